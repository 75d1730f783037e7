"""fwd_wgmma, the Hopper forward kernel (cuda_src/fwd_wgmma.cu, sm_90a), without a GPU: what is
particular to it.  Its dispatch (opt-in, compute capability 9.0 only, the head dims of
whole 64-column pages), launch geometry, static report (HGMMA, no ldmatrix) and every
instantiation on the emulator are tests/test_families.py's.

Static tier: ptxas repaired no wgmma ordering hazard (and says so where one is planted);
the products probe compiles for sm_90a as the kernels do.

Emulated tier: the emulator's wgmma (cupyflash/emulator/include/wgmma.cuh) against
NumPy, each ordering rule of cuda_src/wgmma.cuh broken on purpose
(tests/emulator_planted/wgmma_planted.cu), then the kernel itself through
:func:`cupyflash._run.forward` on an emulated sm_90, with the accuracy criterion of
tests/_kernel_util.py (check_against_oracle).
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _report, _run
from cupyflash._families import FWD_WGMMA
from cupyflash._families.fwd_wgmma import WGMMA_HEAD_DIMS
from cupyflash._options import KernelOptions
from cupyflash.reference import naive_attention
from cupyflash.emulator import EmulatorError, EmulatorExecutor

from _emulator_util import bf16_round, planted_params
from _kernel_util import (HALF_DTYPES, HALF_IDS, PROBE, PROBE_SHARED, PRODUCT_FORMS, PRODUCT_SHARED,
                          PRODUCT_THREADS, PRODUCTS, check_product, compile_planted_sm90a, needs_emulator,
                          product_case, qkv, run_half_forward)
from _util import LaunchSpy, poisoned, random_array, wgmma_hazard_notes, wgmma_module_log

WGMMA = KernelOptions(wgmma=True)


def run_wgmma(executor, q, k, v, **kw):
    """One forward with fwd_wgmma allowed, checked against the oracle (run_half_forward)."""
    return run_half_forward(executor, q, k, v, family="fwd_wgmma", options=WGMMA, **kw)


# ---- static: NVRTC for sm_90a -------------------------------------------------------------------

@pytest.fixture(scope="module")
def report():
    # the compile of tests/test_families.py's report (sm_90a, every row of the entry)
    return _report.kernel_report(("sm_90",), FWD_WGMMA.rows)


def test_ptxas_repairs_no_wgmma_ordering_hazard(report):
    # C7517 / C7514 in the ptxas log: the compiler moved an accumulator read above its
    # wait, and ptxas waited (or serialized) on its own
    assert report and not wgmma_hazard_notes(wgmma_module_log(FWD_WGMMA.rows))


def test_a_hoisted_accumulator_read_shows_in_the_ptxas_log():
    # the probe's run-time fault flags read accumulators (and change A registers) before
    # wgmma.wait_group: ptxas must say so, or the test above could never fail
    log, _cubin, _lowered = compile_planted_sm90a(PROBE, ["wgmma_probe<false>"])
    notes = wgmma_hazard_notes(log)
    assert any("C7517" in line for line in notes), log


def test_the_products_probe_compiles_for_sm90a_as_the_kernels_do():
    # what tests/test_gpu_wgmma.py loads first on a device: no spills, and no wait or
    # serialization ptxas added (the products would then be timed as nothing else runs)
    log, _cubin, lowered = compile_planted_sm90a(PRODUCTS, [f"wgmma_products<{f}>" for f in PRODUCT_FORMS])
    stats = _report.parse_ptxas_log(log)
    assert len(lowered) == len(PRODUCT_FORMS)
    for name, mangled in lowered.items():
        assert not (stats[mangled]["spill_stores"] or stats[mangled]["stack_bytes"]), name
    assert not wgmma_hazard_notes(log)


# ---- emulated: the wgmma instruction and its ordering rules -------------------------------------

@pytest.fixture(scope="module")
def probe_ex():
    e = EmulatorExecutor(arch=90, seed=3, shuffle=True, race_check=True)
    e.compile(PROBE, ["wgmma_probe<true>", "wgmma_probe<false>"])
    return e


def _probe(executor, regs_a: bool, flags: int = 0):
    rng = np.random.default_rng(21)
    inp = rng.standard_normal(2048).astype(np.float32)
    out = np.full(64 * 64, np.nan, np.float32)
    executor.launch(PROBE, f"wgmma_probe<{'true' if regs_a else 'false'}>", 1, 128,
                    PROBE_SHARED, planted_params(inp, out, None, 0, flags))
    return inp, out.reshape(64, 64)


@needs_emulator
@pytest.mark.parametrize("regs_a, flags", [(False, 0), (True, 0), (False, 64)],
                         ids=["A-shared", "A-registers", "A-and-B-MN-major"])
def test_wgmma_product_matches_numpy(probe_ex, regs_a, flags):
    inp, out = _probe(probe_ex, regs_a, flags)
    a, b = bf16_round(inp[:1024]).reshape(64, 16), bf16_round(inp[1024:]).reshape(16, 64)
    np.testing.assert_allclose(out, a @ b, rtol=1e-6, atol=1e-6)


@needs_emulator
@pytest.mark.parametrize("regs_a, flags, match", [
    (False, 1, "no fence.proxy.async"),
    (True, 1, "no fence.proxy.async"),
    (False, 2, "without a wgmma.fence"),
    (True, 8, "race|overwritten"),
    (True, 16, "changed the A registers"),
    (False, 32, "in flight"),
    (False, 128, "divergent warpgroup.*same wgmma instruction"),
], ids=["no-proxy-fence", "no-proxy-fence-rs", "no-wgmma-fence", "smem-overwritten", "a-regs-changed",
        "no-wait", "two-call-sites"])
def test_broken_ordering_rules_are_reported(probe_ex, regs_a, flags, match):
    with pytest.raises(EmulatorError, match=match):
        _probe(probe_ex, regs_a, flags)


@needs_emulator
@pytest.mark.parametrize("form", sorted(PRODUCT_FORMS), ids=list(PRODUCT_FORMS.values()))
def test_each_kernel_product_matches_numpy(form):
    e = EmulatorExecutor(arch=90, seed=30 + form, shuffle=True, race_check=True)
    inp, out, expected, bound, terms = product_case(form)
    e.launch(PRODUCTS, f"wgmma_products<{form}>", 1, PRODUCT_THREADS, PRODUCT_SHARED,
             planted_params(inp, out, None, 0, form))
    check_product(out, expected, bound, terms)


@needs_emulator
def test_accumulators_read_before_the_wait_are_poison(probe_ex):
    _, out = _probe(probe_ex, False, 4)
    assert np.isnan(out).all()


# ---- emulated: the kernel ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ex90():
    return EmulatorExecutor(arch=90, seed=2090, shuffle=True, race_check=True)


@needs_emulator
@pytest.mark.parametrize("head_dim", [40, 104, 184, 248], ids=["d40", "d104", "d184", "d248"])
def test_padded_head_dims_match_oracle(ex90, head_dim):
    # Columns beyond d are zero-filled in shared memory and never stored (rows stay 16-byte aligned).
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, np.float16, batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    run_wgmma(ex90, q, k, v)


@needs_emulator
def test_rows_with_no_key_are_zero_with_lse_minus_inf(ex90):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, np.float16, seqlen_q=300, seqlen_k=40, head_dim=64)
    out, lse = run_wgmma(ex90, q, k, v, window=(None, 0))
    assert (out[:, :, :260] == 0).all()
    assert np.isneginf(lse[:, :, :260]).all() and np.isfinite(lse[:, :, 260:]).all()
    out, lse = run_wgmma(ex90, q, k, v, window=(0, 0))
    np.testing.assert_array_equal(out[0, 0, 260:], v[0, 0])


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_gqa_strides_and_transposed_views(ex90, dtype):
    rng = np.random.default_rng(12)
    b, hkv, ratio, lq, lk, d = 2, 2, 2, 70, 90, 128
    q = random_array(rng, (b, lq, hkv * ratio, d), dtype).transpose(0, 2, 1, 3)
    k = random_array(rng, (b, hkv, 2 * lk, d), dtype)[:, :, ::2]
    v = random_array(rng, (b, hkv, lk, d), dtype)[:, :, ::-1]
    out = poisoned((b, lq, hkv * ratio, d), dtype).transpose(0, 2, 1, 3)
    lse = poisoned((b, lq, hkv * ratio), np.float32).transpose(0, 2, 1)
    assert _run.rows_aligned(q, k, v, out)
    run_wgmma(ex90, q, k, v, out=out, lse=lse, gqa_ratio=ratio, window=(20, 5))


@needs_emulator
def test_without_lse_and_growing_row_maxima(ex90):
    # Scores growing by 12 (log2) per 128-key block: the lazy rescale moves its reference.
    rng = np.random.default_rng(13)
    d, lk = 64, 3 * 128 + 5
    a = (np.arange(lk) // 128) * 12.0 * np.log(2) / (d ** 0.5)
    q = (1.0 + 0.1 * rng.standard_normal((1, 1, 40, d))).astype(np.float16)
    k = (a[:, None] + 0.05 * rng.standard_normal((lk, d)))[None, None].astype(np.float16)
    v = random_array(rng, (1, 1, lk, d), np.float16)
    run_wgmma(ex90, q, k, v)
    run_wgmma(ex90, q, k, v, with_lse=False)


def test_wgmma_rows_are_in_the_catalogue_table():
    rows = FWD_WGMMA.rows
    assert set(FWD_WGMMA.tiles) == set(WGMMA_HEAD_DIMS) == {r.head_dim for r in rows}
    # each split-KV and whole-KV row, per dtype and head dim (and d = 128's feature tile);
    # the decoupled rows, bounds-checked and whole-KV, per dtype at d = 64 and 128
    coupled = [r for r in rows if not r.decoupled]
    assert (sum(r.split for r in coupled) == sum(r.whole_kv for r in coupled)
            == 2 * (len(WGMMA_HEAD_DIMS) + len(FWD_WGMMA.feature_tiles)))
    assert not any(r.split and r.whole_kv for r in rows)
    decoupled = [(r.dtype, r.head_dim, r.whole_kv) for r in rows if r.decoupled]
    assert sorted(decoupled) == sorted((t, d, w) for t in ("float16", "bfloat16") for d in (64, 128)
                                       for w in (False, True))


@needs_emulator
@pytest.mark.parametrize("timing", ["no-exp", "no-copy"])
def test_timing_only_builds_run_and_leave_out_what_they_say(ex90, timing):
    # KernelOptions.timing (benchmarks/gpu_first_contact.py's table): the forward kernel's
    # module built with CF_TIMING_NO_EXP / CF_TIMING_NO_COPY runs on the emulator without a
    # race or wgmma ordering error, and computes something else than attention: what it
    # leaves out is left out (five key blocks: the copies stop after the second).
    from cupyflash._options import TIMING_BUILDS
    from cupyflash._source import Variant

    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, np.float16, seqlen_q=70, seqlen_k=5 * 192 + 3, head_dim=64)
    spy = LaunchSpy(ex90)
    out = poisoned((1, 1, 70, 64), np.float16)
    lse = poisoned((1, 1, 70), np.float32)
    _run.forward(q, k, v, out, lse, scale=0.125, window_left=None, window_right=None, gqa_ratio=1,
                 executor=spy, options=WGMMA.replace(timing=timing, splits=1))
    ((entry, name),) = spy.entries
    assert name.startswith("cf::fwd_wgmma_kernel") and entry == Variant("fwd_wgmma.cu", ((TIMING_BUILDS[timing], "1"),))
    expected = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=0.125)
    assert not np.allclose(out.astype(np.float64), expected, atol=0.05, equal_nan=False)
    with pytest.raises(ValueError, match="`timing`"):
        KernelOptions(timing="no-softmax")


@needs_emulator
def test_the_loop_before_the_fixes_gives_the_same_outputs(ex90):
    # KernelOptions(timing="before-fixes"): the schedule of before issue 32's fixes 1 and 2
    # (tests/test_wgmma_schedule.py shows its SASS failing both rules), the same arithmetic:
    # the fixed kernel's outputs bit for bit, over five key blocks.
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, np.float16, seqlen_q=70, seqlen_k=5 * 128 + 3, head_dim=128)
    outs = []
    for timing in (None, "before-fixes"):
        out, lse = poisoned((1, 1, 70, 128), np.float16), poisoned((1, 1, 70), np.float32)
        _run.forward(q, k, v, out, lse, scale=0.125, window_left=None, window_right=0, gqa_ratio=1,
                     executor=ex90, options=WGMMA.replace(timing=timing, splits=1))
        outs.append((out, lse))
    assert outs[0][0].tobytes() == outs[1][0].tobytes() and outs[0][1].tobytes() == outs[1][1].tobytes()


# ---- the decoupled (warp-specialised) kernel: KernelOptions.decoupled -------------------------------

DECOUPLED = WGMMA.replace(decoupled=True)


def _forward_once(executor, q, k, v, options, window):
    spy = LaunchSpy(executor)
    out, lse = run_half_forward(spy, q, k, v, window=window, family="fwd_wgmma", options=options)
    (name,) = spy.launched
    return name, out, lse


@needs_emulator
@pytest.mark.parametrize("accumulation", ["exact", "truncate:3"])
def test_decoupled_rows_match_the_coupled_kernel_bit_for_bit(accumulation):
    # The producer warpgroup, the full/empty mbarriers and the warpgroups' turns change
    # when each product runs, not what it computes: the same outputs, bit for bit, under
    # both accumulation models, with the emulator's strict checks (shuffled threads, races,
    # mbarrier phases, named barriers, setmaxnreg).  Six key blocks: each stage's barriers
    # go through three phases (parity 0, 1, 0); causal CTAs see 1 to 6 blocks; d = 64 with
    # whole key blocks and a window; rows with no key at all (every block skipped).
    ex = EmulatorExecutor(arch=90, seed=3290, shuffle=True, race_check=True, accumulation=accumulation)
    rng = np.random.default_rng(32)
    cases = [(np.float16, 150, 5 * 128 + 3, 128, (None, None)), (np.float16, 150, 5 * 128 + 3, 128, (None, 0)),
             (HALF_DTYPES[-1], 140, 4 * 128, 64, (20, 5)), (np.float16, 300, 40, 64, (None, 0))]
    for dtype, lq, lk, d, window in cases:
        q, k, v = qkv(rng, dtype, seqlen_q=lq, seqlen_k=lk, head_dim=d)
        name, out, lse = _forward_once(ex, q, k, v, DECOUPLED, window)
        assert name.endswith(", true>") and FWD_WGMMA.plan(_call_of(q, k, window), 90, DECOUPLED)[0].decoupled
        coupled, out_c, lse_c = _forward_once(ex, q, k, v, WGMMA, window)
        assert coupled != name
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(lse, lse_c)


def _call_of(q, k, window):
    from cupyflash._families import Call
    d = q.shape[-1]
    return Call(np.dtype(q.dtype).name, d, d, seqlen_q=q.shape[2], seqlen_k=k.shape[2],
                aligned=_run.rows_aligned(q, k), scale=d ** -0.5)


def test_decoupled_is_opt_in_and_only_where_it_has_rows():
    # CUPYFLASH_DECOUPLED (KernelOptions.decoupled); d = 64 and 128 only, and not for
    # split-KV, score features, a paged cache or a timing-only build: those keep the
    # coupled rows.
    from cupyflash._families import Call
    from cupyflash._options import DECOUPLED_ENV
    assert KernelOptions.from_environment({DECOUPLED_ENV: "1"}).decoupled
    assert not KernelOptions.from_environment({}).decoupled
    for d in WGMMA_HEAD_DIMS:
        call = Call("bfloat16", d, d, seqlen_q=1000, seqlen_k=1000, aligned=True, scale=d ** -0.5)
        (row,) = FWD_WGMMA.plan(call, 90, DECOUPLED)
        assert row.decoupled == (d in (64, 128)) and row.threads == 256 + 128 * row.decoupled
        assert not FWD_WGMMA.plan(call, 90, WGMMA)[0].decoupled
        for other in ({"split": True}, {"features": frozenset({"bias"})}, {"paged": True}):
            assert not FWD_WGMMA.plan(Call(**{**call.__dict__, **other}), 90, DECOUPLED)[0].decoupled
        assert not FWD_WGMMA.plan(call, 90, DECOUPLED.replace(timing="no-exp"))[0].decoupled
    with pytest.raises(ValueError, match="no decoupled instantiation"):
        FWD_WGMMA.make_row("float16", 192, decoupled=True)
