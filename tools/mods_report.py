"""Registers, spills and stack of the kernels a call with a score modification runs at
head dim 128: for each of the modifications issue 29 names (its score_mod and mask_mod
examples, softcap=, ALiBi), every row the dispatcher plans for such a call -- every
forward and backward family, each dtype, precision and determinism it serves, sm_80
and sm_90 (sm_90a for the wgmma families) -- compiled with NVRTC (offline).

    python tools/mods_report.py -o mods-registers.json [--arch 80 --arch 90] [--example dist]

Prints one line per (example, row) and, last, the rows with spills or stack; exits 1
if there is any.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

HEADS = 8
# name: keywords of check_score_functions (score_mod / mask_mod text, softcap, alibi)
EXAMPLES = {
    "relative-position table": dict(score_mod="score + rel[h, q_idx - kv_idx + 511]"),
    "T5 buckets": dict(score_mod="score + t5[h, where(abs(q_idx - kv_idx) < 8, abs(q_idx - kv_idx), "
                                 "min(8 + floor(log(max(abs(q_idx - kv_idx), 1) / 8.0) / log(16.0) * 8), 15))]"),
    "distance kernel": dict(score_mod="score - gamma[h] * abs(q_idx - kv_idx)"),
    "temperature per batch": dict(score_mod="score * temp[b]"),
    "softcap by hand": dict(score_mod="30 * tanh(score / 30)"),
    "softcap=": dict(softcap=30.0),
    "ALiBi": dict(alibi=True),
    "prefix-LM": dict(mask_mod="(kv_idx <= q_idx + 8) | (kv_idx < prefix[b])"),
    "documents": dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]"),
    "sliding window by hand": dict(mask_mod="(kv_idx <= q_idx) & (q_idx - kv_idx < 64)"),
    "dilated": dict(mask_mod="(q_idx - kv_idx) - 3 * floor((q_idx - kv_idx) / 3.0) == 0"),
}
ARGS = {"rel": np.ones((HEADS, 1023)), "t5": np.ones((HEADS, 16)), "gamma": np.ones(HEADS), "temp": np.ones(2),
        "prefix": np.array([5, 12]), "doc": np.zeros((2, 512), np.int64)}


def example_operands(softcap=None, alibi=False, score_mod=None, mask_mod=None):
    from cupyflash._terms import ScoreOperands
    from cupyflash._validation import check_score_functions

    text = (score_mod or "") + (mask_mod or "")
    args = {k: v for k, v in ARGS.items() if f"{k}[" in text} or None
    mods = check_score_functions(softcap, np.ones((1, HEADS)) if alibi else None, score_mod, mask_mod, args,
                                 kind="numpy", device=None, batch_shape=(2, HEADS))
    return ScoreOperands(mods=mods)


def planned_rows(archs, features) -> dict:
    """{(entry, target): [name expressions]}: the rows any family plans for a d = 128 call
    with ``features`` on ``archs``, each family allowed in turn (wgmma, DMMA on)."""
    from cupyflash._families import BACKWARD, FORWARD
    from cupyflash._families._family import Call
    from cupyflash._options import KernelOptions

    options = KernelOptions(wgmma=True, dmma=frozenset({"float64", "float32"}))
    out: dict = {}
    for family in FORWARD + BACKWARD:
        if not features <= family.takes:
            continue
        for arch in archs:
            target = family.compile_target(f"sm_{arch}")
            if target is None:
                continue
            for dtype in ("float16", "bfloat16", "float32", "float64"):
                for precision in ("ieee", "tf32", "tf32x3"):
                    for deterministic, length, split in ((True, 4096, False), (False, 4096, False),
                                                         (True, None, False), (False, None, False),
                                                         (True, None, True)):
                        call = Call(dtype, 128, 128, length, length, aligned=True, precision=precision,
                                    deterministic=deterministic, split=split, features=frozenset(features))
                        if not family.applies(call, arch, options):
                            continue
                        for row in family.plan(call, arch, options):
                            if row.family is family:
                                names = out.setdefault((family.entry, target), [])
                                if row.name_expression not in names:
                                    names.append(row.name_expression)
    return out


def report(archs, examples, entries=None, quiet=False) -> list[dict]:
    """One dict per (example, planned row) (``entries``: only these cuda_src/ files)."""
    from cupyflash._loader import module_source
    from cupyflash._report import compile_report

    rows = []
    for name in examples:
        operands = example_operands(**EXAMPLES[name])
        for (entry, target), names in planned_rows(archs, set(operands.features)).items():
            if entries is not None and entry not in entries:
                continue
            compiled = compile_report(module_source(operands.entry(entry)), names, target, sass=False)
            for kernel in names:
                f = compiled.functions[kernel]
                rows.append(dict(example=name, arch=target, kernel=kernel, registers=f.registers,
                                 spill_stores=f.spill_stores, spill_loads=f.spill_loads, stack=f.stack_bytes))
                if not quiet:
                    print(f"{name:24s} {target:7s} {kernel:64s} {f.registers:4d} regs, spills {f.spill_stores} B, "
                          f"stack {f.stack_bytes} B", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", type=int, default=[])
    ap.add_argument("--example", action="append", default=[], choices=list(EXAMPLES))
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    rows = report(a.arch or [80, 90], a.example or list(EXAMPLES))
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["stack"]]
    print(f"\n{len(rows)} rows, {len(bad)} with spills or stack")
    for r in bad:
        print(f"  {r['example']}: {r['arch']} {r['kernel']} spills {r['spill_stores']} B, stack {r['stack']} B")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
