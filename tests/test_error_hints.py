"""Errors that point at the fix: GQA shapes without enable_gqa, PyTorch tensors, integer arrays."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash


def test_gqa_head_counts_without_enable_gqa_suggest_it():
    q = np.ones((3, 12, 8, 4), np.float32)
    kv = np.ones((3, 4, 8, 4), np.float32)
    with pytest.raises(ValueError, match=r"q \(3, 12\), k \(3, 4\).*pass enable_gqa=True"):
        cupyflash.attention(q, kv, kv)
    # head counts that are not a GQA grouping get no such hint
    with pytest.raises(ValueError, match="do not broadcast") as info:
        cupyflash.attention(np.ones((3, 10, 8, 4), np.float32), kv, kv)
    assert "enable_gqa" not in str(info.value)


def test_a_torch_tensor_gets_the_numpy_conversion_hint():
    torch = pytest.importorskip("torch")
    kv = np.ones((2, 8, 4), np.float32)
    with pytest.raises(TypeError, match=r"`q` must be a NumPy or CuPy array.*pass q\.numpy\(\)"):
        cupyflash.attention(torch.ones(2, 8, 4), kv, kv)


def test_an_integer_array_gets_an_astype_hint():
    kv = np.ones((2, 8, 4), np.float32)
    with pytest.raises(TypeError, match=r"got int64; convert it first, e\.g\. q\.astype"):
        cupyflash.attention(np.ones((2, 8, 4), np.int64), kv, kv)
