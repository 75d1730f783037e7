"""Packed variable-length attention: :func:`attention_varlen` and its backward.

Sequence ``s`` of a packed batch is rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of
q (heads first: ``(Hq, total_q, d)``) and rows ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``
of k and v; each is attended on its own, as :func:`cupyflash.attention` would on
the slices, and written into its own rows of the packed results.

The NumPy path runs the sequences on the worker threads, longest first, each in
one thread (results do not depend on the number of threads: every sequence is
computed the same way whoever runs it), or, with fewer sequences than twice the
workers, one after the other with the workers inside each.  The kernel backends
run every sequence in one launch (one per kernel of the plan): the kernels read
each sequence's first row and length from a table (``cuda_src/sequence.cuh``),
and the longest sequences' blocks start first.
"""

from __future__ import annotations

import numpy as np

from . import _cpu
from . import _dispatch
from ._dispatch import _allocate, _kernel_copy, _kernel_ready, _kernels_take, _xp
from ._options import KernelOptions
from ._params import KernelView
from ._validation import Problem, check_forward, check_forward_results, check_output, host_integers

__all__ = ["run_varlen", "run_varlen_backward", "check_cu_seqlens"]


def check_cu_seqlens(cu, name: str, *, kind: str, total: int) -> np.ndarray:
    """Offsets ``(nseq + 1,)``: int32/int64 of the call's kind, from 0, non-decreasing, to
    ``total``; returned as a host int64 array (on CuPy one small device-to-host copy)."""
    host = host_integers(cu, name, kind=kind)
    if host.ndim != 1 or host.shape[0] < 1:
        raise ValueError(f"`{name}` must have shape (number of sequences + 1,); got {tuple(host.shape)}")
    if host[0] != 0:
        raise ValueError(f"`{name}` must start at 0; got {int(host[0])}")
    steps = np.diff(host)
    if (steps < 0).any():
        s = int(np.argmax(steps < 0))
        raise ValueError(f"`{name}` must be non-decreasing; it falls from {int(host[s])} to "
                         f"{int(host[s + 1])} at sequence {s}")
    if host[-1] != total:
        raise ValueError(f"`{name}` must end at the packed length {total} (axis -2); got {int(host[-1])}")
    return host


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, window, enable_gqa, backend, extra=()):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"`{name}` must be packed as (heads, total, d): 3 dimensions; got shape "
                             f"{getattr(x, 'shape', None)} (FlashAttention's (total, heads, d) layout passes "
                             f"as x.transpose(1, 0, 2), without a copy)")
    problem, rest = check_forward(q, k, v, scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
                                  backend=backend, extra=extra)
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", kind=problem.kind, total=problem.seqlen_q)
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", kind=problem.kind, total=problem.seqlen_k)
    if cq.shape != ck.shape:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_k` must describe as many sequences; got "
                         f"{cq.shape[0] - 1} and {ck.shape[0] - 1}")
    return problem, rest, cq, ck


def _sequences(problem: Problem, cq, ck):
    """(problem of sequence s on its slices, q rows, k rows), longest first (ties in order)."""
    spans = [(slice(int(a), int(b)), slice(int(c), int(d))) for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]
    order = sorted(range(len(spans)), key=lambda s: -(spans[s][0].stop - spans[s][0].start)
                   * max(1, spans[s][1].stop - spans[s][1].start))
    for s in order:
        rows, keys = spans[s]
        yield problem.on(problem.q[:, rows], problem.k[:, keys], problem.v[:, keys]), rows, keys


def run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, window, enable_gqa, return_lse, out,
               backend, options: KernelOptions | None = None):
    problem, _, cq, ck = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, window=window,
                                enable_gqa=enable_gqa, backend=backend)
    if out is not None:
        check_output(out, "out", problem.out_shape, problem.dtype, problem.kind, (problem.q, problem.k, problem.v))
    _kernels_take(problem)
    out, lse = _allocate(problem, out, True)
    if problem.backend == "numpy":
        sequences = list(_sequences(problem, cq, ck))

        def run(item, single_thread):
            sub, rows, _ = item
            _cpu.forward(sub, out[:, rows], lse[:, rows], single_thread=single_thread)

        for _ in _cpu.map_whole(run, sequences):
            pass
    else:
        options = KernelOptions.from_environment() if options is None else options
        target = out if _kernel_ready(out) else _xp(problem.kind).empty(out.shape, dtype=out.dtype)
        _run_packed_forward(problem, cq, ck, target, lse, options)
        if target is not out:
            out[...] = target
    return (out, lse) if return_lse else out


def run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, scale, causal, window, enable_gqa,
                        deterministic, backend, options: KernelOptions | None = None):
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"`deterministic` must be a bool, got {type(deterministic).__name__}")
    problem, (dout, out, lse), cq, ck = _check(
        q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
        backend=backend, extra=(("dout", dout), ("out", out), ("lse", lse)))
    check_forward_results(problem, dout, out, lse)
    _kernels_take(problem, backward=True)
    if problem.backend == "numpy":
        xp = _xp(problem.kind)
        grads = tuple(xp.zeros(x.shape, dtype=x.dtype) for x in (problem.q, problem.k, problem.v))
        sequences = [item for item in _sequences(problem, cq, ck) if item[0].seqlen_q and item[0].seqlen_k]

        def store(item, result):
            _, rows, keys = item
            for grad, part, span in zip(grads, result, (rows, keys, keys)):
                grad[:, span] = part

        def run(item, single_thread):
            sub, rows, _ = item
            return item, _cpu.backward(sub, dout[:, rows], out[:, rows], lse[:, rows], single_thread=single_thread)

        for item, result in _cpu.map_whole(run, sequences):
            store(item, result)
    else:
        options = KernelOptions.from_environment() if options is None else options
        grads = _run_packed_backward(problem, cq, ck, dout, out, lse, bool(deterministic), options)
    return grads


def _spans(cq, ck) -> np.ndarray:
    """The ``(4, nseq)`` spans of packed sequences (:func:`cupyflash._run.sequence_table`):
    first query row, query rows, first key, keys."""
    return np.stack([cq[:-1], np.diff(cq), ck[:-1], np.diff(ck)]).astype(np.int64)


def _packed(x, nseq: int):
    """A packed ``(H, total, ...)`` array as the kernels' ``(nseq, H, total, ...)`` view:
    batch stride 0, each sequence's first row from the sequence table (the launch is
    cut to the longest sequence)."""
    return KernelView(x, (nseq,) + tuple(x.shape), (0,) + tuple(x.strides))


def _run_packed_forward(problem: Problem, cq, ck, out, lse, options) -> None:
    """The kernels' forward of every packed sequence in one launch; every row of
    ``out`` and ``lse`` belongs to a sequence and is written."""
    from . import _run

    nseq = len(cq) - 1
    if nseq == 0 or out.size == 0:
        return
    q, k, v = (_kernel_copy(x) for x in (problem.q, problem.k, problem.v))
    _run.forward(*(_packed(x, nseq) for x in (q, k, v, out, lse)), scale=problem.scale,
                 window_left=problem.window_left, window_right=problem.window_right,
                 gqa_ratio=problem.gqa_ratio, executor=_dispatch.executor_for(problem.backend), options=options,
                 precision=problem.precision, sequences=_spans(cq, ck))


def _run_packed_backward(problem: Problem, cq, ck, dout, out, lse, deterministic: bool, options):
    """The kernels' backward of every packed sequence in one launch group: (dq, dk, dv)
    in the inputs' dtype, zero where no sequence's query row sees a key."""
    from . import _run

    xp = _xp(problem.kind)
    acc = problem.accum_dtype
    nseq = len(cq) - 1
    grads = tuple(xp.zeros(x.shape, dtype=acc) for x in (problem.q, problem.k, problem.v))
    if nseq and problem.q.size and problem.k.size:
        q, k, v, out, dout = (_kernel_copy(x) for x in (problem.q, problem.k, problem.v, out, dout))
        lse = xp.ascontiguousarray(lse, dtype=acc)   # backward's delta takes its layout
        views = (_packed(x, nseq) for x in (dout, q, k, v, out, lse) + grads)
        _run.backward(*views, scale=problem.scale, window_left=problem.window_left,
                      window_right=problem.window_right, gqa_ratio=problem.gqa_ratio,
                      deterministic=deterministic, executor=_dispatch.executor_for(problem.backend), options=options,
                      precision=problem.precision, sequences=_spans(cq, ck))
    return tuple(g.astype(problem.dtype, copy=False) for g in grads)
