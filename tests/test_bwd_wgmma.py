"""bwd_wgmma, the Hopper backward kernels (cuda_src/bwd_wgmma.cu, sm_90a), without a GPU.

Dispatch: bwd_wgmma follows the forward's switch (``CUPYFLASH_WGMMA=1``, on
compute capability 9.0 only), for the head dims of
:data:`~cupyflash._kernels.WGMMA_BWD_HEAD_DIMS` (64, 128, 192, 256; the others
of bwd_mma's in between keep bwd_mma, and d below a wgmma head dim runs
zero-padded in it).  From 192 on dV and dK are two launches and the dQ kernel
always runs.

Static tier: every row compiled offline by NVRTC for sm_90a -- no spills, no
stack, no local memory; per block pair the SASS issues the HGMMA count of its
products and no HMMA or ldmatrix.

Emulated tier: the kernels through :func:`cupyflash._gpu_bwd.backward` on an
emulated sm_90 (shuffled threads, race check, wgmma ordering checks), against
the float64 oracle with the half-precision yardstick of
tests/test_backward_emulated.py: tails in both axes, GQA, causal and window
masks with Lq < Lk and Lq > Lk, padded head dims, rows with no key, strided
and broadcast views, deterministic runs bit-identical, and the atomic dQ path
leaving dK and dV bit for bit as the deterministic one computes them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import _gpu, _gpu_bwd, _report
from cupyflash._kernels import (WGMMA_BWD_HEAD_DIMS, bwd_wgmma_dq_keys, bwd_wgmma_tiles, compile_target,
                                instantiations, launchable)
from cupyflash._launch import backward_kernel, backward_launch_config
from cupyflash.emulator import EmulatorExecutor, emulator_available

from _util import HALF, accum_dtype, poisoned, random_array, wgmma_hazard_notes, wgmma_module_log
from test_backward_emulated import Case, qkv

ROWS = [r for r in instantiations() if r.family == "bwd_wgmma"]

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


def _kernels(dtype, d, arch=90, **kw):
    return [backward_kernel(r) for r in _gpu_bwd.select(dtype, d, d, arch, aligned=True, **kw)]


def _grads(row):
    """The kGrads of a bwd_wgmma_dkdv_kernel row (1 dV, 2 dK, 4 atomic dQ)."""
    return int(row.name_expression.rstrip(">").rsplit(",", 1)[1])


# ---- the catalogue and the dispatcher -----------------------------------------------------------

def test_select_picks_bwd_wgmma_only_on_sm90_when_enabled(monkeypatch):
    monkeypatch.delenv(_gpu.WGMMA_ENV, raising=False)
    for dtype in ("float16", "bfloat16"):
        for d in (40, 64, 100, 128, 192, 248, 256):
            bucket = min(b for b in WGMMA_BWD_HEAD_DIMS if b >= d)
            rows = _gpu_bwd.select(dtype, d, d, 90, aligned=True, wgmma=True)
            split = bucket > 128   # dV, then dK
            assert [backward_kernel(r) for r in rows] == (
                ["bwd_simt_dot_do_o_kernel"] + ["bwd_wgmma_dkdv_kernel"] * (1 + split) + ["bwd_wgmma_dq_kernel"])
            assert {r.head_dim for r in rows[1:]} == {bucket}
            assert [_grads(r) for r in rows[1:-1]] == ([1, 2] if split else [3])
            fast = _gpu_bwd.select(dtype, d, d, 90, aligned=True, wgmma=True, deterministic=False)
            if split:   # a warpgroup's dQ slice would not be whole pages: the dQ kernel runs
                assert fast == rows
            else:
                assert [backward_kernel(r) for r in fast] == ["bwd_simt_dot_do_o_kernel", "bwd_wgmma_dkdv_kernel"]
                assert fast[1].name_expression == rows[1].name_expression.replace(", 3>", ", 7>")
            assert "bwd_wgmma_dkdv_kernel" not in _kernels(dtype, d)   # default: off
            for arch in (80, 86, 89, 100, 120):
                assert "bwd_mma_dkdv_kernel" in _kernels(dtype, d, arch, wgmma=True)
        for d in (32, 96, 160, 200, 224):   # bwd_mma's head dims between wgmma's keep bwd_mma
            assert "bwd_mma_dkdv_kernel" in _kernels(dtype, d, wgmma=True)
        unaligned = _gpu_bwd.select(dtype, 64, 64, 90, aligned=False, wgmma=True)
        assert {r.family for r in unaligned} == {"bwd_simt"}
        assert {r.family for r in _gpu_bwd.select(dtype, 64, 48, 90, aligned=True, wgmma=True)} == {"bwd_simt"}
    monkeypatch.setenv(_gpu.WGMMA_ENV, "1")
    assert _kernels("bfloat16", 128)[1] == "bwd_wgmma_dkdv_kernel"
    monkeypatch.setenv(_gpu.WGMMA_ENV, "0")
    assert _kernels("bfloat16", 128)[1] == "bwd_mma_dkdv_kernel"


def test_only_sm90_compiles_and_launches_bwd_wgmma():
    names = {r.name_expression for r in ROWS}
    # per dtype and head dim four rows: dK/dV (deterministic and atomic-dQ) and dQ, or
    # (192, 256) dV, dK and dQ -- and the dQ kernel's whole-stream row
    assert len(ROWS) == 2 * len(WGMMA_BWD_HEAD_DIMS) * 4 == len(names)
    assert sum(r.whole_kv for r in ROWS) == 2 * len(WGMMA_BWD_HEAD_DIMS)
    assert all(backward_kernel(r) == "bwd_wgmma_dq_kernel" for r in ROWS if r.whole_kv)
    assert set(bwd_wgmma_tiles()) == set(WGMMA_BWD_HEAD_DIMS)
    assert names <= launchable(90)
    for arch in (80, 86, 89, 100, 120):
        assert not names & launchable(arch)
    assert compile_target("bwd_wgmma.cu", "sm_90") == "sm_90a"
    assert compile_target("bwd_wgmma.cu", "sm_86") is None


def test_launch_config_and_shared_memory():
    sizes = dict(batch=2, heads_q=6, heads_kv=3, seqlen_q=1000, seqlen_k=333)
    for r in ROWS:
        grid, block, shared = backward_launch_config(r, **sizes)
        d, kernel = r.head_dim, backward_kernel(r)
        assert block == (r.threads, 1, 1)
        if kernel == "bwd_wgmma_dkdv_kernel":
            own, streamed = r.block_n, r.block_m
            assert r.threads == 2 * own and grid == (2 * 3 * math.ceil(333 / own), 1, 1)
            grads = _grads(r)
            # K (and V for dK); two stages of Q, dO and of lse, delta; the dS^T tile; 1 KB alignment
            assert shared == ((2 if grads & 2 else 1) * own * d * 2 + 2 * 2 * streamed * d * 2
                              + 2 * 2 * streamed * 4 + (own * streamed * 2 if grads & 4 else 0) + 1024)
        else:
            own, streamed = r.block_m, r.block_n
            assert r.threads == 2 * own and grid == (2 * 6 * math.ceil(1000 / own), 1, 1)
            assert shared == 2 * own * d * 2 + 2 * 2 * streamed * d * 2 + 2 * 2 * streamed * 4 + 1024
        assert shared <= 227 * 1024


def test_select_picks_the_whole_stream_dq_row_only_for_whole_key_blocks_at_the_bucket(monkeypatch):
    # the dQ kernel's K/V copies without bounds (kWholeStream) need every key block whole
    # and d = the bucket; the dK/dV kernels have no such rows (ptxas did worse without
    # their bounds at 255 registers)
    for d in WGMMA_BWD_HEAD_DIMS:
        keys = bwd_wgmma_dq_keys(d)
        plain = _gpu_bwd.select("bfloat16", d, d, 90, aligned=True, wgmma=True)
        whole = _gpu_bwd.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_q=4096, seqlen_k=3 * keys)
        assert whole[:-1] == plain[:-1] and not any(r.whole_kv for r in plain)
        assert whole[-1].whole_kv and whole[-1].name_expression == plain[-1].name_expression[:-1] + ", true>"
        for seqlen_k in (keys + 1, 3 * keys - 8, None):
            assert _gpu_bwd.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_k=seqlen_k) == plain
        assert not any(r.whole_kv for r in _gpu_bwd.select("bfloat16", d - 8, d - 8, 90, aligned=True, wgmma=True,
                                                           seqlen_k=4096))
        monkeypatch.setattr(_gpu, "whole_kv_override", False)
        assert _gpu_bwd.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_k=4096) == plain
        monkeypatch.setattr(_gpu, "whole_kv_override", None)


# ---- static: NVRTC for sm_90a -------------------------------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(("sm_80", "sm_90"), ROWS)


def test_every_kernel_compiles_for_sm90a_without_spills(report):
    assert {(r["arch"], r["target"], r["name"]) for r in report} == \
        {("sm_90", "sm_90a", r.name_expression) for r in ROWS}
    for r in report:
        sass = r["sass"]
        assert not (r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]), r["name"]
        assert not (sass.get("LDL") or sass.get("STL")), r["name"]
        assert r["occupancy"] >= 1 and r["registers"] <= 255, r["name"]


def test_sass_issues_the_hgmma_of_each_product_and_no_ldmatrix(report):
    insts = {i.name_expression: i for i in ROWS}
    for r in report:
        inst, sass = insts[r["name"]], r["sass"]
        d = inst.head_dim
        if backward_kernel(inst) == "bwd_wgmma_dkdv_kernel":
            # S^T (d / 16), dV (streamed / 16); dP^T (d / 16), dK (streamed / 16); atomic dQ (own keys / 16)
            own, streamed, grads = inst.block_n, inst.block_m, _grads(inst)
            expected = d // 16 + (streamed // 16 if grads & 1 else 0) + (d // 16 + streamed // 16 if grads & 2 else 0)
            if grads & 4:
                expected += own // 16
                assert any(k.startswith(("RED", "ATOM")) for k in sass), r["name"]   # dq += by atomics
        else:
            # S, dP (d / 16 each), dQ (streamed keys / 16)
            expected = 2 * d // 16 + inst.block_n // 16
        assert sass.get("HGMMA") == expected, (r["name"], sass.get("HGMMA"), expected)
        # not serialized by ptxas (C7514: a WARPGROUP.ARRIVE / DEPBAR pair around every HGMMA)
        assert sass.get("WARPGROUP", 0) < expected // 2, (r["name"], sass.get("WARPGROUP"))
        assert not sass.get("HMMA") and not sass.get("LDSM"), r["name"]
        assert sass.get("LDGSTS", 0) > 0 and sass.get("MUFU", 0) > 0, r["name"]


def test_ptxas_repairs_no_wgmma_ordering_hazard(report):
    # as tests/test_fwd_wgmma.py (which shows the check firing on a planted kernel)
    assert not wgmma_hazard_notes(wgmma_module_log(ROWS))


# ---- emulated: the kernels -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ex90():
    return EmulatorExecutor(arch=90, seed=9090, shuffle=True, race_check=True)


@pytest.fixture
def wgmma_on(monkeypatch):
    monkeypatch.setenv(_gpu.WGMMA_ENV, "1")


def _run(case: Case, executor, *, deterministic=True, grads=None):
    dq, dk, dv = case.grads() if grads is None else grads
    _gpu_bwd.backward(case.dout, case.q, case.k, case.v, case.out, case.lse, dq, dk, dv, scale=case.scale,
                      window_left=case.window[0], window_right=case.window[1], gqa_ratio=case.gqa_ratio,
                      deterministic=deterministic, executor=executor)
    return dq, dk, dv


def _families(case: Case, deterministic=True):
    rows = _gpu_bwd.select(case.dtype, case.q.shape[-1], case.v.shape[-1], 90,
                           aligned=_gpu.rows_aligned(case.q, case.k, case.v, case.dout),
                           deterministic=deterministic)
    return [backward_kernel(r) for r in rows]


# (dtype, run-time head dim): each bucket at its own size and padded below it.
KERNEL_CASES = ([(dtype, d) for dtype in HALF for d in (64, 128, 192, 256)]
                + [(HALF[0], 40), (HALF[-1], 104), (HALF[0], 248)])


@needs_emulator
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim", KERNEL_CASES,
                         ids=[f"{np.dtype(c[0]).name}-d{c[1]}" for c in KERNEL_CASES])
def test_every_instantiation_matches_oracle_and_atomic_dq_leaves_dk_dv_alone(ex90, wgmma_on, dtype, head_dim,
                                                                            causal):
    rng = np.random.default_rng(head_dim + 7 * causal)
    # Tails in both axes: partial query and key blocks; two query heads per kv head.
    q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=2, seqlen_q=150, seqlen_k=2 * 128 + 21, head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if causal else (None, None))
    split = head_dim > 128   # dV and dK apart, and no atomic dQ
    assert _families(case)[1:] == ["bwd_wgmma_dkdv_kernel"] * (1 + split) + ["bwd_wgmma_dq_kernel"]
    exact = _run(case, ex90)
    case.check(exact)
    if split:
        return
    assert _families(case, deterministic=False)[1:] == ["bwd_wgmma_dkdv_kernel"]
    fast = _run(case, ex90, deterministic=False)   # dq poisoned: zeroed, then added to
    case.check(fast)
    assert np.array_equal(fast[1], exact[1]) and np.array_equal(fast[2], exact[2])


@needs_emulator
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim", [(dtype, d) for dtype in HALF for d in WGMMA_BWD_HEAD_DIMS],
                         ids=[f"{np.dtype(dtype).name}-d{d}" for dtype in HALF for d in WGMMA_BWD_HEAD_DIMS])
def test_whole_stream_dq_rows_match_oracle(ex90, wgmma_on, dtype, head_dim, causal):
    from test_fwd_mma import Recorder

    rng = np.random.default_rng(head_dim + 3 * causal + 1)
    # Lk two whole key blocks of the dQ kernel, Lq a tail: the dQ kernel's whole-stream row
    keys = bwd_wgmma_dq_keys(head_dim)
    q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=2, seqlen_q=90, seqlen_k=2 * keys, head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if causal else (None, None))
    recorder = Recorder(ex90)
    case.check(_run(case, recorder))
    dq_launches = [n for n in recorder.launched if n.startswith("cf::bwd_wgmma_dq_kernel")]
    assert len(dq_launches) == 1 and dq_launches[0].endswith(", true>"), recorder.launched


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 300)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(16, 0), (0, 0), (5, 40), (None, 9), (130, None)],
                         ids=["w16-0", "w0-0", "w5-40", "wN-9", "w130-N"])
def test_masks_match_oracle(ex90, wgmma_on, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q * 3 + seqlen_k)
    q, k, v = qkv(rng, np.float16, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64)
    case = Case(rng, q, k, v, window=window)
    assert "bwd_wgmma_dq_kernel" in _families(case)
    case.check(_run(case, ex90))
    case.check(_run(case, ex90, deterministic=False))


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(ex90, wgmma_on):
    rng = np.random.default_rng(31)
    # causal with Lq > Lk: the first 260 query rows see no key
    q, k, v = qkv(rng, np.float16, seqlen_q=300, seqlen_k=40, head_dim=64)
    case = Case(rng, q, k, v, window=(None, 0))
    for deterministic in (True, False):
        dq, dk, dv = _run(case, ex90, deterministic=deterministic)
        case.check((dq, dk, dv))
        assert (dq[:, :, :260] == 0).all()
    # a window that no query row of the first 20 keys reaches
    q, k, v = qkv(rng, np.float16, seqlen_q=40, seqlen_k=200, head_dim=128)
    case = Case(rng, q, k, v, window=(0, 0))
    dq, dk, dv = _run(case, ex90)
    case.check((dq, dk, dv))
    assert (dk[:, :, :160] == 0).all() and (dv[:, :, :160] == 0).all()


@needs_emulator
def test_strided_broadcast_views_and_bit_identical_runs(wgmma_on):
    # (B, L, H, d) storage seen as (B, H, L, d); k broadcast over heads (stride 0);
    # v every other row; gradients written through transposed views.
    rng = np.random.default_rng(19)
    b, h, lq, lk, d = 2, 2, 75, 140, 128
    dtype = np.dtype(HALF[-1])
    q = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    k = np.broadcast_to(random_array(rng, (b, 1, lk, d), dtype), (b, h, lk, d))
    v = random_array(rng, (b, h, 2 * lk, d), dtype)[:, :, ::2]
    dout = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    case = Case(rng, q, k, v, window=(60, 4), dout=dout)
    assert _families(case)[1:] == ["bwd_wgmma_dkdv_kernel", "bwd_wgmma_dq_kernel"]
    acc = accum_dtype(dtype)
    runs = []
    for seed in (5, 6):
        grads = (poisoned((b, lq, h, d), acc).transpose(0, 2, 1, 3), poisoned((b, h, lk, d), acc),
                 poisoned((lk, b, h, d), acc).transpose(1, 2, 0, 3))
        runs.append(_run(case, EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=True),
                         grads=grads))
    case.check(runs[0])
    for a, c in zip(*runs):
        assert np.array_equal(a, c)


@needs_emulator
def test_atomic_dq_needs_8_byte_aligned_dq_rows_else_the_dq_kernel_runs(ex90, wgmma_on):
    # The atomic dQ adds float pairs with 8-byte vector reductions (the emulator traps on a
    # misaligned pair).  A dq whose rows are 4-byte aligned only gets the deterministic
    # kernels instead -- with the same result.
    rng = np.random.default_rng(41)
    q, k, v = qkv(rng, np.float16, seqlen_q=70, seqlen_k=90, head_dim=64)
    case = Case(rng, q, k, v, window=(None, 0))
    assert not _gpu.rows_aligned(poisoned((1, 1, 70, 65), np.float32)[..., 1:], boundary=8)
    assert _gpu.rows_aligned(poisoned((1, 1, 70, 64), np.float32), boundary=8)
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
        _run(case, Recording(), deterministic=False, grads=grads)
        case.check(grads)
        odd = dq_storage[-1] % 2
        assert ("cf::bwd_wgmma_dq_kernel" in launched) == bool(odd), launched
