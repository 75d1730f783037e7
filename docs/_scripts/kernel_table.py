"""Write the static-report tables of docs/performance.md from ``python -m cupyflash kernels --json``.

    python docs/_scripts/kernel_table.py                    # runs the report for sm_80 and sm_90
    python docs/_scripts/kernel_table.py sm80.json sm90.json  # or reads saved JSON output

Replaces the text between the ``kernel-report:begin`` and ``kernel-report:end``
markers of docs/performance.md with one Markdown table per kernel family: per
instantiation and architecture, registers per thread, shared memory per block
and theoretical resident blocks per SM (with the limiting resource).  For
``fwd_mma`` only the tile the dispatcher picks on each architecture is shown.
Needs no GPU: the report compiles offline with NVRTC (a few minutes on two
cores for both architectures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- kernel-report:begin -->", "<!-- kernel-report:end -->"
ARCHS = ("sm_80", "sm_90")
FAMILIES = (
    ("fwd_mma", "Tensor-core forward (`fwd_mma`, float16/bfloat16, the tile each GPU class gets)"),
    ("fwd_wgmma", "Hopper forward (`fwd_wgmma`, float16/bfloat16, sm_90a only; opt-in with `CUPYFLASH_WGMMA=1`)"),
    ("fwd_simt", "SIMT forward (`fwd_simt`)"),
    ("fwd_dmma", "float64 (and float32, computed in float64) forward on the FP64 tensor cores (`fwd_dmma`, "
                 "sm_80/sm_90; opt-in with `CUPYFLASH_DMMA=1`, `=float32`)"),
    ("fwd_tf32", "float32 forward on the TF32 tensor cores (`fwd_tf32`, sm_80+; only with "
                 "`precision=\"tf32\"` (1 pass) or `\"tf32x3\"` (3 passes))"),
    ("bwd_tf32", "float32 backward on the TF32 tensor cores (`bwd_tf32`, sm_80+; only with "
                 "`precision=\"tf32\"` or `\"tf32x3\"`; tile: owned × streamed rows)"),
    ("bwd_mma", "Tensor-core backward (`bwd_mma`, float16/bfloat16, the kernels each GPU class launches; "
                "tile: owned × streamed rows)"),
    ("bwd_simt", "SIMT backward (`bwd_simt`: delta, dK/dV and dQ kernels)"),
    ("bwd_dmma", "float64 (and float32, computed in float64) backward on the FP64 tensor cores (`bwd_dmma`, "
                 "sm_80/sm_90; opt-in with `CUPYFLASH_DMMA=1`, `=float32`; tile: owned × streamed rows)"),
    ("bwd_wgmma", "Hopper backward (`bwd_wgmma`, float16/bfloat16, sm_90a only; opt-in with `CUPYFLASH_WGMMA=1`; "
                  "tile: owned × streamed rows)"),
    ("fwd_v1", "Algorithm 1 (`fwd_v1`; shared memory at d = 64, M = 8192 elements)"),
    ("fwd_combine", "Split-KV merge (`fwd_combine`, after a forward whose keys were split)"),
)
DTYPE_ORDER = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
SHORT_KERNEL = {"bwd_simt_dot_do_o_kernel": "delta", "bwd_simt_dkdv_kernel": "dK/dV",
                "bwd_simt_dq_kernel": "dQ", "bwd_wgmma_dkdv_kernel": "dK/dV", "bwd_wgmma_dq_kernel": "dQ",
                "bwd_mma_dq_kernel": "dQ", "bwd_dmma_dkdv_kernel": "dK/dV", "bwd_dmma_dq_kernel": "dQ",
                "bwd_tf32_dkdv_kernel": "dK/dV", "bwd_tf32_dq_kernel": "dQ"}
WITH_KERNEL_COLUMN = ("bwd_simt", "bwd_wgmma", "bwd_mma", "bwd_dmma", "bwd_tf32")
# Families whose tile depends on the GPU class: only the rows each arch launches, tile per arch.
PER_ARCH_TILE = ("fwd_mma", "bwd_mma")
GRADS = {1: "dV", 2: "dK", 3: "dK/dV", 6: "dK + atomic dQ", 7: "dK/dV + atomic dQ",
         15: "dK/dV + dQ by bulk reductions", 30: "dK + ordered dQ (bulk reductions in key-block order)",
         31: "dK/dV + ordered dQ (bulk reductions in key-block order)"}   # kGrads


def _load(paths: list[str]) -> list[dict]:
    if paths:
        rows = []
        for p in paths:
            rows.extend(json.loads(Path(p).read_text()))
        return rows
    cmd = [sys.executable, "-m", "cupyflash", "kernels", "--json"]
    for arch in ARCHS:
        cmd += ["--arch", arch]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _picked_mma(rows: list[dict]) -> set[tuple[str, str]]:
    """(arch, name) of the fwd_mma and bwd_mma instantiations the dispatcher runs on each arch."""
    from cupyflash._families import BWD_MMA, FWD_MMA

    picked = set()
    for arch in {r["arch"] for r in rows}:
        number = int(arch.removeprefix("sm_"))
        picked.update((arch, r.name_expression) for f in (FWD_MMA, BWD_MMA) for r in f.launchable(number))
    return picked


def _inst(row: dict):
    """The catalogue row (an Instantiation, with typed fields) of a report row."""
    from cupyflash._families import by_name

    return by_name()[row["name"]]


def _own_streamed(inst) -> tuple[int, int]:
    """A backward kernel's (owned, streamed) rows: a dK/dV kernel owns keys, a dQ kernel query rows."""
    return (inst.block_n, inst.block_m) if inst.role == "dkdv" else (inst.block_m, inst.block_n)


def _kernel(row: dict) -> str:
    inst = _inst(row)
    if inst.kernel == "bwd_simt_dkdv_kernel" and inst.atomic_dq:
        return "dK/dV + atomic dQ"
    if inst.kernel in ("bwd_wgmma_dkdv_kernel", "bwd_mma_dkdv_kernel"):   # kGrads: 1 dV, 2 dK, 4 atomic dQ
        return GRADS[inst.grads]
    return SHORT_KERNEL.get(inst.kernel, inst.kernel)


def _split(row: dict) -> bool:
    """A split-KV instantiation (fwd_mma's and fwd_wgmma's kSplit)."""
    return _inst(row).split


def _whole_kv(row: dict) -> bool:
    """fwd_mma's or fwd_wgmma's whole-KV instantiation (kWholeKV), bwd_mma's or bwd_wgmma's
    whole-stream one (kWholeStream)."""
    return _inst(row).whole_kv


def _tile(row: dict) -> str:
    inst = _inst(row)
    family = inst.family.name
    split = ", split-KV" if inst.split else ", whole K/V blocks" if inst.whole_kv else ""
    plural = "s" * (inst.kv_stages != 1)
    if family == "fwd_mma":
        lazy = ", lazy rescale" if inst.lazy_rescale else ""
        return f"{inst.block_m}×{inst.block_n}, {inst.threads // 32} warps, {inst.kv_stages} stage{plural}{lazy}{split}"
    if family == "fwd_wgmma":
        lazy = ", lazy rescale" if inst.lazy_rescale else ""
        if inst.decoupled:   # a producer warpgroup besides the two that compute
            return f"{inst.block_m}×{inst.block_n}, 2 warpgroups + producer{lazy}{split}, decoupled"
        return f"{inst.block_m}×{inst.block_n}, {inst.threads // 128} warpgroups{lazy}{split}"
    if family == "bwd_mma":
        own, streamed = _own_streamed(inst)
        return (f"{own}×{streamed}, {inst.threads // 32} warps, {inst.kv_stages} stage{plural}"
                f"{', whole streamed blocks' if inst.whole_kv else ''}")
    if family == "bwd_wgmma":
        own, streamed = _own_streamed(inst)
        if inst.decoupled:   # a producer warpgroup besides the two that compute
            return f"{own}×{streamed}, 2 warpgroups + producer, decoupled"
        return f"{own}×{streamed}, {inst.threads // 128} warpgroups{', whole streamed blocks' if inst.whole_kv else ''}"
    if family in ("fwd_dmma", "fwd_tf32", "fwd_simt"):
        passes = f", {inst.passes} pass{'es' * (inst.passes != 1)}" if inst.passes else ""
        warps = f", {inst.threads // 32} warps" if family != "fwd_simt" else ""
        return f"{inst.block_m}×{inst.block_n}{warps}{passes}"
    if family in ("bwd_dmma", "bwd_tf32") or (family == "bwd_simt" and inst.role != "delta"):
        own, streamed = _own_streamed(inst)
        passes = f", {inst.passes} pass{'es' * (inst.passes != 1)}" if inst.passes else ""
        warps = f", {inst.threads // 32} warps" if family != "bwd_simt" else ""
        return f"{own}×{streamed}{warps}{passes}"
    return "–"


def _cells(row: dict | None) -> list[str]:
    if row is None:
        return ["", "", ""]
    return [str(row["registers"]), f"{row['shared_bytes'] / 1024:.1f}",
            f"{row['occupancy']} ({row['occupancy_limit']})"]


def _family_table(rows: list[dict], family: str, archs: list[str], picked: set) -> list[str]:
    per_arch = family in PER_ARCH_TILE
    rows = [r for r in rows if r["family"] == family and (not per_arch or (r["arch"], r["name"]) in picked)]
    # one line per (kernel, dtype, head dim), with the tile per arch where it depends on the GPU class
    keys: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if family in ("fwd_mma", "fwd_wgmma"):
            key = (DTYPE_ORDER[r["dtype"]], r["head_dim"],
                   "split" if _split(r) else "whole" if _whole_kv(r) else "", r["dtype"])
        elif family == "fwd_tf32":   # one line per pass count (the tile says which)
            key = (DTYPE_ORDER[r["dtype"]], r["head_dim"], _tile(r), r["dtype"])
        elif family == "bwd_tf32":   # one line per kernel and pass count
            key = (DTYPE_ORDER[r["dtype"]], r["head_dim"], _kernel(r), r["dtype"], _tile(r))
        elif family in ("bwd_mma", "bwd_wgmma"):   # one line per kernel, bounds-checked or whole-stream
            key = (DTYPE_ORDER[r["dtype"]], r["head_dim"], _kernel(r), r["dtype"], _whole_kv(r))
        else:
            key = (DTYPE_ORDER[r["dtype"]], r["head_dim"], _kernel(r), r["dtype"])
        if not per_arch:   # one tile per line: a family's other tiles (score features, decoupled) apart
            key += (_tile(r),)
        keys.setdefault(key, {})[r["arch"]] = r
    header = ["dtype", "d ≤"] + (["kernel"] if family in WITH_KERNEL_COLUMN else []) + \
        ([] if per_arch else ["tile"])
    for arch in archs:
        header += ([f"{arch} tile"] if per_arch else []) + \
                  [f"{arch} regs", f"{arch} smem KB", f"{arch} blocks/SM"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(keys, key=lambda k: (k[0], k[1], list(SHORT_KERNEL.values()).index(k[2])
                                            if k[2] in SHORT_KERNEL.values() else 0, str(k[4:]))):
        by_arch = keys[key]
        any_row = next(iter(by_arch.values()))
        cells = [key[3], str(key[1])]
        if family in WITH_KERNEL_COLUMN:
            cells.append(key[2])
        if not per_arch:
            cells.append(_tile(any_row))
        for arch in archs:
            r = by_arch.get(arch)
            if per_arch:
                cells.append(_tile(r) if r else "")
            cells += _cells(r)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _provenance() -> str:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "cuda_src", "cupyflash/_families", "cupyflash/_launch.py")
    nvrtc = "unknown"
    try:
        sys.path.insert(0, str(ROOT))
        from cupyflash._nvrtc import compiler

        nvrtc = ".".join(map(str, compiler().version))
    except Exception:  # noqa: BLE001 - provenance only
        pass
    state = f"commit {commit}" + (" with uncommitted kernel changes" if dirty else "")
    return f"Generated on {date.today().isoformat()} from {state}, NVRTC {nvrtc}."


def render(rows: list[dict]) -> str:
    archs = [a for a in ARCHS if any(r["arch"] == a for r in rows)]
    picked = _picked_mma(rows)
    out = [BEGIN, "", f"*{_provenance()}*", ""]
    for family, title in FAMILIES:
        if not any(r["family"] == family for r in rows):
            continue
        out += [f"**{title}**", ""] + _family_table(rows, family, archs, picked) + [""]
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]]
    local = [r for r in rows if r.get("sass") and (r["sass"].get("LDL") or r["sass"].get("STL"))]
    if not spills and not local:
        out.append(f"Spills, stack frames and local-memory instructions (LDL/STL): none, in all "
                   f"{len(rows)} compiled kernels (every instantiation of the catalogue, on "
                   f"{' and '.join(archs)}).")
    else:
        flagged = sorted({id(r): r for r in spills + local}.values(), key=lambda r: (r["arch"], r["name"]))
        out.append(f"Spills, stack frames or local-memory instructions in {len(flagged)} of "
                   f"{len(rows)} compiled kernels:")
        out.append("")
        for r in flagged:
            unused = r["family"] in PER_ARCH_TILE and (r["arch"], r["name"]) not in picked
            out.append(f"- `{r['name']}` on {r['arch']}: {r['spill_stores']} B spill stores, "
                       f"{r['spill_loads']} B spill loads, {r['stack_bytes']} B stack"
                       + (" (another class's tile: the dispatcher does not run it on this arch)"
                          if unused else ""))
    compile_s = {}
    for r in rows:
        compile_s[(r["entry"], r["arch"])] = r["compile_seconds"]
    parts = [f"`{e}` {s:.0f} s" for (e, a), s in sorted(compile_s.items()) if a == archs[0]]
    out += ["", f"NVRTC wall time per kernel file ({archs[0]}; every instantiation of the file "
            f"in one compile, files compiled in parallel, one per core, on a {os.cpu_count()}-core "
            f"machine): " + ", ".join(parts) + ". A first call compiles one instantiation only.",
            "", END]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    rows = _load(argv)
    text = PAGE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    PAGE.write_text(text[:start] + render(rows) + text[end:])
    print(f"updated {PAGE.relative_to(ROOT)} ({len(rows)} report rows)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
