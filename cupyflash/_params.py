"""The kernels' one argument: NumPy mirrors of ``cf::FwdParams`` and ``cf::BwdParams``.

``FWD_PARAMS`` is a structured dtype laid out exactly like the C++ struct in
``cuda_src/params.cuh`` (same fields, same order, ``align=True``); every field
is 8 bytes, so there is no padding.  :func:`fwd_params` fills one from the
arrays of a call and returns a NumPy structured scalar, which CuPy passes to
the kernel by value and the emulator as raw bytes.  The tests compile
``params.cuh`` with the host compiler and compare every ``offsetof`` with
``FWD_PARAMS.fields``.

``BWD_PARAMS`` mirrors ``cuda_src/params_bwd.cuh``: the forward's struct nested
as ``fwd`` (the backward sees q, k, v, out, lse, the sizes, the window and the
scale as the forward did), then the pointers and strides of dout, the gradients
and the ``delta`` workspace; :func:`bwd_params` fills one.
"""

from __future__ import annotations

import math
import struct

import numpy as np

__all__ = ["FWD_PARAMS", "BWD_PARAMS", "UNBOUNDED", "MAX_BIAS", "NO_TERMS", "KernelView", "fwd_params",
           "bwd_params", "term_fields", "data_pointer", "element_strides"]

# cf::kUnbounded: the window bound meaning "no limit on that side".
UNBOUNDED = 1 << 62
# cf::kMaxBias, cf::kMaxModArgs: the most additive bias terms and mod_args arrays the kernels take.
MAX_BIAS = 4
MAX_MOD_ARGS = 4

_POINTERS = ("q", "k", "v", "out", "lse", "ws_o", "ws_l", "ws_m")
_STRIDED = ("q", "k", "v", "out", "lse")
_SIZES = ("batch", "heads_q", "gqa_ratio", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
          "window_left", "window_right", "block_m", "block_n", "num_splits")

FWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(f"{t}_{axis}_stride", np.int64) for t in _STRIDED for axis in ("batch", "head", "row")]
    + [(name, np.int64) for name in _SIZES]
    + [("scale", np.float64), ("scale_log2", np.float64)]
    + [("bias", np.uint64, (MAX_BIAS,)), ("bias_strides", np.int64, (MAX_BIAS, 4)),
       ("mask", np.uint64), ("mask_strides", np.int64, (4,))]
    + [("softcap", np.float64), ("coord", np.uint64, (3,)), ("coord_strides", np.int64, (3, 2)),
       ("mod_args", np.uint64, (MAX_MOD_ARGS,)), ("mod_shape", np.int64, (MAX_MOD_ARGS, 4)),
       ("mod_strides", np.int64, (MAX_MOD_ARGS, 4))]
    + [("sequences", np.uint64), ("split_rows", np.int64), ("first_row", np.int64), ("first_key", np.int64)]
    + [("block_table", np.uint64), ("table_stride", np.int64), ("page_size", np.int64)],
    align=True,
)
assert FWD_PARAMS.itemsize == 115 * 8
# The same fields as one struct.pack format (native byte order, as NumPy's dtype):
# packing them in one call is ~7x faster than setting 115 fields of a NumPy scalar.
_FWD_PACK = struct.Struct("=8Q27q2d4Q16qQ4qd3Q6q4Q16q16qQ3qQ2q")
assert _FWD_PACK.size == FWD_PARAMS.itemsize


class KernelView:
    """A strided view of an array as a kernel sees it: address, shape, strides, dtype.

    The dispatcher describes each launch's (B, H, L, d) views of the caller's
    arrays with these instead of NumPy/CuPy view objects: building a CuPy view
    costs microseconds of host time per array, and the kernels read only the
    address and the strides.  ``base`` is the array the view is of (kept alive
    with it); :meth:`array` makes the real view where one is needed, and
    :meth:`fill` writes through it (the atomic backward zeroes dq).
    """

    __slots__ = ("base", "dtype", "itemsize", "ptr", "shape", "strides")

    def __init__(self, base, shape: tuple, strides: tuple) -> None:
        self.base = base
        self.ptr = data_pointer(base)
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.dtype = base.dtype
        self.itemsize = base.itemsize

    def fill(self, value) -> None:
        """Set every element of the view to ``value`` (as ``ndarray.fill``)."""
        self.array().fill(value)

    def array(self):
        """The view as an array of ``base``'s kind (NumPy or CuPy)."""
        if isinstance(self.base, np.ndarray):
            return np.lib.stride_tricks.as_strided(self.base, shape=self.shape, strides=self.strides,
                                                   writeable=self.base.flags.writeable)
        import cupy

        return cupy.lib.stride_tricks.as_strided(self.base, shape=self.shape, strides=self.strides)


def data_pointer(a) -> int:
    """Address of ``a``'s first element (NumPy or CuPy array, :class:`KernelView`), 0 for None."""
    if a is None:
        return 0
    if isinstance(a, KernelView):
        return a.ptr
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
               num_splits: int = 1, terms=None, sequences=None, pages=None) -> np.void:
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
    terms : cupyflash._terms.ScoreOperands, optional
        The biases and the mask, as ``(B, Hq, Lq, Lk)`` views (None: none).
    sequences : array, optional
        Per-sequence lengths: the ``(5, B)`` int32 table of ``cuda_src/sequence.cuh``
        (launch order, first query row, query rows, first key, keys), on the
        kernels' side (None: none; Lq and Lk are then every entry's).
    pages : (block_table, page_size), optional
        A paged KV cache (``cuda_src/paged.cuh``): the ``(B, max_pages)`` int32 block
        table on the kernels' side (unit stride along the pages) and the keys per
        page; k and v are then the caches as ``(B, Hkv, max_pages * page_size, d)``
        views whose batch strides are the page strides.
    """
    return np.frombuffer(bytearray(_FWD_PACK.pack(*fwd_fields(
        q, k, v, out, lse, scale=scale, window_left=window_left, window_right=window_right,
        gqa_ratio=gqa_ratio, workspace=workspace, block_m=block_m, block_n=block_n,
        num_splits=num_splits, terms=terms, sequences=sequences, pages=pages))), FWD_PARAMS)[0]


# The score-term fields of a call without terms.
NO_TERMS = (0,) * MAX_BIAS + (0,) * (4 * MAX_BIAS) + (0,) + (0,) * 4
NO_MODS = (0.0,) + (0,) * 3 + (0,) * 6 + (0,) * MAX_MOD_ARGS + (0,) * (8 * MAX_MOD_ARGS)


def mod_fields(softcap, coords, mod_args) -> tuple:
    """The score modifications' fields: ``softcap`` (None: 0), ``coords`` the (B, Hq)
    views of b, h and the slopes (None: null), ``mod_args`` the arrays in slot order."""
    if len(mod_args) > MAX_MOD_ARGS:
        raise ValueError(f"at most {MAX_MOD_ARGS} mod_args arrays, got {len(mod_args)}")
    pointers = [data_pointer(c) for c in coords]
    strides = [s for c in coords for s in (element_strides(c, 2) if c is not None else (0, 0))]
    args = [data_pointer(a) for a in mod_args] + [0] * (MAX_MOD_ARGS - len(mod_args))
    shapes, arg_strides = [], []
    for a in mod_args:
        shapes += list(a.shape) + [0] * (4 - a.ndim)
        arg_strides += list(element_strides(a, a.ndim)) + [0] * (4 - a.ndim)
    pad = [0] * (4 * (MAX_MOD_ARGS - len(mod_args)))
    return (0.0 if softcap is None else float(softcap), *pointers, *strides, *args, *shapes, *pad,
            *arg_strides, *pad)


def term_fields(bias=(), mask=None) -> tuple:
    """The score-term fields (bias pointers and strides, mask pointer and strides) of
    ``bias`` (up to :data:`MAX_BIAS` 4-D views, None: a null pointer) and ``mask`` (a
    4-D view or None)."""
    if len(bias) > MAX_BIAS:
        raise ValueError(f"at most {MAX_BIAS} bias terms, got {len(bias)}")
    pointers = [data_pointer(b) for b in bias] + [0] * (MAX_BIAS - len(bias))
    strides = [s for b in bias for s in (element_strides(b, 4) if b is not None else (0, 0, 0, 0))]
    strides += [0] * (4 * (MAX_BIAS - len(bias)))
    mask_strides = element_strides(mask, 4) if mask is not None else (0, 0, 0, 0)
    return (*pointers, *strides, data_pointer(mask), *mask_strides)


def fwd_fields(q, k, v, out, lse, *, scale: float, window_left, window_right, gqa_ratio: int,
               workspace=(None, None, None), block_m: int = 0, block_n: int = 0,
               num_splits: int = 1, terms=None, sequences=None, pages=None) -> tuple:
    """:func:`fwd_params`'s values as a tuple, in :data:`FWD_PARAMS`'s field order."""
    table, page_size = (None, 0) if pages is None else pages
    table_stride = 0 if table is None else element_strides(table, 1)[0]
    ws_o, ws_l, ws_m = workspace
    strides = []
    for a in (q, k, v, out):
        strides += element_strides(a, 3)
    strides += element_strides(lse, 3) if lse is not None else (0, 0, 0)
    batch, heads_q, seqlen_q, head_dim = q.shape
    return (data_pointer(q), data_pointer(k), data_pointer(v), data_pointer(out), data_pointer(lse),
            data_pointer(ws_o), data_pointer(ws_l), data_pointer(ws_m), *strides,
            batch, heads_q, gqa_ratio, seqlen_q, k.shape[2], head_dim, v.shape[3],
            _window(window_left), _window(window_right), block_m, block_n, num_splits,
            float(scale), float(scale) * math.log2(math.e),
            *(NO_TERMS if terms is None else term_fields(terms.bias, terms.mask)),
            *(NO_MODS if terms is None or terms.mods is None else
              mod_fields(terms.mods.softcap, terms.coords, terms.mod_args)),
            data_pointer(sequences), seqlen_q, 0, 0,
            data_pointer(table), table_stride, int(page_size))


# ---- backward ----------------------------------------------------------------------------------

_BWD_POINTERS = ("dout", "dq", "dk", "dv", "delta")

BWD_PARAMS = np.dtype(
    [("fwd", FWD_PARAMS)]
    + [(name, np.uint64) for name in _BWD_POINTERS]
    + [(f"{t}_{axis}_stride", np.int64) for t in _BWD_POINTERS for axis in ("batch", "head", "row")]
    + [("dbias", np.uint64, (MAX_BIAS,)), ("dbias_strides", np.int64, (MAX_BIAS, 4))]
    + [("dq_turns", np.uint64)],
    align=True,
)
assert BWD_PARAMS.itemsize == FWD_PARAMS.itemsize + 41 * 8
# The fields in one struct.pack format (see cupyflash._params).
_BWD_PACK = struct.Struct(_FWD_PACK.format + "5Q15q4Q16qQ")
assert _BWD_PACK.size == BWD_PARAMS.itemsize


def bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, *, scale: float, window_left,
               window_right, gqa_ratio: int, terms=None, dbias=(), sequences=None, dq_turns=None) -> np.void:
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
    scale, window_left, window_right, gqa_ratio, terms
        As for :func:`cupyflash._params.fwd_params`.
    dbias : tuple of arrays, optional
        One ``(B, Hq, Lq, Lk)`` view of the accumulator type per bias term (or none): the
        kernels add the bias gradients into them.
    sequences : array, optional
        As for :func:`fwd_params`.
    dq_turns : array, optional
        bwd_wgmma's ordered dQ: zeroed int32, one per (batch, query head, query block of
        the dK/dV launch), C order (``BwdParams::dq_turns``); None: a null pointer.

    Every array has a unit-stride last axis (where it has one) and is NumPy
    for the emulator, CuPy for the GPU.
    """
    strides = []
    for a in (dout, dq, dk, dv, delta):
        strides += element_strides(a, 3)
    fields = fwd_fields(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, terms=terms, sequences=sequences)
    pointers = (data_pointer(a) for a in (dout, dq, dk, dv, delta))
    gradients = term_fields(dbias)[:5 * MAX_BIAS]    # the bias part: pointers, strides
    turns = data_pointer(dq_turns) if dq_turns is not None else 0
    return np.frombuffer(bytearray(_BWD_PACK.pack(*fields, *pointers, *strides, *gradients, turns)),
                         BWD_PARAMS)[0]
