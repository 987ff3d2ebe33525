# SPDX-License-Identifier: Apache-2.0
"""kvexport's two custom ops, on both sides of the export (contracts: docs/custom_ops.md).

PyTorch side: ``torch.ops.kvexport.topk_gather`` / ``torch.ops.kvexport.latent_attention``
(``torch.library.custom_op`` + fake impls), whose eager impls are the references
(:func:`kvexport.cache.static_cache.select_kept` + ``gather_slots``; the absorbed MLA attention of
DeepSeek-V2 / X-EcoMLA).

ONNX side: nodes ``kvexport::TopKGather`` / ``kvexport::LatentAttention`` (op version 1, carrying
``plugin_namespace`` / ``plugin_version`` for TensorRT's parser), an :class:`onnx.defs.OpSchema` per op
so ``onnx.checker.check_model(full_check=True)`` passes, and a model-local ``FunctionProto`` per op built
from opset-18 standard ops so onnxruntime and ``onnx.reference`` run the file without a plugin.
"""

from __future__ import annotations

import onnx
import torch
from onnx import defs, helper

DOMAIN = "kvexport"
OP_VERSION = 1
OPSET = 18  # default-domain opset of every exported graph and of the function bodies
PLUGIN_NAMESPACE = "kvexport"
PLUGIN_VERSION = "1"


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


def latent_attention_reference(q: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                               latent_positions: torch.Tensor, rank: int, scale: float):
    """Absorbed multi-head latent attention (DeepSeek-V2 "absorb" mode; X-EcoMLA, AMD 2025).

    q (B, Hq, T, R+Dr) absorbed queries ``[W_UK,iᵀ q_nope ; RoPE(q_pe)]``, latent (B, S, R+Dr) cache rows
    ``[c_kv ; RoPE(k_pe)]``, q_positions (B, T), latent_positions (B, S) int64 (-1 = padding / empty) ->
    out (B, Hq, T, R) in q's dtype = ``softmax(scale · q·latentᵀ) @ latent[..., :R]``.
    Slot j is visible to query t iff 0 <= latent_positions[j] <= q_positions[t]; masked logits are
    ``finfo(float32).min`` (a query that sees nothing averages uniformly); softmax in float32.
    This is the one reference of the op: the MLA attention calls it, the plugin tests compare with it.
    """
    logits = torch.matmul(q, latent[:, None].transpose(-1, -2)).float() * scale  # (B, Hq, T, S)
    lp = latent_positions[:, None, None, :]
    visible = (lp >= 0) & (lp <= q_positions[:, None, :, None])
    logits = logits.masked_fill(~visible, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs.to(q.dtype), latent[:, None, :, :rank])


@torch.library.custom_op("kvexport::latent_attention", mutates_args=())
def latent_attention(q: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                     latent_positions: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """See :func:`latent_attention_reference` (docs/custom_ops.md, LatentAttention)."""
    return latent_attention_reference(q, latent, q_positions, latent_positions, rank, scale).contiguous()


@latent_attention.register_fake
def _latent_attention_fake(q, latent, q_positions, latent_positions, rank, scale):
    B, Hq, T, _ = q.shape
    return q.new_empty(B, Hq, T, rank)


# ----------------------------------------------------------------------------- ONNX schemas
_F = ["tensor(float)", "tensor(float16)"]


def _schema_topk_gather() -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    return defs.OpSchema(
        "TopKGather", DOMAIN, OP_VERSION,
        doc="Keep the k best-scoring cache slots per (batch, head), in slot order (kvexport docs/custom_ops.md).",
        inputs=[P("scores", "S"), P("keys", "T"), P("values", "T"), P("positions", "I")],
        outputs=[P("kept_keys", "T"), P("kept_values", "T"), P("kept_positions", "I"), P("kept_indices", "I")],
        type_constraints=[("S", ["tensor(float)"], "scores: float32 in every build (exact ties, the plugin's type)"),
                          ("T", _F, "cache type"), ("I", ["tensor(int64)"], "positions")],
        attributes=[
            defs.OpSchema.Attribute("k", A.INT, "slots kept, 1 <= k <= S", required=True),
            defs.OpSchema.Attribute("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False),
            defs.OpSchema.Attribute("plugin_version", A.STRING, "TensorRT plugin version", required=False),
        ],
    )


def _schema_latent_attention() -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    return defs.OpSchema(
        "LatentAttention", DOMAIN, OP_VERSION,
        doc="Absorbed MLA attention over a latent cache [c_kv; k_pe] (kvexport docs/custom_ops.md).",
        inputs=[P("q", "T"), P("latent", "T"), P("q_positions", "I"), P("latent_positions", "I")],
        outputs=[P("out", "T")],
        type_constraints=[("T", _F, "activation type"), ("I", ["tensor(int64)"], "positions")],
        attributes=[
            defs.OpSchema.Attribute("rank", A.INT, "latent (value) width R", required=True),
            defs.OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=True),
            defs.OpSchema.Attribute("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False),
            defs.OpSchema.Attribute("plugin_version", A.STRING, "TensorRT plugin version", required=False),
        ],
    )


def register_schemas() -> None:
    """Register the ``kvexport`` domain's schemas with onnx (idempotent)."""
    for make in (_schema_topk_gather, _schema_latent_attention):
        s = make()
        try:
            defs.get_schema(s.name, OP_VERSION, DOMAIN)
        except defs.SchemaError:
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

_LATENT_ATTENTION_FN = f"""
<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>
LatentAttention <rank, scale, plugin_namespace, plugin_version> (q, latent, q_positions, latent_positions)
    => (out)
{{
    one = Constant <value_ints: ints = [1]> ()
    lat = Unsqueeze (latent, one)
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
    probs = Softmax <axis: int = -1> (masked)
    pq = CastLike (probs, q)
    r0 = Constant <value_int: int = @rank> ()
    start = Constant <value_ints: ints = [0]> ()
    r = Reshape (r0, one)
    axis = Constant <value_ints: ints = [3]> ()
    val = Slice (lat, start, r, axis)
    out = MatMul (pq, val)
}}
"""


def function_protos() -> list[onnx.FunctionProto]:
    """The model-local functions backing ``kvexport::TopKGather`` and ``kvexport::LatentAttention``."""
    return [onnx.parser.parse_function(_TOPK_GATHER_FN), onnx.parser.parse_function(_LATENT_ATTENTION_FN)]


def make_node(op: str, inputs: list[str], outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """A ``kvexport`` node with the plugin attributes TensorRT's parser reads."""
    return helper.make_node(op, inputs, outputs, name=name, domain=DOMAIN, plugin_namespace=PLUGIN_NAMESPACE,
                            plugin_version=PLUGIN_VERSION, **attrs)


# ----------------------------------------------------------------------------- dynamo translations
def _translations() -> dict:
    """custom_translation_table for ``torch.onnx.export(dynamo=True)``: emit the kvexport-domain nodes."""
    import onnxscript

    register_schemas()
    kvx = onnxscript.values.Opset(DOMAIN, OP_VERSION)

    def topk_gather_onnx(scores, keys, values, positions, k: int):
        return kvx.TopKGather(scores, keys, values, positions, k=k, plugin_namespace=PLUGIN_NAMESPACE,
                              plugin_version=PLUGIN_VERSION, _outputs=4)

    def latent_attention_onnx(q, latent, q_positions, latent_positions, rank: int, scale: float):
        return kvx.LatentAttention(q, latent, q_positions, latent_positions, rank=rank, scale=scale,
                                   plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)

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

    return {torch.ops.kvexport.topk_gather.default: topk_gather_onnx,
            torch.ops.kvexport.latent_attention.default: latent_attention_onnx,
            torch.ops.aten.amax.default: amax_onnx, torch.ops.aten.amin.default: amin_onnx}


def translation_table() -> dict:
    return _translations()
