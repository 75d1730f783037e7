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
// Score terms (DESIGN.md section 3b's order: scale, softcap, bias and ALiBi,
// score_mod, then the masks).  A module compiled with CF_SCORE_TERMS defined
// as a ScoreTerms<kMask, Bias...> (cupyflash/_terms.py writes it into the
// source's prelude) reads the additive biases and the bool mask of
// FwdParams; without it Terms is ScoreTerms<false> and none of this code
// exists.  Both epilogues apply them, on every block whatever `partial` says
// (term_pass), element (i, j) = (tile.q0 + q, tile.k0 + tile.key0 + k) with q
// and k as hide_pairs computes them:
//   forward   s -> s + log2(e) sum(bias), and -inf where the mask is False;
//             in the raw (q.k) families the epilogue applies the scale first,
//             s -> s * scale_log2 + log2(e) sum(bias), and those kernels hand
//             the softmax a scale of 1 (softmax_scale_log2);
//   backward  P = exp2(s * scale_log2 + log2(e) sum(bias) - lse_log2), 0 where
//             the mask is False; dS = P (dP - delta) is the bias's gradient
//             (gradient_epilogue adds it up).
// Elements past Lq or Lk (a tile's padding) read no term: bias 0, mask True
// (the window rule hides their keys, their rows are never stored).
//
// The score modifications (softcap, ALiBi, score_mod, mask_mod; Mods below,
// from CF_SOFTCAP, CF_ALIBI, CF_SCORE_MOD, CF_MASK_MOD) run in the same
// passes: with any that changes the scores, the epilogues work in natural
// units -- the scale applied, softcap, + bias, ALiBi, score_mod (ModTile) --
// and go back to base 2; mask_mod joins the mask.  The backward keeps
// score_mod's and the softcap's derivatives per element (ChainRule) from
// probability_epilogue to gradient_epilogue: dS times the first, then dbias,
// then times the second (what dQ and dK take).
//
// How a later feature plugs in:
//   * per-sequence lengths: Rule's seqlen_q / seqlen_k (and WindowMask's
//     diagonal) taken per tile.batch instead of from the params.
#pragma once

#include "fragment.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "params_bwd.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

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

// ---- score terms ------------------------------------------------------------------------------

// The terms a module reads: the mask (kMask) and one additive bias per type in
// Bias (the element type of FwdParams::bias[t], any of the four dtypes; read
// in the accumulator type and summed in order, bias 0 first).
template <bool kMask_, typename... Bias>
struct ScoreTerms {
    static constexpr bool kMask = kMask_;
    static constexpr int kBiases = static_cast<int>(sizeof...(Bias));
    static constexpr bool kBias = kBiases > 0;
    static constexpr bool kAny = kMask || kBias;
    static_assert(kBiases <= kMaxBias, "at most kMaxBias bias terms");
};

#ifndef CF_SCORE_TERMS
#define CF_SCORE_TERMS ScoreTerms<false>
#endif
using Terms = CF_SCORE_TERMS;

// How the scores arrive in the forward's epilogue (the table above): kLog2
// already times scale * log2(e), kRaw as q.k.
enum class Units { kLog2, kRaw };

// One term's view within a score tile: element (q0 + a, k0 + key0 + b) --
// a, b the offsets within the tile, below 2^16 -- at base[a * row + b * key].
// The host keeps |row| + |key| below 2^23 elements for every term
// (cupyflash/_terms.py, TILE_STRIDE_LIMIT), so every in-tile offset fits 32
// bits: one 64-bit address per term and tile, 32-bit arithmetic per element.
// base may point past the view where the tile does (its elements are then
// never read: term_pass tests each element against Lq and Lk first).
template <typename E>
struct TermTile {
    const E* base;
    int row, key;

    __device__ __forceinline__ TermTile(const void* ptr, const int64_t (&st)[4], const ScoreTile& t)
        : base(static_cast<const E*>(ptr) + t.batch * st[0] + t.head * st[1] + t.q0 * st[2] +
               (t.k0 + t.key0) * st[3]),
          row(static_cast<int>(st[2])),
          key(static_cast<int>(st[3])) {}

    __device__ __forceinline__ const E& at(int a, int b) const { return base[a * row + b * key]; }
};

// The bias terms of a tile, bias 0 first: sum(a, b) is their sum at (a, b) in
// the accumulator type, added in order.
template <typename Acc, int kTerm, typename... Bias>
struct BiasTiles {
    __device__ __forceinline__ BiasTiles(const FwdParams&, const ScoreTile&) {}
    __device__ __forceinline__ Acc add(int, int, Acc sum) const { return sum; }
};
template <typename Acc, int kTerm, typename B, typename... Rest>
struct BiasTiles<Acc, kTerm, B, Rest...> {
    TermTile<B> tile;
    BiasTiles<Acc, kTerm + 1, Rest...> rest;

    __device__ __forceinline__ BiasTiles(const FwdParams& p, const ScoreTile& t)
        : tile(p.bias[kTerm], p.bias_strides[kTerm], t), rest(p, t) {}
    __device__ __forceinline__ Acc add(int a, int b, Acc sum) const {
        return rest.add(a, b, sum + static_cast<Acc>(to_acc(tile.at(a, b))));
    }
    __device__ __forceinline__ Acc sum(int a, int b) const {
        return rest.add(a, b, static_cast<Acc>(to_acc(tile.at(a, b))));
    }
};

// The terms of one tile: the biases' sum times log2(e) and the mask's verdict
// at in-tile offsets (a, b).
template <typename Acc, class Terms_> struct TermTiles;
template <typename Acc, bool kMask, typename... Bias>
struct TermTiles<Acc, ScoreTerms<kMask, Bias...>> {
    BiasTiles<Acc, 0, Bias...> bias;
    TermTile<uint8_t> mask;

    __device__ __forceinline__ TermTiles(const FwdParams& p, const ScoreTile& t)
        : bias(p, t), mask(p.mask, p.mask_strides, t) {}

    __device__ __forceinline__ Acc bias_sum(int a, int b) const {
        if constexpr (sizeof...(Bias) == 0) {
            return Acc(0);
        } else {
            return bias.sum(a, b);
        }
    }
    __device__ __forceinline__ Acc bias_log2(int a, int b) const {
        constexpr double kLog2e = 1.44269504088896340736;
        return bias_sum(a, b) * Acc(kLog2e);
    }
    __device__ __forceinline__ bool admits(int a, int b) const {
        if constexpr (kMask) {
            return mask.at(a, b) != 0;
        } else {
            return true;
        }
    }
};

// ---- score modifications (softcap, ALiBi, score_mod, mask_mod) ----------------------------------
//
// A module compiled with them (cupyflash/_terms.py) defines CF_SOFTCAP and
// CF_ALIBI (0 or 1), and CF_SCORE_MOD(Acc, ctx, score, b, h, q_idx, kv_idx)
// / CF_MASK_MOD(Acc, ctx, b, h, q_idx, kv_idx): the user's expressions as
// C++ (cupyflash/_expr.py's cuda()), on natural-unit scores of the
// accumulator type Acc, FwdParams ctx, int64 coordinates.
#ifndef CF_SOFTCAP
#define CF_SOFTCAP 0
#endif
#ifndef CF_ALIBI
#define CF_ALIBI 0
#endif
#ifdef CF_SCORE_MOD
#define CF_HAS_SCORE_MOD 1
#else
#define CF_HAS_SCORE_MOD 0
#define CF_SCORE_MOD(Acc, ctx, score, b, h, q_idx, kv_idx) (score)
#endif
#ifndef CF_SCORE_MOD_GRAD  // d score_mod / d score (cupyflash/_expr.py's derivative)
#define CF_SCORE_MOD_GRAD(Acc, ctx, score, b, h, q_idx, kv_idx) (static_cast<Acc>(1))
#endif
// 1 where that derivative is a number (score + a position bias: 1; a bias that
// ignores the score: 0): the backward multiplies dS by it instead of keeping
// one factor per score element (bwd_dmma's d = 128 dK/dV kernel spilled 16 B
// with `score - gamma[h] * abs(q_idx - kv_idx)` when it kept them).
#ifndef CF_SCORE_MOD_GRAD_CONST
#define CF_SCORE_MOD_GRAD_CONST 0
#endif
#ifdef CF_MASK_MOD
#define CF_HAS_MASK_MOD 1
#else
#define CF_HAS_MASK_MOD 0
#define CF_MASK_MOD(Acc, ctx, b, h, q_idx, kv_idx) (true)
#endif

struct Mods {
    static constexpr bool kSoftcap = CF_SOFTCAP != 0, kAlibi = CF_ALIBI != 0;
    static constexpr bool kScoreMod = CF_HAS_SCORE_MOD != 0, kMaskMod = CF_HAS_MASK_MOD != 0;
    static constexpr bool kModGradConst = kScoreMod && CF_SCORE_MOD_GRAD_CONST != 0;
    static constexpr bool kScores = kSoftcap || kAlibi || kScoreMod;  // they change the scores
    static constexpr bool kAny = kScores || kMaskMod;
};

// An index of a mod_args array outside its axis: the emulator reports it (the
// dispatcher raises IndexError); a GPU traps (the context is then unusable).
__device__ __forceinline__ void mod_index_fault() {
#ifdef CUPYFLASH_EMULATOR
    cfemu_trap("cupyflash: mod_args index out of bounds", __FILE__, __LINE__);
#else
    __trap();
#endif
}

// Element idx... of mod_args array t (kAxes axes), bounds-checked.
template <typename E, int kAxes, typename... I>
__device__ __forceinline__ E mod_read(const FwdParams& p, int t, I... idx) {
    static_assert(sizeof...(I) == kAxes && kAxes <= 4, "one index per axis");
    const int64_t at[kAxes] = {static_cast<int64_t>(idx)...};
    int64_t offset = 0;
#pragma unroll
    for (int axis = 0; axis < kAxes; ++axis) {
        if (at[axis] < 0 || at[axis] >= p.mod_shape[t][axis]) mod_index_fault();
        offset += at[axis] * p.mod_strides[t][axis];
    }
    return static_cast<const E*>(p.mod_args[t])[offset];
}

template <typename X> __device__ __forceinline__ X mod_abs(X x) { return x < X(0) ? -x : x; }
template <typename X> __device__ __forceinline__ X mod_min(X a, X b) { return a <= b ? a : b; }
template <typename X> __device__ __forceinline__ X mod_max(X a, X b) { return a >= b ? a : b; }

// The modifications of one score tile: its (b, h) coordinates, ALiBi slope and
// diagonal, and the softcap; `at` / `admits` for element (i, j) of the
// problem.
template <typename Acc>
struct ModTile {
    int64_t b = 0, h = 0, diagonal = 0;
    Acc slope = Acc(0), cap = Acc(0);
    const FwdParams& p;

    __device__ __forceinline__ ModTile(const FwdParams& params, const ScoreTile& t) : p(params) {
        if constexpr (Mods::kAny) {
            b = coordinate<int64_t>(0, t);
            h = coordinate<int64_t>(1, t);
        }
        if constexpr (Mods::kAlibi) {
            slope = static_cast<Acc>(coordinate<double>(2, t));
            diagonal = p.seqlen_k - p.seqlen_q;
        }
        if constexpr (Mods::kSoftcap) cap = static_cast<Acc>(p.softcap);
    }
    // Table c (FwdParams::coord) at the tile's (batch, head).
    template <typename E>
    __device__ __forceinline__ E coordinate(int c, const ScoreTile& t) const {
        return static_cast<const E*>(p.coord[c])[t.batch * p.coord_strides[c][0] + t.head * p.coord_strides[c][1]];
    }
    // s (natural units, the scale applied) -> capped (step 2 of DESIGN 3b); with
    // d_cap, also its derivative 1 - tanh^2.
    __device__ __forceinline__ Acc capped(Acc s, Acc* d_cap = nullptr) const {
        if constexpr (Mods::kSoftcap) {
            const Acc t = tanh(s / cap);
            if (d_cap != nullptr) *d_cap = Acc(1) - t * t;
            return cap * t;
        } else {
            return s;
        }
    }
    // s (after the bias) -> after ALiBi and score_mod (steps 3-4) at query i, key j;
    // with d_mod, also score_mod's derivative there.
    __device__ __forceinline__ Acc modified(Acc s, int64_t i, int64_t j, Acc* d_mod = nullptr) const {
        if constexpr (Mods::kAlibi) s -= slope * static_cast<Acc>(mod_abs(i + diagonal - j));
        if constexpr (Mods::kScoreMod) {
            if (d_mod != nullptr) *d_mod = static_cast<Acc>(CF_SCORE_MOD_GRAD(Acc, p, s, b, h, i, j));
        }
        return static_cast<Acc>(CF_SCORE_MOD(Acc, p, s, b, h, i, j));
    }
    __device__ __forceinline__ bool admits(int64_t i, int64_t j) const {
        return CF_MASK_MOD(Acc, p, b, h, i, j);
    }
};

// The backward's chain rule through the modifications: per element of a score
// fragment, score_mod's derivative (d_mod) and the softcap's (d_cap), kept from
// probability_epilogue (where the scores are) to the dS they multiply
// (gradient_epilogue); no registers without those modifications, nor for a
// score_mod whose derivative is a number (Mods::kModGradConst: dS times it).
template <typename Acc, int R, int C>
struct ChainRule {
    static constexpr bool kMod = Mods::kScoreMod && !Mods::kModGradConst, kCap = Mods::kSoftcap;
    Acc mod[kMod ? R : 1][kMod ? C : 1];
    Acc cap[kCap ? R : 1][kCap ? C : 1];

    __device__ __forceinline__ void set(int r, int c, Acc d_mod, Acc d_cap) {
        if constexpr (kMod) mod[r][c] = d_mod;
        if constexpr (kCap) cap[r][c] = d_cap;
    }
    // dS -> dS d_mod, 0 where P is 0 (a hidden pair's d_mod may be anything, even NaN).
    __device__ __forceinline__ void through_mod(Acc (&ds)[R][C], const Acc (&prob)[R][C]) const {
        if constexpr (kMod) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int c = 0; c < C; ++c) ds[r][c] = prob[r][c] == Acc(0) ? Acc(0) : ds[r][c] * mod[r][c];
        }
#if CF_SCORE_MOD_GRAD_CONST  // the macro names no context then
        if constexpr (Mods::kModGradConst) {
            const Acc d_mod = static_cast<Acc>(CF_SCORE_MOD_GRAD(Acc, 0, 0, 0, 0, 0, 0));
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int c = 0; c < C; ++c) ds[r][c] = prob[r][c] == Acc(0) ? Acc(0) : ds[r][c] * d_mod;
        }
#endif
    }
    __device__ __forceinline__ void through_cap(Acc (&ds)[R][C]) const {
        if constexpr (kCap) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int c = 0; c < C; ++c) ds[r][c] *= cap[r][c];
        }
    }
};

// A ChainRule for the score fragment s (its element type and shape).
template <typename Acc, int R, int C>
__device__ __forceinline__ ChainRule<Acc, R, C> chain_for(const Acc (&)[R][C]) {
    return {};
}

// Whether the epilogue applies the scale (the raw-score kernels' softmax then takes 1).
constexpr bool kEpilogueScales = Terms::kBias || Mods::kScores;
constexpr bool kAnyTerms = Terms::kAny || Mods::kAny;

// The scale a forward kernel's softmax multiplies raw scores by: scale *
// log2(e), or 1 where the epilogue has applied it (a bias, or a modification
// that changes the scores).
template <typename Acc>
__device__ __forceinline__ Acc softmax_scale_log2(const FwdParams& p) {
    return kEpilogueScales ? Acc(1) : static_cast<Acc>(p.scale_log2);
}

// For each element [r][c] of a fragment: f(r, c, a, b, inside): its query
// offset a and key offset b within the tile (kQueryRows: a from the row, b
// from the column; else the transpose) and whether it lies inside the problem
// (below Lq and Lk): elements outside read no term.
template <bool kQueryRows, int R, int C, class Frag, class F>
__device__ __forceinline__ void term_pass(const Frag& frag, const FwdParams& p, const ScoreTile& tile, const F& f) {
    // rows and keys of the problem from the tile's corner on (clamped: tiles are < 2^16)
    const int queries_left = static_cast<int>(min64(p.seqlen_q - tile.q0, 1 << 16));
    const int keys_left = static_cast<int>(min64(max64(p.seqlen_k - tile.k0 - tile.key0, 0), 1 << 16));
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int a = kQueryRows ? frag.row(r) : frag.col(c);  // query offset
            const int b = kQueryRows ? frag.col(c) : frag.row(r);  // key offset
            f(r, c, a, b, a < queries_left && b < keys_left);
        }
    }
}

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

// The forward's epilogue: the score terms (biases added, -inf where the mask
// is False; kUnits: how the scores arrive), then scores of keys a query may
// not see (window, causal, beyond Lk) -> -inf.
template <class Rule, bool kQueryRows = true, Units kUnits = Units::kLog2, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void score_epilogue(Acc (&s)[R][C], const Frag& frag, const WindowMask& mask,
                                               const FwdParams& p, const ScoreTile& tile, bool partial) {
    if constexpr (kAnyTerms) {
        const Acc scale_log2 = static_cast<Acc>(p.scale_log2);
        const TermTiles<Acc, Terms> terms(p, tile);
        const ModTile<Acc> mods(p, tile);
        term_pass<kQueryRows, R, C>(frag, p, tile, [&](int r, int c, int a, int b, bool inside) {
            if (!inside) {  // past Lq (never stored) or Lk (hidden by the rule): scaled, read nothing
                if constexpr (kEpilogueScales && kUnits == Units::kRaw) s[r][c] *= scale_log2;
                return;
            }
            const int64_t i = tile.q0 + a, j = tile.k0 + tile.key0 + b;
            Acc x = s[r][c];
            if constexpr (Mods::kScores) {  // DESIGN 3b in natural units, then back to log2 units
                constexpr double kLn2 = 0.69314718055994530942, kLog2e = 1.44269504088896340736;
                Acc v = kUnits == Units::kRaw ? x * static_cast<Acc>(p.scale) : x * Acc(kLn2);
                v = mods.modified(mods.capped(v) + terms.bias_sum(a, b), i, j);
                x = v * Acc(kLog2e);
            } else if constexpr (Terms::kBias) {
                const Acc bias = terms.bias_log2(a, b);
                x = kUnits == Units::kRaw ? fma(x, scale_log2, bias) : x + bias;
            }
            s[r][c] = terms.admits(a, b) && mods.admits(i, j) ? x : neg_inf<Acc>();
        });
    }
    if (partial) hide_pairs<kQueryRows>(s, frag, Rule(mask, p, tile), tile.key0, neg_inf<Acc>());
}

// P = exp2(s * scale_log2 - lse_log2): ex2.approx in float, exp2 in double.
template <typename Acc>
__device__ __forceinline__ Acc probability(Acc s, Acc scale_log2, Acc lse_log2) {
    return exp2_acc(s * scale_log2 - lse_log2);
}

// The backward's epilogue: s -> P = exp2(s * scale_log2 - lse_log2(r, c))
// (ex2.approx in float, exp2 in double; with the biases' log2(e) sum(bias)
// inside the exponent, and 0 where the mask is False), then P of pairs that
// are not admissible (window, causal, past Lq or Lk) -> 0.  `partial` is a callable,
// asked after the exponentials: evaluated before them, the block test's 64-bit
// arithmetic stayed live across them (bwd_dmma's dQ kernel: 164 -> 182 registers).
template <class Rule, bool kQueryRows, Walk kWalk = Walk::kByQuery, class Frag, typename Acc, int R, int C,
          class Partial, class Stat>
__device__ __forceinline__ void probability_epilogue(Acc (&s)[R][C], const Frag& frag, const WindowMask& mask,
                                                     const FwdParams& p, const ScoreTile& tile,
                                                     const Partial& partial, const Stat& lse_log2,
                                                     Acc scale_log2, ChainRule<Acc, R, C>& chain) {
    if constexpr (kAnyTerms) {
        const TermTiles<Acc, Terms> terms(p, tile);
        const ModTile<Acc> mods(p, tile);
        term_pass<kQueryRows, R, C>(frag, p, tile, [&](int r, int c, int a, int b, bool inside) {
            if (!inside) {  // past Lq (lse_log2 +inf: P = 0) or Lk (hidden by the rule)
                s[r][c] = probability(s[r][c], scale_log2, lse_log2(r, c));
                chain.set(r, c, Acc(1), Acc(1));
                return;
            }
            const int64_t i = tile.q0 + a, j = tile.k0 + tile.key0 + b;
            Acc x;
            if constexpr (Mods::kScores) {
                constexpr double kLog2e = 1.44269504088896340736;
                Acc d_cap = Acc(1), d_mod = Acc(1);
                const Acc v = mods.modified(mods.capped(s[r][c] * static_cast<Acc>(p.scale), &d_cap) +
                                            terms.bias_sum(a, b), i, j, &d_mod);
                chain.set(r, c, d_mod, d_cap);
                x = exp2_acc(v * Acc(kLog2e) - lse_log2(r, c));
            } else {
                x = exp2_acc((s[r][c] * scale_log2 + terms.bias_log2(a, b)) - lse_log2(r, c));
            }
            s[r][c] = terms.admits(a, b) && mods.admits(i, j) ? x : Acc(0);
        });
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < C; ++c) s[r][c] = probability(s[r][c], scale_log2, lse_log2(r, c));
    }
    if (partial()) hide_pairs<kQueryRows, kWalk>(s, frag, Rule(mask, p, tile), tile.key0, Acc(0));
}

// The bias gradients: dbias[t] += dS for every bias term t, at the element
// (query i, key j) of each dS[r][c] inside the problem, in a dK/dV kernel
// (rows are keys: i from the column, j from the row).  The caller makes each
// launch's writes disjoint between CTAs (cupyflash/_dispatch.py: one launch
// per batch entry or kv head along which a term is broadcast, and no
// gradient of a term broadcast along the keys: it is exactly 0) and zeroes
// dbias first; within a CTA one thread adds a given element (every head of a
// GQA group and every query block in turn, so the sums run in a fixed order:
// bit-identical run to run), except where term t is broadcast along the
// queries (dbias_strides[t][2] == 0): there the Frag::kRowLanes lanes holding
// a key's queries sum theirs first (shuffles) and the first of them adds.
template <int kTerm, typename Out, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void add_bias_gradient(const Acc (&ds)[R][C], const Frag& frag, const BwdParams& params,
                                                  const ScoreTile& tile) {
    const FwdParams& p = params.fwd;
    if (params.dbias[kTerm] == nullptr) return;  // no gradient asked (a term constant along the keys)
    const TermTile<Out> db(params.dbias[kTerm], params.dbias_strides[kTerm], tile);
    Out* const base = const_cast<Out*>(db.base);
    const int queries_left = static_cast<int>(min64(p.seqlen_q - tile.q0, 1 << 16));
    const int keys_left = static_cast<int>(min64(max64(p.seqlen_k - tile.k0 - tile.key0, 0), 1 << 16));
    if (db.row == 0) {  // broadcast along the queries: one sum per key
#pragma unroll
        for (int r = 0; r < R; ++r) {
            Acc sum = Acc(0);
#pragma unroll
            for (int c = 0; c < C; ++c)
                if (frag.col(c) < queries_left) sum += ds[r][c];
            sum = group_sum<Frag::kRowLanes>(sum);
            const int b = frag.row(r);
            if (b < keys_left && (lane_id() & (Frag::kRowLanes - 1)) == 0) base[b * db.key] += static_cast<Out>(sum);
        }
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = frag.row(r);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int a = frag.col(c);
                if (a < queries_left && b < keys_left) base[a * db.row + b * db.key] += static_cast<Out>(ds[r][c]);
            }
        }
    }
}

template <int kTerm, int kTerms, typename Out, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void add_bias_gradients(const Acc (&ds)[R][C], const Frag& frag, const BwdParams& params,
                                                   const ScoreTile& tile) {
    if constexpr (kTerm < kTerms) {
        add_bias_gradient<kTerm, Out>(ds, frag, params, tile);
        add_bias_gradients<kTerm + 1, kTerms, Out>(ds, frag, params, tile);
    }
}

// dS^T of a dK/dV kernel's tile (rows keys; P^T in prob) -> dS through
// score_mod, the bias gradients from it (of the call's accumulator type Out,
// dbias's: float for float32 inputs that bwd_dmma computes in double), then dS
// through the softcap: what dK (and an atomic dQ) take.  Nothing without terms.
// `tile` as its probability_epilogue's.
template <typename Out, class Frag, typename Acc, int R, int C>
__device__ __forceinline__ void gradient_epilogue(Acc (&ds)[R][C], const Acc (&prob)[R][C],
                                                  const ChainRule<Acc, R, C>& chain, const Frag& frag,
                                                  const BwdParams& params, const ScoreTile& tile) {
    chain.through_mod(ds, prob);
    if constexpr (Terms::kBias) add_bias_gradients<0, Terms::kBiases, Out>(ds, frag, params, tile);
    chain.through_cap(ds);
}

// The same for a dQ kernel's dS (no bias gradient: the dK/dV kernel adds it).
template <typename Acc, int R, int C>
__device__ __forceinline__ void gradient_epilogue(Acc (&ds)[R][C], const Acc (&prob)[R][C],
                                                  const ChainRule<Acc, R, C>& chain) {
    chain.through_mod(ds, prob);
    chain.through_cap(ds);
}

// fwd_v1's form (its threads walk a shared score tile element by element):
// the score of element e, computed by product() only where the mask admits
// the pair, -inf elsewhere.
template <class Rule, class Product>
__device__ __forceinline__ auto score_element(const ElementFragment& e, const WindowMask& mask, const FwdParams& p,
                                              const ScoreTile& tile, const Product& product) -> decltype(product()) {
    static_assert(sizeof(Rule) > 0 && !kAnyTerms, "fwd_v1 takes no score terms");  // (checked per instantiation)
    const Rule rule(mask, p, tile);
    int lo = 0, hi = 0;
    if (!Rule::kBoundsQueries || !rule.gone(e.row(0))) rule.range(e.row(0), lo, hi);
    const int k = tile.key0 + e.col(0);
    return k < lo || k >= hi ? neg_inf<decltype(product())>() : product();
}

}  // namespace cf
