// SPDX-License-Identifier: Apache-2.0
// CPU shim stand-in for <cuda_fp16.h>: IEEE binary16 storage and the conversions the kernels use (round to nearest
// even, as __float2half_rn).
#pragma once
#include "kvx_cpu_shim.h"

struct alignas(2) __half
{
    unsigned short __x;
};
struct alignas(4) __half2
{
    __half x, y;
};

namespace kvxshim
{
inline unsigned short floatToHalfBits(float f)
{
    unsigned int const x = __float_as_uint(f);
    unsigned int const sign = (x >> 16) & 0x8000u;
    unsigned int const a = x & 0x7FFFFFFFu;
    if (a >= 0x7F800000u)
    {
        return static_cast<unsigned short>(sign | (a > 0x7F800000u ? 0x7FFFu : 0x7C00u));
    }
    if (a >= 0x477FF000u) // >= 65520 rounds to infinity
    {
        return static_cast<unsigned short>(sign | 0x7C00u);
    }
    if (a < 0x38800000u) // below 2^-14: subnormal half (or zero), in units of 2^-24
    {
        unsigned int const m = static_cast<unsigned int>(nearbyintf(__uint_as_float(a) * 16777216.0F));
        return static_cast<unsigned short>(sign | m);
    }
    unsigned int h = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3FFu);
    unsigned int const rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
    {
        ++h;
    }
    return static_cast<unsigned short>(sign | h);
}

inline float halfBitsToFloat(unsigned short h)
{
    unsigned int const sign = (static_cast<unsigned int>(h) & 0x8000u) << 16;
    unsigned int const e = (h >> 10) & 0x1Fu;
    unsigned int const m = h & 0x3FFu;
    if (e == 0)
    {
        float const v = static_cast<float>(m) * (1.0F / 16777216.0F);
        return sign ? -v : v;
    }
    if (e == 31)
    {
        return __uint_as_float(sign | 0x7F800000u | (m << 13));
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
} // namespace kvxshim

inline __half __float2half_rn(float f)
{
    return __half{kvxshim::floatToHalfBits(f)};
}
inline __half __float2half(float f)
{
    return __float2half_rn(f);
}
inline float __half2float(__half h)
{
    return kvxshim::halfBitsToFloat(h.__x);
}
inline float2 __half22float2(__half2 h)
{
    return make_float2(__half2float(h.x), __half2float(h.y));
}
inline __half2 __floats2half2_rn(float a, float b)
{
    return __half2{__float2half_rn(a), __float2half_rn(b)};
}
inline __half2 __float22half2_rn(float2 f)
{
    return __floats2half2_rn(f.x, f.y);
}
inline float __low2float(__half2 h)
{
    return __half2float(h.x);
}
inline float __high2float(__half2 h)
{
    return __half2float(h.y);
}
