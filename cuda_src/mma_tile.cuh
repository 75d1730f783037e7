// mma_tile.cuh -- tiles of 16-bit elements for the tensor-core kernels: the
// swizzled shared-memory layout, cp.async tile loads with zero-filled tails,
// and warp-level fragment verbs around mma.sync m16n8k16 (ldmatrix in,
// float accumulators out).
//
// Register tiles.  A warp's m16n8 accumulators are kept as `float acc[R][C]`
// where row r = 2 * m16_tile + half (half 0: fragment row g, half 1: g + 8)
// and column c = 2 * n8_tile + e (fragment column 2t + e), so element
// acc[r][c] of lane (g, t) is logical entry (16 * (r / 2) + 8 * (r % 2) + g,
// 8 * (c / 2) + 2t + c % 2) of the warp's tile (ptx-fragments.md section 1).
// Each row therefore lives in the four lanes of one quad, which is what the
// online softmax (softmax.cuh, kLanes = 4) reduces over.  Every index is a
// compile-time constant after unrolling, so the arrays are plain registers.
#pragma once

#include "fragment.cuh"
#include "paged.cuh"
#include "ptx.cuh"

namespace cf {

// ---- the element type's mma and packing ------------------------------------------------------

template <typename T> struct MmaElement;
template <> struct MmaElement<__half> {
    __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                               const float (&c)[4]) {
        mma_m16n8k16_f16(d, a, b, c);
    }
    __device__ static uint32_t pack(float lo, float hi) { return pack_half2(lo, hi); }
};
template <> struct MmaElement<__nv_bfloat16> {
    __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                               const float (&c)[4]) {
        mma_m16n8k16_bf16(d, a, b, c);
    }
    __device__ static uint32_t pack(float lo, float hi) { return pack_bf162(lo, hi); }
};

// ---- shared-memory layout ----------------------------------------------------------------------

// A kRows x kCols tile of 16-bit elements, stored as column pages of 64
// elements (one 128-byte line per row), plus a last page of 32 elements when
// kCols is an odd multiple of 32 (two rows per line).  Within a page the
// 16-byte chunk index inside each 128-byte line is XORed with the line number
// mod 8.  The 8 row addresses of one ldmatrix matrix (8 consecutive rows
// starting at a multiple of 8, one chunk column) then hit 8 different
// 16-byte bank groups, as do the 8 chunks a quarter-warp of cp.async writes
// along a row, with no padding; chunks stay whole (16-byte aligned).
template <int kRows_, int kCols_>
struct SwizzledTile {
    static constexpr int kRows = kRows_;
    static constexpr int kCols = kCols_;
    static constexpr int kChunks = kCols / 8;        // 16-byte chunks per row
    static constexpr int kFullPages = kCols / 64;
    static constexpr int kElements = kRows * kCols;
    static_assert(kCols % 32 == 0, "SwizzledTile: rows of whole 64-byte half pages");
    static_assert(kRows % 8 == 0, "SwizzledTile: whole 8-row ldmatrix groups");

    // Element offset of the first element of chunk c = c_base + c_lane
    // (elements 8c .. 8c+7) of row r.  Callers split c into a part known at
    // compile time once loops are unrolled (c_base) and a lane-dependent part
    // (c_lane) that stays inside c_base's page: c_lane < 8 - c_base % 8 in a
    // half-page tile, any c_lane when c_base is a multiple of 8 and every page
    // is full.  The page, and with it the formula, then folds to a constant.
    __device__ static int chunk(int r, int c_base, int c_lane = 0) {
        if (kCols % 64 == 0 || (c_base >> 3) < kFullPages) {  // one 128-byte line per row
            const int page = (c_base >> 3) + (c_lane >> 3);
            return page * (kRows * 64) + r * 64 + ((((c_base & 7) + (c_lane & 7)) ^ (r & 7)) << 3);
        }
        const int line = r >> 1;  // the half page: two rows per line
        const int in_line = ((r & 1) << 2) + (c_base & 3) + c_lane;
        return kFullPages * (kRows * 64) + line * 64 + ((in_line ^ (line & 7)) << 3);
    }

    // Elements between chunk c of row r and of row r + dr, for dr a multiple of
    // 16 (of 8 in a full page): whole groups of 8 lines, which leave the
    // swizzle alone.  Loops over rows therefore compute the lane-dependent
    // chunk(r, c) once per distinct c and step by compile-time offsets.
    __device__ static int row_pitch(int c_base) {
        return kCols % 64 == 0 || (c_base >> 3) < kFullPages ? 64 : 32;
    }
};

// ---- global -> shared (cp.async) ---------------------------------------------------------------

// Issue (not commit) the cp.async copies of one tile by kThreads threads, all
// of which must call: row r, column c of the tile takes
// src[(first_row + r) * row_stride + c] for r < rows_valid and c < cols_valid,
// zero otherwise (cp.async zero-fill).  Every row start must be 16-byte
// aligned (the dispatcher checks it).  kLanes consecutive threads share a row,
// each taking every kLanes-th chunk (kLanes: the largest power of two dividing
// the chunks per row, at most 16).  One row address per call, stepped by a
// pass's rows, and the column bounds once per call: the row stride's
// products are not hoisted out of the caller's loop (they would hold two
// registers per row for the whole kernel), and a pass costs an add, a
// compare and its copies.  kWhole: the caller guarantees rows_valid >= the
// tile's rows and cols_valid >= its columns, and the copies drop every bound
// and select (fwd_mma's K/V blocks when Lk is a multiple of the block and d
// is the bucket: a third of the instructions of d = 128's main loop went to
// the two K/V copies' bounds).
//
// src: a pointer, or the pages of a paged cache (paged.cuh): then each row's
// address comes from its page, one table lookup per row and pass.
//
// cp_async_tile_by: the same by threads 0 .. kThreads - 1 of a group that is
// not the whole CTA (a producer warpgroup: `thread` its index in it).  kRolled:
// the passes stay a loop (unrolled, they hold a row address each: a producer
// that gives its registers back would spill them).
template <int kThreads, class Tile, bool kWhole = false, bool kRolled = false, typename T, class Src>
__device__ __forceinline__ void cp_async_tile_by(int thread, T* dst, const Src& src, int64_t first_row,
                                                 int64_t row_stride, int rows_valid, int cols_valid) {
    static_assert(sizeof(T) == 2, "16-bit elements: 8 per 16-byte chunk");
    constexpr int kLanesRaw = Tile::kChunks & -Tile::kChunks;
    constexpr int kLanes = kLanesRaw < 16 ? kLanesRaw : 16;
    constexpr int kRowsPerPass = kThreads / kLanes;
    constexpr int kRowPasses = (Tile::kRows + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kThreads % kLanes == 0 && kRowsPerPass % (Tile::kCols % 64 ? 16 : 8) == 0,
                  "whole rows per pass, and whole swizzle periods (row_pitch)");
    const int r0 = thread / kLanes;
    const int c0 = thread % kLanes;
    // Bytes of each of the thread's chunks inside a valid row (columns past
    // cols_valid read nothing): the same for every row, so computed once.
    constexpr int kChunksPerLane = Tile::kChunks / kLanes;
    int chunk_bytes[kChunksPerLane];
#pragma unroll
    for (int cp = 0; cp < kChunksPerLane; ++cp) {
        const int valid = cols_valid - 8 * (c0 + cp * kLanes);  // elements inside the row
        chunk_bytes[cp] = kWhole ? 16 : 2 * (valid < 0 ? 0 : valid > 8 ? 8 : valid);
    }
    if constexpr (IsPaged<Src>::value) {
        // One row's lookup at a time: unrolled, the passes' lookups and addresses
        // held more registers (fwd_mma's d = 128 spilled 8 B on sm_90, 4 B so).
#pragma unroll 1
        for (int rp = 0; rp < kRowPasses; ++rp) {
            const int r = r0 + rp * kRowsPerPass;
            if (Tile::kRows % kRowsPerPass == 0 || r < Tile::kRows) {
                const bool valid = kWhole || r < rows_valid;  // rows past it: no lookup (the table may end)
                const T* row = valid ? row_at(src, first_row + r, row_stride) + 8 * c0 : any_row(src);
#pragma unroll
                for (int cp = 0; cp < kChunksPerLane; ++cp) {
                    const int bytes = valid ? chunk_bytes[cp] : 0;
                    T* to = dst + Tile::chunk(r0, cp * kLanes, c0) + rp * kRowsPerPass * Tile::row_pitch(cp * kLanes);
                    cp_async_16(to, bytes > 0 ? row + 8 * kLanes * cp : any_row(src), bytes);
                }
            }
        }
        return;
    }
    const T* row = row_at(src, first_row + r0, row_stride) + 8 * c0;
#pragma unroll(kRolled ? 1 : kRowPasses)
    for (int rp = 0; rp < kRowPasses; ++rp, row += kRowsPerPass * row_stride) {
        const int r = r0 + rp * kRowsPerPass;
        if (Tile::kRows % kRowsPerPass == 0 || r < Tile::kRows) {
#pragma unroll
            for (int cp = 0; cp < kChunksPerLane; ++cp) {
                const int bytes = kWhole || r < rows_valid ? chunk_bytes[cp] : 0;
                // A zero-byte copy reads nothing; it still gets an aligned address.
                T* to = dst + Tile::chunk(r0, cp * kLanes, c0) +
                        rp * kRowsPerPass * Tile::row_pitch(cp * kLanes);
                cp_async_16(to, bytes > 0 ? row + 8 * kLanes * cp : any_row(src), bytes);
            }
        }
    }
}

// cp_async_tile_by with every thread of the CTA (threadIdx.x).
template <int kThreads, class Tile, bool kWhole = false, typename T, class Src>
__device__ __forceinline__ void cp_async_tile(T* dst, const Src& src, int64_t first_row, int64_t row_stride,
                                              int rows_valid, int cols_valid) {
    cp_async_tile_by<kThreads, Tile, kWhole>(static_cast<int>(threadIdx.x), dst, src, first_row, row_stride,
                                             rows_valid, cols_valid);
}

// ---- warp-level fragments ------------------------------------------------------------------------
// Addresses follow ptx-fragments.md section 4 ("FA2 recipes"): lane L supplies
// the row address of matrix L / 8, row L % 8.

// A operand (16 x 16) from a [m][k] tile: rows m0 .. m0+15 (m0 a multiple of 16),
// k-columns 16 ks .. 16 ks + 15.
template <class Tile, typename T>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&a)[4], const T* tile, int m0, int ks) {
    const int lane = lane_id();
    ldmatrix_x4(a, tile + Tile::chunk(lane & 15, 2 * ks, lane >> 4) + m0 * Tile::row_pitch(2 * ks));
}

// B operands of two n8 tiles from a [n][k] tile (K, for S = Q K^T): columns
// n0 .. n0+7 in b[0..1] and n0+8 .. n0+15 in b[2..3] (n0 a multiple of 16), k-step ks.
template <class Tile, typename T>
__device__ __forceinline__ void ldmatrix_b_nk(uint32_t (&b)[4], const T* tile, int n0, int ks) {
    const int lane = lane_id();
    ldmatrix_x4(b, tile + Tile::chunk((lane & 7) + ((lane >> 4) << 3), 2 * ks, (lane >> 3) & 1) +
                       n0 * Tile::row_pitch(2 * ks));
}

// B operands of two n8 tiles from a [k][n] tile (V, for O = P V), transposed
// on the way: k-rows k0 .. k0+15 (k0 a multiple of 16), columns 16 np .. 16 np + 7 in b[0..1] and
// 16 np + 8 .. 16 np + 15 in b[2..3].
template <class Tile, typename T>
__device__ __forceinline__ void ldmatrix_b_kn(uint32_t (&b)[4], const T* tile, int k0, int np) {
    const int lane = lane_id();
    ldmatrix_x4_trans(b, tile + Tile::chunk(lane & 15, 2 * np, lane >> 4) + k0 * Tile::row_pitch(2 * np));
}

// A operand (16 x 16) from a [k][m] tile (A stored transposed, e.g. dS^T):
// rows m0 .. m0+15 of A (m0 a multiple of 16), k-step ks, transposed on the
// way.  Matrix i = lane / 8 is A's (rows 8 (i % 2) .., k 8 (i / 2) ..) block:
// k-rows 16 ks + 8 (i / 2) + lane % 8, the chunk of columns m0 + 8 (i % 2).
template <class Tile, typename T>
__device__ __forceinline__ void ldmatrix_a_km(uint32_t (&a)[4], const T* tile, int m0, int ks) {
    const int lane = lane_id();
    ldmatrix_x4_trans(a, tile + Tile::chunk(16 * ks + 8 * (lane >> 4) + (lane & 7), m0 >> 3, (lane >> 3) & 1));
}

// acc (m16 tile mi, n8 tile nj) += A * B, acc laid out as described at the top.
template <typename T, int R, int C>
__device__ __forceinline__ void mma_into(float (&acc)[R][C], int mi, int nj, const uint32_t (&a)[4],
                                         uint32_t b0, uint32_t b1) {
    float (&lo)[C] = acc[2 * mi];
    float (&hi)[C] = acc[2 * mi + 1];
    const float c[4] = {lo[2 * nj], lo[2 * nj + 1], hi[2 * nj], hi[2 * nj + 1]};
    const uint32_t b[2] = {b0, b1};
    float d[4];
    MmaElement<T>::mma(d, a, b, c);
    lo[2 * nj] = d[0];
    lo[2 * nj + 1] = d[1];
    hi[2 * nj] = d[2];
    hi[2 * nj + 1] = d[3];
}

// acc = A B^T for the warp's m16 tiles of A (rows row0 .. row0 + 16 kMTiles - 1)
// and all kN rows of B, over kKSteps k16 steps; A and B are [row][k] tiles in
// their swizzled layouts (Q K^T in the forward, X Y^T in the backward).
template <class ATile, class BTile, int kMTiles, int kN, int kKSteps, typename T, int R, int C>
__device__ __forceinline__ void mma_abt(float (&acc)[R][C], const T* sA, const T* sB, int row0) {
    static_assert(R == 2 * kMTiles && C == kN / 4, "accumulators: two row halves per m16 tile, 2 per n8 tile");
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) ldmatrix_a<ATile>(a[mi], sA, row0 + 16 * mi, ks);
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_nk<BTile>(b, sB, 16 * np, ks);
#pragma unroll
            for (int mi = 0; mi < kMTiles; ++mi) {
                mma_into<T>(acc, mi, 2 * np, a[mi], b[0], b[1]);
                mma_into<T>(acc, mi, 2 * np + 1, a[mi], b[2], b[3]);
            }
        }
    }
}

// The A operand of P V for m16 tile mi and key step kk (keys 16 kk .. 16 kk + 15)
// straight from the score accumulators: the C fragments of n8 tiles 2kk and
// 2kk+1, rounded to T and packed (ptx-fragments.md section 1, "[derived]").
template <typename T, int R, int C>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[4], const float (&p)[R][C], int mi, int kk) {
    const float (&lo)[C] = p[2 * mi];
    const float (&hi)[C] = p[2 * mi + 1];
    a[0] = MmaElement<T>::pack(lo[4 * kk], lo[4 * kk + 1]);
    a[1] = MmaElement<T>::pack(hi[4 * kk], hi[4 * kk + 1]);
    a[2] = MmaElement<T>::pack(lo[4 * kk + 2], lo[4 * kk + 3]);
    a[3] = MmaElement<T>::pack(hi[4 * kk + 2], hi[4 * kk + 3]);
}

// Write the accumulators (rounded to T) into rows row0 .. of a swizzled tile:
// each lane stores its pairs as 32-bit words, 8 rows x 4 words per n8 tile,
// which the swizzle spreads over all 32 banks.
template <class Tile, typename T, int R, int C>
__device__ __forceinline__ void store_accumulators(T* tile, const float (&acc)[R][C], int row0) {
    const int lane = lane_id();
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = row0 + 16 * (r >> 1) + 8 * (r & 1) + g;
#pragma unroll
        for (int nj = 0; nj < C / 2; ++nj) {
            uint32_t* word = reinterpret_cast<uint32_t*>(tile + Tile::chunk(row, nj) + 2 * t);
            *word = MmaElement<T>::pack(acc[r][2 * nj], acc[r][2 * nj + 1]);
        }
    }
}

// Copy rows row0 .. row0 + kRowsOut - 1 of a swizzled tile to global memory
// (row r to dst + r * row_stride), one warp, 16-byte stores: only rows below
// rows_valid and columns below cols_valid are written (a chunk cut by
// cols_valid element by element).  Row starts must be 16-byte aligned.
template <int kRowsOut, class Tile, typename T>
__device__ __forceinline__ void store_rows(T* dst, int64_t row_stride, const T* tile, int row0,
                                           int rows_valid, int cols_valid) {
    constexpr int kTotal = kRowsOut * Tile::kChunks;
    const int lane = lane_id();
    // Not unrolled: it runs once per CTA, and unrolled copies of the partial-chunk
    // loop would only lengthen the kernel.
#pragma unroll 1
    for (int pass = 0; pass < (kTotal + 31) / 32; ++pass) {
        const int idx = 32 * pass + lane;
        const int r = idx / Tile::kChunks;
        const int c = idx % Tile::kChunks;
        const int valid = cols_valid - 8 * c;
        if ((kTotal % 32 == 0 || idx < kTotal) && r < rows_valid && valid > 0) {
            const T* from = tile + Tile::chunk(row0 + r, c);
            T* to = dst + r * row_stride + 8 * c;
            if (valid >= 8) {
                *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
            } else {
                for (int e = 0; e < valid; ++e) to[e] = from[e];
            }
        }
    }
}

}  // namespace cf
