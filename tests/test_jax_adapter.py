"""cupyflash.jax: custom_vjp attention under grad, jit and vmap.

Exactness is checked in float64 (x64 enabled per test, restored after) against a
plain ``jax.numpy`` softmax attention with cupyflash's bottom-right masks: both are
float64 computations with errors of a few ulps times the reduction lengths here
(<= 9), about 1e-15, so the 1e-10 of the issue leaves a wide margin while a wrong
mask, scale or gradient is O(1e-2) off.  ``jax.nn.dot_product_attention`` computes
its softmax in float32 even for float64 inputs (errors about 1e-7 on these O(1)
values), so it is checked to 1e-6.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from _adapter_util import CASES, allowed, require, spy_on_library
from _util import TOLERANCE, bfloat16

jax = require("jax")
import cupyflash.jax as cfj  # noqa: E402
import jax.numpy as jnp  # noqa: E402

F64 = dict(rtol=0, atol=1e-10)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def x64():
    """float64 arrays in JAX for the test (the flag is restored afterwards)."""
    with jax.enable_x64(True):
        yield


def _inputs(shapes, dtype="float64", seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple(jax.random.normal(key, s, dtype=dtype) for key, s in zip(keys, shapes))


def _reference(q, k, v, *, scale=None, causal=False, window=None, enable_gqa=False):
    """Softmax attention the obvious way in jax.numpy, with cupyflash's masks."""
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ jnp.swapaxes(k, -1, -2)
    s = jnp.where(allowed(q.shape[-2], k.shape[-2], causal=causal, window=window), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


def _loss(attend, **keywords):
    def loss(q, k, v, w):
        return jnp.sum(w * attend(q, k, v, **keywords))
    return loss


def _assert_all_close(actual, expected, **tolerance):
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tolerance)


@pytest.mark.parametrize("case", list(CASES))
def test_grad_and_jit_grad_match_float64_reference(case, x64):
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes, seed=1)
    out = cfj.attention(q, k, v, **keywords)
    w = jax.random.normal(jax.random.key(2), out.shape, dtype=out.dtype)   # upstream gradient
    # the reference is jitted: op by op, its gradient takes seconds to dispatch
    _assert_all_close([out], [jax.jit(functools.partial(_reference, **keywords))(q, k, v)], **F64)
    expected = jax.jit(jax.grad(_loss(_reference, **keywords), argnums=(0, 1, 2)))(q, k, v, w)
    grad = jax.grad(_loss(cfj.attention, **keywords), argnums=(0, 1, 2))
    _assert_all_close(grad(q, k, v, w), expected, **F64)
    _assert_all_close(jax.jit(grad)(q, k, v, w), expected, **F64)


def test_vmap_of_forward_and_grad_with_an_unbatched_argument(x64):
    # k is shared by the batch (in_axes None): each example's dk is its own, not summed
    q, k, v = _inputs(((3, 2, 5, 4), (2, 6, 4), (3, 2, 6, 4)), seed=3)
    w = jax.random.normal(jax.random.key(4), (3, 2, 5, 4))
    attend = jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True), in_axes=(0, None, 0))
    expected = jax.vmap(lambda q, k, v: _reference(q, k, v, causal=True), in_axes=(0, None, 0))
    _assert_all_close([jax.jit(attend)(q, k, v)], [jax.jit(expected)(q, k, v)], **F64)
    per_example = (0, None, 0, 0)
    grads = jax.vmap(jax.grad(_loss(cfj.attention, causal=True), argnums=(0, 1, 2)),
                     in_axes=per_example)(q, k, v, w)
    ref = jax.jit(jax.vmap(jax.grad(_loss(_reference, causal=True), argnums=(0, 1, 2)),
                           in_axes=per_example))(q, k, v, w)
    assert grads[1].shape == (3, 2, 6, 4)
    _assert_all_close(grads, ref, **F64)


@pytest.mark.parametrize("case", ["full", "causal", "gqa"])
def test_matches_jax_dot_product_attention_where_semantics_overlap(case, x64):
    # Lq == Lk in these cases: JAX's top-left causal mask is then cupyflash's bottom-right one
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes, seed=5)

    def theirs(q, k, v, causal=False, enable_gqa=False):
        blhd = [jnp.swapaxes(x, -2, -3) for x in (q, k, v)]    # (B, L, H, d)
        out = jax.nn.dot_product_attention(*blhd, is_causal=causal, implementation="xla")
        return jnp.swapaxes(out, -2, -3)

    w = jax.random.normal(jax.random.key(6), shapes[0][:-1] + (shapes[2][-1],))
    _assert_all_close([cfj.attention(q, k, v, **keywords)], [theirs(q, k, v, **keywords)],
                      rtol=0, atol=1e-6)
    _assert_all_close(jax.grad(_loss(cfj.attention, **keywords), argnums=(0, 1, 2))(q, k, v, w),
                      jax.jit(jax.grad(_loss(theirs, **keywords), argnums=(0, 1, 2)))(q, k, v, w),
                      rtol=0, atol=1e-6)


def test_causal_is_bottom_right_where_jax_is_top_left(x64):
    q, k, v = _inputs(((1, 4, 2, 4), (1, 9, 2, 4), (1, 9, 2, 4)), seed=7)     # (B, L, H, d)
    ours = jnp.swapaxes(cfj.attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), causal=True), 1, 2)
    top_left = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    bottom_right = jax.nn.dot_product_attention(q, k, v, mask=allowed(4, 9, causal=True),
                                                implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(bottom_right), rtol=0, atol=1e-6)
    assert np.abs(np.asarray(ours) - np.asarray(top_left)).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["float32", "bfloat16"])
def test_float32_and_bfloat16_are_the_library_bit_for_bit(dtype):
    if dtype == "bfloat16" and bfloat16 is None:
        pytest.skip("ml_dtypes is not installed")
    q, k, v = _inputs(((2, 5, 8), (2, 7, 8), (2, 7, 8)), dtype=dtype, seed=8)
    out, vjp = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, window=(3, 0)), q, k, v)
    dout = jax.random.normal(jax.random.key(9), out.shape, dtype=out.dtype)
    arrays = [np.asarray(x) for x in (q, k, v)]
    ref, lse = cupyflash.attention(*arrays, window=(3, 0), return_lse=True)
    expected = cupyflash.attention_backward(np.asarray(dout), *arrays, ref, lse, window=(3, 0))
    assert out.dtype == dtype
    for got, want in zip((out, *vjp(dout)), (ref, *expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    # and the library is the oracle's, to its tolerance
    from cupyflash.reference import naive_attention

    np.testing.assert_allclose(np.asarray(out, dtype=np.float64),
                               naive_attention(*arrays, window=(3, 0)),
                               **TOLERANCE[np.dtype(out.dtype)])


def test_every_keyword_reaches_the_library(monkeypatch):
    calls = spy_on_library(monkeypatch, cfj)
    q, k, v = _inputs(CASES["gqa"][1], dtype="float32")
    jax.grad(lambda q: jnp.sum(cfj.attention(
        q, k, v, scale=0.5, causal=True, window=(None, 2), enable_gqa=True, precision="tf32x3",
        deterministic=False, backend="numpy")))(q)
    expected = dict(scale=0.5, causal=True, window=(-1, 2), enable_gqa=True,
                    precision="tf32x3", backend="numpy")
    assert calls["forward"] == dict(expected, return_lse=True)
    assert calls["backward"] == dict(expected, deterministic=False)


@pytest.mark.parametrize("call, error, match", [
    (lambda q: cfj.attention([[1.0]], q, q), TypeError, "`q` must be a JAX array"),
    (lambda q: cfj.attention(q, q.astype("float16"), q), TypeError, "same dtype"),
    (lambda q: cfj.attention(q, q, q, return_lse=True), TypeError, "does not take `return_lse`"),
    (lambda q: cfj.attention(q, q, q, bias=q), TypeError, "unexpected keyword argument 'bias'"),
    (lambda q: cfj.attention(q, q, q, backend="cuda"), TypeError, "computes on the host"),
    (lambda q: cfj.attention(q, q, q, backend="gpu"), ValueError, "`backend` must be one of"),
    (lambda q: cfj.attention(q, q, q, deterministic=None), TypeError, "`deterministic` must be a bool"),
    (lambda q: cfj.attention(*[q.astype("float16")] * 3, precision="tf32x3"), ValueError,
     "float32 inputs only"),
    (lambda q: jax.jit(cfj.attention)(q, q[..., :3], q), ValueError, r"same head dim.*\(2, 6, 3\)"),
    (lambda q: cfj.attention(q[0], q[0], q[0], enable_gqa=True), ValueError, "needs a head axis"),
    (lambda q: cfj.attention(q, q, q, window=(0, -2)), ValueError, "`window` right bound"),
])
def test_bad_input_is_rejected_when_traced(call, error, match, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the library was called")

    monkeypatch.setattr(cfj, "_attention", fail)
    q = jax.random.normal(jax.random.key(0), (2, 6, 4))
    with pytest.raises(error, match=match):
        call(q)


def test_import_without_jax_names_the_extra():
    result = subprocess.run(
        [sys.executable, "-c", 'import sys; sys.modules["jax"] = None\nimport cupyflash.jax'],
        capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert result.returncode != 0
    assert 'ImportError: cupyflash.jax needs JAX; install it with: pip install "cupyflash[jax]"' \
        in result.stderr, result.stderr


# ---- GPU tier: arrays on a GPU go through the host callback ---------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "gqa", "lq_ne_lk"])
def test_gpu_arrays_grad_and_vmap_match_float64_reference(case, x64):
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    keywords, shapes = CASES[case]
    q, k, v = jax.device_put(_inputs(shapes, seed=10), device)
    w = jax.device_put(jax.random.normal(jax.random.key(11), shapes[0][:-1] + (shapes[2][-1],)),
                       device)
    grad = jax.jit(jax.grad(_loss(cfj.attention, **keywords), argnums=(0, 1, 2)))
    result = grad(q, k, v, w)
    assert all(g.devices() == {device} for g in result)
    _assert_all_close(result, jax.jit(jax.grad(_loss(_reference, **keywords), argnums=(0, 1, 2)))(q, k, v, w),
                      **F64)
    batched = jax.vmap(lambda q: cfj.attention(q, k, v, **keywords))(jnp.stack([q, 2 * q]))
    _assert_all_close([batched[1]], [_reference(2 * q, k, v, **keywords)], **F64)
