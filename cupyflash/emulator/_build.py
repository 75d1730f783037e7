"""Building emulated kernel modules with the host C++ compiler, cached on disk.

Two kinds of shared library are built, both keyed by a hash of everything that
goes into them (source text, headers, flags, compiler and CUDA headers used):

* the **runtime** (``src/runtime.cpp``: fibers, block, named and mbarrier
  barriers, warp collectives, cp.async and bulk queues, shared-memory checks),
  built once per compiler;
* one **kernel module** per (entry file, set of name expressions compiled
  together, instrumentation flag): the assembled ``cuda_src/`` text compiled
  against ``include/cuda_emu.h`` and the emulated ``include/ptx.cuh``,
  ``wgmma.cuh`` and ``barriers.cuh`` (:data:`SUBSTITUTIONS`), plus one
  ``extern "C"`` launch function per name expression.  With race checking the
  module is compiled with ``-fsanitize=kernel-address`` and outlined
  instrumentation, so that GCC calls the runtime's ``__asan_*`` hooks on every
  load and store (no sanitizer runtime is involved).

Modules include ``cuda_emu.h`` precompiled (a GCC ``.gch`` per flag set, see
:meth:`ModuleCache.precompiled_header`).  Libraries and precompiled headers
live in ``$CUPYFLASH_EMULATOR_CACHE`` (default ``~/.cache/cupyflash/emulator``);
each is written to a temporary name and renamed into place, so concurrent
builders (threads or processes) are safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import _source

__all__ = ["EmulatorBuildError", "EmulatorError", "ModuleCache", "Toolchain", "find_toolchain"]

_HERE = Path(__file__).resolve().parent
INCLUDE_DIR = _HERE / "include"
RUNTIME_SOURCE = _HERE / "src" / "runtime.cpp"
# The cuda_src/ headers of inline PTX and their emulated twins, swapped in by name.
SUBSTITUTIONS = {name: INCLUDE_DIR / name for name in ("ptx.cuh", "wgmma.cuh", "barriers.cuh")}

# -g gives error messages file:line through addr2line; -fno-strict-aliasing
# because CUDA code type-puns freely through pointers.  A module took ~0.3-0.5 s
# to build at -O0, -O1 or -O2 alike, mostly parsing cuda_fp16.h/cuda_bf16.h,
# before the precompiled header (~0.25 s now);
# -O1 keeps the instrumented code fast to run without -O2's compile cost on
# larger kernels.
_COMMON_FLAGS = ("-std=c++17", "-fPIC", "-g", "-fno-strict-aliasing", "-fvisibility=hidden")
# The runtime's own debug information need only map its code to lines (-g1): with
# full -g its build took 5.4 s instead of 4.0 s once it modelled barriers.cuh.
# -falign-loops=32: the emulated toy forward spends a tenth of its time in one small
# loop (the sum of an mma's products), whose speed otherwise moved by 7% with where
# unrelated edits happened to place it.
_RUNTIME_FLAGS = tuple(f for f in _COMMON_FLAGS if f != "-g") + ("-g1", "-O2", "-falign-loops=32")
# -fstack-clash-protection probes large frames page by page, so that a stack
# overflow hits the fiber's guard page instead of a neighbour's stack.
_MODULE_FLAGS = _COMMON_FLAGS + ("-O1", "-Wno-attributes", "-fstack-clash-protection")
_INSTRUMENT_FLAGS = (
    "-fsanitize=kernel-address",
    "--param=asan-instrumentation-with-call-threshold=0",
    "--param=asan-stack=0",
    "--param=asan-globals=0",
)


class EmulatorError(RuntimeError):
    """An emulated kernel launch failed.

    Raised for races, deadlocks, divergent warp collectives, out-of-bounds or
    misaligned shared-memory accesses, cp.async copies never waited for,
    misuse of mbarriers, named barriers and bulk reductions, bad launch
    configurations and build failures; the message names the kernel, the
    block and the threads involved.
    """


class EmulatorBuildError(EmulatorError):
    """The host compiler rejected an emulated kernel module (message: its errors)."""


@dataclass(frozen=True)
class Toolchain:
    """The host compiler and the CUDA header directories the emulator uses."""

    cxx: str
    version: str
    cuda_includes: tuple[str, ...]

    @property
    def identity(self) -> str:
        """Text that changes whenever the compiler or the CUDA headers change."""
        parts = [self.cxx, self.version]
        for d in self.cuda_includes:
            for name in ("cuda_fp16.hpp", "cuda_bf16.hpp", "crt/host_defines.h"):
                p = Path(d) / name
                if p.is_file():
                    st = p.stat()
                    parts.append(f"{p}:{st.st_size}:{int(st.st_mtime)}")
        return "\n".join(parts)


def _cuda_include_candidates() -> list[Path]:
    out: list[Path] = []
    env = os.environ.get("CUPYFLASH_EMULATOR_CUDA_INCLUDE")
    if env:
        out += [Path(p) for p in env.split(os.pathsep) if p]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            out.append(Path(os.environ[var]) / "include")
    try:
        from cuda import pathfinder
    except ImportError:
        pathfinder = None
    if pathfinder is not None:
        for lib in ("cudart", "nvcc"):
            try:
                found = pathfinder.find_nvidia_header_directory(lib)
            except Exception:  # noqa: BLE001 - any failure just means "not found there"
                found = None
            if found:
                out.append(Path(found))
    out.append(Path("/usr/local/cuda/include"))
    return out


def _find_gcc() -> tuple[str, str]:
    """(path, version line) of the first GCC among ``$CXX`` and ``g++``."""
    tried = []
    for cxx in dict.fromkeys(filter(None, [os.environ.get("CXX"), "g++"])):
        exe = shutil.which(cxx)
        if exe is None:
            tried.append(f"{cxx!r} is not on PATH")
            continue
        try:
            proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{exe} --version failed ({exc})")
            continue
        version = proc.stdout.splitlines()[0] if proc.stdout else ""
        if proc.returncode == 0 and ("GCC" in version or "g++" in version or "gcc" in version):
            return exe, version
        tried.append(f"{exe} is not GCC ({version!r})")
    raise EmulatorError(
        "no GCC C++ compiler (the emulator needs GCC's -fsanitize=kernel-address instrumentation): "
        + "; ".join(tried)
    )


@functools.lru_cache(maxsize=1)
def find_toolchain() -> Toolchain:
    """Locate GCC (``$CXX`` if it is GCC, else ``g++``) and the CUDA headers.

    The CUDA include directories must provide ``cuda_fp16.h``, ``cuda_bf16.h``
    and ``crt/host_defines.h`` (a CUDA toolkit, or the ``nvidia-cuda-runtime``
    and ``nvidia-cuda-crt`` wheels).  ``$CUPYFLASH_EMULATOR_CUDA_INCLUDE`` (a
    path list) is searched first.

    Raises
    ------
    EmulatorError
        Not Linux, no GCC, or no CUDA headers; the message says what is missing.
    """
    if sys.platform != "linux":
        raise EmulatorError(f"the CPU emulator needs Linux (fibers, mmap, dladdr); this is {sys.platform}")
    exe, version = _find_gcc()
    candidates = _cuda_include_candidates()

    def has_fp16(d: Path) -> bool:
        return (d / "cuda_fp16.h").is_file() and (d / "cuda_bf16.h").is_file()

    def has_crt(d: Path) -> bool:
        return (d / "crt" / "host_defines.h").is_file()

    # Prefer one directory with everything (headers of one CUDA version).
    complete = [d for d in candidates if has_fp16(d) and has_crt(d)]
    fp16_dir = complete[0] if complete else next((d for d in candidates if has_fp16(d)), None)
    crt_dir = complete[0] if complete else next((d for d in candidates if has_crt(d)), None)
    if fp16_dir is None or crt_dir is None:
        missing = "cuda_fp16.h/cuda_bf16.h" if fp16_dir is None else "crt/host_defines.h"
        raise EmulatorError(
            f"CUDA headers not found ({missing}); looked in "
            + ", ".join(str(p) for p in _cuda_include_candidates())
            + " (install a CUDA toolkit or the cuda-toolkit[cudart,crt] wheels, or set "
            "$CUPYFLASH_EMULATOR_CUDA_INCLUDE)"
        )
    dirs = tuple(dict.fromkeys([str(fp16_dir), str(crt_dir)]))
    return Toolchain(cxx=exe, version=version, cuda_includes=dirs)


def default_cache_dir() -> Path:
    env = os.environ.get("CUPYFLASH_EMULATOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupyflash" / "emulator"


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _headers_text() -> str:
    return "".join(p.name + "\n" + p.read_text() for p in sorted(INCLUDE_DIR.iterdir()) if p.is_file())


def _include_options(tc: Toolchain) -> list[str]:
    """The include path of a kernel module: the emulation headers, then the CUDA headers."""
    return [f"-I{INCLUDE_DIR}", *(f"-I{d}" for d in tc.cuda_includes)]


def _compile(tc: Toolchain, args: list[str], out: Path, what: str) -> None:
    """Run the compiler writing to a temporary file, then rename it to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([tc.cxx, *args, "-o", tmp], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise EmulatorBuildError(f"{what}: the host compiler failed:\n{_trim_log(proc.stderr)}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _trim_log(log: str, max_lines: int = 60) -> str:
    lines = log.strip().splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def wrapper_source(assembled: str, name_expressions: list[str]) -> str:
    """The kernel module's translation unit: emulation header, kernels, launch functions."""
    out = ['#include "cuda_emu.h"', assembled, '#line 1 "<cupyflash emulator launch wrappers>"']
    out.append(
        """namespace cfemu_wrap {
template <typename F> struct kernel_params {
    static_assert(sizeof(F) == 0, "an emulated kernel must be a function");
};
template <typename P> struct kernel_params<void (*)(P)> { using type = P; };
template <typename... A> struct kernel_params<void (*)(A...)> {
    static_assert(sizeof...(A) == 1, "an emulated kernel takes exactly one argument: a params struct by value");
};
#ifdef CFEMU_USES_BARRIERS
constexpr uint32_t module_flags = CFEMU_MODULE_BARRIERS;
#else
constexpr uint32_t module_flags = 0;
#endif
}  // namespace cfemu_wrap"""
    )
    for i, name in enumerate(name_expressions):
        out.append(
            f"""extern "C" __attribute__((visibility("default")))
int cfemu_launch_{i}(const cfemu_launch_desc* d, char* err, uint64_t errlen) {{
    using P = typename cfemu_wrap::kernel_params<decltype(&{name})>::type;
    static_assert(std::is_standard_layout<P>::value, "the params struct must be a plain (standard-layout) struct");
    return cfemu_run(d, [](const void* p) {{ {name}(*static_cast<const P*>(p)); }}, sizeof(P), alignof(P),
                     cfemu_wrap::module_flags, err, errlen);
}}"""
        )
    return "\n".join(out) + "\n"


class Module:
    """A loaded kernel module: launch functions by name expression."""

    def __init__(self, path: Path, name_expressions: list[str], runtime: ctypes.CDLL):
        self.path = path
        self._runtime = runtime  # keeps the runtime loaded as long as the module
        self._lib = ctypes.CDLL(str(path))
        self.functions = {}
        for i, name in enumerate(name_expressions):
            fn = getattr(self._lib, f"cfemu_launch_{i}")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64]
            fn.restype = ctypes.c_int
            self.functions[name] = fn


class ModuleCache:
    """Thread-safe cache of built and loaded emulator libraries (one per process)."""

    def __init__(self, cache_dir: Path | None = None):
        self._cache_dir = cache_dir
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._runtimes: dict[Path, tuple[Path, ctypes.CDLL]] = {}
        self._modules: dict[str, Module] = {}
        # (source hash, name expression, instrumented) -> module key
        self._index: dict[tuple[str, str, bool], str] = {}

    @property
    def cache_dir(self) -> Path:
        return self._cache_dir if self._cache_dir is not None else default_cache_dir()

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def runtime(self) -> tuple[Path, ctypes.CDLL]:
        """Build (once per cache directory) and load the runtime library.

        Modules find it beside themselves (rpath ``$ORIGIN``), so each cache
        directory holds its own copy.
        """
        cache_dir = self.cache_dir
        with self._key_lock("runtime"):
            if cache_dir not in self._runtimes:
                tc = find_toolchain()
                abi = (INCLUDE_DIR / "cfemu_abi.h").read_text()
                key = _digest(
                    RUNTIME_SOURCE.read_text(), abi, tc.cxx, tc.version, " ".join(_RUNTIME_FLAGS), platform.machine()
                )
                path = cache_dir / f"libcfemu-runtime-{key}.so"
                if not path.is_file():
                    args = [
                        *_RUNTIME_FLAGS,
                        "-shared",
                        f"-I{INCLUDE_DIR}",
                        str(RUNTIME_SOURCE),
                        f"-Wl,-soname,{path.name}",
                        "-ldl",
                    ]
                    _compile(tc, args, path, "emulator runtime")
                self._runtimes[cache_dir] = (path, ctypes.CDLL(str(path)))
            return self._runtimes[cache_dir]

    def assembled(self, entry: str) -> str:
        return _source.assemble(entry, substitutions=SUBSTITUTIONS)

    def module_for(self, entry: str, name_expressions: list[str], instrument: bool) -> Module:
        """Build (or find) and load the module holding exactly these instantiations."""
        names = list(dict.fromkeys(name_expressions))
        if not names:
            raise ValueError("name_expressions: need at least one kernel name expression")
        text = self.assembled(entry)
        src_hash = _source.source_hash(text)
        tc = find_toolchain()
        rt_path, rt = self.runtime()
        flags = list(_MODULE_FLAGS) + (list(_INSTRUMENT_FLAGS) if instrument else [])
        tu = wrapper_source(text, names)
        key = _digest(tu, _headers_text(), tc.identity, " ".join(flags), rt_path.name, platform.machine())
        with self._key_lock(key):
            module = self._modules.get(key)
            if module is None:
                path = rt_path.parent / f"mod-{key}.so"
                if not path.is_file():
                    self._build_module(tc, tu, flags, path, rt_path, entry,
                                       pch_dir=self.precompiled_header(tc, flags))
                module = Module(path, names, rt)
            with self._lock:
                self._modules[key] = module
                for n in names:
                    self._index[(src_hash, n, instrument)] = key
        return module

    def precompiled_header(self, tc: Toolchain, flags: list[str]) -> Path:
        """The directory holding ``cuda_emu.h.gch``, ``cuda_emu.h`` precompiled with ``flags``.

        Every module's translation unit starts by including ``cuda_emu.h`` (the
        emulation header, with cuda_fp16.h and cuda_bf16.h), which is most of the
        ~0.5 s a module takes to build; with this directory first on the include
        path GCC loads the precompiled form instead (~0.25 s a module).  Built once
        per cache directory, header text, toolchain and flag set (one for plain,
        one for race-checked modules).  A stale or mismatched file costs only
        time: GCC then reads the header itself.
        """
        key = _digest("pch", _headers_text(), tc.identity, " ".join(flags), platform.machine())
        directory = self.cache_dir / f"pch-{key}"
        gch = directory / "cuda_emu.h.gch"
        with self._key_lock(f"pch-{key}"):
            if not gch.is_file():
                args = [*flags, "-x", "c++-header", *_include_options(tc), str(INCLUDE_DIR / "cuda_emu.h")]
                _compile(tc, args, gch, "emulator precompiled header")
        return directory

    def _build_module(self, tc: Toolchain, tu: str, flags: list[str], path: Path, rt_path: Path, entry: str,
                      *, pch_dir: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="build-", dir=path.parent) as tmp:
            src = Path(tmp) / (Path(_source.entry_file(entry)).stem + ".emu.cpp")
            src.write_text(tu)
            args = [
                *flags,
                "-shared",
                f"-I{pch_dir}",   # before cuda_emu.h's own directory: GCC takes the .gch
                *_include_options(tc),
                str(src),
                str(rt_path),
                "-Wl,-rpath,$ORIGIN",
                "-Wl,-z,defs",
            ]
            _compile(tc, args, path, f"emulated module for {entry}")

    def function(self, entry: str, name_expression: str, instrument: bool):
        """The launch function of one instantiation, building a module for it if needed."""
        text = self.assembled(entry)
        src_hash = _source.source_hash(text)
        with self._lock:
            key = self._index.get((src_hash, name_expression, instrument))
            module = self._modules.get(key) if key is not None else None
        if module is None:
            module = self.module_for(entry, [name_expression], instrument)
        return module.functions[name_expression]


# ---- error messages: "{loc:<lib>+0x<off>}" -> source locations ----------------

_LOC = re.compile(r" ?\{loc:(?P<lib>[^{}]+)\+0x(?P<off>[0-9a-f]+)\}")


def symbolize(message: str) -> str:
    """Replace the runtime's code-address tokens with `` at file:line`` via addr2line."""
    tokens = list(_LOC.finditer(message))
    if not tokens:
        return message
    by_lib: dict[str, list[int]] = {}
    for m in tokens:
        by_lib.setdefault(m.group("lib"), []).append(int(m.group("off"), 16))
    resolved: dict[tuple[str, int], str] = {}
    addr2line = shutil.which("addr2line")
    for lib, offs in by_lib.items():
        offs = list(dict.fromkeys(offs))
        frames_per_off: list[list[str]] = [[] for _ in offs]
        if addr2line:
            # One query per address keeps the inline chains apart.
            for i, off in enumerate(offs):
                try:
                    proc = subprocess.run(
                        [addr2line, "-e", lib, "-i", hex(max(off - 1, 0))],
                        capture_output=True,
                        text=True,
                        timeout=30,
                        check=False,
                    )
                    frames_per_off[i] = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
                except (OSError, subprocess.SubprocessError):
                    pass
        for off, frames in zip(offs, frames_per_off):
            resolved[(lib, off)] = _format_frames(frames) or f"{os.path.basename(lib)}+{hex(off)}"
    return _LOC.sub(lambda m: f" at {resolved[(m.group('lib'), int(m.group('off'), 16))]}", message)


def _format_frames(frames: list[str]) -> str:
    """addr2line -i lines (innermost first) -> 'file:line, inlined in file:line, ...'."""
    keep = []
    inc = str(INCLUDE_DIR)
    for fr in frames:
        fr = re.sub(r" \(discriminator \d+\)$", "", fr)
        if fr.startswith(("??", inc, "/usr/")) or "<cupyflash emulator" in fr:
            continue
        keep.append(fr)
    if not keep:
        return ""
    return keep[0] + "".join(f", inlined in {fr}" for fr in keep[1:4])
