"""bwd_tf32 (``cuda_src/bwd_tf32.cu``): the float32 backward on the TF32 tensor cores.

Where the caller allows TF32 (``precision="tf32"`` / ``"tf32x3"``) and
fwd_tf32's conditions hold (:func:`~cupyflash._families.fwd_tf32.tf32_bucket`;
any strides): bwd_simt's delta kernel, then the dK/dV and dQ kernels, whatever
``deterministic`` says.  It takes precedence over bwd_dmma.
"""

from __future__ import annotations

from ._family import DKDV, DQ, FEATURES, Call, Family, Sizes
from .bwd_simt import BWD_SIMT
from .fwd_tf32 import TF32_PASSES, tf32_bucket

__all__ = ["BWD_TF32"]


class BwdTf32(Family):
    name = "bwd_tf32"
    entry = "bwd_tf32.cu"
    takes = frozenset(FEATURES)   # score.cuh: probability_epilogue, gradient_epilogue
    direction = "backward"
    # Per head dim (own rows, streamed rows, warps) of both kernels -- dK/dV owns keys
    # and streams query rows, dQ owns query rows and streams keys; 4 warps of one m16
    # tile each.  Per lane: the own rows' gradients (dK and dV, or dQ) 2 x d / 4
    # floats, S and dP streamed / 4 each.  Shared memory (2 own + 2 x 2 streamed
    # tiles) x d x 4 bytes (cp.async, two stages).  Registers from the static report
    # (NVRTC 13.5, sm_80 / sm_90, tf32 / tf32x3), no spills (nor under NVRTC 13.0 and
    # 12.0); not yet timed on a GPU.
    tiles = {
        32: (64, 64, 4),    # 48 KB
        64: (64, 32, 4),    # 64 KB
        128: (64, 16, 4),   # 96 KB: two CTAs per SM on sm_90, one on sm_80 (32 streamed rows: 128 KB)
    }
    # A call with score features (bias, mask, modifications) at d = 128 streams 8 rows:
    # with 16, tf32x3's dK/dV kernel spills 24-60 B with a score_mod and 40 B with two
    # biases and a mask on sm_80 (8: 223-255 registers, no spills; 80 KB; NVRTC 13.5,
    # benchmarks/results/terms/).
    feature_tiles = {128: (64, 8, 4)}

    def kernels(self, head_dim: int, passes: int, features: bool = False) -> tuple:
        """``bwd_tf32_dkdv_kernel`` and ``bwd_tf32_dq_kernel`` ``<head_dim, own, streamed,
        warps, passes>``, in launch order (``features``: a call's with score features)."""
        if head_dim not in self.tiles:
            raise ValueError(f"bwd_tf32 has no kernel for head_dim={head_dim}")
        own, streamed, warps = self.tile(head_dim, features)
        common = dict(dtype="float32", head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps, kv_stages=2,
                      passes=passes)
        args = (head_dim, own, streamed, warps, passes)
        return (self.row("bwd_tf32_dkdv_kernel", *args, role=DKDV, block_m=streamed, block_n=own, grads=3, **common),
                self.row("bwd_tf32_dq_kernel", *args, role=DQ, block_m=own, block_n=streamed, **common))

    def build_rows(self):
        return [r for passes in sorted(set(TF32_PASSES.values())) for d in self.tiles for features in (False, True)
                for r in self.kernels(d, passes, features)]

    def launchable(self, arch: int):
        return self.rows if int(arch) >= 80 else ()

    def applies(self, call: Call, arch: int, options) -> bool:
        return tf32_bucket(call, arch) is not None

    def plan(self, call: Call, arch: int, options):
        return (BWD_SIMT.delta(call),) + self.kernels(tf32_bucket(call, arch), TF32_PASSES[call.precision],
                                                      bool(call.features))

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # Tf32BwdTraits::kSmemBytes: two own tiles and two stages of two streamed tiles of
        # floats; the same shape for both kernels.
        own, streamed = (row.block_n, row.block_m) if row.role == DKDV else (row.block_m, row.block_n)
        return (2 * own + 4 * streamed) * row.head_dim * 4


BWD_TF32 = BwdTf32()
