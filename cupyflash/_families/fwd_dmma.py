"""fwd_dmma (``cuda_src/fwd_dmma.cu``): the forward on the FP64 tensor cores (mma.sync m8n8k4 .f64).

float64 -- and float32, computed in double and rounded once -- with
``head_dim == head_dim_v <= 128`` (any strides) on
:data:`~cupyflash._arch.DMMA_ARCHS`, where :attr:`KernelOptions.dmma
<cupyflash._options.KernelOptions.dmma>` names the dtype (opt-in until the GPU
tier has checked it), in the smallest of :data:`DMMA_HEAD_DIMS` holding the
head dim.
"""

from __future__ import annotations

from .._arch import DMMA_ARCHS
from ._family import FEATURES, FORWARD, Call, Family, Sizes, smallest_fit

__all__ = ["FWD_DMMA", "DMMA_HEAD_DIMS", "DMMA_DTYPES", "dmma_bucket"]

DMMA_HEAD_DIMS = (32, 64, 128)
DMMA_DTYPES = ("float64", "float32")


def dmma_bucket(call: Call, arch: int, options) -> int | None:
    """The head dim the DMMA kernels (fwd_dmma, bwd_dmma) run ``call`` in, or None where
    they do not apply (dtype, head dims, arch, or ``options.dmma`` not naming the dtype)."""
    if (call.dtype in DMMA_DTYPES and call.dtype in options.dmma and int(arch) in DMMA_ARCHS
            and call.head_dim == call.head_dim_v):
        return smallest_fit(DMMA_HEAD_DIMS, call.head_dim)
    return None


def dtype_tail(dtype: str) -> tuple:
    """The DMMA kernels' optional last template argument: none for float64, the input
    type for float32 (computed in double)."""
    return () if dtype == "float64" else (dtype,)


class FwdDmma(Family):
    name = "fwd_dmma"
    entry = "fwd_dmma.cu"
    split_kv = True
    takes = frozenset(FEATURES)   # score.cuh's terms and modifications, through score_epilogue
    # (block_m, block_n, warps) per head dim: 4 warps of 16 query rows (two m8 tiles,
    # so each K/V fragment feeds two DMMA); shared memory (Q + K + V) x 8 bytes.
    # Registers from the static report (NVRTC 13.5, sm_80 / sm_90), no spills;
    # 2 CTAs per SM (registers) except at d = 128 on sm_80 (shared memory: 1).
    # Not yet timed on a GPU.
    tiles = {
        32: (64, 32, 4),    # 187 / 192 regs, 32 KB
        64: (64, 32, 4),    # 215 / 216 regs, 64 KB
        128: (64, 16, 4),   # 246 / 246 regs, 96 KB: 1 CTA on sm_80, 2 on sm_90 (64 x 32 would take 128 KB)
    }
    # A call with score features at d = 128 takes 8-key blocks: with 16, float64 spilled
    # 24-32 B on sm_90 with a T5 bucket table, a temperature per batch or a prefix-LM
    # mask_mod (NVRTC 13.5; 8 keys: 240-252 registers, no spills, with two biases and a
    # mask too; benchmarks/results/terms/).
    feature_tiles = {128: (64, 8, 4)}

    def make_row(self, dtype: str, head_dim: int, features: bool = False):
        """``fwd_dmma_kernel<head_dim, block_m, block_n, warps[, float]>`` (``features``: a
        call's with score features)."""
        block_m, block_n, warps = self.tile(head_dim, features)
        return self.row("fwd_dmma_kernel", head_dim, block_m, block_n, warps, *dtype_tail(dtype), role=FORWARD,
                        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps,
                        block_m=block_m, block_n=block_n)

    def build_rows(self):
        return [self.make_row(dtype, d, features) for dtype in DMMA_DTYPES for d in self.tiles
                for features in (False, True)]

    def launchable(self, arch: int):
        return self.rows if int(arch) in DMMA_ARCHS else ()

    def applies(self, call: Call, arch: int, options) -> bool:
        return dmma_bucket(call, arch, options) is not None

    def plan(self, call: Call, arch: int, options):
        return (self.make_row(call.dtype, dmma_bucket(call, arch, options), bool(call.features)),)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # DmmaFwdTraits::kSmemBytes: Q, K and V tiles of doubles (float32 inputs, widened
        # on the way in: Q and one K/V buffer).
        return (row.block_m + (2 if row.dtype == "float64" else 1) * row.block_n) * row.head_dim * 8

    def min_ctas_per_sm(self, row) -> int:
        return 2                                                            # DmmaFwdTraits


FWD_DMMA = FwdDmma()
