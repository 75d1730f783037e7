"""Tier 1: fwd_dmma and bwd_dmma, float64 (and the float32 forward) on the FP64 tensor cores, on a real GPU.

The matrices of tests/test_fwd_dmma.py and tests/test_bwd_dmma.py on the device
through ``cupyflash.attention`` and ``cupyflash.attention_backward`` with the
DMMA kernels switched on (they are opt-in until this tier has passed): every
instantiation with tails in both axes, causal and window masks with Lq < Lk
and Lq > Lk, GQA, padded and unaligned head dims, split-KV (forward), a check
that the DMMA kernels are the ones that ran, agreement with fwd_simt and
bwd_simt to float64 rounding on a longer sequence, and repeated runs bit for
bit.  Outputs are poisoned with NaN before each forward launch; gradients are
checked against the float64 CPU backward term by term (tests/_backward_util.py, check_gradients).
Skipped cleanly without CuPy or a CUDA device, and on GPUs other than compute
capability 8.0 and 9.0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash._arch import DMMA_ARCHS
from cupyflash._families import BWD_DMMA, FWD_DMMA
from cupyflash._families.fwd_dmma import DMMA_HEAD_DIMS
from cupyflash._options import DMMA_ENV
from cupyflash.reference import naive_attention

from _backward_util import check_gradients
from _util import assert_close, assert_lse_close, plain_call_rows, random_array

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DMMA_ROWS = plain_call_rows(FWD_DMMA)
BWD_ROWS = plain_call_rows(BWD_DMMA)


@pytest.fixture(scope="module", autouse=True)
def dmma_gpu():
    arch = int(cp.cuda.Device().compute_capability)
    if arch not in DMMA_ARCHS:
        pytest.skip(f"fwd_dmma runs on compute capability 8.0 and 9.0; this GPU is sm_{arch}")


@pytest.fixture
def spy(monkeypatch, cuda_spy):
    """fwd_dmma and bwd_dmma on for both dtypes (the public calls read the switch from the
    environment), and a record of what cupyflash.attention launches in this test."""
    monkeypatch.setenv(DMMA_ENV, "float64,float32")
    return cuda_spy


def check(q, k, v, *, window=(None, None), gqa_ratio=1, repeat=2):
    """cupyflash.attention on the device (NaN-poisoned out=) against the float64 oracle; runs
    ``repeat`` times and requires the same bits each time."""
    left, right = window
    results = []
    for _ in range(repeat):
        out = cp.full(q.shape[:-1] + (v.shape[-1],), cp.nan)
        _, lse = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, return_lse=True,
                                     window=(left, right), enable_gqa=gqa_ratio > 1, backend="cuda")
        results.append((cp.asnumpy(out), cp.asnumpy(lse)))
    for later in results[1:]:
        np.testing.assert_array_equal(later[0], results[0][0])
        np.testing.assert_array_equal(later[1], results[0][1])
    out, lse = results[0]
    ref, ref_lse = naive_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), window=window,
                                   enable_gqa=gqa_ratio > 1, return_lse=True)
    assert not np.isnan(out).any()
    assert_close(out, ref, np.float64)
    assert_lse_close(lse, ref_lse, np.float64)
    return out


def qkv(rng, *, seqlen_q, seqlen_k, head_dim, heads_kv=1, gqa_ratio=1, batch=1):
    return (random_array(rng, (batch, heads_kv * gqa_ratio, seqlen_q, head_dim), np.float64),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float64),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float64))


@pytest.mark.parametrize("inst", DMMA_ROWS, ids=lambda r: f"d{r.head_dim}")
def test_every_instantiation_with_tails_and_masks(spy, inst):
    rng = np.random.default_rng(inst.head_dim)
    q, k, v = qkv(rng, seqlen_q=inst.block_m + 21, seqlen_k=inst.block_m + 2 * inst.block_n + 5,
                  head_dim=inst.head_dim)
    for window in ((None, 0), (None, None)):
        check(q, k, v, window=window)
    assert set(spy.launched) == {inst.name_expression}


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 200)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (5, 40), (70, None)])
def test_masks(spy, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    check(*qkv(rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, heads_kv=2, gqa_ratio=2),
          window=window, gqa_ratio=2)
    assert all("fwd_dmma" in n for n in spy.launched)


@pytest.mark.parametrize("head_dim", [3, 17, 40, 100])
def test_padded_and_unaligned_head_dims(spy, head_dim):
    rng = np.random.default_rng(head_dim)
    check(*qkv(rng, seqlen_q=300, seqlen_k=500, head_dim=head_dim, batch=2))
    bucket = min(b for b in DMMA_HEAD_DIMS if b >= head_dim)
    assert spy.launched[0].startswith(f"cf::fwd_dmma_kernel<{bucket},")


def test_a_split_decoding_step_and_a_long_sequence_agree_with_fwd_simt(spy, monkeypatch):
    rng = np.random.default_rng(7)
    # Lq = 1 over 20000 keys: few CTAs, so the keys are split
    check(*qkv(rng, seqlen_q=1, seqlen_k=20000, head_dim=64, heads_kv=4))
    assert spy.launched[-1] == "cf::fwd_combine_kernel<double, double>"
    q, k, v = qkv(rng, seqlen_q=2048, seqlen_k=2048, head_dim=64, heads_kv=8, batch=2)
    dmma = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True, backend="cuda")
    monkeypatch.setenv(DMMA_ENV, "float32")   # float64 back on the CUDA cores
    simt = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True, backend="cuda")
    np.testing.assert_allclose(cp.asnumpy(dmma), cp.asnumpy(simt), rtol=1e-12, atol=1e-13)


# ---- fwd_dmma in float32: computed in double, rounded once ---------------------------------------

@pytest.mark.parametrize("head_dim", DMMA_HEAD_DIMS + (40,), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("window", [(None, None), (None, 0), (30, 5)], ids=["full", "causal", "w30-5"])
def test_float32_within_one_ulp_of_the_exact_result(spy, head_dim, window):
    rng = np.random.default_rng(head_dim)
    q, k, v = (x.astype(np.float32) for x in qkv(rng, seqlen_q=300, seqlen_k=437, head_dim=head_dim,
                                                 heads_kv=2, gqa_ratio=2))
    outs = []
    for _ in range(2):
        out = cp.full(q.shape, cp.nan, dtype=cp.float32)
        cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, window=window,
                            enable_gqa=True, backend="cuda")
        outs.append(cp.asnumpy(out))
    np.testing.assert_array_equal(outs[1], outs[0])
    ref = naive_attention(*(x.astype(np.float64) for x in (q, k, v)), scale=1 / math.sqrt(head_dim),
                          window=window, enable_gqa=True)
    # one float32 ulp, plus the double computation's own error (~1e-16 of terms of
    # size ~1) for outputs so close to zero that their ulp is smaller
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64) + 1e-13
    assert (np.abs(outs[0].astype(np.float64) - ref) <= ulp).all()
    bucket = min(b for b in DMMA_HEAD_DIMS if b >= head_dim)
    assert spy.launched[0].startswith(f"cf::fwd_dmma_kernel<{bucket},") and spy.launched[0].endswith(", float>")


def test_float32_split_decoding_step(spy):
    # Lq = 1 over 20000 keys: the keys are split, the float32 partials merged by fwd_combine
    rng = np.random.default_rng(8)
    q, k, v = (x.astype(np.float32) for x in qkv(rng, seqlen_q=1, seqlen_k=20000, head_dim=64, heads_kv=4))
    out, lse = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, backend="cuda")
    ref, ref_lse = naive_attention(*(x.astype(np.float64) for x in (q, k, v)), scale=1 / 8, return_lse=True)
    assert_close(cp.asnumpy(out), ref, np.float32)
    assert_lse_close(cp.asnumpy(lse), ref_lse, np.float32)
    assert spy.launched == ["cf::fwd_dmma_kernel<64, 64, 32, 4, float>", "cf::fwd_combine_kernel<float, float>"]


# ---- bwd_dmma ---------------------------------------------------------------------------------

def backward_check(q, k, v, *, seed, repeat=2, **kw):
    """attention (fwd_dmma) then attention_backward on the device, ``repeat`` times with the
    same bits each time; gradients against the float64 CPU backward.  Returns them."""
    rng = np.random.default_rng(seed)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, backend="cuda", **kw)
    dout = random_array(rng, out.shape, np.float64)
    runs = [tuple(cp.asnumpy(g) for g in cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse,
                                                                       backend="cuda", **kw))
            for _ in range(repeat)]
    for later in runs[1:]:
        for a, b in zip(later, runs[0]):
            np.testing.assert_array_equal(a, b)
    check_gradients(runs[0], dout, q, k, v, cp.asnumpy(out), np.float64, **kw)
    return runs[0]


def _bwd_launched(spy):
    return [n for n in spy.launched if n.startswith("cf::bwd_")]


@pytest.mark.parametrize("head_dim", DMMA_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_backward_every_instantiation_with_tails_gqa_and_masks(spy, head_dim):
    own = next(r.block_n for r in BWD_ROWS if r.head_dim == head_dim and "dkdv" in r.name_expression)
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, seqlen_q=2 * own + 13, seqlen_k=3 * own + 5, head_dim=head_dim, heads_kv=2, gqa_ratio=2)
    for causal in (False, True):
        backward_check(q, k, v, seed=head_dim, causal=causal, enable_gqa=True)
    assert set(_bwd_launched(spy)) == {f"cf::bwd_simt_dot_do_o_kernel<double, {head_dim}>"} | {
        r.name_expression for r in BWD_ROWS if r.head_dim == head_dim}


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 200)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (5, 40), (70, None)])
def test_backward_masks(spy, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    backward_check(*qkv(rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, batch=2), seed=5, window=window)
    assert any(n.startswith("cf::bwd_dmma_dq_kernel") for n in spy.launched)


@pytest.mark.parametrize("head_dim", [3, 17, 40, 100])
def test_backward_padded_and_unaligned_head_dims(spy, head_dim):
    rng = np.random.default_rng(head_dim)
    backward_check(*qkv(rng, seqlen_q=300, seqlen_k=500, head_dim=head_dim), seed=head_dim, causal=True)
    bucket = min(b for b in DMMA_HEAD_DIMS if b >= head_dim)
    assert any(n.startswith(f"cf::bwd_dmma_dkdv_kernel<{bucket},") for n in spy.launched)


@pytest.mark.parametrize("head_dim", DMMA_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_backward_float32_computed_in_double(spy, head_dim):
    rng = np.random.default_rng(head_dim + 1)
    q, k, v = (cp.asarray(x.astype(np.float32)) for x in qkv(rng, seqlen_q=333, seqlen_k=517, head_dim=head_dim,
                                                            heads_kv=2, gqa_ratio=2))
    out, lse = cupyflash.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, backend="cuda")
    dout = random_array(rng, out.shape, np.float32)
    runs = [[cp.asnumpy(g) for g in cupyflash.attention_backward(cp.asarray(dout), q, k, v, out, lse, causal=True,
                                                                  enable_gqa=True, backend="cuda")]
            for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    check_gradients(runs[0], dout, cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), cp.asnumpy(out), np.float32,
                    causal=True, enable_gqa=True)
    bucket = min(b for b in DMMA_HEAD_DIMS if b >= head_dim)
    assert f"cf::bwd_dmma_dq_kernel<{bucket}, " in " ".join(spy.launched)
    assert all(n.endswith(", float>") for n in spy.launched if "dmma" in n)


def test_backward_long_sequence_agrees_with_bwd_simt_and_ignores_deterministic(spy, monkeypatch):
    rng = np.random.default_rng(9)
    q, k, v = (cp.asarray(x) for x in qkv(rng, seqlen_q=2048, seqlen_k=2048, head_dim=64, heads_kv=4, batch=2))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
    dout = cp.asarray(random_array(rng, out.shape, np.float64))
    dmma = [cp.asnumpy(g) for g in cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    fast = [cp.asnumpy(g) for g in cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                                 deterministic=False)]
    assert "cf::bwd_dmma_dq_kernel<64, 64, 16, 4>" in spy.launched
    monkeypatch.setenv(DMMA_ENV, "float32")   # float64 back on the CUDA cores
    simt = [cp.asnumpy(g) for g in cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    for name, a, b, c in zip(("dq", "dk", "dv"), dmma, fast, simt):
        np.testing.assert_array_equal(a, b, err_msg=name)   # no atomic variant: the same kernels
        np.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-12, err_msg=name)
