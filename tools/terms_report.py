"""Registers, spills and stack of kernel rows compiled with score terms, next to the same
rows without: what a call with a bias and a mask costs each kernel (NVRTC, offline).

    python tools/terms_report.py --arch sm_80 --arch sm_90 --head-dim 64 --head-dim 128 -o terms.json

The terms compiled are two biases (float16 and float32) and a mask: the most a
representative call reads (each further bias is one more load per element).
``--score-mod EXPR`` compiles a score_mod instead (with its derivative, reading a
float64 ``gamma`` of one axis if it names it).  Every family's rows of the given head dims
are compiled (``--family`` narrows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TERMS = "cf::ScoreTerms<true, __half, float>"


def _defines(score_mod):
    if score_mod is None:
        return (("CF_SCORE_TERMS", TERMS),)
    import numpy as np

    from cupyflash._terms import ScoreOperands
    from cupyflash._validation import check_score_functions

    args = {"gamma": np.ones(8)} if "gamma" in score_mod else None
    mods = check_score_functions(None, None, score_mod, None, args, kind="numpy", device=None, batch_shape=(1, 8))
    return ScoreOperands(mods=mods).defines()


def report(archs, head_dims, families=None, score_mod=None) -> list[dict]:
    from cupyflash._families import FAMILIES
    from cupyflash._loader import module_source
    from cupyflash._report import compile_report
    from cupyflash._source import Variant

    rows = []
    for family in FAMILIES:
        if not family.takes or (families and family.name not in families):
            continue
        for arch in archs:
            target = family.compile_target(arch)
            if target is None:
                continue
            picked = [r for r in family.rows if r.head_dim in head_dims and r.role in ("forward", "dkdv", "dq")]
            if not picked:
                continue
            names = [r.name_expression for r in picked]
            plain = compile_report(module_source(family.entry), names, target, sass=False)
            with_terms = compile_report(module_source(Variant(family.entry, _defines(score_mod))),
                                        names, target, sass=False)
            for name in names:
                a, b = plain.functions[name], with_terms.functions[name]
                rows.append(dict(arch=target, kernel=name, registers=a.registers, registers_terms=b.registers,
                                 spill_stores=a.spill_stores, spill_stores_terms=b.spill_stores,
                                 spill_loads_terms=b.spill_loads, stack_terms=b.stack_bytes))
                print(f"{target:7s} {name:70s} {a.registers:4d} -> {b.registers:4d} regs, "
                      f"spills {a.spill_stores} -> {b.spill_stores} B, stack {b.stack_bytes} B", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", default=[])
    ap.add_argument("--head-dim", action="append", type=int, default=[])
    ap.add_argument("--family", action="append", default=[])
    ap.add_argument("--score-mod")
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    rows = report(a.arch or ["sm_80"], set(a.head_dim or [64, 128]), set(a.family), a.score_mod)
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
