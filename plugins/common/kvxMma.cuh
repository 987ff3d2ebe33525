// SPDX-License-Identifier: Apache-2.0
// Tensor-core and asynchronous-copy primitives of the kernels (sm_80 and newer: A100, A10/L4/L40, Orin, H100/H200,
// Thor): warp-wide mma.sync m16n8k16 with float accumulators, ldmatrix fragment loads from shared memory, and
// cp.async global->shared copies (with zero fill) in commit groups. Fragment layouts are the PTX ISA's
// ("Matrix fragments for mma.m16n8k16"): groupID g = lane / 4, t = lane % 4;
//   A (16x16, row major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8, column major): b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C/D (16x8 float): c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// Under the CPU shim (tests/plugins/cpu_shim) these functions are replaced by a scalar emulation of exactly these
// layouts, so the kernels' indexing runs and is checked without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#if defined(KVX_CPU_SHIM)
#include "kvx_cpu_mma.h"
#else

namespace kvexport
{

//! d += a * b, f16 inputs, f32 accumulators (one warp, all lanes).
__device__ __forceinline__ void mmaF16(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

//! d += a * b, bf16 inputs, f32 accumulators (one warp, all lanes).
__device__ __forceinline__ void mmaBf16(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ uint32_t sharedAddress(void const* p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

//! Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses (16-byte aligned) of matrix i; r[i] = its row
//! lane / 4, elements 2 (lane % 4) and 2 (lane % 4) + 1.
__device__ __forceinline__ void ldmatrixX4(uint32_t (&r)[4], void const* row)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sharedAddress(row)));
#endif
}

//! As ldmatrixX4, transposed: r[i] = matrix i's rows 2 (lane % 4) and 2 (lane % 4) + 1, element lane / 4.
__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&r)[4], void const* row)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sharedAddress(row)));
#endif
}

//! Asynchronous copy of BYTES (4, 8 or 16) bytes; only the first srcBytes are read, the rest is zero-filled.
template <int BYTES>
__device__ __forceinline__ void cpAsync(void* smem, void const* gmem, int srcBytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (BYTES == 16)
    {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sharedAddress(smem)), "l"(gmem),
            "r"(srcBytes));
    }
    else
    {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(sharedAddress(smem)), "l"(gmem),
            "n"(BYTES), "r"(srcBytes));
    }
#endif
}

__device__ __forceinline__ void cpAsyncCommit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

//! Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cpAsyncWait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

} // namespace kvexport

#endif // KVX_CPU_SHIM
