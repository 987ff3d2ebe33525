# SPDX-License-Identifier: Apache-2.0
"""The per-token quantities every study averages (definitions in docs/studies.md).

Shapes: hidden states (L, B, F, H) = per decoder layer, batch, future token, hidden dim; logits (B, F, V).
"""

from __future__ import annotations

import torch


def layer_discrepancy(h: torch.Tensor, h_ref: torch.Tensor) -> torch.Tensor:
    """(L, B, F, H) x2 -> (L, B, F): ``‖h − h_ref‖₂`` over the hidden dimension (float32)."""
    return (h.float() - h_ref.float()).norm(dim=-1)


def relative_discrepancy(h: torch.Tensor, h_ref: torch.Tensor) -> torch.Tensor:
    """(L, B, F, H) x2 -> (L, B, F): ``‖h − h_ref‖₂ / ‖h_ref‖₂``."""
    return layer_discrepancy(h, h_ref) / h_ref.float().norm(dim=-1).clamp_min(1e-12)


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """logits (B, F, V), targets (B, F) -> summed next-token cross-entropy (nats)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()


def agreement_count(logits: torch.Tensor, logits_ref: torch.Tensor) -> int:
    """(B, F, V) x2 -> how many of the B·F argmax tokens are equal."""
    return int((logits.argmax(-1) == logits_ref.argmax(-1)).sum().item())


def top1_hits(logits: torch.Tensor, targets: torch.Tensor) -> int:
    """logits (B, F, V), targets (B, F) -> how many argmax predictions equal the targets."""
    return int((logits.argmax(-1) == targets).sum().item())
