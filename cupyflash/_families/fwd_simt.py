"""fwd_simt (``cuda_src/fwd_simt.cu``): the CUDA-core forward, any dtype, any strides.

The fallback every forward call can take: FlashAttention-2's loop on the CUDA
cores in the accumulator type, for every dtype, head dims up to 256 (a
run-time d and dv up to the bucket are masked in the kernel), any strides and
any scale.  Splits keys at run time (``FwdParams::num_splits``).
"""

from __future__ import annotations

import functools

from .._dtypes import DTYPES, accumulator_dtype, accumulator_name
from ._family import FEATURES, FORWARD, Call, Family, Sizes, smallest_fit

__all__ = ["FWD_SIMT", "HEAD_DIM_BUCKETS", "simt_bucket"]

# Head-dim buckets: a run-time d (and dv) up to the bucket is masked in the
# kernel, so four instantiations per dtype cover 1..256.  d and dv share the
# bucket of max(d, dv).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)


def simt_bucket(family: Family, dtype: str, head_dim: int, head_dim_v: int) -> int:
    """The smallest head-dim bucket of a SIMT family (fwd_simt, bwd_simt) holding both head dims.

    Raises
    ------
    TypeError
        The family has no kernels for ``dtype``.
    ValueError
        A head dim above the largest bucket.
    """
    if dtype not in DTYPES:
        raise TypeError(f"no {family.name} kernels for dtype {dtype}")
    bucket = smallest_fit(HEAD_DIM_BUCKETS, max(head_dim, head_dim_v))
    if bucket is None:
        raise ValueError(f"head dims up to {HEAD_DIM_BUCKETS[-1]} are supported; "
                         f"got head_dim={head_dim}, head_dim_v={head_dim_v}")
    return bucket


class FwdSimt(Family):
    name = "fwd_simt"
    entry = "fwd_simt.cu"
    split_kv = True
    takes = frozenset(FEATURES)   # score.cuh's terms and modifications, through score_epilogue
    threads = 128
    # (block_m, block_n) per accumulator type and bucket.  128 threads; 8 lanes
    # share a query row, so a thread holds block_m/16 rows, its block_n/8 keys of
    # S and bucket/8 columns of O.  Shared memory (accumulator type): Q, K and V
    # in their own buffers for float32/float64 (cp.async prefetch; one K/V buffer
    # for the 16-bit types, converted on the way in), and P (block_m x (block_n +
    # 8)).  Registers stay below the cap of the occupancy target (fwd_simt.cu:
    # 128 for 4 CTAs/SM up to 48 KB, 168 up to 64 KB, 255 above).  Sizes below:
    # float32 / 16-bit, float64.
    tiles = {
        # float accumulators (float16, bfloat16, float32): 16-byte chunks of 4.
        # Per chunk a thread does rows x keys x 4 FMAs for rows + keys vector loads.
        "float32": {
            32: (64, 32),    # 4 rows x 4 keys: 64 FMAs per 8 loads, 16 O registers; 26 / 22 KB
            64: (64, 32),    # 4 x 4, 32 O registers; 42 / 34 KB.  block_n 64 sits at the 128-register cap
            128: (32, 32),   # 2 x 4, 32 O registers; 53 / 37 KB.  block_m 64 would make the Q tile alone 32 KB
            256: (32, 16),   # 2 x 2, 64 O registers; 67 / 51 KB
        },
        # double accumulators: 16-byte chunks of 2, half as many elements per byte
        "float64": {
            32: (32, 32),    # 2 x 4, 8 O doubles; 34 KB.  block_m 64 (4 rows) sits at the 128-register cap
            64: (32, 32),    # 2 x 4, 16 O doubles; 58 KB
            128: (32, 16),   # 2 x 2, 32 O doubles; 70 KB
            256: (16, 8),    # 1 x 1, 32 O doubles; 66 KB (the 16-row Q tile alone is 32 KB)
        },
    }

    def build_rows(self):
        rows = []
        for dtype in DTYPES:
            for bucket in HEAD_DIM_BUCKETS:
                block_m, block_n = self.tiles[accumulator_name(dtype)][bucket]
                rows.append(self.row("fwd_simt_kernel", dtype, bucket, bucket, block_m, block_n, role=FORWARD,
                                     dtype=dtype, head_dim=bucket, head_dim_v=bucket, threads=self.threads,
                                     block_m=block_m, block_n=block_n))
        return rows

    def applies(self, call: Call, arch: int, options) -> bool:
        return True

    @functools.cached_property
    def _by_bucket(self):
        return {(r.dtype, r.head_dim): r for r in self.rows}

    def plan(self, call: Call, arch: int, options):
        return (self._by_bucket[(call.dtype, simt_bucket(self, call.dtype, call.head_dim, call.head_dim_v))],)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # SimtFwdTraits::kSmemBytes: Q, then K and V in their own buffers for float32 /
        # float64 (copied with cp.async, kAsync), one shared K/V buffer for the 16-bit
        # types, then P (block_m rows of block_n + 8).
        if row.dtype in ("float32", "float64"):
            kv = row.block_n * (row.head_dim + row.head_dim_v)
        else:
            kv = row.block_n * max(row.head_dim, row.head_dim_v)
        p = row.block_m * (row.block_n + 8)
        return (row.block_m * row.head_dim + kv + p) * accumulator_dtype(row.dtype).itemsize

    def min_ctas_per_sm(self, row) -> int:
        shared = self.shared_bytes(row)
        return 1 if shared > 64 * 1024 else 3 if shared > 48 * 1024 else 4   # SimtFwdTraits::kMinBlocksPerSm


FWD_SIMT = FwdSimt()
