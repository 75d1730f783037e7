"""What ptxas made of the Hopper kernels' main loops, read in their SASS (no GPU needed).

The source order of a software-pipelined loop says nothing about the order the
GPU issues it in: ptxas schedules within basic blocks, and once hoisted the
wait for O += P V above every exponential of the softmax (so the softmax no
longer ran beside the tensor cores).  These tests read the compiled loop:

- fwd_wgmma: at least block_n / 2 exponentials (``MUFU.EX2``) lie between the
  wait for S (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the wait for P V
  (``... 0x0``) -- the softmax overlaps P V;
- fwd_wgmma and the deterministic bwd_wgmma dK/dV kernels: at most 40
  instructions from the main loop's barrier to its first HGMMA -- the copies of
  the next block are issued behind the products, not before them;
- fwd_wgmma's decoupled rows: every copy in the producer warpgroup's code, after
  it gives its registers back; the consumers' loop waits on mbarriers and named
  barriers, never on the whole CTA;
- bwd_wgmma's decoupled dK/dV rows likewise, and their consumers' turns;
- the loop as it was before those fixes (the ``before-fixes`` timing build) fails
  both rules, so they can fail.

The SASS comes from the static report (NVRTC for sm_90a, cuobjdump), the text
``python -m cupyflash kernels --arch sm_90a --sass NAME`` prints.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from cupyflash import _report
from cupyflash._families import BWD_WGMMA, FWD_WGMMA

pytest.importorskip("cuda.pathfinder")

FWD_ROWS = list(FWD_WGMMA.rows)
BWD_ROWS = list(BWD_WGMMA.rows)
MAX_BARRIER_TO_HGMMA = 40


@pytest.fixture(scope="module")
def report():
    # The rows of tests/test_fwd_wgmma.py's and tests/test_bwd_wgmma.py's reports (one
    # compile per entry file and arch, shared through the report's in-process cache).
    rows = _report.kernel_report(("sm_90",), FWD_ROWS + BWD_ROWS, sass_text=True)
    if any(r["sass_text"] is None for r in rows):
        pytest.skip("cuobjdump/nvdisasm not found: no SASS")
    return {r["name"]: r for r in rows}


def loop_barrier(instructions: list[str], anchor: int) -> int:
    """Index of the last block barrier before instruction ``anchor``."""
    return max(i for i in range(anchor) if instructions[i].startswith("BAR.SYNC"))


def barrier_to_first_hgmma(instructions: list[str], barrier: int) -> int:
    first = next(i for i in range(barrier + 1, len(instructions)) if instructions[i].startswith("HGMMA"))
    return first - barrier - 1


def exponentials_beside_p_v(code: list[str]) -> int:
    """fwd_wgmma's loop: the MUFU.EX2 between its one wait for S alone and the wait for P V."""
    waits_s = [i for i, x in enumerate(code) if x == "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert len(waits_s) == 1, "the loop has one wait for S alone"
    end = code.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", waits_s[0])
    return sum(x.startswith("MUFU.EX2") for x in code[waits_s[0]:end])


def forward_barrier_to_products(code: list[str]) -> int:
    """fwd_wgmma's loop: instructions from its barrier to its first HGMMA."""
    return barrier_to_first_hgmma(code, loop_barrier(code, code.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")))


def test_forward_softmax_runs_while_p_v_is_in_flight(report):
    for inst in FWD_ROWS:
        code = _report.sass_instructions(report[inst.name_expression]["sass_text"])
        exponentials = exponentials_beside_p_v(code)
        assert exponentials >= inst.block_n // 2, (inst.name_expression, exponentials)


def test_forward_loop_issues_its_products_right_after_the_barrier(report):
    for inst in FWD_ROWS:
        code = _report.sass_instructions(report[inst.name_expression]["sass_text"])
        gap = forward_barrier_to_products(code)
        assert gap <= MAX_BARRIER_TO_HGMMA, (inst.name_expression, gap)


def test_the_loop_before_the_fixes_fails_both_rules():
    # KernelOptions(timing="before-fixes"): the wait for P V in the softmax's basic block
    # and the copies before the products, as fwd_wgmma was before issue 32's fixes 1 and
    # 2.  ptxas hoists that wait above the exponentials (2 are left beside P V at d = 128,
    # NVRTC 13.5, against 66 in the fixed loop) and the copies' arithmetic comes between
    # the barrier and the products (280 instructions, against 3).
    from cupyflash._loader import module_source
    from cupyflash._options import TIMING_BUILDS
    from cupyflash._source import Variant

    inst = next(r for r in FWD_ROWS if r.dtype == "float16" and r.head_dim == 128 and not r.split
                and not r.whole_kv and not r.decoupled)
    source = module_source(Variant("fwd_wgmma.cu", ((TIMING_BUILDS["before-fixes"], "1"),)))
    report = _report.compile_report(source, [inst.name_expression], "sm_90a")
    text = report.functions[inst.name_expression].sass_text
    if text is None:
        pytest.skip("cuobjdump/nvdisasm not found: no SASS")
    code = _report.sass_instructions(text)
    assert exponentials_beside_p_v(code) < inst.block_n // 2
    assert forward_barrier_to_products(code) > MAX_BARRIER_TO_HGMMA


def producer_and_consumer_turns(code: list[str], name: str, *, producer: int, consumers: int) -> tuple[int, int]:
    """A decoupled kernel's SASS: the producer warpgroup gives registers back (to
    ``producer`` a thread) before its first copy, the consumers raise theirs (to
    ``consumers``), the kernel has one CTA barrier, and the consumers' loop waits on an
    mbarrier, then for its turn (another barrier).  Returns the turn's barrier and the
    wait for S (the first ``DEPBAR.LE gsb0, 0x1`` of the loop)."""
    (dealloc,) = [i for i, x in enumerate(code) if x.startswith("USETMAXREG.DEALLOC")]
    (alloc,) = [i for i, x in enumerate(code) if x.startswith("USETMAXREG.TRY_ALLOC")]
    assert code[dealloc].endswith(f" {producer:#x}") and code[alloc].endswith(f", {consumers:#x}"), \
        (name, code[dealloc], code[alloc])
    copies = [i for i, x in enumerate(code) if x.startswith("LDGSTS")]
    assert copies and min(copies) > dealloc, name
    assert code.count("BAR.SYNC.DEFER_BLOCKING 0x0") == 1, name
    wait_s = code.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    turn = loop_barrier(code, wait_s)
    assert code[turn] != "BAR.SYNC.DEFER_BLOCKING 0x0" and "PHASECHK" in " ".join(code[alloc:turn]), name
    return turn, wait_s


def test_decoupled_forward_leaves_the_copies_to_its_producer(report):
    # KernelOptions.decoupled rows: the producer warpgroup gives its registers back
    # (USETMAXREG.DEALLOC to 40) and issues every copy; the consumers raise theirs
    # (TRY_ALLOC to 232), wait on mbarriers (SYNCS.PHASECHK) and on their turns (named
    # barriers), and no longer on the whole CTA: one CTA barrier in the kernel, the one
    # that publishes the mbarriers' initialisation.  No copy in the consumers' main loop.
    rows = [r for r in FWD_ROWS if r.decoupled]
    assert len(rows) == 8
    for inst in rows:
        code = _report.sass_instructions(report[inst.name_expression]["sass_text"])
        turn, wait_s = producer_and_consumer_turns(code, inst.name_expression, producer=40, consumers=232)
        assert not any(x.startswith("LDGSTS") for x in code[turn:code.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", wait_s)])


def test_dkdv_loop_issues_its_products_right_after_the_barrier(report):
    # The deterministic dK/dV kernels (no atomic dQ); the atomic-dQ kernels (atomics or bulk
    # reductions) load the next block's statistics before their products (after them the
    # d = 128 row spills): about 100 instructions there.
    rows = [r for r in BWD_ROWS if "dkdv" in r.name_expression and not r.atomic_dq]
    assert rows
    for inst in rows:
        code = _report.sass_instructions(report[inst.name_expression]["sass_text"])
        # the loop over query blocks: its barrier is the one whose products are the S^T batch,
        # the first barrier followed by an HGMMA before the next barrier
        barriers = [i for i, x in enumerate(code) if x.startswith("BAR.SYNC")]
        gaps = []
        for b, nxt in zip(barriers, barriers[1:] + [len(code)]):
            if any(x.startswith("HGMMA") for x in code[b + 1:nxt]):
                gaps.append(barrier_to_first_hgmma(code, b))
        assert gaps, inst.name_expression
        assert gaps[0] <= MAX_BARRIER_TO_HGMMA, (inst.name_expression, gaps)


def test_decoupled_dkdv_leaves_the_copies_to_its_producer_and_takes_turns(report):
    # KernelOptions.decoupled dK/dV rows: the producer warpgroup gives its registers back
    # (USETMAXREG.DEALLOC to 24) and issues every copy; the consumers raise theirs
    # (TRY_ALLOC to 240); one CTA barrier (after the mbarriers' initialisation); each
    # consumer's loop waits on its block's full barrier (SYNCS.PHASECHK), then for its
    # turn (a named barrier), issues the S^T and dP^T batch and passes the turn on
    # (BAR.ARV) before it waits for S^T.
    rows = [r for r in BWD_ROWS if r.decoupled]
    assert len(rows) == 4
    for inst in rows:
        code = _report.sass_instructions(report[inst.name_expression]["sass_text"])
        turn, wait_s = producer_and_consumer_turns(code, inst.name_expression, producer=24, consumers=240)
        hgmma = [i for i in range(turn, wait_s) if code[i].startswith("HGMMA")]
        passed = [i for i in range(turn, wait_s) if "BAR.ARV" in code[i]]
        assert hgmma and passed and max(hgmma) < min(passed), inst.name_expression


def test_kernels_sass_prints_one_section_per_matching_row(report):
    name = FWD_ROWS[0].name_expression
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _report.main_kernels(["--arch", "sm_90a", "--sass", name]) == 0
    text = out.getvalue()
    matching = [r for r in FWD_ROWS + BWD_ROWS if name in r.name_expression]
    assert text.count("Function : ") == len(matching) >= 1
    assert report[name]["sass_text"] in text
    assert report[name]["sass"] == _report.parse_sass(report[name]["sass_text"])[report[name]["mangled"]]


def test_kernels_sass_90a_takes_only_the_architecture_specific_rows():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _report.main_kernels(["--arch", "sm_90a", "--sass", "fwd_simt"]) == 2
    assert "no kernel" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert _report.main_kernels(["--arch", "sm_90a", "--arch", "sm_80", "--sass", "x"]) == 2
