"""fwd_mma, the tensor-core forward kernel (cuda_src/fwd_mma.cu), without a GPU: what is
particular to it.  Its dispatch, launch geometry, static report and every instantiation
on the emulator are tests/test_families.py's.

Static tier: each arch keeps 8 warps resident with the tiles dispatch gives it (FA2's
rule); the swizzled shared-memory layout, evaluated by the C++ code itself, is a
permutation without ldmatrix bank conflicts.

Emulated tier: the kernels run on the CPU emulator (race checks on, threads in
shuffled order, outputs poisoned with NaN) through :func:`cupyflash._run.forward`,
exactly as the GPU path calls them: padded head dims, masks with both stagings of K/V,
rows that see no key, GQA, broadcast and transposed strides, extreme scales, the lazy
rescale, the public call.  Accuracy criterion (tests/_kernel_util.py,
check_against_oracle): the error against the float64 oracle (on the same rounded inputs)
is at most 1.25 times the error of naive attention from the same half-precision inputs
with float32 accumulation and P rounded to the input dtype before P V -- what a
tensor-core kernel computes, without the tiling -- plus one rounding of the largest output
to the dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch, _report, _run
from cupyflash._arch import tile_class
from cupyflash._families import FORWARD, FWD_MMA, Call, select
from cupyflash._families.fwd_mma import MMA_HEAD_DIMS
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor
from cupyflash.reference import naive_attention

from _kernel_util import (HALF_DTYPES, HALF_IDS, Recorder, needs_emulator, poisoned, qkv,
                          run_half_forward as run_mma)
from _util import bfloat16, random_array

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
# One compute capability per tile class, for the emulated launches.
CLASS_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}


def _select(dtype, d, dv, arch, **call):
    (row,) = select(FORWARD, Call(np.dtype(dtype).name, d, dv, **call), arch, KernelOptions())
    return row


# ---- the tile classes and the rows' alignment ------------------------------------------------

def test_name_expressions_carry_each_class_tile():
    # the template arguments in the kernel's order: <T, d, block_m, block_n, warps, kv_stages,
    # lazy_rescale[, split[, whole_kv]]>
    for arch in CLASS_ARCH.values():
        for dtype in ("float16", "bfloat16"):
            for d in MMA_HEAD_DIMS:
                block_m, block_n, warps, stages, lazy = FWD_MMA.class_tiles(arch)[d]
                inst = _select(dtype, d, d, arch, aligned=True)
                assert inst.name_expression.endswith(
                    f"{d}, {block_m}, {block_n}, {warps}, {stages}, {str(lazy).lower()}>")


def test_arch_classes():
    assert [tile_class(a) for a in (75, 80, 86, 87, 89, 90, 100, 120)] == \
        [None, "sm80", "sm86", "sm80", "sm86", "sm90", "sm90", "sm86"]
    assert FWD_MMA.class_tiles(75) is None


def test_rows_aligned_needs_16_byte_row_starts():
    base = np.zeros((2, 3, 40, 72), np.float16)                       # rows of 144 bytes
    assert _run.rows_aligned(base, None)
    assert _run.rows_aligned(base[:, :, ::-1], base[:, :, 1:])       # negative / shifted by a row
    assert _run.rows_aligned(np.broadcast_to(base[:1], base.shape))   # stride 0
    assert not _run.rows_aligned(np.zeros((2, 3, 40, 36), np.float16))   # rows of 72 bytes
    assert not _run.rows_aligned(base[..., 1:])                       # first element 2 bytes off
    assert _run.rows_aligned(np.zeros((1, 1, 1, 36), np.float16)[..., :8])   # size-1 axes never step
    assert not _run.rows_aligned(base, base[:, :, :, :36].copy())


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
    # the compiles of tests/test_families.py's report: each row where it may launch
    return _report.kernel_report(ARCHS, FWD_MMA.rows, launchable=True)


def _row_id(row):
    return f"{row['arch']}:{row['name']}"



@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_keeps_8_warps_resident_with_its_tiles(report, arch):
    chosen = {_select(dt, d, d, int(arch[3:]), aligned=True).name_expression
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


@needs_emulator
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("head_dim", [40, 72, 200, 8], ids=["d40", "d72", "d200", "d8"])
def test_padded_head_dims_match_oracle(executors, dtype, head_dim):
    # Columns beyond d are zero-filled in shared memory and never stored.
    rng = np.random.default_rng(head_dim)
    q, k, v = qkv(rng, dtype, batch=2, seqlen_q=70, seqlen_k=90, head_dim=head_dim)
    run_mma(executors[80], q, k, v)


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
    _run.forward(q, k, v, out, None, scale=0.125, window_left=130, window_right=0, gqa_ratio=1,
                 executor=executors[80], options=KernelOptions())
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
    assert _run.rows_aligned(q, k, v, out)
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
    assert _select(q.dtype, 32, 32, 80, aligned=True, scale=scale).family.name == family
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
    inst = _select(np.float16, d, d, arch, aligned=True)
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
