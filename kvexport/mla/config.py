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

#: how the d_rope RoPE channels are made from the GQA keys (kvexport.mla.rope_plan); the first is the default
ROPE_INITS = ("rorope", "perhead", "xeco", "norm")
#: how a key component that loses RoPE enters the no-RoPE key: rotated by the mean RoPE rotation over the
#: horizon ("mean"), unrotated ("none", MHA2MLA / TransMLA), or left out ("zero")
DROPPED_ROPE = ("mean", "none", "zero")
#: how the latent is fitted to the stacked [no-RoPE keys ; values]: PCA of their (centred) activations on
#: calibration inputs with the keys weighted by the queries and the values by o_proj ("wpca"), unweighted
#: ("pca", TransMLA's balanced KV PCA), or SVD of the weights alone ("svd", X-EcoMLA)
KV_FITS = ("wpca", "pca", "svd")
#: rope inits whose RoPE key is the head average (X-EcoMLA): d_rope is bounded by head_dim
SHARED_KEY_INITS = ("xeco", "norm")


@dataclass(frozen=True)
class MLASettings:
    """What to build.

    kv_rank: latent width r_kv of every layer; or ``energy`` δ in (0, 1]: per layer, the smallest rank
    whose cumulative energy reaches δ of the total, rounded up to a multiple of 8 (X-EcoMLA's "dynamic" rank).
    rope_dim: d_rope, width of the RoPE part of the latent row (even; <= n_kv · head_dim, or <= head_dim
    for the shared-key inits). ``r_kv = d_rope = n_kv · head_dim`` is the exact rewrite at the GQA cache size.
    rope_init: "rorope" (TransMLA's RoRoPE: per frequency, an orthogonal mix of the KV heads' keys that
    commutes with RoPE, then the d_rope/2 components that carry the most positional attention keep RoPE),
    "perhead" (no mix: each KV head's own frequency pairs, MHA2MLA's per-head partial RoPE, by the same
    score), "xeco" (X-EcoMLA: evenly spaced pairs, one key = the head average) or "norm" (MHA2MLA's 2-norm
    pairs, key = the head average).
    dropped_rope: see :data:`DROPPED_ROPE`; rope_horizon: the relative distances (0 .. horizon - 1, uniform)
    that "mean" averages the rotation over and that the RoPE components are scored on.
    kv_fit: see :data:`KV_FITS`.
    q_rank: optional low-rank query (SVD of W_Q to r_q); None keeps W_Q full.
    absorb: attention path: True = absorbed (W_UK folded into the query, what is exported), False = naive.
    equalize_latent: rescale each latent channel, and each RoPE pair of the latent row, to the same largest
    magnitude on the calibration inputs (``kvexport.mla.rewrite.equalize_latent``); exact (the scales are folded
    into the down- and up-projections), it shrinks the rounding of an int8 cache's small channels, which a
    per-row scale sizes by the largest. ``kvexport convert`` / ``export`` turn it on for an int8 cache
    (docs/quantized.md).
    """

    kv_rank: int | None = None
    energy: float | None = None
    rope_dim: int = 32
    rope_init: str = ROPE_INITS[0]
    dropped_rope: str = DROPPED_ROPE[0]
    rope_horizon: int = 2048
    kv_fit: str = KV_FITS[0]
    q_rank: int | None = None
    absorb: bool = True
    equalize_latent: bool = False

    def __post_init__(self):
        if (self.kv_rank is None) == (self.energy is None):
            raise BadUsage("give exactly one of an MLA rank (--mla-rank R) or an energy threshold (--mla-energy δ)")
        if self.kv_rank is not None and int(self.kv_rank) < 1:
            raise BadUsage(f"MLA rank r_kv {self.kv_rank} must be >= 1")
        if self.energy is not None and not (0.0 < float(self.energy) <= 1.0):
            raise BadUsage(f"energy threshold δ {self.energy} is outside (0, 1]")
        if int(self.rope_dim) < 2 or int(self.rope_dim) % 2:
            raise BadUsage(f"RoPE dim d_rope {self.rope_dim} must be even and >= 2 (it holds frequency pairs)")
        for name, value, accepted in (("rope init", self.rope_init, ROPE_INITS),
                                      ("dropped-rope rule", self.dropped_rope, DROPPED_ROPE),
                                      ("latent fit", self.kv_fit, KV_FITS)):
            if value not in accepted:
                raise BadUsage(f"{name} {value!r} unknown; accepted: {', '.join(accepted)}")
        if int(self.rope_horizon) < 1:
            raise BadUsage(f"RoPE horizon {self.rope_horizon} must be >= 1 token")
        if self.q_rank is not None and int(self.q_rank) < 1:
            raise BadUsage(f"query rank r_q {self.q_rank} must be >= 1")

    def max_rope_dim(self, head_dim: int, num_kv_heads: int) -> int:
        return head_dim if self.rope_init in SHARED_KEY_INITS else num_kv_heads * head_dim

    def check_model(self, head_dim: int, hidden: int, num_kv_heads: int, qk_norm: bool = False) -> None:
        """Refuse settings this model cannot take (one line, :class:`BadUsage`)."""
        top = self.max_rope_dim(head_dim, num_kv_heads)
        if self.rope_dim > top:
            what = "head_dim" if self.rope_init in SHARED_KEY_INITS else "n_kv * head_dim"
            raise BadUsage(f"RoPE dim d_rope {self.rope_dim} is larger than the model's {what} {top} "
                           f"(rope init {self.rope_init})")
        mx = max_kv_rank(hidden, num_kv_heads, head_dim, self.rope_dim, qk_norm)
        if self.kv_rank is not None and self.kv_rank > mx:
            raise BadUsage(f"MLA rank r_kv {self.kv_rank} is larger than the rank of the stacked no-RoPE keys and "
                           f"values ({mx} = min(hidden {hidden}, 2*n_kv*head_dim - d_rope))")
        if self.q_rank is not None and self.q_rank > hidden:
            raise BadUsage(f"query rank r_q {self.q_rank} is larger than hidden_size {hidden}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the cache formats whose MLA rewrite equalizes the latent (:attr:`MLASettings.equalize_latent`): int8's one
#: rounding step per row; fp8 rounds each element relative to its own size and measured worse equalized
EQUALIZED_FORMATS = ("int8",)


def equalizes_latent(kv_dtype: str | None) -> bool:
    """Whether a rewrite for a ``kv_dtype`` cache equalizes the latent (convert, export and the benchmarks ask here)."""
    return kv_dtype in EQUALIZED_FORMATS


def max_kv_rank(hidden: int, num_kv_heads: int, head_dim: int, rope_dim: int, qk_norm: bool = False) -> int:
    """Rank bound of the stacked no-RoPE keys and values, ``2 n_kv d_h - d_rope`` dimensions (GQA repetition
    adds no rank): min(H, 2 n_kv d_h - d_rope); with Qwen3's k_norm the keys are not linear in h, so
    (n_kv d_h - d_rope) + min(H, n_kv d_h). At d_rope = n_kv d_h both are min(H, n_kv d_h)."""
    kv = num_kv_heads * head_dim
    if qk_norm:
        return max(kv - rope_dim, 0) + min(hidden, kv)
    return min(hidden, 2 * kv - rope_dim)


@dataclass
class MLALayerPlan:
    """One layer's resolved shapes: kv_rank r_kv, q_rank (or None), rope_pairs (d_rope/2 frequency indices
    into the original head's half-split RoPE layout, one per RoPE pair of the latent row; a frequency repeats
    when several KV heads or rotated components keep it)."""

    kv_rank: int
    rope_pairs: list[int] = field(default_factory=list)
    q_rank: int | None = None

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.rope_pairs)
