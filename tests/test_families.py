"""What every kernel family must do, parametrized over the registry (cupyflash._families).

Four sections, each a loop over :data:`~cupyflash._families.FAMILIES`,
:data:`~cupyflash._families.FORWARD` or :data:`~cupyflash._families.BACKWARD`
and a table with one row per family:

- catalogue and launch: each family's rows are unique, launched on the archs of
  :data:`CATALOGUE` only, fit the shared memory of every arch that launches them
  (and the family's own limit), with the grid, block and shared memory of
  :data:`LAUNCH` (the kernels' ``kSmemBytes``);
- dispatch: for the representative calls of :data:`DISPATCH`, the family (and head-dim
  bucket, roles, gradients) :func:`~cupyflash._families.select` picks -- where the
  family applies and where it must leave the call to another -- always a row the arch
  launches; the opt-in families follow the environment; the whole-block rows;
- static: every row compiled offline by NVRTC for sm_80, sm_86, sm_89 and sm_90 (the
  static report; the compiles are shared with tests/test_static_report.py) without
  spills, stack or local memory, with registers that allow the kernel's occupancy
  target (its ``__launch_bounds__`` minimum), and, per :data:`SASS`, the instructions of
  one unrolled copy of its main loop;
- emulated: every instantiation (or representative shapes, :data:`FORWARD_RUNS`,
  :data:`BACKWARD_RUNS`) on the CPU emulator (shuffled threads, race checks, outputs
  poisoned) against the float64 oracle, with partial query and key blocks, and the
  masks of :data:`FORWARD_MASKS` / :data:`BACKWARD_MASKS` with Lq < Lk and Lq > Lk.

A new family gets all of this by its entry in the registry and a row in each table.
What is particular to one family (wgmma's schedule and ordering rules, TF32's error
model, DMMA's rounding of float32 once from double, fwd_mma's swizzle and lazy rescale,
the atomic dQ paths, ...) stays in that family's file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from cupyflash import _report, _run
from cupyflash._arch import DMMA_ARCHS, SM_LIMITS
from cupyflash._families import (BACKWARD, BWD_SIMT, DELTA, DKDV, DQ, FAMILIES, FORWARD, Call, Sizes,
                                 catalogue, select)
from cupyflash._families.fwd_dmma import DMMA_DTYPES, DMMA_HEAD_DIMS
from cupyflash._families.fwd_mma import MMA_HEAD_DIMS
from cupyflash._families.fwd_tf32 import TF32_HEAD_DIMS, TF32_PASSES
from cupyflash._families.fwd_wgmma import WGMMA_HEAD_DIMS
from cupyflash._options import KernelOptions
from cupyflash.emulator import EmulatorExecutor

from _kernel_util import Case, needs_emulator, numpy_dtype, qkv, run_half_forward
from _util import DTYPES, HALF, LaunchSpy, forward_against_oracle, plain_call_rows

NAMES = {f.name: f for f in FAMILIES}
DEFAULT = KernelOptions()
WGMMA = KernelOptions(wgmma=True)
DMMA = KernelOptions(dmma=frozenset({"float64", "float32"}))
HALF_NAMES = [d.name for d in HALF]
DTYPE_NAMES = [d.name for d in DTYPES]


def _ids(families):
    return [f.name for f in families]


def _bucket(dims, d):
    return min(b for b in dims if b >= d)


# ---- catalogue and launch ----------------------------------------------------------------------

ALL = {"float16", "bfloat16", "float32", "float64"}
HALF_SET, TF32_SET, DMMA_SET = {"float16", "bfloat16"}, {"float32"}, set(DMMA_DTYPES)
EVERY_ARCH, SM80_ON = {75, 80, 86, 89, 90, 100, 120}, {80, 86, 89, 90, 100, 120}
# name: (rows in the catalogue or None, their dtypes, the archs of (75, 80, 86, 89, 90, 100,
# 120) that launch some of them, whether each of those launches every row)
CATALOGUE = {
    "fwd_simt": (16, ALL, EVERY_ARCH, True),
    "fwd_v1": (4, ALL, EVERY_ARCH, True),
    "fwd_combine": (4, ALL, EVERY_ARCH, True),
    "fwd_mma": (None, HALF_SET, SM80_ON, False),                    # each arch class its tiles
    # two dtypes; split-KV and whole-KV rows; each family's other tile at d = 128 for calls
    # with score features (feature_tiles); decoupled rows (bounds-checked and whole-KV) at
    # d = 64 and 128 (KernelOptions.decoupled)
    "fwd_wgmma": (2 * 3 * (len(WGMMA_HEAD_DIMS) + 1) + 2 * 2 * 2, HALF_SET, {90}, True),
    "fwd_dmma": ((len(DMMA_HEAD_DIMS) + 1) * len(DMMA_DTYPES), DMMA_SET, set(DMMA_ARCHS), True),
    # fwd_tf32 also its d = 64 tile for calls over a paged KV cache (paged_tiles)
    "fwd_tf32": ((len(TF32_HEAD_DIMS) + 2) * len(TF32_PASSES), TF32_SET, SM80_ON, True),
    "bwd_simt": (None, ALL, EVERY_ARCH, True),
    "bwd_mma": (None, HALF_SET, SM80_ON, False),
    # per dtype and head dim: dK/dV (deterministic and atomic-dQ) and dQ, or (192, 256) dV,
    # dK and dQ -- and the dQ kernel's whole-stream row; at d = 128, for calls with score
    # features, a dQ kernel of 64-key blocks (and its whole-stream row) and dV, dK apart;
    # and the atomic-dQ dK/dV rows (d = 64, 128) with dQ by bulk reductions (async_dq),
    # unordered and in key-block order (deterministic), and the decoupled dK/dV rows
    # (d = 64, 128; KernelOptions.decoupled)
    "bwd_wgmma": (2 * (len(WGMMA_HEAD_DIMS) * 4 + 4 + 2 + 2 + 2), HALF_SET, {90}, True),
    "bwd_dmma": (2 * len(DMMA_HEAD_DIMS) * len(DMMA_DTYPES), DMMA_SET, set(DMMA_ARCHS), True),   # dK/dV, dQ
    # dK/dV and dQ per head dim and pass count, and d = 128's for calls with score features
    "bwd_tf32": (2 * (len(TF32_HEAD_DIMS) + 1) * len(TF32_PASSES), TF32_SET, SM80_ON, True),
}
# Compile targets the static report and the loader build an entry for (None: no kernels there).
TARGETS = {"fwd_wgmma": {"sm_90": "sm_90a", "sm_80": None, "sm_86": None},
           "bwd_wgmma": {"sm_90": "sm_90a", "sm_86": None},
           "fwd_mma": {"sm_90": "sm_90", "sm_80": "sm_80"}}


@pytest.mark.parametrize("family", FAMILIES, ids=_ids(FAMILIES))
def test_catalogue_rows_are_unique_and_launched_where_the_family_runs(family):
    count, dtypes, archs, every_row = CATALOGUE[family.name]
    rows = family.rows
    assert len({r.name_expression for r in rows}) == len(rows)
    assert {r.dtype for r in rows} == dtypes
    assert all(r.family is family and r.entry == family.entry for r in rows)
    if count is not None:
        assert len(rows) == count
    launched = set()
    for arch in (75, 80, 86, 89, 90, 100, 120):
        on = set(family.launchable(arch))
        assert bool(on) == (arch in archs), arch
        assert on <= set(rows)
        if on and every_row:
            assert on == set(rows), arch
        launched |= on
    assert launched == set(rows)   # no row that no architecture launches
    for arch, target in TARGETS.get(family.name, {}).items():
        assert family.compile_target(arch) == target


def _sizes(family, row, **kw):
    return Sizes(2, 6, 3, 1000, 333, row.head_dim, row.head_dim_v, num_splits=2 if family.split_kv else 1, **kw)


def _mma_bwd(row):
    # K (and V for dK) or Q and dO; per stage two streamed tiles and two floats per
    # streamed row; the atomic dQ's dS^T tile
    own, streamed = (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)
    own_tiles = 2 if row.role == DQ or row.grads & 2 else 1
    return (own_tiles * own * row.head_dim * 2 + row.kv_stages * (2 * streamed * row.head_dim * 2 + 2 * streamed * 4)
            + (own * streamed * 2 if row.grads & 4 else 0))


def _wgmma_bwd(row):
    # K (and V for dK); two stages of Q, dO and of lse, delta; the dS^T tile; the float dQ
    # tile of bulk dQ (rows padded by 16 bytes); 1 KB alignment; the decoupled rows' 4 mbarriers
    own, streamed = (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)
    own_tiles = 2 if row.role == DQ or row.grads & 2 else 1
    return (own_tiles * own * row.head_dim * 2 + 2 * 2 * streamed * row.head_dim * 2 + 2 * 2 * streamed * 4
            + (own * streamed * 2 if row.grads & 4 else 0) + (streamed * (row.head_dim + 4) * 4 if row.grads & 8 else 0)
            + 1024 + 32 * row.decoupled)


def _tf32_fwd(row):
    # three passes: K and V (d = 128's 32-key tile: V alone) as TF32 big and small parts,
    # where two CTAs still fit an sm_80 SM
    planes = 2 if row.passes == 1 else 4 if row.head_dim < 128 or row.block_n <= 16 else 3
    return (row.block_m + planes * row.block_n) * row.head_dim * 4


def _own_streamed(row):
    return (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)


# name: (threads per CTA from the row, shared memory of a launch from the row (bytes), the
# family's own limit on it in KB).  The shared memory is each kernel's kSmemBytes.
LAUNCH = {
    "fwd_mma": (lambda r: r.threads, lambda r: (r.block_m + 2 * r.kv_stages * r.block_n) * r.head_dim * 2, 227),
    # (the decoupled rows: a producer warpgroup, and 8 mbarriers after the tiles)
    "fwd_wgmma": (lambda r: 2 * r.block_m + 128 * r.decoupled,
                  lambda r: (r.block_m + 4 * r.block_n) * r.head_dim * 2 + 1024 + 64 * r.decoupled, 227),
    # Q, K, V tiles of doubles; float32 is widened on the way in: Q and one K/V buffer
    "fwd_dmma": (lambda r: r.threads,
                 lambda r: (r.block_m + (2 if r.dtype == "float64" else 1) * r.block_n) * r.head_dim * 8, 99),
    "fwd_tf32": (lambda r: r.threads, _tf32_fwd, 99),
    "bwd_mma": (lambda r: 128, _mma_bwd, 99),
    "bwd_wgmma": (lambda r: 2 * (r.block_n if r.role == DKDV else r.block_m) + 128 * r.decoupled, _wgmma_bwd, 227),
    # K and V (Q and dO), then two stages (float64) or one (float32) of the two streamed
    # tiles, in doubles
    "bwd_dmma": (lambda r: r.threads, lambda r: (2 * _own_streamed(r)[0] + 2 * (2 if r.dtype == "float64" else 1)
                                                * _own_streamed(r)[1]) * r.head_dim * 8, 99),
    # K and V (Q and dO), then two stages of the two streamed tiles, in floats
    "bwd_tf32": (lambda r: r.threads, lambda r: (2 * _own_streamed(r)[0] + 4 * _own_streamed(r)[1]) * r.head_dim * 4,
                 99),
}
LAUNCHED = [NAMES[n] for n in LAUNCH]


@pytest.mark.parametrize("family", LAUNCHED, ids=_ids(LAUNCHED))
def test_launch_config_grid_block_and_shared_memory(family):
    threads, shared_bytes, limit_kb = LAUNCH[family.name]
    for row in family.rows:
        sizes = _sizes(family, row)
        grid, block, shared = family.launch_config(row, sizes)
        if row.role == DKDV:   # one CTA per block of keys and kv head, else of query rows and query head
            ctas = 2 * 3 * math.ceil(333 / row.block_n)
        else:
            ctas = 2 * 6 * math.ceil(1000 / row.block_m)
        assert grid == (ctas, sizes.num_splits, 1), row
        assert block == (row.threads, 1, 1) and row.threads == threads(row), row
        assert row.head_dim == row.head_dim_v, row
        assert shared == shared_bytes(row) <= limit_kb * 1024, row
    for arch, limits in SM_LIMITS.items():   # every row an arch launches fits its shared memory
        for row in family.launchable(arch):
            assert family.launch_config(row, _sizes(family, row))[2] <= limits.shared_per_block_optin, (arch, row)


# ---- dispatch -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pick:
    """A call, where it runs, and what dispatch must pick for it: the family ``expect`` (the
    plan's rows after bwd_simt's delta kernel, for the backward), in head-dim ``bucket``;
    optionally the roles of the whole plan, the dK/dV rows' gradient bits and other
    properties of the family's rows."""

    call: Call
    arch: int
    options: KernelOptions
    expect: str
    bucket: int | None = None
    roles: tuple | None = None
    grads: tuple | None = None
    props: dict = field(default_factory=dict)


def pick(dtype, d, dv=None, *, arch=80, options=DEFAULT, expect, bucket=None, roles=None, grads=None,
         props=None, **call):
    return Pick(Call(dtype, d, d if dv is None else dv, **call), arch, options, expect, bucket,
                None if roles is None else tuple(roles), None if grads is None else tuple(grads), props or {})


THREE = (DELTA, DKDV, DQ)


def _fwd_simt():
    cases = [pick(dtype, d, dv, expect="fwd_simt", bucket=bucket) for dtype in DTYPE_NAMES
             for d, dv, bucket in [(1, 1, 32), (32, 3, 32), (33, 8, 64), (8, 65, 128), (128, 128, 128),
                                   (200, 1, 256), (256, 256, 256)]]
    for dtype in HALF_NAMES:   # dv != d: the simt bucket of max(d, dv)
        cases.append(pick(dtype, 64, 32, aligned=True, expect="fwd_simt", bucket=64))
    return cases


def _fwd_mma():
    from cupyflash._families import FWD_MMA

    cases = [pick(dtype, d, arch=arch, aligned=True, expect="fwd_mma", bucket=d,
                  props=dict(zip(("block_m", "block_n", "kv_stages", "lazy_rescale"),
                                 (lambda t: (t[0], t[1], t[3], t[4]))(FWD_MMA.class_tiles(arch)[d])),
                             threads=32 * FWD_MMA.class_tiles(arch)[d][2]))
             for arch in (80, 86, 90) for dtype in HALF_NAMES for d in MMA_HEAD_DIMS]
    for dtype in HALF_NAMES:
        cases += [pick(dtype, 64, aligned=True, expect="fwd_mma", bucket=64),
                  pick(dtype, 1, arch=90, aligned=True, expect="fwd_mma", bucket=32),      # padded up to 32
                  pick(dtype, 200, arch=86, aligned=True, expect="fwd_mma", bucket=224),
                  pick(dtype, 256, arch=89, aligned=True, expect="fwd_mma", bucket=256),
                  pick(dtype, 64, expect="fwd_simt"),                     # alignment unknown
                  pick(dtype, 64, aligned=False, expect="fwd_simt"),      # rows not 16-byte aligned
                  pick(dtype, 64, 32, aligned=True, expect="fwd_simt"),   # dv != d
                  pick(dtype, 64, arch=75, aligned=True, expect="fwd_simt")]   # no mma.sync m16n8k16 before sm_80
    cases += [pick(dtype, 64, arch=90, aligned=True, expect="fwd_simt") for dtype in ("float32", "float64")]
    # a scale the kernel folds into its exponent as a float32 scale * log2(e): zero,
    # negative, float32-subnormal or float32-zero scales run fwd_simt
    for scale, expect in ((3.0, "fwd_mma"), (1e-30, "fwd_mma"), (1e-40, "fwd_simt"), (4.4e-159, "fwd_simt"),
                          (-0.7, "fwd_simt"), (0.0, "fwd_simt")):
        cases.append(pick("float16", 32, aligned=True, scale=scale, expect=expect))
    return cases


def _fwd_wgmma():
    cases = []
    for dtype in HALF_NAMES:
        for d in (64, 100, 128, 192, 256):
            cases += [pick(dtype, d, arch=90, aligned=True, options=WGMMA, expect="fwd_wgmma",
                           bucket=_bucket(WGMMA_HEAD_DIMS, d)),
                      pick(dtype, d, arch=90, aligned=True, expect="fwd_mma")]   # default: off
            cases += [pick(dtype, d, arch=arch, aligned=True, options=WGMMA, expect="fwd_mma")
                      for arch in (80, 86, 89, 100, 120)]
        cases += [pick(dtype, d, arch=90, aligned=True, options=WGMMA, expect="fwd_mma")
                  for d in (32, 96, 160, 224)]   # between pages: fwd_mma's own head dims
        cases += [pick(dtype, 64, arch=90, aligned=False, options=WGMMA, expect="fwd_simt"),
                  pick(dtype, 64, arch=90, aligned=True, scale=-1.0, options=WGMMA, expect="fwd_simt"),
                  pick(dtype, 64, 48, arch=90, aligned=True, options=WGMMA, expect="fwd_simt")]
    return cases


def _fwd_dmma():
    cases = []
    for dtype in DMMA_DTYPES:
        for arch in (80, 86, 89, 90):
            for d in (1, 3, 32, 40, 64, 100, 128):
                if arch in DMMA_ARCHS:
                    cases.append(pick(dtype, d, arch=arch, options=DMMA, expect="fwd_dmma",
                                      bucket=_bucket(DMMA_HEAD_DIMS, d), props={"dtype": dtype}))
                else:
                    cases.append(pick(dtype, d, arch=arch, options=DMMA, expect="fwd_simt"))
                cases.append(pick(dtype, d, arch=arch, expect="fwd_simt"))   # default: off
        # not for dv != d, or head dims above 128
        cases += [pick(dtype, 64, 32, options=DMMA, expect="fwd_simt"),
                  pick(dtype, 129, arch=90, options=DMMA, expect="fwd_simt")]
    cases += [pick(dtype, 64, options=DMMA, expect="fwd_simt") for dtype in HALF_NAMES]
    return cases


def _fwd_tf32():
    cases = []
    for precision, passes in TF32_PASSES.items():
        for arch in (80, 86, 89, 90, 100, 120):
            for d in (1, 3, 32, 40, 64, 100, 128):
                cases += [pick("float32", d, arch=arch, precision=precision, expect="fwd_tf32",
                               bucket=_bucket(TF32_HEAD_DIMS, d), props={"passes": passes}),
                          # the default, and precision="ieee", keep IEEE float32
                          pick("float32", d, arch=arch, expect="fwd_simt"),
                          pick("float32", d, arch=arch, precision="ieee", expect="fwd_simt")]
        # where the kernel does not apply, IEEE float32
        cases += [pick("float32", 64, arch=75, precision=precision, expect="fwd_simt"),
                  pick("float32", 64, 32, precision=precision, expect="fwd_simt"),
                  pick("float32", 129, arch=90, precision=precision, expect="fwd_simt")]
        # zero and negative scales, and those the kernel's float32 scale * log2(e) holds as 0
        # or a subnormal (NaN rows once, found by the tf32x3 fuzzer)
        cases += [pick("float32", 64, precision=precision, scale=scale, expect="fwd_simt")
                  for scale in (0.0, -1.0, 4.4e-159, 1e-40)]
        cases.append(pick("float32", 64, precision=precision, scale=1e-37, expect="fwd_tf32"))
        # asked for explicitly, TF32 wins over the opt-in float32 DMMA path
        cases.append(pick("float32", 64, arch=90, precision=precision, options=DMMA, expect="fwd_tf32"))
    cases.append(pick("float32", 64, arch=90, options=DMMA, expect="fwd_dmma"))
    return cases


def _bwd_simt():
    cases = []
    for dtype in DTYPE_NAMES:
        acc = "float64" if dtype == "float64" else "float32"
        for d, dv, bucket in [(1, 1, 32), (32, 3, 32), (33, 8, 64), (8, 65, 128), (200, 1, 256), (256, 256, 256)]:
            cases.append(pick(dtype, d, dv, expect="bwd_simt", bucket=bucket, roles=THREE, grads=[3],
                              props={"delta_head_dim": bucket}))
            # deterministic=False: delta, then the dK/dV kernel that adds dQ by atomics, where
            # its streamed block is whole row groups (16 rows)
            atomic = BWD_SIMT.tiles[acc][bucket][1] % 16 == 0
            cases.append(pick(dtype, d, dv, deterministic=False, expect="bwd_simt", bucket=bucket,
                              roles=(DELTA, DKDV) if atomic else THREE, grads=[7] if atomic else [3],
                              props={"delta_head_dim": bucket}))
    for dtype in HALF_NAMES:
        cases += [pick(dtype, 64, expect="bwd_simt", roles=THREE),                  # alignment unknown
                  pick(dtype, 64, aligned=False, expect="bwd_simt", roles=THREE),   # rows not 16-byte aligned
                  pick(dtype, 64, 32, aligned=True, expect="bwd_simt"),             # dv != d
                  pick(dtype, 64, arch=75, aligned=True, expect="bwd_simt")]        # before sm_80
    cases += [pick(dtype, 64, arch=90, aligned=True, expect="bwd_simt") for dtype in ("float32", "float64")]
    return cases


def _bwd_mma():
    cases = []
    for dtype in HALF_NAMES:
        cases += [pick(dtype, 64, aligned=True, expect="bwd_mma", bucket=64, roles=THREE, grads=[3]),
                  # dV, then dK from 160 on; the delta kernel in the simt bucket (256)
                  pick(dtype, 200, arch=90, aligned=True, expect="bwd_mma", bucket=224,
                       roles=(DELTA, DKDV, DKDV, DQ), grads=[1, 2], props={"delta_head_dim": 256})]
    return cases


def _bwd_wgmma():
    cases = []
    for dtype in HALF_NAMES:
        for d in (40, 64, 100, 128, 192, 248, 256):
            bucket = _bucket(WGMMA_HEAD_DIMS, d)
            split = bucket > 128   # dV, then dK; a warpgroup's dQ slice would not be whole pages
            roles = (DELTA,) + (DKDV,) * (1 + split) + (DQ,)
            grads = [1, 2] if split else [3]
            cases += [pick(dtype, d, arch=90, aligned=True, options=WGMMA, expect="bwd_wgmma", bucket=bucket,
                           roles=roles, grads=grads),
                      pick(dtype, d, arch=90, aligned=True, options=WGMMA, deterministic=False, expect="bwd_wgmma",
                           bucket=bucket, roles=roles if split else (DELTA, DKDV), grads=grads if split else [7]),
                      pick(dtype, d, arch=90, aligned=True, expect="bwd_mma")]   # default: off
            cases += [pick(dtype, d, arch=arch, aligned=True, options=WGMMA, expect="bwd_mma")
                      for arch in (80, 86, 89, 100, 120)]
        cases += [pick(dtype, d, arch=90, aligned=True, options=WGMMA, expect="bwd_mma")
                  for d in (32, 96, 160, 200, 224)]   # bwd_mma's head dims between wgmma's
        cases += [pick(dtype, 64, arch=90, aligned=False, options=WGMMA, expect="bwd_simt"),
                  pick(dtype, 64, 48, arch=90, aligned=True, options=WGMMA, expect="bwd_simt")]
    return cases


def _bwd_dmma():
    cases = []
    for dtype in DMMA_DTYPES:
        for arch in (80, 86, 89, 90):
            for d in (1, 3, 32, 40, 64, 100, 128):
                for deterministic in (True, False):
                    for aligned in (True, False):
                        kw = dict(arch=arch, aligned=aligned, deterministic=deterministic, options=DMMA)
                        if arch in DMMA_ARCHS:   # no atomic variant: the dQ kernel either way
                            cases.append(pick(dtype, d, expect="bwd_dmma", bucket=_bucket(DMMA_HEAD_DIMS, d),
                                              roles=THREE, props={"dtype": dtype}, **kw))
                        else:
                            cases.append(pick(dtype, d, expect="bwd_simt", **kw))
                cases.append(pick(dtype, d, arch=arch, expect="bwd_simt"))   # default: off
        # not for dv != d, or head dims above 128
        cases += [pick(dtype, 64, 32, arch=90, options=DMMA, expect="bwd_simt"),
                  pick(dtype, 129, arch=90, options=DMMA, expect="bwd_simt")]
    cases += [pick(dtype, 64, arch=90, aligned=True, options=DMMA, expect="bwd_mma") for dtype in HALF_NAMES]
    return cases


def _bwd_tf32():
    cases = []
    for precision, passes in TF32_PASSES.items():
        for arch in (80, 86, 89, 90, 100):
            for d in (1, 3, 32, 40, 64, 100, 128):
                cases += [pick("float32", d, arch=arch, deterministic=deterministic, precision=precision,
                               options=DMMA, expect="bwd_tf32", bucket=_bucket(TF32_HEAD_DIMS, d), roles=THREE,
                               props={"passes": passes}) for deterministic in (True, False)]
                cases += [pick("float32", d, arch=arch, expect="bwd_simt"),                  # default: IEEE
                          pick("float32", d, arch=arch, precision="ieee", expect="bwd_simt")]
        cases += [pick("float32", 64, arch=75, precision=precision, expect="bwd_simt"),
                  pick("float32", 64, 32, arch=90, precision=precision, expect="bwd_simt"),
                  pick("float32", 129, arch=90, precision=precision, expect="bwd_simt")]
    return cases


# name: the representative calls of the family's dispatch rule (where it applies, and where
# it leaves the call to another family)
DISPATCH = {"fwd_simt": _fwd_simt(), "fwd_mma": _fwd_mma(), "fwd_wgmma": _fwd_wgmma(), "fwd_dmma": _fwd_dmma(),
            "fwd_tf32": _fwd_tf32(), "bwd_simt": _bwd_simt(), "bwd_mma": _bwd_mma(), "bwd_wgmma": _bwd_wgmma(),
            "bwd_dmma": _bwd_dmma(), "bwd_tf32": _bwd_tf32()}
DISPATCHED = FORWARD + BACKWARD


@pytest.mark.parametrize("family", DISPATCHED, ids=_ids(DISPATCHED))
def test_dispatch_picks_the_family_where_it_applies_and_leaves_other_calls(family):
    order = FORWARD if family.direction == "forward" else BACKWARD
    assert any(p.expect == family.name for p in DISPATCH[family.name])
    for p in DISPATCH[family.name]:
        where = (p.call, p.arch, p.options)
        plan = select(order, p.call, p.arch, p.options)
        main = plan
        if family.direction == "backward":   # bwd_simt's delta kernel first
            assert plan[0].family is BWD_SIMT and plan[0].role == DELTA, where
            main = plan[1:]
            if "delta_head_dim" in p.props:
                assert plan[0].head_dim == p.props["delta_head_dim"], where
        else:
            assert len(plan) == 1, where
        assert {r.family.name for r in main} == {p.expect}, where
        assert {r.dtype for r in plan} == {p.call.dtype}, where
        if p.bucket is not None:
            assert {(r.head_dim, r.head_dim_v) for r in main} == {(p.bucket, p.bucket)}, where
        if p.roles is not None:
            assert tuple(r.role for r in plan) == p.roles, where
        if p.grads is not None:
            assert tuple(r.grads for r in main if r.role == DKDV) == p.grads, where
        for prop, value in p.props.items():
            if prop != "delta_head_dim":
                assert {getattr(r, prop) for r in main} == {value}, (prop, where)
        for r in plan:   # a row of the catalogue that the arch compiles
            assert r in r.family.launchable(p.arch), (r, where)


@pytest.mark.parametrize("order", [FORWARD, BACKWARD], ids=["forward", "backward"])
def test_head_dims_above_the_largest_bucket_and_other_dtypes_are_refused(order):
    for dtype in DTYPE_NAMES:
        with pytest.raises(ValueError, match="256"):
            select(order, Call(dtype, 257, 1), 80, DEFAULT)
        with pytest.raises(ValueError, match="256"):
            select(order, Call(dtype, 1, 257), 80, DEFAULT)
    for dtype in HALF_NAMES:
        with pytest.raises(ValueError, match="256"):
            select(order, Call(dtype, 257, 257, aligned=True), 80, DEFAULT)
    with pytest.raises(TypeError, match="int32"):
        select(order, Call("int32", 8, 8), 80, DEFAULT)


def _picked(order, call, arch, environ):
    plan = select(order, call, arch, KernelOptions.from_environment(environ))
    return plan[0].family.name if order is FORWARD else plan[1].family.name


def test_opt_in_families_follow_the_environment():
    wgmma = Call("bfloat16", 128, 128, aligned=True, scale=0.125)
    for environ, forward, backward in (({}, "fwd_mma", "bwd_mma"), ({"CUPYFLASH_WGMMA": "1"}, "fwd_wgmma", "bwd_wgmma"),
                                       ({"CUPYFLASH_WGMMA": "0"}, "fwd_mma", "bwd_mma")):
        assert (_picked(FORWARD, wgmma, 90, environ), _picked(BACKWARD, wgmma, 90, environ)) == (forward, backward)
    # CUPYFLASH_DMMA: 1 (or float64) for float64, float32 for float32, both by list or "all"
    for value, on in (("1", {"float64"}), ("float64", {"float64"}), ("float32", {"float32"}),
                      ("float64, float32", {"float64", "float32"}), ("all", {"float64", "float32"}),
                      ("0", set()), ("", set())):
        environ = {"CUPYFLASH_DMMA": value}
        for order, name in ((FORWARD, "fwd_dmma"), (BACKWARD, "bwd_dmma")):
            assert {dtype for dtype in DMMA_DTYPES
                    if _picked(order, Call(dtype, 64, 64), 90, environ) == name} == on, (value, name)


# name: (dtype, the archs whose tiles to check, options) of the forward families with
# whole-KV rows (kWholeKV: K/V copies without bounds)
WHOLE_KV = {"fwd_mma": ("float16", (80, 86, 90), DEFAULT), "fwd_wgmma": ("bfloat16", (90,), WGMMA)}
WHOLE_KV_FAMILIES = [NAMES[n] for n in WHOLE_KV]


@pytest.mark.parametrize("family", WHOLE_KV_FAMILIES, ids=_ids(WHOLE_KV_FAMILIES))
def test_the_whole_kv_row_only_for_whole_key_blocks_at_the_bucket(family):
    # K/V copies without bounds need every key block whole and d = the bucket
    dtype, archs, options = WHOLE_KV[family.name]

    def row(d, arch, opts=options, **kw):
        (r,) = select(FORWARD, Call(dtype, d, d, aligned=True, **kw), arch, opts)
        return r

    for arch in archs:
        for d in sorted({r.head_dim for r in family.rows}):
            plain = row(d, arch)
            whole = row(d, arch, seqlen_k=3 * plain.block_n)
            assert plain.family is whole.family is family and not plain.whole_kv and whole.whole_kv
            assert whole.name_expression == plain.name_expression[:-1] + ", false, true>"
            assert (whole.block_m, whole.block_n, whole.threads, whole.kv_stages, whole.lazy_rescale) == \
                (plain.block_m, plain.block_n, plain.threads, plain.kv_stages, plain.lazy_rescale)
            for seqlen_k in (plain.block_n + 1, 3 * plain.block_n - 8, None):
                assert row(d, arch, seqlen_k=seqlen_k) == plain
            padded = row(d - 8, arch, seqlen_k=4096)            # the head dim below its bucket
            assert padded == row(d - 8, arch) and not padded.whole_kv
            split = row(d, arch, split=True, seqlen_k=4096)
            assert split.split and not split.whole_kv
            assert row(d, arch, options.replace(whole_blocks=False), seqlen_k=4096) == plain


# ---- static: NVRTC for sm_80, sm_86, sm_89, sm_90 ---------------------------------------------------

STATIC_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


@pytest.fixture(scope="module")
def report():
    # the whole catalogue, as tests/test_static_report.py compiles it: one compile per
    # entry and arch in a process (the report's cache), shared by both files on CI's
    # static-report worker (tests/conftest.py).  Each row on the archs that may launch
    # it: a tile class's rows are not compiled for the archs that never pick them
    # (fwd_mma's and bwd_mma's sm_80 rows on sm_86, the FP64 tensor-core rows there).
    return _report.kernel_report(STATIC_ARCHS, catalogue(), launchable=True)


@pytest.mark.parametrize("family", FAMILIES, ids=_ids(FAMILIES))
def test_every_row_compiles_without_spills_and_within_its_occupancy_target(report, family):
    rows = [r for r in report if r["family"] == family.name]
    assert {(r["arch"], r["target"], r["name"]) for r in rows} == {
        (a, family.compile_target(a), i.name_expression) for a in STATIC_ARCHS for i in family.rows
        if family.compile_target(a) is not None and i in family.launchable(int(a[3:]))}
    by_name = family.by_name
    for r in rows:
        where = (r["arch"], r["name"])
        assert not (r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]), where
        assert not (r["sass"].get("LDL") or r["sass"].get("STL")), where
        assert 0 < r["registers"] <= 255 and r["occupancy"] >= 1, where
        # the registers allow the CTAs per SM the kernel's __launch_bounds__ asks for
        row = by_name[r["name"]]
        blocks, _ = _report.occupancy(r["arch"], threads=row.threads, registers=r["registers"], shared_bytes=0)
        assert blocks >= family.min_ctas_per_sm(row), (where, r["registers"], blocks)


def _m_tiles(row, rows_per_tile, own=None):
    return (row.block_m if own is None else own) // (row.threads // 32) // rows_per_tile


def _sass_fwd_mma(row, sass):
    # Per key block a warp issues kMTiles * block_n/8 * d/16 mma for S and kMTiles * d/8 *
    # block_n/16 for O; ldmatrix.x4: kMTiles * d/16 (Q) + block_n/16 * d/16 (K) +
    # block_n/16 * d/16 (V).  Exactly these counts: one unrolled copy of the loop.
    m = _m_tiles(row, 16)
    assert sass.get("HMMA") == m * row.block_n // 8 * row.head_dim // 16 * 2
    assert sass.get("LDSM") == (m + 2 * row.block_n // 16) * row.head_dim // 16
    assert sass.get("LDGSTS", 0) > 0 and sass.get("SHFL", 0) > 0 and sass.get("MUFU", 0) > 0


def _sass_fwd_wgmma(row, sass):
    # Per key block a warpgroup issues d/16 wgmma for S = Q K^T and block_n/16 for O += P V;
    # the code holds them twice: the first block's S and the last block's P V are peeled
    # off the software-pipelined loop.
    assert sass.get("HGMMA") == 2 * (row.head_dim // 16 + row.block_n // 16)
    # not serialized by ptxas (C7514: a WARPGROUP.ARRIVE / DEPBAR pair around every HGMMA)
    assert sass.get("WARPGROUP", 0) < sass["HGMMA"] // 2
    assert not sass.get("HMMA") and not sass.get("LDSM")
    assert sass.get("LDGSTS", 0) > 0 and sass.get("MUFU", 0) > 0


def _sass_fwd_dmma(row, sass):
    # per key block a warp issues kMTiles x block_n/8 x d/4 DMMA for S and kMTiles x d/8 x
    # block_n/4 for O: exactly these counts, one copy of the loop
    m = _m_tiles(row, 8)
    assert sass.get("DMMA") == m * (row.block_n // 8 * row.head_dim // 4 + row.head_dim // 8 * row.block_n // 4)
    assert not sass.get("HMMA")
    if row.dtype == "float64":   # cp.async straight into the tiles
        assert sass.get("LDGSTS", 0) > 0
    else:                        # float32 widened on the way in
        assert sass.get("F2F", 0) > 0 and not sass.get("LDGSTS")


def _sass_fwd_tf32(row, sass):
    # per key block a warp issues passes x kMTiles x (block_n/8 x d/8) MMAs for S and as many
    # for O (k8 steps: d/8 for S, block_n/8 for O).  S = Q K^T unrolls two 16-column groups
    # per iteration (kUnrollQK), so its loop body holds the MMAs of min(d, 32) columns; O's
    # loop is unrolled whole.
    m = _m_tiles(row, 16)
    assert sass.get("HMMA") == row.passes * m * (row.block_n // 8) * (min(row.head_dim, 32) + row.head_dim) // 8
    assert not sass.get("DMMA")
    assert sass.get("LDGSTS", 0) > 0


def _sass_bwd_wgmma(row, sass):
    d = row.head_dim
    if row.role == DKDV:
        # S^T (d / 16), dV (streamed / 16); dP^T (d / 16), dK (streamed / 16); atomic dQ (own keys / 16)
        own, streamed, grads = row.block_n, row.block_m, row.grads
        expected = d // 16 + (streamed // 16 if grads & 1 else 0) + (d // 16 + streamed // 16 if grads & 2 else 0)
        if grads & 4:
            expected += own // 16
            if grads & 8:   # dq += by bulk reductions (cp.reduce.async.bulk), no atomics
                assert sass.get("UBLKRED", 0) > 0 and not any(k.startswith(("RED", "ATOM")) for k in sass)
            else:
                assert any(k.startswith(("RED", "ATOM")) for k in sass)   # dq += by atomics
    else:
        expected = 2 * d // 16 + row.block_n // 16   # S, dP (d / 16 each), dQ (streamed keys / 16)
    assert sass.get("HGMMA") == expected, (sass.get("HGMMA"), expected)
    # not serialized by ptxas (C7514: a WARPGROUP.ARRIVE / DEPBAR pair around every HGMMA)
    assert sass.get("WARPGROUP", 0) < expected // 2
    assert not sass.get("HMMA") and not sass.get("LDSM")
    assert sass.get("LDGSTS", 0) > 0 and sass.get("MUFU", 0) > 0


def _sass_bwd_dmma(row, sass):
    # Per streamed block a warp issues, for each of the two score products (S and dP),
    # m_tiles x streamed/8 DMMA per k4 step -- unrolled eight k4 steps deep -- and for each
    # gradient product (dV and dK, or dQ) m_tiles x d/8 per k4 step over the streamed rows,
    # fully unrolled.
    own, streamed = _own_streamed(row)
    m = _m_tiles(row, 8, own)
    scores = 2 * min(8, row.head_dim // 4) * m * (streamed // 8)
    gradients = (2 if row.role == DKDV else 1) * (streamed // 4) * (row.head_dim // 8) * m
    assert sass.get("DMMA") == scores + gradients
    assert sass.get("SHFL", 0) > 0
    if row.dtype == "float64":   # cp.async straight into the tiles
        assert sass.get("LDGSTS", 0) > 0
    else:                        # float32 widened on the way in
        assert sass.get("F2F", 0) > 0 and not sass.get("LDGSTS")
    assert not any(op.startswith(("HMMA", "LDSM", "ATOM", "RED")) for op in sass)


def _sass_bwd_tf32(row, sass):
    # Per streamed block a warp issues, for each of the two score products (S and dP),
    # passes x m_tiles x streamed/8 MMAs per k8 step -- unrolled four k8 steps (32 columns)
    # deep, two at d = 32 -- and for each gradient product (dV and dK, or dQ) passes x
    # m_tiles x d/8 per k8 step over the streamed rows, fully unrolled.
    own, streamed = _own_streamed(row)
    m = _m_tiles(row, 16, own)
    scores = 2 * row.passes * (4 if row.head_dim > 32 else 2) * m * (streamed // 8)
    gradients = (2 if row.role == DKDV else 1) * row.passes * (streamed // 8) * (row.head_dim // 8) * m
    assert sass.get("HMMA") == scores + gradients, (sass.get("HMMA"), scores + gradients)
    assert sass.get("LDGSTS", 0) > 0
    assert not any(op.startswith(("DMMA", "LDSM", "ATOM", "RED")) for op in sass)


# name: the SASS one unrolled copy of the family's main loop issues, per row (the SIMT,
# fwd_v1, fwd_combine and bwd_mma kernels: tests/test_static_report.py's intended opcodes)
SASS = {"fwd_mma": _sass_fwd_mma, "fwd_wgmma": _sass_fwd_wgmma, "fwd_dmma": _sass_fwd_dmma,
        "fwd_tf32": _sass_fwd_tf32, "bwd_wgmma": _sass_bwd_wgmma, "bwd_dmma": _sass_bwd_dmma,
        "bwd_tf32": _sass_bwd_tf32}
SASS_FAMILIES = [NAMES[n] for n in SASS]


@pytest.mark.parametrize("family", SASS_FAMILIES, ids=_ids(SASS_FAMILIES))
def test_sass_holds_one_unrolled_copy_of_the_main_loop(report, family):
    by_name = family.by_name
    for r in report:
        if r["family"] == family.name:
            try:
                SASS[family.name](by_name[r["name"]], r["sass"])
            except AssertionError as exc:
                raise AssertionError(f"{r['arch']}: {r['name']}: {exc}") from exc


# ---- emulated ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def executors():
    """One race-checking emulator per compute capability, threads in shuffled order."""
    return {arch: EmulatorExecutor(arch=arch, seed=2024 + arch, shuffle=True, race_check=True)
            for arch in (80, 86, 90)}


@dataclass(frozen=True)
class ForwardRun:
    """How the every-instantiation test runs a family's rows: (seqlen_q, seqlen_k, run-time
    head dim, head_dim_v, batch) and the seed from a row, the windows, the archs whose
    dispatch may pick it, the options and the precision."""

    shape: object
    seed: object
    windows: tuple
    archs: tuple = (80,)
    options: object = DEFAULT   # KernelOptions, or a function of the row
    precision: object = lambda row: "ieee"

    def options_for(self, row) -> KernelOptions:
        return self.options(row) if callable(self.options) else self.options


def _tails(row):
    # Two query blocks (the second partial), Lk > Lq: key blocks fully visible, cut by the
    # diagonal, skipped, and a partial last one
    return row.block_m + 21, row.block_m + 2 * row.block_n + 5, row.head_dim, row.head_dim, 1


def _mma_tails(row):
    # as _tails, with Lk = Lq + 2 key blocks + 5; a whole-KV row: Lk a multiple of block_n
    # (the dispatcher's condition for it)
    seqlen_q = row.block_m + 21
    seqlen_k = seqlen_q + 2 * row.block_n + 5
    if row.whole_kv:
        seqlen_k += -seqlen_k % row.block_n
    return seqlen_q, seqlen_k, row.head_dim, row.head_dim, 1


def _wgmma_tails(row):
    # a partial query block and a partial key block (three key blocks: a split-KV row runs
    # one per split, the causal case with some empty); a whole-KV row three whole key blocks
    seqlen_k = 3 * row.block_n if row.whole_kv else 2 * row.block_n + 21
    return row.block_m + 19, seqlen_k, row.head_dim, row.head_dim, 1


# fwd_simt: one (d, dv) per bucket, partial query and key blocks, several key blocks
_SIMT_DIMS = {32: (1, 1), 64: (19, 33), 128: (100, 7), 256: (129, 256)}
FULL, CAUSAL = (None, None), (None, 0)

FORWARD_RUNS = {
    "fwd_simt": ForwardRun(lambda r: (37, 45) + _SIMT_DIMS[r.head_dim] + (2,),
                           lambda r: _SIMT_DIMS[r.head_dim][0] * 1000 + _SIMT_DIMS[r.head_dim][1], (FULL,)),
    "fwd_mma": ForwardRun(_mma_tails, lambda r: r.head_dim * 7 + r.block_n, (CAUSAL,), archs=(80, 86, 90)),
    "fwd_wgmma": ForwardRun(_wgmma_tails, lambda r: r.head_dim, (FULL, CAUSAL), archs=(90,),
                            options=lambda r: WGMMA.replace(decoupled=r.decoupled)),
    "fwd_dmma": ForwardRun(_tails, lambda r: r.head_dim, (CAUSAL, FULL), options=DMMA),
    "fwd_tf32": ForwardRun(_tails, lambda r: r.head_dim, (CAUSAL, FULL),
                           precision=lambda r: next(p for p, n in TF32_PASSES.items() if n == r.passes)),
}


FORWARD_ROWS = [r for f in FORWARD for r in plain_call_rows(f)]


def _row_id(row):
    return "-".join([row.family.name] + [str(a).lower() for a in row.args])


@needs_emulator
@pytest.mark.parametrize("row", FORWARD_ROWS, ids=[_row_id(r) for r in FORWARD_ROWS])
def test_forward_every_instantiation_matches_oracle_with_tails(executors, row):
    # a split-KV row runs 3 splits (then fwd_combine)
    run = FORWARD_RUNS[row.family.name]
    seqlen_q, seqlen_k, d, dv, batch = run.shape(row)
    dtype = numpy_dtype(row.dtype)
    rng = np.random.default_rng(run.seed(row))
    q, k, v = qkv(rng, dtype, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=d, head_dim_v=dv)
    precision = run.precision(row)
    call = Call(row.dtype, d, dv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, aligned=_run.rows_aligned(q, k, v),
                scale=1 / math.sqrt(d), precision=precision, split=row.split)
    options = run.options_for(row)
    arch = next((a for a in run.archs if select(FORWARD, call, a, options) == (row,)), None)
    assert arch is not None, f"no arch of {run.archs} selects {row.name_expression}"
    splits = 3 if row.split else 1
    for window in run.windows:
        spy = LaunchSpy(executors[arch])
        if dtype.itemsize == 2:
            run_half_forward(spy, q, k, v, window=window, family=row.family.name, splits=splits, options=options)
        else:
            forward_against_oracle(spy, q, k, v, window=window, precision=precision,
                                   options=options.replace(splits=splits))
        assert spy.launched[0] == row.name_expression, spy.launched
        assert len(spy.launched) == 1 + (splits > 1), spy.launched


@dataclass(frozen=True)
class Masks:
    """A family's mask cases: dtype, head dim, arch, options, precisions, seed from the lengths,
    the (Lq, Lk) pairs and windows (id: (left, right)), and (backward) the deterministic modes."""

    dtype: str
    head_dim: int
    arch: int
    options: KernelOptions
    precisions: tuple
    seed: object
    lengths: dict
    windows: dict
    deterministic: tuple = (True,)


_W = {"causal": (None, 0), "full": (None, None), "w16-0": (16, 0), "w0-0": (0, 0), "w5-40": (5, 40),
      "wN-9": (None, 9), "w31-N": (31, None), "w0-N": (0, None), "w70-N": (70, None), "w130-N": (130, None)}


def _windows(*names):
    return {n: _W[n] for n in names}


_LONGER_K = {"lq>lk": (150, 100), "lq<lk": (70, 200)}
_SHORTER_K = {"lq>lk": (150, 100), "lq<lk": (70, 133)}
_SUM, _THRICE = (lambda lq, lk: lq + lk), (lambda lq, lk: lq * 3 + lk)
_EVERY_WINDOW = _windows("causal", "full", "w16-0", "w0-0", "w5-40", "wN-9", "w31-N", "w0-N")

FORWARD_MASKS = {
    "fwd_simt": Masks("float32", 16, 80, DEFAULT, ("ieee",), _SUM, _SHORTER_K, _EVERY_WINDOW),
    "fwd_mma": Masks("float16", 64, 80, DEFAULT, ("ieee",), _THRICE, _LONGER_K,
                     _windows("causal", "w16-0", "w0-0", "w5-40", "wN-9", "w70-N")),
    "fwd_wgmma": Masks("float16", 64, 90, WGMMA, ("ieee",), _THRICE, {"lq>lk": (150, 100), "lq<lk": (70, 300)},
                       _windows("causal", "w16-0", "w5-40", "w130-N")),
    "fwd_dmma": Masks("float64", 64, 80, DMMA, ("ieee",), _SUM, _LONGER_K,
                      _windows("causal", "w16-0", "w0-0", "w5-40", "w70-N")),
    "fwd_tf32": Masks("float32", 64, 80, DEFAULT, ("tf32x3",), _SUM, _LONGER_K,
                      _windows("causal", "w16-0", "w0-0", "w5-40", "w70-N")),
}


def _mask_cases(table):
    return [(name, precision, lengths, window) for name, m in table.items() for precision in m.precisions
            for lengths in m.lengths for window in m.windows]


def _mask_id(case):
    name, precision, lengths, window = case
    return "-".join([name] + ([precision] if len(table_of(name).precisions) > 1 else []) + [lengths, window])


def table_of(name):
    return FORWARD_MASKS.get(name) or BACKWARD_MASKS[name]


FORWARD_MASK_CASES = _mask_cases(FORWARD_MASKS)


@needs_emulator
@pytest.mark.parametrize("family, precision, lengths, window", FORWARD_MASK_CASES,
                         ids=[_mask_id(c) for c in FORWARD_MASK_CASES])
def test_forward_masks_match_oracle(executors, family, precision, lengths, window):
    m = FORWARD_MASKS[family]
    seqlen_q, seqlen_k = m.lengths[lengths]
    rng = np.random.default_rng(m.seed(seqlen_q, seqlen_k))
    dtype = numpy_dtype(m.dtype)
    q, k, v = qkv(rng, dtype, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=m.head_dim)
    spy = LaunchSpy(executors[m.arch])
    if dtype.itemsize == 2:
        run_half_forward(spy, q, k, v, window=m.windows[window], family=family, options=m.options)
    else:
        forward_against_oracle(spy, q, k, v, window=m.windows[window], precision=precision,
                               options=m.options.replace(splits=1))
    assert [n.split("<")[0] for n in spy.launched] == [f"cf::{family}_kernel"]


@dataclass(frozen=True)
class BackwardRun:
    """One backward problem of the every-instantiation test: dtype, (d, dv), (Lq, Lk), batch,
    kv heads, GQA ratio, window, arch, options, precision, seed, the head-dim bucket its
    rows must have, and whether deterministic=False (dQ by atomics where the family has
    it) must leave dK and dV bit for bit as they are."""

    dtype: str
    dims: tuple
    lengths: tuple
    window: tuple = FULL
    batch: int = 1
    heads_kv: int = 1
    gqa_ratio: int = 1
    arch: int = 80
    options: KernelOptions = DEFAULT
    precision: str = "ieee"
    seed: int = 0
    bucket: int | None = None
    atomic: bool = False

    @property
    def id(self):
        d, dv = self.dims
        return (f"{self.dtype}-d{d}{'' if dv == d else f'-dv{dv}'}{'-causal' if self.window == CAUSAL else ''}"
                f"{'' if self.precision == 'ieee' else '-' + self.precision}")


def _bwd_simt_runs():
    # several query and key blocks per bucket's tiles, partial ones in both axes
    return [BackwardRun(dtype, (d, dv), (37, 45), batch=2, seed=d * 1000 + dv) for dtype in DTYPE_NAMES
            for d, dv in ((1, 1), (32, 19), (33, 64), (100, 7), (256, 129))]


def _bwd_mma_runs():
    # one case per (dtype, head dim): run-time d below the bucket where it can be (zero-filled
    # columns), GQA, partial query and key blocks; causal on every other case
    return [BackwardRun(dtype, (d, d), (70, 83), CAUSAL if bucket % 64 else FULL, gqa_ratio=2, seed=bucket + d,
                        bucket=bucket)
            for dtype in HALF_NAMES for bucket, d in zip(MMA_HEAD_DIMS, (24, 64, 88, 128, 152, 192, 200, 256))]


def _bwd_wgmma_runs():
    # each bucket at its own size and padded below it; tails in both axes, two query heads
    # per kv head; the atomic dQ (up to 128) leaving dK and dV alone
    dims = ([(dtype, d) for dtype in HALF_NAMES for d in (64, 128, 192, 256)]
            + [(HALF_NAMES[0], 40), (HALF_NAMES[-1], 104), (HALF_NAMES[0], 248)])
    return [BackwardRun(dtype, (d, d), (150, 2 * 128 + 21), window, gqa_ratio=2, arch=90, options=WGMMA,
                        seed=d + 7 * (window == CAUSAL), atomic=_bucket(WGMMA_HEAD_DIMS, d) <= 128)
            for dtype, d in dims for window in (FULL, CAUSAL)]


def _bwd_dmma_runs():
    # partial query and key blocks in both kernels; Lk > Lq so that, causal, key blocks are
    # fully visible, cut by the diagonal and unseen; two query heads per kv head
    from cupyflash._families import BWD_DMMA

    return [BackwardRun(dtype, (d, d), (2 * BWD_DMMA.tiles[d][0] + 13, 3 * BWD_DMMA.tiles[d][0] + 5), window,
                        heads_kv=2, gqa_ratio=2, options=DMMA, seed=d + (window == CAUSAL), bucket=d)
            for dtype in DMMA_DTYPES for d in DMMA_HEAD_DIMS for window in (FULL, CAUSAL)]


def _bwd_tf32_runs():
    from cupyflash._families import BWD_TF32

    return [BackwardRun("float32", (d, d), (2 * BWD_TF32.tiles[d][0] + 13, 3 * BWD_TF32.tiles[d][0] + 5), window,
                        heads_kv=2, gqa_ratio=2, precision=precision, seed=d + (window == CAUSAL), bucket=d)
            for precision in TF32_PASSES for d in TF32_HEAD_DIMS for window in (FULL, CAUSAL)]


BACKWARD_RUNS = {"bwd_simt": _bwd_simt_runs(), "bwd_mma": _bwd_mma_runs(), "bwd_wgmma": _bwd_wgmma_runs(),
                 "bwd_dmma": _bwd_dmma_runs(), "bwd_tf32": _bwd_tf32_runs()}
BACKWARD_CASES = [(name, run) for name, runs in BACKWARD_RUNS.items() for run in runs]


@needs_emulator
@pytest.mark.parametrize("family, run", BACKWARD_CASES, ids=[f"{n}-{r.id}" for n, r in BACKWARD_CASES])
def test_backward_every_instantiation_matches_oracle(executors, family, run):
    rng = np.random.default_rng(run.seed)
    d, dv = run.dims
    q, k, v = qkv(rng, numpy_dtype(run.dtype), batch=run.batch, heads_kv=run.heads_kv, gqa_ratio=run.gqa_ratio,
                  seqlen_q=run.lengths[0], seqlen_k=run.lengths[1], head_dim=d, head_dim_v=dv)
    case = Case(rng, q, k, v, gqa_ratio=run.gqa_ratio, window=run.window, options=run.options,
                precision=run.precision)
    plan = case.plan(run.arch)
    assert {r.family.name for r in plan[1:]} == {family}
    if run.bucket is not None:
        assert {r.head_dim for r in plan[1:]} == {run.bucket}
    spy = LaunchSpy(executors[run.arch])
    exact = case.run(spy)
    case.check(exact)
    assert spy.launched == [r.name_expression for r in plan]
    if run.atomic:
        fast_plan = case.plan(run.arch, deterministic=False)
        assert [r.role for r in fast_plan] == [DELTA, DKDV] and fast_plan[1].atomic_dq
        fast = case.run(executors[run.arch], deterministic=False)   # dq poisoned: zeroed, then added to
        case.check(fast)
        assert np.array_equal(fast[1], exact[1]) and np.array_equal(fast[2], exact[2])
        if family == "bwd_wgmma":   # and dQ by bulk reductions (KernelOptions.async_dq)
            case.options = run.options.replace(async_dq=True)
            bulk_plan = case.plan(run.arch, deterministic=False)
            assert [r.role for r in bulk_plan] == [DELTA, DKDV] and bulk_plan[1].bulk_dq
            spy = LaunchSpy(executors[run.arch])
            bulk = case.run(spy, deterministic=False)
            assert spy.launched == [r.name_expression for r in bulk_plan]
            case.check(bulk)
            assert np.array_equal(bulk[1], exact[1]) and np.array_equal(bulk[2], exact[2])
            # deterministic too: the key blocks add in key-block order (the ordered dQ)
            ordered_plan = case.plan(run.arch, deterministic=True)
            assert {r.role for r in ordered_plan[1:]} == {DKDV} and ordered_plan[-1].ordered_dq
            spy = LaunchSpy(executors[run.arch])
            ordered = case.run(spy, deterministic=True)
            assert spy.launched == [r.name_expression for r in ordered_plan]
            case.check(ordered)
            assert np.array_equal(ordered[1], exact[1]) and np.array_equal(ordered[2], exact[2])


BACKWARD_MASKS = {
    "bwd_simt": Masks("float64", 16, 80, DEFAULT, ("ieee",), _SUM, _SHORTER_K, _EVERY_WINDOW),
    "bwd_mma": Masks("float16", 32, 80, DEFAULT, ("ieee",), _THRICE, _SHORTER_K,
                     _windows("causal", "w16-0", "w0-0", "w5-40", "w31-N")),
    "bwd_wgmma": Masks("float16", 64, 90, WGMMA, ("ieee",), _THRICE, {"lq>lk": (150, 100), "lq<lk": (70, 300)},
                       _windows("w16-0", "w0-0", "w5-40", "wN-9", "w130-N"), deterministic=(True, False)),
    "bwd_dmma": Masks("float64", 32, 80, DMMA, ("ieee",), _SUM, _SHORTER_K,
                      _windows("causal", "w16-0", "w0-0", "w5-40", "wN-9", "w31-N")),
    "bwd_tf32": Masks("float32", 32, 80, DEFAULT, ("tf32", "tf32x3"), _SUM, _SHORTER_K,
                      _windows("causal", "w16-0", "w5-40", "w31-N")),
}
BACKWARD_MASK_CASES = _mask_cases(BACKWARD_MASKS)


@needs_emulator
@pytest.mark.parametrize("family, precision, lengths, window", BACKWARD_MASK_CASES,
                         ids=[_mask_id(c) for c in BACKWARD_MASK_CASES])
def test_backward_masks_match_oracle(executors, family, precision, lengths, window):
    m = BACKWARD_MASKS[family]
    seqlen_q, seqlen_k = m.lengths[lengths]
    rng = np.random.default_rng(m.seed(seqlen_q, seqlen_k))
    q, k, v = qkv(rng, numpy_dtype(m.dtype), seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=m.head_dim)
    case = Case(rng, q, k, v, window=m.windows[window], options=m.options, precision=precision)
    for deterministic in m.deterministic:
        plan = case.plan(m.arch, deterministic)
        assert {r.family.name for r in plan[1:]} == {family}
        spy = LaunchSpy(executors[m.arch])
        case.check(case.run(spy, deterministic=deterministic))
        assert spy.launched == [r.name_expression for r in plan]


def test_every_family_has_its_row_in_each_table():
    # a family added to the registry without them would go untested here
    assert set(CATALOGUE) == {f.name for f in FAMILIES}
    assert set(DISPATCH) == {f.name for f in DISPATCHED}
    assert set(FORWARD_RUNS) == set(FORWARD_MASKS) == {f.name for f in FORWARD}
    assert set(BACKWARD_RUNS) == set(BACKWARD_MASKS) == {f.name for f in BACKWARD}
    assert set(LAUNCH) | set(SASS) <= {f.name for f in FAMILIES}
