"""Run-to-run determinism: forward and default backward are bit-identical on every backend.

The CPU path is run three times.  The emulator is run with executors of
different seeds, which change the order in which blocks and threads run
(``EmulatorExecutor(seed=...)``, swapped in for the one ``executor_for``
caches), through the public API, over every kernel family: fwd_simt, fwd_mma,
fwd_v1, bwd_simt, bwd_mma.  The GPU tier repeats each call on the device, on
the default and on a non-blocking stream.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch
from cupyflash.emulator import EmulatorExecutor, emulator_available
from cupyflash.reference import flash_attention_v1

from _util import DTYPES

EMULATOR_OK, EMULATOR_WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not EMULATOR_OK, reason=f"CPU emulator unavailable: {EMULATOR_WHY}")

# (id, dtype, head dim, kv heads, options): several query and key blocks, a broadcast
# (multi-query) or grouped kv head axis, masks.  float16 and bfloat16 with d == dv and
# aligned rows run the tensor-core kernels, the rest SIMT.
CASES = [(f"{d.name}-{name}", d, head_dim, kv_heads, options)
         for d in DTYPES
         for name, head_dim, kv_heads, options in (
             ("d64-causal-mqa", 64, 1, dict(causal=True)),
             ("d40-window-gqa", 40, 2, dict(window=(30, 5), enable_gqa=True)))]


def problem(dtype, head_dim, kv_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 4, 150, head_dim)).astype(dtype)
    k = rng.standard_normal((1, kv_heads, 130, head_dim)).astype(dtype)
    v = rng.standard_normal((1, kv_heads, 130, head_dim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


def forward_and_backward(q, k, v, dout, options, backend, to_device=np.asarray, to_host=np.asarray):
    qd, kd, vd, dd = (to_device(x) for x in (q, k, v, dout))
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, backend=backend, **options)
    grads = cupyflash.attention_backward(dd, qd, kd, vd, out, lse, backend=backend, **options)
    return [to_host(x) for x in (out, lse, *grads)]


def assert_runs_identical(runs):
    for run in runs[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], run):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), f"{name} differs between runs"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_path_is_bit_identical_across_runs(case):
    _, dtype, head_dim, kv_heads, options = case
    q, k, v, dout = problem(dtype, head_dim, kv_heads)
    assert_runs_identical([forward_and_backward(q, k, v, dout, options, "numpy") for _ in range(3)])


@needs_emulator
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_emulated_kernels_are_bit_identical_across_thread_and_block_orders(case, monkeypatch):
    _, dtype, head_dim, kv_heads, options = case
    q, k, v, dout = problem(dtype, head_dim, kv_heads)
    runs = []
    for seed in (0, 1, 2):
        monkeypatch.setitem(_dispatch._executors, ("emulator",), EmulatorExecutor(arch=80, seed=seed))
        runs.append(forward_and_backward(q, k, v, dout, options, "emulator"))
    assert_runs_identical(runs)


@needs_emulator
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_emulated_fwd_v1_is_bit_identical_across_thread_and_block_orders(dtype, monkeypatch):
    q, k, v, _ = problem(dtype, 24, kv_heads=4, seed=1)
    runs = []
    for seed in (0, 1):
        monkeypatch.setitem(_dispatch._executors, ("emulator",), EmulatorExecutor(arch=80, seed=seed))
        runs.append(flash_attention_v1(q, k, v, sram_size=1024, causal=True, return_lse=True,
                                       backend="emulator"))
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_is_bit_identical_across_runs_and_streams(case):
    import cupy

    _, dtype, head_dim, kv_heads, options = case
    q, k, v, dout = problem(dtype, head_dim, kv_heads)
    runs = [forward_and_backward(q, k, v, dout, options, "cuda", cupy.asarray, cupy.asnumpy) for _ in range(3)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        runs.append(forward_and_backward(q, k, v, dout, options, "cuda", cupy.asarray, cupy.asnumpy))
    assert_runs_identical(runs)
