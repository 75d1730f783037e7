"""The kernel families and dispatch: the first family of an ordered list that applies.

Each module of this package owns one family (one ``cuda_src/`` entry): its tile
table, its instantiations, its launch geometry and its rule
:meth:`~cupyflash._families._family.Family.applies`.  :data:`FORWARD` and
:data:`BACKWARD` list the families dispatch tries, in order; :func:`select`
returns the launch plan of the first that applies.  Adding a family is one
``.cu``, one module here and one entry in a list below.

Examples
--------
>>> from cupyflash._families import BACKWARD, FORWARD, Call, select
>>> from cupyflash._options import KernelOptions
>>> [f.name for f in FORWARD]
['fwd_wgmma', 'fwd_mma', 'fwd_tf32', 'fwd_dmma', 'fwd_simt']
>>> call = Call("float16", 64, 64, seqlen_q=1024, seqlen_k=1024, aligned=True, scale=0.125)
>>> [r.name_expression for r in select(FORWARD, call, 80, KernelOptions())]
['cf::fwd_mma_kernel<__half, 64, 128, 64, 4, 2, true, false, true>']
>>> [r.role for r in select(BACKWARD, call, 80, KernelOptions())]
['delta', 'dkdv', 'dq']
"""

from __future__ import annotations

import functools

from ._family import COMBINE, DELTA, DKDV, DQ, FEATURES, FORWARD as FORWARD_ROLE, Call, Family, Instantiation, Sizes
from .bwd_dmma import BWD_DMMA
from .bwd_mma import BWD_GRAD_DK, BWD_GRAD_DQ_ATOMIC, BWD_GRAD_DV, BWD_MMA
from .bwd_simt import BWD_SIMT
from .bwd_tf32 import BWD_TF32
from .bwd_wgmma import BWD_WGMMA
from .fwd_combine import FWD_COMBINE
from .fwd_dmma import FWD_DMMA
from .fwd_mma import FWD_MMA
from .fwd_simt import FWD_SIMT
from .fwd_tf32 import FWD_TF32
from .fwd_v1 import FWD_V1
from .fwd_wgmma import FWD_WGMMA

__all__ = ["Family", "Instantiation", "Call", "Sizes", "FORWARD", "BACKWARD", "FAMILIES", "FEATURES", "select",
           "taking",
           "catalogue", "by_name", "launchable", "family_named", "entry_family", "FORWARD_ROLE", "COMBINE",
           "DELTA", "DKDV", "DQ", "BWD_GRAD_DV", "BWD_GRAD_DK", "BWD_GRAD_DQ_ATOMIC",
           "FWD_SIMT", "FWD_V1", "FWD_COMBINE", "FWD_MMA", "FWD_WGMMA", "FWD_DMMA", "FWD_TF32",
           "BWD_SIMT", "BWD_MMA", "BWD_WGMMA", "BWD_DMMA", "BWD_TF32"]

# Dispatch order.  Forward: Hopper's wgmma where enabled, else mma.sync, for
# float16/bfloat16; TF32 where the caller allows it, then the FP64 tensor cores
# where enabled, for float32/float64; the CUDA cores for everything else.
FORWARD = (FWD_WGMMA, FWD_MMA, FWD_TF32, FWD_DMMA, FWD_SIMT)
BACKWARD = (BWD_TF32, BWD_DMMA, BWD_WGMMA, BWD_MMA, BWD_SIMT)
# Every family, in the catalogue's order (the static report's rows).
FAMILIES = (FWD_SIMT, FWD_V1, FWD_COMBINE, FWD_MMA, FWD_WGMMA, FWD_DMMA, FWD_TF32,
            BWD_SIMT, BWD_MMA, BWD_WGMMA, BWD_DMMA, BWD_TF32)


@functools.lru_cache(maxsize=4096)   # on every call: a decode step's host time matters
def select(families: tuple, call: Call, arch: int, options) -> tuple[Instantiation, ...]:
    """The launch plan of the first of ``families`` (after ``options``' replacements)
    that applies to ``call`` on compute capability ``arch``: its rows in launch order.

    Raises
    ------
    TypeError
        No kernels for the dtype.
    ValueError
        A head dim above the largest bucket.
    """
    for family in options.resolve(families):
        if call.features <= family.takes and family.applies(call, int(arch), options):
            return family.plan(call, int(arch), options)
    if call.features:
        raise NotImplementedError(f"no kernel family takes {', '.join(sorted(call.features))} yet")
    raise TypeError(f"no kernel family serves {call}")   # the SIMT families apply to every call


def taking(families: tuple, features) -> tuple[Family, ...]:
    """The ``families`` whose kernels take every one of ``features`` (what a call asking
    for them can be dispatched to; none of them may be picked for it otherwise).

    >>> from cupyflash._families import BACKWARD, FORWARD, taking
    >>> [f.name for f in taking(FORWARD, {"bias", "mask"})]
    ['fwd_wgmma', 'fwd_mma', 'fwd_tf32', 'fwd_dmma', 'fwd_simt']
    >>> [f.name for f in taking(BACKWARD, {"mask"})]
    ['bwd_tf32', 'bwd_dmma', 'bwd_wgmma', 'bwd_mma', 'bwd_simt']
    """
    return tuple(f for f in families if frozenset(features) <= f.takes)


def catalogue(families: tuple = FAMILIES) -> tuple[Instantiation, ...]:
    """Every instantiation of ``families``, family by family (what the static report and
    the emulator's tests enumerate)."""
    return tuple(r for f in families for r in f.rows)


@functools.lru_cache(maxsize=1)
def by_name() -> dict[str, Instantiation]:
    """The registry's catalogue keyed by name expression."""
    return {r.name_expression: r for r in catalogue()}


def launchable(arch: int, families: tuple = FAMILIES) -> tuple[Instantiation, ...]:
    """The rows some call may launch on compute capability ``arch`` (what
    :func:`cupyflash.precompile` compiles for a device)."""
    return tuple(dict.fromkeys(r for f in families for r in f.launchable(int(arch))))


def family_named(name: str) -> Family:
    """The registry's family called ``name``.

    Raises
    ------
    ValueError
        No such family (the message lists them).
    """
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown kernel family {name!r}; known: {[f.name for f in FAMILIES]}")


def entry_family(entry) -> Family:
    """The registry's family whose ``cuda_src/`` file is ``entry`` (a file name, or a
    :class:`cupyflash._source.Variant` of one)."""
    from .._source import entry_file

    entry = entry_file(entry)
    for f in FAMILIES:
        if f.entry == entry:
            return f
    raise ValueError(f"no kernel family is defined in {entry!r}")
