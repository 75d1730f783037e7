"""``python -m cupyflash bench`` and the function behind it, on tiny sizes on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupyflash import _bench
from cupyflash._bench import Case, bench, flop_count
from cupyflash.reference import naive_attention, naive_attention_backward

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
TORCH_CPU = {"torch-sdpa", "torch-flash", "torch-math"}


def test_flop_count_is_flashattentions():
    assert flop_count(2, 3, 128, 256, 64) == 4 * 2 * 3 * 128 * 256 * 64
    assert flop_count(2, 3, 128, 256, 64, causal=True) == 2 * 2 * 3 * 128 * 256 * 64
    assert flop_count(2, 3, 128, 256, 64, backward=True) == 2.5 * 4 * 2 * 3 * 128 * 256 * 64
    assert flop_count(1, 1, 64, 64, 32, causal=True, backward=True) == 2.5 * 2 * 64 * 64 * 32
    assert Case("float32", 2, 3, 128, 256, 64, True, True).flops == \
        flop_count(2, 3, 128, 256, 64, causal=True, backward=True)


def test_cases_are_the_product_of_the_options_forward_first():
    got = _bench.cases(dtypes=["float32", "float64"], batch=[1], heads=[2], seqlens=[64, 128],
                       head_dims=[16], causal=(False, True), backward=True)
    assert len(got) == 2 * 2 * 2 * 2
    assert [c.backward for c in got] == [False] * 8 + [True] * 8
    assert {(c.seqlen_q, c.seqlen_k) for c in got} == {(64, 64), (128, 128)}


# (Lq, Lk, options): the bench's cases, and every other argument the oracle takes --
# a window, GQA with broadcast batch dims, rows that see no key (causal with Lq > Lk)
NAIVE_CASES = [(5, 9, dict()), (5, 9, dict(causal=True)), (9, 5, dict(causal=True, window=(1, None))),
               (6, 7, dict(window=(2, 1), enable_gqa=True, scale=0.3))]


@pytest.mark.parametrize("lq, lk, kw", NAIVE_CASES, ids=["plain", "causal", "empty-rows", "window-gqa"])
def test_naive_peer_as_written_matches_the_oracle(lq, lk, kw):
    """naive_attention(..., oracle=False), the peer bench and the check time: float64
    inputs computed in float64, so within a few rounding errors of the oracle."""
    rng = np.random.default_rng(1)
    gqa = kw.get("enable_gqa", False)
    q, do = (rng.standard_normal((2, 4 if gqa else 3, lq, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2 if gqa else 3, lk, 8)) for _ in range(2))
    out, lse = naive_attention(q, k, v, return_lse=True, oracle=False, **kw)
    want, want_lse = naive_attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)        # -inf where a row sees no key
    grads = naive_attention_backward(do, q, k, v, oracle=False, **kw)
    for got, want, x in zip(grads, naive_attention_backward(do, q, k, v, **kw), (q, k, v)):
        assert got.shape == x.shape
        np.testing.assert_allclose(got, want, atol=1e-12)


def test_naive_peer_as_written_computes_in_the_accumulator_type():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 6, 8)).astype(np.float16) for _ in range(3))
    out, lse = naive_attention(q, k, v, return_lse=True, oracle=False)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    grads = naive_attention_backward(q, q, k, v, oracle=False)
    assert [g.dtype for g in grads] == [np.float16] * 3
    # float32 scores: not the float64 oracle rounded once, but close to it
    want = naive_attention(q, k, v)
    assert not np.array_equal(naive_attention(*(x.astype(np.float32) for x in (q, k, v)), oracle=False),
                              want.astype(np.float32))
    # float16 output: within half an ulp (2**-11 relative) of float32 sums of six O(1) terms
    np.testing.assert_allclose(out, want, rtol=2**-11, atol=1e-5)
    with pytest.raises(TypeError, match="oracle"):
        naive_attention(q, k, v, oracle="no")


def test_random_inputs_are_the_same_for_every_dtype_and_never_zero():
    case = Case("float64", 1, 2, 16, 24, 8)
    q, k, v, dout = _bench.random_inputs(case)
    assert q.shape == dout.shape == (1, 2, 16, 8) and k.shape == v.shape == (1, 2, 24, 8)
    assert np.count_nonzero(q) == q.size and not np.array_equal(k, v)
    q32 = _bench.random_inputs(Case("float32", 1, 2, 16, 24, 8))[0]
    np.testing.assert_array_equal(q, q32.astype(np.float64))


@pytest.fixture(scope="module")
def doc():
    cases = _bench.cases(dtypes=["float32"], batch=[1], heads=[2], seqlens=[64], head_dims=[16],
                         causal=(False, True), backward=True)
    return bench(cases, device="cpu", repeat=2, memory=False, gemm=True, settle_s=0)


def test_results_document_has_the_required_keys(doc):
    assert set(_bench.REQUIRED_KEYS) <= set(doc)
    assert doc["gpu"] is None and doc["device"] == "cpu" and doc["schema"] == _bench.SCHEMA
    assert doc["numpy"] == np.__version__ and doc["cpu"]
    json.loads(json.dumps(doc))                                    # serialisable as is
    for row in doc["rows"]:
        assert set(row) == set(_bench.ROW_KEYS)


def test_every_case_times_cupyflash_and_naive_numpy_and_they_agree(doc):
    for pass_name in ("forward", "backward"):
        for causal in (False, True):
            rows = {r["impl"]: r for r in doc["rows"]
                    if r["pass"] == pass_name and r["causal"] == causal}
            assert {"cupyflash", "numpy-naive"} <= set(rows)
            for r in rows.values():
                assert r["error"] is None, r
                assert r["ms"] > 0 and r["ms_min"] <= r["ms"] and r["repeats"] == 2
                assert r["flops"] == flop_count(1, 2, 64, 64, 16, causal=causal,
                                                backward=pass_name == "backward")
                assert r["tflops"] == pytest.approx(r["flops"] / (r["ms"] * 1e-3) / 1e12)
                assert r["max_abs_diff"] < 1e-4, r
                assert r["of_gemm"] > 0
            best = max(r["vs_best_peer"] for n, r in rows.items() if not n.startswith("cupyflash"))
            assert best == pytest.approx(1.0)


def test_pytorch_rows_present_iff_torch_is_importable(doc):
    impls = {r["impl"] for r in doc["rows"]}
    assert (impls & TORCH_CPU == TORCH_CPU) if HAS_TORCH else not impls & TORCH_CPU


@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
def test_pytorch_cpu_memory_is_measured_in_a_subprocess():
    got = bench([Case("float32", 1, 1, 512, 512, 16)], device="cpu", repeat=1, gemm=False,
                impls=["torch-*"], settle_s=0)
    assert {r["impl"] for r in got["rows"]} == TORCH_CPU
    for r in got["rows"]:
        assert r["peak_method"] == "peak RSS (subprocess)", r
        assert 0 <= r["peak_bytes"] < 2**30, r
    math = next(r for r in got["rows"] if r["impl"] == "torch-math")
    assert math["peak_bytes"] >= 512 * 512 * 4                    # its score matrix


def test_float64_results_are_compared_in_float64():
    got = bench([Case("float64", 1, 2, 128, 128, 16)], device="cpu", repeat=1, memory=False,
                gemm=False, settle_s=0)
    diffs = [r["max_abs_diff"] for r in got["rows"] if r["impl"] != "cupyflash"]
    assert diffs and all(0 <= d < 1e-12 for d in diffs)
    assert any(d > 0 for d in diffs)          # not rounded away through float32


def test_causal_with_lq_not_lk_runs_without_pytorch_and_says_why():
    got = bench([Case("float32", 1, 1, 32, 48, 16, causal=True)], device="cpu", repeat=1,
                memory=False, gemm=False, settle_s=0)
    assert {r["impl"] for r in got["rows"]} == {"cupyflash", "numpy-naive"}
    if HAS_TORCH:
        assert _bench.PEER_NOTE in got["notes"]
        assert "top-left" in _bench.markdown(got)


def test_cpu_path_needs_less_memory_than_naive():
    got = bench([Case("float32", 1, 1, 2048, 2048, 16)], device="cpu", repeat=1, gemm=False,
                impls=["cupyflash", "numpy-naive"], settle_s=0)
    peak = {r["impl"]: r["peak_bytes"] for r in got["rows"]}
    assert {r["peak_method"] for r in got["rows"]} == {"tracemalloc"}
    assert peak["numpy-naive"] >= 2048 * 2048 * 4                 # the score matrix
    assert peak["cupyflash"] < peak["numpy-naive"] / 2


def test_markdown_table_has_the_documented_columns(doc):
    text = _bench.markdown(doc)
    header = next(line for line in text.splitlines() if line.startswith("| pass"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells == [("GFLOP/s" if c == "FLOP/s" else c) for c in _bench.COLUMNS]
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(doc["rows"])
    assert all(line.count("|") == len(cells) + 1 for line in table)
    assert "no GPU" in text and "4·B·H·Lq·Lk·d" in text


def test_command_line_exits_0_without_a_gpu_and_writes_json(tmp_path):
    device = "cpu" if _bench.gpu_available() else "auto"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cupyflash", "bench", "--device", device, "--seqlen", "32,64",
         "--head-dim", "16", "--heads", "2", "--repeat", "1", "--causal", "both", "--backward",
         "--no-memory", "--no-gemm", "--settle", "0", "--impls", "cupyflash,numpy-naive",
         "--json", str(out),
         "--markdown", str(tmp_path / "r.md")],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["gpu"] is None
    assert len(got["rows"]) == 2 * 2 * 2 * 2                    # L x causal x pass x impl
    assert "| pass | dtype |" in proc.stdout and (tmp_path / "r.md").read_text() in proc.stdout


def test_command_line_rejects_gpu_without_one(capsys):
    if _bench.gpu_available():
        pytest.skip("a GPU is present")
    assert _bench.main_bench(["--device", "gpu", "--seqlen", "16"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_warm_up_is_by_time_as_well_as_by_count():
    """The GPU timings first keep the device busy for a while (its clocks ramp up), not
    only for a few calls: keep_busy returns after both the calls and the seconds."""
    import time

    from cupyflash._bench import keep_busy

    calls = []
    start = time.perf_counter()
    n = keep_busy(lambda: calls.append(1), lambda: time.sleep(0.01), calls=2, seconds=0.1)
    assert time.perf_counter() - start >= 0.1
    assert n == len(calls) >= 5
    assert keep_busy(lambda: calls.append(1), lambda: None, calls=7, seconds=0.0) == 7


def test_gpu_variants_name_catalogue_rows():
    """benchmarks/gpu_variants.py runs each tile as a family with that tile
    (``family.with_tiles``): every variant must yield its kernels (one fwd_mma row;
    bwd_mma's dK/dV and dQ rows), and every one must compile for sm_90 without spills
    (what the sweep times is what CI checks)."""
    import importlib.util
    from pathlib import Path

    from cupyflash import _report
    from cupyflash._loader import module_source

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_variants.py"
    spec = importlib.util.spec_from_file_location("gpu_variants", path)
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    # a backward: bwd_simt's delta kernel, then dK/dV and dQ (bwd_wgmma: then the atomic-dQ dK/dV kernel)
    families = {"fwd": ["fwd_mma"], "bwd": ["bwd_simt"] + ["bwd_mma"] * 2, "wfwd": ["fwd_wgmma"],
                "wbwd": ["bwd_simt"] + ["bwd_wgmma"] * 3, "sfwd": ["fwd_simt"], "sbwd": ["bwd_simt"] * 3,
                "dfwd": ["fwd_dmma"], "dbwd": ["bwd_simt", "bwd_dmma", "bwd_dmma"], "tfwd": ["fwd_tf32"]}
    kinds = set()
    for kind, d, tile in variants.all_variants():
        kinds.add(kind)
        _, rows = variants.variant(kind, d, tile)
        assert [r.family.name for r in rows] == families[kind], (kind, d, tile)
        # fwd, wfwd: the whole-KV row where the sweep's Lk is whole key blocks, unless the
        # variant says False (a sixth element for fwd, a fourth for wfwd)
        if kind == "fwd":
            (row,) = rows
            assert (row.block_m, row.block_n, row.threads // 32, row.kv_stages, row.lazy_rescale) == tuple(tile[:5])
            whole = variants.SHAPE["seqlen"] % row.block_n == 0
            assert row.whole_kv == ((len(tile) < 6 or tile[5]) and whole)
        if kind == "wfwd":
            (row,) = rows
            assert (row.block_n, row.threads // 128, row.lazy_rescale) == tuple(tile[:3])
            whole = variants.SHAPE["seqlen"] % row.block_n == 0
            assert row.whole_kv == ((len(tile) < 4 or tile[3]) and whole)
        if kind == "bwd":   # the whole-stream rows, unless a trailing False
            _, whole = variants.whole_flag(kind, tile)
            assert all(r.whole_kv == whole for r in rows[1:]), (tile, rows)
        if kind == "wbwd":  # the dQ kernel's whole-stream row (the sweep's Lk is whole blocks)
            (launch,), groups, streamed_dq = tile
            assert (rows[1].block_m, rows[1].threads // 128, rows[2].block_n) == (launch[1], groups, streamed_dq)
            assert [r.whole_kv for r in rows[1:]] == [False, True, False]
        if kind == "sfwd":
            (row,) = rows
            assert (row.dtype, row.block_m, row.block_n) == tuple(tile)
        if kind == "sbwd":   # <T, d, dv, own, streamed, atomic dQ> and <T, d, dv, own, streamed>
            dtype, own, streamed = tile
            assert all(r.dtype == dtype for r in rows)
            assert all(f", {own}, {streamed}" in r.name_expression for r in rows[1:]), rows
        if kind == "tfwd":             # <d, block_m, block_n, warps, passes>
            (row,) = rows
            assert (row.block_m, row.block_n, row.threads // 32, row.passes) == (*tile, 3)
        if kind in ("dfwd", "dbwd"):   # <d, block_m, block_n, warps>; <d, own, streamed, warps>
            assert all(r.name_expression.endswith(f"<{d}, {', '.join(map(str, tile))}>") for r in rows
                       if "dmma" in r.family.name), rows
        if kind in ("fwd", "wfwd", "sfwd", "sbwd", "dfwd", "dbwd", "tfwd"):
            for row in rows:
                target = row.family.compile_target("sm_90")
                report = _report.compile_report(module_source(row.entry), [row.name_expression], target,
                                                sass=False, filename=row.entry)
                assert report.functions[row.name_expression].spill_stores == 0, (d, tile)
    assert kinds == set(families)


def test_gpu_profile_cases_run_the_kernels_they_name():
    """benchmarks/gpu_profile.py (run under ncu by gpu_check.sh): every case's shape
    dispatches to the kernel family its name says, on an H100-class GPU."""
    import importlib.util
    from pathlib import Path

    import numpy as np

    from cupyflash._families import BACKWARD, DQ, FORWARD, Call, select
    from cupyflash._options import KernelOptions

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile", path)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    assert profile.CASES
    for name, (kind, dtype, b, h, length, d, deterministic) in profile.CASES.items():
        family = name.rsplit("_", 1)[0].replace("_atomic", "")
        dtype_name = "float16" if dtype == "bfloat16" else np.dtype(dtype).name   # same dispatch as bfloat16
        wgmma = "wgmma" in name   # gpu_profile.py turns the opt-in wgmma kernels on for these
        dmma = "dmma" in name     # and fwd_dmma, bwd_dmma (float64 and float32)
        precision = "tf32x3" if name.endswith("_x3") else "ieee"   # and fwd_tf32
        options = KernelOptions(wgmma=wgmma, dmma=frozenset({"float64", "float32"} if dmma else ()))
        call = Call(dtype_name, d, d, aligned=True, precision=precision, deterministic=deterministic)
        if kind == "forward":
            (row,) = select(FORWARD, call, 90, options)
            assert row.family.name == family, name
        else:
            rows = select(BACKWARD, call, 90, options)
            assert {r.family.name for r in rows[1:]} == {family}, name
            assert any(r.role == DQ for r in rows) == deterministic, name


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WATCHED_CASES = [Case("float32", 1, 1, 32, 32, 16), Case("float64", 1, 1, 32, 32, 16)]


@pytest.mark.parametrize("kind", ["hang", "crash", "lost"])
def test_gpu_check_table_goes_on_without_an_implementation_that_hangs_crashes_or_loses_the_context(
        kind, tmp_path):
    """benchmarks/gpu_check.py runs the table in a watched child process: a planted
    hang, crash or lost CUDA context in one implementation costs only that
    implementation's rows, from the case where it struck on."""
    check = _gpu_check()
    lines = []
    doc = check.bench_watched(WATCHED_CASES, budget=120, repeat=1, warmup=0, memory=False,
                              work=tmp_path, log=lines.append, device="cpu", stall_s=5,
                              fault={"impl": "numpy-naive", "kind": kind})
    rows = {(r["dtype"], r["impl"]): r for r in doc["rows"]}
    assert rows["float32", "cupyflash"]["ms"] > 0 and rows["float64", "cupyflash"]["ms"] > 0
    struck = rows["float32", "numpy-naive"]
    assert struck["ms"] is None and struck["error"]
    assert ("float64", "numpy-naive") not in rows            # left out of the later case
    assert [r["dtype"] for r in doc["rows"]] == sorted(r["dtype"] for r in doc["rows"]) # case order
    assert any(n.startswith("numpy-naive: ") and "left out of every later case" in n for n in doc["notes"])
    assert any("restarting without it" in line for line in lines)
    assert doc["device"] == "cpu" and doc["cupyflash"]                # the first child's header
    assert _bench.markdown(doc)


def test_gpu_check_table_without_faults_is_benchs(tmp_path):
    check = _gpu_check()
    doc = check.bench_watched(WATCHED_CASES, budget=120, repeat=1, warmup=0, memory=False,
                              work=tmp_path, log=lambda line: None, device="cpu")
    impls = _bench.implementations("cpu", WATCHED_CASES[0])
    assert [(r["dtype"], r["impl"]) for r in doc["rows"]] == [
        (c.dtype, name) for c in WATCHED_CASES for name in impls]
    assert all(r["ms"] > 0 and r["error"] is None for r in doc["rows"])
    assert not [n for n in doc["notes"] if "left out" in n or "budget" in n]
    assert (tmp_path / "bench-progress.jsonl").read_text().count('"done"') == len(WATCHED_CASES)


def test_gpu_check_splits_the_gpu_tier_into_one_process_per_gpu_module(tmp_path):
    """Every GPU-marked test is in exactly one of gpu_check.py's test groups."""
    check = _gpu_check()
    groups = check.test_groups()
    modules = sorted(p.stem for p in (ROOT / "tests").glob("test_gpu*.py"))
    assert [name for name, _ in groups] == [*modules, "others"]

    def collect(*targets):
        out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                              "-p", "no:cacheprovider", *targets], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout
        return {line for line in out.splitlines() if "::" in line}

    # each module group is one file (its tests: the whole run's of that file); the "others"
    # group is collected as gpu_check runs it -- two collections, not one per module
    wanted = collect("tests")
    collected = {}
    for name, targets in groups:
        if name == "others":
            collected[name] = collect(*targets)
        else:
            (target,) = targets
            assert Path(target).stem == name
            collected[name] = {t for t in wanted if t.startswith(f"tests/{name}.py::")}
    assert sum(len(c) for c in collected.values()) == len(wanted) > 0
    assert set().union(*collected.values()) == wanted


def test_gpu_check_sums_the_junit_files_of_its_test_groups(tmp_path):
    check = _gpu_check()
    for name, (tests, failures, skipped, seconds) in {"a": (5, 1, 1, 3.0), "b": (4, 0, 2, 7.5)}.items():
        failed = f'<testcase classname="t.{name}" name="x"><failure message="m"/></testcase>' * failures
        (tmp_path / f"junit-{name}.xml").write_text(
            f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="0" '
            f'skipped="{skipped}" time="{seconds}">{failed}</testsuite></testsuites>')
    got = check.test_summary(tmp_path, 1)
    assert (got["tests"], got["failures"], got["skipped"], got["passed"]) == (9, 1, 3, 5)
    assert got["seconds"] == 7.5 and got["failed"] == ["t.a::x"]
    assert got["summary"] == "5 passed, 1 failed, 3 skipped in 8 s"
    assert check.test_summary(tmp_path / "none", None)["summary"].startswith("no report")


_STAND_IN_PYTHON = r"""#!/usr/bin/env bash
# Plays the python3 of a GPU machine for gpu_check.sh: every step writes what the real one does.
args="$*"
work=""
json=""
while [ $# -gt 0 ]; do [ "$1" = --work ] && work="$2"; [ "$1" = --json ] && json="$2"; shift; done
case "$args" in
    -) cat > /dev/null ;;                                   # the GPU probe: a device is there
    *gpu_first_contact.py*) echo "{}" > "$json" ;;
    *--tests*) for i in 1 2 3 4 5 6 7 8 9; do
                   echo "<testsuites/>" > "$work/junit-group$i.xml"; echo "1 passed" > "$work/pytest-group$i.log"
               done ;;
    *--budget*) echo "case 1" > "$work/progress.jsonl"; echo "{}" > "$OUT/2026-01-01-gpu.json"
                echo "| table |" > "$OUT/2026-01-01-gpu.md" ;;
    *gpu_variants.py*--json*) echo "{}" > "$OUT/${args##* }" ;;
    *gpu_variants.py*) echo "{}" > "$OUT/gpu_variants.json" ;;
esac
echo "stand-in python: $args"
"""


def test_gpu_check_returns_everything_within_the_device_machines_file_limits(tmp_path):
    """The device machines return at most 8 files from $OUT, at most two folders down,
    named in letters, digits, '.', '_' and '-': gpu_check.sh keeps its many logs in one
    archive there, and the results and sweeps beside it."""
    import re
    import tarfile

    python = tmp_path / "python3"
    python.write_text(_STAND_IN_PYTHON)
    python.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHON=str(python), GPU_CHECK_PROFILE_SECONDS="0")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for path in files:
        rel = path.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    assert {p.name for p in files} == {"2026-01-01-gpu.json", "2026-01-01-gpu.md", "gpu_variants.json",
                                       "gpu_variants_wgmma.json", "gpu_check_logs.tar.gz", "first_contact.json"}
    with tarfile.open(out / "gpu_check_logs.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"first_contact.log", "first_contact.json", "precompile.log", "pytest.log", "bench.log",
            "variants.log", "variants-wgmma.log", "progress.jsonl"} <= names
    assert {f"junit-group{i}.xml" for i in range(1, 10)} <= names
    assert {f"pytest-group{i}.log" for i in range(1, 10)} <= names


def test_gpu_check_table_leaves_out_what_it_is_told_and_says_so(tmp_path):
    check = _gpu_check()
    doc = check.bench_watched(WATCHED_CASES, budget=120, repeat=1, warmup=0, memory=False,
                              work=tmp_path, log=lambda line: None, device="cpu",
                              leave_out={"numpy-naive": "not wanted here"})
    impls = [n for n in _bench.implementations("cpu", WATCHED_CASES[0]) if n != "numpy-naive"]
    assert [(r["dtype"], r["impl"]) for r in doc["rows"]] == [
        (c.dtype, name) for c in WATCHED_CASES for name in impls]
    assert "left out of this table: numpy-naive (not wanted here)" in doc["notes"]


def test_gpu_check_cases_come_in_the_order_of_the_issues_targets():
    """A spent time budget cuts the table's tail: the bf16 targets (issue 4 and issue 5's
    backward) first, then the exact dtypes at every length (issue 5), then what no target
    names (float16, the split-KV grids)."""
    check = _gpu_check()
    order = [c[0] for c in check.CASES + check.EXACT_L_CASES + check.FLOAT16_CASES] + [
        c[0] for c in check.SMALL_GRID_CASES]
    first_exact = order.index("float32")
    assert set(order[:first_exact]) == {"bfloat16"}
    assert order.index("float16") > max(i for i, dt in enumerate(order) if dt in ("float32", "float64")
                                         and i < len(check.CASES) + len(check.EXACT_L_CASES))
    assert check.QUICK == [check.CASES[0], check.CASES[8], check.CASES[10]]
    assert [c[-1] for c in check.QUICK] == [False, True, False]       # forward, backward, forward
    assert check.QUICK[2][0] == "float32"
    assert {"cupyflash-v1", "torch-efficient", "torch-cudnn"} == set(check.TABLE_LEAVE_OUT)
    source = (ROOT / "benchmarks" / "gpu_check.py").read_text()
    assert "leave_out=TABLE_LEAVE_OUT" in source
