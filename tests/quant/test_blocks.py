# SPDX-License-Identifier: Apache-2.0
"""The block rule (kvexport.quant.blocks) against an independent NumPy statement of it, and onnxruntime's kernels
(MatMulNBits, GatherBlockQuantized, DequantizeLinear over INT4) against its dequantized values, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import BadModel, BadUsage
from kvexport.quant.blocks import fp16_round, quantize_int4

SHAPES = [(64, 48), (80, 30), (96, 64)]  # K a multiple of the block; K padded (80 = 2.5 blocks); 3 blocks (odd)


def _weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    w[:32, 0] = 0.0  # an all-zero block
    w[:, 1] += 0.2  # a column far from symmetric
    return w


def _blocks_of(w: np.ndarray, bs: int) -> np.ndarray:
    """(N, kb, bs) the weight's blocks along K, zero-padded."""
    k, n = w.shape
    kb = -(-k // bs)
    p = np.zeros((kb * bs, n), np.float32)
    p[:k] = w
    return p.T.reshape(n, kb, bs)


@pytest.mark.parametrize("k,n", SHAPES)
def test_asymmetric_blocks_are_min_max_over_15_and_round_to_nearest(k, n):
    w = _weight(k, n)
    b = quantize_int4(w, 32)
    blk = _blocks_of(w, 32)
    lo, hi = np.minimum(blk.min(-1), 0), np.maximum(blk.max(-1), 0)  # onnxruntime keeps 0 in every block's range
    want = (hi - lo) / 15
    assert np.allclose(b.scales[want > 0], want[want > 0], rtol=1e-6, atol=0)
    assert np.all(b.scales[want == 0] == 1)  # all-zero blocks: scale 1 (still reads 0)
    assert b.codes.max() <= 15 and b.zero_points.max() <= 15
    err = np.abs(b.dequantize() - w)
    bound = np.repeat(b.scales, 32, axis=1)[:, :k].T / 2
    assert np.all(err <= bound * (1 + 1e-5) + 1e-9), float((err - bound).max())
    assert np.all(b.dequantize()[:32, 0] == 0)


@pytest.mark.parametrize("k,n", SHAPES)
def test_symmetric_blocks_are_absmax_over_7_with_positive_scales(k, n):
    w = _weight(k, n)
    b = quantize_int4(w, 32, symmetric=True)
    blk = _blocks_of(w, 32)
    amax = np.abs(blk).max(-1)
    assert np.all(b.scales > 0)
    assert np.array_equal(b.scales[amax > 0], (amax / np.float32(7)).astype(np.float32)[amax > 0])
    q = np.clip(np.rint(blk / np.where(amax > 0, amax / np.float32(7), 1)[..., None]), -8, 7)
    assert np.array_equal(b.codes.astype(np.int16) - 8, q.reshape(n, -1)[:, :k].astype(np.int16))
    assert np.all(b.zero_points == 8)


def test_block_size_must_be_a_power_of_two_of_at_least_16():
    for bad in (8, 24, 0):
        with pytest.raises(BadUsage, match="power of two"):
            quantize_int4(np.zeros((32, 2), np.float32), bad)


def _session(nodes, inputs, outputs, inits, opset=18, acc_level=None):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    ops = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    m = helper.make_model(g, opset_imports=ops, ir_version=10)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if acc_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(acc_level))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n", SHAPES)
def test_matmulnbits_reads_exactly_the_dequantized_weight(k, n, symmetric):
    """y = I @ W through onnxruntime's MatMulNBits (float32 activations, prefill and decode row shapes) is the
    dequantized weight itself: each output is one product w * 1 plus zeros."""
    b = quantize_int4(_weight(k, n), 32, symmetric)
    bq, scales, zp = b.matmulnbits()
    inits = [numpy_helper.from_array(bq, "B"), numpy_helper.from_array(scales, "S")]
    ins = ["A", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32)
    s = _session([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    eye = np.eye(k, dtype=np.float32)
    want = b.dequantize()
    assert np.array_equal(s.run(None, {"A": eye})[0], want)
    rows = np.concatenate([s.run(None, {"A": eye[i : i + 1]})[0] for i in range(k)])
    assert np.array_equal(rows, want)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n", [(64, 48), (96, 64)])
def test_gather_block_quantized_reads_the_head_blocks_as_table_rows(k, n, symmetric):
    """A tied table (V, D) = the head's weight transposed: GatherBlockQuantized over the head's MatMulNBits data,
    viewed (V, D / 2), returns the dequantized rows exactly."""
    b = quantize_int4(_weight(k, n), 32, symmetric)  # head (K=D, N=V)
    bq, scales, zp = b.matmulnbits()
    inits = [numpy_helper.from_array(bq.reshape(n, k // 2), "D"), numpy_helper.from_array(scales, "S")]
    ins = ["D", "I", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        ins.append("Z")
    node = helper.make_node("GatherBlockQuantized", ins, ["Y"], domain="com.microsoft", bits=4, block_size=32,
                            gather_axis=0, quantize_axis=1)
    s = _session([node], [helper.make_tensor_value_info("I", TensorProto.INT64, ["T"])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", k])], inits)
    assert np.array_equal(s.run(None, {"I": np.arange(n, dtype=np.int64)})[0], b.dequantize().T)


@pytest.mark.parametrize("k,n", [(64, 48), (96, 64)])
def test_int4_dequantizelinear_reads_exactly_the_dequantized_weight(k, n):
    """The int4-qdq storage: ONNX DequantizeLinear (opset 21, INT4, blocked along axis 0) alone, and fused by
    onnxruntime with a MatMul into MatMulNBits (float32 activations)."""
    b = quantize_int4(_weight(k, n), 32, symmetric=True)
    raw, scales = b.int4_dq()
    q = helper.make_tensor("Q", TensorProto.INT4, [k, n], raw, raw=True)
    dq = helper.make_node("DequantizeLinear", ["Q", "S"], ["W"], axis=0, block_size=32)
    s = _session([dq], [], [helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])],
                 [q, numpy_helper.from_array(scales, "S")], opset=21)
    assert np.array_equal(s.run(None, {})[0], b.dequantize())
    mm = helper.make_node("MatMul", ["A", "W"], ["Y"])
    s = _session([dq, mm], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                 [q, numpy_helper.from_array(scales, "S")], opset=21, acc_level=0)
    assert np.array_equal(s.run(None, {"A": np.eye(k, dtype=np.float32)})[0], b.dequantize())
    onnx.checker.check_model(helper.make_model(helper.make_graph([dq], "g", [], [
        helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])], [q, numpy_helper.from_array(scales, "S")]),
        opset_imports=[helper.make_opsetid("", 21)], ir_version=10), full_check=True)


def test_fp16_round_is_round_to_nearest_even_and_refuses_overflow():
    w = np.array([1.0, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, -65519.0, 1e-8, 2**-24], np.float32)
    want = np.array([1.0, 1.0, 1 + 2**-9, 65504.0, -65504.0, 0.0, 2**-24], np.float32)  # ties to even; subnormal
    assert np.array_equal(fp16_round(w), want)
    with pytest.raises(BadModel, match="does not fit float16"):
        fp16_round(np.array([1.0, 65520.0], np.float32))


def _q4_1(k: int, n: int, seed: int = 3) -> np.ndarray:
    """A weight as a GGUF Q4_1 file holds it, stated independently of kvexport (llama.cpp's reference quantizer
    written out in NumPy): per block of 32 along K, d = float16((max - min) / 15), m = float16(min),
    q = round((x - min) / d) in 0 ... 15, read back as d * q + m in float32."""
    x = np.random.default_rng(seed).standard_normal((n, k // 32, 32)).astype(np.float32) * 0.04
    x[0, 0] = 0.01  # a constant block
    lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.floor((x - lo) / np.where(d > 0, d, 1) + 0.5), 0, 15)
    return np.ascontiguousarray((d * q + m).reshape(n, k).T)  # (K, N) as MatMul reads it


@pytest.mark.parametrize("k,n", [(64, 48), (96, 64)])
def test_a_q4_1_weight_keeps_its_own_grid(k, n):
    """A weight already on a Q4_1 grid keeps its codes with float zero points: it reads back within one float32
    rounding (most blocks bit for bit) where onnxruntime's integer zero point moves it by up to half a code; and
    MatMulNBits reads the float zero points as the rule says, bit for bit."""
    w = _q4_1(k, n)
    b = quantize_int4(w, 32)
    assert b.own and b.bits == 4 and b.zero_points.dtype == np.float32 and b.codes.max() <= 15
    got = b.dequantize()
    ulp = np.spacing(np.abs(w)).max()
    assert np.abs(got - w).max() <= ulp
    same = (got == w).reshape(k // 32, 32, n).all(axis=1).mean()
    assert same >= 0.5, same
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, quant_format=QuantFormat.QOperator)
    packed, scales, zp = DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(w)  # onnxruntime's rule, integer points
    nb = k // 32
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, nb, 32).astype(np.float32)
    zps = np.stack([zp & 0xF, zp >> 4], axis=-1).reshape(n, -1)[:, :nb].astype(np.float32)
    theirs = ((codes - zps[:, :, None]) * scales.reshape(n, nb)[:, :, None]).reshape(n, k).T
    assert np.abs(theirs - w).mean() > 100 * np.abs(got - w).mean() + 1e-6  # the grid moved, not kept
    bq, s, z = b.matmulnbits()
    assert z.dtype == np.float32 and z.shape == s.shape
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32)
    sess = _session([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                    [numpy_helper.from_array(bq, "B"), numpy_helper.from_array(s, "S"), numpy_helper.from_array(z, "Z")])
    assert np.array_equal(sess.run(None, {"A": np.eye(k, dtype=np.float32)})[0], got)


def test_a_float_weight_is_not_taken_for_a_grid():
    """Random float weights, a Q4_1 weight with one value off its grid, and K not a multiple of the block get
    onnxruntime's integer zero points."""
    assert not quantize_int4(_weight(64, 48), 32).own
    w = _q4_1(64, 48)
    w[5, 7] += 1e-4
    assert not quantize_int4(w, 32).own
    assert not quantize_int4(_q4_1(96, 48)[:80], 32).own  # 2.5 blocks
    assert quantize_int4(_q4_1(96, 48), 32).own


@pytest.mark.parametrize("k,n", [(64, 48), (96, 64)])
def test_a_q8_0_weight_keeps_its_8_bit_blocks(k, n):
    """A weight as a GGUF Q8_0 block holds it (stated here in NumPy: d = float16(absmax / 127),
    q = round(x / d) in -127 ... 127, read back as d * q) keeps its 8-bit codes: MatMulNBits (bits 8) and
    GatherBlockQuantized (the tied table's rows) read it back bit for bit, as the weight itself."""
    x = np.random.default_rng(5).standard_normal((n, k // 32, 32)).astype(np.float32) * 0.03
    x[1, 0] = 0.0  # an all-zero block
    d = (np.abs(x).max(axis=2, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    w = np.ascontiguousarray((np.rint(x / np.where(d > 0, d, 1)) * d).reshape(n, k).T)  # (K, N)
    b = quantize_int4(w, 32)
    assert b.own and b.bits == 8 and np.array_equal(b.dequantize(), w)
    bq, s, z = b.matmulnbits()
    assert z is None and bq.dtype == np.uint8 and bq.shape == (n, k // 32, 32)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=32)
    sess = _session([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                    [numpy_helper.from_array(bq, "B"), numpy_helper.from_array(s, "S")])
    assert np.array_equal(sess.run(None, {"A": np.eye(k, dtype=np.float32)})[0], w)
    node = helper.make_node("GatherBlockQuantized", ["D", "I", "S"], ["Y"], domain="com.microsoft", bits=8,
                            block_size=32, gather_axis=0, quantize_axis=1)
    sess = _session([node], [helper.make_tensor_value_info("I", TensorProto.INT64, ["T"])],
                    [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", k])],
                    [numpy_helper.from_array(bq.reshape(n, k), "D"), numpy_helper.from_array(s, "S")])
    assert np.array_equal(sess.run(None, {"I": np.arange(n, dtype=np.int64)})[0], w.T)
