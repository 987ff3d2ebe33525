# SPDX-License-Identifier: Apache-2.0
"""``export_model``: a HF causal LM (optionally MLA-rewritten, with a press) -> a directory of ONNX graphs.

Exporter: ``torch.onnx.export(dynamo=True)`` (torch.export, then onnxscript's translation) with a
``custom_translation_table`` that emits the ``kvexport`` custom nodes; the model-local functions and the
op schemas are added afterwards (:mod:`kvexport.ops`). The models call the custom ops themselves (each op module's
model-facing function is the custom op while torch.export traces), so nothing is patched for the export. It was chosen over the TorchScript exporter
because it traces the press's Python ``score()`` without scripting, is the maintained path in torch 2.13,
and gives the same bytes on every run once node metadata (stack traces) is stripped.

Layout of an export directory (static caches)::

    prefill.onnx           a chunk of exactly C tokens over the cache -> logits and the chunk's new rows
    decode.onnx            one token per row over the cache -> logits and its new rows (the host writes them)
    compact_prefill.onnx   a chunk's compaction: the best budget of [cache ; chunk] (absent without a press)
    compact.onnx           decode-time compaction of every layer (absent without a press)
    weights.data   every graph's weights (initializers >= 1 KiB), each tensor once: the graphs share it by offset
    tokenizer/     the source model's tokenizer files, when it has them
    manifest.json  settings, model hash and sha256 of every file (kvexport.manifest)

A full cache (no press) of more than :data:`~kvexport.cache.plan.MIN_BUCKET` slots is exported with its capacity
axis (axis 2 of every cache tensor) as one dynamic dimension ``capacity`` (manifest ``dynamic_capacity``), so the
runtime can hold it in buckets (plan rule 7); static budgets keep fixed shapes.

``--dynamic-cache`` writes ``model.onnx`` instead: full cache with a growing past (the Optimum baseline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from kvexport import ops
from kvexport.cache.plan import MIN_BUCKET
from kvexport.errors import BadUsage
from kvexport.export import graphs
from kvexport.manifest import ONNX_EXPORT as KIND
from kvexport.manifest import ORT_ONLY_SUFFIX, atomic_output, check_out_dir, write_manifest
from kvexport.models.loading import TOKENIZER_FILES

# torch's exporter warns once per graph that torchvision's ops are not registered; they are never used here
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

INPLACE_FILE = "decode_inplace" + ORT_ONLY_SUFFIX  # the in-place decode step (onnxruntime, CPU)
WEIGHTS_FILE = "weights.data"  # every graph's initializers of at least EXTERNAL_MIN_BYTES, each stored once
EXTERNAL_MIN_BYTES = 1024
WEIGHT_ALIGN = 64  # byte alignment of each tensor in WEIGHTS_FILE
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
NOT_EXPORTABLE = {
    "random": "its scores are fresh random draws of the candidates' shape, which a static graph cannot reproduce",
    "optimal": "it is an oracle that needs future queries",
}


# ----------------------------------------------------------------------------- model resolution
def _hash_model(decoder, path: Path | None) -> str:
    h = hashlib.sha256()
    if path is not None:
        for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
            if f.name.startswith("tokenizer"):
                continue
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for b in iter(lambda: fh.read(1 << 20), b""):
                    h.update(b)
        return "sha256:" + h.hexdigest()
    h.update(json.dumps(decoder.spec.to_dict(), sort_keys=True).encode())
    for name, t in sorted(decoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _is_mla(decoder) -> bool:
    return any(getattr(layer.self_attn, "cache_heads", None) == 1 and getattr(layer.self_attn, "value_dim", 1) == 0
               for layer in decoder.layers)


def resolve_decoder(model, dtype: str, mla_rank: int | None, rope_dim: int | None, equalize_latent: bool = False):
    """model (HF dir, HF model or kvexport Decoder) -> (Decoder in dtype, source dir or None, model hash, mla dict);
    with ``mla_rank`` rewritten to MLA (``equalize_latent``: :attr:`MLASettings.equalize_latent`)."""
    from kvexport.models.decoder import Decoder
    from kvexport.models.loading import load_hf_model

    path = None
    rewritten = False
    if isinstance(model, Decoder):
        dec = model
    elif isinstance(model, torch.nn.Module):
        dec = Decoder.from_hf(load_hf_model(model))
    else:
        path = Path(model)
        try:
            from kvexport.mla.io import is_mla_dir, load_mla
        except ImportError:  # pragma: no cover - kvexport.mla ships with kvexport
            is_mla_dir = None
        if is_mla_dir is not None and is_mla_dir(path):  # a saved MLA model (kvexport mla / convert)
            dec = load_mla(path, dtype=torch.float32)
        else:  # memory-mapped; straight in the export's dtype unless the MLA rewrite needs fp32 first
            dec = Decoder.from_hf(load_hf_model(path, "fp32" if mla_rank is not None else dtype))
    model_hash = _hash_model(dec, path)
    mla = None
    if mla_rank is not None:
        if _is_mla(dec):
            raise BadUsage("--mla-rank given but the model is already MLA; drop --mla-rank/--rope-dim")
        from kvexport.mla.config import MLASettings
        from kvexport.mla.rewrite import rewrite_to_mla

        kw = {"kv_rank": int(mla_rank), "equalize_latent": bool(equalize_latent)}
        if rope_dim is not None:
            kw["rope_dim"] = int(rope_dim)
        settings = MLASettings(**kw)
        dec = rewrite_to_mla(dec, settings, inplace=path is not None)  # a Decoder we loaded: nobody else holds it
        rewritten = True
    elif rope_dim is not None:
        raise BadUsage("--rope-dim needs --mla-rank")
    if _is_mla(dec):
        from kvexport.mla.rewrite import set_absorb

        set_absorb(dec, True)
        s = getattr(dec, "mla_settings", None)
        mla = {"settings": s.to_dict() if s is not None else None,
               "kv_ranks": [int(layer.self_attn.kv_rank) for layer in dec.layers],
               "rope_dim": int(dec.layers[0].self_attn.rope_dim), "rewritten_by_export": rewritten}
    dec = dec.to(DTYPES[dtype]).eval()
    return dec, path, model_hash, mla


def resolve_press(press, budget: int | None, ratio: float | None):
    """press name / object / None -> press object or None, with the checks a static export needs."""
    from kvexport.presses import make_press
    from kvexport.presses.base import ScorerPress

    if ratio is not None:
        raise BadUsage("a static export needs --budget N (tokens kept); --ratio depends on the prompt length")
    if press is None or press == "none":
        if budget is not None:
            raise BadUsage("--budget needs a --press (accepted: a press name, not 'none')")
        return None
    if isinstance(press, str):
        if budget is None:
            raise BadUsage(f"--press {press} needs --budget N (tokens kept per layer and head)")
        press = make_press(press, budget=budget)
    elif not isinstance(press, ScorerPress):
        raise BadUsage(f"press must be a press name or a ScorerPress, not {type(press).__name__}")
    elif budget is not None:
        press = dataclasses.replace(press, budget=int(budget), compression_ratio=None)
    if press.budget is None:
        raise BadUsage(f"press {press.name} has no budget; a static export needs --budget N")
    if press.name in NOT_EXPORTABLE:
        raise BadUsage(f"press {press.name!r} cannot be exported: {NOT_EXPORTABLE[press.name]}")
    return press


def press_to_dict(press) -> dict[str, Any] | None:
    if press is None:
        return None
    return {"name": press.name, "params": dataclasses.asdict(press)}


def press_from_dict(d: dict[str, Any] | None):
    if d is None:
        return None
    from kvexport.presses import PRESSES

    return PRESSES[d["name"]](**d["params"])


# ----------------------------------------------------------------------------- ONNX post-processing
def _finish_proto(model, custom: bool):
    """Attach (custom) or inline (standard) the kvexport functions, strip per-node metadata. The graph's weights
    are external by now (:class:`SharedWeights`), so the proto is small; it is checked once saved (:func:`_check`)."""
    from onnx import inliner

    uses = {n.op_type for n in model.graph.node if n.domain == ops.DOMAIN}
    del model.functions[:]
    if uses:
        model.functions.extend(f for f in ops.function_protos(model) if f.name in uses)
    if not custom and uses:
        model = inliner.inline_local_functions(model)
        keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    if not uses:
        keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    for n in model.graph.node:
        del n.metadata_props[:]
    del model.metadata_props[:]
    model.graph.doc_string = ""
    model.doc_string = ""
    model.producer_name = "kvexport"
    import kvexport

    model.producer_version = kvexport.__version__
    return model


def _check(path: Path) -> None:
    """onnx's full check (schemas, shape inference) of a saved graph; by path, so that it finds the external
    weights beside it without loading them."""
    import onnx

    ops.register_schemas()
    onnx.checker.check_model(str(path), full_check=True)


_REGISTRIES: dict = {}


@contextlib.contextmanager
def _torchlib_registry_once():
    """Build torch.onnx's torchlib registry once per process instead of once per graph (about a second each).

    ``torch.onnx.export`` makes a fresh ``ONNXRegistry.from_torchlib()`` on every call and then registers the
    custom translations on it; the registry only depends on the opset, and registering our translations again
    puts the same functions first, so one registry per opset serves every graph. Falls back to torch's own path
    if its private layout differs."""
    try:
        from torch.onnx._internal.exporter import _registration as reg

        original = reg.ONNXRegistry.__dict__["from_torchlib"]
    except (ImportError, KeyError):  # pragma: no cover - another torch layout: no caching
        yield
        return

    def cached(cls, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = original.__func__(cls, *args, **kwargs)
        return _REGISTRIES[key]

    reg.ONNXRegistry.from_torchlib = classmethod(cached)
    try:
        yield
    finally:
        reg.ONNXRegistry.from_torchlib = original


def _export_graph(module, args: tuple, input_names: list[str], output_names: list[str], custom: bool,
                  weights: "SharedWeights", dynamic_shapes=None):
    """Trace ``module`` and translate it to ONNX; -> (ModelProto without weight bytes, whether it uses
    ``weights``' file). The exporter's initializers wrap the module's own tensors (no copy); after the clean-up
    passes each large one is written to ``weights`` and replaced by a reference, one tensor at a time, before the
    graph becomes a proto, so the weights are never serialized into memory."""
    table = ops.translation_table()
    with torch.no_grad(), warnings.catch_warnings(), _torchlib_registry_once():
        warnings.simplefilter("ignore")
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            prog = torch.onnx.export(module, args, dynamo=True, custom_translation_table=table, opset_version=ops.OPSET,
                                     input_names=input_names, output_names=output_names, optimize=False,
                                     dynamic_shapes=dynamic_shapes, verbose=False)
        _optimize(prog.model)
        used = weights.externalize(prog.model)
        import onnx_ir as ir

        proto = ir.serde.serialize_model(prog.model)
    del prog
    return _finish_proto(proto, custom), used


def _optimize(model) -> None:
    """Constant folding and clean-up on the exported IR, in place.

    onnxscript's full optimizer (what ``optimize=True`` runs) adds its pattern-rewrite rules and fusions; on
    kvexport's graphs they change a handful of nodes of several hundred (a few scalar Mul/Unsqueeze) and cost
    about 40 % of the export time, so only the folding, dead-node, initializer and naming passes run here."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import _constant_folding

    fold = _constant_folding.FoldConstantsPass(shape_inference=True,
                                               input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                                               output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                                               should_fold=lambda node: None)
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([fold, common.RemoveUnusedNodesPass()], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(), common.CommonSubexpressionEliminationPass(), common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
    if _fold_weight_reshapes(model):
        common.RemoveUnusedNodesPass()(model)


def _fold_weight_reshapes(model) -> int:
    """Replace ``Reshape(weight, constant shape)``, ``Slice(weight, constant starts / ends / axes / steps)`` and
    ``Transpose(weight)`` by the weight itself in the new shape, the slice of it or its transpose (views of the same
    memory; a transposed one is written contiguous, one tensor at a time, by :class:`SharedWeights`);
    -> how many. onnxscript's folding leaves them (its input size limit), and onnxruntime would fold each one in
    every session into a copy of its own: MLA's ``kv_b_proj``, reshaped per head and sliced into its key and value
    halves, is 27 % of a Qwen3 MLA model's weights, copied twice (prefill and decode) into anonymous memory. A
    sliced weight whose whole is no longer read is dropped, so the file holds the same bytes once."""
    import numpy as np
    import onnx_ir as ir

    graph = model.graph
    done = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Reshape", "Slice", "Transpose"):
            continue
        if node.op_type != "Transpose" and len(node.inputs) < 2:
            continue
        data = node.inputs[0]
        t = data.const_value if data is not None and data.is_initializer() else None
        if t is None or t.nbytes < EXTERNAL_MIN_BYTES or node.outputs[0].is_graph_output():
            continue
        consts = [None if v is None or v.const_value is None else v.const_value.numpy().reshape(-1).tolist()
                  for v in node.inputs[1:]]
        if any(c is None for c in consts):
            continue
        arr = t.numpy()
        if node.op_type == "Transpose":
            perm = node.attributes.get("perm")
            view = arr.transpose(perm.as_ints() if perm is not None else None)
        elif node.op_type == "Reshape":
            view = _reshape_view(arr, consts[0], node)
        else:
            view = _slice_view(arr, *consts)
        if view is None or (view.size and not np.shares_memory(view, arr)):  # never a copy
            continue
        kind = {"Reshape": "reshaped", "Slice": "sliced", "Transpose": "transposed"}[node.op_type]
        name = f"{data.name}_{kind}_{done}"
        value = ir.Value(name=name, shape=ir.Shape(view.shape), type=data.type,
                         const_value=ir.Tensor(view, dtype=t.dtype, name=name))
        graph.register_initializer(value)
        node.outputs[0].replace_all_uses_with(value)
        graph.remove(node, safe=True)
        done += 1
    return done


def _reshape_view(arr, dims: list[int], node):
    allowzero = node.attributes.get("allowzero")
    if not (allowzero is not None and allowzero.as_int()):
        dims = [arr.shape[i] if d == 0 else d for i, d in enumerate(dims)]  # 0: copy the input's dimension
    try:
        return arr.reshape(dims)
    except ValueError:
        return None


def _slice_view(arr, starts: list[int], ends: list[int], axes: list[int] | None = None,
                steps: list[int] | None = None):
    """ONNX Slice with positive steps as a NumPy view (its clamping of starts / ends is Python's); None otherwise."""
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or any(st < 1 for st in steps):
        return None
    index = [slice(None)] * arr.ndim
    for a, b, e, st in zip(axes, starts, ends, steps, strict=True):
        if not -arr.ndim <= a < arr.ndim:
            return None
        index[a] = slice(int(b), int(e), int(st))
    return arr[tuple(index)]


class SharedWeights:
    """One ``weights.data`` for all graphs of an export: each initializer of at least ``EXTERNAL_MIN_BYTES`` is
    written once (identical bytes, dtype and shape are stored once however many graphs use them, under whatever
    name the exporter gave them) and every graph's tensor points at it by offset.

    :meth:`externalize` works on the exporter's IR before any proto exists: each tensor's bytes are viewed (or,
    for a folded transpose, made contiguous: one tensor at a time), hashed, appended when new, and the
    initializer is replaced by a reference into the file. So an export holds the model's weights once (the
    module's) plus at most one tensor, however large the model."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.path = self.dir / WEIGHTS_FILE
        self.offsets: dict[tuple, tuple[int, int]] = {}
        self.size = 0

    def _append(self, f, data: memoryview, key: tuple) -> tuple[int, int]:
        if key not in self.offsets:
            pad = -self.size % WEIGHT_ALIGN
            f.write(b"\0" * pad)
            self.size += pad
            f.write(data)
            self.offsets[key] = (self.size, data.nbytes)
            self.size += data.nbytes
        return self.offsets[key]

    def externalize(self, model) -> bool:
        """Move every large initializer of the onnx_ir ``model`` (main graph) into the shared file; -> whether
        the graph now uses it."""
        import onnx_ir as ir

        used = False
        with open(self.path, "ab") as f:
            for value in list(model.graph.initializers.values()):
                t = value.const_value
                if t is None or isinstance(t, ir.ExternalTensor) or t.nbytes < EXTERNAL_MIN_BYTES:
                    continue
                data = _tensor_bytes(t)
                key = (hashlib.sha256(data).digest(), int(t.dtype), tuple(t.shape.numpy()))
                offset, length = self._append(f, data, key)
                del data
                value.const_value = ir.ExternalTensor(WEIGHTS_FILE, offset, length, t.dtype, shape=t.shape,
                                                      name=value.name, base_dir=str(self.dir))
                used = True
        if not used and self.size == 0:
            self.path.unlink(missing_ok=True)
        return used

    def save(self, model, path: Path, used: bool = True) -> bool:
        """Write the graph proto ``model`` (weights already external) to ``path`` and check it; -> ``used``."""
        import onnx

        onnx.save_model(model, str(path))
        _check(path)
        return used


#: ONNX element types whose raw bytes are the NumPy array's bytes (little-endian), so a tensor can be written from
#: a view of its own memory; any other type goes through the tensor's ``tobytes`` (packed 4-bit types, strings)
_VIEWABLE = {"FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT8", "UINT8", "INT16", "UINT16", "INT32", "UINT32",
             "INT64", "UINT64", "BOOL"}


def _tensor_bytes(t) -> memoryview:
    """The bytes ONNX stores for the onnx_ir tensor ``t`` (what ``t.tobytes()`` returns), as a view of the tensor's
    memory where it is contiguous: a module parameter is not copied."""
    import numpy as np

    if t.dtype.name in _VIEWABLE and sys.byteorder == "little":
        a = np.ascontiguousarray(t.numpy())
        return memoryview(a.reshape(-1).view(np.uint8))
    return memoryview(t.tobytes())


# ----------------------------------------------------------------------------- example inputs
def kv_examples(shapes: list[graphs.LayerShape], batch: int, dtype) -> list:
    return graphs.cache_examples(shapes, batch, dtype)


def query_examples(shapes: list[graphs.LayerShape], batch: int, window: int, dtype) -> list:
    return [torch.zeros(batch, s.q_heads, window, s.q_dim, dtype=dtype) for s in shapes] + [
        torch.full((batch, window), -1, dtype=torch.long)]


# ----------------------------------------------------------------------------- the entry point
def export_model(model, out_dir, *, press=None, budget: int | None = None, ratio: float | None = None,
                 window: int = 32, mla_rank: int | None = None, rope_dim: int | None = None, batch: int = 1,
                 chunk: int = 128, dtype: str = "fp32", ops: str = "custom", dynamic_cache: bool = False,
                 force: bool = False, max_positions: int | None = None, source: str | Path | None = None,
                 tokenizer_dir: str | Path | None = None, original: str | Path | None = None,
                 decode_batch: int | None = None, progress=None, kv_dtype: str | None = None,
                 inplace_decode: bool = False) -> Path:
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
    window_eff = int(window) if p is not None else 0
    # a full cache larger than the smallest bucket: the graphs take its capacity axis as a dynamic dimension and
    # the runtime holds it in buckets (kvexport.cache.plan rule 7); static budgets keep fixed shapes
    dynamic_capacity = p is None and not dynamic_cache and budgets[0] > MIN_BUCKET
    td = DTYPES[dtype]
    custom = opsel == "custom"
    settings: dict[str, Any] = {
        "mode": "dynamic" if dynamic_cache else "static", "batch": int(batch), "chunk": int(chunk),
        "decode_batch": int(decode_batch) if decode_batch is not None else None,
        "window": window_eff, "budgets": budgets if p is not None else None,
        "capacities": [b + window_eff for b in budgets] if not dynamic_cache else None,
        "dynamic_capacity": dynamic_capacity, "inplace_decode": bool(inplace_decode),
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
                                        kv_dtype, dynamic_capacity, inplace_decode))
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
    """A full cache's layer shapes at an example capacity, and ``dynamic_shapes`` for (input_ids, positions, *cache):
    axis 2 of every cache tensor one dynamic dimension ``capacity`` in [2, capacity] (kvexport.cache.plan rule 7)."""
    from torch.export import Dim

    cap = shapes[0].capacity
    axis = Dim("capacity", min=2, max=cap)
    example = [dataclasses.replace(s, capacity=min(cap, MIN_BUCKET + 1)) for s in shapes]
    n = sum(len(s.fields) for s in shapes)
    return example, (None, None, tuple({2: axis} for _ in range(n)))  # forward(input_ids, positions, *cache)


def _export_static(dec, press, budgets, window, batch, chunk, td, custom, tmp: Path, say,
                   decode_batch: int | None = None, kv_dtype: str | None = None,
                   dynamic_capacity: bool = False, inplace_decode: bool = False) -> dict[str, Any]:
    shapes = graphs.layer_shapes(dec, budgets, window, kv_dtype)
    L = len(shapes)
    wq = press is not None
    kv, new = graphs.kv_names(shapes), graphs.new_names(shapes, wq)
    traced, dyn = _capacity_axis(shapes) if dynamic_capacity else (shapes, None)
    cache = kv_examples(traced, batch, td)
    n_graphs = (4 if wq else 2) + (decode_batch is not None) + bool(inplace_decode)
    files: dict[str, Any] = {}

    weights = SharedWeights(tmp)

    def export(name: str, module, args, inputs, outputs, k: int, dynamic=None, file: str | None = None) -> None:
        file = file or f"{name}.onnx"
        say(f"exporting {file} ({k}/{n_graphs})")
        m, used = _export_graph(module.eval(), args, inputs, outputs, custom, weights, dynamic_shapes=dynamic)
        files[name] = {"file": file, "external_data": weights.save(m, tmp / file, used), **_io(m)}

    ids = torch.zeros(batch, chunk, dtype=torch.long)
    pos = torch.arange(chunk).expand(batch, chunk).contiguous()
    prefill = graphs.PrefillChunk(dec, press, budgets, window, kv_dtype)
    new_prefill = graphs.new_names(shapes, wq, prefill.full_rows)
    export("prefill", prefill, (ids, pos, *cache), ["input_ids", "positions"] + kv, ["logits"] + new_prefill, 1, dyn)
    ids1 = torch.zeros(batch, 1, dtype=torch.long)
    pos1 = torch.full((batch, 1), chunk, dtype=torch.long)
    export("decode", graphs.DecodeStep(dec, press, budgets, window, kv_dtype), (ids1, pos1, *cache),
           ["input_ids", "positions"] + kv, ["logits"] + new, 2, dyn)
    if wq:
        with torch.no_grad():
            chunk_rows = prefill(ids, pos, *cache)[1:]
        fill, one = torch.full((L,), 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        export("compact_prefill", graphs.CompactPrefill(dec, press, budgets, window, kv_dtype),
               (fill, one, pos, *cache, *chunk_rows), ["fill", "n_pad", "positions"] + kv + new_prefill,
               graphs.kv_names(shapes, "kept_"), 3)
        export("compact", graphs.Compact(dec, press, budgets, window, kv_dtype),
               (fill, one, *cache, *query_examples(shapes, batch, window, td)),
               ["fill", "query_start"] + kv + graphs.query_names(L), graphs.kv_names(shapes, "kept_"), 4)
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
                *kv_examples(traced, N, td)), ["input_ids", "positions"] + kv, ["logits"] + new, n_graphs, dyn)
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

