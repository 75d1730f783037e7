// fwd_combine.cu -- the second step of a split-KV forward: merge the splits.
//
// A split-KV launch (FwdParams::num_splits = S > 1) of fwd_simt, fwd_mma or
// fwd_wgmma leaves, for every query row i, S partial results: o_s, the row's
// softmax-weighted mean of the values of the s-th run of its keys, and lse_s,
// the log-sum-exp of its scores over that run (-inf, with o_s = 0, for a run
// it sees no key of).  With M = max_s lse_s and w_s = exp(lse_s - M),
//     lse = M + log(sum_s w_s),   out = sum_s w_s o_s / sum_s w_s,
// which is the attention over all the keys; a row that sees none (M = -inf)
// gets zeros and lse = -inf, as from one launch.
//
// One thread per 16-byte chunk of an output row (4 floats, 2 doubles): it
// reads the row's S lse values (shared by the row's threads, from L1), then
// its chunk of each o_s.  The arithmetic is in the accumulator type; out is
// rounded once, at the end.  With per-sequence lengths (sequence.cuh) the
// rows are those of the launch's seqlen_q (the longest sequence's); a row
// past its own sequence's length has no partial results and is skipped.
#pragma once

#include "params.cuh"
#include "ptx.cuh"
#include "sequence.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

template <typename T, typename Acc>
__global__ void __launch_bounds__(128) fwd_combine_kernel(const FwdParams p) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(Acc));
    const int64_t dv = p.head_dim_v;
    const int64_t chunks = (dv + kVec - 1) / kVec;
    const int64_t rows = p.batch * p.heads_q * p.seqlen_q;  // every split's rows, in this order
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * chunks) return;
    const int64_t row = idx / chunks;
    const int col = static_cast<int>(idx - row * chunks) * kVec;
    const int64_t i = row % p.seqlen_q;
    const int64_t head = (row / p.seqlen_q) % p.heads_q;
    const int64_t batch = row / (p.seqlen_q * p.heads_q);
    // With lengths: the row of its sequence, from the sequence's first row (sequence.cuh;
    // `p` is the launch's params here, so first_row is read from the table)
    if (kSeqLengths && i >= sequence_entry(p, kSeqQLen, batch)) return;
    const int64_t r = kSeqStarts ? sequence_entry(p, kSeqQStart, batch) + i : i;
    const int splits = static_cast<int>(p.num_splits);
    const Acc* part_lse = static_cast<const Acc*>(p.ws_l) + row;
    const Acc* part_o = static_cast<const Acc*>(p.ws_o) + row * dv + col;

    // The largest lse; a NaN one (NaN inputs) sticks, and makes the row NaN.
    Acc m = neg_inf<Acc>();
    for (int s = 0; s < splits; ++s) {
        const Acc x = part_lse[s * rows];
        if (x > m || x != x) m = x;
    }
    Acc total = Acc(0);
    Acc acc[kVec] = {};
    if (m != neg_inf<Acc>()) {
        for (int s = 0; s < splits; ++s) {
            const Acc w = exp_acc(part_lse[s * rows] - m);  // 0 for an empty split
            total += w;
#pragma unroll
            for (int e = 0; e < kVec; ++e)
                if (col + e < dv) acc[e] += w * part_o[s * rows * dv + e];
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] /= total;
    }
    T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride + head * p.out_head_stride +
             r * p.out_row_stride + col;
    store_run(out, acc, static_cast<int>(dv) - col);
    if (p.lse != nullptr && col == 0) {
        Acc* lse = static_cast<Acc*>(p.lse) + batch * p.lse_batch_stride + head * p.lse_head_stride +
                   r * p.lse_row_stride;
        *lse = m == neg_inf<Acc>() ? m : m + log_acc(total);
    }
}

}  // namespace cf
