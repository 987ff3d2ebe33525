// SPDX-License-Identifier: Apache-2.0
// CPU shim emulation of plugins/common/kvxMma.cuh: the same functions, same fragment layouts (PTX ISA, mma.m16n8k16
// and ldmatrix), computed with scalar code over a warp rendezvous. cp.async copies are queued and performed when a
// wait retires their group (kvx_cpu_shim.cpp), so reading a destination too early sees stale shared memory.
#pragma once

#include "cuda_bf16.h"
#include "kvx_cpu_shim.h"

#include <cstdint>

namespace kvxshim
{
struct MmaOperands
{
    uint32_t a[4];
    uint32_t b[2];
};

inline float b16ToFloat(uint16_t h, bool bf16)
{
    return bf16 ? __uint_as_float(static_cast<uint32_t>(h) << 16) : halfBitsToFloat(h);
}

inline void mma16816(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2], bool bf16)
{
    MmaOperands mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
    int const lane = self().lane;
    int const g = lane >> 2;
    int const t = lane & 3;
    float out[4] = {d[0], d[1], d[2], d[3]};
    warpCollective(0xFFFFFFFFu, mine, bf16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", [&](auto all) {
        auto A = [&](int row, int k) {
            uint32_t const w = all[(row & 7) * 4 + ((k & 7) >> 1)].a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
            return b16ToFloat(static_cast<uint16_t>((k & 1) ? (w >> 16) : (w & 0xFFFFu)), bf16);
        };
        auto B = [&](int k, int n) {
            uint32_t const w = all[n * 4 + ((k & 7) >> 1)].b[k >= 8 ? 1 : 0];
            return b16ToFloat(static_cast<uint16_t>((k & 1) ? (w >> 16) : (w & 0xFFFFu)), bf16);
        };
        for (int i = 0; i < 4; ++i)
        {
            int const row = g + (i >= 2 ? 8 : 0);
            int const col = 2 * t + (i & 1);
            float acc = out[i];
            for (int k = 0; k < 16; ++k)
            {
                acc = fmaf(A(row, k), B(k, col), acc);
            }
            out[i] = acc;
        }
    });
    for (int i = 0; i < 4; ++i)
    {
        d[i] = out[i];
    }
}

inline void ldmatrix(uint32_t (&r)[4], void const* row, bool trans)
{
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0 || !inShared(row, 16))
    {
        fatal("ldmatrix row address %p is not a 16-byte aligned shared-memory row", row);
    }
    int const lane = self().lane;
    unsigned char const* mine = static_cast<unsigned char const*>(row);
    uint32_t out[4];
    warpCollective(0xFFFFFFFFu, mine, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", [&](auto all) {
        for (int i = 0; i < 4; ++i)
        {
            if (!trans)
            {
                std::memcpy(&out[i], all[i * 8 + lane / 4] + (lane % 4) * 4, 4);
            }
            else
            {
                uint16_t lo;
                uint16_t hi;
                std::memcpy(&lo, all[i * 8 + (lane % 4) * 2] + (lane / 4) * 2, 2);
                std::memcpy(&hi, all[i * 8 + (lane % 4) * 2 + 1] + (lane / 4) * 2, 2);
                out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
            }
        }
    });
    for (int i = 0; i < 4; ++i)
    {
        r[i] = out[i];
    }
}
} // namespace kvxshim

namespace kvexport
{
inline void mmaF16(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
    kvxshim::mma16816(d, a, b, false);
}
inline void mmaBf16(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
    kvxshim::mma16816(d, a, b, true);
}
inline void ldmatrixX4(uint32_t (&r)[4], void const* row)
{
    kvxshim::ldmatrix(r, row, false);
}
inline void ldmatrixX4Trans(uint32_t (&r)[4], void const* row)
{
    kvxshim::ldmatrix(r, row, true);
}
template <int BYTES>
inline void cpAsync(void* smem, void const* gmem, int srcBytes)
{
    kvxshim::cpAsyncIssue(smem, gmem, BYTES, srcBytes);
}
inline void cpAsyncCommit()
{
    kvxshim::cpAsyncCommit();
}
template <int N>
inline void cpAsyncWait()
{
    kvxshim::cpAsyncWait(N);
}
} // namespace kvexport
