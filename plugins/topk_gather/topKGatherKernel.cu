// SPDX-License-Identifier: Apache-2.0
// TopKGather kernel: one block per (batch, head) sorts packed (score, slot) keys with a bitonic network in shared
// memory, keeps the first k, sorts their slot indices ascending with the same network, and gathers rows.
//
// Key packing: high 32 bits = order-preserving bits of the float score (masked slots = -inf), low 32 bits =
// 0xFFFFFFFF - slot. Sorting the 64-bit keys descending orders by score descending and, on equal scores, by slot
// ascending: exactly ONNX TopK's tie rule and kvexport.cache.static_cache.select_kept (a stable descending sort).
// Padding keys are 0 and sort after every real key (including -inf ones).
#include "topKGatherKernel.h"

#include "../common/kvxTypes.cuh"

#include <cmath>

namespace kvexport
{
namespace
{

constexpr int32_t kThreads = 512;

__device__ __forceinline__ uint32_t orderedBits(float s)
{
    if (isnan(s))
    {
        s = __uint_as_float(0x7FC00000u); // canonical NaN sorts above +inf, as torch.sort(descending=True) does
    }
    if (s == 0.0F)
    {
        s = 0.0F; // -0 ties with +0
    }
    uint32_t const u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

//! Sorts keys[0, n) descending; n a power of two; every thread of the block calls it.
__device__ void bitonicSortDescending(unsigned long long* keys, int32_t n)
{
    for (int32_t size = 2; size <= n; size <<= 1)
    {
        for (int32_t stride = size >> 1; stride > 0; stride >>= 1)
        {
            for (int32_t i = threadIdx.x; i < n; i += blockDim.x)
            {
                int32_t const j = i ^ stride;
                if (j > i)
                {
                    unsigned long long const a = keys[i];
                    unsigned long long const b = keys[j];
                    bool const descending = (i & size) == 0;
                    if (descending ? (a < b) : (a > b))
                    {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

__host__ __device__ inline int32_t nextPow2(int32_t x)
{
    int32_t n = 1;
    while (n < x)
    {
        n <<= 1;
    }
    return n;
}

//! Copies `rows` rows of `dim` elements picked by slot index; one warp per row.
template <typename E>
__device__ void gatherRows(E const* __restrict__ src, E* __restrict__ dst, unsigned long long const* keys,
    int32_t rows, int32_t dim)
{
    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;
    int32_t const nWarps = blockDim.x / 32;
    for (int32_t r = warp; r < rows; r += nWarps)
    {
        uint32_t const slot = 0xFFFFFFFFu - static_cast<uint32_t>(keys[r]);
        E const* s = src + static_cast<int64_t>(slot) * dim;
        E* d = dst + static_cast<int64_t>(r) * dim;
        for (int32_t c = lane; c < dim; c += 32)
        {
            d[c] = s[c];
        }
    }
}

template <typename S, typename E>
__global__ void __launch_bounds__(kThreads) topKGatherKernel(S const* __restrict__ scores, E const* __restrict__ keys,
    E const* __restrict__ values, int64_t const* __restrict__ positions, int32_t slots, int32_t keyDim,
    int32_t valueDim, int32_t k, int32_t n, E* __restrict__ keptKeys, E* __restrict__ keptValues,
    int64_t* __restrict__ keptPositions, int64_t* __restrict__ keptIndices)
{
    extern __shared__ unsigned long long sortKeys[]; // (n,)
    int64_t const bh = blockIdx.x;                   // b * H + h
    S const* sc = scores + bh * slots;
    int64_t const* pos = positions + bh * slots;

    for (int32_t i = threadIdx.x; i < n; i += blockDim.x)
    {
        unsigned long long key = 0ULL;
        if (i < slots)
        {
            float const s = pos[i] < 0 ? -INFINITY : toFloat(sc[i]);
            key = (static_cast<unsigned long long>(orderedBits(s)) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
        }
        sortKeys[i] = key;
    }
    __syncthreads();
    bitonicSortDescending(sortKeys, n);

    // the k chosen slots, ascending: key = 0xFFFFFFFF - slot (low half), sorted descending
    int32_t const m = nextPow2(k);
    for (int32_t i = threadIdx.x; i < m; i += blockDim.x)
    {
        sortKeys[i] = i < k ? (sortKeys[i] & 0xFFFFFFFFULL) : 0ULL;
    }
    __syncthreads();
    bitonicSortDescending(sortKeys, m);

    for (int32_t r = threadIdx.x; r < k; r += blockDim.x)
    {
        uint32_t const slot = 0xFFFFFFFFu - static_cast<uint32_t>(sortKeys[r]);
        keptIndices[bh * k + r] = slot;
        keptPositions[bh * k + r] = pos[slot];
    }
    gatherRows(keys + bh * slots * keyDim, keptKeys + bh * k * keyDim, sortKeys, k, keyDim);
    if (valueDim > 0)
    {
        gatherRows(values + bh * slots * valueDim, keptValues + bh * k * valueDim, sortKeys, k, valueDim);
    }
}

template <typename S, typename E>
cudaError_t launchTyped(TopKGatherParams const& p, cudaStream_t stream)
{
    int32_t const n = nextPow2(p.slots);
    size_t const smem = static_cast<size_t>(n) * sizeof(unsigned long long);
    auto kernel = topKGatherKernel<S, E>;
    if (smem > 48 * 1024)
    {
        cudaError_t const e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (e != cudaSuccess)
        {
            return e;
        }
    }
    int64_t const blocks = static_cast<int64_t>(p.batch) * p.heads;
    kernel<<<static_cast<unsigned int>(blocks), kThreads, smem, stream>>>(static_cast<S const*>(p.scores),
        static_cast<E const*>(p.keys), static_cast<E const*>(p.values), p.positions, p.slots, p.keyDim, p.valueDim,
        p.k, n, static_cast<E*>(p.keptKeys), static_cast<E*>(p.keptValues), p.keptPositions, p.keptIndices);
    return cudaGetLastError();
}

template <typename S>
cudaError_t launchScore(TopKGatherParams const& p, cudaStream_t stream)
{
    if (dtypeSize(static_cast<KvxDType>(p.dataType)) == 4)
    {
        return launchTyped<S, float>(p, stream);
    }
    return launchTyped<S, uint16_t>(p, stream);
}

bool validDType(int32_t t)
{
    return t >= 0 && t <= 2;
}

} // namespace

cudaError_t launchTopKGather(TopKGatherParams const& p, cudaStream_t stream)
{
    if (!validDType(p.scoreType) || !validDType(p.dataType) || p.batch < 0 || p.heads < 0 || p.slots < 1
        || p.slots > kTopKGatherMaxSlots || p.k < 1 || p.k > p.slots || p.keyDim < 0 || p.valueDim < 0)
    {
        return cudaErrorInvalidValue;
    }
    if (p.batch == 0 || p.heads == 0)
    {
        return cudaSuccess;
    }
    switch (static_cast<KvxDType>(p.scoreType))
    {
    case KvxDType::kFLOAT32: return launchScore<float>(p, stream);
    case KvxDType::kFLOAT16: return launchScore<__half>(p, stream);
    case KvxDType::kBFLOAT16: return launchScore<__nv_bfloat16>(p, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace kvexport

extern "C" KVX_API int32_t kvx_topk_gather(int32_t scoreType, int32_t dataType, void const* scores, void const* keys,
    void const* values, int64_t const* positions, int32_t batch, int32_t heads, int32_t slots, int32_t keyDim,
    int32_t valueDim, int32_t k, void* keptKeys, void* keptValues, int64_t* keptPositions, int64_t* keptIndices,
    cudaStream_t stream)
{
    kvexport::TopKGatherParams p{scoreType, dataType, scores, keys, values, positions, batch, heads, slots, keyDim,
        valueDim, k, keptKeys, keptValues, keptPositions, keptIndices};
    return static_cast<int32_t>(kvexport::launchTopKGather(p, stream));
}

extern "C" KVX_API int32_t kvx_topk_gather_max_slots()
{
    return kvexport::kTopKGatherMaxSlots;
}
