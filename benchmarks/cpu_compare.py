"""The CPU path beside naive NumPy and PyTorch's CPU SDPA: issue 33's table in one command.

    python benchmarks/cpu_compare.py            # about 8 minutes on a busy 2-core machine

writes ``benchmarks/results/<date>-cpu-<N>core-compare.md`` and the raw numbers to
``benchmarks/results/cpu-compare/<date>-cpu-<N>core.json`` (a folder of its own: the
results JSON beside the Markdown is ``bench``'s format, which the plot scripts read).
Every case runs in two BLAS settings, each in its own process (the setting
must be in place before NumPy loads): the default, and
``OPENBLAS_NUM_THREADS=1``; and in each of them on an otherwise idle machine
and with one competing CPU-bound process, which this script starts itself
(a one-thread NumPy matmul loop: what a shared server looks like).

Cases (float32): forward 1 head L = 4096 d = 64; 16 heads L = 1024 d = 64;
causal 1 head L = 4096 d = 64; a Llama-style prefill (32 query heads, 8 key/value
heads, L = 1024, d = 128, causal, GQA); the backward at 1 head L = 4096 d = 64;
a sliding window (L = 20,000, window (256, 0)) against a hand-written loop over
256-row bands; and cupyflash's peak extra memory at L = 32768 (tracemalloc).

Implementations are timed interleaved (repeat r of each, then repeat r + 1),
after one warm-up call each; the table gives medians (default 7 repeats).
``naive`` is :func:`cupyflash.reference.naive_attention` with ``oracle=False``
(matmul, softmax in place, matmul), the same code that ``python -m cupyflash`` and
``bench`` time.
PyTorch is ``scaled_dot_product_attention`` on the same buffers
(``torch.from_numpy``), best of its CPU backends per case (``flash`` and ``math``,
each timed); its backward is ``torch.autograd.grad`` on a graph built once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPETITOR = ("import numpy as np\n"
              "a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)\n"
              "while True:\n"
              "    a @ a\n")

# name: (Hq, Hkv, L, d, causal, backward, issue's target: at most this x PyTorch's time idle)
CASES = {
    "1 head L=4096": (1, 1, 4096, 64, False, False, 1.15),
    "16 heads L=1024": (16, 16, 1024, 64, False, False, 1.15),
    "causal L=4096": (1, 1, 4096, 64, True, False, 1.15),
    "Llama prefill 32q/8kv L=1024 d=128 causal": (32, 8, 1024, 128, True, False, 1.15),
    "backward L=4096": (1, 1, 4096, 64, False, True, 1.3),
}
WINDOW_L, WINDOW = 20_000, (256, 0)


def band_loop(q, k, v, left, band=256):
    """Sliding-window attention by hand: for each ``band``-row slice of queries, the keys it
    may see ([i - left, i]) in one matmul, a masked softmax in place, one matmul (naive
    attention as written, on the band: its last query sees its last key, so window
    ``(left, 0)`` is the band's own mask)."""
    import numpy as np

    from cupyflash.reference import naive_attention

    length, d = q.shape
    out = np.empty_like(q)
    for r0 in range(0, length, band):
        r1 = min(r0 + band, length)
        c0 = max(0, r0 - left)
        out[r0:r1] = naive_attention(q[r0:r1], k[c0:r1], v[c0:r1], window=(left, 0), oracle=False)
    return out


def _impls(name, rng):
    """{implementation: callable} for one case, on one set of inputs."""
    import numpy as np
    import torch

    import cupyflash
    from cupyflash.reference import naive_attention, naive_attention_backward

    hq, hkv, length, d, causal, backward, _ = CASES[name]
    q = rng.standard_normal((1, hq, length, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, hkv, length, d), dtype=np.float32) for _ in range(2))
    gqa = hq != hkv
    naive_kv = (np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)) if gqa else (k, v)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = torch.nn.attention.SDPBackend
    impls = {}
    if not backward:
        impls["cupyflash"] = lambda: cupyflash.attention(q, k, v, causal=causal, enable_gqa=gqa)
        # GQA for the naive code: k, v repeated to the query heads beforehand (not timed)
        impls["naive"] = lambda: naive_attention(q, *naive_kv, causal=causal, oracle=False)
        for backend in ("FLASH_ATTENTION", "MATH"):
            def run(backend=backend):
                with torch.nn.attention.sdpa_kernel(getattr(backends, backend)), torch.no_grad():
                    return sdpa(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
            impls[f"torch-{backend.lower()}"] = run
        return impls
    out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    impls["cupyflash"] = lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    impls["naive"] = lambda: naive_attention_backward(dout, q, k, v, causal=causal, oracle=False)
    tdout = torch.from_numpy(dout)
    for backend in ("FLASH_ATTENTION", "MATH"):
        leaves = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]
        with torch.nn.attention.sdpa_kernel(getattr(backends, backend)):
            graph = sdpa(*leaves, is_causal=causal)
        impls[f"torch-{backend.lower()}"] = (
            lambda graph=graph, leaves=leaves: torch.autograd.grad(graph, leaves, tdout,
                                                                   retain_graph=True))
    return impls


def _window_impls(rng):
    import numpy as np

    import cupyflash

    q, k, v = (rng.standard_normal((WINDOW_L, 64), dtype=np.float32) for _ in range(3))
    return {"cupyflash": lambda: cupyflash.attention(q, k, v, window=WINDOW),
            "band loop": lambda: band_loop(q, k, v, WINDOW[0])}


def _interleaved(impls, repeat):
    for fn in impls.values():
        fn()                                    # warm-up
    times = {name: [] for name in impls}
    for _ in range(repeat):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _gemm_gflops():
    import numpy as np

    a = np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(3))
    return 2 * 2048**3 / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child(repeat: int) -> dict:
    """One BLAS setting: idle, then with a competing process; JSON on stdout."""
    import numpy as np
    import threadpoolctl
    import torch

    from cupyflash import _threads

    result = dict(blas=[{k: lib[k] for k in ("internal_api", "version", "num_threads")}
                        for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"],
                  cupyflash_threads=_threads.num_threads(), torch_threads=torch.get_num_threads(),
                  gemm_gflops=_gemm_gflops(), modes={})
    for mode in ("idle", "loaded"):
        competitor = None
        if mode == "loaded":
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
            competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env)
            time.sleep(1.0)
        try:
            rng = np.random.default_rng(0)
            rows = {name: _interleaved(_impls(name, rng), repeat) for name in CASES}
            rows["window"] = _interleaved(_window_impls(rng), repeat)
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
        result["modes"][mode] = rows
        print(f"  {mode}: done", file=sys.stderr, flush=True)
    return result


def peak_memory_mib(length=32768, d=64) -> float:
    """cupyflash's peak extra memory (tracemalloc, the result included) for one head."""
    import numpy as np

    import cupyflash

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((length, d), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        cupyflash.attention(q, k, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak / 2**20


def _machine() -> dict:
    from cupyflash._bench import _cpu_info

    info = _cpu_info()
    info["cores"] = len(os.sched_getaffinity(0))
    info["loadavg_at_start"] = os.getloadavg()
    # settings that change BLAS speed or cupyflash's thread count, as this run saw them
    info["env"] = {name: os.environ.get(name) for name in (
        "CUPYFLASH_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
        "OPENBLAS_L2_SIZE")}
    return info


def _versions() -> dict:
    import numpy
    import torch

    import cupyflash

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.strip()
    return dict(cupyflash=cupyflash.__version__, revision=rev or None, numpy=numpy.__version__,
                torch=torch.__version__, python=platform.python_version())


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# CPU path beside naive NumPy and PyTorch CPU SDPA ({doc['date']})", "",
             f"- CPU: {m['model']} (family {m['family']}, model {m['model_number']}; "
             f"{', '.join(m['features'])}), {m['cores']} cores usable; load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}",
             f"- environment: {', '.join(f'{k}={v}' for k, v in m['env'].items() if v) or 'none set'}",
             f"- command: `{doc['command']}` ({doc['seconds']:.0f} s); float32; median of "
             f"{doc['repeat']} interleaved repeats after a warm-up",
             f"- peak extra memory of cupyflash, one head L = 32768 d = 64 (tracemalloc): "
             f"{doc['peak_mib']:.1f} MiB (target < 64)", ""]
    for setting, res in doc["settings"].items():
        blas = "; ".join(f"{b['internal_api']} {b['version']} {b['num_threads']} threads"
                         for b in res["blas"])
        lines += [f"## BLAS setting: {setting}", "",
                  f"GEMM (2048^3 float32, best of 3, idle): {res['gemm_gflops']:.1f} GFLOP/s; "
                  f"BLAS: {blas}; cupyflash threads: {res['cupyflash_threads']}; "
                  f"PyTorch threads: {res['torch_threads']}.", ""]
        for mode, rows in res["modes"].items():
            lines += [f"### {'idle machine' if mode == 'idle' else 'one competing CPU-bound process'}",
                      "", "| case | cupyflash ms | naive ms | PyTorch ms (best) | cupyflash / PyTorch "
                      "| target | naive / cupyflash |", "|---|---|---|---|---|---|---|"]
            for name, (*_, target) in CASES.items():
                t = rows[name]
                torch_best = min(t["torch-flash_attention"], t["torch-math"])
                which = "flash" if t["torch-flash_attention"] <= t["torch-math"] else "math"
                limit = target if mode == "idle" else 1.5
                lines.append(f"| {name} | {t['cupyflash'] * 1e3:.1f} | {t['naive'] * 1e3:.1f} | "
                             f"{torch_best * 1e3:.1f} ({which}) | {t['cupyflash'] / torch_best:.2f}x "
                             f"| <= {limit}x | {t['naive'] / t['cupyflash']:.2f}x |")
            w = rows["window"]
            lines += ["", f"Sliding window L = {WINDOW_L}, window {WINDOW}: cupyflash "
                      f"{w['cupyflash'] * 1e3:.1f} ms, 256-row band loop {w['band loop'] * 1e3:.1f} ms "
                      f"(band loop / cupyflash {w['band loop'] / w['cupyflash']:.2f}x).", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed repeats per case (median)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="folder for the .md and .json files")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        json.dump(child(args.repeat), sys.stdout)
        return 0
    start = time.perf_counter()
    doc = dict(date=dt.date.today().isoformat(), machine=_machine(), versions=_versions(),
               repeat=args.repeat, command="python benchmarks/cpu_compare.py"
               + (f" --repeat {args.repeat}" if args.repeat != 7 else ""), settings={})
    for setting, env in (("default", {}), ("OPENBLAS_NUM_THREADS=1", {"OPENBLAS_NUM_THREADS": "1"})):
        print(f"{setting}:", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", "--repeat", str(args.repeat)],
                              env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True,
                              check=True)
        doc["settings"][setting] = json.loads(proc.stdout)
    doc["peak_mib"] = peak_memory_mib()
    doc["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{doc['date']}-cpu-{doc['machine']['cores']}core"
    (out / "cpu-compare").mkdir(parents=True, exist_ok=True)
    (out / "cpu-compare" / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n",
                                                      encoding="utf-8")
    (out / f"{name}-compare.md").write_text(markdown(doc), encoding="utf-8")
    print(markdown(doc))
    print(f"wrote {out / name}-compare.md and {out / 'cpu-compare' / name}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
