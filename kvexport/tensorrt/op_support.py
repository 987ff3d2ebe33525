# SPDX-License-Identifier: Apache-2.0
"""Is an ONNX graph TensorRT-parseable? A check that needs no TensorRT.

Every node is checked against the ONNX-TensorRT parser's published operator support matrix
(:mod:`kvexport.tensorrt.trt_onnx_support`: TensorRT 10.3 and the newest tag): the operator must be imported, the
data types of its tensors must be in the operator's list, and the restrictions that can be read off a graph must
hold (constant axes, TopK's ``sorted`` and K bound, pooling dimensions, ...). Nodes of the ``kvexport`` domain are
checked against what the plugins accept instead (:data:`PLUGIN_IO`, the plugins' supportsFormatCombination and
creator fields). Model-local functions are inlined first, as the parser does, except the plugin ops' own functions,
which TensorRT replaces by the plugins (functions stripped before 10.7, plugins preferred from 10.7). Subgraphs of
If / Loop / Scan are checked too.

    report = check_model("out/llama-snapkv/decode.onnx")           # all versions of MATRICES
    report.raise_if_any()                                         # BadArtifact naming node, op, version, reason
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvexport.errors import BadArtifact
from kvexport.tensorrt.trt_onnx_support import MATRICES

KVEXPORT_DOMAIN = "kvexport"
_GROUPS = {"F": ("f32", "f16", "bf16"), "FI": ("f32", "f16", "bf16", "i32", "i64"),
           "FIB": ("f32", "f16", "bf16", "i32", "i64", "bool")}
#: ONNX TensorProto element type -> the matrix's type names (anything else is not a TensorRT type)
_ELEM = {1: "f32", 2: "u8", 3: "i8", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64", 16: "bf16", 17: "fp8",
         22: "i4", 23: "fp4"}
#: network input / output types TensorRT binds
_IO_TYPES = {"f32", "f16", "bf16", "i32", "i64", "bool", "u8", "i8"}
_REDUCE = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
           "ReduceProd", "ReduceSum", "ReduceSumSquare")
#: inputs that carry indices, shapes, axes, sizes or conditions, not the data the matrix's type list is about
_INDEX_INPUTS = {
    "Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "Scatter": (1,), "ScatterElements": (1,),
    "ScatterND": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 3),
    "TopK": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Split": (1,), "CumSum": (1,), "Resize": (1, 2, 3),
    "Upsample": (1,), "OneHot": (0, 1), "Trilu": (1,), "ConstantOfShape": (0,), "Where": (0,), "Dropout": (1, 2),
    "RotaryEmbedding": (3,), "TensorScatter": (2,), "STFT": (1, 3), "If": (0,), "Loop": (0, 1),
    **{r: (1,) for r in _REDUCE},
}
#: outputs that are indices, shapes or booleans whatever the input type
_INDEX_OUTPUTS = {"TopK": (1,), "ArgMax": (0,), "ArgMin": (0,), "NonZero": (0,), "Shape": (0,), "Size": (0,),
                  "Equal": (0,), "Greater": (0,), "GreaterOrEqual": (0,), "Less": (0,), "LessOrEqual": (0,),
                  "IsInf": (0,), "IsNaN": (0,), "NonMaxSuppression": (0,), "Dropout": (1,)}
#: ONNX defaults of the attributes the rules name
_DEFAULTS = {("TopK", "sorted"): 1, ("ScatterND", "reduction"): "none", ("LSTM", "input_forget"): 0,
             ("LSTM", "layout"): 0, ("TensorScatter", "axis"): -2}
_RESIZE = dict(coordinate_transformation_mode=("half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn",
                                               "asymmetric", "align_corners"),
               mode=("nearest", "linear"),
               nearest_mode=("floor", "ceil", "round_prefer_floor", "round_prefer_ceil"),
               keep_aspect_ratio_policy=("stretch",))


@dataclass(frozen=True)
class PluginIO:
    """What a kvexport plugin accepts: per input / output a type set or ``"=name"`` (the type of that input); a
    type set may also name another input with ``"=name"`` (a latent: q's type or uint8 codes). The last
    ``optional`` inputs may be left out (a node with fewer inputs)."""

    inputs: tuple[tuple[str, tuple[str, ...] | str], ...]
    outputs: tuple[tuple[str, tuple[str, ...] | str], ...]
    int_attrs: dict[str, tuple[int, int]]  # name -> inclusive range
    float_attrs: tuple[str, ...] = ()  # positive finite floats
    version: str = "1"  # the plugin_version the library registers
    optional: int = 0  # trailing inputs a node may omit
    optional_int_attrs: dict[str, tuple[int, int]] = field(default_factory=dict)


_FLOATS = ("f32", "f16", "bf16")
#: The plugins' declared formats (plugins/*/README.md; supportsFormatCombination in plugins/*/*Plugin.cpp, which
#: tests/plugins/plugin_host_check.cpp prints and tests/plugins/test_compile.py compares with this table).
PLUGIN_IO = {
    "TopKGather": PluginIO(
        inputs=(("scores", ("f32",)), ("keys", (*_FLOATS, "u8")), ("values", "=keys"), ("positions", ("i64",))),
        outputs=(("kept_keys", "=keys"), ("kept_values", "=keys"), ("kept_positions", ("i64",)),
                 ("kept_indices", ("i64",))),
        int_attrs={"k": (1, 2**31 - 1)}),
    "LatentAttention": PluginIO(
        inputs=(("q", _FLOATS), ("latent", "=q"), ("q_positions", ("i64",)), ("latent_positions", ("i64",))),
        outputs=(("out", "=q"),),
        int_attrs={"rank": (1, 512)}, float_attrs=("scale",)),
}
#: plugin_version "2" signatures (op version 2): a LatentAttention over this step's rows (``new_latent``) and / or a
#: quantized latent (uint8 codes, float16 ``latent_scale``, ``latent_format`` 1 int8 / 2 fp8); a float cache takes
#: 4 or 5 inputs, a quantized one all 6, the latent (B, S, R+Dr) or (B, 1, S, R+Dr) (plugins/latent_attention/
#: README.md). The exporter writes version-2 nodes over int8 / fp8 latent caches (the codes as the cache input holds
#: them), version-1 nodes over float ones.
PLUGIN_IO_V2 = {
    "LatentAttention": PluginIO(
        inputs=(("q", _FLOATS), ("latent", ("=q", "u8")), ("q_positions", ("i64",)), ("latent_positions", ("i64",)),
                ("new_latent", "=q"), ("latent_scale", ("f16",))),
        outputs=(("out", "=q"),),
        int_attrs={"rank": (1, 512)}, float_attrs=("scale",), version="2", optional=2,
        optional_int_attrs={"latent_format": (0, 2)}),
}
#: LatentAttention's largest latent width R + Dr (plugins/latent_attention/latentAttentionKernel.h)
LATENT_MAX_DIM = 1024


@dataclass(frozen=True)
class Rule:
    kind: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class OpEntry:
    types: frozenset[str]
    rules: tuple[Rule, ...]


@dataclass(frozen=True)
class Matrix:
    version: str
    source: str
    opset: tuple[int, int]
    ops: dict[str, OpEntry]


def _parse(version: str, data: dict) -> Matrix:
    ops = {}
    for line in data["table"].strip().splitlines():
        name, rest = line.split(":", 1)
        types_part, _, rules_part = rest.partition(";")
        types = frozenset(t for tok in types_part.split() for t in _GROUPS.get(tok, (tok,)))
        rules = tuple(Rule(tok.split(":")[0], tuple(tok.split(":")[1:])) for tok in rules_part.split())
        ops[name.strip()] = OpEntry(types, rules)
    return Matrix(version, data["source"], tuple(data["opset"]), ops)


_MATRICES = {v: _parse(v, d) for v, d in MATRICES.items()}


def matrix(version: str) -> Matrix:
    """The parsed support matrix of a TensorRT version listed in MATRICES."""
    return _MATRICES[version]


@dataclass(frozen=True)
class Problem:
    """One reason a node (or the graph) would not parse."""

    graph: str
    node: str
    op: str
    version: str  # TensorRT version, "plugin" for kvexport nodes
    reason: str

    def __str__(self) -> str:
        return f"{self.graph}: node {self.node!r} ({self.op}) for TensorRT {self.version}: {self.reason}"


@dataclass
class OpSupportReport:
    graph: str
    versions: tuple[str, ...]
    nodes: int = 0
    plugin_nodes: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)  # tensors whose type neither the graph nor inference gives

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_any(self, limit: int = 8) -> None:
        if self.problems:
            more = f" (+{len(self.problems) - limit} more)" if len(self.problems) > limit else ""
            raise BadArtifact(f"{self.graph} is not TensorRT-parseable: "
                              + "; ".join(map(str, self.problems[:limit])) + more)


# ------------------------------------------------------------------------------------------------- graph facts
class _Graph:
    """Types, shapes, producers and constant-ness of the tensors of one (sub)graph."""

    def __init__(self, graph, outer: _Graph | None = None):
        import onnx

        self.graph = graph
        self.outer = outer
        self.types: dict[str, str | None] = {}
        self.shapes: dict[str, tuple | None] = {}
        self.consts: dict[str, object] = {}  # name -> numpy value (initializers, Constant outputs)
        self.folded: set[str] = set()  # resolvable to a constant (consts + arithmetic on them + static shapes)
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type"):
                self.types[vi.name] = _ELEM.get(tt.elem_type, f"onnx type {tt.elem_type}") if tt.elem_type else None
                dims = tt.shape.dim if tt.HasField("shape") else None
                self.shapes[vi.name] = (tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
                                        if dims is not None else None)
        for init in graph.initializer:
            self.types[init.name] = _ELEM.get(init.data_type, f"onnx type {init.data_type}")
            self.shapes[init.name] = tuple(init.dims)
            self.consts[init.name] = onnx.numpy_helper.to_array(init)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                value = _constant_value(node)
                if value is not None:
                    out = node.output[0]
                    self.consts[out] = value
                    self.types.setdefault(out, _ELEM.get(onnx.helper.np_dtype_to_tensor_dtype(value.dtype)))
                    self.shapes.setdefault(out, tuple(value.shape))
        self.folded = set(self.consts)
        for node in graph.node:
            ins = [i for i in node.input if i]
            static_shape = node.op_type in ("Shape", "Size") and ins and self.shapes.get(ins[0]) is not None \
                and None not in self.shapes[ins[0]]
            random = node.op_type.startswith("Random")
            if static_shape or (ins and not random and all(i in self.folded for i in ins)):
                self.folded.update(o for o in node.output if o)

    def type(self, name: str) -> str | None:
        if name in self.types:
            return self.types[name]
        return self.outer.type(name) if self.outer is not None else None

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        if shape is None and self.outer is not None:
            return self.outer.rank(name)
        return None if shape is None else len(shape)

    def is_const(self, name: str) -> bool:
        return name in self.consts or (self.outer is not None and self.outer.is_const(name))

    def is_folded(self, name: str) -> bool:
        return name in self.folded or (self.outer is not None and self.outer.is_folded(name))

    def const(self, name: str):
        if name in self.consts:
            return self.consts[name]
        return self.outer.const(name) if self.outer is not None else None


def _constant_value(node):
    """The value of a Constant node (value / value_int(s) / value_float(s)); None for the unsupported kinds."""
    import numpy as np
    import onnx

    for a in node.attribute:
        if a.name == "value":
            return onnx.numpy_helper.to_array(a.t)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
    return None


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _name(node, index: int) -> str:
    return node.name or f"#{index} {node.op_type}"


# ------------------------------------------------------------------------------------------------- node checks
def _check_rules(node, entry: OpEntry, g: _Graph, attrs: dict) -> list[str]:
    bad = []
    ins, outs = list(node.input), list(node.output)

    def inp(i: int) -> str:
        return ins[i] if i < len(ins) else ""

    for rule in entry.rules:
        k, a = rule.kind, rule.args
        if k in ("const", "fold") and inp(int(a[0])):
            name = inp(int(a[0]))
            if not (g.is_const(name) if k == "const" else g.is_folded(name)):
                what = "an initializer or Constant" if k == "const" else "resolvable to a constant"
                bad.append(f"input {a[0]} ({name}) must be {what}")
        elif k == "attr":
            key, want = a[0].split("=", 1)
            got = attrs.get(key, _DEFAULTS.get((node.op_type, key)))
            if str(got) != want:
                bad.append(f"attribute {key} = {got!r} (TensorRT needs {want})")
        elif k == "noattr" and a[0] in attrs:
            bad.append(f"attribute {a[0]} is not supported")
        elif k == "noin" and inp(int(a[0])):
            bad.append(f"optional input {a[0]} ({inp(int(a[0]))}) is not supported")
        elif k == "noout" and int(a[0]) < len(outs) and outs[int(a[0])]:
            bad.append(f"optional output {a[0]} ({outs[int(a[0])]}) is not supported")
        elif k == "lt" and inp(int(a[0])):
            v = g.const(inp(int(a[0])))
            if v is not None and int(v.max()) >= int(a[1]):
                bad.append(f"input {a[0]} = {int(v.max())} must be below {a[1]}")
        elif k == "rank" and inp(int(a[0])):
            r = g.rank(inp(int(a[0])))
            if r is not None and r != int(a[1]):
                bad.append(f"input {a[0]} has rank {r}, TensorRT needs {a[1]}")
        elif k == "itype" and inp(int(a[0])):
            t = g.type(inp(int(a[0])))
            if t is not None and t != a[1]:
                bad.append(f"input {a[0]} is {t}, TensorRT needs {a[1]}")
        elif k == "pool":
            spatial = len(attrs.get("kernel_shape", ()))
            if not 1 <= spatial <= 3:
                bad.append(f"{spatial}-D pooling (1-D to 3-D only)")
            if any(int(d) != 1 for d in attrs.get("dilations", ())):
                bad.append(f"dilations {list(attrs['dilations'])} (all ones only)")
        elif k == "resize":
            for key, allowed in _RESIZE.items():
                if key in attrs and attrs[key] not in allowed:
                    bad.append(f"{key} = {attrs[key]!r} is not supported")
            if attrs.get("antialias", 0):
                bad.append("antialias is not supported")
    return bad


#: Q/DQ tensors whose type is not the matrix's list (which names the quantized side, DQ's input / Q's zero point, or
#: Q's float input): (input, output) positions -> the types they take (onnx-tensorrt QuantDequantLinearHelper)
_QDQ_SIDES = {"DequantizeLinear": {("input", 1): _FLOATS, ("output", 0): _FLOATS},
              "QuantizeLinear": {("output", 0): ("i8", "i4", "fp8", "fp4"), ("input", 2): ("i8", "i4", "fp8", "fp4")}}


def _check_types(node, entry: OpEntry, g: _Graph, untyped: list[str]) -> list[str]:
    bad = []
    skip_in = _INDEX_INPUTS.get(node.op_type, ())
    skip_out = _INDEX_OUTPUTS.get(node.op_type, ())
    sides = _QDQ_SIDES.get(node.op_type, {})
    for kind, names, skip in (("input", node.input, skip_in), ("output", node.output, skip_out)):
        for i, name in enumerate(names):
            if not name or i in skip:
                continue
            t = g.type(name)
            allowed = sides.get((kind, i), entry.types)
            if t is None:
                untyped.append(name)
            elif t not in allowed:
                bad.append(f"{kind} {i} ({name}) is {t}; TensorRT takes {', '.join(sorted(allowed))}")
    return bad


#: what TensorRT converts UINT8 from and to (its DataType.kUINT8 documentation: "uint8 conversions are only
#: supported for {float32, float16}"); the matrix's Cast line lists u8 without the pairing
_UINT8_PEERS = ("f32", "f16")


def _check_uint8_cast(node, g: _Graph) -> list[str]:
    """A Cast / CastLike to or from uint8 must have float32 or float16 on the other side."""
    if node.op_type not in ("Cast", "CastLike") or not node.input or not node.output:
        return []
    src, dst = g.type(node.input[0]), g.type(node.output[0])
    if src is None or dst is None or src == dst or "u8" not in (src, dst):
        return []
    other = dst if src == "u8" else src
    if other in _UINT8_PEERS:
        return []
    return [f"casts {src} to {dst}: TensorRT converts uint8 only from / to {', '.join(_UINT8_PEERS)}"]


def _check_plugin(node, g: _Graph) -> list[str]:
    io = PLUGIN_IO.get(node.op_type)
    if io is None:
        return [f"no kvexport plugin is named {node.op_type} (plugins: {', '.join(PLUGIN_IO)})"]
    bad = []
    attrs = _attrs(node)
    v2 = PLUGIN_IO_V2.get(node.op_type)
    if v2 is not None and (attrs.get("plugin_version") == v2.version or len(node.input) > len(io.inputs)
                           or "latent_format" in attrs):
        io = v2
        fmt = attrs.get("latent_format", 0)
        if fmt and len(node.input) != len(io.inputs):
            bad.append(f"latent_format {fmt} (a quantized latent) needs all {len(io.inputs)} inputs "
                       f"({', '.join(n for n, _ in io.inputs)}), the node has {len(node.input)}")
        if len(node.input) > 1:
            t = g.type(node.input[1])
            if t is not None and (t == "u8") != bool(fmt):
                bad.append(f"input latent ({node.input[1]}) is {t}: uint8 codes go with latent_format 1 / 2, a float "
                           "latent with latent_format 0")
    for key, want in (("plugin_namespace", "kvexport"), ("plugin_version", io.version)):
        if key in attrs and attrs[key] != want:
            bad.append(f"{key} = {attrs[key]!r}, the plugin library registers {want!r}")
    for key, (lo, hi) in io.int_attrs.items():
        v = attrs.get(key)
        if not isinstance(v, int) or not lo <= v <= hi:
            bad.append(f"attribute {key} = {v!r} must be an integer in [{lo}, {hi}]")
    for key, (lo, hi) in io.optional_int_attrs.items():
        v = attrs.get(key, lo)
        if not isinstance(v, int) or not lo <= v <= hi:
            bad.append(f"attribute {key} = {v!r} must be an integer in [{lo}, {hi}]")
    for key in io.float_attrs:
        v = attrs.get(key)
        if not isinstance(v, float) or not v > 0 or v == float("inf"):
            bad.append(f"attribute {key} = {v!r} must be a positive float")
    types = {}
    for kind, decl, names in (("input", io.inputs, node.input), ("output", io.outputs, node.output)):
        least = len(decl) - (io.optional if kind == "input" else 0)
        if not least <= len(names) <= len(decl) or "" in list(names):
            what = f"{least} to {len(decl)}" if least < len(decl) else f"{len(decl)}"
            bad.append(f"{len(names)} {kind}s (none may be empty), the plugin has {what} "
                       f"({', '.join(n for n, _ in decl)})")
            continue
        for (pname, allowed), name in zip(decl, names, strict=False):
            t = g.type(name)
            types[pname] = t
            opts = (allowed,) if isinstance(allowed, str) else allowed
            want = tuple(types.get(a[1:]) if a.startswith("=") else a for a in opts)
            if t is not None and None not in want and t not in want:
                bad.append(f"{kind} {pname} ({name}) is {t}; the plugin takes {', '.join(want)}")
    if node.op_type == "LatentAttention" and node.input:
        shape = g.shapes.get(node.input[0])
        if shape and shape[-1] and not attrs.get("rank", 0) <= shape[-1] <= LATENT_MAX_DIM:
            bad.append(f"latent width {shape[-1]} must be in [rank, {LATENT_MAX_DIM}]")
        lat = g.shapes.get(node.input[1]) if len(node.input) > 1 else None
        one_head = io.version == "2" and lat is not None and len(lat) == 4 and lat[1] in (1, None)
        if lat is not None and len(lat) != 3 and not one_head:
            want = "(B, S, R+Dr) or (B, 1, S, R+Dr)" if io.version == "2" else "(B, S, R+Dr)"
            bad.append(f"input latent ({node.input[1]}) has shape {list(lat)}; plugin version {io.version} takes {want}")
    return bad


def _check_graph(graph, m: Matrix, label: str, report: OpSupportReport, outer: _Graph | None = None,
                 weights: frozenset[str] = frozenset()) -> None:
    """``weights``: names of the external initializers :func:`_prepared` turned into typed inputs (not network I/O:
    the parser reads them as constants, INT4 weights included)."""
    from onnx import AttributeProto

    g = _Graph(graph, outer)
    if outer is None:
        for vi in [*graph.input, *graph.output]:
            if vi.name in weights:
                continue
            t = g.type(vi.name)
            if t is not None and t not in _IO_TYPES:
                report.problems.append(Problem(label, vi.name, "graph I/O", m.version,
                                               f"network input/output of type {t}"))
    for i, node in enumerate(graph.node):
        report.nodes += 1
        name = _name(node, i)
        if node.domain == KVEXPORT_DOMAIN:
            report.plugin_nodes[node.op_type] = report.plugin_nodes.get(node.op_type, 0) + 1
            report.problems += [Problem(label, name, node.op_type, m.version, r) for r in _check_plugin(node, g)]
            continue
        if node.domain not in ("", "ai.onnx"):
            report.problems.append(Problem(label, name, f"{node.domain}::{node.op_type}", m.version,
                                           "custom-domain node with no model-local function and no kvexport plugin"))
            continue
        entry = m.ops.get(node.op_type)
        if entry is None:
            report.problems.append(Problem(label, name, node.op_type, m.version,
                                           f"not in the parser's support matrix ({m.source})"))
            continue
        attrs = _attrs(node)
        reasons = (_check_types(node, entry, g, report.untyped) + _check_rules(node, entry, g, attrs)
                   + _check_uint8_cast(node, g))
        report.problems += [Problem(label, name, node.op_type, m.version, r) for r in reasons]
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                _check_graph(a.g, m, f"{label}/{name}.{a.name}", report, g)


def _prepared(model):
    """The model as the parser sees it: local functions inlined except the kvexport plugin ops'; types inferred."""
    import onnx
    from onnx import inliner, shape_inference

    from kvexport import ops as kvx_ops

    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:  # the checks need types and shapes only: weights stored outside become typed graph inputs
        model = onnx.ModelProto.FromString(model.SerializeToString())
        kept = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        model.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    keep = [(f.domain, f.name) for f in model.functions if f.domain == KVEXPORT_DOMAIN and f.name in PLUGIN_IO]
    if len(keep) != len(model.functions):
        model = inliner.inline_selected_functions(model, keep, exclude=True)
    kvx_ops.register_schemas()
    try:
        model = shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        pass  # keep the exporter's value_info
    return model


def check_model(model_or_path, versions: tuple[str, ...] | None = None, name: str | None = None) -> OpSupportReport:
    """Check an ONNX model (ModelProto or path; external weights are not loaded) for the given TensorRT versions
    (default: every version in MATRICES). Returns a report listing every problem found."""
    import onnx

    if isinstance(model_or_path, (str, Path)):
        label = name or Path(model_or_path).name
        model = onnx.load(str(model_or_path), load_external_data=False)
    else:
        label, model = name or (model_or_path.graph.name or "model"), model_or_path
    versions = tuple(versions or MATRICES)
    report = OpSupportReport(label, versions)
    weights = frozenset(t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    model = _prepared(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    for v in versions:
        m = matrix(v)
        if opset is not None and not m.opset[0] <= opset <= m.opset[1]:
            report.problems.append(Problem(label, "(model)", "opset", v,
                                           f"default-domain opset {opset} outside [{m.opset[0]}, {m.opset[1]}]"))
        nodes, plugins, untyped = report.nodes, dict(report.plugin_nodes), list(report.untyped)
        _check_graph(model.graph, m, label, report, weights=weights)
        if v != versions[0]:  # count the graph once
            report.nodes, report.plugin_nodes, report.untyped = nodes, plugins, untyped
    return report


def check_export_dir(export_dir, versions: tuple[str, ...] | None = None) -> list[OpSupportReport]:
    """check_model for every ``*.onnx`` of an export directory (sorted by name)."""
    from kvexport.tensorrt.engine import find_onnx_graphs

    return [check_model(p, versions) for p in find_onnx_graphs(export_dir)]


__all__ = ["PLUGIN_IO", "Problem", "OpSupportReport", "check_model", "check_export_dir", "matrix"]
