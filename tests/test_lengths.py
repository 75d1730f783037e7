"""``q_lengths=`` / ``kv_lengths=`` (padded variable-length batches) on the NumPy path.

Each sequence of a padded batch must give what plain ``attention`` gives on that
sequence alone (its own rows and keys, its own bottom-right diagonal), with zeros,
lse ``-inf`` and zero gradients in the padding, and nothing the padding holds (NaN
planted there) reaching any result.  Error rules: docs/testing.md's table (outputs)
and ``assert_grad_close`` (gradients), against the per-sequence loop and the oracle.
The kernels' one launch over the sequences is tests/test_lengths_kernels.py's.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash.reference import naive_attention, naive_attention_backward

from _util import use_cpu_blocks, DTYPES, DTYPE_IDS, assert_close, assert_grad_close, assert_lse_close, random_array


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


# small CPU blocks, so that the lengths below fall on, beside and inside block edges
TILE = 16
SMALL_BLOCKS = dict(key_block=TILE, score_elements=2 * TILE * TILE, min_query_block=TILE)


@pytest.fixture(params=["default-blocks", "small-blocks"])
def blocks(request, monkeypatch):
    if request.param == "small-blocks":
        use_cpu_blocks(monkeypatch, **SMALL_BLOCKS)
    return request.param


def _padded(rng, dtype, batch, hq, hkv, lq, lk, d, dv, q_lengths, kv_lengths):
    """q, k, v, dout with NaN (q, k, dout) and inf (v) in every padded row."""
    q = random_array(rng, (batch, hq, lq, d), dtype)
    k = random_array(rng, (batch, hkv, lk, d), dtype)
    v = random_array(rng, (batch, hkv, lk, dv), dtype)
    dout = random_array(rng, (batch, hq, lq, dv), dtype)
    for b in range(batch):
        q[b, :, q_lengths[b]:] = np.nan
        dout[b, :, q_lengths[b]:] = np.nan
        k[b, :, kv_lengths[b]:] = np.nan
        v[b, :, kv_lengths[b]:] = np.inf
    return q, k, v, dout


def _check_against_loop(q, k, v, dout, q_lengths, kv_lengths, dtype, **kw):
    ql, kl = np.asarray(q_lengths), np.asarray(kv_lengths)
    out, lse = cupyflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, return_lse=True, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, q_lengths=ql, kv_lengths=kl, **kw)
    for b in range(q.shape[0]):
        n, m = int(ql[b]), int(kl[b])
        assert not out[b, :, n:].any() and np.isneginf(lse[b, :, n:]).all(), f"sequence {b}: padded rows"
        assert not grads[0][b, :, n:].any(), f"sequence {b}: dq of padded rows"
        assert not grads[1][b, :, m:].any() and not grads[2][b, :, m:].any(), f"sequence {b}: dk/dv of padded keys"
        qb, kb, vb = q[b, :, :n], k[b, :, :m], v[b, :, :m]
        alone, alone_lse = cupyflash.attention(qb, kb, vb, return_lse=True, **kw)
        expected = naive_attention(qb, kb, vb, **kw)
        assert_close(out[b, :, :n], expected, dtype, what=f"sequence {b}")
        assert_lse_close(lse[b, :, :n], naive_attention(qb, kb, vb, return_lse=True, **kw)[1], dtype)
        np.testing.assert_array_equal(np.isneginf(lse[b, :, :n]), np.isneginf(alone_lse))
        expected_grads = naive_attention_backward(dout[b, :, :n], qb, kb, vb, **kw)
        for name, g, e, rows in zip(("dq", "dk", "dv"), grads, expected_grads, (n, m, m)):
            assert_grad_close(g[b, :, :rows], e, dtype, what=f"sequence {b} {name}")
    return out, lse, grads


LENGTH_CASES = {                 # (q_lengths, kv_lengths) for Lq = 40, Lk = 50
    "edges": ([0, 1, 40, 39], [50, 0, 1, 49]),
    "tiles": ([TILE, TILE + 1, TILE - 1, 2 * TILE], [TILE - 1, 2 * TILE + 1, TILE, 3 * TILE]),
    "lq>lk-per-sequence": ([40, 33, 17, 5], [3, 10, 16, 50]),
}


@pytest.mark.parametrize("lengths", list(LENGTH_CASES), ids=list(LENGTH_CASES))
@pytest.mark.parametrize("options", ["full", "causal", "window"])
def test_each_sequence_equals_plain_attention_on_it(blocks, lengths, options):
    kw = {"full": {}, "causal": dict(causal=True), "window": dict(window=(6, 2))}[options]
    ql, kl = LENGTH_CASES[lengths]
    rng = _rng("loop", lengths, options)
    q, k, v, dout = _padded(rng, np.float64, 4, 3, 3, 40, 50, 16, 12, ql, kl)
    _check_against_loop(q, k, v, dout, ql, kl, np.float64, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_dtype_and_gqa(dtype):
    ql, kl = [7, 0, 40, 23], [50, 31, 12, 1]
    q, k, v, dout = _padded(_rng("gqa", dtype), dtype, 4, 4, 2, 40, 50, 16, 16, ql, kl)
    _check_against_loop(q, k, v, dout, np.array(ql, np.int32), np.array(kl, np.int32), dtype,
                        enable_gqa=True, causal=True)


def test_mqa_broadcast_lengths_and_the_oracle():
    rng = _rng("mqa")
    q = random_array(rng, (2, 3, 4, 20, 8), np.float64)          # (B, N, H, L, d): lengths (B, N)
    k = random_array(rng, (2, 3, 1, 25, 8), np.float64)
    v = random_array(rng, (2, 3, 1, 25, 8), np.float64)
    ql = np.array([[20, 3, 0], [1, 19, 11]])
    kl = np.array([25, 9])[:, None]                               # broadcast over N
    out, lse = cupyflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, causal=True, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, q_lengths=ql, kv_lengths=kl, causal=True, return_lse=True)
    assert_close(out, ref, np.float64)
    assert_lse_close(lse, ref_lse, np.float64)
    dout = random_array(rng, out.shape, np.float64)
    for g, e in zip(cupyflash.attention_backward(dout, q, k, v, out, lse, q_lengths=ql, kv_lengths=kl, causal=True),
                    naive_attention_backward(dout, q, k, v, q_lengths=ql, kv_lengths=kl, causal=True)):
        assert_grad_close(g, e, np.float64)


def test_lengths_with_bias_and_mask():
    rng = _rng("bias")
    ql, kl = [9, 30], [44, 5]
    q, k, v, dout = _padded(rng, np.float64, 2, 2, 2, 30, 44, 8, 8, ql, kl)
    bias = (random_array(rng, (1, 2, 30, 44), np.float64), random_array(rng, (2, 1, 1, 44), np.float64))
    bias[0][..., 10:, :] = np.nan                                   # in every sequence's padding... or not
    mask = rng.random((2, 1, 30, 44)) < 0.8
    kw = dict(bias=bias, mask=mask, q_lengths=np.array(ql), kv_lengths=np.array(kl), window=(12, 3))
    with np.errstate(invalid="ignore"):
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
        ref = naive_attention(q, k, v, **kw)
    # sequence 1 reads bias rows >= 10: NaN there reaches its rows, exactly as the oracle says
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert not np.isnan(out[0]).any()
    assert_close(out[0], ref[0], np.float64)
    bias[0][..., 10:, :] = 0.5
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)
    expected = naive_attention_backward(dout, q, k, v, **kw)
    assert_close(out, naive_attention(q, k, v, **kw), np.float64)
    for g, e in zip(grads[:3], expected[:3]):
        assert_grad_close(g, e, np.float64)
    for g, e in zip(grads[3], expected[3]):
        assert_grad_close(g, e, np.float64, what="dbias")


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 64), causal=st.booleans())
def test_random_lengths(seed, batch, causal):
    rng = np.random.default_rng(seed)
    lq, lk = int(rng.integers(1, 24)), int(rng.integers(1, 24))
    ql, kl = rng.integers(0, lq + 1, batch), rng.integers(0, lk + 1, batch)
    q, k, v, dout = _padded(rng, np.float32, batch, 2, 2, lq, lk, 8, 8, ql, kl)
    out, lse = cupyflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, causal=causal, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, q_lengths=ql, kv_lengths=kl, causal=causal, return_lse=True)
    assert_close(out, ref, np.float32)
    assert_lse_close(lse, ref_lse, np.float32)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, q_lengths=ql, kv_lengths=kl, causal=causal)
    expected = naive_attention_backward(dout, q, k, v, q_lengths=ql, kv_lengths=kl, causal=causal)
    for g, e in zip(grads, expected):
        assert_grad_close(g, e, np.float32)


def test_three_dimensional_inputs_take_an_int():
    rng = _rng("3d")
    q, k, v = (random_array(rng, (2, 12, 8), np.float64) for _ in range(3))
    out = cupyflash.attention(q, k, v, q_lengths=5, kv_lengths=np.int64(7), causal=True)
    np.testing.assert_allclose(out[:, :5], cupyflash.attention(q[:, :5], k[:, :7], v[:, :7], causal=True),
                               rtol=1e-14, atol=1e-15)
    assert not out[:, 5:].any()


def test_run_to_run_and_thread_count_identity(monkeypatch):
    rng = _rng("identity")
    ql, kl = rng.integers(0, 301, 6), rng.integers(0, 301, 6)
    q, k, v, dout = _padded(rng, np.float32, 6, 4, 4, 300, 300, 32, 32, ql, kl)
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("CUPYFLASH_NUM_THREADS", threads)
        out, lse = cupyflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, causal=True, return_lse=True)
        results.append((out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, q_lengths=ql,
                                                                 kv_lengths=kl, causal=True)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kw, error, words", [
    (dict(q_lengths=np.array([1, -1, 3])), ValueError, ["`q_lengths`", "[0, 10]", "-1", "batch index 1"]),
    (dict(kv_lengths=np.array([1, 2, 13])), ValueError, ["`kv_lengths`", "[0, 12]", "13", "batch index 2"]),
    (dict(q_lengths=np.array([1.0, 2.0, 3.0])), TypeError, ["`q_lengths`", "int32 or int64", "float64"]),
    (dict(q_lengths=np.array([True, False, True])), TypeError, ["`q_lengths`", "bool"]),
    (dict(q_lengths=np.ones((3, 2), np.int64)), ValueError, ["`q_lengths`", "(3, 2)", "not per head"]),
    (dict(kv_lengths=[1, 2, 3]), TypeError, ["`kv_lengths`"]),
    (dict(q_lengths=2.5), TypeError, ["`q_lengths`"]),
    (dict(q_lengths=True), TypeError, ["`q_lengths`", "bool"]),
])
def test_bad_lengths_are_refused_before_any_work(kw, error, words):
    q = np.zeros((3, 2, 10, 4), np.float32)
    k = v = np.zeros((3, 2, 12, 4), np.float32)
    with pytest.raises(error) as info:
        cupyflash.attention(q, k, v, **kw)
    assert all(w in str(info.value) for w in words), str(info.value)


# ---- packed sequences --------------------------------------------------------------------------


def _packed(rng, dtype, heads_q, heads_kv, lengths_q, lengths_k, d=16, dv=16):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = random_array(rng, (heads_q, int(cu_q[-1]), d), dtype)
    k = random_array(rng, (heads_kv, int(cu_k[-1]), d), dtype)
    v = random_array(rng, (heads_kv, int(cu_k[-1]), dv), dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("case", ["plain", "gqa", "mqa", "window"])
def test_packed_sequences_equal_a_loop_of_attention_bit_for_bit(case):
    rng = _rng("packed", case)
    heads, kw = {"plain": ((3, 3), dict(causal=True)), "gqa": ((4, 2), dict(enable_gqa=True, causal=True)),
                 "mqa": ((3, 1), {}), "window": ((2, 2), dict(window=(4, 1)))}[case]
    lengths_q, lengths_k = [5, 0, 17, 1, 33, 40], [7, 3, 0, 20, 33, 1]
    q, k, v, cu_q, cu_k = _packed(rng, np.float32, *heads, lengths_q, lengths_k, dv=12)
    out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = random_array(rng, out.shape, np.float32)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    for s in range(len(lengths_q)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        alone, alone_lse = cupyflash.attention(q[:, rows], k[:, keys], v[:, keys], return_lse=True, **kw)
        np.testing.assert_array_equal(out[:, rows], alone)
        np.testing.assert_array_equal(lse[:, rows], alone_lse)
        expected = cupyflash.attention_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], alone, alone_lse,
                                                **kw)
        for g, e, span in zip(grads, expected, (rows, keys, keys)):
            np.testing.assert_array_equal(g[:, span], e)


def test_packed_results_do_not_depend_on_the_thread_count(monkeypatch):
    # 40 sequences: run whole, one per worker thread (with 3 threads), or one after the other
    rng = _rng("packed-threads")
    lengths = rng.integers(0, 60, 40)
    q, k, v, cu_q, cu_k = _packed(rng, np.float64, 2, 2, lengths, lengths[::-1])
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("CUPYFLASH_NUM_THREADS", threads)
        out, lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
        results.append((out, lse, *cupyflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k,
                                                                        causal=True)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_flashattention_layout_passes_transposed():
    rng = _rng("fa-layout")
    total, heads, d = 30, 2, 8
    q, k, v = (random_array(rng, (total, heads, d), np.float64) for _ in range(3))   # (total, H, d)
    cu = np.array([0, 12, 30], np.int32)
    out = cupyflash.attention_varlen(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), cu, cu)
    expected = cupyflash.attention(q[12:].transpose(1, 0, 2), k[12:].transpose(1, 0, 2), v[12:].transpose(1, 0, 2))
    np.testing.assert_array_equal(out[:, 12:], expected)


@pytest.mark.parametrize("cu_q, error, words", [
    (np.array([1, 5, 10]), ValueError, ["`cu_seqlens_q`", "start at 0"]),
    (np.array([0, 6, 5, 10]), ValueError, ["`cu_seqlens_q`", "non-decreasing", "sequence 1"]),
    (np.array([0, 5, 11]), ValueError, ["`cu_seqlens_q`", "end at", "10"]),
    (np.array([0.0, 5.0, 10.0]), TypeError, ["`cu_seqlens_q`", "int32 or int64"]),
    (np.array([[0, 5, 10]]), ValueError, ["`cu_seqlens_q`", "shape"]),
    (np.array([0, 10]), ValueError, ["as many sequences"]),
    ([0, 5, 10], TypeError, ["`cu_seqlens_q`"]),
])
def test_bad_cu_seqlens_are_refused_before_any_work(cu_q, error, words):
    q = np.zeros((2, 10, 4), np.float32)
    k = v = np.zeros((2, 12, 4), np.float32)
    with pytest.raises(error) as info:
        cupyflash.attention_varlen(q, k, v, cu_q, np.array([0, 2, 12]))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_packed_inputs_must_be_three_dimensional():
    with pytest.raises(ValueError, match="transpose"):
        cupyflash.attention_varlen(np.zeros((1, 2, 10, 4)), np.zeros((1, 2, 10, 4)), np.zeros((1, 2, 10, 4)),
                                   np.array([0, 10]), np.array([0, 10]))
