"""Helpers of the framework-adapter tests (tests/test_torch_adapter.py, tests/test_jax_adapter.py)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

# the cases the adapters are checked on: keywords and (q, k, v) shapes, small enough
# for float64 finite differences; GQA with 4 query heads on 2 kv heads, Lq != Lk with
# a causal mask (aligned bottom-right), dv != d with a window
CASES = {
    "full": (dict(), ((2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4))),
    "causal": (dict(causal=True), ((1, 2, 7, 4), (1, 2, 7, 4), (1, 2, 7, 4))),
    "window": (dict(window=(2, 1)), ((1, 2, 7, 4), (1, 2, 7, 4), (1, 2, 7, 3))),
    "gqa": (dict(enable_gqa=True), ((1, 4, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4))),
    "lq_ne_lk": (dict(causal=True, scale=0.7), ((1, 2, 4, 4), (1, 2, 9, 4), (1, 2, 9, 4))),
}


def require(module: str):
    """``module``, imported; the test module is skipped where it is not installed,
    except on CI (``CI=true``), which installs it: there its absence is an error."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def allowed(seqlen_q: int, seqlen_k: int, *, causal=False, window=None) -> np.ndarray:
    """The ``(Lq, Lk)`` boolean mask (True = may attend) of cupyflash's ``causal`` and
    ``window``: diagonals aligned to the bottom-right corner, -1/None unbounded."""
    i = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = np.arange(seqlen_k)[None, :]
    left, right = window if window is not None else (None, None)
    left = None if left == -1 else left
    right = None if right == -1 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left is not None:
        mask &= j >= i - left
    if right is not None:
        mask &= j <= i + right
    return mask


def spy_on_library(monkeypatch, adapter) -> dict:
    """Wrap ``adapter``'s references to the library's forward and backward so that each
    call's keywords land in the returned dict, under "forward" and "backward"."""
    calls = {}

    def spy(name, function):
        def call(*arrays, **keywords):
            calls[name] = keywords
            return function(*arrays, **keywords)
        return call

    monkeypatch.setattr(adapter, "_attention", spy("forward", adapter._attention))
    monkeypatch.setattr(adapter, "_attention_backward", spy("backward", adapter._attention_backward))
    return calls
