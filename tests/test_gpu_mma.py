"""Tier 1: fwd_mma, the tensor-core forward kernel, on a real GPU (sm_80 or later).

The correctness matrix of tests/test_fwd_mma.py and tests/test_families.py on the device through
``cupyflash.attention(..., backend="cuda")`` with CuPy arrays -- every head dim
(padded ones too), tails in both axes, causal and window masks with Lq < Lk and
Lq > Lk, GQA, broadcast kv heads, strided views, lse, rows with no key --
with the same accuracy criterion (at most twice the error of naive
attention with float32 accumulation and P rounded to the input dtype, plus
one ulp at 1.0; tests/_kernel_util.py), a check that fwd_mma is the kernel that ran, and a long
sequence, (B, H, L, d) = (4, 16, 8192, 128), against a float32 CuPy
reference computed head by head.  Outputs are poisoned with NaN before each
launch, and repeated runs must agree bit for bit.

Skipped cleanly without CuPy or a CUDA device (tests/conftest.py), and on
GPUs older than sm_80, where fwd_mma does not apply.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash

from _kernel_util import (HALF_DTYPES, HALF_IDS, MASK_LENGTHS, MASK_WINDOWS, attention_on_gpu, check_against_oracle,
                          check_head_dim, check_long_sequence, check_masks, gpu_poisoned, launched)  # noqa: F401
from _util import random_array

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def sm80_or_later():
    arch = int(cp.cuda.Device().compute_capability)
    if arch < 80:
        pytest.skip(f"fwd_mma needs sm_80 or later; this GPU is sm_{arch}")


# ---- the correctness matrix ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("d", [32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256])
def test_every_head_dim_runs_fwd_mma_and_matches_oracle(rng, launched, dtype, d):  # noqa: F811
    check_head_dim(rng, launched, dtype, d, "cf::fwd_mma_kernel")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@MASK_LENGTHS
@MASK_WINDOWS
def test_masks_match_oracle(rng, dtype, seqlen_q, seqlen_k, window):
    check_masks(rng, dtype, seqlen_q, seqlen_k, window)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_rows_with_no_key_are_zero_with_lse_minus_inf(rng, dtype):
    q = random_array(rng, (2, 2, 500, 64), dtype)
    k = random_array(rng, (2, 2, 60, 64), dtype)
    v = random_array(rng, (2, 2, 60, 64), dtype)
    out, lse = attention_on_gpu(q, k, v, causal=True)
    check_against_oracle(out, lse, q, k, v, window=(None, 0))
    assert (out[:, :, :440] == 0).all() and np.isneginf(lse[:, :, :440]).all()
    assert np.isfinite(lse[:, :, 440:]).all()


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("heads_q, heads_kv", [(8, 2), (6, 1)], ids=["gqa4", "mqa"])
def test_grouped_and_multi_query_heads(rng, launched, dtype, heads_q, heads_kv):  # noqa: F811
    q = random_array(rng, (2, heads_q, 190, 64), dtype)
    k = random_array(rng, (2, heads_kv, 250, 64), dtype)
    v = random_array(rng, (2, heads_kv, 250, 64), dtype)
    out, lse = attention_on_gpu(q, k, v, enable_gqa=heads_kv > 1, window=(30, 2))
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_mma_kernel"]
    check_against_oracle(out, lse, q, k, v, window=(30, 2), gqa_ratio=heads_q // heads_kv)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_strided_views_in_and_out(rng, launched, dtype):  # noqa: F811
    b, h, lq, lk, d = 2, 3, 170, 260, 128
    q_store = random_array(rng, (b, lq, h, d), dtype)      # (B, L, H, d) storage
    k_store = random_array(rng, (b, h, 2 * lk, d), dtype)
    v_store = random_array(rng, (b, h, lk, d), dtype)

    def views(qs, ks, vs):   # (B, H, L, d) views: transposed, every other key row, reversed values
        return qs.transpose(0, 2, 1, 3), ks[:, :, ::2], vs[:, :, ::-1]

    q, k, v = views(q_store, k_store, v_store)
    qg, kg, vg = views(cp.asarray(q_store), cp.asarray(k_store), cp.asarray(v_store))
    out = gpu_poisoned((b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    result = cupyflash.attention(qg, kg, vg, out=out, causal=True, backend="cuda")
    assert result is out and vg.strides[2] < 0
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_mma_kernel"]
    _, lse = cupyflash.attention(qg, kg, vg, causal=True, return_lse=True, backend="cuda")
    check_against_oracle(cp.asnumpy(out), cp.asnumpy(lse), q, k, v, window=(None, 0))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_misaligned_rows_fall_back_to_fwd_simt(rng, launched, dtype):  # noqa: F811
    q = random_array(rng, (1, 2, 100, 36), dtype)    # rows of 72 bytes
    k = random_array(rng, (1, 2, 120, 36), dtype)
    v = random_array(rng, (1, 2, 120, 36), dtype)
    out, lse = attention_on_gpu(q, k, v, causal=True)
    assert [n.split("<")[0] for n in launched] == ["cf::fwd_simt_kernel"]
    check_against_oracle(out, lse, q, k, v, window=(None, 0))


@pytest.mark.parametrize("scale, kernel", [(1e-30, "cf::fwd_mma_kernel"), (1e-40, "cf::fwd_simt_kernel"),
                                           (4.4e-159, "cf::fwd_simt_kernel")],
                         ids=["tiny", "float32-subnormal", "float32-zero"])
def test_tiny_scales_give_finite_rows(rng, launched, scale, kernel):  # noqa: F811
    # fwd_mma folds the scale into the exponent as a float32 scale * log2(e) times
    # every score, masked ones (-inf) included: where that factor is 0 -- or a
    # subnormal, which this GPU flushes (-ftz=true) and the emulator does not -- the
    # rows were NaN, so such scales run fwd_simt (the tail block masks key columns)
    q = random_array(rng, (1, 2, 70, 64), HALF_DTYPES[0])
    k = random_array(rng, (1, 2, 90, 64), HALF_DTYPES[0])
    v = random_array(rng, (1, 2, 90, 64), HALF_DTYPES[0])
    out, lse = attention_on_gpu(q, k, v, scale=scale)
    assert [n.split("<")[0] for n in launched] == [kernel]
    check_against_oracle(out, lse, q, k, v, scale=scale)


# ---- a long sequence -------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_long_sequence_d128_against_float32_reference_and_bit_identical(launched, dtype, causal):  # noqa: F811
    check_long_sequence(launched, dtype, causal, "cf::fwd_mma_kernel")
