"""Bad input, row by row, on every backend, forward and backward; non-finite inputs.

``BAD_INPUTS`` has one row per error of DESIGN.md section 3 (and the list in
``attention``'s docstring): what is changed in a valid call, the exception
type, and a pattern that names the argument.  Each row runs on every backend
(``numpy``, ``emulator``; ``cuda`` in the gpu tier, with CuPy arrays), through
``attention`` and through ``attention_backward``, with the backends themselves
replaced by a function that fails the test: validation must raise before any
work is done.

Non-finite inputs are not errors: a NaN or infinity propagates to the
output rows that depend on it and to no other row (docs/semantics.md,
"Non-finite inputs").
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _api
from cupyflash.emulator import emulator_available
from cupyflash.reference import naive_attention

from _util import DTYPES, assert_close, visible

EMULATOR_OK, EMULATOR_WHY = emulator_available()

BACKEND_MARKS = {
    "numpy": (),
    "emulator": (pytest.mark.skipif(not EMULATOR_OK, reason=f"CPU emulator unavailable: {EMULATOR_WHY}"),),
    "cuda": (pytest.mark.gpu,),
}
BACKENDS = [pytest.param(name, marks=marks, id=name) for name, marks in BACKEND_MARKS.items()]


def _xp(backend):
    if backend == "cuda":
        import cupy

        return cupy
    return np


def _fake_cupy_array():
    """An object validation classifies as a CuPy array, without CuPy."""
    return type("ndarray", (), {"__module__": "cupy._core.core", "shape": (2, 3, 5, 4), "ndim": 4,
                                "dtype": np.dtype(np.float32)})()


def _other_kind(backend, like):
    """An array of the other kind than the backend takes: NumPy for cuda, (fake) CuPy otherwise."""
    return np.asarray(like.get()) if backend == "cuda" else _fake_cupy_array()


@pytest.fixture
def call(monkeypatch):
    """A valid call (q (2,3,5,4), k/v (2,3,7,4), float32) as a dict to spoil; running it
    fails the test if validation lets it through to a backend."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("a backend ran although the arguments are invalid")

    monkeypatch.setattr(_api, "run_forward", must_not_run)
    monkeypatch.setattr(_api, "run_backward", must_not_run)

    def make(backend):
        xp = _xp(backend)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4)))
        out, lse = naive_attention(q, k, v, return_lse=True)
        arrays = dict(q=q, k=k, v=v, dout=np.ones_like(out, np.float32), out=out.astype(np.float32),
                      lse=lse.astype(np.float32), out_arg=np.full(out.shape, np.nan, np.float32))
        a = {name: xp.asarray(x) for name, x in arrays.items()}
        a["options"] = dict(backend=backend)
        a["xp"], a["backend"] = xp, backend
        return a

    return make


def run_forward(a):
    return cupyflash.attention(a["q"], a["k"], a["v"], out=a.get("out_arg"), **a["options"])


def run_backward(a):
    return cupyflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **a["options"])


def _set(**changes):
    """A row's change: a function of the call dict; values are functions of it too."""
    def change(a):
        new = {name: f(a) for name, f in changes.items()}
        for name, value in new.items():
            if name in ("scale", "causal", "window", "enable_gqa", "backend", "deterministic"):
                a["options"][name] = value
            else:
                a[name] = value
    return change


def _all_other_kind(a):
    for name in ("q", "k", "v", "dout", "out", "lse", "out_arg"):
        a[name] = _other_kind(a["backend"], a[name])


def _different_float(a):
    return a["k"].astype(np.float64)


def _not_broadcasting(a):
    xp = a["xp"]
    return xp.concatenate([a["k"], a["k"][:1]], axis=0)      # batch 3 against q's 2


def _head_dim(name, n):
    def big(a):
        return a["xp"].ones(a[name].shape[:-1] + (n,), np.float32)
    return big


def _overlapping_out(a):
    return a["q"]                                             # out has q's shape here (dv == d)


def _read_only_out(a):
    out = a["out_arg"].copy()
    out.flags.writeable = False
    return out


# (id, directions, backends or None for all, change of the call dict, exception, pattern
# naming the argument)
BAD_INPUTS = [
    # TypeError: not arrays, kinds mixed, dtypes
    ("q_list", "fb", None, _set(q=lambda a: a["q"].tolist()), TypeError, r"`q`.*list"),
    ("k_tuple", "fb", None, _set(k=lambda a: tuple(a["k"].tolist())), TypeError, r"`k`.*tuple"),
    ("v_float", "fb", None, _set(v=lambda a: 3.0), TypeError, r"`v`"),
    ("q_none", "fb", None, _set(q=lambda a: None), TypeError, r"`q`"),
    ("k_other_kind", "fb", None, _set(k=lambda a: _other_kind(a["backend"], a["k"])), TypeError,
     r"all arrays must be of one kind.*k: (cupy|numpy)"),
    ("all_other_kind", "fb", None, _all_other_kind, TypeError, r"backend='(numpy|emulator|cuda)' needs"),
    ("q_int32", "fb", None, _set(q=lambda a: a["q"].astype(np.int32)), TypeError, r"`q` must have dtype"),
    ("k_bool", "fb", None, _set(k=lambda a: a["k"] > 0), TypeError, r"`k` must have dtype"),
    ("v_complex", "fb", None, _set(v=lambda a: a["v"].astype(np.complex64)), TypeError, r"`v` must have dtype"),
    ("k_float64", "fb", None, _set(k=_different_float), TypeError,
     r"`q`, `k` and `v` must have the same dtype; got q: float32, k: float64, v: float32"),
    ("causal_int", "fb", None, _set(causal=lambda a: 1), TypeError, r"`causal`"),
    ("enable_gqa_str", "fb", None, _set(enable_gqa=lambda a: "yes"), TypeError, r"`enable_gqa`"),
    ("scale_str", "fb", None, _set(scale=lambda a: "0.5"), TypeError, r"`scale`"),
    # ValueError: shapes
    ("q_1d", "fb", None, _set(q=lambda a: a["q"][0, 0, 0]), ValueError, r"`q` must have at least 2 dimensions"),
    ("k_0d", "fb", None, _set(k=lambda a: a["k"].reshape(-1)[:1].reshape(())), ValueError, r"`k` must have at least 2 dimensions"),
    ("d_mismatch", "fb", None, _set(k=lambda a: a["k"][..., :3]), ValueError,
     r"`q` and `k` must have the same head dim.*\(2, 3, 5, 4\).*\(2, 3, 7, 3\)"),
    ("lk_mismatch", "fb", None, _set(v=lambda a: a["v"][..., :6, :]), ValueError,
     r"`k` and `v` must have the same sequence length.*\(2, 3, 7, 4\).*\(2, 3, 6, 4\)"),
    ("batch_not_broadcasting", "fb", None, _set(k=_not_broadcasting), ValueError,
     r"do not broadcast: q \(2, 3\), k \(3, 3\), v \(2, 3\)"),
    ("gqa_not_dividing", "fb", None,       # 3 query heads over 2 kv heads
     _set(enable_gqa=lambda a: True, k=lambda a: a["k"][:, :2], v=lambda a: a["v"][:, :2]), ValueError,
     r"enable_gqa=True needs the query head count to be a multiple.*q \(2, 3, 5, 4\), k \(2, 2, 7, 4\)"),
    ("head_dim_300", "fb", ("emulator", "cuda"), _set(q=_head_dim("q", 300), k=_head_dim("k", 300)), ValueError,
     r"head dims up to 256; got q/k head dim 300"),
    ("head_dim_v_257", "fb", ("emulator", "cuda"), _set(v=lambda a: a["xp"].ones((2, 3, 7, 257), np.float32)),
     ValueError, r"head dims up to 256.*v head dim 257"),
    # ValueError: values
    ("scale_nan", "fb", None, _set(scale=lambda a: float("nan")), ValueError, r"`scale` must be finite"),
    ("scale_inf", "fb", None, _set(scale=lambda a: -np.inf), ValueError, r"`scale` must be finite"),
    ("window_one_bound", "fb", None, _set(window=lambda a: (3,)), ValueError, r"`window` must be a pair"),
    ("window_below_minus_one", "fb", None, _set(window=lambda a: (-2, 0)), ValueError, r"`window` left bound"),
    ("window_float", "fb", None, _set(window=lambda a: (1, 2.5)), ValueError, r"`window` right bound"),
    ("backend_unknown", "fb", None, _set(backend=lambda a: "torch"), ValueError, r"`backend`"),
    # out= (forward)
    ("out_shape", "f", None, _set(out_arg=lambda a: a["out_arg"][..., :3, :]), ValueError,
     r"`out` must have shape \(2, 3, 5, 4\); got \(2, 3, 3, 4\)"),
    ("out_dtype", "f", None, _set(out_arg=lambda a: a["out_arg"].astype(np.float64)), ValueError,
     r"`out` must have dtype float32; got float64"),
    ("out_list", "f", None, _set(out_arg=lambda a: a["out_arg"].tolist()), TypeError, r"`out`"),
    ("out_overlapping_q", "f", None, _set(out_arg=_overlapping_out), ValueError, r"`out` must not overlap"),
    ("out_read_only", "f", ("numpy", "emulator"), _set(out_arg=_read_only_out), ValueError, r"`out` is read-only"),
    # backward's own arguments
    ("dout_shape", "b", None, _set(dout=lambda a: a["dout"][..., :4, :]), ValueError, r"`dout` must have shape"),
    ("out_bwd_shape", "b", None, _set(out=lambda a: a["out"][:1]), ValueError, r"`out` must have shape"),
    ("dout_dtype", "b", None, _set(dout=lambda a: a["dout"].astype(np.float16)), TypeError,
     r"`dout` must have dtype float32"),
    ("out_bwd_dtype", "b", None, _set(out=lambda a: a["out"].astype(np.float64)), TypeError,
     r"`out` must have dtype float32"),
    ("lse_shape", "b", None, _set(lse=lambda a: a["lse"][..., None]), ValueError, r"`lse` must have shape \(2, 3, 5\)"),
    ("lse_dtype", "b", None, _set(lse=lambda a: a["lse"].astype(np.float16)), TypeError, r"`lse` must have dtype"),
    ("lse_list", "b", None, _set(lse=lambda a: a["lse"].tolist()), TypeError, r"`lse`"),
    ("dout_other_kind", "b", None, _set(dout=lambda a: _other_kind(a["backend"], a["dout"])), TypeError,
     r"dout: (cupy|numpy)"),
    ("deterministic_int", "b", None, _set(deterministic=lambda a: 1), TypeError, r"`deterministic`"),
]

CASES = [pytest.param(row, backend, direction, marks=marks, id=f"{row[0]}-{'forward' if direction == 'f' else 'backward'}-{backend}")
         for row in BAD_INPUTS for direction in row[1] for backend, marks in BACKEND_MARKS.items()
         if row[2] is None or backend in row[2]]


@pytest.mark.parametrize("row, backend, direction", CASES)
def test_bad_input_raises_the_documented_error_naming_the_argument(call, row, backend, direction):
    _, _, _, change, error, pattern = row
    a = call(backend)
    change(a)
    with pytest.raises(error, match=pattern):
        run_forward(a) if direction == "f" else run_backward(a)


@pytest.mark.parametrize("direction", ["f", "b"])
def test_every_row_is_checked_in_some_direction_on_every_backend(direction):
    rows = [r for r in BAD_INPUTS if direction in r[1]]
    assert len(rows) >= (25 if direction == "f" else 30)
    assert {r[4] for r in rows} == {TypeError, ValueError}


def test_head_dims_above_256_are_fine_on_the_cpu_path():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 300)) for _ in range(3))
    np.testing.assert_allclose(cupyflash.attention(q, k, v, backend="numpy"), naive_attention(q, k, v))


@pytest.mark.gpu
def test_arrays_on_two_gpus_are_a_value_error():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    x = np.ones((4, 8), np.float32)
    with cupy.cuda.Device(0):
        q = cupy.asarray(x)
    with cupy.cuda.Device(1):
        k = cupy.asarray(x)
    with pytest.raises(ValueError, match="one device.*'q': 0.*'k': 1"):
        cupyflash.attention(q, k, k)


# ---- non-finite inputs ---------------------------------------------------------------------

# (Lq, Lk, mask): causal with Lq > Lk (the first rows see no key), a band, all keys; sizes
# that span several query and key blocks of every kernel (fwd_mma: 128 x 64, fwd_simt 64 x 32).
MASKS = [(150, 100, dict(causal=True)), (140, 140, dict(window=(20, 5))), (70, 90, {})]


def _problem(dtype, lq, lk, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((2, 2, n, d)).astype(dtype) for n in (lq, lk, lk))


def _visible(lq, lk, causal=False, window=None):
    left, right = window if window is not None else (None, None)
    return visible(lq, lk, (left, 0 if causal else right))


def _run(backend, q, k, v, mask):
    """out and lse as float64 NumPy arrays (NumPy's warnings about NaN arithmetic silenced)."""
    xp = _xp(backend)
    with np.errstate(invalid="ignore"):
        out, lse = cupyflash.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), return_lse=True,
                                       backend=backend, **mask)
    host = (lambda x: x) if xp is np else (lambda x: x.get())
    return host(out).astype(np.float64), host(lse).astype(np.float64)


def _assert_rows_match_oracle(out, lse, q, k, v, mask, rows, dtype):
    """Rows ``rows`` of head (0, 0) are finite and match the oracle; other heads untouched."""
    with np.errstate(invalid="ignore"):
        ref, ref_lse = naive_attention(q, k, v, return_lse=True, **mask)
    assert np.isfinite(out[0, 0, rows]).all()
    assert_close(out[0, 0, rows], ref[0, 0, rows], dtype)
    np.testing.assert_array_equal(np.isneginf(lse[0, 0, rows]), np.isneginf(ref_lse[0, 0, rows]))
    assert np.isfinite(out[:, 1]).all() and np.isfinite(out[1]).all(), "another head was affected"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("lq, lk, mask", MASKS, ids=["causal_lq>lk", "window", "full"])
def test_nonfinite_query_makes_its_row_nan_and_no_other(backend, dtype, value, lq, lk, mask):
    q, k, v = _problem(dtype, lq, lk)
    k[..., 3] = np.abs(k[..., 3])        # so that +inf * k > 0: the row's logits are +inf
    seen = _visible(lq, lk, **mask).any(axis=1)
    for i in (0, lq // 2, lq - 1):
        q[0, 0, i, 3] = value
    out, lse = _run(backend, q, k, v, mask)
    bad = np.zeros(lq, bool)
    bad[[0, lq // 2, lq - 1]] = True
    bad &= seen                          # a row that sees no key does not read its query
    assert np.isnan(out[0, 0, bad]).all() and np.isnan(lse[0, 0, bad]).all()
    _assert_rows_match_oracle(out, lse, q, k, v, mask, ~bad, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("lq, lk, mask", MASKS, ids=["causal_lq>lk", "window", "full"])
def test_nonfinite_key_makes_exactly_the_rows_that_see_it_nan(backend, dtype, value, lq, lk, mask):
    q, k, v = _problem(dtype, lq, lk, seed=1)
    q[..., 3] = np.abs(q[..., 3])        # q * +inf > 0: every row that sees the key gets a +inf logit
    j = lk // 2
    k[0, 0, j, 3] = value
    out, lse = _run(backend, q, k, v, mask)
    sees = _visible(lq, lk, **mask)[:, j]
    assert sees.any() and (not sees.all() or not mask)
    assert np.isnan(out[0, 0, sees]).all() and np.isnan(lse[0, 0, sees]).all()
    _assert_rows_match_oracle(out, lse, q, k, v, mask, ~sees, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("lq, lk, mask", MASKS, ids=["causal_lq>lk", "window", "full"])
def test_minus_inf_logits_count_as_keys_with_zero_weight(backend, dtype, lq, lk, mask):
    # -inf in k against positive q: that key's logit is -inf in every row, which is
    # exactly a masked key; the rest of each row is unaffected, and a row whose only
    # visible key it is behaves as a row that sees no key (zeros, lse = -inf).
    q, k, v = _problem(dtype, lq, lk, seed=2)
    q[..., 3] = np.abs(q[..., 3]) + 0.5
    j = lk // 2
    k[0, 0, j, 3] = -np.inf
    out, lse = _run(backend, q, k, v, mask)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    masked = _visible(lq, lk, **mask)
    masked[:, j] = False
    with np.errstate(invalid="ignore"):
        ref = naive_attention(q, k, v, **mask)
    assert_close(out[0, 0], ref[0, 0], dtype)
    np.testing.assert_array_equal(np.isneginf(lse[0, 0]), ~masked.any(axis=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("lq, lk, mask", MASKS, ids=["causal_lq>lk", "window", "full"])
def test_nonfinite_value_reaches_its_column_of_the_rows_that_see_it(backend, dtype, value, lq, lk, mask):
    q, k, v = _problem(dtype, lq, lk, seed=3)
    j, c = lk // 2, 5
    v[0, 0, j, c] = value
    out, lse = _run(backend, q, k, v, mask)
    sees = _visible(lq, lk, **mask)[:, j]
    assert not np.isfinite(out[0, 0, sees, c]).any()
    if np.isnan(value):
        assert np.isnan(out[0, 0, sees, c]).all()
    # v enters neither lse nor any other column.  (Whether rows that do not see key j but
    # share its key block get a NaN is unspecified: semantics.md, "Non-finite inputs".)
    assert not np.isnan(lse).any()
    others = np.delete(np.arange(v.shape[-1]), c)
    assert np.isfinite(out[0, 0][np.ix_(sees, others)]).all()
    with np.errstate(invalid="ignore"):
        ref = naive_attention(q, k, v, **mask)
    assert_close(out[0, 0][np.ix_(sees, others)], ref[0, 0][np.ix_(sees, others)], dtype)
    assert np.isfinite(out[:, 1]).all() and np.isfinite(out[1]).all()
