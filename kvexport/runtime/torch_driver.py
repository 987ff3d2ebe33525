# SPDX-License-Identifier: Apache-2.0
"""kvexport's PyTorch path as a step driver: a :class:`~kvexport.models.decoder.Decoder` and a
:class:`~kvexport.cache.static_cache.StaticCache` made for each prompt (the cache applies the plan itself)."""

from __future__ import annotations

import numpy as np
import torch

from kvexport.cache.memory import measure
from kvexport.cache.plan import DEFAULT_WINDOW, CachePlan
from kvexport.errors import BadUsage
from kvexport.runtime.protocol import Driver


class TorchDriver(Driver):
    """``decoder`` with ``press`` (None: a full cache that never evicts), ``window`` decode slots, prefill ``chunk``
    (None: the prompt at once), ``batch`` rows.

    Budgets: ``press.layer_budgets`` of the prompt's real length; without a press the cache holds ``capacity``
    tokens (default: the prompt plus the stream's new tokens). ``kv_dtype``: how the cache stores K/V
    (:mod:`kvexport.cache.formats`; default the model's dtype). ``tie_break``: the cache's hook to choose among
    near-equal scores (:class:`kvexport.export.ties.TieReferee`). ``lookahead`` L (with a press and ``chunk``): the
    prompt's last L columns observe every earlier chunk (kvexport.cache.plan rule 3b); refused for a press that
    scores without observation queries (its ``observes`` is False)."""

    def __init__(self, decoder, press=None, window: int = DEFAULT_WINDOW, chunk: int | None = None,
                 capacity: int | None = None, kv_dtype: str | None = None, batch: int = 1, tie_break=None,
                 lookahead: int = 0):
        if press is not None and window < 1:
            raise BadUsage(f"window {window} must be >= 1")
        if chunk is not None and chunk < 1:
            raise BadUsage(f"chunk {chunk} must be >= 1")
        if kv_dtype is not None:
            from kvexport.cache.formats import kv_format

            kv_format(kv_dtype)  # one line if unknown, before any work
        if int(lookahead) < 0:
            raise BadUsage(f"lookahead {lookahead} must be >= 0")
        if lookahead and press is not None and not press.observes:
            raise BadUsage(f"--lookahead: {press.name} scores without observation queries, so a lookahead tail changes "
                           "nothing; use it with snapkv, pyramidkv, tova, expected_attention or observed_attention")
        self.decoder, self.press, self.window, self.chunk = decoder, press, int(window), chunk
        self.capacity, self.kv_dtype, self.batch, self.tie_break = capacity, kv_dtype, int(batch), tie_break
        self.lookahead = int(lookahead) if press is not None else 0
        self.cache = None
        self.device = next(decoder.parameters()).device

    limit_text = "the model's {limit} positions (max_position_embeddings)"

    @property
    def max_positions(self) -> int | None:
        """The model's position range: a longer prompt is refused, as an export of it refuses it."""
        return int(self.decoder.spec.max_position_embeddings) or None

    @property
    def plan(self) -> CachePlan:
        if self.cache is None:
            raise BadUsage("the PyTorch cache is made for a prompt; start a stream first")
        return self.cache.plan

    def start(self, mask: np.ndarray, new_tokens: int | None) -> None:
        N = mask.shape[1]
        L = self.decoder.spec.num_layers
        if self.press is None:
            budgets, window = [int(self.capacity or N + int(new_tokens or 1))] * L, 0
        else:
            budgets, window = self.press.layer_budgets(L, int(mask.sum(-1).max())), self.window
            if hasattr(self.press, "reset"):
                self.press.reset()
        self.cache = None  # the last prompt's buffers go before the next one's are made
        cache = self.decoder.new_cache(self.batch, self.press, budgets, window, self.chunk, lookahead=self.lookahead)
        if self.kv_dtype is not None:
            cache.set_kv_dtype(self.kv_dtype, self.decoder)
        if self.tie_break is not None:
            cache.tie_break = self.tie_break
        self.cache = cache

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    @torch.no_grad()
    def prefill_chunk(self, ids: np.ndarray, positions: np.ndarray, chunk, tail=None) -> tuple[torch.Tensor, bool]:
        before = self.cache.compactions
        observe = {} if tail is None else {"tail_ids": self._tensor(tail[0]), "tail_positions": self._tensor(tail[1])}
        logits = self.decoder(self._tensor(ids), self._tensor(positions), self.cache, mode="prefill",
                              last_only=True, **observe)
        return logits[:, -1], self.cache.compactions > before

    @torch.no_grad()
    def decode(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, bool]:
        before = self.cache.compactions
        logits = self.decoder(self._tensor(tokens)[:, None], self._tensor(positions)[:, None], self.cache,
                              mode="decode")
        return logits[:, -1], self.cache.compactions > before

    def kept_positions(self) -> list[torch.Tensor]:
        return self.cache.kept_positions()

    def resident_bytes(self) -> dict[str, int]:
        """What the cache holds (:meth:`kvexport.cache.static_cache.StaticCache.resident_bytes`); nothing before a
        prompt."""
        return self.cache.resident_bytes() if self.cache is not None else measure({})

    def close(self) -> None:
        self.cache = None


class TorchBatch:
    """Decode steps of several :class:`TorchDriver` s (each its own batch-1 cache) in one batched forward
    (:meth:`kvexport.models.decoder.Decoder.decode_caches`): the host that
    :func:`kvexport.runtime.loop.decode_together` calls for drivers whose ``host`` it is. ``batch_from``: the fewest
    decoding drivers that go through it (fewer decode one by one)."""

    def __init__(self, decoder, batch_from: int = 2):
        self.decoder = decoder
        self.batch_from = max(1, int(batch_from))

    def batches(self, n: int) -> bool:
        return n >= self.batch_from

    @torch.no_grad()
    def decode_slots(self, drivers: list[TorchDriver], tokens: np.ndarray, positions: np.ndarray) -> list:
        """One decode step of every driver (token ``tokens[j]`` at ``positions[j]``) -> per driver (logits (1, V),
        compacted)."""
        caches = [d.cache for d in drivers]
        if any(c is None for c in caches):
            raise BadUsage("the PyTorch cache is made for a prompt; start a stream first")
        before = [c.compactions for c in caches]
        dev = drivers[0].device
        ids = torch.as_tensor(np.asarray(tokens, np.int64).reshape(-1, 1), device=dev)
        pos = torch.as_tensor(np.asarray(positions, np.int64).reshape(-1, 1), device=dev)
        logits = self.decoder.decode_caches(ids, pos, caches)[:, -1]
        return [(logits[j : j + 1], c.compactions > b) for j, (c, b) in enumerate(zip(caches, before, strict=True))]


__all__ = ["TorchDriver", "TorchBatch"]
