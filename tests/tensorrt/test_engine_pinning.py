# SPDX-License-Identifier: Apache-2.0
"""build_engine --fp16 keeps in FP32 exactly the layers whose results only serve TopKGather's scores (a stand-in
network: TensorRT itself runs only where it is installed)."""

from __future__ import annotations

import types

import onnx
from onnx import TensorProto, helper

from kvexport import ops
from kvexport.tensorrt.engine import pin_scores_fp32, topk_score_tensors

TRT = types.SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16", int64="i64")


class Tensor:
    def __init__(self, name, dtype="f16"):
        self.name, self.dtype = name, dtype


class Layer:
    def __init__(self, name, inputs, outputs):
        self.name, self.inputs, self.outputs = name, inputs, outputs
        self.precision, self.output_types = None, {}

    num_inputs = property(lambda self: len(self.inputs))
    num_outputs = property(lambda self: len(self.outputs))

    def get_input(self, i):
        return self.inputs[i]

    def get_output(self, i):
        return self.outputs[i]

    def set_output_type(self, i, t):
        self.output_types[i] = t


class Network:
    def __init__(self, layers, outputs):
        self.layers, self.outputs = layers, outputs

    num_layers = property(lambda self: len(self.layers))
    num_outputs = property(lambda self: len(self.outputs))

    def get_layer(self, i):
        return self.layers[i]

    def get_output(self, i):
        return self.outputs[i]


def test_only_the_exclusive_score_cone_is_pinned():
    x, h, s, keys, pos = Tensor("x"), Tensor("h"), Tensor("scores"), Tensor("keys"), Tensor("pos", "i64")
    a, b, logits = Tensor("a"), Tensor("b"), Tensor("logits")
    kept = Tensor("kept")
    shared = Layer("shared_matmul", [x], [h])  # h also feeds the logits: not pinned
    score_norm = Layer("score_norm", [h], [a])  # only for scores
    score_mul = Layer("score_mul", [a, b], [s])
    b_src = Layer("b_const", [], [b])  # constant feeding only the scores
    head = Layer("lm_head", [h], [logits])
    topk = Layer("topk_gather", [s, keys, keys, pos], [kept])
    net = Network([shared, score_norm, b_src, score_mul, head, topk], [logits, kept])
    assert pin_scores_fp32(net, {"scores"}, TRT) == 3
    assert {la.name for la in net.layers if la.precision == "f32"} == {"score_norm", "score_mul", "b_const"}
    assert score_mul.output_types == {0: "f32"} and shared.precision is None and head.precision is None


def test_no_topk_no_pinning():
    x, y = Tensor("x"), Tensor("y")
    net = Network([Layer("l", [x], [y])], [y])
    assert pin_scores_fp32(net, set(), TRT) == 0


def test_score_tensors_from_the_graph(tmp_path):
    vi = helper.make_tensor_value_info
    node = ops.make_node("TopKGather", ["s", "k", "v", "p"], ["kk", "kv", "kp", "ki"], k=1)
    g = helper.make_graph([node], "g", [vi("s", TensorProto.FLOAT, [1, 1, 2]), vi("k", TensorProto.FLOAT, [1, 1, 2, 1]),
                                        vi("v", TensorProto.FLOAT, [1, 1, 2, 1]), vi("p", TensorProto.INT64, [1, 1, 2])],
                          [vi("ki", TensorProto.INT64, [1, 1, 1])])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(g), str(path))
    assert topk_score_tensors(path) == {"s"}


def test_diamond_joins_once_both_branches_have():
    x, d, e1, e2, s, kept = Tensor("x"), Tensor("d"), Tensor("e1"), Tensor("e2"), Tensor("scores"), Tensor("kept")
    src = Layer("src", [x], [d])  # feeds two layers that both serve only the scores
    left, right = Layer("left", [d], [e1]), Layer("right", [d], [e2])
    add = Layer("add", [e1, e2], [s])
    topk = Layer("topk", [s], [kept])
    net = Network([src, left, right, add, topk], [kept])
    assert pin_scores_fp32(net, {"scores"}, TRT) == 4
