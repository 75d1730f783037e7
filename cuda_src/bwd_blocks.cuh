// bwd_blocks.cuh -- the parts of the tensor-core backward kernels that do not
// depend on how the products are computed (bwd_mma.cu: mma.sync; bwd_wgmma.cu:
// wgmma): the streamed query blocks of the dK/dV kernels and key blocks of the
// dQ kernels, a query row's statistics, the probabilities' gradient on a
// warp's accumulator tile (the probabilities and the mask: score.cuh), and the
// gradient stores.  Everything takes the kernel's traits Tr (kThreads,
// kBlockStream, StreamTile, kRows, kSCols, kGCols) with a warp's accumulators
// in mma_tile.cuh's register-tile layout, which is also wgmma's (wgmma.cuh).
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

// Which gradients a dK/dV kernel launch computes (a bit set; bwd_mma and bwd_wgmma).
constexpr int kGradDV = 1;
constexpr int kGradDK = 2;
// With kGradDK: also add this CTA's share of dQ = scale dS K to dq with float
// atomics (deterministic=False), so that no dQ kernel recomputes S and dP.
constexpr int kGradDQAtomic = 4;
// With kGradDQAtomic (bwd_wgmma only): the share goes through shared memory and
// one warp adds it to dq by bulk asynchronous reductions (barriers.cuh), one per
// query row, instead of every thread issuing its own atomics.
constexpr int kGradDQBulk = 8;
// With kGradDQBulk (bwd_wgmma only, deterministic=True): the key blocks add their
// shares of a query block's dQ in key-block order, taking turns through a semaphore
// per query block (BwdParams::dq_turns, barriers.cuh): dq's bits do not depend on
// the schedule.
constexpr int kGradDQOrdered = 16;

// A query row's statistics come from `stat(r, c)`, a callable giving the value
// for accumulator element [r][c]: indexed by the row in the dQ kernel (one
// register per accumulator row), by the column in the dK/dV kernel (staged in
// shared memory, one float per streamed query row).

// lse * log2(e) and delta of query row i; +inf and 0 past Lq and for a row
// that sees no key (lse = -inf), whose probabilities are then exp2(-inf) = 0.
__device__ __forceinline__ void query_stats(float& lse_log2, float& delta, const float* lse,
                                            int64_t lse_row_stride, const float* delta_in,
                                            int64_t delta_row_stride, int64_t i, int64_t seqlen_q) {
    constexpr float kLog2e = 1.44269504088896340736f;
    lse_log2 = -neg_inf<float>();
    delta = 0.0f;
    if (i < seqlen_q) {
        const float l = lse[i * lse_row_stride];
        if (l != neg_inf<float>()) lse_log2 = l * kLog2e;
        delta = delta_in[i * delta_row_stride];
    }
}

// The dK/dV kernels' streamed query blocks: per stage a Q and a dO tile
// (Tr::StreamTile, copied by cp.async) at `tiles`, and the rows' lse * log2(e)
// and delta (one float each per row, written by the thread of that row) at
// `stats`.  kBlockM = Tr::kBlockStream rows per block.  kWhole: every query
// block is complete and d is the bucket (bwd_mma's whole-stream instantiations:
// Lq a multiple of the block): the copies skip the bounds (cp_async_tile's kWhole).
template <class Tr, typename T, bool kWhole = false>
struct QueryStream {
    static constexpr int kBlockM = Tr::kBlockStream;
    static_assert(kBlockM <= Tr::kThreads, "one thread per streamed row loads its statistics");

    const BwdParams& params;
    int64_t batch;
    int d;          // the run-time head dim
    T* tiles;
    float* stats;

    __device__ T* q(int stage) const { return tiles + 2 * stage * Tr::StreamTile::kElements; }
    __device__ T* dout(int stage) const { return tiles + (2 * stage + 1) * Tr::StreamTile::kElements; }
    __device__ const float* stats_lse_log2(int stage) const { return stats + 2 * stage * kBlockM; }
    __device__ const float* stats_delta(int stage) const { return stats + (2 * stage + 1) * kBlockM; }

    // Issue the copies of query block (head, m_block)'s Q and dO into `stage`
    // as one group, and load the statistics of row threadIdx.x (threads below
    // kBlockM) into lse_log2 and delta, for store_stats once `stage`'s are free.
    __device__ void issue(int stage, int64_t head, int64_t m_block, float& lse_log2, float& delta) const {
        issue_tiles(stage, head, m_block);
        load_stats(head, m_block, lse_log2, delta);
    }
    // The two halves of issue(), for a kernel that places them apart.
    __device__ void issue_tiles(int stage, int64_t head, int64_t m_block) const {
        const FwdParams& p = params.fwd;
        const int64_t m0 = m_block * kBlockM;
        const int rows = static_cast<int>(min64(kBlockM, p.seqlen_q - m0));
        const HeadSlice<T, float> qo(p, batch, head);
        const GradSlice<T, float> grad(params, batch, head);
        cp_async_tile<Tr::kThreads, typename Tr::StreamTile, kWhole>(q(stage), qo.q, m0, p.q_row_stride, rows, d);
        cp_async_tile<Tr::kThreads, typename Tr::StreamTile, kWhole>(dout(stage), grad.dout, m0,
                                                                     params.dout_row_stride, rows, d);
        cp_async_commit();
    }
    __device__ void load_stats(int64_t head, int64_t m_block, float& lse_log2, float& delta) const {
        const FwdParams& p = params.fwd;
        const HeadSlice<T, float> qo(p, batch, head);
        const GradSlice<T, float> grad(params, batch, head);
        if (threadIdx.x < kBlockM)
            query_stats(lse_log2, delta, qo.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                        m_block * kBlockM + static_cast<int>(threadIdx.x), p.seqlen_q);
    }
    __device__ void store_stats(int stage, float lse_log2, float delta) const {
        stats[2 * stage * kBlockM + threadIdx.x] = lse_log2;
        stats[(2 * stage + 1) * kBlockM + threadIdx.x] = delta;
    }

    // The same by threads 0 .. kCopyThreads - 1 of a group (bwd_wgmma's producer
    // warpgroup, `thread` its index in it; kRolled: cp_async_tile_by's passes a
    // loop): the Q and dO copies of query block (head, m_block) into `stage`,
    // uncommitted, and its rows' statistics, loaded and stored into `stage` by
    // the threads of their rows.
    template <int kCopyThreads, bool kRolled>
    __device__ void copy_tiles_by(int thread, int stage, int64_t head, int64_t m_block) const {
        const FwdParams& p = params.fwd;
        const int64_t m0 = m_block * kBlockM;
        const int rows = static_cast<int>(min64(kBlockM, p.seqlen_q - m0));
        const HeadSlice<T, float> qo(p, batch, head);
        const GradSlice<T, float> grad(params, batch, head);
        cp_async_tile_by<kCopyThreads, typename Tr::StreamTile, kWhole, kRolled>(thread, q(stage), qo.q, m0,
                                                                                p.q_row_stride, rows, d);
        cp_async_tile_by<kCopyThreads, typename Tr::StreamTile, kWhole, kRolled>(thread, dout(stage), grad.dout, m0,
                                                                                params.dout_row_stride, rows, d);
    }
    template <int kCopyThreads>
    __device__ void stage_stats_by(int thread, int stage, int64_t head, int64_t m_block) const {
        static_assert(kBlockM <= kCopyThreads, "one thread per streamed row");
        if (thread >= kBlockM) return;
        const FwdParams& p = params.fwd;
        const HeadSlice<T, float> qo(p, batch, head);
        const GradSlice<T, float> grad(params, batch, head);
        float lse_log2, delta;
        query_stats(lse_log2, delta, qo.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                    m_block * kBlockM + thread, p.seqlen_q);
        stats[2 * stage * kBlockM + thread] = lse_log2;
        stats[(2 * stage + 1) * kBlockM + thread] = delta;
    }
};

// The dQ kernels' streamed key blocks: per stage a K and a V tile
// (Tr::StreamTile, copied by cp.async) at `tiles`; Tr::kBlockStream keys per block.
// kWhole: every key block complete and d the bucket (Lk a multiple of the block).
template <class Tr, typename T, bool kWhole = false>
struct KeyStream {
    const FwdParams& p;
    const T* k_src;  // the head's K and V
    const T* v_src;
    int d;           // the run-time head dim
    T* tiles;

    __device__ T* k(int stage) const { return tiles + 2 * stage * Tr::StreamTile::kElements; }
    __device__ T* v(int stage) const { return tiles + (2 * stage + 1) * Tr::StreamTile::kElements; }

    // Issue the copies of key block n_block's K and V into `stage` (the caller commits).
    __device__ void issue(int stage, int64_t n_block) const {
        const int64_t n0 = n_block * Tr::kBlockStream;
        const int keys = QueryBlock::keys_in(p, n0, Tr::kBlockStream);
        cp_async_tile<Tr::kThreads, typename Tr::StreamTile, kWhole>(k(stage), k_src, n0, p.k_row_stride, keys, d);
        cp_async_tile<Tr::kThreads, typename Tr::StreamTile, kWhole>(v(stage), v_src, n0, p.v_row_stride, keys, d);
    }
};

// dp (dO V^T) -> dS = P o (dP - delta(r, c)).
template <class Tr, typename Acc, class Stat>
__device__ __forceinline__ void score_gradient(Acc (&dp)[Tr::kRows][Tr::kSCols],
                                               const Acc (&p)[Tr::kRows][Tr::kSCols], const Stat& delta) {
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) dp[r][c] = p[r][c] * (dp[r][c] - delta(r, c));
}

// Write factor * g for the warp's rows below rows_valid and columns below
// cols_valid; dst points at the warp's first row.
template <class Tr>
__device__ __forceinline__ void store_gradient(float* dst, int64_t row_stride,
                                               const float (&g)[Tr::kRows][Tr::kGCols], float factor,
                                               int rows_valid, int cols_valid) {
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int row = fragment_row(r);
        if (row >= rows_valid) continue;
#pragma unroll
        for (int c = 0; c < Tr::kGCols; ++c) {
            const int col = fragment_col(c);
            if (col < cols_valid) dst[row * row_stride + col] = g[r][c] * factor;
        }
    }
}

}  // namespace cf
