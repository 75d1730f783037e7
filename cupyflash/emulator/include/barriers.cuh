// barriers.cuh (emulated) -- the CPU emulator's twin of cuda_src/barriers.cuh.
//
// Same names, signatures and semantics; each call goes to the emulator runtime
// (src/runtime.cpp, "mbarriers", "named barriers" and "bulk reductions"), which
// keeps the state the hardware keeps and checks the rules listed in the real
// header:
//  * an mbarrier is state in the runtime keyed by its shared offset (its 8
//    bytes hold nothing; a plain load or store of them is an error).  Phases,
//    pending arrivals and tx-count follow the PTX ISA; use before
//    mbarrier_init (or before a __syncthreads() makes the init visible to the
//    thread), after mbarrier_inval, a second init, more arrivals than pending,
//    an arrival in a phase before any wait returned true for the previous one,
//    a parity other than 0 or 1 and a waiter that fell two phases behind are
//    errors;
//  * a false mbarrier_try_wait_parity yields the thread; mbarrier_wait_parity
//    blocks it until the phase completes; a block whose threads can only wait
//    or spin is a deadlock, reported with each barrier's phase, pending count
//    and tx-count;
//  * cp.async copies tracked by cp_async_mbarrier_arrive land at the first
//    wait that returns true for the phase their arrival completed (or the
//    issuing thread's cp_async_wait, or the barrier's mbarrier_inval), never
//    earlier;
//  * a named barrier is a rendezvous of each warp's non-exited lanes at the
//    same instruction, counted as 32 threads per warp;
//  * a bulk reduction reads its source until bulk_wait_read (a write to it
//    before is an error) and adds into global memory at bulk_wait or the
//    thread's exit, element by element in a shuffled order;
//  * a semaphore_wait whose value is not there yet blocks the thread; a block
//    whose threads can only wait for semaphores is suspended and another block
//    runs (blocks are concurrent only through semaphores).  A semaphore_post
//    while a thread of the block has bulk reductions not complete, or (with
//    race checking) not ordered before the post, or completed with no
//    fence_proxy_async_global() after, is an error; so is a bulk reduction
//    issued after the block acquired a semaphore by a thread with no
//    fence_proxy_async_global() since, a wait that a block later in launch
//    order satisfied, and a grid whose started blocks all wait with none left
//    to start (a deadlock).
// With race checking, completed phases and named barriers are happens-before
// edges (vector clocks) for the shared-memory race check.  As in the real
// header, the sm_90 functions are declared for every target here.
#pragma once

#include "ptx.cuh"

// Tells the module's launch functions (cfemu_run's module_flags) to keep the
// vector clocks these barriers need.
#define CFEMU_USES_BARRIERS 1

namespace cf {

// ---- mbarrier ------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) { cfemu_mbar_init(bar, count); }
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) { cfemu_mbar_arrive(bar, CFEMU_MBAR_ARRIVE, 0); }
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* bar) { cfemu_cp_async_mbar_arrive(bar); }
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    return cfemu_mbar_wait(bar, parity, 0) != 0;
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) { cfemu_mbar_wait(bar, parity, 1); }
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) { cfemu_mbar_inval(bar); }
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
    cfemu_mbar_arrive(bar, CFEMU_MBAR_ARRIVE_EXPECT_TX, tx_bytes);
}
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
    cfemu_mbar_arrive(bar, CFEMU_MBAR_EXPECT_TX, tx_bytes);
}
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes) {
    cfemu_mbar_arrive(bar, CFEMU_MBAR_COMPLETE_TX, tx_bytes);
}

// ---- named barriers -----------------------------------------------------------------

__device__ __forceinline__ void named_barrier_sync(int id, int threads) { cfemu_named_barrier(id, threads, 1); }
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) { cfemu_named_barrier(id, threads, 0); }

// ---- bulk asynchronous reduction into global memory ------------------------------------

__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
    cfemu_bulk_reduce_add_f32(gmem_dst, smem_src, bytes);
}
__device__ __forceinline__ void bulk_commit() { cfemu_bulk_commit(); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    static_assert(N >= 0, "cp.async.bulk.wait_group.read takes a non-negative immediate");
    cfemu_bulk_wait(N, 1);
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    static_assert(N >= 0, "cp.async.bulk.wait_group takes a non-negative immediate");
    cfemu_bulk_wait(N, 0);
}
__device__ __forceinline__ void fence_proxy_async_global() { cfemu_fence_proxy_async_global(); }

// ---- semaphores in global memory -----------------------------------------------------

__device__ __forceinline__ void semaphore_wait(const int* sem, int value) { cfemu_semaphore_wait(sem, value); }
__device__ __forceinline__ void semaphore_post(int* sem, int value) { cfemu_semaphore_post(sem, value); }

}  // namespace cf
