"""The catalogue of kernel instantiations the dispatcher can pick.

One row per template instantiation: which family (``fwd_simt``, ``fwd_v1``,
...), which ``cuda_src/`` file defines it, the exact name expression handed to
``cupy.RawModule(name_expressions=...)`` (and to the emulator), and the
properties the static report prints.  The dispatcher, ``precompile`` and
``python -m cupyflash kernels`` all read this one list.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Instantiation", "instantiations", "HEAD_DIM_BUCKETS"]


@dataclass(frozen=True)
class Instantiation:
    family: str            # "fwd_simt", "fwd_v1", ...
    entry: str             # file in cuda_src/, e.g. "fwd_simt.cu"
    name_expression: str   # e.g. "cf::fwd_simt_kernel<float, 64, 64>"
    dtype: str             # "float16", "bfloat16", "float32", "float64"
    head_dim: int          # compile-time (maximum) head dim of q/k
    head_dim_v: int        # compile-time (maximum) head dim of v/out
    threads: int           # threads per block
    block_m: int = 0       # query rows per CTA (0: chosen at run time, fwd_v1)
    block_n: int = 0       # keys per K/V block (0: chosen at run time, fwd_v1)


# C++ spelling of each dtype in name expressions.
_CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

# Head-dim buckets: a run-time d (and dv) up to the bucket is masked in the
# kernel, so four instantiations per dtype cover 1..256.  d and dv share the
# bucket of max(d, dv).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)

# fwd_simt tiles (block_m, block_n) per accumulator type and bucket.  128
# threads; 8 lanes share a query row, so a thread holds block_m/16 rows, its
# block_n/8 keys of S and bucket/8 columns of O.  Every tile keeps shared
# memory (Q + one K/V buffer, in the accumulator type) at or below 48 KB, the
# limit without an opt-in, and registers below the cap of the occupancy target
# (fwd_simt.cu: 128 for 4 CTAs/SM, 168 for the 48 KB tiles, which fit 3/SM).
_SIMT_TILES = {
    # float accumulators (float16, bfloat16, float32): 16-byte chunks of 4.
    # Per chunk a thread does rows x keys x 4 FMAs for rows + keys vector loads.
    "float": {
        32: (64, 32),    # 4 rows x 4 keys: 64 FMAs per 8 loads, 16 O registers; 12 KB
        64: (64, 32),    # 4 x 4, 32 O registers; 24 KB.  block_n 64 sits at the 128-register cap
        128: (32, 32),   # 2 x 4, 32 O registers; 32 KB.  block_m 64 would make the Q tile alone 32 KB
        256: (32, 16),   # 2 x 2, 64 O registers; 48 KB, 3 CTAs/SM on an A100
    },
    # double accumulators: 16-byte chunks of 2, half as many elements per byte
    "double": {
        32: (32, 32),    # 2 x 4, 8 O doubles; 16 KB.  block_m 64 (4 rows) sits at the 128-register cap
        64: (32, 32),    # 2 x 4, 16 O doubles; 32 KB
        128: (32, 16),   # 2 x 2, 32 O doubles; 48 KB
        256: (16, 8),    # 1 x 1, 32 O doubles; 48 KB (the 16-row Q tile alone is 32 KB)
    },
}

_SIMT_THREADS = 128
_V1_THREADS = 128


def _accumulator(dtype: str) -> str:
    return "double" if dtype == "float64" else "float"


def instantiations() -> list[Instantiation]:
    """Every instantiation the dispatcher can pick, in a stable order."""
    rows = []
    for dtype, cxx in _CXX_TYPE.items():
        for bucket in HEAD_DIM_BUCKETS:
            block_m, block_n = _SIMT_TILES[_accumulator(dtype)][bucket]
            rows.append(Instantiation(
                family="fwd_simt", entry="fwd_simt.cu",
                name_expression=f"cf::fwd_simt_kernel<{cxx}, {bucket}, {bucket}, {block_m}, {block_n}>",
                dtype=dtype, head_dim=bucket, head_dim_v=bucket, threads=_SIMT_THREADS,
                block_m=block_m, block_n=block_n))
    for dtype, cxx in _CXX_TYPE.items():
        rows.append(Instantiation(
            family="fwd_v1", entry="fwd_v1.cu", name_expression=f"cf::fwd_v1_kernel<{cxx}>",
            dtype=dtype, head_dim=HEAD_DIM_BUCKETS[-1], head_dim_v=HEAD_DIM_BUCKETS[-1],
            threads=_V1_THREADS))
    return rows
