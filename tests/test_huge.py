"""Tensors past 2^31 elements, and 64-bit offsets in the kernels.

- The CPU path attends 3 query rows to a key tensor of 2^31 + 768 elements
  (float32, 8 GiB).  The keys live in a lazily zero-filled anonymous mapping
  (``MAP_NORESERVE``, no huge pages): only a handful of planted rows, among
  them the last ones, are ever written, so reading the rest maps the kernel's
  zero page and the test needs ~150 MB of real memory, not 8 GiB.  The float64
  oracle is computed from the structure alone (every unplanted logit is 0), on
  just the rows that matter: prefix sums of v and the planted rows.
- The GPU tier runs the same case on the device, float16 with two heads
  (tensor-core kernels: head 1 starts past 2^31 elements, rows of head 0 pass
  it) and float32 (SIMT kernels), forward and backward.
- The emulator runs every kernel family with strides above 2^31 elements (row
  strides of 2^25, head strides of 2^31 + 2^12, batch strides of 2^32 + 2^13
  elements) over sparse mappings of up to 75 GB of address space, of which the
  kernels touch a few hundred rows: an offset computed in 32 bits reads or
  writes the wrong row (or crashes, which the emulator reports).
- A static check: every stride in the params structs is an int64_t.

The same checking code runs on a small case (``test_huge_case_checks_on_a_small_case``)
so that it is exercised on every machine.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash._source import cuda_src_dir
from cupyflash.emulator import emulator_available
from cupyflash.reference import flash_attention_v1, naive_attention, naive_attention_backward

from _backward_util import assert_within_yardstick, naive_half_backward
from _util import assert_close, assert_grad_close, assert_lse_close

EMULATOR_OK, EMULATOR_WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not EMULATOR_OK, reason=f"CPU emulator unavailable: {EMULATOR_WHY}")

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux value; not exported before Python 3.13
TWO_31 = 2**31


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def need_memory(nbytes: int) -> None:
    """Skip unless physical memory is at least 3x what the test really touches."""
    have = physical_memory()
    if have < 3 * nbytes:
        pytest.skip(f"needs {3 * nbytes / 2**30:.1f} GiB of physical memory (3x the {nbytes / 2**30:.1f} GiB "
                    f"touched); this machine has {have / 2**30:.1f} GiB")


def sparse_zeros(shape, dtype, strides=None):
    """A zero array of ``shape`` (element ``strides``, default C order) over a lazily filled,
    unreserved anonymous mapping: pages cost memory only once written."""
    dtype = np.dtype(dtype)
    if strides is None:
        strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    nbytes = -(-span * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError, OverflowError) as exc:
        pytest.skip(f"cannot map {nbytes / 2**30:.0f} GiB of address space: {exc}")
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)    # a written row must cost 4 KiB, not 2 MiB
    flat = np.frombuffer(mapping, dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, shape=tuple(shape),
                                           strides=tuple(s * dtype.itemsize for s in strides), writeable=True)


# ---- a key tensor past 2^31 elements, checked from its structure -----------------------------------


class HugeKeys:
    """q (H, Lq, d) against k (H, Lk, d) that is zero but for a few planted rows, v (H, Lk, dv).

    Query row ``Lq - 1 - n`` of every head gets a planted key with logit ``log(Lk) + n / 2``,
    so that it weighs about as much as the millions of zero-logit keys together (and the
    rows are not one-hot, whose dq would be all cancellation); the planted rows include
    the first and the last keys.  ``causal`` is bottom-right aligned.
    Arrays are NumPy or CuPy (``xp``); the oracle is float64 NumPy.
    """

    def __init__(self, xp, dtype, *, heads, seqlen_q, seqlen_k, head_dim, head_dim_v, causal, sparse_k=False):
        self.xp, self.dtype, self.causal = xp, np.dtype(dtype), causal
        lq, lk = seqlen_q, seqlen_k
        rng = np.random.default_rng(lk)
        q = rng.standard_normal((heads, lq, head_dim))
        self.planted = np.unique([0, 1, lk // 2, lk - 2 * lq, lk - lq - 1] + [lk - 1 - n for n in range(lq)])
        planted_k = rng.standard_normal((heads, len(self.planted), head_dim))
        for n in range(lq):                   # key lk-1-n is the last one row lq-1-n sees (causal)
            row = q[:, lq - 1 - n]
            logit = math.log(lk) + 0.5 * n    # about as heavy as all the zero keys together
            planted_k[:, -1 - n] = logit * row / (row * row).sum(axis=-1, keepdims=True)
        self.scale = 1.0
        self.q = xp.asarray(q.astype(self.dtype))
        self.k = sparse_zeros((heads, lk, head_dim), self.dtype) if sparse_k else xp.zeros(
            (heads, lk, head_dim), self.dtype)
        self.k[:, self.index(self.planted)] = xp.asarray(planted_k.astype(self.dtype))
        if xp is np:
            self.v = rng.standard_normal((heads, lk, head_dim_v)).astype(self.dtype)
        else:
            self.v = xp.random.default_rng(0).standard_normal((heads, lk, head_dim_v),
                                                              dtype=np.float32).astype(self.dtype)
        self.seqlen_q, self.seqlen_k = lq, lk

    def host(self, x):
        return x if isinstance(x, np.ndarray) else self.xp.asnumpy(x)

    def index(self, rows):
        return self.xp.asarray(rows)

    def last_key(self, i):
        """Last key query row i sees."""
        return self.seqlen_k - self.seqlen_q + i if self.causal else self.seqlen_k - 1

    def v_prefix_sums(self):
        """float64 sums of v over the keys each query row sees, (H, Lq, dv), in chunks."""
        xp, limits = self.xp, [self.last_key(i) + 1 for i in range(self.seqlen_q)]
        sums = np.zeros((self.v.shape[0], self.seqlen_q, self.v.shape[2]))
        total, done = 0, 0
        for stop in sorted(set(limits)):
            for start in range(done, stop, 1 << 18):
                total = total + self.host(self.v[:, start:min(stop, start + (1 << 18))].astype(xp.float64).sum(axis=1))
            done = stop
            for i, lim in enumerate(limits):
                if lim == stop:
                    sums[:, i] = total
        return sums

    def probabilities(self):
        """float64 (H, Lq, P) weights of the planted keys, (H, Lq) weight of each zero key, lse, out."""
        q = self.host(self.q).astype(np.float64)
        kp = self.host(self.k[:, self.index(self.planted)]).astype(np.float64)
        vp = self.host(self.v[:, self.index(self.planted)]).astype(np.float64)
        s = self.scale * q @ np.swapaxes(kp, -1, -2)                        # (H, Lq, P)
        visible = self.planted[None, :] <= np.array([self.last_key(i) for i in range(self.seqlen_q)])[:, None]
        s = np.where(visible, s, -np.inf)
        zeros = np.array([self.last_key(i) + 1 for i in range(self.seqlen_q)]) - visible.sum(axis=1)   # (Lq,)
        m = np.maximum(s.max(axis=-1), np.where(zeros > 0, 0.0, -np.inf))
        p_planted = np.exp(s - m[..., None])
        p_zero = zeros * np.exp(-m)                                          # all zero keys together
        denom = p_planted.sum(axis=-1) + p_zero
        lse = m + np.log(denom)
        sum_v_zero = self.v_prefix_sums() - np.broadcast_to(visible, s.shape).astype(float) @ vp
        out = (np.exp(-m)[..., None] * sum_v_zero + p_planted @ vp) / denom[..., None]
        return p_planted / denom[..., None], np.exp(-lse), lse, out, visible

    def check_forward(self, backend, *, rtol):
        out, lse = cupyflash.attention(self.q, self.k, self.v, scale=self.scale, causal=self.causal,
                                       return_lse=True, backend=backend)
        _, _, ref_lse, ref_out, _ = self.probabilities()
        np.testing.assert_allclose(self.host(out).astype(np.float64), ref_out, rtol=rtol, atol=rtol, err_msg="out")
        np.testing.assert_allclose(self.host(lse), ref_lse, rtol=0, atol=rtol, err_msg="lse")
        return out, lse

    def sampled_keys(self, sample=8):
        """The planted keys and ``sample`` zero keys spread over the sequence."""
        return np.unique(np.concatenate([self.planted, np.linspace(0, self.seqlen_k - 1, sample).astype(int)]))

    def backward_reference(self, dout, out, *, term_sizes=False):
        """float64 dq (every row), dk and dv (the ``sampled_keys`` rows); delta from ``out``.

        With ``term_sizes``, the same sums over the absolute values of their terms
        (|dS| <= P o (|dO| |V|^T + rowsum|dO o O|)): what a gradient's rounding error is
        relative to where dP - delta cancels and the gradient itself is far smaller."""
        p_planted, p_zero, _, _, _ = self.probabilities()
        f = np.abs if term_sizes else (lambda x: x)
        q = f(self.host(self.q).astype(np.float64))
        do = f(np.asarray(dout, np.float64))
        delta = f(do * np.asarray(out, np.float64)).sum(axis=-1)
        rows = self.sampled_keys()
        kr = f(self.host(self.k[:, self.index(rows)]).astype(np.float64))
        vr = f(self.host(self.v[:, self.index(rows)]).astype(np.float64))
        is_planted = np.isin(rows, self.planted)        # rows and planted are sorted: same order
        sees = rows[None, :] <= np.array([self.last_key(i) for i in range(self.seqlen_q)])[:, None]
        p = np.where(sees, p_zero[..., None], 0.0)      # a zero key's weight is exp(0 - lse)
        p[..., is_planted] = p_planted                  # (0 where not visible)
        sign = 1.0 if term_sizes else -1.0
        ds = p * (do @ np.swapaxes(vr, -1, -2) + sign * delta[..., None])        # (H, Lq, rows)
        dq = self.scale * ds[..., is_planted] @ kr[:, is_planted]                 # zero keys add 0 * k
        dk = self.scale * np.swapaxes(ds, -1, -2) @ q
        dv = np.swapaxes(p, -1, -2) @ do
        return dq, dk, dv

    def check_backward(self, backend, out, lse, *, rtol):
        """dq of every row; dk and dv of the sampled keys, each row to ``rtol`` of its own size
        (a zero key's gradients are ~1e-9, far below the planted keys'), plus rounding
        relative to the size of the terms summed, plus, for float16, the rounding of
        subnormal mma operands (below)."""
        dout = np.random.default_rng(1).standard_normal(out.shape).astype(self.dtype)
        dq, dk, dv = cupyflash.attention_backward(self.xp.asarray(dout), self.q, self.k, self.v, out, lse,
                                                  scale=self.scale, causal=self.causal, backend=backend)
        refs = self.backward_reference(dout, self.host(out))
        terms = self.backward_reference(dout, self.host(out), term_sizes=True)
        # float32 rounding of dP, delta and the products, relative to the terms summed
        # (seen on an H200: a dq row of size 5e-6, all cancellation, off by 4.3e-7);
        # float16 also rounds dS to float16 for the tensor cores
        term_rtol = 32 * np.finfo(np.float32).eps + (np.finfo(np.float16).eps
                                                      if self.dtype.itemsize == 2 else 0.0)
        rows = self.index(self.sampled_keys())
        floors = (0.0, 0.0, 0.0)
        if self.dtype.itemsize == 2:
            # The tensor-core backward rounds dS and P to float16 as mma operands.  A zero
            # key's weight exp(-lse) ~ 1e-8..1e-13 is a float16 subnormal, so each such
            # operand is off by up to half the subnormal spacing, 2^-25, and a gradient
            # element by 2^-25 times the sum over the query rows of the other factor
            # (scale |q| for dk, |dO| for dv, scale |k| of the planted keys for dq),
            # plus 2^-25 for its own rounding (seen on an H200: dk 1.2e-7 off).
            half_spacing = 2.0**-25
            q_rows = np.abs(self.host(self.q)).astype(np.float64).max(axis=-1).sum(axis=-1)
            do_rows = np.abs(dout.astype(np.float64)).max(axis=-1).sum(axis=-1)
            k_rows = np.abs(self.host(self.k[:, self.index(self.planted)])).astype(np.float64)
            k_rows = k_rows.max(axis=-1).sum(axis=-1)
            floors = tuple(half_spacing * (1 + f)[:, None, None]
                           for f in (self.scale * k_rows, self.scale * q_rows, do_rows))
        for name, got, ref, term, floor in zip(("dq", "dk", "dv"), (dq, dk[:, rows], dv[:, rows]), refs,
                                               terms, floors):
            got = self.host(got).astype(np.float64)
            size = np.abs(ref).max(axis=-1, keepdims=True)
            excess = np.abs(got - ref) - (rtol * (size + np.abs(ref)) + term_rtol * term + floor)
            worst = np.unravel_index(np.argmax(excess), excess.shape)
            assert (excess <= 0).all(), (
                f"{name}: max error {np.abs(got - ref).max():.3g}; worst at {worst}: got {got[worst]:.6g}, "
                f"exact {ref[worst]:.6g}, row size {size[worst[:-1]].item():.3g}")


# Tolerances of these checks (out, lse and gradients, relative): float32 sums the
# probabilities of ~2^23 keys block by block, 2^14 blocks of 512 on the CPU path, so the
# row sum is off by up to ~2^14 u = 1e-3 in the worst case (6.5e-5 seen); float16 rounds
# the output, and the tensor-core kernels the probabilities, to float16.
HUGE_RTOL = {"float32": 5e-4, "float16": 4e-3}


@pytest.mark.parametrize("backend", ["numpy", pytest.param("emulator", marks=needs_emulator)])
@pytest.mark.parametrize("dtype, heads, head_dim", [("float32", 1, 40), ("float16", 2, 64)])
def test_huge_case_checks_on_a_small_case(backend, dtype, heads, head_dim):
    case = HugeKeys(np, dtype, heads=heads, seqlen_q=3, seqlen_k=3000, head_dim=head_dim,
                    head_dim_v=head_dim, causal=True)
    # The structure-based oracle is the naive one, forward and backward.
    ref, ref_lse = naive_attention(case.q, case.k, case.v, scale=case.scale, causal=True, return_lse=True)
    _, _, lse, out, _ = case.probabilities()
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    dout = np.random.default_rng(2).standard_normal(ref.shape)
    naive = naive_attention_backward(dout, case.q, case.k, case.v, scale=case.scale, causal=True)
    rows = case.sampled_keys()
    for got, want in zip(case.backward_reference(dout, ref), (naive[0], naive[1][:, rows], naive[2][:, rows])):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-14)
    # ... and the backends agree with it.
    out, lse = case.check_forward(backend, rtol=HUGE_RTOL[dtype])
    assert_close(out, ref, case.dtype)
    assert_lse_close(lse, ref_lse, case.dtype)
    case.check_backward(backend, out, lse, rtol=HUGE_RTOL[dtype])


def test_cpu_path_keys_past_2_31_elements():
    d = 256
    lk = TWO_31 // d + 3                         # k: 2^31 + 768 elements, 8 GiB of float32
    need_memory(lk * 4 + 2**28)                  # v (dv = 1) plus the CPU path's blocks
    case = HugeKeys(np, np.float32, heads=1, seqlen_q=3, seqlen_k=lk, head_dim=d, head_dim_v=1, causal=True,
                    sparse_k=True)
    assert case.k.size > TWO_31 and case.planted.max() * d > TWO_31
    case.check_forward("numpy", rtol=HUGE_RTOL["float32"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads", [("float16", 2), ("float32", 1)])
def test_gpu_keys_past_2_31_elements(dtype, heads):
    import cupy

    d = 256                                      # float16: fwd_mma and bwd_mma (d == dv, aligned rows)
    lk = TWO_31 // d + 64
    case = HugeKeys(cupy, dtype, heads=heads, seqlen_q=3, seqlen_k=lk, head_dim=d, head_dim_v=d, causal=True)
    assert case.k[0].size > TWO_31
    out, lse = case.check_forward("cuda", rtol=HUGE_RTOL[dtype])
    case.check_backward("cuda", out, lse, rtol=HUGE_RTOL[dtype])


# ---- every kernel family with strides past 2^31 elements, on the emulator -----------------------------

# Element strides (batch, head, row, 1) of (2, 2, L <= 90, 64) tensors: each row in its own
# page, every axis but the last reaching past 2^31 elements on its own (rows from 64 on),
# and no two elements at one address (90 rows of 2^25 + 64 fit in a head stride).
HUGE_STRIDES = (2**33 + 2**13, 2**32 + 2**12, 2**25 + 64, 1)


def strided_copy(x):
    """``x`` copied into a sparse array with HUGE_STRIDES."""
    y = sparse_zeros(x.shape, x.dtype, HUGE_STRIDES)
    y[...] = x
    return y


def huge_problem(dtype, seed):
    # Each axis alone reaches past 2^31 elements, where a 32-bit offset would wrap.
    assert all(n * s > TWO_31 for n, s in zip((1, 1, 64), HUGE_STRIDES))
    assert 90 * HUGE_STRIDES[2] <= HUGE_STRIDES[1] and 2 * HUGE_STRIDES[1] <= HUGE_STRIDES[0]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 2, 70, 64), (2, 2, 90, 64), (2, 2, 90, 64)))
    return (q, k, v), tuple(strided_copy(x) for x in (q, k, v))


@needs_emulator
@pytest.mark.parametrize("dtype", ["float16", "float32"], ids=["fwd_mma-float16", "fwd_simt-float32"])
def test_forward_kernels_use_64_bit_offsets(dtype):
    (q, k, v), (qs, ks, vs) = huge_problem(np.dtype(dtype), 1)
    assert qs.strides[0] // qs.itemsize > TWO_31 and not qs.flags.c_contiguous
    out = sparse_zeros((2, 2, 70, 64), dtype, HUGE_STRIDES)
    out[...] = np.nan
    res, lse = cupyflash.attention(qs, ks, vs, out=out, causal=True, return_lse=True, backend="emulator")
    assert res is out
    ref, ref_lse = naive_attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, ref, q.dtype)
    assert_lse_close(lse, ref_lse, q.dtype)


@needs_emulator
def test_fwd_v1_kernel_uses_64_bit_offsets():
    (q, k, v), (qs, ks, vs) = huge_problem(np.dtype(np.float32), 2)
    out = flash_attention_v1(qs, ks, vs, sram_size=4096, window=(30, 10), backend="emulator")
    assert_close(out, naive_attention(q, k, v, window=(30, 10)), q.dtype)


@needs_emulator
@pytest.mark.parametrize("dtype", ["float16", "float32"], ids=["bwd_mma-float16", "bwd_simt-float32"])
def test_backward_kernels_use_64_bit_offsets(dtype):
    dtype = np.dtype(dtype)
    (q, k, v), (qs, ks, vs) = huge_problem(dtype, 3)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = np.random.default_rng(4).standard_normal(out.shape).astype(dtype)
    grads = cupyflash.attention_backward(strided_copy(dout), qs, ks, vs, strided_copy(out), lse,
                                         causal=True, backend="emulator")
    expected = naive_attention_backward(dout, q, k, v, causal=True)
    if dtype.itemsize == 2:
        naive = naive_half_backward(dout, q, k, v, out, scale=1 / math.sqrt(64), window=(None, 0))
        for name, g, e, h in zip(("dq", "dk", "dv"), grads, expected, naive):
            assert_within_yardstick(g, e, h, what=name)
    else:
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            assert_grad_close(g, e, dtype, what=name)


@needs_emulator
def test_tf32_kernels_use_64_bit_offsets():
    # fwd_tf32 and bwd_tf32 (precision="tf32x3": float32's tolerance applies)
    dtype = np.dtype(np.float32)
    (q, k, v), (qs, ks, vs) = huge_problem(dtype, 5)
    out = sparse_zeros((2, 2, 70, 64), dtype, HUGE_STRIDES)
    out[...] = np.nan
    _, lse = cupyflash.attention(qs, ks, vs, out=out, causal=True, return_lse=True, precision="tf32x3",
                                 backend="emulator")
    ref, ref_lse = naive_attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    dout = np.random.default_rng(6).standard_normal(out.shape).astype(dtype)
    grads = cupyflash.attention_backward(strided_copy(dout), qs, ks, vs, out, lse, causal=True,
                                         precision="tf32x3", backend="emulator")
    for name, g, e in zip(("dq", "dk", "dv"), grads, naive_attention_backward(dout, q, k, v, causal=True)):
        assert_grad_close(g, e, dtype, what=name)


PLANTED_32_BIT_OFFSET = """
import numpy as np, cupyflash, sys
sys.path.insert(0, {tests!r})
from test_huge import huge_problem
from cupyflash.reference import naive_attention
(q, k, v), (qs, ks, vs) = huge_problem(np.dtype(np.float32), 1)
try:
    out = cupyflash.attention(qs, ks, vs, causal=True, backend="emulator")
except Exception as exc:
    print("raised", type(exc).__name__)
else:
    print("max error", float(np.abs(out - naive_attention(q, k, v, causal=True)).max()))
"""


@needs_emulator
def test_a_32_bit_offset_in_a_kernel_is_caught(tmp_path):
    # The premise of the tests above, shown on a copy of cuda_src/ whose fwd_simt
    # truncates one row offset (key block start * row stride) to 32 bits (in its
    # K/V schedule, fwd_tiles.cuh).
    import shutil
    import subprocess
    import sys

    src = tmp_path / "cuda_src"
    shutil.copytree(cuda_src_dir(), src)
    kernel = src / "fwd_tiles.cuh"
    good = "at_key(head.k, n0, params.k_row_stride)"
    assert good in kernel.read_text()
    kernel.write_text(kernel.read_text().replace(good, "head.k + static_cast<int>(n0 * params.k_row_stride)"))
    root = str(Path(__file__).resolve().parents[1])        # this checkout, installed or not
    env = dict(os.environ, CUPYFLASH_CUDA_SRC=str(src),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    code = PLANTED_32_BIT_OFFSET.format(tests=str(Path(__file__).resolve().parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = done.stdout.split()
    assert result[0] == "raised" or float(result[-1]) > 0.1, done.stdout


# 32-bit strides by design, each with the host check that makes it safe:
# paged.cuh's PagedRows holds a page's stride in 32 bits (a register less through
# the main loop, K's and V's); cupyflash/_kvcache.py refuses a page of 2^31 elements
# or more before any work, and every product with it is widened to 64 bits.
NARROW_STRIDES = {("paged.cuh", "page_stride")}


def test_every_stride_in_the_kernels_is_64_bit():
    # Struct fields, function parameters and locals named *stride*: a 32-bit one would
    # make row * stride (or head * stride) wrap past 2^31 elements.
    declared = []
    for path in sorted(cuda_src_dir().glob("*.cu*")):
        for ctype, name in re.findall(r"\b(int64_t|int32_t|uint32_t|uint64_t|unsigned|long|int|size_t)\s+"
                                      r"(\w*stride\w*)", path.read_text()):
            declared.append((path.name, name))
            wanted = "int32_t" if (path.name, name) in NARROW_STRIDES else "int64_t"
            assert ctype == wanted, f"{path.name}: {name} is {ctype}"
    assert len(declared) >= 15, declared
