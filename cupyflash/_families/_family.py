"""What a kernel family is: its instantiations, its launch geometry, when it applies.

A :class:`Family` owns one ``cuda_src/`` entry file and everything Python
knows about it -- the tile table, the typed template arguments of each
instantiation, the shared-memory formula that mirrors the kernels'
``kSmemBytes`` (``tests/test_shared_bytes.py`` compiles the C++ side for
every row and compares), the grid, and the rule :meth:`Family.applies` that
says whether it serves a :class:`Call`.  Dispatch
(:func:`cupyflash._families.select`) takes the first family of an ordered
list that applies; nothing outside a family module compares family names.

An :class:`Instantiation` carries its template arguments as Python values
(:attr:`Instantiation.args`); its name expression (what NVRTC and the
emulator are asked for) is built from them and never parsed back.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

from .._dtypes import CXX_TYPE
from .._mods import FEATURES as MOD_FEATURES

__all__ = ["Instantiation", "Family", "Call", "Sizes", "FEATURES", "MAX_GRID_X", "MAX_SPLITS", "FORWARD", "COMBINE",
           "DELTA", "DKDV", "DQ"]

# What a kernel of a family computes (Instantiation.role).
FORWARD, COMBINE, DELTA, DKDV, DQ = "forward", "combine", "delta", "dkdv", "dq"
MAX_GRID_X = 2**31 - 1
# Most splits of one query block's keys (split-KV; cupyflash._launch.num_splits).
MAX_SPLITS = 64


def _cxx(arg) -> str:
    if isinstance(arg, bool):
        return "true" if arg else "false"
    if isinstance(arg, str):
        return CXX_TYPE[arg]
    return str(int(arg))


@dataclass(frozen=True)
class Instantiation:
    """One template instantiation of a family's kernel: a row of the catalogue.

    ``args`` are the C++ template arguments in order: dtype names (rendered as
    their C++ types), ints and bools.  Every other field is a property the
    launch, the report and the tests read; ``block_m`` / ``block_n`` are the
    query rows / keys a CTA takes (a dK/dV kernel owns ``block_n`` keys and
    streams ``block_m`` query rows, a dQ kernel the reverse).
    """

    family: "Family" = field(repr=False)
    kernel: str            # template name without "cf::", e.g. "fwd_mma_kernel"
    args: tuple            # template arguments
    role: str              # FORWARD, COMBINE, DELTA, DKDV or DQ
    dtype: str             # "float16", "bfloat16", "float32", "float64"
    head_dim: int          # compile-time (maximum) head dim of q/k
    head_dim_v: int        # compile-time (maximum) head dim of v/out
    threads: int           # threads per block
    block_m: int = 0       # query rows per CTA (0: chosen at run time, fwd_v1)
    block_n: int = 0       # keys per CTA / key block (0: chosen at run time)
    kv_stages: int = 0     # buffers of the streamed tiles (family-specific)
    lazy_rescale: bool = False  # rescale the output only when a row max moves far
    split: bool = False    # the split-KV instantiation
    whole_kv: bool = False  # streamed copies without bounds (whole blocks, d == bucket)
    passes: int = 0        # TF32 MMAs per product (1: "tf32", 3: "tf32x3")
    grads: int = 0         # dK/dV kernels: which gradients (BWD_GRAD_* bits)
    decoupled: bool = False  # warp-specialised: a producer warpgroup copies, mbarriers (fwd_wgmma)
    name_expression: str = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "name_expression",
                           f"cf::{self.kernel}<{', '.join(_cxx(a) for a in self.args)}>")

    @property
    def entry(self) -> str:
        """The file in ``cuda_src/`` that defines the kernel."""
        return self.family.entry

    @property
    def atomic_dq(self) -> bool:
        """A dK/dV kernel that also adds dQ by float atomics."""
        return bool(self.grads & 4)

    @property
    def bulk_dq(self) -> bool:
        """A dK/dV kernel that adds dQ by bulk asynchronous reductions (bwd_wgmma)."""
        return bool(self.grads & 8)

    @property
    def ordered_dq(self) -> bool:
        """A bulk-dQ dK/dV kernel whose key blocks add in key-block order (bwd_wgmma,
        ``deterministic=True``): it takes ``BwdParams::dq_turns``."""
        return bool(self.grads & 16)

    def __repr__(self) -> str:
        return f"Instantiation({self.name_expression!r})"


@dataclass(frozen=True)
class Call:
    """What dispatch knows of one kernel call (per launch group of a problem).

    ``aligned``: every row of q, k, v and out (dout) starts on a 16-byte
    boundary; ``dq_aligned``: every row of dq on an 8-byte one (atomic dQ adds
    float pairs); ``dq_aligned_16``: on a 16-byte one (bulk reductions of dQ rows).  ``seqlen_q`` / ``seqlen_k`` None: unknown (never the
    whole-block instantiations).  ``split``: the split-KV instantiation.
    ``paged``: K and V come from a paged KV cache (``cuda_src/paged.cuh``; the
    forward only), ``aligned`` then covering every page's rows.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    seqlen_q: int | None = None
    seqlen_k: int | None = None
    aligned: bool = False
    dq_aligned: bool = True
    dq_aligned_16: bool = False
    scale: float = 1.0
    precision: str = "ieee"
    deterministic: bool = True
    split: bool = False
    # The score features the call asks for beyond the window (DESIGN 3b): "bias",
    # "mask", ...; a family serves the call only if it takes every one of them.
    features: frozenset = frozenset()
    paged: bool = False


# The score features the API knows; a family lists those its kernels take in
# Family.takes: every forward and backward family all of them (score.cuh's
# score_epilogue, probability_epilogue and gradient_epilogue), fwd_v1 none.
FEATURES = ("bias", "mask") + MOD_FEATURES


@dataclass(frozen=True)
class Sizes:
    """The run-time sizes a launch's grid and shared memory depend on."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int = 0
    head_dim_v: int = 0
    sram_size: int | None = None   # fwd_v1: Algorithm 1's M, in elements
    num_splits: int = 1


class Family:
    """A kernel family: one ``cuda_src/`` entry and its instantiations.

    Subclasses set :attr:`name`, :attr:`entry`, :attr:`direction` and
    :attr:`tiles` (the tile table, replaced by :meth:`with_tiles`), and
    implement :meth:`build_rows`, :meth:`applies`, :meth:`plan` and
    :meth:`shared_bytes`.  Families compare by identity: a family with other
    tiles is another family with the same name.
    """

    name: str = ""
    entry: str = ""
    direction: str = "forward"       # "forward" or "backward"
    tiles: dict = {}
    # Per head dim, the tile (in the format of the family's tiles) a call with score
    # features takes where the usual one spills with them: :meth:`tile`.
    feature_tiles: dict = {}
    # Compile targets other than the arch itself: {"sm_90": "sm_90a"}; an entry
    # listed here has no kernels for the archs not listed.
    arch_specific: dict | None = None
    split_kv: bool = False           # takes FwdParams::num_splits > 1
    # The score features (Call.features, FEATURES) its kernels take: select() skips the
    # family for a call asking for any other, so no family ever ignores one.
    takes: frozenset = frozenset()

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    # ---- the catalogue -------------------------------------------------------------------

    def build_rows(self) -> list[Instantiation]:
        """Every instantiation of the family, in a stable order (subclasses)."""
        raise NotImplementedError

    @functools.cached_property
    def rows(self) -> tuple[Instantiation, ...]:
        """:meth:`build_rows`, built once per family object, without duplicates."""
        return tuple(dict.fromkeys(self.build_rows()))

    @functools.cached_property
    def by_name(self) -> dict[str, Instantiation]:
        return {r.name_expression: r for r in self.rows}

    def tile(self, head_dim: int, features: bool = False):
        """``tiles[head_dim]`` -- for a call with score ``features``, its :attr:`feature_tiles`
        entry where there is one (families whose tiles map head dims to tiles)."""
        return self.feature_tiles.get(head_dim, self.tiles[head_dim]) if features else self.tiles[head_dim]

    def row(self, kernel: str, *args, **props) -> Instantiation:
        """An :class:`Instantiation` of this family (``props``: its other fields)."""
        return Instantiation(self, kernel, tuple(args), **props)

    def launchable(self, arch: int) -> tuple[Instantiation, ...]:
        """The rows some call may launch on compute capability ``arch`` (default: every row
        where the entry has a compile target)."""
        return self.rows if self.compile_target(f"sm_{int(arch)}") is not None else ()

    def compile_target(self, arch: str) -> str | None:
        """The NVRTC target the entry is built for on ``arch`` (``"sm_90"``): the arch itself,
        its architecture-specific target, or None where the entry has no kernels for it."""
        return arch if self.arch_specific is None else self.arch_specific.get(arch)

    def with_tiles(self, **tables) -> "Family":
        """A copy of the family with other tile tables (attribute name -> table), e.g.
        ``FWD_MMA.with_tiles(tiles={...})``: for tile sweeps, handed to dispatch through
        :class:`~cupyflash._options.KernelOptions`."""
        other = copy.copy(self)
        for attr in dir(type(self)):   # drop what was built from the old tables
            if isinstance(getattr(type(self), attr, None), functools.cached_property):
                other.__dict__.pop(attr, None)
        for attr, table in tables.items():
            if not hasattr(self, attr):
                raise AttributeError(f"{self.name} has no table {attr!r}")
            setattr(other, attr, table)
        return other

    # ---- dispatch ------------------------------------------------------------------------

    def applies(self, call: Call, arch: int, options) -> bool:
        """Whether this family serves ``call`` on ``arch`` under ``options``."""
        raise NotImplementedError

    def plan(self, call: Call, arch: int, options) -> tuple[Instantiation, ...]:
        """The rows to launch for ``call``, in launch order (where :meth:`applies`)."""
        raise NotImplementedError

    # ---- launch geometry -----------------------------------------------------------------

    def shared_bytes(self, row: Instantiation, sizes: Sizes | None = None) -> int:
        """Dynamic shared memory of one launch of ``row`` (bytes): the kernel's ``kSmemBytes``."""
        raise NotImplementedError

    def ctas(self, row: Instantiation, sizes: Sizes) -> int:
        """CTAs of one launch of ``row`` (the grid's x extent): one per block of rows -- query
        rows for forward, delta and dQ kernels, keys for dK/dV kernels."""
        if row.role == DKDV:
            heads, rows, block = sizes.heads_kv, sizes.seqlen_k, row.block_n
        else:
            heads, rows, block = sizes.heads_q, sizes.seqlen_q, row.block_m
        return -(-rows // block) * heads * sizes.batch

    def min_ctas_per_sm(self, row: Instantiation) -> int:
        """The kernel's own occupancy target (its ``__launch_bounds__`` minimum)."""
        return 1

    def launch_config(self, row: Instantiation, sizes: Sizes):
        """Grid, block and dynamic shared memory (bytes) for one launch of ``row``.

        Raises
        ------
        ValueError
            Nothing to launch, or more CTAs than a one-dimensional grid allows.
        """
        if row.role == DKDV:
            heads, rows = sizes.heads_kv, sizes.seqlen_k
        else:
            heads, rows = sizes.heads_q, sizes.seqlen_q
        if sizes.batch < 1 or heads < 1 or rows < 1:
            raise ValueError(f"{row.kernel}: nothing to launch: batch={sizes.batch}, heads={heads}, "
                             f"seqlen_q={sizes.seqlen_q}, seqlen_k={sizes.seqlen_k}")
        if sizes.num_splits != 1 and not (self.split_kv and 1 <= sizes.num_splits <= MAX_SPLITS):
            raise ValueError(f"{self.name}: num_splits={sizes.num_splits} (1 to {MAX_SPLITS}, and only for "
                             f"families that split keys)")
        ctas = self.ctas(row, sizes)
        if ctas > MAX_GRID_X:
            raise ValueError(
                f"{self.name}: batch={sizes.batch}, heads={heads}, seqlen_q={sizes.seqlen_q}, "
                f"seqlen_k={sizes.seqlen_k} needs {ctas} CTAs; a launch allows at most {MAX_GRID_X}")
        return (ctas, sizes.num_splits, 1), (row.threads, 1, 1), self.shared_bytes(row, sizes)

    def representative_shared_bytes(self, row: Instantiation) -> int:
        """Dynamic shared memory of ``row`` for the static report (a fixed-size kernel's own)."""
        return self.shared_bytes(row, None)


def smallest_fit(sizes, value: int) -> int | None:
    """The smallest of ``sizes`` that is at least ``value`` (None: none)."""
    fits = [s for s in sizes if s >= value]
    return min(fits) if fits else None
