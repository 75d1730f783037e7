"""Error of the tensor-core kernels against the float64 oracle under the emulator's two
accumulation models (issue 32, finding 4d).  Opt-in, CPU only, a few minutes:

    python -m benchmarks.emulator_accumulation [--extra-bits E] [--seeds N]

For each seeded problem (B = 1, H = 2, L = 256, d = 64, not causal) it runs, on
``backend="emulator"`` (sm_80: fwd_mma / bwd_mma, fwd_tf32 / bwd_tf32), the forward
and the backward of bfloat16 inputs and of float32 inputs with ``precision="tf32x3"``
and ``"ieee"`` (fwd_simt / bwd_simt, no tensor cores), each in a fresh process whose
``$CUPYFLASH_EMULATOR_ACCUMULATION`` is ``exact`` or ``truncate:E``, and prints the
largest error relative to the largest reference element, per output, and the ratios
the error rules are written in (tf32x3 / ieee, truncate / exact).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

_CHILD = r"""
import json, sys
import numpy as np
import cupyflash
from cupyflash.reference import naive_attention

seed, dtype_name, precision = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = np.random.default_rng(seed)
shape = (1, 2, 256, 64)
q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
if dtype_name == "bfloat16":
    import ml_dtypes
    q, k, v, do = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v, do))
f64 = [x.astype(np.float64) for x in (q, k, v, do)]
out, lse = cupyflash.attention(q, k, v, return_lse=True, precision=precision, backend="emulator")
grads = cupyflash.attention_backward(do, q, k, v, out, lse, precision=precision, backend="emulator")
ref = naive_attention(*f64[:3])
# the float64 oracle's gradients by hand: P = softmax(S), dV = P^T dO, dP = dO V^T,
# dS = P (dP - rowsum(dO * O)), dQ = dS K scale, dK = dS^T Q scale
qq, kk, vv, dd = f64
scale = 1 / np.sqrt(qq.shape[-1])
s = qq @ np.swapaxes(kk, -1, -2) * scale
p = np.exp(s - s.max(-1, keepdims=True))
p /= p.sum(-1, keepdims=True)
o = p @ vv
dv = np.swapaxes(p, -1, -2) @ dd
dp = dd @ np.swapaxes(vv, -1, -2)
ds = p * (dp - (dd * o).sum(-1, keepdims=True))
dq, dk = ds @ kk * scale, np.swapaxes(ds, -1, -2) @ qq * scale
err = lambda x, r: float(np.abs(x.astype(np.float64) - r).max() / np.abs(r).max())
print(json.dumps({"out": err(out, ref), "dq": err(grads[0], dq), "dk": err(grads[1], dk),
                  "dv": err(grads[2], dv)}))
"""


def _run(seed: int, dtype: str, precision: str, accumulation: str) -> dict:
    env = dict(os.environ, CUPYFLASH_EMULATOR_ACCUMULATION=accumulation)
    res = subprocess.run([sys.executable, "-c", _CHILD, str(seed), dtype, precision], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra-bits", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    modes = ("exact", f"truncate:{args.extra_bits}")
    cases = [("bfloat16", "ieee"), ("float32", "tf32x3"), ("float32", "ieee")]
    table = {}
    for seed in range(args.seeds):
        for dtype, precision in cases:
            for mode in modes:
                if precision == "ieee" and dtype == "float32" and mode != "exact":
                    continue   # fwd_simt / bwd_simt: no tensor cores, the mode cannot matter
                table[seed, dtype, precision, mode] = _run(seed, dtype, precision, mode)
    outputs = ("out", "dq", "dk", "dv")
    print(f"{'seed':>4} {'inputs':<16} {'accumulation':<12} " + " ".join(f"{o:>9}" for o in outputs))
    for (seed, dtype, precision, mode), errs in table.items():
        print(f"{seed:>4} {dtype + '/' + precision:<16} {mode:<12} " + " ".join(f"{errs[o]:9.2e}" for o in outputs))
    print("\nratios, worst over seeds (per output):")
    for label, num, den in [
        ("tf32x3 / ieee, exact", ("float32", "tf32x3", modes[0]), ("float32", "ieee", "exact")),
        ("tf32x3 / ieee, truncate", ("float32", "tf32x3", modes[1]), ("float32", "ieee", "exact")),
        ("bf16 truncate / exact", ("bfloat16", "ieee", modes[1]), ("bfloat16", "ieee", modes[0])),
    ]:
        worst = {o: max(table[(s,) + num][o] / table[(s,) + den][o] for s in range(args.seeds)) for o in outputs}
        print(f"  {label:<26} " + " ".join(f"{o} {worst[o]:5.2f}" for o in outputs))


if __name__ == "__main__":
    main()
