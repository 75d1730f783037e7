"""Tier 1: paged KV caches through the CUDA kernels on a real GPU (``cuda_src/paged.cuh``).

Every family the device's dispatch picks (fwd_wgmma on sm_90, the FP64 tensor cores where
the arch has them), a chunked prefill (Lq = 7) and a decode step (Lq = 1, GQA 8:1, the
keys split as the dispatcher chooses), pages of 16 and 17 keys shuffled and shared, NaN
and inf in every page no sequence reads -- against the float64 oracle over each
sequence's gathered pages, by tests/test_kvcache_kernels.py's rules.  Skipped cleanly
without CuPy or a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash._api import run_attention

from _util import dtype_named, gpu_variant_options, random_array
from test_kvcache_kernels import _cache, _check, _rng

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["default", "wgmma", "dmma"])
@pytest.mark.parametrize("dtype_name, head_dim", [("float16", 128), ("bfloat16", 64), ("float32", 64),
                                                  ("float64", 64)])
@pytest.mark.parametrize("lq, page_size", [(7, 17), (1, 16)], ids=["prefill", "decode"])
def test_paged_cache_matches_the_oracle(variant, dtype_name, head_dim, lq, page_size):
    dtype = dtype_named(dtype_name)
    options = gpu_variant_options(cp, variant, dtype)
    lengths = [1000, 0, 1, 517, 4 * page_size, 300]
    k_cache, v_cache, table = _cache(f"gpu{variant}", dtype, lengths, page_size, 2, head_dim)
    q = random_array(_rng("gpu-q", variant, dtype_name, lq), (len(lengths), 16, lq, head_dim), dtype)
    kw = dict(causal=True, enable_gqa=True)
    out, lse = run_attention(*(cp.asarray(x) for x in (q, k_cache, v_cache)), block_table=cp.asarray(table),
                             kv_lengths=cp.asarray(lengths), return_lse=True, backend="cuda", options=options, **kw)
    _check(cp.asnumpy(out), cp.asnumpy(lse), q, k_cache, v_cache, table, lengths, "ieee", **kw)
