// bwd_tf32.cu -- the float32 backward on tensor cores, when the caller allows
// TF32 (attention_backward(..., precision="tf32" or "tf32x3")): FlashAttention-2's
// backward with mma.sync m16n8k8 .tf32 and float32 accumulation, sm_80 and later.
//
// The algorithm and the launch order are bwd_dmma's (bwd_simt's delta kernel
// runs first): with P recomputed from the forward's lse,
//     P  = exp2(S * scale * log2(e) - lse * log2(e))      S = Q K^T
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - delta)
//     dK = scale * dS^T Q                   dQ = scale * dS K
// every product on the TF32 tensor cores in kPasses MMAs (1: operands rounded
// to TF32; 3: split into two TF32 parts, errors of the order of float32
// arithmetic's -- tf32_tile.cuh).  Two kernels:
//   bwd_tf32_dkdv_kernel  a CTA owns kOwn keys of one kv head (K, V in shared
//                         memory, dK, dV in registers) and streams the query
//                         blocks that see them, head by head through the kv
//                         head's query group;
//   bwd_tf32_dq_kernel    a CTA owns kOwn query rows (Q, dO in shared memory,
//                         dQ in registers) and streams the key blocks they see.
// Every gradient element is summed by one lane in a fixed order, so results
// are bit-identical from run to run; there is no atomic variant
// (deterministic=False runs the same kernels).  The kernels' loops are
// bwd_tc_loops.cuh's, shared with bwd_dmma.cu; this file supplies the TF32
// products, the layouts and the tile loads (Tf32BwdTraits).
//
// Each of the kWarps warps owns kWarpRows = kOwn / kWarps of the CTA's rows
// (kMTiles m16 tiles).  Per streamed block of kStream rows a warp computes
//     X = Own Stream^T    tf32_abt (S^T = K Q^T, dP^T = V dO^T; S = Q K^T,
//                         dP = dO V^T): the own tile as A fragments, the
//                         streamed one read by rows
//     G += X' Stream      tf32_accumulate (dV += P^T dO, dK += dS^T Q;
//                         dQ += dS K): X' from the accumulators in place,
//                         the streamed tile read by columns
// so the streamed tiles are read both ways and use Tf32BothRows, free of bank
// conflicts for both; the own tiles are fragment quads (Tf32Pairs).  Every
// tile is copied in units its threads rework in place as they land
// (Tf32BwdTraits::tile_landed).  The streamed tiles are double-buffered by
// cp.async: the next block's copy runs while this one is computed.  The
// dispatcher (cupyflash/_gpu_bwd.py) gives these kernels float32 with d = dv
// up to 128 on sm_80+ (rows not 16-byte aligned are copied a word at a time);
// columns past the run-time d are zero-filled by cp.async.
#pragma once

#include "block_info.cuh"
#include "bwd_tc_loops.cuh"
#include "mma_tile.cuh"
#include "params_bwd.cuh"
#include "ptx.cuh"
#include "tf32_tile.cuh"
#include "tile_io.cuh"

namespace cf {

// Whether this pass compiles device code for sm_90 or later (the dK/dV kernel's
// order of products with lengths moves registers differently per architecture;
// false on the host and the emulator).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kCompiledForSm90 = true;
#else
constexpr bool kCompiledForSm90 = false;
#endif

// Every compile-time quantity of one instantiation: kOwn rows stay in shared
// memory for the whole CTA, kStream rows are reloaded per block.  The tile
// table with the reason for each row is _BWD_TF32_TILES in cupyflash/_kernels.py.
template <int kHeadDim_, int kOwn_, int kStream_, int kWarps_, int kPasses_>
struct Tf32BwdTraits {
    using T = float;
    using Acc = float;
    using Out = float;
    static constexpr int kHeadDim = kHeadDim_, kOwnRows = kOwn_, kStreamRows = kStream_, kWarps = kWarps_;
    static constexpr int kPasses = kPasses_;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kWarpRows = kOwnRows / kWarps;  // own rows per warp
    static constexpr int kMTiles = kWarpRows / 16;       // m16 tiles per warp
    static constexpr int kRows = 2 * kMTiles;            // accumulator rows per lane
    static constexpr int kNTiles = kStreamRows / 8;      // n8 tiles of S, dP
    static constexpr int kSCols = 2 * kNTiles;           // S, dP columns per lane and row
    static constexpr int kGCols = kHeadDim / 4;          // gradient columns per lane and row

    // The own tiles are only ever X of row_products (A fragments): fragment
    // quads (Tf32Pairs, rows g and g + 8 interleaved), one 16-byte load each.
    // The streamed tiles are read by rows (Y) and by columns (Z): Tf32BothRows.
    // With one pass each thread rounds its own copies of every tile to TF32 as
    // they land (tf32_prepare_tile, which also interleaves the own tiles), once
    // for all warps; with three the tiles stay float32 and each warp splits
    // what it loads.
    using OwnLayout = Tf32Pairs<kHeadDim, 8>;
    using StreamLayout = Tf32BothRows<kHeadDim>;
    static constexpr int kPrep = kPasses == 1 ? kTf32Rounded : kTf32Raw;
    using OwnTile = Tf32Tile<OwnLayout, kPrep>;
    using StreamTile = Tf32Tile<StreamLayout, kPrep>;
    // Shared memory (floats): the two own tiles, then two stages of the two streamed tiles.
    static constexpr int kStages = 2;
    static constexpr bool kAsync = true;  // cp.async, two stages of the streamed tiles
    static constexpr int kOwnTile = kOwnRows * kHeadDim, kStreamTile = kStreamRows * kHeadDim;
    static constexpr int kSmemBytes = (2 * kOwnTile + 2 * kStages * kStreamTile) * static_cast<int>(sizeof(float));
    // __launch_bounds__ minimum CTAs per SM: 2 leaves every thread the 255-register maximum.
    static constexpr int kMinBlocksPerSm = 2;

    static_assert(kPasses == 1 || kPasses == 3, "kPasses: 1 (tf32) or 3 (tf32x3)");
    static_assert(kOwnRows % (16 * kWarps) == 0, "own block: whole m16 tiles per warp");
    static_assert(kStreamRows % 8 == 0, "streamed block: whole n8 tiles");
    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 128, "head dim bucket: 32, 64 or 128");
    static_assert(kSmemBytes <= 99 * 1024, "within the opt-in shared memory of every sm_80+ GPU");

    // bwd_tc_loops.cuh's interface: the accumulators are mma_tile.cuh's register tiles.
    using Fragment = M16n8Fragment;
    // dV's product after dP's: before, tf32x3's d = 128 dK/dV kernel spilled 8 B.
    // With per-sequence lengths (sequence.cuh) that kernel spills 4 B after on
    // sm_90 and 64 B before on sm_80, none the other way round: before on sm_90.
    static constexpr bool kDvFirst = kSeqLengths && kHeadDim >= 128 && kPasses == 3 && kCompiledForSm90;
    // x = X Y^T, 32 columns per unrolled iteration (16 at d = 32): fully unrolled,
    // the dK/dV kernels' fragment loads spill 8-12 bytes on sm_80 at d = 64, and at
    // d = 32 the three-pass one spills 8-44 bytes (NVRTC 13.5, 13.0, 12.0).
    __device__ static void row_products(float (&x)[kRows][kSCols], const float* sX, const float* sY, int row0) {
        tf32_abt<kPasses, kMTiles, kNTiles, kHeadDim, OwnTile, StreamTile, (kHeadDim > 32 ? 2 : 1)>(x, sX, sY, row0);
    }
    // g += X Z, Z the streamed tile read by columns.
    __device__ static void accumulate(float (&g)[kRows][kGCols], const float (&x)[kRows][kSCols], const float* sZ) {
        tf32_accumulate<kPasses, kMTiles, kNTiles, kHeadDim, StreamTile>(g, x, sZ);
    }
    __device__ static void store_rows(float* dst, int64_t row_stride, const float (&g)[kRows][kGCols], float factor,
                                      int row0, int rows_valid, int cols_valid) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int row = row0 + fragment_row(r);
            if (row < rows_valid) store_row_tf32(dst + row * row_stride, g[r], factor, cols_valid);
        }
    }
    // By cp.async, rows past rows_valid and columns past d zero-filled, in units
    // each thread can rework once they have landed (tile_landed).
    template <int kTileRows, bool kOwned>
    __device__ static void load_tile(float* dst, const float* src, int64_t row_stride, int rows_valid, int d) {
        if constexpr (kOwned) {
            tf32_copy_tile<kThreads, kTileRows, kHeadDim, OwnLayout>(dst, src, row_stride, rows_valid, d);
        } else {
            tf32_copy_tile<kThreads, kTileRows, kHeadDim, StreamLayout>(dst, src, row_stride, rows_valid, d);
        }
    }
    template <int kTileRows, bool kOwned>
    __device__ static void tile_landed(float* tile) {
        if constexpr (kOwned) {
            tf32_prepare_tile<kThreads, kTileRows, kHeadDim, OwnTile>(tile);
        } else {
            tf32_prepare_tile<kThreads, kTileRows, kHeadDim, StreamTile>(tile);
        }
    }
};


// dK, dV of kOwn keys of one (batch, kv head).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
__global__ void __launch_bounds__((Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kThreads),
                                  (Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kMinBlocksPerSm))
bwd_tf32_dkdv_kernel(const BwdParams params) {
    bwd_dkdv_loop<Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>>(params);
}

// bwd_tf32_dkdv_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
constexpr int bwd_tf32_dkdv_kernel_smem() {
    return Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kSmemBytes;
}

// dQ of kOwn query rows of one (batch, query head).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
__global__ void __launch_bounds__((Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kThreads),
                                  (Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kMinBlocksPerSm))
bwd_tf32_dq_kernel(const BwdParams params) {
    bwd_dq_loop<Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>>(params);
}

// bwd_tf32_dq_kernel's dynamic shared memory, in bytes: a constant of its traits, for
// the host (the launch configuration's formula is checked against it).
template <int kHeadDim, int kOwn, int kStream, int kWarps, int kPasses>
constexpr int bwd_tf32_dq_kernel_smem() {
    return Tf32BwdTraits<kHeadDim, kOwn, kStream, kWarps, kPasses>::kSmemBytes;
}

}  // namespace cf
