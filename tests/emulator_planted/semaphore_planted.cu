// semaphore_planted.cu -- blocks taking turns through a semaphore in global memory to
// add into one accumulator with bulk reductions (bwd_wgmma's ordered dQ in
// miniature), for tests/test_emulator_semaphores.py.  Block b stages its 128
// floats in[128 b, 128 (b + 1)) in shared memory; warp 0 waits until *ticket == b,
// each lane fences the global proxies, adds 4 floats into out[0, 128) with one
// bulk reduction, completes it and fences again, and lane 0 posts b + 1: out is then the float32 sum of the blocks' rows in block
// order, whatever order the blocks run in.  64 threads, 512 bytes of shared memory.
// kFault breaks one rule (barriers.cuh, "semaphores"):
//   0  correct
//   1  no turns: no wait, no post (the sum's order is the schedule's)
//   2  the post before the bulk_wait<0> that completes the additions
//   3  every lane completes its additions, but nothing orders the other lanes'
//      completion before lane 0's post (no __syncwarp between)
//   4  turns in reverse launch order: block b waits for a post of block b + 1
//   5  block b waits for b + 1, which nobody posts first (a deadlock)
//   6  the semaphore in shared memory
//   7  no proxy fence between the acquire and the bulk reductions
//   8  no proxy fence between the completed reductions and the post
#include "ptx.cuh"
#include "barriers.cuh"
#include "wgmma.cuh"
#include "planted_params.cuh"

template <int kFault>
__global__ void semaphore_turns(const PlantedParams p) {
    float* staged = reinterpret_cast<float*>(cf::dynamic_smem());
    const int b = static_cast<int>(blockIdx.x), nb = static_cast<int>(gridDim.x);
    for (int i = threadIdx.x; i < 128; i += blockDim.x) staged[i] = p.in[128 * b + i];
    cf::fence_proxy_async_shared();  // the rows' stores before the bulk reads
    __syncthreads();
    if (cf::warp_id() != 0) return;
    const int lane = cf::lane_id();
    int* ticket = p.ticket;
    if (kFault == 6) ticket = reinterpret_cast<int*>(staged + 120);
    const int turn = kFault == 4 ? nb - 1 - b : kFault == 5 ? b + 1 : b;
    if (kFault != 1) {
        if (lane == 0) cf::semaphore_wait(ticket, turn);
        __syncwarp();
        if (kFault != 7) cf::fence_proxy_async_global();
    }
    cf::bulk_reduce_add_f32(p.out + 4 * lane, staged + 4 * lane, 16);
    cf::bulk_commit();
    if (kFault == 2) {
        if (lane == 0) cf::semaphore_post(ticket, turn + 1);
        cf::bulk_wait<0>();
        return;
    }
    cf::bulk_wait<0>();
    if (kFault != 8) cf::fence_proxy_async_global();
    if (kFault == 3) {
        if (lane == 0) {
            __syncwarp(1u);  // lane 0 alone: the other lanes run on, nothing joins them
            cf::semaphore_post(ticket, turn + 1);
        }
        return;
    }
    __syncwarp();  // every lane's additions complete before lane 0 posts
    if (kFault != 1 && lane == 0) cf::semaphore_post(ticket, turn + 1);
}
