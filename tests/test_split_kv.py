"""Split-KV forward: the heuristic, the launch geometry, and the split kernels on the emulator.

When the query blocks of a call give the GPU too few CTAs (few heads, short
query sequences, decoding with Lq = 1), :func:`cupyflash._launch.num_splits`
cuts each query block's keys into several runs, one CTA each
(``FwdParams::num_splits``, ``blockIdx.y``), and ``fwd_combine`` merges the
partial results.  Checked here without a GPU:

- the heuristic's rule (no split for a full grid or short key sequences;
  for small grids the count that minimises waves x (key blocks per split + 2),
  with at least 256 keys a split and at most 4 waves);
- the catalogue (a ``kSplit`` fwd_mma row for every tile a GPU class runs,
  32-key blocks at d = 128 where the 64-key tile's split epilogue spills);
- every split kernel on the emulator (shuffled threads, race check), forced
  to several split counts -- including more splits than key blocks, so some
  runs are empty -- over causal and window masks with Lq < Lk and Lq > Lk
  (rows that see no key), GQA, tails, dv != d, strided outputs, with and
  without lse, against the float64 oracle, each output NaN-poisoned first.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash._families import FORWARD, FWD_COMBINE, FWD_MMA, FWD_WGMMA, Call, Sizes, by_name, launchable, select
from cupyflash._families.fwd_mma import MMA_HEAD_DIMS
from cupyflash._launch import ctas_per_sm, num_splits
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor, emulator_available

from _util import forward_against_oracle, poisoned, random_array

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")

H200_SMS = 132


def _forward(dtype, head_dim, arch, options=KernelOptions(), **call):
    """The forward row dispatch picks for a ``head_dim`` x ``head_dim`` call (``call``: the
    rest of the :class:`~cupyflash._families.Call`)."""
    (row,) = select(FORWARD, Call(dtype, head_dim, head_dim, **call), arch, options)
    return row


def _simt(dtype="float32", head_dim=64):
    return _forward(dtype, head_dim, 90)


def _mma(dtype="bfloat16", head_dim=128, arch=90):
    return _forward(dtype, head_dim, arch, aligned=True)


def _combine(dtype_name):
    (row,) = [r for r in FWD_COMBINE.rows if r.dtype == dtype_name]
    return row


def _launch_config(row, *, batch, heads, seqlen_q, seqlen_k, head_dim_v=0, num_splits=1):
    return row.family.launch_config(row, Sizes(batch, heads, heads, seqlen_q, seqlen_k, head_dim_v=head_dim_v,
                                               num_splits=num_splits))


# ---- the heuristic -------------------------------------------------------------------------------

def test_a_full_grid_is_not_split():
    for inst in (_simt(), _mma()):
        assert num_splits(inst, batch=4, heads=16, seqlen_q=4096, seqlen_k=4096, arch=90,
                          multiprocessors=H200_SMS) == 1


def test_the_partial_results_stay_within_four_waves_of_rows():
    # one float16 head at d = 256 over a million keys: the time model alone would take
    # 43 splits (34 waves); four waves of 3 x 132 CTAs of 32 rows cap it
    inst = _simt("float16", 256)
    splits = num_splits(inst, batch=1, heads=1, seqlen_q=10000, seqlen_k=1 << 20, arch=90,
                        multiprocessors=H200_SMS)
    ctas = -(-10000 // inst.block_m)
    assert 2 <= splits and ctas * splits <= 4 * ctas_per_sm(inst, 90) * H200_SMS


def test_a_local_window_counts_only_the_keys_it_lets_through():
    inst = _mma()
    common = dict(batch=1, heads=8, seqlen_q=1, seqlen_k=1 << 20, arch=90, multiprocessors=H200_SMS)
    assert num_splits(inst, **common) == 33     # one wave of 8 x 33 CTAs
    # 128 + 4096 + 0 + 64 keys: 67 blocks, at most 16 splits of 256 keys
    assert 2 <= num_splits(inst, window_left=4096, window_right=0, **common) <= 16
    assert num_splits(inst, window_left=100, window_right=0, **common) == 1     # 5 blocks
    assert num_splits(inst, window_left=None, window_right=0, **common) == 33   # causal: all keys


def test_short_key_sequences_are_not_split():
    # fewer than 2 x 256 keys: a second split would not have 256
    for inst in (_simt(), _mma()):
        assert num_splits(inst, batch=1, heads=1, seqlen_q=1, seqlen_k=511, arch=90,
                          multiprocessors=H200_SMS) == 1


@pytest.mark.parametrize("inst_name", ["simt", "mma"])
@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k", [
    (1, 8, 1, 8192), (1, 32, 1, 4096), (1, 1, 10000, 10000), (2, 4, 300, 50000), (1, 1, 64, 1 << 20)])
def test_small_grids_are_split_to_fill_the_gpu(inst_name, batch, heads, seqlen_q, seqlen_k):
    inst = _simt() if inst_name == "simt" else _mma()
    slots = ctas_per_sm(inst, 90) * H200_SMS
    ctas = -(-seqlen_q // inst.block_m) * batch * heads
    splits = num_splits(inst, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, arch=90,
                        multiprocessors=H200_SMS)
    assert ctas < 0.8 * slots
    full_blocks = seqlen_k // inst.block_n
    allowed = [s for s in range(1, 65)
               if full_blocks // s * inst.block_n >= 256 and ctas * s <= 4 * slots]   # 256 keys, 4 waves

    def time(s):   # waves x (key blocks per split + the CTA's own Q tile and rows)
        return math.ceil(ctas * s / slots) * (math.ceil(seqlen_k / inst.block_n / s) + 2)

    assert splits in allowed and splits >= 2
    assert time(splits) == min(time(s) for s in allowed)
    assert all(time(s) > time(splits) for s in allowed if s < splits), "the smallest best count"
    assert time(splits) <= 0.9 * time(1)


def test_a_long_single_head_is_split_in_ten_on_an_h200():
    # 157 query blocks of 64 rows (313 key blocks) for 4 x 132 slots: 3 splits run one
    # wave of 105 + 2 blocks, 10 splits three waves of 32 + 2 (102, the least)
    assert num_splits(_simt(), batch=1, heads=1, seqlen_q=10000, seqlen_k=10000, arch=90,
                      multiprocessors=H200_SMS) == 10


def test_ctas_per_sm_follows_the_occupancy_targets_and_shared_memory():
    f32 = _simt("float32", 64)          # 42 KB, __launch_bounds__(128, 4)
    assert ctas_per_sm(f32, 90) == 4 and ctas_per_sm(f32, 80) == 3 and ctas_per_sm(f32, 86) == 2
    assert ctas_per_sm(_simt("float32", 256), 90) == 1    # 67 KB: one CTA's target
    assert ctas_per_sm(_mma("bfloat16", 128, 80), 80) == 2
    wgmma = _forward("bfloat16", 128, 90, KernelOptions(wgmma=True), aligned=True)
    assert wgmma.family is FWD_WGMMA and ctas_per_sm(wgmma, 90) == 1
    with pytest.raises(ValueError, match="no split-KV"):
        ctas_per_sm(_combine("float32"), 90)


def test_launch_geometry():
    inst = _simt()
    grid, block, _ = _launch_config(inst, batch=2, heads=3, seqlen_q=100, seqlen_k=5000, num_splits=7)
    assert grid == (2 * 3 * 2, 7, 1) and block == (128, 1, 1)
    for bad in (0, 65):
        with pytest.raises(ValueError, match="num_splits"):
            _launch_config(inst, batch=1, heads=1, seqlen_q=1, seqlen_k=1, num_splits=bad)
    combine = _combine("float32")
    with pytest.raises(ValueError, match="num_splits"):
        _launch_config(combine, batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim_v=64, num_splits=2)
    # one thread per 16-byte chunk of an output row: 4 floats, 2 doubles
    grid, block, shared = _launch_config(combine, batch=2, heads=3, seqlen_q=100, seqlen_k=1, head_dim_v=65)
    assert grid == (-(-600 * 17 // 128), 1, 1) and shared == 0
    combine64 = _combine("float64")
    grid, _, _ = _launch_config(combine64, batch=2, heads=3, seqlen_q=100, seqlen_k=1, head_dim_v=65)
    assert grid == (-(-600 * 33 // 128), 1, 1)


# ---- the catalogue -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [80, 86, 89, 90])
def test_every_mma_tile_has_a_split_instantiation(arch):
    tiles, split_tiles = FWD_MMA.class_tiles(arch), FWD_MMA.class_tiles(arch, split=True)
    names = {r.name_expression for r in launchable(arch)}
    for dtype in ("float16", "bfloat16"):
        for d in MMA_HEAD_DIMS:
            name = FWD_MMA.make_row(dtype, d, split_tiles[d], split=True).name_expression
            assert name.endswith(", true>") and name in names
            row = by_name()[name]
            assert row.split and row.family is FWD_MMA
            # the same tile, except d = 128's 32-key blocks
            assert split_tiles[d] == (tiles[d] if d != 128 else (128, 32, 4, 1, True))
            split = _forward(dtype, d, arch, aligned=True, split=True)
            assert split.name_expression == name
            assert not _forward(dtype, d, arch, aligned=True).split


# ---- the kernels, on the emulator --------------------------------------------------------------

@pytest.fixture(scope="module")
def executor():
    return EmulatorExecutor(arch=80, seed=77, shuffle=True, race_check=True)


def _run(executor, dtype, *, head_dim, seqlen_q, seqlen_k, head_dim_v=None, window=(None, None),
         gqa_ratio=1, batch=1, heads_kv=1, splits=None, with_lse=True, out=None):
    """One forward with ``splits`` forced (None: the heuristic) on random inputs, checked
    against the oracle; returns the (name, grid) launches and the output."""
    rng = np.random.default_rng(seqlen_q * 1000 + seqlen_k + head_dim)
    dtype = np.dtype(dtype)
    dv = head_dim if head_dim_v is None else head_dim_v
    heads = heads_kv * gqa_ratio
    q = random_array(rng, (batch, heads, seqlen_q, head_dim), dtype)
    k = random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype)
    v = random_array(rng, (batch, heads_kv, seqlen_k, dv), dtype)
    spy, out = forward_against_oracle(executor, q, k, v, window=window, gqa_ratio=gqa_ratio, out=out,
                                      with_lse=with_lse, options=KernelOptions(splits=splits))
    return spy.launches, out


def _bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16


@needs_emulator
@pytest.mark.parametrize("case", [
    # dtype, d, Lq, Lk, window, gqa, splits, kernel
    ("float32", 64, 70, 300, (None, None), 1, 3, "fwd_simt_kernel<float, 64"),
    ("float32", 64, 100, 90, (None, 0), 2, 5, "fwd_simt_kernel<float, 64"),     # rows with no key; 5 > 3 blocks
    ("float64", 32, 40, 200, (20, 5), 2, 4, "fwd_simt_kernel<double, 32"),
    ("float16", 64, 130, 400, (None, None), 1, 3, "fwd_mma_kernel<__half, 64, 128, 64, 4, 2, true, true>"),
    ("bfloat16", 128, 65, 300, (None, 0), 2, 4, "fwd_mma_kernel<__nv_bfloat16, 128, 128, 32, 4, 1, true, true>"),
    ("bfloat16", 36, 33, 260, (50, 0), 1, 2, "fwd_simt_kernel<__nv_bfloat16, 64"),   # rows of 72 B: SIMT
    ("float16", 32, 20, 150, (None, 0), 1, 8, "fwd_mma_kernel<__half, 32"),   # 3 key blocks: 5 empty runs
    ("float16", 36, 20, 150, (None, 0), 2, 8, "fwd_simt_kernel<__half, 64"),  # 5 key blocks: 3 empty runs
], ids=lambda c: f"{c[0]}-d{c[1]}-{c[2]}x{c[3]}-w{c[4]}-g{c[5]}-s{c[6]}")
def test_split_kernels_match_the_oracle(executor, case):
    dtype, d, lq, lk, window, gqa, splits, kernel = case
    dt = _bf16() if dtype == "bfloat16" else dtype
    launched, _ = _run(executor, dt, head_dim=d, seqlen_q=lq, seqlen_k=lk, window=window, gqa_ratio=gqa,
                       batch=2, splits=splits)
    (main, grid), (combine, _) = launched
    assert kernel in main and grid[1] == splits
    assert combine == _combine(np.dtype(dt).name).name_expression


@needs_emulator
def test_split_with_dv_other_than_d_without_lse_into_a_strided_out(executor):
    # out: a transposed (B, L, H, dv) buffer viewed as (B, H, L, dv)
    base = poisoned((1, 50, 2, 64), np.float32)
    out = base.transpose(0, 2, 1, 3)
    launched, _ = _run(executor, np.float32, head_dim=32, head_dim_v=64, seqlen_q=50, seqlen_k=333,
                       window=(None, 0), gqa_ratio=2, splits=3, with_lse=False, out=out)
    assert [n for n, _ in launched][1] == _combine("float32").name_expression


@needs_emulator
def test_split_and_unsplit_agree(executor):
    _, one = _run(executor, np.float64, head_dim=64, seqlen_q=17, seqlen_k=700, splits=1)
    _, four = _run(executor, np.float64, head_dim=64, seqlen_q=17, seqlen_k=700, splits=4)
    np.testing.assert_allclose(four, one, rtol=1e-13, atol=1e-15)


@needs_emulator
def test_the_heuristic_splits_a_decoding_step(executor):
    # Lq = 1 over 4096 keys, 2 heads: 2 CTAs on an emulated A100 (108 SMs)
    launched, _ = _run(executor, np.float32, head_dim=64, seqlen_q=1, seqlen_k=4096, heads_kv=2,
                       splits=None)
    (main, grid), (combine, _) = launched
    inst = _forward("float32", 64, 80)
    assert main == inst.name_expression
    # 2 CTAs for 3 x 108 slots, 128 key blocks: 16 splits of 256 keys, the most allowed,
    # still run in one wave
    assert grid[1] == num_splits(inst, batch=1, heads=2, seqlen_q=1, seqlen_k=4096, arch=80,
                                 multiprocessors=executor.multiprocessors) == 16
    assert combine == _combine("float32").name_expression


@needs_emulator
def test_split_results_do_not_depend_on_thread_order():
    outs = []
    for seed in (1, 2):
        ex = EmulatorExecutor(arch=80, seed=seed, shuffle=True, race_check=False)
        _, out = _run(ex, np.float32, head_dim=64, seqlen_q=9, seqlen_k=600, splits=3)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
