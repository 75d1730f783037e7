"""cupyflash.torch: autograd, torch.compile and custom-op registration of attention on tensors.

Exactness is checked in float64 against PyTorch's own math-backend
``scaled_dot_product_attention`` (given cupyflash's bottom-right masks as boolean
``attn_mask``): both sides are float64 computations with errors of a few ulps
times the reduction lengths here (<= 9), about 1e-15, so the 1e-10 of the issue
leaves a wide margin while any wrong mask, scale or gradient is O(1e-2) off.
Half precision is compared bit for bit with the library called on the same arrays:
the adapter must add no rounding of its own.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from _adapter_util import CASES, allowed, require, spy_on_library

torch = require("torch")
import cupyflash.torch as cft  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

F64 = dict(rtol=0, atol=1e-10)
ROOT = Path(__file__).resolve().parents[1]


def _inputs(shapes, *, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
                 .requires_grad_() for s in shapes)


def _sdpa(q, k, v, *, scale=None, causal=False, window=None, enable_gqa=False):
    """PyTorch's math-backend attention with cupyflash's (bottom-right) masks."""
    mask = torch.from_numpy(allowed(q.shape[-2], k.shape[-2], causal=causal, window=window))
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.to(q.device), scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck_float64(case):
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes)
    assert torch.autograd.gradcheck(lambda q, k, v: cft.attention(q, k, v, **keywords), (q, k, v))


@pytest.mark.parametrize("case", list(CASES))
def test_output_and_gradients_match_sdpa_math_float64(case):
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes, seed=1)
    out = cft.attention(q, k, v, **keywords)
    ref = _sdpa(q, k, v, **keywords)
    torch.testing.assert_close(out, ref, **F64)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, e in zip("qkv", grads, expected):
        torch.testing.assert_close(g, e, **F64, msg=lambda m, name=name: f"d{name}: {m}")


def test_noncontiguous_upstream_gradient_and_strided_inputs():
    # (B, L, H, d) storage read as (B, H, L, d) views, a broadcast (expanded) key batch,
    # and an upstream gradient that is a transposed view: all zero-copy on the NumPy path
    gen = torch.Generator().manual_seed(2)
    qs = torch.randn(2, 6, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ks = torch.randn(1, 8, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    vs = torch.randn(2, 8, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    q, k, v = qs.transpose(1, 2), ks.transpose(1, 2).expand(2, 3, 8, 4), vs.transpose(1, 2)
    dout = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64).transpose(-1, -2)
    assert not dout.is_contiguous() and not q.is_contiguous()
    out = cft.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    ref = _sdpa(q, k, v, causal=True)
    expected = torch.autograd.grad(ref, (qs, ks, vs), dout.contiguous())
    torch.testing.assert_close(out, ref, **F64)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, **F64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_the_library_bit_for_bit(dtype):
    import ml_dtypes

    np_dtype = np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16
    q, k, v = _inputs(((2, 5, 8), (2, 7, 8), (2, 7, 8)), dtype=dtype, seed=3)
    view = cft._Host.to_array(q)
    assert view.dtype == np_dtype and view.ctypes.data == q.data_ptr()      # zero-copy
    out = cft.attention(q, k, v, window=(3, 0))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def arr(t):
        return t.detach().float().numpy().astype(np_dtype)

    ref, lse = cupyflash.attention(arr(q), arr(k), arr(v), window=(3, 0), return_lse=True)
    expected = cupyflash.attention_backward(arr(dout), arr(q), arr(k), arr(v), ref, lse,
                                            window=(3, 0))
    assert out.dtype == dtype
    for got, want in zip((out, *grads), (ref, *expected)):
        np.testing.assert_array_equal(got.detach().float().numpy(), want.astype(np.float32))


def test_emulator_backend_is_forwarded():
    emulator = pytest.importorskip("cupyflash.emulator")
    ok, reason = emulator.emulator_available()
    if not ok:
        pytest.skip(reason)
    q, k, v = _inputs(((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8)), dtype=torch.float32, seed=4)
    out = cft.attention(q, k, v, causal=True, backend="emulator")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    arrays = [t.detach().numpy() for t in (q, k, v)]
    ref, lse = cupyflash.attention(*arrays, causal=True, return_lse=True, backend="emulator")
    expected = cupyflash.attention_backward(np.ones_like(ref), *arrays, ref, lse, causal=True,
                                            backend="emulator")
    for got, want in zip((out, *grads), (ref, *expected)):
        np.testing.assert_array_equal(got.detach().numpy(), want)


def test_every_keyword_reaches_the_library(monkeypatch):
    calls = spy_on_library(monkeypatch, cft)
    q, k, v = _inputs(CASES["gqa"][1], dtype=torch.float32)
    out = cft.attention(q, k, v, scale=0.5, causal=True, window=(None, 2), enable_gqa=True,
                        precision="tf32x3", deterministic=False, backend="numpy")
    out.sum().backward()
    expected = dict(scale=0.5, causal=True, window=(-1, 2), enable_gqa=True,
                    precision="tf32x3", backend="numpy")
    assert calls["forward"] == dict(expected, return_lse=True)
    assert calls["backward"] == dict(expected, deterministic=False)


def test_backward_saves_only_q_k_v_out_and_lse():
    q, k, v = _inputs(CASES["lq_ne_lk"][1])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cft.attention(q, k, v, scale=np.float32(0.5))
    shapes = [tuple(t.shape) for t in saved]
    assert shapes == [q.shape, k.shape, v.shape, out.shape, out.shape[:-1]], shapes
    assert saved[3] is out or saved[3].data_ptr() == out.data_ptr()


def test_double_backward_raises_a_clear_error():
    q, k, v = _inputs(CASES["full"][1])
    out = cft.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        dq.sum().backward()


def test_opcheck_passes_on_the_forward_and_backward_operators():
    q, k, v = _inputs(CASES["gqa"][1])
    arguments = (0.4, True, 2, -1, True, "ieee", True, "auto")
    results = torch.library.opcheck(torch.ops.cupyflash.attention_forward.default,
                                    (q, k, v, *arguments))
    assert set(results.values()) == {"SUCCESS"}, results
    with torch.no_grad():
        out, lse = torch.ops.cupyflash.attention_forward(q, k, v, *arguments)
    plain = [t.detach() for t in (torch.randn_like(out), q, k, v, out, lse)]
    results = torch.library.opcheck(torch.ops.cupyflash.attention_backward.default,
                                    (*plain, *arguments))
    assert set(results.values()) == {"SUCCESS"}, results


class _Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is cupyflash's (or SDPA's)."""

    def __init__(self, attend, dim=16, heads=2):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)          # strided (B, H, L, d) views
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, length, dim)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


def test_compile_fullgraph_block_matches_eager():
    torch.manual_seed(5)
    block = _Block(lambda q, k, v: cft.attention(q, k, v, causal=True)).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    eager = block(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), (x, *block.parameters()))
    compiled = torch.compile(block, fullgraph=True)
    start = time.perf_counter()
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *block.parameters()))
    print(f"torch.compile of the block, forward and backward: {time.perf_counter() - start:.1f} s")
    torch.testing.assert_close(out, eager, rtol=1e-10, atol=1e-10)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("call, error, match", [
    (lambda q: cft.attention(q.detach().numpy(), q, q), TypeError, "`q` must be a torch.Tensor"),
    (lambda q: cft.attention(q, q.int(), q), TypeError, "`k` must have dtype float16, bfloat16"),
    (lambda q: cft.attention(q, q.float(), q), TypeError, "same dtype"),
    (lambda q: cft.attention(q, q, q, return_lse=True), TypeError, "does not take `return_lse`"),
    (lambda q: cft.attention(q, q, q, out=q), TypeError, "does not take `out`"),
    (lambda q: cft.attention(q, q, q, bias=q), TypeError, "unexpected keyword argument 'bias'"),
    (lambda q: cft.attention(q, q, q, backend="cuda"), TypeError, "needs CUDA tensors"),
    (lambda q: cft.attention(q, q, q, backend="gpu"), ValueError, "`backend` must be one of"),
    (lambda q: cft.attention(q, q, q, deterministic=1), TypeError, "`deterministic` must be a bool"),
    (lambda q: cft.attention(q, q, q, precision="tf32"), ValueError, "float32 inputs only"),
    (lambda q: cft.attention(q, q[..., :3], q), ValueError, r"same head dim.*\(1, 2, 6, 3\)"),
    (lambda q: cft.attention(q, q, q, window=(1.5, 0)), ValueError, "`window` left bound"),
    (lambda q: cft.attention(q, q, q, scale=float("nan")), ValueError, "`scale` must be finite"),
])
def test_bad_input_is_rejected_before_any_work(call, error, match, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the library was called")

    monkeypatch.setattr(cft, "_attention", fail)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(error, match=match):
        call(q)


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)


def test_import_without_torch_names_the_extra():
    result = _python('import sys; sys.modules["torch"] = None\n'
                     'import cupyflash.torch')
    assert result.returncode != 0
    assert 'ImportError: cupyflash.torch needs PyTorch; install it with: pip install "cupyflash[torch]"' \
        in result.stderr, result.stderr


def test_importing_cupyflash_imports_neither_torch_nor_jax():
    result = _python("import sys, cupyflash; print(sorted({'torch', 'jax'} & set(sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---- GPU tier: the same checks on CUDA tensors ---------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "gqa", "lq_ne_lk"])
def test_gpu_gradcheck_float64(case):
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes, device=_cuda())
    assert torch.autograd.gradcheck(lambda q, k, v: cft.attention(q, k, v, **keywords), (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_output_and_gradients_match_sdpa_math_float64(case):
    keywords, shapes = CASES[case]
    q, k, v = _inputs(shapes, device=_cuda(), seed=1)
    out = cft.attention(q, k, v, **keywords)
    assert out.device == q.device
    ref = _sdpa(q, k, v, **keywords)
    torch.testing.assert_close(out, ref, **F64)
    dout = torch.randn_like(ref).transpose(-1, -2).contiguous().transpose(-1, -2)  # strided
    for g, e in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, e, **F64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_on_a_side_stream_is_the_library_bit_for_bit(dtype):
    cupy = pytest.importorskip("cupy")
    device = _cuda()
    q, k, v = _inputs(((2, 4, 200, 64), (2, 4, 300, 64), (2, 4, 300, 64)), dtype=dtype,
                      device=device, seed=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = cft.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        summed = out.float().sum()                       # ordered after the kernel on `side`
    side.synchronize()
    assert out.dtype == dtype and out.device == q.device

    np_dtype = cft._DTYPES[dtype]()

    def arr(t):
        return cupy.from_dlpack(t.detach().view(torch.int16)).view(np_dtype)

    ref, lse = cupyflash.attention(arr(q), arr(k), arr(v), causal=True, return_lse=True)
    expected = cupyflash.attention_backward(cupy.ones_like(ref), arr(q), arr(k), arr(v), ref, lse,
                                            causal=True)
    for got, want in zip((out, *grads), (ref, *expected)):
        cupy.testing.assert_array_equal(arr(got), want)
    assert torch.equal(summed, out.float().sum())    # the side stream's sum saw the output


@pytest.mark.gpu
def test_gpu_compile_fullgraph_block_matches_eager():
    device = _cuda()
    torch.manual_seed(5)
    block = _Block(lambda q, k, v: cft.attention(q, k, v, causal=True)).double().to(device)
    x = torch.randn(2, 12, 16, dtype=torch.float64, device=device, requires_grad=True)
    eager = block(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), (x, *block.parameters()))
    out = torch.compile(block, fullgraph=True)(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *block.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-10, atol=1e-10)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
