// fwd_simt.cu -- the portable forward kernel: FlashAttention-2 on CUDA cores.
//
// Any float type (half, bfloat16, float, double), any head dim up to the
// compile-time bucket.  A CTA owns kBlockM query rows of one (batch, head),
// keeps them in shared memory, and streams the visible K/V blocks through
// shared memory (float and double: K and V each in their own buffer, copied
// with cp.async while the other is in use; 16-bit types: one buffer,
// converted to float on the way in -- see SimtTiles).  Per key block:
// S = Q K^T (in registers, scale * log2(e) folded in), mask if the block is
// partly admissible (score.cuh), online softmax with exp2, O += P V.  The
// normalisation by the row sum happens once, at the end.  The loop itself is
// fwd_loop.cuh's, shared with fwd_dmma and fwd_tf32; this file gives it the
// products (SimtFwdLoop).  With FwdParams::num_splits > 1
// (split-KV), CTA (x, y) visits only the y-th run of its key blocks and
// writes its partial output and lse for fwd_combine.cu to merge.
//
// Thread layout (kThreads = 128): 8 consecutive lanes share kRowsPerThread
// query rows and split the columns among themselves --
//   query row  ii * 16 + row_group          (row_group = tid / 8, 0..15)
//   key column jj * 8 + lane_in_group       (of S and P)
//   chunk      qq * 8 + lane_in_group       (16-byte chunks of an O / V row)
// so row maxima and sums are reductions over 8 lanes (softmax.cuh), and the
// probabilities P reach the P V product through a small shared tile that
// each row group writes and reads back by 16-byte broadcasts (mma_pv).  Shared tiles hold the accumulator type; Q and K rows are
// XOR-swizzled (tile_io.cuh) so the vector loads of the inner products are
// free of bank conflicts.
#pragma once

#include "block_info.cuh"
#include "fwd_loop.cuh"
#include "fwd_tiles.cuh"
#include "fragment.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The (block_m, block_n)
// table with the reason for each row is in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_>
struct SimtFwdTraits {
    using Acc = acc_t<T>;
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kThreads = 128;
    static constexpr int kLanesPerRow = 8;
    static constexpr int kRowGroups = kThreads / kLanesPerRow;
    static constexpr int kRowsPerThread = kBlockM / kRowGroups;
    static constexpr int kKeysPerThread = kBlockN / kLanesPerRow;
    static constexpr int kVec = Vec16<Acc>::kSize;
    static constexpr int kChunksPerThreadV = kHeadDimV / kVec / kLanesPerRow;

    using QLayout = SwizzledRows<Acc, kHeadDim>;
    using KLayout = SwizzledRows<Acc, kHeadDim>;
    __device__ static PlainRows v_layout() { return PlainRows{kHeadDimV}; }

    // float and double tiles need no conversion, so they are copied with
    // cp.async into separate K and V buffers: V(n) lands while S = Q K(n)^T
    // is computed, K(n+1) while O += P V(n).  The 16-bit types convert on the
    // way in and share one K/V buffer, loaded synchronously.
    static constexpr bool kAsync = SameType<T, Acc>::value;

    static constexpr int kSmemQ = kBlockM * kHeadDim;  // elements of Acc
    static constexpr int kSmemK = kBlockN * (kAsync || kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV);
    static constexpr int kSmemV = kAsync ? kBlockN * kHeadDimV : 0;  // else V reuses the K buffer
    // P of the current block, kBlockM rows of kPPitch: the pitch is 8 more
    // than the row so that the 4 row groups of a warp store their P to
    // different banks (row offsets 8 banks apart, lanes 0..7 within).
    static constexpr int kPPitch = kBlockN + 8;
    static constexpr int kSmemP = kBlockM * kPPitch;
    static constexpr int kSmemBytes =
        (kSmemQ + kSmemK + kSmemV + kSmemP) * static_cast<int>(sizeof(Acc));
    // Occupancy target, which sets the register cap (65536 / (128 * n)): 4
    // CTAs (16 warps) per SM -> 128 registers up to 48 KB of shared memory,
    // 3 -> 168 up to 64 KB (an H100 holds 3 such CTAs, an A100 2), and 1 (255
    // registers) for the d = 256 tiles above that.
    static constexpr int kMinBlocksPerSm = kSmemBytes > 64 * 1024 ? 1 : kSmemBytes > 48 * 1024 ? 3 : 4;

    static_assert(kBlockM % kRowGroups == 0, "block_m: a multiple of 16 query rows");
    static_assert(kBlockN % kLanesPerRow == 0, "block_n: a multiple of 8 keys");
    static_assert(kHeadDimV % (kVec * kLanesPerRow) == 0, "head_dim_v bucket: whole chunks per lane");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");
};

// This thread's place in the layout described at the top of the file.
template <class Tr>
using SimtThread = SimtRowsFragment<Tr::kRowGroups, Tr::kLanesPerRow>;

// s = (Q K^T) * scale_log2 for this thread's rows and keys; the head dim is
// walked in 16-byte chunks up to the run-time d (the tile is zero beyond it).
template <class Tr, typename Acc>
__device__ __forceinline__ void mma_qk(Acc (&s)[Tr::kRowsPerThread][Tr::kKeysPerThread],
                                       const Acc* sQ, const Acc* sK, const SimtThread<Tr>& me,
                                       int head_dim, Acc scale_log2) {
    constexpr int TM = Tr::kRowsPerThread, TN = Tr::kKeysPerThread;
#pragma unroll
    for (int ii = 0; ii < TM; ++ii)
#pragma unroll
        for (int jj = 0; jj < TN; ++jj) s[ii][jj] = Acc(0);
    const int chunks = (head_dim + Tr::kVec - 1) / Tr::kVec;
    // One chunk per iteration: unrolling would hoist several chunks' loads
    // and push the register count past the occupancy target's cap.
#pragma unroll 1
    for (int q = 0; q < chunks; ++q) {
        Vec16<Acc> a[TM], b[TN];
#pragma unroll
        for (int ii = 0; ii < TM; ++ii) a[ii] = load_vec16(sQ + Tr::QLayout::chunk(me.row(ii), q));
#pragma unroll
        for (int jj = 0; jj < TN; ++jj) b[jj] = load_vec16(sK + Tr::KLayout::chunk(me.col(jj), q));
#pragma unroll
        for (int ii = 0; ii < TM; ++ii)
#pragma unroll
            for (int jj = 0; jj < TN; ++jj)
#pragma unroll
                for (int e = 0; e < Tr::kVec; ++e) s[ii][jj] += a[ii].x[e] * b[jj].x[e];
    }
#pragma unroll
    for (int ii = 0; ii < TM; ++ii)
#pragma unroll
        for (int jj = 0; jj < TN; ++jj) s[ii][jj] *= scale_log2;
}

// o += P V.  P goes through shared memory: each thread stores its entries,
// then reads its rows' P four keys (float; two for double) at a time, the 8
// lanes of a row group reading the same address (a broadcast).  Rows are
// private to their row group, so a warp barrier separates the stores from
// the loads; the CTA barriers of the next key block separate these loads
// from the next stores.  Per 16-byte chunk of P: kRowsPerThread + kVec x
// kChunksPerThreadV shared loads for kRowsPerThread x kVec x kVec x
// kChunksPerThreadV FMAs -- fewer loads per FMA than shuffling P one key at a
// time, which costs a shuffle per row and key.
template <class Tr, typename Acc>
__device__ __forceinline__ void mma_pv(
    Acc (&o)[Tr::kRowsPerThread][Tr::kChunksPerThreadV][Tr::kVec],
    const Acc (&p)[Tr::kRowsPerThread][Tr::kKeysPerThread], Acc* sP, const Acc* sV, int v_cols,
    const SimtThread<Tr>& me) {
    constexpr int TM = Tr::kRowsPerThread;
#pragma unroll
    for (int ii = 0; ii < TM; ++ii)
#pragma unroll
        for (int jj = 0; jj < Tr::kKeysPerThread; ++jj) sP[me.row(ii) * Tr::kPPitch + me.col(jj)] = p[ii][jj];
    __syncwarp();
    // One chunk of keys per iteration keeps kRowsPerThread P vectors live.
#pragma unroll 1
    for (int k0 = 0; k0 < Tr::kBlockN; k0 += Tr::kVec) {
        Vec16<Acc> pk[TM];
#pragma unroll
        for (int ii = 0; ii < TM; ++ii) pk[ii] = load_vec16(sP + me.row(ii) * Tr::kPPitch + k0);
#pragma unroll
        for (int e = 0; e < Tr::kVec; ++e) {
#pragma unroll
            for (int qq = 0; qq < Tr::kChunksPerThreadV; ++qq) {
                const Vec16<Acc> v = load_vec16(sV + (k0 + e) * v_cols + me.chunk(qq) * Tr::kVec);
#pragma unroll
                for (int ii = 0; ii < TM; ++ii)
#pragma unroll
                    for (int x = 0; x < Tr::kVec; ++x) o[ii][qq][x] += pk[ii].x[e] * v.x[x];
            }
        }
    }
}

// Write this thread's rows of the (already normalised) output to out (rows
// out_row_stride elements apart) and their lse to lse_out when it is not
// null: the output (T) and lse of the call, or a split's partial results
// (Acc, SplitSlice).
template <class Tr, typename Out, typename Acc>
__device__ __forceinline__ void store_output(
    const Acc (&o)[Tr::kRowsPerThread][Tr::kChunksPerThreadV][Tr::kVec],
    const Acc (&lse)[Tr::kRowsPerThread], Out* out, int64_t out_row_stride, Acc* lse_out,
    int64_t lse_row_stride, const QueryBlock& block, const FwdParams& p, const SimtThread<Tr>& me) {
#pragma unroll
    for (int ii = 0; ii < Tr::kRowsPerThread; ++ii) {
        if (me.row(ii) >= block.rows) continue;
        const int64_t i = block.m0 + me.row(ii);
        Out* out_row = out + i * out_row_stride;
#pragma unroll
        for (int qq = 0; qq < Tr::kChunksPerThreadV; ++qq) {
            const int col = me.chunk(qq) * Tr::kVec;
            store_run(out_row + col, o[ii][qq], static_cast<int>(p.head_dim_v) - col);
        }
        if (lse_out != nullptr && me.lane_in_group == 0) lse_out[i * lse_row_stride] = lse[ii];
    }
}

// fwd_loop.cuh's hooks: the products above on this file's thread layout.
template <class Tr>
struct SimtFwdLoop : Tr {
    using Acc = typename Tr::Acc;
    using Thread = SimtThread<Tr>;
    using Mover = RowTileMover<Tr>;
    using Rule = WindowRule<false>;
    static constexpr Units kUnits = Units::kLog2;
    using Softmax = OnlineSoftmax<Acc, Tr::kRowsPerThread, Tr::kLanesPerRow>;
    using Scores = Acc[Tr::kRowsPerThread][Tr::kKeysPerThread];
    using Output = Acc[Tr::kRowsPerThread][Tr::kChunksPerThreadV][Tr::kVec];
    static constexpr int kStatRows = Tr::kRowsPerThread;

    __device__ static int first_row(const Thread&) { return 0; }
    __device__ static const Thread& fragment(const Thread& me) { return me; }
    template <class Tiles>
    __device__ static void scores(Scores& s, const Tiles& t, const Thread& me, int d, Acc scale_log2) {
        mma_qk<Tr>(s, t.sQ, t.sK, me, d, scale_log2);
    }
    __device__ static void update(Softmax& softmax, Scores& s, Output& o, Acc) { softmax.update(s, o); }
    template <class Tiles>
    __device__ static void accumulate(Output& o, const Scores& s, const Tiles& t, const Thread& me) {
        mma_pv<Tr>(o, s, t.sP, t.sV, Tr::kHeadDimV, me);
    }
    template <typename Out>
    __device__ static void store(const Output& o, const Acc (&lse)[kStatRows], Out* out, int64_t out_row_stride,
                                 Acc* lse_out, int64_t lse_row_stride, const QueryBlock& block, const Thread& me,
                                 const FwdParams& p) {
        store_output<Tr>(o, lse, out, out_row_stride, lse_out, lse_row_stride, block, p, me);
    }
};

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(
    (SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kThreads),
    (SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kMinBlocksPerSm))
fwd_simt_kernel(const FwdParams params) {
    fwd_tile_loop<SimtFwdLoop<SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>>, T>(params);
}

// fwd_simt_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
constexpr int fwd_simt_kernel_smem() {
    return SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kSmemBytes;
}

}  // namespace cf
