# SPDX-License-Identifier: Apache-2.0
"""The step protocol: what the one loop (:mod:`kvexport.runtime.loop`) asks of a runtime.

A driver runs one batch of ``batch`` rows on one cache whose static shape is its :attr:`~StepDriver.plan`
(:class:`~kvexport.cache.plan.CachePlan`). It is thin: where each token goes, when the cache is compacted and how a
prompt is chunked are the plan's rules, applied by the driver's :class:`~kvexport.cache.plan.CacheState` (PyTorch:
the :class:`~kvexport.cache.static_cache.StaticCache`; graphs: :class:`kvexport.runtime.host.GraphHost`, the one
host for onnxruntime and TensorRT). The loop owns the rest: the prompt's positions, the chunks, the decode steps,
token choice and the names of compactions.

Drivers: :class:`kvexport.runtime.torch_driver.TorchDriver` (the PyTorch library path),
:class:`kvexport.runtime.onnxruntime.OrtGenerator` (an export on onnxruntime),
:class:`kvexport.runtime.growing.GrowingPast` (the ``--dynamic-cache`` baseline) and
:class:`kvexport.tensorrt.generator.TrtGenerator` (an export's engines); the server's slots are drivers over rows
of one host (:meth:`kvexport.runtime.slots.SlotBank.slot`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvexport.cache.plan import CachePlan, Chunk
from kvexport.runtime.loop import generate


class StepDriver(Protocol):
    """One batch on one cache, a step at a time. Arrays in are NumPy (host side); logits come back in the driver's
    own kind (torch tensors for PyTorch, NumPy arrays for the graph runtimes)."""

    batch: int  # rows of a step
    #: the positions a prompt may take (an export's ``max_positions``, the model's position range), None: no bound;
    #: the loop refuses a longer prompt with "prompt of N tokens exceeds " + ``limit_text.format(limit=...)``
    max_positions: int | None
    limit_text: str

    @property
    def plan(self) -> CachePlan:
        """The cache's static shape (valid after :meth:`start`: a PyTorch cache is made for its prompt)."""

    def start(self, mask: np.ndarray, new_tokens: int | None) -> None:
        """Empty the cache for a prompt with attention mask ``mask`` (B, N) (left padded) that will be followed by
        ``new_tokens`` tokens (None: unknown; a full cache may size or bucket itself by it)."""

    def prefill_chunk(self, ids: np.ndarray, positions: np.ndarray, chunk: Chunk,
                      tail: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[Any, bool]:
        """Feed one prompt chunk (B, ``chunk.width``), front-padded as the plan says (id 0, position -1) ->
        (logits (B, V) of its last column, whether the cache was compacted). ``tail``: where the plan has a lookahead
        (rule 3b), the ids and positions (B, ``chunk.tail_pad`` + its columns) of the prompt's last columns, which
        observe the chunk and are not stored; None otherwise."""

    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[Any, bool]:
        """One token per row, ``tokens`` (B,) at ``positions`` (B,) -> (its logits (B, V), whether the cache was
        compacted after it). A full press-free cache refuses a token that does not fit
        (:class:`~kvexport.cache.plan.CacheFull`)."""

    def kept_positions(self) -> list[Any]:
        """Per layer: the positions (B, Hc, slots) the cache holds now, -1 = empty (copies)."""

    def resident_bytes(self) -> dict[str, int]:
        """Every byte the driver holds for its batch, by kind (:func:`kvexport.cache.memory.measure`)."""

    def close(self) -> None:
        """Free what the driver holds (sessions, engines, buffers); it is not usable afterwards."""

    def __enter__(self) -> "StepDriver": ...

    def __exit__(self, *exc) -> None: ...


class Driver:
    """What every driver shares: a context manager that closes it (``with driver: ...``), :meth:`generate`, and the
    prompt's bound (:attr:`max_positions`, an export's ``max_positions`` here; the loop applies it)."""

    limit_text = "the export's maximum {limit} (max_positions)"

    @property
    def max_positions(self) -> int | None:
        settings = getattr(self, "settings", None) or {}
        return int(settings.get("max_positions") or 0) or None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        return None

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 32, eos_token_id: int | None = None,
                 forced_tokens=None, track_kept: bool = True, keep_logits: bool = False):
        """:func:`kvexport.runtime.loop.generate` on this driver (kept positions tracked by default)."""
        return generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, forced_tokens, keep_logits,
                        track_kept)


__all__ = ["StepDriver", "Driver"]
