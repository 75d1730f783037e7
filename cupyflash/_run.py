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

import numpy as np

from ._dtypes import accumulator_dtype, dtype_name
from ._families import BACKWARD, DKDV, DQ, FORWARD, FWD_COMBINE, FWD_V1, Call, Sizes, select
from ._families.fwd_v1 import v1_block_sizes
from ._launch import num_splits
from ._options import KernelOptions
from ._params import KernelView, bwd_params, data_pointer, fwd_params
from ._terms import ScoreOperands

__all__ = ["forward", "forward_v1", "backward", "forward_plan", "backward_plan", "rows_aligned"]


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


def forward_plan(q, k, v, out, *, scale: float, arch: int, options: KernelOptions, precision: str = "ieee",
                 features: frozenset = frozenset()):
    """The rows :func:`forward` launches for these views (without the split-KV choice)."""
    call = Call(dtype_name(q.dtype), q.shape[3], v.shape[3], seqlen_q=q.shape[2], seqlen_k=k.shape[2],
                aligned=rows_aligned(q, k, v, out), scale=float(scale), precision=precision, features=features)
    return call, select(FORWARD, call, arch, options)


def forward(q, k, v, out, lse, *, scale, window_left, window_right, gqa_ratio, executor,
            options: KernelOptions, precision: str = "ieee", terms: ScoreOperands | None = None) -> None:
    """out (and lse) = attention(q, k, v), FlashAttention-2 order, by the family dispatch picks.

    Rows that see no key (including every row when Lk = 0) get zeros and
    lse = -inf.  Nothing is launched when there are no query rows.  Where the
    query blocks alone would leave much of the GPU idle (``executor.multiprocessors``,
    :func:`cupyflash._launch.num_splits`; or ``options.splits``), each one's keys
    are split over several CTAs and fwd_combine merges their partial results.
    ``terms``: the call's biases and mask (``(B, Hq, Lq, Lk)`` views), read by a
    family that takes them, in a module compiled for them.
    """
    terms = ScoreOperands() if terms is None else terms
    batch, heads, seqlen_q, head_dim = q.shape
    if batch == 0 or heads == 0 or seqlen_q == 0:
        return
    seqlen_k, head_dim_v = k.shape[2], v.shape[3]
    call, (row,) = forward_plan(q, k, v, out, scale=scale, arch=executor.arch, options=options,
                                precision=precision, features=terms.features)
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
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, workspace=workspace,
                        num_splits=splits, terms=terms)
    sizes = Sizes(batch, heads, k.shape[1], seqlen_q, seqlen_k, head_dim, head_dim_v, num_splits=splits)
    executor.launch(terms.entry(row.entry), row.name_expression, *row.family.launch_config(row, sizes), params)
    if splits > 1:   # fwd_combine merges the partials into out and lse
        (combine,) = FWD_COMBINE.plan(call, executor.arch, options)
        one_row = replace(sizes, num_splits=1)   # it merges the splits: one grid row
        executor.launch(combine.entry, combine.name_expression, *FWD_COMBINE.launch_config(combine, one_row), params)


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
                  precision: str = "ieee", features: frozenset = frozenset()):
    """The rows :func:`backward` launches for these views, in launch order."""
    call = Call(dtype_name(q.dtype), q.shape[3], v.shape[3], seqlen_q=q.shape[2], seqlen_k=k.shape[2],
                aligned=rows_aligned(q, k, v, dout), dq_aligned=rows_aligned(dq, boundary=8),
                precision=precision, deterministic=bool(deterministic), features=features)
    return select(BACKWARD, call, arch, options)


def backward(dout, q, k, v, out, lse, dq, dk, dv, *, scale, window_left, window_right, gqa_ratio,
             deterministic=True, executor, options: KernelOptions, precision="ieee",
             terms: ScoreOperands | None = None, dbias: tuple = ()) -> None:
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

    Three or four launches, in order: ``delta = rowsum(dout * out)`` into a
    workspace allocated here, then dK/dV (one launch, or dV and dK apart), then
    dQ.  Rows that see no key (lse = -inf) contribute nothing: their dq rows are
    zero.  Keys no query row sees get zero dk and dv rows; with Lq = 0 every dk,
    dv row is zero, with Lk = 0 every dq row.
    """
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
    delta = xp.empty((batch, heads_q, seqlen_q), dtype=acc)
    params = bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, scale=scale,
                        window_left=window_left, window_right=window_right, gqa_ratio=gqa_ratio,
                        terms=terms, dbias=dbias)
    sizes = Sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v)
    rows = backward_plan(dout, q, k, v, dq, arch=executor.arch, options=options, deterministic=deterministic,
                         precision=precision, features=terms.features)
    if not any(r.role == DQ for r in rows):
        dq.fill(0)   # the dK/dV kernel adds dQ into it (float atomics)
    # delta first (the others read it); a dK/dV launch needs keys, the others query rows.
    for row in rows:
        if (sizes.seqlen_k if row.role == DKDV else sizes.seqlen_q) > 0:
            executor.launch(terms.entry(row.entry), row.name_expression, *row.family.launch_config(row, sizes),
                            params)
