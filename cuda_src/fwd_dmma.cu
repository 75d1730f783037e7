// fwd_dmma.cu -- the float64 forward on tensor cores: FlashAttention-2 with
// mma.sync m8n8k4 .f64 (DMMA), sm_80 and later.
//
// Double precision throughout: the products and sums of DMMA are those of
// double fused multiply-adds (ptx-fragments.md section 3), the softmax is the
// SIMT kernels' OnlineSoftmax<double>.  On an A100 or H100 the FP64 tensor
// cores run twice the rate of the FP64 CUDA cores that fwd_simt uses.
//
// A CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps
// owns kWarpRows = kBlockM / kWarps of them (kMTiles m8 tiles).  Q, K and V
// move through shared memory as in fwd_simt's float64 path (fwd_tiles.cuh:
// Q once, K and V in their own buffers by cp.async, V(n) landing during S =
// Q K(n)^T, K(n + 1) during O += P V(n)).  Per key block, every warp computes
//     S = Q K^T                   k4 steps: an A fragment per m8 tile (Q[g][t]),
//                                 a B fragment per n8 tile (K[n + g][t])
//     mask                        only on blocks that cross a mask boundary (score.cuh)
//     online softmax, exp2        OnlineSoftmax<double, kMTiles, 4>: lane (g, t)
//                                 holds row g of each m8 tile, columns 2t, 2t + 1
//                                 of each n8 tile; rows reduce over the quad
//     O += P V                    P's A fragments (P[g][k + t]) gathered from the
//                                 score accumulators by two quad shuffles each;
//                                 B fragments V[k + t][n + g]
// and divides O by l once, at the end: fwd_loop.cuh's loop with this file's
// products (DmmaFwdLoop).
//
// Shared layouts (16-byte chunks of 2 doubles): Q and K rows swizzle their
// chunks by XOR with row % 8, so the 8 rows x 4 columns of an A or B fragment
// of S hit 16 chunks spread over all 32 banks (two wavefronts, the minimum for
// 256 bytes); V's fragment is 4 rows x 8 columns, so V rows XOR their chunks
// with 4 x (row % 4) (DmmaVRows) to the same effect.  The dispatcher
// (cupyflash/_gpu.py) gives this kernel float64 with d = dv up to 128 on
// sm_80 / sm_90; columns past the run-time d are zero-filled by cp.async.
//
// float32 (T = float, opt-in): the tiles are widened to double on the way into
// shared memory (fwd_tiles.cuh's converting path, one K/V buffer), so every
// product of two float32 inputs is exact and every sum a double; out and lse
// are rounded to float once, at the end -- closer to the exact result than
// float32 arithmetic, at the FP64 tensor cores' rate.  Split-KV (FwdParams::num_splits > 1) as in fwd_simt: CTA (x, y)
// visits the y-th run of its key blocks and writes its partial results.
#pragma once

#include "block_info.cuh"
#include "dmma_tile.cuh"
#include "fwd_loop.cuh"
#include "fwd_tiles.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The (head dim -> tile)
// table with the reason for each row is _DMMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct DmmaFwdTraits {
    using Acc = double;  // the shared tiles and every product
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDim_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
    static constexpr int kMTiles = kWarpRows / 8;       // m8 tiles per warp = accumulator rows per lane
    static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S
    static constexpr int kSCols = 2 * kNTiles;          // score columns per lane and row
    static constexpr int kOTiles = kHeadDim / 8;        // n8 tiles of O
    static constexpr int kOCols = 2 * kOTiles;          // output columns per lane and row
    static constexpr int kKSteps = kHeadDim / 4;        // k4 steps of S = Q K^T
    static constexpr int kKeySteps = kBlockN / 4;       // k4 steps of O += P V

    // fwd_tiles.cuh's schedule: double needs no conversion, so cp.async into
    // separate K and V buffers; float is widened on the way in, one K/V buffer.
    static constexpr bool kAsync = SameType<T, double>::value;
    using QLayout = SwizzledRows<double, kHeadDim>;
    using KLayout = SwizzledRows<double, kHeadDim>;
    __device__ static DmmaVRows<kHeadDim> v_layout() { return {}; }
    static constexpr int kSmemQ = kBlockM * kHeadDim, kSmemK = kBlockN * kHeadDim;
    static constexpr int kSmemV = kAsync ? kBlockN * kHeadDim : 0;  // else V reuses the K buffer
    static constexpr int kSmemBytes = (kSmemQ + kSmemK + kSmemV) * static_cast<int>(sizeof(double));
    // __launch_bounds__ minimum CTAs per SM: 2 leaves every thread the 255-register maximum.
    static constexpr int kMinBlocksPerSm = 2;

    static_assert(kBlockM % (8 * kWarps) == 0, "block_m: whole m8 tiles per warp");
    static_assert(kBlockN % 8 == 0, "block_n: whole n8 tiles");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "head dim bucket: 32, 64 or 128");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");
};

// s = (Q K^T) * scale_log2 for the warp's rows (from row0 of the Q tile) and the key block.
template <class Tr>
__device__ __forceinline__ void dmma_qk(double (&s)[Tr::kMTiles][Tr::kSCols], const double* sQ,
                                        const double* sK, int row0, double scale_log2) {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] = 0.0;
#pragma unroll
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        double a[Tr::kMTiles], b[Tr::kNTiles];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) a[mi] = sQ[Tr::QLayout::offset(row0 + 8 * mi + g, 4 * kk + t)];
#pragma unroll
        for (int ni = 0; ni < Tr::kNTiles; ++ni) b[ni] = sK[Tr::KLayout::offset(8 * ni + g, 4 * kk + t)];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int ni = 0; ni < Tr::kNTiles; ++ni) {
                double (&acc)[2] = pair(s[mi], ni);
                mma_m8n8k4_f64(acc, a[mi], b[ni], acc);
            }
    }
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] *= scale_log2;
}

// o += P V, P the (unnormalised) probabilities in the score accumulators.  Key
// step kk takes keys 4 kk .. 4 kk + 3: P's A fragment comes from the
// accumulators by gather_a (dmma_tile.cuh).
template <class Tr>
__device__ __forceinline__ void dmma_pv(double (&o)[Tr::kMTiles][Tr::kOCols],
                                        const double (&p)[Tr::kMTiles][Tr::kSCols], const double* sV) {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
        double a[Tr::kMTiles];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) a[mi] = gather_a(p[mi], kk);
#pragma unroll
        for (int nj = 0; nj < Tr::kOTiles; ++nj) {
            const double b = sV[DmmaVRows<Tr::kHeadDim>::offset(4 * kk + t, 8 * nj + g)];
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                double (&acc)[2] = pair(o[mi], nj);
                mma_m8n8k4_f64(acc, a[mi], b, acc);
            }
        }
    }
}

// The warp's rows of the normalised output (to out, rows out_row_stride apart)
// and their lse (to lse_out unless null): the call's output or a split's partials,
// rounded to Out (float for float inputs).
template <class Tr, typename Out>
__device__ __forceinline__ void dmma_store(const double (&o)[Tr::kMTiles][Tr::kOCols],
                                           const double (&lse)[Tr::kMTiles], Out* out, int64_t out_row_stride,
                                           Out* lse_out, int64_t lse_row_stride, const QueryBlock& block,
                                           int row0, int dv) {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        const int row = row0 + 8 * mi + g;
        if (row >= block.rows) continue;
        const int64_t i = block.m0 + row;
        Out* out_row = out + i * out_row_stride;
#pragma unroll
        for (int nj = 0; nj < Tr::kOTiles; ++nj) {
            const int col = 8 * nj + 2 * t;
            if (col < dv) out_row[col] = static_cast<Out>(o[mi][2 * nj]);
            if (col + 1 < dv) out_row[col + 1] = static_cast<Out>(o[mi][2 * nj + 1]);
        }
        if (lse_out != nullptr && t == 0) lse_out[i * lse_row_stride] = static_cast<Out>(lse[mi]);
    }
}

// fwd_loop.cuh's hooks: the DMMA products above, one warp per kWarpRows rows.
template <class Tr>
struct DmmaFwdLoop : Tr {
    using Acc = double;
    using Thread = WarpRows<Tr::kWarpRows>;
    using Mover = RowTileMover<Tr>;
    using Rule = WindowRule<false>;
    static constexpr Units kUnits = Units::kLog2;
    using Softmax = OnlineSoftmax<double, Tr::kMTiles, 4>;
    using Scores = double[Tr::kMTiles][Tr::kSCols];
    using Output = double[Tr::kMTiles][Tr::kOCols];
    static constexpr int kStatRows = Tr::kMTiles;

    __device__ static int first_row(const Thread& me) { return me.row0; }
    __device__ static M8n8Fragment fragment(const Thread&) { return {}; }
    template <class Tiles>
    __device__ static void scores(Scores& s, const Tiles& t, const Thread& me, int, double scale_log2) {
        dmma_qk<Tr>(s, t.sQ, t.sK, me.row0, scale_log2);
    }
    __device__ static void update(Softmax& softmax, Scores& s, Output& o, double) { softmax.update(s, o); }
    template <class Tiles>
    __device__ static void accumulate(Output& o, const Scores& s, const Tiles& t, const Thread&) {
        dmma_pv<Tr>(o, s, t.sV);
    }
    template <typename Out>
    __device__ static void store(const Output& o, const double (&lse)[kStatRows], Out* out, int64_t out_row_stride,
                                 Out* lse_out, int64_t lse_row_stride, const QueryBlock& block, const Thread& me,
                                 const FwdParams& p) {
        dmma_store<Tr>(o, lse, out, out_row_stride, lse_out, lse_row_stride, block, me.row0,
                       static_cast<int>(p.head_dim_v));
    }
};

// T: double, or float (opt-in: products exact, sums in double, the output and
// lse rounded to float once at the end).
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename T = double>
__global__ void __launch_bounds__((DmmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>::kThreads),
                                  (DmmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>::kMinBlocksPerSm))
fwd_dmma_kernel(const FwdParams params) {
    fwd_tile_loop<DmmaFwdLoop<DmmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>>, T>(params);
}

// fwd_dmma_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename T = double>
constexpr int fwd_dmma_kernel_smem() {
    return DmmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps>::kSmemBytes;
}

}  // namespace cf
