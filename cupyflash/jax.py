"""cupyflash for JAX: :func:`attention` on JAX arrays, differentiable, under ``jit`` and ``vmap``.

``import cupyflash.jax as cfj`` needs JAX (``pip install "cupyflash[jax]"``);
``import cupyflash`` alone never imports it.

The function is a ``jax.custom_vjp`` whose forward and backward call
:func:`cupyflash.attention` and :func:`cupyflash.attention_backward` through
``jax.pure_callback`` on NumPy arrays on the host.  On the CPU the callback
reads XLA's buffers without copying them and its results are copied once into
XLA's; on a GPU every call copies its inputs to the host and its results back
(a round trip through host memory), and computes on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    raise ImportError(
        'cupyflash.jax needs JAX; install it with: pip install "cupyflash[jax]"'
    ) from exc

import numpy as np

from . import _adapters
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward

__all__ = ["attention"]


def attention(q, k, v, /, *, scale=None, causal=False, window=None, enable_gqa=False,
              precision="ieee", deterministic=True, backend="auto", **unsupported):
    """:func:`cupyflash.attention` on JAX arrays, differentiable in q, k and v.

    Parameters
    ----------
    q, k, v : jax.Array
        Shapes ``(..., Lq, d)``, ``(..., Lk, d)``, ``(..., Lk, dv)``; one dtype
        (float16, bfloat16, float32, or float64 with ``jax_enable_x64``).
        NumPy arrays are taken too.
    scale, causal, window, enable_gqa, precision
        As for :func:`cupyflash.attention` (``causal`` is aligned to the
        bottom-right corner).
    deterministic : bool, default True
        Passed to :func:`cupyflash.attention_backward` by the backward.
    backend : {'auto', 'numpy', 'emulator'}, default 'auto'
        The backend the host callback runs ('auto' is 'numpy').

    Returns
    -------
    out : jax.Array, shape (..., Lq, dv)
        In the inputs' dtype.  Differentiable once (``jax.grad``, ``jax.vjp``;
        gradients are summed over broadcast batch dims and, with
        ``enable_gqa``, over each group's query heads); works under
        ``jax.jit`` and ``jax.vmap``.

    Raises
    ------
    TypeError
        Arguments that are not arrays, a ``backend`` of 'cuda', and any
        keyword not listed above (``return_lse`` and ``out`` of
        :func:`cupyflash.attention` included).
    ValueError
        As :func:`cupyflash.attention`, when the call is traced.

    See Also
    --------
    cupyflash.attention : the function on NumPy and CuPy arrays.

    Notes
    -----
    ``jax.nn.dot_product_attention(..., is_causal=True)`` aligns its mask to
    the top-left corner, ``causal=True`` here to the bottom-right one; the two
    agree when ``Lq == Lk``.  That function uses the ``(batch, L, heads, d)``
    layout; this one ``(..., L, d)``, i.e. ``(batch, heads, L, d)``.

    Under ``vmap`` the callback runs once on the whole batch
    (``vmap_method="broadcast_all"``: an unbatched argument is broadcast to
    the batch in memory first).  On a GPU each call copies q, k, v to the
    host and the result back; the backward copies dout, q, k, v, out and lse
    to the host and the gradients back.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import cupyflash.jax as cfj
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 4, 16, 8))
    >>> out = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))(q, k, v)
    >>> dq = jax.grad(lambda q: cfj.attention(q, k, v).sum())(q)
    >>> out.shape, dq.shape
    ((2, 4, 16, 8), (2, 4, 16, 8))
    """
    _adapters.reject_keywords("cupyflash.jax.attention", unsupported)
    arrays = {"q": q, "k": k, "v": v}
    for name, x in arrays.items():
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"`{name}` must be a JAX array, got {type(x).__module__}.{type(x).__name__}")
    if backend == "cuda":
        raise TypeError("cupyflash.jax computes on the host (NumPy arrays): backend must be "
                        "'auto', 'numpy' or 'emulator'; got 'cuda'")
    q, k, v = (jnp.asarray(x) for x in arrays.values())
    _, options = _adapters.check_call(
        [x.shape for x in (q, k, v)], [np.dtype(x.dtype) for x in (q, k, v)],
        scale=scale, causal=causal, window=window, enable_gqa=enable_gqa, precision=precision,
        deterministic=deterministic, backend=backend,
        check_backend="numpy" if backend == "auto" else backend)
    return _differentiable(q, k, v, options)


def _host_forward(options, q, k, v):
    return _attention(np.asarray(q), np.asarray(k), np.asarray(v), return_lse=True,
                      **_host_keywords(options).forward_keywords())


def _host_backward(options, dout, q, k, v, out, lse):
    return _attention_backward(*(np.asarray(x) for x in (dout, q, k, v, out, lse)),
                               **_host_keywords(options).backward_keywords())


def _host_keywords(options: _adapters.Options) -> _adapters.Options:
    return dataclasses.replace(options, backend="numpy" if options.backend == "auto" else options.backend)


def _results(q, k, v, options):
    """Shapes and dtypes of the forward's (out, lse) for q, k and v as traced."""
    problem, _ = _adapters.check_call(
        [x.shape for x in (q, k, v)], [np.dtype(x.dtype) for x in (q, k, v)],
        **options.backward_keywords(), check_backend="numpy")
    return (jax.ShapeDtypeStruct(problem.out_shape, q.dtype),
            jax.ShapeDtypeStruct(problem.lse_shape, problem.accum_dtype))


def _forward(q, k, v, options):
    out, lse = jax.pure_callback(functools.partial(_host_forward, options),
                                 _results(q, k, v, options), q, k, v,
                                 vmap_method="broadcast_all")
    return out, (q, k, v, out, lse)


def _backward(options, residuals, dout):
    q, k, v, out, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return jax.pure_callback(functools.partial(_host_backward, options), shapes,
                             dout, q, k, v, out, lse, vmap_method="broadcast_all")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _differentiable(q, k, v, options):
    return _forward(q, k, v, options)[0]


_differentiable.defvjp(_forward, _backward)
