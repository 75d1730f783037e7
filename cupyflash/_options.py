"""What steers kernel dispatch beyond the arguments of a call: one frozen value.

:class:`KernelOptions` holds the switches that used to be module globals: the
opt-in kernels (wgmma on sm_90, the FP64 tensor cores), a forced split-KV
count, whether the whole-block instantiations may run, and families with
other tiles (a tile sweep's ``family.with_tiles(...)``).  The public functions
read it from the environment once per call (:meth:`KernelOptions.from_environment`);
tests and benchmarks pass one explicitly (``cupyflash._api.run_attention(...,
options=...)``).  Nothing about dispatch is mutable at module level.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

__all__ = ["KernelOptions", "WGMMA_ENV", "DMMA_ENV", "ASYNC_DQ_ENV", "DECOUPLED_ENV"]

# The wgmma kernels (fwd_wgmma, bwd_wgmma) have not run on a GPU yet: they are
# opt-in until the GPU tier has checked them.
WGMMA_ENV = "CUPYFLASH_WGMMA"
# fwd_dmma and bwd_dmma (the FP64 tensor cores) have not run on a GPU yet: opt-in
# until the GPU tier has checked them and the benchmark has timed them against the
# SIMT kernels.  CUPYFLASH_DMMA=1 (or float64) turns them on for float64; float32
# (or "float64,float32", or all) runs float32 on them too (computed in double).
DMMA_ENV = "CUPYFLASH_DMMA"
# bwd_wgmma's asynchronous dQ (bulk reductions from shared memory in place of
# every thread's atomics, deterministic=False; deterministic, the same in key-block
# order in place of the dQ kernel): opt-in until a GPU has timed it against the
# atomics and the dQ kernel (benchmarks/gpu_first_contact.py's table).
ASYNC_DQ_ENV = "CUPYFLASH_ASYNC_DQ"
# fwd_wgmma's warp-specialised form (a producer warpgroup, per-stage mbarriers,
# the consumer warpgroups' turns by named barriers): opt-in until a GPU has timed
# it against the coupled kernel (benchmarks/gpu_first_contact.py's table).
DECOUPLED_ENV = "CUPYFLASH_DECOUPLED"

_TRUE = {"1", "true", "yes", "on"}
# KernelOptions.timing -> the macro of cuda_src/fwd_wgmma.cu (and, "no-copy" only,
# cuda_src/bwd_wgmma.cu) that builds it
TIMING_BUILDS = {"no-exp": "CF_TIMING_NO_EXP", "no-copy": "CF_TIMING_NO_COPY",
                 "before-fixes": "CF_TIMING_BEFORE_FIXES"}
# the timing-only builds the backward has
BACKWARD_TIMING_BUILDS = ("no-copy",)


@dataclass(frozen=True)
class KernelOptions:
    """Dispatch switches for one call.

    Parameters
    ----------
    wgmma : bool, default False
        The wgmma kernels may replace their mma.sync counterparts on sm_90.
    dmma : frozenset of str, default empty
        dtype names (``"float64"``, ``"float32"``) that may run on the FP64 tensor cores
        of :data:`~cupyflash._arch.DMMA_ARCHS`.
    splits : int or None, default None
        Force the forward's split-KV count (None: the heuristic,
        :func:`cupyflash._launch.num_splits`).
    whole_blocks : bool, default True
        Whether the whole-block instantiations (copies without bounds) may run
        where they apply; False times the bounds-checked copies.
    families : tuple of Family, default ()
        Replacements for the registry's families of the same name (tile sweeps).
    async_dq : bool, default False
        bwd_wgmma adds dQ (``deterministic=False``) by bulk asynchronous reductions
        from shared memory, where dq's rows start 16-byte aligned; with
        ``deterministic=True`` and no score features, by the same reductions in
        key-block order (the key blocks take turns per query block: ordered dQ),
        in place of the dQ kernel.
    decoupled : bool, default False
        fwd_wgmma runs its warp-specialised instantiations where they exist (d = 64 and
        128, no split-KV, no score features, no paged cache): a producer warpgroup
        copies K and V, the two consumer warpgroups take turns on the tensor cores.
        bwd_wgmma likewise runs its warp-specialised dK/dV kernel (d = 64 and 128,
        deterministic, no score features): a producer warpgroup copies Q, dO and the
        statistics of each query block.
    timing : str or None, default None
        A timing-only build of the forward kernel (:data:`TIMING_BUILDS`: ``"no-exp"``
        without the softmax, ``"no-copy"`` without the K/V copies after the first two
        blocks; ``"before-fixes"`` the loop as it was before issue 32's schedule fixes,
        with correct outputs; fwd_wgmma reads them) or, ``"no-copy"`` only, of the backward's
        (bwd_wgmma: no streamed-tile copies after the first two blocks): its outputs
        are meaningless.  For ``benchmarks/gpu_first_contact.py``'s table only.

    Examples
    --------
    >>> from cupyflash._options import KernelOptions
    >>> KernelOptions.from_environment({"CUPYFLASH_DMMA": "float64,float32"}).dmma == {"float64", "float32"}
    True
    >>> KernelOptions().replace(wgmma=True).wgmma
    True
    """

    wgmma: bool = False
    dmma: frozenset = field(default_factory=frozenset)
    splits: int | None = None
    whole_blocks: bool = True
    families: tuple = ()
    async_dq: bool = False
    decoupled: bool = False
    timing: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "dmma", frozenset(self.dmma))
        object.__setattr__(self, "families", tuple(self.families))
        unknown = self.dmma - {"float64", "float32"}
        if unknown:
            raise ValueError(f"`dmma`: dtype names float64 and float32 only, got {sorted(unknown)}")
        if self.splits is not None and int(self.splits) < 1:
            raise ValueError(f"`splits` must be None or at least 1, got {self.splits}")
        if self.timing is not None and self.timing not in TIMING_BUILDS:
            raise ValueError(f"`timing`: None or one of {sorted(TIMING_BUILDS)}, got {self.timing!r}")

    @property
    def timing_defines(self) -> tuple:
        """The macro definitions of the forward kernel's module for :attr:`timing`."""
        return () if self.timing is None else ((TIMING_BUILDS[self.timing], "1"),)

    @classmethod
    def from_environment(cls, environ=None) -> "KernelOptions":
        """The options ``CUPYFLASH_WGMMA``, ``CUPYFLASH_DMMA``, ``CUPYFLASH_ASYNC_DQ`` and
        ``CUPYFLASH_DECOUPLED`` ask for (read now)."""
        env = os.environ if environ is None else environ
        wgmma = env.get(WGMMA_ENV, "").strip().lower() in _TRUE
        async_dq = env.get(ASYNC_DQ_ENV, "").strip().lower() in _TRUE
        decoupled = env.get(DECOUPLED_ENV, "").strip().lower() in _TRUE
        words = {w.strip() for w in env.get(DMMA_ENV, "").lower().split(",")}
        dmma = set()
        if words & (_TRUE | {"float64", "all"}):
            dmma.add("float64")
        if words & {"float32", "all"}:
            dmma.add("float32")
        return cls(wgmma=wgmma, dmma=frozenset(dmma), async_dq=async_dq, decoupled=decoupled)

    def replace(self, **changes) -> "KernelOptions":
        """A copy with ``changes`` (as :func:`dataclasses.replace`)."""
        return replace(self, **changes)

    def resolve(self, families: tuple) -> tuple:
        """``families`` with each one that :attr:`families` replaces (by name) replaced."""
        if not self.families:
            return families
        by_name = {f.name: f for f in self.families}
        return tuple(by_name.get(f.name, f) for f in families)
