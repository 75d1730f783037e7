"""bwd_wgmma (``cuda_src/bwd_wgmma.cu``): the backward on Hopper's warpgroup mma, sm_90a.

Where bwd_mma would run on a 9.0 device in a head dim of :attr:`BwdWgmma.tiles`
and :attr:`KernelOptions.wgmma <cupyflash._options.KernelOptions.wgmma>` allows
it (the forward's switch): bwd_simt's delta kernel, the dK/dV kernel (dV then
dK from head dim 192 on) and the dQ kernel -- or, not deterministic, up to
head dim 128 and with 8-byte aligned dq rows, the dK/dV kernel that adds dQ by
atomics (with :attr:`KernelOptions.async_dq <cupyflash._options.KernelOptions.async_dq>`
and 16-byte aligned dq rows: by bulk asynchronous reductions, ``kGradDQBulk``).  With
``async_dq``, deterministic and without score features, the bulk-dQ dK/dV kernel
adds in key-block order instead (``kGradDQOrdered``: blocks take turns through a
semaphore per query block) and no dQ kernel runs either.
With :attr:`KernelOptions.decoupled <cupyflash._options.KernelOptions.decoupled>`,
deterministic calls without score features at d = 64 and 128 get the warp-specialised
dK/dV kernel (:attr:`BwdWgmma.decoupled_tiles`) before the dQ kernel (the ordered dQ,
with both switches, takes precedence).
"""

from __future__ import annotations

from .._arch import WGMMA_ARCH
from ._family import DKDV, DQ, FEATURES, MOD_FEATURES, Call, Family, Sizes
from .bwd_mma import BWD_GRAD_DK, BWD_GRAD_DQ_ATOMIC, BWD_GRAD_DV
from .bwd_simt import BWD_SIMT
from .fwd_mma import MMA_DTYPES, mma_bucket, whole_blocks

__all__ = ["BWD_WGMMA", "BWD_GRAD_DQ_BULK", "BWD_GRAD_DQ_ORDERED"]

# kGradDQBulk (bwd_blocks.cuh), with BWD_GRAD_DQ_ATOMIC: the dK/dV kernel stages its
# dQ share in shared memory and adds it by bulk asynchronous reductions.
BWD_GRAD_DQ_BULK = 8
# kGradDQOrdered, with BWD_GRAD_DQ_BULK (deterministic): the key blocks add their dQ
# shares in key-block order, taking turns through BwdParams::dq_turns.
BWD_GRAD_DQ_ORDERED = 16


def wgmma_bwd_shared_bytes(head_dim: int, own: int, streamed: int, needs_v: bool, atomic_dq: bool,
                           bulk_dq: bool = False) -> int:
    """``WgmmaBwdTraits::kSmemBytes`` (bwd_wgmma.cu): the own tiles (two with ``needs_v``),
    two stages of two streamed tiles and of two floats per streamed row, the dS^T tile
    with ``atomic_dq``, the float dQ tile (rows padded by 4 floats) with ``bulk_dq``,
    and 1 KB to align the start to 1024 bytes."""
    return ((2 if needs_v else 1) * own * head_dim * 2 + 2 * 2 * streamed * head_dim * 2
            + 2 * 2 * streamed * 4 + (own * streamed * 2 if atomic_dq else 0)
            + (streamed * (head_dim + 4) * 4 if bulk_dq else 0) + 1024)


# The decoupled dK/dV kernel's barriers (DkdvStageBarriers, bwd_wgmma.cu): a full and an
# empty mbarrier per stage, after the statistics.
DKDV_BARRIER_BYTES = 4 * 8


class BwdWgmma(Family):
    name = "bwd_wgmma"
    entry = "bwd_wgmma.cu"
    takes = frozenset(FEATURES)   # score.cuh: probability_epilogue, gradient_epilogue
    direction = "backward"
    arch_specific = {"sm_90": "sm_90a"}
    # Per head dim: (the dK/dV launches as (kGrads, streamed query rows), warpgroups,
    # streamed keys of the dQ kernel).  A CTA owns 64 rows per warpgroup (keys in
    # dK/dV, query rows in dQ), one CTA per SM; the streamed tiles are
    # double-buffered.  Per thread in dK/dV: dK and dV d / 4 floats each, S^T and
    # dP^T streamed / 4.  From 192 on, dK and dV together would take 2 x 48+
    # floats on top of S^T and dP^T, so dV and dK are launched apart (as bwd_mma
    # does from 160), and d = 256 streams 32 rows in its dK and dQ kernels, whose
    # own tiles alone are 128 KB.  deterministic=False adds dQ by atomics in the
    # dK launch where a warpgroup's dQ slice is whole 64-column pages (d <= 128);
    # 192 and 256 always run the dQ kernel.  Registers from the static report
    # (NVRTC 13.5, sm_90a), no spills; not yet timed on a GPU (FlashAttention-3's
    # Hopper backward uses the same 128-key x 64-query (d = 128) and 128 x 128
    # (d = 64) blocks).
    tiles = {
        64: (((BWD_GRAD_DV | BWD_GRAD_DK, 128),), 2, 128),   # dK/dV 255 regs, 99 KB (131 KB atomic); dQ 224, 99 KB
        128: (((BWD_GRAD_DV | BWD_GRAD_DK, 64),), 2, 128),   # dK/dV 255 regs, 130 KB (146 KB atomic); dQ 255, 195 KB
        192: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 64)), 2, 64),    # dV 254 regs, 146 KB; dK 254, 194 KB; dQ 215, 194 KB
        256: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 32)), 2, 32),    # dV 255 regs, 194 KB; dK 254, 194 KB; dQ 210, 194 KB
    }
    # A call with score features at d = 128 (NVRTC 13.5, sm_90a; benchmarks/results/terms/):
    # the dQ kernel streams 64 keys (with 128 it spilled 12-20 B), dQ is never added by
    # atomics (those dK launches spilled 4-272 B), and with a modification (softcap,
    # ALiBi, score_mod, mask_mod) dV and dK are launched apart (together they spilled
    # 4-84 B; apart none of issue 29's eleven examples spills: 183-255 registers).
    feature_tiles = {128: (((BWD_GRAD_DV | BWD_GRAD_DK, 64),), 2, 64)}
    mod_tiles = {128: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 64)), 2, 64)}
    # The ordered dQ (deterministic with async_dq): at d = 128 the fused dK/dV row with it
    # spilled 8-20 B under NVRTC 13.5 and 13.0 in every arrangement of the turns tried
    # (lane 0 or every lane waiting, one semaphore per lane, the turn's bound computed
    # once or where used, one lane sending every row); with dV launched apart, the dK
    # launch that adds dQ in order takes 255 registers and does not spill (dV: 228).
    ordered_tiles = {128: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 64)), 2, 128)}
    # Streamed query rows of the decoupled (warp-specialised) dK/dV kernel, KernelOptions.decoupled:
    # a producer warpgroup copies Q, dO and the statistics (384 threads; setmaxnreg leaves the
    # producer 24 registers, the two consumer warpgroups 240), for deterministic calls without
    # score features.  The consumers' 240 do not hold the coupled tiles (NVRTC 13.5, sm_90a, at
    # 24/240: d = 64 128 x 128 spilled 48 B, every wgmma serialised; d = 128 128 x 64 36 B); half
    # the streamed rows spill nothing at 24/240, 32/232 or 40/232.  Not yet timed on a GPU.
    decoupled_tiles = {64: 64, 128: 32}

    def _atomic_dq(self, head_dim: int, streamed: int, groups: int) -> bool:
        """Whether a dK launch streaming ``streamed`` rows can add dQ by atomics: each
        warpgroup one m64 slice of the block's queries and a head-dim slice of whole
        64-column pages, and the dS^T tile within sm_90's 227 KB."""
        if streamed % 64 or groups % (streamed // 64):
            return False
        cols = head_dim // (groups // (streamed // 64))
        return cols % 64 == 0 and wgmma_bwd_shared_bytes(head_dim, 64 * groups, streamed, True, True) <= 227 * 1024

    def _bulk_dq(self, head_dim: int, streamed: int, groups: int) -> bool:
        """Whether an atomic-dQ launch also has room for the float dQ tile of bulk dQ."""
        return wgmma_bwd_shared_bytes(head_dim, 64 * groups, streamed, True, True, True) <= 227 * 1024

    def dq_keys(self, head_dim: int, features: frozenset = frozenset()) -> int:
        """Keys per block of the dQ kernel at compile-time ``head_dim`` (for a call with
        score ``features``)."""
        return self.tile(head_dim, bool(features))[2]

    def kernels(self, dtype: str, head_dim: int, deterministic: bool = True, whole_k: bool = False,
                features: frozenset = frozenset(), bulk_dq: bool = False, decoupled: bool = False) -> tuple:
        """The dK/dV launches (or dV, then dK), then dQ -- or, not ``deterministic`` where
        the dK launch can (:meth:`_atomic_dq`), no dQ kernel.  ``whole_k``: the dQ
        kernel's whole-stream instantiation (``kWholeStream``).  The dK/dV kernels have
        none: at 255 registers, ptxas spent more instructions without their bounds than
        with them.  ``features``: the call's score features (:attr:`feature_tiles`,
        :attr:`mod_tiles`).  ``bulk_dq``: atomic dQ by bulk reductions where the tile fits;
        ``deterministic`` too and no ``features``: the same kernel adding in key-block
        order (``BWD_GRAD_DQ_ORDERED``), no dQ kernel.  ``decoupled``: the warp-specialised
        dK/dV kernel (:attr:`decoupled_tiles`; a deterministic call without score
        features), then the dQ kernel."""
        if head_dim not in self.tiles:
            raise ValueError(f"bwd_wgmma has no kernel for head_dim={head_dim}")
        if decoupled:
            if not deterministic or features or head_dim not in self.decoupled_tiles:
                raise ValueError(f"bwd_wgmma has no decoupled instantiation for deterministic={deterministic}, "
                                 f"features={sorted(features)}, head_dim={head_dim}")
            launches, groups, streamed_dq = self.tiles[head_dim]
            grads, streamed = BWD_GRAD_DV | BWD_GRAD_DK, self.decoupled_tiles[head_dim]
            common = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, kv_stages=2)
            return (self.row("bwd_wgmma_dkdv_kernel", dtype, head_dim, 64 * groups, streamed, groups, grads, True,
                             role=DKDV, block_m=streamed, block_n=64 * groups, grads=grads, decoupled=True,
                             threads=128 * groups + 128, **common),
                    self.row("bwd_wgmma_dq_kernel", dtype, head_dim, 64 * groups, streamed_dq, groups,
                             *((True,) if whole_k else ()), role=DQ, block_m=64 * groups, block_n=streamed_dq,
                             whole_kv=whole_k, threads=128 * groups, **common))
        modified = bool(features & set(MOD_FEATURES))
        launches, groups, streamed_dq = (self.mod_tiles[head_dim] if modified and head_dim in self.mod_tiles
                                         else self.tile(head_dim, bool(features)))
        deterministic = deterministic or (bool(features) and head_dim in self.feature_tiles)
        dq_launches = [streamed for grads, streamed in launches if grads & BWD_GRAD_DK]
        ordered = (deterministic and bulk_dq and not features
                   and all(self._atomic_dq(head_dim, s, groups) and self._bulk_dq(head_dim, s, groups)
                           for s in dq_launches))
        if ordered and head_dim in self.ordered_tiles:
            launches, groups, streamed_dq = self.ordered_tiles[head_dim]
        own = 64 * groups
        atomic = ordered or (not deterministic and all(self._atomic_dq(head_dim, s, groups) for s in dq_launches))
        common = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=128 * groups, kv_stages=2)
        rows = []
        for grads, streamed in launches:
            if atomic and grads & BWD_GRAD_DK:
                grads |= BWD_GRAD_DQ_ATOMIC
                if bulk_dq and self._bulk_dq(head_dim, streamed, groups):
                    grads |= BWD_GRAD_DQ_BULK | (BWD_GRAD_DQ_ORDERED if ordered else 0)
            rows.append(self.row("bwd_wgmma_dkdv_kernel", dtype, head_dim, own, streamed, groups, grads,
                                 role=DKDV, block_m=streamed, block_n=own, grads=grads, **common))
        if not atomic:
            rows.append(self.row("bwd_wgmma_dq_kernel", dtype, head_dim, own, streamed_dq, groups,
                                 *((True,) if whole_k else ()), role=DQ, block_m=own, block_n=streamed_dq,
                                 whole_kv=whole_k, **common))
        return tuple(rows)

    def build_rows(self):
        rows = [r for dtype in MMA_DTYPES for d in self.tiles for deterministic in (True, False)
                for whole in (False, True) for features in ((), ("mask",), ("score_mod",))
                for r in self.kernels(dtype, d, deterministic, whole, frozenset(features))]
        # asynchronous dQ (opt-in): the atomic-dQ launches without score features, and
        # their ordered (deterministic) twins
        return (rows + [r for dtype in MMA_DTYPES for d in self.tiles for deterministic in (False, True)
                        for r in self.kernels(dtype, d, deterministic, bulk_dq=True) if r.bulk_dq]
                # the decoupled dK/dV kernels (opt-in)
                + [r for dtype in MMA_DTYPES for d in self.decoupled_tiles
                   for r in self.kernels(dtype, d, decoupled=True) if r.decoupled])

    def applies(self, call: Call, arch: int, options) -> bool:
        return options.wgmma and int(arch) == WGMMA_ARCH and mma_bucket(call, arch) in self.tiles

    def plan(self, call: Call, arch: int, options):
        bucket = mma_bucket(call, arch)
        deterministic = call.deterministic or not call.dq_aligned
        bulk_dq = options.async_dq and call.dq_aligned_16
        decoupled = (options.decoupled and deterministic and not call.features
                     and bucket in self.decoupled_tiles and not bulk_dq)   # (the ordered dQ first)
        return (BWD_SIMT.delta(call),) + self.kernels(
            call.dtype, bucket, deterministic,
            whole_k=whole_blocks(call.seqlen_k, self.dq_keys(bucket, call.features), call.head_dim, bucket, options),
            features=call.features, bulk_dq=bulk_dq, decoupled=decoupled)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # WgmmaBwdTraits::kSmemBytes; the dK/dV kernel needs V only for dK
        if row.role == DKDV:   # WgmmaBwdLaunch::kSmemBytes: the decoupled kernel's barriers after the rest
            return (wgmma_bwd_shared_bytes(row.head_dim, row.block_n, row.block_m, bool(row.grads & BWD_GRAD_DK),
                                           row.atomic_dq, row.bulk_dq)
                    + (DKDV_BARRIER_BYTES if row.decoupled else 0))
        return wgmma_bwd_shared_bytes(row.head_dim, row.block_m, row.block_n, True, False)


BWD_WGMMA = BwdWgmma()
