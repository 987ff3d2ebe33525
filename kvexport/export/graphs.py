# SPDX-License-Identifier: Apache-2.0
"""The exportable graphs: a prefill chunk, a one-token decode step, a compaction, and the growing-past baseline.

Each wraps a :class:`~kvexport.models.decoder.Decoder` with fixed shapes (batch B, chunk C, per-layer capacity
cap_i = budget_i + window W) and follows :mod:`kvexport.cache.plan`: the host keeps the plan's
:class:`~kvexport.cache.plan.CacheState` and passes its numbers in (fill counts, slots, ring indices), so the
graphs have no data-dependent control flow, and what a compaction keeps is :func:`kvexport.cache.candidates.keep_best`,
the function the PyTorch cache runs. Cache tensors are graph inputs ``<name>_in`` and outputs ``<name>_out`` of
identical shapes, per layer i: ``k_i (B, Hc, cap_i, Dk)``, ``v_i (B, Hc, cap_i, Dv)``, ``pos_i (B, Hc, cap_i)`` int64
(-1 = empty); with a press also the query ring ``qbuf_i (B, Hq, W, Dq)`` and one shared ``qpos (B, W)``:

- prefill (``fill (L,)``, ``n_pad (1,)``): C columns, the first ``n_pad`` of them padding (plan rule 2); the
  candidates [occupied ; real columns] are kept by the press (top budget_i) or, without one, written at ``fill``.
  Reads and writes k/v/pos only (the prefill never writes the ring).
- decode (``slot (L,)``, with a press ``query_slot (1,)``): the token written at ``slot_i``, its query at
  ``query_slot`` of the ring.
- compact (``fill (L,)``, ``query_start (1,)``): every layer's occupied slots scored with the ring read oldest
  first; outputs k/v/pos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvexport.cache.candidates import keep_best
from kvexport.cache.static_cache import ScoreContext
from kvexport.export import ops


@dataclass(frozen=True)
class LayerShape:
    """Cache shape of one layer."""

    heads: int  # Hc
    key_dim: int
    value_dim: int
    q_heads: int
    q_dim: int
    budget: int
    capacity: int


def layer_shapes(decoder, budgets: list[int], window: int) -> list[LayerShape]:
    out = []
    for b, layer in zip(budgets, decoder.layers, strict=True):
        a = layer.self_attn
        out.append(LayerShape(a.cache_heads, a.key_dim, a.value_dim, a.num_heads,
                              getattr(a, "score_dim", a.head_dim), b, b + window))
    return out


def kv_names(n_layers: int, suffix: str) -> list[str]:
    """Graph I/O names of the K/V/position tensors, in graph order."""
    return [f"{t}_{i}{suffix}" for i in range(n_layers) for t in ("k", "v", "pos")]


def query_names(n_layers: int, suffix: str) -> list[str]:
    """Graph I/O names of the query ring, in graph order."""
    return [f"qbuf_{i}{suffix}" for i in range(n_layers)] + [f"qpos{suffix}"]


class _CacheGraph(nn.Module):
    def __init__(self, decoder, press, budgets: list[int], window: int):
        super().__init__()
        self.decoder = decoder
        self.press = press
        self.budgets = list(budgets)
        self.window = int(window)
        self.shapes = layer_shapes(decoder, self.budgets, self.window)

    def split_kv(self, cache):
        """Flat k/v/pos tuple -> per-layer (k, v, pos)."""
        return [tuple(cache[3 * i : 3 * i + 3]) for i in range(len(self.shapes))]

    def make_inputs(self, i: int):
        attn = self.decoder.layers[i].self_attn
        ctx = ScoreContext(rotary=getattr(attn, "score_rotary", attn.rotary), scaling=attn.scaling, layer_idx=i,
                           num_layers=len(self.shapes), sliding_window=getattr(attn, "sliding_window", None))
        return ctx.inputs(self.shapes[i].budget)

    def keep(self, i: int, k, v, pos, queries, q_positions, fill, n_pad):
        """Raw layout [cache (cap_i) ; columns] -> the layer's cache (B, Hc, cap_i, .) (plan rules 3 and 5)."""
        s = self.shapes[i]
        if self.press is None:
            return keep_best(None, None, k, v, pos, None, None, fill, n_pad, s.capacity, s.capacity, s.capacity)
        return keep_best(self.press, self.make_inputs(i), k, v, pos, queries, q_positions, fill, n_pad, s.capacity,
                         s.budget, s.capacity, topk=ops.topk_gather)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder.norm(h))


class PrefillChunk(_CacheGraph):
    """One chunk of exactly C columns, the first ``n_pad`` padding (position -1).

    Inputs: input_ids (B, C) int64, positions (B, C) int64, fill (L,) int64, n_pad (1,) int64, then k/v/pos of
    every layer. Outputs: logits (B, V) of the last column, then k/v/pos.
    """

    def forward(self, input_ids, positions, fill, n_pad, *cache):
        B, C = input_ids.shape
        h = self.decoder.embed_tokens(input_ids)
        out = []
        for i, (layer, (k, v, pos)) in enumerate(zip(self.decoder.layers, self.split_kv(cache), strict=True)):
            h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)
            new_pos = positions[:, None, :].expand(B, k_new.shape[1], C)
            q_score = layer.self_attn.score_queries(q_pre) if self.press is not None else None
            out += list(self.keep(i, torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2),
                                  torch.cat([pos, new_pos], dim=2), q_score, positions, fill[i], n_pad[0]))
        return (self.head(h[:, -1]), *out)


class DecodeStep(_CacheGraph):
    """One token per row. Inputs: input_ids (B, 1), positions (B, 1), slot (L,) int64, with a press query_slot (1,)
    int64, then k/v/pos of every layer (and the ring). Outputs: logits (B, V), then the same tensors with the
    token written at slot_i (and its query at query_slot)."""

    def forward(self, input_ids, positions, slot, *rest):
        query_slot, cache = (rest[0], rest[1:]) if self.press is not None else (None, rest)
        L = len(self.shapes)
        h = self.decoder.embed_tokens(input_ids)
        out, ring = [], []
        for i, (layer, (k, v, pos)) in enumerate(zip(self.decoder.layers, self.split_kv(cache), strict=True)):
            h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)
            hot = torch.arange(k.shape[2], device=k.device) == slot[i]  # (cap,)
            out.append(torch.where(hot[None, None, :, None], k_new, k))
            out.append(torch.where(hot[None, None, :, None], v_new, v))
            out.append(torch.where(hot[None, None, :], positions[:, None, :], pos))
            if self.press is not None:
                qhot = torch.arange(self.window, device=k.device) == query_slot[0]  # (W,)
                q_score = layer.self_attn.score_queries(q_pre)
                ring.append(torch.where(qhot[None, None, :, None], q_score, cache[3 * L + i]))
        if self.press is not None:
            qhot = torch.arange(self.window, device=input_ids.device) == query_slot[0]
            ring.append(torch.where(qhot[None, :], positions, cache[4 * L]))
        return (self.head(h[:, -1]), *out, *ring)


class Compact(_CacheGraph):
    """Decode-time compaction of every layer: all slots scored with the ring read oldest first.
    Inputs: fill (L,) int64, query_start (1,) int64, then k/v/pos of every layer and the ring. Outputs: k/v/pos."""

    def forward(self, fill, query_start, *cache):
        L = len(self.shapes)
        order = torch.remainder(query_start[0] + torch.arange(self.window, device=fill.device), self.window)
        qpos = cache[4 * L].index_select(1, order)
        out = []
        for i, (k, v, pos) in enumerate(self.split_kv(cache)):
            queries = cache[3 * L + i].index_select(2, order)
            out += list(self.keep(i, k, v, pos, queries, qpos, fill[i], 0))
        return tuple(out)


class GrowingPast(nn.Module):
    """The full-cache baseline with a growing past (the way Optimum exports decoders).

    Inputs: input_ids (B, T), positions (B, T), past_positions (B, P), then past k_i, v_i (B, Hkv, P, D).
    Outputs: logits (B, V) of the last column, present_positions (B, P+T), present k_i, v_i (B, Hkv, P+T, D).
    """

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, positions, past_positions, *past):
        B, T = input_ids.shape
        h = self.decoder.embed_tokens(input_ids)
        present = []
        for i, layer in enumerate(self.decoder.layers):
            k, v = past[2 * i], past[2 * i + 1]
            pp = past_positions[:, None, :].expand(B, k.shape[1], past_positions.shape[1])
            h, k_new, v_new, _ = layer(h, positions, k, v, pp)
            present += [torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2)]
        logits = self.decoder.lm_head(self.decoder.norm(h[:, -1]))
        return (logits, torch.cat([past_positions, positions], dim=1), *present)
