// dmma_tile.cuh -- shared-memory layouts and fragment moves of the float64
// tensor-core kernels (fwd_dmma.cu, bwd_dmma.cu): mma.sync m8n8k4 .f64.
//
// One DMMA multiplies an 8 x 4 A fragment by a 4 x 8 B fragment into an 8 x 8
// accumulator; lane (g, t) = (lane / 4, lane % 4) holds A[g][t], B[t][g] and
// the accumulator pair (g, 2t), (g, 2t + 1) (ptx-fragments.md section 3).
// A tile in shared memory is read in two patterns:
//   rows    8 rows x 4 columns, X[r0 + g][k + t]: the A fragment of a product
//           over the tile's columns (S = Q K^T), and the B fragment of one
//           whose rows are the output's columns (the K of Q K^T);
//   columns 4 rows x 8 columns, X[k + t][n + g]: the B fragment of a product
//           over the tile's rows (the V of P V).
// Either reads 256 bytes, two wavefronts at best.
#pragma once

// fragment_col: the accumulators' n8 columns are those of mma.sync's register tiles
#include "mma_tile.cuh"
#include "ptx.cuh"

namespace cf {

// Rows of kCols doubles whose 16-byte chunks are permuted by XOR with
// 4 x (row % 4): the 4 rows x 8 columns of a DMMA B fragment of V (rows k..k+3,
// columns n..n+7, n a multiple of 8) land in 16 distinct chunks.
template <int kCols>
struct DmmaVRows {
    static_assert(kCols % 32 == 0, "DmmaVRows: rows of at least 16 chunks");
    __device__ static int offset(int r, int c) { return r * kCols + (((c >> 1) ^ ((r & 3) << 2)) << 1) + (c & 1); }
};

// Rows of kCols doubles whose 16-byte chunks are permuted by XOR with
// 2 x (row % 4), conflict-free in both patterns (the backward reads Q, dO and
// K both ways).  A chunk's bank group is its index mod 8.
//   rows:    row r0 + g reads chunk k/2 + t/2 -> (k/2 + t/2) ^ 2 (g % 4); over
//            the 8 rows the XOR takes each of 0, 2, 4, 6 twice, so the 16
//            chunks cover the 8 bank groups twice each.
//   columns: row k + t reads chunks n/2 .. n/2 + 3 (one aligned group of four)
//            XOR 2t: rows t = 0, 1 stay in that group of four, rows 2, 3 move
//            to the other one -- again every bank group twice.
template <int kCols>
struct DmmaRows {
    static_assert(kCols % 16 == 0, "DmmaRows: rows of at least 8 chunks");
    __device__ static int offset(int r, int c) { return r * kCols + (((c >> 1) ^ ((r & 3) << 1)) << 1) + (c & 1); }
};

// The two accumulators of lane (g, t) in n8 tile n of a row array, as DMMA's C/D.
template <int kCols>
__device__ __forceinline__ double (&pair(double (&row)[kCols], int n))[2] {
    return *reinterpret_cast<double(*)[2]>(&row[2 * n]);
}

// The A fragment X[g][4 kk + t] of k4 step kk, for X held as accumulators
// (lane (g, t') holds X[g][8 n + 2t'], X[g][8 n + 2t' + 1] of n8 tile n):
// element t % 2 of tile kk / 2 in lane (g, 2 (kk % 2) + t / 2), two shuffles.
// Every lane of the warp must call.
template <int kCols>
__device__ __forceinline__ double gather_a(const double (&x)[kCols], int kk) {
    const int lane = lane_id(), t = lane & 3;
    const int src = (lane & ~3) | (2 * (kk & 1) + (t >> 1));
    const double even = shfl(x[2 * (kk >> 1)], src), odd = shfl(x[2 * (kk >> 1) + 1], src);
    return (t & 1) ? odd : even;
}

}  // namespace cf
