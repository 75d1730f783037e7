"""bwd_tf32, the float32 backward on the TF32 tensor cores (cuda_src/bwd_tf32.cu), without a GPU.

Dispatch: only where the caller allows TF32 -- ``attention_backward(...,
precision="tf32")`` or ``"tf32x3"`` -- for float32 with d = dv up to 128 on
sm_80 and newer, with or without ``deterministic`` (no atomic variant);
bwd_simt's delta kernel runs first.  precision="ieee" never runs it.

Static tier: every row compiled offline by NVRTC for sm_80, sm_86, sm_89 and
sm_90 -- no spills, no stack, no local memory; the SASS holds the HMMA of one
copy of each product, cp.async, and no ldmatrix or atomics.

Emulated tier: the kernels through :func:`cupyflash._gpu_bwd.backward` on the
CPU emulator (shuffled threads, race check), gradients NaN-poisoned first,
against the float64 oracle -- "tf32x3" to float32's own tolerance, "tf32"
within twice the error of a naive TF32 backward of the same inputs
(tests/_backward_util.py): partial query and key blocks, causal and window
masks with Lq < Lk and Lq > Lk, rows that see no key and keys no row sees, GQA
groups, padded head dims (d = 3 .. 100, rows not 16-byte aligned), transposed,
reversed and broadcast strides; runs with different thread orders
bit-identical; the public call routes ``precision``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch, _gpu_bwd, _report
from cupyflash._kernels import TF32_HEAD_DIMS, TF32_PASSES, instantiations, launchable
from cupyflash._launch import backward_kernel, backward_launch_config
from cupyflash.emulator import EmulatorExecutor, emulator_available
from cupyflash.reference import naive_attention_backward

from _backward_util import (TF32_YARDSTICK_FACTOR, assert_within_term_bound, assert_within_yardstick,
                            backward_term_sizes, naive_tf32_backward)
from _util import LaunchSpy, assert_compiled_clean, assert_grad_close, logit_rounding, random_array
from test_backward_emulated import Case, check_broadcast_and_strided_views, qkv

ROWS = [r for r in instantiations() if r.family == "bwd_tf32"]
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
PRECISIONS = tuple(TF32_PASSES)
TF32 = ["bwd_simt_dot_do_o_kernel", "bwd_tf32_dkdv_kernel", "bwd_tf32_dq_kernel"]

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


def _kernels(d, dv=None, arch=90, dtype="float32", **kw):
    return [backward_kernel(r) for r in _gpu_bwd.select(dtype, d, d if dv is None else dv, arch, **kw)]


def _bucket(d):
    return min(b for b in TF32_HEAD_DIMS if b >= d)


# ---- the catalogue and the dispatcher -----------------------------------------------------------

def test_select_picks_bwd_tf32_only_where_tf32_is_allowed():
    for precision, passes in TF32_PASSES.items():
        for arch in (80, 86, 89, 90, 100):
            for d in (1, 3, 32, 40, 64, 100, 128):
                for deterministic in (True, False):
                    rows = _gpu_bwd.select("float32", d, d, arch, deterministic=deterministic, precision=precision,
                                           dmma=True)
                    assert [backward_kernel(r) for r in rows] == TF32
                    assert {r.head_dim for r in rows} == {_bucket(d)}
                    assert {r.passes for r in rows[1:]} == {passes}
                assert "bwd_tf32_dkdv_kernel" not in _kernels(d, arch=arch)               # default: IEEE
                assert "bwd_tf32_dkdv_kernel" not in _kernels(d, arch=arch, precision="ieee")
        assert "bwd_tf32_dkdv_kernel" not in _kernels(64, arch=75, precision=precision)
        assert "bwd_tf32_dkdv_kernel" not in _kernels(64, 32, precision=precision)
        assert "bwd_tf32_dkdv_kernel" not in _kernels(129, precision=precision)


def test_launchable_on_every_tensor_core_gpu():
    names = {r.name_expression for r in ROWS}
    assert len(ROWS) == 2 * len(TF32_HEAD_DIMS) * len(TF32_PASSES) == len(names)   # dK/dV, dQ per head dim
    for arch in (75, 80, 86, 89, 90, 100):
        assert (names <= launchable(arch)) == (arch >= 80)
        assert (not names & launchable(arch)) == (arch < 80)


def test_launch_config_and_shared_memory():
    sizes = dict(batch=2, heads_q=6, heads_kv=3, seqlen_q=1000, seqlen_k=333)
    for r in ROWS:
        grid, block, shared = backward_launch_config(r, **sizes)
        assert block == (r.threads, 1, 1) and r.dtype == "float32" and r.head_dim == r.head_dim_v
        if backward_kernel(r) == "bwd_tf32_dkdv_kernel":
            own, streamed = r.block_n, r.block_m
            assert grid == (2 * 3 * -(-333 // own), 1, 1)
        else:
            own, streamed = r.block_m, r.block_n
            assert grid == (2 * 6 * -(-1000 // own), 1, 1)
        # K and V (Q and dO), then two stages of the two streamed tiles, in floats
        assert shared == (2 * own + 4 * streamed) * r.head_dim * 4 <= 99 * 1024


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


# ---- static: NVRTC for sm_80, sm_86, sm_89, sm_90 ---------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(ARCHS, ROWS)


def test_every_kernel_compiles_without_spills_stack_or_local_memory(report):
    assert_compiled_clean(report, ROWS, ARCHS)


def test_sass_issues_the_mma_of_each_product_and_no_atomics(report):
    # Per streamed block a warp issues, for each of the two score products (S and
    # dP), passes x m_tiles x streamed/8 MMAs per k8 step -- unrolled four k8 steps
    # (32 columns) deep, two at d = 32 -- and for each gradient product (dV and dK,
    # or dQ) passes x m_tiles x d/8 per k8 step over the streamed rows, fully unrolled.
    insts = {i.name_expression: i for i in ROWS}
    for r in report:
        inst, sass = insts[r["name"]], r["sass"]
        dkdv = backward_kernel(inst) == "bwd_tf32_dkdv_kernel"
        own, streamed = (inst.block_n, inst.block_m) if dkdv else (inst.block_m, inst.block_n)
        m_tiles = own // (inst.threads // 32) // 16
        scores = 2 * inst.passes * (4 if inst.head_dim > 32 else 2) * m_tiles * (streamed // 8)
        gradients = (2 if dkdv else 1) * inst.passes * (streamed // 8) * (inst.head_dim // 8) * m_tiles
        assert sass.get("HMMA") == scores + gradients, (r["arch"], r["name"], sass.get("HMMA"), scores + gradients)
        assert sass.get("LDGSTS", 0) > 0, (r["arch"], r["name"])
        assert not any(op.startswith(("DMMA", "LDSM", "ATOM", "RED")) for op in sass), (r["arch"], r["name"])


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=3232, shuffle=True, race_check=True)


@pytest.fixture
def spy(executor):
    return LaunchSpy(executor)


class Tf32Case(Case):
    """A float32 backward problem run with TF32 allowed, and its accuracy rule."""

    def __init__(self, rng, q, k, v, *, precision="tf32x3", **kw):
        super().__init__(rng, q, k, v, **kw)
        self.precision = precision

    def check(self, grads, *, logits=0.0):
        """tf32x3: float32's gradient bound of the GPU tier (32 epsilons of the terms each
        element sums; a TF32x3 product is good to about 6 float32 epsilons), plus what
        probabilities flushed to zero below float32's smallest normal can take (ex2.approx
        flushes them), and with ``logits`` what a large scale makes of the scores' rounding
        (assert_within_term_bound); tf32: twice the error of the naive TF32 backward."""
        expected = self.expected()
        naive = naive_tf32_backward(self.dout, self.q, self.k, self.v, self.out, self.lse, scale=self.scale,
                                    window=self.window, gqa_ratio=self.gqa_ratio)
        kw = dict(scale=self.scale, window=self.window, enable_gqa=self.gqa_ratio > 1)
        sizes = backward_term_sizes(self.dout, self.q, self.k, self.v, **kw)
        flushed = backward_term_sizes(self.dout, self.q, self.k, self.v, unit_probabilities=True, **kw)
        for name, g, e, n, size, unit in zip(("dq", "dk", "dv"), grads, expected, naive, sizes, flushed):
            assert not np.isnan(g).any(), f"{name}: element left unwritten (NaN)"
            if self.precision in ("tf32x3", "ieee"):
                assert_within_term_bound(g, e, size, eps=np.finfo(np.float32).eps, head_dim=self.q.shape[-1],
                                         floor=np.finfo(np.float32).tiny * unit, logits=logits, what=name)
            else:
                assert_within_yardstick(g, e, n, factor=TF32_YARDSTICK_FACTOR, sizes=size, what=name)


@needs_emulator
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("inst", [r for r in ROWS if "dkdv" in r.name_expression],
                         ids=lambda r: f"x{r.passes}-d{r.head_dim}")
def test_every_instantiation_matches_the_oracle_with_tails_gqa_and_masks(spy, inst, causal):
    precision = next(p for p, n in TF32_PASSES.items() if n == inst.passes)
    rng = np.random.default_rng(inst.head_dim + causal)
    # Partial query and key blocks in both kernels; Lk > Lq so that, causal, key
    # blocks are fully visible, cut by the diagonal and unseen; two query heads per kv head.
    own_keys = inst.block_n
    q, k, v = qkv(rng, np.float32, heads_kv=2, gqa_ratio=2, seqlen_q=2 * own_keys + 13, seqlen_k=3 * own_keys + 5,
                  head_dim=inst.head_dim)
    case = Tf32Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if causal else (None, None), precision=precision)
    case.check(case.run(spy))
    assert spy.launched == [f"cf::bwd_simt_dot_do_o_kernel<float, {inst.head_dim}>"] + [
        r.name_expression for r in ROWS if r.head_dim == inst.head_dim and r.passes == inst.passes]


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 133)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (5, 40), (31, None)], ids=["causal", "w16-0", "w5-40", "w31-N"])
def test_masks_match_the_oracle(spy, precision, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    q, k, v = qkv(rng, np.float32, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32)
    case = Tf32Case(rng, q, k, v, window=window, precision=precision)
    case.check(case.run(spy))
    assert {n.split("<")[0] for n in spy.launched[1:]} == {"cf::bwd_tf32_dkdv_kernel", "cf::bwd_tf32_dq_kernel"}


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(spy):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key (a whole query block of them).
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, np.float32, seqlen_q=150, seqlen_k=20, head_dim=32)
    case = Tf32Case(rng, q, k, v, window=(None, 0))
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dq[:, :, :130] == 0).all()
    # Window (2, 0) with Lq < Lk: keys 0 .. 40 are seen by no row (whole key blocks).
    q, k, v = qkv(rng, np.float32, seqlen_q=30, seqlen_k=73, head_dim=32)
    case = Tf32Case(rng, q, k, v, window=(2, 0), precision="tf32")
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
    case = Tf32Case(rng, q, k, v, window=(None, 0), precision=precision)
    case.check(case.run(spy))
    assert spy.launched[1] == next(r.name_expression for r in ROWS if r.head_dim == _bucket(head_dim)
                                   and r.passes == TF32_PASSES[precision] and "dkdv" in r.name_expression)


@needs_emulator
def test_transposed_reversed_and_broadcast_views(spy):
    check_broadcast_and_strided_views(spy, np.float32, Tf32Case)
    assert spy.launched[1].startswith("cf::bwd_tf32_dkdv_kernel<64,")


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bit_identical_across_thread_orders_and_deterministic_modes(precision):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, np.float32, heads_kv=2, gqa_ratio=3, seqlen_q=97, seqlen_k=120, head_dim=64)
    case = Tf32Case(rng, q, k, v, gqa_ratio=3, window=(40, 0), precision=precision)
    runs = [case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=False)),
                     deterministic=deterministic)
            for seed, deterministic in ((1, True), (2, False))]
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    case.check(runs[0])


@needs_emulator
def test_three_passes_recover_float32_accuracy_and_one_does_not(spy):
    # tf32x3 within a few times bwd_simt's IEEE error; tf32 near TF32's 2^-11, far outside it
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, np.float32, heads_kv=2, seqlen_q=130, seqlen_k=150, head_dim=64)
    errors = {}
    for precision in ("ieee",) + PRECISIONS:
        case = Tf32Case(np.random.default_rng(1), q, k, v, precision=precision)
        grads, expected = case.run(spy), case.expected()
        errors[precision] = max(np.abs(g.astype(np.float64) - e).max() / np.abs(e).max()
                                for g, e in zip(grads, expected))
    assert errors["tf32x3"] <= 4 * errors["ieee"], errors
    assert errors["tf32"] > 100 * errors["tf32x3"], errors


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(spy, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=24)
    case = Tf32Case(rng, q, k, v)
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
    case = Tf32Case(rng, q, k, v, scale=scale, window=(None, 0), precision=precision)
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
    case = Tf32Case(rng, q, k, v, scale=scale, window=(None, 0), precision="ieee")
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
