# SPDX-License-Identifier: Apache-2.0
"""Training windows that exercise in-context recall: a span of each chosen window is written again later.

This is the copy augmentation the bundled reference models learned to copy from (docs/reference_models.md,
``add_copies`` in scripts/train_reference.py: spans of 48-120 tokens of a 256-token window, copied at least 8
tokens after they end), scaled to the window length, applied to a seeded fraction of the windows. Predicting
the repeated tokens needs an induction head (previous-token attention plus a copy), which is what an MLA
student must keep; plain text rarely asks for it.
"""

from __future__ import annotations

import torch


def copy_augment(seqs: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """seqs (N, T) token ids -> a copy where ``round(fraction · N)`` seeded rows have one span of their first half
    (length 48/256 .. 120/256 of T) written again at a seeded later place, at least T/32 tokens after it ends."""
    out = seqs.clone()
    N, T = out.shape
    n = int(round(fraction * N))
    if n == 0 or T < 16:
        return out
    g = torch.Generator().manual_seed(seed)
    lo, hi, gap = max(2, T * 48 // 256), max(2, T * 120 // 256), max(1, T // 32)
    for row in torch.randperm(N, generator=g)[:n].tolist():
        span = int(torch.randint(lo, hi + 1, (1,), generator=g))
        src = int(torch.randint(1, max(2, T // 2 - span), (1,), generator=g))
        first = src + span + gap
        dst = int(torch.randint(first, max(first + 1, T - span + 1), (1,), generator=g))
        dst = min(dst, T - span)
        out[row, dst : dst + span] = seqs[row, src : src + span]
    return out
