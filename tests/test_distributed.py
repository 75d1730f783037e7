"""cupyflash.distributed: ring attention over MPI (mpiexec -n 1..4) and over a fake NCCL communicator.

The MPI cases run in tests/_mpi_ring_worker.py, one launch per world size; the worker
compares every rank's shards with the single-process result itself and prints a summary.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import distributed
from cupyflash.distributed import ring_attention, ring_attention_backward, shard, unshard
from cupyflash.reference import naive_attention, naive_attention_backward

from _util import assert_close, assert_grad_close, assert_lse_close, random_qkv

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "_mpi_ring_worker.py"
TIMEOUT = 120          # seconds for one launch; a hang fails the test instead of the run


def mpiexec(n, *args, timeout=TIMEOUT):
    """Run the worker under ``mpiexec -n n``; (returncode, stdout + stderr, seconds)."""
    on_ci = os.environ.get("CI") == "true"   # CI installs the test extra: missing MPI is an error there
    if on_ci:
        import mpi4py  # noqa: F401
    else:
        pytest.importorskip("mpi4py")
    exe = shutil.which("mpiexec")
    if exe is None:
        if on_ci:
            pytest.fail("mpiexec not on PATH although CI installs the mpich wheel (the test extra)")
        pytest.skip("mpiexec not on PATH (pip install mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    # a session of its own: on a hang, the whole launch (mpiexec, its proxies, the ranks) is killed
    proc = subprocess.Popen([exe, "-n", str(n), sys.executable, str(WORKER), *args], cwd=TESTS, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {n} {' '.join(args)} did not end within {timeout} s (a hang):\n{log[-4000:]}")
    return proc.returncode, log, time.perf_counter() - start


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_equals_single_process_attention_under_mpiexec(n):
    rc, log, _ = mpiexec(n)
    summary = re.search(r"RING-SUMMARY size=(\d+) cases=(\d+) checks=(\d+) failures=(\d+)", log)
    assert rc == 0 and summary, log[-4000:]
    size, cases, checks, failures = map(int, summary.groups())
    assert failures == 0, log[-4000:]
    # every case made its 6 checks (out, lse, unshard, dq, dk, dv) on every rank
    assert (size, checks) == (n, 6 * cases * n) and cases >= 20


def test_a_raising_rank_ends_the_job_instead_of_hanging():
    rc, log, seconds = mpiexec(3, "raise", timeout=60)
    assert rc != 0, log[-4000:]
    assert "planted failure on rank 1" in log and "rank 1 of 3 failed; aborting the ring" in log
    assert "NOT-ABORTED" not in log
    assert seconds < 60


def test_bad_input_on_one_rank_raises_on_every_rank():
    rc, log, _ = mpiexec(3, "badinput", timeout=60)
    raised = dict(re.findall(r"RAISED (\d) (\w+)", log))
    assert rc == 0 and raised == {"0": "ValueError", "1": "TypeError", "2": "ValueError"}, log[-4000:]
    assert "the input of rank(s) [1] is invalid" in log


# ---------------------------------------------------------------- geometry, without communication


def brute_visible(nq, nk, qa, ka, lo, hi):
    j = ka + np.arange(nk)[None, :]
    i = qa + np.arange(nq)[:, None]
    ok = np.ones((nq, nk), dtype=bool)
    if lo is not None:
        ok &= j - i >= lo
    if hi is not None:
        ok &= j - i <= hi
    return ok


def test_pair_slices_give_exactly_the_global_band():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        nq, nk = rng.integers(1, 9, size=2)
        qa, ka = rng.integers(0, 30, size=2)
        lo = None if rng.random() < 0.3 else -int(rng.integers(0, 12))
        hi = None if rng.random() < 0.3 else int(rng.integers(0, 12))
        expected = brute_visible(nq, nk, qa, ka, lo, hi)
        got = np.zeros_like(expected)
        cut = distributed._pair_slices((qa, qa + nq), (ka, ka + nk), (lo, hi))
        if cut is not None:
            (r0, r1), (c0, c1), (left, right) = cut
            assert (left is None or left >= 0) and (right is None or right >= 0)
            diff = np.arange(c1 - c0)[None, :] - np.arange(r1 - r0)[:, None] - ((c1 - c0) - (r1 - r0))
            block = np.ones((r1 - r0, c1 - c0), dtype=bool)
            if left is not None:
                block &= diff >= -left
            if right is not None:
                block &= diff <= right
            got[r0:r1, c0:c1] = block
            # the cut keeps only rows that see a key and keys that some row sees
            assert block.any(axis=1).all() and block.any(axis=0).all()
        np.testing.assert_array_equal(got, expected, err_msg=f"{(nq, nk, qa, ka, lo, hi)}")


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_layouts_cover_every_row_once_as_array_split_cuts(layout):
    for length in (8, 11, 3):
        for size in (1, 2, 3, 4):
            rows = [np.arange(a, b) for r in range(size)
                    for a, b in distributed._ranges(length, size, r, layout)]
            np.testing.assert_array_equal(np.sort(np.concatenate(rows)), np.arange(length))
            parts = 2 * size if layout == "zigzag" else size
            assert sorted(len(x) for x in rows) == sorted(len(x) for x in np.array_split(np.arange(length), parts))
    if layout == "zigzag":     # rank r holds chunks r and 2n - 1 - r
        assert distributed._ranges(16, 4, 1, "zigzag") == [(2, 4), (12, 14)]


def test_backward_of_a_pair_with_the_global_out_and_lse_is_its_share():
    """The claim the ring backward rests on: attention_backward of queries against one key
    block, given the *global* out and lse, is that block's exact share of the gradients."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, (2, 10, 8), (2, 13, 8), (2, 13, 5), np.float64)
    dout = rng.standard_normal((2, 10, 5))
    out, lse = cupyflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse)
    dq_sum = np.zeros_like(dq)
    for a, b in ((0, 4), (4, 5), (5, 13)):
        dq_p, dk_p, dv_p = cupyflash.attention_backward(dout, q, k[:, a:b], v[:, a:b], out, lse)
        dq_sum += dq_p
        np.testing.assert_allclose(dk_p, dk[:, a:b], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dv_p, dv[:, a:b], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dq_sum, dq, rtol=1e-12, atol=1e-13)
    # with the block's own (local) out and lse instead, the share is wrong
    o_loc, lse_loc = cupyflash.attention(q, k[:, :4], v[:, :4], return_lse=True)
    _, dk_loc, _ = cupyflash.attention_backward(dout, q, k[:, :4], v[:, :4], o_loc, lse_loc)
    assert not np.allclose(dk_loc, dk[:, :4])


def test_cuda_awareness_is_read_from_the_memory_kinds():
    listed = distributed._lists_cuda_memory
    assert listed("mpi,system,cuda") and listed("mpi,system,cuda:device") and listed("cuda:host:device")
    assert not listed("mpi,system") and not listed("cuda:host") and not listed("") and not listed("rocm:device")


def test_importing_cupyflash_does_not_import_mpi4py():
    code = "import sys, cupyflash, cupyflash.distributed; print('mpi4py' in sys.modules, 'cupy' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_comm_of_another_kind_is_a_type_error():
    q = np.ones((4, 8))
    with pytest.raises(TypeError, match="`comm` must be an mpi4py.MPI.Comm"):
        ring_attention(q, q, q, comm=object())
    with pytest.raises(TypeError, match="`comm` must be an mpi4py.MPI.Comm"):
        shard(q, comm="world")


# ---------------------------------------------------------------- the NCCL path, on a fake


class FakeNcclWorld:
    """The ranks of a fake NCCL job, as threads of this process."""

    def __init__(self, size):
        self.size = size
        self.boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.barrier = threading.Barrier(size)
        self.deposits = [b""] * size
        self.aborted = []


class FakeNcclCommunicator:
    """The interface of ``cupy.cuda.nccl.NcclCommunicator`` the ring uses (pointers and byte
    counts), over host memory: sends are queued, receives wait for theirs."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def rank_id(self):
        return self.rank

    def size(self):
        return self.world.size

    def send(self, sendbuf, count, datatype, peer, stream):
        assert datatype == FakeRuntime.byte
        self.world.boxes[(self.rank, peer)].put(ctypes.string_at(sendbuf, count))

    def recv(self, recvbuf, count, datatype, peer, stream):
        assert datatype == FakeRuntime.byte
        deadline = time.monotonic() + 30
        while True:           # as NCCL's error handling would: an aborted job fails the wait
            if self.world.aborted:
                raise RuntimeError(f"rank {self.rank}: a peer aborted the communicator")
            try:
                data = self.world.boxes[(peer, self.rank)].get(timeout=0.02)
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "fake recv waited 30 s"
        assert len(data) == count, (len(data), count)
        ctypes.memmove(recvbuf, data, count)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802 - NCCL's name
        nbytes = count * (8 if datatype == FakeRuntime.int64 else 1)
        self.world.deposits[self.rank] = ctypes.string_at(sendbuf, nbytes)
        self.world.barrier.wait(timeout=30)
        ctypes.memmove(recvbuf, b"".join(self.world.deposits), nbytes * self.world.size)
        self.world.barrier.wait(timeout=30)

    def abort(self):
        self.world.aborted.append(self.rank)


class FakeRuntime:
    """Host stand-in for _CupyRuntime: NumPy arrays, no streams; checks the group calls pair up."""

    kind, xp, byte, int64 = "numpy", np, 7, 9
    depth = threading.local()

    def side_stream(self):
        return "side"

    def ptr(self, a):
        assert a.flags.c_contiguous
        return a.ctypes.data

    def stream_ptr(self, stream):
        return 0

    def record(self, stream=None):
        return stream

    def wait_event(self, event, stream=None):
        pass

    def synchronize(self, stream):
        pass

    def group_start(self):
        self.depth.n = getattr(self.depth, "n", 0) + 1

    def group_end(self):
        self.depth.n -= 1
        assert self.depth.n == 0


def run_ranks(size, fn):
    world = FakeNcclWorld(size)
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(fn, FakeNcclCommunicator(world, r)) for r in range(size)]
        return [f.result(timeout=60) for f in futures], world


@pytest.mark.parametrize("size,layout", [(1, "contiguous"), (3, "zigzag"), (4, "contiguous")])
def test_nccl_path_on_a_fake_communicator_equals_single_process(monkeypatch, size, layout):
    monkeypatch.setattr(distributed, "_nccl_runtime", FakeRuntime)
    rng = np.random.default_rng(size)
    q, k, v = random_qkv(rng, (4, 11, 8), (2, 11, 8), (2, 11, 6), np.float64)
    dout = rng.standard_normal((4, 11, 6))
    opts = dict(causal=True, window=(5, None), enable_gqa=True)
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **opts)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **opts)

    def rank(comm):
        sq, sk, sv, sd = (shard(x, comm, layout) for x in (q, k, v, dout))
        o, s = ring_attention(sq, sk, sv, comm=comm, return_lse=True, layout=layout, **opts)
        g = ring_attention_backward(sd, sq, sk, sv, o, s, comm=comm, layout=layout, **opts)
        return [unshard(x, comm, layout) for x in (o, s[..., None], *g)]

    results, world = run_ranks(size, rank)
    assert not world.aborted
    for got in results:
        for a, b in zip(got, (out, lse[..., None], *grads)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_nccl_path_aborts_the_communicator_and_reraises(monkeypatch):
    monkeypatch.setattr(distributed, "_nccl_runtime", FakeRuntime)
    q = np.random.default_rng(0).standard_normal((2, 8, 4))

    class Failing(FakeNcclCommunicator):
        def send(self, *args):
            if self.rank == 1:
                raise RuntimeError("link down")
            super().send(*args)

    def rank(comm):
        try:
            ring_attention(shard(q, comm), shard(q, comm), shard(q, comm), comm=comm)
        except RuntimeError as exc:
            return str(exc)
        return None

    world = FakeNcclWorld(2)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(rank, Failing(world, r)) for r in range(2)]
        results = [f.result(timeout=30) for f in futures]
    assert results == ["rank 0: a peer aborted the communicator", "link down"]
    assert sorted(world.aborted) == [0, 1]


def test_numpy_arrays_over_nccl_are_a_type_error(monkeypatch):
    class CupyOnly(FakeRuntime):
        kind = "cupy"

    monkeypatch.setattr(distributed, "_nccl_runtime", CupyOnly)
    q = np.ones((4, 8))
    with pytest.raises(TypeError, match="NumPy arrays need an mpi4py communicator"):
        run_ranks(1, lambda comm: ring_attention(q, q, q, comm=comm))


def test_shard_lengths_not_of_the_layout_raise_on_every_rank(monkeypatch):
    monkeypatch.setattr(distributed, "_nccl_runtime", FakeRuntime)
    q = np.ones((2, 12, 4))

    def rank(comm):
        mine = q[:, : (7 if comm.rank_id() == 0 else 5)]     # 7 + 5: array_split gives 6 + 6
        with pytest.raises(ValueError, match=r"shard lengths \[7, 5\].*'contiguous' layout of L = 12"):
            ring_attention(mine, mine, mine, comm=comm)
        return True

    assert run_ranks(2, rank)[0] == [True, True]


def test_bad_layout_and_unequal_qkv_lengths_are_value_errors(monkeypatch):
    monkeypatch.setattr(distributed, "_nccl_runtime", FakeRuntime)
    q = np.ones((2, 6, 4))
    with pytest.raises(ValueError, match="`layout` must be one of 'contiguous', 'zigzag'"):
        run_ranks(1, lambda comm: ring_attention(q, q, q, comm=comm, layout="striped"))
    with pytest.raises(ValueError, match=r"one length on axis -2.*\[6, 5, 5\]"):
        run_ranks(1, lambda comm: ring_attention(q, q[:, :5], q[:, :5], comm=comm))


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_nccl_world_of_one_on_the_gpu_equals_attention(dtype):
    import cupy as cp
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, (4, 300, 64), (2, 300, 64), (2, 300, 64), dtype)
    dout = rng.standard_normal((4, 300, 64)).astype(dtype)
    q, k, v, dout = (cp.asarray(x) for x in (q, k, v, dout))
    opts = dict(causal=True, window=(100, None), enable_gqa=True)
    out, lse = ring_attention(q, k, v, comm=comm, return_lse=True, layout="zigzag", **opts)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm=comm, layout="zigzag", **opts)
    host = [x.get() for x in (q, k, v, dout)]
    ref, ref_lse = naive_attention(*host[:3], return_lse=True, **opts)
    ref_grads = naive_attention_backward(host[3], *host[:3], **opts)
    assert all(isinstance(x, cp.ndarray) and x.dtype == dtype for x in (out, *grads))
    assert_close(out.get(), ref, dtype)
    assert_lse_close(lse.get(), ref_lse, dtype)
    for what, got, expected in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_grad_close(got.get(), expected, dtype, what=what)
