"""Test configuration: the `gpu` marker skips cleanly where no CUDA GPU is usable; the
static-report tests share one pytest-xdist worker."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
from hypothesis import Phase, settings

from _util import on_ci

# tests/mutations.py runs its selections with --hypothesis-profile=mutations: a planted bug
# needs one failing example, not the smallest one (shrinking a fuzzer's example takes minutes).
settings.register_profile("mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU path
        return False, f"CuPy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver / no device
        return False, f"no CUDA device ({type(exc).__name__})"
    return (n > 0, f"{n} CUDA device(s)" if n else "no CUDA device")


# Under pytest-xdist (the README's `-n auto --dist loadgroup`) two kinds of test
# share one worker each:
# - those using a fixture that compiles the catalogue for the static report
#   (cupyflash._report's in-process cache compiles each entry file once per arch
#   and process), so that CI's two CPUs compile the catalogue once, not per worker;
# - the GPU tier, so that one process at a time holds the device and its memory.
REPORT_FIXTURES = frozenset({"report", "rows"})


EMULATOR_SKIP = "CPU emulator unavailable"   # the start of every emulator test's skip reason


def pytest_sessionstart(session):
    from cupyflash.emulator import emulator_available

    ok, why = emulator_available()
    if not ok and on_ci():
        pytest.exit(f"CI=true and the CPU emulator cannot be built here ({why}): the emulated "
                    f"kernel tests would all skip and CI would go green without them", returncode=1)


def pytest_terminal_summary(terminalreporter):
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if EMULATOR_SKIP in str(getattr(r, "longrepr", ""))]
    if skipped:
        from cupyflash.emulator import emulator_available

        terminalreporter.write_line(f"cupyflash: {len(skipped)} tests skipped, the CPU emulator is unavailable "
                                    f"({emulator_available()[1]}); with CI=true they fail", yellow=True)


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's, which reads xdist_group
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.xdist_group("gpu"))
        elif REPORT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("static-report"))
    ok, reason = gpu_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu tier: {reason}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def cuda_spy(monkeypatch):
    """The CUDA executor behind cupyflash's public calls in this test, wrapped in a
    LaunchSpy (tests/_util.py) that records each launch's name and grid (GPU tier)."""
    from cupyflash import _dispatch

    from _util import LaunchSpy

    recorder = LaunchSpy(_dispatch.executor_for("cuda"))
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: recorder)
    return recorder


@pytest.fixture
def emulate(monkeypatch):
    """``emulate(arch, seed=None, **options)``: cupyflash's emulator backend at that arch's
    dispatch (shuffled warps, race checks; the warp order seeded by ``seed``, default the
    arch) with those KernelOptions, through a LaunchSpy (tests/_util.py) it returns."""
    from cupyflash import _dispatch
    from cupyflash._options import KernelOptions
    from cupyflash.emulator import EmulatorExecutor

    from _util import LaunchSpy

    def use(arch, seed=None, **options):
        spy = LaunchSpy(EmulatorExecutor(arch=arch, seed=arch if seed is None else seed, shuffle=True,
                                         race_check=True))
        monkeypatch.setattr(_dispatch, "executor_for", lambda backend: spy)
        chosen = KernelOptions(**options)
        monkeypatch.setattr(KernelOptions, "from_environment", classmethod(lambda cls, environ=None: chosen))
        return spy
    return use


@pytest.fixture
def rng(request):
    """A generator seeded by the test's name: fresh inputs per test, the same on every run.

    Test modules that need another seeding define their own ``rng``."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
