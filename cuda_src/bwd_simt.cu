// bwd_simt.cu -- the portable backward kernels: FlashAttention-2's backward on CUDA cores.
//
// Any float type (half, bfloat16, float, double), any head dims up to the
// compile-time bucket; products in the accumulator type (float, double for
// double), so float32 is IEEE float32 and float64 is float64 throughout.
// The probabilities are recomputed from the forward's lse, never stored:
//     P  = exp2(S * scale * log2(e) - lse * log2(e))      S = Q K^T
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - delta)
//     dK = scale * dS^T Q                   dQ = scale * dS K
// with delta = rowsum(dO o O).  Three kernels, launched in this order:
//   bwd_simt_dot_do_o_kernel  delta, one 8-lane group per query row;
//   bwd_simt_dkdv_kernel      a CTA owns kBlockN keys of one kv head, keeps
//                             K, V in shared memory and dK, dV in registers,
//                             and streams the query blocks that see its keys,
//                             head by head through the kv head's query group;
//   bwd_simt_dq_kernel        a CTA owns kBlockM query rows, keeps Q, dO in
//                             shared memory and dQ in registers, and streams
//                             the key blocks its rows see.
// The main kernels keep their own rows in shared memory and load the streamed
// rows block by block; for float and double the next block is copied with
// cp.async while the current one is in use (StreamedTiles, two buffers).
// With deterministic=False (kAtomicDq, where the streamed block is a multiple
// of 16 rows) the dK/dV kernel also adds dQ with atomics and no dQ kernel runs.
// Otherwise every gradient element is summed by one thread in a fixed order (dK, dV
// over the group's query heads in order, then over query blocks in order), so
// results are bit-identical from run to run: no atomics.  The dQ pass pays
// for that by recomputing S and dP (7 block products per block pair instead
// of 5).
//
// Thread layout (kThreads = 128), as fwd_simt: 8 consecutive lanes share
// kRowsPerThread of the CTA's own rows (keys in dkdv, queries in dq) and
// split the streamed rows among themselves --
//   own row       ii * 16 + row_group      (row_group = tid / 8)
//   streamed row  jj * 8 + lane_in_group   (a column of the S, P, dP, dS tiles)
//   chunk         qq * 8 + lane_in_group   (16-byte chunks of a gradient row)
// A gradient row's update sums over the streamed rows; their P / dS values
// reach the 8 lanes of the row group through a small shared scratch tile.  Shared tiles hold the accumulator
// type in XOR-swizzled rows (tile_io.cuh), conflict-free both for the 8
// different rows of the score products and the 8 chunks of one row of the
// gradient updates.
#pragma once

#include "block_info.cuh"
#include "block_info_bwd.cuh"
#include "fragment.cuh"
#include "mask.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

// Every compile-time quantity of one instantiation.  kBlockOwn rows stay in
// shared memory for the whole CTA, kBlockStream rows are reloaded per block.
// The tile table, with the reason for each row, is _BWD_SIMT_TILES in
// cupyflash/_kernels.py.
template <typename T, int kHeadDim_, int kHeadDimV_, int kBlockOwn, int kBlockStream>
struct SimtBwdTraits {
    using Acc = acc_t<T>;
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
    static constexpr int kOwnRows = kBlockOwn, kStreamRows = kBlockStream;
    static constexpr int kThreads = 128;
    static constexpr int kLanesPerRow = 8;
    static constexpr int kRowGroups = kThreads / kLanesPerRow;
    static constexpr int kRowsPerThread = kBlockOwn / kRowGroups;
    static constexpr int kColsPerThread = kBlockStream / kLanesPerRow;
    static constexpr int kVec = Vec16<Acc>::kSize;
    static constexpr int kChunks = kHeadDim / kVec / kLanesPerRow;    // per thread, d-wide row
    static constexpr int kChunksV = kHeadDimV / kVec / kLanesPerRow;  // per thread, dv-wide row

    using Layout = SwizzledRows<Acc, kHeadDim>;    // Q, K
    using LayoutV = SwizzledRows<Acc, kHeadDimV>;  // dO, V

    // Shared memory (elements of Acc): the own rows' d- and dv-wide tiles and
    // the scratch tile, then kStages copies of the streamed rows' d- and
    // dv-wide tiles.
    static constexpr int kOwnD = kBlockOwn * kHeadDim;
    static constexpr int kOwnDv = kBlockOwn * kHeadDimV;
    static constexpr int kStreamD = kBlockStream * kHeadDim;
    static constexpr int kStreamDv = kBlockStream * kHeadDimV;
    static constexpr int kStageBytes = (kStreamD + kStreamDv) * static_cast<int>(sizeof(Acc));
    // The own rows' tiles, then a kBlockOwn x kSPitch scratch tile through
    // which P or dS reach the gradient updates (accumulate_rows); the pitch
    // is 8 more than the row, so that the 4 row groups of a warp store to
    // different banks.
    static constexpr int kSPitch = kBlockStream + 8;
    static constexpr int kScratch = kBlockOwn * kSPitch;
    static constexpr int kOwnBytes = (kOwnD + kOwnDv + kScratch) * static_cast<int>(sizeof(Acc));
    // float and double tiles need no conversion: the next streamed block is
    // copied with cp.async into a second buffer while the CTA computes on the
    // current one (kStages = 2), wherever the second buffer keeps the CTA
    // within 72 KB (3 CTAs per SM on an H100, 2 on an A100).  The 16-bit types convert on the way in: one buffer,
    // loaded between barriers.
    static constexpr int kStages =
        SameType<T, Acc>::value && kOwnBytes + 2 * kStageBytes <= 72 * 1024 ? 2 : 1;
    static constexpr bool kPipelined = kStages == 2;
    static constexpr int kSmemBytes = kOwnBytes + kStages * kStageBytes;
    // Occupancy target, which sets the register cap (65536 / (128 * n)): 4
    // CTAs per SM (128 registers) up to 32 KB, 3 (168) up to 48 KB -- up to
    // 53 KB for the pipelined tiles, which is the float d = 64 tile (three
    // such CTAs, with the 1 KB the driver reserves for each, fit an A100's
    // 164 KB; left to itself ptxas gives its dK/dV kernel 212 registers, 2
    // CTAs), while the 16-bit d = 128 tile (51 KB) spills at 168 under NVRTC
    // 13.0 -- 2 (255) up to 72 KB; the one tile above (float64, bucket 256)
    // runs 1 per SM on an A100.
    static constexpr int kMinBlocksPerSm = kSmemBytes > 72 * 1024                       ? 1
                                           : kSmemBytes > (kPipelined ? 53 : 48) * 1024 ? 2
                                           : kSmemBytes > 32 * 1024                     ? 3
                                                                                        : 4;

    static_assert(kBlockOwn % kRowGroups == 0, "own block: a multiple of 16 rows");
    static_assert(kBlockStream % kLanesPerRow == 0, "streamed block: a multiple of 8 rows");
    static_assert(kHeadDim % (kVec * kLanesPerRow) == 0, "head_dim bucket: whole chunks per lane");
    static_assert(kHeadDimV % (kVec * kLanesPerRow) == 0, "head_dim_v bucket: whole chunks per lane");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");
};

// This thread's place in the layout described at the top of the file.
template <class Tr>
using SimtBwdThread = SimtRowsFragment<Tr::kRowGroups, Tr::kLanesPerRow>;

// ---- block products ------------------------------------------------------------------------

// s[ii][jj] = <X[row(ii)], Y[col(jj)]>: X the own tile, Y the streamed tile,
// both `Layout`, walked in 16-byte chunks up to the run-time width (the tiles
// are zero beyond it).
template <class Tr, class Layout, typename Acc>
__device__ __forceinline__ void dot_rows(Acc (&s)[Tr::kRowsPerThread][Tr::kColsPerThread],
                                         const Acc* sX, const Acc* sY, const SimtBwdThread<Tr>& me,
                                         int width) {
    constexpr int TR = Tr::kRowsPerThread, TC = Tr::kColsPerThread;
#pragma unroll
    for (int ii = 0; ii < TR; ++ii)
#pragma unroll
        for (int jj = 0; jj < TC; ++jj) s[ii][jj] = Acc(0);
    const int chunks = (width + Tr::kVec - 1) / Tr::kVec;
    // One chunk per iteration keeps TR + TC vectors live, within the register cap.
#pragma unroll 1
    for (int q = 0; q < chunks; ++q) {
        Vec16<Acc> a[TR], b[TC];
#pragma unroll
        for (int ii = 0; ii < TR; ++ii) a[ii] = load_vec16(sX + Layout::chunk(me.row(ii), q));
#pragma unroll
        for (int jj = 0; jj < TC; ++jj) b[jj] = load_vec16(sY + Layout::chunk(me.col(jj), q));
#pragma unroll
        for (int ii = 0; ii < TR; ++ii)
#pragma unroll
            for (int jj = 0; jj < TC; ++jj)
#pragma unroll
                for (int e = 0; e < Tr::kVec; ++e) s[ii][jj] += a[ii].x[e] * b[jj].x[e];
    }
}

// acc[ii] += sum_c s[ii][c] * Z[c]: this thread's chunks of its own rows'
// gradient, summed over the streamed rows c in order.  s goes through the
// scratch tile: each thread stores its entries, then reads its own rows'
// values back by 16-byte vectors (the 8 lanes of a row group read the same
// address, a broadcast).  Own rows are private to their row group, so warp
// barriers order the stores and the loads (and the loads before the next
// call's stores).
//
// float: 8 streamed rows per iteration.  Z is a SwizzledRows tile, whose XOR
// pattern repeats every 8 rows: for row c8 + e with c8 a multiple of 8,
// (row & 7) == e, so this thread's chunk qq * 8 + lane_in_group of that row
// lies at
//     c8 * kRowElements + Layout::chunk(e, lane_in_group) + qq * 8 * kVec.
// The eight Layout::chunk(e, lane_in_group) are fixed for the whole loop, so
// each Z load costs at most one add, where Layout::chunk(c + e, chunk(qq))
// costs 4-5 integer instructions.
// double: kVec = 2 rows per iteration (one for the 256-wide tiles), each
// load's address computed in full.  The 8-row form hoists twice as many
// 16-byte Z loads, which costs the d = 32 dK/dV and d = 64 dQ tiles a CTA per
// SM on an H100, and a DFMA issues at most every other cycle, which leaves
// room for the address arithmetic.
template <class Tr, class Layout, int kChunks, typename Acc>
__device__ __forceinline__ void accumulate_rows(
    Acc (&acc)[Tr::kRowsPerThread][kChunks][Tr::kVec],
    const Acc (&s)[Tr::kRowsPerThread][Tr::kColsPerThread], Acc* sS, const Acc* sZ,
    const SimtBwdThread<Tr>& me) {
    constexpr int TR = Tr::kRowsPerThread;
    // streamed rows per iteration (double: one at a time for the 256-wide tiles,
    // whose registers have no room for a second row's values)
    constexpr int kGroup = sizeof(Acc) == 4 ? 8 : kChunks * Tr::kVec < 32 ? Tr::kVec : 1;
    static_assert(Tr::kStreamRows % kGroup == 0, "whole groups of streamed rows");
    __syncwarp();  // the previous call's loads are done
#pragma unroll
    for (int ii = 0; ii < TR; ++ii)
#pragma unroll
        for (int jj = 0; jj < Tr::kColsPerThread; ++jj) sS[me.row(ii) * Tr::kSPitch + me.col(jj)] = s[ii][jj];
    __syncwarp();
    int lane_offset[8];  // the 8-row form's fixed offsets
    if constexpr (kGroup == 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) lane_offset[e] = Layout::chunk(e, me.lane_in_group);
    }
    // One group of streamed rows per iteration keeps TR x kGroup values of s live.
#pragma unroll 1
    for (int c0 = 0; c0 < Tr::kStreamRows; c0 += kGroup) {
        Acc sc[TR][kGroup];
#pragma unroll
        for (int ii = 0; ii < TR; ++ii) {
            const Acc* src = sS + me.row(ii) * Tr::kSPitch + c0;
            if constexpr (kGroup == 1) {
                sc[ii][0] = *src;
            } else {
#pragma unroll
                for (int v = 0; v < kGroup / Tr::kVec; ++v) {
                    const Vec16<Acc> w = load_vec16(src + v * Tr::kVec);
#pragma unroll
                    for (int x = 0; x < Tr::kVec; ++x) sc[ii][v * Tr::kVec + x] = w.x[x];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
#pragma unroll
            for (int qq = 0; qq < kChunks; ++qq) {
                const Vec16<Acc> zv = load_vec16(
                    kGroup == 8 ? sZ + c0 * Layout::kRowElements + lane_offset[e] + qq * Tr::kLanesPerRow * Tr::kVec
                                : sZ + Layout::chunk(c0 + e, me.chunk(qq)));
#pragma unroll
                for (int ii = 0; ii < TR; ++ii)
#pragma unroll
                    for (int x = 0; x < Tr::kVec; ++x) acc[ii][qq][x] += sc[ii][e] * zv.x[x];
            }
        }
    }
}

// ---- probabilities and their gradient ------------------------------------------------------
// The query rows' statistics (lse * log2(e), delta) are indexed by the own
// row in the dQ pass (kQueryRows) and by the streamed row in the dK/dV pass.
// The probabilities themselves and the mask: score.cuh's probability_epilogue.

template <bool kQueryRows, typename Acc, int N>
__device__ __forceinline__ Acc query_stat(const Acc (&x)[N], int ii, int jj) {
    return x[kQueryRows ? ii : jj];
}

// dp (dO V^T) -> dS = P o (dP - delta).
template <bool kQueryRows, class Tr, typename Acc, int N>
__device__ __forceinline__ void score_gradient(Acc (&dp)[Tr::kRowsPerThread][Tr::kColsPerThread],
                                               const Acc (&p)[Tr::kRowsPerThread][Tr::kColsPerThread],
                                               const Acc (&delta)[N]) {
#pragma unroll
    for (int ii = 0; ii < Tr::kRowsPerThread; ++ii)
#pragma unroll
        for (int jj = 0; jj < Tr::kColsPerThread; ++jj)
            dp[ii][jj] = p[ii][jj] * (dp[ii][jj] - query_stat<kQueryRows>(delta, ii, jj));
}

// Write factor * acc for this thread's own rows below rows_valid and columns
// below cols_valid (the gradients are of the accumulator type).
template <class Tr, int kChunks, typename Acc>
__device__ __forceinline__ void store_gradient(Acc* dst, int64_t row_stride,
                                               Acc (&acc)[Tr::kRowsPerThread][kChunks][Tr::kVec],
                                               Acc factor, int rows_valid, int cols_valid,
                                               const SimtBwdThread<Tr>& me) {
#pragma unroll
    for (int ii = 0; ii < Tr::kRowsPerThread; ++ii) {
        if (me.row(ii) >= rows_valid) continue;
        Acc* row = dst + me.row(ii) * row_stride;
#pragma unroll
        for (int qq = 0; qq < kChunks; ++qq) {
            const int col = me.chunk(qq) * Tr::kVec;
            scale_in_place(acc[ii][qq], factor);
            store_run(row + col, acc[ii][qq], cols_valid - col);
        }
    }
}

// ---- streamed tiles --------------------------------------------------------------------------

// The streamed rows' two tiles (Q and dO in the dK/dV pass, K and V in the dQ
// pass), in kStages buffers after the own tiles.  load() fills buffer
// `stage`: pipelined, it only issues the copies (one cp.async group; the
// caller waits and synchronises); otherwise it converts and stores, and the
// caller synchronises.
template <class Tr>
struct StreamedTiles {
    using Acc = typename Tr::Acc;
    Acc* base;

    __device__ Acc* d_tile(int stage) const { return base + stage * (Tr::kStreamD + Tr::kStreamDv); }
    __device__ Acc* dv_tile(int stage) const { return d_tile(stage) + Tr::kStreamD; }

    template <typename T>
    __device__ void load(int stage, const T* src_d, int64_t stride_d, const T* src_dv,
                         int64_t stride_dv, int rows, int d, int dv) const {
        if constexpr (Tr::kPipelined) {
            cp_async_tile_rows<Tr::kThreads, Tr::kStreamRows, Tr::kHeadDim>(
                d_tile(stage), typename Tr::Layout{}, src_d, stride_d, rows, d);
            cp_async_tile_rows<Tr::kThreads, Tr::kStreamRows, Tr::kHeadDimV>(
                dv_tile(stage), typename Tr::LayoutV{}, src_dv, stride_dv, rows, dv);
            cp_async_commit();
        } else {
            load_tile<Tr::kThreads>(d_tile(stage), typename Tr::Layout{}, src_d, stride_d,
                                    Tr::kStreamRows, Tr::kHeadDim, rows, d);
            load_tile<Tr::kThreads>(dv_tile(stage), typename Tr::LayoutV{}, src_dv, stride_dv,
                                    Tr::kStreamRows, Tr::kHeadDimV, rows, dv);
        }
    }
};

// dq[streamed rows of one block] += scale * dS K, summed over the CTA's own
// keys, by atomics (deterministic=False).  sS holds dS^T ([own row][streamed
// row], written by every warp; the caller synchronises the CTA first).  The
// roles of bwd_simt_dq_kernel's threads, with the streamed rows as the rows:
// streamed row ii * 16 + row_group, d-chunks qq * 8 + lane_in_group, a sum
// over the own rows r of dS^T[r][row] (a broadcast to the row group) times
// K's row r (one 16-byte load per chunk).  dq points at the block's first row.
template <class Tr, typename Acc>
__device__ __forceinline__ void add_dq_atomically(Acc* dq, int64_t row_stride, const Acc* sS, const Acc* sK,
                                                  Acc scale, int rows_valid, int cols_valid,
                                                  const SimtBwdThread<Tr>& me) {
    static_assert(Tr::kStreamRows % Tr::kRowGroups == 0, "whole streamed rows per row group");
    constexpr int TQ = Tr::kStreamRows / Tr::kRowGroups;  // streamed rows per thread
    Acc acc[TQ][Tr::kChunks][Tr::kVec] = {};
#pragma unroll 2
    for (int r = 0; r < Tr::kOwnRows; ++r) {
        Acc ds[TQ];
#pragma unroll
        for (int ii = 0; ii < TQ; ++ii) ds[ii] = sS[r * Tr::kSPitch + me.row(ii)];
#pragma unroll
        for (int qq = 0; qq < Tr::kChunks; ++qq) {
            const Vec16<Acc> k = load_vec16(sK + Tr::Layout::chunk(r, me.chunk(qq)));
#pragma unroll
            for (int ii = 0; ii < TQ; ++ii)
#pragma unroll
                for (int x = 0; x < Tr::kVec; ++x) acc[ii][qq][x] += ds[ii] * k.x[x];
        }
    }
#pragma unroll
    for (int ii = 0; ii < TQ; ++ii) {
        if (me.row(ii) >= rows_valid) continue;
        Acc* row = dq + me.row(ii) * row_stride;
#pragma unroll
        for (int qq = 0; qq < Tr::kChunks; ++qq)
#pragma unroll
            for (int x = 0; x < Tr::kVec; ++x) {
                const int col = me.chunk(qq) * Tr::kVec + x;
                if (col < cols_valid) atomicAdd(row + col, acc[ii][qq][x] * scale);
            }
    }
}

// ---- kernels ---------------------------------------------------------------------------------

// delta[i] = sum_c dout[i][c] * out[i][c] for kRows query rows per CTA (the
// grid is fwd_simt's TileIndex with block_m = kRows).
template <typename T, int kHeadDimV>
__global__ void __launch_bounds__(128) bwd_simt_dot_do_o_kernel(const BwdParams launch) {
    using Acc = acc_t<T>;
    constexpr int kLanes = 8, kRows = 128 / kLanes;
    const TileIndex tile(launch.fwd, kRows, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kRows)) return;
    }
    const FwdParams& p = params.fwd;
    const HeadSlice<T, Acc> head(p, tile.batch, tile.head);
    const GradSlice<T, Acc> grad(params, tile.batch, tile.head);
    const int64_t i = tile.m_block * kRows + static_cast<int>(threadIdx.x) / kLanes;
    const int lane = static_cast<int>(threadIdx.x) % kLanes;

    Acc sum = Acc(0);
    if (i < p.seqlen_q) {
        const T* o = head.out + i * p.out_row_stride;
        const T* d_o = grad.dout + i * params.dout_row_stride;
#pragma unroll
        for (int qq = 0; qq < kHeadDimV / kLanes; ++qq) {
            const int c = qq * kLanes + lane;
            if (c < p.head_dim_v) sum += to_acc(d_o[c]) * to_acc(o[c]);
        }
    }
    sum = group_sum<kLanes>(sum);  // every lane takes part, rows past Lq too
    if (i < p.seqlen_q && lane == 0) grad.delta[i * params.delta_row_stride] = sum;
}

// dK, dV of kBlockN keys of one (batch, kv head).
// kAtomicDq (deterministic=False): also add each block pair's dQ = scale dS K
// to dq (zeroed by the caller) with atomics; no dQ kernel runs then.
template <typename T, int kHeadDim, int kHeadDimV, int kBlockN, int kBlockM, bool kAtomicDq>
__global__ void __launch_bounds__(
    (SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockN, kBlockM>::kThreads),
    (SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockN, kBlockM>::kMinBlocksPerSm))
bwd_simt_dkdv_kernel(const BwdParams launch) {
    using Tr = SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockN, kBlockM>;
    using Acc = typename Tr::Acc;
    using Layout = typename Tr::Layout;
    using LayoutV = typename Tr::LayoutV;
    constexpr int TR = Tr::kRowsPerThread, TC = Tr::kColsPerThread;

    const KeyTileIndex tile(launch.fwd, kBlockN, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kBlockN)) return;
    }
    const FwdParams& p = params.fwd;
    const WindowMask mask(p);
    const KeyBlock block(p, mask, tile.n_block * kBlockN, kBlockN);
    const SimtBwdThread<Tr> me;
    const Acc scale_log2 = static_cast<Acc>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);
    const int64_t first_head = tile.head_kv * p.gqa_ratio;  // the kv head's query group

    Acc* sK = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sV = sK + Tr::kOwnD;
    Acc* sS = sV + Tr::kOwnDv;  // P^T, then dS^T (accumulate_rows)
    const StreamedTiles<Tr> streamed{sS + Tr::kScratch};  // Q, dO
    const HeadSlice<T, Acc> kv(p, tile.batch, first_head);
    load_tile<Tr::kThreads>(sK, Layout{}, kv.k + block.n0 * p.k_row_stride, p.k_row_stride, kBlockN,
                            kHeadDim, block.keys, d);
    load_tile<Tr::kThreads>(sV, LayoutV{}, kv.v + block.n0 * p.v_row_stride, p.v_row_stride,
                            kBlockN, kHeadDimV, block.keys, dv);

    // The query blocks that see these keys, head by head through the group:
    // (head, m_block) walks heads first_head.. and, within each, m_begin..m_end.
    const int64_t m_begin = block.m_begin(kBlockM), m_end = block.m_end(kBlockM);
    const int64_t num_blocks = (m_end - m_begin) * p.gqa_ratio;
    auto load_queries = [&](int stage, int64_t head, int64_t m_block) {
        const int64_t m0 = m_block * kBlockM;
        const HeadSlice<T, Acc> qo(p, tile.batch, head);
        const GradSlice<T, Acc> grad(params, tile.batch, head);
        streamed.load(stage, qo.q + m0 * p.q_row_stride, p.q_row_stride,
                      grad.dout + m0 * params.dout_row_stride, params.dout_row_stride,
                      static_cast<int>(min64(kBlockM, p.seqlen_q - m0)), d, dv);
    };

    Acc dk[TR][Tr::kChunks][Tr::kVec] = {};
    Acc dv_acc[TR][Tr::kChunksV][Tr::kVec] = {};
    Acc s[TR][TC], dp[TR][TC];
    int64_t head = first_head, m_block = m_begin;
    if (Tr::kPipelined && num_blocks > 0) load_queries(0, head, m_block);
    for (int64_t it = 0; it < num_blocks; ++it) {
        const int stage = Tr::kPipelined ? static_cast<int>(it & 1) : 0;
        const int64_t next_head = m_block + 1 == m_end ? head + 1 : head;
        const int64_t next_m_block = m_block + 1 == m_end ? m_begin : m_block + 1;
        if constexpr (Tr::kPipelined) {
            cp_async_wait<0>();
            __syncthreads();  // this block landed; the other buffer has been read
            if (it + 1 < num_blocks) load_queries(stage ^ 1, next_head, next_m_block);
        } else {
            load_queries(0, head, m_block);
            __syncthreads();
        }
        const Acc* sQ = streamed.d_tile(stage);
        const Acc* sdO = streamed.dv_tile(stage);
        const int64_t m0 = m_block * kBlockM;
        const HeadSlice<T, Acc> qo(p, tile.batch, head);
        const GradSlice<T, Acc> grad(params, tile.batch, head);
        Acc lse_log2[TC], delta[TC];
#pragma unroll
        for (int jj = 0; jj < TC; ++jj)
            load_query_stats(lse_log2[jj], delta[jj], qo.lse, p.lse_row_stride, grad.delta,
                             params.delta_row_stride, m0 + me.col(jj), p.seqlen_q);

        dot_rows<Tr, Layout>(s, sK, sQ, me, d);                        // S^T = K Q^T
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<true>, false, Walk::kByElement>(  // P^T
            s, me, mask, p, ScoreTile{tile.batch, head, m0, block.n0, 0, kBlockN},
            [&] { return block.needs_mask(p, mask, m0, kBlockM, kBlockN); },
            [&](int, int jj) { return lse_log2[jj]; }, scale_log2, chain);
        dot_rows<Tr, LayoutV>(dp, sV, sdO, me, dv);                    // dP^T = V dO^T
        accumulate_rows<Tr, LayoutV>(dv_acc, s, sS, sdO, me);           // dV += P^T dO
        score_gradient<false, Tr>(dp, s, delta);                        // dS^T
        gradient_epilogue<Acc>(dp, s, chain, me, params, ScoreTile{tile.batch, head, m0, block.n0, 0, kBlockN});
        accumulate_rows<Tr, Layout>(dk, dp, sS, sQ, me);                // dK += dS^T Q
        if constexpr (kAtomicDq) {
            __syncthreads();  // every row group's dS^T in the scratch tile
            add_dq_atomically<Tr>(grad.dq + m0 * params.dq_row_stride, params.dq_row_stride, sS, sK,
                                  static_cast<Acc>(p.scale), static_cast<int>(min64(kBlockM, p.seqlen_q - m0)),
                                  d, me);                               // dQ += dS K (atomics)
        }
        if constexpr (!Tr::kPipelined) __syncthreads();  // Q, dO fully read: the buffer takes the next block
        head = next_head;
        m_block = next_m_block;
    }

    const GradSlice<T, Acc> kv_grad(params, tile.batch, first_head);
    store_gradient<Tr>(kv_grad.dk + block.n0 * params.dk_row_stride, params.dk_row_stride, dk,
                       static_cast<Acc>(p.scale), block.keys, d, me);
    store_gradient<Tr>(kv_grad.dv + block.n0 * params.dv_row_stride, params.dv_row_stride, dv_acc,
                       Acc(1), block.keys, dv, me);
}

// bwd_simt_dkdv_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockN, int kBlockM, bool kAtomicDq>
constexpr int bwd_simt_dkdv_kernel_smem() {
    return SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockN, kBlockM>::kSmemBytes;
}

// dQ of kBlockM query rows of one (batch, query head).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(
    (SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kThreads),
    (SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kMinBlocksPerSm))
bwd_simt_dq_kernel(const BwdParams launch) {
    using Tr = SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>;
    using Acc = typename Tr::Acc;
    using Layout = typename Tr::Layout;
    using LayoutV = typename Tr::LayoutV;
    constexpr int TR = Tr::kRowsPerThread, TC = Tr::kColsPerThread;

    const TileIndex tile(launch.fwd, kBlockM, blockIdx.x);
    const BwdView params = sequence_params(launch, tile.batch);  // sequence.cuh
    if constexpr (kSeqLengths) {
        if (tile.past_end(params.fwd, kBlockM)) return;
    }
    const FwdParams& p = params.fwd;
    const HeadSlice<T, Acc> head(p, tile.batch, tile.head);
    const GradSlice<T, Acc> grad(params, tile.batch, tile.head);
    const WindowMask mask(p);
    const QueryBlock block(p, mask, tile.m_block * kBlockM, kBlockM);
    const SimtBwdThread<Tr> me;
    const Acc scale_log2 = static_cast<Acc>(p.scale_log2);
    const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);

    Acc* sQ = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sdO = sQ + Tr::kOwnD;
    Acc* sS = sdO + Tr::kOwnDv;  // dS (accumulate_rows)
    const StreamedTiles<Tr> streamed{sS + Tr::kScratch};  // K, V
    load_tile<Tr::kThreads>(sQ, Layout{}, head.q + block.m0 * p.q_row_stride, p.q_row_stride,
                            kBlockM, kHeadDim, block.rows, d);
    load_tile<Tr::kThreads>(sdO, LayoutV{}, grad.dout + block.m0 * params.dout_row_stride,
                            params.dout_row_stride, kBlockM, kHeadDimV, block.rows, dv);
    Acc lse_log2[TR], delta[TR];
#pragma unroll
    for (int ii = 0; ii < TR; ++ii)
        load_query_stats(lse_log2[ii], delta[ii], head.lse, p.lse_row_stride, grad.delta,
                         params.delta_row_stride, block.m0 + me.row(ii), p.seqlen_q);

    auto load_keys = [&](int stage, int64_t n_block) {
        const int64_t n0 = n_block * kBlockN;
        streamed.load(stage, head.k + n0 * p.k_row_stride, p.k_row_stride,
                      head.v + n0 * p.v_row_stride, p.v_row_stride,
                      QueryBlock::keys_in(p, n0, kBlockN), d, dv);
    };

    Acc dq[TR][Tr::kChunks][Tr::kVec] = {};
    Acc s[TR][TC], dp[TR][TC];
    const int64_t n_begin = block.n_begin(kBlockN), n_end = block.n_end(kBlockN);
    if (Tr::kPipelined && n_begin < n_end) load_keys(0, n_begin);
    for (int64_t n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = Tr::kPipelined ? static_cast<int>((n_block - n_begin) & 1) : 0;
        if constexpr (Tr::kPipelined) {
            cp_async_wait<0>();
            __syncthreads();  // this block landed; the other buffer has been read
            if (n_block + 1 < n_end) load_keys(stage ^ 1, n_block + 1);
        } else {
            load_keys(0, n_block);
            __syncthreads();
        }
        const Acc* sK = streamed.d_tile(stage);
        const Acc* sV = streamed.dv_tile(stage);
        const int64_t n0 = n_block * kBlockN;

        dot_rows<Tr, Layout>(s, sQ, sK, me, d);                            // S = Q K^T
        auto chain = chain_for(s);
        probability_epilogue<WindowRule<true>, true>(                       // P
            s, me, mask, p, ScoreTile{tile.batch, tile.head, block.m0, n0, 0, kBlockN},
            [&] { return block.needs_mask(mask, n0, kBlockN); },
            [&](int ii, int) { return lse_log2[ii]; }, scale_log2, chain);
        dot_rows<Tr, LayoutV>(dp, sdO, sV, me, dv);                        // dP = dO V^T
        score_gradient<true, Tr>(dp, s, delta);                             // dS
        gradient_epilogue(dp, s, chain);
        accumulate_rows<Tr, Layout>(dq, dp, sS, sK, me);                    // dQ += dS K
        if constexpr (!Tr::kPipelined) __syncthreads();  // K, V fully read: the buffer takes the next block
    }

    store_gradient<Tr>(grad.dq + block.m0 * params.dq_row_stride, params.dq_row_stride, dq,
                       static_cast<Acc>(p.scale), block.rows, d, me);
}

// bwd_simt_dq_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <typename T, int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN>
constexpr int bwd_simt_dq_kernel_smem() {
    return SimtBwdTraits<T, kHeadDim, kHeadDimV, kBlockM, kBlockN>::kSmemBytes;
}

}  // namespace cf
