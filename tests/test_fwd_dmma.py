"""fwd_dmma, the forward on the FP64 tensor cores (cuda_src/fwd_dmma.cu), without a GPU: what is
particular to it.  Its dispatch (opt-in for float64 and, computed in double, float32, d =
dv up to 128 on compute capability 8.0 and 9.0), launch geometry, static report (one
unrolled loop of DMMA, cp.async for float64, widening conversions for float32) and every
instantiation on the emulator are tests/test_families.py's.

Emulated tier: through :func:`cupyflash._run.forward` on the CPU emulator (shuffled
threads, race check) against the float64 oracle: padded head dims (d = 3 .. 100), rows
that are not 16-byte aligned, GQA, transposed strides, split-KV, agreement with fwd_simt,
and float32 rounded once from double; outputs NaN-poisoned first.  The instruction itself
is checked against the fragment table in tests/test_emulator.py (fid_mma_f64), and on a
GPU against the device.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _run
from cupyflash._families.fwd_dmma import DMMA_HEAD_DIMS
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention

from _kernel_util import needs_emulator
from _util import forward_against_oracle, poisoned, random_array

# fwd_dmma on for both dtypes
DMMA = KernelOptions(dmma=frozenset({"float64", "float32"}))


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=80, shuffle=True, race_check=True)


def run_dmma(executor, *, head_dim, seqlen_q, seqlen_k, window=(None, None), gqa_ratio=1,
             batch=1, heads_kv=1, splits=1, q=None, k=None, v=None, out=None, with_lse=True, seed=0,
             dtype=np.float64):
    """One forward through _run.forward with fwd_dmma on and ``splits`` forced, checked against
    the oracle; returns the names launched and the output."""
    rng = np.random.default_rng(seed)
    heads = heads_kv * gqa_ratio
    q = random_array(rng, (batch, heads, seqlen_q, head_dim), dtype) if q is None else q
    k = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype) if k is None else k
    v = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype) if v is None else v
    spy, out = forward_against_oracle(executor, q, k, v, window=window, gqa_ratio=gqa_ratio, out=out,
                                      with_lse=with_lse, options=DMMA.replace(splits=splits))
    return spy.launched, out


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(executor, head_dim, dtype):
    # d = 3 and 17: rows of 24 and 136 bytes (float64; 12 and 68 for float32), not
    # 16-byte aligned (4-byte cp.async; element-wise converting loads)
    launched, _ = run_dmma(executor, head_dim=head_dim, seqlen_q=70, seqlen_k=90, batch=2,
                           seed=head_dim, dtype=dtype)
    assert launched[0].startswith(f"cf::fwd_dmma_kernel<{min(b for b in DMMA_HEAD_DIMS if b >= head_dim)},")


@needs_emulator
def test_gqa_strides_without_lse_and_split_kv(executor):
    rng = np.random.default_rng(5)
    # q and out as (B, L, H, d) buffers viewed as (B, H, L, d); 3 splits of the keys
    q = random_array(rng, (2, 90, 4, 64), np.float64).transpose(0, 2, 1, 3)
    out = poisoned((2, 90, 4, 64), np.float64).transpose(0, 2, 1, 3)
    k = random_array(rng, (2, 2, 400, 64), np.float64)
    v = random_array(rng, (2, 2, 400, 64), np.float64)
    launched, _ = run_dmma(executor, head_dim=64, seqlen_q=90, seqlen_k=400, window=(None, 0),
                           gqa_ratio=2, q=q, k=k, v=v, out=out, with_lse=False, splits=3)
    assert launched == ["cf::fwd_dmma_kernel<64, 64, 32, 4>", "cf::fwd_combine_kernel<double, double>"]


@needs_emulator
def test_agrees_with_fwd_simt_to_rounding(executor):
    rng = np.random.default_rng(11)
    q, k, v = (random_array(rng, (1, 2, 77, 64), np.float64) for _ in range(3))
    _, dmma = run_dmma(executor, head_dim=64, seqlen_q=77, seqlen_k=77, q=q, k=k, v=v)
    simt = poisoned(q.shape, np.float64)
    _run.forward(q, k, v, simt, None, scale=0.125, window_left=None, window_right=None, gqa_ratio=1,
                 executor=executor, options=KernelOptions())
    np.testing.assert_allclose(dmma, simt, rtol=1e-13, atol=1e-14)


@needs_emulator
def test_float32_split_kv_and_gqa(executor):
    rng = np.random.default_rng(6)
    q = random_array(rng, (1, 4, 50, 64), np.float32)
    k = random_array(rng, (1, 2, 300, 64), np.float32)
    v = random_array(rng, (1, 2, 300, 64), np.float32)
    launched, _ = run_dmma(executor, head_dim=64, seqlen_q=50, seqlen_k=300, window=(100, 0),
                           gqa_ratio=2, q=q, k=k, v=v, splits=2)
    assert launched == ["cf::fwd_dmma_kernel<64, 64, 32, 4, float>", "cf::fwd_combine_kernel<float, float>"]


@needs_emulator
def test_float32_is_rounded_once_from_double(executor):
    # Products of float32 inputs are exact in double and the sums are double, so out
    # is the exact attention of the float32 inputs rounded once: within one float32
    # ulp of the float64 oracle element by element (fwd_simt, in float32 arithmetic,
    # is not), and lse likewise.
    rng = np.random.default_rng(12)
    q, k, v = (random_array(rng, (2, 2, 150, 64), np.float32) for _ in range(3))
    _, out = run_dmma(executor, head_dim=64, seqlen_q=150, seqlen_k=150, q=q, k=k, v=v,
                      window=(None, 0))
    ref = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                          scale=1 / 8, window=(None, 0))
    # one float32 ulp, plus the double computation's own error (~1e-16 of terms of
    # size ~1) for outputs so close to zero that their ulp is smaller
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64) + 1e-13
    assert (np.abs(out.astype(np.float64) - ref) <= ulp).all()
    simt = poisoned(q.shape, np.float32)
    _run.forward(q, k, v, simt, None, scale=0.125, window_left=None, window_right=0, gqa_ratio=1,
                 executor=executor, options=DMMA.replace(dmma=frozenset({"float64"})))
    assert (np.abs(simt.astype(np.float64) - ref) > ulp).any()   # the yardstick: float32 arithmetic is not
