"""Tile variants of fwd_wgmma, bwd_wgmma, fwd_mma, bwd_mma, fwd_tf32, fwd_simt, bwd_simt, fwd_dmma, bwd_dmma.

Each family (``cupyflash/_families/``) holds one tile per (head dim,
architecture); this script runs copies of a family with other tiles
(``family.with_tiles(...)``, handed to dispatch in ``KernelOptions(families=...)``),
so that a GPU session can compare them in one call::

    PYTHONPATH=. python benchmarks/gpu_variants.py            # on the GPU
    python benchmarks/gpu_variants.py --report [--arch sm_90]  # anywhere: ptxas figures

Every variant is first compiled (in parallel processes, into CuPy's disk
cache), then checked against PyTorch's SDPA (forward output; backward dq, dk,
dv) on fresh random inputs, then timed with CUDA events (median).  A variant
whose error exceeds the bound is reported, not timed.  Results:
``$OUT/gpu_variants.json`` when ``OUT`` is set, and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cupyflash._arch import WGMMA_ARCH  # noqa: E402
from cupyflash._families import (BACKWARD, BWD_DMMA, BWD_MMA, BWD_SIMT, BWD_WGMMA, FORWARD, FWD_DMMA,  # noqa: E402
                                 FWD_MMA, FWD_SIMT, FWD_TF32, FWD_WGMMA, Call, select)
from cupyflash._options import KernelOptions  # noqa: E402

# fwd_mma: head dim -> [(block_m, block_n, warps, kv_stages, lazy_rescale)], the
# catalogue's sm90 row first.  The lazy rescale is new since the last GPU run:
# each head dim times it against the rescale of every block.  d = 64's last row is
# FlashAttention-2's 128 x 128 tile of 4 warps: with the lazy rescale and two
# stages it fits 255 registers under NVRTC 13.5 (0 B spilled, sm_90); under 13.0
# (the H200 machines' NVRTC) its bounds-checked row spills 28 B and the whole-KV
# row the sweep runs none.  Without the lazy rescale: 48 B under 13.5.
# The sweep's shape runs the whole-KV instantiations (kWholeKV: no bounds in the K/V
# copies); a sixth element False times the same tile with the bounds-checked copies
# (as measured in sweep B) instead.
FWD_VARIANTS = {
    128: [(128, 64, 4, 1, False), (128, 64, 4, 1, False, False), (128, 64, 4, 1, True),
          (128, 128, 8, 2, True), (128, 128, 8, 2, False), (128, 64, 8, 2, True)],
    64: [(128, 64, 4, 2, True), (128, 64, 4, 2, True, False), (128, 64, 4, 2, False),
         (128, 64, 4, 1, True), (64, 128, 4, 2, True), (128, 128, 8, 2, True), (128, 128, 4, 2, True)],
}
# bwd_mma: head dim -> [(own, streamed, warps[, keys streamed by the dQ kernel][, whole])],
# the catalogue's first.  The sweep's shape runs the whole-stream instantiations
# (kWholeStream); a trailing False times the bounds-checked copies instead.
BWD_VARIANTS = {
    128: [(64, 32, 4), (64, 32, 4, False), (64, 64, 4), (64, 32, 4, 64)],
}
# fwd_wgmma (sm_90 only, timed first: it carries issue 4's target): head dim ->
# [(block_n, warpgroups, lazy_rescale[, whole])], the catalogue's first; as for fwd_mma,
# the sweep's shape runs the whole-KV rows, and a fourth element False times the
# bounds-checked copies instead.  Registers (NVRTC
# 13.5): d = 128 (64, 2) 152, (64, 3) 148 (192 query rows, 12 warps); d = 64
# (64, 2) 127, which leaves room for two CTAs per SM, (64, 3) 125, (192, 2) 255.
# At d = 128, (192, 2) spills and (128, 3) does not fit the registers.
WGMMA_FWD_VARIANTS = {
    128: [(128, 2, True), (128, 2, True, False), (128, 2, False), (64, 2, True), (64, 3, True)],
    64: [(128, 2, True), (64, 2, True), (64, 3, True), (192, 2, True)],
}
# bwd_wgmma: head dim -> [(((kGrads, dK/dV streamed rows), ...), warpgroups, dQ streamed
# keys)] (the format of BWD_WGMMA.tiles), the catalogue's first; each timed
# deterministic and with atomic dQ (where it has one).
WGMMA_BWD_VARIANTS = {
    128: [(((3, 64),), 2, 128), (((3, 64),), 2, 64)],
    64: [(((3, 128),), 2, 128), (((3, 128),), 2, 64)],
}
# fwd_simt / bwd_simt in float32 and float64 (issue 5's exact-dtype target, timed
# last): (dtype, head dim) -> [(block_m, block_n)] / [(own, streamed)], the
# catalogue's first.  All spill-free on sm_90 (NVRTC 13.5): float32 d = 64 forward
# (64, 32) 128 registers, (32, 32) 124, (32, 64) 168, (64, 64) 220, (128, 32) 236;
# float64 (32, 32) 168, (16, 32) 128, (64, 16) 168; float32 backward dK/dV / dQ
# (32, 32) 142 / 160, (64, 32) 198 / 168, (32, 64) 238 / 172.  The kernels hold
# their occupancy target by shared memory (fwd_simt.cu), so a larger tile also
# means fewer CTAs per SM: the sweep says which side wins.
SIMT_FWD_VARIANTS = {
    ("float32", 64): [(64, 32), (32, 32), (32, 64), (64, 64), (128, 32)],
    ("float64", 64): [(32, 32), (16, 32), (64, 16)],
}
SIMT_BWD_VARIANTS = {
    ("float32", 64): [(32, 32), (64, 32), (32, 64)],
}
# fwd_dmma / bwd_dmma (float64 on the FP64 tensor cores, opt-in, timed after the SIMT
# tiles at SIMT_SHAPE): head dim -> [(block_m, block_n, warps)] / [(own, streamed,
# warps)], the catalogue's first.  Registers (NVRTC 13.5, sm_90), all spill-free:
# forward (64, 32, 4) 216, (64, 16, 4) 194, (32, 32, 2) 246; backward dK/dV / dQ
# (64, 16, 4) 244 / 242, (32, 16, 4) 232 / 155, (32, 32, 4) 232 / 224.  Eight warps
# (128 registers at two CTAs per SM) spill: forward (128, 32, 8) 168 B, backward
# (64, 16, 8) 8 B on sm_80.
DMMA_FWD_VARIANTS = {
    64: [(64, 32, 4), (64, 16, 4), (32, 32, 2)],
}
DMMA_BWD_VARIANTS = {
    64: [(64, 16, 4), (32, 16, 4), (32, 32, 4)],
}
# fwd_tf32 with precision="tf32x3" (float32 on the TF32 tensor cores, timed after
# fwd_mma at SIMT_SHAPE): head dim -> [(block_m, block_n, warps)], the catalogue's
# first.  Two m16 tiles per warp (block_m 128) feed each split K/V fragment to two
# MMAs; registers (NVRTC 13.5, sm_90) 203, 223 and 248, no spills.  Eight warps
# (128 registers at two CTAs per SM) spill 60 B.
TF32_FWD_VARIANTS = {
    64: [(64, 64, 4), (64, 32, 4), (128, 32, 4)],
}
SHAPE = dict(batch=2, heads=16, seqlen=8192)
SIMT_SHAPE = dict(batch=1, heads=8, seqlen=4096)   # the benchmark table's float32 backward case
# ||out - ref|| / ||ref||: bfloat16 with SDPA's own rounding; float32/float64 against
# SDPA in the same dtype (two exact orders of summation)
BOUND = {"bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def variant(kind: str, head_dim: int, variant, dtype: str = "bfloat16"):
    """``(options, rows)``: the dispatch options that run this variant (its family with the
    variant's tile, the kernels it needs switched on) and the catalogue rows it launches on
    sm_90 for the sweep's shape.  For the SIMT kinds ``variant`` is ``(dtype, tile...)``,
    the DMMA kinds are float64, fwd_tf32 runs precision="tf32x3"."""
    simt, dmma, tf32 = kind in ("sfwd", "sbwd"), kind in ("dfwd", "dbwd"), kind == "tfwd"
    if simt:
        dtype, *variant = variant
    elif dmma:
        dtype = "float64"
    elif tf32:
        dtype = "float32"
    tile, whole = whole_flag(kind, variant) if kind in ("fwd", "wfwd", "bwd") else (tuple(variant), True)
    acc = "float64" if dtype == "float64" else "float32"
    if kind == "fwd":   # every class's row, so that the tile runs on any sm_80+ GPU
        family = FWD_MMA.with_tiles(tiles={c: {**t, head_dim: tile} for c, t in FWD_MMA.tiles.items()})
    elif kind == "bwd":
        own, streamed, warps, *dq = tile
        family = BWD_MMA.with_tiles(own=own, warps=warps,
                                    tiles={**BWD_MMA.tiles, head_dim: (streamed, True, dq[0] if dq else streamed)})
    elif kind == "wfwd":
        family = FWD_WGMMA.with_tiles(tiles={**FWD_WGMMA.tiles, head_dim: tile})
    elif kind == "wbwd":
        family = BWD_WGMMA.with_tiles(tiles={**BWD_WGMMA.tiles, head_dim: tile})
    elif simt:
        base = FWD_SIMT if kind == "sfwd" else BWD_SIMT
        family = base.with_tiles(tiles={**base.tiles, acc: {**base.tiles[acc], head_dim: tile}})
    elif dmma:
        base = FWD_DMMA if kind == "dfwd" else BWD_DMMA
        family = base.with_tiles(tiles={**base.tiles, head_dim: tile})
    else:
        family = FWD_TF32.with_tiles(tiles={**FWD_TF32.tiles, head_dim: tile})
    options = KernelOptions(wgmma=kind in ("wfwd", "wbwd"), dmma=frozenset({"float64"} if dmma else ()),
                            whole_blocks=whole, families=(family,))
    length = (SIMT_SHAPE if simt or dmma or tf32 else SHAPE)["seqlen"]
    call = Call(dtype, head_dim, head_dim, seqlen_q=length, seqlen_k=length, aligned=True,
                scale=head_dim ** -0.5, precision="tf32x3" if tf32 else "ieee")
    if family.direction == "forward":
        return options, list(select(FORWARD, call, WGMMA_ARCH, options))
    rows = list(select(BACKWARD, call, WGMMA_ARCH, options))
    if kind == "wbwd":   # timed deterministic and with atomic dQ
        rows += select(BACKWARD, Call(**{**call.__dict__, "deterministic": False}), WGMMA_ARCH, options)
    return options, list(dict.fromkeys(rows))


def whole_flag(kind: str, variant) -> tuple[tuple, bool]:
    """A fwd_mma / fwd_wgmma / bwd_mma variant's tile and whether the sweep's shape runs its
    whole-KV (whole-stream) rows: True unless the variant ends in an extra False -- a
    sixth element for fwd_mma and a fourth for fwd_wgmma (whose last, lazy_rescale, is
    a bool too), a trailing bool for bwd_mma."""
    extra = {"fwd": len(variant) > 5, "wfwd": len(variant) > 3}.get(kind, isinstance(variant[-1], bool))
    return (tuple(variant[:-1]), bool(variant[-1])) if extra else (tuple(variant), True)


def all_variants(wgmma: bool = True):
    tables = [("fwd", FWD_VARIANTS), ("bwd", BWD_VARIANTS)]
    if wgmma:
        tables = [("wfwd", WGMMA_FWD_VARIANTS), ("wbwd", WGMMA_BWD_VARIANTS)] + tables
    for kind, table in tables + [("tfwd", TF32_FWD_VARIANTS)]:
        for d, tiles in table.items():
            for t in tiles:
                yield kind, d, t
    for kind, table in (("sfwd", SIMT_FWD_VARIANTS), ("sbwd", SIMT_BWD_VARIANTS)):
        for (dtype, d), tiles in table.items():
            for t in tiles:
                yield kind, d, (dtype, *t)
    for kind, table in (("dfwd", DMMA_FWD_VARIANTS), ("dbwd", DMMA_BWD_VARIANTS)):
        for d, tiles in table.items():
            for t in tiles:
                yield kind, d, t


def _compile(job):
    kind, d, variant = job
    from cupyflash._loader import module_caches

    try:
        for r in variant(kind, d, variant)[1]:
            module_caches.for_device(0).module(r.entry, (r.name_expression,))
    except Exception as error:  # noqa: BLE001
        return f"{kind} d={d} {variant}: {type(error).__name__}: {str(error)[:1500]}"
    return None


def report(archs) -> None:
    from cupyflash import _report
    from cupyflash._loader import module_source

    for kind, d, tile in all_variants():
        for r in variant(kind, d, tile)[1]:
            for arch in archs:
                target = r.family.compile_target(arch)
                if target is None:
                    continue
                try:
                    rep = _report.compile_report(module_source(r.entry), [r.name_expression],
                                                 target, sass=False, filename=r.entry)
                except _report.NvrtcError as error:
                    print(f"{arch} {kind} d={d} {tile}: {str(error)[:600]}")
                    continue
                f = rep.functions[r.name_expression]
                print(f"{arch} {kind} d={d} {str(tile):18} {r.name_expression:58} "
                      f"regs {f.registers:3} spill {f.spill_stores:3}/{f.spill_loads:3} "
                      f"stack {f.stack_bytes:3}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", action="store_true", help="ptxas figures only (no GPU needed)")
    p.add_argument("--arch", action="append", help="with --report (default sm_90)")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--kinds", help="comma-separated kinds to time (default all: "
                   "wfwd,wbwd,fwd,bwd,tfwd,sfwd,sbwd,dfwd,dbwd)")
    p.add_argument("--json", default="gpu_variants.json", help="file name of the results in $OUT")
    args = p.parse_args()
    if args.report:
        report(args.arch or ["sm_90"])
        return 0

    import cupy
    import torch
    from cupyx.profiler import benchmark

    from cupyflash import _bench
    from cupyflash._api import run_attention, run_attention_backward

    sm90 = int(cupy.cuda.Device().compute_capability) == WGMMA_ARCH
    kinds = set(args.kinds.split(",")) if args.kinds else None
    jobs = [job for job in all_variants(wgmma=sm90) if kinds is None or job[0] in kinds]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        failures = [f for f in pool.map(_compile, jobs) if f]
    print(f"compiled {len(jobs)} variants in {time.perf_counter() - start:.0f} s; "
          f"{len(failures)} failed", flush=True)
    for f in failures:
        print(f, flush=True)

    rows, inputs = [], {}
    modes = {"wbwd": (True, False)}   # bwd_wgmma: deterministic, then atomic dQ
    for kind, d, tile in jobs:
        options = variant(kind, d, tile)[0]
        simt, dmma, tf32 = kind in ("sfwd", "sbwd"), kind in ("dfwd", "dbwd"), kind == "tfwd"
        dtype = tile[0] if simt else "float64" if dmma else "float32" if tf32 else "bfloat16"
        shape = SIMT_SHAPE if simt or dmma or tf32 else SHAPE
        precision = "tf32x3" if tf32 else "ieee"
        b, h, L = shape["batch"], shape["heads"], shape["seqlen"]
        for causal, deterministic in ((c, m) for c in (False, True) for m in modes.get(kind, (True,))):
            if (dtype, d) not in inputs:   # one input set per dtype and head dim: every variant sees the same
                inputs[dtype, d] = _bench.random_inputs(_bench.Case(dtype, b, h, L, L, d), cupy, seed=d)
            q, k, v, dout = inputs[dtype, d]
            tq, tk, tv, tdo = (_bench._to_torch(x) for x in (q, k, v, dout))
            row = dict(kind=kind, head_dim=d, variant=list(tile), causal=causal,
                       deterministic=deterministic, dtype=dtype, shape=shape)
            try:
                if kind in ("fwd", "wfwd", "sfwd", "dfwd", "tfwd"):
                    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                           is_causal=causal)
                    out = run_attention(q, k, v, causal=causal, precision=precision, options=options)
                    errs = [_rel(_bench._to_torch(out), ref)]
                    fn = lambda: run_attention(q, k, v, causal=causal, precision=precision,  # noqa: E731
                                               options=options)
                    flops = 4 * b * h * L * L * d / (2 if causal else 1)
                else:
                    leaves = [t.detach().requires_grad_(True) for t in (tq, tk, tv)]
                    ref_out = torch.nn.functional.scaled_dot_product_attention(
                        *leaves, is_causal=causal)
                    refs = torch.autograd.grad(ref_out, leaves, tdo)
                    out, lse = run_attention(q, k, v, causal=causal, return_lse=True, options=options)
                    grads = run_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                   deterministic=deterministic, options=options)
                    errs = [_rel(_bench._to_torch(g), r) for g, r in zip(grads, refs)]
                    fn = lambda: run_attention_backward(  # noqa: E731
                        dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, options=options)
                    flops = 2.5 * 4 * b * h * L * L * d / (2 if causal else 1)
                row["rel_err"] = max(errs)
                if not row["rel_err"] <= BOUND[dtype]:
                    row["error"] = f"rel err {row['rel_err']:.3g} > {BOUND[dtype]}"
                else:
                    t = benchmark(fn, (), n_repeat=args.repeat, n_warmup=3)
                    ms = float(cupy.median(cupy.asarray(t.gpu_times[0]))) * 1e3
                    row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            print(_line(row), flush=True)
            out = os.environ.get("OUT")
            if out:   # after every row: a sweep stopped at its time limit keeps what it measured
                Path(out, args.json).write_text(json.dumps(
                    dict(gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                         shape=SHAPE, dtype="bfloat16", simt_shape=SIMT_SHAPE, rows=rows), indent=1))
            if "error" in row and not _bench.cuda_context_alive():
                # an illegal instruction or address is sticky: every later variant would fail
                print(f"gpu_variants: the CUDA context is lost after {kind} d={d} {tile}; "
                      f"stopping (later variants of this run not timed)", flush=True)
                return 3
    return 0


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def _line(r) -> str:
    what = r.get("error") or f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s  err {r['rel_err']:.2e}"
    mode = "" if r.get("deterministic", True) else " atomic-dQ"
    return (f"{r['kind']} {r.get('dtype', 'bfloat16')} d={r['head_dim']} {str(tuple(r['variant'])):18} "
            f"causal={'yes' if r['causal'] else 'no ':3}{mode} {what}")


if __name__ == "__main__":
    sys.exit(main())
