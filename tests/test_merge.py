"""merge_attention: partial attentions over disjoint key sets merge into the single call's result."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash.reference import naive_attention

from _util import DTYPE_IDS, DTYPES, HALF, TOLERANCE, accum_dtype, assert_lse_close, poisoned, random_qkv

# Lq > Lk with the bottom-right causal mask: the first Lq - Lk query rows see no key at all.
LQ, LK = 12, 9


def key_partition(rng, n, seqlen_k):
    """``n`` contiguous key ranges [a, b) covering [0, seqlen_k); from n = 3 on, one is empty."""
    cuts = np.sort(rng.integers(0, seqlen_k + 1, size=n - 1))
    if n >= 3:
        cuts[1] = cuts[0]
    bounds = [0, *cuts.tolist(), seqlen_k]
    return list(zip(bounds[:-1], bounds[1:]))


def partials(q, k, v, parts, backend):
    """Each key range's attention under the global bottom-right causal mask: key j' of range
    [a, b) is key a + j', visible to row i iff a + j' <= i + Lk - Lq, i.e. the bottom-right
    window (None, Lk - b) of the (Lq, b - a) sub-problem."""
    seqlen_k = k.shape[-2]
    res = [cupyflash.attention(q, k[..., a:b, :], v[..., a:b, :], window=(None, seqlen_k - b),
                               return_lse=True, backend=backend) for a, b in parts]
    return [o for o, _ in res], [s for _, s in res]


def merge_bound(q, k, v, parts, dtype):
    """Error bound for the merge of partials each within the dtype's tolerance of its exact
    value o_i*: with exact weights f_i = exp(lse_i* - lse*) (sum 1),
    |merged - o*| <= sum_i f_i |o_i - o_i*|          (the partials' own errors)
                   + sum_i |f^_i - f_i| |o_i|        (from the lse errors, relative 2·dlse)
                   + rounding of the result once.
    """
    tol, acc_tol = TOLERANCE[np.dtype(dtype)], TOLERANCE[accum_dtype(dtype)]
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    seqlen_k = k.shape[-2]
    whole, lse = naive_attention(q64, k64, v64, causal=True, return_lse=True)
    shift = np.where(np.isneginf(lse), 0, lse)
    weighted = np.zeros_like(whole)          # sum_i f_i |o_i*|
    lse_err = 0.0
    for a, b in parts:
        o_i, lse_i = naive_attention(q64, k64[..., a:b, :], v64[..., a:b, :],
                                     window=(None, seqlen_k - b), return_lse=True)
        weighted += np.exp(lse_i - shift)[..., None] * np.abs(o_i)
        finite = lse_i[np.isfinite(lse_i)]
        lse_err = max(lse_err, acc_tol["rtol"] * float(np.abs(finite).max(initial=0)) + acc_tol["atol"])
    bound = tol["atol"] + (tol["rtol"] + 2 * lse_err) * weighted + tol["rtol"] * np.abs(whole)
    return whole, lse, bound


def check_merge(q, k, v, n, backend, rng):
    parts = key_partition(rng, n, k.shape[-2])
    outs, lses = partials(q, k, v, parts, backend)
    out, lse = cupyflash.merge_attention(outs, lses)
    whole, whole_lse, bound = merge_bound(q, k, v, parts, q.dtype)
    assert out.dtype == q.dtype and out.shape == whole.shape
    err = np.abs(out.astype(np.float64) - whole)
    assert (err <= bound).all(), f"n={n} parts={parts}: error {err.max():.3g} beyond the bound"
    assert_lse_close(lse, whole_lse, q.dtype)
    assert np.isneginf(lse[..., : LQ - LK]).all() and not out[..., : LQ - LK, :].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_of_key_partitions_equals_single_call(dtype):
    rng = np.random.default_rng(31)
    q, k, v = random_qkv(rng, (2, 3, LQ, 8), (2, 3, LK, 8), (2, 3, LK, 5), dtype)
    for n in range(1, 9):
        check_merge(q, k, v, n, "numpy", rng)


def test_merge_float64_equals_single_call_to_1e_12():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, (3, LQ, 16), (3, LK, 16), (3, LK, 16), np.float64)
    parts = key_partition(rng, 5, LK)
    out, lse = cupyflash.merge_attention(*partials(q, k, v, parts, "numpy"))
    whole, whole_lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(whole_lse))
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_merge_of_emulator_partials_equals_single_call(dtype):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, (1, 2, LQ, 16), (1, 2, LK, 16), (1, 2, LK, 16), dtype)
    check_merge(q, k, v, 4, "emulator", rng)


def test_rows_with_every_lse_neginf_are_zero():
    outs = np.zeros((3, 2, 4, 5), np.float32)
    lses = np.full((3, 2, 4), -np.inf, np.float32)
    lses[1, 0, 2] = 0.5
    outs[1, 0, 2] = 7.0
    out, lse = cupyflash.merge_attention(outs, lses)
    assert np.isneginf(lse).sum() == 7 and lse[0, 2] == np.float32(0.5)
    assert (out[0, 2] == 7.0).all() and np.count_nonzero(out) == 5
    assert not np.isnan(out).any()


def test_nan_propagates():
    rng = np.random.default_rng(1)
    outs = rng.standard_normal((2, 3, 4, 5))
    lses = rng.standard_normal((2, 3, 4))
    outs[0, 1, 2, 3] = np.nan
    lses[1, 2, 0] = np.nan
    out, lse = cupyflash.merge_attention(outs, lses)
    assert np.isnan(out[1, 2, 3]) and np.isnan(out[2, 0]).all() and np.isnan(lse[2, 0])
    assert np.isnan(out).sum() == 1 + 5 and np.isnan(lse).sum() == 1


def test_axis_list_and_out_forms_agree():
    rng = np.random.default_rng(2)
    outs = rng.standard_normal((2, 4, 3, 6, 5)).astype(np.float32)
    lses = rng.standard_normal((2, 4, 3, 6)).astype(np.float32)
    ref_out, ref_lse = cupyflash.merge_attention(np.moveaxis(outs, 1, 0), np.moveaxis(lses, 1, 0))
    for o, s in ((outs, lses), ([outs[:, i] for i in range(4)], [lses[:, i] for i in range(4)])):
        got, got_lse = cupyflash.merge_attention(o, s, axis=1)
        np.testing.assert_array_equal(got, ref_out)
        np.testing.assert_array_equal(got_lse, ref_lse)
    buf = poisoned((2, 3, 6, 5), np.float32)
    got, _ = cupyflash.merge_attention(outs, lses, axis=-4, out=buf)
    assert got is buf
    np.testing.assert_array_equal(buf, ref_out)


def test_half_partials_are_merged_in_float32_and_rounded_once():
    rng = np.random.default_rng(3)
    lses = rng.standard_normal((5, 2, 7)).astype(np.float32)
    for dtype in HALF:
        outs = rng.standard_normal((5, 2, 7, 4)).astype(dtype)
        out, lse = cupyflash.merge_attention(outs, lses)
        wide, wide_lse = cupyflash.merge_attention(outs.astype(np.float32), lses)
        assert out.dtype == dtype and lse.dtype == np.float32
        np.testing.assert_array_equal(out, wide.astype(dtype))
        np.testing.assert_array_equal(lse, wide_lse)


def _bad_cases():
    f32 = np.zeros((2, 3, 4, 5), np.float32)
    l32 = np.zeros((2, 3, 4), np.float32)
    return [
        (dict(outs=f32, lses=l32[:, :, :3]), ValueError,
         r"`lses` must have shape outs.shape\[:-1\] = \(2, 3, 4\); got \(2, 3, 3\)"),
        (dict(outs=f32[0, 0], lses=l32[0, 0]), ValueError, "at least 3 axes"),
        (dict(outs=f32, lses=l32, axis=2), ValueError, "batch axis"),
        (dict(outs=f32, lses=l32, axis=-1), ValueError, "batch axis"),
        (dict(outs=f32, lses=l32, axis=1.0), ValueError, "`axis` must be an int"),
        (dict(outs=f32.astype(np.int32), lses=l32), TypeError, "`outs` must have dtype"),
        (dict(outs=f32, lses=l32.astype(np.float16)), TypeError, "`lses` must have dtype float32 or float64"),
        (dict(outs=f32.tolist(), lses=l32), TypeError, r"outs\[0\]"),
        (dict(outs=[f32[0], f32[1, :2]], lses=[l32[0], l32[1, :2]]), ValueError, "one shape"),
        (dict(outs=[], lses=[]), ValueError, "at least one"),
        (dict(outs=f32, lses=l32, out=np.zeros((3, 4, 5), np.float64)), ValueError, "`out` must have dtype float32"),
        (dict(outs=f32, lses=l32, out=np.zeros((2, 4, 5), np.float32)), ValueError,
         r"`out` must have shape \(3, 4, 5\)"),
        (dict(outs=f32, lses=l32, out=f32[0]), ValueError, "must not overlap"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_before_writing(case):
    kwargs, exc, match = _bad_cases()[case]
    out = kwargs.get("out")
    before = None if out is None else out.copy()
    with pytest.raises(exc, match=match):
        cupyflash.merge_attention(kwargs.pop("outs"), kwargs.pop("lses"), **kwargs)
    if out is not None:
        np.testing.assert_array_equal(out, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["float16", "float32", "float64"])
def test_merge_of_cupy_partials_equals_single_call(dtype):
    import cupy as cp

    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, (2, 3, LQ, 64), (2, 3, LK, 64), (2, 3, LK, 64), dtype)
    parts = key_partition(rng, 4, LK)
    outs, lses = partials(*(cp.asarray(x) for x in (q, k, v)), parts, "cuda")
    out, lse = cupyflash.merge_attention(outs, lses)
    assert isinstance(out, cp.ndarray) and out.dtype == dtype and lse.dtype == accum_dtype(dtype)
    whole, whole_lse, bound = merge_bound(q, k, v, parts, dtype)
    err = np.abs(out.get().astype(np.float64) - whole)
    assert (err <= bound).all(), f"parts={parts}: error {err.max():.3g} beyond the bound"
    assert_lse_close(lse.get(), whole_lse, dtype)
