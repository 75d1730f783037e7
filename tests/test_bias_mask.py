"""``bias=`` and ``mask=`` on the NumPy path: against the float64 oracle, finite
differences, run-to-run identity, the hidden-pair rules, memory and argument checks.

Error rules: docs/testing.md, "Tolerances" (the table for outputs of order 1,
``assert_grad_close`` for dq/dk/dv) and "Bias and masks" in its error analysis
(dbias: the table's atol relative to the sum of |dS| it adds up, the looser of
the inputs' and the bias's dtype).
"""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest

import cupyflash
from cupyflash.reference import naive_attention, naive_attention_backward

from _terms_util import assert_dbias_close, dbias_bound
from _util import (use_cpu_blocks, DTYPES, DTYPE_IDS, assert_close, assert_grad_close, assert_lse_close,
                   random_array, random_qkv)


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


B, H, LQ, LK = 2, 3, 45, 70

# name: shape of each bias term (a tuple of shapes: a tuple of terms), for (B, H, Lq, Lk) scores
BIAS_SHAPES = {
    "11qk": (1, 1, LQ, LK),
    "b11k": (B, 1, 1, LK),          # key padding
    "1hqk": (1, H, LQ, LK),
    "bhqk": (B, H, LQ, LK),
    "bhq1": (B, H, LQ, 1),          # one value per query row: cancels in the softmax
    "bh1k": (B, H, 1, LK),          # one row for every query: dbias summed over the query blocks
    "qk": (LQ, LK),                 # fewer axes than the scores
    "two-terms": ((B, 1, 1, LK), (H, LQ, LK)),
}
MASK_SHAPES = {"11qk": (1, 1, LQ, LK), "b11k": (B, 1, 1, LK), "1hqk": (1, H, LQ, LK), "bhqk": (B, H, LQ, LK)}

# small CPU blocks, so that these sizes take several query and key blocks
SMALL_BLOCKS = dict(key_block=16, score_elements=3 * 16 * 16, min_query_block=8)


@pytest.fixture(params=["default-blocks", "small-blocks"])
def blocks(request, monkeypatch):
    if request.param == "small-blocks":
        use_cpu_blocks(monkeypatch, **SMALL_BLOCKS)
    return request.param


def _bias(rng, shapes, dtype=np.float64):
    if isinstance(shapes[0], tuple):
        return tuple(random_array(rng, s, dtype) for s in shapes)
    return random_array(rng, shapes, dtype)


def _mask(rng, shape, keep=0.7):
    m = rng.random(shape) < keep
    return m


def _check(q, k, v, *, bias=None, mask=None, dtype=None, **kw):
    dtype = np.dtype(q.dtype) if dtype is None else dtype
    out, lse = cupyflash.attention(q, k, v, bias=bias, mask=mask, return_lse=True, **kw)
    ref, ref_lse = naive_attention(q, k, v, bias=bias, mask=mask, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    dout = random_array(_rng("dout", q.shape, kw), out.shape, q.dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, bias=bias, mask=mask, **kw)
    expected = naive_attention_backward(dout, q, k, v, bias=bias, mask=mask, **kw)
    assert len(grads) == (3 if bias is None else 4)
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_grad_close(g, e, dtype, what=name)
    if bias is not None:
        assert_dbias_close(grads[3], expected[3], dbias_bound(dout, q, k, v, bias, dtype, mask=mask, **kw),
                            bias)
    return out, lse, grads


# ---- against the oracle ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(BIAS_SHAPES), ids=list(BIAS_SHAPES))
def test_bias_shapes_match_the_oracle(blocks, shape):
    rng = _rng("bias", shape)
    q, k, v = random_qkv(rng, (B, H, LQ, 16), (B, H, LK, 16), (B, H, LK, 12), np.float64)
    _check(q, k, v, bias=_bias(rng, BIAS_SHAPES[shape]), causal=True)


@pytest.mark.parametrize("shape", list(MASK_SHAPES), ids=list(MASK_SHAPES))
def test_mask_shapes_match_the_oracle(blocks, shape):
    rng = _rng("mask", shape)
    q, k, v = random_qkv(rng, (B, H, LQ, 16), (B, H, LK, 16), (B, H, LK, 16), np.float64)
    mask = _mask(rng, MASK_SHAPES[shape])
    if mask.shape[-2] == LQ:
        mask[..., 3, :] = False                   # a row that sees no key
    _check(q, k, v, mask=mask, window=(20, 5))
    _check(q, k, v, mask=mask, bias=_bias(rng, (B, 1, LQ, LK)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_dtype_with_bias_of_every_dtype(dtype):
    rng = _rng("dtype", dtype)
    q, k, v = random_qkv(rng, (B, H, LQ, 24), (B, H, LK, 24), (B, H, LK, 24), dtype)
    bias = tuple(random_array(rng, s, t) for s, t in
                 (((1, H, LQ, LK), np.float16), ((B, 1, 1, LK), np.float32), ((LQ, LK), np.float64)))
    _check(q, k, v, bias=bias, mask=_mask(rng, (B, 1, LQ, LK)), causal=True)


def test_evoformer_pair_bias_five_dims(blocks):
    # AlphaFold's MSA row attention: (batch, sequences N, heads, L, d), a (B, N, 1, 1, L)
    # mask bias and a (B, 1, H, L, L) pair bias, never summed into (B, N, H, L, L)
    rng = _rng("evoformer")
    n, length = 3, 40
    q, k, v = random_qkv(rng, (B, n, H, length, 8), (B, n, H, length, 8), (B, n, H, length, 8), np.float64)
    padding = np.where(rng.random((B, n, 1, 1, length)) < 0.2, -1e9, 0.0)
    _check(q, k, v, bias=(padding, random_array(rng, (B, 1, H, length, length), np.float64)))


@pytest.mark.parametrize("case", ["gqa", "mqa", "lq<lk", "lq>lk", "dv!=d", "window", "head-dim-8", "head-dim-256"])
def test_bias_and_mask_with_the_other_options(blocks, case):
    rng = _rng("options", case)
    d, dv, lq, lk, hq, hkv, kw = 16, 16, LQ, LK, 4, 4, dict(causal=True)
    if case == "gqa":
        hkv, kw = 2, dict(enable_gqa=True, causal=True)
    elif case == "mqa":
        hkv = 1
    elif case == "lq<lk":
        lq, lk = 9, 60
    elif case == "lq>lk":
        lq, lk = 60, 9                             # rows with no key under causal
    elif case == "dv!=d":
        dv = 40
    elif case == "window":
        kw = dict(window=(7, 3))
    elif case.startswith("head-dim"):
        d = dv = int(case.rsplit("-", 1)[1])
    q, k, v = random_qkv(rng, (B, hq, lq, d), (B, hkv, lk, d), (B, hkv, lk, dv), np.float64)
    bias = (random_array(rng, (1, hq, lq, lk), np.float64), random_array(rng, (B, 1, 1, lk), np.float64))
    _check(q, k, v, bias=bias, mask=_mask(rng, (B, hq, lq, lk), 0.8), **kw)


@pytest.mark.parametrize("lengths", [(0, 7), (7, 0), (0, 0)])
def test_empty_sequences(lengths):
    lq, lk = lengths
    rng = _rng("empty", lengths)
    q, k, v = random_qkv(rng, (2, lq, 8), (2, lk, 8), (2, lk, 8), np.float32)
    bias = (random_array(rng, (lq, lk), np.float32), random_array(rng, (2, 1, lk), np.float16))
    out, lse = cupyflash.attention(q, k, v, bias=bias, mask=np.ones((lq, lk), bool), return_lse=True)
    assert out.shape == (2, lq, 8) and not out.any() and np.isneginf(lse).all()
    dq, dk, dv, dbias = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse, bias=bias)
    assert not dq.any() and not dk.any() and not dv.any()
    assert [(g.shape, g.dtype) for g in dbias] == [((lq, lk), np.float32), ((2, 1, lk), np.float16)]
    assert not any(g.any() for g in dbias)


# ---- the hidden-pair rules -------------------------------------------------------------------


def test_minus_inf_bias_is_a_false_mask_entry():
    rng = _rng("minus-inf")
    q, k, v = random_qkv(rng, (B, H, LQ, 16), (B, H, LK, 16), (B, H, LK, 16), np.float32)
    mask = _mask(rng, (B, 1, LQ, LK))
    mask[0, 0, 5] = False                          # batch 0 row 5 sees no key
    bias = random_array(rng, (1, H, LQ, LK), np.float32)
    with_mask = cupyflash.attention(q, k, v, bias=bias, mask=mask, return_lse=True)
    as_bias = (bias, np.where(mask, np.float32(0), np.float32(-np.inf)))
    with_bias = cupyflash.attention(q, k, v, bias=as_bias, return_lse=True)
    for a, b in zip(with_mask, with_bias):
        np.testing.assert_array_equal(a, b)
    out, lse = with_mask
    assert not out[0, :, 5].any() and np.isneginf(lse[0, :, 5]).all()
    dout = random_array(rng, out.shape, np.float32)
    g_mask = cupyflash.attention_backward(dout, q, k, v, out, lse, bias=bias, mask=mask)
    g_bias = cupyflash.attention_backward(dout, q, k, v, out, lse, bias=as_bias)
    for a, b in zip(g_mask[:3], g_bias[:3]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g_mask[3], g_bias[3][0])
    assert not g_bias[3][1][~np.broadcast_to(mask, g_bias[3][1].shape)].any(), "dbias where a -inf hid the pair"
    assert not g_mask[0][0, :, 5].any(), "dq of the row with no key"
    assert not g_bias[3][1][0, 0, 5].any(), "dbias of the row with no key"
    assert not np.isnan(g_mask[3]).any()


def test_nan_in_bias_poisons_exactly_its_rows_unless_hidden():
    rng = _rng("nan")
    q, k, v = random_qkv(rng, (1, 2, 20, 8), (1, 2, 30, 8), (1, 2, 30, 8), np.float64)
    bias = random_array(rng, (1, 1, 20, 30), np.float64)
    bias[0, 0, 4, 7] = np.nan
    out = cupyflash.attention(q, k, v, bias=bias)
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1)[0], np.tile(np.arange(20) == 4, (2, 1)))
    mask = np.ones((20, 30), bool)
    mask[4, 7] = False                             # the NaN sits on a hidden pair: no effect
    out, lse = cupyflash.attention(q, k, v, bias=bias, mask=mask, return_lse=True)
    assert not np.isnan(out).any()
    grads = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse, bias=bias, mask=mask)
    assert not any(np.isnan(g).any() for g in grads)
    np.testing.assert_allclose(out, naive_attention(q, k, v, bias=np.where(mask, bias, 0), mask=mask),
                               rtol=1e-13, atol=1e-14)


# ---- finite differences -----------------------------------------------------------------------


def test_oracle_dbias_matches_finite_differences():
    rng = _rng("fd-oracle")
    q, k, v = random_qkv(rng, (2, 2, 6, 4), (2, 2, 7, 4), (2, 2, 7, 3), np.float64)
    bias = (random_array(rng, (2, 1, 6, 7), np.float64), random_array(rng, (1, 7), np.float64))
    mask = _mask(rng, (2, 2, 6, 7), 0.8)
    r = random_array(rng, (2, 2, 6, 3), np.float64)
    _, _, _, dbias = naive_attention_backward(r, q, k, v, bias=bias, mask=mask, causal=True)
    h = 1e-6
    for t, b in enumerate(bias):
        for flat in range(b.size):
            idx = np.unravel_index(flat, b.shape)
            plus, minus = [x.copy() for x in bias], [x.copy() for x in bias]
            plus[t][idx] += h
            minus[t][idx] -= h
            numeric = (np.sum(naive_attention(q, k, v, bias=tuple(plus), mask=mask, causal=True) * r)
                       - np.sum(naive_attention(q, k, v, bias=tuple(minus), mask=mask, causal=True) * r)) / (2 * h)
            assert dbias[t][idx] == pytest.approx(numeric, rel=1e-6, abs=1e-9), (t, idx)


def test_dbias_matches_finite_differences(blocks):
    rng = _rng("fd")
    q, k, v = random_qkv(rng, (2, 3, 30, 8), (2, 3, 40, 8), (2, 3, 40, 8), np.float64)
    bias = (random_array(rng, (1, 3, 30, 40), np.float64), random_array(rng, (2, 1, 1, 40), np.float64))
    r = random_array(rng, (2, 3, 30, 8), np.float64)
    out, lse = cupyflash.attention(q, k, v, bias=bias, window=(9, 2), return_lse=True)
    _, _, _, dbias = cupyflash.attention_backward(r, q, k, v, out, lse, bias=bias, window=(9, 2))
    h = 1e-6
    for t, b in enumerate(bias):
        for flat in rng.choice(b.size, size=6, replace=False):
            idx = np.unravel_index(flat, b.shape)
            plus, minus = [x.copy() for x in bias], [x.copy() for x in bias]
            plus[t][idx] += h
            minus[t][idx] -= h
            numeric = (np.sum(cupyflash.attention(q, k, v, bias=tuple(plus), window=(9, 2)) * r)
                       - np.sum(cupyflash.attention(q, k, v, bias=tuple(minus), window=(9, 2)) * r)) / (2 * h)
            assert dbias[t][idx] == pytest.approx(numeric, rel=1e-6, abs=1e-9), (t, idx)


# ---- run to run -------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_shape", [(1, 1, 300, 260), (4, 3, 1, 260)], ids=["summed-by-the-caller",
                                                                                 "written-in-place"])
def test_gradients_bit_identical_across_runs_and_thread_counts(monkeypatch, bias_shape):
    # (1, 1, L, L) over 4 x 3 heads: vectorised heads summed in each task, and with wide
    # heads the batch loop summed in task order by the calling thread; (4, 3, 1, L): a
    # term broadcast over the queries, added to by each task's query blocks in place
    rng = _rng("identity", bias_shape)
    q, k, v = random_qkv(rng, (4, 3, 300, 32), (4, 3, 260, 32), (4, 3, 260, 32), np.float32)
    bias = random_array(rng, bias_shape, np.float32)
    mask = _mask(rng, (4, 1, 300, 260), 0.9)
    dout = random_array(rng, (4, 3, 300, 32), np.float32)
    results = []
    for threads in ("1", "3", "3"):
        monkeypatch.setenv("CUPYFLASH_NUM_THREADS", threads)
        out, lse = cupyflash.attention(q, k, v, bias=bias, mask=mask, causal=True, return_lse=True)
        results.append((out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, bias=bias,
                                                                 mask=mask, causal=True)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


# ---- memory ----------------------------------------------------------------------------------


def test_a_broadcast_bias_is_never_expanded():
    # a (1, 1, L, L) bias over 8 heads: expanded it would be 8 x 4 MiB = 32 MiB
    rng = _rng("memory")
    length = 1024
    q, k, v = random_qkv(rng, (2, 4, length, 32), (2, 4, length, 32), (2, 4, length, 32), np.float32)
    bias = random_array(rng, (1, 1, length, length), np.float32)
    mask = _mask(rng, (2, 1, 1, length), 0.9)
    tracemalloc.start()
    try:
        out, lse = cupyflash.attention(q, k, v, bias=bias, mask=mask, return_lse=True)
        forward_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        grads = cupyflash.attention_backward(out, q, k, v, out, lse, bias=bias, mask=mask)
        backward_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    inputs_outputs = out.nbytes + lse.nbytes
    assert forward_peak - inputs_outputs < 16 * 2**20, f"forward: {forward_peak / 2**20:.1f} MiB"
    gradients = sum(g.nbytes for g in grads) + 3 * q.nbytes     # dq, dk, dv and their float32 sums
    assert backward_peak - gradients < 24 * 2**20, f"backward: {backward_peak / 2**20:.1f} MiB"


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bias, error, words", [
    (np.zeros((3, 1, LQ, LK)), ValueError, ["`bias`", "(3, 1, 45, 70)", "(2, 3, 45, 70)"]),
    (np.zeros((1, 1, 1, 2, LQ, LK)), ValueError, ["`bias`", "does not broadcast"]),
    (np.zeros((LQ, LK + 1)), ValueError, ["`bias`", "(45, 71)"]),
    (np.zeros((LQ, LK), np.int32), TypeError, ["`bias`", "int32"]),
    (np.zeros((LQ, LK), bool), TypeError, ["`bias`", "mask="]),
    ([np.zeros((LQ, LK))], TypeError, ["`bias`", "tuple"]),
    ((), ValueError, ["`bias`", "1 to 4"]),
    ((np.zeros((LQ, LK)),) * 5, ValueError, ["`bias`", "1 to 4"]),
    ((np.zeros((LQ, LK)), np.zeros((2, LK))), ValueError, ["`bias[1]`", "(2, 70)"]),
    ((np.zeros((LQ, LK)), "x"), TypeError, ["`bias[1]`"]),
])
def test_bad_bias_is_refused_before_any_work(bias, error, words):
    q, k, v = random_qkv(_rng("bad"), (B, H, LQ, 8), (B, H, LK, 8), (B, H, LK, 8), np.float32)
    with pytest.raises(error) as info:
        cupyflash.attention(q, k, v, bias=bias)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("mask, error, words", [
    (np.ones((B, 2, LQ, LK), bool), ValueError, ["`mask`", "(2, 2, 45, 70)"]),
    (np.ones((LQ, LK), np.float32), TypeError, ["`mask`", "bias="]),
    (np.ones((LQ, LK), np.int8), TypeError, ["`mask`", "astype(bool)"]),
])
def test_bad_mask_is_refused(mask, error, words):
    q, k, v = random_qkv(_rng("bad"), (B, H, LQ, 8), (B, H, LK, 8), (B, H, LK, 8), np.float32)
    with pytest.raises(error) as info:
        cupyflash.attention(q, k, v, mask=mask)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_backward_checks_bias_and_out_may_not_overlap_it():
    rng = _rng("bad-bwd")
    q, k, v = random_qkv(rng, (2, 5, 8), (2, 6, 8), (2, 6, 8), np.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="`bias`"):
        cupyflash.attention_backward(out, q, k, v, out, lse, bias=np.zeros((3, 5, 6), np.float32))
    shared = np.zeros(2 * 5 * 8, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        cupyflash.attention(q, k, v, bias=shared[:30].reshape(5, 6), out=shared.reshape(2, 5, 8))
