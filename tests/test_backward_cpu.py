"""``attention_backward`` on NumPy arrays: against the float64 naive gradient and
against central finite differences of ``attention`` itself."""

from __future__ import annotations

import tracemalloc
import warnings
import zlib

import numpy as np
import pytest

import cupyflash
from cupyflash import _cpu
from cupyflash.reference import naive_attention_backward

from _util import DTYPES, DTYPE_IDS, assert_grad_close, poisoned, random_array, random_qkv


# name: (q shape, k shape, v shape, options)
CASES = {
    "plain": ((2, 3, 9, 8), (2, 3, 13, 8), (2, 3, 13, 6), {}),
    "two_dim": ((7, 5), (11, 5), (11, 3), {}),
    "causal_lq_lt_lk": ((2, 7, 8), (2, 15, 8), (2, 15, 4), dict(causal=True)),
    "causal_lq_gt_lk": ((2, 15, 8), (2, 6, 8), (2, 6, 4), dict(causal=True)),      # rows with no key
    "window": ((2, 12, 8), (2, 16, 8), (2, 16, 8), dict(window=(3, 2))),
    "causal_window": ((2, 12, 5), (2, 9, 5), (2, 9, 7), dict(causal=True, window=(2, None))),
    "gqa": ((2, 6, 9, 8), (2, 2, 13, 8), (2, 2, 13, 5), dict(enable_gqa=True)),
    "gqa_causal": ((2, 4, 13, 8), (2, 2, 9, 8), (2, 2, 9, 5), dict(enable_gqa=True, causal=True)),
    "gqa_broadcast_kv": ((3, 4, 9, 8), (1, 2, 11, 8), (3, 1, 11, 5), dict(enable_gqa=True)),
    "mqa_broadcast": ((2, 4, 9, 8), (2, 1, 13, 8), (2, 1, 13, 6), dict(causal=True)),
    "batch_broadcast": ((3, 1, 9, 4), (1, 2, 11, 4), (11, 3), {}),
    "q_broadcast": ((9, 4), (3, 11, 4), (3, 11, 3), dict(window=(4, 4))),
    "lq1": ((2, 1, 8), (2, 10, 8), (2, 10, 8), dict(causal=True)),
    "lk1": ((2, 10, 8), (2, 1, 8), (2, 1, 8), {}),
    "d256": ((1, 10, 256), (1, 14, 256), (1, 14, 256), dict(causal=True)),
}

SMALL_BLOCKS = {"bc4_bq3": (4, 12), "bc3_bq1": (3, 3)}


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _forward_backward(q, k, v, dout_scale=1.0, **kw):
    rng = _rng("dout", q.shape, k.shape, kw)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    dout = random_array(rng, out.shape, q.dtype, dout_scale)
    return dout, out, lse, cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)


@pytest.fixture(params=list(SMALL_BLOCKS), ids=list(SMALL_BLOCKS))
def small_blocks(request, monkeypatch):
    key_block, score_elements = SMALL_BLOCKS[request.param]
    monkeypatch.setattr(_cpu, "_MAX_KEY_BLOCK", key_block)
    monkeypatch.setattr(_cpu, "_SCORE_BLOCK_ELEMENTS", score_elements)


# ---- against the naive gradient --------------------------------------------------


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_matches_naive_backward(dtype, case):
    q_shape, k_shape, v_shape, kw = CASES[case]
    q, k, v = random_qkv(_rng("bwd", dtype, case), q_shape, k_shape, v_shape, dtype)
    dout, _, _, grads = _forward_backward(q, k, v, **kw)
    expected = naive_attention_backward(dout, q, k, v, **kw)
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.shape == x.shape, name
        assert g.dtype == x.dtype, name
        assert not np.isnan(g.astype(np.float64)).any(), name
        assert_grad_close(g, e, dtype, what=name)


@pytest.mark.parametrize("case", ["plain", "causal_lq_gt_lk", "window", "gqa_causal", "gqa_broadcast_kv",
                                  "batch_broadcast", "causal_window"])
def test_backward_with_small_blocks_matches_naive_backward(small_blocks, case):
    q_shape, k_shape, v_shape, kw = CASES[case]
    q, k, v = random_qkv(_rng("bwd-small", case), q_shape, k_shape, v_shape, np.float64)
    dout, _, _, grads = _forward_backward(q, k, v, **kw)
    for g, e in zip(grads, naive_attention_backward(dout, q, k, v, **kw)):
        assert_grad_close(g, e, np.float64)


def test_backward_for_long_keys_matches_naive_backward():
    # more than one default (512) key block
    q, k, v = random_qkv(_rng("long"), (1, 20, 16), (1, 1100, 16), (1, 1100, 16), np.float32)
    dout, _, _, grads = _forward_backward(q, k, v, causal=True)
    for g, e in zip(grads, naive_attention_backward(dout, q, k, v, causal=True)):
        assert_grad_close(g, e, np.float32)


# ---- against finite differences ------------------------------------------------------


FD_CASES = ["plain", "two_dim", "causal_lq_lt_lk", "causal_lq_gt_lk", "window", "gqa", "gqa_causal",
            "gqa_broadcast_kv", "mqa_broadcast", "batch_broadcast"]


@pytest.mark.parametrize("case", FD_CASES)
def test_backward_matches_central_finite_differences(case):
    q_shape, k_shape, v_shape, kw = CASES[case]
    rng = _rng("fd", case)
    q, k, v = random_qkv(rng, q_shape, k_shape, v_shape, np.float64)
    out = cupyflash.attention(q, k, v, **kw)
    r = random_array(rng, out.shape, np.float64)

    def loss(q, k, v):
        return float(np.sum(cupyflash.attention(q, k, v, **kw) * r))

    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    grads = cupyflash.attention_backward(r, q, k, v, out, lse, **kw)
    h = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        for flat in rng.choice(x.size, size=min(4, x.size), replace=False):
            idx = np.unravel_index(flat, x.shape)
            args_plus = [a.copy() for a in (q, k, v)]
            args_minus = [a.copy() for a in (q, k, v)]
            args_plus[which][idx] += h
            args_minus[which][idx] -= h
            numeric = (loss(*args_plus) - loss(*args_minus)) / (2 * h)
            assert g[idx] == pytest.approx(numeric, rel=1e-6, abs=1e-8), (
                f"d{'qkv'[which]}{idx}: analytic {g[idx]!r}, finite difference {numeric!r}")


def test_finite_differences_see_gqa_group_sum():
    # A kv head's gradient collects every query head of its group: perturbing k of
    # kv head 1 changes only query heads 2 and 3 (group size 2).
    rng = _rng("group")
    q, k, v = random_qkv(rng, (4, 5, 3), (2, 6, 3), (2, 6, 2), np.float64)
    out, lse = cupyflash.attention(q, k, v, enable_gqa=True, return_lse=True)
    r = random_array(rng, out.shape, np.float64)
    _, dk, dv = cupyflash.attention_backward(r, q, k, v, out, lse, enable_gqa=True)
    k2 = k.copy()
    k2[1, 2, 0] += 1e-3
    changed = np.any(cupyflash.attention(q, k2, v, enable_gqa=True) != out, axis=(1, 2))
    np.testing.assert_array_equal(changed, [False, False, True, True])
    per_head = [cupyflash.attention_backward(r[h], q[h], k[h // 2], v[h // 2], out[h], lse[h]) for h in range(4)]
    np.testing.assert_allclose(dk[1], per_head[2][1] + per_head[3][1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv[0], per_head[0][2] + per_head[1][2], rtol=1e-12, atol=1e-14)


# ---- shapes, masked rows, empty inputs, determinism ------------------------------------


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_with_no_key_get_zero_gradient(dtype):
    q, k, v = random_qkv(_rng("nokey", dtype), (2, 12, 4), (2, 5, 4), (2, 5, 3), dtype)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        dout, out, lse, (dq, dk, dv) = _forward_backward(q, k, v, causal=True)
    assert np.isneginf(lse[:, :7]).all()
    assert np.all(dq[:, :7].astype(np.float64) == 0)
    for g in (dq, dk, dv):
        assert np.isfinite(g.astype(np.float64)).all()


@pytest.mark.filterwarnings("error")
def test_empty_sequences_give_empty_or_zero_gradients():
    rng = _rng("empty")
    q, k, v = random_qkv(rng, (2, 0, 4), (2, 5, 4), (2, 5, 3), np.float32)
    _, _, _, (dq, dk, dv) = _forward_backward(q, k, v, causal=True)
    assert dq.shape == (2, 0, 4) and dk.shape == (2, 5, 4) and dv.shape == (2, 5, 3)
    assert np.all(dk == 0) and np.all(dv == 0)
    q, k, v = random_qkv(rng, (2, 3, 4), (2, 0, 4), (2, 0, 3), np.float32)
    _, _, _, (dq, dk, dv) = _forward_backward(q, k, v)
    assert dq.shape == (2, 3, 4) and np.all(dq == 0)
    assert dk.shape == (2, 0, 4) and dv.shape == (2, 0, 3)


def test_strided_inputs_and_dout():
    rng = _rng("strided")
    q_, k_, v_ = random_qkv(rng, (2, 9, 3, 8), (2, 11, 3, 8), (2, 11, 3, 8), np.float32)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_, k_, v_))
    out, lse = cupyflash.attention(q, k, v, return_lse=True, causal=True)
    dout = random_array(rng, (2, 9, 3, 8), np.float32).transpose(0, 2, 1, 3)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for g, e, x in zip(grads, naive_attention_backward(dout, q, k, v, causal=True), (q, k, v)):
        assert g.shape == x.shape
        assert_grad_close(g, e, np.float32)


def test_lse_of_the_accumulation_dtype_is_accepted_for_float64():
    q, k, v = random_qkv(_rng("lse64"), (2, 5, 4), (2, 6, 4), (2, 6, 3), np.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dout = np.ones_like(out)
    a = cupyflash.attention_backward(dout, q, k, v, out, lse)
    b = cupyflash.attention_backward(dout, q, k, v, out, lse.astype(np.float64))
    for x, y in zip(a, b):
        assert_grad_close(x, y.astype(np.float64), np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_is_deterministic_and_leaves_inputs_alone(dtype):
    q, k, v = random_qkv(_rng("det", dtype), (2, 4, 30, 8), (2, 2, 40, 8), (2, 2, 40, 6), dtype)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, enable_gqa=True, causal=True)
    dout = random_array(_rng("det-dout", dtype), out.shape, dtype)
    arrays = (dout, q, k, v, out, lse)
    copies = [x.copy() for x in arrays]
    for x in arrays:
        x.flags.writeable = False
    first = cupyflash.attention_backward(*arrays, enable_gqa=True, causal=True)
    second = cupyflash.attention_backward(*arrays, enable_gqa=True, causal=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for x, c in zip(arrays, copies):
        np.testing.assert_array_equal(x.view(np.uint8), c.view(np.uint8))


def test_no_warnings_from_backward():
    q, k, v = random_qkv(_rng("warn"), (2, 20, 8), (2, 7, 8), (2, 7, 8), np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({}, dict(causal=True), dict(window=(0, 0))):
            _forward_backward(q, k, v, **kw)


def test_gradients_are_fresh_arrays():
    # Nothing returned is aliased to an input, so a caller may modify the gradients.
    q, k, v = random_qkv(_rng("alias"), (2, 5, 4), (2, 6, 4), (2, 6, 4), np.float64)
    out = poisoned((2, 5, 4), np.float64)
    out, lse = cupyflash.attention(q, k, v, out=out, return_lse=True)
    dout = np.ones_like(out)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
    for g in grads:
        for x in (dout, q, k, v, out, lse):
            assert not np.may_share_memory(g, x)


def test_backward_memory_stays_far_below_the_score_matrix():
    # Lq = Lk = 8192: one float32 (Lq, Lk) matrix would be 256 MiB, and the naive
    # backward holds several.  The blocked backward's temporaries are a few score blocks.
    length, d = 8192, 64
    rng = _rng("memory")
    q, k, v = random_qkv(rng, (length, d), (length, d), (length, d), np.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, causal=True)
    dout = random_array(rng, out.shape, np.float32)
    tracemalloc.start()
    try:
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    rows = rng.choice(length, 4, replace=False)
    assert all(np.isfinite(g[rows]).all() for g in grads)
