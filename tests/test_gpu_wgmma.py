"""Tier 1: fwd_wgmma and bwd_wgmma, the Hopper kernels, on a real sm_90 GPU (H100, H200).

The wgmma kernels are opt-in (``CUPYFLASH_WGMMA=1``) until this tier has passed
on a device; every test here turns them on.  The matrix of tests/test_gpu_mma.py for
the head dims fwd_wgmma serves (padded ones too): tails in both axes, causal
and window masks with Lq < Lk and Lq > Lk, GQA/MQA, strided views, rows with
no key, and (B, H, L, d) = (4, 16, 8192, 128) against a float32 reference,
bit-identical across runs; outputs poisoned with NaN before each launch, and
a check that fwd_wgmma is the kernel that ran.  First, one wgmma of each
operand form the kernels use (tests/emulator_planted/wgmma_planted.cu)
against NumPy, then each product of the kernels as they call it
(tests/emulator_planted/wgmma_products.cu): together they isolate a misread
descriptor or layout.  The backward: bwd_wgmma's
head dims (padded ones too) with GQA, tails, causal and window masks, both
deterministic, with dQ by atomics and by bulk reductions, against the float64 oracle
(tests/_backward_util.py's check_gradients); deterministic runs bit-identical and
dK, dV the same bit for bit either way.  The decoupled forward (CUPYFLASH_DECOUPLED)
bit-identical to the coupled one.  Skipped on other GPUs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash._families import BACKWARD, Call, select
from cupyflash._options import ASYNC_DQ_ENV, WGMMA_ENV, KernelOptions

from _backward_util import check_gradients
from _emulator_util import PLANTED_DTYPE, bf16_round
from _fuzz_util import BACKWARD_SCALES, NUMPY_MAX_LEN, check_backward, check_forward, problems
from _kernel_util import (HALF_DTYPES, HALF_IDS, MASK_LENGTHS, MASK_WINDOWS, PROBE, PROBE_SHARED, PRODUCT_FORMS,
                          PRODUCT_SHARED, PRODUCT_THREADS, PRODUCTS, attention_on_gpu, check_against_oracle,
                          check_head_dim, check_long_sequence, check_masks, check_product, compile_planted_sm90a,
                          launched, product_case)  # noqa: F401
from _util import random_array, random_qkv

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def sm90_only():
    arch = int(cp.cuda.Device().compute_capability)
    if arch != 90:
        pytest.skip(f"fwd_wgmma runs on sm_90 (compute capability 9.0) only; this GPU is sm_{arch}")


@pytest.fixture(autouse=True)
def wgmma_on(monkeypatch):
    monkeypatch.setenv(WGMMA_ENV, "1")


# ---- one wgmma per operand form, on the device ------------------------------------------------
# The emulator's reading of the PTX ISA (descriptors, MN-major strides, register
# layouts) against the hardware, one instruction at a time: if the kernels below
# fail, these say which operand form is misread.

def _planted_sm90a(tmp_path_factory, source: str, names: list[str]) -> dict:
    """``{name: cupy Function}`` of the planted file ``source`` compiled by NVRTC for sm_90a
    and loaded as a cubin (as cupyflash's loader does for the wgmma kernels)."""
    _log, cubin, lowered = compile_planted_sm90a(source, names)
    path = tmp_path_factory.mktemp("wgmma_planted") / (Path(source).stem + ".cubin")
    path.write_bytes(cubin)
    module = cp.RawModule(path=str(path))
    return {n: module.get_function(lowered[n]) for n in names}


@pytest.fixture(scope="module")
def probe_module(tmp_path_factory):
    return _planted_sm90a(tmp_path_factory, PROBE, ["wgmma_probe<true>", "wgmma_probe<false>"])


@pytest.fixture(scope="module")
def products_module(tmp_path_factory):
    return _planted_sm90a(tmp_path_factory, PRODUCTS, [f"wgmma_products<{f}>" for f in PRODUCT_FORMS])


@pytest.mark.parametrize("regs_a, flags", [(False, 0), (True, 0), (False, 64)],
                         ids=["ss-K-major", "rs-B-MN-major", "ss-A-and-B-MN-major"])
def test_one_wgmma_of_each_operand_form_matches_numpy(probe_module, regs_a, flags):
    rng = np.random.default_rng(21)
    inp = rng.standard_normal(2048).astype(np.float32)
    inp_d = cp.asarray(inp)
    out_d = cp.full(64 * 64, cp.nan, dtype=cp.float32)
    params = np.array((inp_d.data.ptr, out_d.data.ptr, 0, 0, flags), dtype=PLANTED_DTYPE)[()]
    kernel = probe_module[f"wgmma_probe<{'true' if regs_a else 'false'}>"]
    kernel((1,), (128,), (params,), shared_mem=PROBE_SHARED)
    out = cp.asnumpy(out_d).reshape(64, 64)
    a, b = bf16_round(inp[:1024]).reshape(64, 16), bf16_round(inp[1024:]).reshape(16, 64)
    np.testing.assert_allclose(out, a @ b, rtol=1e-6, atol=1e-6)


# Then each product of the kernels, called as the kernels call it (page-crossing k-steps,
# the second warpgroup's rows, N = 32 to 256, MN-major operands over two and four pages,
# the atomic dQ's page offsets): if a kernel below fails and the one-instruction forms
# pass, these say which product is misread.
@pytest.mark.parametrize("form", sorted(PRODUCT_FORMS), ids=list(PRODUCT_FORMS.values()))
def test_each_kernel_product_matches_numpy(products_module, form):
    inp, out, expected, bound, terms = product_case(form)
    inp_d, out_d = cp.asarray(inp), cp.asarray(out)
    kernel = products_module[f"wgmma_products<{form}>"]
    kernel.max_dynamic_shared_size_bytes = PRODUCT_SHARED
    params = np.array((inp_d.data.ptr, out_d.data.ptr, 0, 0, form), dtype=PLANTED_DTYPE)[()]
    kernel((1,), (PRODUCT_THREADS,), (params,), shared_mem=PRODUCT_SHARED)
    check_product(cp.asnumpy(out_d), expected, bound, terms)


# ---- fwd_wgmma ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("d", [40, 64, 104, 128, 184, 192, 248, 256])
def test_every_head_dim_runs_fwd_wgmma_and_matches_oracle(rng, launched, dtype, d):  # noqa: F811
    check_head_dim(rng, launched, dtype, d, "cf::fwd_wgmma_kernel")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@MASK_LENGTHS
@MASK_WINDOWS
def test_masks_match_oracle(rng, dtype, seqlen_q, seqlen_k, window):
    check_masks(rng, dtype, seqlen_q, seqlen_k, window)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_rows_with_no_key_gqa_and_strided_views(rng, launched, dtype):  # noqa: F811
    q = random_array(rng, (2, 2, 500, 64), dtype)
    k = random_array(rng, (2, 2, 60, 64), dtype)
    v = random_array(rng, (2, 2, 60, 64), dtype)
    out, lse = attention_on_gpu(q, k, v, causal=True)
    check_against_oracle(out, lse, q, k, v, window=(None, 0))
    assert (out[:, :, :440] == 0).all() and np.isneginf(lse[:, :, :440]).all()
    # GQA 4:1 with (B, L, H, d) storage and every other key row.
    qs = cp.asarray(random_array(rng, (2, 90, 8, 128), dtype)).transpose(0, 2, 1, 3)
    ks = cp.asarray(random_array(rng, (2, 2, 2 * 77, 128), dtype))[:, :, ::2]
    vs = cp.asarray(random_array(rng, (2, 2, 77, 128), dtype))
    out = cupyflash.attention(qs, ks, vs, enable_gqa=True, window=(30, 4), backend="cuda")
    check_against_oracle(cp.asnumpy(out), None, cp.asnumpy(qs), cp.asnumpy(ks), cp.asnumpy(vs),
                         window=(30, 4), gqa_ratio=4)
    assert all(n.startswith("cf::fwd_wgmma_kernel") for n in launched)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_long_sequence_d128_against_float32_reference_and_bit_identical(launched, dtype, causal):  # noqa: F811
    check_long_sequence(launched, dtype, causal, "cf::fwd_wgmma_kernel")


@pytest.mark.parametrize("shape_q, shape_k, causal",
                         [((2, 3, 200, 64), (2, 3, 331, 64), False), ((2, 3, 300, 128), (2, 3, 170, 128), True),
                          ((1, 4, 150, 128), (1, 4, 1027, 128), True), ((4, 16, 8192, 128), (4, 16, 8192, 128), False),
                          ((4, 16, 8192, 128), (4, 16, 8192, 128), True)],
                         ids=["d64-tails", "d128-lq>lk-causal", "d128-9-blocks-causal", "L8192", "L8192-causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_decoupled_forward_is_bit_identical_to_the_coupled_kernel(monkeypatch, rng, launched, dtype, shape_q,
                                                                   shape_k, causal):  # noqa: F811
    # CUPYFLASH_DECOUPLED: the producer warpgroup, mbarriers and the warpgroups' turns order
    # the same products differently in time only -- the outputs of the coupled kernel, bit
    # for bit, and the decoupled row is the one that ran.
    from cupyflash._options import DECOUPLED_ENV
    q, k, v = (cp.asarray(random_array(rng, shape, dtype)) for shape in (shape_q, shape_k, shape_k))
    outs = []
    for decoupled in (True, False):
        monkeypatch.setenv(DECOUPLED_ENV, "1" if decoupled else "0")
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, backend="cuda")
        outs.append((cp.asnumpy(out), cp.asnumpy(lse)))
    assert [n.endswith(", true>") for n in launched] == [True, False], launched
    assert outs[0][0].tobytes() == outs[1][0].tobytes() and outs[0][1].tobytes() == outs[1][1].tobytes()
    if shape_q[2] < 8192:
        check_against_oracle(*outs[0], cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v),
                             window=(None, 0) if causal else (None, None))


# ---- bwd_wgmma ---------------------------------------------------------------------------------

def _backward_both_ways(rng, launched, dtype, shape_q, shape_kv, **kw):  # noqa: F811
    """Forward, then the backward deterministic (twice), with atomic dQ, with dQ by bulk
    reductions (CUPYFLASH_ASYNC_DQ) and, with that switch, deterministic (the ordered dQ,
    twice); checks each against the oracle, each mode's two runs and dK, dV across the
    four modes bit for bit."""
    import os

    q, k, v = random_qkv(rng, shape_q, shape_kv, shape_kv, dtype)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, **kw)
    dout = random_array(rng, out.shape, dtype)
    launched.clear()
    runs = [cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, deterministic=det, **kw)
            for det in (True, True, False)]
    os.environ[ASYNC_DQ_ENV] = "1"
    try:
        runs.append(cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, deterministic=False, **kw))
        # deterministic with async dQ: the key blocks take turns (ordered dQ), twice
        runs += [cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, deterministic=True, **kw)
                 for _ in range(2)]
    finally:
        del os.environ[ASYNC_DQ_ENV]
    d = q.shape[-1]
    expected = [r.name_expression for det, bulk in ((True, False), (True, False), (False, False), (False, True),
                                                    (True, True), (True, True))
                for r in select(BACKWARD, Call(np.dtype(dtype).name, d, d, aligned=True, deterministic=det,
                                               dq_aligned_16=True), 90, KernelOptions(wgmma=True, async_dq=bulk))]
    assert [n for n in launched if "bwd_wgmma" in n] == [n for n in expected if "bwd_wgmma" in n]
    for grads in (runs[0], runs[2], runs[3], runs[4]):
        check_gradients(tuple(cp.asnumpy(g) for g in grads), dout, q, k, v, cp.asnumpy(out), dtype, **kw)
    for first, second in ((runs[0], runs[1]), (runs[4], runs[5])):
        for a, b in zip(first, second):
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "deterministic runs differ"
    for fast in runs[2:]:
        for a, b in zip(runs[0][1:], fast[1:]):
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "dk / dv depend on the dQ mode"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("d", [40, 64, 104, 128, 192, 248, 256])
def test_backward_every_head_dim_runs_bwd_wgmma_and_matches_oracle(rng, launched, dtype, d, causal):  # noqa: F811
    _backward_both_ways(rng, launched, dtype, (2, 4, 333, d), (2, 2, 300, d), causal=causal, enable_gqa=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 170), (150, 420)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(16, 0), (0, 0), (5, 40), (None, 9), (100, None)],
                         ids=["w16-0", "w0-0", "w5-40", "wN-9", "w100-N"])
def test_backward_masks_match_oracle(rng, launched, seqlen_q, seqlen_k, window):  # noqa: F811
    dtype = HALF_DTYPES[-1]
    _backward_both_ways(rng, launched, dtype, (1, 2, seqlen_q, 128), (1, 2, seqlen_k, 128), window=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_large_shape_against_oracle(rng, launched, causal):  # noqa: F811
    """B=1, H=2, L=2048, d=128 (many query and key blocks per CTA), checked in full."""
    _backward_both_ways(rng, launched, HALF_DTYPES[-1], (1, 2, 2048, 128), (1, 2, 2048, 128), causal=causal)


@pytest.mark.parametrize("shape_q, shape_k, causal",
                         [((2, 4, 333, 64), (2, 2, 300, 64), False), ((1, 2, 2048, 128), (1, 2, 2048, 128), True)],
                         ids=["d64-gqa-tails", "d128-L2048-causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_decoupled_dkdv_is_bit_identical_to_the_coupled_kernel(monkeypatch, rng, launched, dtype, shape_q, shape_k,
                                                                causal):  # noqa: F811
    # CUPYFLASH_DECOUPLED on a deterministic backward: the producer warpgroup, mbarriers and
    # turns, and half the streamed query rows per block, sum the same k16 products in the
    # same order -- the coupled kernels' gradients, bit for bit (dQ from the same dQ kernel),
    # and the decoupled dK/dV row is the one that ran.
    from cupyflash._options import DECOUPLED_ENV
    q, k, v = (cp.asarray(random_array(rng, shape, dtype)) for shape in (shape_q, shape_k, shape_k))
    kw = dict(causal=causal, enable_gqa=shape_q[1] != shape_k[1])
    out, lse = cupyflash.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    dout = cp.asarray(random_array(rng, out.shape, dtype))
    launched.clear()
    runs = []
    for decoupled in (True, False):
        monkeypatch.setenv(DECOUPLED_ENV, "1" if decoupled else "0")
        runs.append(cupyflash.attention_backward(dout, q, k, v, out, lse, backend="cuda", **kw))
    dkdv = [n for n in launched if "bwd_wgmma_dkdv_kernel" in n]
    assert [n.endswith(", true>") for n in dkdv] == [True, False], launched
    for a, b in zip(*runs):
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), "the decoupled dK/dV kernel changed a gradient"
    check_gradients(tuple(cp.asnumpy(g) for g in runs[0]), cp.asnumpy(dout), cp.asnumpy(q), cp.asnumpy(k),
                    cp.asnumpy(v), cp.asnumpy(out), dtype, **kw)


# ---- fuzzing: random problems the wgmma kernels take ------------------------------------------
# tests/test_fuzz.py's tensor-core problems (16-bit, d = dv a multiple of 8, aligned rows,
# scale > 0, L up to 300) and its checks, with the wgmma kernels on.

def wgmma_fuzz(examples: int) -> settings:
    # function_scoped_fixture: the autouse wgmma_on sets the switch once for all examples
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@wgmma_fuzz(100)
@given(problems(max_len=NUMPY_MAX_LEN, dtypes=HALF_DTYPES, tensor_core=True))
def test_fuzzed_forward_matches_oracle(problem):
    check_forward(problem, "cuda", cp)


@wgmma_fuzz(50)
@given(problems(max_len=NUMPY_MAX_LEN, dtypes=HALF_DTYPES, scales=BACKWARD_SCALES, tensor_core=True),
       st.booleans())
def test_fuzzed_backward_matches_oracle(problem, deterministic):
    check_backward(problem, "cuda", cp, deterministic=deterministic)
