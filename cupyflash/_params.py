"""The forward kernels' one argument: a NumPy mirror of ``cf::FwdParams``.

``FWD_PARAMS`` is a structured dtype laid out exactly like the C++ struct in
``cuda_src/params.cuh`` (same fields, same order, ``align=True``); every field
is 8 bytes, so there is no padding.  :func:`fwd_params` fills one from the
arrays of a call and returns a NumPy structured scalar, which CuPy passes to
the kernel by value and the emulator as raw bytes.  The tests compile
``params.cuh`` with the host compiler and compare every ``offsetof`` with
``FWD_PARAMS.fields``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["FWD_PARAMS", "UNBOUNDED", "fwd_params", "data_pointer", "element_strides"]

# cf::kUnbounded: the window bound meaning "no limit on that side".
UNBOUNDED = 1 << 62

_POINTERS = ("q", "k", "v", "out", "lse", "ws_o", "ws_l", "ws_m")
_STRIDED = ("q", "k", "v", "out", "lse")
_SIZES = ("batch", "heads_q", "gqa_ratio", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
          "window_left", "window_right", "block_m", "block_n", "num_splits")

FWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(f"{t}_{axis}_stride", np.int64) for t in _STRIDED for axis in ("batch", "head", "row")]
    + [(name, np.int64) for name in _SIZES]
    + [("scale", np.float64), ("scale_log2", np.float64)],
    align=True,
)
assert FWD_PARAMS.itemsize == 37 * 8


def data_pointer(a) -> int:
    """Address of ``a``'s first element (NumPy or CuPy array), 0 for None."""
    if a is None:
        return 0
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)


def element_strides(a, axes: int) -> tuple[int, ...]:
    """The strides of ``a``'s first ``axes`` axes in elements (any sign, 0 for broadcast)."""
    out = []
    for s in a.strides[:axes]:
        if s % a.itemsize:
            raise ValueError(f"stride {s} bytes is not a multiple of the item size {a.itemsize}")
        out.append(s // a.itemsize)
    return tuple(out)


def _window(bound) -> int:
    return UNBOUNDED if bound is None else min(int(bound), UNBOUNDED)


def fwd_params(q, k, v, out, lse, *, scale: float, window_left, window_right, gqa_ratio: int,
               workspace=(None, None, None), block_m: int = 0, block_n: int = 0,
               num_splits: int = 1) -> np.void:
    """Fill a :data:`FWD_PARAMS` scalar for one forward launch.

    Parameters
    ----------
    q, k, v, out : arrays
        ``(B, Hq, Lq, d)``, ``(B, Hkv, Lk, d)``, ``(B, Hkv, Lk, dv)``, ``(B, Hq, Lq, dv)``,
        last axis of unit stride, all NumPy or all CuPy.
    lse : array or None
        ``(B, Hq, Lq)`` of the accumulator type.
    scale : float
        Softmax scale; ``scale_log2 = scale * log2(e)`` is derived here.
    window_left, window_right : int or None
        Window bounds (``None``: unbounded), ``causal`` already folded in.
    gqa_ratio : int
        ``Hq // Hkv``.
    workspace : (o, l, m), optional
        fwd_v1's global-memory state, or a split-KV forward's partial outputs
        ``(num_splits, B, Hq, Lq, dv)`` and lse ``(num_splits, B, Hq, Lq)`` (m: None);
        contiguous, of the accumulator type.
    block_m, block_n : int, optional
        fwd_v1's run-time block sizes.
    num_splits : int, optional
        Split-KV: runs each query block's keys are cut into (1: none).
    """
    p = np.zeros((), dtype=FWD_PARAMS)
    ws_o, ws_l, ws_m = workspace
    for name, a in zip(_POINTERS, (q, k, v, out, lse, ws_o, ws_l, ws_m)):
        p[name] = data_pointer(a)
    for name, a in zip(_STRIDED, (q, k, v, out)):
        for axis, s in zip(("batch", "head", "row"), element_strides(a, 3)):
            p[f"{name}_{axis}_stride"] = s
    if lse is not None:
        for axis, s in zip(("batch", "head", "row"), element_strides(lse, 3)):
            p[f"lse_{axis}_stride"] = s
    batch, heads_q, seqlen_q, head_dim = q.shape
    p["batch"], p["heads_q"], p["gqa_ratio"] = batch, heads_q, gqa_ratio
    p["seqlen_q"], p["seqlen_k"] = seqlen_q, k.shape[2]
    p["head_dim"], p["head_dim_v"] = head_dim, v.shape[3]
    p["window_left"], p["window_right"] = _window(window_left), _window(window_right)
    p["block_m"], p["block_n"] = block_m, block_n
    p["num_splits"] = num_splits
    p["scale"] = float(scale)
    p["scale_log2"] = float(scale) * math.log2(math.e)
    return p[()]
