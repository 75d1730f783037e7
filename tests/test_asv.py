"""The asv suites (benchmarks/) import, pass ``asv check`` and run once with ``asv run --quick``.

Runs asv on the interpreter running the tests (``--python=same``) with a copy
of asv.conf.json whose env, results and html directories lie in a temporary
directory, and a temporary HOME for ``asv machine``: nothing is written to the
checkout or to the user's home.  ``--quick`` runs each benchmark once and
saves no results.  On this CPU tier the GPU suites skip (their ``setup``
raises NotImplementedError) and the static-report suite is narrowed to the
fwd_v1 kernels (``CUPYFLASH_ASV_KERNELS``) to keep its NVRTC compiles short.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

asv_util = pytest.importorskip("asv.util", reason="asv is not installed (the test extra has it)")

ROOT = Path(__file__).resolve().parents[1]
# asv check imports the suites, asv run --quick runs every benchmark once: about a
# minute on two cores with the fork server, three with spawn.
TIME_LIMIT_S = 240


@pytest.fixture(scope="module")
def asv_cmd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asv")
    conf = asv_util.load_json(str(ROOT / "asv.conf.json"), js_comments=True)
    conf.update(repo=str(ROOT), benchmark_dir=str(ROOT / "benchmarks"),
                env_dir=str(tmp / "env"), results_dir=str(tmp / "results"),
                html_dir=str(tmp / "html"))
    config = tmp / "asv.conf.json"
    config.write_text(json.dumps(conf, indent=1))
    (tmp / "home").mkdir()
    env = dict(os.environ, HOME=str(tmp / "home"), CUPYFLASH_ASV_KERNELS="fwd_v1",
               # asv drops PYTHONPATH; ASV_PYTHONPATH is its way in (for an uninstalled checkout)
               ASV_PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                              if p))

    def run(*args, timeout=TIME_LIMIT_S):
        proc = subprocess.run([sys.executable, "-m", "asv", *args, "--config", str(config)],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        return proc.returncode, proc.stdout + proc.stderr

    rc, out = run("machine", "--yes", "--machine", "ci", timeout=60)
    assert rc == 0, out
    return run


def test_asv_check_finds_no_problems(asv_cmd):
    run = asv_cmd
    rc, out = run("check", "--python=same")
    assert rc == 0, out
    assert "No problems found" in out, out


def test_asv_quick_run_passes_and_writes_nothing_to_the_checkout(asv_cmd):
    run = asv_cmd
    before = {p for p in ROOT.glob(".asv/**/*")}   # the config's dirs, if anyone used them
    # The CPU tier has no CUDA, so the fork server is safe here and much faster
    # than the config's spawn (which GPU machines need).
    rc, out = run("run", "--python=same", "--quick", "--machine", "ci", "--show-stderr",
                  "--launch-method", "forkserver")
    assert rc == 0, out[-6000:]
    assert "failed" not in out, out[-6000:]
    for suite in ("bench_cpu.CPUForward.time_attention", "bench_cpu.CPUBackward.track_peak_memory",
                  "bench_gpu.GPUForward.track_tflops",
                  "bench_kernels.StaticReport.track_registers"):
        assert suite in out, f"{suite} did not run:\n{out[-6000:]}"
    if "NotImplementedError('no CUDA device')" not in out:     # a GPU machine ran them for real
        assert "bench_gpu.GPUBackward.track_gpu_ms" in out
    assert {p for p in ROOT.glob(".asv/**/*")} == before
