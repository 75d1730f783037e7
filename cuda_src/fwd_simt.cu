// fwd_simt.cu -- the portable forward kernel: FlashAttention-2 on CUDA cores.
//
// Any float type (half, bfloat16, float, double), any head dim up to the
// compile-time bucket.  A CTA owns kBlockM query rows of one (batch, head),
// keeps them in shared memory, and streams the visible K/V blocks through one
// shared buffer.  Per key block: S = Q K^T (in registers, scale * log2(e)
// folded in), mask if the block is partly admissible, online softmax with
// exp2, O += P V.  The normalisation by the row sum happens once, at the end.
//
// Thread layout (kThreads = 128): 8 consecutive lanes share kRowsPerThread
// query rows and split the columns among themselves --
//   query row  ii * 16 + row_group          (row_group = tid / 8, 0..15)
//   key column jj * 8 + lane_in_group       (of S and P)
//   chunk      qq * 8 + lane_in_group       (16-byte chunks of an O / V row)
// so row maxima and sums are reductions over 8 lanes (softmax.cuh), and the
// probabilities P travel to the P V product by warp shuffles, not through
// shared memory.  Shared tiles hold the accumulator type; Q and K rows are
// XOR-swizzled (tile_io.cuh) so the vector loads of the inner products are
// free of bank conflicts.
#pragma once

#include "block_info.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The (block_m, block_n)
// table with the reason for each row is in cupyflash/_kernels.py.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
struct SimtFwdTraits {
    using Acc = acc_t<T>;
    static constexpr int kThreads = 128;
    static constexpr int kLanesPerRow = 8;
    static constexpr int kRowGroups = kThreads / kLanesPerRow;
    static constexpr int kRowsPerThread = kBlockM / kRowGroups;
    static constexpr int kKeysPerThread = kBlockN / kLanesPerRow;
    static constexpr int kVec = Vec16<Acc>::kSize;
    static constexpr int kChunksPerThreadV = kHeadDimV / kVec / kLanesPerRow;

    using QLayout = SwizzledRows<Acc, kHeadDim>;
    using KLayout = SwizzledRows<Acc, kHeadDim>;

    static constexpr int kSmemQ = kBlockM * kHeadDim;  // elements of Acc
    static constexpr int kSmemKV = kBlockN * (kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV);
    static constexpr int kSmemBytes = (kSmemQ + kSmemKV) * static_cast<int>(sizeof(Acc));
    // Occupancy target, which sets the register cap (65536 / (128 * n)): 4
    // CTAs (16 warps) per SM -> 128 registers; tiles above 32 KB fit at most
    // 3 CTAs in an A100's 164 KB of shared memory anyway, so they may use 168.
    static constexpr int kMinBlocksPerSm = kSmemBytes > 32 * 1024 ? 3 : 4;

    static_assert(kBlockM % kRowGroups == 0, "block_m: a multiple of 16 query rows");
    static_assert(kBlockN % kLanesPerRow == 0, "block_n: a multiple of 8 keys");
    static_assert(kHeadDimV % (kVec * kLanesPerRow) == 0, "head_dim_v bucket: whole chunks per lane");
    static_assert(kSmemBytes <= 48 * 1024, "stay within the default dynamic shared memory limit");
};

// This thread's place in the layout described at the top of the file.
template <class Tr>
struct SimtThread {
    int row_group, lane_in_group;

    __device__ SimtThread()
        : row_group(static_cast<int>(threadIdx.x) / Tr::kLanesPerRow),
          lane_in_group(static_cast<int>(threadIdx.x) % Tr::kLanesPerRow) {}

    __device__ int row(int ii) const { return ii * Tr::kRowGroups + row_group; }
    __device__ int key(int jj) const { return jj * Tr::kLanesPerRow + lane_in_group; }
    __device__ int chunk_v(int qq) const { return qq * Tr::kLanesPerRow + lane_in_group; }
};

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
        for (int jj = 0; jj < TN; ++jj) b[jj] = load_vec16(sK + Tr::KLayout::chunk(me.key(jj), q));
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

// Scores of keys row `m0 + row` may not see (window, causal, beyond Lk) -> -inf.
template <class Tr, typename Acc>
__device__ __forceinline__ void apply_mask(Acc (&s)[Tr::kRowsPerThread][Tr::kKeysPerThread],
                                           const WindowMask& mask, int64_t m0, int64_t n0,
                                           const SimtThread<Tr>& me) {
#pragma unroll
    for (int ii = 0; ii < Tr::kRowsPerThread; ++ii) {
        int lo, hi;
        mask.row_range(m0 + me.row(ii), n0, Tr::kKeysPerThread * Tr::kLanesPerRow, lo, hi);
#pragma unroll
        for (int jj = 0; jj < Tr::kKeysPerThread; ++jj) {
            const int c = me.key(jj);
            if (c < lo || c >= hi) s[ii][jj] = neg_inf<Acc>();
        }
    }
}

// o += P V.  Key column jj * 8 + src of P lives in lane `src` of this
// thread's 8-lane group; it is broadcast to the group with a shuffle.
template <class Tr, typename Acc>
__device__ __forceinline__ void mma_pv(
    Acc (&o)[Tr::kRowsPerThread][Tr::kChunksPerThreadV][Tr::kVec],
    const Acc (&p)[Tr::kRowsPerThread][Tr::kKeysPerThread], const Acc* sV, int v_cols,
    const SimtThread<Tr>& me) {
    constexpr int TM = Tr::kRowsPerThread;
    const int group_base = lane_id() & ~(Tr::kLanesPerRow - 1);
#pragma unroll
    for (int jj = 0; jj < Tr::kKeysPerThread; ++jj) {
        // One key per iteration keeps one V row slice live, not kKeysPerThread of them.
#pragma unroll 1
        for (int src = 0; src < Tr::kLanesPerRow; ++src) {
            const int key = jj * Tr::kLanesPerRow + src;
            Acc pk[TM];
#pragma unroll
            for (int ii = 0; ii < TM; ++ii) pk[ii] = shfl(p[ii][jj], group_base + src);
#pragma unroll
            for (int qq = 0; qq < Tr::kChunksPerThreadV; ++qq) {
                const Vec16<Acc> v = load_vec16(sV + key * v_cols + me.chunk_v(qq) * Tr::kVec);
#pragma unroll
                for (int ii = 0; ii < TM; ++ii)
#pragma unroll
                    for (int e = 0; e < Tr::kVec; ++e) o[ii][qq][e] += pk[ii] * v.x[e];
            }
        }
    }
}

// Write this thread's rows of the (already normalised) output, and lse.
template <class Tr, typename T, typename Acc>
__device__ __forceinline__ void store_output(
    const Acc (&o)[Tr::kRowsPerThread][Tr::kChunksPerThreadV][Tr::kVec],
    const Acc (&lse)[Tr::kRowsPerThread], const HeadSlice<T, Acc>& head, const QueryBlock& block,
    const FwdParams& p, const SimtThread<Tr>& me) {
#pragma unroll
    for (int ii = 0; ii < Tr::kRowsPerThread; ++ii) {
        if (me.row(ii) >= block.rows) continue;
        const int64_t i = block.m0 + me.row(ii);
        T* out_row = head.out + i * p.out_row_stride;
#pragma unroll
        for (int qq = 0; qq < Tr::kChunksPerThreadV; ++qq) {
            const int col = me.chunk_v(qq) * Tr::kVec;
            store_run(out_row + col, o[ii][qq], static_cast<int>(p.head_dim_v) - col);
        }
        if (head.lse != nullptr && me.lane_in_group == 0) head.lse[i * p.lse_row_stride] = lse[ii];
    }
}

template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(
    (SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kThreads),
    (SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kMinBlocksPerSm))
fwd_simt_kernel(const FwdParams params) {
    using Tr = SimtFwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
    using Acc = typename Tr::Acc;
    constexpr int TM = Tr::kRowsPerThread;

    const TileIndex tile(params, kBlockM, blockIdx.x);
    const HeadSlice<T, Acc> head(params, tile.batch, tile.head);
    const WindowMask mask(params);
    const QueryBlock block(params, mask, tile.m_block * kBlockM, kBlockM);
    const SimtThread<Tr> me;
    const Acc scale_log2 = static_cast<Acc>(params.scale_log2);
    const int d = static_cast<int>(params.head_dim), dv = static_cast<int>(params.head_dim_v);

    Acc* sQ = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sKV = sQ + Tr::kSmemQ;  // K, then V, of the current key block
    load_tile<Tr::kThreads>(sQ, typename Tr::QLayout{}, head.q + block.m0 * params.q_row_stride,
                            params.q_row_stride, kBlockM, kHeadDim, block.rows, d);

    OnlineSoftmax<Acc, TM, Tr::kLanesPerRow> softmax;
    Acc o[TM][Tr::kChunksPerThreadV][Tr::kVec] = {};
    Acc s[TM][Tr::kKeysPerThread];

    const int64_t n_end = block.n_end(kBlockN);
    for (int64_t n_block = block.n_begin(kBlockN); n_block < n_end; ++n_block) {
        const int64_t n0 = n_block * kBlockN;
        const int keys = QueryBlock::keys_in(params, n0, kBlockN);

        load_tile<Tr::kThreads>(sKV, typename Tr::KLayout{}, head.k + n0 * params.k_row_stride,
                                params.k_row_stride, kBlockN, kHeadDim, keys, d);
        __syncthreads();
        mma_qk<Tr>(s, sQ, sKV, me, d, scale_log2);
        if (block.needs_mask(mask, n0, kBlockN)) apply_mask<Tr>(s, mask, block.m0, n0, me);
        softmax.update(s, o);
        __syncthreads();  // K fully read: its buffer takes V

        load_tile<Tr::kThreads>(sKV, PlainRows{kHeadDimV}, head.v + n0 * params.v_row_stride,
                                params.v_row_stride, kBlockN, kHeadDimV, keys, dv);
        __syncthreads();
        mma_pv<Tr>(o, s, sKV, kHeadDimV, me);
        __syncthreads();  // V fully read: the buffer takes the next K
    }

    Acc lse[TM];
    softmax.normalize(o, lse);
    store_output<Tr>(o, lse, head, block, params, me);
}

}  // namespace cf
