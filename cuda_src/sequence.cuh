// sequence.cuh -- one launch over a batch of sequences of different lengths,
// padded (B, H, L, d) or packed (H, total, d).
//
// A module compiled with CF_SEQ_LENGTHS reads FwdParams::sequences, a
// (5, batch) int32 table (32 bits: fewer registers where a main loop runs at
// the limit; the host checks every entry fits): row kSeqOrder the launch
// order (grid slot s runs batch entry order[s]; the host lists the longest
// sequences first, so no CTA of a long sequence starts last), then, per batch
// entry b, the first query row, the number of query rows, the first key and
// the number of keys of its sequence.  CF_SEQ_LENGTHS=1, a padded batch: the
// batch strides place each sequence and the first rows are 0, never read.
// CF_SEQ_LENGTHS=2, packed sequences: batch strides 0, and each sequence's
// base pointers move to its first row and key (HeadSlice, GradSlice).

// The one seam: TileIndex / KeyTileIndex (block_info*.cuh) map the slot to
// its batch entry, and each kernel narrows the launch's params to that
// sequence (sequence_params): seqlen_q and seqlen_k its lengths, and its first
// row and key where HeadSlice / GradSlice place the base pointers.  From there every helper -- tails, the window and
// its bottom-right diagonal (Lk - Lq of the sequence), the block ranges that
// skip what no row sees, the score terms -- sees a plain problem of the
// sequence's size, and no kernel body tests a length.  A CTA whose block lies
// wholly past its sequence returns at once (TileIndex::past_end), so blocks
// past a length cost a launch slot, not a pass over keys.  Rows past a padded
// sequence's length belong to no CTA: the caller fills them (zeros, lse =
// -inf, zero gradients).
//
// Without CF_SEQ_LENGTHS, slot_batch is the slot, sequence_params returns
// the launch's params themselves (FwdView is a reference) and the past_end
// test sits behind `if constexpr (kSeqLengths)` in each kernel (a test that
// is merely false there still moved registers in fwd_mma at d = 128): the
// kernels compile as they did before lengths.
#pragma once

#include "params.cuh"
#include "params_bwd.cuh"

#ifndef CF_SEQ_LENGTHS
#define CF_SEQ_LENGTHS 0
#endif

namespace cf {

constexpr bool kSeqLengths = CF_SEQ_LENGTHS != 0;
constexpr bool kSeqStarts = CF_SEQ_LENGTHS == 2;  // packed: sequences start at their own rows

// The rows of FwdParams::sequences.
enum SequenceRow : int { kSeqOrder = 0, kSeqQStart = 1, kSeqQLen = 2, kSeqKStart = 3, kSeqKLen = 4 };

__device__ __forceinline__ int sequence_entry(const FwdParams& p, int row, int64_t b) {
    return p.sequences[row * p.batch + b];
}

// The batch entry grid slot `slot` runs.
__device__ __forceinline__ int64_t slot_batch(const FwdParams& p, int64_t slot) {
    if constexpr (kSeqLengths) {
        return sequence_entry(p, kSeqOrder, slot);
    } else {
        return slot;
    }
}

#if CF_SEQ_LENGTHS
using FwdView = FwdParams;  // a CTA's own copy, narrowed to its sequence
using BwdView = BwdParams;
#else
using FwdView = const FwdParams&;  // the launch's params themselves
using BwdView = const BwdParams&;
#endif

// The launch's params narrowed to batch entry `batch`'s sequence: seqlen_q
// and seqlen_k its lengths; packed, first_row and first_key its first query
// row and key, which HeadSlice and GradSlice add to the base pointers (two
// integers live, not a pointer per tensor).
__device__ __forceinline__ FwdView sequence_params(const FwdParams& launch, int64_t batch) {
#if CF_SEQ_LENGTHS
    FwdParams p = launch;
    p.seqlen_q = sequence_entry(launch, kSeqQLen, batch);
    p.seqlen_k = sequence_entry(launch, kSeqKLen, batch);
    if constexpr (kSeqStarts) {
        p.first_row = sequence_entry(launch, kSeqQStart, batch);
        p.first_key = sequence_entry(launch, kSeqKStart, batch);
    }
    return p;
#else
    (void)batch;
    return launch;
#endif
}

// The backward's params narrowed likewise (GradSlice moves dout, dq and delta
// to the first query row, dk and dv to the first key).
__device__ __forceinline__ BwdView sequence_params(const BwdParams& launch, int64_t batch) {
#if CF_SEQ_LENGTHS
    BwdParams p = launch;
    p.fwd = sequence_params(launch.fwd, batch);
    return p;
#else
    (void)batch;
    return launch;
#endif
}

}  // namespace cf
