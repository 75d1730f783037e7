"""fwd_wgmma (``cuda_src/fwd_wgmma.cu``): the forward on Hopper's warpgroup mma, sm_90a.

Where fwd_mma would run on a 9.0 device in a head dim of
:data:`WGMMA_HEAD_DIMS` and :attr:`KernelOptions.wgmma
<cupyflash._options.KernelOptions.wgmma>` allows it (opt-in until the GPU tier
has checked it).  Built for the architecture-specific target sm_90a only.
"""

from __future__ import annotations

from .._arch import WGMMA_ARCH
from ._family import FEATURES, FORWARD, Call, Family, Sizes
from .fwd_mma import MMA_DTYPES, folds_scale, mma_bucket, whole_blocks

__all__ = ["FWD_WGMMA", "WGMMA_HEAD_DIMS"]

# Head dims with wgmma kernels: whole 64-column pages of the 128-byte-swizzled
# tiles.  The tensor-core head dims in between (32, 96, 160, 224) keep fwd_mma:
# padding them to the next page would add 33-100 % of work.
WGMMA_HEAD_DIMS = (64, 128, 192, 256)


class FwdWgmma(Family):
    name = "fwd_wgmma"
    entry = "fwd_wgmma.cu"
    split_kv = True
    takes = frozenset(FEATURES)   # score.cuh's terms and modifications, through score_epilogue
    # wgmma and the "a" target run on 9.0 devices only (H100, H200, GH200).
    arch_specific = {"sm_90": "sm_90a"}
    # (block_n, warpgroups, lazy_rescale) per head dim.  A CTA owns 64 query rows
    # per warpgroup (each warp 16, the rows of its m64 slice); K/V double-buffered,
    # V one block behind K (the P V product of block n - 1 runs behind S of block n).
    # Per thread: S block_n / 2 floats, O d / 2 floats, P block_n / 4 registers for
    # the block in flight and as many for the next.  Shared memory (Q + 2 x (K + V))
    # x 2 bytes + 1 KB of alignment slack.  Registers from the static report (NVRTC
    # 13.5, sm_90a), no spills; one CTA of 8 warps per SM everywhere (registers).
    # Not yet timed on a GPU: benchmarks/gpu_check.sh times each row against
    # fwd_mma, benchmarks/gpu_variants.py the alternatives.
    tiles = {
        64: (128, 2, True),     # 184 regs, 81 KB (block_n 64: 127 regs, two CTAs per SM -- a variant to time)
        128: (128, 2, True),    # 216 regs, 161 KB: FA3's 128 x 128 non-causal tile, without its producer
                                # warpgroup (block_n 192 spills; three warpgroups do not fit the registers)
        192: (64, 2, True),     # 194 regs, 145 KB
        256: (64, 2, True),     # 222 regs, 193 KB (O is 128 floats per thread)
    }
    # A call with score features at d = 128 takes 64-key blocks: with 128, the kernel
    # spilled 16-116 B with a relative-position table or document ids (NVRTC 13.5,
    # sm_90a; 64 keys: no spills with any of issue 29's examples, nor with two biases
    # and a mask; benchmarks/results/terms/).
    feature_tiles = {128: (64, 2, True)}
    # Head dims with a decoupled (warp-specialised) instantiation, KernelOptions.decoupled:
    # the tiles above plus a producer warpgroup (384 threads; setmaxnreg leaves the
    # consumers 232 registers, the producer 40), for calls without split-KV, score
    # features or a paged cache.  No spills (NVRTC 13.5 and 13.0, sm_90a).
    decoupled_head_dims = (64, 128)

    def make_row(self, dtype: str, head_dim: int, split: bool = False, whole_kv: bool = False,
                 features: bool = False, decoupled: bool = False):
        """``fwd_wgmma_kernel<T, head_dim, block_n, warpgroups, lazy_rescale[, split[, whole_kv[,
        decoupled]]]>``."""
        if split and whole_kv:
            raise ValueError("fwd_wgmma has no split-KV instantiation with whole K/V blocks")
        if decoupled and (split or features or head_dim not in self.decoupled_head_dims):
            raise ValueError(f"fwd_wgmma has no decoupled instantiation for split={split}, "
                             f"features={features}, head_dim={head_dim}")
        block_n, groups, lazy = self.tile(head_dim, features)
        tail = ((False, whole_kv, True) if decoupled else (True,) if split else (False, True) if whole_kv
                else ())
        return self.row("fwd_wgmma_kernel", dtype, head_dim, block_n, groups, lazy, *tail, role=FORWARD,
                        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim,
                        threads=128 * groups + (128 if decoupled else 0),
                        block_m=64 * groups, block_n=block_n, kv_stages=2, lazy_rescale=lazy, split=split,
                        whole_kv=whole_kv, decoupled=decoupled)

    def build_rows(self):
        return ([self.make_row(dtype, d, split, whole_kv, features) for features in (False, True)
                 for split, whole_kv in ((False, False), (True, False), (False, True))
                 for dtype in MMA_DTYPES for d in self.tiles]
                + [self.make_row(dtype, d, whole_kv=whole_kv, decoupled=True) for whole_kv in (False, True)
                   for dtype in MMA_DTYPES for d in self.decoupled_head_dims])

    def applies(self, call: Call, arch: int, options) -> bool:
        return (options.wgmma and int(arch) == WGMMA_ARCH and folds_scale(call.scale)
                and mma_bucket(call, arch) in self.tiles)

    def plan(self, call: Call, arch: int, options):
        bucket = mma_bucket(call, arch)
        features = bool(call.features)
        whole_kv = not call.split and whole_blocks(call.seqlen_k, self.tile(bucket, features)[0], call.head_dim,
                                                   bucket, options)
        decoupled = (options.decoupled and options.timing is None and bucket in self.decoupled_head_dims
                     and not (call.split or features or call.paged))
        return (self.make_row(call.dtype, bucket, call.split, whole_kv, features, decoupled),)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # WgmmaFwdLaunch::kSmemBytes: Q, then 2 x (K, V), 16-bit elements, and 1 KB
        # to align the tiles to 1024 bytes; the decoupled kernel's 8 mbarriers after them.
        return ((row.block_m + 2 * row.kv_stages * row.block_n) * row.head_dim * 2 + 1024
                + (64 if row.decoupled else 0))


FWD_WGMMA = FwdWgmma()
