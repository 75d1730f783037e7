"""The static kernel report: compile every instantiation offline and read what ptxas made of it.

No GPU is needed.  Each ``cuda_src/`` entry file is compiled once per target
architecture by NVRTC (the compiler CuPy uses, called directly through
:mod:`cupyflash._nvrtc`, because CuPy's own compile path wants a device and its
``getCUBIN`` drops the cubin's last byte), with the loader's options plus what
CuPy adds itself (``-arch=sm_XX``, ``-ftz=true``,
``--device-as-default-execution-space`` and its include paths), with
``--ptxas-options=-v`` on.  From the result:

- the ptxas log per kernel: registers, spill stores/loads, stack frame,
  static shared memory, barriers;
- the cubin's SASS (``cuobjdump -sass``, from the ``nvidia-cuda-cuobjdump``
  and ``nvidia-cuda-nvdisasm`` wheels) as a histogram of opcodes without
  modifiers (``HMMA``, ``LDSM``, ``LDGSTS``, ``LDL``, ``STL``, ``FFMA``, ...);
- theoretical occupancy (resident blocks per SM) from registers, threads and
  shared memory (static + the dynamic amount the launch configuration asks
  for on a representative shape), with the arithmetic of CUDA's
  ``cuda_occupancy.h`` and the per-architecture limits in :data:`SM_LIMITS`;
- the compile time of each module.

Results are cached in-process by (source text, name expressions, arch,
options), so tests and the CLI compile each module once.

:func:`main_kernels` is ``python -m cupyflash kernels [--arch ...] [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import _nvrtc as nvrtc
from ._arch import SM_LIMITS, SMLimits
from ._loader import module_source
from ._nvrtc import NvrtcError

__all__ = [
    "ARCHS",
    "SM_LIMITS",
    "SMLimits",
    "NvrtcError",
    "FunctionReport",
    "ModuleReport",
    "compile_report",
    "occupancy",
    "kernel_report",
    "REQUIRED_KEYS",
    "format_table",
    "main_kernels",
]

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

# Keys every row of :func:`kernel_report` carries.
REQUIRED_KEYS = ("name", "family", "dtype", "head_dim", "head_dim_v", "arch", "threads",
                 "registers", "static_shared_bytes", "dynamic_shared_bytes", "shared_bytes",
                 "spill_stores", "spill_loads", "stack_bytes", "barriers", "occupancy",
                 "occupancy_limit", "sass", "compile_seconds")


def _target_name(arch) -> str:
    """``"sm_90"``, ``"90"``, ``90`` -> ``"sm_90"``; ``"sm_90a"`` -> ``"sm_90a"`` (an
    architecture-specific target keeps its suffix)."""
    suffix = "a" if str(arch).endswith("a") else ""
    return f"sm_{_arch_number(arch)}{suffix}"


def _arch_number(arch) -> int:
    """``"sm_90"``, ``"90"`` or ``90`` -> 90."""
    text = str(arch)
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)a?", text)
    if not m:
        raise ValueError(f"`arch` must look like 'sm_90', got {arch!r}")
    return int(m.group(1))


def occupancy(arch, *, threads: int, registers: int, shared_bytes: int,
              barriers: int = 1) -> tuple[int, str]:
    """Theoretical resident blocks per SM and the resource that limits it.

    ``shared_bytes`` is static plus dynamic shared memory per block.
    Returns ``(blocks, limiter)`` with limiter one of ``"blocks"``,
    ``"threads"``, ``"registers"``, ``"shared"``, ``"barriers"``; 0 blocks
    means the kernel cannot launch with these resources.
    """
    lim = SM_LIMITS[_arch_number(arch)]
    if threads > lim.max_threads_per_block or threads < 1:
        return 0, "threads"
    warps = -(-threads // 32)
    candidates = {"blocks": lim.max_blocks_per_sm,
                  "threads": lim.max_threads_per_sm // 32 // warps}
    # Registers go to warps in units of register_alloc_unit, evenly over the
    # sub-partitions; the launch check rounds the warps up to a multiple of them.
    regs_per_warp = -(-registers * 32 // lim.register_alloc_unit) * lim.register_alloc_unit
    if registers > lim.max_registers_per_thread or \
            regs_per_warp * (-(-warps // lim.sub_partitions) * lim.sub_partitions) > lim.registers_per_block:
        candidates["registers"] = 0
    elif regs_per_warp:
        warps_per_partition = lim.registers_per_sm // lim.sub_partitions // regs_per_warp
        candidates["registers"] = warps_per_partition * lim.sub_partitions // warps
    smem = shared_bytes + lim.shared_reserved_per_block
    smem = -(-smem // lim.shared_alloc_unit) * lim.shared_alloc_unit
    if shared_bytes > lim.shared_per_block_optin:
        candidates["shared"] = 0
    elif smem:              # no shared memory at all (none reserved before sm_80): no limit
        candidates["shared"] = lim.shared_per_sm // smem
    if barriers > 0 and lim.barriers_per_block_slot:
        candidates["barriers"] = lim.barriers_per_block_slot * lim.max_blocks_per_sm // barriers
    limiter = min(candidates, key=lambda k: candidates[k])
    return candidates[limiter], limiter


def nvrtc_options(arch) -> tuple[str, ...]:
    """The options the report compiles with for ``arch``: the loader's plus CuPy's own,
    with ptxas's resource report on."""
    return nvrtc.options(_target_name(arch), ptxas_verbose=True)


# ---- ptxas log and SASS -------------------------------------------------------------

@dataclass
class FunctionReport:
    """What ptxas and cuobjdump say about one kernel of a module."""

    name_expression: str
    mangled: str
    registers: int = 0
    barriers: int = 0
    static_shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    sass: dict[str, int] | None = None
    sass_text: str | None = field(default=None, repr=False)   # this kernel's ``cuobjdump -sass`` section


@dataclass
class ModuleReport:
    """One NVRTC compile (one entry file, one arch) and its kernels."""

    arch: str
    compile_seconds: float
    functions: dict[str, FunctionReport]   # by name expression
    log: str = field(repr=False, default="")


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per mangled kernel name: registers, barriers, static_shared_bytes, stack and spill bytes."""
    stats: dict[str, dict[str, int]] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _RE_ENTRY.search(line):
            entry = m.group(1)
            stats.setdefault(entry, dict(registers=0, barriers=0, static_shared_bytes=0,
                                         stack_bytes=0, spill_stores=0, spill_loads=0))
            continue
        if m := _RE_PROPS.search(line):
            props = m.group(1)
            continue
        if (m := _RE_FRAME.search(line)) and props in stats:
            s = stats[props]
            s["stack_bytes"] = max(s["stack_bytes"], int(m.group(1)))
            s["spill_stores"] += int(m.group(2))
            s["spill_loads"] += int(m.group(3))
            continue
        if (m := _RE_USED.search(line)) and entry is not None:
            s = stats[entry]
            s["registers"] = int(m.group(1))
            if b := _RE_BARRIERS.search(line):
                s["barriers"] = int(b.group(1))
            if sm := _RE_SMEM.search(line):
                s["static_shared_bytes"] = int(sm.group(1))
            if c := _RE_CUMULATIVE.search(line):
                s["stack_bytes"] = max(s["stack_bytes"], int(c.group(1)))
    return stats


_RE_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_RE_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_RE_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


def sass_opcode(instruction: str) -> str:
    """``"@!P0 HMMA.16816.F32 R4, ..."`` -> ``"HMMA"``."""
    text = _RE_PREDICATE.sub("", instruction.strip())
    return text.split(None, 1)[0].split(".", 1)[0] if text else ""


def split_sass(text: str) -> dict[str, str]:
    """Per mangled function name in ``cuobjdump -sass`` output: its section of the text
    (from its ``Function :`` line to the next one)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := _RE_FUNCTION.match(line):
            current = sections.setdefault(m.group(1), [])
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in sections.items()}


def sass_instructions(text: str) -> list[str]:
    """The instructions of SASS text in order, without addresses and encodings
    (``"@!P0 BRA 0x1f00"``, ``"WARPGROUP.DEPBAR.LE gsb0, 0x1"``)."""
    return [m.group(1) for line in text.splitlines() if (m := _RE_INSTRUCTION.match(line))]


def parse_sass(text: str) -> dict[str, dict[str, int]]:
    """Per mangled function name in ``cuobjdump -sass`` output: opcode -> count."""
    return {name: dict(sorted(Counter(op for ins in sass_instructions(section)
                                      if (op := sass_opcode(ins))).items()))
            for name, section in split_sass(text).items()}


@functools.lru_cache(maxsize=1)
def _cuobjdump() -> tuple[str, dict] | None:
    """cuobjdump and an environment in which it finds nvdisasm, or None."""
    try:
        from cuda import pathfinder

        cuobjdump = pathfinder.find_nvidia_binary_utility("cuobjdump")
        nvdisasm = pathfinder.find_nvidia_binary_utility("nvdisasm")
    except Exception:
        cuobjdump = nvdisasm = None
    cuobjdump = cuobjdump or shutil.which("cuobjdump")
    nvdisasm = nvdisasm or shutil.which("nvdisasm")
    if not cuobjdump or not nvdisasm:
        return None
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(nvdisasm).parent), env.get("PATH", "")])
    return cuobjdump, env


def disassemble(cubin: bytes) -> str | None:
    """``cuobjdump -sass`` of a cubin, or None (with a warning) if the tools are missing."""
    tools = _cuobjdump()
    if tools is None:
        warnings.warn("cupyflash: cuobjdump/nvdisasm not found (pip install "
                      "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm); the report has no SASS",
                      RuntimeWarning, stacklevel=3)
        return None
    cuobjdump, env = tools
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "module.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([cuobjdump, "-sass", str(path)], env=env, capture_output=True,
                              text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"cuobjdump -sass failed: {done.stderr.strip()}")
    return done.stdout


# ---- compiling a module ---------------------------------------------------------------

class _ReportCache:
    """In-process cache of :class:`ModuleReport` objects, compiled once per key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple, ModuleReport] = {}
        self._locks: dict[tuple, threading.Lock] = {}

    def get(self, key: tuple, build) -> ModuleReport:
        with self._lock:
            if key in self._done:
                return self._done[key]
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._done:
                report = build()
                with self._lock:
                    self._done[key] = report
        return self._done[key]


_cache = _ReportCache()


def compile_report(source: str, name_expressions: Iterable[str], arch="sm_80", *,
                   sass: bool = True, filename: str = "kernel.cu") -> ModuleReport:
    """Compile ``source`` for ``arch`` with the report's options; per-kernel resources and SASS.

    The same function reports the catalogue (with :func:`~cupyflash._loader.module_source`
    as ``source``) and any test source, so a planted spilling kernel checks the parser.
    Cached in-process by (source, name expressions, arch, sass).
    """
    names = tuple(dict.fromkeys(name_expressions))
    arch_name = _target_name(arch)
    key = (source, names, arch_name, sass)

    def build() -> ModuleReport:
        options = nvrtc_options(arch_name)
        start = time.perf_counter()
        log, cubin, lowered = nvrtc.compiler().compile(source, names, options, filename)
        seconds = time.perf_counter() - start
        stats = parse_ptxas_log(log)
        histograms = sections = None
        if sass:
            text = disassemble(cubin)
            if text is not None:
                histograms, sections = parse_sass(text), split_sass(text)
        functions = {}
        for name in names:
            mangled = lowered[name]
            if mangled not in stats:
                raise RuntimeError(f"ptxas log has no entry for {name} ({mangled}); "
                                   f"is it a __global__ function?\n{log}")
            functions[name] = FunctionReport(
                name, mangled, **stats[mangled],
                sass=None if histograms is None else histograms.get(mangled, {}),
                sass_text=None if sections is None else sections.get(mangled, ""))
        return ModuleReport(arch_name, seconds, functions, log)

    return _cache.get(key, build)


# ---- the catalogue report ---------------------------------------------------------------

def _dynamic_shared_bytes(inst) -> int:
    """Dynamic shared memory the launch configuration gives ``inst`` on a representative shape."""
    return int(inst.family.representative_shared_bytes(inst))


def kernel_report(archs: Sequence = ("sm_80",), instantiations=None, *,
                  sass: bool = True, sass_text: bool = False, max_workers: int | None = None,
                  progress=None, launchable: bool = False) -> list[dict]:
    """One row per (instantiation, arch), compiling each entry file once per arch.

    Parameters
    ----------
    archs : sequence of str
        Targets, from :data:`ARCHS`.
    instantiations : sequence of Instantiation, optional
        Default: :func:`cupyflash._families.catalogue`.
    sass : bool, default True
        Disassemble and count SASS opcodes.
    sass_text : bool, default False
        Also give each row its kernel's SASS text (key ``sass_text``; needs ``sass``).
    max_workers : int, optional
        Parallel compiles (NVRTC releases the GIL); default one per CPU.
    progress : callable, optional
        Called as ``progress(done, total, entry, arch)`` as each module (one
        entry file for one arch) finishes compiling, in the calling thread.
    launchable : bool, default False
        Per arch, only the rows a GPU of that compute capability may launch
        (:func:`cupyflash._families.launchable`), not every tile class's: what a
        user of that GPU can get.  A row another arch's tile class owns is
        compiled there, not here.

    Returns
    -------
    list of dict
        Keys :data:`REQUIRED_KEYS` plus ``mangled``, ``occupancy_warps`` and ``entry``;
        rows ordered like the catalogue, arch by arch.
    """
    if instantiations is None:
        from ._families import catalogue

        instantiations = catalogue()
    rows_in = list(instantiations)
    arch_names = [f"sm_{_arch_number(a)}" for a in archs]
    per_arch = {arch: rows_in for arch in arch_names}
    if launchable:
        from ._families import launchable as launchable_rows

        for arch in arch_names:
            names = {r.name_expression for r in launchable_rows(_arch_number(arch))}
            per_arch[arch] = [inst for inst in rows_in if inst.name_expression in names]
    groups: dict[tuple[str, str], list] = {}
    for arch in arch_names:
        for inst in per_arch[arch]:
            groups.setdefault((inst.entry, arch), []).append(inst)
    # An entry with an architecture-specific target (fwd_wgmma: sm_90a) is compiled
    # for that target on its arch and not at all on the others.
    family = {entry: rows[0].family for (entry, _), rows in groups.items()}
    jobs = [job for job in groups if family[job[0]].compile_target(job[1]) is not None]
    sources = {entry: module_source(entry) for entry in family}

    def run(job):
        entry, arch = job
        names = [inst.name_expression for inst in groups[job]]
        return job, compile_report(sources[entry], names, family[entry].compile_target(arch), sass=sass,
                                   filename=f"cuda_src/{entry}")

    workers = max_workers or max(1, min(len(jobs), os.cpu_count() or 1))
    modules = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done, future in enumerate(as_completed([pool.submit(run, job) for job in jobs]), 1):
            (entry, arch), module = future.result()
            modules[(entry, arch)] = module
            if progress is not None:
                progress(done, len(jobs), entry.removesuffix(".cu"), arch)

    rows = []
    for arch in arch_names:
        for inst in per_arch[arch]:
            module = modules.get((inst.entry, arch))
            if module is None:
                continue
            fn = module.functions[inst.name_expression]
            dynamic = _dynamic_shared_bytes(inst)
            shared = fn.static_shared_bytes + dynamic
            blocks, limiter = occupancy(arch, threads=inst.threads, registers=fn.registers,
                                        shared_bytes=shared, barriers=fn.barriers)
            rows.append(dict(
                name=inst.name_expression, family=inst.family.name, entry=inst.entry,
                dtype=inst.dtype, head_dim=inst.head_dim, head_dim_v=inst.head_dim_v,
                arch=arch, threads=inst.threads, registers=fn.registers,
                static_shared_bytes=fn.static_shared_bytes, dynamic_shared_bytes=dynamic,
                shared_bytes=shared, spill_stores=fn.spill_stores, spill_loads=fn.spill_loads,
                stack_bytes=fn.stack_bytes, barriers=fn.barriers, occupancy=blocks,
                occupancy_limit=limiter, occupancy_warps=blocks * -(-inst.threads // 32),
                sass=fn.sass, compile_seconds=round(module.compile_seconds, 3), target=module.arch,
                mangled=fn.mangled))
            if sass_text:
                rows[-1]["sass_text"] = fn.sass_text
    return rows


# ---- python -m cupyflash kernels --------------------------------------------------------

# All four targets of DESIGN.md's tier 0: the whole catalogue compiles in about
# 5 s per arch on two cores (one NVRTC compile per entry file and arch), so the
# full picture is the default; `--arch sm_80` alone is the quick look.
DEFAULT_ARCHS = ARCHS

# SASS opcodes shown in the table: tensor-core mma, ldmatrix, cp.async,
# local-memory traffic (must be 0), FP32 FMA, special-function unit (exp2).
SASS_COLUMNS = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "LDL", "STL", "FFMA", "MUFU")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupyflash kernels",
        description="Static report of every kernel instantiation, compiled offline with NVRTC.")
    p.add_argument("--arch", action="append", metavar="ARCH",
                   help=f"target ({', '.join(ARCHS)}, 'all', or sm_90a: the sm_90 rows built for "
                        "the architecture-specific target); repeatable; default all")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--family", action="append", help="only these kernel families (repeatable)")
    p.add_argument("--no-sass", action="store_true", help="skip disassembly (faster)")
    p.add_argument("--sass", metavar="NAME_SUBSTRING",
                   help="print the SASS of the rows whose name expression contains NAME_SUBSTRING "
                        "(cuobjdump's text, one 'Function :' section per kernel) instead of the table")
    p.add_argument("--launchable", action="store_true",
                   help="per --arch, only the rows a GPU of that compute capability may launch "
                        "(what cupyflash.precompile compiles for it), not every tile class's")
    return p


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of report rows."""
    header = ["kernel", "arch", "thr", "regs", "smem KB", "spill st/ld", "stack", "blk/SM"] + \
        list(SASS_COLUMNS) + ["compile s"]
    body = []
    for r in rows:
        sass = r["sass"] or {}
        body.append([
            r["name"], r["arch"], str(r["threads"]), str(r["registers"]),
            f"{r['shared_bytes'] / 1024:.1f}", f"{r['spill_stores']}/{r['spill_loads']}",
            str(r["stack_bytes"]), f"{r['occupancy']} ({r['occupancy_limit']})",
        ] + [str(sass.get(op, 0)) if r["sass"] is not None else "-" for op in SASS_COLUMNS]
          + [f"{r['compile_seconds']:.2f}"])
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    align = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(row, widths)))
    lines = [align(header), "  ".join("-" * w for w in widths)] + [align(r) for r in body]
    return "\n".join(lines)


def main_kernels(argv=None) -> int:
    """Entry point of the ``kernels`` subcommand; returns the exit status."""
    args = _parser().parse_args(argv)
    archs, specific_only = [], False
    for a in args.arch or DEFAULT_ARCHS:
        a = a if a.startswith("sm_") or a == "all" else f"sm_{a}"
        if a == "sm_90a":   # the rows compiled for sm_90a on sm_90 (fwd_wgmma, bwd_wgmma)
            a, specific_only = "sm_90", True
        archs.extend(ARCHS if a == "all" else [a])
    if specific_only and len(set(archs)) > 1:
        print("--arch sm_90a cannot be combined with other archs", file=sys.stderr)
        return 2
    if args.sass is not None and args.no_sass:
        print("--sass and --no-sass exclude each other", file=sys.stderr)
        return 2
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        print(f"unknown --arch {', '.join(unknown)}; choose from {', '.join(ARCHS)} or all",
              file=sys.stderr)
        return 2
    try:
        nvrtc.compiler()
    except Exception as error:  # ImportError (no cuda-pathfinder), library not found, ...
        print(f"cupyflash kernels: cannot load NVRTC ({type(error).__name__}: {error}); install "
              "the test extra (cuda-pathfinder and the NVRTC/CUDA header wheels)", file=sys.stderr)
        return 1
    from ._families import catalogue

    rows_in = catalogue()
    if args.family:
        rows_in = [r for r in rows_in if r.family.name in set(args.family)]
    if specific_only:
        rows_in = [r for r in rows_in if r.family.compile_target("sm_90") == "sm_90a"]
    if args.sass is not None:
        rows_in = [r for r in rows_in if args.sass in r.name_expression]
        if not rows_in:
            print(f"no kernel's name expression contains {args.sass!r}", file=sys.stderr)
            return 2
    start = time.perf_counter()
    archs = list(dict.fromkeys(archs))

    def progress(done, total, entry, arch):         # on stderr: stdout stays the table / JSON
        line = f"compiling {done}/{total} {entry} {arch}..."
        if sys.stderr.isatty():                     # one line, rewritten in place
            print(f"\r{line}\033[K", end="\n" if done == total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    progress = None if args.json else progress
    rows = kernel_report(archs, rows_in, sass=not args.no_sass, sass_text=args.sass is not None,
                         progress=progress, launchable=args.launchable)
    if args.sass is not None:
        for r in rows:
            print(f"// {r['name']}  ({r['arch']}, target {r['target']})")
            print(r["sass_text"] if r.get("sass_text") is not None else "(no SASS: cuobjdump not found)")
        return 0
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(format_table(rows))
    bad = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]
           or r["occupancy"] < 1]
    print(f"\n{len(rows)} rows, {len({r['entry'] for r in rows})} entry files x "
          f"{len(set(archs))} archs in {time.perf_counter() - start:.1f} s; "
          + (f"{len(bad)} with spills, stack or zero occupancy" if bad
             else "no spills, no stack, every kernel fits"))
    print("blk/SM: theoretical resident blocks per SM (limiting resource); smem: static + dynamic "
          "at a representative shape; compile s: wall time of the row's whole entry file for that arch")
    return 0
