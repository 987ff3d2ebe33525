# SPDX-License-Identifier: Apache-2.0
"""The exportable graphs: a prefill chunk, a one-token decode step, the two compactions, and the growing past.

Each wraps a :class:`~kvexport.models.decoder.Decoder` with fixed shapes (batch B, chunk C, per-layer capacity
cap_i = budget_i + window W) and follows :mod:`kvexport.cache.plan`: the host keeps the plan's
:class:`~kvexport.cache.plan.CacheState` and the cache buffers, and writes each step's new rows into them in
place; the graphs read the cache and output only what is new, so a decode step writes O(1) bytes whatever the
capacity. What a compaction keeps is :func:`kvexport.cache.candidates.keep_best`, the function the PyTorch
cache runs. Cache tensors (inputs, per layer i): ``k_i (B, Hc, cap_i, Dk)``, ``v_i (B, Hc, cap_i, Dv)``,
``pos_i (B, Hc, cap_i)`` int64 (-1 = empty); with a press the query ring ``qbuf_i (B, Hq, W, Dq)`` and one shared
``qpos (B, W)``:

- prefill: C columns (a short last chunk front-padded, plan rule 2) attend to the cache and each other; outputs
  the logits of the last column and the chunk's rows ``k_new_i``, ``v_new_i`` (and with a press the queries
  ``q_new_i`` that observe at a compaction). The host writes the real columns at ``fill`` or, when a layer
  overflows, runs ``compact_prefill``.
- compact_prefill (``fill (L,)``, ``n_pad (1,)``, the cache, the chunk's rows, positions and queries): every
  layer's [occupied ; real columns] scored by the press, the best budget_i -> ``kept_k_i``, ``kept_v_i``,
  ``kept_pos_i`` (B, Hc, budget_i, .), which the host copies to slots [0, budget_i).
- decode: one token per row attends to the cache and itself; outputs logits and its ``k_new_i``, ``v_new_i``
  (B, Hc, 1, .) (and ``q_new_i`` (B, Hq, 1, Dq)), which the host writes at ``slot_i`` (and ring slot).
- compact (``fill (L,)``, ``query_start (1,)``, the cache and the ring): every layer's occupied slots scored with
  the ring read oldest first -> ``kept_*`` as above.
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


def kv_names(n_layers: int, prefix: str = "") -> list[str]:
    """Graph I/O names of the K/V/position tensors, in graph order (``prefix``: "" for the cache, "kept_")."""
    return [f"{prefix}{t}_{i}" for i in range(n_layers) for t in ("k", "v", "pos")]


def query_names(n_layers: int) -> list[str]:
    """Graph input names of the query ring, in graph order."""
    return [f"qbuf_{i}" for i in range(n_layers)] + ["qpos"]


def new_names(n_layers: int, with_queries: bool) -> list[str]:
    """Graph names of a step's new rows, in graph order."""
    per = ("k_new", "v_new", "q_new") if with_queries else ("k_new", "v_new")
    return [f"{t}_{i}" for i in range(n_layers) for t in per]


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
        """Raw layout [cache (cap_i) ; columns] -> the best budget_i (B, Hc, budget_i, .) (plan rules 3 and 5)."""
        s = self.shapes[i]
        return keep_best(self.press, self.make_inputs(i), k, v, pos, queries, q_positions, fill, n_pad, s.capacity,
                         s.budget, s.budget, topk=ops.topk_gather)

    def step(self, input_ids, positions, cache):
        """Run the tokens through every layer over the cache -> final hidden (B, T, H) and the new rows."""
        h = self.decoder.embed_tokens(input_ids)
        new = []
        for layer, (k, v, pos) in zip(self.decoder.layers, self.split_kv(cache), strict=True):
            h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)
            new += [k_new, v_new]
            if self.press is not None:
                new.append(layer.self_attn.score_queries(q_pre))
        return h, new

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder.norm(h))


class PrefillChunk(_CacheGraph):
    """One chunk of exactly C columns (padding: position -1). Inputs: input_ids (B, C) int64, positions (B, C)
    int64, then k/v/pos of every layer. Outputs: logits (B, V) of the last column, then the chunk's new rows."""

    def forward(self, input_ids, positions, *cache):
        h, new = self.step(input_ids, positions, cache)
        return (self.head(h[:, -1]), *new)


class DecodeStep(_CacheGraph):
    """One token per row. Inputs: input_ids (B, 1), positions (B, 1), then k/v/pos of every layer. Outputs:
    logits (B, V), then the token's new rows (B, Hc, 1, .) (and its query (B, Hq, 1, Dq) with a press)."""

    def forward(self, input_ids, positions, *cache):
        h, new = self.step(input_ids, positions, cache)
        return (self.head(h[:, -1]), *new)


class CompactPrefill(_CacheGraph):
    """A prefill chunk's compaction. Inputs: fill (L,), n_pad (1,), positions (B, C), then k/v/pos of every layer,
    then the chunk's new rows (as PrefillChunk returns them). Outputs: kept k/v/pos (B, Hc, budget_i, .)."""

    def forward(self, fill, n_pad, positions, *rest):
        L = len(self.shapes)
        cache, new = rest[: 3 * L], rest[3 * L :]
        B, C = positions.shape
        out = []
        for i, (k, v, pos) in enumerate(self.split_kv(cache)):
            k_new, v_new, q_new = new[3 * i : 3 * i + 3]
            new_pos = positions[:, None, :].expand(B, k.shape[1], C)
            out += list(self.keep(i, torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2),
                                  torch.cat([pos, new_pos], dim=2), q_new, positions, fill[i], n_pad[0]))
        return tuple(out)


class Compact(_CacheGraph):
    """Decode-time compaction of every layer: all slots scored with the ring read oldest first.
    Inputs: fill (L,), query_start (1,), then k/v/pos of every layer and the ring. Outputs: kept k/v/pos."""

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
