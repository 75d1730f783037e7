"""Write the CPU-path results section of docs/performance.md from committed benchmark results.

    python docs/_scripts/cpu_results.py                       # benchmarks/results/*cpu*.json
    python docs/_scripts/cpu_results.py path/to/results.json  # or given files

Reads results documents written by ``python -m cupyflash bench --device cpu
--json PATH`` and replaces the text between the ``cpu-results:begin`` and
``cpu-results:end`` markers of docs/performance.md with, per document, the
machine and software it was measured with and one table of its rows.  With no
results files it writes the note saying that none have been committed, so the
page never shows a number that is not in the repository.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- cpu-results:begin -->", "<!-- cpu-results:end -->"

NONE_YET = """```{note}
The CPU-path figures (cupyflash's CPU path against naive NumPy attention and
PyTorch's CPU `scaled_dot_product_attention`, with peak memory up to
$L$ = 32k) will appear here once the CPU benchmark results are committed
under `benchmarks/results/`. None have been committed yet, so this section
shows no numbers.
```"""


def _fmt(value, spec: str, none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _table(doc: dict) -> list[str]:
    lines = ["| pass | dtype | B·H | Lq | Lk | d | causal | implementation | ms | GFLOP/s "
             "| vs best peer | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r.get("error"):
            timing = ["failed", "", "", ""]
        else:
            timing = [_fmt(r["ms"], ".1f"), _fmt(r["tflops"] and r["tflops"] * 1e3, ".1f"),
                      _fmt(r["vs_best_peer"], ".2f") + ("×" if r["vs_best_peer"] is not None else ""),
                      _fmt(r["peak_bytes"] and r["peak_bytes"] / 2**20, ".1f")]
        lines.append("| " + " | ".join(
            [r["pass"], r["dtype"], str(r["B"] * r["H"]), str(r["Lq"]), str(r["Lk"]), str(r["d"]),
             "yes" if r["causal"] else "no", r["impl"]] + timing) + " |")
    return lines


def render(paths: list[Path]) -> str:
    if not paths:
        return "\n".join([BEGIN, NONE_YET, END])
    out = [BEGIN, ""]
    for path in paths:
        doc = json.loads(path.read_text())
        cores = f", {doc['cpu_count']} cores" if doc.get("cpu_count") else ""
        blas = doc.get("blas") or {}
        versions = ", ".join(f"{name} {doc[key]}" for name, key in
                             (("cupyflash", "cupyflash"), ("NumPy", "numpy"), ("SciPy", "scipy"),
                              ("PyTorch", "torch"), ("Python", "python")) if doc.get(key))
        out += [f"**{doc.get('cpu', 'CPU')}{cores}**, {doc['date']} "
                f"(`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}`): "
                f"{versions}; BLAS {blas.get('name', '?')} {blas.get('version', '')}.".rstrip(), ""]
        out += _table(doc) + [""]
        out += [f"- {note}" for note in doc.get("notes", [])] + [""]
    out += ["Times are medians after a warm-up; FLOP/s uses FlashAttention's count, so the naive "
            "peers' FLOP/s is the same work's rate; \"vs best peer\" above 1 means faster than "
            "every other implementation in the run; peak is the extra memory of one call.", "", END]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    paths = [Path(p).resolve() for p in argv] or sorted(RESULTS.glob("*cpu*.json"))
    text = PAGE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    PAGE.write_text(text[:start] + render(paths) + text[end:])
    print(f"updated {PAGE.relative_to(ROOT)} from {len(paths)} results file(s)")


if __name__ == "__main__":
    main(sys.argv[1:])
