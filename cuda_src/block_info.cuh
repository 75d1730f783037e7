// block_info.cuh -- from "which CTA am I" to base pointers, valid lengths and
// the range of key blocks worth visiting.
//
// The kernels' main loops never test for tails or masks themselves: a
// QueryBlock says how many of its rows are real and which key blocks hold at
// least one admissible key (the others are skipped, which is where causal and
// local attention save their work), and whether a given key block is only
// partly admissible (then, and only then, the mask is applied element-wise).
// All offsets are 64-bit: batch * stride, head * stride and row * stride each
// can exceed 2^31 elements.
#pragma once

#include "mask.cuh"
#include "paged.cuh"
#include "params.cuh"
#include "sequence.cuh"

namespace cf {

// One (batch, query head) of every tensor; k and v belong to its kv head
// (KeyRows: a pointer, or the sequence's pages of a paged cache, paged.cuh).
template <typename T, typename Acc>
struct HeadSlice {
    const T* q;
    KeyRows<T> k;
    KeyRows<T> v;
    T* out;
    Acc* lse;  // null when the caller did not ask for the log-sum-exp

    __device__ HeadSlice(const FwdParams& p, int64_t batch, int64_t head) {
        // Head counts are < 2^31 (launch_config checks): 32-bit division, no call.
        const int64_t head_kv = static_cast<int>(head) / static_cast<int>(p.gqa_ratio);
        q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
#if CF_PAGED_KV  // the sequence's pages of the caches, through its row of the block table
        k = paged_rows(p, static_cast<const T*>(p.k) + head_kv * p.k_head_stride, batch, p.k_batch_stride);
        v = paged_rows(p, static_cast<const T*>(p.v) + head_kv * p.v_head_stride, batch, p.v_batch_stride);
#else
        k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
        v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;
#endif
        out = static_cast<T*>(p.out) + batch * p.out_batch_stride + head * p.out_head_stride;
        lse = p.lse == nullptr
                  ? nullptr
                  : static_cast<Acc*>(p.lse) + batch * p.lse_batch_stride + head * p.lse_head_stride;
        if constexpr (kSeqStarts) {  // packed sequences: from the sequence's first row and key
            q += p.first_row * p.q_row_stride;
            k += p.first_key * p.k_row_stride;
            v += p.first_key * p.v_row_stride;
            out += p.first_row * p.out_row_stride;
            if (lse != nullptr) lse += p.first_row * p.lse_row_stride;
        }
    }
};

// Query rows [m0, m0 + rows) and the keys they may see: [first_key, last_key]
// (the union over the rows; empty when first_key > last_key).
struct QueryBlock {
    int64_t m0;
    int rows;
    int64_t first_key, last_key;

    __device__ QueryBlock(const FwdParams& p, const WindowMask& mask, int64_t m0_, int block_m)
        : m0(m0_), rows(static_cast<int>(min64(block_m, p.seqlen_q - m0_))) {
        // first_key/last_key grow with the row, so the block's first row gives
        // the first visible key and its last row the last.
        first_key = mask.first_key(m0);
        last_key = mask.last_key(m0 + rows - 1);
    }

    // Key blocks [n_begin, n_end) of width block_n holding at least one key
    // the block may see (empty range when it sees none).
    __device__ int64_t n_begin(int block_n) const { return first_key / block_n; }
    __device__ int64_t n_end(int block_n) const {
        return last_key < first_key ? n_begin(block_n) : last_key / block_n + 1;
    }
    // Whether any row may see any of the keys [n0, n0 + width).
    __device__ bool sees_any(int64_t n0, int width) const {
        return first_key <= last_key && first_key < n0 + width && last_key >= n0;
    }

    // Number of real keys in the key block starting at n0 (the last may be partial).
    __device__ static int keys_in(const FwdParams& p, int64_t n0, int block_n) {
        return static_cast<int>(min64(block_n, p.seqlen_k - n0));
    }

    // True unless every real row of this block may see every key of the
    // block [n0, n0 + block_n) (which must also be complete).
    __device__ bool needs_mask(const WindowMask& mask, int64_t n0, int block_n) const {
        return mask.first_key(m0 + rows - 1) > n0 || mask.last_key(m0) < n0 + block_n - 1;
    }
};

// Split-KV (FwdParams::num_splits > 1): split `split` of a query block takes
// the split-th of num_splits near-equal runs of its key blocks [n_begin,
// n_end), in order (a run may be empty: the split then writes zeros and
// lse = -inf, which fwd_combine gives no weight).  Every query block is cut
// the same way, so a causal grid stays balanced.
template <typename Index>
__device__ __forceinline__ void split_key_blocks(const FwdParams& p, unsigned split, Index& n_begin,
                                                 Index& n_end) {
    if (p.num_splits <= 1) return;
    // The first (blocks % splits) runs take one block more; in Index arithmetic
    // (32-bit in the tensor-core kernels: no 64-bit division in their epilogue).
    const Index splits = static_cast<Index>(p.num_splits), s = static_cast<Index>(split);
    const Index blocks = n_end - n_begin;
    const Index per = blocks / splits, extra = blocks % splits;
    n_begin += s * per + (s < extra ? s : extra);
    n_end = n_begin + per + (s < extra ? 1 : 0);
}

// A split's partial results for one (batch, query head): its normalised
// output rows (head_dim_v elements each, contiguous) and their lse.
template <typename Acc>
struct SplitSlice {
    Acc* o;
    Acc* lse;

    __device__ SplitSlice(const FwdParams& p, int64_t batch, int64_t head, int64_t split) {
        // Rows per (split, batch, head): the launch's seqlen_q (under lengths `p` is a
        // CTA's sequence view, whose seqlen_q is its own).
        const int64_t rows = kSeqLengths ? p.split_rows : p.seqlen_q;
        const int64_t first_row = ((split * p.batch + batch) * p.heads_q + head) * rows;
        o = static_cast<Acc*>(p.ws_o) + first_row * p.head_dim_v;
        lse = static_cast<Acc*>(p.ws_l) + first_row;
    }
};

// The forward grids are one-dimensional: tile = (num_m_blocks - 1 - m_block)
//     + num_m_blocks * (head + heads_q * slot),
// so consecutive CTAs share a (batch, head) and hence its K/V in L2; slot s
// runs batch entry slot_batch(s) (s itself without lengths).  The grid has
// fewer than 2^31 CTAs (launch_config checks), so 32-bit division.
struct TileIndex {
    int64_t batch, head, m_block;

    __device__ TileIndex(const FwdParams& p, int block_m, unsigned tile) {
        const unsigned num_m_blocks = static_cast<unsigned>((p.seqlen_q + block_m - 1) / block_m);
        const unsigned heads = static_cast<unsigned>(p.heads_q);
        // Last query block first: under a bottom-right causal mask it has the
        // most keys, so the longest CTAs of each head start earliest and the
        // short ones fill the tail of the grid.  Heads stay contiguous, so the
        // CTAs resident together share one head's K and V in L2.
        m_block = num_m_blocks - 1 - tile % num_m_blocks;
        const unsigned bh = tile / num_m_blocks;
        head = bh % heads;
        batch = slot_batch(p, bh / heads);
    }

    // Whether the block lies wholly past its sequence's query rows (`seq`: the
    // CTA's sequence_params), under CF_SEQ_LENGTHS: the CTA then returns.  Called
    // behind `if constexpr (kSeqLengths)`: without lengths the kernels compile as before.
    __device__ __forceinline__ bool past_end(const FwdParams& seq, int block_m) const {
        return m_block * block_m >= seq.seqlen_q;
    }
};

}  // namespace cf
