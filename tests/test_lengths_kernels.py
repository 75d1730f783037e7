"""Per-sequence lengths on the CUDA kernels, run by the emulator: one launch over every
sequence (``cuda_src/sequence.cuh``), for every kernel family the dispatcher can pick,
forced in turn at sm_80 or sm_90 dispatch, padded (``q_lengths=`` / ``kv_lengths=``)
and packed (``attention_varlen``).

Each sequence must give what plain attention gives on it alone: its rows against the
float64 oracle on that sequence's own slices (its own rows, keys and bottom-right
diagonal), by the families' error rules (docs/testing.md, "Shares of the bound":
``_terms_util.check_forward`` / ``check_backward``); rows and keys past its lengths
exactly zero (lse = -inf), and nothing the padding holds -- NaN and inf planted there --
reaching any result.  The lengths hit 0, 1, L, L - 1 and both sides of the 64-row
tiles, with Lq != Lk per sequence and Lq > Lk in some; GQA 2:1 (MQA in the packed
case).  The NumPy path's semantics, bad lengths and the oracle are tests/test_lengths.py's.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash

from _terms_util import check_backward, check_forward
from _util import EMULATED_FAMILIES, bfloat16, family_params, random_array

B, HQ, HKV, LQ, LK = 6, 4, 2, 45, 70
Q_LENS = [0, 1, 45, 44, 33, 17]      # 0, 1, L, L - 1, tails of the query tiles
KV_LENS = [70, 0, 69, 65, 1, 63]     # L, 0, L - 1, 64 + 1, 1, 64 - 1


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _launched(spy, direction):
    return [n.split("<")[0].removeprefix("cf::") for n in spy.launched if n.startswith(f"cf::{direction}_")]


def _padded(key, dtype, q_lens=Q_LENS, kv_lens=KV_LENS, d=64, heads=(HQ, HKV), shape=(LQ, LK)):
    """q, k, v, dout with NaN (q, k, dout) and inf (v) in every padded row."""
    rng = _rng(key, np.dtype(dtype).name)
    batch, (hq, hkv), (lq, lk) = len(q_lens), heads, shape
    q, dout = (random_array(rng, (batch, hq, lq, d), dtype) for _ in range(2))
    k, v = (random_array(rng, (batch, hkv, lk, d), dtype) for _ in range(2))
    for b, (m, n) in enumerate(zip(q_lens, kv_lens)):
        q[b, :, m:] = dout[b, :, m:] = k[b, :, n:] = np.nan
        v[b, :, n:] = np.inf
    return q, k, v, dout


def _check_forward_per_sequence(out, lse, q, k, v, precision, q_lens, kv_lens, **kw):
    for b, (m, n) in enumerate(zip(q_lens, kv_lens)):
        assert not out[b, :, m:].any() and np.isneginf(lse[b, :, m:]).all(), f"sequence {b}: padded rows"
        if m and n:
            one = slice(b, b + 1)   # the sequence alone, as a batch of one
            check_forward(out[one, :, :m], lse[one, :, :m], q[one, :, :m], k[one, :, :n], v[one, :, :n], precision,
                          **kw)
        elif m:   # no key: zeros and lse = -inf
            assert not out[b, :, :m].any() and np.isneginf(lse[b, :, :m]).all(), f"sequence {b}: no key"


def _check_backward_per_sequence(grads, dout, q, k, v, out, lse, precision, q_lens, kv_lens, **kw):
    for b, (m, n) in enumerate(zip(q_lens, kv_lens)):
        assert not grads[0][b, :, m:].any(), f"sequence {b}: dq of padded rows"
        assert not grads[1][b, :, n:].any() and not grads[2][b, :, n:].any(), f"sequence {b}: padded keys"
        if m and n:
            one = slice(b, b + 1)
            check_backward(tuple(g[one, :, :r] for g, r in zip(grads, (m, n, n))), dout[one, :, :m], q[one, :, :m],
                           k[one, :, :n], v[one, :, :n], out[one, :, :m], lse[one, :, :m], precision, **kw)
        else:     # no pair: every gradient of the sequence is zero
            assert not any(g[b].any() for g in grads), f"sequence {b}: nothing attends"


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(EMULATED_FAMILIES))
def test_padded_forward_is_one_launch_per_family(emulate, arch, options, dtype, precision, family):
    spy = emulate(arch, **options)
    q, k, v, _ = _padded("forward", dtype)
    kw = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, q_lengths=np.array(Q_LENS), kv_lengths=np.array(KV_LENS, np.int32),
                                   backend="emulator", return_lse=True, precision=precision, **kw)
    assert [n for n in _launched(spy, "fwd") if n != "fwd_combine_kernel"] == [f"fwd_{family}_kernel"]
    _check_forward_per_sequence(out, lse, q, k, v, precision, Q_LENS, KV_LENS, **kw)


@pytest.mark.parametrize("arch, options, dtype, precision, family", family_params(
    EMULATED_FAMILIES + [("mma-f16-atomic-dq", 80, {}, np.float16, "ieee", "mma"),
                         # bwd_wgmma's ordered dQ: its semaphores are laid out over the longest sequence
                         ("wgmma-f16-ordered-dq", 90, {"wgmma": True, "async_dq": True}, np.float16, "ieee",
                          "wgmma")]))
def test_padded_backward_is_one_launch_per_kernel(emulate, request, arch, options, dtype, precision, family):
    deterministic = "atomic" not in request.node.callspec.id
    spy = emulate(arch, **options)
    q, k, v, dout = _padded("backward", dtype)
    kw = dict(causal=True, enable_gqa=True, q_lengths=np.array(Q_LENS), kv_lengths=np.array(KV_LENS))
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    for b, m in enumerate(Q_LENS):   # what the padding of out and lse holds reaches nothing either
        out[b, :, m:], lse[b, :, m:] = np.nan, np.nan
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", precision=precision,
                                         deterministic=deterministic, **kw)
    launched = _launched(spy, "bwd")
    assert len(launched) == len(set(spy.launched)), "one launch per kernel of the plan"
    assert any(n.startswith(f"bwd_{family}_dkdv") for n in launched)
    del kw["q_lengths"], kw["kv_lengths"]
    _check_backward_per_sequence(grads, dout, q, k, v, out, lse, precision, Q_LENS, KV_LENS, **kw)


def test_window_and_split_kv_with_lengths(emulate):
    # a two-sided window aligned to each sequence's own diagonal, keys split over 3 CTAs
    # per query block: fwd_combine merges the rows of each sequence and none past it
    spy = emulate(80, splits=3)
    q, k, v, _ = _padded("split", np.float16)
    kw = dict(window=(20, 3), enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, q_lengths=np.array(Q_LENS), kv_lengths=np.array(KV_LENS),
                                   backend="emulator", return_lse=True, **kw)
    assert any(g[1] == 3 for _, g in spy.launches) and "fwd_combine_kernel" in _launched(spy, "fwd")
    _check_forward_per_sequence(out, lse, q, k, v, "ieee", Q_LENS, KV_LENS, **kw)


def test_window_backward_with_lengths(emulate):
    # a two-sided window on each sequence's own diagonal: the dK/dV blocks skip the query
    # blocks outside it per sequence, not per padded shape
    emulate(80)
    q, k, v, dout = _padded("window-backward", np.float16)
    kw = dict(window=(20, 3), enable_gqa=True, q_lengths=np.array(Q_LENS), kv_lengths=np.array(KV_LENS))
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw)
    del kw["q_lengths"], kw["kv_lengths"]
    _check_backward_per_sequence(grads, dout, q, k, v, out, lse, "ieee", Q_LENS, KV_LENS, **kw)


def _pack(x, lengths):
    return np.concatenate([x[b, :, :n] for b, n in enumerate(lengths)], axis=1)


PACKED = [
    ("simt-f32", 80, {}, np.float32, "simt"),
    ("mma-f16", 80, {}, np.float16, "mma"),
    ("wgmma-bf16", 90, {"wgmma": True}, bfloat16, "wgmma"),
]


@pytest.mark.parametrize("arch, options, dtype, family", family_params(PACKED))
def test_packed_sequences_in_one_launch(emulate, arch, options, dtype, family):
    # MQA: one kv head for four query heads; the FlashAttention (total, H, d) layout
    spy = emulate(arch, **options)
    q, k, v, dout = _padded("packed", dtype, heads=(HQ, 1))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (Q_LENS, KV_LENS))
    packed = [_pack(x, n) for x, n in ((q, Q_LENS), (k, KV_LENS), (v, KV_LENS), (dout, Q_LENS))]
    pq, pk, pv, pdout = (np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2) for x in packed)
    kw = dict(causal=True, enable_gqa=True)
    out, lse = cupyflash.attention_varlen(pq, pk, pv, cu_q, cu_k, return_lse=True, backend="emulator", **kw)
    grads = cupyflash.attention_varlen_backward(pdout, pq, pk, pv, out, lse, cu_q, cu_k, backend="emulator", **kw)
    assert _launched(spy, "fwd") == [f"fwd_{family}_kernel"]
    assert len(_launched(spy, "bwd")) == len(set(n for n in spy.launched if n.startswith("cf::bwd_")))

    def unpack(x, cu):   # back to the padded layout, zeros past each length
        full = np.zeros((len(cu) - 1, x.shape[0], max(LQ, LK)) + x.shape[2:], x.dtype)
        for s in range(len(cu) - 1):
            full[s, :, :cu[s + 1] - cu[s]] = x[:, cu[s]:cu[s + 1]]
        return full

    lse_full = unpack(lse, cu_q)
    for s, m in enumerate(Q_LENS):
        lse_full[s, :, m:] = -np.inf
    _check_forward_per_sequence(unpack(out, cu_q), lse_full, q, k, v, "ieee", Q_LENS, KV_LENS, **kw)
    padded_grads = (unpack(grads[0], cu_q), unpack(grads[1], cu_k), unpack(grads[2], cu_k))
    _check_backward_per_sequence(padded_grads, dout, q, k, v, unpack(out, cu_q), lse_full, "ieee",
                                 Q_LENS, KV_LENS, **kw)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 64), causal=st.booleans())
def test_random_lengths_on_the_kernels(seed, batch, causal):
    # 1 to 64 sequences of random lengths, one launch each way (fwd_simt, bwd_simt)
    rng = np.random.default_rng(seed)
    lq, lk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    ql, kl = rng.integers(0, lq + 1, batch), rng.integers(0, lk + 1, batch)
    q, k, v, dout = _padded(seed, np.float32, ql, kl, d=16, heads=(2, 1), shape=(lq, lk))
    kw = dict(causal=causal, enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, q_lengths=ql, kv_lengths=kl, backend="emulator", return_lse=True, **kw)
    _check_forward_per_sequence(out, lse, q, k, v, "ieee", ql, kl, **kw)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, q_lengths=ql, kv_lengths=kl, backend="emulator",
                                         **kw)
    _check_backward_per_sequence(grads, dout, q, k, v, out, lse, "ieee", ql, kl, **kw)


def test_backward_with_lengths_is_deterministic(emulate):
    # the warps in two other orders: the same bits (each CTA owns its dk/dv rows, the dQ
    # kernel its dq rows; nothing is added by atomics with deterministic=True)
    q, k, v, dout = _padded("deterministic", np.float16)
    kw = dict(causal=True, enable_gqa=True, q_lengths=np.array(Q_LENS), kv_lengths=np.array(KV_LENS))
    out, lse = cupyflash.attention(q, k, v, backend="numpy", return_lse=True, **kw)
    runs = []
    for seed in (1, 2):
        emulate(80, seed=seed)
        runs.append(cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", **kw))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_the_launch_order_puts_the_most_work_first():
    from cupyflash._run import sequence_defines, sequence_table

    # per sequence: first query row, query rows, first key, keys -> the (4, B) spans
    spans = np.array([[0, 5, 9, 20], [5, 4, 11, 0], [0, 3, 3, 10], [3, 6, 2, 7]]).T
    table = sequence_table(spans)
    assert table.dtype == np.int32 and table.shape == (5, 4)
    # work = query rows x keys (no key counts as one): 100, 4, 30, 42
    assert table[0].tolist() == [0, 3, 2, 1]
    np.testing.assert_array_equal(table[1:], spans)
    assert sequence_defines(np.zeros((4, 3), np.int64)) == (("CF_SEQ_LENGTHS", "1"),)   # padded
    assert sequence_defines(spans) == (("CF_SEQ_LENGTHS", "2"),)                         # packed
    with pytest.raises(NotImplementedError, match="2\\^31"):
        sequence_table(np.array([[0], [2**31], [0], [1]]))


@pytest.mark.parametrize("case", ["gqa-4:1", "mqa-8:1-split", "window-not-packed"])
def test_decode_packs_the_query_heads_of_a_kv_head(emulate, case):
    # one query row per sequence (a decode step over a dense cache): each kv head's query
    # heads are the rows of one query block, so the grid has a block per (sequence, kv head)
    heads = {"gqa-4:1": (8, 2), "mqa-8:1-split": (8, 1), "window-not-packed": (8, 2)}[case]
    spy = emulate(80, **({"splits": 2} if "split" in case else {}))
    kv_lens = [150, 17, 0]
    q, k, v, _ = _padded(f"decode-{case}", np.float16, [1, 1, 1], kv_lens, heads=heads, shape=(1, 150))
    kw = dict(window=(16, 0)) if "window" in case else dict(causal=True)
    out, lse = cupyflash.attention(q, k, v, kv_lengths=np.array(kv_lens), backend="emulator", return_lse=True,
                                   enable_gqa=True, **kw)
    (name, grid), *rest = spy.launches
    blocks = len(kv_lens) * (heads[0] if "window" in case else heads[1])   # a query block per what
    assert name.startswith("cf::fwd_mma_kernel") and grid[0] == blocks
    assert [n for n, _ in rest] == (["cf::fwd_combine_kernel<__half, float>"] if "split" in case else [])
    _check_forward_per_sequence(out, lse, q, k, v, "ieee", [1, 1, 1], kv_lens, enable_gqa=True, **kw)
