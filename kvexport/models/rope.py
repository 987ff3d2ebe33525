# SPDX-License-Identifier: Apache-2.0
"""Rotary position embedding (Su et al., 2021) in HF's half-split layout, for explicit positions.

Unlike HF's module, :class:`Rotary` takes arbitrary (possibly non-contiguous, possibly padded = -1)
positions, can rotate only a slice of the last dimension (MLA's decoupled RoPE key), and can return
the rotation as a matrix (ExpectedAttention averages it over future positions).
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE over ``dim`` channels starting at ``offset`` of the last axis.

    inv_freq: (dim/2,) inverse frequencies, as HF computes them for the model's ``rope_type``
    (default, linear, llama3, yarn ...); ``scaling`` is HF's ``attention_scaling`` multiplier on cos/sin.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, offset: int = 0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float32).clone(), persistent=True)
        self.scaling = float(scaling)
        self.offset = int(offset)

    @property
    def dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...,) int -> cos, sin (..., dim); negative (padding) positions act as 0."""
        p = positions.clamp(min=0).to(torch.float32)
        freqs = p[..., None] * self.inv_freq  # (..., dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D), positions (B, T) -> x with channels [offset, offset+dim) rotated."""
        cos, sin = self.cos_sin(positions, x.dtype)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, dim)
        if self.offset == 0 and self.dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        lo, hi = self.offset, self.offset + self.dim
        part = x[..., lo:hi]
        rot = part * cos + rotate_half(part) * sin
        return torch.cat((x[..., :lo], rot, x[..., hi:]), dim=-1)

    def matrix(self, positions: torch.Tensor, total_dim: int | None = None) -> torch.Tensor:
        """positions (P,) -> R (P, D, D) with ``apply(x) == x @ R.T`` row-wise; identity outside the slice."""
        d = self.dim
        D = total_dim or (self.offset + d)
        cos, sin = self.cos_sin(positions)  # (P, d)
        half = d // 2
        P = torch.zeros(d, d)
        P[half:, :half] = torch.eye(half)
        P[:half, half:] = -torch.eye(half)
        eye = torch.eye(d)
        R_small = cos[:, :, None] * eye + sin[:, :, None] * P  # (P, d, d)
        R = torch.eye(D).repeat(positions.shape[0], 1, 1)
        R[:, self.offset : self.offset + d, self.offset : self.offset + d] = R_small
        return R

    @classmethod
    def from_hf_rotary(cls, hf_rotary: nn.Module, offset: int = 0) -> "Rotary":
        """HF's rotary module -> a Rotary with its frequencies as loaded (``original_inv_freq`` where transformers
        keeps one: ``inv_freq`` itself may have been rescaled by a long sequence the HF model ran before)."""
        inv = getattr(hf_rotary, "original_inv_freq", None)
        return cls(hf_rotary.inv_freq if inv is None else inv, getattr(hf_rotary, "attention_scaling", 1.0), offset)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, offset={self.offset}, scaling={self.scaling}"
