// cfemu_abi.h -- the C interface between emulated kernel modules and the emulator runtime.
//
// A kernel module (one shared library per set of instantiations, built by
// cupyflash/emulator/_build.py) contains the unchanged cuda_src/ kernels compiled
// by the host compiler against cuda_emu.h and the emulated ptx.cuh, wgmma.cuh and
// barriers.cuh.  Everything those headers cannot do locally -- scheduling the
// block's threads as fibers, barriers (block, named, mbarriers), warp-collective
// instructions, cp.async and bulk queues, the shared-memory checks -- is a call
// into the runtime library (src/runtime.cpp) declared here.
// The runtime is plain C++17 and does not include any CUDA header.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(CFEMU_BUILDING_RUNTIME)
#define CFEMU_API extern "C" __attribute__((visibility("default")))
#else
#define CFEMU_API extern "C"
#endif

// Layout-compatible with CUDA's uint3 / dim3 (three unsigned ints).
struct cfemu_xyz {
    unsigned x, y, z;
};

// What one emulated CUDA thread sees: its indices and the block's shared memory.
struct cfemu_thread_ctx {
    cfemu_xyz thread_idx;
    cfemu_xyz block_idx;
    cfemu_xyz block_dim;
    cfemu_xyz grid_dim;
    char* smem;  // the block's dynamic shared memory
    // smem's address in the shared window (what smem_addr adds to an offset).  A
    // GPU's dynamic shared memory need not start 1024-byte aligned, so with a
    // shuffled thread order it does not start so here either: a 16-byte multiple
    // from 16 to 1008, drawn per launch (0 otherwise).
    uint32_t smem_window;
};

// The thread (fiber) that is running on this OS thread; set by the scheduler.
extern "C" __thread cfemu_thread_ctx* cfemu_current_ctx;

// One launch, filled in by the Python executor (ctypes mirror in _executor.py).
struct cfemu_launch_desc {
    uint32_t grid[3];
    uint32_t block[3];
    uint64_t smem_bytes;       // dynamic shared memory per block
    uint64_t seed;             // seeds the thread order and the block order
    const void* params;        // raw bytes of the kernel's params struct
    uint64_t params_size;      // sizeof as seen by the caller
    uint64_t params_align;     // alignment as seen by the caller
    uint64_t stack_bytes;      // per emulated thread
    const char* kernel_name;   // for messages
    int32_t shuffle;           // shuffle the thread order between barriers
    int32_t race_check;        // the module is instrumented: check shared memory
    // How mma.sync and wgmma sum their products (enum cfemu_accum) and, for
    // CFEMU_ACCUM_TRUNCATE, how many bits below binary32's 24 they keep.
    int32_t accum_mode;
    int32_t accum_extra_bits;
};

// CFEMU_ACCUM_EXACT: products and C summed exactly, rounded once to nearest.
// CFEMU_ACCUM_TRUNCATE: every term (the instruction's k products and C) is
// truncated toward zero to 24 + accum_extra_bits bits below the leading bit of
// the largest term, the truncated terms are summed exactly, and the sum is
// truncated to binary32 (round toward zero); see runtime.cpp, truncated_sum.
enum cfemu_accum { CFEMU_ACCUM_EXACT = 0, CFEMU_ACCUM_TRUNCATE = 1 };

typedef void (*cfemu_thunk)(const void* params);

// What a kernel module uses, told to the runtime by its launch functions.
// CFEMU_MODULE_BARRIERS: the module includes barriers.cuh (mbarriers, named
// barriers), so the race check keeps vector clocks for their happens-before
// edges (a module without them runs without that cost).
enum cfemu_module_flags { CFEMU_MODULE_BARRIERS = 1 };

// Runs the grid; returns 0 on success, else writes a message into err.
CFEMU_API int cfemu_run(const cfemu_launch_desc* desc, cfemu_thunk thunk, uint64_t kernel_params_size,
                        uint64_t kernel_params_align, uint32_t module_flags, char* err, uint64_t errlen);

// ---- synchronisation and warp-collective operations (called from kernels) ----

enum cfemu_shfl_mode { CFEMU_SHFL_IDX = 0, CFEMU_SHFL_UP = 1, CFEMU_SHFL_DOWN = 2, CFEMU_SHFL_BFLY = 3 };
enum cfemu_vote_mode { CFEMU_VOTE_ALL = 0, CFEMU_VOTE_ANY = 1, CFEMU_VOTE_BALLOT = 2 };
enum cfemu_mma_kind { CFEMU_MMA_F16 = 0, CFEMU_MMA_BF16 = 1, CFEMU_MMA_TF32 = 2, CFEMU_MMA_F64 = 3 };

// A block barrier at call site file:line; returns how many live threads passed pred != 0.
CFEMU_API int cfemu_syncthreads(const char* file, int line, int pred);
CFEMU_API void cfemu_syncwarp(unsigned mask);
CFEMU_API uint64_t cfemu_shfl(int mode, unsigned mask, uint64_t bits, int size, int lane_arg, int width);
CFEMU_API unsigned cfemu_vote(int mode, unsigned mask, int pred);
CFEMU_API void cfemu_mma(int kind, float* d, const uint32_t* a, const uint32_t* b, const float* c);
// mma.sync.m8n8k4 .f64 (kind CFEMU_MMA_F64): d[2] = a[0] b[0] + c[2] per ptx-fragments.md section 3.
CFEMU_API void cfemu_mma_f64(double* d, const double* a, const double* b, const double* c);
CFEMU_API void cfemu_ldmatrix(int num, int trans, uint32_t* d, const void* row);
CFEMU_API void cfemu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, int src_bytes);
CFEMU_API void cfemu_cp_async_commit(void);
CFEMU_API void cfemu_cp_async_wait(int n);
// wgmma.mma_async m64n{n}k16 (kind: CFEMU_MMA_F16 / CFEMU_MMA_BF16), a warpgroup
// collective: d is the thread's float[2][n / 4] accumulator tile, a its 4 A
// registers or null (A from desc_a); trans: bit 0 B is MN-major, bit 1 A (from
// shared memory) is.  The result lands
// in d when cfemu_wgmma_wait retires the group (see wgmma.cuh).
CFEMU_API void cfemu_wgmma(int kind, int n, float* d, const uint32_t* a, uint64_t desc_a, uint64_t desc_b,
                           int trans, int accumulate);
CFEMU_API void cfemu_wgmma_fence(void);
CFEMU_API void cfemu_wgmma_commit(void);
CFEMU_API void cfemu_wgmma_wait(int n);
CFEMU_API void cfemu_fence_proxy_async(void);
// setmaxnreg.inc (inc = 1) or .dec (inc = 0) .sync.aligned.u32 count: a warpgroup collective.
CFEMU_API void cfemu_setmaxnreg(int inc, int count);

// ---- barriers.cuh: mbarriers, named barriers, bulk reductions (see that header) ----
enum cfemu_mbar_arrive_kind {
    CFEMU_MBAR_ARRIVE = 0,            // mbarrier.arrive
    CFEMU_MBAR_ARRIVE_EXPECT_TX = 1,  // mbarrier.arrive.expect_tx: tx-count += tx, then arrive
    CFEMU_MBAR_EXPECT_TX = 2,         // mbarrier.expect_tx: tx-count += tx
    CFEMU_MBAR_COMPLETE_TX = 3        // mbarrier.complete_tx: tx-count -= tx
};
CFEMU_API void cfemu_mbar_init(void* bar, uint32_t count);
CFEMU_API void cfemu_mbar_arrive(void* bar, int kind, uint32_t tx);
// try_wait.parity (blocking = 0: returns whether the phase completed) or a wait
// until it has (blocking = 1, returns 1).
CFEMU_API int cfemu_mbar_wait(void* bar, uint32_t parity, int blocking);
CFEMU_API void cfemu_cp_async_mbar_arrive(void* bar);
CFEMU_API void cfemu_mbar_inval(void* bar);
// bar.sync (sync = 1) or bar.arrive (sync = 0) id, threads.
CFEMU_API void cfemu_named_barrier(int id, int threads, int sync);
CFEMU_API void cfemu_bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes);
CFEMU_API void cfemu_bulk_commit(void);
// cp.async.bulk.wait_group(.read when read_only) n.
CFEMU_API void cfemu_bulk_wait(int n, int read_only);
// A semaphore in global memory: wait until *sem == value (ld.acquire.gpu in a loop),
// post value (st.release.gpu).  Either may switch the emulator to another block.
CFEMU_API void cfemu_semaphore_wait(const int* sem, int value);
CFEMU_API void cfemu_semaphore_post(int* sem, int value);
// fence.proxy.async.global
CFEMU_API void cfemu_fence_proxy_async_global(void);
// Ends the launch with an error (assert, __trap).
CFEMU_API void cfemu_trap(const char* what, const char* file, int line) __attribute__((noreturn));
