# SPDX-License-Identifier: Apache-2.0
"""The exportable graphs: a prefill chunk, a one-token decode step, a compaction, and the growing-past baseline.

Each wraps a :class:`~kvexport.models.decoder.Decoder` and follows the rules of
:mod:`kvexport.cache.static_cache` with fixed shapes (batch B, chunk C, per-layer capacity
cap_i = budget_i + window W). Cache tensors are explicit inputs and outputs of identical shapes, in
this order per layer i: ``k_i (B, Hc, cap_i, Dk)``, ``v_i (B, Hc, cap_i, Dv)``, ``pos_i (B, Hc, cap_i)``
int64 (-1 = empty), and, when a press evicts, ``qbuf_i (B, Hq, W, Dq)``; then one shared
``qpos (B, W)``. The host keeps the per-layer fill counts and passes them in, so the graphs have no
data-dependent control flow:

- prefill (``fill (L,)``): candidates = [occupied slots ; chunk ; empty slots] (the same order as the
  PyTorch cache's ``cat([occupied, chunk])``), scored by the press and top-``budget_i`` kept in slots
  [0, budget_i) (TopKGather); without a press the chunk is written at ``fill``.
  Host: ``fill_i = min(fill_i + C, budget_i)`` (no press: ``fill + C``).
- decode (``slot (L,)``): the token is written at ``slot_i`` with a one-hot ``Where``.
  Host: ``fill_i += 1``; when any layer is full it runs ``compact`` and sets ``fill_i = min(fill_i, budget_i)``.
- compact: every layer scores all its slots with the last W decoded queries and keeps budget_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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
    for b, layer in zip(budgets, decoder.layers, strict=False):
        a = layer.self_attn
        out.append(LayerShape(a.cache_heads, a.key_dim, a.value_dim, a.num_heads,
                              getattr(a, "score_dim", a.head_dim), b, b + window))
    return out


def cache_names(n_layers: int, with_queries: bool, suffix: str) -> list[str]:
    """Graph I/O names of the cache tensors, in the order the graphs take and return them."""
    names = []
    for i in range(n_layers):
        names += [f"k_{i}{suffix}", f"v_{i}{suffix}", f"pos_{i}{suffix}"]
        if with_queries:
            names.append(f"qbuf_{i}{suffix}")
    if with_queries:
        names.append(f"qpos{suffix}")
    return names


class _CacheGraph(nn.Module):
    def __init__(self, decoder, press, budgets: list[int], window: int):
        super().__init__()
        self.decoder = decoder
        self.press = press
        self.budgets = list(budgets)
        self.window = int(window)
        self.shapes = layer_shapes(decoder, self.budgets, self.window)
        self.per_layer = 4 if press is not None else 3

    def split(self, cache: tuple[torch.Tensor, ...]):
        """Flat cache tuple -> per-layer lists [k, v, pos(, qbuf)] and qpos (or None)."""
        n = self.per_layer
        layers = [list(cache[i * n : (i + 1) * n]) for i in range(len(self.shapes))]
        qpos = cache[-1] if self.press is not None else None
        return layers, qpos

    def score_inputs(self, i: int, k, v, pos, queries, q_positions):
        from kvexport.presses.base import ScoreInputs

        attn = self.decoder.layers[i].self_attn
        return ScoreInputs(keys=k, values=v, positions=pos, queries=queries, query_positions=q_positions,
                           rotary=getattr(attn, "score_rotary", attn.rotary), scaling=attn.scaling, layer_idx=i,
                           num_layers=len(self.shapes), n_keep=self.shapes[i].budget)

    def keep(self, i: int, k, v, pos, queries, q_positions, n_occupied):
        """Candidates (B, Hc, S, .) in cache order [occupied (n_occupied) ; empty] -> cache (B, Hc, cap_i, .):
        the top budget_i in [0, budget_i), then empty slots.

        The press sees the candidates rolled to [empty ; occupied], so that, as in the PyTorch cache, the
        observation queries belong to the *last* candidates; its scores are rolled back before TopKGather,
        so ties and empty picks follow the PyTorch cache's slot order.
        """
        s = self.shapes[i]
        S = k.shape[2]
        j = torch.arange(S, device=k.device)
        to_scored = torch.remainder(j + n_occupied, S)  # scored[a] = cache[(a + m) mod S]
        back = torch.remainder(j - n_occupied, S)  # cache[b] = scored[(b - m) mod S]
        ks, vs, ps = k.index_select(2, to_scored), v.index_select(2, to_scored), pos.index_select(2, to_scored)
        scores = self.press.score(self.score_inputs(i, ks, vs, ps, queries, q_positions))
        scores = scores.index_select(2, back)
        kk, kv, kp, _ = ops.topk_gather(scores, k, v, pos, s.budget)
        W = s.capacity - s.budget
        B, H = k.shape[0], k.shape[1]
        kk = torch.cat([kk, kk.new_zeros(B, H, W, k.shape[-1])], dim=2)
        kv = torch.cat([kv, kv.new_zeros(B, H, W, v.shape[-1])], dim=2)
        kp = torch.cat([kp, torch.full((B, H, W), -1, dtype=kp.dtype, device=kp.device)], dim=2)
        return kk, kv, kp

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder.norm(h))


class PrefillChunk(_CacheGraph):
    """One chunk of exactly C prompt tokens (padding: position -1).

    Inputs: input_ids (B, C) int64, positions (B, C) int64, last_index (1,) int64 (chunk column whose
    logits are returned), fill (L,) int64, then the cache. Outputs: logits (B, V), then the cache.
    """

    def forward(self, input_ids, positions, last_index, fill, *cache):
        layers, qpos = self.split(cache)
        B, C = input_ids.shape
        h = self.decoder.embed_tokens(input_ids)
        out = []
        for i, layer in enumerate(self.decoder.layers):
            k, v, pos = layers[i][0], layers[i][1], layers[i][2]
            cap = k.shape[2]
            h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)
            new_pos = positions[:, None, :].expand(B, k_new.shape[1], C)
            # candidates in the PyTorch cache's order: occupied [0, fill), chunk, then the empty slots
            j = torch.arange(cap + C, device=k.device)
            f = fill[i]
            idx = torch.where(j < f, j, torch.where(j < f + C, cap + j - f, j - C))
            kc = torch.cat([k, k_new], dim=2).index_select(2, idx)
            vc = torch.cat([v, v_new], dim=2).index_select(2, idx)
            pc = torch.cat([pos, new_pos], dim=2).index_select(2, idx)
            if self.press is None:
                out += [kc[:, :, :cap], vc[:, :, :cap], pc[:, :, :cap]]
                continue
            q_score = layer.self_attn.score_queries(q_pre)
            out += list(self.keep(i, kc, vc, pc, q_score, positions, f + C))
            qb = layers[i][3]
            out.append(torch.cat([qb, q_score], dim=2)[:, :, -self.window :])
        if self.press is not None:
            out.append(torch.cat([qpos, positions], dim=1)[:, -self.window :])
        hl = h.index_select(1, last_index)[:, 0]  # (B, H)
        return (self.head(hl), *out)


class DecodeStep(_CacheGraph):
    """One token per row. Inputs: input_ids (B, 1), positions (B, 1), slot (L,) int64, then the cache.
    Outputs: logits (B, V), then the cache with the token written at slot_i of every layer."""

    def forward(self, input_ids, positions, slot, *cache):
        layers, qpos = self.split(cache)
        input_ids.shape[0]
        h = self.decoder.embed_tokens(input_ids)
        out = []
        for i, layer in enumerate(self.decoder.layers):
            k, v, pos = layers[i][0], layers[i][1], layers[i][2]
            cap = k.shape[2]
            h, k_new, v_new, q_pre = layer(h, positions, k, v, pos)
            hot = torch.arange(cap, device=k.device) == slot[i]  # (cap,)
            hot4 = hot[None, None, :, None]
            out.append(torch.where(hot4, k_new, k))
            out.append(torch.where(hot4, v_new, v))
            out.append(torch.where(hot[None, None, :], positions[:, None, :], pos))
            if self.press is not None:
                q_score = layer.self_attn.score_queries(q_pre)
                out.append(torch.cat([layers[i][3], q_score], dim=2)[:, :, 1:])
        if self.press is not None:
            out.append(torch.cat([qpos, positions], dim=1)[:, 1:])
        return (self.head(h[:, -1]), *out)


class Compact(_CacheGraph):
    """Decode-time compaction of every layer: all slots scored with the last W decoded queries.
    Inputs: fill (L,) int64 (occupied slots per layer), then the cache. Outputs: k_i, v_i, pos_i of every layer (qbuf and qpos are unchanged)."""

    def forward(self, fill, *cache):
        layers, qpos = self.split(cache)
        out = []
        for i in range(len(layers)):
            k, v, pos, qb = layers[i]
            out += list(self.keep(i, k, v, pos, qb, qpos, fill[i]))
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
