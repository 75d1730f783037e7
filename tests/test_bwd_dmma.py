"""bwd_dmma, the backward on the FP64 tensor cores (cuda_src/bwd_dmma.cu), without a GPU: what is
particular to it.  Its dispatch (the forward's switch: float64, and float32 computed in
double, with d = dv up to 128 on compute capability 8.0 and 9.0, with or without
``deterministic``), launch geometry, static report (the DMMA of one unrolled copy of each
product, no HMMA, ldmatrix or atomics) and every instantiation on the emulator are
tests/test_families.py's.

Here, on the CPU emulator (shuffled threads, race check) through
:func:`cupyflash._run.backward`, gradients NaN-poisoned first, against the float64
oracle to the dtype's rounding: rows that see no key and keys no row sees, padded head
dims (d = 3 .. 100, rows not 16-byte aligned), transposed, reversed and broadcast
strides; agreement with bwd_simt; runs with different thread orders bit-identical;
tiny and empty sequences; extreme scales.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash._families import BWD_DMMA
from cupyflash._families.fwd_dmma import DMMA_DTYPES, DMMA_HEAD_DIMS
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor

from _kernel_util import Case, check_broadcast_and_strided_views, needs_emulator, qkv
from _util import LaunchSpy, logit_rounding

ROWS = BWD_DMMA.rows
# bwd_dmma on for both dtypes
DMMA = KernelOptions(dmma=frozenset({"float64", "float32"}))


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=8080, shuffle=True, race_check=True)


@pytest.fixture
def spy(executor):
    """A record of the launches on the emulator."""
    return LaunchSpy(executor)


def _bucket(d):
    return min(b for b in DMMA_HEAD_DIMS if b >= d)


@needs_emulator
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(spy):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key (a whole query block of them).
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, np.float64, seqlen_q=150, seqlen_k=20, head_dim=32)
    case = Case(rng, q, k, v, window=(None, 0), options=DMMA)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dq[:, :, :130] == 0).all()
    # Window (2, 0) with Lq < Lk: keys 0 .. 40 are seen by no row (whole key blocks).
    q, k, v = qkv(rng, np.float64, seqlen_q=30, seqlen_k=73, head_dim=32)
    case = Case(rng, q, k, v, window=(2, 0), options=DMMA)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    assert (dk[:, :, :41] == 0).all() and (dv[:, :, :41] == 0).all()


@needs_emulator
@pytest.mark.parametrize("dtype", DMMA_DTYPES)
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(spy, head_dim, dtype):
    # d = 3 and 17: rows of 24 and 136 bytes (float32: 12 and 68), not 16-byte
    # aligned (4-byte cp.async; element-wise converting loads)
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, np.dtype(dtype), batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    case = Case(rng, q, k, v, window=(None, 0), options=DMMA)
    case.check(case.run(spy))
    assert spy.launched[1] == next(r.name_expression for r in ROWS if r.head_dim == _bucket(head_dim)
                                   and r.dtype == dtype and r.role == "dkdv")


@needs_emulator
def test_transposed_reversed_and_broadcast_views(spy):
    check_broadcast_and_strided_views(spy, np.float64, options=DMMA)
    assert spy.launched[1].startswith("cf::bwd_dmma_dkdv_kernel<64,")


@needs_emulator
def test_agrees_with_bwd_simt_and_is_bit_identical_across_thread_orders():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, np.float64, heads_kv=2, gqa_ratio=3, seqlen_q=97, seqlen_k=120, head_dim=64)
    case = Case(rng, q, k, v, gqa_ratio=3, window=(40, 0), options=DMMA)
    runs = [case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=seed, shuffle=True, race_check=False)),
                     deterministic=deterministic)
            for seed, deterministic in ((1, True), (2, False))]
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    case.options = KernelOptions()   # bwd_simt
    simt = case.run(LaunchSpy(EmulatorExecutor(arch=90, seed=3, shuffle=True, race_check=False)))
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], simt):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=name)
    case.check(runs[0])


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(spy, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float64, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=24)
    case = Case(rng, q, k, v, options=DMMA)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv))
    if seqlen_k == 0:
        assert (dq == 0).all()
    if seqlen_q == 0:
        assert (dk == 0).all() and (dv == 0).all()
    # a kernel runs only where it has rows to own: dK/dV needs keys, dQ (and delta) query rows
    assert [n.split("<")[0] for n in spy.launched] == (
        ["cf::bwd_simt_dot_do_o_kernel"] * (seqlen_q > 0) + ["cf::bwd_dmma_dkdv_kernel"] * (seqlen_k > 0)
        + ["cf::bwd_dmma_dq_kernel"] * (seqlen_q > 0))


@needs_emulator
@pytest.mark.parametrize("scale", [12.0, -0.7, 0.0], ids=["large", "negative", "zero"])
def test_extreme_and_negative_scales(spy, scale):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float64, seqlen_q=45, seqlen_k=77, head_dim=40)
    case = Case(rng, q, k, v, scale=scale, window=(None, 0), options=DMMA)
    dq, dk, dv = case.run(spy)
    case.check((dq, dk, dv), logits=logit_rounding(q, k, scale))   # scores of ~100: their rounding
    if scale == 0.0:   # P is uniform over the visible keys, and dq, dk carry the factor scale
        assert (dq == 0).all() and (dk == 0).all()
