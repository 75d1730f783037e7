"""Render results files (``python -m cupyflash bench --json``) into PNG plots for the docs.

    python benchmarks/plot_results.py                      # every benchmarks/results/*.json
    python benchmarks/plot_results.py FILE.json ... --out DIR

For each results file ``<stem>.json`` and each pass (forward, backward) it writes
into ``docs/_static/perf/`` (or ``--out``):

- ``<stem>-<pass>-<dtype>-d<d>-b<B>h<H>.png``: throughput (TFLOP/s on a GPU,
  GFLOP/s on the CPU; FlashAttention's FLOP count) against the sequence
  length, one line per implementation, solid without and dashed with the
  causal mask -- cupyflash and its peers from the same run;
- ``<stem>-<pass>-memory.png``: peak extra memory of one call against the
  sequence length (log-log), one line per implementation, dtype, head dim,
  batch x heads and mask.

Only rows with Lq == Lk are plotted.  Needs matplotlib (the ``bench`` extra);
without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "_static" / "perf"


def _series(rows, key):
    """{label: [(L, y), ...]} over the rows with a value for ``key``, sorted by L."""
    lines = defaultdict(list)
    for r in rows:
        if r.get(key) is None or r.get("error") or r["Lq"] != r["Lk"]:
            continue
        label = r["impl"] + (f" ({r['kernel']})" if r.get("kernel") else "")
        lines[label, r["causal"]].append((r["Lq"], r[key]))
    return {k: sorted(v) for k, v in lines.items()}


def _colors(keys) -> dict:
    """One colour per implementation (its causal line shares it, dashed)."""
    return {key: f"C{i % 10}" for i, key in enumerate(sorted(set(keys)))}


def _title(doc: dict) -> str:
    if doc.get("device") == "gpu":
        return f"{doc['gpu']}, {doc.get('date', '')[:10]}"
    return f"CPU only: {doc.get('cpu')} x {doc.get('cpu_count')}, {doc.get('date', '')[:10]}"


def _style(ax, xlabel, ylabel, title, log_y=False):
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_file(path: Path, out_dir: Path, plt) -> list[Path]:
    """Write the PNGs of one results file; returns their paths."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    gpu = doc.get("device") == "gpu"
    scale, unit = (1.0, "TFLOP/s") if gpu else (1e3, "GFLOP/s")
    written = []
    for pass_name in ("forward", "backward"):
        rows = [r for r in doc.get("rows", []) if r["pass"] == pass_name]
        if not rows:
            continue
        groups = defaultdict(list)
        for r in rows:
            groups[r["dtype"], r["d"], r["B"], r["H"]].append(r)
        for (dtype, d, b, h), group in sorted(groups.items()):
            lines = _series(group, "tflops")
            if not lines:
                continue
            fig, ax = plt.subplots(figsize=(8.5, 4.2))
            colors = _colors(label for label, _ in lines)
            for (label, causal), points in sorted(lines.items()):
                xs, ys = zip(*points)
                ax.plot(xs, [y * scale for y in ys], marker="o", linestyle="--" if causal else "-",
                        color=colors[label], label=label + (", causal" if causal else ""))
            _style(ax, "sequence length L (Lq = Lk)", unit,
                   f"{pass_name}, {dtype}, d={d}, B={b}, H={h}\n{_title(doc)}")
            target = out_dir / f"{path.stem}-{pass_name}-{dtype}-d{d}-b{b}h{h}.png"
            fig.tight_layout()
            fig.savefig(target, dpi=120)
            plt.close(fig)
            written.append(target)
        memory = defaultdict(list)
        for r in rows:
            if r.get("peak_bytes") is not None and not r.get("error") and r["Lq"] == r["Lk"]:
                key = (r["impl"], r["dtype"], r["d"], r["B"] * r["H"], r["causal"])
                memory[key].append((r["Lq"], r["peak_bytes"] / 2**20))
        if memory:
            fig, ax = plt.subplots(figsize=(8.5, 4.2))
            colors = _colors(key[:4] for key in memory)
            for (impl, dtype, d, bh, causal), points in sorted(memory.items()):
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", linestyle="--" if causal else "-",
                        color=colors[impl, dtype, d, bh],
                        label=f"{impl}, {dtype}, d={d}, B·H={bh}" + (", causal" if causal else ""))
            _style(ax, "sequence length L (Lq = Lk)", "peak extra memory (MiB)",
                   f"{pass_name}: memory of one call\n{_title(doc)}", log_y=True)
            target = out_dir / f"{path.stem}-{pass_name}-memory.png"
            fig.tight_layout()
            fig.savefig(target, dpi=120)
            plt.close(fig)
            written.append(target)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="results JSON files (default: all in "
                   "benchmarks/results/)")
    p.add_argument("--out", type=Path, default=OUT, help="output directory (default "
                   "docs/_static/perf)")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is not installed (pip install '.[bench]'); "
              "nothing plotted.")
        return 0
    files = args.files or sorted(RESULTS.glob("*.json"))
    if not files:
        print(f"plot_results: no results files in {RESULTS}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for path in files:
        for target in plot_file(path, args.out, plt):
            print(f"plot_results: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
