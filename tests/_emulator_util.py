"""Shared by the emulator's tests and the GPU tier: the fidelity micro-kernels
(cuda_src/fidelity.cu) and the planted bugs (tests/emulator_planted/), their params
structs, and the PTX fragment tables of shared/reference/ptx-fragments.md written out
independently of the emulator's own layout code."""

from __future__ import annotations

import numpy as np

FIDELITY = "fidelity.cu"

FID_DTYPE = np.dtype(
    [("in0", np.uint64), ("in1", np.uint64), ("in2", np.uint64), ("out0", np.uint64), ("out1", np.uint64),
     ("n", np.int32), ("arg0", np.int32), ("arg1", np.int32), ("arg2", np.int32)],
    align=True,
)
PLANTED_DTYPE = np.dtype(
    [("inp", np.uint64), ("out", np.uint64), ("ticket", np.uint64), ("n", np.int32), ("arg", np.int32)], align=True
)

SHFL_TYPES = ["float", "int", "double", "__half2", "__nv_bfloat162"]
SHFL_NUMPY = {"float": np.float32, "int": np.int32, "double": np.float64, "__half2": np.uint32,
              "__nv_bfloat162": np.uint32}
FIDELITY_KERNELS = (
    ["fid_mma_f16", "fid_mma_bf16", "fid_mma_tf32", "fid_mma_f64", "fid_cp_async_4", "fid_exp2", "fid_pack",
     "fid_to_tf32"]
    + [f"fid_ldmatrix<{n}, {tr}>" for n in (1, 2, 4) for tr in ("false", "true")]
    + [f"fid_shfl_{op}<{t}>" for op in ("xor", "idx", "updown") for t in SHFL_TYPES]
    + [f"fid_cp_async<{n}>" for n in (0, 1, 2)]
)


def ptr(a) -> int:
    return 0 if a is None else a.ctypes.data


def fid_params(in0=None, in1=None, in2=None, out0=None, out1=None, n=0, arg0=0, arg1=0, arg2=0):
    return np.array((ptr(in0), ptr(in1), ptr(in2), ptr(out0), ptr(out1), n, arg0, arg1, arg2), dtype=FID_DTYPE)[()]


def planted_executors(source, kernels, seed=3):
    """Module-scoped fixtures ``(ex, ex_plain, ex_ordered)`` over the planted kernels of
    ``source`` on an emulated sm_90: shuffled and race-checked; shuffled without the
    shared-memory checks (the data a kernel sees); race-checked with the threads in index
    order (a fixed interleaving).  Assign them to those names in the test module."""
    import pytest

    from cupyflash.emulator import EmulatorExecutor

    def build(shuffle, race_check):
        e = EmulatorExecutor(arch=90, seed=seed, shuffle=shuffle, race_check=race_check)
        e.compile(source, kernels)
        return e

    return (pytest.fixture(scope="module", name="ex")(lambda: build(True, True)),
            pytest.fixture(scope="module", name="ex_plain")(lambda: build(True, False)),
            pytest.fixture(scope="module", name="ex_ordered")(lambda: build(False, True)))


def planted_params(inp, out, ticket=None, n=0, arg=0):
    return np.array((ptr(inp), ptr(out), ptr(ticket), n, arg), dtype=PLANTED_DTYPE)[()]


# ---- fragment tables of ptx-fragments.md, written out independently -------------------

def frag_a_16816(lane):
    """(row, col) of a0..a7 for m16n8k16 (section 1 table)."""
    g, t = lane >> 2, lane & 3
    return [(g if i in (0, 1, 4, 5) else g + 8, 2 * t + (i & 1) + (8 if i >= 4 else 0)) for i in range(8)]


def frag_b_16816(lane):
    g, t = lane >> 2, lane & 3
    return [(2 * t + (i & 1) + (8 if i >= 2 else 0), g) for i in range(4)]


def frag_c(lane):
    g, t = lane >> 2, lane & 3
    return [(g if i < 2 else g + 8, 2 * t + (i & 1)) for i in range(4)]


def frag_a_1688_tf32(lane):
    g, t = lane >> 2, lane & 3
    return [(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)]


def frag_b_1688_tf32(lane):
    g, t = lane >> 2, lane & 3
    return [(t, g), (t + 4, g)]


def pack_pairs(bits16):
    """uint16 elements e0, e1, e2, ... -> b32 registers {e0 | e1 << 16, ...} (section 0)."""
    b = np.asarray(bits16, dtype=np.uint32).reshape(-1, 2)
    return b[:, 0] | (b[:, 1] << 16)


def bf16_bits_rne(x):
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def tf32_rna(x):
    """cvt.rna.tf32.f32 as section 2 describes it: 10 mantissa bits, ties away, low 13 bits zero."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF).astype(np.uint32)


def bf16_round(x):
    """x rounded to bfloat16 (nearest even, finite inputs), as float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)
