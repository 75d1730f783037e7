// fwd_mma.cu -- the tensor-core forward kernel: FlashAttention-2 with mma.sync
// m16n8k16 (float16 / bfloat16 inputs, float32 accumulation), sm_80 and later.
//
// A CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps
// owns kBlockM / kWarps of those rows (16 per m16 tile, FA2's split of Q
// across warps: no reduction between warps).  Q is copied once to shared
// memory; K and V blocks of kBlockN keys stream through shared memory with
// cp.async.  Per key block, every warp computes
//     S = Q K^T * scale * log2(e)      ldmatrix + mma, scores stay in registers
//     mask                             only on blocks that cross a mask boundary
//     m, l, O rescale, P = exp2(S - m) softmax.cuh, quad shuffles (xor 1, 2)
//     O += P V                         P re-packed in registers as the A operand
// and divides O by l once, at the end.  O is staged through the (no longer
// needed) Q tile and written with 16-byte stores.
//
// K/V pipelines (kStages):
//   2  double buffer: while block j is computed, block j+1's K and V land in
//      the other buffer pair (one barrier per block).
//   1  one K and one V buffer, as FA2: V_j lands during S = Q K_j^T and the
//      softmax, K_{j+1} during O += P V_j (two barriers per block); less
//      shared memory, so more CTAs per SM where shared memory is the limit.
// Every shared tile uses the swizzled layout of mma_tile.cuh.  Rows and head
// dims are padded inside the kernel: tails and columns beyond the run-time d
// are zero-filled by cp.async and never stored.  The dispatcher guarantees
// 16-byte aligned row starts (cupyflash/_gpu.py).
#pragma once

#include "block_info.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "softmax.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  The table of
// (head dim -> tiles, warps, stages) with the reason for each row is
// _MMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_>
struct MmaFwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kWarps = kWarps_, kStages = kStages_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
    static constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;           // accumulator rows per lane
    static constexpr int kSCols = 2 * (kBlockN / 8);    // score columns per lane and row
    static constexpr int kOCols = 2 * (kHeadDim / 8);   // output columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of S = Q K^T
    static constexpr int kKeySteps = kBlockN / 16;      // k16 steps of O = P V

    using QTile = SwizzledTile<kBlockM, kHeadDim>;      // Q, later the output staging
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;

    // Shared memory (elements of T): Q, then kStages x (K, V).
    static constexpr int kQElems = QTile::kElements;
    static constexpr int kKVElems = KVTile::kElements;
    static constexpr int kSmemBytes = (kQElems + 2 * kStages * kKVElems) * static_cast<int>(sizeof(T));
    // __launch_bounds__ minimum CTAs per SM: two CTAs of up to 4 warps leave
    // every thread the 255-register maximum, so this never caps registers; it
    // states the occupancy the tile table aims for.
    static constexpr int kMinBlocksPerSm = kWarps <= 4 ? 2 : 1;

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kBlockM % (16 * kWarps) == 0, "block_m: whole m16 tiles per warp");
    static_assert(kBlockN % 16 == 0, "block_n: whole k16 steps of P V");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim bucket: 32 .. 256, multiple of 32");
    static_assert(kStages == 1 || kStages == 2, "kStages: 1 (K/V interleaved) or 2 (double buffer)");
    static_assert(kSmemBytes <= 99 * 1024, "within sm_86 / sm_89's 99 KB per block");
};

// s = (Q K^T) * scale_log2 for the warp's rows (from row0 of the Q tile) and the key block.
template <class Tr, typename T>
__device__ __forceinline__ void mma_qk(float (&s)[Tr::kRows][Tr::kSCols], const T* sQ, const T* sK,
                                       int row0, float scale_log2) {
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) s[r][c] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
        uint32_t a[Tr::kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi)
            ldmatrix_a<typename Tr::QTile>(a[mi], sQ, row0 + 16 * mi, ks);
#pragma unroll
        for (int np = 0; np < Tr::kBlockN / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_nk<typename Tr::KVTile>(b, sK, 16 * np, ks);
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                mma_into<T>(s, mi, 2 * np, a[mi], b[0], b[1]);
                mma_into<T>(s, mi, 2 * np + 1, a[mi], b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) s[r][c] *= scale_log2;
}

// Scores of keys a row may not see (window, causal, beyond Lk) -> -inf.
// first_row is the global index of the warp's first query row.
template <class Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kRows][Tr::kSCols], const WindowMask& mask,
                                           int64_t first_row, int64_t n0) {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        int lo, hi;
        mask.row_range(first_row + 16 * (r >> 1) + 8 * (r & 1) + g, n0, Tr::kBlockN, lo, hi);
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) {
            const int key = 8 * (c >> 1) + 2 * t + (c & 1);
            if (key < lo || key >= hi) s[r][c] = neg_inf<float>();
        }
    }
}

// o += P V, with P (the probabilities in s) as the A operand straight from registers.
template <class Tr, typename T>
__device__ __forceinline__ void mma_pv(float (&o)[Tr::kRows][Tr::kOCols],
                                       const float (&p)[Tr::kRows][Tr::kSCols], const T* sV) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
        uint32_t a[Tr::kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) accumulator_to_a<T>(a[mi], p, mi, kk);
#pragma unroll
        for (int np = 0; np < Tr::kHeadDim / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_kn<typename Tr::KVTile>(b, sV, 16 * kk, np);
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                mma_into<T>(o, mi, 2 * np, a[mi], b[0], b[1]);
                mma_into<T>(o, mi, 2 * np + 1, a[mi], b[2], b[3]);
            }
        }
    }
}

// Shared-memory buffers of one CTA.
template <class Tr, typename T>
struct MmaSmem {
    T* q;
    T* kv;  // kStages x (K, V)

    __device__ MmaSmem() : q(reinterpret_cast<T*>(dynamic_smem())), kv(q + Tr::kQElems) {}
    __device__ T* k(int stage) const { return kv + (2 * stage) * Tr::kKVElems; }
    __device__ T* v(int stage) const { return kv + (2 * stage + 1) * Tr::kKVElems; }
};

// Issue the copies of the K or V rows of key block n_block (keys beyond Lk and
// columns beyond d zero-filled).
template <class Tr, typename T>
__device__ __forceinline__ void load_kv(T* dst, const T* src, int64_t row_stride, const FwdParams& p,
                                        int64_t n_block, int d) {
    const int64_t n0 = n_block * Tr::kBlockN;
    cp_async_tile<Tr::kThreads, typename Tr::KVTile>(dst, src + n0 * row_stride, row_stride,
                                                     QueryBlock::keys_in(p, n0, Tr::kBlockN), d);
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages>
__global__ void __launch_bounds__(
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages>::kThreads),
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages>::kMinBlocksPerSm))
fwd_mma_kernel(const FwdParams params) {
    using Tr = MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages>;

    // Query blocks in reverse order: under a causal mask the last ones see the
    // most keys, and starting them first evens out the tail of the grid.
    const TileIndex tile(params, kBlockM, blockIdx.x);
    const int64_t num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
    const HeadSlice<T, float> head(params, tile.batch, tile.head);
    const WindowMask mask(params);
    const QueryBlock block(params, mask, (num_m_blocks - 1 - tile.m_block) * kBlockM, kBlockM);
    const MmaSmem<Tr, T> smem;
    const int d = static_cast<int>(params.head_dim);
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile

    OnlineSoftmax<float, Tr::kRows, 4> softmax;
    float o[Tr::kRows][Tr::kOCols] = {};
    float s[Tr::kRows][Tr::kSCols];

    const int64_t n_begin = block.n_begin(kBlockN), n_end = block.n_end(kBlockN);
    if (n_begin < n_end) {
        cp_async_tile<Tr::kThreads, typename Tr::QTile>(smem.q, head.q + block.m0 * params.q_row_stride,
                                                        params.q_row_stride, block.rows, d);
        load_kv<Tr>(smem.k(0), head.k, params.k_row_stride, params, n_begin, d);
        if constexpr (kStages == 2) load_kv<Tr>(smem.v(0), head.v, params.v_row_stride, params, n_begin, d);
        cp_async_commit();
    }
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int64_t n0 = n_block * kBlockN;
        const bool has_next = n_block + 1 < n_end;
        // With one buffer pair the stage is always 0.
        const int stage = kStages == 2 ? static_cast<int>((n_block - n_begin) & 1) : 0;
        const T* sK = smem.k(stage);
        const T* sV = smem.v(stage);

        cp_async_wait<0>();
        __syncthreads();  // block j's K (and V) visible to all; every warp done with block j-1
        if constexpr (kStages == 2) {
            if (has_next) {
                load_kv<Tr>(smem.k(stage ^ 1), head.k, params.k_row_stride, params, n_block + 1, d);
                load_kv<Tr>(smem.v(stage ^ 1), head.v, params.v_row_stride, params, n_block + 1, d);
            }
        } else {
            load_kv<Tr>(smem.v(0), head.v, params.v_row_stride, params, n_block, d);
        }
        cp_async_commit();

        mma_qk<Tr>(s, smem.q, sK, row0, scale_log2);
        if (block.needs_mask(mask, n0, kBlockN)) apply_mask<Tr>(s, mask, block.m0 + row0, n0);
        softmax.update(s, o);

        if constexpr (kStages == 1) {
            cp_async_wait<0>();
            __syncthreads();  // V_j visible to all; every warp done with K_j
            if (has_next) {
                load_kv<Tr>(smem.k(0), head.k, params.k_row_stride, params, n_block + 1, d);
                cp_async_commit();
            }
        }
        mma_pv<Tr>(o, s, sV);
    }

    float lse[Tr::kRows];
    softmax.normalize(o, lse);

    // Each warp stages its own rows in its own rows of the Q tile (read only by
    // this warp), then writes them out; the warp's lanes swap data, hence the
    // warp barriers.
    __syncwarp();
    store_accumulators<typename Tr::QTile>(smem.q, o, row0);
    __syncwarp();
    const int rows_valid = block.rows - row0;
    store_rows<Tr::kWarpRows, typename Tr::QTile>(head.out + (block.m0 + row0) * params.out_row_stride,
                                                  params.out_row_stride, smem.q, row0, rows_valid,
                                                  static_cast<int>(params.head_dim_v));
    if (head.lse != nullptr && (lane_id() & 3) == 0) {
        const int g = lane_id() >> 2;
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r) {
            const int row = 16 * (r >> 1) + 8 * (r & 1) + g;
            if (row < rows_valid) head.lse[(block.m0 + row0 + row) * params.lse_row_stride] = lse[r];
        }
    }
}

}  // namespace cf
