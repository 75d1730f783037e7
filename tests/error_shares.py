"""How much of its error bound each kernel family uses: the table of docs/testing.md.

Run by hand, ``python tests/error_shares.py`` (emulator kernels: minutes).  For one
representative problem per family (two heads, Lq = 130, Lk = 150, d = 64, causal),
the largest ratio of error to bound under the rule the tests apply to that family:

- forward, float32/float64 (and the 16-bit dtypes on the SIMT kernels and the CPU
  path): the tolerance table of tests/_util.py;
- forward, 16-bit on the tensor cores: HALF_FORWARD_FACTOR times naive_half_attention's
  error plus one rounding (tests/_util.py);
- backward, float32/float64: assert_within_term_bound's 32 eps per term size;
- backward, 16-bit: assert_within_yardstick (1.25 times naive_half_backward's error).
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]      # this checkout's tests and cupyflash

SHAPE_Q, SHAPE_K = (1, 2, 130, 64), (1, 2, 150, 64)


def _inputs(dtype, seed=0):
    from _util import random_array

    rng = np.random.default_rng(seed)
    q = random_array(rng, SHAPE_Q, dtype)
    k, v = random_array(rng, SHAPE_K, dtype), random_array(rng, SHAPE_K, dtype)
    return q, k, v, rng


def forward_share(dtype, backend, precision="ieee", rule="table", options=None):
    from _util import HALF_FORWARD_FACTOR, HALF_UNIT_ROUNDOFF, TOLERANCE, naive_half_attention
    from cupyflash._api import run_attention
    from cupyflash.reference import naive_attention

    q, k, v, _ = _inputs(dtype)
    out = run_attention(q, k, v, causal=True, backend=backend, precision=precision,
                        options=options).astype(np.float64)
    ref = naive_attention(q, k, v, causal=True)
    err = np.abs(out - ref)
    if rule == "table":
        tol = TOLERANCE[np.dtype(dtype)]
        return float((err / (tol["atol"] + tol["rtol"] * np.abs(ref))).max())
    naive = naive_half_attention(q, k, v, scale=1 / math.sqrt(64), window=(None, 0), gqa_ratio=1)
    bound = (HALF_FORWARD_FACTOR * np.abs(naive - ref).max()
             + (HALF_UNIT_ROUNDOFF[np.dtype(dtype).name] + 2.0**-24) * np.abs(ref).max())
    return float(err.max() / bound)


def backward_share(dtype, backend, precision="ieee", options=None):
    import cupyflash
    from _backward_util import (HALF_YARDSTICK_FACTOR, _HALF_UNIT_ROUNDOFF, backward_term_sizes,
                                naive_half_backward)
    from _util import random_array
    from cupyflash._api import run_attention_backward
    from cupyflash.reference import naive_attention_backward

    q, k, v, rng = _inputs(dtype)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout = random_array(rng, out.shape, dtype)
    grads = run_attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend,
                                   precision=precision, options=options)
    expected = naive_attention_backward(dout, q, k, v, causal=True)
    shares = []
    if np.dtype(dtype).itemsize == 2:
        naive = naive_half_backward(dout, q, k, v, out, scale=1 / math.sqrt(64), window=(None, 0), lse=lse)
        for g, e, n in zip(grads, expected, naive):
            largest = np.abs(e).max()
            floor = 2.0**-24 * max(1.0, largest) + _HALF_UNIT_ROUNDOFF[np.dtype(dtype).name] * largest
            shares.append(np.abs(g.astype(np.float64) - e).max() / (HALF_YARDSTICK_FACTOR * np.abs(n - e).max()
                                                                   + floor))
    else:
        eps = np.finfo(np.float32 if precision != "ieee" or dtype != np.float64 else np.float64).eps
        for g, e, size in zip(grads, expected, backward_term_sizes(dout, q, k, v, causal=True)):
            bound = 2 * 32 * eps * size        # widen = sqrt(64) / 4 = 2
            ok = size > 0
            shares.append((np.abs(g.astype(np.float64) - e)[ok] / bound[ok]).max())
    return float(max(shares))


@contextlib.contextmanager
def sm90_emulator():
    """The emulator backend as an sm_90 (the wgmma and FP64 tensor-core rows exist there)."""
    from cupyflash import _dispatch
    from cupyflash.emulator import EmulatorExecutor

    key = ("emulator",)
    saved = _dispatch._executors.get(key)
    _dispatch._executors[key] = EmulatorExecutor(arch=90, seed=90, shuffle=True, race_check=True)
    try:
        yield
    finally:
        _dispatch._executors.pop(key)
        if saved is not None:
            _dispatch._executors[key] = saved


def main():
    from _util import bfloat16
    from cupyflash._options import KernelOptions

    f16, f32, f64 = np.float16, np.float32, np.float64
    rows = [
        ("CPU path forward", "float16 / bfloat16 / float32 / float64", "table",
         lambda: [forward_share(d, "numpy") for d in (f16, bfloat16, f32, f64)]),
        ("CPU path backward", "float32 / float64", "term bound",
         lambda: [backward_share(d, "numpy") for d in (f32, f64)]),
        ("fwd_simt", "float32 / float64", "table", lambda: [forward_share(d, "emulator") for d in (f32, f64)]),
        ("fwd_mma (sm_80)", "float16 / bfloat16", "yardstick x 1.25 + rounding",
         lambda: [forward_share(d, "emulator", rule="mma") for d in (f16, bfloat16)]),
        ("fwd_tf32, tf32x3", "float32", "table", lambda: [forward_share(f32, "emulator", "tf32x3")]),
        ("bwd_simt", "float32 / float64", "term bound", lambda: [backward_share(d, "emulator") for d in (f32, f64)]),
        ("bwd_mma (sm_80)", "float16 / bfloat16", "yardstick x 1.25",
         lambda: [backward_share(d, "emulator") for d in (f16, bfloat16)]),
        ("bwd_tf32, tf32x3", "float32", "term bound",
         lambda: [backward_share(f32, "emulator", "tf32x3")]),
    ]
    on = KernelOptions(wgmma=True, dmma=frozenset({"float64"}))   # the opt-in sm_90 kernels
    wgmma = [
        ("fwd_wgmma (sm_90)", "float16 / bfloat16", "yardstick x 1.25 + rounding",
         lambda: [forward_share(d, "emulator", rule="mma", options=on) for d in (f16, bfloat16)]),
        ("fwd_dmma (sm_90)", "float64", "table", lambda: [forward_share(f64, "emulator", options=on)]),
        ("bwd_wgmma (sm_90)", "float16 / bfloat16", "yardstick x 1.25",
         lambda: [backward_share(d, "emulator", options=on) for d in (f16, bfloat16)]),
        ("bwd_dmma (sm_90)", "float64", "term bound", lambda: [backward_share(f64, "emulator", options=on)]),
    ]
    print("| family | dtypes | rule | share of the bound |\n|---|---|---|---|")
    for name, dtypes, rule, run in rows:
        print(f"| {name} | {dtypes} | {rule} | {' / '.join(f'{x:.2g}' for x in run())} |", flush=True)
    with sm90_emulator():
        for name, dtypes, rule, run in wgmma:
            print(f"| {name} | {dtypes} | {rule} | {' / '.join(f'{x:.2g}' for x in run())} |", flush=True)


if __name__ == "__main__":
    main()
