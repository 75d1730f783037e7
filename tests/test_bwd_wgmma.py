"""bwd_wgmma, the Hopper backward kernels (cuda_src/bwd_wgmma.cu, sm_90a), without a GPU: what is
particular to them.  Their dispatch (the forward's switch, compute capability 9.0 only,
the head dims of whole 64-column pages; dV and dK apart from 192 on; the atomic dQ up to
128), launch geometry, static report (the HGMMA of each product, no ldmatrix) and every
instantiation on the emulator (with the atomic dQ leaving dK and dV bit for bit as the
deterministic kernels compute them) are tests/test_families.py's.

Here: the dQ kernel's whole-stream rows (dispatch and emulator); ptxas repaired no wgmma
ordering hazard; on an emulated sm_90 (shuffled threads, race check, wgmma ordering
checks) through :func:`cupyflash._run.backward`, against the float64 oracle with the
half-precision yardstick of tests/_kernel_util.py's Case: rows with no key, strided and
broadcast views with bit-identical runs, and the atomic dQ's alignment rule; the decoupled
(warp-specialised) dK/dV rows: opt-in, and the coupled kernel's dK and dV bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _report, _run
from cupyflash._families import BACKWARD, BWD_WGMMA, Call, select
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor

from _kernel_util import Case, needs_emulator, qkv
from _util import HALF, LaunchSpy, accum_dtype, poisoned, random_array, wgmma_hazard_notes, wgmma_module_log

WGMMA = KernelOptions(wgmma=True)
WGMMA_BWD_HEAD_DIMS = tuple(BWD_WGMMA.tiles)


def _select(dtype, d, options=WGMMA, **call):
    return select(BACKWARD, Call(dtype, d, d, aligned=True, **call), 90, options)


# ---- the catalogue and dispatch ---------------------------------------------------------------------

def test_only_the_dq_kernel_has_whole_stream_rows():
    rows = BWD_WGMMA.rows
    assert set(WGMMA_BWD_HEAD_DIMS) == {64, 128, 192, 256} == {r.head_dim for r in rows}
    # per dtype one per head dim, and one more per head dim whose calls with score features
    # stream other key blocks (feature_tiles)
    assert sum(r.whole_kv for r in rows) == 2 * (len(WGMMA_BWD_HEAD_DIMS) + len(BWD_WGMMA.feature_tiles))
    assert all(r.kernel == "bwd_wgmma_dq_kernel" for r in rows if r.whole_kv)


def test_select_picks_the_whole_stream_dq_row_only_for_whole_key_blocks_at_the_bucket():
    # the dQ kernel's K/V copies without bounds (kWholeStream) need every key block whole
    # and d = the bucket; the dK/dV kernels have no such rows (ptxas did worse without
    # their bounds at 255 registers)
    for d in WGMMA_BWD_HEAD_DIMS:
        keys = BWD_WGMMA.dq_keys(d)
        plain = _select("bfloat16", d)
        whole = _select("bfloat16", d, seqlen_q=4096, seqlen_k=3 * keys)
        assert whole[:-1] == plain[:-1] and not any(r.whole_kv for r in plain)
        assert whole[-1].whole_kv and whole[-1].name_expression == plain[-1].name_expression[:-1] + ", true>"
        for seqlen_k in (keys + 1, 3 * keys - 8, None):
            assert _select("bfloat16", d, seqlen_k=seqlen_k) == plain
        assert not any(r.whole_kv for r in _select("bfloat16", d - 8, seqlen_k=4096))
        assert _select("bfloat16", d, WGMMA.replace(whole_blocks=False), seqlen_k=4096) == plain


# ---- static: NVRTC for sm_90a -------------------------------------------------------------------

@pytest.fixture(scope="module")
def report():
    # the compile of tests/test_families.py's report (sm_90a, every row of the entry)
    return _report.kernel_report(("sm_90",), BWD_WGMMA.rows)


def test_ptxas_repairs_no_wgmma_ordering_hazard(report):
    # as tests/test_fwd_wgmma.py (which shows the check firing on a planted kernel)
    assert report and not wgmma_hazard_notes(wgmma_module_log(BWD_WGMMA.rows))


# ---- emulated: the kernels -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ex90():
    return EmulatorExecutor(arch=90, seed=9090, shuffle=True, race_check=True)


def _backward(case: Case, executor, *, deterministic=True, grads=None):
    return case.run(executor, grads, deterministic=deterministic)


def _kernels(case: Case, deterministic=True):
    return [r.kernel for r in case.plan(90, deterministic)]


@needs_emulator
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim", [(dtype, d) for dtype in HALF for d in WGMMA_BWD_HEAD_DIMS],
                         ids=[f"{np.dtype(dtype).name}-d{d}" for dtype in HALF for d in WGMMA_BWD_HEAD_DIMS])
def test_whole_stream_dq_rows_match_oracle(ex90, dtype, head_dim, causal):
    rng = np.random.default_rng(head_dim + 3 * causal + 1)
    # Lk two whole key blocks of the dQ kernel, Lq a tail: the dQ kernel's whole-stream row
    keys = BWD_WGMMA.dq_keys(head_dim)
    q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=2, seqlen_q=90, seqlen_k=2 * keys, head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if causal else (None, None), options=WGMMA)
    recorder = LaunchSpy(ex90)
    case.check(_backward(case, recorder))
    dq_launches = [n for n in recorder.launched if n.startswith("cf::bwd_wgmma_dq_kernel")]
    assert len(dq_launches) == 1 and dq_launches[0].endswith(", true>"), recorder.launched


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(ex90):
    rng = np.random.default_rng(31)
    # causal with Lq > Lk: the first 260 query rows see no key
    q, k, v = qkv(rng, np.float16, seqlen_q=300, seqlen_k=40, head_dim=64)
    case = Case(rng, q, k, v, window=(None, 0), options=WGMMA)
    for deterministic in (True, False):
        dq, dk, dv = _backward(case, ex90, deterministic=deterministic)
        case.check((dq, dk, dv))
        assert (dq[:, :, :260] == 0).all()
    # a window that no query row of the first 20 keys reaches
    q, k, v = qkv(rng, np.float16, seqlen_q=40, seqlen_k=200, head_dim=128)
    case = Case(rng, q, k, v, window=(0, 0), options=WGMMA)
    dq, dk, dv = _backward(case, ex90)
    case.check((dq, dk, dv))
    assert (dk[:, :, :160] == 0).all() and (dv[:, :, :160] == 0).all()


@needs_emulator
def test_strided_broadcast_views_and_bit_identical_runs():
    # (B, L, H, d) storage seen as (B, H, L, d); k broadcast over heads (stride 0);
    # v every other row; gradients written through transposed views.
    rng = np.random.default_rng(19)
    b, h, lq, lk, d = 2, 2, 75, 140, 128
    dtype = np.dtype(HALF[-1])
    q = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    k = np.broadcast_to(random_array(rng, (b, 1, lk, d), dtype), (b, h, lk, d))
    v = random_array(rng, (b, h, 2 * lk, d), dtype)[:, :, ::2]
    dout = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    case = Case(rng, q, k, v, window=(60, 4), dout=dout, options=WGMMA)
    assert _kernels(case)[1:] == ["bwd_wgmma_dkdv_kernel", "bwd_wgmma_dq_kernel"]
    acc = accum_dtype(dtype)
    runs = []
    for seed in (5, 6):
        grads = (poisoned((b, lq, h, d), acc).transpose(0, 2, 1, 3), poisoned((b, h, lk, d), acc),
                 poisoned((lk, b, h, d), acc).transpose(1, 2, 0, 3))
        runs.append(_backward(case, EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=True),
                         grads=grads))
    case.check(runs[0])
    for a, c in zip(*runs):
        assert np.array_equal(a, c)


@needs_emulator
def test_atomic_dq_needs_8_byte_aligned_dq_rows_else_the_dq_kernel_runs(ex90):
    # The atomic dQ adds float pairs with 8-byte vector reductions (the emulator traps on a
    # misaligned pair).  A dq whose rows are 4-byte aligned only gets the deterministic
    # kernels instead -- with the same result.
    rng = np.random.default_rng(41)
    q, k, v = qkv(rng, np.float16, seqlen_q=70, seqlen_k=90, head_dim=64)
    case = Case(rng, q, k, v, window=(None, 0), options=WGMMA)
    assert not _run.rows_aligned(poisoned((1, 1, 70, 65), np.float32)[..., 1:], boundary=8)
    assert _run.rows_aligned(poisoned((1, 1, 70, 64), np.float32), boundary=8)
    launched = []

    class Recording:
        arch = ex90.arch

        def launch(self, entry, name, *args):
            launched.append(name.split("<")[0])
            ex90.launch(entry, name, *args)

    for dq_storage in ((1, 1, 70, 64), (1, 1, 70, 65)):
        launched.clear()
        dq = poisoned(dq_storage, np.float32)[..., dq_storage[-1] - 64:]
        grads = (dq,) + case.grads()[1:]
        _backward(case, Recording(), deterministic=False, grads=grads)
        case.check(grads)
        odd = dq_storage[-1] % 2
        assert ("cf::bwd_wgmma_dq_kernel" in launched) == bool(odd), launched


@needs_emulator
def test_async_dq_is_opt_in_and_needs_16_byte_aligned_dq_rows(ex90):
    # KernelOptions.async_dq (CUPYFLASH_ASYNC_DQ) stages dQ in shared memory and adds each row
    # by one bulk reduction, whose global address must be 16-byte aligned: a dq with rows
    # on 8-byte boundaries only gets the atomics, one on 4-byte ones the dQ kernel -- each
    # with the same result; never with score features (their d = 128 tiles take no atomics).
    from cupyflash._options import KernelOptions

    assert KernelOptions.from_environment({"CUPYFLASH_ASYNC_DQ": "1"}).async_dq
    assert not KernelOptions.from_environment({}).async_dq
    bulk = WGMMA.replace(async_dq=True)
    for d in (64, 128):
        plain = _select("float16", d, deterministic=False)[1]
        assert plain.atomic_dq and not plain.bulk_dq
        row = _select("float16", d, bulk, deterministic=False, dq_aligned_16=True)[1]
        assert row.bulk_dq and row.name_expression == plain.name_expression[:-2] + "15>"
        assert _select("float16", d, bulk, deterministic=False, dq_aligned_16=False)[1] == plain
        # deterministic: the same kernel adding in key-block order (at d = 128 with dV
        # launched apart: the fused row spilled)
        ordered = _select("float16", d, bulk, deterministic=True, dq_aligned_16=True)
        assert [r.role for r in ordered] == ["delta"] + ["dkdv"] * (1 if d == 64 else 2)
        assert ordered[-1].ordered_dq and not any(r.atomic_dq for r in ordered[1:-1])
        assert ordered[-1].name_expression == plain.name_expression[:-2] + ("31>" if d == 64 else "30>")
        assert _select("float16", d, bulk, deterministic=True, dq_aligned_16=False) == _select("float16", d)
        assert _select("float16", d, bulk, deterministic=True, dq_aligned_16=True,
                       features=frozenset({"mask"})) == _select("float16", d, features=frozenset({"mask"}))
    assert not any(r.atomic_dq for r in _select("float16", 128, bulk, deterministic=False, dq_aligned_16=True,
                                                features=frozenset({"mask"})))
    assert not any(r.bulk_dq for d in (192, 256)
                   for r in _select("float16", d, bulk, deterministic=False, dq_aligned_16=True))

    rng = np.random.default_rng(43)
    q, k, v = qkv(rng, np.float16, seqlen_q=70, seqlen_k=90, head_dim=64)
    case = Case(rng, q, k, v, window=(None, 0), options=bulk)
    for dq_storage, kind in (((1, 1, 70, 64), 15), ((1, 1, 70, 66), 7), ((1, 1, 70, 65), None)):
        spy = LaunchSpy(ex90)
        dq = poisoned(dq_storage, np.float32)[..., dq_storage[-1] - 64:]
        grads = (dq,) + case.grads()[1:]
        _backward(case, spy, deterministic=False, grads=grads)
        case.check(grads)
        dkdv = next(n for n in spy.launched if "dkdv" in n)
        assert (dkdv.endswith(f", {kind}>") if kind else any("bwd_wgmma_dq_kernel" in n for n in spy.launched)), \
            spy.launched


@needs_emulator
@pytest.mark.parametrize("head_dim, window", [(64, (None, 0)), (128, (None, None)), (128, (70, 10))],
                         ids=["d64-causal", "d128-full", "d128-window"])
def test_ordered_dq_is_the_same_sum_whatever_order_the_blocks_run_in(head_dim, window):
    # async_dq and deterministic: the dK/dV kernel (at d = 128 the dK launch, dV apart)
    # adds dQ by bulk reductions, the key blocks taking turns per query block
    # (kGradDQOrdered); no dQ kernel.  Blocks started
    # in other orders (the emulator suspends a block that waits for its turn and runs
    # another) give the same bits; the window leaves some query blocks without the key
    # block before (their first turn is 0); with GQA each query head has its own turns.
    rng = np.random.default_rng(47)
    q, k, v = qkv(rng, np.float16, heads_kv=1, gqa_ratio=2, seqlen_q=150, seqlen_k=300, head_dim=head_dim)
    case = Case(rng, q, k, v, window=window, gqa_ratio=2, options=WGMMA.replace(async_dq=True))
    plan = case.plan(90, True)
    assert {r.kernel for r in plan[1:]} == {"bwd_wgmma_dkdv_kernel"} and plan[-1].ordered_dq
    runs = []
    for seed in (11, 12, 13):
        runs.append(_backward(case, EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=seed == 11)))
    case.check(runs[0])
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert a.tobytes() == c.tobytes()


@needs_emulator
def test_the_timing_only_backward_runs_without_its_copies(ex90):
    # KernelOptions.timing = "no-copy" (benchmarks/gpu_first_contact.py's backward rows):
    # bwd_wgmma's modules built with CF_TIMING_NO_COPY run on the emulator without a race
    # or wgmma ordering error, and their gradients are not attention's (three query blocks
    # for dK/dV and four key blocks for dQ: the copies stop after the second).  The
    # backward has no "no-exp" build, and a call the other families take refuses it.
    from cupyflash._source import Variant

    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, np.float16, seqlen_q=3 * 128 - 5, seqlen_k=4 * 128 - 9, head_dim=64)
    case = Case(rng, q, k, v, options=WGMMA.replace(timing="no-copy"))
    spy = LaunchSpy(ex90)
    grads = case.run(spy)
    timed = [(e, n) for e, n in spy.entries if "bwd_wgmma" in n]
    assert [n.split("<")[0] for _, n in timed] == ["cf::bwd_wgmma_dkdv_kernel", "cf::bwd_wgmma_dq_kernel"]
    assert all(e == Variant("bwd_wgmma.cu", (("CF_TIMING_NO_COPY", "1"),)) for e, _ in timed)
    for got, want in zip(grads, case.expected()):
        assert not np.allclose(got, want, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="the backward's timing-only builds are"):
        Case(rng, q, k, v, options=WGMMA.replace(timing="no-exp")).run(ex90)
    with pytest.raises(ValueError, match="is built for bwd_wgmma only"):
        Case(rng, q, k, v, options=KernelOptions(timing="no-copy")).run(ex90)


# ---- the decoupled (warp-specialised) dK/dV kernel: KernelOptions.decoupled ----------------------------

DECOUPLED = WGMMA.replace(decoupled=True)


def test_decoupled_dkdv_is_opt_in_and_only_where_it_has_rows():
    # d = 64 and 128 (decoupled_tiles: half the coupled kernel's streamed rows, which its
    # consumers' 240 registers hold), deterministic calls without score features; the dQ
    # kernel is the coupled plan's
    assert set(BWD_WGMMA.decoupled_tiles) == {64, 128}
    for d in WGMMA_BWD_HEAD_DIMS:
        coupled = _select("bfloat16", d)
        plan = _select("bfloat16", d, DECOUPLED)
        if d not in BWD_WGMMA.decoupled_tiles:
            assert plan == coupled
            continue
        dkdv = plan[1]
        assert dkdv.decoupled and dkdv.threads == 384 and dkdv.grads == 3
        assert dkdv.block_m == BWD_WGMMA.decoupled_tiles[d] and dkdv.name_expression.endswith(", 3, true>")
        assert plan[2] == coupled[2] and not any(r.decoupled for r in coupled)
        assert _select("bfloat16", d, DECOUPLED, deterministic=False) == _select("bfloat16", d, deterministic=False)
        with_mask = _select("bfloat16", d, DECOUPLED, features=frozenset({"mask"}))
        assert with_mask == _select("bfloat16", d, features=frozenset({"mask"}))
    with pytest.raises(ValueError, match="no decoupled instantiation"):
        BWD_WGMMA.kernels("float16", 192, decoupled=True)


@needs_emulator
@pytest.mark.parametrize("accumulation", ["exact", "truncate:3"])
def test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit(accumulation):
    # The producer warpgroup and the full/empty mbarriers change when each copy lands and
    # each product runs, and the decoupled rows stream half as many query rows per block --
    # but dK and dV sum the same k16 products in the same order: the same gradients, bit for
    # bit, under both accumulation models, with the emulator's strict checks (shuffled
    # threads, races, mbarrier phases, setmaxnreg).  Two query heads per kv head and six
    # query blocks of each: the CTAs walk 12 blocks, each stage's barriers through six
    # phases; causal CTAs fewer; a window; keys no query row sees (no block at all).
    ex = EmulatorExecutor(arch=90, seed=3291, shuffle=True, race_check=True, accumulation=accumulation)
    rng = np.random.default_rng(33)
    cases = [(np.float16, 330, 130, 64, (None, None), 2), (np.float16, 330, 130, 64, (None, 0), 1),
             (HALF[-1], 170, 140, 128, (20, 5), 2), (np.float16, 40, 200, 128, (0, 0), 1)]
    for dtype, lq, lk, d, window, gqa_ratio in cases:
        q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=gqa_ratio, seqlen_q=lq, seqlen_k=lk, head_dim=d)
        case = Case(rng, q, k, v, gqa_ratio=gqa_ratio, window=window, options=DECOUPLED)
        spy = LaunchSpy(ex)
        decoupled = _backward(case, spy)
        assert [n.endswith(", true>") for n in spy.launched if "dkdv" in n] == [True], spy.launched
        case.check(decoupled)
        case.options = WGMMA
        for got, coupled in zip(decoupled, _backward(case, ex)):
            np.testing.assert_array_equal(got, coupled)
