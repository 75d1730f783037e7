"""NVRTC, called directly through ctypes: the one binding the loader and the static report share.

CuPy's ``RawModule`` compiles the ordinary kernels (with :data:`COMPILE_OPTIONS`;
CuPy adds ``-arch=sm_XX`` for the current device, ``-ftz=true`` and its include
paths itself).  Two things need NVRTC without CuPy in between: kernels built for
an architecture-specific target (wgmma needs ``sm_90a``, and CuPy always appends
its own ``-arch``), which the loader compiles to a cubin and loads; and the static
report, which compiles for targets the machine may not have and reads the ptxas
log and the cubin (CuPy's ``getCUBIN`` drops the cubin's last byte).  Both
compile with :func:`options`, which adds what CuPy would add, so the three
builds see the same source with the same options.

The library is found with ``cuda.pathfinder`` (``CUPYFLASH_NVRTC`` names another
one, e.g. the oldest supported), loaded on first use, once per process.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Sequence

__all__ = ["COMPILE_OPTIONS", "NvrtcError", "Nvrtc", "compiler", "include_options", "options"]

# Options handed to NVRTC by the loader and (with -arch, -ftz=true and the
# include paths that CuPy itself adds) by the static report.  No fast-math:
# the kernels use exp2_approx explicitly where they want it, everything else
# is IEEE.  CuPy appends -arch=sm_XX for the current device, -ftz=true and
# its include paths itself, so they are not repeated here.
COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17",)


class NvrtcError(RuntimeError):
    """NVRTC failed; the message carries its log."""


class Nvrtc:
    """The few NVRTC entry points cupyflash needs, from the shared library at ``path``."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                           ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.nvrtcAddNameExpression.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                            ctypes.POINTER(ctypes.c_char_p)]
        self._lib = lib
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str, log: str = "") -> None:
        if status:
            message = f"{what}: {self._lib.nvrtcGetErrorString(status).decode()}"
            raise NvrtcError(message + ("\n" + log if log else ""))

    def compile(self, source: str, name_expressions: Sequence[str], options: Sequence[str],
                filename: str = "kernel.cu") -> tuple[str, bytes, dict[str, str]]:
        """Compile to a cubin; return (log, cubin, {name expression: mangled name}).

        Raises
        ------
        NvrtcError
            NVRTC rejected the source or an option (the message carries its log).
        """
        lib = self._lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                           filename.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            for name in name_expressions:
                self._check(lib.nvrtcAddNameExpression(prog, name.encode()),
                            "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            self._check(status, f"compiling {filename}", log)
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            lowered = {}
            for name in name_expressions:
                out = ctypes.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)),
                            f"nvrtcGetLoweredName({name})")
                lowered[name] = out.value.decode()
            return log, cubin.raw, lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=1)
def compiler() -> Nvrtc:
    """The process's :class:`Nvrtc`, loaded on first use.

    Raises
    ------
    ImportError
        ``cuda.pathfinder`` is not installed (and ``CUPYFLASH_NVRTC`` is not set).
    OSError
        The library could not be loaded.
    """
    path = os.environ.get("CUPYFLASH_NVRTC")
    if not path:    # CUPYFLASH_NVRTC: another libnvrtc, e.g. the oldest one supported
        from cuda import pathfinder

        path = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    return Nvrtc(path)


@functools.lru_cache(maxsize=1)
def include_options() -> tuple[str, ...]:
    """The ``-I`` paths CuPy's RawModule adds (CCCL, CuPy's headers, the CUDA headers)."""
    try:
        from cupy._core.core import assemble_cupy_compiler_options

        return tuple(o for o in assemble_cupy_compiler_options(()) if o.startswith("-I"))
    except Exception:  # no CuPy: the CUDA headers and CCCL where cuda.pathfinder finds them
        from cuda import pathfinder

        dirs = []
        for name in ("cccl", "cudart"):
            try:
                dirs.append(pathfinder.find_nvidia_header_directory(name))
            except Exception:
                pass
        return tuple(f"-I{d}" for d in dirs if d)


def options(target: str, *, ptxas_verbose: bool = False) -> tuple[str, ...]:
    """The options of a direct compile for ``target`` (``"sm_80"``, ``"sm_90a"``): the
    loader's :data:`COMPILE_OPTIONS` plus what CuPy's RawModule would add itself.

    ``ptxas_verbose`` (the static report) adds ptxas's resource report and, on NVRTC
    12.9 and later, ``--no-cache``: every report compile runs ptxas afresh.
    """
    extra = ()
    if ptxas_verbose:
        extra = ("--ptxas-options=-v",) + (("--no-cache",) if compiler().version >= (12, 9) else ())
    return (COMPILE_OPTIONS + include_options()
            + (f"-arch={target}", "--device-as-default-execution-space", "-ftz=true") + extra)
