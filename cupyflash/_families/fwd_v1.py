"""fwd_v1 (``cuda_src/fwd_v1.cu``): Algorithm 1 of FlashAttention (v1), for teaching.

One CTA per (batch, head) walks the key blocks in the outer loop and the query
blocks in the inner one, keeping O, l and m in a global-memory workspace, with
the paper's block sizes from its SRAM size ``M`` (:func:`v1_block_sizes`).
Run by :func:`cupyflash.reference.flash_attention_v1` with a CUDA backend; the
dispatcher never picks it.
"""

from __future__ import annotations

import functools
import math

from .._dtypes import DTYPES, accumulator_dtype
from ._family import FORWARD, Family, Sizes

__all__ = ["FWD_V1", "v1_block_sizes"]

# fwd_v1's on-chip buffers per Q block of Br rows: l_i, m_i, m~_ij, 1/l_i^new, m_i^new, l_i^new.
_ROW_VECTORS = 6


def v1_block_sizes(sram_size: int, head_dim: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Algorithm 1, line 1: ``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)``.

    ``M`` is the SRAM size in elements and ``d`` the q/k head dim.  A block
    longer than its sequence is cut to the sequence (same blocks, less shared
    memory).  Returns ``(Br, Bc)``.
    """
    if int(sram_size) < 1:
        raise ValueError(f"`sram_size` must be positive, got {sram_size}")
    d = max(int(head_dim), 1)
    b_c = math.ceil(int(sram_size) / (4 * d))
    b_r = min(b_c, d)
    return min(b_r, max(int(seqlen_q), 1)), min(b_c, max(int(seqlen_k), 1))


class FwdV1(Family):
    name = "fwd_v1"
    entry = "fwd_v1.cu"
    threads = 128
    head_dim = 256

    def build_rows(self):
        return [self.row("fwd_v1_kernel", dtype, role=FORWARD, dtype=dtype, head_dim=self.head_dim,
                         head_dim_v=self.head_dim, threads=self.threads)
                for dtype in DTYPES]

    @functools.cached_property
    def _by_dtype(self):
        return {r.dtype: r for r in self.rows}

    def applies(self, call, arch, options) -> bool:
        return False   # never picked by dispatch: flash_attention_v1 asks for it

    def plan(self, call, arch, options):
        try:
            return (self._by_dtype[call.dtype],)
        except KeyError:
            raise TypeError(f"no fwd_v1 kernel for dtype {call.dtype}") from None

    def ctas(self, row, sizes: Sizes) -> int:
        return sizes.heads_q * sizes.batch

    def launch_config(self, row, sizes: Sizes):
        if sizes.sram_size is None:
            raise ValueError("fwd_v1 needs `sram_size` (Algorithm 1's M, in elements)")
        return super().launch_config(row, sizes)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # The buffer list at the top of fwd_v1_kernel, for the run-time blocks.
        if sizes is None:   # the static report: d = dv = 64, L = 1024, M = 8192 (Br = Bc = 32)
            sizes = Sizes(1, 1, 1, 1024, 1024, head_dim=64, head_dim_v=64, sram_size=8192)
        block_m, block_n = v1_block_sizes(sizes.sram_size, sizes.head_dim, sizes.seqlen_q, sizes.seqlen_k)
        d, dv = sizes.head_dim, sizes.head_dim_v
        elements = block_n * (d + dv) + block_m * (d + dv) + block_m * block_n + _ROW_VECTORS * block_m
        return elements * accumulator_dtype(row.dtype).itemsize


FWD_V1 = FwdV1()
