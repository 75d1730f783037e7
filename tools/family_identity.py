"""Bit-identity of every kernel family on the emulator, before and after a refactor.

Runs a fixed list of seeded problems -- at least one per family and kernel
branch (whole/partial blocks, split-KV, atomic dQ, dV/dK apart, GQA, windows)
-- through the CUDA kernels on the CPU emulator, and records per problem the
kernels launched and a SHA-256 of every output (out, lse; dq, dk, dv).  Two
records of the same list compare equal exactly when every family computed
bit-identical results.

    python tools/family_identity.py -o after.json
    python tools/family_identity.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

# name, direction, arch, dtype, d, dv, Lq, Lk, heads_q, heads_kv, window (left, right), switches
#   switches: wgmma, dmma (float64 / float32), precision, splits, deterministic
PROBLEMS = [
    ("simt-f32-causal", "fwd", 80, "float32", 40, 40, 37, 75, 2, 2, (None, 0), {}),
    ("simt-f64-window", "fwd", 80, "float64", 64, 64, 45, 70, 2, 1, (10, 5), {}),
    ("simt-f16-dv", "fwd", 80, "float16", 32, 48, 33, 40, 1, 1, (None, None), {}),
    ("simt-bf16-unaligned-d", "fwd", 80, "bfloat16", 20, 20, 20, 33, 1, 1, (None, 0), {}),
    ("simt-f32-split", "fwd", 80, "float32", 64, 64, 8, 600, 1, 1, (None, None), {"splits": 3}),
    ("mma-f16-64-causal", "fwd", 80, "float16", 64, 64, 70, 130, 2, 1, (None, 0), {}),
    ("mma-bf16-64-whole", "fwd", 80, "bfloat16", 64, 64, 40, 128, 1, 1, (None, None), {}),
    ("mma-f16-128-window", "fwd", 80, "float16", 128, 128, 50, 90, 1, 1, (20, 3), {}),
    ("mma-f16-96-split", "fwd", 80, "float16", 96, 96, 4, 700, 1, 1, (None, None), {"splits": 2}),
    ("wgmma-f16-64", "fwd", 90, "float16", 64, 64, 70, 140, 2, 1, (None, 0), {"wgmma": True}),
    ("wgmma-bf16-128-whole", "fwd", 90, "bfloat16", 128, 128, 40, 256, 1, 1, (None, None), {"wgmma": True}),
    ("wgmma-f16-64-split", "fwd", 90, "float16", 64, 64, 8, 600, 1, 1, (None, None), {"wgmma": True, "splits": 2}),
    ("dmma-f64-64", "fwd", 80, "float64", 64, 64, 50, 70, 2, 1, (None, 0), {"dmma": ("float64",)}),
    ("dmma-f32-32", "fwd", 80, "float32", 32, 32, 40, 50, 1, 1, (7, 7), {"dmma": ("float32",)}),
    ("tf32-64", "fwd", 80, "float32", 64, 64, 50, 90, 1, 1, (None, 0), {"precision": "tf32"}),
    ("tf32x3-128", "fwd", 80, "float32", 128, 128, 30, 40, 1, 1, (None, None), {"precision": "tf32x3"}),
    ("v1-f32", "v1", 80, "float32", 32, 32, 40, 50, 1, 1, (None, 0), {}),
    ("v1-f64", "v1", 80, "float64", 16, 24, 20, 30, 1, 1, (None, None), {}),
    ("bwd-simt-f32", "bwd", 80, "float32", 64, 64, 40, 60, 2, 1, (None, 0), {}),
    ("bwd-simt-f64-atomic", "bwd", 80, "float64", 32, 32, 30, 50, 1, 1, (5, 5), {"deterministic": False}),
    ("bwd-simt-f16-dv", "bwd", 80, "float16", 32, 48, 20, 30, 1, 1, (None, None), {}),
    ("bwd-mma-f16-64", "bwd", 80, "float16", 64, 64, 70, 100, 2, 1, (None, 0), {}),
    ("bwd-mma-bf16-64-atomic", "bwd", 80, "bfloat16", 64, 64, 64, 64, 1, 1, (None, None), {"deterministic": False}),
    ("bwd-mma-f16-160", "bwd", 80, "float16", 160, 160, 40, 50, 1, 1, (None, 0), {}),
    ("bwd-wgmma-f16-64", "bwd", 90, "float16", 64, 64, 70, 140, 2, 1, (None, 0), {"wgmma": True}),
    ("bwd-wgmma-f16-64-atomic", "bwd", 90, "float16", 64, 64, 64, 128, 1, 1, (None, None),
     {"wgmma": True, "deterministic": False}),
    ("bwd-wgmma-bf16-192", "bwd", 90, "bfloat16", 192, 192, 40, 70, 1, 1, (None, 0), {"wgmma": True}),
    ("bwd-dmma-f64-64", "bwd", 80, "float64", 64, 64, 40, 50, 1, 1, (None, 0), {"dmma": ("float64",)}),
    ("bwd-tf32x3-64", "bwd", 80, "float32", 64, 64, 40, 50, 1, 1, (None, 0), {"precision": "tf32x3"}),
    ("bwd-tf32-32", "bwd", 80, "float32", 32, 32, 30, 70, 1, 1, (3, 9), {"precision": "tf32"}),
]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _arrays(rng, dtype, d, dv, lq, lk, hq, hkv):
    def a(*shape):
        return rng.standard_normal(shape).astype(dtype)
    return a(1, hq, lq, d), a(1, hkv, lk, d), a(1, hkv, lk, dv)


class _Recorder:
    def __init__(self, executor):
        self.executor, self.launches = executor, []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def launch(self, entry, name, *args, **kwargs):
        self.launches.append(name)
        return self.executor.launch(entry, name, *args, **kwargs)


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def _runner():
    """forward(...), forward_v1(...), backward(...) for this checkout's API."""
    try:
        from cupyflash import _run
        from cupyflash._options import KernelOptions
    except ImportError:
        _run = None
    if _run is not None:
        def opts(s):
            return KernelOptions(wgmma=s.get("wgmma", False), dmma=frozenset(s.get("dmma", ())),
                                 splits=s.get("splits"))

        def fwd(args, s, **kw):
            _run.forward(*args, options=opts(s), precision=s.get("precision", "ieee"), **kw)

        def v1(args, s, **kw):
            _run.forward_v1(*args, sram_size=2048, **kw)

        def bwd(args, s, **kw):
            _run.backward(*args, deterministic=s.get("deterministic", True), options=opts(s),
                          precision=s.get("precision", "ieee"), **kw)
        return fwd, v1, bwd

    from cupyflash import _gpu, _gpu_bwd

    def switches(s):
        _gpu.wgmma_override = s.get("wgmma", False)
        _gpu.dmma_override = "float64" in s.get("dmma", ())
        _gpu.dmma_float32_override = "float32" in s.get("dmma", ())
        _gpu.split_override = s.get("splits")

    def fwd(args, s, **kw):
        switches(s)
        _gpu.forward(*args, precision=s.get("precision", "ieee"), **kw)

    def v1(args, s, **kw):
        switches(s)
        _gpu.forward_v1(*args, sram_size=2048, **kw)

    def bwd(args, s, **kw):
        switches(s)
        _gpu_bwd.backward(*args, deterministic=s.get("deterministic", True),
                          precision=s.get("precision", "ieee"), **kw)
    return fwd, v1, bwd


def run(names=None) -> dict:
    from cupyflash.emulator import EmulatorExecutor

    fwd, v1, bwd = _runner()
    executors = {}
    record = {}
    for (name, direction, arch, dtype, d, dv, lq, lk, hq, hkv, (left, right), s) in PROBLEMS:
        if names and name not in names:
            continue
        rng = np.random.default_rng(sum(map(ord, name)))
        acc = np.float64 if dtype == "float64" else np.float32
        dtype = _dtype(dtype)
        q, k, v = _arrays(rng, dtype, d, dv, lq, lk, hq, hkv)
        if arch not in executors:
            executors[arch] = EmulatorExecutor(arch=arch, seed=0, shuffle=False, race_check=False)
        ex = _Recorder(executors[arch])
        common = dict(scale=1.0 / np.sqrt(d), window_left=left, window_right=right, gqa_ratio=hq // hkv,
                      executor=ex)
        out = np.zeros((1, hq, lq, dv), dtype)
        lse = np.zeros((1, hq, lq), acc)
        if direction == "v1":
            v1((q, k, v, out, lse), s, **common)
            record[name] = dict(launches=ex.launches, digest=_digest(out, lse))
            continue
        fwd((q, k, v, out, lse), s, **common)
        entry = dict(launches=list(ex.launches), digest=_digest(out, lse))
        if direction == "bwd":
            ex.launches.clear()
            dout = rng.standard_normal(out.shape).astype(dtype)
            grads = [np.zeros(a.shape, acc) for a in (q, k, v)]
            bwd((dout, q, k, v, out, lse, *grads), s, **common)
            entry = dict(forward=entry, launches=list(ex.launches), digest=_digest(*grads))
        record[name] = entry
        print(name, entry["launches"], entry["digest"], file=sys.stderr, flush=True)
    return record


def compare(before: dict, after: dict) -> int:
    bad = 0
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            print(f"MISSING {name}")
            bad += 1
        elif a["digest"] != b["digest"] or a.get("forward", {}).get("digest") != b.get("forward", {}).get("digest"):
            print(f"DIFFERS {name}: {b['launches']} -> {a['launches']}")
            bad += 1
        elif a["launches"] != b["launches"]:
            print(f"same bits, other kernels {name}: {b['launches']} -> {a['launches']}")
            bad += 1
    print(f"{len(before)} problems, {bad} differ")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output")
    p.add_argument("--only", action="append")
    p.add_argument("--compare", nargs=2)
    a = p.parse_args(argv)
    if a.compare:
        before, after = (json.load(open(f)) for f in a.compare)
        return 1 if compare(before, after) else 0
    record = run(a.only)
    text = json.dumps(record, indent=1)
    if a.output:
        open(a.output, "w").write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
