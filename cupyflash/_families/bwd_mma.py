"""bwd_mma (``cuda_src/bwd_mma.cu``): the tensor-core backward (mma.sync m16n8k16), sm_80 and later.

Where fwd_mma's conditions hold (float16 / bfloat16, ``head_dim == head_dim_v
<= 256``, 16-byte aligned rows of q, k, v and dout; :func:`mma_bucket`):
bwd_simt's delta kernel, then the dK/dV kernel (two launches, dV then dK,
from head dim 160 on) and the dQ kernel -- or, ``deterministic=False``, no dQ
kernel: the launch computing dK adds dQ to a zeroed dq by float atomics.
"""

from __future__ import annotations

from .._arch import TILE_CLASS_ARCH, tile_class
from ._family import DKDV, DQ, FEATURES, Call, Family, Sizes
from .bwd_simt import BWD_SIMT
from .fwd_mma import MMA_DTYPES, MMA_HEAD_DIMS, mma_bucket, whole_blocks

__all__ = ["BWD_MMA", "BWD_GRAD_DV", "BWD_GRAD_DK", "BWD_GRAD_DQ_ATOMIC"]

# The dK/dV kernels' kGrads: which gradients one launch computes (bwd_mma.cu,
# bwd_wgmma.cu); BWD_GRAD_DQ_ATOMIC (with BWD_GRAD_DK, deterministic=False): dQ
# by float atomics.
BWD_GRAD_DV, BWD_GRAD_DK, BWD_GRAD_DQ_ATOMIC = 1, 2, 4


def mma_bwd_shared_bytes(head_dim: int, own: int, streamed: int, needs_v: bool, stages: int,
                         atomic_dq: bool = False) -> int:
    """``MmaBwdTraits::kSmemBytes`` (bwd_mma.cu): the own tiles (one or two), then per
    stage two streamed tiles of 16-bit elements and two floats per streamed row, then
    with ``atomic_dq`` one own x streamed tile of dS."""
    return ((2 if needs_v else 1) * own * head_dim * 2
            + stages * (2 * streamed * head_dim * 2 + 2 * streamed * 4)
            + (own * streamed * 2 if atomic_dq else 0))


class BwdMma(Family):
    name = "bwd_mma"
    entry = "bwd_mma.cu"
    takes = frozenset(FEATURES)   # score.cuh: probability_epilogue, gradient_epilogue
    direction = "backward"
    own = 64
    warps = 4
    # 4 warps, each owning 16 rows (one m16 tile) of the CTA's own block: dK/dV
    # owns 64 keys and streams query blocks, dQ owns 64 query rows and streams key
    # blocks.  Per head dim: (streamed rows, dK and dV in one launch[, streamed keys
    # of the dQ kernel when they differ]).  Registers from the static report (sm_80
    # / sm_90), all without spills; shared memory = (own tiles + 2 streamed) x d x 2
    # bytes (+ 2 floats per streamed row).  Measured on an H200 for d = 128
    # (benchmarks/results/2026-11-30-nvidia-h200-tuning.md); the other rows are
    # predictions from the static report.  From 160 on, dK and dV accumulators
    # together (2 x 2d/8 floats per lane on top of S and dP) spill at 255 registers
    # (160: 8 bytes on sm_90; 192: 32; 256: over 1 KB): one launch computes dV, a
    # second dK (S recomputed: 8 block products per block pair instead of 7).
    tiles = {
        # registers sm_80 / sm_90 (float16 and bfloat16 alike, NVRTC 13.5), shared memory
        # sm_80 / sm_90 with each class's stages (docs/performance.md has every kernel)
        32: (64, True),     # dK/dV 201 / 232, 25 KB; dQ 150 / 159, 25 KB
        64: (64, True),     # dK/dV 254 / 254, 49 KB; dQ 205 / 206, 49 KB
        96: (32, True),     # dK/dV 223 / 244, 48.5 KB; dQ 192 / 199, 48.5 KB
        128: (32, True),    # dK/dV 254 / 255, 64.5 KB; dQ 195 / 197, 64.5 KB.  H200: 161 TFLOP/s; 64 streamed
                            # rows 190, but its dK/dV kernel spills (16 B NVRTC 13.5, 4 B 13.0)
        160: (32, False),   # dV 208 / 208, 60.5 KB; dK 219 / 231, 80.5 KB; dQ 219 / 225, 80.5 KB
        192: (32, False),   # dV 218 / 232, 72.5 KB; dK 226 / 250, 72 / 96.5 KB; dQ 224 / 235, 72 / 96.5 KB
        224: (32, False),   # dV 228 / 243, 56 / 84.5 KB; dK 254 / 253, 84 KB; dQ 249 / 246, 84 KB: 1 CTA/SM
                            # on sm_80 (2 on sm_90)
        256: (32, False),   # dV 246 / 254, 64 / 96.5 KB; dK 254 / 255, 96 KB; dQ 248 / 254, 96 KB: 1 CTA/SM on
                            # sm_80 (2 on sm_90)
    }
    # Streamed-tile stages per GPU class: two (the next block copied while this one
    # is computed) wherever two CTAs still fit on one SM -- the shared memory per CTA
    # below (per SM: 164 KB sm80, 100 KB sm86, 228 KB sm90, less 1 KB per CTA) --
    # else one.  sm90 stops at 100 KB: the d = 224 dK kernel with two stages (112.5
    # KB) spills 4 bytes under NVRTC 13.0.
    two_cta_shared = {"sm80": 81 * 1024, "sm86": 49 * 1024, "sm90": 100 * 1024}
    # A call with score features at d = 128 launches dV and dK apart: together, the dK/dV
    # kernel spilled 4-12 B on sm_90 with softcap, ALiBi or a softcap by hand, and 4 B
    # with two biases and a mask (NVRTC 13.5; apart 168-246 registers, no spills;
    # benchmarks/results/terms/).
    feature_tiles = {128: (32, False)}

    def streamed(self, head_dim: int) -> tuple[int, int]:
        """Rows per streamed block of the dK/dV kernels (query rows) and of the dQ kernel
        (keys) at compile-time ``head_dim``."""
        streamed, _, *dq_streamed = self.tiles[head_dim]
        return streamed, (dq_streamed[0] if dq_streamed else streamed)

    def kernels(self, dtype: str, head_dim: int, arch: int, deterministic: bool = True,
                whole_q: bool = False, whole_k: bool = False, features: bool = False) -> tuple:
        """The dK/dV launches (or dV, then dK) and the dQ kernel for ``dtype`` and ``head_dim``
        on ``arch``, in launch order.  Not ``deterministic``: the launch computing dK also
        adds dQ by float atomics and there is no dQ kernel -- except at d = 256, whose
        atomic dK kernel would pass the 99 KB of shared memory every row keeps within.
        ``whole_q`` / ``whole_k``: the dK/dV / dQ kernels' whole-stream instantiations
        (``kWholeStream``: streamed copies without bounds).  ``features``: a call's with
        score features (:attr:`feature_tiles`)."""
        cls = tile_class(arch)
        if cls is None or head_dim not in self.tiles:
            raise ValueError(f"bwd_mma has no kernel for head_dim={head_dim} on sm_{arch}")
        own, warps = self.own, self.warps
        streamed, together, *_ = self.tile(head_dim, features)
        streamed_dq = self.streamed(head_dim)[1]

        def stages(rows: int, needs_v: bool, atomic_dq: bool = False) -> int:
            two = mma_bwd_shared_bytes(head_dim, own, rows, needs_v, 2, atomic_dq)
            return 2 if two <= self.two_cta_shared[cls] else 1

        if not deterministic and mma_bwd_shared_bytes(head_dim, own, streamed, True, 1, True) > 99 * 1024:
            deterministic = True   # d = 256: the dS tile would pass sm_86/89's 99 KB; the dQ kernel runs
        common = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps)
        rows = []
        for grads in ([BWD_GRAD_DV | BWD_GRAD_DK] if together else [BWD_GRAD_DV, BWD_GRAD_DK]):
            if grads & BWD_GRAD_DK and not deterministic:
                grads |= BWD_GRAD_DQ_ATOMIC
            n = stages(streamed, bool(grads & BWD_GRAD_DK), bool(grads & BWD_GRAD_DQ_ATOMIC))
            rows.append(self.row("bwd_mma_dkdv_kernel", dtype, head_dim, own, streamed, warps, grads, n,
                                 *((True,) if whole_q else ()), role=DKDV, block_m=streamed, block_n=own,
                                 kv_stages=n, whole_kv=whole_q, grads=grads, **common))
        if deterministic:
            n = stages(streamed_dq, True)
            rows.append(self.row("bwd_mma_dq_kernel", dtype, head_dim, own, streamed_dq, warps, n,
                                 *((True,) if whole_k else ()), role=DQ, block_m=own, block_n=streamed_dq,
                                 kv_stages=n, whole_kv=whole_k, **common))
        return tuple(rows)

    def build_rows(self):
        return [r for dtype in MMA_DTYPES for d in self.tiles for arch in TILE_CLASS_ARCH.values()
                for deterministic in (True, False) for whole in (False, True) for features in (False, True)
                for r in self.kernels(dtype, d, arch, deterministic, whole, whole, features)]

    def launchable(self, arch: int):
        if tile_class(arch) is None:
            return ()
        return tuple(dict.fromkeys(r for dtype in MMA_DTYPES for d in MMA_HEAD_DIMS
                                   for deterministic in (True, False) for whole in (False, True)
                                   for features in (False, True)
                                   for r in self.kernels(dtype, d, arch, deterministic, whole, whole, features)))

    def applies(self, call: Call, arch: int, options) -> bool:
        return mma_bucket(call, arch) is not None

    def plan(self, call: Call, arch: int, options):
        bucket = mma_bucket(call, arch)
        streamed, streamed_dq = self.streamed(bucket)
        return (BWD_SIMT.delta(call),) + self.kernels(
            call.dtype, bucket, arch, call.deterministic,
            whole_q=whole_blocks(call.seqlen_q, streamed, call.head_dim, bucket, options),
            whole_k=whole_blocks(call.seqlen_k, streamed_dq, call.head_dim, bucket, options),
            features=bool(call.features))

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # MmaBwdTraits::kSmemBytes (V only when the dK/dV kernel computes dK) and the dS
        # tile of deterministic=False's atomic dQ
        if row.role == DKDV:
            return mma_bwd_shared_bytes(row.head_dim, row.block_n, row.block_m, bool(row.grads & BWD_GRAD_DK),
                                        row.kv_stages, row.atomic_dq)
        return mma_bwd_shared_bytes(row.head_dim, row.block_m, row.block_n, True, row.kv_stages)


BWD_MMA = BwdMma()
