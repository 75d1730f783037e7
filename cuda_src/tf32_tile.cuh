// tf32_tile.cuh -- shared-memory layouts and warp-level products of the TF32
// tensor-core kernels (fwd_tf32.cu, bwd_tf32.cu): mma.sync m16n8k8 .tf32 with
// float32 accumulation, on float tiles.
//
// Precision.  kPasses = 1 rounds every operand to TF32 (cvt.rna: 10 explicit
// mantissa bits) and multiplies once.  kPasses = 3 splits every operand x into
// big = tf32(x) and small = tf32(x - big), which together hold 22 of its 24
// significant bits, and sums big_a big_b + big_a small_b + small_a big_b (the
// small x small term, below 2^-22 |a b|, is dropped): three MMAs per product,
// errors of the order of float32 arithmetic's.
//
// Index permutations.  There is no ldmatrix for 32-bit elements, so the
// fragments come from 16-byte shared loads and from the accumulators in
// place, by choosing the order of the sums: an MMA sums over k, so any
// permutation of k applied to both A and B leaves the product unchanged, and
// a permutation of n only moves the output columns (ptx-fragments.md section
// 2: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); b0 (t, g),
// b1 (t+4, g); C (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)).
//   X Y^T, k over tile columns (tf32_abt): in columns 16 j .. 16 j + 15, k8
//       step 2j + h reads column 16 j + 4t + 2h as k index t and the next one
//       as t + 4.  Lane (g, t) loads X[row g (+ 8)][16 j + 4t .. + 3] and
//       Y[row g][16 j + 4t .. + 3] once for both steps ("row" reads).
//   P Z, k over P's columns = Z's rows (tf32_accumulate): k8 step kk reads
//       Z row 8 kk + 2t as k index t and 8 kk + 2t + 1 as t + 4 -- the columns
//       lane (g, t) holds of P's n8 tile kk, so P's A fragment is four of the
//       lane's own accumulators: no shuffle, no shared memory.
//   n over Z's columns: n8 tile 4 J + i takes column 32 J + 4 g + i as its n
//       index g, so one 16-byte load of Z[row][32 J + 4g ..] serves four n8
//       tiles ("column" reads); the lane's accumulators of those tiles then
//       hold columns 32 J + 4 (2t + e) + i, four consecutive ones per (J, e)
//       (store_run_tf32).
// A quarter-warp's 16-byte loads (lanes 8q .. 8q + 7) must fall in 8
// different bank groups (16-byte chunk index mod 8).  Row reads: rows 2q,
// 2q + 1 (mod 8), chunks 4j + t; column reads: rows 8 kk + 2t + e, chunks
// 8 J + 2q, 8 J + 2q + 1.  The layouts XOR a row's chunk index with
//   Tf32Rows       4 (r % 2)                       row reads
//   Tf32VRows      2 ((r / 2) % 4)                 column reads
//   Tf32BothRows   (r & 6) ^ 4 (r % 2)             both: bit 2 differs between
//                  rows 2q and 2q + 1 (row reads), bits 1-2 take four values
//                  over rows 2t + e, t = 0..3 (column reads).
#pragma once

#include "ptx.cuh"
#include "tile_io.cuh"

namespace cf {

// ---- shared-memory layouts (rows of kCols floats, 16-byte chunks permuted) --------------------

template <int kCols>
struct Tf32Rows {
    static_assert(kCols % 32 == 0, "Tf32Rows: rows of whole 128-byte lines");
    __device__ static int offset(int r, int c) { return r * kCols + ((((c >> 2) ^ ((r & 1) << 2))) << 2) + (c & 3); }
};

template <int kCols>
struct Tf32VRows {
    static_assert(kCols % 32 == 0, "Tf32VRows: rows of whole 128-byte lines");
    __device__ static int offset(int r, int c) {
        return r * kCols + ((((c >> 2) ^ (((r >> 1) & 3) << 1))) << 2) + (c & 3);
    }
};

template <int kCols>
struct Tf32BothRows {
    static_assert(kCols % 32 == 0, "Tf32BothRows: rows of whole 128-byte lines");
    __device__ static int offset(int r, int c) {
        return r * kCols + ((((c >> 2) ^ ((r & 6) ^ ((r & 1) << 2)))) << 2) + (c & 3);
    }
};

// ---- operands and MMAs ----------------------------------------------------------------------------

// One float32 operand as TF32: big = tf32(x) and, with three passes, small = tf32(x - big).
template <int kPasses>
struct Tf32Operand {
    uint32_t big, small;
    Tf32Operand() = default;
    __device__ explicit Tf32Operand(float x) : big(to_tf32(x)), small(0u) {
        if constexpr (kPasses == 3) small = to_tf32(x - __uint_as_float(big));
    }
};

// d += A B over one k8 step in kPasses MMAs, the small terms first.
template <int kPasses>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const Tf32Operand<kPasses> (&a)[4],
                                         const Tf32Operand<kPasses> (&b)[2]) {
    static_assert(kPasses == 1 || kPasses == 3, "kPasses: 1 (tf32) or 3 (tf32x3)");
    const uint32_t a_big[4] = {a[0].big, a[1].big, a[2].big, a[3].big};
    const uint32_t b_big[2] = {b[0].big, b[1].big};
    if constexpr (kPasses == 3) {
        const uint32_t a_small[4] = {a[0].small, a[1].small, a[2].small, a[3].small};
        const uint32_t b_small[2] = {b[0].small, b[1].small};
        mma_m16n8k8_tf32(d, a_small, b_big, d);
        mma_m16n8k8_tf32(d, a_big, b_small, d);
    }
    mma_m16n8k8_tf32(d, a_big, b_big, d);
}

// Accumulator tile (m16 tile mi, n8 tile nj) += A B; acc[2 mi + h][2 nj + e] is
// the lane's element (g + 8h, 2t + e) of the tile, as in mma_tile.cuh.
template <int kPasses, int R, int C>
__device__ __forceinline__ void tile_mma(float (&acc)[R][C], int mi, int nj, const Tf32Operand<kPasses> (&a)[4],
                                         const Tf32Operand<kPasses> (&b)[2]) {
    float d[4] = {acc[2 * mi][2 * nj], acc[2 * mi][2 * nj + 1], acc[2 * mi + 1][2 * nj], acc[2 * mi + 1][2 * nj + 1]};
    mma_tf32<kPasses>(d, a, b);
    acc[2 * mi][2 * nj] = d[0];
    acc[2 * mi][2 * nj + 1] = d[1];
    acc[2 * mi + 1][2 * nj] = d[2];
    acc[2 * mi + 1][2 * nj + 1] = d[3];
}

// x = X Y^T for kMTiles m16 tiles of X's rows (from row0) and kNTiles n8 tiles
// of Y's rows (from 0), over kCols columns (zero past the run-time width), in
// the k order described at the top; kUnroll groups of 16 columns per unrolled
// iteration (fewer keep the backward's dK/dV kernels within their registers).
template <int kPasses, int kMTiles, int kNTiles, int kCols, class XLayout, class YLayout, int kUnroll = kCols / 16>
__device__ __forceinline__ void tf32_abt(float (&x)[2 * kMTiles][2 * kNTiles], const float* sX, const float* sY,
                                         int row0) {
    using Op = Tf32Operand<kPasses>;
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r)
#pragma unroll
        for (int c = 0; c < 2 * kNTiles; ++c) x[r][c] = 0.0f;
#pragma unroll kUnroll
    for (int j = 0; j < kCols / 16; ++j) {
        const int col = 16 * j + 4 * t;
        // A fragments of k8 steps 2j (h = 0) and 2j + 1 (h = 1) for each m16 tile.
        Op a[kMTiles][2][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
            const int r = row0 + 16 * mi + g;
            const Vec16<float> lo = load_vec16(sX + XLayout::offset(r, col));
            const Vec16<float> hi = load_vec16(sX + XLayout::offset(r + 8, col));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                a[mi][h][0] = Op(lo.x[2 * h]);
                a[mi][h][1] = Op(hi.x[2 * h]);
                a[mi][h][2] = Op(lo.x[2 * h + 1]);
                a[mi][h][3] = Op(hi.x[2 * h + 1]);
            }
        }
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
            const Vec16<float> y = load_vec16(sY + YLayout::offset(8 * ni + g, col));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Op b[2] = {Op(y.x[2 * h]), Op(y.x[2 * h + 1])};
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) tile_mma<kPasses>(x, mi, ni, a[mi][h], b);
            }
        }
    }
}

// o += P Z: P the accumulators of a tf32_abt (kMTiles m16 tiles by kKTiles n8
// tiles), Z a tile of 8 kKTiles rows and kCols columns; o's columns in the
// order described at the top.
template <int kPasses, int kMTiles, int kKTiles, int kCols, class ZLayout>
__device__ __forceinline__ void tf32_accumulate(float (&o)[2 * kMTiles][kCols / 4],
                                                const float (&p)[2 * kMTiles][2 * kKTiles], const float* sZ) {
    using Op = Tf32Operand<kPasses>;
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int kk = 0; kk < kKTiles; ++kk) {
        Op a[kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
            a[mi][0] = Op(p[2 * mi][2 * kk]);
            a[mi][1] = Op(p[2 * mi + 1][2 * kk]);
            a[mi][2] = Op(p[2 * mi][2 * kk + 1]);
            a[mi][3] = Op(p[2 * mi + 1][2 * kk + 1]);
        }
        const int row = 8 * kk + 2 * t;
#pragma unroll
        for (int jg = 0; jg < kCols / 32; ++jg) {
            const int col = 32 * jg + 4 * g;
            const Vec16<float> z0 = load_vec16(sZ + ZLayout::offset(row, col));
            const Vec16<float> z1 = load_vec16(sZ + ZLayout::offset(row + 1, col));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const Op b[2] = {Op(z0.x[i]), Op(z1.x[i])};
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) tile_mma<kPasses>(o, mi, 4 * jg + i, a[mi], b);
            }
        }
    }
}

// factor * one accumulator row of tf32_accumulate (columns in its order) to
// dst[0 .. cols_valid), rounded to T: a run of four columns per (J, e).
template <typename T, int kOCols>
__device__ __forceinline__ void store_row_tf32(T* dst, const float (&row)[kOCols], float factor, int cols_valid) {
    const int t = lane_id() & 3;
#pragma unroll
    for (int jg = 0; jg < kOCols / 8; ++jg)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float run[4] = {factor * row[8 * jg + e], factor * row[8 * jg + 2 + e],
                                  factor * row[8 * jg + 4 + e], factor * row[8 * jg + 6 + e]};
            const int col = 32 * jg + 8 * t + 4 * e;
            store_run(dst + col, run, cols_valid - col);
        }
}

}  // namespace cf
