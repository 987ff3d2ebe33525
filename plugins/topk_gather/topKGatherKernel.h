// SPDX-License-Identifier: Apache-2.0
// TopKGather CUDA kernels: per (batch, head), keep the k best-scoring cache slots in slot order.
#pragma once

#include "../common/kvxDefs.h"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace kvexport
{

//! Slots one block of the selection kernels handles; a (batch, head) row of S slots uses ceil(S / 1024) blocks.
constexpr int32_t kTopKGatherChunk = 1024;

//! Raw device pointers and shapes of one TopKGather call (see docs/custom_ops.md). Scores are float32 only.
struct TopKGatherParams
{
    int32_t dataType;         //!< KvxDType of keys and values (also kept_keys / kept_values); 3 = uint8 codes
    float const* scores;      //!< (B, H, S) float32
    void const* keys;         //!< (B, H, S, Dk)
    void const* values;       //!< (B, H, S, Dv); may be null when Dv == 0
    int64_t const* positions; //!< (B, H, S), -1 = empty
    int32_t batch;            //!< B
    int32_t heads;            //!< H
    int32_t slots;            //!< S
    int32_t keyDim;           //!< Dk
    int32_t valueDim;         //!< Dv (may be 0)
    int32_t k;                //!< slots kept, 1 <= k <= S
    void* keptKeys;           //!< (B, H, k, Dk)
    void* keptValues;         //!< (B, H, k, Dv); may be null when Dv == 0
    int64_t* keptPositions;   //!< (B, H, k)
    int64_t* keptIndices;     //!< (B, H, k), ascending
    void* workspace;          //!< topKGatherWorkspaceSize(B, H, S) bytes, 256-byte aligned
    size_t workspaceSize;
};

//! Scratch bytes of one call: the 32-bit sort keys (B*H*S), four 256-bin histograms and two counters per block.
size_t topKGatherWorkspaceSize(int32_t batch, int32_t heads, int32_t slots);

//! Validates the shapes and launches the selection (4 radix passes over 8-bit digits of the keys, several blocks
//! per row) and the gather on `stream`. cudaErrorInvalidValue for k outside [1, S], unknown dtypes, a short
//! workspace.
cudaError_t launchTopKGather(TopKGatherParams const& p, cudaStream_t stream);

} // namespace kvexport

extern "C"
{
    //! C interface for ctypes / tests: same meaning as TopKGatherParams; returns a cudaError_t code (0 = success).
    KVX_API int32_t kvx_topk_gather(int32_t dataType, float const* scores, void const* keys, void const* values,
        int64_t const* positions, int32_t batch, int32_t heads, int32_t slots, int32_t keyDim, int32_t valueDim,
        int32_t k, void* keptKeys, void* keptValues, int64_t* keptPositions, int64_t* keptIndices, void* workspace,
        size_t workspaceSize, cudaStream_t stream);

    KVX_API size_t kvx_topk_gather_workspace_size(int32_t batch, int32_t heads, int32_t slots);
}
