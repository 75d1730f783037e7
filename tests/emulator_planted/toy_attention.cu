// toy_attention.cu -- not a planted bug: a small, correct FlashAttention-2 style
// forward (f16 in, f32 out, one head per blockIdx.y, no masking, L a multiple of
// 64, head dim 64) built from every ptx.cuh instruction: cp.async double
// buffering, ldmatrix (plain and .trans), mma.sync m16n8k16, exp2 and quad
// shuffles.  tests/test_emulator.py runs it end to end against NumPy and times
// the emulator on it.  kPrefetchWait = false plants a bug: the next-to-last
// iteration skips its cp_async_wait<1>, so it reads a K/V block still in flight.
#include "ptx.cuh"

struct ToyAttentionParams {
    const __half* q;  // [heads, L, 64]
    const __half* k;
    const __half* v;
    float* o;         // [heads, L, 64]
    int32_t L;
    float scale_log2;  // softmax scale * log2(e)
};

namespace toy {

constexpr int D = 64, BM = 64, BN = 64, kThreads = 128;
constexpr int kTileBytes = 64 * D * 2;  // one 64 x 64 f16 tile

// Copies a 64 x 64 f16 tile (rows of D) into shared memory, 16 bytes per cp.async.
__device__ __forceinline__ void load_tile(char* dst, const __half* src) {
    for (int c = threadIdx.x; c < 64 * D / 8; c += kThreads) {
        const int row = c / (D / 8), chunk = c % (D / 8);
        cf::cp_async_16(dst + row * D * 2 + chunk * 16, src + row * D + chunk * 8, 16);
    }
}

// Address of element (r, c) of a tile in shared memory.
__device__ __forceinline__ const char* at(const char* tile, int r, int c) { return tile + (r * D + c) * 2; }

}  // namespace toy

template <bool kPrefetchWait>
__global__ void toy_attention(const ToyAttentionParams p) {
    using namespace toy;
    char* smem = cf::dynamic_smem();
    char* sq = smem;
    char* sk[2] = {smem + kTileBytes, smem + 2 * kTileBytes};
    char* sv[2] = {smem + 3 * kTileBytes, smem + 4 * kTileBytes};
    const int lane = cf::lane_id(), warp = cf::warp_id(), g = lane >> 2, t = lane & 3;
    const size_t head = static_cast<size_t>(blockIdx.y) * p.L * D;
    const int m0 = blockIdx.x * BM;
    const int nblocks = p.L / BN;

    load_tile(sq, p.q + head + static_cast<size_t>(m0) * D);
    load_tile(sk[0], p.k + head);
    load_tile(sv[0], p.v + head);
    cf::cp_async_commit();

    uint32_t qa[D / 16][4];
    float o[D / 8][4] = {};
    float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.0f, 0.0f};

    for (int j = 0; j < nblocks; ++j) {
        const int buf = j & 1;
        if (j + 1 < nblocks) {
            load_tile(sk[buf ^ 1], p.k + head + static_cast<size_t>(j + 1) * BN * D);
            load_tile(sv[buf ^ 1], p.v + head + static_cast<size_t>(j + 1) * BN * D);
            cf::cp_async_commit();
            if (kPrefetchWait || j + 2 < nblocks) cf::cp_async_wait<1>();
        } else {
            cf::cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0)
            for (int kk = 0; kk < D / 16; ++kk)
                cf::ldmatrix_x4(qa[kk], at(sq, warp * 16 + (lane & 15), kk * 16 + 8 * (lane >> 4)));

        // S = Q K^T for this warp's 16 rows and BN keys.
        float s[BN / 8][4];
        for (int nt = 0; nt < BN / 8; ++nt)
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
        for (int kk = 0; kk < D / 16; ++kk)
            for (int np = 0; np < BN / 16; ++np) {
                uint32_t kb[4];
                const int key = np * 16 + (lane & 7) + 8 * (lane >> 4), dim = kk * 16 + 8 * ((lane >> 3) & 1);
                cf::ldmatrix_x4(kb, at(sk[buf], key, dim));
                const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
                cf::mma_m16n8k16_f16(s[2 * np], qa[kk], b0, s[2 * np]);
                cf::mma_m16n8k16_f16(s[2 * np + 1], qa[kk], b1, s[2 * np + 1]);
            }

        // Online softmax on rows g (h = 0) and g + 8 (h = 1); a row lives in one quad.
        float rescale[2];
        for (int h = 0; h < 2; ++h) {
            float mx = m_row[h];
            for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            mx = fmaxf(mx, cf::shfl_xor(mx, 1));
            mx = fmaxf(mx, cf::shfl_xor(mx, 2));
            rescale[h] = cf::exp2_approx((m_row[h] - mx) * p.scale_log2);
            m_row[h] = mx;
            float sum = 0.0f;
            for (int nt = 0; nt < BN / 8; ++nt)
                for (int e = 0; e < 2; ++e) {
                    float& x = s[nt][2 * h + e];
                    x = cf::exp2_approx(x * p.scale_log2 - mx * p.scale_log2);
                    sum += x;
                }
            sum += cf::shfl_xor(sum, 1);
            sum += cf::shfl_xor(sum, 2);
            l_row[h] = l_row[h] * rescale[h] + sum;
        }
        for (int dt = 0; dt < D / 8; ++dt)
            for (int i = 0; i < 4; ++i) o[dt][i] *= rescale[i >> 1];

        // O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of keys 16kk..16kk+15.
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint32_t pa[4] = {
                cf::pack_half2(s[2 * kk][0], s[2 * kk][1]), cf::pack_half2(s[2 * kk][2], s[2 * kk][3]),
                cf::pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]), cf::pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];
                const int key = kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), dim = dp * 16 + 8 * (lane >> 4);
                cf::ldmatrix_x4_trans(vb, at(sv[buf], key, dim));
                const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
                cf::mma_m16n8k16_f16(o[2 * dp], pa, b0, o[2 * dp]);
                cf::mma_m16n8k16_f16(o[2 * dp + 1], pa, b1, o[2 * dp + 1]);
            }
        }
        __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
    }

    float* out = p.o + head + static_cast<size_t>(m0 + warp * 16) * D;
    for (int dt = 0; dt < D / 8; ++dt)
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = dt * 8 + 2 * t + (i & 1);
            out[row * D + col] = o[dt][i] / l_row[i >> 1];
        }
}
