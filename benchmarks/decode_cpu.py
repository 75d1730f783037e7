"""A decode step over a KV cache: paged cache, dense cache, and naive attention over the
gathered cache (issue 28's benchmark case), on the CPU path or a GPU.

    python benchmarks/decode_cpu.py                          # B 32, Hq 32, Hkv 8, d 128, 4096 keys, pages of 16
    python benchmarks/decode_cpu.py --markdown benchmarks/results/decode.md
    python benchmarks/decode_cpu.py --backend cuda --dtype float16   # CuPy arrays: the kernels

With ``--backend cuda`` each timed call is bracketed by device synchronisations, and the
table adds the K/V read rate as a share of ``--peak-gbs`` (default 4800: an H200's
HBM3e; issue 28's target is 70% for the paged cache).

One query per sequence (Lq = 1), causal, GQA.  The paged cache holds the same keys as
the dense one, its pages shuffled; the naive variant gathers each sequence's pages into
a dense array and runs matmul, softmax, matmul (naive_attention with oracle=False).  The
variants take turns, one call each per round; the table gives the median, the bytes of
K and V read per second, and the largest difference from the dense cache's result.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupyflash  # noqa: E402
from cupyflash import _threads  # noqa: E402
from cupyflash.reference import naive_attention  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--backend", choices=("numpy", "cuda"), default="numpy")
    p.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth, GB/s")
    p.add_argument("--markdown")
    a = p.parse_args(argv)

    rng = np.random.default_rng(0)
    dtype = np.dtype(a.dtype)
    b, hq, hkv, d, n, ps = a.batch, a.heads_q, a.heads_kv, a.head_dim, a.kv_len, a.page_size
    k_dense = rng.standard_normal((b, hkv, n, d), dtype=np.float32).astype(dtype)
    v_dense = rng.standard_normal((b, hkv, n, d), dtype=np.float32).astype(dtype)
    q = rng.standard_normal((b, hq, 1, d), dtype=np.float32).astype(dtype)
    pages_per = -(-n // ps)
    table = rng.permutation(b * pages_per).astype(np.int32).reshape(b, pages_per)
    k_pages = np.empty((b * pages_per, hkv, ps, d), dtype)
    v_pages = np.empty((b * pages_per, hkv, ps, d), dtype)
    padded = pages_per * ps
    for s in range(b):
        for name, dense, pages in (("k", k_dense, k_pages), ("v", v_dense, v_pages)):
            full = np.zeros((hkv, padded, d), dtype)
            full[:, :n] = dense[s]
            pages[table[s]] = full.reshape(hkv, pages_per, ps, d).transpose(1, 0, 2, 3)
    lengths = np.full(b, n, np.int32)
    del full
    sync = lambda: None  # noqa: E731
    if a.backend == "cuda":
        import cupy

        q, k_dense, v_dense, k_pages, v_pages, table, lengths = (
            cupy.asarray(x) for x in (q, k_dense, v_dense, k_pages, v_pages, table, lengths))
        sync = cupy.cuda.Device().synchronize

    def dense():
        return cupyflash.attention(q, k_dense, v_dense, kv_lengths=lengths, causal=True, enable_gqa=True)

    def paged():
        return cupyflash.attention(q, k_pages, v_pages, block_table=table, kv_lengths=lengths, causal=True,
                                   enable_gqa=True)

    def naive():
        keys = k_pages[table].transpose(0, 2, 1, 3, 4).reshape(b, hkv, padded, d)[:, :, :n]
        values = v_pages[table].transpose(0, 2, 1, 3, 4).reshape(b, hkv, padded, d)[:, :, :n]
        return naive_attention(q, keys, values, causal=True, enable_gqa=True, oracle=False)

    variants = [("dense cache (kv_lengths)", dense), ("paged cache (block_table)", paged),
                ("naive over the gathered cache", naive)]
    reference = dense()
    for _, fn in variants:
        fn()
    times = {name: [] for name, _ in variants}
    for _ in range(a.repeat):
        for name, fn in variants:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    kv_bytes = 2 * b * hkv * n * d * dtype.itemsize
    where = "CPU path" if a.backend == "numpy" else "GPU (CuPy arrays, the kernels)"
    lines = [f"# Decode step over a KV cache, {where}", "",
             f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} CPUs, {_threads.num_threads()} "
             f"worker threads; NumPy {np.__version__}, Python {platform.python_version()}.",
             f"`python benchmarks/decode_cpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`: B = {b}, "
             f"Hq = {hq}, Hkv = {hkv}, d = {d}, {n} keys per sequence, pages of {ps}, {dtype.name}, Lq = 1, causal; "
             f"K and V: {kv_bytes / 2**20:.0f} MiB; median of {a.repeat} rounds (the variants in turn) after a warm-up.",
             "", "| variant | ms | K/V read GB/s | vs dense cache | max abs diff from the dense cache |"
             + (" of the peak |" if a.backend == "cuda" else ""),
             "|---|---|---|---|---|" + ("---|" if a.backend == "cuda" else "")]
    base = statistics.median(times[variants[0][0]])
    for name, fn in variants:
        seconds = statistics.median(times[name])
        diff = float(abs(fn().astype(np.float64) - reference.astype(np.float64)).max())
        rate = kv_bytes / seconds / 1e9
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {rate:.2f} | {base / seconds:.2f}x | {diff:.1e} |"
                     + (f" {100 * rate / a.peak_gbs:.0f}% |" if a.backend == "cuda" else ""))
    table_md = "\n".join(lines) + "\n"
    print(table_md)
    if a.markdown:
        Path(a.markdown).write_text(table_md, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
