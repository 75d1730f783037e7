"""Argument checking for the public API.

Everything here runs before any work: every bad input raises a ``TypeError``
(wrong kind of object or dtype) or ``ValueError`` (shape or value) whose message
names the argument, what was expected and what was found.  The result is a
:class:`Problem`: the checked arrays plus the derived sizes and the mask bounds
every backend uses.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import _expr
from ._dtypes import accumulator_dtype, dtype_name
from ._mods import ScoreFunctions

__all__ = ["Problem", "check_forward", "check_backward", "check_precision", "SUPPORTED_DTYPES"]

BACKENDS = ("auto", "numpy", "cuda", "emulator")
PRECISIONS = ("ieee", "tf32", "tf32x3")
_FLOAT_KINDS = {"float16", "bfloat16", "float32", "float64"}
SUPPORTED_DTYPES = "float16, bfloat16, float32 or float64"


@dataclass
class Problem:
    """A checked attention call.

    ``q_shape``/``k_shape``/``v_shape`` are the user's shapes.  ``batch_shape`` is
    the broadcast shape of the leading dims (with the query head count on axis
    -3 when ``gqa_ratio > 1``).  ``window_left``/``window_right`` are the key
    offsets, relative to the bottom-right-aligned diagonal, that a query row may
    see (``None`` = unbounded); ``causal`` is already folded in.
    """

    q: object
    k: object
    v: object
    kind: str               # "numpy" or "cupy"
    dtype: np.dtype
    scale: float
    window_left: int | None
    window_right: int | None
    gqa_ratio: int
    batch_shape: tuple
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    backend: str
    precision: str = "ieee"  # float32 only: "tf32"/"tf32x3" allow the TF32 tensor cores
    bias: tuple = ()         # the additive bias terms, each broadcastable to scores_shape
    bias_is_tuple: bool = False   # the caller passed a tuple (dbias is then a tuple too)
    mask: object = None      # bool, broadcastable to scores_shape; True = may attend
    q_lengths: object = None   # int64 NumPy array of shape sequence_shape (host copy), or None
    kv_lengths: object = None
    mods: object = None        # cupyflash._mods.ScoreFunctions (softcap, ALiBi, score/mask_mod), or None
    mod_coords: tuple = ()     # the kernels' (b, h, slope) tables of a sequence's sub-problem (_dispatch)

    @property
    def sequence_shape(self) -> tuple:
        """The batch dims before the head axis: one length per sequence, whatever the heads."""
        return self.batch_shape[:-1]

    @property
    def kv_batch_shape(self) -> tuple:
        """batch_shape with the key/value head count on axis -3 (under GQA, Hq / group)."""
        if self.gqa_ratio > 1:
            return self.batch_shape[:-1] + (self.batch_shape[-1] // self.gqa_ratio,)
        return self.batch_shape

    def lengths_of(self, seq: tuple) -> tuple[int, int]:
        """(q_len, kv_len) of the sequence at index ``seq`` of the sequence dims."""
        q_len = self.seqlen_q if self.q_lengths is None else int(self.q_lengths[seq])
        kv_len = self.seqlen_k if self.kv_lengths is None else int(self.kv_lengths[seq])
        return q_len, kv_len

    def on(self, q, k, v, batch_shape: tuple | None = None, terms: tuple | None = None,
           mod_coords: tuple = ()) -> "Problem":
        """This problem on other arrays (one sequence's own rows and keys, checked with the
        whole): their lengths, no per-sequence lengths, ``batch_shape`` if it changes,
        ``terms = (bias, mask)`` the sequence's own score terms if given, and its own
        ``mod_coords`` (the kernels' coordinate tables, sliced from the whole's)."""
        bias, mask = (self.bias, self.mask) if terms is None else terms
        return dataclasses.replace(self, q=q, k=k, v=v, seqlen_q=q.shape[-2], seqlen_k=k.shape[-2],
                                   batch_shape=self.batch_shape if batch_shape is None else batch_shape,
                                   q_lengths=None, kv_lengths=None, bias=tuple(bias), mask=mask,
                                   mod_coords=tuple(mod_coords))

    @property
    def scores_shape(self) -> tuple:
        return self.batch_shape + (self.seqlen_q, self.seqlen_k)

    @property
    def out_shape(self) -> tuple:
        return self.batch_shape + (self.seqlen_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple:
        return self.batch_shape + (self.seqlen_q,)

    @property
    def accum_dtype(self) -> np.dtype:
        return accumulator_dtype(self.dtype)


def array_kind(x, name: str) -> str:
    """'numpy', 'cupy', or 'cuda-foreign' (a CUDA array CuPy can take zero-copy)."""
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray:
            # np.matrix changes what * and @ mean; a MaskedArray's mask would be ignored
            raise TypeError(
                f"`{name}` must be a plain NumPy array, got the subclass {type(x).__name__}; "
                f"pass numpy.asarray({name}) if ignoring its extra meaning is intended"
            )
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return "cupy"
    try:
        has_cai = hasattr(x, "__cuda_array_interface__")
    except Exception as exc:  # noqa: BLE001 - e.g. torch refuses it for tensors that require grad
        raise TypeError(
            f"`{name}` ({type(x).__name__}) cannot be shared with CuPy: {exc} "
            f"(for a PyTorch tensor, pass {name}.detach())"
        ) from None
    if has_cai:
        return "cuda-foreign"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            device_type = x.__dlpack_device__()[0]
        except Exception:  # noqa: BLE001 - a broken producer is just "not an array we take"
            device_type = None
        if int(device_type or 0) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return "cuda-foreign"
    if isinstance(x, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a NumPy or CuPy array, got a {type(x).__name__}; "
            f"convert it first, e.g. numpy.asarray({name})"
        )
    raise TypeError(f"`{name}` must be a NumPy or CuPy array, got {type(x).__module__}.{type(x).__name__}"
                    + _conversion_hint(x, name))


def _conversion_hint(x, name: str) -> str:
    """How to turn a host array of another library into a NumPy array ('' if unknown)."""
    if type(x).__module__.split(".")[0] == "torch":
        return (f"; for a PyTorch CPU tensor pass {name}.numpy() (zero-copy; "
                f"{name}.detach().numpy() if it requires grad)")
    if hasattr(x, "__array__") or hasattr(x, "__dlpack__"):
        return f"; convert it first, e.g. numpy.asarray({name})"
    return ""


def _to_cupy(x):
    import cupy

    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    return cupy.from_dlpack(x)


def _describe(dtype) -> str:
    """dtype name, with the byte order when it is not native ('float64 (>f8)')."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


def _check_dtype(x, name: str) -> np.dtype:
    dtype = np.dtype(x.dtype)
    if dtype_name(dtype) not in _FLOAT_KINDS:
        hint = (f"; convert it first, e.g. {name}.astype(numpy.float32)"
                if dtype.kind in "iub" else "")
        raise TypeError(f"`{name}` must have dtype {SUPPORTED_DTYPES}, got {dtype.name}{hint}")
    return dtype


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"`scale` must be a real number or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"`scale` must be finite, got {value}")
    return value


def _check_window(window, causal) -> tuple[int | None, int | None]:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"`causal` must be a bool, got {type(causal).__name__}")
    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"`window` must be a pair (left, right) or None, got {window!r}")
        bounds = []
        for side, w in zip(("left", "right"), window):
            if w is None:
                bounds.append(None)
                continue
            if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
                raise ValueError(
                    f"`window` {side} bound must be an integer >= -1 or None, got {w!r}"
                )
            w = int(w)
            if w < -1:
                raise ValueError(
                    f"`window` {side} bound must be >= 0, or -1/None for unbounded, got {w}"
                )
            bounds.append(None if w == -1 else w)
        left, right = bounds
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _broadcast(shapes: dict[str, tuple], hint: str = "") -> tuple:
    first, *rest = shapes.values()
    if all(s == first for s in rest):      # the common case, without NumPy's general rule
        return tuple(first)
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        found = ", ".join(f"{n} {s}" for n, s in shapes.items())
        raise ValueError(f"batch dimensions do not broadcast: {found}{hint}") from None


def _gqa_hint(q, k, v) -> str:
    """A hint to pass enable_gqa=True when the head counts (axis -3) look like GQA."""
    if min(q.ndim, k.ndim, v.ndim) < 3:
        return ""
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk == hv and 1 < hk < hq and hq % hk == 0:
        return (f"; q has {hq} heads and k, v {hk} (axis -3): for grouped-query attention "
                f"pass enable_gqa=True")
    return ""


MAX_BIAS_TERMS = 4


def _of_kind(x, name: str, kind: str, what: str = "an array"):
    """``x`` as the call's kind of array (a CUDA array of another library taken zero-copy
    on the CuPy path), or a TypeError naming it."""
    found = array_kind(x, name)
    if found == "cuda-foreign" and kind == "cupy":
        return _to_cupy(x)
    if found != kind:
        expected = "NumPy" if kind == "numpy" else "CuPy"
        raise TypeError(f"`{name}` must be {what} of {expected} like q, k and v; got a "
                        f"{'NumPy' if found == 'numpy' else 'CUDA'} array")
    return x


def _check_scores_operand(x, name: str, kind: str, device, target: tuple, batch_shape: tuple):
    """A bias term or the mask: the call's kind of array, on q's device, broadcastable to
    ``target``."""
    x = _of_kind(x, name, kind)
    if kind == "cupy" and int(x.device.id) != device:
        raise ValueError(f"`{name}` must be on q's device {device}; got device {int(x.device.id)}")
    shape = tuple(x.shape)
    if len(shape) > len(target) or any(n not in (1, t) for n, t in zip(shape[::-1], target[::-1])):
        raise ValueError(
            f"`{name}` of shape {shape} does not broadcast to the scores' shape {target} "
            f"(the output's batch shape {batch_shape} + (Lq, Lk)); each axis must be 1 or the "
            f"scores' size, and it may have fewer axes (they are aligned on the right)")
    return x


def _check_bias_and_mask(bias, mask, *, kind, device, batch_shape, seqlen_q, seqlen_k):
    """(bias terms, whether bias was a tuple, mask): checked, nothing converted."""
    target = batch_shape + (seqlen_q, seqlen_k)
    terms, is_tuple = (), False
    if bias is not None:
        if isinstance(bias, tuple):
            is_tuple = True
            if not 1 <= len(bias) <= MAX_BIAS_TERMS:
                raise ValueError(f"`bias` as a tuple must hold 1 to {MAX_BIAS_TERMS} arrays; got {len(bias)}")
            named = [(f"bias[{i}]", b) for i, b in enumerate(bias)]
        elif isinstance(bias, list):
            raise TypeError("`bias` must be an array or a tuple of arrays; got a list "
                            "(pass tuple(bias) for several terms, or numpy.asarray(bias) for one)")
        else:
            named = [("bias", bias)]
        checked = []
        for name, b in named:
            b = _check_scores_operand(b, name, kind, device, target, batch_shape)
            dtype = np.dtype(b.dtype)
            if dtype_name(dtype) not in _FLOAT_KINDS:
                hint = " (a boolean mask goes in `mask=`)" if dtype == np.bool_ else ""
                raise TypeError(f"`{name}` must have dtype {SUPPORTED_DTYPES}; got {dtype.name}{hint}")
            checked.append(b)
        terms = tuple(checked)
    if mask is not None:
        mask = _check_scores_operand(mask, "mask", kind, device, target, batch_shape)
        if np.dtype(mask.dtype) != np.bool_:
            dtype = np.dtype(mask.dtype)
            hint = (" (an additive mask of 0 and -inf goes in `bias=`)" if dtype.kind == "f"
                    else "; convert it, e.g. mask.astype(bool)")
            raise TypeError(f"`mask` must have dtype bool (True = may attend); got {dtype.name}{hint}")
    return terms, is_tuple, mask


def host_integers(x, name: str, *, kind: str, what: str = "an int32/int64 array"):
    """An int32/int64 array of the call's kind (CUDA arrays of another library taken on the
    CuPy path) as a host int64 array: on CuPy one small device-to-host copy, for the
    offsets, lengths and page tables that steer the host's work."""
    x = _of_kind(x, name, kind, what)
    dtype = np.dtype(x.dtype)
    if dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        hint = f"; convert it, e.g. {name}.astype(numpy.int64)" if dtype.kind in "iuf" else ""
        raise TypeError(f"`{name}` must have dtype int32 or int64; got {dtype.name}{hint}")
    return np.asarray(x.get() if kind == "cupy" else x, dtype=np.int64)


def _check_lengths(lengths, name: str, *, kind: str, shape: tuple, limit: int):
    """Per-sequence lengths: an integer (int32/int64 array of the call's kind, or a Python
    int) broadcastable to ``shape`` with values in [0, limit]; returned as a host int64
    array of exactly ``shape`` (a broadcast view), or None."""
    if lengths is None:
        return None
    if isinstance(lengths, numbers.Integral) and not isinstance(lengths, (bool, np.bool_)):
        host = np.asarray(int(lengths), dtype=np.int64)
    else:
        if isinstance(lengths, (bool, np.bool_)):
            raise TypeError(f"`{name}` must be an integer or an int32/int64 array; got a bool")
        host = host_integers(lengths, name, kind=kind, what="a Python int or an int32/int64 array")
    if host.ndim > len(shape) or any(n not in (1, t) for n, t in zip(host.shape[::-1], shape[::-1])):
        raise ValueError(
            f"`{name}` of shape {host.shape} does not broadcast to the sequences' shape {shape} "
            f"(the batch dims before the head axis: one length per sequence, not per head)")
    host = np.broadcast_to(host, shape)
    bad = np.argwhere((host < 0) | (host > limit))
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        raise ValueError(f"`{name}` must lie in [0, {limit}]; got {int(host[index])} at batch index "
                         f"{index if len(index) != 1 else index[0]}")
    return host


def check_forward(q, k, v, *, scale, causal, window, enable_gqa, backend, extra=(),
                  bias=None, mask=None, q_lengths=None, kv_lengths=None, mods=None) -> Problem:
    """Check the arguments shared by the forward and backward calls.

    ``extra`` lists further ``(name, array)`` pairs (dout, out, lse) that must be
    of the same array kind as q, k, v; their shapes are checked by the caller.
    ``bias`` and ``mask`` are checked against the scores' shape
    ``batch_shape + (Lq, Lk)``; ``mods`` is the dict of the score modifications'
    keywords (softcap, alibi_slopes, score_mod, mask_mod, mod_args), or None.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    named = [("q", q), ("k", k), ("v", v), *extra]
    kinds = {name: array_kind(x, name) for name, x in named}
    found = set(kinds.values())
    if len(found) > 1:
        desc = ", ".join(f"{n}: {kd}" for n, kd in kinds.items())
        raise TypeError(f"all arrays must be of one kind (all NumPy or all CuPy); got {desc}")
    kind = found.pop()
    if kind == "cuda-foreign":
        if backend not in ("auto", "cuda"):
            raise TypeError(f"backend={backend!r} needs NumPy arrays; got CUDA arrays")
        converted = [_to_cupy(x) for _, x in named]
        q, k, v = converted[:3]
        kind = "cupy"
    else:
        converted = [x for _, x in named]
    if backend in ("numpy", "emulator") and kind != "numpy":
        raise TypeError(
            f"backend={backend!r} needs NumPy arrays; got CuPy arrays (use .get() to copy them to the host)"
        )
    if backend == "cuda" and kind != "cupy":
        raise TypeError(
            "backend='cuda' needs CuPy (or other CUDA) arrays; got NumPy arrays "
            "(use cupy.asarray to copy them to the device)"
        )
    if kind == "cupy":
        devices = {name: int(x.device.id) for (name, _), x in zip(named, converted)}
        if len(set(devices.values())) > 1:
            raise ValueError(f"all arrays must be on one device; got {devices}")
    resolved = backend if backend != "auto" else ("numpy" if kind == "numpy" else "cuda")

    dtypes = {name: _check_dtype(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(dtypes.values())) > 1:
        desc = ", ".join(f"{n}: {_describe(d)}" for n, d in dtypes.items())
        raise TypeError(f"`q`, `k` and `v` must have the same dtype; got {desc}")
    dtype = dtypes["q"]
    if resolved == "emulator" and not dtype.isnative:
        raise TypeError(
            f"backend='emulator' needs native byte order, got {dtype.str}; "
            "convert with q.astype(q.dtype.newbyteorder('=')) (and k, v)"
        )

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"`{name}` must have at least 2 dimensions (..., L, d); got shape {x.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"`q` and `k` must have the same head dim (last axis); got q {q.shape} and k {k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"`k` and `v` must have the same sequence length (axis -2); got k {k.shape} and v {v.shape}"
        )
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if head_dim < 1 or head_dim_v < 1:
        raise ValueError(
            f"head dims must be at least 1; got q/k head dim {head_dim} and v head dim {head_dim_v}"
        )
    if resolved in ("cuda", "emulator") and (head_dim > 256 or head_dim_v > 256):
        raise ValueError(
            f"the {resolved} backend supports head dims up to 256; got q/k head dim {head_dim} "
            f"and v head dim {head_dim_v} (use backend='numpy' for larger ones)"
        )

    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"`enable_gqa` must be a bool, got {type(enable_gqa).__name__}")
    gqa_ratio = 1
    if enable_gqa:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim < 3:
                raise ValueError(
                    f"enable_gqa=True needs a head axis (-3) in `{name}`; got shape {x.shape}"
                )
        hq = q.shape[-3]
        hkv = _broadcast({"k heads": (k.shape[-3],), "v heads": (v.shape[-3],)})[0]
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(
                f"enable_gqa=True needs the query head count to be a multiple of the key/value "
                f"head count (axis -3); got q {q.shape}, k {k.shape}, v {v.shape}"
            )
        gqa_ratio = hq // hkv
        outer = _broadcast({"q": q.shape[:-3], "k": k.shape[:-3], "v": v.shape[:-3]})
        batch_shape = outer + (hq,)
    else:
        batch_shape = _broadcast({"q": q.shape[:-2], "k": k.shape[:-2], "v": v.shape[:-2]},
                                 _gqa_hint(q, k, v))

    left, right = _check_window(window, causal)
    scale = _check_scale(scale, head_dim)
    terms, is_tuple, mask = _check_bias_and_mask(
        bias, mask, kind=kind, device=int(q.device.id) if kind == "cupy" else None,
        batch_shape=batch_shape, seqlen_q=q.shape[-2], seqlen_k=k.shape[-2])
    sequences = batch_shape[:-1]
    q_lengths = _check_lengths(q_lengths, "q_lengths", kind=kind, shape=sequences, limit=q.shape[-2])
    kv_lengths = _check_lengths(kv_lengths, "kv_lengths", kind=kind, shape=sequences, limit=k.shape[-2])
    functions = None if mods is None else check_score_functions(
        **mods, kind=kind, device=int(q.device.id) if kind == "cupy" else None, batch_shape=batch_shape)
    return Problem(
        q=q, k=k, v=v, kind=kind, dtype=dtype, scale=scale,
        window_left=left, window_right=right, gqa_ratio=gqa_ratio,
        batch_shape=batch_shape, seqlen_q=q.shape[-2], seqlen_k=k.shape[-2],
        head_dim=head_dim, head_dim_v=head_dim_v, backend=resolved,
        bias=terms, bias_is_tuple=is_tuple, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
        mods=functions,
    ), converted[3:]


def check_precision(precision, dtype: np.dtype) -> str:
    """Check ``attention``'s ``precision`` against the inputs' dtype."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}")
    if precision != "ieee" and np.dtype(dtype) != np.float32:
        raise ValueError(f"`precision`={precision!r} applies to float32 inputs only; got {_describe(dtype)} "
                         "inputs (use precision='ieee', the default)")
    return precision


def check_output(out, name: str, shape: tuple, dtype: np.dtype, kind: str, inputs) -> None:
    """Check a caller-provided output array (``out=``)."""
    found_kind = array_kind(out, name)
    if found_kind != kind:
        raise TypeError(f"`{name}` must be a {'NumPy' if kind == 'numpy' else 'CuPy'} array like the inputs; got {found_kind}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {tuple(shape)}; got {tuple(out.shape)}")
    if np.dtype(out.dtype) != dtype:
        raise ValueError(f"`{name}` must have dtype {_describe(dtype)}; got {_describe(out.dtype)}")
    if kind == "numpy":
        if not out.flags.writeable:
            raise ValueError(f"`{name}` is read-only")
        overlaps = any(np.may_share_memory(out, x) for x in inputs)
    else:
        import cupy

        overlaps = any(cupy.may_share_memory(out, x) for x in inputs)
    if overlaps:
        raise ValueError(f"`{name}` must not overlap the input arrays")


def check_backward(dout, q, k, v, out, lse, *, scale, causal, window, enable_gqa, backend,
                   bias=None, mask=None, q_lengths=None, kv_lengths=None, mods=None):
    """Check ``attention_backward``'s arguments; returns the Problem and (dout, out, lse)."""
    problem, (dout, out, lse) = check_forward(
        q, k, v, scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
        backend=backend, extra=(("dout", dout), ("out", out), ("lse", lse)), bias=bias, mask=mask,
        q_lengths=q_lengths, kv_lengths=kv_lengths, mods=mods,
    )
    check_forward_results(problem, dout, out, lse)
    return problem, dout, out, lse


def check_forward_results(problem: Problem, dout, out, lse) -> None:
    """dout, out and lse of a backward call against the problem's shapes and dtypes."""
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != problem.out_shape:
            raise ValueError(f"`{name}` must have shape {problem.out_shape}; got {tuple(x.shape)}")
        if np.dtype(x.dtype) != problem.dtype:
            raise TypeError(f"`{name}` must have dtype {_describe(problem.dtype)} like q; got {_describe(x.dtype)}")
    if tuple(lse.shape) != problem.lse_shape:
        raise ValueError(f"`lse` must have shape {problem.lse_shape}; got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"`lse` must have dtype float32 or float64; got {np.dtype(lse.dtype).name}")


# ---- score modifications (softcap, ALiBi, score_mod, mask_mod, mod_args) -------------------


def _on_device(x, name, kind, device):
    """``x`` as the call's kind of array, on q's device."""
    x = _of_kind(x, name, kind)
    if kind == "cupy" and int(x.device.id) != device:
        raise ValueError(f"`{name}` must be on q's device {device}; got device {int(x.device.id)}")
    return x


def _check_mod_args(mod_args, kind, device) -> dict:
    if mod_args is None:
        return {}
    if not isinstance(mod_args, dict):
        raise TypeError(f"`mod_args` must be a dict of name -> array, got {type(mod_args).__name__}")
    reserved = set(_expr.COORDINATES) | set(_expr.FUNCTIONS) | {"score"}
    out = {}
    for name, a in mod_args.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"`mod_args`: the name {name!r} is not an identifier")
        if name in reserved:
            raise ValueError(f"`mod_args`: the name {name!r} is taken by the language (score, b, h, q_idx, "
                             f"kv_idx and the functions)")
        a = _on_device(a, f"mod_args[{name!r}]", kind, device)
        if np.dtype(a.dtype).kind not in "biuf" or a.ndim == 0:
            raise ValueError(f"`mod_args[{name!r}]` must be an array of at least one axis of bool, int or "
                             f"float elements, got {np.dtype(a.dtype).name} of shape {tuple(a.shape)}")
        out[name] = a
    return out


def check_score_functions(softcap, alibi_slopes, score_mod, mask_mod, mod_args, *, kind, device,
                          batch_shape) -> ScoreFunctions | None:
    """The checked modifications of a call (None when none is given); errors name the
    argument and come before any work."""
    if softcap is None and alibi_slopes is None and score_mod is None and mask_mod is None:
        if mod_args:
            raise ValueError("`mod_args` is given but neither `score_mod` nor `mask_mod` reads it")
        return None
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
            raise TypeError(f"`softcap` must be a positive number, got {type(softcap).__name__}")
        if not (np.isfinite(softcap) and softcap > 0):
            raise ValueError(f"`softcap` must be a positive finite number, got {softcap!r}")
        softcap = float(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _on_device(alibi_slopes, "alibi_slopes", kind, device)
        if np.dtype(alibi_slopes.dtype).kind != "f":
            raise TypeError(f"`alibi_slopes` must be floating, got {np.dtype(alibi_slopes.dtype).name}")
        try:
            np.broadcast_shapes(tuple(alibi_slopes.shape), tuple(batch_shape))
            fits = len(alibi_slopes.shape) <= len(batch_shape) and np.broadcast_shapes(
                tuple(alibi_slopes.shape), tuple(batch_shape)) == tuple(batch_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"`alibi_slopes` of shape {tuple(alibi_slopes.shape)} does not broadcast to the "
                             f"output's batch shape {tuple(batch_shape)} (one slope per head: shape "
                             f"({batch_shape[-1] if batch_shape else 1},))")
    arrays = _check_mod_args(mod_args, kind, device)
    if arrays and score_mod is None and mask_mod is None:
        raise ValueError("`mod_args` is given but neither `score_mod` nor `mask_mod` reads it")
    score_node = None if score_mod is None else _expr.parse(score_mod, "score_mod", arrays)
    mask_node = None if mask_mod is None else _expr.parse(mask_mod, "mask_mod", arrays, boolean=True)
    return ScoreFunctions(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_node, mask_mod=mask_node,
                          mod_args=arrays,
                          score_mod_grad=None if score_node is None else _expr.derivative(score_node),
                          texts=(score_mod or "", mask_mod or ""))
