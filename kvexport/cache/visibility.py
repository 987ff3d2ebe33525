# SPDX-License-Identifier: Apache-2.0
"""Which cached tokens a query sees, stated once (the attention of every model and every press that computes
attention read it): key j is visible to query t iff ``0 <= pos_j <= pos_t`` (empty slots and padding have position
-1, plan rule 1) and, in a layer with a sliding window, ``pos_t - pos_j < window``."""

from __future__ import annotations

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """q_pos (B, T), k_pos (B, Hc, S) -> bool (B, Hc, T, S): key j visible to query t."""
    kp = k_pos[:, :, None, :]  # (B, Hc, 1, S)
    qp = q_pos[:, None, :, None]  # (B, 1, T, 1)
    vis = (kp >= 0) & (kp <= qp)
    if sliding_window is not None:
        vis = vis & (qp - kp < int(sliding_window))
    return vis


__all__ = ["visible"]
