# SPDX-License-Identifier: Apache-2.0
"""Settings of an MLA rewrite (X-EcoMLA, Li et al., 2025) and the per-layer shapes they resolve to.

:class:`MLASettings` is what a user asks for (a fixed latent rank or an energy threshold, the decoupled
RoPE width, how to pick its frequency pairs, an optional query rank); :class:`MLALayerPlan` is what one
layer gets after the SVDs (its rank, its RoPE pairs). Both are saved in the MLA directory's JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvexport.errors import BadUsage

ROPE_INITS = ("xeco", "norm")


@dataclass(frozen=True)
class MLASettings:
    """What to build.

    kv_rank: latent width r_kv of every layer; or ``energy`` δ in (0, 1]: per layer, the smallest rank
    whose cumulative σ² reaches δ of the total, rounded up to a multiple of 8 (X-EcoMLA's "dynamic" rank).
    rope_dim: d_rope, width of the shared decoupled RoPE key (even, 2 <= d_rope <= head_dim).
    rope_init: "xeco" (evenly spaced frequency pairs, key = head average, X-EcoMLA) or "norm" (the pairs
    with the largest ‖q_f‖·‖k_f‖ on calibration text, MHA2MLA's 2-norm selection; key = head average).
    q_rank: optional low-rank query (SVD of W_Q to r_q); None keeps W_Q full.
    absorb: attention path: True = absorbed (W_UK folded into the query, what is exported), False = naive.
    """

    kv_rank: int | None = None
    energy: float | None = None
    rope_dim: int = 32
    rope_init: str = "xeco"
    q_rank: int | None = None
    absorb: bool = True

    def __post_init__(self):
        if (self.kv_rank is None) == (self.energy is None):
            raise BadUsage("give exactly one of an MLA rank (--mla-rank R) or an energy threshold (--mla-energy δ)")
        if self.kv_rank is not None and int(self.kv_rank) < 1:
            raise BadUsage(f"MLA rank r_kv {self.kv_rank} must be >= 1")
        if self.energy is not None and not (0.0 < float(self.energy) <= 1.0):
            raise BadUsage(f"energy threshold δ {self.energy} is outside (0, 1]")
        if int(self.rope_dim) < 2 or int(self.rope_dim) % 2:
            raise BadUsage(f"RoPE dim d_rope {self.rope_dim} must be even and >= 2 (it holds frequency pairs)")
        if self.rope_init not in ROPE_INITS:
            raise BadUsage(f"rope init {self.rope_init!r} unknown; accepted: {', '.join(ROPE_INITS)}")
        if self.q_rank is not None and int(self.q_rank) < 1:
            raise BadUsage(f"query rank r_q {self.q_rank} must be >= 1")

    def check_model(self, head_dim: int, hidden: int, num_kv_heads: int) -> None:
        """Refuse settings this model cannot take (one line, :class:`BadUsage`)."""
        if self.rope_dim > head_dim:
            raise BadUsage(f"RoPE dim d_rope {self.rope_dim} is larger than the model's head_dim {head_dim}")
        mx = max_kv_rank(hidden, num_kv_heads, head_dim, self.rope_dim)
        if self.kv_rank is not None and self.kv_rank > mx:
            raise BadUsage(f"MLA rank r_kv {self.kv_rank} is larger than the rank of the stacked K/V weights "
                           f"({mx} = min(hidden {hidden}, n_kv*(2*head_dim - d_rope)))")
        if self.q_rank is not None and self.q_rank > hidden:
            raise BadUsage(f"query rank r_q {self.q_rank} is larger than hidden_size {hidden}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def max_kv_rank(hidden: int, num_kv_heads: int, head_dim: int, rope_dim: int) -> int:
    """Rank bound of the stacked ``[W_K,nope; W_V]`` (GQA repetition adds no rank): min(H, n_kv (2 d_h - d_rope))."""
    return min(hidden, num_kv_heads * (2 * head_dim - rope_dim))


@dataclass
class MLALayerPlan:
    """One layer's resolved shapes: kv_rank r_kv, q_rank (or None), rope_pairs (d_rope/2 frequency-pair
    indices into the original head's half-split RoPE layout, ascending)."""

    kv_rank: int
    rope_pairs: list[int] = field(default_factory=list)
    q_rank: int | None = None

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.rope_pairs)
