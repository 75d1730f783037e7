// fwd_wgmma.cu -- the Hopper forward kernel: FlashAttention-2's algorithm on
// wgmma.mma_async (float16 / bfloat16 inputs, float32 accumulation), sm_90a.
//
// A CTA owns kBlockM = 64 kWarpGroups query rows of one (batch, head); each
// warpgroup owns 64 of them, each warp 16 (the rows of its m64 slice).  Q
// stays in shared memory for the whole kernel and is read by the tensor cores
// directly; K and V blocks of kBlockN keys stream through a double buffer
// filled by cp.async (fwd_blocks.cuh KVPipeline, every thread copying).  Per
// key block, every warpgroup computes
//     S = Q K^T        wgmma, A = Q and B = K from shared memory (K-major),
//                      d / 16 steps of m64 n(kBlockN) k16 into registers
//     mask             only on blocks that cross a mask boundary
//     softmax          softmax.cuh on each warp's rows, as fwd_mma
//     O += P V         wgmma, A = P from registers (the score accumulators
//                      rounded and re-packed, no shared-memory round trip),
//                      B = V from shared memory (MN-major, transposed by the
//                      tensor core); kBlockN / 16 steps of m64 n(d) k16
// and divides O by l once, at the end; the epilogue is fwd_mma's.  Each
// product is one commit group waited for before its result is used; two or
// more warpgroups per CTA let one warpgroup's softmax run while another's
// products are in the tensor cores.
//
// Every shared tile is a SwizzledTile of 64-column pages, which is wgmma's
// 128-byte-swizzle layout (wgmma.cuh); the tiles start 1024-byte aligned.
// Needs head dims that are multiples of 64; rows and columns past the
// run-time sizes are zero-filled by cp.async, as in fwd_mma.  The dispatcher
// guarantees 16-byte aligned rows, dv == d and scale > 0 (cupyflash/_gpu.py).
#pragma once

#include "block_info.cuh"
#include "fwd_blocks.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace cf {

// Every compile-time quantity of one instantiation (the table with the
// reason for each row: _WGMMA_TILES in cupyflash/_kernels.py).
template <typename T, int kHeadDim_, int kBlockN_, int kWarpGroups_, bool kLazyRescale_>
struct WgmmaFwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kWarpGroups = kWarpGroups_;
    static constexpr bool kLazyRescale = kLazyRescale_;
    static constexpr int kBlockM = 64 * kWarpGroups;
    static constexpr int kWarps = 4 * kWarpGroups;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kStages = 2;                   // K/V double buffer
    static constexpr int kWarpRows = 16;                // a warp's rows of its warpgroup's m64 slice
    static constexpr int kMTiles = 1;
    static constexpr int kRows = 2;                     // accumulator rows per lane (g, g + 8)
    static constexpr int kSCols = kBlockN / 4;          // score columns per lane and row
    static constexpr int kOCols = kHeadDim / 4;         // output columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of S = Q K^T
    static constexpr int kKeySteps = kBlockN / 16;      // k16 steps of O = P V

    using QTile = SwizzledTile<kBlockM, kHeadDim>;      // Q, later the output staging
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;

    // Q, then kStages x (K, V); plus 1 KB to align the start to 1024 bytes.
    static constexpr int kSmemBytes =
        (QTile::kElements + 2 * kStages * KVTile::kElements) * static_cast<int>(sizeof(T)) + 1024;

    // Descriptor strides (wgmma.cuh): 8-row groups 1024 bytes apart; an
    // MN-major V page (64 columns) is kBlockN lines of 128 bytes.
    static constexpr uint32_t kGroupBytes = 1024;
    static constexpr uint32_t kVPageBytes = kBlockN * 128;

    // KVPipeline: the tiles are read by the tensor cores' async proxy.
    __device__ static void publish_copies() { fence_proxy_async_shared(); }

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dim: whole 64-column pages, at most 256");
    static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "block_n: an n of wgmma (whole 64-row V pages)");
    static_assert(kWarpGroups >= 1 && kWarpGroups <= 3, "1 to 3 warpgroups");
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// s = Q K^T (unscaled) for the warpgroup's 64 rows (from row wg_row0 of the Q tile).
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_qk(float (&s)[Tr::kRows][Tr::kSCols], const T* sQ, const T* sK,
                                         int wg_row0) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
        const uint64_t a = wgmma_desc_sw128(sQ + Tr::QTile::chunk(wg_row0, 2 * ks), 16, Tr::kGroupBytes);
        const uint64_t b = wgmma_desc_sw128(sK + Tr::KVTile::chunk(0, 2 * ks), 16, Tr::kGroupBytes);
        Wgmma<T, Tr::kBlockN>::ss(s, a, b, ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
}

// o += P V, P as A operands in registers.
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_pv(float (&o)[Tr::kRows][Tr::kOCols],
                                         const uint32_t (&p)[Tr::kKeySteps][Tr::kMTiles][4], const T* sV) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
        const uint64_t b = wgmma_desc_sw128(sV + Tr::KVTile::chunk(16 * kk, 0), Tr::kVPageBytes, Tr::kGroupBytes);
        Wgmma<T, Tr::kHeadDim>::rs_mn(o, p[kk][0], b, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
}

template <typename T, int kHeadDim, int kBlockN, int kWarpGroups, bool kLazyRescale>
__global__ void __launch_bounds__((WgmmaFwdTraits<T, kHeadDim, kBlockN, kWarpGroups, kLazyRescale>::kThreads), 1)
fwd_wgmma_kernel(const FwdParams params) {
    using Tr = WgmmaFwdTraits<T, kHeadDim, kBlockN, kWarpGroups, kLazyRescale>;

    const TileIndex tile(params, Tr::kBlockM, blockIdx.x);
    const int batch = static_cast<int>(tile.batch), head = static_cast<int>(tile.head);
    const int m_block = static_cast<int>(tile.m_block);
    const HeadSlice<T, float> in(params, batch, head);
    char* smem = dynamic_smem();
    smem += (1024 - (smem_addr(smem) & 1023)) & 1023;  // 128-byte swizzle atoms are 1024-byte aligned
    T* const sQ = reinterpret_cast<T*>(smem);  // Q, later the output staging
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile
    const int wg_row0 = (warp_id() >> 2) * 64;   // its warpgroup's

    int n_begin, n_end;
    const UnmaskedBlocks unmasked = key_blocks<Tr>(params, m_block, n_begin, n_end);
    KVPipeline<Tr, T> kv(params, in.k, in.v, sQ + Tr::QTile::kElements, n_end);
    if (n_begin < n_end) kv.start_with_queries(sQ, in.q, m_block, n_begin);

    OnlineSoftmax<float, Tr::kRows, 4> softmax;
    float o[Tr::kRows][Tr::kOCols] = {};
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        float s[Tr::kRows][Tr::kSCols];
        kv.await_keys(n_block);
        wgmma_qk<Tr>(s, sQ, kv.keys(), wg_row0);
        if (unmasked.needs_mask(n_block))
            apply_mask<Tr>(s, BlockMask(params, static_cast<int64_t>(m_block) * Tr::kBlockM + row0,
                                        static_cast<int64_t>(n_block) * kBlockN, kBlockN));
        softmax.template update_unscaled<Tr::kLazyRescale>(s, o, scale_log2);
        uint32_t p[Tr::kKeySteps][Tr::kMTiles][4];
        scores_to_a<Tr, T>(p, s);
        wgmma_pv<Tr>(o, p, kv.values());
        kv.advance();
    }

    float lse[Tr::kRows];
    softmax.normalize(o, lse);

    store_output<Tr>(params, batch, head, m_block, row0, sQ, o, lse);
}

}  // namespace cf
