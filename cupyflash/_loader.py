"""Kernel loading on the GPU: compile with NVRTC through CuPy, cache per device, launch.

The GPU path of :func:`cupyflash.attention` asks a :class:`CudaExecutor` to
run one instantiation (a ``cuda_src/`` entry file plus a C++ name expression
such as ``"cf::fwd_simt_kernel<float, 64, 64>"``).  The executor finds the
compiled module in the current device's :class:`ModuleCache`, compiling it
on first use, and launches it on CuPy's current device and stream with one
params struct (a NumPy structured scalar, which CuPy passes by value).

Granularity: one module per *instantiation*, not per entry file.  A first
call needs exactly one kernel, and NVRTC's cost grows with the number of
instantiations in a program (front end once, but ptxas once per kernel), so
compiling the whole catalogue of an entry file on the first call would make
the cold start proportional to the catalogue rather than to the work asked
for.  The module key is ``(entry, name expressions)``, so callers that want a
batch (e.g. :func:`precompile` with grouped requests) can still ask for one
module holding several; CuPy's on-disk cache key contains the sorted name
expressions, so each module is cached on disk under its own key and a second
process starts in milliseconds.

Nothing here imports CuPy or touches CUDA at import time.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np

from . import _nvrtc
from ._dtypes import dtype_name
from ._nvrtc import COMPILE_OPTIONS
from ._source import assemble, entry_file

__all__ = [
    "COMPILE_OPTIONS",
    "ModuleCache",
    "CudaExecutor",
    "module_caches",
    "module_source",
    "precompile",
]

# Dynamic shared memory above this needs cudaFuncAttributeMaxDynamicSharedMemorySize.
_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


def module_source(entry: str) -> str:
    """The exact source string compiled for ``entry``: every quoted header inlined.

    The loader and the static report both compile this string, so CuPy's disk
    cache (keyed by the source text) changes whenever any header changes.
    """
    return assemble(entry)


class _Pending:
    """A compile in progress: the first requester compiles, the others wait here."""

    __slots__ = ("_event", "_value", "_error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value = None
        self._error: BaseException | None = None

    def resolve(self, value=None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def wait(self):
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class ModuleCache:
    """Compiled modules of one device, keyed by ``(entry, name expressions)``.

    Thread-safe: a module is compiled once even when several threads ask for
    it at the same time (the first compiles outside the lock, the others wait
    for its result); different modules compile concurrently.  A failed
    compile is not cached: every waiter sees the exception and the next
    request tries again.

    Parameters
    ----------
    compile_module : callable
        ``compile_module(entry, name_expressions) -> module``; the module
        must have ``get_function(name_expression)``.  The GPU path passes a
        function that builds a ``cupy.RawModule`` on this cache's device;
        tests pass a fake.
    device_id : int, optional
        The device whose modules this cache holds (informational).
    """

    def __init__(self, compile_module: Callable[[str, tuple[str, ...]], object],
                 device_id: int | None = None) -> None:
        self.device_id = device_id
        self._compile_module = compile_module
        self._lock = threading.Lock()
        self._modules: dict[tuple[str, tuple[str, ...]], object] = {}
        self._pending: dict[tuple[str, tuple[str, ...]], _Pending] = {}
        # (entry, name_expression) -> kernel function, filled from every module compiled.
        self._functions: dict[tuple[str, str], object] = {}
        # kernel function id -> dynamic shared memory limit already set on it.
        self._smem_limits: dict[int, int] = {}

    @staticmethod
    def key(entry: str, name_expressions: Iterable[str]) -> tuple[str, tuple[str, ...]]:
        names = tuple(sorted(set(name_expressions)))
        if not names:
            raise ValueError(f"no name expressions given for {entry!r}")
        return entry, names

    def module(self, entry: str, name_expressions: Iterable[str]):
        """Return the module holding ``name_expressions`` of ``entry``, compiling it once."""
        key = self.key(entry, name_expressions)
        module = self._modules.get(key)
        if module is not None:
            return module
        with self._lock:
            module = self._modules.get(key)
            if module is not None:
                return module
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = _Pending()
        if not owner:
            return pending.wait()
        try:
            module = self._compile_module(*key)
            functions = {(entry, name): module.get_function(name) for name in key[1]}
        except BaseException as error:
            with self._lock:
                del self._pending[key]
            pending.resolve(error=error)
            raise
        with self._lock:
            self._modules[key] = module
            for fkey, function in functions.items():
                self._functions.setdefault(fkey, function)
            del self._pending[key]
        pending.resolve(module)
        return module

    def function(self, entry: str, name_expression: str):
        """Return the kernel ``name_expression`` of ``entry`` (compiling its module if needed)."""
        function = self._functions.get((entry, name_expression))
        if function is None:
            self.module(entry, (name_expression,))
            function = self._functions[(entry, name_expression)]
        return function

    def compiled(self) -> list[tuple[str, tuple[str, ...]]]:
        """Keys of the modules compiled so far."""
        with self._lock:
            return list(self._modules)

    def ensure_dynamic_smem(self, function, nbytes: int,
                            set_limit: Callable[[object, int], None]) -> None:
        """Raise ``function``'s dynamic shared memory limit to ``nbytes`` if needed (once)."""
        if nbytes <= _DEFAULT_DYNAMIC_SMEM_LIMIT:
            return
        fid = id(function)
        if self._smem_limits.get(fid, 0) >= nbytes:
            return
        with self._lock:
            if self._smem_limits.get(fid, 0) < nbytes:
                set_limit(function, nbytes)
                self._smem_limits[fid] = nbytes


def _cache_dir() -> str:
    """Where architecture-specific cubins are kept: ``cupyflash/`` in CuPy's kernel cache."""
    root = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    return os.path.join(root, "cupyflash")


class _CubinModule:
    """A cubin built here for an architecture-specific target, loaded as a ``cupy.RawModule``.

    CuPy's RawModule compiles for the device's plain ``sm_XX`` (it appends its own
    ``-arch``), but wgmma needs ``sm_90a``: :func:`_compile_arch_specific` compiles
    with NVRTC directly and this wrapper maps name expressions to the mangled names
    NVRTC reported, so the module answers ``get_function(name_expression)`` like one
    built with ``name_expressions``.
    """

    def __init__(self, path: str, lowered: dict[str, str]) -> None:
        import cupy

        self._module = cupy.RawModule(path=path)
        self._lowered = dict(lowered)

    def get_function(self, name_expression: str):
        return self._module.get_function(self._lowered[name_expression])


def _compile_arch_specific(entry: str, name_expressions: tuple[str, ...], target: str) -> _CubinModule:
    """Compile ``name_expressions`` of ``cuda_src/<entry>`` for ``target`` (e.g. ``"sm_90a"``)
    with NVRTC and load the cubin (:func:`cached_cubin`)."""
    return _CubinModule(*cached_cubin(entry, name_expressions, target))


def cached_cubin(entry, name_expressions: tuple[str, ...], target: str) -> tuple[str, dict[str, str]]:
    """The path of the cubin of ``name_expressions`` of ``entry`` (a file of cuda_src/ or a
    :class:`~cupyflash._source.Variant`) for ``target``, and its lowered names: read from
    the disk cache (keyed by source, options, NVRTC version and names), else compiled
    with NVRTC and stored there.  Needs no GPU."""
    import hashlib
    import json

    nvrtc = _nvrtc.compiler()
    source = module_source(entry)
    options = _nvrtc.options(target)
    key = hashlib.sha256("\0".join((source, *options, repr(nvrtc.version), *name_expressions))
                         .encode()).hexdigest()[:32]
    directory = _cache_dir()
    cubin_path = os.path.join(directory, f"{key}.cubin")
    names_path = os.path.join(directory, f"{key}.json")
    try:
        with open(names_path) as f:
            lowered = json.load(f)
        if set(lowered) != set(name_expressions) or not os.path.isfile(cubin_path):
            raise FileNotFoundError(cubin_path)
    except (OSError, ValueError):
        try:
            _log, cubin, lowered = nvrtc.compile(source, name_expressions, options, f"cuda_src/{entry_file(entry)}")
        except Exception as error:
            _add_note(error, f"cupyflash: while compiling {', '.join(name_expressions)} "
                             f"from cuda_src/{entry} for {target}")
            raise
        os.makedirs(directory, exist_ok=True)
        # Written under temporary names, then renamed: a concurrent process never
        # sees a partial file, and the names file (checked first) lands last.
        for path, data in ((cubin_path, cubin), (names_path, json.dumps(lowered).encode())):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    return cubin_path, lowered


def _compile_rawmodule(device_id: int) -> Callable[[str, tuple[str, ...]], object]:
    """A compile function building ``cupy.RawModule`` objects on ``device_id`` (or, for
    entries with an architecture-specific target such as fwd_wgmma's sm_90a, a
    :class:`_CubinModule`)."""

    def compile_module(entry: str, name_expressions: tuple[str, ...]):
        import cupy

        from ._families import entry_family

        with cupy.cuda.Device(device_id):
            arch = f"sm_{cupy.cuda.Device(device_id).compute_capability}"
            target = entry_family(entry).compile_target(arch)
            if target is None:
                raise RuntimeError(f"cupyflash: cuda_src/{entry} has no kernels for {arch} "
                                   f"(device {device_id})")
            if target != arch:
                return _compile_arch_specific(entry, name_expressions, target)
            module = cupy.RawModule(code=module_source(entry), options=COMPILE_OPTIONS,
                                    name_expressions=list(name_expressions))
            try:
                module.compile()
            except Exception as error:  # CompileException carries the NVRTC log
                _add_note(error, f"cupyflash: while compiling {', '.join(name_expressions)} "
                                 f"from cuda_src/{entry} for device {device_id}")
                raise
        return module

    return compile_module


class _DeviceCaches:
    """One :class:`ModuleCache` per CUDA device, created on first use."""

    def __init__(self, make_compile: Callable[[int], Callable] = _compile_rawmodule) -> None:
        self._make_compile = make_compile
        self._lock = threading.Lock()
        self._caches: dict[int, ModuleCache] = {}

    def for_device(self, device_id: int) -> ModuleCache:
        cache = self._caches.get(device_id)
        if cache is None:
            with self._lock:
                cache = self._caches.get(device_id)
                if cache is None:
                    cache = self._caches[device_id] = ModuleCache(
                        self._make_compile(device_id), device_id)
        return cache


module_caches = _DeviceCaches()


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)


def _dim3(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if np.isscalar(value) else tuple(value)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"`{what}` must have 1 to 3 dimensions, got {value!r}")
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    if any(d < 1 for d in dims):
        raise ValueError(f"`{what}` dimensions must be >= 1, got {value!r}")
    return dims


class CudaExecutor:
    """Runs kernel instantiations on CuPy's current device and current stream.

    The executor protocol shared with :class:`cupyflash.emulator.EmulatorExecutor`:

    - ``arch`` : int, compute capability of the device kernels run on (e.g. 90);
    - ``multiprocessors`` : int, its SM count (the forward's split-KV heuristic);
    - ``launch(entry, name_expression, grid, block, shared_mem, params)``.

    Parameters
    ----------
    synchronize : bool, default False
        Synchronize the stream after every launch so that an asynchronous
        CUDA error (an illegal address, say) is raised by the launch that
        caused it instead of by a later call.  For tests and debugging.
    caches : optional
        The per-device module caches (default: the process-wide one).
    """

    def __init__(self, *, synchronize: bool = False, caches: _DeviceCaches | None = None) -> None:
        self.synchronize = synchronize
        self._caches = module_caches if caches is None else caches
        self._archs: dict[int, int] = {}
        self._sms: dict[int, int] = {}
        self._optin: dict[int, int] = {}

    @staticmethod
    def _device_id() -> int:
        import cupy

        return cupy.cuda.runtime.getDevice()

    @property
    def multiprocessors(self) -> int:
        """Streaming multiprocessors of CuPy's current device (the split-KV heuristic's input)."""
        device_id = self._device_id()
        count = self._sms.get(device_id)
        if count is None:
            import cupy

            count = self._sms[device_id] = int(
                cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
        return count

    @property
    def arch(self) -> int:
        """Compute capability of CuPy's current device as an int (80, 86, 89, 90, ...)."""
        device_id = self._device_id()
        arch = self._archs.get(device_id)
        if arch is None:
            import cupy

            arch = self._archs[device_id] = int(cupy.cuda.Device(device_id).compute_capability)
        return arch

    def _smem_optin(self, device_id: int) -> int:
        """Most dynamic shared memory one block may opt in to on ``device_id`` (bytes)."""
        limit = self._optin.get(device_id)
        if limit is None:
            import cupy

            limit = self._optin[device_id] = cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)
        return limit

    def cache(self) -> ModuleCache:
        """The module cache of CuPy's current device."""
        return self._caches.for_device(self._device_id())

    def launch(self, entry: str, name_expression: str, grid, block, shared_mem: int,
               params) -> None:
        """Launch ``name_expression`` of ``cuda_src/<entry>`` with ``params`` as its one argument.

        Parameters
        ----------
        entry : str
            File in ``cuda_src/`` defining the kernel.
        name_expression : str
            The C++ name of the instantiation, e.g. ``"cf::fwd_simt_kernel<float, 64, 64>"``.
        grid, block : int or tuple of int
            Launch dimensions (1 to 3).
        shared_mem : int
            Dynamic shared memory in bytes; above 48 KB the kernel's limit is raised first.
        params : numpy.void
            A NumPy structured scalar laid out like the kernel's params struct
            (a 0-d structured array is accepted too); passed by value.

        Raises
        ------
        TypeError
            ``params`` is not a structured scalar.
        ValueError
            Bad launch dimensions, or more shared memory than the device allows per block.
        cupy.cuda.compiler.CompileException
            NVRTC rejected the source (the exception carries its log).
        cupy.cuda.driver.CUDADriverError
            The launch failed (too many threads, too many registers, ...).
        cupy.cuda.runtime.CUDARuntimeError
            With ``synchronize=True``: the kernel failed while running.
        """
        import cupy

        grid3, block3 = _dim3(grid, "grid"), _dim3(block, "block")
        shared_mem = int(shared_mem)
        if isinstance(params, np.ndarray) and params.ndim == 0:
            params = params[()]
        if not isinstance(params, np.void):
            raise TypeError(f"`params` must be a NumPy structured scalar, got {type(params).__name__}")
        cache = self.cache()
        function = cache.function(entry, name_expression)
        if shared_mem > _DEFAULT_DYNAMIC_SMEM_LIMIT:
            limit = self._smem_optin(cache.device_id)
            if shared_mem > limit:
                raise ValueError(
                    f"{name_expression} needs {shared_mem} bytes of dynamic shared memory; "
                    f"this device allows {limit} per block")
            cache.ensure_dynamic_smem(function, shared_mem, _set_max_dynamic_smem)
        try:
            function(grid3, block3, (params,), shared_mem=shared_mem)
            if self.synchronize:
                cupy.cuda.get_current_stream().synchronize()
        except Exception as error:
            _add_note(error, f"cupyflash: launching {name_expression} (cuda_src/{entry}) "
                             f"grid={grid3} block={block3} shared_mem={shared_mem}")
            raise


def _set_max_dynamic_smem(function, nbytes: int) -> None:
    function.max_dynamic_shared_size_bytes = nbytes


def select(instantiations: Sequence, *, dtypes=None, head_dims=None, families=None) -> list:
    """The catalogue rows :func:`precompile` compiles for the given filters.

    ``head_dims`` are head dims of the caller's data: each selects, per
    (family, dtype), the smallest instantiation whose compile-time head dim is
    at least that value (the instantiation the dispatcher runs it with).
    """
    rows = list(instantiations)
    if families is not None:
        wanted = {families} if isinstance(families, str) else set(families)
        unknown = wanted - {r.family.name for r in rows}
        if unknown:
            raise ValueError(f"unknown kernel families {sorted(unknown)}; "
                             f"known: {sorted({r.family.name for r in rows})}")
        rows = [r for r in rows if r.family.name in wanted]
    if dtypes is not None:
        if isinstance(dtypes, (str, np.dtype, type)):
            dtypes = [dtypes]
        wanted = {dtype_name(d) for d in dtypes}
        rows = [r for r in rows if r.dtype in wanted]
    if head_dims is not None:
        dims = [head_dims] if np.isscalar(head_dims) else list(head_dims)
        chosen = []
        groups: dict[tuple[str, str], list] = {}
        for r in rows:
            groups.setdefault((r.family.name, r.dtype), []).append(r)
        for group in groups.values():
            for d in dims:
                fits = [r for r in group if r.head_dim >= int(d) and r.head_dim_v >= int(d)]
                if fits:
                    best = min(r.head_dim for r in fits)
                    chosen.extend(r for r in fits if r.head_dim == best)
        rows = [r for r in rows if r in chosen]
    return rows


def precompile(*, dtypes=None, head_dims=None, families=None, device=None,
               max_workers: int | None = None) -> list:
    """Compile kernel instantiations ahead of time, so the first call does not wait.

    Parameters
    ----------
    dtypes : dtype or sequence of dtypes, optional
        Only instantiations for these dtypes (``numpy.float16``,
        ``"bfloat16"``/``ml_dtypes.bfloat16``, ``numpy.float32``, ``numpy.float64``).
        Default: all.
    head_dims : int or sequence of int, optional
        Head dims of the data to be run; each selects the instantiation the
        dispatcher picks for it (the smallest compile-time head dim that fits).
        Default: all.
    families : str or sequence of str, optional
        Kernel families (``"fwd_simt"``, ``"fwd_v1"``, ...). Default: all.
    device : int or cupy.cuda.Device, optional
        Device to compile for. Default: CuPy's current device.
    max_workers : int, optional
        Parallel NVRTC compiles (default: up to 8, one per CPU).

    Returns
    -------
    list of Instantiation
        The catalogue rows compiled (already-compiled ones included): those the
        filters select that a call on this device's architecture may launch (the
        tensor-core tiles of other GPU classes are left out).

    Notes
    -----
    Modules land in CuPy's on-disk kernel cache, so a later process loads them
    in milliseconds.
    """
    import cupy

    from ._families import catalogue, launchable

    rows = select(catalogue(), dtypes=dtypes, head_dims=head_dims, families=families)
    if device is None:
        device_id = cupy.cuda.runtime.getDevice()
    else:
        device_id = int(getattr(device, "id", device))
    keep = {r.name_expression for r in launchable(int(cupy.cuda.Device(device_id).compute_capability))}
    rows = [r for r in rows if r.name_expression in keep]
    cache = module_caches.for_device(device_id)

    def compile_one(row) -> None:
        cache.module(row.entry, (row.name_expression,))

    workers = max_workers or min(8, os.cpu_count() or 1, max(1, len(rows)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(compile_one, rows))
    return rows
