"""Property-based tests: the CPU path against the oracle over random problems.

Shapes (batch dims that broadcast, Lq/Lk 0..64, d/dv 1..40), dtypes, causal,
window, GQA and scale are drawn by hypothesis; the inputs themselves come from a
drawn seed.  Derandomized: the same examples on every run.  The small-block tests
draw float32 and float64 with key blocks of 1 to 9 keys, so that every example of
more than 9 keys crosses key blocks.  Budgets are bounded so the file runs in seconds.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _cpu
from cupyflash.reference import naive_attention, naive_attention_backward

from _strategies import batch_shapes
from _backward_util import assert_within_term_bound, backward_term_sizes
from _util import DTYPES, assert_close, assert_lse_close, random_array, random_qkv

# derandomize=True: the same examples on every run (a mutation caught on one seed in four
# is not caught); database=None: no .hypothesis/ directory in the working tree;
# deadline=None: timing varies on CI.
PROPERTY_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow])
SMALL_BLOCK_DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]

window_bound = st.one_of(st.none(), st.just(-1), st.integers(0, 70))


@st.composite
def problems(draw, *, dtypes=DTYPES):
    """(q, k, v, options) for one attention call."""
    dtype = draw(st.sampled_from(dtypes))
    lq, lk = draw(st.integers(0, 64)), draw(st.integers(0, 64))
    d, dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    q_batch, k_batch, v_batch, enable_gqa = draw(batch_shapes(max_dims=3, max_side=3, max_group=3))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(window_bound, window_bound)))
    # Logits stay O(1), where TOLERANCE applies; large logits have their own tests.
    factor = draw(st.one_of(st.none(), st.floats(-1.5, 1.5, allow_nan=False)))
    scale = None if factor is None else factor / np.sqrt(d)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, q_batch + (lq, d), k_batch + (lk, d), v_batch + (lk, dv), dtype)
    return q, k, v, dict(causal=causal, window=window, enable_gqa=enable_gqa, scale=scale)


def _check_forward(q, k, v, kw):
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    expected, expected_lse = naive_attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype
    assert_close(out, expected, q.dtype)
    assert_lse_close(lse, expected_lse, q.dtype)


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(problems())
def test_cpu_path_matches_oracle(problem):
    q, k, v, kw = problem
    _check_forward(q, k, v, kw)


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(problems(dtypes=SMALL_BLOCK_DTYPES), st.integers(1, 9), st.integers(1, 40))
def test_cpu_path_with_small_blocks_matches_oracle(problem, key_block, score_elements):
    # Small block sizes push even tiny problems through tails and every block kind,
    # across key blocks (Lk up to 64 is up to 64 blocks).
    q, k, v, kw = problem
    with mock.patch.object(_cpu, "_MAX_KEY_BLOCK", key_block), \
            mock.patch.object(_cpu, "_SCORE_BLOCK_ELEMENTS", score_elements):
        _check_forward(q, k, v, kw)


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(problems(dtypes=SMALL_BLOCK_DTYPES), st.integers(1, 9), st.integers(1, 40))
def test_backward_matches_naive_backward(problem, key_block, score_elements):
    q, k, v, kw = problem
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    dout = random_array(np.random.default_rng(out.size), out.shape, q.dtype)
    with mock.patch.object(_cpu, "_MAX_KEY_BLOCK", key_block), \
            mock.patch.object(_cpu, "_SCORE_BLOCK_ELEMENTS", score_elements):
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)
    expected = naive_attention_backward(dout, q, k, v, **kw)
    # Relative to the terms each element sums: a row that sees one key has dq = 0
    # exactly, and float32 leaves the rounding of dP - delta there (docs/testing.md).
    # A scale below the dtype's subnormal spacing is rounded to it with an absolute error of up
    # to half that spacing: a relative error of spacing / (2 |scale|) in dq and dk.
    sizes = backward_term_sizes(dout, q, k, v, **kw)
    scale = 1 / np.sqrt(q.shape[-1]) if kw["scale"] is None else abs(kw["scale"])
    scale_rounding = min(1.0, np.finfo(q.dtype).smallest_subnormal / scale) if scale else 0.0
    for name, g, e, x, size in zip(("dq", "dk", "dv"), grads, expected, (q, k, v), sizes):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        floor = scale_rounding * size if name != "dv" else 0.0
        assert_within_term_bound(g, e, size, eps=np.finfo(q.dtype).eps, head_dim=q.shape[-1], floor=floor,
                                 what=name)


@settings(max_examples=100, **PROPERTY_SETTINGS)
@given(st.integers(0, 40), st.integers(1, 12), st.integers(0, 40), st.integers(1, 12),
       st.integers(-30, 30), st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.none(), st.integers(0, 20)))
def test_block_bounds_classifies_blocks_exactly(i0, rows, j0, cols, offset, left, right):
    kind = _cpu.block_bounds(i0, i0 + rows, j0, j0 + cols, offset, left, right)
    i = np.arange(i0, i0 + rows)[:, None]
    j = np.arange(j0, j0 + cols)[None, :]
    ok = np.ones((rows, cols), dtype=bool)
    if left is not None:
        ok &= j >= i + offset - left
    if right is not None:
        ok &= j <= i + offset + right
    expected = "empty" if not ok.any() else "full" if ok.all() else "partial"
    assert kind == expected
