"""Routing a checked call to a backend.

``numpy`` runs the CPU path (:mod:`cupyflash._cpu`).  ``cuda`` and
``emulator`` run the CUDA kernels (:mod:`cupyflash._run`, which asks
:func:`cupyflash._families.select` for the kernels) through an executor:
:class:`cupyflash._loader.CudaExecutor` on the current CuPy device and stream,
or :class:`cupyflash.emulator.EmulatorExecutor` on the CPU.  The kernels take
(B, H, L, d) strided views; this module builds them from the broadcast batch
dims without copying (a broadcast axis gets stride 0, a transposed
(B, L, H, d) layout is just other strides), as
:class:`~cupyflash._params.KernelView` descriptors rather than array objects:
host time per call matters where the kernels are short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np

from . import _cpu
from ._options import KernelOptions
from ._params import MAX_MOD_ARGS, KernelView
from ._terms import ScoreOperands, check_tile_strides
from ._validation import Problem

__all__ = ["run_forward", "run_backward", "run_forward_v1", "executor_for"]

_EMULATOR_ARCH = 80
_executors: dict = {}
_executors_lock = threading.Lock()


def _xp(kind: str):
    if kind == "numpy":
        return np
    import cupy

    return cupy


def executor_for(backend: str):
    """The executor for 'cuda' (current device) or 'emulator' (sm_80)."""
    if backend == "emulator":
        key = ("emulator",)
    else:
        import cupy

        key = ("cuda", cupy.cuda.runtime.getDevice())
    with _executors_lock:
        ex = _executors.get(key)
        if ex is None:
            if backend == "emulator":
                from .emulator import EmulatorExecutor

                ex = EmulatorExecutor(arch=_EMULATOR_ARCH)
            else:
                from ._loader import CudaExecutor

                ex = CudaExecutor()
            _executors[key] = ex
    return ex


def _allocate(problem: Problem, out, return_lse: bool):
    xp = _xp(problem.kind)
    if out is None:
        out = xp.empty(problem.out_shape, dtype=problem.dtype)
    lse = xp.empty(problem.lse_shape, dtype=problem.accum_dtype) if return_lse else None
    return out, lse


def _kernels_take(problem: Problem, backward: bool = False) -> None:
    """Raise before any work when the problem asks the kernels for score features
    (:data:`cupyflash._families.FEATURES`) that no family of the direction takes."""
    from ._families import BACKWARD, FORWARD, taking

    asked = {n for n, on in (("bias", problem.bias), ("mask", problem.mask is not None)) if on}
    asked |= problem.mods.features if problem.mods else set()
    if problem.backend == "numpy" or not asked:
        return
    if not taking(BACKWARD if backward else FORWARD, asked):
        what = ", ".join(f"`{n}`" for n in sorted(asked))
        raise NotImplementedError(
            f"{what}: no CUDA kernel family takes them yet, so the {problem.backend!r} backend cannot run "
            f"this call; the NumPy backend can (NumPy arrays: numpy arrays in, or .get() CuPy ones)")
    check_tile_strides("bias", problem.bias)
    check_tile_strides("mask", () if problem.mask is None else (problem.mask,))
    args = problem.mods.mod_args if problem.mods else {}
    if len(args) > MAX_MOD_ARGS or any(a.ndim > 4 for a in args.values()):
        raise NotImplementedError(f"`mod_args`: the CUDA kernels read up to {MAX_MOD_ARGS} arrays of up to 4 axes; "
                                  f"got {len(args)} of {[a.ndim for a in args.values()]} axes (backend='numpy' "
                                  f"takes any)")


def run_forward(problem: Problem, out, return_lse: bool, options: KernelOptions | None = None):
    """(out[, lse]) of a checked problem; ``options`` steers kernel dispatch (None: read
    from the environment now)."""
    _kernels_take(problem)
    out, lse = _allocate(problem, out, return_lse)
    if out.size == 0 and (lse is None or lse.size == 0):
        return (out, lse) if return_lse else out
    if problem.backend == "numpy":
        _cpu.forward(problem, out, lse)
    elif _has_lengths(problem):
        options = KernelOptions.from_environment() if options is None else options
        with _index_faults(problem):
            _run_sequences_forward(problem, out, lse, options)
    else:
        with _index_faults(problem):
            _run_kernel(problem, out, lse, sram_size=None,
                        options=KernelOptions.from_environment() if options is None else options)
    return (out, lse) if return_lse else out


def _run_sequences_forward(problem: Problem, out, lse, options) -> None:
    """The kernels' forward of a padded batch with lengths: one launch over every
    sequence (cuda_src/sequence.cuh), after zeros and lse = -inf in the rows past
    each sequence's length, which no CTA writes."""
    out[...] = 0
    if lse is not None:
        lse[...] = -np.inf
    _run_kernel(problem, out, lse, sram_size=None, options=options, lengths=True)


def _length_views(problem: Problem):
    """The per-sequence lengths as host int64 arrays of ``batch_shape`` (each sequence's
    lengths along its heads, stride 0 there), for :func:`_kernel_views` to cut into
    launches with the other arrays."""
    shape = problem.batch_shape
    out = []
    for given, full in ((problem.q_lengths, problem.seqlen_q), (problem.kv_lengths, problem.seqlen_k)):
        per = np.full(problem.sequence_shape, full, np.int64) if given is None else \
            np.ascontiguousarray(np.broadcast_to(given, problem.sequence_shape), dtype=np.int64)
        out.append(np.broadcast_to(per.reshape(per.shape + (1,) * (len(shape) - per.ndim)), shape))
    return out


def _spans(q_lengths, kv_lengths) -> np.ndarray:
    """A launch's ``(4, B)`` spans (:func:`cupyflash._run.sequence_table`) of a padded
    batch: first rows 0, the lengths from the launch's (B, H) length views."""
    q_len = np.asarray(q_lengths.array() if isinstance(q_lengths, KernelView) else q_lengths)[:, 0]
    kv_len = np.asarray(kv_lengths.array() if isinstance(kv_lengths, KernelView) else kv_lengths)[:, 0]
    zeros = np.zeros_like(q_len)
    return np.stack([zeros, q_len, zeros, kv_len]).astype(np.int64)


@contextlib.contextmanager
def _index_faults(problem: Problem):
    """An index of a score_mod / mask_mod outside its mod_args array, as IndexError: the
    emulator's bounds check stops the kernel (a GPU's __trap ends its context instead)."""
    try:
        yield
    except Exception as error:
        if problem.mods and "mod_args index out of bounds" in str(error):
            texts = " / ".join(t for t in problem.mods.texts if t)
            raise IndexError(f"`mod_args`: an index of {texts!r} is outside its array (the emulator's "
                             f"bounds check stopped the kernel)") from error
        raise


def _has_lengths(problem: Problem) -> bool:
    return problem.q_lengths is not None or problem.kv_lengths is not None


def _full_views(problem: Problem, prepare=lambda x: x):
    """q, k, v (each ``prepare``d) broadcast to the full batch shapes, q's and the kv heads'."""
    xp = _xp(problem.kind)
    return (_broadcast_to(xp, prepare(problem.q), problem.batch_shape + problem.q.shape[-2:]),
            _broadcast_to(xp, prepare(problem.k), problem.kv_batch_shape + problem.k.shape[-2:]),
            _broadcast_to(xp, prepare(problem.v), problem.kv_batch_shape + problem.v.shape[-2:]))


def _full_terms(problem: Problem):
    """The biases (each aligned: a copy where an element is not) and the mask broadcast to
    the scores' full shape ``batch_shape + (Lq, Lk)``: stride 0 along broadcast axes."""
    xp = _xp(problem.kind)
    shape = problem.scores_shape
    bias = tuple(_broadcast_to(xp, b if _aligned(b) else b.copy(), shape) for b in problem.bias)
    mask = None if problem.mask is None else _broadcast_to(xp, problem.mask, shape)
    return bias, mask


def _mod_coordinates(problem: Problem) -> tuple:
    """The score modifications' per-(batch, head) tables, each broadcast to the batch
    shape (stride 0 along broadcast axes): the flat batch index b and the head h (int64),
    the ALiBi slopes (float64; None without them).  A sequence's sub-problem carries its
    slices of the whole's (``Problem.mod_coords``): b stays the whole's index.  Empty
    without modifications."""
    if not problem.mods:
        return ()
    if problem.mod_coords:
        return problem.mod_coords
    xp = _xp(problem.kind)
    b, h, slopes = problem.mods.coordinates(problem.batch_shape, xp)
    slopes = None if slopes is None else slopes.astype(np.float64)
    return tuple(None if x is None else _broadcast_to(xp, x, problem.batch_shape) for x in (b, h, slopes))


def run_forward_v1(problem: Problem, sram_size: int, return_lse: bool):
    out, lse = _allocate(problem, None, return_lse)
    if out.size:
        _run_kernel(problem, out, lse, sram_size=sram_size, options=None)
    return (out, lse) if return_lse else out


def run_backward(problem: Problem, dout, out, lse, *, deterministic: bool = True,
                 options: KernelOptions | None = None):
    """(dq, dk, dv) with the shapes and dtypes of q, k and v.

    The CPU path is deterministic whatever ``deterministic`` says; the CUDA
    kernels add dq with atomics when it is False (:func:`cupyflash._run.backward`).
    ``options`` steers kernel dispatch (None: read from the environment now).
    """
    _kernels_take(problem, backward=True)
    if problem.backend == "numpy":
        return _cpu.backward(problem, dout, out, lse)
    options = KernelOptions.from_environment() if options is None else options
    with _index_faults(problem):
        return _run_backward_kernels(problem, dout, out, lse, deterministic, options,
                                     lengths=_has_lengths(problem))


def _bias_gradients(problem: Problem):
    """Per bias term, its gradient accumulator (the term's own shape, the accumulator
    type, zeroed) and the kernels' view of it: broadcast to the scores' full shape
    (stride 0 along the term's broadcast axes), or None for a term constant along the
    keys, whose gradient is exactly 0 (the softmax does not see a per-row shift: the
    row's dS sums to 0) and is not computed."""
    xp = _xp(problem.kind)
    dbias = tuple(xp.zeros(b.shape, dtype=problem.accum_dtype) for b in problem.bias)
    views = tuple(None if (b.shape[-1:] in ((), (1,))) else _broadcast_to(xp, g, problem.scores_shape)
                  for g, b in zip(dbias, problem.bias))
    return dbias, views


def _finish_bias_gradients(problem: Problem, dbias) -> tuple:
    """``()`` without biases, else a 1-tuple: dbias as the caller passed bias (an array, or
    a tuple in order), each term in its own dtype."""
    if not problem.bias:
        return ()
    terms = tuple(g.astype(b.dtype, copy=False) for g, b in zip(dbias, problem.bias))
    return (terms if problem.bias_is_tuple else terms[0],)


# ---- (B, H, L, d) views for the kernels ------------------------------------------


def _merge(shape, strides):
    """Merge dims into one (size, stride) if their strides allow it, else None."""
    size, stride = 1, 0
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if size == 1:
            size, stride = n, s
        elif stride == s * n:
            size, stride = size * n, s
        else:
            return None
    return size, stride


def _kernel_views(problem: Problem, arrays):
    """Split ``arrays`` (full-shape broadcast views) into lists of 4-D/3-D views.

    Each array has shape ``outer + (H, ...tail)``.  The outer dims are merged
    into one batch axis when every array's strides allow it; otherwise the
    first outer dim is looped over.  Yields tuples of
    :class:`~cupyflash._params.KernelView` (None stays None), one per launch.
    """
    n_outer = len(problem.batch_shape) - 1 if problem.batch_shape else 0
    if n_outer <= 1 or all(
        _merge(a.shape[:n_outer], a.strides[:n_outer]) is not None for a in arrays if a is not None
    ):
        views = []
        for a in arrays:
            if a is None:
                views.append(None)
                continue
            outer = a.shape[:n_outer]
            b, sb = _merge(outer, a.strides[:n_outer]) if n_outer else (1, 0)
            if n_outer == 0 and not problem.batch_shape:     # 2-D inputs: one head
                shape, strides = (1, 1) + a.shape, (0, 0) + a.strides
            else:
                shape = (b,) + a.shape[n_outer:]
                strides = (sb,) + a.strides[n_outer:]
            views.append(KernelView(a, shape, strides))
        yield tuple(views)
        return
    for i in range(problem.batch_shape[0]):
        sub = Problem(**{**problem.__dict__, "batch_shape": problem.batch_shape[1:]})
        yield from _kernel_views(sub, [None if a is None else a[i] for a in arrays])


def _broadcast_to(xp, x, shape):
    """``x`` broadcast to ``shape`` (``x`` itself where it has that shape: no view to build)."""
    return x if x.shape == shape else xp.broadcast_to(x, shape)


def _operands(problem: Problem, bias, mask, coords) -> ScoreOperands:
    """One launch's score operands: its views of the bias terms, the mask and the
    modifications' coordinate tables, and the mod_args arrays in order."""
    mods = problem.mods or None
    args = tuple(mods.mod_args.values()) if mods else ()
    return ScoreOperands(tuple(bias), mask, mods, tuple(coords), args)


def _kernel_ready(x) -> bool:
    """Whether the kernels can read ``x`` in place: a unit stride along the head dim
    (or a single element there), and every element aligned to its size -- a GPU
    faults on a misaligned access (NumPy arrays can be: ``numpy.frombuffer`` at an
    odd offset, a field of a packed structured array)."""
    return (x.shape[-1] == 1 or x.strides[-1] == x.itemsize) and _aligned(x)


def _aligned(x) -> bool:
    """Whether every element of ``x`` starts at a multiple of its size."""
    if isinstance(x, np.ndarray):
        return x.flags.aligned   # the dtypes' alignments are their sizes
    size = x.itemsize
    return x.data.ptr % size == 0 and all(stride % size == 0 for stride in x.strides)


def _kernel_copy(x):
    """``x`` itself where :func:`_kernel_ready`, else a C-contiguous (aligned) copy."""
    return x if _kernel_ready(x) else x.copy(order="C")


def _run_kernel(problem: Problem, out, lse, *, sram_size, options, lengths: bool = False):
    """The kernels' forward; ``lengths``: the problem's per-sequence lengths, one launch
    over every sequence (``out`` and ``lse`` hold the caller's values past them)."""
    from . import _run

    xp = _xp(problem.kind)
    g = problem.gqa_ratio
    q, k, v = _full_views(problem, _kernel_copy)
    bias, mask = _full_terms(problem)
    coords = _mod_coordinates(problem) or (None, None, None)
    target = out if _kernel_ready(out) else out.copy() if lengths else xp.empty(out.shape, dtype=out.dtype)
    executor = executor_for(problem.backend)
    sizes = _length_views(problem) if lengths else [None, None]
    for qv, kv, vv, ov, lv, qlen, kvlen, *tv in _kernel_views(problem, [q, k, v, target, lse, *sizes, *coords,
                                                                      *bias, mask]):
        common = dict(scale=problem.scale, window_left=problem.window_left,
                      window_right=problem.window_right, gqa_ratio=g, executor=executor)
        if sram_size is None:
            terms = _operands(problem, tv[3:-1], tv[-1], tv[:3])
            _run.forward(qv, kv, vv, ov, lv, precision=problem.precision, options=options, terms=terms,
                         sequences=_spans(qlen, kvlen) if lengths else None, **common)
        else:
            _run.forward_v1(qv, kv, vv, ov, lv, sram_size=sram_size, **common)
    if target is not out:
        out[...] = target


def _sum_to_shape(x, shape):
    """Sum a full-shape gradient over the axes broadcasting added or expanded (a
    fixed-order reduction: deterministic on NumPy and CuPy alike)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + a for a, n in enumerate(shape) if n == 1 and x.shape[lead + a] != 1)
    return (x.sum(axis=axes) if axes else x).reshape(shape)


def _run_backward_kernels(problem: Problem, dout, out, lse, deterministic: bool, options, finish: bool = True,
                          dbias=None, lengths: bool = False):
    """(dq, dk, dv) -- and with biases, dbias as :func:`_finish_bias_gradients` gives it.
    ``finish=False``: the full broadcast shapes in the accumulator type, the bias
    gradients added into ``dbias`` (the kernels' views, :func:`_bias_gradients`), nothing
    returned for them.  ``lengths``: the problem's per-sequence lengths, one launch
    group over every sequence; the gradient rows past them stay zero."""
    from . import _run

    xp = _xp(problem.kind)
    g = problem.gqa_ratio
    acc = problem.accum_dtype
    q, k, v = _full_views(problem, _kernel_copy)
    out, dout = _kernel_copy(out), _kernel_copy(dout)
    lse = lse if lse.dtype == acc and _aligned(lse) else lse.astype(acc, order="C")   # any strides
    bias, mask = _full_terms(problem)
    coords = _mod_coordinates(problem) or (None, None, None)
    accumulators = None
    if dbias is None:
        accumulators, dbias = _bias_gradients(problem)
    # Gradients of the full broadcast shapes in the accumulator type: every
    # (batch, head) of the kernels owns its slice (a kv head's slice already
    # sums its GQA group); broadcast axes are summed below, then cast.
    allocate = xp.zeros if lengths else xp.empty   # with lengths no CTA writes the rows past them
    dq = allocate(q.shape, dtype=acc)
    dk = allocate(k.shape, dtype=acc)
    dv = allocate(v.shape, dtype=acc)
    executor = executor_for(problem.backend)
    sizes = _length_views(problem) if lengths else [None, None]
    by_query = [q, out, dout, lse, dq, *sizes, *coords, *bias, mask, *dbias]   # batch_shape's heads
    by_key = [k, v, dk, dv]                                     # kv_batch_shape's
    n_terms = len(bias)
    for part, (qs, ks) in _disjoint_gradient_launches(problem, dbias):
        arrays = [None if a is None else a[qs] for a in by_query] + [a[ks] for a in by_key]
        for views in _kernel_views(part, arrays):
            qv, ov, dov, lv, dqv, qlen, kvlen, *rest = views[:-4]
            kv, vv, dkv, dvv = views[-4:]
            cv, rest = rest[:3], rest[3:]
            tv, mv, gv = tuple(rest[:n_terms]), rest[n_terms], tuple(rest[n_terms + 1:])
            _run.backward(dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, scale=problem.scale,
                          window_left=problem.window_left, window_right=problem.window_right,
                          gqa_ratio=g, deterministic=deterministic, executor=executor, options=options,
                          precision=problem.precision, terms=_operands(problem, tv, mv, cv), dbias=gv,
                          sequences=_spans(qlen, kvlen) if lengths else None)
    if not finish:      # the full broadcast shapes, in the accumulator type
        return dq, dk, dv
    grads = tuple(_sum_to_shape(grad, x.shape).astype(problem.dtype, copy=False)
                  for grad, x in ((dq, problem.q), (dk, problem.k), (dv, problem.v)))
    return grads + _finish_bias_gradients(problem, accumulators)


def _disjoint_gradient_launches(problem: Problem, dbias):
    """``(part, (q_index, kv_index))`` per group of launches whose bias-gradient writes
    are disjoint between CTAs: the kernels' CTAs each own one (batch entry, kv head), and
    two of them must never add into the same dbias element.  So where a bias term is
    broadcast along a batch axis of more than one entry (stride 0 in its view), each
    entry of that axis gets its own launches, and likewise each kv head where a term is
    broadcast along the heads; launches run in order, so every sum runs in a fixed
    order.  Indices keep every axis (length-1 slices); ``q_index`` applies to arrays of
    ``batch_shape``'s heads, ``kv_index`` to those of ``kv_batch_shape``'s.  Without
    bias gradients: one group, the whole problem."""
    views = [g for g in dbias if g is not None]
    shape = problem.batch_shape
    whole = (slice(None),) * len(shape)
    if not views or not shape:
        yield problem, (whole, whole)
        return
    g = problem.gqa_ratio
    heads_kv = shape[-1] // g
    split = [n > 1 and any(v.strides[a] == 0 for v in views) for a, n in enumerate(shape)]
    axes = [range(n) if s else [None] for n, s in zip(shape[:-1], split[:-1])]
    heads = range(heads_kv) if split[-1] and heads_kv > 1 else [None]
    sub_shape = tuple(1 if s else n for n, s in zip(shape[:-1], split[:-1]))
    for outer in np.ndindex(*(len(a) for a in axes)) if axes else [()]:
        idx = tuple(slice(None) if a[i] is None else slice(a[i], a[i] + 1) for a, i in zip(axes, outer))
        for h in heads:
            if h is None:
                q_head = kv_head = slice(None)
                n_heads = shape[-1]
            else:
                q_head, kv_head, n_heads = slice(h * g, (h + 1) * g), slice(h, h + 1), g
            part = dataclasses.replace(problem, batch_shape=sub_shape + (n_heads,))
            yield part, (idx + (q_head,), idx + (kv_head,))
