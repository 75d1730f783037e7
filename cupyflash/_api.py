"""The public functions: :func:`attention` and :func:`attention_backward`."""

from __future__ import annotations

import numpy as np

from ._dispatch import run_backward, run_forward
from ._options import KernelOptions
from ._validation import check_backward, check_forward, check_output, check_precision

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "run_attention",
           "run_attention_backward"]


def attention(q, k, v, /, *, scale=None, causal=False, window=None, enable_gqa=False,
              return_lse=False, out=None, precision="ieee", backend="auto", bias=None, mask=None,
              q_lengths=None, kv_lengths=None, block_table=None, softcap=None, alibi_slopes=None,
              score_mod=None, mask_mod=None, mod_args=None):
    """Exact scaled dot-product attention, ``softmax(q kᵀ · scale) v``, without the score matrix.

    Computes FlashAttention-style: the ``(..., Lq, Lk)`` scores and
    probabilities are never stored; key/value blocks are streamed with an
    online softmax.  NumPy arrays run on the CPU, CuPy arrays on the GPU.

    Parameters
    ----------
    q : array, shape (..., Lq, d)
        Queries.  NumPy or CuPy (or any CUDA array CuPy takes zero-copy,
        e.g. a PyTorch CUDA tensor; the result is then a CuPy array).
    k : array, shape (..., Lk, d)
        Keys.
    v : array, shape (..., Lk, dv)
        Values.  The leading (batch) dims of q, k and v broadcast like NumPy's,
        so a key/value head axis of size 1 gives multi-query attention.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(d)``.  Must be finite.
    causal : bool, default False
        Causal mask aligned to the bottom-right corner: query ``i`` sees key
        ``j`` iff ``j <= i + Lk - Lq`` (as FlashAttention >= 2.1; PyTorch's and
        JAX's ``is_causal`` are top-left aligned, which differs when Lq != Lk).
    window : (int or None, int or None), optional
        Local attention ``(left, right)``: query ``i`` sees key ``j`` iff
        ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``.  ``None`` or ``-1``
        leaves that side unbounded.  With ``causal=True`` right is capped at 0.
    enable_gqa : bool, default False
        Grouped-query attention: q has ``Hq`` heads on axis -3, k and v
        ``Hkv`` with ``Hq % Hkv == 0``; query head ``h`` uses kv head
        ``h // (Hq // Hkv)``.
    return_lse : bool, default False
        Also return the log-sum-exp of each query row's scaled, biased, masked scores.
    out : array, optional
        Preallocated output of shape ``(..., Lq, dv)`` and the input dtype;
        any strides.  Filled and returned.
    precision : {'ieee', 'tf32', 'tf32x3'}, default 'ieee'
        float32 inputs only.  'ieee' computes in IEEE float32.  'tf32' and
        'tf32x3' allow the GPU to use the TF32 tensor cores (sm_80 and newer,
        ``d == dv <= 128``, ``scale`` above about 1e-38): 'tf32' rounds q, k, v and the
        probabilities to TF32 (10 mantissa bits; outputs good to about 1e-3
        relative), 'tf32x3' splits each into two TF32 parts and sums three
        products (errors of the order of float32 arithmetic's).  Where the
        tensor-core kernel does not apply, and on NumPy arrays, the result is
        computed in IEEE float32 as with 'ieee'.
    backend : {'auto', 'numpy', 'cuda', 'emulator'}, default 'auto'
        'auto' picks 'numpy' for NumPy arrays and 'cuda' for CUDA arrays.
        'emulator' runs the CUDA kernels on the CPU emulator (NumPy arrays;
        for testing kernels without a GPU).
    bias : array or tuple of arrays, optional
        Added to the scaled scores: they become ``scale * q kᵀ + bias`` (as
        PyTorch's ``scaled_dot_product_attention`` adds a float ``attn_mask``).
        Each array broadcasts (NumPy's rules, read in place, never expanded)
        to the scores' shape ``batch + (Lq, Lk)``, ``batch`` the output's
        leading shape; any of the four float dtypes, read in the accumulation
        type.  A tuple of up to 4 arrays adds them all (in order), so that
        e.g. a ``(B, N, 1, 1, L)`` padding bias and a ``(B, 1, H, L, L)`` pair
        bias never have to be summed into a ``(B, N, H, L, L)`` array.  A
        ``-inf`` entry hides that key from that query, as a False ``mask``
        entry does; NaN makes the rows it touches NaN.  Every backend.
    mask : bool array, optional
        True where a query may attend to a key (PyTorch's convention),
        broadcastable like ``bias``; combined with ``causal``/``window`` by
        AND.  Every backend.
    q_lengths, kv_lengths : int or int array, optional
        Per-sequence lengths of a padded batch: int32/int64, broadcastable to
        the batch dims before the head axis (``(B,)`` for ``(B, H, L, d)``
        inputs; an int for 3-D inputs), in ``[0, Lq]`` and ``[0, Lk]``.
        Query rows ``i >= q_len`` give zeros and lse ``-inf``; keys
        ``j >= kv_len`` are invisible; what the padding holds (even NaN)
        never reaches a result.  ``causal`` and ``window`` align to each
        sequence's own lengths: query ``i`` sits at key ``i + kv_len - q_len``.
        On CuPy arrays they are copied to the host once (a few bytes); the
        kernel backends run every sequence in one launch per kernel, each on
        its own rows and keys (blocks past a length return at once).
    block_table : int32 or int64 array, shape (B, max_pages), optional
        k and v are then a paged KV cache, ``(num_pages, Hkv, page_size, d)``
        and ``(num_pages, Hkv, page_size, dv)``, and q is ``(B, Hq, Lq, d)``:
        sequence ``b``'s key ``j`` is slot ``j % page_size`` of page
        ``block_table[b, j // page_size]``.  Any page size; pages in any
        order, shared or not.  Needs ``kv_lengths``; takes ``q_lengths``,
        ``causal`` (each sequence's queries are its last ``Lq`` positions),
        ``window``, ``enable_gqa``, ``scale``, ``return_lse`` and ``out``,
        not ``bias`` or ``mask``.  See :func:`append_kv`.  Every backend: the
        kernels read each key row from its page in place (one launch over every
        sequence, never a gathered copy), and need the caches' last axis of
        unit stride.  Every page index a sequence uses is checked before any
        work -- on CuPy arrays after one small copy of the table to the host,
        with the lengths' (which waits for the device).  Forward only.
    softcap : float, optional
        Caps the scaled scores smoothly before the bias:
        ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok).  Every backend,
        as for the four below (the kernels read the expressions compiled
        into them: a new expression costs one NVRTC compile per family).
    alibi_slopes : float array, optional
        ALiBi: adds ``-slope * |i + Lk - Lq - j|`` (per sequence's lengths)
        after the bias; broadcastable to the output's batch shape (one slope
        per head: ``(H,)``).
    score_mod : str, optional
        An expression that rewrites each score after the bias and ALiBi, e.g.
        ``"score - gamma[h] * abs(q_idx - kv_idx)"``: the names ``score``,
        ``b`` (flat batch index), ``h`` (query head), ``q_idx``, ``kv_idx``
        and the arrays of ``mod_args``; ``+ - * /``, comparisons, ``& | ~``,
        ``where tanh exp log sqrt sigmoid abs floor min max`` (the language:
        the semantics page).  Its derivative with respect to ``score`` is
        derived by cupyflash for the backward.
    mask_mod : str, optional
        A boolean expression of ``b``, ``h``, ``q_idx``, ``kv_idx`` and the
        ``mod_args`` arrays: True where a query may attend to a key (ANDed
        with every other mask).
    mod_args : dict of str to array, optional
        The arrays ``score_mod`` and ``mask_mod`` index (same kind of array as
        q; constants: no gradient flows into them; the kernels take up to 4
        of up to 4 axes).  An index outside an array raises IndexError on the
        NumPy and emulator backends; on a GPU the kernel traps (a CUDA error
        that ends the context).

    Returns
    -------
    out : array, shape (..., Lq, dv)
        Same dtype and array type as the inputs.  A query row that sees no
        key (possible with ``window``/``causal`` and Lq > Lk, a ``mask`` or
        an all ``-inf`` ``bias``) is all zeros.
    lse : array, shape (..., Lq)
        Natural-log log-sum-exp; float32 (float64 for float64 inputs);
        ``-inf`` for rows that see no key.  Only if ``return_lse``.

    Raises
    ------
    TypeError
        Non-arrays, a mix of NumPy and CuPy arrays, unsupported or differing
        dtypes, a backend that does not take this kind of array, a ``bias``
        that is not floating or a ``mask`` that is not bool.
    ValueError
        Shapes that do not fit together or broadcast, GQA head counts that do
        not divide, non-finite ``scale``, a malformed ``window``, an ``out`` of
        the wrong shape or dtype, an unknown ``backend`` or ``precision``, a
        ``precision`` other than 'ieee' for inputs that are not float32, a
        ``bias`` or ``mask`` that does not broadcast to the scores' shape.
    NotImplementedError
        ``bias`` or ``mask`` on the CUDA or emulator backend (not yet).

    See Also
    --------
    attention_backward : gradients from ``out`` and ``lse``.
    cupyflash.reference.naive_attention : the float64 oracle.

    Notes
    -----
    dtypes float16, bfloat16 (``ml_dtypes.bfloat16`` arrays), float32 and
    float64; the output has the input dtype, accumulation is float32
    (float64 for float64 inputs).  float32 is computed in IEEE float32 -- or,
    opted into with ``CUPYFLASH_DMMA=float32`` on A100/H100-class GPUs, in
    float64 on the FP64 tensor cores and rounded once -- and with TF32 only
    where ``precision`` allows it.  Memory beyond
    the output is O(Lq·d) per (batch, head).

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 128, 64), dtype=np.float32)   # (batch, heads, L, d)
    >>> k = rng.standard_normal((2, 4, 256, 64), dtype=np.float32)
    >>> v = rng.standard_normal((2, 4, 256, 64), dtype=np.float32)
    >>> out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, out.dtype, lse.shape
    ((2, 4, 128, 64), dtype('float32'), (2, 4, 128))
    """
    return run_attention(q, k, v, scale=scale, causal=causal, window=window, enable_gqa=enable_gqa,
                         return_lse=return_lse, out=out, precision=precision, backend=backend,
                         bias=bias, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
                         block_table=block_table, softcap=softcap, alibi_slopes=alibi_slopes,
                         score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)


def run_attention(q, k, v, *, scale=None, causal=False, window=None, enable_gqa=False, return_lse=False,
                  out=None, precision="ieee", backend="auto", options: KernelOptions | None = None,
                  bias=None, mask=None, q_lengths=None, kv_lengths=None, block_table=None, softcap=None,
                  alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=None):
    """:func:`attention` with explicit dispatch ``options`` (tests and benchmarks; None: read
    ``CUPYFLASH_WGMMA`` / ``CUPYFLASH_DMMA`` from the environment, as :func:`attention` does)."""
    if block_table is not None:
        from ._kvcache import run_paged

        for name, given in (("bias", bias), ("mask", mask), ("softcap", softcap), ("alibi_slopes", alibi_slopes),
                            ("score_mod", score_mod), ("mask_mod", mask_mod), ("mod_args", mod_args)):
            if given is not None:
                raise ValueError(f"`{name}` does not combine with `block_table` (a paged cache has no dense "
                                 f"(Lq, Lk) layout to broadcast it to)")
        return run_paged(q, k, v, block_table=block_table, kv_lengths=kv_lengths, q_lengths=q_lengths, scale=scale,
                         causal=causal, window=window, enable_gqa=enable_gqa, return_lse=return_lse, out=out,
                         backend=backend, precision=precision, options=options)
    problem, _ = check_forward(q, k, v, scale=scale, causal=causal, window=window,
                               enable_gqa=enable_gqa, backend=backend, bias=bias, mask=mask,
                               q_lengths=q_lengths, kv_lengths=kv_lengths,
                               mods=_mods(softcap, alibi_slopes, score_mod, mask_mod, mod_args))
    problem.precision = check_precision(precision, problem.dtype)
    if out is not None:
        check_output(out, "out", problem.out_shape, problem.dtype, problem.kind,
                     (problem.q, problem.k, problem.v, *problem.bias,
                      *(() if problem.mask is None else (problem.mask,))))
    return run_forward(problem, out, bool(return_lse), options)


def attention_backward(dout, q, k, v, out, lse, /, *, scale=None, causal=False, window=None,
                       enable_gqa=False, deterministic=True, precision="ieee", backend="auto",
                       bias=None, mask=None, q_lengths=None, kv_lengths=None, softcap=None, alibi_slopes=None,
                       score_mod=None, mask_mod=None, mod_args=None):
    """Gradients of :func:`attention` with respect to q, k and v (and ``bias``).

    Recomputes the probabilities block by block from ``lse`` (as returned by
    ``attention(..., return_lse=True)``); the ``(..., Lq, Lk)`` matrices are
    never stored.

    Parameters
    ----------
    dout : array, shape (..., Lq, dv)
        Gradient of the loss with respect to ``out``.
    q, k, v : array
        The forward inputs.
    out : array, shape (..., Lq, dv)
        The forward output.
    lse : array, shape (..., Lq)
        The forward log-sum-exp (float32 or float64).
    scale, causal, window, enable_gqa, bias, mask, q_lengths, kv_lengths
        As passed to :func:`attention`.  With lengths, the padded query rows
        get zero dq, the padded keys zero dk and dv, and nothing the padding of
        dout, out or lse holds is read.
    deterministic : bool, default True
        Require results that are bit-identical from run to run (same inputs,
        same device).  ``False`` allows an algorithm whose summation order may
        vary between runs when one is faster (see Notes).
    precision : {'ieee', 'tf32', 'tf32x3'}, default 'ieee'
        As for :func:`attention` (float32 only): 'tf32' and 'tf32x3' allow the
        GPU to compute the block products on the TF32 tensor cores (sm_80+,
        ``d == dv <= 128``), with one or three TF32 products per product.
    backend : {'auto', 'numpy', 'cuda', 'emulator'}, default 'auto'
        As for :func:`attention`.

    Returns
    -------
    dq, dk, dv : arrays
        Shapes and dtypes of q, k and v.  Broadcast batch dims and, with
        ``enable_gqa``, each group's query heads are summed back onto k and v.
    dbias : array or tuple of arrays
        Only when ``bias`` is given (a 4-tuple is returned then): the gradient
        of each bias term, structured like ``bias`` (one array, or a tuple in
        its order), each with its term's shape and dtype, summed over the
        axes along which that term was broadcast.  Zero where a pair was
        hidden (a False ``mask`` entry, a ``-inf`` bias, the window).  ``mask``
        has no gradient.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention`; also for ``dout``/``out``/``lse`` of the wrong
        shape or dtype, and a ``deterministic`` that is not a bool.

    Notes
    -----
    Gradients are accumulated in float32 (float64 for float64 inputs) and
    rounded to the input dtype once.  On the GPU (tensor cores for
    float16/bfloat16 with ``d == dv`` on sm_80+, CUDA cores otherwise) a pass
    computes ``rowsum(dout * out)``, a kernel that owns blocks of keys sums
    dk and dv over the query blocks (and, with ``enable_gqa``, over the
    group's query heads in order), and one that owns blocks of queries sums
    dq over the key blocks.  Each gradient element is summed by one thread in
    a fixed order, so the results are bit-identical from run to run; the
    price is that the scores and their gradient are computed twice (7 block
    products per pair of query and key blocks instead of 5).  With
    ``deterministic=False`` the GPU path skips the dq kernel where the kernels
    allow it (not in the TF32 and DMMA backwards, at d = 256, nor on Hopper's wgmma
    kernels for a call with score terms or modifications at d = 128, whose
    atomic launch would spill registers): the kernel that
    owns blocks of keys also adds each pair's dq contribution with atomics
    (float32; float64 for float64 inputs), whose order, and hence the last
    bits of dq, changes from run to run (dk and dv stay bit-identical).  The
    NumPy path is deterministic either way.  Broadcast batch dims are summed
    back onto q, k and v in a fixed order too.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 16, 8))
    >>> out, lse = cupyflash.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = cupyflash.attention_backward(np.ones_like(out), q, k, v, out, lse)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 16, 8), (2, 16, 8), (2, 16, 8))
    """
    return run_attention_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, window=window,
                                  enable_gqa=enable_gqa, deterministic=deterministic, precision=precision,
                                  backend=backend, bias=bias, mask=mask, q_lengths=q_lengths,
                                  kv_lengths=kv_lengths, softcap=softcap, alibi_slopes=alibi_slopes,
                                  score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)


def run_attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None, enable_gqa=False,
                           deterministic=True, precision="ieee", backend="auto",
                           options: KernelOptions | None = None, bias=None, mask=None,
                           q_lengths=None, kv_lengths=None, softcap=None, alibi_slopes=None, score_mod=None,
                           mask_mod=None, mod_args=None):
    """:func:`attention_backward` with explicit dispatch ``options`` (see :func:`run_attention`)."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"`deterministic` must be a bool, got {type(deterministic).__name__}")
    problem, dout, out, lse = check_backward(
        dout, q, k, v, out, lse, scale=scale, causal=causal, window=window,
        enable_gqa=enable_gqa, backend=backend, bias=bias, mask=mask,
        q_lengths=q_lengths, kv_lengths=kv_lengths, mods=_mods(softcap, alibi_slopes, score_mod, mask_mod, mod_args),
    )
    problem.precision = check_precision(precision, problem.dtype)
    return run_backward(problem, dout, out, lse, deterministic=bool(deterministic), options=options)


def _mods(softcap, alibi_slopes, score_mod, mask_mod, mod_args):
    """The score modifications' keywords for the checks (None: none given)."""
    given = dict(softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                 mod_args=mod_args)
    return given if any(x is not None for x in given.values()) else None


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, /, *, scale=None, causal=False, window=None,
                     enable_gqa=False, return_lse=False, out=None, backend="auto"):
    """:func:`attention` over a batch of packed sequences of different lengths.

    Sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v; each attends to its own keys
    only, as :func:`attention` would on those slices, and nothing is padded.

    Parameters
    ----------
    q : array, shape (Hq, total_q, d)
        The queries of every sequence, one after the other along axis 1 (heads
        first, as everywhere in cupyflash; FlashAttention's ``(total, H, d)``
        data passes without a copy as ``x.transpose(1, 0, 2)``).
    k, v : array, shape (Hkv, total_k, d) and (Hkv, total_k, dv)
    cu_seqlens_q, cu_seqlens_k : int32 or int64 array, shape (nseq + 1,)
        The sequences' offsets: from 0, non-decreasing, ending at total_q
        (total_k).  Empty sequences are allowed.  On CuPy arrays they are
        copied to the host once (a few bytes).
    scale, causal, window, enable_gqa, return_lse, out, backend
        As for :func:`attention`; ``causal`` and ``window`` align to each
        sequence's own lengths (query ``i`` of a sequence sits at its key
        ``i + len_k - len_q``).

    Returns
    -------
    out : array, shape (Hq, total_q, dv)
    lse : array, shape (Hq, total_q), only if ``return_lse``
        A query of a sequence without keys gives zeros and ``-inf``.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 3, 8])                   # sequences of 3, 0 and 5 rows
    >>> q, k, v = rng.standard_normal((3, 2, 8, 4))   # (heads, total, d) each
    >>> out = cupyflash.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> bool(np.allclose(out[:, 3:8], cupyflash.attention(q[:, 3:8], k[:, 3:8], v[:, 3:8], causal=True)))
    True
    """
    from ._varlen import run_varlen

    return run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal, window=window,
                      enable_gqa=enable_gqa, return_lse=return_lse, out=out, backend=backend)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, /, *, scale=None, causal=False,
                              window=None, enable_gqa=False, deterministic=True, backend="auto"):
    """Gradients of :func:`attention_varlen`: ``(dq, dk, dv)`` with the shapes and
    dtypes of q, k and v, each sequence's from its own rows (as
    :func:`attention_backward` on the slices); ``lse`` as returned by
    ``attention_varlen(..., return_lse=True)``.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 8])
    >>> q, k, v = rng.standard_normal((3, 2, 8, 4))
    >>> out, lse = cupyflash.attention_varlen(q, k, v, cu, cu, return_lse=True)
    >>> dq, dk, dv = cupyflash.attention_varlen_backward(np.ones_like(out), q, k, v, out, lse, cu, cu)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 8, 4), (2, 8, 4), (2, 8, 4))
    """
    from ._varlen import run_varlen_backward

    return run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                               window=window, enable_gqa=enable_gqa, deterministic=deterministic, backend=backend)
