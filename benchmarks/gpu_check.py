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

The cases run in a child process that this one watches (see ``bench_watched``):
an implementation that hangs, kills its process or loses the CUDA context is
left out of the remaining cases, with a note, and the table goes on.  With
``--tests SECONDS`` it runs ``pytest -m gpu`` instead, one process per
``tests/test_gpu*.py`` module, side by side (``run_tests``).

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
import time
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
    ("float32", 2, 8, 2048, 64, False, False),
    ("float32", 1, 8, 4096, 64, False, True),
    ("float64", 1, 8, 1024, 64, False, False),
    ("float64", 1, 8, 2048, 64, False, True),
]
QUICK = [CASES[0], CASES[8], CASES[10]]
# After the exact dtypes at more lengths (EXACT_L_CASES): no target names float16.
FLOAT16_CASES = [("float16", 2, 16, 8192, 128, False, False)]
# The table leaves these out: its time goes to the implementations the issues'
# targets name.  fwd_v1 is the teaching kernel (seconds per call at these sizes:
# 1.7 s at bf16 B=4 H=16 L=4096 on an H200); torch-sdpa runs whichever of
# torch-efficient and torch-cudnn PyTorch picks, and torch-flash and torch-math are
# the issues' named peers.  `python -m cupyflash bench` times every implementation.
TABLE_LEAVE_OUT = {
    "cupyflash-v1": "the teaching kernel (Algorithm 1): seconds per call at these sizes",
    "torch-efficient": "torch-sdpa runs it where PyTorch picks it",
    "torch-cudnn": "torch-sdpa runs it where PyTorch picks it",
}
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
# where it fits), right after CASES: (dtype, B, H, L, d, causal, backward).
EXACT_L_CASES = [(dtype, 1, 8, length, 64, False, backward)
                 for dtype in ("float64", "float32") for backward in (False, True) for length in (512, 8192)]


def precompile(workers: int) -> int:
    """Compile every kernel instantiation this GPU can launch into CuPy's on-disk cache,
    ``workers`` processes at a time, so that the test run (and its xdist workers) only
    load modules."""
    import time
    from concurrent.futures import ProcessPoolExecutor

    import cupy

    from cupyflash._families import launchable

    rows = [(r.entry, r.name_expression) for r in launchable(int(cupy.cuda.Device(0).compute_capability))]
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


def test_groups(tests_dir: Path = ROOT / "tests") -> list[tuple[str, list[str]]]:
    """The ``pytest -m gpu`` run in isolated parts: one per ``test_gpu*.py`` module,
    and one for the GPU tests of every other module.  A kernel that loses its CUDA
    context (an illegal instruction or address is sticky: every later call in that
    process fails) or hangs then costs only its own module's results."""
    modules = sorted(tests_dir.glob("test_gpu*.py"))
    groups = [(m.stem, [str(m)]) for m in modules]
    groups.append(("others", [str(tests_dir), "--ignore-glob=*/test_gpu*.py"]))
    return groups


def run_tests(seconds: float, work: Path, python: str = sys.executable) -> int:
    """Run :func:`test_groups` side by side (one process each), each stopped at the
    shared deadline; a JUnit file per group in ``work``.  Returns the worst exit status
    (0: all passed; 124: a group ran past the deadline)."""
    import signal
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    extra = ["--timeout=90"] if _importable(python, "pytest_timeout") else []
    procs = []
    for name, targets in test_groups():
        log = open(work / f"pytest-{name}.log", "w")
        cmd = [python, "-m", "pytest", "-m", "gpu", *targets, "-q", "-rfEs", "-p", "no:cacheprovider",
               f"--junitxml={work / f'junit-{name}.xml'}", *extra]
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True), log))
    print(f"gpu_check: pytest -m gpu in {len(procs)} processes: {', '.join(n for n, _, _ in procs)}"
          f"{' ' + ' '.join(extra) if extra else ''} (limit {seconds:.0f} s)", flush=True)
    deadline = time.monotonic() + seconds
    worst = 0
    for name, proc, log in procs:
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)      # pytest writes its report on SIGINT
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        log.close()
        tail = (work / f"pytest-{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
        print(f"gpu_check: {name}: exit status {rc}{' (time limit)' if rc == 124 else ''}: "
              f"{tail[0] if tail else '(no output)'}", flush=True)
        worst = max(worst, rc)
    return worst


def _importable(python: str, module: str) -> bool:
    import subprocess

    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def test_summary(junit, rc: int | None) -> dict:
    """Counts (and failing test names) from pytest JUnit XML files (a path, a folder of
    ``junit*.xml`` files, or a list of paths)."""
    import xml.etree.ElementTree as ET

    summary = dict(exit_status=rc)
    if isinstance(junit, (str, Path)):
        path = Path(junit)
        paths = sorted(path.glob("junit*.xml")) if path.is_dir() else [path]
    else:
        paths = [Path(p) for p in junit]
    paths = [p for p in paths if p.is_file()]
    if not paths:
        summary["summary"] = f"no report (exit status {rc}; timed out?)"
        return summary
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    seconds, failed = 0.0, []
    for path in paths:
        root = ET.parse(path).getroot()
        for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
            seconds = max(seconds, float(suite.get("time", 0.0)))   # the parts ran side by side
            failed += [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                       if case.find("failure") is not None or case.find("error") is not None]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary.update(counts, seconds=seconds, failed=failed[:50])
    summary["summary"] = (f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                          f"{counts['skipped']} skipped in {summary['seconds']:.0f} s")
    return summary


# ---- the table, in a watched child process -------------------------------------------------------
#
# The opt-in kernels (wgmma, TF32, DMMA, atomics) reach the table before they have
# run on many GPUs.  One that hangs, or that loses the CUDA context (every later
# call in that process fails), must not cost the rest of the table: the cases run
# in a child process that reports each implementation as it starts and each row as
# it ends, one JSON line each, to a progress file; the parent (which never touches
# CUDA) restarts a child that stops making progress or loses its context, without
# the implementation responsible, at the case where it stopped.

STALL_SECONDS = 60.0    # one implementation of one case takes < 15 s (max_seconds 5 s, warm-up, memory)
MAX_RESTARTS = 4


class ContextLost(Exception):
    """Raised in the child when a row's error left the CUDA context unusable."""


def child(spec_path: str) -> int:
    """Body of the child process: run the cases in ``spec_path`` and report progress."""
    from cupyflash import _bench

    spec = json.loads(Path(spec_path).read_text())
    device, fault = spec["device"], spec.get("fault")   # fault: planted by the tests only
    progress = open(spec["progress"], "a", buffering=1)

    def emit(**item):
        progress.write(json.dumps(item) + "\n")

    if spec["header"]:
        emit(header=_bench.environment(device))
        if device == "gpu":
            emit(gemm=_bench._gemm_reference(device, "bfloat16"))
    where = {}

    def on_start(case, impl):
        emit(start=impl, case=where["case"])
        if fault and fault["impl"] == impl and fault["kind"] == "hang":
            time.sleep(3600)
        if fault and fault["impl"] == impl and fault["kind"] == "crash":
            os._exit(9)

    def on_row(row):
        planted = bool(fault and fault["impl"] == row["impl"] and fault["kind"] == "lost")
        if planted:
            row.update(ms=None, ms_min=None, repeats=None, tflops=None, error="planted: context lost")
        emit(row=row, case=where["case"])
        if row["error"] and (planted or device == "gpu" and not _bench.cuda_context_alive()):
            raise ContextLost(row["impl"])

    start = time.perf_counter()
    cases = [(index, _bench.Case(**c)) for index, c in spec["cases"]]
    for n, (index, case) in enumerate(cases):
        left = spec["budget"] - (time.perf_counter() - start)
        if left <= 0:
            emit(budget_spent=[i for i, _ in cases[n:]])
            break
        where["case"] = index
        try:
            _bench.run_case(case, device, exclude=spec["exclude"], repeat=spec["repeat"],
                            warmup=spec["warmup"], memory=spec["memory"],
                            max_seconds=_bench.per_impl_seconds(left, len(cases) - n),
                            settle_s=0.0, on_start=on_start, on_row=on_row)
        except ContextLost as lost:
            emit(lost=str(lost), case=index)
            return 3
        emit(done=index)
    emit(finished=True)
    return 0


def _read_progress(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON lines of the progress file from ``offset``; the new offset."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    items = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return items, offset + end


def bench_watched(cases: list, *, budget: float, repeat: int, work: Path, log=print,
                  device: str = "gpu", warmup: int = 2, memory: bool = True,
                  stall_s: float = STALL_SECONDS, fault: dict | None = None,
                  leave_out: dict | None = None) -> dict:
    """The table of ``cases`` (a list of ``_bench.Case``) in watched child processes
    (see above); returns the results document of :func:`cupyflash._bench.bench`, with
    a note for each implementation left out and why: ``leave_out`` (implementation ->
    why) from the start, others when they hang or break.  ``device="cpu"`` and ``fault``
    (``{"impl": name, "kind": "hang" | "crash" | "lost"}``, planted in the child) are
    for the tests."""
    import dataclasses
    import signal
    import subprocess

    from cupyflash import _bench

    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    progress = work / "bench-progress.jsonl"
    progress.write_text("")
    header, gemm = None, None
    rows: dict[int, list[dict]] = {}           # case index -> finished rows
    remaining = list(range(len(cases)))
    excluded: dict[str, str] = dict(leave_out or {})   # implementation -> why
    notes = [f"left out of this table: {name} ({why})" for name, why in excluded.items()]
    for attempt in range(MAX_RESTARTS + 1):
        left = budget - (time.monotonic() - started)
        if not remaining:
            break
        if left <= 5:
            notes.append(f"time budget of {budget:g} s spent: {len(remaining)} case(s) not run")
            break
        spec = dict(progress=str(progress), header=header is None, exclude=sorted(excluded),
                    device=device, repeat=repeat, warmup=warmup, memory=memory, budget=left,
                    fault=fault,
                    cases=[(i, dataclasses.asdict(cases[i])) for i in remaining])
        spec_path = work / f"bench-spec-{attempt}.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                cwd=ROOT, start_new_session=True)
        offset = progress.stat().st_size
        last_activity, running, why = time.monotonic(), None, None
        lost = None
        while True:
            rc = proc.poll()
            items, offset = _read_progress(progress, offset)
            if items:
                last_activity = time.monotonic()
            for item in items:
                if "header" in item:
                    header = item["header"]
                elif "gemm" in item:
                    gemm = item["gemm"]
                elif "start" in item:   # a restarted case times its implementations again
                    running = (item["case"], item["start"])
                    rows[item["case"]] = [r for r in rows.get(item["case"], []) if r["impl"] != item["start"]]
                elif "row" in item:
                    rows.setdefault(item["case"], []).append(item["row"])
                    log(_bench._progress(item["row"]))
                    running = None
                elif "done" in item:
                    remaining.remove(item["done"])
                elif "lost" in item:
                    lost = item["lost"]
                    running = (item["case"], lost)
                elif "budget_spent" in item:
                    notes.append(f"time budget of {budget:g} s spent: {len(item['budget_spent'])} "
                                 f"case(s) not run")
                    remaining.clear()
            if rc is not None:
                break
            if time.monotonic() - last_activity > stall_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, why = proc.returncode, f"no progress for {stall_s:g} s (hung?); process killed"
                break
            if time.monotonic() - started > budget + 2 * stall_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, why = proc.returncode, "the table's time budget ran out"
                notes.append(f"time budget of {budget:g} s spent: {len(remaining)} case(s) not finished")
                remaining.clear()
                break
            time.sleep(0.2)
        if not remaining:
            break
        culprit = lost or (running[1] if running else None)
        if lost:
            why = "its error left the CUDA context unusable; the process was restarted"
        elif why is None:
            why = f"the process died (exit status {rc})"
        if culprit is None:                    # not a kernel's doing: a restart would fail the same way
            notes.append(f"the table's process stopped ({why}) outside any implementation; "
                         f"{len(remaining)} case(s) not run")
            break
        excluded[culprit] = why
        index = running[0]
        case_rows = rows.setdefault(index, [])
        if not any(r["impl"] == culprit for r in case_rows):
            case_rows.append(_bench.blank_row(cases[index], culprit, device) | {"error": why})
        notes.append(f"{culprit}: {why} (at {_case_name(cases[index])}); left out of every later case")
        log(f"gpu_check: {culprit}: {why}; restarting without it")
    else:
        notes.append(f"gave up after {MAX_RESTARTS} restarts; {len(remaining)} case(s) not run")
    doc = header or dict.fromkeys(_bench.REQUIRED_KEYS, None) | dict(device=device, notes=[])
    all_rows = []
    for index in sorted(rows):
        _bench.peer_ratios(rows[index])
        all_rows += rows[index]
    references = {"bfloat16": gemm} if gemm else {}
    _bench.gemm_shares(all_rows, references, device)
    doc["gemm"] = [gemm] if gemm else []
    doc["rows"] = all_rows
    doc["notes"] = doc.get("notes", []) + notes
    if any(c.causal for c in cases) and any(r["impl"].startswith("torch-") for r in all_rows):
        doc["notes"].append(_bench.PEER_NOTE)
    doc["load_average_end"] = _bench._load_average()
    doc["seconds"] = round(time.monotonic() - started, 1)
    return doc


def _case_name(case) -> str:
    return (f"{case.pass_name} {case.dtype} B={case.batch} H={case.heads} Lq={case.seqlen_q} "
            f"Lk={case.seqlen_k} d={case.head_dim}{' causal' if case.causal else ''}")


def write_results(doc: dict, out_dir: Path) -> Path:
    """``<date>-<gpu>.json`` and ``.md`` in ``out_dir`` (and ``$OUT`` when set); the stem."""
    from cupyflash import _bench

    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", (doc.get("gpu") or "gpu").lower()).strip("-")
    stem = out_dir / f"{_dt.date.today().isoformat()}-{slug}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_bench.markdown(doc))
    out = os.environ.get("OUT")
    if out:
        for suffix in (".json", ".md"):
            shutil.copy(stem.with_suffix(suffix), Path(out) / stem.with_suffix(suffix).name)
    return stem


def host_time_note(calls: int = 2000) -> str:
    """Host time per forward call on a problem too small for the GPU to be the limit.

    perf_counter over ``calls`` back-to-back calls without synchronising (then one
    synchronisation, not counted): validation, dispatch, allocation of the output and
    the launch, i.e. the floor of a call's latency (benchmarks/bench_host.py times the
    Python part alone on any machine).  PyTorch's SDPA on the same tensors, where
    importable.
    """
    import cupy

    import cupyflash

    q = cupy.zeros((1, 1, 16, 64), dtype=cupy.float16)

    def per_call(fn) -> float:
        for _ in range(50):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        cupy.cuda.get_current_stream().synchronize()
        return elapsed / calls * 1e6

    parts = [f"cupyflash {per_call(lambda: cupyflash.attention(q, q, q)):.1f} µs"]
    try:
        import torch
        import torch.nn.functional as F

        t = torch.zeros((1, 1, 16, 64), dtype=torch.float16, device="cuda")
        parts.append(f"PyTorch SDPA {per_call(lambda: F.scaled_dot_product_attention(t, t, t)):.1f} µs")
    except ImportError:
        pass
    return ("Host time per forward call (float16, B=1, H=1, L=16, d=64; perf_counter over "
            f"{calls} calls without synchronising): " + ", ".join(parts) + ".")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small cases, few repeats")
    p.add_argument("--junit", help="pytest's --junitxml file (or a folder of junit*.xml files), "
                   "summarised into the results")
    p.add_argument("--test-rc", type=int, help="pytest's exit status")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the whole table")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--work", help="folder for logs, progress and JUnit files (default: a temporary one)")
    p.add_argument("--precompile", type=int, metavar="N",
                   help="only compile every instantiation with N processes, then exit")
    p.add_argument("--tests", type=float, metavar="SECONDS",
                   help="only run `pytest -m gpu` (isolated parts side by side), then exit")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.child:
        return child(args.child)
    if args.precompile:
        return precompile(args.precompile)
    import tempfile

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    if args.tests is not None:
        return run_tests(args.tests, work)
    from cupyflash import _bench

    if not _bench.gpu_available():
        print("gpu_check: no usable GPU (CuPy sees no CUDA device); nothing timed.")
        return 0
    selected = QUICK if args.quick else CASES
    cases = [_bench.Case(dtype, b, h, length, length, d, causal, backward)
             for dtype, b, h, length, d, causal, backward in selected]
    if not args.quick:   # in order of the issues' targets: a spent budget cuts the tail
        cases += [_bench.Case(dtype, b, h, length, length, d, causal, backward)
                  for dtype, b, h, length, d, causal, backward in EXACT_L_CASES + FLOAT16_CASES]
        cases += [_bench.Case(dtype, b, h, lq, lk, d) for dtype, b, h, lq, lk, d in SMALL_GRID_CASES]
    doc = bench_watched(cases, budget=args.budget, repeat=10 if args.quick else 50, work=work,
                        log=lambda line: print(line, flush=True), leave_out=TABLE_LEAVE_OUT)
    try:
        doc["notes"].append(host_time_note())
    except Exception as error:  # noqa: BLE001 - a note, never a reason to lose the table
        doc["notes"].append(f"host time per call not measured: {type(error).__name__}: {error}")
    doc["command"] = shlex.join(["benchmarks/gpu_check.py",
                                 *(sys.argv[1:] if argv is None else argv)])
    if args.junit:
        doc["tests"] = test_summary(args.junit, args.test_rc)
    stem = write_results(doc, Path(args.out_dir))
    print()
    print(_bench.markdown(doc))
    print(f"gpu_check: wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
