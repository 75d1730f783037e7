// setmaxnreg_planted.cu -- kernels for tests/test_emulator_setmaxnreg.py: register
// reallocation between warpgroups (wgmma.cuh's setmaxnreg_dec / setmaxnreg_inc) used
// correctly, an op script run against the test's model of the CTA's register pool,
// and each rule of the instruction broken on purpose by a template argument, so that
// the emulator's checks are shown to fire.
#include "ptx.cuh"
#include "wgmma.cuh"
#include "barriers.cuh"
#include "planted_params.cuh"

// ---- correct use: a producer warpgroup hands its registers to two consumers -----------
// 384 threads start with 168 registers a thread (3 * 168 = 504 a thread slot): warpgroup
// 2, the producer, drops to 40 and warpgroups 0 and 1, the consumers, rise to 232
// (40 + 2 * 232 = 504).  Then p.n rounds over one shared buffer: the producer copies
// p.in[256 r, 256 r + 256) into it and arrives on `full`; each consumer thread t writes
// p.out[256 r + t] = 2 buf[t] + buf[255 - t] and arrives on `empty`.
// Before its .dec the producer sets p.ticket[0]; each consumer thread copies it to
// p.ticket[1 + t] after its .inc -- 1 everywhere, as no .inc can complete before the
// .dec gives the pool its registers (observed here, in the emulator's thread order, not
// a memory-model guarantee).
__global__ void setmaxnreg_handoff(const PlantedParams p) {
    uint64_t* full = reinterpret_cast<uint64_t*>(cf::dynamic_smem());
    uint64_t* empty = full + 1;
    float* buf = reinterpret_cast<float*>(cf::dynamic_smem() + 64);
    const int t = threadIdx.x;
    if (t == 0) {
        cf::mbarrier_init(full, 128);
        cf::mbarrier_init(empty, 256);
    }
    __syncthreads();
    if (t >= 256) {
        if (t == 256) p.ticket[0] = 1;
        cf::setmaxnreg_dec<40>();
        for (int r = 0; r < p.n; ++r) {
            if (r > 0) cf::mbarrier_wait_parity(empty, (r - 1) & 1);
            for (int i = t - 256; i < 256; i += 128) buf[i] = p.in[256 * r + i];
            cf::mbarrier_arrive(full);
        }
        return;
    }
    cf::setmaxnreg_inc<232>();
    p.ticket[1 + t] = *static_cast<volatile int32_t*>(p.ticket);
    for (int r = 0; r < p.n; ++r) {
        cf::mbarrier_wait_parity(full, r & 1);
        p.out[256 * r + t] = 2.0f * buf[t] + buf[255 - t];
        cf::mbarrier_arrive(empty);
    }
}

// ---- an op script against the Python model ----------------------------------------------
// p.in holds p.n ops as int32 triples (warpgroup, inc, count); each warpgroup runs its own
// ops in order, synchronising on named barrier 1 + warpgroup between two of them (PTX
// ISA: "all warps in the warpgroup must synchronize explicitly before executing
// subsequent setmaxnreg instructions"), and its thread 0 writes the number it ran to
// p.ticket[warpgroup].  The count is an operand here, not an immediate, so the kernel
// calls the emulator's entry point itself (the header's templates take only constants).
__global__ void setmaxnreg_script(const PlantedParams p) {
    const int wg = threadIdx.x / 128;
    const int32_t* ops = reinterpret_cast<const int32_t*>(p.in);
    int done = 0;
    for (int i = 0; i < p.n; ++i) {
        if (ops[3 * i] != wg) continue;
        if (done++) cf::named_barrier_sync(1 + wg, 128);
        cfemu_setmaxnreg(ops[3 * i + 1], ops[3 * i + 2]);
    }
    if (threadIdx.x % 128 == 0) p.ticket[wg] = done;
}

// ---- one rule broken per kFault -----------------------------------------------------------
// 384 threads (kFault 7: 288), 168 registers a thread at the start; unless noted warpgroup
// 2 drops to 40 and warpgroups 0 and 1 rise to 232, then every thread writes p.out[t] = 1.
//   1  warpgroup 0's warps 2-3 ask for 224, its warps 0-1 for 232
//   2  warp 3 skips the call and exits
//   3  warp 3 skips the call and waits at a __syncthreads() the others reach after theirs
//   4  the producer's .dec asks for 200: more than its 168
//   5  the consumers' .inc asks for 160: fewer than their 168
//   6  the consumers ask for 240: 40 + 2 * 240 = 520 > 504, the pool never holds enough
//   7  288 threads: warp 8, alone in its warpgroup, calls setmaxnreg_dec<40>
//   8  thread 0 exits at once; the rest of warpgroup 0 calls setmaxnreg_inc<232>
//   9  a count of 100 (not a multiple of 8), through the emulator's entry point
//  10  warpgroup 0's warps 0-1 and 2-3 reach setmaxnreg_inc<232> at two call sites
//  11  lane 0 of warp 0 waits at __syncwarp() while lanes 1-31 go on to setmaxnreg_inc<232>
//  12  warpgroup 0's warps 0-1 call setmaxnreg_dec<168>, its warps 2-3 setmaxnreg_inc<168>
//  13  warpgroup 0 at one call site with two counts, 232 (warps 0-1) and 224 (warps 2-3),
//      through the emulator's entry point (with wgmma.cuh's immediates a count is its own
//      instruction)
template <int kFault>
__global__ void setmaxnreg_fault(const PlantedParams p) {
    const int t = threadIdx.x, w = cf::warp_id();
    if (kFault == 7) {
        if (w == 8) cf::setmaxnreg_dec<40>();
        return;
    }
    if (kFault == 8 && t == 0) return;
    if (kFault == 9 && w < 4) cfemu_setmaxnreg(0, 100);
    if (t >= 256) {
        if (kFault == 4)
            cf::setmaxnreg_dec<200>();
        else
            cf::setmaxnreg_dec<40>();
    } else if (kFault == 1 && (w == 2 || w == 3)) {
        cf::setmaxnreg_inc<224>();
    } else if ((kFault == 2 || kFault == 3) && w == 3) {
        if (kFault == 2) return;
    } else if (kFault == 5) {
        cf::setmaxnreg_inc<160>();
    } else if (kFault == 6) {
        cf::setmaxnreg_inc<240>();
    } else if (kFault == 10 && w < 4) {  // the volatile stores keep the compiler from merging the calls
        volatile int path;
        if (w < 2) {
            cf::setmaxnreg_inc<232>();
            path = 1;
        } else {
            cf::setmaxnreg_inc<232>();
            path = 2;
        }
        (void)path;
    } else if (kFault == 13 && w < 4) {
        cfemu_setmaxnreg(1, w < 2 ? 232 : 224);
    } else if (kFault == 12 && w < 4) {
        if (w < 2)
            cf::setmaxnreg_dec<168>();
        else
            cf::setmaxnreg_inc<168>();
    } else {
        if (kFault == 11 && t == 0) __syncwarp();
        cf::setmaxnreg_inc<232>();
    }
    if (kFault == 3) __syncthreads();
    p.out[t] = 1.0f;
}
