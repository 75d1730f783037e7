"""fwd_tf32, the float32 forward on the TF32 tensor cores (cuda_src/fwd_tf32.cu), without a GPU:
what is particular to it.  Its dispatch (only where the caller allows TF32 --
``attention(..., precision="tf32")``, one TF32 product per product, or ``"tf32x3"``, three
on operands split into two TF32 parts -- for float32 with d = dv up to 128 and scale > 0
on sm_80 and newer), launch geometry, static report and every instantiation on the
emulator are tests/test_families.py's.

Here: precision is checked before any work and the CPU path stays IEEE; the shared
layouts are chunk permutations whose fragment loads hit distinct banks; on the CPU
emulator (shuffled threads, race check) through :func:`cupyflash._run.forward`, against
the float64 oracle, the error model -- "tf32x3" within float32's own tolerance, "tf32"
no further than twice the naive TF32 attention of the same inputs -- on padded head dims
(d = 3 .. 100), rows that are not 16-byte aligned, GQA, transposed strides and split-KV;
the public call routes precision.  The instruction itself is checked against the fragment
table in tests/test_emulator.py (fid_mma_tf32).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _run
from cupyflash._families import FWD_TF32
from cupyflash._families.fwd_tf32 import TF32_HEAD_DIMS, TF32_PASSES
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention

from _kernel_util import needs_emulator
from _util import (TOLERANCE, forward_against_oracle, naive_tf32_attention, poisoned, random_array,
                   tf32x3_forward_bound)

PRECISIONS = tuple(TF32_PASSES)


def bucket(d):
    return min(b for b in TF32_HEAD_DIMS if b >= d)


def test_rows_are_float32_with_one_or_three_passes():
    assert all(r.dtype == "float32" and r.passes in (1, 3) for r in FWD_TF32.rows)
    assert {TF32_PASSES[p] for p in PRECISIONS} == {r.passes for r in FWD_TF32.rows} == {1, 3}


def test_precision_is_checked_before_any_work():
    rng = np.random.default_rng(0)
    q, k, v = (random_array(rng, (1, 2, 8, 16), np.float32) for _ in range(3))
    for bad in ("TF32", "fp16", "", None, 3, "highest"):
        with pytest.raises(ValueError, match="`precision` must be one of 'ieee', 'tf32', 'tf32x3'"):
            cupyflash.attention(q, k, v, precision=bad)
    for dtype in (np.float64, np.float16):
        with pytest.raises(ValueError, match=r"`precision`='tf32x3' applies to float32 inputs only; got float"):
            cupyflash.attention(*(x.astype(dtype) for x in (q, k, v)), precision="tf32x3")
    assert cupyflash.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                               precision="ieee").dtype == np.float64


def test_numpy_path_stays_ieee_whatever_precision_allows():
    # precision allows TF32; the CPU path has no tensor cores and computes exactly as with "ieee"
    rng = np.random.default_rng(1)
    q, k, v = (random_array(rng, (2, 3, 20, 24), np.float32) for _ in range(3))
    ieee, ieee_lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    for precision in PRECISIONS:
        out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True, precision=precision)
        np.testing.assert_array_equal(out, ieee)
        np.testing.assert_array_equal(lse, ieee_lse)


# ---- the shared layouts: whole chunks, and the fragment loads free of bank conflicts -----------

LAYOUT_PROBE = r"""
#include "tf32_tile.cuh"
struct ProbeParams { int* rows; int* both; int* pairs8; int* pairs1; int* raw8; int* raw1; };
// Offsets of every element of a kRows x kCols tile in each layout, and where the
// 16-byte chunk of a paired layout's row r, columns c .. c + 3 lands raw.
template <int kRows, int kCols>
__global__ void tf32_layout_probe(const ProbeParams p) {
    if (threadIdx.x != 0) return;
    for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < kCols; ++c) {
            const int i = r * kCols + c;
            p.rows[i] = cf::Tf32Rows<kCols>::offset(r, c);
            p.both[i] = cf::Tf32BothRows<kCols>::offset(r, c);
            p.pairs8[i] = cf::Tf32Pairs<kCols, 8>::offset(r, c);
            p.pairs1[i] = cf::Tf32Pairs<kCols, 1>::offset(r, c);
            p.raw8[i] = cf::Tf32Pairs<kCols, 8>::raw_chunk(r, c & ~3) + (c & 3);
            p.raw1[i] = cf::Tf32Pairs<kCols, 1>::raw_chunk(r, c & ~3) + (c & 3);
        }
}
"""


@needs_emulator
@pytest.mark.parametrize("cols", TF32_HEAD_DIMS)
def test_layouts_are_chunk_permutations_and_fragment_loads_hit_distinct_banks(executor, tmp_path, cols):
    rows = 64
    probe = tmp_path / "tf32_layout_probe.cu"
    probe.write_text(LAYOUT_PROBE)
    names = ("rows", "both", "pairs8", "pairs1", "raw8", "raw1")
    offsets = {name: np.full((rows, cols), -1, np.int32) for name in names}
    params = np.array(tuple(offsets[n].ctypes.data for n in names),
                      dtype=np.dtype([(n, np.uint64) for n in names], align=True))[()]
    executor.launch(str(probe), f"tf32_layout_probe<{rows}, {cols}>", 1, 32, 0, params)
    for off in offsets.values():   # every layout: a permutation of the tile
        np.testing.assert_array_equal(np.sort(off.ravel()), np.arange(rows * cols))
    for name in ("rows", "both", "raw8", "raw1"):
        # rows, and the raw chunks of the paired layouts: each 16-byte chunk whole
        off = offsets[name]
        assert (off[:, ::4] % 4 == 0).all() and all((off[:, i::4] == off[:, ::4] + i).all() for i in (1, 2, 3))
    for name in ("rows", "both"):
        assert (offsets[name] // cols == np.arange(rows)[:, None]).all()
    for stride, name in ((8, "pairs8"), (1, "pairs1")):
        # fragment quads: (r, c), (r + stride, c), (r, c + 1), (r + stride, c + 1) for even c,
        # in the two 16-byte slots where rows r and r + stride land raw
        off, raw = offsets[name], offsets["raw" + name[5:]]
        first = np.array([r for r in range(rows) if (r // stride) % 2 == 0])
        quad = off[first][:, ::2]
        assert (quad % 4 == 0).all()
        np.testing.assert_array_equal(off[first + stride][:, ::2], quad + 1)
        np.testing.assert_array_equal(off[first][:, 1::2], quad + 2)
        np.testing.assert_array_equal(off[first + stride][:, 1::2], quad + 3)
        slots = lambda o, r: {int(x) // 4 for x in o[r]}  # noqa: E731
        for r in first:
            assert slots(off, r) | slots(off, r + stride) == slots(raw, r) | slots(raw, r + stride)

    def conflict_free(off, addresses):
        # one 16-byte load per lane: each quarter-warp's 8 chunks in 8 different bank groups
        assert all(off[r, c] % 4 == 0 for r, c in addresses)
        groups = [(off[r, c] // 4) % 8 for r, c in addresses]
        return all(len(set(groups[8 * i:8 * i + 8])) == 8 for i in range(4))

    lanes = [(lane // 4, lane % 4) for lane in range(32)]   # (g, t)
    for name in ("rows", "both"):                # row reads (X Y^T): row g (+ 8 m), column 16 j + 4 t
        for j in range(cols // 16):
            for r0 in range(0, rows, 8):
                assert conflict_free(offsets[name], [(r0 + g, 16 * j + 4 * t) for g, t in lanes]), name
    for j in range(cols // 16):                  # A fragments of tf32_abt: row g of an m16 tile, column 16 j + 4 t + 2 h
        for r0 in range(0, rows, 16):
            for h in (0, 1):
                assert conflict_free(offsets["pairs8"], [(r0 + g, 16 * j + 4 * t + 2 * h) for g, t in lanes])
    for kk in range(rows // 8):                  # column reads (P Z): row 8 kk + 2 t (+ 1), column 32 J + 4 g
        for jg in range(cols // 32):
            for e in (0, 1):
                assert conflict_free(offsets["both"], [(8 * kk + 2 * t + e, 32 * jg + 4 * g) for g, t in lanes])
                # the paired layout: both rows in one load, columns 32 J + 4 g + 2 h
                assert conflict_free(offsets["pairs1"], [(8 * kk + 2 * t, 32 * jg + 4 * g + 2 * e) for g, t in lanes])


# ---- emulated ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=32, shuffle=True, race_check=True)


def run_tf32(executor, *, head_dim, seqlen_q, seqlen_k, precision="tf32x3", window=(None, None),
             gqa_ratio=1, batch=1, heads_kv=1, splits=1, q=None, k=None, v=None, out=None, with_lse=True,
             seed=0):
    """One forward through _run.forward with TF32 allowed and ``splits`` forced, checked against
    the oracle (forward_against_oracle's rule for ``precision``); returns the names launched
    and the output."""
    rng = np.random.default_rng(seed)
    heads = heads_kv * gqa_ratio
    q = random_array(rng, (batch, heads, seqlen_q, head_dim), np.float32) if q is None else q
    k = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float32) if k is None else k
    v = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), np.float32) if v is None else v
    spy, out = forward_against_oracle(executor, q, k, v, window=window, gqa_ratio=gqa_ratio, out=out,
                                      with_lse=with_lse, precision=precision, options=KernelOptions(splits=splits))
    return spy.launched, out


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim", [3, 17, 40, 100], ids=["d3", "d17", "d40", "d100"])
def test_padded_and_unaligned_head_dims(executor, head_dim, precision):
    # d = 3 and 17: rows of 12 and 68 bytes, not 16-byte aligned (4-byte cp.async)
    launched, _ = run_tf32(executor, head_dim=head_dim, seqlen_q=70, seqlen_k=90, batch=2,
                           precision=precision, seed=head_dim)
    assert launched[0].startswith(f"cf::fwd_tf32_kernel<{bucket(head_dim)},")


@needs_emulator
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gqa_strides_without_lse_and_split_kv(executor, precision):
    rng = np.random.default_rng(5)
    # q and out as (B, L, H, d) buffers viewed as (B, H, L, d); 3 splits of the keys
    q = random_array(rng, (2, 90, 4, 64), np.float32).transpose(0, 2, 1, 3)
    out = poisoned((2, 90, 4, 64), np.float32).transpose(0, 2, 1, 3)
    k = random_array(rng, (2, 2, 400, 64), np.float32)
    v = random_array(rng, (2, 2, 400, 64), np.float32)
    launched, _ = run_tf32(executor, head_dim=64, seqlen_q=90, seqlen_k=400, window=(None, 0),
                           gqa_ratio=2, q=q, k=k, v=v, out=out, with_lse=False, splits=3, precision=precision)
    assert launched == [f"cf::fwd_tf32_kernel<64, 64, 64, 4, {TF32_PASSES[precision]}>",
                        "cf::fwd_combine_kernel<float, float>"]


@needs_emulator
def test_split_kv_with_lse_and_rows_that_see_no_key(executor):
    # Lq > Lk under a causal mask: the first rows see no key (zeros, lse = -inf)
    launched, _ = run_tf32(executor, head_dim=32, seqlen_q=200, seqlen_k=130, window=(None, 0),
                           splits=2, precision="tf32")
    assert launched == ["cf::fwd_tf32_kernel<32, 64, 64, 4, 1>", "cf::fwd_combine_kernel<float, float>"]


@needs_emulator
def test_three_passes_recover_float32_accuracy_and_one_does_not(executor):
    # The same inputs through both kernels against the float64 oracle.  tf32x3: within its
    # derived bound (tf32x3_forward_bound: float32's table plus its split products and, where
    # the emulator's mma truncates, the cuts of its instruction chains) for the executor's
    # accumulation model.  tf32: within twice the naive TF32 attention's error, and outside
    # the part of the tf32x3 bound that is not accumulation (the table and the split), at
    # least 10 times somewhere: one pass and three differ in their products, by up to 2^-10
    # against 3 * 2^-22 per product (docs/testing.md, "Error analysis").
    rng = np.random.default_rng(12)
    q, k, v = (random_array(rng, (2, 2, 150, 64), np.float32) for _ in range(3))
    ref = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=1 / 8)
    errors = {}
    for precision in PRECISIONS:
        out = poisoned(q.shape, np.float32)
        _run.forward(q, k, v, out, None, scale=1 / 8, window_left=None, window_right=None, gqa_ratio=1,
                     executor=executor, precision=precision, options=KernelOptions())
        errors[precision] = np.abs(out.astype(np.float64) - ref)
    bound = tf32x3_forward_bound(q, k, v, ref, scale=1 / 8, accumulation=executor.accumulation)
    worst = np.unravel_index(np.argmax(errors["tf32x3"] - bound), bound.shape)
    assert (errors["tf32x3"] <= bound).all(), (
        f"tf32x3 ({executor.accumulation}): error {errors['tf32x3'][worst]:.3g} > bound {bound[worst]:.3g} at {worst}")
    products = tf32x3_forward_bound(q, k, v, ref, scale=1 / 8, accumulation="exact")
    assert (errors["tf32"] / products).max() > 10, (errors["tf32"] / products).max()
    yardstick = naive_tf32_attention(q, k, v, scale=1 / 8)
    assert errors["tf32"].max() <= 2 * np.abs(yardstick.astype(np.float64) - ref).max(), errors["tf32"].max()


@needs_emulator
def test_attention_routes_precision_to_the_kernel(monkeypatch):
    # the public call on backend="emulator": fwd_tf32 for float32 with TF32 allowed
    from cupyflash import _dispatch
    from _util import LaunchSpy

    spy = LaunchSpy(_dispatch.executor_for("emulator"))
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: spy)
    rng = np.random.default_rng(3)
    q, k, v = (random_array(rng, (1, 2, 40, 48), np.float32) for _ in range(3))
    ref = naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    out = cupyflash.attention(q, k, v, causal=True, precision="tf32x3", backend="emulator")
    np.testing.assert_allclose(out, ref, **TOLERANCE[np.dtype(np.float32)])
    cupyflash.attention(q, k, v, causal=True, backend="emulator")
    assert [name.split("<")[0] for name in spy.launched] == ["cf::fwd_tf32_kernel", "cf::fwd_simt_kernel"]
