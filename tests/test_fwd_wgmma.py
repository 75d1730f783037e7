"""fwd_wgmma, the Hopper forward kernel (cuda_src/fwd_wgmma.cu, sm_90a), without a GPU.

Dispatch: fwd_wgmma is opt-in (``CUPYFLASH_WGMMA=1``) on compute capability 9.0
only, for the head dims of whole 64-column pages.

Static tier: every fwd_wgmma row compiled offline by NVRTC for sm_90a (its only
target) -- no spills, no stack, no local memory; the SASS issues HGMMA
(wgmma) and cp.async and no ldmatrix (the tensor cores read Q, K and V from
shared memory through descriptors).

Emulated tier: the emulator's wgmma (cupyflash/emulator/include/wgmma.cuh)
against NumPy, each ordering rule of cuda_src/wgmma.cuh broken on purpose
(tests/emulator_planted/wgmma_planted.cu), then the kernel itself through
:func:`cupyflash._gpu.forward` on an emulated sm_90, with the accuracy
criterion of tests/test_fwd_mma.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cupyflash import _gpu, _kernels, _report
from cupyflash._kernels import WGMMA_HEAD_DIMS, compile_target, instantiations, launchable
from cupyflash._launch import launch_config
from cupyflash.emulator import EmulatorError, EmulatorExecutor, emulator_available

from _util import bfloat16, poisoned, random_array, wgmma_hazard_notes, wgmma_module_log
from test_fwd_mma import HALF_DTYPES, HALF_IDS, Recorder, qkv, run_mma

WGMMA_ROWS = [r for r in instantiations() if r.family == "fwd_wgmma"]
PROBE = str(Path(__file__).resolve().parent / "emulator_planted" / "wgmma_planted.cu")
PROBE_SHARED = 2 * 64 * 64 * 2 + 1024   # A and B pages, and the slack to align them
# Each wgmma product of fwd_wgmma.cu and bwd_wgmma.cu as the kernels call it (its
# header lists what it covers beyond PROBE's single instruction).
PRODUCTS = str(Path(__file__).resolve().parent / "emulator_planted" / "wgmma_products.cu")
PRODUCT_FORMS = {0: "fwd-S=QKt-d128", 1: "fwd-O=PV-d128", 2: "bwd-own-stream-d128", 3: "bwd-accumulate-d128",
                 4: "bwd-atomic-dq-d128", 5: "bwd-atomic-dq-d64", 6: "fwd-S=QKt-d256", 7: "fwd-O=PV-d256",
                 8: "bwd-own-stream-d256", 9: "bwd-accumulate-d256"}
# form -> (shape of the first input, of the second, how they multiply): "abt" A B^T,
# "ab" A B, "dq" 0.5 A^T B (the tile holds dS^T)
_PRODUCT_SHAPES = {0: ((128, 128), (128, 128), "abt"), 1: ((128, 128), (128, 128), "ab"),
                   2: ((128, 128), (64, 128), "abt"), 3: ((128, 64), (64, 128), "ab"),
                   4: ((128, 64), (128, 128), "dq"), 5: ((128, 128), (128, 64), "dq"),
                   6: ((128, 256), (64, 256), "abt"), 7: ((128, 64), (64, 256), "ab"),
                   8: ((128, 256), (32, 256), "abt"), 9: ((128, 32), (32, 256), "ab")}
PRODUCT_THREADS = 256
PRODUCT_SHARED = (128 * 256 + 64 * 256) * 2 + 1024   # the largest form's tiles (6), and the alignment slack

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


# ---- the catalogue and the dispatcher -----------------------------------------------------------

def test_select_picks_fwd_wgmma_only_on_sm90_when_enabled(monkeypatch):
    monkeypatch.delenv(_gpu.WGMMA_ENV, raising=False)
    assert not _gpu.wgmma_enabled()
    for dtype in HALF_IDS:
        for d in (64, 100, 128, 192, 256):
            bucket = min(b for b in WGMMA_HEAD_DIMS if b >= d)
            on = _gpu.select(dtype, d, d, 90, aligned=True, wgmma=True)
            assert (on.family, on.head_dim) == ("fwd_wgmma", bucket)
            assert _gpu.select(dtype, d, d, 90, aligned=True).family == "fwd_mma"  # default: off
            for arch in (80, 86, 89, 100, 120):
                assert _gpu.select(dtype, d, d, arch, aligned=True, wgmma=True).family == "fwd_mma"
        for d in (32, 96, 160, 224):   # between pages: fwd_mma's own head dims
            assert _gpu.select(dtype, d, d, 90, aligned=True, wgmma=True).family == "fwd_mma"
        assert _gpu.select(dtype, 64, 64, 90, aligned=False, wgmma=True).family == "fwd_simt"
        assert _gpu.select(dtype, 64, 64, 90, aligned=True, scale=-1.0, wgmma=True).family == "fwd_simt"
        assert _gpu.select(dtype, 64, 48, 90, aligned=True, wgmma=True).family == "fwd_simt"
    monkeypatch.setenv(_gpu.WGMMA_ENV, "1")
    assert _gpu.select("bfloat16", 128, 128, 90, aligned=True).family == "fwd_wgmma"
    monkeypatch.setenv(_gpu.WGMMA_ENV, "0")
    assert _gpu.select("bfloat16", 128, 128, 90, aligned=True).family == "fwd_mma"


def test_select_picks_the_whole_kv_row_only_for_whole_key_blocks_at_the_bucket(monkeypatch):
    # as fwd_mma's: K/V copies without bounds need every key block whole and d = the bucket
    for d in WGMMA_HEAD_DIMS:
        plain = _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True)
        whole = _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_k=3 * plain.block_n)
        assert plain.family == whole.family == "fwd_wgmma" and not plain.whole_kv and whole.whole_kv
        assert whole.name_expression == plain.name_expression[:-1] + ", false, true>"
        assert (whole.block_m, whole.block_n, whole.threads, whole.lazy_rescale) == \
            (plain.block_m, plain.block_n, plain.threads, plain.lazy_rescale)
        for seqlen_k in (plain.block_n + 1, 3 * plain.block_n - 8, None):
            assert _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_k=seqlen_k) == plain
        assert not _gpu.select("bfloat16", d - 8, d - 8, 90, aligned=True, wgmma=True, seqlen_k=4096).whole_kv
        assert _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True, split=True, seqlen_k=4096).split
        assert not _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True, split=True, seqlen_k=4096).whole_kv
        monkeypatch.setattr(_gpu, "whole_kv_override", False)
        assert _gpu.select("bfloat16", d, d, 90, aligned=True, wgmma=True, seqlen_k=4096) == plain
        monkeypatch.setattr(_gpu, "whole_kv_override", None)


def test_only_sm90_compiles_and_launches_fwd_wgmma():
    names = {r.name_expression for r in WGMMA_ROWS}
    assert len(WGMMA_ROWS) == 2 * 3 * len(WGMMA_HEAD_DIMS)   # two dtypes; each split-KV and whole-KV row
    assert sum(r.split for r in WGMMA_ROWS) == 2 * len(WGMMA_HEAD_DIMS)
    assert sum(r.whole_kv for r in WGMMA_ROWS) == 2 * len(WGMMA_HEAD_DIMS)
    assert not any(r.split and r.whole_kv for r in WGMMA_ROWS)
    assert names <= launchable(90)
    for arch in (80, 86, 89, 100, 120):
        assert not names & launchable(arch)
    assert compile_target("fwd_wgmma.cu", "sm_90") == "sm_90a"
    assert compile_target("fwd_wgmma.cu", "sm_80") is None
    assert compile_target("fwd_mma.cu", "sm_90") == "sm_90"


def test_launch_config_and_shared_memory():
    for inst in WGMMA_ROWS:
        grid, block, shared = launch_config(inst, batch=2, heads=3, seqlen_q=1000, seqlen_k=77)
        assert block == (inst.threads, 1, 1) and inst.threads == 2 * inst.block_m
        assert grid == (2 * 3 * -(-1000 // inst.block_m), 1, 1)
        assert shared == (inst.block_m + 4 * inst.block_n) * inst.head_dim * 2 + 1024
        assert shared <= 227 * 1024


# ---- static: NVRTC for sm_90a -------------------------------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(("sm_80", "sm_90"), WGMMA_ROWS)


def test_every_wgmma_kernel_compiles_for_sm90a_without_spills(report):
    assert {(r["arch"], r["target"], r["name"]) for r in report} == \
        {("sm_90", "sm_90a", r.name_expression) for r in WGMMA_ROWS}
    for r in report:
        sass = r["sass"]
        assert not (r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]), r["name"]
        assert not (sass.get("LDL") or sass.get("STL")), r["name"]
        assert r["occupancy"] >= 1 and r["registers"] <= 255, r["name"]


def test_sass_issues_hgmma_per_key_block_and_no_ldmatrix(report):
    # Per key block a warpgroup issues d/16 wgmma for S = Q K^T and block_n/16 for O += P V;
    # the code holds them twice: the first block's S and the last block's P V are peeled
    # off the software-pipelined loop.
    insts = {i.name_expression: i for i in WGMMA_ROWS}
    for r in report:
        inst, sass = insts[r["name"]], r["sass"]
        assert sass.get("HGMMA") == 2 * (inst.head_dim // 16 + inst.block_n // 16), (r["name"], sass.get("HGMMA"))
        # not serialized by ptxas (C7514: a WARPGROUP.ARRIVE / DEPBAR pair around every HGMMA)
        assert sass.get("WARPGROUP", 0) < sass["HGMMA"] // 2, (r["name"], sass.get("WARPGROUP"))
        assert not sass.get("HMMA") and not sass.get("LDSM"), r["name"]
        assert sass.get("LDGSTS", 0) > 0 and sass.get("MUFU", 0) > 0, r["name"]


def test_ptxas_repairs_no_wgmma_ordering_hazard(report):
    # C7517 / C7514 in the ptxas log: the compiler moved an accumulator read above its
    # wait, and ptxas waited (or serialized) on its own
    assert not wgmma_hazard_notes(wgmma_module_log(WGMMA_ROWS))


def compile_planted_sm90a(source: str, names) -> tuple[str, bytes, dict]:
    """(ptxas log, cubin, lowered names) of a planted file compiled by NVRTC for sm_90a with
    the loader's options (tests/test_gpu_wgmma.py loads the cubin)."""
    from cupyflash._loader import COMPILE_OPTIONS
    from cupyflash._report import _include_options, _nvrtc
    from cupyflash._source import assemble

    options = COMPILE_OPTIONS + _include_options() + (
        "-arch=sm_90a", "--device-as-default-execution-space", "-ftz=true", "--ptxas-options=-v")
    return _nvrtc().compile(assemble(source), list(names), options, Path(source).name)


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
    from test_emulator import planted_params

    rng = np.random.default_rng(21)
    inp = rng.standard_normal(2048).astype(np.float32)
    out = np.full(64 * 64, np.nan, np.float32)
    executor.launch(PROBE, f"wgmma_probe<{'true' if regs_a else 'false'}>", 1, 128,
                    PROBE_SHARED, planted_params(inp, out, None, 0, flags))
    return inp, out.reshape(64, 64)


def _bf16_round(x):
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def product_case(form: int, seed: int = 0):
    """Inputs of wgmma_products<form> (two row-major float32 matrices, one after the other),
    its output buffer as the kernel needs it (NaN, or zero for the atomic dQ forms), the
    float64 product NumPy expects from the inputs rounded to bfloat16, the same product
    of absolute values, and the number of terms each element sums."""
    rng = np.random.default_rng(seed + form)
    shape_a, shape_b, how = _PRODUCT_SHAPES[form]
    a, b = (rng.standard_normal(shape).astype(np.float32) for shape in (shape_a, shape_b))
    ar, br = _bf16_round(a), _bf16_round(b)
    if how == "abt":            # S = Q K^T, X = A B^T: both K-major
        expected, bound, terms = ar @ br.T, np.abs(ar) @ np.abs(br).T, shape_a[1]
    elif how == "ab":           # O = P V, G = X Z: B MN-major
        expected, bound, terms = ar @ br, np.abs(ar) @ np.abs(br), shape_a[1]
    else:                       # dq = 0.5 dS K
        expected, bound, terms = 0.5 * ar.T @ br, 0.5 * np.abs(ar).T @ np.abs(br), shape_a[0]
    out = np.zeros(expected.size, np.float32) if how == "dq" else np.full(expected.size, np.nan, np.float32)
    return np.concatenate([a.ravel(), b.ravel()]), out, expected, bound, terms


def check_product(out, expected, bound, terms):
    """float32 accumulation of exact bfloat16 products: within 8 units of float32 rounding
    per term summed (tensor cores need not round to nearest); a misread layout or
    descriptor is off by the size of the terms."""
    out = out.reshape(expected.shape)
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} elements never written"
    err, tol = np.abs(out - expected), terms * 2.0 ** -21 * bound
    worst = np.unravel_index(np.argmax(err / (bound + 1e-30)), err.shape)
    assert (err <= tol).all(), (f"element {worst}: {out[worst]} vs {expected[worst]}; "
                                f"{int((err > tol).sum())} of {err.size} elements wrong")


@needs_emulator
@pytest.mark.parametrize("regs_a, flags", [(False, 0), (True, 0), (False, 64)],
                         ids=["A-shared", "A-registers", "A-and-B-MN-major"])
def test_wgmma_product_matches_numpy(probe_ex, regs_a, flags):
    inp, out = _probe(probe_ex, regs_a, flags)
    a, b = _bf16_round(inp[:1024]).reshape(64, 16), _bf16_round(inp[1024:]).reshape(16, 64)
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
    from test_emulator import planted_params

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


@pytest.fixture
def wgmma_on(monkeypatch):
    monkeypatch.setenv(_gpu.WGMMA_ENV, "1")


@needs_emulator
@pytest.mark.parametrize("inst", WGMMA_ROWS, ids=lambda r: f"{r.dtype}-d{r.head_dim}{'-split' if r.split else ''}"
                                                         f"{'-whole' if r.whole_kv else ''}")
def test_every_instantiation_matches_oracle_with_tails_and_causal_mask(ex90, wgmma_on, inst):
    if inst.dtype == "bfloat16" and bfloat16 is None:
        pytest.skip("needs ml_dtypes")
    dtype = bfloat16 if inst.dtype == "bfloat16" else np.dtype(inst.dtype)
    rng = np.random.default_rng(inst.head_dim)
    # Tails in both axes: a partial query block and a partial key block (three key
    # blocks: a split-KV row runs one per split, the causal case with some empty);
    # a whole-KV row three whole key blocks (the dispatcher's condition for it).
    seqlen_k = 3 * inst.block_n if inst.whole_kv else 2 * inst.block_n + 21
    q, k, v = qkv(rng, dtype, seqlen_q=inst.block_m + 19, seqlen_k=seqlen_k, head_dim=inst.head_dim)
    splits = 3 if inst.split else 1
    for window in ((None, None), (None, 0)):
        recorder = Recorder(ex90)
        run_mma(recorder, q, k, v, window=window, family="fwd_wgmma", splits=splits)
        assert recorder.launched[0] == inst.name_expression


@needs_emulator
@pytest.mark.parametrize("head_dim", [40, 104, 184, 248], ids=["d40", "d104", "d184", "d248"])
def test_padded_head_dims_match_oracle(ex90, wgmma_on, head_dim):
    # Columns beyond d are zero-filled in shared memory and never stored (rows stay 16-byte aligned).
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, np.float16, batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    run_mma(ex90, q, k, v, family="fwd_wgmma")


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 300)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (5, 40), (130, None)],
                         ids=["causal", "w16-0", "w5-40", "w130-N"])
def test_masks_match_oracle(ex90, wgmma_on, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q * 3 + seqlen_k)
    q, k, v = qkv(rng, np.float16, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64)
    run_mma(ex90, q, k, v, window=window, family="fwd_wgmma")


@needs_emulator
def test_rows_with_no_key_are_zero_with_lse_minus_inf(ex90, wgmma_on):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, np.float16, seqlen_q=300, seqlen_k=40, head_dim=64)
    out, lse = run_mma(ex90, q, k, v, window=(None, 0), family="fwd_wgmma")
    assert (out[:, :, :260] == 0).all()
    assert np.isneginf(lse[:, :, :260]).all() and np.isfinite(lse[:, :, 260:]).all()
    out, lse = run_mma(ex90, q, k, v, window=(0, 0), family="fwd_wgmma")
    np.testing.assert_array_equal(out[0, 0, 260:], v[0, 0])


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_gqa_strides_and_transposed_views(ex90, wgmma_on, dtype):
    rng = np.random.default_rng(12)
    b, hkv, ratio, lq, lk, d = 2, 2, 2, 70, 90, 128
    q = random_array(rng, (b, lq, hkv * ratio, d), dtype).transpose(0, 2, 1, 3)
    k = random_array(rng, (b, hkv, 2 * lk, d), dtype)[:, :, ::2]
    v = random_array(rng, (b, hkv, lk, d), dtype)[:, :, ::-1]
    out = poisoned((b, lq, hkv * ratio, d), dtype).transpose(0, 2, 1, 3)
    lse = poisoned((b, lq, hkv * ratio), np.float32).transpose(0, 2, 1)
    assert _gpu.rows_aligned(q, k, v, out)
    run_mma(ex90, q, k, v, out=out, lse=lse, gqa_ratio=ratio, window=(20, 5), family="fwd_wgmma")


@needs_emulator
def test_without_lse_and_growing_row_maxima(ex90, wgmma_on):
    # Scores growing by 12 (log2) per 128-key block: the lazy rescale moves its reference.
    rng = np.random.default_rng(13)
    d, lk = 64, 3 * 128 + 5
    a = (np.arange(lk) // 128) * 12.0 * np.log(2) / (d ** 0.5)
    q = (1.0 + 0.1 * rng.standard_normal((1, 1, 40, d))).astype(np.float16)
    k = (a[:, None] + 0.05 * rng.standard_normal((lk, d)))[None, None].astype(np.float16)
    v = random_array(rng, (1, 1, lk, d), np.float16)
    run_mma(ex90, q, k, v, family="fwd_wgmma")
    run_mma(ex90, q, k, v, with_lse=False, family="fwd_wgmma")


def test_wgmma_rows_are_in_the_catalogue_table():
    assert set(_kernels.wgmma_tiles()) == set(WGMMA_HEAD_DIMS)


def test_generated_wgmma_wrappers_are_up_to_date():
    from cupyflash import _gen_wgmma
    from cupyflash._source import cuda_src_dir

    text = (cuda_src_dir() / "wgmma.cuh").read_text()
    assert _gen_wgmma.header_text(text) == text, "run python -m cupyflash._gen_wgmma"
    # ss, rs_mn and ss_mn per type and n
    assert text.count("wgmma.mma_async.sync.aligned.m64n") == 3 * len(_gen_wgmma.TYPES) * len(_gen_wgmma.NS)
