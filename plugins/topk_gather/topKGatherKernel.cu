// SPDX-License-Identifier: Apache-2.0
// TopKGather kernels: exact top-k by radix select over 32-bit sort keys with several blocks per (batch, head) row,
// then an order-preserving compaction and the row gather. No sort of the whole row and no limit on S.
//
// Sort key of slot j: the order-preserving bits of s_j, where s_j = -inf for an empty slot (position < 0), NaN is
// made canonical (above +inf, as torch.sort(descending=True)) and -0 equals +0. The k largest keys are kept, ties
// (equal keys) to the lower slot index: ONNX TopK's rule and kvexport.cache.static_cache.select_kept's.
//
//  1. topkKeysKernel, one block per chunk of 1024 slots of a row: writes the keys and the histogram of digit 0
//     (key bits 31..24) with shared-memory then global atomics.
//  2. topkHistKernel<PASS> (passes 1..3): each block re-derives the digits chosen so far from the finished
//     histograms (a 256-bin suffix scan per pass, one warp), then histograms the next digit of the keys that match.
//  3. topkCountKernel: the four digits give the threshold key v and how many keys equal to v to keep; counts the keys
//     above v and equal to v in each chunk.
//  4. topkWriteKernel: each chunk sums its predecessors' counts, ranks its kept slots with two block scans (ties taken
//     in slot order), writes kept_indices / kept_positions in ascending slot order and copies their rows.
#include "topKGatherKernel.h"

#include "../common/kvxTypes.cuh"

#include <cmath>

namespace kvexport
{
namespace
{

constexpr int32_t kThreads = 256;
constexpr int32_t kItems = kTopKGatherChunk / kThreads;
constexpr int32_t kWarps = kThreads / 32;
constexpr int32_t kBins = 256;
constexpr int32_t kPasses = 4;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

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

inline size_t alignUp(size_t bytes)
{
    return (bytes + 255) / 256 * 256;
}

inline int64_t chunksOf(int64_t slots)
{
    return (slots + kTopKGatherChunk - 1) / kTopKGatherChunk;
}

//! Workspace layout in bytes: keys (rows, S) uint32, histograms (rows, 4, 256) uint32, counts (rows, chunks) uint2.
struct WorkspaceLayout
{
    size_t keys, hist, counts, total;
};

WorkspaceLayout workspaceLayout(int64_t rows, int64_t slots)
{
    WorkspaceLayout w{};
    size_t off = 0;
    w.keys = off;
    off += alignUp(sizeof(uint32_t) * rows * slots);
    w.hist = off;
    off += alignUp(sizeof(uint32_t) * rows * kPasses * kBins);
    w.counts = off;
    off += alignUp(sizeof(uint2) * rows * chunksOf(slots));
    w.total = off;
    return w;
}

//! The digits chosen so far (high bits of the threshold key) and how many keys matching them must still be taken.
struct Selection
{
    uint32_t prefix;
    uint32_t need;
};

//! Replays the first `passes` digit choices from the row's finished histograms: for each pass, the digit d whose
//! bin holds the need-th largest matching key (bins scanned from 255 down). Warp 0 computes, the block reads the
//! result; contains a __syncthreads.
__device__ Selection selectPrefix(uint32_t const* rowHist, uint32_t k, int32_t passes, Selection* shared)
{
    if (threadIdx.x < 32)
    {
        int32_t const lane = threadIdx.x;
        uint32_t prefix = 0;
        uint32_t need = k;
        for (int32_t p = 0; p < passes; ++p)
        {
            uint32_t const* h = rowHist + p * kBins + lane * 8;
            uint32_t c[8];
            uint32_t s = 0;
#pragma unroll
            for (int32_t i = 0; i < 8; ++i)
            {
                c[i] = h[i];
                s += c[i];
            }
            uint32_t suffix = s; // keys in the bins of lanes >= lane
#pragma unroll
            for (int32_t o = 1; o < 32; o <<= 1)
            {
                uint32_t const v = __shfl_down_sync(kFullMask, suffix, o);
                suffix += lane + o < 32 ? v : 0u;
            }
            unsigned const reach = __ballot_sync(kFullMask, suffix >= need);
            int32_t const owner = 31 - __clz(reach); // the last lane whose suffix still reaches need
            uint32_t digit = 0;
            uint32_t rest = 0;
            if (lane == owner)
            {
                uint32_t cum = suffix - s; // keys in higher lanes' bins
                for (int32_t i = 7; i >= 0; --i)
                {
                    if (cum + c[i] >= need)
                    {
                        digit = static_cast<uint32_t>(lane * 8 + i);
                        rest = need - cum;
                        break;
                    }
                    cum += c[i];
                }
            }
            digit = __shfl_sync(kFullMask, digit, owner);
            need = __shfl_sync(kFullMask, rest, owner);
            prefix |= digit << (24 - 8 * p);
        }
        if (lane == 0)
        {
            *shared = Selection{prefix, need};
        }
    }
    __syncthreads();
    return *shared;
}

__device__ __forceinline__ void flushHistogram(uint32_t const* sHist, uint32_t* global)
{
    __syncthreads();
    for (int32_t i = threadIdx.x; i < kBins; i += blockDim.x)
    {
        if (sHist[i] != 0)
        {
            atomicAdd(global + i, sHist[i]);
        }
    }
}

__global__ void __launch_bounds__(kThreads) topkKeysKernel(float const* __restrict__ scores,
    int64_t const* __restrict__ positions, int32_t slots, int32_t chunks, uint32_t* __restrict__ keys,
    uint32_t* __restrict__ hist)
{
    __shared__ uint32_t sHist[kBins];
    int64_t const row = blockIdx.x / chunks;
    int32_t const c0 = (blockIdx.x % chunks) * kTopKGatherChunk;
    for (int32_t i = threadIdx.x; i < kBins; i += blockDim.x)
    {
        sHist[i] = 0;
    }
    __syncthreads();
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        int32_t const j = c0 + i * kThreads + threadIdx.x;
        if (j < slots)
        {
            int64_t const at = row * slots + j;
            uint32_t const key = orderedBits(positions[at] < 0 ? -INFINITY : scores[at]);
            keys[at] = key;
            atomicAdd(&sHist[key >> 24], 1u);
        }
    }
    flushHistogram(sHist, hist + row * kPasses * kBins);
}

template <int32_t PASS>
__global__ void __launch_bounds__(kThreads) topkHistKernel(uint32_t const* __restrict__ keys, int32_t slots,
    int32_t chunks, uint32_t k, uint32_t* __restrict__ hist)
{
    __shared__ uint32_t sHist[kBins];
    __shared__ Selection sSel;
    int64_t const row = blockIdx.x / chunks;
    int32_t const c0 = (blockIdx.x % chunks) * kTopKGatherChunk;
    uint32_t* rowHist = hist + row * kPasses * kBins;
    for (int32_t i = threadIdx.x; i < kBins; i += blockDim.x)
    {
        sHist[i] = 0;
    }
    Selection const sel = selectPrefix(rowHist, k, PASS, &sSel);
    uint32_t const mask = 0xFFFFFFFFu << (32 - 8 * PASS);
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        int32_t const j = c0 + i * kThreads + threadIdx.x;
        if (j < slots)
        {
            uint32_t const key = keys[row * slots + j];
            if ((key & mask) == sel.prefix)
            {
                atomicAdd(&sHist[(key >> (24 - 8 * PASS)) & 0xFFu], 1u);
            }
        }
    }
    flushHistogram(sHist, rowHist + PASS * kBins);
}

//! Sum of v over the block; every thread gets it. Uses `scratch` (kWarps values) and two __syncthreads.
__device__ uint32_t blockSum(uint32_t v, uint32_t* scratch)
{
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
#pragma unroll
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        v += __shfl_xor_sync(kFullMask, v, o);
    }
    if (lane == 0)
    {
        scratch[warp] = v;
    }
    __syncthreads();
    uint32_t total = 0;
    for (int32_t w = 0; w < kWarps; ++w)
    {
        total += scratch[w];
    }
    __syncthreads();
    return total;
}

//! Exclusive prefix sum of v over the block in thread order; `total` gets the sum. Two __syncthreads.
__device__ uint32_t blockExclusiveScan(uint32_t v, uint32_t* scratch, uint32_t& total)
{
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    uint32_t inclusive = v;
#pragma unroll
    for (int32_t o = 1; o < 32; o <<= 1)
    {
        uint32_t const n = __shfl_up_sync(kFullMask, inclusive, o);
        inclusive += lane >= o ? n : 0u;
    }
    if (lane == 31)
    {
        scratch[warp] = inclusive;
    }
    __syncthreads();
    uint32_t before = 0;
    total = 0;
    for (int32_t w = 0; w < kWarps; ++w)
    {
        uint32_t const x = scratch[w];
        before += w < warp ? x : 0u;
        total += x;
    }
    __syncthreads();
    return before + inclusive - v;
}

__global__ void __launch_bounds__(kThreads) topkCountKernel(uint32_t const* __restrict__ keys,
    uint32_t const* __restrict__ hist, int32_t slots, int32_t chunks, uint32_t k, uint2* __restrict__ counts)
{
    __shared__ Selection sSel;
    __shared__ uint32_t sScratch[kWarps];
    int64_t const row = blockIdx.x / chunks;
    int32_t const chunk = blockIdx.x % chunks;
    int32_t const c0 = chunk * kTopKGatherChunk;
    Selection const sel = selectPrefix(hist + row * kPasses * kBins, k, kPasses, &sSel); // prefix = threshold key
    uint32_t gt = 0;
    uint32_t eq = 0;
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        int32_t const j = c0 + i * kThreads + threadIdx.x;
        if (j < slots)
        {
            uint32_t const key = keys[row * slots + j];
            gt += key > sel.prefix ? 1u : 0u;
            eq += key == sel.prefix ? 1u : 0u;
        }
    }
    gt = blockSum(gt, sScratch);
    eq = blockSum(eq, sScratch);
    if (threadIdx.x == 0)
    {
        counts[row * chunks + chunk] = make_uint2(gt, eq);
    }
}

//! Copies one row of `dim` elements with the lanes of a warp (16-byte vectors when the row allows).
template <typename E>
__device__ __forceinline__ void copyRow(E const* __restrict__ src, E* __restrict__ dst, int32_t dim, int32_t lane)
{
    constexpr int32_t kVec = 16 / sizeof(E);
    bool const vec = dim % kVec == 0 && (reinterpret_cast<uintptr_t>(src) % 16) == 0
        && (reinterpret_cast<uintptr_t>(dst) % 16) == 0;
    if (vec)
    {
        uint4 const* s = reinterpret_cast<uint4 const*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int32_t c = lane; c < dim / kVec; c += 32)
        {
            d[c] = s[c];
        }
    }
    else
    {
        for (int32_t c = lane; c < dim; c += 32)
        {
            dst[c] = src[c];
        }
    }
}

template <typename E>
__global__ void __launch_bounds__(kThreads) topkWriteKernel(uint32_t const* __restrict__ keys,
    uint32_t const* __restrict__ hist, uint2 const* __restrict__ counts, int64_t const* __restrict__ positions,
    E const* __restrict__ srcKeys, E const* __restrict__ srcValues, int32_t slots, int32_t chunks, uint32_t k,
    int32_t keyDim, int32_t valueDim, E* __restrict__ keptKeys, E* __restrict__ keptValues,
    int64_t* __restrict__ keptPositions, int64_t* __restrict__ keptIndices)
{
    __shared__ Selection sSel;
    __shared__ uint32_t sScratch[kWarps];
    __shared__ int32_t sSlot[kTopKGatherChunk]; // kept slots of this chunk, in slot order
    __shared__ int32_t sOut[kTopKGatherChunk];  // their output rows
    int64_t const row = blockIdx.x / chunks;
    int32_t const chunk = blockIdx.x % chunks;
    int32_t const c0 = chunk * kTopKGatherChunk;
    Selection const sel = selectPrefix(hist + row * kPasses * kBins, k, kPasses, &sSel);

    // keys above the threshold and ties in the chunks before this one
    uint32_t gtBefore = 0;
    uint32_t eqBefore = 0;
    for (int32_t c = threadIdx.x; c < chunk; c += blockDim.x)
    {
        uint2 const n = counts[row * chunks + c];
        gtBefore += n.x;
        eqBefore += n.y;
    }
    gtBefore = blockSum(gtBefore, sScratch);
    eqBefore = blockSum(eqBefore, sScratch);
    uint32_t const keptBefore = gtBefore + min(eqBefore, sel.need); // ties go to the lowest slots first

    // each thread owns kItems consecutive slots, so thread order is slot order
    int32_t const j0 = c0 + threadIdx.x * kItems;
    bool gt[kItems];
    bool eq[kItems];
    uint32_t nEq = 0;
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        int32_t const j = j0 + i;
        uint32_t const key = j < slots ? keys[row * slots + j] : 0u;
        gt[i] = j < slots && key > sel.prefix;
        eq[i] = j < slots && key == sel.prefix;
        nEq += eq[i] ? 1u : 0u;
    }
    uint32_t total = 0;
    uint32_t eqRank = eqBefore + blockExclusiveScan(nEq, sScratch, total);
    bool kept[kItems];
    uint32_t nKept = 0;
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        kept[i] = gt[i] || (eq[i] && eqRank < sel.need);
        eqRank += eq[i] ? 1u : 0u;
        nKept += kept[i] ? 1u : 0u;
    }
    uint32_t keptTotal = 0;
    uint32_t local = blockExclusiveScan(nKept, sScratch, keptTotal);
#pragma unroll
    for (int32_t i = 0; i < kItems; ++i)
    {
        if (kept[i])
        {
            int32_t const j = j0 + i;
            int64_t const out = row * static_cast<int64_t>(k) + keptBefore + local;
            keptIndices[out] = j;
            keptPositions[out] = positions[row * slots + j];
            sSlot[local] = j;
            sOut[local] = static_cast<int32_t>(keptBefore + local);
            ++local;
        }
    }
    __syncthreads();

    int32_t const lane = threadIdx.x % 32;
    for (int32_t r = threadIdx.x / 32; r < static_cast<int32_t>(keptTotal); r += kWarps)
    {
        int64_t const src = row * slots + sSlot[r];
        int64_t const dst = row * static_cast<int64_t>(k) + sOut[r];
        copyRow(srcKeys + src * keyDim, keptKeys + dst * keyDim, keyDim, lane);
        if (valueDim > 0)
        {
            copyRow(srcValues + src * valueDim, keptValues + dst * valueDim, valueDim, lane);
        }
    }
}

template <typename E>
cudaError_t launchTyped(TopKGatherParams const& p, cudaStream_t stream)
{
    int64_t const rows = static_cast<int64_t>(p.batch) * p.heads;
    int32_t const chunks = static_cast<int32_t>(chunksOf(p.slots));
    WorkspaceLayout const w = workspaceLayout(rows, p.slots);
    if (p.workspace == nullptr || p.workspaceSize < w.total || rows * chunks > 0x7FFFFFFFLL)
    {
        return cudaErrorInvalidValue;
    }
    auto* ws = static_cast<unsigned char*>(p.workspace);
    auto* keys = reinterpret_cast<uint32_t*>(ws + w.keys);
    auto* hist = reinterpret_cast<uint32_t*>(ws + w.hist);
    auto* counts = reinterpret_cast<uint2*>(ws + w.counts);
    auto const k = static_cast<uint32_t>(p.k);
    auto const blocks = static_cast<unsigned int>(rows * chunks);

    cudaError_t e = cudaMemsetAsync(hist, 0, sizeof(uint32_t) * rows * kPasses * kBins, stream);
    if (e != cudaSuccess)
    {
        return e;
    }
    topkKeysKernel<<<blocks, kThreads, 0, stream>>>(p.scores, p.positions, p.slots, chunks, keys, hist);
    topkHistKernel<1><<<blocks, kThreads, 0, stream>>>(keys, p.slots, chunks, k, hist);
    topkHistKernel<2><<<blocks, kThreads, 0, stream>>>(keys, p.slots, chunks, k, hist);
    topkHistKernel<3><<<blocks, kThreads, 0, stream>>>(keys, p.slots, chunks, k, hist);
    topkCountKernel<<<blocks, kThreads, 0, stream>>>(keys, hist, p.slots, chunks, k, counts);
    topkWriteKernel<E><<<blocks, kThreads, 0, stream>>>(keys, hist, counts, p.positions,
        static_cast<E const*>(p.keys), static_cast<E const*>(p.values), p.slots, chunks, k, p.keyDim, p.valueDim,
        static_cast<E*>(p.keptKeys), static_cast<E*>(p.keptValues), p.keptPositions, p.keptIndices);
    return cudaGetLastError();
}

} // namespace

size_t topKGatherWorkspaceSize(int32_t batch, int32_t heads, int32_t slots)
{
    if (batch < 1 || heads < 1 || slots < 1)
    {
        return 0;
    }
    return workspaceLayout(static_cast<int64_t>(batch) * heads, slots).total;
}

cudaError_t launchTopKGather(TopKGatherParams const& p, cudaStream_t stream)
{
    if (p.dataType < 0 || p.dataType > 3 || p.batch < 0 || p.heads < 0 || p.slots < 1 || p.k < 1 || p.k > p.slots
        || p.keyDim < 0 || p.valueDim < 0 || p.scores == nullptr || p.positions == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (p.batch == 0 || p.heads == 0)
    {
        return cudaSuccess;
    }
    // rows are copied as raw elements of their size: float32; float16 / bfloat16; uint8 codes of a quantized cache
    switch (dtypeSize(static_cast<KvxDType>(p.dataType)))
    {
    case 4: return launchTyped<uint32_t>(p, stream);
    case 2: return launchTyped<uint16_t>(p, stream);
    default: return launchTyped<uint8_t>(p, stream);
    }
}

} // namespace kvexport

extern "C" KVX_API int32_t kvx_topk_gather(int32_t dataType, float const* scores, void const* keys,
    void const* values, int64_t const* positions, int32_t batch, int32_t heads, int32_t slots, int32_t keyDim,
    int32_t valueDim, int32_t k, void* keptKeys, void* keptValues, int64_t* keptPositions, int64_t* keptIndices,
    void* workspace, size_t workspaceSize, cudaStream_t stream)
{
    kvexport::TopKGatherParams p{dataType, scores, keys, values, positions, batch, heads, slots, keyDim, valueDim, k,
        keptKeys, keptValues, keptPositions, keptIndices, workspace, workspaceSize};
    return static_cast<int32_t>(kvexport::launchTopKGather(p, stream));
}

extern "C" KVX_API size_t kvx_topk_gather_workspace_size(int32_t batch, int32_t heads, int32_t slots)
{
    return kvexport::topKGatherWorkspaceSize(batch, heads, slots);
}
