// wgmma.cuh (emulated) -- the CPU emulator's twin of cuda_src/wgmma.cuh.
//
// Same names, signatures and semantics.  A wgmma is a rendezvous of the
// warpgroup's 128 threads in the emulator runtime, which reads the operands
// through the descriptors (128-byte swizzle), computes the m64nNk16 product
// and hands each thread its accumulators back at the wgmma.wait_group that
// retires the group; until then they hold a signalling NaN.  The runtime
// checks the ordering rules listed in the real header: a fence before a batch
// and no write to its registers between the fence and the wgmma; A registers
// and accumulators untouched until retirement; shared memory unchanged until
// the last thread of the warpgroup retires the group; fence.proxy.async after
// the writes a wgmma reads.  Keep the two headers in step.
#pragma once

#include "ptx.cuh"

namespace cf {

__device__ __forceinline__ void wgmma_fence() { cfemu_wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { cfemu_wgmma_commit(); }
// The registers named after the immediate are the real header's compiler pins;
// here the runtime hands the accumulators back through memory, so they need none.
template <int N, typename... Regs>
__device__ __forceinline__ void wgmma_wait(Regs&...) {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes an immediate in 0..7");
    cfemu_wgmma_wait(N);
}
// One wait here: the real header's two arms only steer ptxas's schedule.
template <typename... Regs>
__device__ __forceinline__ void wgmma_wait_all_apart(int, Regs&...) { cfemu_wgmma_wait(0); }
__device__ __forceinline__ void fence_proxy_async_shared() { cfemu_fence_proxy_async(); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in 24 .. 256");
    cfemu_setmaxnreg(0, kRegs);
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in 24 .. 256");
    cfemu_setmaxnreg(1, kRegs);
}

// Two atomic additions; the alignment the vector instruction needs is checked.
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
    if (reinterpret_cast<uintptr_t>(p) % 8 != 0) __trap();
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}

// As the real header: bits 0-13 address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4,
// 62-63 layout (1: 128-byte swizzle); the address is the shared-memory offset.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    const uint64_t addr = smem_addr(p);
    return ((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fffu) << 16) |
           (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fffu) << 32) | (uint64_t(1) << 62);
}

template <typename T> struct WgmmaKind;
template <> struct WgmmaKind<__half> { static constexpr int kValue = CFEMU_MMA_F16; };
template <> struct WgmmaKind<__nv_bfloat16> { static constexpr int kValue = CFEMU_MMA_BF16; };

template <typename T, int N>
struct Wgmma {
    static_assert(N % 32 == 0 && N <= 256, "the real header instantiates n = 32, 64, 128, 192, 256");
    __device__ static void ss(float (&d)[2][N / 4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
        cfemu_wgmma(WgmmaKind<T>::kValue, N, &d[0][0], nullptr, desc_a, desc_b, 0, accumulate);
    }
    __device__ static void rs_mn(float (&d)[2][N / 4], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
        cfemu_wgmma(WgmmaKind<T>::kValue, N, &d[0][0], a, 0, desc_b, 1, accumulate);
    }
    __device__ static void ss_mn(float (&d)[2][N / 4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
        cfemu_wgmma(WgmmaKind<T>::kValue, N, &d[0][0], nullptr, desc_a, desc_b, 3, accumulate);
    }
};

}  // namespace cf
