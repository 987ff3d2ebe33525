# SPDX-License-Identifier: Apache-2.0
"""The custom ops: PyTorch op vs its ONNX function (onnxruntime, onnx.reference) vs a NumPy reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort  # noqa: E402
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from kvexport import ops

NP = {"fp32": np.float32, "fp16": np.float16}
TP = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


def _model(node, inputs, outputs):
    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET), helper.make_opsetid(ops.DOMAIN, 1)],
                          functions=ops.function_protos())
    m.ir_version = 10
    ops.register_schemas()
    onnx.checker.check_model(m, full_check=True)
    return m


def _run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


# ----------------------------------------------------------------------------- TopKGather
def topk_gather_numpy(scores, keys, values, positions, k):
    s = np.where(positions < 0, -np.inf, scores.astype(np.float32))
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]  # descending, ties -> lower slot
    idx = np.sort(order, axis=-1)
    take = lambda x: np.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731
    return take(keys), take(values), np.take_along_axis(positions, idx, axis=2), idx


def topk_gather_model(B, H, S, Dk, Dv, k, dtype):
    t = TP[dtype]
    node = ops.make_node("TopKGather", ["scores", "keys", "values", "positions"],
                         ["kept_keys", "kept_values", "kept_positions", "kept_indices"], k=k)
    vi = helper.make_tensor_value_info
    return _model(node, [vi("scores", TensorProto.FLOAT, [B, H, S]), vi("keys", t, [B, H, S, Dk]),
                         vi("values", t, [B, H, S, Dv]),
                         vi("positions", TensorProto.INT64, [B, H, S])],
                  [vi("kept_keys", t, [B, H, k, Dk]), vi("kept_values", t, [B, H, k, Dv]),
                   vi("kept_positions", TensorProto.INT64, [B, H, k]), vi("kept_indices", TensorProto.INT64, [B, H, k])])


@st.composite
def topk_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    S = draw(st.integers(1, 12))
    k = draw(st.integers(1, S))
    Dk, Dv = draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    ties = draw(st.booleans())
    p_empty = draw(st.sampled_from([0.0, 0.3, 0.8]))
    dtype = draw(st.sampled_from(["fp32", "fp16"]))
    return B, H, S, Dk, Dv, k, seed, ties, p_empty, dtype


@settings(max_examples=40, deadline=None)
@given(topk_cases())
def test_topk_gather_torch_onnx_numpy(case):
    B, H, S, Dk, Dv, k, seed, ties, p_empty, dtype = case
    rng = np.random.default_rng(seed)
    nd = NP[dtype]
    scores = (rng.integers(-2, 3, (B, H, S)) if ties else rng.standard_normal((B, H, S))).astype(np.float32)
    keys = rng.standard_normal((B, H, S, Dk)).astype(nd)
    values = rng.standard_normal((B, H, S, Dv)).astype(nd)
    positions = np.where(rng.random((B, H, S)) < p_empty, -1, rng.permutation(S)[None, None, :]).astype(np.int64)
    want = topk_gather_numpy(scores, keys, values, positions, k)
    got_t = ops.topk_gather.topk_gather(*(torch.from_numpy(x) for x in (scores, keys, values, positions)), k)
    got_o = _run(topk_gather_model(B, H, S, Dk, Dv, k, dtype),
                 {"scores": scores, "keys": keys, "values": values, "positions": positions})
    for w, t, o in zip(want, got_t, got_o, strict=False):
        np.testing.assert_array_equal(t.numpy(), w)
        np.testing.assert_array_equal(o, w)


def test_topk_gather_reference_evaluator():
    """onnx.reference runs the same function (no plugin, no onnxruntime)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(0)
    scores = np.array([[[1, 1, 2, 2, 0, 1], [3, 3, 3, 3, 3, 3]]], np.float32)
    positions = np.array([[[0, 1, 2, -1, 4, 5], [0, 1, -1, 3, 4, 5]]], np.int64)
    keys = rng.standard_normal((1, 2, 6, 3)).astype(np.float32)
    values = rng.standard_normal((1, 2, 6, 2)).astype(np.float32)
    m = topk_gather_model(1, 2, 6, 3, 2, 4, "fp32")
    got = ReferenceEvaluator(m).run(None, {"scores": scores, "keys": keys, "values": values, "positions": positions})
    want = topk_gather_numpy(scores, keys, values, positions, 4)
    np.testing.assert_array_equal(got[3], [[[0, 1, 2, 5], [0, 1, 3, 4]]])
    for g, w in zip(got, want, strict=False):
        np.testing.assert_array_equal(g, w)


# ----------------------------------------------------------------------------- LatentAttention
def latent_attention_numpy(q, latent, qp, lp, rank, scale):
    logits = np.einsum("bhtd,bsd->bhts", q.astype(np.float64), latent.astype(np.float64)) * scale
    vis = (lp[:, None, None, :] >= 0) & (lp[:, None, None, :] <= qp[:, None, :, None])
    logits = np.where(vis, logits, np.finfo(np.float32).min)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bsr->bhtr", p, latent[..., :rank].astype(np.float64))


def latent_attention_model(B, Hq, T, S, R, Dr, scale, dtype):
    t = TP[dtype]
    node = ops.make_node("LatentAttention", ["q", "latent", "q_positions", "latent_positions"], ["out"], rank=R,
                         scale=scale)
    vi = helper.make_tensor_value_info
    return _model(node, [vi("q", t, [B, Hq, T, R + Dr]), vi("latent", t, [B, S, R + Dr]),
                         vi("q_positions", TensorProto.INT64, [B, T]), vi("latent_positions", TensorProto.INT64, [B, S])],
                  [vi("out", t, [B, Hq, T, R])])


@st.composite
def latent_cases(draw):
    return (draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 10)),
            draw(st.integers(1, 8)), draw(st.sampled_from([0, 2, 4])), draw(st.integers(0, 2**31 - 1)),
            draw(st.sampled_from([0.0, 0.4])), draw(st.sampled_from(["fp32", "fp16"])))


@settings(max_examples=30, deadline=None)
@given(latent_cases())
def test_latent_attention_torch_onnx_numpy(case):
    B, Hq, T, S, R, Dr, seed, p_empty, dtype = case
    rng = np.random.default_rng(seed)
    nd = NP[dtype]
    scale = float((R + Dr) ** -0.5)
    q = rng.standard_normal((B, Hq, T, R + Dr)).astype(nd)
    latent = rng.standard_normal((B, S, R + Dr)).astype(nd)
    lp = np.where(rng.random((B, S)) < p_empty, -1, rng.integers(0, 12, (B, S))).astype(np.int64)
    qp = np.where(rng.random((B, T)) < 0.2, -1, rng.integers(0, 12, (B, T))).astype(np.int64)
    want_out = latent_attention_numpy(q, latent, qp, lp, R, scale)
    t_out = ops.latent_attention.latent_attention(*(torch.from_numpy(x) for x in (q, latent, qp, lp)), R, scale)
    (o_out,) = _run(latent_attention_model(B, Hq, T, S, R, Dr, scale, dtype),
                    {"q": q, "latent": latent, "q_positions": qp, "latent_positions": lp})
    tol = 1e-5 if dtype == "fp32" else 2e-2
    np.testing.assert_allclose(t_out.numpy().astype(np.float64), want_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(o_out.astype(np.float64), want_out, atol=tol, rtol=tol)
    assert o_out.dtype == nd


def test_nodes_carry_plugin_attributes():
    m = topk_gather_model(1, 1, 4, 2, 2, 2, "fp32")
    attrs = {a.name: helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
    assert attrs["plugin_namespace"] == b"kvexport" and attrs["plugin_version"] == b"1" and attrs["k"] == 2
    assert m.graph.node[0].domain == "kvexport"


# ----------------------------------------------------------------------------- op version 2 (quantized caches)
def _model_v2(node, inputs, outputs):
    """A one-node graph importing the kvexport domain at version 2, with the function bodies its node needs."""
    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ops.OPSET),
                                            helper.make_opsetid(ops.DOMAIN, ops.OP_VERSION)])
    m.functions.extend(ops.function_protos(m))
    m.ir_version = 10
    ops.register_schemas()
    onnx.checker.check_model(m, full_check=True)
    return m


def test_topk_gather_gathers_uint8_codes():
    """Version 2: a quantized cache's uint8 codes are gathered as bytes, like float rows (vs NumPy)."""
    assert ops.OP_VERSION == 2
    rng = np.random.default_rng(3)
    B, H, S, Dk, Dv, k = 2, 3, 11, 5, 4, 6
    scores = rng.integers(0, 4, (B, H, S)).astype(np.float32)  # ties
    keys = rng.integers(0, 256, (B, H, S, Dk)).astype(np.uint8)
    values = rng.integers(0, 256, (B, H, S, Dv)).astype(np.uint8)
    positions = np.where(rng.random((B, H, S)) < 0.2, -1, np.arange(S)).astype(np.int64)
    node = ops.make_node("TopKGather", ["scores", "keys", "values", "positions"],
                         ["kept_keys", "kept_values", "kept_positions", "kept_indices"], k=k)
    vi, U = helper.make_tensor_value_info, TensorProto.UINT8
    m = _model_v2(node, [vi("scores", TensorProto.FLOAT, [B, H, S]), vi("keys", U, [B, H, S, Dk]),
                         vi("values", U, [B, H, S, Dv]), vi("positions", TensorProto.INT64, [B, H, S])],
                  [vi("kept_keys", U, [B, H, k, Dk]), vi("kept_values", U, [B, H, k, Dv]),
                   vi("kept_positions", TensorProto.INT64, [B, H, k]), vi("kept_indices", TensorProto.INT64, [B, H, k])])
    # the body onnxruntime runs here (and an inlined --ops standard graph holds) gathers the codes as float16
    body = next(f for f in m.functions if f.name == "TopKGather")
    assert {"Cast", "CastLike"} <= {n.op_type for n in body.node}
    got = _run(m, {"scores": scores, "keys": keys, "values": values, "positions": positions})
    want = topk_gather_numpy(scores, keys, values, positions, k)
    t_got = ops.topk_gather.topk_gather(*(torch.from_numpy(x) for x in (scores, keys, values, positions)), k)
    for g, t, w in zip(got, t_got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(t.numpy(), w)


def _dequantize_numpy(codes, scale, fmt):
    """codes (B, S, D) uint8, scale (B, S) float16 -> float64 rows, independently of kvexport.cache.quant."""
    import ml_dtypes

    if fmt == 1:
        v = codes.astype(np.float64) - 128.0
    else:
        v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return v * scale.astype(np.float64)[..., None]


@pytest.mark.parametrize("one_head", [False, True], ids=["BSD", "B1SD"])
@pytest.mark.parametrize("fmt", [0, 1, 2], ids=["float", "int8", "fp8"])
def test_latent_attention_v2_two_parts_and_quantized_latent(fmt, one_head):
    """Version 2: ``new_latent`` attended in the same softmax as the cache, and a quantized cache (uint8 codes +
    float16 scale per row, dequantized on load): PyTorch op and ONNX function vs NumPy on the concatenated rows.
    ``one_head``: the latent handed over as the exporter does, the cache's (B, 1, S, D) buffer (B = 2, so a scale
    broadcast over the wrong axis would mix the rows of the two sequences)."""
    rng = np.random.default_rng(11 + fmt)
    B, Hq, T, S, R, Dr = 2, 3, 2, 9, 6, 2
    D, scale = R + Dr, float((R + Dr) ** -0.5)
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float32)
    new = rng.standard_normal((B, T, D)).astype(np.float32)
    lp = np.where(rng.random((B, S)) < 0.3, -1, rng.integers(0, 9, (B, S))).astype(np.int64)
    qp = np.stack([[9, 10], [9, -1]]).astype(np.int64)
    if fmt:
        latent = rng.integers(0, 256, (B, S, D)).astype(np.uint8)
        if fmt == 2:
            latent[(latent & 0x7F) == 0x7F] = 0  # no NaN patterns (never written by the quantizer)
        lscale = (rng.random((B, S)) * 0.1 + 0.01).astype(np.float16)
        rows = _dequantize_numpy(latent, lscale, fmt)
    else:
        latent, lscale = rng.standard_normal((B, S, D)).astype(np.float32), None
        rows = latent.astype(np.float64)
    want = latent_attention_numpy(q, np.concatenate([rows, new], 1), qp, np.concatenate([lp, qp], 1), R, scale)
    tt = (lambda x: None if x is None else torch.from_numpy(x))  # noqa: E731
    lshape = [B, 1, S, D] if one_head else [B, S, D]
    latent = latent.reshape(lshape)
    t_out = ops.latent_attention.latent_attention(tt(q), tt(latent), tt(qp), tt(lp), R, scale, tt(new), tt(lscale), fmt)
    names = ["q", "latent", "q_positions", "latent_positions", "new_latent"] + (["latent_scale"] if fmt else [])
    attrs = {"latent_format": fmt} if fmt else {}
    node = ops.make_node("LatentAttention", names, ["out"], rank=R, scale=scale, **attrs)
    vi, F = helper.make_tensor_value_info, TensorProto.FLOAT
    inputs = [vi("q", F, [B, Hq, T, D]), vi("latent", TensorProto.UINT8 if fmt else F, lshape),
              vi("q_positions", TensorProto.INT64, [B, T]), vi("latent_positions", TensorProto.INT64, [B, S]),
              vi("new_latent", F, [B, T, D])] + ([vi("latent_scale", TensorProto.FLOAT16, [B, S])] if fmt else [])
    m = _model_v2(node, inputs, [vi("out", F, [B, Hq, T, R])])
    feeds = {"q": q, "latent": latent, "q_positions": qp, "latent_positions": lp, "new_latent": new}
    if fmt:
        feeds["latent_scale"] = lscale
    (o_out,) = _run(m, feeds)
    np.testing.assert_allclose(t_out.numpy(), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(o_out, want, atol=1e-5, rtol=1e-5)
    # the node asks for the version-2 plugin (plugins/latent_attention registers versions 1 and 2)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_version"] == b"2" and ops.PLUGIN_REGISTERED["LatentAttention"] == ("1", "2")
