# SPDX-License-Identifier: Apache-2.0
"""Block quantization of one weight matrix: the one rule that the ONNX post-pass (:mod:`kvexport.quant.weights`)
and the PyTorch reference (:mod:`kvexport.quant.reference`) both call, so the numbers an export dequantizes are the
numbers the reference uses.

A weight is taken as ONNX MatMul reads it, ``w`` (K, N) float32 (``y = x @ w``; a ``nn.Linear`` weight transposed),
and quantized in blocks of ``block_size`` consecutive rows of one column (along K, the input features)::

    w[k, n] ~ (codes[n, k] - zero_points[n, k // B]) * scales[n, k // B]        codes, zero points in 0 ... 15

- **asymmetric** (default; the Q4_1 / onnxruntime ``MatMulNBits`` uint4 scheme): onnxruntime's own block quantizer
  (``quantize_matmul_4bits``, through :class:`onnxruntime.quantization.matmul_nbits_quantizer.
  DefaultWeightOnlyQuantizer`), ``scale = (max - min) / 15`` with a zero point in 0 ... 15 per block.
- **symmetric** (the TensorRT scheme: its DequantizeLinear takes INT4 with a zero point of 0 and strictly positive
  scales, onnx-tensorrt ``QuantDequantLinearHelper``): ``scale = absmax / 7``, ``q = clip(rint(w / scale), -8, 7)``,
  stored as ``codes = q + 8`` with zero point 8. onnxruntime's symmetric quantizer is not used here: it maps the
  block's extreme to -8 with a *negative* scale where that extreme is positive, which TensorRT's parser refuses.

- **the checkpoint's own grid** (asymmetric, tried first): a weight that is already 4-bit, as every layer weight of a
  GGUF Q4_1 file is (each block of 32 holds ``d * q + m``, q in 0 ... 15, d and m float16), keeps its codes, with
  scale ``d`` and a *float* zero point ``-m / d`` (MatMulNBits takes float zero points on the CPU). Re-quantizing it
  with an integer zero point would move every block off its grid by up to half a code (a quarter on average: on
  SmolLM2-135M's Q4_1 file that is 10 % relative error per weight and +32 % perplexity); the grid is exact. Taken
  only when every block of the weight lies on one (:func:`own_blocks`), else onnxruntime's rule.

Dequantization is ``(codes - zero_point) * scale`` in float32 (:meth:`Int4Blocks.dequantize`); the difference of two
small integers is exact, so the only rounding is the product's, the same in NumPy, PyTorch and onnxruntime's
kernels (tests/quant check the kernels against it bit for bit). A float zero point is read as onnxruntime's kernel
reads it, ``codes * scale + (-zero_point * scale)``, and is chosen so that ``-zero_point * scale`` rounds to ``m``
where a float32 zero point can (the block then reads back as the checkpoint's ``d * q + m`` bit for bit: 90 % of
SmolLM2-135M's blocks); elsewhere no float32 product lands on ``m`` and the block reads back within one rounding of
it (at most 2.4e-7 on SmolLM2). An all-zero block gets scale 1 (its codes equal
its zero point, so it still dequantizes to 0): TensorRT refuses a zero scale.

fp16 storage is the other format: ``float16(w)``, read back exactly as float32 (:func:`fp16_round`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS = 4
DEFAULT_BLOCK = 32


def check_block_size(block_size: int) -> int:
    """MatMulNBits / GatherBlockQuantized: a power of two, at least 16."""
    from kvexport.errors import BadUsage

    b = int(block_size)
    if b < 16 or b & (b - 1):
        raise BadUsage(f"--block-size {block_size} must be a power of two of at least 16 (16, 32, 64, 128, ...)")
    return b


@dataclass(frozen=True)
class Int4Blocks:
    """One (K, N) weight in 4-bit blocks along K.

    codes: (N, K) uint8 in 0 ... 15; scales: (N, k_blocks) float32 > 0; zero_points: (N, k_blocks) uint8 in
    0 ... 15 (8 everywhere when ``symmetric``), or float32 for the checkpoint's own 4-bit grid; k_blocks =
    ceil(K / block_size). ``own``: the checkpoint's own blocks (:func:`own_blocks`; K a multiple of the block
    size), then ``bits`` may be 8 (a Q8_0 weight: codes q + 128 in 1 ... 255, zero point 128).
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    block_size: int
    symmetric: bool
    bits: int = BITS
    own: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N), as MatMul reads the weight."""
        n, k = self.codes.shape
        return k, n

    @property
    def float_zero_points(self) -> bool:
        """The checkpoint's own 4-bit grid (Q4_1) keeps its zero point -m / d, a float."""
        return self.zero_points.dtype == np.float32

    @property
    def k_blocks(self) -> int:
        return self.scales.shape[1]

    def _padded_codes(self) -> np.ndarray:
        """(N, k_blocks * B) codes, the tail of the last block filled with the zero point (it dequantizes to 0)."""
        n, k = self.codes.shape
        pad = self.k_blocks * self.block_size - k
        if not pad:
            return self.codes
        fill = np.repeat(self.zero_points[:, -1:], pad, axis=1)
        return np.concatenate([self.codes, fill], axis=1)

    def dequantize(self) -> np.ndarray:
        """(K, N) float32: ``(codes - zero_point) * scale`` per block."""
        k, n = self.shape
        c = self._padded_codes().reshape(n, self.k_blocks, self.block_size).astype(np.float32)
        if self.float_zero_points:  # as MatMulNBits reads a float zero point: codes * scale + (-zero_point * scale)
            w = c * self.scales[:, :, None] + (-self.zero_points * self.scales)[:, :, None]
        else:
            w = (c - self.zero_points[:, :, None].astype(np.float32)) * self.scales[:, :, None]
        return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)

    # ------------------------------------------------------------------ storage layouts
    def matmulnbits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """onnxruntime ``com.microsoft::MatMulNBits`` inputs B, scales, zero_points: B (N, k_blocks, B / 2) uint8 (two
        codes a byte, the first in the low nibble), scales (N, k_blocks) float32, zero points packed the same way
        (N, ceil(k_blocks / 2)) uint8 (the checkpoint's 4-bit grid: (N, k_blocks) float32), or None when symmetric (the
        op's default zero point is 8). 8 bits: B (N, k_blocks, B) uint8, one code a byte, no zero points (the op's
        default, 128)."""
        n = self.codes.shape[0]
        if self.bits == 8:
            return self._padded_codes().reshape(n, self.k_blocks, self.block_size), self.scales, None
        b = _pack_pairs(self._padded_codes()).reshape(n, self.k_blocks, self.block_size // 2)
        zp = (None if self.symmetric else self.zero_points if self.float_zero_points else
              _pack_pairs(self.zero_points))
        return b, self.scales, zp

    def zero_points_of_zero(self) -> np.ndarray:
        """4-bit MatMulNBits zero points that are all 0, packed two a byte: (N, ceil(k_blocks / 2)) uint8."""
        return np.zeros((self.codes.shape[0], (self.k_blocks + 1) // 2), np.uint8)

    def matmulnbits_split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The checkpoint's 4-bit grid (float zero points) as MatMulNBits takes it at speed: B, scales and zero points
        of 0 (packed uint8: onnxruntime 1.32's CPU kernel reads a float zero point 20x slower, measured on SmolLM2's
        MatMuls), so the op computes ``x @ (codes * scale)``, plus each block's offset ``-zero_point * scale`` (the
        float32 product :meth:`dequantize` adds) as a (k_blocks, N) matrix and the (K, k_blocks) 0/1 matrix that sums
        ``x`` over each block: ``x @ w = MatMulNBits(x) + (x @ blocks) @ offsets``, the same sum in another order.
        Needs K a multiple of the block (every own grid is)."""
        if not self.float_zero_points:
            raise ValueError("only the checkpoint's own grid (float zero points) is split")
        k, n = self.shape
        if k % self.block_size:
            raise ValueError(f"K {k} is not a multiple of the block {self.block_size}")
        b, scales, _ = self.matmulnbits()
        zeros = self.zero_points_of_zero()
        offsets = np.ascontiguousarray((-self.zero_points * self.scales).T.astype(np.float32))
        blocks = np.repeat(np.eye(self.k_blocks, dtype=np.float32), self.block_size, axis=0)
        return b, scales, zeros, offsets, blocks

    def matmulnbits_halves(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """An 8-bit weight (Q8_0: codes c = q + 128, w = (c - 128) * d) as two 4-bit MatMulNBits, each on the fast
        kernel: onnxruntime 1.32 runs MatMulNBits with bits 8 at accuracy level 0 on a slow path (SmolLM2's
        49152 x 576 head: 174 ms a row against 2.3 ms in 4 bits). With c = 16 h + l (h, l in 0 ... 15),
        ``w = (h - 8) * 16 d + l * d``: -> ((B, scales) of the high nibbles, whose zero point is the op's default 8),
        ((B, scales, zero points of 0) of the low ones). 16 d and each nibble's product with it are exact in
        float32 (d is a float16); only the order of the sum changes."""
        if self.bits != 8 or self.shape[0] % self.block_size:
            raise ValueError("only an 8-bit weight with K a multiple of its block is split in halves")
        n = self.codes.shape[0]
        c = self._padded_codes()
        hi, lo = (c >> 4).astype(np.uint8), (c & 0xF).astype(np.uint8)
        pack = lambda v: _pack_pairs(v).reshape(n, self.k_blocks, self.block_size // 2)  # noqa: E731
        zeros = self.zero_points_of_zero()
        scales = self.scales.astype(np.float32)
        return (pack(hi), np.ascontiguousarray(scales * np.float32(16))), (pack(lo), scales, zeros)

    def int4_dq(self) -> tuple[bytes, np.ndarray]:
        """ONNX ``DequantizeLinear`` (opset 21, blocked along axis 0) inputs for a symmetric weight: the INT4 tensor
        (K, N) as raw bytes (row-major, two values a byte, low nibble first), scales (k_blocks, N) float32; no zero
        point (0)."""
        if not self.symmetric:
            raise ValueError("a DequantizeLinear over INT4 takes symmetric blocks (zero point 0)")
        q = (self.codes.astype(np.int16) - 8).T  # (K, N) in -8 ... 7
        return _pack_pairs((q & 0xF).astype(np.uint8).reshape(-1)).tobytes(), np.ascontiguousarray(self.scales.T)


def _pack_pairs(v: np.ndarray) -> np.ndarray:
    """Pack 4-bit values along the last axis, two a byte, the first in the low nibble (odd length: a zero nibble)."""
    if v.shape[-1] % 2:
        v = np.concatenate([v, np.zeros((*v.shape[:-1], 1), v.dtype)], axis=-1)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def _unpack_pairs(p: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`_pack_pairs`: the first n 4-bit values along the last axis."""
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)[..., :n]


def own_blocks(w: np.ndarray, block_size: int = DEFAULT_BLOCK) -> Int4Blocks | None:
    """w (K, N) float32 -> the checkpoint's own blocks, when every block of ``block_size`` values along K holds one
    of GGUF's block formats exactly (K a multiple of the block size): Q4_1 (:func:`_q4_1_blocks`), else Q8_0
    (:func:`_q8_0_blocks`); None otherwise (a float weight, another quantizer's blocks)."""
    k, n = w.shape
    if k % block_size:
        return None
    blocks = np.ascontiguousarray(w.T).reshape(n, k // block_size, block_size)
    return _q4_1_blocks(blocks, block_size) or _q8_0_blocks(blocks, block_size)


def _q8_0_blocks(blocks: np.ndarray, block_size: int) -> Int4Blocks | None:
    """Every block ``d * q`` exactly, q in -127 ... 127, ``d = float16(absmax / 127)`` (llama.cpp's Q8_0): codes
    q + 128, zero point 128, scale d; read back as ``(codes - 128) * d``, the same product, bit for bit."""
    n, kb, _ = blocks.shape
    with np.errstate(over="ignore"):
        d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float16).astype(np.float32)
    if not np.isfinite(d).all():
        return None
    d = np.where(d == 0, np.float32(1), d)  # an all-zero block: codes 128
    q = np.rint(blocks / d[:, :, None])
    if np.abs(q).max() > 127 or not np.array_equal(q * d[:, :, None], blocks):
        return None
    codes = (q + 128).astype(np.uint8).reshape(n, -1)
    return Int4Blocks(np.ascontiguousarray(codes), d.astype(np.float32), np.full((n, kb), 128, np.uint8), block_size,
                      True, bits=8, own=True)


def _q4_1_blocks(blocks: np.ndarray, block_size: int) -> Int4Blocks | None:
    """Every block ``d * q + m`` exactly (float32 arithmetic, q in 0 ... 15, ``d = float16((max - min) / 15)``,
    ``m`` = the block's minimum: how llama.cpp's Q4_1 quantizer places a block, its minimum at code 0)."""
    n, kb, _ = blocks.shape
    k = kb * block_size
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    with np.errstate(over="ignore"):
        d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    if not np.isfinite(d).all():
        return None
    flat = d == 0  # a constant block: code 0, scale 1, the zero point -m reads back m
    d = np.where(flat, np.float32(1), d)
    q = np.clip(np.rint((blocks - lo[:, :, None]) / d[:, :, None]), 0, 15)
    if not np.array_equal(q * d[:, :, None] + lo[:, :, None], blocks):
        return None
    zp = _zero_point_for(lo, d)
    codes = q.astype(np.uint8).reshape(n, k)
    return Int4Blocks(np.ascontiguousarray(codes), d.astype(np.float32), zp, block_size, False, own=True)


def _zero_point_for(m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The float32 zero point z nearest -m / d with ``-z * d == m`` in float32 where one of its neighbours has it
    (else -m / d itself: the block then reads back within one rounding of m)."""
    z0 = (-m / d).astype(np.float32)
    best = z0.copy()
    done = (-z0 * d) == m
    for step in (1, -1, 2, -2):
        z = z0
        for _ in range(abs(step)):
            z = np.nextafter(z, np.float32(np.inf if step > 0 else -np.inf)).astype(np.float32)
        ok = ~done & ((-z * d) == m)
        best = np.where(ok, z, best)
        done |= ok
    return best.astype(np.float32)


def quantize_int4(w: np.ndarray, block_size: int = DEFAULT_BLOCK, symmetric: bool = False) -> Int4Blocks:
    """w (K, N) float32 -> its 4-bit blocks (see the module docstring for the schemes; asymmetric: the checkpoint's
    own blocks when the weight holds them, :func:`own_blocks`, 8-bit ones included)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"block quantization takes a 2-D weight, got shape {w.shape}")
    block_size = check_block_size(block_size)
    k, n = w.shape
    kb = -(-k // block_size)
    if not symmetric:
        own = own_blocks(w, block_size)
        if own is not None:
            return own
    if symmetric:
        padded = np.zeros((kb * block_size, n), np.float32)
        padded[:k] = w
        blocks = padded.T.reshape(n, kb, block_size)
        scales = np.ascontiguousarray(np.abs(blocks).max(axis=2) / np.float32(7), dtype=np.float32)
        safe = np.where(scales > 0, scales, np.float32(1))
        q = np.clip(np.rint(blocks / safe[:, :, None]), -8, 7).astype(np.int16)
        codes = (q + 8).astype(np.uint8).reshape(n, -1)[:, :k]
        zps = np.full((n, kb), 8, np.uint8)
        return _positive(Int4Blocks(np.ascontiguousarray(codes), scales, zps, block_size, True))
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=False, quant_format=QuantFormat.QOperator)
    packed, scales, zp = DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(w)  # (N, kb, B/2), (N, kb), (N, ceil(kb/2))
    codes = _unpack_pairs(packed.reshape(n, -1), k)
    zps = _unpack_pairs(zp, kb)
    return _positive(Int4Blocks(np.ascontiguousarray(codes), np.ascontiguousarray(scales, np.float32),
                                np.ascontiguousarray(zps), block_size, False))


def _positive(b: Int4Blocks) -> Int4Blocks:
    """Scale 1 for the all-zero blocks (scale 0): their codes all equal the zero point, so they still read as 0."""
    zero = b.scales <= 0
    if not zero.any():
        return b
    c = b._padded_codes().reshape(b.codes.shape[0], b.k_blocks, b.block_size)
    if not np.all(c[zero] == b.zero_points[zero][:, None]):
        raise ValueError("a block with scale 0 holds codes other than its zero point")
    scales = np.where(zero, np.float32(1), b.scales).astype(np.float32)
    return Int4Blocks(b.codes, scales, b.zero_points, b.block_size, b.symmetric)


def to_fp16(w: np.ndarray) -> np.ndarray:
    """fp16 storage of a float32 weight: round to nearest even; a finite value beyond float16's range (65520 and
    up round to inf) raises BadModel rather than turning into inf."""
    from kvexport.errors import BadModel

    w = np.asarray(w, dtype=np.float32)
    with np.errstate(over="ignore"):
        h = w.astype(np.float16)
    if np.isinf(h).any() and not np.array_equal(np.isinf(h), np.isinf(w)):
        raise BadModel(f"a weight of magnitude {float(np.abs(w[np.isfinite(w)]).max()):.6g} does not fit float16 "
                       "(largest 65504); keep this model's weights fp32 or int4")
    return h


def fp16_round(w: np.ndarray) -> np.ndarray:
    """The values fp16 storage keeps, read back as float32 (exact)."""
    return to_fp16(w).astype(np.float32)
