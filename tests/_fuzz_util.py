"""The fuzzers' problems, memory layouts and checks against the float64 oracle
(tests/test_fuzz.py, and the GPU tier's fuzzers).

Tolerances
----------
Outputs are compared with the oracle evaluated on the *same rounded inputs*:

- for logits of order 1 (scale drawn as ``c / sqrt(d)`` with ``|c| <= 1.5``,
  tiny or zero) with the one tolerance table of ``tests/_util.py``;
- for huge scales with that table **plus** ``HUGE_LOGIT_FACTOR * u * M *
  max|v|`` for ``out`` and ``HUGE_LOGIT_FACTOR * u * M`` for ``lse``, where
  ``u`` is the unit roundoff of the accumulator (2^-24 for float32, also for
  the 16-bit dtypes; 2^-53 for float64) and ``M = |scale| * max_i |q_i|_2 *
  max_j |k_j|_2`` bounds, by Cauchy-Schwarz, both every logit ``|s_ij|`` and
  the sum ``|scale| * sum_c |q_ic k_jc|`` whose rounding error the computed
  logit carries.  Why: a backend computes ``s_ij`` with an absolute error of
  about ``u * M`` (a few roundings of a dot product, of the scaling and of the
  subtraction of the row max; the worst case grows like ``d * u * M``,
  random rounding like ``sqrt(d) * u * M``); the probabilities are
  ``exp(s - lse)``, so each is off by a relative ``2 max|ds|`` at first order
  and ``out = sum_j p_j v_j`` by at most ``2 max|ds| max|v|``, ``lse`` by
  ``max|ds|``.  The factor is that first-order 2 (``M`` by Cauchy-Schwarz is
  above the sum of |terms| a rounding comes from); the largest ratio of error to
  ``u * M * max|v|`` ever seen is 0.51 (docs/testing.md; it was 16, 30 times that).
  Where ``2 u M >= 1`` the allowance reaches ``max|v|`` and says nothing, so each
  row is then also held to the range of the values it sees
  (``assert_within_seen_values``).  The logits' magnitude is why: with
  ``M = 1e6`` in float32 two keys whose logits differ by less than ``u * M``
  (0.06) are a tie that no float32 computation can break, and the oracle,
  working in float64 on the same inputs, breaks it anyway.
- backward, float32/float64: the table relative to ``max(1, max|grad|)``
  (``assert_grad_close``'s bound) **plus** ``CANCELLATION_FACTOR * u *
  sum|terms|`` per element, where ``sum|terms|`` is the sum of the absolute
  values of the terms the gradient element is a sum of (computed in float64
  from the oracle's probabilities, ``backward_term_sizes`` in tests/_backward_util.py).  Why: ``dP =
  dout v^T`` and ``delta = rowsum(dout o out)`` cancel in ``dS = P o (dP -
  delta)``; a row that sees a single key has ``dq = 0`` exactly, yet every
  correct float32 backward returns ``u * |dout| |v| |k|``-sized values there
  (the fuzzer found such a case, now the ``@example`` ``SINGLE_KEY_ROW``).
  The factor 4 leaves room over the largest ratio seen, 1.05 (docs/testing.md).
- ``precision="tf32x3"`` (float32 on the TF32 tensor cores, fuzzed on the
  emulator): the same rules with ``u = 2^-20`` in place of float32's 2^-24,
  since each product of two TF32x3-split operands carries a relative error
  below ``3 * 2^-22 < 2^-20`` (cuda_src/tf32_tile.cuh); calls the TF32
  kernels do not take (d > 128, dv != d, scale <= 0 forward) run the IEEE
  ones, which meet the tighter rule anyway.
- backward, float16/bfloat16: within 1.25 times the error of a half-precision
  yardstick that rounds where the kernels must (``tests/_backward_util.py``),
  as the emulated and GPU backward tests do.  The backward fuzzers draw logits of order 1 and tiny
  scales only: with huge logits the gradients of a near-one-hot softmax are
  dominated by near-ties (see above) and have no useful bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import cupyflash
from cupyflash._api import run_attention, run_attention_backward
from cupyflash._validation import check_forward as validate
from cupyflash.reference import _probabilities, naive_attention, naive_attention_backward

from _strategies import batch_shapes
from _backward_util import (assert_within_yardstick, backward_term_sizes, naive_half_backward,
                            sum_to_shape)
from _util import DTYPES, TOLERANCE, accum_dtype, assert_close, assert_lse_close

HUGE_LOGIT_FACTOR = 2.0
CANCELLATION_FACTOR = 4.0
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "tf32x3": 2.0**-20}

# Memory layouts an input array can have (see `place`).
INPUT_LAYOUTS = ("contiguous", "blhd", "strided", "reversed", "unit_last_stride_2", "broadcast")
OUT_LAYOUTS = ("contiguous", "blhd", "strided", "reversed", "unit_last_stride_2")


# ---- problems ------------------------------------------------------------------------------


@dataclass
class Problem:
    dtype: np.dtype
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    options: dict          # causal, window, enable_gqa, scale
    layouts: tuple         # q, k, v, out (None: no out=), dout
    scale_kind: str        # "default", "moderate", "tiny", "zero", "huge"
    seed: int

    def arrays(self):
        """(q, k, v) as NumPy arrays of the values (standard normal, so never zeros)."""
        rng = np.random.default_rng(self.seed)
        arrays = []
        for shape, layout in zip((self.q_shape, self.k_shape, self.v_shape), self.layouts):
            x = rng.standard_normal(shape)
            if layout == "broadcast" and len(shape) >= 3:
                x = np.broadcast_to(x[:1], shape)        # equal along axis 0: a stride-0 view
            arrays.append(x.astype(self.dtype))
        return tuple(arrays)


window_bound = st.one_of(st.none(), st.just(-1), st.integers(0, 8), st.integers(0, 300))


# Layouts whose rows stay 16-byte aligned for 16-bit d a multiple of 8 (the tensor-core kernels' condition).
ALIGNED_INPUT_LAYOUTS = ("contiguous", "blhd", "reversed", "broadcast")
ALIGNED_OUT_LAYOUTS = ("contiguous", "blhd", "reversed")


@st.composite
def problems(draw, *, max_len, dtypes=DTYPES, scales=("default", "moderate", "tiny", "zero", "huge"),
             tensor_core=False, key_block=None):
    """One attention call: shapes, options, layouts and a seed for the values.

    ``tensor_core``: only calls the tensor-core kernels (fwd_mma, bwd_mma, and
    fwd_wgmma, bwd_wgmma where on) take -- 16-bit dtypes, d = dv a multiple of 8,
    row-aligned layouts, a positive scale.  Drawn freely, about one call in a
    hundred qualifies, and the rest run the SIMT kernels.

    ``key_block``: the backend's key block; long problems then draw, half the time,
    Lk from just past it (up to two blocks), so that the online softmax's running
    max, sum and output move from block to block.
    """
    if tensor_core:
        dtypes = [x for x in dtypes if x.itemsize == 2]
        scales = tuple(x for x in scales if x != "zero")
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    big = draw(st.booleans())
    if big:     # long sequences: few heads
        lq = draw(st.integers(0, max_len))
        lk = draw(st.integers(0, max_len) if key_block is None else
                  st.one_of(st.integers(0, max_len), st.integers(key_block + 1, 2 * key_block)))
        max_dims, max_side = 2, 2
    else:
        lq, lk = draw(st.integers(0, 20)), draw(st.integers(0, 20))
        max_dims, max_side = 3, 3
    if tensor_core:
        d = dv = 8 * draw(st.integers(1, 32))
    else:
        d = draw(st.one_of(st.integers(1, 40), st.integers(1, 256)))
        dv = draw(st.one_of(st.just(d), st.integers(1, 40), st.integers(1, 256)))
    q_batch, k_batch, v_batch, enable_gqa = draw(batch_shapes(max_dims=max_dims, max_side=max_side,
                                                              max_group=4))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(window_bound, window_bound)))
    scale_kind = draw(st.sampled_from(scales))
    if scale_kind == "default":
        scale = None
    elif scale_kind == "moderate":
        scale = draw(st.floats(0.01 if tensor_core else -1.5, 1.5, allow_nan=False)) / math.sqrt(d)
    elif scale_kind == "tiny":
        sign = 1.0 if tensor_core else draw(st.sampled_from([1.0, -1.0]))
        scale = sign * 10.0 ** draw(st.integers(-30, -6))
    elif scale_kind == "zero":
        scale = 0.0
    else:       # logits of 1e1 .. 1e6 (times the norms of q and k)
        sign = 1.0 if tensor_core else draw(st.sampled_from([1.0, -1.0]))
        scale = sign * 10.0 ** draw(st.integers(1, 6)) / math.sqrt(d)
    inputs, outs = (ALIGNED_INPUT_LAYOUTS, ALIGNED_OUT_LAYOUTS) if tensor_core else (INPUT_LAYOUTS, OUT_LAYOUTS)
    layouts = (draw(st.sampled_from(inputs)), draw(st.sampled_from(inputs)), draw(st.sampled_from(inputs)),
               draw(st.one_of(st.none(), st.sampled_from(outs))), draw(st.sampled_from(outs)))
    return Problem(dtype=dtype, q_shape=q_batch + (lq, d), k_shape=k_batch + (lk, d),
                   v_shape=v_batch + (lk, dv),
                   options=dict(causal=causal, window=window, enable_gqa=enable_gqa, scale=scale),
                   layouts=layouts, scale_kind=scale_kind, seed=draw(st.integers(0, 2**32 - 1)))


# ---- layouts -------------------------------------------------------------------------------------


def place(xp, values, layout):
    """An array of module ``xp`` equal to ``values`` with the memory layout ``layout``.

    - ``contiguous``: C order;
    - ``blhd``: a (..., L, H, d) buffer viewed as (..., H, L, d) (axes -3, -2 swapped);
    - ``strided``: every other row of a buffer with spare rows and columns, starting one
      element in (rows not 16-byte aligned: the tensor-core kernels fall back to SIMT);
    - ``reversed``: a negative row stride;
    - ``unit_last_stride_2``: every other element of the last axis (the kernels copy it);
    - ``broadcast``: stride 0 along axis 0 (``values`` must be equal along it).
    Fewer than 3 dims turn ``blhd`` and ``broadcast`` into ``contiguous``.
    """
    shape = values.shape
    if layout == "contiguous" or (layout in ("blhd", "broadcast") and len(shape) < 3):
        return xp.ascontiguousarray(xp.asarray(values))
    if layout == "broadcast":
        return xp.broadcast_to(xp.asarray(np.ascontiguousarray(values[:1])), shape)
    if layout == "blhd":
        base = xp.empty(shape[:-3] + (shape[-2], shape[-3], shape[-1]), dtype=values.dtype)
        view = xp.swapaxes(base, -3, -2)
    elif layout == "strided":
        base = xp.empty(shape[:-2] + (2 * shape[-2] + 1, shape[-1] + 3), dtype=values.dtype)
        view = base[..., 1::2, 1:shape[-1] + 1][..., :shape[-2], :]
    elif layout == "reversed":
        view = xp.empty(shape, dtype=values.dtype)[..., ::-1, :]
    elif layout == "unit_last_stride_2":
        view = xp.empty(shape[:-1] + (2 * shape[-1],), dtype=values.dtype)[..., ::2]
    else:
        raise ValueError(layout)
    view[...] = xp.asarray(values)
    assert view.shape == shape
    return view


def poisoned_out(xp, shape, dtype, layout):
    return place(xp, np.full(shape, np.nan, dtype=dtype), layout)


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


# ---- checks ---------------------------------------------------------------------------------------


def logit_bound(q, k, scale):
    """``|scale| * max_i |q_i|_2 * max_j |k_j|_2``: bounds every |logit| and its rounding (module doc)."""
    def max_norm(x):
        x = np.asarray(x, np.float64)
        return float(np.sqrt((x * x).sum(axis=-1)).max(initial=0.0))
    return abs(scale) * max_norm(q) * max_norm(k)


def check_forward(problem, backend, xp=np, precision="ieee", options=None):
    """Run one forward on ``backend`` (with ``precision``, dispatch ``options``; None: from
    the environment, as :func:`cupyflash.attention`) and compare it with the oracle.

    Returns, for huge scales, the largest error beyond the table in units of
    ``u * M * max|v|`` (the sweep's figure in docs/testing.md), else None.
    """
    q, k, v = problem.arrays()
    q_dev, k_dev, v_dev = (place(xp, x, lay) for x, lay in zip((q, k, v), problem.layouts[:3]))
    kw = problem.options
    checked, _ = check_forward_problem(q, k, v, kw)
    out_arg = None
    if problem.layouts[3] is not None:
        out_arg = poisoned_out(xp, checked.out_shape, problem.dtype, problem.layouts[3])
    out, lse = run_attention(q_dev, k_dev, v_dev, return_lse=True, out=out_arg, backend=backend,
                             precision=precision, options=options, **kw)
    if out_arg is not None:
        assert out is out_arg
    out, lse = _host(out), _host(lse)
    assert out.dtype == problem.dtype and out.shape == checked.out_shape
    expected, expected_lse = naive_attention(q, k, v, return_lse=True, **kw)
    if problem.scale_kind != "huge":
        assert_close(out, expected, problem.dtype)
        assert_lse_close(lse, expected_lse, problem.dtype)
        return None
    # Huge logits: the table plus HUGE_LOGIT_FACTOR * u * M * max|v| (module docstring).
    u = UNIT_ROUNDOFF[precision if precision == "tf32x3" else accum_dtype(problem.dtype).name]
    m = logit_bound(q, k, checked.scale)
    vmax = float(np.abs(v.astype(np.float64)).max(initial=0.0))
    tol = TOLERANCE[problem.dtype]
    err = np.abs(out.astype(np.float64) - expected)
    bound = tol["atol"] + tol["rtol"] * np.abs(expected) + HUGE_LOGIT_FACTOR * u * m * vmax
    assert not np.isnan(out.astype(np.float64)).any(), "NaN in out"
    assert (err <= bound).all(), f"out: max error {err.max():.3g}, u*M*max|v| = {u * m * vmax:.3g}"
    if HUGE_LOGIT_FACTOR * u * m >= 1:
        # The allowance is max|v| or more, which any output within the values' range
        # meets: hold each row to the range of the values it sees instead (a weighted mean).
        assert_within_seen_values(out, q, k, v, kw)
    assert lse.dtype == accum_dtype(problem.dtype) and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse), err_msg="-inf rows")
    finite = np.isfinite(expected_lse)
    lse_err = np.abs(lse[finite].astype(np.float64) - expected_lse[finite])
    lse_bound = tol["atol"] + tol["rtol"] * np.abs(expected_lse[finite]) + HUGE_LOGIT_FACTOR * u * m
    assert (lse_err <= lse_bound).all(), f"lse: max error {lse_err.max(initial=0):.3g}, u*M = {u * m:.3g}"
    # The figure docs/testing.md reports: the error beyond the table in units of u * M * max|v|.
    beyond = err - (tol["atol"] + tol["rtol"] * np.abs(expected))
    return float(beyond.max(initial=0.0) / (u * m * vmax)) if m * vmax > 0 else 0.0


def assert_within_seen_values(out, q, k, v, kw):
    """Every output row is a weighted mean of the values its row sees: within their range
    per column, up to a rounding of the largest (0 where the row sees no key)."""
    _, p, _, o = _probabilities(q, k, v, **kw)
    out = np.broadcast_to(out, p.shape[:-1] + (o.v.shape[-1],))
    tol = TOLERANCE[np.dtype(out.dtype)]
    slack = tol["atol"] + tol["rtol"] * float(np.abs(o.v).max(initial=0.0))
    for i in range(p.shape[-2]):
        seen = o.visible[i]
        row = out[..., i, :].astype(np.float64)
        if not seen.any():
            assert (row == 0).all(), f"row {i} sees no key but is not zero"
            continue
        values = o.v[..., seen, :]
        assert (row >= values.min(axis=-2) - slack).all() and (row <= values.max(axis=-2) + slack).all(), (
            f"row {i} outside the range of the values it sees")


def check_forward_problem(q, k, v, kw):
    return validate(q, k, v, scale=kw["scale"], causal=kw["causal"], window=kw["window"],
                         enable_gqa=kw["enable_gqa"], backend="numpy")


def check_backward(problem, backend, xp=np, precision="ieee", deterministic=True, options=None):
    """Run one backward on ``backend`` (with ``precision``, dispatch ``options`` as for
    :func:`check_forward`) and compare it with the oracle.

    Returns, for float32/float64, the largest error beyond the table in units of
    ``u * sum|terms|`` (docs/testing.md), else None.
    """
    q, k, v = problem.arrays()
    kw = problem.options
    checked, _ = check_forward_problem(q, k, v, kw)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)      # the CPU path's forward
    dout = np.random.default_rng(problem.seed + 1).standard_normal(out.shape).astype(problem.dtype)
    inputs = [place(xp, x, lay) for x, lay in zip((q, k, v), problem.layouts[:3])]
    dout_dev = place(xp, dout, problem.layouts[4])
    out_dev = place(xp, out, problem.layouts[3] or "contiguous")
    grads = run_attention_backward(dout_dev, *inputs, out_dev, xp.asarray(lse), backend=backend,
                                   precision=precision, deterministic=deterministic, options=options, **kw)
    expected = naive_attention_backward(dout, q, k, v, **kw)
    naive = (None,) * 3
    if problem.dtype.itemsize == 2:
        naive = naive_half_yardstick(dout, q, k, v, out, lse, checked)
    terms = backward_term_sizes(dout, q, k, v, **kw)
    ratios = []
    for name, g, e, h, t, x in zip(("dq", "dk", "dv"), grads, expected, naive, terms, (q, k, v)):
        g = _host(g)
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not np.isnan(g.astype(np.float64)).any(), f"{name}: NaN"
        if h is not None:
            assert_within_yardstick(g, e, h, sizes=t, what=name)
            continue
        # assert_grad_close's bound plus CANCELLATION_FACTOR * u * (sum of |terms|) (module doc)
        tol = TOLERANCE[problem.dtype]
        u = UNIT_ROUNDOFF[precision if precision == "tf32x3" else accum_dtype(problem.dtype).name]
        err = np.abs(g.astype(np.float64) - e)
        table = max(1.0, float(np.abs(e).max(initial=0.0))) * tol["atol"] + tol["rtol"] * np.abs(e)
        assert (err <= table + CANCELLATION_FACTOR * u * t).all(), (
            f"{name}: max error {err.max():.3g}; table bound there {table.flat[err.argmax()]:.3g}, "
            f"u * sum|terms| there {u * t.flat[err.argmax()]:.3g}")
        ratios.append(float(((err - table) / (u * np.maximum(t, 1e-300))).max(initial=0.0)))
    return max(ratios, default=None)


def naive_half_yardstick(dout, q, k, v, out, lse, checked):
    """``naive_half_backward`` for any batch shapes.

    It needs a head axis (-3) holding every query head, so the arrays are lifted to
    the full number of dims and q, dout and out broadcast along that axis; a dq whose
    q had one head there is summed back over it (one more float32 sum).
    """
    ndim = len(checked.batch_shape) + 2
    heads = checked.batch_shape[-1] if checked.batch_shape else 1

    def lift(x, full_heads=False):
        x = x.reshape((1,) * (max(ndim, 3) - x.ndim) + x.shape)
        return np.broadcast_to(x, x.shape[:-3] + (heads,) + x.shape[-2:]) if full_heads else x

    dq, dk, dv = naive_half_backward(lift(dout, True), lift(q, True), lift(k), lift(v), lift(out, True),
                                     scale=checked.scale,
                                     window=(checked.window_left, checked.window_right),
                                     gqa_ratio=checked.gqa_ratio, lse=lift(lse[..., None], True)[..., 0])
    dq = sum_to_shape(dq, lift(q).shape)
    return tuple(g.reshape(x.shape) for g, x in zip((dq, dk, dv), (q, k, v)))


# ---- the fuzzers' sizes ------------------------------------------------------------------------------

NUMPY_MAX_LEN = 300
EMULATOR_MAX_LEN = 150
BACKWARD_SCALES = ("default", "moderate", "tiny", "zero")
