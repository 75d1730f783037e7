"""The full sweep of bias and mask cases through the CUDA kernels, on the emulator.

Opt-in (about ten minutes on two cores; CI runs tests/test_bias_mask_kernels.py, one
representative shape per family)::

    python tests/terms_sweep.py            # every configuration and case
    python tests/terms_sweep.py mma wgmma  # configurations whose name contains a word

For every dispatch configuration -- an arch, KernelOptions, a dtype and a precision that
make the dispatcher pick one family, forward and backward -- each case runs the forward
and the backward on the emulator (shuffled warps, race checks) and checks them with
tests/test_bias_mask_kernels.py's rules (the families' error rules, the dbias bound):
each bias shape alone ((1,1,Lq,Lk), (B,1,1,Lk), (1,H,Lq,Lk), (B,H,Lq,Lk)) in each bias
dtype in turn, each mask shape alone, a tuple of two terms with a mask, GQA and MQA,
causal and a two-sided window, Lq > Lk with fully hidden rows, Lq = 0 and Lk = 0, head
dims 8, 128 and 256, dv != d, and a 5-D Evoformer pair.  Prints one line per case and
the family that ran it, then a summary; exits 1 on any failure.
"""

from __future__ import annotations

import sys
import time
import traceback
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import cupyflash  # noqa: E402
from cupyflash import _dispatch  # noqa: E402
from cupyflash._options import KernelOptions  # noqa: E402
from cupyflash.emulator import EmulatorExecutor  # noqa: E402

from _util import LaunchSpy, bfloat16, random_array  # noqa: E402
from _terms_util import check_backward, check_forward  # noqa: E402

HALF = [np.dtype(np.float16)] + ([bfloat16] if bfloat16 is not None else [])
CONFIGS = [  # name, arch, options, dtypes, precision
    ("simt sm_80", 80, {}, [np.dtype(np.float32), np.dtype(np.float64)], "ieee"),
    ("simt sm_90", 90, {}, [np.dtype(np.float32), np.dtype(np.float64)], "ieee"),
    ("mma sm_80", 80, {}, HALF, "ieee"),
    ("mma sm_90", 90, {}, HALF, "ieee"),
    ("wgmma sm_90", 90, {"wgmma": True}, HALF, "ieee"),
    ("tf32x3 sm_80", 80, {}, [np.dtype(np.float32)], "tf32x3"),
    ("tf32x3 sm_90", 90, {}, [np.dtype(np.float32)], "tf32x3"),
    ("dmma sm_80", 80, {"dmma": {"float64", "float32"}}, [np.dtype(np.float64), np.dtype(np.float32)], "ieee"),
    ("dmma sm_90", 90, {"dmma": {"float64", "float32"}}, [np.dtype(np.float64), np.dtype(np.float32)], "ieee"),
]
BIAS_DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)] + ([bfloat16] if bfloat16 else [])


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def cases():
    """(name, sizes, make_terms(rng, dtype_index), keywords) of every case."""
    B, H, LQ, LK = 2, 4, 37, 53
    base = dict(B=B, HQ=H, HKV=H, LQ=LQ, LK=LK, d=64, dv=64)
    shapes = {"11qk": (1, 1, LQ, LK), "b11k": (B, 1, 1, LK), "1hqk": (1, H, LQ, LK), "bhqk": (B, H, LQ, LK)}
    out = []
    for i, (name, shape) in enumerate(shapes.items()):
        out.append((f"bias {name}", base, lambda rng, s=shape, i=i: dict(
            bias=random_array(rng, s, BIAS_DTYPES[i % len(BIAS_DTYPES)])), dict(causal=True)))
    for name, shape in shapes.items():
        out.append((f"mask {name} window", base, lambda rng, s=shape: dict(mask=rng.random(s) < 0.6),
                    dict(window=(5, 9))))

    def pair(rng, b11k=(B, 1, 1, LK), hqk=(H, LQ, LK), mask=(B, 1, LQ, LK)):
        return dict(bias=(random_array(rng, b11k, np.float16), random_array(rng, hqk, np.float32)),
                    mask=rng.random(mask) < 0.7)
    out.append(("tuple + mask, GQA 2:1, causal", {**base, "HKV": 2}, pair, dict(causal=True, enable_gqa=True)))
    out.append(("tuple + mask, MQA", {**base, "HKV": 1}, pair, dict(enable_gqa=True)))
    out.append(("Lq > Lk, causal (hidden rows)", {**base, "LQ": LK, "LK": LQ},
                lambda rng: pair(rng, (B, 1, 1, LQ), (H, LK, LQ), (B, 1, LK, LQ)), dict(causal=True)))
    out.append(("Lq = 0", {**base, "LQ": 0}, lambda rng: pair(rng, (B, 1, 1, LK), (H, 0, LK), (B, 1, 0, LK)), {}))
    out.append(("Lk = 0", {**base, "LK": 0}, lambda rng: pair(rng, (B, 1, 1, 0), (H, LQ, 0), (B, 1, LQ, 0)), {}))
    for d in (8, 128, 256):
        out.append((f"d = {d}", {**base, "d": d, "dv": d}, pair, dict(causal=True)))
    out.append(("dv != d", {**base, "dv": 32}, pair, dict(causal=True)))
    out.append(("Evoformer 5-D pair", {**base, "N": 3, "LQ": 20, "LK": 20, "HQ": 2, "HKV": 2},
                lambda rng: dict(bias=(random_array(rng, (B, 3, 1, 1, 20), np.float32),
                                       random_array(rng, (B, 1, 2, 20, 20), np.float16))), {}))
    return out


def run_case(name, sizes, make_terms, kw, config, dtype):
    _, arch, options, _, precision = config
    spy = LaunchSpy(EmulatorExecutor(arch=arch, seed=arch, shuffle=True, race_check=True))
    _dispatch.executor_for = lambda backend: spy
    chosen = KernelOptions(**options)
    KernelOptions.from_environment = classmethod(lambda cls, environ=None: chosen)
    rng = _rng(name, config[0], dtype.name)
    s = sizes
    lead = (s["B"], s["N"]) if "N" in s else (s["B"],)
    q = random_array(rng, lead + (s["HQ"], s["LQ"], s["d"]), dtype)
    k = random_array(rng, lead + (s["HKV"], s["LK"], s["d"]), dtype)
    v = random_array(rng, lead + (s["HKV"], s["LK"], s["dv"]), dtype)
    dout = random_array(rng, lead + (s["HQ"], s["LQ"], s["dv"]), dtype)
    kw = {**kw, **make_terms(rng)}
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, precision=precision, **kw)
    check_forward(out, lse, q, k, v, precision, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", precision=precision, **kw)
    check_backward(grads, dout, q, k, v, out, lse, precision, **kw)
    return sorted({n.split("<")[0].removeprefix("cf::") for n in spy.launched})


def sweep(argv, cases, run_case, width=32) -> int:
    """Run ``run_case(case, config, dtype)`` for every configuration whose name contains one
    of the words in ``argv[1:]`` (all without), every dtype and every case of ``cases()``
    (tuples whose first item is the name); print a line per case and a summary; 1 on any
    failure."""
    words = argv[1:]
    configs = [c for c in CONFIGS if not words or any(w in c[0] for w in words)]
    failures = ran = 0
    start = time.perf_counter()
    for config in configs:
        for dtype in config[3]:
            for case in cases():
                t = time.perf_counter()
                try:
                    families = run_case(case, config, dtype)
                    status = "ok    "
                except Exception:  # noqa: BLE001 - report and go on
                    failures += 1
                    families = []
                    status = "FAILED"
                    traceback.print_exc()
                ran += 1
                print(f"{status} {config[0]:13s} {dtype.name:9s} {case[0]:{width}s} {', '.join(families):60s} "
                      f"{time.perf_counter() - t:5.1f} s", flush=True)
    print(f"{ran} cases, {failures} failed, {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


def main(argv) -> int:
    return sweep(argv, cases, lambda case, config, dtype: run_case(*case, config, dtype))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
