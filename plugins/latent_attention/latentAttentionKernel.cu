// SPDX-License-Identifier: Apache-2.0
// LatentAttention kernels (split-K "flash-decoding" over the slots, Dao et al. 2023):
//
//  1. latentSplitKernel, grid (splits, query groups, B): a block owns up to 32 query rows (all heads of a decode
//     step) and a contiguous range of slots. It stages its queries once in shared memory, then walks the range in
//     tiles of 32 slots: each tile of the latent cache is read from global memory ONCE and used by every head for
//     the logits (lane = slot) and for the value sum (lane = latent channel), with an online softmax per row. Raw
//     logits are also written out (float32) for the attention mass.
//  2. latentCombineKernel, grid (B * Hq * T): merges the per-split partial softmax states into the output row and
//     keeps the row's max / sum.
//  3. latentMassKernel, grid (S / 256, B): attn_mass[b, j] = sum over rows of exp(logit - max) / sum.
//
// Masking follows docs/custom_ops.md: slot j is visible to query t iff 0 <= latent_pos[j] <= q_pos[t]; masked
// logits are -FLT_MAX (finfo(float32).min), so a query that sees nothing averages all S slots uniformly.
#include "latentAttentionKernel.h"

#include "../common/kvxTypes.cuh"

#include <algorithm>
#include <cfloat>

namespace kvexport
{
namespace
{

constexpr int32_t kTileSlots = 32;      // slots per shared-memory tile (one per lane)
constexpr int32_t kRowsPerWarp = 4;     // query rows per warp
constexpr int32_t kMaxRowsPerBlock = 32;
constexpr int32_t kWorkspaceBlockBound = 1024; // split bound used for the workspace size (>= 4 * SMs on any GPU)
constexpr int32_t kCombineThreads = 128;
constexpr int32_t kMassThreads = 256;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__host__ __device__ inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

//! Row stride in shared memory: a multiple of 4 elements whose count of 4-element groups is odd, so the vector
//! loads of 32 lanes reading 32 different rows hit distinct banks.
inline int32_t paddedDim(int32_t dim)
{
    int32_t dp = static_cast<int32_t>(ceilDiv(dim, 4) * 4);
    if ((dp / 4) % 2 == 0)
    {
        dp += 4;
    }
    return dp;
}

//! Number of slot splits for a grid of (splits, groups, B) blocks aiming at `targetBlocks` blocks.
inline int32_t numSplits(int64_t batch, int64_t rows, int64_t slots, int64_t rowsPerBlock, int64_t targetBlocks)
{
    int64_t const groups = ceilDiv(rows, rowsPerBlock);
    int64_t const tiles = ceilDiv(slots, kTileSlots);
    int64_t const want = std::max<int64_t>(1, ceilDiv(targetBlocks, batch * groups));
    int64_t const splits = std::min(tiles, want);
    int64_t const tilesPerSplit = ceilDiv(tiles, splits);
    return static_cast<int32_t>(ceilDiv(tiles, tilesPerSplit));
}

inline int32_t maxSplits(int64_t batch, int64_t rows, int64_t slots)
{
    return numSplits(batch, rows, slots, kMaxRowsPerBlock, kWorkspaceBlockBound);
}

//! Workspace layout, float elements, each section 256-byte aligned.
struct WorkspaceLayout
{
    size_t logits, partMax, partSum, partAcc, rowMax, rowSum, total;
};

inline size_t alignUp(size_t bytes)
{
    return (bytes + 255) / 256 * 256;
}

WorkspaceLayout workspaceLayout(int64_t batch, int64_t rows, int64_t slots, int64_t rank)
{
    int64_t const splits = maxSplits(batch, rows, slots);
    int64_t const br = batch * rows;
    WorkspaceLayout w{};
    size_t off = 0;
    w.logits = off;
    off += alignUp(sizeof(float) * br * slots);
    w.partMax = off;
    off += alignUp(sizeof(float) * br * splits);
    w.partSum = off;
    off += alignUp(sizeof(float) * br * splits);
    w.partAcc = off;
    off += alignUp(sizeof(float) * br * splits * rank);
    w.rowMax = off;
    off += alignUp(sizeof(float) * br);
    w.rowSum = off;
    off += alignUp(sizeof(float) * br);
    w.total = off;
    return w;
}

__device__ __forceinline__ float warpMax(float x)
{
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
    }
    return x;
}

__device__ __forceinline__ float warpSum(float x)
{
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        x += __shfl_xor_sync(kFullMask, x, o);
    }
    return x;
}

//! Stages `nRows` rows of `dim` elements from a contiguous global block into float32 shared rows of stride `dp`
//! (converted once here, so the inner loops do no conversions); rows >= validRows are zero-filled.
template <typename T>
__device__ void stageRows(float* dst, T const* src, int32_t nRows, int32_t validRows, int32_t dim, int32_t dp)
{
    if (dim % 4 == 0)
    {
        int32_t const groups = dim / 4;
        for (int32_t i = threadIdx.x; i < nRows * groups; i += blockDim.x)
        {
            int32_t const row = i / groups;
            int32_t const c = (i - row * groups) * 4;
            float4 const v = row < validRows ? load4(src + static_cast<int64_t>(row) * dim + c)
                                             : make_float4(0.0F, 0.0F, 0.0F, 0.0F);
            *reinterpret_cast<float4*>(dst + row * dp + c) = v;
        }
    }
    else
    {
        for (int32_t i = threadIdx.x; i < nRows * dim; i += blockDim.x)
        {
            int32_t const row = i / dim;
            int32_t const c = i - row * dim;
            dst[row * dp + c] = row < validRows ? toFloat(src[static_cast<int64_t>(row) * dim + c]) : 0.0F;
        }
    }
}

template <typename T, int32_t RPL>
__global__ void __launch_bounds__(kMaxRowsPerBlock / kRowsPerWarp * 32) latentSplitKernel(T const* __restrict__ q,
    T const* __restrict__ latent, int64_t const* __restrict__ qPos, int64_t const* __restrict__ latPos, int32_t rows,
    int32_t queries, int32_t slots, int32_t dim, int32_t dp, int32_t rank, float scale, int32_t rowsPerBlock,
    int32_t tilesPerSplit, int32_t splits, float* __restrict__ logits, float* __restrict__ partMax,
    float* __restrict__ partSum, float* __restrict__ partAcc)
{
    extern __shared__ __align__(16) unsigned char smemRaw[];
    float* sQ = reinterpret_cast<float*>(smemRaw); // (rowsPerBlock, dp) float32
    float* sTile = sQ + rowsPerBlock * dp;         // (kTileSlots, dp) float32

    int32_t const split = blockIdx.x;
    int32_t const row0 = blockIdx.y * rowsPerBlock;
    int64_t const b = blockIdx.z;
    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;

    // queries of this block, once
    int32_t const blockRows = min(rowsPerBlock, rows - row0);
    stageRows(sQ, q + (b * rows + row0) * dim, rowsPerBlock, blockRows, dim, dp);

    int64_t qp[kRowsPerWarp];
    bool rowValid[kRowsPerWarp];
    float runMax[kRowsPerWarp];
    float runSum[kRowsPerWarp];
    float acc[kRowsPerWarp][RPL];
#pragma unroll
    for (int32_t r = 0; r < kRowsPerWarp; ++r)
    {
        int32_t const local = warp * kRowsPerWarp + r;
        int32_t const m = row0 + local;
        rowValid[r] = local < rowsPerBlock && m < rows;
        qp[r] = rowValid[r] ? qPos[b * queries + m % queries] : -1;
        runMax[r] = -INFINITY;
        runSum[r] = 0.0F;
#pragma unroll
        for (int32_t i = 0; i < RPL; ++i)
        {
            acc[r][i] = 0.0F;
        }
    }

    int32_t const tiles = static_cast<int32_t>(ceilDiv(slots, kTileSlots));
    int32_t const tileBegin = split * tilesPerSplit;
    int32_t const tileEnd = min(tiles, tileBegin + tilesPerSplit);
    int32_t const dim4 = dim & ~3;
    T const* latB = latent + b * slots * dim;

    for (int32_t tile = tileBegin; tile < tileEnd; ++tile)
    {
        int32_t const s0 = tile * kTileSlots;
        int32_t const nValid = min(kTileSlots, slots - s0);
        __syncthreads(); // previous tile fully consumed (and sQ staged on the first pass)
        stageRows(sTile, latB + static_cast<int64_t>(s0) * dim, kTileSlots, nValid, dim, dp);
        __syncthreads();

        // logits: lane = slot
        int32_t const slot = s0 + lane;
        bool const inRange = lane < nValid;
        int64_t const lp = inRange ? latPos[b * slots + slot] : -1;
        float dot[kRowsPerWarp];
#pragma unroll
        for (int32_t r = 0; r < kRowsPerWarp; ++r)
        {
            dot[r] = 0.0F;
        }
        float const* myRow = sTile + lane * dp;
        float const* qRows = sQ + warp * kRowsPerWarp * dp;
        for (int32_t d = 0; d < dim4; d += 4)
        {
            float4 const t = load4(myRow + d);
#pragma unroll
            for (int32_t r = 0; r < kRowsPerWarp; ++r)
            {
                float4 const qv = load4(qRows + r * dp + d);
                dot[r] = fmaf(qv.x, t.x, fmaf(qv.y, t.y, fmaf(qv.z, t.z, fmaf(qv.w, t.w, dot[r]))));
            }
        }
        for (int32_t d = dim4; d < dim; ++d)
        {
            float const t = myRow[d];
#pragma unroll
            for (int32_t r = 0; r < kRowsPerWarp; ++r)
            {
                dot[r] = fmaf(qRows[r * dp + d], t, dot[r]);
            }
        }

        float p[kRowsPerWarp];
#pragma unroll
        for (int32_t r = 0; r < kRowsPerWarp; ++r)
        {
            bool const visible = inRange && lp >= 0 && lp <= qp[r];
            float const logit = visible ? dot[r] * scale : -FLT_MAX;
            if (rowValid[r] && inRange)
            {
                logits[(b * rows + row0 + warp * kRowsPerWarp + r) * slots + slot] = logit;
            }
            float const tileMax = warpMax(inRange ? logit : -INFINITY);
            float const newMax = fmaxf(runMax[r], tileMax);
            float const corr = expf(runMax[r] - newMax); // 0 on the first tile (runMax = -inf)
            p[r] = inRange ? expf(logit - newMax) : 0.0F;
            runSum[r] = runSum[r] * corr + warpSum(p[r]);
            runMax[r] = newMax;
#pragma unroll
            for (int32_t i = 0; i < RPL; ++i)
            {
                acc[r][i] *= corr;
            }
        }

        // values: lane = latent channel, p broadcast from the slot's lane
        for (int32_t j = 0; j < nValid; ++j)
        {
            float tv[RPL];
#pragma unroll
            for (int32_t i = 0; i < RPL; ++i)
            {
                int32_t const c = lane + 32 * i;
                tv[i] = c < rank ? sTile[j * dp + c] : 0.0F;
            }
#pragma unroll
            for (int32_t r = 0; r < kRowsPerWarp; ++r)
            {
                float const pj = __shfl_sync(kFullMask, p[r], j);
#pragma unroll
                for (int32_t i = 0; i < RPL; ++i)
                {
                    acc[r][i] = fmaf(pj, tv[i], acc[r][i]);
                }
            }
        }
    }

#pragma unroll
    for (int32_t r = 0; r < kRowsPerWarp; ++r)
    {
        if (!rowValid[r])
        {
            continue;
        }
        int64_t const idx = (b * rows + row0 + warp * kRowsPerWarp + r) * splits + split;
        if (lane == 0)
        {
            partMax[idx] = runMax[r];
            partSum[idx] = runSum[r];
        }
#pragma unroll
        for (int32_t i = 0; i < RPL; ++i)
        {
            int32_t const c = lane + 32 * i;
            if (c < rank)
            {
                partAcc[idx * rank + c] = acc[r][i];
            }
        }
    }
}

__device__ float blockReduce(float x, bool isMax, float* scratch)
{
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    x = isMax ? warpMax(x) : warpSum(x);
    __syncthreads();
    if (lane == 0)
    {
        scratch[warp] = x;
    }
    __syncthreads();
    int32_t const nWarps = blockDim.x / 32;
    float y = isMax ? -INFINITY : 0.0F;
    for (int32_t w = 0; w < nWarps; ++w)
    {
        y = isMax ? fmaxf(y, scratch[w]) : y + scratch[w];
    }
    return y;
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) latentCombineKernel(float const* __restrict__ partMax,
    float const* __restrict__ partSum, float const* __restrict__ partAcc, int32_t splits, int32_t rank,
    T* __restrict__ out, float* __restrict__ rowMax, float* __restrict__ rowSum)
{
    extern __shared__ float weights[]; // (splits,)
    __shared__ float scratch[32];
    int64_t const row = blockIdx.x;
    float const* pm = partMax + row * splits;
    float const* ps = partSum + row * splits;

    float mx = -INFINITY;
    for (int32_t s = threadIdx.x; s < splits; s += blockDim.x)
    {
        mx = fmaxf(mx, pm[s]);
    }
    float const gmax = blockReduce(mx, true, scratch);
    float sum = 0.0F;
    for (int32_t s = threadIdx.x; s < splits; s += blockDim.x)
    {
        float const w = expf(pm[s] - gmax);
        weights[s] = w;
        sum += ps[s] * w;
    }
    float const total = blockReduce(sum, false, scratch); // also orders the weights[] writes before the reads
    float const inv = 1.0F / total;
    for (int32_t c = threadIdx.x; c < rank; c += blockDim.x)
    {
        float a = 0.0F;
        for (int32_t s = 0; s < splits; ++s)
        {
            a = fmaf(partAcc[(row * splits + s) * rank + c], weights[s], a);
        }
        out[row * rank + c] = fromFloat<T>(a * inv);
    }
    if (threadIdx.x == 0)
    {
        rowMax[row] = gmax;
        rowSum[row] = total;
    }
}

__global__ void __launch_bounds__(kMassThreads) latentMassKernel(float const* __restrict__ logits,
    float const* __restrict__ rowMax, float const* __restrict__ rowSum, int32_t rows, int32_t slots,
    float* __restrict__ attnMass)
{
    int64_t const b = blockIdx.y;
    int32_t const j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= slots)
    {
        return;
    }
    float mass = 0.0F;
    for (int32_t m = 0; m < rows; ++m)
    {
        int64_t const row = b * rows + m;
        mass += expf(logits[row * slots + j] - rowMax[row]) / rowSum[row];
    }
    attnMass[b * slots + j] = mass;
}

template <typename T, int32_t RPL>
cudaError_t launchTyped(LatentAttentionParams const& p, cudaStream_t stream)
{
    int32_t const rows = p.heads * p.queries;
    int32_t const dp = paddedDim(p.dim);

    int32_t device = 0;
    cudaError_t e = cudaGetDevice(&device);
    int32_t smCount = 0;
    int32_t smemOptin = 0;
    if (e == cudaSuccess)
    {
        e = cudaDeviceGetAttribute(&smCount, cudaDevAttrMultiProcessorCount, device);
    }
    if (e == cudaSuccess)
    {
        e = cudaDeviceGetAttribute(&smemOptin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (e != cudaSuccess)
    {
        return e;
    }

    // rows per block: all rows of a decode step when shared memory allows, else fewer (more query groups)
    int32_t rowsPerBlock = static_cast<int32_t>(std::min<int64_t>(kMaxRowsPerBlock, ceilDiv(rows, kRowsPerWarp) * kRowsPerWarp));
    auto smemFor = [&](int32_t rpb) { return static_cast<size_t>(rpb + kTileSlots) * dp * sizeof(float); };
    while (rowsPerBlock > kRowsPerWarp && smemFor(rowsPerBlock) > static_cast<size_t>(smemOptin))
    {
        rowsPerBlock = std::max(kRowsPerWarp, rowsPerBlock / 2 / kRowsPerWarp * kRowsPerWarp);
    }
    size_t const smem = smemFor(rowsPerBlock);
    if (smem > static_cast<size_t>(smemOptin))
    {
        return cudaErrorInvalidValue; // latent too wide for shared memory
    }

    int32_t const groups = static_cast<int32_t>(ceilDiv(rows, rowsPerBlock));
    int32_t const tiles = static_cast<int32_t>(ceilDiv(p.slots, kTileSlots));
    int32_t splits = std::min(numSplits(p.batch, rows, p.slots, rowsPerBlock, 4LL * smCount),
        maxSplits(p.batch, rows, p.slots));
    int32_t const tilesPerSplit = static_cast<int32_t>(ceilDiv(tiles, splits));
    splits = static_cast<int32_t>(ceilDiv(tiles, tilesPerSplit));

    WorkspaceLayout const w = workspaceLayout(p.batch, rows, p.slots, p.rank);
    if (p.workspace == nullptr || p.workspaceSize < w.total)
    {
        return cudaErrorInvalidValue;
    }
    auto* ws = static_cast<unsigned char*>(p.workspace);
    auto* logits = reinterpret_cast<float*>(ws + w.logits);
    auto* partMax = reinterpret_cast<float*>(ws + w.partMax);
    auto* partSum = reinterpret_cast<float*>(ws + w.partSum);
    auto* partAcc = reinterpret_cast<float*>(ws + w.partAcc);
    auto* rowMax = reinterpret_cast<float*>(ws + w.rowMax);
    auto* rowSum = reinterpret_cast<float*>(ws + w.rowSum);

    auto split = latentSplitKernel<T, RPL>;
    if (smem > 48 * 1024)
    {
        e = cudaFuncSetAttribute(split, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (e != cudaSuccess)
        {
            return e;
        }
    }
    dim3 const grid(splits, groups, p.batch);
    int32_t const threads = rowsPerBlock / kRowsPerWarp * 32;
    split<<<grid, threads, smem, stream>>>(static_cast<T const*>(p.q), static_cast<T const*>(p.latent),
        p.qPositions, p.latentPositions, rows, p.queries, p.slots, p.dim, dp, p.rank, p.scale, rowsPerBlock,
        tilesPerSplit, splits, logits, partMax, partSum, partAcc);
    e = cudaGetLastError();
    if (e != cudaSuccess)
    {
        return e;
    }
    latentCombineKernel<T><<<static_cast<unsigned int>(static_cast<int64_t>(p.batch) * rows), kCombineThreads,
        splits * sizeof(float), stream>>>(partMax, partSum, partAcc, splits, p.rank, static_cast<T*>(p.out),
        rowMax, rowSum);
    e = cudaGetLastError();
    if (e != cudaSuccess)
    {
        return e;
    }
    dim3 const massGrid(static_cast<unsigned int>(ceilDiv(p.slots, kMassThreads)), p.batch);
    latentMassKernel<<<massGrid, kMassThreads, 0, stream>>>(logits, rowMax, rowSum, rows, p.slots, p.attnMass);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchRank(LatentAttentionParams const& p, cudaStream_t stream)
{
    if (p.rank <= 64)
    {
        return launchTyped<T, 2>(p, stream);
    }
    if (p.rank <= 128)
    {
        return launchTyped<T, 4>(p, stream);
    }
    if (p.rank <= 256)
    {
        return launchTyped<T, 8>(p, stream);
    }
    return launchTyped<T, 16>(p, stream);
}

} // namespace

size_t latentAttentionWorkspaceSize(int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t rank)
{
    if (batch < 1 || heads < 1 || queries < 1 || slots < 1 || rank < 1)
    {
        return 0;
    }
    return workspaceLayout(batch, static_cast<int64_t>(heads) * queries, slots, rank).total;
}

cudaError_t launchLatentAttention(LatentAttentionParams const& p, cudaStream_t stream)
{
    if (p.dataType < 0 || p.dataType > 2 || p.batch < 0 || p.heads < 1 || p.queries < 1 || p.slots < 1
        || p.rank < 1 || p.rank > kLatentAttentionMaxRank || p.dim < p.rank || p.dim > kLatentAttentionMaxDim)
    {
        return cudaErrorInvalidValue;
    }
    if (p.batch == 0)
    {
        return cudaSuccess;
    }
    switch (static_cast<KvxDType>(p.dataType))
    {
    case KvxDType::kFLOAT32: return launchRank<float>(p, stream);
    case KvxDType::kFLOAT16: return launchRank<__half>(p, stream);
    case KvxDType::kBFLOAT16: return launchRank<__nv_bfloat16>(p, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace kvexport

extern "C" KVX_API int32_t kvx_latent_attention(int32_t dataType, void const* q, void const* latent,
    int64_t const* qPositions, int64_t const* latentPositions, int32_t batch, int32_t heads, int32_t queries,
    int32_t slots, int32_t dim, int32_t rank, float scale, void* out, float* attnMass, void* workspace,
    size_t workspaceSize, cudaStream_t stream)
{
    kvexport::LatentAttentionParams p{dataType, q, latent, qPositions, latentPositions, batch, heads, queries, slots,
        dim, rank, scale, out, attnMass, workspace, workspaceSize};
    return static_cast<int32_t>(kvexport::launchLatentAttention(p, stream));
}

extern "C" KVX_API size_t kvx_latent_attention_workspace_size(
    int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t rank)
{
    return kvexport::latentAttentionWorkspaceSize(batch, heads, queries, slots, rank);
}

extern "C" KVX_API int32_t kvx_abi_version()
{
    return KVX_ABI_VERSION;
}
