// barriers.cuh -- the asynchronous synchronisation and copy primitives of a
// warp-specialised kernel: mbarriers (shared-memory barriers with phases and a
// transaction count), named barriers (bar.sync / bar.arrive), the bulk
// asynchronous reduction into global memory and semaphores in global memory
// (CTAs taking turns).  With ptx.cuh and wgmma.cuh, the
// only inline PTX in cuda_src/; the CPU emulator compiles kernels against its
// twin (cupyflash/emulator/include/barriers.cuh), which checks the rules below.
//
// Targets: everything compiles for sm_80 except mbarrier_arrive_expect_tx,
// mbarrier_expect_tx, mbarrier_complete_tx and the bulk operations, which
// need sm_90 (PTX ISA 8.0) and are not declared for an older target: using
// one there is a compile error naming it.  mbarrier_try_wait_parity is
// mbarrier.try_wait.parity (sm_90: the thread may be suspended until the
// phase completes) and, below sm_90, mbarrier.test_wait.parity (sm_80: the
// same result, no suspension).
//
// mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions:
// mbarrier"): a uint64_t in dynamic shared memory, 8-byte aligned, that only
// these functions may touch.  It counts phases 0, 1, 2, ...; a phase completes
// when its pending arrivals reach zero and its tx-count is zero, and the
// barrier then starts the next phase with the init count pending.  Rules the
// kernels follow (the emulator checks them):
//  * mbarrier_init once, by one thread, then __syncthreads() before any other
//    thread uses the barrier; mbarrier_inval before the memory is reused or
//    initialised again;
//  * every phase sees exactly the init count of arrivals (mbarrier_arrive,
//    mbarrier_arrive_expect_tx, cp_async_mbarrier_arrive), and some thread's
//    wait returns true for a phase before any arrival of the next one;
//  * a wait names the phase it waits for by parity: the current phase
//    (returns false) or the one just completed (returns true); a waiter that
//    falls two phases behind would wait for the wrong phase;
//  * data written before an arrive (and cp.async copies tracked by
//    cp_async_mbarrier_arrive) may be read by another thread only after its
//    wait for that phase returned true.
#pragma once

#include "ptx.cuh"

namespace cf {

// ---- mbarrier ------------------------------------------------------------------

// Phase 0 with count (1 .. 2^20 - 1) arrivals pending, tx-count 0.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

// One arrival (release: this thread's earlier memory accesses are visible to
// whoever waits for the phase).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

// An arrival by the system once all of this thread's earlier cp.async copies
// have landed (.noinc: the init count includes it).  It orders those copies
// before the phase's completion, not the thread's other accesses.
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

// true once the phase of parity `parity` (0 or 1) has completed: the current
// phase has the other parity.  Acquire: what the phase's arrivals released is
// visible after a true result.
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    uint32_t done;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#else
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
    return done != 0;
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}

// The barrier is no longer one: its memory may be reused (or initialised again).
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// The current phase also waits for tx_bytes more bytes of asynchronous
// transactions (tx-count += tx_bytes), then one arrival.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(tx_bytes) : "memory");
}
// tx-count += tx_bytes, no arrival.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(tx_bytes) : "memory");
}
// tx-count -= tx_bytes, as an asynchronous transaction's completion would do.
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes) {
    asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                 :: "r"(smem_addr(bar)), "r"(tx_bytes) : "memory");
}
#endif

// ---- named barriers (bar.sync / bar.arrive; ids 0..15, 0 is __syncthreads') -----
// `threads` is a multiple of 32; each warp arrives as a whole (all of its
// non-exited lanes execute the same instruction).  Completion orders every
// arriving thread's earlier accesses before the sync-ing threads' later ones.

// Arrive and wait until `threads` threads have arrived at barrier `id`.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// Arrive at barrier `id` (of `threads` threads) without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---- bulk asynchronous reduction into global memory (sm_90) -------------------------
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// gmem_dst[i] += smem_src[i] for bytes / 4 floats, element by element (each
// addition atomic, their order unspecified), asynchronously; bytes a multiple
// of 16, both addresses 16-byte aligned.  The source is read by the async
// proxy: its writers run fence_proxy_async_shared() (wgmma.cuh) after writing
// it, and nothing writes it until bulk_wait_read retires the group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(gmem_dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
}
// Closes this thread's current bulk group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's most recent bulk groups still read
// their sources (the source memory may be written again after).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    static_assert(N >= 0, "cp.async.bulk.wait_group.read takes a non-negative immediate");
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// Waits until at most N of this thread's most recent bulk groups are pending
// (their writes done and visible to this thread).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    static_assert(N >= 0, "cp.async.bulk.wait_group takes a non-negative immediate");
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}
// Orders this thread's global-memory accesses through the async proxy (bulk
// reductions) and through the generic one (loads, stores, the semaphores) with
// each other: after its bulk reductions completed and before a post publishes
// them, and after a wait acquired another CTA's and before its own.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
#endif

// ---- semaphores in global memory ---------------------------------------------------
// An int in global memory by which CTAs take turns (bwd_wgmma's ordered dQ): one
// thread waits for a value another CTA posts.  Rules the kernels follow (the
// emulator checks them):
//  * a CTA waits only for posts of CTAs before it in launch order (lower linear
//    block index): the GPU starts CTAs in that order, and one waiting for a later
//    CTA that cannot become resident while it waits would wait for ever;
//  * data a post publishes is complete before the post: bulk reductions by
//    bulk_wait<0>() and fence_proxy_async_global() in each issuing thread, then
//    ordered before the posting thread (__syncwarp() or a barrier) -- a post
//    orders the poster's own accesses and those it has observed, not bulk
//    operations still in flight nor, without the proxy fence, async-proxy writes;
//  * the waiter's acquire orders its later accesses (and, through __syncwarp() or
//    a barrier, its warp's or CTA's) after everything the post published; a
//    thread that then issues bulk reductions into that memory runs
//    fence_proxy_async_global() first.

// Spins until *sem == value (an acquire at gpu scope).
__device__ __forceinline__ void semaphore_wait(const int* sem, int value) {
    int seen;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
    } while (seen != value);
}
// *sem = value, releasing this thread's accesses so far (and those it observed) at gpu scope.
__device__ __forceinline__ void semaphore_post(int* sem, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(sem), "r"(value) : "memory");
}

}  // namespace cf
