"""What the framework adapters (:mod:`cupyflash.torch`, :mod:`cupyflash.jax`) share.

The adapters forward a fixed set of keywords to :func:`cupyflash.attention` and
:func:`cupyflash.attention_backward` (:data:`FORWARDED`); a library keyword they do not
take, or any other keyword, is a ``TypeError``.  A keyword added to the library (bias,
lengths, score functions, ...) joins :data:`FORWARDED` when an adapter learns to pass it
and to return its gradient; until then it lands in :data:`NOT_FORWARDED` or is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validation import check_forward, check_precision

# keyword -> the library function(s) it goes to
FORWARDED = {
    "scale": "both", "causal": "both", "window": "both", "enable_gqa": "both",
    "precision": "both", "backend": "both", "deterministic": "backward",
}

# library keywords an adapter does not take, and why
NOT_FORWARDED = {
    "return_lse": "the adapters return the output only; its lse is kept for the backward",
    "out": "the adapters allocate their outputs (the framework owns the memory)",
}


def reject_keywords(function: str, keywords: dict) -> None:
    """TypeError for any keyword of an adapter call outside its signature."""
    for name in keywords:
        if name in NOT_FORWARDED:
            raise TypeError(f"{function}() does not take `{name}`: {NOT_FORWARDED[name]}")
        raise TypeError(
            f"{function}() got an unexpected keyword argument {name!r}; "
            f"it takes {', '.join(FORWARDED)}"
        )


@dataclass(frozen=True)
class Options:
    """Checked, hashable options of one adapter call.

    The fields are the keywords of the library's functions; from
    :func:`check_call`, ``scale`` is resolved (``1/sqrt(d)`` for ``None``)
    and ``window`` is ``None`` or ``(left, right)`` with ``-1`` for an
    unbounded side.
    """

    scale: float | None
    causal: bool
    window: tuple[int, int] | None
    enable_gqa: bool
    precision: str
    deterministic: bool
    backend: str

    def forward_keywords(self) -> dict:
        return dict(scale=self.scale, causal=self.causal, window=self.window,
                    enable_gqa=self.enable_gqa, precision=self.precision, backend=self.backend)

    def backward_keywords(self) -> dict:
        return dict(self.forward_keywords(), deterministic=self.deterministic)


def _placeholder(shape, dtype) -> np.ndarray:
    """A read-only array of ``shape`` that owns one element (all strides 0)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=tuple(shape),
                                           strides=(0,) * len(shape), writeable=False)


def check_call(shapes, dtypes, *, scale, causal, window, enable_gqa, precision,
               deterministic, backend, check_backend):
    """Check an adapter call on the shapes and (NumPy) dtypes of q, k and v alone, as
    the library checks NumPy arrays of them with ``check_backend`` ('numpy' or
    'emulator'); nothing is computed.

    Returns the library's checked problem (its ``out_shape``, ``lse_shape`` and
    ``accum_dtype`` describe the results) and the call's :class:`Options` (with
    ``backend``, the user's).
    """
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"`deterministic` must be a bool, got {type(deterministic).__name__}")
    placeholders = [_placeholder(s, d) for s, d in zip(shapes, dtypes)]
    problem, _ = check_forward(*placeholders, scale=scale, causal=causal, window=window,
                               enable_gqa=enable_gqa, backend=check_backend)
    check_precision(precision, problem.dtype)
    if window is not None:
        window = tuple(-1 if w is None else int(w) for w in window)
    options = Options(scale=problem.scale, causal=bool(causal), window=window,
                      enable_gqa=bool(enable_gqa), precision=precision,
                      deterministic=bool(deterministic), backend=backend)
    return problem, options
