"""Backward-pass test helpers: the half-precision yardstick shared by the emulated and GPU tiers.

A float16/bfloat16 backward cannot be compared with the float64 oracle at a
fixed tolerance that means anything: its error is set by how the intermediate
matrices are rounded.  The yardstick rounds exactly where a tensor-core flash
backward must (P and dS to the half dtype as the A operands of their products,
everything else float32; not S, which no flash kernel rounds), and a kernel
must stay within HALF_YARDSTICK_FACTOR of its error (docs/testing.md, "Error
analysis").
"""

from __future__ import annotations

import math

import numpy as np

from cupyflash.reference import naive_attention_backward

from _util import (TF32X3_SPLIT, logit_rounding, tf32_mma_cut, tf32x3_chain, to_tf32, visible,
                   with_terms)


def naive_half_backward(dout, q, k, v, out, *, scale, window=(None, None), gqa_ratio=1, lse=None, bias=(),
                        mask=None, softcap=None, score_fn=None, score_fn_grad=None):
    """(dq, dk, dv) in float32, computed as a flash backward in half precision does.

    q, dout, out ``(..., Hq, Lq, ·)``; k, v ``(..., Hkv, Lk, ·)`` with
    ``Hq = gqa_ratio * Hkv``; batch dims broadcast.  The roundings are the ones a
    tensor-core backward cannot avoid, and no others: S = Q K^T and dP = dO V^T
    products of the (half) inputs summed in float32; P = exp(scale S - lse) in
    float32 (``lse`` the forward's, else the float32 row's own); P rounded to the
    half dtype for dV = P^T dO, dS = P o (dP - delta) rounded to it for dQ = scale dS K
    and dK = scale dS^T Q (the products' A operands), every sum in float32; delta =
    rowsum(dO o O) in float32 from the stored (half) O; dk and dv summed over each kv
    head's group of query heads, and every gradient over the batch dims its input was
    broadcast along, in float32.  Not rounded to the half dtype at the end: a caller
    comparing half results allows for that one rounding itself.  ``bias`` (a tuple of
    terms) and ``mask`` enter the scores as the kernels' epilogue adds them
    (tests/_util.py's with_terms); ``softcap`` before them and ``score_fn(s)`` after
    (with its derivative ``score_fn_grad``), in float32, and dS takes their derivatives
    in float32 before its rounding to half, as the kernels' gradient epilogue does.
    """
    dtype = np.dtype(q.dtype)

    def f32(x):
        return np.asarray(x).astype(np.float32)

    def half(x):
        return x.astype(dtype).astype(np.float32)

    g = gqa_ratio
    q32, do, o = f32(q), f32(dout), f32(out)
    heads_kv = q32.shape[-3] // g     # a broadcast (size-1) kv head axis first takes Hkv heads

    def per_query_head(x):
        x = np.broadcast_to(f32(x), x.shape[:-3] + (heads_kv,) + x.shape[-2:])
        return np.repeat(x, g, axis=-3)

    k32, v32 = per_query_head(k), per_query_head(v)
    s = (q32 @ np.swapaxes(k32, -1, -2)) * np.float32(scale)
    d_cap = d_mod = None
    if softcap is not None:
        t = np.tanh(s / np.float32(softcap))
        s, d_cap = (np.float32(softcap) * t).astype(np.float32), (1 - t * t).astype(np.float32)
    if score_fn is not None:      # after the bias: with_terms adds it, then the function, then the mask
        s = with_terms(s, np.ones(s.shape[-2:], bool), bias, None)
        d_mod = np.asarray(score_fn_grad(s), np.float32)
        s = np.asarray(score_fn(s), np.float32)
        s = with_terms(s, visible(q32.shape[-2], k32.shape[-2], window), (), mask)
    else:
        s = with_terms(s, visible(q32.shape[-2], k32.shape[-2], window), bias, mask)
    if lse is None:
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.exp(s - np.where(np.isfinite(m), m, 0))
            lse = (np.where(np.isfinite(m), m, 0) + np.log(e.sum(axis=-1, keepdims=True)))[..., 0]
    lse = np.asarray(lse, dtype=np.float32)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(np.isfinite(lse), np.exp(s - np.where(np.isfinite(lse), lse, 0)), 0).astype(np.float32)
    dv = np.swapaxes(half(p), -1, -2) @ do
    dp = do @ np.swapaxes(v32, -1, -2)
    ds = (p * (dp - np.sum(do * o, axis=-1, keepdims=True))).astype(np.float32)
    for factor in (d_mod, d_cap):
        if factor is not None:
            ds = np.where(p > 0, ds * factor, np.float32(0)).astype(np.float32)
    dq = half(ds) @ k32 * np.float32(scale)
    dk = np.swapaxes(half(ds), -1, -2) @ q32 * np.float32(scale)

    def group_sum(x):
        return x.reshape(x.shape[:-3] + (x.shape[-3] // g, g) + x.shape[-2:]).sum(axis=-3)

    return (sum_to_shape(dq, np.shape(q)).astype(np.float32),
            sum_to_shape(group_sum(dk), np.shape(k)).astype(np.float32),
            sum_to_shape(group_sum(dv), np.shape(v)).astype(np.float32))


def naive_tf32_backward(dout, q, k, v, out, lse, *, scale, window=(None, None), gqa_ratio=1):
    """(dq, dk, dv) in float32 as the TF32 tensor cores compute them naively: the
    operands of every product rounded to TF32 (q, k, v, dout, P for dV, dS for dQ and
    dK), products summed in float32; P = exp(S - lse) from the float32 scores and the
    forward's lse, as every flash backward recomputes it (so the scores' TF32 error
    reaches P unnormalised), delta = rowsum(dO o O) in float32.  The yardstick of
    ``precision="tf32"`` (shapes as naive_half_backward, lse of q's leading shape)."""
    g = gqa_ratio
    q32, do, o = (np.asarray(x, dtype=np.float32) for x in (q, dout, out))
    heads_kv = q32.shape[-3] // g

    def per_query_head(x):
        x = np.broadcast_to(np.asarray(x, dtype=np.float32), x.shape[:-3] + (heads_kv,) + x.shape[-2:])
        return np.repeat(x, g, axis=-3)

    qt, kt, vt, dot = to_tf32(q32), to_tf32(per_query_head(k)), to_tf32(per_query_head(v)), to_tf32(do)
    s = (qt @ np.swapaxes(kt, -1, -2)) * np.float32(scale)
    s = np.where(visible(q32.shape[-2], kt.shape[-2], window), s, -np.inf)
    lse = np.asarray(lse, dtype=np.float32)[..., None]
    p = np.where(np.isfinite(lse), np.exp(s - np.where(np.isfinite(lse), lse, 0)), 0).astype(np.float32)
    dv = np.swapaxes(to_tf32(p), -1, -2) @ dot
    dp = dot @ np.swapaxes(vt, -1, -2)
    ds = (p * (dp - np.sum(do * o, axis=-1, keepdims=True))).astype(np.float32)
    dq = to_tf32(ds) @ kt * np.float32(scale)
    dk = np.swapaxes(to_tf32(ds), -1, -2) @ qt * np.float32(scale)

    def group_sum(x):
        return x.reshape(x.shape[:-3] + (x.shape[-3] // g, g) + x.shape[-2:]).sum(axis=-3)

    return (sum_to_shape(dq, np.shape(q)).astype(np.float32),
            sum_to_shape(group_sum(dk), np.shape(k)).astype(np.float32),
            sum_to_shape(group_sum(dv), np.shape(v)).astype(np.float32))


def sum_to_shape(x, shape):
    """Sum a broadcast gradient back to ``shape``."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + a for a, n in enumerate(shape) if n == 1 and x.shape[lead + a] != 1)
    return (x.sum(axis=axes) if axes else x).reshape(shape)


# Unit roundoff of a 16-bit result: one rounding of the exact gradient to it may be off by this
# relative amount (float16 11 significand bits, bfloat16 8).
_HALF_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}

# How much further from the oracle than the yardstick a half-precision backward may be
# (docs/testing.md, "Error analysis").  naive_half_backward rounds where the kernels round, so
# the two differ only in float32 summation order and exp2, which can move a half rounding of
# P or dS only where it sits within float32 ulps of a rounding boundary: bwd_mma and bwd_wgmma
# measure 1.00 on every emulated case; rounding dP to half as well (a 2-3x loss) measures
# 1.13-3.2 on float16.
HALF_YARDSTICK_FACTOR = 1.25
# The TF32 yardstick (naive_tf32_backward) rounds where the kernels round too, but the
# kernels' TF32 products split and sum differently; the factor is the one measured to hold.
TF32_YARDSTICK_FACTOR = 2.0


def assert_within_yardstick(actual, expected, yardstick, *, factor=HALF_YARDSTICK_FACTOR, sizes=None,
                            what="gradient"):
    """|actual - oracle| <= factor * max |yardstick - oracle| + floor, element-wise;
    ``yardstick`` a backward that rounds as the kernels must (naive_half_backward,
    naive_tf32_backward).

    The floor is what float32 sums and cancellation leave, which the yardstick,
    summing in another order, may happen not to show (a row that sees one key has
    dq = 0 exactly, and the yardstick's dP - delta can round to 0 too): 4 u times
    the size of the terms each element sums (``sizes``, backward_term_sizes;
    without them, float32's rounding of the largest gradient), plus, for 16-bit
    results, one rounding of the largest gradient to their dtype (the yardstick
    returns float32), at least one subnormal spacing of it.  No part of the bound comes from ``actual``.
    """
    actual = np.asarray(actual)
    half_u = _HALF_UNIT_ROUNDOFF.get(np.dtype(actual.dtype).name, 0.0)
    # below the 16-bit dtype's normal range its rounding is absolute: one subnormal spacing
    spacing = float(np.finfo(actual.dtype).smallest_subnormal) if half_u else 0.0
    actual = actual.astype(np.float64)
    yardstick = np.asarray(yardstick).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    yard_err = np.abs(yardstick - expected).max(initial=0.0)
    largest = np.abs(expected).max(initial=0.0)
    float32_part = 4 * 2.0**-24 * (np.asarray(sizes) if sizes is not None else max(1.0, largest))
    bound = factor * yard_err + float32_part + half_u * largest + spacing
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), (
        f"{what}: error {err[worst]:.3g} at {worst} exceeds {factor} times the yardstick's largest, "
        f"{yard_err:.3g}, + {np.broadcast_to(bound, err.shape)[worst] - factor * yard_err:.3g} "
        f"(float32's sums there and the result's rounding of the largest gradient)")


def backward_term_sizes(dout, q, k, v, *, unit_probabilities=False, **kw):
    """Per element of (dq, dk, dv), the sum of the absolute values of the float64 terms
    the exact gradient sums: |dS| <= P o (|dO| |V|^T + rowsum|dO o O|), then
    scale |dS| |K|, scale |dS|^T |Q| and P^T |dO|, reduced to the shapes of q, k
    and v as the gradients are.  A summation's rounding error is bounded by a
    multiple of this (not of the result, which can cancel to ~0).

    ``unit_probabilities``: the same sums with every admissible P replaced by 1 (and
    |O| by the largest |V| of the row's keys): multiplied by float32's smallest normal,
    a bound on what probabilities flushed to zero (below it) take from a gradient.

    With score modifications (the oracle's softcap, alibi_slopes, score_mod and its
    score_mod_grad, mask_mod), |dS| also takes the chain rule's factors |d_mod d_cap|."""
    from cupyflash.reference import _probabilities, _reduce_to

    kw = {n: x for n, x in kw.items() if n in ("scale", "causal", "window", "enable_gqa", "bias", "mask", "softcap",
                                               "alibi_slopes", "score_mod", "mask_mod", "score_mod_grad")}
    _, p, _, o, (d_cap, d_mod) = _probabilities(q, k, v, chain=True, **kw)
    do = np.abs(np.broadcast_to(np.asarray(dout, np.float64), p.shape[:-1] + (o.v.shape[-1],)))
    out = np.abs(p @ o.v)
    if unit_probabilities:
        p = np.broadcast_to(o.visible, p.shape).astype(np.float64)
        out = np.broadcast_to(np.abs(o.v).max(axis=-2, keepdims=True, initial=0.0), out.shape)
    ds = p * (do @ np.swapaxes(np.abs(o.v), -1, -2) + np.sum(do * out, axis=-1, keepdims=True))
    for factor in (d_mod, d_cap):
        if factor is not None:
            ds = ds * np.where(p > 0, np.abs(np.nan_to_num(factor)), 0.0)
    dq = ds @ np.abs(o.k) * abs(o.scale)
    dk = np.swapaxes(ds, -1, -2) @ np.abs(o.q) * abs(o.scale)
    dv = np.swapaxes(p, -1, -2) @ do
    return (_reduce_to(dq, np.shape(q)), _reduce_to(dk, np.shape(k), o.kv_head, o.kv_heads),
            _reduce_to(dv, np.shape(v), o.kv_head, o.kv_heads))


def assert_within_term_bound(actual, expected, size, *, eps, head_dim, floor=0.0, logits=0.0, what="gradient"):
    """|actual - oracle| <= 32 eps x (the size of the terms the element sums, from
    :func:`backward_term_sizes`), widened by sqrt(head_dim) / 4 past 16: the float32
    and float64 gradient bound of the GPU tier.  Relative to the terms, not to the
    result: where dP - delta cancels (one key: P = 1, dP = delta) the exact gradient
    is ~0 and the rounding of dP and delta, each a sum over the head dim in its own
    order, is all that is left.  ``floor``: an absolute allowance (the float32
    kernels' exp2 flushes probabilities below float32's smallest normal to zero).
    ``logits``: ``max_ij |scale| sum_c |q_ic k_jc|`` where the scale is large: each
    score is then off by about ``eps * logits`` and every term, through P = exp(S - lse),
    by twice that relatively, twice again for random rounding over sqrt(d) terms:
    ``4 * eps * logits`` times the term size more (docs/testing.md)."""
    import math

    widen = max(1.0, math.sqrt(head_dim) / 4)
    err = np.abs(np.asarray(actual).astype(np.float64) - expected)
    bound = widen * (32 + 4 * logits) * eps * size + floor   # CPU path and emulator: <= 0.1 of 32
    bound[size == 0] = 0.0                    # nothing summed: exactly zero
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), (
        f"{what}: error {err[worst]:.3g} > {bound[worst]:.3g} at {worst} "
        f"(got {np.asarray(actual)[worst]!r}, exact {expected[worst]!r}, term size {size[worst]:.3g})")


def tf32x3_gradient_allowance(q, k, v, sizes, *, scale, accumulation, gqa_ratio=1):
    """Per element of (dq, dk, dv), what ``precision="tf32x3"`` may add to float32's term
    bound (assert_within_term_bound: pass it as ``floor``) under ``accumulation``
    (tf32_mma_cut), in units of ``sizes`` (backward_term_sizes).  With h = TF32X3_SPLIT
    + n_d cut (a sum over the head dim, n_d = tf32x3_chain(d)) and L the largest
    |scale| sum_c |q_ic k_jc|: P is off by h L relatively and dP by h sum_c |dO_ic V_jc|,
    so dS = P o (dP - delta) by h (1 + L) of its term size; dQ's sum over the keys adds
    TF32X3_SPLIT + n_k cut, dK's and dV's over the rows of the kv head's query group
    TF32X3_SPLIT + n_q cut (n_k, n_q the chains of Lk and gqa_ratio Lq products).
    docs/testing.md, "Error analysis"."""
    cut = tf32_mma_cut(accumulation)
    head = TF32X3_SPLIT + tf32x3_chain(max(q.shape[-1], v.shape[-1])) * cut
    logits = logit_rounding(q, np.repeat(k, gqa_ratio, axis=-3), scale)
    keys = TF32X3_SPLIT + tf32x3_chain(k.shape[-2]) * cut
    rows = TF32X3_SPLIT + tf32x3_chain(gqa_ratio * q.shape[-2]) * cut
    dq, dk, dv = sizes
    return (keys + head * (1 + logits)) * dq, (rows + head * (1 + logits)) * dk, (rows + head * logits) * dv


def window_of(kw):
    """The (left, right) window of attention keywords (causal folded in)."""
    left, right = kw.get("window") or (None, None)
    left = None if left == -1 else left
    right = None if right == -1 else right
    if kw.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def check_gradients(grads, dout, q, k, v, out, dtype, **kw):
    """Compare a kernel's gradients (host arrays) with the oracle on the same rounded inputs.

    float16/bfloat16: within :data:`HALF_YARDSTICK_FACTOR` of :func:`naive_half_backward`.

    float32/float64: 32 epsilons of the size of the terms each gradient
    element sums (``backward_term_sizes``), widened by sqrt(head dim) / 4
    past 16.  Relative to the terms, not to the result:
    where dP - delta cancels (one key, where P = 1 and dP = delta) the exact
    gradient is ~0 and the rounding of dP and delta, each a sum over the head
    dim in its own order, is all that is left (seen on an H200: dq ~5e-6 from
    terms of ~10, exact 1e-16).
    """
    expected = naive_attention_backward(dout, q, k, v, **kw)
    sizes = backward_term_sizes(dout, q, k, v, **kw)
    if np.dtype(dtype).itemsize == 2:
        scale = kw.get("scale", 1.0 / math.sqrt(q.shape[-1]))
        g = q.shape[-3] // k.shape[-3] if kw.get("enable_gqa") else 1
        naive = naive_half_backward(dout, q, k, v, out, scale=scale, window=window_of(kw), gqa_ratio=g)
    else:
        naive = (None,) * 3
    for name, a, e, h, size in zip(("dq", "dk", "dv"), grads, expected, naive, sizes):
        assert np.isfinite(a.astype(np.float64)).all(), f"{name}: non-finite gradient"
        if h is None:
            assert_within_term_bound(a, e, size, eps=np.finfo(dtype).eps,
                                     head_dim=max(q.shape[-1], v.shape[-1]), what=name)
        else:
            assert_within_yardstick(a, e, h, sizes=size, what=name)
