"""The emulator's wgmma register and shared-memory rules, and its truncating accumulation.

Part of issue 32: (a) a register written between ``wgmma.fence`` and the wgmma
that reads it, (b) accumulators written while their wgmma is in flight, (c)
shared memory overwritten after some but not all warps of the warpgroup
retired the group -- each broken on purpose by a flag of
``emulator_planted/wgmma_planted.cu`` and reported; and (d) the
``accumulation="truncate"`` model of the tensor cores' adder, checked bit for
bit against an independent model written here with Python integers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cupyflash.emulator import EmulatorError, EmulatorExecutor, emulator_available
from cupyflash.emulator._executor import ACCUMULATION_ENV, DEFAULT_EXTRA_BITS

from _emulator_util import (FIDELITY, bf16_bits_rne, bf16_round, fid_params, frag_a_16816, frag_a_1688_tf32,
                            frag_b_16816, frag_b_1688_tf32, frag_c, pack_pairs, planted_params, tf32_rna)

OK, WHY = emulator_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU emulator unavailable: {WHY}")

PROBE = str(Path(__file__).resolve().parent / "emulator_planted" / "wgmma_planted.cu")
PROBE_SHARED = 2 * 64 * 64 * 2 + 1024


def _probe(executor, regs_a: bool, flags: int = 0, inp=None):
    if inp is None:
        inp = np.random.default_rng(21).standard_normal(2048).astype(np.float32)
    out = np.full(64 * 64, np.nan, np.float32)
    executor.launch(PROBE, f"wgmma_probe<{'true' if regs_a else 'false'}>", 1, 128, PROBE_SHARED,
                    planted_params(inp, out, None, 0, flags))
    return out.reshape(64, 64)


@pytest.fixture(scope="module")
def probe_ex():
    e = EmulatorExecutor(arch=90, seed=5, shuffle=True, race_check=True)
    e.compile(PROBE, ["wgmma_probe<true>", "wgmma_probe<false>"])
    return e


# ---- 4a-4c: the planted faults ----------------------------------------------------------------

@pytest.mark.parametrize("regs_a, flags, match", [
    (True, 512, r"wrote A register 1 \(0x[0-9a-f]{8}, was 0x[0-9a-f]{8}\) between its wgmma\.fence"),
    (False, 1024, r"wrote accumulator register 19 \(0x3f000000, was 0x[0-9a-f]{8}\) between its wgmma\.fence"),
    (False, 2048, r"wrote accumulator register \d+ \(now 0x7fe5c0de\) of a wgmma .*while it was in flight"),
    (True, 2048, r"wrote accumulator register \d+ \(now 0x7fe5c0de\) of a wgmma .*while it was in flight"),
    (False, 256, r"shared offset \d+, read by a wgmma .*was overwritten before the warpgroup's wgmma\.wait_group "
                 r"retired it \(found by thread \(\d+,0,0\) \[warp [123], .*the last of the warpgroup's 128"),
], ids=["a-reg-after-fence", "acc-after-fence", "acc-scaled-in-flight", "acc-scaled-in-flight-rs",
        "smem-before-last-warp-retires"])
def test_planted_register_and_shared_memory_faults_are_reported(probe_ex, regs_a, flags, match):
    with pytest.raises(EmulatorError, match=match):
        _probe(probe_ex, regs_a, flags)


HANDOFF = str(Path(__file__).resolve().parent / "emulator_planted" / "wgmma_handoff_planted.cu")
HANDOFF_SHARED = 2 * 64 * 64 * 2 + 16 + 1024


def _handoff(executor, fault):
    inp = np.random.default_rng(33).standard_normal(3072).astype(np.float32)
    out = np.full(2 * 64 * 64, np.nan, np.float32)
    executor.launch(HANDOFF, f"wgmma_handoff<{fault}>", 1, 256, HANDOFF_SHARED,
                    planted_params(inp, out, None, 0, 0))
    return inp, out.reshape(2, 64, 64)


@pytest.fixture(scope="module")
def handoff_ex():
    e = EmulatorExecutor(arch=90, seed=7, shuffle=True, race_check=True)
    e.compile(HANDOFF, [f"wgmma_handoff<{k}>" for k in range(3)])
    return e


def test_a_wgmma_buffer_handed_over_by_mbarriers_matches_numpy(handoff_ex):
    # the producer/consumer protocol of the decoupled forward, in miniature: correct
    inp, out = _handoff(handoff_ex, 0)
    a = bf16_round(inp[:1024]).reshape(64, 16).astype(np.float64)
    for r in range(2):
        b = bf16_round(inp[1024 * (1 + r):1024 * (2 + r)]).reshape(16, 64).astype(np.float64)
        np.testing.assert_allclose(out[r], a @ b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fault, match", [
    # (found from either side: the write after the re-read, or the re-read after the write)
    (1, r"shared-memory race .*(thread \(0,0,0\) \[warp 0, lane 0\] read at \S*wgmma_handoff_planted\.cu:\d+|"
        r"in wgmma \(its reads last until the wgmma\.wait_group that retires it\))"),
    (2, r"whose fence\.proxy\.async after that write does not happen before the read"),
], ids=["released-before-the-wait", "fence-after-the-arrival"])
def test_a_hand_off_that_only_the_schedule_saves_is_reported(handoff_ex, fault, match):
    # The emulator's schedule lands nothing early here (the producer writes the buffer
    # again only after the consumers ran on; the later fence comes before the second read),
    # so only the happens-before checks can see these: the wgmma's reads last until each
    # warp retires them, and the writer's fence must come before the release the reader
    # acquired.
    with pytest.raises(EmulatorError, match=match):
        _handoff(handoff_ex, fault)


def test_the_checked_probe_without_faults_still_matches_numpy(probe_ex):
    # the fence snapshot, the poison check and the last-retirement check pass a correct kernel
    inp = np.random.default_rng(21).standard_normal(2048).astype(np.float32)
    for regs_a in (False, True):
        out = _probe(probe_ex, regs_a, 0, inp)
        a, b = bf16_round(inp[:1024]).reshape(64, 16), bf16_round(inp[1024:]).reshape(16, 64)
        np.testing.assert_allclose(out, a @ b, rtol=1e-6, atol=1e-6)


# ---- d: the truncating accumulation ----------------------------------------------------------

def truncated_sum_model(c: float, products, extra: int) -> np.float32:
    """c + sum(products) as the truncating tensor-core adder is modelled, with Python integers:
    every term cut toward zero to a multiple of 2**(e - 23 - extra), e the exponent of the
    largest term, the cut terms added exactly, the sum cut toward zero to float32."""
    terms = [float(c)] + [float(p) for p in products]
    nonzero = [t for t in terms if t != 0.0]
    if not nonzero:
        return np.float32(math.fsum(terms))
    e = max(math.frexp(t)[1] - 1 for t in nonzero)
    lsb = e - 23 - extra                         # exponent of the last bit kept
    total = 0
    for t in terms:
        m, x = math.frexp(t)                     # t = m 2**x, m with 53 bits
        n = int(m * 2**53)                       # exact integer: t = n 2**(x - 53)
        shift = x - 53 - lsb
        total += n * 2**shift if shift >= 0 else int(n / 2**-shift)   # |n| < 2**53: exact; int() cuts to 0
    if total == 0:
        return np.float32(0.0)
    # total 2**lsb to float32, toward zero: keep the top 24 bits of |total| (fewer when subnormal)
    sign, mag = (-1 if total < 0 else 1), abs(total)
    top = mag.bit_length() - 1 + lsb             # exponent of the sum's leading bit
    keep_lsb = max(top - 23, -149)
    if keep_lsb > lsb:
        mag >>= keep_lsb - lsb
        return np.float32(sign * math.ldexp(mag, keep_lsb))
    return np.float32(sign * math.ldexp(mag, lsb))


def test_the_model_truncates_where_exact_rounding_does_not():
    # 1 + 16 * 1.5 * 2**-28: exact, 1 + 1.5 * 2**-24 rounds to 1 + 2**-23; with 3 extra bits each
    # product lies below the last kept bit (2**-26) and is dropped
    prods = [1.5 * 2.0**-28] * 16
    assert truncated_sum_model(1.0, prods, 3) == np.float32(1.0)
    assert np.float32(1.0 + math.fsum(prods)) == np.float32(1.0 + 2.0**-23)
    assert truncated_sum_model(1.0, [2.0**-26] * 16, 3) == np.float32(1.0 + 2.0**-22)
    # the final rounding is toward zero, for either sign
    assert truncated_sum_model(0.0, [1.0, 2.0**-24 * 1.5], 3) == np.float32(1.0)
    assert truncated_sum_model(0.0, [-1.0, -(2.0**-23) * 1.5], 3) == np.float32(-(1.0 + 2.0**-23))


def _mma_case(rng, kind: str, planted: bool):
    """Fragments for test_emulator's fid_mma_{kind} kernel (2 warps), and per warp A, B, C in float64."""
    warps, k = 2, (16 if kind == "bf16" else 8)
    mats = []
    a_frag = np.zeros((32 * warps, 4), np.uint32 if kind == "bf16" else np.float32)
    b_frag = np.zeros((32 * warps, 2), np.uint32 if kind == "bf16" else np.float32)
    c_frag = np.zeros((32 * warps, 4), np.float32)
    for w in range(warps):
        A = rng.standard_normal((16, k)).astype(np.float32)
        B = rng.standard_normal((k, 8)).astype(np.float32)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        if planted:   # a large C (row 0) and products far below its last bit; mixed signs
            C[0] = np.float32(1.0) + np.float32(2.0**-20) * np.arange(8, dtype=np.float32)
            A[0] = np.ldexp(np.float32(1.5), -14) * np.where(np.arange(k) % 3 == 0, -1, 1)
            B[:, :] = np.abs(B) + 0.5
        if kind == "bf16":
            a_bits, b_bits = bf16_bits_rne(A), bf16_bits_rne(B)
            A64 = (a_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            B64 = (b_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            A64, B64 = (tf32_rna(M).view(np.float32).astype(np.float64) for M in (A, B))
        for lane in range(32):
            L = 32 * w + lane
            if kind == "bf16":
                a_frag[L] = pack_pairs([a_bits[r, c] for r, c in frag_a_16816(lane)])
                b_frag[L] = pack_pairs([b_bits[r, c] for r, c in frag_b_16816(lane)])
            else:
                a_frag[L] = [A[r, c] for r, c in frag_a_1688_tf32(lane)]
                b_frag[L] = [B[r, c] for r, c in frag_b_1688_tf32(lane)]
            c_frag[L] = [C[r, c] for r, c in frag_c(lane)]
        mats.append((A64, B64, C.astype(np.float64)))
    return a_frag, b_frag, c_frag, mats


def _run_mma(executor, kind, a_frag, b_frag, c_frag):
    d = np.full((64, 4), np.nan, np.float32)
    regs = np.zeros((64, 6), np.uint32)
    extra = (regs,) if kind == "tf32" else ()
    executor.launch(FIDELITY, f"fid_mma_{kind}", 1, 64, 0, fid_params(a_frag, b_frag, c_frag, d, *extra))
    return d


def _expected(mats, model):
    out = np.zeros((64, 4), np.float32)
    for w, (A, B, C) in enumerate(mats):
        for lane in range(32):
            for i, (r, c) in enumerate(frag_c(lane)):
                out[32 * w + lane, i] = model(C[r, c], A[r, :] * B[:, c])
    return out


@pytest.mark.parametrize("kind", ["bf16", "tf32"])
@pytest.mark.parametrize("planted", [False, True], ids=["random", "planted"])
def test_truncating_mma_matches_the_model_bit_for_bit(kind, planted):
    extra = 2
    a_frag, b_frag, c_frag, mats = _mma_case(np.random.default_rng(7), kind, planted)
    trunc = _run_mma(EmulatorExecutor(arch=80, seed=1, accumulation=f"truncate:{extra}"), kind,
                     a_frag, b_frag, c_frag)
    exact = _run_mma(EmulatorExecutor(arch=80, seed=1, accumulation="exact"), kind, a_frag, b_frag, c_frag)
    want_trunc = _expected(mats, lambda c, p: truncated_sum_model(c, p, extra))
    want_exact = _expected(mats, lambda c, p: np.float32(math.fsum([c, *p])))
    np.testing.assert_array_equal(trunc.view(np.uint32), want_trunc.view(np.uint32))
    np.testing.assert_array_equal(exact.view(np.uint32), want_exact.view(np.uint32))
    differ = np.count_nonzero(trunc != exact)
    if planted:   # rows 0 (C = 1 + j 2**-20, products of 2**-14-ish): truncation drops low bits
        assert differ >= 8, differ
    else:         # toward zero vs to nearest: about half of the elements
        assert differ > 0.2 * trunc.size, differ


def test_truncating_wgmma_matches_the_model_bit_for_bit(monkeypatch):
    monkeypatch.setenv(ACCUMULATION_ENV, "truncate")   # the default extra bits, through the environment
    ex = EmulatorExecutor(arch=90, seed=9)
    assert ex.accumulation == f"truncate:{DEFAULT_EXTRA_BITS}"
    rng = np.random.default_rng(8)
    inp = rng.standard_normal(2048).astype(np.float32)
    inp[:16] *= 2.0**12       # row 0 of A large: its products swamp the others' low bits
    a, b = bf16_round(inp[:1024]).reshape(64, 16), bf16_round(inp[1024:]).reshape(16, 64)
    for regs_a in (False, True):
        out = _probe(ex, regs_a, 0, inp)
        want = np.array([[truncated_sum_model(0.0, a[r] * b[:, n], DEFAULT_EXTRA_BITS) for n in range(64)]
                         for r in range(64)], np.float32)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
        assert np.count_nonzero(want != (a @ b).astype(np.float32)) > 100   # the case tells the modes apart


@pytest.mark.parametrize("value, error", [
    ("truncate:21", ValueError), ("round", ValueError), ("truncate:", ValueError), (3, TypeError),
])
def test_a_bad_accumulation_mode_is_rejected_naming_it(value, error):
    with pytest.raises(error, match="accumulation"):
        EmulatorExecutor(accumulation=value)
