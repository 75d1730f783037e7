"""fwd_mma (``cuda_src/fwd_mma.cu``): the tensor-core forward (mma.sync m16n8k16), sm_80 and later.

float16 / bfloat16 with ``head_dim == head_dim_v <= 256``, 16-byte aligned rows
and a scale the kernel can fold into its exponent (:func:`folds_scale`); the
head dim runs in the next of :data:`MMA_HEAD_DIMS` up, zero-padded inside the
kernel.  Each instantiation also exists as a whole-KV one (``kWholeKV``: K/V
copies without bounds, for Lk a multiple of ``block_n`` and d the bucket) and
a split-KV one (``kSplit``).
"""

from __future__ import annotations

import math

import numpy as np

from .._arch import TILE_CLASS_ARCH, tile_class
from ._family import FEATURES, FORWARD, Call, Family, Sizes, smallest_fit

__all__ = ["FWD_MMA", "MMA_HEAD_DIMS", "MMA_DTYPES", "mma_bucket", "folds_scale", "whole_blocks"]

# Compile-time head dims; a run-time d <= 256 runs in the next one up, zero-padded
# inside the kernel.  fwd_mma needs dv == d (fwd_simt runs the others).
MMA_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MMA_DTYPES = ("float16", "bfloat16")

# The scale as fwd_mma, fwd_wgmma and fwd_tf32 fold it into the exponent: a float32
# ``scale * log2(e)`` multiplying the unscaled scores, masked ones (-inf) included.
# It must be a positive normal float32: a scale below about 8e-39 is 0 there, or a
# subnormal that the kernels' flush-to-zero (-ftz=true) makes 0, and -inf * 0 is
# NaN.  Such scales run fwd_simt, which scales before it masks.
_LOG2E = math.log2(math.e)   # as the params derive scale_log2
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def folds_scale(scale: float) -> bool:
    """Whether the tensor-core forward kernels can take ``scale`` (see above)."""
    return scale * _LOG2E >= _FLOAT32_TINY


def mma_bucket(call: Call, arch: int) -> int | None:
    """The compile-time head dim the mma.sync tensor-core kernels (fwd_mma, bwd_mma) run
    ``call`` in -- the smallest of :data:`MMA_HEAD_DIMS` holding ``head_dim`` -- or None
    where they do not apply: ``arch < 80``, not float16/bfloat16, ``head_dim !=
    head_dim_v`` or above 256, rows not 16-byte aligned."""
    if (call.aligned and arch >= 80 and call.dtype in MMA_DTYPES and call.head_dim == call.head_dim_v):
        return smallest_fit(MMA_HEAD_DIMS, call.head_dim)
    return None


def whole_blocks(seqlen: int | None, block: int, head_dim: int, bucket: int, options) -> bool:
    """Whether every streamed block of ``seqlen`` rows is complete and the head dim fills
    its bucket -- the condition of the whole-KV (whole-stream) instantiations, copies
    without bounds -- and ``options.whole_blocks`` allows them.  An unknown length (None)
    never qualifies."""
    return seqlen is not None and int(seqlen) % block == 0 and head_dim == bucket and options.whole_blocks


class FwdMma(Family):
    name = "fwd_mma"
    entry = "fwd_mma.cu"
    split_kv = True
    takes = frozenset(FEATURES)   # score.cuh's terms and modifications, through score_epilogue

    # (block_m, block_n, warps, kv_stages, lazy_rescale) per architecture class
    # and head dim; each warp owns block_m / warps query rows (16 per m16 tile),
    # kv_stages 2 = K/V double buffer, 1 = FA2's single K and V buffers (less
    # shared memory); lazy_rescale: the output is rescaled only on blocks where a
    # row max of the warp grows past the reference by 2^8 (softmax.cuh), which
    # removes d/8 FMUL per row and block from nearly every block -- on wherever
    # it compiles without spills under NVRTC 13.0 and 13.5 and costs no CTA per
    # SM (not timed yet: benchmarks/gpu_variants.py times it both ways).
    # Shared memory = (block_m + 2 * kv_stages * block_n) * d * 2 bytes.
    # Registers, spills and occupancy (CTAs/SM x warps) from the static report
    # (python -m cupyflash kernels --family fwd_mma, NVRTC 13.5; "(227)" = sm_90
    # where it differs), float16 and bfloat16 alike; every row compiles without spills or
    # stack for sm_80, sm_86, sm_89 and sm_90 (tests/test_fwd_mma.py checks).
    # The sm90 rows for d = 64 and 128 are measured on an H200 (sweeps in
    # benchmarks/results/2026-11-30-nvidia-h200-tuning.md); every other row is a
    # prediction by FA2's rule -- two m16 tiles per warp where registers allow
    # (half the ldmatrix traffic per mma of one tile), 8+ resident warps per SM,
    # then the larger key block -- which those sweeps bore out on sm_90.
    # A class takes the archs with its shared memory per SM (mma_arch_class).
    tiles = {
        # A100 / A30 / Orin: 164 KB per SM; 2 CTAs of 4 warps at up to 255 registers.
        "sm80": {
            32: (128, 64, 4, 2, False),   # 168 regs (176), 24 KB: 3 CTAs (registers; sm_90: 2); 128x128: 255 regs, 2.
                                          # The lazy rescale takes 174 registers: 2 CTAs
            64: (128, 64, 4, 2, True),    # 229 regs (227), 48 KB: 2 CTAs (registers); 128x128 spills with 2 stages
            96: (128, 64, 4, 1, True),    # 252 regs (254), 48 KB: 2 CTAs; 2 stages (72 KB) spill 12-20 B
            128: (128, 64, 4, 1, True),   # 255 regs, 64 KB: 2 CTAs (FA2's tile); 2 stages = 96 KB -> 1 CTA here;
                                          # NVRTC 13.0 spills 8 B here (52 without the lazy rescale; 13.5: none)
            160: (64, 64, 4, 1, True),    # 214 regs (231), 60 KB: 2 CTAs; 2 m16 tiles per warp (160 O registers) spill
            192: (64, 64, 4, 1, True),    # 220 regs (228), 72 KB: 2 CTAs
            224: (64, 32, 4, 1, True),    # 229 regs, 56 KB: 2 CTAs; 64x64 (84 KB) fits 1
            256: (64, 32, 4, 1, True),    # 230 regs, 64 KB: 2 CTAs; 64x64 (96 KB) fits 1
        },
        # RTX 30xx/40xx, A10, L4, L40: 100 KB per SM, 99 KB per block; 2 CTAs need <= 49 KB each.
        "sm86": {
            32: (128, 64, 4, 2, False),   # as sm80 (24 KB)
            64: (128, 64, 4, 2, True),    # as sm80 (48 KB: 2 CTAs)
            96: (128, 64, 4, 1, True),    # as sm80 (48 KB: 2 CTAs)
            128: (128, 32, 4, 1, True),   # 247 regs, 48 KB: 2 CTAs (FA2's sm86 tile); 128x64 (64 KB) fits 1
            160: (64, 32, 4, 1, True),    # 205 regs, 40 KB: 2 CTAs
            192: (64, 32, 4, 1, True),    # 200 regs, 48 KB: 2 CTAs
            224: (128, 32, 8, 1, True),   # 229 regs, 84 KB: 1 CTA of 8 warps; 4-warp tiles in 49 KB need block_n 16
            256: (128, 32, 8, 1, True),   # 228 regs, 96 KB: 1 CTA of 8 warps
        },
        # H100 / H200 / B200: 228 KB per SM; 2 CTAs fit up to 113 KB each.  Measured on an
        # H200 (benchmarks/results/2026-11-30-nvidia-h200-tuning.md; bf16, B=2, H=16, L=8192,
        # TFLOP/s non-causal / causal).
        "sm90": {
            32: (128, 64, 4, 2, True),    # as sm80, with the lazy rescale (174 regs: 2 CTAs either way)
            64: (128, 64, 4, 2, True),    # 238 / 183; (64, 128, 4, 2) 228 / 182, (128, 128, 8, 2) 216 / 175
            96: (128, 64, 4, 1, True),    # as sm80
            128: (128, 64, 4, 1, False),  # 293 / 241; (128, 128, 8, 2) 270 / 235; 2 stages spill with NVRTC 13.0,
                                          # so does the lazy rescale (72 B; 13.5: none)
            160: (64, 64, 4, 1, True),    # as sm80
            192: (64, 64, 4, 1, True),    # as sm80
            224: (64, 64, 4, 1, True),    # 250 regs, 84 KB: 2 CTAs; half the key blocks of 64x32
            256: (64, 64, 4, 1, True),    # 250 regs, 96 KB: 2 CTAs (FA2's H100 tile)
        },
    }


    # The split-KV instantiations (kSplit = true, run where cupyflash._launch.num_splits
    # splits the keys): each class's tile, except where the split epilogue spills --
    # d = 128 with 64-key blocks, 20-88 B on every arch (NVRTC 13.5) -- which takes
    # 32-key blocks instead (sm86's tile: 247 / 244 registers on sm_80 / sm_90, no spills).
    split_tiles = {128: (128, 32, 4, 1, True)}
    # A call with score features (bias, mask, modifications) at d = 128, every arch class
    # (not Family.tile: these tiles are per class): the 64-key tiles spill 40-144 B with
    # terms (NVRTC 13.5, sm_80 and sm_90), the 32-key tile none (246 / 250 registers;
    # benchmarks/results/terms/).
    feature_tiles = {128: (128, 32, 4, 1, True)}
    # A call over a paged KV cache at d = 128, every arch class: the table lookups of
    # the 64-key tile's K/V copies spilled 4-8 B on sm_90 (NVRTC 13.5); the 32-key tile
    # (the feature tile, an instantiation already) none (246 / 244 registers sm_90 /
    # sm_80; tools/lengths_report.py --form paged).
    paged_tiles = {128: (128, 32, 4, 1, True)}

    def class_tiles(self, arch: int, split: bool = False) -> dict | None:
        """``{head_dim: (block_m, block_n, warps, kv_stages, lazy_rescale)}`` on ``arch`` (the
        split-KV instantiations' with ``split``); None below sm_80."""
        cls = tile_class(arch)
        if cls is None:
            return None
        tiles = self.tiles[cls]
        return {d: self.split_tiles.get(d, t) for d, t in tiles.items()} if split else dict(tiles)

    def make_row(self, dtype: str, head_dim: int, tile, split: bool = False, whole_kv: bool = False):
        """The instantiation ``fwd_mma_kernel<T, head_dim, block_m, block_n, warps, kv_stages,
        lazy_rescale[, split[, whole_kv]]>`` (the trailing arguments only where set)."""
        if split and whole_kv:
            raise ValueError("fwd_mma has no split-KV instantiation with whole K/V blocks")
        block_m, block_n, warps, stages, lazy = tile
        tail = (True,) if split else (False, True) if whole_kv else ()
        return self.row("fwd_mma_kernel", dtype, head_dim, block_m, block_n, warps, stages, lazy, *tail,
                        role=FORWARD, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps,
                        block_m=block_m, block_n=block_n, kv_stages=stages, lazy_rescale=lazy, split=split,
                        whole_kv=whole_kv)

    def build_rows(self):
        rows = []
        for split, whole_kv in ((False, False), (False, True), (True, False)):
            for dtype in MMA_DTYPES:
                for head_dim in MMA_HEAD_DIMS:
                    for cls in self.tiles:
                        tile = self.class_tiles(TILE_CLASS_ARCH[cls], split)[head_dim]
                        rows.append(self.make_row(dtype, head_dim, tile, split, whole_kv))
        return rows

    def launchable(self, arch: int):
        tiles = self.class_tiles(arch)
        if tiles is None:
            return ()
        split = self.class_tiles(arch, True)
        terms = {d: self.feature_tiles.get(d, t) for d, t in tiles.items()}   # calls with score features
        paged = {d: self.paged_tiles.get(d, t) for d, t in tiles.items()}     # calls over a paged cache
        return tuple(dict.fromkeys(
            r for dtype in MMA_DTYPES for d in MMA_HEAD_DIMS
            for r in (self.make_row(dtype, d, tiles[d]), self.make_row(dtype, d, tiles[d], whole_kv=True),
                      self.make_row(dtype, d, split[d], split=True), self.make_row(dtype, d, terms[d]),
                      self.make_row(dtype, d, terms[d], whole_kv=True), self.make_row(dtype, d, paged[d]))))

    def applies(self, call: Call, arch: int, options) -> bool:
        return folds_scale(call.scale) and mma_bucket(call, arch) is not None

    def plan(self, call: Call, arch: int, options):
        bucket = mma_bucket(call, arch)
        tile = self.class_tiles(arch, call.split)[bucket]
        if call.features and not call.split:
            tile = self.feature_tiles.get(bucket, tile)
        if call.paged and not call.split:
            tile = self.paged_tiles.get(bucket, tile)
        whole_kv = not call.split and whole_blocks(call.seqlen_k, tile[1], call.head_dim, bucket, options)
        return (self.make_row(call.dtype, bucket, tile, call.split, whole_kv),)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # MmaFwdTraits::kSmemBytes: Q, then kv_stages x (K, V), 16-bit elements; the
        # output is staged in the Q tile.
        return (row.block_m + 2 * row.kv_stages * row.block_n) * row.head_dim * 2

    def min_ctas_per_sm(self, row) -> int:
        return 2 if row.threads <= 128 else 1                                # MmaFwdTraits


FWD_MMA = FwdMma()
