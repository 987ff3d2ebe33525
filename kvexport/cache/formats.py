# SPDX-License-Identifier: Apache-2.0
"""Cache element formats (``--kv-dtype``): what one cached number is stored as, and which tensors a layer's cache
holds. Torch-free, so the host runtimes and the byte formula read it without importing torch; the quantization
arithmetic itself is :mod:`kvexport.cache.quant` (one implementation, run by the PyTorch cache and traced into the
graphs).

==========  =============================  ===================================================================
name        stored as                      per cached row (one token, one cache head, keys or values)
==========  =============================  ===================================================================
fp32        float32                        4 bytes per element
fp16        float16                        2 bytes per element
bf16        bfloat16                       2 bytes per element
int8        uint8 codes ``q + 128``        1 byte per element + one float16 scale; ``x ~ (code - 128) * scale``,
                                           q = round(x / scale) in [-127, 127], scale = absmax(row) / 127
fp8         uint8 bit patterns of          1 byte per element + one float16 scale; ``x ~ e4m3(code) * scale``,
            float8 e4m3fn                  scale = absmax(row) / 448 (e4m3's largest finite value)
==========  =============================  ===================================================================

Why uint8 codes for both (and not int8 / float8 tensors): the ONNX-TensorRT parser binds UINT8 network I/O and
casts UINT8 to float (its support matrix has no INT8 Cast; FP8 is not a network I/O type and float8 ONNX types need
opset 19, the exports are opset 18), and a per-token scale is not a DequantizeLinear scale before opset 21's blocked
quantization. A kernel gets the int8 value back by flipping the top bit (``code ^ 0x80``) and reads fp8 codes as
``__nv_fp8_e4m3`` bits.

A layer's cache tensors (:func:`layer_fields`): ``k``, ``v`` (codes or floats), ``pos`` (int64), and for the
quantized formats ``ks`` (B, Hc, cap) float16 (the keys' scales) and ``vs`` (the values', absent when the values
have no width: an MLA latent is all key).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvexport.errors import BadUsage

#: ``--kv-dtype`` names, in the order the CLI lists them
KV_DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8")
#: bytes of one scale (float16; one per row: per token, cache head and tensor)
SCALE_BYTES = 2


@dataclass(frozen=True)
class KVFormat:
    """One ``--kv-dtype``. ``code``: the LatentAttention / kernel ``latent_format`` (0 float, 1 int8, 2 fp8)."""

    name: str
    element_bytes: int
    numpy: str  # storage element type: "float32", "float16", "bfloat16", "uint8"
    quantized: bool
    qmax: float  # largest code magnitude a scale maps absmax(row) to (quantized formats), else 0
    code: int

    def scale_fields(self, value_dim: int) -> tuple[str, ...]:
        """The scale tensors of a layer: ``("ks", "vs")``, ``("ks",)`` (no value width) or ``()`` (float formats)."""
        if not self.quantized:
            return ()
        return ("ks", "vs") if value_dim > 0 else ("ks",)

    def row_bytes(self, width: int) -> int:
        """Bytes of one stored row of ``width`` elements, its scale included (0 for a width-0 row)."""
        if width == 0:
            return 0
        return width * self.element_bytes + (SCALE_BYTES if self.quantized else 0)


FORMATS = {
    "fp32": KVFormat("fp32", 4, "float32", False, 0.0, 0),
    "fp16": KVFormat("fp16", 2, "float16", False, 0.0, 0),
    "bf16": KVFormat("bf16", 2, "bfloat16", False, 0.0, 0),
    "int8": KVFormat("int8", 1, "uint8", True, 127.0, 1),
    "fp8": KVFormat("fp8", 1, "uint8", True, 448.0, 2),
}


#: every element-type name kvexport reads (``--dtype`` of the accounting, a manifest's dtype) -> its format's name
DTYPE_NAMES = {"float32": "fp32", "fp32": "fp32", "float16": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16",
               "int8": "int8", "fp8": "fp8"}


def element_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (any name of :data:`DTYPE_NAMES`)."""
    return FORMATS[DTYPE_NAMES[dtype]].element_bytes


def kv_format(name: str | KVFormat | None, default: str = "fp32") -> KVFormat:
    """A ``--kv-dtype`` name (None: ``default``, the model's dtype) -> its :class:`KVFormat`; one line if unknown."""
    if isinstance(name, KVFormat):
        return name
    key = default if name is None else str(name)
    if key not in FORMATS:
        raise BadUsage(f"--kv-dtype {key!r} unknown; accepted: {', '.join(KV_DTYPES)}")
    return FORMATS[key]


def storage_numpy(fmt: KVFormat):
    """The NumPy element type of a format's stored K/V (ml_dtypes' bfloat16 for bf16)."""
    if fmt.numpy == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    import numpy as np

    return np.dtype(fmt.numpy).type


def layer_fields(value_dim: int, fmt: KVFormat) -> tuple[str, ...]:
    """The cache tensors of one layer, in graph order: ``k``, ``v``, ``pos``, then the scales."""
    return ("k", "v", "pos", *fmt.scale_fields(value_dim))


__all__ = ["KV_DTYPES", "SCALE_BYTES", "KVFormat", "FORMATS", "DTYPE_NAMES", "element_bytes", "kv_format", "layer_fields",
           "storage_numpy"]
