// SPDX-License-Identifier: Apache-2.0
// Runtime of the CPU shim (kvx_cpu_shim.h): grid launches, per-block thread contexts (fibers or OS threads),
// barriers, warp rendezvous, shared memory and cp.async queues.
#include "kvx_cpu_shim.h"

#include <atomic>
#include <cstdarg>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

#if KVX_SHIM_OS_THREADS
#include <condition_variable>
#include <mutex>
#include <thread>
#elif !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define KVX_ASAN 1
#else
#define KVX_ASAN 0
#endif

namespace kvxshim
{

DeviceConfig& config()
{
    static DeviceConfig c;
    return c;
}

void fatal(char const* fmt, ...)
{
    std::fflush(stdout);
    std::fputs("kvx_cpu_shim: ", stderr);
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fputc('\n', stderr);
    std::fflush(stderr);
    std::_Exit(3);
}

namespace
{

cudaError_t gLastError = cudaSuccess;
std::map<void const*, int> gMaxDynamicSmem; // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
unsigned long long gLaunchCount = 0;

constexpr size_t kStaticSmemLimit = 48 * 1024;

struct CpCopy
{
    void* dst;
    void const* src;
    int bytes;
    int srcBytes;
};
struct CpAsyncState
{
    std::vector<CpCopy> open;              // issued, not committed
    std::deque<std::vector<CpCopy>> groups; // committed, oldest first
};

struct WarpOp
{
    unsigned mask = 0;
    unsigned arrived = 0;
    bool collecting = false;
    bool complete = false;
    int readers = 0;
    char const* what = nullptr;
    alignas(16) unsigned char data[32][64];
};

//! Lock and wake-up of one rendezvous domain (a block's barrier, or one warp): in OS-thread mode a mutex and a
//! condition variable, so ThreadSanitizer sees exactly the happens-before edges the hardware gives (a warp operation
//! orders its own lanes only); nothing in fiber mode.
struct Sync
{
#if KVX_SHIM_OS_THREADS
    std::mutex mu;
    std::condition_variable cv;
#endif
};

struct Warp
{
    std::vector<std::unique_ptr<WarpOp>> ops;
    std::unique_ptr<Sync> sync = std::make_unique<Sync>();
};

struct StaticVar
{
    int site;
    size_t bytes;
    unsigned char* ptr;
};

#if KVX_SHIM_OS_THREADS
thread_local Thread* tlsSelf = nullptr;
#else
Thread* gCurrent = nullptr;
#endif

} // namespace

void threadExited(Thread& t);

// ------------------------------------------------------------------------------------------------ fibers
#if !KVX_SHIM_OS_THREADS
namespace
{
#if defined(__x86_64__)
extern "C" void kvx_shim_switch(void** saveSp, void* loadSp);
extern "C" void kvx_shim_trampoline();
asm(R"(
    .text
    .globl kvx_shim_switch
    .type kvx_shim_switch,@function
kvx_shim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw (%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw (%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvx_shim_switch, .-kvx_shim_switch

    .globl kvx_shim_trampoline
    .type kvx_shim_trampoline,@function
kvx_shim_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size kvx_shim_trampoline, .-kvx_shim_trampoline
)");
#endif

size_t stackBytes()
{
    return (KVX_ASAN ? 4u : 1u) * 512u * 1024u;
}

struct Fiber
{
    Thread* thread = nullptr;
    unsigned char* stack = nullptr; // lowest address (guard page below the usable part)
    size_t size = 0;
    bool done = false;
    bool (*waitFn)(void*) = nullptr;
    void* waitCtx = nullptr;
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
    void* fakeStack = nullptr;
};

struct Scheduler
{
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
    void const* bottom = nullptr;
    size_t size = 0;
    Fiber* running = nullptr;
    KernelBody body = nullptr;
    void* ctx = nullptr;
};
Scheduler gSched;
std::vector<unsigned char*> gStacks; // reused across blocks and launches

unsigned char* stackFor(size_t i)
{
    while (gStacks.size() <= i)
    {
        size_t const page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        void* m = mmap(nullptr, stackBytes() + page, PROT_READ | PROT_WRITE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
        {
            fatal("cannot map a fiber stack");
        }
        mprotect(m, page, PROT_NONE); // guard page: a stack overflow faults instead of corrupting a neighbour
        gStacks.push_back(static_cast<unsigned char*>(m) + page);
    }
    return gStacks[i];
}

void toScheduler(Fiber& f, bool dying)
{
#if KVX_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f.fakeStack, gSched.bottom, gSched.size);
#endif
#if defined(__x86_64__)
    kvx_shim_switch(&f.sp, gSched.sp);
#else
    swapcontext(&f.uc, &gSched.uc);
#endif
#if KVX_ASAN
    __sanitizer_finish_switch_fiber(f.fakeStack, &gSched.bottom, &gSched.size);
#endif
    (void) dying;
}

void fiberMain(Fiber* f)
{
#if KVX_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &gSched.bottom, &gSched.size);
#endif
    gSched.body(gSched.ctx);
    f->done = true;
    threadExited(*f->thread);
    toScheduler(*f, true);
    fatal("a finished fiber was resumed");
}

#if !defined(__x86_64__)
void fiberEntry(unsigned hi, unsigned lo)
{
    fiberMain(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

void startFiber(Fiber& f)
{
#if defined(__x86_64__)
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + f.size) & ~static_cast<uintptr_t>(15);
    top -= 16;
    auto* sp = reinterpret_cast<unsigned char*>(top - 72);
    std::memset(sp, 0, 72);
    uint16_t const fpucw = 0x037F;
    uint32_t const mxcsr = 0x1F80;
    std::memcpy(sp + 0, &fpucw, 2);
    std::memcpy(sp + 8, &mxcsr, 4);
    auto put = [&](int off, uintptr_t v) { std::memcpy(sp + off, &v, 8); };
    put(32, reinterpret_cast<uintptr_t>(&fiberMain)); // r13: entry
    put(40, reinterpret_cast<uintptr_t>(&f));         // r12: argument
    put(64, reinterpret_cast<uintptr_t>(&kvx_shim_trampoline));
    f.sp = sp;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = f.size;
    f.uc.uc_link = nullptr;
    uintptr_t const p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiberEntry), 2, static_cast<unsigned>(p >> 32),
        static_cast<unsigned>(p & 0xFFFFFFFFu));
#endif
}

void resume(Fiber& f)
{
    gSched.running = &f;
    gCurrent = f.thread;
#if KVX_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, f.size);
#endif
#if defined(__x86_64__)
    kvx_shim_switch(&gSched.sp, f.sp);
#else
    swapcontext(&gSched.uc, &f.uc);
#endif
#if KVX_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    gSched.running = nullptr;
    gCurrent = nullptr;
}

} // namespace
#endif // !KVX_SHIM_OS_THREADS

// ------------------------------------------------------------------------------------------------ block state
struct Block
{
    dim3 idx;
    int nThreads = 0;
    int live = 0;
    std::vector<Thread> threads;
    std::vector<char> exited;
    std::vector<Warp> warps;
    // __syncthreads
    int barArrived = 0;
    unsigned long long barGen = 0;
    char const* barFile = nullptr;
    int barLine = 0;
    int barCount = 0;
    int barCountResult = 0;
    // shared memory
    unsigned char* dyn = nullptr;
    size_t dynBytes = 0;
    // static __shared__ variables: appended under sharedSync, published with a release store so lookups need no lock
    // (a lock on every lookup would order all threads of the block and hide races from ThreadSanitizer)
    static constexpr int kMaxStatics = 64;
    StaticVar statics[kMaxStatics];
    std::atomic<int> nStatics{0};
    size_t staticBytes = 0;
    std::vector<CpAsyncState> cp;
    Sync sync;       // __syncthreads
    Sync sharedSync; // static shared allocation
#if !KVX_SHIM_OS_THREADS
    std::vector<Fiber> fibers;
#endif
};

namespace
{

#if KVX_SHIM_OS_THREADS
using Lock = std::unique_lock<std::mutex>;
Lock lock(Sync& s)
{
    return Lock(s.mu);
}
void notifyAll(Sync& s)
{
    s.cv.notify_all();
}
template <typename P>
void waitFor(Sync& s, Lock& lk, P pred)
{
    s.cv.wait(lk, pred);
}
#else
struct Lock
{
};
Lock lock(Sync&)
{
    return Lock{};
}
void notifyAll(Sync&) {}
template <typename P>
void waitFor(Sync&, Lock&, P pred)
{
    if (pred())
    {
        return;
    }
    Fiber& f = *gSched.running;
    f.waitFn = [](void* c) { return (*static_cast<P*>(c))(); };
    f.waitCtx = &pred;
    toScheduler(f, false);
}
#endif

std::string where(Block const& b)
{
    char buf[96];
    std::snprintf(buf, sizeof(buf), "block (%u, %u, %u)", b.idx.x, b.idx.y, b.idx.z);
    return buf;
}

} // namespace

Thread& self()
{
#if KVX_SHIM_OS_THREADS
    Thread* t = tlsSelf;
#else
    Thread* t = gCurrent;
#endif
    if (t == nullptr)
    {
        fatal("a device intrinsic was called outside a kernel launch");
    }
    return *t;
}

void threadExited(Thread& t)
{
    Block& b = *t.block;
    CpAsyncState& cp = b.cp[t.linear];
    if (!cp.open.empty() || !cp.groups.empty())
    {
        fatal("%s thread %d exited with cp.async copies that no cp.async.wait_group retired", where(b).c_str(),
            t.linear);
    }
    {
        Warp& w = b.warps[t.warp];
        Lock lw = lock(*w.sync);
        b.exited[t.linear] = 1;
        unsigned const bit = 1u << t.lane;
        for (auto& op : w.ops)
        {
            if (op->collecting && (op->mask & bit) && !(op->arrived & bit))
            {
                fatal("%s thread %d exited while lanes of its warp wait for it in %s", where(b).c_str(), t.linear,
                    op->what);
            }
        }
    }
    Lock lk = lock(b.sync);
    --b.live;
    if (b.barArrived > 0 && b.barArrived == b.live)
    {
        b.barArrived = 0;
        b.barCountResult = b.barCount;
        b.barCount = 0;
        ++b.barGen;
    }
    notifyAll(b.sync);
}

namespace
{
int barrier(int pred, char const* file, int line)
{
    Thread& t = self();
    Block& b = *t.block;
    Lock lk = lock(b.sync);
    if (b.barArrived == 0)
    {
        b.barFile = file;
        b.barLine = line;
    }
    else if (b.barLine != line || std::strcmp(b.barFile, file) != 0)
    {
        fatal("%s: threads wait at different __syncthreads (%s:%d and %s:%d)", where(b).c_str(), b.barFile,
            b.barLine, file, line);
    }
    unsigned long long const gen = b.barGen;
    b.barCount += pred;
    ++b.barArrived;
    if (b.barArrived == b.live)
    {
        b.barArrived = 0;
        b.barCountResult = b.barCount;
        b.barCount = 0;
        ++b.barGen;
        notifyAll(b.sync);
    }
    else
    {
        waitFor(b.sync, lk, [&b, gen] { return b.barGen != gen; });
    }
    return b.barCountResult;
}
} // namespace

void syncThreads(char const* file, int line)
{
    barrier(0, file, line);
}

int syncThreadsCount(int pred, char const* file, int line)
{
    return barrier(pred, file, line);
}

void warpCollective(unsigned mask, void const* mine, size_t bytes, void (*fn)(unsigned char const (*all)[64], void*),
    void* ctx, char const* what)
{
    Thread& t = self();
    Block& b = *t.block;
    unsigned const bit = 1u << t.lane;
    if (!(mask & bit))
    {
        fatal("%s thread %d calls %s with a mask 0x%08x that leaves out its own lane", where(b).c_str(), t.linear,
            what, mask);
    }
    int const warpBase = t.warp * 32;
    for (int l = 0; l < 32; ++l)
    {
        if ((mask >> l) & 1u)
        {
            if (warpBase + l >= b.nThreads)
            {
                fatal("%s: %s mask 0x%08x names lane %d, which does not exist (block of %d threads)",
                    where(b).c_str(), what, mask, l, b.nThreads);
            }
        }
    }
    Warp& w = b.warps[t.warp];
    Lock lk = lock(*w.sync);
    for (int l = 0; l < 32; ++l)
    {
        if (((mask >> l) & 1u) && b.exited[warpBase + l])
        {
            fatal("%s thread %d: %s waits for lane %d, which has exited", where(b).c_str(), t.linear, what, l);
        }
    }
    WarpOp* op = nullptr;
    for (auto& o : w.ops)
    {
        if (o->collecting && o->mask == mask && !(o->arrived & bit))
        {
            op = o.get();
            break;
        }
    }
    if (op == nullptr)
    {
        for (auto& o : w.ops)
        {
            if (!o->collecting && !o->complete)
            {
                op = o.get();
                break;
            }
        }
        if (op == nullptr)
        {
            w.ops.push_back(std::make_unique<WarpOp>());
            op = w.ops.back().get();
        }
        op->mask = mask;
        op->arrived = 0;
        op->collecting = true;
        op->what = what;
    }
    else if (std::strcmp(op->what, what) != 0)
    {
        fatal("%s warp %d: lanes meet in different warp operations (%s and %s)", where(b).c_str(), t.warp, op->what,
            what);
    }
    std::memcpy(op->data[t.lane], mine, bytes);
    op->arrived |= bit;
    if (op->arrived == mask)
    {
        op->collecting = false;
        op->complete = true;
        op->readers = __builtin_popcount(mask);
        notifyAll(*w.sync);
    }
    else
    {
        waitFor(*w.sync, lk, [op] { return op->complete; });
    }
    fn(op->data, ctx);
    if (--op->readers == 0)
    {
        op->complete = false;
    }
}

// ------------------------------------------------------------------------------------------------ shared memory
void* dynamicSharedRaw()
{
    Block& b = *self().block;
    if (b.dynBytes == 0)
    {
        fatal("%s uses dynamic shared memory but was launched with 0 bytes of it", where(b).c_str());
    }
    return b.dyn;
}

namespace
{
//! Exactly `bytes` (AddressSanitizer flags the first byte past them), aligned.
void* exactAlloc(size_t bytes, size_t align)
{
    void* p = nullptr;
    if (posix_memalign(&p, align, bytes == 0 ? 1 : bytes) != 0)
    {
        fatal("out of host memory for %zu bytes of shared memory", bytes);
    }
    return p;
}

StaticVar const* findStatic(Block const& b, int site)
{
    int const n = b.nStatics.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i)
    {
        if (b.statics[i].site == site)
        {
            return &b.statics[i];
        }
    }
    return nullptr;
}
} // namespace

void* staticSharedRaw(int site, size_t bytes, size_t align)
{
    Block& b = *self().block;
    StaticVar const* v = findStatic(b, site);
    if (v == nullptr)
    {
        Lock lk = lock(b.sharedSync);
        v = findStatic(b, site);
        if (v == nullptr)
        {
            int const n = b.nStatics.load(std::memory_order_relaxed);
            if (n == Block::kMaxStatics)
            {
                fatal("more than %d static __shared__ variables", Block::kMaxStatics);
            }
            auto* p = static_cast<unsigned char*>(exactAlloc(bytes, align));
            std::memset(p, 0xFF, bytes);
            b.statics[n] = StaticVar{site, bytes, p};
            b.staticBytes += (bytes + align - 1) / align * align;
            if (b.staticBytes > kStaticSmemLimit)
            {
                fatal("static shared memory exceeds 48 KiB (%zu bytes)", b.staticBytes);
            }
            b.nStatics.store(n + 1, std::memory_order_release);
            v = &b.statics[n];
        }
    }
    if (v->bytes != bytes)
    {
        fatal("__shared__ variable %d declared with %zu and %zu bytes in one launch", site, v->bytes, bytes);
    }
    return v->ptr;
}

bool inShared(void const* p, size_t bytes)
{
    Block& b = *self().block;
    auto const* c = static_cast<unsigned char const*>(p);
    if (b.dyn != nullptr && c >= b.dyn && c + bytes <= b.dyn + b.dynBytes)
    {
        return true;
    }
    int const n = b.nStatics.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i)
    {
        if (c >= b.statics[i].ptr && c + bytes <= b.statics[i].ptr + b.statics[i].bytes)
        {
            return true;
        }
    }
    return false;
}

// ------------------------------------------------------------------------------------------------ cp.async
void cpAsyncIssue(void* smemDst, void const* gmemSrc, int bytes, int srcBytes)
{
    Thread& t = self();
    if (bytes != 4 && bytes != 8 && bytes != 16)
    {
        fatal("cp.async of %d bytes (4, 8 or 16 only)", bytes);
    }
    if (srcBytes < 0 || srcBytes > bytes)
    {
        fatal("cp.async src-size %d outside [0, %d]", srcBytes, bytes);
    }
    if (reinterpret_cast<uintptr_t>(smemDst) % static_cast<uintptr_t>(bytes) != 0
        || (srcBytes > 0 && reinterpret_cast<uintptr_t>(gmemSrc) % static_cast<uintptr_t>(bytes) != 0))
    {
        fatal("cp.async of %d bytes with a misaligned address (dst %p, src %p)", bytes, smemDst, gmemSrc);
    }
    if (!inShared(smemDst, static_cast<size_t>(bytes)))
    {
        fatal("cp.async destination %p is not in the block's shared memory", smemDst);
    }
    t.block->cp[t.linear].open.push_back({smemDst, gmemSrc, bytes, srcBytes});
}

void cpAsyncCommit()
{
    Thread& t = self();
    CpAsyncState& s = t.block->cp[t.linear];
    s.groups.push_back(std::move(s.open));
    s.open.clear();
}

void cpAsyncWait(int keepGroups)
{
    Thread& t = self();
    CpAsyncState& s = t.block->cp[t.linear];
    while (static_cast<int>(s.groups.size()) > keepGroups)
    {
        for (CpCopy const& c : s.groups.front())
        {
            auto* d = static_cast<unsigned char*>(c.dst);
            if (c.srcBytes > 0)
            {
                std::memcpy(d, c.src, static_cast<size_t>(c.srcBytes));
            }
            std::memset(d + c.srcBytes, 0, static_cast<size_t>(c.bytes - c.srcBytes));
        }
        s.groups.pop_front();
    }
}

// ------------------------------------------------------------------------------------------------ launches
void setLastError(cudaError_t e)
{
    gLastError = e;
}

cudaError_t funcSetAttribute(void const* kernel, cudaFuncAttribute attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    {
        return cudaErrorInvalidValue;
    }
    if (value < 0 || value > config().smemPerBlockOptin)
    {
        return cudaErrorInvalidValue;
    }
    gMaxDynamicSmem[kernel] = value;
    return cudaSuccess;
}

namespace
{
#if KVX_SHIM_OS_THREADS
//! OS threads that run the CUDA threads of one block at a time; created once and reused by every block and launch.
class ThreadPool
{
public:
    ~ThreadPool()
    {
        {
            std::lock_guard<std::mutex> lk(mMu);
            mQuit = true;
        }
        mWork.notify_all();
        for (auto& t : mThreads)
        {
            t.join();
        }
    }

    void run(Block& b, KernelBody body, void* ctx)
    {
        std::unique_lock<std::mutex> lk(mMu);
        while (static_cast<int>(mThreads.size()) < b.nThreads)
        {
            int const id = static_cast<int>(mThreads.size());
            mThreads.emplace_back([this, id] { worker(id); });
        }
        mBlock = &b;
        mBody = body;
        mCtx = ctx;
        mActive = b.nThreads;
        mDone = 0;
        ++mGen;
        mWork.notify_all();
        mFinished.wait(lk, [this] { return mDone == mActive; });
    }

private:
    void worker(int id)
    {
        unsigned long long seen = 0;
        for (;;)
        {
            std::unique_lock<std::mutex> lk(mMu);
            mWork.wait(lk, [&] { return mQuit || (mGen != seen && id < mActive); });
            if (mQuit)
            {
                return;
            }
            seen = mGen;
            Block* b = mBlock;
            KernelBody body = mBody;
            void* ctx = mCtx;
            lk.unlock();
            tlsSelf = &b->threads[static_cast<size_t>(id)];
            body(ctx);
            threadExited(*tlsSelf);
            tlsSelf = nullptr;
            lk.lock();
            if (++mDone == mActive)
            {
                mFinished.notify_all();
            }
        }
    }

    std::mutex mMu;
    std::condition_variable mWork, mFinished;
    std::vector<std::thread> mThreads;
    unsigned long long mGen = 0;
    int mActive = 0;
    int mDone = 0;
    bool mQuit = false;
    Block* mBlock = nullptr;
    KernelBody mBody = nullptr;
    void* mCtx = nullptr;
};
#endif

void runBlock(Block& b, KernelBody body, void* ctx, bool reverse)
{
#if KVX_SHIM_OS_THREADS
    (void) reverse;
    static ThreadPool pool;
    pool.run(b, body, ctx);
#else
    gSched.body = body;
    gSched.ctx = ctx;
    b.fibers.assign(static_cast<size_t>(b.nThreads), Fiber{});
    for (int i = 0; i < b.nThreads; ++i)
    {
        Fiber& f = b.fibers[static_cast<size_t>(i)];
        f.thread = &b.threads[static_cast<size_t>(i)];
        f.stack = stackFor(static_cast<size_t>(i));
        f.size = stackBytes();
        startFiber(f);
    }
    for (;;)
    {
        bool any = false;
        bool ran = false;
        for (int k = 0; k < b.nThreads; ++k)
        {
            Fiber& f = b.fibers[static_cast<size_t>(reverse ? b.nThreads - 1 - k : k)];
            if (f.done)
            {
                continue;
            }
            any = true;
            if (f.waitFn != nullptr && !f.waitFn(f.waitCtx))
            {
                continue;
            }
            f.waitFn = nullptr;
            resume(f);
            ran = true;
        }
        if (!any)
        {
            break;
        }
        if (!ran)
        {
            std::string who;
            for (int i = 0; i < b.nThreads && who.size() < 600; ++i)
            {
                if (!b.fibers[static_cast<size_t>(i)].done)
                {
                    who += " " + std::to_string(i);
                }
            }
            fatal("%s deadlocked: threads%s wait forever (a barrier or warp operation some threads never reach)",
                where(b).c_str(), who.c_str());
        }
    }
#endif
}
} // namespace

cudaError_t runGrid(void const* kernelId, dim3 grid, dim3 block, size_t smem, KernelBody body, void* ctx)
{
    unsigned long long const threads = static_cast<unsigned long long>(block.x) * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0
        || grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535)
    {
        return cudaErrorInvalidConfiguration;
    }
    if (smem > 48 * 1024)
    {
        auto it = gMaxDynamicSmem.find(kernelId);
        if (it == gMaxDynamicSmem.end() || static_cast<size_t>(it->second) < smem)
        {
            return cudaErrorInvalidValue; // what the GPU does without cudaFuncSetAttribute
        }
    }
    if (smem > static_cast<size_t>(config().smemPerBlockOptin))
    {
        return cudaErrorInvalidValue;
    }
    ++gLaunchCount;
    int const n = static_cast<int>(threads);
    for (unsigned z = 0; z < grid.z; ++z)
    {
        for (unsigned y = 0; y < grid.y; ++y)
        {
            for (unsigned x = 0; x < grid.x; ++x)
            {
                Block b;
                b.idx = dim3(x, y, z);
                b.nThreads = n;
                b.live = n;
                b.threads.resize(static_cast<size_t>(n));
                b.exited.assign(static_cast<size_t>(n), 0);
                b.warps.resize(static_cast<size_t>((n + 31) / 32));
                b.cp.resize(static_cast<size_t>(n));
                for (int i = 0; i < n; ++i)
                {
                    Thread& t = b.threads[static_cast<size_t>(i)];
                    t.tIdx = dim3(static_cast<unsigned>(i) % block.x, static_cast<unsigned>(i) / block.x % block.y,
                        static_cast<unsigned>(i) / (block.x * block.y));
                    t.bIdx = b.idx;
                    t.bDim = block;
                    t.gDim = grid;
                    t.linear = i;
                    t.lane = i % 32;
                    t.warp = i / 32;
                    t.block = &b;
                }
                b.dynBytes = smem;
                if (smem > 0)
                {
                    b.dyn = static_cast<unsigned char*>(exactAlloc(smem, 128));
                    std::memset(b.dyn, 0xFF, smem);
                }
                bool const reverse = ((x + y + z + gLaunchCount) & 1u) != 0;
                runBlock(b, body, ctx, reverse);
                if (b.staticBytes + b.dynBytes > static_cast<size_t>(config().smemPerBlockOptin))
                {
                    fatal("block uses %zu bytes of shared memory, more than the device's %d",
                        b.staticBytes + b.dynBytes, config().smemPerBlockOptin);
                }
                std::free(b.dyn);
                for (int i = 0; i < b.nStatics.load(); ++i)
                {
                    std::free(b.statics[i].ptr);
                }
            }
        }
    }
    return cudaSuccess;
}

} // namespace kvxshim

// ------------------------------------------------------------------------------------------------ runtime API
cudaError_t cudaGetLastError()
{
    cudaError_t const e = kvxshim::gLastError;
    kvxshim::gLastError = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError()
{
    return kvxshim::gLastError;
}

char const* cudaGetErrorString(cudaError_t e)
{
    switch (e)
    {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorNotSupported: return "operation not supported";
    }
    return "unknown error";
}

cudaError_t cudaGetDevice(int* device)
{
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device)
{
    if (device != 0)
    {
        return cudaErrorInvalidValue;
    }
    kvxshim::DeviceConfig const& c = kvxshim::config();
    switch (attr)
    {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrClockRate: *value = c.clockKHz; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = c.smCount; return cudaSuccess;
    case cudaDevAttrMemoryClockRate: *value = c.memClockKHz; return cudaSuccess;
    case cudaDevAttrGlobalMemoryBusWidth: *value = c.memBusWidth; return cudaSuccess;
    case cudaDevAttrL2CacheSize: *value = c.l2Bytes; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = c.ccMajor; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = c.ccMinor; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = c.smemPerSM; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = c.smemPerBlockOptin; return cudaSuccess;
    }
    return cudaErrorInvalidValue;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t)
{
    std::memset(p, value, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, void const* src, size_t count, int, cudaStream_t)
{
    std::memmove(dst, src, count);
    return cudaSuccess;
}
