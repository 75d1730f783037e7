// fwd_wgmma.cu -- the Hopper forward kernel: FlashAttention-2's algorithm on
// wgmma.mma_async (float16 / bfloat16 inputs, float32 accumulation), sm_90a.
//
// A CTA owns kBlockM = 64 kWarpGroups query rows of one (batch, head); each
// warpgroup owns 64 of them, each warp 16 (the rows of its m64 slice).  Q
// stays in shared memory for the whole kernel and is read by the tensor cores
// directly; K and V blocks of kBlockN keys stream through a double buffer
// filled by cp.async (every thread copying), V one block behind K.  Per key
// block, every warpgroup computes
//     S = Q K^T        wgmma, A = Q and B = K from shared memory (K-major),
//                      d / 16 steps of m64 n(kBlockN) k16 into registers
//     mask             only on blocks that cross a mask boundary
//     softmax          softmax.cuh on each warp's rows, as fwd_mma
//     O += P V         wgmma, A = P from registers (the score accumulators
//                      rounded and re-packed, no shared-memory round trip),
//                      B = V from shared memory (MN-major, transposed by the
//                      tensor core); kBlockN / 16 steps of m64 n(d) k16
// and divides O by l once, at the end; the epilogue is fwd_mma's.
//
// Software pipelining inside a warpgroup (FlashAttention-3's intra-warpgroup
// overlap): block n's S = Q K(n)^T and block n - 1's O += P(n - 1) V(n - 1) are
// issued back to back as two commit groups; the warpgroup waits for S only
// and runs block n's mask and softmax while the tensor cores do the P V
// product.  The softmax's rescale of O waits until that product retires
// (OnlineSoftmax hands back the factors), then P(n) is packed for the next
// block.  The first block's S and the last block's P V stand outside the loop.
// Two warpgroups per CTA add the overlap of one's softmax with the other's
// products.  Split-KV (the kSplit instantiations) as in fwd_mma: CTA (x, y)
// visits the y-th run of its key blocks and writes float partial results
// (store_partial).
//
// Every shared tile is a SwizzledTile of 64-column pages, which is wgmma's
// 128-byte-swizzle layout (wgmma.cuh); the tiles start 1024-byte aligned.
// Needs head dims that are multiples of 64; rows and columns past the
// run-time sizes are zero-filled by cp.async, as in fwd_mma.  The dispatcher
// guarantees 16-byte aligned rows, dv == d and scale > 0 (cupyflash/_gpu.py).
#pragma once

#include "barriers.cuh"
#include "block_info.cuh"
#include "fwd_blocks.cuh"
#include "mma_tile.cuh"
#include "params.cuh"
#include "producer.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace cf {

// Timing-only builds (benchmarks/gpu_first_contact.py's A/B table through
// KernelOptions.timing; never dispatched): CF_TIMING_NO_EXP leaves out the
// softmax (the raw scores become P), CF_TIMING_NO_COPY every K/V copy after
// the first two blocks (the products re-read those buffers).  Their outputs
// are meaningless; their time against the real kernel's is what the
// exponentials and the copies cost.  CF_TIMING_BEFORE_FIXES builds the loop
// as it was before issue 32's fixes 1 and 2 -- the wait for P V in the same
// basic block as the softmax (ptxas then hoists it above the exponentials) and
// the next block's copies issued before the products -- with the same outputs
// (tests/test_wgmma_schedule.py shows its SASS failing both schedule rules).
#ifndef CF_TIMING_NO_EXP
#define CF_TIMING_NO_EXP 0
#endif
#ifndef CF_TIMING_NO_COPY
#define CF_TIMING_NO_COPY 0
#endif
#ifndef CF_TIMING_BEFORE_FIXES
#define CF_TIMING_BEFORE_FIXES 0
#endif
constexpr bool kTimingNoExp = CF_TIMING_NO_EXP != 0;
constexpr bool kTimingNoCopy = CF_TIMING_NO_COPY != 0;
constexpr bool kTimingBeforeFixes = CF_TIMING_BEFORE_FIXES != 0;

// Every compile-time quantity of one instantiation (the table with the
// reason for each row: _WGMMA_TILES in cupyflash/_kernels.py).
template <typename T, int kHeadDim_, int kBlockN_, int kWarpGroups_, bool kLazyRescale_>
struct WgmmaFwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kWarpGroups = kWarpGroups_;
    static constexpr bool kLazyRescale = kLazyRescale_;
    static constexpr int kBlockM = 64 * kWarpGroups;
    static constexpr int kWarps = 4 * kWarpGroups;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kStages = 2;                   // K/V double buffer
    static constexpr int kWarpRows = 16;                // a warp's rows of its warpgroup's m64 slice
    static constexpr int kMTiles = 1;
    static constexpr int kRows = 2;                     // accumulator rows per lane (g, g + 8)
    static constexpr int kSCols = kBlockN / 4;          // score columns per lane and row
    static constexpr int kOCols = kHeadDim / 4;         // output columns per lane and row
    static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of S = Q K^T
    static constexpr int kKeySteps = kBlockN / 16;      // k16 steps of O = P V

    using QTile = SwizzledTile<kBlockM, kHeadDim>;      // Q, later the output staging
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;

    // Q, then kStages x (K, V); plus 1 KB to align the start to 1024 bytes.
    static constexpr int kSmemBytes =
        (QTile::kElements + 2 * kStages * KVTile::kElements) * static_cast<int>(sizeof(T)) + 1024;

    // Descriptor strides (wgmma.cuh): 8-row groups 1024 bytes apart; an
    // MN-major V page (64 columns) is kBlockN lines of 128 bytes.
    static constexpr uint32_t kGroupBytes = 1024;
    static constexpr uint32_t kVPageBytes = kBlockN * 128;

    static_assert(sizeof(T) == 2, "float16 / bfloat16 only");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dim: whole 64-column pages, at most 256");
    static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "block_n: an n of wgmma (whole 64-row V pages)");
    static_assert(kWarpGroups >= 1 && kWarpGroups <= 3, "1 to 3 warpgroups");
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// s = Q K^T (unscaled) for the warpgroup's 64 rows (from row wg_row0 of the Q tile):
// one commit group; the caller fences before and waits after.
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_qk(float (&s)[Tr::kRows][Tr::kSCols], const T* sQ, const T* sK,
                                         int wg_row0) {
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
        const uint64_t a = wgmma_desc_sw128(sQ + Tr::QTile::chunk(wg_row0, 2 * ks), 16, Tr::kGroupBytes);
        const uint64_t b = wgmma_desc_sw128(sK + Tr::KVTile::chunk(0, 2 * ks), 16, Tr::kGroupBytes);
        Wgmma<T, Tr::kBlockN>::ss(s, a, b, ks > 0);
    }
    wgmma_commit();
}

// o += P V, P as A operands in registers: one commit group, likewise.
template <class Tr, typename T>
__device__ __forceinline__ void wgmma_pv(float (&o)[Tr::kRows][Tr::kOCols],
                                         const uint32_t (&p)[Tr::kKeySteps][Tr::kMTiles][4], const T* sV) {
#pragma unroll
    for (int kk = 0; kk < Tr::kKeySteps; ++kk) {
        const uint64_t b = wgmma_desc_sw128(sV + Tr::KVTile::chunk(16 * kk, 0), Tr::kVPageBytes, Tr::kGroupBytes);
        Wgmma<T, Tr::kHeadDim>::rs_mn(o, p[kk][0], b, true);
    }
    wgmma_commit();
}

// The decoupled kernel's producer: a whole warpgroup, the last.  (One warp
// would do the copying, but registers are allocated per SM quarter: a ninth
// warp caps every thread at 168 registers, as a third warpgroup does.  A
// warpgroup can give its registers back, setmaxnreg, and a warp cannot.)
constexpr int kProducerThreads = 128;
// Registers per thread after the reallocation: the producer's 128 threads give
// up all but kProducerRegs, and each consumer warpgroup takes kConsumerRegs
// (2 x 232 + 40 = 504 of the 512 = 65536 / 128 a thread slot of a CTA of 384
// has; 232 = the coupled kernel's 214 with room; with 32 the producer spilled).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;

// The decoupled kernel's barriers (kDecoupled), after the K/V buffers.  Stage s
// holds K(n) and V(n) of the blocks n = n_begin + 2 u + s, u = 0, 1, ...: phase u
// of each barrier belongs to the u-th of them.  full_*: the producer's threads
// arrive once their copies of the tile have landed (the first K's also Q);
// empty_*: the consumer threads arrive once their products have read it.
struct FwdStageBarriers {
    uint64_t full_k[2], full_v[2];
    uint64_t empty_k[2], empty_v[2];

    __device__ void init(int consumers) {
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(&full_k[s], kProducerThreads);
            mbarrier_init(&full_v[s], kProducerThreads);
            mbarrier_init(&empty_k[s], consumers);
            mbarrier_init(&empty_v[s], consumers);
        }
    }
};

// Threads and dynamic shared memory of an instantiation: the decoupled kernel
// adds its producer warpgroup and its barriers.
template <class Tr, bool kDecoupled>
struct WgmmaFwdLaunch {
    static constexpr int kThreads = Tr::kThreads + (kDecoupled ? kProducerThreads : 0);
    static constexpr int kSmemBytes = Tr::kSmemBytes + (kDecoupled ? static_cast<int>(sizeof(FwdStageBarriers)) : 0);
    static_assert(kSmemBytes <= 227 * 1024, "within sm_90's 227 KB per block");
};

// The producer warpgroup of the decoupled kernel: Q with the first K, then K(n)
// and V(n) of every block into stage (n - n_begin) & 1, each tile once the
// consumers have freed its buffer.  The newest tile stays in flight while the
// previous one is published, and before blocking on a busy buffer a thread
// publishes everything it has issued.
template <class Tr, typename T, bool kWholeKV>
__device__ __forceinline__ void produce_blocks(const FwdParams& params, const HeadSlice<T, float>& in, T* sQ,
                                               const KVPipeline<Tr, T, kWholeKV>& kv, FwdStageBarriers& bars,
                                               int m_block, int n_begin, int n_end) {
    const int thread = static_cast<int>(threadIdx.x) - Tr::kThreads;  // 0 .. kProducerThreads - 1
    uint64_t* unpublished = nullptr;  // the full barrier of the newest tile, not yet published
    const auto publish_all = [&]() {
        if (unpublished != nullptr) publish_copies<0>(unpublished);
        unpublished = nullptr;
    };
    const auto acquire = [&](uint64_t* empty, int use) {  // the buffer's previous tile read by every consumer
        if (use == 0) return;
        const uint32_t parity = static_cast<uint32_t>(use - 1) & 1;
        if (!mbarrier_try_wait_parity(empty, parity)) {
            publish_all();
            mbarrier_wait_parity(empty, parity);
        }
    };
    const auto issued = [&](uint64_t* full) {  // after the tile's commit: publish the one before it
        if (unpublished != nullptr) publish_copies<1>(unpublished);
        unpublished = full;
    };
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int i = n_block - n_begin, stage = i & 1, use = i >> 1;
        acquire(&bars.empty_k[stage], use);
        if (i == 0) {
            const int64_t m0 = static_cast<int64_t>(m_block) * Tr::kBlockM;
            cp_async_tile_by<kProducerThreads, typename Tr::QTile, false, true>(thread, sQ, in.q, m0, params.q_row_stride,
                                                     static_cast<int>(min64(Tr::kBlockM, params.seqlen_q - m0)),
                                                     static_cast<int>(params.head_dim));
        }
        kv.template load_by<kProducerThreads, true>(thread, kv.k(stage), in.k, params.k_row_stride, n_block);
        cp_async_commit();
        issued(&bars.full_k[stage]);
        acquire(&bars.empty_v[stage], use);
        kv.template load_by<kProducerThreads, true>(thread, kv.v(stage), in.v, params.v_row_stride, n_block);
        cp_async_commit();
        issued(&bars.full_v[stage]);
    }
    publish_all();
}

// kSplit: the split-KV instantiation, as in fwd_mma (a run-time test tipped
// the 255-register d = 64 variant with 192-key blocks into spills).
//
// kWholeKV: the whole-KV instantiation, as in fwd_mma (Lk a multiple of
// kBlockN, d the bucket; cupyflash/_gpu.py checks both): K/V copies without
// bounds.  Bounds-checked, the copies of a key block take 279 of the ~780
// instructions a warp issues per block on the common path (d = 128).
//
// kDecoupled: warp specialisation (opt-in, KernelOptions.decoupled).  A
// producer warpgroup (warpgroup kWarpGroups) copies every tile (produce_blocks) and
// the warpgroups consume them through per-stage full / empty mbarriers, each
// at its own pace, in place of "wait for every copy, then __syncthreads" per
// block.  The warpgroups take turns to issue their products (ping-pong, named
// barriers kTurnBarrier + wg): warpgroup wg waits for its turn, issues S(n)
// and P(n - 1) V(n - 1), and passes the turn on, so one warpgroup's softmax
// runs while the other's products occupy the tensor cores.  Warpgroup 0 takes
// the first turn (the last one arrives at its barrier beforehand, and skips
// its pass after its last turn: every barrier phase has 128 waiting and 128
// arriving threads).
template <typename T, int kHeadDim, int kBlockN, int kWarpGroups, bool kLazyRescale, bool kSplit = false,
          bool kWholeKV = false, bool kDecoupled = false>
__global__ void __launch_bounds__(
    (WgmmaFwdLaunch<WgmmaFwdTraits<T, kHeadDim, kBlockN, kWarpGroups, kLazyRescale>, kDecoupled>::kThreads), 1)
fwd_wgmma_kernel(const FwdParams launch) {
    using Tr = WgmmaFwdTraits<T, kHeadDim, kBlockN, kWarpGroups, kLazyRescale>;
    static_assert(!(kDecoupled && kSplit), "the decoupled kernel has no split-KV instantiation");
    static_assert(!kDecoupled || kWarpGroups == 2, "ping-pong between two warpgroups");
    static_assert(!(kDecoupled && (kTimingNoExp || kTimingNoCopy || kTimingBeforeFixes)),
                  "timing-only builds are coupled");

    const TileIndex tile(launch, Tr::kBlockM, blockIdx.x);
    const FwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params, Tr::kBlockM)) return;
    }
    const int batch = static_cast<int>(tile.batch), head = static_cast<int>(tile.head);
    const int m_block = static_cast<int>(tile.m_block);
    const HeadSlice<T, float> in(params, batch, head);
    char* smem = dynamic_smem();
    smem += (1024 - (smem_addr(smem) & 1023)) & 1023;  // 128-byte swizzle atoms are 1024-byte aligned
    T* const sQ = reinterpret_cast<T*>(smem);  // Q, later the output staging
    const float scale_log2 = softmax_scale_log2<float>(params);  // 1 where a bias's epilogue scales
    const int row0 = warp_id() * Tr::kWarpRows;  // the warp's first row in the Q tile
    const int wg = warp_id() >> 2;               // its warpgroup
    const int wg_row0 = wg * 64;                 // and the warpgroup's first row

    const WindowMask mask(params);
    int n_begin, n_end;
    const UnmaskedBlocks unmasked = key_blocks<Tr>(params, m_block, n_begin, n_end);
    if constexpr (kSplit) split_key_blocks(params, blockIdx.y, n_begin, n_end);
    KVPipeline<Tr, T, kWholeKV> kv(params, in.k, in.v, sQ + Tr::QTile::kElements, n_end);  // buffers, copies
    FwdStageBarriers* const bars =
        reinterpret_cast<FwdStageBarriers*>(sQ + Tr::QTile::kElements + 2 * Tr::kStages * Tr::KVTile::kElements);
    if constexpr (kDecoupled) {
        if (threadIdx.x == 0) bars->init(Tr::kThreads);
        __syncthreads();
        if (wg == kWarpGroups) {  // the producer
            setmaxnreg_dec<kProducerRegs>();
            produce_blocks<Tr>(params, in, sQ, kv, *bars, m_block, n_begin, n_end);
            return;
        }
        setmaxnreg_inc<kConsumerRegs>();
        if (wg == kWarpGroups - 1 && n_begin < n_end) named_barrier_arrive(kTurnBarrier, 2 * 128);
    } else if (n_begin < n_end) {  // Q and the first block's K; its V comes with the next K
        const int64_t m0 = static_cast<int64_t>(m_block) * Tr::kBlockM;
        cp_async_tile<Tr::kThreads, typename Tr::QTile>(sQ, in.q, m0, params.q_row_stride,
                                                        static_cast<int>(min64(Tr::kBlockM, params.seqlen_q - m0)),
                                                        static_cast<int>(params.head_dim));
        kv.load(kv.k(0), in.k, params.k_row_stride, n_begin);
        cp_async_commit();
    }

    OnlineSoftmax<float, Tr::kRows, 4> softmax;
    float o[Tr::kRows][Tr::kOCols] = {};
    uint32_t p[Tr::kKeySteps][Tr::kMTiles][4];  // the previous block's P: A of its P V, in flight
    // Coupled: the copies of K(n + 1) and V(n), into the buffers of K(n - 1) and
    // V(n - 2), which no product of block n reads.
    const auto issue_copies = [&](int n_block, int stage) {
        if (kTimingNoCopy && n_block > n_begin + 1) return;
        if (n_block + 1 < n_end) kv.load(kv.k(stage ^ 1), in.k, params.k_row_stride, n_block + 1);
        kv.load(kv.v(stage), in.v, params.v_row_stride, n_block);
        cp_async_commit();
    };
    // Before the products of block n: K(n) and (with_values) V(n - 1) visible, and
    // every warpgroup done with K(n - 1) and V(n - 2) -- coupled: every copy
    // waited for and a CTA barrier; decoupled: the two tiles' full barriers, then
    // this warpgroup's turn.
    const auto wait_for_block = [&](int n_block, bool with_values) {
        if constexpr (kDecoupled) {
            const int i = n_block - n_begin;
            mbarrier_wait_parity(&bars->full_k[i & 1], static_cast<uint32_t>(i >> 1) & 1);
            if (with_values) mbarrier_wait_parity(&bars->full_v[(i - 1) & 1], static_cast<uint32_t>((i - 1) >> 1) & 1);
            named_barrier_sync(kTurnBarrier + wg, 2 * 128);
        } else {
            cp_async_wait<0>();
            fence_proxy_async_shared();
            __syncthreads();
            if constexpr (kTimingBeforeFixes) issue_copies(n_block, (n_block - n_begin) & 1);
        }
    };
    // Then, once block n's products are issued: coupled, the copies (issued after
    // the products, not before: their address arithmetic and bounds checks, about
    // 100 instructions a warp, no longer delay the tensor cores); decoupled, the
    // turn passes to the other warpgroup.
    const auto products_issued = [&](int n_block, int stage) {
        if constexpr (kDecoupled) {
            if (wg != kWarpGroups - 1 || n_block + 1 < n_end)
                named_barrier_arrive(kTurnBarrier + (wg + 1) % kWarpGroups, 2 * 128);
        } else if constexpr (!kTimingBeforeFixes) {
            issue_copies(n_block, stage);
        }
    };
    // Decoupled: this thread's products have read K or V of a stage (their wgmma
    // retired), which the producer may then refill.
    const auto keys_read = [&](int stage) {
        if constexpr (kDecoupled) mbarrier_arrive(&bars->empty_k[stage]);
    };
    const auto values_read = [&](int stage) {
        if constexpr (kDecoupled) mbarrier_arrive(&bars->empty_v[stage]);
    };
    // The mask and the softmax of block n's scores; o's rescale factors returned.
    const auto softmax_block = [&](float (&s)[Tr::kRows][Tr::kSCols], float (&rescale)[Tr::kRows], int n_block) {
        score_epilogue<BlockRule, true, Units::kRaw>(
            s, Wgmma64Fragment{}, mask, params,
            ScoreTile{batch, head, static_cast<int64_t>(m_block) * Tr::kBlockM + row0,
                      static_cast<int64_t>(n_block) * kBlockN, 0, kBlockN},
            unmasked.needs_mask(n_block));
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r) rescale[r] = 1.0f;
        if constexpr (!kTimingNoExp) softmax.template update_unscaled<Tr::kLazyRescale>(s, rescale, scale_log2);
    };
    if (n_begin < n_end) {  // block n_begin: S only
        wait_for_block(n_begin, false);
        float s[Tr::kRows][Tr::kSCols], rescale[Tr::kRows];
        wgmma_fence();
        wgmma_qk<Tr>(s, sQ, kv.k(0), wg_row0);
        products_issued(n_begin, 0);
        wgmma_wait<0>(s);
        keys_read(0);
        softmax_block(s, rescale, n_begin);  // o is still zero: no rescale
        scores_to_a<Tr, T>(p, s);
    }
    for (int n_block = n_begin + 1; n_block < n_end; ++n_block) {
        const int stage = (n_block - n_begin) & 1;  // K(n) in k(stage), V(n) in v(stage)
        wait_for_block(n_block, true);
        float s[Tr::kRows][Tr::kSCols], rescale[Tr::kRows];
        wgmma_fence();
        wgmma_qk<Tr>(s, sQ, kv.k(stage), wg_row0);   // S(n) = Q K(n)^T
        wgmma_pv<Tr>(o, p, kv.v(stage ^ 1));         // O += P(n - 1) V(n - 1), behind it
        products_issued(n_block, stage);
        wgmma_wait<1>(s);                            // S(n)
        keys_read(stage);
        softmax_block(s, rescale, n_block);          // while P V runs
        if constexpr (kTimingBeforeFixes) wgmma_wait<0>(o, p);
        else wgmma_wait_all_apart(n_block, o, p);    // O and P(n - 1) free
        values_read(stage ^ 1);
        bool moved = !Tr::kLazyRescale;
#pragma unroll
        for (int r = 0; r < Tr::kRows; ++r) moved |= rescale[r] != 1.0f;
        if (!Tr::kLazyRescale || __any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int r = 0; r < Tr::kRows; ++r) scale_in_place(o[r], rescale[r]);
        }
        scores_to_a<Tr, T>(p, s);
    }
    if (n_begin < n_end) {  // the last block's P V
        const int last = n_end - 1 - n_begin;
        if constexpr (kDecoupled) {
            mbarrier_wait_parity(&bars->full_v[last & 1], static_cast<uint32_t>(last >> 1) & 1);
        } else {
            cp_async_wait<0>();
            fence_proxy_async_shared();
            __syncthreads();  // its V visible
        }
        wgmma_fence();
        wgmma_pv<Tr>(o, p, kv.v(last & 1));
        wgmma_wait<0>(o, p);
        values_read(last & 1);
    }

    finish_output<Tr, kSplit>(params, batch, head, m_block, row0, sQ, softmax, o);
}

// fwd_wgmma_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kBlockN, int kWarpGroups, bool kLazyRescale, bool kSplit = false,
          bool kWholeKV = false, bool kDecoupled = false>
constexpr int fwd_wgmma_kernel_smem() {
    return WgmmaFwdLaunch<WgmmaFwdTraits<T, kHeadDim, kBlockN, kWarpGroups, kLazyRescale>, kDecoupled>::kSmemBytes;
}

}  // namespace cf
