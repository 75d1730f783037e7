// wgmma_planted.cu -- one m64n64k16 wgmma for tests/test_fwd_wgmma.py: the product
// against NumPy (A from shared memory, K-major or -- bit 64 of p.arg -- MN-major, or
// from registers; B K-major or MN-major), and
// each ordering rule of wgmma.cuh broken on purpose by a bit of p.arg, so that the
// emulator's checks are shown to fire:
//   1  no fence.proxy.async after the shared-memory stores
//   2  no wgmma.fence before the wgmma
//   4  the accumulators read before wgmma.wait_group
//   8  thread 0 overwrites a B element before wgmma.wait_group
//  16  an A register changed before wgmma.wait_group (A from registers)
//  32  no wgmma.wait_group at all
//  64  (not a fault) A and B MN-major, from shared memory
// 128  warps 0-1 and 2-3 reach the (same) wgmma at two call sites: two instructions
// 256  warp 0 retires the group, then thread 0 overwrites a B element (after a
//      barrier, so no race) before warps 1-3 retire it
// 512  an A register written after wgmma.fence, before the wgmma (A from registers)
// 1024 an accumulator written after wgmma.fence, before the wgmma
// 2048 the accumulators scaled in place while the wgmma is in flight
#include "mma_tile.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"
#include "planted_params.cuh"

// out (64 x 64, row-major) = A B with A = in[0, 1024) (64 x 16, row-major) and
// B = in[1024, 2048) (16 x 64, row-major), both rounded to bfloat16.
template <bool kRegsA>
__global__ void wgmma_probe(const PlantedParams p) {
    using bf16 = __nv_bfloat16;
    using ATile = cf::SwizzledTile<64, 64>;   // A, K-major: k in columns 0..15 of the page
    using KTile = cf::SwizzledTile<64, 64>;   // B^T ([n][k], K-major) for the ss form
    using VTile = cf::SwizzledTile<16, 64>;   // B ([k][n], MN-major) for the rs form
    const int t = threadIdx.x, flags = p.arg;
    const bool mn_major = !kRegsA && (flags & 64);   // A ([k][m]) and B ([k][n]) MN-major: ss_mn
    char* smem = cf::dynamic_smem();  // as the kernels: 1024-byte aligned tiles (1 KB of slack)
    smem += (1024 - (cf::smem_addr(smem) & 1023)) & 1023;
    bf16* sA = reinterpret_cast<bf16*>(smem);
    bf16* sB = sA + ATile::kElements;
    for (int i = t; i < 64 * 16; i += 128) {
        const int r = i / 16, k = i % 16;
        if (mn_major)
            sA[VTile::chunk(k, r / 8) + r % 8] = __float2bfloat16(p.in[i]);
        else
            sA[ATile::chunk(r, k / 8) + k % 8] = __float2bfloat16(p.in[i]);
        const int kb = i / 64, n = i % 64;  // B element i: row kb, column n
        if (kRegsA || mn_major)
            sB[VTile::chunk(kb, n / 8) + n % 8] = __float2bfloat16(p.in[1024 + i]);
        else
            sB[KTile::chunk(n, kb / 8) + kb % 8] = __float2bfloat16(p.in[1024 + i]);
    }
    if (!(flags & 1)) cf::fence_proxy_async_shared();
    __syncthreads();

    const int w = cf::warp_id(), g = cf::lane_id() >> 2, q = cf::lane_id() & 3;
    float d[2][16] = {};
    uint32_t a[4];
    for (int j = 0; j < 4; ++j) {
        const int row = 16 * w + g + 8 * (j & 1), col = 2 * q + 8 * (j >> 1);
        a[j] = cf::pack_bf162(p.in[16 * row + col], p.in[16 * row + col + 1]);
    }
    if (!(flags & 2)) cf::wgmma_fence();
    if (flags & 512) a[1] ^= 1u << 16;
    if (flags & 1024) d[1][3] = 0.5f;
    if (kRegsA)
        cf::Wgmma<bf16, 64>::rs_mn(d, a, cf::wgmma_desc_sw128(sB, VTile::kRows * 128, 1024), false);
    else if (mn_major)
        cf::Wgmma<bf16, 64>::ss_mn(d, cf::wgmma_desc_sw128(sA, VTile::kRows * 128, 1024),
                                   cf::wgmma_desc_sw128(sB, VTile::kRows * 128, 1024), false);
    else if (flags & 128) {   // the volatile stores keep the compiler from merging the calls
        volatile int path;
        if (w < 2) {
            cf::Wgmma<bf16, 64>::ss(d, cf::wgmma_desc_sw128(sA, 16, 1024), cf::wgmma_desc_sw128(sB, 16, 1024),
                                    false);
            path = 1;
        } else {
            cf::Wgmma<bf16, 64>::ss(d, cf::wgmma_desc_sw128(sA, 16, 1024), cf::wgmma_desc_sw128(sB, 16, 1024),
                                    false);
            path = 2;
        }
        (void)path;
    } else
        cf::Wgmma<bf16, 64>::ss(d, cf::wgmma_desc_sw128(sA, 16, 1024), cf::wgmma_desc_sw128(sB, 16, 1024), false);
    cf::wgmma_commit();
    if ((flags & 8) && t == 0) sB[0] = __float2bfloat16(1.0f);
    if (flags & 16) a[0] ^= 1u;
    if (flags & 2048)
        for (int c = 0; c < 16; ++c) d[0][c] *= 0.5f;
    if (flags & 256) {
        __syncthreads();
        if (w == 0) {
            cf::wgmma_wait<0>();
            __syncwarp();
            if (t == 0) sB[0] = __float2bfloat16(1.0f);
        }
        __syncthreads();
        if (w != 0) cf::wgmma_wait<0>();
    } else if (!(flags & 4) && !(flags & 32))
        cf::wgmma_wait<0>();
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 16; ++c)
            p.out[64 * (16 * w + 8 * r + g) + 8 * (c / 2) + 2 * q + c % 2] = d[r][c];
    if (flags & 4) cf::wgmma_wait<0>();
}
