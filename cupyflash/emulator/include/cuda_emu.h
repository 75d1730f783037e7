// cuda_emu.h -- what a CUDA kernel needs to compile as host C++ for the CPU emulator.
//
// Included first in every emulated kernel module (before the assembled cuda_src/
// text).  It provides the CUDA execution-space keywords, the built-in index
// variables (per emulated thread), barriers, warp shuffles and votes, atomics and
// the device math the kernels may use.  The half/bfloat16 types come from the
// real cuda_fp16.h / cuda_bf16.h, which compile as host code.  Warp-collective
// and synchronising calls go to the emulator runtime (cfemu_abi.h).
//
// Differences from a GPU that kernels must not rely on (none of them can make a
// kernel that is wrong on a GPU pass here):
//  * __CUDA_ARCH__ is not defined; CUPYFLASH_EMULATOR is.
//  * Only dynamic shared memory (cf::dynamic_smem()) is emulated: using a
//    `__shared__` variable is a compile error.
//  * __launch_bounds__ is not checked; float arithmetic does not flush denormals.
#pragma once

// Standard headers first: after this point __noinline__ and friends are macros.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <math.h>
#include <type_traits>
#include <utility>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>

#include "cfemu_abi.h"

#define CUPYFLASH_EMULATOR 1

// ---- execution-space keywords (the CUDA headers define most as empty) --------
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __constant__ static
// Kernels take shared memory from cf::dynamic_smem() only (sized by the launch,
// poisoned and checked here); a static __shared__ variable is an error at its use.
#if defined(__has_attribute) && __has_attribute(unavailable)
#define __shared__ \
    __attribute__((unavailable("the emulator supports only dynamic shared memory: use cf::dynamic_smem()"))) \
    static thread_local
#else
#define __shared__ static thread_local
#endif
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif

// ---- built-in variables ---------------------------------------------------------
#define threadIdx (*reinterpret_cast<const uint3*>(&cfemu_current_ctx->thread_idx))
#define blockIdx (*reinterpret_cast<const uint3*>(&cfemu_current_ctx->block_idx))
#define blockDim (*reinterpret_cast<const dim3*>(&cfemu_current_ctx->block_dim))
#define gridDim (*reinterpret_cast<const dim3*>(&cfemu_current_ctx->grid_dim))
static_assert(sizeof(uint3) == sizeof(cfemu_xyz) && sizeof(dim3) == sizeof(cfemu_xyz), "uint3/dim3 layout");
constexpr int warpSize = 32;

// ---- synchronisation --------------------------------------------------------------
// The call site identifies the barrier: every thread must reach the same one.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    cfemu_syncthreads(file, line, 0);
}
inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cfemu_syncthreads(file, line, pred);
}
inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cfemu_syncthreads(file, line, !pred) == 0;
}
inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cfemu_syncthreads(file, line, pred) != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { cfemu_syncwarp(mask); }
// Memory fences order nothing here: an emulated block runs on one OS thread.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    cfemu_trap("__trap()", file, line);
}
#undef assert
#define assert(e) ((e) ? (void)0 : cfemu_trap("assertion `" #e "` failed", __FILE__, __LINE__))

// ---- warp shuffles and votes ----------------------------------------------------------
// Any standard-layout 2-, 4- or 8-byte type (int, unsigned, float, double,
// long long, __half, __half2, __nv_bfloat16, __nv_bfloat162, ...), moved bit for bit.
// (The CUDA half types are not trivially copyable in host code: user-written copies.)
namespace cfemu_detail {
template <typename T>
inline T shfl(int mode, unsigned mask, T v, int lane_arg, int width) {
    static_assert(std::is_standard_layout<T>::value && (sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8),
                  "warp shuffles move 2-, 4- or 8-byte standard-layout values");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = cfemu_shfl(mode, mask, bits, static_cast<int>(sizeof(T)), lane_arg, width);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
}  // namespace cfemu_detail

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {
    return cfemu_detail::shfl(CFEMU_SHFL_IDX, mask, v, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return cfemu_detail::shfl(CFEMU_SHFL_UP, mask, v, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    return cfemu_detail::shfl(CFEMU_SHFL_DOWN, mask, v, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    return cfemu_detail::shfl(CFEMU_SHFL_BFLY, mask, v, lane_mask, width);
}
inline int __all_sync(unsigned mask, int pred) { return static_cast<int>(cfemu_vote(CFEMU_VOTE_ALL, mask, pred)); }
inline int __any_sync(unsigned mask, int pred) { return static_cast<int>(cfemu_vote(CFEMU_VOTE_ANY, mask, pred)); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return cfemu_vote(CFEMU_VOTE_BALLOT, mask, pred); }

// ---- atomics (one block runs on one OS thread; __atomic keeps concurrent
// launches on shared global memory safe; not race-checked) ------------------------
#define CFEMU_NOCHECK __attribute__((no_sanitize_address))
#define CFEMU_ATOMIC_RMW(fn, T, expr)                                          \
    CFEMU_NOCHECK inline T fn(T* p, T v) {                                     \
        T old, nv;                                                             \
        __atomic_load(p, &old, __ATOMIC_SEQ_CST);                              \
        do {                                                                   \
            nv = (expr);                                                       \
        } while (!__atomic_compare_exchange(p, &old, &nv, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)); \
        return old;                                                            \
    }
CFEMU_ATOMIC_RMW(atomicAdd, int, old + v)
CFEMU_ATOMIC_RMW(atomicAdd, unsigned, old + v)
CFEMU_ATOMIC_RMW(atomicAdd, unsigned long long, old + v)
CFEMU_ATOMIC_RMW(atomicAdd, float, old + v)
CFEMU_ATOMIC_RMW(atomicAdd, double, old + v)
CFEMU_ATOMIC_RMW(atomicSub, int, old - v)
CFEMU_ATOMIC_RMW(atomicSub, unsigned, old - v)
CFEMU_ATOMIC_RMW(atomicMax, int, old > v ? old : v)
CFEMU_ATOMIC_RMW(atomicMax, unsigned, old > v ? old : v)
CFEMU_ATOMIC_RMW(atomicMin, int, old < v ? old : v)
CFEMU_ATOMIC_RMW(atomicMin, unsigned, old < v ? old : v)
CFEMU_ATOMIC_RMW(atomicExch, int, v)
CFEMU_ATOMIC_RMW(atomicExch, unsigned, v)
CFEMU_ATOMIC_RMW(atomicExch, float, v)
CFEMU_ATOMIC_RMW(atomicOr, unsigned, old | v)
CFEMU_ATOMIC_RMW(atomicAnd, unsigned, old & v)
#undef CFEMU_ATOMIC_RMW
CFEMU_NOCHECK inline int atomicCAS(int* p, int cmp, int v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
CFEMU_NOCHECK inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
CFEMU_NOCHECK inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}

// ---- device math and intrinsics -------------------------------------------------------
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }

inline float __int_as_float(int x) { float r; std::memcpy(&r, &x, 4); return r; }
inline int __float_as_int(float x) { int r; std::memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned x) { float r; std::memcpy(&r, &x, 4); return r; }
inline unsigned __float_as_uint(float x) { unsigned r; std::memcpy(&r, &x, 4); return r; }
inline double __longlong_as_double(long long x) { double r; std::memcpy(&r, &x, 8); return r; }
inline long long __double_as_longlong(double x) { long long r; std::memcpy(&r, &x, 8); return r; }
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(std::ceil(x)); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((int64_t(a) * b) >> 32); }
template <typename T>
inline T __ldg(const T* p) { return *p; }

// max/min as CUDA overloads them (mixed int/unsigned promote to unsigned).
#define CFEMU_MINMAX(T)                                  \
    inline T max(T a, T b) { return a > b ? a : b; }     \
    inline T min(T a, T b) { return a < b ? a : b; }
CFEMU_MINMAX(int)
CFEMU_MINMAX(unsigned)
CFEMU_MINMAX(long)
CFEMU_MINMAX(unsigned long)
CFEMU_MINMAX(long long)
CFEMU_MINMAX(unsigned long long)
#undef CFEMU_MINMAX
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
