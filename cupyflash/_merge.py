"""Merging partial attentions over disjoint key sets by their log-sum-exp: :func:`merge_attention`."""

from __future__ import annotations

import numpy as np

from ._dtypes import accumulator_dtype
from ._validation import array_kind, check_output

__all__ = ["merge_attention"]

_OUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LSE_DTYPES = ("float32", "float64")


def _stack(x, name: str, axis):
    """``x`` as one array: an array as is, a list/tuple of arrays stacked on ``axis``."""
    if not isinstance(x, (list, tuple)):
        return x, array_kind(x, name)
    if not x:
        raise ValueError(f"`{name}` must hold at least one partial result; got an empty {type(x).__name__}")
    kinds = {array_kind(a, f"{name}[{i}]") for i, a in enumerate(x)}
    if len(kinds) != 1:
        raise TypeError(f"`{name}` must be all NumPy or all CuPy arrays; got {sorted(kinds)}")
    shapes = {tuple(a.shape) for a in x}
    if len(shapes) != 1:
        raise ValueError(f"the arrays of `{name}` must have one shape; got {sorted(shapes)}")
    dtypes = {np.dtype(a.dtype) for a in x}
    if len(dtypes) != 1:
        raise TypeError(f"the arrays of `{name}` must have one dtype; got {sorted(d.name for d in dtypes)}")
    kind = kinds.pop()
    if kind == "numpy":
        xp = np
    else:
        import cupy as xp
    ndim = len(shapes.pop()) + 1
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise ValueError(f"`axis` must be an int in [{-ndim}, {ndim}); got {axis!r}")
    return xp.stack([xp.asarray(a) for a in x], axis=int(axis)), kind


def merge_attention(outs, lses, /, *, axis=0, out=None):
    """Attention over the union of disjoint key sets, from each set's output and log-sum-exp.

    If ``outs[i], lses[i] = attention(q, k_i, v_i, return_lse=True)`` for key/value
    sets ``k_i, v_i`` that partition the keys of ``k, v``, the result equals
    ``attention(q, k, v, return_lse=True)``: with ``lse = log(sum_i exp(lses[i]))``,
    ``out = sum_i exp(lses[i] - lse) * outs[i]``.  This is how split-KV decoding,
    a KV cache kept in pieces and ring attention (:mod:`cupyflash.distributed`)
    combine their partial results.

    Parameters
    ----------
    outs : array, shape (..., Lq, dv), or a sequence of arrays
        The partial outputs, stacked on ``axis`` (``n`` partitions); a list or
        tuple of ``n`` arrays of one shape is stacked on ``axis`` first.  NumPy
        or CuPy; float16, bfloat16, float32 or float64.
    lses : array, shape ``outs.shape[:-1]``, or a sequence of arrays
        Their log-sum-exps, as ``attention(..., return_lse=True)`` returns them
        (float32 or float64; ``-inf`` for a row that saw no key of its set).
    axis : int, default 0
        The partition axis of ``outs``; one of its batch axes (not the last two,
        ``Lq`` and ``dv``).  ``lses`` has the same axis (counted from the front).
    out : array, optional
        Preallocated output: ``outs``' shape without ``axis``, ``outs``' dtype and
        kind, any strides, not overlapping the inputs.  Filled and returned.

    Returns
    -------
    out : array, shape ``outs.shape`` without ``axis``
        The merged output, in ``outs``' dtype.  A row whose every lse is ``-inf``
        (it saw no key at all) is zeros.
    lse : array, shape ``lses.shape`` without ``axis``
        The merged log-sum-exp: float64 for float64 ``outs``, float32 otherwise;
        ``-inf`` where every partial lse is ``-inf``.

    Raises
    ------
    TypeError
        Non-arrays, a mix of NumPy and CuPy, a dtype not listed above, an ``out``
        of the other array kind.
    ValueError
        ``lses`` whose shape is not ``outs.shape[:-1]``, ``outs`` with fewer than
        three axes, an ``axis`` out of range or on ``Lq``/``dv``, an ``out`` of
        the wrong shape or dtype, read-only, or overlapping the inputs.

    See Also
    --------
    cupyflash.attention : gives the partial results (``return_lse=True``).
    cupyflash.distributed.ring_attention : merges shards arriving around a ring.

    Notes
    -----
    The sums run in float32 (float64 for float64 ``outs``) whatever the dtype
    of ``outs``: partial outputs in float16/bfloat16 are widened, merged and the
    result rounded once.  The weights ``exp(lses[i] - lse)`` lie in [0, 1] and
    add up to one, so nothing overflows, and the merged output is a convex
    combination of the partials: its error is that of the partials plus a few
    units in the last place of the accumulation dtype.  A NaN in ``outs`` or
    ``lses`` gives NaN in that row (a partial output with weight zero is still
    multiplied, so its NaN is not hidden).  Memory beyond the result is one
    accumulator of the output's shape.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 16, 8))
    >>> k, v = rng.standard_normal((2, 4, 48, 8))
    >>> parts = [cupyflash.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
    ...          for a, b in ((0, 10), (10, 10), (10, 48))]    # the middle one is empty
    >>> out, lse = cupyflash.merge_attention([o for o, _ in parts], [s for _, s in parts])
    >>> whole, whole_lse = cupyflash.attention(q, k, v, return_lse=True)
    >>> bool(np.abs(out - whole).max() < 1e-14), bool(np.abs(lse - whole_lse).max() < 1e-14)
    (True, True)
    """
    outs, kind = _stack(outs, "outs", axis)
    lses, lse_kind = _stack(lses, "lses", axis)
    if lse_kind != kind:
        raise TypeError(f"`outs` and `lses` must both be NumPy or both CuPy arrays; got {kind} and {lse_kind}")
    if kind == "cuda-foreign":
        raise TypeError("`outs` and `lses` must be NumPy or CuPy arrays; convert with cupy.asarray first")
    if kind == "numpy":
        xp = np
    else:
        import cupy as xp
    out_dtype, lse_dtype = np.dtype(outs.dtype), np.dtype(lses.dtype)
    if out_dtype.name not in _OUT_DTYPES:
        raise TypeError(f"`outs` must have dtype {', '.join(_OUT_DTYPES)}; got {out_dtype.name}")
    if lse_dtype.name not in _LSE_DTYPES:
        raise TypeError(f"`lses` must have dtype float32 or float64; got {lse_dtype.name}")
    if outs.ndim < 3:
        raise ValueError(f"`outs` must have shape (..., n, ..., Lq, dv) with the partitions on a batch "
                         f"axis, at least 3 axes; got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"`lses` must have shape outs.shape[:-1] = {tuple(outs.shape[:-1])}; "
                         f"got {tuple(lses.shape)}")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ValueError(f"`axis` must be an int; got {axis!r}")
    ax = int(axis) + outs.ndim if axis < 0 else int(axis)
    if not 0 <= ax < outs.ndim - 2:
        raise ValueError(f"`axis` must be a batch axis of `outs` (shape {tuple(outs.shape)}), one of "
                         f"[{-outs.ndim}, {outs.ndim - 3}] without the last two (Lq, dv); got {axis}")
    result_shape = tuple(outs.shape[:ax]) + tuple(outs.shape[ax + 1:])
    if out is not None:
        check_output(out, "out", result_shape, out_dtype, kind, (outs, lses))

    acc = accumulator_dtype(out_dtype)
    lses = lses.astype(acc, copy=False)
    n = outs.shape[ax]
    if n == 0:
        top = xp.full(result_shape[:-1], -np.inf, dtype=acc)
    else:
        top = lses.max(axis=ax)
    # rows with every lse -inf: shift by 0 so that their weights are exp(-inf) = 0, not NaN
    shift = xp.where(xp.isneginf(top), xp.zeros((), dtype=acc), top)
    total = xp.zeros(result_shape[:-1], dtype=acc)
    for i in range(n):
        total += xp.exp(xp.take(lses, i, axis=ax) - shift)
    with np.errstate(divide="ignore"):   # log(0) = -inf is the answer for rows with no key
        lse = xp.log(total) + shift      # NaN propagates
    lse_shift = xp.where(xp.isneginf(lse), xp.zeros((), dtype=acc), lse)
    merged = xp.zeros(result_shape, dtype=acc)
    for i in range(n):
        weight = xp.exp(xp.take(lses, i, axis=ax) - lse_shift)
        merged += weight[..., None] * xp.take(outs, i, axis=ax).astype(acc, copy=False)
    if out is None:
        out = merged.astype(out_dtype, copy=False)
    else:
        out[...] = merged
    return out, lse
