"""``softcap=``, ``alibi_slopes=``, ``score_mod=``, ``mask_mod=`` and ``mod_args=`` on the
NumPy path: against the float64 oracle, where each expression is paired with a NumPy
function of the same meaning written here by hand (so the parser's own NumPy code is not
its own judge); the derived gradients against finite differences; the errors with their
caret; a fuzzer that throws token strings at the parser.

Error rules: docs/testing.md, "Tolerances" (the table for outputs, ``assert_grad_close``
for gradients); float64 inputs, so that the rules are tight.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import _expr
from cupyflash.reference import _probabilities, naive_attention, naive_attention_backward

from _util import (HALF_FORWARD_FACTOR, HALF_UNIT_ROUNDOFF, assert_close, assert_grad_close, assert_lse_close,
                   random_array)

B, H, LQ, LK, D = 2, 4, 19, 27, 8


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _inputs(key, lq=LQ, lk=LK, hkv=H, dtype=np.float64, d=D):
    rng = _rng(key)
    q = random_array(rng, (B, H, lq, d), dtype)
    k = random_array(rng, (B, hkv, lk, d), dtype)
    v = random_array(rng, (B, hkv, lk, d), dtype)
    dout = random_array(rng, (B, H, lq, d), dtype)
    return q, k, v, dout


def _check(key, *, api, oracle, lq=LQ, lk=LK, hkv=H, dtype=np.float64, **common):
    """cupyflash with ``api`` keywords against the oracle with ``oracle`` keywords (both
    with ``common``): out, lse and every gradient."""
    q, k, v, dout = _inputs(key, lq, lk, hkv, dtype)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **api, **common)
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **{n: x for n, x in oracle.items()
                                                                 if n != "score_mod_grad"}, **common)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **api, **common)
    expected = naive_attention_backward(dout, q, k, v, **oracle, **common)
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), grads, expected):
        assert_grad_close(g, e, dtype, what=name)
    return out, grads


# ---- softcap and ALiBi ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [5.0, 30.0, 50.0])
def test_softcap_matches_the_oracle_and_the_expression_written_by_hand(cap):
    # scores of order 10, so that even the cap of 50 bends them
    common = dict(scale=4.0, causal=True)
    out, grads = _check(f"cap{cap}", api=dict(softcap=cap), oracle=dict(softcap=cap), **common)
    q, k, v, dout = _inputs(f"cap{cap}")
    by_hand = f"{cap!r} * tanh(score / {cap!r})"
    out2, lse2 = cupyflash.attention(q, k, v, score_mod=by_hand, return_lse=True, **common)
    np.testing.assert_array_equal(out2, out)
    grads2 = cupyflash.attention_backward(dout, q, k, v, out2, lse2, score_mod=by_hand, **common)
    for a, b in zip(grads, grads2):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_softcap_comes_before_the_bias():
    bias = random_array(_rng("bias"), (H, LQ, LK), np.float64, 3.0)
    _check("cap-bias", api=dict(softcap=2.0, bias=bias), oracle=dict(softcap=2.0, bias=bias), scale=3.0)


@pytest.mark.parametrize("lq, lk", [(LQ, LK), (LK, LQ)], ids=["lq<lk", "lq>lk"])
def test_alibi_with_lq_ne_lk_causal_and_gqa(lq, lk):
    slopes = 2.0 ** -np.arange(1, H + 1)
    _check("alibi", api=dict(alibi_slopes=slopes), oracle=dict(alibi_slopes=slopes), lq=lq, lk=lk, hkv=2,
           causal=True, enable_gqa=True)


def test_alibi_aligns_to_each_sequences_lengths():
    slopes = np.array([[0.5], [0.25]])                         # (B, 1): per sequence too
    lens = dict(q_lengths=np.array([11, 19]), kv_lengths=np.array([27, 13]))
    _check("alibi-lengths", api=dict(alibi_slopes=slopes), oracle=dict(alibi_slopes=slopes), causal=True, **lens)


def test_alibi_slopes_in_float32_for_float32_inputs():
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    _check("alibi32", api=dict(alibi_slopes=slopes), oracle=dict(alibi_slopes=slopes), dtype=np.float32)


# ---- score_mod ------------------------------------------------------------------------------------

_REL = random_array(_rng("rel"), (H, LQ + LK - 1), np.float64)
_GAMMA = np.array([0.1, 0.3, 0.05, 0.7])
_TEMP = np.array([0.5, 2.0])
_T5 = random_array(_rng("t5"), (H, 16), np.float64)


def _t5_bucket(d):
    """T5's bucket of a distance: exact below 8, then logarithmic up to 128, 16 buckets."""
    d = np.abs(d)
    with np.errstate(divide="ignore"):
        far = 8 + np.floor(np.log(np.maximum(d, 1) / 8.0) / np.log(16.0) * 8).astype(np.int64)
    return np.where(d < 8, d, np.minimum(far, 15))


SCORE_MODS = {   # name: (expression, mod_args, NumPy function, its derivative)
    "relative-position table": (
        f"score + rel[h, q_idx - kv_idx + {LK - 1}]", {"rel": _REL},
        lambda s, b, h, i, j: s + _REL[h, i - j + LK - 1], lambda s, b, h, i, j: np.ones_like(s)),
    "T5 buckets": (
        "score + t5[h, where(abs(q_idx - kv_idx) < 8, abs(q_idx - kv_idx), "
        "min(8 + floor(log(max(abs(q_idx - kv_idx), 1) / 8.0) / log(16.0) * 8), 15))]", {"t5": _T5},
        lambda s, b, h, i, j: s + _T5[h, _t5_bucket(i - j)], lambda s, b, h, i, j: np.ones_like(s)),
    "distance kernel": (
        "score - gamma[h] * abs(q_idx - kv_idx)", {"gamma": _GAMMA},
        lambda s, b, h, i, j: s - _GAMMA[h] * np.abs(i - j), lambda s, b, h, i, j: np.ones_like(s)),
    "temperature per batch": (
        "score * temp[b]", {"temp": _TEMP},
        lambda s, b, h, i, j: s * _TEMP[b], lambda s, b, h, i, j: np.broadcast_to(_TEMP[b], s.shape)),
    "nonlinear": (
        "where(score > 0, sqrt(score + 1) - 1, 0.5 * sigmoid(score) - 0.25) + exp(-abs(score)) / 4", {},
        lambda s, b, h, i, j: np.where(s > 0, np.sqrt(np.maximum(s, 0) + 1) - 1, 0.5 / (1 + np.exp(-s)) - 0.25)
        + np.exp(-np.abs(s)) / 4,
        lambda s, b, h, i, j: np.where(s > 0, 0.5 / np.sqrt(np.maximum(s, 0) + 1),
                                       0.5 * np.exp(-s) / (1 + np.exp(-s)) ** 2)
        - np.sign(s) * np.exp(-np.abs(s)) / 4),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_matches_the_oracle(name):
    text, args, fn, grad = SCORE_MODS[name]
    _check(f"mod-{name}", api=dict(score_mod=text, mod_args=args), oracle=dict(score_mod=fn, score_mod_grad=grad),
           causal=True)


def test_score_mod_with_a_bias_sees_the_biased_scores_and_dbias_takes_its_derivative():
    bias = random_array(_rng("mod-bias"), (B, 1, 1, LK), np.float64)
    _check("mod-bias", api=dict(score_mod="score * score / 4", bias=bias),
           oracle=dict(score_mod=lambda s, *_: s * s / 4, score_mod_grad=lambda s, *_: s / 2, bias=bias))


# ---- mask_mod --------------------------------------------------------------------------------------

_PREFIX = np.array([5, 12])
_DOC = np.sort(_rng("doc").integers(0, 4, size=(B, max(LQ, LK))), axis=-1)

MASK_MODS = {   # name: (expression, mod_args, NumPy function)
    "prefix-LM": ("(kv_idx <= q_idx + 8) | (kv_idx < prefix[b])", {"prefix": _PREFIX},
                  lambda b, h, i, j: (j <= i + 8) | (j < _PREFIX[b])),
    "documents": ("doc[b, q_idx] == doc[b, kv_idx]", {"doc": _DOC},
                  lambda b, h, i, j: _DOC[b, i] == _DOC[b, j]),
    "dilated": ("(q_idx - kv_idx) - 3 * floor((q_idx - kv_idx) / 3.0) == 0", {},
                lambda b, h, i, j: (i - j) % 3 == 0),
}


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mod_matches_the_oracle(name):
    text, args, fn = MASK_MODS[name]
    _check(f"mask-{name}", api=dict(mask_mod=text, mod_args=args), oracle=dict(mask_mod=fn))


def test_and_or_bind_looser_than_comparisons():
    # unlike Python: q_idx >= 3 & kv_idx < 5 means (q_idx >= 3) & (kv_idx < 5)
    bare = _expr.parse("q_idx >= 3 & kv_idx < 5 | ~(b == 1) & h != 2", "mask_mod", boolean=True)
    full = _expr.parse("((q_idx >= 3) & (kv_idx < 5)) | ((~(b == 1)) & (h != 2))", "mask_mod", boolean=True)
    assert _expr.normalised(bare) == _expr.normalised(full)
    assert _expr.normalised(_expr.parse("-score * 2 - 1 / h", "score_mod")) == "(((-score) * 2) - (1 / h))"


def test_a_sliding_window_by_hand_equals_window():
    q, k, v, dout = _inputs("window")
    diagonal = LK - LQ
    by_hand = f"(kv_idx >= q_idx + {diagonal} - 4) & (kv_idx <= q_idx + {diagonal} + 2)"
    out, lse = cupyflash.attention(q, k, v, window=(4, 2), return_lse=True)
    out2, lse2 = cupyflash.attention(q, k, v, mask_mod=by_hand, return_lse=True)
    np.testing.assert_allclose(out2, out, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(lse2, lse, rtol=1e-14, atol=1e-15)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, window=(4, 2))
    grads2 = cupyflash.attention_backward(dout, q, k, v, out2, lse2, mask_mod=by_hand)
    for a, b in zip(grads, grads2):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_everything_together_with_lengths():
    slopes = 2.0 ** -np.arange(1, H + 1)
    bias = random_array(_rng("all-bias"), (B, 1, LQ, LK), np.float64)
    mask = _rng("all-mask").random((LQ, LK)) < 0.9
    lens = dict(q_lengths=np.array([19, 8]), kv_lengths=np.array([20, 27]))
    text, args, fn, grad = SCORE_MODS["distance kernel"]
    mtext, margs, mfn = MASK_MODS["documents"]
    _check("all", api=dict(softcap=3.0, alibi_slopes=slopes, bias=bias, mask=mask, score_mod=text,
                           mask_mod=mtext, mod_args={**args, **margs}),
           oracle=dict(softcap=3.0, alibi_slopes=slopes, bias=bias, mask=mask, score_mod=fn,
                       score_mod_grad=grad, mask_mod=mfn), causal=True, scale=2.0, **lens)


# ---- the derivative ---------------------------------------------------------------------------------


DERIVATIVES = [
    "score * score - 3 * score", "tanh(score) * exp(-score / 4)", "log(score * score + 1)", "sqrt(score + 5)",
    "sigmoid(2 * score)", "abs(score - 0.3)", "min(score, 0.5) + max(score * 2, -1)",
    "where(score > 0.2, score * score, -score)", "score / (1 + score * score)", "-score * q_idx + h",
] + [v[0] for v in SCORE_MODS.values()]


@pytest.mark.parametrize("text", DERIVATIVES)
def test_the_derived_gradient_matches_finite_differences(text):
    # away from the kinks of abs, min, max and where (0.3, 0.5, -0.5 and 0.2 above):
    # points at least 1e-3 from them, steps of 1e-6
    rng = _rng("fd", text)
    s = rng.uniform(-3, 3, size=(H, LQ, LK))
    kinks = np.array([0.3, 0.5, -0.5, 0.2])
    s = np.where(np.min(np.abs(s[..., None] - kinks), axis=-1) < 1e-3, s + 0.01, s)
    args = {n: a for _, a, _, _ in SCORE_MODS.values() for n, a in a.items()} if "[" in text else {}
    node = _expr.parse(text, "score_mod", args)
    env = dict(b=np.array([1]).reshape(1, 1, 1), h=np.arange(H).reshape(H, 1, 1),
               q_idx=np.arange(LQ)[:, None], kv_idx=np.arange(LK)[None, :])
    step = 1e-6
    up = _expr.evaluate(node, {**env, "score": s + step}, args, np.float64)
    down = _expr.evaluate(node, {**env, "score": s - step}, args, np.float64)
    derivative = _expr.derivative(node)
    d = _expr.evaluate(derivative, {**env, "score": s}, args, np.float64)
    np.testing.assert_allclose(np.broadcast_to(d, s.shape), (up - down) / (2 * step), rtol=1e-6, atol=1e-7)


def test_the_whole_backward_matches_finite_differences_through_a_score_mod():
    rng = _rng("fd-all")
    q, k, v = (random_array(rng, (1, 2, 5, 4), np.float64) for _ in range(3))
    dout = random_array(rng, (1, 2, 5, 4), np.float64)
    bias = random_array(rng, (2, 5, 5), np.float64)
    kw = dict(softcap=1.5, bias=bias, score_mod="where(score > 0, score * score, 0.5 * score)", causal=True)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)

    def loss(**over):
        args = dict(q=q, k=k, v=v, bias=bias)
        args.update(over)
        return float(np.sum(dout * cupyflash.attention(args["q"], args["k"], args["v"], bias=args["bias"],
                                                        **{n: x for n, x in kw.items() if n != "bias"})))

    step = 1e-6
    for name, x, g in (("q", q, grads[0]), ("k", k, grads[1]), ("v", v, grads[2]), ("bias", bias, grads[3])):
        fd = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            e = np.zeros_like(x)
            e[index] = step
            fd[index] = (loss(**{name: x + e}) - loss(**{name: x - e})) / (2 * step)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7, err_msg=name)


# ---- errors ------------------------------------------------------------------------------------------


def _error(call, error=ValueError):
    with pytest.raises(error) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("text, args, message, caret", [
    ("score +", {}, "unexpected end", 7),
    ("score * gama[h]", {"gamma": _GAMMA}, "unknown array 'gama'", 8),
    ("score * gamma", {"gamma": _GAMMA}, "needs 1 index", 8),
    ("score * gamma[h, b]", {"gamma": _GAMMA}, "has 1 axis", 8),
    ("score * gamma[0.5]", {"gamma": _GAMMA}, "needs int", 14),
    ("cosh(score)", {}, "unknown function 'cosh'", 0),
    ("score * qidx", {}, "unknown name 'qidx'", 8),
    ("score < 1", {}, "not bool", 6),
    ("score & 1", {}, "needs bool", 0),
    ("(score", {}, "expected ')'", 6),
    ("score # 2", {}, "unexpected character '#'", 6),
])
def test_bad_score_mod_is_refused_with_a_caret(text, args, message, caret):
    q, k, v, _ = _inputs("errors")
    msg = _error(lambda: cupyflash.attention(q, k, v, score_mod=text, mod_args=args or None))
    assert "`score_mod`" in msg and message in msg, msg
    lines = msg.splitlines()
    assert lines[1].strip() == text and lines[2].index("^") - lines[1].index(text[0]) == caret, msg


def test_bad_mask_mod_and_mod_args_are_refused_before_any_work():
    q, k, v, _ = _inputs("errors")
    assert "must be boolean" in _error(lambda: cupyflash.attention(q, k, v, mask_mod="q_idx - kv_idx"))
    assert "`score` exists in score_mod only" in _error(lambda: cupyflash.attention(q, k, v, mask_mod="score > 0"))
    assert "NumPy" in _error(lambda: cupyflash.attention(q, k, v, score_mod="score * t[b]",
                                                         mod_args={"t": [1.0, 2.0]}), TypeError)
    assert "taken by the language" in _error(lambda: cupyflash.attention(q, k, v, score_mod="score",
                                                                         mod_args={"h": _GAMMA}))
    assert "neither" in _error(lambda: cupyflash.attention(q, k, v, mod_args={"g": _GAMMA}))
    assert "positive finite" in _error(lambda: cupyflash.attention(q, k, v, softcap=-1.0))
    assert "positive number" in _error(lambda: cupyflash.attention(q, k, v, softcap=True), TypeError)
    assert "batch shape" in _error(lambda: cupyflash.attention(q, k, v, alibi_slopes=np.ones(3)))
    assert "floating" in _error(lambda: cupyflash.attention(q, k, v, alibi_slopes=np.ones(H, int)), TypeError)
    assert "must be a string" in _error(lambda: cupyflash.attention(q, k, v, score_mod=lambda s: s), TypeError)


def test_an_index_out_of_bounds_raises_index_error():
    q, k, v, _ = _inputs("index")
    with pytest.raises(IndexError, match="'rel'.*outside"):
        cupyflash.attention(q, k, v, score_mod="score + rel[h, q_idx - kv_idx]", mod_args={"rel": _REL})


# ---- the kernels, on the emulator ---------------------------------------------------------------

KERNEL_FAMILIES = [   # id, arch, KernelOptions, dtype, precision, the forward family
    ("simt-f32", 80, {}, np.float32, "ieee", "fwd_simt"),
    ("mma-f16", 80, {}, np.float16, "ieee", "fwd_mma"),
    ("wgmma-f16", 90, {"wgmma": True}, np.float16, "ieee", "fwd_wgmma"),
    ("tf32x3", 80, {}, np.float32, "tf32x3", "fwd_tf32"),
    ("dmma-f64", 80, {"dmma": {"float64"}}, np.float64, "ieee", "fwd_dmma"),
]


def _kernel_case(dtype, hkv=2, d=64):
    """q, k, v, dout of GQA 2:1 and the keywords of every modification at once, with the
    oracle's: softcap, a bias, ALiBi, a score_mod reading a table, a mask_mod reading one."""
    q, k, v, dout = _inputs(f"kernel-{np.dtype(dtype).name}-{d}", hkv=hkv, dtype=dtype, d=d)
    slopes = 2.0 ** -np.arange(1, H + 1)
    bias = random_array(_rng("kernel-bias"), (B, 1, 1, LK), np.float32)
    text, args, fn, grad = SCORE_MODS["distance kernel"]
    mtext, margs, mfn = MASK_MODS["documents"]
    api = dict(softcap=4.0, bias=bias, alibi_slopes=slopes, score_mod=text, mask_mod=mtext, mod_args={**args, **margs})
    oracle = dict(softcap=4.0, bias=bias, alibi_slopes=slopes, score_mod=fn, mask_mod=mfn)
    return q, k, v, dout, api, oracle


# Where a call with score features runs other tiles at d = 128 (the families' feature_tiles,
# and bwd_dmma's order of products: none spills there): a piece of each kernel it launches.
FEATURE_TILE_KERNELS = {   # forward family: (its kernel, the backward's kernels)
    "fwd_mma": ("fwd_mma_kernel<__half, 128, 128, 32, 4, 1, true", ("bwd_mma_dkdv_kernel<__half, 128, 64, 32, 4, 1, ",
                                                                   "bwd_mma_dkdv_kernel<__half, 128, 64, 32, 4, 2, ")),
    "fwd_wgmma": ("fwd_wgmma_kernel<__half, 128, 64, 2, true", ("bwd_wgmma_dkdv_kernel<__half, 128, 128, 64, 2, 1>",
                                                               "bwd_wgmma_dkdv_kernel<__half, 128, 128, 64, 2, 2>",
                                                               "bwd_wgmma_dq_kernel<__half, 128, 128, 64, 2")),
    "fwd_tf32": ("fwd_tf32_kernel<128, 64, 16, 4, 3>", ("bwd_tf32_dkdv_kernel<128, 64, 8, 4, 3>",
                                                       "bwd_tf32_dq_kernel<128, 64, 8, 4, 3>")),
    "fwd_dmma": ("fwd_dmma_kernel<128, 64, 8, 4>", ("bwd_dmma_dkdv_kernel<128, 32, 8, 4>",)),
    "fwd_simt": ("fwd_simt_kernel<float, 128, ", ("bwd_simt_dkdv_kernel<float, 128, ",)),
}
HEAD_DIMS = pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])


def _launched(spy, pieces):
    missing = [p for p in pieces if not any(p in n for n in spy.launched)]
    assert not missing, (missing, spy.launched)


@HEAD_DIMS
@pytest.mark.parametrize("fid, arch, options, dtype, precision, family", KERNEL_FAMILIES,
                         ids=[c[0] for c in KERNEL_FAMILIES])
def test_forward_kernels_take_every_modification(emulate, fid, arch, options, dtype, precision, family, d):
    spy = emulate(arch, **options)
    q, k, v, _, api, oracle = _kernel_case(dtype, d=d)
    common = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, precision=precision, **api,
                                   **common)
    assert {n.split("<")[0] for n in spy.launched} == {f"cf::{family}_kernel"}
    if d == 128:
        _launched(spy, FEATURE_TILE_KERNELS[family][:1])
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **oracle, **common)
    assert_lse_close(lse, ref_lse, dtype)
    if np.dtype(dtype).itemsize == 2:
        # the families' 16-bit rule (docs/testing.md): within HALF_FORWARD_FACTOR of the error
        # of attention whose unnormalised P is rounded to the input dtype before P V, plus one
        # rounding of the largest output -- here on the oracle's modified scores
        s, _, _, o = _probabilities(q, k, v, **oracle, **common)
        top = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        e = np.exp(s - np.where(np.isfinite(top), top, 0))
        total = e.sum(axis=-1, keepdims=True)
        naive = (e.astype(dtype).astype(np.float64) @ o.v) / np.where(total > 0, total, 1)
        err = np.abs(out.astype(np.float64) - ref).max()
        bound = (HALF_FORWARD_FACTOR * np.abs(naive - ref).max()
                 + (HALF_UNIT_ROUNDOFF[np.dtype(dtype).name] + 2.0**-24) * np.abs(ref).max())
        assert err <= bound, f"max error {err:.3g} > {bound:.3g}"
    else:
        assert_close(out, ref, np.float32 if precision != "ieee" else dtype)


@pytest.mark.parametrize("fid, arch, options, dtype, precision, family", KERNEL_FAMILIES[:2] + KERNEL_FAMILIES[4:],
                         ids=[c[0] for c in KERNEL_FAMILIES[:2] + KERNEL_FAMILIES[4:]])
def test_backward_kernels_take_alibi_and_mask_mod(emulate, fid, arch, options, dtype, precision, family):
    # the modifications whose gradient needs no factor of the chain rule: ALiBi is an
    # additive term, mask_mod a mask (so the 16-bit yardstick can take them as such)
    spy = emulate(arch, **options)
    q, k, v, dout, api, oracle = _kernel_case(dtype)
    keep = ("bias", "alibi_slopes", "mask_mod", "mod_args")
    api = {n: x for n, x in api.items() if n in keep}
    oracle = {n: x for n, x in oracle.items() if n in keep}
    common = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **api, **common)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **api, **common)
    assert any(n.startswith(f"cf::bwd_{family.split('_')[1]}_dkdv") for n in spy.launched)
    expected = naive_attention_backward(dout, q, k, v, **oracle, **common)
    if np.dtype(dtype).itemsize == 2:
        # the 16-bit yardstick (naive_half_backward) with ALiBi as the additive term it is and
        # mask_mod as the mask it is: the families' rule
        from _backward_util import assert_within_yardstick, backward_term_sizes, naive_half_backward

        i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
        alibi = -api["alibi_slopes"][:, None, None] * np.abs(i + LK - LQ - j)
        doc = api["mod_args"]["doc"]
        documents = doc[:, None, :LQ, None] == doc[:, None, None, :LK]
        half = naive_half_backward(dout, q, k, v, out, scale=1 / np.sqrt(q.shape[-1]), window=(None, 0),
                                   gqa_ratio=2, lse=lse, bias=(api["bias"], alibi), mask=documents)
        sizes = backward_term_sizes(dout, q, k, v, bias=(api["bias"], alibi), mask=documents, **common)
        for name, g, e, h, size in zip(("dq", "dk", "dv"), grads, expected, half, sizes):
            assert_within_yardstick(g, e, h, sizes=size, what=name)
    else:
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            assert_grad_close(g, e, dtype, what=name)
    looser = np.float32 if np.dtype(dtype).itemsize == 8 else dtype     # the bias term is float32
    assert_grad_close(grads[3], expected[3], looser, what="dbias")


@HEAD_DIMS
@pytest.mark.parametrize("fid, arch, options, dtype, precision, family", KERNEL_FAMILIES,
                         ids=[c[0] for c in KERNEL_FAMILIES])
def test_backward_kernels_carry_the_chain_rule(emulate, fid, arch, options, dtype, precision, family, d):
    # softcap and score_mod: dS times score_mod's derivative, then dbias, then times the
    # softcap's.  float32 / float64 (and tf32x3) against the oracle with the table;
    # 16-bit inputs within HALF_YARDSTICK_FACTOR of naive_half_backward's error, which
    # applies the same softcap, bias and function in float32 (the families' rule).  d = 64:
    # a derivative kept per score element; d = 128 (the feature tiles): the distance kernel,
    # whose derivative is the number 1 (CF_SCORE_MOD_GRAD_CONST), with a mask_mod
    spy = emulate(arch, **options)
    q, k, v, dout, api, oracle = _kernel_case(dtype, d=d)
    if d == 64:
        mod = "where(score > 0, score * score / 4, 0.5 * score)"
        api = dict(softcap=3.0, bias=api["bias"], score_mod=mod)
        oracle = dict(softcap=3.0, bias=oracle["bias"],
                      score_mod=lambda s, *_: np.where(s > 0, s * s / 4, 0.5 * s),
                      score_mod_grad=lambda s, *_: np.where(s > 0, s / 2, 0.5))
    else:
        text, args, fn, grad = SCORE_MODS["distance kernel"]
        api = dict(softcap=3.0, bias=api["bias"], score_mod=text, mod_args=args)
        oracle = dict(softcap=3.0, bias=oracle["bias"], score_mod=fn, score_mod_grad=grad)
    common = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **api, **common)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", precision=precision,
                                         **api, **common)
    assert any(n.startswith(f"cf::bwd_{family.split('_')[1]}_dkdv") for n in spy.launched)
    if d == 128:
        _launched(spy, FEATURE_TILE_KERNELS[family][1])
    expected = naive_attention_backward(dout, q, k, v, **oracle, **common)
    accuracy = np.float32 if precision != "ieee" or np.dtype(dtype).itemsize == 8 else dtype
    if np.dtype(dtype).itemsize == 2:
        from _backward_util import assert_within_yardstick, backward_term_sizes, naive_half_backward

        # the oracle's (b, h, q_idx, kv_idx), broadcast over the scores (B, H, Lq, Lk)
        coords = (np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
                  np.arange(LQ)[:, None], np.arange(LK)[None, :])
        half = naive_half_backward(dout, q, k, v, out, scale=1 / np.sqrt(q.shape[-1]), window=(None, 0),
                                   gqa_ratio=2, lse=lse, bias=(api["bias"],), softcap=3.0,
                                   score_fn=lambda x: oracle["score_mod"](x, *coords),
                                   score_fn_grad=lambda x: oracle["score_mod_grad"](x, *coords))
        sizes = backward_term_sizes(dout, q, k, v, **oracle, **common)
        for name, g, e, h, size in zip(("dq", "dk", "dv"), grads, expected, half, sizes):
            assert_within_yardstick(g, e, h, sizes=size, what=name)
    else:
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            assert_grad_close(g, e, dtype, what=name)
    assert_grad_close(grads[3], expected[3], accuracy, what="dbias")


def test_kernel_coordinates_follow_each_sequence(emulate):
    # one launch over the sequences (lengths) keeps b each sequence's flat batch index
    emulate(80)
    q, k, v, dout, api, oracle = _kernel_case(np.float64, hkv=H)
    lens = dict(q_lengths=np.array([19, 8]), kv_lengths=np.array([20, 27]))
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, **api, **lens)
    ref, ref_lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **api, **lens)
    assert_close(out, ref, np.float64)
    assert_lse_close(lse, ref_lse, np.float64)


def test_an_index_out_of_bounds_on_the_emulator_raises_index_error(emulate):
    emulate(80)
    q, k, v, _ = _inputs("kernel-index", dtype=np.float32)
    with pytest.raises(IndexError, match="outside its array"):
        cupyflash.attention(q, k, v, backend="emulator", score_mod="score + g[q_idx - kv_idx]",
                            mod_args={"g": np.ones(LQ + LK)})


_TOKENS = st.sampled_from(["score", "b", "h", "q_idx", "kv_idx", "g", "tab", "tanh", "where", "min", "floor",
                           "1", "2.5", "1e3", "+", "-", "*", "/", "(", ")", "[", "]", ",", "<", "<=", "==",
                           "&", "|", "~", "$", " "])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOKENS, min_size=0, max_size=14))
def test_random_token_strings_raise_value_error_or_parse(tokens):
    text = " ".join(tokens)
    arrays = {"g": _GAMMA, "tab": _REL}
    for what, boolean in (("score_mod", False), ("mask_mod", True)):
        try:
            node = _expr.parse(text, what, arrays, boolean=boolean)
        except ValueError as error:
            assert f"`{what}`" in str(error)
        else:
            _expr.normalised(node)
            if not boolean:
                _expr.derivative(node)
