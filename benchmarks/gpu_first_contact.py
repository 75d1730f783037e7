"""The first minute on a GPU: how its tensor cores add, the wgmma probes, an A/B table.

Step 0 of ``benchmarks/gpu_check.sh``; run alone from the checkout's root::

    python benchmarks/gpu_first_contact.py            # on a machine with a GPU and CuPy
    python benchmarks/gpu_first_contact.py --emulator # the probes on the CPU emulator

1. **Accumulation probes.**  One tensor-core product per instruction the kernels use
   (``mma.sync`` m16n8k16 bf16, m16n8k8 tf32 and, on sm_90, wgmma m64n64k16 bf16;
   ``tests/emulator_planted/accumulation_probe.cu``) on inputs whose float32 result
   tells two models apart: *exact* (the products summed exactly, rounded once to
   float32: the emulator's model) and *aligned* (every term shifted to the largest
   term's exponent, ``extra_bits`` bits kept below float32's last one and the rest
   dropped -- toward zero, toward minus infinity or to nearest -- then summed: the
   model Fasi et al. (2021) measured on V100, T4 and A100 and Khattak & Mikaitis
   (2025) refined for H100 and B200).  Row ``i`` of the probe holds the products
   ``+1, -1, +2**-k`` with ``k = LADDER[i]``: exact accumulation returns ``2**-k`` for
   every ``k``; the aligned model returns it while ``k <= 23 + extra_bits`` and
   nothing after, so the first ``k`` that comes back as zero gives the bits kept.
   More columns say which way the dropped bits go, whether the accumulator ``C``
   enters the sum as a product does, and whether one alignment spans all K
   products or each group of them is aligned on its own (:data:`COLUMNS`).  The script prints and
   records (JSON) the model each instruction matches and the error bound per term
   that follows from it (:func:`error_per_term`), from which the GPU tier's
   tolerances are set.
2. **The wgmma probes** of ``tests/test_gpu_wgmma.py`` (one instruction per operand
   form, then each product as the kernels call it), under a time limit.
3. **An A/B table** in this one process, the same inputs for every row of a case:
   fwd_mma against fwd_wgmma and its timing-only builds without the softmax or the
   copies (bf16, d = 64 and 128, L = 8192, causal and not), the backward deterministic,
   with dQ by atomics (``deterministic=False``), by bulk reductions (async dQ) and by
   bulk reductions in key-block order (ordered dQ, deterministic),
   PyTorch's flash and cuDNN backends beside them when torch is installed; the timers are
   :mod:`cupyflash._bench`'s (CUDA events through ``cupyx.profiler.benchmark`` after a
   warm-up; medians), TFLOP/s by FlashAttention's FLOP count.  Variants issue 32 names
   that are not built yet are listed as such (:data:`NOT_BUILT`).

Everything stops at a time budget (``--budget``, 60 s): what it has not reached is
recorded as not reached.  Without CuPy or a CUDA device the script says so and exits
0.  The decoding and the table's formatting need no GPU
(tests/test_gpu_first_contact.py runs them).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere: the checkout's cupyflash
    sys.path.insert(0, str(ROOT))

PROBE = ROOT / "tests" / "emulator_planted" / "accumulation_probe.cu"
# The params struct of every planted kernel (tests/emulator_planted/planted_params.cuh).
PLANTED_DTYPE = np.dtype([("inp", np.uint64), ("out", np.uint64), ("ticket", np.uint64), ("n", np.int32),
                          ("arg", np.int32)], align=True)
# name -> (template argument, M, N, K, threads, dynamic shared memory, lowest compute capability)
INSTRUCTIONS = {
    "mma.m16n8k16.bf16": (0, 16, 8, 16, 32, 0, 80),
    "mma.m16n8k8.tf32": (1, 16, 8, 8, 32, 0, 80),
    "wgmma.m64n64k16.bf16": (2, 64, 64, 16, 128, 2 * 64 * 64 * 2 + 1024, 90),
}
# Row i of each probe: the small term 2**-LADDER[i].  k = 20 .. 30 reads extra_bits from
# -3 (float32's 24 bits less three) to 6; exact accumulation looks like 7 or more.
LADDER = tuple(range(20, 31))
EXTRA_BITS = tuple(range(LADDER[0] - 23, LADDER[-1] - 23))
# Where the dropped bits of a term go in the aligned model.
DROPS = {"rz": "toward zero", "rd": "toward minus infinity", "rn": "to nearest even"}
# Column n of the probe: (C, B's rows 0, 1, 2 and K - 1).  A's row i is (1, -1, 2**-k,
# 0, ..., 0, 2**-k), so column n sums C + B[0, n] - B[1, n] + 2**-k (B[2, n] + B[K - 1, n]).
COLUMNS = {
    0: (0.0, (1.0, 1.0, 1.0, 0.0)),     # 1 - 1 + 2**-k: the bits kept
    1: (0.0, (1.0, 1.0, -1.0, 0.0)),    # 1 - 1 - 2**-k: toward zero or toward minus infinity
    2: (0.0, (1.0, 1.0, 1.5, 0.0)),     # 1 - 1 + 1.5 * 2**-k: truncated or rounded
    3: (1.0, (0.0, 1.0, 1.0, 0.0)),     # C = 1, - 1 + 2**-k: C in place of the product 1
    4: (0.0, (1.0, 1.0, 0.0, 1.0)),     # 1 - 1 + 2**-k as the last product: one alignment for all K
}
MODEL_COLUMNS = 4   # the models are fitted to columns 0 .. 3; column 4 then says whether they span K
# Rows of the A/B table issue 32 names that today's code does not have.
NOT_BUILT = (
    # the issue's stretch: K and V by the tensor memory accelerator, maps encoded on the host
    ("forward", "fwd_wgmma decoupled with a TMA producer (cp.async.bulk.tensor)"),
)
# The table's cases: (B, H, L, d) as benchmarks/gpu_check.py's; each forward and
# backward, causal and not.
TABLE_SHAPES = ((2, 16, 8192, 128), (2, 16, 8192, 64))
# _bench implementation -> what the row is called here
TABLE_IMPLS = {
    # cupyflash-wgmma-no-exp / -no-copy: timing-only builds (wrong outputs), what the
    # exponentials and the copies cost
    # cupyflash-wgmma-decoupled: a producer warpgroup, per-stage mbarriers, ping-pong
    # cupyflash-wgmma-before-fixes: the loop before fixes 1+2 (P V waited for before the
    # exponentials; copies before the products), same outputs
    "forward": ("cupyflash", "cupyflash-wgmma-before-fixes", "cupyflash-wgmma", "cupyflash-wgmma-decoupled",
                "cupyflash-wgmma-no-exp", "cupyflash-wgmma-no-copy", "torch-flash", "torch-cudnn"),
    "backward": ("cupyflash", "cupyflash-atomic", "cupyflash-wgmma", "cupyflash-wgmma-atomic",
                 "cupyflash-wgmma-async-dq", "cupyflash-wgmma-ordered-dq", "cupyflash-wgmma-decoupled",
                 "cupyflash-wgmma-no-copy", "torch-flash", "torch-cudnn"),
}
WGMMA_SELECTION = "one_wgmma_of_each_operand_form or each_kernel_product"


# ---- the probes' inputs and the two models ------------------------------------------------------

def probe_inputs(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, C)`` of the probe of instruction ``name`` (float32, row-major, M x K, K x N,
    M x N); every value is exact in bfloat16 and tf32.

    >>> a, b, c = probe_inputs("mma.m16n8k16.bf16")
    >>> a.shape, b.shape, c.shape
    ((16, 16), (16, 8), (16, 8))
    >>> float(a[0, 2]) == 2.0 ** -LADDER[0]
    True
    """
    _, m, n, k, _, _, _ = INSTRUCTIONS[name]
    a = np.zeros((m, k), np.float32)
    b = np.zeros((k, n), np.float32)
    c = np.zeros((m, n), np.float32)
    for i, e in enumerate(LADDER):
        a[i, :3] = (1.0, -1.0, 2.0 ** -e)
        a[i, k - 1] = 2.0 ** -e
    for col, (c_value, factors) in COLUMNS.items():
        b[[0, 1, 2, k - 1], col] = factors
        c[:len(LADDER), col] = c_value
    return a, b, c


def aligned_sum(terms, extra_bits: int | None, drop: str = "rz") -> float:
    """The float32 sum of ``terms`` (exact numbers) as the aligned model adds them.

    ``extra_bits=None`` is exact accumulation: the exact sum rounded once to
    float32 (to nearest).  Otherwise every term is put on the grid of
    ``2**(e - 23 - extra_bits)``, ``e`` the exponent of the largest term's leading
    bit, its lower bits dropped as ``drop`` says (``"rz"``, ``"rd"`` or ``"rn"``), and
    the grid values summed exactly (the probes' sums fit float32, so the final
    normalisation does not round them).

    >>> aligned_sum([1.0, -1.0, 2.0 ** -26], None) == 2.0 ** -26
    True
    >>> aligned_sum([1.0, -1.0, 2.0 ** -26], 2)
    0.0
    >>> aligned_sum([1.0, -1.0, 2.0 ** -26], 3) == 2.0 ** -26
    True
    >>> aligned_sum([1.0, -1.0, -(2.0 ** -27)], 2, "rd") == -(2.0 ** -25)
    True
    """
    exact = [Fraction(t) for t in terms if t != 0]
    if not exact:
        return 0.0
    if extra_bits is None:
        return float(np.float32(float(sum(exact))))
    top = max(math.frexp(float(abs(t)))[1] - 1 for t in exact)
    ulp = Fraction(2) ** (top - 23 - extra_bits)
    if drop == "rz":
        on_grid = [math.trunc(t / ulp) for t in exact]
    elif drop == "rd":
        on_grid = [math.floor(t / ulp) for t in exact]
    elif drop == "rn":
        on_grid = [round(t / ulp) for t in exact]   # Fraction.__round__: ties to even
    else:
        raise ValueError(f"drop: expected one of {sorted(DROPS)}, got {drop!r}")
    return float(np.float32(float(sum(on_grid) * ulp)))


def _models():
    """Every model the decoder tells apart: ``(label, extra_bits, drop)``."""
    yield "exact", None, None
    for bits in EXTRA_BITS:
        for drop in DROPS:
            yield "aligned", bits, drop


def model_output(name: str, extra_bits: int | None, drop: str | None = None) -> np.ndarray:
    """The probe block (``len(LADDER)`` x ``len(COLUMNS)``) a model predicts for ``name``'s probe
    (one alignment over C and all K products)."""
    a, b, c = probe_inputs(name)
    out = np.zeros((len(LADDER), len(COLUMNS)), np.float32)
    for i in range(len(LADDER)):
        for n in COLUMNS:
            terms = [float(c[i, n])] + [float(a[i, k]) * float(b[k, n]) for k in range(a.shape[1])]
            out[i, n] = aligned_sum(terms, extra_bits, drop or "rz")
    return out


def error_per_term(extra_bits: int | None, drop: str | None) -> float:
    """Bound on each term's error, relative to the largest term of one instruction's sum.

    Exact accumulation rounds once: half a float32 unit (``2**-24``) of the result.
    The aligned model loses below one grid step per term when it truncates
    (``2**-(23 + extra_bits)``), half a step when it rounds.

    >>> error_per_term(None, None) == 2.0 ** -24
    True
    >>> error_per_term(3, "rz") == 2.0 ** -26
    True
    """
    if extra_bits is None:
        return 2.0 ** -24
    return 2.0 ** -(23 + extra_bits + (1 if drop == "rn" else 0))


def classify(name: str, d: np.ndarray) -> dict:
    """Which model the probe's output ``d`` (M x N, float32) of instruction ``name`` matches.

    Returns a dict: ``model`` ("exact", "truncated" -- dropped toward zero or minus
    infinity --, "rounded" or "unknown"), ``extra_bits`` (bits kept below float32's
    last; None for exact), ``drop``, ``one_alignment`` (False where a product in a
    later group of the K escapes the alignment: the hardware aligns groups of
    products on their own; None for exact), ``error_per_term`` (:func:`error_per_term`),
    ``ladder`` (k -> the value of ``1 - 1 + 2**-k``), ``block`` (the probe rows and
    columns as returned) and ``note``.
    """
    a, b, c = probe_inputs(name)
    d = np.asarray(d, np.float32).reshape(c.shape)
    block = d[:len(LADDER), :len(COLUMNS)]
    ladder = {k: float(block[i, 0]) for i, k in enumerate(LADDER)}   # the bits-kept column
    rest = d.copy()
    rest[:len(LADDER), :len(COLUMNS)] = 0
    result = {"instruction": name, "model": "unknown", "extra_bits": None, "drop": None,
              "one_alignment": None, "error_per_term": None, "ladder": ladder, "block": block.tolist(),
              "note": ""}
    if not np.isfinite(d).all() or rest.any():
        bad = int((~np.isfinite(d)).sum() + (rest != 0).sum())
        result["note"] = (f"{bad} element(s) outside the probe block are not 0: the fragment layout or "
                          "the launch is wrong, not the accumulation")
        return result
    predicted = {(label, bits, drop): model_output(name, bits, drop) for label, bits, drop in _models()}
    matches = [m for m, out in predicted.items() if np.array_equal(out[:, :MODEL_COLUMNS], block[:, :MODEL_COLUMNS])]
    if not matches:
        # Read what can be read: the first k of column 0 that comes back as zero.
        zero = [k for k in LADDER if ladder[k] == 0.0]
        result["note"] = ("matches no model" + (f"; column 0 first drops 2**-{zero[0]} "
                                                f"(extra_bits {zero[0] - 24}?)" if zero else "")
                          + ("; C = 1 gives another ladder than the product 1 (column 3 vs 0)"
                             if not np.array_equal(block[:, 3], block[:, 0]) else "")
                          + ("; the last product gives another ladder than the third (column 4 vs 0)"
                             if not np.array_equal(block[:, 4], block[:, 0]) else ""))
        return result
    if len(matches) > 1:
        result["note"] = f"ambiguous: {matches}"
        return result
    label, bits, drop = matches[0]
    whole = bool(np.array_equal(predicted[matches[0]][:, MODEL_COLUMNS], block[:, MODEL_COLUMNS]))
    if label == "exact":
        result.update(model="exact", note=f"exact, or at least {LADDER[-1] - 23} extra bits kept")
        if not whole:
            result.update(model="unknown", note="exact in the first products but not for the last one")
            return result
    else:
        result.update(model="rounded" if drop == "rn" else "truncated", extra_bits=bits, drop=DROPS[drop],
                      one_alignment=whole,
                      note=f"aligned to the largest term, {bits} bit(s) kept below float32's last, "
                           f"the rest {'rounded' if drop == 'rn' else 'dropped'} {DROPS[drop]}"
                           + ("" if whole else "; the last product escapes the first products' alignment: "
                              "groups of products are aligned on their own"))
    result["error_per_term"] = error_per_term(bits, drop)
    return result


def describe(result: dict) -> str:
    """One line per instruction for the log."""
    if result.get("error"):
        return f"{result['instruction']:<22} not run: {result['error']}"
    head = f"{result['instruction']:<22} {result['model']}"
    if result["extra_bits"] is not None:
        head += f", {result['extra_bits']} extra bit(s), dropped {result['drop']}"
        head += ", one alignment over K" if result["one_alignment"] else ", groups of K aligned apart"
    if result["error_per_term"]:
        head += f"; error per term <= 2**{math.log2(result['error_per_term']):.0f} x the largest"
    return head + (f" ({result['note']})" if result["note"] else "")


# ---- running the probes ---------------------------------------------------------------------------

def _params(inp_ptr: int, out_ptr: int) -> np.void:
    return np.array((inp_ptr, out_ptr, 0, 0, 0), dtype=PLANTED_DTYPE)[()]


def run_probes_emulator(names=None) -> dict:
    """``{name: D}``: each probe run on the CPU emulator (an emulated sm_90)."""
    from cupyflash.emulator import EmulatorExecutor

    names = list(names or INSTRUCTIONS)
    executor = EmulatorExecutor(arch=90, seed=1, shuffle=True, race_check=True)
    executor.compile(str(PROBE), [f"accumulation_probe<{INSTRUCTIONS[n][0]}>" for n in names])
    outputs = {}
    for name in names:
        kind, m, n, _k, threads, shared, _arch = INSTRUCTIONS[name]
        inp = np.concatenate([x.ravel() for x in probe_inputs(name)])
        out = np.full(m * n, np.nan, np.float32)
        executor.launch(str(PROBE), f"accumulation_probe<{kind}>", 1, threads, shared,
                        _params(inp.ctypes.data, out.ctypes.data))
        outputs[name] = out.reshape(m, n)
    return outputs


def run_probes_gpu(arch: int) -> dict:
    """``{name: D or the exception}``: each probe this device has, compiled by NVRTC for
    ``sm_<arch>`` (``sm_90a`` on sm_90, as the wgmma kernels are) and launched once."""
    import cupy

    from cupyflash import _nvrtc
    from cupyflash._source import assemble

    names = [n for n, spec in INSTRUCTIONS.items() if arch >= spec[6] and (spec[6] != 90 or arch == 90)]
    target = "sm_90a" if arch == 90 else f"sm_{arch}"
    options = _nvrtc.options(target)
    expressions = {n: f"accumulation_probe<{INSTRUCTIONS[n][0]}>" for n in names}
    _log, cubin, lowered = _nvrtc.compiler().compile(assemble(str(PROBE)), list(expressions.values()),
                                                     options, PROBE.name)
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "accumulation_probe.cubin"
        path.write_bytes(cubin)
        module = cupy.RawModule(path=str(path))
        for name, expression in expressions.items():
            _, m, n, _k, threads, shared, _ = INSTRUCTIONS[name]
            try:
                inp = cupy.asarray(np.concatenate([x.ravel() for x in probe_inputs(name)]))
                out = cupy.full(m * n, cupy.nan, dtype=cupy.float32)
                kernel = module.get_function(lowered[expression])
                kernel((1,), (threads,), (_params(inp.data.ptr, out.data.ptr),), shared_mem=shared)
                outputs[name] = cupy.asnumpy(out).reshape(m, n)
            except Exception as error:  # noqa: BLE001 - recorded; the other probes still run
                outputs[name] = error
    return outputs


def probe_report(outputs: dict) -> list[dict]:
    """Each instruction's :func:`classify` result (or its error), in :data:`INSTRUCTIONS` order;
    instructions the device lacks are recorded as such."""
    results = []
    for name in INSTRUCTIONS:
        d = outputs.get(name)
        if d is None:
            results.append({"instruction": name, "error": "not on this device"})
        elif isinstance(d, BaseException):
            results.append({"instruction": name, "error": f"{type(d).__name__}: {d}"[:500]})
        else:
            results.append(classify(name, d))
    return results


# ---- the wgmma probes of tests/test_gpu_wgmma.py --------------------------------------------------

def run_wgmma_tests(seconds: float, junit: Path | None) -> dict:
    """The one-instruction and per-product wgmma tests, in a child process with a time
    limit (then SIGINT, on which pytest still writes its report)."""
    import signal

    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", "-m", "gpu",
           str(ROOT / "tests" / "test_gpu_wgmma.py"), "-k", WGMMA_SELECTION]
    if junit is not None:
        cmd += [f"--junitxml={junit}"]
    start, limit = time.perf_counter(), max(seconds, 1.0)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            text, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        rc = None
        text = (text or "") + f"\n(stopped after {limit:.0f} s)"
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return {"command": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - start, 1),
            "summary": lines[-1] if lines else "", "output": "\n".join(lines[-40:])}


# ---- the A/B table -------------------------------------------------------------------------------

def table_rows(shapes=TABLE_SHAPES) -> list[dict]:
    """The table's rows before timing, in the order they are timed (d = 128 first: the
    issues' targets), each case's rows together; then the variants not built yet
    (``status`` "not built")."""
    rows = []
    for batch, heads, length, d in shapes:
        for pass_name in ("forward", "backward"):
            for causal in (False, True):
                for impl in TABLE_IMPLS[pass_name]:
                    rows.append({"pass": pass_name, "B": batch, "H": heads, "L": length, "d": d,
                                 "causal": causal, "impl": impl, "kernel": None, "ms": None, "tflops": None,
                                 "status": "not reached"})
    for pass_name, what in NOT_BUILT:
        rows.append({"pass": pass_name, "B": None, "H": None, "L": None, "d": None, "causal": None,
                     "impl": what, "kernel": None, "ms": None, "tflops": None, "status": "not built"})
    return rows


def tflops(row: dict) -> float | None:
    """TFLOP/s of a timed row by FlashAttention's count (:func:`cupyflash._bench.flop_count`)."""
    from cupyflash._bench import flop_count

    if not row.get("ms"):
        return None
    flops = flop_count(row["B"], row["H"], row["L"], row["L"], row["d"], causal=row["causal"],
                       backward=row["pass"] == "backward")
    return flops / (row["ms"] * 1e-3) / 1e12


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table: TFLOP/s, milliseconds, and the status of rows not timed.

    >>> print(format_table([{"pass": "forward", "B": 2, "H": 16, "L": 8192, "d": 128, "causal": False,
    ...                      "impl": "cupyflash", "kernel": "fwd_mma", "ms": 4.0, "tflops": None,
    ...                      "status": "ok"}]))
    | pass | d | causal | implementation | kernel | ms | TFLOP/s | status |
    | --- | --- | --- | --- | --- | --- | --- | --- |
    | forward | 128 | no | cupyflash | fwd_mma | 4.000 | 274.9 | ok |
    """
    lines = ["| pass | d | causal | implementation | kernel | ms | TFLOP/s | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rate = r.get("tflops") or tflops(r)
        causal = "" if r["causal"] is None else ("yes" if r["causal"] else "no")
        lines.append(f"| {r['pass']} | {'' if r['d'] is None else r['d']} | {causal} | {r['impl']} | "
                     f"{r.get('kernel') or ''} | {'' if r['ms'] is None else format(r['ms'], '.3f')} | "
                     f"{'' if rate is None else format(rate, '.1f')} | {r['status']} |")
    return "\n".join(lines)


def fill_table(rows: list[dict], deadline: float, log=print, *, device: str = "gpu") -> None:
    """Time the table's rows in place until ``deadline`` (``time.perf_counter()``): per case,
    one set of inputs for all its implementations.  ``device="cpu"`` times what
    :mod:`cupyflash._bench` runs on the CPU (the tests do)."""
    from cupyflash import _bench

    if device == "gpu":
        import cupy as xp
    else:
        xp = np
    cases = {}
    for r in rows:
        if r["status"] == "not reached":
            cases.setdefault((r["pass"], r["B"], r["H"], r["L"], r["d"], r["causal"]), []).append(r)
    for (pass_name, batch, heads, length, d, causal), case_rows in cases.items():
        if time.perf_counter() >= deadline:
            break
        case = _bench.Case("bfloat16", batch, heads, length, length, d, causal, pass_name == "backward")
        try:
            inputs = _bench.random_inputs(case, xp, seed=0)
        except Exception as error:  # noqa: BLE001 - out of memory, say: the next case may fit
            for r in case_rows:
                r["status"] = f"inputs failed: {type(error).__name__}"
            continue
        available = set(_bench.implementations(device, case, timing_only=True))
        for r in case_rows:
            left = deadline - time.perf_counter()
            if left <= 1.0:
                break
            if r["impl"] not in available:
                r["status"] = "not available here"
                continue
            try:
                fn, kernel = _bench.prepare(r["impl"], case, inputs, device)
                times = _bench.time_call(fn, device, repeat=20, warmup=3, max_seconds=min(2.0, left / 2),
                                         warm_s=0.1)
                r.update(kernel=kernel, ms=1e3 * float(np.median(times)), status=f"ok ({len(times)} runs)")
                r["tflops"] = tflops(r)
            except Exception as error:  # noqa: BLE001 - recorded; the next row still runs
                first = str(error).splitlines()[0][:120] if str(error) else ""
                r["status"] = f"failed: {type(error).__name__}: {first}"
                if device == "gpu" and not _bench.cuda_context_alive():
                    r["status"] += " (CUDA context lost: the table stops)"
                    log(format_table([r]).splitlines()[-1])
                    return
            log(format_table([r]).splitlines()[-1])
        del inputs
        if device == "gpu":
            xp.get_default_memory_pool().free_all_blocks()


# ---- the script ----------------------------------------------------------------------------------

def _device_or_reason() -> tuple[int, str]:
    """``(compute capability, device name)``, or ``(0, why not)``."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return 0, "no CUDA device"
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return int(cupy.cuda.Device(0).compute_capability), name
    except Exception as error:  # noqa: BLE001 - no CuPy, no driver
        return 0, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def default_json(device_name: str) -> Path:
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-") or "gpu"
    return ROOT / "benchmarks" / "results" / f"{_dt.date.today().isoformat()}-{slug}-first-contact.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=float(os.environ.get("FIRST_CONTACT_SECONDS", 60)),
                        help="seconds for everything (default 60); what is not reached is recorded so")
    parser.add_argument("--wgmma-seconds", type=float, default=25.0,
                        help="time limit of the wgmma probes' pytest run (default 25)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write the results (default benchmarks/results/<date>-<gpu>-first-contact.json)")
    parser.add_argument("--junit", type=Path, default=None, help="JUnit file of the wgmma probes' run")
    parser.add_argument("--emulator", action="store_true",
                        help="run the accumulation probes on the CPU emulator instead (no GPU, no table)")
    args = parser.parse_args(argv)
    if not args.budget > 0 or not args.wgmma_seconds >= 0:
        parser.error(f"--budget must be positive and --wgmma-seconds not negative; got {args.budget} "
                     f"and {args.wgmma_seconds}")
    start = time.perf_counter()
    deadline = start + args.budget

    if args.emulator:
        results = probe_report(run_probes_emulator())
        for r in results:
            print("first_contact (emulator):", describe(r))
        if args.json:
            args.json.write_text(json.dumps({"device": "emulator", "probes": results}, indent=1) + "\n")
        return 0

    arch, device = _device_or_reason()
    if not arch:
        print(f"first_contact: no usable GPU here ({device}); nothing run. This script needs CuPy and a CUDA device.")
        return 0
    doc = {"schema": 1, "device": device, "compute_capability": arch,
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "probes": [], "wgmma_tests": None, "table": []}
    path = args.json or default_json(device)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        doc["seconds"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"first_contact: {device} (sm_{arch}); results in {path}")
    try:
        doc["probes"] = probe_report(run_probes_gpu(arch))
    except Exception as error:  # noqa: BLE001 - the compile failed: say so, go on
        doc["probes"] = [{"instruction": n, "error": f"{type(error).__name__}: {error}"[:500]}
                         for n in INSTRUCTIONS]
    for r in doc["probes"]:
        print("first_contact:", describe(r))
    save()

    if arch == 90:
        seconds = min(args.wgmma_seconds, deadline - time.perf_counter() - 10)
        doc["wgmma_tests"] = run_wgmma_tests(seconds, args.junit)
        print(f"first_contact: wgmma probes (pytest -k '{WGMMA_SELECTION}'): rc {doc['wgmma_tests']['rc']} "
              f"in {doc['wgmma_tests']['seconds']} s: {doc['wgmma_tests']['summary']}")
    else:
        doc["wgmma_tests"] = {"rc": None, "summary": f"not run: sm_{arch} has no wgmma"}
    save()

    rows = table_rows()
    doc["table"] = rows
    try:
        fill_table(rows, deadline)
    except KeyboardInterrupt:   # gpu_check.sh's time limit: keep the rows timed so far
        print("first_contact: interrupted; the rows timed so far are kept")
    except Exception as error:  # noqa: BLE001 - the table is the last step: keep what it has
        print(f"first_contact: the table stopped: {type(error).__name__}: {error}")
    save()
    print(format_table(rows))
    print(f"first_contact: done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
