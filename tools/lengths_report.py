"""Registers and spills of the kernels a call with per-sequence lengths launches.

A call with ``q_lengths=`` / ``kv_lengths=`` (or a packed ``attention_varlen``) runs
every sequence in one launch, in modules compiled with ``CF_SEQ_LENGTHS``
(``cuda_src/sequence.cuh``): each CTA narrows the params to its sequence, which
costs registers where the launch's own lengths were free constant-bank operands.
This lists every row dispatch plans for such a call -- each family allowed in turn
(wgmma, DMMA on), every head-dim bucket, dtype, precision and determinism, bounded
instantiations (lengths never pick the whole-block ones) and the split-KV forward --
compiles each without lengths and in the length modules (padded: lengths only;
packed: lengths and each sequence's first rows; paged: the forward's rows reading K
and V from a paged KV cache, ``cuda_src/paged.cuh`` -- what a decode step or a
chunked prefill over a cache launches), and prints registers, spills and stack.

    python tools/lengths_report.py [--arch 80 --arch 90] [--form paged] [--json FILE]

Exit status 1 if a row spills with lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


def planned_rows(archs, head_dims=HEAD_DIMS, paged: bool = False) -> dict:
    """{(entry, target): [name expressions]}: the rows any family plans for a call with
    lengths on ``archs`` at ``head_dims`` (``paged``: a forward over a paged KV cache)."""
    from cupyflash._families import BACKWARD, FORWARD, FWD_COMBINE
    from cupyflash._families._family import Call
    from cupyflash._options import KernelOptions

    options = KernelOptions(wgmma=True, dmma=frozenset({"float64", "float32"}))
    out: dict = {}
    for family in FORWARD + (FWD_COMBINE,) + (() if paged else BACKWARD):
        for arch in archs:
            target = family.compile_target(f"sm_{arch}")
            if target is None:
                continue
            for d in head_dims:
                for dtype in ("float16", "bfloat16", "float32", "float64"):
                    for precision in ("ieee", "tf32", "tf32x3"):
                        for deterministic, split in ((True, False), (False, False), (True, True)):
                            call = Call(dtype, d, d, None, None, aligned=True, precision=precision,
                                        deterministic=deterministic, split=split, paged=paged)
                            try:
                                if family is not FWD_COMBINE and not family.applies(call, arch, options):
                                    continue
                                plan = family.plan(call, arch, options)
                            except (TypeError, ValueError, KeyError):
                                continue
                            for row in plan:
                                if row.family is family:
                                    names = out.setdefault((family.entry, target), [])
                                    if row.name_expression not in names:
                                        names.append(row.name_expression)
    return out


FORMS = ("padded", "packed", "paged")


def report(archs, entries=None, forms=FORMS, head_dims=HEAD_DIMS) -> list[dict]:
    """One dict per (planned row, form): registers without lengths, and with them registers,
    spills and stack (``entries``: only these cuda_src/ files)."""
    from cupyflash._loader import module_source
    from cupyflash._report import compile_report
    from cupyflash._run import PACKED_DEFINES, PADDED_DEFINES, PAGED_DEFINES
    from cupyflash._source import Variant

    def run(job):
        (entry, target), names, (form, defines) = job
        plain = compile_report(module_source(entry), names, target, sass=False)   # (a paged row: its dense twin)
        lengths = compile_report(module_source(Variant(entry, defines)), names, target, sass=False)
        return [dict(entry=entry, target=target, form=form, kernel=n, registers=plain.functions[n].registers,
                     registers_lengths=lengths.functions[n].registers,
                     spill_stores=lengths.functions[n].spill_stores, spill_loads=lengths.functions[n].spill_loads,
                     stack=lengths.functions[n].stack_bytes) for n in names]

    defines = {"padded": PADDED_DEFINES, "packed": PACKED_DEFINES, "paged": PAGED_DEFINES}
    jobs = [(key, names, (form, defines[form])) for form in forms
            for key, names in planned_rows(archs, head_dims, paged=form == "paged").items()
            if entries is None or key[0] in entries]
    with ThreadPoolExecutor(2) as pool:
        return [r for rows in pool.map(run, jobs) for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append")
    ap.add_argument("--form", action="append", choices=FORMS)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = report(a.arch or [80, 90], forms=a.form or FORMS)
    for r in rows:
        flag = "  SPILLS" if r["spill_stores"] or r["spill_loads"] else ""
        print(f"{r['target']:7s} {r['form']:6s} {r['kernel']:80s} {r['registers']:4d} -> {r['registers_lengths']:4d} "
              f"spill {r['spill_stores']}/{r['spill_loads']} stack {r['stack']}{flag}")
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(spilled)} of {len(rows)} rows spill with lengths")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
