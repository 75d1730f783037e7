"""Running the CUDA backward kernels through an executor.

The caller (:mod:`cupyflash._dispatch`) hands over canonical 4-D views, as for
:func:`cupyflash._gpu.forward`: q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``,
v ``(B, Hkv, Lk, dv)``, out and dout ``(B, Hq, Lq, dv)``, lse ``(B, Hq, Lq)``
(the accumulator type), with a unit-stride last axis and any other strides
(0 for broadcast axes), all NumPy (emulator) or all CuPy (GPU); and the
gradients dq, dk, dv of those shapes in the **accumulator type** (float32,
float64 for float64 inputs), any strides with a unit-stride last axis.  dk and
dv receive, per (batch, kv head), the sum over the kv head's group of query
heads; reducing broadcast axes back to the shapes of k and v (and casting to
the input dtype) is the caller's job.

Three or four launches, in order: ``delta = rowsum(dout * out)`` into a
workspace allocated here (``cuda_src/bwd_simt.cu``), then dK/dV (one launch,
or dV and dK apart for bwd_mma's large head dims), then dQ, by the SIMT
kernels or the tensor-core ones (``cuda_src/bwd_mma.cu``, on Hopper
``cuda_src/bwd_wgmma.cu``; for float64 ``cuda_src/bwd_dmma.cu`` where
enabled; :func:`select`).
Every gradient element is summed by one thread in a fixed order, so the
results are bit-identical from run to run.
"""

from __future__ import annotations

import numpy as np

from ._gpu import (_accumulator_dtype, _array_module, mma_head_dim, rows_aligned, simt_bucket, use_dmma, use_wgmma,
                   whole_blocks)
from ._kernels import (DMMA_DTYPES, DMMA_HEAD_DIMS, TF32_HEAD_DIMS, TF32_PASSES, WGMMA_BWD_HEAD_DIMS, Instantiation,
                       bwd_dmma_name_expressions, bwd_mma_name_expressions, bwd_mma_streamed, bwd_tf32_name_expressions,
                       bwd_wgmma_dq_keys, bwd_wgmma_name_expressions, by_name, family_rows)
from ._launch import backward_kernel, backward_launch_config
from ._params_bwd import bwd_params

__all__ = ["backward", "select"]

# bwd_simt's kernels of one bucket, in launch order.
_SIMT_KERNELS = ("bwd_simt_dot_do_o_kernel", "bwd_simt_dkdv_kernel", "bwd_simt_dq_kernel")


def select(dtype, head_dim: int, head_dim_v: int, arch: int, *, aligned: bool = False,
           deterministic: bool = True, wgmma: bool | None = None,
           dq_aligned: bool = True, dmma: bool | None = None,
           precision: str = "ieee", seqlen_q: int | None = None,
           seqlen_k: int | None = None) -> tuple[Instantiation, ...]:
    """The instantiations :func:`backward` launches for these arguments, in launch order.

    bwd_wgmma (Hopper's wgmma, ``cuda_src/bwd_wgmma.cu``) where bwd_mma would run
    on ``arch == 90`` in a head dim of :data:`~cupyflash._kernels.WGMMA_BWD_HEAD_DIMS`
    and ``wgmma`` is true (default: :func:`cupyflash._gpu.wgmma_enabled`, the
    forward's switch): bwd_simt's delta kernel, bwd_wgmma's dK/dV kernel (two
    launches, dV then dK, from head dim 192 on) and its dQ kernel -- or, not
    ``deterministic``, up to head dim 128 and with ``dq_aligned`` (every row of
    dq starts on an 8-byte boundary: its atomics add float pairs), the dK/dV
    kernel that adds dQ by atomics.

    bwd_tf32 (the TF32 tensor cores, ``cuda_src/bwd_tf32.cu``) for float32 when
    ``precision`` is ``"tf32"`` or ``"tf32x3"``, with ``head_dim == head_dim_v <= 128``
    (any strides) on ``arch >= 80``, in the smallest of
    :data:`~cupyflash._kernels.TF32_HEAD_DIMS` holding the head dim: bwd_simt's delta
    kernel, bwd_tf32's dK/dV and dQ kernels, whatever ``deterministic`` says.  It takes
    precedence over bwd_dmma.

    bwd_dmma (the FP64 tensor cores, ``cuda_src/bwd_dmma.cu``) for float64 -- and
    float32, computed in double -- with ``head_dim == head_dim_v <= 128`` (any
    strides) on :data:`~cupyflash._kernels.DMMA_ARCHS` where ``dmma`` is true
    (default: :func:`cupyflash._gpu.dmma_enabled` for the dtype, the forward's
    switch), in the smallest
    of :data:`~cupyflash._kernels.DMMA_HEAD_DIMS` holding the head dim:
    bwd_simt's delta kernel, bwd_dmma's dK/dV and dQ kernels, whatever
    ``deterministic`` says (they have no atomic variant).  Otherwise:

    bwd_mma (tensor cores, ``cuda_src/bwd_mma.cu``) where it applies -- the
    conditions of fwd_mma (:func:`cupyflash._gpu.select`): ``arch >= 80``,
    float16 or bfloat16, ``head_dim == head_dim_v <= 256`` and ``aligned``
    (every row of q, k, v and dout starts on a 16-byte boundary) -- with the
    smallest of :data:`~cupyflash._kernels.MMA_HEAD_DIMS` holding
    ``head_dim``: bwd_simt's delta kernel, then bwd_mma's dK/dV kernel (two
    launches, dV then dK, from head dim 160 on) and dQ kernel -- or, not
    ``deterministic``, no dQ kernel: the launch computing dK adds dQ to a
    zeroed dq with float atomics.  Otherwise bwd_simt (any dtype, any
    strides) in the smallest head-dim bucket that holds both head dims:
    delta, dK/dV, dQ -- or, not ``deterministic``, delta and the dK/dV
    kernel that adds dQ with atomics, where its tile has one (streamed
    blocks of a multiple of 16 rows: buckets up to 64 for float64, 128 for
    the others).

    ``seqlen_q`` / ``seqlen_k``: bwd_mma's dK/dV (dQ) kernels run their whole-stream
    instantiations (``kWholeStream``: streamed copies without bounds) where Lq (Lk) is a
    multiple of their streamed block (:func:`~cupyflash._kernels.bwd_mma_streamed`) and
    ``head_dim`` is the bucket itself, unless ``cupyflash._gpu.whole_kv_override`` is
    False; bwd_wgmma's dQ kernel likewise where Lk is a multiple of its key block
    (:func:`~cupyflash._kernels.bwd_wgmma_dq_keys`).  None (unknown) never picks them.

    Raises
    ------
    TypeError
        ``dtype`` is not float16, bfloat16, float32 or float64.
    ValueError
        A head dim above the largest bucket.
    """
    name = np.dtype(dtype).name
    d, dv = int(head_dim), int(head_dim_v)
    bucket = simt_bucket("bwd_simt", name, d, dv)
    rows = [r for r in family_rows("bwd_simt", name) if r.head_dim == bucket]
    simt = {backward_kernel(r): r for r in rows if not r.name_expression.endswith(", true>")}
    atomic = [r for r in rows if r.name_expression.endswith(", true>")]
    if precision in TF32_PASSES and name == "float32" and arch >= 80 and d == dv and d <= TF32_HEAD_DIMS[-1]:
        names = bwd_tf32_name_expressions(min(m for m in TF32_HEAD_DIMS if m >= d), TF32_PASSES[precision])
        return (simt["bwd_simt_dot_do_o_kernel"],) + tuple(by_name()[n] for n in names)
    if name in DMMA_DTYPES and d == dv and d <= DMMA_HEAD_DIMS[-1] and use_dmma(arch, dmma, name):
        names = bwd_dmma_name_expressions(min(m for m in DMMA_HEAD_DIMS if m >= d), name)
        return (simt["bwd_simt_dot_do_o_kernel"],) + tuple(by_name()[n] for n in names)
    mma_dim = mma_head_dim(name, d, dv, arch, aligned=aligned)
    if mma_dim is not None:
        if mma_dim in WGMMA_BWD_HEAD_DIMS and use_wgmma(arch, wgmma):
            names = bwd_wgmma_name_expressions(name, mma_dim, deterministic or not dq_aligned,
                                               whole_k=whole_blocks(seqlen_k, bwd_wgmma_dq_keys(mma_dim), d, mma_dim))
        else:
            streamed, streamed_dq = bwd_mma_streamed(mma_dim)
            names = bwd_mma_name_expressions(name, mma_dim, arch, deterministic,
                                             whole_q=whole_blocks(seqlen_q, streamed, d, mma_dim),
                                             whole_k=whole_blocks(seqlen_k, streamed_dq, d, mma_dim))
        return (simt["bwd_simt_dot_do_o_kernel"],) + tuple(by_name()[n] for n in names)
    if not deterministic and atomic:
        return (simt["bwd_simt_dot_do_o_kernel"], atomic[0])
    return tuple(simt[k] for k in _SIMT_KERNELS)


def backward(dout, q, k, v, out, lse, dq, dk, dv, *, scale, window_left, window_right, gqa_ratio,
             deterministic=True, executor, precision="ieee") -> None:
    """dq, dk, dv = gradients of attention(q, k, v) with bwd_mma or bwd_simt (:func:`select`).

    Parameters
    ----------
    dout, q, k, v, out, lse, dq, dk, dv : arrays
        Canonical views as described in the module docstring; dq, dk and dv
        (accumulator type) are overwritten entirely.
    scale, window_left, window_right, gqa_ratio
        As for :func:`cupyflash._gpu.forward` (``causal`` folded into the window).
    deterministic : bool, default True
        False lets the dK/dV kernel add dQ by atomics (no dQ kernel, which
        recomputes S and dP): faster, and dq's last bits then depend on the
        order the atomics land in (float atomics; double for float64).
    executor
        :class:`cupyflash._loader.CudaExecutor` or
        :class:`cupyflash.emulator.EmulatorExecutor`.
    precision : {"ieee", "tf32", "tf32x3"}, default "ieee"
        float32: whether the TF32 tensor cores may run the products (:func:`select`).

    Rows that see no key (lse = -inf) contribute nothing: their dq rows are
    zero.  Keys no query row sees get zero dk and dv rows; with Lq = 0 every
    dk, dv row is zero, with Lk = 0 every dq row.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    if batch == 0 or heads_q == 0:
        return
    acc = np.dtype(_accumulator_dtype(q.dtype))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        if np.dtype(g.dtype) != acc:
            raise TypeError(f"`{name}` must have the accumulator dtype {acc.name}, "
                            f"got {np.dtype(g.dtype).name}")
    if np.dtype(lse.dtype) != acc:
        raise TypeError(f"`lse` must have the accumulator dtype {acc.name}, got {np.dtype(lse.dtype).name}")
    xp = _array_module(q)
    delta = xp.empty((batch, heads_q, seqlen_q), dtype=acc)
    params = bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, scale=scale,
                        window_left=window_left, window_right=window_right, gqa_ratio=gqa_ratio)
    sizes = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                 seqlen_k=seqlen_k)
    # dq_aligned: always so for attention_backward's own dq
    kernels = select(q.dtype, head_dim, head_dim_v, executor.arch, aligned=rows_aligned(q, k, v, dout),
                     deterministic=deterministic, dq_aligned=rows_aligned(dq, boundary=8), precision=precision,
                     seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    if not any(backward_kernel(r).endswith("_dq_kernel") for r in kernels):
        dq.fill(0)   # the dK/dV kernel adds dQ into it (float atomics)
    # delta first (the others read it); a dK/dV launch needs keys, the others query rows.
    for inst in kernels:
        if (seqlen_k if "dkdv" in backward_kernel(inst) else seqlen_q) > 0:
            grid, block, shared = backward_launch_config(inst, **sizes)
            executor.launch(inst.entry, inst.name_expression, grid, block, shared, params)
