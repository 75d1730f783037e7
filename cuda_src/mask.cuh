// mask.cuh -- which keys a query row may attend to.
//
// One rule covers full, causal and local attention (causal is the window with
// right = 0; "no limit" is kUnbounded): with the window aligned to the
// bottom-right corner, query row i sees key j iff
//     i + (Lk - Lq) - left <= j <= i + (Lk - Lq) + right   and   0 <= j < Lk.
// For each row the admissible keys are therefore one contiguous range
// [first_key(i), last_key(i)], empty when first > last; both ends grow with i,
// which is what lets block_info.cuh skip whole blocks.  score.cuh applies the
// rule to the scores.
#pragma once

#include "params.cuh"

namespace cf {

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

struct WindowMask {
    int64_t diagonal;  // Lk - Lq: the key aligned with query row i is i + diagonal
    int64_t left, right, seqlen_k;

    __device__ explicit WindowMask(const FwdParams& p)
        : diagonal(p.seqlen_k - p.seqlen_q),
          left(p.window_left),
          right(p.window_right),
          seqlen_k(p.seqlen_k) {}

    // First and last key query row i may see (first > last: none).
    __device__ int64_t first_key(int64_t i) const { return max64(0, i + diagonal - left); }
    __device__ int64_t last_key(int64_t i) const { return min64(seqlen_k - 1, i + diagonal + right); }
};

}  // namespace cf
