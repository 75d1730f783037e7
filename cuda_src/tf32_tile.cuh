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
//       (store_row_tf32).
// A quarter-warp's 16-byte loads (lanes 8q .. 8q + 7) must fall in 8
// different bank groups (16-byte chunk index mod 8).  Row reads: rows 2q,
// 2q + 1 (mod 8), chunks 4j + t; column reads: rows 8 kk + 2t + e, chunks
// 8 J + 2q, 8 J + 2q + 1.  The layouts XOR a row's chunk index with
//   Tf32Rows       4 (r % 2)                       row reads
//   Tf32BothRows   (r & 6) ^ 4 (r % 2)             both: bit 2 differs between
//                  rows 2q and 2q + 1 (row reads), bits 1-2 take four values
//                  over rows 2t + e, t = 0..3 (column reads).
// Fragment quads.  The loads above still leave each lane to gather an A
// fragment from two rows (and each B fragment of P Z from two rows), which
// costs register moves on every use.  Tf32Pairs stores two rows interleaved
// so that one 16-byte load is a whole A fragment (rows g, g + 8) or two whole
// B fragments (rows 2t, 2t + 1); a tile reaches it raw and is interleaved in
// place by the threads that copied it (tf32_copy_tile, tf32_prepare_tile),
// which can round (split) it to TF32 at the same time, once for all warps.
#pragma once

#include "ptx.cuh"
#include "tile_io.cuh"

namespace cf {

// ---- shared-memory layouts (rows of kCols floats, 16-byte chunks permuted) --------------------
// Besides offset(r, c), each layout names the units its tiles are copied in
// (tf32_copy_tile): kRowsPerUnit rows, unit_row(u, m) the m-th row of unit row
// u, one 16-byte chunk each, landing raw at raw_chunk(r, c).  kPaired layouts
// are reworked in place once they land (tf32_prepare_tile).

template <int kCols>
struct Tf32Rows {
    static_assert(kCols % 32 == 0, "Tf32Rows: rows of whole 128-byte lines");
    static constexpr bool kPaired = false;
    static constexpr int kRowsPerUnit = 1;
    __device__ static int offset(int r, int c) { return r * kCols + ((((c >> 2) ^ ((r & 1) << 2))) << 2) + (c & 3); }
    __device__ static int unit_row(int u, int) { return u; }
    __device__ static int raw_chunk(int r, int c) { return offset(r, c); }
};

template <int kCols>
struct Tf32BothRows {
    static_assert(kCols % 32 == 0, "Tf32BothRows: rows of whole 128-byte lines");
    static constexpr bool kPaired = false;
    static constexpr int kRowsPerUnit = 1;
    __device__ static int offset(int r, int c) {
        return r * kCols + ((((c >> 2) ^ ((r & 6) ^ ((r & 1) << 2)))) << 2) + (c & 3);
    }
    __device__ static int unit_row(int u, int) { return u; }
    __device__ static int raw_chunk(int r, int c) { return offset(r, c); }
};

// Rows r and r + kStride (r % (2 kStride) < kStride) interleaved into fragment
// quads: 16-byte slot 2 j + h of pair p holds
//     X[r][4j + 2h], X[r + kStride][4j + 2h], X[r][4j + 2h + 1], X[r + kStride][4j + 2h + 1]
// -- with kStride = 8 an A fragment (a0 .. a3) of tf32_abt, with kStride = 1
// two B fragments (b0, b1) of tf32_accumulate, each in one 16-byte load, no
// register moves.  Pair p's slots are XORed with (p & 1) | 4 ((p >> 1) & 1),
// which puts a quarter-warp's 8 loads in 8 bank groups for both reads (rows
// 2q, 2q + 1 of the pairs at slots 8j + 2t + h; pairs 4kk + t at slots
// 16J + 4q + h, 16J + 4q + 2 + h).  Rows r and r + kStride land raw in slots
// 2 j and 2 j + 1.
template <int kCols, int kStride>
struct Tf32Pairs {
    static_assert(kCols % 16 == 0, "Tf32Pairs: pairs of whole 64-byte rows");
    static constexpr bool kPaired = true;
    static constexpr int kRowsPerUnit = 2;
    static constexpr int kSlots = kCols / 2;  // 16-byte slots per pair
    __device__ static int pair(int r) { return (r / (2 * kStride)) * kStride + r % kStride; }
    __device__ static int member(int r) { return (r / kStride) & 1; }
    __device__ static int slot(int p, int s) { return 4 * (p * kSlots + (s ^ ((p & 1) | ((p & 2) << 1)))); }
    __device__ static int offset(int r, int c) {
        return slot(pair(r), 2 * (c >> 2) + ((c >> 1) & 1)) + 2 * (c & 1) + member(r);
    }
    __device__ static int unit_row(int u, int m) { return (u / kStride) * 2 * kStride + u % kStride + m * kStride; }
    __device__ static int raw_chunk(int r, int c) { return slot(pair(r), 2 * (c >> 2) + member(r)); }
};

// ---- tiles into shared memory ---------------------------------------------------------------------

// Copies the first rows_valid rows and cols_valid columns of a kRows x kCols
// float tile at src into Layout (zeros elsewhere) with cp.async.  Unit
// u = threadIdx.x + i kThreads is one thread's on either path (16-byte copies,
// or 4-byte ones where src rows are not 16-byte aligned), so once its
// cp_async_wait returns the thread may rework its units in place
// (tf32_prepare_tile) before the barrier that shows the tile to the others.
// src: a pointer, or the pages of a paged cache (paged.cuh's row_at).
template <int kThreads, int kRows, int kCols, class Layout, class Src>
__device__ __forceinline__ void tf32_copy_tile(float* dst, const Src& src, int64_t row_stride, int rows_valid,
                                               int cols_valid) {
    constexpr int kChunks = kCols / 4, kUnits = kRows / Layout::kRowsPerUnit * kChunks;
    constexpr int kPasses = (kUnits + kThreads - 1) / kThreads;
    // A paged cache's rows are 16-byte aligned (fwd_tf32 takes no other).
    if (IsPaged<Src>::value || (reinterpret_cast<unsigned long long>(any_row(src)) % 16 == 0 && row_stride % 4 == 0)) {
        if constexpr (IsPaged<Src>::value) {
            // A paged cache: one unit's lookups at a time (unrolled, the d = 64
            // kernel spilled 16-52 bytes).
#pragma unroll 1
            for (int u = static_cast<int>(threadIdx.x); u < kUnits; u += kThreads) {
                const int c = (u % kChunks) * 4;
#pragma unroll
                for (int m = 0; m < Layout::kRowsPerUnit; ++m) {
                    const int r = Layout::unit_row(u / kChunks, m);
                    const int valid = r < rows_valid ? min(cols_valid - c, 4) : 0;
                    cp_async_16(dst + Layout::raw_chunk(r, c), valid > 0 ? row_at(src, r, row_stride) + c : any_row(src),
                                valid > 0 ? 4 * valid : 0);
                }
            }
        } else {
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int u = static_cast<int>(threadIdx.x) + pass * kThreads;
                if (kUnits % kThreads != 0 && u >= kUnits) break;
                const int c = (u % kChunks) * 4;
#pragma unroll
                for (int m = 0; m < Layout::kRowsPerUnit; ++m) {
                    const int r = Layout::unit_row(u / kChunks, m);
                    const int valid = r < rows_valid ? min(cols_valid - c, 4) : 0;
                    // a zero-byte copy reads nothing but still gets a valid address
                    cp_async_16(dst + Layout::raw_chunk(r, c), valid > 0 ? src + r * row_stride + c : src,
                                valid > 0 ? 4 * valid : 0);
                }
            }
        }
        return;
    }
    // Rows not 16-byte aligned: the same units, word by word (rare; not unrolled,
    // so that it costs the aligned path no registers).
#pragma unroll 1
    for (int i = 0; i < kPasses * Layout::kRowsPerUnit * 4; ++i) {
        const int u = static_cast<int>(threadIdx.x) + (i / (4 * Layout::kRowsPerUnit)) * kThreads;
        const int m = (i / 4) % Layout::kRowsPerUnit, w = i % 4;
        if (u >= kUnits) break;
        const int c = (u % kChunks) * 4;
        const int r = Layout::unit_row(u / kChunks, m);
        const bool valid = r < rows_valid && c + w < cols_valid;
        cp_async_4(dst + Layout::raw_chunk(r, c) + w, valid ? any_row(src) + r * row_stride + c + w : any_row(src),
                   valid ? 4 : 0);  // (never a paged cache's rows)
    }
}

__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(to_tf32(x)); }

// What tf32_prepare_tile leaves in a tile: the float32 values (kTf32Raw), or
// the TF32 operands every warp would otherwise convert for itself --
// tf32(x) (kTf32Rounded, one pass) or tf32(x) in place and tf32(x - tf32(x))
// kPlane floats further on (kTf32Split, three passes).
constexpr int kTf32Raw = 0, kTf32Rounded = 1, kTf32Split = 2;

// A shared-memory tile as an MMA operand: its layout and its preparation.
template <class Layout_, int kPrep_ = kTf32Raw, int kPlane_ = 0>
struct Tf32Tile {
    using Layout = Layout_;
    static constexpr int kPrep = kPrep_, kPlane = kPlane_;
    static_assert(kPrep == kTf32Raw || kPrep == kTf32Rounded || kPlane_ > 0 && kPrep == kTf32Split,
                  "kPrep: kTf32Raw, kTf32Rounded, or kTf32Split with its small plane");
};

// After this thread's copies of a tf32_copy_tile have landed: interleave its
// units of a kPaired layout into fragment quads, and prepare them as Tile says.
template <int kThreads, int kRows, int kCols, class Tile>
__device__ __forceinline__ void tf32_prepare_tile(float* dst) {
    using Layout = typename Tile::Layout;
    constexpr int kChunks = kCols / 4, kUnits = kRows / Layout::kRowsPerUnit * kChunks;
    // one 16-byte slot, prepared
    auto finish = [](float* slot, Vec16<float> x) {
        if constexpr (Tile::kPrep == kTf32Raw) {
            *reinterpret_cast<Vec16<float>*>(slot) = x;
        } else {
            Vec16<float> big, small;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                big.x[e] = tf32_round(x.x[e]);
                if constexpr (Tile::kPrep == kTf32Split) small.x[e] = tf32_round(x.x[e] - big.x[e]);
            }
            *reinterpret_cast<Vec16<float>*>(slot) = big;
            if constexpr (Tile::kPrep == kTf32Split) *reinterpret_cast<Vec16<float>*>(slot + Tile::kPlane) = small;
        }
    };
    if constexpr (Layout::kPaired || Tile::kPrep != kTf32Raw) {
#pragma unroll
        for (int pass = 0; pass < (kUnits + kThreads - 1) / kThreads; ++pass) {
            const int u = static_cast<int>(threadIdx.x) + pass * kThreads;
            if (kUnits % kThreads != 0 && u >= kUnits) break;
            const int c = (u % kChunks) * 4;
            float* lo = dst + Layout::raw_chunk(Layout::unit_row(u / kChunks, 0), c);
            const Vec16<float> a = load_vec16(lo);
            if constexpr (Layout::kPaired) {
                float* hi = dst + Layout::raw_chunk(Layout::unit_row(u / kChunks, 1), c);
                const Vec16<float> b = load_vec16(hi);
                finish(lo, Vec16<float>{{a.x[0], b.x[0], a.x[1], b.x[1]}});
                finish(hi, Vec16<float>{{a.x[2], b.x[2], a.x[3], b.x[3]}});
            } else {
                finish(lo, a);
            }
        }
    }
}

// ---- operands and MMAs ----------------------------------------------------------------------------

// One float32 operand as TF32: big = tf32(x) and, with three passes, small = tf32(x - big).
template <int kPasses>
struct Tf32Operand {
    uint32_t big, small;
    Tf32Operand() = default;
    __device__ explicit Tf32Operand(float x) : big(to_tf32(x)), small(0u) {
        if constexpr (kPasses == 3) small = to_tf32(x - __uint_as_float(big));
    }
    __device__ Tf32Operand(uint32_t big_, uint32_t small_) : big(big_), small(small_) {}
};

// The operands of the four elements at Tile's offset off (one 16-byte load;
// two for a split tile), converted here only if the tile is raw.
template <int kPasses, class Tile>
__device__ __forceinline__ void tf32_load4(Tf32Operand<kPasses> (&op)[4], const float* tile, int off) {
    static_assert(Tile::kPrep != kTf32Rounded || kPasses == 1, "a rounded tile serves one pass only");
    static_assert(Tile::kPrep != kTf32Split || kPasses == 3, "a split tile serves three passes");
    const Vec16<float> x = load_vec16(tile + off);
    if constexpr (Tile::kPrep == kTf32Split) {
        const Vec16<float> small = load_vec16(tile + Tile::kPlane + off);
#pragma unroll
        for (int e = 0; e < 4; ++e) op[e] = Tf32Operand<kPasses>(__float_as_uint(x.x[e]), __float_as_uint(small.x[e]));
    } else if constexpr (Tile::kPrep == kTf32Rounded) {
#pragma unroll
        for (int e = 0; e < 4; ++e) op[e] = Tf32Operand<kPasses>(__float_as_uint(x.x[e]), 0u);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) op[e] = Tf32Operand<kPasses>(x.x[e]);
    }
}

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
// XTile and YTile: Tf32Tile (layout and preparation) of X and Y.
template <int kPasses, int kMTiles, int kNTiles, int kCols, class XTile, class YTile, int kUnroll = kCols / 16>
__device__ __forceinline__ void tf32_abt(float (&x)[2 * kMTiles][2 * kNTiles], const float* sX, const float* sY,
                                         int row0) {
    using Op = Tf32Operand<kPasses>;
    using XLayout = typename XTile::Layout;
    using YLayout = typename YTile::Layout;
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
            if constexpr (XLayout::kPaired) {  // a whole fragment per load
#pragma unroll
                for (int h = 0; h < 2; ++h) tf32_load4<kPasses, XTile>(a[mi][h], sX, XLayout::offset(r, col + 2 * h));
            } else {
                Op lo[4], hi[4];
                tf32_load4<kPasses, XTile>(lo, sX, XLayout::offset(r, col));
                tf32_load4<kPasses, XTile>(hi, sX, XLayout::offset(r + 8, col));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[mi][h][0] = lo[2 * h];
                    a[mi][h][1] = hi[2 * h];
                    a[mi][h][2] = lo[2 * h + 1];
                    a[mi][h][3] = hi[2 * h + 1];
                }
            }
        }
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
            Op y[4];
            tf32_load4<kPasses, YTile>(y, sY, YLayout::offset(8 * ni + g, col));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Op b[2] = {y[2 * h], y[2 * h + 1]};
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) tile_mma<kPasses>(x, mi, ni, a[mi][h], b);
            }
        }
    }
}

// o += P Z: P the accumulators of a tf32_abt (kMTiles m16 tiles by kKTiles n8
// tiles), Z a tile (ZTile: Tf32Tile) of 8 kKTiles rows and kCols columns; o's
// columns in the order described at the top.
template <int kPasses, int kMTiles, int kKTiles, int kCols, class ZTile>
__device__ __forceinline__ void tf32_accumulate(float (&o)[2 * kMTiles][kCols / 4],
                                                const float (&p)[2 * kMTiles][2 * kKTiles], const float* sZ) {
    using Op = Tf32Operand<kPasses>;
    using ZLayout = typename ZTile::Layout;
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
            // b_i = (Z[row][col + i], Z[row + 1][col + i]): two fragments per load of a
            // kPaired layout, else one element each from rows row and row + 1
            Op b[4][2];
            Op w0[4], w1[4];
            if constexpr (ZLayout::kPaired) {
                tf32_load4<kPasses, ZTile>(w0, sZ, ZLayout::offset(row, col));
                tf32_load4<kPasses, ZTile>(w1, sZ, ZLayout::offset(row, col + 2));
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    b[i][0] = w0[2 * i], b[i][1] = w0[2 * i + 1];
                    b[i + 2][0] = w1[2 * i], b[i + 2][1] = w1[2 * i + 1];
                }
            } else {
                tf32_load4<kPasses, ZTile>(w0, sZ, ZLayout::offset(row, col));
                tf32_load4<kPasses, ZTile>(w1, sZ, ZLayout::offset(row + 1, col));
#pragma unroll
                for (int i = 0; i < 4; ++i) b[i][0] = w0[i], b[i][1] = w1[i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) tile_mma<kPasses>(o, mi, 4 * jg + i, a[mi], b[i]);
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
