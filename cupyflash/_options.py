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

__all__ = ["KernelOptions", "WGMMA_ENV", "DMMA_ENV"]

# The wgmma kernels (fwd_wgmma, bwd_wgmma) have not run on a GPU yet: they are
# opt-in until the GPU tier has checked them.
WGMMA_ENV = "CUPYFLASH_WGMMA"
# fwd_dmma and bwd_dmma (the FP64 tensor cores) have not run on a GPU yet: opt-in
# until the GPU tier has checked them and the benchmark has timed them against the
# SIMT kernels.  CUPYFLASH_DMMA=1 (or float64) turns them on for float64; float32
# (or "float64,float32", or all) runs float32 on them too (computed in double).
DMMA_ENV = "CUPYFLASH_DMMA"

_TRUE = {"1", "true", "yes", "on"}


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

    def __post_init__(self):
        object.__setattr__(self, "dmma", frozenset(self.dmma))
        object.__setattr__(self, "families", tuple(self.families))
        unknown = self.dmma - {"float64", "float32"}
        if unknown:
            raise ValueError(f"`dmma`: dtype names float64 and float32 only, got {sorted(unknown)}")
        if self.splits is not None and int(self.splits) < 1:
            raise ValueError(f"`splits` must be None or at least 1, got {self.splits}")

    @classmethod
    def from_environment(cls, environ=None) -> "KernelOptions":
        """The options ``CUPYFLASH_WGMMA`` and ``CUPYFLASH_DMMA`` ask for (read now)."""
        env = os.environ if environ is None else environ
        wgmma = env.get(WGMMA_ENV, "").strip().lower() in _TRUE
        words = {w.strip() for w in env.get(DMMA_ENV, "").lower().split(",")}
        dmma = set()
        if words & (_TRUE | {"float64", "all"}):
            dmma.add("float64")
        if words & {"float32", "all"}:
            dmma.add("float32")
        return cls(wgmma=wgmma, dmma=frozenset(dmma))

    def replace(self, **changes) -> "KernelOptions":
        """A copy with ``changes`` (as :func:`dataclasses.replace`)."""
        return replace(self, **changes)

    def resolve(self, families: tuple) -> tuple:
        """``families`` with each one that :attr:`families` replaces (by name) replaced."""
        if not self.families:
            return families
        by_name = {f.name: f for f in self.families}
        return tuple(by_name.get(f.name, f) for f in families)
