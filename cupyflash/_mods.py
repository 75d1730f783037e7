"""Score modifications: ``softcap``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` and their
``mod_args``, checked once per call (``cupyflash._validation.check_score_functions``) and
applied to the CPU path's score blocks (:meth:`ScoreFunctions.transform`, :meth:`ScoreFunctions.admits`).

DESIGN.md section 3b's order, for a block of scaled scores ``s``:

1. ``softcap``: ``s = softcap * tanh(s / softcap)``;
2. the bias terms, then ALiBi: ``s -= slope * |i + kv_len - q_len - j|``;
3. ``score_mod``: ``s = score_mod(s, b, h, q_idx, kv_idx)``;
4. the masks, ``mask_mod`` among them (``mask_mod(b, h, q_idx, kv_idx)`` True = may attend).

The backward needs two factors of the chain rule: ``d score_mod / d s`` at step 3's input
(the bias gradient is dS times it) and ``1 - tanh^2`` of step 1 (dq and dk take that too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _expr

__all__ = ["ScoreFunctions", "FEATURES"]

# The dispatch features (cupyflash._families.Call.features) these ask of a kernel family.
FEATURES = ("softcap", "alibi", "score_mod", "mask_mod")


@dataclass(frozen=True)
class ScoreFunctions:
    """A call's checked score modifications (None / empty where not given)."""

    softcap: float | None = None
    alibi_slopes: object = None           # float array broadcastable to the output's batch shape
    score_mod: _expr.Node | None = None
    mask_mod: _expr.Node | None = None
    mod_args: dict = field(default_factory=dict)
    score_mod_grad: _expr.Node | None = None   # d score_mod / d score (None: identically 0)
    texts: tuple = ("", "")                     # the expressions as given (score_mod, mask_mod)

    @property
    def features(self) -> frozenset:
        on = (self.softcap is not None, self.alibi_slopes is not None, self.score_mod is not None,
              self.mask_mod is not None)
        return frozenset(n for n, o in zip(FEATURES, on) if o)

    def __bool__(self) -> bool:
        return bool(self.features)

    def coordinates(self, batch_shape: tuple, xp=np) -> tuple:
        """``(b, h, slopes)`` as arrays of ``xp`` that broadcast to ``batch_shape``: the
        flat batch index over the dims before the head axis (C order) and the query head
        (int64), and the ALiBi slopes as given (None without them)."""
        if batch_shape:
            seq = tuple(batch_shape[:-1])
            b = xp.arange(int(np.prod(seq)), dtype=np.int64).reshape(seq + (1,))
            h = xp.arange(batch_shape[-1], dtype=np.int64)
        else:
            b = h = xp.zeros((), dtype=np.int64)
        return b, h, self.alibi_slopes

    # ---- the CPU path's blocks ---------------------------------------------------------------

    def transform(self, s, coords, rows, keys, offset, bias_terms=(), grad=False):
        """Steps 1-3 on the score block ``s`` (in place; ``s`` of the accumulator type):
        ``coords`` the block's ``(b, h, slopes)`` views, ``rows`` / ``keys`` its query
        and key indices (arrays that broadcast as ``(..., i, 1)`` / ``(..., 1, j)``),
        ``offset`` = kv_len - q_len, ``bias_terms`` the bias blocks (added after the
        softcap).  With ``grad``, returns ``(d_cap, d_mod)``: the factors dS takes
        through the softcap and through score_mod (None: 1)."""
        acc_t = s.dtype
        d_cap = d_mod = None
        if self.softcap is not None:
            c = acc_t.type(self.softcap)
            t = np.tanh(s / c)
            np.multiply(t, c, out=s)
            if grad:
                d_cap = 1 - t * t
        for b in bias_terms:
            s += b.astype(acc_t, copy=False)
        b_idx, h_idx, slopes = coords
        if slopes is not None:
            s -= slopes.astype(acc_t, copy=False) * np.abs(rows + offset - keys).astype(acc_t)
        if self.score_mod is not None:
            env = {"score": s, "b": b_idx, "h": h_idx, "q_idx": rows, "kv_idx": keys}
            if grad and self.score_mod_grad is not None:
                d_mod = np.broadcast_to(_expr.evaluate(self.score_mod_grad, env, self.mod_args, acc_t), s.shape)
            elif grad:
                d_mod = np.zeros(s.shape, acc_t)
            s[...] = _expr.evaluate(self.score_mod, env, self.mod_args, acc_t)
        return d_cap, d_mod

    def admits(self, coords, rows, keys, acc_t):
        """mask_mod on the block (None without one): bool, True = may attend; its float
        arithmetic in the accumulator type ``acc_t``, as the kernels do it."""
        if self.mask_mod is None:
            return None
        b_idx, h_idx, _ = coords
        env = {"b": b_idx, "h": h_idx, "q_idx": rows, "kv_idx": keys}
        return _expr.evaluate(self.mask_mod, env, self.mod_args, acc_t)
