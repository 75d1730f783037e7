// fwd_blocks.cuh -- the parts of the tensor-core forward kernels that do not
// depend on how the products are computed (fwd_mma.cu: mma.sync; fwd_wgmma.cu:
// wgmma): which key blocks a query block visits and which need the mask
// (score.cuh applies it), P re-packed as A operands, the
// K/V cp.async pipeline and the output epilogue.  Everything takes the
// kernel's traits Tr: kBlockM, kBlockN, kHeadDim, kThreads, kStages,
// kWarpRows, kMTiles, kRows, kSCols, kKeySteps, QTile and KVTile, with a
// warp's accumulators in mma_tile.cuh's register-tile layout.
#pragma once

#include "block_info.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

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

// The K/V pipeline: kStages buffer pairs in shared memory after the Q tile,
// filled by cp.async (keys beyond Lk and columns beyond d zero-filled), with
// the wait_group / __syncthreads pairing of each schedule (see the top).
// Every thread has at most one cp.async group in flight, so every wait is
// wait_group 0.  fwd_mma runs the whole schedule through it; fwd_wgmma, whose
// V trails K by one block, uses its buffers and copies (load) with a schedule
// of its own.
//
// kWholeKV: every key block is complete and d is the bucket (the dispatcher's
// whole-KV instantiations, for Lk a multiple of kBlockN): the copies skip
// the bounds (cp_async_tile's kWhole).
template <class Tr, typename T, bool kWholeKV = false>
struct KVPipeline {
    const FwdParams& p;
    KeyRows<T> k_src;  // a pointer, or a paged cache's pages (paged.cuh)
    KeyRows<T> v_src;
    T* buffers;     // kStages x (K, V)
    int n_end;      // one past the last key block
    int stage = 0;  // the pair holding the current block (always 0 with one pair)

    __device__ KVPipeline(const FwdParams& params, const KeyRows<T>& k, const KeyRows<T>& v, T* smem, int end)
        : p(params), k_src(k), v_src(v), buffers(smem), n_end(end) {}

    __device__ T* k(int s) const { return buffers + (2 * s) * Tr::KVTile::kElements; }
    __device__ T* v(int s) const { return buffers + (2 * s + 1) * Tr::KVTile::kElements; }
    __device__ const T* keys() const { return k(stage); }
    __device__ const T* values() const { return v(stage); }

    __device__ void load(T* dst, const KeyRows<T>& src, int64_t row_stride, int n_block) const {
        load_by<Tr::kThreads>(static_cast<int>(threadIdx.x), dst, src, row_stride, n_block);
    }
    // The same by threads 0 .. kCopyThreads - 1 of a group (fwd_wgmma's producer
    // warpgroup, kRolled: cp_async_tile_by's passes a loop).
    template <int kCopyThreads, bool kRolled = false>
    __device__ void load_by(int thread, T* dst, const KeyRows<T>& src, int64_t row_stride, int n_block) const {
        const int64_t n0 = static_cast<int64_t>(n_block) * Tr::kBlockN;
        cp_async_tile_by<kCopyThreads, typename Tr::KVTile, kWholeKV, kRolled>(thread, dst, src, n0, row_stride,
                                                                      QueryBlock::keys_in(p, n0, Tr::kBlockN),
                                                                      static_cast<int>(p.head_dim));
    }

    // Issue the first block's copies (K, and V with two stages) into the caller's open group.
    __device__ void start(int n_begin) const {
        load(k(0), k_src, p.k_row_stride, n_begin);
        if constexpr (Tr::kStages == 2) load(v(0), v_src, p.v_row_stride, n_begin);
    }

    // Issue the copies of query block m_block's Q tile (rows past Lq and columns
    // past d zero-filled) and of the first key block, and commit them as one group.
    __device__ void start_with_queries(T* sQ, const T* q, int m_block, int n_begin) const {
        const int64_t m0 = static_cast<int64_t>(m_block) * Tr::kBlockM;
        const int rows = static_cast<int>(min64(Tr::kBlockM, p.seqlen_q - m0));
        cp_async_tile<Tr::kThreads, typename Tr::QTile>(sQ, q, m0, p.q_row_stride, rows,
                                                        static_cast<int>(p.head_dim));
        start(n_begin);
        cp_async_commit();
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

// Split-KV: the warp's rows of one split's normalised output, in float, and
// their lse, straight from the accumulators (SplitSlice rows: head_dim_v
// floats, 8-byte aligned since the dispatcher gives fwd_mma a d = dv that is
// a multiple of 8).  Lane (g, t) holds columns 8 j + 2 t and 8 j + 2 t + 1 of
// rows g and g + 8 of each m16 tile: one 8-byte store per pair.
template <class Tr>
__device__ __forceinline__ void store_partial(const FwdParams& p, int batch, int head, int m_block, int row0,
                                              const float (&o)[Tr::kRows][Tr::kOCols],
                                              const float (&lse)[Tr::kRows]) {
    const SplitSlice<float> part(p, batch, head, blockIdx.y);
    const int64_t first_row = static_cast<int64_t>(m_block) * Tr::kBlockM + row0;
    const int rows_valid = static_cast<int>(min64(Tr::kWarpRows, p.seqlen_q - first_row));
    const int dv = static_cast<int>(p.head_dim_v);
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int row = 16 * (r >> 1) + 8 * (r & 1) + g;
        if (row >= rows_valid) continue;
        float* dst = part.o + (first_row + row) * dv;
#pragma unroll
        for (int j = 0; j < Tr::kOCols / 2; ++j) {
            const int col = 8 * j + 2 * t;
            if (col < dv) store_f32x2(dst + col, o[r][2 * j], o[r][2 * j + 1]);
        }
        if (t == 0) part.lse[first_row + row] = lse[r];
    }
}

// The epilogue of the tensor-core forwards: o /= l, then the call's output and
// lse (store_output) or, in a kSplit instantiation, the split's partial results
// (store_partial).
template <class Tr, bool kSplit, typename T, class Softmax>
__device__ __forceinline__ void finish_output(const FwdParams& p, int batch, int head, int m_block, int row0,
                                              T* sQ, Softmax& softmax, float (&o)[Tr::kRows][Tr::kOCols]) {
    float lse[Tr::kRows];
    softmax.normalize(o, lse);
    if constexpr (kSplit)
        store_partial<Tr>(p, batch, head, m_block, row0, o, lse);
    else
        store_output<Tr>(p, batch, head, m_block, row0, sQ, o, lse);
}

}  // namespace cf
