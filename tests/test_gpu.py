"""Tier 1: the CUDA kernels on a real GPU, through the public API, against the float64 oracle.

Skipped cleanly where CuPy or a CUDA device is missing (tests/conftest.py).
The first fixture precompiles every catalogue kernel in parallel (a cold
NVRTC compile per instantiation), so the tests themselves only launch.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cupyflash
from cupyflash.reference import flash_attention_v1, naive_attention

from _util import DTYPES, DTYPE_IDS, HALF, assert_close, random_qkv

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every catalogue kernel, compiled once up front (timed: the cold-start cost)."""
    start = time.perf_counter()
    rows = cupyflash.precompile()
    return rows, time.perf_counter() - start


def _gpu(*arrays):
    return tuple(cp.asarray(a) for a in arrays)


def _host(x):
    return cp.asnumpy(x)


def _check(out, lse, q, k, v, dtype, *, factor=1.0, **kw):
    """Compare a GPU result (out, lse or None) with the oracle on the same rounded inputs."""
    ref = naive_attention(q, k, v, return_lse=lse is not None, **kw)
    ref_out, ref_lse = ref if lse is not None else (ref, None)
    out_h = _host(out)
    assert np.isfinite(out_h.astype(np.float64)).all(), "non-finite output"
    assert_close(out_h, ref_out, dtype, factor=factor)
    if lse is not None:
        lse_h = _host(lse).astype(np.float64)
        finite = np.isfinite(ref_lse)
        assert (np.isfinite(lse_h) == finite).all(), "lse -inf pattern differs from the oracle"
        tol = 1e-11 if np.dtype(dtype) == np.float64 else 2e-5
        np.testing.assert_allclose(lse_h[finite], ref_lse[finite], rtol=tol, atol=tol, err_msg="lse")


# ---- correctness matrix ----------------------------------------------------------------

HEAD_DIMS = [1, 3, 8, 16, 24, 32, 40, 48, 64, 72, 80, 96, 112, 128, 136, 160, 192, 200, 224, 256]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_head_dim_matches_oracle(rng, dtype, d):
    q, k, v = random_qkv(rng, (2, 3, 70, d), (2, 3, 131, d), (2, 3, 131, d), dtype)
    out, lse = cupyflash.attention(*_gpu(q, k, v), return_lse=True)
    assert out.dtype == dtype and isinstance(out, cp.ndarray)
    _check(out, lse, q, k, v, dtype)


@pytest.mark.parametrize("d, dv", [(64, 32), (32, 128), (80, 48), (16, 256)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_value_head_dim_differs(rng, dtype, d, dv):
    q, k, v = random_qkv(rng, (2, 33, d), (2, 65, d), (2, 65, dv), dtype)
    out = cupyflash.attention(*_gpu(q, k, v))
    _check(out, None, q, k, v, dtype)


@pytest.mark.parametrize("lq, lk", [(1, 1), (1, 300), (300, 1), (17, 33), (64, 64), (65, 63),
                                    (129, 257), (255, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sequence_tails(rng, dtype, lq, lk):
    q, k, v = random_qkv(rng, (2, 2, lq, 64), (2, 2, lk, 64), (2, 2, lk, 64), dtype)
    out, lse = cupyflash.attention(*_gpu(q, k, v), return_lse=True, scale=0.3)
    _check(out, lse, q, k, v, dtype, scale=0.3)


MASKS = [dict(causal=True), dict(window=(16, 8)), dict(window=(0, 0)), dict(window=(None, 4)),
         dict(window=(40, None)), dict(causal=True, window=(24, None))]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("lq, lk", [(96, 200), (200, 96), (128, 128), (37, 1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_causal_and_window(rng, dtype, lq, lk, mask):
    q, k, v = random_qkv(rng, (2, 2, lq, 64), (2, 2, lk, 64), (2, 2, lk, 64), dtype)
    out, lse = cupyflash.attention(*_gpu(q, k, v), return_lse=True, **mask)
    _check(out, lse, q, k, v, dtype, **mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_with_no_key_are_zero_with_lse_minus_inf(rng, dtype):
    # Lq > Lk with causal: the first Lq - Lk query rows see no key.
    q, k, v = random_qkv(rng, (1, 2, 150, 64), (1, 2, 50, 64), (1, 2, 50, 64), dtype)
    out, lse = cupyflash.attention(*_gpu(q, k, v), causal=True, return_lse=True)
    out_h, lse_h = _host(out).astype(np.float64), _host(lse)
    assert (out_h[..., :100, :] == 0).all()
    assert np.isneginf(lse_h[..., :100]).all()
    _check(out, lse, q, k, v, dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_query_and_multi_query(rng, dtype):
    q, k, v = random_qkv(rng, (2, 8, 77, 64), (2, 2, 90, 64), (2, 2, 90, 64), dtype)
    out = cupyflash.attention(*_gpu(q, k, v), enable_gqa=True, causal=True)
    _check(out, None, q, k, v, dtype, enable_gqa=True, causal=True)
    # a size-1 key/value head axis broadcasts: multi-query attention
    q, k, v = random_qkv(rng, (2, 4, 77, 32), (2, 1, 90, 32), (2, 1, 90, 32), dtype)
    out = cupyflash.attention(*_gpu(q, k, v))
    _check(out, None, q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_blhd_strided_views_run_zero_copy(rng, dtype):
    # (B, L, H, d) buffers seen as (B, H, L, d): the layout FlashAttention and JAX use
    qb, kb, vb = random_qkv(rng, (2, 100, 4, 64), (2, 120, 4, 64), (2, 120, 4, 64), dtype)
    qg, kg, vg = (x.transpose(0, 2, 1, 3) for x in _gpu(qb, kb, vb))
    assert not qg.flags.c_contiguous
    out = cupyflash.attention(qg, kg, vg, causal=True)
    _check(out, None, *(x.transpose(0, 2, 1, 3) for x in (qb, kb, vb)), dtype, causal=True)
    # every other head of a larger buffer (a non-mergeable batch stride)
    q, k, v = random_qkv(rng, (2, 6, 50, 32), (2, 6, 60, 32), (2, 6, 60, 32), dtype)
    out = cupyflash.attention(*(x[:, ::2] for x in _gpu(q, k, v)))
    _check(out, None, q[:, ::2], k[:, ::2], v[:, ::2], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_poisoned_with_nan_is_fully_written_and_nothing_else(rng, dtype):
    q, k, v = random_qkv(rng, (2, 3, 70, 64), (2, 3, 90, 64), (2, 3, 90, 48), dtype)
    base = cp.full((2, 3, 70, 56), np.nan, dtype=dtype)       # 8 columns of padding
    out = base[..., :48]
    result = cupyflash.attention(*_gpu(q, k, v), out=out)
    assert result is out
    _check(out, None, q, k, v, dtype)
    assert cp.isnan(base[..., 48:].astype(cp.float32)).all(), "wrote outside `out`"
    # a transposed (B, L, H, dv) output
    base = cp.full((2, 70, 3, 48), np.nan, dtype=dtype)
    out = base.transpose(0, 2, 1, 3)
    cupyflash.attention(*_gpu(q, k, v), out=out)
    _check(out, None, q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_repeated_runs_are_bit_identical(rng, dtype):
    q, k, v = _gpu(*random_qkv(rng, (2, 4, 300, 128), (2, 4, 333, 128), (2, 4, 333, 128), dtype))
    first = cupyflash.attention(q, k, v, causal=True)
    for _ in range(3):
        again = cupyflash.attention(q, k, v, causal=True)
        assert cp.array_equal(first.view(cp.uint8), again.view(cp.uint8))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", HALF + [np.dtype(np.float32)], ids=lambda d: str(d))
def test_large_shape(rng, dtype, causal):
    """B=2, H=8, L=4096, d=128; two heads checked against the oracle in full."""
    shape = (2, 8, 4096, 128)
    q, k, v = random_qkv(rng, shape, shape, shape, dtype)
    out = cupyflash.attention(*_gpu(q, k, v), causal=causal)
    out_h = _host(out)
    assert np.isfinite(out_h.astype(np.float32)).all()
    for b, h in [(0, 0), (1, 7)]:
        ref = naive_attention(q[b, h], k[b, h], v[b, h], causal=causal)
        assert_close(out_h[b, h], ref, dtype, what=f"head ({b}, {h})")


def test_two_threads_on_two_streams(rng):
    dtype = np.dtype(np.float16)
    inputs = [_gpu(*random_qkv(rng, (2, 4, 512, 64), (2, 4, 512, 64), (2, 4, 512, 64), dtype))
              for _ in range(2)]
    expected = [_host(cupyflash.attention(*x, causal=True)) for x in inputs]
    results, errors = [None, None], []
    start = threading.Barrier(2)

    def work(i):
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                start.wait()
                outs = [cupyflash.attention(*inputs[i], causal=True) for _ in range(20)]
                stream.synchronize()
            results[i] = [_host(o) for o in outs]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(2):
        for o in results[i]:
            assert np.array_equal(o.view(np.uint16), expected[i].view(np.uint16))


def test_launches_on_the_current_stream(rng):
    """Work queued on a non-blocking stream is complete after that stream alone syncs."""
    q, k, v = _gpu(*random_qkv(rng, (4, 8, 2048, 64), (4, 8, 2048, 64), (4, 8, 2048, 64),
                               np.dtype(np.float16)))
    ref = _host(cupyflash.attention(q, k, v))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.full(ref.shape, np.nan, ref.dtype)
        cupyflash.attention(q, k, v, out=out)
        copy = cp.empty(ref.shape, ref.dtype)
        copy[...] = out              # same stream: ordered after the kernel
    stream.synchronize()
    assert np.array_equal(_host(copy).view(np.uint16), ref.view(np.uint16))


def test_peak_device_memory_grows_linearly_in_sequence_length(rng):
    from cupyflash import _launch
    from cupyflash._families import FORWARD, Call, select
    from cupyflash._options import KernelOptions

    dtype = np.dtype(np.float16)
    device = cp.cuda.Device()
    arch = int(device.compute_capability)
    sms = int(cp.cuda.runtime.getDeviceProperties(device.id)["multiProcessorCount"])
    measured = {}
    for length in (1024, 4096):
        # with so few query blocks the forward may split the keys (split-KV): its partial
        # results, splits x rows x (dv + 1) floats, come on top of out and lse
        (inst,) = select(FORWARD, Call(dtype.name, 64, 64, aligned=True), arch, KernelOptions.from_environment())
        splits = _launch.num_splits(inst, batch=1, heads=4, seqlen_q=length, seqlen_k=length,
                                    arch=arch, multiprocessors=sms)
        partials = 0 if splits == 1 else splits * 4 * length * (64 + 1) * 4
        q, k, v = _gpu(*random_qkv(rng, (1, 4, length, 64), (1, 4, length, 64),
                                   (1, 4, length, 64), dtype))
        cp.cuda.Device().synchronize()
        pool = cp.cuda.MemoryPool()
        previous = cp.cuda.get_allocator()
        cp.cuda.set_allocator(pool.malloc)
        try:
            out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
            cp.cuda.Device().synchronize()
            measured[length] = pool.total_bytes() - partials   # the pool only grows: its peak
            expected = out.nbytes + lse.nbytes
            del out, lse
        finally:
            cp.cuda.set_allocator(previous)
        # no L x L (or L x L / block) scratch: at most the outputs (and partials) plus 1 MiB
        assert 0 <= measured[length] <= expected + 2**20, (length, measured[length], expected, splits)
    assert measured[4096] <= 4 * measured[1024] + 2**20


def test_precompile_returns_the_compiled_catalogue(compiled):
    from cupyflash._families import BWD_SIMT, FWD_SIMT, FWD_V1, catalogue, launchable
    from cupyflash._loader import module_caches

    rows, seconds = compiled
    arch = int(cp.cuda.Device().compute_capability)
    assert rows == [r for r in catalogue() if r in launchable(arch)]
    assert {r.family for r in rows} >= {FWD_SIMT, BWD_SIMT, FWD_V1}
    cache = module_caches.for_device(cp.cuda.runtime.getDevice())
    done = {names for _, names in cache.compiled()}
    assert all((r.name_expression,) in done for r in rows)
    start = time.perf_counter()
    again = cupyflash.precompile(dtypes=["float16"], head_dims=[64])
    assert again and all(r.dtype == "float16" and r.head_dim >= 64 for r in again)
    assert time.perf_counter() - start < 1.0, "already-compiled kernels were compiled again"
    print(f"precompile of {len(rows)} kernels took {seconds:.1f} s")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fwd_v1_kernel_matches_oracle(rng, dtype):
    q, k, v = random_qkv(rng, (2, 2, 70, 32), (2, 2, 90, 32), (2, 2, 90, 32), dtype)
    out, lse = flash_attention_v1(*_gpu(q, k, v), sram_size=2048, causal=True, return_lse=True)
    _check(out, lse, q, k, v, dtype, causal=True)


# ---- the executor itself ---------------------------------------------------------------------


def test_executor_reports_the_device_arch():
    from cupyflash._loader import CudaExecutor

    major, minor = cp.cuda.Device().compute_capability[:-1], cp.cuda.Device().compute_capability[-1]
    assert CudaExecutor().arch == int(major) * 10 + int(minor)


def test_cuda_errors_surface_as_exceptions():
    from cupyflash._families import catalogue
    from cupyflash._loader import CudaExecutor

    inst = catalogue()[0]
    params = np.zeros((), dtype=[("raw", np.uint8, (1024,))])[()]
    ex = CudaExecutor()
    with pytest.raises(cp.cuda.driver.CUDADriverError):
        ex.launch(inst.entry, inst.name_expression, (1,), (4096,), 0, params)   # > 1024 threads
    with pytest.raises(ValueError, match="shared memory"):
        ex.launch(inst.entry, inst.name_expression, (1,), (inst.threads,), 1 << 30, params)
    with pytest.raises(Exception, match="no_such_kernel"):
        ex.launch(inst.entry, "cf::no_such_kernel<1>", (1,), (32,), 0, params)


# ---- emulator fidelity: cuda_src/fidelity.cu on the device and in the emulator -----------------
#
# Each micro-kernel runs with the same inputs through CudaExecutor and
# EmulatorExecutor; data movement (ldmatrix, shuffles, cp.async, packing, tf32
# rounding) must agree bit for bit, mma to float32 rounding (the PTX ISA leaves
# its accumulation order open), ex2.approx within its 2-ulp contract.  The
# fragment tables themselves are checked on the CPU in tests/test_emulator.py.

from _emulator_util import FID_DTYPE, FIDELITY, FIDELITY_KERNELS, SHFL_NUMPY, SHFL_TYPES  # noqa: E402

WARPS = 2
THREADS = 32 * WARPS
UNWRITTEN = 0xDEADBEEF


@pytest.fixture(scope="module")
def executors():
    """(device executor, emulator executor) with the fidelity module built once on each."""
    from cupyflash._loader import CudaExecutor
    from cupyflash.emulator import EmulatorExecutor, emulator_available

    ok, reason = emulator_available()
    if not ok:
        pytest.skip(f"CPU emulator unavailable: {reason}")
    device = CudaExecutor(synchronize=True)
    device.cache().module(FIDELITY, FIDELITY_KERNELS)
    emulator = EmulatorExecutor(arch=device.arch, seed=0)
    emulator.compile(FIDELITY, FIDELITY_KERNELS)
    return device, emulator


def _fid_params(pointers, n=0, arg0=0, arg1=0, arg2=0):
    return np.array(tuple(pointers) + (n, arg0, arg1, arg2), dtype=FID_DTYPE)[()]


def run_fidelity(executors, name, grid, block, smem, inputs, outputs, **args):
    """Run ``name`` on both executors; returns (device outputs, emulator outputs) as NumPy."""
    device, emulator = executors
    ins = list(inputs) + [None] * (3 - len(inputs))
    outs = list(outputs) + [None] * (2 - len(outputs))

    d_ins = [None if a is None else cp.asarray(a) for a in ins]
    d_outs = [None if a is None else cp.asarray(a) for a in outs]
    ptrs = [0 if a is None else a.data.ptr for a in d_ins + d_outs]
    device.launch(FIDELITY, name, grid, block, smem, _fid_params(ptrs, **args))

    h_ins = [None if a is None else np.ascontiguousarray(a) for a in ins]
    h_outs = [None if a is None else a.copy() for a in outs]
    ptrs = [0 if a is None else a.ctypes.data for a in h_ins + h_outs]
    emulator.launch(FIDELITY, name, grid, block, smem, _fid_params(ptrs, **args))
    return ([cp.asnumpy(a) for a in d_outs if a is not None], [a for a in h_outs if a is not None])


def assert_bits_equal(device_out, emulated_out, what):
    for i, (d, e) in enumerate(zip(device_out, emulated_out)):
        assert np.array_equal(d.view(np.uint8), e.view(np.uint8)), \
            f"{what}: output {i} differs in {(d.view(np.uint8) != e.view(np.uint8)).sum()} bytes"


def _bf16_fragments(rng, shape):
    bits = rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16
    return bits.astype(np.uint16).view(np.uint32)


@pytest.mark.parametrize("name", ["fid_mma_f16", "fid_mma_bf16"])
def test_fidelity_mma_16816_to_float32_rounding(executors, rng, name):
    if name == "fid_mma_f16":
        a = rng.standard_normal((THREADS, 8)).astype(np.float16).view(np.uint32)
        b = rng.standard_normal((THREADS, 4)).astype(np.float16).view(np.uint32)
    else:
        a, b = _bf16_fragments(rng, (THREADS, 8)), _bf16_fragments(rng, (THREADS, 4))
    c = rng.standard_normal((THREADS, 4)).astype(np.float32)
    d0 = np.full((THREADS, 4), np.nan, np.float32)
    (dev,), (emu,) = run_fidelity(executors, name, 1, THREADS, 0, [a, b, c], [d0])
    assert np.isfinite(dev).all()
    np.testing.assert_allclose(dev, emu, rtol=1e-6, atol=1e-5)


def test_fidelity_mma_tf32(executors, rng):
    a = rng.standard_normal((THREADS, 4)).astype(np.float32)
    b = rng.standard_normal((THREADS, 2)).astype(np.float32)
    c = rng.standard_normal((THREADS, 4)).astype(np.float32)
    d0 = np.full((THREADS, 4), np.nan, np.float32)
    regs0 = np.zeros((THREADS, 6), np.uint32)
    (dev_d, dev_regs), (emu_d, emu_regs) = run_fidelity(executors, "fid_mma_tf32", 1, THREADS, 0,
                                                        [a, b, c], [d0, regs0])
    np.testing.assert_array_equal(dev_regs, emu_regs)          # cvt.rna.tf32: bit for bit
    np.testing.assert_allclose(dev_d, emu_d, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", ["false", "true"])
def test_fidelity_ldmatrix_bit_exact(executors, rng, num, trans):
    smem_bytes = 4096
    smem = rng.integers(0, 2**16, smem_bytes // 2, dtype=np.uint16)
    offsets = (rng.permutation(smem_bytes // 16)[:THREADS] * 16).astype(np.int32)
    out0 = np.full((THREADS, num), UNWRITTEN, np.uint32)
    dev, emu = run_fidelity(executors, f"fid_ldmatrix<{num}, {trans}>", 1, THREADS, smem_bytes,
                            [smem, offsets], [out0], n=smem_bytes)
    assert_bits_equal(dev, emu, f"ldmatrix x{num} trans={trans}")


def _shfl_values(rng, ctype):
    dt = SHFL_NUMPY[ctype]
    if np.dtype(dt).kind == "f":
        return rng.standard_normal(THREADS).astype(dt)
    return rng.integers(0, 2**32, THREADS, dtype=np.uint64).astype(np.uint32).view(dt)


@pytest.mark.parametrize("ctype", SHFL_TYPES)
def test_fidelity_shuffles_bit_exact(executors, rng, ctype):
    v = _shfl_values(rng, ctype)
    for width in (32, 16, 8, 1):
        for lane_mask in (1, 5, 16, 31):
            dev, emu = run_fidelity(executors, f"fid_shfl_xor<{ctype}>", 1, THREADS, 0, [v],
                                    [np.zeros_like(v), np.zeros_like(v)], arg0=lane_mask, arg1=width)
            assert_bits_equal(dev, emu, f"shfl_xor mask {lane_mask} width {width}")
        src = rng.integers(0, 64, THREADS).astype(np.int32)
        dev, emu = run_fidelity(executors, f"fid_shfl_idx<{ctype}>", 1, THREADS, 0, [v, src],
                                [np.zeros_like(v), np.zeros_like(v)], arg1=width)
        assert_bits_equal(dev, emu, f"shfl_idx width {width}")
        for delta in (0, 1, 3, 8):
            dev, emu = run_fidelity(executors, f"fid_shfl_updown<{ctype}>", 1, THREADS, 0, [v],
                                    [np.zeros_like(v), np.zeros_like(v)], arg0=delta, arg1=width)
            assert_bits_equal(dev, emu, f"shfl_up/down delta {delta} width {width}")


@pytest.mark.parametrize("n", [0, 1, 2])
@pytest.mark.parametrize("empty_groups", [0, 1])
def test_fidelity_cp_async_groups_bit_exact(executors, rng, n, empty_groups):
    # arg0 = 0 only: reading copies still in flight is undefined on the device.
    src = rng.integers(0, 2**32, THREADS * 12 + 4, dtype=np.uint64).astype(np.uint32)
    src_bytes = rng.choice(np.array([0, 1, 5, 15, 16], np.int32), size=(THREADS, 3))
    out0 = np.full((THREADS, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((THREADS, 12), np.uint32)
    dev, emu = run_fidelity(executors, f"fid_cp_async<{n}>", 1, THREADS, 48 * THREADS,
                            [src, src_bytes], [out0, out1], arg2=empty_groups)
    assert_bits_equal(dev, emu, f"cp.async wait_group {n}")


def test_fidelity_cp_async_4_bit_exact(executors, rng):
    src = rng.integers(1, 2**32, THREADS * 4, dtype=np.uint64).astype(np.uint32)
    src_bytes = rng.choice(np.array([0, 4], np.int32), size=(THREADS, 4))
    dev, emu = run_fidelity(executors, "fid_cp_async_4", 1, THREADS, 16 * THREADS, [src, src_bytes],
                            [np.full((THREADS, 4), UNWRITTEN, np.uint32)])
    assert_bits_equal(dev, emu, "cp.async 4 bytes")


def test_fidelity_pack_and_tf32_rounding_bit_exact(executors, rng):
    # finite and infinite values (NaN payloads of the conversions are not specified)
    x = np.concatenate([rng.standard_normal(190) * 100, [65520.0, -65504.0, 1e-8, -0.0, np.inf, -np.inf,
                                                          3.0e38, 1e-40, 6.1e-5, 7.0]]).astype(np.float32)
    dev, emu = run_fidelity(executors, "fid_pack", 1, 64, 0, [x],
                            [np.zeros(100, np.uint32), np.zeros(100, np.uint32)], n=100)
    assert_bits_equal(dev, emu, "pack_half2 / pack_bf162")
    bits = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    bits[:6] = [0x3F800FFF, 0x3F801000, 0x3F801001, 0x7F7FFFFF, 0x00000001, 0xFF800000]
    dev, emu = run_fidelity(executors, "fid_to_tf32", 2, 128, 0, [bits.view(np.float32)],
                            [np.zeros(1000, np.uint32)], n=1000)
    finite = np.isfinite(bits.view(np.float32))   # NaN payloads after cvt.rna are not specified
    np.testing.assert_array_equal(dev[0][finite], emu[0][finite])


def test_fidelity_exp2_approx_within_contract(executors, rng):
    x = np.concatenate([rng.uniform(-125, 127, 4000),
                        [-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-40, -126.0, -126.5, -140.0, 127.99]]
                       ).astype(np.float32)
    dev, emu = run_fidelity(executors, "fid_exp2", 4, 128, 0, [x], [np.full_like(x, 7.0)], n=x.size)
    dev, emu = dev[0], emu[0]
    exact = np.exp2(x.astype(np.float64))
    normal = np.isfinite(x) & (exact >= np.finfo(np.float32).tiny) & (exact < np.finfo(np.float32).max)
    ulp = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(dev[normal] - exact[normal]) <= 2 * ulp), "device ex2.approx outside 2 ulp"
    assert np.all(np.abs(dev[normal] - emu[normal]) <= 2 * ulp)
    special = ~normal
    np.testing.assert_array_equal(dev[special], emu[special])   # inf, NaN, zeros, flushed subnormals
