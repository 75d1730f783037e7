// fwd_mma.cu -- the tensor-core forward kernel: FlashAttention-2 with mma.sync
// m16n8k16 (float16 / bfloat16 inputs, float32 accumulation), sm_80 and later.
//
// A CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps
// owns kBlockM / kWarps of those rows (16 per m16 tile, FA2's split of Q
// across warps: no reduction between warps).  Q is copied once to shared
// memory; K and V blocks of kBlockN keys stream through shared memory with
// cp.async (KVPipeline).  Per key block, every warp computes
//     S = Q K^T                        ldmatrix + mma, scores stay in registers
//     mask                             only on blocks that cross a mask boundary
//     m, l, O rescale, P = exp2(S * scale * log2(e) - m)
//                                      softmax.cuh (one FFMA per score), quad shuffles;
//                                      with kLazyRescale, m moves (and O is rescaled)
//                                      only when a warp's row max grows by 2^8 or more
//     O += P V                         P re-packed in registers as the A operand
// and divides O by l once, at the end.  O is staged through the (no longer
// needed) Q tile and written with 16-byte stores.  Split-KV (the kSplit
// instantiations, num_splits > 1): CTA (x, y) visits the y-th run of its key
// blocks and writes its float partial output and lse (store_partial) for
// fwd_combine.cu.
//
// K/V pipelines (kStages):
//   2  double buffer: while block j is computed, block j+1's K and V land in
//      the other buffer pair (one barrier per block).
//   1  one K and one V buffer, as FA2: V_j lands during S = Q K_j^T and the
//      softmax, K_{j+1} during O += P V_j (two barriers per block); less
//      shared memory, so more CTAs per SM where shared memory is the limit.
// Every shared tile uses the swizzled layout of mma_tile.cuh.  Rows and head
// dims are padded inside the kernel: tails and columns beyond the run-time d
// are zero-filled by cp.async and never stored.  The dispatcher guarantees
// 16-byte aligned row starts and dv == d (cupyflash/_gpu.py).
#pragma once

#include "block_info.cuh"
#include "fwd_blocks.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The table of
// (head dim -> tiles, warps, stages) with the reason for each row is
// _MMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          bool kLazyRescale_>
struct MmaFwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kWarps = kWarps_, kStages = kStages_;
    // Rescale o and l only when a row maximum of the warp moves far
    // (OnlineSoftmax::update_unscaled); off where its registers would spill.
    static constexpr bool kLazyRescale = kLazyRescale_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
    static constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;           // accumulator rows per lane
    static constexpr int kSCols = 2 * (kBlockN / 8);    // score columns per lane and row
    static constexpr int kOCols = 2 * (kHeadDim / 8);   // output columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of S = Q K^T
    static constexpr int kKeySteps = kBlockN / 16;      // k16 steps of O = P V

    using QTile = SwizzledTile<kBlockM, kHeadDim>;      // Q, later the output staging
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;

    // Shared memory: Q, then kStages x (K, V) (KVPipeline).
    static constexpr int kSmemBytes =
        (QTile::kElements + 2 * kStages * KVTile::kElements) * static_cast<int>(sizeof(T));
    // __launch_bounds__ minimum CTAs per SM: two CTAs of up to 4 warps leave
    // every thread the 255-register maximum, so this never caps registers; it
    // states the occupancy the tile table aims for.
    static constexpr int kMinBlocksPerSm = kWarps <= 4 ? 2 : 1;

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kBlockM % (16 * kWarps) == 0, "block_m: whole m16 tiles per warp");
    static_assert(kBlockN % 16 == 0, "block_n: whole k16 steps of P V");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim bucket: 32 .. 256, multiple of 32");
    static_assert(kStages == 1 || kStages == 2, "kStages: 1 (K/V interleaved) or 2 (double buffer)");
    // the per-architecture tables keep sm_86 / sm_89 tiles within their 99 KB
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// s = Q K^T (unscaled: the softmax folds the scale in) for the warp's rows (from row0 of the Q tile) and the key block.
template <class Tr, typename T>
__device__ __forceinline__ void mma_qk(float (&s)[Tr::kRows][Tr::kSCols], const T* sQ, const T* sK,
                                       int row0) {
    mma_abt<typename Tr::QTile, typename Tr::KVTile, Tr::kMTiles, Tr::kBlockN, Tr::kKSteps>(s, sQ, sK, row0);
}

// o += P V, with P as A operands already in registers.
template <class Tr, typename T>
__device__ __forceinline__ void mma_pv(float (&o)[Tr::kRows][Tr::kOCols],
                                       const uint32_t (&a)[Tr::kKeySteps][Tr::kMTiles][4], const T* sV) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
#pragma unroll
        for (int np = 0; np < Tr::kHeadDim / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_kn<typename Tr::KVTile>(b, sV, 16 * kk, np);
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                mma_into<T>(o, mi, 2 * np, a[kk][mi], b[0], b[1]);
                mma_into<T>(o, mi, 2 * np + 1, a[kk][mi], b[2], b[3]);
            }
        }
    }
}

// kSplit: the split-KV instantiation (FwdParams::num_splits > 1, blockIdx.y =
// split), a template argument rather than a run-time test because the main
// loop of the large head dims runs at 255 registers and the extra epilogue
// tips several of them into spills.
//
// kWholeKV: the whole-KV instantiation (Lk a multiple of kBlockN, d the
// bucket; cupyflash/_gpu.py checks both): K/V copies without bounds.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLazyRescale,
          bool kSplit = false, bool kWholeKV = false>
__global__ void __launch_bounds__(
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>::kThreads),
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>::kMinBlocksPerSm))
fwd_mma_kernel(const FwdParams launch) {
    using Tr = MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>;

    // The main loop runs at the register limit, so only 32-bit indices and the
    // K/V pointers live across it; everything else is derived where it is used.
    // TileIndex hands out the last query blocks (the most keys under a causal
    // mask) first.
    const TileIndex tile(launch, kBlockM, blockIdx.x);
    const FwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params, kBlockM)) return;
    }
    const int batch = static_cast<int>(tile.batch), head = static_cast<int>(tile.head);
    const int m_block = static_cast<int>(tile.m_block);
    const HeadSlice<T, float> in(params, batch, head);  // q, k, v (out and lse: after the loop)
    T* const sQ = reinterpret_cast<T*>(dynamic_smem());  // Q, later the output staging
    const float scale_log2 = softmax_scale_log2<float>(params);  // 1 where a bias's epilogue scales
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile

    const WindowMask mask(params);
    int n_begin, n_end;
    const UnmaskedBlocks unmasked = key_blocks<Tr>(params, m_block, n_begin, n_end);
    if constexpr (kSplit) split_key_blocks(params, blockIdx.y, n_begin, n_end);
    KVPipeline<Tr, T, kWholeKV> kv(params, in.k, in.v, sQ + Tr::QTile::kElements, n_end);
    if (n_begin < n_end) kv.start_with_queries(sQ, in.q, m_block, n_begin);

    OnlineSoftmax<float, Tr::kRows, 4> softmax;
    float o[Tr::kRows][Tr::kOCols] = {};
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        float s[Tr::kRows][Tr::kSCols];
        kv.await_keys(n_block);
        mma_qk<Tr>(s, sQ, kv.keys(), row0);
        score_epilogue<BlockRule, true, Units::kRaw>(
            s, M16n8Fragment{}, mask, params,
            ScoreTile{batch, head, static_cast<int64_t>(m_block) * kBlockM + row0,
                      static_cast<int64_t>(n_block) * kBlockN, 0, kBlockN},
            unmasked.needs_mask(n_block));
        softmax.template update_unscaled<Tr::kLazyRescale>(s, o, scale_log2);
        uint32_t p[Tr::kKeySteps][Tr::kMTiles][4];
        scores_to_a<Tr, T>(p, s);
        kv.await_values(n_block);
        mma_pv<Tr>(o, p, kv.values());
        kv.advance();
    }

    finish_output<Tr, kSplit>(params, batch, head, m_block, row0, sQ, softmax, o);
}

// fwd_mma_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLazyRescale,
          bool kSplit = false, bool kWholeKV = false>
constexpr int fwd_mma_kernel_smem() {
    return MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>::kSmemBytes;
}

}  // namespace cf
