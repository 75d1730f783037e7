// wgmma_products.cu -- each wgmma product of cuda_src/fwd_wgmma.cu and
// cuda_src/bwd_wgmma.cu, called exactly as the kernels call it, on one CTA of
// two warpgroups with its tiles filled from global memory, for a check against
// NumPy (tests/test_fwd_wgmma.py on the emulator, tests/test_gpu_wgmma.py on a
// device).  It covers what the one-instruction probe (wgmma_planted.cu) leaves
// out, so that a misread descriptor shows up here before it shows up as a wrong
// attention output:
//   * k16 steps that start 32, 64 and 96 bytes into a swizzled 128-byte line,
//     and steps into the next 64-column page (d = 128: 8 steps over two pages);
//   * the second warpgroup's rows, 64 rows into the A tile;
//   * N = 64 and N = 128 (B over 8 and 16 eight-row groups);
//   * MN-major B over two 64-column pages, i.e. the leading byte offset
//     (O += P V and the backward's gradient products with d = 128);
//   * MN-major A and B at page offsets (atomic dQ: a warpgroup's query slice or
//     head-dim slice is the tile's second page).
// p.arg picks the product (kForm); the inputs are row-major float matrices,
// rounded to bfloat16 here, one after the other in p.in.
#include "fwd_wgmma.cu"
#include "bwd_wgmma.cu"

struct PlantedParams {
    const float* in;
    float* out;
    int32_t* ticket;
    int32_t n;
    int32_t arg;
};

namespace probe {

using bf16 = __nv_bfloat16;
// fwd_wgmma's d = 128 row (128 x 128 tile, two warpgroups)
using Fwd = cf::WgmmaFwdTraits<bf16, 128, 128, 2, false>;
// bwd_wgmma's dK/dV kernels with dQ by atomics: d = 128 streams 64 query rows (dQ
// in two head-dim slices of 64 columns), d = 64 streams 128 (two query slices)
using Bwd128 = cf::WgmmaBwdTraits<bf16, 128, 128, 64, 2, 7>;
using Bwd64 = cf::WgmmaBwdTraits<bf16, 64, 128, 128, 2, 7>;

constexpr int kThreads = 256;

template <int kForm> struct DqTraits { using type = Bwd64; };
template <> struct DqTraits<4> { using type = Bwd128; };

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
//   0  fwd_wgmma's wgmma_qk:        S (128 x 128) = Q (128 x 128) K^T, K 128 x 128
//   1  fwd_wgmma's wgmma_pv:        O (128 x 128) = P (128 x 128) V, V 128 x 128
//   2  bwd_wgmma's wgmma_own_stream: X (128 x 64) = A (128 x 128) B^T, B 64 x 128
//   3  bwd_wgmma's wgmma_accumulate: G (128 x 128) = X (128 x 64) Z, Z 64 x 128
//   4  add_dq_atomically, d = 128:  dq (64 x 128) += 0.5 dS K, dS 64 x 128, K 128 x 128
//   5  add_dq_atomically, d = 64:   dq (128 x 64) += 0.5 dS K, dS 128 x 128, K 128 x 64
// (forms 4 and 5 add to p.out, which starts at zero; dS^T is what the tile holds).
template <int kForm>
__global__ void __launch_bounds__(probe::kThreads, 1) wgmma_products(const PlantedParams p) {
    using namespace probe;
    char* smem = cf::dynamic_smem();
    smem += (1024 - (cf::smem_addr(smem) & 1023)) & 1023;  // as the kernels: 1024-byte aligned tiles
    bf16* const s0 = reinterpret_cast<bf16*>(smem);
    const int wg_row0 = (cf::warp_id() >> 2) * 64;

    if constexpr (kForm == 0) {
        bf16* const sK = s0 + Fwd::QTile::kElements;
        fill<Fwd::QTile>(s0, p.in);
        fill<Fwd::KVTile>(sK, p.in + Fwd::QTile::kElements);
        publish();
        float s[2][Fwd::kSCols];
        cf::wgmma_fence();
        cf::wgmma_qk<Fwd>(s, s0, sK, wg_row0);
        cf::wgmma_wait<0>();
        store(p.out, Fwd::kBlockN, wg_row0, s);
    } else if constexpr (kForm == 1) {
        fill<Fwd::KVTile>(s0, p.in + Fwd::kBlockM * Fwd::kBlockN);
        publish();
        float s[2][Fwd::kSCols], o[2][Fwd::kOCols] = {};
        uint32_t a[Fwd::kKeySteps][1][4];
        load(s, p.in, Fwd::kBlockN, wg_row0);
        cf::scores_to_a<Fwd, bf16>(a, s);
        cf::wgmma_fence();
        cf::wgmma_pv<Fwd>(o, a, s0);
        cf::wgmma_wait<0>();
        store(p.out, Fwd::kHeadDim, wg_row0, o);
    } else if constexpr (kForm == 2) {
        using Tr = Bwd128;
        bf16* const sB = s0 + Tr::OwnTile::kElements;
        fill<Tr::OwnTile>(s0, p.in);
        fill<Tr::StreamTile>(sB, p.in + Tr::OwnTile::kElements);
        publish();
        float x[2][Tr::kSCols];
        cf::wgmma_fence();
        cf::wgmma_own_stream<Tr>(x, s0, sB, wg_row0);
        cf::wgmma_commit();
        cf::wgmma_wait<0>();
        store(p.out, Tr::kBlockStream, wg_row0, x);
    } else if constexpr (kForm == 3) {
        using Tr = Bwd128;
        fill<Tr::StreamTile>(s0, p.in + Tr::kBlockOwn * Tr::kBlockStream);
        publish();
        float x[2][Tr::kSCols], g[2][Tr::kGCols] = {};
        uint32_t a[Tr::kStreamSteps][4];
        load(x, p.in, Tr::kBlockStream, wg_row0);
        cf::pack_a<Tr, bf16>(a, x);
        cf::wgmma_accumulate<Tr>(g, a, s0);
        cf::wgmma_wait<0>();
        store(p.out, Tr::kHeadDim, wg_row0, g);
    } else {
        using Tr = typename DqTraits<kForm>::type;
        bf16* const sK = s0 + Tr::DsTile::kElements;
        fill<typename Tr::DsTile>(s0, p.in);
        fill<typename Tr::OwnTile>(sK, p.in + Tr::DsTile::kElements);
        publish();
        cf::add_dq_atomically<Tr>(p.out, Tr::kHeadDim, s0, sK, 0.5f, Tr::kBlockStream, Tr::kHeadDim);
    }
}
