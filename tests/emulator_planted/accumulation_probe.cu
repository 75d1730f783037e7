// accumulation_probe.cu -- one tensor-core product D = A B + C per launch, on inputs
// chosen by benchmarks/gpu_first_contact.py so that the float32 result says how the
// tensor cores add the products: exactly and rounded once (as the emulator does), or
// aligned to the largest term's exponent with a few bits kept below float32's last
// and the rest dropped (Fasi et al. 2021; Khattak & Mikaitis 2025).  The script
// decodes the output; tests/test_gpu_first_contact.py runs these kernels on the
// emulator.
//
// accumulation_probe<kKind>:
//   0  mma.sync m16n8k16 bf16, one warp (32 threads)
//   1  mma.sync m16n8k8 tf32, one warp (32 threads)
//   2  wgmma m64n64k16 bf16, A and B from shared memory, K-major, one warpgroup
//      (128 threads; shared memory: two 64 x 64 pages and 1 KB of slack); compiled
//      for sm_90a (and the emulator) only: other targets build kinds 0 and 1
// p.in holds A (M x K), B (K x N) and C (M x N), row-major floats one after the
// other; p.out receives D (M x N, row-major).  The inputs must be exact in the
// instruction's input type (the script picks powers of two and 1.5): they are
// converted, not checked.
#include "ptx.cuh"
#include "mma_tile.cuh"
#include "planted_params.cuh"
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CF_PROBE_WGMMA 1
#include "wgmma.cuh"
#endif

namespace probe {

template <int kKind> struct Shape;
template <> struct Shape<0> { static constexpr int M = 16, N = 8, K = 16; };
template <> struct Shape<1> { static constexpr int M = 16, N = 8, K = 8; };
template <> struct Shape<2> { static constexpr int M = 64, N = 64, K = 16; };

// mma.sync's accumulator fragment: register i of lane (g, t) holds row g + 8 (i >> 1),
// column 2 t + (i & 1) (cuda_src/ptx.cuh).
__device__ int mma_row(int i) { return (cf::lane_id() >> 2) + 8 * (i >> 1); }
__device__ int mma_col(int i) { return 2 * (cf::lane_id() & 3) + (i & 1); }

}  // namespace probe

template <int kKind>
__global__ void accumulation_probe(const PlantedParams p) {
    using namespace probe;
    constexpr int M = Shape<kKind>::M, N = Shape<kKind>::N, K = Shape<kKind>::K;
    const float* A = p.in;
    const float* B = A + M * K;
    const float* C = B + K * N;
    const int g = cf::lane_id() >> 2, t = cf::lane_id() & 3;

    if constexpr (kKind == 0 || kKind == 1) {
        float c[4], d[4];
        uint32_t a[4], b[2];
        for (int i = 0; i < 4; ++i) c[i] = C[mma_row(i) * N + mma_col(i)];
        if constexpr (kKind == 0) {
            // a[j]: row g + 8 (j & 1), columns 2t, 2t + 1 (+ 8 for j >= 2); b[j]: rows 2t, 2t + 1 (+ 8 j)
            for (int j = 0; j < 4; ++j) {
                const int row = g + 8 * (j & 1), col = 2 * t + 8 * (j >> 1);
                a[j] = cf::pack_bf162(A[row * K + col], A[row * K + col + 1]);
            }
            for (int j = 0; j < 2; ++j) {
                const int k = 2 * t + 8 * j;
                b[j] = cf::pack_bf162(B[k * N + g], B[(k + 1) * N + g]);
            }
            cf::mma_m16n8k16_bf16(d, a, b, c);
        } else {
            // a[j]: row g + 8 (j & 1), column t + 4 (j >> 1); b[j]: row t + 4 j, column g
            for (int j = 0; j < 4; ++j) a[j] = cf::to_tf32(A[(g + 8 * (j & 1)) * K + t + 4 * (j >> 1)]);
            for (int j = 0; j < 2; ++j) b[j] = cf::to_tf32(B[(t + 4 * j) * N + g]);
            cf::mma_m16n8k8_tf32(d, a, b, c);
        }
        for (int i = 0; i < 4; ++i) p.out[mma_row(i) * N + mma_col(i)] = d[i];
    } else {
#ifdef CF_PROBE_WGMMA
        using bf16 = __nv_bfloat16;
        using Tile = cf::SwizzledTile<64, 64>;   // A [m][k] and B^T [n][k]: k in columns 0..15
        char* smem = cf::dynamic_smem();
        smem += (1024 - (cf::smem_addr(smem) & 1023)) & 1023;   // 1024-byte aligned pages
        bf16* sA = reinterpret_cast<bf16*>(smem);
        bf16* sB = sA + Tile::kElements;
        for (int i = threadIdx.x; i < M * K; i += 128) {
            const int r = i / K, k = i % K;
            sA[Tile::chunk(r, k / 8) + k % 8] = __float2bfloat16(A[i]);
        }
        for (int i = threadIdx.x; i < K * N; i += 128) {
            const int k = i / N, n = i % N;
            sB[Tile::chunk(n, k / 8) + k % 8] = __float2bfloat16(B[i]);
        }
        cf::fence_proxy_async_shared();
        __syncthreads();
        // wgmma's accumulators: d[r][c] is row 16 w + 8 r + g, column 8 (c / 2) + 2 t + c % 2
        const int row0 = 16 * cf::warp_id() + g;
        float d[2][N / 4];
        for (int r = 0; r < 2; ++r)
            for (int c = 0; c < N / 4; ++c) d[r][c] = C[(row0 + 8 * r) * N + 8 * (c / 2) + 2 * t + c % 2];
        cf::wgmma_fence();   // after the accumulators are written
        cf::Wgmma<bf16, N>::ss(d, cf::wgmma_desc_sw128(sA, 16, 1024), cf::wgmma_desc_sw128(sB, 16, 1024), true);
        cf::wgmma_commit();
        cf::wgmma_wait<0>();
        for (int r = 0; r < 2; ++r)
            for (int c = 0; c < N / 4; ++c) p.out[(row0 + 8 * r) * N + 8 * (c / 2) + 2 * t + c % 2] = d[r][c];
#else
        static_assert(kKind != 2, "accumulation_probe<2> (wgmma) needs the sm_90a target");
#endif
    }
}
