// ptx.cuh -- every piece of inline PTX and every hardware intrinsic the kernels use.
//
// Nothing else in cuda_src/ contains `asm`.  The CPU emulator compiles the same
// kernels against a twin of this header (cupyflash/emulator/include/ptx.cuh)
// whose functions have identical signatures and semantics; keep the two in step.
// Fragment layouts are those of shared/reference/ptx-fragments.md
// (g = lane >> 2, t = lane & 3; 16-bit pairs packed low element first).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
// NVRTC has no <cstdint>; CuPy puts libcudacxx on its include path, whose
// <cuda/std/cstdint> defines the global fixed-width types there.
#ifdef __CUDACC_RTC__
#include <cuda/std/cstdint>
#else
#include <cstdint>
#endif

namespace cf {

// ---- thread geometry ------------------------------------------------------
// Kernels launch 1-D blocks: lane and warp come from threadIdx.x alone.

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

// The block's dynamic shared memory (the only shared memory kernels use:
// the launch configuration sizes it, and the emulator checks it for races).
__device__ __forceinline__ char* dynamic_smem() {
    extern __shared__ __align__(128) char cf_dynamic_smem[];
    return cf_dynamic_smem;
}

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

// 2^x with ex2.approx.ftz.f32 (2 ulp; -inf -> +0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- 16-bit packing -------------------------------------------------------------

// {lo, hi} -> b32 with lo in bits 0-15 (the mma/ldmatrix element order).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &h, sizeof(r));
    return r;
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &h, sizeof(r));
    return r;
}

// ---- tensor cores: mma.sync ------------------------------------------------------

// D = A*B + C, m16n8k16, f16 inputs, f32 accumulate.
// a[0]=A[g][2t..], a[1]=A[g+8][2t..], a[2]=A[g][2t+8..], a[3]=A[g+8][2t+8..];
// b[0]=B[2t..2t+1][g], b[1]=B[2t+8..2t+9][g]; c/d: (g,2t),(g,2t+1),(g+8,2t),(g+8,2t+1).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// As mma_m16n8k16_f16 with bf16 inputs (identical fragment layout).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// D = A*B + C, m8n8k4 in double (sm_80): a = A[g][t], b = B[t][g], c/d = (g, 2t), (g, 2t + 1)
// (ptx-fragments.md section 3); precision that of a double FMA.
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b, const double (&c)[2]) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};\n"
                 : "=d"(d[0]), "=d"(d[1])
                 : "d"(a), "d"(b), "d"(c[0]), "d"(c[1]));
}

// D = A*B + C, m16n8k8, tf32 inputs (one element per b32), f32 accumulate.
// a[0]=(g,t), a[1]=(g+8,t), a[2]=(g,t+4), a[3]=(g+8,t+4); b[0]=(t,g), b[1]=(t+4,g).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// fp32 -> tf32 (cvt.rna: round to nearest, ties away; low 13 bits zero).
__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t y;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
    return y;
}

// ---- ldmatrix (shared -> registers, 8x8 b16 matrices) ------------------------------
// Matrix i's rows are at the addresses of lanes 8i..8i+7 (16-byte aligned rows).
// Without .trans: d[i] = {M_i[g][2t], M_i[g][2t+1]}; with .trans: {M_i[2t][g], M_i[2t+1][g]}.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&d)[1], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(d[0]) : "r"(smem_addr(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&d)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(d[0]), "=r"(d[1]) : "r"(smem_addr(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_addr(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t (&d)[1], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(d[0]) : "r"(smem_addr(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&d)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(d[0]), "=r"(d[1]) : "r"(smem_addr(row)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&d)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_addr(row)) : "memory");
}

// ---- global stores ----------------------------------------------------------------------
// p[0] = a, p[1] = b in one 8-byte store (p 8-byte aligned, global memory).
__device__ __forceinline__ void store_f32x2(float* p, float a, float b) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
}

// ---- cp.async (global -> shared, asynchronous, per-thread groups) ---------------------
// Copies src_bytes (0..16) from src and zero-fills the rest of the 16 destination
// bytes; both addresses 16-byte aligned.  Visible to this thread only after the
// cp_async_wait that retires its group, to other threads after a __syncthreads.

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes) : "memory");
}
// 4-byte variant (cp.async.ca; src_bytes 0 or 4) for rows that are not 16-byte aligned.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's most recent groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

}  // namespace cf
