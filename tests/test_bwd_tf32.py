"""bwd_tf32, the float32 backward on the TF32 tensor cores (cuda_src/bwd_tf32.cu), without a GPU:
what is particular to it.  Its dispatch (only where the caller allows TF32 --
``attention_backward(..., precision="tf32")`` or ``"tf32x3"`` -- for float32 with d = dv
up to 128 on sm_80 and newer, with or without ``deterministic``), launch geometry,
static report and every instantiation on the emulator are tests/test_families.py's.

Here: precision is checked before any work and the CPU path stays IEEE; on the CPU
emulator (shuffled threads, race check) through :func:`cupyflash._run.backward`,
gradients NaN-poisoned first, TF32's error model against the float64 oracle -- "tf32x3"
to float32's own tolerance, "tf32" within twice the error of a naive TF32 backward of
the same inputs (tests/_backward_util.py; tests/_kernel_util.py's Case applies both):
rows that see no key and keys no row sees, padded head dims (d = 3 .. 100, rows not
16-byte aligned), transposed, reversed and broadcast strides; runs with different thread
orders bit-identical; three passes recover float32's accuracy; large scales; the public
call routes ``precision``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch
from cupyflash._families import BWD_TF32
from cupyflash._families.fwd_tf32 import TF32_HEAD_DIMS, TF32_PASSES
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention_backward

from _backward_util import assert_within_term_bound, backward_term_sizes, tf32x3_gradient_allowance
from _kernel_util import Case, check_broadcast_and_strided_views, needs_emulator, qkv
from _util import LaunchSpy, assert_grad_close, logit_rounding, random_array

ROWS = BWD_TF32.rows
PRECISIONS = tuple(TF32_PASSES)


def _bucket(d):
    return min(b for b in TF32_HEAD_DIMS if b >= d)


def tf32_case(rng, q, k, v, *, precision="tf32x3", **kw):
    """A float32 backward problem run with TF32 allowed (``precision``), and the accuracy
    rule of that precision (Case.check)."""
    return Case(rng, q, k, v, precision=precision, **kw)


def test_precision_is_checked_before_any_work():
    rng = np.random.default_rng(0)
    q, k, v = (random_array(rng, (1, 2, 8, 16), np.float64) for _ in range(3))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"`precision`='tf32' applies to float32 inputs only; got float64"):
        cupyflash.attention_backward(out, q, k, v, out, lse, precision="tf32")
    with pytest.raises(ValueError, match="`precision` must be one of"):
        cupyflash.attention_backward(out, q, k, v, out, lse, precision="TF32")


def test_numpy_path_stays_ieee_whatever_precision_allows():
    rng = np.random.default_rng(1)
    q, k, v = (random_array(rng, (2, 3, 20, 24), np.float32) for _ in range(3))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = random_array(rng, out.shape, np.float32)
    ieee = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for precision in PRECISIONS:
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, precision=precision)
        for a, b in zip(grads, ieee):
            np.testing.assert_array_equal(a, b)


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=3232, shuffle=True, race_check=True)


@pytest.fixture
def spy(executor):
    return LaunchSpy(executor)


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(spy):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key (a whole query block of them).
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, np.float32, seqlen_q=150, seqlen_k=20, head_dim=32)
    case = tf32_case(rng, q, k, v, window=(None, 0))
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dq[:, :, :130] == 0).all()
    # Window (2, 0) with Lq < Lk: keys 0 .. 40 are seen by no row (whole key blocks).
    q, k, v = qkv(rng, np.float32, seqlen_q=30, seqlen_k=73, head_dim=32)
    case = tf32_case(rng, q, k, v, window=(2, 0), precision="tf32")
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dk[:, :, :41] == 0).all() and (dv[:, :, :41] == 0).all()


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(spy, head_dim, precision):
    # d = 3 and 17: rows of 12 and 68 bytes, not 16-byte aligned (4-byte cp.async)
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, np.float32, batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    case = tf32_case(rng, q, k, v, window=(None, 0), precision=precision)
    case.check(case.run(spy))
    assert spy.launched[1] == next(r.name_expression for r in ROWS if r.head_dim == _bucket(head_dim)
                                   and r.passes == TF32_PASSES[precision] and r.role == "dkdv")


@needs_emulator
def test_transposed_reversed_and_broadcast_views(spy):
    check_broadcast_and_strided_views(spy, np.float32, precision="tf32x3")
    assert spy.launched[1].startswith("cf::bwd_tf32_dkdv_kernel<64,")


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bit_identical_across_thread_orders_and_deterministic_modes(precision):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, np.float32, heads_kv=2, gqa_ratio=3, seqlen_q=97, seqlen_k=120, head_dim=64)
    case = tf32_case(rng, q, k, v, gqa_ratio=3, window=(40, 0), precision=precision)
    runs = [case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=False)),
                     deterministic=deterministic)
            for seed, deterministic in ((1, True), (2, False))]
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    case.check(runs[0])


@needs_emulator
def test_three_passes_recover_float32_accuracy_and_one_does_not(spy):
    # tf32x3: within float32's term bound plus what its split products and, where the
    # emulator's mma truncates, the cuts of its instruction chains add
    # (tf32x3_gradient_allowance, for the executor's accumulation model).  tf32: outside the
    # part of that bound that is not accumulation (the term bound and the split), at least 3
    # times somewhere in each gradient (docs/testing.md, "Error analysis").
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, np.float32, heads_kv=2, seqlen_q=130, seqlen_k=150, head_dim=64)
    eps = float(np.finfo(np.float32).eps)
    for precision in PRECISIONS:
        case = tf32_case(np.random.default_rng(1), q, k, v, precision=precision)
        grads, expected = case.run(spy), case.expected()
        sizes = backward_term_sizes(case.dout, q, k, v, scale=case.scale)
        accumulation = spy.inner.accumulation if precision == "tf32x3" else "exact"
        allowance = tf32x3_gradient_allowance(q, k, v, sizes, scale=case.scale, accumulation=accumulation)
        for name, g, e, size, extra in zip(("dq", "dk", "dv"), grads, expected, sizes, allowance):
            if precision == "tf32x3":
                assert_within_term_bound(g, e, size, eps=eps, head_dim=64, floor=extra,
                                         what=f"{name} ({accumulation})")
            else:   # a third of one pass's error still breaks it
                with pytest.raises(AssertionError):
                    assert_within_term_bound(e + (g.astype(np.float64) - e) / 3, e, size, eps=eps, head_dim=64,
                                             floor=extra, what=name)


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(spy, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=24)
    case = tf32_case(rng, q, k, v)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    if seqlen_k == 0:
        assert (dq == 0).all()
    if seqlen_q == 0:
        assert (dk == 0).all() and (dv == 0).all()
    assert [n.split("<")[0] for n in spy.launched] == (
        ["cf::bwd_simt_dot_do_o_kernel"] * (seqlen_q > 0) + ["cf::bwd_tf32_dkdv_kernel"] * (seqlen_k > 0)
        + ["cf::bwd_tf32_dq_kernel"] * (seqlen_q > 0))


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("scale", [12.0, -0.7, 0.0], ids=["large", "negative", "zero"])
def test_extreme_and_negative_scales(spy, scale, precision):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float32, seqlen_q=45, seqlen_k=77, head_dim=40)
    case = tf32_case(rng, q, k, v, scale=scale, window=(None, 0), precision=precision)
    dq, dk, dv = case.run(spy)
    # A scale of 12 (or -0.7, 4.4 times 1/sqrt(d)) amplifies the scores' rounding through
    # exp: the term bound widened by the logits' size, against the float64 oracle (the
    # IEEE kernels meet the same rule, test_ieee_kernels_meet_the_large_logit_rule).
    case.check((dq, dk, dv), logits=logit_rounding(q, k, scale))
    if scale == 0.0:   # P is uniform over the visible keys, and dq, dk carry the factor scale
        assert (dq == 0).all() and (dk == 0).all()


@needs_emulator
@pytest.mark.parametrize("scale", [12.0, -0.7], ids=["large", "negative"])
def test_ieee_kernels_meet_the_large_logit_rule(spy, scale):
    # The rule the tf32x3 kernels are held to at large scales is not looser than IEEE
    # float32 needs: bwd_simt meets it too (it once was the yardstick, which nothing bounded).
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float32, seqlen_q=45, seqlen_k=77, head_dim=40)
    case = tf32_case(rng, q, k, v, scale=scale, window=(None, 0), precision="ieee")
    case.check(case.run(spy), logits=logit_rounding(q, k, scale))


@needs_emulator
def test_attention_backward_routes_precision_to_the_kernels(monkeypatch):
    spy = LaunchSpy(_dispatch.executor_for("emulator"))
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: spy)
    rng = np.random.default_rng(4)
    q, k, v = (random_array(rng, (1, 2, 40, 48), np.float32) for _ in range(3))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    dout = random_array(rng, out.shape, np.float32)
    expected = naive_attention_backward(dout, q, k, v, causal=True)      # the float64 oracle
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, precision="tf32x3",
                                         backend="emulator")
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_grad_close(g, e, np.float32, what=name)
    assert [n.split("<")[0] for n in spy.launched] == ["cf::bwd_simt_dot_do_o_kernel", "cf::bwd_tf32_dkdv_kernel",
                                                       "cf::bwd_tf32_dq_kernel"]
