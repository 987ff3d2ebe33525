// SPDX-License-Identifier: Apache-2.0
// CPU execution of the kvexport CUDA kernels (tests only): the unmodified .cu sources, after two mechanical rewrites
// (`__shared__` declarations and `<<<>>>` launches, tests/plugins/cpu_kernels.py), compile with g++ against this
// header, which stands in for the CUDA runtime and device intrinsics.
//
//  - Every CUDA thread is its own host execution context with its own stack: a fiber (default; one OS thread runs
//    the fibers of a block, switching at every barrier) or, with KVX_SHIM_OS_THREADS=1 (forced under
//    ThreadSanitizer), one std::thread per CUDA thread.
//  - __syncthreads() is a block barrier that also checks every thread reached the same call site; warp shuffles,
//    votes, __syncwarp, mma and ldmatrix are warp rendezvous over the lanes of their mask (a lane in the mask that
//    has exited, or lanes arriving with different masks, abort with a message).
//  - Shared memory (static and dynamic) is allocated per block, exactly sized (AddressSanitizer sees overruns), and
//    filled with 0xFF before the block starts; the CPU-side "device" limits (SM count, opt-in shared memory per
//    block, compute capability) come from ::kvxshim::config() so tests can emulate different GPUs.
//  - It checks indexing and synchronisation; it says nothing about speed or the device's floating-point rounding.
#pragma once

#define KVX_CPU_SHIM 1

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_THREAD__) && !defined(KVX_SHIM_OS_THREADS)
#define KVX_SHIM_OS_THREADS 1
#endif
#ifndef KVX_SHIM_OS_THREADS
#define KVX_SHIM_OS_THREADS 0
#endif

// ------------------------------------------------------------------------------------------ qualifiers and types
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct dim3
{
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_)
        , y(y_)
        , z(z_)
    {
    }
};

struct alignas(8) float2
{
    float x, y;
};
struct alignas(16) float4
{
    float x, y, z, w;
};
struct alignas(8) uint2
{
    unsigned int x, y;
};
struct alignas(16) uint4
{
    unsigned int x, y, z, w;
};
struct alignas(8) int2
{
    int x, y;
};
struct alignas(16) int4
{
    int x, y, z, w;
};
inline float2 make_float2(float x, float y)
{
    return {x, y};
}
inline float4 make_float4(float x, float y, float z, float w)
{
    return {x, y, z, w};
}
inline uint2 make_uint2(unsigned x, unsigned y)
{
    return {x, y};
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
    return {x, y, z, w};
}

// ------------------------------------------------------------------------------------------ runtime API subset
enum cudaError
{
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorNotSupported = 801,
};
using cudaError_t = cudaError;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaDeviceAttr
{
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrClockRate = 13,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMemoryClockRate = 36,
    cudaDevAttrGlobalMemoryBusWidth = 37,
    cudaDevAttrL2CacheSize = 38,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute
{
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

namespace kvxshim
{

//! The emulated device. Defaults: an H200-like sm_90 part; tests change them per case (kvx_cpu_driver options).
struct DeviceConfig
{
    int smCount = 132;
    int smemPerBlockOptin = 232448;
    int smemPerSM = 233472;
    int ccMajor = 9;
    int ccMinor = 0;
    int clockKHz = 1980000;
    int memClockKHz = 2619000;
    int memBusWidth = 6144;
    int l2Bytes = 50 * 1024 * 1024;
};
DeviceConfig& config();

[[noreturn]] void fatal(char const* fmt, ...) __attribute__((format(printf, 1, 2)));

struct Block;

//! One CUDA thread's identity.
struct Thread
{
    dim3 tIdx, bIdx, bDim, gDim; // threadIdx, blockIdx, blockDim, gridDim
    int linear = 0; //!< linear thread index in the block
    int lane = 0;
    int warp = 0;
    Block* block = nullptr;
    void* cpAsync = nullptr; //!< pending cp.async groups (kvx_cpu_mma.h)
};
Thread& self();

void syncThreads(char const* file, int line);
int syncThreadsCount(int pred, char const* file, int line);

//! Warp rendezvous: every lane of `mask` contributes `bytes` (<= 64) of data; once all have, `fn(all, ctx)` runs on
//! the calling lane with the 32 contributions (lanes outside the mask are left unset).
void warpCollective(unsigned mask, void const* mine, size_t bytes, void (*fn)(unsigned char const (*all)[64], void*),
    void* ctx, char const* what);

//! The 32 contributions of a warp rendezvous, read as T.
template <typename T>
struct LaneValues
{
    unsigned char const (*all)[64];
    T const& operator[](int lane) const
    {
        return *reinterpret_cast<T const*>(all[lane]);
    }
};

template <typename T, typename F>
inline void warpCollective(unsigned mask, T const& mine, char const* what, F&& f)
{
    static_assert(sizeof(T) <= 64 && std::is_trivially_copyable<T>::value, "warp exchange payload");
    using Fn = std::remove_reference_t<F>;
    warpCollective(
        mask, &mine, sizeof(T),
        [](unsigned char const (*all)[64], void* p) { (*static_cast<Fn*>(p))(LaneValues<T>{all}); }, &f, what);
}

//! Dynamic shared memory of the running block (extern __shared__), and static __shared__ variables by site id.
void* dynamicSharedRaw();
void* staticSharedRaw(int site, size_t bytes, size_t align);
bool inShared(void const* p, size_t bytes);

template <typename T>
inline T* dynamicShared()
{
    return static_cast<T*>(dynamicSharedRaw());
}
template <typename T>
inline T& staticShared(int site)
{
    return *static_cast<T*>(staticSharedRaw(site, sizeof(T), alignof(T) > 16 ? alignof(T) : 16));
}

//! cp.async emulation: a copy is queued when issued and performed when a later cp.async.wait_group retires its group
//! (the latest moment the PTX memory model allows), so a read of the destination before the wait sees stale data.
void cpAsyncIssue(void* smemDst, void const* gmemSrc, int bytes, int srcBytes);
void cpAsyncCommit();
void cpAsyncWait(int keepGroups);

// ------------------------------------------------------------------------------------------ launches
using KernelBody = void (*)(void* ctx);
cudaError_t runGrid(void const* kernelId, dim3 grid, dim3 block, size_t smem, KernelBody body, void* ctx);
void setLastError(cudaError_t e);

template <typename... P>
struct Launch
{
    void (*kernel)(P...);
    dim3 grid, block;
    size_t smem;

    template <typename... A>
    void operator()(A&&... args) const
    {
        static_assert(sizeof...(A) == sizeof...(P), "kernel argument count");
        std::tuple<std::decay_t<P>...> params(static_cast<P>(std::forward<A>(args))...);
        struct Ctx
        {
            void (*k)(P...);
            std::tuple<std::decay_t<P>...>* params;
        } ctx{kernel, &params};
        cudaError_t const e = runGrid(
            reinterpret_cast<void const*>(kernel), grid, block, smem,
            [](void* p) {
                Ctx* c = static_cast<Ctx*>(p);
                std::tuple<std::decay_t<P>...> local = *c->params; // each thread gets its own copy, as on the GPU
                std::apply(c->k, local);
            },
            &ctx);
        if (e != cudaSuccess)
        {
            setLastError(e);
        }
    }
};

inline dim3 toDim3(dim3 d)
{
    return d;
}
inline dim3 toDim3(unsigned long long x)
{
    return dim3(static_cast<unsigned int>(x));
}

//! `kernel<<<grid, block, smem, stream>>>(args)` is rewritten to `::kvxshim::launch(kernel, grid, block, smem,
//! stream)(args)`.
template <typename... P, typename G, typename B>
inline Launch<P...> launch(void (*kernel)(P...), G const& grid, B const& block, size_t smem = 0, cudaStream_t = nullptr)
{
    return Launch<P...>{kernel, toDim3(grid), toDim3(block), smem};
}

cudaError_t funcSetAttribute(void const* kernel, cudaFuncAttribute attr, int value);

} // namespace kvxshim

#define threadIdx (::kvxshim::self().tIdx)
#define blockIdx (::kvxshim::self().bIdx)
#define blockDim (::kvxshim::self().bDim)
#define gridDim (::kvxshim::self().gDim)
#define __syncthreads() ::kvxshim::syncThreads(__FILE__, __LINE__)
#define __syncthreads_count(p) ::kvxshim::syncThreadsCount((p) ? 1 : 0, __FILE__, __LINE__)
constexpr int warpSize = 32;

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
char const* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpyAsync(void* dst, void const* src, size_t count, int kind, cudaStream_t stream = nullptr);
template <typename... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value)
{
    return ::kvxshim::funcSetAttribute(reinterpret_cast<void const*>(kernel), attr, value);
}
constexpr int cudaMemcpyDeviceToDevice = 3;

// ------------------------------------------------------------------------------------------ device intrinsics
using std::isfinite;
using std::isinf;
using std::isnan;

inline int min(int a, int b)
{
    return a < b ? a : b;
}
inline int max(int a, int b)
{
    return a > b ? a : b;
}
inline unsigned min(unsigned a, unsigned b)
{
    return a < b ? a : b;
}
inline unsigned max(unsigned a, unsigned b)
{
    return a > b ? a : b;
}
inline long long min(long long a, long long b)
{
    return a < b ? a : b;
}
inline long long max(long long a, long long b)
{
    return a > b ? a : b;
}
inline long min(long a, long b)
{
    return a < b ? a : b;
}
inline long max(long a, long b)
{
    return a > b ? a : b;
}
inline float min(float a, float b)
{
    return fminf(a, b);
}
inline float max(float a, float b)
{
    return fmaxf(a, b);
}

inline float __expf(float x)
{
    return expf(x);
}
inline float __fdividef(float a, float b)
{
    return a / b;
}
inline float __frcp_rn(float x)
{
    return 1.0F / x;
}
inline float __saturatef(float x)
{
    return x < 0.0F ? 0.0F : (x > 1.0F ? 1.0F : x);
}
inline unsigned int __float_as_uint(float f)
{
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned int u)
{
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f)
{
    int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int u)
{
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __popc(unsigned int x)
{
    return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}
inline int __clz(unsigned int x)
{
    return x == 0 ? 32 : __builtin_clz(x);
}
inline int __ffs(unsigned int x)
{
    return __builtin_ffs(static_cast<int>(x));
}
inline unsigned int __brev(unsigned int x)
{
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i)
    {
        r = (r << 1) | ((x >> i) & 1u);
    }
    return r;
}
template <typename T>
inline T __ldg(T const* p)
{
    return *p;
}
inline void __threadfence()
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline void __threadfence_block()
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline unsigned int __activemask()
{
    return 0xFFFFFFFFu;
}

template <typename T>
inline T atomicAdd(T* p, T v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v)
{
    float old = 0.0F;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    float desired = old + v;
    while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    {
        desired = old + v;
    }
    return old;
}
template <typename T>
inline T atomicMax(T* p, T v)
{
    return __atomic_fetch_max(p, v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicMin(T* p, T v)
{
    return __atomic_fetch_min(p, v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicOr(T* p, T v)
{
    return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicExch(T* p, T v)
{
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}

// warp-level primitives: rendezvous of the lanes in `mask`
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    T r{};
    int const lane = ::kvxshim::self().lane;
    int const base = lane & ~(width - 1);
    int const from = base + (src & (width - 1));
    ::kvxshim::warpCollective(mask, v, "__shfl_sync", [&](auto all) { r = all[from]; });
    return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int laneMask, int width = 32)
{
    T r{};
    int const lane = ::kvxshim::self().lane;
    int const from = lane ^ laneMask;
    int const target = ((from & ~(width - 1)) == (lane & ~(width - 1))) ? from : lane;
    ::kvxshim::warpCollective(mask, v, "__shfl_xor_sync", [&](auto all) { r = all[target]; });
    return r;
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    T r{};
    int const lane = ::kvxshim::self().lane;
    int const inSeg = lane & (width - 1);
    int const from = inSeg >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
    ::kvxshim::warpCollective(mask, v, "__shfl_up_sync", [&](auto all) { r = all[from]; });
    return r;
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    T r{};
    int const lane = ::kvxshim::self().lane;
    int const inSeg = lane & (width - 1);
    int const from = inSeg + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
    ::kvxshim::warpCollective(mask, v, "__shfl_down_sync", [&](auto all) { r = all[from]; });
    return r;
}
inline unsigned __ballot_sync(unsigned mask, int pred)
{
    unsigned r = 0;
    int const p = pred ? 1 : 0;
    ::kvxshim::warpCollective(mask, p, "__ballot_sync", [&](auto all) {
        for (int i = 0; i < 32; ++i)
        {
            if (((mask >> i) & 1u) && all[i])
            {
                r |= 1u << i;
            }
        }
    });
    return r;
}
inline int __any_sync(unsigned mask, int pred)
{
    return __ballot_sync(mask, pred) != 0;
}
inline int __all_sync(unsigned mask, int pred)
{
    return __ballot_sync(mask, pred) == mask;
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu)
{
    int const none = 0;
    ::kvxshim::warpCollective(mask, none, "__syncwarp", [](auto) {});
}
