"""Tier 1: ``bias=`` and ``mask=`` through the CUDA kernels on a real GPU.

Every family the device's dispatch picks (and fwd_wgmma/bwd_wgmma on sm_90, the FP64
tensor cores where the arch has them), forward and backward, on shapes of several
blocks with a tuple of two biases broadcast along different axes, a mask, GQA and a
causal window, against the float64 oracle with tests/test_bias_mask_kernels.py's rules;
the backward twice, bit for bit (dbias included).  Skipped cleanly without CuPy or a
CUDA device.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cupyflash._api import run_attention, run_attention_backward

from _util import dtype_named, gpu_variant_options, random_array
from _terms_util import check_backward, check_forward

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["default", "wgmma", "dmma"])
@pytest.mark.parametrize("dtype_name, head_dim", [("float16", 128), ("bfloat16", 64), ("float32", 64),
                                                  ("float64", 64)])
def test_families_with_bias_and_mask_match_the_oracle(cuda_spy, variant, dtype_name, head_dim):
    dtype = dtype_named(dtype_name)
    options = gpu_variant_options(cp, variant, dtype)
    rng = np.random.default_rng([zlib.crc32(f"{variant}{dtype_name}".encode())])
    B, HQ, HKV, LQ, LK = 2, 4, 2, 300, 517
    q = random_array(rng, (B, HQ, LQ, head_dim), dtype)
    k = random_array(rng, (B, HKV, LK, head_dim), dtype)
    v = random_array(rng, (B, HKV, LK, head_dim), dtype)
    dout = random_array(rng, (B, HQ, LQ, head_dim), dtype)
    bias = (random_array(rng, (B, 1, 1, LK), np.float16), random_array(rng, (HQ, LQ, LK), np.float32))
    mask = rng.random((B, 1, LQ, LK)) < 0.8
    mask[1, 0, 7] = False
    kw = dict(bias=bias, mask=mask, causal=True, enable_gqa=True)
    on_gpu = dict(bias=tuple(cp.asarray(b) for b in bias), mask=cp.asarray(mask), causal=True, enable_gqa=True)
    g = [cp.asarray(x) for x in (q, k, v, dout)]
    out, lse = run_attention(*g[:3], return_lse=True, backend="cuda", options=options, **on_gpu)
    check_forward(cp.asnumpy(out), cp.asnumpy(lse), q, k, v, "ieee", **kw)
    runs = [run_attention_backward(g[3], *g[:3], out, lse, backend="cuda", options=options, **on_gpu)
            for _ in range(2)]
    grads = tuple(cp.asnumpy(x) for x in runs[0][:3]) + (tuple(cp.asnumpy(x) for x in runs[0][3]),)
    check_backward(grads, dout, q, k, v, cp.asnumpy(out), cp.asnumpy(lse), "ieee", **kw)
    for a, b in zip(runs[0][:3] + runs[0][3], runs[1][:3] + runs[1][3]):
        assert cp.array_equal(a, b)
    launched = {n.split("<")[0] for n in cuda_spy.launched}
    if variant == "wgmma":
        assert {"cf::fwd_wgmma_kernel", "cf::bwd_wgmma_dkdv_kernel"} <= launched
    if variant == "dmma":
        assert {"cf::fwd_dmma_kernel", "cf::bwd_dmma_dkdv_kernel"} <= launched
