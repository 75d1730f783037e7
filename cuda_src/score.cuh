// score.cuh -- the score epilogue: the one place where a tile of attention
// scores meets the mask, in every kernel family, forward and backward.
//
// Every family calls, right after its S = Q K^T (or S^T = K Q^T) product,
//   forward   score_epilogue<Rule, kQueryRows>(s, frag, mask, params, tile, partial)
//             scores of hidden keys -> -inf, before the online softmax;
//   backward  probability_epilogue<Rule, kQueryRows[, kWalk]>(s, frag, mask, params, tile,
//                                                     partial, lse_log2, scale_log2)
//             (here `partial` a callable, lse_log2 one: element [r][c]'s query's)
//             s -> P = exp2(s * scale_log2 - lse_log2), hidden pairs -> P = 0 (a
//             select, so whatever padded scores held never reaches a gradient);
//   fwd_v1    score_element<Rule>(element, mask, params, tile, product), its
//             one-element-at-a-time form (the product runs only where admitted).
// `frag` is the accumulator layout's coordinate trait (fragment.cuh) and
// kQueryRows says whether its rows are queries (S) or keys (S^T); `mask` is
// the kernel's WindowMask (taken from the kernel rather than rebuilt from the
// params: rebuilt, it cost fwd_v1 26 registers on sm_80); `tile` is where the
// thread's tile sits in the problem (ScoreTile); `partial` whether
// block_info.cuh found the block crossing a mask boundary (else every pair is
// admissible and the mask costs nothing).  Rule is the mask's arithmetic:
// WindowRule (64-bit, exact for any bounds) or BlockRule (32-bit, for the
// forward tensor-core kernels whose masking runs at the register limit).  Every
// register layout goes through hide_pairs, the one loop that hides elements.
//
// What the scores are when they arrive (the scale is applied where each
// kernel has always applied it; moving it would change the rounding):
//   fwd_simt, fwd_dmma, fwd_v1       q.k * scale * log2(e) (log2 units)
//   fwd_mma, fwd_wgmma, fwd_tf32     q.k; the softmax multiplies by scale *
//                                    log2(e) in its exponent (update_unscaled)
//   every backward                   q.k; P = exp2(q.k * scale_log2 - lse_log2)
//                                    is computed here
//
// How a later feature plugs in (DESIGN.md section 3b's order: scale, softcap,
// bias and ALiBi, score_mod, then the masks):
//   * bias / ALiBi / softcap / score_mod: transform s in the three epilogues
//     before the mask, indexing by tile.batch, tile.head and the element's
//     global (query, key) = (tile.q0 + q, tile.k0 + tile.key0 + k), q and k
//     as hide_pairs computes them; in the raw (q.k) families multiply by the
//     scale first and hand the softmax (and P's exp2) a scale of 1 -- the
//     epilogue then owns the scale; and apply it whatever `partial` says
//     (every block needs it).  The backward's dS = P (dP - delta) gains the
//     transform's derivative in score_gradient.
//   * boolean mask / mask_mod: one more condition per element in hide_pairs
//     (and score_element), and `partial` forced true while a mask is given.
//   * per-sequence lengths: Rule's seqlen_q / seqlen_k (and WindowMask's
//     diagonal) taken per tile.batch instead of from the params.
#pragma once

#include "fragment.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"

namespace cf {

// Where a thread's score tile sits in the problem: (batch, query head) of the
// scores, global query row q0 of the fragment's query 0, the first key k0 of
// the key block (the mask's ranges are relative to it, clamped to [0, keys])
// and the fragment's first key key0 within that block (the dK/dV kernels'
// warps each own key0 = row0 of the block's keys; elsewhere 0).  The global
// key of fragment key k is k0 + key0 + k.
struct ScoreTile {
    int64_t batch, head;
    int64_t q0, k0;
    int key0, keys;
};

// A Rule's range(q, lo, hi): the keys query q may see, relative to the key
// block: key k is admissible iff lo <= k < hi (lo >= hi: none).  With
// kBoundsQueries, gone(q) says whether query q lies past Lq (then it sees no
// key); without, the rule has no gone() and no query test is emitted.
//
// WindowMask's rule, exact in 64 bits, the range clamped to [0, keys] (keys
// beyond Lk hidden); with kQueryBound, queries past Lq see none (the backward,
// whose padded rows must not reach a gradient).
template <bool kQueryBound>
struct WindowRule {
    WindowMask mask;
    int64_t q0, k0, seqlen_q;
    int keys;

    __device__ __forceinline__ WindowRule(const WindowMask& m, const FwdParams& p, const ScoreTile& t)
        : mask(m), q0(t.q0), k0(t.k0), seqlen_q(p.seqlen_q), keys(t.keys) {}

    static constexpr bool kBoundsQueries = kQueryBound;
    __device__ __forceinline__ bool gone(int q) const { return q0 + q >= seqlen_q; }
    __device__ __forceinline__ void range(int q, int& lo, int& hi) const {
        const int64_t i = q0 + q;
        lo = static_cast<int>(min64(max64(mask.first_key(i) - k0, 0), keys));
        hi = static_cast<int>(min64(max64(mask.last_key(i) + 1 - k0, 0), keys));
    }
};

// The same rule in 32-bit offsets relative to the tile: the 64-bit bounds (the
// window sides may be kUnbounded) are clamped to +-2^30 once per tile; adding
// a row offset below 2^16 to a clamped value cannot change whether it lies in
// [0, keys].  Keeps the masking step of the forward tensor-core kernels, which
// runs while the scores and the output accumulators are all live, to a few
// 32-bit registers.  Forward only (no query bound).
struct BlockRule {
    int lo_base, hi_base, keys;

    __device__ __forceinline__ BlockRule(const WindowMask&, const FwdParams& p, const ScoreTile& t) {
        const int64_t aligned = t.q0 + (p.seqlen_k - p.seqlen_q) - t.k0;  // query 0's diagonal key - k0
        lo_base = clamp30(aligned - p.window_left);
        hi_base = clamp30(aligned + p.window_right + 1);
        keys = static_cast<int>(min64(p.seqlen_k - t.k0, t.keys));
    }
    __device__ static __forceinline__ int clamp30(int64_t x) {
        constexpr int64_t kLimit = int64_t(1) << 30;
        return static_cast<int>(x < -kLimit ? -kLimit : x > kLimit ? kLimit : x);
    }
    static constexpr bool kBoundsQueries = false;
    __device__ __forceinline__ void range(int q, int& lo, int& hi) const {
        lo = lo_base + q;
        hi = min(hi_base + q, keys);
    }
};

// How hide_pairs walks a fragment whose rows are keys (S^T, the dK/dV
// kernels).  The two orders compute the same selects; they differ in what the
// register allocator sees, and each caller keeps the one its kernel was tuned
// with (tools/kernel_fingerprint.py measured both, NVRTC 13.5 and 13.0):
//   kByQuery    one query (column) at a time: its range once, then its keys --
//               bwd_tc_loops.cuh (with kByElement bwd_tf32's d = 32 dK/dV
//               kernel went 240 -> 254 registers on sm_80, 205 -> 218 on sm_90);
//   kByElement  row by row, the rule asked per element and the reuse of the
//               ranges left to the compiler -- bwd_mma, bwd_wgmma, bwd_simt
//               (with kByQuery bwd_mma's d = 64 dK/dV kernels went 226 -> 254
//               on sm_90).
// A fragment whose rows are queries is always walked query by query.
enum class Walk { kByQuery, kByElement };

// x[r][c] -> hidden wherever Rule does not admit the element's (query, key):
// query frag.row(r) and key key0 + frag.col(c) (kQueryRows), else the
// transpose.  The test is written out in each loop, not called: a bool
// returned by a helper, even one that folds to the same comparison, left
// NVVM a different branch structure (bwd_tf32's d = 128 dQ kernel: 185 -> 199
// registers on sm_80).
template <bool kQueryRows, Walk kWalk = Walk::kByQuery, class Rule, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void hide_pairs(Acc (&x)[R][C], const Frag& frag, const Rule& rule, int key0,
                                           Acc hidden) {
    if constexpr (kQueryRows) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int lo, hi;
            rule.range(frag.row(r), lo, hi);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int k = key0 + frag.col(c);
                if constexpr (Rule::kBoundsQueries) {
                    if (rule.gone(frag.row(r)) || k < lo || k >= hi) x[r][c] = hidden;
                } else if (k < lo || k >= hi) {
                    x[r][c] = hidden;
                }
            }
        }
    } else if constexpr (kWalk == Walk::kByQuery) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            int lo, hi;
            rule.range(frag.col(c), lo, hi);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int k = key0 + frag.row(r);
                if constexpr (Rule::kBoundsQueries) {
                    if (rule.gone(frag.col(c)) || k < lo || k >= hi) x[r][c] = hidden;
                } else if (k < lo || k >= hi) {
                    x[r][c] = hidden;
                }
            }
        }
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int k = key0 + frag.row(r);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                int lo, hi;
                rule.range(frag.col(c), lo, hi);
                if constexpr (Rule::kBoundsQueries) {
                    if (rule.gone(frag.col(c)) || k < lo || k >= hi) x[r][c] = hidden;
                } else if (k < lo || k >= hi) {
                    x[r][c] = hidden;
                }
            }
        }
    }
}

// The forward's epilogue: scores of keys a query may not see (window, causal,
// beyond Lk) -> -inf.
template <class Rule, bool kQueryRows = true, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void score_epilogue(Acc (&s)[R][C], const Frag& frag, const WindowMask& mask,
                                               const FwdParams& p, const ScoreTile& tile, bool partial) {
    if (partial) hide_pairs<kQueryRows>(s, frag, Rule(mask, p, tile), tile.key0, neg_inf<Acc>());
}

// P = exp2(s * scale_log2 - lse_log2): ex2.approx in float, exp2 in double.
template <typename Acc>
__device__ __forceinline__ Acc probability(Acc s, Acc scale_log2, Acc lse_log2) {
    return exp2_acc(s * scale_log2 - lse_log2);
}

// The backward's epilogue: s -> P = exp2(s * scale_log2 - lse_log2(r, c))
// (ex2.approx in float, exp2 in double), then P of pairs that are not
// admissible (window, causal, past Lq or Lk) -> 0.  `partial` is a callable,
// asked after the exponentials: evaluated before them, the block test's 64-bit
// arithmetic stayed live across them (bwd_dmma's dQ kernel: 164 -> 182 registers).
template <class Rule, bool kQueryRows, Walk kWalk = Walk::kByQuery, class Frag, typename Acc, int R, int C,
          class Partial, class Stat>
__device__ __forceinline__ void probability_epilogue(Acc (&s)[R][C], const Frag& frag, const WindowMask& mask,
                                                     const FwdParams& p, const ScoreTile& tile,
                                                     const Partial& partial, const Stat& lse_log2,
                                                     Acc scale_log2) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) s[r][c] = probability(s[r][c], scale_log2, lse_log2(r, c));
    if (partial()) hide_pairs<kQueryRows, kWalk>(s, frag, Rule(mask, p, tile), tile.key0, Acc(0));
}

// fwd_v1's form (its threads walk a shared score tile element by element):
// the score of element e, computed by product() only where the mask admits
// the pair, -inf elsewhere.
template <class Rule, class Product>
__device__ __forceinline__ auto score_element(const ElementFragment& e, const WindowMask& mask, const FwdParams& p,
                                              const ScoreTile& tile, const Product& product) -> decltype(product()) {
    const Rule rule(mask, p, tile);
    int lo = 0, hi = 0;
    if (!Rule::kBoundsQueries || !rule.gone(e.row(0))) rule.range(e.row(0), lo, hi);
    const int k = tile.key0 + e.col(0);
    return k < lo || k >= hi ? neg_inf<decltype(product())>() : product();
}

}  // namespace cf
