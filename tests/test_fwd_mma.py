"""fwd_mma, the tensor-core forward kernel (cuda_src/fwd_mma.cu), without a GPU.

Static tier: every fwd_mma row of the catalogue compiled offline by NVRTC for
sm_80, sm_86, sm_89 and sm_90 (one compile per arch, module-scoped) -- no
spills, no stack frame, no local memory, and the SASS of a tensor-core kernel:
HMMA, LDSM (ldmatrix) and LDGSTS (cp.async), with the main loop emitted once.

Emulated tier: the kernels run on the CPU emulator (race checks on, threads in
shuffled order, outputs poisoned with NaN) through :func:`cupyflash._gpu.forward`,
exactly as the GPU path calls them.  Accuracy criterion: the error against the
float64 oracle (on the same rounded inputs) is at most 1.25 times the error of
naive attention from the same half-precision inputs with float32
accumulation and P rounded to the input dtype before P V -- what a
tensor-core kernel computes, without the tiling -- plus one rounding of the
largest output to the dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch, _gpu, _report
from cupyflash._kernels import MMA_HEAD_DIMS, instantiations, mma_arch_class, mma_tiles
from cupyflash._launch import launch_config
from cupyflash.emulator import EmulatorExecutor, emulator_available
from cupyflash.reference import naive_attention

from _util import assert_lse_close, bfloat16, poisoned, random_array, visible

HALF_DTYPES = [np.dtype(np.float16)] + ([bfloat16] if bfloat16 is not None else [])
HALF_IDS = [d.name for d in HALF_DTYPES]
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
MMA_ROWS = [r for r in instantiations() if r.family == "fwd_mma"]
# One compute capability per tile class, for the emulated launches.
CLASS_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


# ---- the catalogue, the dispatcher and the launch configuration ------------------------------

def test_catalogue_has_every_head_dim_and_tile_for_both_dtypes():
    for arch in CLASS_ARCH.values():
        for dtype in ("float16", "bfloat16"):
            for d in MMA_HEAD_DIMS:
                inst = _gpu.select(dtype, d, d, arch, aligned=True)
                block_m, block_n, warps, stages, lazy = mma_tiles(arch)[d]
                assert (inst.family, inst.dtype, inst.head_dim) == ("fwd_mma", dtype, d)
                assert (inst.block_m, inst.block_n, inst.threads, inst.kv_stages, inst.lazy_rescale) == \
                    (block_m, block_n, 32 * warps, stages, lazy)
                assert inst.name_expression.endswith(
                    f"{d}, {block_m}, {block_n}, {warps}, {stages}, {str(lazy).lower()}>")
    assert len({r.name_expression for r in MMA_ROWS}) == len(MMA_ROWS)


@pytest.mark.parametrize("arch, limit_kb", [(80, 163), (86, 99), (89, 99), (90, 227)])
def test_each_arch_gets_tiles_that_fit_its_shared_memory(arch, limit_kb):
    for d in MMA_HEAD_DIMS:
        inst = _gpu.select(np.float16, d, d, arch, aligned=True)
        shared = launch_config(inst, batch=1, heads=1, seqlen_q=1, seqlen_k=1)[2]
        assert shared == (inst.block_m + 2 * inst.kv_stages * inst.block_n) * d * 2
        assert shared <= limit_kb * 1024, (arch, inst.name_expression)


def test_launch_config_one_cta_per_query_block_and_head():
    inst = _gpu.select(np.float16, 128, 128, 80, aligned=True)
    grid, block, shared = launch_config(inst, batch=3, heads=5, seqlen_q=300, seqlen_k=7)
    assert grid == (3 * 5 * math.ceil(300 / inst.block_m), 1, 1)
    assert block == (inst.threads, 1, 1)
    assert shared == 64 * 1024


@pytest.mark.parametrize("dtype", HALF_IDS)
def test_select_picks_fwd_mma_only_where_it_applies(dtype):
    assert _gpu.select(dtype, 64, 64, 80, aligned=True).family == "fwd_mma"
    assert _gpu.select(dtype, 1, 1, 90, aligned=True).head_dim == 32       # padded up to 32
    assert _gpu.select(dtype, 200, 200, 86, aligned=True).head_dim == 224
    assert _gpu.select(dtype, 256, 256, 89, aligned=True).family == "fwd_mma"
    simt = [
        _gpu.select(dtype, 64, 64, 80),                  # alignment unknown
        _gpu.select(dtype, 64, 64, 80, aligned=False),   # rows not 16-byte aligned
        _gpu.select(dtype, 64, 32, 80, aligned=True),    # dv != d
        _gpu.select(dtype, 64, 64, 75, aligned=True),    # no mma.sync m16n8k16 before sm_80
    ]
    assert [r.family for r in simt] == ["fwd_simt"] * 4
    assert _gpu.select(dtype, 64, 32, 80, aligned=True).head_dim == 64    # simt bucket of max(d, dv)
    with pytest.raises(ValueError, match="256"):
        _gpu.select(dtype, 257, 257, 80, aligned=True)


@pytest.mark.parametrize("arch", CLASS_ARCH.values())
def test_select_picks_the_whole_kv_row_only_for_whole_key_blocks_at_the_bucket(arch, monkeypatch):
    # K/V copies without bounds (kWholeKV) need every key block whole and d = the bucket
    for d in MMA_HEAD_DIMS:
        plain = _gpu.select("float16", d, d, arch, aligned=True)
        whole = _gpu.select("float16", d, d, arch, aligned=True, seqlen_k=3 * plain.block_n)
        assert not plain.whole_kv and whole.whole_kv
        assert whole.name_expression == plain.name_expression[:-1] + ", false, true>"
        assert (whole.block_m, whole.block_n, whole.threads, whole.kv_stages, whole.lazy_rescale) == \
            (plain.block_m, plain.block_n, plain.threads, plain.kv_stages, plain.lazy_rescale)
        for seqlen_k in (plain.block_n + 1, 3 * plain.block_n - 8, None):
            assert _gpu.select("float16", d, d, arch, aligned=True, seqlen_k=seqlen_k) == plain
        assert _gpu.select("float16", d - 8, d - 8, arch, aligned=True, seqlen_k=4096) == \
            _gpu.select("float16", d - 8, d - 8, arch, aligned=True)                 # padded head dim
        assert not _gpu.select("float16", d, d, arch, aligned=True, split=True, seqlen_k=4096).whole_kv
        monkeypatch.setattr(_gpu, "whole_kv_override", False)
        assert _gpu.select("float16", d, d, arch, aligned=True, seqlen_k=4096) == plain
        monkeypatch.setattr(_gpu, "whole_kv_override", None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select_keeps_fwd_simt_for_float32_and_float64(dtype):
    assert _gpu.select(dtype, 64, 64, 90, aligned=True).family == "fwd_simt"


def test_arch_classes():
    assert [mma_arch_class(a) for a in (75, 80, 86, 87, 89, 90, 100, 120)] == \
        [None, "sm80", "sm86", "sm80", "sm86", "sm90", "sm90", "sm86"]
    assert mma_tiles(75) is None


def test_rows_aligned_needs_16_byte_row_starts():
    base = np.zeros((2, 3, 40, 72), np.float16)                       # rows of 144 bytes
    assert _gpu.rows_aligned(base, None)
    assert _gpu.rows_aligned(base[:, :, ::-1], base[:, :, 1:])       # negative / shifted by a row
    assert _gpu.rows_aligned(np.broadcast_to(base[:1], base.shape))   # stride 0
    assert not _gpu.rows_aligned(np.zeros((2, 3, 40, 36), np.float16))   # rows of 72 bytes
    assert not _gpu.rows_aligned(base[..., 1:])                       # first element 2 bytes off
    assert _gpu.rows_aligned(np.zeros((1, 1, 1, 36), np.float16)[..., :8])   # size-1 axes never step
    assert not _gpu.rows_aligned(base, base[:, :, :, :36].copy())


# ---- the swizzled shared-memory layout, evaluated by the C++ code itself ----------------------

SWIZZLE_PROBE = r"""
#include "mma_tile.cuh"
struct ProbeParams { int* out; };
// For every (row, chunk) of a tile: SwizzledTile::chunk as the loaders and the
// fragment loads call it -- whole, split into an even base plus a lane bit
// (ldmatrix), into a multiple of 4 or 16 plus a lane part (cp.async), and with
// the row split into a multiple of 16 plus 0..15 (row_pitch).
template <int kRows, int kCols>
__global__ void swizzle_probe(const ProbeParams p) {
    using Tile = cf::SwizzledTile<kRows, kCols>;
    if (threadIdx.x != 0) return;
    int* out = p.out;
    for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < Tile::kChunks; ++c) {
            out[0] = Tile::chunk(r, c);
            out[1] = Tile::chunk(r, c & ~1, c & 1);
            out[2] = Tile::chunk(r, c & ~3, c & 3);
            out[3] = kCols % 128 == 0 ? Tile::chunk(r, c & ~15, c & 15) : out[0];
            out[4] = Tile::chunk(r % 16, c & ~1, c & 1) + (r / 16) * 16 * Tile::row_pitch(c & ~1);
            out += 5;
        }
}
"""

SWIZZLE_TILES = [(128, 32), (64, 96), (128, 128), (64, 160), (32, 224), (64, 256)]


@needs_emulator
@pytest.mark.parametrize("rows, cols", SWIZZLE_TILES, ids=[f"{r}x{c}" for r, c in SWIZZLE_TILES])
def test_swizzled_layout_is_a_permutation_without_ldmatrix_bank_conflicts(executors, tmp_path, rows,
                                                                           cols):
    probe = tmp_path / "swizzle_probe.cu"
    probe.write_text(SWIZZLE_PROBE)
    chunks = cols // 8
    out = np.full((rows, chunks, 5), -1, np.int32)
    params = np.array((out.ctypes.data,), dtype=np.dtype([("out", np.uint64)], align=True))[()]
    executors[80].launch(str(probe), f"swizzle_probe<{rows}, {cols}>", 1, 32, 0, params)
    offset = out[..., 0]
    for split in range(1, 5):                       # every way the kernels split the index agrees
        np.testing.assert_array_equal(out[..., split], offset)
    # A permutation of whole 16-byte chunks of the tile.
    assert (offset % 8 == 0).all()
    np.testing.assert_array_equal(np.sort(offset.ravel()), np.arange(0, rows * cols, 8))
    bank_group = (offset * 2 // 16) % 8             # 16-byte group of the 32 banks
    # ldmatrix: 8 consecutive rows (from a multiple of 8) of one chunk column in 8 groups.
    by_matrix = bank_group.reshape(rows // 8, 8, chunks)
    assert all(len(set(by_matrix[i, :, c])) == 8 for i in range(rows // 8) for c in range(chunks))
    # cp.async: 8 consecutive chunks of a row (within a 64-element page) in 8 groups.
    for c0 in range(0, chunks - chunks % 8, 8):
        assert all(len(set(bank_group[r, c0:c0 + 8])) == 8 for r in range(rows))


# ---- static: NVRTC for sm_80, sm_86, sm_89, sm_90 ---------------------------------------------

@pytest.fixture(scope="module")
def report():
    return _report.kernel_report(ARCHS, MMA_ROWS)


def _row_id(row):
    return f"{row['arch']}:{row['name']}"


def test_every_mma_kernel_compiles_without_spills_stack_or_local_memory(report):
    assert {(r["arch"], r["name"]) for r in report} == \
        {(a, i.name_expression) for a in ARCHS for i in MMA_ROWS}
    bad = [(_row_id(r), r["spill_stores"], r["spill_loads"], r["stack_bytes"],
            r["sass"].get("LDL", 0), r["sass"].get("STL", 0))
           for r in report
           if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]
           or r["sass"].get("LDL") or r["sass"].get("STL")]
    assert not bad, f"(kernel, spill st, spill ld, stack, LDL, STL): {bad}"
    assert all(0 < r["registers"] <= 255 for r in report)


def test_sass_is_tensor_core_ldmatrix_and_cp_async_with_the_main_loop_emitted_once(report):
    # Per key block a warp issues kMTiles * block_n/8 * d/16 mma for S and kMTiles * d/8 *
    # block_n/16 for O; ldmatrix.x4: kMTiles * d/16 (Q) + block_n/16 * d/16 (K) +
    # block_n/16 * d/16 (V).  Exactly these counts: one unrolled copy of the loop.
    insts = {i.name_expression: i for i in MMA_ROWS}
    for r in report:
        inst = insts[r["name"]]
        m_tiles = inst.block_m // (inst.threads // 32) // 16
        hmma = m_tiles * inst.block_n // 8 * inst.head_dim // 16 * 2
        ldsm = (m_tiles + 2 * inst.block_n // 16) * inst.head_dim // 16
        sass = r["sass"]
        assert sass.get("HMMA") == hmma, (_row_id(r), sass.get("HMMA"), hmma)
        assert sass.get("LDSM") == ldsm, (_row_id(r), sass.get("LDSM"), ldsm)
        assert sass.get("LDGSTS", 0) > 0 and sass.get("SHFL", 0) > 0 and sass.get("MUFU", 0) > 0, _row_id(r)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_keeps_8_warps_resident_with_its_tiles(report, arch):
    chosen = {_gpu.select(dt, d, d, int(arch[3:]), aligned=True).name_expression
              for dt in HALF_IDS for d in MMA_HEAD_DIMS}
    for r in report:
        if r["arch"] == arch and r["name"] in chosen:
            assert r["occupancy_warps"] >= 8, (_row_id(r), r["registers"], r["shared_bytes"],
                                               r["occupancy"], r["occupancy_limit"])


# ---- emulated: correctness ------------------------------------------------------------------

@pytest.fixture(scope="module")
def executors():
    return {arch: EmulatorExecutor(arch=arch, seed=2024 + arch, shuffle=True, race_check=True)
            for arch in CLASS_ARCH.values()}


class Recorder:
    """Executor wrapper that remembers which instantiations were launched."""

    def __init__(self, inner):
        self.inner, self.arch, self.launched = inner, inner.arch, []

    def launch(self, entry, name_expression, grid, block, shared_mem, params):
        self.launched.append(name_expression)
        self.inner.launch(entry, name_expression, grid, block, shared_mem, params)


def naive_half_attention(q, k, v, *, scale, window, gqa_ratio):
    """Attention as a tensor-core kernel computes it, untiled: scores and softmax in float32
    from the half inputs, the unnormalised P = exp(S - rowmax) rounded to the input dtype
    before P V, the row sum of P taken before that rounding, the output in float32 (not
    rounded: check_against_oracle allows for the kernels' one rounding of it)."""
    dtype = q.dtype
    k = np.repeat(k, gqa_ratio, axis=1) if gqa_ratio > 1 else k
    v = np.repeat(v, gqa_ratio, axis=1) if gqa_ratio > 1 else v
    s = np.matmul(q.astype(np.float32), np.swapaxes(k.astype(np.float32), -1, -2)) * np.float32(scale)
    s = np.where(visible(q.shape[-2], k.shape[-2], window), s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0)).astype(np.float32)
    total = p.sum(axis=-1, keepdims=True, dtype=np.float32)
    pv = np.matmul(p.astype(dtype).astype(np.float32), v.astype(np.float32))
    return np.where(total > 0, pv / np.where(total > 0, total, 1), 0).astype(np.float32)


# Unit roundoff of the 16-bit dtypes: one rounding of the output may be off by this, relatively.
HALF_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# How much further from the oracle than naive_half_attention the kernels may be, besides their
# one rounding of the output (docs/testing.md, "Error analysis"): both round P where a
# tensor-core kernel must, and differ in float32 order and in where P is rounded (against the
# running maximum), not in what is rounded.
HALF_FORWARD_FACTOR = 1.25


# One ulp at 1.0 (machine epsilon): 10 and 7 explicit mantissa bits.
ULP_AT_ONE = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def run_mma(executor, q, k, v, *, window=(None, None), gqa_ratio=1, scale=None, out=None,
            lse=None, with_lse=True, family="fwd_mma", splits=1):
    """One forward through _gpu.forward on the emulator, checked against the oracle;
    ``splits`` > 1 forces a split-KV launch (the kSplit row, then fwd_combine)."""
    batch, heads, seqlen_q, head_dim = q.shape
    if out is None:
        out = poisoned((batch, heads, seqlen_q, v.shape[3]), q.dtype)
    if lse is None and with_lse:
        lse = poisoned((batch, heads, seqlen_q), np.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    recorder = Recorder(executor)
    saved, _gpu.split_override = _gpu.split_override, splits
    try:
        _gpu.forward(q, k, v, out, lse, scale=scale, window_left=window[0], window_right=window[1],
                     gqa_ratio=gqa_ratio, executor=recorder)
    finally:
        _gpu.split_override = saved
    expected = [f"cf::{family}_kernel"] + (["cf::fwd_combine_kernel"] if splits > 1 else [])
    assert [n.split("<")[0] for n in recorder.launched] == expected, recorder.launched
    check_against_oracle(out, lse if with_lse else None, q, k, v, scale=scale, window=window,
                         gqa_ratio=gqa_ratio)
    return out, lse


def check_against_oracle(out, lse, q, k, v, *, scale=None, window=(None, None), gqa_ratio=1):
    """Every element written; out no further from the float64 oracle than HALF_FORWARD_FACTOR
    times naive_half_attention, plus one rounding of the largest output (and float32's);
    lse (unless None) to its tolerance."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    assert not np.isnan(out.astype(np.float64)).any(), "output element left unwritten (NaN)"
    oracle, oracle_lse = naive_attention(q, k, v, scale=scale, window=window,
                                         enable_gqa=gqa_ratio > 1, return_lse=True)
    naive = naive_half_attention(q, k, v, scale=scale, window=window, gqa_ratio=gqa_ratio)
    err = np.abs(out.astype(np.float64) - oracle).max(initial=0.0)
    naive_err = np.abs(naive.astype(np.float64) - oracle).max(initial=0.0)
    largest = np.abs(oracle).max(initial=0.0)
    bound = HALF_FORWARD_FACTOR * naive_err + (HALF_UNIT_ROUNDOFF[q.dtype.name] + 2.0**-24) * largest
    assert err <= bound, (f"max error {err:.3g} > {HALF_FORWARD_FACTOR} x the yardstick's {naive_err:.3g} "
                          f"+ one rounding of the largest output {largest:.3g}")
    if lse is not None:
        assert_lse_close(lse, oracle_lse, q.dtype)


def qkv(rng, dtype, *, batch=1, heads_kv=1, gqa_ratio=1, seqlen_q, seqlen_k, head_dim):
    heads = gqa_ratio * heads_kv
    return (random_array(rng, (batch, heads, seqlen_q, head_dim), dtype),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype))


def _arch_serving(inst):
    seqlen_k = inst.block_n if inst.whole_kv else None   # whole K/V blocks: the whole-KV row
    for arch in CLASS_ARCH.values():
        if _gpu.select(inst.dtype, inst.head_dim, inst.head_dim, arch, aligned=True, split=inst.split,
                       seqlen_k=seqlen_k) == inst:
            return arch
    raise AssertionError(f"no arch selects {inst.name_expression}")


@needs_emulator
@pytest.mark.parametrize("inst", MMA_ROWS, ids=[f"{r.dtype}-d{r.head_dim}-{r.block_m}x{r.block_n}w"
                                                 f"{r.threads // 32}s{r.kv_stages}"
                                                 f"{'-lazy' if r.lazy_rescale else ''}"
                                                 f"{'-split' if r.split else ''}"
                                                 f"{'-whole' if r.whole_kv else ''}" for r in MMA_ROWS])
def test_every_instantiation_matches_oracle_with_tails_and_causal_mask(executors, inst):
    # Two query blocks (the second partial), Lk > Lq: key blocks fully visible, cut by
    # the diagonal, skipped, and a partial last one (a whole-KV row: Lk a multiple of
    # block_n, the dispatcher's condition for it).  A split-KV row runs 3 splits.
    arch = _arch_serving(inst)
    dtype = np.dtype(bfloat16 if inst.dtype == "bfloat16" else inst.dtype)
    rng = np.random.default_rng(inst.head_dim * 7 + inst.block_n)
    seqlen_q = inst.block_m + 21
    seqlen_k = seqlen_q + 2 * inst.block_n + 5
    if inst.whole_kv:
        seqlen_k += -seqlen_k % inst.block_n
    q, k, v = qkv(rng, dtype, heads_kv=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=inst.head_dim)
    recorder = Recorder(executors[arch])
    run_mma(recorder, q, k, v, window=(None, 0), splits=3 if inst.split else 1)
    assert recorder.launched[0] == inst.name_expression


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("head_dim", [40, 72, 200, 8], ids=["d40", "d72", "d200", "d8"])
def test_padded_head_dims_match_oracle(executors, dtype, head_dim):
    # Columns beyond d are zero-filled in shared memory and never stored.
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, dtype, batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    run_mma(executors[80], q, k, v)


@needs_emulator
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(150, 100), (70, 200)], ids=["lq>lk", "lq<lk"])
@pytest.mark.parametrize("window", [(None, 0), (16, 0), (0, 0), (5, 40), (None, 9), (70, None)],
                         ids=["causal", "w16-0", "w0-0", "w5-40", "wN-9", "w70-N"])
def test_masks_match_oracle(executors, seqlen_q, seqlen_k, window):
    rng = np.random.default_rng(seqlen_q * 3 + seqlen_k)
    q, k, v = qkv(rng, np.float16, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64)
    run_mma(executors[80], q, k, v, window=window)


@needs_emulator
@pytest.mark.skipif(bfloat16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("window", [(None, 0), (3, 20)], ids=["causal", "w3-20"])
def test_masks_bfloat16_and_2_stage_pipeline(executors, window):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, bfloat16, heads_kv=2, seqlen_q=200, seqlen_k=140, head_dim=128)
    run_mma(executors[90], q, k, v, window=window)     # sm90's d=128 tile double-buffers K/V


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_rows_with_no_key_are_zero_with_lse_minus_inf(executors, dtype):
    # Lq > Lk, causal: rows i < Lq - Lk see nothing -- a whole query block of them, too.
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, dtype, seqlen_q=300, seqlen_k=40, head_dim=32)
    out, lse = run_mma(executors[80], q, k, v, window=(None, 0))
    assert (out[:, :, :260] == 0).all()
    assert np.isneginf(lse[:, :, :260]).all() and np.isfinite(lse[:, :, 260:]).all()
    # Window (0, 0): only rows i >= Lq - Lk have their one key; softmax of one key is 1.
    out, lse = run_mma(executors[80], q, k, v, window=(0, 0))
    np.testing.assert_array_equal(out[0, 0, 260:], v[0, 0])
    assert np.isneginf(lse[0, 0, :260]).all()


@needs_emulator
def test_no_keys_at_all_gives_zeros(executors):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, np.float16, batch=2, seqlen_q=30, seqlen_k=0, head_dim=64)
    out, lse = run_mma(executors[80], q, k, v)
    assert (out == 0).all() and np.isneginf(lse).all()


@needs_emulator
def test_fully_masked_key_blocks_are_never_read(executors):
    # The rows see keys 150..299 only; keys 0..127 fill two key blocks no row can see.
    # Were they read, their NaN would reach the output (0 * NaN).
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, np.float16, seqlen_q=20, seqlen_k=300, head_dim=64)
    k[:, :, :128] = np.nan
    v[:, :, :128] = np.nan
    out = poisoned(q.shape, np.float16)
    _gpu.forward(q, k, v, out, None, scale=0.125, window_left=130, window_right=0, gqa_ratio=1,
                 executor=executors[80])
    ref = naive_attention(q, k[:, :, 128:], v[:, :, 128:], scale=0.125, window=(130, 0))
    assert np.abs(out.astype(np.float64) - ref).max() < 4e-3


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("gqa_ratio, heads_kv", [(2, 2), (4, 1)], ids=["gqa2", "mqa4"])
def test_gqa_query_heads_share_kv_heads(executors, dtype, gqa_ratio, heads_kv):
    rng = np.random.default_rng(10 + gqa_ratio)
    q, k, v = qkv(rng, dtype, batch=2, heads_kv=heads_kv, gqa_ratio=gqa_ratio, seqlen_q=65,
                  seqlen_k=81, head_dim=32)
    run_mma(executors[80], q, k, v, gqa_ratio=gqa_ratio, window=(None, 3))


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_broadcast_kv_and_batch_with_zero_strides(executors, dtype):
    rng = np.random.default_rng(11)
    q = np.broadcast_to(random_array(rng, (1, 3, 29, 64), dtype), (2, 3, 29, 64))
    k = np.broadcast_to(random_array(rng, (2, 1, 75, 64), dtype), (2, 3, 75, 64))
    v = np.broadcast_to(random_array(rng, (1, 1, 75, 64), dtype), (2, 3, 75, 64))
    assert q.strides[0] == 0 and k.strides[1] == 0 and v.strides[0] == v.strides[1] == 0
    run_mma(executors[80], q, k, v)


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_transposed_and_strided_views_in_and_out(executors, dtype):
    rng = np.random.default_rng(12)
    b, h, lq, lk, d = 2, 3, 70, 90, 64
    # (B, L, H, d) storage seen as (B, H, L, d); every other key row; reversed value rows.
    q = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    k = random_array(rng, (b, h, 2 * lk, d), dtype)[:, :, ::2]
    v = random_array(rng, (b, h, lk, d), dtype)[:, :, ::-1]
    out = poisoned((b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    lse = poisoned((b, lq, h), np.float32).transpose(0, 2, 1)
    assert _gpu.rows_aligned(q, k, v, out)
    run_mma(executors[80], q, k, v, out=out, lse=lse, window=(20, 5))


@needs_emulator
def test_without_lse(executors):
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, np.float16, seqlen_q=40, seqlen_k=50, head_dim=96)
    run_mma(executors[80], q, k, v, with_lse=False)


@needs_emulator
@pytest.mark.parametrize("scale, family", [
    (3.0, "fwd_mma"), (1e-30, "fwd_mma"), (1e-40, "fwd_simt"), (4.4e-159, "fwd_simt"), (-0.7, "fwd_simt"),
    (0.0, "fwd_simt")], ids=["large", "tiny", "float32-subnormal", "float32-zero", "negative", "zero"])
def test_extreme_and_negative_scales(executors, scale, family):
    # fwd_mma folds a positive scale into the exponent (row max of the unscaled
    # scores) as a float32 scale * log2(e) times every score, masked ones (-inf)
    # included.  Where that is 0 (4.4e-159 gave NaN rows, found by the tf32x3
    # fuzzer) or a subnormal, which a GPU flushes to 0 (-ftz=true; the emulator does
    # not), -inf * 0 is NaN: zero, negative and such tiny scales run fwd_simt.
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, np.float16, seqlen_q=45, seqlen_k=77, head_dim=32)
    assert _gpu.select(q.dtype, 32, 32, 80, aligned=True, scale=scale).family == family
    run_mma(executors[80], q, k, v, scale=scale, window=(None, 0), family=family)


@needs_emulator
@pytest.mark.parametrize("arch, step", [(80, 3.0), (80, 12.0), (90, 3.0), (90, 12.0)],
                         ids=["lazy-within-slack", "lazy-moves", "every-block-3", "every-block-12"])
def test_row_maxima_growing_from_block_to_block(executors, arch, step):
    # Scores that grow by about `step` (log2 units) from one 64-key block to the
    # next.  sm_80's d = 128 tile rescales lazily: within the slack of 8 the
    # reference stays put and the probabilities reach 2^3; beyond it every block
    # moves it.  sm_90's d = 128 tile rescales every block.
    d, block_n = 128, 64
    inst = _gpu.select(np.float16, d, d, arch, aligned=True)
    assert (inst.block_n, inst.lazy_rescale) == (block_n, arch == 80)
    rng = np.random.default_rng(int(step) + arch)
    seqlen_q, seqlen_k = 40, 5 * block_n + 9
    scale = 1.0 / math.sqrt(d)
    # q_i ~ e, k_j ~ a_b e (e = ones): score ~ scale * d * a_b, a_b growing with j's block b.
    a = (np.arange(seqlen_k) // block_n) * step * math.log(2) / (scale * d)
    q = (1.0 + 0.1 * rng.standard_normal((1, 1, seqlen_q, d))).astype(np.float16)
    k = (a[:, None] + 0.05 * rng.standard_normal((seqlen_k, d)))[None, None].astype(np.float16)
    v = random_array(rng, (1, 1, seqlen_k, d), np.float16)
    run_mma(executors[arch], q, k, v)


@needs_emulator
def test_misaligned_rows_run_fwd_simt(executors):
    # d = 36 float16: rows of 72 bytes, not 16-byte aligned -> the SIMT kernel.
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, np.float16, seqlen_q=33, seqlen_k=41, head_dim=36)
    run_mma(executors[80], q, k, v, family="fwd_simt")


@needs_emulator
def test_public_api_on_the_emulator_dispatches_to_fwd_mma(executors, monkeypatch):
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, np.float16, batch=2, heads_kv=2, seqlen_q=50, seqlen_k=60, head_dim=64)
    recorder = Recorder(executors[80])
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: recorder)
    out = cupyflash.attention(q, k, v, causal=True, backend="emulator")
    assert [n.split("<")[0] for n in recorder.launched] == ["cf::fwd_mma_kernel"]
    oracle = naive_attention(q, k, v, causal=True)
    assert np.abs(out.astype(np.float64) - oracle).max() < 4e-3
    cupyflash.attention(q, k, v[..., :32], backend="emulator")      # dv != d
    cupyflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                        backend="emulator")
    assert [n.split("<")[0] for n in recorder.launched[1:]] == ["cf::fwd_simt_kernel"] * 2
