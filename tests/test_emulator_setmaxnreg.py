"""The emulator's model of setmaxnreg (wgmma.cuh's setmaxnreg_dec / setmaxnreg_inc, sm_90a).

- A model of the CTA's register pool written here from the PTX ISA's text, independent
  of the emulator, predicts for random op scripts over 2-4 warpgroups whether they
  pass, deadlock or break a rule; ``emulator_planted/setmaxnreg_planted.cu``'s
  ``setmaxnreg_script`` runs each script, and a list of hand-written ones, and must
  land on one of the predicted outcomes; the count each warp starts with, per block size.
- Correct use passes and matches NumPy exactly: a producer warpgroup drops to 40
  registers, two consumers rise to 232 and take data from it through an mbarrier, in
  the shuffled orders and in the one where the consumers' ``.inc`` comes first (and
  waits for the producer's ``.dec``).
- Every check trips on a planted kernel, naming the violation and the file:line.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.emulator import EmulatorError, EmulatorExecutor

from _emulator_util import planted_executors, planted_params
from _kernel_util import needs_emulator

HERE = Path(__file__).resolve().parent
PLANTED = str(HERE / "emulator_planted" / "setmaxnreg_planted.cu")
AT_LINE = r"\S*setmaxnreg_planted\.cu:\d+"
FAULTS = 13
KERNELS = ["setmaxnreg_handoff", "setmaxnreg_script"] + [f"setmaxnreg_fault<{k}>" for k in range(1, FAULTS + 1)]
INC, DEC = "setmaxnreg\\.inc\\.sync\\.aligned\\.u32", "setmaxnreg\\.dec\\.sync\\.aligned\\.u32"


ex, ex_plain, ex_ordered = planted_executors(PLANTED, KERNELS)


# ---- the CTA's register pool as the PTX ISA describes it ------------------------------------

def start_count(threads):
    """The registers a thread owns at launch: a kernel with setmaxnreg is compiled for a fixed
    count (PTX ISA: "launched with a valid value of maximum number of per-thread registers"),
    here the most one block of ``threads`` gets of an SM's 65536 registers -- which sit in
    four quarters, warp w in quarter w % 4, so a partial warpgroup costs as much as a whole
    one -- allocated 8 a thread at a time, at most 256 (ptxas's 255, in allocation units)."""
    whole_warpgroups = -(-threads // 128) * 128
    return min(256, 65536 // whole_warpgroups // 8 * 8)


def outcomes(script, warpgroups):
    """Every outcome some thread order can give ``script`` -- a list of (warpgroup, inc,
    count), each warpgroup running its own ops in order -- from the PTX ISA's
    "setmaxnreg":

    - "A pool of available registers is maintained per-CTA": empty at the start (the
      ISA names no other source), fed by ``.dec`` ("releasing extra registers from the
      requesting warp to this pool"), drained by ``.inc``, a warpgroup's 4 warps of 32
      threads moving (old - new) * 128 registers;
    - "setmaxnreg.inc ... blocks the execution until enough registers are available in
      the CTA's register pool": an ``.inc`` is enabled only when the pool holds them;
    - "imm-reg-count must be in the range 24 to 256 (both inclusive) and must be a
      multiple of 8" (``count``); the count before a ``.dec`` "should be greater than or
      equal to" the new one (``dec-raises``), before an ``.inc`` "less than or equal to"
      it (``inc-lowers``) -- an equal count is fine either way.

    A warpgroup that reaches a rule-breaking op breaks it (it does not wait for the pool
    first); a state where unfinished warpgroups can only wait is a ``deadlock``.
    """
    ops = [[(inc, n) for k, inc, n in script if k == wg] for wg in range(warpgroups)]
    start = start_count(128 * warpgroups)
    found, seen = set(), set()
    stack = [((0,) * warpgroups, (start,) * warpgroups, 0)]
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        pos, regs, pool = state
        moved = False
        for wg in range(warpgroups):
            if pos[wg] == len(ops[wg]):
                continue
            inc, n = ops[wg][pos[wg]]
            broken = ("count" if n % 8 or not 24 <= n <= 256 else "inc-lowers" if inc and n < regs[wg]
                      else "dec-raises" if not inc and n > regs[wg] else None)
            if broken:
                found.add(broken)
                moved = True
                continue
            need = (n - regs[wg]) * 128      # a .dec's is negative: it gives back
            if need <= pool:
                moved = True
                stack.append((pos[:wg] + (pos[wg] + 1,) + pos[wg + 1:], regs[:wg] + (n,) + regs[wg + 1:],
                              pool - need))
        if not moved:
            found.add("pass" if pos == tuple(map(len, ops)) else "deadlock")
    return found


OUTCOME_MESSAGES = {
    "count": r"the count must be a multiple of 8 in 24\.\.256",
    "dec-raises": r"which would raise warpgroup \d's count of \d+ registers a thread",
    "inc-lowers": r"which would lower warpgroup \d's count of \d+ registers a thread",
    "deadlock": r"deadlock: .*wait at " + INC + r" \d+ at " + AT_LINE + r" for registers: warpgroup \d \(warps "
                r"\d+-\d+\) needs \d+ from the CTA's pool",
}


def emulated_outcome(executor, script, threads, *, raise_errors=False):
    """(the outcome, p.ticket) of setmaxnreg_script on ``script`` in a block of ``threads``."""
    ops = np.array(script, np.int32).reshape(-1)
    out, ticket = np.zeros(4, np.float32), np.full(8, -7, np.int32)   # a slot per warpgroup of 1024 threads
    params = planted_params(ops.view(np.float32), out, ticket, len(script))
    try:
        executor.launch(PLANTED, "setmaxnreg_script", 1, threads, 0, params)
    except EmulatorError as exc:
        if raise_errors:
            raise
        kinds = [k for k, m in OUTCOME_MESSAGES.items() if re.search(m, str(exc))]
        assert len(kinds) == 1, str(exc)
        return kinds[0], ticket
    return "pass", ticket


FA3 = [(2, 0, 40), (0, 1, 232), (1, 1, 232)]          # 40 + 2 * 232 = 3 * 168
# 16 a thread in the pool, two warpgroups each taking 8 twice before giving them back:
# both taking 8 first deadlocks, one going first passes
TAKE_TWICE = [(2, 0, 152), (0, 1, 176), (1, 1, 176), (0, 1, 184), (1, 1, 184), (0, 0, 168), (1, 0, 168)]
HAND_WRITTEN = [   # (warpgroups, script, the outcomes the ISA's text allows)
    (3, FA3, {"pass"}),
    (3, FA3[::-1], {"pass"}),                          # the .inc calls wait for the .dec
    (3, [(2, 0, 40), (0, 1, 240), (1, 1, 240)], {"deadlock"}),
    (3, [(0, 0, 168), (1, 1, 168)], {"pass"}),         # an equal count, either way
    (3, [(0, 0, 176)], {"dec-raises"}),
    (3, [(0, 1, 160)], {"inc-lowers"}),
    (3, [(0, 0, 100)], {"count"}),
    (4, [(1, 0, 24), (0, 1, 256), (0, 0, 24)], {"deadlock"}),   # 104 a thread given back, 128 wanted
    (2, [(1, 0, 24), (1, 1, 256), (0, 0, 24), (0, 1, 256)], {"pass"}),
    (3, TAKE_TWICE, {"pass", "deadlock"}),
]


@pytest.mark.parametrize("warpgroups, script, expected", HAND_WRITTEN)
def test_the_model_follows_the_isa_text(warpgroups, script, expected):
    assert outcomes(script, warpgroups) == expected


@needs_emulator
@pytest.mark.parametrize("fixture", ["ex", "ex_ordered"])
@pytest.mark.parametrize("warpgroups, script, expected", HAND_WRITTEN)
def test_hand_written_scripts_end_as_the_model_allows(request, fixture, warpgroups, script, expected):
    assert emulated_outcome(request.getfixturevalue(fixture), script, 128 * warpgroups)[0] in expected


def test_the_model_starts_384_threads_where_ptxas_caps_them():
    assert [start_count(n) for n in (128, 256, 288, 384, 512, 1024)] == [256, 256, 168, 168, 128, 64]


COUNTS = list(range(24, 257, 8))


@st.composite
def scripts(draw):
    warpgroups = draw(st.integers(2, 4))
    regs = [start_count(128 * warpgroups)] * warpgroups
    script = []
    for _ in range(draw(st.integers(1, 8))):
        wg = draw(st.integers(0, warpgroups - 1))
        inc = draw(st.booleans())
        allowed = [n for n in COUNTS if (n >= regs[wg] if inc else n <= regs[wg])]
        breaking = [n for n in COUNTS if n not in allowed]
        kind = draw(st.integers(0, 59))   # mostly a count the rules allow
        if kind == 0:
            n = draw(st.sampled_from([20, 100, 264]))
        elif kind <= 2 and breaking:
            n = draw(st.sampled_from(breaking))
        else:
            n = draw(st.sampled_from(allowed))
        if n in COUNTS:
            regs[wg] = n
        script.append((wg, int(inc), n))
    return warpgroups, script


@needs_emulator
@settings(max_examples=30, deadline=None)
@given(case=scripts())
def test_the_emulated_register_pool_agrees_with_the_model(ex, case):
    warpgroups, script = case
    expected = outcomes(script, warpgroups)
    outcome, ticket = emulated_outcome(ex, script, 128 * warpgroups)
    assert outcome in expected, (script, expected)
    if outcome == "pass":
        np.testing.assert_array_equal(ticket[:warpgroups], [sum(k == wg for k, _, _ in script)
                                                            for wg in range(warpgroups)])


@needs_emulator
@pytest.mark.parametrize("threads", [128, 256, 288, 384, 512, 640, 1024])
def test_each_warp_starts_with_the_most_registers_one_block_per_sm_allows(ex, threads):
    start = start_count(threads)
    assert emulated_outcome(ex, [(0, 0, start), (0, 1, start)], threads)[0] == "pass"
    with pytest.raises(EmulatorError, match=rf"setmaxnreg\.inc\.sync\.aligned\.u32 {start - 8} at {AT_LINE}, which "
                                            rf"would lower warpgroup 0's count of {start} registers a thread"):
        emulated_outcome(ex, [(0, 1, start - 8)], threads, raise_errors=True)


# ---- correct use: warp specialisation with a register hand-over -------------------------------

ROUNDS = 3


@needs_emulator
@pytest.mark.parametrize("fixture", ["ex", "ex_plain", "ex_ordered"], ids=["shuffled", "unchecked", "inc-first"])
def test_a_producer_handing_registers_to_two_consumers_matches_numpy(request, fixture):
    inp = np.random.default_rng(31).integers(-8, 8, 256 * ROUNDS).astype(np.float32)
    out = np.full(256 * ROUNDS, np.nan, np.float32)
    ticket = np.zeros(257, np.int32)
    request.getfixturevalue(fixture).launch(PLANTED, "setmaxnreg_handoff", 1, 384, 64 + 1024,
                                            planted_params(inp, out, ticket, ROUNDS))
    tiles = inp.reshape(ROUNDS, 256)
    np.testing.assert_array_equal(out.reshape(ROUNDS, 256), 2 * tiles + tiles[:, ::-1])
    np.testing.assert_array_equal(ticket[1:], 1)   # every .inc completed after the producer's .dec


# ---- every check on a planted kernel ----------------------------------------------------------

THREAD = r"thread \(\d+,0,0\) \[warp \d+, lane \d+\]"
CHECKS = [
    (1, "ex", r"divergent warpgroup: " + THREAD + r" executes " + INC + r" (224|232) at " + AT_LINE + r" while "
        + THREAD + r" of its warpgroup waits at " + INC + r" (224|232) at " + AT_LINE + r" \(another count\)"),
    (2, "ex", r"(" + THREAD + r" executes " + INC + r" 232 at " + AT_LINE + r", but thread \(\d+,0,0\) \[warp 3, "
        r"lane \d+\] of its warpgroup has exited|thread \(\d+,0,0\) \[warp 3, lane \d+\] exits while " + THREAD
        + r" of its warpgroup waits for it at " + INC + r" 232 at " + AT_LINE + r")"),
    (2, "ex_ordered", r"thread \(96,0,0\) \[warp 3, lane 0\] exits while thread \(0,0,0\) \[warp 0, lane 0\] of its "
        r"warpgroup waits for it at " + INC + r" 232 at " + AT_LINE),
    (3, "ex", r"deadlock: no thread can proceed \(threads 0-95 wait at " + INC + r" 232 at " + AT_LINE + r" for the "
        r"rest of warpgroup 0 \(96 of its 128 threads arrived; the whole warpgroup executes it\); threads 96-383 "
        r"wait at __syncthreads\(\)"),
    (4, "ex", THREAD + r" executes " + DEC + r" 200 at " + AT_LINE + r", which would raise warpgroup 2's count of 168 "
        r"registers a thread: \.dec may only lower it \(or keep it\)"),
    (5, "ex", THREAD + r" executes " + INC + r" 160 at " + AT_LINE + r", which would lower warpgroup [01]'s count of "
        r"168 registers a thread: \.inc may only raise it \(or keep it\)"),
    (6, "ex", r"deadlock: no thread can proceed \(.*threads (0-127|128-255) wait at " + INC + r" 240 at " + AT_LINE
        + r" for registers: warpgroup [01] \(warps [04]-[37]\) needs 9216 from the CTA's pool \(72 a thread, from 168 "
          r"to 240\), which holds 7168"),
    (7, "ex", r"thread \(2\d\d,0,0\) \[warp 8, lane \d+\] executes " + DEC + r" 40 at " + AT_LINE + r", but its "
        r"warpgroup \(warps 8-11\) is incomplete: the block has 288 threads \(9 warps\)"),
    (8, "ex", r"(of its warpgroup has exited|exits while)"),
    (8, "ex_ordered", r"thread \(1,0,0\) \[warp 0, lane 1\] executes " + INC + r" 232 at " + AT_LINE + r", but thread "
        r"\(0,0,0\) \[warp 0, lane 0\] of its warpgroup has exited: every thread of warpgroup 0 must execute the same "
        r"setmaxnreg"),
    (9, "ex", THREAD + r" executes " + DEC + r" 100 at " + AT_LINE + r": the count must be a multiple of 8 in "
        r"24\.\.256"),
    (10, "ex", r"divergent warpgroup: " + THREAD + r" executes " + INC + r" 232 at " + AT_LINE + r" while " + THREAD
         + r" of its warpgroup waits at " + INC + r" 232 at " + AT_LINE + r" \(another call site\)"),
    (11, "ex", r"divergent warp"),
    (11, "ex_ordered", r"divergent warp: thread \(1,0,0\) \[warp 0, lane 1\] executes " + INC + r" 232 at " + AT_LINE
         + r" while lane 0 of its warp is elsewhere \(it would wait at __syncwarp\(\) with mask 0xffffffff at "
         + AT_LINE),
    (12, "ex", r"divergent warpgroup: " + THREAD + r" executes setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 168 at "
         + AT_LINE + r" while " + THREAD + r" of its warpgroup waits at setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 168 "
         r"at " + AT_LINE + r" \(another action\)"),
    (13, "ex", r"divergent warpgroup: " + THREAD + r" executes " + INC + r" (224|232) at (" + AT_LINE + r") while "
         + THREAD + r" of its warpgroup waits at " + INC + r" (224|232) at \2 \(another count\)"),
]


@needs_emulator
@pytest.mark.parametrize("fault, fixture, match", CHECKS, ids=[f"fault{f}-{x}" for f, x, _ in CHECKS])
def test_setmaxnreg_misuse_is_reported_at_its_line(request, fault, fixture, match):
    threads = 288 if fault == 7 else 384
    inp, out = np.zeros(4, np.float32), np.zeros(384, np.float32)
    with pytest.raises(EmulatorError, match=match):
        request.getfixturevalue(fixture).launch(PLANTED, f"setmaxnreg_fault<{fault}>", 1, threads, 0,
                                                planted_params(inp, out))
