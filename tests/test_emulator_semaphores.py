"""The emulator's semaphores (barriers.cuh's semaphore_wait / semaphore_post): blocks
that wait are suspended and others run, the sum the turns order matches a NumPy model
bit for bit whatever order the blocks start in, and each rule broken in
``emulator_planted/semaphore_planted.cu`` is reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cupyflash.emulator import EmulatorError, EmulatorExecutor, emulator_available

from _emulator_util import planted_params

pytestmark = pytest.mark.skipif(not emulator_available(), reason="the emulator needs g++")

SOURCE = str(Path(__file__).resolve().parent / "emulator_planted" / "semaphore_planted.cu")
KERNELS = [f"semaphore_turns<{k}>" for k in range(9)]
BLOCKS = 6


def _executor(seed, shuffle=True, race_check=True):
    e = EmulatorExecutor(arch=90, seed=seed, shuffle=shuffle, race_check=race_check)
    e.compile(SOURCE, KERNELS)
    return e


@pytest.fixture(scope="module")
def ex():
    return _executor(5)


def _rows(seed=0):
    """Rows whose float32 sum depends on the order: magnitudes 2**-20 .. 2**20, mixed signs."""
    rng = np.random.default_rng(seed)
    scale = np.exp2(rng.integers(-20, 21, size=(BLOCKS, 128)))
    return (rng.standard_normal((BLOCKS, 128)) * scale).astype(np.float32)


def _run(executor, fault, rows):
    out = np.zeros(128, np.float32)
    ticket = np.zeros(1, np.int32)
    executor.launch(SOURCE, f"semaphore_turns<{fault}>", BLOCKS, 64, 512,
                    planted_params(rows.ravel(), out, ticket, 128, 0))
    return out, int(ticket[0])


def in_block_order(rows):
    """The model: float32 additions into a zeroed accumulator, block 0 first."""
    acc = np.zeros(rows.shape[1], np.float32)
    for r in rows:
        acc = (acc + r).astype(np.float32)
    return acc


def test_the_model_depends_on_the_order():
    # (else the tests below could not tell the turns from any schedule)
    rows = _rows()
    assert not np.array_equal(in_block_order(rows), in_block_order(rows[::-1]))


@pytest.mark.parametrize("seed, shuffle", [(1, True), (2, True), (3, True), (4, False)])
def test_turns_add_in_block_order_whatever_order_the_blocks_start_in(seed, shuffle):
    rows = _rows()
    out, ticket = _run(_executor(seed, shuffle=shuffle), 0, rows)
    np.testing.assert_array_equal(out.view(np.uint32), in_block_order(rows).view(np.uint32))
    assert ticket == BLOCKS


def test_without_turns_the_sum_follows_the_schedule(ex):
    # the faulty kernel is not an error, but its sum is not the model's for some start order
    rows = _rows()
    sums = {_run(_executor(seed), 1, rows)[0].tobytes() for seed in range(1, 5)}
    assert len(sums) > 1 or in_block_order(rows).tobytes() not in sums


@pytest.mark.parametrize("fault, match", [
    (2, r"semaphore_post\(0x[0-9a-f]+, \d\) .*while thread \(\d+,0,0\) \[warp 0, lane \d+\] has 1 bulk "
        r"reductions whose additions are not complete"),
    (4, r"semaphore_wait\(0x[0-9a-f]+, \d\) .*returned with the value posted by block \(\d,0,0\), which comes "
        r"after this block in launch order"),
    (5, r"deadlock: every started block waits for a semaphore and no block is left to start \(block \(\d,0,0\): "
        r"thread 0 waits at semaphore_wait\(0x[0-9a-f]+, \d\)"),
    (6, r"semaphore_wait on 0x[0-9a-f]+, which is in shared memory or a thread's stack"),
    (7, r"bulk_reduce_add_f32 after the block acquired a semaphore, with no fence_proxy_async_global\(\) by "
        r"this thread since"),
    (8, r"semaphore_post\(0x[0-9a-f]+, \d\) .*completed bulk reductions and ran no fence_proxy_async_global\(\) "
        r"after them"),
], ids=["post-before-completion", "waits-for-a-later-block", "deadlock", "in-shared-memory", "no-reader-fence",
        "no-writer-fence"])
def test_planted_faults_are_reported(ex, fault, match):
    with pytest.raises(EmulatorError, match=match):
        _run(ex, fault, _rows())


def test_a_post_not_ordered_after_the_lanes_completion_is_reported():
    # threads in index order: lane 0 yields at its one-lane __syncwarp, the other lanes
    # complete their additions, and nothing joins their clocks to lane 0's before its post
    with pytest.raises(EmulatorError, match=r"the bulk reductions thread \(\d+,0,0\) \[warp 0, lane \d+\] "
                                             r"completed are not ordered before the post"):
        _run(_executor(6, shuffle=False), 3, _rows())


def test_without_race_checks_the_ordering_check_is_off_and_the_rest_holds():
    # the happens-before check needs the vector clocks; completion and turns do not
    e = _executor(7, shuffle=True, race_check=False)
    rows = _rows(1)
    out, _ = _run(e, 0, rows)
    np.testing.assert_array_equal(out, in_block_order(rows))
    with pytest.raises(EmulatorError, match="whose additions are not complete"):
        _run(e, 2, rows)
