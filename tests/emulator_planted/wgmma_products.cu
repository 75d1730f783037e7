// wgmma_products.cu -- each wgmma product of cuda_src/fwd_wgmma.cu and
// cuda_src/bwd_wgmma.cu, called exactly as the kernels call it, on one CTA of
// two warpgroups with its tiles filled from global memory, for a check against
// NumPy (tests/test_fwd_wgmma.py on the emulator, tests/test_gpu_wgmma.py on a
// device).  It covers what the one-instruction probe (wgmma_planted.cu) leaves
// out, so that a misread descriptor shows up here before it shows up as a wrong
// attention output:
//   * k16 steps that start 32, 64 and 96 bytes into a swizzled 128-byte line,
//     and steps into the next 64-column pages (d = 128 and 256: two and four);
//   * the second warpgroup's rows, 64 rows into the A tile;
//   * N = 32, 64, 128 and 256;
//   * MN-major B over two and four 64-column pages, i.e. the leading byte
//     offset (O += P V and the backward's gradient products, d = 128 and 256);
//   * MN-major A and B at page offsets (atomic dQ: a warpgroup's query slice or
//     head-dim slice is the tile's second page).
// p.arg picks the product (kForm); the inputs are row-major float matrices,
// rounded to bfloat16 here, one after the other in p.in.
#include "fwd_wgmma.cu"
#include "bwd_wgmma.cu"
#include "planted_params.cuh"

namespace probe {

using bf16 = __nv_bfloat16;
// fwd_wgmma's d = 128 and d = 256 rows (two warpgroups; 128 and 64 keys per block)
using Fwd128 = cf::WgmmaFwdTraits<bf16, 128, 128, 2, false>;
using Fwd256 = cf::WgmmaFwdTraits<bf16, 256, 64, 2, true>;
// bwd_wgmma's dK/dV kernels with dQ by atomics: d = 128 streams 64 query rows (dQ
// in two head-dim slices of 64 columns), d = 64 streams 128 (two query slices);
// d = 256's dK launch streams 32 (N = 32, and MN-major operands over four pages)
using Bwd128 = cf::WgmmaBwdTraits<bf16, 128, 128, 64, 2, 7>;
using Bwd64 = cf::WgmmaBwdTraits<bf16, 64, 128, 128, 2, 7>;
using Bwd256 = cf::WgmmaBwdTraits<bf16, 256, 128, 32, 2, cf::kGradDK>;

constexpr int kThreads = 256;

// Tile <- the row-major Tile::kRows x Tile::kCols floats at src.
template <class Tile>
__device__ void fill(bf16* tile, const float* src) {
    for (int i = threadIdx.x; i < Tile::kRows * Tile::kCols; i += kThreads) {
        const int r = i / Tile::kCols, c = i % Tile::kCols;
        tile[Tile::chunk(r, c / 8) + c % 8] = __float2bfloat16(src[i]);
    }
}

// The warpgroup's accumulator tile (its 64 rows from row wg_row0) to or from a
// row-major matrix of `cols` columns.
template <int C>
__device__ void store(float* out, int cols, int wg_row0, const float (&acc)[2][C]) {
    const int row0 = wg_row0 + 16 * (cf::warp_id() & 3);
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < C; ++c) out[(row0 + cf::fragment_row(r)) * cols + cf::fragment_col(c)] = acc[r][c];
}
template <int C>
__device__ void load(float (&acc)[2][C], const float* src, int cols, int wg_row0) {
    const int row0 = wg_row0 + 16 * (cf::warp_id() & 3);
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = src[(row0 + cf::fragment_row(r)) * cols + cf::fragment_col(c)];
}

// Writers' shared-memory stores visible to the tensor cores of every warpgroup.
__device__ void publish() {
    cf::fence_proxy_async_shared();
    __syncthreads();
}

}  // namespace probe

// kForm (matrices named as the kernels name them; NumPy computes the same):
//   0  fwd_wgmma's wgmma_qk, d = 128:  S (128 x 128) = Q (128 x 128) K^T, K 128 x 128
//   1  fwd_wgmma's wgmma_pv, d = 128:  O (128 x 128) = P (128 x 128) V, V 128 x 128
//   2  bwd_wgmma's wgmma_own_stream, d = 128: X (128 x 64) = A (128 x 128) B^T, B 64 x 128
//   3  bwd_wgmma's wgmma_accumulate, d = 128: G (128 x 128) = X (128 x 64) Z, Z 64 x 128
//   4  add_dq_atomically, d = 128:  dq (64 x 128) += 0.5 dS K, dS 64 x 128, K 128 x 128
//   5  add_dq_atomically, d = 64:   dq (128 x 64) += 0.5 dS K, dS 128 x 128, K 128 x 64
//   6  wgmma_qk, d = 256:           S (128 x 64) = Q (128 x 256) K^T, K 64 x 256
//   7  wgmma_pv, d = 256:           O (128 x 256) = P (128 x 64) V, V 64 x 256
//   8  wgmma_own_stream, d = 256:   X (128 x 32) = A (128 x 256) B^T, B 32 x 256
//   9  wgmma_accumulate, d = 256:   G (128 x 256) = X (128 x 32) Z, Z 32 x 256
// (forms 4 and 5 add to p.out, which starts at zero; dS^T is what the tile holds).
template <int kForm> struct Form;
template <> struct Form<0> { using Tr = probe::Fwd128; };
template <> struct Form<1> { using Tr = probe::Fwd128; };
template <> struct Form<2> { using Tr = probe::Bwd128; };
template <> struct Form<3> { using Tr = probe::Bwd128; };
template <> struct Form<4> { using Tr = probe::Bwd128; };
template <> struct Form<5> { using Tr = probe::Bwd64; };
template <> struct Form<6> { using Tr = probe::Fwd256; };
template <> struct Form<7> { using Tr = probe::Fwd256; };
template <> struct Form<8> { using Tr = probe::Bwd256; };
template <> struct Form<9> { using Tr = probe::Bwd256; };

template <int kForm>
__global__ void __launch_bounds__(probe::kThreads, 1) wgmma_products(const PlantedParams p) {
    using namespace probe;
    using Tr = typename Form<kForm>::Tr;
    char* smem = cf::dynamic_smem();
    smem += (1024 - (cf::smem_addr(smem) & 1023)) & 1023;  // as the kernels: 1024-byte aligned tiles
    bf16* const s0 = reinterpret_cast<bf16*>(smem);
    const int wg_row0 = (cf::warp_id() >> 2) * 64;

    if constexpr (kForm == 0 || kForm == 6) {
        bf16* const sK = s0 + Tr::QTile::kElements;
        fill<typename Tr::QTile>(s0, p.in);
        fill<typename Tr::KVTile>(sK, p.in + Tr::QTile::kElements);
        publish();
        float s[2][Tr::kSCols];
        cf::wgmma_fence();
        cf::wgmma_qk<Tr>(s, s0, sK, wg_row0);
        cf::wgmma_wait<0>();
        store(p.out, Tr::kBlockN, wg_row0, s);
    } else if constexpr (kForm == 1 || kForm == 7) {
        fill<typename Tr::KVTile>(s0, p.in + Tr::kBlockM * Tr::kBlockN);
        publish();
        float s[2][Tr::kSCols], o[2][Tr::kOCols] = {};
        uint32_t a[Tr::kKeySteps][1][4];
        load(s, p.in, Tr::kBlockN, wg_row0);
        cf::scores_to_a<Tr, bf16>(a, s);
        cf::wgmma_fence();
        cf::wgmma_pv<Tr>(o, a, s0);
        cf::wgmma_wait<0>();
        store(p.out, Tr::kHeadDim, wg_row0, o);
    } else if constexpr (kForm == 2 || kForm == 8) {
        bf16* const sB = s0 + Tr::OwnTile::kElements;
        fill<typename Tr::OwnTile>(s0, p.in);
        fill<typename Tr::StreamTile>(sB, p.in + Tr::OwnTile::kElements);
        publish();
        float x[2][Tr::kSCols];
        cf::wgmma_fence();
        cf::wgmma_own_stream<Tr>(x, s0, sB, wg_row0);
        cf::wgmma_commit();
        cf::wgmma_wait<0>();
        store(p.out, Tr::kBlockStream, wg_row0, x);
    } else if constexpr (kForm == 3 || kForm == 9) {
        fill<typename Tr::StreamTile>(s0, p.in + Tr::kBlockOwn * Tr::kBlockStream);
        publish();
        float x[2][Tr::kSCols], g[2][Tr::kGCols] = {};
        uint32_t a[Tr::kStreamSteps][4];
        load(x, p.in, Tr::kBlockStream, wg_row0);
        cf::pack_a<Tr, bf16>(a, x);
        cf::wgmma_accumulate<Tr>(g, a, s0);
        cf::wgmma_wait<0>();
        store(p.out, Tr::kHeadDim, wg_row0, g);
    } else {
        bf16* const sK = s0 + Tr::DsTile::kElements;
        fill<typename Tr::DsTile>(s0, p.in);
        fill<typename Tr::OwnTile>(sK, p.in + Tr::DsTile::kElements);
        publish();
        cf::add_dq_atomically<Tr>(p.out, Tr::kHeadDim, s0, sK, 0.5f, Tr::kBlockStream, Tr::kHeadDim);
    }
}
