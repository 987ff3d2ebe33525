# SPDX-License-Identifier: Apache-2.0
"""The one greedy loop and the one prefill driver, for every runtime.

:class:`Stream` is a batch of prompts in flight on a step driver (:mod:`kvexport.runtime.protocol`): it numbers the
prompt's positions (plan rule 1), feeds it chunk by chunk with a short last chunk front-padded where the driver's
chunk width is static (rule 2), each earlier chunk with its lookahead tail where the plan has one (rule 3b), then one decode step per call at each row's next position, and names every
compaction (``"prefill:<chunk>"``, ``"decode:<step>"``). :func:`generate` runs a stream to the end greedily (or
teacher-forced), which is what ``kvexport generate``, validation, the profiler, the studies and the benchmarks
call; the server steps one stream per slot, its decoding slots together (:func:`decode_together`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvexport.cache.plan import next_positions, positions_from_mask
from kvexport.errors import BadUsage


def host_array(x) -> np.ndarray:
    """A NumPy view or copy of ``x`` (a NumPy array, a torch tensor on any device, a list)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def check_prompt(input_ids, attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """input_ids (B, N) (or (N,)), attention_mask (B, N) 0/1 left padded or None -> both as int64 NumPy arrays;
    one line for an empty prompt or a row of padding only."""
    ids = host_array(input_ids).astype(np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0 or ids.shape[1] == 0:
        raise BadUsage("the prompt is empty; give at least one token")
    mask = np.ones_like(ids) if attention_mask is None else host_array(attention_mask).astype(np.int64).reshape(ids.shape)
    if (mask.sum(-1) == 0).any():
        raise BadUsage("a prompt row is all padding; give at least one token per row")
    return ids, mask


def greedy(logits) -> np.ndarray:
    """logits (B, V) of any kind -> (B,) int64: the lowest index among equal maxima."""
    return host_array(logits.argmax(-1)).astype(np.int64).reshape(-1)


@dataclass
class GenerationResult:
    """What :func:`generate` returns. Logits and kept positions are in the driver's kind (torch / NumPy)."""

    tokens: Any  # (B, n_new) generated (or forced) ids
    prompt_logits: Any  # (B, V) at the last prompt token
    step_logits: list = field(default_factory=list)  # per decode step (B, V), with keep_logits
    kept_positions: list = field(default_factory=list)  # per compaction, per layer (B, Hc, slots), with track_kept
    compaction_steps: list[str] = field(default_factory=list)  # "prefill:<chunk>" / "decode:<step>"
    compactions: int = 0
    cache_bytes: int = 0  # K/V (or latent) storage held
    resident_bytes: dict[str, int] = field(default_factory=dict)  # every buffer the driver holds, by kind
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)  # wall time of each decode step (with its compaction)
    ties_resolved: int = 0  # PyTorch path: compactions where ``tie_break`` chose among equal scores


class Stream:
    """A batch of prompts in flight on ``driver``: :meth:`prefill_step` feeds one chunk, :meth:`decode` one token
    per row. ``new_tokens``: how many tokens the stream will produce (the first from the prefill), when known: a
    full cache is checked (and sized, or bucketed) for the prompt plus them. ``on_compaction(where)`` is called
    after each compaction."""

    def __init__(self, driver, input_ids, attention_mask=None, new_tokens: int | None = None,
                 on_compaction: Callable[[str], None] | None = None):
        ids, mask = check_prompt(input_ids, attention_mask)
        if ids.shape[0] != driver.batch:
            raise BadUsage(f"this export takes batches of {driver.batch} prompt(s), got {ids.shape[0]}")
        limit = getattr(driver, "max_positions", None)  # the positions a prompt may take, on every runtime
        n = int(mask.sum(-1).max())
        if limit and n > limit:
            raise BadUsage(f"prompt of {n} tokens exceeds " + driver.limit_text.format(limit=limit))
        self.driver = driver
        self.on_compaction = on_compaction
        self.positions = positions_from_mask(mask)  # rule 1
        driver.start(mask, new_tokens)
        driver.plan.check_fits(ids.shape[1], max(int(new_tokens or 1) - 1, 0))
        self._ids = ids
        self._chunks = deque(enumerate(driver.plan.chunks(ids.shape[1])))  # rule 2
        self.next_pos = next_positions(self.positions)  # (B,) position of each row's next token
        self.steps = 0  # decode steps so far
        self.compactions = 0

    @classmethod
    def resume(cls, driver, next_positions: np.ndarray, on_compaction: Callable[[str], None] | None = None) -> "Stream":
        """A stream on a cache the driver already holds (e.g. a benchmark's synthesised one,
        ``driver.synthesize``): nothing to prefill, the rows' next positions ``next_positions`` (B,)."""
        self = cls.__new__(cls)
        self.driver, self.on_compaction = driver, on_compaction
        self.positions, self._ids, self._chunks = None, None, deque()
        self.next_pos = np.asarray(next_positions, np.int64).reshape(driver.batch).copy()
        self.steps = self.compactions = 0
        return self

    @property
    def prefilling(self) -> bool:
        return bool(self._chunks)

    def prefill_step(self):
        """Feed the next chunk; -> the logits (B, V) of the prompt's last token after the last chunk, else None."""
        index, chunk = self._chunks.popleft()
        B, pad = self._ids.shape[0], chunk.pad
        ids = np.concatenate([np.zeros((B, pad), np.int64), self._ids[:, chunk.start:chunk.stop]], axis=1)
        pos = np.concatenate([np.full((B, pad), -1, np.int64), self.positions[:, chunk.start:chunk.stop]], axis=1)
        tail = None
        if chunk.has_tail:  # rule 3b: the prompt's last columns observe this chunk, front-padded to a static width
            tp = chunk.tail_pad
            tail = (np.concatenate([np.zeros((B, tp), np.int64), self._ids[:, chunk.tail_start:chunk.tail_stop]], 1),
                    np.concatenate([np.full((B, tp), -1, np.int64),
                                    self.positions[:, chunk.tail_start:chunk.tail_stop]], 1))
        logits, compacted = self.driver.prefill_chunk(ids, pos, chunk, tail)
        if compacted:
            self._compacted(f"prefill:{index}")
        if self._chunks:
            return None
        self._ids = None
        return logits

    def prefill(self):
        """Feed every chunk left; -> the logits (B, V) of the prompt's last token."""
        while True:
            logits = self.prefill_step()
            if logits is not None:
                return logits

    def decode(self, tokens):
        """One token per row, ``tokens`` (B,) (an int for batch 1), at each row's next position -> logits (B, V)."""
        if self._chunks:
            raise BadUsage("decode before the prompt is fed; run the prefill first")
        tok = np.asarray(tokens, dtype=np.int64).reshape(self.driver.batch)
        logits, compacted = self.driver.decode(tok, self.next_pos.copy())
        self.advance(compacted)
        return logits

    def advance(self, compacted: bool) -> None:
        """After a decode step (run here or by :func:`decode_together`): name its compaction, move the positions."""
        if compacted:
            self._compacted(f"decode:{self.steps}")
        self.steps += 1
        self.next_pos = self.next_pos + 1

    def _compacted(self, where: str) -> None:
        self.compactions += 1
        if self.on_compaction is not None:
            self.on_compaction(where)


def decode_together(streams: list[Stream], tokens: list[int]) -> list:
    """One decode step of several batch-1 streams -> their logits (V,) each. Streams whose drivers are slots of one
    host with a batched decode step (``driver.host.decode_slots``) run it in one call; others step one by one."""
    host = getattr(streams[0].driver, "host", None)
    if host is not None and all(getattr(s.driver, "host", None) is host for s in streams) and \
            host.batches(len(streams)):
        for s in streams:
            if s.prefilling:
                raise BadUsage("decode before the prompt is fed; run the prefill first")
        got = host.decode_slots([s.driver for s in streams], np.asarray(tokens, np.int64),
                                np.array([int(s.next_pos[0]) for s in streams], np.int64))
        out = []
        for s, (logits, compacted) in zip(streams, got, strict=True):
            s.advance(compacted)
            out.append(logits[0])
        return out
    return [s.decode(int(t))[0] for s, t in zip(streams, tokens, strict=True)]


def generate(driver, input_ids, attention_mask=None, max_new_tokens: int = 32, eos_token_id: int | None = None,
             forced_tokens=None, keep_logits: bool = False, track_kept: bool = False,
             on_compaction: Callable[[str], None] | None = None) -> GenerationResult:
    """Greedy decoding on ``driver``: the prompt ``input_ids`` (B, N) (``attention_mask`` (B, N), left padded), then
    up to ``max_new_tokens`` tokens (the first from the prompt's logits), a row ending at ``eos_token_id`` (padded
    with it until every row has ended).

    ``forced_tokens`` (B, n): feed these instead of the argmax (teacher forcing). ``keep_logits``: keep every decode
    step's logits (memory grows with the steps). ``track_kept``: copy the kept positions after each compaction.
    ``on_compaction(where)``: called after each compaction."""
    if int(max_new_tokens) < 1:
        raise BadUsage(f"max_new_tokens {max_new_tokens} must be >= 1")
    res = GenerationResult(tokens=None, prompt_logits=None)
    t0 = time.perf_counter()
    stream = Stream(driver, input_ids, attention_mask, new_tokens=int(max_new_tokens),
                    on_compaction=_tracker(driver, res, track_kept, on_compaction))
    last = stream.prefill()
    res.prefill_seconds = time.perf_counter() - t0
    return _decode_loop(stream, last, res, max_new_tokens, eos_token_id, forced_tokens, keep_logits)


def generate_from(stream: Stream, logits, max_new_tokens: int, eos_token_id: int | None = None, forced_tokens=None,
                  keep_logits: bool = False, track_kept: bool = False) -> GenerationResult:
    """:func:`generate`'s decoding on a stream whose prompt is fed already (:meth:`Stream.resume`), the first token
    chosen from ``logits`` (B, V)."""
    res = GenerationResult(tokens=None, prompt_logits=logits)
    stream.on_compaction = _tracker(stream.driver, res, track_kept, stream.on_compaction)
    return _decode_loop(stream, logits, res, max_new_tokens, eos_token_id, forced_tokens, keep_logits)


def _tracker(driver, res: GenerationResult, track_kept: bool, then):
    def compacted(where: str) -> None:
        if track_kept:
            res.kept_positions.append(driver.kept_positions())
            res.compaction_steps.append(where)
        if then is not None:
            then(where)

    return compacted


def _decode_loop(stream: Stream, last, res: GenerationResult, max_new_tokens: int, eos_token_id, forced_tokens,
                 keep_logits: bool) -> GenerationResult:
    """The greedy loop: choose (or force) a token per row, stop at ``max_new_tokens`` or when every row has ended,
    else decode it."""
    res.prompt_logits = last
    forced = None if forced_tokens is None else host_array(forced_tokens).astype(np.int64)
    done = np.zeros(stream.driver.batch, bool)
    out = []
    for step in range(int(max_new_tokens)):
        tok = greedy(last) if forced is None else forced[:, step]
        if eos_token_id is not None:
            tok = np.where(done, eos_token_id, tok)
            done |= tok == eos_token_id
        out.append(tok)
        if step == max_new_tokens - 1 or (eos_token_id is not None and done.all()):
            break
        t1 = time.perf_counter()
        last = stream.decode(tok)
        res.decode_seconds.append(time.perf_counter() - t1)
        if keep_logits:
            res.step_logits.append(last)
    res.tokens = np.stack(out, axis=1)
    res.compactions = stream.compactions
    res.resident_bytes = stream.driver.resident_bytes()
    res.cache_bytes = int(res.resident_bytes["kv"])
    return res


__all__ = ["GenerationResult", "Stream", "generate", "generate_from", "decode_together", "check_prompt", "greedy",
           "host_array"]
