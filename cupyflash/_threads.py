"""The CPU path's worker threads and the BLAS thread limit inside them.

The CPU path splits its work into independent tasks (a query block of a
(batch, head) slice in the forward, a key block in the backward) and runs them
on a pool of threads, each calling BLAS single-threaded: a few large tasks per
core instead of thousands of small BLAS calls that each wake (and, on a busy
machine, wait for) the BLAS library's own threads.

Thread count
------------
``CUPYFLASH_NUM_THREADS`` (read at every call) sets it: a positive integer,
used as given, or ``auto`` (the default): the cores this process may run on
(``os.sched_getaffinity``: a ``taskset`` or container CPU set counts), capped
by ``OMP_NUM_THREADS`` where that is set, the usual per-process thread budget.
BLAS settings (``OPENBLAS_NUM_THREADS``, ``threadpoolctl`` limits) concern the
BLAS library's threads, which cupyflash holds to one per worker anyway; they do
not change the worker count.  A problem too small to repay a hand-off to the
pool runs in the calling thread.

While a call runs, the BLAS libraries that ``threadpoolctl`` finds are held to
one thread (a process-wide setting, restored when the last concurrent call
returns).  Task boundaries and the order in which the backward sums the
tasks' partial gradients do not depend on the thread count, so results are
bit-identical whatever it is.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["ENV_VAR", "num_threads", "ordered_map", "single_threaded_blas"]

ENV_VAR = "CUPYFLASH_NUM_THREADS"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


def parse_num_threads(value: str | None) -> int | None:
    """The thread count that ``value`` (of ``CUPYFLASH_NUM_THREADS``) asks for; None for auto.

    >>> parse_num_threads("3"), parse_num_threads("auto"), parse_num_threads(None)
    (3, None, None)
    """
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_VAR} must be a positive integer or 'auto', got {value!r}")
    return n


class _Threads:
    """The worker pool and the BLAS limit, shared by all calls (one lock guards both)."""

    def __init__(self):
        self._blas = None          # threadpoolctl's BLAS library controllers, found once
        self.reset()

    def reset(self) -> None:
        """Fresh state: at start-up, and in a forked child, where the parent's worker
        threads do not exist (a pool that still counted them would never run a task)
        and the lock may have been held by one of the parent's threads."""
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._active = 0           # calls inside single_threaded_blas
        self._saved: list[int] = []  # the BLAS thread counts before the first of them

    def _blas_libs(self):
        if self._blas is None:
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController().select(user_api="blas").lib_controllers
        return self._blas

    def num_threads(self) -> int:
        explicit = parse_num_threads(os.environ.get(ENV_VAR))
        if explicit is not None:
            return explicit
        try:
            budget = int(os.environ.get("OMP_NUM_THREADS", "0").split(",")[0])
        except ValueError:
            budget = 0
        return min(_cores(), budget) if budget > 0 else _cores()

    @contextlib.contextmanager
    def single_threaded_blas(self):
        with self._lock:
            libs = self._blas_libs()
            if self._active == 0:
                self._saved = [lib.num_threads for lib in libs]
                for lib in libs:
                    lib.set_num_threads(1)
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    for lib, n in zip(libs, self._saved):
                        lib.set_num_threads(n)

    def pool(self, n: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_size != n:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="cupyflash")
                self._pool_size = n
            return self._pool


_THREADS = _Threads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_THREADS.reset)


def num_threads() -> int:
    """The number of worker threads a CPU-path call uses now (see the module docstring).

    >>> num_threads() >= 1
    True
    """
    return _THREADS.num_threads()


def single_threaded_blas():
    """Context manager: BLAS held to one thread inside (nests; thread-safe)."""
    return _THREADS.single_threaded_blas()


def ordered_map(fn, items, workers: int):
    """Yield ``fn(item)`` for each item, in the items' order, computed on ``workers`` threads.

    At most ``2 * workers`` items are in flight, so the items (and results) held
    at once stay bounded.  ``items`` is consumed in the calling thread.  If a
    call raises, the items in flight are waited for before the error propagates
    (none still writes into an output after this returns).

    >>> list(ordered_map(lambda x: x * x, range(5), workers=2))
    [0, 1, 4, 9, 16]
    """
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    pool = _THREADS.pool(workers)
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            if not future.cancelled():
                with contextlib.suppress(BaseException):
                    future.result()
