// SPDX-License-Identifier: Apache-2.0
// LatentAttention CUDA kernels: absorbed multi-head latent attention over a shared latent cache (DeepSeek-V2/V3
// "absorb" mode, X-EcoMLA), plus the per-slot attention mass used by the eviction presses.
#pragma once

#include "../common/kvxDefs.h"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace kvexport
{

//! Largest latent rank R (value width) the kernels handle.
constexpr int32_t kLatentAttentionMaxRank = 512;
//! Largest latent width D = R + Dr.
constexpr int32_t kLatentAttentionMaxDim = 1024;

//! Raw device pointers and shapes of one LatentAttention call (see docs/custom_ops.md). M = heads * queries.
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
    float* attnMass;                //!< (B, S) float32
    void* workspace;                //!< latentAttentionWorkspaceSize(...) bytes, 256-byte aligned
    size_t workspaceSize;
};

//! Bytes of scratch memory one call needs: the float logits (B, Hq*T, S), per-split softmax partials and the row
//! statistics. An upper bound over every GPU, so TensorRT can size it at build time.
size_t latentAttentionWorkspaceSize(int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t rank);

//! Validates and launches the three kernels (split attention, split combine, attention mass) on `stream`.
cudaError_t launchLatentAttention(LatentAttentionParams const& p, cudaStream_t stream);

} // namespace kvexport

extern "C"
{
    //! C interface for ctypes / tests; returns a cudaError_t code (0 = success).
    KVX_API int32_t kvx_latent_attention(int32_t dataType, void const* q, void const* latent,
        int64_t const* qPositions, int64_t const* latentPositions, int32_t batch, int32_t heads, int32_t queries,
        int32_t slots, int32_t dim, int32_t rank, float scale, void* out, float* attnMass, void* workspace,
        size_t workspaceSize, cudaStream_t stream);

    KVX_API size_t kvx_latent_attention_workspace_size(
        int32_t batch, int32_t heads, int32_t queries, int32_t slots, int32_t rank);

    //! KVX_ABI_VERSION of the library.
    KVX_API int32_t kvx_abi_version();
}
