"""The CPU path: blocked FlashAttention forward and backward in NumPy.

The forward is the online-softmax recurrence of FlashAttention's Algorithm 1,
organised as FlashAttention-2 does (each block of query rows streams over the
key/value blocks), with BLAS for the block products.  No Lq x Lk array is ever
formed: besides the output, the extra memory per (batch, head) is the query
block's accumulator and one score block, sized by :func:`_block_sizes`.

Batch dims are handled by NumPy broadcasting: trailing batch dims (the heads,
and the query-group axis under GQA) are vectorised in each BLAS call, leading
ones are looped over.  Grouped-query attention splits q's head axis into
(kv_heads, group) and gives k/v a size-1 group axis, after which GQA is plain
broadcasting.

The work is split into tasks that run on the worker threads of
:mod:`cupyflash._threads` with BLAS held to one thread: in the forward one
task per (leading batch index, query block), each writing its own rows of the
output; in the backward one per (leading batch index, key block), each
returning its key block's dK, dV and a partial dQ over the query rows it
touches, which the calling thread adds up in task order.  Block sizes depend
on the problem only, never on the thread count, so the results are
bit-identical whatever the number of threads.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from . import _threads
from ._validation import Problem

__all__ = ["forward", "backward", "block_bounds"]

# Elements of one score block (all vectorised heads together): 2**18 float32 is
# 1 MiB, a core's L2 cache on current x86 server parts, so that the passes over
# the block (max, exp, the P V product) read it from cache.
_SCORE_BLOCK_ELEMENTS = 1 << 18
_MAX_KEY_BLOCK = 512
# Query rows per block at least (BLAS is inefficient on thinner products and the
# per-block Python overhead grows), even where the score block then outgrows L2.
_MIN_QUERY_BLOCK = 64
# Below this many multiply-adds a call runs in the calling thread: handing tasks
# to the pool costs some tens of microseconds.
_MIN_PARALLEL_WORK = 1 << 22


def _block_sizes(n_vec: int, seqlen_q: int, seqlen_k: int, masked: bool,
                 band: int | None = None) -> tuple[int, int]:
    """Query and key block sizes so that one score block stays within budget.

    Under a causal or window mask the query block is no taller than the key
    block is wide, so that blocks entirely outside the band are skipped
    (a causal square problem then computes about half of the blocks), and key
    blocks are at most an eighth of the keys (at least 128).  A window of
    ``band`` keys narrower than the default key block gets query blocks of
    ``bq`` rows and key blocks of the ``bq + band - 1`` keys such a block sees:
    the forward starts its key blocks at the query block's first key, so that
    each query block meets one key block (a 256-row band loop's work).
    Never depends on the thread count.
    """
    if band is not None and band < _MAX_KEY_BLOCK:
        bq = max(_MIN_QUERY_BLOCK, (_MAX_KEY_BLOCK - band + 1) // 64 * 64)
        bq = max(1, min(seqlen_q, bq))
        return bq, max(1, min(seqlen_k, bq + band - 1))
    bc = max(1, min(_MAX_KEY_BLOCK, seqlen_k))
    if masked:
        # the blocks across the diagonal are computed whole and half masked: keep them
        # to about an eighth of the keys (L = 1024 causal: 128-key blocks)
        bc = min(bc, max(128, seqlen_k // 8 // 64 * 64))
    bq = _SCORE_BLOCK_ELEMENTS // (bc * max(n_vec, 1))
    bq = max(1, min(seqlen_q, max(bq, _MIN_QUERY_BLOCK)))
    if masked:
        bq = min(bq, bc)
    return bq, bc


# Query rows a block of all the vectorised heads must still have; with more heads
# than fit, the heads are looped over (each its own tasks) instead: 16 heads of 64
# rows make sixteen 64 x d x 512 products, slower than one head's 512-row product.
_WIDE_QUERY_BLOCK = 256


def _vector_dims(problem: Problem, batch5: tuple) -> int:
    """How many trailing batch dims each BLAS call covers.

    All the heads (and under GQA the group axis) while a block of all of them
    keeps ``_WIDE_QUERY_BLOCK`` query rows within the score budget; otherwise
    the heads are looped over (under GQA the kv heads; the group axis stays
    vectorised).
    """
    n_max = 2 if problem.gqa_ratio > 1 else 1
    heads = int(np.prod(batch5[len(batch5) - n_max:]))
    masked = problem.window_left is not None or problem.window_right is not None
    _, bc = _block_sizes(1, problem.seqlen_q, problem.seqlen_k, masked, _band(problem))
    return n_max if heads * _WIDE_QUERY_BLOCK * bc <= _SCORE_BLOCK_ELEMENTS else n_max - 1


def _band(problem: Problem) -> int | None:
    """Keys a query row may see under a window bounded on both sides, else None."""
    if problem.window_left is None or problem.window_right is None:
        return None
    return problem.window_left + problem.window_right + 1


def _workers(problem: Problem, single_thread: bool = False) -> tuple[int, object]:
    """Threads for this call and the context to run it in (``single_thread``: the calling
    thread alone, BLAS as it is -- a caller that runs several problems on the workers).

    A problem too small to repay the pool runs in the calling thread with BLAS
    as the caller set it (BLAS does not split products this small anyway); a
    larger one runs its tasks with BLAS held to one thread, whatever the
    number of workers, so that its results do not depend on that number.
    """
    if single_thread:
        return 1, contextlib.nullcontext()
    n_batch = int(np.prod(problem.batch_shape, dtype=np.int64))
    work = n_batch * problem.seqlen_q * problem.seqlen_k * (problem.head_dim + problem.head_dim_v)
    n = _threads.num_threads()      # reads (and checks) CUPYFLASH_NUM_THREADS every call
    if work < _MIN_PARALLEL_WORK:
        return 1, contextlib.nullcontext()
    return n, _threads.single_threaded_blas()


def block_bounds(i0, i1, j0, j1, offset, left, right):
    """Classify the score block rows [i0, i1) x keys [j0, j1) under the mask.

    Query i sees key j iff ``offset - left <= j - i <= offset + right`` with
    ``offset = Lk - Lq`` (bottom-right aligned) and None meaning unbounded.
    Returns ``"empty"`` (every entry masked), ``"full"`` (none masked) or
    ``"partial"``.
    """
    lo_first = -np.inf if left is None else i0 + offset - left       # first row's lowest key
    lo_last = -np.inf if left is None else (i1 - 1) + offset - left
    hi_first = np.inf if right is None else i0 + offset + right
    hi_last = np.inf if right is None else (i1 - 1) + offset + right  # last row's highest key
    if hi_last < j0 or lo_first > j1 - 1:
        return "empty"
    if lo_last <= j0 and hi_first >= j1 - 1:
        return "full"
    return "partial"


def _visible(i0, i1, j0, j1, offset, left, right):
    """Boolean (i1-i0, j1-j0) mask of admissible (query, key) pairs (read-only)."""
    return _band_mask(i1 - i0, j1 - j0, j0 - i0 - offset, left, right)


def _hidden(i0, i1, j0, j1, offset, left, right):
    """``~_visible(...)`` (read-only)."""
    return _band_mask(i1 - i0, j1 - j0, j0 - i0 - offset, left, right, negate=True)


@functools.lru_cache(maxsize=16)
def _band_mask(rows, cols, shift, left, right, negate=False):
    """Mask of rows x cols with key - query - offset = shift + col - row in [-left, right].

    Blocks along a band or a diagonal repeat the same few masks: cached (the
    cache is thread-safe; the arrays are read-only).
    """
    # Compare a key row against a query column: only boolean (rows, cols) arrays
    # are formed, never an int64 one twice the size of the float32 score block.
    keys = np.arange(shift, shift + cols)[None, :]
    diagonal = np.arange(rows)[:, None]
    ok = np.ones((rows, cols), dtype=bool)
    if left is not None:
        ok &= keys >= diagonal - left
    if right is not None:
        ok &= keys <= diagonal + right
    if negate:
        ok = ~ok
    ok.flags.writeable = False
    return ok


def _split_heads(problem: Problem, arrays_q, arrays_kv):
    """Views with a common ndim; under GQA q-like arrays get (kv_heads, group) axes."""
    g = problem.gqa_ratio
    ndim = len(problem.batch_shape) + 2

    def lift(x):
        return x.reshape((1,) * (ndim - x.ndim) + x.shape)

    qs = [lift(x) for x in arrays_q]
    kvs = [lift(x) for x in arrays_kv]
    if g > 1:
        def split(x):
            return x.reshape(x.shape[:-3] + (x.shape[-3] // g, g) + x.shape[-2:])

        qs = [split(x) for x in qs]
        kvs = [x[..., None, :, :] for x in kvs]
    return qs, kvs


def _scores_view(problem: Problem, x):
    """A bias term or the mask (broadcastable to ``batch_shape + (Lq, Lk)``) viewed with
    q's split axes: lifted to the full number of dims, and under GQA its head axis (of
    size Hq or 1) split into (kv_heads, group) or (1, 1).  A view, never a copy."""
    ndim = len(problem.batch_shape) + 2
    x = x.reshape((1,) * (ndim - x.ndim) + x.shape)
    g = problem.gqa_ratio
    if g > 1:
        h = x.shape[-3]
        x = x.reshape(x.shape[:-3] + ((h // g, g) if h != 1 else (1, 1)) + x.shape[-2:])
    return x


def _coordinates(problem: Problem):
    """The score modifications' per-head operands, scores-shaped views like a bias term's
    (``_scores_view``): the flat batch index ``b`` (over the dims before the head axis),
    the query head ``h`` and the ALiBi slopes (None without them)."""
    return tuple(None if x is None else _scores_view(problem, x.reshape(tuple(x.shape) + (1, 1)))
                 for x in problem.mods.coordinates(problem.batch_shape))


def _terms_of(problem: Problem, idx, bias5, mask5, coords5, acc_t, offset) -> "_ScoreTerms":
    """The score terms of batch index ``idx``."""
    coords = (None, None, None) if coords5 is None else tuple(
        None if c is None else _index_into(c, idx) for c in coords5)
    return _ScoreTerms([_index_into(b, idx) for b in bias5], None if mask5 is None else _index_into(mask5, idx),
                       acc_t, problem.mods, coords, offset)


def _block_of(x, i0, i1, j0, j1):
    """Rows [i0, i1) x keys [j0, j1) of a scores-shaped operand, whose query or key axis
    may have size 1 (broadcast): that axis's one entry then serves every row or key."""
    rows = slice(0, 1) if x.shape[-2] == 1 else slice(i0, i1)
    keys = slice(0, 1) if x.shape[-1] == 1 else slice(j0, j1)
    return x[..., rows, keys]


class _ScoreTerms:
    """The bias terms, the boolean mask and the score modifications of one batch index,
    for the score blocks.

    DESIGN 3b's order: the scaled scores, the softcap, plus each bias term in order
    (read in the accumulator type) and ALiBi, score_mod, then the window, the mask
    and mask_mod.  Each operand keeps its size-1 (broadcast) axes: a block of it is a
    view that NumPy broadcasts.  ``mods`` (cupyflash._mods.ScoreFunctions) reads the
    index's ``coords`` -- its flat batch index, head and ALiBi slope views -- and
    ``offset`` = kv_len - q_len (ALiBi's diagonal).
    """

    def __init__(self, bias, mask, acc_t, mods=None, coords=(None, None, None), offset=0):
        self.bias = bias            # arrays (*vec, Lq, Lk) (size-1 axes where broadcast)
        self.mask = mask            # bool array or None
        self.acc_t = acc_t
        self.mods = mods or None
        self.coords = coords
        self.offset = offset

    def __bool__(self):
        return bool(self.bias) or self.mask is not None or self.mods is not None

    def transform(self, s, i0, i1, j0, j1, grad=False):
        """The block's scaled scores ``s`` -> its scores before the masks, in place.  With
        ``grad``: the chain rule's factors ``(d_cap, d_mod)`` (None: 1), see
        :meth:`cupyflash._mods.ScoreFunctions.transform`."""
        blocks = [_block_of(b, i0, i1, j0, j1) for b in self.bias]
        if self.mods is None:
            for b in blocks:
                s += b.astype(self.acc_t, copy=False)
            return None, None
        return self.mods.transform(s, self.coords, np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :],
                                   self.offset, blocks, grad)

    def hidden(self, i0, i1, j0, j1):
        """Where the mask or mask_mod hides a pair of the block (None: neither)."""
        hidden = None if self.mask is None else ~_block_of(self.mask, i0, i1, j0, j1)
        if self.mods is not None and self.mods.mask_mod is not None:
            out = ~self.mods.admits(self.coords, np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :], self.acc_t)
            hidden = out if hidden is None else hidden | out
        return hidden

    def sees_none(self, i0, i1, j0, j1) -> bool:
        """Whether the mask and mask_mod hide the whole block (then it is skipped)."""
        return _hides_all(self.hidden(i0, i1, j0, j1))


def _hides_all(hidden) -> bool:
    """Whether ``hidden`` (a block's hidden pairs, None: none) hides every pair."""
    return hidden is not None and bool(hidden.all())


_NO_TERMS = _ScoreTerms((), None, None)


def _lengths_of(problem: Problem, idx) -> tuple[int, int]:
    """(q_len, kv_len) of the sequence of batch index ``idx`` (the looped dims, which start
    with the sequence dims: lengths are per sequence, never per head)."""
    return problem.lengths_of(idx[:len(problem.sequence_shape)])


def map_whole(fn, items):
    """``fn(item, single_thread)`` for each of ``items`` (whole problems: the sequences of a
    packed or paged batch), results in the items' order.  With at least twice as many
    items as workers, each runs whole in one worker (BLAS held to one thread, and
    ``single_thread`` True); otherwise one after the other, each with the workers inside.
    Either way each item is computed as it would be alone."""
    workers = _threads.num_threads()
    fan = workers if len(items) >= 2 * workers > 2 else 1
    with _threads.single_threaded_blas() if fan > 1 else contextlib.nullcontext():
        yield from _threads.ordered_map(lambda item: fn(item, fan > 1), items, fan)


def _lse_view(problem: Problem, lse):
    """lse (..., Lq) viewed like an out array without its last axis."""
    g = problem.gqa_ratio
    ndim = len(problem.batch_shape) + 1
    lse = lse.reshape((1,) * (ndim - lse.ndim) + lse.shape)
    if g > 1:
        lse = lse.reshape(lse.shape[:-2] + (lse.shape[-2] // g, g) + lse.shape[-1:])
    return lse


def _loop_shape(shape5, n_vec_dims):
    return shape5[: len(shape5) - n_vec_dims]


def _index_into(x, idx):
    """x[idx] where x may have size-1 (broadcast) axes among the looped ones."""
    return x[tuple(0 if x.shape[a] == 1 else i for a, i in enumerate(idx))]


def _with_ones(vf):
    """``vf`` with a column of ones appended (from 8 columns on zero-padded to a
    multiple of 8, which BLAS handles at full speed), so that P @ result gives
    P V and P's row sums in one product instead of a product and a reduction
    pass over P."""
    dv = vf.shape[-1]
    width = dv + 1 if dv < 8 else -(-(dv + 1) // 8) * 8      # narrow values stay narrow
    ext = np.zeros(vf.shape[:-1] + (width,), dtype=vf.dtype)
    ext[..., :dv] = vf
    ext[..., dv] = 1
    return ext


# Row sums of one block's weights, taken against the running max, above which
# the block is redone against its own max (weights this large are still far
# from float32's range, and the P V products with them).
_LAZY_LIMIT = 2.0**32


def _scores(qf, kf, j0, j1, i0, i1, kind, rows, out, mask_args, terms, hidden=None):
    """The scores of key block [j0, j1) as a ``rows + (j1 - j0,)`` array: the (already
    scaled) products plus the bias terms, -inf where the window or the mask hides a pair
    (``hidden``: the terms' hidden pairs of the block, as ``terms.hidden`` gives them);
    into ``out`` when given (a full block)."""
    kt = np.swapaxes(kf[..., j0:j1, :], -1, -2)
    if out is not None:
        s = np.matmul(qf, kt, out=out)
    else:   # the tail block, or q and k both broadcast along a vectorised axis
        s = np.matmul(qf, kt)
        if s.shape[:-1] != rows:
            s = np.broadcast_to(s, rows + (j1 - j0,)).copy()
    if terms:
        terms.transform(s, i0, i1, j0, j1)
        if hidden is not None:
            np.copyto(s, -np.inf, where=hidden)
    if kind == "partial":
        np.copyto(s, -np.inf, where=_hidden(i0, i1, j0, j1, *mask_args))
    return s


def _query_block(qf, kf, vf_ones, dv, i0, i1, vec_shape, bc, mask_args, acc_t, terms=_NO_TERMS):
    """Online softmax over the key blocks for query rows [i0, i1).

    ``qf`` holds the already scaled rows, ``vf_ones`` the ``dv`` value columns
    followed by a column of ones (``_with_ones``).  Returns the normalised output
    rows and their lse (float, -inf for rows that saw no key).
    """
    lk = kf.shape[-2]
    rows = vec_shape + (i1 - i0,)
    m = np.full(rows, -np.inf, dtype=acc_t)                    # running row max
    l = np.zeros(rows, dtype=acc_t)                            # running row sum of exp
    acc = np.zeros(rows + (dv,), dtype=acc_t)                  # unnormalised output
    # One score buffer and one P.V buffer serve every full key block: fresh
    # multi-MiB temporaries per block cost page faults on every call.
    s_full = np.empty(rows + (bc,), dtype=acc_t)
    pv = np.empty(rows + (vf_ones.shape[-1],), dtype=acc_t)
    direct = np.broadcast_shapes(qf.shape[:-2], kf.shape[:-2]) == vec_shape
    offset, left, right = mask_args
    first, stop = 0, lk
    if left is not None:
        # a window bounded on the left: key blocks start at the block's first key and
        # stop after its last one, so that a narrow band is one or two key blocks
        first = min(max(0, i0 + offset - left), lk)
        if right is not None:
            stop = max(first, min(lk, i1 - 1 + offset + right + 1))
    for j0 in range(first, stop, bc):
        j1 = min(j0 + bc, stop)
        kind = block_bounds(i0, i1, j0, j1, *mask_args)
        if kind == "empty":
            continue
        hidden = terms.hidden(i0, i1, j0, j1) if terms else None   # once per block: mask_mod evaluates
        if _hides_all(hidden):
            continue
        out = s_full if direct and j1 - j0 == bc else None
        s = _scores(qf, kf, j0, j1, i0, i1, kind, rows, out, mask_args, terms, hidden)
        if not np.isneginf(m).any():
            # Every row has a finite running max: exponentiate against it and skip
            # this block's max pass.  Kept unless a row's new weights sum past
            # 2^32 (or are not finite): then the block is redone against its max.
            with np.errstate(over="ignore", invalid="ignore"):
                s -= m[..., None]
                p = np.exp(s, out=s)
                pv_block = np.matmul(p, vf_ones[..., j0:j1, :], out=pv)
            if np.all(pv_block[..., dv] <= _LAZY_LIMIT):            # False for NaN
                l += pv_block[..., dv]
                acc += pv_block[..., :dv]
                continue
            s = _scores(qf, kf, j0, j1, i0, i1, kind, rows, out, mask_args, terms, hidden)
        m_new = np.maximum(m, s.max(axis=-1))
        m_safe = np.where(np.isneginf(m_new), 0, m_new)       # rows with no key yet
        s -= m_safe[..., None]
        p = np.exp(s, out=s)
        alpha = np.exp(m - m_safe)
        pv_block = np.matmul(p, vf_ones[..., j0:j1, :], out=pv)
        l *= alpha
        l += pv_block[..., dv]                                  # the ones column: rowsum(P)
        acc *= alpha[..., None]
        acc += pv_block[..., :dv]
        m = m_new
    empty = l == 0                                              # rows that saw no key
    acc *= np.where(empty, 0, 1 / np.where(empty, 1, l))[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(l))
    return acc, lse


def forward(problem: Problem, out, lse, single_thread: bool = False) -> None:
    """Fill ``out`` (..., Lq, dv) and, if given, ``lse`` (..., Lq) in place."""
    acc_t = problem.accum_dtype
    lq, lk = problem.seqlen_q, problem.seqlen_k
    left, right = problem.window_left, problem.window_right
    (q, o), (k, v) = _split_heads(problem, [problem.q, out], [problem.k, problem.v])
    bias5 = [_scores_view(problem, b) for b in problem.bias]
    mask5 = None if problem.mask is None else _scores_view(problem, problem.mask)
    coords5 = _coordinates(problem) if problem.mods else None
    lse5 = _lse_view(problem, lse) if lse is not None else None
    batch5 = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_vec = _vector_dims(problem, batch5)
    vec_shape = batch5[len(batch5) - n_vec:]
    masked = problem.window_left is not None or problem.window_right is not None
    bq, bc = _block_sizes(int(np.prod(vec_shape)), lq, lk, masked, _band(problem))
    scale = acc_t.type(problem.scale)
    dv = v.shape[-1]

    def tasks():
        # k and v in the accumulator type (v with its ones column) once per batch index,
        # here in the calling thread, shared by that index's query-block tasks.  With
        # lengths, only the sequence's own rows and keys are read (the padding, whatever it
        # holds, never is), its padded rows are written here, and the window is aligned to
        # its own lengths.
        for idx in np.ndindex(*_loop_shape(batch5, n_vec)):
            q_len, kv_len = _lengths_of(problem, idx)
            if q_len < lq:
                o[idx][..., q_len:, :] = 0
                if lse5 is not None:
                    lse5[idx][..., q_len:] = -np.inf
            if q_len == 0:
                continue
            kf = _index_into(k, idx)[..., :kv_len, :].astype(acc_t, copy=False)
            vf_ones = _with_ones(_index_into(v, idx)[..., :kv_len, :].astype(acc_t, copy=False))
            terms = _terms_of(problem, idx, bias5, mask5, coords5, acc_t, kv_len - q_len)
            mask_args = (kv_len - q_len, left, right)
            for i0 in range(0, q_len, bq):
                yield idx, kf, vf_ones, terms, mask_args, i0, min(i0 + bq, q_len)

    def run(task):
        idx, kf, vf_ones, terms, mask_args, i0, i1 = task
        qf = _index_into(q, idx)[..., i0:i1, :].astype(acc_t)
        qf *= scale                                             # scale folded into q once
        rows, rows_lse = _query_block(qf, kf, vf_ones, dv, i0, i1, vec_shape, bc, mask_args, acc_t,
                                      terms)
        o[idx][..., i0:i1, :] = rows                            # each task its own rows
        if lse5 is not None:
            lse5[idx][..., i0:i1] = rows_lse

    workers, blas = _workers(problem, single_thread)
    with blas:
        for _ in _threads.ordered_map(run, tasks(), workers):
            pass


def _sum_to(x, shape):
    """Sum x over the axes that broadcasting expanded from ``shape``."""
    axes = tuple(a for a, (n, s) in enumerate(zip(x.shape, shape)) if s == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


class _BackwardBuffers:
    """Reusable outputs for the backward's block products, one per role and shape.

    The products of full blocks all have the same few shapes; fresh multi-MiB
    temporaries for each would be mapped and faulted in again on every block.
    ``matmul(role, a, b)`` returns ``a @ b``, broadcast to the vectorised axes
    ``lead`` (so that the in-place updates that follow never need a larger
    array), in the role's buffer, valid until that role's next product.
    """

    def __init__(self, dtype, lead: tuple):
        self.dtype = dtype
        self.lead = lead          # the vectorised axes: every product is computed at full size
        self._bufs: dict[tuple, np.ndarray] = {}

    def matmul(self, role: str, a, b):
        shape = (np.broadcast_shapes(self.lead, a.shape[:-2], b.shape[:-2])
                 + (a.shape[-2], b.shape[-1]))
        buf = self._bufs.get((role, shape))
        if buf is None:
            buf = self._bufs[(role, shape)] = np.empty(shape, dtype=self.dtype)
        return np.matmul(a, b, out=buf)


def backward(problem: Problem, dout, out, lse, single_thread: bool = False):
    """Return (dq, dk, dv) with the shapes and dtypes of q, k, v; with a bias, also dbias
    (an array, or a tuple like the caller's ``bias``).

    dbias is dS summed over each term's broadcast axes: within a task over the
    vectorised axes (one NumPy reduction), and over the looped batch indices in
    task order -- by the calling thread, unless the term is broadcast along no
    looped axis, when each task writes its own key block's columns in place.
    Either way the order is fixed, whatever the number of threads.
    """
    acc_t = problem.accum_dtype
    lq, lk = problem.seqlen_q, problem.seqlen_k
    left, right = problem.window_left, problem.window_right
    scale = acc_t.type(problem.scale)
    (q, do, o), (k, v) = _split_heads(problem, [problem.q, dout, out], [problem.k, problem.v])
    lse5 = _lse_view(problem, lse)
    batch5 = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_vec = _vector_dims(problem, batch5)
    vec_shape = batch5[len(batch5) - n_vec:]
    masked = problem.window_left is not None or problem.window_right is not None
    bq, bc = _block_sizes(int(np.prod(vec_shape)), lq, lk, masked, _band(problem))
    bias5 = [_scores_view(problem, b) for b in problem.bias]
    mask5 = None if problem.mask is None else _scores_view(problem, problem.mask)
    coords5 = _coordinates(problem) if problem.mods else None
    loop_shape = _loop_shape(batch5, n_vec)
    # dbias in the accumulator type, with each term's (split) shape.  A term broadcast
    # along no looped axis and not along the keys is added to by the tasks in place: each
    # task owns its key block's columns (its query blocks add to them one after another)
    dbias = [np.zeros(b.shape, dtype=acc_t) for b in bias5]
    in_place = [all(b.shape[a] != 1 or n == 1 for a, n in enumerate(loop_shape))
                and (b.shape[-1] != 1 or lk <= 1) for b in bias5]

    def tasks():
        # per batch index, in the calling thread: the scaled q, the operands in the
        # accumulator type, D and lse, shared by that index's key-block tasks.  With
        # lengths, only the sequence's own rows (of q, dout, out, lse) and keys are read.
        for idx in np.ndindex(*_loop_shape(batch5, n_vec)):
            q_len, kv_len = _lengths_of(problem, idx)
            if q_len == 0 or kv_len == 0:
                continue                                        # zero gradients
            qf = _index_into(q, idx)[..., :q_len, :].astype(acc_t)
            qf *= scale      # dK = scale dS^T Q = dS^T (scale Q), and S = (scale Q) K^T
            dof = _index_into(do, idx)[..., :q_len, :].astype(acc_t, copy=False)
            # D_i = rowsum(dO_i * O_i): the softmax Jacobian's correction term.
            delta = np.einsum("...d,...d->...", dof,
                              _index_into(o, idx)[..., :q_len, :].astype(acc_t, copy=False))
            lse_i = _index_into(lse5, idx)[..., :q_len].astype(acc_t, copy=False)
            lse_i = np.where(np.isneginf(lse_i), np.inf, lse_i)   # rows with no key: p = 0
            ops = (qf, _index_into(k, idx)[..., :kv_len, :].astype(acc_t, copy=False),
                   _index_into(v, idx)[..., :kv_len, :].astype(acc_t, copy=False), dof, delta, lse_i,
                   _terms_of(problem, idx, bias5, mask5, coords5, acc_t, kv_len - q_len),
                   kv_len - q_len)
            for j0 in range(0, kv_len, bc):
                yield idx, ops, j0, min(j0 + bc, kv_len)

    def run(task):
        idx, (qf, kf, vf, dof, delta, lse_i, terms, offset), j0, j1 = task
        q_len = qf.shape[-2]
        kj, vj = kf[..., j0:j1, :], vf[..., j0:j1, :]
        kjt, vjt = np.swapaxes(kj, -1, -2), np.swapaxes(vj, -1, -2)
        blocks = [(i0, min(i0 + bq, q_len)) for i0 in range(0, q_len, bq)]
        kinds = [block_bounds(i0, i1, j0, j1, offset, left, right) for i0, i1 in blocks]
        live = [(i0, i1, kind) for (i0, i1), kind in zip(blocks, kinds)
                if kind != "empty" and not terms.sees_none(i0, i1, j0, j1)]
        if not live:
            return idx, j0, j1, None, None, 0, None, None
        rows0, rows1 = live[0][0], live[-1][1]           # the query rows this key block meets
        bufs = _BackwardBuffers(acc_t, vec_shape)
        dk_j = np.zeros(vec_shape + kj.shape[-2:], dtype=acc_t)
        dv_j = np.zeros(vec_shape + vj.shape[-2:], dtype=acc_t)
        dq_part = np.zeros(vec_shape + (rows1 - rows0, qf.shape[-1]), dtype=acc_t)
        # dbias of the terms summed by the calling thread: this task's rows x keys
        db_parts = [None if direct else np.zeros(
                        b.shape[:-2] + (1 if b.shape[-2] == 1 else rows1 - rows0, 1 if b.shape[-1] == 1 else j1 - j0),
                        dtype=acc_t)
                    for b, direct in zip(terms.bias, in_place)]
        for i0, i1, kind in live:
            qi, doi = qf[..., i0:i1, :], dof[..., i0:i1, :]
            p = bufs.matmul("s", qi, kjt)                       # scaled scores
            d_cap = d_mod = None                                # the chain rule's factors
            if terms:
                d_cap, d_mod = terms.transform(p, i0, i1, j0, j1, grad=True)
            p -= lse_i[..., i0:i1, None]
            np.exp(p, out=p)
            # hidden pairs -> P = 0 by a select: a NaN or inf bias there never reaches a gradient
            if kind == "partial":
                np.copyto(p, 0, where=_hidden(i0, i1, j0, j1, offset, left, right))
            hidden = terms.hidden(i0, i1, j0, j1)
            if hidden is not None:
                np.copyto(p, 0, where=hidden)
            dv_j += bufs.matmul("kv", np.swapaxes(p, -1, -2), doi)
            ds = bufs.matmul("dp", doi, vjt)
            ds -= delta[..., i0:i1, None]
            ds *= p                                             # dS = P o (dP - D)
            if d_mod is not None:       # through score_mod; a hidden or zero P stays 0 (even if d_mod is not finite)
                with np.errstate(invalid="ignore"):
                    ds *= d_mod
                np.copyto(ds, 0, where=p == 0)
            for t, b in enumerate(terms.bias):                  # dbias = dS over b's broadcast axes
                part = _sum_to(ds, _block_of(b, i0, i1, j0, j1).shape)
                if in_place[t]:
                    _block_of(_index_into(dbias[t], idx), i0, i1, j0, j1)[...] += part
                else:
                    _block_of(db_parts[t], i0 - rows0, i1 - rows0, 0, j1 - j0)[...] += part
            if d_cap is not None:                               # through the softcap: dq, dk only
                ds *= d_cap
            dk_j += bufs.matmul("kv", np.swapaxes(ds, -1, -2), qi)
            dq_part[..., i0 - rows0:i1 - rows0, :] += bufs.matmul("q", ds, kj)
        return idx, j0, j1, dk_j, dv_j, rows0, dq_part, db_parts

    dq = np.zeros(q.shape, dtype=acc_t)
    dk = np.zeros(k.shape, dtype=acc_t)
    dv = np.zeros(v.shape, dtype=acc_t)
    grads = None                                # (idx, dq_i, dk_i, dv_i) of the current index

    def finish_index():
        idx, dq_i, dk_i, dv_i = grads
        dq_i *= scale                                           # dQ = scale dS K, once
        _accumulate(dq, idx, dq_i)
        _accumulate(dk, idx, dk_i)
        _accumulate(dv, idx, dv_i)

    workers, blas = _workers(problem, single_thread)
    with blas:
        # results come in task order: the partial dQs are summed in the same order
        # whatever the number of threads
        for idx, j0, j1, dk_j, dv_j, rows0, dq_part, db_parts in _threads.ordered_map(
                run, tasks(), workers):
            if grads is None or grads[0] != idx:
                if grads is not None:
                    finish_index()
                q_len, kv_len = _lengths_of(problem, idx)      # the rows a sequence has
                grads = (idx, np.zeros(vec_shape + (q_len, q.shape[-1]), dtype=acc_t),
                         np.zeros(vec_shape + (kv_len, k.shape[-1]), dtype=acc_t),
                         np.zeros(vec_shape + (kv_len, v.shape[-1]), dtype=acc_t))
            if dk_j is None:
                continue
            grads[2][..., j0:j1, :] = dk_j
            grads[3][..., j0:j1, :] = dv_j
            grads[1][..., rows0:rows0 + dq_part.shape[-2], :] += dq_part
            for t, part in enumerate(db_parts):
                if part is not None:
                    _block_of(_index_into(dbias[t], idx), rows0, rows0 + part.shape[-2], j0, j1)[...] += part
        if grads is not None:
            finish_index()

    def finish(grad, like):
        return grad.reshape(like.shape).astype(like.dtype, copy=False)

    grads = finish(dq, problem.q), finish(dk, problem.k), finish(dv, problem.v)
    if not problem.bias:
        return grads
    terms = tuple(finish(db, b) for db, b in zip(dbias, problem.bias))
    return grads + (terms if problem.bias_is_tuple else terms[0],)


def _accumulate(total, idx, part):
    """total[idx] += part, summing part over the axes where total is broadcast; part may
    cover the first rows only (a sequence's own, under lengths)."""
    target_idx = tuple(0 if total.shape[a] == 1 else i for a, i in enumerate(idx))
    target = total[target_idx][..., :part.shape[-2], :]
    target += _sum_to(part, target.shape)
