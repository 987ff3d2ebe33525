# SPDX-License-Identifier: Apache-2.0
"""Cache accounting for ``kvexport inspect``: elements and bytes per token and layer, per sequence, resident
bytes, and the ratio to the original cache, from a :class:`~kvexport.models.spec.ModelSpec` alone.

The formula has one owner, :class:`kvexport.cache.memory.CacheShape` (GQA/MHA ``2 · n_kv · d_h`` elements
per token and layer, MLA ``r_kv + d_rope``; a static budget holds ``budget + window`` slots per layer whatever
the context, else the whole context); this module only builds the shape from a spec and the inspect flags and
reports it. The original cache is the same model's GQA/MHA cache over the whole context, in the same element
type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvexport.cache.formats import DTYPE_NAMES, FORMATS, element_bytes
from kvexport.cache.memory import CacheShape
from kvexport.errors import BadUsage
from kvexport.models.spec import ModelSpec


@dataclass
class CacheReport:
    model: str
    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    vocab_size: int
    dtype: str
    bytes_per_element: int
    original_elements_per_token_layer: int
    elements_per_token_layer: list[int]  # per layer (MLA ranks may differ per layer)
    context: int
    tokens_held: int  # per layer and sequence
    budget: int | None
    window: int | None
    mla: dict[str, Any] | None
    mla_ranks: list[int] | None = None
    rope_dim: int = 0

    def shape(self, original: bool = False) -> CacheShape:
        """This cache (or with ``original``, the model's uncompressed GQA/MHA cache) as a CacheShape."""
        quantized = FORMATS[DTYPE_NAMES[self.dtype]].quantized
        kw: dict[str, Any] = {"kv_dtype": self.dtype} if quantized else {}
        ranks = None if original or self.mla_ranks is None else tuple(self.mla_ranks)
        return CacheShape(self.num_layers, self.num_kv_heads, self.head_dim, ranks,
                          0 if ranks is None else self.rope_dim,
                          budget=None if original else self.budget,
                          window=0 if original or self.window is None else self.window,
                          dtype_bytes=2 if quantized else self.bytes_per_element, query_heads=self.num_heads,
                          query_dim=None if ranks is not None else self.head_dim, vocab_size=self.vocab_size, **kw)

    @property
    def elements_per_token(self) -> int:
        return sum(self.elements_per_token_layer)

    @property
    def original_elements_per_token(self) -> int:
        return self.original_elements_per_token_layer * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        this, orig = self.shape(), self.shape(original=True)
        per_tok, orig_tok = this.bytes_per_token(), orig.bytes_per_token()
        scales = (per_tok - self.elements_per_token * self.bytes_per_element) // self.num_layers
        seq = this.bytes_at(self.context) + _scale_bytes(this, self.context)
        orig_seq = orig.bytes_at(self.context) + _scale_bytes(orig, self.context)
        d.update(
            elements_per_token=self.elements_per_token,
            bytes_per_token_layer=[e * self.bytes_per_element + scales for e in self.elements_per_token_layer],
            bytes_per_token=per_tok,
            original_elements_per_token=self.original_elements_per_token,
            original_bytes_per_token_layer=orig_tok // self.num_layers,
            original_bytes_per_token=orig_tok,
            per_token_ratio=orig_tok / per_tok,
            bytes_per_sequence=seq,
            original_bytes_per_sequence=orig_seq,
            ratio=orig_seq / seq,
            resident_bytes=this.resident_bytes_at(self.context)["total"],
            original_resident_bytes=orig.resident_bytes_at(self.context)["total"],
        )
        return d


def _scale_bytes(shape: CacheShape, context: int) -> int:
    """The float16 scales of a quantized cache (0 for float caches)."""
    f = getattr(shape, "scale_bytes_at", None)
    return int(f(context)) if f is not None else 0


def cache_report(spec: ModelSpec, *, model: str = "", mla_ranks: list[int] | None = None, rope_dim: int | None = None,
                 context: int = 4096, budget: int | None = None, window: int | None = None,
                 dtype: str = "float16", mla: dict[str, Any] | None = None) -> CacheReport:
    """Accounting from the spec alone (no weights). ``mla_ranks``: per-layer r_kv (or one value for all)."""
    if context < 1:
        raise BadUsage(f"--context {context} must be >= 1 token")
    if dtype not in DTYPE_NAMES:
        raise BadUsage(f"cache dtype {dtype!r} unknown; accepted: {', '.join(DTYPE_NAMES)}")
    if budget is not None and budget < 1:
        raise BadUsage(f"--budget {budget} must be >= 1")
    if window is not None and window < 1:
        raise BadUsage(f"--window {window} must be >= 1")
    if mla_ranks is not None:
        if rope_dim is None:
            raise BadUsage("an MLA rank needs --rope-dim D")
        mla_ranks = [int(r) for r in mla_ranks]
        if len(mla_ranks) == 1:
            mla_ranks = mla_ranks * spec.num_layers
    rep = CacheReport(model=model, family=spec.family, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, num_heads=spec.num_heads, vocab_size=spec.vocab_size, dtype=dtype,
                      bytes_per_element=element_bytes(dtype), original_elements_per_token_layer=0,
                      elements_per_token_layer=[], context=context, tokens_held=0, budget=budget,
                      window=window if budget is not None else None, mla=mla, mla_ranks=mla_ranks,
                      rope_dim=int(rope_dim or 0) if mla_ranks is not None else 0)
    this = rep.shape()
    rep.elements_per_token_layer = this.elements_per_token()
    rep.original_elements_per_token_layer = rep.shape(original=True).elements_per_token()[0]
    rep.tokens_held = this.slots(context)
    return rep
