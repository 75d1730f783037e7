"""Score terms for the kernels: a call's additive biases and bool mask as the
kernels read them.

A kernel module reads the terms it was compiled for (``cuda_src/score.cuh``'s
``ScoreTerms<kMask, Bias...>``, named by the macro ``CF_SCORE_TERMS``): the
mask or not, and one C++ element type per bias term.  :class:`ScoreOperands`
holds one launch's terms as ``(B, Hq, Lq, Lk)`` views of the caller's arrays
(stride 0 along broadcast axes: nothing is copied) and names the module
variant (:class:`cupyflash._source.Variant`) and the dispatch features
(:attr:`cupyflash._families.Call.features`) they need.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._dtypes import CXX_TYPE, dtype_name
from ._source import Variant

__all__ = ["ScoreOperands", "TILE_STRIDE_LIMIT", "tile_strides", "check_tile_strides"]

# The kernels address a term's elements within a score tile in 32 bits
# (score.cuh's TermTile): |row stride| + |key stride| must stay below this, in
# elements -- a dense (Lq, Lk) term up to Lk = 2^23 - 1 keys.
TILE_STRIDE_LIMIT = 1 << 23


def tile_strides(a) -> tuple[int, int]:
    """The (query, key) strides in elements, 0 along length-1 axes, with which the
    kernels read ``a`` broadcast to the scores' shape."""
    shape, strides = (1, 1) + tuple(a.shape), (0, 0) + tuple(a.strides)
    return tuple(0 if n == 1 else s // a.itemsize for n, s in zip(shape[-2:], strides[-2:]))


def check_tile_strides(name: str, terms) -> None:
    """NotImplementedError naming ``name`` where a term's strides are past what the
    kernels address (:data:`TILE_STRIDE_LIMIT`) -- before any work."""
    for t, a in enumerate(terms):
        rows, keys = tile_strides(a)
        contiguous_rows = a.shape[-1] if a.ndim >= 2 and a.shape[-2] > 1 else 0    # its gradient's
        if abs(rows) + abs(keys) >= TILE_STRIDE_LIMIT or contiguous_rows + 1 >= TILE_STRIDE_LIMIT:
            what = f"`{name}`" + (f" term {t}" if len(terms) > 1 else "")
            raise NotImplementedError(
                f"{what}: the CUDA kernels read bias and mask terms whose query and key strides sum below "
                f"{TILE_STRIDE_LIMIT} elements; this one's are {rows} and {keys} (shape {tuple(a.shape)}). "
                f"Pass a C-contiguous copy (query stride Lk) if Lk is below that, else backend='numpy'")


@dataclass(frozen=True)
class ScoreOperands:
    """One launch's score terms: ``bias`` a tuple of 4-D views (any of the four float
    dtypes each), ``mask`` a 4-D bool view or None; and the score modifications: ``mods``
    (cupyflash._mods.ScoreFunctions or None), ``coords`` the ``(B, Hq)`` views of the flat
    batch index, the head and the ALiBi slope (float64) of the launch's (batch, head)
    pairs, ``mod_args`` the mod_args arrays in order."""

    bias: tuple = ()
    mask: object = None
    mods: object = None
    coords: tuple = (None, None, None)
    mod_args: tuple = ()

    @property
    def features(self) -> frozenset:
        """What the call asks of a kernel family (``Family.takes`` must hold them)."""
        own = frozenset(n for n, on in (("bias", bool(self.bias)), ("mask", self.mask is not None)) if on)
        return own | (self.mods.features if self.mods else frozenset())

    def terms_type(self) -> str:
        """The C++ ``ScoreTerms`` type the module is compiled with."""
        types = ", ".join(CXX_TYPE[dtype_name(b.dtype)] for b in self.bias)
        return f"cf::ScoreTerms<{'true' if self.mask is not None else 'false'}{', ' if types else ''}{types}>"

    def defines(self) -> tuple:
        """The module's macro definitions (score.cuh reads them)."""
        out = [("CF_SCORE_TERMS", self.terms_type())]
        m = self.mods
        if m:
            from ._expr import constant, cuda

            arrays = dict(m.mod_args)
            out += [("CF_SOFTCAP", "1" if m.softcap is not None else "0"),
                    ("CF_ALIBI", "1" if m.alibi_slopes is not None else "0")]
            if m.score_mod is not None:
                out.append(("CF_SCORE_MOD(Acc, ctx, score, b, h, q_idx, kv_idx)", cuda(m.score_mod, arrays)))
                grad = "static_cast<Acc>(0)" if m.score_mod_grad is None else cuda(m.score_mod_grad, arrays)
                out.append(("CF_SCORE_MOD_GRAD(Acc, ctx, score, b, h, q_idx, kv_idx)", grad))
                if constant(m.score_mod_grad):   # no factor per element (score.cuh's ChainRule)
                    out.append(("CF_SCORE_MOD_GRAD_CONST", "1"))
            if m.mask_mod is not None:
                out.append(("CF_MASK_MOD(Acc, ctx, b, h, q_idx, kv_idx)", cuda(m.mask_mod, arrays)))
        return tuple(out)

    def entry(self, entry):
        """``entry`` compiled with these terms (``entry`` itself without any)."""
        if not self.bias and self.mask is None and not self.mods:
            return entry
        return Variant(entry, self.defines())
