"""bwd_dmma (``cuda_src/bwd_dmma.cu``): the backward on the FP64 tensor cores.

Where fwd_dmma's conditions hold (:func:`~cupyflash._families.fwd_dmma.dmma_bucket`):
bwd_simt's delta kernel, then the dK/dV and dQ kernels, whatever
``deterministic`` says (there is no atomic variant).
"""

from __future__ import annotations

from ._family import DKDV, DQ, FEATURES, Call, Family, Sizes
from .bwd_simt import BWD_SIMT
from .fwd_dmma import DMMA_DTYPES, dmma_bucket, dtype_tail

__all__ = ["BWD_DMMA"]


class BwdDmma(Family):
    name = "bwd_dmma"
    entry = "bwd_dmma.cu"
    takes = frozenset(FEATURES)   # score.cuh: probability_epilogue, gradient_epilogue
    direction = "backward"
    # Per head dim (own rows, streamed rows, warps) of both kernels -- dK/dV owns keys
    # and streams query rows, dQ owns query rows and streams keys.  Per lane: the own
    # rows' gradients (dK and dV, or dQ) 2 x d / 8 doubles per m8 tile, S and dP
    # streamed / 4 each.  Shared memory (2 own + 2 x stages streamed tiles) x d x 8
    # bytes, two stages for float64 and one for float32.  Registers from the static
    # report (NVRTC 13.5, float64 on sm_80 / sm_90; float32 within 10 of them), no
    # spills; not yet timed on a GPU.
    tiles = {
        32: (64, 32, 4),    # dK/dV 236 / 246 regs, dQ 232 / 230; 64 KB (float32 48 KB)
        64: (64, 16, 4),    # dK/dV 240 / 244, dQ 228 / 242; 96 KB (float32 80 KB; 32 streamed rows: 128 KB;
                            # fully unrolled score products: the dK/dV kernel spills 28-36 B)
        128: (32, 8, 4),    # dK/dV 254 / 252, dQ 238 / 234; 96 KB (float32 80 KB): one m8 tile per warp (two
                            # would be 128 doubles of dK and dV per lane)
    }

    def kernels(self, dtype: str, head_dim: int) -> tuple:
        """``bwd_dmma_dkdv_kernel`` and ``bwd_dmma_dq_kernel`` ``<head_dim, own, streamed,
        warps[, float]>``, in launch order."""
        if head_dim not in self.tiles:
            raise ValueError(f"bwd_dmma has no kernel for head_dim={head_dim}")
        own, streamed, warps = self.tiles[head_dim]
        common = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps,
                      kv_stages=2 if dtype == "float64" else 1)
        args = (head_dim, own, streamed, warps, *dtype_tail(dtype))
        return (self.row("bwd_dmma_dkdv_kernel", *args, role=DKDV, block_m=streamed, block_n=own, grads=3, **common),
                self.row("bwd_dmma_dq_kernel", *args, role=DQ, block_m=own, block_n=streamed, **common))

    def build_rows(self):
        return [r for dtype in DMMA_DTYPES for d in self.tiles for r in self.kernels(dtype, d)]

    def launchable(self, arch: int):
        from .._arch import DMMA_ARCHS

        return self.rows if int(arch) in DMMA_ARCHS else ()

    def applies(self, call: Call, arch: int, options) -> bool:
        return dmma_bucket(call, arch, options) is not None

    def plan(self, call: Call, arch: int, options):
        return (BWD_SIMT.delta(call),) + self.kernels(call.dtype, dmma_bucket(call, arch, options))

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # DmmaBwdTraits::kSmemBytes: two own tiles and, per stage, two streamed tiles of
        # doubles -- two stages for float64 (cp.async), one for float32 (widened on the
        # way in).  The same shape for both kernels.
        own, streamed = (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)
        return (2 * own + 2 * row.kv_stages * streamed) * row.head_dim * 8


BWD_DMMA = BwdDmma()
