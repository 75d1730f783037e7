"""Paged KV caches on the CUDA kernels, run by the emulator: K and V read from their
pages in place (``cuda_src/paged.cuh``), one launch over every sequence, for every
kernel family the dispatcher can pick, forced in turn at sm_80 or sm_90 dispatch.

The oracle of each sequence is dense attention over its gathered pages
(``_gathered``), by the families' error rules (``_terms_util.check_forward``).  The
caches hold NaN in every page no sequence uses and the tables -1 past each
sequence's pages, so a read of the wrong page, or past a sequence's keys, shows.
Lengths 0, 1, a partial last page and the table's full capacity; pages shuffled and
shared; Lq = 1 and 7, causal (bottom-right to each sequence's keys); GQA 8:1 and MQA;
page sizes 1, 16, 17, 64 and 256; split-KV on and off.  The NumPy path's semantics,
bad tables and ``append_kv`` are tests/test_kvcache.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash

from cupyflash.reference import naive_attention

from _terms_util import check_forward
from _util import EMULATED_FAMILIES, family_params, naive_tf32_attention, random_array
from test_kvcache import _gathered, _paged_cache, _rng


def _cache(key, dtype, lengths, page_size, hkv, d):
    """test_kvcache.py's shuffled cache for ``lengths`` keys per sequence -- sequence 1
    sharing sequence 0's first page (a common prefix), two spare pages -- with its table
    cut to the longest sequence's pages (so that one fills it: the full capacity), -1 past
    each sequence's pages, and NaN (K) and inf (V) in every page no sequence uses."""
    k_cache, v_cache, table = _paged_cache(_rng(key, np.dtype(dtype).name, page_size), dtype, lengths, page_size,
                                           hkv, d, shared=True, spare=2)
    table = np.ascontiguousarray(table[:, :max(-(-n // page_size) for n in lengths + [1])])
    num_pages = k_cache.shape[0]
    unused = np.setdiff1d(np.arange(num_pages), table[table >= 0])
    k_cache[unused], v_cache[unused] = np.nan, np.inf
    # the slots past a sequence's last key in its last page (one no other sequence
    # reads): no CTA may read them either
    pages, counts = np.unique(table[table >= 0], return_counts=True)
    for b, n in enumerate(lengths):
        last = table[b, n // page_size] if n % page_size else -1
        if last >= 0 and counts[pages == last][0] == 1:
            k_cache[last, :, n % page_size:], v_cache[last, :, n % page_size:] = np.nan, np.inf
    return k_cache, v_cache, table


def _check(out, lse, q, k_cache, v_cache, table, lengths, precision, **kw):
    page_size = k_cache.shape[2]
    for b, n in enumerate(lengths):
        if n == 0:   # no key: zeros and lse = -inf
            assert not out[b].any() and np.isneginf(lse[b]).all(), f"sequence {b}: no key"
            continue
        k = _gathered(k_cache, table[b], n, page_size)[None]
        v = _gathered(v_cache, table[b], n, page_size)[None]
        if precision == "tf32":   # one TF32 pass: tests/_util.py's forward_against_oracle rules
            one = (q[b:b + 1], k, v)
            scale = 1 / np.sqrt(q.shape[-1])
            ref, ref_lse = naive_attention(*one, return_lse=True, **kw)
            yardstick = naive_tf32_attention(*one, scale=scale, window=(None, 0), enable_gqa=kw.get("enable_gqa"))
            err = np.abs(out[b:b + 1] - ref).max()
            assert err <= 2 * np.abs(yardstick.astype(np.float64) - ref).max(), f"sequence {b}: {err:.3g}"
            # a score's TF32 error is below 2^-10 scale sum |q_i k_i|; lse moves by at most its row's largest
            g = q.shape[1] // k.shape[1]
            bound = 2.0 ** -10 * scale * (np.abs(q[b].astype(np.float64))
                                          @ np.swapaxes(np.abs(np.repeat(k[0], g, axis=0)), -1, -2)).max(axis=-1)
            np.testing.assert_array_equal(np.isneginf(lse[b]), np.isneginf(ref_lse[0]))
            finite = np.isfinite(ref_lse[0])
            assert (np.abs(lse[b][finite] - ref_lse[0][finite]) <= bound[finite] + 1e-5).all(), f"sequence {b}"
        else:
            check_forward(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, precision, **kw)


def _launched(spy):
    return [n.split("<")[0].removeprefix("cf::") for n in spy.launched if n.startswith("cf::fwd_")]


# Per family, a page size (together they cover 1, 16, 17, 64 and 256) and whether the
# keys are split (fwd_combine merging each sequence's rows).
_PAGE_SIZES = {"simt-f32": (256, 1), "simt-f64": (17, 3), "mma-f16": (16, 3), "mma-bf16": (64, 1),
               "tf32x3": (17, 1), "tf32": (16, 2), "dmma-f64": (1, 2), "wgmma-f16": (16, 1)}


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(
    EMULATED_FAMILIES + [("tf32", 80, {}, np.float32, "tf32", "tf32")]))   # one pass: a paged tile of its own
def test_paged_prefill_and_decode_per_family(emulate, request, arch, options, dtype, precision, family):
    # Lq = 7 new queries per sequence over its cached prefix (a chunked prefill), then a
    # decode step (Lq = 1: the 8 query heads of a kv head packed into one query block);
    # GQA 8:1, causal
    page_size, splits = _PAGE_SIZES[request.node.callspec.id]
    max_pages = -(-(page_size + 3) // page_size) + 1
    lengths = [page_size + 3, 0, 1, max_pages * page_size]   # partial last page, none, one, full capacity
    k_cache, v_cache, table = _cache("prefill", dtype, lengths, page_size, 2, 64)
    kw = dict(causal=True, enable_gqa=True)
    for lq in (7, 1):
        spy = emulate(arch, splits=splits, **options)
        q = random_array(_rng("q", request.node.callspec.id, lq), (len(lengths), 16, lq, 64), dtype)
        out, lse = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array(lengths),
                                       backend="emulator", return_lse=True, precision=precision, **kw)
        assert [n for n in _launched(spy) if n != "fwd_combine_kernel"] == [f"fwd_{family}_kernel"]
        assert ("fwd_combine_kernel" in _launched(spy)) == (splits > 1)
        _check(out, lse, q, k_cache, v_cache, table, lengths, precision, **kw)


@pytest.mark.parametrize("page_size", [1, 16, 17, 64, 256])
def test_paged_decode_page_sizes(emulate, page_size):
    # one new query per sequence, MQA (8 query heads on one kv head: packed as the
    # rows of one query block), keys split in two; fwd_simt float32
    lengths = [2 * page_size + 5, 1, page_size, 0, 70]
    k_cache, v_cache, table = _cache("decode", np.float32, lengths, page_size, 1, 32)
    spy = emulate(80, splits=2)
    q = random_array(_rng("decode-q", page_size), (len(lengths), 8, 1, 32), np.float32)
    kw = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array(lengths, np.int32),
                                   backend="emulator", return_lse=True, **kw)
    (main,) = [(n, grid) for n, grid in spy.launches if "fwd_simt" in n]
    assert main[1][0] == len(lengths), "the 8 query heads of a kv head: one query block per sequence"
    _check(out, lse, q, k_cache, v_cache, table, lengths, "ieee", **kw)


def test_paged_decode_with_a_window_and_query_lengths(emulate):
    # a sliding window on each sequence's own diagonal (no head packing then) and
    # query lengths below Lq: rows past them are zeros with lse = -inf
    lengths, q_lengths = [40, 9, 33], [3, 0, 2]
    k_cache, v_cache, table = _cache("window", np.float16, lengths, 16, 2, 64)
    emulate(80)
    q = random_array(_rng("window-q"), (3, 4, 3, 64), np.float16)
    kw = dict(window=(12, 0), enable_gqa=True)
    out = np.full(q.shape, np.nan, np.float16)    # the rows past the query lengths: the call's to zero
    out, lse = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array(lengths),
                                   q_lengths=np.array(q_lengths), backend="emulator", return_lse=True, out=out, **kw)
    for b, m in enumerate(q_lengths):
        assert not out[b, :, m:].any() and np.isneginf(lse[b, :, m:]).all(), f"sequence {b}: rows past its queries"
        if m:
            k = _gathered(k_cache, table[b], lengths[b], 16)[None]
            v = _gathered(v_cache, table[b], lengths[b], 16)[None]
            check_forward(out[b:b + 1, :, :m], lse[b:b + 1, :, :m], q[b:b + 1, :, :m], k, v, "ieee", **kw)


@pytest.mark.parametrize("dtype, d, dv", [(np.float16, 12, 12), (np.float16, 32, 64), (np.float32, 6, 6)],
                         ids=["f16-unaligned", "f16-d-not-dv", "f32-unaligned"])
def test_paged_rows_only_fwd_simt_takes(emulate, dtype, d, dv):
    # rows the tensor cores do not take -- not 16-byte aligned, or d != dv -- run
    # fwd_simt: float16 rows converted to float on the way in, element by element (or,
    # whole 16-byte chunks, chunk by chunk); float32 copied word by word
    lengths = [23, 5, 11]
    k_cache, v_cache, table = _cache("simt-rows", dtype, lengths, 5, 2, d)
    if dv != d:
        v_cache = random_array(_rng("simt-rows-v"), v_cache.shape[:3] + (dv,), dtype)
    spy = emulate(80)
    q = random_array(_rng("simt-rows-q"), (3, 2, 4, d), dtype)
    kw = dict(causal=True)
    out, lse = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array(lengths),
                                   backend="emulator", return_lse=True, **kw)
    assert _launched(spy) == ["fwd_simt_kernel"]
    _check(out, lse, q, k_cache, v_cache, table, lengths, "ieee", **kw)


def test_paged_cache_kernel_errors(emulate):
    emulate(80)
    k_cache, v_cache, table = _cache("errors", np.float32, [8, 8], 4, 1, 8)
    # a page of 2^31 elements: the kernels hold a page's stride in 32 bits (paged.cuh), so
    # refused before anything is read (the view's pages lie past its memory)
    huge = np.lib.stride_tricks.as_strided(k_cache, strides=(2**31 * 4,) + k_cache.strides[1:])
    q = random_array(_rng("errors-q"), (2, 1, 1, 8), np.float32)
    with pytest.raises(NotImplementedError, match="`k_cache`.*32 bits"):
        cupyflash.attention(q, huge, v_cache, block_table=table, kv_lengths=np.array([8, 8]), backend="emulator")
    strided = np.zeros(k_cache.shape[:3] + (16,), np.float32)[..., ::2]
    strided[...] = k_cache
    with pytest.raises(ValueError, match="`k_cache`.*unit stride"):
        cupyflash.attention(q, strided, v_cache, block_table=table, kv_lengths=np.array([8, 8]), backend="emulator")
    bad = table.copy()
    bad[0, 1] = 99
    with pytest.raises(ValueError, match=r"`block_table`\[0, 1\]"):
        cupyflash.attention(q, k_cache, v_cache, block_table=bad, kv_lengths=np.array([8, 8]), backend="emulator")


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(
    [c for c in EMULATED_FAMILIES if c[0] in ("mma-f16", "tf32x3")]))
def test_paged_tiles_are_planned(arch, options, dtype, precision, family):
    # a call over a paged cache plans the families' paged tiles where the usual tile
    # spilled with the table lookups (tools/lengths_report.py --form paged)
    from cupyflash._families import FORWARD, Call, select
    from cupyflash._options import KernelOptions

    d = 128 if family == "mma" else 64
    dtype_name = np.dtype(dtype).name
    plain = Call(dtype_name, d, d, aligned=True, precision=precision)
    paged = Call(dtype_name, d, d, aligned=True, precision=precision, paged=True)
    (row,), (paged_row,) = (select(FORWARD, c, 90, KernelOptions(**options)) for c in (plain, paged))
    assert row.block_n == 64 and paged_row.block_n == 32
    unaligned = Call(dtype_name, d, d, aligned=False, precision=precision, paged=True)
    assert select(FORWARD, unaligned, 90, KernelOptions(**options))[0].family.name == "fwd_simt"
