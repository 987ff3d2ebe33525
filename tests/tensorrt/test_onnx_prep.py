# SPDX-License-Identifier: Apache-2.0
"""prepare_onnx_for_trt: strip the kvexport local functions for TensorRT < 10.7, keep them from 10.7."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvexport.cache.static_cache import gather_slots, select_kept
from kvexport.errors import BadArtifact, BadUsage
from kvexport.tensorrt import needs_function_strip, parse_version, prepare_onnx_for_trt
from tests.tensorrt.onnx_models import topk_gather_model


def _feeds(seed=0, B=1, H=2, S=10, Dk=4, Dv=3):
    rng = np.random.default_rng(seed)
    pos = np.tile(np.arange(S), (B, H, 1))
    pos[rng.random((B, H, S)) < 0.2] = -1
    return dict(
        scores=rng.integers(0, 3, (B, H, S)).astype(np.float32),  # ties on purpose
        keys=rng.standard_normal((B, H, S, Dk)).astype(np.float32),
        values=rng.standard_normal((B, H, S, Dv)).astype(np.float32),
        positions=pos,
    )


@pytest.fixture()
def model_path(tmp_path):
    p = tmp_path / "decode.onnx"
    onnx.save(topk_gather_model(), str(p))
    return p


def test_fixture_function_matches_select_kept(model_path):
    """The local function (what onnxruntime runs) implements the TopKGather contract, ties included."""
    feeds = _feeds(3)
    kk, kv, kp, ki = ort.InferenceSession(str(model_path)).run(None, feeds)
    idx = select_kept(torch.from_numpy(feeds["scores"]), torch.from_numpy(feeds["positions"]), 4)
    np.testing.assert_array_equal(ki, idx.numpy())
    np.testing.assert_array_equal(kp, gather_slots(torch.from_numpy(feeds["positions"]), idx).numpy())
    np.testing.assert_array_equal(kk, gather_slots(torch.from_numpy(feeds["keys"]), idx).numpy())
    np.testing.assert_array_equal(kv, gather_slots(torch.from_numpy(feeds["values"]), idx).numpy())


@pytest.mark.parametrize(
    "version,strip",
    [("10.3.0", True), ("10.6.0.26", True), ("10.7.0", False), ("10.13.3", False), ("11.1", False), ((10, 3), True)],
)
def test_strip_depends_on_version(model_path, tmp_path, version, strip):
    assert needs_function_strip(version) is strip
    out = tmp_path / "prepared.onnx"
    res = prepare_onnx_for_trt(model_path, out, version)
    m = onnx.load(str(out))
    names = [f.name for f in m.functions]
    assert res.plugin_nodes == {"TopKGather": 1}
    if strip:
        assert names == [] and res.stripped_functions == ["TopKGather"]
    else:
        assert names == ["TopKGather"] and res.stripped_functions == []
    node = next(n for n in m.graph.node if n.op_type == "TopKGather")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"k": 4, "plugin_namespace": b"kvexport", "plugin_version": b"1"}
    assert node.domain == "kvexport"
    # the rest of the graph is untouched
    orig = onnx.load(str(model_path))
    assert [n.op_type for n in m.graph.node] == [n.op_type for n in orig.graph.node]
    assert m.graph.initializer[0] == orig.graph.initializer[0]


def test_unchanged_copy_runs_like_original(model_path, tmp_path):
    out = tmp_path / "prepared.onnx"
    prepare_onnx_for_trt(model_path, out, "10.13")
    feeds = _feeds(5)
    a = ort.InferenceSession(str(model_path)).run(None, feeds)
    b = ort.InferenceSession(str(out)).run(None, feeds)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_stripped_copy_no_longer_runs_without_plugin(model_path, tmp_path):
    """Proof the function is really gone: onnxruntime cannot resolve kvexport::TopKGather any more."""
    out = tmp_path / "prepared.onnx"
    prepare_onnx_for_trt(model_path, out, "10.3")
    with pytest.raises(Exception, match="TopKGather"):
        ort.InferenceSession(str(out))


def test_missing_plugin_attributes_are_added(tmp_path):
    m = topk_gather_model()
    node = m.graph.node[1]
    keep = [a for a in node.attribute if a.name == "k"]
    del node.attribute[:]
    node.attribute.extend(keep)
    src = tmp_path / "bare.onnx"
    onnx.save(m, str(src))
    prepare_onnx_for_trt(src, tmp_path / "out.onnx", "10.3.0")
    attrs = {a.name for a in onnx.load(str(tmp_path / "out.onnx")).graph.node[1].attribute}
    assert attrs == {"k", "plugin_namespace", "plugin_version"}


@pytest.mark.parametrize("same_dir", [True, False])
def test_external_data_survives(tmp_path, same_dir):
    w = np.linspace(0.5, 2.0, 10).astype(np.float32)
    src_dir = tmp_path / "export"
    src_dir.mkdir()
    src = src_dir / "decode.onnx"
    onnx.save(
        topk_gather_model(with_weight=w),
        str(src),
        save_as_external_data=True,
        location="decode.onnx.data",
        size_threshold=0,
    )
    out = (src_dir if same_dir else tmp_path / "elsewhere") / "decode.prepared.onnx"
    prepare_onnx_for_trt(src, out, "10.13")
    feeds = _feeds(9)
    a = ort.InferenceSession(str(src)).run(None, feeds)
    b = ort.InferenceSession(str(out)).run(None, feeds)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_bad_inputs(tmp_path):
    with pytest.raises(BadUsage, match="does not exist"):
        prepare_onnx_for_trt(tmp_path / "nope.onnx", tmp_path / "o.onnx", "10.3")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01not a model" * 10)
    with pytest.raises(BadArtifact, match="not a readable ONNX model"):
        prepare_onnx_for_trt(junk, tmp_path / "o.onnx", "10.3")
    with pytest.raises(BadUsage, match="not like"):
        parse_version("ten")
    assert parse_version("10.13.3.9") == (10, 13, 3)


def test_exporter_functions_are_stripped(tmp_path):
    """The exporter's own local functions (kvexport.ops) for both ops are what gets stripped."""
    from onnx import TensorProto, helper

    from kvexport import ops

    B, H, S, D, R, k = 1, 2, 8, 6, 4, 3
    vi = helper.make_tensor_value_info
    inputs = [
        vi("q", TensorProto.FLOAT, [B, H, 1, D]),
        vi("latent", TensorProto.FLOAT, [B, S, D]),
        vi("qpos", TensorProto.INT64, [B, 1]),
        vi("lpos", TensorProto.INT64, [B, S]),
        vi("scores", TensorProto.FLOAT, [B, 1, S]),
    ]
    outputs = [vi("out", TensorProto.FLOAT, [B, H, 1, R]), vi("kept", TensorProto.FLOAT, [B, 1, k, D])]
    nodes = [
        ops.make_node("LatentAttention", ["q", "latent", "qpos", "lpos"], ["out"], rank=R, scale=0.5),
        helper.make_node("Unsqueeze", ["latent", "ax1"], ["lat4"]),
        helper.make_node("Unsqueeze", ["lpos", "ax1"], ["lpos3"]),
        ops.make_node("TopKGather", ["scores", "lat4", "lat4", "lpos3"], ["kept", "kv", "kp", "ki"], k=k),
    ]
    init = [helper.make_tensor("ax1", TensorProto.INT64, [1], [1])]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, init),
        opset_imports=[helper.make_opsetid("", ops.OPSET), helper.make_opsetid("kvexport", 1)],
        functions=ops.function_protos(),
    )
    src = tmp_path / "decode.onnx"
    onnx.save(model, str(src))
    res = prepare_onnx_for_trt(src, tmp_path / "p103.onnx", "10.3.0")
    assert sorted(res.stripped_functions) == ["LatentAttention", "TopKGather"]
    assert res.plugin_nodes == {"LatentAttention": 1, "TopKGather": 1}
    assert list(onnx.load(str(tmp_path / "p103.onnx")).functions) == []
    res = prepare_onnx_for_trt(src, tmp_path / "p1013.onnx", "10.13.3")
    assert res.stripped_functions == [] and len(onnx.load(str(tmp_path / "p1013.onnx")).functions) == 2
