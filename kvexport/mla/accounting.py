# SPDX-License-Identifier: Apache-2.0
"""Cache accounting: elements and bytes per token and layer, per sequence, and the ratio to the original cache.

Original (GQA/MHA) cache per token and layer: ``2 · n_kv · d_h`` elements (K and V). MLA: ``r_kv + d_rope``
(X-EcoMLA; the latent and the shared RoPE key, values are derived). With a static budget the cache holds
``budget + window`` slots per layer whatever the context (kvexport's static cache), else the whole context.
Query buffers of the static cache (window × heads × dim, for decode-time compaction) are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvexport.errors import BadUsage
from kvexport.models.spec import ModelSpec


@dataclass
class CacheReport:
    model: str
    family: str
    num_layers: int
    dtype: str
    bytes_per_element: int
    original_elements_per_token_layer: int
    elements_per_token_layer: list[int]  # per layer (MLA ranks may differ per layer)
    context: int
    tokens_held: int  # per layer and sequence
    budget: int | None
    window: int | None
    mla: dict[str, Any] | None

    @property
    def elements_per_token(self) -> int:
        return sum(self.elements_per_token_layer)

    @property
    def original_elements_per_token(self) -> int:
        return self.original_elements_per_token_layer * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        b = self.bytes_per_element
        per_tok = self.elements_per_token
        orig_tok = self.original_elements_per_token
        d.update(
            elements_per_token=per_tok,
            bytes_per_token_layer=[e * b for e in self.elements_per_token_layer],
            bytes_per_token=per_tok * b,
            original_elements_per_token=orig_tok,
            original_bytes_per_token_layer=self.original_elements_per_token_layer * b,
            original_bytes_per_token=orig_tok * b,
            per_token_ratio=orig_tok / per_tok,
            bytes_per_sequence=per_tok * b * self.tokens_held,
            original_bytes_per_sequence=orig_tok * b * self.context,
            ratio=(orig_tok * self.context) / (per_tok * self.tokens_held),
        )
        return d


DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "int8": 1, "fp8": 1}


def cache_report(spec: ModelSpec, *, model: str = "", mla_ranks: list[int] | None = None, rope_dim: int | None = None,
                 context: int = 4096, budget: int | None = None, window: int | None = None,
                 dtype: str = "float16", mla: dict[str, Any] | None = None) -> CacheReport:
    """Accounting from the spec alone (no weights). ``mla_ranks``: per-layer r_kv (or one value for all)."""
    if context < 1:
        raise BadUsage(f"--context {context} must be >= 1 token")
    if dtype not in DTYPE_BYTES:
        raise BadUsage(f"cache dtype {dtype!r} unknown; accepted: {', '.join(DTYPE_BYTES)}")
    if budget is not None and budget < 1:
        raise BadUsage(f"--budget {budget} must be >= 1")
    if window is not None and window < 1:
        raise BadUsage(f"--window {window} must be >= 1")
    orig = 2 * spec.num_kv_heads * spec.head_dim
    if mla_ranks is not None:
        if rope_dim is None:
            raise BadUsage("an MLA rank needs --rope-dim D")
        if len(mla_ranks) == 1:
            mla_ranks = mla_ranks * spec.num_layers
        per_layer = [int(r) + int(rope_dim) for r in mla_ranks]
    else:
        per_layer = [orig] * spec.num_layers
    held = context if budget is None else min(context, budget + (window or 0))
    # a static cache is allocated at capacity: budget + window slots whatever the context
    if budget is not None:
        held = budget + (window or 0)
    return CacheReport(model=model, family=spec.family, num_layers=spec.num_layers, dtype=dtype,
                       bytes_per_element=DTYPE_BYTES[dtype], original_elements_per_token_layer=orig,
                       elements_per_token_layer=per_layer, context=context, tokens_held=held, budget=budget,
                       window=window if budget is not None else None, mla=mla)
