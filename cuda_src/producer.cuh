// producer.cuh -- what the producer warpgroups of the decoupled (warp-specialised)
// kernels share: fwd_wgmma's, which copies K and V, and bwd_wgmma's dK/dV, which
// copies Q, dO and their rows' statistics.
#pragma once

#include "barriers.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace cf {

// The consumer warpgroups' turns on the tensor cores: warpgroup wg waits at named
// barrier kTurnBarrier + wg (0 is __syncthreads') before it issues its products
// and then arrives at the other's, 2 x 128 threads a phase.
constexpr int kTurnBarrier = 1;

// A producer thread publishes a tile on its full barrier: its copies of it
// landed (all but the kNewer most recent groups), then a fence.proxy.async that
// orders them before the tensor cores' reads -- a cp.async arrival
// (cp_async_mbarrier_arrive) would leave no point to fence at -- then its arrival.
template <int kNewer>
__device__ __forceinline__ void publish_copies(uint64_t* full) {
    cp_async_wait<kNewer>();
    fence_proxy_async_shared();
    mbarrier_arrive(full);
}

}  // namespace cf
