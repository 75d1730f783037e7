// fragment.cuh -- where each accumulator element a thread holds sits in its
// tile: one coordinate trait per register-fragment layout.
//
// A trait gives, for element [r][c] of a thread's accumulator array, its row
// row(r) and column col(c) within the tile the thread's warp (or, SIMT, its
// CTA) computes; row0, the warp's first row in the CTA's block, is added by
// the caller.  Which of the two is the query and which the key depends on the
// product, not on the layout: S = Q K^T has the query as the row, the dK/dV
// kernels' S^T = K Q^T the key (score.cuh takes that as kQueryRows).
//
//   layout        kernels                               row(r)                 col(c)
//   SimtRows      fwd_simt, bwd_simt                    16 r' + tid / 8  (*)   8 c + tid % 8
//   M16n8         fwd_mma, fwd_tf32, bwd_mma, bwd_tf32   16 (r/2) + 8 (r%2) + g  8 (c/2) + 2t + c%2
//   Wgmma64       fwd_wgmma, bwd_wgmma                  8 r + g                8 (c/2) + 2t + c%2
//   M8n8          fwd_dmma, bwd_dmma                    8 r + g                8 (c/2) + 2t + c%2
//   Element       fwd_v1 (one element of a shared tile) r                      c
// (g, t) = (lane / 4, lane % 4).  (*) kRowGroups r + tid / kLanesPerRow, with
// kRowGroups = 16 and kLanesPerRow = 8 in both SIMT families.
//
// M16n8 is mma.sync m16n8k16's (and m16n8k8 .tf32's) C layout, kept as
// mma_tile.cuh's register tiles (float acc[2 m16 tiles][2 n8 tiles]).  A warp's
// share of a wgmma m64nN accumulator is the same layout with one m16 tile
// (warp w of the warpgroup holds rows 16 w .. 16 w + 15; wgmma.cuh), so
// Wgmma64 is M16n8 restricted to kRows = 2.  M8n8 is mma.sync m8n8k4 .f64's C
// layout: one row per m8 tile, the same columns as M16n8 (ptx-fragments.md).
#pragma once

#include "ptx.cuh"

namespace cf {

// Column, within the warp's tile, of accumulator element [r][c] of this lane:
// column 2t + c % 2 of n8 tile c / 2 -- for mma.sync m8n8k4's double
// accumulators (dmma_tile.cuh) as for the m16n8 ones.
__device__ __forceinline__ int fragment_col(int c) { return 8 * (c >> 1) + 2 * (lane_id() & 3) + (c & 1); }

// Row, within the warp's tile, of m16n8 accumulator element [r][c] of this lane:
// row g of the upper (r even) or lower (r odd) half of m16 tile r / 2.
__device__ __forceinline__ int fragment_row(int r) { return 16 * (r >> 1) + 8 * (r & 1) + (lane_id() >> 2); }

// mma.sync m16n8 accumulators (mma_tile.cuh's register tiles).
struct M16n8Fragment {
    static constexpr int kRowLanes = 4;  // the lanes holding one row: (g, t) for t = 0..3
    __device__ static __forceinline__ int row(int r) { return fragment_row(r); }
    __device__ static __forceinline__ int col(int c) { return fragment_col(c); }
};

// A warp's share of a wgmma m64nN accumulator: d[r][c], r = 0, 1 (wgmma.cuh).
struct Wgmma64Fragment {
    static constexpr int kRowLanes = 4;
    __device__ static __forceinline__ int row(int r) { return 8 * r + (lane_id() >> 2); }
    __device__ static __forceinline__ int col(int c) { return fragment_col(c); }
};

// mma.sync m8n8k4 .f64 accumulators: row g of m8 tile r (dmma_tile.cuh).
struct M8n8Fragment {
    static constexpr int kRowLanes = 4;
    __device__ static __forceinline__ int row(int r) { return 8 * r + (lane_id() >> 2); }
    __device__ static __forceinline__ int col(int c) { return fragment_col(c); }
};

// The CUDA-core kernels' thread layout (fwd_simt.cu, bwd_simt.cu): kLanesPerRow
// consecutive threads share the rows kRowGroups ii + row_group and split the
// columns kLanesPerRow jj + lane_in_group (of the scores) and the 16-byte
// chunks of a row (of the outputs and gradients) among themselves.
template <int kRowGroups, int kLanesPerRow>
struct SimtRowsFragment {
    static constexpr int kRowLanes = kLanesPerRow;  // consecutive lanes, one row
    int row_group, lane_in_group;

    __device__ SimtRowsFragment()
        : row_group(static_cast<int>(threadIdx.x) / kLanesPerRow),
          lane_in_group(static_cast<int>(threadIdx.x) % kLanesPerRow) {}

    __device__ __forceinline__ int row(int ii) const { return ii * kRowGroups + row_group; }
    __device__ __forceinline__ int col(int jj) const { return jj * kLanesPerRow + lane_in_group; }
    __device__ __forceinline__ int chunk(int qq) const { return qq * kLanesPerRow + lane_in_group; }
};

// One element (row, col) of a tile, held as a 1 x 1 array (fwd_v1, whose
// threads walk the shared score tile element by element).
struct ElementFragment {
    int r, c;
    __device__ __forceinline__ int row(int) const { return r; }
    __device__ __forceinline__ int col(int) const { return c; }
};

}  // namespace cf
