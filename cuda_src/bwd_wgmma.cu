// bwd_wgmma.cu -- the Hopper backward kernels: bwd_mma's algorithm on
// wgmma.mma_async (float16 / bfloat16 inputs, float32 accumulation), sm_90a.
//
// The split into kernels is bwd_mma.cu's: bwd_simt's delta kernel first, then
//   bwd_wgmma_dkdv_kernel  a CTA owns kBlockN = 64 kWarpGroups keys of one kv
//                          head, each warpgroup 64 of them (the rows of its m64
//                          slice), each warp 16.  K and V stay in shared memory
//                          and dK, dV in registers; the query blocks that see
//                          the keys stream through a cp.async double buffer
//                          (Q, dO and their rows' lse, delta), head by head
//                          through the kv head's group.  Per query block a
//                          warpgroup computes, for its 64 keys,
//       S^T  = K Q^T      wgmma, A = K and B = Q from shared memory (K-major)
//       dP^T = V dO^T     wgmma likewise, issued in the same batch as S^T
//       P^T  = exp2(S^T c - lse c), masked, while dP^T is in the tensor cores
//       dV  += P^T dO     wgmma, A = P^T from registers, B = dO MN-major
//       dS^T = P^T o (dP^T - delta), while dV is in the tensor cores
//       dK  += dS^T Q     wgmma, A = dS^T from registers, B = Q MN-major
//   bwd_wgmma_dq_kernel    a CTA owns kBlockM = 64 kWarpGroups query rows; Q
//                          and dO stay in shared memory, dQ in registers; the
//                          key blocks its rows see stream through
//       S = Q K^T, dP = dO V^T (one batch), P, dS,
//       dQ += dS K        wgmma, A = dS from registers, B = K MN-major.
// From head dim 192 on, dK and dV accumulators together would not leave S^T
// and dP^T their registers: the dK/dV kernel runs twice, with kGrads = kGradDV
// (no V tile, no dP^T) and then kGradDK (S^T recomputed), as bwd_mma does from
// 160; d = 256 streams 32 rows in the dK launch and 32 keys in the dQ kernel
// (m64 n32 products), its own tiles taking 128 KB.
// deterministic=False (kGradDQAtomic, d <= 128): the dK/dV kernel also rounds dS^T into a
// shared tile, and after a barrier the CTA computes dQ = dS K for the query
// block over all of its keys -- wgmma with A = dS (MN-major: the tile is
// [key][query]) and B = K (MN-major), warpgroup w taking one m64 slice of the
// queries and one slice of the head dim -- and adds it to dq with float
// atomics (8-byte vector reductions: dq's rows must start 8-byte aligned);
// no dQ kernel runs (5 block products per block pair instead of 7).
// kGradDQBulk (asynchronous dQ, opt-in until timed): the same product, its
// result staged as floats in shared memory, and warp 0 adds each query row to
// dq with one bulk asynchronous reduction (cp.reduce.async.bulk .add.f32,
// barriers.cuh; dq's rows 16-byte aligned) while the CTA goes on to the next
// query block: 64 instructions of one warp per block in place of every
// thread's 8-byte atomics.  The staging tile is written again only after
// warp 0 has waited for the bulk reads, before the next block's barrier.
// kGradDQOrdered (with kGradDQBulk, deterministic=True, opt-in with it): the key
// blocks of a kv head add into a query block in key-block order.  Warp 0 waits
// until the query block's semaphore (BwdParams::dq_turns) holds its turn (its
// own key-block number n when key block n - 1 adds into the same query block,
// which posts n; else 0: turn_bound), sends, completes its reductions
// (bulk_wait<0>, a global proxy fence, then __syncwarp) and posts n + 1.
// Every dq element is then the same float32 sum whatever the schedule, and no
// dQ kernel runs.  A block waits only for the block before it in launch order
// (KeyTileIndex: n_block is the fastest index), which the GPU starts first.
// (At d = 128 the host launches it for dK alone, dV apart: the fused row
// spilled, _families/bwd_wgmma.py.)
//
// Shared tiles are SwizzledTile pages, wgmma's 128-byte-swizzle layout
// (wgmma.cuh), 1024-byte aligned.  Every thread copies with cp.async and runs
// fence.proxy.async after its copies land, before the barrier that publishes
// them to the tensor cores; a buffer is refilled only after that barrier,
// which every warpgroup reaches after retiring the wgmma groups that read it.
// Needs head dims that are multiples of 64 (others pass through with zero-
// filled columns), 16-byte aligned rows, dv == d and scale > 0 -- the
// dispatcher's conditions (cupyflash/_gpu_bwd.py).  Gradients are float32.
#pragma once

#include "barriers.cuh"
#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "bwd_blocks.cuh"
#include "mask.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "producer.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace cf {

// A timing-only build (benchmarks/gpu_first_contact.py's A/B table through
// KernelOptions.timing = "no-copy"; never dispatched): CF_TIMING_NO_COPY leaves out
// every streamed-tile copy after the first two blocks (Q and dO in the dK/dV
// kernel, K and V in the dQ kernel; the products re-read those buffers, the
// statistics still load).  Its gradients are meaningless; its time against the
// real kernels' is what the copies cost.
#ifndef CF_TIMING_NO_COPY
#define CF_TIMING_NO_COPY 0
#endif
constexpr bool kBwdTimingNoCopy = CF_TIMING_NO_COPY != 0;

// Every compile-time quantity of one instantiation.  kBlockOwn rows (keys in
// the dK/dV kernel, query rows in the dQ kernel) stay in shared memory, 64 per
// warpgroup; kBlockStream rows are reloaded per block.  The tile table, with
// the reason for each row, is _BWD_WGMMA_TILES in cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kBlockOwn_, int kBlockStream_, int kWarpGroups_, int kGrads_>
struct WgmmaBwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockOwn = kBlockOwn_, kBlockStream = kBlockStream_;
    static constexpr int kWarpGroups = kWarpGroups_, kGrads = kGrads_;
    static constexpr bool kDV = (kGrads & kGradDV) != 0, kDK = (kGrads & kGradDK) != 0;
    static constexpr bool kAtomicDq = (kGrads & kGradDQAtomic) != 0;
    static constexpr bool kBulkDq = (kGrads & kGradDQBulk) != 0;
    static constexpr bool kOrderedDq = (kGrads & kGradDQOrdered) != 0;
    static constexpr bool kNeedsV = kDK;  // dP^T = V dO^T only for dK (the dQ kernel: both own tiles)
    static constexpr int kWarps = 4 * kWarpGroups;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kMTiles = 1;
    static constexpr int kRows = 2;                         // accumulator rows per lane (g, g + 8)
    static constexpr int kSCols = kBlockStream / 4;         // score columns per lane and row
    static constexpr int kGCols = kHeadDim / 4;             // gradient columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;           // k16 steps over the head dim
    static constexpr int kStreamSteps = kBlockStream / 16;  // k16 steps over the streamed rows

    using OwnTile = SwizzledTile<kBlockOwn, kHeadDim>;
    using StreamTile = SwizzledTile<kBlockStream, kHeadDim>;
    using DsTile = SwizzledTile<kBlockOwn, kBlockStream>;   // dS^T, [key][query]

    // Shared memory, in bytes from a 1024-byte aligned start: the own tiles
    // (K, and V with kDK; Q and dO), two stages of two streamed tiles (Q, dO or
    // K, V), two stages of the streamed rows' lse * log2(e) and delta (the dK/dV
    // kernel), the dS^T tile with kAtomicDq and the float dQ tile with kBulkDq
    // (rows of kDqStride floats: 16 bytes of padding move each row four banks,
    // so a warp's fragment stores do not all hit one bank); plus 1 KB of
    // alignment slack.
    static constexpr int kOwnBytes = (kNeedsV ? 2 : 1) * OwnTile::kElements * 2;
    static constexpr int kStageBytes = 2 * StreamTile::kElements * 2;
    static constexpr int kStatsOffset = kOwnBytes + 2 * kStageBytes;
    static constexpr int kDsOffset = kStatsOffset + 2 * 2 * kBlockStream * 4;
    static constexpr int kDqOffset = kDsOffset + (kAtomicDq ? DsTile::kElements * 2 : 0);
    static constexpr int kDqStride = kHeadDim + 4;
    static constexpr int kSmemBytes = kDqOffset + (kBulkDq ? kBlockStream * kDqStride * 4 : 0) + 1024;

    // Descriptor strides (wgmma.cuh): 8-row groups 1024 bytes apart; an
    // MN-major operand's 64-column pages a tile's page apart.
    static constexpr uint32_t kGroupBytes = 1024;
    static constexpr uint32_t kOwnPageBytes = kBlockOwn * 128;
    static constexpr uint32_t kStreamPageBytes = kBlockStream * 128;

    // kAtomicDq: dQ of a query block is kBlockStream / 64 m64 slices by
    // kDqSlices head-dim slices of kDqCols columns, one per warpgroup.
    static constexpr int kDqSlices = kWarpGroups / (kBlockStream / 64 > 0 ? kBlockStream / 64 : 1);
    static constexpr int kDqCols = kHeadDim / (kDqSlices > 0 ? kDqSlices : 1);

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dim: whole 64-column pages, at most 256");
    static_assert(kBlockOwn == 64 * kWarpGroups, "own block: one m64 slice per warpgroup");
    static_assert(kBlockStream % 32 == 0 && kBlockStream <= 256, "streamed block: an n of wgmma, 32 or whole pages");
    static_assert(kBlockStream <= 32 || kBlockStream % 64 == 0, "streamed block: 32 or whole 64-row pages");
    static_assert(kWarpGroups >= 1 && kWarpGroups <= 3, "1 to 3 warpgroups");
    static_assert(kGrads >= 1 && kGrads <= 31 && (!kAtomicDq || kDK) && (!kBulkDq || kAtomicDq) &&
                      (!kOrderedDq || kBulkDq),
                  "kGrads: kGradDV, kGradDK, kGradDQAtomic, kGradDQBulk, kGradDQOrdered");
    static_assert(!kAtomicDq || ((kBlockStream / 64) * kDqSlices == kWarpGroups && kDqCols % 64 == 0),
                  "atomic dQ: one (m64 slice, whole-page head-dim slice) per warpgroup");
    static_assert(!kAtomicDq || kDsOffset % 1024 == 0, "the dS^T tile starts 1024-byte aligned");
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

template <class Tr, typename T>
__device__ __forceinline__ uint64_t k_major(const T* tile_chunk) {
    return wgmma_desc_sw128(tile_chunk, 16, Tr::kGroupBytes);
}

// x = A B^T for the warpgroup's 64 own rows (from row wg_row0 of own tile sA)
// and every row of streamed tile sB, both [row][head dim]: kKSteps wgmma into
// x, not committed.
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_own_stream(float (&x)[Tr::kRows][Tr::kSCols], const T* sA, const T* sB,
                                                 int wg_row0) {
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks)
        Wgmma<T, Tr::kBlockStream>::ss(x, k_major<Tr>(sA + Tr::OwnTile::chunk(wg_row0, 2 * ks)),
                                       k_major<Tr>(sB + Tr::StreamTile::chunk(0, 2 * ks)), ks > 0);
}

// g += x Z, x (own rows x streamed rows) re-packed as A operands, Z the
// streamed tile [streamed row][head dim] read MN-major: one committed group.
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_accumulate(float (&g)[Tr::kRows][Tr::kGCols],
                                                 const uint32_t (&a)[Tr::kStreamSteps][4], const T* sZ) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::kStreamSteps; ++kk)
        Wgmma<T, Tr::kHeadDim>::rs_mn(
            g, a[kk], wgmma_desc_sw128(sZ + Tr::StreamTile::chunk(16 * kk, 0), Tr::kStreamPageBytes, Tr::kGroupBytes),
            true);
    wgmma_commit();
}

// x rounded to T and packed as A operands (kStreamSteps k16 slices).
template <class Tr, typename T>
__device__ __forceinline__ void pack_a(uint32_t (&a)[Tr::kStreamSteps][4], const float (&x)[Tr::kRows][Tr::kSCols]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kStreamSteps; ++kk) accumulator_to_a<T>(a[kk], x, 0, kk);
}

// kAtomicDq: acc = this warpgroup's slice of dS K over the CTA's keys.  sdS
// holds dS^T ([key][query]) of every warpgroup; warpgroup w computes m64 slice
// w / kDqSlices of the queries and head-dim slice w % kDqSlices, from column
// col0 (returned) of the block's query rows row_base + fragment_row(r)
// (row_base returned).
template <class Tr, typename T>
__device__ __forceinline__ void dq_slice(float (&acc)[Tr::kRows][Tr::kDqCols / 4], const T* sdS, const T* sK,
                                         int& row_base, int& col0) {
    const int wg = warp_id() >> 2;
    const int m_slice = wg / Tr::kDqSlices;
    col0 = (wg % Tr::kDqSlices) * Tr::kDqCols;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockOwn / 16; ++kk)
        Wgmma<T, Tr::kDqCols>::ss_mn(
            acc,
            wgmma_desc_sw128(sdS + Tr::DsTile::chunk(16 * kk, 8 * m_slice), Tr::kOwnPageBytes, Tr::kGroupBytes),
            wgmma_desc_sw128(sK + Tr::OwnTile::chunk(16 * kk, col0 / 8), Tr::kOwnPageBytes, Tr::kGroupBytes),
            kk > 0);
    wgmma_commit();
    wgmma_wait<0>(acc);
    row_base = 64 * m_slice + 16 * (warp_id() & 3);
}

// kAtomicDq: dq[rows of one query block] += scale * dS K over the CTA's keys
// (dq_slice), by every thread's float atomics.  dq points at the block's first
// query row.
template <class Tr, typename T>
__device__ __forceinline__ void add_dq_atomically(float* dq, int64_t row_stride, const T* sdS, const T* sK,
                                                  float scale, int rows_valid, int cols_valid) {
    float acc[Tr::kRows][Tr::kDqCols / 4];
    int row_base, col0;
    dq_slice<Tr>(acc, sdS, sK, row_base, col0);
    // A lane's columns come in pairs (c even: 2t, 2t + 1 of an 8-column group),
    // added by one vector reduction: every row of dq starts 8-byte aligned (the
    // dispatcher's condition, cupyflash/_gpu_bwd.py) and cols_valid is even
    // (16-byte rows of q), so a pair is whole or past d.
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        const int row = row_base + fragment_row(r);
        if (row >= rows_valid) continue;
#pragma unroll
        for (int c = 0; c < Tr::kDqCols / 4; c += 2) {
            const int col = col0 + fragment_col(c);
            if (col < cols_valid)
                red_add_v2(dq + row * row_stride + col, acc[r][c] * scale, acc[r][c + 1] * scale);
        }
    }
}

// kBulkDq: scale * dS K (dq_slice) into the float tile sdQ ([query row][kDqStride]),
// every row and column of the block (those past the valid ones are never sent).
// The caller fences the async proxy and publishes the tile to warp 0.
template <class Tr, typename T>
__device__ __forceinline__ void stage_dq(float* sdQ, const T* sdS, const T* sK, float scale) {
    float acc[Tr::kRows][Tr::kDqCols / 4];
    int row_base, col0;
    dq_slice<Tr>(acc, sdS, sK, row_base, col0);
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r) {
        float* row = sdQ + (row_base + fragment_row(r)) * Tr::kDqStride + col0;
#pragma unroll
        for (int c = 0; c < Tr::kDqCols / 4; c += 2)
            *reinterpret_cast<float2*>(row + fragment_col(c)) = make_float2(acc[r][c] * scale, acc[r][c + 1] * scale);
    }
}

// kBulkDq, warp 0: dq[row] += sdQ[row] for the block's rows_valid query rows,
// cols_valid floats each (a multiple of 4: 16-byte rows of q), one bulk
// reduction per row and one bulk group per lane.  dq points at the block's
// first query row; its rows start 16-byte aligned (the dispatcher's condition).
template <class Tr>
__device__ __forceinline__ void send_dq(float* dq, int64_t row_stride, const float* sdQ, int rows_valid,
                                        int cols_valid) {
    for (int row = lane_id(); row < rows_valid; row += 32)
        bulk_reduce_add_f32(dq + row * row_stride, sdQ + row * Tr::kDqStride, static_cast<uint32_t>(cols_valid) * 4u);
    bulk_commit();
}

// kOrderedDq: key block n_block's (keys from n0) turn in query block m_block is
// n_block when the key block before it also adds into m_block (that block posts
// n_block), else 0 (the semaphore's value before any post).  A query block's key
// blocks are consecutive (KeyBlock's first and last rows grow with the key block),
// so the one before ours adds into m_block (>= our first query block >= its first)
// exactly when m_block lies below its m_end, which this returns (0 for key block 0).
template <int kBlockN, int kBlockM>
__device__ __forceinline__ int turn_bound(const FwdParams& p, const WindowMask& mask, int64_t n_block, int64_t n0) {
    if (n_block == 0) return 0;
    const KeyBlock before(p, mask, n0 - kBlockN, kBlockN);
    return static_cast<int>(before.m_end(kBlockM));
}

// kOrderedDq: the semaphore of (batch, query head, query block m_block) in
// BwdParams::dq_turns, laid out over the launch's longest sequence.
template <int kBlockM>
__device__ __forceinline__ int* dq_turns_of(const BwdParams& launch, int64_t batch, int64_t head, int64_t m_block) {
    const int64_t m_blocks = (launch.fwd.seqlen_q + kBlockM - 1) / kBlockM;
    return launch.dq_turns + (batch * launch.fwd.heads_q + head) * m_blocks + m_block;
}

// ---- the decoupled dK/dV kernel (kDecoupled) ------------------------------------------------

// Its producer: a warpgroup after the consumers (registers are allocated per
// SM quarter, so a 9th warp would cap every thread at 168 registers as a
// whole warpgroup does; only a warpgroup can give them back, setmaxnreg).
constexpr int kDkdvProducerThreads = 128;
// Registers per thread after the reallocation: 24 + 2 x 240 = 504 of the 512 =
// 65536 / 128 a thread slot of a CTA of 384 has (each warpgroup starts at 168;
// counts are multiples of 8).  The producer's rolled copies fit in 24; the
// consumers' 240 hold half the coupled kernel's streamed rows without spills
// (NVRTC 13.5: the coupled tiles spilled 48 B at d = 64, 36 B at d = 128;
// 32/232 and 40/232 spilled more).
constexpr int kDkdvProducerRegs = 24, kDkdvConsumerRegs = 240;
static_assert(kDkdvProducerRegs + 2 * kDkdvConsumerRegs <= 65536 / 128, "the register file of 3 x 128 threads");

// The decoupled kernel's barriers, after the statistics.  The CTA's query
// blocks i = 0, 1, ... (head by head) take stage i & 1; phase u of a stage's
// barriers belongs to block 2 u + stage.  full: the producer's threads arrive
// once their copies of the block (Q, dO, before the first block also K and V)
// have landed and they have stored its rows' statistics; empty: the consumer
// threads arrive once their products have read it.
struct DkdvStageBarriers {
    uint64_t full[2], empty[2];

    __device__ void init(int consumers) {
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(&full[s], kDkdvProducerThreads);
            mbarrier_init(&empty[s], consumers);
        }
    }
};

// Threads and dynamic shared memory of an instantiation: the decoupled kernel
// adds its producer warpgroup and its barriers (at kDqOffset: no dQ tile).
template <class Tr, bool kDecoupled>
struct WgmmaBwdLaunch {
    static_assert(!kDecoupled || (Tr::kGrads == (kGradDV | kGradDK) && Tr::kWarpGroups == 2),
                  "decoupled: dK and dV of the deterministic path, two consumer warpgroups");
    static constexpr int kThreads = Tr::kThreads + (kDecoupled ? kDkdvProducerThreads : 0);
    static constexpr int kSmemBytes = Tr::kSmemBytes + (kDecoupled ? static_cast<int>(sizeof(DkdvStageBarriers)) : 0);
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// The producer warpgroup: K and V, then Q, dO and the statistics of every
// query block the keys see into stage i & 1, each once the consumers have
// freed it.  The newest block stays in flight while the one before it is
// published, and before blocking on a busy stage a thread publishes
// everything it has issued.
template <class Tr, typename T>
__device__ __forceinline__ void produce_query_blocks(const QueryStream<Tr, T>& queries, const HeadSlice<T, float>& kv,
                                                     const FwdParams& p, const KeyBlock& block, T* sK, T* sV,
                                                     DkdvStageBarriers& bars, int64_t first_head, int64_t head_end,
                                                     int64_t m_begin, int64_t m_end) {
    using Own = typename Tr::OwnTile;
    if (m_begin >= m_end) return;  // no products: K and V are not needed
    const int thread = static_cast<int>(threadIdx.x) - Tr::kThreads;  // 0 .. kDkdvProducerThreads - 1
    cp_async_tile_by<kDkdvProducerThreads, Own, false, true>(thread, sK, kv.k, block.n0, p.k_row_stride, block.keys,
                                                             queries.d);
    cp_async_tile_by<kDkdvProducerThreads, Own, false, true>(thread, sV, kv.v, block.n0, p.v_row_stride, block.keys,
                                                             queries.d);
    cp_async_commit();
    uint64_t* unpublished = nullptr;  // the full barrier of the newest block, not yet published
    int i = 0;
    for (int64_t head = first_head; head < head_end; ++head) {
        for (int64_t m_block = m_begin; m_block < m_end; ++m_block, ++i) {
            const int stage = i & 1, use = i >> 1;
            if (use > 0) {  // the stage's previous block read by every consumer
                const uint32_t parity = static_cast<uint32_t>(use - 1) & 1;
                if (!mbarrier_try_wait_parity(&bars.empty[stage], parity)) {
                    if (unpublished != nullptr) publish_copies<0>(unpublished);
                    unpublished = nullptr;
                    mbarrier_wait_parity(&bars.empty[stage], parity);
                }
            }
            queries.template copy_tiles_by<kDkdvProducerThreads, true>(thread, stage, head, m_block);
            cp_async_commit();
            queries.template stage_stats_by<kDkdvProducerThreads>(thread, stage, head, m_block);
            if (unpublished != nullptr) publish_copies<1>(unpublished);
            unpublished = &bars.full[stage];
        }
    }
    publish_copies<0>(unpublished);
}

// ---- kernels ---------------------------------------------------------------------------------

// dK and/or dV (kGrads; with kGradDQAtomic, dQ by atomics too) of kBlockN keys
// of one (batch, kv head).  No whole-stream instantiation (bwd_mma's kWholeStream):
// at 255 registers, dropping the Q and dO copies' bounds made ptxas spend more
// instructions than it saved (d = 128: 1,538 -> 1,631 per streamed block).
//
// kDecoupled: warp specialisation (opt-in, KernelOptions.decoupled; kGrads =
// kGradDV | kGradDK, two warpgroups).  A producer warpgroup (warpgroup
// kWarpGroups, produce_query_blocks) copies K and V, then Q, dO and the
// statistics of every query block, and the warpgroups consume them through
// per-stage full / empty mbarriers, each at its own pace, in place of "wait
// for every copy, then __syncthreads" per block; the consumers run no copy
// code.  They take turns to issue a block's S^T and dP^T (named barriers
// kTurnBarrier + wg, producer.cuh; warpgroup 1 gives warpgroup 0 the first
// turn and passes none after its last), so that one warpgroup's P^T and dS^T
// run while the other's products are in the tensor cores.  The products, and
// so dK and dV, are the coupled kernel's.
template <typename T, int kHeadDim, int kBlockN, int kBlockM, int kWarpGroups, int kGrads, bool kDecoupled = false>
__global__ void __launch_bounds__(
    (WgmmaBwdLaunch<WgmmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarpGroups, kGrads>, kDecoupled>::kThreads), 1)
bwd_wgmma_dkdv_kernel(const BwdParams launch) {
    using Tr = WgmmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarpGroups, kGrads>;
    using Own = typename Tr::OwnTile;
    constexpr bool kDV = Tr::kDV, kDK = Tr::kDK, kAtomicDq = Tr::kAtomicDq;

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
    const int row0 = warp_id() * 16;             // the warp's first key in the K tile
    const int wg_row0 = (warp_id() >> 2) * 64;   // its warpgroup's
    const int64_t first_head = tile.head_kv * p.gqa_ratio;

    char* smem = dynamic_smem();
    smem += (1024 - (smem_addr(smem) & 1023)) & 1023;  // 128-byte swizzle atoms are 1024-byte aligned
    T* const sK = reinterpret_cast<T*>(smem);
    T* const sV = sK + Own::kElements;  // kDK only
    const QueryStream<Tr, T> queries{params, tile.batch, d, sK + (kDK ? 2 : 1) * Own::kElements,
                                     reinterpret_cast<float*>(smem + Tr::kStatsOffset)};  // 2 x (Q, dO), (lse, delta)
    T* const sdS = reinterpret_cast<T*>(smem + Tr::kDsOffset);  // kAtomicDq only
    float* const sdQ = reinterpret_cast<float*>(smem + Tr::kDqOffset);  // kBulkDq only

    // The query blocks that see these keys, head by head through the kv head's group.
    const int64_t m_begin = block.m_begin(kBlockM), m_end = block.m_end(kBlockM);
    const int64_t head_end = first_head + p.gqa_ratio;
    const int turn_below = Tr::kOrderedDq ? turn_bound<kBlockN, kBlockM>(p, mask, tile.n_block, block.n0) : 0;
    const HeadSlice<T, float> kv(p, tile.batch, first_head);
    DkdvStageBarriers* const bars = reinterpret_cast<DkdvStageBarriers*>(smem + Tr::kDqOffset);  // kDecoupled only
    if constexpr (kDecoupled) {
        if (threadIdx.x == 0) bars->init(Tr::kThreads);
        __syncthreads();
        if (warp_id() >= Tr::kWarps) {  // the producer
            setmaxnreg_dec<kDkdvProducerRegs>();
            produce_query_blocks<Tr>(queries, kv, p, block, sK, sV, *bars, first_head, head_end, m_begin, m_end);
            return;
        }
        setmaxnreg_inc<kDkdvConsumerRegs>();
        // warpgroup 0 takes the first turn (producer.cuh's kTurnBarrier)
        if (warp_id() >> 2 == 1 && m_begin < m_end) named_barrier_arrive(kTurnBarrier, 2 * 128);
    } else {
        cp_async_tile<Tr::kThreads, Own>(sK, kv.k, block.n0, p.k_row_stride, block.keys, d);
        if constexpr (kDK) cp_async_tile<Tr::kThreads, Own>(sV, kv.v, block.n0, p.v_row_stride, block.keys, d);
        cp_async_commit();
        if (m_begin < m_end) {
            float lse_log2, delta;
            queries.issue(0, first_head, m_begin, lse_log2, delta);
            if (threadIdx.x < kBlockM) queries.store_stats(0, lse_log2, delta);
        }
    }

    float dk[Tr::kRows][Tr::kGCols] = {};
    float dv[Tr::kRows][Tr::kGCols] = {};
    int stage = 0;  // the buffers of the current block
    uint32_t walked = 0;  // kDecoupled: the blocks done (stage = walked & 1; its barriers' phase)
    for (int64_t head = first_head; head < head_end; ++head) {
        for (int64_t m_block = m_begin; m_block < m_end; ++m_block) {
            if constexpr (kDecoupled) {
                stage = static_cast<int>(walked & 1);
                mbarrier_wait_parity(&bars->full[stage], (walked >> 1) & 1);  // this block's Q, dO, lse, delta visible
                named_barrier_sync(kTurnBarrier + (warp_id() >> 2), 2 * 128);  // this warpgroup's turn
            } else {
                cp_async_wait<0>();
                fence_proxy_async_shared();
                __syncthreads();  // this block's Q, dO, lse, delta visible; every wgmma on the other stage retired
            }
            float next_lse_log2 = 0.0f, next_delta = 0.0f;
            const bool head_done = m_block + 1 == m_end;
            const bool has_next = !head_done || head + 1 < head_end;
            const int64_t next_head = head_done ? head + 1 : head, next_m = head_done ? m_begin : m_block + 1;
            // (the atomic-dQ kernel loads the statistics before the products: after
            // them, its d = 128 row spilled 4 bytes)
            if (kAtomicDq && has_next) queries.load_stats(next_head, next_m, next_lse_log2, next_delta);
            const T* sQ = queries.q(stage);
            const T* sdO = queries.dout(stage);
            const float* sLse = queries.stats_lse_log2(stage);
            const float* sDelta = queries.stats_delta(stage);
            const auto lse_of = [sLse](int, int c) { return sLse[fragment_col(c)]; };  // by query column
            const auto delta_of = [sDelta](int, int c) { return sDelta[fragment_col(c)]; };
            const int64_t m0 = m_block * kBlockM;

            float s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
            wgmma_fence();
            wgmma_own_stream<Tr>(s, sK, sQ, wg_row0);      // S^T = K Q^T
            wgmma_commit();
            if constexpr (kDK) {
                wgmma_own_stream<Tr>(dp, sV, sdO, wg_row0);  // dP^T = V dO^T
                wgmma_commit();
            }
            if constexpr (kDecoupled) {  // the other warpgroup's turn (none after warpgroup 1's last)
                if (warp_id() >> 2 == 0 || has_next) named_barrier_arrive(kTurnBarrier + 1 - (warp_id() >> 2), 2 * 128);
            }
            // The next block's copies go out behind the products, into the other
            // stage, which no product in flight reads: their address arithmetic
            // (about 200 instructions a warp) no longer delays the tensor cores.
            if (!kDecoupled && has_next && !(kBwdTimingNoCopy && (head != first_head || m_block > m_begin)))
                queries.issue_tiles(stage ^ 1, next_head, next_m);
            if (!kDecoupled && !kAtomicDq && has_next) queries.load_stats(next_head, next_m, next_lse_log2, next_delta);
            if constexpr (kDK) wgmma_wait<1>(s);           // S^T
            else wgmma_wait<0>(s);
            auto chain = chain_for(s);
            probability_epilogue<WindowRule<true>, false, Walk::kByElement>(  // P^T
                s, Wgmma64Fragment{}, mask, p, ScoreTile{tile.batch, head, m0, block.n0, row0, kBlockN},
                [&] { return block.needs_mask(p, mask, m0, kBlockM, kBlockN); }, lse_of, scale_log2, chain);
            // The A operands live until the wait that retires their products.
            uint32_t a[Tr::kStreamSteps][4], ds[Tr::kStreamSteps][4];
            if constexpr (kDV) {
                pack_a<Tr, T>(a, s);
                wgmma_accumulate<Tr>(dv, a, sdO);          // dV += P^T dO
            }
            if constexpr (kDK) {
                if constexpr (kDV) wgmma_wait<1>(dp); else wgmma_wait<0>(dp);  // dP^T (dV still in flight)
                score_gradient<Tr>(dp, s, delta_of);       // dS^T
                gradient_epilogue<float>(dp, s, chain, Wgmma64Fragment{}, params,
                                         ScoreTile{tile.batch, head, m0, block.n0, row0, kBlockN});
                pack_a<Tr, T>(ds, dp);
                if constexpr (kAtomicDq) store_accumulators<typename Tr::DsTile>(sdS, dp, row0);  // rounded as ds
                wgmma_accumulate<Tr>(dk, ds, sQ);          // dK += dS^T Q
            }
            if constexpr (kDV && kDK) wgmma_wait<0>(dv, a, dk, ds);
            else if constexpr (kDV) wgmma_wait<0>(dv, a);
            else wgmma_wait<0>(dk, ds);
            if constexpr (kDecoupled) mbarrier_arrive(&bars->empty[stage]);  // the stage may be refilled
            if constexpr (kAtomicDq) {
                fence_proxy_async_shared();
                if constexpr (Tr::kBulkDq) {
                    if (warp_id() == 0) bulk_wait_read<0>();  // the last block's dQ read from sdQ
                }
                __syncthreads();  // every warpgroup's dS^T visible (the last block's dQ read it before the top
                                  // barrier), sdQ free again
                const GradSlice<T, float> grad(params, tile.batch, head);
                const int rows_valid = static_cast<int>(min64(kBlockM, p.seqlen_q - m0));
                if constexpr (Tr::kBulkDq) {
                    stage_dq<Tr>(sdQ, sdS, sK, static_cast<float>(p.scale));
                    fence_proxy_async_shared();  // the tile's stores before the bulk reads
                    // Every warp's rows staged; warp 0 sends them.  The barrier before the
                    // next block's dQ orders the bulk reads before sdQ is written again, so
                    // the reads overlap the next block's products.  (Only warp 0 waiting
                    // here, the others arriving at a named barrier, spilled 8 bytes at
                    // d = 128.)
                    __syncthreads();
                    if (warp_id() == 0) {
                        if constexpr (Tr::kOrderedDq) {
                            if (lane_id() == 0)
                                semaphore_wait(dq_turns_of<kBlockM>(launch, tile.batch, head, m_block),
                                               m_block < turn_below ? static_cast<int>(tile.n_block) : 0);
                            __syncwarp();  // lane 0's acquire before every lane's reductions
                            fence_proxy_async_global();  // ... which go through the async proxy
                        }
                        send_dq<Tr>(grad.dq + m0 * params.dq_row_stride, params.dq_row_stride, sdQ, rows_valid, d);
                        if constexpr (Tr::kOrderedDq) {
                            bulk_wait<0>();  // this lane's additions complete
                            fence_proxy_async_global();  // ... for the generic proxy too
                            __syncwarp();    // ... every lane's, before lane 0 posts
                            if (lane_id() == 0)
                                semaphore_post(dq_turns_of<kBlockM>(launch, tile.batch, head, m_block),
                                               static_cast<int>(tile.n_block) + 1);
                        }
                    }
                } else {
                    add_dq_atomically<Tr>(grad.dq + m0 * params.dq_row_stride, params.dq_row_stride, sdS, sK,
                                          static_cast<float>(p.scale), rows_valid, d);
                }
            }
            // the other stage's statistics were last read before this block's barrier
            if (!kDecoupled && has_next && threadIdx.x < kBlockM) queries.store_stats(stage ^ 1, next_lse_log2, next_delta);
            if constexpr (kDecoupled) ++walked;
            else stage ^= 1;
        }
    }
    if constexpr (!kDecoupled) cp_async_wait<0>();  // without a query block, K and V were never waited for
    if constexpr (Tr::kBulkDq) {
        if (warp_id() == 0) bulk_wait<0>();  // sdQ read before the CTA's shared memory goes
    }

    const GradSlice<T, float> kv_grad(params, tile.batch, first_head);
    const int keys_valid = block.keys - row0;
    if constexpr (kDK)
        store_gradient<Tr>(kv_grad.dk + (block.n0 + row0) * params.dk_row_stride, params.dk_row_stride, dk,
                           static_cast<float>(p.scale), keys_valid, d);
    if constexpr (kDV)
        store_gradient<Tr>(kv_grad.dv + (block.n0 + row0) * params.dv_row_stride, params.dv_row_stride, dv, 1.0f,
                           keys_valid, static_cast<int>(p.head_dim_v));
}

// bwd_wgmma_dkdv_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockN, int kBlockM, int kWarpGroups, int kGrads, bool kDecoupled = false>
constexpr int bwd_wgmma_dkdv_kernel_smem() {
    return WgmmaBwdLaunch<WgmmaBwdTraits<T, kHeadDim, kBlockN, kBlockM, kWarpGroups, kGrads>, kDecoupled>::kSmemBytes;
}

// dQ of kBlockM query rows of one (batch, query head).  kWholeStream: every
// key block complete and d the bucket (Lk a multiple of kBlockN): the K and V
// copies skip their bounds.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarpGroups, bool kWholeStream = false>
__global__ void __launch_bounds__(
    (WgmmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarpGroups, kGradDV | kGradDK>::kThreads), 1)
bwd_wgmma_dq_kernel(const BwdParams launch) {
    using Tr = WgmmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarpGroups, kGradDV | kGradDK>;  // two own tiles
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
    const int row0 = warp_id() * 16;             // the warp's first row in the Q tile
    const int wg_row0 = (warp_id() >> 2) * 64;   // its warpgroup's

    char* smem = dynamic_smem();
    smem += (1024 - (smem_addr(smem) & 1023)) & 1023;
    T* const sQ = reinterpret_cast<T*>(smem);
    T* const sdO = sQ + Own::kElements;
    const KeyStream<Tr, T, kWholeStream> keys{p, head.k, head.v, d, sdO + Own::kElements};  // 2 x (K, V)

    const int64_t n_begin = block.n_begin(kBlockN), n_end = block.n_end(kBlockN);
    cp_async_tile<Tr::kThreads, Own>(sQ, head.q, block.m0, p.q_row_stride, block.rows, d);
    cp_async_tile<Tr::kThreads, Own>(sdO, grad.dout, block.m0, params.dout_row_stride, block.rows, d);
    if (n_begin < n_end) keys.issue(0, n_begin);
    cp_async_commit();

    float lse_log2[Tr::kRows], delta[Tr::kRows];
#pragma unroll
    for (int r = 0; r < Tr::kRows; ++r)
        query_stats(lse_log2[r], delta[r], head.lse, p.lse_row_stride, grad.delta, params.delta_row_stride,
                    block.m0 + row0 + fragment_row(r), p.seqlen_q);
    const auto lse_of = [&lse_log2](int r, int) { return lse_log2[r]; };  // by query row
    const auto delta_of = [&delta](int r, int) { return delta[r]; };

    float dq[Tr::kRows][Tr::kGCols] = {};
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = static_cast<int>((n_block - n_begin) & 1);
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();  // this block's K, V (the first time Q, dO) visible; the other stage's wgmma retired
        if (n_block + 1 < n_end && !(kBwdTimingNoCopy && n_block > n_begin)) {
            keys.issue(stage ^ 1, n_block + 1);
            cp_async_commit();
        }
        const T* sK = keys.k(stage);
        const T* sV = keys.v(stage);
        const int64_t n0 = n_block * kBlockN;

        float s[Tr::kRows][Tr::kSCols], dp[Tr::kRows][Tr::kSCols];
        wgmma_fence();
        wgmma_own_stream<Tr>(s, sQ, sK, wg_row0);      // S = Q K^T
        wgmma_commit();
        wgmma_own_stream<Tr>(dp, sdO, sV, wg_row0);    // dP = dO V^T
        wgmma_commit();
        wgmma_wait<1>(s);                              // S
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<true>, true>(                      // P
            s, Wgmma64Fragment{}, mask, p, ScoreTile{tile.batch, tile.head, block.m0 + row0, n0, 0, kBlockN},
            [&] { return block.needs_mask(mask, n0, kBlockN); }, lse_of, scale_log2, chain);
        wgmma_wait<0>(dp);                             // dP
        score_gradient<Tr>(dp, s, delta_of);           // dS
        gradient_epilogue(dp, s, chain);
        uint32_t a[Tr::kStreamSteps][4];
        pack_a<Tr, T>(a, dp);
        wgmma_accumulate<Tr>(dq, a, sK);               // dQ += dS K
        wgmma_wait<0>(dq, a);
    }
    cp_async_wait<0>();  // without a key block, Q and dO were never waited for

    store_gradient<Tr>(grad.dq + (block.m0 + row0) * params.dq_row_stride, params.dq_row_stride, dq,
                       static_cast<float>(p.scale), block.rows - row0, d);
}

// bwd_wgmma_dq_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarpGroups, bool kWholeStream = false>
constexpr int bwd_wgmma_dq_kernel_smem() {
    return WgmmaBwdTraits<T, kHeadDim, kBlockM, kBlockN, kWarpGroups, kGradDV | kGradDK>::kSmemBytes;
}

}  // namespace cf
