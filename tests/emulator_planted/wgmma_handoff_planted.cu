// wgmma_handoff_planted.cu -- a producer warpgroup hands B tiles to a consumer
// warpgroup's wgmma through full/empty mbarriers (the decoupled fwd_wgmma's
// protocol in miniature), for tests/test_emulator_wgmma_checks.py: two rounds
// into one buffer, out = A B0 then A B1 (A 64 x 16 in in[0, 1024), B_r 16 x 64
// in in[1024 (1 + r), ...), all rounded to bfloat16; out[4096 r + 64 m + n]).
// kFault breaks one ordering rule the emulator must see although the emulator's
// schedule never lets the data go wrong:
//   0  correct
//   1  the consumers release the buffer (empty barrier) before the
//      wgmma.wait_group that retires the product reading it
//   2  the producer runs its fence.proxy.async after the arrival that publishes
//      the tile instead of before
// 256 threads: warpgroup 0 consumes, warpgroup 1 produces.
#include "mma_tile.cuh"
#include "ptx.cuh"
#include "barriers.cuh"
#include "wgmma.cuh"
#include "planted_params.cuh"

template <int kFault>
__global__ void wgmma_handoff(const PlantedParams p) {
    using bf16 = __nv_bfloat16;
    using Tile = cf::SwizzledTile<64, 64>;
    char* smem = cf::dynamic_smem();
    smem += (1024 - (cf::smem_addr(smem) & 1023)) & 1023;
    bf16* sA = reinterpret_cast<bf16*>(smem);
    bf16* sB = sA + Tile::kElements;
    uint64_t* full = reinterpret_cast<uint64_t*>(sB + Tile::kElements);
    uint64_t* empty = full + 1;
    const int t = threadIdx.x;
    if (t == 0) {
        cf::mbarrier_init(full, 128);
        cf::mbarrier_init(empty, 128);
    }
    __syncthreads();
    if (t >= 128) {  // the producer: A once, then B_0 and B_1 into the same buffer
        const int u = t - 128;
        for (int round = 0; round < 2; ++round) {
            if (round > 0) cf::mbarrier_wait_parity(empty, 0);
            for (int i = u; i < 64 * 16; i += 128) {
                if (round == 0) sA[Tile::chunk(i / 16, (i % 16) / 8) + i % 8] = __float2bfloat16(p.in[i]);
                const int kb = i / 64, n = i % 64;  // B element i: row kb, column n, stored [n][k]
                sB[Tile::chunk(n, kb / 8) + kb % 8] = __float2bfloat16(p.in[1024 * (1 + round) + i]);
            }
            if (kFault != 2) cf::fence_proxy_async_shared();
            cf::mbarrier_arrive(full);
            if (kFault == 2) cf::fence_proxy_async_shared();
        }
        return;
    }
    const int w = cf::warp_id(), g = cf::lane_id() >> 2, q = cf::lane_id() & 3;
    for (int round = 0; round < 2; ++round) {
        cf::mbarrier_wait_parity(full, round);
        float d[2][16];
        cf::wgmma_fence();
        cf::Wgmma<bf16, 64>::ss(d, cf::wgmma_desc_sw128(sA, 16, 1024), cf::wgmma_desc_sw128(sB, 16, 1024), false);
        cf::wgmma_commit();
        if (kFault == 1) cf::mbarrier_arrive(empty);
        cf::wgmma_wait<0>(d);
        if (kFault != 1) cf::mbarrier_arrive(empty);
        for (int r = 0; r < 2; ++r)
            for (int c = 0; c < 16; ++c)
                p.out[4096 * round + 64 * (16 * w + 8 * r + g) + 8 * (c / 2) + 2 * q + c % 2] = d[r][c];
    }
}
