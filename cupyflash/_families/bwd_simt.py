"""bwd_simt (``cuda_src/bwd_simt.cu``): the CUDA-core backward, any dtype, any strides.

Per dtype and head-dim bucket three kernels, launched in this order: delta =
rowsum(dO o O) (:data:`DELTA`; every backward family launches this one first),
then dK/dV (a CTA owns ``block_n`` keys and streams ``block_m`` query rows),
then dQ (a CTA owns ``block_m`` query rows and streams ``block_n`` keys) -- or,
``deterministic=False`` where the streamed block allows it, delta and the
dK/dV kernel that adds dQ by atomics.
"""

from __future__ import annotations

import functools

from .._dtypes import DTYPES, accumulator_dtype, accumulator_name
from ._family import DELTA, DKDV, DQ, FEATURES, Call, Family, Sizes
from .fwd_simt import HEAD_DIM_BUCKETS, simt_bucket

__all__ = ["BWD_SIMT"]



class BwdSimt(Family):
    name = "bwd_simt"
    entry = "bwd_simt.cu"
    takes = frozenset(FEATURES)   # score.cuh: probability_epilogue, gradient_epilogue
    direction = "backward"
    threads = 128
    delta_rows = 16     # bwd_simt_dot_do_o_kernel: 128 threads, 8 lanes per query row
    # Both main kernels keep in shared memory the own rows x (d + dv), a P / dS
    # scratch tile (own x (streamed + 8)) and the streamed rows x (d + dv) -- twice
    # for float32/float64 where it fits in 72 KB (cp.async prefetch of the next
    # block) -- in the accumulator type, and use the same (own, streamed) shape,
    # 128 threads, 8 lanes per own row: a thread holds own/16 rows of dK+dV (or
    # dQ) and own/16 x streamed/8 entries of S, P, dP, dS.  float32 tiles take
    # 29-67 KB, float64 58-70 KB except at 256, whose smallest tile (16 + 8 rows of
    # 4 KB, one streamed buffer) needs 98 KB; the 16-bit types (one buffer) 21-51 KB.
    tiles = {
        # (own rows, streamed rows)
        "float32": {
            32: (32, 32),    # 2 x 4, 8 + 8 dK/dV registers.  (64, 32): its dQ kernel spilled 16 B on sm_86/89
            64: (32, 32),    # 2 x 4, 16 + 16
            128: (32, 16),   # 2 x 2, 32 + 32
            256: (16, 8),    # 1 x 1, 32 + 32
        },
        "float64": {
            32: (32, 32),    # 2 x 4, 8 + 8 doubles
            64: (32, 16),    # 2 x 2, 16 + 16 doubles
            128: (16, 8),    # 1 x 1, 16 + 16 doubles
            256: (16, 8),    # 1 x 1, 32 + 32 doubles; 98 KB (opt-in shared memory, 1 CTA/SM on an A100)
        },
    }

    def _kernels(self, dtype: str, bucket: int):
        """(delta, dK/dV, dQ, atomic dK/dV or None) of one dtype and bucket."""
        own, streamed = self.tiles[accumulator_name(dtype)][bucket]
        common = dict(dtype=dtype, head_dim=bucket, head_dim_v=bucket, threads=self.threads)
        delta = self.row("bwd_simt_dot_do_o_kernel", dtype, bucket, role=DELTA, block_m=self.delta_rows, **common)

        def dkdv(atomic: bool):
            return self.row("bwd_simt_dkdv_kernel", dtype, bucket, bucket, own, streamed, atomic, role=DKDV,
                            block_m=streamed, block_n=own, grads=3 | (4 if atomic else 0), **common)
        dq = self.row("bwd_simt_dq_kernel", dtype, bucket, bucket, own, streamed, role=DQ, block_m=own,
                      block_n=streamed, **common)
        # deterministic=False: dK/dV and dQ by atomics in one launch, where the streamed
        # block is a multiple of 16 rows
        return delta, dkdv(False), dq, (dkdv(True) if streamed % 16 == 0 else None)

    def build_rows(self):
        return [r for dtype in DTYPES for bucket in HEAD_DIM_BUCKETS for r in self._kernels(dtype, bucket)
                if r is not None]

    @functools.cached_property
    def _index(self):
        return {(dtype, bucket): self._kernels(dtype, bucket) for dtype in DTYPES for bucket in HEAD_DIM_BUCKETS}

    def delta(self, call: Call):
        """The delta kernel every backward family launches first."""
        return self._index[(call.dtype, simt_bucket(self, call.dtype, call.head_dim, call.head_dim_v))][0]

    def applies(self, call: Call, arch: int, options) -> bool:
        return True

    def plan(self, call: Call, arch: int, options):
        delta, dkdv, dq, atomic = self._index[(call.dtype, simt_bucket(self, call.dtype, call.head_dim,
                                                                       call.head_dim_v))]
        if not call.deterministic and atomic is not None:
            return (delta, atomic)
        return (delta, dkdv, dq)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        if row.role == DELTA:
            return 0
        # SimtBwdTraits::kSmemBytes: own rows, a scratch tile for P / dS, then kStages
        # buffers of streamed rows, each a d-wide and a dv-wide tile.  Two buffers for
        # float32 / float64 (cp.async prefetch) where they fit in 72 KB.
        own, streamed = (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)
        acc = accumulator_dtype(row.dtype).itemsize
        row_bytes = (row.head_dim + row.head_dim_v) * acc
        scratch_bytes = own * (streamed + 8) * acc   # P / dS, kSPitch
        own_bytes, stage_bytes = own * row_bytes + scratch_bytes, streamed * row_bytes
        pipelined = row.dtype in ("float32", "float64") and own_bytes + 2 * stage_bytes <= 72 * 1024
        return own_bytes + (2 if pipelined else 1) * stage_bytes


BWD_SIMT = BwdSimt()
