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

import numpy as np

from ._kernels import Instantiation, instantiations
from ._launch import launch_config, v1_block_sizes
from ._params import fwd_params

__all__ = ["forward", "forward_v1", "select"]


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def select(dtype, head_dim: int, head_dim_v: int, arch: int) -> Instantiation:
    """The fwd_simt instantiation :func:`forward` runs for these arguments.

    The smallest head-dim bucket that holds both ``head_dim`` and
    ``head_dim_v``.  ``arch`` (e.g. 80) does not change the choice yet: the
    SIMT kernel runs on every architecture.

    Raises
    ------
    TypeError
        ``dtype`` is not float16, bfloat16, float32 or float64.
    ValueError
        A head dim above the largest bucket.
    """
    name = _dtype_name(dtype)
    rows = [r for r in instantiations() if r.family == "fwd_simt" and r.dtype == name]
    if not rows:
        raise TypeError(f"no fwd_simt kernel for dtype {name}")
    need = max(int(head_dim), int(head_dim_v))
    fits = [r for r in rows if r.head_dim >= need]
    if not fits:
        raise ValueError(
            f"head dims up to {max(r.head_dim for r in rows)} are supported; "
            f"got head_dim={head_dim}, head_dim_v={head_dim_v}")
    return min(fits, key=lambda r: r.head_dim)


def _v1_instantiation(dtype) -> Instantiation:
    name = _dtype_name(dtype)
    for r in instantiations():
        if r.family == "fwd_v1" and r.dtype == name:
            return r
    raise TypeError(f"no fwd_v1 kernel for dtype {name}")


def _array_module(a):
    return np if isinstance(a, np.ndarray) else importlib.import_module("cupy")


def _accumulator_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def forward(q, k, v, out, lse, *, scale, window_left, window_right, gqa_ratio, executor) -> None:
    """out (and lse) = attention(q, k, v) with the fwd_simt kernel (FlashAttention-2 order).

    Rows that see no key (including every row when Lk = 0) get zeros and
    lse = -inf.  Nothing is launched when there are no query rows.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    if batch == 0 or heads == 0 or seqlen_q == 0:
        return
    inst = select(q.dtype, head_dim, v.shape[3], executor.arch)
    params = fwd_params(q, k, v, out, lse, scale=scale, window_left=window_left,
                        window_right=window_right, gqa_ratio=gqa_ratio)
    grid, block, shared = launch_config(inst, batch=batch, heads=heads, seqlen_q=seqlen_q,
                                        seqlen_k=k.shape[2])
    executor.launch(inst.entry, inst.name_expression, grid, block, shared, params)


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
