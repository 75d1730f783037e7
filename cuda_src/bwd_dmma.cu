// bwd_dmma.cu -- the float64 backward on tensor cores: FlashAttention-2's
// backward with mma.sync m8n8k4 .f64 (DMMA), sm_80 and later.
//
// The algorithm and the launch order are bwd_simt's (its delta kernel runs
// first): with P recomputed from the forward's lse,
//     P  = exp2(S * scale * log2(e) - lse * log2(e))      S = Q K^T
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - delta)
//     dK = scale * dS^T Q                   dQ = scale * dS K
// Every product is a chain of double FMAs on the FP64 tensor cores, so the
// gradients are float64 throughout, as bwd_simt's are.  Two kernels:
//   bwd_dmma_dkdv_kernel  a CTA owns kOwn keys of one kv head (K, V in shared
//                         memory, dK, dV in registers) and streams the query
//                         blocks that see them, head by head through the kv
//                         head's query group;
//   bwd_dmma_dq_kernel    a CTA owns kOwn query rows (Q, dO in shared memory,
//                         dQ in registers) and streams the key blocks they see.
// Every gradient element is summed by one lane in a fixed order, so results
// are bit-identical from run to run; there is no atomic variant
// (deterministic=False runs the same kernels).  The kernels' loops are
// bwd_tc_loops.cuh's, shared with bwd_tf32.cu; this file supplies the DMMA
// products, the layouts and the tile loads (DmmaBwdTraits).
//
// Each of the kWarps warps owns kWarpRows = kOwn / kWarps of the CTA's rows
// (kMTiles m8 tiles).  Per streamed block of kStream rows a warp computes
//     X = Own Stream^T    (S^T = K Q^T, dP^T = V dO^T; S = Q K^T, dP = dO V^T)
//                         A fragments: the own tile's rows; B fragments: the
//                         streamed tile's rows
//     G += X' Stream      (dV += P^T dO, dK += dS^T Q; dQ += dS K)
//                         A fragments: X' gathered from the accumulators by
//                         two quad shuffles (gather_a); B fragments: the
//                         streamed tile's columns
// so Q and dO (streamed in dK/dV) and K (streamed in dQ) are read both ways:
// every tile uses DmmaRows, conflict-free for both (dmma_tile.cuh).  The
// streamed tiles are double-buffered: the next block's copy (cp.async) runs
// while this one is computed.  The dispatcher (cupyflash/_gpu_bwd.py) gives
// these kernels float64 with d = dv up to 128 on sm_80 / sm_90 (rows not
// 16-byte aligned are copied a word at a time); columns past the run-time d
// are zero-filled by cp.async.
//
// float32 (T = float, opt-in with the forward's fwd_dmma float32 kernels): the
// tiles are widened to double on the way into shared memory (converting loads
// between barriers, one streamed stage), every product and sum is double, and
// the gradients are rounded to float once.  lse and delta stay float32 (the
// forward's and the delta kernel's), so P is as exact as float32 lse allows.
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "bwd_tc_loops.cuh"
#include "dmma_tile.cuh"
#include "mask.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// x = X Y^T for the warp's rows of the own tile sX (from row0) and every row
// of the streamed tile sY, over the bucket's columns (zero past the run-time d).
template <class Tr>
__device__ __forceinline__ void dmma_row_products(double (&x)[Tr::kMTiles][Tr::kSCols], const double* sX,
                                                  const double* sY, int row0) {
    using Layout = typename Tr::Layout;
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) x[mi][c] = 0.0;
    // Eight k4 steps per unrolled iteration: fully unrolled, the d = 64 dK/dV
    // kernel's 64 own rows hoist enough fragment loads to spill 28-36 bytes.
#pragma unroll 8
    for (int kk = 0; kk < Tr::kKSteps; ++kk) {
        double a[Tr::kMTiles], b[Tr::kNTiles];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) a[mi] = sX[Layout::offset(row0 + 8 * mi + g, 4 * kk + t)];
#pragma unroll
        for (int ni = 0; ni < Tr::kNTiles; ++ni) b[ni] = sY[Layout::offset(8 * ni + g, 4 * kk + t)];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int ni = 0; ni < Tr::kNTiles; ++ni) {
                double (&acc)[2] = pair(x[mi], ni);
                mma_m8n8k4_f64(acc, a[mi], b[ni], acc);
            }
    }
}

// grad += X Z: X the warp's rows over the streamed rows (accumulators of
// dmma_row_products' shape), Z the streamed tile sZ.
template <class Tr>
__device__ __forceinline__ void dmma_accumulate(double (&grad)[Tr::kMTiles][Tr::kGCols],
                                                const double (&x)[Tr::kMTiles][Tr::kSCols], const double* sZ) {
    using Layout = typename Tr::Layout;
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int kk = 0; kk < Tr::kStreamSteps; ++kk) {
        double a[Tr::kMTiles];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) a[mi] = gather_a(x[mi], kk);
#pragma unroll
        for (int nj = 0; nj < Tr::kGTiles; ++nj) {
            const double b = sZ[Layout::offset(4 * kk + t, 8 * nj + g)];
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                double (&acc)[2] = pair(grad[mi], nj);
                mma_m8n8k4_f64(acc, a[mi], b, acc);
            }
        }
    }
}

// Write factor * grad, rounded to Out, for the warp's rows below rows_valid
// (from row0 of a tile whose first row is dst) and columns below cols_valid.
template <class Tr, typename Out>
__device__ __forceinline__ void dmma_store_rows(Out* dst, int64_t row_stride,
                                                const double (&grad)[Tr::kMTiles][Tr::kGCols], double factor,
                                                int row0, int rows_valid, int cols_valid) {
    const int g = lane_id() >> 2;
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        const int row = row0 + 8 * mi + g;
        if (row >= rows_valid) continue;
        Out* out = dst + row * row_stride;
#pragma unroll
        for (int c = 0; c < Tr::kGCols; ++c)
            if (fragment_col(c) < cols_valid) out[fragment_col(c)] = static_cast<Out>(factor * grad[mi][c]);
    }
}

// A rows x kHeadDim tile of T from global memory into shared doubles (rows
// past rows_valid and columns past d zero): by cp.async for double (the caller
// commits, waits and synchronises), by converting loads for float (the caller
// synchronises).
template <class Tr, int kRows, typename T>
__device__ __forceinline__ void dmma_load_tile(double* dst, const T* src, int64_t row_stride, int rows_valid,
                                               int d) {
    if constexpr (Tr::kAsync) {
        cp_async_tile_rows<Tr::kThreads, kRows, Tr::kHeadDim>(dst, typename Tr::Layout{}, src, row_stride,
                                                             rows_valid, d);
    } else {
        load_tile<Tr::kThreads>(dst, typename Tr::Layout{}, src, row_stride, kRows, Tr::kHeadDim, rows_valid, d);
    }
}

// Every compile-time quantity of one instantiation: kOwn rows stay in shared
// memory for the whole CTA, kStream rows are reloaded per block.  The tile
// table with the reason for each row is _BWD_DMMA_TILES in cupyflash/_kernels.py.
template <typename T_, int kHeadDim_, int kOwn_, int kStream_, int kWarps_>
struct DmmaBwdTraits {
    using T = T_;
    using Acc = double;   // the tiles, every product and sum
    using Out = acc_t<T>;  // lse, delta and the gradients: the call's accumulator type
    static constexpr int kHeadDim = kHeadDim_, kOwnRows = kOwn_, kStreamRows = kStream_, kWarps = kWarps_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kOwnRows / kWarps;  // own rows per warp
    static constexpr int kMTiles = kWarpRows / 8;        // m8 tiles per warp = accumulator rows per lane
    static constexpr int kRows = kMTiles;
    static constexpr int kNTiles = kStreamRows / 8;      // n8 tiles of S, dP
    static constexpr int kSCols = 2 * kNTiles;           // S, dP columns per lane and row
    static constexpr int kGTiles = kHeadDim / 8;         // n8 tiles of a gradient row
    static constexpr int kGCols = 2 * kGTiles;           // gradient columns per lane and row
    static constexpr int kKSteps = kHeadDim / 4;         // k4 steps of S, dP
    static constexpr int kStreamSteps = kStreamRows / 4; // k4 steps of the gradient products

    using Layout = DmmaRows<kHeadDim>;
    // double tiles go straight to shared memory by cp.async, the next streamed
    // block while this one is computed (two stages); float ones are widened on
    // the way in by converting loads between barriers (one stage).
    static constexpr bool kAsync = SameType<T, double>::value;
    static constexpr int kStages = kAsync ? 2 : 1;
    // Shared memory (doubles): the two own tiles, then kStages stages of the two streamed tiles.
    static constexpr int kOwnTile = kOwnRows * kHeadDim, kStreamTile = kStreamRows * kHeadDim;
    static constexpr int kSmemBytes =
        (2 * kOwnTile + 2 * kStages * kStreamTile) * static_cast<int>(sizeof(double));
    // __launch_bounds__ minimum CTAs per SM: 2 leaves every thread the 255-register maximum.
    static constexpr int kMinBlocksPerSm = 2;

    static_assert(kOwnRows % (8 * kWarps) == 0, "own block: whole m8 tiles per warp");
    static_assert(kStreamRows % 8 == 0, "streamed block: whole n8 tiles");
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "head dim bucket: a multiple of 16 up to 128");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");

    // bwd_tc_loops.cuh's interface: the accumulators are DMMA's (row g of m8 tile r).
    using Fragment = M8n8Fragment;
    // At d = 128 with score terms or modifications, dV's product before dP's:
    // the dK/dV kernel spilled 12-16 B with a score_mod after dP's, none before.
    // Elsewhere after: without terms, before took 8.8 % more main-loop
    // instructions at d = 128 (254 -> 238 registers, sm_80); d = 32 with two
    // biases and a mask spilled 20 B before.
    static constexpr bool kDvFirst = (kAnyTerms || kSeqLengths) && kHeadDim_ >= 128;
    __device__ static void row_products(double (&x)[kRows][kSCols], const double* sX, const double* sY, int row0) {
        dmma_row_products<DmmaBwdTraits>(x, sX, sY, row0);
    }
    __device__ static void accumulate(double (&g)[kRows][kGCols], const double (&x)[kRows][kSCols], const double* sZ) {
        dmma_accumulate<DmmaBwdTraits>(g, x, sZ);
    }
    __device__ static void store_rows(Out* dst, int64_t row_stride, const double (&g)[kRows][kGCols], double factor,
                                      int row0, int rows_valid, int cols_valid) {
        dmma_store_rows<DmmaBwdTraits>(dst, row_stride, g, factor, row0, rows_valid, cols_valid);
    }
    template <int kTileRows, bool kOwned>  // own and streamed tiles alike
    __device__ static void load_tile(double* dst, const T* src, int64_t row_stride, int rows_valid, int d) {
        dmma_load_tile<DmmaBwdTraits, kTileRows>(dst, src, row_stride, rows_valid, d);
    }
    template <int kTileRows, bool kOwned>
    __device__ static void tile_landed(double*) {}  // used as copied
};


// dK, dV of kOwn keys of one (batch, kv head).  T: double, or float (opt-in:
// computed in double, the gradients rounded to float once).
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
__global__ void __launch_bounds__((DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kThreads),
                                  (DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kMinBlocksPerSm))
bwd_dmma_dkdv_kernel(const BwdParams params) {
    bwd_dkdv_loop<DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>>(params);
}

// bwd_dmma_dkdv_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
constexpr int bwd_dmma_dkdv_kernel_smem() {
    return DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kSmemBytes;
}

// dQ of kOwn query rows of one (batch, query head); T as for the dK/dV kernel.
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
__global__ void __launch_bounds__((DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kThreads),
                                  (DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kMinBlocksPerSm))
bwd_dmma_dq_kernel(const BwdParams params) {
    bwd_dq_loop<DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>>(params);
}

// bwd_dmma_dq_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
constexpr int bwd_dmma_dq_kernel_smem() {
    return DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kSmemBytes;
}

}  // namespace cf
