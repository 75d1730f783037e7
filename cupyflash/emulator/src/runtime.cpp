// runtime.cpp -- the CPU emulator's runtime: runs a kernel's grid block by block,
// each block's threads as fibers on the calling OS thread.
//
// Model (DESIGN.md section 5):
//  * Blocks run one at a time (in a seeded random order when shuffling).  Each
//    block gets freshly poisoned (0xFF: NaN for every float type) dynamic shared
//    memory with red zones on both sides.
//  * A thread runs until it reaches a synchronisation point: __syncthreads(), a
//    warp-collective operation (__syncwarp, shuffles, votes, mma, ldmatrix) or the
//    end of the kernel.  Each scheduling round runs every runnable thread once, in
//    a seeded random order when shuffling.
//  * Barriers are typed.  __syncthreads() releases when every live thread of the
//    block waits at the same __syncthreads() call (file:line); a warp collective
//    completes when every lane named in its mask waits at the same kind of
//    operation with the same mask, and is then computed from all lanes' operands
//    with the PTX fragment layouts.  A block where no thread can proceed is a
//    deadlock and is reported with what every thread waits for.
//  * cp.async copies are queued per thread and performed -- source read, zero
//    fill, destination written -- when the issuing thread's cp.async.wait_group
//    retires their group.  Copies never waited for never land, and a thread that
//    exits with copies in flight is an error.
//  * mbarriers (barriers.cuh) are state here, keyed by shared offset: phase,
//    pending arrivals, expected count, tx-count.  A phase completes when its
//    pending count and tx-count are zero.  mbarrier_wait_parity blocks the
//    thread until the phase completes; a false mbarrier_try_wait_parity yields
//    it (rounds in which every thread that runs only fails a try_wait, 4096 in
//    a row, are a deadlock).  cp_async_mbarrier_arrive counts its arrival at
//    once; the copies it tracks land at the first wait that returns true for
//    the phase it completed (or at the issuing thread's cp.async.wait_group, or
//    when the barrier is invalidated).
//    Errors: use before init, before a __syncthreads() (or barrier edge) makes
//    the init visible, or after inval; a second init; an arrival when none is
//    pending (tx-count keeps the phase open); an arrival in a phase before any
//    wait returned true for the previous one (PTX ISA, "Phase of the mbarrier
//    object"); a parity other than 0 or 1; a try_wait whose thread failed for
//    phase F and tries again when the barrier is in phase F + 2 or later (it
//    was lapped); a plain load or store of a live barrier's 8 bytes.
//  * Named barriers (bar.sync / bar.arrive id, threads): each warp's non-exited
//    lanes meet at the same instruction (a lane elsewhere is divergence, or a
//    deadlock naming the warp's arrived lanes), then the warp counts 32
//    threads; a sync waits for `threads`.  Errors: id outside 0..15, a count
//    not a multiple of 32 or above the block's, one id with two counts at once,
//    a warp arriving twice before the barrier completes, a barrier with
//    arrivals no sync completed when the block ends.  named_barrier_sync(0,
//    all threads) is __syncthreads() at its own call site; any other use of
//    barrier 0 while threads wait at __syncthreads() is an error.
//  * Bulk reductions (cp.reduce.async.bulk ... add.f32) are queued per thread
//    in bulk groups: the source (16-byte aligned, a multiple of 16 bytes) may
//    be read until bulk.wait_group.read retires the group -- a write to it
//    before is an error -- and the float additions into global memory happen
//    when bulk.wait_group retires it or the thread exits, in a shuffled element
//    order.  A thread that exits while a group still reads its source is an
//    error.
//  * Semaphores (semaphore_wait / semaphore_post, barriers.cuh) are ints in
//    global memory.  A wait whose value is not there blocks the thread
//    (St::SemWait); a block in which no thread can run and some wait for a
//    semaphore is suspended -- its state moved aside (BlockState), its fibers'
//    stacks kept -- and the grid scheduler starts or resumes another: a
//    suspended block whose awaited value has been posted, or the next block
//    to start (chosen at random when shuffling).  A post that a suspended
//    block waits for suspends the poster at once, so the waiter runs before
//    the poster goes on.  Errors: a post while a thread of the block has bulk
//    reductions whose additions are not complete, completed with no
//    fence_proxy_async_global after, or (vector clocks) whose completion no
//    barrier edge orders before the post; a bulk reduction issued after the
//    block acquired a semaphore by a thread with no fence_proxy_async_global
//    since (the fence is modelled only there); a wait satisfied by a
//    post of a block later in launch order (on a GPU that block may never
//    start while the waiter holds its SM); a misaligned or shared-memory
//    semaphore; every started block waiting with none left to start (a
//    deadlock, reported with each waiter's semaphore and value).
//  * setmaxnreg (wgmma.cuh, sm_90a) is a warpgroup collective: the 128 threads of
//    warps 4k..4k+3 meet at the same instruction (call site, action and count).
//    Errors: an incomplete warpgroup, an exited thread of it, another call site,
//    action or count in it, a lane of the warp waiting at another collective, a
//    count outside 24..256 or not a multiple of 8, a .dec that would raise the
//    warpgroup's count or an .inc that would lower it.  Every warp starts with
//    the most registers a thread can have at one block of this size per SM
//    (Launch::reg_start) and the CTA's register pool empty: a .dec gives
//    (old - new) * 128 registers to the pool, an .inc takes (new - old) * 128 from
//    it and holds the warpgroup until the pool has them (other threads run on;
//    a deadlock report names the warpgroup, what it needs and what the pool
//    holds).  Exiting threads give nothing back.  It orders no memory accesses.
//  * With race checking on (the kernel module is compiled with
//    -fsanitize=kernel-address so that every load and store calls a hook below),
//    every shared-memory byte keeps its last writer and its readers since the last
//    __syncthreads(); conflicting accesses by two threads not ordered by a
//    __syncthreads() (or, within a warp, a full-warp __syncwarp()) are reported.
//    In a module that uses barriers.cuh each thread also keeps a vector clock
//    (one entry per thread, and one per thread's cp.async copies): an arrival
//    releases the thread's clock into the phase (a named barrier's arrivals into
//    the barrier), a wait that returns true for the phase (a named barrier's
//    sync) acquires it, and a __syncwarp() joins its lanes' clocks; two accesses
//    so ordered are not a race.  Each byte then keeps its writer's clock and
//    the clocks of its readers (an interned set of (thread, clock) pairs).  The
//    async proxy's reads (wgmma, bulk reductions) need a fence.proxy.async by
//    the writer after the write (for copies landed through an mbarrier: by the
//    issuing or the reading thread after they landed); with vector clocks that
//    fence must happen before the read (before the release the reader
//    acquired, not merely before the read in the emulator's schedule).  A
//    wgmma's shared operands are read at its issue and again at each warp's
//    retirement (by the warp's lane 0, the reader of record): a write to them
//    must be ordered after the wgmma.wait_group that retires them, so a buffer
//    released before that wait is a race.
//  * A fault in kernel code (an out-of-bounds global access, a stack overflow
//    into a fiber's guard page) is caught by a SIGSEGV/SIGBUS handler and becomes
//    an error; so does a thread that runs 2^30 instrumented memory accesses
//    without reaching a synchronisation point (a spin-wait on another thread,
//    which cannot progress under cooperative scheduling).
//
// Everything that belongs to one launch lives in a Launch object, so launches on
// different OS threads are independent.  Errors never abort the process: the
// failing fiber is abandoned, the scheduler stops and cfemu_run returns the message.
#define CFEMU_BUILDING_RUNTIME 1
#include "cfemu_abi.h"

#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

extern "C" {
__attribute__((visibility("default"))) __thread cfemu_thread_ctx* cfemu_current_ctx = nullptr;
}

// ---------------------------------------------------------------------------
// Fiber context switching: a few instructions on x86-64, ucontext elsewhere
// (define CFEMU_USE_UCONTEXT to run the portable path on x86-64 too).
// ---------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(CFEMU_USE_UCONTEXT)
// Saves the callee-saved registers on the current stack, stores the stack pointer
// in *save_sp and resumes the context whose stack pointer is load_sp.
extern "C" void cfemu_switch(void** save_sp, void* load_sp);
extern "C" void cfemu_fiber_start();
asm(R"(
    .text
    .p2align 4
    .globl cfemu_switch
    .hidden cfemu_switch
    .type cfemu_switch,@function
cfemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cfemu_switch, .-cfemu_switch

    .p2align 4
    .globl cfemu_fiber_start
    .hidden cfemu_fiber_start
    .type cfemu_fiber_start,@function
cfemu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cfemu_fiber_start, .-cfemu_fiber_start
)");

namespace {
struct Context {
    void* sp = nullptr;
};
// A fresh context that calls entry(arg) on the stack [lo, lo + size).
void context_init(Context& c, char* lo, size_t size, void (*entry)(void*), void* arg) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top) - 7;
    sp[0] = nullptr;                                         // r15
    sp[1] = nullptr;                                         // r14
    sp[2] = reinterpret_cast<void*>(entry);                  // r13
    sp[3] = arg;                                             // r12
    sp[4] = nullptr;                                         // rbx
    sp[5] = nullptr;                                         // rbp
    sp[6] = reinterpret_cast<void*>(&cfemu_fiber_start);     // return address
    c.sp = sp;
}
inline void context_switch(Context& from, Context& to) { cfemu_switch(&from.sp, to.sp); }
}  // namespace
#else
namespace {
struct Context {
    ucontext_t uc;
};
void ucontext_entry(unsigned hi_e, unsigned lo_e, unsigned hi_a, unsigned lo_a) {
    auto entry = reinterpret_cast<void (*)(void*)>((uintptr_t(hi_e) << 32) | lo_e);
    void* arg = reinterpret_cast<void*>((uintptr_t(hi_a) << 32) | lo_a);
    entry(arg);
    abort();  // entry never returns
}
void context_init(Context& c, char* lo, size_t size, void (*entry)(void*), void* arg) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = lo;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    uintptr_t e = reinterpret_cast<uintptr_t>(entry), a = reinterpret_cast<uintptr_t>(arg);
    makecontext(&c.uc, reinterpret_cast<void (*)()>(&ucontext_entry), 4, unsigned(e >> 32), unsigned(e),
                unsigned(a >> 32), unsigned(a));
}
inline void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
}  // namespace
#endif

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
// Rounds in a row in which every thread that runs fails an mbarrier_try_wait_parity and
// nothing else happens: then the block is a deadlock (a kernel may poll a barrier a
// bounded number of times and then do something else; 4096 polls is far beyond that).
constexpr int kSpinRounds = 4096;
// An mbarrier's counts: expected arrivals 1 .. 2^20 - 1, tx-count within +-(2^20 - 1).
constexpr int64_t kMbarMax = (1 << 20) - 1;
// The "file" of a named_barrier_sync(0, all threads), which is a __syncthreads().
constexpr const char kBar0[] = "named_barrier_sync(0, all threads)";

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

// " {loc:<module path>+0x<offset>}" for a code address; the Python side turns it
// into " at file:line" with addr2line.
std::string location(const void* pc) {
    if (!pc) return "";
    Dl_info info;
    if (dladdr(pc, &info) && info.dli_fname && info.dli_fbase) {
        uintptr_t off = reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase);
        return format(" {loc:%s+0x%llx}", info.dli_fname, static_cast<unsigned long long>(off));
    }
    return "";
}

// ---- number formats used by the tensor-core operations ----------------------

double half_to_double(uint32_t h) {
    int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v;
    if (exp == 0)
        v = std::ldexp(double(man), -24);
    else if (exp == 31)
        v = man ? NAN : INFINITY;
    else
        v = std::ldexp(double(man | 0x400), exp - 25);
    return sign ? -v : v;
}
double bf16_to_double(uint32_t b) {
    uint32_t bits = (b & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
// The tensor cores read the upper 19 bits of a .tf32 register (sign, 8-bit
// exponent, 10-bit mantissa); cvt.rna.tf32.f32 has already rounded them.
double tf32_to_double(uint32_t r) {
    uint32_t bits = r & 0xffffe000u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The truncating accumulation (CFEMU_ACCUM_TRUNCATE): c plus the k products
// (exact in double: at most 11 x 11 significand bits), as a tensor core's
// multi-operand adder is taken to work -- every term aligned to the largest
// one's exponent and cut to 24 + extra bits below its leading bit (round toward
// zero), the cut terms added without error, the sum cut to binary32.  The
// truncated terms are multiples of 2^(e - 23 - extra) below 2^(e + 1), so for
// extra <= 20 the at most 17 of them sum exactly in a double.  Infinite and NaN
// terms leave the sum to IEEE arithmetic (the exact path's result).
float truncated_sum(double c, const double* prod, int k, int extra) {
    int emax = INT32_MIN;
    double exact = c;
    for (int i = 0; i < k; ++i) exact += prod[i];
    if (!std::isfinite(exact)) return static_cast<float>(exact);
    auto scan = [&](double t) {
        if (t != 0.0) emax = std::max(emax, std::ilogb(t));
    };
    scan(c);
    for (int i = 0; i < k; ++i) scan(prod[i]);
    if (emax == INT32_MIN) return static_cast<float>(exact);  // every term is zero: the IEEE sum's sign
    const int shift = 23 + extra - emax;  // term * 2^shift: its value in units of the last kept bit
    double sum = std::trunc(std::ldexp(c, shift));
    for (int i = 0; i < k; ++i) sum += std::trunc(std::ldexp(prod[i], shift));
    sum = std::ldexp(sum, -shift);
    float f = static_cast<float>(sum);  // to nearest; step back toward zero if that rounded up
    if (std::fabs(static_cast<double>(f)) > std::fabs(sum)) f = std::nextafter(f, 0.0f);
    if (f == 0.0f && sum == 0.0) f = std::copysign(0.0f, static_cast<float>(exact));
    return f;
}

// ---- per-launch state ----------------------------------------------------------

// NamedWarp: at a named barrier, waiting for the rest of its warp; NamedBar: the
// warp has arrived at a named_barrier_sync that has not completed; MbarWait: in
// mbarrier_wait_parity for a phase that has not completed; RegWait: its whole
// warpgroup is at a setmaxnreg.inc, waiting for the CTA's register pool.
enum class St : uint8_t { Runnable, BlockBar, WarpOp, NamedWarp, NamedBar, MbarWait, RegWait, SemWait, Exited };
// Setmaxnreg: op_variant is (count << 1) | inc.
enum class Op : uint8_t { None, Syncwarp, Shfl, Vote, Mma, Ldmatrix, Wgmma, Setmaxnreg };

struct ShflArgs {
    uint64_t in, out;
    int lane_arg, width;
};
struct VoteArgs {
    int pred;
    unsigned out;
};
struct MmaArgs {
    float* d;
    const uint32_t* a;
    const uint32_t* b;
    const float* c;
};
struct DmmaArgs {
    double* d;
    const double* a;
    const double* b;
    const double* c;
};
struct LdmArgs {
    uint32_t* d;
    const char* row;
};
struct WgmmaArgs {
    int kind, n, trans_b, accumulate;
    float* d;           // this thread's float[2][n / 4] register tile
    const uint32_t* a;  // 4 registers, or null: A from desc_a
    uint64_t desc_a, desc_b;
    int trans_a;        // A from shared memory, MN-major
};

// The shared memory one warpgroup's wgmma read, checked when its group retires.
struct WgmmaRead {
    std::vector<size_t> offsets;
    std::vector<char> bytes;
    const void* pc;
    int retired = 0;  // threads of the warpgroup that have retired it
    // With race checking: the offsets each warp's reader of record (its lane 0) read, A's
    // rows of the warp and all of B; read again, as that thread, when it retires the group.
    std::vector<size_t> a_off[4], b_off;
};
// One thread's part of a wgmma in flight (issued, its group not retired).
struct WgmmaPending {
    uint32_t group;
    float* d;
    std::vector<float> result;  // the thread's float[2][n / 4], written back when the group retires
    const uint32_t* a;
    uint32_t a_copy[4];
    std::shared_ptr<WgmmaRead> read;
    const void* pc;
};

// What a wgmma leaves in its accumulators until the group retires: a signaling
// NaN, so that a read gives NaN and any arithmetic written back (x * s, x + y)
// quietens it -- the retirement then sees that the registers were written.
constexpr uint32_t kWgmmaPoison = 0x7fa5c0deu;

struct Copy {
    char* dst;
    const char* src;
    int size, src_bytes;
    uint32_t group;
    const void* pc;
    uint32_t seq;      // the issuing thread's copies before this one
    int arrival = -1;  // the first cp_async_mbarrier_arrive that tracks it (Launch::arrivals), or -1
};

// Writer ids of the shared-memory shadow: threads 0..1023, and the cp.async
// copies of thread t that land through an mbarrier (the async proxy's writes,
// ordered only by that barrier's phase) as kAgentBase + t.
constexpr unsigned kAgentBase = 1024;

// Shadow::pending: 0, issuing thread + 1 of an in-flight cp.async, or one of these.
constexpr uint16_t kPendMbar = 0xffff;  // a live mbarrier's 8 bytes
constexpr uint16_t kPendBulk = 0xfffe;  // the source of a bulk reduction not yet retired by wait_group.read

// One cp_async_mbarrier_arrive: thread `tid`'s copies issued before it (seq <
// `seq`) land when a wait returns true for the phase it was counted in.
struct AsyncArrival {
    int tid;
    uint32_t seq;
    uint32_t agent_clock;  // the clock its copies are stamped with (kAgentBase + tid's entry)
    size_t bar;            // the barrier's shared offset
};

// An mbarrier (PTX ISA "Contents of the mbarrier object"), by shared offset.
struct Mbar {
    size_t off = 0;
    bool live = false;
    uint32_t expected = 0;
    int64_t pending = 0, tx = 0;
    uint64_t phase = 0;
    bool waited_prev = true;  // some wait returned true for phase - 1 (none needed for phase 0)
    int init_tid = -1;
    uint32_t init_clock = 0, init_epoch = 0;
    const void* init_pc = nullptr;
    const void* inval_pc = nullptr;
    std::vector<uint32_t> vc_cur, vc_prev;  // released into the current / the completed phase
    std::vector<int> arr_cur, arr_prev;     // async arrivals counted in them, copies not landed
};

// A named barrier (bar.sync / bar.arrive): count 0 when idle.
struct NamedBar {
    int count = 0, arrived = 0;
    uint32_t warps = 0;  // warps arrived in this use (bit w)
    const void* first_pc = nullptr;
    int first_warp = -1;
    std::vector<int> waiters;  // threads of sync-ing warps, released at completion
    std::vector<uint32_t> vc;
};

// One bulk reduction: dst[i] += the source's floats as they were at issue.
struct BulkOp {
    float* dst;
    size_t src_off;
    uint32_t bytes, group;
    bool read_retired;
    std::vector<float> values;
    const void* pc;
};

struct Launch;

// The scheduler and the warp rendezvous read a few fields of many fibers: 256 bytes
// (the barriers.cuh state lives apart, in ThreadSync) on cache-line boundaries, so
// that those fields sit at the same place in a line for every fiber.
struct alignas(64) Fiber {
    cfemu_thread_ctx ctx;
    Context context;
    Launch* L;
    int tid, warp, lane;
    St state;
    Op op;
    bool spinning = false;  // its last yield was a false mbarrier_try_wait_parity
    int op_variant;
    unsigned op_mask;
    void* op_args;
    const void* op_pc;
    const char* bar_file;
    int bar_line;
    int bar_pred;    // __syncthreads_count/_and/_or: this thread's predicate
    int bar_result;  // ... and the block's count of true predicates
    uint32_t issued;  // cp.async copies issued (Copy::seq)
    std::vector<Copy> copies;  // issued, not yet performed (group == committed: uncommitted)
    uint32_t committed;
    // wgmma: fenced since the registers were last handed back, groups committed,
    // operations in flight; and fence.proxy.async calls so far.
    bool wg_fenced = false;
    uint32_t wg_committed = 0;
    // The thread's stack from its last wgmma.fence's caller up, as it was then:
    // the registers a wgmma reads must still hold those bytes (no write since).
    std::vector<char> wg_snap;
    uintptr_t wg_snap_lo = 0;
    const void* wg_fence_pc = nullptr;
    std::vector<WgmmaPending> wg_pending;
    uint32_t proxy_fences = 0;
};

// A thread's state for barriers.cuh (Launch::sync, by thread id): apart from the
// Fiber, whose fields the scheduler and the warp collectives read for many threads
// at a time (with these in it, 128 fibers no longer fit in a 32 KiB L1 cache).
struct ThreadSync {
    uint32_t fence_seq = 0;         // Launch::proxy_seq at the thread's last fence.proxy.async
    int nb_id = 0, nb_threads = 0;  // the named barrier it is at (St::NamedWarp, St::NamedBar)
    bool nb_sync = false;
    size_t mb_off = 0;              // the mbarrier it waits (St::MbarWait) or spins (Fiber::spinning) on
    uint32_t mb_parity = 0;
    // (barrier offset, phase) of its last false try_wait on that barrier, for the lapped check
    std::vector<std::pair<size_t, uint64_t>> mb_failed;
    std::vector<BulkOp> bulk;
    uint32_t bulk_committed = 0;
    uint32_t bulk_done = 0;         // its clock when its last bulk additions completed (0: none)
    uint64_t bulk_done_event = 0;   // ... and Launch::gevents then
    uint64_t global_fence = 0;      // Launch::gevents at its last fence_proxy_async_global
    const int* sem = nullptr;       // the semaphore it waits for (St::SemWait) and the value
    int sem_value = 0;
    uint32_t clock = 1;             // its own entry of its vector clock (modules with barriers.cuh)
    // With vector clocks: its clock at each fence.proxy.async of this block (the first at
    // index fence_base: Fiber::proxy_fences when the block started).
    std::vector<uint32_t> fence_clocks;
    uint32_t fence_base = 0;
};

// What one shared-memory byte remembers since the last __syncthreads().
struct Shadow {
    uint32_t w_epoch, r_epoch;  // barrier epoch of the last write / of the readers
    uint32_t w_wsync, r_wsync;  // the warp's __syncwarp count at the write / latest read
    uint32_t w_proxy;  // the writer's fence.proxy.async count at the write (agent writes: Launch::proxy_seq)
    uint16_t w_tid, r_first, r_second, pending;  // pending: issuing thread + 1 of an in-flight cp.async
    uint8_t r_many, r_mixed;                     // several readers / readers of several warps
    const void* w_pc;
    const void* r_pc;
};

// What a byte remembers for the vector clocks (modules with barriers.cuh, in an array
// beside the Shadow ones): the writer's clock at the write, r_first's at its latest
// read, and with several readers their (thread, clock) set (ReadSets).
struct ShadowClocks {
    uint32_t w_clock, r_clock, r_set;
};

// The reader sets of shared-memory bytes, interned: a set is a sorted list of
// (thread, clock at its latest read), one id per distinct list; id 0 is unused.
// Emptied at every __syncthreads() (a byte's set matters only within its epoch).
struct ReadSets {
    using Set = std::vector<std::pair<uint16_t, uint32_t>>;
    std::vector<Set> sets{Set{}};
    std::vector<std::vector<uint32_t>> buckets = std::vector<std::vector<uint32_t>>(4096);  // ids by hash
    // The last steps taken (direct-mapped): a thread reading a row meets the same set byte after byte.
    struct Step {
        uint32_t gen, from, clock, to;
        uint16_t tid;
    };
    std::vector<Step> steps = std::vector<Step>(4096, Step{0, 0, 0, 0, 0});
    uint32_t gen = 1;

    void clear() {
        ++gen;
        if (sets.size() == 1) return;
        for (size_t id = 1; id < sets.size(); ++id) buckets[hash(sets[id])].clear();
        sets.resize(1);
    }
    static size_t hash(const Set& s) {
        uint64_t h = 0xcbf29ce484222325ull;
        for (const auto& e : s) h = (h ^ (uint64_t(e.first) << 32 | e.second)) * 0x100000001b3ull;
        return static_cast<size_t>(h >> 52);
    }
    // The set `from` (0: the empty set) with thread `tid` having read at `clock`.
    uint32_t add(uint32_t from, uint16_t tid, uint32_t clock) {
        Step& e = steps[((from * 0x9e3779b1u) ^ (tid * 0x85ebca77u) ^ (clock * 0xc2b2ae3du)) >> 20];
        if (e.gen == gen && e.from == from && e.tid == tid && e.clock == clock) return e.to;
        Set s = sets[from];
        auto it = std::lower_bound(s.begin(), s.end(), std::make_pair(tid, uint32_t(0)));
        uint32_t to = from;
        if (it == s.end() || it->first != tid || it->second < clock) {
            if (it != s.end() && it->first == tid)
                it->second = clock;
            else
                s.insert(it, {tid, clock});
            std::vector<uint32_t>& bucket = buckets[hash(s)];
            to = 0;
            for (uint32_t id : bucket)
                if (sets[id] == s) to = id;
            if (!to) {
                to = static_cast<uint32_t>(sets.size());
                bucket.push_back(to);
                sets.push_back(std::move(s));
            }
        }
        e = Step{gen, from, clock, to, tid};
        return to;
    }
};

const char* op_name(Op op, int variant) {
    switch (op) {
        case Op::Syncwarp: return "__syncwarp()";
        case Op::Shfl: {
            static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
            return names[(variant >> 4) & 3];
        }
        case Op::Vote: {
            static const char* names[] = {"__all_sync", "__any_sync", "__ballot_sync"};
            return names[variant % 3];
        }
        case Op::Mma: {
            static const char* names[] = {"mma.sync.m16n8k16 (f16)", "mma.sync.m16n8k16 (bf16)",
                                          "mma.sync.m16n8k8 (tf32)", "mma.sync.m8n8k4 (f64)"};
            return names[variant % 4];
        }
        case Op::Wgmma:
            return (variant >> 1) & 1   ? "wgmma.mma_async (A from registers)"
                   : (variant >> 3) & 1 ? "wgmma.mma_async (A from shared memory, MN-major)"
                                        : "wgmma.mma_async (A from shared memory)";
        case Op::Ldmatrix: {
            static const char* names[] = {"ldmatrix.x1", "ldmatrix.x1.trans", "ldmatrix.x2", "ldmatrix.x2.trans",
                                          "ldmatrix.x4", "ldmatrix.x4.trans"};
            int num = variant >> 1, idx = (num == 1 ? 0 : num == 2 ? 1 : 2) * 2 + (variant & 1);
            return names[idx];
        }
        case Op::Setmaxnreg: return variant & 1 ? "setmaxnreg.inc.sync.aligned.u32" : "setmaxnreg.dec.sync.aligned.u32";
        case Op::None: break;
    }
    return "?";
}

// What Launch keeps of the block it runs (Launch::swap_block exchanges the two):
// a suspended block's state while another block runs, or a finished block's
// storage, spare for the next block to start.  Its fibers' stacks stay where
// they are (each BlockState has its own); the shared memory's bytes are copied,
// as the block's shared window stays at one address.
struct BlockState {
    std::vector<Fiber> fibers;
    char* stacks = nullptr;
    std::vector<char> smem;
    std::vector<Shadow> shadow;
    uint32_t epoch = 0;
    std::vector<uint32_t> wsync;
    std::vector<Mbar> mbars;
    NamedBar nbars[16];
    std::vector<AsyncArrival> arrivals;
    std::vector<uint32_t> agent_clock;
    std::vector<uint16_t> bulk_src_refs;
    std::vector<uint32_t> vcs;
    std::vector<ShadowClocks> shadow_clocks;
    ReadSets rsets;
    std::vector<ThreadSync> sync;
    std::vector<int> wg_regs;
    int64_t reg_pool = 0;
    std::vector<int> reg_waiting;
    unsigned at_setmaxnreg = 0;
    std::vector<int> run_now, run_next;
    unsigned live = 0, at_bar = 0, at_named = 0, at_sem = 0;
    int idle_rounds = 0;
    bool preempt = false;
    uint64_t last_acquire = 0;
    cfemu_xyz block{0, 0, 0};
};

struct Launch {
    // configuration
    const cfemu_launch_desc* desc;
    cfemu_thunk thunk;
    void* params = nullptr;
    std::string name;
    unsigned nthreads = 0, nwarps = 0;
    bool shuffle = false, race = false;
    int accum_mode = CFEMU_ACCUM_EXACT, accum_extra = 0;  // cfemu_launch_desc's accumulation model
    uint64_t rng = 0;

    // fibers and their stacks
    std::vector<Fiber> fibers;
    char* stacks = nullptr;
    size_t stack_bytes = 0, stacks_total = 0;

    // shared memory with red zones, and its shadow
    char* smem_alloc = nullptr;
    size_t smem_alloc_size = 0, redzone = 0;
    char* smem = nullptr;
    size_t smem_size = 0;
    uint32_t smem_window = 0;  // smem's shared-window address (cfemu_thread_ctx::smem_window)
    uintptr_t chk_lo = 0, chk_hi = 0;
    std::vector<Shadow> shadow;
    uint32_t epoch = 0;
    std::vector<uint32_t> wsync;

    // barriers.cuh
    uint32_t module_flags = 0;  // cfemu_module_flags of the kernel's module
    std::vector<Mbar> mbars;
    NamedBar nbars[16];
    std::vector<AsyncArrival> arrivals;
    std::vector<uint32_t> agent_clock;              // per thread: the clock of its copies' next arrival
    std::vector<uint16_t> bulk_src_refs;            // per shared byte: bulk reductions reading it (race check)
    uint32_t proxy_seq = 0;                         // fence.proxy.async calls so far
    uint64_t progress = 0;                          // runtime calls, less the false try_waits
    // Vector clocks: on when the module uses barriers.cuh and races are checked.
    // Entry u < nthreads: thread u; nthreads + t: thread t's copies landed through an mbarrier.
    bool hb = false;
    size_t nclocks = 0;
    std::vector<uint32_t> vcs;  // thread t's clock: vcs[t * nclocks, (t + 1) * nclocks)
    std::vector<ShadowClocks> shadow_clocks;
    ReadSets rsets;
    std::vector<ThreadSync> sync;  // per thread
    bool barriers = false;         // the module uses barriers.cuh
    std::vector<const void*> bar0_sites;  // the call sites of named_barrier_sync(0, all threads)

    // setmaxnreg: each warpgroup's per-thread register count, the CTA's pool,
    // the warpgroups waiting for it (in the order they got there) and the threads at a
    // setmaxnreg whose warpgroup has not all arrived.
    int reg_start = 0;
    std::vector<int> wg_regs;
    int64_t reg_pool = 0;
    std::vector<int> reg_waiting;
    unsigned at_setmaxnreg = 0;

    // scheduling
    Context sched;
    Fiber* cur = nullptr;
    std::vector<int> run_now, run_next;
    unsigned live = 0, at_bar = 0;
    unsigned at_named = 0;  // threads waiting for the rest of their warp at a named barrier (St::NamedWarp)
    unsigned at_sem = 0;    // threads waiting for a semaphore (St::SemWait)
    int idle_rounds = 0;    // rounds in a row in which every thread that ran only spun
    bool preempt = false;   // a post a suspended block waits for: suspend this block after the poster yields
    uint64_t last_acquire = 0;  // gevents at the block's last semaphore_wait that returned (0: none)
    cfemu_xyz block{0, 0, 0};

    // Blocks and semaphores (every field above from `fibers` on, but for the
    // configuration, is the running block's: BlockState).  Each semaphore's last
    // post: the poster's linear block index and the value.
    std::vector<std::unique_ptr<BlockState>> suspended, spare;
    std::vector<std::pair<char*, size_t>> stack_maps;  // every fiber-stack mapping, unmapped at the end
    struct SemPost {
        uint64_t block;
        int value;
    };
    std::unordered_map<const int*, SemPost> sem_posts;
    // Global-memory events that the proxy fence orders, counted (a semaphore acquired,
    // bulk additions completed, fence_proxy_async_global).
    uint64_t gevents = 0;

    bool failed = false;
    std::string err;

    // fault handling and the spin watchdog
    sigjmp_buf jmp;
    volatile bool jmp_armed = false;
    int fault_sig = 0;
    void* fault_addr = nullptr;
    void* fault_pc = nullptr;
    uint64_t steps = 0;  // instrumented accesses since the running thread was resumed

    ~Launch() {
        for (const auto& m : stack_maps) munmap(m.first, m.second);
        if (smem_alloc) munmap(smem_alloc, smem_alloc_size);
        std::free(params);
    }

    uint64_t next_random() {  // splitmix64
        uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    template <typename T>
    void shuffle_vec(std::vector<T>& v) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
    }

    std::string who(int tid) const {
        if (tid >= static_cast<int>(kAgentBase))
            return "the cp.async copies of " + who(tid - static_cast<int>(kAgentBase)) + " (landed through an mbarrier)";
        const Fiber& f = fibers[tid];
        return format("thread (%u,%u,%u) [warp %d, lane %d]", f.ctx.thread_idx.x, f.ctx.thread_idx.y,
                      f.ctx.thread_idx.z, f.warp, f.lane);
    }
    std::string where() const {
        return format("kernel `%s`, block (%u,%u,%u)", name.c_str(), block.x, block.y, block.z);
    }

    // Records the first error.  In a fiber, then switches to the scheduler for good.
    [[noreturn]] void fail(std::string msg) {
        if (!failed) {
            failed = true;
            err = where() + ": " + msg;
        }
        if (cur) {
            Fiber* f = cur;
            context_switch(f->context, sched);
        }
        abort();  // unreachable: a failed launch never resumes its fibers
    }
    // An error found by the scheduler itself (no fiber to abandon).
    void fail_sched(std::string msg) {
        if (!failed) {
            failed = true;
            err = where() + ": " + msg;
        }
    }

    void yield(Fiber* f) { context_switch(f->context, sched); }
    // A scheduling point at which f stays runnable (it runs again next round).
    void reschedule(Fiber* f) {
        run_next.push_back(f->tid);
        yield(f);
    }
    void make_runnable(Fiber& f) {
        f.state = St::Runnable;
        f.op = Op::None;
        run_next.push_back(f.tid);
    }

    // ---- shared-memory checks ----------------------------------------------

    [[noreturn]] void race_error(Fiber* f, size_t off, size_t n, size_t first, bool write, const char* kind,
                                 int other, const void* other_pc, const char* other_did, const void* pc,
                                 const char* via) {
        fail(format("shared-memory race (%s): %s %s byte %zu of dynamic shared memory%s (%zu-byte access at offset "
                    "%zu)%s, which %s %s%s since the last __syncthreads(); separate the two accesses with "
                    "__syncthreads() (or __syncwarp() within one warp%s)",
                    kind, who(f->tid).c_str(), write ? "writes" : "reads", off, via, n, first,
                    location(pc).c_str(), who(other).c_str(), other_did, location(other_pc).c_str(),
                    hb ? ", or a wait for the mbarrier phase or the named barrier the other access was released to"
                       : ""));
    }

    // ---- vector clocks (modules with barriers.cuh, race checking on) -------------

    size_t clock_index(unsigned u) const { return u < kAgentBase ? u : nthreads + (u - kAgentBase); }
    uint32_t* clock_of(int tid) { return &vcs[static_cast<size_t>(tid) * nclocks]; }
    // Whether f has seen entry u's clock reach c (u's access at clock c happens before f's now).
    bool ordered(const Fiber* f, unsigned u, uint32_t c) const {
        return vcs[static_cast<size_t>(f->tid) * nclocks + clock_index(u)] >= c;
    }
    // f's clock joins `into` (an arrival: f's accesses so far happen before whoever acquires it).
    void release(Fiber* f, std::vector<uint32_t>& into) {
        uint32_t* v = clock_of(f->tid);
        if (into.size() != nclocks) into.assign(nclocks, 0);
        for (size_t i = 0; i < nclocks; ++i) into[i] = std::max(into[i], v[i]);
        v[f->tid] = ++sync[f->tid].clock;
    }
    void acquire(Fiber* f, const std::vector<uint32_t>& from) {
        if (from.empty()) return;
        uint32_t* v = clock_of(f->tid);
        for (size_t i = 0; i < nclocks; ++i) v[i] = std::max(v[i], from[i]);
    }
    // Every earlier reader of byte s (other than f) happens before f; else `other` is one that does not.
    bool readers_ordered(const Fiber* f, const Shadow& s, const ShadowClocks& c, int& other) const {
        if (!s.r_many) {
            if (s.r_first == f->tid || ordered(f, s.r_first, c.r_clock)) return true;
            other = s.r_first;
            return false;
        }
        for (const auto& rc : rsets.sets[c.r_set])
            if (rc.first != f->tid && !ordered(f, rc.first, rc.second)) {
                other = rc.first;
                return false;
            }
        return true;
    }

    // An access by f to byte off of shared memory, whose Shadow::pending is set.
    [[noreturn]] void pending_error(Fiber* f, size_t off, bool write, const void* pc, const char* via,
                                    const Shadow& s) {
        const int tid = f->tid;
        if (s.pending == kPendMbar) {
            const Mbar* b = find_mbar(off & ~size_t(7));
            fail(format("%s %s byte %zu of shared memory%s%s, which belongs to the live mbarrier at shared offset "
                        "%zu (initialised%s): only mbarrier operations may access a barrier's 8 bytes until "
                        "mbarrier_inval",
                        who(tid).c_str(), write ? "writes" : "reads", off, via, location(pc).c_str(),
                        off & ~size_t(7), b ? location(b->init_pc).c_str() : ""));
        }
        if (s.pending == kPendBulk) {
            const void* issued = nullptr;
            for (const Fiber& g : fibers)
                for (const BulkOp& op : sync[g.tid].bulk)
                    if (!op.read_retired && off >= op.src_off && off < op.src_off + op.bytes) issued = op.pc;
            fail(format("%s writes byte %zu of shared memory%s%s, the source of a bulk reduction (cp.reduce.async.bulk, "
                        "issued%s) that may still be reading it: the issuing thread's bulk_wait_read must retire "
                        "it first",
                        who(tid).c_str(), off, via, location(pc).c_str(), location(issued).c_str()));
        }
        const int issuer = s.pending - 1;
        bool tracked = false;  // by a cp_async_mbarrier_arrive
        for (const Copy& c : fibers[issuer].copies)
            tracked = tracked || (c.arrival >= 0 && off >= static_cast<size_t>(c.dst - smem) &&
                                  off < static_cast<size_t>(c.dst - smem) + c.size);
        const char* lands = tracked ? "at the first wait that returns true for the mbarrier phase its "
                                      "cp_async_mbarrier_arrive completed"
                                    : "only after that thread's cp.async.wait_group and a __syncthreads()";
        if (issuer == tid)
            fail(format("%s %s byte %zu of shared memory%s%s while its own cp.async into it is still in "
                        "flight (issued%s); the copy lands %s",
                        who(tid).c_str(), write ? "writes" : "reads", off, via, location(pc).c_str(),
                        location(s.w_pc).c_str(), tracked ? lands : "at its cp.async.wait_group: wait for it first"));
        fail(format("shared-memory race (cp.async in flight): %s %s byte %zu of shared memory%s%s while %s "
                    "is still copying into it with cp.async (issued%s); the copy lands %s",
                    who(tid).c_str(), write ? "writes" : "reads", off, via, location(pc).c_str(),
                    who(issuer).c_str(), location(s.w_pc).c_str(), lands));
    }

    // A load or store of n bytes at address a by thread f (checked only when the
    // address is within the red zones around the block's shared memory).
    void access(Fiber* f, uintptr_t a, size_t n, bool write, const void* pc, const char* via) {
        if (hb)
            access_checked<true>(f, a, n, write, pc, via);
        else
            access_checked<false>(f, a, n, write, pc, via);
    }
    // kHb: with vector clocks (the module uses barriers.cuh), a separate instance so that
    // other modules run the loop they ran before.
    template <bool kHb>
    void access_checked(Fiber* f, uintptr_t a, size_t n, bool write, const void* pc, const char* via) {
        char* p = reinterpret_cast<char*>(a);
        if (p < smem || p + n > smem + smem_size) {
            long long off = static_cast<long long>(p - smem);
            fail(format("out-of-bounds shared-memory access: %s %s %zu byte(s) at offset %lld%s, outside the %zu "
                        "bytes of dynamic shared memory of this launch%s",
                        who(f->tid).c_str(), write ? "writes" : "reads", n, off, via, smem_size,
                        location(pc).c_str()));
        }
        const size_t first = static_cast<size_t>(p - smem);
        const int tid = f->tid, warp = f->warp;
        const uint32_t ws = wsync[warp];
        const uint32_t clock = kHb ? sync[tid].clock : 0;
        Shadow* s = &shadow[first];
        ShadowClocks* c = kHb ? &shadow_clocks[first] : nullptr;
        for (size_t i = 0; i < n; ++i, ++s, c += kHb) {
            // (several bulk reductions, and the thread's own loads, may read one source)
            if (s->pending && (write || s->pending != kPendBulk)) pending_error(f, first + i, write, pc, via, *s);
            // Unordered by __syncthreads() or __syncwarp(): with vector clocks, ordered by a barrier edge?
            if (s->w_epoch == epoch && s->w_tid != tid && !((s->w_tid >> 5) == warp && ws > s->w_wsync) &&
                !(kHb && ordered(f, s->w_tid, c->w_clock)))
                race_error(f, first + i, n, first, write, write ? "write-after-write" : "read-after-write",
                           s->w_tid, s->w_pc, "wrote", pc, via);
            if (write) {
                if (s->r_epoch == epoch) {
                    bool only_self = !s->r_many && s->r_first == tid;
                    bool warp_ordered = !s->r_mixed && (s->r_first >> 5) == warp && ws > s->r_wsync;
                    if (!only_self && !warp_ordered) {
                        int other = s->r_first != tid ? s->r_first : s->r_second;
                        if (!kHb || !readers_ordered(f, *s, *c, other))
                            race_error(f, first + i, n, first, true, "write-after-read", other,
                                       other == s->r_first ? s->r_pc : nullptr, "read", pc, via);
                    }
                }
                s->w_epoch = epoch;
                s->w_tid = static_cast<uint16_t>(tid);
                s->w_wsync = ws;
                s->w_pc = pc;
                s->w_proxy = f->proxy_fences;
                if (kHb) c->w_clock = clock;
                s->r_epoch = 0;
            } else if (s->r_epoch != epoch) {
                s->r_epoch = epoch;
                s->r_first = static_cast<uint16_t>(tid);
                s->r_many = 0;
                s->r_mixed = 0;
                s->r_wsync = ws;
                s->r_pc = pc;
                if (kHb) c->r_clock = clock;
            } else {
                if (s->r_first != tid && !s->r_many) {
                    s->r_many = 1;
                    s->r_second = static_cast<uint16_t>(tid);
                    if (kHb)
                        c->r_set = rsets.add(rsets.add(0, s->r_first, c->r_clock), static_cast<uint16_t>(tid), clock);
                } else if (kHb) {
                    if (s->r_many)
                        c->r_set = rsets.add(c->r_set, static_cast<uint16_t>(tid), clock);
                    else
                        c->r_clock = clock;
                }
                if ((s->r_first >> 5) != warp) s->r_mixed = 1;
                if (ws > s->r_wsync) s->r_wsync = ws;
            }
        }
    }

    // ---- barriers and warp collectives ----------------------------------------

    // Returns the number of live threads whose predicate is non-zero.  (A
    // named_barrier_sync(0, all threads) is one too: file kBar0, line an index into bar0_sites.)
    int syncthreads(Fiber* f, const char* file, int line, int pred) {
        if (nbars[0].count)
            fail(format("%s waits at %s while named barrier 0 is in use with %d threads (warp %d arrived%s): "
                        "barrier 0 is __syncthreads()' own, with all %u threads",
                        who(f->tid).c_str(), barrier_site(file, line).c_str(), nbars[0].count, nbars[0].first_warp,
                        location(nbars[0].first_pc).c_str(), nthreads));
        f->state = St::BlockBar;
        f->bar_file = file;
        f->bar_line = line;
        f->bar_pred = pred != 0;
        ++at_bar;
        yield(f);
        return f->bar_result;
    }

    std::string waiting_for(const Fiber& g) const {
        switch (g.state) {
            case St::Exited: return "have exited";
            case St::BlockBar: return "wait at " + barrier_site(g.bar_file, g.bar_line);
            case St::WarpOp: {
                if (g.op != Op::Setmaxnreg)
                    return format("wait at %s with mask 0x%08x%s", op_name(g.op, g.op_variant), g.op_mask,
                                  location(g.op_pc).c_str());
                const int first = (g.warp & ~3) * 32, end = std::min(first + 128, static_cast<int>(nthreads));
                int arrived = 0;
                for (int t = first; t < end; ++t)
                    arrived += fibers[t].state == St::WarpOp && fibers[t].op == Op::Setmaxnreg;
                return format("wait at %s%s for the rest of warpgroup %d (%d of its 128 threads arrived; the whole "
                              "warpgroup executes it)",
                              setmaxnreg_name(g.op_variant).c_str(), location(g.op_pc).c_str(), g.warp / 4, arrived);
            }
            case St::RegWait: {
                const int wg = g.warp / 4, regs = g.op_variant >> 1;
                return format("wait at %s%s for registers: warpgroup %d (warps %d-%d) needs %lld from the CTA's pool "
                              "(%d a thread, from %d to %d), which holds %lld",
                              setmaxnreg_name(g.op_variant).c_str(), location(g.op_pc).c_str(), wg, 4 * wg, 4 * wg + 3,
                              static_cast<long long>(regs - wg_regs[wg]) * 128, regs - wg_regs[wg], wg_regs[wg], regs,
                              static_cast<long long>(reg_pool));
            }
            case St::NamedWarp: {
                uint32_t lanes = 0;
                const int base = g.warp * 32;
                for (int l = 0; l < 32 && base + l < static_cast<int>(nthreads); ++l) {
                    const Fiber& h = fibers[base + l];
                    if (h.state == St::NamedWarp && sync[h.tid].nb_id == sync[g.tid].nb_id) lanes |= 1u << l;
                }
                return format("wait at %s(%d, %d)%s for the rest of warp %d (lanes %s of it arrived; a warp "
                              "arrives at a named barrier as a whole)",
                              sync[g.tid].nb_sync ? "named_barrier_sync" : "named_barrier_arrive", sync[g.tid].nb_id, sync[g.tid].nb_threads,
                              location(g.op_pc).c_str(), g.warp, ranges(lanes).c_str());
            }
            case St::NamedBar: {
                const NamedBar& nb = nbars[sync[g.tid].nb_id];
                return format("wait at named_barrier_sync(%d, %d)%s, where %d of %d threads arrived (warps %s)",
                              sync[g.tid].nb_id, sync[g.tid].nb_threads, location(g.op_pc).c_str(), nb.arrived, nb.count,
                              ranges(nb.warps).c_str());
            }
            case St::MbarWait:
                return format("wait at mbarrier_wait_parity(parity %u)%s, where %s", sync[g.tid].mb_parity,
                              location(g.op_pc).c_str(), mbar_state(sync[g.tid].mb_off).c_str());
            case St::SemWait:
                return format("wait at semaphore_wait(%p, %d)%s, which holds %d",
                              static_cast<const void*>(sync[g.tid].sem), sync[g.tid].sem_value,
                              location(g.op_pc).c_str(), sem_load(sync[g.tid].sem));
            case St::Runnable:
                if (g.spinning)
                    return format("spin in mbarrier_try_wait_parity(parity %u)%s, where %s", sync[g.tid].mb_parity,
                                  location(g.op_pc).c_str(), mbar_state(sync[g.tid].mb_off).c_str());
                return "are runnable";
        }
        return "?";
    }
    // "__syncthreads() (file:line)", or "named_barrier_sync(0, all threads) at file:line".
    std::string barrier_site(const char* file, int line) const {
        if (file == kBar0) return std::string(kBar0) + location(bar0_sites[line]);
        return format("__syncthreads() (%s:%d)", file, line);
    }
    // "0-15, 20" for the set bits of m.
    static std::string ranges(uint32_t m) {
        std::string out;
        for (int i = 0; i < 32;) {
            if (!((m >> i) & 1)) {
                ++i;
                continue;
            }
            int j = i;
            while (j + 1 < 32 && ((m >> (j + 1)) & 1)) ++j;
            out += (out.empty() ? "" : ", ") + (i == j ? format("%d", i) : format("%d-%d", i, j));
            i = j + 1;
        }
        return out.empty() ? "none" : out;
    }
    // "threads 0-31: wait at ...; threads 32-63: have exited"
    std::string describe_threads() const {
        std::string out;
        size_t i = 0;
        while (i < fibers.size()) {
            std::string what = waiting_for(fibers[i]);
            size_t j = i + 1;
            while (j < fibers.size() && waiting_for(fibers[j]) == what) ++j;
            if (!out.empty()) out += "; ";
            out += (j - i == 1 ? format("thread %zu", i) : format("threads %zu-%zu", i, j - 1)) + " " + what;
            i = j;
        }
        return out;
    }

    // f waits at a collective operation (warp or warpgroup) until it completes.
    void enter_collective(Fiber* f, Op op, int variant, unsigned mask, void* args, const void* pc) {
        f->state = St::WarpOp;
        f->op = op;
        f->op_variant = variant;
        f->op_mask = mask;
        f->op_args = args;
        f->op_pc = pc;
    }

    // Arrival of lane f at a warp-collective operation; completes it when every
    // lane of the mask has arrived.  Returns after the operation completed.
    void warp_op(Fiber* f, Op op, int variant, unsigned mask, void* args, const void* pc) {
        if (!((mask >> f->lane) & 1))
            fail(format("%s executes %s with mask 0x%08x, which does not name its own lane%s", who(f->tid).c_str(),
                        op_name(op, variant), mask, location(pc).c_str()));
        enter_collective(f, op, variant, mask, args, pc);
        const int base = f->warp * 32;
        bool complete = true;
        for (int l = 0; l < 32; ++l) {
            if (!((mask >> l) & 1)) continue;
            if (base + l >= static_cast<int>(nthreads))
                fail(format("%s executes %s with mask 0x%08x naming lane %d, which does not exist (the block has "
                            "%u threads)%s",
                            who(f->tid).c_str(), op_name(op, variant), mask, l, nthreads, location(pc).c_str()));
            const Fiber& g = fibers[base + l];
            if (g.state == St::Exited)
                fail(format("%s executes %s with mask 0x%08x, but lane %d of its warp has exited (a warp "
                            "collective needs every lane of its mask)%s",
                            who(f->tid).c_str(), op_name(op, variant), mask, l, location(pc).c_str()));
            if (g.state != St::WarpOp) {
                complete = false;
                continue;
            }
            bool waits_for_f = (g.op_mask >> f->lane) & 1;
            if (waits_for_f && (g.op != op || g.op_variant != variant || g.op_mask != mask))
                fail(format("divergent warp collective: %s executes %s with mask 0x%08x%s while lane %d of its "
                            "warp waits at %s with mask 0x%08x%s; every lane of the mask must execute the same "
                            "operation",
                            who(f->tid).c_str(), op_name(op, variant), mask, location(pc).c_str(), l,
                            op_name(g.op, g.op_variant), g.op_mask, location(g.op_pc).c_str()));
            // mma.sync and ldmatrix are .aligned: every lane must execute the same
            // instruction, not merely the same operation from another call site
            // (where the warp's lanes took different paths to it).
            if (waits_for_f && (op == Op::Mma || op == Op::Ldmatrix) && g.op_pc != pc)
                fail(format("divergent .aligned warp collective: %s executes %s%s while lane %d of its warp waits "
                            "at another %s%s; every lane must execute the same instruction",
                            who(f->tid).c_str(), op_name(op, variant), location(pc).c_str(), l,
                            op_name(g.op, g.op_variant), location(g.op_pc).c_str()));
            if (!waits_for_f) complete = false;
        }
        if (complete) {
            switch (op) {
                case Op::Syncwarp: finish_syncwarp(base, mask); break;
                case Op::Shfl: finish_shfl(base, mask, variant); break;
                case Op::Vote: finish_vote(base, mask, variant); break;
                case Op::Mma:
                    if (variant == CFEMU_MMA_F64)
                        finish_dmma(base);
                    else
                        finish_mma(base, variant);
                    break;
                case Op::Ldmatrix: finish_ldmatrix(base, variant); break;
                case Op::None: break;
            }
            for (int l = 0; l < 32; ++l)
                if ((mask >> l) & 1) make_runnable(fibers[base + l]);
        }
        yield(f);
    }

    void finish_syncwarp(int base, unsigned mask) {
        // Only a full-warp __syncwarp() orders shared-memory accesses for the race
        // check (a partial one synchronises its lanes but is not tracked) -- except
        // with vector clocks, where the lanes of the mask join their clocks.
        if (mask == kFullMask) ++wsync[base / 32];
        if (hb) {
            std::vector<uint32_t> joined(nclocks, 0);
            for (int l = 0; l < 32; ++l)
                if ((mask >> l) & 1) release(&fibers[base + l], joined);
            for (int l = 0; l < 32; ++l)
                if ((mask >> l) & 1) acquire(&fibers[base + l], joined);
        }
    }

    void finish_shfl(int base, unsigned mask, int variant) {
        const int mode = (variant >> 4) & 3;
        for (int l = 0; l < 32; ++l) {
            if (!((mask >> l) & 1)) continue;
            Fiber& f = fibers[base + l];
            auto* a = static_cast<ShflArgs*>(f.op_args);
            int w = a->width;
            if (w < 1 || w > 32 || (w & (w - 1)))
                fail(format("%s: %s with width %d (must be a power of two in 1..32)%s", who(f.tid).c_str(),
                            op_name(Op::Shfl, variant), w, location(f.op_pc).c_str()));
            // PTX shfl.sync: c = ((32 - width) << 8) | 0x1f (0 in the low bits for .up).
            const unsigned segmask = static_cast<unsigned>(32 - w) & 0x1f;
            const unsigned clamp = mode == CFEMU_SHFL_UP ? 0u : 0x1fu;
            const int max_lane = static_cast<int>((l & segmask) | (clamp & ~segmask));
            const int min_lane = static_cast<int>(l & segmask);
            const unsigned b = static_cast<unsigned>(a->lane_arg);
            int j;
            bool in_range;
            switch (mode) {
                case CFEMU_SHFL_IDX:
                    j = static_cast<int>(min_lane | (b & 0x1f & ~segmask));
                    in_range = j <= max_lane;
                    break;
                case CFEMU_SHFL_UP:
                    j = l - static_cast<int>(b);
                    in_range = j >= max_lane;
                    break;
                case CFEMU_SHFL_DOWN:
                    j = l + static_cast<int>(b);
                    in_range = j <= max_lane;
                    break;
                default:
                    j = l ^ static_cast<int>(b & 0x1f);
                    in_range = j <= max_lane;
                    break;
            }
            if (!in_range || j < 0 || j > 31) j = l;
            if (!((mask >> j) & 1))
                fail(format("%s: %s reads lane %d, which is not in the mask 0x%08x (its value is undefined)%s",
                            who(f.tid).c_str(), op_name(Op::Shfl, variant), j, mask, location(f.op_pc).c_str()));
            a->out = static_cast<ShflArgs*>(fibers[base + j].op_args)->in;
        }
    }

    void finish_vote(int base, unsigned mask, int mode) {
        unsigned ballot = 0;
        for (int l = 0; l < 32; ++l)
            if (((mask >> l) & 1) && static_cast<VoteArgs*>(fibers[base + l].op_args)->pred) ballot |= 1u << l;
        unsigned result = mode == CFEMU_VOTE_BALLOT ? ballot
                          : mode == CFEMU_VOTE_ALL  ? unsigned(ballot == mask)
                                                    : unsigned(ballot != 0);
        for (int l = 0; l < 32; ++l)
            if ((mask >> l) & 1) static_cast<VoteArgs*>(fibers[base + l].op_args)->out = result;
    }

    // One element of D: c plus k products, exact and rounded once to nearest
    // (CFEMU_ACCUM_EXACT), or as truncated_sum models the tensor cores.
    float accumulate(double c, const double* prod, int k) const {
        if (accum_mode == CFEMU_ACCUM_TRUNCATE) return truncated_sum(c, prod, k, accum_extra);
        double acc = c;
        for (int i = 0; i < k; ++i) acc += prod[i];
        return static_cast<float>(acc);
    }

    // D = A*B + C for one warp, fragments as in ptx-fragments.md sections 1 and 2.
    // Products are exact in double; accumulate() sums them.
    void finish_mma(int base, int kind) {
        double A[16][16], B[16][8], C[16][8];
        const int K = kind == CFEMU_MMA_TF32 ? 8 : 16;
        for (int l = 0; l < 32; ++l) {
            const auto* m = static_cast<MmaArgs*>(fibers[base + l].op_args);
            const int g = l >> 2, t = l & 3;
            if (kind == CFEMU_MMA_TF32) {
                A[g][t] = tf32_to_double(m->a[0]);
                A[g + 8][t] = tf32_to_double(m->a[1]);
                A[g][t + 4] = tf32_to_double(m->a[2]);
                A[g + 8][t + 4] = tf32_to_double(m->a[3]);
                B[t][g] = tf32_to_double(m->b[0]);
                B[t + 4][g] = tf32_to_double(m->b[1]);
            } else {
                auto cvt = kind == CFEMU_MMA_F16 ? half_to_double : bf16_to_double;
                for (int i = 0; i < 8; ++i) {
                    uint32_t h = (m->a[i >> 1] >> (16 * (i & 1))) & 0xffffu;
                    int row = g + ((i >> 1) & 1) * 8;         // a0,a1,a4,a5: g; a2,a3,a6,a7: g+8
                    int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
                    A[row][col] = cvt(h);
                }
                for (int i = 0; i < 4; ++i) {
                    uint32_t h = (m->b[i >> 1] >> (16 * (i & 1))) & 0xffffu;
                    int k = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
                    B[k][g] = cvt(h);
                }
            }
            C[g][2 * t] = m->c[0];
            C[g][2 * t + 1] = m->c[1];
            C[g + 8][2 * t] = m->c[2];
            C[g + 8][2 * t + 1] = m->c[3];
        }
        float D[16][8];
        for (int r = 0; r < 16; ++r)
            for (int n = 0; n < 8; ++n) {
                double prod[16];
                for (int k = 0; k < K; ++k) prod[k] = A[r][k] * B[k][n];
                D[r][n] = accumulate(C[r][n], prod, K);
            }
        for (int l = 0; l < 32; ++l) {
            auto* m = static_cast<MmaArgs*>(fibers[base + l].op_args);
            const int g = l >> 2, t = l & 3;
            m->d[0] = D[g][2 * t];
            m->d[1] = D[g][2 * t + 1];
            m->d[2] = D[g + 8][2 * t];
            m->d[3] = D[g + 8][2 * t + 1];
        }
    }

    // D = A*B + C, m8n8k4 in double (ptx-fragments.md section 3): a0 = A[g][t], b0 = B[t][g],
    // c0/c1 = C[g][2t], C[g][2t+1].  "Identical to .f64 fused multiply-add": each element as
    // four FMAs in k order (the hardware's order is not documented; every order is exact to
    // the rounding of an FMA chain).
    void finish_dmma(int base) {
        double A[8][4], B[4][8], C[8][8];
        for (int l = 0; l < 32; ++l) {
            const auto* m = static_cast<DmmaArgs*>(fibers[base + l].op_args);
            const int g = l >> 2, t = l & 3;
            A[g][t] = m->a[0];
            B[t][g] = m->b[0];
            C[g][2 * t] = m->c[0];
            C[g][2 * t + 1] = m->c[1];
        }
        double D[8][8];
        for (int r = 0; r < 8; ++r)
            for (int n = 0; n < 8; ++n) {
                double acc = C[r][n];
                for (int k = 0; k < 4; ++k) acc = std::fma(A[r][k], B[k][n], acc);
                D[r][n] = acc;
            }
        for (int l = 0; l < 32; ++l) {
            auto* m = static_cast<DmmaArgs*>(fibers[base + l].op_args);
            const int g = l >> 2, t = l & 3;
            m->d[0] = D[g][2 * t];
            m->d[1] = D[g][2 * t + 1];
        }
    }

    // ldmatrix: matrix i's row r is at the address of lane 8i + r; see ptx-fragments.md section 4.
    void finish_ldmatrix(int base, int variant) {
        const int num = variant >> 1;
        const bool trans = variant & 1;
        uint32_t out[32][4] = {};
        for (int i = 0; i < num; ++i)
            for (int r = 0; r < 8; ++r) {
                const Fiber& src = fibers[base + 8 * i + r];
                const char* row = static_cast<LdmArgs*>(src.op_args)->row;
                const char* what = op_name(Op::Ldmatrix, variant);
                if (row < smem || row + 16 > smem + smem_size)
                    fail(format("%s: %s row address (offset %lld) is outside the %zu bytes of dynamic shared "
                                "memory%s",
                                who(src.tid).c_str(), what, static_cast<long long>(row - smem), smem_size,
                                location(src.op_pc).c_str()));
                if ((row - smem) % 16)
                    fail(format("%s: %s row address (shared offset %lld) is not 16-byte aligned%s",
                                who(src.tid).c_str(), what, static_cast<long long>(row - smem),
                                location(src.op_pc).c_str()));
                for (int c = 0; c < 8; ++c) {
                    uint16_t e;
                    std::memcpy(&e, row + 2 * c, 2);
                    const int dst = trans ? 4 * c + r / 2 : 4 * r + c / 2;
                    const int half = trans ? (r & 1) : (c & 1);
                    out[dst][i] |= uint32_t(e) << (16 * half);
                    if (race)
                        access(&fibers[base + dst], reinterpret_cast<uintptr_t>(row + 2 * c), 2, false,
                               fibers[base + dst].op_pc, " in ldmatrix");
                }
            }
        for (int l = 0; l < 32; ++l) {
            uint32_t* d = static_cast<LdmArgs*>(fibers[base + l].op_args)->d;
            for (int i = 0; i < num; ++i) d[i] = out[l][i];
        }
    }

    // ---- wgmma (warpgroup matrix multiply, sm_90a) -------------------------------
    // wgmma.cuh describes the operand layouts and the ordering rules checked here.
    // The product is computed when the warpgroup's 128th thread arrives, from
    // the shared memory as it is then; each thread's operand registers must be
    // as its wgmma.fence left them, and its accumulators are poisoned (a
    // signalling NaN) until its wgmma.wait_group retires the group, which
    // checks that the A registers are unchanged, the accumulators still poison
    // (not written in flight) and -- at the first and the last retirement in
    // the warpgroup -- the shared memory read unchanged, writes the result back
    // and requires a new wgmma.fence before the thread's next wgmma.

    // wgmma.fence: the thread's registers are now ordered before its next wgmma.
    // The emulator cannot see registers, only the stack the kernel keeps them
    // in: it saves the caller's frames as they are (everything above this call),
    // so that the wgmma can tell whether its operands were written since.
    void wgmma_fence(Fiber* f, const void* frame, const void* pc) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(frame);
        const uintptr_t top = reinterpret_cast<uintptr_t>(stacks) + static_cast<uintptr_t>(f->tid + 1) * stack_bytes;
        f->wg_fenced = true;
        f->wg_fence_pc = pc;
        f->wg_snap_lo = lo;
        if (lo >= top || top - lo > stack_bytes) {  // not on the fiber's stack: no snapshot
            f->wg_snap.clear();
            return;
        }
        f->wg_snap.assign(reinterpret_cast<const char*>(lo), reinterpret_cast<const char*>(top));
    }

    // Keeps the fence's snapshot in step with what the runtime itself writes into
    // a thread's registers (the poison a wgmma leaves in its accumulators).
    void wgmma_snap_update(Fiber& f, const void* p, size_t n) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        if (!f.wg_fenced || a < f.wg_snap_lo || a + n > f.wg_snap_lo + f.wg_snap.size()) return;
        std::memcpy(f.wg_snap.data() + (a - f.wg_snap_lo), p, n);
    }

    // The operand registers [p, p + n) of a wgmma must not have been written
    // since the thread's wgmma.fence (PTX: the fence goes between a register's
    // write and the wgmma that reads it).
    void wgmma_check_since_fence(const Fiber* f, const void* p, size_t n, const char* regs, const char* what,
                                 const void* pc) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        const uintptr_t lo = f->wg_snap_lo, hi = lo + f->wg_snap.size();
        const uintptr_t base = reinterpret_cast<uintptr_t>(stacks) + static_cast<uintptr_t>(f->tid) * stack_bytes;
        if (f->wg_snap.empty()) return;
        if (a >= base && a < lo)
            fail(format("%s: the %s registers of %s%s live in a stack frame made after its wgmma.fence%s, so "
                        "they were written after it; the fence must come after the last write of a wgmma's "
                        "registers",
                        who(f->tid).c_str(), regs, what, location(pc).c_str(), location(f->wg_fence_pc).c_str()));
        if (a < lo || a + n > hi) return;
        const char* before = f->wg_snap.data() + (a - lo);
        const char* now = static_cast<const char*>(p);
        for (size_t i = 0; i < n; i += 4)
            if (std::memcmp(before + i, now + i, 4) != 0) {
                uint32_t was, is;
                std::memcpy(&was, before + i, 4);
                std::memcpy(&is, now + i, 4);
                fail(format("%s wrote %s register %zu (0x%08x, was 0x%08x) between its wgmma.fence%s and %s%s that "
                            "reads it; the fence must come after the last write of a wgmma's registers",
                            who(f->tid).c_str(), regs, i / 4, is, was, location(f->wg_fence_pc).c_str(), what,
                            location(pc).c_str()));
            }
    }

    void wgmma_op(Fiber* f, WgmmaArgs* args, const void* pc) {
        const int variant = (args->kind & 1) | ((args->a != nullptr) << 1) | ((args->trans_b & 1) << 2) |
                            ((args->trans_a & 1) << 3) | (args->n << 4);
        const char* what = op_name(Op::Wgmma, variant);
        if (!f->wg_fenced)
            fail(format("%s executes %s without a wgmma.fence since its last wgmma.wait_group (or the kernel "
                        "start): the accumulator and A registers may be stale%s",
                        who(f->tid).c_str(), what, location(pc).c_str()));
        if (args->n >= 8 && args->n <= 256) {
            wgmma_check_since_fence(f, args->d, static_cast<size_t>(args->n) * 2, "accumulator", what, pc);
            if (args->a) wgmma_check_since_fence(f, args->a, 16, "A", what, pc);
        }
        if (args->a && args->trans_a)
            fail(format("%s: %s with a transposed A from registers (only a shared-memory A may be MN-major)%s",
                        who(f->tid).c_str(), what, location(pc).c_str()));
        if (args->n < 8 || args->n > 256 || args->n % 8)
            fail(format("%s: %s with n = %d (must be a multiple of 8 in 8..256)%s", who(f->tid).c_str(), what,
                        args->n, location(pc).c_str()));
        const int first = (f->warp & ~3) * 32;
        if (first + 128 > static_cast<int>(nthreads))
            fail(format("%s executes %s, but its warpgroup (warps %d-%d) is incomplete: the block has %u threads%s",
                        who(f->tid).c_str(), what, f->warp & ~3, (f->warp & ~3) + 3, nthreads,
                        location(pc).c_str()));
        enter_collective(f, Op::Wgmma, variant, kFullMask, args, pc);
        bool complete = true;
        for (int t = first; t < first + 128; ++t) {
            const Fiber& g = fibers[t];
            if (g.state == St::Exited)
                fail(format("%s executes %s, but thread %d of its warpgroup has exited%s", who(f->tid).c_str(),
                            what, t, location(pc).c_str()));
            if (g.state != St::WarpOp) {
                complete = false;
                continue;
            }
            if (g.op != Op::Wgmma) {
                if ((t >> 5) == f->warp)
                    fail(format("divergent warp collective: %s executes %s%s while lane %d of its warp waits at "
                                "%s%s",
                                who(f->tid).c_str(), what, location(pc).c_str(), g.lane,
                                op_name(g.op, g.op_variant), location(g.op_pc).c_str()));
                complete = false;
                continue;
            }
            if (g.op_pc != pc)   // .sync.aligned: the same instruction in the whole warpgroup
                fail(format("divergent warpgroup: %s executes %s%s while thread %d of its warpgroup waits at "
                            "another %s%s; every thread of the warpgroup must execute the same wgmma "
                            "instruction",
                            who(f->tid).c_str(), what, location(pc).c_str(), t, op_name(g.op, g.op_variant),
                            location(g.op_pc).c_str()));
            const auto* o = static_cast<const WgmmaArgs*>(g.op_args);
            if (g.op_variant != variant || o->accumulate != args->accumulate || o->desc_b != args->desc_b ||
                (!args->a && o->desc_a != args->desc_a))
                fail(format("%s executes %s%s with operands that differ from those of thread %d at %s%s (shape, "
                            "type, descriptors and scale-d must be the same in the whole warpgroup)",
                            who(f->tid).c_str(), what, location(pc).c_str(), t, op_name(g.op, g.op_variant),
                            location(g.op_pc).c_str()));
        }
        if (complete) {
            finish_wgmma(first);
            for (int t = first; t < first + 128; ++t) make_runnable(fibers[t]);
        }
        yield(f);
    }

    // Byte offset in shared memory of element (row, k) of a 128-byte-swizzled
    // operand: row indexes M (A) or N (B).  K-major: 8-row groups SBO apart, k
    // along the 128-byte line; MN-major: 64-element lines, 64-wide blocks LBO
    // apart along M/N, 8-line groups SBO apart along K.  The swizzle XORs
    // address bits 4-6 with bits 7-9.
    size_t operand_offset(const Fiber& f, uint64_t desc, bool mn_major, int row, int k, const char* what,
                          const char* operand) {
        const uint64_t start = (desc & 0x3fffu) << 4, lbo = ((desc >> 16) & 0x3fffu) << 4,
                       sbo = ((desc >> 32) & 0x3fffu) << 4;
        const unsigned base_offset = static_cast<unsigned>((desc >> 49) & 7), layout = static_cast<unsigned>(desc >> 62);
        if (layout != 1 || base_offset != 0 || (start & 0x380))
            fail(format("%s: %s %s descriptor 0x%016llx: the emulator supports the 128-byte swizzle (layout 1) "
                        "with base offset 0, whose start must lie in the first 128 bytes of a 1024-byte aligned "
                        "block (got layout %u, base offset %u, start %llu)%s",
                        who(f.tid).c_str(), what, operand, static_cast<unsigned long long>(desc), layout, base_offset,
                        static_cast<unsigned long long>(start), location(f.op_pc).c_str()));
        // a: the element's shared-window address, swizzled by its own bits, as the
        // hardware does; its offset in the block's memory is a - smem_window.
        uint64_t a = mn_major ? start + (row / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (row % 64) * 2
                              : start + (row / 8) * sbo + (row % 8) * 128 + k * 2;
        a ^= ((a >> 7) & 7) << 4;
        if (a < smem_window || a - smem_window + 2 > smem_size)
            fail(format("%s: %s %s element (%d, k %d) at shared address %llu is outside the %zu bytes of dynamic "
                        "shared memory at address %u (descriptor 0x%016llx)%s",
                        who(f.tid).c_str(), what, operand, row, k, static_cast<unsigned long long>(a), smem_size,
                        smem_window, static_cast<unsigned long long>(desc), location(f.op_pc).c_str()));
        return static_cast<size_t>(a - smem_window);
    }

    // One element read by the tensor core: recorded for the retirement check;
    // with race checking, ordered after its write (barrier, and the writer's
    // fence.proxy.async after the write) and recorded as a read by `reader`.
    uint16_t wgmma_read(Fiber& reader, size_t off, WgmmaRead& rec, const char* what) {
        uint16_t e;
        std::memcpy(&e, smem + off, 2);
        rec.offsets.push_back(off);
        rec.bytes.push_back(smem[off]);
        rec.bytes.push_back(smem[off + 1]);
        if (race) {
            for (size_t i = off; i < off + 2; ++i) check_proxy_fence(reader, i, what, "the tensor core", reader.op_pc);
            access(&reader, reinterpret_cast<uintptr_t>(smem + off), 2, false, reader.op_pc, " in wgmma");
        }
        return e;
    }

    // The async proxy (a wgmma's operands, a bulk reduction's source) reads shared byte
    // `off` for `reader`: its last write must be followed by a fence.proxy.async of the
    // writer -- for copies landed through an mbarrier, of the issuing or the reading
    // thread after they landed.
    void check_proxy_fence(const Fiber& reader, size_t off, const char* what, const char* engine, const void* pc) {
        const Shadow& s = shadow[off];
        if (s.w_epoch == 0 || s.pending) return;
        if (s.w_tid >= kAgentBase) {
            if (sync[s.w_tid - kAgentBase].fence_seq > s.w_proxy || sync[reader.tid].fence_seq > s.w_proxy) return;
            fail(format("%s reads shared offset %zu, written by %s%s, and neither that thread nor %s ran a "
                        "fence.proxy.async after the copy landed: %s (async proxy) may not see it%s",
                        what, off, who(s.w_tid).c_str(), location(s.w_pc).c_str(), who(reader.tid).c_str(), engine,
                        location(pc).c_str()));
        }
        if (fibers[s.w_tid].proxy_fences <= s.w_proxy)
            fail(format("%s reads shared offset %zu, written by %s%s, which ran no fence.proxy.async "
                        "after that write: %s (async proxy) may not see it%s",
                        what, off, who(s.w_tid).c_str(), location(s.w_pc).c_str(), engine, location(pc).c_str()));
        // With vector clocks, the writer's first fence after the write must happen before
        // the read: fenced before the release the reader acquired, not merely by now.
        if (hb && s.w_epoch == epoch && s.w_tid != reader.tid) {
            const ThreadSync& ws = sync[s.w_tid];
            const size_t k = s.w_proxy - ws.fence_base;
            if (s.w_proxy >= ws.fence_base && k < ws.fence_clocks.size() &&
                !ordered(&reader, s.w_tid, ws.fence_clocks[k]))
                fail(format("%s reads shared offset %zu, written by %s%s, whose fence.proxy.async after that "
                            "write does not happen before the read (it came after the arrival or barrier that "
                            "ordered the write before %s): %s (async proxy) may not see it%s",
                            what, off, who(s.w_tid).c_str(), location(s.w_pc).c_str(), who(reader.tid).c_str(),
                            engine, location(pc).c_str()));
        }
    }

    void finish_wgmma(int first) {
        Fiber& f0 = fibers[first];
        const auto* args0 = static_cast<const WgmmaArgs*>(f0.op_args);
        const int N = args0->n;
        const bool a_regs = args0->a != nullptr, trans_b = args0->trans_b != 0, trans_a = args0->trans_a != 0;
        const char* what = op_name(Op::Wgmma, f0.op_variant);
        auto cvt = args0->kind == CFEMU_MMA_F16 ? half_to_double : bf16_to_double;
        auto rec = std::make_shared<WgmmaRead>();
        rec->pc = f0.op_pc;
        std::vector<double> A(64 * 16), B(16 * N), C(64 * N, 0.0);
        // A: rows 16w .. 16w + 15 belong to warp w (its lane 0 is the reader of record).
        for (int w = 0; w < 4; ++w) {
            Fiber& owner = fibers[first + 32 * w];
            for (int l = 0; l < 32; ++l) {
                const auto* m = static_cast<const WgmmaArgs*>(fibers[first + 32 * w + l].op_args);
                const int g = l >> 2, t = l & 3;
                if (a_regs) {
                    for (int i = 0; i < 8; ++i) {
                        const uint32_t h = (m->a[i >> 1] >> (16 * (i & 1))) & 0xffffu;
                        const int row = 16 * w + g + 8 * ((i >> 1) & 1), col = 2 * t + (i & 1) + 8 * (i >> 2);
                        A[row * 16 + col] = cvt(h);
                    }
                }
            }
            if (!a_regs)
                for (int r = 16 * w; r < 16 * w + 16; ++r)
                    for (int k = 0; k < 16; ++k) {
                        const size_t off = operand_offset(owner, args0->desc_a, trans_a, r, k, what, "A");
                        A[r * 16 + k] = cvt(wgmma_read(owner, off, *rec, what));
                        if (race) rec->a_off[w].push_back(off);
                    }
        }
        // B: read by every warp of the group (lane 0 of each is the reader of record).
        for (int n = 0; n < N; ++n)
            for (int k = 0; k < 16; ++k) {
                const size_t off = operand_offset(f0, args0->desc_b, trans_b, n, k, what, "B");
                B[k * N + n] = cvt(wgmma_read(f0, off, *rec, what));
                if (race) rec->b_off.push_back(off);
                if (race)
                    for (int w = 1; w < 4; ++w)
                        access(&fibers[first + 32 * w], reinterpret_cast<uintptr_t>(smem + off), 2, false,
                               f0.op_pc, " in wgmma");
            }
        // C: the thread's registers, or the result of its own wgmma in flight on them (a chain).
        const int cols = N / 4;
        std::vector<const float*> c_src(128);
        for (int i = 0; i < 128; ++i) {
            Fiber& f = fibers[first + i];
            const auto* m = static_cast<const WgmmaArgs*>(f.op_args);
            const float* src = m->d;
            for (const WgmmaPending& p : f.wg_pending)
                if (p.d == m->d) {
                    if (p.result.size() != static_cast<size_t>(N / 2))
                        fail(format("%s: %s chains onto a wgmma in flight with another n%s", who(f.tid).c_str(),
                                    what, location(f.op_pc).c_str()));
                    src = p.result.data();
                }
            c_src[i] = src;
            if (args0->accumulate) {
                const int w = i >> 5, g = (i & 31) >> 2, t = i & 3;
                for (int r = 0; r < 2; ++r)
                    for (int c = 0; c < cols; ++c)
                        C[(16 * w + 8 * r + g) * N + 8 * (c >> 1) + 2 * t + (c & 1)] = src[r * cols + c];
            }
        }
        std::vector<float> D(64 * N);
        for (int r = 0; r < 64; ++r)
            for (int n = 0; n < N; ++n) {
                double prod[16];
                for (int k = 0; k < 16; ++k) prod[k] = A[r * 16 + k] * B[k * N + n];
                D[r * N + n] = accumulate(C[r * N + n], prod, 16);
            }
        for (int i = 0; i < 128; ++i) {
            Fiber& f = fibers[first + i];
            auto* m = static_cast<WgmmaArgs*>(f.op_args);
            const int w = i >> 5, g = (i & 31) >> 2, t = i & 3;
            WgmmaPending p;
            p.group = f.wg_committed;
            p.d = m->d;
            p.result.resize(N / 2);
            for (int r = 0; r < 2; ++r)
                for (int c = 0; c < cols; ++c)
                    p.result[r * cols + c] = D[(16 * w + 8 * r + g) * N + 8 * (c >> 1) + 2 * t + (c & 1)];
            p.a = m->a;
            if (m->a) std::memcpy(p.a_copy, m->a, sizeof(p.a_copy));
            p.read = rec;
            p.pc = f.op_pc;
            f.wg_pending.push_back(std::move(p));
            for (int e = 0; e < N / 2; ++e)  // undefined until the group retires
                std::memcpy(&m->d[e], &kWgmmaPoison, 4);
            wgmma_snap_update(f, m->d, static_cast<size_t>(N) * 2);
        }
    }

    void wgmma_wait(Fiber* f, int n, const void* pc) {
        if (n < 0 || n > 7) fail(format("%s: wgmma.wait_group %d (must be 0..7)%s", who(f->tid).c_str(), n,
                                        location(pc).c_str()));
        const uint32_t limit = f->wg_committed > static_cast<uint32_t>(n) ? f->wg_committed - n : 0;
        std::vector<WgmmaPending>& q = f->wg_pending;
        bool retired = false;
        for (WgmmaPending& p : q) {
            if (p.group >= limit) continue;
            retired = true;
            if (p.a && std::memcmp(p.a, p.a_copy, sizeof(p.a_copy)) != 0)
                fail(format("%s changed the A registers of a wgmma (issued%s) before wgmma.wait_group retired it%s",
                            who(f->tid).c_str(), location(p.pc).c_str(), location(pc).c_str()));
            for (size_t e = 0; e < p.result.size(); ++e)
                if (std::memcmp(&p.d[e], &kWgmmaPoison, 4) != 0) {
                    uint32_t bits;
                    std::memcpy(&bits, &p.d[e], 4);
                    fail(format("%s wrote accumulator register %zu (now 0x%08x) of a wgmma (issued%s) while it was "
                                "in flight, before the wgmma.wait_group%s that retires it; its result would "
                                "overwrite that write",
                                who(f->tid).c_str(), e, bits, location(p.pc).c_str(), location(pc).c_str()));
                }
            // The tensor core may read the shared operands until the last thread of the
            // warpgroup retires the group: checked at the first retirement (the earliest
            // report) and at the last (a write in between, after some warps retired).
            const int nth = ++p.read->retired;
            // The reads last until the retirement: a warp's reader of record (lane 0)
            // reads its operands again now, so that a write to them must be ordered
            // after this wait (an arrival releasing the buffer before the wait is a race).
            if (race && f->lane == 0) {
                const int w = f->warp & 3;
                for (const std::vector<size_t>* offs : {&p.read->a_off[w], &p.read->b_off})
                    for (size_t off : *offs)
                        access(f, reinterpret_cast<uintptr_t>(smem + off), 2, false, p.pc,
                               " in wgmma (its reads last until the wgmma.wait_group that retires it)");
            }
            if (nth == 1 || nth == 128)
                for (size_t j = 0; j < p.read->offsets.size(); ++j) {
                    const size_t off = p.read->offsets[j];
                    if (smem[off] != p.read->bytes[2 * j] || smem[off + 1] != p.read->bytes[2 * j + 1])
                        fail(format("shared offset %zu, read by a wgmma (issued%s), was overwritten before the "
                                    "warpgroup's wgmma.wait_group retired it (found by %s%s, the %s of the "
                                    "warpgroup's 128 threads to retire it)",
                                    off, location(p.pc).c_str(), who(f->tid).c_str(), location(pc).c_str(),
                                    nth == 1 ? "first" : "last"));
                }
        }
        // The results land, except where a later wgmma of this thread on the same
        // accumulators (a chain) retires now too or is still in flight.
        for (size_t i = 0; i < q.size(); ++i) {
            if (q[i].group >= limit) continue;
            bool superseded = false;
            for (size_t j = i + 1; j < q.size(); ++j) superseded = superseded || q[j].d == q[i].d;
            if (!superseded) std::memcpy(q[i].d, q[i].result.data(), q[i].result.size() * sizeof(float));
        }
        q.erase(std::remove_if(q.begin(), q.end(), [limit](const WgmmaPending& p) { return p.group < limit; }),
                q.end());
        if (retired) f->wg_fenced = false;
    }

    // ---- cp.async --------------------------------------------------------------

    void cp_async(Fiber* f, char* dst, const char* src, int size, int src_bytes, const void* pc) {
        const char* what = size == 16 ? "cp.async (16 bytes)" : "cp.async (4 bytes)";
        if (dst < smem || dst + size > smem + smem_size)
            fail(format("%s: %s destination (shared offset %lld) is outside the %zu bytes of dynamic shared memory%s",
                        who(f->tid).c_str(), what, static_cast<long long>(dst - smem), smem_size,
                        location(pc).c_str()));
        if ((dst - smem) % size)
            fail(format("%s: %s destination (shared offset %lld) is not %d-byte aligned%s", who(f->tid).c_str(),
                        what, static_cast<long long>(dst - smem), size, location(pc).c_str()));
        if (reinterpret_cast<uintptr_t>(src) % size)
            fail(format("%s: %s source address %p is not %d-byte aligned%s", who(f->tid).c_str(), what,
                        static_cast<const void*>(src), size, location(pc).c_str()));
        if (src_bytes < 0 || src_bytes > size)
            fail(format("%s: %s with src_bytes = %d (must be 0..%d)%s", who(f->tid).c_str(), what, src_bytes, size,
                        location(pc).c_str()));
        if (race) {
            // The copy may land at any time from now on: it conflicts like a write.
            const size_t off = static_cast<size_t>(dst - smem);
            for (int i = 0; i < size; ++i) {
                Shadow& s = shadow[off + i];
                if (s.pending && s.pending < kPendBulk)  // (a barrier or a bulk source: access() says)
                    fail(format("%s: %s into shared offset %zu overlaps a cp.async of %s that is still in flight "
                                "(issued%s)%s",
                                who(f->tid).c_str(), what, off + i, who(s.pending - 1).c_str(),
                                location(s.w_pc).c_str(), location(pc).c_str()));
            }
            access(f, reinterpret_cast<uintptr_t>(dst), size, true, pc, " with cp.async");
            for (int i = 0; i < size; ++i) {
                Shadow& s = shadow[off + i];
                s.pending = static_cast<uint16_t>(f->tid + 1);
                s.w_pc = pc;
            }
        }
        f->copies.push_back(Copy{dst, src, size, src_bytes, f->committed, pc, f->issued++, -1});
    }

    // A copy tracked by a cp_async_mbarrier_arrive lands: an async-proxy write of its
    // issuing thread's agent, at the clock of the first arrival that tracked it.
    void land_tracked(const Copy& c, int tid) {
        if (race) {
            const size_t off = static_cast<size_t>(c.dst - smem);
            const uint32_t clock = arrivals[c.arrival].agent_clock;
            for (int k = 0; k < c.size; ++k) {
                Shadow& s = shadow[off + k];
                s.pending = 0;
                s.w_epoch = epoch;
                s.w_tid = static_cast<uint16_t>(kAgentBase + tid);
                s.w_wsync = 0;
                if (hb) shadow_clocks[off + k].w_clock = clock;
                s.w_pc = c.pc;
                s.w_proxy = proxy_seq;
                s.r_epoch = 0;
            }
        }
        if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
        std::memset(c.dst + c.src_bytes, 0, c.size - c.src_bytes);
    }

    // The copies arrival a tracks (its thread's, issued before it) land.
    void land_arrival(int a) {
        const AsyncArrival arr = arrivals[a];
        std::vector<Copy>& q = fibers[arr.tid].copies;
        size_t kept = 0;
        for (size_t i = 0; i < q.size(); ++i) {
            if (q[i].seq >= arr.seq) {
                q[kept++] = q[i];
                continue;
            }
            land_tracked(q[i], arr.tid);
        }
        q.resize(kept);
    }

    void cp_async_wait(Fiber* f, int n, const void* pc) {
        if (n < 0) fail(format("%s: cp.async.wait_group %d", who(f->tid).c_str(), n));
        const uint32_t limit = f->committed > static_cast<uint32_t>(n) ? f->committed - n : 0;
        size_t kept = 0;
        for (size_t i = 0; i < f->copies.size(); ++i) {
            Copy c = f->copies[i];
            if (c.group >= limit) {
                f->copies[kept++] = c;
                continue;
            }
            if (c.arrival >= 0) {  // tracked by an mbarrier too: its own wait orders it for this thread
                land_tracked(c, f->tid);
                if (hb) {
                    uint32_t& seen = clock_of(f->tid)[clock_index(kAgentBase + f->tid)];
                    seen = std::max(seen, arrivals[c.arrival].agent_clock);
                }
                continue;
            }
            if (race) {
                const size_t off = static_cast<size_t>(c.dst - smem);
                for (int k = 0; k < c.size; ++k) shadow[off + k].pending = 0;
                access(f, reinterpret_cast<uintptr_t>(c.dst), c.size, true, pc,
                       " when its cp.async lands (cp.async.wait_group)");
            }
            // The source is read now, when the copy lands.
            if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(c.dst + c.src_bytes, 0, c.size - c.src_bytes);
        }
        f->copies.resize(kept);
    }

    // ---- mbarriers (barriers.cuh) ------------------------------------------------
    // The model: PTX ISA "Parallel Synchronization and Communication Instructions:
    // mbarrier".  An arrival by a thread releases its clock into the current phase; a
    // wait that returns true for a phase acquires what its arrivals released and lands
    // the copies its cp_async_mbarrier_arrive arrivals track.

    Mbar* find_mbar(size_t off) {
        for (Mbar& b : mbars)
            if (b.off == off) return &b;
        return nullptr;
    }
    const Mbar* find_mbar(size_t off) const {
        for (const Mbar& b : mbars)
            if (b.off == off) return &b;
        return nullptr;
    }
    std::string mbar_state(size_t off) const {
        const Mbar* b = find_mbar(off);
        if (!b) return format("shared offset %zu holds no mbarrier", off);
        return format("the mbarrier at shared offset %zu is in phase %llu with %lld of %u arrivals pending and "
                      "tx-count %lld",
                      off, static_cast<unsigned long long>(b->phase), static_cast<long long>(b->pending),
                      b->expected, static_cast<long long>(b->tx));
    }

    // The shared offset of an mbarrier operand (in shared memory, 8-byte aligned).
    size_t mbar_offset(Fiber* f, const void* bar, const char* what, const void* pc) {
        const char* p = static_cast<const char*>(bar);
        if (p < smem || p + 8 > smem + smem_size)
            fail(format("%s: %s on address %p, which is not within the %zu bytes of dynamic shared memory (an "
                        "mbarrier is a uint64_t there)%s",
                        who(f->tid).c_str(), what, bar, smem_size, location(pc).c_str()));
        const size_t off = static_cast<size_t>(p - smem);
        if (off % 8)
            fail(format("%s: %s on shared offset %zu, which is not 8-byte aligned (an mbarrier is a uint64_t)%s",
                        who(f->tid).c_str(), what, off, location(pc).c_str()));
        return off;
    }

    // The live barrier at bar, whose initialisation f must see.
    Mbar& mbar_live(Fiber* f, const void* bar, const char* what, const void* pc) {
        const size_t off = mbar_offset(f, bar, what, pc);
        Mbar* b = find_mbar(off);
        if (!b || !b->live)
            fail(format("%s: %s on shared offset %zu, which holds no initialised mbarrier (%s)%s", who(f->tid).c_str(),
                        what, off,
                        b ? ("it was invalidated" + location(b->inval_pc)).c_str() : "mbarrier_init was never called on it",
                        location(pc).c_str()));
        if (race && f->tid != b->init_tid && b->init_epoch == epoch && !(hb && ordered(f, b->init_tid, b->init_clock)))
            fail(format("%s: %s on the mbarrier at shared offset %zu before its mbarrier_init by %s%s is visible to "
                        "it: a __syncthreads() must separate the initialisation from other threads' uses%s",
                        who(f->tid).c_str(), what, off, who(b->init_tid).c_str(), location(b->init_pc).c_str(),
                        location(pc).c_str()));
        return *b;
    }

    void mbar_init(Fiber* f, void* bar, uint32_t count, const void* pc) {
        const size_t off = mbar_offset(f, bar, "mbarrier_init", pc);
        if (count < 1 || count > kMbarMax)
            fail(format("%s: mbarrier_init on shared offset %zu with count %u (must be 1 .. 2^20 - 1)%s",
                        who(f->tid).c_str(), off, count, location(pc).c_str()));
        Mbar* b = find_mbar(off);
        if (b && b->live)
            fail(format("%s: mbarrier_init on shared offset %zu, which holds a live mbarrier (initialised by %s%s; "
                        "%s): mbarrier_inval it before initialising it again%s",
                        who(f->tid).c_str(), off, who(b->init_tid).c_str(), location(b->init_pc).c_str(),
                        mbar_state(off).c_str(), location(pc).c_str()));
        if (race) {  // the initialisation writes the barrier's memory; from now on only mbarrier operations may
            access(f, reinterpret_cast<uintptr_t>(smem + off), 8, true, pc, " (mbarrier_init)");
            for (size_t i = off; i < off + 8; ++i) shadow[i].pending = kPendMbar;
        }
        if (!b) {
            mbars.emplace_back();
            b = &mbars.back();
        }
        for (Fiber& g : fibers)  // false waits on a former barrier here say nothing about this one
            sync[g.tid].mb_failed.erase(std::remove_if(sync[g.tid].mb_failed.begin(), sync[g.tid].mb_failed.end(),
                                             [off](const std::pair<size_t, uint64_t>& e) { return e.first == off; }),
                              sync[g.tid].mb_failed.end());
        *b = Mbar{};
        b->off = off;
        b->live = true;
        b->expected = count;
        b->pending = count;
        b->init_tid = f->tid;
        b->init_clock = sync[f->tid].clock;
        b->init_epoch = epoch;
        b->init_pc = pc;
    }

    // The checks of an arrive-on, and its count.
    void mbar_arrive_on(Fiber* f, Mbar& b, const char* what, const void* pc) {
        if (b.phase > 0 && !b.waited_prev)
            fail(format("%s: %s on the mbarrier at shared offset %zu in phase %llu before any wait returned true "
                        "for phase %llu: a phase must be waited for before the next one's first arrival (PTX ISA, "
                        "\"Phase of the mbarrier object\"), or the phases of a fast and a slow thread mix%s",
                        who(f->tid).c_str(), what, b.off, static_cast<unsigned long long>(b.phase),
                        static_cast<unsigned long long>(b.phase - 1), location(pc).c_str()));
        if (b.pending <= 0)
            fail(format("%s: %s: more arrivals than pending -- %s (all %u arrivals of the phase are in; its "
                        "tx-count keeps it open)%s",
                        who(f->tid).c_str(), what, mbar_state(b.off).c_str(), b.expected, location(pc).c_str()));
        --b.pending;
    }

    void mbar_update(Fiber* f, void* bar, int kind, uint32_t tx, const void* pc) {
        static const char* const names[] = {"mbarrier_arrive", "mbarrier_arrive_expect_tx", "mbarrier_expect_tx",
                                            "mbarrier_complete_tx"};
        const char* what = names[kind & 3];
        Mbar& b = mbar_live(f, bar, what, pc);
        if (kind != CFEMU_MBAR_ARRIVE) {
            const int64_t now = kind == CFEMU_MBAR_COMPLETE_TX ? b.tx - int64_t(tx) : b.tx + int64_t(tx);
            if (tx > kMbarMax || now < -kMbarMax || now > kMbarMax)
                fail(format("%s: %s of %u bytes takes the tx-count of the mbarrier at shared offset %zu from %lld to "
                            "%lld, outside -(2^20 - 1) .. 2^20 - 1%s",
                            who(f->tid).c_str(), what, tx, b.off, static_cast<long long>(b.tx),
                            static_cast<long long>(now), location(pc).c_str()));
            b.tx = now;
        }
        if (kind == CFEMU_MBAR_ARRIVE || kind == CFEMU_MBAR_ARRIVE_EXPECT_TX) {
            mbar_arrive_on(f, b, what, pc);
            if (hb) release(f, b.vc_cur);
        }
        if (b.pending == 0 && b.tx == 0) mbar_complete(b);
    }

    void cp_async_mbar_arrive(Fiber* f, void* bar, const void* pc) {
        Mbar& b = mbar_live(f, bar, "cp_async_mbarrier_arrive", pc);
        mbar_arrive_on(f, b, "cp_async_mbarrier_arrive", pc);
        const int a = static_cast<int>(arrivals.size());
        arrivals.push_back(AsyncArrival{f->tid, f->issued, agent_clock[f->tid], b.off});
        for (Copy& c : f->copies)
            if (c.arrival < 0) c.arrival = a;
        if (hb) {  // it releases the copies (the async proxy's writes), not the thread's own accesses
            if (b.vc_cur.size() != nclocks) b.vc_cur.assign(nclocks, 0);
            uint32_t& e = b.vc_cur[clock_index(kAgentBase + f->tid)];
            e = std::max(e, agent_clock[f->tid]);
        }
        ++agent_clock[f->tid];
        b.arr_cur.push_back(a);
        if (b.pending == 0 && b.tx == 0) mbar_complete(b);
    }

    void mbar_complete(Mbar& b) {
        for (int a : b.arr_prev) land_arrival(a);  // never waited for: they land before being forgotten
        b.arr_prev.swap(b.arr_cur);
        b.arr_cur.clear();
        b.vc_prev.swap(b.vc_cur);
        std::fill(b.vc_cur.begin(), b.vc_cur.end(), 0u);
        ++b.phase;
        b.pending = b.expected;
        b.waited_prev = false;
        for (Fiber& g : fibers)
            if (g.state == St::MbarWait && sync[g.tid].mb_off == b.off) {
                mbar_waited(&g, b);
                make_runnable(g);
            }
    }

    // g's wait for b's completed phase returned true.
    void mbar_waited(Fiber* g, Mbar& b) {
        b.waited_prev = true;
        for (int a : b.arr_prev) land_arrival(a);
        b.arr_prev.clear();
        if (hb) acquire(g, b.vc_prev);
        auto& failed_waits = sync[g->tid].mb_failed;
        failed_waits.erase(std::remove_if(failed_waits.begin(), failed_waits.end(),
                                          [&](const std::pair<size_t, uint64_t>& e) { return e.first == b.off; }),
                           failed_waits.end());
    }

    // try_wait.parity (returns whether the phase of that parity completed) or, blocking,
    // a wait until it has.  Either is a scheduling point.
    int mbar_wait(Fiber* f, void* bar, uint32_t parity, bool blocking, const void* pc) {
        const char* what = blocking ? "mbarrier_wait_parity" : "mbarrier_try_wait_parity";
        Mbar& b = mbar_live(f, bar, what, pc);
        if (parity > 1)
            fail(format("%s: %s with parity %u (must be 0 or 1, the parity of the phase waited for)%s",
                        who(f->tid).c_str(), what, parity, location(pc).c_str()));
        for (const auto& e : sync[f->tid].mb_failed)
            if (e.first == b.off && (e.second & 1) == parity && b.phase >= e.second + 2)
                fail(format("%s: %s(parity %u) on the mbarrier at shared offset %zu: this thread's wait for phase "
                            "%llu returned false, and the barrier has since completed it and is now in phase %llu, "
                            "which parity %u names instead: the waiter was lapped (an arrival count too small, or "
                            "a thread that does not wait before arriving again)%s",
                            who(f->tid).c_str(), what, parity, b.off, static_cast<unsigned long long>(e.second),
                            static_cast<unsigned long long>(b.phase), parity, location(pc).c_str()));
        sync[f->tid].mb_off = b.off;
        sync[f->tid].mb_parity = parity;
        f->op_pc = pc;
        if ((b.phase & 1) != parity) {  // the phase just before the current one (none before phase 0)
            mbar_waited(f, b);
            reschedule(f);
            return 1;
        }
        if (blocking) {
            f->state = St::MbarWait;
            yield(f);  // mbar_complete releases it
            return 1;
        }
        bool seen = false;
        for (auto& e : sync[f->tid].mb_failed)
            if (e.first == b.off) {
                e.second = b.phase;
                seen = true;
            }
        if (!seen) sync[f->tid].mb_failed.emplace_back(b.off, b.phase);
        f->spinning = true;
        --progress;  // a false try_wait lets no other thread proceed
        reschedule(f);
        return 0;
    }

    void mbar_inval(Fiber* f, void* bar, const void* pc) {
        Mbar& b = mbar_live(f, bar, "mbarrier_inval", pc);
        for (const Fiber& g : fibers)
            if (g.state == St::MbarWait && sync[g.tid].mb_off == b.off)
                fail(format("%s: mbarrier_inval on the mbarrier at shared offset %zu while %s waits on it%s%s",
                            who(f->tid).c_str(), b.off, who(g.tid).c_str(), location(g.op_pc).c_str(),
                            location(pc).c_str()));
        for (int a : b.arr_prev) land_arrival(a);  // counted arrivals: their copies are complete
        for (int a : b.arr_cur) land_arrival(a);
        b.live = false;
        b.inval_pc = pc;
        if (race) {  // the memory is ordinary again, written now
            for (size_t i = b.off; i < b.off + 8; ++i) shadow[i].pending = 0;
            access(f, reinterpret_cast<uintptr_t>(smem + b.off), 8, true, pc, " (mbarrier_inval)");
        }
    }

    // ---- named barriers (bar.sync / bar.arrive) ------------------------------------
    // Each warp's non-exited lanes meet at the same instruction (PTX: "causes executing
    // thread to wait for all non-exited threads from its warp"); the warp then counts 32
    // threads and releases its lanes' clocks into the barrier; a sync-ing warp waits
    // until `threads` have arrived and acquires them.

    void named_barrier(Fiber* f, int id, int threads, bool wait, const void* pc) {
        const char* what = wait ? "named_barrier_sync" : "named_barrier_arrive";
        const int block_threads = static_cast<int>(nwarps) * 32;
        if (id < 0 || id > 15)
            fail(format("%s: %s(%d, %d): barrier id %d is outside 0..15%s", who(f->tid).c_str(), what, id, threads,
                        id, location(pc).c_str()));
        if (threads <= 0 || threads % 32 || threads > block_threads)
            fail(format("%s: %s(%d, %d): the thread count must be a positive multiple of 32 (warps arrive whole) and "
                        "at most the block's %d (%u warps)%s",
                        who(f->tid).c_str(), what, id, threads, block_threads, nwarps, location(pc).c_str()));
        if (id == 0 && wait && threads == block_threads) {  // bar.sync 0 of the whole block: __syncthreads()
            auto site = std::find(bar0_sites.begin(), bar0_sites.end(), pc);
            if (site == bar0_sites.end()) site = bar0_sites.insert(site, pc);
            syncthreads(f, kBar0, static_cast<int>(site - bar0_sites.begin()), 0);
            return;
        }
        if (id == 0 && at_bar)
            fail(format("%s: %s(0, %d)%s while threads wait at __syncthreads() (barrier 0 with all %d threads): %s",
                        who(f->tid).c_str(), what, threads, location(pc).c_str(), block_threads,
                        threads != block_threads ? "barrier 0 is used with two thread counts at once"
                                                 : "the emulator does not combine bar.arrive 0 with __syncthreads(); "
                                                   "use a barrier id from 1 to 15"));
        f->state = St::NamedWarp;
        ++at_named;
        sync[f->tid].nb_id = id;
        sync[f->tid].nb_threads = threads;
        sync[f->tid].nb_sync = wait;
        f->op_pc = pc;
        const int base = f->warp * 32;
        for (int l = 0; l < 32 && base + l < static_cast<int>(nthreads); ++l) {
            const Fiber& g = fibers[base + l];
            if (&g == f) continue;
            const bool other_bar = g.state == St::NamedWarp &&
                                   (sync[g.tid].nb_id != id || sync[g.tid].nb_threads != threads || sync[g.tid].nb_sync != wait || g.op_pc != pc);
            if (other_bar || g.state == St::WarpOp || g.state == St::BlockBar)
                fail(format("divergent named barrier: %s executes %s(%d, %d)%s while lane %d of its warp is "
                            "elsewhere (it would %s); a warp arrives at a named barrier as a whole, all its "
                            "non-exited lanes at the same bar instruction",
                            who(f->tid).c_str(), what, id, threads, location(pc).c_str(), l,
                            waiting_for(g).c_str()));
        }
        named_warp_arrival(f->warp);
        yield(f);
    }

    // When every non-exited lane of `warp` waits at its named barrier: the warp arrives.
    void named_warp_arrival(int warp) {
        const int base = warp * 32;
        const Fiber* lead = nullptr;
        for (int l = 0; l < 32 && base + l < static_cast<int>(nthreads); ++l) {
            const Fiber& g = fibers[base + l];
            if (g.state == St::Exited) continue;
            if (g.state != St::NamedWarp) return;
            if (!lead) lead = &g;
        }
        if (!lead) return;
        const int id = sync[lead->tid].nb_id, threads = sync[lead->tid].nb_threads;
        NamedBar& nb = nbars[id];
        const char* what = sync[lead->tid].nb_sync ? "named_barrier_sync" : "named_barrier_arrive";
        if (nb.count && nb.count != threads)
            fail(format("named barrier %d is used with two thread counts at once: warp %d arrives at %s(%d, %d)%s "
                        "while it waits for %d threads (warp %d arrived first%s)",
                        id, warp, what, id, threads, location(lead->op_pc).c_str(), nb.count, nb.first_warp,
                        location(nb.first_pc).c_str()));
        if ((nb.warps >> warp) & 1)
            fail(format("warp %d arrives twice at named barrier %d (%d threads) before it completes (%s%s; %d of %d "
                        "threads arrived, warps %s): a warp counts once per use, so its second arrival would count "
                        "towards the next one",
                        warp, id, threads, what, location(lead->op_pc).c_str(), nb.arrived, nb.count,
                        ranges(nb.warps).c_str()));
        if (!nb.count) {
            nb.count = threads;
            nb.first_pc = lead->op_pc;
            nb.first_warp = warp;
        }
        nb.warps |= 1u << warp;
        nb.arrived += 32;
        for (int l = 0; l < 32 && base + l < static_cast<int>(nthreads); ++l) {
            Fiber& g = fibers[base + l];
            if (g.state == St::Exited) continue;
            --at_named;
            if (hb) release(&g, nb.vc);
            if (sync[g.tid].nb_sync) {
                g.state = St::NamedBar;
                nb.waiters.push_back(g.tid);
            } else {
                make_runnable(g);
            }
        }
        if (nb.arrived == nb.count) {
            NamedBar done = std::move(nb);
            nb = NamedBar{};
            for (int t : done.waiters) {
                if (hb) acquire(&fibers[t], done.vc);
                make_runnable(fibers[t]);
            }
        }
    }

    // ---- bulk reductions (cp.reduce.async.bulk .add.f32, bulk groups) ---------------

    void bulk_reduce(Fiber* f, float* dst, const float* src, uint32_t bytes, const void* pc) {
        const char* what = "bulk_reduce_add_f32";
        const char* s = reinterpret_cast<const char*>(src);
        const char* d = reinterpret_cast<const char*>(dst);
        if (bytes == 0 || bytes % 16)
            fail(format("%s: %s of %u bytes (must be a positive multiple of 16)%s", who(f->tid).c_str(), what, bytes,
                        location(pc).c_str()));
        if (s < smem || s + bytes > smem + smem_size)
            fail(format("%s: %s source at %p (%u bytes) is not within the %zu bytes of dynamic shared memory%s",
                        who(f->tid).c_str(), what, static_cast<const void*>(s), bytes, smem_size,
                        location(pc).c_str()));
        const size_t off = static_cast<size_t>(s - smem);
        if (off % 16)
            fail(format("%s: %s source at shared offset %zu is not 16-byte aligned%s", who(f->tid).c_str(), what, off,
                        location(pc).c_str()));
        if (d + bytes > smem_alloc && d < smem_alloc + smem_alloc_size)
            fail(format("%s: %s destination %p is in shared memory: the reduction adds into global memory%s",
                        who(f->tid).c_str(), what, static_cast<const void*>(d), location(pc).c_str()));
        if (reinterpret_cast<uintptr_t>(d) % 16)
            fail(format("%s: %s destination address %p is not 16-byte aligned%s", who(f->tid).c_str(), what,
                        static_cast<const void*>(d), location(pc).c_str()));
        if (race) {
            access(f, reinterpret_cast<uintptr_t>(s), bytes, false, pc, " (the source of bulk_reduce_add_f32)");
            for (size_t i = off; i < off + bytes; ++i) check_proxy_fence(*f, i, what, "the bulk copy engine", pc);
            for (size_t i = off; i < off + bytes; ++i) {
                shadow[i].pending = kPendBulk;
                ++bulk_src_refs[i];
            }
        }
        if (last_acquire > sync[f->tid].global_fence)
            fail(format("%s: %s after the block acquired a semaphore, with no fence_proxy_async_global() by this "
                        "thread since: the acquire orders the generic proxy's accesses, not the async proxy's "
                        "reduction into the memory the post published%s",
                        who(f->tid).c_str(), what, location(pc).c_str()));
        BulkOp op{dst, off, bytes, sync[f->tid].bulk_committed, false, std::vector<float>(bytes / 4), pc};
        std::memcpy(op.values.data(), s, bytes);
        sync[f->tid].bulk.push_back(std::move(op));
    }

    // The group of op no longer reads its source, which must be as it was at the issue.
    void bulk_retire_read(Fiber* f, BulkOp& op, const void* pc) {
        const char* now = smem + op.src_off;
        const char* then = reinterpret_cast<const char*>(op.values.data());
        for (uint32_t i = 0; i < op.bytes; ++i)
            if (now[i] != then[i])
                fail(format("shared offset %zu, the source of a bulk reduction (issued%s), was overwritten before "
                            "bulk_wait_read retired it (found by %s%s)",
                            op.src_off + i, location(op.pc).c_str(), who(f->tid).c_str(), location(pc).c_str()));
        if (race)
            for (size_t i = op.src_off; i < op.src_off + op.bytes; ++i)
                if (--bulk_src_refs[i] == 0) shadow[i].pending = 0;
        op.read_retired = true;
    }

    // The additions of f's reductions of groups below `limit`, in a shuffled order
    // (reductions and elements) when shuffling; each element added atomically.
    void bulk_perform(Fiber* f, uint32_t limit) {
        if (sync[f->tid].bulk.empty()) return;
        std::vector<BulkOp> done, kept;
        for (BulkOp& op : sync[f->tid].bulk) (op.group < limit ? done : kept).push_back(std::move(op));
        sync[f->tid].bulk.swap(kept);
        if (shuffle) shuffle_vec(done);
        for (const BulkOp& op : done) {
            std::vector<uint32_t> order(op.values.size());
            for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
            if (shuffle) shuffle_vec(order);
            for (uint32_t i : order) {
                float* p = op.dst + i;
                float old, sum;
                __atomic_load(p, &old, __ATOMIC_SEQ_CST);
                do {
                    sum = old + op.values[i];
                } while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
            }
        }
    }

    void bulk_wait(Fiber* f, int n, bool read_only, const void* pc) {
        if (n < 0)
            fail(format("%s: cp.async.bulk.wait_group %d%s", who(f->tid).c_str(), n, location(pc).c_str()));
        const uint32_t limit = sync[f->tid].bulk_committed > static_cast<uint32_t>(n) ? sync[f->tid].bulk_committed - n : 0;
        for (BulkOp& op : sync[f->tid].bulk)
            if (op.group < limit && !op.read_retired) bulk_retire_read(f, op, pc);
        if (!read_only && !sync[f->tid].bulk.empty()) {
            const size_t before = sync[f->tid].bulk.size();
            bulk_perform(f, limit);
            if (sync[f->tid].bulk.size() < before) {
                sync[f->tid].bulk_done = sync[f->tid].clock;
                sync[f->tid].bulk_done_event = ++gevents;
            }
        }
    }

    // ---- setmaxnreg (register reallocation between warpgroups, sm_90a) -------------
    // PTX ISA, "setmaxnreg": the same instruction must be executed by all warps of a
    // warpgroup (.sync.aligned); the count is "in the range 24 to 256 (both inclusive)
    // and must be a multiple of 8"; before a .dec the warp's count "should be greater
    // than or equal to" the new one, before an .inc "less than or equal to" it
    // ("Otherwise, the behaviour is undefined") -- so an equal count is allowed either
    // way; "A pool of available registers is maintained per-CTA": a .dec releases the
    // warp's extra registers to it, an .inc "blocks the execution until enough
    // registers are available in the CTA's register pool".
    //
    // The pool starts empty (the ISA gives it no other registers) and exiting warps
    // give nothing back to it (the ISA does not say that they do), so a kernel that
    // counts on either deadlocks here.  What a warpgroup takes, another gave back, and
    // each warpgroup has one warp in each quarter of the register file: every
    // quarter holds at most what it held at launch, so an .inc past what a quarter
    // could hold beside the other warps' counts is one the pool never satisfies --
    // the deadlock report, no check of its own.  (The ISA also asks the warpgroup to
    // synchronise explicitly between two setmaxnreg; here they meet at each one anyway,
    // and a missing synchronisation is not reported.)

    // "setmaxnreg.inc.sync.aligned.u32 232" for an Op::Setmaxnreg variant.
    static std::string setmaxnreg_name(int variant) {
        return format("%s %d", op_name(Op::Setmaxnreg, variant), variant >> 1);
    }

    void setmaxnreg(Fiber* f, bool inc, int regs, const void* pc) {
        const std::string what = format("%s %d", op_name(Op::Setmaxnreg, inc), regs);
        // (wgmma.cuh's static_assert refuses such an immediate; the ABI takes any int)
        if (regs < 24 || regs > 256 || regs % 8)
            fail(format("%s executes %s%s: the count must be a multiple of 8 in 24..256", who(f->tid).c_str(),
                        what.c_str(), location(pc).c_str()));
        const int variant = (regs << 1) | (inc ? 1 : 0);
        const int wg = f->warp / 4, first = wg * 128;
        if (first + 128 > static_cast<int>(nthreads))
            fail(format("%s executes %s%s, but its warpgroup (warps %d-%d) is incomplete: the block has %u threads "
                        "(%u warps); setmaxnreg is executed by whole warpgroups",
                        who(f->tid).c_str(), what.c_str(), location(pc).c_str(), 4 * wg, 4 * wg + 3, nthreads,
                        nwarps));
        int arrived = 1;
        for (int t = first; t < std::min(first + 128, static_cast<int>(nthreads)); ++t) {
            const Fiber& g = fibers[t];
            if (&g == f) continue;
            if (g.state == St::Exited)
                fail(format("%s executes %s%s, but %s of its warpgroup has exited: every thread of warpgroup %d "
                            "must execute the same setmaxnreg",
                            who(f->tid).c_str(), what.c_str(), location(pc).c_str(), who(t).c_str(), wg));
            if (g.state == St::WarpOp && g.op == Op::Setmaxnreg) {
                if (g.op_variant != variant || g.op_pc != pc)
                    fail(format("divergent warpgroup: %s executes %s%s while %s of its warpgroup waits at %s%s "
                                "(%s); every thread of the warpgroup must execute the same setmaxnreg instruction",
                                who(f->tid).c_str(), what.c_str(), location(pc).c_str(), who(t).c_str(),
                                setmaxnreg_name(g.op_variant).c_str(), location(g.op_pc).c_str(),
                                (g.op_variant & 1) != inc       ? "another action"
                                : (g.op_variant >> 1) != regs ? "another count"
                                                                : "another call site"));
                ++arrived;
                continue;
            }
            // A lane of f's warp at a collective that waits for f: neither can complete.
            if (g.warp == f->warp && ((g.state == St::WarpOp && ((g.op_mask >> f->lane) & 1)) ||
                                      g.state == St::NamedWarp || g.state == St::BlockBar))
                fail(format("divergent warp: %s executes %s%s while lane %d of its warp is elsewhere (it would %s); "
                            "all lanes of a warp execute the same setmaxnreg",
                            who(f->tid).c_str(), what.c_str(), location(pc).c_str(), g.lane,
                            waiting_for(g).c_str()));
        }
        const int now = wg_regs[wg];
        if (!inc && regs > now)
            fail(format("%s executes %s%s, which would raise warpgroup %d's count of %d registers a thread: .dec may "
                        "only lower it (or keep it)",
                        who(f->tid).c_str(), what.c_str(), location(pc).c_str(), wg, now));
        if (inc && regs < now)
            fail(format("%s executes %s%s, which would lower warpgroup %d's count of %d registers a thread: .inc may "
                        "only raise it (or keep it)",
                        who(f->tid).c_str(), what.c_str(), location(pc).c_str(), wg, now));
        enter_collective(f, Op::Setmaxnreg, variant, kFullMask, nullptr, pc);
        ++at_setmaxnreg;
        if (arrived == 128) {
            at_setmaxnreg -= 128;
            if (!inc) {
                reg_pool += static_cast<int64_t>(now - regs) * 128;
                setmaxnreg_done(wg);
                for (size_t i = 0; i < reg_waiting.size();) {  // the waiting .inc calls the pool now satisfies
                    if (setmaxnreg_granted(reg_waiting[i]))
                        reg_waiting.erase(reg_waiting.begin() + static_cast<std::ptrdiff_t>(i));
                    else
                        ++i;
                }
            } else if (!setmaxnreg_granted(wg)) {
                for (int t = first; t < first + 128; ++t) fibers[t].state = St::RegWait;
                reg_waiting.push_back(wg);
            }
        }
        yield(f);
    }

    // The .inc of warpgroup wg, every thread of which is at it: takes its registers
    // from the pool if the pool holds them.
    bool setmaxnreg_granted(int wg) {
        const int64_t need = static_cast<int64_t>((fibers[wg * 128].op_variant >> 1) - wg_regs[wg]) * 128;
        if (reg_pool < need) return false;
        reg_pool -= need;
        setmaxnreg_done(wg);
        return true;
    }

    void setmaxnreg_done(int wg) {
        wg_regs[wg] = fibers[wg * 128].op_variant >> 1;
        for (int t = wg * 128; t < wg * 128 + 128; ++t) make_runnable(fibers[t]);
    }

    // ---- threads and blocks -------------------------------------------------

    void thread_exit(Fiber* f) {
        // Copies a cp_async_mbarrier_arrive tracks have had their arrival counted: they
        // land at a wait for its phase.  Any other copy must have been waited for.
        size_t untracked = 0, uncommitted = 0;
        const void* first_pc = nullptr;
        for (const Copy& c : f->copies)
            if (c.arrival < 0) {
                if (!untracked++) first_pc = c.pc;
                uncommitted += c.group == f->committed;
            }
        if (untracked)
            fail(format("%s exits with %zu cp.async cop%s never waited for (cp.async.wait_group) nor tracked by "
                        "cp_async_mbarrier_arrive (%zu not even committed); they never land (first issued%s)",
                        who(f->tid).c_str(), untracked, untracked == 1 ? "y" : "ies", uncommitted,
                        location(first_pc).c_str()));
        if (barriers) {
            for (const BulkOp& op : sync[f->tid].bulk)
                if (!op.read_retired)
                    fail(format("%s exits while a bulk reduction it issued%s may still read its shared-memory "
                                "source (offset %zu, %u bytes): retire it with bulk_wait_read first (the block's "
                                "shared memory is released once its threads have exited)",
                                who(f->tid).c_str(), location(op.pc).c_str(), op.src_off, op.bytes));
            if (!sync[f->tid].bulk.empty()) {
                sync[f->tid].bulk_done = sync[f->tid].clock;
                sync[f->tid].bulk_done_event = ++gevents;
            }
            bulk_perform(f, std::numeric_limits<uint32_t>::max());
        }
        if (!f->wg_pending.empty())
            fail(format("%s exits with %zu wgmma operation%s in flight (first issued%s); retire them with "
                        "wgmma.wait_group",
                        who(f->tid).c_str(), f->wg_pending.size(), f->wg_pending.size() == 1 ? "" : "s",
                        location(f->wg_pending.front().pc).c_str()));
        f->state = St::Exited;
        --live;
        const int base = f->warp * 32;
        for (int l = 0; l < 32 && base + l < static_cast<int>(nthreads); ++l) {
            const Fiber& g = fibers[base + l];
            if (g.state == St::WarpOp && ((g.op_mask >> f->lane) & 1))
                fail(format("%s exits while lane %d of its warp waits for it at %s with mask 0x%08x%s",
                            who(f->tid).c_str(), l, op_name(g.op, g.op_variant), g.op_mask,
                            location(g.op_pc).c_str()));
        }
        if (at_setmaxnreg && (f->warp & ~3) * 32 + 128 <= static_cast<int>(nthreads))
            for (int t = (f->warp & ~3) * 32; t < (f->warp & ~3) * 32 + 128; ++t) {
                const Fiber& g = fibers[t];
                if (g.state == St::WarpOp && g.op == Op::Setmaxnreg)
                    fail(format("%s exits while %s of its warpgroup waits for it at %s%s (every thread of the "
                                "warpgroup must execute the same setmaxnreg)",
                                who(f->tid).c_str(), who(t).c_str(), setmaxnreg_name(g.op_variant).c_str(),
                                location(g.op_pc).c_str()));
            }
        // A named barrier waits for the warp's non-exited lanes: this exit may complete the warp.
        if (at_named) named_warp_arrival(f->warp);
        yield(f);
        abort();  // an exited fiber is never resumed
    }

    static void fiber_main(void* arg) {
        Fiber* f = static_cast<Fiber*>(arg);
        Launch* L = f->L;
        L->thunk(L->params);
        L->thread_exit(f);
    }

    // Starts block `block` in the storage Launch holds (a finished block's, or fresh).
    void start_block() {
        for (Fiber& f : fibers) {
            f.ctx.block_idx = block;
            f.state = St::Runnable;
            f.op = Op::None;
            f.copies.clear();
            f.committed = 0;
            f.wg_fenced = false;
            f.wg_committed = 0;
            f.wg_pending.clear();  // proxy_fences keeps counting: shadow entries outlive a block
            f.spinning = false;
            f.issued = 0;
            if (barriers) {
                ThreadSync& ts = sync[f.tid];  // (fence_seq keeps counting, as proxy_fences)
                ts.bulk.clear();
                ts.bulk_committed = 0;
                ts.bulk_done = 0;
                ts.bulk_done_event = 0;
                ts.global_fence = 0;
                ts.sem = nullptr;
                ts.mb_failed.clear();
                ts.clock = 1;
                ts.fence_clocks.clear();
                ts.fence_base = f.proxy_fences;
            }
            context_init(f.context, stacks + static_cast<size_t>(f.tid) * stack_bytes + page_size(),
                         stack_bytes - page_size(), &Launch::fiber_main, &f);
        }
        std::memset(smem, 0xff, smem_size);
        ++epoch;
        if (barriers) {
            mbars.clear();
            for (NamedBar& nb : nbars) nb = NamedBar{};
            arrivals.clear();
            agent_clock.assign(nthreads, 1);
        }
        if (hb) {
            for (Shadow& s : shadow) s.pending = 0;  // barriers and copies the last block left
            std::fill(bulk_src_refs.begin(), bulk_src_refs.end(), uint16_t(0));
            rsets.clear();
            std::fill(vcs.begin(), vcs.end(), 0u);
            for (unsigned t = 0; t < nthreads; ++t) vcs[t * nclocks + t] = 1;
        }
        live = nthreads;
        at_bar = 0;
        at_named = 0;
        wg_regs.assign((nwarps + 3) / 4, reg_start);
        reg_pool = 0;
        reg_waiting.clear();
        at_setmaxnreg = 0;
        at_sem = 0;
        preempt = false;
        last_acquire = 0;
        run_next.clear();
        for (unsigned t = 0; t < nthreads; ++t) run_next.push_back(static_cast<int>(t));
        idle_rounds = 0;
    }

    enum class Ran { Done, Suspended, Failed };

    // Runs the block Launch holds until it ends, fails, or can only wait for
    // semaphores (or its poster was preempted): then it is to be suspended.
    Ran run_rounds() {
        for (;;) {
            if (run_next.empty()) {
                if (live == 0) return named_barriers_complete() ? Ran::Done : Ran::Failed;
                if (at_bar == live) {
                    if (!release_block_barrier()) return Ran::Failed;
                    continue;
                }
                if (at_sem > 0) {
                    if (wake_sem_waiters()) continue;
                    return Ran::Suspended;
                }
                fail_sched("deadlock: no thread can proceed (" + describe_threads() + ")");
                return Ran::Failed;
            }
            run_now.swap(run_next);
            run_next.clear();
            if (shuffle) shuffle_vec(run_now);
            const uint64_t progress_before = progress;
            bool all_spun = true;
            for (size_t i = 0; i < run_now.size(); ++i) {
                Fiber& f = fibers[run_now[i]];
                f.spinning = false;
                cur = &f;
                cfemu_current_ctx = &f.ctx;
                steps = 0;
                context_switch(sched, f.context);
                cur = nullptr;
                cfemu_current_ctx = nullptr;
                if (failed) return Ran::Failed;
                all_spun = all_spun && f.spinning;
                if (preempt) {  // the rest of the round runs when the block resumes
                    preempt = false;
                    run_next.insert(run_next.end(), run_now.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                    run_now.end());
                    return Ran::Suspended;
                }
            }
            // Threads that only fail mbarrier_try_wait_parity change nothing another thread
            // could see: if no other thread can run, they spin forever.
            idle_rounds = all_spun && progress == progress_before ? idle_rounds + 1 : 0;
            if (idle_rounds == kSpinRounds) {
                fail_sched("deadlock: no thread can proceed, the runnable ones only spin (" + describe_threads() +
                           ")");
                return Ran::Failed;
            }
        }
    }

    // ---- blocks and semaphores ------------------------------------------------------

    // Exchanges the running block's state with s (BlockState).
    void swap_block(BlockState& s) {
        fibers.swap(s.fibers);
        std::swap(stacks, s.stacks);
        if (s.smem.size() != smem_size) s.smem.assign(smem_size, static_cast<char>(0xff));
        std::swap_ranges(smem, smem + smem_size, s.smem.begin());
        shadow.swap(s.shadow);
        std::swap(epoch, s.epoch);
        wsync.swap(s.wsync);
        mbars.swap(s.mbars);
        for (int i = 0; i < 16; ++i) std::swap(nbars[i], s.nbars[i]);
        arrivals.swap(s.arrivals);
        agent_clock.swap(s.agent_clock);
        bulk_src_refs.swap(s.bulk_src_refs);
        vcs.swap(s.vcs);
        shadow_clocks.swap(s.shadow_clocks);
        std::swap(rsets, s.rsets);
        sync.swap(s.sync);
        wg_regs.swap(s.wg_regs);
        std::swap(reg_pool, s.reg_pool);
        reg_waiting.swap(s.reg_waiting);
        std::swap(at_setmaxnreg, s.at_setmaxnreg);
        run_now.swap(s.run_now);
        run_next.swap(s.run_next);
        std::swap(live, s.live);
        std::swap(at_bar, s.at_bar);
        std::swap(at_named, s.at_named);
        std::swap(at_sem, s.at_sem);
        std::swap(idle_rounds, s.idle_rounds);
        std::swap(preempt, s.preempt);
        std::swap(last_acquire, s.last_acquire);
        std::swap(block, s.block);
    }

    uint64_t linear(const cfemu_xyz& b) const {
        return b.x + uint64_t(desc->grid[0]) * (b.y + uint64_t(desc->grid[1]) * b.z);
    }
    static int sem_load(const int* sem) { return __atomic_load_n(sem, __ATOMIC_SEQ_CST); }
    // Whether thread f (of a block whose threads' barrier state is sync) waits for a
    // semaphore value that has been posted.
    static bool sem_arrived(const Fiber& f, const std::vector<ThreadSync>& sync) {
        return f.state == St::SemWait && sem_load(sync[f.tid].sem) == sync[f.tid].sem_value;
    }

    // Makes runnable the threads whose semaphore holds their value; how many.
    int wake_sem_waiters() {
        int woke = 0;
        for (Fiber& f : fibers)
            if (sem_arrived(f, sync)) {
                --at_sem;
                make_runnable(f);
                ++woke;
            }
        return woke;
    }
    // Whether suspended block s can run: a thread runnable, or a semaphore it waits for posted.
    static bool block_ready(const BlockState& s) {
        if (!s.run_next.empty()) return true;
        for (const Fiber& f : s.fibers)
            if (sem_arrived(f, s.sync)) return true;
        return false;
    }

    void check_semaphore(Fiber* f, const int* sem, const char* what, const void* pc) {
        if (!barriers) fail(format("%s: %s outside a module that includes barriers.cuh", who(f->tid).c_str(), what));
        const char* a = reinterpret_cast<const char*>(sem);
        if (reinterpret_cast<uintptr_t>(sem) % 4)
            fail(format("%s: %s on %p, not 4-byte aligned%s", who(f->tid).c_str(), what, static_cast<const void*>(a),
                        location(pc).c_str()));
        if ((a + 4 > smem_alloc && a < smem_alloc + smem_alloc_size) || on_stack(reinterpret_cast<uintptr_t>(a)))
            fail(format("%s: %s on %p, which is in shared memory or a thread's stack: a semaphore lives in global "
                        "memory%s",
                        who(f->tid).c_str(), what, static_cast<const void*>(a), location(pc).c_str()));
    }

    // The wait that returned: the value it saw must not come from a block after f's.
    void sem_acquired(Fiber* f, const int* sem, int value, const void* pc) {
        const auto post = sem_posts.find(sem);
        if (post != sem_posts.end() && post->second.value == value && post->second.block > linear(block)) {
            const uint64_t b = post->second.block, g0 = desc->grid[0], g1 = desc->grid[1];
            fail(format("%s: semaphore_wait(%p, %d)%s returned with the value posted by block (%llu,%llu,%llu), "
                        "which comes after this block in launch order: on a GPU that block may never start "
                        "while this one holds its SM (a block waits only for blocks before it)",
                        who(f->tid).c_str(), static_cast<const void*>(sem), value, location(pc).c_str(),
                        static_cast<unsigned long long>(b % g0), static_cast<unsigned long long>((b / g0) % g1),
                        static_cast<unsigned long long>(b / (g0 * g1))));
        }
    }

    void semaphore_wait(Fiber* f, const int* sem, int value, const void* pc) {
        check_semaphore(f, sem, "semaphore_wait", pc);
        if (sem_load(sem) != value) {
            sync[f->tid].sem = sem;
            sync[f->tid].sem_value = value;
            f->op_pc = pc;
            f->state = St::SemWait;
            ++at_sem;
            yield(f);  // wake_sem_waiters makes it runnable once the value is there
        }
        sem_acquired(f, sem, value, pc);
        last_acquire = ++gevents;
    }

    // fence.proxy.async.global: orders the thread's async-proxy and generic-proxy
    // global accesses (the bulk reductions; the semaphores) with each other.
    void fence_proxy_async_global(Fiber* f) { sync[f->tid].global_fence = ++gevents; }

    void semaphore_post(Fiber* f, int* sem, int value, const void* pc) {
        check_semaphore(f, sem, "semaphore_post", pc);
        for (const Fiber& g : fibers) {
            const ThreadSync& ts = sync[g.tid];
            if (!ts.bulk.empty())
                fail(format("%s: semaphore_post(%p, %d)%s while %s has %zu bulk reductions whose additions are not "
                            "complete (issued%s; bulk_wait<0>() completes them): a block that waits for this post "
                            "may add into the same memory before they land",
                            who(f->tid).c_str(), static_cast<void*>(sem), value, location(pc).c_str(),
                            who(g.tid).c_str(), ts.bulk.size(), location(ts.bulk.front().pc).c_str()));
            if (ts.bulk_done_event > ts.global_fence)
                fail(format("%s: semaphore_post(%p, %d)%s: %s completed bulk reductions and ran no "
                            "fence_proxy_async_global() after them: their writes, made by the async proxy, are "
                            "not published by a post",
                            who(f->tid).c_str(), static_cast<void*>(sem), value, location(pc).c_str(),
                            who(g.tid).c_str()));
            if (hb && ts.bulk_done && !ordered(f, g.tid, ts.bulk_done))
                fail(format("%s: semaphore_post(%p, %d)%s: the bulk reductions %s completed are not ordered before "
                            "the post (a __syncwarp() or barrier between that thread's bulk_wait and the post): a "
                            "block that waits for it may add before they land",
                            who(f->tid).c_str(), static_cast<void*>(sem), value, location(pc).c_str(),
                            who(g.tid).c_str()));
        }
        __atomic_store_n(sem, value, __ATOMIC_SEQ_CST);
        sem_posts[sem] = SemPost{linear(block), value};
        for (const auto& s : suspended)
            for (const Fiber& g : s->fibers)
                if (g.state == St::SemWait && s->sync[g.tid].sem == sem && s->sync[g.tid].sem_value == value)
                    preempt = true;
        if (preempt) reschedule(f);  // the waiter runs before this block goes on
    }

    // Every started block waits for a semaphore and none is left to start.
    void grid_deadlock() {
        std::string out;
        for (const auto& s : suspended) {
            out += format("%sblock (%u,%u,%u):", out.empty() ? "" : "; ", s->block.x, s->block.y, s->block.z);
            int listed = 0;
            for (const Fiber& g : s->fibers)
                if (g.state == St::SemWait && listed++ < 4)
                    out += format(" thread %d waits at semaphore_wait(%p, %d)%s, which holds %d", g.tid,
                                  static_cast<const void*>(s->sync[g.tid].sem), s->sync[g.tid].sem_value,
                                  location(g.op_pc).c_str(), sem_load(s->sync[g.tid].sem));
        }
        failed = true;
        err = format("kernel `%s`: deadlock: every started block waits for a semaphore and no block is left to "
                     "start (%s)",
                     name.c_str(), out.c_str());
    }

    // At the end of a block: a named barrier with arrivals and no completion is an
    // arrive nothing waited for (bar.arrive without its bar.sync): the protocol the
    // barrier serves is unbalanced, and a kernel that reused the barrier would hang
    // or pass early.
    bool named_barriers_complete() {
        for (int id = 0; id < 16; ++id) {
            const NamedBar& nb = nbars[id];
            if (nb.arrived > 0) {
                fail_sched(format("named barrier %d still has %d of its %d threads arrived when the block ends "
                                  "(first arrival%s): a bar.arrive no bar.sync completed",
                                  id, nb.arrived, nb.count, location(nb.first_pc).c_str()));
                return false;
            }
        }
        return true;
    }

    bool release_block_barrier() {
        const Fiber* first = nullptr;
        for (const Fiber& f : fibers) {
            if (f.state != St::BlockBar) continue;
            if (!first) {
                first = &f;
            } else if (f.bar_line != first->bar_line || std::strcmp(f.bar_file, first->bar_file) != 0) {
                fail_sched("threads wait at different __syncthreads() calls (a __syncthreads() in divergent "
                           "code): " + describe_threads());
                return false;
            }
        }
        int count = 0;
        for (const Fiber& f : fibers) count += f.state == St::BlockBar && f.bar_pred;
        ++epoch;
        if (hb) rsets.clear();  // reader sets of the past epoch are never consulted again
        at_bar = 0;
        for (Fiber& f : fibers)
            if (f.state == St::BlockBar) {
                f.bar_result = count;
                make_runnable(f);
            }
        return true;
    }

    bool on_stack(uintptr_t a) const {
        return a >= reinterpret_cast<uintptr_t>(stacks) && a < reinterpret_cast<uintptr_t>(stacks) + stacks_total;
    }

    [[noreturn]] void misaligned(uintptr_t a, size_t n, bool write, const void* pc) {
        char* p = reinterpret_cast<char*>(a);
        const std::string where = p >= smem && p < smem + smem_size
                                      ? format("shared offset %lld", static_cast<long long>(p - smem))
                                      : format("address %p", p);
        fail(format("misaligned access: %s %s %zu bytes at %s, which is not %zu-byte aligned%s; a GPU stops the "
                    "kernel there (misaligned address)",
                    who(cur->tid).c_str(), write ? "writes" : "reads", n, where.c_str(), n, location(pc).c_str()));
    }

    [[noreturn]] void spin_error(const void* pc) {
        fail(format("%s made 2^30 memory accesses without reaching __syncthreads(), a warp collective or its "
                    "end%s; emulated threads switch only there, so a spin-wait on another thread never ends",
                    who(cur->tid).c_str(), location(pc).c_str()));
    }

    // After a SIGSEGV/SIGBUS in thread `cur`.
    void describe_fault() {
        failed = true;
        const char* sig = fault_sig == SIGBUS ? "SIGBUS" : "SIGSEGV";
        if (!cur) {
            err = where() + format(": %s in the emulator outside any thread (address %p)", sig, fault_addr);
            return;
        }
        const char* lo = stacks + static_cast<size_t>(cur->tid) * stack_bytes;
        const char* a = static_cast<const char*>(fault_addr);
        if (a >= lo - page_size() && a < lo + page_size())
            err = where() + ": " + who(cur->tid) +
                  format(" overflowed its %zu KiB stack%s (pass a larger stack_bytes to EmulatorExecutor)",
                         (stack_bytes - page_size()) / 1024, location(fault_pc).c_str());
        else
            err = where() + ": " + who(cur->tid) +
                  format(" crashed with %s accessing address %p%s: an out-of-bounds or invalid global-memory "
                         "access (an illegal address on a GPU)",
                         sig, fault_addr, location(fault_pc).c_str());
    }

    static size_t page_size() {
        static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        return p;
    }

    bool setup(char* errbuf, uint64_t errlen) {
        const cfemu_launch_desc& d = *desc;
        name = d.kernel_name ? d.kernel_name : "?";
        shuffle = d.shuffle != 0;
        race = d.race_check != 0;
        accum_mode = d.accum_mode;
        accum_extra = d.accum_extra_bits;
        if ((accum_mode != CFEMU_ACCUM_EXACT && accum_mode != CFEMU_ACCUM_TRUNCATE) || accum_extra < 0 ||
            accum_extra > 20) {
            snprintf(errbuf, errlen, "kernel `%s`: accumulation mode %d with %d extra bits (modes 0, 1; 0..20 bits)",
                     name.c_str(), accum_mode, accum_extra);
            return false;
        }
        rng = d.seed ^ 0x5eedc0ffee123457ull;
        nthreads = d.block[0] * d.block[1] * d.block[2];
        nwarps = (nthreads + 31) / 32;
        // The registers a thread owns at launch, for setmaxnreg.  A kernel that uses it
        // is compiled for a fixed count ("launched with a valid value of maximum number
        // of per-thread registers", PTX ISA); the emulator takes the most a block of
        // this size can have at one block per SM.  An SM's 65536 registers are in four
        // quarters of 16384, warp w in quarter w % 4, so the busiest quarter holds
        // ceil(nwarps / 4) warps of 32 threads: 16384 / (32 * that), rounded down to
        // a multiple of 8 (registers are allocated 8 a thread at a time) -- 168 for
        // 288 or 384 threads, as ptxas gives __launch_bounds__(384, 1).  Up to 8 warps
        // that is 256 or more: ptxas's limit of 255 (R255 is the zero register), which
        // occupies 256, so the count starts at 256.
        reg_start = std::min(256, static_cast<int>(16384 / (32 * ((nwarps + 3) / 4))) / 8 * 8);
        const size_t ps = page_size();
        stack_bytes = ((std::max<uint64_t>(d.stack_bytes, 64 * 1024) + ps - 1) / ps) * ps + ps;  // + guard page
        stacks_total = stack_bytes * nthreads;

        smem_size = d.smem_bytes;
        redzone = std::max<size_t>(64 * 1024, ((smem_size + ps - 1) / ps) * ps);
        smem_alloc_size = 2 * redzone + ((smem_size + ps - 1) / ps) * ps;
        void* sm = mmap(nullptr, smem_alloc_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (sm == MAP_FAILED) {
            snprintf(errbuf, errlen, "kernel `%s`: cannot map shared memory", name.c_str());
            return false;
        }
        smem_alloc = static_cast<char*>(sm);
        smem = smem_alloc + redzone;
        smem_window = shuffle ? static_cast<uint32_t>(16 * (1 + next_random() % 63)) : 0;
        chk_lo = reinterpret_cast<uintptr_t>(smem_alloc);
        chk_hi = chk_lo + smem_alloc_size;
        barriers = module_flags & CFEMU_MODULE_BARRIERS;
        hb = race && barriers;
        if (hb) nclocks = 2 * static_cast<size_t>(nthreads);
        if (!init_storage()) {
            snprintf(errbuf, errlen, "%s", err.c_str());
            return false;
        }
        return true;
    }

    // A block's storage (BlockState's fields), sized for this launch: fiber stacks
    // (a mapping of their own, a guard page below each), the shadows, the threads'
    // barrier state and the fibers.
    bool init_storage() {
        const cfemu_launch_desc& d = *desc;
        const size_t ps = page_size();
        void* st = mmap(nullptr, stacks_total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
        if (st == MAP_FAILED) {
            failed = true;
            err = format("kernel `%s`: cannot map %zu bytes of fiber stacks", name.c_str(), stacks_total);
            return false;
        }
        stacks = static_cast<char*>(st);
        stack_maps.emplace_back(stacks, stacks_total);
        for (unsigned t = 0; t < nthreads; ++t) mprotect(stacks + static_cast<size_t>(t) * stack_bytes, ps, PROT_NONE);
        if (race) shadow.assign(smem_size, Shadow{});
        if (race) bulk_src_refs.assign(smem_size, 0);
        if (barriers) sync.assign(nthreads, ThreadSync{});
        wsync.assign(nwarps, 0);
        if (hb) {
            vcs.assign(nthreads * nclocks, 0);
            shadow_clocks.assign(smem_size, ShadowClocks{});
        }
        fibers = std::vector<Fiber>(nthreads);
        for (unsigned t = 0; t < nthreads; ++t) {
            Fiber& f = fibers[t];
            f.L = this;
            f.tid = static_cast<int>(t);
            f.warp = static_cast<int>(t / 32);
            f.lane = static_cast<int>(t % 32);
            f.ctx.thread_idx = cfemu_xyz{t % d.block[0], (t / d.block[0]) % d.block[1], t / (d.block[0] * d.block[1])};
            f.ctx.block_dim = cfemu_xyz{d.block[0], d.block[1], d.block[2]};
            f.ctx.grid_dim = cfemu_xyz{d.grid[0], d.grid[1], d.grid[2]};
            f.ctx.smem = smem;
            f.ctx.smem_window = smem_window;
        }
        return true;
    }
};

// The launch running on this OS thread, and the same when its module is
// instrumented (read by the memory-access hooks).
__thread Launch* t_launch = nullptr;
__thread Launch* t_check = nullptr;

inline Launch* current_launch(const char* api) {
    Launch* L = t_launch;
    if (!L || !L->cur) {
        fprintf(stderr, "cupyflash emulator: %s called outside an emulated kernel\n", api);
        abort();
    }
    ++L->progress;
    return L;
}

inline void check_access(uintptr_t a, size_t n, bool write, const void* pc) {
    Launch* L = t_check;
    if (!L) return;
    if (__builtin_expect(++L->steps > (uint64_t(1) << 30), 0)) L->spin_error(pc);
    // A GPU needs every global and shared access of 2, 4, 8 or 16 bytes naturally
    // aligned ("misaligned address", which ends the CUDA context); x86 does not.
    // Fiber stacks are left out: a GPU keeps such locals in registers.
    if (__builtin_expect((n & (n - 1)) == 0 && n > 1 && n <= 16 && (a & (n - 1)) != 0, 0) && !L->on_stack(a))
        L->misaligned(a, n, write, pc);
    if (a + n <= L->chk_lo || a >= L->chk_hi) return;
    L->access(L->cur, a, n, write, pc, "");
}

// ---- faults in kernel code ------------------------------------------------------

struct sigaction g_prev_segv, g_prev_bus;
std::once_flag g_fault_handlers_once;

void fault_handler(int sig, siginfo_t* si, void* uctx) {
    Launch* L = t_launch;
    if (L && L->jmp_armed) {
        L->jmp_armed = false;
        L->fault_sig = sig;
        L->fault_addr = si->si_addr;
#if defined(__x86_64__)
        L->fault_pc = reinterpret_cast<void*>(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
        L->fault_pc = reinterpret_cast<void*>(static_cast<ucontext_t*>(uctx)->uc_mcontext.pc);
#endif
        siglongjmp(L->jmp, 1);
    }
    // Not an emulated kernel: hand over to whoever handled it before us.
    const struct sigaction& prev = sig == SIGBUS ? g_prev_bus : g_prev_segv;
    if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction) {
        prev.sa_sigaction(sig, si, uctx);
    } else if (!(prev.sa_flags & SA_SIGINFO) && prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
        prev.sa_handler(sig);
    } else {
        signal(sig, SIG_DFL);  // the faulting instruction runs again and takes the default action
    }
}

void install_fault_handlers() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = &fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
}

bool run_grid(Launch& L, const std::vector<uint64_t>& order) __attribute__((noinline));
bool run_grid(Launch& L, const std::vector<uint64_t>& order) {
    const cfemu_launch_desc* d = L.desc;
    size_t next = 0;
    std::vector<size_t> ready;
    for (;;) {
        // A suspended block whose semaphore was posted, or the next block to start.
        ready.clear();
        for (size_t i = 0; i < L.suspended.size(); ++i)
            if (Launch::block_ready(*L.suspended[i])) ready.push_back(i);
        const bool can_start = next < order.size();
        if (ready.empty() && !can_start) {
            if (L.suspended.empty()) return true;
            L.grid_deadlock();
            return false;
        }
        size_t pick = 0;  // pick == ready.size(): start one (without shuffling: only when none is ready)
        if (L.shuffle) pick = L.next_random() % (ready.size() + (can_start ? 1 : 0));
        if (pick == ready.size()) {
            const uint64_t b = order[next++];
            L.block = cfemu_xyz{static_cast<unsigned>(b % d->grid[0]),
                                static_cast<unsigned>((b / d->grid[0]) % d->grid[1]),
                                static_cast<unsigned>(b / (uint64_t(d->grid[0]) * d->grid[1]))};
            L.start_block();
        } else {
            std::unique_ptr<BlockState> s = std::move(L.suspended[ready[pick]]);
            L.suspended.erase(L.suspended.begin() + static_cast<std::ptrdiff_t>(ready[pick]));
            L.swap_block(*s);  // s now holds the finished block's storage
            L.spare.push_back(std::move(s));
        }
        const Launch::Ran ran = L.run_rounds();
        if (ran == Launch::Ran::Failed) return false;
        if (ran == Launch::Ran::Suspended) {
            std::unique_ptr<BlockState> s;
            if (L.spare.empty()) {
                s = std::make_unique<BlockState>();
            } else {
                s = std::move(L.spare.back());
                L.spare.pop_back();
            }
            L.swap_block(*s);
            if (L.fibers.empty() && !L.init_storage()) return false;
            L.suspended.push_back(std::move(s));
        }
    }
}

// Runs the grid with faults turned into errors; false on any error.
bool run_guarded(Launch* L, const std::vector<uint64_t>& order) __attribute__((noinline));
bool run_guarded(Launch* L, const std::vector<uint64_t>& order) {
    if (sigsetjmp(L->jmp, 1)) {
        L->describe_fault();
        return false;
    }
    L->jmp_armed = true;
    const bool ok = run_grid(*L, order);
    L->jmp_armed = false;
    return ok;
}

}  // namespace

// ---------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------

CFEMU_API int cfemu_run(const cfemu_launch_desc* desc, cfemu_thunk thunk, uint64_t kernel_params_size,
                        uint64_t kernel_params_align, uint32_t module_flags, char* err, uint64_t errlen) {
    const char* name = desc->kernel_name ? desc->kernel_name : "?";
    if (desc->params_size != kernel_params_size || desc->params_align != kernel_params_align) {
        snprintf(err, errlen,
                 "kernel `%s`: the params struct passed has %llu bytes (alignment %llu) but the kernel's parameter "
                 "type has sizeof %llu (alignof %llu); build the NumPy dtype with the same fields in the same order "
                 "and align=True",
                 name, static_cast<unsigned long long>(desc->params_size),
                 static_cast<unsigned long long>(desc->params_align),
                 static_cast<unsigned long long>(kernel_params_size),
                 static_cast<unsigned long long>(kernel_params_align));
        return 1;
    }
    const uint64_t nthreads = uint64_t(desc->block[0]) * desc->block[1] * desc->block[2];
    if (nthreads == 0 || nthreads > 1024 || desc->grid[0] == 0 || desc->grid[1] == 0 || desc->grid[2] == 0) {
        snprintf(err, errlen, "kernel `%s`: bad launch configuration grid (%u,%u,%u) block (%u,%u,%u)", name,
                 desc->grid[0], desc->grid[1], desc->grid[2], desc->block[0], desc->block[1], desc->block[2]);
        return 1;
    }
    if (t_launch) {
        snprintf(err, errlen, "kernel `%s`: launched from inside an emulated kernel", name);
        return 1;
    }
    Launch L;
    L.desc = desc;
    L.thunk = thunk;
    L.module_flags = module_flags;
    if (!L.setup(err, errlen)) return 1;
    const size_t align = std::max<size_t>(16, kernel_params_align);
    const size_t psize = ((std::max<size_t>(kernel_params_size, 1) + align - 1) / align) * align;
    L.params = std::aligned_alloc(align, psize);
    std::memcpy(L.params, desc->params, kernel_params_size);

    const uint64_t nblocks = uint64_t(desc->grid[0]) * desc->grid[1] * desc->grid[2];
    std::vector<uint64_t> order(nblocks);
    for (uint64_t i = 0; i < nblocks; ++i) order[i] = i;
    if (L.shuffle) L.shuffle_vec(order);

    std::call_once(g_fault_handlers_once, install_fault_handlers);
    std::vector<char> alt_stack(256 * 1024);
    stack_t alt, previous_alt;
    alt.ss_sp = alt_stack.data();
    alt.ss_size = alt_stack.size();
    alt.ss_flags = 0;
    sigaltstack(&alt, &previous_alt);
    t_launch = &L;
    if (L.race) t_check = &L;
    const bool ok = run_guarded(&L, order);
    if (previous_alt.ss_flags & SS_DISABLE) {
        stack_t off;
        std::memset(&off, 0, sizeof off);
        off.ss_flags = SS_DISABLE;
        sigaltstack(&off, nullptr);
    } else {
        sigaltstack(&previous_alt, nullptr);
    }
    t_check = nullptr;
    t_launch = nullptr;
    cfemu_current_ctx = nullptr;
    if (!ok) {
        snprintf(err, errlen, "%s", L.err.c_str());
        return 1;
    }
    return 0;
}

CFEMU_API int cfemu_syncthreads(const char* file, int line, int pred) {
    Launch* L = current_launch("__syncthreads");
    return L->syncthreads(L->cur, file, line, pred);
}

CFEMU_API void cfemu_syncwarp(unsigned mask) {
    Launch* L = current_launch("__syncwarp");
    L->warp_op(L->cur, Op::Syncwarp, 0, mask, nullptr, __builtin_return_address(0));
}

CFEMU_API uint64_t cfemu_shfl(int mode, unsigned mask, uint64_t bits, int size, int lane_arg, int width) {
    Launch* L = current_launch("__shfl_*_sync");
    ShflArgs a{bits, 0, lane_arg, width};
    L->warp_op(L->cur, Op::Shfl, ((mode & 3) << 4) | (size & 15), mask, &a, __builtin_return_address(0));
    return a.out;
}

CFEMU_API unsigned cfemu_vote(int mode, unsigned mask, int pred) {
    Launch* L = current_launch("__vote_sync");
    VoteArgs a{pred != 0, 0};
    L->warp_op(L->cur, Op::Vote, mode, mask, &a, __builtin_return_address(0));
    return a.out;
}

CFEMU_API void cfemu_mma(int kind, float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    Launch* L = current_launch("mma");
    MmaArgs m{d, a, b, c};
    L->warp_op(L->cur, Op::Mma, kind, kFullMask, &m, __builtin_return_address(0));
}

CFEMU_API void cfemu_mma_f64(double* d, const double* a, const double* b, const double* c) {
    Launch* L = current_launch("mma");
    DmmaArgs m{d, a, b, c};
    L->warp_op(L->cur, Op::Mma, CFEMU_MMA_F64, kFullMask, &m, __builtin_return_address(0));
}

CFEMU_API void cfemu_ldmatrix(int num, int trans, uint32_t* d, const void* row) {
    Launch* L = current_launch("ldmatrix");
    LdmArgs m{d, static_cast<const char*>(row)};
    L->warp_op(L->cur, Op::Ldmatrix, (num << 1) | (trans ? 1 : 0), kFullMask, &m,
               __builtin_return_address(0));
}

CFEMU_API void cfemu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, int src_bytes) {
    Launch* L = current_launch("cp.async");
    L->cp_async(L->cur, static_cast<char*>(smem_dst), static_cast<const char*>(gmem_src), cp_size, src_bytes,
                __builtin_return_address(0));
}

CFEMU_API void cfemu_cp_async_commit(void) {
    Launch* L = current_launch("cp.async.commit_group");
    ++L->cur->committed;
}

CFEMU_API void cfemu_cp_async_wait(int n) {
    Launch* L = current_launch("cp.async.wait_group");
    L->cp_async_wait(L->cur, n, __builtin_return_address(0));
}

CFEMU_API void cfemu_wgmma(int kind, int n, float* d, const uint32_t* a, uint64_t desc_a, uint64_t desc_b,
                           int trans, int accumulate) {
    Launch* L = current_launch("wgmma.mma_async");
    WgmmaArgs w{kind, n, (trans & 1) != 0, accumulate != 0, d, a, desc_a, desc_b, (trans & 2) != 0};
    L->wgmma_op(L->cur, &w, __builtin_return_address(0));
}

CFEMU_API void cfemu_wgmma_fence(void) {
    Launch* L = current_launch("wgmma.fence");
    L->wgmma_fence(L->cur, __builtin_frame_address(0), __builtin_return_address(0));
}

CFEMU_API void cfemu_wgmma_commit(void) {
    Launch* L = current_launch("wgmma.commit_group");
    ++L->cur->wg_committed;
}

CFEMU_API void cfemu_wgmma_wait(int n) {
    Launch* L = current_launch("wgmma.wait_group");
    L->wgmma_wait(L->cur, n, __builtin_return_address(0));
}

CFEMU_API void cfemu_fence_proxy_async(void) {
    Launch* L = current_launch("fence.proxy.async");
    ++L->cur->proxy_fences;
    if (L->barriers) {
        ThreadSync& ts = L->sync[L->cur->tid];
        ts.fence_seq = ++L->proxy_seq;
        if (L->hb) ts.fence_clocks.push_back(ts.clock);
    }
}

CFEMU_API void cfemu_setmaxnreg(int inc, int count) {
    Launch* L = current_launch(inc ? "setmaxnreg.inc" : "setmaxnreg.dec");
    L->setmaxnreg(L->cur, inc != 0, count, __builtin_return_address(0));
}

CFEMU_API void cfemu_mbar_init(void* bar, uint32_t count) {
    Launch* L = current_launch("mbarrier_init");
    L->mbar_init(L->cur, bar, count, __builtin_return_address(0));
}

CFEMU_API void cfemu_mbar_arrive(void* bar, int kind, uint32_t tx) {
    Launch* L = current_launch("mbarrier_arrive");
    L->mbar_update(L->cur, bar, kind, tx, __builtin_return_address(0));
}

CFEMU_API int cfemu_mbar_wait(void* bar, uint32_t parity, int blocking) {
    Launch* L = current_launch("mbarrier_try_wait_parity");
    return L->mbar_wait(L->cur, bar, parity, blocking != 0, __builtin_return_address(0));
}

CFEMU_API void cfemu_cp_async_mbar_arrive(void* bar) {
    Launch* L = current_launch("cp_async_mbarrier_arrive");
    L->cp_async_mbar_arrive(L->cur, bar, __builtin_return_address(0));
}

CFEMU_API void cfemu_mbar_inval(void* bar) {
    Launch* L = current_launch("mbarrier_inval");
    L->mbar_inval(L->cur, bar, __builtin_return_address(0));
}

CFEMU_API void cfemu_named_barrier(int id, int threads, int sync) {
    Launch* L = current_launch("named_barrier_sync");
    L->named_barrier(L->cur, id, threads, sync != 0, __builtin_return_address(0));
}

CFEMU_API void cfemu_bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
    Launch* L = current_launch("bulk_reduce_add_f32");
    L->bulk_reduce(L->cur, gmem_dst, smem_src, bytes, __builtin_return_address(0));
}

CFEMU_API void cfemu_bulk_commit(void) {
    Launch* L = current_launch("bulk_commit");
    ++L->sync[L->cur->tid].bulk_committed;
}

CFEMU_API void cfemu_bulk_wait(int n, int read_only) {
    Launch* L = current_launch("bulk_wait");
    L->bulk_wait(L->cur, n, read_only != 0, __builtin_return_address(0));
}

CFEMU_API void cfemu_semaphore_wait(const int* sem, int value) {
    Launch* L = current_launch("semaphore_wait");
    L->semaphore_wait(L->cur, sem, value, __builtin_return_address(0));
}

CFEMU_API void cfemu_semaphore_post(int* sem, int value) {
    Launch* L = current_launch("semaphore_post");
    L->semaphore_post(L->cur, sem, value, __builtin_return_address(0));
}

CFEMU_API void cfemu_fence_proxy_async_global(void) {
    Launch* L = current_launch("fence_proxy_async_global");
    if (!L->barriers) L->fail("fence_proxy_async_global outside a module that includes barriers.cuh");
    L->fence_proxy_async_global(L->cur);
}

CFEMU_API void cfemu_trap(const char* what, const char* file, int line) {
    Launch* L = current_launch("__trap");
    L->fail(format("%s: %s at %s:%d", L->who(L->cur->tid).c_str(), what, file, line));
}

// ---------------------------------------------------------------------------
// Memory-access hooks: the kernel module is compiled with -fsanitize=kernel-address
// and outlined instrumentation, so GCC calls these around every load and store.
// ---------------------------------------------------------------------------
#define CFEMU_HOOK(kind, n, write)                                                              \
    CFEMU_API void __asan_##kind##n##_noabort(uintptr_t a) {                                    \
        check_access(a, n, write, __builtin_return_address(0));                                \
    }                                                                                           \
    CFEMU_API void __asan_##kind##n(uintptr_t a) { check_access(a, n, write, __builtin_return_address(0)); }
CFEMU_HOOK(load, 1, false)
CFEMU_HOOK(load, 2, false)
CFEMU_HOOK(load, 4, false)
CFEMU_HOOK(load, 8, false)
CFEMU_HOOK(load, 16, false)
CFEMU_HOOK(store, 1, true)
CFEMU_HOOK(store, 2, true)
CFEMU_HOOK(store, 4, true)
CFEMU_HOOK(store, 8, true)
CFEMU_HOOK(store, 16, true)
#undef CFEMU_HOOK
CFEMU_API void __asan_loadN_noabort(uintptr_t a, size_t n) { check_access(a, n, false, __builtin_return_address(0)); }
CFEMU_API void __asan_storeN_noabort(uintptr_t a, size_t n) { check_access(a, n, true, __builtin_return_address(0)); }
CFEMU_API void __asan_loadN(uintptr_t a, size_t n) { check_access(a, n, false, __builtin_return_address(0)); }
CFEMU_API void __asan_storeN(uintptr_t a, size_t n) { check_access(a, n, true, __builtin_return_address(0)); }
CFEMU_API void __asan_handle_no_return(void) {}
