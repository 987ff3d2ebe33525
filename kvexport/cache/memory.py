# SPDX-License-Identifier: Apache-2.0
"""Memory accounting of a cache, stated once: the kinds of buffer a sequence keeps resident, how a runtime measures
what it allocated (:func:`measure`), and the analytic formula (:class:`CacheShape`) the measurements are held to.

Buffer kinds (:data:`KINDS`), named by the graphs' tensor names (:func:`kind_of`)::

    kv               k_i, v_i          K/V (or the MLA latent) as stored: codes for int8 / fp8
    scales           ks_i, vs_i        float16 scales of a quantized format
    positions        pos_i             int64 position of every slot
    queries          qbuf_i            the press's query ring
    query_positions  qpos              the ring's positions
    step_outputs     *_new_i           a decode step's new rows (or a growing past's spare buffer)
    logits           logits            the step's logits
    staging          (prefill)         a prefill chunk's rows, held only while a prompt is fed

Elements cached per token and layer:
    GQA/MHA:  2 * n_kv * d_h             (keys and values of every KV head)
    MLA:      r_kv + d_rope              (the shared latent and the decoupled RoPE key; X-EcoMLA,
                                          see REFERENCE.md section 2), r_kv may differ per layer
Bytes per element: the cache format's (``kv_dtype``, :mod:`kvexport.cache.formats`: 4 fp32, 2 fp16 / bf16, 1 int8 /
fp8); a quantized format adds one float16 scale per row (per token, cache head and tensor: keys and values, or
the latent alone), ``2 * 2 * n_kv`` (GQA) or ``2`` (MLA) bytes per token and layer, counted as ``scales``.
A static-budget cache allocates its plan's capacities (``budget + window`` slots per layer,
:attr:`kvexport.cache.plan.CachePlan.capacities`) and never holds more (PyramidKV: a budget per layer); one read in
buckets (``read_buckets``, plan rule 7b) holds the bucket of its tokens while that is at most half the capacity,
then the capacity (a server's bank of slots holds the capacity from the start); a full
cache holds every token of the context (a static export without a press holds the bucket of the context, at most
its ``capacity``: :func:`kvexport.cache.plan.bucket_slots`, the plan's rule 7).

Memory as held (:meth:`CacheShape.resident_bytes_at`): every buffer a sequence keeps, not only K/V —
positions (int64 per slot and cache head; one row per token for a growing past), the press's query ring
(``window`` pre-RoPE queries per layer, ``query_heads x query_dim``, plus one int64 position row), a static
runtime's logits buffer, and for a runtime that ping-pongs its caches (onnxruntime) a second copy of every
cache buffer. The runtimes report what they allocated (:func:`measure` of their buffers); tests hold the two
together. Not held, so not counted: a server's bank reading in buckets (:mod:`kvexport.cache.plan` rule 7b) copies
the bucket it hands a prefill chunk or decode step, at most half its cache buffers' bytes, for that call only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvexport.cache.formats import SCALE_BYTES, element_bytes, kv_format
from kvexport.cache.plan import bucket_slots, capacities

#: every kind of buffer a runtime holds for its sequences, in report order
KINDS = ("kv", "scales", "positions", "queries", "query_positions", "step_outputs", "logits", "staging")


def kind_of(name: str) -> str:
    """A buffer's graph name -> its kind (:data:`KINDS`)."""
    if "_new_" in name:  # k_new_ v_new_ ks_new_ vs_new_ q_new_ kf_new_ vf_new_
        return "step_outputs"
    if name == "logits":
        return "logits"
    if name.startswith(("k_", "v_")):
        return "kv"
    if name.startswith(("ks_", "vs_")):
        return "scales"
    if name.startswith("pos_"):
        return "positions"
    if name.startswith("qbuf_"):
        return "queries"
    if name == "qpos":
        return "query_positions"
    raise ValueError(f"{name!r} is not a cache buffer name")


def nbytes(buf) -> int:
    """Bytes of a buffer (a NumPy array, a torch tensor, an onnxruntime OrtValue); 0 for None."""
    if buf is None:
        return 0
    if hasattr(buf, "element_size"):
        return int(buf.numel() * buf.element_size())
    if hasattr(buf, "nbytes"):
        return int(buf.nbytes)
    return int(buf.numpy().nbytes)


def measure(buffers, staging=()) -> dict[str, int]:
    """What a runtime holds, measured from its own allocations: ``buffers`` (name -> buffer, or (name, buffer)
    pairs: one name may come back, e.g. per slot) by :func:`kind_of`, plus ``staging`` buffers; -> bytes by kind
    (every kind of :data:`KINDS`) and ``total``."""
    out = dict.fromkeys(KINDS, 0)
    items = buffers.items() if hasattr(buffers, "items") else buffers
    for name, buf in items:
        out[kind_of(name)] += nbytes(buf)
    out["staging"] += sum(nbytes(b) for b in staging)
    out["total"] = sum(out.values())
    return out


@dataclass(frozen=True)
class CacheShape:
    """The cache layout of one model: ``mla_ranks`` None = GQA/MHA, else one r_kv per layer.

    ``budget``: tokens kept per layer (None = full cache); ``layer_budgets`` overrides it per layer (PyramidKV).
    ``capacity``: the most slots of a static full cache (a static export without a press), held in buckets.
    ``query_heads`` / ``query_dim``: the query ring's shape (GQA: num_heads x head_dim; MLA: r_kv + d_rope).
    ``dtype_bytes``: the model's element size (queries, logits); ``kv_dtype``: how K/V are stored (None: as the
    model's dtype).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    mla_ranks: tuple[int, ...] | None = None
    rope_dim: int = 0
    budget: int | None = None  # None = full cache (grows with the context)
    window: int = 0
    dtype_bytes: int = 4
    capacity: int | None = None
    query_heads: int | None = None
    query_dim: int | None = None
    vocab_size: int = 0
    layer_budgets: tuple[int, ...] | None = None
    kv_dtype: str | None = None
    read_buckets: bool = False  # an evicting cache held in the bucket of its tokens while that is <= capacity / 2

    @property
    def kv_format(self):
        return kv_format(self.kv_dtype, {4: "fp32", 2: "fp16"}[self.dtype_bytes])

    def scaled_tensors(self) -> int:
        """Rows with a scale per token and cache head: 2 (keys, values) for GQA, 1 (the latent) for MLA, 0 unless
        quantized."""
        if not self.kv_format.quantized:
            return 0
        return 1 if self.mla_ranks is not None else 2

    def _ranks(self) -> list[int]:
        r = list(self.mla_ranks)
        return r * self.num_layers if len(r) == 1 else r

    def elements_per_token(self) -> list[int]:
        """Per layer: cached elements per token."""
        if self.mla_ranks is not None:
            return [int(r) + int(self.rope_dim) for r in self._ranks()]
        return [2 * self.num_kv_heads * self.head_dim] * self.num_layers

    def cache_heads(self) -> int:
        return 1 if self.mla_ranks is not None else self.num_kv_heads

    @property
    def evicting(self) -> bool:
        return self.budget is not None or self.layer_budgets is not None

    def layer_slots(self, context: int) -> list[int]:
        """Slots allocated per layer for a sequence of ``context`` tokens."""
        if self.layer_budgets is not None:
            return list(capacities(self.layer_budgets, self.window))
        if self.budget is not None:
            caps = list(capacities([self.budget] * self.num_layers, self.window))
            if self.read_buckets:  # kvexport.cache.plan rule 7b: the bucket of the context while <= half of it
                n = bucket_slots(context, min(caps))
                return [n] * self.num_layers if 2 * n <= min(caps) else caps
            return caps
        if self.capacity:  # a static full cache: the bucket of the context (kvexport.cache.plan rule 7)
            return [bucket_slots(context, self.capacity)] * self.num_layers
        return [int(context)] * self.num_layers

    def slots(self, context: int) -> int:
        """Slots of the largest layer (all layers unless PyramidKV)."""
        return max(self.layer_slots(context))

    def bytes_per_token(self) -> int:
        """K/V bytes per cached token, all layers, their scales included."""
        scales = self.num_layers * self.cache_heads() * self.scaled_tensors() * SCALE_BYTES
        return sum(self.elements_per_token()) * self.kv_format.element_bytes + scales

    def bytes_at(self, context: int, batch: int = 1) -> int:
        """K/V (or latent) storage bytes resident for ``batch`` sequences of ``context`` tokens (scales apart)."""
        return batch * self.kv_format.element_bytes * sum(s * e for s, e in zip(self.layer_slots(context),
                                                                                   self.elements_per_token(), strict=True))

    def scale_bytes_at(self, context: int, batch: int = 1) -> int:
        """Bytes of the float16 scales of a quantized cache (one per slot, cache head and scaled tensor)."""
        return batch * self.cache_heads() * self.scaled_tensors() * SCALE_BYTES * sum(self.layer_slots(context))

    def index_bytes_at(self, context: int, batch: int = 1) -> int:
        """int64 positions of a static cache (per slot and cache head); a growing past keeps one row per token."""
        if not self.evicting and not self.capacity:
            return batch * int(context) * 8
        return batch * self.cache_heads() * sum(self.layer_slots(context)) * 8

    def resident_bytes_at(self, context: int, batch: int = 1, double_buffer: bool = False,
                          in_place: bool = False) -> dict[str, int]:
        """Every byte held for ``batch`` sequences of ``context`` tokens while decoding, by kind, and ``total``.

        ``double_buffer``: a growing past whose runtime keeps the next step's present in a second buffer of the
        cache's size (kvexport's onnxruntime runner on CPU), counted in ``step_outputs``; without it the growing
        past is counted as the cache a sequence keeps (the original model's, in the MLA accounting). ``in_place``:
        the decode step writes its rows into the cache itself (an export's ``decode_inplace`` graph), so the only
        step outputs are the press's queries."""
        out = {"kv": self.bytes_at(context, batch), "scales": self.scale_bytes_at(context, batch),
               "positions": self.index_bytes_at(context, batch), "queries": 0, "query_positions": 0}
        if self.evicting:
            if self.query_heads is None:
                raise ValueError("resident bytes of an evicting cache need query_heads (and query_dim for GQA)")
            dims = self.elements_per_token() if self.mla_ranks is not None else [self.query_dim or self.head_dim] * \
                self.num_layers
            out["queries"] = batch * self.query_heads * self.window * sum(dims) * self.dtype_bytes
            out["query_positions"] = batch * self.window * 8
        static = self.evicting or bool(self.capacity)  # a growing past returns a new present each step instead
        out["step_outputs"] = self.step_bytes(batch, 1, rows=not in_place) if static else \
            (self.bytes_at(context, batch) if double_buffer else 0)
        out["logits"] = batch * self.vocab_size * self.dtype_bytes if static else 0
        out["staging"] = 0
        out["total"] = sum(out.values())
        return out

    def step_bytes(self, batch: int, tokens: int, rows: bool = True) -> int:
        """New rows a step of ``tokens`` tokens returns (keys and values as stored, with their scales, and with a
        press the queries), all layers; ``rows=False``: the queries only (rows written into the cache in place)."""
        stored = sum(self.elements_per_token()) * self.kv_format.element_bytes
        stored += self.num_layers * self.cache_heads() * self.scaled_tensors() * SCALE_BYTES
        stored *= int(rows)
        queries = 0
        if self.evicting:
            dims = self.elements_per_token() if self.mla_ranks is not None else [self.query_dim or self.head_dim] * \
                self.num_layers
            queries = (self.query_heads or 0) * sum(dims) * self.dtype_bytes
        return batch * tokens * (stored + queries)

    @classmethod
    def from_export(cls, settings: dict[str, Any], banked: bool = False) -> "CacheShape":
        """The cache of an export directory (its manifest ``settings``) as one batch of sequences holds it;
        ``banked``: as a server's bank of slots holds each (at its capacity, never in read buckets)."""
        spec = settings["spec"]
        mla = settings.get("mla")
        ranks = tuple(int(r) for r in mla["kv_ranks"]) if mla else None
        budgets = settings.get("budgets")
        static = settings["mode"] == "static"
        return cls(int(settings["num_layers"]), int(spec["num_kv_heads"]), int(spec["head_dim"]), ranks,
                   int(mla["rope_dim"]) if mla else 0, budget=int(max(budgets)) if budgets else None,
                   window=int(settings["window"] or 0), dtype_bytes=element_bytes(settings["dtype"]),
                   capacity=int(min(settings["capacities"])) if static and not budgets else None,
                   query_heads=int(spec["num_heads"]), query_dim=None if ranks else int(spec["head_dim"]),
                   vocab_size=int(settings["vocab_size"]),
                   layer_budgets=tuple(int(b) for b in budgets) if budgets and len(set(budgets)) > 1 else None,
                   kv_dtype=settings.get("kv_dtype"),
                   read_buckets=bool(settings.get("read_buckets")) and bool(budgets) and not banked)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "mla_ranks": list(self.mla_ranks) if self.mla_ranks is not None else None,
            "rope_dim": self.rope_dim, "budget": self.budget, "window": self.window,
            "layer_budgets": list(self.layer_budgets) if self.layer_budgets is not None else None,
            "dtype_bytes": self.dtype_bytes, "capacity": self.capacity, "bytes_per_token": self.bytes_per_token(),
            "query_heads": self.query_heads, "query_dim": self.query_dim, "vocab_size": self.vocab_size,
            "kv_dtype": self.kv_format.name,
        }


def full_cache_of(shape: CacheShape) -> CacheShape:
    """The uncompressed baseline of the same model: GQA, full cache, same dtype."""
    return CacheShape(shape.num_layers, shape.num_kv_heads, shape.head_dim, None, 0, None, 0, shape.dtype_bytes,
                      query_heads=shape.query_heads, vocab_size=shape.vocab_size)


def cache_table(shape: CacheShape, contexts: list[int], batch: int = 1) -> dict[str, Any]:
    """Per context: K/V bytes of this cache and of the full-cache baseline, their ratio, index bytes, and the
    resident bytes (every buffer, :meth:`CacheShape.resident_bytes_at`) when the shape knows its query ring."""
    base = full_cache_of(shape)
    rows = []
    for c in contexts:
        b, f = shape.bytes_at(c, batch), base.bytes_at(c, batch)
        row = {"context": int(c), "kv_bytes": b, "baseline_kv_bytes": f, "ratio": f / b if b else None,
               "index_bytes": shape.index_bytes_at(c, batch)}
        if shape.query_heads is not None or not shape.evicting:
            row["resident_bytes"] = shape.resident_bytes_at(c, batch)["total"]
            row["baseline_resident_bytes"] = base.resident_bytes_at(c, batch)["total"]
        rows.append(row)
    return {
        "shape": shape.to_dict(),
        "bytes_per_token": shape.bytes_per_token(),
        "baseline_bytes_per_token": base.bytes_per_token(),
        "per_token_ratio": base.bytes_per_token() / shape.bytes_per_token(),
        "contexts": rows,
    }


__all__ = ["CacheShape", "full_cache_of", "cache_table", "KINDS", "kind_of", "nbytes", "measure"]
