// fwd_tf32.cu -- the float32 forward on tensor cores, when the caller allows
// TF32 (attention(..., precision="tf32" or "tf32x3")): FlashAttention-2 with
// mma.sync m16n8k8 .tf32 and float32 accumulation, sm_80 and later.
//
// kPasses = 1 ("tf32"): every operand rounded to TF32 once, one MMA per
// product -- scores and output good to about 2^-11 relative.  kPasses = 3
// ("tf32x3"): every operand split into two TF32 parts, three MMAs per
// product -- errors of the order of float32 arithmetic's (tf32_tile.cuh).
//
// A CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps
// owns kWarpRows of them (kMTiles m16 tiles), as in fwd_mma.  Q, K and V move
// through shared memory as float tiles on fwd_simt's schedule (fwd_tiles.cuh:
// Q once, K and V in their own buffers by cp.async, V(n) landing during
// S = Q K(n)^T, K(n + 1) during O += P V(n)).  Per key block every warp computes
//     S = Q K^T        tf32_abt: Q and K fragments by 16-byte loads
//     mask             only on blocks that cross a mask boundary (score.cuh)
//     online softmax   OnlineSoftmax<float, kRows, 4>, the scale folded into exp2
//     O += P V         tf32_accumulate: P's A fragments straight from the score
//                      accumulators, V's by 16-byte loads
// and divides O by l once, at the end (fwd_loop.cuh's loop with this file's
// products: Tf32FwdLoop); O's columns are in tf32_accumulate's
// order, which store_row_tf32 undoes.  Q and V are stored as fragment quads,
// K as rows (Tf32FwdTraits), each thread rounding (or splitting) its own copies
// in place as they land: every fragment is one 16-byte load, free of bank
// conflicts, with no conversion (K and V; Q with one pass) and no register
// moves.  The dispatcher (cupyflash/_gpu.py) gives this kernel float32 with
// d = dv up to 128 and scale > 0 on sm_80+; columns past the run-time d are
// zero-filled by cp.async and never stored.  Split-KV (FwdParams::num_splits > 1) as in
// fwd_simt: CTA (x, y) visits the y-th run of its key blocks and writes its
// partial results.
#pragma once

#include "block_info.cuh"
#include "fwd_blocks.cuh"
#include "fwd_loop.cuh"
#include "fwd_tiles.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "tf32_tile.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The (head dim -> tile)
// table with the reason for each row is _TF32_TILES in cupyflash/_kernels.py.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kPasses_>
struct Tf32FwdTraits {
    using Acc = float;
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDim_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_, kPasses = kPasses_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
    static constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;           // accumulator rows per lane
    static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S = k8 steps of P V
    static constexpr int kSCols = 2 * kNTiles;          // score columns per lane and row
    static constexpr int kOCols = 2 * (kHeadDim / 8);   // output columns per lane and row

    // fwd_tiles.cuh's schedule, float tiles by cp.async into their own buffers
    // (Tf32TileMover).  Q and V are stored as fragment quads (Tf32Pairs: rows
    // g, g + 8 for Q's A fragments, 2t, 2t + 1 for V's B fragments), K as rows.
    // Once per CTA, as each tile lands, tf32_prepare_tile does for all warps
    // what each would otherwise do for itself: one pass rounds Q, K and V to
    // TF32 in place; three split K and V into TF32 big parts (in place) and
    // small parts (a second plane after each tile) as far as the shared memory
    // allows (below).  Q, which only its own warp reads, stays float32 there
    // and is split as it is loaded.
    static constexpr bool kAsync = true;
    using QLayout = Tf32Pairs<kHeadDim, 8>;
    using KLayout = Tf32Rows<kHeadDim>;
    using VLayout = Tf32Pairs<kHeadDim, 1>;
    // The split takes its second planes only where two CTAs still fit an
    // sm_80 SM (80 KB each): K's and V's (d = 32, 64), else V's alone (d = 128);
    // a tile without one stays float32 and each warp splits what it loads.
    static constexpr int kPlane = kBlockN * kHeadDim;  // elements of one K or V plane
    static constexpr int kQ = kBlockM * kHeadDim;
    static constexpr bool kSplitV = kPasses == 3 && (kQ + 3 * kPlane) * 4 <= 80 * 1024;
    static constexpr bool kSplitK = kPasses == 3 && (kQ + 4 * kPlane) * 4 <= 80 * 1024;
    static constexpr int kPrepK = kPasses == 1 ? kTf32Rounded : kSplitK ? kTf32Split : kTf32Raw;
    static constexpr int kPrepV = kPasses == 1 ? kTf32Rounded : kSplitV ? kTf32Split : kTf32Raw;
    using QTile = Tf32Tile<QLayout, kPasses == 1 ? kTf32Rounded : kTf32Raw>;
    using KTile = Tf32Tile<KLayout, kPrepK, kSplitK ? kPlane : 0>;
    using VTile = Tf32Tile<VLayout, kPrepV, kSplitV ? kPlane : 0>;
    static constexpr int kSmemQ = kQ, kSmemK = (kSplitK ? 2 : 1) * kPlane, kSmemV = (kSplitV ? 2 : 1) * kPlane;
    static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV) * static_cast<int>(sizeof(float));
    // __launch_bounds__ minimum CTAs per SM: 3 with one pass (168 registers;
    // at d = 32, whose 64 keys hold more scores per head-dim column, NVRTC 12.0
    // and 13.0 spill there, so 2), 2 with three.  S = Q K^T unrolls two
    // 16-column groups per iteration (all of them: up to 255 registers with
    // three passes, and spills with 128-row tiles).
    static constexpr int kMinBlocksPerSm = kPasses == 1 && kHeadDim > 32 ? 3 : 2;
    static constexpr int kUnrollQK = 2;

    static_assert(kPasses == 1 || kPasses == 3, "kPasses: 1 (tf32) or 3 (tf32x3)");
    static_assert(kBlockM % (16 * kWarps) == 0, "block_m: whole m16 tiles per warp");
    static_assert(kBlockN % 8 == 0, "block_n: whole n8 tiles");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "head dim bucket: 32, 64 or 128");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");
};

// SimtTiles' Mover: each thread copies whole units of a tile (tf32_copy_tile)
// and, once they have landed, interleaves and rounds them (tf32_prepare_tile).
template <class Tr>
struct Tf32TileMover {
    __device__ static void q(float* dst, const float* src, int64_t row_stride, int rows_valid, int cols_valid) {
        tf32_copy_tile<Tr::kThreads, Tr::kBlockM, Tr::kHeadDim, typename Tr::QLayout>(dst, src, row_stride,
                                                                                    rows_valid, cols_valid);
    }
    template <class Src>  // K and V: a pointer, or a paged cache's pages (paged.cuh)
    __device__ static void k(float* dst, const Src& src, int64_t row_stride, int rows_valid, int cols_valid) {
        tf32_copy_tile<Tr::kThreads, Tr::kBlockN, Tr::kHeadDim, typename Tr::KLayout>(dst, src, row_stride,
                                                                                    rows_valid, cols_valid);
    }
    template <class Src>
    __device__ static void v(float* dst, const Src& src, int64_t row_stride, int rows_valid, int cols_valid) {
        tf32_copy_tile<Tr::kThreads, Tr::kBlockN, Tr::kHeadDim, typename Tr::VLayout>(dst, src, row_stride,
                                                                                    rows_valid, cols_valid);
    }
    __device__ static void q_landed(float* dst) {
        tf32_prepare_tile<Tr::kThreads, Tr::kBlockM, Tr::kHeadDim, typename Tr::QTile>(dst);
    }
    __device__ static void k_landed(float* dst) {
        tf32_prepare_tile<Tr::kThreads, Tr::kBlockN, Tr::kHeadDim, typename Tr::KTile>(dst);
    }
    __device__ static void v_landed(float* dst) {
        tf32_prepare_tile<Tr::kThreads, Tr::kBlockN, Tr::kHeadDim, typename Tr::VTile>(dst);
    }
};

// The warp's rows of the normalised output (to out, rows out_row_stride apart)
// and their lse (to lse_out unless null): the call's output or a split's partials.
template <class Tr>
__device__ __forceinline__ void tf32_store(const float (&o)[Tr::kRows][Tr::kOCols], const float (&lse)[Tr::kRows],
                                           float* out, int64_t out_row_stride, float* lse_out,
                                           int64_t lse_row_stride, const QueryBlock& block, int row0, int dv) {
    const int t = lane_id() & 3;
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int row = row0 + fragment_row(r);
        if (row >= block.rows) continue;
        const int64_t i = block.m0 + row;
        store_row_tf32(out + i * out_row_stride, o[r], 1.0f, dv);
        if (lse_out != nullptr && t == 0) lse_out[i * lse_row_stride] = lse[r];
    }
}

// fwd_loop.cuh's hooks: the TF32 products, one warp per kWarpRows rows; the
// scale is folded into the softmax's exponent (update_unscaled).
template <class Tr>
struct Tf32FwdLoop : Tr {
    using Acc = float;
    using Thread = WarpRows<Tr::kWarpRows>;
    using Mover = Tf32TileMover<Tr>;
    using Rule = BlockRule;
    static constexpr Units kUnits = Units::kRaw;
    using Softmax = OnlineSoftmax<float, Tr::kRows, 4>;
    using Scores = float[Tr::kRows][Tr::kSCols];
    using Output = float[Tr::kRows][Tr::kOCols];
    static constexpr int kStatRows = Tr::kRows;

    __device__ static int first_row(const Thread& me) { return me.row0; }
    __device__ static M16n8Fragment fragment(const Thread&) { return {}; }
    template <class Tiles>
    __device__ static void scores(Scores& s, const Tiles& t, const Thread& me, int, float) {
        tf32_abt<Tr::kPasses, Tr::kMTiles, Tr::kNTiles, Tr::kHeadDim, typename Tr::QTile, typename Tr::KTile,
                 Tr::kUnrollQK>(s, t.sQ, t.sK, me.row0);
    }
    __device__ static void update(Softmax& softmax, Scores& s, Output& o, float scale_log2) {
        softmax.template update_unscaled<false>(s, o, kEpilogueScales ? 1.0f : scale_log2);
    }
    template <class Tiles>
    __device__ static void accumulate(Output& o, const Scores& s, const Tiles& t, const Thread&) {
        tf32_accumulate<Tr::kPasses, Tr::kMTiles, Tr::kNTiles, Tr::kHeadDim, typename Tr::VTile>(o, s, t.sV);
    }
    __device__ static void store(const Output& o, const float (&lse)[kStatRows], float* out, int64_t out_row_stride,
                                 float* lse_out, int64_t lse_row_stride, const QueryBlock& block, const Thread& me,
                                 const FwdParams& p) {
        tf32_store<Tr>(o, lse, out, out_row_stride, lse_out, lse_row_stride, block, me.row0,
                       static_cast<int>(p.head_dim_v));
    }
};

template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kPasses>
__global__ void __launch_bounds__((Tf32FwdTraits<kHeadDim, kBlockM, kBlockN, kWarps, kPasses>::kThreads),
                                  (Tf32FwdTraits<kHeadDim, kBlockM, kBlockN, kWarps, kPasses>::kMinBlocksPerSm))
fwd_tf32_kernel(const FwdParams params) {
    fwd_tile_loop<Tf32FwdLoop<Tf32FwdTraits<kHeadDim, kBlockM, kBlockN, kWarps, kPasses>>, float>(params);
}

// fwd_tf32_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kPasses>
constexpr int fwd_tf32_kernel_smem() {
    return Tf32FwdTraits<kHeadDim, kBlockM, kBlockN, kWarps, kPasses>::kSmemBytes;
}

}  // namespace cf
