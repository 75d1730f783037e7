"""Helpers the kernel-family tests share (tests/test_families.py, the per-family files and
their GPU tier): inputs, one forward or backward through :mod:`cupyflash._run` on an
executor with explicit :class:`~cupyflash._options.KernelOptions`, and the accuracy rules
of the half-precision kernels; the wgmma probes; the GPU tier's forward checks.

The float32/float64 forward rule is :func:`_util.forward_against_oracle`, the backward
rules are :class:`Case`'s (tests/_backward_util.py has the error analysis).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cupyflash import _run
from cupyflash._options import KernelOptions
from cupyflash.emulator import emulator_available
from cupyflash.reference import naive_attention, naive_attention_backward

from _backward_util import (TF32_YARDSTICK_FACTOR, assert_within_term_bound, assert_within_yardstick,
                            backward_term_sizes, naive_half_backward, naive_tf32_backward)
from _emulator_util import bf16_round
from _util import (HALF, HALF_FORWARD_FACTOR, HALF_UNIT_ROUNDOFF, LaunchSpy, accum_dtype, assert_lse_close,
                   bfloat16, naive_half_attention, poisoned, random_array)

_OK, _WHY = emulator_available()
needs_emulator = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")

HALF_DTYPES = list(HALF)
HALF_IDS = [d.name for d in HALF_DTYPES]


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a kernel row's dtype name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        if bfloat16 is None:
            pytest.skip("needs ml_dtypes")
        return bfloat16
    return np.dtype(name)


def qkv(rng, dtype, *, batch=1, heads_kv=1, gqa_ratio=1, seqlen_q, seqlen_k, head_dim, head_dim_v=None,
        scale=1.0):
    """Random (B, H, L, d) q, k, v with ``gqa_ratio`` query heads per kv head."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return (random_array(rng, (batch, gqa_ratio * heads_kv, seqlen_q, head_dim), dtype, scale),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim), dtype, scale),
            random_array(rng, (batch, heads_kv, seqlen_k, head_dim_v), dtype, scale))


# ---- the half-precision forward: its rule -------------------------------------------------------

# One ulp at 1.0 (machine epsilon): 10 and 7 explicit mantissa bits.
ULP_AT_ONE = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def check_against_oracle(out, lse, q, k, v, *, scale=None, window=(None, None), gqa_ratio=1):
    """Every element written; out no further from the float64 oracle than HALF_FORWARD_FACTOR
    times naive_half_attention (tests/_util.py), plus one rounding of the largest output (and float32's);
    lse (unless None) to its tolerance."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    assert not np.isnan(out.astype(np.float64)).any(), "output element left unwritten (NaN)"
    oracle, oracle_lse = naive_attention(q, k, v, scale=scale, window=window,
                                         enable_gqa=gqa_ratio > 1, return_lse=True)
    naive = naive_half_attention(q, k, v, scale=scale, window=window, gqa_ratio=gqa_ratio)
    err = np.abs(out.astype(np.float64) - oracle).max(initial=0.0)
    naive_err = np.abs(naive.astype(np.float64) - oracle).max(initial=0.0)
    largest = np.abs(oracle).max(initial=0.0)
    bound = HALF_FORWARD_FACTOR * naive_err + (HALF_UNIT_ROUNDOFF[q.dtype.name] + 2.0**-24) * largest
    assert err <= bound, (f"max error {err:.3g} > {HALF_FORWARD_FACTOR} x the yardstick's {naive_err:.3g} "
                          f"+ one rounding of the largest output {largest:.3g}")
    if lse is not None:
        assert_lse_close(lse, oracle_lse, q.dtype)


def run_half_forward(executor, q, k, v, *, window=(None, None), gqa_ratio=1, scale=None, out=None, lse=None,
                     with_lse=True, family="fwd_mma", splits=1, options=None):
    """One half-precision forward through :func:`cupyflash._run.forward` on ``executor``
    (``options``: None is the defaults) with ``splits`` forced (> 1: the kSplit row, then
    fwd_combine), checked against the oracle with :func:`check_against_oracle`; asserts that
    ``family``'s kernel ran.  Returns (out, lse)."""
    batch, heads, seqlen_q, head_dim = q.shape
    if out is None:
        out = poisoned((batch, heads, seqlen_q, v.shape[3]), q.dtype)
    if lse is None and with_lse:
        lse = poisoned((batch, heads, seqlen_q), np.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    spy = LaunchSpy(executor)
    _run.forward(q, k, v, out, lse, scale=scale, window_left=window[0], window_right=window[1],
                 gqa_ratio=gqa_ratio, executor=spy, options=(options or KernelOptions()).replace(splits=splits))
    expected = [f"cf::{family}_kernel"] + (["cf::fwd_combine_kernel"] if splits > 1 else [])
    assert [n.split("<")[0] for n in spy.launched] == expected, spy.launched
    check_against_oracle(out, lse if with_lse else None, q, k, v, scale=scale, window=window,
                         gqa_ratio=gqa_ratio)
    return out, lse


# ---- a backward problem and its accuracy rule ----------------------------------------------------

class Case:
    """One backward problem: inputs, the forward's out/lse as the forward returns them, dout,
    and the :class:`~cupyflash._options.KernelOptions` and precision its runs pass to dispatch."""

    precision = "ieee"

    def __init__(self, rng, q, k, v, *, window=(None, None), gqa_ratio=1, scale=None, dout=None, options=None,
                 precision=None):
        self.q, self.k, self.v = q, k, v
        self.dtype = np.dtype(q.dtype)
        self.window, self.gqa_ratio = window, gqa_ratio
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        self.options = KernelOptions() if options is None else options
        if precision is not None:
            self.precision = precision
        out, lse = naive_attention(q, k, v, scale=self.scale, window=window,
                                   enable_gqa=gqa_ratio > 1, return_lse=True)
        self.out = out.astype(self.dtype)
        self.lse = lse.astype(accum_dtype(self.dtype))
        self.dout = random_array(rng, out.shape, self.dtype) if dout is None else dout

    def grads(self):
        acc = accum_dtype(self.dtype)
        return (poisoned(self.q.shape, acc), poisoned(self.k.shape, acc), poisoned(self.v.shape, acc))

    def run(self, executor, grads=None, *, out=None, dout=None, lse=None, deterministic=True):
        """The kernels' dq, dk, dv (accumulator dtype, shapes of q, k, v)."""
        dq, dk, dv = self.grads() if grads is None else grads
        _run.backward(self.dout if dout is None else dout, self.q, self.k, self.v,
                      self.out if out is None else out, self.lse if lse is None else lse,
                      dq, dk, dv, scale=self.scale, window_left=self.window[0],
                      window_right=self.window[1], gqa_ratio=self.gqa_ratio, deterministic=deterministic,
                      executor=executor, options=self.options, precision=self.precision)
        return dq, dk, dv

    def plan(self, arch, deterministic=True):
        """The rows :meth:`run` launches on compute capability ``arch``."""
        return _run.backward_plan(self.dout, self.q, self.k, self.v, self.grads()[0], arch=arch,
                                  options=self.options, deterministic=deterministic, precision=self.precision)

    def expected(self):
        return naive_attention_backward(self.dout, self.q, self.k, self.v, scale=self.scale,
                                        window=self.window, enable_gqa=self.gqa_ratio > 1)

    def check(self, grads, *, logits=0.0):
        """float32/float64 (and float32 with precision "tf32x3"): the term bound
        (assert_within_term_bound; ``logits``: see there), with what probabilities flushed
        below float32's smallest normal take -- for tf32x3 float32's gradient bound of the GPU
        tier (32 epsilons of the terms each element sums; a TF32x3 product is good to about 6
        float32 epsilons); precision "tf32": within TF32_YARDSTICK_FACTOR of the naive TF32
        backward's error; 16-bit: within HALF_YARDSTICK_FACTOR of naive_half_backward's error."""
        expected = self.expected()
        half = self.dtype.itemsize == 2
        naive_half = (naive_half_backward(self.dout, self.q, self.k, self.v, self.out, scale=self.scale,
                                          window=self.window, gqa_ratio=self.gqa_ratio, lse=self.lse)
                      if half else (None,) * 3)
        naive_tf32 = (naive_tf32_backward(self.dout, self.q, self.k, self.v, self.out, self.lse, scale=self.scale,
                                          window=self.window, gqa_ratio=self.gqa_ratio)
                      if self.precision == "tf32" else (None,) * 3)
        kw = dict(scale=self.scale, window=self.window, enable_gqa=self.gqa_ratio > 1)
        sizes = backward_term_sizes(self.dout, self.q, self.k, self.v, **kw)
        flushed = (backward_term_sizes(self.dout, self.q, self.k, self.v, unit_probabilities=True, **kw)
                   if not half else (None,) * 3)
        for name, g, e, h, t, size, unit in zip(("dq", "dk", "dv"), grads, expected, naive_half, naive_tf32, sizes,
                                                flushed):
            g = np.asarray(g)
            assert g.shape == e.shape, f"{name}: shape {g.shape} != {e.shape}"
            assert not np.isnan(g.astype(np.float64)).any(), f"{name}: element left unwritten (NaN)"
            if t is not None:
                assert_within_yardstick(g, e, t, factor=TF32_YARDSTICK_FACTOR, sizes=size, what=name)
            elif h is None:
                assert_within_term_bound(g, e, size, eps=np.finfo(self.dtype).eps,
                                         head_dim=max(self.q.shape[-1], self.v.shape[-1]), logits=logits,
                                         floor=np.finfo(accum_dtype(self.dtype)).tiny * unit, what=name)
            else:
                assert_within_yardstick(g, e, h, sizes=size, what=name)


def check_broadcast_and_strided_views(executor, dtype, case_type=Case, **case_kw):
    """A GQA backward through ``executor`` on views, against the oracle: q, dout, out and
    dq as (B, L, H, d) buffers viewed as (B, H, L, d); k every other row, v reversed
    along L; a broadcast (stride-0) batch axis of q; dk with L outermost, dv every
    other row.  ``case_type``: Case or a subclass with its own accuracy rule; ``case_kw``
    its options or precision."""
    rng = np.random.default_rng(21)
    b, h, lq, lk, d = 2, 4, 60, 77, 64
    q = np.broadcast_to(random_array(rng, (1, lq, h, d), dtype).transpose(0, 2, 1, 3), (b, h, lq, d))
    k = random_array(rng, (b, 2, 2 * lk, d), dtype)[:, :, ::2]
    v = random_array(rng, (b, 2, lk, d), dtype)[:, :, ::-1]
    dout = random_array(rng, (b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    case = case_type(rng, q, k, v, gqa_ratio=2, window=(30, 4), dout=dout, **case_kw)
    out = np.empty((b, lq, h, d), dtype).transpose(0, 2, 1, 3)
    out[...] = case.out
    grads = (poisoned((b, lq, h, d), dtype).transpose(0, 2, 1, 3),
             poisoned((lk, b, 2, d), dtype).transpose(1, 2, 0, 3),
             poisoned((b, 2, 2 * lk, d), dtype)[:, :, 1::2])
    case.check(case.run(executor, grads=grads, out=out))


# ---- the wgmma probes: one instruction, and each product of the kernels -------------------------

PLANTED_DIR = Path(__file__).resolve().parent / "emulator_planted"
PROBE = str(PLANTED_DIR / "wgmma_planted.cu")
PROBE_SHARED = 2 * 64 * 64 * 2 + 1024   # A and B pages, and the slack to align them
# Each wgmma product of fwd_wgmma.cu and bwd_wgmma.cu as the kernels call it (its
# header lists what it covers beyond PROBE's single instruction).
PRODUCTS = str(PLANTED_DIR / "wgmma_products.cu")
PRODUCT_FORMS = {0: "fwd-S=QKt-d128", 1: "fwd-O=PV-d128", 2: "bwd-own-stream-d128", 3: "bwd-accumulate-d128",
                 4: "bwd-atomic-dq-d128", 5: "bwd-atomic-dq-d64", 6: "fwd-S=QKt-d256", 7: "fwd-O=PV-d256",
                 8: "bwd-own-stream-d256", 9: "bwd-accumulate-d256"}
# form -> (shape of the first input, of the second, how they multiply): "abt" A B^T,
# "ab" A B, "dq" 0.5 A^T B (the tile holds dS^T)
_PRODUCT_SHAPES = {0: ((128, 128), (128, 128), "abt"), 1: ((128, 128), (128, 128), "ab"),
                   2: ((128, 128), (64, 128), "abt"), 3: ((128, 64), (64, 128), "ab"),
                   4: ((128, 64), (128, 128), "dq"), 5: ((128, 128), (128, 64), "dq"),
                   6: ((128, 256), (64, 256), "abt"), 7: ((128, 64), (64, 256), "ab"),
                   8: ((128, 256), (32, 256), "abt"), 9: ((128, 32), (32, 256), "ab")}
PRODUCT_THREADS = 256
PRODUCT_SHARED = (128 * 256 + 64 * 256) * 2 + 1024   # the largest form's tiles (6), and the alignment slack


def product_case(form: int, seed: int = 0):
    """Inputs of wgmma_products<form> (two row-major float32 matrices, one after the other),
    its output buffer as the kernel needs it (NaN, or zero for the atomic dQ forms), the
    float64 product NumPy expects from the inputs rounded to bfloat16, the same product
    of absolute values, and the number of terms each element sums."""
    rng = np.random.default_rng(seed + form)
    shape_a, shape_b, how = _PRODUCT_SHAPES[form]
    a, b = (rng.standard_normal(shape).astype(np.float32) for shape in (shape_a, shape_b))
    ar, br = bf16_round(a), bf16_round(b)
    if how == "abt":            # S = Q K^T, X = A B^T: both K-major
        expected, bound, terms = ar @ br.T, np.abs(ar) @ np.abs(br).T, shape_a[1]
    elif how == "ab":           # O = P V, G = X Z: B MN-major
        expected, bound, terms = ar @ br, np.abs(ar) @ np.abs(br), shape_a[1]
    else:                       # dq = 0.5 dS K
        expected, bound, terms = 0.5 * ar.T @ br, 0.5 * np.abs(ar).T @ np.abs(br), shape_a[0]
    out = np.zeros(expected.size, np.float32) if how == "dq" else np.full(expected.size, np.nan, np.float32)
    return np.concatenate([a.ravel(), b.ravel()]), out, expected, bound, terms


def check_product(out, expected, bound, terms):
    """float32 accumulation of exact bfloat16 products: within 8 units of float32 rounding
    per term summed (tensor cores need not round to nearest); a misread layout or
    descriptor is off by the size of the terms."""
    out = out.reshape(expected.shape)
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} elements never written"
    err, tol = np.abs(out - expected), terms * 2.0 ** -21 * bound
    worst = np.unravel_index(np.argmax(err / (bound + 1e-30)), err.shape)
    assert (err <= tol).all(), (f"element {worst}: {out[worst]} vs {expected[worst]}; "
                                f"{int((err > tol).sum())} of {err.size} elements wrong")


def compile_planted_sm90a(source: str, names) -> tuple[str, bytes, dict]:
    """(ptxas log, cubin, lowered names) of a planted file compiled by NVRTC for sm_90a with
    the loader's options (tests/test_gpu_wgmma.py loads the cubin)."""
    from cupyflash._loader import COMPILE_OPTIONS
    from cupyflash import _nvrtc
    from cupyflash._source import assemble

    options = COMPILE_OPTIONS + _nvrtc.include_options() + (
        "-arch=sm_90a", "--device-as-default-execution-space", "-ftz=true", "--ptxas-options=-v")
    return _nvrtc.compiler().compile(assemble(source), list(names), options, Path(source).name)


# ---- the GPU tier's forward checks (tests/test_gpu_mma.py, tests/test_gpu_wgmma.py) --------------

class Recorder:
    """Executor wrapper that keeps the name expressions launched in a list (``launched``).
    Unlike :class:`_util.LaunchSpy` it hides the inner executor's SM count, so that dispatch
    never splits the keys: the launches are the forward kernel's alone."""

    def __init__(self, inner):
        self.inner, self.arch, self.launched = inner, inner.arch, []

    def launch(self, entry, name_expression, grid, block, shared_mem, params):
        self.launched.append(name_expression)
        self.inner.launch(entry, name_expression, grid, block, shared_mem, params)


@pytest.fixture
def launched(monkeypatch):
    """The name expressions cupyflash.attention launches (backend="cuda") in this test."""
    from cupyflash import _dispatch

    recorder = Recorder(_dispatch.executor_for("cuda"))
    monkeypatch.setattr(_dispatch, "executor_for", lambda backend: recorder)
    return recorder.launched


def gpu_poisoned(shape, dtype):
    import cupy as cp

    return cp.full(shape, cp.nan, dtype=dtype)


def attention_on_gpu(q, k, v, **kw):
    """cupyflash.attention on CuPy copies of NumPy inputs, into a NaN-poisoned ``out=``;
    returns (out, lse) on the host."""
    import cupy as cp

    import cupyflash

    out = gpu_poisoned(q.shape[:-1] + (v.shape[-1],), q.dtype)
    result, lse = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out,
                                      return_lse=True, backend="cuda", **kw)
    assert result is out
    return cp.asnumpy(out), cp.asnumpy(lse)


def window_kw(window):
    """attention() keywords of a (left, right) window ((None, 0) is causal)."""
    if tuple(window) == (None, 0):
        return dict(causal=True)
    return dict(window=window)


def check_head_dim(rng, launched, dtype, d, kernel):
    """Tails in both axes at head dim ``d``: ``kernel`` ran, the output matches the oracle."""
    q = random_array(rng, (2, 3, 200, d), dtype)
    k = random_array(rng, (2, 3, 331, d), dtype)
    v = random_array(rng, (2, 3, 331, d), dtype)
    out, lse = attention_on_gpu(q, k, v)
    assert [n.split("<")[0] for n in launched] == [kernel]
    check_against_oracle(out, lse, q, k, v)


def check_masks(rng, dtype, seqlen_q, seqlen_k, window):
    """d = 128 under ``window`` (left, right; (None, 0) is causal) against the oracle."""
    q = random_array(rng, (1, 4, seqlen_q, 128), dtype)
    k = random_array(rng, (1, 4, seqlen_k, 128), dtype)
    v = random_array(rng, (1, 4, seqlen_k, 128), dtype)
    out, lse = attention_on_gpu(q, k, v, **window_kw(window))
    check_against_oracle(out, lse, q, k, v, window=window)


# The mask cases of tests/test_gpu_mma.py and tests/test_gpu_wgmma.py.
MASK_LENGTHS = pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 170), (150, 420)], ids=["lq>lk", "lq<lk"])
MASK_WINDOWS = pytest.mark.parametrize("window", [(None, 0), (16, 0), (0, 0), (5, 40), (None, 9), (100, None)],
                                       ids=["causal", "w16-0", "w0-0", "w5-40", "wN-9", "w100-N"])


def _float32_reference(q, k, v, *, causal):
    """Naive attention in float32 on the GPU, one (batch, head) at a time, plus the same
    with P rounded to the input dtype (the naive half-precision error)."""
    import cupy as cp

    ref = cp.empty(q.shape, cp.float32)
    naive = cp.empty(q.shape, q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        mask = cp.arange(lk)[None, :] <= cp.arange(lq)[:, None] + (lk - lq)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = cp.matmul(q[b, h].astype(cp.float32), k[b, h].astype(cp.float32).T) * scale
            if mask is not None:
                s = cp.where(mask, s, -cp.inf)
            s -= s.max(axis=-1, keepdims=True)
            p = cp.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            vf = v[b, h].astype(cp.float32)
            ref[b, h] = cp.matmul(p, vf)
            naive[b, h] = cp.matmul(p.astype(q.dtype).astype(cp.float32), vf).astype(q.dtype)
            del s, p
    return ref, naive


def check_long_sequence(launched, dtype, causal, kernel):
    """(4, 16, 8192, 128) twice into poisoned outputs: ``kernel`` ran both times, the runs
    agree bit for bit, and the error against the float32 reference is within the criterion."""
    import cupy as cp

    import cupyflash

    shape = (4, 16, 8192, 128)
    gen = cp.random.default_rng(1234)
    q, k, v = (gen.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3))
    outs = []
    for _ in range(2):
        out = gpu_poisoned(shape, dtype)
        cupyflash.attention(q, k, v, causal=causal, out=out, backend="cuda")
        outs.append(out)
    assert [n.split("<")[0] for n in launched] == [kernel] * 2
    assert not bool(cp.isnan(outs[0].astype(cp.float32)).any())
    assert cp.asnumpy(outs[0]).tobytes() == cp.asnumpy(outs[1]).tobytes(), "runs differ"
    ref, naive = _float32_reference(q, k, v, causal=causal)
    err = float(cp.abs(outs[0].astype(cp.float32) - ref).max())
    naive_err = float(cp.abs(naive.astype(cp.float32) - ref).max())
    assert err <= 2 * naive_err + ULP_AT_ONE[np.dtype(dtype).name], (err, naive_err)
