// bwd_tc_loops.cuh -- the dK/dV and dQ kernels of the tensor-core backward
// families that keep whole tiles in shared memory and multiply warp-level
// fragments into register accumulators: bwd_dmma.cu (DMMA, double tiles) and
// bwd_tf32.cu (TF32 mma.sync, float tiles).  The algorithm, the launch order
// and the determinism are described in those files; only the products and
// the accumulator layout differ, and the traits Tr hand them in:
//   T, Acc, Out        the inputs' type, the tiles' and products' type, and
//                      the type of lse, delta and the gradients
//   kThreads, kWarpRows, kOwnRows, kStreamRows, kOwnTile, kStreamTile,
//   kRows, kSCols, kGCols, kAsync  (shapes; kAsync: cp.async and two stages of
//                      the streamed tiles, else converting loads and one)
//   Fragment           the accumulators' coordinate trait (fragment.cuh)
//   kDvFirst           dK/dV: dV's product issued before dP's (else after)
//   row_products(x, sX, sY, row0)   x = X Y^T: the warp's own rows by every streamed row
//   accumulate(g, x, sZ)            g += X Z: x in row_products' shape, Z streamed
//   store_rows(dst, stride, g, factor, row0, rows_valid, cols_valid)
//   load_tile<kRows, kOwned>(dst, src, stride, rows_valid, d)   by cp.async
//                      (kAsync; the caller commits and waits) or converting
//                      loads; kOwned: an own tile (only ever X of row_products),
//                      else a streamed one
//   tile_landed<kRows, kOwned>(tile)   (kAsync) this thread's copies into tile
//                      have landed: it may rework them in place before the barrier
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "bwd_blocks.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

// The stages of the streamed tiles (Q, dO in dK/dV; K, V in dQ) after the own
// tiles own1, own2 (which land with the first streamed block); load() fills one
// stage with one block (Tr::load_tile's protocol).
template <class Tr>
struct TileStream {
    using Acc = typename Tr::Acc;
    Acc* base;
    Acc* own1;
    Acc* own2;
    __device__ Acc* first(int stage) const { return base + 2 * stage * Tr::kStreamTile; }
    __device__ Acc* second(int stage) const { return first(stage) + Tr::kStreamTile; }
    template <typename T>
    __device__ void load(int stage, const T* src1, int64_t stride1, const T* src2, int64_t stride2, int rows,
                         int d) const {
        Tr::template load_tile<Tr::kStreamRows, false>(first(stage), src1, stride1, rows, d);
        Tr::template load_tile<Tr::kStreamRows, false>(second(stage), src2, stride2, rows, d);
    }
    // Make block `it` of the loop readable in stage(it), and (kAsync) start
    // copying block it + 1 into the other stage: load_next(stage) loads the next
    // block, load_this(stage) this one (one stage, loaded in turn).
    __device__ static int stage(int64_t it) { return Tr::kAsync ? static_cast<int>(it & 1) : 0; }
    template <class LoadNext, class LoadThis>
    __device__ void advance(int64_t it, int64_t count, LoadNext load_next, LoadThis load_this) const {
        if constexpr (Tr::kAsync) {
            cp_async_wait<0>();
            if (it == 0) {
                Tr::template tile_landed<Tr::kOwnRows, true>(own1);
                Tr::template tile_landed<Tr::kOwnRows, true>(own2);
            }
            Tr::template tile_landed<Tr::kStreamRows, false>(first(stage(it)));
            Tr::template tile_landed<Tr::kStreamRows, false>(second(stage(it)));
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

// dK, dV of Tr::kOwnRows keys of one (batch, kv head): the body of a dK/dV kernel.
template <class Tr>
__device__ __forceinline__ void bwd_dkdv_loop(const BwdParams& launch) {
    using T = typename Tr::T;
    using Acc = typename Tr::Acc;
    using Out = typename Tr::Out;
    constexpr int kOwn = Tr::kOwnRows, kStream = Tr::kStreamRows;

    const KeyTileIndex tile(launch.fwd, kOwn, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kOwn)) return;
    }
    const FwdParams& p = params.fwd;
    const WindowMask mask(p);
    const KeyBlock block(p, mask, tile.n_block * kOwn, kOwn);
    const Acc scale_log2 = static_cast<Acc>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first key in the block
    const int64_t first_head = tile.head_kv * p.gqa_ratio;  // the kv head's query group

    Acc* sK = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sV = sK + Tr::kOwnTile;
    const TileStream<Tr> stream{sV + Tr::kOwnTile, sK, sV};  // Q, dO
    const HeadSlice<T, Out> kv(p, tile.batch, first_head);
    Tr::template load_tile<kOwn, true>(sK, kv.k + block.n0 * p.k_row_stride, p.k_row_stride, block.keys, d);
    Tr::template load_tile<kOwn, true>(sV, kv.v + block.n0 * p.v_row_stride, p.v_row_stride, block.keys, d);

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

    Acc dk[Tr::kRows][Tr::kGCols] = {};
    Acc dv[Tr::kRows][Tr::kGCols] = {};
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
        const Acc* sQ = stream.first(stage);
        const Acc* sdO = stream.second(stage);
        const int64_t m0 = m_block * kStream;
        const HeadSlice<T, Out> qo(p, tile.batch, head);
        const GradSlice<T, Out> grad(params, tile.batch, head);

        Acc s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
        Tr::row_products(s, sK, sQ, row0);  // S^T = K Q^T
        Acc lse_log2[Tr::kSCols], delta[Tr::kSCols];
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c)
            load_query_stats(lse_log2[c], delta[c], qo.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                             m0 + fragment_col(c), p.seqlen_q);
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<true>, false>(  // P^T
            s, typename Tr::Fragment{}, mask, p, ScoreTile{tile.batch, head, m0, block.n0, row0, kOwn},
            [&] { return block.needs_mask(p, mask, m0, kStream, kOwn); }, [&](int, int c) { return lse_log2[c]; },
            scale_log2, chain);
        // dV += P^T dO before or after dP^T = V dO^T (Tr::kDvFirst), whichever the
        // family's registers prefer: the same sums either way.
        if constexpr (Tr::kDvFirst) Tr::accumulate(dv, s, sdO);
        Tr::row_products(dp, sV, sdO, row0);
        if constexpr (!Tr::kDvFirst) Tr::accumulate(dv, s, sdO);
        score_gradient<Tr>(dp, s, [&](int, int c) { return delta[c]; });  // dS^T
        gradient_epilogue<Out>(dp, s, chain, typename Tr::Fragment{}, params,
                               ScoreTile{tile.batch, head, m0, block.n0, row0, kOwn});
        Tr::accumulate(dk, dp, sQ);           // dK += dS^T Q
        head = next_head;
        m_block = next_m_block;
    }
    if constexpr (Tr::kAsync) cp_async_wait<0>();  // K and V of a block no query row sees

    const GradSlice<T, Out> kv_grad(params, tile.batch, first_head);
    Tr::store_rows(kv_grad.dk + block.n0 * params.dk_row_stride, params.dk_row_stride, dk,
                   static_cast<Acc>(p.scale), row0, block.keys, d);
    Tr::store_rows(kv_grad.dv + block.n0 * params.dv_row_stride, params.dv_row_stride, dv, Acc(1), row0,
                   block.keys, d);
}

// dQ of Tr::kOwnRows query rows of one (batch, query head): the body of a dQ kernel.
template <class Tr>
__device__ __forceinline__ void bwd_dq_loop(const BwdParams& launch) {
    using T = typename Tr::T;
    using Acc = typename Tr::Acc;
    using Out = typename Tr::Out;
    constexpr int kOwn = Tr::kOwnRows, kStream = Tr::kStreamRows;

    const TileIndex tile(launch.fwd, kOwn, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kOwn)) return;
    }
    const FwdParams& p = params.fwd;
    const HeadSlice<T, Out> head(p, tile.batch, tile.head);
    const GradSlice<T, Out> grad(params, tile.batch, tile.head);
    const WindowMask mask(p);
    const QueryBlock block(p, mask, tile.m_block * kOwn, kOwn);
    const Acc scale_log2 = static_cast<Acc>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first query row in the block

    Acc* sQ = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sdO = sQ + Tr::kOwnTile;
    const TileStream<Tr> stream{sdO + Tr::kOwnTile, sQ, sdO};  // K, V
    Tr::template load_tile<kOwn, true>(sQ, head.q + block.m0 * p.q_row_stride, p.q_row_stride, block.rows, d);
    Tr::template load_tile<kOwn, true>(sdO, grad.dout + block.m0 * params.dout_row_stride, params.dout_row_stride,
                                 block.rows, d);
    Acc lse_log2[Tr::kRows], delta[Tr::kRows];
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
        load_query_stats(lse_log2[r], delta[r], head.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                         block.m0 + row0 + Tr::Fragment::row(r), p.seqlen_q);

    auto load_keys = [&](int stage, int64_t n_block) {
        const int64_t n0 = n_block * kStream;
        stream.load(stage, head.k + n0 * p.k_row_stride, p.k_row_stride, head.v + n0 * p.v_row_stride,
                    p.v_row_stride, QueryBlock::keys_in(p, n0, kStream), d);
    };

    Acc dq[Tr::kRows][Tr::kGCols] = {};
    const int64_t n_begin = block.n_begin(kStream), n_end = block.n_end(kStream);
    if constexpr (Tr::kAsync) {
        if (n_begin < n_end) load_keys(0, n_begin);
        cp_async_commit();  // Q, dO and the first key block
    }
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = stream.stage(n_block - n_begin);
        stream.advance(n_block - n_begin, n_end - n_begin, [&](int st) { load_keys(st, n_block + 1); },
                       [&](int st) { load_keys(st, n_block); });
        const Acc* sK = stream.first(stage);
        const Acc* sV = stream.second(stage);
        const int64_t n0 = n_block * kStream;

        Acc s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
        Tr::row_products(s, sQ, sK, row0);  // S = Q K^T
        // P; rows past Lq need no query bound: their lse_log2 is +inf, so P = 0.
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<false>, true>(
            s, typename Tr::Fragment{}, mask, p, ScoreTile{tile.batch, tile.head, block.m0 + row0, n0, 0, kStream},
            [&] { return block.needs_mask(mask, n0, kStream); }, [&](int r, int) { return lse_log2[r]; },
            scale_log2, chain);
        Tr::row_products(dp, sdO, sV, row0);  // dP = dO V^T
        score_gradient<Tr>(dp, s, [&](int r, int) { return delta[r]; });  // dS
        gradient_epilogue(dp, s, chain);
        Tr::accumulate(dq, dp, sK);           // dQ += dS K
    }
    if constexpr (Tr::kAsync) cp_async_wait<0>();  // Q and dO of a block that sees no key

    Tr::store_rows(grad.dq + block.m0 * params.dq_row_stride, params.dq_row_stride, dq, static_cast<Acc>(p.scale),
                   row0, block.rows, d);
}

}  // namespace cf
