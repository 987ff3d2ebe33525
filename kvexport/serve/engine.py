# SPDX-License-Identifier: Apache-2.0
"""The scheduler: sequences in, tokens out, over a fixed set of cache slots (in-flight batching).

One thread runs the backend; each *tick* it

1. drops cancelled sequences (their slots are free again at once),
2. admits waiting sequences while slots are free (first come, first served; the rest stay queued),
3. runs one decode step for every sequence past its prefill, all together (one graph call with a
   ``decode_batch`` export), choosing each next token and finishing sequences (``max_tokens``, EOS, a stop string),
4. feeds one prefill chunk of the oldest sequence still in prefill,

so a long prompt costs each tick one chunk and never stalls the streams already decoding. A sequence's first
token comes from its last prefill chunk's logits; it joins the decode steps on the next tick, exactly the order of
calls :meth:`OrtGenerator.generate` makes for one sequence, so each slot holds what a solo run holds.

Events reach the caller through ``publish(events)`` once per tick (the server hands them to its event loop);
each :class:`Event` carries a text piece, the token and, on the last one, the finish reason.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvexport.serve.backends.base import SlotBackend
from kvexport.serve.metrics import Metrics
from kvexport.serve.sampling import SamplingParams, choose
from kvexport.serve.text import TextStream


@dataclass(frozen=True)
class Event:
    """One step of a sequence: ``text`` to send, ``token`` (None on an error), ``finish`` ("stop", "length",
    "error", "cancelled") on the last event, ``error`` (a message) when it failed."""

    text: str
    token: int | None
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """A request for one completion. ``sink(event)`` receives its events (from ``publish``)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop: tuple[str, ...] = ()
    eos: int | None = None  # None: EOS does not end the sequence (ignore_eos)
    sink: Callable[[Event], None] | None = None
    id: int = field(default_factory=itertools.count().__next__)
    state: str = "new"  # new -> queued -> prefill -> decode -> done
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False
    text: TextStream | None = None
    compactions: list[tuple[str, list]] = field(default_factory=list)  # (where, kept positions) with track_kept
    queued_tokens: int = 0  # what it counts in the engine's queue while it waits for a slot

    def __post_init__(self):
        self._rng = self.sampling.rng()


class Engine:
    """``Engine(backend, tokenizer)``: :meth:`submit` sequences, :meth:`cancel` them; :meth:`start` runs the
    scheduler thread, :meth:`stop` ends it (sequences still running finish as "cancelled").

    ``max_queue``: sequences waiting for a slot; ``max_queued_tokens``: their prompt and ``max_tokens`` together
    (:meth:`submit_all` refuses what would pass either, naming which).
    ``track_kept``: keep each sequence's kept positions after every compaction (tests compare them with a solo
    run; costs a copy per compaction)."""

    def __init__(self, backend: SlotBackend, tokenizer, metrics: Metrics | None = None, max_queue: int = 1024,
                 track_kept: bool = False, publish: Callable[[list[tuple[Sequence, Event]]], None] | None = None,
                 max_queued_tokens: int | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics()
        self.max_queue = int(max_queue)
        self.max_queued_tokens = max_queued_tokens
        self._queued_tokens = 0  # prompt + max_tokens of the sequences not yet in a slot (admission)
        self.track_kept = track_kept
        self.publish = publish or _call_sinks
        self._cv = threading.Condition()
        self._incoming: deque[Sequence] = deque()
        self._waiting: deque[Sequence] = deque()
        self._slots: dict[int, Sequence] = {}
        self._free = list(range(backend.n_slots))[::-1]
        self._running = self._stopped = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the scheduler thread, if anything did
        backend.on_compaction = self._on_compaction

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, seq: Sequence) -> bool:
        """Queue ``seq``; False when the queue is full or the engine has stopped."""
        return self.submit_all([seq]) is None

    def submit_all(self, seqs: list[Sequence]) -> str | None:
        """Queue all of ``seqs`` or none: None when queued, else why not ("stopped", "queue": ``max_queue``
        sequences would wait, "tokens": ``max_queued_tokens`` would be passed)."""
        cost = [len(s.prompt) + s.max_tokens for s in seqs]
        with self._cv:
            if self._stopped:
                return "stopped"
            if len(self._incoming) + len(self._waiting) + len(seqs) > self.max_queue:
                return "queue"
            if self.max_queued_tokens is not None and self._queued_tokens + sum(cost) > self.max_queued_tokens:
                return "tokens"
            for seq, c in zip(seqs, cost, strict=True):
                seq.state, seq.queued_tokens = "queued", c
                seq.text = TextStream(self.tokenizer, tuple(seq.stop))
                self._incoming.append(seq)
            self._queued_tokens += sum(cost)
            self._cv.notify()
        return None

    def _unqueue(self, seq: Sequence) -> None:
        """``seq`` no longer waits (it took a slot, or ended before): its tokens leave the queue's count."""
        with self._cv:
            self._queued_tokens -= seq.queued_tokens
            seq.queued_tokens = 0

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` (a client went away); its slot is freed on the next tick."""
        with self._cv:
            seq.cancelled = True
            self._cv.notify()

    def cancel_all(self) -> None:
        """Cancel every sequence, running or queued (the end of a drain)."""
        with self._cv:
            for s in [*self._slots.values(), *self._waiting, *self._incoming]:
                s.cancelled = True
            self._cv.notify()

    def counts(self) -> dict[str, int]:
        with self._cv:
            return {"active_sequences": len(self._slots), "queued_sequences": len(self._incoming) + len(self._waiting),
                    "queued_tokens": self._queued_tokens, "slots": self.backend.n_slots}

    @property
    def alive(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    def start(self) -> "Engine":
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvexport-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._running, self._stopped = False, True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._running and not (self._incoming or self._waiting or self._slots):
                        self._cv.wait(1.0)
                    if not self._running:
                        break
                self.step()
        except BaseException as e:  # noqa: BLE001 - the thread reports why it stopped; the server answers 500
            self.error = e
            print(f"error: the engine stopped: {e.__class__.__name__}: {e}", file=sys.stderr)
        finally:
            self._running, self._stopped = False, True
            leftovers = [(s, Event("", None, "cancelled")) for s in [*self._slots.values(), *self._waiting,
                                                                     *self._incoming]]
            for s, _ in leftovers:
                self._finish(s, "cancelled")
            if leftovers:
                self.publish(leftovers)

    def step(self) -> list[tuple[Sequence, Event]]:
        """Take the sequences submitted so far, run one :meth:`tick` and publish its events (the scheduler thread
        calls this in a loop; a test may call it itself instead of :meth:`start`)."""
        with self._cv:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        events: list[tuple[Sequence, Event]] = []
        self.tick(events)
        if events:
            self.publish(events)
        return events

    def tick(self, events: list[tuple[Sequence, Event]]) -> None:
        """One round of the scheduler (see the module docstring); appends what happened to ``events``."""
        b = self.backend
        gone = [s for s in [*self._slots.values(), *self._waiting] if s.cancelled]
        if gone:
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
            for s in gone:
                self._finish(s, "cancelled")
                self.metrics.count("cancelled")
                events.append((s, Event("", None, "cancelled")))
        while self._free and self._waiting:
            s = self._waiting.popleft()
            self._unqueue(s)
            s.slot = self._free.pop()
            self._slots[s.slot] = s
            s.state = "prefill"
            self._guard(events, [s], lambda s=s: b.start(s.slot, s.prompt))
            self.metrics.prompt_tokens += len(s.prompt)
        made = 0
        dec = [s for s in self._slots.values() if s.state == "decode"]
        if dec:
            logits = self._guard(events, dec, lambda: b.decode([s.slot for s in dec], [s.tokens[-1] for s in dec]))
            if logits is not None:
                self.metrics.decode_steps += 1
                for s, row in zip(dec, logits, strict=True):
                    events.append((s, self._next(s, row)))
                made += len(dec)
        pre = min((s for s in self._slots.values() if s.state == "prefill"), key=lambda s: s.id, default=None)
        if pre is not None:
            logits = self._guard(events, [pre], lambda: b.prefill_step(pre.slot))
            self.metrics.prefill_chunks += 1
            if logits is not None and pre.state == "prefill":
                pre.state = "decode"
                events.append((pre, self._next(pre, logits)))
                made += 1
        self.metrics.tick(made)

    def _next(self, s: Sequence, logits) -> Event:
        """Choose the sequence's next token from its logits (V,) and decide whether it ends there."""
        tok = choose(logits, s.sampling, s._rng)
        s.tokens.append(tok)
        piece = s.text.push(tok)
        finish = None
        if s.eos is not None and tok == s.eos or s.text.stopped:
            finish = "stop"
        elif len(s.tokens) >= s.max_tokens:
            finish = "length"
        if finish is not None:
            piece += s.text.finish()
            self._finish(s, finish)
            self.metrics.count("ok")
        return Event(piece, tok, finish)

    def _guard(self, events, seqs: list[Sequence], fn):
        """Run a backend call for ``seqs``; a failure ends those sequences with an error event (the others go on)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported to the clients of these sequences, one line each
            msg = f"{e.__class__.__name__}: {e}"
            print(f"error: a backend step failed for {len(seqs)} sequence(s): {msg}", file=sys.stderr)
            for s in seqs:
                self._finish(s, "error")
                self.metrics.count("error")
                events.append((s, Event("", None, "error", msg)))
            return None

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish, s.state = reason, "done"
        self._unqueue(s)
        if s.slot is not None and self._slots.get(s.slot) is s:
            del self._slots[s.slot]
            self.backend.release(s.slot)
            self._free.append(s.slot)

    def _on_compaction(self, slot: int, where: str) -> None:
        self.metrics.compactions += 1
        s = self._slots.get(slot)
        if self.track_kept and s is not None:
            s.compactions.append((where, self.backend.kept_positions(slot)))


def _call_sinks(events: list[tuple[Sequence, Event]]) -> None:
    for s, ev in events:
        if s.sink is not None:
            s.sink(ev)


__all__ = ["Engine", "Sequence", "Event"]
