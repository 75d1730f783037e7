"""Tier 1: fwd_tf32 and bwd_tf32, float32 on the TF32 tensor cores (``precision="tf32"`` / ``"tf32x3"``), on a real GPU.

The matrices of tests/test_fwd_tf32.py and tests/test_bwd_tf32.py on the device
through ``cupyflash.attention`` and ``cupyflash.attention_backward``:
every instantiation with tails in both axes, causal and window masks with
Lq < Lk and Lq > Lk, GQA, padded and unaligned head dims, a split decoding
step, a check that fwd_tf32 is what ran, and repeated runs bit for bit.
Outputs are poisoned with NaN before each launch.  The accuracy rules are the
emulated tier's, stated against what the hardware may do (its TF32 MMAs
accumulate in "at least" float32, in an unspecified order): "tf32" no further
from the float64 oracle than twice the naive TF32 attention of the same inputs,
"tf32x3" within its derived bound (tf32x3_forward_bound: float32's table, the
split products and the cuts of its instruction chains); gradients: "tf32" within
twice the naive TF32 backward's error, "tf32x3" within the float32 gradient bound
of tests/test_gpu_backward.py (32 epsilons of the terms each element sums) plus
tf32x3_gradient_allowance.  Both bounds take the tensor cores' adder to be
HARDWARE_ACCUMULATION (docs/testing.md, "Error analysis").  Deterministic runs of
the backward are bit-identical.  Skipped cleanly without CuPy or a CUDA device, and below
compute capability 8.0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash._families import BWD_TF32, FWD_TF32
from cupyflash._families.fwd_tf32 import TF32_HEAD_DIMS, TF32_PASSES
from cupyflash.reference import naive_attention, naive_attention_backward

from _backward_util import (TF32_YARDSTICK_FACTOR, assert_within_term_bound, assert_within_yardstick,
                            backward_term_sizes, naive_tf32_backward, tf32x3_gradient_allowance)
from _util import naive_tf32_attention, plain_call_rows, random_array, tf32x3_forward_bound

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TF32_ROWS = plain_call_rows(FWD_TF32)
PRECISIONS = tuple(TF32_PASSES)
# The GPU's TF32 adder is undocumented: the bounds take the emulator's truncating model with
# no extra bits, the widest per instruction (9 * 2^-23 of its terms; tf32_mma_cut), which
# also covers an instruction summed in two fused k4 steps keeping one extra bit or more.
# Narrow it to what tests/test_gpu_first_contact.py's probes decode on the device.
HARDWARE_ACCUMULATION = "truncate:0"


@pytest.fixture(scope="module", autouse=True)
def tensor_core_gpu():
    arch = int(cp.cuda.Device().compute_capability)
    if arch < 80:
        pytest.skip(f"fwd_tf32 runs on compute capability 8.0 and newer; this GPU is sm_{arch}")


def run(q, k, v, *, precision, window=(None, None), gqa_ratio=1):
    out = cp.full(q.shape[:-1] + (v.shape[-1],), cp.nan, dtype=cp.float32)
    _, lse = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, return_lse=True,
                                 window=window, enable_gqa=gqa_ratio > 1, precision=precision, backend="cuda")
    return cp.asnumpy(out), cp.asnumpy(lse)


def check(q, k, v, *, precision, window=(None, None), gqa_ratio=1):
    """Two runs with ``precision`` (same bits), then the accuracy rule of the module docstring."""
    out, lse = run(q, k, v, precision=precision, window=window, gqa_ratio=gqa_ratio)
    again, again_lse = run(q, k, v, precision=precision, window=window, gqa_ratio=gqa_ratio)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(again_lse, lse)
    assert not np.isnan(out).any()
    scale = 1 / math.sqrt(q.shape[-1])
    ref, ref_lse = naive_attention(*(x.astype(np.float64) for x in (q, k, v)), scale=scale, window=window,
                                   enable_gqa=gqa_ratio > 1, return_lse=True)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert (out[np.isneginf(ref_lse)] == 0).all()
    err = np.abs(out.astype(np.float64) - ref).max(initial=0.0)
    if precision == "tf32":
        yardstick = naive_tf32_attention(q, k, v, scale=scale, window=window, enable_gqa=gqa_ratio > 1)
        assert err <= 2 * np.abs(yardstick.astype(np.float64) - ref).max(initial=0.0), err
    else:
        bound = tf32x3_forward_bound(q, k, v, ref, scale=scale, accumulation=HARDWARE_ACCUMULATION, window=window,
                                     enable_gqa=gqa_ratio > 1)
        over = np.abs(out.astype(np.float64) - ref) / bound
        assert (over <= 1).all(), f"error {over.max():.3g} times the tf32x3 bound"


def qkv(rng, *, seqlen_q, seqlen_k, head_dim, heads_kv=1, gqa_ratio=1, batch=1):
    return (random_array(rng, (batch, heads_kv * gqa_ratio, seqlen_q, head_dim), np.float32),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float32),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float32))


@pytest.mark.parametrize("inst", TF32_ROWS, ids=lambda r: f"x{r.passes}-d{r.head_dim}")
def test_every_instantiation_with_tails_and_masks(cuda_spy, inst):
    precision = next(p for p, n in TF32_PASSES.items() if n == inst.passes)
    rng = np.random.default_rng(inst.head_dim)
    q, k, v = qkv(rng, seqlen_q=inst.block_m + 21, seqlen_k=inst.block_m + 2 * inst.block_n + 5,
                  head_dim=inst.head_dim)
    for window in ((None, 0), (None, None)):
        check(q, k, v, precision=precision, window=window)
    assert inst.name_expression in cuda_spy.launched


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 200)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (5, 40), (70, None)])
def test_masks_and_gqa(cuda_spy, precision, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    check(*qkv(rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, heads_kv=2, gqa_ratio=2),
          precision=precision, window=window, gqa_ratio=2)
    assert any("fwd_tf32" in n for n in cuda_spy.launched)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100])
def test_padded_and_unaligned_head_dims(cuda_spy, precision, head_dim):
    rng = np.random.default_rng(head_dim)
    check(*qkv(rng, seqlen_q=300, seqlen_k=500, head_dim=head_dim, batch=2), precision=precision)
    bucket = min(b for b in TF32_HEAD_DIMS if b >= head_dim)
    assert cuda_spy.launched[0].startswith(f"cf::fwd_tf32_kernel<{bucket},")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_split_decoding_step_and_a_long_sequence(cuda_spy, precision):
    rng = np.random.default_rng(7)
    # Lq = 1 over 20000 keys: few CTAs, so the keys are split
    check(*qkv(rng, seqlen_q=1, seqlen_k=20000, head_dim=64, heads_kv=4), precision=precision)
    assert cuda_spy.launched[1] == "cf::fwd_combine_kernel<float, float>"
    check(*qkv(rng, seqlen_q=2048, seqlen_k=2048, head_dim=128, heads_kv=4), precision=precision,
          window=(None, 0))


# ---- the backward ---------------------------------------------------------------------------------

def check_backward(q, k, v, *, precision, window=(None, None), gqa_ratio=1, deterministic=True):
    """attention_backward with ``precision`` on the device, twice (same bits), against the float64 oracle."""
    dev = [cp.asarray(x) for x in (q, k, v)]
    kw = dict(window=window, enable_gqa=gqa_ratio > 1)
    out, lse = cupyflash.attention(*dev, return_lse=True, precision=precision, **kw)
    rng = np.random.default_rng(q.shape[-2])
    dout = random_array(rng, out.shape, np.float32)
    runs = [tuple(cp.asnumpy(g) for g in cupyflash.attention_backward(
        cp.asarray(dout), *dev, out, lse, precision=precision, deterministic=deterministic, **kw))
        for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    out, lse = cp.asnumpy(out), cp.asnumpy(lse)
    scale = 1 / math.sqrt(q.shape[-1])
    expected = naive_attention_backward(dout, q, k, v, scale=scale, **kw)
    naive = naive_tf32_backward(dout, q, k, v, out, lse, scale=scale, window=window, gqa_ratio=gqa_ratio)
    sizes = backward_term_sizes(dout, q, k, v, scale=scale, **kw)
    allowance = tf32x3_gradient_allowance(q, k, v, sizes, scale=scale, accumulation=HARDWARE_ACCUMULATION,
                                          gqa_ratio=gqa_ratio)
    for name, g, e, n, size, extra in zip(("dq", "dk", "dv"), runs[0], expected, naive, sizes, allowance):
        assert np.isfinite(g).all(), name
        if precision == "tf32x3":
            terms = max(q.shape[-2], k.shape[-2]) * q.shape[-1]
            assert_within_term_bound(g, e, size, eps=np.finfo(np.float32).eps, head_dim=q.shape[-1],
                                     floor=extra + terms * np.finfo(np.float32).tiny, what=name)
        else:
            assert_within_yardstick(g, e, n, factor=TF32_YARDSTICK_FACTOR, sizes=size, what=name)


BWD_ROWS = [r for r in plain_call_rows(BWD_TF32) if r.role == "dkdv"]


@pytest.mark.parametrize("inst", BWD_ROWS, ids=lambda r: f"x{r.passes}-d{r.head_dim}")
def test_backward_every_instantiation_with_tails_gqa_and_masks(cuda_spy, inst):
    precision = next(p for p, n in TF32_PASSES.items() if n == inst.passes)
    rng = np.random.default_rng(inst.head_dim)
    q, k, v = qkv(rng, seqlen_q=2 * inst.block_n + 13, seqlen_k=3 * inst.block_n + 5, head_dim=inst.head_dim,
                  heads_kv=2, gqa_ratio=2)
    for window in ((None, 0), (None, None)):
        check_backward(q, k, v, precision=precision, window=window, gqa_ratio=2)
    assert inst.name_expression in cuda_spy.launched


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim", [17, 100])
def test_backward_masks_unaligned_head_dims_and_atomics_off(cuda_spy, precision, head_dim):
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, seqlen_q=150, seqlen_k=100, head_dim=head_dim, batch=2)
    check_backward(q, k, v, precision=precision, window=(16, 0), deterministic=False)
    assert any("bwd_tf32_dq_kernel" in n for n in cuda_spy.launched)   # no atomic variant

