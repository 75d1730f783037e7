"""One launch of each kernel behind the issues' targets, for Nsight Compute.

Run under ``ncu`` by ``benchmarks/gpu_check.sh`` (where ncu can read the
hardware counters), or by hand::

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --csv --page details python benchmarks/gpu_profile.py > profile.csv

Each case calls the public API once (the forward, or the forward and the
backward), so every kernel it launches is profiled once: on sm_90 fwd_wgmma and
bwd_wgmma (deterministic and with atomic dQ) at d = 128, then fwd_mma at d = 128
and 64, fwd_simt in float32, fwd_dmma in float64 and float32 (where the GPU has it), fwd_tf32
(float32 with precision="tf32x3"), bwd_tf32 (likewise), bwd_mma
deterministic and with atomic dQ, bwd_simt in float32, bwd_dmma in float64.  Shapes are large enough to fill an H100-class GPU for a few
milliseconds (the counters then describe the steady state, not the tail), small
enough that ncu's replay of every kernel stays within seconds.  Without
arguments every case runs; ``--case NAME`` (repeatable) picks some.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (pass, dtype, batch, heads, seqlen, head_dim, deterministic).  The wgmma
# kernels (opt-in) first: on an sm_90 GPU they carry the targets; elsewhere they
# are skipped.
CASES = {
    "fwd_wgmma_d128": ("forward", "bfloat16", 1, 16, 4096, 128, True),
    "bwd_wgmma_d128": ("backward", "bfloat16", 1, 16, 4096, 128, True),
    "bwd_wgmma_atomic_d128": ("backward", "bfloat16", 1, 16, 4096, 128, False),
    "fwd_mma_d128": ("forward", "bfloat16", 1, 16, 4096, 128, True),
    "fwd_mma_d64": ("forward", "bfloat16", 1, 16, 4096, 64, True),
    "fwd_simt_f32": ("forward", "float32", 1, 16, 2048, 64, True),
    "fwd_dmma_f64": ("forward", "float64", 1, 16, 2048, 64, True),
    "fwd_dmma_f32": ("forward", "float32", 1, 16, 2048, 64, True),
    "fwd_tf32_x3": ("forward", "float32", 1, 16, 2048, 64, True),
    "bwd_mma_d128": ("backward", "bfloat16", 1, 16, 4096, 128, True),
    "bwd_mma_atomic_d128": ("backward", "bfloat16", 1, 16, 4096, 128, False),
    "bwd_simt_f32": ("backward", "float32", 1, 8, 2048, 64, True),
    "bwd_dmma_f64": ("backward", "float64", 1, 8, 2048, 64, True),
    "bwd_tf32_x3": ("backward", "float32", 1, 8, 2048, 64, True),
}


def run(name: str) -> None:
    import cupy
    import numpy as np

    from cupyflash._api import run_attention, run_attention_backward
    from cupyflash._arch import DMMA_ARCHS, WGMMA_ARCH
    from cupyflash._options import KernelOptions

    kind, dtype, b, h, length, d, deterministic = CASES[name]
    wgmma = "wgmma" in name
    if wgmma and int(cupy.cuda.Device().compute_capability) != WGMMA_ARCH:
        print(f"gpu_profile: {name} skipped (not an sm_90 GPU)", file=sys.stderr, flush=True)
        return
    dmma = "dmma" in name   # fwd_dmma and bwd_dmma are opt-in too, and only on compute capability 8.0 / 9.0
    if dmma and int(cupy.cuda.Device().compute_capability) not in DMMA_ARCHS:
        print(f"gpu_profile: {name} skipped (no fast FP64 tensor cores)", file=sys.stderr, flush=True)
        return
    options = KernelOptions(wgmma=wgmma, dmma=frozenset({"float64", "float32"} if dmma else ()))
    if dtype == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((b, h, length, d), dtype=np.float32).astype(dt))
               for _ in range(3))
    precision = "tf32x3" if name.endswith("_x3") else "ieee"   # fwd_tf32 runs where TF32 is allowed
    out, lse = run_attention(q, k, v, return_lse=True, precision=precision, options=options)
    if kind == "backward":
        dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(dt))
        run_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, precision=precision,
                               options=options)
    cupy.cuda.Device().synchronize()
    print(f"gpu_profile: {name} done", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    args = p.parse_args()
    for name in args.case or CASES:
        run(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
