"""Shared test helpers: one tolerance table, random inputs, comparison against the oracle."""

from __future__ import annotations

import os

import numpy as np

try:
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    bfloat16 = None

DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)] + (
    [bfloat16] if bfloat16 is not None else []
)
DTYPE_IDS = [d.name for d in DTYPES]            # pytest ids for parametrising over DTYPES
HALF = [d for d in DTYPES if d.itemsize == 2]   # float16 (and bfloat16 where available)

# Absolute/relative tolerance per dtype for outputs of O(1) magnitude compared with
# the float64 oracle evaluated on the *same* (already rounded) inputs.  The output is
# rounded to the dtype once, so the bound is a few ulps of the dtype.
TOLERANCE = {
    np.dtype(np.float16): dict(rtol=2e-3, atol=2e-3),
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-6),
    np.dtype(np.float64): dict(rtol=4e-14, atol=4e-15),
}
if bfloat16 is not None:
    TOLERANCE[bfloat16] = dict(rtol=1.6e-2, atol=1.6e-2)


def on_ci() -> bool:
    """Whether this is a CI run (``CI=true``, as CI hosts set it): there a check that
    cannot run fails, where a developer's machine skips it with its reason."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def dtype_named(name: str) -> np.dtype:
    """The NumPy dtype called ``name``; bfloat16 from ml_dtypes (the test skips without it)."""
    if name == "bfloat16":
        import pytest

        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def random_array(rng, shape, dtype, scale=1.0):
    """Standard-normal values (never zeros) rounded to ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def random_qkv(rng, q_shape, k_shape, v_shape, dtype, scale=1.0):
    return tuple(random_array(rng, s, dtype, scale) for s in (q_shape, k_shape, v_shape))


def assert_close(actual, expected, dtype, *, what="output", factor=1.0, extra=0.0):
    """Compare ``actual`` (any float dtype, NumPy) with the float64 ``expected``: the
    dtype's tolerance times ``factor``, plus an absolute ``extra`` (a bound derived for
    the case, e.g. :func:`logit_rounding`'s)."""
    tol = TOLERANCE[np.dtype(dtype)]
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    np.testing.assert_allclose(
        a, e, rtol=tol["rtol"] * factor, atol=tol["atol"] * factor + extra, err_msg=what
    )


def logit_rounding(q, k, scale):
    """``max_ij |scale| sum_c |q_ic k_jc|``: a score computed in floating point is off by
    a few unit roundoffs of this (the sum its rounding comes from), whatever the score.
    Where it is large (large scales), P = exp(S - lse) inherits twice that relative
    error, and out = P V up to 2 max|delta S| max|v| (docs/testing.md, "Error analysis")."""
    q64, k64 = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k, np.float64))
    return abs(scale) * float((q64 @ np.swapaxes(k64, -1, -2)).max(initial=0.0))


def accum_dtype(dtype):
    """The dtype the library accumulates in (and returns lse in) for inputs of ``dtype``."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def assert_lse_close(actual, expected, dtype, *, what="lse"):
    """Compare a returned lse with the float64 oracle's: its dtype, the rows that see
    no key (``-inf`` in both) and the finite values (tolerance of the accumulation dtype)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == accum_dtype(dtype), f"{what}: dtype {actual.dtype}, expected {accum_dtype(dtype)}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{what}: -inf rows")
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], accum_dtype(dtype), what=what)


def to_tf32(x):
    """float32 ``x`` rounded to TF32 as ``cvt.rna.tf32.f32`` does: 10 explicit mantissa
    bits, ties away from zero, the low 13 bits zero (returned as float32)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (u & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    rounded = np.where(finite, (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000), u)
    return rounded.astype(np.uint32).view(np.float32)


def naive_tf32_attention(q, k, v, *, scale, window=(None, None), enable_gqa=False):
    """The yardstick of ``precision="tf32"``: naive attention of q, k, v rounded to TF32,
    scores and sums in float32, the unnormalised probabilities rounded to TF32 before
    they multiply v -- what the TF32 tensor cores do, in the plainest order."""
    q, k, v = (to_tf32(x) for x in (q, k, v))
    if enable_gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(scale)
    ok = visible(q.shape[-2], k.shape[-2], window)
    s = np.where(ok, s, -np.inf).astype(np.float32)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    p = np.exp(s - m).astype(np.float32)
    row_sum = p.sum(axis=-1, keepdims=True, dtype=np.float32)
    o = np.matmul(to_tf32(p), v)
    return np.where(row_sum > 0, o / np.where(row_sum > 0, row_sum, 1), 0).astype(np.float32)


# ---- precision="tf32x3": what its products and its tensor-core sums add to float32's rules ----------
# (docs/testing.md, "Error analysis", "TF32x3")

# A tf32x3 product big_a big_b + big_a small_b + small_a big_b of float32 a, b is off by at
# most 3 * 2^-22 |a b|: the dropped small_a small_b and the remainders a - big_a - small_a,
# b - big_b - small_b (each below 2^-22 of its operand).
TF32X3_SPLIT = 3 * 2.0**-22
TF32_MMA_K = 8   # products per mma.sync m16n8k8 .tf32


def tf32_mma_cut(accumulation: str) -> float:
    """Per tf32 mma instruction, its error beyond float32's own rounding, relative to the sum
    of the absolute values of its terms (C and the k products), for the emulator's
    ``accumulation`` models: "exact" sums them exactly and rounds once to nearest -- float32's
    rounding, which the table and the term bound already allow: 0.  "truncate:E" cuts the
    sum toward zero (less than 2^-23 of it) and, before that, each term but the largest
    toward zero at 24 + E bits below the largest's leading bit (less than 2^-(23+E) of the
    largest each, k of them): 2^-23 (1 + k 2^-E)."""
    mode, _, bits = accumulation.partition(":")
    if mode == "exact":
        return 0.0
    if mode != "truncate":
        raise ValueError(f"accumulation: 'exact' or 'truncate:E', got {accumulation!r}")
    return 2.0**-23 * (1 + TF32_MMA_K * 2.0 ** -int(bits or 3))


def tf32x3_chain(n: int) -> int:
    """The mma instructions one accumulator element goes through in a tf32x3 sum of n
    products: three per k8 step (an instruction of zero products adds no error)."""
    return 3 * -(-n // TF32_MMA_K)


def tf32x3_forward_bound(q, k, v, expected, *, scale, accumulation, window=(None, None), enable_gqa=False):
    """Per output element, the error ``precision="tf32x3"`` may have under ``accumulation``
    (tf32_mma_cut): float32's table, plus what the split products and the instruction
    chains add.  A score s_ij = q_i . k_j is off by at most
    sigma_ij = (TF32X3_SPLIT + n_d cut) |scale| sum_c |q_ic k_jc| (n_d = tf32x3_chain(d));
    out = sum_j P_ij v_j with P = softmax(s) then moves by at most
    sum_j P_ij sigma_ij |v_jc| + (sum_j P_ij sigma_ij) |out_ic|, and its own sum adds
    (TF32X3_SPLIT + n_k cut) sum_j P_ij |v_jc| (n_k = tf32x3_chain(Lk)).  All from the
    inputs and the float64 oracle's P and ``expected`` output, never from the result."""
    from cupyflash.reference import _probabilities

    _, p, _, o = _probabilities(q, k, v, scale=scale, window=window, enable_gqa=enable_gqa)
    cut = tf32_mma_cut(accumulation)
    score = (TF32X3_SPLIT + tf32x3_chain(q.shape[-1]) * cut) * abs(o.scale)
    p_sigma = p * score * np.matmul(np.abs(o.q), np.swapaxes(np.abs(o.k), -1, -2))
    abs_v = np.abs(o.v)
    allowance = (np.matmul(p_sigma, abs_v) + p_sigma.sum(axis=-1, keepdims=True) * np.abs(expected)
                 + (TF32X3_SPLIT + tf32x3_chain(k.shape[-2]) * cut) * np.matmul(p, abs_v))
    tol = TOLERANCE[np.dtype(np.float32)]
    return tol["rtol"] * np.abs(expected) + tol["atol"] + allowance


def with_terms(s, visible_pairs, bias=(), mask=None):
    """Scores ``s`` (float32) plus each bias term (read in float32, in order), -inf where
    ``visible_pairs`` or the mask hide the pair: what the kernels' score epilogue does."""
    for b in bias:
        s = s + np.asarray(b).astype(np.float32)
    admitted = visible_pairs if mask is None else visible_pairs & np.asarray(mask)
    return np.where(admitted, s, np.float32(-np.inf)).astype(np.float32)


def naive_half_attention(q, k, v, *, scale, window, gqa_ratio, bias=(), mask=None):
    """Attention as a tensor-core kernel computes it, untiled: scores and softmax in float32
    from the half inputs, the unnormalised P = exp(S - rowmax) rounded to the input dtype
    before P V, the row sum of P taken before that rounding, the output in float32 (not
    rounded: a check against it allows for the kernels' one rounding of it).  ``bias``
    (a tuple of terms) and ``mask``: :func:`with_terms`."""
    dtype = q.dtype
    k = np.repeat(k, gqa_ratio, axis=1) if gqa_ratio > 1 else k
    v = np.repeat(v, gqa_ratio, axis=1) if gqa_ratio > 1 else v
    s = np.matmul(q.astype(np.float32), np.swapaxes(k.astype(np.float32), -1, -2)) * np.float32(scale)
    s = with_terms(s, visible(q.shape[-2], k.shape[-2], window), bias, mask)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0)).astype(np.float32)
    total = p.sum(axis=-1, keepdims=True, dtype=np.float32)
    pv = np.matmul(p.astype(dtype).astype(np.float32), v.astype(np.float32))
    return np.where(total > 0, pv / np.where(total > 0, total, 1), 0).astype(np.float32)


# Unit roundoff of the 16-bit dtypes: one rounding of the output may be off by this, relatively.
HALF_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# How much further from the oracle than naive_half_attention the kernels may be, besides their
# one rounding of the output (docs/testing.md, "Error analysis"): both round P where a
# tensor-core kernel must, and differ in float32 order and in where P is rounded (against the
# running maximum), not in what is rounded.
HALF_FORWARD_FACTOR = 1.25

def assert_compiled_clean(report, rows, archs):
    """The static report ``report`` (cupyflash._report.kernel_report rows) has every one of
    ``rows`` on every arch of ``archs``, each without spills, stack frame or local memory,
    within 255 registers and with at least one CTA per SM."""
    assert {(r["arch"], r["name"]) for r in report} == {(a, i.name_expression) for a in archs for i in rows}
    for r in report:
        assert not (r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]), (r["arch"], r["name"])
        assert not (r["sass"].get("LDL") or r["sass"].get("STL")), (r["arch"], r["name"])
        assert r["occupancy"] >= 1 and r["registers"] <= 255


def wgmma_hazard_notes(log: str) -> list[str]:
    """The lines of a ptxas log (``-v``) in which ptxas says it repaired a wgmma ordering
    hazard itself: where the compiler has moved a read of wgmma accumulators (or a
    write of its A registers) above the wgmma.wait_group that retires them, ptxas
    inserts a wait of its own (C7517, 'wgmma.wait_group is injected') or serializes
    the wgmma (C7514, ...), and says so only at info level.  The results stay right
    and the overlap is lost; one injected wait is too little for the SASS counts to
    show."""
    import re

    return [line for line in log.splitlines() if re.search(r"\(C75\d\d\)", line)]


def wgmma_module_log(rows) -> str:
    """The ptxas log of the wgmma kernels ``rows`` (one entry file) compiled for sm_90a as
    cupyflash._report.kernel_report compiles them (its in-process cache: no second compile
    after the report fixture)."""
    from cupyflash import _report
    from cupyflash._loader import module_source

    (entry,) = {r.entry for r in rows}
    (family,) = {r.family for r in rows}
    return _report.compile_report(module_source(entry), [r.name_expression for r in rows],
                                  family.compile_target("sm_90"), sass=True,
                                  filename=f"cuda_src/{entry}").log


def poisoned(shape, dtype):
    """An output buffer full of NaN, so that an element the code under test forgets shows."""
    return np.full(shape, np.nan, dtype=dtype)


def assert_grad_close(actual, expected, dtype, *, what="gradient"):
    """Compare a gradient with the float64 naive one.

    A gradient entry is a sum over a whole sequence of terms of the size of the
    largest entries, so its absolute rounding error scales with that size, not with
    the entry: the dtype's ``atol`` is applied relative to ``max(1, max |expected|)``,
    its ``rtol`` to each entry as it is (scaling both would let the allowance grow
    with the square of the gradients' size).
    """
    tol = TOLERANCE[np.dtype(dtype)]
    expected = np.asarray(expected, dtype=np.float64)
    magnitude = max(1.0, float(np.abs(expected).max(initial=0.0)))
    assert_close(actual, expected, dtype, what=what, extra=tol["atol"] * (magnitude - 1.0))


def visible(seqlen_q: int, seqlen_k: int, window) -> np.ndarray:
    """(Lq, Lk) bool: query i may see key j (window bottom-right aligned, None = unbounded)."""
    left, right = window
    diff = np.arange(seqlen_k)[None, :] - np.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q)
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left is not None:
        ok &= diff >= -left
    if right is not None:
        ok &= diff <= right
    return ok


def cxx_struct_layout(tmp_path, header: str, struct: str, fields: dict) -> dict:
    """Offsets (and ``sizeof``, ``alignof``) of a struct of cuda_src/ as g++ lays it out.

    ``fields`` maps each printed name to the C++ offset expression of that field
    (e.g. ``offsetof(cf::FwdParams, q)``).  Returns ``{name: int}``, in print order.
    """
    import subprocess

    from cupyflash._source import cuda_src_dir

    prints = "\n".join(f'    std::printf("{n} %zu\\n", (size_t)({e}));' for n, e in fields.items())
    src = tmp_path / "layout.cpp"
    src.write_text(f'#include <cstddef>\n#include <cstdio>\n#include "{header}"\n'
                   f'int main() {{\n{prints}\n'
                   f'    std::printf("sizeof %zu\\n", sizeof({struct}));\n'
                   f'    std::printf("alignof %zu\\n", alignof({struct}));\n}}\n')
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-std=c++17", f"-I{cuda_src_dir()}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    return {name: int(value) for name, value in (line.split() for line in lines if line)}


class LaunchSpy:
    """Executor wrapper recording each launch's ``(name expression, grid)`` and
    ``(entry, name expression)`` (the module variant it was built from); passes the
    inner executor's ``arch`` and SM count on, so the dispatch is the inner one's."""

    def __init__(self, inner):
        self.inner, self.arch = inner, inner.arch
        self.multiprocessors = getattr(inner, "multiprocessors", None)
        self.launches = []
        self.entries = []

    @property
    def launched(self):
        return [name for name, _ in self.launches]

    def launch(self, entry, name_expression, grid, block, shared_mem, params):
        self.launches.append((name_expression, tuple(grid) if isinstance(grid, tuple) else (grid,)))
        self.entries.append((entry, name_expression))
        self.inner.launch(entry, name_expression, grid, block, shared_mem, params)


# Every kernel family the dispatcher can pick, each forced in turn on the emulator (the
# conftest's ``emulate`` fixture): (id, arch, KernelOptions, dtype, precision, the family
# expected to run).  A feature's emulator tests run one representative shape per row.
EMULATED_FAMILIES = [
    ("simt-f32", 80, {}, np.float32, "ieee", "simt"),
    ("simt-f64", 80, {}, np.float64, "ieee", "simt"),
    ("mma-f16", 80, {}, np.float16, "ieee", "mma"),
    ("mma-bf16", 80, {}, bfloat16, "ieee", "mma"),
    ("tf32x3", 80, {}, np.float32, "tf32x3", "tf32"),
    ("dmma-f64", 80, {"dmma": {"float64"}}, np.float64, "ieee", "dmma"),
    ("wgmma-f16", 90, {"wgmma": True}, np.float16, "ieee", "wgmma"),
]


def family_params(cases):
    """pytest params of EMULATED_FAMILIES-shaped rows (the id as the test id; a row of
    bfloat16 skipped without ml_dtypes)."""
    import pytest

    return [pytest.param(*c[1:], id=c[0], marks=pytest.mark.skipif(c[3] is None, reason="no ml_dtypes"))
            for c in cases]


def gpu_variant_options(cp, variant: str, dtype):
    """KernelOptions of a GPU-tier test's ``variant`` ("default", "wgmma", "dmma") on the
    current device, or a pytest skip where the device or the dtype has no such kernels."""
    import pytest

    from cupyflash._options import KernelOptions

    arch = int(cp.cuda.Device().compute_capability)
    options = KernelOptions.from_environment()
    if variant == "wgmma":
        if dtype.itemsize != 2 or arch != 90:
            pytest.skip("fwd_wgmma/bwd_wgmma: float16/bfloat16 on an sm_90 GPU")
        return options.replace(wgmma=True)
    if variant == "dmma":
        if dtype.itemsize == 2 or arch not in (80, 90):
            pytest.skip("the FP64 tensor cores: float32/float64 on sm_80 or sm_90")
        return options.replace(dmma={"float64", "float32"})
    return options


def forward_against_oracle(executor, q, k, v, *, window=(None, None), gqa_ratio=1, out=None,
                           with_lse=True, precision="ieee", options=None):
    """:func:`cupyflash._run.forward` of q, k, v on ``executor`` (dispatch ``options``,
    default ``KernelOptions()``) into a NaN-poisoned ``out``
    (unless given) against the float64 oracle: every element written, out and lse to the
    dtype's tolerance, rows that see no key zero with lse = -inf.  Returns the
    :class:`LaunchSpy` that ran it and ``out``.

    ``precision="tf32"`` (float32): out no further from the oracle than twice
    :func:`naive_tf32_attention` is, element-wise maximum, and lse within the error
    its TF32 scores allow.  ``"tf32x3"`` must meet float32's own tolerance."""
    import math

    from cupyflash import _run
    from cupyflash._options import KernelOptions
    from cupyflash.reference import naive_attention

    dtype = q.dtype
    if out is None:
        out = poisoned(q.shape[:3] + (v.shape[3],), dtype)
    lse = poisoned(q.shape[:3], accum_dtype(dtype)) if with_lse else None
    spy = LaunchSpy(executor)
    scale = 1.0 / math.sqrt(q.shape[-1])
    _run.forward(q, k, v, out, lse, scale=scale, window_left=window[0], window_right=window[1],
                 gqa_ratio=gqa_ratio, executor=spy, precision=precision,
                 options=KernelOptions() if options is None else options)
    ref, ref_lse = naive_attention(q, k, v, scale=scale, window=window, enable_gqa=gqa_ratio > 1,
                                   return_lse=True)
    assert not np.isnan(out.astype(np.float64)).any(), "output element left unwritten (NaN)"
    if precision == "tf32":
        yardstick = naive_tf32_attention(q, k, v, scale=scale, window=window, enable_gqa=gqa_ratio > 1)
        err = np.abs(out.astype(np.float64) - ref).max(initial=0.0)
        assert err <= 2 * np.abs(yardstick.astype(np.float64) - ref).max(initial=0.0), err
    else:
        assert_close(out, ref, dtype)
    if with_lse and precision == "tf32":
        # a score's TF32 error is below 2^-10 sum |q_i k_i| scale (two roundings of
        # 2^-11 each, products and sums exact enough beside them); lse moves by at most
        # the largest score error of its row
        bound = 2.0 ** -10 * scale * np.matmul(np.abs(q.astype(np.float64)),
                                               np.swapaxes(np.abs(np.repeat(k, gqa_ratio, axis=1)
                                                                  .astype(np.float64)), -1, -2)).max(axis=-1)
        finite = np.isfinite(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        assert (np.abs(lse[finite] - ref_lse[finite]) <= bound[finite] + 1e-5).all()
    elif with_lse:
        assert_lse_close(lse, ref_lse, dtype)
        no_key = np.isneginf(ref_lse)
        assert (np.isneginf(lse) == no_key).all()
        assert (out.astype(np.float64)[no_key] == 0).all()
    return spy, out


def use_cpu_blocks(monkeypatch, *, key_block: int, score_elements: int, min_query_block: int) -> None:
    """Make the CPU path's blocks small (for the rest of the test), so that small problems
    take several query and key blocks."""
    from cupyflash import _cpu

    monkeypatch.setattr(_cpu, "_MAX_KEY_BLOCK", key_block)
    monkeypatch.setattr(_cpu, "_SCORE_BLOCK_ELEMENTS", score_elements)
    monkeypatch.setattr(_cpu, "_MIN_QUERY_BLOCK", min_query_block)


_GUARDED = []   # the guarded mappings of this process (never unmapped: a few MiB per run at most)


def guarded_array(shape, dtype, guard_bytes=1 << 20):
    """A C-contiguous array of ``shape`` that ends exactly where ``guard_bytes`` of
    inaccessible memory begin: any read past its last element faults (the emulator reads
    arrays where they are, so a kernel reading past a view crashes the test instead of
    reading whatever lies there)."""
    import ctypes
    import mmap as _mmap

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    page = _mmap.PAGESIZE
    data = -(-nbytes // page) * page
    guard = -(-guard_bytes // page) * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    addr = libc.mmap(None, data + guard, _mmap.PROT_READ | _mmap.PROT_WRITE,
                     _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    if libc.mprotect(addr + data, guard, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    _GUARDED.append(addr)
    buffer = (ctypes.c_char * nbytes).from_address(addr + data - nbytes)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def plain_call_rows(family):
    """The family's rows a call without score features can run: its rows less those of its
    feature tiles (tests/test_score_mods.py runs those at d = 128, tests/mods_sweep.py and
    tests/terms_sweep.py at every head dim) and of its paged-cache tiles
    (tests/test_kvcache_kernels.py): what a test running each row through plain dispatch
    can reach."""
    tables = {t: {} for t in ("feature_tiles", "mod_tiles", "paged_tiles") if hasattr(family, t)}
    plain = {r.name_expression for r in family.with_tiles(**tables).rows}
    return [r for r in family.rows if r.name_expression in plain]
