"""Running the CUDA kernels through an executor, forward and backward.

The caller (:mod:`cupyflash._dispatch`) hands over canonical 4-D views -- q
``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, dv)``, out and
dout ``(B, Hq, Lq, dv)``, lse ``(B, Hq, Lq)`` (the accumulator type) -- with a
unit-stride last axis and any other strides (0 for broadcast axes), all NumPy
(emulator) or all CuPy (GPU), as :class:`~cupyflash._params.KernelView`
descriptors or arrays.  This module describes the call to dispatch
(:class:`~cupyflash._families.Call`, :func:`cupyflash._families.select`), fills
the params struct and launches each row of the plan through ``executor``
(:class:`cupyflash._loader.CudaExecutor` or
:class:`cupyflash.emulator.EmulatorExecutor`, which share the protocol
``executor.arch`` and ``executor.launch(entry, name_expression, grid, block,
shared_mem, params)``).

The backward's gradients dq, dk, dv have the shapes of q, k, v in the
**accumulator type**; dk and dv receive, per (batch, kv head), the sum over the
kv head's group of query heads.  Reducing broadcast axes back to the shapes of
k and v (and casting to the input dtype) is the caller's job.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ._dtypes import accumulator_dtype, dtype_name
from ._families import BACKWARD, DKDV, DQ, FORWARD, FWD_COMBINE, FWD_V1, Call, Sizes, select
from ._families.fwd_v1 import v1_block_sizes
from ._launch import num_splits
from ._options import BACKWARD_TIMING_BUILDS, KernelOptions
from ._params import KernelView, bwd_params, data_pointer, fwd_params
from ._source import with_defines
from ._terms import ScoreOperands

__all__ = ["forward", "forward_v1", "backward", "forward_plan", "backward_plan", "rows_aligned",
           "sequence_table", "sequence_defines", "PADDED_DEFINES", "PACKED_DEFINES",
           "PAGED_DEFINES", "PagedKV"]

# The macros of a module that reads per-sequence lengths (cuda_src/sequence.cuh): a padded
# batch (lengths only) or packed sequences (lengths and first rows).
PADDED_DEFINES = (("CF_SEQ_LENGTHS", "1"),)
PACKED_DEFINES = (("CF_SEQ_LENGTHS", "2"),)
# A paged KV cache (cuda_src/paged.cuh): the padded form, K and V read through the block table.
PAGED_DEFINES = PADDED_DEFINES + (("CF_PAGED_KV", "1"),)


def _packed(spans) -> bool:
    """Whether a launch's ``(4, B)`` spans start a sequence past row or key 0 (packed
    sequences; a padded batch's first rows are all 0)."""
    return spans is not None and bool(spans[0].any() or spans[2].any())


def sequence_defines(spans) -> tuple:
    """The module macros for a launch's ``(4, B)`` spans (None: no lengths, none): the
    packed module only where a sequence starts past row or key 0."""
    if spans is None:
        return ()
    return PACKED_DEFINES if _packed(spans) else PADDED_DEFINES


def sequence_table(spans) -> np.ndarray:
    """``cuda_src/sequence.cuh``'s ``(5, B)`` int32 table from ``spans``, a ``(4, B)``
    array of each batch entry's first query row, query rows, first key and keys: the
    launch order first -- the most work (query rows x keys) first, ties in order, so
    the longest sequences' CTAs start earliest and the short ones fill the tail."""
    spans = np.asarray(spans, dtype=np.int64).reshape(4, -1)
    if spans.size and int(spans.max()) >= 2**31:   # the kernels read it in 32 bits
        raise NotImplementedError(f"the CUDA kernels take rows and keys below 2^31 per launch; got "
                                  f"{int(spans.max())} (backend='numpy' takes any)")
    order = np.argsort(-(spans[1] * np.maximum(spans[3], 1)), kind="stable")
    return np.ascontiguousarray(np.concatenate([order[None], spans]), dtype=np.int32)


def _narrow(a, n: int):
    """``a`` (a (B, H, L, ...) view) cut to its first ``n`` rows (axis 2); None stays None."""
    if a is None or a.shape[2] == n:
        return a
    if isinstance(a, KernelView):
        return KernelView(a.base, a.shape[:2] + (n,) + a.shape[3:], a.strides)
    return a[:, :, :n]


def _pack_query_heads(x, ratio: int):
    """A one-row ``(B, Hq, 1, ...)`` view (q, out, lse) as ``(B, Hq / ratio, ratio, ...)``:
    each kv head's group of query heads as the rows of one query block (strides only)."""
    if x is None:
        return None
    base = x.base if isinstance(x, KernelView) else x
    b, h = x.shape[:2]
    sb, sh = x.strides[:2]
    return KernelView(base, (b, h // ratio, ratio) + tuple(x.shape[3:]), (sb, ratio * sh, sh) + tuple(x.strides[3:]))


def _device_table(spans, like):
    """The sequence table on the kernels' side: a NumPy array for the emulator, a CuPy
    one (one small host-to-device copy) for the GPU -- the kind of ``like``."""
    return _array_module(like).asarray(sequence_table(spans))


def rows_aligned(*arrays, boundary: int = 16) -> bool:
    """Whether every row of every array starts on a ``boundary``-byte boundary.

    True when each array's first element and its strides in bytes along
    every axis but the last (skipping axes of length 1, whose stride is
    never used) are multiples of ``boundary``; ``None`` entries are ignored.
    The tensor-core kernels copy and store rows in 16-byte chunks and need 16;
    bwd_wgmma's atomic dQ adds float pairs and needs 8 of dq.
    """
    for a in arrays:
        if a is None:
            continue
        if data_pointer(a) % boundary:
            return False
        shape, strides = a.shape, a.strides
        for i in range(len(shape) - 1):
            if shape[i] > 1 and strides[i] % boundary:
                return False
    return True


def _array_module(a):
    if isinstance(a, KernelView):
        a = a.base
    return np if isinstance(a, np.ndarray) else importlib.import_module("cupy")


class PagedKV(NamedTuple):
    """A paged KV cache as :func:`forward` reads it (``cuda_src/paged.cuh``): the
    ``(B, max_pages)`` int32 block table on the kernels' side (unit stride along the
    pages), the keys per page, and whether every page's rows start on a 16-byte
    boundary (:func:`rows_aligned` of the caches themselves)."""

    table: object
    page_size: int
    aligned: bool


def forward_plan(q, k, v, out, *, scale: float, arch: int, options: KernelOptions, precision: str = "ieee",
                 features: frozenset = frozenset(), lengths: bool = False, paged: PagedKV | None = None):
    """The rows :func:`forward` launches for these views (without the split-KV choice);
    ``lengths``: per-sequence lengths (never the whole-block instantiations); ``paged``: K
    and V from a paged cache."""
    seqlen_q, seqlen_k = (None, None) if lengths else (q.shape[2], k.shape[2])
    aligned = rows_aligned(q, k, v, out) and (paged is None or paged.aligned)
    call = Call(dtype_name(q.dtype), q.shape[3], v.shape[3], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                aligned=aligned, scale=float(scale), precision=precision, features=features,
                paged=paged is not None)
    return call, select(FORWARD, call, arch, options)


def forward(q, k, v, out, lse, *, scale, window_left, window_right, gqa_ratio, executor,
            options: KernelOptions, precision: str = "ieee", terms: ScoreOperands | None = None,
            sequences=None, paged: PagedKV | None = None) -> None:
    """out (and lse) = attention(q, k, v), FlashAttention-2 order, by the family dispatch picks.

    Rows that see no key (including every row when Lk = 0) get zeros and
    lse = -inf.  Nothing is launched when there are no query rows.  Where the
    query blocks alone would leave much of the GPU idle (``executor.multiprocessors``,
    :func:`cupyflash._launch.num_splits`; or ``options.splits``), each one's keys
    are split over several CTAs and fwd_combine merges their partial results.
    ``terms``: the call's biases and mask (``(B, Hq, Lq, Lk)`` views), read by a
    family that takes them, in a module compiled for them.

    ``sequences``: per-sequence lengths, a host ``(4, B)`` array of each batch entry's
    first query row, query rows, first key and keys (:func:`sequence_table`); one
    launch runs every sequence on its own rows and keys, in a module compiled with
    :func:`sequence_defines`.  Rows past a sequence's length are not written (the
    caller's); a padded batch has first rows 0, a packed one batch strides 0.

    ``paged``: K and V are a paged cache (:class:`PagedKV`, padded ``sequences``): k and v
    are then ``(B, Hkv, max_pages * page_size, d)`` views of the caches whose batch
    strides are the page strides, and every key row is read from its page through the
    block table (``cuda_src/paged.cuh``), in a module compiled with :data:`PAGED_DEFINES`.

    Decoding with GQA (one query row, ``gqa_ratio`` > 1, the window unbounded on the
    left, no score terms, no packed sequences): each kv head's query heads are packed
    into the rows of one query block (:func:`_pack_query_heads`), so K and V are read
    once per kv head.
    """
    terms = ScoreOperands() if terms is None else terms
    lengths = sequences is not None
    if lengths:   # the launch spans the longest sequence
        spans = np.asarray(sequences, dtype=np.int64).reshape(4, -1)
        max_q, max_k = int(spans[1].max(initial=0)), int(spans[3].max(initial=0))
        q, out, lse = _narrow(q, max_q), _narrow(out, max_q), _narrow(lse, max_q)
        k, v = _narrow(k, max_k), _narrow(v, max_k)
    if (q.shape[2] == 1 and gqa_ratio > 1 and window_left is None and not terms.features
            and not (lengths and _packed(spans))):
        # Decoding (one query row): the kv head's group of query heads become the rows of one
        # query block -- K and V read once per kv head, not once per query head.  A row at
        # the bottom-right corner sees every key whatever the window's right bound, so the
        # packed rows (gqa_ratio 1, no window) see what each head's row saw.
        q, out, lse = (_pack_query_heads(x, gqa_ratio) for x in (q, out, lse))
        if lengths:
            spans = spans.copy()
            spans[1] *= gqa_ratio
        gqa_ratio, window_right = 1, None
    batch, heads, seqlen_q, head_dim = q.shape
    if batch == 0 or heads == 0 or seqlen_q == 0:
        return
    seqlen_k, head_dim_v = k.shape[2], v.shape[3]
    call, (row,) = forward_plan(q, k, v, out, scale=scale, arch=executor.arch, options=options,
                                precision=precision, features=terms.features, lengths=lengths, paged=paged)
    defines = sequence_defines(spans if lengths else None)   # fwd_combine's (it reads no keys)
    splits = options.splits
    if splits is None:
        sms = getattr(executor, "multiprocessors", None)
        splits = 1 if sms is None else num_splits(row, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                                  seqlen_k=seqlen_k, arch=executor.arch, multiprocessors=sms,
                                                  window_left=window_left, window_right=window_right)
    workspace = (None, None, None)
    if splits > 1:
        # the family's split-KV instantiation (never a whole-KV one: no lengths), and
        # each split's normalised partial rows and lse, in the accumulator type
        (row,) = row.family.plan(replace(call, split=True, seqlen_q=None, seqlen_k=None), executor.arch, options)
        xp = _array_module(q)
        acc = accumulator_dtype(q.dtype)
        workspace = (xp.empty((splits, batch, heads, seqlen_q, head_dim_v), dtype=acc),
                     xp.empty((splits, batch, heads, seqlen_q), dtype=acc), None)
    table = _device_table(spans, q) if lengths else None
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, workspace=workspace,
                        num_splits=splits, terms=terms, sequences=table,
                        pages=None if paged is None else (paged.table, paged.page_size))
    sizes = Sizes(batch, heads, k.shape[1], seqlen_q, seqlen_k, head_dim, head_dim_v, num_splits=splits)
    executor.launch(with_defines(terms.entry(row.entry),
                                 (PAGED_DEFINES if paged is not None else defines) + options.timing_defines),
                    row.name_expression, *row.family.launch_config(row, sizes), params)
    if splits > 1:   # fwd_combine merges the partials into out and lse
        (combine,) = FWD_COMBINE.plan(call, executor.arch, options)
        one_row = replace(sizes, num_splits=1)   # it merges the splits: one grid row
        executor.launch(with_defines(combine.entry, defines), combine.name_expression,
                        *FWD_COMBINE.launch_config(combine, one_row), params)


def forward_v1(q, k, v, out, lse, *, scale, window_left, window_right, gqa_ratio, sram_size,
               executor) -> None:
    """out (and lse) = attention(q, k, v) with fwd_v1, Algorithm 1 of FlashAttention (v1).

    ``sram_size`` is the paper's M in elements (``Bc = ceil(M / 4d)``,
    ``Br = min(Bc, d)``).  O, l and m live in a workspace of the accumulator
    type allocated here with the inputs' array module.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    if batch == 0 or heads == 0 or seqlen_q == 0:
        return
    seqlen_k, head_dim_v = k.shape[2], v.shape[3]
    (row,) = FWD_V1.plan(Call(dtype_name(q.dtype), head_dim, head_dim_v), executor.arch, None)
    block_m, block_n = v1_block_sizes(sram_size, head_dim, seqlen_q, seqlen_k)
    xp = _array_module(q)
    acc = accumulator_dtype(q.dtype)
    workspace = (xp.empty((batch, heads, seqlen_q, head_dim_v), dtype=acc),
                 xp.empty((batch, heads, seqlen_q), dtype=acc),
                 xp.empty((batch, heads, seqlen_q), dtype=acc))
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, workspace=workspace,
                        block_m=block_m, block_n=block_n)
    sizes = Sizes(batch, heads, k.shape[1], seqlen_q, seqlen_k, head_dim, head_dim_v, sram_size=sram_size)
    executor.launch(row.entry, row.name_expression, *FWD_V1.launch_config(row, sizes), params)


def backward_plan(dout, q, k, v, dq, *, arch: int, options: KernelOptions, deterministic: bool = True,
                  precision: str = "ieee", features: frozenset = frozenset(), lengths: bool = False):
    """The rows :func:`backward` launches for these views, in launch order (``lengths``:
    as for :func:`forward_plan`)."""
    seqlen_q, seqlen_k = (None, None) if lengths else (q.shape[2], k.shape[2])
    call = Call(dtype_name(q.dtype), q.shape[3], v.shape[3], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                aligned=rows_aligned(q, k, v, dout), dq_aligned=rows_aligned(dq, boundary=8),
                dq_aligned_16=rows_aligned(dq),
                precision=precision, deterministic=bool(deterministic), features=features)
    return select(BACKWARD, call, arch, options)


def backward(dout, q, k, v, out, lse, dq, dk, dv, *, scale, window_left, window_right, gqa_ratio,
             deterministic=True, executor, options: KernelOptions, precision="ieee",
             terms: ScoreOperands | None = None, dbias: tuple = (), sequences=None) -> None:
    """dq, dk, dv = gradients of attention(q, k, v), by the family dispatch picks.

    Parameters
    ----------
    dout, q, k, v, out, lse, dq, dk, dv : arrays
        Canonical views as described in the module docstring; dq, dk and dv
        (accumulator type) are overwritten entirely.
    scale, window_left, window_right, gqa_ratio
        As for :func:`forward` (``causal`` folded into the window).
    deterministic : bool, default True
        False lets the dK/dV kernel add dQ by atomics (no dQ kernel, which
        recomputes S and dP): faster, and dq's last bits then depend on the
        order the atomics land in (float atomics; double for float64).
    executor
        :class:`cupyflash._loader.CudaExecutor` or
        :class:`cupyflash.emulator.EmulatorExecutor`.
    options : KernelOptions
        Dispatch switches (:mod:`cupyflash._options`).
    precision : {"ieee", "tf32", "tf32x3"}, default "ieee"
        float32: whether the TF32 tensor cores may run the products.
    terms : ScoreOperands, optional
        The biases and the mask, as for :func:`forward`.
    dbias : tuple
        With biases: per term, a ``(B, Hq, Lq, Lk)`` view of the accumulator type
        (stride 0 along the axes the term is broadcast along) that the dK/dV kernel
        adds dS into, or None (no gradient).  The caller zeroes them and keeps
        every launch's writes disjoint between CTAs (``score.cuh``'s bias_gradient).
    sequences : array, optional
        Per-sequence lengths, as for :func:`forward`.  Gradient rows past a sequence's
        length are not written: the caller zeroes dq, dk and dv.

    Three or four launches, in order: ``delta = rowsum(dout * out)`` into a
    workspace allocated here, then dK/dV (one launch, or dV and dK apart), then
    dQ.  Rows that see no key (lse = -inf) contribute nothing: their dq rows are
    zero.  Keys no query row sees get zero dk and dv rows; with Lq = 0 every dk,
    dv row is zero, with Lk = 0 every dq row.
    """
    if options.timing is not None and options.timing not in BACKWARD_TIMING_BUILDS:
        raise ValueError(f"`options.timing`: the backward's timing-only builds are {BACKWARD_TIMING_BUILDS}, "
                         f"got {options.timing!r}")
    lengths = sequences is not None
    if lengths:   # the launches span the longest sequence
        spans = np.asarray(sequences, dtype=np.int64).reshape(4, -1)
        max_q, max_k = int(spans[1].max(initial=0)), int(spans[3].max(initial=0))
        dout, q, out, lse, dq = (_narrow(x, max_q) for x in (dout, q, out, lse, dq))
        k, v, dk, dv = (_narrow(x, max_k) for x in (k, v, dk, dv))
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    if batch == 0 or heads_q == 0:
        return
    acc = accumulator_dtype(q.dtype)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("lse", lse)):
        if np.dtype(g.dtype) != acc:
            raise TypeError(f"`{name}` must have the accumulator dtype {acc.name}, got {np.dtype(g.dtype).name}")
    terms = ScoreOperands() if terms is None else terms
    xp = _array_module(q)
    if lengths and _packed(spans):
        # packed: delta laid out like lse (C-contiguous base), each sequence's rows
        # addressed from its first row as lse's are
        base = lse.base if isinstance(lse, KernelView) else lse
        delta = KernelView(xp.empty(base.shape, dtype=acc), lse.shape, lse.strides)
    else:
        delta = xp.empty((batch, heads_q, seqlen_q), dtype=acc)
    table = _device_table(spans, q) if lengths else None
    sizes = Sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v)
    rows = backward_plan(dout, q, k, v, dq, arch=executor.arch, options=options, deterministic=deterministic,
                         precision=precision, features=terms.features, lengths=lengths)
    # ordered dQ: a zeroed semaphore per (sequence, query head, query block of the launch)
    ordered = [r for r in rows if r.ordered_dq]
    turns = (xp.zeros((spans.shape[1] if lengths else batch, heads_q, -(-seqlen_q // ordered[0].block_m)),
                      dtype=np.int32) if ordered else None)
    params = bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, scale=scale,
                        window_left=window_left, window_right=window_right, gqa_ratio=gqa_ratio,
                        terms=terms, dbias=dbias, sequences=table, dq_turns=turns)
    defines = sequence_defines(spans if lengths else None)
    if options.timing is not None:   # a timing-only build (bwd_wgmma's kernels read it)
        if any(r.family.name != "bwd_wgmma" for r in rows if r.role in (DKDV, DQ)):
            raise ValueError(f"`options.timing`: {options.timing!r} is built for bwd_wgmma only, and this call "
                             f"dispatches {sorted({r.family.name for r in rows if r.role in (DKDV, DQ)})}")
        defines = defines + options.timing_defines
    if not lengths and not any(r.role == DQ for r in rows):
        dq.fill(0)   # the dK/dV kernel adds dQ into it (float atomics; with lengths: zeroed already)
    # delta first (the others read it); a dK/dV launch needs keys, the others query rows.
    for row in rows:
        if (sizes.seqlen_k if row.role == DKDV else sizes.seqlen_q) > 0:
            executor.launch(with_defines(terms.entry(row.entry), defines), row.name_expression,
                            *row.family.launch_config(row, sizes), params)
