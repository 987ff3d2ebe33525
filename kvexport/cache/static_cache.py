# SPDX-License-Identifier: Apache-2.0
"""A KV cache of fixed capacity per layer, kept full of the tokens a press scores highest.

Layout of one layer (``Hc`` cache heads: the KV heads, or 1 for an MLA latent):

    slots [0, budget)             kept tokens, in position order
    slots [budget, budget+window) recent tokens appended while decoding
    k (B, Hc, cap, Dk)   v (B, Hc, cap, Dv)   pos (B, Hc, cap) int64, -1 = empty / padding

Rules (the exported graphs follow the same ones):
- ``prefill(chunk of T tokens)``: candidates = occupied slots + the chunk. If there are more than
  ``budget`` of them, the press scores all candidates (observation queries = the chunk's queries),
  top-``budget`` per (batch, head) are kept in position order in slots [0, budget). A single-shot
  prefill is one chunk holding the whole prompt: that is the mode that matches kvpress.
- ``decode(T tokens)``: appended at slot ``fill``. When any layer has filled its capacity, every
  layer is compacted back to its budget: the press scores all slots, observation queries = the last
  ``window`` decoded tokens' queries (kept in a small buffer).
- Keys keep the RoPE of their true position; empty and padding slots are never attended and never
  chosen while a valid candidate remains. Memory is fixed when the cache is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvexport.errors import BadUsage


def select_kept(scores: torch.Tensor, positions: torch.Tensor, n_keep: int) -> torch.Tensor:
    """scores, positions (B, Hc, S) -> slot indices (B, Hc, n_keep) of the best, ascending.

    Invalid candidates (position < 0) score -inf; ties go to the lower slot (ONNX TopK's rule, so the
    exported graphs choose the same set); ascending slot order = position order.
    """
    scores = scores.float().masked_fill(positions < 0, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :n_keep].sort(dim=-1).values


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, Hc, S, D) or (B, Hc, S), idx (B, Hc, K) -> (B, Hc, K, D) or (B, Hc, K)."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


@dataclass
class ScoreContext:
    """What a press needs from the layer besides the cache: how to rotate queries and the softmax scale."""

    rotary: object  # kvexport.models.rope.Rotary (or MLA's partial rotary)
    scaling: float
    layer_idx: int
    num_layers: int


class LayerCache:
    """Fixed buffers of one layer; see the module docstring for the layout."""

    def __init__(self, batch, heads, key_dim, value_dim, q_heads, q_dim, budget, window, dtype, device, ctx):
        if budget < 1 or window < 1:
            raise BadUsage(f"budget ({budget}) and window ({window}) must be >= 1")
        self.budget, self.window, self.capacity = budget, window, budget + window
        cap = self.capacity
        self.k = torch.zeros(batch, heads, cap, key_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, heads, cap, value_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, heads, cap), -1, dtype=torch.long, device=device)
        self.qbuf = torch.zeros(batch, q_heads, window, q_dim, dtype=dtype, device=device)
        self.qpos = torch.full((batch, window), -1, dtype=torch.long, device=device)
        self.qhead = 0  # ring buffer: slot of the oldest observation query (the next one written)
        self.fill = 0
        self.ctx = ctx

    def occupied(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.fill
        return self.k[:, :, :f], self.v[:, :, :f], self.pos[:, :, :f]

    def _write(self, start: int, k, v, pos) -> None:
        """Write n slots at ``start``; fill = start + n. Slots past ``fill`` always hold position -1."""
        n = k.shape[2]
        self.k[:, :, start : start + n] = k
        self.v[:, :, start : start + n] = v
        self.pos[:, :, start : start + n] = pos
        if start + n < self.fill:  # a compaction shrank the occupied range: empty the rest
            self.pos[:, :, start + n : self.fill] = -1
        self.fill = start + n

    def _push_queries(self, q_score: torch.Tensor, q_positions: torch.Tensor) -> None:
        """Keep the last ``window`` observation queries (B, Hq, W, Dq) and their positions, in place."""
        W = self.window
        n = min(q_score.shape[2], W)
        slots = (self.qhead + torch.arange(n, device=self.qbuf.device)) % W
        self.qbuf[:, :, slots] = q_score[:, :, -n:]
        self.qpos[:, slots] = q_positions[:, -n:]
        self.qhead = (self.qhead + n) % W

    def observation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffered queries (B, Hq, W, Dq) and positions (B, W), oldest first."""
        order = (self.qhead + torch.arange(self.window, device=self.qbuf.device)) % self.window
        return self.qbuf[:, :, order], self.qpos[:, order]

    def compact_candidates(self, press, k, v, pos, queries, q_positions) -> None:
        """Score candidates k/v/pos (B, Hc, S, .) with observation queries; keep budget in slots [0, budget)."""
        from kvexport.presses.base import ScoreInputs

        S = k.shape[2]
        if S <= self.budget:
            self._write(0, k, v, pos)
            return
        inputs = ScoreInputs(
            keys=k,
            values=v,
            positions=pos,
            queries=queries,
            query_positions=q_positions,
            rotary=self.ctx.rotary,
            scaling=self.ctx.scaling,
            layer_idx=self.ctx.layer_idx,
            num_layers=self.ctx.num_layers,
            n_keep=self.budget,
        )
        scores = press.score(inputs)
        idx = select_kept(scores, pos, self.budget)
        self._write(0, gather_slots(k, idx), gather_slots(v, idx), gather_slots(pos, idx))

    def prefill(self, press, k_new, v_new, new_pos, q_score, q_positions) -> None:
        """A chunk: k_new, v_new (B, Hc, T, D), new_pos (B, Hc, T), q_score (B, Hq, T, Dq), q_positions (B, T)."""
        k0, v0, p0 = self.occupied()
        k = torch.cat([k0, k_new], dim=2)
        v = torch.cat([v0, v_new], dim=2)
        pos = torch.cat([p0, new_pos], dim=2)
        self.compact_candidates(press, k, v, pos, q_score, q_positions)
        self._push_queries(q_score, q_positions)

    def append(self, k_new, v_new, new_pos, q_score, q_positions) -> None:
        T = k_new.shape[2]
        if self.fill + T > self.capacity:
            raise BadUsage(f"decode of {T} tokens does not fit: {self.fill} of {self.capacity} slots used")
        self._write(self.fill, k_new, v_new, new_pos)
        self._push_queries(q_score, q_positions)

    def compact(self, press) -> None:
        """Decode-time compaction over all occupied slots, observed by the last ``window`` queries."""
        k, v, pos = self.occupied()
        self.compact_candidates(press, k, v, pos, *self.observation())


class StaticCache:
    """One :class:`LayerCache` per layer, all made at once; capacity never changes.

    Build it with :meth:`kvexport.models.decoder.Decoder.new_cache`.
    """

    def __init__(self, layers: list[LayerCache], press):
        self.layers = layers
        self.press = press
        self.compactions = 0

    @property
    def budgets(self) -> list[int]:
        return [layer.budget for layer in self.layers]

    @property
    def window(self) -> int:
        return self.layers[0].window

    def is_full(self) -> bool:
        return any(layer.fill >= layer.capacity for layer in self.layers)

    def compact(self) -> None:
        for layer in self.layers:
            layer.compact(self.press)
        self.compactions += 1

    def nbytes(self) -> int:
        """Bytes of the K/V buffers (what a deployment keeps resident)."""
        return sum(layer.k.numel() * layer.k.element_size() + layer.v.numel() * layer.v.element_size()
                   for layer in self.layers)

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer: positions (B, Hc, fill) of the occupied slots (-1 = padding)."""
        return [layer.pos[:, :, : layer.fill].clone() for layer in self.layers]

