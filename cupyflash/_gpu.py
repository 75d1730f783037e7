"""Running the CUDA forward kernels through an executor.

The caller (:mod:`cupyflash._dispatch`) hands over canonical 4-D views --
q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, dv)``, out
``(B, Hq, Lq, dv)``, lse ``(B, Hq, Lq)`` or None -- with a unit-stride last
axis and any other strides, all NumPy (emulator) or all CuPy (GPU).  This
module picks the instantiation, fills the params struct and launches through
``executor`` (:class:`cupyflash._loader.CudaExecutor` or
:class:`cupyflash.emulator.EmulatorExecutor`), which share the protocol
``executor.arch`` and ``executor.launch(entry, name_expression, grid, block,
shared_mem, params)``.
"""

from __future__ import annotations

import importlib
import math
import os

import numpy as np

from ._kernels import (DMMA_ARCHS, DMMA_DTYPES, DMMA_HEAD_DIMS, MMA_HEAD_DIMS, TF32_HEAD_DIMS, TF32_PASSES,
                       WGMMA_ARCH, WGMMA_HEAD_DIMS, Instantiation, by_name, combine_name_expression,
                       dmma_name_expression, dmma_tiles, family_rows, mma_name_expression, mma_split_tiles,
                       mma_tiles, tf32_name_expression, tf32_tiles, wgmma_name_expression, wgmma_tiles)
from ._launch import launch_config, num_splits, v1_block_sizes
from ._params import KernelView, data_pointer, fwd_params

__all__ = ["forward", "forward_v1", "select", "rows_aligned", "wgmma_enabled", "use_wgmma", "dmma_enabled",
           "use_dmma", "whole_blocks"]

# The wgmma kernels (fwd_wgmma, bwd_wgmma) have not run on a GPU yet: they are
# opt-in until the GPU tier has checked them.
WGMMA_ENV = "CUPYFLASH_WGMMA"


# Set by the benchmarks to time the wgmma kernels without touching the environment (None: use it).
wgmma_override: bool | None = None
# Set by tests and benchmarks to force the forward's split-KV count (None: the
# heuristic, cupyflash._launch.num_splits).
split_override: int | None = None
# Set to False by the benchmarks to time the bounds-checked copies (fwd_mma, fwd_wgmma, bwd_mma,
# bwd_wgmma's dQ) where the whole-KV (whole-stream) instantiations would run (None: use them).
whole_kv_override: bool | None = None

# fwd_dmma and bwd_dmma (the FP64 tensor cores) have not run on a GPU yet: opt-in
# until the GPU tier has checked them and the benchmark has timed them against the
# SIMT kernels.  CUPYFLASH_DMMA=1 (or float64) turns them on for float64;
# float32 (or "float64,float32", or all) runs the float32 forward on them too.
DMMA_ENV = "CUPYFLASH_DMMA"
# Set by tests and benchmarks to switch the DMMA kernels without touching the
# environment (None: use it): float64's switch, and float32's.
dmma_override: bool | None = None
dmma_float32_override: bool | None = None


def dmma_enabled(dtype="float64") -> bool:
    """Whether ``dtype`` (float64, or float32) may run on the FP64 tensor cores of
    :data:`~cupyflash._kernels.DMMA_ARCHS`: ``CUPYFLASH_DMMA`` (read at each call) is
    ``1`` or names the dtype (``float64``, ``float32``, ``float64,float32``, ``all``).
    Off by default until checked on a GPU."""
    name = _dtype_name(dtype)
    override = {"float64": dmma_override, "float32": dmma_float32_override}.get(name, False)
    if override is not None:
        return override
    words = {w.strip() for w in os.environ.get(DMMA_ENV, "").lower().split(",")}
    if name == "float64":
        return bool(words & {"1", "true", "yes", "on", "float64", "all"})
    return bool(words & {"float32", "all"})


def use_dmma(arch: int, dmma: bool | None = None, dtype="float64") -> bool:
    """Whether the DMMA kernels replace the SIMT ones for ``dtype`` on ``arch``: a GPU of
    :data:`~cupyflash._kernels.DMMA_ARCHS` and ``dmma`` true (default:
    :func:`dmma_enabled` for ``dtype``)."""
    return int(arch) in DMMA_ARCHS and (dmma_enabled(dtype) if dmma is None else dmma)


def wgmma_enabled() -> bool:
    """Whether the dispatchers may pick the wgmma kernels on sm_90: ``CUPYFLASH_WGMMA=1``
    (read at each call). Off by default until they have been checked on a GPU."""
    if wgmma_override is not None:
        return wgmma_override
    return os.environ.get(WGMMA_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def use_wgmma(arch: int, wgmma: bool | None = None) -> bool:
    """Whether a wgmma kernel replaces its mma.sync counterpart on ``arch``: a compute
    capability 9.0 device and ``wgmma`` true (default: :func:`wgmma_enabled`)."""
    return int(arch) == WGMMA_ARCH and (wgmma_enabled() if wgmma is None else wgmma)


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def whole_blocks(seqlen: int | None, block: int, head_dim: int, bucket: int) -> bool:
    """Whether every streamed block of ``seqlen`` rows is complete and the head dim fills
    its bucket -- the condition of fwd_mma's and fwd_wgmma's whole-KV and bwd_mma's and
    bwd_wgmma's (dQ) whole-stream instantiations (copies without bounds) -- and
    ``whole_kv_override`` allows them.  An unknown length (None) never qualifies."""
    return (seqlen is not None and int(seqlen) % block == 0 and head_dim == bucket
            and whole_kv_override is not False)


# The scale as fwd_mma, fwd_wgmma and fwd_tf32 fold it into the exponent: a float32
# ``scale * log2(e)`` multiplying the unscaled scores, masked ones (-inf) included.
# It must be a positive normal float32: a scale below about 8e-39 is 0 there, or a
# subnormal that the kernels' flush-to-zero (-ftz=true) makes 0, and -inf * 0 is
# NaN.  Such scales run fwd_simt, which scales before it masks.
_LOG2E = math.log2(math.e)   # as fwd_params derives scale_log2
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def folds_scale(scale: float) -> bool:
    """Whether the tensor-core forward kernels can take ``scale`` (see above)."""
    return scale * _LOG2E >= _FLOAT32_TINY


def select(dtype, head_dim: int, head_dim_v: int, arch: int, *, aligned: bool = False,
           scale: float = 1.0, wgmma: bool | None = None, split: bool = False,
           dmma: bool | None = None, precision: str = "ieee", seqlen_k: int | None = None) -> Instantiation:
    """The instantiation :func:`forward` runs for these arguments.

    ``fwd_wgmma`` (Hopper's wgmma, ``cuda_src/fwd_wgmma.cu``) where fwd_mma would
    run on ``arch == 90`` in a head dim of :data:`~cupyflash._kernels.WGMMA_HEAD_DIMS`
    and ``wgmma`` is true (default: :func:`wgmma_enabled`).  Otherwise:

    ``fwd_mma`` (tensor cores, ``cuda_src/fwd_mma.cu``) where it applies:

    - ``arch >= 80`` (mma.sync m16n8k16 with float16/bfloat16 inputs),
    - ``dtype`` float16 or bfloat16,
    - ``head_dim == head_dim_v <= 256`` (the kernel's V tile shares Q/K's
      layout and head dim; ``dv != d`` runs fwd_simt),
    - ``aligned``: every row of q, k, v and out starts on a 16-byte boundary
      (see :func:`rows_aligned`), as its 16-byte cp.async copies and stores need;
    - :func:`folds_scale`: the kernel takes row maxima of the unscaled scores and
      folds the scale into the exponent's FFMA, which needs a positive scale that
      is a normal float32 once multiplied by log2(e) (a zero, negative or tiny
      one, rare, runs fwd_simt);

    with the tile :func:`~cupyflash._kernels.mma_tiles` gives ``arch`` for the smallest of
    :data:`~cupyflash._kernels.MMA_HEAD_DIMS` holding ``head_dim``.  Otherwise
    ``fwd_simt`` (any dtype, any strides) in the smallest head-dim bucket that
    holds both head dims.  ``aligned`` defaults to False: without knowing the
    arrays, only fwd_simt is safe.

    ``fwd_dmma`` (``cuda_src/fwd_dmma.cu``, the FP64 tensor cores) for float64 -- and
    float32, computed in double and rounded once -- with ``head_dim == head_dim_v <=
    128`` on :data:`~cupyflash._kernels.DMMA_ARCHS` where ``dmma`` is true (default:
    :func:`dmma_enabled` for the dtype), in the smallest of
    :data:`~cupyflash._kernels.DMMA_HEAD_DIMS` holding the head dim.

    ``fwd_tf32`` (``cuda_src/fwd_tf32.cu``, the TF32 tensor cores) for float32 when
    ``precision`` is ``"tf32"`` or ``"tf32x3"`` (one or three TF32 products per
    product), with ``head_dim == head_dim_v <= 128`` and :func:`folds_scale` on ``arch >= 80``,
    in the smallest of :data:`~cupyflash._kernels.TF32_HEAD_DIMS` holding the head dim
    (any strides: it copies rows that are not 16-byte aligned word by word).  It takes
    precedence over fwd_dmma; ``precision="ieee"`` (the default) never runs it.

    ``split``: the instantiation a split-KV launch runs (``FwdParams::num_splits > 1``):
    fwd_mma's and fwd_wgmma's ``kSplit`` rows (fwd_mma's tiles:
    :func:`~cupyflash._kernels.mma_split_tiles`); fwd_simt splits at run time, so the
    same row.

    ``seqlen_k``: where it is a multiple of the fwd_mma (fwd_wgmma) tile's ``block_n``
    and ``head_dim`` is the bucket itself, the tile's whole-KV instantiation
    (``kWholeKV``: its K/V copies check no bounds; not for ``split``), unless
    ``whole_kv_override`` is False.  None (unknown) never picks it.

    Raises
    ------
    TypeError
        ``dtype`` is not float16, bfloat16, float32 or float64.
    ValueError
        A head dim above the largest bucket.
    """
    name = _dtype_name(dtype)
    d, dv = int(head_dim), int(head_dim_v)
    folds = folds_scale(scale)
    bucket = mma_head_dim(name, d, dv, arch, aligned=aligned) if folds else None
    if bucket is not None:
        if bucket in WGMMA_HEAD_DIMS and use_wgmma(arch, wgmma):
            tile = wgmma_tiles()[bucket]
            whole_kv = not split and whole_blocks(seqlen_k, tile[0], d, bucket)
            wanted = wgmma_name_expression(name, bucket, *tile, split=split, whole_kv=whole_kv)
        else:
            tiles = mma_split_tiles(arch) if split else mma_tiles(arch)
            whole_kv = not split and whole_blocks(seqlen_k, tiles[bucket][1], d, bucket)
            wanted = mma_name_expression(name, bucket, *tiles[bucket], split=split, whole_kv=whole_kv)
        return by_name()[wanted]
    if (precision in TF32_PASSES and name == "float32" and arch >= 80 and folds and d == dv
            and d <= TF32_HEAD_DIMS[-1]):
        bucket = min(m for m in TF32_HEAD_DIMS if m >= d)
        return by_name()[tf32_name_expression(bucket, *tf32_tiles()[bucket], TF32_PASSES[precision])]
    if name in DMMA_DTYPES and d == dv and d <= DMMA_HEAD_DIMS[-1] and use_dmma(arch, dmma, name):
        bucket = min(m for m in DMMA_HEAD_DIMS if m >= d)
        return by_name()[dmma_name_expression(bucket, *dmma_tiles()[bucket], name)]
    bucket = simt_bucket("fwd_simt", name, d, dv)
    return next(r for r in family_rows("fwd_simt", name) if r.head_dim == bucket)


def mma_head_dim(name: str, head_dim: int, head_dim_v: int, arch: int, *, aligned: bool) -> int | None:
    """The compile-time head dim the tensor-core kernels (fwd_mma, bwd_mma) run these
    arguments in -- the smallest of :data:`~cupyflash._kernels.MMA_HEAD_DIMS` holding
    ``head_dim`` -- or None where they do not apply: ``arch < 80``, ``name`` not
    float16/bfloat16, ``head_dim != head_dim_v`` or above 256, rows not 16-byte aligned."""
    if (aligned and arch >= 80 and name in ("float16", "bfloat16") and head_dim == head_dim_v
            and head_dim <= MMA_HEAD_DIMS[-1]):
        return min(m for m in MMA_HEAD_DIMS if m >= head_dim)
    return None


def simt_bucket(family: str, name: str, head_dim: int, head_dim_v: int) -> int:
    """The smallest head-dim bucket of ``family`` (fwd_simt, bwd_simt) holding both head dims.

    Raises
    ------
    TypeError
        ``family`` has no kernels for dtype ``name``.
    ValueError
        A head dim above the largest bucket.
    """
    buckets = [r.head_dim for r in family_rows(family, name)]
    if not buckets:
        raise TypeError(f"no {family} kernels for dtype {name}")
    fits = [b for b in buckets if b >= max(head_dim, head_dim_v)]
    if not fits:
        raise ValueError(f"head dims up to {max(buckets)} are supported; "
                         f"got head_dim={head_dim}, head_dim_v={head_dim_v}")
    return min(fits)


def rows_aligned(*arrays, boundary: int = 16) -> bool:
    """Whether every row of every array starts on a ``boundary``-byte boundary.

    True when each array's first element and its strides in bytes along
    every axis but the last (skipping axes of length 1, whose stride is
    never used) are multiples of ``boundary``; ``None`` entries are ignored.
    fwd_mma copies and stores rows in 16-byte chunks and needs 16;
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


def _v1_instantiation(dtype) -> Instantiation:
    name = _dtype_name(dtype)
    for r in family_rows("fwd_v1", name):
        return r
    raise TypeError(f"no fwd_v1 kernel for dtype {name}")


def _array_module(a):
    if isinstance(a, KernelView):
        a = a.base
    return np if isinstance(a, np.ndarray) else importlib.import_module("cupy")


def _accumulator_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def forward(q, k, v, out, lse, *, scale, window_left, window_right, gqa_ratio, executor,
            precision: str = "ieee") -> None:
    """out (and lse) = attention(q, k, v) with fwd_mma or fwd_simt (FlashAttention-2 order).

    :func:`select` picks the kernel: fwd_mma for float16/bfloat16 on sm_80+
    with ``d == dv <= 256``, 16-byte aligned rows and :func:`folds_scale` (fwd_wgmma
    instead on sm_90 where enabled), fwd_tf32 for float32 where ``precision`` allows
    TF32, fwd_dmma where enabled, fwd_simt otherwise.

    Rows that see no key (including every row when Lk = 0) get zeros and
    lse = -inf.  Nothing is launched when there are no query rows.  Where the
    query blocks alone would leave much of the GPU idle (``executor.multiprocessors``,
    :func:`cupyflash._launch.num_splits`), each one's keys are split over
    several CTAs and ``fwd_combine`` merges their partial results (split-KV).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    if batch == 0 or heads == 0 or seqlen_q == 0:
        return
    seqlen_k, head_dim_v = k.shape[2], v.shape[3]
    inst = select(q.dtype, head_dim, head_dim_v, executor.arch, aligned=rows_aligned(q, k, v, out),
                  scale=scale, precision=precision, seqlen_k=seqlen_k)
    splits = split_override
    if splits is None:
        sms = getattr(executor, "multiprocessors", None)
        splits = 1 if sms is None else num_splits(inst, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                                  seqlen_k=seqlen_k, arch=executor.arch,
                                                  multiprocessors=sms, window_left=window_left,
                                                  window_right=window_right)
    if splits > 1 and inst.family in ("fwd_mma", "fwd_wgmma"):
        inst = select(q.dtype, head_dim, head_dim_v, executor.arch, aligned=True, scale=scale, split=True)
    workspace = (None, None, None)
    if splits > 1:   # each split's normalised partial rows and lse, in the accumulator type
        xp = _array_module(q)
        acc = _accumulator_dtype(q.dtype)
        workspace = (xp.empty((splits, batch, heads, seqlen_q, head_dim_v), dtype=acc),
                     xp.empty((splits, batch, heads, seqlen_q), dtype=acc), None)
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, workspace=workspace,
                        num_splits=splits)
    grid, block, shared = launch_config(inst, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                        seqlen_k=seqlen_k, num_splits=splits)
    executor.launch(inst.entry, inst.name_expression, grid, block, shared, params)
    if splits > 1:   # fwd_combine merges the partials into out and lse
        combine = by_name()[combine_name_expression(_dtype_name(q.dtype))]
        grid, block, shared = launch_config(combine, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                            seqlen_k=seqlen_k, head_dim_v=head_dim_v)
        executor.launch(combine.entry, combine.name_expression, grid, block, shared, params)


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
    inst = _v1_instantiation(q.dtype)
    block_m, block_n = v1_block_sizes(sram_size, head_dim, seqlen_q, seqlen_k)
    xp = _array_module(q)
    acc = _accumulator_dtype(q.dtype)
    workspace = (xp.empty((batch, heads, seqlen_q, head_dim_v), dtype=acc),
                 xp.empty((batch, heads, seqlen_q), dtype=acc),
                 xp.empty((batch, heads, seqlen_q), dtype=acc))
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio, workspace=workspace,
                        block_m=block_m, block_n=block_n)
    grid, block, shared = launch_config(inst, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                        seqlen_k=seqlen_k, head_dim=head_dim,
                                        head_dim_v=head_dim_v, sram_size=sram_size)
    executor.launch(inst.entry, inst.name_expression, grid, block, shared, params)
