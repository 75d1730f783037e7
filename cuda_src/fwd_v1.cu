// fwd_v1.cu -- FlashAttention v1, Algorithm 1 of Dao et al. (2022), literally.
//
// For teaching and benchmarking; `attention` never picks it.  Block sizes come
// from an SRAM size M (line 1, computed on the host: cupyflash/_launch.py);
// the OUTER loop walks K/V blocks j, the INNER loop Q blocks i; O, l and m
// live in global memory ("HBM") and make the round trip on every step,
// exactly as in the paper.  One CTA per (batch, head) does the whole loop
// nest, its threads sharing each step.  Line numbers below are the paper's.
//
// Differences from the paper's listing, none of which changes the arithmetic:
// * the softmax scale and the mask (window / causal, bottom-right aligned, as
//   everywhere in cupyflash) are applied to S_ij, and a pair (i, j) whose
//   block is entirely masked is skipped (it would leave O_i, l_i, m_i as
//   they are);
// * exponentials are base 2: S_ij is multiplied by scale * log2(e), so
//   e^{x} of the paper is exp2 of our x, and m is kept in those units;
// * a row that has seen no admissible key yet has m = -inf; it is
//   exponentiated against 0 instead (softmax.cuh), so it stays at
//   O = 0, l = 0 with no NaN, and ends with lse = -inf;
// * d != dv is allowed (Q, K are Br/Bc x d; V, O are Bc/Br x dv);
// * after the loops the kernel also casts O into `out` and writes lse.
#pragma once

#include "block_info.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "score.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"

namespace cf {

constexpr int kV1Threads = 128;

template <typename T>
__global__ void __launch_bounds__(kV1Threads) fwd_v1_kernel(const FwdParams params) {
    using Acc = acc_t<T>;
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = warp_id(), lane = lane_id();
    constexpr int kWarps = kV1Threads / 32;

    // One CTA per (batch, head); fewer than 2^31 of them (launch_config checks).
    const int heads = static_cast<int>(params.heads_q), cta = static_cast<int>(blockIdx.x);
    const int64_t batch = cta / heads, head = cta % heads;
    const HeadSlice<T, Acc> hs(params, batch, head);
    const WindowMask mask(params);
    const int64_t n_q = params.seqlen_q, n_k = params.seqlen_k;
    const int d = static_cast<int>(params.head_dim), dv = static_cast<int>(params.head_dim_v);
    const Acc scale_log2 = static_cast<Acc>(params.scale_log2);

    // Line 1 (done on the host): Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d).
    const int Br = static_cast<int>(params.block_m), Bc = static_cast<int>(params.block_n);

    // This head's O (n_q x dv), l and m (n_q) in global memory.
    const int64_t bh = batch * params.heads_q + head;
    Acc* O = static_cast<Acc*>(params.ws_o) + bh * n_q * dv;
    Acc* l = static_cast<Acc*>(params.ws_l) + bh * n_q;
    Acc* m = static_cast<Acc*>(params.ws_m) + bh * n_q;

    // On-chip SRAM: K_j, V_j, Q_i, O_i, S_ij (= P~_ij in place), and per row
    // of the Q block: l_i, m_i, m~_ij, 1 / l_i^new, m_i^new, l_i^new.  (l~_ij
    // lives in a register of the warp that computes its row.)
    Acc* sK = reinterpret_cast<Acc*>(dynamic_smem());
    Acc* sV = sK + Bc * d;
    Acc* sQ = sV + Bc * dv;
    Acc* sO = sQ + Br * d;
    Acc* sS = sO + Br * dv;
    Acc* s_l = sS + Br * Bc;
    Acc* s_m = s_l + Br;
    Acc* s_m_tilde = s_m + Br;
    Acc* s_inv_l_new = s_m_tilde + Br;
    Acc* s_m_new = s_inv_l_new + Br;
    Acc* s_l_new = s_m_new + Br;

    // Line 2: O = (0), l = (0), m = (-inf) in HBM.
    for (int64_t idx = tid; idx < n_q * dv; idx += kV1Threads) O[idx] = Acc(0);
    for (int64_t r = tid; r < n_q; r += kV1Threads) {
        l[r] = Acc(0);
        m[r] = neg_inf<Acc>();
    }
    __syncthreads();

    // Lines 3-4: Tr = ceil(N_q / Br) blocks of Br query rows (and of O, l, m),
    // Tc = ceil(N_k / Bc) blocks of Bc keys; block j starts at key n0 = j Bc,
    // block i at row m0 = i Br.
    for (int64_t n0 = 0; n0 < n_k; n0 += Bc) {  // line 5: for 1 <= j <= Tc
        // Line 6: load K_j, V_j from HBM to on-chip SRAM.
        const int keys = QueryBlock::keys_in(params, n0, Bc);
        load_tile<kV1Threads>(sK, PlainRows{d}, hs.k + n0 * params.k_row_stride,
                              params.k_row_stride, Bc, d, keys, d);
        load_tile<kV1Threads>(sV, PlainRows{dv}, hs.v + n0 * params.v_row_stride,
                              params.v_row_stride, Bc, dv, keys, dv);
        __syncthreads();

        for (int64_t m0 = 0; m0 < n_q; m0 += Br) {  // line 7: for 1 <= i <= Tr
            const QueryBlock qb(params, mask, m0, Br);
            if (!qb.sees_any(n0, keys)) continue;  // no admissible (row, key) in the pair
            const int rows = qb.rows;

            // Line 8: load Q_i, O_i, l_i, m_i from HBM to on-chip SRAM.
            load_tile<kV1Threads>(sQ, PlainRows{d}, hs.q + m0 * params.q_row_stride,
                                  params.q_row_stride, Br, d, rows, d);
            load_tile<kV1Threads>(sO, PlainRows{dv}, O + m0 * dv, dv, Br, dv, rows, dv);
            for (int r = tid; r < Br; r += kV1Threads) {
                s_l[r] = r < rows ? l[m0 + r] : Acc(0);
                s_m[r] = r < rows ? m[m0 + r] : neg_inf<Acc>();
            }
            __syncthreads();

            // Line 9: S_ij = Q_i K_j^T (times scale * log2 e; -inf where masked,
            // and in the padding rows/columns of a partial block).
            const ScoreTile score_tile{batch, head, m0, n0, 0, keys};
            for (int idx = tid; idx < Br * Bc; idx += kV1Threads) {
                const int r = idx / Bc, c = idx - r * Bc;
                sS[idx] = score_element<WindowRule<true>>(ElementFragment{r, c}, mask, params, score_tile, [&] {
                    Acc dot = Acc(0);
                    for (int k = 0; k < d; ++k) dot += sQ[r * d + k] * sK[c * d + k];
                    return dot * scale_log2;
                });
            }
            __syncthreads();

            // Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
            // Line 11: m_i^new = max(m_i, m~_ij),
            //          l_i^new = e^{m_i - m_i^new} l_i + e^{m~_ij - m_i^new} l~_ij.
            // One warp per row.
            for (int r = warp; r < Br; r += kWarps) {
                Acc* S_row = sS + r * Bc;
                Acc m_tilde = neg_inf<Acc>();
                for (int c = lane; c < Bc; c += 32) m_tilde = max_acc(m_tilde, S_row[c]);
                m_tilde = group_max<32>(m_tilde);
                const Acc ref_tilde = exp2_reference(m_tilde);
                Acc l_tilde = Acc(0);
                for (int c = lane; c < Bc; c += 32) {
                    S_row[c] = exp2_acc(S_row[c] - ref_tilde);
                    l_tilde += S_row[c];
                }
                l_tilde = group_sum<32>(l_tilde);
                if (lane == 0) {
                    const Acc m_new = max_acc(s_m[r], m_tilde);
                    const Acc ref_new = exp2_reference(m_new);
                    const Acc l_new = exp2_acc(s_m[r] - ref_new) * s_l[r] +
                                      exp2_acc(m_tilde - ref_new) * l_tilde;
                    s_m_tilde[r] = m_tilde;
                    s_m_new[r] = m_new;
                    s_l_new[r] = l_new;
                    // diag(l_i^new)^-1 of line 12; a row with no key yet keeps O_i = 0.
                    s_inv_l_new[r] = l_new > Acc(0) ? Acc(1) / l_new : Acc(0);
                }
            }
            __syncthreads();

            // Line 12: O_i <- diag(l_i^new)^-1 (diag(l_i) e^{m_i - m_i^new} O_i
            //                                  + e^{m~_ij - m_i^new} P~_ij V_j), written to HBM.
            for (int idx = tid; idx < rows * dv; idx += kV1Threads) {
                const int r = idx / dv, n = idx - r * dv;
                Acc pv = Acc(0);
                for (int c = 0; c < Bc; ++c) pv += sS[r * Bc + c] * sV[c * dv + n];
                const Acc ref_new = exp2_reference(s_m_new[r]);
                const Acc updated = s_l[r] * exp2_acc(s_m[r] - ref_new) * sO[r * dv + n] +
                                    exp2_acc(s_m_tilde[r] - ref_new) * pv;
                O[(m0 + r) * dv + n] = updated * s_inv_l_new[r];
            }
            // Line 13: l_i <- l_i^new, m_i <- m_i^new, written to HBM.
            for (int r = tid; r < rows; r += kV1Threads) {
                l[m0 + r] = s_l_new[r];
                m[m0 + r] = s_m_new[r];
            }
            __syncthreads();  // line 14: the next Q block reuses the on-chip buffers
        }
    }  // line 15

    // Line 16: return O -- rounded into `out` -- and lse = ln(2) (m + log2 l).
    for (int64_t m0 = 0; m0 < n_q; m0 += Br) {
        const int rows = static_cast<int>(min64(Br, n_q - m0));
        for (int idx = tid; idx < rows * dv; idx += kV1Threads) {
            const int r = idx / dv, n = idx - r * dv;
            hs.out[(m0 + r) * params.out_row_stride + n] = from_acc<T>(O[(m0 + r) * dv + n]);
        }
    }
    if (hs.lse != nullptr)
        for (int64_t r = tid; r < n_q; r += kV1Threads)
            hs.lse[r * params.lse_row_stride] = row_lse(m[r], l[r]);
}

}  // namespace cf
