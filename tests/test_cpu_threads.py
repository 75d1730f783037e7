"""The CPU path's worker threads: same bits whatever the thread count, BLAS held to one
thread inside a call and restored after, ``CUPYFLASH_NUM_THREADS`` read and checked."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import cupyflash
from cupyflash import _cpu, _threads
from cupyflash.reference import naive_attention

from _util import assert_close, random_qkv

# One representative shape per branch: GQA (two vectorised axes) with a window,
# causal with several heads, and plain attention over a broadcast leading batch
# axis.  Each is large enough for the pool (see _cpu._MIN_PARALLEL_WORK) and has
# several query blocks and several key blocks.
CASES = {
    "gqa-window": (((2, 4, 600, 16), (2, 2, 600, 16), (2, 2, 600, 16)),
                   dict(enable_gqa=True, window=(100, 30))),
    "causal": (((3, 700, 32), (3, 900, 32), (3, 900, 24)), dict(causal=True)),
    "broadcast": (((2, 2, 520, 16), (1, 2, 1100, 16), (1, 2, 1100, 16)), {}),
}


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def _run(case, n, monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, str(n))
    shapes, kw = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v = random_qkv(rng, *shapes, np.float32)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)
    return (q, k, v, kw), (out, lse) + tuple(grads)


@pytest.mark.parametrize("case", list(CASES))
def test_results_are_bit_identical_for_any_thread_count(case, monkeypatch):
    (q, k, v, kw), serial = _run(case, 1, monkeypatch)
    assert_close(serial[0], naive_attention(q, k, v, **kw), np.float32)
    for n in (2, 3):
        _, threaded = _run(case, n, monkeypatch)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], serial, threaded):
            assert np.array_equal(a, b), f"{name} differs between 1 and {n} threads"


def _recording_query_block(monkeypatch):
    """Record (thread name, BLAS thread counts) in every forward task."""
    seen = []
    original = _cpu._query_block

    def recording(*args, **kwargs):
        seen.append((threading.current_thread().name, _blas_threads()))
        return original(*args, **kwargs)

    monkeypatch.setattr(_cpu, "_query_block", recording)
    return seen


def test_tasks_run_on_the_pool_with_blas_on_one_thread(monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, "2")
    seen = _recording_query_block(monkeypatch)
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, (4, 600, 32), (4, 600, 32), (4, 600, 32), np.float32)
    with threadpool_limits(limits=2, user_api="blas"):
        cupyflash.attention(q, k, v)
        after = _blas_threads()
    assert len(seen) >= 4
    assert all(name.startswith("cupyflash") for name, _ in seen), seen
    assert all(set(blas) == {1} for _, blas in seen), seen
    assert set(after) == {2}, "the BLAS thread count was not restored"


def test_a_small_problem_runs_in_the_calling_thread(monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, "2")
    seen = _recording_query_block(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, (2, 50, 16), (2, 60, 16), (2, 60, 16), np.float32)
    cupyflash.attention(q, k, v)
    assert {name for name, _ in seen} == {threading.current_thread().name}


def test_concurrent_calls_restore_the_blas_thread_count(monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, "2")
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, (2, 500, 32), (2, 500, 32), (2, 500, 32), np.float32)
    with threadpool_limits(limits=2, user_api="blas"):
        with ThreadPoolExecutor(4) as users:
            results = list(users.map(lambda _: cupyflash.attention(q, k, v), range(8)))
        assert set(_blas_threads()) == {2}
    assert all(np.array_equal(r, results[0]) for r in results)


def test_auto_is_the_usable_cores_capped_by_omp_num_threads(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(_threads.ENV_VAR, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with threadpool_limits(limits=1, user_api="blas"):     # a BLAS limit is BLAS's business
        assert _threads.num_threads() == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _threads.num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 5))
    assert _threads.num_threads() == cores
    monkeypatch.setenv(_threads.ENV_VAR, str(cores + 1))   # an explicit count wins
    assert _threads.num_threads() == cores + 1


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_is_refused_before_any_work(value, monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, value)
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, (2, 600, 32), (2, 600, 32), (2, 600, 32), np.float32)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    with pytest.raises(ValueError, match=f"{_threads.ENV_VAR} must be a positive integer"):
        cupyflash.attention(q, k, v, out=out)
    assert np.isnan(out).all(), "out was written before the error"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_working_pool(monkeypatch):
    monkeypatch.setenv(_threads.ENV_VAR, "2")
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, (2, 600, 32), (2, 600, 32), (2, 600, 32), np.float32)
    expected = cupyflash.attention(q, k, v)              # the parent's pool now has threads
    pid = os.fork()
    if pid == 0:                                         # the child: exit status 0 if it matches
        try:
            os._exit(0 if np.array_equal(cupyflash.attention(q, k, v), expected) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's call did not finish (a pool with no threads?)")
    assert os.waitstatus_to_exitcode(done[1]) == 0
