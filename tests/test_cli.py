"""``python -m cupyflash``: the help lists every subcommand, progress goes to stderr (none
under --json), and the check times the same naive attention as ``bench``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cupyflash import _bench, _cli, _report, reference


def test_help_lists_every_subcommand_with_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        _cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("kernels", "bench"):
        assert any(line.split()[:1] == [name] and len(line.split()) > 3 for line in out.splitlines()), \
            f"{name} missing from --help:\n{out}"


def test_the_check_times_the_naive_attention_bench_times(monkeypatch):
    """Both time the oracle's module as a user would write it (``oracle=False``), not
    the float64 oracle and not a copy of their own."""
    calls = []
    as_written = reference.naive_attention

    def spy(*args, **kw):
        calls.append(kw.get("oracle", True))
        return as_written(*args, **kw)

    monkeypatch.setattr(reference, "naive_attention", spy)
    monkeypatch.setattr(_cli, "_median_time", lambda fn, repeat=5: (fn(), 1.0)[1])
    _cli._timing_table(np.random.default_rng(0), lengths=(16,), d=8)
    assert calls == [False]
    case = _bench.Case("float32", 1, 2, 16, 16, 8)
    fn, _ = _bench.prepare("numpy-naive", case, _bench.random_inputs(case), "cpu")
    fn()
    assert calls == [False, False]


def _fake_report(archs, rows_in, *, sass=True, sass_text=False, progress=None, launchable=False):
    for done in (1, 2, 3):
        if progress is not None:
            progress(done, 3, ["fwd_simt", "fwd_mma", "bwd_mma"][done - 1], archs[0])
    return []


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_kernels_reports_each_module_on_stderr_unless_json(as_json, monkeypatch, capsys):
    monkeypatch.setattr(_report, "kernel_report", _fake_report)
    assert _report.main_kernels(["--arch", "sm_80"] + (["--json"] if as_json else [])) == 0
    captured = capsys.readouterr()
    if as_json:
        assert captured.err == "" and json.loads(captured.out) == []
    else:
        assert "compiling 2/3 fwd_mma sm_80..." in captured.err
        assert "compiling" not in captured.out
