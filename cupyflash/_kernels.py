"""The catalogue of kernel instantiations the dispatcher can pick.

One row per template instantiation: which family (``fwd_simt``, ``fwd_v1``,
...), which ``cuda_src/`` file defines it, the exact name expression handed to
``cupy.RawModule(name_expressions=...)`` (and to the emulator), and the
properties the static report prints.  The dispatcher, ``precompile`` and
``python -m cupyflash kernels`` all read this one list.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

__all__ = ["Instantiation", "instantiations", "HEAD_DIM_BUCKETS", "MMA_HEAD_DIMS", "mma_arch_class",
           "mma_tiles", "mma_name_expression", "bwd_mma_name_expressions", "bwd_mma_shared_bytes", "bwd_mma_streamed",
           "launchable", "by_name", "family_rows", "WGMMA_HEAD_DIMS", "wgmma_tiles", "wgmma_name_expression",
           "compile_target", "WGMMA_BWD_HEAD_DIMS", "bwd_wgmma_tiles", "bwd_wgmma_name_expressions",
           "bwd_wgmma_shared_bytes", "combine_name_expression", "COMBINE_THREADS", "mma_split_tiles",
           "DMMA_ARCHS", "DMMA_HEAD_DIMS", "DMMA_DTYPES", "dmma_name_expression", "dmma_tiles",
           "bwd_dmma_name_expressions", "bwd_dmma_shared_bytes", "TF32_HEAD_DIMS", "TF32_PASSES",
           "tf32_name_expression", "tf32_tiles", "bwd_tf32_name_expressions", "bwd_tf32_shared_bytes"]


@dataclass(frozen=True)
class Instantiation:
    family: str            # "fwd_simt", "fwd_v1", ...
    entry: str             # file in cuda_src/, e.g. "fwd_simt.cu"
    name_expression: str   # e.g. "cf::fwd_simt_kernel<float, 64, 64>"
    dtype: str             # "float16", "bfloat16", "float32", "float64"
    head_dim: int          # compile-time (maximum) head dim of q/k
    head_dim_v: int        # compile-time (maximum) head dim of v/out
    threads: int           # threads per block
    block_m: int = 0       # query rows per CTA (0: chosen at run time, fwd_v1)
    block_n: int = 0       # keys per K/V block (0: chosen at run time, fwd_v1)
    kv_stages: int = 0     # fwd_mma/fwd_wgmma: K/V buffer pairs, bwd_mma: streamed tile buffers (1 or 2)
    lazy_rescale: bool = False  # fwd_mma/fwd_wgmma: rescale the output only when a row max moves far
    split: bool = False    # fwd_mma/fwd_wgmma: the split-KV instantiation (kSplit; fwd_simt splits at run time)
    # fwd_mma, fwd_wgmma: K/V copies without bounds (kWholeKV: Lk a multiple of block_n, d the bucket);
    # bwd_mma (bwd_wgmma's dQ kernel): streamed copies without bounds (kWholeStream: the
    # streamed length a multiple of the streamed block, d the bucket)
    whole_kv: bool = False
    passes: int = 0        # fwd_tf32: TF32 MMAs per product (1: precision "tf32", 3: "tf32x3")


# C++ spelling of each dtype in name expressions.
_CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

# Head-dim buckets: a run-time d (and dv) up to the bucket is masked in the
# kernel, so four instantiations per dtype cover 1..256.  d and dv share the
# bucket of max(d, dv).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)

# fwd_simt tiles (block_m, block_n) per accumulator type and bucket.  128
# threads; 8 lanes share a query row, so a thread holds block_m/16 rows, its
# block_n/8 keys of S and bucket/8 columns of O.  Shared memory (accumulator
# type): Q, K and V in their own buffers for float32/float64 (cp.async
# prefetch; one K/V buffer for the 16-bit types, converted on the way in),
# and P (block_m x (block_n + 8)).  Registers stay below the cap of the
# occupancy target (fwd_simt.cu: 128 for 4 CTAs/SM up to 48 KB, 168 up to
# 64 KB, 255 above).  Sizes below: float32 / 16-bit, float64.
_SIMT_TILES = {
    # float accumulators (float16, bfloat16, float32): 16-byte chunks of 4.
    # Per chunk a thread does rows x keys x 4 FMAs for rows + keys vector loads.
    "float": {
        32: (64, 32),    # 4 rows x 4 keys: 64 FMAs per 8 loads, 16 O registers; 26 / 22 KB
        64: (64, 32),    # 4 x 4, 32 O registers; 42 / 34 KB.  block_n 64 sits at the 128-register cap
        128: (32, 32),   # 2 x 4, 32 O registers; 53 / 37 KB.  block_m 64 would make the Q tile alone 32 KB
        256: (32, 16),   # 2 x 2, 64 O registers; 67 / 51 KB
    },
    # double accumulators: 16-byte chunks of 2, half as many elements per byte
    "double": {
        32: (32, 32),    # 2 x 4, 8 O doubles; 34 KB.  block_m 64 (4 rows) sits at the 128-register cap
        64: (32, 32),    # 2 x 4, 16 O doubles; 58 KB
        128: (32, 16),   # 2 x 2, 32 O doubles; 70 KB
        256: (16, 8),    # 1 x 1, 32 O doubles; 66 KB (the 16-row Q tile alone is 32 KB)
    },
}

_SIMT_THREADS = 128
_V1_THREADS = 128
# fwd_combine (split-KV's merge): one thread per 16-byte chunk of an output row
COMBINE_THREADS = 128


def _accumulator(dtype: str) -> str:
    return "double" if dtype == "float64" else "float"


def combine_name_expression(dtype: str) -> str:
    """fwd_combine's instantiation for ``dtype`` (any head dim, any forward family)."""
    return f"cf::fwd_combine_kernel<{_CXX_TYPE[dtype]}, {_accumulator(dtype)}>"


def instantiations() -> list[Instantiation]:
    """Every instantiation the dispatcher can pick, in a stable order (a new list).

    Built once from the tables of this module: every GPU call selects its
    kernel from it, and building it takes ~0.25 ms.  Code that edits the
    tables (benchmarks/gpu_variants.py) calls :func:`refresh` afterwards.
    """
    return list(_catalogue())


def refresh() -> None:
    """Rebuild :func:`instantiations` from the tables on its next call."""
    _catalogue.cache_clear()
    by_name.cache_clear()
    family_rows.cache_clear()


@functools.lru_cache(maxsize=1)
def by_name() -> dict[str, Instantiation]:
    """The catalogue keyed by name expression (built once, like :func:`instantiations`;
    do not modify)."""
    return {r.name_expression: r for r in _catalogue()}


@functools.cache
def family_rows(family: str, dtype: str) -> tuple[Instantiation, ...]:
    """The catalogue's rows of one kernel family and dtype name, in catalogue order
    (built once per pair, like :func:`by_name`; the dispatchers look them up per call)."""
    return tuple(r for r in _catalogue() if r.family == family and r.dtype == dtype)


@functools.lru_cache(maxsize=1)
def _catalogue() -> tuple[Instantiation, ...]:
    rows = []
    for dtype, cxx in _CXX_TYPE.items():
        for bucket in HEAD_DIM_BUCKETS:
            block_m, block_n = _SIMT_TILES[_accumulator(dtype)][bucket]
            rows.append(Instantiation(
                family="fwd_simt", entry="fwd_simt.cu",
                name_expression=f"cf::fwd_simt_kernel<{cxx}, {bucket}, {bucket}, {block_m}, {block_n}>",
                dtype=dtype, head_dim=bucket, head_dim_v=bucket, threads=_SIMT_THREADS,
                block_m=block_m, block_n=block_n))
    for dtype, cxx in _CXX_TYPE.items():
        rows.append(Instantiation(
            family="fwd_v1", entry="fwd_v1.cu", name_expression=f"cf::fwd_v1_kernel<{cxx}>",
            dtype=dtype, head_dim=HEAD_DIM_BUCKETS[-1], head_dim_v=HEAD_DIM_BUCKETS[-1],
            threads=_V1_THREADS))
    for dtype, cxx in _CXX_TYPE.items():
        rows.append(Instantiation(
            family="fwd_combine", entry="fwd_combine.cu", name_expression=combine_name_expression(dtype),
            dtype=dtype, head_dim=HEAD_DIM_BUCKETS[-1], head_dim_v=HEAD_DIM_BUCKETS[-1],
            threads=COMBINE_THREADS))
    rows.extend(_mma_instantiations())
    rows.extend(_wgmma_instantiations())
    rows.extend(_dmma_instantiations())
    rows.extend(_tf32_instantiations())
    rows.extend(_backward_instantiations())
    return tuple(rows)



# ---- fwd_mma: tensor cores (mma.sync m16n8k16), float16 / bfloat16, sm_80 and later -------------

# Compile-time head dims; a run-time d <= 256 runs in the next one up, zero-padded
# inside the kernel.  fwd_mma needs dv == d (cupyflash/_gpu.py falls back to fwd_simt).
MMA_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

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
_MMA_TILES = {
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

_MMA_DTYPES = ("float16", "bfloat16")


def mma_arch_class(arch: int) -> str | None:
    """The row of ``_MMA_TILES`` serving compute capability ``arch`` (e.g. 80), None below sm_80.

    By shared memory per SM: 164 KB (8.0, 8.7), 100 KB (8.6, 8.9, 12.x),
    228 KB (9.0, 10.x, 11.x).
    """
    arch = int(arch)
    if arch < 80:
        return None
    if arch in (80, 87):
        return "sm80"
    if arch in (86, 89) or arch >= 120:
        return "sm86"
    return "sm90"


def mma_tiles(arch: int) -> dict[int, tuple[int, int, int, int, bool]] | None:
    """``{head_dim: (block_m, block_n, warps, kv_stages, lazy_rescale)}`` of fwd_mma on ``arch``;
    None below sm_80."""
    tile_class = mma_arch_class(arch)
    return None if tile_class is None else dict(_MMA_TILES[tile_class])


# fwd_mma's split-KV instantiations (kSplit = true, used where the heuristic of
# cupyflash._launch.num_splits splits the keys): each class's tile, except where
# the split epilogue spills -- d = 128 with 64-key blocks, 20-88 B on every arch
# (NVRTC 13.5) -- which takes 32-key blocks instead (sm86's tile: 247 / 244
# registers on sm_80 / sm_90, no spills).
_MMA_SPLIT_TILES = {128: (128, 32, 4, 1, True)}


def mma_split_tiles(arch: int) -> dict[int, tuple[int, int, int, int, bool]] | None:
    """Like :func:`mma_tiles`, for the split-KV instantiations; None below sm_80."""
    tiles = mma_tiles(arch)
    return None if tiles is None else {d: _MMA_SPLIT_TILES.get(d, t) for d, t in tiles.items()}


def mma_name_expression(dtype: str, head_dim: int, block_m: int, block_n: int, warps: int,
                        kv_stages: int, lazy_rescale: bool, split: bool = False,
                        whole_kv: bool = False) -> str:
    """``cf::fwd_mma_kernel<T, head_dim, block_m, block_n, warps, kv_stages, lazy_rescale[, true]>``
    (the trailing ``true``: the split-KV instantiation, ``kSplit``), or ``..., lazy_rescale,
    false, true>`` (the whole-KV instantiation, ``kWholeKV``: K/V copies without bounds, for
    Lk a multiple of ``block_n`` and the head dim equal to the bucket; never split)."""
    if split and whole_kv:
        raise ValueError("fwd_mma has no split-KV instantiation with whole K/V blocks")
    suffix = ", true" if split else ", false, true" if whole_kv else ""
    return (f"cf::fwd_mma_kernel<{_CXX_TYPE[dtype]}, {head_dim}, {block_m}, {block_n}, {warps}, "
            f"{kv_stages}, {'true' if lazy_rescale else 'false'}{suffix}>")


def launchable(arch: int) -> frozenset[str]:
    """Name expressions of the catalogue rows some call may launch on compute capability
    ``arch``: every SIMT and fwd_v1 row, the tensor-core rows of ``arch``'s class
    (none below sm_80), the fwd_dmma and bwd_dmma rows on :data:`DMMA_ARCHS`, and on sm_90
    exactly the fwd_wgmma and bwd_wgmma rows -- what
    :func:`cupyflash.precompile` compiles for a device."""
    names = {r.name_expression for r in instantiations()
             if r.family not in ("fwd_mma", "bwd_mma", "fwd_wgmma", "bwd_wgmma", "fwd_dmma", "bwd_dmma",
                                 "fwd_tf32", "bwd_tf32")}
    if int(arch) in DMMA_ARCHS:
        names.update(r.name_expression for r in instantiations() if r.family in ("fwd_dmma", "bwd_dmma"))
    if int(arch) == WGMMA_ARCH:
        names.update(r.name_expression for r in instantiations() if r.family in ("fwd_wgmma", "bwd_wgmma"))
    tiles = mma_tiles(arch)
    if tiles is not None:
        names.update(r.name_expression for r in instantiations() if r.family in ("fwd_tf32", "bwd_tf32"))
        for dtype in _MMA_DTYPES:
            for d in MMA_HEAD_DIMS:
                names.add(mma_name_expression(dtype, d, *tiles[d]))
                names.add(mma_name_expression(dtype, d, *tiles[d], whole_kv=True))
                names.add(mma_name_expression(dtype, d, *mma_split_tiles(arch)[d], split=True))
                for deterministic, whole in itertools.product((True, False), (False, True)):
                    names.update(bwd_mma_name_expressions(dtype, d, arch, deterministic, whole, whole))
    return frozenset(names)


def _mma_instantiations() -> list[Instantiation]:
    """fwd_mma rows: every distinct (dtype, head dim, tile) of ``_MMA_TILES``, each also as
    its whole-KV instantiation, and the split-KV rows of ``_MMA_SPLIT_TILES``."""
    rows = {}
    for split, whole_kv in ((False, False), (False, True), (True, False)):
        for dtype in _MMA_DTYPES:
            for head_dim in MMA_HEAD_DIMS:
                for tiles in _MMA_TILES.values():
                    block_m, block_n, warps, stages, lazy = (
                        _MMA_SPLIT_TILES.get(head_dim, tiles[head_dim]) if split else tiles[head_dim])
                    name = mma_name_expression(dtype, head_dim, block_m, block_n, warps, stages, lazy,
                                               split, whole_kv)
                    rows.setdefault(name, Instantiation(
                        family="fwd_mma", entry="fwd_mma.cu", name_expression=name, dtype=dtype,
                        head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps, block_m=block_m,
                        block_n=block_n, kv_stages=stages, lazy_rescale=lazy, split=split,
                        whole_kv=whole_kv))
    return list(rows.values())

# ---- fwd_wgmma: Hopper's warpgroup mma (wgmma.mma_async), float16 / bfloat16, sm_90a ----------

# The compute capability whose sm_90a target fwd_wgmma is built for: wgmma and
# the "a" target run on 9.0 devices only (H100, H200, GH200), not on later ones.
WGMMA_ARCH = 90
# Kernels built for an architecture-specific target: entry -> {arch: target}.
# CuPy's RawModule compiles for the device's plain sm_XX, so the loader compiles
# these itself (cupyflash/_loader.py); the static report only for the arch listed.
_ARCH_SPECIFIC = {"fwd_wgmma.cu": {"sm_90": "sm_90a"}, "bwd_wgmma.cu": {"sm_90": "sm_90a"}}


def compile_target(entry: str, arch: str) -> str | None:
    """The NVRTC target ``cuda_src/<entry>`` is built for on ``arch`` (``"sm_90"``):
    ``arch`` itself, its architecture-specific target (``"sm_90a"`` for fwd_wgmma), or
    None where the entry has no kernels for ``arch``."""
    targets = _ARCH_SPECIFIC.get(entry)
    return arch if targets is None else targets.get(arch)


# Head dims with wgmma kernels: whole 64-column pages of the 128-byte-swizzled
# tiles.  The tensor-core head dims in between (32, 96, 160, 224) keep fwd_mma:
# padding them to the next page would add 33-100 % of work.
WGMMA_HEAD_DIMS = (64, 128, 192, 256)

# (block_n, warpgroups, lazy_rescale) per head dim.  A CTA owns 64 query rows
# per warpgroup (each warp 16, the rows of its m64 slice); K/V double-buffered,
# V one block behind K (the P V product of block n - 1 runs behind S of block n).
# Per thread: S block_n / 2 floats, O d / 2 floats, P block_n / 4 registers for
# the block in flight and as many for the next.  Shared memory (Q + 2 x (K + V))
# x 2 bytes + 1 KB of alignment slack.  Registers from the static report (NVRTC
# 13.5, sm_90a), no spills; one CTA of 8 warps per SM everywhere (registers).
# Not yet timed on a GPU: benchmarks/gpu_check.sh times each row against
# fwd_mma, benchmarks/gpu_variants.py the alternatives.
_WGMMA_TILES = {
    64: (128, 2, True),     # 184 regs, 81 KB (block_n 64: 127 regs, two CTAs per SM -- a variant to time)
    128: (128, 2, True),    # 216 regs, 161 KB: FA3's 128 x 128 non-causal tile, without its producer
                            # warpgroup (block_n 192 spills; three warpgroups do not fit the registers)
    192: (64, 2, True),     # 194 regs, 145 KB
    256: (64, 2, True),     # 222 regs, 193 KB (O is 128 floats per thread)
}


def wgmma_tiles() -> dict[int, tuple[int, int, bool]]:
    """``{head_dim: (block_n, warpgroups, lazy_rescale)}`` of fwd_wgmma (sm_90 only)."""
    return dict(_WGMMA_TILES)


def wgmma_name_expression(dtype: str, head_dim: int, block_n: int, warpgroups: int,
                          lazy_rescale: bool, split: bool = False, whole_kv: bool = False) -> str:
    """``cf::fwd_wgmma_kernel<T, head_dim, block_n, warpgroups, lazy_rescale[, true]>`` (the
    trailing ``true``: the split-KV instantiation, ``kSplit``, same tile), or ``...,
    lazy_rescale, false, true>`` (the whole-KV instantiation, ``kWholeKV``, as fwd_mma's:
    K/V copies without bounds; never split)."""
    if split and whole_kv:
        raise ValueError("fwd_wgmma has no split-KV instantiation with whole K/V blocks")
    suffix = ", true" if split else ", false, true" if whole_kv else ""
    return (f"cf::fwd_wgmma_kernel<{_CXX_TYPE[dtype]}, {head_dim}, {block_n}, {warpgroups}, "
            f"{'true' if lazy_rescale else 'false'}{suffix}>")


def _wgmma_instantiations() -> list[Instantiation]:
    rows = []
    for split, whole_kv in ((False, False), (True, False), (False, True)):
        for dtype in _MMA_DTYPES:
            for head_dim, (block_n, groups, lazy) in _WGMMA_TILES.items():
                rows.append(Instantiation(
                    family="fwd_wgmma", entry="fwd_wgmma.cu",
                    name_expression=wgmma_name_expression(dtype, head_dim, block_n, groups, lazy, split,
                                                          whole_kv),
                    dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, threads=128 * groups,
                    block_m=64 * groups, block_n=block_n, kv_stages=2, lazy_rescale=lazy, split=split,
                    whole_kv=whole_kv))
    return rows

# ---- fwd_dmma: float64 on the FP64 tensor cores (mma.sync m8n8k4 .f64), sm_80 / sm_90 -----------

# Compute capabilities whose FP64 tensor cores run at twice the FP64 CUDA-core
# rate (A100, A30; H100, H200): fwd_dmma replaces fwd_simt there.  Other GPUs
# either lack FP64 tensor cores' speed (RTX 30/40: FP64 at 1/64 rate either
# way) or are not known to gain (Blackwell).
DMMA_ARCHS = (80, 90)
DMMA_HEAD_DIMS = (32, 64, 128)
# (block_m, block_n, warps) per head dim: 4 warps of 16 query rows (two m8 tiles,
# so each K/V fragment feeds two DMMA); shared memory (Q + K + V) x 8 bytes.
# Registers from the static report (NVRTC 13.5, sm_80 / sm_90), no spills;
# 2 CTAs per SM (registers) except at d = 128 on sm_80 (shared memory: 1).
# Not yet timed on a GPU.
_DMMA_TILES = {
    32: (64, 32, 4),    # 187 / 192 regs, 32 KB
    64: (64, 32, 4),    # 215 / 216 regs, 64 KB
    128: (64, 16, 4),   # 246 / 246 regs, 96 KB: 1 CTA on sm_80, 2 on sm_90 (64 x 32 would take 128 KB)
}


DMMA_DTYPES = ("float64", "float32")


def dmma_name_expression(head_dim: int, block_m: int, block_n: int, warps: int, dtype: str = "float64") -> str:
    """``cf::fwd_dmma_kernel<head_dim, block_m, block_n, warps>`` for float64,
    ``cf::fwd_dmma_kernel<head_dim, block_m, block_n, warps, float>`` for float32."""
    suffix = "" if dtype == "float64" else f", {_CXX_TYPE[dtype]}"
    return f"cf::fwd_dmma_kernel<{head_dim}, {block_m}, {block_n}, {warps}{suffix}>"


def dmma_tiles() -> dict[int, tuple[int, int, int]]:
    """``{head_dim: (block_m, block_n, warps)}`` of fwd_dmma."""
    return dict(_DMMA_TILES)


def _dmma_instantiations() -> list[Instantiation]:
    return [Instantiation(family="fwd_dmma", entry="fwd_dmma.cu",
                          name_expression=dmma_name_expression(d, block_m, block_n, warps, dtype),
                          dtype=dtype, head_dim=d, head_dim_v=d, threads=32 * warps,
                          block_m=block_m, block_n=block_n)
            for dtype in DMMA_DTYPES for d, (block_m, block_n, warps) in _DMMA_TILES.items()]

# ---- fwd_tf32: float32 on the TF32 tensor cores (mma.sync m16n8k8 .tf32), sm_80+, opt-in ---------

# attention(..., precision=...) -> TF32 MMAs per product: "tf32" rounds every
# operand to TF32 once, "tf32x3" splits it into two TF32 parts and sums three
# products (cuda_src/fwd_tf32.cu).  precision="ieee" (the default) never runs them.
TF32_PASSES = {"tf32": 1, "tf32x3": 3}
TF32_HEAD_DIMS = (32, 64, 128)
# (block_m, block_n, warps) per head dim, both precisions: 4 warps of 16 query
# rows (one m16 tile each); shared memory (Q + K + V) x 4 bytes, plus the small
# TF32 parts of K and V (else of V alone) with three passes, within 80 KB (two
# CTAs per sm_80 SM).  Registers from the static report (NVRTC 13.5, sm_80 / sm_90):
# one pass 165-185 (at most 168 at d = 64 and 128: three CTAs per SM where the
# shared memory allows), three 221-242 (two); no spills, nor under NVRTC 13.0 and
# 12.0.  Not yet timed on a GPU.
_TF32_TILES = {
    32: (64, 64, 4),    # 24 KB (tf32x3: 40 KB)
    64: (64, 64, 4),    # 48 KB (tf32x3: 80 KB)
    128: (64, 32, 4),   # 64 KB (tf32x3: 80 KB, V's small plane only); 64 keys: 96 KB
}


def tf32_name_expression(head_dim: int, block_m: int, block_n: int, warps: int, passes: int) -> str:
    """``cf::fwd_tf32_kernel<head_dim, block_m, block_n, warps, passes>``."""
    return f"cf::fwd_tf32_kernel<{head_dim}, {block_m}, {block_n}, {warps}, {passes}>"


def tf32_tiles() -> dict[int, tuple[int, int, int]]:
    """``{head_dim: (block_m, block_n, warps)}`` of fwd_tf32."""
    return dict(_TF32_TILES)


def _tf32_instantiations() -> list[Instantiation]:
    return [Instantiation(family="fwd_tf32", entry="fwd_tf32.cu",
                          name_expression=tf32_name_expression(d, block_m, block_n, warps, passes),
                          dtype="float32", head_dim=d, head_dim_v=d, threads=32 * warps,
                          block_m=block_m, block_n=block_n, passes=passes)
            for passes in sorted(set(TF32_PASSES.values())) for d, (block_m, block_n, warps) in _TF32_TILES.items()]

# ---- backward ----------------------------------------------------------------------------------

# bwd_simt (cuda_src/bwd_simt.cu): per dtype and head-dim bucket three kernels,
# launched in this order -- delta = rowsum(dO o O), then dK/dV (a CTA owns
# block_n keys, streams block_m query rows), then dQ (a CTA owns block_m query
# rows, streams block_n keys).  Both main kernels keep in shared memory the
# own rows x (d + dv), a P / dS scratch tile (own x (streamed + 8)) and the
# streamed rows x (d + dv) -- twice for float32/float64 where it fits in 72
# KB (cp.async prefetch of the next block) -- in the accumulator type, and
# use the same (own, streamed) shape, 128 threads, 8 lanes per own row: a
# thread holds own/16 rows of dK+dV (or dQ) and own/16 x streamed/8 entries
# of S, P, dP, dS.  float32 tiles take 29-67 KB, float64 58-70 KB except at
# 256, whose smallest tile (16 + 8 rows of 4 KB, one streamed buffer) needs
# 98 KB; the 16-bit types (one buffer) 21-51 KB.
_BWD_SIMT_TILES = {
    # (own rows, streamed rows)
    "float": {
        32: (32, 32),    # 2 x 4, 8 + 8 dK/dV registers.  (64, 32): its dQ kernel spilled 16 B on sm_86/89
        64: (32, 32),    # 2 x 4, 16 + 16
        128: (32, 16),   # 2 x 2, 32 + 32
        256: (16, 8),    # 1 x 1, 32 + 32
    },
    "double": {
        32: (32, 32),    # 2 x 4, 8 + 8 doubles
        64: (32, 16),    # 2 x 2, 16 + 16 doubles
        128: (16, 8),    # 1 x 1, 16 + 16 doubles
        256: (16, 8),    # 1 x 1, 32 + 32 doubles; 98 KB (opt-in shared memory, 1 CTA/SM on an A100)
    },
}

_BWD_SIMT_THREADS = 128
_BWD_DELTA_ROWS = 16     # bwd_simt_dot_do_o_kernel: 128 threads, 8 lanes per query row


# bwd_mma (cuda_src/bwd_mma.cu): float16/bfloat16, sm_80+, d == dv, the head
# dims of fwd_mma.  4 warps, each owning 16 rows (one m16 tile) of the CTA's
# own block: dK/dV owns 64 keys and streams query blocks, dQ owns 64 query
# rows and streams key blocks.  Per head dim: (streamed rows, dK and dV in
# one launch[, streamed keys of the dQ kernel when they differ]).  Registers
# from the static report (sm_80 / sm_90), all without spills; shared memory =
# (own tiles + 2 streamed) x d x 2 bytes (+ 2 floats per streamed row).
# Measured on an H200 for d = 128 (benchmarks/results/2026-11-30-nvidia-h200-
# tuning.md); the other rows are predictions from the static report.
# From 160 on, dK and dV accumulators together (2 x 2d/8 floats per lane on
# top of S and dP) spill at 255 registers (160: 8 bytes on sm_90; 192: 32;
# 256: over 1 KB): one launch computes dV, a second dK (S recomputed: 8 block
# products per block pair instead of 7).
_BWD_MMA_TILES = {
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
_BWD_MMA_OWN = 64
_BWD_MMA_WARPS = 4
# bwd_mma_dkdv_kernel's kGrads: which gradients one launch computes (bwd_mma.cu);
# BWD_GRAD_DQ_ATOMIC (with BWD_GRAD_DK, deterministic=False): dQ by float atomics.
BWD_GRAD_DV, BWD_GRAD_DK, BWD_GRAD_DQ_ATOMIC = 1, 2, 4
# Streamed-tile stages of bwd_mma per GPU class: two (the next block copied
# while this one is computed) wherever two CTAs still fit on one SM -- the
# shared memory per CTA below (per SM: 164 KB sm80, 100 KB sm86, 228 KB
# sm90, less 1 KB per CTA) -- else one.  sm90 stops at 100 KB: the d = 224
# dK kernel with two stages (112.5 KB) spills 4 bytes under NVRTC 13.0.
_TWO_CTA_SHARED = {"sm80": 81 * 1024, "sm86": 49 * 1024, "sm90": 100 * 1024}


def bwd_mma_shared_bytes(head_dim: int, own: int, streamed: int, needs_v: bool, stages: int,
                         atomic_dq: bool = False) -> int:
    """``MmaBwdTraits::kSmemBytes`` (bwd_mma.cu): the own tiles (one or two), then per
    stage two streamed tiles of 16-bit elements and two floats per streamed row, then
    with ``atomic_dq`` one own x streamed tile of dS."""
    return ((2 if needs_v else 1) * own * head_dim * 2
            + stages * (2 * streamed * head_dim * 2 + 2 * streamed * 4)
            + (own * streamed * 2 if atomic_dq else 0))


def bwd_mma_streamed(head_dim: int) -> tuple[int, int]:
    """Rows per streamed block of bwd_mma's dK/dV kernels (query rows) and of its dQ
    kernel (keys) at compile-time ``head_dim``."""
    streamed, _, *dq_streamed = _BWD_MMA_TILES[head_dim]
    return streamed, (dq_streamed[0] if dq_streamed else streamed)


def bwd_mma_name_expressions(dtype: str, head_dim: int, arch: int, deterministic: bool = True,
                             whole_q: bool = False, whole_k: bool = False) -> list[str]:
    """bwd_mma's kernels for ``dtype`` (float16 / bfloat16) and compile-time ``head_dim`` on
    ``arch`` (>= 80), in launch order: dK/dV (or dV, then dK), then dQ.  Not
    ``deterministic``: the launch computing dK also adds dQ by float atomics (into a
    zeroed dq), and there is no dQ kernel -- except at d = 256, whose atomic dK kernel
    would pass the 99 KB of shared memory every row keeps within.  ``whole_q`` /
    ``whole_k``: the dK/dV / dQ kernels' whole-stream instantiations (a trailing
    ``true``, kWholeStream: streamed copies without bounds, for Lq / Lk a multiple of
    :func:`bwd_mma_streamed`'s blocks and the head dim equal to the bucket)."""
    tile_class = mma_arch_class(arch)
    if tile_class is None or head_dim not in _BWD_MMA_TILES:
        raise ValueError(f"bwd_mma has no kernel for head_dim={head_dim} on sm_{arch}")
    cxx, own, warps = _CXX_TYPE[dtype], _BWD_MMA_OWN, _BWD_MMA_WARPS
    streamed, together, *dq_streamed = _BWD_MMA_TILES[head_dim]
    streamed_dq = dq_streamed[0] if dq_streamed else streamed

    def stages(rows: int, needs_v: bool, atomic_dq: bool = False) -> int:
        two = bwd_mma_shared_bytes(head_dim, own, rows, needs_v, 2, atomic_dq)
        return 2 if two <= _TWO_CTA_SHARED[tile_class] else 1

    if not deterministic and bwd_mma_shared_bytes(head_dim, own, streamed, True, 1, True) > 99 * 1024:
        deterministic = True   # d = 256: the dS tile would pass sm_86/89's 99 KB; the dQ kernel runs
    names = []
    for grads in ([BWD_GRAD_DV | BWD_GRAD_DK] if together else [BWD_GRAD_DV, BWD_GRAD_DK]):
        if grads & BWD_GRAD_DK and not deterministic:
            grads |= BWD_GRAD_DQ_ATOMIC
        names.append(f"cf::bwd_mma_dkdv_kernel<{cxx}, {head_dim}, {own}, {streamed}, {warps}, {grads}, "
                     f"{stages(streamed, bool(grads & BWD_GRAD_DK), bool(grads & BWD_GRAD_DQ_ATOMIC))}"
                     f"{', true' if whole_q else ''}>")
    if deterministic:
        names.append(f"cf::bwd_mma_dq_kernel<{cxx}, {head_dim}, {own}, {streamed_dq}, {warps}, "
                     f"{stages(streamed_dq, True)}{', true' if whole_k else ''}>")
    return names


def _backward_instantiations() -> list[Instantiation]:
    """Backward rows in launch order per (family, dtype, head dim): bwd_simt's delta,
    dK/dV and dQ kernels (and, where its streamed block allows, the dK/dV kernel that
    adds dQ by atomics); bwd_mma's dK/dV (one or two launches) and dQ kernels (bwd_mma
    uses bwd_simt's delta kernel)."""
    rows = []
    for dtype, cxx in _CXX_TYPE.items():
        for bucket in HEAD_DIM_BUCKETS:
            own, streamed = _BWD_SIMT_TILES[_accumulator(dtype)][bucket]
            common = dict(family="bwd_simt", entry="bwd_simt.cu", dtype=dtype, head_dim=bucket,
                          head_dim_v=bucket, threads=_BWD_SIMT_THREADS)
            rows.append(Instantiation(
                name_expression=f"cf::bwd_simt_dot_do_o_kernel<{cxx}, {bucket}>",
                block_m=_BWD_DELTA_ROWS, **common))
            rows.append(Instantiation(
                name_expression=f"cf::bwd_simt_dkdv_kernel<{cxx}, {bucket}, {bucket}, {own}, {streamed}, false>",
                block_m=streamed, block_n=own, **common))
            rows.append(Instantiation(
                name_expression=f"cf::bwd_simt_dq_kernel<{cxx}, {bucket}, {bucket}, {own}, {streamed}>",
                block_m=own, block_n=streamed, **common))
            if streamed % 16 == 0:   # deterministic=False: dK/dV and dQ by atomics in one launch
                rows.append(Instantiation(
                    name_expression=f"cf::bwd_simt_dkdv_kernel<{cxx}, {bucket}, {bucket}, {own}, {streamed}, true>",
                    block_m=streamed, block_n=own, **common))
    mma = {}
    for dtype in ("float16", "bfloat16"):
        for d in _BWD_MMA_TILES:
            for arch in _CLASS_ARCH.values():
                for deterministic, whole in itertools.product((True, False), (False, True)):
                    for name in bwd_mma_name_expressions(dtype, d, arch, deterministic, whole, whole):
                        if name not in mma:
                            mma[name] = _bwd_mma_row(dtype, d, name)
    return (rows + list(mma.values()) + _bwd_wgmma_instantiations() + _bwd_dmma_instantiations()
            + _bwd_tf32_instantiations())


# ---- bwd_wgmma: the backward on Hopper's wgmma (cuda_src/bwd_wgmma.cu), sm_90a --------------------

# Head dims with bwd_wgmma kernels: those of fwd_wgmma.
WGMMA_BWD_HEAD_DIMS = (64, 128, 192, 256)

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
_BWD_WGMMA_TILES = {
    64: (((BWD_GRAD_DV | BWD_GRAD_DK, 128),), 2, 128),   # dK/dV 255 regs, 99 KB (131 KB atomic); dQ 224, 99 KB
    128: (((BWD_GRAD_DV | BWD_GRAD_DK, 64),), 2, 128),   # dK/dV 255 regs, 130 KB (146 KB atomic); dQ 255, 195 KB
    192: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 64)), 2, 64),    # dV 254 regs, 146 KB; dK 254, 194 KB; dQ 215, 194 KB
    256: (((BWD_GRAD_DV, 64), (BWD_GRAD_DK, 32)), 2, 32),    # dV 255 regs, 194 KB; dK 254, 194 KB; dQ 210, 194 KB
}


def bwd_wgmma_tiles() -> dict[int, tuple]:
    """``{head_dim: (((grads, streamed_rows), ...), warpgroups, dq_streamed_keys)}`` of
    bwd_wgmma: the dK/dV launches in order (``grads`` a bit set of
    ``BWD_GRAD_DV``, ``BWD_GRAD_DK``), the warpgroups per CTA and the dQ kernel's block."""
    return dict(_BWD_WGMMA_TILES)


def bwd_wgmma_shared_bytes(head_dim: int, own: int, streamed: int, needs_v: bool, atomic_dq: bool) -> int:
    """``WgmmaBwdTraits::kSmemBytes`` (bwd_wgmma.cu): the own tiles (two with
    ``needs_v``), two stages of two streamed tiles and of two floats per streamed
    row, the dS^T tile with ``atomic_dq``, and 1 KB to align the start to 1024 bytes."""
    return ((2 if needs_v else 1) * own * head_dim * 2 + 2 * 2 * streamed * head_dim * 2
            + 2 * 2 * streamed * 4 + (own * streamed * 2 if atomic_dq else 0) + 1024)


def _wgmma_atomic_dq(head_dim: int, streamed: int, groups: int) -> bool:
    """Whether a bwd_wgmma dK launch streaming ``streamed`` rows can add dQ by atomics:
    each warpgroup one m64 slice of the block's queries and a head-dim slice of
    whole 64-column pages, and the dS^T tile within sm_90's 227 KB."""
    if streamed % 64 or groups % (streamed // 64):
        return False
    cols = head_dim // (groups // (streamed // 64))
    return cols % 64 == 0 and bwd_wgmma_shared_bytes(head_dim, 64 * groups, streamed, True, True) <= 227 * 1024


def bwd_wgmma_name_expressions(dtype: str, head_dim: int, deterministic: bool = True,
                               whole_k: bool = False) -> list[str]:
    """bwd_wgmma's kernels for ``dtype`` and ``head_dim`` (one of
    :data:`WGMMA_BWD_HEAD_DIMS`), in launch order: dK/dV (or dV, then dK), then dQ --
    or, not ``deterministic``, where the dK launch can (:func:`_wgmma_atomic_dq`), no
    dQ kernel: that launch adds dQ by float atomics.  ``whole_k``: the dQ kernel's
    whole-stream instantiation (a trailing ``true``, kWholeStream: K/V copies without
    bounds, for Lk a multiple of its key block and the head dim equal to the bucket).
    The dK/dV kernels have none: at 255 registers, ptxas spent more instructions
    without their bounds than with them."""
    if head_dim not in _BWD_WGMMA_TILES:
        raise ValueError(f"bwd_wgmma has no kernel for head_dim={head_dim}")
    cxx = _CXX_TYPE[dtype]
    launches, groups, streamed_dq = _BWD_WGMMA_TILES[head_dim]
    own = 64 * groups
    atomic = not deterministic and all(_wgmma_atomic_dq(head_dim, streamed, groups)
                                       for grads, streamed in launches if grads & BWD_GRAD_DK)
    names = []
    for grads, streamed in launches:
        if atomic and grads & BWD_GRAD_DK:
            grads |= BWD_GRAD_DQ_ATOMIC
        names.append(f"cf::bwd_wgmma_dkdv_kernel<{cxx}, {head_dim}, {own}, {streamed}, {groups}, {grads}>")
    if not atomic:
        names.append(f"cf::bwd_wgmma_dq_kernel<{cxx}, {head_dim}, {own}, {streamed_dq}, {groups}"
                     f"{', true' if whole_k else ''}>")
    return names


def bwd_wgmma_dq_keys(head_dim: int) -> int:
    """Keys per block of bwd_wgmma's dQ kernel at compile-time ``head_dim``."""
    return _BWD_WGMMA_TILES[head_dim][2]


def _backward_row(family: str, name: str, dtype: str, head_dim: int, own: int, streamed: int, threads: int,
                  **extra) -> Instantiation:
    """A backward kernel's catalogue row (cuda_src/<family>.cu): a dK/dV kernel owns keys
    (block_n) and streams query rows (block_m), a dQ kernel the reverse."""
    dkdv = "_dkdv_kernel<" in name
    return Instantiation(family=family, entry=f"{family}.cu", name_expression=name, dtype=dtype, head_dim=head_dim,
                         head_dim_v=head_dim, threads=threads, block_m=streamed if dkdv else own,
                         block_n=own if dkdv else streamed, **extra)


def _bwd_wgmma_instantiations() -> list[Instantiation]:
    rows = []
    for dtype in _MMA_DTYPES:
        for d in _BWD_WGMMA_TILES:
            for deterministic, whole in itertools.product((True, False), (False, True)):
                for name in bwd_wgmma_name_expressions(dtype, d, deterministic, whole_k=whole):
                    args = [a.strip() for a in name.split("<", 1)[1].rstrip(">").split(",")]
                    own, streamed, groups = int(args[2]), int(args[3]), int(args[4])
                    row = _backward_row("bwd_wgmma", name, dtype, d, own, streamed, 128 * groups, kv_stages=2,
                                        whole_kv=args[-1] == "true")
                    if row not in rows:
                        rows.append(row)
    return rows


# ---- bwd_dmma: the float64 backward on the FP64 tensor cores (cuda_src/bwd_dmma.cu), sm_80 / sm_90 --

# Head dims (d == dv) with bwd_dmma kernels: those of fwd_dmma, on DMMA_ARCHS,
# for float64 and (computed in double) float32.  Per head dim (own rows,
# streamed rows, warps) of both kernels -- dK/dV owns keys and streams query
# rows, dQ owns query rows and streams keys.  Per lane: the own rows'
# gradients (dK and dV, or dQ) 2 x d / 8 doubles per m8 tile, S and dP
# streamed / 4 each.  Shared memory (2 own + 2 x stages streamed tiles) x d x 8
# bytes, two stages for float64 and one for float32.  Registers from the static
# report (NVRTC 13.5, float64 on sm_80 / sm_90; float32 within 10 of them), no
# spills; not yet timed on a GPU.
_BWD_DMMA_TILES = {
    32: (64, 32, 4),    # dK/dV 236 / 246 regs, dQ 232 / 230; 64 KB (float32 48 KB)
    64: (64, 16, 4),    # dK/dV 240 / 244, dQ 228 / 242; 96 KB (float32 80 KB; 32 streamed rows: 128 KB;
                        # fully unrolled score products: the dK/dV kernel spills 28-36 B)
    128: (32, 8, 4),    # dK/dV 254 / 252, dQ 238 / 234; 96 KB (float32 80 KB): one m8 tile per warp (two
                        # would be 128 doubles of dK and dV per lane)
}


def bwd_dmma_name_expressions(head_dim: int, dtype: str = "float64") -> list[str]:
    """bwd_dmma's kernels for compile-time ``head_dim`` (one of :data:`DMMA_HEAD_DIMS`) and
    ``dtype`` (float64; float32, computed in double), in launch order: dK/dV, then dQ
    (there is no atomic variant)."""
    if head_dim not in _BWD_DMMA_TILES:
        raise ValueError(f"bwd_dmma has no kernel for head_dim={head_dim}")
    own, streamed, warps = _BWD_DMMA_TILES[head_dim]
    suffix = "" if dtype == "float64" else f", {_CXX_TYPE[dtype]}"
    return [f"cf::bwd_dmma_dkdv_kernel<{head_dim}, {own}, {streamed}, {warps}{suffix}>",
            f"cf::bwd_dmma_dq_kernel<{head_dim}, {own}, {streamed}, {warps}{suffix}>"]


def bwd_dmma_shared_bytes(head_dim: int, own: int, streamed: int, dtype: str = "float64") -> int:
    """``DmmaBwdTraits::kSmemBytes`` (bwd_dmma.cu): two own tiles and, per stage, two
    streamed tiles of doubles -- two stages for float64 (cp.async), one for float32
    (widened on the way in)."""
    stages = 2 if dtype == "float64" else 1
    return (2 * own + 2 * stages * streamed) * head_dim * 8


def _bwd_dmma_instantiations() -> list[Instantiation]:
    rows = []
    for dtype in DMMA_DTYPES:
        for d, (own, streamed, warps) in _BWD_DMMA_TILES.items():
            for name in bwd_dmma_name_expressions(d, dtype):
                rows.append(_backward_row("bwd_dmma", name, dtype, d, own, streamed, 32 * warps,
                                          kv_stages=2 if dtype == "float64" else 1))
    return rows


# ---- bwd_tf32: the float32 backward on the TF32 tensor cores (cuda_src/bwd_tf32.cu), sm_80+, opt-in --

# Head dims (d == dv) with bwd_tf32 kernels: those of fwd_tf32, run where the
# caller allows TF32 (attention_backward(..., precision="tf32" / "tf32x3")).
# Per head dim (own rows, streamed rows, warps) of both kernels -- dK/dV owns
# keys and streams query rows, dQ owns query rows and streams keys; 4 warps of
# one m16 tile each.  Per lane: the own rows' gradients (dK and dV, or dQ) 2 x
# d / 4 floats, S and dP streamed / 4 each.  Shared memory (2 own + 2 x 2
# streamed tiles) x d x 4 bytes (cp.async, two stages).  Registers from the
# static report (NVRTC 13.5, sm_80 / sm_90, tf32 / tf32x3), no spills (nor under
# NVRTC 13.0 and 12.0); not yet timed on a GPU.
_BWD_TF32_TILES = {
    32: (64, 64, 4),    # 48 KB
    64: (64, 32, 4),    # 64 KB
    128: (64, 16, 4),   # 96 KB: two CTAs per SM on sm_90, one on sm_80 (32 streamed rows: 128 KB)
}


def bwd_tf32_name_expressions(head_dim: int, passes: int) -> list[str]:
    """bwd_tf32's kernels for compile-time ``head_dim`` (one of :data:`TF32_HEAD_DIMS`) and
    ``passes`` TF32 MMAs per product (1 or 3), in launch order: dK/dV, then dQ (there is
    no atomic variant)."""
    if head_dim not in _BWD_TF32_TILES:
        raise ValueError(f"bwd_tf32 has no kernel for head_dim={head_dim}")
    own, streamed, warps = _BWD_TF32_TILES[head_dim]
    return [f"cf::bwd_tf32_dkdv_kernel<{head_dim}, {own}, {streamed}, {warps}, {passes}>",
            f"cf::bwd_tf32_dq_kernel<{head_dim}, {own}, {streamed}, {warps}, {passes}>"]


def bwd_tf32_shared_bytes(head_dim: int, own: int, streamed: int) -> int:
    """``Tf32BwdTraits::kSmemBytes`` (bwd_tf32.cu): two own tiles and two stages of two
    streamed tiles of floats."""
    return (2 * own + 4 * streamed) * head_dim * 4


def _bwd_tf32_instantiations() -> list[Instantiation]:
    rows = []
    for passes in sorted(set(TF32_PASSES.values())):
        for d, (own, streamed, warps) in _BWD_TF32_TILES.items():
            for name in bwd_tf32_name_expressions(d, passes):
                rows.append(_backward_row("bwd_tf32", name, "float32", d, own, streamed, 32 * warps, kv_stages=2,
                                          passes=passes))
    return rows


# One compute capability per architecture class (mma_arch_class).
_CLASS_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}


def _bwd_mma_row(dtype: str, head_dim: int, name: str) -> Instantiation:
    args = [a.strip() for a in name.split("<", 1)[1].rstrip(">").split(",")[1:]]
    whole = args[-1] == "true"          # kWholeStream
    args = [int(a) for a in (args[:-1] if whole else args)]
    own, streamed, warps, stages = args[1], args[2], args[3], args[-1]
    return dataclasses.replace(
        _backward_row("bwd_mma", name, dtype, head_dim, own, streamed, 32 * warps, kv_stages=stages),
        whole_kv=whole)
