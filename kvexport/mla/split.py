# SPDX-License-Identifier: Apache-2.0
"""Split a per-token cache budget ``r_kv + d_rope`` between the latent and the RoPE part, by measurement.

For a total of E elements per token and layer, every candidate d_rope (even, < E, <= n_kv · D) is rewritten
(:func:`kvexport.mla.rewrite.rewrite_to_mla`, r_kv = E − d_rope, clamped to the latent's rank) and scored
by the forward KL(original || rewritten) on held-out token windows; the smallest KL wins. On the bundled
student (docs/studies.md) the winners are d_rope = 32, 12, 4-6, 2, 2 of E = 68, 36, 20, 12, 10: the RoPE part
gets about half of a mild budget and less as the budget shrinks, because the latent must also carry the
values. At E = 2 n_kv D the exact rewrite (d_rope = n_kv D) is among the candidates and wins.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvexport.mla.config import MLASettings, max_kv_rank


def rope_candidates(total: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """Even d_rope values to try for a budget of ``total`` elements: 2, 4, 6, 8, 12, 16, 24, 32, 48, ... (powers of
    two and 1.5x them) below ``total`` and up to n_kv · D, plus n_kv · D itself when the budget has room for it."""
    full = num_kv_heads * head_dim
    top = min(full, total - 1)
    grid = {2, 4, 6} | {m * 2**k for k in range(2, 16) for m in (2, 3)}
    out = {d for d in grid if d <= top}
    if full < total:
        out.add(full)
    return sorted(out)


@torch.no_grad()
def kl_to(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(ref) || softmax(logits)), nats."""
    lp, lq = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@torch.no_grad()
def choose_split(dec, total: int, base: MLASettings, calibration_ids: torch.Tensor | None,
                 heldout_ids: torch.Tensor, candidates: list[int] | None = None) -> tuple[MLASettings, list[dict]]:
    """dec (a GQA Decoder), total = r_kv + d_rope, base: the other settings -> (the best settings, every candidate
    as {rope_dim, kv_rank, kl}). heldout_ids (B, T) score the candidates; calibration_ids feed the rewrite."""
    from kvexport.mla.rewrite import rewrite_to_mla

    s = dec.spec
    cands = candidates or rope_candidates(total, s.num_kv_heads, s.head_dim)
    B, T = heldout_ids.shape
    pos = torch.arange(T, device=heldout_ids.device).expand(B, T)
    ref = dec(heldout_ids, pos)
    rows = []
    for dr in cands:
        r = min(total - dr, max_kv_rank(s.hidden_size, s.num_kv_heads, s.head_dim, dr, s.qk_norm))
        settings = replace(base, kv_rank=r, energy=None, rope_dim=dr)
        mla = rewrite_to_mla(dec, settings, calibration_ids)
        rows.append({"rope_dim": dr, "kv_rank": r, "kl": kl_to(ref, mla(heldout_ids, pos))})
    best = min(rows, key=lambda row: row["kl"])
    return replace(base, kv_rank=best["kv_rank"], energy=None, rope_dim=best["rope_dim"]), rows
