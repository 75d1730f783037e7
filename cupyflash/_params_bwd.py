"""The backward kernels' one argument: a NumPy mirror of ``cf::BwdParams``.

``BWD_PARAMS`` is a structured dtype laid out exactly like the C++ struct in
``cuda_src/params_bwd.cuh``: the forward's :data:`~cupyflash._params.FWD_PARAMS`
nested as ``fwd`` (the backward sees q, k, v, out, lse, the sizes, the window
and the scale as the forward did), then the pointers and strides of dout, the
gradients and the ``delta`` workspace (``align=True``; every field is 8 bytes,
so there is no padding).  :func:`bwd_params` fills one from the arrays of a
call.  The tests compile ``params_bwd.cuh`` with the host compiler and compare
every ``offsetof`` with ``BWD_PARAMS.fields``.
"""

from __future__ import annotations

import struct

import numpy as np

from ._params import _FWD_PACK, FWD_PARAMS, data_pointer, element_strides, fwd_fields

__all__ = ["BWD_PARAMS", "bwd_params"]

_POINTERS = ("dout", "dq", "dk", "dv", "delta")
_AXES = ("batch", "head", "row")

BWD_PARAMS = np.dtype(
    [("fwd", FWD_PARAMS)]
    + [(name, np.uint64) for name in _POINTERS]
    + [(f"{t}_{axis}_stride", np.int64) for t in _POINTERS for axis in _AXES],
    align=True,
)
assert BWD_PARAMS.itemsize == FWD_PARAMS.itemsize + 20 * 8
# The fields in one struct.pack format (see cupyflash._params).
_BWD_PACK = struct.Struct(_FWD_PACK.format + "5Q15q")
assert _BWD_PACK.size == BWD_PARAMS.itemsize


def bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, *, scale: float, window_left,
               window_right, gqa_ratio: int) -> np.void:
    """Fill a :data:`BWD_PARAMS` scalar for the backward launches of one call.

    Parameters
    ----------
    dout, out : arrays
        ``(B, Hq, Lq, dv)``, the input dtype.
    q, k, v : arrays
        ``(B, Hq, Lq, d)``, ``(B, Hkv, Lk, d)``, ``(B, Hkv, Lk, dv)``.
    lse : array
        ``(B, Hq, Lq)``, the accumulator type.
    dq, dk, dv : arrays
        ``(B, Hq, Lq, d)``, ``(B, Hkv, Lk, d)``, ``(B, Hkv, Lk, dv)``, the accumulator type.
    delta : array
        ``(B, Hq, Lq)`` workspace, the accumulator type.
    scale, window_left, window_right, gqa_ratio
        As for :func:`cupyflash._params.fwd_params`.

    Every array has a unit-stride last axis (where it has one) and is NumPy
    for the emulator, CuPy for the GPU.
    """
    strides = []
    for a in (dout, dq, dk, dv, delta):
        strides += element_strides(a, 3)
    fields = fwd_fields(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio)
    pointers = (data_pointer(a) for a in (dout, dq, dk, dv, delta))
    return np.frombuffer(bytearray(_BWD_PACK.pack(*fields, *pointers, *strides)), BWD_PARAMS)[0]
