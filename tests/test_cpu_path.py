"""The CPU path (``cupyflash.attention`` on NumPy arrays) against the float64 oracle.

Three implementations of the same math are compared: the blocked CPU path, the
literal Algorithm 1 (``flash_attention_v1``, K/V blocks outer, Q blocks inner)
and the naive oracle.  The semantics of the masks, of GQA and of broadcasting are
also checked against formulas written out here, independent of the oracle.
"""

from __future__ import annotations

import math
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest

import cupyflash
from cupyflash import _cpu
from cupyflash.reference import flash_attention_v1, naive_attention, naive_attention_backward

from _util import (
    DTYPE_IDS,
    DTYPES,
    accum_dtype,
    assert_close,
    assert_lse_close,
    poisoned,
    random_array,
    random_qkv,
)


# (q shape, k shape, v shape): the edge cases of the issue.
SHAPES = {
    "lq1": ((2, 1, 16), (2, 33, 16), (2, 33, 16)),
    "lk1": ((2, 17, 16), (2, 1, 16), (2, 1, 16)),
    "lq1_lk1_d1": ((1, 1, 1), (1, 1, 1), (1, 1, 1)),
    "odd_d": ((3, 19, 7), (3, 23, 7), (3, 23, 5)),
    "d256": ((2, 24, 256), (2, 40, 256), (2, 40, 256)),
    "dv_ne_d": ((2, 2, 13, 8), (2, 2, 29, 8), (2, 2, 29, 24)),
    "two_dim": ((21, 12), (34, 12), (34, 6)),
    "lq_gt_lk": ((2, 40, 8), (2, 9, 8), (2, 9, 8)),
    "lq_lt_lk": ((2, 9, 8), (2, 40, 8), (2, 40, 8)),
    "many_key_blocks": ((1, 6, 32), (1, 1100, 32), (1, 1100, 32)),  # > 2 default key blocks
}

# Mask options; causal and window are exercised with Lq < Lk and Lq > Lk through SHAPES.
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(3, 2)),
    "window_left_only": dict(window=(5, None)),
    "window_right_only": dict(window=(-1, 4)),
    "causal_window": dict(causal=True, window=(4, 7)),
}

# (max key block, score block elements) of the CPU path: small values make tiny
# problems run through many blocks, tails and empty/full/partial block cases.
SMALL_BLOCKS = {"bc4_bq3": (4, 12), "bc3_bq1": (3, 3), "bc5_bq7": (5, 35)}


@pytest.fixture(params=list(SMALL_BLOCKS), ids=list(SMALL_BLOCKS))
def small_blocks(request, monkeypatch):
    key_block, score_elements = SMALL_BLOCKS[request.param]
    monkeypatch.setattr(_cpu, "_MAX_KEY_BLOCK", key_block)
    monkeypatch.setattr(_cpu, "_SCORE_BLOCK_ELEMENTS", score_elements)
    return key_block, score_elements


def _rng(*key):
    """A generator seeded by the test's parameters: every case has its own, reproducible inputs."""
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def check_against_oracle(q, k, v, *, factor=1.0, **kw):
    """Run the CPU path with return_lse and compare out and lse with the oracle."""
    dtype = q.dtype
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    kw.pop("backend", None)
    expected, expected_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert not np.isnan(out.astype(np.float64)).any()
    assert_close(out, expected, dtype, factor=factor)
    assert_lse_close(lse, expected_lse, dtype)
    return out, lse


def visible_mask(lq, lk, *, causal=False, window=None):
    """The spec's mask, written out: query i sees key j iff
    i + Lk - Lq - left <= j <= i + Lk - Lq + right (causal caps right at 0)."""
    left, right = (None, None) if window is None else window
    left = None if left == -1 else left
    right = None if right == -1 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    ok = np.ones((lq, lk), dtype=bool)
    for i in range(lq):
        for j in range(lk):
            diagonal = i + lk - lq
            if left is not None and j < diagonal - left:
                ok[i, j] = False
            if right is not None and j > diagonal + right:
                ok[i, j] = False
    return ok


# ---- oracle vs blocked CPU path vs Algorithm 1 -------------------------------------


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_path_and_algorithm1_match_oracle(dtype, shape, mask):
    rng = _rng("fwd", dtype, shape, mask)
    q, k, v = random_qkv(rng, *SHAPES[shape], dtype)
    kw = MASKS[mask]
    out, lse = check_against_oracle(q, k, v, **kw)

    d = q.shape[-1]
    sram_size = 4 * d * 3                      # Bc = 3, Br = min(3, d): many small blocks
    if shape == "many_key_blocks":
        sram_size = 4 * d * 128
    v1, v1_lse = flash_attention_v1(q, k, v, sram_size=sram_size, return_lse=True,
                                    backend="numpy", **kw)
    expected, expected_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert v1.dtype == dtype
    assert_close(v1, expected, dtype, what="Algorithm 1 output")
    assert_lse_close(v1_lse, expected_lse, dtype, what="Algorithm 1 lse")
    if dtype == np.float64:                    # the two blocked orders agree to rounding
        assert_close(out, v1, dtype, what="CPU path vs Algorithm 1")
        assert_close(lse, v1_lse, dtype, what="CPU path lse vs Algorithm 1 lse")


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("shape", ["odd_d", "dv_ne_d", "two_dim", "lq_gt_lk", "lq_lt_lk", "lq1", "lk1"])
def test_small_blocks_match_oracle(small_blocks, shape, mask):
    rng = _rng("small", small_blocks, shape, mask)
    q, k, v = random_qkv(rng, *SHAPES[shape], np.float64)
    check_against_oracle(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_small_blocks_with_gqa_and_broadcast_match_oracle(small_blocks, mask):
    rng = _rng("small-gqa", small_blocks, mask)
    q, k, v = random_qkv(rng, (2, 1, 6, 11, 5), (3, 1, 17, 5), (1, 3, 17, 4), np.float64)
    check_against_oracle(q, k, v, enable_gqa=True, **MASKS[mask])
    q, k, v = random_qkv(rng, (1, 4, 11, 5), (3, 1, 17, 5), (17, 4), np.float64)
    check_against_oracle(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("sram_size", [4 * 8, 4 * 8 * 2 + 1, 4 * 8 * 5, 4 * 8 * 100])
def test_algorithm1_is_independent_of_sram_size(sram_size):
    rng = _rng("v1", sram_size)
    q, k, v = random_qkv(rng, (2, 13, 8), (2, 21, 8), (2, 21, 3), np.float64)
    for kw in ({}, dict(causal=True), dict(window=(2, 1))):
        expected = naive_attention(q, k, v, **kw)
        assert_close(flash_attention_v1(q, k, v, sram_size=sram_size, **kw), expected, np.float64)


def test_large_head_dim_above_256_runs_on_numpy_backend():
    rng = _rng("d300")
    q, k, v = random_qkv(rng, (1, 7, 300), (1, 9, 300), (1, 9, 260), np.float32)
    check_against_oracle(q, k, v, backend="numpy")


def test_long_half_precision_rows_accumulate_in_float32():
    # 3000 keys of nearly equal weight: a float16/bfloat16 running sum would lose it.
    rng = _rng("long-half")
    for dtype in DTYPES:
        if np.dtype(dtype).itemsize != 2:
            continue
        q, k, v = random_qkv(rng, (1, 3, 8), (1, 3000, 8), (1, 3000, 8), dtype, scale=0.1)
        v = (np.abs(v.astype(np.float64)) + 1).astype(dtype)   # a mean of positive values
        check_against_oracle(q, k, v)


def test_oracle_matches_the_definition():
    rng = _rng("oracle")
    q, k, v = random_qkv(rng, (5, 3), (7, 3), (7, 2), np.float64)
    s = q @ k.T * 0.7
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out, lse = naive_attention(q, k, v, scale=0.7, return_lse=True)
    np.testing.assert_allclose(out, p @ v, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(axis=1)), rtol=1e-13)


def test_oracle_shares_no_code_with_the_validation(monkeypatch):
    # A mistake in _validation (say, causal not folded into the window) is made by every
    # backend at once; the oracle must not make it too.
    from cupyflash import _validation

    def refuse(*args, **kw):
        raise AssertionError("the oracle called cupyflash._validation")

    monkeypatch.setattr(_validation, "check_forward", refuse)
    rng = _rng("independent")
    q, k, v = random_qkv(rng, (2, 4, 5, 3), (2, 2, 7, 3), (1, 2, 7, 2), np.float64)
    dout = random_array(rng, (2, 4, 5, 2), np.float64)
    naive_attention(q, k, v, causal=True, window=(2, 4), enable_gqa=True)
    naive_attention_backward(dout, q, k, v, causal=True, window=(2, 4), enable_gqa=True)


@pytest.mark.parametrize("lq, lk, kw", [(4, 11, dict(causal=True, window=(1, 5))), (11, 4, dict(window=(2, 1))),
                                        (6, 6, dict(causal=True, window=(None, -1))), (9, 1, dict(causal=True))],
                         ids=["causal-window", "window", "causal-unbounded", "causal-9x1"])
def test_oracle_follows_its_own_mask_rule(lq, lk, kw):
    # v = I: the output row is the probability row, zero exactly where the hand-written
    # loop (visible_mask) says the key is masked.
    rng = _rng("oracle-mask", lq, lk)
    q, k = random_array(rng, (lq, 4), np.float64), random_array(rng, (lk, 4), np.float64)
    out, lse = naive_attention(q, k, np.eye(lk), return_lse=True, **kw)
    ok = visible_mask(lq, lk, **kw)
    np.testing.assert_array_equal(out > 0, ok)
    np.testing.assert_array_equal(np.isneginf(lse), ~ok.any(axis=1))


def test_oracle_groups_and_broadcasts_heads_as_a_loop_does():
    # GQA (query head h reads kv head h // 3) and a broadcast batch axis, against one
    # plain 2-D call per (batch, head), forward and backward.
    rng = _rng("oracle-heads")
    q, k, v = random_qkv(rng, (2, 6, 5, 3), (1, 2, 7, 3), (2, 1, 7, 4), np.float64)
    dout = random_array(rng, (2, 6, 5, 4), np.float64)
    out = naive_attention(q, k, v, enable_gqa=True, causal=True)
    grads = naive_attention_backward(dout, q, k, v, enable_gqa=True, causal=True)
    expected = [np.zeros(x.shape) for x in (q, k, v)]
    for b in range(2):
        for h in range(6):
            kk, vv = k[0, h // 3], v[b, 0]
            np.testing.assert_allclose(out[b, h], naive_attention(q[b, h], kk, vv, causal=True), rtol=1e-14)
            dq, dk, dv = naive_attention_backward(dout[b, h], q[b, h], kk, vv, causal=True)
            expected[0][b, h] += dq
            expected[1][0, h // 3] += dk
            expected[2][b, 0] += dv
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14, err_msg=name)


# ---- semantics: masks, scale, GQA, broadcasting --------------------------------------


MASK_CASES = [
    (lq, lk, kw)
    for lq, lk in [(6, 6), (4, 11), (11, 4), (1, 9), (9, 1)]
    for kw in [dict(causal=True), dict(window=(2, 1)), dict(window=(0, 0)), dict(window=(1, None)),
               dict(window=(None, 2)), dict(window=(-1, 0)), dict(causal=True, window=(1, 5)),
               dict(causal=True, window=(None, -1)), dict(window=(30, 30))]
]


@pytest.mark.parametrize("lq, lk, kw", MASK_CASES, ids=[f"{a}x{b}-{kw}" for a, b, kw in MASK_CASES])
def test_mask_is_bottom_right_aligned_as_documented(small_blocks, lq, lk, kw):
    # With v = I the output row is the probability row: zero exactly where masked.
    rng = _rng("mask", lq, lk, kw)
    q, k = random_array(rng, (lq, 4), np.float64), random_array(rng, (lk, 4), np.float64)
    out, lse = cupyflash.attention(q, k, np.eye(lk), return_lse=True, **kw)
    ok = visible_mask(lq, lk, **kw)
    assert np.all(out[~ok] == 0)
    assert np.all(out[ok] > 0)
    seen = ok.any(axis=1)
    np.testing.assert_allclose(out[seen].sum(axis=1), 1.0, rtol=1e-13)
    assert np.all(out[~seen] == 0)
    assert np.all(np.isneginf(lse) == ~seen)


def test_causal_is_not_top_left_aligned_when_lq_lt_lk():
    rng = _rng("bottom-right")
    q, k = random_array(rng, (2, 5), np.float64), random_array(rng, (5, 5), np.float64)
    out = cupyflash.attention(q, k, np.eye(5), causal=True)
    # bottom-right: the last query sees every key; the first sees keys 0..3 (top-left: only key 0)
    assert np.all(out[1] > 0)
    assert np.all(out[0, :4] > 0) and out[0, 4] == 0


def test_causal_with_window_caps_right_at_zero():
    rng = _rng("cap")
    q, k, v = random_qkv(rng, (2, 9, 4), (2, 13, 4), (2, 13, 3), np.float32)
    a = cupyflash.attention(q, k, v, causal=True, window=(3, 5), return_lse=True)
    b = cupyflash.attention(q, k, v, window=(3, 0), return_lse=True)
    c = cupyflash.attention(q, k, v, causal=True, window=(3, None), return_lse=True)
    for x, y in [(a, b), (a, c)]:
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])


def test_window_none_and_minus_one_are_unbounded():
    rng = _rng("unbounded")
    q, k, v = random_qkv(rng, (2, 9, 4), (2, 13, 4), (2, 13, 3), np.float64)
    plain = cupyflash.attention(q, k, v)
    for window in [(None, None), (-1, -1), (-1, None), [None, -1], (np.int64(-1), None)]:
        np.testing.assert_array_equal(cupyflash.attention(q, k, v, window=window), plain)
    np.testing.assert_array_equal(cupyflash.attention(q, k, v, causal=True),
                                  cupyflash.attention(q, k, v, causal=True, window=(-1, None)))


def test_default_scale_is_inverse_sqrt_head_dim():
    rng = _rng("scale")
    q, k, v = random_qkv(rng, (3, 8, 10), (3, 12, 10), (3, 12, 5), np.float64)
    expected = naive_attention(q, k, v, scale=1 / math.sqrt(10))
    assert_close(cupyflash.attention(q, k, v), expected, np.float64)
    assert_close(cupyflash.attention(q, k, v, scale=np.float32(0.3)),
                 naive_attention(q, k, v, scale=float(np.float32(0.3))), np.float64)
    assert_close(cupyflash.attention(q, k, v, scale=-2), naive_attention(q, k, v, scale=-2.0), np.float64)


def test_zero_scale_averages_the_visible_values():
    rng = _rng("uniform")
    q, k, v = random_qkv(rng, (6, 3), (8, 3), (8, 2), np.float64)
    out = cupyflash.attention(q, k, v, scale=0.0, causal=True)
    for i in range(6):
        np.testing.assert_allclose(out[i], v[: i + 3].mean(axis=0), rtol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window=(2, 3))], ids=["plain", "causal", "window"])
def test_gqa_query_head_h_uses_kv_head_h_over_group(dtype, kw):
    rng = _rng("gqa", dtype, kw)
    q, k, v = random_qkv(rng, (2, 6, 11, 8), (2, 2, 14, 8), (2, 2, 14, 5), dtype)
    out, lse = check_against_oracle(q, k, v, enable_gqa=True, **kw)
    # h // (Hq / Hkv): heads 0, 1, 2 use kv head 0; heads 3, 4, 5 use kv head 1.
    repeated = cupyflash.attention(q, np.repeat(k, 3, axis=-3), np.repeat(v, 3, axis=-3),
                                   return_lse=True, **kw)
    assert_close(out, repeated[0].astype(np.float64), dtype, factor=2)
    assert_lse_close(lse, repeated[1].astype(np.float64), dtype)


def test_gqa_with_one_kv_head_and_broadcast_batch():
    rng = _rng("gqa-mqa")
    q, k, v = random_qkv(rng, (3, 4, 7, 6), (1, 1, 9, 6), (3, 1, 9, 2), np.float32)
    check_against_oracle(q, k, v, enable_gqa=True, causal=True)
    q, k, v = random_qkv(rng, (2, 1, 4, 7, 6), (3, 2, 9, 6), (1, 9, 2), np.float32)
    check_against_oracle(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mqa_by_broadcasting_a_single_kv_head(dtype):
    rng = _rng("mqa", dtype)
    q, k, v = random_qkv(rng, (2, 5, 10, 8), (2, 1, 15, 8), (2, 1, 15, 8), dtype)
    out, _ = check_against_oracle(q, k, v, causal=True)
    assert out.shape == (2, 5, 10, 8)
    for h in range(5):
        expected = naive_attention(q[:, h], k[:, 0], v[:, 0], causal=True)
        assert_close(out[:, h], expected, dtype)
    gqa = cupyflash.attention(q, k, v, causal=True, enable_gqa=True)
    assert_close(gqa, out.astype(np.float64), dtype, factor=2)


def test_batch_dims_broadcast_like_numpy():
    rng = _rng("bcast")
    q, k, v = random_qkv(rng, (3, 1, 5, 4), (1, 2, 6, 4), (6, 3), np.float64)
    out, lse = cupyflash.attention(q, k, v, window=(2, 1), return_lse=True)
    assert out.shape == (3, 2, 5, 3) and lse.shape == (3, 2, 5)
    for b in range(3):
        for h in range(2):
            e, e_lse = naive_attention(q[b, 0], k[0, h], v, window=(2, 1), return_lse=True)
            assert_close(out[b, h], e, np.float64)
            assert_lse_close(lse[b, h], e_lse, np.float64)


def test_two_dim_query_with_batched_keys():
    rng = _rng("2d-q")
    q, k, v = random_qkv(rng, (5, 4), (3, 6, 4), (3, 6, 2), np.float32)
    out, _ = check_against_oracle(q, k, v)
    assert out.shape == (3, 5, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_output_and_lse_dtypes(dtype):
    rng = _rng("dtypes", dtype)
    q, k, v = random_qkv(rng, (2, 3, 4), (2, 5, 4), (2, 5, 6), dtype)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, 3, 6)
    assert lse.dtype == accum_dtype(dtype) and lse.shape == (2, 3)
    assert cupyflash.attention(q, k, v).dtype == dtype


def test_bfloat16_via_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = _rng("bf16")
    q, k, v = random_qkv(rng, (2, 3, 17, 16), (2, 3, 23, 16), (2, 3, 23, 8), ml_dtypes.bfloat16)
    out, lse = check_against_oracle(q, k, v, causal=True)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    assert lse.dtype == np.float32


def test_non_native_byte_order_float64_accumulates_in_float64():
    # '>f8' is float64: it must get float64 accumulation and a float64 lse like '<f8'.
    rng = _rng("byteorder")
    q, k, v = (x.astype(np.dtype(np.float64).newbyteorder()) for x in
               random_qkv(rng, (2, 9, 8), (2, 12, 8), (2, 12, 8), np.float64))
    out, lse = cupyflash.attention(q, k, v, return_lse=True, causal=True)
    expected, expected_lse = naive_attention(q, k, v, return_lse=True, causal=True)
    assert out.dtype.name == "float64" and lse.dtype.name == "float64"
    assert_close(out, expected, np.float64)
    assert_close(lse[np.isfinite(expected_lse)], expected_lse[np.isfinite(expected_lse)], np.float64)


def test_backend_numpy_is_what_auto_picks():
    rng = _rng("backend")
    q, k, v = random_qkv(rng, (2, 7, 4), (2, 9, 4), (2, 9, 4), np.float32)
    np.testing.assert_array_equal(cupyflash.attention(q, k, v, backend="numpy"),
                                  cupyflash.attention(q, k, v))


# ---- empty results and rows with no key ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lq_zero_returns_empty_result(dtype):
    rng = _rng("lq0", dtype)
    q, k, v = random_qkv(rng, (2, 3, 0, 4), (2, 3, 5, 4), (2, 3, 5, 6), dtype)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, causal=True)
    assert out.shape == (2, 3, 0, 6) and out.dtype == dtype
    assert lse.shape == (2, 3, 0) and lse.dtype == accum_dtype(dtype)
    buf = np.empty((2, 3, 0, 6), dtype)
    assert cupyflash.attention(q, k, v, out=buf) is buf


def test_zero_size_batch_returns_empty_result():
    rng = _rng("b0")
    q, k, v = random_qkv(rng, (0, 3, 4), (0, 5, 4), (0, 5, 6), np.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert out.shape == (0, 3, 6) and lse.shape == (0, 3)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lk_zero_gives_zeros_and_minus_inf_lse(dtype):
    rng = _rng("lk0", dtype)
    q, k, v = random_qkv(rng, (2, 3, 4), (2, 0, 4), (2, 0, 6), dtype)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 6) and out.dtype == dtype
    assert np.all(out.astype(np.float64) == 0)
    assert np.all(np.isneginf(lse))
    check_against_oracle(q, k, v)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(1, 0)), dict(window=(0, 0), causal=True)],
                         ids=["causal", "window", "causal_window"])
def test_causal_rows_with_no_key_are_zero_with_minus_inf_lse(dtype, kw):
    # Lq > Lk: with the bottom-right alignment the first Lq - Lk rows see no key.
    rng = _rng("nokey", dtype, kw)
    q, k, v = random_qkv(rng, (2, 3, 20, 8), (2, 3, 6, 8), (2, 3, 6, 5), dtype)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    empty = ~visible_mask(20, 6, **kw).any(axis=1)
    assert empty[:14].all() and not empty[14:].any()
    assert np.all(out[..., empty, :].astype(np.float64) == 0)
    assert np.all(np.isneginf(lse[..., empty]))
    assert np.all(np.isfinite(lse[..., ~empty]))
    check_against_oracle(q, k, v, **kw)


@pytest.mark.filterwarnings("error")
def test_window_can_leave_rows_in_the_middle_without_keys():
    # Lq > Lk and a window that is narrow and shifted: rows on both ends see no key.
    rng = _rng("middle")
    q, k, v = random_qkv(rng, (3, 30, 4), (3, 8, 4), (3, 8, 2), np.float32)
    out, lse = cupyflash.attention(q, k, v, window=(0, 3), return_lse=True)
    empty = ~visible_mask(30, 8, window=(0, 3)).any(axis=1)
    assert empty.any() and not empty.all()
    assert np.all(out[:, empty] == 0) and np.all(np.isneginf(lse[:, empty]))
    check_against_oracle(q, k, v, window=(0, 3))


# ---- large logits ------------------------------------------------------------------


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window=(3, None))], ids=["plain", "causal", "window"])
def test_large_logits_stay_finite_and_match_oracle(dtype, kw):
    rng = _rng("big", dtype, kw)
    q, k, v = random_qkv(rng, (2, 20, 16), (2, 25, 16), (2, 25, 16), dtype)
    q = (q.astype(np.float64) * 50).astype(dtype)
    k = (k.astype(np.float64) * 50).astype(dtype)
    with np.errstate(invalid="raise", over="raise"):
        out, lse = cupyflash.attention(q, k, v, scale=1.0, return_lse=True, **kw)
    assert np.abs(lse).max() > 5e3                      # |s| ~ 1e4 really happened
    assert np.isfinite(out.astype(np.float64)).all()
    assert np.isfinite(lse).all()
    check_against_oracle(q, k, v, scale=1.0, **kw)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_large_common_logit_offset_matches_oracle_in_float64(sign):
    # s = ±1e4 + O(1): a softmax that is not one-hot, at scores far from 0.
    rng = _rng("offset", sign)
    q, k, v = random_qkv(rng, (2, 15, 9), (2, 21, 9), (2, 21, 4), np.float64)
    q[..., 0], k[..., 0] = 100.0, sign * 100.0
    out, lse = check_against_oracle(q, k, v, scale=1.0, causal=True)
    assert np.all(np.abs(lse) > 9e3)
    assert np.isfinite(out).all()


@pytest.mark.filterwarnings("error")
def test_float16_inputs_near_dtype_max_do_not_overflow():
    rng = _rng("f16max")
    signs = lambda shape: np.where(rng.standard_normal(shape) > 0, 1.0, -1.0)  # noqa: E731
    q = (signs((2, 6, 8)) * 60000).astype(np.float16)
    k = (signs((2, 7, 8)) * 60000 * rng.uniform(0.5, 1, (2, 7, 1))).astype(np.float16)
    v = random_array(rng, (2, 7, 8), np.float16)
    out, lse = check_against_oracle(q, k, v)
    assert np.isfinite(out.astype(np.float64)).all() and np.isfinite(lse).all()


# ---- strides, out=, inputs untouched, determinism ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_blhd_views_match_oracle(dtype):
    rng = _rng("blhd", dtype)
    q_, k_, v_ = random_qkv(rng, (2, 19, 3, 8), (2, 27, 3, 8), (2, 27, 3, 8), dtype)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_, k_, v_))      # (B, H, L, d) views
    assert not q.flags.c_contiguous
    out, _ = check_against_oracle(q, k, v, causal=True)
    assert out.shape == (2, 3, 19, 8)
    contiguous = cupyflash.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=True)
    assert_close(out, contiguous.astype(np.float64), dtype, factor=2)


def test_unusual_strides_match_oracle():
    rng = _rng("strides")
    big = random_array(rng, (2, 30, 16), np.float32)
    q = big[:, ::3, ::2]                                 # non-unit last-axis stride
    k = big[:, ::-2, 1::2]                               # negative stride
    v = np.asfortranarray(random_array(rng, (2, 15, 5), np.float32))
    check_against_oracle(q, k, v, window=(4, 4))
    shared = np.broadcast_to(random_array(rng, (1, 9, 4), np.float32), (3, 9, 4))   # stride 0, read-only
    check_against_oracle(shared, shared, shared, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_is_filled_and_returned(dtype):
    rng = _rng("out", dtype)
    q, k, v = random_qkv(rng, (2, 3, 9, 4), (2, 3, 11, 4), (2, 3, 11, 5), dtype)
    out = poisoned((2, 3, 9, 5), dtype)
    result = cupyflash.attention(q, k, v, out=out, causal=True)
    assert result is out
    assert_close(out, naive_attention(q, k, v, causal=True), dtype)
    out2 = poisoned((2, 3, 9, 5), dtype)
    result, lse = cupyflash.attention(q, k, v, out=out2, causal=True, return_lse=True)
    assert result is out2
    np.testing.assert_array_equal(out2.astype(np.float64), out.astype(np.float64))
    assert_lse_close(lse, naive_attention(q, k, v, causal=True, return_lse=True)[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["rows_step2", "last_axis_step2", "blhd", "heads_reversed"])
def test_non_contiguous_out_view_is_filled_in_place(dtype, layout):
    rng = _rng("out-view", dtype, layout)
    q, k, v = random_qkv(rng, (2, 3, 9, 4), (2, 3, 11, 4), (2, 3, 11, 5), dtype)
    if layout == "rows_step2":
        buf = poisoned((2, 3, 18, 5), dtype)
        out, untouched = buf[:, :, ::2], buf[:, :, 1::2]
    elif layout == "last_axis_step2":
        buf = poisoned((2, 3, 9, 10), dtype)
        out, untouched = buf[..., ::2], buf[..., 1::2]
    elif layout == "blhd":
        buf = poisoned((2, 9, 3, 5), dtype)
        out, untouched = buf.transpose(0, 2, 1, 3), None
    else:
        buf = poisoned((2, 3, 9, 5), dtype)
        out, untouched = buf[:, ::-1], None
    assert not out.flags.c_contiguous
    result = cupyflash.attention(q, k, v, out=out, window=(3, 1))
    assert result is out
    expected = naive_attention(q, k, v, window=(3, 1))
    assert_close(out, expected, dtype)
    if untouched is not None:
        assert np.isnan(untouched.astype(np.float64)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inputs_are_not_modified(dtype):
    rng = _rng("inputs", dtype)
    q, k, v = random_qkv(rng, (2, 4, 9, 8), (2, 2, 13, 8), (2, 2, 13, 6), dtype)
    copies = [x.copy() for x in (q, k, v)]
    for x in (q, k, v):
        x.flags.writeable = False                    # a write would raise
    cupyflash.attention(q, k, v, enable_gqa=True, causal=True, return_lse=True, scale=3.0)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x.view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_results_are_bit_identical_on_repeat(dtype):
    rng = _rng("repeat", dtype)
    q, k, v = random_qkv(rng, (2, 4, 70, 8), (2, 2, 90, 8), (2, 2, 90, 6), dtype)
    first = cupyflash.attention(q, k, v, enable_gqa=True, causal=True, return_lse=True)
    for _ in range(2):
        again = cupyflash.attention(q, k, v, enable_gqa=True, causal=True, return_lse=True)
        np.testing.assert_array_equal(again[0].view(np.uint8), first[0].view(np.uint8))
        np.testing.assert_array_equal(again[1], first[1])
    into = cupyflash.attention(q, k, v, enable_gqa=True, causal=True, out=poisoned(first[0].shape, dtype))
    np.testing.assert_array_equal(into.view(np.uint8), first[0].view(np.uint8))


# ---- memory -------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window=(256, 256)), dict(return_lse=True)],
                         ids=["plain", "causal", "window", "lse"])
def test_memory_stays_far_below_the_score_matrix(kw):
    # Lq = Lk = 4096: the float32 score matrix alone would be 64 MiB.
    length, d = 4096, 64
    rng = _rng("memory")
    q, k, v = random_qkv(rng, (length, d), (length, d), (length, d), np.float32)
    tracemalloc.start()
    try:
        probe = np.ones(2 * 2**20, dtype=np.float32)     # tracemalloc sees NumPy's allocations
        del probe
        assert tracemalloc.get_traced_memory()[1] >= 8 * 2**20
        tracemalloc.reset_peak()
        result = cupyflash.attention(q, k, v, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    score_matrix = length * length * 4
    assert peak < 32 * 2**20, f"peak {peak / 2**20:.1f} MiB (score matrix {score_matrix / 2**20:.0f} MiB)"
    out = result[0] if isinstance(result, tuple) else result
    left, right = kw.get("window", (None, None))
    right = 0 if kw.get("causal") else right
    for i in rng.choice(length, 6, replace=False):      # spot-check a few rows (Lq = Lk: diagonal j = i)
        lo = 0 if left is None else max(0, i - left)
        hi = length if right is None else i + right + 1
        assert_close(out[i:i + 1], naive_attention(q[i:i + 1], k[lo:hi], v[lo:hi]), np.float32)


def test_no_warnings_on_ordinary_inputs():
    rng = _rng("warn")
    q, k, v = random_qkv(rng, (2, 30, 8), (2, 7, 8), (2, 7, 8), np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({}, dict(causal=True), dict(window=(0, 0)), dict(window=(2, 2), causal=True)):
            cupyflash.attention(q, k, v, return_lse=True, **kw)


def test_causal_skips_the_blocks_above_the_diagonal(monkeypatch):
    # Square causal problem: with square blocks, the blocks above the diagonal are
    # never computed (about half of them), not computed and then masked.
    seen = []
    original = _cpu.block_bounds

    def counting(*args):
        kind = original(*args)
        seen.append(kind)
        return kind

    monkeypatch.setattr(_cpu, "block_bounds", counting)
    rng = _rng("causal-skip")
    q, k, v = random_qkv(rng, (2048, 16), (2048, 16), (2048, 16), np.float32)
    out = cupyflash.attention(q, k, v, causal=True)
    assert_close(out, naive_attention(q, k, v, causal=True), np.float32)
    n = math.isqrt(len(seen))                   # n x n square blocks: n (n - 1) / 2 above the diagonal
    assert n * n == len(seen) and seen.count("empty") >= n * (n - 1) // 2, seen


# ---- the running max as the exponent's reference --------------------------------------------

@pytest.mark.parametrize("jump, redone", [(0.0, False), (3.0, False), (30.0, True), (200.0, True)],
                         ids=["flat", "kept", "redone", "huge"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_later_key_blocks_with_larger_scores(jump, redone, dtype, monkeypatch):
    """After the first key block a row's weights are taken against its running max
    without a max pass; a block whose weights would sum past 2^32 (scores more than
    ~22 above that max) is redone against its own max.  Either way the result is the
    oracle's, with no warnings (the overflow of the first attempt is expected)."""
    rng = np.random.default_rng(int(jump))
    lq, lk, d = 40, 2048, 16
    _, bc = _cpu._block_sizes(1, lq, lk, False)
    assert lk // bc >= 3, "needs several key blocks"
    q = rng.standard_normal((1, lq, d)).astype(dtype)
    k = rng.standard_normal((1, lk, d)).astype(dtype)
    v = rng.standard_normal((1, lk, d)).astype(dtype)
    # keys of the last block get a score `jump` larger for every query (k . q grows)
    boost = jump * q.mean(axis=1) / np.square(q.mean(axis=1)).sum()
    k[:, -bc:] += boost.astype(dtype)[:, None, :] * math.sqrt(d)
    blocks = []
    scores = _cpu._scores
    monkeypatch.setattr(_cpu, "_scores", lambda *a, **kw: blocks.append(a[2]) or scores(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert blocks == list(range(0, lk, bc)) + ([lk - bc] if redone else [])
    ref, ref_lse = naive_attention(q, k, v, return_lse=True)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out, ref, **tol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol["rtol"], atol=tol["atol"] * abs(ref_lse).max())


def test_nan_in_a_later_key_block_still_propagates():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 8, 2048, 16)).astype(np.float32) for _ in range(3))
    k[0, 3, -5, 2] = np.nan                  # one key of the last block, head 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cupyflash.attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 3]).all() and np.isnan(lse[0, 3]).all()
    others = np.delete(np.arange(8), 3)
    assert np.isfinite(out[0, others]).all() and np.isfinite(lse[0, others]).all()
