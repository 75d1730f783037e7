"""Calling attention from several threads at once.

CPU: the CPU path and the emulator backend called from 4 threads at the same
time (released together by a barrier) give correct results, bit-identical to
the same calls made one after another; the emulator's module cache builds a
module once however many threads ask for it.

GPU tier (``gpu``): threads on their own non-blocking streams (and on every
device present) give results bit-identical to serial runs, and the loader's
per-device module cache compiles each instantiation once
(``cupyflash._loader.module_caches``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch
from cupyflash.emulator import EmulatorExecutor, emulator_available
from cupyflash.reference import naive_attention, naive_attention_backward

from _util import assert_close, assert_grad_close, assert_lse_close, bfloat16

EMULATOR_OK, EMULATOR_WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not EMULATOR_OK, reason=f"CPU emulator unavailable: {EMULATOR_WHY}")

THREADS = 4


def jobs():
    """Eight (name, q, k, v, options) calls: every dtype, masks, GQA, several instantiations."""
    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float64, np.float16] + ([bfloat16] if bfloat16 is not None else [np.float16])
    out = []
    for n, dtype in enumerate(dtypes * 2):
        d = (16, 40, 64, 100)[n % 4]
        q = rng.standard_normal((2, 4, 40 + n, d)).astype(dtype)
        k = rng.standard_normal((2, 2, 70 - n, d)).astype(dtype)
        v = rng.standard_normal((2, 2, 70 - n, d)).astype(dtype)
        options = dict(enable_gqa=True, causal=n % 2 == 0, window=(40, None) if n >= 4 else None)
        out.append((f"{np.dtype(dtype).name}-d{d}-{n}", q, k, v, options))
    return out


def run_job(job, backend):
    """Forward and backward of one job: (out, lse, dq, dk, dv), NumPy arrays."""
    _, q, k, v, options = job
    out, lse = cupyflash.attention(q, k, v, return_lse=True, backend=backend, **options)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(q.dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
    return (out, lse, *grads)


def run_threads(work, items):
    """``work(item)`` for every item on THREADS threads released at once; results in order."""
    start = threading.Barrier(min(THREADS, len(items)))
    first = threading.local()

    def wrapped(item):
        if not getattr(first, "done", False):   # each worker waits once: all start together
            first.done = True
            start.wait(timeout=60)
        return work(item)

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        return list(pool.map(wrapped, items))


def assert_bit_identical(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-identical"


def check_against_oracle(job, result):
    _, q, k, v, options = job
    out, lse, *grads = result
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **options)
    assert_close(out, ref, q.dtype)
    assert_lse_close(lse, ref_lse, q.dtype)
    if q.dtype.itemsize > 2:
        dout = np.random.default_rng(1).standard_normal(out.shape).astype(q.dtype)
        for name, g, e in zip(("dq", "dk", "dv"), grads, naive_attention_backward(dout, q, k, v, **options)):
            assert_grad_close(g, e, q.dtype, what=name)


@pytest.mark.parametrize("backend", ["numpy", pytest.param("emulator", marks=needs_emulator)])
def test_four_threads_give_the_results_of_serial_calls(backend):
    work = jobs()
    serial = [run_job(job, backend) for job in work]
    concurrent = run_threads(lambda job: run_job(job, backend), work + work)     # each job twice at once
    for job, ref, got in zip(work + work, serial + serial, concurrent):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ref, got):
            assert_bit_identical(a, b, f"{job[0]} {name}")
    for job, result in zip(work, serial):
        check_against_oracle(job, result)


@needs_emulator
def test_emulator_builds_a_module_once_for_concurrent_first_calls(tmp_path, monkeypatch):
    import cupyflash.emulator._executor as executor_module
    from cupyflash.emulator._build import ModuleCache

    cache = ModuleCache(tmp_path)
    builds = []
    build = cache._build_module

    def counting_build(*args, **kwargs):
        builds.append(args[-1])
        return build(*args, **kwargs)

    monkeypatch.setattr(cache, "_build_module", counting_build)
    monkeypatch.setattr(executor_module, "_CACHE", cache)
    monkeypatch.setitem(_dispatch._executors, ("emulator",), EmulatorExecutor(arch=80, race_check=False))
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 40, 24)).astype(np.float32) for _ in range(3))
    outs = run_threads(lambda _: cupyflash.attention(q, k, v, backend="emulator"), range(2 * THREADS))
    assert builds == ["fwd_simt.cu"], builds        # one module (one instantiation) built, by one thread
    for out in outs[1:]:
        assert_bit_identical(out, outs[0], "out")
    assert_close(outs[0], naive_attention(q, k, v), np.float32)


# ---- GPU tier ---------------------------------------------------------------------------------------


def _devices():
    import cupy

    return list(range(cupy.cuda.runtime.getDeviceCount()))


@pytest.mark.gpu
def test_threads_on_streams_and_devices_give_serial_results():
    import cupy

    work = jobs()
    devices = _devices()

    def on_device(job, device):
        _, q, k, v, options = job
        with cupy.cuda.Device(device):
            qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
            out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, **options)
            dout = cupy.asarray(np.random.default_rng(1).standard_normal(out.shape).astype(q.dtype))
            grads = cupyflash.attention_backward(dout, qd, kd, vd, out, lse, **options)
            return [cupy.asnumpy(x) for x in (out, lse, *grads)]

    serial = {(i, dev): on_device(job, dev) for i, job in enumerate(work) for dev in devices}
    items = [(i, dev) for i in range(len(work)) for dev in devices] * 3

    def threaded(item):
        i, dev = item
        with cupy.cuda.Device(dev):
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                result = on_device(work[i], dev)
            stream.synchronize()
        return result

    for item, got in zip(items, run_threads(threaded, items)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), serial[item], got):
            assert_bit_identical(a, b, f"{work[item[0]][0]} on device {item[1]}: {name}")
    for i, job in enumerate(work):
        check_against_oracle(job, serial[(i, devices[0])])


@pytest.mark.gpu
def test_module_cache_compiles_each_instantiation_once_under_threads(monkeypatch):
    import cupy

    from cupyflash import _loader

    compiled = []
    lock = threading.Lock()

    def counting(device_id):
        compile_module = _loader._compile_rawmodule(device_id)

        def compile_and_count(entry, names):
            with lock:
                compiled.append((device_id, entry, names))
            return compile_module(entry, names)

        return compile_and_count

    caches = _loader._DeviceCaches(counting)
    monkeypatch.setattr(_loader, "module_caches", caches)
    monkeypatch.setattr(_dispatch, "_executors", {})          # new CudaExecutors, on the new caches
    work = jobs()
    devices = _devices()

    def threaded(item):
        i, dev = item
        _, q, k, v, options = work[i]
        with cupy.cuda.Device(dev):
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                out, lse = cupyflash.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, **options)
                cupyflash.attention_backward(out, *(cupy.asarray(x) for x in (q, k, v)), out, lse, **options)
            stream.synchronize()

    run_threads(threaded, [(i, dev) for i in range(len(work)) for dev in devices] * THREADS)
    assert compiled, "nothing was compiled through the counting caches"
    assert len(compiled) == len(set(compiled)), f"compiled more than once: {compiled}"
    for dev in devices:
        keys = {(entry, names) for d, entry, names in compiled if d == dev}
        assert set(caches.for_device(dev).compiled()) == keys
