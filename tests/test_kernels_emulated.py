"""The CUDA forward kernels, fwd_simt and fwd_v1, run on the CPU emulator: what is particular to
them.  fwd_simt's dispatch, every instantiation and its masks are tests/test_families.py's.

Each case calls :func:`cupyflash._run.forward` / :func:`~cupyflash._run.forward_v1`
exactly as the GPU path does, but through
:class:`cupyflash.emulator.EmulatorExecutor` (threads in shuffled order,
shared-memory race and bounds checks on), and compares ``out`` and ``lse``
with the float64 oracle.  Outputs start as NaN, so an element a kernel forgets
to write shows.  Together with tests/test_families.py the cases cover every
instantiation in the catalogue and every branch of the kernels: partial query and key blocks, masked and
unmasked key blocks, skipped key blocks, rows that see no key, GQA,
broadcast and transposed strides.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from cupyflash import _run
from cupyflash._families import FORWARD, FWD_SIMT, FWD_V1, Call, Sizes, select
from cupyflash._families.fwd_simt import HEAD_DIM_BUCKETS
from cupyflash._families.fwd_v1 import v1_block_sizes
from cupyflash._options import KernelOptions
from cupyflash._params import FWD_PARAMS, UNBOUNDED, KernelView, fwd_params
from cupyflash._mods import ScoreFunctions
from cupyflash._terms import ScoreOperands
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention

from _kernel_util import needs_emulator, qkv
from _util import (DTYPE_IDS, DTYPES, accum_dtype, assert_close, assert_lse_close, cxx_struct_layout,
                   logit_rounding, poisoned, random_array)


@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=1234, shuffle=True, race_check=True)


def run_and_check(executor, q, k, v, *, family="fwd_simt", window=(None, None), gqa_ratio=1,
                  scale=None, out=None, lse=None, sram_size=None, with_lse=True, extra=0.0):
    """Run one forward on the emulator, compare with the oracle, return (out, lse)."""
    batch, heads, seqlen_q, head_dim = q.shape
    dtype = q.dtype
    if out is None:
        out = poisoned((batch, heads, seqlen_q, v.shape[3]), dtype)
    if lse is None and with_lse:
        lse = poisoned((batch, heads, seqlen_q), accum_dtype(dtype))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    left, right = window
    common = dict(scale=scale, window_left=left, window_right=right, gqa_ratio=gqa_ratio,
                  executor=executor)
    if family == "fwd_simt":
        _run.forward(q, k, v, out, lse, options=KernelOptions(), **common)
    else:
        _run.forward_v1(q, k, v, out, lse, sram_size=sram_size, **common)
    ref_out, ref_lse = naive_attention(q, k, v, scale=scale, window=window,
                                       enable_gqa=gqa_ratio > 1, return_lse=True)
    assert not np.isnan(out.astype(np.float64)).any(), "output element left unwritten (NaN)"
    assert_close(out, ref_out, dtype, extra=extra)
    if with_lse:
        assert_lse_close(lse, ref_lse, dtype)
    return out, lse


# ---- the params struct, the catalogue and the launch configuration -------------------------------

@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_params_dtype_matches_cxx_struct_layout(tmp_path):
    names = FWD_PARAMS.names
    cxx = cxx_struct_layout(tmp_path, "params.cuh", "cf::FwdParams",
                            {n: f"offsetof(cf::FwdParams, {n})" for n in names})
    assert [n for n in cxx if n not in ("sizeof", "alignof")] == list(names)
    for n in names:
        assert cxx[n] == FWD_PARAMS.fields[n][1], n
    assert cxx["sizeof"] == FWD_PARAMS.itemsize
    assert cxx["alignof"] == FWD_PARAMS.alignment


def test_params_hold_pointers_strides_and_sentinel_windows():
    q = np.zeros((2, 4, 5, 8), np.float32)
    k = np.zeros((2, 3, 2, 6, 8), np.float32)[:, :, 0]          # a strided view
    v = np.broadcast_to(np.zeros((1, 1, 6, 3), np.float32), (2, 2, 6, 3))
    out = np.zeros((2, 5, 4, 3), np.float32).transpose(0, 2, 1, 3)
    p = fwd_params(q, k, v, out, None, scale=0.5, window_left=None, window_right=0, gqa_ratio=2)
    assert p["q"] == q.ctypes.data and p["lse"] == 0 and p["ws_o"] == 0
    assert (p["k_batch_stride"], p["k_head_stride"], p["k_row_stride"]) == (3 * 2 * 6 * 8, 2 * 6 * 8, 8)
    assert (p["v_batch_stride"], p["v_head_stride"], p["v_row_stride"]) == (0, 0, 3)
    assert (p["out_batch_stride"], p["out_head_stride"], p["out_row_stride"]) == (60, 3, 12)
    assert (p["window_left"], p["window_right"]) == (UNBOUNDED, 0)
    assert (p["seqlen_q"], p["seqlen_k"], p["head_dim"], p["head_dim_v"]) == (5, 6, 8, 3)
    assert p["scale_log2"] == pytest.approx(0.5 * math.log2(math.e), rel=1e-15)


def test_params_fields_by_name():
    """fwd_params packs its fields positionally: every field, by name, holds its value."""
    q = np.zeros((2, 3, 5, 8), np.float32)
    k = np.zeros((2, 1, 7, 8), np.float32)
    v = np.zeros((2, 1, 7, 4), np.float32)
    out = np.zeros((2, 3, 5, 4), np.float32)
    lse = np.zeros((2, 3, 5), np.float32)
    ws = (np.zeros((3, 2, 3, 5, 4), np.float32), np.zeros((3, 2, 3, 5), np.float32), None)
    # score terms as (B, Hq, Lq, Lk) views: a key-padding bias, a transposed pair bias, a mask
    pad = np.broadcast_to(np.zeros((2, 1, 1, 7), np.float16), (2, 3, 5, 7))
    pair = np.broadcast_to(np.zeros((3, 7, 5), np.float64).swapaxes(1, 2), (2, 3, 5, 7))
    mask = np.broadcast_to(np.ones((5, 7), bool), (2, 3, 5, 7))
    table = np.zeros((5, 2), np.int32)
    pages = np.zeros((2, 6), np.int32)[:, ::2]     # a block table with 6 entries from one row to the next
    p = fwd_params(q, k, v, out, lse, scale=0.75, window_left=9, window_right=None, gqa_ratio=3,
                   workspace=ws, block_m=16, block_n=32, num_splits=3, terms=ScoreOperands((pad, pair), mask),
                   sequences=table, pages=(pages, 17))
    expected = {"q": q.ctypes.data, "k": k.ctypes.data, "v": v.ctypes.data, "out": out.ctypes.data,
                "lse": lse.ctypes.data, "ws_o": ws[0].ctypes.data, "ws_l": ws[1].ctypes.data, "ws_m": 0,
                "batch": 2, "heads_q": 3, "gqa_ratio": 3, "seqlen_q": 5, "seqlen_k": 7, "head_dim": 8,
                "head_dim_v": 4, "window_left": 9, "window_right": UNBOUNDED, "block_m": 16, "block_n": 32,
                "num_splits": 3, "scale": 0.75, "scale_log2": 0.75 * math.log2(math.e),
                "bias": [pad.ctypes.data, pair.ctypes.data, 0, 0],
                "bias_strides": [[7, 0, 0, 1], [0, 35, 1, 5], [0] * 4, [0] * 4],
                "mask": mask.ctypes.data, "mask_strides": [0, 0, 7, 1],
                # no score modifications in this call: their fields are zero
                "softcap": 0.0, "coord": [0] * 3, "coord_strides": [[0, 0]] * 3, "mod_args": [0] * 4,
                "mod_shape": [[0] * 4] * 4, "mod_strides": [[0] * 4] * 4,
                # per-sequence lengths: the table; the split workspace's rows per (batch, head)
                "sequences": table.ctypes.data, "split_rows": 5, "first_row": 0, "first_key": 0,
                # a paged KV cache: the block table, its row stride and the keys per page
                "block_table": pages.ctypes.data, "table_stride": 6, "page_size": 17}
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        for axis, stride in zip(("batch", "head", "row"), a.strides[:3]):
            expected[f"{name}_{axis}_stride"] = stride // a.itemsize
    assert set(expected) == set(FWD_PARAMS.names)
    for name, value in expected.items():
        assert np.array_equal(p[name], value), name
    # with modifications: the softcap, the (B, Hq) coordinate views and the mod_args arrays
    b_idx = np.broadcast_to(np.arange(2, dtype=np.int64)[:, None], (2, 3))
    h_idx = np.broadcast_to(np.arange(3, dtype=np.int64), (2, 3))
    table = np.zeros((4, 6), np.float32)[:, ::2]
    mods = ScoreFunctions(softcap=7.5, mod_args={"t": table})
    p = fwd_params(q, k, v, out, lse, scale=0.75, window_left=9, window_right=None, gqa_ratio=3,
                   terms=ScoreOperands(mods=mods, coords=(b_idx, h_idx, None), mod_args=(table,)))
    assert p["softcap"] == 7.5
    assert list(p["coord"]) == [b_idx.ctypes.data, h_idx.ctypes.data, 0]
    assert p["coord_strides"].tolist() == [[1, 0], [0, 1], [0, 0]]
    assert list(p["mod_args"]) == [table.ctypes.data, 0, 0, 0]
    assert p["mod_shape"][0].tolist() == [4, 3, 0, 0] and p["mod_strides"][0].tolist() == [6, 2, 0, 0]


def test_params_from_kernel_views_equal_params_from_the_arrays():
    """The dispatcher describes its views with KernelView instead of array objects: the
    params, and the view KernelView.array() makes, must be those of the real view."""
    base = np.arange(2 * 7 * 4 * 8, dtype=np.float32).reshape(2, 7, 4, 8)   # (B, L, H, d)
    view = base.swapaxes(1, 2)                                               # (B, H, L, d)
    views = {name: KernelView(base, view.shape, view.strides) for name in ("q", "k", "v")}
    out = np.zeros((2, 4, 7, 8), np.float32)
    lse = np.zeros((2, 4, 7), np.float32)
    kw = dict(scale=0.25, window_left=3, window_right=None, gqa_ratio=1)
    from_views = fwd_params(views["q"], views["k"], views["v"], KernelView(out, out.shape, out.strides),
                            KernelView(lse, lse.shape, lse.strides), **kw)
    assert from_views.tobytes() == fwd_params(view, view, view, out, lse, **kw).tobytes()
    made = views["q"].array()
    assert made.shape == view.shape and made.strides == view.strides
    assert np.shares_memory(made, base) and (made == view).all()
    assert _run.rows_aligned(views["q"]) == _run.rows_aligned(view)


def test_catalogue_covers_every_dtype_and_bucket_within_99k_shared_memory():
    simt = FWD_SIMT.rows
    assert {(r.dtype, r.head_dim) for r in simt} == {
        (d, b) for d in ("float16", "bfloat16", "float32", "float64") for b in HEAD_DIM_BUCKETS}
    assert {r.dtype for r in FWD_V1.rows} == {"float16", "bfloat16", "float32", "float64"}
    for r in simt:
        assert r.block_m % 16 == 0 and r.block_n % 8 == 0, r
        assert f"{r.head_dim}, {r.head_dim_v}, {r.block_m}, {r.block_n}>" in r.name_expression
        # the opt-in limit of sm_86 / sm_89; up to bucket 64, 64 KB (3 CTAs on an H100)
        assert FWD_SIMT.representative_shared_bytes(r) <= (64 if r.head_dim <= 64 else 99) * 1024, r


def _launch_config(inst, *, batch, heads, seqlen_q, seqlen_k, head_dim=0, head_dim_v=0, sram_size=None):
    return inst.family.launch_config(inst, Sizes(batch, heads, heads, seqlen_q, seqlen_k, head_dim, head_dim_v,
                                                  sram_size=sram_size))


def test_launch_config_grid_and_shared_memory():
    (inst,) = select(FORWARD, Call("float32", 64, 64), 80, KernelOptions())
    grid, block, shared = _launch_config(inst, batch=3, heads=5, seqlen_q=130, seqlen_k=7)
    assert grid == (3 * 5 * math.ceil(130 / inst.block_m), 1, 1)
    assert block == (128, 1, 1)
    # Q, K and V (float32: kAsync), P (block_m rows of block_n + 8)
    assert shared == ((inst.block_m + 2 * inst.block_n) * 64 + inst.block_m * (inst.block_n + 8)) * 4
    with pytest.raises(ValueError, match="CTAs"):
        _launch_config(inst, batch=2**16, heads=2**10, seqlen_q=2**12, seqlen_k=1)
    v1 = [r for r in FWD_V1.rows if r.dtype == "float64"][0]
    assert v1_block_sizes(1000, 16, 100, 100) == (16, 16)     # Bc = ceil(1000/64) = 16, Br = min(16, d)
    assert v1_block_sizes(1000, 8, 100, 100) == (8, 32)
    assert v1_block_sizes(1000, 8, 5, 3) == (5, 3)           # never longer than the sequence
    grid, block, shared = _launch_config(v1, batch=2, heads=3, seqlen_q=100, seqlen_k=100,
                                        head_dim=16, head_dim_v=8, sram_size=1000)
    assert grid == (6, 1, 1)
    assert shared == (16 * 24 + 16 * 24 + 16 * 16 + 6 * 16) * 8
    with pytest.raises(ValueError, match="sram_size"):
        _launch_config(v1, batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=4, head_dim_v=4)


# ---- fwd_simt --------------------------------------------------------------------------------

@needs_emulator
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_simt_rows_with_no_key_are_zero_with_lse_minus_inf(executor, dtype):
    # Lq > Lk, causal: rows i < Lq - Lk see nothing; a whole query block of them, too.
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, dtype, seqlen_q=150, seqlen_k=20, head_dim=8)
    out, lse = run_and_check(executor, q, k, v, window=(None, 0))
    assert (out[:, :, :130] == 0).all()
    assert np.isneginf(lse[:, :, :130]).all() and np.isfinite(lse[:, :, 130:]).all()


@needs_emulator
def test_simt_window_rows_without_key_between_rows_with_keys(executor):
    # Window (0, 0) with Lq > Lk: only rows i >= Lq - Lk have their one key.
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, np.float64, seqlen_q=90, seqlen_k=50, head_dim=5)
    out, lse = run_and_check(executor, q, k, v, window=(0, 0))
    np.testing.assert_array_equal(out[0, 0, 40:], v[0, 0])         # softmax of one key is 1
    assert np.isneginf(lse[0, 0, :40]).all()


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
def test_fully_masked_key_blocks_are_skipped(executor, family):
    # The query row sees keys 189..199 only; keys 0..127 sit in key blocks no row can
    # see in either kernel.  Were they read, their NaN would reach the output (0 * NaN).
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, np.float32, seqlen_q=1, seqlen_k=200, head_dim=16)
    k[:, :, :128] = np.nan
    v[:, :, :128] = np.nan
    out = poisoned((1, 1, 1, 16), np.float32)
    lse = poisoned((1, 1, 1), np.float32)
    _call(family, executor, q, k, v, out, lse, window=(10, 0), sram_size=4 * 16 * 32)
    # Bottom-right alignment: without the first 128 keys, the row sees the same ones.
    ref_out, ref_lse = naive_attention(q, k[:, :, 128:], v[:, :, 128:], scale=0.25, window=(10, 0),
                                       return_lse=True)
    assert_close(out, ref_out, np.float32)
    assert_lse_close(lse, ref_lse, np.float32)


def _call(family, executor, q, k, v, out, lse, *, window, sram_size, scale=0.25, gqa_ratio=1):
    common = dict(scale=scale, window_left=window[0], window_right=window[1], gqa_ratio=gqa_ratio,
                  executor=executor)
    if family == "fwd_simt":
        _run.forward(q, k, v, out, lse, options=KernelOptions(), **common)
    else:
        _run.forward_v1(q, k, v, out, lse, sram_size=sram_size, **common)


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
@pytest.mark.parametrize("gqa_ratio, heads_kv", [(2, 2), (4, 1)], ids=["gqa2", "mqa4"])
def test_gqa_query_heads_share_kv_heads(executor, family, gqa_ratio, heads_kv):
    rng = np.random.default_rng(10 + gqa_ratio)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=heads_kv, gqa_ratio=gqa_ratio, seqlen_q=33,
                  seqlen_k=41, head_dim=12, head_dim_v=20)
    run_and_check(executor, q, k, v, family=family, gqa_ratio=gqa_ratio, window=(None, 3),
                  sram_size=4 * 12 * 6)


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
def test_broadcast_kv_and_batch_with_zero_strides(executor, family):
    rng = np.random.default_rng(11)
    q = random_array(rng, (1, 3, 29, 10), np.float32)
    q = np.broadcast_to(q, (2, 3, 29, 10))                          # batch stride 0
    k = np.broadcast_to(random_array(rng, (2, 1, 35, 10), np.float32), (2, 3, 35, 10))   # head stride 0
    v = np.broadcast_to(random_array(rng, (1, 1, 35, 6), np.float32), (2, 3, 35, 6))
    assert q.strides[0] == 0 and k.strides[1] == 0 and v.strides[0] == v.strides[1] == 0
    run_and_check(executor, q, k, v, family=family, sram_size=4 * 10 * 8)


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
def test_transposed_and_strided_views_in_and_out(executor, family):
    rng = np.random.default_rng(12)
    b, h, lq, lk, d, dv = 2, 3, 40, 70, 24, 40
    # (B, L, H, d) storage seen as (B, H, L, d); every other key row; reversed value rows.
    q = random_array(rng, (b, lq, h, d), np.float64).transpose(0, 2, 1, 3)
    k = random_array(rng, (b, h, 2 * lk, d), np.float64)[:, :, ::2]
    v = random_array(rng, (b, h, lk, dv), np.float64)[:, :, ::-1]
    out = poisoned((b, lq, h, dv), np.float64).transpose(0, 2, 1, 3)
    lse = poisoned((b, lq, h), np.float64).transpose(0, 2, 1)
    run_and_check(executor, q, k, v, family=family, out=out, lse=lse, window=(20, 5),
                  sram_size=4 * d * 5)


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_simt_column_slices_copy_partial_16_byte_chunks(executor, dtype):
    # Rows 16-byte aligned (the width-40 storage), d and dv not whole 16-byte
    # chunks: fwd_simt's cp.async copies of float32/float64 tiles take each
    # chunk's valid bytes and zero-fill the rest (a chunk of 1 or 3 valid floats, 1 double).
    rng = np.random.default_rng(21)
    q = random_array(rng, (1, 2, 37, 40), dtype)[..., :13]
    k = random_array(rng, (1, 2, 45, 40), dtype)[..., :13]
    v = random_array(rng, (1, 2, 45, 40), dtype)[..., :7]
    run_and_check(executor, q, k, v)
    run_and_check(executor, q, k, v, window=(None, 0))


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 50), (50, 1), (3, 0), (0, 5)],
                         ids=["1x1", "1x50", "50x1", "lk0", "lq0"])
def test_tiny_and_empty_sequences(executor, family, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = qkv(rng, np.float32, batch=2, heads_kv=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  head_dim=7, head_dim_v=3)
    out, lse = run_and_check(executor, q, k, v, family=family, sram_size=4 * 7 * 2)
    if seqlen_k == 0:
        assert (out == 0).all() and np.isneginf(lse).all()


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
def test_without_lse(executor, family):
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, np.float16, seqlen_q=20, seqlen_k=30, head_dim=16)
    run_and_check(executor, q, k, v, family=family, with_lse=False, sram_size=256)


@needs_emulator
@pytest.mark.parametrize("family", ["fwd_simt", "fwd_v1"])
@pytest.mark.parametrize("scale", [12.0, -0.7, 0.0], ids=["large", "negative", "zero"])
def test_extreme_and_negative_scales(executor, family, scale):
    # Large logits need the running max; a negative scale turns the max into the min.
    # Logits of size ~100 are rounded to float32 before exp: besides the table, out may
    # be off by 2 max|dS| max|v|, a score off by up to eps * logit_rounding (2 u for the
    # product sums and the scaling).
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, np.float32, seqlen_q=45, seqlen_k=77, head_dim=9)
    extra = 2 * np.finfo(np.float32).eps * logit_rounding(q, k, scale) * float(np.abs(v).max())
    run_and_check(executor, q, k, v, family=family, scale=scale, window=(None, 0),
                  sram_size=4 * 9 * 8, extra=extra if abs(scale) > 1 else 0.0)


# ---- fwd_v1 ----------------------------------------------------------------------------------

@needs_emulator
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sram_size", [4 * 24, 4 * 24 * 7, 100_000],
                         ids=["one-row-blocks", "several-blocks", "one-block"])
def test_v1_every_dtype_and_block_size_matches_oracle(executor, dtype, sram_size):
    rng = np.random.default_rng(sram_size)
    q, k, v = qkv(rng, dtype, heads_kv=2, seqlen_q=29, seqlen_k=38, head_dim=24, head_dim_v=11)
    run_and_check(executor, q, k, v, family="fwd_v1", sram_size=sram_size)


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 25), (25, 40)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (0, 0), (6, 2), (None, None)],
                         ids=["causal", "w0-0", "w6-2", "full"])
def test_v1_masks_match_oracle(executor, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k)
    q, k, v = qkv(rng, np.float64, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=6)
    run_and_check(executor, q, k, v, family="fwd_v1", window=window, sram_size=4 * 6 * 4)
