"""Run under ``mpiexec -n N``: every ring-attention case of tests/test_distributed.py in one launch.

Each rank builds the same whole arrays (one seed), runs ring_attention and
ring_attention_backward on its shards and compares them with the single-process
attention / attention_backward (float64: within 1e-12) or with the float64 oracle
(float32, float16: the tolerance table of tests/_util.py) on the whole arrays.
Rank 0 prints one line ``RING-SUMMARY size=N cases=C checks=K failures=F`` and a
``FAIL`` line per failed check; the test parses them.

``python _mpi_ring_worker.py raise``: rank 1 raises inside the ring (its second pair);
the job must end by MPI_Abort, not hang.  ``... badinput``: rank 1's q has the wrong
dtype; every rank must raise, none hang; each prints ``RAISED <rank> <type>``.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np

import cupyflash
from cupyflash import distributed
from cupyflash.distributed import ring_attention, ring_attention_backward, shard, unshard
from cupyflash.reference import naive_attention, naive_attention_backward

from _util import TOLERANCE, accum_dtype, bfloat16, random_qkv

COMM = None                 # MPI.COMM_WORLD; mpi4py is imported in main, not on import
L = 11                      # not divisible by 2, 3, 4, 6 or 8: the shards differ in length
MASKS = [(False, None), (True, None), (False, (2, 3)), (True, (4, None)), (False, (None, 2))]


def cases():
    """(layout, causal, window, dtype, gqa): every mask and layout in float64 and float32,
    GQA on every other case, a float16 case per layout and a bfloat16 one."""
    found = []
    i = 0
    for layout in distributed.LAYOUTS:
        for causal, window in MASKS:
            for dtype in (np.float64, np.float32):
                found.append((layout, causal, window, np.dtype(dtype), i % 2 == 1))
                i += 1
        found.append((layout, True, (3, None), np.dtype(np.float16), True))
    if bfloat16 is not None:
        found.append(("zigzag", False, (2, 3), bfloat16, False))
    return found


def compare(got, expected, dtype, grad, what, failures):
    """float64: within 1e-12 of the single-process result; other dtypes: the table's
    tolerance against the float64 oracle (gradients relative to their largest entry)."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if got.shape != expected.shape:
        failures.append(f"{what}: shape {got.shape} != {expected.shape}")
        return
    if np.dtype(dtype) == np.float64:
        rtol, atol = 1e-12, 1e-12
    else:
        tol = TOLERANCE[np.dtype(dtype)]
        scale = max(1.0, float(np.abs(expected[np.isfinite(expected)]).max(initial=0))) if grad else 1.0
        rtol, atol = tol["rtol"] * scale, tol["atol"] * scale
    same_inf = np.array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    err = np.abs(got[finite] - expected[finite])
    if not same_inf or np.isnan(got).any() or (err > atol + rtol * np.abs(expected[finite])).any():
        failures.append(f"{what}: max error {err.max(initial=0):.3g} (rtol {rtol:.1g}, atol {atol:.1g}), "
                        f"-inf rows agree: {same_inf}")


def run_case(case, failures):
    layout, causal, window, dtype, gqa = case
    rng = np.random.default_rng(zlib.crc32(repr((layout, causal, window, dtype.name, gqa)).encode()))
    hkv = 2
    hq = 4 if gqa else hkv
    q, k, v = random_qkv(rng, (1, hq, L, 8), (1, hkv, L, 8), (1, hkv, L, 6), dtype)
    dout = rng.standard_normal((1, hq, L, 6)).astype(dtype)
    opts = dict(causal=causal, window=window, enable_gqa=gqa)
    if dtype == np.float64:
        ref, ref_lse = cupyflash.attention(q, k, v, return_lse=True, **opts)
        grads = cupyflash.attention_backward(dout, q, k, v, ref, ref_lse, **opts)
    else:      # the oracle, on the same (rounded) inputs
        ref, ref_lse = naive_attention(q, k, v, return_lse=True, **opts)
        grads = naive_attention_backward(dout, q, k, v, **opts)
    sq, sk, sv, sd = (shard(x, COMM, layout) for x in (q, k, v, dout))
    out, lse = ring_attention(sq, sk, sv, comm=COMM, return_lse=True, layout=layout, **opts)
    name = f"{layout} causal={causal} window={window} {dtype.name} gqa={gqa}"
    if out.dtype != dtype or lse.dtype != accum_dtype(dtype):
        failures.append(f"{name}: dtypes out {out.dtype} lse {lse.dtype}")
    compare(out, shard(ref, COMM, layout), dtype, False, f"{name} out", failures)
    compare(lse, shard(ref_lse[..., None], COMM, layout)[..., 0], accum_dtype(dtype), False,
            f"{name} lse", failures)
    whole = unshard(out, COMM, layout)
    if dtype == np.float64 and not np.array_equal(whole[..., shard_rows(layout), :], out):
        failures.append(f"{name}: unshard does not put this rank's rows back in place")
    compare(whole, ref, dtype, False, f"{name} unshard(out)", failures)
    dq, dk, dv = ring_attention_backward(sd, sq, sk, sv, out, lse, comm=COMM, layout=layout, **opts)
    for what, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        if got.dtype != dtype:
            failures.append(f"{name} {what}: dtype {got.dtype}")
        compare(got, shard(expected, COMM, layout), dtype, True, f"{name} {what}", failures)
    return 6


def shard_rows(layout):
    """This rank's global row indices (what shard takes of axis -2)."""
    return shard(np.arange(L)[:, None], COMM, layout)[:, 0]


def main(mode):
    global COMM
    from mpi4py import MPI

    COMM = MPI.COMM_WORLD
    if mode == "raise":
        calls = []
        real = distributed.attention

        def failing(*args, **kwargs):
            calls.append(1)
            if COMM.rank == 1 and len(calls) == 2:
                raise RuntimeError("planted failure on rank 1")
            return real(*args, **kwargs)

        distributed.attention = failing
        for _ in range(3):      # the other ranks would wait for rank 1 forever without the abort
            run_case(("contiguous", False, None, np.dtype(np.float64), False), [])
        print(f"NOT-ABORTED {COMM.rank}", flush=True)
        return
    if mode == "badinput":
        q = np.ones((2, 4 if COMM.rank != 1 else 3, 8), dtype=np.float32 if COMM.rank != 1 else np.int32)
        try:
            ring_attention(q, q, q, comm=COMM)
        except (TypeError, ValueError) as exc:
            print(f"RAISED {COMM.rank} {type(exc).__name__}: {exc}", flush=True)
        return
    failures = []
    checks = 0
    all_cases = cases()
    for case in all_cases:
        try:
            checks += run_case(case, failures)
        except Exception as exc:  # noqa: BLE001 - report, then let the summary fail
            failures.append(f"{case}: {type(exc).__name__}: {exc}")
    counts = COMM.allreduce(np.array([checks, len(failures)]), op=MPI.SUM)
    every = COMM.gather(failures, root=0)
    if COMM.rank == 0:
        for rank, fails in enumerate(every):
            for f in fails:
                print(f"FAIL rank {rank}: {f}")
        print(f"RING-SUMMARY size={COMM.size} cases={len(all_cases)} checks={counts[0]} "
              f"failures={counts[1]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cases")
