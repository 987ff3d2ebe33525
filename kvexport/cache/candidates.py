# SPDX-License-Identifier: Apache-2.0
"""Compaction in torch ops, shared by the PyTorch cache and the exported graphs (rules 3, 5 and 6 of
:mod:`kvexport.cache.plan`).

Both call :func:`keep_best` on the same raw layout, ``cat([cache slots (n_slots) ; new columns (n_cols)])``:

    cache slots: [0, fill) occupied, [fill, n_slots) empty
    new columns: [0, n_pad) padding, [n_pad, n_cols) real

The PyTorch cache passes only its occupied slots (``n_slots == fill``) and never pads, so for it every order
below is the identity; a graph passes its whole static cache and a front-padded chunk. Written with torch ops
only (``fill`` and ``n_pad`` may be 0-d tensors), so it traces into ONNX.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def select_kept(scores: torch.Tensor, positions: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The TopKGather reference. scores, positions (B, Hc, S) -> slot indices (B, Hc, n_keep), ascending.

    Entries with position < 0 score -inf; ties go to the lower index (ONNX TopK's rule, which the exported
    graphs and the plugin follow); ascending index = candidate order = position order.
    """
    scores = scores.float().masked_fill(positions < 0, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :n_keep].sort(dim=-1).values


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, Hc, S, D) or (B, Hc, S), idx (B, Hc, K) -> (B, Hc, K, D) or (B, Hc, K)."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def topk_gather_reference(scores, keys, values, positions, k: int):
    """TopKGather (docs/custom_ops.md): the k best per (batch, head) -> kept keys, values, positions, indices."""
    idx = select_kept(scores, positions, k)
    return gather_slots(keys, idx), gather_slots(values, idx), gather_slots(positions, idx), idx


@dataclass(frozen=True)
class Orders:
    """Index vectors (S,) into the raw layout: ``press`` = [empty ; padding ; occupied ; real] (rule 6) and
    ``kept`` = candidate order [occupied ; real ; empty ; padding]; ``kept[a] = press[(a + shift) % S]``."""

    press: torch.Tensor
    kept: torch.Tensor
    shift: torch.Tensor | int


def orders(fill, n_pad, n_slots: int, n_cols: int, device=None) -> Orders | None:
    """The two orders of the raw layout, or None when both are the identity (no empty slot, no padding)."""
    if isinstance(fill, int) and isinstance(n_pad, int) and fill == n_slots and n_pad == 0:
        return None
    S = n_slots + n_cols
    a = torch.arange(S, device=device)
    n_empty = n_slots - fill
    n_free = n_empty + n_pad  # invalid entries at the front of the press order
    occ_end = n_free + fill
    press = torch.where(a < n_empty, fill + a,
                        torch.where(a < n_free, n_slots + (a - n_empty),
                                    torch.where(a < occ_end, a - n_free, n_slots + n_pad + (a - occ_end))))
    kept = press.index_select(0, torch.remainder(a + n_free, S))
    return Orders(press, kept, n_free)


def _ranked(press, inputs) -> torch.Tensor:
    """What the cache ranks candidates by: a :class:`~kvexport.presses.base.ScorerPress`'s ``keep_scores`` (its
    scores spread to neighbours), or ``score`` of any object that only scores."""
    rank = getattr(press, "keep_scores", None) or press.score
    return rank(inputs).float()


def keep_best(press, make_inputs, k, v, pos, queries, q_positions, fill, n_pad, n_slots: int, budget: int,
              capacity: int, topk=topk_gather_reference, stored=None):
    """Rules 3 and 5: score the candidates, keep the best ``budget`` in candidate order, then ``capacity -
    budget`` empty slots.

    k (B, Hc, S, Dk), v (B, Hc, S, Dv), pos (B, Hc, S): the raw layout (module docstring), S = n_slots + n_cols.
    queries (B, Hq, Q, Dq) / q_positions (B, Q): the observation. ``make_inputs(k, v, pos, queries, q_positions)``
    builds the press's :class:`~kvexport.presses.base.ScoreInputs` (it knows the layer). ``press=None`` keeps the
    first ``budget`` in candidate order (a full cache). ``topk``: the TopKGather implementation (the reference
    here, the custom op in a graph). Returns k, v, pos with ``capacity`` slots.

    ``stored``: what the cache holds of the same candidates when that is not what the press scores (a quantized
    cache, :mod:`kvexport.cache.quant`): ``(k_codes, v_codes, k_scale, v_scale)`` in the raw layout (a scale may be
    None). The press scores ``k`` / ``v``; the kept entries are gathered from ``stored`` (codes are copied, never
    quantized again), and the result is ``(k_codes, v_codes, pos, k_scale, v_scale)``.
    """
    S = k.shape[2]
    o = orders(fill, n_pad, n_slots, S - n_slots, device=k.device)
    store = list(stored) if stored is not None else None
    if press is None:
        if o is not None:
            idx = o.kept[:budget]
            pos = pos.index_select(2, idx)
            k, v = (store[0], store[1]) if store is not None else (k, v)
            k, v = k.index_select(2, idx), v.index_select(2, idx)
            scales = [None if s is None else s.index_select(2, idx) for s in store[2:]] if store is not None else []
        else:
            k, v = (store[0], store[1]) if store is not None else (k, v)
            scales = list(store[2:]) if store is not None else []
        kk, kv, kp = k[:, :, :budget], v[:, :, :budget], pos[:, :, :budget]
        kept_scales = [None if s is None else s[:, :, :budget] for s in scales]
    else:
        if o is None:
            scores = _ranked(press, make_inputs(k, v, pos, queries, q_positions))
        else:
            ks, vs, ps = k.index_select(2, o.press), v.index_select(2, o.press), pos.index_select(2, o.press)
            scores = _ranked(press, make_inputs(ks, vs, ps, queries, q_positions))
            back = torch.remainder(torch.arange(S, device=k.device) + o.shift, S)
            scores = scores.index_select(2, back)
            if S > n_slots:  # with no new columns the candidate order is the raw layout: nothing to reorder (and a
                # quantized cache's codes reach TopKGather as they are; TensorRT gathers no UINT8 itself)
                pos = pos.index_select(2, o.kept)
                if store is None:
                    k, v = k.index_select(2, o.kept), v.index_select(2, o.kept)
                else:
                    store = [None if t is None else t.index_select(2, o.kept) for t in store]
        if store is not None:
            k, v = store[0], store[1]
        kk, kv, kp, idx = topk(scores, k, v, pos, budget)
        kept_scales = [None if s is None else gather_slots(s, idx) for s in store[2:]] if store is not None else []
    extra = capacity - kk.shape[2]
    if extra > 0:
        B, H = k.shape[0], k.shape[1]
        kk = torch.cat([kk, kk.new_zeros(B, H, extra, k.shape[-1])], dim=2)
        kv = torch.cat([kv, kv.new_zeros(B, H, extra, v.shape[-1])], dim=2)
        kp = torch.cat([kp, torch.full((B, H, extra), -1, dtype=kp.dtype, device=kp.device)], dim=2)
        kept_scales = [None if s is None else torch.cat([s, s.new_zeros(B, H, extra)], dim=2) for s in kept_scales]
    if stored is None:
        return kk, kv, kp
    return (kk, kv, kp, *kept_scales)
