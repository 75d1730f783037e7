// planted.cu -- small kernels for tests/test_emulator.py: each bug is planted behind
// a template flag (or a params value) whose other setting is the correct kernel, so
// that the emulator's checks are shown to fire on the bug and stay quiet on the fix.
#include "ptx.cuh"
#include "planted_params.cuh"

// out[t] = in[t] + in[t+1 mod n] through shared memory.  kSync = false drops the
// __syncthreads() between each thread's write and its neighbour's read (a
// read-after-write race).
template <bool kSync>
__global__ void neighbour_sum(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    s[t] = p.in[base + t];
    if (kSync) __syncthreads();
    p.out[base + t] = s[t] + s[(t + 1) % n];
}

// Every thread reads its neighbour's slot then overwrites its own.  kSync = false
// drops the barrier between the reads and the writes (a write-after-read race).
template <bool kSync>
__global__ void rotate_in_place(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x, n = blockDim.x;
    s[t] = p.in[t];
    __syncthreads();
    const float v = s[(t + 1) % n];
    if (kSync) __syncthreads();
    s[t] = 2.0f * v;
    __syncthreads();
    p.out[t] = s[t];
}

// Lanes exchange values with their xor-1 partner through shared memory, ordered
// by __syncwarp() (kSync) or not at all.
template <bool kSync>
__global__ void warp_exchange(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x;
    s[t] = p.in[t];
    if (kSync) __syncwarp();
    p.out[t] = s[t ^ 1];
}

// Each thread loads 16 bytes with cp.async and then reads its neighbour's.
// kWait = false omits cp_async_wait (the data never lands).
template <bool kWait>
__global__ void cp_async_neighbour(const PlantedParams p) {
    char* smem = cf::dynamic_smem();
    const int t = threadIdx.x, n = blockDim.x;
    cf::cp_async_16(smem + 16 * t, p.in + 4 * t, 16);
    cf::cp_async_commit();
    if (kWait) cf::cp_async_wait<0>();
    __syncthreads();
    const float* s = reinterpret_cast<const float*>(smem);
    for (int i = 0; i < 4; ++i) p.out[4 * t + i] = s[4 * ((t + 1) % n) + i];
}

// As cp_async_neighbour<true> but without the __syncthreads() after the wait:
// the neighbour's read races with the copy landing.
__global__ void cp_async_no_barrier(const PlantedParams p) {
    char* smem = cf::dynamic_smem();
    const int t = threadIdx.x, n = blockDim.x;
    cf::cp_async_16(smem + 16 * t, p.in + 4 * t, 16);
    cf::cp_async_commit();
    cf::cp_async_wait<0>();
    const float* s = reinterpret_cast<const float*>(smem);
    for (int i = 0; i < 4; ++i) p.out[4 * t + i] = s[4 * ((t + 1) % n) + i];
}

// A __syncthreads() inside a branch taken by the first warp only: the other warps
// wait at the second __syncthreads() (a deadlock on a GPU, undefined behaviour).
__global__ void divergent_barrier(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x;
    if (t < 32) {
        s[t] = p.in[t];
        __syncthreads();
    }
    __syncthreads();
    p.out[t] = s[t % 32];
}

// Half of warp 0 waits at __syncthreads() while its other half waits in a
// shuffle for them: neither can complete.
__global__ void barrier_vs_shuffle(const PlantedParams p) {
    const int t = threadIdx.x;
    float v = p.in[t];
    if (cf::lane_id() < 16 || cf::warp_id() > 0)
        __syncthreads();
    else
        v = cf::shfl_xor(v, 1);
    p.out[t] = v;
}

// Lanes 16-31 return before a full-warp shuffle.
__global__ void shuffle_after_exit(const PlantedParams p) {
    const int t = threadIdx.x;
    if (cf::lane_id() >= 16) return;
    p.out[t] = cf::shfl_xor(p.in[t], 1);
}

// Lanes 0-15 shuffle while lanes 16-31 of the same warp wait in __syncwarp():
// two different warp collectives, each waiting for the other's lanes.
__global__ void divergent_collectives(const PlantedParams p) {
    const int t = threadIdx.x;
    float v = p.in[t];
    if (cf::lane_id() < 16)
        v = cf::shfl_xor(v, 1);
    else
        __syncwarp();
    p.out[t] = v;
}

// One m16n8k16 mma per warp, the lanes' fragments from in[] by lane (so every warp
// computes the same product).  mma.sync is .aligned: a warp must execute it as one
// instruction.  kSplit = true has lanes 0-15 and 16-31 reach it at two call sites
// (the same operation, two instructions); false splits by warp instead, which is fine.
// The volatile stores after the calls keep the compiler from merging them.
template <bool kSplit>
__global__ void divergent_mma(const PlantedParams p) {
    const int t = threadIdx.x, lane = cf::lane_id();
    uint32_t a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = cf::pack_bf162(p.in[8 * lane + 2 * i], p.in[8 * lane + 2 * i + 1]);
    for (int i = 0; i < 2; ++i) b[i] = cf::pack_bf162(p.in[256 + 4 * lane + 2 * i], p.in[257 + 4 * lane + 2 * i]);
    const float c[4] = {};
    float d[4];
    volatile int path;
    if (kSplit ? lane < 16 : cf::warp_id() % 2 == 0) {
        cf::mma_m16n8k16_bf16(d, a, b, c);
        path = 1;
    } else {
        cf::mma_m16n8k16_bf16(d, a, b, c);
        path = 2;
    }
    (void)path;
    for (int i = 0; i < 4; ++i) p.out[4 * t + i] = d[i];
}

// Thread t < n - 1 copies in[4t + arg .. 4t + arg + 3] to out[4t ..] with one 16-byte
// load and store, as the kernels' vector paths do; arg = 1 misaligns the load.
__global__ void vector_copy(const PlantedParams p) {
    const int t = threadIdx.x;
    if (t + 1 < p.n)
        *reinterpret_cast<uint4*>(p.out + 4 * t) = *reinterpret_cast<const uint4*>(p.in + 4 * t + p.arg);
}

// Thread t writes shared float t + arg; arg = 1 makes the last thread write past the end.
__global__ void smem_out_of_bounds(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    const int t = threadIdx.x;
    s[t + p.arg] = p.in[t];
    __syncthreads();
    p.out[t] = s[t];
}

// Records the order in which threads run: ticket[t] before and ticket[n + t]
// after a barrier, drawn from the counter ticket[2n].
__global__ void order_probe(const PlantedParams p) {
    const int t = threadIdx.x, n = blockDim.x;
    p.ticket[t] = atomicAdd(p.ticket + 2 * n, 1);
    __syncthreads();
    p.ticket[n + t] = atomicAdd(p.ticket + 2 * n, 1);
}

// Correct block and warp votes on pred = in[t] > 0: out[4t..4t+3] = the
// __syncthreads_count, _and and _or results and __all_sync + 2 * __any_sync of the
// warp; ticket[t] = the warp's __ballot_sync.
__global__ void block_votes(const PlantedParams p) {
    const int t = threadIdx.x;
    const int pred = p.in[t] > 0.0f;
    const int count = __syncthreads_count(pred);
    const int all = __syncthreads_and(pred);
    const int any = __syncthreads_or(pred);
    const unsigned ballot = __ballot_sync(0xffffffffu, pred);
    const int warp_all = __all_sync(0xffffffffu, pred), warp_any = __any_sync(0xffffffffu, pred);
    p.out[4 * t] = static_cast<float>(count);
    p.out[4 * t + 1] = static_cast<float>(all);
    p.out[4 * t + 2] = static_cast<float>(any);
    p.out[4 * t + 3] = static_cast<float>(warp_all + 2 * warp_any);
    p.ticket[t] = static_cast<int32_t>(ballot);
}

// A correct block reduction two ways: out[2b] by a shared-memory tree,
// out[2b+1] by warp shuffles and one shared slot per warp.
__global__ void block_sum(const PlantedParams p) {
    float* s = reinterpret_cast<float*>(cf::dynamic_smem());
    float* warp_sums = s + blockDim.x;
    const int t = threadIdx.x, n = blockDim.x;
    const float x = p.in[blockIdx.x * n + t];
    s[t] = x;
    __syncthreads();
    for (int stride = n / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    float v = x;
    for (int m = 16; m > 0; m >>= 1) v += cf::shfl_xor(v, m);
    if (cf::lane_id() == 0) warp_sums[cf::warp_id()] = v;
    __syncthreads();
    if (t == 0) {
        float total = 0.0f;
        for (int w = 0; w < n / 32; ++w) total += warp_sums[w];
        p.out[2 * blockIdx.x] = s[0];
        p.out[2 * blockIdx.x + 1] = total;
    }
}

// Writes far outside any buffer (arg != 0): a crash on the host, an illegal address on a GPU.
__global__ void wild_global_write(const PlantedParams p) {
    const size_t offset = static_cast<size_t>(p.arg) << 30;
    p.out[threadIdx.x + offset] = 1.0f;
}

// A 4 MiB frame: more than the emulator's default 256 KiB per-thread stack.
__device__ __noinline__ float stack_hog(float x) {
    volatile char big[4 << 20];
    for (int i = 0; i < (4 << 20); i += 4096) big[i] = static_cast<char>(x);
    return big[0];
}
__global__ void stack_overflow(const PlantedParams p) { p.out[threadIdx.x] = stack_hog(p.in[threadIdx.x]); }

// out[t] = the shared-window address (smem_addr) of the dynamic shared memory's
// 16-byte slot t: where a GPU puts dynamic shared memory is its own business, so
// the shuffled emulator puts it at an address that is not 1024-byte aligned.
__global__ void shared_window(const PlantedParams p) {
    p.out[threadIdx.x] = static_cast<float>(cf::smem_addr(cf::dynamic_smem() + 16 * threadIdx.x));
}
