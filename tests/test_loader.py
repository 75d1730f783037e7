"""CPU-only tests of the GPU loader: source assembly, the module cache, the executor's shape."""

from __future__ import annotations

import inspect
import re
import sys
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cupyflash import _loader, _source
from cupyflash._loader import CudaExecutor, ModuleCache, module_source, select
from cupyflash._families import BACKWARD, FORWARD, FORWARD_ROLE, FWD_SIMT, FWD_V1, Call, catalogue, launchable
from cupyflash._families import select as select_family
from cupyflash._families.fwd_mma import MMA_HEAD_DIMS
from cupyflash._options import KernelOptions

REPO = Path(__file__).resolve().parents[1]


def _entries():
    return sorted(p.name for p in _source.cuda_src_dir().glob("*.cu"))


# ---- source assembly ---------------------------------------------------------------


@pytest.fixture
def src_tree(tmp_path, monkeypatch):
    """A private cuda_src/ (CUPYFLASH_CUDA_SRC) with a small include graph."""
    root = tmp_path / "cuda_src"
    (root / "sub").mkdir(parents=True)
    (root / "ptx.cuh").write_text("#pragma once\n// ptx\nint ptx_marker;\n")
    (root / "sub" / "helper.cuh").write_text('#pragma once\n#include "../ptx.cuh"\nint helper_marker;\n')
    (root / "main.cu").write_text(
        '#include "ptx.cuh"\n#include "sub/helper.cuh"\n#include <cuda_fp16.h>\nint main_marker;\n')
    monkeypatch.setenv("CUPYFLASH_CUDA_SRC", str(root))
    _source.cuda_src_dir.cache_clear()
    yield root
    _source.cuda_src_dir.cache_clear()


def test_line_directives_name_real_files_and_lines(src_tree):
    text = module_source("main.cu")
    lines = text.splitlines()
    files = {}
    for i, line in enumerate(lines):
        m = re.match(r'#line (\d+) "([^"]+)"', line)
        if m:
            n, name = int(m.group(1)), m.group(2)
            path = src_tree / name.removeprefix("cuda_src/")
            assert path.is_file(), f"#line names {name!r}, which is not a file"
            files[name] = path
            # The next non-directive line is line n of that file (or a later inlined header).
            nxt = lines[i + 1] if i + 1 < len(lines) else None
            if nxt is not None and not nxt.startswith("#line"):
                real = path.read_text().splitlines()
                assert real[n - 1].strip() == nxt.strip() or real[n - 1].startswith("#pragma once")
    assert set(files) == {"cuda_src/main.cu", "cuda_src/ptx.cuh", "cuda_src/sub/helper.cuh"}
    # Each header inlined once, system headers left to the compiler.
    assert text.count("int ptx_marker;") == 1
    assert "#include <cuda_fp16.h>" in text
    assert '#include "' not in text


def test_missing_include_raises_naming_it(src_tree):
    (src_tree / "broken.cu").write_text('#include "ptx.cuh"\n#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nowhere.cuh"):
        module_source("broken.cu")


def test_header_edit_changes_source_and_hash(src_tree):
    before = module_source("main.cu")
    (src_tree / "sub" / "helper.cuh").write_text('#pragma once\n#include "../ptx.cuh"\nint helper_marker2;\n')
    after = module_source("main.cu")
    assert "helper_marker2" in after
    assert _source.source_hash(before) != _source.source_hash(after)


@pytest.mark.parametrize("entry", _entries())
def test_project_sources_assemble_with_every_header(entry):
    text = module_source(entry)
    root = _source.cuda_src_dir()
    named = set(re.findall(r'#line \d+ "cuda_src/([^"]+)"', text))
    assert entry in named
    for name in named:
        body = (root / name).read_text()
        # every non-include, non-pragma line of every header reached is in the string
        for line in body.splitlines():
            if not re.match(r'\s*#\s*(include\s+"|pragma\s+once)', line):
                assert line in text


# ---- the module cache ------------------------------------------------------------------


class _FakeModule:
    def __init__(self, entry, names):
        self.entry, self.names = entry, names

    def get_function(self, name):
        if name not in self.names:
            raise KeyError(name)
        return (self.entry, name)


def test_module_compiled_once_under_concurrency():
    calls = []
    gate = threading.Event()

    def compile_module(entry, names):
        calls.append((entry, names))
        gate.wait(5)            # hold the compile so every thread piles up on it
        time.sleep(0.01)
        return _FakeModule(entry, names)

    cache = ModuleCache(compile_module, device_id=0)
    results = []
    barrier = threading.Barrier(16)

    def worker(i):
        barrier.wait()
        if i == 0:
            time.sleep(0.05)
            gate.set()
        results.append(cache.function("a.cu", "k<1>"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [("a.cu", ("k<1>",))]
    assert results == [("a.cu", "k<1>")] * 16
    assert cache.compiled() == [("a.cu", ("k<1>",))]


def test_distinct_modules_compile_concurrently():
    running = []
    both = threading.Barrier(2, timeout=5)

    def compile_module(entry, names):
        running.append(names)
        both.wait()            # deadlocks (BrokenBarrierError) if compiles were serialised
        return _FakeModule(entry, names)

    cache = ModuleCache(compile_module)
    threads = [threading.Thread(target=cache.function, args=("a.cu", f"k<{i}>")) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(running) == [("k<0>",), ("k<1>",)]


def test_failed_compile_reaches_every_waiter_and_is_retried():
    attempts = []
    gate = threading.Event()

    def compile_module(entry, names):
        attempts.append(names)
        gate.wait(5)
        if len(attempts) == 1:
            raise RuntimeError("nvrtc says no")
        return _FakeModule(entry, names)

    cache = ModuleCache(compile_module)
    errors = []

    def worker():
        try:
            cache.function("a.cu", "k<1>")
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join(10)
    assert errors == ["nvrtc says no"] * 4
    assert cache.function("a.cu", "k<1>") == ("a.cu", "k<1>")
    assert len(attempts) == 2


def test_group_module_serves_its_functions():
    calls = []

    def compile_module(entry, names):
        calls.append(names)
        return _FakeModule(entry, names)

    cache = ModuleCache(compile_module)
    cache.module("a.cu", ["k<2>", "k<1>", "k<1>"])
    assert calls == [("k<1>", "k<2>")]
    assert cache.function("a.cu", "k<2>") == ("a.cu", "k<2>")
    assert calls == [("k<1>", "k<2>")]
    with pytest.raises(ValueError):
        cache.module("a.cu", [])


def test_dynamic_shared_memory_limit_raised_once_and_only_above_48k():
    cache = ModuleCache(lambda e, n: _FakeModule(e, n))
    f = cache.function("a.cu", "k<1>")
    raised = []
    setter = lambda fn, n: raised.append(n)  # noqa: E731
    cache.ensure_dynamic_smem(f, 48 * 1024, setter)
    cache.ensure_dynamic_smem(f, 64 * 1024, setter)
    cache.ensure_dynamic_smem(f, 60 * 1024, setter)
    cache.ensure_dynamic_smem(f, 100 * 1024, setter)
    assert raised == [64 * 1024, 100 * 1024]


def test_per_device_caches_are_distinct_and_reused():
    made = []
    caches = _loader._DeviceCaches(lambda dev: made.append(dev) or (lambda e, n: _FakeModule(e, n)))
    a, b = caches.for_device(0), caches.for_device(1)
    assert a is not b and caches.for_device(0) is a and made == [0, 1]
    assert (a.device_id, b.device_id) == (0, 1)


# ---- executor protocol -------------------------------------------------------------------


def test_executor_protocol_shape():
    ex = CudaExecutor()
    assert isinstance(type(ex).arch, property)
    params = list(inspect.signature(ex.launch).parameters)
    assert params == ["entry", "name_expression", "grid", "block", "shared_mem", "params"]


class _FakeKernel:
    def __init__(self, name):
        self.name, self.calls, self.max_dynamic_shared_size_bytes = name, [], 0

    def __call__(self, grid, block, args, *, shared_mem=0):
        if block[0] > 1024:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        self.calls.append((grid, block, args, shared_mem, self.max_dynamic_shared_size_bytes))


@pytest.fixture
def fake_cupy(monkeypatch):
    """Just enough of CuPy for CudaExecutor: device 0 is an sm_86 with 99 KB opt-in shared memory."""
    import types

    syncs = []
    runtime = types.SimpleNamespace(
        getDevice=lambda: 0, cudaDevAttrMaxSharedMemoryPerBlockOptin=97,
        deviceGetAttribute=lambda attr, dev: 101376 if attr == 97 else 0)
    cuda = types.SimpleNamespace(
        runtime=runtime, Device=lambda i=0: types.SimpleNamespace(compute_capability="86"),
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: syncs.append(1)))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return syncs


def _fake_executor(**kw):
    kernels = {}

    class Module:
        def __init__(self, names):
            self.names = names

        def get_function(self, name):
            return kernels.setdefault(name, _FakeKernel(name))

    caches = _loader._DeviceCaches(lambda dev: (lambda entry, names: Module(names)))
    return CudaExecutor(caches=caches, **kw), kernels


PARAMS = np.dtype([("ptr", np.uint64), ("n", np.int32)], align=True)


def test_launch_passes_one_struct_and_raises_smem_limit(fake_cupy):
    ex, kernels = _fake_executor()
    assert ex.arch == 86
    params = np.array((1234, 7), dtype=PARAMS)
    ex.launch("a.cu", "k<1>", 10, 128, 1024, params)                      # 0-d array accepted
    ex.launch("a.cu", "k<1>", (10, 2), (128,), 64 * 1024, params[()])
    calls = kernels["k<1>"].calls
    assert [c[:2] for c in calls] == [((10, 1, 1), (128, 1, 1)), ((10, 2, 1), (128, 1, 1))]
    assert isinstance(calls[0][2][0], np.void) and len(calls[0][2]) == 1
    assert calls[0][2][0]["n"] == 7
    assert (calls[0][3], calls[0][4]) == (1024, 0)              # below 48 KB: limit untouched
    assert (calls[1][3], calls[1][4]) == (64 * 1024, 64 * 1024)  # raised before the launch
    with pytest.raises(ValueError, match="101376"):
        ex.launch("a.cu", "k<1>", 1, 128, 200 * 1024, params)
    with pytest.raises(TypeError, match="structured scalar"):
        ex.launch("a.cu", "k<1>", 1, 128, 0, (1234, 7))
    assert fake_cupy == []


def test_launch_errors_carry_the_kernel_and_configuration(fake_cupy):
    ex, _ = _fake_executor(synchronize=True)
    params = np.zeros((), dtype=PARAMS)
    ex.launch("a.cu", "k<2>", 1, 32, 0, params)
    assert fake_cupy == [1]                                      # synchronize=True syncs the stream
    with pytest.raises(RuntimeError, match="INVALID_VALUE") as info:
        ex.launch("a.cu", "k<2>", 1, 2048, 0, params)
    notes = "".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "k<2>" in notes and "block=(2048, 1, 1)" in notes


def test_launch_dims_are_normalised_and_checked():
    assert _loader._dim3(4, "grid") == (4, 1, 1)
    assert _loader._dim3((4, 2), "grid") == (4, 2, 1)
    assert _loader._dim3((np.int64(3), 2, 5), "grid") == (3, 2, 5)
    with pytest.raises(ValueError, match="grid"):
        _loader._dim3((1, 0), "grid")
    with pytest.raises(ValueError, match="block"):
        _loader._dim3((1, 1, 1, 1), "block")


def test_compile_options_are_nvrtc_safe():
    opts = _loader.COMPILE_OPTIONS
    assert "-std=c++17" in opts
    assert not any(o.startswith(("-arch", "--gpu-architecture")) for o in opts)  # CuPy adds its own
    assert not any("fast-math" in o or "fast_math" in o for o in opts)


def test_import_does_not_import_cupy_or_touch_cuda():
    code = ("import sys, cupyflash, cupyflash._loader, cupyflash._report; "
            "import cupyflash._families, cupyflash._run, cupyflash._launch, cupyflash._params; "
            "print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ---- precompile's selection ----------------------------------------------------------------

_CAT = [
    FWD_SIMT.row("k", t, d, role=FORWARD_ROLE, dtype=t, head_dim=d, head_dim_v=d, threads=128)
    for t in ("float16", "float32") for d in (32, 64, 128)
] + [FWD_V1.row("v1", d, role=FORWARD_ROLE, dtype="float16", head_dim=d, head_dim_v=d, threads=128)
     for d in (64, 128)]


def test_select_filters_by_family_dtype_and_head_dim():
    assert select(_CAT) == _CAT
    assert {r.family for r in select(_CAT, families="fwd_v1")} == {FWD_V1}
    rows = select(_CAT, dtypes=[np.float32])
    assert {r.dtype for r in rows} == {"float32"} and len(rows) == 3
    # head dim 80 runs on the 128 instantiation; 64 on 64
    rows = select(_CAT, dtypes=["float16"], head_dims=[80, 64], families=["fwd_simt"])
    assert [r.head_dim for r in rows] == [64, 128]
    assert select(_CAT, head_dims=300) == []
    with pytest.raises(ValueError, match="nope"):
        select(_CAT, families=["nope"])


def test_launchable_is_what_the_dispatchers_pick_on_each_architecture():
    """precompile() compiles launchable(arch): every row a call on that architecture can
    pick, and no other tensor-core tile; each catalogue row is launchable somewhere."""
    off, dmma = KernelOptions(), KernelOptions(dmma=frozenset({"float64", "float32"}))

    def forward(dtype, d, arch, options=off, **call):
        return {r.name_expression for r in select_family(FORWARD, Call(dtype, d, d, aligned=True, **call), arch,
                                                         options)}

    def backward(dtype, d, arch, options=off, **call):
        return {r.name_expression for r in select_family(BACKWARD, Call(dtype, d, d, aligned=True, **call), arch,
                                                         options)}

    everywhere = set()
    for arch in (75, 80, 86, 89, 90):
        keep = {r.name_expression for r in launchable(arch)}
        everywhere |= keep
        picked = set()
        # calls with score features too (the families' feature tiles: a bias or mask, a modification)
        for features in (frozenset(), frozenset({"mask"}), frozenset({"score_mod"})):
            for dtype in ("float16", "bfloat16", "float32", "float64"):
                for d in MMA_HEAD_DIMS:
                    for split in (False, True):   # the split-KV rows too
                        picked |= forward(dtype, d, arch, split=split, features=features)
                    # fwd_mma's whole-KV rows (Lk a multiple of every block_n)
                    picked |= forward(dtype, d, arch, seqlen_k=4096, features=features)
                    if d <= 128:   # fwd_dmma, opt-in; fwd_tf32 where precision allows TF32
                        picked |= forward(dtype, d, arch, dmma, features=features)
                        for precision in ("tf32", "tf32x3"):
                            picked |= forward(dtype, d, arch, precision=precision, features=features)
                    for deterministic in (True, False):
                        for options in (off, dmma):   # bwd_dmma, opt-in
                            picked |= backward(dtype, d, arch, options, deterministic=deterministic,
                                               features=features)
                        # bwd_mma's whole-stream rows (Lq and Lk multiples of every streamed block)
                        picked |= backward(dtype, d, arch, deterministic=deterministic, seqlen_q=4096,
                                           seqlen_k=4096, features=features)
                        for precision in ("tf32", "tf32x3"):   # bwd_tf32
                            picked |= backward(dtype, d, arch, deterministic=deterministic, precision=precision,
                                               features=features)
        assert picked <= keep, (arch, sorted(picked - keep)[:3])
        mma = {n for n in keep if "_mma_" in n}
        assert mma == {n for n in picked if "_mma_" in n}, arch   # no other class's tiles
        assert (arch < 80) == (not mma)
    assert everywhere == {r.name_expression for r in catalogue()}


def test_cached_cubin_compiles_once_then_reads_the_disk_cache(tmp_path, monkeypatch):
    # the architecture-specific loader's disk cache (issue 29: a second process loads a
    # compiled expression from it): a second request, in this process or another, finds
    # the cubin by its key and never calls NVRTC; another expression is another key
    from cupyflash import _nvrtc
    from cupyflash._terms import ScoreOperands
    from cupyflash._validation import check_score_functions

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    compiles = []
    real = _nvrtc.compiler()

    class Spy:
        version = real.version

        def compile(self, *a, **kw):
            compiles.append(a[1])
            return real.compile(*a, **kw)

    monkeypatch.setattr(_nvrtc, "compiler", lambda: Spy())

    def entry(text):
        mods = check_score_functions(None, None, text, None, None, kind="numpy", device=None, batch_shape=(1, 2))
        return ScoreOperands(mods=mods).entry(FWD_SIMT.entry)

    name = (FWD_SIMT.rows[0].name_expression,)
    first = _loader.cached_cubin(entry("score * 0.5"), name, "sm_80")
    assert len(compiles) == 1 and Path(first[0]).is_file() and set(first[1]) == set(name)
    assert _loader.cached_cubin(entry("score * 0.5"), name, "sm_80") == first and len(compiles) == 1
    other = _loader.cached_cubin(entry("score * 0.25"), name, "sm_80")
    assert other[0] != first[0] and len(compiles) == 2
