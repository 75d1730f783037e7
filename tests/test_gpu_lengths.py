"""Tier 1: per-sequence lengths through the CUDA kernels on a real GPU, one launch per
kernel (``cuda_src/sequence.cuh``).

Every family the device's dispatch picks (and fwd_wgmma/bwd_wgmma on sm_90, the FP64
tensor cores where the arch has them), padded (``q_lengths=`` / ``kv_lengths=``, NaN
and inf in the padding) and packed (``attention_varlen``), forward and backward, on
sequences of several blocks, against the float64 oracle per sequence with
tests/test_lengths_kernels.py's rules.  Skipped cleanly without CuPy or a CUDA device.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cupyflash._api import run_attention, run_attention_backward

from _util import dtype_named, gpu_variant_options, random_array
from test_lengths_kernels import _check_backward_per_sequence, _check_forward_per_sequence

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

Q_LENS = [0, 1, 300, 299, 129, 64]
KV_LENS = [517, 0, 516, 257, 1, 63]


@pytest.mark.parametrize("variant", ["default", "wgmma", "dmma"])
@pytest.mark.parametrize("dtype_name, head_dim", [("float16", 128), ("bfloat16", 64), ("float32", 64),
                                                  ("float64", 64)])
def test_families_with_lengths_match_the_oracle(variant, dtype_name, head_dim):
    dtype = dtype_named(dtype_name)
    options = gpu_variant_options(cp, variant, dtype)
    rng = np.random.default_rng([zlib.crc32(f"lengths{variant}{dtype_name}".encode())])
    B, HQ, HKV, LQ, LK = len(Q_LENS), 4, 2, 300, 517
    q, dout = (random_array(rng, (B, HQ, LQ, head_dim), dtype) for _ in range(2))
    k, v = (random_array(rng, (B, HKV, LK, head_dim), dtype) for _ in range(2))
    for b, (m, n) in enumerate(zip(Q_LENS, KV_LENS)):
        q[b, :, m:] = dout[b, :, m:] = k[b, :, n:] = np.nan
        v[b, :, n:] = np.inf
    kw = dict(causal=True, enable_gqa=True)
    lengths = dict(q_lengths=cp.asarray(Q_LENS), kv_lengths=cp.asarray(KV_LENS))
    g = [cp.asarray(x) for x in (q, k, v, dout)]
    out, lse = run_attention(*g[:3], return_lse=True, backend="cuda", options=options, **lengths, **kw)
    _check_forward_per_sequence(cp.asnumpy(out), cp.asnumpy(lse), q, k, v, "ieee", Q_LENS, KV_LENS, **kw)
    grads = run_attention_backward(g[3], *g[:3], out, lse, backend="cuda", options=options, **lengths, **kw)
    _check_backward_per_sequence(tuple(cp.asnumpy(x) for x in grads), dout, q, k, v, cp.asnumpy(out),
                                 cp.asnumpy(lse), "ieee", Q_LENS, KV_LENS, **kw)
