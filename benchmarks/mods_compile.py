"""What a new score_mod expression costs before its first launch, without a GPU: the first
process compiles the kernels a call plans (NVRTC, one module per family), a second
process finds them in the disk cache (cupyflash._loader.cached_cubin: the expression
parsed, the module source built and hashed, the cubin read).

    python benchmarks/mods_compile.py [--arch sm_80] [--family fwd_mma --family bwd_mma]

Each expression is new to the cache (an empty temporary CUPY_CACHE_DIR).  Not
measured here: the driver loading the cubin onto a GPU (cuModuleLoadData), which
needs one.  Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPRESSION = "score - gamma[h] * abs(q_idx - kv_idx)"

# Run in a fresh interpreter: times one family's module for one call's rows.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from cupyflash import _loader
from cupyflash._families import family_named
from cupyflash._families._family import Call
from cupyflash._options import KernelOptions
from cupyflash._terms import ScoreOperands
from cupyflash._validation import check_score_functions
t1 = time.perf_counter()
family_name, arch, text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
family = family_named(family_name)
mods = check_score_functions(None, None, text, None, {"gamma": np.ones(8)}, kind="numpy", device=None,
                             batch_shape=(1, 8))
operands = ScoreOperands(mods=mods)
call = Call("float16", 128, 128, None, None, aligned=True, features=operands.features)
names = tuple(r.name_expression for r in family.plan(call, arch, KernelOptions()) if r.family is family)
path, lowered = _loader.cached_cubin(operands.entry(family.entry), names, family.compile_target(f"sm_{arch}"))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "kernels": len(names)}))
"""


def child(family: str, arch: int, text: str, cache: str) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=cache, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", CHILD, family, str(arch), text], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", default=[])
    ap.add_argument("--family", action="append", default=[])
    a = ap.parse_args()
    archs = [int(x.removeprefix("sm_")) for x in a.arch] or [80, 90]
    families = a.family or ["fwd_mma", "bwd_mma"]
    print("| family | arch | kernels | first process: compile (s) | second process: from the cache (ms) "
          "| second process: import cupyflash (ms) |")
    print("|---|---|---|---|---|---|")
    for family in families:
        for arch in archs:
            with tempfile.TemporaryDirectory() as cache:
                first = child(family, arch, EXPRESSION, cache)
                second = child(family, arch, EXPRESSION, cache)
            print(f"| {family} | sm_{arch} | {first['kernels']} | {first['load_s']:.2f} | "
                  f"{1e3 * second['load_s']:.1f} | {1e3 * second['import_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
