"""fwd_combine (``cuda_src/fwd_combine.cu``): split-KV's merge of partial rows.

After a forward launch with ``num_splits > 1`` each split has written its
normalised partial rows and their lse to a workspace; fwd_combine merges them
into ``out`` and ``lse`` (one thread per 16-byte chunk of an output row), for
every forward family that splits (:attr:`Family.split_kv`).
"""

from __future__ import annotations

import functools

from .._dtypes import DTYPES, accumulator_dtype, accumulator_name
from ._family import COMBINE, Family, Sizes

__all__ = ["FWD_COMBINE"]



class FwdCombine(Family):
    name = "fwd_combine"
    entry = "fwd_combine.cu"
    threads = 128
    head_dim = 256

    def build_rows(self):
        return [self.row("fwd_combine_kernel", dtype, accumulator_name(dtype), role=COMBINE, dtype=dtype,
                         head_dim=self.head_dim, head_dim_v=self.head_dim, threads=self.threads)
                for dtype in DTYPES]

    @functools.cached_property
    def _by_dtype(self):
        return {r.dtype: r for r in self.rows}

    def applies(self, call, arch, options) -> bool:
        return False   # run after a split forward, never picked on its own

    def plan(self, call, arch, options):
        return (self._by_dtype[call.dtype],)

    def ctas(self, row, sizes: Sizes) -> int:
        # one thread per 16-byte chunk of each output row (head_dim_v, run time)
        chunks = -(-max(int(sizes.head_dim_v), 1) // (16 // accumulator_dtype(row.dtype).itemsize))
        return -(-sizes.seqlen_q * sizes.heads_q * sizes.batch * chunks // row.threads)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        return 0


FWD_COMBINE = FwdCombine()
