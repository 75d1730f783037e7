"""KV caches: attention over a paged cache (``block_table=``) and ``append_kv``.

The oracle of a paged call is dense attention over each sequence's gathered pages
(``naive_attention``); error rules: docs/testing.md's table.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupyflash
from cupyflash.reference import naive_attention

from _util import DTYPES, DTYPE_IDS, assert_close, assert_lse_close, random_array


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _gathered(cache, table_row, length, page_size):
    pages = table_row[:-(-length // page_size)] if length else table_row[:0]
    part = cache[pages]
    return part.transpose(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])[:, :length]


def _paged_cache(rng, dtype, lengths, page_size, hkv, d, *, shared=False, spare=3):
    """A shuffled paged cache holding ``lengths`` keys per sequence (and spare pages),
    its block table (unused entries -1) and the dense keys/values it holds."""
    pages_per = [-(-n // page_size) for n in lengths]
    max_pages = max(pages_per + [1]) + 1
    num_pages = sum(pages_per) + spare
    k_cache = random_array(rng, (num_pages, hkv, page_size, d), dtype)
    v_cache = random_array(rng, (num_pages, hkv, page_size, d), dtype)
    order = rng.permutation(num_pages)
    table = np.full((len(lengths), max_pages), -1, np.int32)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[used:used + n]
        used += n
    if shared and len(lengths) > 1 and pages_per[0] and pages_per[1]:
        table[1, 0] = table[0, 0]                 # a shared first page (a common prefix)
    return k_cache, v_cache, table


@pytest.mark.parametrize("page_size", [1, 16, 17, 64, 256])
@pytest.mark.parametrize("lq", [1, 7])
def test_paged_attention_equals_dense_attention_over_the_gathered_pages(page_size, lq):
    rng = _rng("paged", page_size, lq)
    lengths = [0, 1, page_size + 3, 2 * page_size, 300 if page_size < 256 else 500]   # partial, full pages
    lengths = [max(n, 0) for n in lengths]
    hq, hkv, d = 8, 1, 16                                     # MQA (8 query heads, one kv head)
    k_cache, v_cache, table = _paged_cache(rng, np.float32, lengths, page_size, hkv, d, shared=True)
    q = random_array(rng, (len(lengths), hq, lq, d), np.float32)
    kv_lengths = np.array(lengths, np.int32)
    out, lse = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=kv_lengths, causal=True,
                                   return_lse=True)
    for b, n in enumerate(lengths):
        k = _gathered(k_cache, table[b], n, page_size)
        v = _gathered(v_cache, table[b], n, page_size)
        # causal: the Lq new queries are the sequence's last positions (bottom-right)
        ref, ref_lse = naive_attention(q[b], np.broadcast_to(k, (hq,) + k.shape[1:]),
                                       np.broadcast_to(v, (hq,) + v.shape[1:]), causal=True, return_lse=True)
        assert_close(out[b], ref, np.float32, what=f"sequence {b}")
        assert_lse_close(lse[b], ref_lse, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_gqa_every_dtype(dtype):
    rng = _rng("paged-gqa", dtype)
    lengths, page_size = [5, 40, 17], 16
    k_cache, v_cache, table = _paged_cache(rng, dtype, lengths, page_size, 2, 32)
    q = random_array(rng, (3, 16, 1, 32), dtype)                # GQA 8:1
    out = cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array(lengths),
                              enable_gqa=True, causal=True)
    for b, n in enumerate(lengths):
        ref = naive_attention(q[b], _gathered(k_cache, table[b], n, page_size),
                              _gathered(v_cache, table[b], n, page_size), enable_gqa=True, causal=True)
        assert_close(out[b], ref, dtype)


def test_dense_cache_is_the_padded_form():
    rng = _rng("dense")
    k_cache = random_array(rng, (2, 2, 64, 8), np.float64)
    v_cache = random_array(rng, (2, 2, 64, 8), np.float64)
    lengths = np.array([10, 64])
    q = random_array(rng, (2, 2, 3, 8), np.float64)
    out = cupyflash.attention(q, k_cache, v_cache, kv_lengths=lengths, causal=True)
    for b, n in enumerate(lengths):
        assert_close(out[b], naive_attention(q[b], k_cache[b, :, :n], v_cache[b, :, :n], causal=True), np.float64)


# ---- append_kv ---------------------------------------------------------------------------------


def test_append_to_a_paged_cache_then_attend():
    rng = _rng("append-paged")
    page_size, lengths = 17, np.array([0, 16, 17, 40])
    k_cache, v_cache, table = _paged_cache(rng, np.float32, [n + 5 for n in lengths], page_size, 2, 8)
    before = [(_gathered(k_cache, table[b], n, page_size).copy(), _gathered(v_cache, table[b], n, page_size).copy())
              for b, n in enumerate(lengths)]
    k_new, v_new = random_array(rng, (4, 2, 5, 8), np.float32), random_array(rng, (4, 2, 5, 8), np.float32)
    new_lengths = cupyflash.append_kv(k_cache, v_cache, k_new, v_new, kv_lengths=lengths, block_table=table)
    np.testing.assert_array_equal(new_lengths, lengths + 5)
    np.testing.assert_array_equal(lengths, [0, 16, 17, 40])      # not modified
    for b, n in enumerate(lengths):
        k = _gathered(k_cache, table[b], n + 5, page_size)
        np.testing.assert_array_equal(k[:, :n], before[b][0])   # the old keys untouched
        np.testing.assert_array_equal(k[:, n:], k_new[b])
        np.testing.assert_array_equal(_gathered(v_cache, table[b], n + 5, page_size)[:, n:], v_new[b])


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_append_past_the_capacity_writes_nothing(paged):
    rng = _rng("capacity", paged)
    if paged:
        k_cache, v_cache, table = _paged_cache(rng, np.float32, [8, 8], 4, 1, 4, spare=0)   # 3 columns: 12 keys
        kw = dict(block_table=table)
    else:
        k_cache, v_cache = random_array(rng, (2, 1, 12, 4), np.float32), random_array(rng, (2, 1, 12, 4), np.float32)
        kw = {}
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    new = random_array(rng, (2, 1, 5, 4), np.float32)
    lengths = np.array([3, 8]) if paged else np.array([7, 8])     # sequence 0's fit, sequence 1's 8 + 5 does not
    with pytest.raises(ValueError, match="sequence 1"):
        cupyflash.append_kv(k_cache, v_cache, new, new, kv_lengths=lengths, **kw)
    np.testing.assert_array_equal(k_cache, k_copy)
    np.testing.assert_array_equal(v_cache, v_copy)


def test_bad_page_indices_are_refused():
    rng = _rng("bad-pages")
    k_cache, v_cache, table = _paged_cache(rng, np.float32, [8, 8], 4, 1, 4)
    q = random_array(rng, (2, 1, 1, 4), np.float32)
    bad = table.copy()
    bad[1, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"`block_table`\[1, 1\]"):
        cupyflash.attention(q, k_cache, v_cache, block_table=bad, kv_lengths=np.array([8, 8]))
    bad[1, 1] = -2
    with pytest.raises(ValueError, match=r"`block_table`\[1, 1\]"):
        cupyflash.append_kv(k_cache, v_cache, q, q, kv_lengths=np.array([4, 4]), block_table=bad)
    with pytest.raises(ValueError, match="kv_lengths"):
        cupyflash.attention(q, k_cache, v_cache, block_table=table)
    with pytest.raises(TypeError, match="int32 or int64"):
        cupyflash.attention(q, k_cache, v_cache, block_table=table.astype(np.float32), kv_lengths=np.array([8, 8]))
    with pytest.raises(ValueError, match="`bias`"):
        cupyflash.attention(q, k_cache, v_cache, block_table=table, kv_lengths=np.array([8, 8]),
                            bias=np.zeros((1, 8)))


# ---- a decode loop -----------------------------------------------------------------------------


class _ToyDecoder:
    """Two attention layers with random weights and a tied readout: enough to check that a
    cached decode step computes what recomputing everything computes."""

    def __init__(self, rng, vocab=11, width=16, heads=4, kv_heads=2):
        self.vocab, self.width, self.heads, self.kv_heads = vocab, width, heads, kv_heads
        self.d = width // heads
        self.embed = rng.standard_normal((vocab, width)) / np.sqrt(width)
        self.layers = [dict(q=rng.standard_normal((width, heads * self.d)) / np.sqrt(width),
                            k=rng.standard_normal((width, kv_heads * self.d)) / np.sqrt(width),
                            v=rng.standard_normal((width, kv_heads * self.d)) / np.sqrt(width),
                            o=rng.standard_normal((heads * self.d, width)) / np.sqrt(width))
                       for _ in range(2)]

    def _split(self, x, heads):                      # (B, L, heads * d) -> (B, heads, L, d)
        return x.reshape(x.shape[0], x.shape[1], heads, self.d).transpose(0, 2, 1, 3)

    def logits(self, tokens, caches=None, lengths=None, backend="numpy", table=None):
        """Full causal attention over ``tokens`` (B, L) -- or, with caches, the new tokens
        only, appended to the caches (paged ones with a block ``table``)."""
        x = self.embed[tokens]
        for layer, cache in zip(self.layers, caches or [None] * len(self.layers)):
            q = self._split(x @ layer["q"], self.heads)
            k = self._split(x @ layer["k"], self.kv_heads)
            v = self._split(x @ layer["v"], self.kv_heads)
            if cache is None:
                a = cupyflash.attention(q, k, v, causal=True, enable_gqa=True, backend=backend)
            else:
                k_cache, v_cache = cache
                grown = cupyflash.append_kv(k_cache, v_cache, k, v, kv_lengths=lengths, block_table=table)
                a = cupyflash.attention(q, k_cache, v_cache, kv_lengths=grown, block_table=table, causal=True,
                                        enable_gqa=True, backend=backend)
            x = x + a.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1) @ layer["o"]
        return x[:, -1] @ self.embed.T


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_greedy_decode_with_a_cache_equals_recomputing(backend, paged):
    rng = _rng("decode")
    model = _ToyDecoder(rng)
    batch, prompt, steps, capacity = 2, 5, 64, 80
    tokens = rng.integers(0, model.vocab, (batch, prompt))
    table = None
    if paged:   # pages of 7 keys, the two sequences' interleaved and shuffled, a spare one
        page_size, per = 7, -(-capacity // 7)
        table = rng.permutation(batch * per + 1)[:batch * per].reshape(batch, per).astype(np.int32)
        shape = (batch * per + 1, model.kv_heads, page_size, model.d)
    else:
        shape = (batch, model.kv_heads, capacity, model.d)
    caches = [(np.zeros(shape), np.zeros(shape)) for _ in model.layers]
    lengths = np.zeros(batch, np.int64)
    logits = model.logits(tokens, caches, lengths, backend, table)                # prefill
    lengths = lengths + prompt
    sequence = tokens
    check_every = 1 if backend == "numpy" else 8       # the emulator's full recomputations cost the most
    for step in range(steps):
        if step % check_every == 0 or step == steps - 1:
            np.testing.assert_allclose(logits, model.logits(sequence, backend=backend), rtol=1e-12, atol=1e-12)
        nxt = logits.argmax(axis=-1)[:, None]
        sequence = np.concatenate([sequence, nxt], axis=1)
        logits = model.logits(nxt, caches, lengths, backend, table)
        lengths = lengths + 1
    assert sequence.shape == (batch, prompt + steps)
