"""Ring attention over MPI on the CPU: time per rank, communication share and overlap.

    python benchmarks/bench_ring.py --ranks 1,2,4 --length 16384 --dim 64 \\
        --json benchmarks/results/DATE-ring-cpu.json --markdown benchmarks/results/DATE-ring-cpu.md

launches ``mpiexec -n N python benchmarks/bench_ring.py --worker ...`` for each N
(one BLAS thread per rank) and writes the table.  Per case and rank it measures

* ``ring``: :func:`cupyflash.distributed.ring_attention` (or the backward), wall clock;
* ``compute``: the same rank's pairs of shards computed and merged with no
  communication at all (the ring's own pair schedule, on local copies);
* ``transfer``: the ring's messages alone (the K/V shards, and for the backward
  the dK/dV accumulators, each step), with no computation;

and derives ``exposed = max(0, ring - compute)`` (communication the computation
did not hide), ``comm share = exposed / ring`` and ``overlap = 1 - exposed /
transfer`` (the fraction of the transfer time hidden behind the computation).
Times are medians over the repeats; the table reports the slowest rank, which
the others wait for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CASES = [  # (pass, causal, layout)
    ("forward", False, "contiguous"),
    ("forward", True, "contiguous"),
    ("forward", True, "zigzag"),
    ("backward", True, "zigzag"),
]


def _median_time(fn, comm, repeat):
    times = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args):
    from mpi4py import MPI

    import cupyflash
    from cupyflash import distributed
    from cupyflash.distributed import ring_attention, ring_attention_backward, shard

    comm = MPI.COMM_WORLD
    t = distributed._MPITransport(comm)
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.length, args.dim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    rows = []
    for pass_, causal, layout in CASES:
        sq, sk, sv, sd = (np.ascontiguousarray(shard(x, comm, layout)) for x in (q, k, v, dout))
        out, lse = ring_attention(sq, sk, sv, comm=comm, causal=causal, layout=layout, return_lse=True)

        def piece(x, r):
            return np.concatenate([x[..., a:b, :] for a, b in distributed._ranges(args.length, t.size, r, layout)],
                                  axis=-2)

        shards = [(piece(k, r), piece(v, r)) for r in range(t.size)]
        band = (None, 0) if causal else (None, None)
        q_ranges = distributed._ranges(args.length, t.size, t.rank, layout)

        def ring():
            if pass_ == "forward":
                ring_attention(sq, sk, sv, comm=comm, causal=causal, layout=layout)
            else:
                ring_attention_backward(sd, sq, sk, sv, out, lse, comm=comm, causal=causal, layout=layout)

        def compute():
            """This rank's pairs, as the ring computes them, with the shards already here."""
            acc_out = np.zeros(sq.shape, np.float32)
            acc_lse = np.full(sq.shape[:-1], -np.inf, np.float32)
            grads = [(np.zeros_like(kj), np.zeros_like(vj)) for kj, vj in shards]
            for step in range(t.size):
                src = (t.rank - step) % t.size
                kj, vj = shards[src]
                for rows_, keys, window in distributed._pairs(
                        q_ranges, distributed._ranges(args.length, t.size, src, layout), band):
                    if pass_ == "forward":
                        o, s = cupyflash.attention(sq[..., rows_, :], kj[..., keys, :], vj[..., keys, :],
                                                   window=window, return_lse=True)
                        distributed._merge_into(acc_out, acc_lse, rows_, o, s)
                    else:
                        dq_s, dk_s, dv_s = cupyflash.attention_backward(
                            sd[..., rows_, :], sq[..., rows_, :], kj[..., keys, :], vj[..., keys, :],
                            out[..., rows_, :], lse[..., rows_], window=window)
                        acc_out[..., rows_, :] += dq_s
                        grads[src][0][..., keys, :] += dk_s
                        grads[src][1][..., keys, :] += dv_s

        def transfer():
            """The ring's messages alone: n - 1 steps of the K/V shards; for the backward
            also n steps of the dK/dV accumulators (float32, the shards' shapes)."""
            lengths = [piece(k[..., :1], r).shape[-2] for r in range(t.size)]
            for step in range(t.size if pass_ == "backward" else t.size - 1):
                src = (t.rank - step) % t.size
                sends = list(shards[src]) if step < t.size - 1 else []
                if pass_ == "backward":
                    sends += list(shards[src])
                nxt = [np.empty(m.shape[:-2] + (lengths[(src - 1) % t.size], m.shape[-1]), m.dtype)
                       for m in sends]
                t.wait(t.start(sends, nxt, (t.rank + 1) % t.size, (t.rank - 1) % t.size))

        ring()                                       # warm-up
        measured = {name: _median_time(fn, comm, args.repeat)
                    for name, fn in (("ring", ring), ("compute", compute), ("transfer", transfer))}
        if t.size == 1:
            measured["transfer"] = 0.0
        per_rank = comm.gather(measured, root=0)
        if t.rank == 0:
            rows.append(dict(pass_=pass_, causal=causal, layout=layout, ranks=t.size, per_rank=per_rank))
    if t.rank == 0:
        print("BENCH-RING-JSON " + json.dumps(rows), flush=True)


def summarise(row):
    ranks = row["per_rank"]
    slowest = max(range(len(ranks)), key=lambda r: ranks[r]["ring"])
    m = ranks[slowest]
    exposed = max(0.0, m["ring"] - m["compute"])
    steps = max(1, row["ranks"] - (1 if row["pass_"] == "forward" else 0))
    return dict(
        pass_=row["pass_"], causal=row["causal"], layout=row["layout"], ranks=row["ranks"],
        ring_s=m["ring"], compute_s=m["compute"], transfer_s=m["transfer"],
        min_rank_ring_s=min(r["ring"] for r in ranks),
        compute_per_step_ms=1e3 * m["compute"] / row["ranks"],
        transfer_per_step_ms=1e3 * m["transfer"] / steps if row["ranks"] > 1 else 0.0,
        comm_share=exposed / m["ring"],
        transfer_over_compute=m["transfer"] / m["compute"],
        overlap=(1.0 - min(exposed, m["transfer"]) / m["transfer"]) if m["transfer"] > 0 else None,
    )


def markdown(doc):
    lines = [f"# Ring attention over MPI on the CPU: {doc['machine']}", "",
             f"{doc['date']}; {doc['versions']}.", f"`{doc['command']}` (load average {doc['load']}).", ""]
    lines += [f"Note: {n}" for n in doc["notes"]] + [""]
    if doc.get("model"):
        lines += ["## Model", ""]
        for paragraph in doc["model"]:
            lines += [paragraph, ""]
    lines += ["| pass | causal | layout | ranks | ring s (slowest rank) | fastest rank s | compute s | "
              "transfer s | compute/step ms | transfer/step ms | transfer/compute | comm share | overlap |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        overlap = "—" if s["overlap"] is None else f"{100 * s['overlap']:.0f}%"
        lines.append(
            f"| {s['pass_']} | {'yes' if s['causal'] else 'no'} | {s['layout']} | {s['ranks']} | "
            f"{s['ring_s']:.3f} | {s['min_rank_ring_s']:.3f} | {s['compute_s']:.3f} | {s['transfer_s']:.4f} | "
            f"{s['compute_per_step_ms']:.1f} | {s['transfer_per_step_ms']:.2f} | "
            f"{100 * s['transfer_over_compute']:.2f}% | {100 * s['comm_share']:.1f}% | "
            f"{overlap} |")
    return "\n".join(lines) + "\n"


def driver(args):
    exe = shutil.which("mpiexec")
    if exe is None:
        sys.exit("bench_ring.py: mpiexec not found (pip install mpich)")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(var, None)
    rows, loads = [], []
    for n in args.ranks:
        cmd = [exe, "-n", str(n), sys.executable, __file__, "--worker", "--length", str(args.length),
               "--dim", str(args.dim), "--heads", str(args.heads), "--repeat", str(args.repeat)]
        loads.append(os.getloadavg()[0])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH-RING-JSON "))
        rows += json.loads(line.split(" ", 1)[1])
        print(f"{n} rank(s) done", file=sys.stderr)
    import mpi4py
    from mpi4py import MPI

    import cupyflash

    doc = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        versions=(f"cupyflash {cupyflash.__version__}, NumPy {np.__version__}, "
                  f"{' '.join(MPI.Get_library_version().split()[:3])}, mpi4py {mpi4py.__version__}, "
                  f"Python {platform.python_version()}"),
        command="python benchmarks/bench_ring.py " + " ".join(sys.argv[1:]),
        load=", ".join(f"{x:.2f}" for x in loads),
        notes=[f"B = 1, H = {args.heads}, L = {args.length}, d = {args.dim}, float32; one BLAS thread per rank.",
               f"{os.cpu_count()} cores: 1 rank uses one core, 2 ranks two, 4 ranks oversubscribe "
               "(two ranks per core), and other jobs shared the machine (load averages above): "
               "absolute times are noisy, and with 4 ranks each rank's time includes waiting for its core.",
               "ring = ring_attention (or its backward) per rank; compute = the same rank's pairs with no "
               "communication; transfer = the same messages with no computation; comm share = "
               "max(0, ring - compute) / ring; overlap = 1 - max(0, ring - compute) / transfer. "
               "The slowest rank is shown (the others wait for it at the end).",
               *args.note],
        model=args.model, rows=rows, summary=[summarise(r) for r in rows])
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    text = markdown(doc)
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--model", action="append", default=[], help="a paragraph for the Model section")
    p.add_argument("--render", metavar="JSON", help="rewrite the JSON's summary, notes and model, and its "
                   "Markdown (--markdown), from its raw rows without running anything")
    args = p.parse_args()
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        doc["summary"] = [summarise(r) for r in doc["rows"]]
        doc["notes"] += args.note
        doc["model"] = doc.get("model", []) + args.model
        Path(args.render).write_text(json.dumps(doc, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(markdown(doc))
        print(markdown(doc))
        return
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
