"""Forward-attention timing table on a GPU: cupyflash vs naive CuPy vs PyTorch SDPA.

Run by ``benchmarks/gpu_check.sh`` (which also runs ``pytest -m gpu``); can be
run alone from the checkout root: ``PYTHONPATH=. python benchmarks/gpu_check.py``.

The cases below go through :func:`cupyflash._bench.bench`, the function behind
``python -m cupyflash bench`` (one benchmarking implementation): every
implementation on the same random inputs in one process -- ``cupyflash`` (as
dispatched; the row names the kernel family), ``cupyflash-atomic`` (the
backward with ``deterministic=False``), ``cupyflash-v1``, ``cupy-naive``
and PyTorch's ``scaled_dot_product_attention`` as it dispatches and per
backend, zero-copy through DLPack, where PyTorch is importable.  CUDA-event
times (median after a warm-up), FlashAttention's FLOP count, peak device
memory.  PyTorch's ``is_causal`` is top-left aligned and cupyflash's
bottom-right; the cases here have Lq == Lk, where they agree.

Writes ``benchmarks/results/<date>-<gpu>.json`` and ``.md`` (the format of
``python -m cupyflash bench --json``, plus ``tests``: the summary of the
``pytest -m gpu`` run when ``--junit`` is given; see benchmarks/results/README.md)
and copies them to ``$OUT`` when that is set.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# (dtype, B, H, L, d, causal, backward).  The issues' targets first: bf16 d=128 at
# L = 4k..16k forward and 8k backward, bf16 d=64, each non-causal and causal;
# then float16 and the exact dtypes.  B·H·L/block_m >= 1024 CTAs everywhere, so
# an H100/H200 (132 SMs) runs several waves; every case stays within a few
# tens of GB for the naive peers.
CASES = [
    ("bfloat16", 4, 16, 4096, 128, False, False),
    ("bfloat16", 4, 16, 4096, 128, True, False),
    ("bfloat16", 2, 16, 8192, 128, False, False),
    ("bfloat16", 2, 16, 8192, 128, True, False),
    ("bfloat16", 1, 16, 16384, 128, False, False),
    ("bfloat16", 1, 16, 16384, 128, True, False),
    ("bfloat16", 2, 16, 8192, 64, False, False),
    ("bfloat16", 2, 16, 8192, 64, True, False),
    ("bfloat16", 2, 16, 8192, 128, False, True),
    ("bfloat16", 2, 16, 8192, 128, True, True),
    ("float16", 2, 16, 8192, 128, False, False),
    ("float32", 2, 8, 2048, 64, False, False),
    ("float32", 1, 8, 4096, 64, False, True),
    ("float64", 1, 8, 1024, 64, False, False),
    ("float64", 1, 8, 2048, 64, False, True),
]
QUICK = [CASES[0], CASES[8], CASES[11]]
# Grids too small to fill the GPU, which the split-KV forward is for, last:
# decoding steps (Lq = 1) and one head of a long sequence (attention over
# points).  (dtype, B, H, Lq, Lk, d), forward, non-causal.
SMALL_GRID_CASES = [
    ("bfloat16", 1, 32, 1, 16384, 128),
    ("bfloat16", 4, 8, 1, 8192, 64),
    ("float32", 1, 1, 16384, 16384, 64),
    ("float64", 1, 1, 8192, 8192, 64),
]
# The exact dtypes at a short and a long sequence besides the table's, forward and
# backward (issue 5: float32/float64 faster than PyTorch's math backend at every L
# where it fits), after the small grids: (dtype, B, H, L, d, causal, backward).
EXACT_L_CASES = [(dtype, 1, 8, length, 64, False, backward)
                 for dtype in ("float64", "float32") for backward in (False, True) for length in (512, 8192)]


def precompile(workers: int) -> int:
    """Compile every kernel instantiation this GPU can launch into CuPy's on-disk cache,
    ``workers`` processes at a time, so that the test run (and its xdist workers) only
    load modules."""
    import time
    from concurrent.futures import ProcessPoolExecutor

    import cupy

    from cupyflash._kernels import instantiations, launchable

    keep = launchable(int(cupy.cuda.Device(0).compute_capability))
    rows = [(r.entry, r.name_expression) for r in instantiations() if r.name_expression in keep]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        failures = [f for f in pool.map(_compile_one, rows) if f]
    print(f"gpu_check: compiled {len(rows)} instantiations in "
          f"{time.perf_counter() - start:.0f} s with {workers} processes; "
          f"{len(failures)} failed", flush=True)
    for failure in failures:
        print(failure, flush=True)
    return 1 if failures else 0


def _compile_one(row) -> str | None:
    from cupyflash._loader import module_caches

    entry, name = row
    try:
        module_caches.for_device(0).module(entry, (name,))
    except Exception as error:  # noqa: BLE001 - reported, and the tests show it again
        return f"  {entry} {name}: {type(error).__name__}: {str(error)[-2000:]}"
    return None


def test_summary(junit: str, rc: int | None) -> dict:
    """Counts (and failing test names) from a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    summary = dict(exit_status=rc)
    path = Path(junit)
    if not path.is_file():
        summary["summary"] = f"no report (exit status {rc}; timed out?)"
        return summary
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary.update(counts, seconds=float(suite.get("time", 0.0)), failed=failed[:50])
    summary["summary"] = (f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                          f"{counts['skipped']} skipped in {summary['seconds']:.0f} s")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small cases, few repeats")
    p.add_argument("--junit", help="pytest's --junitxml file, summarised into the results")
    p.add_argument("--test-rc", type=int, help="pytest's exit status")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the whole table")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--precompile", type=int, metavar="N",
                   help="only compile every instantiation with N processes, then exit")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.precompile:
        return precompile(args.precompile)
    from cupyflash import _bench

    if not _bench.gpu_available():
        print("gpu_check: no usable GPU (CuPy sees no CUDA device); nothing timed.")
        return 0
    selected = QUICK if args.quick else CASES
    cases = [_bench.Case(dtype, b, h, length, length, d, causal, backward)
             for dtype, b, h, length, d, causal, backward in selected]
    if not args.quick:
        cases += [_bench.Case(dtype, b, h, lq, lk, d) for dtype, b, h, lq, lk, d in SMALL_GRID_CASES]
        cases += [_bench.Case(dtype, b, h, length, length, d, causal, backward)
                  for dtype, b, h, length, d, causal, backward in EXACT_L_CASES]
    doc = _bench.bench(cases, device="gpu", repeat=10 if args.quick else 50, warmup=5,
                       budget_s=args.budget, log=lambda line: print(line, flush=True))
    doc["command"] = shlex.join(["benchmarks/gpu_check.py",
                                 *(sys.argv[1:] if argv is None else argv)])
    if args.junit:
        doc["tests"] = test_summary(args.junit, args.test_rc)
    table = _bench.markdown(doc)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", doc["gpu"].lower()).strip("-")
    stem = out_dir / f"{_dt.date.today().isoformat()}-{slug}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(table)
    print()
    print(table)
    print(f"gpu_check: wrote {stem}.json and {stem}.md")
    out = os.environ.get("OUT")
    if out:
        for suffix in (".json", ".md"):
            shutil.copy(stem.with_suffix(suffix), Path(out) / stem.with_suffix(suffix).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
