// fidelity.cu -- one micro-kernel per instruction wrapped in ptx.cuh.
//
// They run unchanged on a GPU (through cupy.RawModule) and in the CPU emulator,
// so that the emulator's results can be held against the hardware's bit for bit
// (data movement) or to float32 rounding (mma); tests/test_emulator.py holds them
// against the fragment tables of shared/reference/ptx-fragments.md.
//
// Every kernel takes one FidelityParams by value and runs with a 1-D block.
// "Lane-major" arrays hold one record per thread (threadIdx.x), so a block of
// several warps checks that warps do not see each other's operands.
#include "ptx.cuh"

struct FidelityParams {
    const void* in0;
    const void* in1;
    const void* in2;
    void* out0;
    void* out1;
    int32_t n;     // element count (elementwise kernels) or shared-memory bytes
    int32_t arg0;  // kernel-specific, see each kernel
    int32_t arg1;
    int32_t arg2;
};

// ---- mma.sync ---------------------------------------------------------------------

// in0: A fragments (4 b32 per lane), in1: B fragments (2 b32 per lane),
// in2: C (4 f32 per lane); out0: D (4 f32 per lane).
template <int Kind>
__device__ __forceinline__ void mma_16816(const FidelityParams& p) {
    const int t = threadIdx.x;
    const uint32_t* a = static_cast<const uint32_t*>(p.in0) + 4 * t;
    const uint32_t* b = static_cast<const uint32_t*>(p.in1) + 2 * t;
    const float* c = static_cast<const float*>(p.in2) + 4 * t;
    const uint32_t ar[4] = {a[0], a[1], a[2], a[3]};
    const uint32_t br[2] = {b[0], b[1]};
    const float cr[4] = {c[0], c[1], c[2], c[3]};
    float dr[4];
    if (Kind == 0)
        cf::mma_m16n8k16_f16(dr, ar, br, cr);
    else
        cf::mma_m16n8k16_bf16(dr, ar, br, cr);
    float* d = static_cast<float*>(p.out0) + 4 * t;
    for (int i = 0; i < 4; ++i) d[i] = dr[i];
}

__global__ void fid_mma_f16(const FidelityParams p) { mma_16816<0>(p); }
__global__ void fid_mma_bf16(const FidelityParams p) { mma_16816<1>(p); }

// in0: A fragment (1 f64 per lane), in1: B fragment (1 f64 per lane), in2: C (2 f64
// per lane); out0: D (2 f64 per lane).  mma.sync m8n8k4 .f64 (sm_80).
__global__ void fid_mma_f64(const FidelityParams p) {
    const int t = threadIdx.x;
    const double* a = static_cast<const double*>(p.in0) + t;
    const double* b = static_cast<const double*>(p.in1) + t;
    const double* c = static_cast<const double*>(p.in2) + 2 * t;
    const double cr[2] = {c[0], c[1]};
    double dr[2];
    cf::mma_m8n8k4_f64(dr, a[0], b[0], cr);
    double* d = static_cast<double*>(p.out0) + 2 * t;
    d[0] = dr[0];
    d[1] = dr[1];
}

// in0: A as 4 f32 per lane, in1: B as 2 f32 per lane (rounded here with to_tf32),
// in2: C (4 f32 per lane); out0: D (4 f32 per lane); out1: the 6 tf32 registers.
__global__ void fid_mma_tf32(const FidelityParams p) {
    const int t = threadIdx.x;
    const float* a = static_cast<const float*>(p.in0) + 4 * t;
    const float* b = static_cast<const float*>(p.in1) + 2 * t;
    const float* c = static_cast<const float*>(p.in2) + 4 * t;
    const uint32_t ar[4] = {cf::to_tf32(a[0]), cf::to_tf32(a[1]), cf::to_tf32(a[2]), cf::to_tf32(a[3])};
    const uint32_t br[2] = {cf::to_tf32(b[0]), cf::to_tf32(b[1])};
    const float cr[4] = {c[0], c[1], c[2], c[3]};
    float dr[4];
    cf::mma_m16n8k8_tf32(dr, ar, br, cr);
    float* d = static_cast<float*>(p.out0) + 4 * t;
    uint32_t* regs = static_cast<uint32_t*>(p.out1) + 6 * t;
    for (int i = 0; i < 4; ++i) {
        d[i] = dr[i];
        regs[i] = ar[i];
    }
    regs[4] = br[0];
    regs[5] = br[1];
}

// ---- ldmatrix -----------------------------------------------------------------------

// n: shared-memory bytes, filled from in0; in1: each lane's row offset in bytes
// (int32, lane-major); out0: the NUM registers of each lane.
template <int NUM, bool TRANS>
__global__ void fid_ldmatrix(const FidelityParams p) {
    char* smem = cf::dynamic_smem();
    const uint32_t* src = static_cast<const uint32_t*>(p.in0);
    for (int i = threadIdx.x; i < p.n / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = src[i];
    __syncthreads();
    const char* row = smem + static_cast<const int32_t*>(p.in1)[threadIdx.x];
    uint32_t d[NUM];
    if constexpr (NUM == 1) {
        if constexpr (TRANS) cf::ldmatrix_x1_trans(d, row); else cf::ldmatrix_x1(d, row);
    } else if constexpr (NUM == 2) {
        if constexpr (TRANS) cf::ldmatrix_x2_trans(d, row); else cf::ldmatrix_x2(d, row);
    } else {
        if constexpr (TRANS) cf::ldmatrix_x4_trans(d, row); else cf::ldmatrix_x4(d, row);
    }
    uint32_t* out = static_cast<uint32_t*>(p.out0) + NUM * threadIdx.x;
    for (int i = 0; i < NUM; ++i) out[i] = d[i];
}

// ---- warp shuffles ----------------------------------------------------------------------

// in0: one T per lane; arg0: lane mask; arg1: width.
// out0: __shfl_xor_sync(full, v, arg0, arg1); out1: cf::shfl_xor(v, arg0).
template <typename T>
__global__ void fid_shfl_xor(const FidelityParams p) {
    const T v = static_cast<const T*>(p.in0)[threadIdx.x];
    static_cast<T*>(p.out0)[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, p.arg0, p.arg1);
    static_cast<T*>(p.out1)[threadIdx.x] = cf::shfl_xor(v, p.arg0);
}

// in0: one T per lane; in1: source lane per lane (int32); arg1: width.
// out0: __shfl_sync(full, v, src, arg1); out1: cf::shfl(v, src).
template <typename T>
__global__ void fid_shfl_idx(const FidelityParams p) {
    const T v = static_cast<const T*>(p.in0)[threadIdx.x];
    const int src = static_cast<const int32_t*>(p.in1)[threadIdx.x];
    static_cast<T*>(p.out0)[threadIdx.x] = __shfl_sync(0xffffffffu, v, src, p.arg1);
    static_cast<T*>(p.out1)[threadIdx.x] = cf::shfl(v, src);
}

// in0: one T per lane; arg0: delta; arg1: width.
// out0: __shfl_up_sync(full, v, arg0, arg1); out1: __shfl_down_sync(full, v, arg0, arg1).
template <typename T>
__global__ void fid_shfl_updown(const FidelityParams p) {
    const T v = static_cast<const T*>(p.in0)[threadIdx.x];
    static_cast<T*>(p.out0)[threadIdx.x] = __shfl_up_sync(0xffffffffu, v, p.arg0, p.arg1);
    static_cast<T*>(p.out1)[threadIdx.x] = __shfl_down_sync(0xffffffffu, v, p.arg0, p.arg1);
}

// ---- cp.async ----------------------------------------------------------------------------

// Each thread owns 48 bytes of shared memory (3 chunks of 16), first filled with
// the sentinel 0xA5A5A5A5.  It copies chunk g from in0 + 48*t + 16*g + arg1 with
// cp_async_16 (src_bytes from in1, int32 x3 per lane), committing one group per
// chunk, then arg2 empty groups, then cp_async_wait<N>.  out0 (12 words per lane)
// receives the chunks guaranteed to have landed (all 3 when arg0 != 0: a read of
// copies still in flight); after cp_async_wait<0>, out1 receives all 3 chunks.
// The __syncthreads() calls fence the compiler: the cp.async wrappers' asm has no
// "memory" clobber, so without them the sentinel stores could sink below the copy
// or the reads be hoisted above the wait (or forwarded from the sentinel stores).
template <int N>
__global__ void fid_cp_async(const FidelityParams p) {
    const int t = threadIdx.x;
    char* mine = cf::dynamic_smem() + 48 * t;
    uint32_t* words = reinterpret_cast<uint32_t*>(mine);
    for (int i = 0; i < 12; ++i) words[i] = 0xA5A5A5A5u;
    __syncthreads();
    const char* src = static_cast<const char*>(p.in0) + 48 * t + p.arg1;
    const int32_t* src_bytes = static_cast<const int32_t*>(p.in1) + 3 * t;
    for (int g = 0; g < 3; ++g) {
        cf::cp_async_16(mine + 16 * g, src + 16 * g, src_bytes[g]);
        cf::cp_async_commit();
    }
    for (int e = 0; e < p.arg2; ++e) cf::cp_async_commit();
    cf::cp_async_wait<N>();
    __syncthreads();
    const int pending = N > p.arg2 ? N - p.arg2 : 0;
    const int landed = p.arg0 ? 3 : 3 - (pending < 3 ? pending : 3);
    uint32_t* out0 = static_cast<uint32_t*>(p.out0) + 12 * t;
    for (int i = 0; i < 4 * landed; ++i) out0[i] = words[i];
    cf::cp_async_wait<0>();
    __syncthreads();
    uint32_t* out1 = static_cast<uint32_t*>(p.out1) + 12 * t;
    for (int i = 0; i < 12; ++i) out1[i] = words[i];
}

// Each thread copies 4 words from in0 + 16*t with cp_async_4 (src_bytes 0 or 4 from
// in1, int32 x4 per lane) into 16 bytes of shared memory holding the sentinel, in
// one group; after cp_async_wait<0>, out0 receives the 4 words.
__global__ void fid_cp_async_4(const FidelityParams p) {
    const int t = threadIdx.x;
    char* mine = cf::dynamic_smem() + 16 * t;
    uint32_t* words = reinterpret_cast<uint32_t*>(mine);
    for (int i = 0; i < 4; ++i) words[i] = 0xA5A5A5A5u;
    __syncthreads();  // compiler fences, as in fid_cp_async
    const char* src = static_cast<const char*>(p.in0) + 16 * t;
    const int32_t* src_bytes = static_cast<const int32_t*>(p.in1) + 4 * t;
    for (int i = 0; i < 4; ++i) cf::cp_async_4(mine + 4 * i, src + 4 * i, src_bytes[i]);
    cf::cp_async_commit();
    cf::cp_async_wait<0>();
    __syncthreads();
    uint32_t* out = static_cast<uint32_t*>(p.out0) + 4 * t;
    for (int i = 0; i < 4; ++i) out[i] = words[i];
}

// ---- elementwise: exp2, packing, tf32 rounding ----------------------------------------------

// out0[i] = exp2_approx(in0[i]) for i < n (float).
__global__ void fid_exp2(const FidelityParams p) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x)
        static_cast<float*>(p.out0)[i] = cf::exp2_approx(static_cast<const float*>(p.in0)[i]);
}

// out0[i] = pack_half2(in0[2i], in0[2i+1]), out1[i] = pack_bf162(...) for i < n.
__global__ void fid_pack(const FidelityParams p) {
    const float* x = static_cast<const float*>(p.in0);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x) {
        static_cast<uint32_t*>(p.out0)[i] = cf::pack_half2(x[2 * i], x[2 * i + 1]);
        static_cast<uint32_t*>(p.out1)[i] = cf::pack_bf162(x[2 * i], x[2 * i + 1]);
    }
}

// out0[i] = to_tf32(in0[i]) for i < n.
__global__ void fid_to_tf32(const FidelityParams p) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x)
        static_cast<uint32_t*>(p.out0)[i] = cf::to_tf32(static_cast<const float*>(p.in0)[i]);
}
