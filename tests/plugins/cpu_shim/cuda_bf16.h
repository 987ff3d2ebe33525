// SPDX-License-Identifier: Apache-2.0
// CPU shim stand-in for <cuda_bf16.h>: bfloat16 storage and the conversions the kernels use (round to nearest even).
#pragma once
#include "cuda_fp16.h"

struct alignas(2) __nv_bfloat16
{
    unsigned short __x;
};
struct alignas(4) __nv_bfloat162
{
    __nv_bfloat16 x, y;
};

namespace kvxshim
{
inline unsigned short floatToBf16Bits(float f)
{
    unsigned int const x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
    {
        return static_cast<unsigned short>(((x >> 16) & 0x8000u) | 0x7FFFu);
    }
    return static_cast<unsigned short>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
} // namespace kvxshim

inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    return __nv_bfloat16{kvxshim::floatToBf16Bits(f)};
}
inline __nv_bfloat16 __float2bfloat16(float f)
{
    return __float2bfloat16_rn(f);
}
inline float __bfloat162float(__nv_bfloat16 h)
{
    return __uint_as_float(static_cast<unsigned int>(h.__x) << 16);
}
inline float2 __bfloat1622float2(__nv_bfloat162 h)
{
    return make_float2(__bfloat162float(h.x), __bfloat162float(h.y));
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b)
{
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f)
{
    return __floats2bfloat162_rn(f.x, f.y);
}
