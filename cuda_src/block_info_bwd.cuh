// block_info_bwd.cuh -- the backward's view of "which CTA am I": base
// pointers of dout and the gradients, and, for the kernels that own a block
// of keys (dK, dV), which query blocks can see it.
//
// The kernels that own query rows (the dQ pass, the preprocess) use the
// forward's TileIndex / HeadSlice / QueryBlock on params.fwd unchanged.  A
// key block is the mirror image of a query block: the query rows that see a
// key form one contiguous range whose ends grow with the key (mask.cuh), so
// the rows seeing any key of [n0, n0 + keys) are [first_row, last_row] and
// every query block outside it is skipped.  All offsets are 64-bit.  Last,
// the query rows' statistics every backward kernel reads (lse, delta).
#pragma once

#include "block_info.cuh"
#include "mask.cuh"
#include "params_bwd.cuh"
#include "softmax.cuh"

namespace cf {

// One (batch, query head) of dout, dq and delta; dk and dv of its kv head.
template <typename T, typename Acc>
struct GradSlice {
    const T* dout;
    Acc* dq;
    Acc* dk;
    Acc* dv;
    Acc* delta;

    __device__ GradSlice(const BwdParams& p, int64_t batch, int64_t head) {
        // Head counts are < 2^31 (the launch configuration checks): 32-bit division.
        const int64_t head_kv = static_cast<int>(head) / static_cast<int>(p.fwd.gqa_ratio);
        dout = static_cast<const T*>(p.dout) + batch * p.dout_batch_stride + head * p.dout_head_stride;
        dq = static_cast<Acc*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
        dk = static_cast<Acc*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride;
        dv = static_cast<Acc*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride;
        delta = static_cast<Acc*>(p.delta) + batch * p.delta_batch_stride + head * p.delta_head_stride;
        if constexpr (kSeqStarts) {  // packed sequences: from the sequence's first row and key
            const FwdParams& f = p.fwd;
            dout += f.first_row * p.dout_row_stride;
            dq += f.first_row * p.dq_row_stride;
            delta += f.first_row * p.delta_row_stride;
            dk += f.first_key * p.dk_row_stride;
            dv += f.first_key * p.dv_row_stride;
        }
    }
};

// The dK/dV kernels' one-dimensional grid: tile = n_block + num_n_blocks *
// (head_kv + heads_kv * slot), consecutive CTAs sharing a kv head; slot s
// runs batch entry slot_batch(s) (sequence.cuh).
struct KeyTileIndex {
    int64_t batch, head_kv, n_block;

    __device__ KeyTileIndex(const FwdParams& p, int block_n, unsigned tile) {
        const unsigned num_n_blocks = static_cast<unsigned>((p.seqlen_k + block_n - 1) / block_n);
        const unsigned heads_kv = static_cast<unsigned>(p.heads_q / p.gqa_ratio);
        n_block = tile % num_n_blocks;
        const unsigned bh = tile / num_n_blocks;
        head_kv = bh % heads_kv;
        batch = slot_batch(p, bh / heads_kv);
    }

    // Whether the block lies wholly past its sequence's keys (`seq`: the CTA's
    // sequence_params), under CF_SEQ_LENGTHS: the CTA then returns.  Called
    // behind `if constexpr (kSeqLengths)`: without lengths the kernels compile as before.
    __device__ __forceinline__ bool past_end(const FwdParams& seq, int block_n) const {
        return n_block * block_n >= seq.seqlen_k;
    }
};

// Keys [n0, n0 + keys) and the query rows that see at least one of them:
// [first_row, last_row] (empty when first_row > last_row).
struct KeyBlock {
    int64_t n0;
    int keys;
    int64_t first_row, last_row;

    __device__ KeyBlock(const FwdParams& p, const WindowMask& mask, int64_t n0_, int block_n)
        : n0(n0_), keys(static_cast<int>(min64(block_n, p.seqlen_k - n0_))) {
        // Row i sees key j iff j - diagonal - right <= i <= j - diagonal + left
        // (and 0 <= i < Lq); with kUnbounded bounds neither side overflows.
        first_row = max64(0, n0 - mask.diagonal - mask.right);
        last_row = min64(p.seqlen_q - 1, n0 + keys - 1 - mask.diagonal + mask.left);
    }

    // Query blocks [m_begin, m_end) of height block_m holding a row that sees a key here.
    __device__ int64_t m_begin(int block_m) const { return first_row / block_m; }
    __device__ int64_t m_end(int block_m) const {
        return last_row < first_row ? m_begin(block_m) : last_row / block_m + 1;
    }

    // True unless the query block [m0, m0 + block_m), whole, sees every key of
    // this block, which must be whole too.
    __device__ bool needs_mask(const FwdParams& p, const WindowMask& mask, int64_t m0, int block_m,
                               int block_n) const {
        return m0 + block_m > p.seqlen_q || keys < block_n ||
               mask.first_key(m0 + block_m - 1) > n0 || mask.last_key(m0) < n0 + block_n - 1;
    }
};

// Statistics of query row i: lse in base 2, and delta.  A row that sees no
// key (lse = -inf) and a row past Lq get lse_log2 = +inf: their
// probabilities exp2(s - inf) are 0, never inf or NaN.
// Stored: the type lse and delta are kept in (the call's accumulator type),
// Acc the one they are used in (double in bwd_dmma's float32 kernels).
template <typename Acc, typename Stored>
__device__ __forceinline__ void load_query_stats(Acc& lse_log2, Acc& delta, const Stored* lse,
                                                 int64_t lse_row_stride, const Stored* delta_in,
                                                 int64_t delta_row_stride, int64_t i,
                                                 int64_t seqlen_q) {
    constexpr double kLog2e = 1.44269504088896340736;
    lse_log2 = -neg_inf<Acc>();
    delta = Acc(0);
    if (i < seqlen_q) {
        const Acc l = static_cast<Acc>(lse[i * lse_row_stride]);
        if (l != neg_inf<Acc>()) lse_log2 = l * Acc(kLog2e);
        delta = static_cast<Acc>(delta_in[i * delta_row_stride]);
    }
}

}  // namespace cf
