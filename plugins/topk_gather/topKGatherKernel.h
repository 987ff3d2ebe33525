// SPDX-License-Identifier: Apache-2.0
// TopKGather CUDA kernel: per (batch, head), keep the k best-scoring cache slots in slot order.
#pragma once

#include "../common/kvxDefs.h"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace kvexport
{

//! Largest S (cache slots per head) the single-block bitonic sort handles: 8192 slots use 64 KiB of shared
//! memory per block (opt-in shared memory, available on sm_80 and newer).
constexpr int32_t kTopKGatherMaxSlots = 8192;

//! Raw device pointers and shapes of one TopKGather call (see docs/custom_ops.md).
struct TopKGatherParams
{
    int32_t scoreType;            //!< KvxDType of scores
    int32_t dataType;             //!< KvxDType of keys and values (also kept_keys / kept_values)
    void const* scores;           //!< (B, H, S)
    void const* keys;             //!< (B, H, S, Dk)
    void const* values;           //!< (B, H, S, Dv); may be null when Dv == 0
    int64_t const* positions;     //!< (B, H, S), -1 = empty
    int32_t batch;                //!< B
    int32_t heads;                //!< H
    int32_t slots;                //!< S
    int32_t keyDim;               //!< Dk
    int32_t valueDim;             //!< Dv (may be 0)
    int32_t k;                    //!< slots kept, 1 <= k <= S
    void* keptKeys;               //!< (B, H, k, Dk)
    void* keptValues;             //!< (B, H, k, Dv); may be null when Dv == 0
    int64_t* keptPositions;       //!< (B, H, k)
    int64_t* keptIndices;         //!< (B, H, k), ascending
};

//! Validates the shapes and launches the kernel on `stream`. Returns cudaErrorInvalidValue for shapes outside
//! the limits (S > kTopKGatherMaxSlots, k outside [1, S], unknown dtype codes).
cudaError_t launchTopKGather(TopKGatherParams const& p, cudaStream_t stream);

} // namespace kvexport

extern "C"
{
    //! C interface for ctypes / tests: same meaning as TopKGatherParams; returns a cudaError_t code (0 = success).
    KVX_API int32_t kvx_topk_gather(int32_t scoreType, int32_t dataType, void const* scores, void const* keys,
        void const* values, int64_t const* positions, int32_t batch, int32_t heads, int32_t slots, int32_t keyDim,
        int32_t valueDim, int32_t k, void* keptKeys, void* keptValues, int64_t* keptPositions, int64_t* keptIndices,
        cudaStream_t stream);

    //! Largest S kvx_topk_gather accepts.
    KVX_API int32_t kvx_topk_gather_max_slots();
}
