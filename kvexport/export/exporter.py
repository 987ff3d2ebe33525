# SPDX-License-Identifier: Apache-2.0
"""``export_model``: a HF causal LM (optionally MLA-rewritten, with a press) -> a directory of ONNX graphs.

Exporter: ``torch.onnx.export(dynamo=True)`` (torch.export, then onnxscript's translation) with a
``custom_translation_table`` that emits the ``kvexport`` custom nodes; the model-local functions and the
op schemas are added afterwards (:mod:`kvexport.ops`). The models call the custom ops themselves (each op module's
model-facing function is the custom op while torch.export traces), so nothing is patched for the export. It was chosen over the TorchScript exporter
because it traces the press's Python ``score()`` without scripting, is the maintained path in torch 2.13,
and gives the same bytes on every run once node metadata (stack traces) is stripped.

Layout of an export directory (static caches)::

    prefill.onnx           a chunk of exactly C tokens over the cache -> logits and the chunk's new rows (with a
                           lookahead L: C + L columns, the chunk then its tail -> also the tail's queries q_tail_i)
    decode.onnx            one token per row over the cache -> logits and its new rows (the host writes them)
    compact_prefill.onnx   a chunk's compaction: the best budget of [cache ; chunk] (absent without a press)
    compact_prefill_tail.onnx  the same, observed by the chunk's lookahead tail (only with a lookahead)
    prefill_last.onnx      with a lookahead: the prompt's last chunk, which has no tail, as C columns (prefill.onnx
                           would compute L columns of padding for it)
    compact.onnx           decode-time compaction of every layer (absent without a press)
    weights.data   every graph's weights (initializers >= 1 KiB), each tensor once: the graphs share it by offset
    tokenizer/     the source model's tokenizer files, when it has them
    manifest.json  settings, model hash and sha256 of every file (kvexport.manifest)

A full cache (no press) of more than :data:`~kvexport.cache.plan.MIN_BUCKET` slots is exported with its capacity
axis (axis 2 of every cache tensor) as one dynamic dimension ``capacity`` (manifest ``dynamic_capacity``), so the
runtime can hold it in buckets (plan rule 7). Static budgets keep fixed shapes, except in the graphs that read the
cache without compacting it (prefill, prefill_last, decode, decode_batch) when every layer has the same budget
(manifest ``read_buckets``): a call is handed only the bucket of the occupied slots (plan rule 7b), so a prompt's
first chunks and the decode steps of a short sequence do not read the empty capacity. With a press or without, the
graph of a prompt's last chunk (``prefill_last``, or ``prefill`` without a lookahead; manifest ``ragged_last``) also
takes its column axis as a dynamic dimension in [2, C]: a last chunk that does not compact (a full cache's never
does) is fed without its padding columns (plan rule 2b), so a 256-token prompt costs 256 columns, not C.

``--dynamic-cache`` writes ``model.onnx`` instead: full cache with a growing past (the Optimum baseline).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvexport.cache.plan import DEFAULT_WINDOW, MIN_BUCKET, capacities
from kvexport.errors import BadUsage
from kvexport.export import graphs
from kvexport.export.onnx_graph import SharedWeights, _export_graph
from kvexport.export.source import DTYPES, _hash_model, press_to_dict, resolve_decoder, resolve_press
from kvexport.manifest import ONNX_EXPORT as KIND
from kvexport.manifest import ORT_ONLY_SUFFIX, atomic_output, check_out_dir, write_manifest
from kvexport.models.loading import TOKENIZER_FILES
from kvexport.quant.weights import check_weights, quantize_export

# torch's exporter warns once per graph that torchvision's ops are not registered; they are never used here
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

INPLACE_FILE = "decode_inplace" + ORT_ONLY_SUFFIX  # the in-place decode step (onnxruntime, CPU)


# ----------------------------------------------------------------------------- model resolution


# ----------------------------------------------------------------------------- example inputs
def kv_examples(shapes: list[graphs.LayerShape], batch: int, dtype) -> list:
    return graphs.cache_examples(shapes, batch, dtype)


def query_examples(shapes: list[graphs.LayerShape], batch: int, window: int, dtype) -> list:
    return [torch.zeros(batch, s.q_heads, window, s.q_dim, dtype=dtype) for s in shapes] + [
        torch.full((batch, window), -1, dtype=torch.long)]


# ----------------------------------------------------------------------------- the entry point
def export_model(model, out_dir, *, press=None, budget: int | None = None, ratio: float | None = None,
                 window: int = DEFAULT_WINDOW, mla_rank: int | None = None, rope_dim: int | None = None, batch: int = 1,
                 chunk: int = 128, dtype: str = "fp32", ops: str = "custom", dynamic_cache: bool = False,
                 force: bool = False, max_positions: int | None = None, source: str | Path | None = None,
                 tokenizer_dir: str | Path | None = None, original: str | Path | None = None,
                 decode_batch: int | None = None, progress=None, kv_dtype: str | None = None,
                 inplace_decode: bool = False, lookahead: int = 0, weights: str | None = None) -> Path:
    """Export ``model`` to ``out_dir`` (written atomically; see the module docstring for the layout).

    model: HF model directory, ``.gguf`` file (:mod:`kvexport.models.gguf`), in-memory HF ``*ForCausalLM``, or a
    kvexport Decoder (MLA-rewritten or not).
    press/budget/window: eviction (static capacity budget + window per layer); press None = full cache with
    capacity ``max_positions`` (or, with ``dynamic_cache``, the growing-past baseline).
    mla_rank/rope_dim: rewrite to MLA first (X-EcoMLA SVD init), decode through LatentAttention.
    batch/chunk: static batch and prefill chunk; decode_batch: also a ``decode_batch.onnx`` decoding that many rows at
    once (sequences at their own positions and fills: a server's slots; prefill and compaction run per row with
    the batch-``batch`` graphs on row views of the same cache; the weights are shared, not copied);
    kv_dtype: how the cache stores K/V (or the MLA latent): fp32, fp16, bf16, int8, fp8 (default: ``dtype``;
    kvexport.cache.formats, docs/quantized.md);
    inplace_decode: also a ``decode_inplace.ort.onnx`` for onnxruntime on the CPU: the decode step through
    onnxruntime's GroupQueryAttention over the cache buffers, writing the token's slot in place (GQA models, the
    cache in the model's dtype; TensorRT ignores the file and runs ``decode.onnx``);
    lookahead: the prompt's last L columns observe every earlier prefill chunk (kvexport.cache.plan rule 3b): the
    prefill graph takes C + L columns and ``compact_prefill_tail.onnx`` compacts a chunk its tail observes (a press
    that observes only);
    weights: None or "fp32" (the weights as traced), "fp16", "int4" or "int4-qdq": the graphs' MatMul weights
    rewritten by :func:`kvexport.quant.quantize_export` before the directory is moved into place (the manifest's
    ``weights`` entry; docs/quantized.md); needs dtype "fp32";
    dtype "fp32"/"fp16"; ops "custom" (kvexport nodes backed
    by local functions) or "standard" (the functions inlined). Returns the output directory.
    source: for an in-memory ``model``, the directory its reference model lives in (an HF or saved MLA
    directory holding the same weights): recorded in the manifest (absolute, and relative to the export so a
    moved conversion still finds it), so ``validate`` needs no ``model=``. tokenizer_dir: where to copy the
    tokenizer from (default: ``source``, or the model directory). original: the uncompressed HF model directory
    this export's model was converted from (recorded so that ``validate`` can measure fidelity against it; by
    default the model directory itself when it is an HF one). progress: ``progress(message)`` per graph.
    """
    opsel = ops
    from kvexport import ops as ops_mod

    if opsel not in ("custom", "standard"):
        raise BadUsage(f"--ops {opsel!r} unknown; accepted: custom, standard")
    if dtype not in DTYPES:
        raise BadUsage(f"--dtype {dtype!r} unknown; accepted: {', '.join(DTYPES)}")
    kv_dtype = graphs.check_kv_dtype(kv_dtype, dtype, dynamic_cache)
    weights = check_weights(weights, dtype)
    if decode_batch is not None and (int(decode_batch) < 1 or dynamic_cache):
        raise BadUsage(f"--decode-batch {decode_batch} must be >= 1, and needs a static cache (not --dynamic-cache)")
    for name, v in (("batch", batch), ("chunk", chunk), ("window", window)):
        if int(v) < 1:
            raise BadUsage(f"--{name} {v} must be >= 1")
    out = check_out_dir(out_dir, force)
    from kvexport.models.gguf import model_dir

    model, tokenizer_dir, original = model_dir(model), model_dir(tokenizer_dir), model_dir(original)
    p = resolve_press(press, budget, ratio)
    if dynamic_cache and p is not None:
        raise BadUsage("--dynamic-cache is the full-cache baseline; it takes --press none")
    from kvexport.mla.config import equalizes_latent

    dec, src, model_hash, mla = resolve_decoder(model, dtype, mla_rank, rope_dim,
                                                equalize_latent=equalizes_latent(kv_dtype))
    if source is not None:
        if src is not None:
            raise BadUsage("source= is for an in-memory model; a model directory is its own source")
        source = Path(source)
        if not source.is_dir():
            raise BadUsage(f"source {source} is not a directory (give the HF or MLA directory of the model)")
        src = source
        model_hash = _hash_model(dec, source)  # what validate recomputes when it loads the source
    if original is not None and not Path(original).is_dir():
        raise BadUsage(f"original {original} is not a model directory")
    if inplace_decode:
        if dynamic_cache:
            raise BadUsage("--inplace-decode writes a static cache in place; --dynamic-cache has none")
        graphs.check_inplace(dec, kv_dtype, dtype)
    spec = dec.spec
    L = spec.num_layers
    limit = spec.max_position_embeddings
    if max_positions is not None and not (1 <= int(max_positions) <= limit):
        raise BadUsage(f"--max-positions {max_positions} must be in [1, {limit}] (the model's max_position_embeddings)")
    max_pos = int(max_positions or limit)
    if chunk > max_pos:
        raise BadUsage(f"--chunk {chunk} exceeds the model's position range ({max_pos}); give a smaller chunk")
    if p is not None:
        budgets = [int(b) for b in p.layer_budgets(L, max_pos)]
        if max(budgets) > max_pos:
            raise BadUsage(f"--budget {p.budget} exceeds the model's position range ({max_pos})")
        if p.budget <= p.always_kept():
            raise BadUsage(f"--budget {p.budget} must exceed the {p.always_kept()} tokens {p.name} always keeps")
    else:  # full static cache: capacity = --max-positions (default: the position range, at most 8192)
        budgets = [int(max_positions or min(limit, 8192))] * L
    lookahead = int(lookahead or 0)
    if lookahead < 0:
        raise BadUsage(f"--lookahead {lookahead} must be >= 0")
    if lookahead and (p is None or not p.observes):
        raise BadUsage("--lookahead needs a press that scores with observation queries (snapkv, tova, "
                       f"expected_attention, ...); {'no press' if p is None else p.name} has none to give")
    if lookahead and chunk + lookahead > max_pos:
        raise BadUsage(f"--chunk {chunk} + --lookahead {lookahead} exceed the model's position range ({max_pos})")
    window_eff = int(window) if p is not None else 0
    # a full cache larger than the smallest bucket: the graphs take its capacity axis as a dynamic dimension and
    # the runtime holds it in buckets (kvexport.cache.plan rule 7); static budgets keep fixed shapes
    dynamic_capacity = p is None and not dynamic_cache and budgets[0] > MIN_BUCKET
    # an evicting cache's prefill chunks and decode steps read only the bucket of the occupied slots (plan rule 7b):
    # their graphs take the capacity axis as a dynamic dimension (one budget for every layer; the compactions and the
    # in-place decode graph keep fixed shapes)
    read_buckets = (p is not None and not dynamic_cache and len(set(budgets)) == 1
                    and budgets[0] + window_eff >= 2 * MIN_BUCKET)
    # a prompt's last chunk is fed at its real width when it does not compact (plan rule 2b): an evicting cache's,
    # and a full cache's, whose chunks never compact (a short prompt costs its own columns, not the chunk's)
    ragged_last = not dynamic_cache and chunk >= 2
    td = DTYPES[dtype]
    custom = opsel == "custom"
    settings: dict[str, Any] = {
        "mode": "dynamic" if dynamic_cache else "static", "batch": int(batch), "chunk": int(chunk),
        "decode_batch": int(decode_batch) if decode_batch is not None else None,
        "window": window_eff, "budgets": budgets if p is not None else None,
        "capacities": list(capacities(budgets, window_eff)) if not dynamic_cache else None,
        "dynamic_capacity": dynamic_capacity,
        # the graphs handed only the bucket of the occupied slots (plan rule 7b), or None
        "read_buckets": (["prefill", "decode"] + ["prefill_last"] * bool(lookahead)
                         + ["decode_batch"] * (decode_batch is not None)) if read_buckets else None,
        # the graph a prompt's last chunk runs at its real width when it does not compact (plan rule 2b), or None
        "ragged_last": ("prefill_last" if lookahead else "prefill") if ragged_last else None,
        "inplace_decode": bool(inplace_decode), "lookahead": lookahead,
        "press": press_to_dict(p), "mla": mla, "dtype": dtype, "kv_dtype": kv_dtype, "ops": opsel,
        "opset": ops_mod.OPSET,
        "custom_domain": {ops_mod.DOMAIN: ops_mod.OP_VERSION} if custom else None,
        "max_positions": max_pos, "source": str(src.resolve()) if src is not None else None,
        "source_relative": os.path.relpath(src.resolve(), Path(out).resolve()) if src is not None else None,
        "original": str(Path(original).resolve()) if original is not None else None,
        "original_relative": (os.path.relpath(Path(original).resolve(), Path(out).resolve())
                              if original is not None else None),
        "spec": spec.to_dict(), "vocab_size": spec.vocab_size, "num_layers": L,
    }
    with atomic_output(out, force) as tmp:
        files: dict[str, Any] = {}
        say = progress or (lambda msg: None)
        if dynamic_cache:
            say("exporting model.onnx (growing past)")
            files["model"] = _export_dynamic(dec, tmp, batch, td, custom)
        else:
            files.update(_export_static(dec, p, budgets, window_eff, batch, chunk, td, custom, tmp, say, decode_batch,
                                        kv_dtype, dynamic_capacity, inplace_decode, lookahead, read_buckets,
                                        ragged_last))
        settings["graphs"] = files
        tok_src = Path(tokenizer_dir) if tokenizer_dir is not None else _tokenizer_source(model, src)
        if tok_src is not None:
            toks = [f for f in TOKENIZER_FILES if (tok_src / f).is_file()]
            if toks:
                (tmp / "tokenizer").mkdir()
                for f in toks:
                    shutil.copyfile(tok_src / f, tmp / "tokenizer" / f)
        settings["tokenizer"] = "tokenizer" if (tmp / "tokenizer").is_dir() else None
        write_manifest(tmp, KIND, settings, model_hash, reports=("parity.json",))
        if weights is not None:  # the post-pass, still inside the temporary directory: --out gets both or nothing
            say(f"weights: {weights}")
            quantize_export(tmp, weights, progress=say)
    return Path(out)


def _tokenizer_source(model, src: Path | None) -> Path | None:
    """Where the tokenizer files are: the model directory, or the directory an in-memory model came from."""
    if src is not None:
        return src
    for attr in ("source_dir", "name_or_path"):
        v = getattr(model, attr, None)
        if v and Path(str(v)).is_dir():
            return Path(str(v))
    return None


def _io(model) -> dict[str, list[str]]:
    return {"inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output]}


def _capacity_axis(shapes: list[graphs.LayerShape]) -> tuple[list[graphs.LayerShape], Any]:
    """Layer shapes at an example capacity, and ``dynamic_shapes`` for (input_ids, positions, *cache): axis 2 of every
    cache tensor one dynamic dimension ``capacity`` in [2, capacity] (a full cache's buckets, kvexport.cache.plan
    rule 7, or the reading graphs of an evicting cache, rule 7b)."""
    from torch.export import Dim

    cap = shapes[0].capacity
    axis = Dim("capacity", min=2, max=cap)
    example = [dataclasses.replace(s, capacity=min(cap, MIN_BUCKET + 1)) for s in shapes]
    n = sum(len(s.fields) for s in shapes)
    return example, (None, None, tuple({2: axis} for _ in range(n)))  # forward(input_ids, positions, *cache)


def _column_axis(chunk: int, n_cache: int, dyn) -> Any:
    """``dynamic_shapes`` for (input_ids, positions, *cache) of a last-chunk graph: axis 1 of the ids and positions one
    dynamic dimension ``columns`` in [2, chunk] (plan rule 2b), the cache's axes as ``dyn`` gives them."""
    from torch.export import Dim

    cols = Dim("columns", min=2, max=int(chunk))
    return ({1: cols}, {1: cols}, dyn[2] if dyn is not None else tuple({} for _ in range(n_cache)))


def _export_static(dec, press, budgets, window, batch, chunk, td, custom, tmp: Path, say,
                   decode_batch: int | None = None, kv_dtype: str | None = None,
                   dynamic_capacity: bool = False, inplace_decode: bool = False,
                   lookahead: int = 0, read_buckets: bool = False, ragged_last: bool = False) -> dict[str, Any]:
    shapes = graphs.layer_shapes(dec, budgets, window, kv_dtype)
    L = len(shapes)
    wq = press is not None
    kv, new = graphs.kv_names(shapes), graphs.new_names(shapes, wq)
    traced, dyn = _capacity_axis(shapes) if dynamic_capacity else (shapes, None)
    cache = kv_examples(traced, batch, td)
    n_graphs = (4 if wq else 2) + 2 * bool(lookahead) + (decode_batch is not None) + bool(inplace_decode)
    files: dict[str, Any] = {}

    weights = SharedWeights(tmp)

    def export(name: str, module, args, inputs, outputs, k: int, dynamic=None, file: str | None = None) -> None:
        file = file or f"{name}.onnx"
        say(f"exporting {file} ({k}/{n_graphs})")
        m, used = _export_graph(module.eval(), args, inputs, outputs, custom, weights, dynamic_shapes=dynamic)
        files[name] = {"file": file, "external_data": weights.save(m, tmp / file, used), **_io(m)}

    Lt = int(lookahead)
    ids = torch.zeros(batch, chunk + Lt, dtype=torch.long)
    pos = torch.arange(chunk + Lt).expand(batch, chunk + Lt).contiguous()
    prefill = graphs.PrefillChunk(dec, press, budgets, window, kv_dtype, lookahead=Lt)
    new_prefill = graphs.new_names(shapes, wq, prefill.full_rows)
    tails = [f"q_tail_{i}" for i in range(L)] if Lt else []
    # the reading graphs of a cache read in buckets (plan rule 7b) are traced at a bucket's example size, their cache
    # axis dynamic
    r_shapes, p_dyn = (_capacity_axis(shapes) if read_buckets else (traced, dyn))
    p_cache = kv_examples(r_shapes, batch, td) if read_buckets else cache
    # the graph of a prompt's last chunk takes its column axis as a dynamic dimension (plan rule 2b): prefill itself,
    # or without a tail prefill_last
    narrow = _column_axis(chunk, len(p_cache), p_dyn) if ragged_last else None
    export("prefill", prefill, (ids, pos, *p_cache), ["input_ids", "positions"] + kv,
           ["logits"] + new_prefill + tails, 1, narrow if not Lt and narrow else p_dyn)
    ids, pos = ids[:, :chunk], pos[:, :chunk].contiguous()
    if Lt:  # the prompt's last chunk has no tail: the same chunk graph without one
        last = graphs.PrefillChunk(dec, press, budgets, window, kv_dtype)
        export("prefill_last", last, (ids, pos, *p_cache), ["input_ids", "positions"] + kv,
               ["logits"] + graphs.new_names(shapes, wq, last.full_rows), 2, narrow or p_dyn)
    ids1 = torch.zeros(batch, 1, dtype=torch.long)
    pos1 = torch.full((batch, 1), chunk, dtype=torch.long)
    export("decode", graphs.DecodeStep(dec, press, budgets, window, kv_dtype), (ids1, pos1, *p_cache),
           ["input_ids", "positions"] + kv, ["logits"] + new, 2 + bool(Lt), p_dyn)
    if wq:
        with torch.no_grad():
            full_pos = torch.arange(chunk + Lt).expand(batch, chunk + Lt).contiguous()
            outs = prefill(torch.zeros(batch, chunk + Lt, dtype=torch.long), full_pos, *cache)[1:]
        chunk_rows, tail_q = outs[:len(new_prefill)], outs[len(new_prefill):]
        fill, one = torch.full((L,), 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        export("compact_prefill", graphs.CompactPrefill(dec, press, budgets, window, kv_dtype),
               (fill, one, pos, *cache, *chunk_rows), ["fill", "n_pad", "positions"] + kv + new_prefill,
               graphs.kv_names(shapes, "kept_"), 3 + bool(Lt))
        if Lt:
            tail_pos = full_pos[:, chunk:].contiguous()
            export("compact_prefill_tail", graphs.CompactPrefillTail(dec, press, budgets, window, kv_dtype),
                   (fill, one, pos, tail_pos, *cache, *chunk_rows, *tail_q),
                   ["fill", "n_pad", "positions", "tail_positions"] + kv + new_prefill + tails,
                   graphs.kv_names(shapes, "kept_"), 5)
        export("compact", graphs.Compact(dec, press, budgets, window, kv_dtype),
               (fill, one, *cache, *query_examples(shapes, batch, window, td)),
               ["fill", "query_start"] + kv + graphs.query_names(L), graphs.kv_names(shapes, "kept_"),
               4 + 2 * bool(Lt))
    if inplace_decode:
        slots = torch.zeros(L, batch, dtype=torch.int32)
        export("decode_inplace", graphs.InPlaceDecodeStep(dec, press, budgets, window, kv_dtype),
               (ids1, pos1, slots, *cache), ["input_ids", "positions", "slots"] + kv,
               ["logits"] + graphs.inplace_names(shapes, wq), n_graphs - (decode_batch is not None),
               (dyn[0], dyn[1], None, dyn[2]) if dyn is not None else None, file=INPLACE_FILE)
        files["decode_inplace"]["in_place"] = graphs.in_place_map(L)
    if decode_batch is not None:
        N = int(decode_batch)
        export("decode_batch", graphs.DecodeStep(dec, press, budgets, window, kv_dtype),
               (torch.zeros(N, 1, dtype=torch.long), torch.full((N, 1), chunk, dtype=torch.long),
                *kv_examples(r_shapes, N, td)), ["input_ids", "positions"] + kv, ["logits"] + new, n_graphs, p_dyn)
    files["layers"] = [dataclasses.asdict(s) for s in shapes]
    return files


def _export_dynamic(dec, tmp: Path, batch: int, td, custom: bool) -> dict[str, Any]:
    from torch.export import Dim

    L = dec.spec.num_layers
    T, P = 3, 2
    past = []
    names_in, names_out = [], []
    for i, layer in enumerate(dec.layers):
        a = layer.self_attn
        past += [torch.zeros(batch, a.cache_heads, P, a.key_dim, dtype=td),
                 torch.zeros(batch, a.cache_heads, P, a.value_dim, dtype=td)]
        names_in += [f"past_k_{i}", f"past_v_{i}"]
        names_out += [f"present_k_{i}", f"present_v_{i}"]
    t, p = Dim("seq", min=1, max=65536), Dim("past", min=1, max=65536)
    dyn = [{1: t}, {1: t}, {1: p}, tuple({2: p} for _ in range(2 * L))]
    args = (torch.zeros(batch, T, dtype=torch.long), torch.arange(P, P + T).expand(batch, T).contiguous(),
            torch.arange(P).expand(batch, P).contiguous(), *past)
    weights = SharedWeights(tmp)
    m, used = _export_graph(graphs.GrowingPast(dec).eval(), args, ["input_ids", "positions", "past_positions"] + names_in,
                            ["logits", "present_positions"] + names_out, custom, weights, dynamic_shapes=tuple(dyn))
    return {"file": "model.onnx", "external_data": weights.save(m, tmp / "model.onnx", used), **_io(m)}

