# SPDX-License-Identifier: Apache-2.0
"""Helpers the attention-based presses share: observation attention, group folding, always-kept scores.

All of them are written with torch ops only (no ``.item()``, no branching on tensor values) so that a
press's ``score`` can later be traced into an ONNX graph. Python branches are on static shapes only.

Conventions (see :class:`~kvexport.presses.base.ScoreInputs`):
- Hq query heads share Hc cache heads, ``G = Hq // Hc``; query head ``h`` reads cache head ``h // G``
  (HF's ``repeat_kv`` layout). MLA latent caches have Hc = 1 and G = Hq.
- The observation queries are pre-RoPE and rotated here with ``inputs.rotary.apply(q, query_positions)``.
- Key j is visible to query t by :func:`kvexport.cache.visibility.visible` (causal by position, the layer's
  sliding window, padding never visible), the rule attention itself uses.
- The real queries of a row are its last ones, and their tokens are its last candidates (kvexport.cache.plan
  rule 6); padding queries contribute nothing.
"""

from __future__ import annotations

import torch

from kvexport.cache.visibility import visible as visible_by_position
from kvexport.presses.base import ScoreInputs


def query_valid(inputs: ScoreInputs, last: int | None = None) -> torch.Tensor:
    """(B, Q') bool: which observation queries are real tokens (the last ``last`` ones, or all)."""
    qp = inputs.query_positions if last is None else inputs.query_positions[:, -last:]
    return qp >= 0


def visible(inputs: ScoreInputs, last: int | None = None) -> torch.Tensor:
    """(B, Hc, Q', S) bool: candidate j visible to (real) observation query t."""
    qp = inputs.query_positions if last is None else inputs.query_positions[:, -last:]
    return visible_by_position(qp, inputs.positions, inputs.sliding_window) & (qp >= 0)[:, None, :, None]


def observation_probs(inputs: ScoreInputs, last: int | None = None) -> torch.Tensor:
    """Softmax attention of the (last ``last``) observation queries over all candidates.

    -> probs (B, Hc, G, Q', S) float32; rows of padding queries are all zero.
    """
    q = inputs.queries if last is None else inputs.queries[:, :, -last:]
    qp = inputs.query_positions if last is None else inputs.query_positions[:, -last:]
    q = inputs.rotary.apply(q, qp)  # RoPE at the queries' true positions
    B, Hq, Q, D = q.shape
    k = inputs.keys
    Hc, S = k.shape[1], k.shape[2]
    G = Hq // Hc
    logits = torch.matmul(q.reshape(B, Hc, G * Q, D).float(), k.float().transpose(-1, -2))
    logits = logits.reshape(B, Hc, G, Q, S) * inputs.scaling
    vis = visible(inputs, last)[:, :, None]  # (B, Hc, 1, Q', S)
    logits = logits.masked_fill(~vis, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1)
    return probs * vis.any(-1, keepdim=True).float()  # a query that sees nothing contributes nothing


def keep_always(scores: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Give ``keep`` candidates (bool, broadcastable to scores) a score above every valid one.

    The tensor form of kvpress's ``F.pad(scores, ..., value=scores.max().item() + 1)``: the maximum is
    taken over valid candidates only (empty / padding slots may hold any value).
    """
    top = scores.masked_fill(~valid, float("-inf")).amax() + 1.0
    return torch.where(keep, top, scores)


def last_candidates(inputs: ScoreInputs, n) -> torch.Tensor:
    """(B or 1, 1, S) bool: the last ``n`` candidates (an int, or (B,) per row): the tokens of the last ``n`` real
    observation queries at prefill and decode."""
    S = inputs.keys.shape[2]
    idx = torch.arange(S, device=inputs.keys.device)
    if isinstance(n, int):
        return (idx >= S - n)[None, None, :]
    return (idx[None, :] >= S - n[:, None])[:, None, :]
