# SPDX-License-Identifier: Apache-2.0
"""Would TensorRT's ONNX parser take an ``int4-qdq`` graph's weights? A structural check that needs no TensorRT.

:func:`kvexport.tensorrt.op_support.check_model` checks operators and types against the parser's support matrix;
this adds what the parser's DequantizeLinear importer asserts about the values (onnx-tensorrt
``QuantDequantLinearHelper``, 10.1-GA and later; the 10.15 / 11.1 operator tables: "DequantizeLinear INT8, FP8,
FP4, INT4: ``x_zero_point`` must be zero") and what weight-only INT4 needs to be a weight:

- the quantized input is a constant INT4 tensor whose last dimension is even (INT4 is packed two a byte);
- the scale is a constant float tensor of the input's rank, every coefficient > 0;
- exactly one axis is blocked and the block is a whole number of elements (the parser infers it from the shapes:
  input extent / scale extent);
- the zero point, if any, is all zeros;
- the output feeds a MatMul as its second input (a weight, not an activation: activations take per-tensor scales).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def int4_dq_problems(path: str | Path) -> list[str]:
    """Every DequantizeLinear over an INT4 initializer in the graph at ``path`` (external weights beside it) ->
    the rules above it breaks, one line each (empty: all hold)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path), load_external_data=True)
    inits = {t.name: t for t in m.graph.initializer}
    consumers: dict[str, list] = {}
    for n in m.graph.node:
        for i, x in enumerate(n.input):
            consumers.setdefault(x, []).append((n, i))
    bad = []
    for n in m.graph.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in inits:
            continue
        x = inits[n.input[0]]
        if x.data_type != onnx.TensorProto.INT4:
            continue
        where = f"{Path(path).name}: {n.name or n.output[0]}"
        dims = list(x.dims)
        if dims[-1] % 2:
            bad.append(f"{where}: INT4 input with an odd last dimension {dims[-1]}")
        s = inits.get(n.input[1])
        if s is None:
            bad.append(f"{where}: the scale is not a constant")
            continue
        scale = numpy_helper.to_array(s)
        if s.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            bad.append(f"{where}: scale of ONNX type {s.data_type}, not float")
        if not np.all(scale.astype(np.float32) > 0):
            bad.append(f"{where}: scale coefficients must all be positive")
        if scale.ndim != len(dims):
            bad.append(f"{where}: scale rank {scale.ndim} is not the input's {len(dims)} (blocked quantization)")
        else:
            blocked = [d // e for d, e in zip(dims, scale.shape, strict=True) if e and d // e != 1]
            if len(blocked) != 1 or int(np.prod(dims)) % max(scale.size, 1):
                bad.append(f"{where}: scale {list(scale.shape)} over input {dims} is not one blocked axis")
        if len(n.input) > 2 and n.input[2]:
            z = inits.get(n.input[2])
            if z is None or np.any(numpy_helper.to_array(z) != 0):
                bad.append(f"{where}: the zero point must be a constant of zeros (TensorRT is symmetric)")
        uses = consumers.get(n.output[0], [])
        if not uses or any(c.op_type not in ("MatMul", "Gemm") or i != 1 for c, i in uses):
            bad.append(f"{where}: the dequantized weight must feed MatMul / Gemm input B only")
    return bad
