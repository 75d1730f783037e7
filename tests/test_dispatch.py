"""Dispatch as a function of its inputs: the options value, the cache, no hidden state.

:class:`~cupyflash._options.KernelOptions` replaced five module globals and two
environment readers.  Checked here, without a GPU:

- ``KernelOptions.from_environment`` accepts exactly the words the old readers
  (``wgmma_enabled``, ``dmma_enabled``) accepted for ``CUPYFLASH_WGMMA`` and
  ``CUPYFLASH_DMMA``;
- :func:`cupyflash._families.select` caches per (families, call, arch, options),
  and a family with other tiles handed over in ``KernelOptions(families=...)``
  replaces the registry's: its rows run, the registry's do not, and the registry
  is left as it was;
- nothing in ``cupyflash`` remembers a dispatch choice between calls: the public
  functions read the environment at each call (two environments in one process
  launch different kernels, and back again).

The public calls run on ``backend="emulator"`` with an executor that only records
what it is asked to launch (nothing runs; the outputs are not looked at).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace

import numpy as np
import pytest

import cupyflash
from cupyflash import _dispatch
from cupyflash._api import run_attention
from cupyflash._arch import tile_class
from cupyflash._families import (BACKWARD, BWD_MMA, BWD_SIMT, BWD_WGMMA, FORWARD, FWD_DMMA, FWD_MMA, FWD_SIMT,
                                 FWD_WGMMA, Call, by_name, select)
from cupyflash._options import DMMA_ENV, WGMMA_ENV, KernelOptions

# ---- the environment ------------------------------------------------------------------------------

# What the old readers accepted, written out: CUPYFLASH_WGMMA stripped and lower-cased is one of
# 1/true/yes/on; CUPYFLASH_DMMA is a comma-separated list, each word stripped and lower-cased,
# where 1/true/yes/on/float64/all turn float64 on and float32/all float32.
WGMMA_WORDS = {
    "1": True, "true": True, "TRUE": True, " yes ": True, "On": True,
    "": False, "0": False, "false": False, "no": False, "off": False, "2": False, "enable": False,
    "1,1": False, "wgmma": False,
}
DMMA_WORDS = {
    "1": {"float64"}, "true": {"float64"}, "Yes": {"float64"}, " on": {"float64"}, "float64": {"float64"},
    "FLOAT64": {"float64"}, "float32": {"float32"}, "float64,float32": {"float64", "float32"},
    " float32 , float64 ": {"float64", "float32"}, "all": {"float64", "float32"}, "ALL": {"float64", "float32"},
    "1,float32": {"float64", "float32"}, "float16": set(), "": set(), "0": set(), "off": set(), "fp64": set(),
    "float32;float64": set(), "float64 float32": set(),
}


@pytest.mark.parametrize("value, expected", list(WGMMA_WORDS.items()), ids=repr)
def test_wgmma_is_read_from_the_environment_as_before(value, expected, monkeypatch):
    assert KernelOptions.from_environment({WGMMA_ENV: value}).wgmma is expected
    monkeypatch.setenv(WGMMA_ENV, value)
    assert KernelOptions.from_environment().wgmma is expected     # os.environ, read now


@pytest.mark.parametrize("value, expected", list(DMMA_WORDS.items()),
                         ids=[f"{v!r}-{sorted(e)}" for v, e in DMMA_WORDS.items()])   # sets print in hash order
def test_dmma_is_read_from_the_environment_as_before(value, expected, monkeypatch):
    assert KernelOptions.from_environment({DMMA_ENV: value}).dmma == expected
    monkeypatch.setenv(DMMA_ENV, value)
    assert KernelOptions.from_environment().dmma == expected


def test_an_unset_environment_turns_nothing_on(monkeypatch):
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    monkeypatch.delenv(DMMA_ENV, raising=False)
    assert KernelOptions.from_environment() == KernelOptions()
    both = KernelOptions.from_environment({WGMMA_ENV: "1", DMMA_ENV: "all"})
    assert both == KernelOptions(wgmma=True, dmma=frozenset({"float64", "float32"}))


# ---- select: the cache and replaced families ---------------------------------------------------------

HALF_CALL = Call("float16", 64, 64, seqlen_q=1000, seqlen_k=1000, aligned=True, scale=0.125)


def test_select_caches_per_families_call_arch_and_options():
    # a call no other test makes, so that its first select is a miss
    call = Call("float16", 120, 120, seqlen_q=777, seqlen_k=777, aligned=True, scale=0.1337)
    off, wgmma = KernelOptions(), KernelOptions(wgmma=True)
    before = select.cache_info()
    first = select(FORWARD, call, 90, off)
    again = select(FORWARD, call, 90, KernelOptions())           # equal, not the same object
    assert again is first
    assert select.cache_info().hits == before.hits + 1 and select.cache_info().misses == before.misses + 1
    # each part of the key on its own gives its own answer
    assert [r.family for r in first] == [FWD_MMA]
    assert [r.family for r in select(FORWARD, call, 90, wgmma)] == [FWD_WGMMA]
    assert [r.family for r in select((FWD_SIMT,), call, 90, off)] == [FWD_SIMT]
    assert select(FORWARD, call, 86, off) != first                     # sm86's tile for d = 128
    assert [r.family for r in select(FORWARD, Call("float16", 120, 120, scale=0.1337), 90, off)] == [FWD_SIMT]
    assert [r.family for r in select(BACKWARD, call, 90, wgmma)[1:]] == [BWD_WGMMA] * 2
    assert select.cache_info().misses == before.misses + 6
    assert select(FORWARD, call, 90, off) is first                     # still cached, unchanged


def _other_mma_tile(arch):
    """FWD_MMA with another tile for d = 64 on ``arch``'s class, and that tile."""
    cls = tile_class(arch)
    tile = (64, 32, 4, 1, False)
    assert FWD_MMA.tiles[cls][64] != tile
    return FWD_MMA.with_tiles(tiles={**FWD_MMA.tiles, cls: {**FWD_MMA.tiles[cls], 64: tile}}), tile


def test_a_family_in_the_options_replaces_the_registrys():
    registry_tiles = {cls: dict(t) for cls, t in FWD_MMA.tiles.items()}
    family, tile = _other_mma_tile(80)
    (row,) = select(FORWARD, HALF_CALL, 80, KernelOptions(families=(family,)))
    assert row.family is family and row in family.rows
    assert (row.block_m, row.block_n, row.threads // 32, row.kv_stages, row.lazy_rescale) == tile
    assert row.name_expression not in FWD_MMA.by_name and row.name_expression not in by_name()
    # the registry's family, its rows and its answer are as they were
    (default,) = select(FORWARD, HALF_CALL, 80, KernelOptions())
    assert default.family is FWD_MMA and default.name_expression in FWD_MMA.by_name
    assert default.name_expression != row.name_expression
    assert FWD_MMA.tiles == registry_tiles
    # a replacement that does not apply to the call changes nothing
    assert select(FORWARD, Call("float32", 64, 64, aligned=True), 80, KernelOptions(families=(family,))) == \
        select(FORWARD, Call("float32", 64, 64, aligned=True), 80, KernelOptions())


def test_a_replaced_backward_family_runs_its_own_rows():
    assert BWD_MMA.tiles[64] != (32, True)
    family = BWD_MMA.with_tiles(tiles={**BWD_MMA.tiles, 64: (32, True)})
    rows = select(BACKWARD, HALF_CALL, 80, KernelOptions(families=(family,)))
    assert [r.family for r in rows] == [BWD_SIMT, family, family]
    assert (rows[1].block_m, rows[2].block_n) == (32, 32)        # 32 streamed query rows, then keys
    assert all(r.name_expression not in by_name() for r in rows[1:])
    assert [r.family for r in select(BACKWARD, HALF_CALL, 80, KernelOptions())] == [BWD_SIMT, BWD_MMA, BWD_MMA]


# ---- no state between calls ------------------------------------------------------------------------


class RecordingExecutor:
    """The executor protocol, recording each launch's name expression; runs nothing."""

    def __init__(self, arch):
        self.arch = arch
        self.launched = []

    def launch(self, entry, name_expression, grid, block, shared_mem, params):
        self.launched.append(name_expression)


@pytest.fixture
def recorder(monkeypatch):
    """backend="emulator" launches into a RecordingExecutor of an sm_90 GPU."""
    ex = RecordingExecutor(90)
    monkeypatch.setitem(_dispatch._executors, ("emulator",), ex)
    return ex


def _inputs(dtype, length=256, d=64):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, length, d)).astype(dtype) for _ in range(3)]


def _families(names):
    return [by_name()[n].family for n in names]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # nothing ran: the outputs are uninitialised memory
def test_the_environment_is_read_at_each_call(recorder, monkeypatch):
    q, k, v = _inputs(np.float16)
    monkeypatch.delenv(WGMMA_ENV, raising=False)
    monkeypatch.delenv(DMMA_ENV, raising=False)
    picked = []
    for wgmma in ("", "1", "0", "1", ""):
        monkeypatch.setenv(WGMMA_ENV, wgmma)
        recorder.launched.clear()
        out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True)
        cupyflash.attention_backward(out, q, k, v, out, lse, backend="emulator")
        picked.append(_families(recorder.launched))
    off = [FWD_MMA, BWD_SIMT, BWD_MMA, BWD_MMA]
    on = [FWD_WGMMA, BWD_SIMT, BWD_WGMMA, BWD_WGMMA]
    assert picked == [off, on, off, on, off]
    q, k, v = _inputs(np.float64)
    for dmma, family in (("", FWD_SIMT), ("float64", FWD_DMMA), ("float32", FWD_SIMT), ("1", FWD_DMMA),
                         ("", FWD_SIMT)):
        monkeypatch.setenv(DMMA_ENV, dmma)
        recorder.launched.clear()
        cupyflash.attention(q, k, v, backend="emulator")
        assert _families(recorder.launched) == [family], dmma


def test_explicit_options_ignore_the_environment(recorder, monkeypatch):
    monkeypatch.setenv(WGMMA_ENV, "1")
    q, k, v = _inputs(np.float16)
    run_attention(q, k, v, backend="emulator", options=KernelOptions())
    assert _families(recorder.launched) == [FWD_MMA]
    assert select(FORWARD, HALF_CALL, 90, KernelOptions())[0].family is FWD_MMA


def test_a_tile_sweeps_family_is_launched_through_the_public_call_and_then_forgotten(monkeypatch):
    ex = RecordingExecutor(80)
    monkeypatch.setitem(_dispatch._executors, ("emulator",), ex)
    family, tile = _other_mma_tile(80)
    q, k, v = _inputs(np.float16)
    run_attention(q, k, v, backend="emulator", options=KernelOptions(families=(family,)))
    cupyflash.attention(q, k, v, backend="emulator")
    sweep, plain = ex.launched
    assert sweep in family.by_name and sweep not in by_name()
    assert by_name()[plain].family is FWD_MMA


def test_no_module_keeps_a_dispatch_switch():
    # the old switches (wgmma_override, split_override, whole_kv_override, dmma_override,
    # dmma_float32_override) and environment readers are gone from every module
    names = [m.name for m in pkgutil.walk_packages(cupyflash.__path__, "cupyflash.")
             if m.name.split(".")[-1] not in ("torch", "jax", "distributed")]   # optional frameworks
    assert "cupyflash._families.fwd_mma" in names and "cupyflash._run" in names
    for name in names:
        module = importlib.import_module(name)
        switches = [a for a in vars(module) if a.endswith("_override") or a in ("wgmma_enabled", "dmma_enabled")]
        assert not switches, (name, switches)


def test_a_family_serves_score_features_only_if_it_takes_them():
    # the seam a kernel family's bias/mask support plugs into: select() never picks a
    # family for a call asking for a feature it does not list in Family.takes
    from cupyflash._families import FORWARD, FWD_MMA, FWD_SIMT, Call, select, taking
    from cupyflash._options import KernelOptions

    call = Call("float16", 64, 64, seqlen_q=256, seqlen_k=256, aligned=True, scale=0.125,
                features=frozenset({"bias"}))
    assert taking(FORWARD, {"bias"}) == FORWARD          # every forward family reads the terms
    mma = FWD_MMA.with_tiles()
    mma.takes = frozenset({"mask"})                      # as if fwd_mma took masks only
    with pytest.raises(NotImplementedError, match="bias"):
        select((mma,), call, 80, KernelOptions())
    families = (mma, FWD_SIMT)
    assert taking(families, {"bias"}) == (FWD_SIMT,)
    assert {r.family for r in select(families, call, 80, KernelOptions())} == {FWD_SIMT}     # fwd_mma skipped
    # with terms, fwd_mma's d = 128 runs the 32-key tile (the 64-key one spills with them)
    terms = Call("float16", 128, 128, seqlen_q=256, seqlen_k=256, aligned=True, features=frozenset({"mask"}))
    assert {r.block_n for r in select(FORWARD, terms, 80, KernelOptions())} == {32}
    assert {r.block_n for r in select(FORWARD, replace(terms, features=frozenset()), 80, KernelOptions())} == {64}
    plain = Call("float16", 64, 64, seqlen_q=256, seqlen_k=256, aligned=True, scale=0.125)
    assert {r.family for r in select(families, plain, 80, KernelOptions())} == {mma}
