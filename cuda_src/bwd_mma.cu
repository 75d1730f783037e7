// bwd_mma.cu -- the tensor-core backward kernels: FlashAttention-2's backward
// with mma.sync m16n8k16 (float16 / bfloat16 inputs, float32 accumulation),
// sm_80 and later.
//
// The algorithm and the split into kernels are bwd_simt.cu's (see there):
// delta = rowsum(dO o O) by bwd_simt_dot_do_o_kernel, then
//   bwd_mma_dkdv_kernel  a CTA owns kBlockN keys of one kv head; each of its
//                        kWarps warps owns kBlockN / kWarps of them (16 per
//                        m16 tile).  K and V stay in shared memory, dK and dV
//                        in registers; the query blocks that see the keys
//                        stream through shared memory, head by head through
//                        the kv head's query group.  Per query block a warp
//                        computes, for its keys,
//                            S^T = K Q^T                 ldmatrix + mma
//                            P^T = exp2(S^T c - lse c)   lse, delta staged in shared memory
//                            dV += P^T dO                P^T re-packed in registers as the A operand
//                            dP^T = V dO^T
//                            dS^T = P^T o (dP^T - delta)
//                            dK += dS^T Q                dS^T re-packed likewise
//   bwd_mma_dq_kernel    a CTA owns kBlockM query rows, each warp 16 per
//                        m16 tile; Q and dO stay in shared memory, dQ in
//                        registers; the key blocks its rows see stream through
//                        S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// No warp ever needs another warp's scores, so the only barriers are those
// around the streamed tiles; with kStages = 2 (where shared memory allows)
// the next streamed block is copied into a second buffer while the current
// one is computed, one barrier per block.  Every gradient element is summed by one lane in
// a fixed order: results are bit-identical from run to run.  From head dim
// 160 on, dK and dV accumulators together (2 x 80+ floats per lane on top of
// the scores) spill, so the dK/dV kernel is launched twice, with
// kGrads = kGradDV and then kGradDK (S recomputed once more).
// deterministic=False: the launch that computes dK (kGradDK | kGradDQAtomic)
// also adds each block pair's dQ = scale dS K to dq with float atomics, and no
// dQ kernel runs: 5 block products per pair instead of 7, in an order that
// changes from run to run (so do dq's last bits).
//
// Tiles are mma_tile.cuh's swizzled tiles, filled by cp.async with tails and
// columns beyond the run-time d zero-filled; the dispatcher guarantees
// 16-byte aligned rows (cupyflash/_gpu.py rows_aligned).  kWholeStream (both
// kernels' whole-stream instantiations, which the dispatcher picks when the
// streamed length -- Lq for dK/dV, Lk for dQ -- is a multiple of the streamed
// block and d is the bucket): the streamed copies skip the bounds.  Gradients are
// float32 and written straight from the accumulators.
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "bwd_blocks.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  kBlockOwn rows stay in
// shared memory for the whole CTA and are split across the warps; kBlockStream
// rows are reloaded per block.  The tile table, with the reason for each row,
// is _BWD_MMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kBlockOwn_, int kBlockStream_, int kWarps_, int kGrads_,
          int kStages_>
struct MmaBwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockOwn = kBlockOwn_, kBlockStream = kBlockStream_;
    static constexpr int kWarps = kWarps_, kGrads = kGrads_, kStages = kStages_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kBlockOwn / kWarps;   // own rows per warp
    static constexpr int kMTiles = kWarpRows / 16;         // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;              // accumulator rows per lane
    static constexpr int kSCols = 2 * (kBlockStream / 8);  // score columns per lane and row
    static constexpr int kGCols = 2 * (kHeadDim / 8);      // gradient columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;          // k16 steps over the head dim
    static constexpr int kStreamSteps = kBlockStream / 16; // k16 steps over the streamed rows

    using OwnTile = SwizzledTile<kBlockOwn, kHeadDim>;
    using StreamTile = SwizzledTile<kBlockStream, kHeadDim>;

    // Shared memory: two own tiles (K, V or Q, dO; V only when dK is
    // computed), kStages pairs of streamed tiles (elements of T), then
    // kStages pairs of the streamed rows' lse * log2(e) and delta (floats;
    // used by the dK/dV kernel).  With two stages the next streamed block
    // lands while this one is computed (the table picks them per GPU class
    // where two CTAs still fit on an SM: cupyflash/_kernels.py).
    static constexpr bool kNeedsV = (kGrads & kGradDK) != 0;
    static constexpr int kOwnElems = OwnTile::kElements;
    static constexpr int kStreamElems = StreamTile::kElements;
    static constexpr int kOwnBytes = (kNeedsV ? 2 : 1) * kOwnElems * 2;
    static constexpr int kStageBytes = 2 * kStreamElems * 2 + 2 * kBlockStream * 4;
    static constexpr int kStatsOffset = kOwnBytes + kStages * 2 * kStreamElems * 2;  // bytes
    // kGradDQAtomic: dS^T of one block pair, [own row][streamed row], read back
    // as the A operand of dQ = dS K (add_dq_atomically).
    static constexpr bool kAtomicDq = (kGrads & kGradDQAtomic) != 0;
    using DsTile = SwizzledTile<kBlockOwn, kBlockStream>;
    static constexpr int kDsOffset = kOwnBytes + kStages * kStageBytes;  // bytes
    static constexpr int kSmemBytes = kDsOffset + (kAtomicDq ? DsTile::kElements * 2 : 0);
    // Two CTAs of up to 4 warps leave every thread the 255-register maximum
    // (as fwd_mma): this states the occupancy aimed for, it caps nothing.
    static constexpr int kMinBlocksPerSm = kWarps <= 4 ? 2 : 1;

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kBlockOwn % (16 * kWarps) == 0, "own block: whole m16 tiles per warp");
    static_assert(kBlockStream % 16 == 0, "streamed block: whole k16 steps");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim bucket: 32 .. 256, multiple of 32");
    static_assert(kGrads >= 1 && kGrads <= 7, "kGrads: kGradDV, kGradDK, kGradDQAtomic");
    static_assert(!kAtomicDq || kNeedsV, "kGradDQAtomic needs dS, which only kGradDK computes");
    static_assert(kStages == 1 || kStages == 2, "kStages: 1 (load, then compute) or 2 (prefetch)");
    // the per-architecture tables keep sm_86 / sm_89 tiles within their 99 KB
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// ---- block products ------------------------------------------------------------------------

// s = X Y^T for the warp's own rows (from row0 of the own tile X) and every
// row of the streamed tile Y; both tiles [row][head dim].
template <class Tr, typename T>
__device__ __forceinline__ void mma_own_stream(float (&s)[Tr::kRows][Tr::kSCols], const T* sX, const T* sY,
                                               int row0) {
    mma_abt<typename Tr::OwnTile, typename Tr::StreamTile, Tr::kMTiles, Tr::kBlockStream, Tr::kKSteps>(
        s, sX, sY, row0);
}

// g += s Z: s (the warp's own rows x the streamed rows) re-packed as A
// operands, Z the streamed tile [streamed row][head dim].
template <class Tr, typename T>
__device__ __forceinline__ void mma_accumulate(float (&g)[Tr::kRows][Tr::kGCols],
                                               const float (&s)[Tr::kRows][Tr::kSCols], const T* sZ) {
#pragma unroll
    for (int kk = 0; kk < Tr::kStreamSteps; ++kk) {
        uint32_t a[Tr::kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) accumulator_to_a<T>(a[mi], s, mi, kk);
#pragma unroll
        for (int np = 0; np < Tr::kHeadDim / 16; ++np) {
            uint32_t b[4];
            ldmatrix_b_kn<typename Tr::StreamTile>(b, sZ, 16 * kk, np);
#pragma unroll
            for (int mi = 0; mi < Tr::kMTiles; ++mi) {
                mma_into<T>(g, mi, 2 * np, a[mi], b[0], b[1]);
                mma_into<T>(g, mi, 2 * np + 1, a[mi], b[2], b[3]);
            }
        }
    }
}

// dq[query rows of one block] += scale * dS K, summed over the CTA's own keys,
// by float atomics.  sdS holds dS^T ([key][query], Tr::DsTile) of every warp;
// warp w takes m16 tile w / kWarpsPerTile of the block's queries and the
// (w % kWarpsPerTile)-th slice of the head dim, so the product runs over all
// of the CTA's keys once.  dq points at the block's first query row.
template <class Tr, typename T>
__device__ __forceinline__ void add_dq_atomically(float* dq, int64_t row_stride, const T* sdS, const T* sK,
                                                  float scale, int rows_valid, int cols_valid) {
    constexpr int kQueryTiles = Tr::kBlockStream / 16;
    constexpr int kWarpsPerTile = Tr::kWarps / kQueryTiles;
    constexpr int kCols = Tr::kHeadDim / kWarpsPerTile;  // head-dim columns per warp
    static_assert(Tr::kWarps % kQueryTiles == 0 && kCols % 16 == 0, "whole m16 tiles and n16 pairs per warp");
    // At most 32 columns per pass (16 above d = 128), a divisor of the warp's
    // columns: the dK and dV accumulators are live here.
    constexpr int kPassCols = Tr::kHeadDim <= 128 && kCols % 32 == 0 ? 32 : 16;
    const int w = warp_id();
    const int m0 = 16 * (w / kWarpsPerTile);
#pragma unroll 1
    for (int np0 = (kCols / 16) * (w % kWarpsPerTile), np_end = np0 + kCols / 16; np0 < np_end;
         np0 += kPassCols / 16) {
        float acc[2][kPassCols / 4] = {};
#pragma unroll(Tr::kHeadDim > 128 ? 1 : 2)
        for (int ks = 0; ks < Tr::kBlockOwn / 16; ++ks) {
            uint32_t a[4];
            ldmatrix_a_km<typename Tr::DsTile>(a, sdS, m0, ks);
#pragma unroll
            for (int np = 0; np < kPassCols / 16; ++np) {
                uint32_t b[4];
                ldmatrix_b_kn<typename Tr::OwnTile>(b, sK, 16 * ks, np0 + np);
                mma_into<T>(acc, 0, 2 * np, a, b[0], b[1]);
                mma_into<T>(acc, 0, 2 * np + 1, a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + fragment_row(r);
            if (row >= rows_valid) continue;
#pragma unroll
            for (int c = 0; c < kPassCols / 4; ++c) {
                const int col = 16 * np0 + fragment_col(c);
                if (col < cols_valid) atomicAdd(dq + row * row_stride + col, acc[r][c] * scale);
            }
        }
    }
}

// ---- kernels ---------------------------------------------------------------------------------

// dK and/or dV (kGrads) of kBlockN keys of one (batch, kv head).
template <typename T, int kHeadDim, int kBlockN, int kBlockM, int kWarps, int kGrads, int kStages,
          bool kWholeStream = false>
__global__ void __launch_bounds__(
    (MmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarps, kGrads, kStages>::kThreads),
    (MmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarps, kGrads, kStages>::kMinBlocksPerSm))
bwd_mma_dkdv_kernel(const BwdParams launch) {
    using Tr = MmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarps, kGrads, kStages>;
    using Own = typename Tr::OwnTile;
    constexpr bool kDV = (kGrads & kGradDV) != 0, kDK = (kGrads & kGradDK) != 0;

    const KeyTileIndex tile(launch.fwd, kBlockN, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kBlockN)) return;
    }
    const FwdParams& p = params.fwd;
    const WindowMask mask(p);
    const KeyBlock block(p, mask, tile.n_block * kBlockN, kBlockN);
    const float scale_log2 = static_cast<float>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first key in the K tile
    const int64_t first_head = tile.head_kv * p.gqa_ratio;

    T* sK = reinterpret_cast<T*>(dynamic_smem());
    T* sV = sK + Tr::kOwnElems;  // only when kDK
    // kStages x (Q, dO), then kStages x (lse, delta)
    const QueryStream<Tr, T, kWholeStream> queries{
        params, tile.batch, d, sK + (Tr::kNeedsV ? 2 : 1) * Tr::kOwnElems,
        reinterpret_cast<float*>(dynamic_smem() + Tr::kStatsOffset)};

    // The query blocks that see these keys, head by head through the kv head's group.
    const int64_t m_begin = block.m_begin(kBlockM), m_end = block.m_end(kBlockM);
    const int64_t head_end = first_head + p.gqa_ratio;
    const HeadSlice<T, float> kv(p, tile.batch, first_head);
    cp_async_tile<Tr::kThreads, Own>(sK, kv.k, block.n0, p.k_row_stride, block.keys, d);
    if constexpr (kDK) cp_async_tile<Tr::kThreads, Own>(sV, kv.v, block.n0, p.v_row_stride, block.keys, d);
    cp_async_commit();
    if (Tr::kStages == 2 && m_begin < m_end) {
        float lse_log2, delta;
        queries.issue(0, first_head, m_begin, lse_log2, delta);
        if (threadIdx.x < kBlockM) queries.store_stats(0, lse_log2, delta);
    }

    float dk[Tr::kRows][Tr::kGCols] = {};
    float dv[Tr::kRows][Tr::kGCols] = {};
    float s[Tr::kRows][Tr::kSCols];
    int stage = 0;  // the buffers of the current block (always 0 with one stage)
    for (int64_t head = first_head; head < head_end; ++head) {
        for (int64_t m_block = m_begin; m_block < m_end; ++m_block) {
            float next_lse_log2 = 0.0f, next_delta = 0.0f;
            bool has_next = false;
            if constexpr (Tr::kStages == 2) {
                cp_async_wait<0>();
                __syncthreads();  // this block's Q, dO, lse, delta visible to all; the other stage read
                const bool head_done = m_block + 1 == m_end;
                has_next = !head_done || head + 1 < head_end;
                if (has_next) {
                    const int64_t next_head = head_done ? head + 1 : head;
                    const int64_t next_m_block = head_done ? m_begin : m_block + 1;
                    queries.issue(stage ^ 1, next_head, next_m_block, next_lse_log2, next_delta);
                }
            } else {
                float lse_log2, delta;
                queries.issue(0, head, m_block, lse_log2, delta);
                if (threadIdx.x < kBlockM) queries.store_stats(0, lse_log2, delta);
                cp_async_wait<0>();
                __syncthreads();  // Q, dO, lse, delta (and, the first time, K, V) visible to all
            }
            const T* sQ = queries.q(stage);
            const T* sdO = queries.dout(stage);
            const float* sLse = queries.stats_lse_log2(stage);
            const float* sDelta = queries.stats_delta(stage);
            const auto lse_of = [sLse](int, int c) { return sLse[fragment_col(c)]; };       // by query column
            const auto delta_of = [sDelta](int, int c) { return sDelta[fragment_col(c)]; };
            const int64_t m0 = m_block * kBlockM;

            mma_own_stream<Tr>(s, sK, sQ, row0);                               // S^T = K Q^T
            auto chain = chain_for(s);
            probability_epilogue<WindowRule<true>, false, Walk::kByElement>(  // P^T
                s, M16n8Fragment{}, mask, p, ScoreTile{tile.batch, head, m0, block.n0, row0, kBlockN},
                [&] { return block.needs_mask(p, mask, m0, kBlockM, kBlockN); }, lse_of, scale_log2, chain);
            if constexpr (kDV) mma_accumulate<Tr>(dv, s, sdO);                 // dV += P^T dO
            if constexpr (kDK) {
                float dp[Tr::kRows][Tr::kSCols];
                mma_own_stream<Tr>(dp, sV, sdO, row0);                         // dP^T = V dO^T
                score_gradient<Tr>(dp, s, delta_of);                           // dS^T
                gradient_epilogue<float>(dp, s, chain, M16n8Fragment{}, params,
                                         ScoreTile{tile.batch, head, m0, block.n0, row0, kBlockN});
                mma_accumulate<Tr>(dk, dp, sQ);                                // dK += dS^T Q
                if constexpr (Tr::kAtomicDq) {
                    T* sdS = reinterpret_cast<T*>(dynamic_smem() + Tr::kDsOffset);
                    store_accumulators<typename Tr::DsTile>(sdS, dp, row0);  // dS^T, rounded as for dK
                    __syncthreads();  // every warp's keys visible (the last block's reads were fenced earlier)
                    const GradSlice<T, float> grad(params, tile.batch, head);
                    add_dq_atomically<Tr>(grad.dq + m0 * params.dq_row_stride, params.dq_row_stride, sdS, sK,
                                          static_cast<float>(p.scale),
                                          static_cast<int>(min64(kBlockM, p.seqlen_q - m0)), d);
                }
            }
            if constexpr (Tr::kStages == 2) {
                // the other stage's statistics were last read before this block's barrier
                if (has_next && threadIdx.x < kBlockM) queries.store_stats(stage ^ 1, next_lse_log2, next_delta);
                stage ^= 1;
            } else {
                __syncthreads();  // Q, dO, lse, delta fully read: their buffers take the next block
            }
        }
    }
    cp_async_wait<0>();  // without a query block, K and V were never waited for

    const GradSlice<T, float> kv_grad(params, tile.batch, first_head);
    const int keys_valid = block.keys - row0;
    if constexpr (kDK)
        store_gradient<Tr>(kv_grad.dk + (block.n0 + row0) * params.dk_row_stride, params.dk_row_stride, dk,
                           static_cast<float>(p.scale), keys_valid, d);
    if constexpr (kDV)
        store_gradient<Tr>(kv_grad.dv + (block.n0 + row0) * params.dv_row_stride, params.dv_row_stride, dv,
                           1.0f, keys_valid, static_cast<int>(p.head_dim_v));
}

// bwd_mma_dkdv_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockN, int kBlockM, int kWarps, int kGrads, int kStages,
          bool kWholeStream = false>
constexpr int bwd_mma_dkdv_kernel_smem() {
    return MmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarps, kGrads, kStages>::kSmemBytes;
}

// dQ of kBlockM query rows of one (batch, query head).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kWholeStream = false>
__global__ void __launch_bounds__(
    (MmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kGradDV | kGradDK, kStages>::kThreads),
    (MmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kGradDV | kGradDK, kStages>::kMinBlocksPerSm))
bwd_mma_dq_kernel(const BwdParams launch) {
    using Tr = MmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kGradDV | kGradDK, kStages>;
    using Own = typename Tr::OwnTile;

    const TileIndex tile(launch.fwd, kBlockM, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kBlockM)) return;
    }
    const FwdParams& p = params.fwd;
    const HeadSlice<T, float> head(p, tile.batch, tile.head);
    const GradSlice<T, float> grad(params, tile.batch, tile.head);
    const WindowMask mask(p);
    const QueryBlock block(p, mask, tile.m_block * kBlockM, kBlockM);
    const float scale_log2 = static_cast<float>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim);
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile

    T* sQ = reinterpret_cast<T*>(dynamic_smem());
    T* sdO = sQ + Tr::kOwnElems;
    const KeyStream<Tr, T, kWholeStream> keys{p, head.k, head.v, d, sdO + Tr::kOwnElems};  // kStages x (K, V)

    const int64_t n_begin = block.n_begin(kBlockN), n_end = block.n_end(kBlockN);
    cp_async_tile<Tr::kThreads, Own>(sQ, head.q, block.m0, p.q_row_stride, block.rows, d);
    cp_async_tile<Tr::kThreads, Own>(sdO, grad.dout, block.m0, params.dout_row_stride, block.rows, d);
    if (Tr::kStages == 2 && n_begin < n_end) keys.issue(0, n_begin);
    cp_async_commit();

    float lse_log2[Tr::kRows], delta[Tr::kRows];
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
        query_stats(lse_log2[r], delta[r], head.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                    block.m0 + row0 + fragment_row(r), p.seqlen_q);

    const auto lse_of = [&lse_log2](int r, int) { return lse_log2[r]; };          // by query row
    const auto delta_of = [&delta](int r, int) { return delta[r]; };

    float dq[Tr::kRows][Tr::kGCols] = {};
    float s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = Tr::kStages == 2 ? static_cast<int>((n_block - n_begin) & 1) : 0;
        if constexpr (Tr::kStages == 2) {
            cp_async_wait<0>();
            __syncthreads();  // this block's K, V (and, the first time, Q, dO) visible; the other stage read
            if (n_block + 1 < n_end) {
                keys.issue(stage ^ 1, n_block + 1);
                cp_async_commit();
            }
        } else {
            keys.issue(0, n_block);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();  // K, V (and, the first time, Q, dO) visible to all
        }
        const T* sK = keys.k(stage);
        const T* sV = keys.v(stage);
        const int64_t n0 = n_block * kBlockN;

        mma_own_stream<Tr>(s, sQ, sK, row0);                                   // S = Q K^T
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<true>, true>(                      // P
            s, M16n8Fragment{}, mask, p, ScoreTile{tile.batch, tile.head, block.m0 + row0, n0, 0, kBlockN},
            [&] { return block.needs_mask(mask, n0, kBlockN); }, lse_of, scale_log2, chain);
        mma_own_stream<Tr>(dp, sdO, sV, row0);                                 // dP = dO V^T
        score_gradient<Tr>(dp, s, delta_of);                                  // dS
        gradient_epilogue(dp, s, chain);
        mma_accumulate<Tr>(dq, dp, sK);                                        // dQ += dS K
        if constexpr (Tr::kStages == 1) __syncthreads();  // K, V fully read: the buffers take the next block
    }
    cp_async_wait<0>();  // without a key block, Q and dO were never waited for

    store_gradient<Tr>(grad.dq + (block.m0 + row0) * params.dq_row_stride, params.dq_row_stride, dq,
                       static_cast<float>(p.scale), block.rows - row0, d);
}

// bwd_mma_dq_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kWholeStream = false>
constexpr int bwd_mma_dq_kernel_smem() {
    return MmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarps, kGradDV | kGradDK, kStages>::kSmemBytes;
}

}  // namespace cf
