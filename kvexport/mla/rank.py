# SPDX-License-Identifier: Apache-2.0
"""Rank choice for truncated SVDs: fixed, or by cumulative energy (X-EcoMLA's dynamic rank)."""

from __future__ import annotations

import math

import torch


def energy_rank(sigma: torch.Tensor, delta: float, multiple: int = 8) -> int:
    """sigma (n,) singular values, descending -> smallest r with Σ_{i<r} σ_i² >= δ Σ σ², rounded up to ``multiple``
    (never above n). δ = 1 gives the full rank n."""
    e = sigma.double().pow(2)
    total = float(e.sum())
    if total <= 0.0:
        return min(multiple, sigma.numel())
    cum = torch.cumsum(e, 0) / total
    # tolerance: δ = 1 must not miss the last value to rounding
    r = int(torch.searchsorted(cum, torch.tensor(float(delta) - 1e-12, dtype=cum.dtype)).item()) + 1
    r = min(r, sigma.numel())
    return min(int(math.ceil(r / multiple) * multiple), sigma.numel())


def truncated_svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (m, n) -> up (m, r), down (r, n) with up @ down the best rank-r approximation (Eckart–Young);
    σ goes into ``down`` (X-EcoMLA: down-projection = Σ_r V_rᵀ, up-projection = U_r). fp64 SVD."""
    U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
    up = U[:, :rank]
    down = S[:rank, None] * Vh[:rank]
    return up.to(w.dtype), down.to(w.dtype)


def singular_values(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(w.double())
