"""What each GPU architecture the kernels target offers: one table of limits.

Every place that needs a per-architecture number -- the static report's
occupancy, a family's tile choice (two CTAs per SM?), the split-KV heuristic,
the emulator's launch checks -- reads it from :data:`SM_LIMITS` through
:func:`sm_limits`, and the tensor-core tile tables pick their row with
:func:`tile_class`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SMLimits", "SM_LIMITS", "sm_limits", "tile_class", "TILE_CLASS_ARCH", "WGMMA_ARCH", "DMMA_ARCHS",
           "MULTIPROCESSORS", "multiprocessors"]


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
#   The same table for the rows the emulator also accepts: 7.0 (V100) 2048 threads
#   and 32 blocks per SM, 96 KB of shared memory per SM and per block; 7.5 (Turing)
#   1024 threads and 16 blocks, 64 KB per SM and per block; 8.7 (Jetson Orin) 1536
#   threads and 16 blocks, 164 KB per SM and 163 KB per block; 12.0 (RTX 50) 1536
#   threads and 24 blocks, 100 KB per SM and 99 KB per block.
# - NVIDIA Ampere / Ada / Hopper tuning guides, "Shared Memory": the driver
#   reserves 1 KB of shared memory per thread block (none before 8.0: the Volta and
#   Turing guides let one block use the whole 96 KB / 64 KB).
# - cuda_occupancy.h (CUDA toolkit): register allocation unit 256 per warp, 4
#   sub-partitions, shared memory granularity 128 bytes (256 on 7.x); block barriers
#   limit occupancy from Hopper on (2 per block slot on 9.0, 1 on 12.0); resident
#   blocks per SM as above (7.0: 32, 7.5: 16, 8.7: 16, 12.0: 24); largest shared
#   memory carveout 96 KB (7.0), 64 KB (7.5), 164 KB (8.0, 8.7), 100 KB (12.0).  tests/test_static_report.py checks occupancy()
#   against that header's calculator for every row.
SM_LIMITS: dict[int, SMLimits] = {
    70: SMLimits(2048, 32, 1024, 65536, 65536, 255, 256, 4, 96 * 1024, 96 * 1024, 0, 256, 0),
    75: SMLimits(1024, 16, 1024, 65536, 65536, 255, 256, 4, 64 * 1024, 64 * 1024, 0, 256, 0),
    80: SMLimits(2048, 32, 1024, 65536, 65536, 255, 256, 4, 164 * 1024, 163 * 1024, 1024, 128, 0),
    86: SMLimits(1536, 16, 1024, 65536, 65536, 255, 256, 4, 100 * 1024, 99 * 1024, 1024, 128, 0),
    87: SMLimits(1536, 16, 1024, 65536, 65536, 255, 256, 4, 164 * 1024, 163 * 1024, 1024, 128, 0),
    89: SMLimits(1536, 24, 1024, 65536, 65536, 255, 256, 4, 100 * 1024, 99 * 1024, 1024, 128, 0),
    90: SMLimits(2048, 32, 1024, 65536, 65536, 255, 256, 4, 228 * 1024, 227 * 1024, 1024, 128, 2),
    120: SMLimits(1536, 24, 1024, 65536, 65536, 255, 256, 4, 100 * 1024, 99 * 1024, 1024, 128, 1),
}


def sm_limits(arch: int) -> SMLimits:
    """The limits of compute capability ``arch`` (e.g. 80), or of the nearest one below
    it in :data:`SM_LIMITS`: for a compute capability without a row, an approximation
    (10.x and 11.x take 9.0's figures, though 11.0 keeps 24 blocks per SM, not 32).

    Raises
    ------
    ValueError
        ``arch`` below 7.0, the oldest row (Volta).

    Examples
    --------
    >>> sm_limits(90).shared_per_block_optin // 1024
    227
    >>> sm_limits(100) is SM_LIMITS[90]
    True
    """
    arch = int(arch)
    known = [a for a in sorted(SM_LIMITS) if a <= arch]
    if not known:
        oldest = min(SM_LIMITS)
        raise ValueError(f"arch: no limits known below compute capability {oldest // 10}.{oldest % 10} "
                         f"({oldest}), got {arch}")
    return SM_LIMITS[known[-1]]


# Not a limit of the compute capability but a product's SM count: the GPU the emulator
# stands in for when it is asked for ``arch`` (the forward's split-KV choice depends on
# it).  A100, RTX 3090, RTX 4090, H100 SXM.
MULTIPROCESSORS = {80: 108, 86: 82, 89: 128, 90: 132}


def multiprocessors(arch: int) -> int:
    """SM count of the representative GPU of compute capability ``arch``
    (:data:`MULTIPROCESSORS`; an A100's 108 for any other ``arch``)."""
    return MULTIPROCESSORS.get(int(arch), MULTIPROCESSORS[80])


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
