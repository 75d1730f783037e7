"""An independent cross-check of the emulator: a second, deliberately simple NumPy model
of every emulated instruction, held against the emulator running cuda_src/fidelity.cu.

The models are written from shared/reference/ptx-fragments.md alone, in the
opposite direction to tests/test_emulator.py: that file builds each lane's
registers from known matrices; here random *registers* (bit patterns) go in,
the model scatters them into the logical matrices with the per-lane
element-index formulas (``a[i] <-> (row, col)``), computes, and gathers the
result back into lanes.  ldmatrix is modelled from the CuTe bit-index picture
of section 4 ("32 rows x 128 bits"), not from the element table; the shuffles
from the segment rule in prose, not from the ``segmask`` formula; cp.async
from the group-counting rule of section 6.

Each model takes a ``plant`` argument naming a deliberate layout error (the
two halves of a packed register swapped, g and t swapped, A's second row block
and second column block swapped, DMMA's B read like its A or its C pair
swapped, ``.trans`` ignored, the shuffle width
ignored, wait_group counting from the oldest group, no zero-fill).  The
faithful model must agree with the emulator; every planted one must
disagree, which shows the comparison can see a layout error at all.

The emulator runs with the race check on (the modules test_emulator.py builds,
so nothing is compiled twice); the one case that reads cp.async copies still in
flight needs the unchecked modules.  In the ``gpu`` tier the faithful models are
also held against the device.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupyflash.emulator import EmulatorExecutor, emulator_available

from _emulator_util import FID_DTYPE, FIDELITY_KERNELS

AVAILABLE, REASON = emulator_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU emulator unavailable: {REASON}")

FIDELITY = "fidelity.cu"
WARPS = 4                      # several warps: a model works warp by warp
LANES = 32 * WARPS
SENTINEL = 0xA5A5A5A5          # fid_cp_async's shared-memory fill
UNWRITTEN = 0xDEADBEEF         # our fill of output words the kernel must not write


# ---- running a fidelity micro-kernel ----------------------------------------------------------


@pytest.fixture(scope="module")
def checked():
    e = EmulatorExecutor(arch=80, seed=7, shuffle=True, race_check=True)
    e.compile(FIDELITY, FIDELITY_KERNELS)
    return e


@pytest.fixture(scope="module")
def unchecked():
    e = EmulatorExecutor(arch=80, seed=7, shuffle=True, race_check=False)
    e.compile(FIDELITY, FIDELITY_KERNELS)
    return e


@pytest.fixture(scope="module", params=["emulator", pytest.param("cuda", marks=pytest.mark.gpu)])
def run(request, checked):
    """``run(name, ins, outs, smem=0, **scalars)`` -> the output arrays, on the emulator or a GPU."""
    if request.param == "emulator":
        return lambda name, ins, outs, smem=0, **scalars: launch(checked, name, ins, outs, smem, scalars)
    import cupy

    from cupyflash._loader import CudaExecutor

    device = CudaExecutor(synchronize=True)

    def on_device(name, ins, outs, smem=0, **scalars):
        ins_d = [cupy.asarray(a) for a in ins]
        outs_d = [cupy.asarray(a) for a in outs]
        launch(device, name, ins_d, outs_d, smem, scalars)
        for host, dev in zip(outs, outs_d):   # filled in place, as on the emulator
            host[...] = cupy.asnumpy(dev)
        return outs

    return on_device


def _pointer(a):
    if a is None:
        return 0
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def launch(executor, name, ins, outs, smem, scalars):
    """One block of LANES threads running ``name``; returns ``outs`` (filled)."""
    ins = list(ins) + [None] * (3 - len(ins))
    slots = list(outs) + [None] * (2 - len(outs))
    params = np.array((*(_pointer(a) for a in ins + slots), scalars.get("n", 0), scalars.get("arg0", 0),
                       scalars.get("arg1", 0), scalars.get("arg2", 0)), dtype=FID_DTYPE)[()]
    executor.launch(FIDELITY, name, 1, LANES, smem, params)
    return outs


def random_words(rng, shape):
    return rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)


# ---- mma.sync m16n8k16 (f16, bf16): registers -> matrices -> D -> registers ----------------------

# Section 1: element i of a lane's A fragment is register i // 2, low half for even i.
def _a_16816_position(i, g, t, plant):
    """(row, col) of A element a_i (section 1 table), with an optional planted error."""
    if plant == "rows_and_column_blocks_swapped":       # a2,a3 <-> a4,a5: reading the table by columns
        i = {2: 4, 3: 5, 4: 2, 5: 3}.get(i, i)
    row = g + (8 if i in (2, 3, 6, 7) else 0)
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def _halves(word, swapped=False):
    lo, hi = word & 0xFFFF, word >> 16
    return (hi, lo) if swapped else (lo, hi)


def _lane_grid(plant):
    lane = np.arange(32)
    if plant == "g_t_swapped":          # lane = 8t + g instead of 4g + t
        return lane & 7, lane >> 3
    return lane >> 2, lane & 3


def test_fragment_positions_reproduce_the_reference_spot_checks():
    # Section 1: lane 5 (g=1, t=1): a0=(1,2), a1=(1,3), a2=(9,2), a3=(9,3), a4=(1,10), ...
    assert [_a_16816_position(i, 1, 1, None) for i in range(8)] == [
        (1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    g, t = _lane_grid(None)
    assert (g[31], t[31]) == (7, 3) and (g[5], t[5]) == (1, 1)


def model_mma_16816(a_regs, b_regs, c, decode, plant=None):
    """D fragments of one warp per section 1: a_regs (32, 4), b_regs (32, 2) b32, c (32, 4) f32.

    ``decode`` turns 16-bit patterns into float64 (f16 or bf16).
    """
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    C = np.full((16, 8), np.nan)
    G, T = _lane_grid(plant)
    for lane in range(32):
        g, t = G[lane], T[lane]
        for i in range(8):
            half = _halves(int(a_regs[lane, i // 2]), plant == "a_halves_swapped")[i & 1]
            A[_a_16816_position(i, g, t, plant)] = decode(half)
        for i in range(4):                       # b_i: row 2t + (i&1) + 8 (i>=2), col g
            half = _halves(int(b_regs[lane, i // 2]))[i & 1]
            B[2 * t + (i & 1) + (8 if i >= 2 else 0), g] = decode(half)
        for i in range(4):                       # c_i: row g + 8 (i>=2), col 2t + (i&1)
            C[g + (8 if i >= 2 else 0), 2 * t + (i & 1)] = c[lane, i]
    assert not np.isnan(A).any() and not np.isnan(B).any(), "the model's map must cover every element"
    D = A @ B + C
    return np.array([[D[G[lane] + (8 if i >= 2 else 0), 2 * T[lane] + (i & 1)] for i in range(4)]
                     for lane in range(32)])


def decode_f16(bits):
    return float(np.array(bits, np.uint16).view(np.float16))


def decode_bf16(bits):
    return float(np.array(bits << 16, np.uint32).view(np.float32))


def random_half_words(rng, shape, kind):
    """b32 words of two finite 16-bit values of moderate size (no NaN/Inf patterns)."""
    x = rng.standard_normal(shape + (2,)).astype(np.float32)
    if kind == "f16":
        bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        bits = x.view(np.uint32) >> 16            # truncation: any bf16 pattern will do
    return bits[..., 0] | (bits[..., 1] << 16)


def per_warp(model, *arrays, **kw):
    """Apply a one-warp model to each warp's 32 lanes of lane-major arrays."""
    return np.concatenate([model(*(a[32 * w: 32 * w + 32] for a in arrays), **kw) for w in range(WARPS)])


# Swapping the halves of A's *and* B's registers permutes k the same way in both
# operands and leaves D unchanged: no mma can show it, so the plant is in A alone.
MMA_PLANTS = ["a_halves_swapped", "g_t_swapped", "rows_and_column_blocks_swapped"]


@pytest.fixture(scope="module", params=["f16", "bf16"])
def mma_case(request, run):
    kind = request.param
    rng = np.random.default_rng(1 if kind == "f16" else 2)
    a = random_half_words(rng, (LANES, 4), kind)
    b = random_half_words(rng, (LANES, 2), kind)
    c = rng.standard_normal((LANES, 4)).astype(np.float32)
    d = np.full((LANES, 4), np.nan, np.float32)
    run(f"fid_mma_{kind}", [a, b, c], [d])
    return kind, a, b, c, d


def mma_agrees(d, expected):
    # The accumulation order is unspecified (section 1): float32 rounding of the sum.
    return d.shape == expected.shape and np.allclose(d, expected, rtol=1e-5, atol=1e-5)


def test_mma_m16n8k16_model_agrees(mma_case):
    kind, a, b, c, d = mma_case
    decode = decode_f16 if kind == "f16" else decode_bf16
    assert mma_agrees(d, per_warp(model_mma_16816, a, b, c, decode=decode))


@pytest.mark.parametrize("plant", MMA_PLANTS)
def test_mma_m16n8k16_planted_model_errors_are_caught(mma_case, plant):
    kind, a, b, c, d = mma_case
    decode = decode_f16 if kind == "f16" else decode_bf16
    assert not mma_agrees(d, per_warp(model_mma_16816, a, b, c, decode=decode, plant=plant))


# ---- mma.sync m16n8k8 tf32 ----------------------------------------------------------------------


def tf32_round(x):
    """cvt.rna.tf32.f32 in plain arithmetic: 10 fraction bits, nearest, ties away from zero."""
    x = np.asarray(x, np.float64)
    exponent = np.floor(np.log2(np.abs(x)))
    ulp = 2.0 ** (exponent - 10)
    return np.sign(x) * np.floor(np.abs(x) / ulp + 0.5) * ulp


def model_mma_1688_tf32(a_in, b_in, c, plant=None):
    """Section 2: a0 (g,t), a1 (g+8,t), a2 (g,t+4), a3 (g+8,t+4); b0 (t,g), b1 (t+4,g); C as section 1.

    Returns (D (32, 4), the tf32 registers (32, 6) as float64 values).
    """
    A = np.full((16, 8), np.nan)
    B = np.full((8, 8), np.nan)
    C = np.full((16, 8), np.nan)
    G, T = _lane_grid(plant)
    a_pos = [(0, 0), (8, 0), (0, 4), (8, 4)]
    if plant == "f16_a_order":        # the gotcha of section 2: f16 m16n8k8 order (a1 = (g, t+4))
        a_pos = [(0, 0), (0, 4), (8, 0), (8, 4)]
    ra, rb = tf32_round(a_in), tf32_round(b_in)
    for lane in range(32):
        g, t = G[lane], T[lane]
        for i, (dr, dc) in enumerate(a_pos):
            A[g + dr, t + dc] = ra[lane, i]
        B[t, g], B[t + 4, g] = rb[lane, 0], rb[lane, 1]
        for i in range(4):
            C[g + (8 if i >= 2 else 0), 2 * t + (i & 1)] = c[lane, i]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B + C
    d = np.array([[D[G[lane] + (8 if i >= 2 else 0), 2 * T[lane] + (i & 1)] for i in range(4)]
                  for lane in range(32)])
    return d, np.concatenate([ra, rb], axis=1)


@pytest.fixture(scope="module")
def tf32_case(run):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((LANES, 4)).astype(np.float32)
    b = rng.standard_normal((LANES, 2)).astype(np.float32)
    a[0, 0] = np.float32(1 + 2**-11)          # a tie: rounds away from zero to 1 + 2^-10
    a[1, 0] = np.float32(-(1 + 3 * 2**-11))   # a tie: -(1 + 2^-9)
    c = rng.standard_normal((LANES, 4)).astype(np.float32)
    d = np.full((LANES, 4), np.nan, np.float32)
    regs = np.zeros((LANES, 6), np.uint32)
    run("fid_mma_tf32", [a, b, c], [d, regs])
    return a, b, c, d, regs


def test_mma_m16n8k8_tf32_model_agrees(tf32_case):
    a, b, c, d, regs = tf32_case
    d_model = per_warp(lambda *x: model_mma_1688_tf32(*x)[0], a, b, c)
    regs_model = per_warp(lambda *x: model_mma_1688_tf32(*x)[1], a, b, c)
    assert mma_agrees(d, d_model)
    np.testing.assert_array_equal(regs.view(np.float32).astype(np.float64), regs_model)
    assert regs.view(np.float32)[0, 0] == 1 + 2**-10 and regs.view(np.float32)[1, 0] == -(1 + 2**-9)
    assert (regs & 0x1FFF == 0).all()


@pytest.mark.parametrize("plant", ["f16_a_order", "g_t_swapped"])
def test_mma_m16n8k8_tf32_planted_model_errors_are_caught(tf32_case, plant):
    a, b, c, d, _ = tf32_case
    assert not mma_agrees(d, per_warp(lambda *x: model_mma_1688_tf32(*x, plant=plant)[0], a, b, c))


# ---- mma.sync m8n8k4 .f64 (DMMA): section 3 -----------------------------------------------------------

def model_mma_884_f64(a, b, c, plant=None):
    """Section 3: a0 = A[g][t], b0 = B[t][g], c0/c1 = C[g][2t], C[g][2t+1] (D likewise)."""
    A, B, C = np.full((8, 4), np.nan), np.full((4, 8), np.nan), np.full((8, 8), np.nan)
    G, T = _lane_grid(plant)
    for lane in range(32):
        g, t = G[lane], T[lane]
        A[g, t] = a[lane]
        if plant == "b_like_a":           # reading B's fragment as A's: b0 = B[g][t] is not even 4 x 8
            B[t, g] = b[(4 * t + g) % 32]
        else:
            B[t, g] = b[lane]
        cols = (2 * t + 1, 2 * t) if plant == "c_pair_swapped" else (2 * t, 2 * t + 1)
        C[g, cols[0]], C[g, cols[1]] = c[lane]
    D = A @ B + C
    return np.array([[D[G[lane], 2 * T[lane] + e if plant != "c_pair_swapped" else 2 * T[lane] + 1 - e]
                      for e in range(2)] for lane in range(32)])


@pytest.fixture(scope="module")
def dmma_case(run):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(LANES), rng.standard_normal(LANES)
    c = rng.standard_normal((LANES, 2))
    d = np.full((LANES, 2), np.nan)
    run("fid_mma_f64", [a, b, c], [d])
    return a, b, c, d


def dmma_agrees(d, expected):
    # double FMAs in some order: a few ulps of the sum of four products and C
    return d.shape == expected.shape and np.allclose(d, expected, rtol=1e-14, atol=1e-14)


def test_mma_m8n8k4_f64_model_agrees(dmma_case):
    a, b, c, d = dmma_case
    assert dmma_agrees(d, per_warp(model_mma_884_f64, a, b, c))


@pytest.mark.parametrize("plant", ["g_t_swapped", "b_like_a", "c_pair_swapped"])
def test_mma_m8n8k4_f64_planted_model_errors_are_caught(dmma_case, plant):
    a, b, c, d = dmma_case
    assert not dmma_agrees(d, per_warp(model_mma_884_f64, a, b, c, plant=plant))


# ---- ldmatrix: the CuTe bit-index picture ------------------------------------------------------------


def model_ldmatrix(smem_bytes, row_offsets, num, trans, plant=None):
    """Section 4, CuTe form: matrix i row r is the 128 bits at the address of lane 8i + r;
    the 32 x 128-bit picture has row 8i + r.

    - LDSM_N: (lane L, bit b of reg i) <- picture row 8i + L/4, bits (L%4)*32 + b;
    - LDSM_T: (lane L, half h of reg i, bit b') <- row 8i + 2(L%4) + h, bits (L/4)*16 + b'.
    """
    trans = (not trans) if plant == "trans_ignored_or_applied" else trans
    picture = np.zeros((32, 128), np.uint8)                 # bits, little-endian within the row
    for i in range(num):
        for r in range(8):
            off = int(row_offsets[8 * i + r])
            picture[8 * i + r] = np.unpackbits(smem_bytes[off:off + 16], bitorder="little")
    G, T = _lane_grid(plant)
    out = np.zeros((32, num), np.uint32)
    weights = (1 << np.arange(16)).astype(np.uint32)
    for lane in range(32):
        g, t = G[lane], T[lane]
        for i in range(num):
            if not trans:
                bits = picture[8 * i + g, 32 * t: 32 * t + 32]
                halves = [bits[:16], bits[16:]]
            else:
                halves = [picture[8 * i + 2 * t + h, 16 * g: 16 * g + 16] for h in (0, 1)]
            lo, hi = (int(h @ weights) for h in halves)
            if plant == "halves_swapped":
                lo, hi = hi, lo
            out[lane, i] = lo | (hi << 16)
    return out


LDMATRIX_CASES = [(n, tr) for n in (1, 2, 4) for tr in (False, True)]


@pytest.fixture(scope="module", params=LDMATRIX_CASES, ids=[f"x{n}{'.trans' if tr else ''}" for n, tr in LDMATRIX_CASES])
def ldmatrix_case(request, run):
    num, trans = request.param
    rng = np.random.default_rng(10 * num + trans)
    smem_bytes = 4096
    smem = random_words(rng, smem_bytes // 4)
    # Distinct, scattered, 16-byte aligned rows for every lane (lanes past 8*num hold
    # addresses too; their rows must not matter).
    offsets = (rng.permutation(smem_bytes // 16)[:LANES] * 16).astype(np.int32)
    out = np.zeros((LANES, num), np.uint32)
    run(f"fid_ldmatrix<{num}, {'true' if trans else 'false'}>", [smem, offsets], [out], smem=smem_bytes,
        n=smem_bytes)
    return num, trans, smem.view(np.uint8), offsets, out


def test_ldmatrix_model_agrees(ldmatrix_case):
    num, trans, smem, offsets, out = ldmatrix_case
    expected = per_warp(lambda o: model_ldmatrix(smem, o, num, trans), offsets)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("plant", ["halves_swapped", "g_t_swapped", "trans_ignored_or_applied"])
def test_ldmatrix_planted_model_errors_are_caught(ldmatrix_case, plant):
    num, trans, smem, offsets, out = ldmatrix_case
    planted = per_warp(lambda o: model_ldmatrix(smem, o, num, trans, plant=plant), offsets)
    assert not np.array_equal(out, planted)


# ---- shuffles ----------------------------------------------------------------------------------------


def model_shfl(values, mode, arg, width, plant=None):
    """One warp of __shfl_{xor,sync,up,down}_sync(full mask, v, arg, width), by the Programming
    Guide's prose: lanes form segments of ``width``; ``idx`` reads src mod width within the
    caller's segment; ``up``/``down`` keep their own value when the source leaves the segment;
    ``xor`` may read an earlier segment but a lane past its own segment's end returns its own.
    """
    if plant == "width_ignored":
        width = 32
    out = []
    for lane in range(32):
        start = lane - lane % width
        end = start + width - 1
        if mode == "xor":
            src = lane ^ arg
            if plant == "wrap_within_segment":      # the plausible misreading
                src = start + src % width
            elif src > end:
                src = lane
        elif mode == "idx":
            src = start + arg[lane] % width
        elif mode == "up":
            src = lane - arg if lane - arg >= start else lane
        else:
            src = lane + arg if lane + arg <= end else lane
        out.append(values[src])
    return np.stack(out)


SHFL_TYPES = {"float": np.float32, "int": np.int32, "double": np.float64, "__half2": np.uint32,
              "__nv_bfloat162": np.uint32}


def _shfl_values(rng, ctype):
    """Random values (floats finite, so that no NaN payload is at stake; the rest any bits)."""
    dtype = SHFL_TYPES[ctype]
    if dtype in (np.float32, np.float64):
        return (rng.standard_normal(LANES) * 1e3).astype(dtype)
    return random_words(rng, LANES).view(dtype)


def _same_bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# (mode, kernel, argument, width) cases; the argument of "idx" is drawn per lane.
SHFL_CASES = [("xor", 1, 32), ("xor", 5, 8), ("xor", 12, 8), ("xor", 3, 4), ("xor", 16, 16), ("xor", 7, 2),
              ("idx", None, 32), ("idx", None, 8), ("idx", None, 1), ("up", 3, 8), ("up", 1, 32),
              ("down", 3, 8), ("down", 9, 16)]


@pytest.mark.parametrize("ctype", list(SHFL_TYPES))
def test_shuffle_models_agree_for_every_type_and_width(run, ctype):
    rng = np.random.default_rng(len(ctype))
    for mode, arg, width in SHFL_CASES:
        v = _shfl_values(rng, ctype)
        out0, out1 = np.zeros_like(v), np.zeros_like(v)
        if mode == "idx":
            src = rng.integers(0, 64, LANES).astype(np.int32)
            run(f"fid_shfl_idx<{ctype}>", [v, src], [out0, out1], arg1=width)
            expected = per_warp(lambda x, s, w=width: model_shfl(x, "idx", s, w), v, src)
            full = per_warp(lambda x, s: model_shfl(x, "idx", s, 32), v, src)     # cf::shfl
        elif mode == "xor":
            run(f"fid_shfl_xor<{ctype}>", [v], [out0, out1], arg0=arg, arg1=width)
            expected = per_warp(lambda x, a=arg, w=width: model_shfl(x, "xor", a, w), v)
            full = per_warp(lambda x, a=arg: model_shfl(x, "xor", a, 32), v)      # cf::shfl_xor
        else:
            run(f"fid_shfl_updown<{ctype}>", [v], [out0, out1], arg0=arg, arg1=width)
            expected = per_warp(lambda x, a=arg, w=width: model_shfl(x, "up", a, w), v)
            full = per_warp(lambda x, a=arg, w=width: model_shfl(x, "down", a, w), v)   # out1: shfl_down
        assert _same_bits(out0, expected), (mode, arg, width)
        assert _same_bits(out1, full), (mode, arg, width)


@pytest.mark.parametrize("plant", ["width_ignored", "wrap_within_segment"])
def test_shuffle_planted_model_errors_are_caught(run, plant):
    rng = np.random.default_rng(5)
    v = _shfl_values(rng, "int")
    out0, out1 = np.zeros_like(v), np.zeros_like(v)
    run("fid_shfl_xor<int>", [v], [out0, out1], arg0=12, arg1=8)   # lanes 4-7 of a segment leave it
    assert _same_bits(out0, per_warp(lambda x: model_shfl(x, "xor", 12, 8), v))
    assert not _same_bits(out0, per_warp(lambda x: model_shfl(x, "xor", 12, 8, plant=plant), v))


# ---- cp.async: groups, wait_group N, zero-fill ----------------------------------------------------------


def model_cp_async_chunk(src_bytes_of_thread, n, plant=None):
    """Section 6: copy ``n`` source bytes, fill the rest of the 16 with zeros."""
    dst = np.zeros(16, np.uint8)
    dst[:n] = src_bytes_of_thread[:n]
    if plant == "no_zero_fill":
        dst[n:] = np.frombuffer(np.uint32(SENTINEL).tobytes() * 4, np.uint8)[n:]
    return dst


def model_cp_async(src, src_bytes, n_wait, empty_groups, in_flight_read, plant=None):
    """fid_cp_async<N>: per thread, groups G1..G3 (one 16-byte chunk each), then ``empty_groups``
    empty groups, then wait_group N: with k groups committed, G1..G(k-N) are complete.

    Returns (out0, out1) (words per thread): out0 holds the chunks the kernel may read after
    the wait (all 3 when ``in_flight_read``: the emulator shows the sentinel for copies still in
    flight, which land only at their wait); out1 all 3 chunks after wait_group 0.
    """
    threads = src_bytes.shape[0]
    k = 3 + empty_groups
    complete = k - n_wait if plant != "wait_counts_from_oldest" else n_wait
    src_u8 = src.view(np.uint8)
    out0 = np.full((threads, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((threads, 12), np.uint32)
    pending = max(n_wait - empty_groups, 0)
    readable = 3 if in_flight_read else 3 - min(pending, 3)       # the kernel's own arithmetic
    for t in range(threads):
        chunks = [model_cp_async_chunk(src_u8[48 * t + 16 * g:], int(src_bytes[t, g]), plant) for g in range(3)]
        for g in range(3):
            words = chunks[g].view(np.uint32)
            out1[t, 4 * g: 4 * g + 4] = words
            if g < readable:
                landed = g + 1 <= complete
                out0[t, 4 * g: 4 * g + 4] = words if landed else SENTINEL
    return out0, out1


def cp_async_inputs(rng, threads):
    src = random_words(rng, threads * 12 + 4)
    src_bytes = rng.choice(np.array([0, 1, 4, 7, 15, 16], np.int32), size=(threads, 3))
    return src, src_bytes


@pytest.mark.parametrize("n_wait", [0, 1, 2])
@pytest.mark.parametrize("empty_groups", [0, 1, 2])
def test_cp_async_group_model_agrees(run, n_wait, empty_groups):
    src, src_bytes = cp_async_inputs(np.random.default_rng(20 + 3 * n_wait + empty_groups), LANES)
    out0 = np.full((LANES, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((LANES, 12), np.uint32)
    run(f"fid_cp_async<{n_wait}>", [src, src_bytes], [out0, out1], smem=48 * LANES, arg2=empty_groups)
    e0, e1 = model_cp_async(src, src_bytes, n_wait, empty_groups, in_flight_read=False)
    np.testing.assert_array_equal(out0, e0)
    np.testing.assert_array_equal(out1, e1)


@pytest.mark.parametrize("n_wait, empty_groups", [(1, 0), (2, 0), (2, 1)])
def test_cp_async_copies_in_flight_are_not_visible_in_the_emulator(unchecked, n_wait, empty_groups):
    # Reading a chunk whose group is still pending is undefined on a GPU; the emulator
    # (race check off) lands copies only at their wait, so the read sees the sentinel.
    src, src_bytes = cp_async_inputs(np.random.default_rng(40 + n_wait), LANES)
    out0 = np.full((LANES, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((LANES, 12), np.uint32)
    launch(unchecked, f"fid_cp_async<{n_wait}>", [src, src_bytes], [out0, out1], 48 * LANES,
           dict(arg0=1, arg2=empty_groups))
    e0, e1 = model_cp_async(src, src_bytes, n_wait, empty_groups, in_flight_read=True)
    np.testing.assert_array_equal(out0, e0)
    np.testing.assert_array_equal(out1, e1)
    assert (out0 == SENTINEL).any()


@pytest.mark.parametrize("plant", ["wait_counts_from_oldest", "no_zero_fill"])
def test_cp_async_planted_model_errors_are_caught(unchecked, plant):
    src, src_bytes = cp_async_inputs(np.random.default_rng(50), LANES)
    out0 = np.full((LANES, 12), UNWRITTEN, np.uint32)
    out1 = np.zeros((LANES, 12), np.uint32)
    launch(unchecked, "fid_cp_async<2>", [src, src_bytes], [out0, out1], 48 * LANES, dict(arg0=1))
    good = model_cp_async(src, src_bytes, 2, 0, in_flight_read=True)
    bad = model_cp_async(src, src_bytes, 2, 0, in_flight_read=True, plant=plant)
    assert all(np.array_equal(o, e) for o, e in zip((out0, out1), good))
    assert not all(np.array_equal(o, e) for o, e in zip((out0, out1), bad))


def test_cp_async_4_model_agrees(run):
    rng = np.random.default_rng(60)
    src = random_words(rng, LANES * 4)
    src_bytes = rng.choice(np.array([0, 4], np.int32), size=(LANES, 4))
    out = np.zeros((LANES, 4), np.uint32)
    run("fid_cp_async_4", [src, src_bytes], [out], smem=16 * LANES)
    src_u8 = src.view(np.uint8)
    expected = np.stack([
        np.concatenate([model_cp_async_chunk(src_u8[16 * t + 4 * i:], int(src_bytes[t, i]))[:4]
                        for i in range(4)]).view(np.uint32)
        for t in range(LANES)])
    np.testing.assert_array_equal(out, expected)
