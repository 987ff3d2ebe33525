# SPDX-License-Identifier: Apache-2.0
"""kvexport's two custom ops, on both sides of the export (contracts: docs/custom_ops.md).

PyTorch side: ``torch.ops.kvexport.topk_gather`` / ``torch.ops.kvexport.latent_attention``
(``torch.library.custom_op`` + fake impls), whose eager impls are the references
(:func:`kvexport.cache.static_cache.select_kept` + ``gather_slots``; the absorbed MLA attention of
DeepSeek-V2 / X-EcoMLA).

ONNX side: nodes ``kvexport::TopKGather`` / ``kvexport::LatentAttention`` (domain op version 2, carrying
``plugin_namespace`` / ``plugin_version`` for TensorRT's parser: :func:`plugin_version`), an :class:`onnx.defs.OpSchema` per op and version so ``onnx.checker.check_model(full_check=True)`` passes
(version 1 stays registered: graphs importing the domain at 1 still check), and a model-local ``FunctionProto`` per
op built from opset-18 standard ops so onnxruntime and ``onnx.reference`` run the file without a plugin.

Version 2: TopKGather also gathers uint8 (quantized caches' codes) and bfloat16 rows; LatentAttention takes this
step's rows as a second part (``new_latent``, attended in the same softmax without concatenating it to the cache)
and a quantized cache (uint8 codes + float16 ``latent_scale``, ``latent_format`` 1 int8 / 2 fp8, dequantized on
load; :mod:`kvexport.cache.quant`).
"""

from __future__ import annotations

from typing import Optional

import onnx
import torch
from onnx import defs, helper

DOMAIN = "kvexport"
OP_VERSION = 2
OPSET = 18  # default-domain opset of every exported graph and of the function bodies
PLUGIN_NAMESPACE = "kvexport"
#: TensorRT plugin version of the node signatures the plugin library (plugins/) implements: TopKGather "1" (float
#: rows and, since domain version 2, uint8 codes: a widening, old graphs still match), LatentAttention "1" (four
#: inputs, a float latent: what the exporter writes for a float cache). A LatentAttention node with the version-2
#: inputs (``new_latent``, ``latent_scale`` / ``latent_format``) is plugin version "2": the exporter writes it for an
#: int8 / fp8 latent cache (the codes read by the kernel; docs/quantized.md).
PLUGIN_VERSION = "1"
PLUGIN_VERSIONS = {"TopKGather": "1", "LatentAttention": "1"}
#: plugin versions the library registers, per op (plugins/*/README.md)
PLUGIN_REGISTERED = {"TopKGather": ("1",), "LatentAttention": ("1", "2")}
#: LatentAttention ``latent_format`` codes (kvexport.cache.formats.KVFormat.code)
LATENT_FORMATS = {0: "float", 1: "int8", 2: "fp8"}


# ----------------------------------------------------------------------------- PyTorch ops
@torch.library.custom_op("kvexport::topk_gather", mutates_args=())
def topk_gather(
    scores: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (B, H, S), keys (B, H, S, Dk), values (B, H, S, Dv), positions (B, H, S) int64 ->
    kept_keys (B, H, k, Dk), kept_values (B, H, k, Dv), kept_positions (B, H, k), kept_indices (B, H, k).

    The k best per (batch, head), empty slots (position < 0) score -inf, ties to the lower slot, kept in
    ascending slot order (docs/custom_ops.md, TopKGather).
    """
    from kvexport.cache.static_cache import gather_slots, select_kept

    idx = select_kept(scores, positions, k)
    return gather_slots(keys, idx), gather_slots(values, idx), gather_slots(positions, idx), idx


@topk_gather.register_fake
def _topk_gather_fake(scores, keys, values, positions, k):
    B, H, _ = scores.shape
    return (keys.new_empty(B, H, k, keys.shape[-1]), values.new_empty(B, H, k, values.shape[-1]),
            positions.new_empty(B, H, k), positions.new_empty(B, H, k))


def _latent_values(latent, latent_scale, latent_format: int, dtype):
    """The cache part's rows (B, S, R+Dr) in q's dtype: the latent itself, or its codes dequantized
    (kvexport.cache.quant); a (B, 1, S, R+Dr) latent (the cache's one head) is read as (B, S, R+Dr)."""
    if latent.dim() == 4:
        if latent.shape[1] != 1:
            raise ValueError(f"LatentAttention: a 4-D latent must be (B, 1, S, R+Dr), got {tuple(latent.shape)}")
        latent = latent[:, 0]
    if not latent_format:
        return latent
    from kvexport.cache.formats import FORMATS
    from kvexport.cache.quant import dequantize

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
    This is the one reference of the op: the MLA attention calls it, the plugin tests compare with it.
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
def latent_attention(q: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                     latent_positions: torch.Tensor, rank: int, scale: float,
                     new_latent: Optional[torch.Tensor] = None, latent_scale: Optional[torch.Tensor] = None,
                     latent_format: int = 0) -> torch.Tensor:
    """See :func:`latent_attention_reference` (docs/custom_ops.md, LatentAttention)."""
    return latent_attention_reference(q, latent, q_positions, latent_positions, rank, scale, new_latent, latent_scale,
                                      latent_format).contiguous()


@latent_attention.register_fake
def _latent_attention_fake(q, latent, q_positions, latent_positions, rank, scale, new_latent=None, latent_scale=None,
                           latent_format=0):
    B, Hq, T, _ = q.shape
    return q.new_empty(B, Hq, T, rank)


# ----------------------------------------------------------------------------- in-place decode (onnxruntime)
#: the ONNX domain of onnxruntime's contrib ops (GroupQueryAttention), used only by ``*.ort.onnx`` graphs
ORT_DOMAIN = "com.microsoft"


def cache_step_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                                   sin: torch.Tensor, scale: float, num_heads: int, kv_num_heads: int):
    """One decode token rotated, written into the cache and attended (the in-place decode graph's attention; the
    contract of onnxruntime's GroupQueryAttention as the graph uses it).

    q (B, 1, Hq * D), k_new / v_new (B, 1, Hc * D): the token's projections before RoPE; k_cache / v_cache
    (B, Hc, S, D) post-RoPE keys and values; bias (B, Hq, 1, S) additive, in q's dtype: 0 where query head h may
    see slot j, a large negative number where not (the caller makes it from
    :func:`kvexport.models.attention.visible`, the one visibility rule); slots (B,) int32: the slot the token goes
    to (plan rule 4: the layer's fill); cos / sin (B, D/2): the token's rotation (HF's half-split RoPE over the whole
    head, attention scaling included: :meth:`kvexport.models.rope.Rotary.cos_sin`'s first half).
    -> out (B, 1, Hq * D) = softmax(scale · q·Kᵀ + bias) V over the cache with the token's rotated key and value at
    ``slots``, and that cache (every other slot unchanged). Query head h reads KV head h // (Hq / Hc); softmax in
    float32."""
    from kvexport.models.rope import rotate_half

    B = q.shape[0]
    D = k_cache.shape[-1]
    G = num_heads // kv_num_heads
    c = torch.cat([cos, cos], -1)[:, None, None, :]  # (B, 1, 1, D)
    s = torch.cat([sin, sin], -1)[:, None, None, :]
    qh = q.view(B, 1, num_heads, D).transpose(1, 2)
    kh = k_new.view(B, 1, kv_num_heads, D).transpose(1, 2)
    qh, kh = qh * c + rotate_half(qh) * s, kh * c + rotate_half(kh) * s
    vh = v_new.view(B, 1, kv_num_heads, -1).transpose(1, 2)
    idx = slots.to(torch.long).view(B, 1, 1, 1)
    k = k_cache.scatter(2, idx.expand(B, kv_num_heads, 1, D), kh)
    v = v_cache.scatter(2, idx.expand(B, kv_num_heads, 1, vh.shape[-1]), vh)
    kq, vq = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Hq, S, .)
    logits = torch.matmul(qh, kq.transpose(-1, -2)).float() * scale + bias.float()
    out = torch.matmul(torch.softmax(logits, dim=-1).to(vq.dtype), vq)  # (B, Hq, 1, Dv)
    return out.transpose(1, 2).reshape(B, 1, -1), k, v


@torch.library.custom_op("kvexport::cache_step_attention", mutates_args=())
def cache_step_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, scale: float, num_heads: int, kv_num_heads: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`cache_step_attention_reference`; exported as onnxruntime's ``GroupQueryAttention`` (rotary inside)
    with the cache as a past/present buffer the runtime binds to one memory (written in place, one slot per step).
    ``num_heads`` / ``kv_num_heads``: q's and the cache's heads (attributes of the ONNX node)."""
    out, k, v = cache_step_attention_reference(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale,
                                               num_heads, kv_num_heads)
    return out.contiguous(), k, v


@cache_step_attention.register_fake
def _cache_step_attention_fake(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale, num_heads,
                               kv_num_heads):
    return q.new_empty(q.shape[0], 1, num_heads * v_cache.shape[-1]), torch.empty_like(k_cache), \
        torch.empty_like(v_cache)


# ----------------------------------------------------------------------------- ONNX schemas
_F = ["tensor(float)", "tensor(float16)"]
#: what TopKGather gathers, per op version: version 2 adds bfloat16 rows and uint8 codes (quantized caches)
_TOPK_T = {1: _F, 2: _F + ["tensor(bfloat16)", "tensor(uint8)"]}


def _plugin_attrs() -> list:
    A = defs.OpSchema.AttrType
    return [defs.OpSchema.Attribute("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False),
            defs.OpSchema.Attribute("plugin_version", A.STRING, "TensorRT plugin version", required=False)]


def _schema_topk_gather(version: int) -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    return defs.OpSchema(
        "TopKGather", DOMAIN, version,
        doc="Keep the k best-scoring cache slots per (batch, head), in slot order (kvexport docs/custom_ops.md).",
        inputs=[P("scores", "S"), P("keys", "T"), P("values", "T"), P("positions", "I")],
        outputs=[P("kept_keys", "T"), P("kept_values", "T"), P("kept_positions", "I"), P("kept_indices", "I")],
        type_constraints=[("S", ["tensor(float)"], "scores: float32 in every build (exact ties, the plugin's type)"),
                          ("T", _TOPK_T[version], "cache type (uint8: quantized codes, gathered as bytes)"),
                          ("I", ["tensor(int64)"], "positions")],
        attributes=[defs.OpSchema.Attribute("k", A.INT, "slots kept, 1 <= k <= S", required=True), *_plugin_attrs()],
    )


def _schema_latent_attention(version: int) -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    opt = defs.OpSchema.FormalParameterOption.Optional
    inputs = [P("q", "T"), P("latent", "L" if version >= 2 else "T"), P("q_positions", "I"),
              P("latent_positions", "I")]
    types = [("T", _F, "activation type"), ("I", ["tensor(int64)"], "positions")]
    attrs = [defs.OpSchema.Attribute("rank", A.INT, "latent (value) width R", required=True),
             defs.OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=True)]
    if version >= 2:
        inputs += [P("new_latent", "T", "this step's rows (B, T, R+Dr), at q_positions", param_option=opt),
                   P("latent_scale", "H", "float16 scale per cached row (B, S) of a quantized latent",
                     param_option=opt)]
        types += [("L", _F + ["tensor(uint8)"], "the cache: q's type, or uint8 codes (latent_format 1 / 2)"),
                  ("H", ["tensor(float16)"], "scales")]
        attrs.append(defs.OpSchema.Attribute("latent_format", A.INT, "0 float, 1 int8 codes, 2 fp8 e4m3fn codes",
                                             required=False))
    return defs.OpSchema(
        "LatentAttention", DOMAIN, version,
        doc="Absorbed MLA attention over a latent cache [c_kv; k_pe] and this step's rows (kvexport "
            "docs/custom_ops.md).",
        inputs=inputs, outputs=[P("out", "T")], type_constraints=types, attributes=[*attrs, *_plugin_attrs()],
    )


def _schema_group_query_attention() -> defs.OpSchema:
    """onnxruntime's ``com.microsoft::GroupQueryAttention`` (version 1), as far as kvexport writes it: its first
    eleven inputs (up to ``attention_bias``) and three outputs, so onnx checks the in-place decode graph and
    onnxscript can emit the node. onnxruntime's own schema is the authority; this one mirrors its input order."""
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    opt = defs.OpSchema.FormalParameterOption.Optional
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
             "sin_cache", "position_ids", "attention_bias"]
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "I"}
    required = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [P(n, types.get(n, "T"), n, param_option=defs.OpSchema.FormalParameterOption.Single if n in required
                else opt) for n in names]
    return defs.OpSchema(
        "GroupQueryAttention", ORT_DOMAIN, 1,
        doc="onnxruntime contrib op (kvexport writes it in decode_inplace.ort.onnx only)",
        inputs=inputs,
        outputs=[P("output", "T"), P("present_key", "T", param_option=opt), P("present_value", "T", param_option=opt)],
        type_constraints=[("T", _F, "activations"), ("M", ["tensor(int32)"], "lengths"),
                          ("I", ["tensor(int64)"], "positions")],
        attributes=[defs.OpSchema.Attribute("num_heads", A.INT, "query heads", required=True),
                    defs.OpSchema.Attribute("kv_num_heads", A.INT, "key/value heads", required=True),
                    defs.OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=False),
                    defs.OpSchema.Attribute("do_rotary", A.INT, "1: RoPE of query and key inside", required=False)],
    )


def register_schemas() -> None:
    """Register the ``kvexport`` domain's schemas with onnx, versions 1 and 2, and the onnxruntime contrib op the
    in-place decode graph uses (idempotent)."""
    made = [make(version) for version in (1, OP_VERSION) for make in (_schema_topk_gather, _schema_latent_attention)]
    for s in [*made, _schema_group_query_attention()]:
        try:
            if defs.get_schema(s.name, s.since_version, s.domain).since_version == s.since_version:
                continue
        except defs.SchemaError:
            pass
        defs.register_schema(s)


# ----------------------------------------------------------------------------- ONNX functions
_TOPK_GATHER_FN = f"""
<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>
TopKGather <k, plugin_namespace, plugin_version> (scores, keys, values, positions)
    => (kept_keys, kept_values, kept_positions, kept_indices)
{{
    zero = Constant <value_int: int = 0> ()
    invalid = Less (positions, zero)
    s32 = Cast <to: int = 1> (scores)
    ninf = Constant <value_float: float = -inf> ()
    s = Where (invalid, ninf, s32)
    k0 = Constant <value_int: int = @k> ()
    minus1 = Constant <value_ints: ints = [-1]> ()
    k1 = Reshape (k0, minus1)
    best, order = TopK <axis: int = -1, largest: int = 1, sorted: int = 1> (s, k1)
    kept_indices, unused = TopK <axis: int = -1, largest: int = 0, sorted: int = 1> (order, k1)
    kept_positions = GatherElements <axis: int = 2> (positions, kept_indices)
    idx4 = Unsqueeze (kept_indices, minus1)
    kshape = Shape (keys)
    three = Constant <value_ints: ints = [3]> ()
    four = Constant <value_ints: ints = [4]> ()
    dk = Slice (kshape, three, four)
    ishape = Shape (kept_indices)
    kidx_shape = Concat <axis: int = 0> (ishape, dk)
    kzero = ConstantOfShape <value: tensor = int64[1] {{0}}> (kidx_shape)
    kidx = Add (idx4, kzero)
    kept_keys = GatherElements <axis: int = 2> (keys, kidx)
    vshape = Shape (values)
    dv = Slice (vshape, three, four)
    vidx_shape = Concat <axis: int = 0> (ishape, dv)
    vzero = ConstantOfShape <value: tensor = int64[1] {{0}}> (vidx_shape)
    vidx = Add (idx4, vzero)
    kept_values = GatherElements <axis: int = 2> (values, vidx)
}}
"""



def topk_gather_function(codes: bool = False) -> onnx.FunctionProto:
    """TopKGather's function body; ``codes``: for uint8 keys / values (a quantized cache), which it gathers as
    float16 (every code 0..255 exactly) and casts back, so that an inlined body (``--ops standard``) runs on
    TensorRT, which gathers no UINT8 tensor (the plugin copies the bytes)."""
    text = _TOPK_GATHER_FN
    if codes:
        for name in ("keys", "values"):
            text = text.replace(f"Shape ({name})", f"Shape ({name}16)").replace(
                f"GatherElements <axis: int = 2> ({name}, ", f"GatherElements <axis: int = 2> ({name}16, ")
            text = text.replace(f"kept_{name} = GatherElements", f"kept_{name}16 = GatherElements")
        text = text.replace("    zero = Constant", "    keys16 = Cast <to: int = 10> (keys)\n"
                            "    values16 = Cast <to: int = 10> (values)\n    zero = Constant", 1)
        text = text.replace("\n}", "\n    kept_keys = CastLike (kept_keys16, keys)\n"
                            "    kept_values = CastLike (kept_values16, values)\n}", 1)
    return onnx.parser.parse_function(text)


def _gathers_codes(model: onnx.ModelProto) -> bool:
    """Whether every TopKGather node of ``model`` takes uint8 keys and values (as far as the graph types them)."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "TopKGather"]
    return bool(nodes) and all(types.get(n.input[i]) == onnx.TensorProto.UINT8 for n in nodes for i in (1, 2))


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
    masked = Where (visible, logits, fmin)
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
    nmasked = Where (nvisible, nlogits, fmin)
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


def latent_attention_function(two_parts: bool = False, latent_format: int = 0) -> onnx.FunctionProto:
    """The function body of one LatentAttention configuration: with / without ``new_latent``, float or quantized
    cache (every LatentAttention node of a graph shares one; :func:`function_protos` picks it)."""
    if latent_format not in LATENT_FORMATS:
        raise ValueError(f"latent_format {latent_format} unknown ({LATENT_FORMATS})")
    text = _LATENT_HEAD + _LATENT_ROWS[latent_format] + _LATENT_CACHE + (_LATENT_TWO_PARTS if two_parts
                                                                          else _LATENT_ONE_PART)
    fn = onnx.parser.parse_function(text)
    if latent_format == 2:  # the e4m3fn value table (NaN entries: the parser's text format has no NaN)
        from kvexport.cache.quant import FP8_VALUES

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


def function_protos(model: onnx.ModelProto | None = None) -> list[onnx.FunctionProto]:
    """The model-local functions backing ``kvexport::TopKGather`` and ``kvexport::LatentAttention``: for ``model``,
    the bodies its nodes use (LatentAttention's configuration, they must agree; TopKGather's for uint8 codes where
    every node gathers codes), else the float TopKGather and one-part float LatentAttention bodies."""
    configs = {latent_configuration(n) for n in model.graph.node
               if n.domain == DOMAIN and n.op_type == "LatentAttention"} if model is not None else set()
    if len(configs) > 1:
        raise ValueError(f"LatentAttention nodes of one graph use different configurations {sorted(configs)}")
    two, fmt = next(iter(configs)) if configs else (False, 0)
    codes = model is not None and _gathers_codes(model)
    return [topk_gather_function(codes), latent_attention_function(two, fmt)]


def plugin_version(op: str, n_inputs: int = 4, latent_format: int = 0) -> str:
    """The ``plugin_version`` of a node: "2" for a LatentAttention with the version-2 inputs (``new_latent``, a
    quantized latent), else the op's :data:`PLUGIN_VERSIONS` entry."""
    if op == "LatentAttention" and (n_inputs > 4 or latent_format):
        return "2"
    return PLUGIN_VERSIONS[op]


def make_node(op: str, inputs: list[str], outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """A ``kvexport`` node with the plugin attributes TensorRT's parser reads."""
    version = plugin_version(op, len(inputs), int(attrs.get("latent_format", 0)))
    return helper.make_node(op, inputs, outputs, name=name, domain=DOMAIN, plugin_namespace=PLUGIN_NAMESPACE,
                            plugin_version=version, **attrs)


# ----------------------------------------------------------------------------- dynamo translations
def _translations() -> dict:
    """custom_translation_table for ``torch.onnx.export(dynamo=True)``: emit the kvexport-domain nodes."""
    import onnxscript

    register_schemas()
    kvx = onnxscript.values.Opset(DOMAIN, OP_VERSION)

    def topk_gather_onnx(scores, keys, values, positions, k: int):
        return kvx.TopKGather(scores, keys, values, positions, k=k, plugin_namespace=PLUGIN_NAMESPACE,
                              plugin_version=PLUGIN_VERSIONS["TopKGather"], _outputs=4)

    def latent_attention_onnx(q, latent, q_positions, latent_positions, rank: int, scale: float, new_latent=None,
                              latent_scale=None, latent_format: int = 0):
        extra = [] if new_latent is None else [new_latent] + ([] if latent_scale is None else [latent_scale])
        if latent_scale is not None and new_latent is None:
            raise ValueError("LatentAttention: a quantized latent (latent_scale) needs new_latent")
        attrs = {"latent_format": int(latent_format)} if latent_format else {}
        return kvx.LatentAttention(q, latent, q_positions, latent_positions, *extra, rank=rank, scale=scale,
                                   plugin_namespace=PLUGIN_NAMESPACE,
                                   plugin_version=plugin_version("LatentAttention", 4 + len(extra), latent_format),
                                   **attrs)

    from onnxscript import opset18 as op

    def amax_onnx(self, dim=(), keepdim: bool = False):
        # torch's full reduction ``x.max()`` lowers to aten.amax with no dim, which onnxscript's
        # torch_lib refuses; ReduceMax without axes reduces every axis
        if dim is None or len(dim) == 0:
            return op.ReduceMax(self, keepdims=int(keepdim))
        return op.ReduceMax(self, op.Constant(value_ints=list(dim)), keepdims=int(keepdim))

    def amin_onnx(self, dim=(), keepdim: bool = False):
        if dim is None or len(dim) == 0:
            return op.ReduceMin(self, keepdims=int(keepdim))
        return op.ReduceMin(self, op.Constant(value_ints=list(dim)), keepdims=int(keepdim))

    msft = onnxscript.values.Opset(ORT_DOMAIN, 1)

    def cache_step_attention_onnx(q, k_new, v_new, k_cache, v_cache, bias, slots, cos, sin, scale: float,
                                  num_heads: int, kv_num_heads: int):
        # onnxruntime's GroupQueryAttention with the cache as past and present (one buffer when the runtime binds
        # both to it: the kernel then writes only the token's slot, seqlens_k = slot, and attends slots [0, slot]),
        # the token's RoPE inside (cos/sin rows of this step, read through position_ids = the batch row), the
        # visibility the caller's bias
        Hq, Hc = int(num_heads), int(kv_num_heads)
        S = op.Shape(k_cache, start=2, end=3)
        B = op.Shape(q, start=0, end=1)
        # cos_cache must have at least total_sequence_length rows: this step's B rows, zero-padded to S
        rows = op.Concat(op.Sub(op.Max(S, B), B), op.Constant(value_ints=[0]), axis=0)
        pads = op.Concat(op.Constant(value_ints=[0, 0]), rows, axis=0)
        total = op.Cast(op.Squeeze(S), to=onnx.TensorProto.INT32)
        pid = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(B), op.Constant(value_int=1)),
                           op.Constant(value_ints=[1]))
        out, k, v = msft.GroupQueryAttention(q, k_new, v_new, k_cache, v_cache,
                                             op.Cast(slots, to=onnx.TensorProto.INT32), total, op.Pad(cos, pads),
                                             op.Pad(sin, pads), pid, bias, num_heads=Hq, kv_num_heads=Hc,
                                             scale=float(scale), do_rotary=1, _outputs=3)
        return out, k, v

    return {torch.ops.kvexport.topk_gather.default: topk_gather_onnx,
            torch.ops.kvexport.cache_step_attention.default: cache_step_attention_onnx,
            torch.ops.kvexport.latent_attention.default: latent_attention_onnx,
            torch.ops.aten.amax.default: amax_onnx, torch.ops.aten.amin.default: amin_onnx}


def translation_table() -> dict:
    return _translations()
