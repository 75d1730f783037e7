"""Reference implementations: the oracle and the paper's Algorithm 1.

- :func:`naive_attention` forms the full score matrix in float64 with
  ``scipy.special.softmax``/``logsumexp``.  Every other path is tested
  against it.  With ``oracle=False`` it is instead the naive attention a user
  would write with NumPy or CuPy (the arrays' own module, the accumulator type,
  softmax in place): the baseline ``python -m cupyflash`` and its ``bench`` time.
- :func:`naive_attention_backward` is its float64 gradient, written out from
  the softmax Jacobian (and, with ``oracle=False``, the same products as a user
  would write them).
- :func:`flash_attention_v1` is a literal transcription of Algorithm 1 of
  Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
  IO-Awareness" (2022), for teaching and as an independent check.  Given CuPy
  arrays it runs the ``fwd_v1`` CUDA kernel, which follows the same loops.
"""

from __future__ import annotations

import math
import numbers
import typing

import numpy as np
import scipy.special

from ._dtypes import accumulator_dtype
from ._validation import check_forward

__all__ = ["naive_attention", "naive_attention_backward", "flash_attention_v1"]


# ---- the oracle: no code in common with the library's validation and dispatch ----------------
#
# The oracle reads its arguments itself (its own default scale, its own mask rule, its own
# broadcasting and grouping of heads), so that a mistake in cupyflash._validation, which every
# backend shares, cannot hide by being made twice.  It trusts its caller: arguments the
# library would reject give an error here too, though not necessarily the same one.
#
# The same reading serves the naive attention as a user would write it (oracle=False): the
# arrays' own module (NumPy or CuPy), the accumulator type instead of float64, the softmax in
# place on the one score matrix.  Only the arithmetic differs; the oracle's is unchanged.


class _Oracle(typing.NamedTuple):
    q: np.ndarray        # float64, (*batch, Lq, d), batch including the query heads
    k: np.ndarray        # float64, (*batch, Lk, d): each query head's own kv head
    v: np.ndarray        # float64, (*batch, Lk, dv)
    scale: float
    visible: np.ndarray | None  # bool (Lq, Lk), or (*batch, Lq, Lk) with a mask: query i may
                                 # attend to key j; None: every key
    kv_head: np.ndarray | None   # under GQA, the kv head (axis -3 of k, v) of each query head
    kv_heads: int                # under GQA, how many kv heads there are
    bias: tuple = ()             # the bias terms, each broadcast to (*batch, Lq, Lk)


def _bounds(causal, window):
    """(left, right) of the window, None for unbounded; causal caps right at 0."""
    left = right = None
    if window is not None:
        left, right = (None if w is None or w == -1 else int(w) for w in window)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _visible(lq, lk, causal, window, xp=np):
    """Query i sits at key position i + Lk - Lq (bottom-right alignment) and sees key j
    when j is no more than ``left`` keys before it and no more than ``right`` after."""
    left, right = _bounds(causal, window)
    i = xp.arange(lq)[:, None]
    j = xp.arange(lk)[None, :]
    offset = lk - lq
    bounds = []                 # each an (Lq, Lk) array: the naive peer's memory counts them
    if left is not None:
        bounds.append(j >= i + offset - left)
    if right is not None:
        bounds.append(j <= i + offset + right)
    if not bounds:
        return xp.full((lq, lk), True)
    ok = bounds.pop(0)
    for bound in bounds:
        ok &= bound
    return ok


def _common_shape(*shapes):
    """The broadcast of ``shapes``: right-aligned, each axis 1 or one common size."""
    ndim = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (ndim - len(s)) + tuple(s) for s in shapes]
    out = []
    for sizes in zip(*padded):
        others = {n for n in sizes if n != 1}
        if len(others) > 1:
            raise ValueError(f"batch dimensions do not broadcast: {shapes}")
        out.append(others.pop() if others else 1)
    return tuple(out)


def _array_module(x):
    """CuPy for a CuPy array, NumPy for anything else (NumPy arrays, lists, ...)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _bias_terms(bias):
    """``bias`` (None, one array, or a tuple of arrays) as a tuple of its terms."""
    if bias is None:
        return ()
    return tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)


def _within(batch, n, lengths, xp=np):
    """Bool (*batch, n): position < its sequence's length (the lengths broadcast to the batch
    dims before the head axis; None: every position)."""
    if lengths is None:
        return xp.ones(tuple(batch) + (n,), dtype=bool)
    seq = tuple(batch[:-1]) if batch else ()
    per_seq = xp.broadcast_to(xp.asarray(lengths), seq)
    if batch:
        per_seq = per_seq[..., None]                 # the head axis
    return xp.broadcast_to(xp.arange(n) < per_seq[..., None], tuple(batch) + (n,))


def _visible_lengths(batch, lq, lk, causal, window, q_lengths, kv_lengths, xp=np):
    """``_visible`` per sequence, (*batch, Lq, Lk): query i < q_len sees key j < kv_len in
    its window, the diagonal at i + kv_len - q_len."""
    rows, keys = _within(batch, lq, q_lengths, xp), _within(batch, lk, kv_lengths, xp)
    ql = rows.sum(axis=-1)[..., None, None]
    kl = keys.sum(axis=-1)[..., None, None]
    left, right = _bounds(causal, window)
    i = xp.arange(lq)[:, None]
    j = xp.arange(lk)[None, :]
    ok = rows[..., :, None] & keys[..., None, :]
    if left is not None:
        ok = ok & (j >= i + (kl - ql) - left)
    if right is not None:
        ok = ok & (j <= i + (kl - ql) + right)
    return ok


def _oracle(q, k, v, scale, causal, window, enable_gqa, xp=np, dtype=np.float64, masks=True,
            bias=None, mask=None, q_lengths=None, kv_lengths=None):
    """The arguments read as the oracle reads them: q, k, v as ``dtype`` arrays of ``xp``
    broadcast to one batch shape, the bias terms as ``dtype`` arrays broadcast to
    ``batch + (Lq, Lk)``, and the mask: the window's and the boolean ``mask``'s together
    (None for ``masks=False`` when nothing is masked)."""
    q, k, v = (xp.asarray(x).astype(dtype, copy=False) for x in (q, k, v))
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kv_head, hkv = None, 0
    if enable_gqa:
        hq, hkv = q.shape[-3], max(k.shape[-3], v.shape[-3])
        if hq % hkv:
            raise ValueError(f"{hq} query heads cannot share {hkv} kv heads")
        kv_head = np.arange(hq) // (hq // hkv)        # query head h reads kv head h // group
        outer = _common_shape(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        batch = outer + (hq,)
        k, v = (xp.take(xp.broadcast_to(x, outer + (hkv,) + x.shape[-2:]), xp.asarray(kv_head), axis=-3)
                for x in (k, v))
    else:
        batch = _common_shape(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (xp.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    scores_shape = batch + (q.shape[-2], k.shape[-2])
    terms = tuple(xp.broadcast_to(xp.asarray(b).astype(dtype, copy=False), scores_shape)
                  for b in _bias_terms(bias))
    visible = None
    if q_lengths is not None or kv_lengths is not None:
        visible = _visible_lengths(batch, q.shape[-2], k.shape[-2], causal, window, q_lengths, kv_lengths, xp)
        # what the padding holds must reach nothing: the oracle reads zeros there
        q = xp.where(_within(batch, q.shape[-2], q_lengths, xp)[..., None], q, 0)
        keys = _within(batch, k.shape[-2], kv_lengths, xp)[..., None]
        k, v = xp.where(keys, k, 0), xp.where(keys, v, 0)
    elif masks or _bounds(causal, window) != (None, None) or mask is not None:
        visible = _visible(q.shape[-2], k.shape[-2], causal, window, xp)
    if mask is not None:
        visible = visible & xp.broadcast_to(xp.asarray(mask, dtype=bool), scores_shape)
    return _Oracle(q, k, v, scale, visible, kv_head, hkv, terms)


def _coordinates(batch, lq, lk):
    """The oracle's (b, h, i, j) of every score, as arrays broadcasting to
    ``batch + (Lq, Lk)``: b the flat index over the dims before the head axis, h the
    head, i the query row, j the key."""
    if batch:
        seq = tuple(batch[:-1])
        b = np.arange(int(np.prod(seq)), dtype=np.int64).reshape(seq + (1, 1, 1))
        h = np.arange(batch[-1], dtype=np.int64).reshape(batch[-1], 1, 1)
    else:
        b = h = np.zeros((1, 1), dtype=np.int64)
    return b, h, np.arange(lq)[:, None], np.arange(lk)[None, :]


def _probabilities(q, k, v, /, *, scale=None, causal=False, window=None, enable_gqa=False,
                   bias=None, mask=None, q_lengths=None, kv_lengths=None, softcap=None, alibi_slopes=None,
                   score_mod=None, mask_mod=None, score_mod_grad=None, chain=False):
    """The oracle's float64 scores (scaled, capped, biased, modified, masked),
    probabilities and lse (all L x L) and its :class:`_Oracle` reading of the arguments;
    for the tests' error bounds too.  With ``chain``, also the factors the backward's dS
    takes through score_mod (``score_mod_grad``'s value) and through the softcap."""
    o = _oracle(q, k, v, scale, causal, window, enable_gqa, bias=bias, mask=mask, q_lengths=q_lengths,
                kv_lengths=kv_lengths)
    s = np.matmul(o.q, np.swapaxes(o.k, -1, -2)) * o.scale
    d_cap = d_mod = None
    if softcap is not None:             # DESIGN 3b: scale, softcap, bias + ALiBi, score_mod, masks
        t = np.tanh(s / float(softcap))
        s, d_cap = float(softcap) * t, 1.0 - t * t
    for term in o.bias:
        s = s + term
    batch, lq, lk = s.shape[:-2], s.shape[-2], s.shape[-1]
    b, h, i, j = _coordinates(batch, lq, lk)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        slopes = slopes.reshape((1,) * (len(batch) - slopes.ndim) + slopes.shape + (1, 1))
        ql = _within(batch, lq, q_lengths).sum(axis=-1)[..., None, None]
        kl = _within(batch, lk, kv_lengths).sum(axis=-1)[..., None, None]
        s = s - slopes * np.abs(i + (kl - ql) - j)
    if score_mod is not None:
        if chain:
            d_mod = np.broadcast_to(np.asarray(score_mod_grad(s, b, h, i, j), dtype=np.float64), s.shape)
        s = np.broadcast_to(np.asarray(score_mod(s, b, h, i, j), dtype=np.float64), s.shape)
    visible = o.visible
    if mask_mod is not None:
        extra = np.broadcast_to(np.asarray(mask_mod(b, h, i, j), dtype=bool), s.shape)
        visible = extra if visible is None else visible & extra
    s = np.where(visible, s, -np.inf) if visible is not None else s
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = scipy.special.logsumexp(s, axis=-1)
        # softmax reduces with max(), which has no identity on an empty key axis (Lk = 0)
        p = scipy.special.softmax(s, axis=-1) if s.shape[-1] else np.zeros_like(s)
    # rows with no admissible key (all -inf: masked, or a -inf bias) -> 0, not NaN; a NaN
    # score (NaN in q, k or a bias) keeps its row NaN
    p = np.where(np.all(np.isneginf(s), axis=-1, keepdims=True), 0.0, p)
    if chain:
        return s, p, lse, o, (d_cap, d_mod)
    return s, p, lse, o


def _reduce_to(grad, like, kv_head=None, kv_heads=0):
    """The gradient ``grad`` of a broadcast (and, under GQA, head-gathered) operand summed
    back onto the operand's own shape ``like``."""
    if kv_head is not None:       # every query head's part onto the kv head it read, in order
        heads = _array_module(grad).zeros(grad.shape[:-3] + (kv_heads,) + grad.shape[-2:], grad.dtype)
        for h, kv in enumerate(kv_head.tolist()):
            heads[..., kv, :, :] += grad[..., h, :, :]
        grad = heads
    if grad.shape == tuple(like):
        return grad
    grad = grad.sum(axis=tuple(range(grad.ndim - len(like))))
    axes = tuple(a for a, n in enumerate(like) if n == 1 and grad.shape[a] != 1)
    return grad.sum(axis=axes, keepdims=True)


def naive_attention(q, k, v, /, *, scale=None, causal=False, window=None, enable_gqa=False,
                    return_lse=False, oracle=True, bias=None, mask=None, q_lengths=None,
                    kv_lengths=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None):
    """Attention computed the obvious way, in float64: the oracle.

    Forms the full ``(..., Lq, Lk)`` score matrix, so it needs O(Lq·Lk)
    memory.  Arguments and semantics are those of :func:`cupyflash.attention`;
    the result is always float64 (NumPy arrays only).  It shares no code with
    the library's argument checks: its mask rule, default scale, broadcasting
    and head grouping are written out here a second time.

    Parameters
    ----------
    q, k, v, scale, causal, window, enable_gqa, return_lse, bias, mask, q_lengths, kv_lengths
        As in :func:`cupyflash.attention` (``q_lengths``/``kv_lengths``: the oracle only).
    softcap, alibi_slopes
        As in :func:`cupyflash.attention` (the oracle only).
    score_mod, mask_mod : callable, optional
        The oracle's own form of :func:`cupyflash.attention`'s expressions: NumPy
        functions on the whole score matrix, ``score_mod(s, b, h, i, j)`` and
        ``mask_mod(b, h, i, j)``, with ``b`` (flat batch index), ``h`` (head), ``i``
        (query) and ``j`` (key) arrays that broadcast to ``batch + (Lq, Lk)`` (the oracle
        only; the tests pair each expression with such a function written by hand).
    oracle : bool, default True
        False: not the oracle but naive attention as a user would write it --
        with the arrays' own module (NumPy or CuPy), scores in the accumulator
        type (float64 for float64 inputs, float32 for the others), the softmax
        done in place on the one score matrix, the result in q's dtype and the
        lse in the accumulator type.  This is the naive peer that
        ``python -m cupyflash`` and ``python -m cupyflash bench`` time.

    Returns
    -------
    out : numpy.ndarray
        ``(..., Lq, dv)`` float64 (``oracle=False``: q's dtype and array type).
    lse : numpy.ndarray
        ``(..., Lq)`` float64, only if ``return_lse``.

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash.reference import naive_attention
    >>> q = k = v = np.eye(2)
    >>> naive_attention(q, k, v, scale=0.0)        # uniform weights
    array([[0.5, 0.5],
           [0.5, 0.5]])

    As a user would write it, in float32 for float32 inputs:

    >>> naive_attention(*(x.astype(np.float32) for x in (q, k, v)), scale=0.0, oracle=False)
    array([[0.5, 0.5],
           [0.5, 0.5]], dtype=float32)
    """
    _check_oracle(oracle)
    if not oracle and (q_lengths is not None or kv_lengths is not None):
        raise ValueError("q_lengths/kv_lengths: the oracle only (oracle=True)")
    mods = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod)
    if not oracle and any(x is not None for x in mods.values()):
        raise ValueError("softcap, alibi_slopes, score_mod, mask_mod: the oracle only (oracle=True)")
    if not oracle:
        p, lse, o = _as_written(q, k, v, scale, causal, window, enable_gqa, bias, mask)
        out = _array_module(p).matmul(p, o.v).astype(_dtype_of(q), copy=False)
        return (out, lse) if return_lse else out
    _, p, lse, o = _probabilities(q, k, v, scale=scale, causal=causal, window=window,
                                  enable_gqa=enable_gqa, bias=bias, mask=mask, q_lengths=q_lengths,
                                  kv_lengths=kv_lengths, **mods)
    out = np.matmul(p, o.v)
    return (out, lse) if return_lse else out


def _check_oracle(oracle):
    if not isinstance(oracle, (bool, np.bool_)):
        raise TypeError(f"`oracle` must be a bool, got {type(oracle).__name__}")


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _as_written(q, k, v, scale, causal, window, enable_gqa, bias=None, mask=None):
    """Naive attention as a user would write it (``oracle=False``): the probabilities
    (softmax in place on the scaled, masked scores), the lse, both in the accumulator
    type of q's dtype, and the operands, read as the oracle reads them."""
    xp = _array_module(q)
    acc = accumulator_dtype(_dtype_of(q))
    o = _oracle(q, k, v, scale, causal, window, enable_gqa, xp=xp, dtype=acc, masks=False,
                bias=bias, mask=mask)
    s = xp.matmul(o.q, o.k.swapaxes(-1, -2))
    s *= acc.type(o.scale)
    for term in o.bias:
        s += term
    if mask is not None:        # a broadcast view of the caller's mask: negate a copy
        xp.copyto(s, -xp.inf, where=xp.logical_not(o.visible))
    elif o.visible is not None:   # the mask is the peer's own: negated in place
        xp.copyto(s, -xp.inf, where=xp.logical_not(o.visible, out=o.visible))
    if s.shape[-1]:
        top = s.max(axis=-1, keepdims=True)
        top = xp.where(top == -xp.inf, acc.type(0), top)   # a row with no admissible key
    else:                                                   # (or no key at all)
        top = xp.zeros(s.shape[:-1] + (1,), acc)
    s -= top
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    s /= xp.where(total > 0, total, acc.type(1))          # ... is all zeros, never NaN
    with np.errstate(divide="ignore"):
        lse = (top + xp.log(total))[..., 0]
    return s, lse, o


def naive_attention_backward(dout, q, k, v, /, *, scale=None, causal=False, window=None,
                             enable_gqa=False, oracle=True, bias=None, mask=None, q_lengths=None,
                             kv_lengths=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None,
                             score_mod_grad=None):
    """Gradients of :func:`naive_attention` in float64: ``(dq, dk, dv)``, and
    ``dbias`` with ``bias``.

    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = scale·dS K,
    dK = scale·dSᵀ Q, dbias = dS; broadcast and grouped heads are summed back to
    the shapes of k and v, and dS over each bias term's broadcast axes.

    Parameters
    ----------
    dout : numpy.ndarray, shape (..., Lq, dv)
        Gradient of the loss with respect to the attention output.
    q, k, v, scale, causal, window, enable_gqa, bias, mask, q_lengths, kv_lengths
        As in :func:`cupyflash.attention` (``q_lengths``/``kv_lengths``: the oracle only;
        dout's padded rows are read as zeros).
    softcap, alibi_slopes, score_mod, mask_mod
        As in :func:`naive_attention` (the oracle only).
    score_mod_grad : callable, optional
        With ``score_mod``: its derivative with respect to the score, ``(s, b, h, i,
        j)`` as ``score_mod`` (written by hand: the oracle derives nothing).  dS is
        multiplied by it before it becomes dbias, and by the softcap's ``1 - tanh^2``
        before dq and dk.
    oracle : bool, default True
        False: the backward as a user would write it, the peer of
        ``naive_attention(..., oracle=False)``: the probabilities recomputed in
        the accumulator type with the arrays' own module, then four products
        (rowsum(dO ∘ O) taken as rowsum(P ∘ dP), which needs no O), the
        gradients in q's dtype.

    Returns
    -------
    dq, dk, dv : numpy.ndarray
        float64, with the shapes of q, k and v (``oracle=False``: q's dtype and
        array type).
    dbias : numpy.ndarray or tuple
        Only with ``bias``: like ``bias`` (one array, or a tuple in its order),
        each term's gradient with that term's shape (float64; ``oracle=False``:
        the accumulator type).

    Examples
    --------
    The gradient of ``sum(out)`` with respect to v: each key's row gets the
    total weight the queries gave it, here 1/2 from each of two queries.

    >>> import numpy as np
    >>> from cupyflash.reference import naive_attention_backward
    >>> q = k = v = np.eye(2)
    >>> dq, dk, dv = naive_attention_backward(np.ones((2, 2)), q, k, v, scale=0.0)
    >>> dv
    array([[1., 1.],
           [1., 1.]])
    >>> dq
    array([[0., 0.],
           [0., 0.]])
    """
    _check_oracle(oracle)
    if not oracle and (q_lengths is not None or kv_lengths is not None):
        raise ValueError("q_lengths/kv_lengths: the oracle only (oracle=True)")
    mods = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod)
    if not oracle and any(x is not None for x in mods.values()):
        raise ValueError("softcap, alibi_slopes, score_mod, mask_mod: the oracle only (oracle=True)")
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("`score_mod` needs `score_mod_grad` (the oracle's backward derives nothing)")
    if not oracle:
        return _as_written_backward(dout, q, k, v, scale, causal, window, enable_gqa, bias, mask)
    _, p, _, o, (d_cap, d_mod) = _probabilities(
        q, k, v, scale=scale, causal=causal, window=window, enable_gqa=enable_gqa, bias=bias, mask=mask,
        q_lengths=q_lengths, kv_lengths=kv_lengths, score_mod_grad=score_mod_grad, chain=True, **mods)
    do = np.broadcast_to(np.asarray(dout).astype(np.float64), p.shape[:-1] + (o.v.shape[-1],))
    if q_lengths is not None:
        do = np.where(_within(p.shape[:-2], p.shape[-2], q_lengths)[..., None], do, 0)
    out = np.matmul(p, o.v)
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(o.v, -1, -2))
    ds = p * (dp - np.sum(do * out, axis=-1, keepdims=True))
    if d_mod is not None:               # through score_mod; a pair with P = 0 has no gradient
        with np.errstate(invalid="ignore"):
            ds = np.where(p > 0, ds * d_mod, 0.0)
    dbias = None if bias is None else _bias_gradient(ds, bias)
    if d_cap is not None:               # through the softcap (not the bias: it comes after)
        ds = ds * d_cap
    dq = np.matmul(ds, o.k) * o.scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), o.q) * o.scale
    grads = (_reduce_to(dq, np.shape(q)), _reduce_to(dk, np.shape(k), o.kv_head, o.kv_heads),
             _reduce_to(dv, np.shape(v), o.kv_head, o.kv_heads))
    return grads if bias is None else grads + (dbias,)


def _bias_gradient(ds, bias):
    """dS summed onto each bias term's shape, structured like ``bias``."""
    terms = tuple(_reduce_to(ds, np.shape(b)).reshape(np.shape(b)) for b in _bias_terms(bias))
    return terms if isinstance(bias, (tuple, list)) else terms[0]


def _as_written_backward(dout, q, k, v, scale, causal, window, enable_gqa, bias=None, mask=None):
    p, _, o = _as_written(q, k, v, scale, causal, window, enable_gqa, bias, mask)
    xp, acc = _array_module(p), p.dtype
    do = xp.broadcast_to(xp.asarray(dout).astype(acc, copy=False), p.shape[:-1] + (o.v.shape[-1],))
    dv = xp.matmul(p.swapaxes(-1, -2), do)
    ds = xp.matmul(do, o.v.swapaxes(-1, -2))                # dP, then in place dS
    ds -= (p * ds).sum(axis=-1, keepdims=True)             # rowsum(P ∘ dP) = rowsum(dO ∘ O)
    ds *= p
    dbias = None if bias is None else _bias_gradient(ds, bias)
    ds *= acc.type(o.scale)
    dq = xp.matmul(ds, o.k)
    dk = xp.matmul(ds.swapaxes(-1, -2), o.q)
    dtype = _dtype_of(q)
    grads = (_reduce_to(dq, np.shape(q)).astype(dtype, copy=False),
             _reduce_to(dk, np.shape(k), o.kv_head, o.kv_heads).astype(dtype, copy=False),
             _reduce_to(dv, np.shape(v), o.kv_head, o.kv_heads).astype(dtype, copy=False))
    return grads if dbias is None else grads + (dbias,)


def _window_mask(problem):
    """Algorithm 1's mask: boolean (Lq, Lk), True where query i may attend to key j."""
    lq, lk = problem.seqlen_q, problem.seqlen_k
    diff = np.arange(lk)[None, :] - np.arange(lq)[:, None] - (lk - lq)
    ok = np.ones((lq, lk), dtype=bool)
    if problem.window_left is not None:
        ok &= diff >= -problem.window_left
    if problem.window_right is not None:
        ok &= diff <= problem.window_right
    return ok


def _algorithm1(q, k, v, sram_size, scale, mask):
    """Algorithm 1 for one head: q (N_q, d), k (N_k, d), v (N_k, dv), float64.

    Returns (O, lse).  The comments number the lines of the paper's
    Algorithm 1.  The paper assumes N_q = N_k and no mask; masked scores are
    -inf here, and a row that has seen no admissible key yet keeps m = -inf
    and ℓ = 0 (its update factors are taken as 0, never NaN).
    """
    n_q, d = q.shape
    n_k = k.shape[0]
    # 1: block sizes from the on-chip memory size M (in elements): the four
    #    tiles Q_i, K_j, V_j, O_i of about Bc x d elements each must fit in M.
    b_c = math.ceil(sram_size / (4 * d))
    b_r = min(math.ceil(sram_size / (4 * d)), d)
    # 2: initialise O = 0, ℓ = 0, m = -inf in "HBM" (here: ordinary arrays).
    O = np.zeros((n_q, v.shape[1]))
    ell = np.zeros(n_q)
    m = np.full(n_q, -np.inf)
    # 3-4: Q, O, ℓ, m are split into T_r blocks of B_r rows; K, V into T_c blocks of B_c rows.
    t_r, t_c = math.ceil(n_q / b_r), math.ceil(n_k / b_c)
    for j in range(t_c):                                        # 5: outer loop over K/V blocks
        kj = k[j * b_c:(j + 1) * b_c]                          # 6: load K_j, V_j to SRAM
        vj = v[j * b_c:(j + 1) * b_c]
        for i in range(t_r):                                    # 7: inner loop over Q blocks
            rows = slice(i * b_r, (i + 1) * b_r)
            qi, oi, li, mi = q[rows], O[rows], ell[rows], m[rows]   # 8: load Q_i, O_i, ℓ_i, m_i
            s = scale * (qi @ kj.T)                             # 9: S_ij = Q_i K_jᵀ (scaled)
            s = np.where(mask[rows, j * b_c:(j + 1) * b_c], s, -np.inf)
            m_tilde = s.max(axis=1)                             # 10: m~_ij = rowmax(S_ij)
            seen = np.isfinite(m_tilde)
            p_tilde = np.exp(s - np.where(seen, m_tilde, 0)[:, None])  # P~_ij = exp(S_ij - m~_ij)
            l_tilde = p_tilde.sum(axis=1)                       #     ℓ~_ij = rowsum(P~_ij)
            m_new = np.maximum(mi, m_tilde)                     # 11: m_i^new = max(m_i, m~_ij)
            with np.errstate(invalid="ignore"):
                a_old = np.where(np.isfinite(mi), np.exp(mi - m_new), 0.0)      # e^{m_i - m_new}
                a_new = np.where(seen, np.exp(m_tilde - m_new), 0.0)          # e^{m~_ij - m_new}
            l_new = a_old * li + a_new * l_tilde                #     ℓ_i^new
            safe = np.where(l_new > 0, l_new, 1.0)
            # 12: O_i <- diag(ℓ_new)^-1 (diag(ℓ_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~_ij V_j)
            O[rows] = ((li * a_old)[:, None] * oi + a_new[:, None] * (p_tilde @ vj)) / safe[:, None]
            ell[rows], m[rows] = l_new, m_new                   # 13: write ℓ_i, m_i back
    with np.errstate(divide="ignore"):
        lse = np.where(ell > 0, m + np.log(np.where(ell > 0, ell, 1.0)), -np.inf)
    return O, lse                                               # 16: return O


def flash_attention_v1(q, k, v, /, *, sram_size, scale=None, causal=False, window=None,
                       enable_gqa=False, return_lse=False, backend="auto"):
    """FlashAttention's Algorithm 1, literally: K/V blocks outer, Q blocks inner.

    Parameters
    ----------
    q, k, v, scale, causal, window, enable_gqa, return_lse
        As in :func:`cupyflash.attention`.
    sram_size : int
        The on-chip memory size M of the paper, in elements.  Block sizes are
        ``Bc = ceil(M / 4d)`` and ``Br = min(ceil(M / 4d), d)``.
    backend : {'auto', 'numpy', 'cuda', 'emulator'}, default 'auto'
        'numpy' runs the commented Python transcription (float64 internally,
        result cast to the input dtype); 'cuda' (the default for CuPy arrays)
        runs the ``fwd_v1`` kernel; 'emulator' runs that kernel on the CPU
        emulator.

    Returns
    -------
    out : array
        ``(..., Lq, dv)``, the dtype of q.
    lse : array
        ``(..., Lq)`` float32 (float64 for float64 inputs), only if ``return_lse``.

    Examples
    --------
    >>> import numpy as np
    >>> from cupyflash.reference import flash_attention_v1, naive_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> out = flash_attention_v1(q, k, v, sram_size=32)       # Bc = 2, Br = 2
    >>> bool(np.allclose(out, naive_attention(q, k, v)))
    True
    """
    if isinstance(sram_size, (bool, np.bool_)) or not isinstance(sram_size, numbers.Integral):
        raise TypeError(f"`sram_size` must be an integer, got {type(sram_size).__name__}")
    problem, _ = check_forward(q, k, v, scale=scale, causal=causal, window=window,
                               enable_gqa=enable_gqa, backend=backend)
    if int(sram_size) < 4 * problem.head_dim:
        raise ValueError(
            f"`sram_size` must hold at least one row of each of the four tiles (4·d = "
            f"{4 * problem.head_dim} elements); got {sram_size}"
        )
    if problem.backend != "numpy":
        from ._dispatch import run_forward_v1

        return run_forward_v1(problem, int(sram_size), return_lse)
    out = np.empty(problem.out_shape, dtype=problem.dtype)
    lse = np.empty(problem.lse_shape, dtype=problem.accum_dtype)
    mask = _window_mask(problem)
    g = problem.gqa_ratio
    kv_batch = problem.batch_shape[:-1] + (problem.batch_shape[-1] // g,) if g > 1 else problem.batch_shape
    q_full = np.broadcast_to(q, problem.batch_shape + q.shape[-2:])
    k_full = np.broadcast_to(k, kv_batch + k.shape[-2:])
    v_full = np.broadcast_to(v, kv_batch + v.shape[-2:])
    for idx in np.ndindex(*problem.batch_shape):
        kv_idx = idx[:-1] + (idx[-1] // g,) if g > 1 else idx
        k_b, v_b = k_full[kv_idx], v_full[kv_idx]
        o, l = _algorithm1(q_full[idx].astype(np.float64), k_b.astype(np.float64),
                           v_b.astype(np.float64), int(sram_size), problem.scale, mask)
        out[idx] = o
        lse[idx] = l
    return (out, lse) if return_lse else out
