"""KV caches: attention over a paged cache, and appending to a dense or paged cache.

A paged cache holds keys as ``(num_pages, Hkv, page_size, d)`` (values likewise); a
``(B, max_pages)`` block table says where sequence ``b``'s key ``j`` lives: page
``block_table[b, j // page_size]``, slot ``j % page_size``.  Pages may appear in any
order and be shared between sequences.

The NumPy path gathers each sequence's own pages (never the whole cache) in the
task that attends over them, on the worker threads as the packed form does
(:mod:`cupyflash._varlen`).  The kernels (``cuda`` and ``emulator`` backends) read
the pages in place: one launch over every sequence, each key row looked up in the
table as its block is copied (``cuda_src/paged.cuh``), never a gathered copy.

The block table and the lengths are checked on the host before any work: on CuPy
arrays that is one small device-to-host copy of each (which waits for the device),
as for every call with lengths.
"""

from __future__ import annotations

import numpy as np

from . import _cpu
from ._params import KernelView
from ._validation import _check_lengths, array_kind, check_forward, check_output, check_precision, host_integers

__all__ = ["run_paged", "append_kv"]


def _xp(kind):
    if kind == "numpy":
        return np
    import cupy

    return cupy


def _check_table(block_table, *, kind: str, batch: int, num_pages: int, page_size: int, lengths,
                 name="block_table") -> np.ndarray:
    """The block table as a host int64 array, every page a sequence uses (its first
    ceil(length / page_size) entries) in [0, num_pages); entries past those are not read."""
    table = host_integers(block_table, name, kind=kind)
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"`{name}` must have shape (batch={batch}, max_pages); got {tuple(table.shape)}")
    capacity = table.shape[1] * page_size
    for b, n in enumerate(np.asarray(lengths).reshape(-1).tolist()):
        if n > capacity:
            raise ValueError(f"sequence {b}: {n} keys do not fit in {table.shape[1]} pages of {page_size} "
                             f"(`{name}` has {table.shape[1]} columns)")
        used = table[b, :-(-n // page_size)]
        bad = np.flatnonzero((used < 0) | (used >= num_pages))
        if bad.size:
            raise ValueError(f"`{name}`[{b}, {int(bad[0])}] = {int(used[bad[0]])} is not a page of the cache "
                             f"(0 to {num_pages - 1})")
    return table


def _gather(cache, pages, length):
    """(H, length, d): a sequence's keys (or values) from its pages, a copy of those pages only."""
    if length == 0:
        return cache[:0].reshape(cache.shape[1], 0, cache.shape[3])
    part = cache[pages]                                       # (n_pages, H, page_size, d)
    n, h, p, d = part.shape
    return part.transpose(1, 0, 2, 3).reshape(h, n * p, d)[:, :length]


def run_paged(q, k_cache, v_cache, *, block_table, kv_lengths, q_lengths, scale, causal, window, enable_gqa,
              return_lse, out, backend, precision, options=None):
    """``attention(q, k_cache, v_cache, block_table=..., kv_lengths=...)`` (``options``: the
    kernels' dispatch options; None: from the environment)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"with `block_table`, `{name}` must have 4 dimensions "
                             f"({'(B, Hq, Lq, d)' if name == 'q' else '(num_pages, Hkv, page_size, d)'}); "
                             f"got shape {getattr(x, 'shape', None)}")
    if kv_lengths is None:
        raise ValueError("`block_table` needs `kv_lengths`: how many keys each sequence has in its pages")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"`k_cache` and `v_cache` must have the same pages (num_pages, Hkv, page_size); got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, num_pages, page_size = q.shape[0], k_cache.shape[0], k_cache.shape[2]
    max_pages = block_table.shape[1] if getattr(block_table, "ndim", 0) == 2 else 0
    xp = _xp("numpy" if array_kind(k_cache, "k_cache") == "numpy" else "cupy")
    # the checks of a dense cache of max_pages * page_size keys per sequence, on stride-0
    # stand-ins for it (no copy): kinds, dtypes, head dims, GQA, lengths, options
    virtual = max_pages * page_size

    def stand_in(cache):
        return xp.broadcast_to(cache[:1, :, :1], (batch, cache.shape[1], virtual, cache.shape[3]))

    problem, _ = check_forward(q, stand_in(k_cache), stand_in(v_cache), scale=scale, causal=causal, window=window,
                               enable_gqa=enable_gqa, backend=backend, q_lengths=q_lengths, kv_lengths=kv_lengths)
    problem.precision = check_precision(precision, problem.dtype)
    lengths = problem.kv_lengths.reshape(-1) if problem.kv_lengths.ndim else np.full(batch, int(problem.kv_lengths))
    table = _check_table(block_table, kind=problem.kind, batch=batch, num_pages=num_pages, page_size=page_size,
                         lengths=lengths)
    if out is not None:
        check_output(out, "out", problem.out_shape, problem.dtype, problem.kind, (q, k_cache, v_cache))
    q_lens = (np.full(batch, problem.seqlen_q) if problem.q_lengths is None
              else np.broadcast_to(problem.q_lengths, (batch,)))
    if problem.backend != "numpy":
        return _run_paged_kernels(problem, k_cache, v_cache, block_table, table, q_lens, lengths, out, return_lse,
                                  options)
    out = np.empty(problem.out_shape, dtype=problem.dtype) if out is None else out
    lse = np.empty(problem.lse_shape, dtype=problem.accum_dtype)

    def run(b, single_thread):
        q_len, kv_len = int(q_lens[b]), int(lengths[b])
        out[b, :, q_len:] = 0
        lse[b, :, q_len:] = -np.inf
        if q_len == 0:
            return
        pages = table[b, :-(-kv_len // page_size)]
        sub = problem.on(problem.q[b, :, :q_len], _gather(k_cache, pages, kv_len), _gather(v_cache, pages, kv_len),
                         batch_shape=problem.batch_shape[1:])
        _cpu.forward(sub, out[b, :, :q_len], lse[b, :, :q_len], single_thread=single_thread)

    # longest first, so that no worker is left with the longest sequence at the end
    order = sorted(range(batch), key=lambda b: -int(lengths[b]) * max(1, int(q_lens[b])))
    for _ in _cpu.map_whole(run, order):
        pass
    return (out, lse) if return_lse else out


def _kernel_table(block_table, table: np.ndarray, kind: str):
    """The block table on the kernels' side: int32 with unit stride along the pages and
    its rows' offsets below 2^31 -- the caller's own array where it is one (no copy on
    the device), else a converted copy of the checked host table."""
    given = block_table
    if (kind == "cupy" and getattr(given, "dtype", None) == np.int32 and given.ndim == 2
            and (given.shape[1] <= 1 or given.strides[1] == 4) and given.data.ptr % 4 == 0
            and given.strides[0] % 4 == 0 and 0 <= given.strides[0] // 4 * given.shape[0] < _INT32):
        return given
    return _xp(kind).asarray(np.ascontiguousarray(table, dtype=np.int32))


def _paged_view(cache, batch: int, capacity: int):
    """A ``(num_pages, Hkv, page_size, d)`` cache as the kernels' ``(B, Hkv, capacity, d)``
    view: its page stride in the batch slot, its slot stride as the row stride (no copy;
    the kernels place every row through the block table)."""
    return KernelView(cache, (batch, cache.shape[1], capacity, cache.shape[3]), cache.strides)


# What the kernels hold in 32 bits (cuda_src/paged.cuh): a page's elements, the table's.
_INT32 = 2**31


def _run_paged_kernels(problem, k_cache, v_cache, block_table, table, q_lens, lengths, out, return_lse, options):
    """attention over a paged cache by the kernels: one launch (plus fwd_combine when the
    keys are split) over every sequence, K and V read from their pages in place."""
    from . import _dispatch, _run
    from ._options import KernelOptions

    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _dispatch._kernel_ready(cache):
            raise ValueError(f"`{name}`: the kernels read a paged cache in place, so its last axis must have unit "
                             f"stride and its elements be aligned; got strides {cache.strides} (copy it once, e.g. "
                             f"`{name} = {name}.copy()`, and keep appending to the copy)")
        itemsize = cache.itemsize
        page = abs(cache.strides[0]) // itemsize
        if page >= _INT32 or cache.shape[2] * abs(cache.strides[2]) // itemsize >= _INT32:
            raise NotImplementedError(f"`{name}`: the kernels address a page in 32 bits; a page of {page} elements "
                                      "is too large (backend='numpy' takes any)")
    batch, max_pages = table.shape
    page_size = k_cache.shape[2]
    if batch * max_pages >= _INT32 or max_pages * page_size >= _INT32:
        raise NotImplementedError(f"`block_table`: the kernels take fewer than 2^31 table entries and keys per "
                                  f"sequence; got {batch} x {max_pages} pages of {page_size} (backend='numpy' "
                                  "takes any)")
    xp = _xp(problem.kind)
    out = xp.empty(problem.out_shape, dtype=problem.dtype) if out is None else out
    lse = xp.empty(problem.lse_shape, dtype=problem.accum_dtype) if return_lse else None
    if out.size == 0 and (lse is None or lse.size == 0):
        return (out, lse) if return_lse else out
    # rows past a sequence's length belong to no CTA (and every row of a sequence
    # without keys sees none): zeros and lse = -inf, as the lengths semantics say
    target = out if _dispatch._kernel_ready(out) else xp.zeros(out.shape, dtype=out.dtype)
    target[...] = 0
    if lse is not None:
        lse[...] = -np.inf
    q = _dispatch._kernel_copy(problem.q)
    capacity = max_pages * page_size
    spans = np.stack([np.zeros(batch, np.int64), np.asarray(q_lens, np.int64), np.zeros(batch, np.int64),
                      np.asarray(lengths, np.int64)])
    paged = _run.PagedKV(_kernel_table(block_table, table, problem.kind), page_size,
                         _run.rows_aligned(k_cache, v_cache))
    _run.forward(q, _paged_view(k_cache, batch, capacity), _paged_view(v_cache, batch, capacity), target, lse,
                 scale=problem.scale, window_left=problem.window_left, window_right=problem.window_right,
                 gqa_ratio=problem.gqa_ratio, executor=_dispatch.executor_for(problem.backend),
                 options=KernelOptions.from_environment() if options is None else options,
                 precision=problem.precision, sequences=spans,
                 paged=paged)
    if target is not out:
        out[...] = target
    return (out, lse) if return_lse else out


def append_kv(k_cache, v_cache, k_new, v_new, *, kv_lengths, block_table=None):
    """Write new keys and values after each sequence's last one, in place; return the new
    lengths.

    Parameters
    ----------
    k_cache, v_cache : array
        Dense: ``(B, Hkv, Lmax, d)`` and ``(B, Hkv, Lmax, dv)``.  Paged (with
        ``block_table``): ``(num_pages, Hkv, page_size, d)`` and ``(..., dv)``.
        Written in place.
    k_new, v_new : array, shape (B, Hkv, Lnew, d) and (B, Hkv, Lnew, dv)
        The new keys and values of every sequence, of the caches' dtype.
    kv_lengths : int array, shape (B,)
        How many keys each sequence has now; the new ones go to positions
        ``kv_lengths[b] ... kv_lengths[b] + Lnew - 1``.  Not modified.
    block_table : int array, shape (B, max_pages), optional
        Where each sequence's keys live in a paged cache (see
        :func:`cupyflash.attention`).  A page shared by several sequences is
        written for all of them: copy it first where they diverge.

    Returns
    -------
    array
        ``kv_lengths + Lnew``, a new array of ``kv_lengths``'s dtype.

    Raises
    ------
    ValueError
        A sequence that would outgrow its cache (``Lmax``, or the pages its row
        of the table gives), a page index outside the cache, shapes that do
        not fit -- all before anything is written.
    TypeError
        Arrays of different kinds or dtypes.

    Notes
    -----
    On CuPy arrays the lengths (and the block table) are copied to the host
    once, which waits for the device.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> k_cache = np.zeros((2, 1, 8, 4)); v_cache = np.zeros((2, 1, 8, 4))
    >>> lengths = np.array([3, 0])
    >>> new = np.ones((2, 1, 2, 4))
    >>> cupyflash.append_kv(k_cache, v_cache, new, new, kv_lengths=lengths)
    array([5, 2])
    >>> k_cache[0, 0, :, 0], k_cache[1, 0, :, 0]
    (array([0., 0., 0., 1., 1., 0., 0., 0.]), array([1., 1., 0., 0., 0., 0., 0., 0.]))
    """
    names = (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new))
    kinds = {name: array_kind(x, name) for name, x in names}
    if len(set(kinds.values())) > 1 or "cuda-foreign" in kinds.values():
        raise TypeError(f"`k_cache`, `v_cache`, `k_new` and `v_new` must be all NumPy or all CuPy arrays; got {kinds}")
    kind = kinds["k_cache"]
    for name, x in names:
        if x.ndim != 4:
            raise ValueError(f"`{name}` must have 4 dimensions; got shape {tuple(x.shape)}")
    dtypes = {name: np.dtype(x.dtype) for name, x in names}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"the caches and the new keys and values must have one dtype; got "
                        f"{ {n: d.name for n, d in dtypes.items()} }")
    if k_new.shape[:3] != v_new.shape[:3]:
        raise ValueError(f"`k_new` and `v_new` must have the same (B, Hkv, Lnew); got {tuple(k_new.shape)} and "
                         f"{tuple(v_new.shape)}")
    if (k_cache.shape[1], k_cache.shape[3]) != (k_new.shape[1], k_new.shape[3]) or \
            (v_cache.shape[1], v_cache.shape[3]) != (v_new.shape[1], v_new.shape[3]) or \
            k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"the new keys and values must have the caches' heads and head dims: k_cache "
                         f"{tuple(k_cache.shape)}, k_new {tuple(k_new.shape)}, v_cache {tuple(v_cache.shape)}, "
                         f"v_new {tuple(v_new.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if kind == "numpy" and not x.flags.writeable:
            raise ValueError(f"`{name}` is read-only")
    batch, new = k_new.shape[0], k_new.shape[2]
    dense = block_table is None
    capacity = k_cache.shape[2] if dense else None
    if dense and k_cache.shape[0] != batch:
        raise ValueError(f"a dense cache has one row per sequence: `k_cache` {tuple(k_cache.shape)} against "
                         f"{batch} sequences in `k_new`")
    lengths = _check_lengths(kv_lengths, "kv_lengths", kind=kind, shape=(batch,), limit=np.iinfo(np.int64).max)
    if dense:
        over = np.flatnonzero(lengths + new > capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(f"sequence {b}: {int(lengths[b])} + {new} keys do not fit in the cache's {capacity}")
        table = None
    else:
        table = _check_table(block_table, kind=kind, batch=batch, num_pages=k_cache.shape[0],
                             page_size=k_cache.shape[2], lengths=lengths + new)
    # everything is checked: now write
    for b in range(batch):
        start = int(lengths[b])
        if dense:
            k_cache[b, :, start:start + new] = k_new[b]
            v_cache[b, :, start:start + new] = v_new[b]
        elif new:
            positions = np.arange(start, start + new)
            pages = table[b, positions // k_cache.shape[2]]
            slots = positions % k_cache.shape[2]
            xp = _xp(kind)
            pages, slots = (xp.asarray(x) for x in (pages, slots))
            # advanced indices on axes 0 and 2: the result's first axis is the position
            k_cache[pages, :, slots] = k_new[b].swapaxes(0, 1)
            v_cache[pages, :, slots] = v_new[b].swapaxes(0, 1)
    result = lengths + new
    dtype = np.dtype(getattr(kv_lengths, "dtype", np.int64))
    if kind == "cupy" and hasattr(kv_lengths, "dtype"):
        import cupy

        return cupy.asarray(result.astype(dtype))
    return result.astype(dtype)
