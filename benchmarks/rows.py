# SPDX-License-Identifier: Apache-2.0
"""The benchmark's rows (what a user would run) and model shapes, with the analytic KV-cache size of each.

Rows, all greedy decoding at batch 1 of the same model and prompt:

    hf              transformers ``generate`` in PyTorch, full (growing) cache
    optimum         ``optimum-cli export onnx --task text-generation-with-past`` on onnxruntime (own venv)
    ortgenai        onnxruntime-genai's model builder: GroupQueryAttention over a preallocated past/present buffer
                    shared in place (own venv), the strongest full-cache CPU runtime
    ortgenai-int4   the same builder with ``-p int4`` (MatMulNBits block-quantized weights), what a CPU user runs
    llamacpp        llama.cpp (llama-cpp-python, own venv) on the shape's GGUF as shipped (smollm2: Q4_1), K/V fp16
    kvx-full        kvexport ``--press none``: a full cache of up to the run's largest context, written in place,
                    held in power-of-two buckets (kvexport.cache.plan rule 7)
    kvx-full-inplace  kvx-full with ``--inplace-decode`` (decode_inplace.ort.onnx over the full cache): issue 33's
                    "full-cache in-place decode no slower than decode.onnx at any length"
    kvx-snapkv      kvexport static budget, SnapKV, budget + window slots per layer
    kvx-streaming   kvexport static budget, StreamingLLM
    kvx-snapkv-std  kvx-snapkv without the in-place decode graph: decode.onnx, standard ONNX ops only (the graph
                    TensorRT runs; kvx-snapkv and kvx-streaming decode through decode_inplace.ort.onnx,
                    onnxruntime's GroupQueryAttention writing the cache in place; kvx-full does not: over a 16k
                    full cache that graph measured slower than decode.onnx's two-part read, docs/benchmarks.md)
    kvx-mla-full    kvexport MLA latent cache (r_kv + d_rope per token and layer, ≈6.4× smaller), static full cache
    kvx-mla-snapkv  MLA + SnapKV static budget
    kvx-default     the export ``kvexport convert MODEL`` makes with its defaults (kvexport.convert.config: SnapKV
                    2048 + 32 with lookahead and neighbours, chunk 512, int8 cache), fp32 weights; shapes that ship
                    a GGUF (the real model) only, like the two peers below it in ``ROWS``
    kvx-default-int4  the same with ``--weights int4`` (onnxruntime's MatMulNBits)
    kvx-default-int4-a8  the same with ``--weights int4-a8`` (MatMulNBits with int8 activations, accuracy level 4:
                    the arithmetic onnxruntime-genai's int4 row runs)
    kvx-default-fp16  the same with ``--weights fp16`` (on request: issue 33's share of the bound for fp16 weights;
                    onnxruntime's CPU MatMul is float32, so each weight is cast up as it is read)

Shapes: ``student`` (models/kvx-student), ``llama1b`` (Llama-3.2-1B's hidden size, heads, KV heads, head dim
and MLP width with 2 layers, random weights), ``llama1b-16`` (all 16 layers, the vocabulary cut to 32k: decode
cost of the real size; its static-budget cells start from a synthesised cache, see benchmarks/cell.py),
``smollm2`` (SmolLM2-135M-Instruct, the real model: ``kvexport get smollm2``'s GGUF for llama.cpp, its fp32
dequantization for every other row), ``tiny`` (CI smoke test).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvexport.cache.memory import CacheShape
from kvexport.cache.plan import DEFAULT_WINDOW


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "hf" | "optimum" | "ortgenai" | "llamacpp" | "kvx"
    label: str
    press: str | None = None
    mla: bool = False
    dynamic_cache: bool = False
    full: bool = False  # a static full cache (capacity = the run's largest prompt + steps)
    inplace: bool = False  # also the in-place decode graph (decode_inplace.ort.onnx), which onnxruntime then runs
    precision: str = "fp32"  # onnxruntime-genai builder's -p
    kv_dtype_bytes: int = 4  # bytes per cached K/V element (llama.cpp: fp16)
    real_model_peer: bool = False  # in the default rows only when a shape ships a GGUF (the real model)
    on_request: bool = False  # never in the default rows: only when named in --rows
    #: the export ``kvexport convert MODEL`` makes with no compression flag (kvexport.convert.config's defaults,
    #: through kvexport.convert.exporting.export_settings), with ``weights`` as ``--weights``; no batched graph
    convert_defaults: bool = False
    weights: str | None = None

    @property
    def static_budget(self) -> bool:
        return self.press is not None or self.convert_defaults

    def export_kwargs(self, shape: "Shape", capacity: int | None = None) -> dict[str, Any]:
        """Keyword arguments of ``kvexport.export.export_model`` for this row on ``shape`` (``capacity``: the
        static full cache's slots)."""
        if self.convert_defaults:
            return _convert_default_kwargs(shape, self.weights)
        kw: dict[str, Any] = {"chunk": shape.chunk, "window": shape.window}
        if self.dynamic_cache:
            kw.update(press="none", dynamic_cache=True)
        if self.full:
            kw.update(press="none", max_positions=int(capacity or shape.max_positions))
        if self.press is not None:
            kw.update(press=self.press, budget=shape.budget)
        if self.mla:
            kw.update(mla_rank=shape.mla_rank, rope_dim=shape.rope_dim)
        if self.inplace:
            kw.update(inplace_decode=True)
        return kw


def _convert_default_kwargs(shape: "Shape", weights: str | None) -> dict[str, Any]:
    """``export_model`` keywords of ``kvexport convert`` with its defaults on a model of ``shape``'s positions (the
    default budget fits them, as the convert stage fits it)."""
    from kvexport.convert.config import ConvertConfig, default_budget
    from kvexport.convert.exporting import export_settings

    cfg = ConvertConfig(weights=weights, decode_batch=0).resolve()
    cfg.budget = default_budget(shape.max_positions)
    return export_settings(cfg)


ROWS: dict[str, Row] = {r.name: r for r in [
    Row("hf", "hf", "HF transformers generate (PyTorch, full cache)"),
    Row("optimum", "optimum", "HF Optimum ONNX export (onnxruntime, full cache)"),
    Row("ortgenai", "ortgenai", "onnxruntime-genai builder (GroupQueryAttention, shared past/present buffer)"),
    Row("ortgenai-int4", "ortgenai", "onnxruntime-genai builder -p int4 (MatMulNBits weights, fp32 cache)",
        precision="int4", real_model_peer=True),
    Row("llamacpp", "llamacpp", "llama.cpp (llama-cpp-python) on the GGUF as shipped, K/V cache fp16",
        kv_dtype_bytes=2, real_model_peer=True),
    Row("kvx-full", "kvx", "kvexport --press none: static full cache written in place (onnxruntime)", full=True),
    Row("kvx-full-inplace", "kvx", "kvx-full with --inplace-decode (onnxruntime's GroupQueryAttention over the full "
        "cache)", full=True, inplace=True, on_request=True),
    Row("kvx-default", "kvx", "kvexport convert's default export (SnapKV 2048 + 32, lookahead 64, neighbours 3, "
        "chunk 512, int8 cache), fp32 weights", convert_defaults=True, real_model_peer=True),
    Row("kvx-default-int4", "kvx", "the same with --weights int4 (MatMulNBits, block 32)", convert_defaults=True,
        weights="int4", precision="int4", real_model_peer=True),
    Row("kvx-default-int4-a8", "kvx", "the same with --weights int4-a8 (int8 activations, as onnxruntime-genai int4)",
        convert_defaults=True, weights="int4-a8", precision="int4", real_model_peer=True),
    Row("kvx-default-fp16", "kvx", "the same with --weights fp16 (MatMul weights stored in fp16)",
        convert_defaults=True, weights="fp16", precision="fp16", real_model_peer=True, on_request=True),
    Row("kvx-snapkv", "kvx", "kvexport SnapKV static budget", press="snapkv", inplace=True),
    Row("kvx-streaming", "kvx", "kvexport StreamingLLM static budget", press="streaming_llm", inplace=True),
    Row("kvx-snapkv-std", "kvx", "kvexport SnapKV static budget, standard decode graph (what TensorRT runs)",
        press="snapkv"),
    Row("kvx-mla-full", "kvx", "kvexport MLA latent cache (≈6.4× smaller per token), static full cache", mla=True,
        full=True),
    Row("kvx-mla-snapkv", "kvx", "kvexport MLA + SnapKV static budget", press="snapkv", mla=True),
]}


@dataclass(frozen=True)
class Shape:
    """A model shape: where its HF checkpoint comes from and the kvexport settings used on it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    budget: int = 256
    window: int = DEFAULT_WINDOW
    chunk: int = 128
    mla_rank: int = 128
    rope_dim: int = 32
    source: str | None = None  # a local HF directory, "registry:NAME" (kvexport get NAME), None = random weights
    max_context: int | None = None  # the full run's largest context column on this shape (prefill time)
    tie: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def cache_shape(self, row: Row, dtype_bytes: int = 4, capacity: int | None = None) -> CacheShape:
        """Analytic cache layout of ``row`` on this shape (kvexport.cache.memory); ``capacity``: a static full
        cache's slots."""
        budget, window, kv_dtype = self.budget, self.window, None
        if row.convert_defaults:  # what the row exports, not a second copy of convert's defaults
            kw = row.export_kwargs(self)
            budget, window, kv_dtype = kw["press"].budget, kw["window"], kw["kv_dtype"]
        return CacheShape(num_layers=self.layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                          mla_ranks=(self.mla_rank,) * self.layers if row.mla else None,
                          rope_dim=self.rope_dim if row.mla else 0,
                          budget=budget if row.static_budget else None,
                          window=window if row.static_budget else 0, dtype_bytes=dtype_bytes,
                          capacity=capacity if row.full else None, query_heads=self.heads,
                          query_dim=self.head_dim, vocab_size=self.vocab, kv_dtype=kv_dtype)

    def kv_bytes(self, row: Row, context: int, capacity: int | None = None) -> int:
        """K/V bytes held for one sequence of ``context`` tokens: budget + window slots with a press, the
        bucket of a static full cache (power-of-two, at most its capacity), else every token (growing caches)."""
        return self.cache_shape(row, row.kv_dtype_bytes, capacity).bytes_at(context)

    @property
    def gguf(self) -> str | None:
        """The registry name of the GGUF this shape comes from (what llama.cpp runs), else None."""
        return self.source.split(":", 1)[1] if self.source and self.source.startswith("registry:") else None

    def mla_ratio(self) -> float:
        return (2 * self.kv_heads * self.head_dim) / (self.mla_rank + self.rope_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SHAPES: dict[str, Shape] = {
    # the reference student: hidden 128, 4 layers, 4 heads / 2 KV heads of 32, max positions 32768.
    # 2·2·32 = 128 cache elements per token and layer; r_kv 12 + d_rope 8 = 20 -> 6.4×.
    "student": Shape("student", hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384,
                     vocab=4096, max_positions=32768, mla_rank=12, rope_dim=8, source="models/kvx-student"),
    # Llama-3.2-1B's per-layer shape (hidden 2048, 32 heads, 8 KV heads of 64, MLP 8192), 2 layers, a 32k
    # vocabulary (1B's 128k vocabulary would make the LM head most of a step). r_kv 128 + d_rope 32 -> 6.4×.
    # Prefill costs ~0.5 GFLOP per token (2 × 250M multiply-adds), whatever the cache: on a shared 2-core CPU
    # 2k tokens take ~30 s and 8k more than the 150 s cell limit, so the default columns stop at 2k
    # (--contexts overrides).
    "llama1b": Shape("llama1b", hidden=2048, layers=2, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                     vocab=32000, max_positions=32768, mla_rank=128, rope_dim=32, max_context=2048),
    # Llama-3.2-1B itself (16 layers, hidden 2048, 32/8 heads of 64, MLP 8192), vocabulary cut to 32k (1.0B
    # parameters, 4.0 GB fp32): the decode step at the real size. Prefilling 16k tokens would take ~10 min of
    # this CPU, so the static-budget rows start each cell from a synthesised cache (same slots, positions up to
    # the context; benchmarks/cell.py) and the full-cache rows run the short contexts only.
    "llama1b-16": Shape("llama1b-16", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                        vocab=32000, max_positions=32768, mla_rank=128, rope_dim=32, max_context=16384,
                        extra={"synthesize": True, "full_rows_max_context": 2048}),
    # SmolLM2-135M-Instruct, the real model (kvexport get smollm2): the registry's GGUF (Q4_1) for llama.cpp, the HF
    # directory kvexport dequantizes from it (fp32, 538 MB) for every other row. 8k positions: the "8k" column's prompt
    # is 8192 - 64 - 1 - 128 = 7999 tokens.
    "smollm2": Shape("smollm2", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                     vocab=49152, max_positions=8192, source="registry:smollm2",
                     max_context=8192),
    # CI smoke test: tiny, fast to export. 2·2·16 = 64 elements per token and layer; 8 + 2 = 10 -> 6.4×.
    "tiny": Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                  max_positions=1024, budget=96, window=8, chunk=32, mla_rank=8, rope_dim=2),
}

CONTEXTS_FULL = [512, 2048, 8192, 16384, 32768]
CONTEXTS_QUICK = [512, 2048]
CONTEXTS_TINY = [128, 256]


def prompt_tokens(shape: Shape, context: int, steps: int) -> int:
    """Prompt length for a context column: the context itself, less room for decoding and one prefill chunk
    of padding when it would not fit the model's positions (the "32k" column on a 32768-position model)."""
    room = steps + 1 + shape.chunk
    return min(int(context), shape.max_positions - room)
