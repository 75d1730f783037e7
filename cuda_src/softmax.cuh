// softmax.cuh -- online softmax in base 2: the running row max m, the running
// row sum l, the rescale of the output accumulator, the final normalisation.
//
// Scores arrive already multiplied by scale * log2(e), so every exponential
// is exp2 and lse = ln(2) * (m + log2(l)).  Multiplying the raw score first
// (instead of FA2's fused exp2(s * c - m * c)) keeps the row max correct for
// any sign of the scale.  A row that has seen no admissible key has
// m = -inf; it is exponentiated against 0 instead of -inf, so its
// probabilities and rescale factors are exp2(-inf) = 0 rather than NaN, and
// it ends with output 0 and lse = -inf.
#pragma once

#include "ptx.cuh"

namespace cf {

// Accumulator type: float for the 16-bit types and float, double for double.
template <typename T> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<double> { using type = double; };
template <typename T> using acc_t = typename AccumulatorOf<T>::type;

// -infinity, spelled as its IEEE bit pattern (NVRTC has no <limits> or INFINITY;
// NVRTC 12.0 has no __builtin_bit_cast either, the CUDA intrinsics work everywhere).
template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() {
    return __int_as_float(static_cast<int>(0xff800000u));
}
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ull));
}

// 2^x: ex2.approx (2 ulp) in float, the correctly rounded-ish libm exp2 in double.
__device__ __forceinline__ float exp2_acc(float x) { return exp2_approx(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

// float: one FMNMX instead of a compare and a select.  double keeps the
// compare-and-select: fmax's NaN handling made fwd_v1<double> spill on sm_80.
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return a > b ? a : b; }

// The reference point a row is exponentiated against: its max, or 0 while
// the max is -inf (so that -inf - (-inf) never happens).
template <typename Acc> __device__ __forceinline__ Acc exp2_reference(Acc m) {
    return m == neg_inf<Acc>() ? Acc(0) : m;
}

// Max / sum over the kLanes consecutive lanes (an aligned group) that share a row.
template <int kLanes> constexpr bool is_lane_group() {
    return kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0;
}
template <int kLanes, typename Acc> __device__ __forceinline__ Acc group_max(Acc x) {
    static_assert(is_lane_group<kLanes>(), "kLanes: a power of two <= 32");
#pragma unroll
    for (int mask = kLanes / 2; mask > 0; mask /= 2) x = max_acc(x, shfl_xor(x, mask));
    return x;
}
template <int kLanes, typename Acc> __device__ __forceinline__ Acc group_sum(Acc x) {
    static_assert(is_lane_group<kLanes>(), "kLanes: a power of two <= 32");
#pragma unroll
    for (int mask = kLanes / 2; mask > 0; mask /= 2) x += shfl_xor(x, mask);
    return x;
}

// x *= factor for a scalar or (recursively) every element of an array.
template <typename Acc> __device__ __forceinline__ void scale_in_place(Acc& x, Acc factor) {
    x *= factor;
}
template <typename Acc, typename E, int N>
__device__ __forceinline__ void scale_in_place(E (&x)[N], Acc factor) {
#pragma unroll
    for (int i = 0; i < N; ++i) scale_in_place(x[i], factor);
}

// ln(2) * (m + log2(l)): the natural-log log-sum-exp of a row, -inf if it saw no
// key.  Tested as l == 0, not l > 0, so that a NaN sum (NaN in q or k) gives NaN.
template <typename Acc> __device__ __forceinline__ Acc row_lse(Acc m, Acc l) {
    constexpr double kLn2 = 0.69314718055994530942;
    return l == Acc(0) ? neg_inf<Acc>() : Acc(kLn2) * (m + log2_acc(l));
}

// State of kRows query rows, each spread over kLanes lanes of one warp (every
// lane holds some of the row's columns).  m is kept identical on those lanes;
// l is each lane's partial sum over its own columns, summed across the lanes
// only once, in normalize().  update() (the SIMT kernels) adds each block's
// sum to l with Kahan compensation (c: the low-order part l has lost), so
// that a float32 row over millions of keys -- one addition per key block --
// keeps the accuracy of a pairwise sum instead of growing its error with
// the block count (seen on an H200: 2^19 blocks, lse off by 5.5e-4).
template <typename Acc, int kRows, int kLanes>
struct OnlineSoftmax {
    Acc m[kRows];
    Acc l[kRows];
    Acc c[kRows];

    __device__ OnlineSoftmax() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            m[r] = neg_inf<Acc>();
            l[r] = Acc(0);
            c[r] = Acc(0);
        }
    }

    // s: this lane's scores of one key block (log2 units, -inf where masked).
    // Afterwards s holds the unnormalised probabilities exp2(s - m_new), the
    // accumulator o (any array per row) is rescaled by exp2(m_old - m_new),
    // and l is updated.
    template <int kCols, typename RowAcc>
    __device__ void update(Acc (&s)[kRows][kCols], RowAcc (&o)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const Acc m_new = max_acc(m[r], row_max<kCols>(s[r]));
            const Acc ref = exp2_reference(m_new);
            const Acc rescale = exp2_acc(m[r] - ref);
            m[r] = m_new;
            Acc sum = Acc(0);
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                s[r][j] = exp2_acc(s[r][j] - ref);
                sum += s[r][j];
            }
            // Kahan: l + (-c) is the running sum; both rescale exactly alike
            const Acc lr = l[r] * rescale;
            const Acc y = sum - c[r] * rescale;
            const Acc t = lr + y;
            c[r] = (t - lr) - y;
            l[r] = t;
            scale_in_place(o[r], rescale);
        }
    }

    // update() for raw scores q.k (-inf where masked) and a scale_log2 > 0:
    // the row max of the scaled scores is the scaled max of the raw ones
    // (multiplying by a positive number is monotone, rounding too), and the
    // scale and the shift fold into one FFMA per score.  fwd_mma's path; the
    // dispatcher sends other scales to fwd_simt (cupyflash/_gpu.py).
    //
    // kLazyRescale: the reference point m of a row moves only when the row's
    // maximum passes it by more than kRescaleSlack (log2 units); until then
    // the probabilities exp2(s - m) stay below 2^kRescaleSlack (far inside
    // the range of float and of the 16-bit types P is rounded to) and o and
    // l need no rescale.  The decision is one vote per warp, so the rescale
    // of the whole accumulator is skipped, not multiplied by 1, on every
    // block where no row of the warp moves -- after the first blocks, nearly
    // all.  Exact either way: o and l share the reference point, and lse
    // uses it.  Needs every lane of the warp (fwd_mma's warps are whole).
    // Otherwise m is the running maximum and o and l are rescaled every block.
    static constexpr float kRescaleSlack = 8.0f;

    template <bool kLazyRescale, int kCols, typename RowAcc>
    __device__ void update_unscaled(Acc (&s)[kRows][kCols], RowAcc (&o)[kRows], Acc scale_log2) {
        if constexpr (kLazyRescale) {
            // The row maxima are taken again when the warp moves (rarely)
            // rather than kept in registers across the vote.
            bool moves = false;
#pragma unroll
            for (int r = 0; r < kRows; ++r)  // a first finite max passes -inf
                moves |= row_max<kCols>(s[r]) * scale_log2 > m[r] + Acc(kRescaleSlack);
            if (__any_sync(0xffffffffu, moves)) {
#pragma unroll
                for (int r = 0; r < kRows; ++r) move_reference(r, row_max<kCols>(s[r]) * scale_log2, o);
            }
        } else {
#pragma unroll
            for (int r = 0; r < kRows; ++r) move_reference(r, row_max<kCols>(s[r]) * scale_log2, o);
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const Acc ref = exp2_reference(m[r]);
            Acc sum = Acc(0);
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                s[r][c] = exp2_acc(fma(s[r][c], scale_log2, -ref));
                sum += s[r][c];
            }
            l[r] += sum;
        }
    }

    // m[r] = max(m[r], block_max), with o[r] and l[r] rescaled to the new reference.
    template <typename RowAcc>
    __device__ void move_reference(int r, Acc block_max, RowAcc (&o)[kRows]) {
        const Acc m_new = max_acc(m[r], block_max);
        const Acc rescale = exp2_acc(m[r] - exp2_reference(m_new));
        m[r] = m_new;
        l[r] *= rescale;
        scale_in_place(o[r], rescale);
    }

    // The maximum of a row's scores over the kLanes lanes holding it.
    template <int kCols>
    __device__ static Acc row_max(const Acc (&s)[kCols]) {
        Acc block_max = s[0];
#pragma unroll
        for (int c = 1; c < kCols; ++c) block_max = max_acc(block_max, s[c]);
        return group_max<kLanes>(block_max);
    }

    // Deferred normalisation: o /= l (0 for a row that saw no key) and the
    // rows' natural-log lse.
    template <typename RowAcc>
    __device__ void normalize(RowAcc (&o)[kRows], Acc (&lse)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const Acc total = group_sum<kLanes>(l[r] - c[r]);
            scale_in_place(o[r], total == Acc(0) ? Acc(0) : Acc(1) / total);
            lse[r] = row_lse(m[r], total);
        }
    }
};

}  // namespace cf
