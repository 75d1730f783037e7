"""CPU emulation of the CUDA kernels in ``cuda_src/`` (DESIGN.md section 5).

The unchanged kernel sources are compiled by g++ against an emulation header
(``include/cuda_emu.h``) and a twin of the PTX-wrapper header
(``include/ptx.cuh``), and run block by block on the CPU, each block's threads
as fibers (``src/runtime.cpp``).  The emulator is meant to find bugs:

- Threads switch only at ``__syncthreads()``, warp collectives and exit; the
  order in which they run between those points, and the order of the blocks,
  are shuffled with the executor's seed.
- Barriers are typed.  ``__syncthreads()`` waits for every live thread at the
  *same* call site; a warp collective (``__syncwarp``, shuffles, votes,
  ``mma``, ``ldmatrix``) waits for every lane of its mask at the same kind of
  operation and is computed from all lanes' operands with the PTX fragment
  layouts.  A block where no thread can proceed is reported as a deadlock;
  lanes that exited or diverge to another collective are errors.
- ``cp.async`` copies are queued per thread and performed -- source read, zero
  fill, destination write -- when that thread's ``cp_async_wait<N>`` retires
  their group (so data read too early is stale, never "lucky").  Copies still
  pending when a thread exits are an error.
- Dynamic shared memory is poisoned with ``0xFF`` (NaN for every float type)
  at the start of every block.
- With ``race_check=True`` (compiled-in instrumentation) every shared-memory
  byte remembers its last writer and its readers since the last barrier:
  read-after-write, write-after-write and write-after-read between threads
  not ordered by ``__syncthreads()`` are reported, naming both threads, the
  byte offset and both source lines.  Within a warp, a full-mask
  ``__syncwarp()`` orders accesses (a partial mask, a shuffle, ``ldmatrix`` or
  ``mma`` does not).  ``ldmatrix`` reads count as reads by the lanes that
  receive the data; a ``cp.async`` counts as a write from its issue (any access
  to its bytes by another thread, or by the issuing thread before its wait, is
  an error) until it lands.  Accesses outside the launch's shared memory,
  misaligned ``ldmatrix`` rows and ``cp.async`` addresses are errors too.
- Crashes in kernel code (a wild global access, a stack overflow) and threads
  that spin without ever reaching a synchronisation point become errors.

Not checked: races on global memory (between threads or blocks), atomics,
``__launch_bounds__``, denormal flushing of float arithmetic (except
``exp2_approx``, which flushes like ``ex2.approx.ftz``).

>>> from cupyflash.emulator import EmulatorExecutor, EmulatorError, emulator_available
"""

from ._build import EmulatorBuildError, EmulatorError
from ._executor import EmulatorExecutor, emulator_available

__all__ = ["EmulatorBuildError", "EmulatorError", "EmulatorExecutor", "emulator_available"]
