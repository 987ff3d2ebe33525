# SPDX-License-Identifier: Apache-2.0
"""Tiny ONNX models with a kvexport-domain TopKGather node backed by a model-local function (test fixtures)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 18


def topk_gather_function() -> onnx.FunctionProto:
    """TopKGather (docs/custom_ops.md) from standard ops: mask, TopK (ties -> lower index), sort indices, gather."""
    n = helper.make_node
    nodes = [
        n("Constant", [], ["k_scalar"], value_int=0),
        n("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [], [0])),
        n("Constant", [], ["neg_inf"], value=helper.make_tensor("ni", TensorProto.FLOAT, [], [-np.inf])),
        n("Constant", [], ["one_axis"], value=helper.make_tensor("o", TensorProto.INT64, [1], [1])),
        n("Constant", [], ["minus1"], value=helper.make_tensor("m", TensorProto.INT64, [1], [-1])),
        n("Reshape", ["k_scalar", "one_axis"], ["K"]),
        n("Cast", ["scores"], ["s32"], to=TensorProto.FLOAT),
        n("Less", ["positions", "zero"], ["empty"]),
        n("Where", ["empty", "neg_inf", "s32"], ["s"]),
        n("TopK", ["s", "K"], ["_vals", "chosen"], axis=-1, largest=1, sorted=1),
        n("Cast", ["chosen"], ["chosen_f"], to=TensorProto.FLOAT),
        n("TopK", ["chosen_f", "K"], ["asc_f", "_order"], axis=-1, largest=0, sorted=1),
        n("Cast", ["asc_f"], ["kept_indices"], to=TensorProto.INT64),
        n("GatherElements", ["positions", "kept_indices"], ["kept_positions"], axis=2),
        n("Unsqueeze", ["kept_indices", "minus1"], ["idx4"]),
        n("Shape", ["kept_indices"], ["idx_shape"]),
        n("Shape", ["keys"], ["kdim"], start=3),
        n("Shape", ["values"], ["vdim"], start=3),
        n("Concat", ["idx_shape", "kdim"], ["kexp"], axis=0),
        n("Concat", ["idx_shape", "vdim"], ["vexp"], axis=0),
        n("Expand", ["idx4", "kexp"], ["kidx"]),
        n("Expand", ["idx4", "vexp"], ["vidx"]),
        n("GatherElements", ["keys", "kidx"], ["kept_keys"], axis=2),
        n("GatherElements", ["values", "vidx"], ["kept_values"], axis=2),
    ]
    # k comes from the node's attribute
    kconst = nodes[0]
    del kconst.attribute[:]
    kconst.attribute.append(helper.make_attribute_ref("value_int", onnx.AttributeProto.INT))
    kconst.attribute[0].ref_attr_name = "k"
    return helper.make_function(
        "kvexport",
        "TopKGather",
        ["scores", "keys", "values", "positions"],
        ["kept_keys", "kept_values", "kept_positions", "kept_indices"],
        nodes,
        [helper.make_opsetid("", OPSET)],
        attributes=["k"],
    )


def topk_gather_model(B=1, H=2, S=10, Dk=4, Dv=3, k=4, with_weight: np.ndarray | None = None) -> onnx.ModelProto:
    """Graph: kept_* = TopKGather(scores * w, keys, values, positions) with a kvexport node + local function."""
    inputs = [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [B, H, S]),
        helper.make_tensor_value_info("keys", TensorProto.FLOAT, [B, H, S, Dk]),
        helper.make_tensor_value_info("values", TensorProto.FLOAT, [B, H, S, Dv]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, [B, H, S]),
    ]
    outputs = [
        helper.make_tensor_value_info("kept_keys", TensorProto.FLOAT, [B, H, k, Dk]),
        helper.make_tensor_value_info("kept_values", TensorProto.FLOAT, [B, H, k, Dv]),
        helper.make_tensor_value_info("kept_positions", TensorProto.INT64, [B, H, k]),
        helper.make_tensor_value_info("kept_indices", TensorProto.INT64, [B, H, k]),
    ]
    w = np.ones((S,), np.float32) if with_weight is None else with_weight.astype(np.float32)
    init = [helper.make_tensor("w", TensorProto.FLOAT, [S], w.tolist())]
    nodes = [
        helper.make_node("Mul", ["scores", "w"], ["weighted"]),
        helper.make_node(
            "TopKGather",
            ["weighted", "keys", "values", "positions"],
            ["kept_keys", "kept_values", "kept_positions", "kept_indices"],
            domain="kvexport",
            k=k,
            plugin_namespace="kvexport",
            plugin_version="1",
        ),
    ]
    graph = helper.make_graph(nodes, "tiny_topk_gather", inputs, outputs, init)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("kvexport", 1)],
        functions=[topk_gather_function()],
    )
    model.ir_version = 10
    return model
