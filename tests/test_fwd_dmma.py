"""fwd_dmma, the forward on the FP64 tensor cores (cuda_src/fwd_dmma.cu), without a GPU.

Dispatch: fwd_dmma is opt-in (``CUPYFLASH_DMMA=1``) for float64 -- and, with
``CUPYFLASH_DMMA=float32``, for float32, computed in double -- with d = dv up
to 128 on compute capability 8.0 and 9.0 (the GPUs whose FP64 tensor cores
double the FP64 rate); everything else keeps fwd_simt.

Static tier: every row compiled offline by NVRTC for sm_80, sm_86, sm_89 and
sm_90 -- no spills, no stack, no local memory; the SASS issues exactly one
unrolled main loop of DMMA (d/4 x tiles for S, block_n/4 x tiles for O),
cp.async for float64 and widening conversions for float32, and no HMMA.

Emulated tier: each instantiation through :func:`cupyflash._gpu.forward` on the
CPU emulator (shuffled threads, race check) against the float64 oracle:
partial query and key blocks, causal and window masks with Lq < Lk and Lq > Lk
(rows that see no key), GQA, padded head dims (d = 3 .. 100), rows that are
not 16-byte aligned, transposed strides, split-KV; outputs NaN-poisoned first.
The instruction itself is checked against the fragment table in
tests/test_emulator.py (fid_mma_f64), and on a GPU against the device.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _gpu, _report
from cupyflash._kernels import DMMA_ARCHS, DMMA_DTYPES, DMMA_HEAD_DIMS, instantiations, launchable
from cupyflash._launch import launch_config
from cupyflash.emulator import EmulatorExecutor, emulator_available
from cupyflash.reference import naive_attention

from _util import assert_compiled_clean, forward_against_oracle, poisoned, random_array

DMMA_ROWS = [r for r in instantiations() if r.family == "fwd_dmma"]
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


# ---- the catalogue and the dispatcher -----------------------------------------------------------

def test_select_picks_fwd_dmma_for_float64_and_float32_on_a100_and_h100_class_gpus_when_enabled(monkeypatch):
    monkeypatch.delenv(_gpu.DMMA_ENV, raising=False)
    assert not _gpu.dmma_enabled() and not _gpu.dmma_enabled("float32")
    for dtype in DMMA_DTYPES:
        for arch in (80, 86, 89, 90):
            for d in (1, 3, 32, 40, 64, 100, 128):
                on = _gpu.select(dtype, d, d, arch, dmma=True)
                if arch in DMMA_ARCHS:
                    assert (on.family, on.dtype, on.head_dim) == (
                        "fwd_dmma", dtype, min(b for b in DMMA_HEAD_DIMS if b >= d))
                else:
                    assert on.family == "fwd_simt"
                assert _gpu.select(dtype, d, d, arch).family == "fwd_simt"   # default: off
        # not for dv != d, or head dims above 128
        assert _gpu.select(dtype, 64, 32, 80, dmma=True).family == "fwd_simt"
        assert _gpu.select(dtype, 129, 129, 90, dmma=True).family == "fwd_simt"
    for dtype in ("float16", "bfloat16"):
        assert _gpu.select(dtype, 64, 64, 80, dmma=True).family != "fwd_dmma"
    # the switch: 1 (or float64) for float64, float32 for float32, both by list or "all"
    for value, on in (("1", {"float64"}), ("float64", {"float64"}), ("float32", {"float32"}),
                      ("float64, float32", {"float64", "float32"}), ("all", {"float64", "float32"}),
                      ("0", set()), ("", set())):
        monkeypatch.setenv(_gpu.DMMA_ENV, value)
        assert {dtype for dtype in DMMA_DTYPES if _gpu.select(dtype, 64, 64, 90).family == "fwd_dmma"} == on


def test_launchable_only_where_the_fp64_tensor_cores_are_fast():
    names = {r.name_expression for r in DMMA_ROWS}
    assert len(DMMA_ROWS) == len(DMMA_HEAD_DIMS) * len(DMMA_DTYPES) == len(names)
    for arch in (75, 80, 86, 89, 90, 100):
        assert (names <= launchable(arch)) == (arch in DMMA_ARCHS)
        assert (not names & launchable(arch)) == (arch not in DMMA_ARCHS)


def test_launch_config_and_shared_memory():
    for inst in DMMA_ROWS:
        grid, block, shared = launch_config(inst, batch=2, heads=3, seqlen_q=1000, seqlen_k=77)
        assert block == (inst.threads, 1, 1) and grid == (2 * 3 * -(-1000 // inst.block_m), 1, 1)
        # Q, K, V tiles of doubles; float32 is widened on the way in: Q and one K/V buffer
        kv_tiles = 2 if inst.dtype == "float64" else 1
        assert shared == (inst.block_m + kv_tiles * inst.block_n) * inst.head_dim * 8 <= 99 * 1024


# ---- static: NVRTC for sm_80, sm_86, sm_89, sm_90 ---------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(ARCHS, DMMA_ROWS)


def test_every_kernel_compiles_without_spills_stack_or_local_memory(report):
    assert_compiled_clean(report, DMMA_ROWS, ARCHS)


def test_sass_issues_one_unrolled_loop_of_dmma(report):
    # per key block a warp issues kMTiles x block_n/8 x d/4 DMMA for S and
    # kMTiles x d/8 x block_n/4 for O: exactly these counts, one copy of the loop
    insts = {i.name_expression: i for i in DMMA_ROWS}
    for r in report:
        inst, sass = insts[r["name"]], r["sass"]
        m_tiles = inst.block_m // (inst.threads // 32) // 8
        expected = m_tiles * (inst.block_n // 8 * inst.head_dim // 4 + inst.head_dim // 8 * inst.block_n // 4)
        assert sass.get("DMMA") == expected, (r["arch"], r["name"], sass.get("DMMA"), expected)
        assert not sass.get("HMMA"), (r["arch"], r["name"])
        if inst.dtype == "float64":   # cp.async straight into the tiles
            assert sass.get("LDGSTS", 0) > 0, (r["arch"], r["name"])
        else:                         # float32 widened on the way in
            assert sass.get("F2F", 0) > 0 and not sass.get("LDGSTS"), (r["arch"], r["name"])


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=80, shuffle=True, race_check=True)


def run_dmma(executor, monkeypatch, *, head_dim, seqlen_q, seqlen_k, window=(None, None), gqa_ratio=1,
             batch=1, heads_kv=1, splits=1, q=None, k=None, v=None, out=None, with_lse=True, seed=0,
             dtype=np.float64):
    """One forward through _gpu.forward with fwd_dmma on, checked against the oracle;
    returns the names launched and the output."""
    monkeypatch.setattr(_gpu, "dmma_override", True)
    monkeypatch.setattr(_gpu, "dmma_float32_override", True)
    monkeypatch.setattr(_gpu, "split_override", splits)
    rng = np.random.default_rng(seed)
    heads = heads_kv * gqa_ratio
    q = random_array(rng, (batch, heads, seqlen_q, head_dim), dtype) if q is None else q
    k = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype) if k is None else k
    v = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype) if v is None else v
    spy, out = forward_against_oracle(executor, q, k, v, window=window, gqa_ratio=gqa_ratio, out=out,
                                      with_lse=with_lse)
    return spy.launched, out


@needs_emulator
@pytest.mark.parametrize("inst", DMMA_ROWS, ids=lambda r: f"{r.dtype}-d{r.head_dim}")
def test_every_instantiation_matches_the_oracle_with_tails_and_masks(executor, monkeypatch, inst):
    # Two query blocks (the second partial), Lk > Lq: key blocks fully visible, cut by
    # the diagonal, skipped, and a partial last one; then the same non-causal.
    seqlen_q, seqlen_k = inst.block_m + 21, inst.block_m + 2 * inst.block_n + 5
    for window in ((None, 0), (None, None)):
        launched, _ = run_dmma(executor, monkeypatch, head_dim=inst.head_dim, seqlen_q=seqlen_q,
                               seqlen_k=seqlen_k, window=window, seed=inst.head_dim, dtype=np.dtype(inst.dtype))
        assert launched == [inst.name_expression]


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 200)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (0, 0), (5, 40), (70, None)],
                         ids=["causal", "w16-0", "w0-0", "w5-40", "w70-N"])
def test_masks_match_the_oracle(executor, monkeypatch, seqlen_q, seqlen_k, window):
    run_dmma(executor, monkeypatch, head_dim=64, seqlen_q=seqlen_q, seqlen_k=seqlen_k, window=window,
             seed=seqlen_q + seqlen_k)


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(executor, monkeypatch, head_dim, dtype):
    # d = 3 and 17: rows of 24 and 136 bytes (float64; 12 and 68 for float32), not
    # 16-byte aligned (4-byte cp.async; element-wise converting loads)
    launched, _ = run_dmma(executor, monkeypatch, head_dim=head_dim, seqlen_q=70, seqlen_k=90, batch=2,
                           seed=head_dim, dtype=dtype)
    assert launched[0].startswith(f"cf::fwd_dmma_kernel<{min(b for b in DMMA_HEAD_DIMS if b >= head_dim)},")


@needs_emulator
def test_gqa_strides_without_lse_and_split_kv(executor, monkeypatch):
    rng = np.random.default_rng(5)
    # q and out as (B, L, H, d) buffers viewed as (B, H, L, d); 3 splits of the keys
    q = random_array(rng, (2, 90, 4, 64), np.float64).transpose(0, 2, 1, 3)
    out = poisoned((2, 90, 4, 64), np.float64).transpose(0, 2, 1, 3)
    k = random_array(rng, (2, 2, 400, 64), np.float64)
    v = random_array(rng, (2, 2, 400, 64), np.float64)
    launched, _ = run_dmma(executor, monkeypatch, head_dim=64, seqlen_q=90, seqlen_k=400, window=(None, 0),
                           gqa_ratio=2, q=q, k=k, v=v, out=out, with_lse=False, splits=3)
    assert launched == ["cf::fwd_dmma_kernel<64, 64, 32, 4>", "cf::fwd_combine_kernel<double, double>"]


@needs_emulator
def test_agrees_with_fwd_simt_to_rounding(executor, monkeypatch):
    rng = np.random.default_rng(11)
    q, k, v = (random_array(rng, (1, 2, 77, 64), np.float64) for _ in range(3))
    _, dmma = run_dmma(executor, monkeypatch, head_dim=64, seqlen_q=77, seqlen_k=77, q=q, k=k, v=v)
    monkeypatch.setattr(_gpu, "dmma_override", False)
    simt = poisoned(q.shape, np.float64)
    _gpu.forward(q, k, v, simt, None, scale=0.125, window_left=None, window_right=None, gqa_ratio=1,
                 executor=executor)
    np.testing.assert_allclose(dmma, simt, rtol=1e-13, atol=1e-14)


@needs_emulator
def test_float32_split_kv_and_gqa(executor, monkeypatch):
    rng = np.random.default_rng(6)
    q = random_array(rng, (1, 4, 50, 64), np.float32)
    k = random_array(rng, (1, 2, 300, 64), np.float32)
    v = random_array(rng, (1, 2, 300, 64), np.float32)
    launched, _ = run_dmma(executor, monkeypatch, head_dim=64, seqlen_q=50, seqlen_k=300, window=(100, 0),
                           gqa_ratio=2, q=q, k=k, v=v, splits=2)
    assert launched == ["cf::fwd_dmma_kernel<64, 64, 32, 4, float>", "cf::fwd_combine_kernel<float, float>"]


@needs_emulator
def test_float32_is_rounded_once_from_double(executor, monkeypatch):
    # Products of float32 inputs are exact in double and the sums are double, so out
    # is the exact attention of the float32 inputs rounded once: within one float32
    # ulp of the float64 oracle element by element (fwd_simt, in float32 arithmetic,
    # is not), and lse likewise.
    rng = np.random.default_rng(12)
    q, k, v = (random_array(rng, (2, 2, 150, 64), np.float32) for _ in range(3))
    _, out = run_dmma(executor, monkeypatch, head_dim=64, seqlen_q=150, seqlen_k=150, q=q, k=k, v=v,
                      window=(None, 0))
    ref = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                          scale=1 / 8, window=(None, 0))
    # one float32 ulp, plus the double computation's own error (~1e-16 of terms of
    # size ~1) for outputs so close to zero that their ulp is smaller
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64) + 1e-13
    assert (np.abs(out.astype(np.float64) - ref) <= ulp).all()
    monkeypatch.setattr(_gpu, "dmma_float32_override", False)
    simt = poisoned(q.shape, np.float32)
    _gpu.forward(q, k, v, simt, None, scale=0.125, window_left=None, window_right=0, gqa_ratio=1,
                 executor=executor)
    assert (np.abs(simt.astype(np.float64) - ref) > ulp).any()   # the yardstick: float32 arithmetic is not
