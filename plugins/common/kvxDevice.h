// SPDX-License-Identifier: Apache-2.0
// The device attributes the kernels plan their launches with, queried once (the plugins do it in onShapeChange, the
// C interface in kvx_query_device) and handed to every launch, so no launch calls the CUDA runtime for them.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

//! Attributes of one CUDA device (plain C layout: the kvx_* C interface passes it by pointer).
struct KvxDeviceInfo
{
    int32_t device;            //!< CUDA device ordinal
    int32_t smCount;           //!< streaming multiprocessors
    int32_t smemPerBlockOptin; //!< opt-in shared memory per block, bytes
    int32_t smemPerSM;         //!< shared memory per multiprocessor, bytes
    int32_t ccMajor;           //!< compute capability
    int32_t ccMinor;
    int32_t clockKHz;    //!< peak SM clock (0 when the runtime does not report it)
    int32_t memClockKHz; //!< peak memory clock (0 when not reported)
    int32_t memBusWidth; //!< memory bus width, bits (0 when not reported)
    int32_t l2Bytes;     //!< L2 cache size, bytes
};

namespace kvexport
{

//! Fills `info` for the current device. Attributes a runtime no longer reports are left 0 (the launch planner then
//! uses conservative defaults).
inline cudaError_t queryDevice(KvxDeviceInfo& info)
{
    info = KvxDeviceInfo{};
    cudaError_t e = cudaGetDevice(&info.device);
    struct Attr
    {
        int32_t* dst;
        cudaDeviceAttr attr;
        bool required;
    } const attrs[] = {
        {&info.smCount, cudaDevAttrMultiProcessorCount, true},
        {&info.smemPerBlockOptin, cudaDevAttrMaxSharedMemoryPerBlockOptin, true},
        {&info.smemPerSM, cudaDevAttrMaxSharedMemoryPerMultiprocessor, true},
        {&info.ccMajor, cudaDevAttrComputeCapabilityMajor, true},
        {&info.ccMinor, cudaDevAttrComputeCapabilityMinor, true},
        {&info.clockKHz, cudaDevAttrClockRate, false},
        {&info.memClockKHz, cudaDevAttrMemoryClockRate, false},
        {&info.memBusWidth, cudaDevAttrGlobalMemoryBusWidth, false},
        {&info.l2Bytes, cudaDevAttrL2CacheSize, false},
    };
    for (Attr const& a : attrs)
    {
        if (e != cudaSuccess)
        {
            break;
        }
        int v = 0;
        cudaError_t const r = cudaDeviceGetAttribute(&v, a.attr, info.device);
        if (r == cudaSuccess)
        {
            *a.dst = v;
        }
        else if (a.required)
        {
            e = r;
        }
        else
        {
            (void) cudaGetLastError(); // optional attribute: clear the error, keep 0
        }
    }
    return e;
}

} // namespace kvexport
