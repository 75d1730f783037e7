"""cupyflash for PyTorch: :func:`attention` on tensors, with autograd and ``torch.compile``.

``import cupyflash.torch as cft`` needs PyTorch (``pip install "cupyflash[torch]"``);
``import cupyflash`` alone never imports it.

The forward and the backward are two operators registered with
``torch.library.custom_op`` -- ``cupyflash::attention_forward`` and
``cupyflash::attention_backward`` -- with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces them without graph breaks, and the
forward's autograd formula calls the backward operator.  CPU tensors run the
NumPy path on views of their memory (bfloat16 through ``ml_dtypes``); CUDA
tensors run the kernels on views taken through DLPack, on PyTorch's current
stream.  The backward keeps q, k, v, the output and its log-sum-exp: O(L)
memory per (batch, head) beyond the inputs and output.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:
    raise ImportError(
        'cupyflash.torch needs PyTorch; install it with: pip install "cupyflash[torch]"'
    ) from exc

import numpy as np

from . import _adapters
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward
from ._validation import SUPPORTED_DTYPES

__all__ = ["attention"]

def attention(q, k, v, /, *, scale=None, causal=False, window=None, enable_gqa=False,
              precision="ieee", deterministic=True, backend="auto", **unsupported):
    """:func:`cupyflash.attention` on PyTorch tensors, differentiable in q, k and v.

    Parameters
    ----------
    q, k, v : torch.Tensor
        Shapes ``(..., Lq, d)``, ``(..., Lk, d)``, ``(..., Lk, dv)``; one dtype
        (float16, bfloat16, float32 or float64), one device (CPU or CUDA); any
        strides, broadcast batch dims (e.g. ``expand``) included.
    scale, causal, window, enable_gqa, precision
        As for :func:`cupyflash.attention` (``causal`` is aligned to the
        bottom-right corner).
    deterministic : bool, default True
        Passed to :func:`cupyflash.attention_backward` by the backward.
    backend : {'auto', 'numpy', 'emulator', 'cuda'}, default 'auto'
        'numpy' or 'emulator' for CPU tensors, 'cuda' for CUDA tensors.

    Returns
    -------
    out : torch.Tensor, shape (..., Lq, dv)
        On the inputs' device, in their dtype.  Gradients flow to q, k and v
        (summed over broadcast batch dims and, with ``enable_gqa``, over each
        group's query heads); a second derivative raises ``RuntimeError``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, tensors on different devices or of an
        unsupported dtype, a ``backend`` that does not take the tensors' device,
        and any keyword not listed above (``return_lse`` and ``out`` of
        :func:`cupyflash.attention` included).
    ValueError
        As :func:`cupyflash.attention`.  Under ``torch.compile`` these checks
        run when the call is traced, and PyTorch reports them wrapped in its
        own error (with this message).

    See Also
    --------
    cupyflash.attention : the function on NumPy and CuPy arrays.

    Notes
    -----
    The operators ``torch.ops.cupyflash.attention_forward`` (returning
    ``(out, lse)``) and ``torch.ops.cupyflash.attention_backward`` are
    registered on import.  Unlike ``scaled_dot_product_attention``'s
    ``is_causal``, ``causal=True`` is aligned to the bottom-right corner; the
    two agree when ``Lq == Lk``.

    Examples
    --------
    >>> import torch
    >>> import cupyflash.torch as cft
    >>> q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    ...            for _ in range(3))
    >>> out = cft.attention(q, k, v, causal=True)      # (batch, heads, L, d)
    >>> out.sum().backward()
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, ref, rtol=0, atol=1e-12), q.grad.shape
    (True, torch.Size([2, 4, 16, 8]))
    """
    _adapters.reject_keywords("cupyflash.torch.attention", unsupported)
    options = _adapters.Options(scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
                                precision=precision, deterministic=deterministic,
                                backend=backend)
    _check_tensors(q, k, v, backend)
    if not torch.compiler.is_compiling():   # when compiling, the fake implementation checks
        _, options = _check_call((q, k, v), options)
    out, _ = torch.ops.cupyflash.attention_forward(q, k, v, *_op_arguments(options))
    return out


def _check_tensors(q, k, v, backend) -> None:
    """What the library cannot check on NumPy placeholders: types, devices, dtypes."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    devices = {name: str(t.device) for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise TypeError(f"`q`, `k` and `v` must be on one device; got {devices}")
    device = q.device.type
    if device not in ("cpu", "cuda"):
        raise TypeError(f"cupyflash.torch takes CPU or CUDA tensors; got device {devices['q']!r}")
    if device == "cpu" and backend == "cuda":
        raise TypeError("backend='cuda' needs CUDA tensors; got CPU tensors (use .cuda())")
    if device == "cuda" and backend in ("numpy", "emulator"):
        raise TypeError(f"backend={backend!r} needs CPU tensors; got CUDA tensors (use .cpu())")
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"`{name}` must have dtype {SUPPORTED_DTYPES}; got {t.dtype}")


def _check_call(tensors, options: _adapters.Options):
    """The library's checks of a call on tensors of these shapes and dtypes: its
    problem and the checked options (see :func:`cupyflash._adapters.check_call`).

    The CUDA backend is checked as the NumPy one is (an unknown backend name too);
    its own limits (head dims up to 256) are checked when it runs.
    """
    backend = "numpy" if options.backend in ("auto", "cuda") else options.backend
    return _adapters.check_call(
        [tuple(int(n) for n in t.shape) for t in tensors], [_DTYPES[t.dtype]() for t in tensors],
        check_backend=backend, **options.backward_keywords())


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


# torch dtype -> the NumPy dtype of the library's arrays (bfloat16's from ml_dtypes, on demand)
_DTYPES = {torch.float16: lambda: np.dtype(np.float16), torch.bfloat16: _bfloat16,
           torch.float32: lambda: np.dtype(np.float32), torch.float64: lambda: np.dtype(np.float64)}


def _op_arguments(options: _adapters.Options) -> tuple:
    """The operators' non-tensor arguments, in their schema's order (an unbounded
    window side is -1, as for :func:`cupyflash.attention`)."""
    window = options.window if options.window is not None else (-1, -1)
    left, right = (-1 if w is None else w for w in window)
    return (options.scale, options.causal, left, right, options.enable_gqa, options.precision,
            options.deterministic, options.backend)


def _options(scale, causal, window_left, window_right, enable_gqa, precision, deterministic,
             backend) -> _adapters.Options:
    """The inverse of :func:`_op_arguments`."""
    window = None if window_left == window_right == -1 else (window_left, window_right)
    return _adapters.Options(scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
                             precision=precision, deterministic=deterministic, backend=backend)


# ---- zero-copy views between tensors and the library's arrays ----------------------------

class _Host:
    """CPU tensors <-> NumPy arrays sharing their memory."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def to_array(t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_bfloat16())
        return t.numpy()

    @staticmethod
    def to_tensor(a):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


class _Device:
    """CUDA tensors <-> CuPy arrays through DLPack, with CuPy on the tensors' device and
    on PyTorch's current stream there for as long as the context is entered."""

    def __init__(self, device):
        import cupy

        self._cupy = cupy
        self._device = cupy.cuda.Device(device.index)
        stream = torch.cuda.current_stream(device)
        self._stream = cupy.cuda.ExternalStream(stream.cuda_stream, device.index)

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        return self._device.__exit__(*exc)

    def to_array(self, t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return self._cupy.from_dlpack(t.view(torch.int16)).view(_bfloat16())
        return self._cupy.from_dlpack(t)

    def to_tensor(self, a):
        if a.dtype.name == "bfloat16":
            return torch.from_dlpack(a.view(self._cupy.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)


def _views(t):
    return _Device(t.device) if t.device.type == "cuda" else _Host()


# ---- the operators -----------------------------------------------------------------------

_ACCUM = {"float32": torch.float32, "float64": torch.float64}


@torch.library.custom_op("cupyflash::attention_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool,
             window_left: int, window_right: int, enable_gqa: bool, precision: str,
             deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(scale, causal, window_left, window_right, enable_gqa, precision,
                       deterministic, backend)
    with _views(q) as views:
        out, lse = _attention(*map(views.to_array, (q, k, v)), return_lse=True,
                              **options.forward_keywords())
        return views.to_tensor(out), views.to_tensor(lse)


@_forward.register_fake
def _forward_fake(q, k, v, *arguments):
    problem, _ = _check_call((q, k, v), _options(*arguments))
    return (q.new_empty(problem.out_shape),
            q.new_empty(problem.lse_shape, dtype=_ACCUM[problem.accum_dtype.name]))


@torch.library.custom_op("cupyflash::attention_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, scale: float | None, causal: bool,
              window_left: int, window_right: int, enable_gqa: bool, precision: str,
              deterministic: bool, backend: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(scale, causal, window_left, window_right, enable_gqa, precision,
                       deterministic, backend)
    with _views(q) as views:
        grads = _attention_backward(*map(views.to_array, (dout, q, k, v, out, lse)),
                                    **options.backward_keywords())
        return tuple(views.to_tensor(g) for g in grads)


@_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *arguments = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.arguments = arguments
    ctx.mark_non_differentiable(lse)


def _forward_grad(ctx, dout, dlse):
    # lse is not an output of attention(): its gradient is None or zeros, and is dropped
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cupyflash.attention_backward(dout, q, k, v, out, lse, *ctx.arguments)
    return (dq, dk, dv) + (None,) * len(ctx.arguments)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "cupyflash.torch.attention is differentiable once: its backward "
        "(cupyflash::attention_backward) has no derivative, so double backward "
        "(create_graph=True, Hessians, gradient penalties) is not supported"
    )


_forward.register_autograd(_forward_grad, setup_context=_setup_context)
_backward.register_autograd(_no_double_backward)
