# SPDX-License-Identifier: Apache-2.0
"""What the scheduler asks of a backend: ``n_slots`` fixed cache slots, each holding one sequence.

A slot is started with a prompt (:meth:`SlotBackend.start`), fed one prefill chunk per call
(:meth:`SlotBackend.prefill_step`), then decoded together with the other decoding slots (:meth:`SlotBackend.decode`)
and released. Each slot's sequence is a :class:`~kvexport.runtime.loop.Stream` on that slot's step driver: the one
loop of every runtime, stepped here one tick at a time (:func:`~kvexport.runtime.loop.decode_together` runs the
decoding slots in one batched call where the backend has one). Backends only say which driver a slot runs on and
what they hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np

from kvexport.runtime.loop import Stream, decode_together, host_array

#: how a backend with a batched decode graph uses it: "auto" (timed at start), "batched", "rows" (slot by slot)
DECODE_MODES = ("auto", "batched", "rows")


class SlotBackend(ABC):
    """``n_slots`` sequences at once, each in a cache of fixed size.

    ``limit``: the most positions a sequence may use (prompt + completion); ``evicting``: a press keeps the
    cache at its budget (else the cache is full-size and ``limit`` is its capacity). ``on_compaction(slot,
    where)`` is called after each compaction of a slot (``"prefill:<chunk>"`` / ``"decode:<step>"``)."""

    name = "?"
    n_slots: int
    limit: int
    vocab_size: int
    settings: dict
    on_compaction: Callable[[int, str], None] | None = None

    @abstractmethod
    def driver(self, slot: int):
        """The step driver (:mod:`kvexport.runtime.protocol`, batch 1) slot ``slot`` runs on."""

    @abstractmethod
    def resident_bytes(self) -> dict:
        """``{"per_slot": {kind: bytes}, "slots": n, "shared": {kind: bytes}, "total": bytes}`` from the
        backend's own allocations."""

    def _streams(self) -> dict:
        if not hasattr(self, "_stream_of"):
            self._stream_of: dict[int, Stream] = {}
        return self._stream_of

    def start(self, slot: int, prompt: list[int]) -> int:
        """Empty ``slot`` and queue ``prompt`` (token ids) for prefill; returns the number of chunks."""
        stream = Stream(self.driver(slot), np.asarray([prompt], np.int64),
                        on_compaction=lambda where: self._compacted(slot, where))
        self._streams()[slot] = stream
        return len(stream._chunks)

    def prefill_step(self, slot: int) -> np.ndarray | None:
        """Feed the slot's next prefill chunk; returns the logits (V,) of the prompt's last token after the last
        chunk, else None."""
        logits = self._streams()[slot].prefill_step()
        return None if logits is None else np.asarray(host_array(logits)[0], np.float32).copy()

    def decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One decode step for each of ``slots`` (token ``tokens[j]`` at that slot's next position); returns their
        logits (len(slots), V)."""
        rows = decode_together([self._streams()[r] for r in slots], tokens)
        return np.stack([np.asarray(host_array(x), np.float32) for x in rows])

    def release(self, slot: int) -> None:
        """The slot's sequence is done (its buffers stay allocated for the next one)."""
        self._streams().pop(slot, None)

    def kept_positions(self, slot: int) -> list[np.ndarray]:
        """Per layer: the positions (1, Hc, cap) the slot's cache holds now, -1 = empty (copies)."""
        return [host_array(p).copy() for p in self.driver(slot).kept_positions()]

    def _compacted(self, slot: int, where: str) -> None:
        if self.on_compaction is not None:
            self.on_compaction(slot, where)

    def describe(self) -> str:
        """How decode steps run, in words (the server's start line)."""
        return "decode slot by slot"

    def close(self) -> None:
        """Free what the backend holds (sessions, engines); nothing by default."""
        return None


__all__ = ["DECODE_MODES", "SlotBackend"]
