# SPDX-License-Identifier: Apache-2.0
"""``kvexport::TopKGather``: keep the k best-scoring cache slots per (batch, head), in slot order
(docs/custom_ops.md, TopKGather; plugin: plugins/topk_gather).

All of the op in one place: its reference (:func:`kvexport.cache.candidates.topk_gather_reference`, the rule the
PyTorch cache runs itself, which is why it lives with the cache), the PyTorch op ``torch.ops.kvexport.topk_gather`` the exported graphs trace,
its ONNX schema (versions 1 and 2) and function body (opset 18; a uint8 variant for quantized caches), the
translation the dynamo exporter uses, and the plugin contract (the versions plugins/ registers).

Version 2 also gathers uint8 (quantized caches' codes) and bfloat16 rows: a widening, old graphs still match.
"""

from __future__ import annotations

import onnx
import torch
from onnx import defs

from kvexport.cache.candidates import topk_gather_reference
from kvexport.ops.common import DOMAIN, FLOATS, OPSET, PLUGIN_NAMESPACE, plugin_attrs

NAME = "TopKGather"
#: the plugin version nodes ask for, and the versions the plugin library registers (plugins/topk_gather/README.md)
PLUGIN_VERSION = "1"
PLUGIN_REGISTERED = ("1",)


# ----------------------------------------------------------------------------- reference and PyTorch op
@torch.library.custom_op("kvexport::topk_gather", mutates_args=())
def topk_gather(
    scores: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (B, H, S), keys (B, H, S, Dk), values (B, H, S, Dv), positions (B, H, S) int64 ->
    kept_keys (B, H, k, Dk), kept_values (B, H, k, Dv), kept_positions (B, H, k), kept_indices (B, H, k).

    The k best per (batch, head), empty slots (position < 0) score -inf, ties to the lower slot, kept in
    ascending slot order: the reference, :func:`kvexport.cache.candidates.topk_gather_reference`. What a graph's
    compaction calls; one TopKGather node once exported."""
    return topk_gather_reference(scores, keys, values, positions, k)


@topk_gather.register_fake
def _topk_gather_fake(scores, keys, values, positions, k):
    B, H, _ = scores.shape
    return (keys.new_empty(B, H, k, keys.shape[-1]), values.new_empty(B, H, k, values.shape[-1]),
            positions.new_empty(B, H, k), positions.new_empty(B, H, k))


# ----------------------------------------------------------------------------- ONNX schema
#: what TopKGather gathers, per op version: version 2 adds bfloat16 rows and uint8 codes (quantized caches)
_TYPES = {1: FLOATS, 2: FLOATS + ["tensor(bfloat16)", "tensor(uint8)"]}


def schema(version: int) -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    A = defs.OpSchema.AttrType
    return defs.OpSchema(
        NAME, DOMAIN, version,
        doc="Keep the k best-scoring cache slots per (batch, head), in slot order (kvexport docs/custom_ops.md).",
        inputs=[P("scores", "S"), P("keys", "T"), P("values", "T"), P("positions", "I")],
        outputs=[P("kept_keys", "T"), P("kept_values", "T"), P("kept_positions", "I"), P("kept_indices", "I")],
        type_constraints=[("S", ["tensor(float)"], "scores: float32 in every build (exact ties, the plugin's type)"),
                          ("T", _TYPES[version], "cache type (uint8: quantized codes, gathered as bytes)"),
                          ("I", ["tensor(int64)"], "positions")],
        attributes=[defs.OpSchema.Attribute("k", A.INT, "slots kept, 1 <= k <= S", required=True), *plugin_attrs()],
    )


# ----------------------------------------------------------------------------- ONNX function
# Rows are gathered whole with GatherND (batch_dims 2: one slot index per kept row), not with GatherElements over
# indices broadcast along the head dimension: the broadcast was ``idx + ConstantOfShape(0)``, which onnxruntime
# folds under static shapes into int64 zeros of the kept cache's shape, one per layer and session (190 MB in each
# compaction graph of SmolLM2 at a 2048-token budget); repeated with Tile it cost 80 ms per compaction there.
_FUNCTION = f"""
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
    kept_keys = GatherND <batch_dims: int = 2> (keys, idx4)
    kept_values = GatherND <batch_dims: int = 2> (values, idx4)
}}
"""


def function(codes: bool = False) -> onnx.FunctionProto:
    """The function body; ``codes``: for uint8 keys / values (a quantized cache), which it gathers as float16
    (every code 0..255 exactly) and casts back, so that an inlined body (``--ops standard``) runs on TensorRT, which
    gathers no UINT8 tensor (the plugin copies the bytes)."""
    text = _FUNCTION
    if codes:
        for name in ("keys", "values"):
            text = text.replace(f"GatherND <batch_dims: int = 2> ({name}, ", f"GatherND <batch_dims: int = 2> ({name}16, ")
            text = text.replace(f"kept_{name} = GatherND", f"kept_{name}16 = GatherND")
        text = text.replace("    zero = Constant", "    keys16 = Cast <to: int = 10> (keys)\n"
                            "    values16 = Cast <to: int = 10> (values)\n    zero = Constant", 1)
        text = text.replace("\n}", "\n    kept_keys = CastLike (kept_keys16, keys)\n"
                            "    kept_values = CastLike (kept_values16, values)\n}", 1)
    return onnx.parser.parse_function(text)


def gathers_codes(model: onnx.ModelProto) -> bool:
    """Whether every TopKGather node of ``model`` takes uint8 keys and values (as far as the graph types them)."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == NAME]
    return bool(nodes) and all(types.get(n.input[i]) == onnx.TensorProto.UINT8 for n in nodes for i in (1, 2))


def function_for(model: onnx.ModelProto | None) -> onnx.FunctionProto:
    """The body ``model``'s nodes use (the uint8 one where every node gathers codes)."""
    return function(model is not None and gathers_codes(model))


# ----------------------------------------------------------------------------- plugin contract and translation
def plugin_version(n_inputs: int = 4, latent_format: int = 0) -> str:
    return PLUGIN_VERSION


def translation(opset):
    """``torch.ops.kvexport.topk_gather`` -> one TopKGather node of ``opset`` (an onnxscript Opset of the domain)."""

    def topk_gather_onnx(scores, keys, values, positions, k: int):
        return opset.TopKGather(scores, keys, values, positions, k=k, plugin_namespace=PLUGIN_NAMESPACE,
                                plugin_version=PLUGIN_VERSION, _outputs=4)

    return {torch.ops.kvexport.topk_gather.default: topk_gather_onnx}


__all__ = ["NAME", "topk_gather", "topk_gather_reference", "schema", "function", "function_for", "gathers_codes",
           "plugin_version", "translation", "PLUGIN_VERSION", "PLUGIN_REGISTERED"]
