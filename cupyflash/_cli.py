"""``python -m cupyflash``: check the installation and time attention on this machine.

Subcommands
-----------
(none)     versions, GPUs, a correctness check of every available backend against
           the float64 oracle, and a small timing table.
kernels    the static kernel report (see ``python -m cupyflash kernels --help``).
bench      cupyflash beside naive attention and PyTorch (``python -m cupyflash bench --help``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

import cupyflash
from cupyflash import reference
from cupyflash._bench import gpus, time_call


def _versions() -> list[tuple[str, str]]:
    rows = [("cupyflash", cupyflash.__version__), ("python", platform.python_version()),
            ("numpy", np.__version__)]
    import scipy

    rows.append(("scipy", scipy.__version__))
    for name in ("cupy", "ml_dtypes", "torch"):
        try:
            mod = __import__(name)
            rows.append((name, getattr(mod, "__version__", "?")))
        except Exception:  # noqa: BLE001 - an optional package that fails to import is "not installed"
            rows.append((name, "not installed"))
    return rows


def _emulator_status() -> tuple[bool, str]:
    try:
        from cupyflash.emulator import emulator_available

        return emulator_available()
    except ImportError as exc:
        return False, str(exc)


def _check_backend(backend: str, rng) -> str:
    """Run a few random cases against the oracle; returns 'ok' or the failure."""
    cases = [
        dict(q=(2, 3, 37, 40), k=(2, 3, 50, 40), v=(2, 3, 50, 24), kw=dict(causal=True)),
        dict(q=(4, 19, 64), k=(2, 19, 64), v=(2, 19, 64), kw=dict(enable_gqa=True, window=(4, 2))),
    ]
    worst = 0.0
    for case in cases:
        q, k, v = (rng.standard_normal(case[n]).astype(np.float32) for n in "qkv")
        if backend == "cuda":
            import cupy

            out = cupy.asnumpy(cupyflash.attention(*(cupy.asarray(x) for x in (q, k, v)), **case["kw"]))
        else:
            out = cupyflash.attention(q, k, v, backend=backend, **case["kw"])
        expected = reference.naive_attention(q, k, v, **case["kw"])
        worst = max(worst, float(np.max(np.abs(out - expected))))
    return "ok" if worst < 1e-4 else f"FAILED (max error {worst:.3g})"


def _median_time(fn, repeat=5) -> float:
    """Median seconds per call after a warm-up call, timed as ``bench`` times on the CPU."""
    return float(np.median(time_call(fn, "cpu", repeat=repeat)))


def _timing_table(rng, lengths=(1024, 4096), d=64) -> list[str]:
    lines = ["| L | d | dtype | cupyflash CPU path (ms) | naive NumPy (ms) | speed-up |",
             "|---|---|---|---|---|---|"]
    for n in lengths:
        q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
        t_flash = _median_time(lambda: cupyflash.attention(q, k, v))
        t_naive = _median_time(lambda: reference.naive_attention(q, k, v, oracle=False))
        lines.append(f"| {n} | {d} | float32 | {t_flash * 1e3:.1f} | {t_naive * 1e3:.1f} | "
                     f"{t_naive / t_flash:.2f}x |")
    return lines


def _gpu_timing_table(lengths=(1024, 4096), d=64) -> list[str]:
    import cupy
    from cupyx.profiler import benchmark

    lines = ["| L | d | dtype | cupyflash GPU (ms) | naive CuPy (ms) | speed-up |",
             "|---|---|---|---|---|---|"]
    for n in lengths:
        for dtype in (np.float16, np.float32):
            q, k, v = (cupy.random.standard_normal((8, n, d), dtype=np.float32).astype(dtype)
                       for _ in range(3))

            t_f = float(np.median(benchmark(cupyflash.attention, (q, k, v), n_repeat=10).gpu_times))
            t_n = float(np.median(benchmark(reference.naive_attention, (q, k, v), {"oracle": False},
                                            n_repeat=10).gpu_times))
            lines.append(f"| {n} | {d} | {np.dtype(dtype).name} (8 heads) | {t_f * 1e3:.3f} | "
                         f"{t_n * 1e3:.3f} | {t_n / t_f:.2f}x |")
    return lines


SUBCOMMANDS = (
    ("(none)", "check the installation: versions, GPUs, every backend against the float64 "
               "oracle, a timing table"),
    ("kernels", "the static kernel report: registers, shared memory, spills, occupancy, SASS "
                "mix of every kernel (NVRTC, no GPU needed)"),
    ("bench", "time cupyflash beside naive attention and PyTorch on this machine, as a "
              "table or JSON"),
)


def _parser() -> argparse.ArgumentParser:
    epilog = "subcommands:\n" + "\n".join(f"  {name:<9} {line}" for name, line in SUBCOMMANDS)
    epilog += "\n\n'python -m cupyflash SUBCOMMAND --help' shows a subcommand's options."
    parser = argparse.ArgumentParser(prog="python -m cupyflash [SUBCOMMAND]",
                                     description="Check the installation and time attention.",
                                     epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
    return parser


def _note(message: str) -> None:
    """Progress on stderr (stdout is the report)."""
    print(message, file=sys.stderr, flush=True)


def check(argv=None) -> int:
    args = _parser().parse_args(argv)
    rng = np.random.default_rng(0)
    print("cupyflash installation check\n")
    for name, version in _versions():
        print(f"  {name:<10} {version}")
    found = gpus()
    print("\nGPU(s): " + ("; ".join(found) if found else "no GPU: CPU path"))
    emu_ok, emu_reason = _emulator_status()
    print(f"CUDA emulator: {'available' if emu_ok else 'unavailable (' + emu_reason + ')'}")

    print("\nCorrectness against the float64 oracle (float32 inputs):")
    failed = False
    backends = ["numpy"] + (["emulator"] if emu_ok else []) + (["cuda"] if found else [])
    for backend in backends:
        if backend == "emulator":
            _note("  (the emulator compiles its kernels with g++ on the first run: 10-20 s, "
                  "cached after)")
        t0 = time.perf_counter()
        try:
            status = _check_backend(backend, rng)
        except Exception as exc:  # noqa: BLE001 - report any backend failure and go on
            status = f"FAILED ({type(exc).__name__}: {exc})"
        failed |= status != "ok"
        print(f"  {backend:<9} {status}  ({time.perf_counter() - t0:.1f} s)")

    if not args.no_timing:
        _note("  (timing: about 10 s)")
        print("\nTiming, one head, median of 5 (CPU; naive = cupyflash.reference.naive_attention with "
              "oracle=False, as in bench):")
        print("\n".join(_timing_table(rng)))
        if found:
            print("\nTiming on the GPU (CUDA events, median of 10):")
            print("\n".join(_gpu_timing_table()))
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "kernels":
        from ._report import main_kernels

        return main_kernels(argv[1:])
    if argv and argv[0] == "bench":
        from ._bench import main_bench

        return main_bench(argv[1:])
    return check(argv)
