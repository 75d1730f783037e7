// fwd_tiles.cuh -- the K/V schedule of the CUDA-core and DMMA forward kernels
// (fwd_simt, fwd_dmma): Q once, then each key block's K and V through shared
// memory, as tiles of the accumulator type.
//
// The traits a kernel hands in (Tr) name its tile shapes (kBlockM, kBlockN,
// kHeadDim, kHeadDimV, kThreads), its shared-memory carve-up (kSmemQ, kSmemK,
// kSmemV), its layouts (QLayout, KLayout, v_layout()) and whether the
// element type is the accumulator type (kAsync: cp.async straight into
// shared memory) or needs converting on the way in.  With kAsync, a kernel may
// hand in its own Mover (fwd_tf32.cu), which copies the tiles and reworks its
// own copies in place once they have landed (before the barrier that shows
// them to the other threads).
#pragma once

#include "block_info.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "tile_io.cuh"

namespace cf {

// The default Mover: rows by cp_async_tile_rows into the traits' layouts,
// used as they land.
template <class Tr>
struct RowTileMover {
    using Acc = typename Tr::Acc;
    __device__ static void q(Acc* dst, const Acc* src, int64_t row_stride, int rows_valid, int cols_valid) {
        cp_async_tile_rows<Tr::kThreads, Tr::kBlockM, Tr::kHeadDim>(dst, typename Tr::QLayout{}, src, row_stride,
                                                                     rows_valid, cols_valid);
    }
    template <class Src>  // K and V: a pointer, or a paged cache's pages (paged.cuh)
    __device__ static void k(Acc* dst, const Src& src, int64_t row_stride, int rows_valid, int cols_valid) {
        cp_async_tile_rows<Tr::kThreads, Tr::kBlockN, Tr::kHeadDim>(dst, typename Tr::KLayout{}, src, row_stride,
                                                                     rows_valid, cols_valid);
    }
    template <class Src>
    __device__ static void v(Acc* dst, const Src& src, int64_t row_stride, int rows_valid, int cols_valid) {
        cp_async_tile_rows<Tr::kThreads, Tr::kBlockN, Tr::kHeadDimV>(dst, Tr::v_layout(), src, row_stride,
                                                                      rows_valid, cols_valid);
    }
    __device__ static void q_landed(Acc*) {}
    __device__ static void k_landed(Acc*) {}
    __device__ static void v_landed(Acc*) {}
};

// Moves the Q tile and each key block's K and V into shared memory.  The
// loop calls keys(n), then values(n), then done(); each returns once its tile
// is visible to every thread.
//   kAsync (float, double): K and V have their own buffers.  keys(n) waits for
//   K(n), then starts V(n); values(n) waits for V(n), then starts K(n + 1).
//   Every thread has at most one cp.async group in flight, so each wait is
//   wait_group 0, and the __syncthreads after it also tells everyone that the
//   buffer about to be refilled has been read (V by the previous block's
//   O += P V, K by this block's S = Q K^T).
//   otherwise: one buffer, converting loads between barriers.
template <class Tr, typename T, class Mover = RowTileMover<Tr>>
struct SimtTiles {
    using Acc = typename Tr::Acc;
    const FwdParams& params;
    const HeadSlice<T, Acc>& head;
    Acc* sQ;
    Acc* sK;
    Acc* sV;
    Acc* sP;  // the current block's probabilities (mma_pv)
    int64_t n_begin, n_end;

    __device__ SimtTiles(const FwdParams& p, const HeadSlice<T, Acc>& h, const QueryBlock& block,
                         int64_t n_begin_, int64_t n_end_)
        : params(p), head(h), sQ(reinterpret_cast<Acc*>(dynamic_smem())), sK(sQ + Tr::kSmemQ),
          sV(Tr::kAsync ? sK + Tr::kSmemK : sK), sP(sK + Tr::kSmemK + Tr::kSmemV), n_begin(n_begin_),
          n_end(n_end_) {
        const int d = static_cast<int>(p.head_dim);
        if constexpr (Tr::kAsync) {
            Mover::q(sQ, head.q + block.m0 * p.q_row_stride, p.q_row_stride, block.rows, d);
            if (n_begin < n_end) issue_keys(n_begin);
            cp_async_commit();
        } else {
            load_tile<Tr::kThreads>(sQ, typename Tr::QLayout{}, head.q + block.m0 * p.q_row_stride,
                                    p.q_row_stride, Tr::kBlockM, Tr::kHeadDim, block.rows, d);
        }
    }

    __device__ int keys_in(int64_t n_block) const {
        return QueryBlock::keys_in(params, n_block * Tr::kBlockN, Tr::kBlockN);
    }
    __device__ void issue_keys(int64_t n_block) const {
        const int64_t n0 = n_block * Tr::kBlockN;
        Mover::k(sK, at_key(head.k, n0, params.k_row_stride), params.k_row_stride, keys_in(n_block),
                 static_cast<int>(params.head_dim));
    }
    __device__ void issue_values(int64_t n_block) const {
        const int64_t n0 = n_block * Tr::kBlockN;
        Mover::v(sV, at_key(head.v, n0, params.v_row_stride), params.v_row_stride, keys_in(n_block),
                 static_cast<int>(params.head_dim_v));
    }

    __device__ void keys(int64_t n_block) const {
        if constexpr (Tr::kAsync) {
            cp_async_wait<0>();
            if (n_block == n_begin) Mover::q_landed(sQ);  // Q came with the first K
            Mover::k_landed(sK);
            __syncthreads();
            issue_values(n_block);
            cp_async_commit();
        } else {
            const int64_t n0 = n_block * Tr::kBlockN;
            load_tile<Tr::kThreads>(sK, typename Tr::KLayout{}, at_key(head.k, n0, params.k_row_stride),
                                    params.k_row_stride, Tr::kBlockN, Tr::kHeadDim,
                                    keys_in(n_block), static_cast<int>(params.head_dim));
            __syncthreads();
        }
    }
    __device__ void values(int64_t n_block) const {
        if constexpr (Tr::kAsync) {
            cp_async_wait<0>();
            Mover::v_landed(sV);
            __syncthreads();
            if (n_block + 1 < n_end) {
                issue_keys(n_block + 1);
                cp_async_commit();
            }
        } else {
            __syncthreads();  // K fully read: its buffer takes V
            const int64_t n0 = n_block * Tr::kBlockN;
            load_tile<Tr::kThreads>(sV, Tr::v_layout(), at_key(head.v, n0, params.v_row_stride),
                                    params.v_row_stride, Tr::kBlockN, Tr::kHeadDimV,
                                    keys_in(n_block), static_cast<int>(params.head_dim_v));
            __syncthreads();
        }
    }
    __device__ void done() const {
        if constexpr (!Tr::kAsync) __syncthreads();  // V fully read: the buffer takes the next K
    }
    // Retire the Q copy of a block that saw no key block (nothing else is in flight).
    __device__ void finish() const {
        if constexpr (Tr::kAsync) cp_async_wait<0>();
    }
};

}  // namespace cf
