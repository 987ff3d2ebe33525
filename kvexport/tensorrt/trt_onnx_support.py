# SPDX-License-Identifier: Apache-2.0
"""Data: which ONNX operators the ONNX-TensorRT parser imports, with which data types and under which restrictions.

Facts from onnx/onnx-tensorrt ``docs/operators.md`` (the "Operator Support Matrix"), rewritten in our own format:
one supported operator per line, ``Op: types [; rule ...]``. Operators the matrix marks unsupported (N) are simply
absent. Types: f32 f16 bf16 i32 i64 bool u8 i8 fp8 i4 fp4; ``F`` = f32 f16 bf16, ``FI`` = F i32 i64,
``FIB`` = FI bool. Rules (checked by :mod:`kvexport.tensorrt.op_support`):

- ``const:I``      input I must be an initializer or a Constant output (matrix: "must be an initializer")
- ``fold:I``       input I must be resolvable to a constant (constants and shape arithmetic on static shapes)
- ``attr:N=V``     attribute N must be V (the ONNX default counts when it is absent)
- ``noattr:N``     attribute N is not supported
- ``noin:I``       optional input I must be absent;  ``noout:I`` optional output I must be unused
- ``lt:I:V``       constant input I must be below V
- ``rank:I:R``     input I must have rank R;  ``itype:I:T`` input I must have type T
- ``pool``         1-3 spatial dims, dilations all ones. The matrix says "2D or 3D pooling only"; the importer
                   (importerUtils.cpp ``poolingHelper``, same tags) expands 1-D pooling to 2-D, so 1-D is accepted
- ``resize``       coordinate_transformation_mode, mode, nearest_mode, keep_aspect_ratio_policy, antialias as listed

Where the importer source contradicts the matrix text, the source wins and the line says so here:
- Clip: the matrix lists f32 f16 bf16; the importer (onnxOpImporters.cpp ``Clip``, 10.1-GA and later) routes i32 and
  i64 inputs to elementwise min/max, so ``FI``.
- pooling: see ``pool`` above.
"""

from __future__ import annotations

#: TensorRT 10.3 (JetPack 6, Orin). Source: onnx-tensorrt branch 10.1-GA docs/operators.md (commit 96e7811, the parser
#: TensorRT v10.1.0 pins), plus the parser changes its docs/Changelog.md lists for 10.2 and 10.3 (10.3: Slice takes
#: tensor axes; 10.2: GRU / Squeeze importer fixes only). The commit TensorRT v10.3.0 pins (62bdde2) was not readable
#: where this table was written.
TRT_10_3 = dict(
    source="onnx/onnx-tensorrt 10.1-GA docs/operators.md (96e7811) + docs/Changelog.md entries 10.2, 10.3",
    opset=(9, 20),
    table="""
Abs: FI
Acos: F
Acosh: F
Add: FI
And: bool
ArgMax: FI
ArgMin: FI
Asin: F
Asinh: F
Atan: F
Atanh: F
AveragePool: F; pool
BatchNormalization: F
Cast: FI u8 bool
CastLike: FI u8 bool
Ceil: F
Celu: F
Clip: FI
Concat: FIB
Constant: FIB; noattr:sparse_value noattr:value_string noattr:value_strings
ConstantOfShape: FIB
Conv: F
ConvTranspose: F
Cos: F
Cosh: F
CumSum: F; const:1
DeformConv: f32 f16
DepthToSpace: FI
DequantizeLinear: i8 fp8 i4
Div: FI
Dropout: F; const:2
Einsum: F
Elu: F
Equal: FI
Erf: F
Exp: F
Expand: FIB
EyeLike: FIB
Flatten: FIB
Floor: F
Gather: FIB
GatherElements: FIB
GatherND: FIB
Gelu: FI i8
Gemm: F
GlobalAveragePool: F
GlobalLpPool: F
GlobalMaxPool: F
Greater: FI
GreaterOrEqual: FI
GridSample: f32 f16; rank:0:4
GroupNormalization: F
GRU: F
HardSigmoid: F
HardSwish: F
Hardmax: F
Identity: FIB
If: FIB
ImageScaler: F
InstanceNormalization: F
IsInf: F
IsNaN: FI
LayerNormalization: F; noout:1 noout:2
LeakyRelu: F
Less: FI
LessOrEqual: FI
Log: F
LogSoftmax: F
Loop: FIB
LRN: F
LSTM: F; attr:input_forget=0 attr:layout=0
LpNormalization: F
LpPool: F; pool
MatMul: F
Max: FI
MaxPool: F; pool noout:1
Mean: FI fp8
MeanVarianceNormalization: F
Min: FI
Mish: f32 f16
Mod: FI
Mul: FI
Neg: FI
NonMaxSuppression: f32 f16
NonZero: f32 f16
Not: bool
OneHot: FIB; fold:1
Or: bool
Pad: FI; const:3
ParametricSoftplus: F
Pow: F
PRelu: F
QuantizeLinear: F
RandomNormal: F
RandomNormalLike: F
RandomUniform: F
RandomUniformLike: F
Range: FI
Reciprocal: F
ReduceL1: FI; const:1
ReduceL2: FI; const:1
ReduceLogSum: FI; const:1
ReduceLogSumExp: FI; const:1
ReduceMax: FI; const:1
ReduceMean: FI; const:1
ReduceMin: FI; const:1
ReduceProd: FI; const:1
ReduceSum: FI; const:1
ReduceSumSquare: FI; const:1
Relu: FI
Reshape: FIB
Resize: F; resize
ReverseSequence: FIB
RNN: F
RoiAlign: f32 f16
Round: F
ScaledTanh: F
Scan: F
Scatter: FI
ScatterElements: FI
ScatterND: FI; attr:reduction=none
Selu: F
Shape: FIB
Shrink: FI
Sigmoid: F
Sign: FI
Sin: F
Sinh: F
Size: FIB
Slice: FIB
Softmax: F
Softplus: F
Softsign: F
SpaceToDepth: FI
Split: FIB
Sqrt: F
Squeeze: FIB; const:1
Sub: FI
Sum: FI
Tan: F
Tanh: F
ThresholdedRelu: F
Tile: FIB
TopK: FI; attr:sorted=1 lt:1:3840
Transpose: FIB
Trilu: FIB
Unsqueeze: FIB; const:1
Upsample: F
Where: FIB
Xor: bool
""",
)

#: TensorRT 11.1 (newest tag). Source: onnx-tensorrt docs/operators.md at 7c51a63, the parser TensorRT v11.1 pins.
TRT_11_1 = dict(
    source="onnx/onnx-tensorrt docs/operators.md (7c51a63, pinned by TensorRT v11.1)",
    opset=(9, 24),
    table="""
Abs: FI
Acos: F
Acosh: F
Add: FI
And: bool
ArgMax: FI
ArgMin: FI
Asin: F
Asinh: F
Atan: F
Atanh: F
Attention: F i8 fp8; rank:0:4 rank:1:4 rank:2:4 noin:4 noin:5 noin:6 noout:1 noout:2 noout:3 noattr:qk_matmul_output_mode noattr:softcap
AveragePool: F; pool
BatchNormalization: F
BlackmanWindow: f32 f16
Cast: FI u8 bool
CastLike: FI u8 bool
Ceil: F
Celu: F
Clip: FI
Concat: FIB
Constant: FIB fp8 fp4 i4; noattr:sparse_value noattr:value_string noattr:value_strings
ConstantOfShape: FIB fp8 fp4 i4
Conv: F
ConvTranspose: F
Cos: F
Cosh: F
CumSum: F; fold:1
DeformConv: f32 f16
DepthToSpace: FI
DequantizeLinear: i8 fp8 fp4 i4
Div: FI
Dropout: F; const:2
Einsum: F
Elu: F
Equal: FI
Erf: F
Exp: F
Expand: FIB
EyeLike: FIB
Flatten: FIB
Floor: F
Gather: FIB
GatherElements: FIB
GatherND: FIB
Gelu: FI i8
Gemm: F
GlobalAveragePool: F
GlobalLpPool: F
GlobalMaxPool: F
Greater: FI
GreaterOrEqual: FI
GridSample: f32 f16; rank:0:4
GroupNormalization: F
GRU: F
HammingWindow: f32 f16
HannWindow: f32 f16
HardSigmoid: F
HardSwish: F
Hardmax: F
Identity: FIB
If: FIB
ImageScaler: F
InstanceNormalization: F
IsInf: F
IsNaN: FI
LayerNormalization: F; noout:1 noout:2
LeakyRelu: F
Less: FI
LessOrEqual: FI
Log: F
LogSoftmax: F
Loop: FIB
LRN: F
LSTM: F; attr:input_forget=0 attr:layout=0
LpNormalization: F
LpPool: F; pool
MatMul: F
Max: FI
MaxPool: F; pool noout:1
Mean: FI fp8
MeanVarianceNormalization: F
Min: FI
Mish: f32 f16
Mod: FI
Mul: FI
Neg: FI
NonMaxSuppression: f32 f16
NonZero: f32 f16
Not: bool
OneHot: FIB; fold:1
Or: bool
Pad: FI
ParametricSoftplus: F
Pow: FI
PRelu: F
QuantizeLinear: F
RandomNormal: F
RandomNormalLike: F
RandomUniform: F
RandomUniformLike: F
Range: FI
Reciprocal: F
ReduceL1: FI; const:1
ReduceL2: FI; const:1
ReduceLogSum: FI; const:1
ReduceLogSumExp: FI; const:1
ReduceMax: FI; const:1
ReduceMean: FI; const:1
ReduceMin: FI; const:1
ReduceProd: FI; const:1
ReduceSum: FI; const:1
ReduceSumSquare: FI; const:1
Relu: FI
Reshape: FIB
Resize: F; resize
ReverseSequence: FIB
RMSNormalization: F
RNN: F
RoiAlign: f32 f16
RotaryEmbedding: F; itype:3:i64
Round: F
STFT: f32; const:1 const:2
ScaledTanh: F
Scan: F
Scatter: FI
ScatterElements: FI
ScatterND: FI; attr:reduction=none
Selu: F
Shape: FIB
Shrink: FI
Sigmoid: F
Sign: FI
Sin: F
Sinh: F
Size: FIB
Slice: FIB
Softmax: F
Softplus: F
Softsign: F
SpaceToDepth: FI
Split: FIB
Sqrt: F
Squeeze: FIB; fold:1
Sub: FI
Sum: FI
Swish: F
Tan: F
Tanh: F
TensorScatter: F i32; rank:0:4 rank:1:4 attr:axis=-2
ThresholdedRelu: F
Tile: FIB
TopK: FI; attr:sorted=1 lt:1:3840
Transpose: FIB
Trilu: FIB
Unsqueeze: FIB; fold:1
Upsample: F
Where: FIB
Xor: bool
""",
)

#: TensorRT version -> support data; the first is the oldest release kvexport targets, the last the newest tag.
MATRICES = {"10.3": TRT_10_3, "11.1": TRT_11_1}
