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
// (deterministic=False runs the same kernels).
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
#include "dmma_tile.cuh"
#include "mask.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation: kOwn rows stay in shared
// memory for the whole CTA, kStream rows are reloaded per block.  The tile
// table with the reason for each row is _BWD_DMMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kOwn_, int kStream_, int kWarps_>
struct DmmaBwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kOwnRows = kOwn_, kStreamRows = kStream_, kWarps = kWarps_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kOwnRows / kWarps;  // own rows per warp
    static constexpr int kMTiles = kWarpRows / 8;        // m8 tiles per warp = accumulator rows per lane
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
};

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

// The stages of the streamed tiles (Q, dO in dK/dV; K, V in dQ) after the own
// tiles; load() fills one stage with one block (dmma_load_tile's protocol).
template <class Tr>
struct DmmaStream {
    double* base;
    __device__ double* first(int stage) const { return base + 2 * stage * Tr::kStreamTile; }
    __device__ double* second(int stage) const { return first(stage) + Tr::kStreamTile; }
    template <typename T>
    __device__ void load(int stage, const T* src1, int64_t stride1, const T* src2, int64_t stride2, int rows,
                         int d) const {
        dmma_load_tile<Tr, Tr::kStreamRows>(first(stage), src1, stride1, rows, d);
        dmma_load_tile<Tr, Tr::kStreamRows>(second(stage), src2, stride2, rows, d);
    }
    // Make block `it` of the loop readable in stage(it), and (double) start
    // copying block it + 1 into the other stage: load_next(stage) loads the next
    // block, load_this(stage) this one (float: one stage, loaded in turn).
    __device__ static int stage(int64_t it) { return Tr::kAsync ? static_cast<int>(it & 1) : 0; }
    template <class LoadNext, class LoadThis>
    __device__ void advance(int64_t it, int64_t count, LoadNext load_next, LoadThis load_this) const {
        if constexpr (Tr::kAsync) {
            cp_async_wait<0>();
            __syncthreads();  // this block landed; the other stage has been read
            if (it + 1 < count) {
                load_next(stage(it) ^ 1);
                cp_async_commit();
            }
        } else {
            __syncthreads();  // the previous block has been read
            load_this(0);
            __syncthreads();
        }
    }
};

// dK, dV of kOwn keys of one (batch, kv head).  T: double, or float (opt-in:
// computed in double, the gradients rounded to float once).
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
__global__ void __launch_bounds__((DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kThreads),
                                  (DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kMinBlocksPerSm))
bwd_dmma_dkdv_kernel(const BwdParams params) {
    using Tr = DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>;
    using Out = acc_t<T>;  // lse, delta and the gradients: the call's accumulator type
    const FwdParams& p = params.fwd;

    const KeyTileIndex tile(p, kOwn, blockIdx.x);
    const WindowMask mask(p);
    const KeyBlock block(p, mask, tile.n_block * kOwn, kOwn);
    const double scale_log2 = p.scale_log2;
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first key in the block
    const int g = lane_id() >> 2;
    const int64_t first_head = tile.head_kv * p.gqa_ratio;  // the kv head's query group

    double* sK = reinterpret_cast<double*>(dynamic_smem());
    double* sV = sK + Tr::kOwnTile;
    const DmmaStream<Tr> stream{sV + Tr::kOwnTile};  // Q, dO
    const HeadSlice<T, Out> kv(p, tile.batch, first_head);
    dmma_load_tile<Tr, kOwn>(sK, kv.k + block.n0 * p.k_row_stride, p.k_row_stride, block.keys, d);
    dmma_load_tile<Tr, kOwn>(sV, kv.v + block.n0 * p.v_row_stride, p.v_row_stride, block.keys, d);

    // (head, m_block) walks heads first_head.. and, within each, the query
    // blocks m_begin..m_end that see these keys.
    const int64_t m_begin = block.m_begin(kStream), m_end = block.m_end(kStream);
    const int64_t num_blocks = (m_end - m_begin) * p.gqa_ratio;
    auto load_queries = [&](int stage, int64_t head, int64_t m_block) {
        const int64_t m0 = m_block * kStream;
        const HeadSlice<T, Out> qo(p, tile.batch, head);
        const GradSlice<T, Out> grad(params, tile.batch, head);
        stream.load(stage, qo.q + m0 * p.q_row_stride, p.q_row_stride, grad.dout + m0 * params.dout_row_stride,
                    params.dout_row_stride, static_cast<int>(min64(kStream, p.seqlen_q - m0)), d);
    };

    double dk[Tr::kMTiles][Tr::kGCols] = {};
    double dv[Tr::kMTiles][Tr::kGCols] = {};
    int64_t head = first_head, m_block = m_begin;
    if constexpr (Tr::kAsync) {
        if (num_blocks > 0) load_queries(0, head, m_block);
        cp_async_commit();  // K, V and the first query block
    }
    for (int64_t it = 0; it < num_blocks; ++it) {
        const int stage = stream.stage(it);
        const int64_t next_head = m_block + 1 == m_end ? head + 1 : head;
        const int64_t next_m_block = m_block + 1 == m_end ? m_begin : m_block + 1;
        stream.advance(it, num_blocks, [&](int st) { load_queries(st, next_head, next_m_block); },
                       [&](int st) { load_queries(st, head, m_block); });
        const double* sQ = stream.first(stage);
        const double* sdO = stream.second(stage);
        const int64_t m0 = m_block * kStream;
        const HeadSlice<T, Out> qo(p, tile.batch, head);
        const GradSlice<T, Out> grad(params, tile.batch, head);

        double s[Tr::kMTiles][Tr::kSCols], dp[Tr::kMTiles][Tr::kSCols];
        dmma_row_products<Tr>(s, sK, sQ, row0);  // S^T = K Q^T
        double lse_log2[Tr::kSCols], delta[Tr::kSCols];
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c)
            load_query_stats(lse_log2[c], delta[c], qo.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                             m0 + fragment_col(c), p.seqlen_q);
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] = exp2(s[mi][c] * scale_log2 - lse_log2[c]);  // P^T
        if (block.needs_mask(p, mask, m0, kStream, kOwn)) {
            // P of pairs (query i, key j) the mask hides, or past Lq or Lk -> 0 (a select:
            // whatever the padded scores held never reaches the gradients).
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) {
                const int64_t i = m0 + fragment_col(c);
                int lo, hi;
                mask.row_range(i, block.n0, kOwn, lo, hi);
#pragma unroll
                for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                    const int key = row0 + 8 * mi + g;
                    if (i >= p.seqlen_q || key < lo || key >= hi) s[mi][c] = 0.0;
                }
            }
        }
        dmma_row_products<Tr>(dp, sV, sdO, row0);  // dP^T = V dO^T
        dmma_accumulate<Tr>(dv, s, sdO);           // dV += P^T dO
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) dp[mi][c] = s[mi][c] * (dp[mi][c] - delta[c]);  // dS^T
        dmma_accumulate<Tr>(dk, dp, sQ);           // dK += dS^T Q
        head = next_head;
        m_block = next_m_block;
    }
    if constexpr (Tr::kAsync) cp_async_wait<0>();  // K and V of a block no query row sees

    const GradSlice<T, Out> kv_grad(params, tile.batch, first_head);
    dmma_store_rows<Tr>(kv_grad.dk + block.n0 * params.dk_row_stride, params.dk_row_stride, dk, p.scale, row0,
                        block.keys, d);
    dmma_store_rows<Tr>(kv_grad.dv + block.n0 * params.dv_row_stride, params.dv_row_stride, dv, 1.0, row0,
                        block.keys, d);
}

// dQ of kOwn query rows of one (batch, query head); T as for the dK/dV kernel.
template <int kHeadDim, int kOwn, int kStream, int kWarps, typename T = double>
__global__ void __launch_bounds__((DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kThreads),
                                  (DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>::kMinBlocksPerSm))
bwd_dmma_dq_kernel(const BwdParams params) {
    using Tr = DmmaBwdTraits<T, kHeadDim, kOwn, kStream, kWarps>;
    using Out = acc_t<T>;
    const FwdParams& p = params.fwd;

    const TileIndex tile(p, kOwn, blockIdx.x);
    const HeadSlice<T, Out> head(p, tile.batch, tile.head);
    const GradSlice<T, Out> grad(params, tile.batch, tile.head);
    const WindowMask mask(p);
    const QueryBlock block(p, mask, tile.m_block * kOwn, kOwn);
    const double scale_log2 = p.scale_log2;
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first query row in the block
    const int g = lane_id() >> 2;

    double* sQ = reinterpret_cast<double*>(dynamic_smem());
    double* sdO = sQ + Tr::kOwnTile;
    const DmmaStream<Tr> stream{sdO + Tr::kOwnTile};  // K, V
    dmma_load_tile<Tr, kOwn>(sQ, head.q + block.m0 * p.q_row_stride, p.q_row_stride, block.rows, d);
    dmma_load_tile<Tr, kOwn>(sdO, grad.dout + block.m0 * params.dout_row_stride, params.dout_row_stride,
                             block.rows, d);
    double lse_log2[Tr::kMTiles], delta[Tr::kMTiles];
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
        load_query_stats(lse_log2[mi], delta[mi], head.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                         block.m0 + row0 + 8 * mi + g, p.seqlen_q);

    auto load_keys = [&](int stage, int64_t n_block) {
        const int64_t n0 = n_block * kStream;
        stream.load(stage, head.k + n0 * p.k_row_stride, p.k_row_stride, head.v + n0 * p.v_row_stride,
                    p.v_row_stride, QueryBlock::keys_in(p, n0, kStream), d);
    };

    double dq[Tr::kMTiles][Tr::kGCols] = {};
    const int64_t n_begin = block.n_begin(kStream), n_end = block.n_end(kStream);
    if constexpr (Tr::kAsync) {
        if (n_begin < n_end) load_keys(0, n_begin);
        cp_async_commit();  // Q, dO and the first key block
    }
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = stream.stage(n_block - n_begin);
        stream.advance(n_block - n_begin, n_end - n_begin, [&](int st) { load_keys(st, n_block + 1); },
                       [&](int st) { load_keys(st, n_block); });
        const double* sK = stream.first(stage);
        const double* sV = stream.second(stage);
        const int64_t n0 = n_block * kStream;

        double s[Tr::kMTiles][Tr::kSCols], dp[Tr::kMTiles][Tr::kSCols];
        dmma_row_products<Tr>(s, sQ, sK, row0);  // S = Q K^T
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] = exp2(s[mi][c] * scale_log2 - lse_log2[mi]);  // P
        if (block.needs_mask(mask, n0, kStream)) {
            // Keys the mask hides from a row, and keys past Lk -> P = 0 (rows past Lq
            // already have P = 0: their lse_log2 is +inf).
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                int lo, hi;
                mask.row_range(block.m0 + row0 + 8 * mi + g, n0, kStream, lo, hi);
#pragma unroll
                for (int c = 0; c < Tr::kSCols; ++c)
                    if (fragment_col(c) < lo || fragment_col(c) >= hi) s[mi][c] = 0.0;
            }
        }
        dmma_row_products<Tr>(dp, sdO, sV, row0);  // dP = dO V^T
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) dp[mi][c] = s[mi][c] * (dp[mi][c] - delta[mi]);  // dS
        dmma_accumulate<Tr>(dq, dp, sK);           // dQ += dS K
    }
    if constexpr (Tr::kAsync) cp_async_wait<0>();  // Q and dO of a block that sees no key

    dmma_store_rows<Tr>(grad.dq + block.m0 * params.dq_row_stride, params.dq_row_stride, dq, p.scale, row0,
                        block.rows, d);
}

}  // namespace cf
