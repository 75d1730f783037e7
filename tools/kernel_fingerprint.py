"""Registers, spills, stack and SASS instruction counts of every kernel row, as JSON.

A developer tool for refactors that must not change the kernels' code: run it on
the commit before and after, then ``--compare BEFORE.json AFTER.json`` prints the
rows whose registers or main-loop instructions grew by more than a threshold.

The main loop of a kernel is taken as the longest backward branch in its SASS
(the span from the branch target to the branch, in instructions): for every
kernel here that is the loop over key (or streamed) blocks.

    python tools/kernel_fingerprint.py --arch sm_80 --arch sm_90 -o before.json
    python tools/kernel_fingerprint.py --compare before.json after.json
    python tools/kernel_fingerprint.py --family fwd_mma --family fwd_wgmma -o part.json

``--family`` keeps the rows of those entry files only, ``--match REGEX`` the rows
whose kernel name matches (a quick check after one
kernel changed; ``--compare`` then reports the rows absent from the part as
gone).  Each row also carries ``sass_sha``, a digest of its instructions without
addresses: equal digests mean the kernel's code did not change at all; and
``sass_sha_params``, the same with every kernel-parameter operand
(``c[0x0][...]``) masked: equal there, the code is the same but for where the
parameters lie (a field added to the params struct moves those after it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

# This checkout's package, not whichever one the environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")


def loop_spans(sass_text: str) -> list[int]:
    """Instruction counts of every backward branch's span (target .. branch)."""
    addresses = []
    spans = []
    for line in sass_text.splitlines():
        m = _ADDRESS.match(line)
        if not m:
            continue
        address = int(m.group(1), 16)
        addresses.append(address)
        b = _BRANCH.search(m.group(2))
        if b:
            target = int(b.group(1), 16)
            if target < address:
                spans.append(sum(1 for a in addresses if target <= a <= address))
    return spans


def fingerprint(archs, families=None, match=None) -> list[dict]:
    try:
        from cupyflash._families import catalogue
    except ImportError:   # a commit before issue 25's families
        from cupyflash._kernels import instantiations as catalogue
    from cupyflash._report import kernel_report, sass_instructions

    rows_in = [i for i in catalogue() if (not families or i.entry.removesuffix(".cu") in families)
               and (not match or re.search(match, i.name_expression))]
    rows = kernel_report(archs, rows_in, sass=True, sass_text=True)
    out = []
    for r in rows:
        text = r.get("sass_text") or ""
        spans = loop_spans(text)
        out.append(dict(name=r["name"], arch=r["arch"], registers=r["registers"],
                        spill_stores=r["spill_stores"], spill_loads=r["spill_loads"],
                        stack_bytes=r["stack_bytes"], shared_bytes=r["shared_bytes"],
                        instructions=len(sass_instructions(text)),
                        main_loop=max(spans, default=0),
                        sass_sha=_digest(sass_instructions(text)),
                        sass_sha_params=_digest(_PARAM_OPERAND.sub("c[0x0][P]", i) for i in sass_instructions(text))))
    return out


# A kernel-parameter operand (constant bank 0) in SASS.
_PARAM_OPERAND = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _digest(lines) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def compare(before: list[dict], after: list[dict], threshold: float) -> int:
    old = {(r["arch"], r["name"]): r for r in before}
    bad = 0
    missing = [k for k in old if k not in {(r["arch"], r["name"]) for r in after}]
    print(f"{len(old)} rows before, {len(after)} after, {len(missing)} rows gone")
    for k in missing[:20]:
        print("  gone:", *k)
    grew = []
    for r in after:
        o = old.get((r["arch"], r["name"]))
        if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]:
            print(f"SPILL {r['arch']} {r['name']}: {r['spill_stores']}/{r['spill_loads']} B, stack {r['stack_bytes']}")
            bad += 1
        if o is None:
            continue
        for key in ("registers", "main_loop", "instructions"):
            if o[key] and (r[key] - o[key]) / o[key] > threshold and key != "instructions":
                grew.append((r["arch"], r["name"], key, o[key], r[key]))
    moved = [(r, old[(r["arch"], r["name"])]) for r in after if (r["arch"], r["name"]) in old]
    hashed = [(r, o) for r, o in moved if "sass_sha" in r and "sass_sha" in o]
    if hashed:
        same = sum(1 for r, o in hashed if r["sass_sha"] == o["sass_sha"])
        print(f"sass identical: {same} of {len(hashed)} rows")
        masked = [(r, o) for r, o in hashed if "sass_sha_params" in r and "sass_sha_params" in o]
        if masked:
            same = sum(1 for r, o in masked if r["sass_sha_params"] == o["sass_sha_params"])
            print(f"sass identical but for parameter offsets: {same} of {len(masked)} rows")
            for r, o in masked:
                if r["sass_sha_params"] != o["sass_sha_params"]:
                    print(f"  code differs: {r['arch']} {r['name']}")
    for r, o in moved:
        if r["registers"] != o["registers"] or r["main_loop"] != o["main_loop"]:
            print(f"MOVED {r['arch']} {r['name']}: registers {o['registers']} -> {r['registers']}, "
                  f"main loop {o['main_loop']} -> {r['main_loop']}")
    for arch, name, key, a, b in grew:
        print(f"GREW {arch} {name} {key}: {a} -> {b} ({(b - a) / a:+.1%})")
    bad += len(grew)
    for key in ("registers", "main_loop", "instructions"):
        pairs = [(old[(r["arch"], r["name"])][key], r[key]) for r in after if (r["arch"], r["name"]) in old]
        up = sum(1 for a, b in pairs if b > a)
        down = sum(1 for a, b in pairs if b < a)
        print(f"{key}: {len(pairs)} rows, {up} up, {down} down, {len(pairs) - up - down} unchanged; "
              f"total {sum(a for a, _ in pairs)} -> {sum(b for _, b in pairs)}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", action="append", default=None)
    p.add_argument("-o", "--output")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--family", action="append", default=None,
                   help="only the rows of this entry file (fwd_mma, bwd_tf32, ...); repeatable")
    p.add_argument("--match", metavar="REGEX",
                   help="only the rows whose kernel name matches REGEX (re.search)")
    p.add_argument("--threshold", type=float, default=0.03)
    a = p.parse_args(argv)
    if a.compare:
        before, after = (json.load(open(f)) for f in a.compare)
        return 1 if compare(before, after, a.threshold) else 0
    rows = fingerprint(a.arch or ["sm_80", "sm_90"], a.family, a.match)
    text = json.dumps(rows, indent=0)
    if a.output:
        open(a.output, "w").write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
