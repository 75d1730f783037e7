"""Checks shared by the bias and mask tests (tests/test_bias_mask.py, the kernels'
tests/test_bias_mask_kernels.py, tests/test_gpu_bias_mask.py and tests/terms_sweep.py):
the dbias bound of docs/testing.md ("Bias and masks") and the families' error rules
applied to calls with terms."""

from __future__ import annotations

import numpy as np

from cupyflash.reference import _probabilities, _reduce_to, naive_attention, naive_attention_backward

from _backward_util import (HALF_YARDSTICK_FACTOR, assert_within_term_bound, assert_within_yardstick,
                            backward_term_sizes, naive_half_backward)
from _util import (HALF_FORWARD_FACTOR, HALF_UNIT_ROUNDOFF, TOLERANCE, assert_close, assert_lse_close,
                   naive_half_attention)


def terms_of(bias):
    """A bias as its tuple of terms."""
    return bias if isinstance(bias, tuple) else (bias,)


def dbias_bound(dout, q, k, v, bias, dtype, **kw):
    """Per term: the table's atol (the looser of the inputs' and the term's dtype) times
    max(1, the size of the dS terms the element adds up), and its rtol per element.

    The size of dS_ij = P_ij (dP_ij - delta_i) is P_ij (|dO_i| . |V_j| + |dO_i| . |O_i|):
    the sums dP and delta are rounded relative to the sizes of their own terms, not to
    their (possibly cancelling) values -- delta all the more as it reads O rounded to
    the inputs' dtype (docs/testing.md, "Bias and masks")."""
    _, p, _, o = _probabilities(q, k, v, bias=bias, **kw)
    do = np.abs(np.broadcast_to(np.asarray(dout, np.float64), p.shape[:-1] + (o.v.shape[-1],)))
    out = np.abs(p @ o.v)
    size = p * (do @ np.swapaxes(np.abs(o.v), -1, -2) + np.sum(do * out, axis=-1, keepdims=True))
    bounds = []
    for b in terms_of(bias):
        tol = max((TOLERANCE[np.dtype(t)] for t in (dtype, b.dtype)), key=lambda t: t["atol"])
        bounds.append((tol, _reduce_to(size, b.shape).reshape(b.shape)))
    return bounds


def assert_dbias_close(dbias, expected, bounds, bias):
    if isinstance(bias, tuple):
        assert isinstance(dbias, tuple) and len(dbias) == len(bias)
    else:
        assert not isinstance(dbias, tuple)
    for i, (g, e, (tol, size), b) in enumerate(zip(terms_of(dbias), terms_of(expected), bounds, terms_of(bias))):
        assert g.shape == b.shape and g.dtype == b.dtype, f"dbias[{i}]: {g.shape} {g.dtype}"
        err = np.abs(g.astype(np.float64) - e)
        allowed = tol["rtol"] * np.abs(e) + tol["atol"] * np.maximum(1.0, size)
        assert (err <= allowed).all(), f"dbias[{i}]: worst error/bound {float((err / allowed).max()):.3g}"


def _window(kw):
    """The (left, right) window of a call's keywords (``causal`` folded in)."""
    left, right = kw.get("window") or (None, None)
    if kw.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def _gqa(q, k, kw):
    return q.shape[-3] // k.shape[-3] if kw.get("enable_gqa") else 1


def check_forward(out, lse, q, k, v, precision, **kw):
    """The families' forward rules (docs/testing.md, "Shares of the bound"): 16-bit within
    HALF_FORWARD_FACTOR of naive_half_attention's error (with the same terms) plus one
    rounding of the largest output; float32 (tf32x3 too) and float64 the table."""
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **kw)
    dtype = np.dtype(q.dtype)
    if dtype.itemsize == 2 and out.size:
        scale = kw.get("scale") or 1.0 / np.sqrt(q.shape[-1])
        terms = () if kw.get("bias") is None else terms_of(kw["bias"])
        naive = naive_half_attention(q, k, v, scale=scale, window=_window(kw), gqa_ratio=_gqa(q, k, kw),
                                     bias=terms, mask=kw.get("mask"))
        err = np.abs(out.astype(np.float64) - ref).max()
        largest = np.abs(ref).max()
        bound = (HALF_FORWARD_FACTOR * np.abs(naive.astype(np.float64) - ref).max()
                 + (HALF_UNIT_ROUNDOFF[dtype.name] + 2.0**-24) * largest)
        assert err <= bound, f"max error {err:.3g} > {bound:.3g}"
    else:
        assert_close(out, ref, np.float32 if precision != "ieee" else dtype)
    assert_lse_close(lse, ref_lse, dtype)


def check_backward(grads, dout, q, k, v, out, lse, precision, **kw):
    """The families' backward rules: 16-bit within HALF_YARDSTICK_FACTOR of
    naive_half_backward's error (same terms); float32 (tf32x3 too) and float64 the term
    bound (sizes with the terms' probabilities); dbias test_bias_mask.py's bound."""
    expected = naive_attention_backward(dout, q, k, v, **kw)
    dtype = np.dtype(q.dtype)
    sizes = backward_term_sizes(dout, q, k, v, **kw)
    bias = kw.get("bias")
    terms = () if bias is None else terms_of(bias)
    half = (naive_half_backward(dout, q, k, v, out, scale=kw.get("scale") or 1.0 / np.sqrt(q.shape[-1]),
                                window=_window(kw), gqa_ratio=_gqa(q, k, kw), lse=lse, bias=terms,
                                mask=kw.get("mask"))
            if dtype.itemsize == 2 else (None,) * 3)
    for name, g, e, x, h, size in zip(("dq", "dk", "dv"), grads, expected, (q, k, v), half, sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        if h is not None:
            assert_within_yardstick(g, e, h, factor=HALF_YARDSTICK_FACTOR, sizes=size, what=name)
        else:
            assert_within_term_bound(g, e, size, eps=np.finfo(dtype).eps, head_dim=max(q.shape[-1], v.shape[-1]),
                                     what=name)
    if bias is None:
        assert len(grads) == 3
        return
    others = {n: x for n, x in kw.items() if n != "bias"}
    accuracy = np.float32 if precision != "ieee" else dtype
    assert_dbias_close(grads[3], expected[3], dbias_bound(dout, q, k, v, bias, accuracy, **others), bias)
