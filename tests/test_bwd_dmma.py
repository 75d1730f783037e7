"""bwd_dmma, the backward on the FP64 tensor cores (cuda_src/bwd_dmma.cu), without a GPU.

Dispatch: bwd_dmma follows the forward's switch (``CUPYFLASH_DMMA=1`` for
float64, ``float32`` for float32, computed in double) with d = dv up to 128 on
compute capability 8.0 and 9.0, with or without ``deterministic`` (it has no
atomic variant); everything else keeps bwd_simt.  bwd_simt's delta kernel
runs first.

Static tier: every row compiled offline by NVRTC for sm_80, sm_86, sm_89 and
sm_90 -- no spills, no stack, no local memory; the SASS holds the DMMA of one
unrolled copy of each product, shuffles, cp.async (float64) or widening
conversions (float32), and no HMMA, ldmatrix or atomics.

Emulated tier: the kernels through :func:`cupyflash._gpu_bwd.backward` on the
CPU emulator (shuffled threads, race check), gradients NaN-poisoned first,
against the float64 oracle to the dtype's rounding: partial query and key blocks, causal
and window masks with Lq < Lk and Lq > Lk, rows that see no key and keys no row
sees, GQA groups, padded head dims (d = 3 .. 100, rows not 16-byte aligned),
transposed, reversed and broadcast strides; agreement with bwd_simt; runs with
different thread orders bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _gpu, _gpu_bwd, _report
from cupyflash._kernels import DMMA_ARCHS, DMMA_DTYPES, DMMA_HEAD_DIMS, instantiations, launchable
from cupyflash._launch import backward_kernel, backward_launch_config
from cupyflash.emulator import EmulatorExecutor, emulator_available

from _util import LaunchSpy, assert_compiled_clean, logit_rounding
from test_backward_emulated import Case, check_broadcast_and_strided_views, qkv

ROWS = [r for r in instantiations() if r.family == "bwd_dmma"]
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


def _kernels(d, dv=None, arch=90, dtype="float64", **kw):
    return [backward_kernel(r) for r in _gpu_bwd.select(dtype, d, d if dv is None else dv, arch, **kw)]


# ---- the catalogue and the dispatcher -----------------------------------------------------------

def test_select_picks_bwd_dmma_for_float64_on_a100_and_h100_class_gpus_when_enabled(monkeypatch):
    monkeypatch.delenv(_gpu.DMMA_ENV, raising=False)
    dmma = ["bwd_simt_dot_do_o_kernel", "bwd_dmma_dkdv_kernel", "bwd_dmma_dq_kernel"]
    for dtype in DMMA_DTYPES:
        for arch in (80, 86, 89, 90):
            for d in (1, 3, 32, 40, 64, 100, 128):
                for deterministic in (True, False):
                    for aligned in (True, False):
                        rows = _gpu_bwd.select(dtype, d, d, arch, aligned=aligned, deterministic=deterministic,
                                               dmma=True)
                        if arch in DMMA_ARCHS:
                            assert [backward_kernel(r) for r in rows] == dmma
                            assert {r.head_dim for r in rows} == {min(b for b in DMMA_HEAD_DIMS if b >= d)}
                            assert {r.dtype for r in rows} == {dtype}
                        else:
                            assert {r.family for r in rows} == {"bwd_simt"}
                assert "bwd_dmma_dkdv_kernel" not in _kernels(d, arch=arch, dtype=dtype)   # default: off
        # not for dv != d, or head dims above 128
        assert "bwd_dmma_dkdv_kernel" not in _kernels(64, 32, dtype=dtype, dmma=True)
        assert "bwd_dmma_dkdv_kernel" not in _kernels(129, dtype=dtype, dmma=True)
    for dtype in ("float16", "bfloat16"):
        assert "bwd_dmma_dkdv_kernel" not in _kernels(64, dtype=dtype, aligned=True, dmma=True)
    monkeypatch.setenv(_gpu.DMMA_ENV, "1")
    assert _kernels(64) == dmma and "bwd_dmma_dkdv_kernel" not in _kernels(64, dtype="float32")
    monkeypatch.setenv(_gpu.DMMA_ENV, "float32")
    assert _kernels(64, dtype="float32") == dmma and "bwd_dmma_dkdv_kernel" not in _kernels(64)


def test_launchable_only_where_the_fp64_tensor_cores_are_fast():
    names = {r.name_expression for r in ROWS}
    assert len(ROWS) == 2 * len(DMMA_HEAD_DIMS) * len(DMMA_DTYPES) == len(names)   # dK/dV, dQ per head dim
    for arch in (75, 80, 86, 89, 90, 100):
        assert (names <= launchable(arch)) == (arch in DMMA_ARCHS)
        assert (not names & launchable(arch)) == (arch not in DMMA_ARCHS)


def test_launch_config_and_shared_memory():
    sizes = dict(batch=2, heads_q=6, heads_kv=3, seqlen_q=1000, seqlen_k=333)
    for r in ROWS:
        grid, block, shared = backward_launch_config(r, **sizes)
        assert block == (r.threads, 1, 1) and r.dtype in DMMA_DTYPES and r.head_dim == r.head_dim_v
        if backward_kernel(r) == "bwd_dmma_dkdv_kernel":
            own, streamed = r.block_n, r.block_m
            assert grid == (2 * 3 * -(-333 // own), 1, 1)
        else:
            own, streamed = r.block_m, r.block_n
            assert grid == (2 * 6 * -(-1000 // own), 1, 1)
        # K and V (Q and dO), then two stages (float64) or one (float32) of the two
        # streamed tiles, in doubles
        stages = 2 if r.dtype == "float64" else 1
        assert shared == (2 * own + 2 * stages * streamed) * r.head_dim * 8 <= 99 * 1024


# ---- static: NVRTC for sm_80, sm_86, sm_89, sm_90 ---------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(ARCHS, ROWS)


def test_every_kernel_compiles_without_spills_stack_or_local_memory(report):
    assert_compiled_clean(report, ROWS, ARCHS)


def test_sass_issues_the_dmma_of_each_product_and_no_atomics(report):
    # Per streamed block a warp issues, for each of the two score products (S and
    # dP), m_tiles x streamed/8 DMMA per k4 step -- unrolled eight k4 steps deep
    # -- and for each gradient product (dV and dK, or dQ) m_tiles x d/8 per k4 step
    # over the streamed rows, fully unrolled.
    insts = {i.name_expression: i for i in ROWS}
    for r in report:
        inst, sass = insts[r["name"]], r["sass"]
        dkdv = backward_kernel(inst) == "bwd_dmma_dkdv_kernel"
        own, streamed = (inst.block_n, inst.block_m) if dkdv else (inst.block_m, inst.block_n)
        m_tiles = own // (inst.threads // 32) // 8
        scores = 2 * min(8, inst.head_dim // 4) * m_tiles * (streamed // 8)
        gradients = (2 if dkdv else 1) * (streamed // 4) * (inst.head_dim // 8) * m_tiles
        assert sass.get("DMMA") == scores + gradients, (r["arch"], r["name"], sass.get("DMMA"))
        assert sass.get("SHFL", 0) > 0, (r["arch"], r["name"])
        if inst.dtype == "float64":   # cp.async straight into the tiles
            assert sass.get("LDGSTS", 0) > 0, (r["arch"], r["name"])
        else:                         # float32 widened on the way in
            assert sass.get("F2F", 0) > 0 and not sass.get("LDGSTS"), (r["arch"], r["name"])
        assert not any(op.startswith(("HMMA", "LDSM", "ATOM", "RED")) for op in sass), (r["arch"], r["name"])


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=8080, shuffle=True, race_check=True)


@pytest.fixture
def spy(executor, monkeypatch):
    """bwd_dmma on (both dtypes), and a record of the launches on the emulator."""
    monkeypatch.setattr(_gpu, "dmma_override", True)
    monkeypatch.setattr(_gpu, "dmma_float32_override", True)
    return LaunchSpy(executor)


def _bucket(d):
    return min(b for b in DMMA_HEAD_DIMS if b >= d)


@needs_emulator
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", DMMA_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DMMA_DTYPES)
def test_every_instantiation_matches_the_oracle_with_tails_gqa_and_masks(spy, dtype, head_dim, causal):
    own_keys = next(r.block_n for r in ROWS if r.head_dim == head_dim and "dkdv" in r.name_expression)
    rng = np.random.default_rng(head_dim + causal)
    # Partial query and key blocks in both kernels; Lk > Lq so that, causal, key
    # blocks are fully visible, cut by the diagonal and unseen; two query heads per kv head.
    seqlen_q, seqlen_k = 2 * own_keys + 13, 3 * own_keys + 5
    q, k, v = qkv(rng, np.dtype(dtype), heads_kv=2, gqa_ratio=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if causal else (None, None))
    case.check(case.run(spy))
    cxx = "double" if dtype == "float64" else "float"
    assert spy.launched == [f"cf::bwd_simt_dot_do_o_kernel<{cxx}, {head_dim}>"] + [
        r.name_expression for r in ROWS if r.head_dim == head_dim and r.dtype == dtype]


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 133)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (0, 0), (5, 40), (None, 9), (31, None)],
                         ids=["causal", "w16-0", "w0-0", "w5-40", "wN-9", "w31-N"])
def test_masks_match_the_oracle(spy, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    q, k, v = qkv(rng, np.float64, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32)
    case = Case(rng, q, k, v, window=window)
    case.check(case.run(spy))
    assert {n.split("<")[0] for n in spy.launched[1:]} == {"cf::bwd_dmma_dkdv_kernel", "cf::bwd_dmma_dq_kernel"}


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(spy):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key (a whole query block of them).
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, np.float64, seqlen_q=150, seqlen_k=20, head_dim=32)
    case = Case(rng, q, k, v, window=(None, 0))
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dq[:, :, :130] == 0).all()
    # Window (2, 0) with Lq < Lk: keys 0 .. 40 are seen by no row (whole key blocks).
    q, k, v = qkv(rng, np.float64, seqlen_q=30, seqlen_k=73, head_dim=32)
    case = Case(rng, q, k, v, window=(2, 0))
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dk[:, :, :41] == 0).all() and (dv[:, :, :41] == 0).all()


@needs_emulator
@pytest.mark.parametrize("dtype", DMMA_DTYPES)
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(spy, head_dim, dtype):
    # d = 3 and 17: rows of 24 and 136 bytes (float32: 12 and 68), not 16-byte
    # aligned (4-byte cp.async; element-wise converting loads)
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, np.dtype(dtype), batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    case = Case(rng, q, k, v, window=(None, 0))
    case.check(case.run(spy))
    assert spy.launched[1] == next(r.name_expression for r in ROWS if r.head_dim == _bucket(head_dim)
                                   and r.dtype == dtype and "dkdv" in r.name_expression)


@needs_emulator
def test_transposed_reversed_and_broadcast_views(spy):
    check_broadcast_and_strided_views(spy, np.float64)
    assert spy.launched[1].startswith("cf::bwd_dmma_dkdv_kernel<64,")


@needs_emulator
def test_agrees_with_bwd_simt_and_is_bit_identical_across_thread_orders(monkeypatch):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, np.float64, heads_kv=2, gqa_ratio=3, seqlen_q=97, seqlen_k=120, head_dim=64)
    case = Case(rng, q, k, v, gqa_ratio=3, window=(40, 0))
    monkeypatch.setattr(_gpu, "dmma_override", True)
    runs = [case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=False)),
                     deterministic=deterministic)
            for seed, deterministic in ((1, True), (2, False))]
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    monkeypatch.setattr(_gpu, "dmma_override", False)
    simt = case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=3, shuffle=True, race_check=False)))
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], simt):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=name)
    case.check(runs[0])


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(spy, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float64, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=24)
    case = Case(rng, q, k, v)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    if seqlen_k == 0:
        assert (dq == 0).all()
    if seqlen_q == 0:
        assert (dk == 0).all() and (dv == 0).all()
    # a kernel runs only where it has rows to own: dK/dV needs keys, dQ (and delta) query rows
    assert [n.split("<")[0] for n in spy.launched] == (
        ["cf::bwd_simt_dot_do_o_kernel"] * (seqlen_q > 0) + ["cf::bwd_dmma_dkdv_kernel"] * (seqlen_k > 0)
        + ["cf::bwd_dmma_dq_kernel"] * (seqlen_q > 0))


@needs_emulator
@pytest.mark.parametrize("scale", [12.0, -0.7, 0.0], ids=["large", "negative", "zero"])
def test_extreme_and_negative_scales(spy, scale):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float64, seqlen_q=45, seqlen_k=77, head_dim=40)
    case = Case(rng, q, k, v, scale=scale, window=(None, 0))
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv), logits=logit_rounding(q, k, scale))   # scores of ~100: their rounding
    if scale == 0.0:   # P is uniform over the visible keys, and dq, dk carry the factor scale
        assert (dq == 0).all() and (dk == 0).all()
