"""The CUDA backward kernels (bwd_simt, bwd_mma) run on the CPU emulator: what is particular to them.
Their dispatch, bwd_mma's launch geometry, and every instantiation and the masks on the
emulator are tests/test_families.py's.

Each case calls :func:`cupyflash._run.backward` exactly as the GPU path
does, but through :class:`cupyflash.emulator.EmulatorExecutor` (threads and
blocks in shuffled order, shared-memory race and bounds checks on), with the
gradients poisoned with NaN before the launch so that an element no kernel
writes shows.  The forward's out and lse come from the float64 oracle (rounded
to the input and accumulator dtypes, as the forward returns them), so a
backward case costs only the backward's launches.  Gradients are compared
with the float64 oracle :func:`~cupyflash.reference.naive_attention_backward`:
float32 and float64 within the term bound (``assert_within_term_bound``), float16 and
bfloat16 within 1.25 times the error of a half-precision yardstick that rounds
where the kernels must (``tests/_backward_util.py``).  The executor is sm_80,
so float16/bfloat16 inputs with d == dv and 16-byte aligned rows run bwd_mma
(asserted where a test means it), everything else bwd_simt.  Together with
tests/test_families.py the cases cover every instantiation in the catalogue and every
branch of the kernels: partial query and key blocks, masked, unmasked and skipped block
pairs, rows that see no key, keys no row sees, GQA groups, broadcast
(stride-0) and transposed or reversed strides, Lq or Lk of 0.
"""

from __future__ import annotations

import itertools
import math
import shutil

import numpy as np
import pytest

import cupyflash
from cupyflash._families import BACKWARD, BWD_MMA, BWD_SIMT, Call, Sizes, select
from cupyflash._families.fwd_mma import MMA_HEAD_DIMS
from cupyflash._families.fwd_simt import HEAD_DIM_BUCKETS
from cupyflash._options import KernelOptions
from cupyflash._params import BWD_PARAMS, FWD_PARAMS, UNBOUNDED, bwd_params
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention_backward

from _backward_util import assert_within_term_bound, backward_term_sizes
from _kernel_util import Case, needs_emulator, qkv
from _util import (DTYPE_IDS, DTYPES, HALF, accum_dtype, assert_grad_close, cxx_struct_layout, logit_rounding,
                   plain_call_rows, poisoned, random_array)


def _select(dtype, d, dv, arch, **call):
    """The backward's launch plan (default options)."""
    return select(BACKWARD, Call(np.dtype(dtype).name, d, dv, **call), arch, KernelOptions())


def _launch_config(row, *, batch, heads_q, heads_kv, seqlen_q, seqlen_k):
    return row.family.launch_config(row, Sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k))


@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=1234, shuffle=True, race_check=True)


# ---- the params struct, the catalogue and the launch configuration -----------------------------


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_bwd_params_dtype_matches_cxx_struct_layout(tmp_path):
    top = [n for n in BWD_PARAMS.names if n != "fwd"]
    nested = list(FWD_PARAMS.names)
    cxx = cxx_struct_layout(
        tmp_path, "params_bwd.cuh", "cf::BwdParams",
        {**{n: f"offsetof(cf::BwdParams, {n})" for n in ["fwd"] + top},
         **{f"fwd.{n}": f"offsetof(cf::BwdParams, fwd) + offsetof(cf::FwdParams, {n})" for n in nested}})
    assert [n for n in cxx if n not in ("sizeof", "alignof") and "." not in n] == list(BWD_PARAMS.names)
    for n in BWD_PARAMS.names:
        assert cxx[n] == BWD_PARAMS.fields[n][1], n
    fwd_offset = BWD_PARAMS.fields["fwd"][1]
    for n in nested:
        assert cxx[f"fwd.{n}"] == fwd_offset + FWD_PARAMS.fields[n][1], n
    assert cxx["sizeof"] == BWD_PARAMS.itemsize
    assert cxx["alignof"] == BWD_PARAMS.alignment


def test_bwd_params_hold_pointers_strides_and_the_forward_problem():
    q = np.zeros((2, 4, 5, 8), np.float32)
    k = np.zeros((2, 3, 2, 6, 8), np.float32)[:, :, 0]
    v = np.broadcast_to(np.zeros((1, 1, 6, 3), np.float32), (2, 2, 6, 3))
    out = np.zeros((2, 4, 5, 3), np.float32)
    dout = np.zeros((2, 5, 4, 3), np.float32).transpose(0, 2, 1, 3)
    lse = np.zeros((2, 4, 5), np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros((2, 2, 6, 8), np.float32), np.zeros((2, 2, 6, 3), np.float32)
    delta = np.zeros((2, 4, 5), np.float32)
    p = bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, scale=0.5, window_left=None,
                   window_right=0, gqa_ratio=2)
    assert p["fwd"]["q"] == q.ctypes.data and p["fwd"]["lse"] == lse.ctypes.data
    assert p["fwd"]["ws_o"] == 0 and p["fwd"]["block_m"] == 0
    assert (p["fwd"]["window_left"], p["fwd"]["window_right"]) == (UNBOUNDED, 0)
    assert p["fwd"]["gqa_ratio"] == 2 and p["fwd"]["scale"] == 0.5
    assert p["dout"] == dout.ctypes.data and p["delta"] == delta.ctypes.data
    assert (p["dout_batch_stride"], p["dout_head_stride"], p["dout_row_stride"]) == (60, 3, 12)
    assert (p["dk_batch_stride"], p["dk_head_stride"], p["dk_row_stride"]) == (96, 48, 8)
    assert (p["fwd"]["v_batch_stride"], p["fwd"]["v_head_stride"]) == (0, 0)
    assert (p["delta_batch_stride"], p["delta_head_stride"], p["delta_row_stride"]) == (20, 5, 1)
    assert (p["dbias"] == 0).all() and (p["dbias_strides"] == 0).all()
    # bias gradients: per term a view of the accumulator (stride 0 along its broadcast axes) or None
    grad = np.broadcast_to(np.zeros((4, 1, 6), np.float32), (2, 4, 5, 6))
    p = bwd_params(dout, q, k, v, out, lse, dq, dk, dv, delta, scale=0.5, window_left=None,
                   window_right=0, gqa_ratio=2, dbias=(None, grad))
    assert list(p["dbias"]) == [0, grad.ctypes.data, 0, 0]
    assert p["dbias_strides"].tolist() == [[0] * 4, [0, 6, 0, 1], [0] * 4, [0] * 4]


def test_catalogue_has_delta_dkdv_and_dq_kernels_for_every_dtype_and_bucket():
    rows = BWD_SIMT.rows
    kernels = {"bwd_simt_dot_do_o_kernel", "bwd_simt_dkdv_kernel", "bwd_simt_dq_kernel"}
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for bucket in HEAD_DIM_BUCKETS:
            found = {r.kernel for r in rows if (r.dtype, r.head_dim) == (dtype, bucket)}
            assert found == kernels, (dtype, bucket)
    for r in rows:
        assert r.entry == "bwd_simt.cu" and r.threads == 128, r
        shared = BWD_SIMT.representative_shared_bytes(r)
        if r.kernel == "bwd_simt_dot_do_o_kernel":
            assert shared == 0
            continue
        own = r.block_n if r.kernel == "bwd_simt_dkdv_kernel" else r.block_m
        streamed = r.block_m if r.kernel == "bwd_simt_dkdv_kernel" else r.block_n
        assert own % 16 == 0 and streamed % 8 == 0, r
        # 72 KB (float32/float64 prefetch into a second streamed buffer) except
        # float64 at 256 (one buffer); all within sm_86/sm_89's 99 KB
        assert shared <= (99 if (r.dtype, r.head_dim) == ("float64", 256) else 72) * 1024, r


def test_backward_launch_config_grids_and_shared_memory():
    delta, dkdv, dq = _select(np.float32, 64, 64, 80)
    sizes = dict(batch=3, heads_q=8, heads_kv=2, seqlen_q=130, seqlen_k=70)
    grid, block, shared = _launch_config(delta, **sizes)
    assert grid == (3 * 8 * math.ceil(130 / 16), 1, 1) and block == (128, 1, 1) and shared == 0
    grid, _, shared = _launch_config(dkdv, **sizes)
    assert grid == (3 * 2 * math.ceil(70 / dkdv.block_n), 1, 1)
    # own rows, the P / dS scratch (own rows of streamed + 8), then two buffers of
    # streamed rows (float32: cp.async prefetch)
    own, streamed = dkdv.block_n, dkdv.block_m
    assert shared == ((own + 2 * streamed) * (64 + 64) + own * (streamed + 8)) * 4
    grid, _, shared = _launch_config(dq, **sizes)
    assert grid == (3 * 8 * math.ceil(130 / dq.block_m), 1, 1)
    own, streamed = dq.block_m, dq.block_n
    assert shared == ((own + 2 * streamed) * (64 + 64) + own * (streamed + 8)) * 4
    _, dkdv16, _ = _select(np.float16, 64, 64, 80)   # converting loads: one buffer
    own, streamed = dkdv16.block_n, dkdv16.block_m
    assert _launch_config(dkdv16, **sizes)[2] == ((own + streamed) * (64 + 64) + own * (streamed + 8)) * 4
    with pytest.raises(ValueError, match="CTAs"):
        _launch_config(dq, batch=2**16, heads_q=2**10, heads_kv=1, seqlen_q=2**12, seqlen_k=1)
    with pytest.raises(ValueError, match="nothing to launch"):
        _launch_config(dkdv, batch=1, heads_q=1, heads_kv=1, seqlen_q=5, seqlen_k=0)


@needs_emulator
@pytest.mark.parametrize("dtype", HALF, ids=[np.dtype(d).name for d in HALF])
def test_half_precision_through_the_api_within_twice_the_naive_half_error(dtype):
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, dtype, heads_kv=2, gqa_ratio=2, seqlen_q=40, seqlen_k=33, head_dim=24,
                  head_dim_v=40)
    case = Case(rng, q, k, v, window=(None, 0), gqa_ratio=2)
    grads = cupyflash.attention_backward(case.dout, q, k, v, case.out, case.lse, causal=True,
                                         enable_gqa=True, backend="emulator")
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    case.check(grads)


# ---- masks ------------------------------------------------------------------------------------------


@needs_emulator
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_with_no_key_get_zero_dq_and_unseen_keys_zero_dk_dv(executor, dtype):
    # Causal with Lq > Lk: rows i < Lq - Lk see no key (lse = -inf), a whole
    # query block of them too.  Window (2, 0) with Lq < Lk: keys 0 .. 40 are
    # seen by no row, whole key blocks of them.
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, dtype, seqlen_q=150, seqlen_k=20, head_dim=8)
    case = Case(rng, q, k, v, window=(None, 0))
    assert np.isneginf(case.lse[:, :, :130]).all()
    dq, dk, dv = case.run(executor)
    case.check((dq, dk, dv))
    assert (dq[:, :, :130] == 0).all()

    q, k, v = qkv(rng, dtype, seqlen_q=30, seqlen_k=73, head_dim=8)
    case = Case(rng, q, k, v, window=(2, 0))
    dq, dk, dv = case.run(executor)
    case.check((dq, dk, dv))
    assert (dk[:, :, :41] == 0).all() and (dv[:, :, :41] == 0).all()


@needs_emulator
def test_fully_masked_blocks_are_skipped(executor):
    # The query row sees keys 189..199 only.  Keys 0..127 fill key blocks no
    # row sees and query rows 0..63 of the second case query blocks that see
    # no key: were they read, their NaN would reach the gradients (0 * NaN).
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, np.float32, seqlen_q=1, seqlen_k=200, head_dim=16)
    case = Case(rng, q, k[:, :, 128:], v[:, :, 128:], window=(10, 0), scale=0.25)
    expected = case.expected()
    k[:, :, :128] = np.nan
    v[:, :, :128] = np.nan
    case.k, case.v = k, v
    dq, dk, dv = case.run(executor)
    assert_grad_close(dq, expected[0], np.float32, what="dq")
    assert_grad_close(dk[:, :, 128:], expected[1], np.float32, what="dk")
    assert_grad_close(dv[:, :, 128:], expected[2], np.float32, what="dv")
    assert (dk[:, :, :128] == 0).all() and (dv[:, :, :128] == 0).all()

    # Lq > Lk, causal: rows 0..79 see nothing; NaN there must not reach dk, dv.
    q, k, v = qkv(rng, np.float32, seqlen_q=100, seqlen_k=20, head_dim=16)
    case = Case(rng, q, k, v, window=(None, 0))
    expected = case.expected()
    for x in (case.q, case.dout, case.out):
        x[:, :, :64] = np.nan
    dq, dk, dv = case.run(executor)
    assert_grad_close(dk, expected[1], np.float32, what="dk")
    assert_grad_close(dv, expected[2], np.float32, what="dv")
    assert_grad_close(dq[:, :, 80:], expected[0][:, :, 80:], np.float32, what="dq")
    assert (dq[:, :, :80] == 0).all()


# ---- GQA, MQA, strides ------------------------------------------------------------------------------


@needs_emulator
@pytest.mark.parametrize("gqa_ratio, heads_kv", [(2, 2), (4, 1)], ids=["gqa2", "mqa4"])
def test_gqa_dk_dv_sum_over_the_group(executor, gqa_ratio, heads_kv):
    rng = np.random.default_rng(10 + gqa_ratio)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=heads_kv, gqa_ratio=gqa_ratio, seqlen_q=33,
                  seqlen_k=41, head_dim=12, head_dim_v=20)
    case = Case(rng, q, k, v, gqa_ratio=gqa_ratio, window=(None, 3))
    case.check(case.run(executor))


@needs_emulator
def test_broadcast_kv_and_batch_with_zero_strides(executor):
    # A stride-0 head or batch axis is just another slot: each (batch, head)
    # slot of dk and dv gets that head's own gradient; the dispatcher sums them.
    rng = np.random.default_rng(11)
    q = np.broadcast_to(random_array(rng, (1, 3, 29, 10), np.float32), (2, 3, 29, 10))
    k = np.broadcast_to(random_array(rng, (2, 1, 35, 10), np.float32), (2, 3, 35, 10))
    v = np.broadcast_to(random_array(rng, (1, 1, 35, 6), np.float32), (2, 3, 35, 6))
    assert q.strides[0] == 0 and k.strides[1] == 0 and v.strides[0] == v.strides[1] == 0
    case = Case(rng, q, k, v, window=(7, 2))
    case.check(case.run(executor))


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_mqa_by_broadcasting_through_the_api(dtype):
    rng = np.random.default_rng(12)
    q = random_array(rng, (2, 4, 21, 8), dtype)
    k = random_array(rng, (2, 1, 26, 8), dtype)        # one kv head for four query heads
    v = random_array(rng, (1, 1, 26, 5), dtype)        # ... and one batch for two
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = random_array(rng, out.shape, dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="emulator")
    expected = naive_attention_backward(dout, q, k, v, causal=True)
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_grad_close(g, e, dtype, what=name)


@needs_emulator
def test_transposed_reversed_and_strided_views_in_and_out(executor):
    rng = np.random.default_rng(13)
    b, h, lq, lk, d, dv = 2, 3, 40, 70, 24, 40
    # (B, L, H, d) storage seen as (B, H, L, d); every other key row; reversed value rows.
    q = random_array(rng, (b, lq, h, d), np.float64).transpose(0, 2, 1, 3)
    k = random_array(rng, (b, h, 2 * lk, d), np.float64)[:, :, ::2]
    v = random_array(rng, (b, h, lk, dv), np.float64)[:, :, ::-1]
    dout = random_array(rng, (b, lq, h, dv), np.float64).transpose(0, 2, 1, 3)
    case = Case(rng, q, k, v, window=(20, 5), dout=dout)
    out = np.empty((b, lq, h, dv), np.float64).transpose(0, 2, 1, 3)
    out[...] = case.out
    lse = np.empty((b, lq, h), np.float64).transpose(0, 2, 1)
    lse[...] = case.lse
    grads = (poisoned((b, lq, h, d), np.float64).transpose(0, 2, 1, 3),
             poisoned((lk, b, h, d), np.float64).transpose(1, 2, 0, 3),
             poisoned((b, h, 2 * lk, dv), np.float64)[:, :, 1::2])
    case.check(case.run(executor, grads, out=out, lse=lse))


def _misaligned(a):
    """A writable copy of ``a`` whose elements start one byte past their alignment (what
    numpy.frombuffer at an odd offset, or a field of a packed structured array, gives)."""
    raw = np.zeros(a.nbytes + 1, np.uint8)
    m = np.frombuffer(raw.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned
    return m


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_misaligned_numpy_arrays_give_the_results_of_aligned_ones(dtype):
    # A GPU faults on a misaligned element (and the emulator says so): the kernels get
    # aligned copies, ``out`` is filled in place, and nothing changes bit for bit.
    rng = np.random.default_rng(31)
    q, k, v = (random_array(rng, (2, 3, 40, 16), dtype) for _ in range(3))
    dout = random_array(rng, (2, 3, 40, 16), dtype)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, backend="emulator")
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="emulator")
    m_out = _misaligned(np.full_like(out, np.nan))
    got, got_lse = cupyflash.attention(_misaligned(q), _misaligned(k), _misaligned(v), causal=True,
                                       return_lse=True, out=m_out, backend="emulator")
    assert got is m_out
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)
    got_grads = cupyflash.attention_backward(*map(_misaligned, (dout, q, k, v, out, lse)), causal=True,
                                             backend="emulator")
    for g, e in zip(got_grads, grads):
        np.testing.assert_array_equal(g, e)


# ---- determinism, sizes, scales ---------------------------------------------------------------------


@needs_emulator
def test_bit_identical_across_runs_with_different_thread_and_block_orders():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=2, gqa_ratio=3, seqlen_q=70, seqlen_k=90,
                  head_dim=20)
    case = Case(rng, q, k, v, gqa_ratio=3, window=(50, 0))
    runs = [case.run(EmulatorExecutor(arch=80, seed=seed, shuffle=True, race_check=False))
            for seed in (1, 2)]
    case.check(runs[0])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(executor, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  head_dim=7, head_dim_v=3)
    case = Case(rng, q, k, v)
    dq, dk, dv = case.run(executor)
    case.check((dq, dk, dv))
    if seqlen_k == 0:
        assert (dq == 0).all()
    if seqlen_q == 0:
        assert (dk == 0).all() and (dv == 0).all()


@needs_emulator
@pytest.mark.parametrize("scale", [12.0, -0.7, 0.0], ids=["large", "negative", "zero"])
def test_extreme_and_negative_scales(executor, scale):
    # Large logits: P is recomputed from lse against scores of size ~100, so every
    # term carries the scores' rounding: the term bound widened by logit_rounding.
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float32, seqlen_q=45, seqlen_k=77, head_dim=9)
    case = Case(rng, q, k, v, scale=scale, window=(None, 0))
    dq, dk, dv = case.run(executor)
    expected = case.expected()
    kw = dict(scale=scale, window=(None, 0))
    sizes = backward_term_sizes(case.dout, q, k, v, **kw)
    flushed = backward_term_sizes(case.dout, q, k, v, unit_probabilities=True, **kw)
    for name, g, e, size, unit in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, sizes, flushed):
        assert_within_term_bound(g, e, size, eps=np.finfo(np.float32).eps, head_dim=9,
                                 logits=logit_rounding(q, k, scale), floor=np.finfo(np.float32).tiny * unit,
                                 what=name)
        if scale == 0.0 and name != "dv":
            assert (g == 0).all(), name


# ---- deterministic=False on the CUDA cores: dQ by atomics in the dK/dV kernel --------------------

# (float64 has atomic tiles up to bucket 64, the others up to 128)
SIMT_ATOMIC_CASES = [(dtype, d, dv) for dtype in DTYPES
                     for d, dv in ((24, 24), (64, 40), (50, 64) if np.dtype(dtype).itemsize == 8 else (100, 128))]


@needs_emulator
@pytest.mark.parametrize("dtype, head_dim, head_dim_v", SIMT_ATOMIC_CASES,
                         ids=[f"{np.dtype(c[0]).name}-d{c[1]}-dv{c[2]}" for c in SIMT_ATOMIC_CASES])
def test_simt_atomic_dq_matches_oracle_and_leaves_dk_dv_alone(executor, dtype, head_dim, head_dim_v):
    # GQA, causal, partial blocks, d != dv; rows beyond Lq and columns beyond d
    # must not receive atomics (dq is poisoned, then zeroed by the call).
    rng = np.random.default_rng(head_dim * 7 + head_dim_v)
    q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=2, seqlen_q=45, seqlen_k=70, head_dim=head_dim,
                  head_dim_v=head_dim_v)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0))
    rows = _select(dtype, head_dim, head_dim_v, 80, deterministic=False)   # alignment unknown: bwd_simt
    assert rows[-1].name_expression.endswith(", true>") and rows[-1].atomic_dq
    dq, dk, dv = case.run(executor, deterministic=False)
    case.check((dq, dk, dv))
    _, dk_det, dv_det = case.run(executor)
    assert np.array_equal(dk, dk_det) and np.array_equal(dv, dv_det)


# ---- bwd_mma: tensor cores -------------------------------------------------------------------------

MMA_ROWS = plain_call_rows(BWD_MMA)   # the feature tiles' rows: tests/test_score_mods.py


def _families(case: Case, arch=80):
    return {r.family.name for r in case.plan(arch)}


def test_mma_catalogue_covers_every_fwd_mma_head_dim_for_both_dtypes():
    by_name = {r.name_expression: r for r in MMA_ROWS}
    used = set()
    for arch, limit_kb in ((80, 81), (86, 49), (89, 49), (90, 113)):
        for dtype, d, deterministic in itertools.product(("float16", "bfloat16"), MMA_HEAD_DIMS,
                                                         (True, False)):
                rows = list(_select(dtype, d, d, arch, aligned=True, deterministic=deterministic)[1:])
                used.update(r.name_expression for r in rows)
                assert all(by_name[r.name_expression] == r for r in rows)
                kernels = [r.kernel for r in rows]
                # dK and dV in one launch up to 128, dV then dK from 160 on; then dQ,
                # or (not deterministic) dQ by atomics in the launch that computes dK
                expected = ["bwd_mma_dkdv_kernel"] * (1 if d <= 128 else 2)
                atomic = 0 if deterministic or d == 256 else 4   # d = 256: no room for the dS tile
                assert kernels == expected + (["bwd_mma_dq_kernel"] if not atomic else []), (dtype, d)
                grads = [r.grads for r in rows if r.role == "dkdv"]
                assert grads == ([3 | atomic] if d <= 128 else [1, 2 | atomic]), (dtype, d, deterministic)
                for r in rows:
                    assert r.threads == 128 and r.head_dim_v == d and r.kv_stages in (1, 2)
                    shared = BWD_MMA.representative_shared_bytes(r)
                    # two stages only where two CTAs still fit on an SM of the class; every
                    # row within sm_86/89's 99 KB (the static report launches each everywhere)
                    assert shared <= (limit_kb if r.kv_stages == 2 else 99) * 1024, (arch, r)
                # the whole-stream rows, for Lq and Lk multiples of every streamed block
                whole = _select(dtype, d, d, arch, aligned=True, deterministic=deterministic,
                                seqlen_q=4096, seqlen_k=4096)[1:]
                assert all(r.whole_kv and by_name[r.name_expression] == r for r in whole)
                assert [r.name_expression for r in whole] == [r.name_expression[:-1] + ", true>" for r in rows]
                used.update(r.name_expression for r in whole)
    assert used == set(by_name)   # no row that no architecture launches


def _whole_stream_cases():
    """(arch, head dim, deterministic) launches that run every whole-stream bwd_mma row
    (kWholeStream: streamed copies without bounds) of float16 at least once, for Lq = 128
    and Lk = 192 (multiples of every streamed block); bfloat16's rows differ only in the
    mma, which tests/test_families.py runs."""
    whole = {r.name_expression for r in MMA_ROWS if r.whole_kv and r.dtype == "float16"}
    cases, covered = [], set()
    for d, arch, deterministic in itertools.product(MMA_HEAD_DIMS, (80, 86, 90), (True, False)):
        rows = {r.name_expression for r in _select(np.float16, d, d, arch, aligned=True, deterministic=deterministic,
                                                   seqlen_q=128, seqlen_k=192)[1:]}
        if (rows - covered) & whole:
            cases.append((arch, d, deterministic))
            covered |= rows
    assert covered >= whole
    return cases


WHOLE_STREAM_CASES = _whole_stream_cases()


@needs_emulator
@pytest.mark.parametrize("arch, head_dim, deterministic", WHOLE_STREAM_CASES,
                         ids=[f"sm{a}-d{d}{'' if det else '-atomic'}" for a, d, det in WHOLE_STREAM_CASES])
def test_mma_whole_stream_rows_match_oracle(arch, head_dim, deterministic):
    rng = np.random.default_rng(arch * 1000 + head_dim * 2 + deterministic)
    q, k, v = qkv(rng, np.float16, heads_kv=1, gqa_ratio=2, seqlen_q=128, seqlen_k=192, head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if head_dim % 64 else (None, None))
    rows = case.plan(arch, deterministic)
    assert all(r.whole_kv for r in rows[1:])
    ex = EmulatorExecutor(arch=arch, seed=head_dim, shuffle=True, race_check=True)
    case.check(case.run(ex, deterministic=deterministic))


# deterministic=False: dQ by float atomics inside the dK/dV kernel, no dQ kernel.
ATOMIC_CASES = [(80, d) for d in MMA_HEAD_DIMS if d < 256] + [(86, 128), (90, 224)]


@needs_emulator
@pytest.mark.parametrize("arch, head_dim", ATOMIC_CASES, ids=[f"sm{a}-d{d}" for a, d in ATOMIC_CASES])
def test_mma_atomic_dq_matches_oracle_and_leaves_dk_dv_alone(arch, head_dim):
    rng = np.random.default_rng(7 * head_dim + arch)
    dtype = HALF[(head_dim // 32) % len(HALF)]   # alternate float16 / bfloat16
    run_d = {32: 24, 64: 64, 96: 88, 128: 128, 160: 152, 192: 192, 224: 200, 256: 256}[head_dim]
    q, k, v = qkv(rng, dtype, heads_kv=1, gqa_ratio=2, seqlen_q=70, seqlen_k=83, head_dim=run_d)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0) if head_dim % 64 else (None, None))
    ex = EmulatorExecutor(arch=arch, seed=head_dim, shuffle=True, race_check=True)
    rows = case.plan(arch, deterministic=False)
    assert [r.kernel for r in rows][-1] == "bwd_mma_dkdv_kernel"
    dq, dk, dv = case.run(ex, deterministic=False)
    case.check((dq, dk, dv))   # dq was poisoned: zeroed, then every element added to
    _, dk_det, dv_det = case.run(ex)
    # dK and dV come from the same arithmetic in the same order either way
    assert np.array_equal(dk, dk_det) and np.array_equal(dv, dv_det)


# The rows sm_80 does not launch: sm_86's single-stage tiles, sm_90's two-stage ones.
OTHER_ARCH_CASES = [(86, 128), (86, 64), (90, 224), (90, 256)]


@needs_emulator
@pytest.mark.parametrize("arch, head_dim", OTHER_ARCH_CASES, ids=[f"sm{a}-d{d}" for a, d in OTHER_ARCH_CASES])
def test_mma_other_architectures_stages_match_oracle(arch, head_dim):
    rng = np.random.default_rng(arch + head_dim)
    q, k, v = qkv(rng, np.float16, heads_kv=1, gqa_ratio=2, seqlen_q=70, seqlen_k=83, head_dim=head_dim)
    case = Case(rng, q, k, v, gqa_ratio=2, window=(None, 0))
    assert _families(case, arch) == {"bwd_simt", "bwd_mma"}
    stages = [r.kv_stages for r in case.plan(arch)[1:]]
    assert stages == {(86, 128): [1, 1], (86, 64): [2, 2], (90, 224): [2, 1, 1], (90, 256): [2, 1, 1]}[
        (arch, head_dim)]
    case.check(case.run(EmulatorExecutor(arch=arch, seed=arch, shuffle=True, race_check=True)))


@needs_emulator
def test_mma_strided_broadcast_views_and_bit_identical_runs():
    # (B, L, H, d) storage seen as (B, H, L, d); k broadcast over heads (stride 0);
    # v every other row; gradients written through transposed views.
    rng = np.random.default_rng(17)
    b, h, lq, lk, d = 2, 3, 45, 70, 64
    dtype = np.dtype(HALF[-1])
    q = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    k = np.broadcast_to(random_array(rng, (b, 1, lk, d), dtype), (b, h, lk, d))
    v = random_array(rng, (b, h, 2 * lk, d), dtype)[:, :, ::2]
    dout = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    case = Case(rng, q, k, v, window=(30, 4), dout=dout)
    assert _families(case) == {"bwd_simt", "bwd_mma"}
    acc = accum_dtype(dtype)
    runs = []
    for seed in (3, 4):
        grads = (poisoned((b, lq, h, d), acc).transpose(0, 2, 1, 3), poisoned((b, h, lk, d), acc),
                 poisoned((lk, b, h, d), acc).transpose(1, 2, 0, 3))
        runs.append(case.run(EmulatorExecutor(arch=80, seed=seed, shuffle=True, race_check=True), grads))
    case.check(runs[0])
    for a, c in zip(*runs):
        assert np.array_equal(a, c)


@needs_emulator
def test_mma_keys_no_row_sees_and_rows_that_see_no_key(executor):
    # Window (2, 0), Lq < Lk: keys 0 .. 40 are seen by no row (whole key blocks);
    # causal, Lq > Lk: rows 0 .. 99 see no key (whole query blocks).
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, np.float16, seqlen_q=30, seqlen_k=73, head_dim=16)
    case = Case(rng, q, k, v, window=(2, 0))
    assert _families(case) == {"bwd_simt", "bwd_mma"}
    dq, dk, dv = case.run(executor)
    case.check((dq, dk, dv))
    assert (dk[:, :, :41] == 0).all() and (dv[:, :, :41] == 0).all()
    q, k, v = qkv(rng, np.float16, seqlen_q=150, seqlen_k=50, head_dim=16)
    case = Case(rng, q, k, v, window=(None, 0))
    dq, dk, dv = case.run(executor)
    case.check((dq, dk, dv))
    assert (dq[:, :, :100] == 0).all()


# ---- the public API ---------------------------------------------------------------------------------

# name: (q shape, k shape, v shape, options): the layouts the dispatcher must map onto the kernels.
API_CASES = {
    "two_dim": ((7, 5), (11, 5), (11, 3), {}),
    "gqa_broadcast_kv": ((3, 4, 9, 8), (1, 2, 11, 8), (3, 1, 11, 5), dict(enable_gqa=True)),
    "batch_broadcast": ((3, 1, 9, 4), (1, 2, 11, 4), (11, 3), {}),
    "q_broadcast_window": ((9, 4), (3, 11, 4), (3, 11, 3), dict(window=(4, 4))),
    "five_dims_causal": ((2, 2, 3, 10, 6), (2, 1, 3, 7, 6), (2, 2, 1, 7, 6), dict(causal=True)),
}


@needs_emulator
@pytest.mark.parametrize("case", list(API_CASES), ids=list(API_CASES))
def test_attention_backward_on_the_emulator_matches_oracle(case):
    q_shape, k_shape, v_shape, kw = API_CASES[case]
    rng = np.random.default_rng(len(case))
    q, k, v = (random_array(rng, s, np.float32) for s in (q_shape, k_shape, v_shape))
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    dout = random_array(rng, out.shape, np.float32)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    cpu = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="numpy", **kw)
    expected = naive_attention_backward(dout, q, k, v, **kw)
    for name, g, c, e, x in zip(("dq", "dk", "dv"), grads, cpu, expected, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_grad_close(g, e, np.float32, what=name)
        assert_grad_close(g, c, np.float32, what=f"{name} vs the CPU path")


@needs_emulator
def test_attention_backward_deterministic_keyword():
    rng = np.random.default_rng(16)
    q, k, v = (random_array(rng, (2, 17, 8), np.float64) for _ in range(3))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dout = random_array(rng, out.shape, np.float64)
    a = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator")
    b = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", deterministic=False)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-13)
    with pytest.raises(TypeError, match="deterministic"):
        cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", deterministic=1)
    # lse in float32 for float64 inputs is accepted (converted to the accumulator type)
    c = cupyflash.attention_backward(dout, q, k, v, out, lse.astype(np.float32), backend="emulator")
    for x, y in zip(a, c):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
