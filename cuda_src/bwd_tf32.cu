// bwd_tf32.cu -- the float32 backward on tensor cores, when the caller allows
// TF32 (attention_backward(..., precision="tf32" or "tf32x3")): FlashAttention-2's
// backward with mma.sync m16n8k8 .tf32 and float32 accumulation, sm_80 and later.
//
// The algorithm and the launch order are bwd_dmma's (bwd_simt's delta kernel
// runs first): with P recomputed from the forward's lse,
//     P  = exp2(S * scale * log2(e) - lse * log2(e))      S = Q K^T
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - delta)
//     dK = scale * dS^T Q                   dQ = scale * dS K
// every product on the TF32 tensor cores in kPasses MMAs (1: operands rounded
// to TF32; 3: split into two TF32 parts, errors of the order of float32
// arithmetic's -- tf32_tile.cuh).  Two kernels:
//   bwd_tf32_dkdv_kernel  a CTA owns kOwn keys of one kv head (K, V in shared
//                         memory, dK, dV in registers) and streams the query
//                         blocks that see them, head by head through the kv
//                         head's query group;
//   bwd_tf32_dq_kernel    a CTA owns kOwn query rows (Q, dO in shared memory,
//                         dQ in registers) and streams the key blocks they see.
// Every gradient element is summed by one lane in a fixed order, so results
// are bit-identical from run to run; there is no atomic variant
// (deterministic=False runs the same kernels).
//
// Each of the kWarps warps owns kWarpRows = kOwn / kWarps of the CTA's rows
// (kMTiles m16 tiles).  Per streamed block of kStream rows a warp computes
//     X = Own Stream^T    tf32_abt (S^T = K Q^T, dP^T = V dO^T; S = Q K^T,
//                         dP = dO V^T): both tiles read by rows
//     G += X' Stream      tf32_accumulate (dV += P^T dO, dK += dS^T Q;
//                         dQ += dS K): X' from the accumulators in place,
//                         the streamed tile read by columns
// so the streamed tiles are read both ways: every tile uses Tf32BothRows,
// free of bank conflicts for both.  The streamed tiles are double-buffered by
// cp.async: the next block's copy runs while this one is computed.  The
// dispatcher (cupyflash/_gpu_bwd.py) gives these kernels float32 with d = dv
// up to 128 on sm_80+ (rows not 16-byte aligned are copied a word at a time);
// columns past the run-time d are zero-filled by cp.async.
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "tf32_tile.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation: kOwn rows stay in shared
// memory for the whole CTA, kStream rows are reloaded per block.  The tile
// table with the reason for each row is _BWD_TF32_TILES in cupyflash/_kernels.py.
template <int kHeadDim_, int kOwn_, int kStream_, int kWarps_, int kPasses_>
struct Tf32BwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kOwnRows = kOwn_, kStreamRows = kStream_, kWarps = kWarps_;
    static constexpr int kPasses = kPasses_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kOwnRows / kWarps;  // own rows per warp
    static constexpr int kMTiles = kWarpRows / 16;       // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;            // accumulator rows per lane
    static constexpr int kNTiles = kStreamRows / 8;      // n8 tiles of S, dP
    static constexpr int kSCols = 2 * kNTiles;           // S, dP columns per lane and row
    static constexpr int kGCols = kHeadDim / 4;          // gradient columns per lane and row

    using Layout = Tf32BothRows<kHeadDim>;
    // Shared memory (floats): the two own tiles, then two stages of the two streamed tiles.
    static constexpr int kStages = 2;
    static constexpr int kOwnTile = kOwnRows * kHeadDim, kStreamTile = kStreamRows * kHeadDim;
    static constexpr int kSmemBytes = (2 * kOwnTile + 2 * kStages * kStreamTile) * static_cast<int>(sizeof(float));
    // __launch_bounds__ minimum CTAs per SM: 2 leaves every thread the 255-register maximum.
    static constexpr int kMinBlocksPerSm = 2;

    static_assert(kPasses == 1 || kPasses == 3, "kPasses: 1 (tf32) or 3 (tf32x3)");
    static_assert(kOwnRows % (16 * kWarps) == 0, "own block: whole m16 tiles per warp");
    static_assert(kStreamRows % 8 == 0, "streamed block: whole n8 tiles");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "head dim bucket: 32, 64 or 128");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");
};

// x = X Y^T: the warp's rows of the own tile sX (from row0) by every row of the
// streamed tile sY, 32 columns per unrolled iteration (16 at d = 32): fully
// unrolled, the dK/dV kernels' fragment loads spill 8-12 bytes on sm_80 at
// d = 64, and at d = 32 the three-pass one spills 8-44 bytes (NVRTC 13.5, 13.0, 12.0).
template <class Tr>
__device__ __forceinline__ void tf32_row_products(float (&x)[Tr::kRows][Tr::kSCols], const float* sX,
                                                  const float* sY, int row0) {
    constexpr int kUnroll = Tr::kHeadDim > 32 ? 2 : 1;
    tf32_abt<Tr::kPasses, Tr::kMTiles, Tr::kNTiles, Tr::kHeadDim, typename Tr::Layout, typename Tr::Layout, kUnroll>(
        x, sX, sY, row0);
}

// grad += X Z: X the warp's rows by the streamed rows (tf32_row_products' shape), Z the streamed tile.
template <class Tr>
__device__ __forceinline__ void tf32_grad(float (&grad)[Tr::kRows][Tr::kGCols], const float (&x)[Tr::kRows][Tr::kSCols],
                                          const float* sZ) {
    tf32_accumulate<Tr::kPasses, Tr::kMTiles, Tr::kNTiles, Tr::kHeadDim, typename Tr::Layout>(grad, x, sZ);
}

// Accumulator row r's place in the warp's rows: 16 (r / 2) + 8 (r % 2) + g.
__device__ __forceinline__ int accumulator_row(int r) { return 16 * (r >> 1) + 8 * (r & 1) + (lane_id() >> 2); }

// Write factor * grad for the warp's rows below rows_valid (from row0 of a
// tile whose first row is dst) and columns below cols_valid.
template <class Tr>
__device__ __forceinline__ void tf32_store_rows(float* dst, int64_t row_stride,
                                                const float (&grad)[Tr::kRows][Tr::kGCols], float factor, int row0,
                                                int rows_valid, int cols_valid) {
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int row = row0 + accumulator_row(r);
        if (row < rows_valid) store_row_tf32(dst + row * row_stride, grad[r], factor, cols_valid);
    }
}

// A rows x kHeadDim tile into shared memory by cp.async (rows past rows_valid
// and columns past d zero-filled); the caller commits, waits and synchronises.
template <class Tr, int kRows>
__device__ __forceinline__ void tf32_load_tile(float* dst, const float* src, int64_t row_stride, int rows_valid,
                                               int d) {
    cp_async_tile_rows<Tr::kThreads, kRows, Tr::kHeadDim>(dst, typename Tr::Layout{}, src, row_stride, rows_valid,
                                                          d);
}

// The two stages of the two streamed tiles (Q, dO in dK/dV; K, V in dQ) after the own tiles.
template <class Tr>
struct Tf32Stream {
    float* base;
    __device__ float* first(int stage) const { return base + 2 * stage * Tr::kStreamTile; }
    __device__ float* second(int stage) const { return first(stage) + Tr::kStreamTile; }
    __device__ void load(int stage, const float* src1, int64_t stride1, const float* src2, int64_t stride2, int rows,
                         int d) const {
        tf32_load_tile<Tr, Tr::kStreamRows>(first(stage), src1, stride1, rows, d);
        tf32_load_tile<Tr, Tr::kStreamRows>(second(stage), src2, stride2, rows, d);
    }
    // Block `it` of the loop lands in stage it % 2: wait for it (every thread
    // has at most one group in flight), let everyone see it and finish reading
    // the other stage, then start copying block it + 1 there (load_next).
    template <class LoadNext>
    __device__ void advance(int64_t it, int64_t count, LoadNext load_next) const {
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < count) {
            load_next(static_cast<int>((it + 1) & 1));
            cp_async_commit();
        }
    }
};

// dK, dV of kOwn keys of one (batch, kv head).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
__global__ void __launch_bounds__((Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kThreads),
                                  (Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kMinBlocksPerSm))
bwd_tf32_dkdv_kernel(const BwdParams params) {
    using Tr = Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>;
    const FwdParams& p = params.fwd;

    const KeyTileIndex tile(p, kOwn, blockIdx.x);
    const WindowMask mask(p);
    const KeyBlock block(p, mask, tile.n_block * kOwn, kOwn);
    const float scale_log2 = static_cast<float>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first key in the block
    const int64_t first_head = tile.head_kv * p.gqa_ratio;  // the kv head's query group

    float* sK = reinterpret_cast<float*>(dynamic_smem());
    float* sV = sK + Tr::kOwnTile;
    const Tf32Stream<Tr> stream{sV + Tr::kOwnTile};  // Q, dO
    const HeadSlice<float, float> kv(p, tile.batch, first_head);
    tf32_load_tile<Tr, kOwn>(sK, kv.k + block.n0 * p.k_row_stride, p.k_row_stride, block.keys, d);
    tf32_load_tile<Tr, kOwn>(sV, kv.v + block.n0 * p.v_row_stride, p.v_row_stride, block.keys, d);

    // (head, m_block) walks heads first_head.. and, within each, the query
    // blocks m_begin..m_end that see these keys.
    const int64_t m_begin = block.m_begin(kStream), m_end = block.m_end(kStream);
    const int64_t num_blocks = (m_end - m_begin) * p.gqa_ratio;
    auto load_queries = [&](int stage, int64_t head, int64_t m_block) {
        const int64_t m0 = m_block * kStream;
        const HeadSlice<float, float> qo(p, tile.batch, head);
        const GradSlice<float, float> grad(params, tile.batch, head);
        stream.load(stage, qo.q + m0 * p.q_row_stride, p.q_row_stride, grad.dout + m0 * params.dout_row_stride,
                    params.dout_row_stride, static_cast<int>(min64(kStream, p.seqlen_q - m0)), d);
    };

    float dk[Tr::kRows][Tr::kGCols] = {};
    float dv[Tr::kRows][Tr::kGCols] = {};
    int64_t head = first_head, m_block = m_begin;
    if (num_blocks > 0) load_queries(0, head, m_block);
    cp_async_commit();  // K, V and the first query block
    for (int64_t it = 0; it < num_blocks; ++it) {
        const int stage = static_cast<int>(it & 1);
        const int64_t next_head = m_block + 1 == m_end ? head + 1 : head;
        const int64_t next_m_block = m_block + 1 == m_end ? m_begin : m_block + 1;
        stream.advance(it, num_blocks, [&](int st) { load_queries(st, next_head, next_m_block); });
        const float* sQ = stream.first(stage);
        const float* sdO = stream.second(stage);
        const int64_t m0 = m_block * kStream;
        const HeadSlice<float, float> qo(p, tile.batch, head);
        const GradSlice<float, float> grad(params, tile.batch, head);

        float s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
        tf32_row_products<Tr>(s, sK, sQ, row0);  // S^T = K Q^T
        float lse_log2[Tr::kSCols], delta[Tr::kSCols];
#pragma unroll
        for (int c = 0; c < Tr::kSCols; ++c)
            load_query_stats(lse_log2[c], delta[c], qo.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                             m0 + fragment_col(c), p.seqlen_q);
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) s[r][c] = exp2_acc(fmaf(s[r][c], scale_log2, -lse_log2[c]));  // P^T
        if (block.needs_mask(p, mask, m0, kStream, kOwn)) {
            // P of pairs (query i, key j) the mask hides, or past Lq or Lk -> 0 (a select:
            // whatever the padded scores held never reaches the gradients).
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) {
                const int64_t i = m0 + fragment_col(c);
                int lo, hi;
                mask.row_range(i, block.n0, kOwn, lo, hi);
#pragma unroll
                for (int r = 0; r < Tr::kRows; ++r) {
                    const int key = row0 + accumulator_row(r);
                    if (i >= p.seqlen_q || key < lo || key >= hi) s[r][c] = 0.0f;
                }
            }
        }
        tf32_row_products<Tr>(dp, sV, sdO, row0);  // dP^T = V dO^T
        tf32_grad<Tr>(dv, s, sdO);                 // dV += P^T dO
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) dp[r][c] = s[r][c] * (dp[r][c] - delta[c]);  // dS^T
        tf32_grad<Tr>(dk, dp, sQ);                 // dK += dS^T Q
        head = next_head;
        m_block = next_m_block;
    }
    cp_async_wait<0>();  // K and V of a block no query row sees

    const GradSlice<float, float> kv_grad(params, tile.batch, first_head);
    tf32_store_rows<Tr>(kv_grad.dk + block.n0 * params.dk_row_stride, params.dk_row_stride, dk,
                        static_cast<float>(p.scale), row0, block.keys, d);
    tf32_store_rows<Tr>(kv_grad.dv + block.n0 * params.dv_row_stride, params.dv_row_stride, dv, 1.0f, row0,
                        block.keys, d);
}

// dQ of kOwn query rows of one (batch, query head).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
__global__ void __launch_bounds__((Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kThreads),
                                  (Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kMinBlocksPerSm))
bwd_tf32_dq_kernel(const BwdParams params) {
    using Tr = Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>;
    const FwdParams& p = params.fwd;

    const TileIndex tile(p, kOwn, blockIdx.x);
    const HeadSlice<float, float> head(p, tile.batch, tile.head);
    const GradSlice<float, float> grad(params, tile.batch, tile.head);
    const WindowMask mask(p);
    const QueryBlock block(p, mask, tile.m_block * kOwn, kOwn);
    const float scale_log2 = static_cast<float>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first query row in the block

    float* sQ = reinterpret_cast<float*>(dynamic_smem());
    float* sdO = sQ + Tr::kOwnTile;
    const Tf32Stream<Tr> stream{sdO + Tr::kOwnTile};  // K, V
    tf32_load_tile<Tr, kOwn>(sQ, head.q + block.m0 * p.q_row_stride, p.q_row_stride, block.rows, d);
    tf32_load_tile<Tr, kOwn>(sdO, grad.dout + block.m0 * params.dout_row_stride, params.dout_row_stride,
                             block.rows, d);
    float lse_log2[Tr::kRows], delta[Tr::kRows];
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
        load_query_stats(lse_log2[r], delta[r], head.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                         block.m0 + row0 + accumulator_row(r), p.seqlen_q);

    auto load_keys = [&](int stage, int64_t n_block) {
        const int64_t n0 = n_block * kStream;
        stream.load(stage, head.k + n0 * p.k_row_stride, p.k_row_stride, head.v + n0 * p.v_row_stride,
                    p.v_row_stride, QueryBlock::keys_in(p, n0, kStream), d);
    };

    float dq[Tr::kRows][Tr::kGCols] = {};
    const int64_t n_begin = block.n_begin(kStream), n_end = block.n_end(kStream);
    if (n_begin < n_end) load_keys(0, n_begin);
    cp_async_commit();  // Q, dO and the first key block
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int64_t it = n_block - n_begin;
        const int stage = static_cast<int>(it & 1);
        stream.advance(it, n_end - n_begin, [&](int st) { load_keys(st, n_block + 1); });
        const float* sK = stream.first(stage);
        const float* sV = stream.second(stage);
        const int64_t n0 = n_block * kStream;

        float s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
        tf32_row_products<Tr>(s, sQ, sK, row0);  // S = Q K^T
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) s[r][c] = exp2_acc(fmaf(s[r][c], scale_log2, -lse_log2[r]));  // P
        if (block.needs_mask(mask, n0, kStream)) {
            // Keys the mask hides from a row, and keys past Lk -> P = 0 (rows past Lq
            // already have P = 0: their lse_log2 is +inf).
#pragma unroll
            for (int r = 0; r < Tr::kRows; ++r) {
                int lo, hi;
                mask.row_range(block.m0 + row0 + accumulator_row(r), n0, kStream, lo, hi);
#pragma unroll
                for (int c = 0; c < Tr::kSCols; ++c)
                    if (fragment_col(c) < lo || fragment_col(c) >= hi) s[r][c] = 0.0f;
            }
        }
        tf32_row_products<Tr>(dp, sdO, sV, row0);  // dP = dO V^T
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r)
#pragma unroll
            for (int c = 0; c < Tr::kSCols; ++c) dp[r][c] = s[r][c] * (dp[r][c] - delta[r]);  // dS
        tf32_grad<Tr>(dq, dp, sK);                 // dQ += dS K
    }
    cp_async_wait<0>();  // Q and dO of a block that sees no key

    tf32_store_rows<Tr>(grad.dq + block.m0 * params.dq_row_stride, params.dq_row_stride, dq,
                        static_cast<float>(p.scale), row0, block.rows, d);
}

}  // namespace cf
