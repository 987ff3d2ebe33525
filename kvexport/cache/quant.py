# SPDX-License-Identifier: Apache-2.0
"""How a cached row is quantized and read back: the one implementation (formats: :mod:`kvexport.cache.formats`).

The PyTorch cache (:mod:`kvexport.cache.static_cache`) runs these functions eagerly and the graph builders
(:mod:`kvexport.export.graphs`) trace them into ONNX, so both write the same codes and read the same values; the
host runtimes only copy what the graphs return. Written with torch ops that map one-to-one onto opset-18 ONNX
operators the TensorRT parser imports (Abs, ReduceMax, Div, Clip, Round, Cast to/from uint8 and float16,
GreaterOrEqual, ReduceSum, Gather, Mul), each exact in IEEE float32, so eager PyTorch and onnxruntime agree to the
bit given the same input row.

Scale (per row: one token, one cache head, keys or values separately)::

    scale = float16(clip(absmax(row) / qmax, 2^-14, 65504))       qmax = 127 (int8) or 448 (fp8)

int8: ``code = clip(round(x / scale), -127, 127) + 128`` (round half to even), ``x' = (code - 128) * scale``;
error ``|x - x'| <= scale / 2`` (the fp16 rounding of the scale can put ``x / scale`` up to 127.06: it rounds to
127, within the bound).

fp8 (float8 e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits, largest finite 448, no infinities):
with ``y = min(|x| / scale, 448)`` and ``e = clip(floor(log2 y), -6, 8)`` (counted against the powers of two, exact),
``code = 8 (e + 6) + round(y * 2^(3 - e))`` plus 128 for negative x: round to nearest even on the 3-bit mantissa,
subnormals below 2^-6, a carry into the next binade, saturation at 448, all in one formula; it equals torch's
``float8_e4m3fn`` cast of ``x / scale`` (tests/cache/test_quantized.py), except that -0 is stored as +0.
Relative error <= 2^-4 above ``2^-6 * scale``, absolute error <= ``2^-10 * scale`` below.

The floor 2^-14 keeps every scale a normal float16 (an all-zero row gets codes of value 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvexport.cache.formats import KVFormat

SCALE_MIN = 2.0**-14
SCALE_MAX = 65504.0
#: the fp8 binade thresholds 2^-5 ... 2^8: y >= threshold k  <=>  floor(log2 y) >= k - 6 (for y >= 2^-6)
_FP8_BINADES = torch.tensor([2.0**k for k in range(-5, 9)], dtype=torch.float32)
#: 2^(3 - e) for e = -6 ... 8, indexed by the number of thresholds y reaches
_FP8_STEPS = torch.tensor([2.0 ** (9 - c) for c in range(15)], dtype=torch.float32)


def _fp8_values() -> torch.Tensor:
    """(256,) float32: the value of every e4m3fn bit pattern (0x7F / 0xFF are NaN, never produced)."""
    out = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v = float("nan")
        elif e == 0:
            v = m / 8 * 2.0**-6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        out.append(-v if s else v)
    return torch.tensor(out, dtype=torch.float32)


FP8_VALUES = _fp8_values()


def _storage(fmt: KVFormat) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "uint8": torch.uint8}[fmt.numpy]


def storage_dtype(fmt: KVFormat) -> torch.dtype:
    """The torch element type a cache tensor of ``fmt`` holds."""
    return _storage(fmt)


def row_scale(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x (..., D), D >= 1 -> the rows' scales (...) float16."""
    a = x.float().abs().amax(-1)
    return (a / fmt.qmax).clamp(SCALE_MIN, SCALE_MAX).to(torch.float16)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float, D >= 1 -> codes (..., D) uint8, scale (...) float16 (module docstring)."""
    scale = row_scale(x, fmt)
    y = x.float() / scale.float()[..., None]
    if fmt.name == "int8":
        return (torch.round(y).clamp(-127.0, 127.0) + 128.0).to(torch.uint8), scale
    a = y.abs().clamp(max=448.0)
    count = (a[..., None] >= _FP8_BINADES.to(a.device)).sum(-1)  # e + 6, in [0, 14]
    code = count.float() * 8.0 + torch.round(a * _FP8_STEPS.to(a.device)[count])
    code = code + (y < 0).float() * 128.0
    return code.to(torch.uint8), scale


def shifted(codes: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, float]:
    """codes (..., D) uint8 -> (x float32, shift) with ``x - shift`` the values before their row's scale: int8's codes
    as they are and their offset 128 (a product with them can take the offset off its result, once per row of the
    result instead of once per code: ``q . (c - 128) = q . c - 128 sum(q)``), fp8's e4m3 values and 0."""
    if fmt.name == "int8":
        return codes.float(), 128.0
    return FP8_VALUES.to(codes.device)[codes.float().long()], 0.0  # via float: TensorRT casts UINT8 to f32 / f16 only


def unscaled(codes: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """codes (..., D) uint8 -> the values before their row's scale, float32 (exact: integers -127..127 for int8, the
    e4m3 values for fp8)."""
    x, shift = shifted(codes, fmt)
    return x - shift if shift else x


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D) uint8, scale (...) float16 -> values (..., D) in ``dtype`` (computed in float32)."""
    return (unscaled(codes, fmt) * scale.float()[..., None]).to(dtype)


def encode(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows as a cache of ``fmt`` stores them: x (..., D) -> (stored (..., D), scale (...) float16 or None).

    Float formats convert; quantized ones return codes and scales (a width-0 row has no scale)."""
    if not fmt.quantized:
        return x.to(_storage(fmt)), None
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape, dtype=torch.uint8), None
    return quantize(x, fmt)


def decode(stored: torch.Tensor, scale: torch.Tensor | None, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """What :func:`encode` stored, read back as ``dtype`` (B, ..., D)."""
    if not fmt.quantized:
        return stored.to(dtype)
    if stored.shape[-1] == 0:
        return stored.new_zeros(stored.shape, dtype=dtype)
    return dequantize(stored, scale, fmt, dtype)


def read_rows(k, v, ks, vs, fmt: KVFormat, dtype: torch.dtype, keys_as_codes: bool = False,
              values_as_codes: bool = False) -> tuple:
    """Stored rows -> what an attention module reads (the one rule of the PyTorch cache and the graphs): keys and
    values in ``dtype`` (the tensors themselves when stored in it, a converted copy for a lossy format), except
    that a quantized format is handed as :class:`QuantizedRows` to a module that reads codes itself:
    ``keys_as_codes`` (its ``reads_quantized``), ``values_as_codes`` (its ``reads_quantized_values``)."""
    if fmt.quantized:
        return (QuantizedRows(k, ks, fmt) if keys_as_codes else decode(k, ks, fmt, dtype),
                QuantizedRows(v, vs, fmt) if values_as_codes else decode(v, vs, fmt, dtype))
    return decode(k, ks, fmt, dtype), decode(v, vs, fmt, dtype)


@dataclass
class QuantizedRows:
    """A quantized cache view handed to an attention module that reads codes itself (``reads_quantized = True``:
    MLA's LatentAttention dequantizes in its kernel's load path; GQA attention multiplies a decode step's logits
    and probabilities by the rows' scales instead of every key and value, :func:`kvexport.models.attention.attention`).
    codes (B, Hc, S, D) uint8, scale (B, Hc, S) float16; :meth:`dequantize` gives what every other module is handed
    instead."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: KVFormat

    @property
    def format_code(self) -> int:
        """LatentAttention's ``latent_format`` attribute: 1 int8, 2 fp8."""
        return self.fmt.code

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.fmt, dtype)

    def shifted(self) -> tuple[torch.Tensor, float]:
        """(x float32 (B, Hc, S, D), shift): ``(x - shift) * scale`` is :meth:`dequantize` (:func:`shifted`)."""
        return shifted(self.codes, self.fmt)


__all__ = ["SCALE_MIN", "SCALE_MAX", "FP8_VALUES", "storage_dtype", "row_scale", "quantize", "shifted", "unscaled", "dequantize",
           "encode", "decode", "read_rows", "QuantizedRows"]
