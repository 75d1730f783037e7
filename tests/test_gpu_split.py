"""Tier 1: the split-KV forward on a real GPU.

Shapes that leave the device mostly idle -- decoding (Lq = 1), a few query
rows over long key sequences, one head -- go through ``cupyflash.attention``
with the device's own SM count, so the heuristic splits them (checked: the
main kernel runs with ``gridDim.y > 1`` and ``fwd_combine`` follows).  Each
result is compared with the float64 oracle on the same inputs, with
NaN-poisoned outputs, and must repeat bit for bit.  On sm_90 the same shapes
run through fwd_wgmma as well.  Skipped cleanly without CuPy or a CUDA device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash._api import run_attention
from cupyflash._families import FWD_COMBINE, FWD_WGMMA
from cupyflash._options import KernelOptions
from cupyflash.reference import naive_attention

from _util import accum_dtype, assert_close, assert_lse_close, dtype_named, random_array

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("wgmma", [False, True], ids=["default", "wgmma"])
@pytest.mark.parametrize("dtype_name, head_dim, heads, seqlen_q, seqlen_k, causal", [
    ("bfloat16", 128, 8, 1, 16384, False),      # a decoding step: fwd_mma's split row
    ("float16", 64, 4, 7, 9000, True),
    ("float32", 64, 2, 1, 20000, False),        # fwd_simt
    ("float64", 32, 1, 100, 12345, True),
    ("float32", 96, 1, 3000, 3000, True),       # one head of a long sequence
])
def test_small_grids_split_and_match_the_oracle(cuda_spy, wgmma, dtype_name, head_dim, heads,
                                                  seqlen_q, seqlen_k, causal):
    dtype = dtype_named(dtype_name)
    if wgmma and (dtype.itemsize != 2 or int(cp.cuda.Device().compute_capability) != 90):
        pytest.skip("fwd_wgmma: float16/bfloat16 on an sm_90 GPU")
    options = KernelOptions.from_environment().replace(wgmma=wgmma)
    rng = np.random.default_rng(seqlen_k + head_dim)
    q = random_array(rng, (1, heads, seqlen_q, head_dim), dtype)
    k = random_array(rng, (1, heads, seqlen_k, head_dim), dtype)
    v = random_array(rng, (1, heads, seqlen_k, head_dim), dtype)
    results = []
    for _ in range(2):
        out = cp.full(q.shape, cp.nan, dtype=dtype)
        _, lse = run_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal, out=out,
                               return_lse=True, backend="cuda", options=options)
        results.append((cp.asnumpy(out), cp.asnumpy(lse)))
    (main, grid), (combine, _) = cuda_spy.launches[:2]
    assert grid[1] > 1, f"{main} was not split"
    assert [combine] == [r.name_expression for r in FWD_COMBINE.rows if r.dtype == dtype.name]
    assert (main in FWD_WGMMA.by_name) == wgmma
    out, lse = results[0]
    np.testing.assert_array_equal(results[1][0], out)
    np.testing.assert_array_equal(results[1][1], lse)
    ref, ref_lse = naive_attention(q, k, v, scale=1 / math.sqrt(head_dim), causal=causal, return_lse=True)
    assert not np.isnan(out.astype(np.float64)).any()
    assert_close(out, ref, dtype)
    assert_lse_close(lse.astype(accum_dtype(dtype)), ref_lse, dtype)
