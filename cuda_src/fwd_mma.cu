// fwd_mma.cu -- the tensor-core forward kernel: FlashAttention-2 with mma.sync
// m16n8k16 (float16 / bfloat16 inputs, float32 accumulation), sm_80 and later.
//
// A CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps
// owns kBlockM / kWarps of those rows (16 per m16 tile, FA2's split of Q
// across warps: no reduction between warps).  Q is copied once to shared
// memory; K and V blocks of kBlockN keys stream through shared memory with
// cp.async (KVPipeline).  Per key block, every warp computes
//     S = Q K^T                        ldmatrix + mma, scores stay in registers
//     mask                             only on blocks that cross a mask boundary
//     m, l, O rescale, P = exp2(S * scale * log2(e) - m)
//                                      softmax.cuh (one FFMA per score), quad shuffles;
//                                      with kLazyRescale, m moves (and O is rescaled)
//                                      only when a warp's row max grows by 2^8 or more
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
// 16-byte aligned row starts and dv == d (cupyflash/_gpu.py).
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
template <typename T, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          bool kLazyRescale_>
struct MmaFwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kWarps = kWarps_, kStages = kStages_;
    // Rescale o and l only when a row maximum of the warp moves far
    // (OnlineSoftmax::update_unscaled); off where its registers would spill.
    static constexpr bool kLazyRescale = kLazyRescale_;
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

    // Shared memory: Q, then kStages x (K, V) (KVPipeline).
    static constexpr int kSmemBytes =
        (QTile::kElements + 2 * kStages * KVTile::kElements) * static_cast<int>(sizeof(T));
    // __launch_bounds__ minimum CTAs per SM: two CTAs of up to 4 warps leave
    // every thread the 255-register maximum, so this never caps registers; it
    // states the occupancy the tile table aims for.
    static constexpr int kMinBlocksPerSm = kWarps <= 4 ? 2 : 1;

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kBlockM % (16 * kWarps) == 0, "block_m: whole m16 tiles per warp");
    static_assert(kBlockN % 16 == 0, "block_n: whole k16 steps of P V");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim bucket: 32 .. 256, multiple of 32");
    static_assert(kStages == 1 || kStages == 2, "kStages: 1 (K/V interleaved) or 2 (double buffer)");
    // the per-architecture tables keep sm_86 / sm_89 tiles within their 99 KB
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// s = Q K^T (unscaled: the softmax folds the scale in) for the warp's rows (from row0 of the Q tile) and the key block.
template <class Tr, typename T>
__device__ __forceinline__ void mma_qk(float (&s)[Tr::kRows][Tr::kSCols], const T* sQ, const T* sK,
                                       int row0) {
    mma_abt<typename Tr::QTile, typename Tr::KVTile, Tr::kMTiles, Tr::kBlockN, Tr::kKSteps>(s, sQ, sK, row0);
}

// WindowMask's rule for the rows of one warp and one key block, in 32-bit
// offsets relative to the block: key n0 + c is admissible for row
// first_row + ri iff lo(ri) <= c < hi(ri).  The 64-bit bounds (the window
// sides may be kUnbounded) are clamped to +-2^30 once per block; adding a row
// offset below 2^16 to a clamped value cannot change whether it lies in
// [0, kBlockN].  Keeps the masking step, which runs while the scores and the
// output accumulators are all live, to a few 32-bit registers.
struct BlockMask {
    int lo_base, hi_base, keys;

    __device__ BlockMask(const FwdParams& p, int64_t first_row, int64_t n0, int block_n) {
        const int64_t aligned = first_row + (p.seqlen_k - p.seqlen_q) - n0;  // row 0's diagonal key - n0
        lo_base = clamp30(aligned - p.window_left);
        hi_base = clamp30(aligned + p.window_right + 1);
        keys = static_cast<int>(min64(p.seqlen_k - n0, block_n));
    }
    __device__ static int clamp30(int64_t x) {
        constexpr int64_t kLimit = int64_t(1) << 30;
        return static_cast<int>(x < -kLimit ? -kLimit : x > kLimit ? kLimit : x);
    }
    __device__ int lo(int ri) const { return lo_base + ri; }
    __device__ int hi(int ri) const { return min(hi_base + ri, keys); }
};

// Scores of keys a row may not see (window, causal, beyond Lk) -> -inf.
template <class Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kRows][Tr::kSCols], const BlockMask& mask) {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int ri = 16 * (r >> 1) + 8 * (r & 1) + g;
        const int lo = mask.lo(ri), hi = mask.hi(ri);
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c) {
            const int key = 8 * (c >> 1) + 2 * t + (c & 1);
            if (key < lo || key >= hi) s[r][c] = neg_inf<float>();
        }
    }
}

// The key blocks [full_begin, full_end) that every row of the query block
// sees completely (QueryBlock::needs_mask is false exactly there): the admissible
// range of keys only grows with the row, so the blocks needing the mask are
// those below the last row's first key and those past the first row's last
// key.  Two numbers carried through the main loop instead of the mask state.
// Key block indices are 32-bit (launch_config checks Lk / block_n < 2^31).
struct UnmaskedBlocks {
    int full_begin, full_end;

    __device__ UnmaskedBlocks(const WindowMask& mask, const QueryBlock& block, int block_n)
        : full_begin(static_cast<int>((mask.first_key(block.m0 + block.rows - 1) + block_n - 1) / block_n)),
          full_end(static_cast<int>((mask.last_key(block.m0) + 1) / block_n)) {}  // <= 0: none complete

    __device__ bool needs_mask(int n_block) const { return n_block < full_begin || n_block >= full_end; }
};

// The key blocks [n_begin, n_end) query block m_block visits, and which of them need the mask.
template <class Tr>
__device__ __forceinline__ UnmaskedBlocks key_blocks(const FwdParams& p, int m_block, int& n_begin,
                                                     int& n_end) {
    const WindowMask mask(p);
    const QueryBlock block(p, mask, static_cast<int64_t>(m_block) * Tr::kBlockM, Tr::kBlockM);
    n_begin = static_cast<int>(block.n_begin(Tr::kBlockN));
    n_end = static_cast<int>(block.n_end(Tr::kBlockN));
    return UnmaskedBlocks(mask, block, Tr::kBlockN);
}

// The probabilities as A operands of P V, rounded to T and packed straight
// from the score accumulators (half the registers of the float scores).
template <class Tr, typename T>
__device__ __forceinline__ void scores_to_a(uint32_t (&a)[Tr::kKeySteps][Tr::kMTiles][4],
                                            const float (&p)[Tr::kRows][Tr::kSCols]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk)
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) accumulator_to_a<T>(a[kk][mi], p, mi, kk);
}

// o += P V, with P as A operands already in registers.
template <class Tr, typename T>
__device__ __forceinline__ void mma_pv(float (&o)[Tr::kRows][Tr::kOCols],
                                       const uint32_t (&a)[Tr::kKeySteps][Tr::kMTiles][4], const T* sV) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
#pragma unroll
        for (int np = 0; np < Tr::kHeadDim / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_kn<typename Tr::KVTile>(b, sV, 16 * kk, np);
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                mma_into<T>(o, mi, 2 * np, a[kk][mi], b[0], b[1]);
                mma_into<T>(o, mi, 2 * np + 1, a[kk][mi], b[2], b[3]);
            }
        }
    }
}

// The K/V pipeline: kStages buffer pairs in shared memory after the Q tile,
// filled by cp.async (keys beyond Lk and columns beyond d zero-filled), with
// the wait_group / __syncthreads pairing of each schedule (see the top).
// Every thread has at most one cp.async group in flight, so every wait is
// wait_group 0.
template <class Tr, typename T>
struct KVPipeline {
    const FwdParams& p;
    const T* k_src;
    const T* v_src;
    T* buffers;     // kStages x (K, V)
    int n_end;      // one past the last key block
    int stage = 0;  // the pair holding the current block (always 0 with one pair)

    __device__ KVPipeline(const FwdParams& params, const T* k, const T* v, T* smem, int end)
        : p(params), k_src(k), v_src(v), buffers(smem), n_end(end) {}

    __device__ T* k(int s) const { return buffers + (2 * s) * Tr::KVTile::kElements; }
    __device__ T* v(int s) const { return buffers + (2 * s + 1) * Tr::KVTile::kElements; }
    __device__ const T* keys() const { return k(stage); }
    __device__ const T* values() const { return v(stage); }

    __device__ void load(T* dst, const T* src, int64_t row_stride, int n_block) const {
        const int64_t n0 = static_cast<int64_t>(n_block) * Tr::kBlockN;
        cp_async_tile<Tr::kThreads, typename Tr::KVTile>(dst, src, n0, row_stride,
                                                         QueryBlock::keys_in(p, n0, Tr::kBlockN),
                                                         static_cast<int>(p.head_dim));
    }

    // Issue the first block's copies (K, and V with two stages) into the caller's open group.
    __device__ void start(int n_begin) const {
        load(k(0), k_src, p.k_row_stride, n_begin);
        if constexpr (Tr::kStages == 2) load(v(0), v_src, p.v_row_stride, n_begin);
    }

    // Before S = Q K^T of block n_block: its K (and V) visible to every thread,
    // every warp done with the previous block; then the next copies go out --
    // block n_block + 1's K and V (two stages) or this block's V (one stage).
    __device__ void await_keys(int n_block) const {
        cp_async_wait<0>();
        __syncthreads();
        if constexpr (Tr::kStages == 2) {
            if (n_block + 1 < n_end) {
                load(k(stage ^ 1), k_src, p.k_row_stride, n_block + 1);
                load(v(stage ^ 1), v_src, p.v_row_stride, n_block + 1);
            }
        } else {
            load(v(0), v_src, p.v_row_stride, n_block);
        }
        cp_async_commit();
    }

    // Before O += P V of block n_block (one stage only): its V visible to every
    // thread, every warp done with its K, which then takes block n_block + 1's.
    __device__ void await_values(int n_block) const {
        if constexpr (Tr::kStages == 1) {
            cp_async_wait<0>();
            __syncthreads();
            if (n_block + 1 < n_end) {
                load(k(0), k_src, p.k_row_stride, n_block + 1);
                cp_async_commit();
            }
        }
    }

    __device__ void advance() {
        if constexpr (Tr::kStages == 2) stage ^= 1;
    }
};

// The warp's rows of the normalised output (rounded to T) and their lse.
// Each warp stages its own rows in its own rows of the Q tile (read by no
// other warp), then writes whole 16-byte chunks of them; its lanes exchange
// data through shared memory, hence the warp barriers.
template <class Tr, typename T>
__device__ __forceinline__ void store_output(const FwdParams& p, int batch, int head, int m_block, int row0,
                                             T* sQ, const float (&o)[Tr::kRows][Tr::kOCols],
                                             const float (&lse)[Tr::kRows]) {
    __syncwarp();
    store_accumulators<typename Tr::QTile>(sQ, o, row0);
    __syncwarp();
    const HeadSlice<T, float> out(p, batch, head);
    const int64_t first_row = static_cast<int64_t>(m_block) * Tr::kBlockM + row0;
    const int rows_valid = static_cast<int>(min64(Tr::kWarpRows, p.seqlen_q - first_row));
    store_rows<Tr::kWarpRows, typename Tr::QTile>(out.out + first_row * p.out_row_stride, p.out_row_stride,
                                                  sQ, row0, rows_valid, static_cast<int>(p.head_dim_v));
    if (out.lse != nullptr && (lane_id() & 3) == 0) {
        const int g = lane_id() >> 2;
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r) {
            const int row = 16 * (r >> 1) + 8 * (r & 1) + g;
            if (row < rows_valid) out.lse[(first_row + row) * p.lse_row_stride] = lse[r];
        }
    }
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kLazyRescale>
__global__ void __launch_bounds__(
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>::kThreads),
    (MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>::kMinBlocksPerSm))
fwd_mma_kernel(const FwdParams params) {
    using Tr = MmaFwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kLazyRescale>;

    // The main loop runs at the register limit, so only 32-bit indices and the
    // K/V pointers live across it; everything else is derived where it is used.
    // TileIndex hands out the last query blocks (the most keys under a causal
    // mask) first.
    const TileIndex tile(params, kBlockM, blockIdx.x);
    const int batch = static_cast<int>(tile.batch), head = static_cast<int>(tile.head);
    const int m_block = static_cast<int>(tile.m_block);
    const HeadSlice<T, float> in(params, batch, head);  // q, k, v (out and lse: after the loop)
    T* const sQ = reinterpret_cast<T*>(dynamic_smem());  // Q, later the output staging
    const float scale_log2 = static_cast<float>(params.scale_log2);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile

    int n_begin, n_end;
    const UnmaskedBlocks unmasked = key_blocks<Tr>(params, m_block, n_begin, n_end);
    KVPipeline<Tr, T> kv(params, in.k, in.v, sQ + Tr::QTile::kElements, n_end);
    if (n_begin < n_end) {
        const int64_t m0 = static_cast<int64_t>(m_block) * kBlockM;
        const int rows = static_cast<int>(min64(kBlockM, params.seqlen_q - m0));
        cp_async_tile<Tr::kThreads, typename Tr::QTile>(sQ, in.q, m0, params.q_row_stride, rows,
                                                        static_cast<int>(params.head_dim));
        kv.start(n_begin);
        cp_async_commit();
    }

    OnlineSoftmax<float, Tr::kRows, 4> softmax;
    float o[Tr::kRows][Tr::kOCols] = {};
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        float s[Tr::kRows][Tr::kSCols];
        kv.await_keys(n_block);
        mma_qk<Tr>(s, sQ, kv.keys(), row0);
        if (unmasked.needs_mask(n_block))
            apply_mask<Tr>(s, BlockMask(params, static_cast<int64_t>(m_block) * kBlockM + row0,
                                        static_cast<int64_t>(n_block) * kBlockN, kBlockN));
        softmax.template update_unscaled<Tr::kLazyRescale>(s, o, scale_log2);
        uint32_t p[Tr::kKeySteps][Tr::kMTiles][4];
        scores_to_a<Tr, T>(p, s);
        kv.await_values(n_block);
        mma_pv<Tr>(o, p, kv.values());
        kv.advance();
    }

    float lse[Tr::kRows];
    softmax.normalize(o, lse);

    store_output<Tr>(params, batch, head, m_block, row0, sQ, o, lse);
}

}  // namespace cf
