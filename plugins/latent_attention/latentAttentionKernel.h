// SPDX-License-Identifier: Apache-2.0
// LatentAttention CUDA kernels: absorbed multi-head latent attention over a shared latent cache (DeepSeek-V2/V3
// "absorb" mode, X-EcoMLA): out = softmax(scale * q latent^T, masked) @ latent[..., :R].
#pragma once

#include "../common/kvxDefs.h"
#include "../common/kvxDevice.h"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace kvexport
{

//! Largest latent rank R (value width) the kernels handle.
constexpr int32_t kLatentAttentionMaxRank = 512;
//! Largest latent width D = R + Dr.
constexpr int32_t kLatentAttentionMaxDim = 1024;

//! Raw device pointers and shapes of one LatentAttention call (see docs/custom_ops.md). Rows = heads * queries.
struct LatentAttentionParams
{
    int32_t dataType;               //!< KvxDType of q, latent and out
    void const* q;                  //!< (B, Hq, T, D) absorbed queries, D = R + Dr
    void const* latent;             //!< (B, S, D) latent cache [c_kv ; RoPE(k_pe)]
    int64_t const* qPositions;      //!< (B, T), -1 = padding query
    int64_t const* latentPositions; //!< (B, S), -1 = empty slot
    int32_t batch;                  //!< B
    int32_t heads;                  //!< Hq
    int32_t queries;                //!< T
    int32_t slots;                  //!< S
    int32_t dim;                    //!< D
    int32_t rank;                   //!< R <= D
    float scale;                    //!< softmax scale
    void* out;                      //!< (B, Hq, T, R)
    void* workspace;                //!< latentAttentionWorkspaceSize(...) bytes, 256-byte aligned
    size_t workspaceSize;
    // op version 2 (docs/custom_ops.md): a quantized cache and this step's own rows
    int32_t latentFormat;           //!< 0: latent in dataType; 1: uint8 int8 codes, (code - 128) * s; 2: uint8 e4m3fn
    void const* latentScale;        //!< (B, S) float16 per-row scale s (latentFormat != 0)
    void const* newLatent;          //!< (B, T, D) in dataType, attended after the S cache slots at qPositions, or null
};

//! Latent formats (the op's `latent_format` attribute, kvexport.ops.latent_attention.LATENT_FORMATS).
constexpr int32_t kLatentFormatNone = 0;
constexpr int32_t kLatentFormatInt8 = 1;
constexpr int32_t kLatentFormatFp8 = 2;

//! Slots a launch attends: the S cache slots plus, with newLatent, the T new rows. Pass this as `slots` to
//! latentAttentionWorkspaceSize.
inline int32_t latentAttentionTotalSlots(LatentAttentionParams const& p)
{
    return p.slots + (p.newLatent != nullptr ? p.queries : 0);
}

//! Kernel paths of a launch.
enum class LatentAttentionPath : int32_t
{
    kSimt = 0, //!< CUDA cores, float32 shared tiles: fp32, or no config of the tensor-core path fits
    kMma = 1,  //!< tensor cores (mma.sync m16n8k16), cp.async double-buffered tiles: fp16 / bf16 on sm_80+
};

//! What a launch does: the kernel path, its tile shape, the slot splits chosen by the cost model and the bytes that
//! cross the memory bus (latent read once; split partials written and read back by the combine kernel).
struct LatentAttentionPlan
{
    LatentAttentionPath path;
    int32_t rowsPerBlock; //!< query rows (heads x queries) one block owns
    int32_t tileSlots;    //!< latent rows per shared-memory tile
    int32_t threads;      //!< threads per block
    int32_t splits;       //!< slot ranges per row tile (1 = no combine kernel)
    int32_t smemBytes;    //!< dynamic shared memory per block
    double latentBytes;   //!< B * S * D * element size
    double partialBytes;  //!< float32 partials written + read (0 when splits == 1)
    double modelSeconds;  //!< the cost model's estimate (for the benchmark table; not a measurement)
};

//! Scratch bytes of one call: float32 split partials (accumulators, row max, row sum). An upper bound over every GPU
//! and path, so TensorRT can size it at build time.
size_t latentAttentionWorkspaceSize(
    int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank);

//! The plan launchLatentAttention would use for `p` on `dev` (pointers are only checked for alignment).
LatentAttentionPlan planLatentAttention(LatentAttentionParams const& p, KvxDeviceInfo const& dev);

//! Once per device before launching: raises the kernels' dynamic shared-memory limit to the device's opt-in size.
cudaError_t prepareLatentAttention(KvxDeviceInfo const& dev);

//! Validates, plans and launches (the attention kernel, plus the combine kernel when the slots are split).
cudaError_t launchLatentAttention(LatentAttentionParams const& p, KvxDeviceInfo const& dev, cudaStream_t stream);

} // namespace kvexport

extern "C"
{
    //! C interface for ctypes / tests; returns a cudaError_t code (0 = success). `dev` from kvx_query_device.
    KVX_API int32_t kvx_latent_attention(int32_t dataType, void const* q, void const* latent,
        int64_t const* qPositions, int64_t const* latentPositions, int32_t batch, int32_t heads, int32_t queries,
        int32_t slots, int32_t dim, int32_t rank, float scale, void* out, void* workspace, size_t workspaceSize,
        KvxDeviceInfo const* dev, cudaStream_t stream);

    //! Op version 2: `latentFormat` 0 / 1 / 2 (latent = dataType rows, or uint8 codes with `latentScale` (B, S)
    //! float16), `newLatent` (B, T, D) in dataType or null. The workspace is kvx_latent_attention_workspace_size with
    //! slots = S + T when newLatent is given. Returns cudaErrorInvalidValue (1) for an unknown format or a missing scale.
    KVX_API int32_t kvx_latent_attention_v2(int32_t dataType, int32_t latentFormat, void const* q, void const* latent,
        void const* latentScale, void const* newLatent, int64_t const* qPositions, int64_t const* latentPositions,
        int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank, float scale, void* out,
        void* workspace, size_t workspaceSize, KvxDeviceInfo const* dev, cudaStream_t stream);

    KVX_API size_t kvx_latent_attention_workspace_size(
        int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank);

    //! The plan of a call (pointers null: alignment assumed): path, rowsPerBlock, tileSlots, threads, splits,
    //! smemBytes into plan[0..5]; latentBytes, partialBytes, modelSeconds into bytes[0..2].
    KVX_API int32_t kvx_latent_attention_plan(int32_t dataType, int32_t batch, int32_t heads, int32_t queries,
        int32_t slots, int32_t dim, int32_t rank, KvxDeviceInfo const* dev, int32_t* plan, double* bytes);

    //! As kvx_latent_attention_plan for an op-version-2 call: `latentFormat` 0 / 1 / 2, `hasNewLatent` 0 / 1 (the
    //! new rows' pointer is taken as 256-byte aligned, like the others).
    KVX_API int32_t kvx_latent_attention_plan_v2(int32_t dataType, int32_t latentFormat, int32_t hasNewLatent,
        int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t dim, int32_t rank,
        KvxDeviceInfo const* dev, int32_t* plan, double* bytes);

    //! Queries the current device and prepares the kernels for it (prepareLatentAttention).
    KVX_API int32_t kvx_query_device(KvxDeviceInfo* dev);

    //! KVX_ABI_VERSION of the library.
    KVX_API int32_t kvx_abi_version();
}
