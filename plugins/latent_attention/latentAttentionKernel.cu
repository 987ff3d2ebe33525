// SPDX-License-Identifier: Apache-2.0
// LatentAttention kernels: split-K "flash-decoding" (Dao et al. 2023) over the latent slots.
//
// Tensor-core path (fp16 / bf16, sm_80+), latentMmaKernel, grid (row tiles, splits, B):
//   A block owns M = 16 * warpsM query rows (heads x queries: the heads of a decode step form one matrix tile) and a
//   contiguous range of slot tiles. Its queries are staged once in shared memory; latent tiles of N rows stream
//   through a two-stage cp.async ring (tile i+1 is in flight while tile i is consumed). Per tile:
//     S = Q Lat^T    warp (wm, wr): rows 16 wm.., slots SW wr.. of the tile; mma.sync m16n8k16 on ldmatrix operands
//     softmax        masked, scaled, online (running max and sum per row; warps sharing rows exchange row maxima)
//     P -> shared    in the input type (the reference rounds the probabilities to q's dtype as well)
//     O += P Lat     warp (wm, wr) owns the output columns 8 NT wr..; V fragments by ldmatrix.trans of the same tile
//   so a latent tile is read from global memory once per row tile and feeds both products. With one split the block
//   writes `out`; otherwise float32 partials (accumulator, row max, row sum) for latentCombineKernel.
// CUDA-core path (fp32, or no tensor-core configuration fits), latentSimtKernel: the same split structure with
//   float32 shared tiles of 32 slots, lane = slot for the logits and lane = channel for the value sum.
// latentCombineKernel, grid (B * rows, R / 128): merges the split partials into `out`.
//
// Op version 2 (docs/custom_ops.md): a quantized cache (uint8 int8 / fp8 e4m3fn codes, one fp16 scale per row) is
// dequantized in the load path: the tensor-core kernel stages the raw codes by cp.async and converts them in shared
// memory into the tile's rows before ldmatrix; the CUDA-core kernel converts while staging its float32 tiles. Each
// value is rounded to q's type, as the reference dequantizes to q's dtype. new_latent's T rows are slots S .. S+T-1
// of the same softmax, at the queries' positions.
//
// The split count comes from a cost model (planLatentAttention): modelled time of the main kernel (waves of blocks,
// each bound by its share of memory bandwidth or of tensor / FMA throughput) plus the partials' traffic and the
// combine launch; among choices within 3 % of the best, the one moving the fewest partial bytes wins.
//
// Masking follows docs/custom_ops.md: slot j is visible to query t iff 0 <= latent_pos[j] <= q_pos[t]; masked logits
// are -FLT_MAX (finfo(float32).min), so a query that sees nothing averages all S slots uniformly; tile padding beyond
// S is -inf (weight 0).
#include "latentAttentionKernel.h"

#include "../common/kvxMma.cuh"
#include "../common/kvxTypes.cuh"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>
#include <vector>

namespace kvexport
{
namespace
{

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int32_t kMaxSplits = 128;          // per row tile
constexpr int32_t kMaxSplitBlocks = 512;     // B * row tiles * splits
constexpr int32_t kMinTileSlots = 16;        // smallest tile of any path (bounds the split count)
constexpr int32_t kLargestRowTile = 64;      // largest rows per block of any path (bounds the split count)
constexpr int32_t kMmaMaxThreads = 256;
constexpr int32_t kSimtTileSlots = 32;
constexpr int32_t kSimtRowsPerWarp = 4;
constexpr int32_t kSimtMaxRowsPerBlock = 32;
constexpr int32_t kCombineThreads = 128;

__host__ __device__ inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

inline size_t alignUp(size_t bytes)
{
    return (bytes + 255) / 256 * 256;
}

//! Workspace layout (bytes) of `splits` partials per row.
struct WorkspaceLayout
{
    size_t acc, max, sum, total;
};

WorkspaceLayout workspaceLayout(int64_t batchRows, int64_t splits, int64_t rank)
{
    WorkspaceLayout w{};
    w.acc = 0;
    w.max = alignUp(sizeof(float) * batchRows * splits * rank);
    w.sum = w.max + alignUp(sizeof(float) * batchRows * splits);
    w.total = w.sum + alignUp(sizeof(float) * batchRows * splits);
    return w;
}

//! Largest split count any plan may choose for these shapes.
int64_t splitBound(int64_t batch, int64_t rows, int64_t slots)
{
    int64_t const minRowTiles = ceilDiv(rows, kLargestRowTile);
    return std::max<int64_t>(1, std::min<int64_t>({kMaxSplits, ceilDiv(slots, kMinTileSlots),
                                    std::max<int64_t>(1, kMaxSplitBlocks / (batch * minRowTiles))}));
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

//! float8 e4m3fn bit pattern -> float, exactly (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7F / 0xFF are
//! NaN, no infinities). Bit manipulation only: no FP8 hardware needed (kvexport.cache.quant.FP8_VALUES).
__device__ __forceinline__ float e4m3ToFloat(uint32_t code)
{
    uint32_t const e = (code >> 3) & 15u;
    uint32_t const m = code & 7u;
    float v;
    if (e == 0)
    {
        v = static_cast<float>(m) * 0.001953125F; // subnormal: m * 2^-9
    }
    else if (e == 15 && m == 7)
    {
        v = NAN;
    }
    else
    {
        v = __uint_as_float(((e + 120u) << 23) | (m << 20)); // (1 + m / 8) * 2^(e - 7)
    }
    return (code & 0x80u) ? -v : v;
}

//! One cached code's value before the row scale: int8 codes are `q + 128`, fp8 codes e4m3fn bit patterns.
__device__ __forceinline__ float decodeLatentCode(uint32_t code, int32_t format)
{
    return format == kLatentFormatInt8 ? static_cast<float>(code) - 128.0F : e4m3ToFloat(code);
}

//! Where a launch's slot rows come from: slots [0, cacheSlots) the cache (rows in T, or uint8 codes + fp16 row
//! scales), slots [cacheSlots, cacheSlots + T) this step's new rows (in T) when newLatent is set.
template <typename T>
struct LatentSource
{
    T const* latent;            // format 0: (B, S, D)
    unsigned char const* codes; // format 1 / 2: (B, S, D) uint8
    __half const* scale;        // format 1 / 2: (B, S)
    T const* newLatent;         // (B, T, D) or null
    int32_t format;
    int32_t cacheSlots; // S
};

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core path

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2]);
template <>
__device__ __forceinline__ void mma<__half>(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
    mmaF16(d, a, b);
}
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
    mmaBf16(d, a, b);
}

template <typename T>
__device__ __forceinline__ uint32_t packPair(float a, float b);
template <>
__device__ __forceinline__ uint32_t packPair<__half>(float a, float b)
{
    __half2 const h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t const*>(&h);
}
template <>
__device__ __forceinline__ uint32_t packPair<__nv_bfloat16>(float a, float b)
{
    __nv_bfloat162 const h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t const*>(&h);
}

template <typename T>
struct MmaArgs
{
    T const* q;
    T const* latent;    // format 0: (B, S, D); null for a quantized cache
    T const* newLatent; // (B, T, D) this step's rows (slots [cacheSlots, slots)), or null
    unsigned char const* codes; // format 1 / 2: (B, S, D) uint8, staged raw by cp.async, dequantized in shared memory
    __half const* latScale;     // format 1 / 2: (B, S)
    int32_t format;
    int32_t ldq;  // shared row stride of the staged codes, bytes (D rounded up to 16; 0 without a quantized cache)
    int32_t vecq; // cp.async chunk of the codes, bytes (16, 8 or 4)
    int64_t const* qPos;
    int64_t const* latPos;
    int32_t rows;       // heads * queries
    int32_t queries;    // T
    int32_t slots;      // S (+ T with newLatent)
    int32_t cacheSlots; // S
    int32_t dim;     // D
    int32_t dk;      // D rounded up to 16 (the k extent of S = Q Lat^T)
    int32_t ld;      // shared row stride of Q and latent tiles, elements (dk + 8: conflict-free ldmatrix rows)
    int32_t ldp;     // shared row stride of P, elements (tileSlots + 8)
    int32_t rank;    // R
    int32_t warpsM;  // row groups of 16 rows
    int32_t warpsR;  // warps per row group (they split the tile's slots for S and the output columns for O)
    int32_t tileSlots;
    int32_t tilesPerSplit;
    int32_t splits;
    int32_t vec; // cp.async chunk, bytes (16, 8 or 4: divides D * sizeof(T) and the latent's alignment)
    float scale;
    T* out;
    float* partAcc;
    float* partMax;
    float* partSum;
};

//! Dynamic shared memory layout of latentMmaKernel, bytes (every section 16-byte aligned).
struct MmaSmem
{
    int32_t q, lat0, lat1, p, lp0, lp1, red, code0, code1, total;
};

//! ldq: the staged code rows' stride in bytes (0: no quantized cache, no code stages).
__host__ __device__ inline MmaSmem mmaSmem(int32_t m, int32_t n, int32_t ld, int32_t ldp, int32_t warps, int32_t ldq)
{
    MmaSmem s{};
    int32_t off = 0;
    s.q = off;
    off += m * ld * 2;
    s.lat0 = off;
    off += n * ld * 2;
    s.lat1 = off;
    off += n * ld * 2;
    s.p = off;
    off += m * ldp * 2;
    s.lp0 = off;
    off += n * 8;
    s.lp1 = off;
    off += n * 8;
    s.red = off;
    off += warps * 16 * 4;
    s.code0 = off;
    off += n * ldq;
    s.code1 = off;
    off += n * ldq;
    s.total = off;
    return s;
}

//! NT: 8-column output tiles per warp (O accumulators: 4 NT floats per thread); SW: slots per warp per tile.
template <typename T, int32_t NT, int32_t SW>
__global__ void __launch_bounds__(kMmaMaxThreads) latentMmaKernel(MmaArgs<T> const a)
{
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int32_t kS = SW / 8; // S n-tiles per warp
    int32_t const warps = a.warpsM * a.warpsR;
    int32_t const m16 = 16 * a.warpsM;
    int32_t const n = a.tileSlots;
    MmaSmem const lay = mmaSmem(m16, n, a.ld, a.ldp, warps, a.ldq);
    T* sQ = reinterpret_cast<T*>(smem + lay.q);
    T* sP = reinterpret_cast<T*>(smem + lay.p);
    float* sRed = reinterpret_cast<float*>(smem + lay.red);
    // the two stages of the latent ring and of its positions (pointer arithmetic, no local arrays)
    auto sLat = [&](int32_t stage) { return reinterpret_cast<T*>(smem + (stage ? lay.lat1 : lay.lat0)); };
    auto sLp = [&](int32_t stage) { return reinterpret_cast<int64_t*>(smem + (stage ? lay.lp1 : lay.lp0)); };
    auto sCodes = [&](int32_t stage) { return smem + (stage ? lay.code1 : lay.code0); };
    bool const quantized = a.format != kLatentFormatNone;

    int32_t const tid = threadIdx.x;
    int32_t const nThreads = blockDim.x;
    int32_t const warp = tid / 32;
    int32_t const lane = tid % 32;
    int32_t const g = lane >> 2;
    int32_t const t4 = lane & 3;
    int32_t const wm = warp % a.warpsM;
    int32_t const wr = warp / a.warpsM;
    int32_t const row0 = blockIdx.x * m16;
    int32_t const split = blockIdx.y;
    int64_t const b = blockIdx.z;

    // queries (zero beyond D and beyond the last row) and the latent tiles' k padding [D, dk), once
    T const zero = fromFloat<T>(0.0F);
    for (int32_t i = tid; i < m16 * a.dk; i += nThreads)
    {
        int32_t const r = i / a.dk;
        int32_t const c = i - r * a.dk;
        int32_t const m = row0 + r;
        sQ[r * a.ld + c] = (m < a.rows && c < a.dim) ? a.q[(b * a.rows + m) * a.dim + c] : zero;
    }
    int32_t const pad = a.dk - a.dim;
    for (int32_t i = tid; i < 2 * n * pad; i += nThreads)
    {
        int32_t const stage = i / (n * pad);
        int32_t const r = (i - stage * n * pad) / pad;
        int32_t const c = a.dim + (i - stage * n * pad - r * pad);
        sLat(stage)[r * a.ld + c] = zero;
    }

    int32_t const tiles = static_cast<int32_t>(ceilDiv(a.slots, n));
    int32_t const tileBegin = split * a.tilesPerSplit;
    int32_t const tileEnd = min(tiles, tileBegin + a.tilesPerSplit);
    int32_t const rowBytes = a.dim * static_cast<int32_t>(sizeof(T));
    int32_t const chunksPerRow = rowBytes / a.vec;
    auto const* latB = a.latent == nullptr ? nullptr
                                           : reinterpret_cast<unsigned char const*>(a.latent + b * a.cacheSlots * a.dim);
    unsigned char const* codesB = a.codes == nullptr ? nullptr : a.codes + b * a.cacheSlots * a.dim;
    int32_t const chunksPerRowQ = a.vecq > 0 ? a.dim / a.vecq : 0;
    auto const* newB = a.newLatent == nullptr ? nullptr
                                              : reinterpret_cast<unsigned char const*>(a.newLatent + b * a.queries * a.dim);
    int64_t const* lpB = a.latPos + b * a.cacheSlots;
    int64_t const* qpB = a.qPos + b * a.queries;

    // issues the copies of one tile (latent rows and their positions) as one cp.async group; a quantized cache's rows
    // go to the stage's code buffer as raw bytes (dequantize() converts them), the new rows straight to the tile
    auto load = [&](int32_t tile, int32_t stage) {
        int32_t const s0 = tile * n;
        auto* dst = reinterpret_cast<unsigned char*>(sLat(stage));
        for (int32_t i = tid; i < n * chunksPerRow; i += nThreads)
        {
            int32_t const r = i / chunksPerRow;
            int32_t const c = i - r * chunksPerRow;
            bool const in = s0 + r < a.slots;
            if (quantized && (!in || s0 + r < a.cacheSlots))
            {
                continue; // a cache row (staged as codes) or tile padding (zeroed by dequantize())
            }
            int32_t const slot = in ? s0 + r : 0;
            unsigned char const* src = slot < a.cacheSlots
                ? latB + static_cast<int64_t>(slot) * rowBytes + c * a.vec
                : newB + static_cast<int64_t>(slot - a.cacheSlots) * rowBytes + c * a.vec;
            void* d = dst + r * a.ld * static_cast<int32_t>(sizeof(T)) + c * a.vec;
            int32_t const bytes = in ? a.vec : 0;
            if (a.vec == 16)
            {
                cpAsync<16>(d, src, bytes);
            }
            else if (a.vec == 8)
            {
                cpAsync<8>(d, src, bytes);
            }
            else
            {
                cpAsync<4>(d, src, bytes);
            }
        }
        if (quantized)
        {
            unsigned char* cdst = sCodes(stage);
            int32_t const cacheRows = max(0, min(n, a.cacheSlots - s0));
            for (int32_t i = tid; i < cacheRows * chunksPerRowQ; i += nThreads)
            {
                int32_t const r = i / chunksPerRowQ;
                int32_t const c = i - r * chunksPerRowQ;
                unsigned char const* src = codesB + static_cast<int64_t>(s0 + r) * a.dim + c * a.vecq;
                void* d = cdst + r * a.ldq + c * a.vecq;
                if (a.vecq == 16)
                {
                    cpAsync<16>(d, src, 16);
                }
                else if (a.vecq == 8)
                {
                    cpAsync<8>(d, src, 8);
                }
                else
                {
                    cpAsync<4>(d, src, 4);
                }
            }
        }
        for (int32_t r = tid; r < n; r += nThreads)
        {
            bool const in = s0 + r < a.slots;
            int32_t const slot = in ? s0 + r : 0;
            cpAsync<8>(sLp(stage) + r, slot < a.cacheSlots ? lpB + slot : qpB + (slot - a.cacheSlots), in ? 8 : 0);
        }
        cpAsyncCommit();
    };

    // a quantized tile: codes (shared) -> values in T in the tile's rows, rounded as the reference's dequantize to
    // q's dtype; tile padding rows beyond S (+ T) zeroed; the new rows were copied by load() already
    auto dequantize = [&](int32_t tile, int32_t stage) {
        int32_t const s0 = tile * n;
        unsigned char const* codes = sCodes(stage);
        T* lat = sLat(stage);
        for (int32_t i = tid; i < n * a.dim; i += nThreads)
        {
            int32_t const r = i / a.dim;
            int32_t const c = i - r * a.dim;
            int32_t const slot = s0 + r;
            if (slot < a.cacheSlots)
            {
                float const s = __half2float(a.latScale[b * a.cacheSlots + slot]);
                lat[r * a.ld + c] = fromFloat<T>(decodeLatentCode(codes[r * a.ldq + c], a.format) * s);
            }
            else if (slot >= a.slots)
            {
                lat[r * a.ld + c] = zero;
            }
        }
    };

    int64_t qp[2];
#pragma unroll
    for (int32_t r = 0; r < 2; ++r)
    {
        int32_t const m = row0 + wm * 16 + g + 8 * r;
        qp[r] = m < a.rows ? a.qPos[b * a.queries + m % a.queries] : -1;
    }
    float mRun[2] = {-INFINITY, -INFINITY};
    float lRun[2] = {0.0F, 0.0F};
    float o[NT][4];
#pragma unroll
    for (int32_t j = 0; j < NT; ++j)
    {
#pragma unroll
        for (int32_t i = 0; i < 4; ++i)
        {
            o[j][i] = 0.0F;
        }
    }
    int32_t const slotBase = wr * SW;    // this warp's slots within a tile
    int32_t const colBase = wr * NT * 8; // this warp's output columns
    T const* qRows = sQ + (wm * 16 + (lane & 15)) * a.ld + (lane >> 4) * 8;
    T const* pRows = sP + (wm * 16 + (lane & 15)) * a.ldp + (lane >> 4) * 8;

    load(tileBegin, 0);
    for (int32_t tile = tileBegin; tile < tileEnd; ++tile)
    {
        int32_t const stage = (tile - tileBegin) & 1;
        if (tile + 1 < tileEnd)
        {
            load(tile + 1, stage ^ 1);
            cpAsyncWait<1>();
        }
        else
        {
            cpAsyncWait<0>();
        }
        __syncthreads(); // this tile (and, the first time, the queries) visible to every warp
        if (quantized)
        {
            dequantize(tile, stage);
            __syncthreads(); // the dequantized rows visible to every warp
        }
        T const* lat = sLat(stage);
        int64_t const* lpTile = sLp(stage);

        // S = Q Lat^T for 16 rows x SW slots
        float s[kS][4];
#pragma unroll
        for (int32_t j = 0; j < kS; ++j)
        {
#pragma unroll
            for (int32_t i = 0; i < 4; ++i)
            {
                s[j][i] = 0.0F;
            }
        }
        T const* latRows = lat + (slotBase + (lane & 7) + (lane >> 4) * 8) * a.ld + ((lane >> 3) & 1) * 8;
        for (int32_t kk = 0; kk < a.dk; kk += 16)
        {
            uint32_t af[4];
            ldmatrixX4(af, qRows + kk);
#pragma unroll
            for (int32_t j = 0; j < kS / 2; ++j)
            {
                uint32_t bf[4];
                ldmatrixX4(bf, latRows + j * 16 * a.ld + kk);
                uint32_t const b0[2] = {bf[0], bf[1]};
                uint32_t const b1[2] = {bf[2], bf[3]};
                mma<T>(s[2 * j], af, b0);
                mma<T>(s[2 * j + 1], af, b1);
            }
        }

        // mask and scale; the tile's row maxima
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int32_t j = 0; j < kS; ++j)
        {
#pragma unroll
            for (int32_t i = 0; i < 4; ++i)
            {
                int32_t const local = slotBase + j * 8 + 2 * t4 + (i & 1);
                int32_t const r = i >> 1;
                bool const in = tile * n + local < a.slots;
                int64_t const lp = lpTile[local];
                bool const visible = in && lp >= 0 && lp <= qp[r];
                float const x = visible ? s[j][i] * a.scale : (in ? -FLT_MAX : -INFINITY);
                s[j][i] = x;
                tmax[r] = fmaxf(tmax[r], x);
            }
        }
#pragma unroll
        for (int32_t r = 0; r < 2; ++r)
        {
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(kFullMask, tmax[r], 1));
            tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(kFullMask, tmax[r], 2));
        }
        if (a.warpsR > 1)
        {
            if (t4 == 0)
            {
                sRed[warp * 16 + g] = tmax[0];
                sRed[warp * 16 + g + 8] = tmax[1];
            }
            __syncthreads();
            for (int32_t w = 0; w < a.warpsR; ++w)
            {
                tmax[0] = fmaxf(tmax[0], sRed[(w * a.warpsM + wm) * 16 + g]);
                tmax[1] = fmaxf(tmax[1], sRed[(w * a.warpsM + wm) * 16 + g + 8]);
            }
        }
        float corr[2];
#pragma unroll
        for (int32_t r = 0; r < 2; ++r)
        {
            float const mNew = fmaxf(mRun[r], tmax[r]);
            corr[r] = expf(mRun[r] - mNew); // 0 on the first tile (mRun = -inf)
            mRun[r] = mNew;
        }

        // probabilities to shared memory (input type), row sums of this warp's slots
        float lTile[2] = {0.0F, 0.0F};
#pragma unroll
        for (int32_t j = 0; j < kS; ++j)
        {
            float const p0 = expf(s[j][0] - mRun[0]);
            float const p1 = expf(s[j][1] - mRun[0]);
            float const p2 = expf(s[j][2] - mRun[1]);
            float const p3 = expf(s[j][3] - mRun[1]);
            lTile[0] += p0 + p1;
            lTile[1] += p2 + p3;
            int32_t const col = slotBase + j * 8 + 2 * t4;
            *reinterpret_cast<uint32_t*>(sP + (wm * 16 + g) * a.ldp + col) = packPair<T>(p0, p1);
            *reinterpret_cast<uint32_t*>(sP + (wm * 16 + g + 8) * a.ldp + col) = packPair<T>(p2, p3);
        }
#pragma unroll
        for (int32_t r = 0; r < 2; ++r)
        {
            lRun[r] = lRun[r] * corr[r] + lTile[r];
        }
#pragma unroll
        for (int32_t j = 0; j < NT; ++j)
        {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
        __syncthreads(); // P of every warp written

        // O += P V, V = the tile's first R columns
        T const* vRows = lat + ((lane & 7) + ((lane >> 3) & 1) * 8) * a.ld + colBase + (lane >> 4) * 8;
        for (int32_t kk = 0; kk < n; kk += 16)
        {
            uint32_t pf[4];
            ldmatrixX4(pf, pRows + kk);
#pragma unroll
            for (int32_t j = 0; j < NT / 2; ++j)
            {
                if (colBase + j * 16 < a.rank)
                {
                    uint32_t vf[4];
                    ldmatrixX4Trans(vf, vRows + kk * a.ld + j * 16);
                    uint32_t const b0[2] = {vf[0], vf[1]};
                    uint32_t const b1[2] = {vf[2], vf[3]};
                    mma<T>(o[2 * j], pf, b0);
                    mma<T>(o[2 * j + 1], pf, b1);
                }
            }
        }
        __syncthreads(); // every warp is done with this stage before the next iteration refills it
    }

    // row sums over the quad, then over the warps that shared the rows
#pragma unroll
    for (int32_t r = 0; r < 2; ++r)
    {
        lRun[r] += __shfl_xor_sync(kFullMask, lRun[r], 1);
        lRun[r] += __shfl_xor_sync(kFullMask, lRun[r], 2);
    }
    if (a.warpsR > 1)
    {
        if (t4 == 0)
        {
            sRed[warp * 16 + g] = lRun[0];
            sRed[warp * 16 + g + 8] = lRun[1];
        }
        __syncthreads();
        float total[2] = {0.0F, 0.0F};
        for (int32_t w = 0; w < a.warpsR; ++w)
        {
            total[0] += sRed[(w * a.warpsM + wm) * 16 + g];
            total[1] += sRed[(w * a.warpsM + wm) * 16 + g + 8];
        }
        lRun[0] = total[0];
        lRun[1] = total[1];
    }

#pragma unroll
    for (int32_t j = 0; j < NT; ++j)
    {
#pragma unroll
        for (int32_t i = 0; i < 4; ++i)
        {
            int32_t const col = colBase + j * 8 + 2 * t4 + (i & 1);
            int32_t const m = row0 + wm * 16 + g + 8 * (i >> 1);
            if (col < a.rank && m < a.rows)
            {
                int64_t const row = b * a.rows + m;
                if (a.splits == 1)
                {
                    a.out[row * a.rank + col] = fromFloat<T>(o[j][i] / lRun[i >> 1]);
                }
                else
                {
                    a.partAcc[(row * a.splits + split) * a.rank + col] = o[j][i];
                }
            }
        }
    }
    if (a.splits > 1 && wr == 0 && t4 == 0)
    {
#pragma unroll
        for (int32_t r = 0; r < 2; ++r)
        {
            int32_t const m = row0 + wm * 16 + g + 8 * r;
            if (m < a.rows)
            {
                int64_t const idx = (b * a.rows + m) * a.splits + split;
                a.partMax[idx] = mRun[r];
                a.partSum[idx] = lRun[r];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA-core path

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

//! Stages `nRows` rows of `dim` elements from a contiguous global block into float32 shared rows of stride `dp`;
//! rows >= validRows are zero-filled.
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

//! Stages slots [s0, s0 + kSimtTileSlots) of batch b into float32 shared rows of stride `dp` (rows >= nValid zero):
//! cache rows in T as they are, quantized cache rows dequantized while loading (value rounded to T, as the reference
//! dequantizes to q's dtype), new rows from newLatent. No fp32 copy of the cache exists outside this tile.
template <typename T>
__device__ void stageLatentTile(
    float* dst, LatentSource<T> const& src, int64_t b, int32_t queries, int32_t s0, int32_t nValid, int32_t dim, int32_t dp)
{
    int32_t const S = src.cacheSlots;
    if (src.format == kLatentFormatNone && src.newLatent == nullptr)
    {
        stageRows(dst, src.latent + (b * S + s0) * dim, kSimtTileSlots, nValid, dim, dp);
        return;
    }
    for (int32_t i = threadIdx.x; i < kSimtTileSlots * dim; i += blockDim.x)
    {
        int32_t const row = i / dim;
        int32_t const c = i - row * dim;
        int32_t const slot = s0 + row;
        float v = 0.0F;
        if (row < nValid && slot < S)
        {
            int64_t const at = (b * S + slot) * dim + c;
            if (src.format == kLatentFormatNone)
            {
                v = toFloat(src.latent[at]);
            }
            else
            {
                float const x = decodeLatentCode(src.codes[at], src.format) * __half2float(src.scale[b * S + slot]);
                v = toFloat(fromFloat<T>(x));
            }
        }
        else if (row < nValid)
        {
            v = toFloat(src.newLatent[(b * queries + slot - S) * dim + c]);
        }
        dst[row * dp + c] = v;
    }
}

template <typename T, int32_t RPL>
__global__ void __launch_bounds__(kSimtMaxRowsPerBlock / kSimtRowsPerWarp * 32) latentSimtKernel(
    T const* __restrict__ q, LatentSource<T> const src, int64_t const* __restrict__ qPos,
    int64_t const* __restrict__ latPos, int32_t rows, int32_t queries, int32_t slots, int32_t dim, int32_t dp,
    int32_t rank, float scale, int32_t rowsPerBlock, int32_t tilesPerSplit, int32_t splits,
    float* __restrict__ partMax, float* __restrict__ partSum, float* __restrict__ partAcc)
{
    extern __shared__ __align__(16) unsigned char smemRaw[];
    float* sQ = reinterpret_cast<float*>(smemRaw); // (rowsPerBlock, dp) float32
    float* sTile = sQ + rowsPerBlock * dp;         // (kSimtTileSlots, dp) float32

    int32_t const split = blockIdx.x;
    int32_t const row0 = blockIdx.y * rowsPerBlock;
    int64_t const b = blockIdx.z;
    int32_t const warp = threadIdx.x / 32;
    int32_t const lane = threadIdx.x % 32;

    int32_t const blockRows = min(rowsPerBlock, rows - row0);
    stageRows(sQ, q + (b * rows + row0) * dim, rowsPerBlock, blockRows, dim, dp);

    int64_t qp[kSimtRowsPerWarp];
    bool rowValid[kSimtRowsPerWarp];
    float runMax[kSimtRowsPerWarp];
    float runSum[kSimtRowsPerWarp];
    float acc[kSimtRowsPerWarp][RPL];
#pragma unroll
    for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
    {
        int32_t const local = warp * kSimtRowsPerWarp + r;
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

    int32_t const tiles = static_cast<int32_t>(ceilDiv(slots, kSimtTileSlots));
    int32_t const tileBegin = split * tilesPerSplit;
    int32_t const tileEnd = min(tiles, tileBegin + tilesPerSplit);
    int32_t const dim4 = dim & ~3;
    for (int32_t tile = tileBegin; tile < tileEnd; ++tile)
    {
        int32_t const s0 = tile * kSimtTileSlots;
        int32_t const nValid = min(kSimtTileSlots, slots - s0);
        __syncthreads(); // previous tile fully consumed (and sQ staged on the first pass)
        stageLatentTile(sTile, src, b, queries, s0, nValid, dim, dp);
        __syncthreads();

        // logits: lane = slot
        int32_t const slot = s0 + lane;
        bool const inRange = lane < nValid;
        int32_t const S = src.cacheSlots;
        int64_t const lp = !inRange ? -1 : (slot < S ? latPos[b * S + slot] : qPos[b * queries + slot - S]);
        float dot[kSimtRowsPerWarp];
#pragma unroll
        for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
        {
            dot[r] = 0.0F;
        }
        float const* myRow = sTile + lane * dp;
        float const* qRows = sQ + warp * kSimtRowsPerWarp * dp;
        for (int32_t d = 0; d < dim4; d += 4)
        {
            float4 const t = load4(myRow + d);
#pragma unroll
            for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
            {
                float4 const qv = load4(qRows + r * dp + d);
                dot[r] = fmaf(qv.x, t.x, fmaf(qv.y, t.y, fmaf(qv.z, t.z, fmaf(qv.w, t.w, dot[r]))));
            }
        }
        for (int32_t d = dim4; d < dim; ++d)
        {
            float const t = myRow[d];
#pragma unroll
            for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
            {
                dot[r] = fmaf(qRows[r * dp + d], t, dot[r]);
            }
        }

        float p[kSimtRowsPerWarp];
#pragma unroll
        for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
        {
            bool const visible = inRange && lp >= 0 && lp <= qp[r];
            float const logit = visible ? dot[r] * scale : -FLT_MAX;
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
            for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
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
    for (int32_t r = 0; r < kSimtRowsPerWarp; ++r)
    {
        if (!rowValid[r])
        {
            continue;
        }
        int64_t const idx = (b * rows + row0 + warp * kSimtRowsPerWarp + r) * splits + split;
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

// ---------------------------------------------------------------------------------------------------------------
// Combine

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
    T* __restrict__ out)
{
    __shared__ float weights[kMaxSplits];
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
    int32_t const c0 = blockIdx.y * blockDim.x; // blocks of a row split its channels, so short rows fill the GPU
    for (int32_t c = c0 + threadIdx.x; c < min(rank, c0 + static_cast<int32_t>(blockDim.x)); c += blockDim.x)
    {
        float a = 0.0F;
        for (int32_t s = 0; s < splits; ++s)
        {
            a = fmaf(partAcc[(row * splits + s) * rank + c], weights[s], a);
        }
        out[row * rank + c] = fromFloat<T>(a * inv);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Planning

//! One kernel configuration, before the split count is chosen.
struct Config
{
    LatentAttentionPath path;
    int32_t rowsPerBlock;
    int32_t tileSlots;
    int32_t threads;
    int32_t smem;
    int32_t nt;  // MMA: output n-tiles per warp; SIMT: rows-per-lane template (RPL)
    int32_t sw;  // MMA: slots per warp per tile
    int32_t warpsM;
    int32_t warpsR;
    int32_t vec; // MMA: cp.async chunk bytes
    int32_t dk;
    int32_t ld;
    int32_t ldp;
    int32_t dp;  // SIMT: float row stride
    int32_t vecq; // MMA, quantized cache: cp.async chunk of the codes, bytes
    int32_t ldq;  // MMA, quantized cache: staged code row stride, bytes
};

int32_t mmaVecBytes(int32_t dim, int32_t elemSize, void const* latent)
{
    for (int32_t v : {16, 8, 4})
    {
        if ((dim * elemSize) % v == 0 && reinterpret_cast<uintptr_t>(latent) % static_cast<uintptr_t>(v) == 0)
        {
            return v;
        }
    }
    return 0;
}

bool mmaConfig(LatentAttentionParams const& p, KvxDeviceInfo const& dev, Config& c)
{
    if (p.dataType == static_cast<int32_t>(KvxDType::kFLOAT32) || dev.ccMajor < 8)
    {
        return false;
    }
    bool const quantized = p.latentFormat != kLatentFormatNone;
    // chunk sizes: the cache's codes (1 byte each) and the rows in T (the cache's, and the new rows'), one per source
    int32_t const vecq = quantized ? mmaVecBytes(p.dim, 1, p.latent) : 0;
    int32_t vec = quantized ? 16 : mmaVecBytes(p.dim, 2, p.latent);
    if (p.newLatent != nullptr)
    {
        vec = std::min(vec, mmaVecBytes(p.dim, 2, p.newLatent));
    }
    if (quantized && vecq == 0)
    {
        return false; // no cp.async chunk divides the code rows: the CUDA-core path dequantizes while staging
    }
    if (vec == 0)
    {
        return false;
    }
    int32_t const nt = p.rank <= 64 ? 8 : (p.rank <= 128 ? 16 : 32);
    int32_t const warpsR = static_cast<int32_t>(ceilDiv(p.rank, 8 * nt));
    int32_t const dk = static_cast<int32_t>(ceilDiv(p.dim, 16) * 16);
    int32_t const ld = dk + 8;
    int32_t const ldq = quantized ? dk : 0;
    int64_t const rows = static_cast<int64_t>(p.heads) * p.queries;
    int32_t const wantM = static_cast<int32_t>(std::min<int64_t>(kLargestRowTile / 16, ceilDiv(rows, 16)));
    int32_t const sws32[] = {32, 16};
    int32_t const sws[] = {64, 16};
    for (int32_t warpsM = wantM; warpsM >= 1; --warpsM)
    {
        int32_t const* cand = warpsR > 1 ? sws32 + 1 : (nt == 32 ? sws32 : sws);
        int32_t const nCand = warpsR > 1 ? 1 : 2;
        for (int32_t i = 0; i < nCand; ++i)
        {
            int32_t const sw = cand[i];
            int32_t const n = sw * warpsR;
            int32_t const ldp = n + 8;
            int32_t const smem = mmaSmem(16 * warpsM, n, ld, ldp, warpsM * warpsR, ldq).total;
            if (smem <= dev.smemPerBlockOptin)
            {
                c = Config{LatentAttentionPath::kMma, 16 * warpsM, n, 32 * warpsM * warpsR, smem, nt, sw, warpsM,
                    warpsR, vec, dk, ld, ldp, 0, vecq, ldq};
                return true;
            }
        }
    }
    return false;
}

bool simtConfig(LatentAttentionParams const& p, KvxDeviceInfo const& dev, Config& c)
{
    int64_t const rows = static_cast<int64_t>(p.heads) * p.queries;
    int32_t const dp = paddedDim(p.dim);
    int32_t rpb = static_cast<int32_t>(
        std::min<int64_t>(kSimtMaxRowsPerBlock, ceilDiv(rows, kSimtRowsPerWarp) * kSimtRowsPerWarp));
    auto smemFor = [&](int32_t r) { return static_cast<int64_t>(r + kSimtTileSlots) * dp * 4; };
    while (rpb > kSimtRowsPerWarp && smemFor(rpb) > dev.smemPerBlockOptin)
    {
        rpb = std::max(kSimtRowsPerWarp, rpb / 2 / kSimtRowsPerWarp * kSimtRowsPerWarp);
    }
    if (smemFor(rpb) > dev.smemPerBlockOptin)
    {
        return false; // latent too wide for shared memory
    }
    int32_t const rpl = p.rank <= 64 ? 2 : (p.rank <= 128 ? 4 : (p.rank <= 256 ? 8 : 16));
    c = Config{LatentAttentionPath::kSimt, rpb, kSimtTileSlots, rpb / kSimtRowsPerWarp * 32,
        static_cast<int32_t>(smemFor(rpb)), rpl, 0, 0, 0, 0, 0, 0, 0, dp};
    return true;
}

//! Chooses the split count of `c` (see the file comment) and fills the plan.
LatentAttentionPlan chooseSplits(LatentAttentionParams const& p, KvxDeviceInfo const& dev, Config const& c)
{
    int64_t const es = p.dataType == static_cast<int32_t>(KvxDType::kFLOAT32) ? 4 : 2;
    int64_t const rows = static_cast<int64_t>(p.heads) * p.queries;
    int64_t const rowTiles = ceilDiv(rows, c.rowsPerBlock);
    int32_t const totalSlots = latentAttentionTotalSlots(p);
    int64_t const tiles = ceilDiv(totalSlots, c.tileSlots);
    bool const quantized = p.latentFormat != kLatentFormatNone;
    double const cacheRowBytes = quantized ? p.dim + 2.0 : static_cast<double>(p.dim * es); // codes + fp16 scale
    bool const tensor = c.path == LatentAttentionPath::kMma;

    double const clock = dev.clockKHz > 0 ? dev.clockKHz * 1e3 : 1.4e9;
    double const bw = dev.memClockKHz > 0 && dev.memBusWidth > 0 ? 2.0 * dev.memClockKHz * 1e3 * dev.memBusWidth / 8
                                                                 : 1.0e12;
    int32_t const cc = dev.ccMajor * 10 + dev.ccMinor;
    bool const halfRateTensor = cc == 86 || cc == 89 || dev.ccMajor == 12; // consumer parts: fp32-accumulate at 1/2
    double const fmaPerClk = tensor ? (halfRateTensor ? 512.0 : 1024.0) : (cc == 80 ? 64.0 : 128.0);
    double const smFlops = 2.0 * fmaPerClk * clock;
    double const smBw = 64.0 * clock; // bytes per clock one SM can pull from L2
    int32_t const sms = std::max(1, dev.smCount);
    int32_t const bySmem = std::max(1, dev.smemPerSM / std::max(1, c.smem + 1024));
    int32_t const byRegs = tensor && c.nt == 32 ? 1 : 2;
    int32_t const perSM = std::max(1, std::min({bySmem, 2048 / c.threads, byRegs}));
    int64_t const concurrent = static_cast<int64_t>(sms) * perSM;
    double const bytesPerSlot = cacheRowBytes + 8;
    double const kExtent = tensor ? c.dk + ceilDiv(p.rank, 16) * 16 : p.dim + p.rank;
    double const flopsPerSlot = 2.0 * c.rowsPerBlock * kExtent;
    double const l2 = dev.l2Bytes > 0 ? dev.l2Bytes : 4.0 * 1024 * 1024;

    int64_t const maxSplits = std::max<int64_t>(1,
        std::min<int64_t>({tiles, kMaxSplits, std::max<int64_t>(1, kMaxSplitBlocks / (p.batch * rowTiles))}));
    struct Choice
    {
        int32_t splits;
        double seconds;
        double partial;
    };
    std::vector<Choice> choices;
    for (int64_t s = 1; s <= maxSplits; ++s)
    {
        int64_t const perSplit = ceilDiv(tiles, s);
        if (ceilDiv(tiles, perSplit) != s)
        {
            continue; // the same ranges as a smaller count
        }
        int64_t const blocks = p.batch * rowTiles * s;
        int64_t const waves = ceilDiv(blocks, concurrent);
        int64_t const waveBlocks = std::min(blocks, concurrent);
        double const activeSMs = std::min<double>(sms, static_cast<double>(ceilDiv(waveBlocks, perSM)));
        double const blockBytes = static_cast<double>(perSplit * c.tileSlots) * bytesPerSlot;
        double const blockFlops = static_cast<double>(perSplit * c.tileSlots) * flopsPerSlot;
        double const share = static_cast<double>(std::min<int64_t>(waveBlocks, perSM)); // blocks sharing an SM
        double const tMem = std::max(waveBlocks * blockBytes / static_cast<double>(rowTiles) / bw,
            blockBytes * share / smBw);
        double const tMath = waveBlocks * blockFlops / (activeSMs * smFlops);
        bool const combine = s > 1 || !tensor; // the CUDA-core path always writes partials
        double const partial = combine ? static_cast<double>(p.batch * rows * s) * (p.rank + 2) * 4.0 * 2.0 : 0.0;
        double const tPartial = combine ? partial / (partial / 2 <= l2 ? 2.5 * bw : bw) + 3e-6 : 0.0;
        double const tTiles = static_cast<double>(perSplit) * 2e-7; // per-tile barrier / pipeline latency
        choices.push_back({static_cast<int32_t>(s), waves * std::max(tMem, tMath) + tTiles + tPartial, partial});
    }
    double best = choices.front().seconds;
    for (Choice const& ch : choices)
    {
        best = std::min(best, ch.seconds);
    }
    Choice pick = choices.front();
    bool found = false;
    for (Choice const& ch : choices)
    {
        if (ch.seconds <= best * 1.03 && (!found || ch.partial < pick.partial))
        {
            pick = ch;
            found = true;
        }
    }
    int64_t const perSplit = ceilDiv(tiles, pick.splits);
    LatentAttentionPlan plan{};
    plan.path = c.path;
    plan.rowsPerBlock = c.rowsPerBlock;
    plan.tileSlots = c.tileSlots;
    plan.threads = c.threads;
    plan.splits = static_cast<int32_t>(ceilDiv(tiles, perSplit));
    plan.smemBytes = c.smem;
    plan.latentBytes = static_cast<double>(p.batch) * (p.slots * cacheRowBytes + (totalSlots - p.slots) * p.dim * es);
    plan.partialBytes = pick.partial;
    plan.modelSeconds = pick.seconds;
    return plan;
}

bool configFor(LatentAttentionParams const& p, KvxDeviceInfo const& dev, Config& c)
{
    return mmaConfig(p, dev, c) || simtConfig(p, dev, c);
}

template <typename T, int32_t NT, int32_t SW>
cudaError_t launchMma(LatentAttentionParams const& p, Config const& c, LatentAttentionPlan const& plan,
    WorkspaceLayout const& w, cudaStream_t stream)
{
    auto* ws = static_cast<unsigned char*>(p.workspace);
    MmaArgs<T> a{};
    a.q = static_cast<T const*>(p.q);
    bool const quantized = p.latentFormat != kLatentFormatNone;
    a.latent = quantized ? nullptr : static_cast<T const*>(p.latent);
    a.newLatent = static_cast<T const*>(p.newLatent);
    a.codes = quantized ? static_cast<unsigned char const*>(p.latent) : nullptr;
    a.latScale = static_cast<__half const*>(p.latentScale);
    a.format = p.latentFormat;
    a.ldq = c.ldq;
    a.vecq = c.vecq;
    a.qPos = p.qPositions;
    a.latPos = p.latentPositions;
    a.rows = p.heads * p.queries;
    a.queries = p.queries;
    a.slots = latentAttentionTotalSlots(p);
    a.cacheSlots = p.slots;
    a.dim = p.dim;
    a.dk = c.dk;
    a.ld = c.ld;
    a.ldp = c.ldp;
    a.rank = p.rank;
    a.warpsM = c.warpsM;
    a.warpsR = c.warpsR;
    a.tileSlots = c.tileSlots;
    int32_t const tiles = static_cast<int32_t>(ceilDiv(a.slots, c.tileSlots));
    a.tilesPerSplit = static_cast<int32_t>(ceilDiv(tiles, plan.splits));
    a.splits = plan.splits;
    a.vec = c.vec;
    a.scale = p.scale;
    a.out = static_cast<T*>(p.out);
    if (plan.splits > 1)
    {
        a.partAcc = reinterpret_cast<float*>(ws + w.acc);
        a.partMax = reinterpret_cast<float*>(ws + w.max);
        a.partSum = reinterpret_cast<float*>(ws + w.sum);
    }
    dim3 const grid(static_cast<unsigned int>(ceilDiv(a.rows, c.rowsPerBlock)), plan.splits, p.batch);
    latentMmaKernel<T, NT, SW><<<grid, c.threads, c.smem, stream>>>(a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t dispatchMma(LatentAttentionParams const& p, Config const& c, LatentAttentionPlan const& plan,
    WorkspaceLayout const& w, cudaStream_t stream)
{
    if (c.nt == 8)
    {
        return c.sw == 64 ? launchMma<T, 8, 64>(p, c, plan, w, stream) : launchMma<T, 8, 16>(p, c, plan, w, stream);
    }
    if (c.nt == 16)
    {
        return c.sw == 64 ? launchMma<T, 16, 64>(p, c, plan, w, stream) : launchMma<T, 16, 16>(p, c, plan, w, stream);
    }
    return c.sw == 32 ? launchMma<T, 32, 32>(p, c, plan, w, stream) : launchMma<T, 32, 16>(p, c, plan, w, stream);
}

template <typename T, int32_t RPL>
cudaError_t launchSimt(LatentAttentionParams const& p, Config const& c, LatentAttentionPlan const& plan,
    WorkspaceLayout const& w, cudaStream_t stream)
{
    auto* ws = static_cast<unsigned char*>(p.workspace);
    int32_t const rows = p.heads * p.queries;
    int32_t const slots = latentAttentionTotalSlots(p);
    int32_t const tiles = static_cast<int32_t>(ceilDiv(slots, kSimtTileSlots));
    int32_t const tilesPerSplit = static_cast<int32_t>(ceilDiv(tiles, plan.splits));
    dim3 const grid(plan.splits, static_cast<unsigned int>(ceilDiv(rows, c.rowsPerBlock)), p.batch);
    bool const quantized = p.latentFormat != kLatentFormatNone;
    LatentSource<T> const src{quantized ? nullptr : static_cast<T const*>(p.latent),
        quantized ? static_cast<unsigned char const*>(p.latent) : nullptr, static_cast<__half const*>(p.latentScale),
        static_cast<T const*>(p.newLatent), p.latentFormat, p.slots};
    latentSimtKernel<T, RPL><<<grid, c.threads, c.smem, stream>>>(static_cast<T const*>(p.q), src, p.qPositions,
        p.latentPositions, rows, p.queries, slots, p.dim, c.dp,
        p.rank, p.scale, c.rowsPerBlock, tilesPerSplit, plan.splits, reinterpret_cast<float*>(ws + w.max),
        reinterpret_cast<float*>(ws + w.sum), reinterpret_cast<float*>(ws + w.acc));
    return cudaGetLastError();
}

template <typename T>
cudaError_t dispatchSimt(LatentAttentionParams const& p, Config const& c, LatentAttentionPlan const& plan,
    WorkspaceLayout const& w, cudaStream_t stream)
{
    switch (c.nt)
    {
    case 2: return launchSimt<T, 2>(p, c, plan, w, stream);
    case 4: return launchSimt<T, 4>(p, c, plan, w, stream);
    case 8: return launchSimt<T, 8>(p, c, plan, w, stream);
    default: return launchSimt<T, 16>(p, c, plan, w, stream);
    }
}

template <typename T>
cudaError_t launchCombine(LatentAttentionParams const& p, LatentAttentionPlan const& plan, WorkspaceLayout const& w,
    cudaStream_t stream)
{
    auto* ws = static_cast<unsigned char*>(p.workspace);
    dim3 const grid(static_cast<unsigned int>(static_cast<int64_t>(p.batch) * p.heads * p.queries),
        static_cast<unsigned int>(ceilDiv(p.rank, kCombineThreads)));
    latentCombineKernel<T><<<grid, kCombineThreads, 0, stream>>>(reinterpret_cast<float const*>(ws + w.max),
        reinterpret_cast<float const*>(ws + w.sum), reinterpret_cast<float const*>(ws + w.acc), plan.splits, p.rank,
        static_cast<T*>(p.out));
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchTyped(LatentAttentionParams const& p, Config const& c, LatentAttentionPlan const& plan,
    WorkspaceLayout const& w, cudaStream_t stream)
{
    cudaError_t e = cudaSuccess;
    if constexpr (std::is_same<T, float>::value)
    {
        e = dispatchSimt<T>(p, c, plan, w, stream);
    }
    else
    {
        e = c.path == LatentAttentionPath::kMma ? dispatchMma<T>(p, c, plan, w, stream)
                                                : dispatchSimt<T>(p, c, plan, w, stream);
    }
    if (e != cudaSuccess || (c.path == LatentAttentionPath::kMma && plan.splits == 1))
    {
        return e;
    }
    return launchCombine<T>(p, plan, w, stream);
}

bool validParams(LatentAttentionParams const& p)
{
    return p.dataType >= 0 && p.dataType <= 2 && p.batch >= 0 && p.heads >= 1 && p.queries >= 1 && p.slots >= 1
        && p.rank >= 1 && p.rank <= kLatentAttentionMaxRank && p.dim >= p.rank && p.dim <= kLatentAttentionMaxDim
        && static_cast<int64_t>(p.heads) * p.queries <= 0x7FFFFFFF
        && static_cast<int64_t>(p.slots) + p.queries <= 0x7FFFFFFF && p.latentFormat >= kLatentFormatNone
        && p.latentFormat <= kLatentFormatFp8 && (p.latentFormat == kLatentFormatNone || p.latentScale != nullptr);
}

template <typename T>
cudaError_t setSmemLimits(int32_t bytes)
{
    cudaFuncAttribute const a = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t e = cudaFuncSetAttribute(latentSimtKernel<T, 2>, a, bytes);
    e = e == cudaSuccess ? cudaFuncSetAttribute(latentSimtKernel<T, 4>, a, bytes) : e;
    e = e == cudaSuccess ? cudaFuncSetAttribute(latentSimtKernel<T, 8>, a, bytes) : e;
    e = e == cudaSuccess ? cudaFuncSetAttribute(latentSimtKernel<T, 16>, a, bytes) : e;
    if constexpr (!std::is_same<T, float>::value)
    {
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 8, 64>, a, bytes) : e;
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 8, 16>, a, bytes) : e;
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 16, 64>, a, bytes) : e;
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 16, 16>, a, bytes) : e;
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 32, 32>, a, bytes) : e;
        e = e == cudaSuccess ? cudaFuncSetAttribute(latentMmaKernel<T, 32, 16>, a, bytes) : e;
    }
    return e;
}

} // namespace

size_t latentAttentionWorkspaceSize(
    int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank)
{
    if (batch < 1 || heads < 1 || queries < 1 || slots < 1 || rank < 1 || dim < rank)
    {
        return 0;
    }
    int64_t const rows = static_cast<int64_t>(heads) * queries;
    return workspaceLayout(batch * rows, splitBound(batch, rows, slots), rank).total;
}

LatentAttentionPlan planLatentAttention(LatentAttentionParams const& p, KvxDeviceInfo const& dev)
{
    Config c{};
    if (!validParams(p) || p.batch == 0 || !configFor(p, dev, c))
    {
        return LatentAttentionPlan{};
    }
    return chooseSplits(p, dev, c);
}

cudaError_t prepareLatentAttention(KvxDeviceInfo const& dev)
{
    int32_t const bytes = dev.smemPerBlockOptin;
    cudaError_t e = setSmemLimits<float>(bytes);
    e = e == cudaSuccess ? setSmemLimits<__half>(bytes) : e;
    return e == cudaSuccess ? setSmemLimits<__nv_bfloat16>(bytes) : e;
}

cudaError_t launchLatentAttention(LatentAttentionParams const& p, KvxDeviceInfo const& dev, cudaStream_t stream)
{
    if (!validParams(p))
    {
        return cudaErrorInvalidValue;
    }
    if (p.batch == 0)
    {
        return cudaSuccess;
    }
    Config c{};
    if (!configFor(p, dev, c))
    {
        return cudaErrorInvalidValue; // latent too wide for this GPU's shared memory
    }
    LatentAttentionPlan const plan = chooseSplits(p, dev, c);
    int64_t const batchRows = static_cast<int64_t>(p.batch) * p.heads * p.queries;
    WorkspaceLayout const w = workspaceLayout(batchRows, plan.splits, p.rank);
    bool const needsWorkspace = c.path == LatentAttentionPath::kSimt || plan.splits > 1;
    if (needsWorkspace && (p.workspace == nullptr || p.workspaceSize < w.total))
    {
        return cudaErrorInvalidValue;
    }
    switch (static_cast<KvxDType>(p.dataType))
    {
    case KvxDType::kFLOAT32: return launchTyped<float>(p, c, plan, w, stream);
    case KvxDType::kFLOAT16: return launchTyped<__half>(p, c, plan, w, stream);
    case KvxDType::kBFLOAT16: return launchTyped<__nv_bfloat16>(p, c, plan, w, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace kvexport

extern "C" KVX_API int32_t kvx_latent_attention(int32_t dataType, void const* q, void const* latent,
    int64_t const* qPositions, int64_t const* latentPositions, int32_t batch, int32_t heads, int32_t queries,
    int32_t slots, int32_t dim, int32_t rank, float scale, void* out, void* workspace, size_t workspaceSize,
    KvxDeviceInfo const* dev, cudaStream_t stream)
{
    if (dev == nullptr)
    {
        return static_cast<int32_t>(cudaErrorInvalidValue);
    }
    kvexport::LatentAttentionParams p{dataType, q, latent, qPositions, latentPositions, batch, heads, queries, slots,
        dim, rank, scale, out, workspace, workspaceSize, kvexport::kLatentFormatNone, nullptr, nullptr};
    return static_cast<int32_t>(kvexport::launchLatentAttention(p, *dev, stream));
}

extern "C" KVX_API int32_t kvx_latent_attention_v2(int32_t dataType, int32_t latentFormat, void const* q,
    void const* latent, void const* latentScale, void const* newLatent, int64_t const* qPositions,
    int64_t const* latentPositions, int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim,
    int32_t rank, float scale, void* out, void* workspace, size_t workspaceSize, KvxDeviceInfo const* dev,
    cudaStream_t stream)
{
    if (dev == nullptr)
    {
        return static_cast<int32_t>(cudaErrorInvalidValue);
    }
    kvexport::LatentAttentionParams p{dataType, q, latent, qPositions, latentPositions, batch, heads, queries, slots,
        dim, rank, scale, out, workspace, workspaceSize, latentFormat, latentScale, newLatent};
    return static_cast<int32_t>(kvexport::launchLatentAttention(p, *dev, stream));
}

extern "C" KVX_API size_t kvx_latent_attention_workspace_size(
    int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank)
{
    return kvexport::latentAttentionWorkspaceSize(batch, heads, queries, slots, dim, rank);
}

extern "C" KVX_API int32_t kvx_latent_attention_plan(int32_t dataType, int32_t batch, int32_t heads, int32_t queries,
    int32_t slots, int32_t dim, int32_t rank, KvxDeviceInfo const* dev, int32_t* plan, double* bytes)
{
    return kvx_latent_attention_plan_v2(
        dataType, kvexport::kLatentFormatNone, 0, batch, heads, queries, slots, dim, rank, dev, plan, bytes);
}

extern "C" KVX_API int32_t kvx_latent_attention_plan_v2(int32_t dataType, int32_t latentFormat, int32_t hasNewLatent,
    int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank, KvxDeviceInfo const* dev,
    int32_t* plan, double* bytes)
{
    if (dev == nullptr || plan == nullptr || bytes == nullptr)
    {
        return static_cast<int32_t>(cudaErrorInvalidValue);
    }
    // planning reads pointers only for their alignment and for whether new rows / scales are given
    void const* const aligned = reinterpret_cast<void const*>(static_cast<uintptr_t>(256));
    kvexport::LatentAttentionParams p{dataType, nullptr, nullptr, nullptr, nullptr, batch, heads, queries, slots, dim,
        rank, 1.0F, nullptr, nullptr, 0, latentFormat, latentFormat != kvexport::kLatentFormatNone ? aligned : nullptr,
        hasNewLatent != 0 ? aligned : nullptr};
    kvexport::LatentAttentionPlan const r = kvexport::planLatentAttention(p, *dev);
    plan[0] = static_cast<int32_t>(r.path);
    plan[1] = r.rowsPerBlock;
    plan[2] = r.tileSlots;
    plan[3] = r.threads;
    plan[4] = r.splits;
    plan[5] = r.smemBytes;
    bytes[0] = r.latentBytes;
    bytes[1] = r.partialBytes;
    bytes[2] = r.modelSeconds;
    return r.splits > 0 ? 0 : static_cast<int32_t>(cudaErrorInvalidValue);
}

extern "C" KVX_API int32_t kvx_query_device(KvxDeviceInfo* dev)
{
    if (dev == nullptr)
    {
        return static_cast<int32_t>(cudaErrorInvalidValue);
    }
    cudaError_t e = kvexport::queryDevice(*dev);
    if (e == cudaSuccess)
    {
        e = kvexport::prepareLatentAttention(*dev);
    }
    return static_cast<int32_t>(e);
}

extern "C" KVX_API int32_t kvx_abi_version()
{
    return KVX_ABI_VERSION;
}
