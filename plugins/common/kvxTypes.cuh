// SPDX-License-Identifier: Apache-2.0
// Element types and conversions shared by the kvexport kernels (no TensorRT dependency).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace kvexport
{

//! Element type codes of the C interface (kvx_* functions); stable across versions.
enum class KvxDType : int32_t
{
    kFLOAT32 = 0,
    kFLOAT16 = 1,
    kBFLOAT16 = 2,
    kUINT8 = 3, //!< quantized cache codes (int8 / fp8 e4m3fn bytes, kvexport.cache.quant); TopKGather gathers them
};

inline int32_t dtypeSize(KvxDType t)
{
    return t == KvxDType::kFLOAT32 ? 4 : t == KvxDType::kUINT8 ? 1 : 2;
}

__device__ __forceinline__ float toFloat(float x)
{
    return x;
}
__device__ __forceinline__ float toFloat(__half x)
{
    return __half2float(x);
}
__device__ __forceinline__ float toFloat(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float x);
template <>
__device__ __forceinline__ float fromFloat<float>(float x)
{
    return x;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

//! Four consecutive elements as floats; p must be aligned to 4 elements.
__device__ __forceinline__ float4 load4(float const* p)
{
    return *reinterpret_cast<float4 const*>(p);
}
__device__ __forceinline__ float4 load4(__half const* p)
{
    uint2 const u = *reinterpret_cast<uint2 const*>(p);
    float2 const a = __half22float2(*reinterpret_cast<__half2 const*>(&u.x));
    float2 const b = __half22float2(*reinterpret_cast<__half2 const*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load4(__nv_bfloat16 const* p)
{
    uint2 const u = *reinterpret_cast<uint2 const*>(p);
    float2 const a = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&u.x));
    float2 const b = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

} // namespace kvexport
