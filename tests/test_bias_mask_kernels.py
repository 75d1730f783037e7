"""``bias=`` and ``mask=`` on the CUDA kernels, run by the emulator: every kernel family
the dispatcher can pick, forced in turn at sm_80 or sm_90 dispatch, against the float64
oracle; the bias gradient's sums and its run-to-run identity; the launches that keep
its writes disjoint; the stride limit.

One representative shape per family (GQA 2:1, Lq != Lk, tails that are no multiple of
any tile, a causal window, a fully masked row, a tuple of two biases of other dtypes
than q, broadcast along different axes, and a mask); the shapes and options the NumPy
path covers in full are tests/test_bias_mask.py's.  Error rules: docs/testing.md
("Tolerances", "Bias and masks"): the table for outputs, ``assert_grad_close`` for
dq/dk/dv, the dbias bound of test_bias_mask.py.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupyflash
from cupyflash.reference import naive_attention, naive_attention_backward

from _terms_util import assert_dbias_close, check_backward, check_forward, dbias_bound
from _util import (EMULATED_FAMILIES, assert_close, assert_grad_close, assert_lse_close, family_params, guarded_array,
                   random_array)

B, HQ, HKV, LQ, LK = 2, 4, 2, 45, 70


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _inputs(key, dtype, d=64, dv=None):
    rng = _rng(key, np.dtype(dtype).name)
    q = random_array(rng, (B, HQ, LQ, d), dtype)
    k = random_array(rng, (B, HKV, LK, d), dtype)
    v = random_array(rng, (B, HKV, LK, dv or d), dtype)
    dout = random_array(rng, (B, HQ, LQ, dv or d), dtype)
    # key padding per sequence (float16, broadcast along heads and queries) + a per-head
    # pair bias (float32, broadcast along the batch): what a padded point-cloud model passes
    bias = (random_array(rng, (B, 1, 1, LK), np.float16), random_array(rng, (HQ, LQ, LK), np.float32))
    mask = rng.random((B, 1, LQ, LK)) < 0.7
    mask[0, 0, 5, :] = False            # a row that sees no key: zeros, lse = -inf, no gradient
    return q, k, v, dout, bias, mask


FAMILIES = EMULATED_FAMILIES


def _launched(spy, direction):
    return {n.split("<")[0].removeprefix("cf::") for n in spy.launched if n.startswith(f"cf::{direction}_")}


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(FAMILIES))
def test_forward_families_match_the_oracle(emulate, arch, options, dtype, precision, family):
    spy = emulate(arch, **options)
    q, k, v, _, bias, mask = _inputs("forward", dtype)
    kw = dict(bias=bias, mask=mask, causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, precision=precision, **kw)
    assert _launched(spy, "fwd") == {f"fwd_{family}_kernel"}
    check_forward(out, lse, q, k, v, precision, **kw)
    assert (out[0, :, 5] == 0).all() and np.isneginf(lse[0, :, 5]).all()


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(
    FAMILIES + [("mma-f16-atomic-dq", 80, {}, np.float16, "ieee", "mma")]))
def test_backward_families_match_the_oracle(emulate, request, arch, options, dtype, precision, family):
    deterministic = "atomic" not in request.node.callspec.id
    spy = emulate(arch, **options)
    q, k, v, dout, bias, mask = _inputs("backward", dtype)
    kw = dict(bias=bias, mask=mask, causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", precision=precision,
                                         deterministic=deterministic, **kw)
    assert {n.split("_")[1] for n in _launched(spy, "bwd")} - {"simt"} <= {family}
    assert any(n.startswith(f"bwd_{family}_dkdv") for n in _launched(spy, "bwd"))
    check_backward(grads, dout, q, k, v, out, lse, precision, **kw)
    assert (grads[0][0, :, 5] == 0).all()            # the row that sees no key


def test_split_kv_with_terms(emulate):
    # the split instantiations read the terms per split and fwd_combine merges them
    spy = emulate(80, splits=3)
    q, k, v, _, bias, mask = _inputs("split", np.float16)
    kw = dict(bias=bias, mask=mask, causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    assert any(g[1] == 3 for _, g in spy.launches) and "fwd_combine_kernel" in _launched(spy, "fwd")
    check_forward(out, lse, q, k, v, "ieee", **kw)


def test_bias_gradient_is_bit_identical_across_runs(emulate):
    # the sums into dbias run in a fixed order whatever order the warps run in
    q, k, v, dout, bias, mask = _inputs("identity", np.float32)
    kw = dict(bias=bias, mask=mask, causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    runs = []
    for seed in (1, 2):
        emulate(80, seed=seed, dmma={"float32"})
        runs.append(cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw))
    for a, b in zip(runs[0][:3] + runs[0][3], runs[1][:3] + runs[1][3]):
        np.testing.assert_array_equal(a, b)


def test_launches_keep_bias_gradient_writes_disjoint(emulate):
    # A term broadcast along the batch (or the heads) has one dbias element per (i, j) that
    # several CTAs' dS reach: each batch entry (kv head) gets its own launches, in order.
    spy = emulate(80)
    q, k, v, dout, bias, mask = _inputs("disjoint", np.float32)
    kw = dict(bias=bias, causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    dkdv = [g for n, g in spy.launches if "dkdv" in n]
    # term 0 broadcast along heads (2 kv heads), term 1 along the batch (2 entries): 4 launches,
    # each over one (batch entry, kv head) and its key blocks
    assert len(dkdv) == B * HKV and all(g[0] == -(-LK // _block_n(spy)) for g in dkdv)
    spy.launches.clear()
    full = random_array(_rng("full"), (B, HQ, LQ, LK), np.float32)        # nothing broadcast: one launch
    cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", bias=full, causal=True,
                                 enable_gqa=True)
    assert len([n for n, _ in spy.launches if "dkdv" in n]) == 1


def _block_n(spy):
    from cupyflash._families import by_name
    (name,) = {n for n, _ in spy.launches if "dkdv" in n}
    return by_name()[name].block_n


def test_evoformer_terms_and_lengths(emulate):
    # (B, N, H, L, d) with the (B, N, 1, 1, L) mask bias and the (B, 1, H, L, L) pair bias
    # (the batch dims cannot merge: a launch per batch entry), then per-sequence lengths
    emulate(80)
    rng = _rng("evoformer")
    b, n, h, L, d = 2, 3, 2, 20, 16
    q, k, v, dout = (random_array(rng, (b, n, h, L, d), np.float32) for _ in range(4))
    bias = (random_array(rng, (b, n, 1, 1, L), np.float32), random_array(rng, (b, 1, h, L, L), np.float32))
    out, lse = cupyflash.attention(q, k, v, bias=bias, backend="emulator", return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, bias=bias, return_lse=True)
    assert_close(out, ref, np.float32)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, bias=bias, backend="emulator")
    expected = naive_attention_backward(dout, q, k, v, bias=bias)
    for g, e in zip(grads[:3], expected[:3]):
        assert_grad_close(g, e, np.float32)
    assert_dbias_close(grads[3], expected[3], dbias_bound(dout, q, k, v, bias, np.float32), bias)

    lens = dict(q_lengths=np.array([[20, 7, 0], [13, 20, 1]]), kv_lengths=np.array([[20, 11, 4], [0, 17, 20]]))
    mask = rng.random((b, n, 1, L, L)) < 0.8
    kw = dict(bias=bias, mask=mask, causal=True, **lens)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    ref, ref_lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    assert_close(out, ref, np.float32)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    expected = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw)
    for g, e in zip(grads[:3], expected[:3]):
        assert_grad_close(g, e, np.float32)
    for g, e in zip(grads[3], expected[3]):
        assert_close(g, e, np.float32, factor=4.0)


def test_a_term_constant_along_the_keys_has_exactly_zero_gradient(emulate):
    # shifting a row's scores does not change its softmax: dS sums to 0 along each row,
    # and the kernels do not compute it (the NumPy path sums it to rounding level)
    emulate(80)
    q, k, v, dout, _, mask = _inputs("row-constant", np.float32)
    bias = (random_array(_rng("rows"), (B, HQ, LQ, 1), np.float32), random_array(_rng("pair"), (LQ, LK), np.float32))
    kw = dict(bias=bias, mask=mask, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, np.float32)
    assert_lse_close(lse, ref_lse, np.float32)          # the row constant is in lse
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    assert (grads[3][0] == 0).all()
    expected = naive_attention_backward(dout, q, k, v, **kw)
    assert_dbias_close(grads[3], expected[3], dbias_bound(dout, q, k, v, bias, np.float32, mask=mask,
                                                            enable_gqa=True), bias)


def test_terms_past_the_stride_limit_are_refused_before_any_work():
    q = np.zeros((1, 1, 4, 8), np.float32)
    far = np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (4, 4), (4 << 23, 4))
    with pytest.raises(NotImplementedError, match="`bias`.*8388608.*backend='numpy'"):
        cupyflash.attention(q, q, q, bias=far, backend="emulator")
    far_mask = np.lib.stride_tricks.as_strided(np.ones(8, bool), (4, 4), (1 << 23, 1))
    with pytest.raises(NotImplementedError, match="`mask`"):
        cupyflash.attention(q, q, q, mask=far_mask, backend="emulator")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["mma-f16", "simt-f32"])
def test_terms_outside_the_view_are_never_read(emulate, dtype):
    # A tile's padding (rows past Lq, keys past Lk) must read no term.  The pair bias ends
    # where inaccessible memory begins (a read past its last row faults), and the mask is a
    # view into a larger array whose rows and keys past the view are True, the bias's NaN:
    # read, they would reach dV through the padding rows' P.
    emulate(80)
    q, k, v, dout, (pad, pair), mask = _inputs("outside", dtype)
    fenced = guarded_array(pair.shape, pair.dtype)
    fenced[...] = pair
    big_mask = np.ones((B, 1, LQ + 40, LK + 40), bool)
    big_mask[..., :LQ, :LK] = mask
    big_pad = np.full((B, 1, 1, LK + 40), np.nan, pad.dtype)
    big_pad[..., :LK] = pad
    kw = dict(bias=(big_pad[..., :LK], fenced), mask=big_mask[..., :LQ, :LK], causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, **kw)
    check_forward(out, lse, q, k, v, "ieee", **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    check_backward(grads, dout, q, k, v, out, lse, "ieee", **kw)
