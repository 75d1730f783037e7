// ptx.cuh (emulated) -- the CPU emulator's twin of cuda_src/ptx.cuh.
//
// Same names, signatures and semantics, in namespace cf, for kernels compiled as
// host C++ (cuda_emu.h is included first).  Each warp-collective instruction is a
// rendezvous of the warp's 32 lanes in the emulator runtime, which gathers every
// lane's operands and computes the result with the fragment layouts of
// shared/reference/ptx-fragments.md; the one-line layout comments below are those
// of the real header.  Keep the two headers in step.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstring>

namespace cf {

// ---- thread geometry ------------------------------------------------------

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

// The block's dynamic shared memory (poisoned with 0xFF at every block start,
// bounds- and race-checked when the launch checks races).
__device__ __forceinline__ char* dynamic_smem() { return cfemu_current_ctx->smem; }

// ---- warp shuffles ----------------------------------------------------------

// result = v of lane (lane ^ lane_mask), all 32 lanes active.
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// result = v of lane src_lane, all 32 lanes active.
template <typename T>
__device__ __forceinline__ T shfl(T v, int src_lane) {
    return __shfl_sync(0xffffffffu, v, src_lane);
}

// ---- fast math ----------------------------------------------------------------

// 2^x as ex2.approx.ftz.f32: subnormal inputs and results flush to +-0 (-inf -> +0,
// +-0 -> 1, +inf -> +inf, NaN -> NaN).  Computed in double and rounded once, so it
// is within the instruction's 2 ulp.
__device__ __forceinline__ float exp2_approx(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
    float y = static_cast<float>(std::exp2(static_cast<double>(x)));
    if (std::fpclassify(y) == FP_SUBNORMAL) y = 0.0f;
    return y;
}

// ---- 16-bit packing -------------------------------------------------------------

// {lo, hi} -> b32 with lo in bits 0-15 (the mma/ldmatrix element order).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    uint32_t r;
    std::memcpy(&r, &h, 4);
    return r;
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    std::memcpy(&r, &h, 4);
    return r;
}

// ---- tensor cores: mma.sync ------------------------------------------------------

// D = A*B + C, m16n8k16, f16 inputs, f32 accumulate.
// a[0]=A[g][2t..], a[1]=A[g+8][2t..], a[2]=A[g][2t+8..], a[3]=A[g+8][2t+8..];
// b[0]=B[2t..2t+1][g], b[1]=B[2t+8..2t+9][g]; c/d: (g,2t),(g,2t+1),(g+8,2t),(g+8,2t+1).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
    cfemu_mma(CFEMU_MMA_F16, d, a, b, c);
}

// As mma_m16n8k16_f16 with bf16 inputs (identical fragment layout).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
    cfemu_mma(CFEMU_MMA_BF16, d, a, b, c);
}

// D = A*B + C, m8n8k4, double: a = A[g][t], b = B[t][g], c/d = (g, 2t), (g, 2t + 1).
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b, const double (&c)[2]) {
    cfemu_mma_f64(d, &a, &b, c);
}

// D = A*B + C, m16n8k8, tf32 inputs (one element per b32), f32 accumulate.
// a[0]=(g,t), a[1]=(g+8,t), a[2]=(g,t+4), a[3]=(g+8,t+4); b[0]=(t,g), b[1]=(t+4,g).
// The tensor core reads the upper 19 bits of each register (low 13 bits ignored).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
    cfemu_mma(CFEMU_MMA_TF32, d, a, b, c);
}

// fp32 -> tf32 (cvt.rna: round to nearest, ties away; low 13 bits zero).
__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fffffffu : u;  // NaN (canonical), +-inf
    return (u + 0x1000u) & 0xffffe000u;  // ties away from zero; may carry into +-inf
}

// ---- ldmatrix (shared -> registers, 8x8 b16 matrices) ------------------------------
// Matrix i's rows are at the addresses of lanes 8i..8i+7 (16-byte aligned rows).
// Without .trans: d[i] = {M_i[g][2t], M_i[g][2t+1]}; with .trans: {M_i[2t][g], M_i[2t+1][g]}.

// Shared-window address of p: its offset in the block's shared memory plus the
// window address of that memory (cfemu_thread_ctx::smem_window).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(static_cast<const char*>(p) - cfemu_current_ctx->smem) +
           cfemu_current_ctx->smem_window;
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&d)[1], const void* row) { cfemu_ldmatrix(1, 0, d, row); }
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&d)[2], const void* row) { cfemu_ldmatrix(2, 0, d, row); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], const void* row) { cfemu_ldmatrix(4, 0, d, row); }
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t (&d)[1], const void* row) { cfemu_ldmatrix(1, 1, d, row); }
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&d)[2], const void* row) { cfemu_ldmatrix(2, 1, d, row); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&d)[4], const void* row) { cfemu_ldmatrix(4, 1, d, row); }

// ---- global stores ----------------------------------------------------------------------
// p[0] = a, p[1] = b in one 8-byte store (p 8-byte aligned, global memory).
__device__ __forceinline__ void store_f32x2(float* p, float a, float b) {
    if (reinterpret_cast<uintptr_t>(p) % 8 != 0)
        cfemu_trap("store_f32x2: address not 8-byte aligned", __FILE__, __LINE__);
    p[0] = a;
    p[1] = b;
}

// ---- cp.async (global -> shared, asynchronous, per-thread groups) ---------------------
// Copies src_bytes (0..16) from src and zero-fills the rest of the 16 destination
// bytes; both addresses 16-byte aligned.  Visible to this thread only after the
// cp_async_wait that retires its group, to other threads after a __syncthreads.
// Emulated: the copy (source read included) happens at that cp_async_wait.

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    cfemu_cp_async(smem_dst, gmem_src, 16, src_bytes);
}
// 4-byte variant (cp.async.ca; src_bytes 0 or 4) for rows that are not 16-byte aligned.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, int src_bytes) {
    cfemu_cp_async(smem_dst, gmem_src, 4, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { cfemu_cp_async_commit(); }
// Wait until at most N of this thread's most recent groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(N >= 0, "cp.async.wait_group takes a non-negative immediate");
    cfemu_cp_async_wait(N);
}

}  // namespace cf
