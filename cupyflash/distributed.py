"""Context-parallel (ring) attention: each rank holds a shard of the sequence, K/V shards travel.

:func:`ring_attention` and :func:`ring_attention_backward` run over an
``mpi4py`` communicator (NumPy arrays; CuPy arrays through CUDA-aware MPI or
staged through pinned host memory) or a CuPy NCCL communicator (CuPy arrays).
:func:`shard` and :func:`unshard` cut a whole sequence into this rank's shard
and gather it back.  Neither mpi4py nor CuPy is imported until a function here
is called with their objects.

Layouts (along the length axis, -2, of global length ``L`` over ``n`` ranks):

* ``"contiguous"``: rank ``r`` holds chunk ``r`` of ``n``;
* ``"zigzag"``: rank ``r`` holds chunks ``r`` and ``2n - 1 - r`` of ``2n``, in
  that order, so that every rank has as much causal work as the others.

Chunks follow :func:`numpy.array_split`: when ``L`` is not divisible, the first
chunks are one row longer.  Any ``L`` works; a shard of a length the layout
does not give is a ValueError on every rank.
"""

from __future__ import annotations

import sys
import traceback
import zlib

import numpy as np

from ._api import attention, attention_backward
from ._merge import merge_attention
from ._validation import check_backward, check_forward

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------- layouts


def _chunks(length: int, parts: int) -> list[tuple[int, int]]:
    """numpy.array_split's split of range(length) into ``parts`` ranges."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def _ranges(length: int, size: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """The global row ranges rank ``rank`` holds, in the order its shard stores them."""
    if layout == "contiguous":
        return [_chunks(length, size)[rank]]
    chunks = _chunks(length, 2 * size)
    return [chunks[rank], chunks[2 * size - 1 - rank]]


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")


# ---------------------------------------------------------------- transports


def _mpi_comm_type():
    from mpi4py import MPI

    return MPI.Comm


class _MPITransport:
    """Point-to-point over mpi4py: Isend/Irecv of raw bytes (any dtype, bfloat16 too)."""

    name = "MPI"

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.kinds = ("numpy", "cupy")
        self._cuda_aware = None

    def cuda_aware(self) -> bool:
        """Whether the MPI library takes device memory: it lists CUDA among the memory kinds of
        the communicator (MPI 4.1's ``mpi_memory_alloc_kinds`` info, e.g. ``cuda:device``)."""
        if self._cuda_aware is None:
            info = self.comm.Get_info()
            try:
                self._cuda_aware = _lists_cuda_memory(info.Get("mpi_memory_alloc_kinds") or "")
            finally:
                info.Free()
        return self._cuda_aware

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(v) for v in self.comm.allgather(list(values))]

    def allgather_array(self, x):
        """Every rank's ``x`` (shapes may differ), as arrays of x's kind."""
        if isinstance(x, np.ndarray):
            return self.comm.allgather(x)
        import cupy

        return [cupy.asarray(h) for h in self.comm.allgather(x.get())]

    def start(self, sends, recvs, dest, source, tag=0):
        """Start sending ``sends`` to ``dest`` and receiving ``recvs`` from ``source``
        (message ``i`` with tag ``tag + i``)."""
        staged = []
        if sends and not isinstance(sends[0], np.ndarray):
            import cupy

            # the device buffers must hold their data before MPI reads them, and the
            # receive buffers must no longer be read by earlier work on the stream
            cupy.cuda.get_current_stream().synchronize()
            if not self.cuda_aware():
                import cupyx

                host_sends = [cupyx.empty_pinned(a.shape, a.dtype) for a in sends]
                for h, a in zip(host_sends, sends):
                    a.get(out=h)
                staged = [(cupyx.empty_pinned(a.shape, a.dtype), a) for a in recvs]
                sends, recvs = host_sends, [h for h, _ in staged]
        requests = []
        for i, (s, r) in enumerate(zip(sends, recvs)):
            requests.append(self.comm.Isend(_bytes(s), dest=dest, tag=tag + i))
            requests.append(self.comm.Irecv(_bytes(r), source=source, tag=tag + i))
        return requests, staged

    def wait(self, handle):
        from mpi4py import MPI

        requests, staged = handle
        MPI.Request.Waitall(requests)
        for host, device in staged:
            device.set(host)

    def abort(self):
        self.comm.Abort(1)


def _lists_cuda_memory(kinds: str) -> bool:
    """True if an ``mpi_memory_alloc_kinds`` value (``"mpi,system,cuda:device"``) includes
    CUDA device memory: the kind ``cuda`` with no restrictor or with ``device``."""
    for kind in kinds.split(","):
        name, *restrictors = kind.strip().split(":")
        if name == "cuda" and (not restrictors or "device" in restrictors):
            return True
    return False


def _bytes(a):
    """A contiguous array's memory as a flat uint8 array (MPI sends bytes)."""
    return a.reshape(-1).view(np.uint8)


class _CupyRuntime:
    """What the NCCL path needs from CuPy, in one place (the tests swap in a fake)."""

    kind = "cupy"

    def __init__(self):
        import cupy
        from cupy.cuda import nccl

        self.xp, self.nccl = cupy, nccl
        self.byte, self.int64 = nccl.NCCL_UINT8, nccl.NCCL_INT64

    def side_stream(self):
        return self.xp.cuda.Stream(non_blocking=True)

    def ptr(self, a):
        return a.data.ptr

    def stream_ptr(self, stream):
        return stream.ptr

    def record(self, stream=None):
        return (stream or self.xp.cuda.get_current_stream()).record()

    def wait_event(self, event, stream=None):
        (stream or self.xp.cuda.get_current_stream()).wait_event(event)

    def synchronize(self, stream):
        stream.synchronize()

    def group_start(self):
        self.nccl.groupStart()

    def group_end(self):
        self.nccl.groupEnd()


def _nccl_runtime():
    return _CupyRuntime()


class _NCCLTransport:
    """Point-to-point over a ``cupy.cuda.nccl.NcclCommunicator`` on a side stream."""

    name = "NCCL"

    def __init__(self, comm):
        self.comm = comm
        try:
            self.rt = _nccl_runtime()
        except ImportError as exc:
            raise TypeError(f"`comm` ({type(comm).__name__}) has the NCCL communicator's interface, "
                            f"but CuPy's NCCL module cannot be imported: {exc}") from None
        self.rank, self.size = comm.rank_id(), comm.size()
        self.kinds = (self.rt.kind,)
        self.stream = self.rt.side_stream()

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        xp = self.rt.xp
        send = xp.asarray(np.asarray(values, dtype=np.int64))
        recv = xp.empty(self.size * len(values), dtype=np.int64)
        self.rt.wait_event(self.rt.record(), self.stream)
        self.comm.allGather(self.rt.ptr(send), self.rt.ptr(recv), len(values), self.rt.int64,
                            self.rt.stream_ptr(self.stream))
        self.rt.synchronize(self.stream)
        host = recv.get() if hasattr(recv, "get") else recv
        return [list(map(int, row)) for row in np.asarray(host).reshape(self.size, len(values))]

    def allgather_array(self, x):
        """Every rank's ``x`` (shapes may differ on axis -2 only): padded to the longest
        on axis -2, one allGather of bytes, cut back."""
        xp = self.rt.xp
        lengths = [row[0] for row in self.allgather_ints([x.shape[-2]])]
        longest = max(lengths)
        padded = xp.zeros(tuple(x.shape[:-2]) + (longest, x.shape[-1]), dtype=x.dtype)
        padded[..., : x.shape[-2], :] = x
        recv = xp.empty((self.size,) + padded.shape, dtype=x.dtype)
        self.rt.wait_event(self.rt.record(), self.stream)
        self.comm.allGather(self.rt.ptr(padded), self.rt.ptr(recv), padded.nbytes, self.rt.byte,
                            self.rt.stream_ptr(self.stream))
        self.rt.wait_event(self.rt.record(self.stream))
        return [recv[r][..., :n, :] for r, n in enumerate(lengths)]

    def start(self, sends, recvs, dest, source, tag=0):
        # NCCL matches point-to-point calls by their order (the same on every rank), not tags;
        # the side stream starts once the compute stream has written what is sent and
        # finished reading the buffers about to be received into
        self.rt.wait_event(self.rt.record(), self.stream)
        self.rt.group_start()
        try:
            for s, r in zip(sends, recvs):
                self.comm.send(self.rt.ptr(s), s.nbytes, self.rt.byte, dest, self.rt.stream_ptr(self.stream))
                self.comm.recv(self.rt.ptr(r), r.nbytes, self.rt.byte, source, self.rt.stream_ptr(self.stream))
        finally:
            self.rt.group_end()
        return self.rt.record(self.stream)

    def wait(self, handle):
        self.rt.wait_event(handle)        # the compute stream waits; the host does not

    def abort(self):
        self.comm.abort()


_NCCL_METHODS = ("rank_id", "size", "send", "recv", "allGather", "abort")


def _transport(comm):
    """The transport for ``comm``: mpi4py Comm, NcclCommunicator (or an object with its
    interface), or a cupyx.distributed NCCL backend (its NcclCommunicator)."""
    if type(comm).__module__.split(".")[0] == "mpi4py" and isinstance(comm, _mpi_comm_type()):
        return _MPITransport(comm)
    if type(comm).__module__.startswith("cupyx.distributed") and hasattr(comm, "_comm"):
        comm = comm._comm
    if all(callable(getattr(comm, m, None)) for m in _NCCL_METHODS):
        return _NCCLTransport(comm)
    raise TypeError(
        f"`comm` must be an mpi4py.MPI.Comm, a cupy.cuda.nccl.NcclCommunicator or a "
        f"cupyx.distributed NCCL backend; got {type(comm).__module__}.{type(comm).__name__}"
    )


# ---------------------------------------------------------------- agreement


def _agree(t, error, seqlen, signature, layout, what):
    """One collective in which every rank learns whether any rank's input was bad and the
    shard lengths; raises the same kind of error on every rank instead of leaving the
    others waiting in the ring.  Returns the global length."""
    rows = t.allgather_ints([int(error is not None), seqlen, zlib.crc32(signature.encode())])
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"{what}: the input of rank(s) {bad} is invalid (see the error there)")
    if len({row[2] for row in rows}) != 1:
        raise ValueError(f"{what}: the ranks' shards differ in batch shape, head dims, dtype or "
                         f"options (this rank: {signature})")
    lengths = [row[1] for row in rows]
    total = sum(lengths)
    expected = [sum(b - a for a, b in _ranges(total, t.size, r, layout)) for r in range(t.size)]
    if lengths != expected:
        raise ValueError(f"{what}: shard lengths {lengths} (axis -2, by rank) are not the "
                         f"{layout!r} layout of L = {total} over {t.size} ranks, {expected}; "
                         f"cut the sequence with cupyflash.distributed.shard")
    return total


def _validate(t, check, arrays, seqlens, layout, extra_sig):
    """Local checks (``check`` returns the Problem first), then the agreement; returns
    (what ``check`` returned, the global length)."""
    error, result, seqlen, sig = None, None, 0, ""
    try:
        _check_layout(layout)
        result = check()
        problem = result[0]
        kinds = {problem.kind}
        if not kinds <= set(t.kinds):
            raise TypeError("NumPy arrays need an mpi4py communicator (NCCL carries CuPy arrays)"
                            if problem.kind == "numpy" else
                            f"{problem.kind} arrays cannot travel over {t.name}")
        if len(set(seqlens)) != 1:
            raise ValueError(f"q, k and v shards must have one length on axis -2 (self-attention "
                             f"over one sequence); got {seqlens}")
        seqlen = seqlens[0]
        sig = ("|".join(str(tuple(a.shape[:-2]) + tuple(a.shape[-1:])) for a in arrays)
               + f"|{problem.dtype.name}|{problem.scale!r}|{problem.window_left}|"
               f"{problem.window_right}|{problem.gqa_ratio}|{layout}|{extra_sig}")
    except (TypeError, ValueError) as exc:
        error = exc
    total = _agree(t, error, seqlen, sig, layout, "ring attention")
    return result, total


# ---------------------------------------------------------------- pair geometry


def _band(window_left, window_right):
    """Global band of key - query offsets a row may see: (lo, hi), None = unbounded."""
    return (None if window_left is None else -window_left,
            None if window_right is None else window_right)


def _pair_slices(q_range, k_range, band):
    """Rows [r0, r1) of the query range and keys [c0, c1) of the key range that can see
    each other, and the (left, right) window that gives exactly the band on that
    sub-block with attention's bottom-right alignment; None if they see nothing.

    Global query i = qa + i', key j = ka + j'; the band lo <= j - i <= hi becomes
    lo - (ka - qa) <= j' - i' <= hi - (ka - qa).  Cut to the rows that see a key and the
    keys some row sees, the sub-block's own diagonal lies in the band, so both bounds
    are >= 0 (a negative bound has no meaning for attention).
    """
    (qa, qb), (ka, kb) = q_range, k_range
    nq, nk = qb - qa, kb - ka
    lo = None if band[0] is None else band[0] - (ka - qa)
    hi = None if band[1] is None else band[1] - (ka - qa)
    r0 = 0 if hi is None else max(0, -hi)
    r1 = nq if lo is None else min(nq, nk - lo)
    c0 = 0 if lo is None else max(0, lo)
    c1 = nk if hi is None else min(nk, nq + hi)
    if r0 >= r1 or c0 >= c1:
        return None
    diag = (c1 - c0) - (r1 - r0)          # attention's diagonal offset on the sub-block
    left = None if lo is None else diag - (lo - c0 + r0)
    right = None if hi is None else (hi - c0 + r0) - diag
    return (r0, r1), (c0, c1), (left, right)


def _pairs(q_ranges, k_ranges, band):
    """(local q rows, local k rows, window) for every sub-block of a shard pair that has work."""
    found = []
    q_off = 0
    for qr in q_ranges:
        k_off = 0
        for kr in k_ranges:
            cut = _pair_slices(qr, kr, band)
            if cut is not None:
                (r0, r1), (c0, c1), window = cut
                found.append((slice(q_off + r0, q_off + r1), slice(k_off + c0, k_off + c1), window))
            k_off += kr[1] - kr[0]
        q_off += qr[1] - qr[0]
    return found


def _array_module(kind: str):
    if kind == "numpy":
        return np
    import cupy

    return cupy


# ---------------------------------------------------------------- the ring


def _run_guarded(t, body):
    """Run ``body``; if it raises on a world of more than one rank, print the error and abort
    the job (MPI_Abort; ncclCommAbort) so that no other rank waits forever, then re-raise."""
    try:
        return body()
    except Exception:
        if t.size > 1:
            print(f"cupyflash.distributed: rank {t.rank} of {t.size} failed; aborting the ring\n"
                  + traceback.format_exc(), file=sys.stderr, flush=True)
            t.abort()
        raise


def _merge_into(out, lse, rows, o, s):
    """Merge a pair's partial (o, s) into the accumulators' rows ``rows``."""
    merged, merged_lse = merge_attention([out[..., rows, :], o], [lse[..., rows], s])
    out[..., rows, :] = merged
    lse[..., rows] = merged_lse


def _empty_like_shard(xp, a, length):
    return xp.empty(tuple(a.shape[:-2]) + (length, a.shape[-1]), dtype=a.dtype)


def ring_attention(q, k, v, /, *, comm, causal=False, window=None, scale=None, enable_gqa=False,
                   return_lse=False, layout="contiguous"):
    """Attention over a sequence split across ranks: each rank's shard of the result.

    Each rank passes its own shard of q, k and v along the length axis (-2), cut
    by ``layout`` (:func:`shard` does that).  The K/V shards travel around the
    ring of ranks: while a rank computes its queries against the shard it holds,
    the next one is already in flight (non-blocking MPI send/receive, or NCCL on
    a side stream).  Partial results stay in float32 (float64 for float64 inputs)
    and are merged by their log-sum-exp (:func:`cupyflash.merge_attention`).

    Parameters
    ----------
    q, k, v : array, shape (..., L_r, d) / (..., L_r, d) / (..., L_r, dv)
        This rank's shards (same length ``L_r`` on axis -2: self-attention of one
        sequence of global length ``L``).  NumPy (MPI only) or CuPy.
    comm : mpi4py.MPI.Comm, cupy.cuda.nccl.NcclCommunicator or cupyx.distributed backend
        The ranks; every rank of it must call with its shard.
    causal, window, scale, enable_gqa, return_lse
        As for :func:`cupyflash.attention`, applied to the whole sequence
        (``L x L``, so causal means key ``j <= i`` in global positions).
    layout : {'contiguous', 'zigzag'}, default 'contiguous'
        How the sequence is cut (module docstring).

    Returns
    -------
    out : array, shape (..., L_r, dv)
        This rank's rows of ``attention(q_full, k_full, v_full, ...)``.
    lse : array, shape (..., L_r)
        Their log-sum-exp (float32; float64 for float64 inputs).  Only if ``return_lse``.

    Raises
    ------
    TypeError
        A ``comm`` of another kind, NumPy arrays with an NCCL communicator, and
        what :func:`cupyflash.attention` raises for its arguments.
    ValueError
        Shards of different lengths, a length the layout does not give rank ``r``
        (the ranks agree on their lengths first), ranks whose shards differ in
        batch shape, head dims, dtype or options, an unknown ``layout``, and what
        :func:`cupyflash.attention` raises.  An input error on one rank is
        raised on every rank (a ValueError naming the rank elsewhere).

    See Also
    --------
    ring_attention_backward, shard, unshard, cupyflash.merge_attention

    Notes
    -----
    Work: every rank computes its queries against each K/V shard in turn; a
    pair of chunks that the causal mask or the window leaves empty is skipped,
    and a pair that is only partly visible runs on the rows and keys that see
    each other (rows that see nothing of a shard merge as zeros).  With
    ``causal`` the contiguous layout leaves rank ``n - 1`` with ``n`` times the
    work of rank 0; zigzag gives every rank the same.  Communication: ``n - 1``
    steps, each sending ``(d + dv) * L_r`` elements per batch and head; it is
    hidden when a step's transfer is shorter than its computation.  float16 and
    bfloat16 shards are computed per pair in float32 (widened copies), so that
    no partial is rounded to half precision; the result is rounded once.

    Over MPI, CuPy arrays go straight from device memory if the MPI library says
    it takes CUDA device memory (it lists ``cuda`` or ``cuda:device`` in the
    communicator's ``mpi_memory_alloc_kinds`` info, MPI 4.1); otherwise each transfer is
    staged through pinned host memory (a device-host and a host-device copy per
    step, at PCIe speed, and the host synchronises with the stream each step).

    If a rank raises inside the ring with more than one rank, it prints the
    error and aborts the job (``MPI_Abort``; ``ncclCommAbort`` for NCCL, then
    re-raises) so that no rank waits forever on a partner that has gone.

    Examples
    --------
    Run under ``mpiexec -n 4 python script.py``:

    >>> from mpi4py import MPI                                        # doctest: +SKIP
    >>> from cupyflash.distributed import ring_attention, shard      # doctest: +SKIP
    >>> q_r, k_r, v_r = (shard(x, MPI.COMM_WORLD) for x in (q, k, v))  # doctest: +SKIP
    >>> out_r = ring_attention(q_r, k_r, v_r, comm=MPI.COMM_WORLD, causal=True)  # doctest: +SKIP
    """
    t = _transport(comm)
    (problem, _), total = _validate(
        t, lambda: check_forward(q, k, v, scale=scale, causal=causal, window=window,
                                 enable_gqa=enable_gqa, backend="auto"),
        (q, k, v), [q.shape[-2], k.shape[-2], v.shape[-2]], layout, "fwd")
    return _run_guarded(t, lambda: _ring_forward(t, problem, total, layout, bool(return_lse)))


def _ring_forward(t, p, total, layout, return_lse):
    xp = _array_module(p.kind)
    acc = p.accum_dtype
    q = p.q.astype(acc, copy=False)
    band = _band(p.window_left, p.window_right)
    q_ranges = _ranges(total, t.size, t.rank, layout)
    lengths = [sum(b - a for a, b in _ranges(total, t.size, r, layout)) for r in range(t.size)]
    out = xp.zeros(p.batch_shape + (p.seqlen_q, p.head_dim_v), dtype=acc)
    lse = xp.full(p.batch_shape + (p.seqlen_q,), -np.inf, dtype=acc)
    cur = [xp.ascontiguousarray(p.k), xp.ascontiguousarray(p.v)]
    for step in range(t.size):
        src = (t.rank - step) % t.size
        pending = None
        if step < t.size - 1:
            nxt_len = lengths[(src - 1) % t.size]
            nxt = [_empty_like_shard(xp, a, nxt_len) for a in cur]
            pending = t.start(cur, nxt, (t.rank + 1) % t.size, (t.rank - 1) % t.size)
        k_ranges = _ranges(total, t.size, src, layout)
        for rows, keys, window in _pairs(q_ranges, k_ranges, band):
            o, s = attention(q[..., rows, :], cur[0][..., keys, :].astype(acc, copy=False),
                             cur[1][..., keys, :].astype(acc, copy=False), scale=p.scale,
                             window=window, enable_gqa=p.gqa_ratio > 1, return_lse=True)
            _merge_into(out, lse, rows, o, s)
        if pending is not None:
            t.wait(pending)
            cur = nxt
    out = out.astype(p.dtype, copy=False)
    return (out, lse) if return_lse else out


def ring_attention_backward(dout, q, k, v, out, lse, /, *, comm, causal=False, window=None,
                            scale=None, enable_gqa=False, layout="contiguous"):
    """Gradients of :func:`ring_attention` with respect to this rank's q, k and v shards.

    Each rank keeps its shards of q, ``out``, ``lse`` and ``dout``; the K/V
    shards travel around the ring as in the forward pass, each followed by the
    accumulators of its dK and dV, which collect every rank's contribution and
    arrive back at their owner after a full turn.  Per pair of shards,
    :func:`cupyflash.attention_backward` with this rank's rows of the *global*
    ``out`` and ``lse`` gives exactly that pair's share of the gradients.

    Parameters
    ----------
    dout : array, shape (..., L_r, dv)
        This rank's shard of the gradient with respect to ``out``.
    q, k, v : array
        This rank's shards, as passed to :func:`ring_attention`.
    out, lse : array
        What :func:`ring_attention` returned on this rank (``return_lse=True``).
    comm, causal, window, scale, enable_gqa, layout
        As passed to :func:`ring_attention`.

    Returns
    -------
    dq, dk, dv : arrays
        Shapes and dtypes of this rank's q, k and v shards.

    Raises
    ------
    TypeError, ValueError
        As :func:`ring_attention`, and as :func:`cupyflash.attention_backward`
        for ``dout``, ``out`` and ``lse``.

    See Also
    --------
    ring_attention, cupyflash.attention_backward

    Notes
    -----
    Gradients are summed in float32 (float64 for float64 inputs) and rounded
    once.  Per step a rank sends its K/V shard (started before the pair is
    computed, so it overlaps the computation) and, once the pair's dK/dV are
    added, the accumulators (which overlap the next step's computation): twice
    the forward's traffic plus one last step that brings the accumulators home.

    Examples
    --------
    Run under ``mpiexec``, after ``out, lse = ring_attention(..., return_lse=True)``:

    >>> dq, dk, dv = ring_attention_backward(dout_r, q_r, k_r, v_r, out, lse,
    ...                                      comm=MPI.COMM_WORLD, causal=True)  # doctest: +SKIP
    """
    t = _transport(comm)
    (problem, dout, out, lse), total = _validate(
        t, lambda: check_backward(dout, q, k, v, out, lse, scale=scale, causal=causal,
                                  window=window, enable_gqa=enable_gqa, backend="auto"),
        (q, k, v), [q.shape[-2], k.shape[-2], v.shape[-2]], layout, "bwd")
    return _run_guarded(t, lambda: _ring_backward(t, problem, dout, out, lse, total, layout))


def _ring_backward(t, p, dout, out, lse, total, layout):
    xp = _array_module(p.kind)
    acc = p.accum_dtype
    q, dout, out = (x.astype(acc, copy=False) for x in (p.q, dout, out))
    band = _band(p.window_left, p.window_right)
    q_ranges = _ranges(total, t.size, t.rank, layout)
    lengths = [sum(b - a for a, b in _ranges(total, t.size, r, layout)) for r in range(t.size)]
    nxt_rank, prev_rank = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    dq = xp.zeros(q.shape, dtype=acc)
    cur = [xp.ascontiguousarray(p.k), xp.ascontiguousarray(p.v)]
    grads = [xp.zeros(a.shape, dtype=acc) for a in cur]      # dK, dV of the shard in `cur`
    grads_pending = None
    for step in range(t.size):
        src = (t.rank - step) % t.size
        kv_pending = None
        if step < t.size - 1:
            nxt = [_empty_like_shard(xp, a, lengths[(src - 1) % t.size]) for a in cur]
            kv_pending = t.start(cur, nxt, nxt_rank, prev_rank)
        contributions = []
        for rows, keys, window in _pairs(q_ranges, _ranges(total, t.size, src, layout), band):
            dq_s, dk_s, dv_s = attention_backward(
                dout[..., rows, :], q[..., rows, :], cur[0][..., keys, :].astype(acc, copy=False),
                cur[1][..., keys, :].astype(acc, copy=False), out[..., rows, :], lse[..., rows],
                scale=p.scale, window=window, enable_gqa=p.gqa_ratio > 1)
            dq[..., rows, :] += dq_s
            contributions.append((keys, dk_s, dv_s))
        if grads_pending is not None:
            t.wait(grads_pending)
            grads = grads_next
        for keys, dk_s, dv_s in contributions:
            grads[0][..., keys, :] += dk_s
            grads[1][..., keys, :] += dv_s
        if t.size > 1:
            # the accumulators follow their shard; the last send brings them home
            grads_next = [_empty_like_shard(xp, a, lengths[(src - 1) % t.size]) for a in grads]
            grads_pending = t.start(grads, grads_next, nxt_rank, prev_rank, tag=2)
        if kv_pending is not None:
            t.wait(kv_pending)
            cur = nxt
    if grads_pending is not None:
        t.wait(grads_pending)
        grads = grads_next
    return dq.astype(p.dtype, copy=False), grads[0].astype(p.dtype, copy=False), \
        grads[1].astype(p.dtype, copy=False)


def _check_sharded_array(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) < 2:
        raise TypeError(f"`{name}` must be an array with at least 2 axes (..., L, d); "
                        f"got {type(x).__name__} of shape {getattr(x, 'shape', None)}")


def _xp_of(x):
    return _array_module("numpy" if isinstance(x, np.ndarray) else "cupy")


def shard(x, comm, layout="contiguous"):
    """This rank's shard of ``x`` along axis -2, cut by ``layout``.

    Parameters
    ----------
    x : array, shape (..., L, d)
        The whole sequence (the same on every rank).
    comm : mpi4py.MPI.Comm, cupy.cuda.nccl.NcclCommunicator or cupyx.distributed backend
        Gives this rank's index ``r`` and the number of ranks ``n``.
    layout : {'contiguous', 'zigzag'}, default 'contiguous'
        ``'contiguous'``: chunk ``r`` of ``n``; ``'zigzag'``: chunks ``r`` and
        ``2n - 1 - r`` of ``2n``, concatenated.  Chunks as
        :func:`numpy.array_split` cuts them.

    Returns
    -------
    array, shape (..., L_r, d)
        A view of ``x`` for 'contiguous', a new array for 'zigzag'.

    Raises
    ------
    TypeError
        ``x`` not an array of at least 2 axes, ``comm`` of another kind.
    ValueError
        An unknown ``layout``.

    See Also
    --------
    unshard, ring_attention

    Examples
    --------
    >>> from mpi4py import MPI                                   # doctest: +SKIP
    >>> q_r = shard(q, MPI.COMM_WORLD, "zigzag")                 # doctest: +SKIP
    """
    _check_sharded_array(x, "x")
    _check_layout(layout)
    t = _transport(comm)
    pieces = [x[..., a:b, :] for a, b in _ranges(x.shape[-2], t.size, t.rank, layout)]
    return pieces[0] if len(pieces) == 1 else _xp_of(x).concatenate(pieces, axis=-2)


def unshard(x, comm, layout="contiguous"):
    """The whole sequence from every rank's shard ``x`` (a collective: every rank calls it).

    Parameters
    ----------
    x : array, shape (..., L_r, d)
        This rank's shard, as :func:`shard` cut it (or as :func:`ring_attention`
        returned it; for an lse of shape (..., L_r), pass ``lse[..., None]``).
    comm, layout
        As for :func:`shard`.

    Returns
    -------
    array, shape (..., L, d)
        On every rank.

    Raises
    ------
    TypeError, ValueError
        As :func:`shard`; a ValueError if the shard lengths are not the layout's.

    See Also
    --------
    shard

    Examples
    --------
    >>> out = unshard(out_r, MPI.COMM_WORLD, "zigzag")          # doctest: +SKIP
    """
    _check_sharded_array(x, "x")
    _check_layout(layout)
    t = _transport(comm)
    parts = t.allgather_array(x)
    total = sum(part.shape[-2] for part in parts)
    xp = _xp_of(x)
    whole = xp.empty(tuple(x.shape[:-2]) + (total, x.shape[-1]), dtype=x.dtype)
    for r, part in enumerate(parts):
        ranges = _ranges(total, t.size, r, layout)
        if part.shape[-2] != sum(b - a for a, b in ranges) or part.shape[:-2] != x.shape[:-2]:
            raise ValueError(f"unshard: rank {r}'s shard has shape {tuple(part.shape)}, not the "
                             f"{layout!r} layout's {tuple(x.shape[:-2])} + "
                             f"({sum(b - a for a, b in ranges)}, ...) for L = {total}")
        offset = 0
        for a, b in ranges:
            whole[..., a:b, :] = part[..., offset:offset + b - a, :]
            offset += b - a
    return whole
