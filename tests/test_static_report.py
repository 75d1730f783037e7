"""Tier 0 offline compilation: every catalogue kernel compiled with NVRTC for sm_80 and sm_90.

No GPU needed.  Each entry file is compiled once per arch (a module-scoped
fixture; the report caches in-process), then every row is checked against the
budget: no spills, no stack frame, no local-memory instructions, registers
within 255, at least one resident block per SM.  A planted spilling kernel,
compiled through the same function, proves the parser sees spills.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _util import on_ci

from cupyflash import _nvrtc, _report, _source
from cupyflash._report import main_kernels
from cupyflash._loader import module_source

pytestmark = pytest.mark.slow

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")   # DESIGN.md section 5: every instantiation, all four


@pytest.fixture(scope="module")
def rows():
    # each row on every arch that may launch it (tests/test_families.py's report, the same
    # compiles): a row of another arch's tile class is checked on that arch
    return _report.kernel_report(ARCHS, launchable=True)


def _row_id(row):
    return f"{row['arch']}:{row['name']}"


def test_every_instantiation_is_reported_for_each_arch(rows):
    # ... for each arch that may launch it (its entry file has a target there: fwd_wgmma
    # is sm_90a only), and every row on one arch at least.
    from cupyflash._families import catalogue, launchable

    assert catalogue(), "the catalogue is empty"
    for arch in ARCHS:
        on = {r.name_expression for r in launchable(int(arch[3:]))}
        names = [i.name_expression for i in catalogue() if i.family.compile_target(arch) and i.name_expression in on]
        assert [r["name"] for r in rows if r["arch"] == arch] == names
        assert {r["target"] for r in rows if r["arch"] == arch} <= {arch, arch + "a"}
    assert {r["name"] for r in rows} == {i.name_expression for i in catalogue()}
    assert {r["arch"] for r in rows if r["family"] == "fwd_wgmma"} == {"sm_90"}


def test_no_spills_no_stack_no_local_memory(rows):
    bad = [(_row_id(r), r["spill_stores"], r["spill_loads"], r["stack_bytes"],
            r["sass"].get("LDL", 0), r["sass"].get("STL", 0))
           for r in rows
           if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]
           or r["sass"].get("LDL") or r["sass"].get("STL")]
    assert not bad, f"(kernel, spill st, spill ld, stack, LDL, STL): {bad}"


def test_registers_and_occupancy_within_budget(rows):
    for r in rows:
        assert 0 < r["registers"] <= 255, _row_id(r)
        assert r["occupancy"] >= 1, f"{_row_id(r)} cannot launch ({r['occupancy_limit']})"


def test_sass_was_read_for_every_kernel(rows):
    for r in rows:
        assert r["sass"], f"no SASS for {_row_id(r)}"
        assert r["sass"].get("EXIT", 0) >= 1


# The instructions each family is built from (DESIGN.md section 5): SIMT kernels
# do their products with FFMA (DFMA for float64), exp2 on the special-function
# unit (MUFU) for float accumulators, and no tensor-core mma; the mma.sync
# kernels use HMMA, LDSM (ldmatrix) and LDGSTS (cp.async).  A new family adds
# its row here.
INTENDED_SASS = {
    "fwd_simt": {"float": ("FFMA", "MUFU", "SHFL"), "double": ("DFMA", "SHFL")},
    "fwd_v1": {"float": ("FFMA", "MUFU"), "double": ("DFMA",)},
    "fwd_mma": {"float": ("HMMA", "LDSM", "LDGSTS", "MUFU")},
    "bwd_simt": {"float": ("FFMA",), "double": ("DFMA",)},
    "bwd_mma": {"float": ("HMMA", "LDSM", "LDGSTS", "MUFU")},
    "fwd_wgmma": {"float": ("HGMMA", "LDGSTS", "MUFU")},
    "bwd_wgmma": {"float": ("HGMMA", "LDGSTS", "MUFU")},
    "fwd_combine": {"float": ("LDG", "MUFU", "FFMA", "STG"), "double": ("LDG", "DFMA", "STG")},
    "fwd_dmma": {"double": ("DMMA", "LDGSTS", "LDS", "SHFL"), "float": ("DMMA", "F2F", "LDS", "SHFL")},
    "bwd_dmma": {"double": ("DMMA", "LDGSTS", "LDS", "SHFL"), "float": ("DMMA", "F2F", "LDS", "SHFL")},
    # fragments by 16-byte LDS (no ldmatrix for 32-bit elements), P from the accumulators in place;
    # the forward rounds (splits) and interleaves its tiles in shared memory once per CTA (STS),
    # the one-pass backward rounds its tiles there
    "fwd_tf32": {"float": ("HMMA", "LDGSTS", "LDS", "STS", "MUFU")},
    "bwd_tf32": {"float": ("HMMA", "LDGSTS", "LDS", "MUFU")},
}
ABSENT_SASS = {"fwd_simt": ("HMMA",), "fwd_v1": ("HMMA",), "bwd_simt": ("HMMA",),
               "fwd_combine": ("HMMA", "LDS", "STS", "BAR"), "fwd_dmma": ("HMMA", "LDSM"),
               "bwd_dmma": ("HMMA", "LDSM", "ATOM", "RED"),
               "fwd_wgmma": ("HMMA", "LDSM"), "bwd_wgmma": ("HMMA", "LDSM"),
               "fwd_tf32": ("LDSM", "DMMA"), "bwd_tf32": ("LDSM", "DMMA", "ATOM", "RED")}


def test_each_family_compiles_to_its_intended_instructions(rows):
    for r in rows:
        assert r["family"] in INTENDED_SASS, f"add the intended SASS of {r['family']} here"
        acc = "double" if r["dtype"] == "float64" else "float"
        for op in INTENDED_SASS[r["family"]][acc]:
            assert r["sass"].get(op, 0) > 0, f"{_row_id(r)} has no {op}"
        for op in ABSENT_SASS.get(r["family"], ()):
            assert op not in r["sass"], f"{_row_id(r)} has {op}"


def test_json_cli_has_the_required_keys(rows, capsys):
    assert main_kernels(["--json", "--arch", "sm_80", "--launchable"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data) == sum(r["arch"] == "sm_80" for r in rows)
    for row in data:
        missing = set(_report.REQUIRED_KEYS) - set(row)
        assert not missing, f"{row['name']}: missing {missing}"
        assert isinstance(row["sass"], dict)


def test_text_cli_prints_one_line_per_row(rows, capsys):
    assert main_kernels([arg for arch in ARCHS for arg in ("--arch", arch)] + ["--launchable"]) == 0
    out = capsys.readouterr().out
    for r in rows:
        assert re.search(re.escape(r["name"]) + r"\s+" + r["arch"], out)
    assert main_kernels(["--arch", "sm_75"]) == 2


# ---- the parser sees what it should (planted kernels) ------------------------------------

PLANTED = r"""
// Too many live values for the 32 registers __launch_bounds__(256, 8) leaves: spills.
template <int N>
__global__ void __launch_bounds__(256, 8) pressure(const float* __restrict__ in, float* __restrict__ out) {
    float acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = in[threadIdx.x + i * 256];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = acc[i] * acc[(i * 7 + r) % N] + 1.0f;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) s += acc[i] * (i + 1);
    out[threadIdx.x] = s;
}
// A local array indexed at run time lives in a stack frame.
__global__ void local_array(float* out, int k) {
    float a[2000];
    for (int i = 0; i < 2000; ++i) a[i] = out[i] * 2.0f;
    out[0] = a[k];
}
__global__ void with_static_smem(float* out) {
    __shared__ float tile[1024];
    tile[threadIdx.x] = out[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = tile[1023 - threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def planted():
    return _report.compile_report(PLANTED, ["pressure<128>", "pressure<4>", "local_array",
                                            "with_static_smem"], "sm_80")


def test_planted_spilling_kernel_is_detected(planted):
    spill = planted.functions["pressure<128>"]
    assert spill.spill_stores > 0 and spill.spill_loads > 0
    assert spill.sass.get("STL", 0) > 0 and spill.sass.get("LDL", 0) > 0
    assert spill.registers <= 32
    clean = planted.functions["pressure<4>"]
    assert (clean.spill_stores, clean.spill_loads, clean.stack_bytes) == (0, 0, 0)
    assert "STL" not in clean.sass and "LDL" not in clean.sass


def test_planted_stack_frame_and_static_shared_memory_are_read(planted):
    assert planted.functions["local_array"].stack_bytes >= 8000
    smem = planted.functions["with_static_smem"]
    assert smem.static_shared_bytes == 4096
    assert smem.barriers == 1 and smem.sass.get("BAR", 0) >= 1
    assert planted.functions["pressure<4>"].mangled == "_Z8pressureILi4EEvPKfPf"


def test_sass_opcodes_drop_predicates_and_modifiers():
    assert _report.sass_opcode("@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4") == "HMMA"
    assert _report.sass_opcode("@UP1 LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]") == "LDGSTS"
    assert _report.sass_opcode("@!PT LDS RZ, [RZ]") == "LDS"
    assert _report.sass_opcode("EXIT") == "EXIT"


def test_compile_error_carries_the_nvrtc_log():
    with pytest.raises(_report.NvrtcError, match="undefined_thing"):
        _report.compile_report("__global__ void k() { undefined_thing(); }", ["k"], "sm_80",
                               sass=False)


# ---- the source handed to NVRTC ------------------------------------------------------------


def test_nvrtc_gets_the_assembled_source_with_every_header(monkeypatch):
    from cupyflash._families import catalogue, entry_family

    seen = {}

    class Recorder:
        version = (13, 0)

        def compile(self, source, names, options, filename):
            seen[filename] = (source, options)
            raise _report.NvrtcError("recorded")

    monkeypatch.setattr(_nvrtc, "compiler", lambda: Recorder())
    insts = catalogue()
    for entry in {i.entry for i in insts}:
        # sm_86 (sm_90, i.e. sm_90a, for the sm_90a-only entry): compiled by the fixtures
        # only with SASS, so the report cache (keyed by sass too) cannot answer
        family = entry_family(entry)
        arch = "sm_86" if family.compile_target("sm_86") else "sm_90"
        target = family.compile_target(arch)
        with pytest.raises(_report.NvrtcError, match="recorded"):
            _report.kernel_report([arch], [i for i in insts if i.entry == entry], sass=False)
        source, options = seen[f"cuda_src/{entry}"]
        assert source == module_source(entry)
        root = _source.cuda_src_dir()
        for name in re.findall(r'#line \d+ "cuda_src/([^"]+)"', source):
            for line in (root / name).read_text().splitlines():
                if not re.match(r'\s*#\s*(include\s+"|pragma\s+once)', line):
                    assert line in source, f"{name}: {line!r} missing"
        assert f"-arch={target}" in options and "-ftz=true" in options
        assert "--ptxas-options=-v" in options and "-std=c++17" in options


def test_editing_a_header_changes_the_source_hash(tmp_path, monkeypatch):
    from cupyflash._families import catalogue

    root = tmp_path / "cuda_src"
    shutil.copytree(_source.cuda_src_dir(), root)
    entry = catalogue()[0].entry
    before = _source.source_hash(module_source(entry))
    monkeypatch.setenv("CUPYFLASH_CUDA_SRC", str(root))
    _source.cuda_src_dir.cache_clear()
    try:
        assert _source.source_hash(module_source(entry)) == before
        with open(root / "ptx.cuh", "a") as f:
            f.write("\n// edited\n")
        assert _source.source_hash(module_source(entry)) != before
    finally:
        _source.cuda_src_dir.cache_clear()


# ---- occupancy against CUDA's own calculator ---------------------------------------------------

_OCC_PROGRAM = r"""
#include <cstdio>
#include "cuda_occupancy.h"
int main() {
    int major, minor, max_threads, threads, regs, barriers;
    long smem_sm, optin, reserved, smem_static, smem_dyn;
    while (scanf("%d %d %d %ld %ld %ld %d %d %ld %ld %d", &major, &minor, &max_threads, &smem_sm,
                 &optin, &reserved, &threads, &regs, &smem_static, &smem_dyn, &barriers) == 11) {
        cudaOccDeviceProp p{};
        p.computeMajor = major; p.computeMinor = minor; p.maxThreadsPerBlock = 1024;
        p.maxThreadsPerMultiprocessor = max_threads; p.regsPerBlock = 65536;
        p.regsPerMultiprocessor = 65536; p.warpSize = 32; p.sharedMemPerBlock = 48 * 1024;
        p.sharedMemPerMultiprocessor = smem_sm; p.numSms = 1; p.sharedMemPerBlockOptin = optin;
        p.reservedSharedMemPerBlock = reserved;
        cudaOccFuncAttributes a{};
        a.maxThreadsPerBlock = 1024; a.numRegs = regs; a.sharedSizeBytes = smem_static;
        a.partitionedGCConfig = PARTITIONED_GC_OFF; a.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;
        a.maxDynamicSharedSizeBytes = optin - smem_static; a.numBlockBarriers = barriers;
        cudaOccDeviceState s{};
        cudaOccResult r{};
        int err = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &p, &a, &s, threads, smem_dyn);
        printf("%d\n", err ? 0 : r.activeBlocksPerMultiprocessor);
    }
}
"""


def test_occupancy_matches_cuda_occupancy_header(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    try:
        from cuda import pathfinder

        include = Path(pathfinder.find_nvidia_header_directory("cudart"))
    except Exception:
        include = None
    if not cxx or include is None or not (include / "cuda_occupancy.h").is_file():
        pytest.skip("needs a C++ compiler and cuda_occupancy.h")
    (tmp_path / "occ.cpp").write_text(_OCC_PROGRAM)
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{include}", "occ.cpp", "-o", "occ"],
                   cwd=tmp_path, check=True)
    rng = random.Random(0)
    cases = []
    for _ in range(2000):
        arch = rng.choice(sorted(_report.SM_LIMITS))
        cases.append((arch, rng.choice([32, 64, 96, 128, 160, 256, 384, 512, 1024]),
                      rng.randint(1, 255), rng.choice([0, 0, 1024, 16000]),
                      rng.choice([0, 1000, 16384, 49152, 65536, 98304, 110000, 150000, 230000]),
                      rng.choice([0, 1, 2, 3])))
    lines = []
    for arch, threads, regs, st, dyn, bars in cases:
        lim = _report.SM_LIMITS[arch]
        lines.append(f"{arch // 10} {arch % 10} {lim.max_threads_per_sm} {lim.shared_per_sm} "
                     f"{lim.shared_per_block_optin} {lim.shared_reserved_per_block} {threads} {regs} {st} "
                     f"{dyn} {bars}")
    done = subprocess.run([str(tmp_path / "occ")], input="\n".join(lines), capture_output=True,
                          text=True, check=True)
    expected = [int(x) for x in done.stdout.split()]
    ours = [_report.occupancy(a, threads=t, registers=r, shared_bytes=s + d, barriers=b)[0]
            for a, t, r, s, d, b in cases]
    mismatches = [(c, e, o) for c, e, o in zip(cases, expected, ours) if e != o]
    assert not mismatches, mismatches[:5]
    assert len(set(ours)) > 5      # the sample spans many occupancy levels


def test_occupancy_known_values():
    # 128 threads x 255 regs on sm_80: 256*... = 8160 regs/warp -> 2 warps/partition -> 2 blocks
    assert _report.occupancy("sm_80", threads=128, registers=255, shared_bytes=0) == (2, "registers")
    # 100 KB of shared memory on sm_86 (99 KB max per block) cannot launch
    assert _report.occupancy("sm_86", threads=128, registers=32, shared_bytes=100 * 1024)[0] == 0
    # 227 KB on sm_90 fits exactly one block
    assert _report.occupancy("sm_90", threads=128, registers=64, shared_bytes=227 * 1024) == (1, "shared")


# ---- the oldest NVRTC ----------------------------------------------------------------------------

# The kernels are compiled by whichever NVRTC the user's CuPy finds, as old as
# 13.0 for cupy-cuda13x (an H200 machine had exactly that, and 13.0 rejected
# __builtin_offsetof, which 13.5 accepts: every kernel failed there).  .ci/run
# fetches that NVRTC and names its library here.
OLDEST_NVRTC = os.environ.get("CUPYFLASH_TEST_OLDEST_NVRTC")


# The same for cupy-cuda12x with the oldest CUDA 12 NVRTC (12.0 has no
# __builtin_bit_cast): everything must compile; its register allocation is its
# own (a few spills in fwd_mma's d = 128 tiles), so no spill check.  What it
# can reject is source and inline PTX, which no kernel spells differently per
# architecture (only wgmma.cuh needs sm_90a), so sm_90 alone -- every entry file,
# the wgmma ones too -- is the check (both archs took 190 s of CI's 17 minutes).
# And of sm_90's rows, one template instance per form (_forms): the rows of a form
# differ only in integer constants, which 13.5's report compiles in every row.
OLDEST_NVRTC_12 = os.environ.get("CUPYFLASH_TEST_OLDEST_NVRTC_12")


def _forms(rows) -> list:
    """Of ``rows``, the smallest and the largest head dim of each form: a kernel template
    with its type and bool arguments (the integer ones are tile constants), so every
    ``if constexpr`` on a type or flag, and both ends of the head-dim branches, compile.

    >>> from cupyflash._families import FWD_DMMA
    >>> dims = sorted({r.head_dim for r in FWD_DMMA.rows})
    >>> sorted({r.head_dim for r in _forms(FWD_DMMA.rows)}) == [dims[0], dims[-1]] and len(dims) > 2
    True
    """
    forms: dict[tuple, list] = {}
    for r in rows:
        template, args = re.fullmatch(r"([\w:]+)<(.*)>", r.name_expression).groups()
        form = tuple("N" if re.fullmatch(r"-?\d+", a.strip()) else a.strip() for a in args.split(","))
        forms.setdefault((template, form), []).append(r)
    keep = {id(f(group, key=lambda r: r.head_dim)) for group in forms.values() for f in (min, max)}
    return [r for r in rows if id(r) in keep]


def _report_with_nvrtc(lib: Path, archs=("sm_90",), select=None) -> list[dict]:
    """``python -m cupyflash kernels --launchable --json`` for ``archs`` with the libnvrtc
    ``lib``: what a GPU of each arch compiles with that NVRTC (``select``: of those rows,
    ``select(rows)``).  The other tile classes' rows are the same templates with other
    constants, and the main report compiles them for their own targets."""
    from cupyflash._families import catalogue, launchable

    env = dict(os.environ, CUPYFLASH_NVRTC=str(lib),   # its builtins library sits beside it
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib.parent),
                                                             os.environ.get("LD_LIBRARY_PATH")])))
    rows_in = {arch: [i for i in catalogue() if i.family.compile_target(arch) is not None
                      and i in launchable(int(arch.removeprefix("sm_")))] for arch in archs}
    if select is not None:
        rows_in = {arch: select(rows) for arch, rows in rows_in.items()}
    # the CLI's --launchable, with the selection: the rows go to the child by name
    code = ("import json, sys\n"
            "from cupyflash import _report\n"
            "from cupyflash._families import catalogue\n"
            "rows = []\n"
            "for arch, names in json.load(sys.stdin).items():\n"
            "    rows += _report.kernel_report([arch], [i for i in catalogue() if i.name_expression in names],\n"
            "                                  sass=False)\n"
            "json.dump(rows, sys.stdout)\n")
    request = json.dumps({arch: [i.name_expression for i in rows] for arch, rows in rows_in.items()})
    done = subprocess.run([sys.executable, "-c", code], input=request,
                          env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert [(r["arch"], r["name"]) for r in rows] == [(arch, i.name_expression) for arch in archs
                                                      for i in rows_in[arch]]
    return rows


def needs_nvrtc(path, variable):
    """Skip without ``variable`` (.ci/run sets it) -- or, on CI (``CI=true``), fail."""
    if not path:
        why = f"{variable} is not set (.ci/run sets it after fetching that NVRTC)"
        if on_ci():
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)


def test_every_kernel_compiles_with_the_oldest_cuda12_nvrtc():
    from cupyflash._families import catalogue

    needs_nvrtc(OLDEST_NVRTC_12, "CUPYFLASH_TEST_OLDEST_NVRTC_12")
    rows = _report_with_nvrtc(Path(OLDEST_NVRTC_12), select=_forms)
    assert {r["entry"] for r in rows} == {i.entry for i in catalogue()}


def test_every_kernel_compiles_with_the_oldest_nvrtc():
    from cupyflash._families import FWD_MMA, FWD_V1, catalogue
    from cupyflash._families.fwd_mma import MMA_HEAD_DIMS

    needs_nvrtc(OLDEST_NVRTC, "CUPYFLASH_TEST_OLDEST_NVRTC")
    # sm_90 alone, as for 12.0: the source is the same for every target (only
    # wgmma.cuh looks at __CUDA_ARCH__), an instruction another target lacks is
    # caught by the main report's four targets, and sm_90 is where the spills are
    # checked (sm_80 as well took about 95 s of CI's two cores).
    rows = _report_with_nvrtc(Path(OLDEST_NVRTC))
    # what the sm_90 dispatcher picks (fwd_mma's table and its whole-KV rows, every
    # other forward row but fwd_v1's, every backward row) runs without spills or a
    # stack frame under this compiler too
    tiles = FWD_MMA.class_tiles(90)
    picked = {FWD_MMA.make_row(dtype, d, tiles[d], whole_kv=whole_kv).name_expression
              for dtype in ("float16", "bfloat16") for d in MMA_HEAD_DIMS for whole_kv in (False, True)}
    picked |= {r.name_expression for r in catalogue() if r.family not in (FWD_MMA, FWD_V1)}
    # Known exceptions, each pinned to its (spill, stack) bytes; 13.5 spills none of them.
    # - fwd_mma's whole-KV row of d = 128's tile: NVRTC 13.0 keeps 13 loop-invariant
    #   values in local memory (52 B: 13 LDL per key block of ~1,200 instructions,
    #   cached in L1). benchmarks/gpu_variants.py times it against the bounds-checked
    #   row, which 13.0 compiles without spills.
    # - bwd_mma's whole-stream dK/dV rows at d = 128 (both stage counts) and d = 224's
    #   dK launch: one register (two at 224), stored once and reloaded once per query
    #   head, outside the streamed loop.
    known = {FWD_MMA.make_row(dtype, 128, tiles[128], whole_kv=True).name_expression: (52, 56)
             for dtype in ("float16", "bfloat16")}
    for cxx in ("__half", "__nv_bfloat16"):
        known.update({f"cf::bwd_mma_dkdv_kernel<{cxx}, 128, 64, 32, 4, 3, {stages}, true>": (4, 8)
                      for stages in (1, 2)})
        known[f"cf::bwd_mma_dkdv_kernel<{cxx}, 224, 64, 32, 4, 2, 1, true>"] = (8, 8)
    bad = [(r["name"], r["spill_stores"], r["stack_bytes"]) for r in rows
           if r["arch"] == "sm_90" and r["name"] in picked and (r["spill_stores"] or r["stack_bytes"])
           and known.get(r["name"]) != (r["spill_stores"], r["stack_bytes"])]
    assert not bad, bad


def test_report_tests_share_one_xdist_worker(tmp_path):
    # The README's `-n auto --dist loadgroup` keeps the tests of the report fixtures on
    # one worker (tests/conftest.py), or CI compiles the catalogue once per worker;
    # pytest 9.2 broke that silently (pytest-xdist issue 1386).  Six tests of a
    # `report` fixture and six others, on two workers: every `report` test on one.
    pytest.importorskip("xdist")
    for helper in ("conftest.py", "_util.py"):   # the conftest imports _util
        shutil.copy(Path(__file__).with_name(helper), tmp_path / helper)
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import time\nimport pytest\n\n"
            "@pytest.fixture(scope='module')\ndef report():\n    return 1\n\n"
            "@pytest.mark.parametrize('i', range(3))\ndef test_uses_report(report, i):\n    time.sleep(0.1)\n\n"
            "@pytest.mark.parametrize('i', range(3))\ndef test_other(i):\n    time.sleep(0.1)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                           "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"\[(gw\d+)\] .*PASSED .*::(test_\w+)\[\d\](@static-report)?", done.stdout)
    assert len(ran) == 12, done.stdout[-3000:]
    assert {(test, group) for _, test, group in ran} == {("test_uses_report", "@static-report"),
                                                         ("test_other", "")}
    assert len({worker for worker, test, _ in ran if test == "test_uses_report"}) == 1


# ---- issue 29: the kernels a call with a score modification runs, at d = 128 ---------------------

# (example, cuda_src entry, arch) where a row spilled before the families took their feature
# tiles (and bwd_dmma its order of products): tools/mods_report.py compiles every example for
# every family (16 minutes on two cores, benchmarks/results/terms/); these are its worst cases
REPO = Path(__file__).resolve().parents[1]
SPILLED_BEFORE = [
    ("distance kernel", "bwd_dmma.cu", 80), ("distance kernel", "bwd_tf32.cu", 80),
    ("relative-position table", "fwd_wgmma.cu", 90), ("relative-position table", "fwd_tf32.cu", 90),
    ("temperature per batch", "fwd_dmma.cu", 90), ("softcap=", "bwd_mma.cu", 90),
    ("T5 buckets", "bwd_wgmma.cu", 90),
]


@pytest.mark.parametrize("example, entry, arch", SPILLED_BEFORE, ids=[f"{e}-{a}" for _, e, a in SPILLED_BEFORE])
def test_rows_planned_for_a_score_modification_do_not_spill(example, entry, arch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mods_report", REPO / "tools" / "mods_report.py")
    mods_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mods_report)
    rows = mods_report.report([arch], [example], entries={entry}, quiet=True)
    assert rows
    spilled = [(r["kernel"], r["spill_stores"], r["stack"]) for r in rows if r["spill_stores"] or r["stack"]]
    assert not spilled, spilled


# ---- issue 27: the kernels a call with per-sequence lengths runs ---------------------------------

# (entry, arch) of the d = 128 rows that spilled in the padded form before the dK/dV kernels took
# dV's product first there (bwd_dmma; bwd_tf32's tf32x3 on sm_90): tools/lengths_report.py
# compiles every row a call with lengths plans, both forms (benchmarks/results/lengths/)
LENGTHS_SPILLED_BEFORE = [("bwd_dmma.cu", 80), ("bwd_tf32.cu", 90)]


@pytest.mark.parametrize("entry, arch", LENGTHS_SPILLED_BEFORE, ids=[f"{e}-{a}" for e, a in LENGTHS_SPILLED_BEFORE])
def test_rows_planned_with_lengths_do_not_spill(entry, arch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lengths_report", REPO / "tools" / "lengths_report.py")
    lengths_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths_report)
    rows = lengths_report.report([arch], entries={entry}, forms=("padded",), head_dims=(128,))
    assert rows
    spilled = [(r["kernel"], r["spill_stores"], r["stack"]) for r in rows if r["spill_stores"] or r["stack"]]
    assert not spilled, spilled


# ---- issue 28: the kernels a decode step or a chunked prefill over a KV cache runs --------------

# (entry, arch, form, head dim) of the rows that spilled before: with a paged cache, the table
# lookups of the 64-key tiles (fwd_mma d = 128 on sm_90, 4-8 B; fwd_tf32 d = 64, 16-64 B), which
# take 32-key blocks over a paged cache now; and fwd_simt float32 d = 32 on sm_80 with a dense
# cache and lengths (16 B), which now builds its output pointers after the loop.
# tools/lengths_report.py --form paged compiles every row such a call plans (none spills).
DECODE_SPILLED_BEFORE = [("fwd_mma.cu", 90, "paged", 128), ("fwd_tf32.cu", 80, "paged", 64),
                         ("fwd_tf32.cu", 90, "paged", 64), ("fwd_simt.cu", 80, "padded", 32)]


@pytest.mark.parametrize("entry, arch, form, head_dim", DECODE_SPILLED_BEFORE,
                         ids=[f"{e}-{a}-{f}" for e, a, f, _ in DECODE_SPILLED_BEFORE])
def test_rows_planned_over_a_kv_cache_do_not_spill(entry, arch, form, head_dim):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lengths_report", REPO / "tools" / "lengths_report.py")
    lengths_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths_report)
    rows = lengths_report.report([arch], entries={entry}, forms=(form,), head_dims=(head_dim,))
    assert rows
    spilled = [(r["kernel"], r["spill_stores"], r["stack"]) for r in rows if r["spill_stores"] or r["stack"]]
    assert not spilled, spilled
