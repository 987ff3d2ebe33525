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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...,) int -> cos, sin (..., dim), each half the same; negative (padding) positions act as 0.
        ``signed``: the first half of sin negated (the sign of :func:`rotate_half`, for :meth:`apply`)."""
        p = positions.clamp(min=0).to(torch.float32)
        freqs = p[..., None] * self.inv_freq  # (..., dim/2)
        c, s = (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
        return torch.cat((c, c), dim=-1), torch.cat((-s if signed else s, s), dim=-1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D), positions (B, T) -> x with channels [offset, offset+dim) rotated: ``x cos +
        rotate_half(x) sin``.

        A decode step (T = 1) writes it ``x cos + x[swap] sin'``, the halves swapped by one index and the sign of
        ``rotate_half`` moved into the first half of ``sin'`` ((-a) b = a (-b) in IEEE arithmetic, so the same
        values bit for bit): its graph gathers once per rotated tensor where a split, a negation and a
        concatenation were three nodes (SmolLM2's step 37.3 -> 34.8 ms with 120 nodes fewer, 2026-12-07). A chunk
        keeps ``rotate_half``: a gather of its many rows along the last axis made a 2k-token prefill 5 % slower."""
        T = x.shape[-2]
        step = isinstance(T, int) and T == 1
        cos, sin = self.cos_sin(positions, x.dtype, signed=step)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, dim)
        if step:
            swap = torch.arange(self.dim, device=x.device).roll(self.dim // 2)  # a constant: [half, ..., 0, ...]
            turn = lambda t: t.index_select(-1, swap)  # noqa: E731  (one Gather; t[..., swap] traces to three nodes)
        else:
            turn = rotate_half
        if self.offset == 0 and self.dim == x.shape[-1]:
            return x * cos + turn(x) * sin
        lo, hi = self.offset, self.offset + self.dim
        part = x[..., lo:hi]
        rot = part * cos + turn(part) * sin
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
