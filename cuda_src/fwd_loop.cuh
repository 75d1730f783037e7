// fwd_loop.cuh -- the forward kernels that keep whole tiles of the accumulator
// type in shared memory (fwd_tiles.cuh's schedule) and differ only in how
// the two products are computed: fwd_simt.cu (CUDA cores), fwd_dmma.cu
// (DMMA, float64) and fwd_tf32.cu (TF32 mma.sync).  A CTA owns kBlockM query
// rows of one (batch, head) and walks the key blocks its rows see (a split's
// run of them under split-KV); per block
//     S = Q K^T, the score epilogue (score.cuh), the online softmax, O += P V,
// then O / l and lse for the call's output or the split's partial results.
//
// The hooks Tr hands in (a kernel's traits plus):
//   Thread                    this thread's place in the CTA (constructed once)
//   first_row(me)             its first query row in the block
//   fragment(me)              its accumulators' coordinate trait (fragment.cuh)
//   kUnits                    how scores(...) leaves them (score.cuh's Units)
//   Mover, Rule, Softmax      fwd_tiles.cuh's tile mover, the mask's Rule and the
//                             online softmax (OnlineSoftmax<Acc, kStatRows, lanes>)
//   Scores, Output, kStatRows the score and output accumulator arrays, and the
//                             query rows a thread holds statistics for
//   scores(s, tiles, me, d, scale_log2)   s = Q K^T, times scale_log2 where the
//                             softmax expects scaled scores (score.cuh's table)
//   update(softmax, s, o, scale_log2)     the online softmax step
//   accumulate(o, s, tiles, me)           o += P V
//   store(o, lse, out, out_row_stride, lse_out, lse_row_stride, block, me, params)
#pragma once

#include "block_info.cuh"
#include "fwd_tiles.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

// The whole forward of one CTA: T the inputs' type; lse and a split's partial
// results are of the call's accumulator type acc_t<T>.
template <class Tr, typename T>
__device__ __forceinline__ void fwd_tile_loop(const FwdParams& launch) {
    using Acc = typename Tr::Acc;  // the tiles' and products' type
    using Out = acc_t<T>;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;

    const TileIndex tile(launch, kBlockM, blockIdx.x);
    const FwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params, kBlockM)) return;
    }
    const HeadSlice<T, Acc> head(params, tile.batch, tile.head);  // q, k, v for the tiles
    const HeadSlice<T, Out> io(params, tile.batch, tile.head);    // out, lse (under lengths: after the loop)
    const WindowMask mask(params);
    const QueryBlock block(params, mask, tile.m_block * kBlockM, kBlockM);
    const typename Tr::Thread me;
    const Acc scale_log2 = static_cast<Acc>(params.scale_log2);
    const int d = static_cast<int>(params.head_dim);

    int64_t n_begin = block.n_begin(kBlockN), n_end = block.n_end(kBlockN);
    split_key_blocks(params, blockIdx.y, n_begin, n_end);
    const SimtTiles<Tr, T, typename Tr::Mover> tiles(params, head, block, n_begin, n_end);

    typename Tr::Softmax softmax;
    typename Tr::Output o = {};
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int64_t n0 = n_block * kBlockN;
        typename Tr::Scores s;
        tiles.keys(n_block);
        Tr::scores(s, tiles, me, d, scale_log2);
        score_epilogue<typename Tr::Rule, true, Tr::kUnits>(
            s, Tr::fragment(me), mask, params,
            ScoreTile{tile.batch, tile.head, block.m0 + Tr::first_row(me), n0, 0, kBlockN},
            block.needs_mask(mask, n0, kBlockN));
        Tr::update(softmax, s, o, scale_log2);
        tiles.values(n_block);
        Tr::accumulate(o, s, tiles, me);
        tiles.done();
    }
    tiles.finish();

    Acc lse[Tr::kStatRows];
    softmax.normalize(o, lse);
    if (params.num_splits > 1) {
        const SplitSlice<Out> part(params, tile.batch, tile.head, blockIdx.y);
        Tr::store(o, lse, part.o, params.head_dim_v, part.lse, 1, block, me, params);
    } else if constexpr (kSeqLengths) {
        // Held across the loop, the sequence's out and lse pointers spilled fwd_simt's
        // float32 d = 32 on sm_80 (16 B); built here, none.  (Moved for every kernel,
        // it changed 40 of the 298 forward rows' code, main loops up to 18% longer.)
        const HeadSlice<T, Out> late(params, tile.batch, tile.head);
        Tr::store(o, lse, late.out, params.out_row_stride, late.lse, params.lse_row_stride, block, me, params);
    } else {
        Tr::store(o, lse, io.out, params.out_row_stride, io.lse, params.lse_row_stride, block, me, params);
    }
}

// The Thread of the warp-tile kernels (fwd_dmma, fwd_tf32): kWarpRows query
// rows per warp, the warp's first at row0 of the block.
template <int kWarpRows>
struct WarpRows {
    int row0 = warp_id() * kWarpRows;
};

}  // namespace cf
