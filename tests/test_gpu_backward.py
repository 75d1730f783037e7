"""Tier 1: the CUDA backward kernels (bwd_simt, bwd_mma) on a real GPU, against the float64 oracle.

Skipped cleanly where CuPy or a CUDA device is missing (tests/conftest.py).
The matrix of tests/test_backward_emulated.py on the device, through the
public API (out and lse from the GPU forward), plus what only a GPU shows:
gradients poisoned with NaN are fully written, repeated runs are bit-identical,
work goes to the current stream, and the backward's device memory grows like
L, not L^2.  float32 and float64 gradients are compared to rounding; float16
and bfloat16 ones within 1.25 times the error of a half-precision yardstick
that rounds where the kernels must (tests/_backward_util.py).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import cupyflash
from cupyflash import _run
from cupyflash._dispatch import executor_for
from cupyflash._families import BACKWARD, BWD_MMA, BWD_SIMT, DQ, Call, select
from cupyflash._options import KernelOptions
from cupyflash._run import rows_aligned

from _backward_util import check_gradients
from _util import DTYPES, DTYPE_IDS, HALF, accum_dtype, random_array, random_qkv

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every backward kernel, compiled once up front (timed: the cold-start cost)."""
    start = time.perf_counter()
    rows = cupyflash.precompile(families=["bwd_simt", "bwd_mma"])
    return rows, time.perf_counter() - start


def _gpu(*arrays):
    return tuple(cp.asarray(a) for a in arrays)


def _host(x):
    return cp.asnumpy(x)


def _forward_backward(rng, q, k, v, **kw):
    """GPU forward (out, lse), a random dout, GPU backward; all returned on the host."""
    qd, kd, vd = _gpu(q, k, v)
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, **kw)
    dout = random_array(rng, out.shape, q.dtype)
    grads = cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, **kw)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, cp.ndarray) and g.dtype == x.dtype and g.shape == x.shape
    return dout, _host(out), tuple(_host(g) for g in grads)


# ---- correctness matrix ----------------------------------------------------------------
# float16/bfloat16 with d == dv and 16-byte aligned rows (d a multiple of 8)
# run bwd_mma on sm_80+, everything else bwd_simt.

HEAD_DIMS = [1, 3, 16, 32, 33, 64, 72, 100, 128, 129, 160, 200, 224, 256]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dispatcher_picks_tensor_cores_for_aligned_half_precision(dtype):
    q = cp.zeros((1, 2, 8, 64), dtype=dtype)
    arch = executor_for("cuda").arch
    call = Call(np.dtype(dtype).name, 64, 64, aligned=rows_aligned(q))
    families = {r.family for r in select(BACKWARD, call, arch, KernelOptions.from_environment())}
    tensor_cores = arch >= 80 and dtype.itemsize == 2
    assert families == ({BWD_SIMT, BWD_MMA} if tensor_cores else {BWD_SIMT})


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_head_dim_matches_oracle(rng, dtype, d):
    q, k, v = random_qkv(rng, (2, 3, 70, d), (2, 3, 131, d), (2, 3, 131, d), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v)
    check_gradients(grads, dout, q, k, v, out, dtype)


@pytest.mark.parametrize("d, dv", [(64, 32), (32, 128), (80, 48), (16, 256), (256, 1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_value_head_dim_differs(rng, dtype, d, dv):
    q, k, v = random_qkv(rng, (2, 33, d), (2, 65, d), (2, 65, dv), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v)
    check_gradients(grads, dout, q, k, v, out, dtype)


@pytest.mark.parametrize("lq, lk", [(1, 1), (1, 300), (300, 1), (17, 33), (64, 64), (65, 63),
                                    (129, 257), (255, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sequence_tails(rng, dtype, lq, lk):
    q, k, v = random_qkv(rng, (2, 2, lq, 64), (2, 2, lk, 64), (2, 2, lk, 64), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, scale=0.3)
    check_gradients(grads, dout, q, k, v, out, dtype, scale=0.3)


MASKS = [dict(causal=True), dict(window=(16, 8)), dict(window=(0, 0)), dict(window=(None, 4)),
         dict(window=(40, None)), dict(causal=True, window=(24, None))]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("lq, lk", [(96, 200), (200, 96), (128, 128), (37, 1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_causal_and_window(rng, dtype, lq, lk, mask):
    q, k, v = random_qkv(rng, (2, 2, lq, 64), (2, 2, lk, 64), (2, 2, lk, 64), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, **mask)
    check_gradients(grads, dout, q, k, v, out, dtype, **mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_with_no_key_get_zero_dq(rng, dtype):
    # Lq > Lk with causal: the first Lq - Lk query rows see no key (lse = -inf).
    q, k, v = random_qkv(rng, (1, 2, 150, 64), (1, 2, 50, 64), (1, 2, 50, 64), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, causal=True)
    assert (grads[0][..., :100, :].astype(np.float64) == 0).all()
    check_gradients(grads, dout, q, k, v, out, dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_query_and_multi_query(rng, dtype):
    q, k, v = random_qkv(rng, (2, 8, 77, 64), (2, 2, 90, 64), (2, 2, 90, 64), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, enable_gqa=True, causal=True)
    check_gradients(grads, dout, q, k, v, out, dtype, enable_gqa=True, causal=True)
    # MQA by broadcasting: one kv head (and one batch for v), summed back by the dispatcher.
    q, k, v = random_qkv(rng, (2, 4, 77, 64), (2, 1, 90, 64), (1, 1, 90, 64), dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, window=(30, 10))
    check_gradients(grads, dout, q, k, v, out, dtype, window=(30, 10))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_blhd_strided_views(rng, dtype):
    b, lq, lk, h, d = 2, 70, 90, 3, 64
    q = random_array(rng, (b, lq, h, d), dtype)
    k = random_array(rng, (b, lk, h, d), dtype)
    v = random_array(rng, (b, lk, h, d), dtype)
    qd, kd, vd = (cp.asarray(x).transpose(0, 2, 1, 3) for x in (q, k, v))
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, causal=True)
    dout = random_array(rng, (b, lq, h, d), dtype)
    dout_d = cp.asarray(dout).transpose(0, 2, 1, 3)
    grads = cupyflash.attention_backward(dout_d, qd, kd, vd, out, lse, causal=True)
    host = tuple(_host(g) for g in grads)
    check_gradients(host, dout.transpose(0, 2, 1, 3), q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
           v.transpose(0, 2, 1, 3), _host(out), dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_poisoned_gradients_are_fully_written(rng, dtype):
    """Kernel level: dq, dk, dv start as NaN; every element is written (zero where nothing is seen)."""
    q, k, v = _gpu(*random_qkv(rng, (2, 4, 99, 40), (2, 2, 131, 40), (2, 2, 131, 24), dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True, enable_gqa=True, window=(20, 0))
    dout = cp.asarray(random_array(rng, out.shape, dtype))
    acc = accum_dtype(dtype)
    dq, dk, dv = (cp.full(x.shape, cp.nan, dtype=acc) for x in (q, k, v))
    _run.backward(dout, q, k, v, out, lse, dq, dk, dv, scale=1 / math.sqrt(40), window_left=20,
                  window_right=0, gqa_ratio=2, executor=executor_for("cuda"),
                  options=KernelOptions.from_environment())
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not bool(cp.isnan(g).any()), f"{name}: element left unwritten"
    # keys 0 .. Lk - Lq - 21 = 11 are seen by no query row
    assert bool((dk[:, :, :12] == 0).all()) and bool((dv[:, :, :12] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_repeated_runs_are_bit_identical(rng, dtype):
    q, k, v = _gpu(*random_qkv(rng, (2, 8, 300, 128), (2, 2, 333, 128), (2, 2, 333, 128), dtype))
    out, lse = cupyflash.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True)
    dout = cp.asarray(random_array(rng, out.shape, dtype))
    first = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, enable_gqa=True,
                                         deterministic=True)
    for _ in range(3):
        again = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, enable_gqa=True,
                                             deterministic=True)
        for a, b in zip(first, again):
            assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", HALF + [np.dtype(np.float32)], ids=lambda d: str(d))
def test_large_shape(rng, dtype, causal):
    """B=1, H=4, L=2048, d=128; two heads checked against the oracle in full."""
    shape = (1, 4, 2048, 128)
    q, k, v = random_qkv(rng, shape, shape, shape, dtype)
    dout, out, grads = _forward_backward(rng, q, k, v, causal=causal)
    for h in (0, 3):    # (1, L, d) slices: the checks take (..., heads, L, d)
        one = slice(h, h + 1)
        check_gradients(tuple(g[0, one] for g in grads), dout[0, one], q[0, one], k[0, one], v[0, one],
               out[0, one], dtype, causal=causal)


def test_launches_on_the_current_stream(rng):
    """Work queued on a non-blocking stream is complete after that stream alone syncs."""
    dtype = np.dtype(np.float16)
    q, k, v = _gpu(*random_qkv(rng, (2, 8, 1024, 64), (2, 8, 1024, 64), (2, 8, 1024, 64), dtype))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dout = cp.asarray(random_array(rng, out.shape, dtype))
    ref = [_host(g) for g in cupyflash.attention_backward(dout, q, k, v, out, lse)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse)
        copies = [g.copy() for g in grads]   # same stream: ordered after the kernels
    stream.synchronize()
    for c, r in zip(copies, ref):
        assert np.array_equal(_host(c).view(np.uint16), r.view(np.uint16))


def test_peak_device_memory_is_linear_in_sequence_length(rng):
    """At L = 8192 the backward allocates its O(L d) gradients and workspaces, far below Lq Lk floats."""
    dtype = np.dtype(np.float16)
    length, heads, d = 8192, 2, 64
    q, k, v = _gpu(*random_qkv(rng, (1, heads, length, d), (1, heads, length, d),
                               (1, heads, length, d), dtype))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = cp.asarray(random_array(rng, out.shape, dtype))
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(pool.malloc)
    try:
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        cp.cuda.Device().synchronize()
        peak = pool.total_bytes()    # the pool only grows: its peak
        del grads
    finally:
        cp.cuda.set_allocator(previous)
    per_grad = heads * length * d
    # float32 dq, dk, dv + their float16 results + delta (float32, one per query row) + 1 MiB
    expected = 3 * per_grad * (4 + 2) + heads * length * 4 + 2**20
    assert peak <= expected, (peak, expected)
    assert peak < length * length * 4 / 8       # 8x below one float32 score matrix


ATOMIC_CASES = ([(dtype, d) for dtype in HALF for d in (64, 128, 200)]
                + [(np.dtype(np.float32), 64), (np.dtype(np.float32), 128), (np.dtype(np.float64), 64)])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, head_dim", ATOMIC_CASES, ids=[f"{d}-d{h}" for d, h in ATOMIC_CASES])
def test_atomic_dq_matches_the_oracle_and_leaves_dk_dv_bit_identical(rng, dtype, head_dim, causal):
    """deterministic=False: the dK/dV kernel (bwd_mma or bwd_simt) adds dQ by atomics."""
    shape_q, shape_kv = (2, 4, 333, head_dim), (2, 2, 300, head_dim)
    q, k, v = random_qkv(rng, shape_q, shape_kv, shape_kv, dtype)
    qd, kd, vd = _gpu(q, k, v)
    kw = dict(causal=causal, enable_gqa=True)
    out, lse = cupyflash.attention(qd, kd, vd, return_lse=True, **kw)
    dout = random_array(rng, out.shape, dtype)
    arch = int(cp.cuda.Device().compute_capability)
    rows = select(BACKWARD, Call(dtype.name, head_dim, head_dim, aligned=True, deterministic=False), arch,
                  KernelOptions.from_environment())
    assert not any(r.role == DQ for r in rows)
    grads = cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, deterministic=False, **kw)
    exact = cupyflash.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse, deterministic=True, **kw)
    check_gradients(tuple(_host(g) for g in grads), dout, q, k, v, _host(out), dtype, **kw)
    for name, a, b in zip(("dk", "dv"), grads[1:], exact[1:]):
        assert cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)), name
