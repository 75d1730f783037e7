"""Write the GPU results section of docs/performance.md from committed benchmark results.

    python docs/_scripts/gpu_results.py                       # benchmarks/results/*.json
    python docs/_scripts/gpu_results.py path/to/results.json  # or given files

Reads results documents written by ``python -m cupyflash bench --json PATH`` or
``benchmarks/gpu_check.py`` and keeps those with ``"device": "gpu"``.  It
replaces the text between the ``gpu-results:begin`` and ``gpu-results:end``
markers of docs/performance.md with the newest of them that is not a
``*-before-tuning.json`` file, in full: the machine and software it was
measured with, the ``pytest -m gpu`` summary and the GEMM reference rate, then
one table per pass in the file's row order.  Every other GPU file gets one
line (date, commit, a link to its Markdown table) under "Earlier runs".  With no GPU
results files it writes the note saying that none have been committed, so the
page never shows a number that is not in the repository.  Nothing outside the
markers is touched (the box at the top of the page is edited by hand).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
BEFORE = "-before-tuning.json"
DASH = "–"

NONE_YET = """```{note}
The GPU figures (cupyflash's forward and backward TFLOP/s per case, next to
naive CuPy attention, the FlashAttention-1 kernel and PyTorch's
`scaled_dot_product_attention` backends, with each one's share of the measured
GEMM rate and its peak memory) will appear here once GPU benchmark results are
committed under `benchmarks/results/`. None have been committed yet, so this
section shows no numbers.
```"""

NO_CURRENT = """```{note}
No GPU results of the current kernels have been committed yet; the earlier
runs below were measured before the kernels were tuned and are kept as a
record, not as the kernels' speed.
```"""

FOOTER = ("Times are medians after a warm-up, taken with CUDA events; TFLOP/s uses "
          "FlashAttention's count, so the naive peers' TFLOP/s is the same work's rate; "
          "\"vs best peer\" is the fastest peer's time over this row's (above 1: faster than "
          "every implementation not named cupyflash); \"% of GEMM\" is the rate over the dense "
          "bfloat16 matrix multiply rate measured in the same run; peak is the extra memory of "
          "one call beyond its inputs, the result included.")


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _download(path: Path) -> str:
    """A Sphinx link to a file outside docs/ (a plain relative link fails ``-W``)."""
    return f"{{download}}`{path.name} <{os.path.relpath(path, PAGE.parent)}>`"


def _cudnn(version) -> str:
    """cuDNN's integer version as x.y.z (9xxxx: major*10000 + minor*100 + patch; 8xxx: *1000)."""
    if not isinstance(version, int):
        return str(version)
    major, rest = divmod(version, 10000 if version >= 10000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _ms(ms: float) -> str:
    """About three significant digits, never in exponent form."""
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def _ratio(value) -> str:
    if value is None:
        return DASH
    return "<0.01×" if 0 < value < 0.005 else f"{value:.2f}×"


def _percent(value) -> str:
    if value is None:
        return DASH
    return "<1%" if 0 < value < 0.005 else f"{100 * value:.0f}%"


def _short(text: str, width: int = 60) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


def _commits(doc: dict) -> str:
    runs = doc.get("runs") or [doc]
    seen = [c for c in dict.fromkeys(r.get("cupyflash_commit") for r in runs) if c]
    return ", ".join(f"`{c}`" for c in seen) if seen else "unknown"


def _tests(doc: dict) -> str | None:
    tests = doc.get("tests")
    if not tests:
        return None
    if tests.get("summary"):
        return tests["summary"]
    if "passed" in tests:
        return (f"{tests['passed']} passed, {tests.get('failures', 0) + tests.get('errors', 0)} "
                f"failed, {tests.get('skipped', 0)} skipped")
    return None


def _gemm(doc: dict) -> str:
    rates = [f"{g['tflops']:.1f} TFLOP/s ({g['dtype']}, {g['n']}³)"
             for g in doc.get("gemm") or [] if g.get("tflops") is not None]
    return "; ".join(rates) if rates else "not measured"


def _header(doc: dict, path: Path) -> list[str]:
    gpu = doc.get("gpu") or "GPU"
    hardware = ", ".join(x for x in (
        doc.get("compute_capability") and f"compute capability {doc['compute_capability']}",
        doc.get("multiprocessors") and f"{doc['multiprocessors']} SMs",
        doc.get("memory_gib") and f"{doc['memory_gib']} GiB") if x)
    torch = doc.get("torch") or "not installed"
    if doc.get("torch") and doc.get("cudnn"):
        torch += f" (cuDNN {_cudnn(doc['cudnn'])})"
    software = ", ".join([f"driver {doc.get('driver') or '?'}",
                          f"CUDA runtime {doc.get('cuda') or '?'}",
                          f"NVRTC {doc.get('nvrtc') or '?'}",
                          f"CuPy {doc.get('cupy') or '?'}",
                          f"PyTorch {torch}"])
    lines = [f"**{gpu}**" + (f" ({hardware})" if hardware else "")
             + f", {doc['date']} (`{_where(path)}`): {software}; cupyflash "
             f"{doc.get('cupyflash') or '?'} at commit {_commits(doc)}."]
    tests = _tests(doc)
    if tests:
        lines.append(f"`pytest -m gpu` on the same machine: {tests}.")
    lines.append(f"Dense matrix multiply (the \"% of GEMM\" reference): {_gemm(doc)}.")
    return [" ".join(lines)]


def _cell_row(r: dict) -> str:
    impl = r["impl"] + (f" ({r['kernel']})" if r.get("kernel") else "")
    length = str(r["Lq"]) if r["Lq"] == r["Lk"] else f"{r['Lq']}/{r['Lk']}"
    if r.get("error"):
        timing = [_short(r["error"]), DASH, DASH, DASH, DASH]
    else:
        peak = r.get("peak_bytes")
        timing = [_ms(r["ms"]) if r.get("ms") is not None else DASH,
                  f"{r['tflops']:.1f}" if r.get("tflops") is not None else DASH,
                  _ratio(r.get("vs_best_peer")), _percent(r.get("of_gemm")),
                  f"{peak / 2**20:.1f}" if peak is not None else DASH]
    cells = [r["dtype"], str(r["B"] * r["H"]), length, str(r["d"]),
             "yes" if r["causal"] else "no", impl] + timing
    return "| " + " | ".join(cells) + " |"


def _tables(doc: dict) -> list[str]:
    passes = list(dict.fromkeys(["forward", "backward"] + [r["pass"] for r in doc["rows"]]))
    out = []
    for name in passes:
        rows = [r for r in doc["rows"] if r["pass"] == name]
        if not rows:
            continue
        out += [f"**{name.capitalize()} pass**", "",
                ("| dtype | B·H | L | d | causal | implementation | ms | TFLOP/s | vs best peer "
                 "| % of GEMM | peak MiB |"),
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        out += [_cell_row(r) for r in rows] + [""]
    return out


def _earlier(entries: list[tuple[Path, dict]]) -> list[str]:
    lines = ["Earlier runs:", ""]
    for path, doc in entries:
        table = path.with_suffix(".md")
        what = _download(table if table.exists() else path)
        before = " (before tuning)" if path.name.endswith(BEFORE) else ""
        lines.append(f"- {doc['date']}, {doc.get('gpu') or 'GPU'}{before}, commit "
                     f"{_commits(doc)}: {what}")
    return lines + [""]


def gpu_documents(paths: list[Path]) -> list[tuple[Path, dict]]:
    """``(path, document)`` of the GPU results among ``paths``, oldest first."""
    docs = [(p, json.loads(p.read_text())) for p in paths]
    docs = [(p, d) for p, d in docs if d.get("device") == "gpu"]
    return sorted(docs, key=lambda pd: (pd[1].get("date") or "", pd[0].name))


def render(paths: list[Path]) -> str:
    docs = gpu_documents(paths)
    if not docs:
        return f"{BEGIN}\n{NONE_YET}\n{END}"
    current = [pd for pd in docs if not pd[0].name.endswith(BEFORE)]
    main_doc = current[-1] if current else None
    others = [pd for pd in reversed(docs) if pd is not main_doc]
    out = [BEGIN, ""]
    if main_doc is None:
        out += [NO_CURRENT, ""]
    else:
        path, doc = main_doc
        out += _header(doc, path) + [""]
        out += _tables(doc)
        out += [f"- {note}" for note in doc.get("notes", [])] + [""]
        out += [FOOTER, ""]
    if others:
        out += _earlier(others)
    out += [END]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    paths = [Path(p).resolve() for p in argv] or sorted(RESULTS.glob("*.json"))
    text = PAGE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    PAGE.write_text(text[:start] + render(paths) + text[end:])
    n = len(gpu_documents(paths))
    print(f"updated {PAGE.relative_to(ROOT)} from {n} GPU results file(s)")


if __name__ == "__main__":
    main(sys.argv[1:])
