"""Tier 1: fwd_mma, the tensor-core forward kernel, on a real GPU (sm_80 or later).

The correctness matrix of tests/test_fwd_mma.py on the device through
``cupyflash.attention(..., backend="cuda")`` with CuPy arrays -- every head dim
(padded ones too), tails in both axes, causal and window masks with Lq < Lk and
Lq > Lk, GQA, broadcast kv heads, strided views, lse, rows with no key --
with the same accuracy criterion (at most twice the error of naive
attention with float32 accumulation and P rounded to the input dtype, plus
one ulp at 1.0), a check that fwd_mma is the kernel that ran, and a long
sequence, (B, H, L, d) = (4, 16, 8192, 128), against a float32 CuPy
reference computed head by head.  Outputs are poisoned with NaN before each
launch, and repeated runs must agree bit for bit.

Skipped cleanly without CuPy or a CUDA device (tests/conftest.py), and on
GPUs older than sm_80, where fwd_mma does not apply.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch

from _util import random_array
from test_fwd_mma import HALF_DTYPES, HALF_IDS, ULP_AT_ONE, Recorder, check_against_oracle

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def sm80_or_later():
    arch = int(cp.cuda.Device().compute_capability)
    if arch < 80:
        pytest.skip(f"fwd_mma needs sm_80 or later; this GPU is sm_{arch}")


@pytest.fixture
def launched(monkeypatch):
    """The name expressions launched by cupyflash.attention in this test."""
    recorder = Recorder(_dispatch.executor_for("cuda"))
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: recorder)
    return recorder.launched


def _poisoned(shape, dtype):
    return cp.full(shape, cp.nan, dtype=dtype)


def attention_on_gpu(q, k, v, **kw):
    """cupyflash.attention on CuPy copies of NumPy inputs, into a NaN-poisoned ``out=``;
    returns (out, lse) on the host."""
    out = _poisoned(q.shape[:-1] + (v.shape[-1],), q.dtype)
    result, lse = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out,
                                      return_lse=True, backend="cuda", **kw)
    assert result is out
    return cp.asnumpy(out), cp.asnumpy(lse)


def _window_kw(window):
    left, right = window
    if (left, right) == (None, 0):
        return dict(causal=True)
    return dict(window=window)


# ---- the correctness matrix ----------------------------------------------------------------------

def check_head_dim(rng, launched, dtype, d, kernel):
    """Tails in both axes at head dim ``d``: ``kernel`` ran, the output matches the oracle."""
    q = random_array(rng, (2, 3, 200, d), dtype)
    k = random_array(rng, (2, 3, 331, d), dtype)
    v = random_array(rng, (2, 3, 331, d), dtype)
    out, lse = attention_on_gpu(q, k, v)
    assert [n.split("<")[0] for n in launched] == [kernel]
    check_against_oracle(out, lse, q, k, v)


def check_masks(rng, dtype, seqlen_q, seqlen_k, window):
    """d = 128 under ``window`` (left, right; (None, 0) is causal) against the oracle."""
    q = random_array(rng, (1, 4, seqlen_q, 128), dtype)
    k = random_array(rng, (1, 4, seqlen_k, 128), dtype)
    v = random_array(rng, (1, 4, seqlen_k, 128), dtype)
    out, lse = attention_on_gpu(q, k, v, **_window_kw(window))
    check_against_oracle(out, lse, q, k, v, window=window)


# The mask cases of this file and tests/test_gpu_wgmma.py.
MASK_LENGTHS = pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 170), (150, 420)], ids=["lq>lk", "lq<lk"])
MASK_WINDOWS = pytest.mark.parametrize("window", [(None, 0), (16, 0), (0, 0), (5, 40), (None, 9), (100, None)],
                                       ids=["causal", "w16-0", "w0-0", "w5-40", "wN-9", "w100-N"])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("d", [32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256])
def test_every_head_dim_runs_fwd_mma_and_matches_oracle(rng, launched, dtype, d):
    check_head_dim(rng, launched, dtype, d, "cf::fwd_mma_kernel")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@MASK_LENGTHS
@MASK_WINDOWS
def test_masks_match_oracle(rng, dtype, seqlen_q, seqlen_k, window):
    check_masks(rng, dtype, seqlen_q, seqlen_k, window)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_rows_with_no_key_are_zero_with_lse_minus_inf(rng, dtype):
    q = random_array(rng, (2, 2, 500, 64), dtype)
    k = random_array(rng, (2, 2, 60, 64), dtype)
    v = random_array(rng, (2, 2, 60, 64), dtype)
    out, lse = attention_on_gpu(q, k, v, causal=True)
    check_against_oracle(out, lse, q, k, v, window=(None, 0))
    assert (out[:, :, :440] == 0).all() and np.isneginf(lse[:, :, :440]).all()
    assert np.isfinite(lse[:, :, 440:]).all()


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("heads_q, heads_kv", [(8, 2), (6, 1)], ids=["gqa4", "mqa"])
def test_grouped_and_multi_query_heads(rng, launched, dtype, heads_q, heads_kv):
    q = random_array(rng, (2, heads_q, 190, 64), dtype)
    k = random_array(rng, (2, heads_kv, 250, 64), dtype)
    v = random_array(rng, (2, heads_kv, 250, 64), dtype)
    out, lse = attention_on_gpu(q, k, v, enable_gqa=heads_kv > 1, window=(30, 2))
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_mma_kernel"]
    check_against_oracle(out, lse, q, k, v, window=(30, 2), gqa_ratio=heads_q // heads_kv)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_strided_views_in_and_out(rng, launched, dtype):
    b, h, lq, lk, d = 2, 3, 170, 260, 128
    q_store = random_array(rng, (b, lq, h, d), dtype)      # (B, L, H, d) storage
    k_store = random_array(rng, (b, h, 2 * lk, d), dtype)
    v_store = random_array(rng, (b, h, lk, d), dtype)

    def views(qs, ks, vs):   # (B, H, L, d) views: transposed, every other key row, reversed values
        return qs.transpose(0, 2, 1, 3), ks[:, :, ::2], vs[:, :, ::-1]

    q, k, v = views(q_store, k_store, v_store)
    qg, kg, vg = views(cp.asarray(q_store), cp.asarray(k_store), cp.asarray(v_store))
    out = _poisoned((b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    result = cupyflash.attention(qg, kg, vg, out=out, causal=True, backend="cuda")
    assert result is out and vg.strides[2] < 0
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_mma_kernel"]
    _, lse = cupyflash.attention(qg, kg, vg, causal=True, return_lse=True, backend="cuda")
    check_against_oracle(cp.asnumpy(out), cp.asnumpy(lse), q, k, v, window=(None, 0))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_misaligned_rows_fall_back_to_fwd_simt(rng, launched, dtype):
    q = random_array(rng, (1, 2, 100, 36), dtype)    # rows of 72 bytes
    k = random_array(rng, (1, 2, 120, 36), dtype)
    v = random_array(rng, (1, 2, 120, 36), dtype)
    out, lse = attention_on_gpu(q, k, v, causal=True)
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_simt_kernel"]
    check_against_oracle(out, lse, q, k, v, window=(None, 0))


@pytest.mark.parametrize("scale, kernel", [(1e-30, "cf::fwd_mma_kernel"), (1e-40, "cf::fwd_simt_kernel"),
                                           (4.4e-159, "cf::fwd_simt_kernel")],
                         ids=["tiny", "float32-subnormal", "float32-zero"])
def test_tiny_scales_give_finite_rows(rng, launched, scale, kernel):
    # fwd_mma folds the scale into the exponent as a float32 scale * log2(e) times
    # every score, masked ones (-inf) included: where that factor is 0 -- or a
    # subnormal, which this GPU flushes (-ftz=true) and the emulator does not -- the
    # rows were NaN, so such scales run fwd_simt (the tail block masks key columns)
    q = random_array(rng, (1, 2, 70, 64), HALF_DTYPES[0])
    k = random_array(rng, (1, 2, 90, 64), HALF_DTYPES[0])
    v = random_array(rng, (1, 2, 90, 64), HALF_DTYPES[0])
    out, lse = attention_on_gpu(q, k, v, scale=scale)
    assert [n.split("<")[0] for n in launched] == [kernel]
    check_against_oracle(out, lse, q, k, v, scale=scale)


# ---- a long sequence -------------------------------------------------------------------------------

def _float32_reference(q, k, v, *, causal):
    """Naive attention in float32 on the GPU, one (batch, head) at a time, plus the same
    with P rounded to the input dtype (the naive half-precision error)."""
    ref = cp.empty(q.shape, cp.float32)
    naive = cp.empty(q.shape, q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        mask = cp.arange(lk)[None, :] <= cp.arange(lq)[:, None] + (lk - lq)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = cp.matmul(q[b, h].astype(cp.float32), k[b, h].astype(cp.float32).T) * scale
            if mask is not None:
                s = cp.where(mask, s, -cp.inf)
            s -= s.max(axis=-1, keepdims=True)
            p = cp.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            vf = v[b, h].astype(cp.float32)
            ref[b, h] = cp.matmul(p, vf)
            naive[b, h] = cp.matmul(p.astype(q.dtype).astype(cp.float32), vf).astype(q.dtype)
            del s, p
    return ref, naive


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_long_sequence_d128_against_float32_reference_and_bit_identical(launched, dtype, causal):
    check_long_sequence(launched, dtype, causal, "cf::fwd_mma_kernel")


def check_long_sequence(launched, dtype, causal, kernel):
    """(4, 16, 8192, 128) twice into poisoned outputs: ``kernel`` ran both times, the runs
    agree bit for bit, and the error against the float32 reference is within the criterion."""
    shape = (4, 16, 8192, 128)
    gen = cp.random.default_rng(1234)
    q, k, v = (gen.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3))
    outs = []
    for _ in range(2):
        out = _poisoned(shape, dtype)
        cupyflash.attention(q, k, v, causal=causal, out=out, backend="cuda")
        outs.append(out)
    assert [n.split("<")[0] for n in launched] == [kernel] * 2
    assert not bool(cp.isnan(outs[0].astype(cp.float32)).any())
    assert cp.asnumpy(outs[0]).tobytes() == cp.asnumpy(outs[1]).tobytes(), "runs differ"
    ref, naive = _float32_reference(q, k, v, causal=causal)
    err = float(cp.abs(outs[0].astype(cp.float32) - ref).max())
    naive_err = float(cp.abs(naive.astype(cp.float32) - ref).max())
    assert err <= 2 * naive_err + ULP_AT_ONE[np.dtype(dtype).name], (err, naive_err)
