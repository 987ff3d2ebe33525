# SPDX-License-Identifier: Apache-2.0
"""Analytic KV-cache size per sequence: what a deployment keeps resident for one sequence.

Elements cached per token and layer:
    GQA/MHA:  2 * n_kv * d_h             (keys and values of every KV head)
    MLA:      r_kv + d_rope              (the shared latent and the decoupled RoPE key; X-EcoMLA,
                                          see REFERENCE.md section 2), r_kv may differ per layer
A static-budget cache allocates ``budget + window`` slots per layer once and never grows; a full
cache holds every token of the context (a static export without a press allocates its whole
``capacity`` up front: then that is what is resident). Position indices (int64 per slot and cache head) are
counted apart in ``index_bytes`` (they are not K/V data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheShape:
    """The cache layout of one model: ``mla_ranks`` None = GQA/MHA, else one r_kv per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    mla_ranks: tuple[int, ...] | None = None
    rope_dim: int = 0
    budget: int | None = None  # None = full cache (grows with the context)
    window: int = 0
    dtype_bytes: int = 4
    #: a full cache allocated once at a fixed capacity (a static export without a press), else None
    capacity: int | None = None

    def elements_per_token(self) -> list[int]:
        """Per layer: cached elements per token."""
        if self.mla_ranks is not None:
            return [int(r) + int(self.rope_dim) for r in self.mla_ranks]
        return [2 * self.num_kv_heads * self.head_dim] * self.num_layers

    def cache_heads(self) -> int:
        return 1 if self.mla_ranks is not None else self.num_kv_heads

    def slots(self, context: int) -> int:
        """Slots allocated per layer for a sequence of ``context`` tokens."""
        if self.budget is None:
            return int(self.capacity) if self.capacity else int(context)
        return int(self.budget) + int(self.window)

    def bytes_per_token(self) -> int:
        """K/V bytes per cached token, all layers."""
        return sum(self.elements_per_token()) * self.dtype_bytes

    def bytes_at(self, context: int, batch: int = 1) -> int:
        """K/V bytes resident for ``batch`` sequences of ``context`` tokens."""
        return batch * self.slots(context) * self.bytes_per_token()

    def index_bytes_at(self, context: int, batch: int = 1) -> int:
        if self.budget is None and not self.capacity:
            return 0
        return batch * self.num_layers * self.cache_heads() * self.slots(context) * 8

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "mla_ranks": list(self.mla_ranks) if self.mla_ranks is not None else None,
            "rope_dim": self.rope_dim, "budget": self.budget, "window": self.window,
            "dtype_bytes": self.dtype_bytes, "capacity": self.capacity, "bytes_per_token": self.bytes_per_token(),
        }


def full_cache_of(shape: CacheShape) -> CacheShape:
    """The uncompressed baseline of the same model: GQA, full cache, same dtype."""
    return CacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, None, 0, None, 0, shape.dtype_bytes)


def cache_table(shape: CacheShape, contexts: list[int], batch: int = 1) -> dict[str, Any]:
    """Per context: bytes of this cache, of the full-cache baseline, and their ratio."""
    base = full_cache_of(shape)
    rows = []
    for c in contexts:
        b, f = shape.bytes_at(c, batch), base.bytes_at(c, batch)
        rows.append({"context": int(c), "kv_bytes": b, "baseline_kv_bytes": f, "ratio": f / b if b else None,
                     "index_bytes": shape.index_bytes_at(c, batch)})
    return {
        "shape": shape.to_dict(),
        "bytes_per_token": shape.bytes_per_token(),
        "baseline_bytes_per_token": base.bytes_per_token(),
        "per_token_ratio": base.bytes_per_token() / shape.bytes_per_token(),
        "contexts": rows,
    }


__all__ = ["CacheShape", "full_cache_of", "cache_table"]
