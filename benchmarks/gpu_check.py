"""Forward-attention timing table on a GPU: cupyflash vs naive CuPy vs PyTorch SDPA.

Run by ``benchmarks/gpu_check.sh`` (which also runs ``pytest -m gpu``); can be
run alone from the checkout root: ``PYTHONPATH=. python benchmarks/gpu_check.py``.

Every case times, on the same random inputs and in the same process:

- ``cupyflash``: :func:`cupyflash.attention` (the CUDA kernels);
- ``cupy-naive``: ``softmax(q kᵀ · scale) v`` with CuPy matmuls (scores in float32
  for 16-bit inputs), which materialises the Lq × Lk matrix;
- ``torch-sdpa`` and, per backend, ``torch-flash`` / ``torch-efficient`` /
  ``torch-cudnn`` / ``torch-math``: ``torch.nn.functional.scaled_dot_product_attention``
  on the same buffers (zero-copy through DLPack), where PyTorch is importable.

Times are CUDA-event times from ``cupyx.profiler.benchmark`` (warm-up first,
median of the repeats).  TFLOP/s uses FlashAttention's count
``4·B·H·Lq·Lk·d``, halved for causal.  PyTorch's ``is_causal`` is top-left
aligned and cupyflash's bottom-right; the cases here have Lq == Lk, where
they agree.  Writes ``benchmarks/results/<date>-<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# (dtype, B, H, L, d, causal).  Sizes fill an H100/H200-class GPU (B·H >= 32
# CTAs rows per SM wave at L=4096) and stay within a few GB for the naive peer.
CASES = [
    ("bfloat16", 2, 16, 4096, 128, False),
    ("bfloat16", 2, 16, 4096, 128, True),
    ("float16", 4, 16, 2048, 64, False),
    ("float16", 4, 16, 2048, 64, True),
    ("float16", 1, 16, 16384, 128, True),
    ("float32", 2, 8, 2048, 64, False),
    ("float64", 1, 8, 1024, 64, False),
]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def flops(b, h, lq, lk, d, causal) -> float:
    f = 4.0 * b * h * lq * lk * d
    return f / 2 if causal else f


def environment() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def version(v):
        return f"{v // 1000}.{(v % 1000) // 10}"

    env = dict(
        gpu=name,
        compute_capability=f"{props['major']}.{props['minor']}",
        multiprocessors=props["multiProcessorCount"],
        memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        driver=version(cupy.cuda.runtime.driverGetVersion()),
        cuda_runtime=version(cupy.cuda.runtime.runtimeGetVersion()),
        nvrtc=".".join(map(str, cupy.cuda.compiler._get_nvrtc_version())),
        cupy=cupy.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        torch=None,
    )
    try:
        smi = shutil.which("nvidia-smi")
        if smi:
            import subprocess

            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            if out:
                env["driver_version"] = out.splitlines()[0]
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import torch

        env["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


def _time(fn, n_repeat: int, n_warmup: int, max_seconds: float) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds."""
    from cupyx.profiler import benchmark

    result = benchmark(fn, (), n_repeat=n_repeat, n_warmup=n_warmup, max_duration=max_seconds)
    return float(np.median(result.gpu_times[0]) * 1e3)


def _peak_bytes(fn) -> int:
    """Device memory one call takes from a fresh CuPy pool (the pool only grows)."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.cuda.MemoryPool()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        result = fn()
        cupy.cuda.Device().synchronize()
        del result
        return int(pool.total_bytes())
    finally:
        cupy.cuda.set_allocator(previous)
        pool.free_all_blocks()


def naive_cupy(q, k, v, scale, causal):
    import cupy

    s = cupy.matmul(q, k.swapaxes(-1, -2)).astype(cupy.float32 if q.itemsize < 4 else q.dtype)
    s *= scale
    if causal:
        lq, lk = s.shape[-2:]
        mask = cupy.tri(lq, lk, lk - lq, dtype=bool)
        s = cupy.where(mask, s, -cupy.inf)
    s -= s.max(axis=-1, keepdims=True)
    cupy.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return cupy.matmul(s.astype(q.dtype), v)


def torch_peers(q, k, v, causal):
    """{name: callable} for PyTorch SDPA (default choice and each backend), or {}."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # noqa: BLE001 - torch is optional
        return {}
    if not torch.cuda.is_available():
        return {}
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    peers = {"torch-sdpa": lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001 - older torch
        return peers
    for name, backend in (("torch-flash", "FLASH_ATTENTION"), ("torch-efficient", "EFFICIENT_ATTENTION"),
                          ("torch-cudnn", "CUDNN_ATTENTION")):
        kind = getattr(SDPBackend, backend, None)
        if kind is None:
            continue

        def run(kind=kind):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        peers[name] = run
    return peers


def gemm_tflops() -> float | None:
    """Dense bf16 (else fp16) GEMM rate on random 8192³ operands, for the ratio column."""
    import cupy

    n = 8192
    x = cupy.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    for name in ("bfloat16", "float16"):
        try:
            a = x.astype(_dtype(name))
            b = a.T.copy()
            ms = _time(lambda a=a, b=b: cupy.matmul(a, b), 20, 3, 2.0)
            return 2.0 * n**3 / (ms * 1e-3) / 1e12
        except Exception:  # noqa: BLE001 - dtype not supported by this CuPy/cuBLAS
            continue
    return None


def run_case(dtype_name, b, h, length, d, causal, *, n_repeat, max_seconds, peers=True):
    import cupy

    import cupyflash

    dtype = _dtype(dtype_name)
    rng = np.random.default_rng(0)
    shape = (b, h, length, d)
    q, k, v = (cupy.asarray(rng.standard_normal(shape, np.float32).astype(dtype)) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    work = flops(b, h, length, length, d, causal)
    candidates = {"cupyflash": lambda: cupyflash.attention(q, k, v, causal=causal)}
    scores_bytes = b * h * length * length * 4
    free = cupy.cuda.runtime.memGetInfo()[0]
    if peers and 3 * scores_bytes < free:
        candidates["cupy-naive"] = lambda: naive_cupy(q, k, v, scale, causal)
    if peers and dtype_name in ("float16", "bfloat16", "float32"):
        try:
            candidates.update(torch_peers(q, k, v, causal))
        except Exception:  # noqa: BLE001
            pass
    rows = []
    for name, fn in candidates.items():
        row = dict(impl=name, dtype=dtype_name, B=b, H=h, Lq=length, Lk=length, d=d, causal=causal)
        try:
            ms = _time(fn, n_repeat, 5, max_seconds)
            row.update(ms=round(ms, 4), tflops=round(work / (ms * 1e-3) / 1e12, 2))
            if name in ("cupyflash", "cupy-naive"):
                row["peak_bytes"] = _peak_bytes(fn)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this case
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return rows


def markdown(env: dict, rows: list, gemm: float | None, tests: dict | None) -> str:
    lines = [f"# cupyflash forward attention on {env['gpu']}", ""]
    lines.append(f"{env['date']}; driver {env.get('driver_version', env['driver'])}, CUDA runtime "
                 f"{env['cuda_runtime']}, NVRTC {env['nvrtc']}, CuPy {env['cupy']}, NumPy "
                 f"{env['numpy']}, PyTorch {env['torch'] or 'not installed'}, Python {env['python']}.")
    if gemm:
        lines.append(f"Dense 16-bit GEMM (8192³, CuPy/cuBLAS): {gemm:.0f} TFLOP/s.")
    if tests:
        lines.append(f"`pytest -m gpu`: {tests.get('summary', 'not run')}.")
    lines += ["", "Median CUDA-event time; TFLOP/s = 4·B·H·Lq·Lk·d / time (half for causal).", "",
              "| dtype | B | H | L | d | causal | impl | ms | TFLOP/s | % GEMM | peak MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            cells = ["—", r["error"][:60], "", ""]
        else:
            pct = f"{100 * r['tflops'] / gemm:.0f}" if gemm else ""
            peak = f"{r['peak_bytes'] / 2**20:.0f}" if "peak_bytes" in r else ""
            cells = [f"{r['ms']:.3f}", f"{r['tflops']:.1f}", pct, peak]
        lines.append("| " + " | ".join([r["dtype"], str(r["B"]), str(r["H"]), str(r["Lq"]), str(r["d"]),
                                        "yes" if r["causal"] else "no", r["impl"]] + cells) + " |")
    return "\n".join(lines) + "\n"


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
    args = p.parse_args(argv)
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001
        print(f"gpu_check: no usable GPU ({type(e).__name__}: {e}); nothing timed.")
        return 0
    start = time.perf_counter()
    env = environment()
    print(f"gpu_check: {env['gpu']} (cc {env['compute_capability']}), driver {env['driver']}, "
          f"CuPy {env['cupy']}, PyTorch {env['torch']}", flush=True)
    gemm = gemm_tflops()
    cases = CASES[2:3] + CASES[5:6] if args.quick else CASES
    rows = []
    for i, case in enumerate(cases):
        left = args.budget - (time.perf_counter() - start)
        if left < 5:
            print(f"gpu_check: time budget spent; skipped {len(cases) - i} cases", flush=True)
            break
        per_impl = max(0.5, min(3.0, left / (len(cases) - i) / 8))
        case_rows = run_case(*case, n_repeat=10 if args.quick else 50, max_seconds=per_impl)
        for r in case_rows:
            status = r.get("error") or f"{r['ms']:.3f} ms  {r['tflops']:.1f} TFLOP/s"
            print(f"  {r['dtype']:>8} B={r['B']} H={r['H']} L={r['Lq']} d={r['d']} "
                  f"causal={r['causal']!s:5} {r['impl']:>15}: {status}", flush=True)
        rows += case_rows
    tests = test_summary(args.junit, args.test_rc) if args.junit else None
    result = dict(env, gemm_tflops=gemm and round(gemm, 1), tests=tests, rows=rows,
                  seconds=round(time.perf_counter() - start, 1))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
    stem = out_dir / f"{_dt.date.today().isoformat()}-{slug}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(env, rows, gemm, tests)
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
