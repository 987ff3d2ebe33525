# SPDX-License-Identifier: Apache-2.0
"""``kvexport::LatentAttention``: absorbed multi-head latent attention over an MLA cache and this step's rows
(docs/custom_ops.md, LatentAttention; plugin: plugins/latent_attention).

All of the op in one place: its reference (:func:`latent_attention_reference`), :func:`latent_attention` as the MLA
attention calls it (the reference when it runs, the PyTorch op ``torch.ops.kvexport.latent_attention`` when it is
traced for export, so the graph carries one node and the exporter patches nothing), the ONNX schema (versions 1
and 2) and function bodies (opset 18, one per configuration), the translation the dynamo exporter uses, and the
plugin contract.

Version 2 takes this step's rows as a second part (``new_latent``, attended in the same softmax without
concatenating it to the cache) and a quantized cache (uint8 codes + float16 ``latent_scale``, ``latent_format`` 1
int8 / 2 fp8, dequantized on load; :mod:`kvexport.cache.quant`). Plugin versions: "1" (four inputs, a float latent,
what the exporter writes for a float cache) and "2" (the version-2 inputs: an int8 / fp8 latent cache, the codes
read by the kernel; docs/quantized.md).
"""

from __future__ import annotations

from typing import Optional

import onnx
import torch
from onnx import defs, helper

from kvexport.cache.formats import FORMATS
from kvexport.cache.quant import FP8_VALUES, dequantize
from kvexport.ops.common import DOMAIN, FLOATS, OPSET, PLUGIN_NAMESPACE, plugin_attrs

NAME = "LatentAttention"
#: plugin versions: what a node asks for (:func:`plugin_version`) and what the plugin library registers
PLUGIN_VERSION = "1"
PLUGIN_REGISTERED = ("1", "2")
#: LatentAttention ``latent_format`` codes (kvexport.cache.formats.KVFormat.code)
LATENT_FORMATS = {0: "float", 1: "int8", 2: "fp8"}


# ----------------------------------------------------------------------------- reference and PyTorch op
def _latent_values(latent, latent_scale, latent_format: int, dtype):
    """The cache part's rows (B, S, R+Dr) in q's dtype: the latent itself, or its codes dequantized
    (kvexport.cache.quant); a (B, 1, S, R+Dr) latent (the cache's one head) is read as (B, S, R+Dr)."""
    if latent.dim() == 4:
        if latent.shape[1] != 1:
            raise ValueError(f"LatentAttention: a 4-D latent must be (B, 1, S, R+Dr), got {tuple(latent.shape)}")
        latent = latent[:, 0]
    if not latent_format:
        return latent
    if latent_format not in LATENT_FORMATS or latent.dtype != torch.uint8 or latent_scale is None:
        raise ValueError(f"latent_format {latent_format} needs uint8 codes and a float16 latent_scale "
                         f"(formats: {LATENT_FORMATS})")
    return dequantize(latent, latent_scale, FORMATS[LATENT_FORMATS[latent_format]], dtype)


def latent_attention_reference(q: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                               latent_positions: torch.Tensor, rank: int, scale: float,
                               new_latent: torch.Tensor | None = None, latent_scale: torch.Tensor | None = None,
                               latent_format: int = 0):
    """Absorbed multi-head latent attention (DeepSeek-V2 "absorb" mode; X-EcoMLA, AMD 2025).

    q (B, Hq, T, R+Dr) absorbed queries ``[W_UK,iᵀ q_nope ; RoPE(q_pe)]``, latent (B, S, R+Dr) cache rows
    ``[c_kv ; RoPE(k_pe)]`` (or (B, 1, S, R+Dr): the cache buffer of its one head, as the exporter hands a quantized
    cache to the node, since TensorRT reshapes no UINT8 tensor), q_positions (B, T), latent_positions (B, S) int64 (-1 = padding / empty) ->
    out (B, Hq, T, R) in q's dtype = ``softmax(scale · q·Lᵀ) @ L[..., :R]`` over the rows L = the cache, followed by
    ``new_latent`` (B, T, R+Dr) when given: this step's own rows, at the queries' positions ``q_positions``.
    A row at position p is visible to query t iff 0 <= p <= q_positions[t]; masked logits are
    ``finfo(float32).min`` (a query that sees nothing averages uniformly); softmax in float32 over both parts at
    once. A quantized cache: ``latent`` uint8 codes, ``latent_scale`` (B, S) float16, ``latent_format`` 1 (int8)
    or 2 (fp8), dequantized to q's dtype first (:func:`kvexport.cache.quant.dequantize`).
    This is the one reference of the op: the MLA attention runs it (through :func:`latent_attention`), the plugin
    tests compare with it.
    """
    lat = _latent_values(latent, latent_scale, int(latent_format), q.dtype)
    parts = [(lat, latent_positions)] + ([(new_latent, q_positions)] if new_latent is not None else [])
    fmin = torch.finfo(torch.float32).min
    logits = []
    for rows, pos in parts:
        lg = torch.matmul(q, rows[:, None].transpose(-1, -2)).float() * scale  # (B, Hq, T, S_part)
        p = pos[:, None, None, :]
        visible = (p >= 0) & (p <= q_positions[:, None, :, None])
        logits.append(lg.masked_fill(~visible, fmin))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)  # the logits of both parts, not their rows
    out, at = None, 0
    for rows, _ in parts:
        n = rows.shape[1]
        o = torch.matmul(probs[..., at : at + n].to(q.dtype), rows[:, None, :, :rank])
        out = o if out is None else out + o
        at += n
    return out


@torch.library.custom_op("kvexport::latent_attention", mutates_args=())
def latent_attention_op(q: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                     latent_positions: torch.Tensor, rank: int, scale: float,
                     new_latent: Optional[torch.Tensor] = None, latent_scale: Optional[torch.Tensor] = None,
                     latent_format: int = 0) -> torch.Tensor:
    """The PyTorch op of :func:`latent_attention_reference`: what an exported graph traces (one node)."""
    return latent_attention_reference(q, latent, q_positions, latent_positions, rank, scale, new_latent, latent_scale,
                                      latent_format).contiguous()


@latent_attention_op.register_fake
def _latent_attention_fake(q, latent, q_positions, latent_positions, rank, scale, new_latent=None, latent_scale=None,
                           latent_format=0):
    B, Hq, T, _ = q.shape
    return q.new_empty(B, Hq, T, rank)

def latent_attention(q, latent, q_positions, latent_positions, rank: int, scale: float, new_latent=None,
                     latent_scale=None, latent_format: int = 0) -> torch.Tensor:
    """The op as the MLA attention calls it: :func:`latent_attention_reference` when the model runs (autograd
    through it, as distillation needs), the custom op when the model is traced for export (one LatentAttention
    node). Arguments as the reference's."""
    if torch.compiler.is_exporting():
        return torch.ops.kvexport.latent_attention(q, latent, q_positions, latent_positions, int(rank), float(scale),
                                                   new_latent, latent_scale, int(latent_format))
    return latent_attention_reference(q, latent, q_positions, latent_positions, rank, scale, new_latent, latent_scale,
                                      latent_format)


# ----------------------------------------------------------------------------- ONNX schema
def schema(version: int) -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    opt = defs.OpSchema.FormalParameterOption.Optional
    inputs = [P("q", "T"), P("latent", "L" if version >= 2 else "T"), P("q_positions", "I"),
              P("latent_positions", "I")]
    types = [("T", FLOATS, "activation type"), ("I", ["tensor(int64)"], "positions")]
    attrs = [defs.OpSchema.Attribute("rank", A.INT, "latent (value) width R", required=True),
             defs.OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=True)]
    if version >= 2:
        inputs += [P("new_latent", "T", "this step's rows (B, T, R+Dr), at q_positions", param_option=opt),
                   P("latent_scale", "H", "float16 scale per cached row (B, S) of a quantized latent",
                     param_option=opt)]
        types += [("L", FLOATS + ["tensor(uint8)"], "the cache: q's type, or uint8 codes (latent_format 1 / 2)"),
                  ("H", ["tensor(float16)"], "scales")]
        attrs.append(defs.OpSchema.Attribute("latent_format", A.INT, "0 float, 1 int8 codes, 2 fp8 e4m3fn codes",
                                             required=False))
    return defs.OpSchema(
        "LatentAttention", DOMAIN, version,
        doc="Absorbed MLA attention over a latent cache [c_kv; k_pe] and this step's rows (kvexport "
            "docs/custom_ops.md).",
        inputs=inputs, outputs=[P("out", "T")], type_constraints=types, attributes=[*attrs, *plugin_attrs()],
    )



# ----------------------------------------------------------------------------- ONNX functions
_LATENT_HEAD = f"""
<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>
LatentAttention <rank, scale, latent_format, plugin_namespace, plugin_version>
    (q, latent, q_positions, latent_positions, new_latent, latent_scale) => (out)
{{
"""
#: the cache part's rows in q's type, per latent_format (the arithmetic of kvexport.cache.quant.dequantize); the
#: latent is (B, S, R+Dr) or (B, 1, S, R+Dr), each scale broadcast over its row, then read as lat (B, 1, S, R+Dr);
#: no op but Cast touches the uint8 codes (an inlined body must parse on TensorRT, which has no UINT8 Shape)
_LATENT_ROWS = {
    0: """
    rows = Identity (latent)
""",
    1: """
    codes = Cast <to: int = 1> (latent)
    zp = Constant <value_float: float = 128.0> ()
    centred = Sub (codes, zp)
    s32 = Cast <to: int = 1> (latent_scale)
    lead = Shape <end: int = -1> (codes)
    unit = Constant <value_ints: ints = [1]> ()
    sshape = Concat <axis: int = 0> (lead, unit)
    s3 = Reshape (s32, sshape)
    deq = Mul (centred, s3)
    rows = CastLike (deq, q)
""",
    2: """
    codes = Cast <to: int = 1> (latent)
    idx = Cast <to: int = 7> (codes)
    table = Constant <value: tensor = float[1] {0.0}> ()
    values = Gather <axis: int = 0> (table, idx)
    s32 = Cast <to: int = 1> (latent_scale)
    lead = Shape <end: int = -1> (idx)
    unit = Constant <value_ints: ints = [1]> ()
    sshape = Concat <axis: int = 0> (lead, unit)
    s3 = Reshape (s32, sshape)
    deq = Mul (values, s3)
    rows = CastLike (deq, q)
""",
}
#: the position rule is selected once per query position (``bias``, shared by the heads) and added to the logits: the
#: same masked logits bit for bit as a Where over every head's (kvexport.models.attention.mask_bias)
_LATENT_CACHE = """
    one = Constant <value_ints: ints = [1]> ()
    width = Shape <start: int = -1> (rows)
    head = Constant <value_ints: ints = [0, 1, -1]> ()
    lshape = Concat <axis: int = 0> (head, width)
    lat = Reshape (rows, lshape)
    latT = Transpose <perm: ints = [0, 1, 3, 2]> (lat)
    raw = MatMul (q, latT)
    raw32 = Cast <to: int = 1> (raw)
    sc = Constant <value_float: float = @scale> ()
    logits = Mul (raw32, sc)
    zero = Constant <value_int: int = 0> ()
    ax12 = Constant <value_ints: ints = [1, 2]> ()
    ax13 = Constant <value_ints: ints = [1, 3]> ()
    lp = Unsqueeze (latent_positions, ax12)
    qp = Unsqueeze (q_positions, ax13)
    filled = GreaterOrEqual (lp, zero)
    causal = LessOrEqual (lp, qp)
    visible = And (filled, causal)
    fmin = Constant <value_float: float = -3.4028234663852886e38> ()
    zerof = Constant <value_float: float = 0.0> ()
    bias = Where (visible, zerof, fmin)
    masked = Add (logits, bias)
    r0 = Constant <value_int: int = @rank> ()
    start = Constant <value_ints: ints = [0]> ()
    r = Reshape (r0, one)
    axis = Constant <value_ints: ints = [3]> ()
"""
#: the value product reads whole rows and drops the RoPE columns from its (B, Hq, T, R + Dr) result: slicing the rows
#: first would copy the cache's R columns on every call (11 % of a 16k full-cache MLA decode step on the student)
_LATENT_ONE_PART = """
    probs = Softmax <axis: int = -1> (masked)
    pq = CastLike (probs, q)
    full = MatMul (pq, lat)
    out = Slice (full, start, r, axis)
}
"""
#: the second part (this step's rows at q_positions), merged by log-sum-exp (no Concat of the rows)
_LATENT_TWO_PARTS = """
    nlat = Unsqueeze (new_latent, one)
    nlatT = Transpose <perm: ints = [0, 1, 3, 2]> (nlat)
    nraw = MatMul (q, nlatT)
    nraw32 = Cast <to: int = 1> (nraw)
    nlogits = Mul (nraw32, sc)
    np = Unsqueeze (q_positions, ax12)
    nfilled = GreaterOrEqual (np, zero)
    ncausal = LessOrEqual (np, qp)
    nvisible = And (nfilled, ncausal)
    nbias = Where (nvisible, zerof, fmin)
    nmasked = Add (nlogits, nbias)
    last = Constant <value_ints: ints = [-1]> ()
    m1 = ReduceMax <keepdims: int = 1> (masked, last)
    m2 = ReduceMax <keepdims: int = 1> (nmasked, last)
    m = Max (m1, m2)
    d1 = Sub (masked, m)
    e1 = Exp (d1)
    d2 = Sub (nmasked, m)
    e2 = Exp (d2)
    s1 = ReduceSum <keepdims: int = 1> (e1, last)
    s2 = ReduceSum <keepdims: int = 1> (e2, last)
    den = Add (s1, s2)
    p1 = Div (e1, den)
    p2 = Div (e2, den)
    p1q = CastLike (p1, q)
    p2q = CastLike (p2, q)
    o1 = MatMul (p1q, lat)
    o2 = MatMul (p2q, nlat)
    full = Add (o1, o2)
    out = Slice (full, start, r, axis)
}
"""


def function(two_parts: bool = False, latent_format: int = 0) -> onnx.FunctionProto:
    """The function body of one LatentAttention configuration: with / without ``new_latent``, float or quantized
    cache (every LatentAttention node of a graph shares one; :func:`function_for` picks it)."""
    if latent_format not in LATENT_FORMATS:
        raise ValueError(f"latent_format {latent_format} unknown ({LATENT_FORMATS})")
    text = _LATENT_HEAD + _LATENT_ROWS[latent_format] + _LATENT_CACHE + (_LATENT_TWO_PARTS if two_parts
                                                                          else _LATENT_ONE_PART)
    fn = onnx.parser.parse_function(text)
    if latent_format == 2:  # the e4m3fn value table (NaN entries: the parser's text format has no NaN)
        for node in fn.node:
            if node.output[0] == "table":
                del node.attribute[:]
                node.attribute.append(helper.make_attribute("value", onnx.numpy_helper.from_array(
                    FP8_VALUES.numpy(), "table")))
    return fn


def latent_configuration(node: onnx.NodeProto) -> tuple[bool, int]:
    """(two parts, latent_format) of a LatentAttention node."""
    fmt = next((a.i for a in node.attribute if a.name == "latent_format"), 0)
    return len(node.input) > 4 and bool(node.input[4]), int(fmt)


# ----------------------------------------------------------------------------- plugin contract and translation
def plugin_version(n_inputs: int = 4, latent_format: int = 0) -> str:
    """The ``plugin_version`` of a node: "2" with the version-2 inputs (``new_latent``, a quantized latent), else
    "1"."""
    return "2" if n_inputs > 4 or latent_format else PLUGIN_VERSION


def function_for(model: onnx.ModelProto | None) -> onnx.FunctionProto:
    """The body ``model``'s LatentAttention nodes use (their configuration: they must agree); the one-part float body
    without a model."""
    configs = {latent_configuration(n) for n in model.graph.node
               if n.domain == DOMAIN and n.op_type == NAME} if model is not None else set()
    if len(configs) > 1:
        raise ValueError(f"LatentAttention nodes of one graph use different configurations {sorted(configs)}")
    two, fmt = next(iter(configs)) if configs else (False, 0)
    return function(two, fmt)


def translation(opset):
    """``torch.ops.kvexport.latent_attention`` -> one LatentAttention node of ``opset``."""

    def latent_attention_onnx(q, latent, q_positions, latent_positions, rank: int, scale: float, new_latent=None,
                              latent_scale=None, latent_format: int = 0):
        extra = [] if new_latent is None else [new_latent] + ([] if latent_scale is None else [latent_scale])
        if latent_scale is not None and new_latent is None:
            raise ValueError("LatentAttention: a quantized latent (latent_scale) needs new_latent")
        attrs = {"latent_format": int(latent_format)} if latent_format else {}
        return opset.LatentAttention(q, latent, q_positions, latent_positions, *extra, rank=rank, scale=scale,
                                     plugin_namespace=PLUGIN_NAMESPACE,
                                     plugin_version=plugin_version(4 + len(extra), latent_format), **attrs)

    return {torch.ops.kvexport.latent_attention.default: latent_attention_onnx}


__all__ = ["NAME", "latent_attention", "latent_attention_op", "latent_attention_reference", "schema", "function",
           "function_for", "latent_configuration", "plugin_version", "translation", "LATENT_FORMATS",
           "PLUGIN_VERSION", "PLUGIN_REGISTERED"]
