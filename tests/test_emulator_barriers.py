"""cuda_src/barriers.cuh: mbarriers, named barriers and bulk reductions, real and emulated.

- The real header compiles with NVRTC (every wrapper for sm_90a and sm_90, the sm_80
  subset for sm_80), is the third and last header with inline PTX, and its emulated
  twin has the same functions.
- An mbarrier model written here from the PTX ISA's text (phase, pending count,
  tx-count, the rules of "Phase of the mbarrier object"), independent of the
  emulator, is driven by random op scripts; ``emulator_planted/barriers_planted.cu``'s
  ``mbar_script`` runs each script and must agree wait for wait, error for error.
- Correct use passes and matches NumPy exactly (integer data): a cp.async pipeline of
  one producer warp and two consumer warpgroups over full/empty barriers, a hand-off
  with plain stores, a ping-pong of two warpgroups over named barriers, per-block
  partial sums reduce-added into global memory.
- Every check trips on a planted kernel, naming the violation and the file:line.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.emulator import EmulatorError, EmulatorExecutor, emulator_available

from _emulator_util import planted_executors, planted_params

OK, WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not OK, reason=f"CPU emulator unavailable: {WHY}")

HERE = Path(__file__).resolve().parent
PLANTED = str(HERE / "emulator_planted" / "barriers_planted.cu")
AT_LINE = r"\S*barriers_planted\.cu:\d+"

MBAR_FAULTS = 19
KERNELS = (["mbar_script"] + [f"mbar_fault<{k}>" for k in range(MBAR_FAULTS)]
           + [f"mbar_pipeline<{k}>" for k in range(5)] + [f"mbar_handoff<{k}>" for k in range(3)]
           + [f"named_pingpong<{k}>" for k in range(3)] + [f"named_fault<{k}>" for k in range(11)]
           + [f"bulk_sum<{k}>" for k in range(11)])


ex, ex_plain, ex_ordered = planted_executors(PLANTED, KERNELS)


def _executor(**kw):
    """Another seed (shuffled)."""
    e = EmulatorExecutor(arch=90, seed=kw.pop("seed", 3), **kw)
    e.compile(PLANTED, KERNELS)
    return e


def run(executor, name, threads, smem, inp=None, *, n=0, arg=0, grid=1, out=None):
    inp = np.zeros(16, np.float32) if inp is None else inp
    out = np.full(1024, np.nan, np.float32) if out is None else out
    ticket = np.zeros(256, np.int32)
    executor.launch(PLANTED, name, grid, threads, smem, planted_params(inp, out, ticket, n, arg))
    return out, ticket


# ---- the real header ------------------------------------------------------------------------

_DEVICE_FUNCTION = re.compile(
    r"((?:template\s*<[^>]*>\s*)?)__device__\s+__forceinline__\s+([^({;]*?)\s*\b(\w+)\s*\((.*?)\)\s*\{", re.DOTALL
)


def _device_functions(path):
    return {m.group(3): tuple(" ".join(m.group(i).split()) for i in (1, 2, 4))
            for m in _DEVICE_FUNCTION.finditer(path.read_text())}


def test_emulated_barriers_header_twins_every_function_of_the_real_one():
    from cupyflash._source import cuda_src_dir
    from cupyflash.emulator._build import INCLUDE_DIR, SUBSTITUTIONS

    real = _device_functions(cuda_src_dir() / "barriers.cuh")
    assert set(real) == {
        "mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx", "mbarrier_expect_tx",
        "mbarrier_complete_tx", "mbarrier_try_wait_parity", "mbarrier_wait_parity", "cp_async_mbarrier_arrive",
        "mbarrier_inval", "named_barrier_sync", "named_barrier_arrive", "bulk_reduce_add_f32", "bulk_commit",
        "bulk_wait_read", "bulk_wait", "fence_proxy_async_global", "semaphore_wait", "semaphore_post"}
    assert real == _device_functions(INCLUDE_DIR / "barriers.cuh")
    assert SUBSTITUTIONS["barriers.cuh"] == INCLUDE_DIR / "barriers.cuh"


def test_only_the_three_ptx_headers_contain_inline_assembly():
    from cupyflash._source import cuda_src_dir

    asm = re.compile(r"\basm\s*(volatile\s*)?\(")
    with_asm = {p.name for p in cuda_src_dir().iterdir() if p.is_file() and asm.search(p.read_text())}
    assert with_asm == {"ptx.cuh", "wgmma.cuh", "barriers.cuh"}


_EVERY_WRAPPER = r'''
#include "barriers.cuh"
extern "C" __global__ void uses_barriers(float* g) {
    uint64_t* bar = reinterpret_cast<uint64_t*>(cf::dynamic_smem());
    float* s = reinterpret_cast<float*>(cf::dynamic_smem() + 64);
    if (threadIdx.x == 0) cf::mbarrier_init(bar, 2);
    __syncthreads();
    cf::mbarrier_arrive(bar);
    cf::cp_async_16(s + 4 * threadIdx.x, g, 16);
    cf::cp_async_mbarrier_arrive(bar);
    const bool done = cf::mbarrier_try_wait_parity(bar, 0);
    cf::mbarrier_wait_parity(bar, done ? 1u : 0u);
    cf::named_barrier_sync(1, 64);
    cf::named_barrier_arrive(2, 64);
#if SM90
    cf::mbarrier_arrive_expect_tx(bar, 16);
    cf::mbarrier_expect_tx(bar, 16);
    cf::mbarrier_complete_tx(bar, 32);
    cf::bulk_reduce_add_f32(g, s, 64);
    cf::bulk_commit();
    cf::bulk_wait_read<0>();
    cf::bulk_wait<0>();
#endif
    cf::mbarrier_inval(bar);
}
'''


@pytest.mark.parametrize("target, sm90", [("sm_90a", 1), ("sm_90", 1), ("sm_80", 0)])
def test_the_real_header_compiles_with_nvrtc(tmp_path, target, sm90):
    pytest.importorskip("cuda.pathfinder")
    from cupyflash import _nvrtc, _source

    (tmp_path / "uses_barriers.cu").write_text(_EVERY_WRAPPER)
    source = f"#define SM90 {sm90}\n" + _source.assemble(str(tmp_path / "uses_barriers.cu"))
    try:
        compiler = _nvrtc.compiler()
    except OSError as exc:
        pytest.skip(f"no NVRTC: {exc}")
    _, cubin, _ = compiler.compile(source, ["uses_barriers"], _nvrtc.options(target))
    assert len(cubin) > 0


def test_the_sm90_wrappers_are_not_declared_for_sm80(tmp_path):
    pytest.importorskip("cuda.pathfinder")
    from cupyflash import _nvrtc, _source

    (tmp_path / "uses_barriers.cu").write_text(_EVERY_WRAPPER)
    source = "#define SM90 1\n" + _source.assemble(str(tmp_path / "uses_barriers.cu"))
    try:
        compiler = _nvrtc.compiler()
    except OSError as exc:
        pytest.skip(f"no NVRTC: {exc}")
    with pytest.raises(_nvrtc.NvrtcError) as info:
        compiler.compile(source, ["uses_barriers"], _nvrtc.options("sm_80"))
    for name in ("mbarrier_arrive_expect_tx", "mbarrier_expect_tx", "mbarrier_complete_tx", "bulk_reduce_add_f32"):
        assert f'has no member "{name}"' in str(info.value)


# ---- an mbarrier as the PTX ISA describes it ------------------------------------------------

class Violation(Exception):
    """A rule of the PTX ISA's mbarrier section broken; ``kind`` names it."""

    def __init__(self, kind):
        super().__init__(kind)
        self.kind = kind


class MbarrierModel:
    """One mbarrier object, from the PTX ISA's "Parallel Synchronization and Communication
    Instructions: mbarrier" (independently of the emulator's code):

    - init: phase 0, expected = pending = count (1 .. 2^20 - 1), tx-count 0; only on
      memory without a valid barrier; every other operation needs a valid one;
    - arrive-on: pending -= 1; expect-tx: tx += n; complete-tx: tx -= n (tx within
      +-(2^20 - 1)); arrive.expect_tx is expect-tx, then arrive-on;
    - the phase completes when pending and tx are both zero: phase += 1, pending =
      expected;
    - "for each phase ... at least one test_wait or try_wait operation must be
      performed which returns True ... before an arrive-on operation in the subsequent
      phase";
    - try_wait.parity(p) is true when the phase of parity p is the one just completed,
      i.e. the current phase has parity 1 - p ("the integer parity of either the current
      phase or the immediately preceding phase"; 0 or 1);
    - a thread whose try_wait for phase F was false, waiting with the same parity when
      the barrier has reached phase F + 2, names the wrong phase (lapped).
    """

    LIMIT = 2**20 - 1

    def __init__(self):
        self.valid = False

    def _need_valid(self):
        if not self.valid:
            raise Violation("uninitialised")

    def init(self, count):
        if not 1 <= count <= self.LIMIT:       # (the operand is checked before the object)
            raise Violation("count")
        if self.valid:
            raise Violation("live-init")
        self.valid, self.phase, self.expected, self.pending, self.tx = True, 0, count, count, 0
        self.waited_previous, self.failed_at = True, None

    def _tx(self, delta):
        if not -self.LIMIT <= self.tx + delta <= self.LIMIT or abs(delta) > self.LIMIT:
            raise Violation("tx-range")
        self.tx += delta

    def _arrive_on(self):
        if self.phase > 0 and not self.waited_previous:
            raise Violation("arrive-before-wait")
        if self.pending == 0:
            raise Violation("too-many")
        self.pending -= 1

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.expected
            self.waited_previous = False

    def arrive(self):
        self._need_valid()
        self._arrive_on()
        self._maybe_complete()

    def arrive_expect_tx(self, n):
        self._need_valid()
        self._tx(n)
        self._arrive_on()
        self._maybe_complete()

    def expect_tx(self, n):
        self._need_valid()
        self._tx(n)
        self._maybe_complete()

    def complete_tx(self, n):
        self._need_valid()
        self._tx(-n)
        self._maybe_complete()

    def try_wait(self, parity):
        self._need_valid()
        if parity not in (0, 1):
            raise Violation("parity")
        if self.failed_at is not None and self.failed_at % 2 == parity and self.phase >= self.failed_at + 2:
            raise Violation("lapped")
        done = self.phase % 2 != parity
        if done:
            self.waited_previous, self.failed_at = True, None
        else:
            self.failed_at = self.phase
        return done

    def inval(self):
        self._need_valid()
        self.valid = False


# op codes of mbar_script
INIT, ARRIVE, ARRIVE_TX, EXPECT_TX, COMPLETE_TX, TRY_WAIT, INVAL = range(7)

VIOLATION_MESSAGES = {
    "uninitialised": r"holds no initialised mbarrier",
    "live-init": r"mbarrier_init on shared offset \d+, which holds a live mbarrier",
    "count": r"mbarrier_init on shared offset \d+ with count",
    "tx-range": r"outside -\(2\^20 - 1\) \.\. 2\^20 - 1",
    "arrive-before-wait": r"before any wait returned true for phase",
    "too-many": r"more arrivals than pending",
    "parity": r"must be 0 or 1",
    "lapped": r"the waiter was lapped",
}


def apply(model, op, arg):
    """Runs one script op on the model: the try_wait result, else None."""
    if op == INIT:
        model.init(arg)
    elif op == ARRIVE:
        model.arrive()
    elif op == ARRIVE_TX:
        model.arrive_expect_tx(arg)
    elif op == EXPECT_TX:
        model.expect_tx(arg)
    elif op == COMPLETE_TX:
        model.complete_tx(arg)
    elif op == TRY_WAIT:
        return model.try_wait(arg)
    else:
        model.inval()
    return None


def run_model(script):
    """(try_wait results, the violation that ends the script or None)."""
    models, waits = [MbarrierModel(), MbarrierModel()], []
    for op, bar, arg in script:
        try:
            result = apply(models[bar], op, arg)
        except Violation as v:
            return waits, v.kind
        if result is not None:
            waits.append(int(result))
    return waits, None


def _mostly_valid_ops(m):
    """Ops that break no rule in model state m (so that scripts get deep)."""
    if not m.valid:
        return [(INIT, c) for c in (1, 2, 3)]
    ops = [(TRY_WAIT, 0), (TRY_WAIT, 1), (EXPECT_TX, 16), (COMPLETE_TX, 16), (INVAL, 0)]
    if m.pending > 0 and (m.phase == 0 or m.waited_previous):
        ops += [(ARRIVE, 0), (ARRIVE, 0), (ARRIVE, 0), (ARRIVE_TX, 32)]
    if m.tx > 0:
        ops.append((COMPLETE_TX, m.tx))
    return ops


ANY_OP = st.sampled_from([(INIT, 1), (INIT, 0), (ARRIVE, 0), (ARRIVE_TX, 16), (EXPECT_TX, 2**20),
                          (COMPLETE_TX, 48), (TRY_WAIT, 0), (TRY_WAIT, 1), (TRY_WAIT, 2), (INVAL, 0)])


@st.composite
def scripts(draw):
    models, script = [MbarrierModel(), MbarrierModel()], []
    for _ in range(draw(st.integers(1, 40))):
        bar = draw(st.integers(0, 1))
        if draw(st.integers(0, 15)):
            op, arg = draw(st.sampled_from(_mostly_valid_ops(models[bar])))
        else:
            op, arg = draw(ANY_OP)
        script.append((op, bar, arg))
        try:
            apply(models[bar], op, arg)
        except Violation:
            break
    return script


def test_the_model_follows_the_isa_examples():
    m = MbarrierModel()
    m.init(2)
    assert m.try_wait(1)            # parity 1 names the phase before phase 0: complete (a producer's first wait)
    assert not m.try_wait(0)
    m.arrive()
    m.arrive_expect_tx(64)          # both arrivals in, but 64 bytes outstanding: phase 0 stays open
    assert not m.try_wait(0)
    m.complete_tx(64)
    assert m.phase == 1 and m.try_wait(0) and not m.try_wait(1)
    m.complete_tx(16)               # tx-count may go negative before the expect-tx
    m.arrive()
    m.arrive_expect_tx(16)
    assert m.phase == 2
    with pytest.raises(Violation, match="arrive-before-wait"):
        m.arrive()                  # nobody waited for phase 1
    with pytest.raises(Violation, match="live-init"):
        m.init(1)


@needs_emulator
@settings(max_examples=40, deadline=None)
@given(script=scripts())
def test_the_emulated_mbarrier_agrees_with_the_model(ex, script):
    waits, violation = run_model(script)
    ops = np.array(script, np.int32).reshape(-1)
    ticket = np.full(len(script) + 1, -7, np.int32)
    out = np.zeros(4, np.float32)
    params = planted_params(ops.view(np.float32), out, ticket, len(script))
    if violation is None:
        ex.launch(PLANTED, "mbar_script", 1, 32, 64, params)
    else:
        with pytest.raises(EmulatorError, match=VIOLATION_MESSAGES[violation] + ".*" + AT_LINE):
            ex.launch(PLANTED, "mbar_script", 1, 32, 64, params)
    np.testing.assert_array_equal(ticket[:len(waits)], waits)
    assert ticket[len(waits)] == -7     # no wait the model did not make


# ---- mbarriers on the emulator: correct use and every check ----------------------------------

@needs_emulator
def test_every_thread_arriving_and_waiting_passes(ex, ex_plain):
    for executor in (ex, ex_plain):
        out, _ = run(executor, "mbar_fault<0>", 64, 64)
        np.testing.assert_array_equal(out[:64], 1.0)


MBAR_CHECKS = [
    (1, r"mbarrier_arrive on shared offset 8, which holds no initialised mbarrier \(mbarrier_init was never "
        r"called on it\) at " + AT_LINE),
    (2, r"mbarrier_arrive on shared offset 8, which holds no initialised mbarrier \(it was invalidated at "
        + AT_LINE + r"\) at " + AT_LINE),
    (3, r"mbarrier_init on shared offset 8, which holds a live mbarrier \(initialised by thread \(0,0,0\).*"
        r"mbarrier_inval it before initialising it again at " + AT_LINE),
    (4, r"mbarrier_arrive: more arrivals than pending -- the mbarrier at shared offset 8 is in phase 0 with 0 of 1 "
        r"arrivals pending and tx-count 16.* at " + AT_LINE),
    (5, r"mbarrier_arrive on the mbarrier at shared offset 8 in phase 1 before any wait returned true for phase 0"
        r".* at " + AT_LINE),
    (6, r"thread \(32,0,0\).*mbarrier_try_wait_parity\(parity 0\) on the mbarrier at shared offset 8: this "
        r"thread's wait for phase 0 returned false, .* now in phase 2, .*the waiter was lapped.* at " + AT_LINE),
    (7, r"thread \(1,0,0\).* writes byte 8 of shared memory at " + AT_LINE + r", which belongs to the live "
        r"mbarrier at shared offset 8 \(initialised at " + AT_LINE + r"\)"),
    (8, r"thread \(1,0,0\).* reads byte 8 of shared memory at " + AT_LINE + r", which belongs to the live "
        r"mbarrier"),
    (13, r"mbarrier_try_wait_parity with parity 2 \(must be 0 or 1.* at " + AT_LINE),
    (14, r"mbarrier_init on shared offset 8 with count 0 \(must be 1 \.\. 2\^20 - 1\) at " + AT_LINE),
    (15, r"mbarrier_init on shared offset 4, which is not 8-byte aligned.* at " + AT_LINE),
    (16, r"mbarrier_init on address 0x[0-9a-f]+, which is not within the 64 bytes of dynamic shared memory.* at "
         + AT_LINE),
    (17, r"mbarrier_expect_tx of 1048576 bytes takes the tx-count of the mbarrier at shared offset 8 from 0 to "
         r"1048576, outside .* at " + AT_LINE),
    # the first copy is tracked (its arrival counted: it lands at a wait for the phase), the second is not
    (18, r"thread \(0,0,0\).* exits with 1 cp\.async copy never waited for \(cp\.async\.wait_group\) nor tracked by "
         r"cp_async_mbarrier_arrive \(1 not even committed\); they never land \(first issued at " + AT_LINE),
]


@needs_emulator
@pytest.mark.parametrize("fault, match", MBAR_CHECKS, ids=[f"fault{f}" for f, _ in MBAR_CHECKS])
def test_mbarrier_misuse_is_reported_at_its_line(ex, fault, match):
    with pytest.raises(EmulatorError, match=match):
        run(ex, f"mbar_fault<{fault}>", 64, 64)


@needs_emulator
def test_use_before_the_init_is_visible_is_reported(ex_ordered):
    # unshuffled, thread 0 initialises and exits, then thread 32 arrives: no __syncthreads() between
    with pytest.raises(EmulatorError, match=r"thread \(32,0,0\).*mbarrier_arrive on the mbarrier at shared offset 8 "
                                            r"before its mbarrier_init by thread \(0,0,0\).* at " + AT_LINE
                                            + r" is visible to it"):
        run(ex_ordered, "mbar_fault<9>", 64, 64)


@needs_emulator
@pytest.mark.parametrize("fault, match", [
    (10, r"deadlock: no thread can proceed \(.*wait at mbarrier_wait_parity\(parity 0\) at " + AT_LINE
         + r", where the mbarrier at shared offset 8 is in phase 0 with 0 of 1 arrivals pending and tx-count 16"),
    (11, r"deadlock: .*wait at mbarrier_wait_parity\(parity 0\) at " + AT_LINE + r", where the mbarrier at shared "
         r"offset 8 is in phase 0 with 1 of 2 arrivals pending and tx-count 0"),
    (12, r"deadlock: no thread can proceed, the runnable ones only spin \(threads 0-63 spin in "
         r"mbarrier_try_wait_parity\(parity 0\) at " + AT_LINE + r", where the mbarrier at shared offset 8 is in "
         r"phase 0 with 1 of 1 arrivals pending"),
], ids=["tx-pending", "arrival-missing", "spinning"])
def test_mbarrier_deadlocks_name_the_barrier_phase_and_counts(ex, fault, match):
    with pytest.raises(EmulatorError, match=match):
        run(ex, f"mbar_fault<{fault}>", 64, 64)


# ---- the cp.async pipeline -------------------------------------------------------------------

ROUNDS = 7
PIPELINE_SMEM = 128 + 3 * 512


def pipeline_expected(inp, rounds):
    out = np.zeros(256, np.float32)
    for c in range(256):
        total = np.float32(0)
        for r in range(rounds):
            tile = inp[128 * r: 128 * r + 128]
            total = np.float32(total + (tile[(7 * c + r) % 128] + tile[c % 128]) * np.float32(r + 1))
        out[c] = total
    return out


@needs_emulator
@pytest.mark.parametrize("arrive", [0, 1], ids=["every-thread-releases", "lane-0-after-syncwarp"])
def test_the_pipeline_matches_numpy(ex, ex_plain, arrive):
    inp = np.random.default_rng(10).integers(-8, 8, 128 * ROUNDS).astype(np.float32)
    expected = pipeline_expected(inp, ROUNDS)
    for executor in (ex, ex_plain, _executor(seed=11, race_check=True)):
        out, _ = run(executor, "mbar_pipeline<0>", 384, PIPELINE_SMEM, inp, n=ROUNDS, arg=arrive)
        np.testing.assert_array_equal(out[:256], expected)


@needs_emulator
@pytest.mark.parametrize("bug", [1, 2, 3, 4], ids=["consumer-skips-full", "producer-skips-empty",
                                                 "empty-parity-never-flips", "consumer-releases-before-reading"])
@pytest.mark.parametrize("arrive", [0, 1], ids=["every-thread-releases", "lane-0-after-syncwarp"])
def test_pipeline_bugs_are_reported(ex, bug, arrive):
    inp = np.random.default_rng(10).integers(-8, 8, 128 * ROUNDS).astype(np.float32)
    # an unordered pair of accesses, a copy overwritten in flight, or a phase arrived at before the last one
    # was waited for: whichever the thread order meets first
    with pytest.raises(EmulatorError, match=r"(shared-memory race|still in flight|before any wait returned true)"
                                            r".*" + AT_LINE):
        run(ex, f"mbar_pipeline<{bug}>", 384, PIPELINE_SMEM, inp, n=ROUNDS, arg=arrive)


@needs_emulator
def test_copies_are_invisible_to_a_consumer_that_does_not_wait(ex, ex_plain):
    inp = np.random.default_rng(10).integers(-8, 8, 128).astype(np.float32)
    out, _ = run(ex_plain, "mbar_pipeline<1>", 384, PIPELINE_SMEM, inp, n=1)
    assert np.isnan(out[:256]).all()       # the copies land at a wait for their phase, and nobody waited
    with pytest.raises(EmulatorError, match=r"shared-memory race|still in flight"):
        run(ex, "mbar_pipeline<1>", 384, PIPELINE_SMEM, inp, n=1)


@needs_emulator
@pytest.mark.parametrize("arrive", [0, 1], ids=["every-thread-releases", "lane-0-after-syncwarp"])
def test_a_plain_store_handoff_is_ordered_by_the_phases(ex, arrive):
    inp = np.random.default_rng(12).integers(-8, 8, 64).astype(np.float32)
    out, _ = run(ex, "mbar_handoff<0>", 64, 256, inp, arg=arrive)
    np.testing.assert_array_equal(out[:32], inp[:32] + inp[32:64])


@needs_emulator
@pytest.mark.parametrize("bug, match", [
    (1, r"shared-memory race \((read-after-write|write-after-read)\)"),
    (2, r"shared-memory race \((read-after-write|write-after-read)\)|before any wait returned true"),
], ids=["consumer-reads-before-waiting", "producer-overwrites-before-release"])
def test_unordered_handoffs_are_races(ex, bug, match):
    inp = np.random.default_rng(12).integers(-8, 8, 64).astype(np.float32)
    for seed in (3, 4, 5):
        executor = ex if seed == 3 else _executor(seed=seed, race_check=True)
        with pytest.raises(EmulatorError, match=match):
            run(executor, f"mbar_handoff<{bug}>", 64, 256, inp)


# ---- named barriers ---------------------------------------------------------------------------

def pingpong_expected(inp, rounds):
    a = inp.astype(np.float64)
    for k in range(rounds):
        b = 2 * a + k
        a = 2 * b + k + 1
    return a.astype(np.float32)


@needs_emulator
def test_a_named_barrier_ping_pong_matches_numpy(ex, ex_plain):
    inp = np.random.default_rng(13).integers(-4, 4, 256).astype(np.float32)
    for executor in (ex, ex_plain, _executor(seed=7, race_check=True)):
        out, _ = run(executor, "named_pingpong<0>", 256, 2048, inp, n=3)
        np.testing.assert_array_equal(out[:256], pingpong_expected(inp, 3))


@needs_emulator
@pytest.mark.parametrize("bug", [1, 2], ids=["no-barriers", "arrive-instead-of-sync"])
def test_an_unsynchronised_ping_pong_is_a_race(ex, bug):
    inp = np.random.default_rng(13).integers(-4, 4, 256).astype(np.float32)
    with pytest.raises(EmulatorError, match=r"shared-memory race .*" + AT_LINE):
        run(ex, f"named_pingpong<{bug}>", 256, 2048, inp, n=3)


@needs_emulator
def test_named_barrier_0_of_the_whole_block_and_a_partial_barrier_order_accesses(ex):
    inp = np.random.default_rng(14).integers(-4, 4, 96).astype(np.float32)
    out, _ = run(ex, "named_fault<0>", 96, 1024, inp)
    t = np.arange(64)
    np.testing.assert_array_equal(out[:64], inp[((t + 32) % 64 + 32) % 96])


NAMED_CHECKS = [
    (1, r"named_barrier_sync\(16, 64\): barrier id 16 is outside 0\.\.15 at " + AT_LINE),
    (2, r"named_barrier_sync\(1, 48\): the thread count must be a positive multiple of 32 .* at " + AT_LINE),
    (3, r"named_barrier_sync\(1, 256\): .*at most the block's 96 \(3 warps\) at " + AT_LINE),
    (4, r"named barrier 1 is used with two thread counts at once: warp \d arrives at named_barrier_sync\(1, \d+\) at "
        + AT_LINE + r" while it waits for \d+ threads"),
    (5, r"divergent named barrier: thread \(\d+,0,0\) \[warp 0, lane \d+\] executes named_barrier_sync\([12], 64\) at "
        + AT_LINE + r" while lane \d+ of its warp is elsewhere \(it would wait at named_barrier_sync\([12], 64\)"),
    (6, r"deadlock: no thread can proceed \(threads 0-15 wait at named_barrier_sync\(1, 64\) at " + AT_LINE
        + r" for the rest of warp 0 \(lanes 0-15 of it arrived; a warp arrives at a named barrier as a whole\); "
          r"threads 16-31 wait at mbarrier_wait_parity"),
    (7, r"deadlock: no thread can proceed \(threads 0-63 wait at named_barrier_sync\(1, 96\) at " + AT_LINE
        + r", where 64 of 96 threads arrived \(warps 0-1\); threads 64-95 have exited\)"),
    (8, r"warp 0 arrives twice at named barrier 1 \(64 threads\) before it completes \(named_barrier_arrive at "
        + AT_LINE),
    (10, r"named barrier 1 still has 32 of its 64 threads arrived when the block ends \(first arrival at "
         + AT_LINE + r"\): a bar\.arrive no bar\.sync completed"),
]


@needs_emulator
@pytest.mark.parametrize("fault, match", NAMED_CHECKS, ids=[f"fault{f}" for f, _ in NAMED_CHECKS])
def test_named_barrier_misuse_is_reported(ex, fault, match):
    with pytest.raises(EmulatorError, match=match):
        run(ex, f"named_fault<{fault}>", 96, 1024)


@needs_emulator
def test_barrier_0_with_another_count_beside_syncthreads_is_reported_from_either_side(ex, ex_ordered):
    # in index order warp 0 has arrived at its barrier 0 (64 threads) when warp 1 reaches __syncthreads()
    with pytest.raises(EmulatorError, match=r"thread \(32,0,0\).* waits at __syncthreads\(\) \(" + AT_LINE
                                            + r"\) while named barrier 0 is in use with 64 threads"):
        run(ex_ordered, "named_fault<9>", 96, 1024)
    # shuffled, some thread of warps 1-2 waits at __syncthreads() when warp 0's lanes get there
    with pytest.raises(EmulatorError, match=r"named_barrier_sync\(0, 64\) at " + AT_LINE
                                            + r" while threads wait at __syncthreads\(\) \(barrier 0 with all 96 "
                                              r"threads\): barrier 0 is used with two thread counts at once"):
        run(ex, "named_fault<9>", 96, 1024)


# ---- bulk reductions --------------------------------------------------------------------------

BLOCKS = 5


def bulk_case(seed, blocks=BLOCKS):
    rng = np.random.default_rng(seed)
    inp = rng.integers(-50, 50, 128 * blocks).astype(np.float32)
    start = rng.integers(-50, 50, 128).astype(np.float32)
    return inp, start, start + inp.reshape(blocks, 128).sum(0)


@needs_emulator
@pytest.mark.parametrize("bug", [0, 8], ids=["waited", "exits-after-wait-read"])
def test_bulk_reductions_add_every_block_exactly(ex, ex_plain, bug):
    # integers: the sum is exact in any order, and the emulator adds in a shuffled one
    for seed, executor in ((20, ex), (21, ex_plain), (22, _executor(seed=9, race_check=True))):
        inp, start, expected = bulk_case(seed)
        out = np.concatenate([start, np.zeros(16, np.float32)])
        run(executor, f"bulk_sum<{bug}>", 128, 512, inp, grid=BLOCKS, out=out)
        np.testing.assert_array_equal(out[:128], expected)
        np.testing.assert_array_equal(out[128:], 0.0)


@needs_emulator
def test_bulk_additions_land_at_bulk_wait_not_at_wait_read(ex):
    inp, start, expected = bulk_case(23, blocks=1)
    out = start.copy()
    _, ticket = run(ex, "bulk_sum<9>", 128, 512, inp, out=out)
    seen_after_read, seen_after_wait = ticket[:2].view(np.float32)
    assert seen_after_read == start[0] and seen_after_wait == expected[0]


BULK_CHECKS = [
    (1, "ex_ordered", r"bulk_reduce_add_f32 reads shared offset 0, written by thread \(0,0,0\).* at " + AT_LINE
        + r", which ran no fence\.proxy\.async after that write: the bulk copy engine \(async proxy\) may not see it"),
    (2, "ex", r"thread \(0,0,0\).* writes byte 80 of shared memory at " + AT_LINE + r", the source of a bulk reduction "
        r"\(cp\.reduce\.async\.bulk, issued at " + AT_LINE + r"\) that may still be reading it"),
    (2, "ex_plain", r"shared offset 8\d, the source of a bulk reduction \(issued at " + AT_LINE + r"\), was "
        r"overwritten before bulk_wait_read retired it"),
    (3, "ex", r"exits while a bulk reduction it issued at " + AT_LINE + r" may still read its shared-memory source"),
    (4, "ex", r"bulk_reduce_add_f32 of 24 bytes \(must be a positive multiple of 16\) at " + AT_LINE),
    (5, "ex", r"bulk_reduce_add_f32 source at shared offset \d+ is not 16-byte aligned at " + AT_LINE),
    (6, "ex", r"bulk_reduce_add_f32 destination address 0x[0-9a-f]+ is not 16-byte aligned at " + AT_LINE),
    (7, "ex", r"bulk_reduce_add_f32 source at 0x[0-9a-f]+ \(64 bytes\) is not within the 512 bytes of dynamic "
        r"shared memory at " + AT_LINE),
    (10, "ex_ordered", r"shared-memory race \(write-after-read\): thread \(1,0,0\).* writes byte 0 of dynamic shared "
         r"memory .* at " + AT_LINE + r", which thread \(0,0,0\).* read"),
]


@needs_emulator
@pytest.mark.parametrize("bug, executor, match", BULK_CHECKS,
                         ids=[f"bug{b}-{e}" for b, e, _ in BULK_CHECKS])
def test_bulk_reduction_misuse_is_reported(request, bug, executor, match):
    inp, start, _ = bulk_case(24)
    with pytest.raises(EmulatorError, match=match):
        run(request.getfixturevalue(executor), f"bulk_sum<{bug}>", 128, 512, inp, grid=BLOCKS,
            out=np.concatenate([start, np.zeros(16, np.float32)]))
