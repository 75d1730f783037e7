"""The dtype facts every layer shares: names, accumulator types, C++ spellings.

One rule for the accumulator (float64 inputs accumulate in float64, every other
dtype in float32), one way to name a dtype, one table of the C++ types the
kernels are instantiated with.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dtype_name", "accumulator_dtype", "accumulator_name", "CXX_TYPE", "CXX_ACCUMULATOR", "DTYPES"]

# C++ spelling of each dtype in kernel name expressions.
CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
# The dtypes the kernels take, in the catalogue's order.
DTYPES = tuple(CXX_TYPE)
# C++ spelling of each accumulator type.
CXX_ACCUMULATOR = {"float32": "float", "float64": "double"}

_names: dict = {}


def dtype_name(dtype) -> str:
    """The NumPy name of ``dtype`` (``"float16"``, ``"bfloat16"``, ...): a dtype, a scalar
    type, or a name (``"bfloat16"`` is understood without ml_dtypes installed)."""
    if isinstance(dtype, str) and dtype in CXX_TYPE:
        return dtype
    try:
        return _names[dtype]
    except (KeyError, TypeError):
        pass
    name = np.dtype(dtype).name
    try:
        _names[dtype] = name
    except TypeError:
        pass
    return name


def accumulator_name(dtype) -> str:
    """``"float64"`` for float64, ``"float32"`` for every other dtype."""
    return "float64" if dtype_name(dtype) == "float64" else "float32"


def accumulator_dtype(dtype) -> np.dtype:
    """The dtype kernels and the CPU path accumulate ``dtype`` in (see :func:`accumulator_name`)."""
    return np.dtype(accumulator_name(dtype))
