"""What each GPU architecture the kernels target offers: one table of limits.

Every place that needs a per-architecture number -- the static report's
occupancy, a family's tile choice (two CTAs per SM?), the split-KV heuristic,
the emulator's launch checks -- reads it from :data:`SM_LIMITS` through
:func:`sm_limits`, and the tensor-core tile tables pick their row with
:func:`tile_class`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SMLimits", "SM_LIMITS", "sm_limits", "tile_class", "TILE_CLASS_ARCH", "WGMMA_ARCH", "DMMA_ARCHS"]


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one compute capability (what occupancy is computed from)."""

    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    registers_per_sm: int          # 32-bit registers in the SM's register file
    registers_per_block: int       # most one block may hold
    max_registers_per_thread: int  # ptxas never exceeds 255
    register_alloc_unit: int       # registers are allocated per warp in units of this many
    sub_partitions: int            # the register file is split evenly over these
    shared_per_sm: int             # bytes, largest carveout
    shared_per_block_optin: int    # bytes, with cudaFuncAttributeMaxDynamicSharedMemorySize
    shared_reserved_per_block: int  # bytes the driver reserves per block (sm_80+)
    shared_alloc_unit: int         # bytes, shared memory allocation granularity
    barriers_per_block_slot: int   # block barriers per resident block slot (0: not a limit)


# Sources:
# - CUDA C++ Programming Guide, "Compute Capabilities", table "Technical
#   Specifications per Compute Capability": max resident threads per SM (2048 for
#   8.0 and 9.0, 1536 for 8.6 and 8.9), max resident blocks per SM (32, 16, 24,
#   32), 64 K 32-bit registers per SM and per block, 255 registers per thread,
#   1024 threads per block, shared memory per SM (164 KB for 8.0, 100 KB for 8.6
#   and 8.9, 228 KB for 9.0) and per block (163 KB, 99 KB, 99 KB, 227 KB).
# - NVIDIA Ampere / Ada / Hopper tuning guides, "Shared Memory": the driver
#   reserves 1 KB of shared memory per thread block.
# - cuda_occupancy.h (CUDA toolkit): register allocation unit 256 per warp, 4
#   sub-partitions, shared memory granularity 128 bytes; block barriers limit
#   occupancy from Hopper on (2 per block slot on 9.0).  tests/test_static_report.py
#   checks occupancy() against that header's calculator.
SM_LIMITS: dict[int, SMLimits] = {
    80: SMLimits(2048, 32, 1024, 65536, 65536, 255, 256, 4, 164 * 1024, 163 * 1024, 1024, 128, 0),
    86: SMLimits(1536, 16, 1024, 65536, 65536, 255, 256, 4, 100 * 1024, 99 * 1024, 1024, 128, 0),
    89: SMLimits(1536, 24, 1024, 65536, 65536, 255, 256, 4, 100 * 1024, 99 * 1024, 1024, 128, 0),
    90: SMLimits(2048, 32, 1024, 65536, 65536, 255, 256, 4, 228 * 1024, 227 * 1024, 1024, 128, 2),
}


def sm_limits(arch: int) -> SMLimits:
    """The limits of compute capability ``arch`` (e.g. 80), or of the nearest one below
    it in :data:`SM_LIMITS` (a newer GPU offers at least as much; 8.7 takes 8.6's
    smaller figures, 10.x and 12.x those of 9.0 and 8.9).

    Raises
    ------
    ValueError
        ``arch`` below 8.0 (the kernels need sm_80).
    """
    arch = int(arch)
    known = [a for a in sorted(SM_LIMITS) if a <= arch]
    if not known:
        raise ValueError(f"arch: the kernels need compute capability 8.0 or later, got {arch}")
    return SM_LIMITS[known[-1]]


# The compute capability whose sm_90a target the wgmma kernels are built for: wgmma
# and the "a" target run on 9.0 devices only (H100, H200, GH200), not on later ones.
WGMMA_ARCH = 90
# Compute capabilities whose FP64 tensor cores run at twice the FP64 CUDA-core rate
# (A100, A30; H100, H200): the DMMA kernels may replace the SIMT ones there.  Other
# GPUs lack the FP64 tensor cores' speed (RTX 30/40: FP64 at 1/64 rate either way)
# or are not known to gain (Blackwell).
DMMA_ARCHS = (80, 90)

# One compute capability per tile class (tile_class).
TILE_CLASS_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}


def tile_class(arch: int) -> str | None:
    """The tile-table row serving compute capability ``arch`` (e.g. 80), None below sm_80.

    By shared memory per SM: 164 KB (8.0, 8.7) "sm80", 100 KB (8.6, 8.9, 12.x)
    "sm86", 228 KB (9.0, 10.x, 11.x) "sm90".
    """
    arch = int(arch)
    if arch < 80:
        return None
    if arch in (80, 87):
        return "sm80"
    if arch in (86, 89) or arch >= 120:
        return "sm86"
    return "sm90"
