// barriers_planted.cu -- kernels for tests/test_emulator_barriers.py: the primitives of
// cuda_src/barriers.cuh used correctly (a cp.async pipeline over mbarriers, a ping-pong
// over named barriers, a bulk reduction), and each rule of that header broken on purpose
// by a template argument, so that the emulator's checks are shown to fire.
// wgmma.cuh for fence_proxy_async_shared.
#include "ptx.cuh"
#include "wgmma.cuh"
#include "barriers.cuh"
#include "planted_params.cuh"

// ---- mbarrier: an op script against the Python model -------------------------------------
// p.in holds p.n ops as int32 triples (op, barrier 0 or 1, argument); thread 0 runs them on
// two barriers at shared offsets 0 and 8 and writes every try_wait result to p.ticket.
// Ops: 0 init(arg), 1 arrive, 2 arrive_expect_tx(arg), 3 expect_tx(arg), 4 complete_tx(arg),
// 5 try_wait_parity(arg), 6 inval.
__global__ void mbar_script(const PlantedParams p) {
    if (threadIdx.x != 0) return;
    uint64_t* bars = reinterpret_cast<uint64_t*>(cf::dynamic_smem());
    const int32_t* ops = reinterpret_cast<const int32_t*>(p.in);
    int waits = 0;
    for (int i = 0; i < p.n; ++i) {
        uint64_t* bar = bars + ops[3 * i + 1];
        const uint32_t arg = static_cast<uint32_t>(ops[3 * i + 2]);
        switch (ops[3 * i]) {
            case 0: cf::mbarrier_init(bar, arg); break;
            case 1: cf::mbarrier_arrive(bar); break;
            case 2: cf::mbarrier_arrive_expect_tx(bar, arg); break;
            case 3: cf::mbarrier_expect_tx(bar, arg); break;
            case 4: cf::mbarrier_complete_tx(bar, arg); break;
            case 5: p.ticket[waits++] = cf::mbarrier_try_wait_parity(bar, arg) ? 1 : 0; break;
            default: cf::mbarrier_inval(bar); break;
        }
    }
}

// ---- mbarrier: one rule broken per kFault (0: none) ------------------------------------------
// 64 threads; the barrier at shared offset 8 (bars[1]), a second one at 16, a third at 24.
//   0  correct: thread 0 initialises (count 64), every thread arrives and waits, thread 0 invalidates
//   1  thread 0 arrives on a barrier never initialised
//   2  thread 0 arrives after mbarrier_inval
//   3  thread 0 initialises the barrier twice
//   4  more arrivals than pending: count 1, expect_tx(16) keeps phase 0 open, two arrivals
//   5  count 1: thread 0 arrives twice with no wait in between (phase 1 before phase 0 is waited for)
//   6  thread 32 fails a try_wait for phase 0, thread 0 then completes phases 0 and 1 (waiting
//      in between); thread 32's next try_wait(parity 0) sees phase 2: it was lapped
//   7  thread 1 stores into the live barrier's 8 bytes
//   8  thread 1 loads them
//   9  thread 32 arrives before a __syncthreads() makes thread 0's init visible (run unshuffled)
//  10  deadlock: arrive_expect_tx(16) and nothing completes the transaction
//  11  deadlock: count 2, one arrival, everyone waits
//  12  deadlock: everyone spins on try_wait for a phase nobody arrives at
//  13  a parity of 2
//  14  mbarrier_init with count 0
//  15  an mbarrier at shared offset 4 (misaligned)
//  16  an mbarrier in global memory
//  17  expect_tx takes the tx-count past 2^20 - 1
//  18  thread 0 issues a cp.async tracked by no cp_async_mbarrier_arrive and exits
template <int kFault>
__global__ void mbar_fault(const PlantedParams p) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(cf::dynamic_smem());
    uint64_t* bar = bars + 1;
    const int t = threadIdx.x;
    if (kFault == 1) {
        if (t == 0) cf::mbarrier_arrive(bar);
        return;
    }
    if (kFault == 18) {
        if (t == 0) {
            cf::mbarrier_init(bar, 1);
            cf::cp_async_16(cf::dynamic_smem() + 16, p.in, 16);
            cf::cp_async_mbarrier_arrive(bar);
            cf::cp_async_16(cf::dynamic_smem() + 32, p.in, 16);
        }
        return;
    }
    if (kFault == 9) {
        if (t == 0) cf::mbarrier_init(bar, 2);
        if (t == 32) cf::mbarrier_arrive(bar);
        return;
    }
    if (kFault == 13 || kFault == 14 || kFault == 15 || kFault == 16 || kFault == 17) {
        if (t != 0) return;
        if (kFault == 14) cf::mbarrier_init(bar, 0);
        if (kFault == 15) cf::mbarrier_init(reinterpret_cast<uint64_t*>(cf::dynamic_smem() + 4), 1);
        if (kFault == 16) cf::mbarrier_init(reinterpret_cast<uint64_t*>(p.ticket + 2), 1);
        cf::mbarrier_init(bar, 1);
        if (kFault == 13) cf::mbarrier_try_wait_parity(bar, 2);
        if (kFault == 17) cf::mbarrier_expect_tx(bar, 1u << 20);
        return;
    }
    if (kFault == 2 || kFault == 3 || kFault == 4 || kFault == 5) {
        if (t != 0) return;
        cf::mbarrier_init(bar, 1);
        if (kFault == 2) {
            cf::mbarrier_inval(bar);
            cf::mbarrier_arrive(bar);
        }
        if (kFault == 3) cf::mbarrier_init(bar, 1);
        if (kFault == 4) {
            cf::mbarrier_expect_tx(bar, 16);
            cf::mbarrier_arrive(bar);
            cf::mbarrier_arrive(bar);
        }
        if (kFault == 5) {
            cf::mbarrier_arrive(bar);
            cf::mbarrier_arrive(bar);
        }
        return;
    }
    if (kFault == 6) {
        uint64_t* go = bars + 2;    // thread 32 -> thread 0: it has failed its first try_wait
        uint64_t* done = bars + 3;  // thread 0 -> thread 32: phases 0 and 1 are complete
        if (t == 0) {
            cf::mbarrier_init(bar, 1);
            cf::mbarrier_init(go, 1);
            cf::mbarrier_init(done, 1);
        }
        __syncthreads();
        if (t == 32) {
            const bool early = cf::mbarrier_try_wait_parity(bar, 0);
            p.ticket[0] = early;
            cf::mbarrier_arrive(go);
            cf::mbarrier_wait_parity(done, 0);
            while (!cf::mbarrier_try_wait_parity(bar, 0)) {
            }
        }
        if (t == 0) {
            cf::mbarrier_wait_parity(go, 0);
            cf::mbarrier_arrive(bar);
            cf::mbarrier_wait_parity(bar, 0);
            cf::mbarrier_arrive(bar);
            cf::mbarrier_arrive(done);
        }
        return;
    }
    if (t == 0) cf::mbarrier_init(bar, kFault == 11 ? 2 : kFault == 0 ? 64 : 1);
    __syncthreads();
    if (kFault == 7 && t == 1) *bar = 0;
    if (kFault == 8 && t == 1) p.out[0] = static_cast<float>(*bar);
    if (kFault == 10 && t == 0) cf::mbarrier_arrive_expect_tx(bar, 16);
    if ((kFault == 0 || (kFault == 11 && t == 0))) cf::mbarrier_arrive(bar);
    if (kFault == 12) {
        while (!cf::mbarrier_try_wait_parity(bar, 0)) {
        }
    } else if (kFault != 7 && kFault != 8) {
        cf::mbarrier_wait_parity(bar, 0);
    }
    p.out[t] = 1.0f;
    __syncthreads();
    if (t == 0) cf::mbarrier_inval(bar);
}

// ---- mbarrier: a cp.async pipeline --------------------------------------------------------
// 384 threads: warp 0 produces, threads 128-383 (two warpgroups) consume, the rest exits.
// kStages stages of 128 floats; round r fills stage r % kStages with in[128 r, 128 r + 128)
// (each producer lane one 16-byte cp.async, tracked by cp_async_mbarrier_arrive on full[s],
// count 32); consumer c adds (tile[(7 c + r) % 128] + tile[c % 128]) (r + 1) to its sum and
// arrives on empty[s] (count 256; with bit 0 of p.arg, lane 0 of each consumer warp after
// a __syncwarp(), count 8).  out[c] = the sum, for p.n rounds.  kBug:
//   1  consumers read without waiting on full[s]
//   2  the producer refills a stage without waiting on empty[s]
//   3  the producer waits on empty[s] always with parity 0 (the phase counter not flipped)
//   4  consumers arrive on empty[s] before reading the stage
constexpr int kStages = 3;
template <int kBug>
__global__ void mbar_pipeline(const PlantedParams p) {
    char* smem = cf::dynamic_smem();
    uint64_t* full = reinterpret_cast<uint64_t*>(smem);
    uint64_t* empty = full + kStages;
    float* tiles = reinterpret_cast<float*>(smem + 128);
    const int t = threadIdx.x, lane = cf::lane_id(), rounds = p.n;
    const bool warp_arrive = p.arg & 1;
    if (t == 0)
        for (int s = 0; s < kStages; ++s) {
            cf::mbarrier_init(&full[s], 32);
            cf::mbarrier_init(&empty[s], warp_arrive ? 8 : 256);
        }
    __syncthreads();
    if (t < 32) {
        for (int r = 0; r < rounds; ++r) {
            const int s = r % kStages;
            if (r >= kStages && kBug != 2) cf::mbarrier_wait_parity(&empty[s], kBug == 3 ? 0 : (r / kStages - 1) & 1);
            cf::cp_async_16(tiles + 128 * s + 4 * lane, p.in + 128 * r + 4 * lane, 16);
            cf::cp_async_mbarrier_arrive(&full[s]);
        }
    } else if (t >= 128) {
        const int c = t - 128;
        float sum = 0.0f;
        auto release = [&](int s) {
            if (warp_arrive) {
                __syncwarp();
                if (lane == 0) cf::mbarrier_arrive(&empty[s]);
            } else {
                cf::mbarrier_arrive(&empty[s]);
            }
        };
        for (int r = 0; r < rounds; ++r) {
            const int s = r % kStages;
            const float* tile = tiles + 128 * s;
            if (kBug != 1) cf::mbarrier_wait_parity(&full[s], (r / kStages) & 1);
            if (kBug == 4) release(s);
            sum += (tile[(7 * c + r) % 128] + tile[c % 128]) * static_cast<float>(r + 1);
            if (kBug != 4) release(s);
        }
        p.out[c] = sum;
    }
}

// ---- mbarrier: a hand-off with plain stores -------------------------------------------------
// 64 threads: warp 0 writes buf, arrives on full (count 32); warp 1 waits, reads, arrives on
// empty (count 32, or with bit 0 of p.arg lane 0 after a __syncwarp(), count 1); warp 0 waits
// on empty and writes the second round.  out[l] = round 0's value + round 1's.  kBug:
//   1  warp 1 reads round 0 without waiting on full
//   2  warp 0 writes round 1 without waiting on empty
template <int kBug>
__global__ void mbar_handoff(const PlantedParams p) {
    char* smem = cf::dynamic_smem();
    uint64_t* full = reinterpret_cast<uint64_t*>(smem);
    uint64_t* empty = full + 1;
    float* buf = reinterpret_cast<float*>(smem + 64);
    const int t = threadIdx.x, lane = cf::lane_id();
    const bool warp_arrive = p.arg & 1;
    if (t == 0) {
        cf::mbarrier_init(full, 32);
        cf::mbarrier_init(empty, warp_arrive ? 1 : 32);
    }
    __syncthreads();
    if (t < 32) {
        for (int r = 0; r < 2; ++r) {
            if (r == 1 && kBug != 2) cf::mbarrier_wait_parity(empty, 0);
            buf[lane] = p.in[32 * r + lane];
            cf::mbarrier_arrive(full);
        }
    } else {
        float sum = 0.0f;
        for (int r = 0; r < 2; ++r) {
            if (!(r == 0 && kBug == 1)) cf::mbarrier_wait_parity(full, r);
            sum += buf[lane];
            if (r == 1) break;
            if (warp_arrive) {
                __syncwarp();
                if (lane == 0) cf::mbarrier_arrive(empty);
            } else {
                cf::mbarrier_arrive(empty);
            }
        }
        p.out[lane] = sum;
    }
}

// ---- named barriers: a ping-pong of two warpgroups ----------------------------------------
// 256 threads; two buffers of 256 floats, a[] starting as in[0, 256).  For p.n rounds k,
// warpgroup 0 sets b = 2 a + k, then warpgroup 1 sets a = 2 b + k + 1 (thread t: elements
// t % 128 and t % 128 + 128), handing over with named barriers 1 (0 -> 1) and 2 (1 -> 0),
// 256 threads: one group arrives, the other syncs.  out = a.  (Two buffers rather than an
// update in place: the race check sees a store that follows a load of the same address
// without a call in between only as the load -- GCC's ASan instrumentation drops the
// second check.)  kBug:
//   1  no named barriers at all
//   2  warpgroup 1 arrives on barrier 1 instead of syncing (it does not wait for group 0)
template <int kBug>
__global__ void named_pingpong(const PlantedParams p) {
    float* a = reinterpret_cast<float*>(cf::dynamic_smem());
    float* b = a + 256;
    const int t = threadIdx.x, g = t / 128, i = t % 128;
    a[t] = p.in[t];
    __syncthreads();
    for (int k = 0; k < p.n; ++k) {
        if (g == 0) {
            if (k > 0 && kBug != 1) cf::named_barrier_sync(2, 256);
        } else if (kBug == 2) {
            cf::named_barrier_arrive(1, 256);
        } else if (kBug != 1) {
            cf::named_barrier_sync(1, 256);
        }
        const float* src = g == 0 ? a : b;
        float* dst = g == 0 ? b : a;
        dst[i] = 2.0f * src[i] + static_cast<float>(k + g);
        dst[i + 128] = 2.0f * src[i + 128] + static_cast<float>(k + g);
        if (kBug != 1) cf::named_barrier_arrive(g == 0 ? 1 : 2, 256);
    }
    if (g == 0 && kBug != 1 && kBug != 2) cf::named_barrier_sync(2, 256);  // group 1's last hand-over
    __syncthreads();
    p.out[t] = a[t];
}

// ---- named barriers: one rule broken per kFault (0: none) -----------------------------------
//   0  correct: named_barrier_sync(0, all threads) as a __syncthreads(), then warps 0 and 1
//      exchange data through barrier 3 (64 threads); warp 2 exits
//   1  barrier id 16
//   2  48 threads (not a multiple of 32)
//   3  256 threads in a block of 96
//   4  warp 0 syncs on barrier 1 with 64 threads, warp 1 with 96
//   5  lanes 0-15 of warp 0 sync on barrier 1, lanes 16-31 on barrier 2
//   6  deadlock: lanes 0-15 of warp 0 sync on barrier 1, lanes 16-31 wait on an mbarrier
//   7  deadlock: warps 0-1 sync on barrier 1 with a count of 96
//   8  warp 0 arrives twice on barrier 1 (64 threads) before it completes
//   9  warp 0 syncs on barrier 0 with 64 threads while warps 1-2 wait at __syncthreads()
//  10  warp 0 arrives on barrier 1 (64 threads) and no warp ever syncs there
// 96 threads (3 warps).
template <int kFault>
__global__ void named_fault(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    uint64_t* bar = reinterpret_cast<uint64_t*>(cf::dynamic_smem() + 512);
    const int t = threadIdx.x, w = cf::warp_id(), lane = cf::lane_id();
    switch (kFault) {
        case 0:  // s[96 + t] is ordered by barrier 3 only
            s[t] = p.in[t];
            cf::named_barrier_sync(0, 96);
            if (w < 2) {
                s[96 + t] = s[(t + 32) % 96];
                cf::named_barrier_sync(3, 64);
                p.out[t] = s[96 + (t + 32) % 64];
            }
            break;
        case 1: cf::named_barrier_sync(16, 64); break;
        case 2: cf::named_barrier_sync(1, 48); break;
        case 3: cf::named_barrier_sync(1, 256); break;
        case 4:
            if (w < 2) cf::named_barrier_sync(1, w == 0 ? 64 : 96);
            break;
        case 5:
            if (w == 0) cf::named_barrier_sync(lane < 16 ? 1 : 2, 64);
            break;
        case 6:
            if (t == 0) cf::mbarrier_init(bar, 1);
            __syncthreads();
            if (w == 0 && lane < 16) cf::named_barrier_sync(1, 64);
            if (w == 0 && lane >= 16) cf::mbarrier_wait_parity(bar, 0);
            break;
        case 7:
            if (w < 2) cf::named_barrier_sync(1, 96);
            break;
        case 8:
            if (w == 0) {
                cf::named_barrier_arrive(1, 64);
                cf::named_barrier_arrive(1, 64);
            }
            break;
        case 9:
            if (w == 0)
                cf::named_barrier_sync(0, 64);
            else
                __syncthreads();
            break;
        case 10:
            if (w == 0) cf::named_barrier_arrive(1, 64);
            break;
    }
}

// ---- bulk reduction: per-block partial sums into global memory ----------------------------
// 128 threads per block; block b stores in[128 b + t] to s[t] (shared), fences, and lane 0 of
// each warp w adds s[32 w, 32 w + 32) into out[32 w, 32 w + 32) with one reduction (128
// bytes), committed as its own group; warp 0's lane 0 splits its part in two groups and
// waits for them with bulk_wait_read<1> then <0>.  All wait with bulk_wait<0>.  kBug:
//   1  no fence.proxy.async after the stores
//   2  the issuing thread overwrites its source before bulk_wait_read
//   3  the issuing threads exit without bulk_wait_read
//   4  a reduction of 24 bytes
//   5  the source 4 bytes into the block
//   6  the destination 4 bytes into out
//   7  the source in global memory
//   8  (correct) the issuing threads exit after bulk_wait_read, without bulk_wait
//   9  (correct) thread 0 records out[0] after bulk_wait_read and after bulk_wait in p.ticket
//  10  thread 1 writes s[0] while thread 0's reduction reads it, unordered
template <int kBug>
__global__ void bulk_sum(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x, w = cf::warp_id(), lane = cf::lane_id();
    s[t] = p.in[128 * blockIdx.x + t];
    if (kBug != 1) cf::fence_proxy_async_shared();
    __syncthreads();
    if (kBug == 10 && t == 1) s[0] = 0.0f;
    if (lane != 0) return;
    const float* src = s + 32 * w;
    float* dst = p.out + 32 * w;
    if (kBug == 4) cf::bulk_reduce_add_f32(dst, src, 24);
    if (kBug == 5) cf::bulk_reduce_add_f32(dst, src + 1, 64);
    if (kBug == 6) cf::bulk_reduce_add_f32(dst + 1, src, 64);
    if (kBug == 7) cf::bulk_reduce_add_f32(dst, p.in, 64);
    if (w == 0) {
        cf::bulk_reduce_add_f32(dst, src, 64);
        cf::bulk_commit();
        cf::bulk_reduce_add_f32(dst + 16, src + 16, 64);
        cf::bulk_commit();
        if (kBug == 2) s[20] = -1.0f;
        if (kBug == 3) return;
        cf::bulk_wait_read<1>();
        cf::bulk_wait_read<0>();
    } else {
        cf::bulk_reduce_add_f32(dst, src, 128);
        cf::bulk_commit();
        if (kBug == 3) return;
        cf::bulk_wait_read<0>();
    }
    if (kBug == 9 && t == 0) p.ticket[0] = __float_as_int(p.out[0]);
    if (kBug == 8) return;
    cf::bulk_wait<0>();
    if (kBug == 9 && t == 0) p.ticket[1] = __float_as_int(p.out[0]);
}
