"""``python -m cupyflash bench``: cupyflash side by side with its peers, on one set of inputs.

Every case (dtype, B, H, Lq, Lk, d, causal; forward or backward) is run, in
one process and on the same random inputs (standard normal, never zeros), by
each implementation that applies:

on the GPU
    ``cupyflash`` (:func:`cupyflash.attention` as dispatched -- the ``kernel``
    field says which family ran, fwd_mma or fwd_simt, bwd_mma or bwd_simt),
    for backward cases ``cupyflash-atomic``
    (``attention_backward(..., deterministic=False)``: dQ by atomics), for float64
    and float32 cases on compute capability 8.0/9.0 ``cupyflash-dmma`` (fwd_dmma,
    bwd_dmma, float32 computed in double; opt-in), for float32 cases on compute
    capability 8.0+ ``cupyflash-tf32`` and ``cupyflash-tf32x3``
    (``precision="tf32"`` / ``"tf32x3"``: fwd_tf32, bwd_tf32),
    on an sm_90 GPU with float16/bfloat16 ``cupyflash-wgmma`` (the Hopper kernels, opt-in:
    fwd_wgmma, bwd_wgmma), ``cupyflash-wgmma-decoupled`` where the head dim has them
    (fwd_wgmma's warp-specialised rows: a producer warpgroup, mbarriers, the consumers'
    turns; bwd_wgmma's decoupled dK/dV rows; opt-in)
    and for backward cases ``cupyflash-wgmma-atomic`` and
    ``cupyflash-wgmma-async-dq`` (dQ by bulk asynchronous reductions, opt-in),
    ``cupyflash-wgmma-ordered-dq`` (the same, deterministic: the key blocks take turns),
    ``cupyflash-v1`` (Algorithm 1, the fwd_v1 kernel, through
    :func:`cupyflash.reference.flash_attention_v1`), ``cupy-naive`` (matmul,
    softmax in place, matmul: :func:`~cupyflash.reference.naive_attention` with
    ``oracle=False``) and, where PyTorch with CUDA is
    installed, ``torch.nn.functional.scaled_dot_product_attention`` as it
    dispatches (``torch-sdpa``) and forced to each backend (``torch-flash``,
    ``torch-efficient``, ``torch-cudnn``, ``torch-math``), fed the CuPy
    buffers zero-copy through DLPack;
on the CPU
    ``cupyflash`` (the NumPy CPU path), ``numpy-naive`` (matmul, softmax in
    place, matmul: the same ``naive_attention(..., oracle=False)``, the naive code
    ``python -m cupyflash`` times too) and, where PyTorch is installed,
    ``torch-sdpa``, ``torch-flash`` and ``torch-math`` on the NumPy buffers
    (``torch.from_numpy``, zero-copy).

The naive peers compute scores in the accumulator type (float32 for 16-bit
inputs) and hold the whole Lq x Lk matrix; their backward recomputes the
probabilities and forms the gradients with four more products.  PyTorch's
backward is ``torch.autograd.grad`` on a graph built once outside the timing.

FLOPs are counted as FlashAttention counts them (:func:`flop_count`): forward
``4·B·H·Lq·Lk·d``, halved for causal; backward 2.5 times that.  Times are the
median of ``repeat`` runs after a warm-up: CUDA events
(``cupyx.profiler.benchmark``) on the GPU, ``time.perf_counter`` on the CPU,
one implementation after the other (on the CPU after a short pause, ``settle_s``).
Peak memory is the extra memory one call needs beyond its inputs (the result
included), measured in a separate, untimed call: the high-water mark of a
fresh CuPy memory pool or ``torch.cuda.max_memory_allocated`` on the GPU;
``tracemalloc`` for NumPy code on the CPU, and for PyTorch on the CPU (whose
allocations tracemalloc does not see) the growth of the peak resident set
over one call in a fresh subprocess (Linux only: the peak is reset through
``/proc/self/clear_refs``).

PyTorch's ``is_causal`` is aligned to the top-left corner, cupyflash's to the
bottom-right; they agree only when Lq == Lk, so causal cases with Lq != Lk run
without the PyTorch peers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np

from ._arch import DMMA_ARCHS
from ._dtypes import accumulator_dtype, accumulator_name

__all__ = ["Case", "flop_count", "cases", "bench", "run_case", "blank_row", "per_impl_seconds",
           "peer_ratios", "gemm_shares",
           "environment", "markdown", "merge",
           "gpus", "gpu_available", "cuda_context_alive", "gemm_tflops", "main_bench", "COLUMNS", "REQUIRED_KEYS", "ROW_KEYS"]

# Columns of the Markdown table, in order.
COLUMNS = ("pass", "dtype", "B", "H", "Lq", "Lk", "d", "causal", "impl", "ms", "FLOP/s",
           "vs best peer", "% GEMM", "peak MiB", "memory via")
# Keys of the JSON document (:func:`bench`'s result) and of each of its rows.
REQUIRED_KEYS = ("schema", "gpu", "device", "date", "driver", "cuda", "cupy", "torch", "numpy",
                 "scipy", "python", "cpu", "blas", "gemm", "notes", "flop_count", "rows")
ROW_KEYS = ("impl", "kernel", "device", "pass", "dtype", "B", "H", "Lq", "Lk", "d", "causal",
            "flops", "ms", "ms_min", "repeats", "tflops", "vs_best_peer", "of_gemm",
            "peak_bytes", "peak_method", "max_abs_diff", "error", "scores")

SCHEMA = 1
PEER_NOTE = ("PyTorch's is_causal is aligned to the top-left corner and cupyflash's to the "
             "bottom-right; causal cases are compared with PyTorch only when Lq == Lk.")
_TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-efficient": "EFFICIENT_ATTENTION",
                   "torch-cudnn": "CUDNN_ATTENTION", "torch-math": "MATH"}
_TORCH_CPU_IMPLS = ("torch-sdpa", "torch-flash", "torch-math")
_TORCH_GPU_IMPLS = ("torch-sdpa", "torch-flash", "torch-efficient", "torch-cudnn", "torch-math")
# Implementations that hold the Lq x Lk score matrix (skipped where it would not fit).
_QUADRATIC = ("numpy-naive", "cupy-naive", "torch-math")
# Algorithm 1's SRAM size M for the fwd_v1 row, in bytes of the accumulator type: 32 KB
# keeps its four tiles within the 48 KB a kernel gets without an opt-in.
_V1_SRAM_BYTES = 32 * 1024
# Pause before each CPU implementation: the worker threads of the one before (OpenBLAS's
# pthreads, PyTorch's OpenMP) spin for a while after their last call, and on a machine
# with few cores they steal it from the next (measured on 2 cores: 2-3x slower right
# after a switch, the same as alone after 0.5 s).
_CPU_SETTLE_S = 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: inputs q ``(B, H, Lq, d)``, k and v ``(B, H, Lk, d)``."""

    dtype: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    backward: bool = False
    scores: str = ""        # "bias": a (1, H, Lq, Lk) bias; "mask": a (B, 1, 1, Lk) key mask

    @property
    def flops(self) -> float:
        return flop_count(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                          causal=self.causal, backward=self.backward)

    @property
    def pass_name(self) -> str:
        return "backward" if self.backward else "forward"


def flop_count(batch, heads, seqlen_q, seqlen_k, head_dim, *, causal=False,
               backward=False) -> float:
    """FLOPs of one attention call as FlashAttention's benchmarks count them.

    Forward ``4·B·H·Lq·Lk·d`` (two products of ``2·Lq·Lk·d``), halved for
    ``causal``; the backward (five products, the scores recomputed) is 2.5
    times the forward.

    Examples
    --------
    >>> from cupyflash._bench import flop_count
    >>> flop_count(1, 1, 1024, 1024, 64)
    268435456.0
    >>> flop_count(2, 16, 4096, 4096, 128, causal=True, backward=True) / 1e12
    0.34359738368
    """
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def cases(*, dtypes, batch, heads, seqlens, head_dims, seqlen_k=None, causal=(False,),
          backward=False, scores=("",)) -> list[Case]:
    """The Cartesian product of the options, forward cases then backward ones."""
    passes = (False, True) if backward else (False,)
    return [Case(dt, b, h, lq, seqlen_k or lq, d, c, bw, sc)
            for bw, dt, b, h, d, c, sc, lq in itertools.product(passes, dtypes, batch, heads, head_dims,
                                                                  causal, scores, seqlens)]


# ---- devices, dtypes, inputs ---------------------------------------------------------------------


def gpus() -> list[str]:
    """Names of the CUDA devices CuPy sees (empty without CuPy or a GPU)."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        names = []
        for i in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            names.append(f"{i}: {name} (sm_{props['major']}{props['minor']})")
        return names
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device all mean "no GPU"
        return []


def gpu_available() -> bool:
    """Whether CuPy sees a CUDA device (False without CuPy or a driver)."""
    return bool(gpus())


def cuda_context_alive() -> bool:
    """Whether CuPy's CUDA context still runs work.  An illegal instruction or address
    in a kernel is sticky: every later CUDA call in the process fails."""
    import cupy

    try:
        cupy.cuda.runtime.deviceSynchronize()
        return int(cupy.arange(4).sum()) == 6
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_inputs(case: Case, xp=np, seed: int = 0):
    """q, k, v and dout (standard normal, rounded to the case's dtype) as ``xp`` arrays."""
    rng = np.random.default_rng(seed)
    dtype = _dtype(case.dtype)
    shape_q = (case.batch, case.heads, case.seqlen_q, case.head_dim)
    shape_kv = (case.batch, case.heads, case.seqlen_k, case.head_dim)
    arrays = [rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
              for shape in (shape_q, shape_kv, shape_kv, shape_q)]
    return arrays if xp is np else [xp.asarray(a) for a in arrays]


def score_operands(case: Case, xp=np, seed: int = 0) -> dict:
    """The keywords of the case's score operand: ``bias`` (1, H, Lq, Lk) in the case's dtype
    (a per-head pair bias, standard normal), ``mask`` (B, 1, 1, Lk) bool (key padding: each
    batch entry's last eighth of the keys hidden), or none."""
    if not case.scores:
        return {}
    rng = np.random.default_rng([seed, 1])
    if case.scores == "bias":
        bias = rng.standard_normal((1, case.heads, case.seqlen_q, case.seqlen_k), dtype=np.float32)
        value = bias.astype(_dtype(case.dtype), copy=False)
    elif case.scores == "mask":
        value = np.ones((case.batch, 1, 1, case.seqlen_k), dtype=bool)
        value[..., case.seqlen_k - case.seqlen_k // 8:] = False
    else:
        raise ValueError(f"unknown score operand {case.scores!r}")
    return {case.scores: value if xp is np else xp.asarray(value)}


def _xp(device: str):
    if device == "cpu":
        return np
    import cupy

    return cupy


def _sync(device: str) -> None:
    if device == "gpu":
        import cupy

        cupy.cuda.Device().synchronize()


# ---- the implementations -------------------------------------------------------------------------


def _to_torch(x):
    """A PyTorch tensor sharing ``x``'s memory (NumPy or CuPy; bfloat16 by a uint16 view)."""
    import torch

    bf16 = x.dtype.name == "bfloat16"
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x.view(np.uint16) if bf16 else x)
    else:
        try:
            return torch.from_dlpack(x)
        except (TypeError, ValueError, RuntimeError, BufferError):   # no bfloat16 in DLPack
            if not bf16:
                raise
            t = torch.from_dlpack(x.view(np.uint16))
    return t.view(torch.bfloat16) if bf16 else t


def _to_numpy(x) -> np.ndarray:
    """NumPy copy of a NumPy/CuPy array or a PyTorch tensor, for comparing results: float64
    for float64, float32 for the rest."""
    if hasattr(x, "detach"):
        x = x.detach()
        return (x.double() if x.dtype.itemsize == 8 else x.float()).cpu().numpy()
    wide = accumulator_dtype(x.dtype)
    if not isinstance(x, np.ndarray):
        import cupy

        return cupy.asnumpy(x.astype(wide))
    return x.astype(wide)


def _torch_available(device: str) -> bool:
    try:
        import torch
    except Exception:  # noqa: BLE001 - an optional package that fails to import is "not installed"
        return False
    return device == "cpu" or bool(torch.cuda.is_available())


def implementations(device: str, case: Case, timing_only: bool = False) -> list[str]:
    """Names of the implementations that apply to ``case`` on ``device`` (cupyflash first);
    ``timing_only``: with the timing-only builds of fwd_wgmma (``cupyflash-wgmma-no-exp``,
    ``cupyflash-wgmma-no-copy``: :attr:`KernelOptions.timing
    <cupyflash._options.KernelOptions.timing>`, wrong outputs; ``cupyflash-wgmma-before-fixes``,
    the loop before issue 32's schedule fixes) for forward cases, and bwd_wgmma's
    (``cupyflash-wgmma-no-copy``) for backward ones."""
    names = ["cupyflash"]
    if case.scores:   # the other cupyflash rows (kernel variants) are timed without score operands
        names.append("numpy-naive" if device == "cpu" else "cupy-naive")
        if _torch_available(device) and not case.causal:   # SDPA takes attn_mask or is_causal
            names += _TORCH_CPU_IMPLS if device == "cpu" else _TORCH_GPU_IMPLS
        return names
    # the backward with dQ by atomics (deterministic=False)
    if device == "gpu" and case.backward:
        names.append("cupyflash-atomic")
    # the Hopper wgmma kernels (opt-in until measured), on compute capability 9.0
    if device == "gpu" and case.dtype in ("float16", "bfloat16") and _is_sm90():
        names.append("cupyflash-wgmma")
        from ._families import BWD_WGMMA, FWD_WGMMA

        decoupled = BWD_WGMMA.decoupled_tiles if case.backward else FWD_WGMMA.decoupled_head_dims
        if case.head_dim in decoupled:   # its decoupled rows
            names.append("cupyflash-wgmma-decoupled")
        if timing_only:
            names += (["cupyflash-wgmma-no-copy"] if case.backward else
                      ["cupyflash-wgmma-no-exp", "cupyflash-wgmma-no-copy", "cupyflash-wgmma-before-fixes"])
        if case.backward:
            names += ["cupyflash-wgmma-atomic", "cupyflash-wgmma-async-dq", "cupyflash-wgmma-ordered-dq"]
    # fwd_dmma / bwd_dmma, float64 on the FP64 tensor cores, and float32 computed there
    # in double (opt-in until measured)
    if device == "gpu" and case.dtype in ("float64", "float32") and _dmma_gpu():
        names.append("cupyflash-dmma")
    # fwd_tf32 / bwd_tf32, where the caller allows TF32 (precision="tf32" / "tf32x3")
    if device == "gpu" and case.dtype == "float32" and _tensor_core_gpu():
        names += ["cupyflash-tf32", "cupyflash-tf32x3"]
    # the literal Algorithm 1 (O, l, m through global memory) is a teaching kernel:
    # timed up to 4096 x 4096 scores per head, where a call still takes milliseconds
    if device == "gpu" and not case.backward and case.seqlen_q * case.seqlen_k <= 4096 * 4096:
        names.append("cupyflash-v1")
    names.append("numpy-naive" if device == "cpu" else "cupy-naive")
    if _torch_available(device) and not (case.causal and case.seqlen_q != case.seqlen_k):
        names += _TORCH_CPU_IMPLS if device == "cpu" else _TORCH_GPU_IMPLS
    return names


def prepare(impl: str, case: Case, inputs, device: str):
    """``(fn, kernel)``: a no-argument callable running ``impl`` on ``inputs`` once, and the
    cupyflash kernel family it runs (None for the peers).

    For a backward case the forward (cupyflash's lse, PyTorch's graph) is
    computed here, outside what ``fn`` runs.
    """
    import cupyflash

    q, k, v, dout, *extra = inputs
    scores = extra[0] if extra else {}
    causal = case.causal
    if impl == "cupyflash":
        kernel = _cupyflash_kernel(case, q, k, v, features=frozenset(scores)) if device == "gpu" else None
        if not case.backward:
            return (lambda: cupyflash.attention(q, k, v, causal=causal, **scores)), kernel
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, **scores)
        return (lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **scores),
                kernel)
    if impl == "cupyflash-atomic":
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
        return (lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                     deterministic=False),
                _cupyflash_kernel(case, q, k, v, deterministic=False))
    if impl in ("cupyflash-wgmma", "cupyflash-wgmma-atomic", "cupyflash-wgmma-async-dq", "cupyflash-wgmma-ordered-dq",
                "cupyflash-wgmma-no-exp", "cupyflash-wgmma-no-copy", "cupyflash-wgmma-before-fixes",
                "cupyflash-wgmma-decoupled", "cupyflash-dmma"):
        from ._api import run_attention, run_attention_backward
        from ._options import KernelOptions

        deterministic = impl not in ("cupyflash-wgmma-atomic", "cupyflash-wgmma-async-dq")
        env = KernelOptions.from_environment()
        timing = {"cupyflash-wgmma-no-exp": "no-exp", "cupyflash-wgmma-no-copy": "no-copy",
                  "cupyflash-wgmma-before-fixes": "before-fixes"}.get(impl)
        options = (env.replace(wgmma=True, async_dq=impl.endswith(("async-dq", "ordered-dq")), timing=timing,
                               decoupled=impl.endswith("decoupled"))
                   if impl.startswith("cupyflash-wgmma") else env.replace(dmma=frozenset({"float64", "float32"})))
        kernel = _cupyflash_kernel(case, q, k, v, deterministic=deterministic, options=options)
        if not case.backward:
            return (lambda: run_attention(q, k, v, causal=causal, options=options)), kernel
        # (a timing-only backward is fed a real forward's out and lse)
        out, lse = run_attention(q, k, v, causal=causal, return_lse=True, options=options.replace(timing=None))
        return (lambda: run_attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                               options=options)), kernel
    if impl in ("cupyflash-tf32", "cupyflash-tf32x3"):
        precision = impl.split("-")[1]
        kernel = _cupyflash_kernel(case, q, k, v, precision=precision)
        if not case.backward:
            return (lambda: cupyflash.attention(q, k, v, causal=causal, precision=precision)), kernel
        out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True, precision=precision)
        return (lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                     precision=precision)), kernel
    if impl == "cupyflash-v1":
        from .reference import flash_attention_v1

        sram = _V1_SRAM_BYTES // accumulator_dtype(case.dtype).itemsize
        return (lambda: flash_attention_v1(q, k, v, sram_size=sram, causal=causal)), "fwd_v1"
    if impl in ("numpy-naive", "cupy-naive"):
        from . import reference

        if case.backward:
            return (lambda: reference.naive_attention_backward(dout, q, k, v, causal=causal,
                                                               oracle=False, **scores)), None
        return (lambda: reference.naive_attention(q, k, v, causal=causal, oracle=False, **scores)), None
    if impl.startswith("torch-"):
        return _prepare_torch(impl, case, inputs), None
    raise ValueError(f"unknown implementation {impl!r}")


def _compute_capability() -> int:
    """The current CUDA device's compute capability as a number (90 for 9.0); 0 without
    CuPy or a device."""
    try:
        import cupy

        return int(cupy.cuda.Device().compute_capability)
    except Exception:  # noqa: BLE001 - no CuPy or no device
        return 0


def _dmma_gpu() -> bool:
    """Whether the current device is one fwd_dmma runs on (compute capability 8.0 or 9.0)."""
    return _compute_capability() in DMMA_ARCHS


def _tensor_core_gpu() -> bool:
    """Whether the current device has mma.sync's tensor cores (compute capability 8.0 or newer)."""
    return _compute_capability() >= 80


def _is_sm90() -> bool:
    return _compute_capability() == 90


def _cupyflash_kernel(case: Case, q, k, v, deterministic: bool = True, options=None,
                      precision: str = "ieee", features: frozenset = frozenset()) -> str:
    """The kernel family :func:`cupyflash.attention` dispatches to for these CuPy arrays
    under ``options`` (None: the environment's; backward: ``attention_backward`` with
    ``deterministic``; ", atomic dQ" where no dQ kernel runs; forward: ", N splits" where
    the keys are split over N CTAs)."""
    import cupy

    from ._launch import num_splits
    from ._options import KernelOptions
    from ._run import backward_plan, forward_plan

    options = KernelOptions.from_environment() if options is None else options
    arch = int(cupy.cuda.Device().compute_capability)
    # the output (and, backward, dout and dq) is allocated like q, so q stands for it
    if case.backward:
        # the delta pre-pass is always bwd_simt's; the family is that of the last launch
        rows = backward_plan(q, q, k, v, q, arch=arch, options=options, deterministic=deterministic,
                             precision=precision, features=features)
        atomic = not any(r.role == "dq" for r in rows)
        return rows[-1].family.name + (", atomic dQ" if atomic else "")
    _, (row,) = forward_plan(q, k, v, q, scale=1.0 / case.head_dim ** 0.5, arch=arch, options=options,
                             precision=precision, features=features)
    sms = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["multiProcessorCount"])
    splits = options.splits or num_splits(row, batch=case.batch, heads=case.heads, seqlen_q=case.seqlen_q,
                                          seqlen_k=case.seqlen_k, arch=arch, multiprocessors=sms)
    return row.family.name + (f", {splits} splits" if splits > 1 else "")


def _prepare_torch(impl: str, case: Case, inputs):
    import torch
    import torch.nn.functional as F

    tq, tk, tv, tdout = (_to_torch(x) for x in inputs[:4])
    # bias: attn_mask added to the scores, with its gradient in the backward; mask: a bool
    # attn_mask (True = may attend, as cupyflash's)
    operand = next(iter(inputs[4].values())) if len(inputs) > 4 and inputs[4] else None
    attn_mask = None if operand is None else _to_torch(operand)
    if impl == "torch-sdpa":
        backend = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kind = getattr(SDPBackend, _TORCH_BACKENDS[impl], None)
        if kind is None:
            raise RuntimeError(f"this PyTorch has no SDPBackend.{_TORCH_BACKENDS[impl]}")

        def backend():
            return sdpa_kernel(kind)

    def forward(q, k, v):
        with backend(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "X unavailable because ..." also comes as an error
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, attn_mask=mask)

    mask = attn_mask
    if not case.backward:
        return lambda: forward(tq, tk, tv)
    leaves = [t.detach().requires_grad_(True) for t in (tq, tk, tv)]
    if case.scores == "bias":
        mask = attn_mask.detach().requires_grad_(True)
        leaves.append(mask)
    out = forward(*leaves[:3])
    return lambda: torch.autograd.grad(out, leaves, tdout, retain_graph=True)


# ---- timing and memory ---------------------------------------------------------------------------


def _time_cpu(fn, repeat: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# A GPU left idle (while the next case's inputs are drawn on the host) drops its
# clocks; a few warm-up calls of a few ms do not bring them back.  Seen on an
# H200: the first implementation timed per case had medians up to 35 % above
# its minimum while the peers timed right after it were steady.  The next
# implementation of the same case starts on a GPU that was busy a few ms before.
_GPU_WARM_S = 0.3
_GPU_WARM_NEXT_S = 0.1


def keep_busy(fn, sync, *, calls: int, seconds: float) -> int:
    """Call ``fn`` (then ``sync``) at least ``calls`` times and for at least ``seconds``;
    return the number of calls.

    >>> n = keep_busy(lambda: None, lambda: None, calls=3, seconds=0.0)
    >>> n
    3
    """
    start, n = time.perf_counter(), 0
    while n < calls or time.perf_counter() - start < seconds:
        fn()
        sync()
        n += 1
    return n


def _time_gpu(fn, repeat: int, warmup: int, max_seconds: float, warm_s: float) -> list[float]:
    import cupy
    from cupyx.profiler import benchmark

    keep_busy(fn, cupy.cuda.Device().synchronize, calls=warmup, seconds=warm_s)
    result = benchmark(fn, (), n_repeat=repeat, n_warmup=0, max_duration=max_seconds)
    return [float(t) for t in result.gpu_times[0]]


def time_call(fn, device: str, *, repeat: int, warmup: int = 1, max_seconds: float = math.inf,
              warm_s: float = _GPU_WARM_S):
    """Seconds per call of ``fn``: CUDA-event times on the GPU, perf_counter on the CPU.
    On the GPU the warm-up is at least ``warmup`` calls and ``warm_s`` seconds."""
    if device == "gpu":
        return _time_gpu(fn, repeat, warmup, max_seconds, warm_s)
    return _time_cpu(fn, repeat, warmup)


def peak_tracemalloc(fn) -> int:
    """Bytes ``tracemalloc`` saw at its peak during one call (NumPy allocations included)."""
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        tracemalloc.stop()
    return int(peak)


def peak_cupy_pool(fn) -> int:
    """Bytes a fresh CuPy memory pool holds after one call: the call's high-water mark
    (a pool keeps freed blocks), in the pool's 512-byte rounding."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.cuda.MemoryPool()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        result = fn()
        cupy.cuda.Device().synchronize()
        del result
        return int(pool.total_bytes())
    finally:
        cupy.cuda.set_allocator(previous)
        pool.free_all_blocks()


def peak_torch_cuda(fn) -> int:
    """``torch.cuda.max_memory_allocated`` growth over one call."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return int(torch.cuda.max_memory_allocated() - base)


def _proc_status_bytes(field: str) -> int | None:
    """``VmRSS``/``VmHWM`` of this process from /proc (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set (VmHWM) to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_torch_cpu(impl: str, case: Case, seed: int, threads: int) -> int:
    """Growth of the peak resident set over one call of a PyTorch CPU implementation.

    Runs in a fresh process, which builds the same inputs, runs the
    implementation once on a tiny case (PyTorch's one-time set-up), resets its
    peak resident set (``/proc/self/clear_refs``) and reports the peak after
    the call minus the resident set before it.
    """
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    spec = json.dumps(dict(impl=impl, case=dataclasses.asdict(case), seed=seed, threads=threads))
    child = "from cupyflash._bench import _torch_cpu_child; _torch_cpu_child()"
    proc = subprocess.run([sys.executable, "-c", child], input=spec, capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    if proc.returncode:
        raise RuntimeError(f"memory subprocess failed: {proc.stderr.strip().splitlines()[-1:]}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


def _torch_cpu_child() -> None:
    """Body of :func:`peak_torch_cpu`'s subprocess (spec on stdin, result on stdout)."""
    import torch

    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    case = Case(**spec["case"])
    tiny = dataclasses.replace(case, batch=1, heads=1, seqlen_q=16, seqlen_k=16)
    _prepare_torch(spec["impl"], tiny, [*random_inputs(tiny), score_operands(tiny)])()
    fn = _prepare_torch(spec["impl"], case, [*random_inputs(case, seed=spec["seed"]),
                                             score_operands(case, seed=spec["seed"])])
    if not _reset_peak_rss():
        raise RuntimeError("cannot reset the peak resident set (/proc/self/clear_refs)")
    before = _proc_status_bytes("VmRSS")
    result = fn()
    peak = _proc_status_bytes("VmHWM") - before
    del result
    print(json.dumps(dict(peak_bytes=peak)))


def _peak(impl: str, fn, device: str, case: Case, seed: int) -> tuple[int | None, str | None]:
    if device == "gpu":
        if impl.startswith("torch-"):
            return peak_torch_cuda(fn), "torch.cuda.max_memory_allocated"
        return peak_cupy_pool(fn), "CuPy pool (fresh)"
    if impl.startswith("torch-"):
        if _proc_status_bytes("VmHWM") is None:
            return None, None
        import torch

        return peak_torch_cpu(impl, case, seed, torch.get_num_threads()), "peak RSS (subprocess)"
    return peak_tracemalloc(fn), "tracemalloc"


def _release(device: str, impl: str) -> None:
    """Hand cached device memory back, so that the next implementation finds it free."""
    if device != "gpu":
        return
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if impl.startswith("torch-"):
        import torch

        torch.cuda.empty_cache()


def _free_bytes(device: str) -> int:
    if device == "gpu":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 2**63


def gemm_tflops(device: str, dtype: str) -> dict:
    """Dense GEMM rate on random square operands, for the "% GEMM" column.

    ``n`` is 8192 on the GPU, 2048 on the CPU; the median of a few runs.
    """
    xp = _xp(device)
    n = 8192 if device == "gpu" else 2048
    rng = np.random.default_rng(1)
    a = xp.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(_dtype(dtype)))
    b = xp.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(_dtype(dtype)))
    times = time_call(lambda: xp.matmul(a, b), device, repeat=10 if device == "gpu" else 3,
                      warmup=2 if device == "gpu" else 1, max_seconds=5.0)
    return dict(dtype=dtype, n=n, tflops=round(2.0 * n**3 / statistics.median(times) / 1e12, 4))


def _gemm_dtype(device: str, dtype: str) -> str:
    """The GEMM a row of ``dtype`` is compared with: on the GPU the dense bfloat16 rate
    for every row (the device's headline rate), on the CPU BLAS in the accumulator type."""
    if device == "gpu":
        return "bfloat16"
    return accumulator_name(dtype)


def _gemm_reference(device: str, dtype: str) -> dict:
    """:func:`gemm_tflops`, falling back to float16 on a GPU without a bfloat16 GEMM."""
    error = None
    for candidate in (dtype, "float16") if dtype == "bfloat16" else (dtype,):
        try:
            return gemm_tflops(device, candidate)
        except Exception as exc:  # noqa: BLE001 - e.g. no bfloat16 matmul in this CuPy
            error = _short(exc)
    return dict(dtype=dtype, error=error)


# ---- one run -------------------------------------------------------------------------------------


def _max_abs_diff(result, reference) -> float | None:
    if reference is None:
        return None
    pairs = zip(result, reference) if isinstance(result, tuple) else [(result, reference)]
    return max(float(np.max(np.abs(_to_numpy(a) - b), initial=0.0)) for a, b in pairs)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120] if text else ''}".strip()


def run_case(case: Case, device: str, *, impls=None, exclude=(), repeat: int, warmup: int = 1,
             memory: bool = True, seed: int = 0, max_seconds: float = math.inf,
             settle_s: float = _CPU_SETTLE_S, on_start=None, on_row=None) -> list[dict]:
    """One row per implementation of ``case`` (see :func:`bench` for the row keys and
    the hooks)."""
    xp = _xp(device)
    inputs = [*random_inputs(case, xp, seed), score_operands(case, xp, seed)]
    names = [n for n in implementations(device, case)
             if (impls is None or _selected(n, impls)) and n not in exclude]
    score_bytes = (case.batch * case.heads * case.seqlen_q * case.seqlen_k
                   * accumulator_dtype(case.dtype).itemsize)
    reference = None
    rows = []
    for name in names:
        row = blank_row(case, name, device)
        if on_start:
            on_start(case, name)
        try:
            if name in _QUADRATIC and 4 * score_bytes > _free_bytes(device):
                raise MemoryError(f"skipped: the {score_bytes / 2**30:.1f} GiB score matrix "
                                  f"would not fit")
            if device == "cpu":
                time.sleep(settle_s)
            fn, row["kernel"] = prepare(name, case, inputs, device)
            result = fn()                                  # also the first warm-up
            _sync(device)
            if name == "cupyflash":
                reference = ([_to_numpy(r) for r in result] if isinstance(result, tuple)
                             else _to_numpy(result))
            row["max_abs_diff"] = _max_abs_diff(result, reference)
            del result
            times = time_call(fn, device, repeat=repeat, warmup=max(warmup - 1, 0),
                              max_seconds=max_seconds,
                              warm_s=_GPU_WARM_S if name == names[0] else _GPU_WARM_NEXT_S)
            ms = statistics.median(times) * 1e3
            row.update(ms=ms, ms_min=min(times) * 1e3, repeats=len(times),
                       tflops=case.flops / (ms * 1e-3) / 1e12)
            if memory:
                row["peak_bytes"], row["peak_method"] = _peak(name, fn, device, case, seed)
            del fn
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a case: a row says why
            row["error"] = _short(exc)
        _release(device, name)
        rows.append(row)
        if on_row:
            on_row(row)
    peer_ratios(rows)
    return rows


def blank_row(case: Case, impl: str, device: str) -> dict:
    """A row of :data:`ROW_KEYS` for ``impl`` on ``case``: the case's keys set, no time."""
    row = dict.fromkeys(ROW_KEYS)
    row.update({"impl": impl, "device": device, "pass": case.pass_name, "dtype": case.dtype,
                "B": case.batch, "H": case.heads, "Lq": case.seqlen_q, "Lk": case.seqlen_k,
                "d": case.head_dim, "causal": case.causal, "flops": case.flops,
                "scores": case.scores or None})
    return row


def per_impl_seconds(seconds_left: float, cases_left: int) -> float:
    """Timing budget of each implementation of the next case: an eighth of an even share
    of what is left, between 0.5 and 5 s."""
    return max(0.5, min(5.0, seconds_left / cases_left / 8))


def peer_ratios(rows) -> None:
    """Set ``vs_best_peer`` on one case's rows: the fastest peer's time (a peer is an
    implementation not named ``cupyflash*``) over each row's."""
    peer_ms = [r["ms"] for r in rows if r["ms"] and not r["impl"].startswith("cupyflash")]
    for r in rows:
        r["vs_best_peer"] = min(peer_ms) / r["ms"] if r["ms"] and peer_ms else None


def gemm_shares(rows, references: dict, device: str) -> None:
    """Set ``of_gemm`` on each row: its rate over the GEMM rate it is compared with
    (``references`` maps :func:`_gemm_dtype`'s names to :func:`gemm_tflops` results)."""
    for r in rows:
        rate = references.get(_gemm_dtype(device, r["dtype"]), {}).get("tflops")
        if r["tflops"] and rate:
            r["of_gemm"] = r["tflops"] / rate


def _selected(name: str, impls) -> bool:
    return any(name == i or (i.endswith("*") and name.startswith(i[:-1])) for i in impls)


def bench(case_list, *, device: str = "auto", impls=None, exclude=(), repeat: int | None = None,
          warmup: int = 1, memory: bool = True, gemm: bool = True, seed: int = 0,
          budget_s: float | None = None, settle_s: float = _CPU_SETTLE_S, log=None,
          on_start=None, on_row=None) -> dict:
    """Time every applicable implementation on each case; return the results document.

    Parameters
    ----------
    case_list : sequence of Case
        What to run (see :func:`cases`).
    device : {'auto', 'cpu', 'gpu'}
        'auto' is 'gpu' where CuPy sees a CUDA device, else 'cpu'.
    impls : sequence of str, optional
        Only these implementations (a trailing ``*`` matches a prefix, e.g.
        ``torch-*``); default all that apply.
    exclude : collection of str, optional
        Implementations left out (exact names).
    repeat : int, optional
        Timed runs per implementation and case (the median is reported);
        default 30 on the GPU, 5 on the CPU.
    warmup : int, default 1
        Untimed runs first.
    memory : bool, default True
        Measure peak memory (one more, untimed run; a subprocess for PyTorch on the CPU).
    gemm : bool, default True
        Measure the dense GEMM rate for the "% GEMM" column.
    seed : int, default 0
        Seed of the random inputs.
    budget_s : float, optional
        Stop starting new cases after this many seconds.
    settle_s : float, default 0.5
        Pause before each implementation on the CPU (the previous one's worker
        threads keep spinning for a while and would slow it on a small machine).
    log : callable, optional
        Called with a line of progress per row.
    on_start, on_row : callable, optional
        Called as ``on_start(case, impl)`` before each implementation is prepared
        and ``on_row(row)`` as soon as its row is complete (before the case's
        ``vs_best_peer`` is known). What either raises ends the run: this is how
        ``benchmarks/gpu_check.py`` watches a run from another process and stops
        one whose CUDA context a kernel has lost.

    Returns
    -------
    dict
        Keys :data:`REQUIRED_KEYS` (``gpu`` names the device or is None on the
        CPU) plus ``cpu_count``, ``torch_threads``, ``openblas_env``,
        ``load_average`` (at the start; ``load_average_end``), ``command``
        and ``seconds``; ``rows`` is a list of dicts with keys
        :data:`ROW_KEYS`: ``ms`` (median) and ``ms_min`` in milliseconds,
        ``tflops`` (FLOPs of :func:`flop_count` per second, in 10¹²),
        ``vs_best_peer`` (the fastest peer's time divided by this row's; the
        peers are the implementations not named ``cupyflash*``),
        ``of_gemm`` (``tflops`` over the GEMM rate), ``peak_bytes`` and its
        ``peak_method``, ``max_abs_diff`` (largest difference from
        cupyflash's result), ``error`` (why a row has no time) or None.

    Examples
    --------
    >>> from cupyflash._bench import Case, bench
    >>> doc = bench([Case("float32", 1, 1, 64, 64, 16)], device="cpu", impls=["cupyflash"],
    ...             repeat=1, memory=False, gemm=False, settle_s=0)
    >>> doc["gpu"] is None, [r["impl"] for r in doc["rows"]]
    (True, ['cupyflash'])
    """
    start = time.perf_counter()
    if device == "auto":
        device = "gpu" if gpu_available() else "cpu"
    if device not in ("cpu", "gpu"):
        raise ValueError(f"`device` must be 'auto', 'cpu' or 'gpu', got {device!r}")
    if device == "gpu" and not gpu_available():
        raise RuntimeError("no CUDA device: CuPy sees no GPU")
    repeat = repeat or (30 if device == "gpu" else 5)
    doc = environment(device)
    rows = []
    for i, case in enumerate(case_list):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            doc["notes"].append(f"time budget of {budget_s:g} s spent: {len(case_list) - i} "
                                f"case(s) not run")
            break
        left = math.inf if budget_s is None else budget_s - (time.perf_counter() - start)
        per_impl = per_impl_seconds(left, len(case_list) - i)
        case_rows = run_case(case, device, impls=impls, exclude=exclude, repeat=repeat,
                             warmup=warmup, memory=memory, seed=seed, max_seconds=per_impl,
                             settle_s=settle_s, on_start=on_start, on_row=on_row)
        for r in case_rows:
            if log:
                log(_progress(r))
        rows += case_rows
    # The GEMM rates last: a large multithreaded BLAS call just before a case can
    # leave BLAS threads spinning into it on a small, busy machine.
    references = {key: _gemm_reference(device, key) for key in
                  dict.fromkeys(_gemm_dtype(device, c.dtype) for c in case_list)} if gemm else {}
    doc["gemm"] = list(references.values())
    gemm_shares(rows, references, device)
    if any(c.causal for c in case_list) and _torch_available(device):
        doc["notes"].append(PEER_NOTE)
    doc["rows"] = rows
    doc["load_average_end"] = _load_average()
    doc["seconds"] = round(time.perf_counter() - start, 1)
    return doc


def _progress(r: dict) -> str:
    what = r["error"] or f"{r['ms']:.3f} ms  {_rate(r['tflops'], r['device'])}"
    return (f"  {r['pass']:>8} {r['dtype']:>8} B={r['B']} H={r['H']} Lq={r['Lq']} Lk={r['Lk']} "
            f"d={r['d']} causal={'yes' if r['causal'] else 'no':<3} {r['impl']:>15}: {what}")


# ---- environment ---------------------------------------------------------------------------------


def _cpu_info() -> dict:
    """Model name, family/model numbers and the vector extensions that matter for BLAS."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in ("model name", "cpu family", "model", "flags") and key not in info:
                    info[key] = value
    except OSError:
        pass
    flags = set(info.pop("flags", "").split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
    return dict(model=info.get("model name") or platform.processor() or platform.machine(),
                family=info.get("cpu family"), model_number=info.get("model"),
                features=[f for f in wanted if f in flags])


def _blas() -> dict | None:
    try:
        config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:  # noqa: BLE001 - older NumPy: no dict form
        return None
    keys = ("name", "version", "openblas configuration")
    return {k: config[k] for k in keys if config.get(k)}


def _version(name: str) -> str | None:
    try:
        return getattr(__import__(name), "__version__", "?")
    except Exception:  # noqa: BLE001 - not installed (or broken): recorded as None
        return None


def _source_revision() -> str | None:
    """The checkout's commit (``+dirty`` when cupyflash/ or cuda_src/ has local changes),
    or None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                  "cupyflash", "cuda_src"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if changes.strip() else "")


def _load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (other work on the machine skews CPU timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def environment(device: str) -> dict:
    """What a results file records about the machine and the software."""
    import scipy

    import cupyflash

    cpu = _cpu_info()
    doc = dict.fromkeys(REQUIRED_KEYS)
    doc.update(
        schema=SCHEMA, device=device,
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cupyflash=cupyflash.__version__, cupyflash_commit=_source_revision(),
        numpy=np.__version__, scipy=scipy.__version__,
        cupy=_version("cupy"), torch=_version("torch"), python=platform.python_version(),
        platform=platform.platform(), cpu=cpu.pop("model"), cpu_detail=cpu,
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        blas=_blas(),
        openblas_env={k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")},
        command="python -m cupyflash bench " + shlex.join(sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else None,
        flop_count="forward 4·B·H·Lq·Lk·d, halved for causal; backward 2.5x forward",
        load_average=_load_average(), notes=[],
    )
    if doc["torch"]:
        import torch

        doc["torch_threads"] = torch.get_num_threads()
    if device == "gpu":
        doc.update(_gpu_environment())
    else:
        doc["notes"].append("CPU-only run: no GPU used.")
    return doc


def _gpu_environment() -> dict:
    import cupy

    def version(v):
        return f"{v // 1000}.{(v % 1000) // 10}"

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    env = dict(gpu=name, compute_capability=f"{props['major']}.{props['minor']}",
               multiprocessors=props["multiProcessorCount"],
               memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
               driver=version(cupy.cuda.runtime.driverGetVersion()),
               cuda=version(cupy.cuda.runtime.runtimeGetVersion()))
    with contextlib.suppress(Exception):      # informational only
        env["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False).stdout.strip()
        if out:
            env["driver"] = out.splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if _torch_available("gpu"):
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


# ---- output --------------------------------------------------------------------------------------


def _rate(tflops: float | None, device: str) -> str:
    if tflops is None:
        return ""
    return f"{tflops:.1f} TFLOP/s" if device == "gpu" else f"{tflops * 1e3:.1f} GFLOP/s"


def markdown(doc: dict) -> str:
    """The results document as Markdown: a header, notes and one table row per row."""
    gpu = doc["device"] == "gpu"
    where = doc["gpu"] if gpu else f"{doc['cpu']} ({doc.get('cpu_count')} CPUs, no GPU used)"
    lines = [f"# cupyflash bench: {where}", "",
             f"{doc['date']}; cupyflash {doc.get('cupyflash')}"
             + (f" ({doc['cupyflash_commit']})" if doc.get("cupyflash_commit") else "")
             + f", NumPy {doc['numpy']}, SciPy {doc['scipy']}, CuPy "
             f"{doc['cupy'] or 'not installed'}, PyTorch {doc['torch'] or 'not installed'}"
             + (f" ({doc.get('torch_threads')} threads)" if doc["torch"] and not gpu else "")
             + f", Python {doc['python']}."]
    if gpu:
        lines.append(f"Compute capability {doc.get('compute_capability')}, driver {doc['driver']}, "
                     f"CUDA runtime {doc['cuda']}, NVRTC {doc.get('nvrtc')}.")
    else:
        blas = doc.get("blas") or {}
        lines.append(f"BLAS: {blas.get('name', '?')} {blas.get('version', '')}"
                     + (f"; OpenBLAS environment: {doc['openblas_env']}" if doc.get("openblas_env")
                        else "") + ".")
    for run in doc.get("runs") or [doc]:
        if run.get("command"):
            load = run.get("load_average")
            lines.append(f"`{run['command']}`" + (f" (load average {load[0]:g})" if load else "")
                         + ".")
    if doc.get("tests"):
        lines.append(f"`pytest -m gpu`: {doc['tests'].get('summary')}.")
    for g in doc.get("gemm") or []:
        if "tflops" in g:
            rate = _rate(g["tflops"], doc["device"])
            lines.append(f"Dense {g['dtype']} GEMM ({g['n']}³): {rate}.")
    unit = "TFLOP/s" if gpu else "GFLOP/s"
    clock = "CUDA events" if gpu else "wall clock, one implementation after the other"
    lines += ["", (f"FLOPs: {doc['flop_count']}. Times: median of the repeats after a warm-up "
                   f"({clock})."),
              ("vs best peer: the fastest non-cupyflash implementation's time divided by this "
               "row's (above 1: faster than every peer). Peak: extra memory of one call, result "
               "included.")]
    lines += [f"Note: {n}" for n in doc["notes"]]
    header = [unit if c == "FLOP/s" else c for c in COLUMNS]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in doc["rows"]:
        impl = r["impl"] + (f" ({r['kernel']})" if r["kernel"] else "")
        if r["error"]:
            timing = [r["error"].replace("|", "/"), "", "", ""]
        else:
            rate = r["tflops"] if gpu else r["tflops"] * 1e3
            timing = [f"{r['ms']:.3f}" if r["ms"] < 100 else f"{r['ms']:.1f}", f"{rate:.1f}",
                      f"{r['vs_best_peer']:.2f}x" if r["vs_best_peer"] else "",
                      f"{100 * r['of_gemm']:.0f}%" if r["of_gemm"] else ""]
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else ""
        cells = [r["pass"] + (f" + {r['scores']}" if r.get("scores") else ""), r["dtype"], str(r["B"]), str(r["H"]), str(r["Lq"]), str(r["Lk"]),
                 str(r["d"]), "yes" if r["causal"] else "no", impl] + timing + \
                [peak, r["peak_method"] or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- command line --------------------------------------------------------------------------------


def merge(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s rows, notes and GEMM rates added (both from one device);
    each run's date, command and load average are listed in ``runs``."""
    if (old.get("device"), old.get("gpu")) != (new.get("device"), new.get("gpu")):
        raise ValueError(f"cannot merge results of {new.get('gpu') or new.get('device')} into "
                         f"those of {old.get('gpu') or old.get('device')}")
    merged = dict(old)
    run_keys = ("date", "command", "cupyflash_commit", "load_average", "load_average_end",
                "seconds")
    merged["runs"] = old.get("runs") or [{k: old.get(k) for k in run_keys}]
    merged["runs"] = merged["runs"] + [{k: new.get(k) for k in run_keys}]
    merged["rows"] = old["rows"] + new["rows"]
    merged["notes"] = old["notes"] + [n for n in new["notes"] if n not in old["notes"]]
    have = {g["dtype"] for g in old.get("gemm") or []}
    merged["gemm"] = (old.get("gemm") or []) + [g for g in new.get("gemm") or []
                                                 if g["dtype"] not in have]
    return merged


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}; got {text!r}")
        return values
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupyflash bench",
        description="Time cupyflash side by side with naive attention and PyTorch's "
                    "scaled_dot_product_attention, on the same random inputs.")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="'auto': the GPU where CuPy sees one, else the CPU path (default)")
    p.add_argument("--batch", type=_ints, help="batch size(s), comma-separated (default 1 on the "
                   "CPU, 2 on the GPU)")
    p.add_argument("--heads", type=_ints,
                   help="head count(s) (default 1 on the CPU, 16 on the GPU)")
    p.add_argument("--seqlen", type=_ints, default=[1024, 4096],
                   help="query sequence length(s) (default 1024,4096)")
    p.add_argument("--seqlen-k", type=int, help="key sequence length (default: equal to Lq)")
    p.add_argument("--head-dim", type=_ints, default=[64], help="head dim(s) (default 64)")
    p.add_argument("--dtype", type=_names(("float16", "bfloat16", "float32", "float64")),
                   help="dtype(s) (default float32 on the CPU, float16,bfloat16,float32 on the "
                        "GPU)")
    p.add_argument("--causal", nargs="?", const="yes", default="no", choices=("no", "yes", "both"),
                   help="causal mask (bottom-right aligned); 'both' runs each case twice")
    p.add_argument("--backward", action="store_true", help="also time the backward pass")
    p.add_argument("--scores", type=_names(("none", "bias", "mask")), default=["none"],
                   help="score operands, comma-separated: 'bias' adds a (1, H, Lq, Lk) bias in the "
                        "case's dtype, 'mask' a (B, 1, 1, Lk) key-padding mask (PyTorch's peers get "
                        "them as attn_mask; not with --causal); default none")
    p.add_argument("--impls", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="only these implementations, e.g. 'cupyflash,numpy-naive' or 'torch-*'")
    p.add_argument("--repeat", type=int, help="timed runs per case (default 30 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--no-gemm", action="store_true", help="skip the dense-GEMM reference rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--settle", type=float, default=_CPU_SETTLE_S, metavar="SECONDS",
                   help=f"pause before each CPU implementation (default {_CPU_SETTLE_S})")
    p.add_argument("--budget", type=float, help="seconds after which no new case starts")
    p.add_argument("--note", action="append", default=[],
                   help="a line for the results' notes (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write the results document (JSON) here")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to the document already at --json PATH (same "
                        "device); the Markdown is then that of the whole document")
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown table here too")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main_bench(argv=None) -> int:
    """``python -m cupyflash bench [options]``; returns the exit status."""
    args = _parser().parse_args(argv)
    device = args.device
    if device == "auto":
        device = "gpu" if gpu_available() else "cpu"
    elif device == "gpu" and not gpu_available():
        print("bench: --device gpu, but CuPy sees no CUDA device", file=sys.stderr)
        return 2
    gpu = device == "gpu"
    case_list = cases(
        dtypes=args.dtype or (["float16", "bfloat16", "float32"] if gpu else ["float32"]),
        batch=args.batch or [2 if gpu else 1], heads=args.heads or [16 if gpu else 1],
        seqlens=args.seqlen, head_dims=args.head_dim, seqlen_k=args.seqlen_k,
        causal={"no": (False,), "yes": (True,), "both": (False, True)}[args.causal],
        backward=args.backward, scores=tuple("" if s == "none" else s for s in args.scores))
    # progress on stderr, so that stdout is the table alone
    print(f"bench: {len(case_list)} case(s) on the {'GPU' if gpu else 'CPU'}", file=sys.stderr,
          flush=True)
    doc = bench(case_list, device=device, impls=args.impls, repeat=args.repeat,
                warmup=args.warmup, memory=not args.no_memory, gemm=not args.no_gemm,
                seed=args.seed, budget_s=args.budget, settle_s=args.settle,
                log=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)))
    doc["notes"] += args.note
    if args.append and args.json and Path(args.json).is_file():
        doc = merge(json.loads(Path(args.json).read_text(encoding="utf-8")), doc)
    table = markdown(doc)
    print()
    print(table)
    for path, text in ((args.json, json.dumps(doc, indent=1) + "\n"), (args.markdown, table)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
            print(f"bench: wrote {path}", file=sys.stderr)
    return 0
