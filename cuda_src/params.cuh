// params.cuh -- the one argument every forward kernel takes.
//
// A plain struct passed by value: pointers, 64-bit strides (in elements) for
// the batch, head and row axes of every tensor (the last axis has unit stride),
// the problem sizes, the softmax scale and the attention window.  Every field
// is 8 bytes, so the layout has no padding; cupyflash/_params.py mirrors it
// field by field (a NumPy structured dtype with align=True) and the
// static_asserts at the end pin the offsets both sides rely on.
//
// This header is plain C++ (host compilers include it to check the layout).
#pragma once

#ifdef __CUDACC_RTC__  // NVRTC has no <cstdint>; CuPy's include path has libcudacxx's
#include <cuda/std/cstdint>
#else
#include <cstdint>
#endif

namespace cf {

// window_left / window_right value meaning "unbounded on that side".  Large
// enough that no admissible index reaches it, small enough that
// i + (Lk - Lq) +/- kUnbounded cannot overflow int64 for any realistic length.
constexpr int64_t kUnbounded = int64_t(1) << 62;

struct FwdParams {
    // Tensors: q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv),
    // out (B, Hq, Lq, dv) of the element type T; lse (B, Hq, Lq) of the
    // accumulator type (float, double for double inputs), or null.
    const void* q;
    const void* k;
    const void* v;
    void* out;
    void* lse;
    // fwd_v1: its global-memory state O (B, Hq, Lq, dv), l and m (B, Hq,
    // Lq), contiguous, of the accumulator type.  A split-KV forward
    // (num_splits > 1): each split's normalised partial output ws_o
    // (num_splits, B, Hq, Lq, dv) and its lse ws_l (num_splits, B, Hq, Lq),
    // contiguous, float (double for double inputs); ws_m unused.  Null
    // otherwise.
    void* ws_o;
    void* ws_l;
    void* ws_m;

    // Strides in elements (any value, including 0 for broadcast axes).
    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int64_t v_batch_stride, v_head_stride, v_row_stride;
    int64_t out_batch_stride, out_head_stride, out_row_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_row_stride;

    // Sizes.  Query head h reads kv head h / gqa_ratio (heads_q = gqa_ratio * Hkv).
    int64_t batch, heads_q, gqa_ratio;
    int64_t seqlen_q, seqlen_k, head_dim, head_dim_v;

    // Bottom-right aligned window: query i sees key j iff
    // i + (Lk - Lq) - window_left <= j <= i + (Lk - Lq) + window_right.
    // Causal is window_right = 0.  kUnbounded for "no limit".
    int64_t window_left, window_right;

    // fwd_v1 only: the run-time block sizes Br, Bc of Algorithm 1 (0 otherwise).
    int64_t block_m, block_n;

    // Split-KV (fwd_simt, fwd_mma and fwd_combine): the visible key blocks of
    // every query block are cut into num_splits near-equal runs, one per
    // blockIdx.y, whose results go to ws_o / ws_l; fwd_combine merges them.
    // 1 (or 0): one run, written straight to out and lse.
    int64_t num_splits;

    // softmax(scale * q k^T); scale_log2 = scale * log2(e) for exp2.
    double scale, scale_log2;

    // Score terms (score.cuh's ScoreTerms; read only by a module compiled with
    // them, null otherwise): up to kMaxBias additive biases (bias[t] of the
    // element type its ScoreTerms names) and a bool mask (one byte, nonzero =
    // may attend), each read as a (B, Hq, Lq, Lk) view: element (b, h, i, j)
    // of bias t at bias[t] + b * bias_strides[t][0] + h * bias_strides[t][1]
    // + i * bias_strides[t][2] + j * bias_strides[t][3], in elements, 0 along
    // broadcast axes (the mask likewise with mask_strides).
    const void* bias[4];
    int64_t bias_strides[4][4];
    const void* mask;
    int64_t mask_strides[4];

    // Score modifications (score.cuh's mods; read only by a module compiled
    // with them): the softcap (0: none); per (batch, query head) of the
    // launch, through (B, Hq) views, coord[0] the flat batch index b
    // (int64), coord[1] the query head h (int64) and coord[2] the ALiBi
    // slope (double), each at coord[c] + batch * coord_strides[c][0] + head *
    // coord_strides[c][1]; and up to kMaxModArgs mod_args arrays (element
    // type and number of axes from the module) of mod_shape and mod_strides
    // (elements).
    double softcap;
    const void* coord[3];
    int64_t coord_strides[3][2];
    const void* mod_args[4];
    int64_t mod_shape[4][4];
    int64_t mod_strides[4][4];

    // Per-sequence lengths (sequence.cuh; read only by a module compiled with
    // CF_SEQ_LENGTHS, null otherwise): a (5, batch) int32 table -- the launch
    // order of the batch entries, then each entry's first query row, query
    // rows, first key and keys.
    const int32_t* sequences;
    // Rows of ws_o / ws_l per (split, batch, query head): the launch's seqlen_q
    // (a CTA's own seqlen_q is its sequence's under CF_SEQ_LENGTHS).
    int64_t split_rows;
    // In a CTA's view of packed sequences (sequence.cuh, CF_SEQ_LENGTHS=2): its
    // sequence's first query row and first key, which HeadSlice and GradSlice
    // add to every base pointer; 0 from the host, read by no other module.
    int64_t first_row, first_key;

    // A paged KV cache (paged.cuh; read only by a module compiled with
    // CF_PAGED_KV, null / 0 otherwise): the (B, max_pages) int32 block table,
    // table_stride elements from one batch entry's row to the next, and the
    // keys per page.  k and v then point at the caches, k_batch_stride and
    // v_batch_stride are their page strides and k_row_stride, v_row_stride
    // their slot strides.
    const int32_t* block_table;
    int64_t table_stride, page_size;
};

// Most additive bias terms one call takes (FwdParams::bias), and most mod_args arrays.
constexpr int kMaxBias = 4;
constexpr int kMaxModArgs = 4;

// The layout _params.py mirrors (tests compare every offset with the dtype's).
static_assert(sizeof(FwdParams) == 115 * 8, "FwdParams: every field is 8 bytes, no padding");
// NVRTC 13.0 has no __builtin_offsetof (13.5 has): the offsets are asserted in
// host builds (the emulator's g++), the size everywhere.
#if !defined(__CUDACC_RTC__)
static_assert(__builtin_offsetof(FwdParams, q_batch_stride) == 8 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, batch) == 23 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, window_left) == 30 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, scale) == 35 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, bias) == 37 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, mask) == 57 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, softcap) == 62 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, mod_strides) == 92 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, sequences) == 108 * 8, "FwdParams layout");
static_assert(__builtin_offsetof(FwdParams, block_table) == 112 * 8, "FwdParams layout");
#endif

}  // namespace cf
