# SPDX-License-Identifier: Apache-2.0
"""``quantize_export``: an export's weights in int4 or fp16, as a post-pass over its graphs and shared weights file.

An export (:mod:`kvexport.export.exporter`) keeps every graph's weights once, in ``weights.data``, referenced by
offset from prefill.onnx, decode.onnx, compact*.onnx, .... This pass rewrites each graph's MatMuls by a constant 2-D
float32 weight ``w`` (K, N) and writes a new ``weights.data`` in which each distinct weight is quantized once and
stays shared by every graph that uses it (the fp32 originals that no node reads any more are dropped):

========== ================================================================= ============================================
format     a MatMul by ``w`` becomes                                          embedding Gather
========== ================================================================= ============================================
int4       ``com.microsoft::MatMulNBits`` (bits 4, blocks along K,            ``com.microsoft::GatherBlockQuantized`` over
           asymmetric uint4 zero points by default): onnxruntime, CPU          the LM head's blocks when the table is the
                                                                              head's weight (tied), else kept fp32
int4-qdq   ``DequantizeLinear`` (opset 21, INT4, blocked along axis 0,        kept fp32
           no zero point, scales > 0) -> ``MatMul``: what TensorRT's ONNX
           parser imports as weight-only INT4; onnxruntime fuses it back
           into MatMulNBits at load
fp16       the weight stored float16 -> ``Cast`` to float -> ``MatMul``       float16 table -> ``Gather`` -> ``Cast``
========== ================================================================= ============================================

The block rule is :mod:`kvexport.quant.blocks` (onnxruntime's own quantizer for the asymmetric blocks), the same
function the PyTorch reference (:func:`kvexport.quant.reference.quantized_decoder`) applies to a Decoder's weights.
The LM head is quantized like every other MatMul (as onnxruntime-genai's ``-p int4`` does); the embedding table is
only read one row per token, so quantizing it buys file size, not decode time: int4 does it only where it costs no
second copy (a tied table reads the head's blocks).

The export's manifest gets a ``weights`` entry (:func:`quantize_export`'s return value): format, block size, scheme,
accuracy level, every quantized tensor (sha256 of its float32 bytes, shape, which nodes of which graph), what was
left as it was and why, and the bytes of ``weights.data`` before and after and those a decode step reads.

On onnxruntime, MatMulNBits packs its weights at session creation ("prepacking"): a session made with
``session.disable_prepacking`` dequantizes the whole weight on every call (tens of times slower).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import BadUsage
from kvexport.quant.blocks import BITS, DEFAULT_BLOCK, Int4Blocks, check_block_size, quantize_int4, to_fp16

FORMATS = ("int4", "int4-a8", "int4-qdq", "fp16")
#: what ``--weights`` takes: fp32 (the weights as traced, no post-pass) or one of the pass's formats. ``int4-a8``
#: is ``int4`` at MatMulNBits accuracy level 4 (int8 activations inside the op, what onnxruntime-genai's ``-p int4``
#: runs on the CPU): the manifest records format "int4" with ``accuracy_level`` 4
CHOICES = ("fp32", "fp16", "int4", "int4-a8", "int4-qdq")
WEIGHTS_FILE = "weights.data"  # kvexport.export.exporter.WEIGHTS_FILE
ALIGN = 64  # byte alignment of each tensor in the file (the exporter's)
MS_DOMAIN = "com.microsoft"
QDQ_OPSET = 21  # DequantizeLinear over INT4 with block_size
INT4_IR = 10  # IR version that has INT4 / UINT4
DECODE_GRAPHS = ("decode_inplace", "decode")  # the graph a decode step runs, in the order a CPU runtime picks it


def sha256_array(a: np.ndarray) -> str:
    """sha256 of a float32 array's C-order bytes (how the manifest names a source weight)."""
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


def check_weights(weights: str | None, dtype: str = "fp32") -> str | None:
    """``--weights`` as given -> the format the post-pass applies, or None (fp32 or not given: the weights as traced).
    Refuses (BadUsage, one line) an unknown name, and a format over an export that is not fp32 (the pass reads
    float32 weights); called before any model loads."""
    if weights is None or weights == "fp32":
        return None
    if weights not in FORMATS:
        raise BadUsage(f"--weights {weights!r} unknown; accepted: {', '.join(CHOICES)}")
    if dtype != "fp32":
        raise BadUsage(f"--weights {weights} rewrites an fp32 export's weights; drop --dtype {dtype} / --fp16")
    return weights


def lossy_arithmetic(entry: dict | None) -> str | None:
    """Why onnxruntime computes a weight-quantized export's MatMuls other than the float32 reference on the same
    weights does (None: it does not: fp16 weights are cast to float32, MatMulNBits at accuracy level 0 dequantizes
    to float32). int4 at accuracy level 4 quantizes the activations to int8 inside MatMulNBits. int4-qdq: onnxruntime
    fuses DequantizeLinear + MatMul into MatMulNBits at the session's ``session.qdq_matmulnbits_accuracy_level``
    (default 4, int8 activations), which kvexport's sessions set to 0 (:meth:`kvexport.runtime.sessions.OrtSessions._options`)."""
    if not entry or entry.get("format") != "int4":
        return None
    level = int(entry.get("accuracy_level", 0))
    return f"MatMulNBits accuracy_level {level}: int8 activations inside the op" if level == 4 else None



# ----------------------------------------------------------------------------- reading the export's tensors
class _Source:
    """The export's initializers: raw bytes (a view of the memory-mapped weights file, or inline) and a key per
    stored tensor, equal for two initializers that point at the same bytes."""

    def __init__(self, root: Path):
        self.root = root
        self.maps: dict[str, np.memmap] = {}

    @staticmethod
    def ext(t) -> dict[str, str] | None:
        import onnx

        if t.data_location != onnx.TensorProto.EXTERNAL:
            return None
        return {e.key: e.value for e in t.external_data}

    def key(self, t) -> tuple:
        e = self.ext(t)
        if e is not None:
            return ("file", e["location"], int(e.get("offset", 0)), int(e["length"]), t.data_type, tuple(t.dims))
        return ("inline", hashlib.sha256(t.SerializeToString()).hexdigest())

    def raw(self, t) -> memoryview:
        e = self.ext(t)
        if e is None:
            raise ValueError("inline tensor")
        loc = e["location"]
        if loc not in self.maps:
            self.maps[loc] = np.memmap(self.root / loc, dtype=np.uint8, mode="r")
        off = int(e.get("offset", 0))
        return memoryview(self.maps[loc][off : off + int(e["length"])])

    def array(self, t) -> np.ndarray:
        import onnx
        from onnx import numpy_helper

        if self.ext(t) is None:
            return numpy_helper.to_array(t)
        if t.data_type != onnx.TensorProto.FLOAT:
            raise ValueError("only float32 external tensors are read as arrays")
        return np.frombuffer(self.raw(t), dtype=np.float32).reshape(tuple(t.dims))

    def close(self) -> None:
        for m in self.maps.values():
            m._mmap.close()  # type: ignore[attr-defined]
        self.maps.clear()


class _Store:
    """The new weights file: blobs appended once each (by key), 64-byte aligned; tensors reference them."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.size = 0
        self.blobs: dict[Any, tuple[int, int]] = {}

    def put(self, key, data) -> tuple[int, int]:
        if key not in self.blobs:
            pad = -self.size % ALIGN
            self.f.write(b"\0" * pad)
            self.size += pad
            if isinstance(data, np.ndarray):
                data = np.ascontiguousarray(data)
            mv = memoryview(data).cast("B")
            self.f.write(mv)
            self.blobs[key] = (self.size, mv.nbytes)
            self.size += mv.nbytes
        return self.blobs[key]

    def tensor(self, name: str, data_type: int, dims, key, data):
        import onnx

        off, length = self.put(key, data)
        t = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", WEIGHTS_FILE), ("offset", str(off)), ("length", str(length))):
            t.external_data.add(key=k, value=v)
        return t

    def close(self) -> None:
        self.f.close()


# ----------------------------------------------------------------------------- the pass
def quantize_export(export_dir: str | os.PathLike, weights: str = "int4", block_size: int = DEFAULT_BLOCK,
                    symmetric: bool | None = None, accuracy_level: int = 0, out: str | os.PathLike | None = None,
                    force: bool = False, progress=None) -> dict[str, Any]:
    """Rewrite an export's weights to ``weights`` ("int4", "int4-qdq" or "fp16"); returns the manifest's new
    ``weights`` entry.

    export_dir: a verified fp32 export (:func:`kvexport.export.export_model`); out: where to write the result
    (default: ``export_dir`` itself, replaced atomically once complete). block_size: int4 block along K (a power of
    two >= 16). symmetric: int4 scheme (default asymmetric for "int4"; "int4-qdq" is always symmetric).
    accuracy_level: MatMulNBits' ``accuracy_level`` (0, the default and what ``--weights int4`` writes: float32
    activations, the reference's arithmetic, so parity holds to float32 rounding; 4: int8 activations inside the
    op, what onnxruntime-genai's ``-p int4`` uses on the CPU, faster, validated only under
    :data:`kvexport.export.parity.LOSSY_WEIGHTS_TOLERANCES`; docs/quantized.md has both measured).
    """
    import onnx

    from kvexport.manifest import ONNX_EXPORT, atomic_output, verify_manifest, write_manifest

    if check_weights(weights) is None:
        raise BadUsage(f"--weights {weights}: the export's weights are fp32 already; nothing to rewrite")
    if weights == "int4-a8":
        weights, accuracy_level = "int4", 4
    block_size = check_block_size(block_size)
    if weights == "int4-qdq" and symmetric is False:
        raise BadUsage("--weights int4-qdq is symmetric (TensorRT takes INT4 with a zero point of 0 only)")
    sym = bool(symmetric) if weights == "int4" else weights == "int4-qdq"
    if accuracy_level not in (0, 1, 4):
        raise BadUsage(f"--accuracy-level {accuracy_level} unknown; accepted: 0, 1, 4 (float32 on the CPU: 0 = 1)")
    src_dir = Path(export_dir)
    doc = verify_manifest(src_dir, ONNX_EXPORT)
    settings = dict(doc["settings"])
    if settings.get("weights"):
        raise BadUsage(f"{src_dir} already has {settings['weights']['format']} weights; quantize the fp32 export")
    if settings.get("dtype") != "fp32":
        raise BadUsage(f"{src_dir} is a {settings.get('dtype')} export; weight formats apply to fp32 exports")
    graphs = {name: g for name, g in settings["graphs"].items() if isinstance(g, dict) and "file" in g}
    say = progress or (lambda msg: None)
    before = (src_dir / WEIGHTS_FILE).stat().st_size if (src_dir / WEIGHTS_FILE).is_file() else 0
    source = _Source(src_dir)
    try:
        models = {name: onnx.load(str(src_dir / g["file"]), load_external_data=False) for name, g in graphs.items()}
        plan = _plan(models, source, weights, block_size, sym, say)
        dest = Path(out) if out is not None else src_dir
        with atomic_output(dest, force=force or out is None) as tmp:
            store = _Store(tmp / WEIGHTS_FILE)
            try:
                for m in models.values():
                    _rewrite(m, plan, source, store, weights, block_size, accuracy_level)
            finally:
                store.close()
            entry = _entry(plan, weights, block_size, sym, accuracy_level, before, store.size, models)
            _save(models, graphs, tmp)
            _copy_rest(src_dir, tmp, doc, {g["file"] for g in graphs.values()})
            settings["weights"] = entry
            _relink(settings, dest)
            write_manifest(tmp, ONNX_EXPORT, settings, doc.get("model_hash"), reports=tuple(doc.get("reports", ())))
    finally:
        source.close()
    return entry


# ----------------------------------------------------------------------------- the plan
@dataclass
class _Weight:
    """One distinct weight (K, N) as a MatMul reads it (a Gemm's ``transB`` weight transposed) and what it becomes."""

    key: tuple
    proto: Any  # one initializer holding it
    transposed: bool
    sha256: str
    shape: tuple[int, int]
    blocks: Int4Blocks | None = None  # int4 formats
    skip: str | None = None  # why it stays as it is
    nodes: dict[str, list[str]] = field(default_factory=dict)  # graph -> node names

    @property
    def tag(self) -> str:
        return self.sha256[:16]


@dataclass
class _Plan:
    linears: dict[tuple, _Weight]  # (source key, transposed) -> weight
    gathers: dict[tuple, _Weight | None]  # table key -> the weight whose blocks it reads (int4, tied), or None
    tables: dict[tuple, dict]  # table key -> {"sha256", "shape", "nodes", "format"}


def _initializers(m) -> dict:
    return {t.name: t for t in m.graph.initializer}


def _is_float_2d(t) -> bool:
    import onnx

    return t is not None and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2


def _linear(node, inits: dict):
    """(weight initializer, transposed, bias input or None) of a MatMul / Gemm by a constant 2-D float32 weight, or
    None. Gemm: alpha 1, no transA, beta 1 where there is a bias (the forms ``nn.Linear`` exports to)."""
    from onnx import helper

    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    t = inits.get(node.input[1])
    if not _is_float_2d(t):
        return None
    if node.op_type == "MatMul":
        return t, False, None
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if a.get("alpha", 1.0) != 1.0 or a.get("transA", 0) or (bias and a.get("beta", 1.0) != 1.0):
        return None
    return t, bool(a.get("transB", 0)), bias


def _table(node, inits: dict):
    """The constant 2-D float32 table of a Gather along axis 0, or None."""
    if node.domain not in ("", "ai.onnx") or node.op_type != "Gather":
        return None
    t = inits.get(node.input[0])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return t if _is_float_2d(t) and axis == 0 else None


def _qdq_skip(k: int, n: int, block_size: int) -> str | None:
    """Why a (K, N) weight cannot be a TensorRT INT4 blocked DequantizeLinear (None: it can)."""
    if k % block_size:
        return f"K={k} is not a multiple of the block size {block_size} (TensorRT infers the block from the shapes)"
    if n % 2:
        return f"N={n} is odd (TensorRT packs INT4 along the last dimension, which must be even)"
    return None


def _weight_array(w: _Weight, source: _Source) -> np.ndarray:
    a = source.array(w.proto)
    return a.T if w.transposed else a


def _plan(models: dict, source: _Source, fmt: str, block_size: int, sym: bool, say) -> _Plan:
    """Find every MatMul / Gemm by a constant 2-D float32 weight and every Gather of a constant 2-D float32 table, in
    every graph; quantize each distinct weight once."""
    linears: dict[tuple, _Weight] = {}
    tables: dict[tuple, dict] = {}
    protos: dict[tuple, Any] = {}
    for gname, m in models.items():
        inits = _initializers(m)
        for node in m.graph.node:
            lin, table = _linear(node, inits), _table(node, inits)
            if lin is not None:
                t, transposed, _ = lin
                key = (source.key(t), transposed)
                if key not in linears:
                    k, n = (t.dims[1], t.dims[0]) if transposed else (t.dims[0], t.dims[1])
                    w = _Weight(key, t, transposed, "", (int(k), int(n)))
                    w.sha256 = sha256_array(_weight_array(w, source))
                    linears[key] = w
                linears[key].nodes.setdefault(gname, []).append(node.name)
            elif table is not None:
                key = source.key(table)
                protos.setdefault(key, table)
                tables.setdefault(key, {"shape": [int(d) for d in table.dims], "nodes": {}})
                tables[key]["nodes"].setdefault(gname, []).append(node.name)
    say(f"{fmt}: {len(linears)} weights")
    by_sha = {}
    for w in linears.values():
        if fmt == "int4-qdq":
            w.skip = _qdq_skip(*w.shape, block_size)
        if fmt != "fp16" and w.skip is None:
            w.blocks = quantize_int4(_weight_array(w, source), block_size, sym)
        by_sha[w.sha256] = w
    gathers: dict[tuple, _Weight | None] = {}
    for key, info in tables.items():
        table = source.array(protos[key])
        info["sha256"] = sha256_array(table)
        head = by_sha.get(sha256_array(table.T)) if fmt == "int4" else None
        gathers[key] = (head if head is not None and head.blocks is not None and not head.blocks.float_zero_points
                        and head.shape[0] % block_size == 0 else None)  # GatherBlockQuantized: uint8 zero points
        info["format"] = ("GatherBlockQuantized over the LM head's blocks (tied)" if gathers[key] is not None
                          else "fp16" if fmt == "fp16" else "fp32 (kept)")
    return _Plan(linears, gathers, tables)


# ----------------------------------------------------------------------------- rewriting one graph
def _rewrite(m, plan: _Plan, source: _Source, store: _Store, fmt: str, block_size: int,
             accuracy_level: int) -> None:
    from onnx import helper

    g = m.graph
    inits = _initializers(m)
    new_inits: dict[str, Any] = {}
    nodes = []
    for node in g.node:
        lin, table = _linear(node, inits), _table(node, inits)
        if lin is not None:
            t, transposed, bias = lin
            w = plan.linears[(source.key(t), transposed)]
            if w.skip is None:
                nodes.extend(_linear_nodes(node, t, bias, w, source, store, new_inits, fmt, block_size, accuracy_level))
                continue
        elif table is not None:
            head = plan.gathers[source.key(table)]
            if head is not None:
                nodes.append(_gather_int4(node, head, store, new_inits, block_size))
                continue
            if fmt == "fp16":
                nodes.extend(_gather_fp16(node, table, source, store, new_inits))
                continue
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    # keep the initializers some node still reads (subgraphs included), re-pointed into the new file
    used = _names_used(g)
    kept = []
    for t in g.initializer:
        if t.name not in used or t.name in new_inits:
            continue
        kept.append(t if source.ext(t) is None else
                    store.tensor(t.name, t.data_type, t.dims, source.key(t), source.raw(t)))
    kept.extend(new_inits.values())
    del g.initializer[:]
    g.initializer.extend(kept)
    names = {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in names or i.name in used]
    del g.input[:]
    g.input.extend(inputs)
    if fmt == "int4" and not any(o.domain == MS_DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    if fmt == "int4-qdq":
        for imports in [m.opset_import, *(f.opset_import for f in m.functions)]:
            for o in imports:
                if o.domain in ("", "ai.onnx") and o.version < QDQ_OPSET:
                    o.version = QDQ_OPSET
        m.ir_version = max(m.ir_version, INT4_IR)


def _names_used(g) -> set[str]:
    used = {o.name for o in g.output}
    for n in g.node:
        used.update(n.input)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                used |= _names_used(sub)
    return used


def _add(new_inits: dict, store: _Store, name: str, data_type: int, dims, key, data) -> str:
    if name not in new_inits:
        new_inits[name] = store.tensor(name, data_type, dims, key, data)
    return name


def _int4_inputs(w: _Weight, store: _Store, new_inits: dict, rows: bool = False) -> list[str]:
    """The MatMulNBits (or, ``rows``, GatherBlockQuantized) weight inputs of w: data, scales[, zero points]."""
    import onnx

    assert w.blocks is not None
    b, scales, zp = w.blocks.matmulnbits()
    k, n = w.shape
    u8, f32 = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT
    data = (_add(new_inits, store, f"q4_{w.tag}_rows", u8, (n, k * w.blocks.bits // 8), ("q4", w.tag), b) if rows else
            _add(new_inits, store, f"q4_{w.tag}", u8, b.shape, ("q4", w.tag), b))
    ins = [data, _add(new_inits, store, f"q4_{w.tag}_scales", f32, scales.shape, ("scales", w.tag), scales)]
    if zp is not None:  # uint8 pairs, or float32 for the checkpoint's own grid
        ins.append(_add(new_inits, store, f"q4_{w.tag}_zero_points", f32 if w.blocks.float_zero_points else u8, zp.shape,
                        ("zp", w.tag), zp))
    return ins


def _zeros_input(store: _Store, new_inits: dict, zeros) -> str:
    """Packed zero points of 0 of one shape, stored once for every weight that has that shape."""
    import onnx

    return _add(new_inits, store, f"q4_zeros_{zeros.shape[0]}x{zeros.shape[1]}", onnx.TensorProto.UINT8, zeros.shape,
                ("zeros", zeros.shape), zeros)


def _int4_split_inputs(w: _Weight, store: _Store, new_inits: dict) -> tuple[list[str], str, str]:
    """A weight on the checkpoint's own grid for a MatMul (:meth:`Int4Blocks.matmulnbits_split`): the MatMulNBits
    inputs (data, scales, zero points of 0), the (K, k_blocks) block-sum matrix (one per K and block, shared) and
    the (k_blocks, N) offsets."""
    import onnx

    b, scales, zeros, offsets, blocks = w.blocks.matmulnbits_split()
    k, _ = w.shape
    u8, f32 = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT
    ins = [_add(new_inits, store, f"q4_{w.tag}", u8, b.shape, ("q4", w.tag), b),
           _add(new_inits, store, f"q4_{w.tag}_scales", f32, scales.shape, ("scales", w.tag), scales),
           _zeros_input(store, new_inits, zeros)]
    bs = _add(new_inits, store, f"q4_block_sums_{k}x{blocks.shape[1]}", f32, blocks.shape, ("block_sums", blocks.shape),
              blocks)
    off = _add(new_inits, store, f"q4_{w.tag}_offsets", f32, offsets.shape, ("offsets", w.tag), offsets)
    return ins, bs, off


def _fp16_tensor(t, source: _Source, store: _Store, new_inits: dict) -> str:
    import onnx

    return _add(new_inits, store, f"{t.name}_fp16", onnx.TensorProto.FLOAT16, t.dims, ("fp16", source.key(t)),
                to_fp16(source.array(t)))


def _linear_nodes(node, t, bias: str | None, w: _Weight, source: _Source, store: _Store, new_inits: dict,
                  fmt: str, block_size: int, accuracy_level: int) -> list:
    """The nodes that replace one MatMul / Gemm by w in the format."""
    import onnx
    from onnx import helper

    out = node.output[0]
    if fmt == "fp16":  # the same node, its weight read through a Cast from float16
        cast = helper.make_node("Cast", [_fp16_tensor(t, source, store, new_inits)], [f"{node.name}_w"],
                                to=onnx.TensorProto.FLOAT, name=f"{node.name}_cast")
        same = onnx.NodeProto()
        same.CopyFrom(node)
        same.input[1] = cast.output[0]
        return [cast, same]
    y = out if bias is None else f"{out}_nobias"
    k, n = w.shape
    if fmt == "int4":
        attrs = dict(K=k, N=n, bits=w.blocks.bits, block_size=block_size)
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        if w.blocks.bits == 8:  # a Q8_0 weight: two 4-bit MatMulNBits over its nibbles, at speed
            (bh, sh), (bl, sl, zl) = w.blocks.matmulnbits_halves()
            u8, f32 = onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT
            hi = [_add(new_inits, store, f"q8_{w.tag}_high", u8, bh.shape, ("q8_high", w.tag), bh),
                  _add(new_inits, store, f"q8_{w.tag}_high_scales", f32, sh.shape, ("q8_high_scales", w.tag), sh)]
            lo = [_add(new_inits, store, f"q8_{w.tag}_low", u8, bl.shape, ("q8_low", w.tag), bl),
                  _add(new_inits, store, f"q4_{w.tag}_scales", f32, sl.shape, ("scales", w.tag), sl),
                  _zeros_input(store, new_inits, zl)]
            a4 = dict(attrs, bits=4)
            new = [helper.make_node("MatMulNBits", [node.input[0], *hi], [f"{y}_high"], name=f"{node.name}_q8_high",
                                    domain=MS_DOMAIN, **a4),
                   helper.make_node("MatMulNBits", [node.input[0], *lo], [f"{y}_low"], name=f"{node.name}_q8_low",
                                    domain=MS_DOMAIN, **a4),
                   helper.make_node("Add", [f"{y}_high", f"{y}_low"], [y], name=f"{node.name}_q8_add")]
        elif w.blocks.float_zero_points:  # the checkpoint's own grid: MatMulNBits at speed + the blocks' offsets
            ins, blocks, offsets = _int4_split_inputs(w, store, new_inits)
            yq, xs, off = f"{y}_codes", f"{node.name}_block_sums", f"{y}_offsets"
            new = [helper.make_node("MatMulNBits", [node.input[0], *ins], [yq], name=f"{node.name}_q4",
                                    domain=MS_DOMAIN, **attrs),
                   helper.make_node("MatMul", [node.input[0], blocks], [xs], name=f"{node.name}_block_sums"),
                   helper.make_node("MatMul", [xs, offsets], [off], name=f"{node.name}_offsets"),
                   helper.make_node("Add", [yq, off], [y], name=f"{node.name}_q4_add")]
        else:
            new = [helper.make_node("MatMulNBits", [node.input[0], *_int4_inputs(w, store, new_inits)], [y],
                                    name=f"{node.name}_q4", domain=MS_DOMAIN, **attrs)]
    else:
        assert w.blocks is not None
        raw, scales = w.blocks.int4_dq()
        q = _add(new_inits, store, f"int4_{w.tag}", onnx.TensorProto.INT4, (k, n), ("int4", w.tag), raw)
        s = _add(new_inits, store, f"int4_{w.tag}_scales", onnx.TensorProto.FLOAT, scales.shape,
                 ("dq_scales", w.tag), scales)
        dq = helper.make_node("DequantizeLinear", [q, s], [f"{node.name}_w"], axis=0, block_size=block_size,
                              name=f"{node.name}_dq")
        new = [dq, helper.make_node("MatMul", [node.input[0], dq.output[0]], [y], name=node.name)]
    if bias is not None:
        new.append(helper.make_node("Add", [y, bias], [out], name=f"{node.name}_bias"))
    return new


def _gather_int4(node, head: _Weight, store: _Store, new_inits: dict, block_size: int):
    """Gather(table (V, D), ids) -> GatherBlockQuantized over the head's blocks: its MatMulNBits data (V, D / B, B / 2)
    is, byte for byte, the table quantized along D, read as (V, D / 2)."""
    from onnx import helper

    data, scales, *zp = _int4_inputs(head, store, new_inits, rows=True)
    return helper.make_node("GatherBlockQuantized", [data, node.input[1], scales, *zp], list(node.output),
                            name=f"{node.name}_q4", domain=MS_DOMAIN, bits=head.blocks.bits,
                            block_size=block_size, gather_axis=0, quantize_axis=1)


def _gather_fp16(node, t, source: _Source, store: _Store, new_inits: dict) -> list:
    import onnx
    from onnx import helper

    mid = f"{node.output[0]}_fp16"
    gather = helper.make_node("Gather", [_fp16_tensor(t, source, store, new_inits), node.input[1]], [mid], axis=0,
                              name=node.name)
    cast = helper.make_node("Cast", [mid], list(node.output), to=onnx.TensorProto.FLOAT, name=f"{node.name}_cast")
    return [gather, cast]


# ----------------------------------------------------------------------------- writing the result
def _entry(plan: _Plan, fmt: str, block_size: int, sym: bool, accuracy_level: int, before: int, after: int,
           models: dict) -> dict[str, Any]:
    import onnxruntime

    tensors, skipped = [], []
    for w in plan.linears.values():
        rec = {"kind": "matmul", "sha256": w.sha256, "shape": list(w.shape), "nodes": w.nodes}
        if w.blocks is not None and w.blocks.own:  # the checkpoint's own blocks (kvexport.quant.blocks.own_blocks)
            rec["own_blocks"] = "Q4_1" if w.blocks.bits == 4 else "Q8_0"
        (skipped if w.skip else tensors).append({**rec, "why": w.skip} if w.skip else rec)
    for key, info in plan.tables.items():
        rec = {"kind": "gather", "sha256": info["sha256"], "shape": info["shape"], "nodes": info["nodes"],
               "format": info["format"]}
        if plan.gathers[key] is not None:
            rec["blocks_of"] = plan.gathers[key].sha256  # type: ignore[union-attr]
            tensors.append(rec)
        elif fmt == "fp16":
            tensors.append(rec)
        else:
            skipped.append({**rec, "why": "an embedding table is read one row per token; int4 only where the LM head's "
                                          "blocks serve it (tied)" if fmt == "int4" else
                                          "TensorRT's Gather takes no INT4 table"})
    entry: dict[str, Any] = {"format": fmt, "bytes_before": int(before), "bytes_after": int(after),
                             "tensors": tensors, "skipped": skipped}
    if fmt == "fp16":
        entry.update(op="Cast(float16 -> float) before each MatMul / Gemm and after each Gather",
                     rule="float16(w), round to nearest even")
    else:
        entry.update(bits=BITS, block_size=block_size, symmetric=sym,
                     rule=("symmetric: scale = absmax / 7, q = clip(rint(w / scale), -8, 7)" if sym else
                           f"asymmetric uint4: onnxruntime {onnxruntime.__version__} quantize_matmul_4bits; a "
                           "weight that holds a GGUF file's own blocks keeps them: Q4_1 (codes, scale d, float "
                           "zero point -m/d), Q8_0 (8-bit codes q + 128, scale d)"))
        entry["own_blocks"] = sum(1 for t in tensors if t.get("own_blocks"))
        entry["op"] = "com.microsoft::MatMulNBits" if fmt == "int4" else "DequantizeLinear(INT4, blocked) + MatMul"
        if fmt == "int4":
            entry["accuracy_level"] = int(accuracy_level)
    dec = next((n for n in DECODE_GRAPHS if n in models), None)
    if dec is not None:
        entry["decode_graph"] = dec
        entry["decode_weight_bytes"] = _step_bytes(models[dec])
    return entry


def _step_bytes(m) -> int:
    """Bytes of weights one step of the graph reads: every initializer a node uses, except one only ever gathered
    from (one row per token)."""
    from onnx import helper

    whole = set()
    for n in m.graph.node:
        gathered = n.op_type in ("Gather", "GatherBlockQuantized")
        whole.update(x for i, x in enumerate(n.input) if not (gathered and i == 0))
    total = 0
    for t in m.graph.initializer:
        if t.name not in whole:
            continue
        ext = {e.key: e.value for e in t.external_data}
        if "length" in ext:
            total += int(ext["length"])
        else:
            total += len(t.raw_data) or int(np.prod(t.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(
                t.data_type).itemsize
    return int(total)


def _save(models: dict, graphs: dict, tmp: Path) -> None:
    import onnx

    from kvexport.ops.registry import register_schemas

    register_schemas()
    for name, m in models.items():
        path = tmp / graphs[name]["file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save_model(m, str(path))
        onnx.checker.check_model(str(path), full_check=True)


def _copy_rest(src: Path, tmp: Path, doc: dict, graph_files: set[str]) -> None:
    """Every other file of the export (tokenizer, ...), as it was; reports of the fp32 export are not carried."""
    for rel in doc["files"]:
        if rel in graph_files or rel == WEIGHTS_FILE:
            continue
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst)


def _relink(settings: dict, dest: Path) -> None:
    """The source / original paths relative to the new directory."""
    for key in ("source", "original"):
        if settings.get(key):
            settings[f"{key}_relative"] = os.path.relpath(settings[key], dest.resolve())


__all__ = ["CHOICES", "FORMATS", "check_weights", "lossy_arithmetic", "quantize_export", "sha256_array"]
