"""benchmarks/gpu_first_contact.py (step 0 of benchmarks/gpu_check.sh) without a GPU.

The accumulation probes (tests/emulator_planted/accumulation_probe.cu) on the CPU
emulator, whose products are summed exactly and rounded once: the script's decoder
must call each instruction "exact".  A NumPy model of a truncating accumulator,
written here independently of the script's own, computes what such tensor cores
would return for the same inputs: the decoder must name the model and the number
of extra bits.  Then the static build of the probe (sm_80 and sm_90a, as the script
compiles it on a device), the table's rows and formatting, and the script's exit
without a GPU.
"""

from __future__ import annotations

import doctest
import importlib.util
import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from cupyflash.emulator import emulator_available

from _util import wgmma_hazard_notes

ROOT = Path(__file__).resolve().parents[1]
_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")


@pytest.fixture(scope="module")
def fc():
    spec = importlib.util.spec_from_file_location("gpu_first_contact", ROOT / "benchmarks" / "gpu_first_contact.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- an independent model of a truncating accumulator ------------------------------------------

def _round_toward_zero_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32, rounding toward zero (the tensor cores' final normalisation)."""
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def _aligned(terms, extra_bits, drop):
    """Exact sums over the last axis of ``terms`` put on the grid of the largest."""
    biggest = np.abs(terms).max(axis=-1, keepdims=True)
    _, exponent = np.frexp(np.where(biggest > 0, biggest, 1.0))
    grid = np.ldexp(1.0, exponent - 1 - 23 - extra_bits)
    steps = {"rz": np.trunc, "rd": np.floor, "rn": np.rint}[drop](terms / grid)
    return (steps * grid).sum(axis=-1)


def truncating_mma(a, b, c, extra_bits: int, drop: str, group: int | None = None) -> np.ndarray:
    """D = A B + C as an aligning accumulator computes it: per output element, the K
    products and C (exact in float64 for bfloat16 and tf32 inputs) are put on the grid
    of 2**(e - 23 - extra_bits), e the leading-bit exponent of the largest of them, the
    bits below the grid dropped (drop: "rz" toward zero, "rd" toward minus infinity, "rn"
    to nearest even), the grid values summed and the sum rounded toward zero to float32.
    With ``group``, each run of ``group`` products (C with the first) is aligned on its
    own and the runs' sums added exactly."""
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    products = a[:, None, :] * b.T[None, :, :]                                      # M x N x K
    if group is None:
        total = _aligned(np.concatenate([c[:, :, None], products], axis=2), extra_bits, drop)
    else:
        runs = [products[:, :, i:i + group] for i in range(0, products.shape[2], group)]
        runs[0] = np.concatenate([c[:, :, None], runs[0]], axis=2)
        total = sum(_aligned(r, extra_bits, drop) for r in runs)
    return _round_toward_zero_f32(total)


def test_the_numpy_model_truncates_as_documented():
    def one(terms, extra_bits, drop):
        a = np.array([terms], np.float64)
        return float(truncating_mma(a, np.ones((len(terms), 1)), np.zeros((1, 1)), extra_bits, drop)[0, 0])

    ulp = 2.0 ** -23
    assert one([1.0, ulp / 2, ulp / 2], 0, "rz") == 1.0           # each half unit below the grid
    assert one([1.0, ulp / 2, ulp / 2], 1, "rz") == 1.0 + ulp     # on the grid with one extra bit
    assert one([1.0, ulp / 2], 0, "rn") == 1.0                    # a tie, to even
    assert one([1.0, 0.75 * ulp], 0, "rn") == 1.0 + ulp
    assert one([1.0, 0.75 * ulp], 0, "rz") == 1.0
    assert one([-1.0, -ulp / 4], 0, "rd") == -1.0 - ulp          # toward minus infinity
    assert one([1.0, ulp / 2, ulp / 4], 2, "rz") == 1.0           # 1 + 0.75 ulp, the sum rounded toward zero


# ---- the decoder ------------------------------------------------------------------------------------

def test_script_doctests_pass(fc):
    failed, tried = doctest.testmod(fc, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried >= 10 and failed == 0


@pytest.mark.parametrize("name", ["mma.m16n8k16.bf16", "mma.m16n8k8.tf32", "wgmma.m64n64k16.bf16"])
def test_every_model_gives_a_different_probe_output(fc, name):
    outputs = {(label, bits, drop): fc.model_output(name, bits, drop).tobytes()
               for label, bits, drop in fc._models()}
    assert len(set(outputs.values())) == len(outputs)


@pytest.mark.parametrize("name", ["mma.m16n8k16.bf16", "mma.m16n8k8.tf32", "wgmma.m64n64k16.bf16"])
@pytest.mark.parametrize("extra_bits, drop", [(0, "rz"), (3, "rz"), (6, "rz"), (-2, "rz"), (2, "rd"), (4, "rn")])
def test_a_truncating_accumulator_is_decoded_with_its_bits(fc, name, extra_bits, drop):
    d = truncating_mma(*fc.probe_inputs(name), extra_bits, drop)
    result = fc.classify(name, d)
    assert result["model"] == ("rounded" if drop == "rn" else "truncated"), result
    assert result["extra_bits"] == extra_bits and result["drop"] == fc.DROPS[drop]
    assert result["one_alignment"] is True
    # the ladder: 2**-k kept up to k = 23 + extra_bits, gone after
    assert [v != 0 for v in result["ladder"].values()] == [k <= 23 + extra_bits for k in fc.LADDER]
    assert result["error_per_term"] == 2.0 ** -(23 + extra_bits + (drop == "rn"))


@pytest.mark.parametrize("name", ["mma.m16n8k16.bf16", "mma.m16n8k8.tf32"])
def test_groups_of_products_aligned_apart_are_told_from_one_alignment(fc, name):
    d = truncating_mma(*fc.probe_inputs(name), 1, "rz", group=4)
    result = fc.classify(name, d)
    assert (result["model"], result["extra_bits"], result["one_alignment"]) == ("truncated", 1, False), result


def test_exact_sums_and_more_bits_than_the_ladder_reads_are_exact(fc):
    name = "mma.m16n8k16.bf16"
    a, b, c = fc.probe_inputs(name)
    exact = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
    assert fc.classify(name, exact)["model"] == "exact"
    assert fc.classify(name, truncating_mma(a, b, c, 8, "rz"))["model"] == "exact"


def test_a_misread_layout_is_not_called_a_model(fc):
    name = "mma.m16n8k16.bf16"
    a, b, c = fc.probe_inputs(name)
    exact = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
    swapped = exact.copy()
    swapped[[0, 8]] = swapped[[8, 0]]   # rows g and g + 8 of a fragment exchanged: no model
    result = fc.classify(name, swapped)
    assert result["model"] == "unknown" and "matches no model" in result["note"]
    swapped = exact.copy()
    swapped[[3, 11]] = swapped[[11, 3]]   # a ladder row moved below the ladder
    result = fc.classify(name, swapped)
    assert result["model"] == "unknown" and "outside the probe block" in result["note"]
    nan = exact.copy()
    nan[3, 1] = np.nan
    assert fc.classify(name, nan)["model"] == "unknown"


# ---- the probe kernels ---------------------------------------------------------------------------

@needs_emulator
def test_the_probes_run_on_the_emulator_and_decode_as_exact(fc):
    outputs = fc.run_probes_emulator()
    assert set(outputs) == set(fc.INSTRUCTIONS)
    for name, d in outputs.items():
        a, b, c = fc.probe_inputs(name)
        np.testing.assert_array_equal(d, (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32))
        result = fc.classify(name, d)
        assert result["model"] == "exact", result
        assert [result["ladder"][k] for k in fc.LADDER] == [2.0 ** -k for k in fc.LADDER]
    assert all(r["model"] == "exact" for r in fc.probe_report(outputs))


@needs_emulator
def test_the_script_records_the_emulators_probes(fc, tmp_path, capsys):
    out = tmp_path / "emulator.json"
    assert fc.main(["--emulator", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(p["instruction"], p["model"]) for p in doc["probes"]] == [(n, "exact") for n in fc.INSTRUCTIONS]
    assert capsys.readouterr().out.count(" exact;") == len(fc.INSTRUCTIONS)
    with pytest.raises(SystemExit):
        fc.main(["--budget", "0"])
    assert "--budget must be positive" in capsys.readouterr().err


def test_the_probe_compiles_for_sm80_and_sm90a_as_the_script_compiles_it(fc):
    from cupyflash._loader import COMPILE_OPTIONS
    from cupyflash import _nvrtc
    from cupyflash._report import parse_ptxas_log
    from cupyflash._source import assemble

    for target, kinds in (("sm_80", (0, 1)), ("sm_90a", (0, 1, 2))):
        options = COMPILE_OPTIONS + _nvrtc.include_options() + (
            f"-arch={target}", "--device-as-default-execution-space", "-ftz=true", "--ptxas-options=-v")
        log, _cubin, lowered = _nvrtc.compiler().compile(assemble(str(fc.PROBE)),
                                                [f"accumulation_probe<{k}>" for k in kinds], options, fc.PROBE.name)
        stats = parse_ptxas_log(log)
        assert len(lowered) == len(kinds)
        assert not any(stats[m]["spill_stores"] or stats[m]["stack_bytes"] for m in lowered.values()), log
        assert not wgmma_hazard_notes(log), log


# ---- the table and the script without a GPU -------------------------------------------------------

def test_table_rows_cover_the_cases_and_list_what_is_not_built(fc):
    rows = fc.table_rows()
    timed = [r for r in rows if r["status"] == "not reached"]
    for pass_name in ("forward", "backward"):
        cases = {(r["d"], r["causal"], r["impl"]) for r in timed if r["pass"] == pass_name}
        assert cases == set(itertools.product((64, 128), (False, True), fc.TABLE_IMPLS[pass_name]))
    assert {"cupyflash-wgmma", "torch-flash", "torch-cudnn"} <= set(fc.TABLE_IMPLS["forward"])
    assert {"cupyflash", "cupyflash-atomic"} <= set(fc.TABLE_IMPLS["backward"])
    assert all(r["L"] == 8192 for r in timed)
    assert len([r for r in rows if r["status"] == "not built"]) == len(fc.NOT_BUILT)


def test_table_formatting_computes_tflops_by_the_flashattention_count(fc):
    rows = fc.table_rows()
    fwd = next(r for r in rows if r["pass"] == "forward" and r["d"] == 128 and r["causal"] and r["impl"] == "cupyflash")
    bwd = next(r for r in rows if r["pass"] == "backward" and r["d"] == 64 and not r["causal"]
               and r["impl"] == "cupyflash-atomic")
    fwd.update(ms=2.0, kernel="fwd_mma", status="ok (20 runs)")
    bwd.update(ms=10.0, kernel="bwd_mma, atomic dQ", status="ok (20 runs)")
    text = fc.format_table(rows)
    # 4 B H L^2 d / 2 (causal) in 2 ms; backward 2.5 times the forward's 4 B H L^2 d in 10 ms
    fwd_rate = 4 * 2 * 16 * 8192 ** 2 * 128 / 2 / 2e-3 / 1e12
    bwd_rate = 2.5 * 4 * 2 * 16 * 8192 ** 2 * 64 / 10e-3 / 1e12
    assert f"| forward | 128 | yes | cupyflash | fwd_mma | 2.000 | {fwd_rate:.1f} | ok (20 runs) |" in text
    assert f"| backward | 64 | no | cupyflash-atomic | bwd_mma, atomic dQ | 10.000 | {bwd_rate:.1f} |" in text
    assert text.count("| not built |") == len(fc.NOT_BUILT)
    assert len(text.splitlines()) == len(rows) + 2


def test_the_table_times_each_row_of_a_case_on_the_same_inputs_until_the_deadline(fc, monkeypatch):
    # the timing loop on the CPU (what cupyflash._bench runs there), with prepare
    # recording the inputs each row got and one implementation that fails
    from cupyflash import _bench

    seen = []
    real_prepare = _bench.prepare

    def prepare(impl, case, inputs, device):
        seen.append((case, impl, tuple(id(x) for x in inputs)))
        if impl == "torch-flash":
            raise RuntimeError("planted\nsecond line")
        return real_prepare(impl, case, inputs, device)

    monkeypatch.setattr(_bench, "prepare", prepare)
    monkeypatch.setattr(_bench, "implementations", lambda device, case, timing_only=False: ["cupyflash", "torch-flash"])
    rows = fc.table_rows(shapes=((1, 2, 64, 16),))
    lines = []
    fc.fill_table(rows, time.perf_counter() + 60, log=lines.append, device="cpu")
    timed = [r for r in rows if r["impl"] == "cupyflash"]
    assert len(timed) == 4 and all(r["ms"] > 0 and r["status"].startswith("ok") for r in timed)
    assert all(r["tflops"] == pytest.approx(fc.tflops(r)) for r in timed)
    assert {r["status"] for r in rows if r["impl"] == "torch-flash"} == {"failed: RuntimeError: planted"}
    assert {r["status"] for r in rows if r["impl"] in ("cupyflash-wgmma", "torch-cudnn")} == {"not available here"}
    for case in {c for c, _, _ in seen}:   # one set of inputs per case
        assert len({ids for c, _, ids in seen if c == case}) == 1
    assert len(lines) == len(seen) == 4 * 2   # a line per row run: 4 cases, 2 implementations
    # a deadline already passed: nothing is timed
    rows = fc.table_rows(shapes=((1, 2, 64, 16),))
    fc.fill_table(rows, time.perf_counter() - 1, log=lines.append, device="cpu")
    assert {r["status"] for r in rows} == {"not reached", "not built"}


def test_the_wgmma_probes_run_is_stopped_at_its_time_limit(fc):
    start = time.perf_counter()
    got = fc.run_wgmma_tests(0.2, None)
    assert got["rc"] is None and "stopped after" in got["summary"]
    assert "test_gpu_wgmma.py" in got["command"] and fc.WGMMA_SELECTION in got["command"]
    assert time.perf_counter() - start < 15


def test_without_a_gpu_the_script_says_so_and_exits_0(fc, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(fc, "_device_or_reason", lambda: (0, "no CUDA device"))
    out = tmp_path / "r.json"
    assert fc.main(["--json", str(out)]) == 0
    assert "no usable GPU here (no CUDA device)" in capsys.readouterr().out
    assert not out.exists()
