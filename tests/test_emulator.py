"""The CPU emulator: every emulated instruction against the PTX fragment tables,
and the checks (races, deadlocks, cp.async waits, bounds) against planted bugs.

Expected values are computed here directly from shared/reference/ptx-fragments.md
and the CUDA Programming Guide's shuffle rules, never with the emulator's own
layout code.  The micro-kernels are cuda_src/fidelity.cu (they also run on a GPU);
the planted bugs are in tests/emulator_planted/.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cupyflash.emulator import (
    EmulatorBuildError,
    EmulatorError,
    EmulatorExecutor,
    emulator_available,
)
from cupyflash.emulator._build import ModuleCache

from _emulator_util import (FID_DTYPE, FIDELITY, FIDELITY_KERNELS, SHFL_NUMPY, SHFL_TYPES,
                            bf16_bits_rne, fid_params, frag_a_16816, frag_a_1688_tf32, frag_b_16816,
                            frag_b_1688_tf32, frag_c, pack_pairs, planted_params, ptr, tf32_rna)

AVAILABLE, REASON = emulator_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU emulator unavailable: {REASON}")

HERE = Path(__file__).resolve().parent
PLANTED = str(HERE / "emulator_planted" / "planted.cu")
TOY = str(HERE / "emulator_planted" / "toy_attention.cu")

TOY_DTYPE = np.dtype(
    [("q", np.uint64), ("k", np.uint64), ("v", np.uint64), ("o", np.uint64), ("L", np.int32),
     ("scale_log2", np.float32)],
    align=True,
)

PLANTED_KERNELS = [
    "neighbour_sum<true>", "neighbour_sum<false>", "rotate_in_place<true>", "rotate_in_place<false>",
    "warp_exchange<true>", "warp_exchange<false>", "cp_async_neighbour<true>", "cp_async_neighbour<false>",
    "cp_async_no_barrier", "divergent_barrier", "barrier_vs_shuffle", "shuffle_after_exit",
    "divergent_collectives", "smem_out_of_bounds", "order_probe", "block_sum", "block_votes",
    "wild_global_write", "stack_overflow", "shared_window", "divergent_mma<true>", "divergent_mma<false>",
    "vector_copy",
]


@pytest.fixture(scope="module")
def ex():
    """Race-checking executor with the fidelity and planted modules built once."""
    e = EmulatorExecutor(arch=80, seed=0, shuffle=True, race_check=True)
    e.compile(FIDELITY, FIDELITY_KERNELS)
    e.compile(PLANTED, PLANTED_KERNELS)
    return e


@pytest.fixture(scope="module")
def ex_nocheck():
    """Executor without the shared-memory checks (uninstrumented modules)."""
    e = EmulatorExecutor(arch=80, seed=0, shuffle=True, race_check=False)
    e.compile(FIDELITY, FIDELITY_KERNELS)
    e.compile(PLANTED, PLANTED_KERNELS)
    return e


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- fragment tables of ptx-fragments.md (tests/_emulator_util.py) -------------------------

def test_fragment_helpers_match_the_reference_spot_checks():
    assert frag_a_16816(5) == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert frag_b_16816(31) == [(6, 7), (7, 7), (14, 7), (15, 7)]
    assert frag_c(31)[0] == (7, 6) and frag_c(31)[3] == (15, 7)


_DEVICE_FUNCTION = re.compile(
    r"((?:template\s*<[^>]*>\s*)?)__device__\s+__forceinline__\s+([^({;]*?)\s*\b(\w+)\s*\((.*?)\)\s*\{", re.DOTALL
)


def _device_functions(path):
    def norm(text):
        return " ".join(text.split())

    return {m.group(3): tuple(norm(m.group(i)) for i in (1, 2, 4)) for m in _DEVICE_FUNCTION.finditer(path.read_text())}


def test_emulated_ptx_header_twins_every_function_of_the_real_one():
    from cupyflash._source import cuda_src_dir
    from cupyflash.emulator._build import INCLUDE_DIR

    real = _device_functions(cuda_src_dir() / "ptx.cuh")
    twin = _device_functions(INCLUDE_DIR / "ptx.cuh")
    assert len(real) >= 20
    assert real == twin


# ---- mma.sync --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_m16n8k16_matches_fragment_tables(ex, rng, kind):
    warps = 2
    a_frag = np.zeros((32 * warps, 4), np.uint32)
    b_frag = np.zeros((32 * warps, 2), np.uint32)
    c_frag = np.zeros((32 * warps, 4), np.float32)
    expected = np.zeros((32 * warps, 4))
    for w in range(warps):
        if kind == "f16":
            A = rng.standard_normal((16, 16)).astype(np.float16)
            B = rng.standard_normal((16, 8)).astype(np.float16)
            a_bits, b_bits = A.view(np.uint16), B.view(np.uint16)
            A64, B64 = A.astype(np.float64), B.astype(np.float64)
        else:
            A32 = rng.standard_normal((16, 16)).astype(np.float32)
            B32 = rng.standard_normal((16, 8)).astype(np.float32)
            a_bits, b_bits = bf16_bits_rne(A32), bf16_bits_rne(B32)
            A64 = (a_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            B64 = (b_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        D = A64 @ B64 + C
        for lane in range(32):
            L = 32 * w + lane
            a_frag[L] = pack_pairs([a_bits[r, c] for r, c in frag_a_16816(lane)])
            b_frag[L] = pack_pairs([b_bits[r, c] for r, c in frag_b_16816(lane)])
            c_frag[L] = [C[r, c] for r, c in frag_c(lane)]
            expected[L] = [D[r, c] for r, c in frag_c(lane)]
    d = np.full((32 * warps, 4), np.nan, np.float32)
    ex.launch(FIDELITY, f"fid_mma_{kind}", 1, 32 * warps, 0, fid_params(a_frag, b_frag, c_frag, d))
    # The accumulation order is unspecified: compare to float32 rounding.
    np.testing.assert_allclose(d, expected, rtol=1e-6, atol=1e-5)


def test_mma_m16n8k8_tf32_rounds_inputs_and_matches_fragment_tables(ex, rng):
    warps = 2
    a_in = np.zeros((32 * warps, 4), np.float32)
    b_in = np.zeros((32 * warps, 2), np.float32)
    c_in = np.zeros((32 * warps, 4), np.float32)
    expected_d = np.zeros((32 * warps, 4))
    expected_regs = np.zeros((32 * warps, 6), np.uint32)
    for w in range(warps):
        A = rng.standard_normal((16, 8)).astype(np.float32)
        B = rng.standard_normal((8, 8)).astype(np.float32)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        Ar, Br = tf32_rna(A), tf32_rna(B)
        D = Ar.view(np.float32).astype(np.float64) @ Br.view(np.float32).astype(np.float64) + C
        for lane in range(32):
            L = 32 * w + lane
            a_in[L] = [A[r, c] for r, c in frag_a_1688_tf32(lane)]
            b_in[L] = [B[r, c] for r, c in frag_b_1688_tf32(lane)]
            c_in[L] = [C[r, c] for r, c in frag_c(lane)]
            expected_regs[L, :4] = [Ar[r, c] for r, c in frag_a_1688_tf32(lane)]
            expected_regs[L, 4:] = [Br[r, c] for r, c in frag_b_1688_tf32(lane)]
            expected_d[L] = [D[r, c] for r, c in frag_c(lane)]
    d = np.full((32 * warps, 4), np.nan, np.float32)
    regs = np.zeros((32 * warps, 6), np.uint32)
    ex.launch(FIDELITY, "fid_mma_tf32", 1, 32 * warps, 0, fid_params(a_in, b_in, c_in, d, regs))
    np.testing.assert_array_equal(regs, expected_regs)
    np.testing.assert_allclose(d, expected_d, rtol=1e-6, atol=1e-5)


def test_mma_m8n8k4_f64_matches_the_fragment_table(ex, rng):
    # ptx-fragments.md section 3: a0 = A[g][t], b0 = B[t][g], c0/c1 = C[g][2t], C[g][2t+1];
    # each warp its own 8x4 @ 4x8 + 8x8 product, in double.
    warps = 2
    a_in, b_in = np.zeros(32 * warps), np.zeros(32 * warps)
    c_in, expected = np.zeros((32 * warps, 2)), np.zeros((32 * warps, 2))
    for w in range(warps):
        A, B, C = rng.standard_normal((8, 4)), rng.standard_normal((4, 8)), rng.standard_normal((8, 8))
        D = A @ B + C
        for lane in range(32):
            g, t, L = lane >> 2, lane & 3, 32 * w + lane
            a_in[L], b_in[L] = A[g, t], B[t, g]
            c_in[L] = C[g, 2 * t:2 * t + 2]
            expected[L] = D[g, 2 * t:2 * t + 2]
    d = np.full((32 * warps, 2), np.nan)
    ex.launch(FIDELITY, "fid_mma_f64", 1, 32 * warps, 0, fid_params(a_in, b_in, c_in, d))
    # an FMA chain in double: within a few ulps of NumPy's sum of four products
    np.testing.assert_allclose(d, expected, rtol=1e-14, atol=1e-14)


def test_to_tf32_rounds_to_nearest_ties_away(ex):
    one = np.float32(1.0).view(np.uint32)
    bits = np.array(
        [one, one + 0x0FFF, one + 0x1000, one + 0x1001, one + 0x3000, 0xBF801000, 0x00000001, 0x7F7FFFFF],
        np.uint32,
    )
    x = bits.view(np.float32)
    out = np.zeros_like(bits)
    ex.launch(FIDELITY, "fid_to_tf32", 1, 32, 0, fid_params(x, out0=out, n=x.size))
    expected = [one, one, one + 0x2000, one + 0x2000, one + 0x4000, 0xBF802000, 0, 0x7F800000]
    np.testing.assert_array_equal(out, np.array(expected, np.uint32))


# ---- ldmatrix ---------------------------------------------------------------------------

@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_matches_fragment_table(ex, rng, num, trans):
    warps, smem_bytes = 2, 4096
    smem = rng.integers(0, 2**16, smem_bytes // 2, dtype=np.uint16)
    # Every lane holds a distinct, 16-byte aligned, scattered row address.
    offsets = (rng.permutation(smem_bytes // 16)[: 32 * warps] * 16).astype(np.int32)
    out = np.zeros((32 * warps, num), np.uint32)
    name = f"fid_ldmatrix<{num}, {'true' if trans else 'false'}>"
    ex.launch(FIDELITY, name, 1, 32 * warps, smem_bytes, fid_params(smem, offsets, out0=out, n=smem_bytes))
    expected = np.zeros_like(out)
    for w in range(warps):
        for i in range(num):
            # M_i row r is 8 b16 values at the address held by lane 8i + r.
            M = np.stack([smem[offsets[32 * w + 8 * i + r] // 2:][:8] for r in range(8)]).astype(np.uint32)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                lo, hi = (M[2 * t, g], M[2 * t + 1, g]) if trans else (M[g, 2 * t], M[g, 2 * t + 1])
                expected[32 * w + lane, i] = lo | (hi << 16)
    np.testing.assert_array_equal(out, expected)


def test_ldmatrix_rejects_misaligned_rows(ex, rng):
    smem = rng.integers(0, 2**16, 1024, dtype=np.uint16)
    offsets = np.arange(32, dtype=np.int32) * 16
    offsets[3] += 8
    out = np.zeros((32, 4), np.uint32)
    with pytest.raises(EmulatorError, match="not 16-byte aligned"):
        ex.launch(FIDELITY, "fid_ldmatrix<4, false>", 1, 32, 2048, fid_params(smem, offsets, out0=out, n=2048))


# ---- shuffles -------------------------------------------------------------------------------
def shfl_values(rng, ctype, n):
    dt = SHFL_NUMPY[ctype]
    if dt in (np.float32, np.float64):
        return rng.standard_normal(n).astype(dt)
    return rng.integers(-(2**31), 2**31, n).astype(np.int64).astype(dt)


def bfly_source(lane, lane_mask, width):
    """Section 7: segmask = (32 - width) & 31, maxLane = (lane & segmask) | (31 & ~segmask)."""
    segmask = (32 - width) & 0x1F
    max_lane = (lane & segmask) | (0x1F & ~segmask)
    j = lane ^ lane_mask
    return lane if j > max_lane else j


@pytest.mark.parametrize("ctype", SHFL_TYPES)
def test_shfl_xor_width_semantics_bit_exact(ex, rng, ctype):
    warps = 2
    v = shfl_values(rng, ctype, 32 * warps)
    widths = [32, 16, 8, 4, 2, 1] if ctype in ("float", "int") else [32, 8]
    for width in widths:
        for lane_mask in range(32):
            out0, out1 = np.zeros_like(v), np.zeros_like(v)
            ex.launch(FIDELITY, f"fid_shfl_xor<{ctype}>", 1, 32 * warps, 0,
                      fid_params(v, out0=out0, out1=out1, arg0=lane_mask, arg1=width))
            src = np.array([32 * w + bfly_source(lane, lane_mask, width) for w in range(warps) for lane in range(32)])
            np.testing.assert_array_equal(out0.view(np.uint8), v[src].view(np.uint8),
                                          err_msg=f"width {width} mask {lane_mask}")
            full = np.array([32 * w + (lane ^ lane_mask) for w in range(warps) for lane in range(32)])
            np.testing.assert_array_equal(out1.view(np.uint8), v[full].view(np.uint8))


@pytest.mark.parametrize("ctype", ["float", "double", "__half2"])
@pytest.mark.parametrize("width", [32, 16, 4, 1])
def test_shfl_idx_reads_src_lane_modulo_width(ex, rng, ctype, width):
    warps = 2
    v = shfl_values(rng, ctype, 32 * warps)
    src = rng.integers(0, 64, 32 * warps).astype(np.int32)  # also outside [0, width)
    out0, out1 = np.zeros_like(v), np.zeros_like(v)
    ex.launch(FIDELITY, f"fid_shfl_idx<{ctype}>", 1, 32 * warps, 0,
              fid_params(v, src, out0=out0, out1=out1, arg1=width))
    # Programming Guide: srcLane outside [0, width) reads srcLane modulo width, within the caller's segment.
    lanes = np.arange(32 * warps)
    seg_base = lanes - lanes % width
    np.testing.assert_array_equal(out0.view(np.uint8), v[seg_base + src % width].view(np.uint8))
    np.testing.assert_array_equal(out1.view(np.uint8), v[32 * (lanes // 32) + src % 32].view(np.uint8))


@pytest.mark.parametrize("width", [32, 8])
@pytest.mark.parametrize("delta", [0, 1, 3, 8])
def test_shfl_up_down_keep_own_value_outside_segment(ex, rng, width, delta):
    v = shfl_values(rng, "int", 64)
    up, down = np.zeros_like(v), np.zeros_like(v)
    ex.launch(FIDELITY, "fid_shfl_updown<int>", 1, 64, 0, fid_params(v, out0=up, out1=down, arg0=delta, arg1=width))
    lanes = np.arange(64)
    pos = lanes % width
    np.testing.assert_array_equal(up, np.where(pos - delta >= 0, v[lanes - delta], v))
    np.testing.assert_array_equal(down, np.where(pos + delta < width, v[np.minimum(lanes + delta, 63)], v))


# ---- cp.async ---------------------------------------------------------------------------------

SENTINEL = 0xA5A5A5A5
UNWRITTEN = 0xDEADBEEF


def cp_async_case(rng, threads):
    src = rng.integers(0, 2**32, threads * 12 + 4, dtype=np.uint64).astype(np.uint32)
    src_bytes = rng.choice(np.array([0, 1, 5, 15, 16], np.int32), size=(threads, 3))
    landed = np.zeros((threads, 12), np.uint32)
    src_u8 = src.view(np.uint8)
    for t in range(threads):
        for g in range(3):
            chunk = np.zeros(16, np.uint8)  # bytes past src_bytes are zero-filled
            chunk[: src_bytes[t, g]] = src_u8[48 * t + 16 * g:][: src_bytes[t, g]]
            landed[t, 4 * g: 4 * g + 4] = chunk.view(np.uint32)
    return src, src_bytes, landed


@pytest.mark.parametrize("n", [0, 1, 2])
@pytest.mark.parametrize("empty_groups", [0, 1])
def test_cp_async_wait_group_retires_all_but_n_most_recent_groups(ex, rng, n, empty_groups):
    threads = 64
    src, src_bytes, landed = cp_async_case(rng, threads)
    out0 = np.full((threads, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((threads, 12), np.uint32)
    ex.launch(FIDELITY, f"fid_cp_async<{n}>", 1, threads, 48 * threads,
              fid_params(src, src_bytes, out0=out0, out1=out1, arg2=empty_groups))
    # Groups G1..G3 and then `empty_groups` empty groups are committed: wait_group n
    # guarantees G1..G(k-n) with k = 3 + empty_groups.
    done = min(3, 3 + empty_groups - n)
    np.testing.assert_array_equal(out0[:, : 4 * done], landed[:, : 4 * done])
    assert (out0[:, 4 * done:] == UNWRITTEN).all()
    np.testing.assert_array_equal(out1, landed)


def test_cp_async_copies_land_only_at_their_wait(ex_nocheck, rng):
    # With 3 groups committed, wait_group 1 lands groups 1-2 but not group 3: a
    # premature read of group 3 sees what was in shared memory before.
    threads = 32
    src, src_bytes, landed = cp_async_case(rng, threads)
    out0 = np.zeros((threads, 12), np.uint32)
    out1 = np.zeros((threads, 12), np.uint32)
    ex_nocheck.launch(FIDELITY, "fid_cp_async<1>", 1, threads, 48 * threads,
                      fid_params(src, src_bytes, out0=out0, out1=out1, arg0=1))
    np.testing.assert_array_equal(out0[:, :8], landed[:, :8])
    assert (out0[:, 8:] == SENTINEL).all()
    np.testing.assert_array_equal(out1, landed)


def test_cp_async_read_before_wait_is_an_error(ex, rng):
    src, src_bytes, _ = cp_async_case(rng, 32)
    out0, out1 = np.zeros((32, 12), np.uint32), np.zeros((32, 12), np.uint32)
    with pytest.raises(EmulatorError, match="own cp.async into it is still in flight"):
        ex.launch(FIDELITY, "fid_cp_async<1>", 1, 32, 48 * 32, fid_params(src, src_bytes, out0=out0, out1=out1, arg0=1))


def test_cp_async_rejects_misaligned_source(ex, rng):
    src, src_bytes, _ = cp_async_case(rng, 32)
    out0, out1 = np.zeros((32, 12), np.uint32), np.zeros((32, 12), np.uint32)
    with pytest.raises(EmulatorError, match="source address .* is not 16-byte aligned"):
        ex.launch(FIDELITY, "fid_cp_async<0>", 1, 32, 48 * 32,
                  fid_params(src, src_bytes, out0=out0, out1=out1, arg1=4))


def test_cp_async_4_zero_fills(ex, rng):
    threads = 32
    src = rng.integers(1, 2**32, threads * 4, dtype=np.uint64).astype(np.uint32)
    src_bytes = rng.choice(np.array([0, 4], np.int32), size=(threads, 4))
    out = np.zeros((threads, 4), np.uint32)
    ex.launch(FIDELITY, "fid_cp_async_4", 1, threads, 16 * threads, fid_params(src, src_bytes, out0=out))
    np.testing.assert_array_equal(out, np.where(src_bytes == 4, src.reshape(threads, 4), 0))


# ---- exp2, packing ------------------------------------------------------------------------------

def test_exp2_approx_within_2_ulp_and_flushes_subnormals(ex, rng):
    x = np.concatenate([
        rng.uniform(-125, 127, 2000),
        [-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, -126.0, -126.5, -140.0, 127.99],
    ]).astype(np.float32)
    y = np.full_like(x, 7.0)
    ex.launch(FIDELITY, "fid_exp2", 4, 128, 0, fid_params(x, out0=y, n=x.size))
    exact = np.exp2(x.astype(np.float64))
    normal = np.isfinite(x) & (exact >= np.finfo(np.float32).tiny) & (exact < np.finfo(np.float32).max)
    ulp = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(y[normal] - exact[normal]) <= 2 * ulp)
    special = dict(zip(x[-11:].tolist(), y[-11:].tolist()))
    assert y[-11] == 0.0 and y[-10] == np.inf and np.isnan(y[-9])
    assert y[-8] == 1.0 and y[-7] == 1.0 and y[-6] == 1.0 and y[-5] == 1.0, special  # +-0, subnormal inputs -> 1
    assert y[-4] == np.float32(2.0**-126)
    assert y[-3] == 0.0 and y[-2] == 0.0 and not np.signbit(y[-3]), special  # subnormal results flush to +0


def test_pack_puts_first_element_in_low_half(ex, rng):
    x = rng.standard_normal(2 * 100).astype(np.float32)
    h, b = np.zeros(100, np.uint32), np.zeros(100, np.uint32)
    ex.launch(FIDELITY, "fid_pack", 1, 64, 0, fid_params(x, out0=h, out1=b, n=100))
    hb = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(h, hb[0::2] | (hb[1::2] << 16))
    bb = bf16_bits_rne(x).astype(np.uint32)
    np.testing.assert_array_equal(b, bb[0::2] | (bb[1::2] << 16))


# ---- planted bugs ---------------------------------------------------------------------------------

def run_planted(executor, name, threads=128, smem=None, arg=0, blocks=1, inp=None):
    inp = np.random.default_rng(7).standard_normal(4 * threads * blocks).astype(np.float32) if inp is None else inp
    out = np.full(4 * threads * blocks, np.nan, np.float32)
    ticket = np.zeros(2 * threads + 1, np.int32)
    smem = 16 * threads if smem is None else smem
    executor.launch(PLANTED, name, blocks, threads, smem, planted_params(inp, out, ticket, threads, arg))
    return inp, out, ticket


def test_missing_syncthreads_is_a_read_after_write_race(ex):
    inp, out, _ = run_planted(ex, "neighbour_sum<true>")
    np.testing.assert_array_equal(out[:128], inp[:128] + np.roll(inp[:128], -1))
    with pytest.raises(EmulatorError, match=r"race \(read-after-write\).*thread \(\d+,0,0\).*thread \(\d+,0,0\)"):
        run_planted(ex, "neighbour_sum<false>")


def test_race_message_names_kernel_offset_and_source_line(ex):
    with pytest.raises(EmulatorError) as info:
        run_planted(ex, "neighbour_sum<false>")
    msg = str(info.value)
    assert "neighbour_sum<false>" in msg and "block (0,0,0)" in msg
    assert "of dynamic shared memory" in msg and "planted.cu:" in msg


def test_write_after_read_without_barrier_is_a_race(ex):
    inp, out, _ = run_planted(ex, "rotate_in_place<true>")
    np.testing.assert_array_equal(out[:128], 2 * np.roll(inp[:128], -1))
    with pytest.raises(EmulatorError, match="race"):
        run_planted(ex, "rotate_in_place<false>")


def test_syncwarp_orders_shared_memory_within_a_warp(ex):
    inp, out, _ = run_planted(ex, "warp_exchange<true>")
    np.testing.assert_array_equal(out[:128], inp[np.arange(128) ^ 1])
    with pytest.raises(EmulatorError, match="race"):
        run_planted(ex, "warp_exchange<false>")


def test_missing_syncthreads_gives_wrong_data_without_the_race_check(ex_nocheck):
    inp, out, _ = run_planted(ex_nocheck, "neighbour_sum<false>")
    assert not np.array_equal(out[:128], inp[:128] + np.roll(inp[:128], -1))


def test_missing_cp_async_wait_is_detected(ex, ex_nocheck):
    inp, out, _ = run_planted(ex, "cp_async_neighbour<true>")
    np.testing.assert_array_equal(out[:512], np.roll(inp[:512], -4))
    with pytest.raises(EmulatorError, match="cp.async in flight"):
        run_planted(ex, "cp_async_neighbour<false>")
    # Without the race check the copies never land: the data read is the poison,
    # and the thread exits with copies pending.
    out = np.full(512, 1.0, np.float32)
    inp = np.random.default_rng(7).standard_normal(512).astype(np.float32)
    with pytest.raises(EmulatorError, match="never waited for"):
        ex_nocheck.launch(PLANTED, "cp_async_neighbour<false>", 1, 128, 2048, planted_params(inp, out, None, 128))
    assert np.isnan(out).any()


def test_cp_async_wait_without_barrier_is_a_race(ex):
    with pytest.raises(EmulatorError, match="race"):
        run_planted(ex, "cp_async_no_barrier")


def test_barrier_in_divergent_code_is_reported_not_hung(ex):
    t0 = time.perf_counter()
    with pytest.raises(EmulatorError, match=r"different __syncthreads\(\) calls.*threads 0-31.*threads 32-127"):
        run_planted(ex, "divergent_barrier")
    assert time.perf_counter() - t0 < 10


def test_block_barrier_never_satisfies_a_warp_collective(ex):
    with pytest.raises(EmulatorError, match=r"deadlock.*threads 16-31 wait at __shfl_xor_sync"):
        run_planted(ex, "barrier_vs_shuffle")


def test_warp_collective_with_exited_lanes_is_an_error(ex):
    with pytest.raises(EmulatorError, match="exit"):
        run_planted(ex, "shuffle_after_exit")


def test_different_warp_collectives_in_one_warp_are_an_error(ex):
    with pytest.raises(EmulatorError, match="divergent warp collective|deadlock"):
        run_planted(ex, "divergent_collectives")


def test_misaligned_vector_access_to_global_memory_is_an_error(ex):
    # x86 loads 16 bytes from any address; a GPU stops the kernel (misaligned address)
    inp, out, _ = run_planted(ex, "vector_copy")
    np.testing.assert_array_equal(out[:4 * 127], inp[:4 * 127])
    with pytest.raises(EmulatorError, match=r"misaligned access: thread \(\d+,0,0\).* reads 16 bytes at address "
                                            r"0x[0-9a-f]+, which is not 16-byte aligned"):
        run_planted(ex, "vector_copy", arg=1)


def test_one_mma_reached_at_two_call_sites_in_a_warp_is_an_error(ex):
    # mma.sync.aligned: the same operation from two instructions is still divergent
    _, out, _ = run_planted(ex, "divergent_mma<false>")   # split by warp: fine
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:128], out[128:256])
    with pytest.raises(EmulatorError, match="divergent .aligned warp collective.*same instruction"):
        run_planted(ex, "divergent_mma<true>")


def test_out_of_bounds_shared_access_is_an_error(ex):
    inp, out, _ = run_planted(ex, "smem_out_of_bounds", smem=4 * 128, arg=0)
    np.testing.assert_array_equal(out[:128], inp[:128])
    with pytest.raises(EmulatorError, match="out-of-bounds shared-memory access.*offset 512"):
        run_planted(ex, "smem_out_of_bounds", smem=4 * 128, arg=1)


def test_crashes_in_kernel_code_become_errors(ex, ex_nocheck):
    for executor in (ex, ex_nocheck):
        with pytest.raises(EmulatorError, match=r"crashed with SIGSEGV.*planted.cu:\d+"):
            run_planted(executor, "wild_global_write", threads=32, arg=1 << 20)
        with pytest.raises(EmulatorError, match="overflowed its 256 KiB stack"):
            run_planted(executor, "stack_overflow", threads=32)
    _, out, _ = run_planted(ex, "neighbour_sum<true>")  # the emulator still works afterwards
    assert np.isfinite(out[:128]).all()


def test_thread_order_changes_with_seed_but_results_do_not():
    orders, sums = [], []
    inp = np.random.default_rng(3).standard_normal(4 * 128 * 3).astype(np.float32)
    for seed in range(3):
        e = EmulatorExecutor(seed=seed)
        _, _, ticket = run_planted(e, "order_probe")
        orders.append(ticket[:256].copy())
        _, out, _ = run_planted(e, "block_sum", blocks=3, smem=4 * 128 + 4 * 4, inp=inp)
        sums.append(out[:6].copy())
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    for o in orders:  # each is a permutation per phase: the barrier separates the phases
        assert sorted(o[:128]) == list(range(128)) and sorted(o[128:]) == list(range(128, 256))
    for s in sums[1:]:
        np.testing.assert_array_equal(s, sums[0])
    expected = inp[: 128 * 3].reshape(3, 128).astype(np.float64).sum(1)
    np.testing.assert_allclose(sums[0][0::2], expected, rtol=1e-5)
    np.testing.assert_allclose(sums[0][1::2], expected, rtol=1e-5)
    _, _, ticket = run_planted(EmulatorExecutor(shuffle=False), "order_probe")
    np.testing.assert_array_equal(ticket[:256], np.arange(256))


def test_shuffled_launches_place_shared_memory_off_1024_byte_boundaries():
    # the wgmma kernels align their tiles themselves (swizzle atoms of 1024 bytes); a
    # GPU need not start dynamic shared memory on such a boundary, and neither does a
    # shuffled launch here, so their alignment code runs on the emulator too
    windows = set()
    for seed in range(6):
        _, out, _ = run_planted(EmulatorExecutor(seed=seed), "shared_window", smem=16 * 128)
        window = int(out[0])
        np.testing.assert_array_equal(out[:128], window + 16 * np.arange(128))
        assert window % 16 == 0 and 16 <= window <= 1008
        windows.add(window)
    assert len(windows) > 1
    _, out, _ = run_planted(EmulatorExecutor(shuffle=False), "shared_window", smem=16 * 128)
    assert out[0] == 0


@pytest.mark.parametrize("sign", ["mixed", "positive"])
def test_block_and_warp_votes(ex, sign):
    inp = np.random.default_rng(8).standard_normal(512).astype(np.float32)
    if sign == "positive":
        inp = np.abs(inp) + 1
    inp[32:64] = 1.0  # warp 1 all true
    inp[64:96] = -1.0  # warp 2 all false
    _, out, ticket = run_planted(ex, "block_votes", inp=inp)
    pred = inp[:128] > 0
    out = out.reshape(-1, 4)[:128]
    np.testing.assert_array_equal(out[:, 0], pred.sum())
    np.testing.assert_array_equal(out[:, 1], pred.all())
    np.testing.assert_array_equal(out[:, 2], pred.any())
    for w in range(4):
        p = pred[32 * w: 32 * w + 32]
        np.testing.assert_array_equal(out[32 * w: 32 * w + 32, 3], p.all() + 2 * p.any())
        ballot = sum(1 << i for i in range(32) if p[i])
        np.testing.assert_array_equal(ticket[32 * w: 32 * w + 32].view(np.uint32), ballot)


def test_concurrent_launches_from_threads_are_independent(ex):
    results, errors = {}, []

    def work(i):
        try:
            inp = np.random.default_rng(100 + i).standard_normal(4 * 128 * 2).astype(np.float32)
            for _ in range(3):
                _, out, _ = run_planted(ex, "block_sum", blocks=2, smem=4 * 128 + 16, inp=inp)
            results[i] = (inp, out)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for inp, out in results.values():
        np.testing.assert_allclose(out[0:4:2], inp[:256].reshape(2, 128).sum(1), rtol=1e-5)


# ---- launch validation and build errors --------------------------------------------------------------

def test_bad_launches_are_rejected(ex):
    x = np.zeros(4096, np.float32)
    p = planted_params(x, x, None, 0)
    with pytest.raises(EmulatorError, match="block"):
        ex.launch(PLANTED, "neighbour_sum<true>", 1, 1025, 0, p)
    with pytest.raises(EmulatorError, match="dynamic shared memory"):
        ex.launch(PLANTED, "neighbour_sum<true>", 1, 32, 200 * 1024, p)
    with pytest.raises(TypeError, match="align=True"):
        ex.launch(PLANTED, "neighbour_sum<true>", 1, 32, 128, np.zeros((), dtype=[("a", "u8"), ("b", "i4")])[()])
    with pytest.raises(TypeError, match="structured"):
        ex.launch(PLANTED, "neighbour_sum<true>", 1, 32, 128, b"\0" * 32)
    short = np.zeros((), dtype=np.dtype([("inp", "u8"), ("out", "u8")], align=True))[()]
    with pytest.raises(EmulatorError, match="sizeof 32"):
        ex.launch(PLANTED, "neighbour_sum<true>", 1, 32, 128, short)


def test_compile_errors_carry_the_compiler_message(ex):
    with pytest.raises(EmulatorBuildError, match="no_such_kernel"):
        ex.compile(PLANTED, ["no_such_kernel<3>"])


def test_static_shared_variables_are_rejected_at_compile_time(ex, tmp_path):
    src = tmp_path / "static_shared.cu"
    src.write_text(
        '#include "ptx.cuh"\nstruct P { float* out; };\n'
        "__global__ void k(const P p) { __shared__ float s[32]; s[threadIdx.x] = 1; p.out[0] = s[0]; }\n"
    )
    with pytest.raises(EmulatorBuildError, match=r"cf::dynamic_smem\(\)"):
        ex.compile(str(src), ["k"])


def test_missing_compiler_is_reported(monkeypatch):
    from cupyflash.emulator import _build

    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    _build.find_toolchain.cache_clear()
    try:
        ok, reason = emulator_available()
    finally:
        _build.find_toolchain.cache_clear()
    assert not ok and "no GCC" in reason


def test_modules_are_cached_on_disk(tmp_path):
    first = ModuleCache(tmp_path)
    m1 = first.module_for(PLANTED, ["block_sum"], instrument=False)
    t0 = time.perf_counter()
    m2 = ModuleCache(tmp_path).module_for(PLANTED, ["block_sum"], instrument=False)
    assert m2.path == m1.path and time.perf_counter() - t0 < 1.0
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("build-*"))


def test_modules_are_built_against_the_precompiled_emulation_header(tmp_path):
    # One cuda_emu.h.gch per flag set (plain, race-checked), and GCC takes it: its -H
    # trace marks a precompiled header it used with '!' (one it rejected, with 'x').
    import subprocess

    from cupyflash.emulator import _build

    cache = ModuleCache(tmp_path)
    for instrument in (False, True):
        cache.module_for(PLANTED, ["block_sum"], instrument=instrument)
    assert len(list(tmp_path.glob("pch-*/cuda_emu.h.gch"))) == 2
    tc = _build.find_toolchain()
    flags = list(_build._MODULE_FLAGS)
    pch_dir = cache.precompiled_header(tc, flags)
    (tmp_path / "tu.cpp").write_text('#include "cuda_emu.h"\nint x;\n')
    done = subprocess.run([tc.cxx, *flags, "-H", "-fsyntax-only", f"-I{pch_dir}", *_build._include_options(tc),
                           str(tmp_path / "tu.cpp")], capture_output=True, text=True, check=True)
    assert f"! {pch_dir / 'cuda_emu.h.gch'}" in done.stderr, done.stderr[:2000]


# ---- end to end: an FA2-style forward built from every instruction ------------------------------------

def toy_attention(executor, bug=False, heads=2, L=128):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((heads, L, 64)).astype(np.float16) for _ in range(3))
    o = np.full((heads, L, 64), np.nan, np.float32)
    scale = 1 / np.sqrt(64)
    p = np.array((ptr(q), ptr(k), ptr(v), ptr(o), L, scale * np.log2(np.e)), dtype=TOY_DTYPE)[()]
    executor.launch(TOY, f"toy_attention<{'false' if bug else 'true'}>", (L // 64, heads), 128, 5 * 64 * 64 * 2, p)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k.astype(np.float64)) * scale
    pr = np.exp(s - s.max(-1, keepdims=True))
    return o, (pr / pr.sum(-1, keepdims=True)) @ v.astype(np.float64)


def test_toy_flash_attention_forward_matches_numpy_and_is_fast(tmp_path, monkeypatch):
    # Compile (fresh cache) and run: grid (2 q-blocks x 2 heads), 128 threads, L=128, d=64.
    import cupyflash.emulator._executor as executor_module

    monkeypatch.setattr(executor_module, "_CACHE", ModuleCache(tmp_path))
    t0 = time.perf_counter()
    o, ref = toy_attention(EmulatorExecutor(seed=11))
    elapsed = time.perf_counter() - t0
    np.testing.assert_allclose(o, ref, atol=2e-3, rtol=2e-3)
    assert elapsed < 30, f"emulated forward took {elapsed:.1f} s including the build"


def test_toy_flash_attention_missing_prefetch_wait_is_detected(ex, ex_nocheck):
    with pytest.raises(EmulatorError, match="cp.async"):
        toy_attention(ex, bug=True)
    o, ref = toy_attention(ex_nocheck, bug=True)
    assert not np.allclose(o, ref, atol=2e-3, equal_nan=False)


# ---- Tier 1: the same micro-kernels on a GPU agree with the emulator ------------------------------------

def _fidelity_case(name, rng):
    """Inputs, output templates, scalars and comparison mode for one fidelity kernel."""
    lanes = 64
    if name == "fid_mma_f64":
        ins = [rng.standard_normal(lanes), rng.standard_normal(lanes), rng.standard_normal((lanes, 2))]
        return {"ins": ins, "outs": [np.zeros((lanes, 2))], "block": lanes, "smem": 0, "scalars": {},
                "mode": "mma"}
    if name.startswith("fid_mma"):
        normal = rng.standard_normal
        if name == "fid_mma_tf32":
            ins = [normal((lanes, 4)).astype(np.float32), normal((lanes, 2)).astype(np.float32)]
        else:
            def bits(n):
                if name == "fid_mma_f16":
                    return normal(n).astype(np.float16).view(np.uint16)
                return bf16_bits_rne(normal(n).astype(np.float32))

            ins = [pack_pairs(bits(lanes * 8)).reshape(lanes, 4), pack_pairs(bits(lanes * 4)).reshape(lanes, 2)]
        ins.append(rng.standard_normal((lanes, 4)).astype(np.float32))
        outs = [np.zeros((lanes, 4), np.float32), np.zeros((lanes, 6), np.uint32)]
        return {"ins": ins, "outs": outs, "block": lanes, "smem": 0, "scalars": {}, "mode": "mma"}
    if name.startswith("fid_ldmatrix"):
        num = int(name.split("<")[1].split(",")[0])
        smem = rng.integers(0, 2**16, 2048, dtype=np.uint16)
        offsets = (rng.permutation(256)[:lanes] * 16).astype(np.int32)
        return {"ins": [smem, offsets], "outs": [np.zeros((lanes, num), np.uint32)], "block": lanes, "smem": 4096,
                    "scalars": {"n": 4096}, "mode": "exact"}
    if name.startswith("fid_shfl"):
        ctype = name.split("<")[1].rstrip(">")
        v = shfl_values(rng, ctype, lanes)
        src = rng.integers(0, 64, lanes).astype(np.int32)
        return {"ins": [v, src], "outs": [np.zeros_like(v), np.zeros_like(v)], "block": lanes, "smem": 0,
                    "scalars": {"arg0": 3, "arg1": 8}, "mode": "exact"}
    if name.startswith("fid_cp_async<"):
        src, src_bytes, _ = cp_async_case(rng, lanes)
        outs = [np.full((lanes, 12), UNWRITTEN, np.uint32), np.zeros((lanes, 12), np.uint32)]
        return {"ins": [src, src_bytes], "outs": outs, "block": lanes, "smem": 48 * lanes, "scalars": {"arg2": 1},
                    "mode": "exact"}
    if name == "fid_cp_async_4":
        src = rng.integers(1, 2**32, lanes * 4, dtype=np.uint64).astype(np.uint32)
        src_bytes = rng.choice(np.array([0, 4], np.int32), size=(lanes, 4))
        return {"ins": [src, src_bytes], "outs": [np.zeros((lanes, 4), np.uint32)], "block": lanes, "smem": 16 * lanes,
                    "scalars": {}, "mode": "exact"}
    n = 1000
    x = np.concatenate([rng.uniform(-125, 127, n - 6), [-np.inf, np.inf, 0.0, 1e-40, -126.5, -140.0]])
    x = x.astype(np.float32)
    if name == "fid_pack":
        x = np.concatenate([x, x[::-1]])
    outs = {"fid_exp2": [np.zeros(n, np.float32)], "fid_pack": [np.zeros(n, np.uint32)] * 2,
            "fid_to_tf32": [np.zeros(n, np.uint32)]}[name]
    return {"ins": [x], "outs": [o.copy() for o in outs], "block": 128, "smem": 0, "scalars": {"n": n},
                "mode": "ulp2" if name == "fid_exp2" else "exact"}


@pytest.mark.gpu
@pytest.mark.parametrize("name", FIDELITY_KERNELS)
def test_fidelity_kernels_on_the_device_agree_with_the_emulator(ex, name):
    import cupy

    from cupyflash._loader import CudaExecutor

    case = _fidelity_case(name, np.random.default_rng(99))
    ins = case["ins"] + [None] * (3 - len(case["ins"]))
    outs = case["outs"] + [None] * (2 - len(case["outs"]))

    def run(executor, to_array, pointer):
        arrays_in = [None if a is None else to_array(a) for a in ins]
        arrays_out = [None if a is None else to_array(a) for a in outs]
        fields = [pointer(a) for a in arrays_in + arrays_out]
        s = case["scalars"]
        p = np.array((*fields, s.get("n", 0), s.get("arg0", 0), s.get("arg1", 0), s.get("arg2", 0)),
                     dtype=FID_DTYPE)[()]
        executor.launch(FIDELITY, name, 1, case["block"], case["smem"], p)
        return [None if a is None else (a.get() if hasattr(a, "get") else a) for a in arrays_out]

    emulated = run(ex, lambda a: a.copy(), lambda a: 0 if a is None else a.ctypes.data)
    device = run(CudaExecutor(synchronize=True), cupy.asarray, lambda a: 0 if a is None else a.data.ptr)
    for e, d in zip(emulated, device):
        if e is None:
            continue
        if case["mode"] == "mma" and e.dtype == np.float32:
            np.testing.assert_allclose(d, e, rtol=1e-5, atol=1e-5)  # accumulation order is unspecified
        elif case["mode"] == "mma" and e.dtype == np.float64:
            np.testing.assert_allclose(d, e, rtol=1e-14, atol=1e-14)
        elif case["mode"] == "ulp2":
            finite = np.isfinite(e) & (e != 0)
            assert np.all(np.abs(d[finite] - e[finite]) <= 2 * np.spacing(np.abs(e[finite])))
            np.testing.assert_array_equal(d[~finite], e[~finite])
        else:
            np.testing.assert_array_equal(d.view(np.uint8), e.view(np.uint8))
