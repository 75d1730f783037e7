"""Launching ``cuda_src/`` kernels on the CPU emulator.

The executor takes the same launch configuration as the GPU path (grid, block,
dynamic shared memory, one params struct by value) and runs the grid block by
block on the calling thread; see ``src/runtime.cpp`` for the execution model.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from .._arch import multiprocessors as representative_multiprocessors
from .._arch import sm_limits
from ._build import EmulatorError, ModuleCache, find_toolchain, symbolize

__all__ = ["EmulatorExecutor", "emulator_available"]

_ERRBUF_BYTES = 16384


class _LaunchDesc(ctypes.Structure):
    """Mirror of ``cfemu_launch_desc`` in include/cfemu_abi.h."""

    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("smem_bytes", ctypes.c_uint64),
        ("seed", ctypes.c_uint64),
        ("params", ctypes.c_void_p),
        ("params_size", ctypes.c_uint64),
        ("params_align", ctypes.c_uint64),
        ("stack_bytes", ctypes.c_uint64),
        ("kernel_name", ctypes.c_char_p),
        ("shuffle", ctypes.c_int32),
        ("race_check", ctypes.c_int32),
        ("accum_mode", ctypes.c_int32),
        ("accum_extra_bits", ctypes.c_int32),
    ]


# How mma.sync and wgmma sum their products; see EmulatorExecutor's ``accumulation``.
ACCUMULATION_ENV = "CUPYFLASH_EMULATOR_ACCUMULATION"
_ACCUM_EXACT, _ACCUM_TRUNCATE = 0, 1
DEFAULT_EXTRA_BITS = 3


def _parse_accumulation(value) -> tuple[int, int]:
    """``(mode, extra_bits)`` for the runtime from ``"exact"``, ``"truncate"`` or ``"truncate:E"``."""
    what = "accumulation" if value is not None else f"${ACCUMULATION_ENV}"
    text = value if value is not None else os.environ.get(ACCUMULATION_ENV, "exact")
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected 'exact', 'truncate' or 'truncate:E' (a str), got {text!r}")
    mode, colon, bits = text.strip().partition(":")
    if mode == "exact" and not colon:
        return _ACCUM_EXACT, 0
    if mode == "truncate":
        if not colon:
            return _ACCUM_TRUNCATE, DEFAULT_EXTRA_BITS
        if bits.isdigit() and 0 <= int(bits) <= 20:
            return _ACCUM_TRUNCATE, int(bits)
    raise ValueError(f"{what}: expected 'exact', 'truncate' or 'truncate:E' with E extra bits in 0..20, "
                     f"got {text!r}")


_CACHE_LOCK = threading.Lock()
_CACHE: ModuleCache | None = None


def _module_cache() -> ModuleCache:
    """The process-wide cache of built emulator libraries."""
    global _CACHE
    with _CACHE_LOCK:
        if _CACHE is None:
            _CACHE = ModuleCache()
        return _CACHE


def emulator_available() -> tuple[bool, str]:
    """Whether the CPU emulator can run here: ``(ok, reason)``.

    It needs Linux, GCC (``g++`` or ``$CXX``) and the CUDA headers
    ``cuda_fp16.h``, ``cuda_bf16.h`` and ``crt/host_defines.h``.

    Examples
    --------
    >>> ok, reason = emulator_available()
    >>> isinstance(ok, bool) and isinstance(reason, str)
    True
    """
    try:
        tc = find_toolchain()
    except EmulatorError as exc:
        return False, str(exc)
    return True, f"{tc.version}; CUDA headers in {', '.join(tc.cuda_includes)}"


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)):
        value = (value,)
    try:
        dims = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError(f"{what}: expected an int or a tuple of 1 to 3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3:
        raise TypeError(f"{what}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))


def _params_bytes(params) -> tuple[bytes, int, int]:
    if isinstance(params, np.ndarray) and params.ndim == 0:
        params = params[()]
    if not isinstance(params, np.void) or params.dtype.fields is None:
        raise TypeError(
            "params: expected a NumPy structured scalar (np.void, or a 0-d structured array) whose dtype "
            f"mirrors the kernel's params struct, got {type(params).__name__}"
        )
    dtype = params.dtype
    if not dtype.isalignedstruct:
        raise TypeError("params: build the structured dtype with align=True so that it has the C struct layout")
    return params.tobytes(), dtype.itemsize, dtype.alignment


class EmulatorExecutor:
    """Runs ``cuda_src/`` kernels on the CPU, block by block, with strict checks.

    Parameters
    ----------
    arch : int, optional
        Compute capability the launch is checked against (80 = sm_80, 7.0 or
        later); it only bounds the dynamic shared memory (its
        ``cupyflash._arch.sm_limits`` opt-in limit) and is passed on for
        dispatch.
    seed : int, optional
        Seeds the order in which threads run between barriers and the order
        of the blocks.
    shuffle : bool, optional
        Randomise those orders (``False``: blocks and threads in index order).
    race_check : bool, optional
        Check every shared-memory access for races and bounds (the kernel
        module is compiled with instrumentation; slower).
    stack_bytes : int, optional
        Stack of each emulated thread.
    multiprocessors : int, optional
        SM count of the emulated GPU, which the forward's split-KV choice
        depends on (default: a representative GPU of ``arch``, 108 for sm_80).
    accumulation : {'exact', 'truncate', 'truncate:E'}, optional
        How mma.sync (f16, bf16, tf32) and wgmma sum an instruction's products
        and C.  ``'exact'``: exactly, rounded once to nearest.  ``'truncate'``:
        as tensor cores are measured to (Fasi et al. 2021): each term cut
        toward zero to ``24 + E`` bits below the leading bit of the largest
        term, the sum cut to float32 toward zero; ``E`` extra bits, default 3.
        Default: ``$CUPYFLASH_EMULATOR_ACCUMULATION``, else ``'exact'``.
        The f64 mma is always IEEE.

    Notes
    -----
    ``launch`` is thread-safe: each launch has its own threads, shared memory
    and checker state.  Modules are built by g++ on first use and cached on
    disk (``$CUPYFLASH_EMULATOR_CACHE``, default ``~/.cache/cupyflash/emulator``)
    and in the process.

    Examples
    --------
    A kernel that doubles an array, in a file of its own; its one argument
    is a struct, mirrored by a NumPy dtype built with ``align=True``
    (pointers as ``uint64`` holding ``array.ctypes.data``):

    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> from cupyflash.emulator import EmulatorExecutor
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "double.cu"
    >>> _ = path.write_text(
    ...     "struct P { const float* x; float* y; int n; };\\n"
    ...     "__global__ void double_it(const P p) {\\n"
    ...     "    const int i = blockIdx.x * blockDim.x + threadIdx.x;\\n"
    ...     "    if (i < p.n) p.y[i] = 2.0f * p.x[i];\\n"
    ...     "}\\n")
    >>> x = np.arange(100, dtype=np.float32)
    >>> y = np.zeros_like(x)
    >>> dt = np.dtype([("x", np.uint64), ("y", np.uint64), ("n", np.int32)], align=True)
    >>> params = np.array((x.ctypes.data, y.ctypes.data, x.size), dtype=dt)[()]
    >>> ex = EmulatorExecutor(arch=80, seed=0)
    >>> ex.launch(str(path), "double_it", grid=4, block=32, shared_mem=0, params=params)
    >>> bool(np.array_equal(y, 2 * x))
    True
    """

    def __init__(self, arch: int = 80, seed: int = 0, shuffle: bool = True, race_check: bool = True, *,
                 stack_bytes: int = 256 * 1024, multiprocessors: int | None = None,
                 accumulation: str | None = None):
        self._accum = _parse_accumulation(accumulation)
        self.accumulation = "exact" if self._accum[0] == _ACCUM_EXACT else f"truncate:{self._accum[1]}"
        self.arch = int(arch)
        if multiprocessors is None:
            multiprocessors = representative_multiprocessors(self.arch)
        if int(multiprocessors) < 1:
            raise ValueError(f"multiprocessors: expected a positive SM count, got {multiprocessors!r}")
        self.multiprocessors = int(multiprocessors)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.race_check = bool(race_check)
        self.stack_bytes = int(stack_bytes)
        # the largest dynamic shared memory a block may opt in to
        self.max_shared_mem = sm_limits(self.arch).shared_per_block_optin
        self._cache = _module_cache()

    def __repr__(self) -> str:
        return (f"EmulatorExecutor(arch={self.arch}, seed={self.seed}, shuffle={self.shuffle}, "
                f"race_check={self.race_check}, accumulation={self.accumulation!r})")

    def compile(self, entry: str, name_expressions) -> None:
        """Build ahead of time one module holding all of ``name_expressions``.

        Parameters
        ----------
        entry : str
            Kernel family file in ``cuda_src/`` (e.g. ``"fwd_simt.cu"``), or an
            absolute path to a ``.cu`` file elsewhere.
        name_expressions : sequence of str
            Instantiations, e.g. ``["fwd_simt_kernel<float, 64, 64, 64, true>"]``.

        Raises
        ------
        EmulatorBuildError
            The host compiler rejected the source (its messages are included).
        """
        if isinstance(name_expressions, str):
            name_expressions = [name_expressions]
        self._cache.module_for(entry, list(name_expressions), self.race_check)

    def launch(self, entry: str, name_expression: str, grid, block, shared_mem: int, params) -> None:
        """Run one kernel launch to completion on the CPU.

        Parameters
        ----------
        entry : str
            Kernel family file (see :meth:`compile`).
        name_expression : str
            The instantiation to run, spelled as for ``RawModule(name_expressions=...)``.
        grid, block : int or tuple of int
            Launch dimensions (1 to 3 each).
        shared_mem : int
            Dynamic shared memory per block, in bytes.
        params : numpy.void or 0-d structured numpy.ndarray
            The kernel's single argument: a structured scalar whose dtype (built
            with ``align=True``) mirrors the params struct; its raw bytes are
            passed.  Pointer fields hold host addresses (``array.ctypes.data``).

        Raises
        ------
        EmulatorError
            Bad launch configuration, races, deadlocks, divergent or incomplete
            warp collectives, out-of-bounds or misaligned shared-memory
            accesses, cp.async copies never waited for, or a params struct whose
            size or alignment differs from the kernel's.
        TypeError
            ``params`` is not a structured scalar built with ``align=True``.
        """
        g = _dims(grid, "grid")
        b = _dims(block, "block")
        smem = int(shared_mem)
        kernel = f"{name_expression} ({entry})"
        if min(g) < 1 or g[0] > 2**31 - 1 or g[1] > 65535 or g[2] > 65535:
            raise EmulatorError(f"kernel `{kernel}`: bad launch configuration: grid {g}")
        if min(b) < 1 or b[0] > 1024 or b[1] > 1024 or b[2] > 64 or b[0] * b[1] * b[2] > 1024:
            raise EmulatorError(
                f"kernel `{kernel}`: bad launch configuration: block {b} (at most 1024 threads, z <= 64)"
            )
        if not 0 <= smem <= self.max_shared_mem:
            raise EmulatorError(
                f"kernel `{kernel}`: bad launch configuration: {smem} bytes of dynamic shared memory "
                f"(sm_{self.arch} allows at most {self.max_shared_mem})"
            )
        raw, size, align = _params_bytes(params)
        fn = self._cache.function(entry, name_expression, self.race_check)
        buf = ctypes.create_string_buffer(raw, len(raw))
        name = kernel.encode()
        desc = _LaunchDesc(
            grid=(ctypes.c_uint32 * 3)(*g),
            block=(ctypes.c_uint32 * 3)(*b),
            smem_bytes=smem,
            seed=self.seed & (2**64 - 1),
            params=ctypes.addressof(buf),
            params_size=size,
            params_align=align,
            stack_bytes=self.stack_bytes,
            kernel_name=name,
            shuffle=int(self.shuffle),
            race_check=int(self.race_check),
            accum_mode=self._accum[0],
            accum_extra_bits=self._accum[1],
        )
        err = ctypes.create_string_buffer(_ERRBUF_BYTES)
        rc = fn(ctypes.byref(desc), err, _ERRBUF_BYTES)
        if rc != 0:
            raise EmulatorError(symbolize(err.value.decode(errors="replace")))
