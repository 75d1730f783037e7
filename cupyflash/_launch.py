"""Launch configuration: grid, block and dynamic shared memory of each kernel.

One function, :func:`launch_config`, used by the GPU path and the emulator
alike, so both run a kernel with the same geometry.  The shared-memory sizes
mirror the kernels' own arithmetic (``SimtFwdTraits::kSmemBytes`` in
``cuda_src/fwd_simt.cu``, ``MmaFwdTraits::kSmemBytes`` in ``cuda_src/fwd_mma.cu``,
``WgmmaFwdTraits::kSmemBytes`` in ``cuda_src/fwd_wgmma.cu``,
``DmmaFwdTraits::kSmemBytes`` in ``cuda_src/fwd_dmma.cu``,
``Tf32FwdTraits::kSmemBytes`` in ``cuda_src/fwd_tf32.cu``;
the buffer list at the top of ``fwd_v1_kernel``).
"""

from __future__ import annotations

import functools
import math

from ._kernels import (Instantiation, bwd_dmma_shared_bytes, bwd_mma_shared_bytes, bwd_tf32_shared_bytes,
                       bwd_wgmma_shared_bytes)

__all__ = ["launch_config", "v1_block_sizes", "representative_shared_bytes", "backward_launch_config",
           "backward_kernel", "num_splits", "ctas_per_sm", "SPLIT_FAMILIES"]

_MAX_GRID_X = 2**31 - 1
_ACC_BYTES = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}

# fwd_v1's on-chip buffers per Q block of Br rows: l_i, m_i, m~_ij, 1/l_i^new, m_i^new, l_i^new.
_V1_ROW_VECTORS = 6


def v1_block_sizes(sram_size: int, head_dim: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Algorithm 1, line 1: ``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)``.

    ``M`` is the SRAM size in elements and ``d`` the q/k head dim.  A block
    longer than its sequence is cut to the sequence (same blocks, less shared
    memory).  Returns ``(Br, Bc)``.
    """
    if int(sram_size) < 1:
        raise ValueError(f"`sram_size` must be positive, got {sram_size}")
    d = max(int(head_dim), 1)
    b_c = math.ceil(int(sram_size) / (4 * d))
    b_r = min(b_c, d)
    return min(b_r, max(int(seqlen_q), 1)), min(b_c, max(int(seqlen_k), 1))


def _simt_shared_bytes(inst: Instantiation) -> int:
    # SimtFwdTraits::kSmemBytes: Q, then K and V in their own buffers for float32 /
    # float64 (copied with cp.async, kAsync), one shared K/V buffer for the 16-bit
    # types, then P (block_m rows of block_n + 8).
    if inst.dtype in ("float32", "float64"):
        kv = inst.block_n * (inst.head_dim + inst.head_dim_v)
    else:
        kv = inst.block_n * max(inst.head_dim, inst.head_dim_v)
    p = inst.block_m * (inst.block_n + 8)
    return (inst.block_m * inst.head_dim + kv + p) * _ACC_BYTES[inst.dtype]


def _mma_shared_bytes(inst: Instantiation) -> int:
    # MmaFwdTraits::kSmemBytes: Q, then kv_stages x (K, V), 16-bit elements; the
    # output is staged in the Q tile.
    return (inst.block_m + 2 * inst.kv_stages * inst.block_n) * inst.head_dim * 2


def _wgmma_shared_bytes(inst: Instantiation) -> int:
    # WgmmaFwdTraits::kSmemBytes: Q, then 2 x (K, V), 16-bit elements, and 1 KB
    # to align the tiles to 1024 bytes.
    return (inst.block_m + 2 * inst.kv_stages * inst.block_n) * inst.head_dim * 2 + 1024


def _dmma_shared_bytes(inst: Instantiation) -> int:
    # DmmaFwdTraits::kSmemBytes: Q, K and V tiles of doubles (float32 inputs, widened
    # on the way in: Q and one K/V buffer).
    return (inst.block_m + (2 if inst.dtype == "float64" else 1) * inst.block_n) * inst.head_dim * 8


def _tf32_shared_bytes(inst: Instantiation) -> int:
    # Tf32FwdTraits::kSmemBytes: Q, K and V tiles of floats; with three passes a second
    # plane (the small TF32 parts) for K and V, or else for V alone, within 80 KB.
    q, plane = inst.block_m * inst.head_dim * 4, inst.block_n * inst.head_dim * 4
    planes = 2
    if inst.passes == 3:
        planes = 4 if q + 4 * plane <= 80 * 1024 else 3 if q + 3 * plane <= 80 * 1024 else 2
    return q + planes * plane


def _v1_shared_bytes(inst: Instantiation, block_m: int, block_n: int, head_dim: int,
                     head_dim_v: int) -> int:
    elements = (block_n * (head_dim + head_dim_v) + block_m * (head_dim + head_dim_v)
                + block_m * block_n + _V1_ROW_VECTORS * block_m)
    return elements * _ACC_BYTES[inst.dtype]


def launch_config(inst: Instantiation, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                  head_dim: int = 0, head_dim_v: int = 0, sram_size: int | None = None,
                  num_splits: int = 1):
    """Grid, block and dynamic shared memory (bytes) for one launch of ``inst``.

    Parameters
    ----------
    inst : Instantiation
        A row of :func:`cupyflash._kernels.instantiations`.
    batch, heads : int
        Batch size and number of query heads.
    seqlen_q, seqlen_k : int
        Sequence lengths (``seqlen_q >= 1``: with no query rows there is nothing to launch).
    head_dim, head_dim_v : int
        Run-time head dims; only fwd_v1 sizes its buffers by them.
    sram_size : int, optional
        fwd_v1 only (required there): Algorithm 1's SRAM size ``M`` in elements.
    num_splits : int, optional
        Split-KV (:data:`SPLIT_FAMILIES`): the grid's y extent, one CTA
        per query block and split (see :func:`num_splits`).

    Returns
    -------
    grid : tuple of int
    block : tuple of int
    shared_mem : int

    Raises
    ------
    ValueError
        More CTAs than a one-dimensional grid allows, or a missing ``sram_size``.
    """
    if seqlen_q < 1 or batch < 1 or heads < 1:
        raise ValueError(f"nothing to launch: batch={batch}, heads={heads}, seqlen_q={seqlen_q}")
    block = (inst.threads, 1, 1)
    if num_splits != 1 and (inst.family not in SPLIT_FAMILIES or not 1 <= num_splits <= _MAX_SPLITS):
        raise ValueError(f"{inst.family}: num_splits={num_splits} (1 to {_MAX_SPLITS}, and only for "
                         f"{', '.join(SPLIT_FAMILIES)})")
    if inst.family == "fwd_combine":
        # one thread per 16-byte chunk of each output row (head_dim_v, run time)
        chunks = -(-max(int(head_dim_v), 1) // (16 // _ACC_BYTES[inst.dtype]))
        ctas = -(-seqlen_q * heads * batch * chunks // inst.threads)
        shared = 0
    elif inst.family == "fwd_simt":
        ctas = -(-seqlen_q // inst.block_m) * heads * batch
        shared = _simt_shared_bytes(inst)
    elif inst.family in ("fwd_mma", "fwd_wgmma"):
        if -(-seqlen_k // inst.block_n) > _MAX_GRID_X:   # the kernel counts key blocks in 32 bits
            raise ValueError(f"{inst.family}: seqlen_k={seqlen_k} has more than 2**31 - 1 key blocks")
        ctas = -(-seqlen_q // inst.block_m) * heads * batch
        shared = _mma_shared_bytes(inst) if inst.family == "fwd_mma" else _wgmma_shared_bytes(inst)
    elif inst.family == "fwd_dmma":
        ctas = -(-seqlen_q // inst.block_m) * heads * batch
        shared = _dmma_shared_bytes(inst)
    elif inst.family == "fwd_tf32":
        ctas = -(-seqlen_q // inst.block_m) * heads * batch
        shared = _tf32_shared_bytes(inst)
    elif inst.family == "fwd_v1":
        if sram_size is None:
            raise ValueError("fwd_v1 needs `sram_size` (Algorithm 1's M, in elements)")
        block_m, block_n = v1_block_sizes(sram_size, head_dim, seqlen_q, seqlen_k)
        ctas = heads * batch
        shared = _v1_shared_bytes(inst, block_m, block_n, head_dim, head_dim_v)
    else:
        raise ValueError(f"no launch configuration for kernel family {inst.family!r}")
    if ctas > _MAX_GRID_X:
        raise ValueError(
            f"{inst.family}: batch={batch}, heads={heads}, seqlen_q={seqlen_q} needs {ctas} CTAs; "
            f"a launch allows at most {_MAX_GRID_X}")
    return (ctas, num_splits, 1), block, shared


# ---- split-KV ------------------------------------------------------------------------------------

SPLIT_FAMILIES = ("fwd_simt", "fwd_mma", "fwd_wgmma", "fwd_dmma", "fwd_tf32")
_MAX_SPLITS = 64
# Keys a split visits at least: below that, reading its Q tile again and
# writing its partial rows (then fwd_combine reading them) stops being small
# next to the K/V blocks it streams.
_SPLIT_MIN_KEYS = 256
# What a CTA costs beyond its key blocks, in key blocks: loading its Q tile
# while the first K/V block is in flight, and writing its (partial) rows.
_CTA_OVERHEAD_BLOCKS = 2
# A split must promise at least this much less time than none.
_SPLIT_MIN_GAIN = 0.10
# Splits stop at this many waves of CTAs, which bounds the partial results
# (waves x CTA slots x block_m rows) whatever the key count; past a few waves
# the model's gain from evening out the last wave is a few percent.
_SPLIT_MAX_WAVES = 4
# Shared memory per SM (bytes, less 1 KB per resident CTA) by compute capability.
_SM_SHARED = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024, 90: 228 * 1024}


def ctas_per_sm(inst: Instantiation, arch: int) -> int:
    """CTAs of ``inst`` one SM holds at once on compute capability ``arch``: the kernel's
    own occupancy target (its ``__launch_bounds__`` minimum, which caps the registers)
    bounded by the SM's shared memory -- an estimate for :func:`num_splits`."""
    if inst.family == "fwd_simt":
        shared = _simt_shared_bytes(inst)
        target = 1 if shared > 64 * 1024 else 3 if shared > 48 * 1024 else 4   # SimtFwdTraits
    elif inst.family == "fwd_mma":
        shared = _mma_shared_bytes(inst)
        target = 2 if inst.threads <= 128 else 1                            # MmaFwdTraits
    elif inst.family == "fwd_wgmma":
        shared = _wgmma_shared_bytes(inst)
        target = 1
    elif inst.family == "fwd_dmma":
        shared = _dmma_shared_bytes(inst)
        target = 2                                                          # DmmaFwdTraits
    elif inst.family == "fwd_tf32":
        shared = _tf32_shared_bytes(inst)
        target = 2                                                          # Tf32FwdTraits
    else:
        raise ValueError(f"no split-KV for kernel family {inst.family!r}")
    sm_shared = _SM_SHARED.get(int(arch), min(_SM_SHARED.values()))
    return max(1, min(target, sm_shared // (shared + 1024)))


@functools.lru_cache(maxsize=4096)   # on every small-grid forward (decoding: every step)
def num_splits(inst: Instantiation, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
               arch: int, multiprocessors: int, window_left: int | None = None,
               window_right: int | None = None) -> int:
    """How many runs (splits) to cut each query block's keys into.

    One launch gives every query block one CTA.  When those CTAs fill less
    than 80 % of what the GPU holds at once (``multiprocessors`` x
    :func:`ctas_per_sm`) -- few heads, short query sequences, decoding -- the
    keys may be split: CTA (x, y) takes the y-th run of query block x's key
    blocks and fwd_combine merges the partial results.  The count minimises a
    simple model of the time, waves x (key blocks per split + 2 for the
    CTA's own Q tile and output), over the counts that leave every split at
    least 256 keys and the grid at most 4 waves (and at most 64); the
    smallest such count, and only if it promises at least 10 % less time
    than one split.  A window bounded on both sides (``window_left``,
    ``window_right``; None: unbounded) limits the keys a query block visits,
    and the model counts only those.  Returns 1 (no split) for the other
    families.
    """
    if inst.family not in SPLIT_FAMILIES or seqlen_k <= 0:
        return 1
    ctas = -(-seqlen_q // inst.block_m) * heads * batch
    slots = max(1, ctas_per_sm(inst, arch) * int(multiprocessors))
    if ctas >= 0.8 * slots:
        return 1
    keys = seqlen_k   # the most keys one query block visits
    if window_left is not None and window_right is not None:
        keys = min(keys, inst.block_m + int(window_left) + int(window_right) + inst.block_n)
    key_blocks = -(-keys // inst.block_n)
    most = min(_MAX_SPLITS, (keys // inst.block_n) // -(-_SPLIT_MIN_KEYS // inst.block_n),
               _SPLIT_MAX_WAVES * slots // ctas)

    def time(splits: int) -> int:   # in key blocks of one CTA
        return -(-ctas * splits // slots) * (-(-key_blocks // splits) + _CTA_OVERHEAD_BLOCKS)

    best = min(range(1, max(most, 1) + 1), key=lambda s: (time(s), s))
    return best if time(best) <= (1 - _SPLIT_MIN_GAIN) * time(1) else 1


def representative_shared_bytes(inst: Instantiation) -> int:
    """Dynamic shared memory of ``inst`` for the static report.

    fwd_simt's is fixed by its tiles; fwd_v1's is taken at d = dv = 64,
    L = 1024 and M = 8192 elements (Br = Bc = 32).
    """
    if inst.family == "fwd_v1":
        return launch_config(inst, batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=64,
                             head_dim_v=64, sram_size=8192)[2]
    if inst.family.startswith("bwd_"):
        return backward_launch_config(inst, batch=1, heads_q=1, heads_kv=1, seqlen_q=1, seqlen_k=1)[2]
    return launch_config(inst, batch=1, heads=1, seqlen_q=1, seqlen_k=1)[2]


# ---- backward ------------------------------------------------------------------------------------

def backward_kernel(inst: Instantiation) -> str:
    """Which backward kernel a catalogue row is: its template name without ``cf::``.

    ``"bwd_simt_dot_do_o_kernel"`` (delta), ``"bwd_simt_dkdv_kernel"``,
    ``"bwd_simt_dq_kernel"``, ``"bwd_mma_dkdv_kernel"``, ``"bwd_mma_dq_kernel"``,
    ``"bwd_wgmma_dkdv_kernel"``, ``"bwd_wgmma_dq_kernel"``, ``"bwd_dmma_dkdv_kernel"``,
    ``"bwd_dmma_dq_kernel"``, ``"bwd_tf32_dkdv_kernel"`` or ``"bwd_tf32_dq_kernel"``.
    """
    return inst.name_expression.split("<", 1)[0].removeprefix("cf::")


def _template_args(inst: Instantiation) -> list[str]:
    return [a.strip() for a in inst.name_expression.split("<", 1)[1].rstrip(">").split(",")]


def _bwd_shared_bytes(inst: Instantiation) -> int:
    kernel = backward_kernel(inst)
    if kernel == "bwd_simt_dot_do_o_kernel":
        return 0
    if kernel.startswith("bwd_simt_"):
        # SimtBwdTraits::kSmemBytes: own rows, a scratch tile for P / dS, then kStages
        # buffers of streamed rows, each a d-wide and a dv-wide tile.  Two buffers for float32 / float64
        # (cp.async prefetch) where they fit in 72 KB.
        own, streamed = (inst.block_n, inst.block_m) if kernel == "bwd_simt_dkdv_kernel" else (
            inst.block_m, inst.block_n)
        row_bytes = (inst.head_dim + inst.head_dim_v) * _ACC_BYTES[inst.dtype]
        scratch_bytes = own * (streamed + 8) * _ACC_BYTES[inst.dtype]   # P / dS, kSPitch
        own_bytes, stage_bytes = own * row_bytes + scratch_bytes, streamed * row_bytes
        pipelined = inst.dtype in ("float32", "float64") and own_bytes + 2 * stage_bytes <= 72 * 1024
        return own_bytes + (2 if pipelined else 1) * stage_bytes
    if kernel.startswith("bwd_dmma_"):
        # DmmaBwdTraits::kSmemBytes: the same shape for both kernels
        dkdv = kernel == "bwd_dmma_dkdv_kernel"
        own, streamed = (inst.block_n, inst.block_m) if dkdv else (inst.block_m, inst.block_n)
        return bwd_dmma_shared_bytes(inst.head_dim, own, streamed, inst.dtype)
    if kernel.startswith("bwd_tf32_"):
        # Tf32BwdTraits::kSmemBytes: the same shape for both kernels
        dkdv = kernel == "bwd_tf32_dkdv_kernel"
        own, streamed = (inst.block_n, inst.block_m) if dkdv else (inst.block_m, inst.block_n)
        return bwd_tf32_shared_bytes(inst.head_dim, own, streamed)
    if kernel.startswith("bwd_wgmma_"):
        # WgmmaBwdTraits::kSmemBytes; the dK/dV kernel's last template argument is
        # kGrads (V only for dK; bit 4: atomic dQ and its dS tile)
        dkdv = kernel == "bwd_wgmma_dkdv_kernel"
        own, streamed = (inst.block_n, inst.block_m) if dkdv else (inst.block_m, inst.block_n)
        grads = int(_template_args(inst)[-1]) if dkdv else 3
        return bwd_wgmma_shared_bytes(inst.head_dim, own, streamed, bool(grads & 2), bool(grads & 4))
    # MmaBwdTraits::kSmemBytes (V only when the dK/dV kernel computes dK)
    # and the dS tile of deterministic=False's atomic dQ (kGrads bit 4)
    grads = int(_template_args(inst)[5]) if kernel == "bwd_mma_dkdv_kernel" else 0
    if kernel == "bwd_mma_dkdv_kernel":
        own, streamed, needs_v = inst.block_n, inst.block_m, bool(grads & 2)
    else:
        own, streamed, needs_v = inst.block_m, inst.block_n, True
    return bwd_mma_shared_bytes(inst.head_dim, own, streamed, needs_v, inst.kv_stages, bool(grads & 4))


def backward_launch_config(inst: Instantiation, *, batch: int, heads_q: int, heads_kv: int,
                           seqlen_q: int, seqlen_k: int):
    """Grid, block and dynamic shared memory (bytes) for one backward launch of ``inst``.

    Parameters
    ----------
    inst : Instantiation
        A backward row of :func:`cupyflash._kernels.instantiations`.
    batch : int
        Batch size.
    heads_q, heads_kv : int
        Query heads and kv heads (``heads_q = gqa_ratio * heads_kv``).
    seqlen_q, seqlen_k : int
        Sequence lengths.  The delta and dQ kernels need ``seqlen_q >= 1``
        (one CTA per block of query rows), the dK/dV kernel ``seqlen_k >= 1``
        (one CTA per block of keys).

    Returns
    -------
    grid : tuple of int
    block : tuple of int
    shared_mem : int

    Raises
    ------
    ValueError
        Nothing to launch, more CTAs than a one-dimensional grid allows, or not
        a backward kernel.
    """
    kernel = backward_kernel(inst)
    if kernel in ("bwd_simt_dot_do_o_kernel", "bwd_simt_dq_kernel", "bwd_mma_dq_kernel", "bwd_wgmma_dq_kernel",
                  "bwd_dmma_dq_kernel", "bwd_tf32_dq_kernel"):
        heads, rows, block_rows = heads_q, seqlen_q, inst.block_m
    elif kernel in ("bwd_simt_dkdv_kernel", "bwd_mma_dkdv_kernel", "bwd_wgmma_dkdv_kernel", "bwd_dmma_dkdv_kernel",
                    "bwd_tf32_dkdv_kernel"):
        heads, rows, block_rows = heads_kv, seqlen_k, inst.block_n
    else:
        raise ValueError(f"no backward launch configuration for {inst.name_expression!r}")
    if batch < 1 or heads < 1 or rows < 1:
        raise ValueError(f"{kernel}: nothing to launch: batch={batch}, heads={heads}, "
                         f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
    if heads_q > 2**31 - 1:
        raise ValueError(f"{kernel}: heads_q={heads_q} must be below 2**31")
    ctas = -(-rows // block_rows) * heads * batch
    if ctas > _MAX_GRID_X:
        raise ValueError(
            f"{kernel}: batch={batch}, heads={heads}, seqlen_q={seqlen_q}, seqlen_k={seqlen_k} needs "
            f"{ctas} CTAs; a launch allows at most {_MAX_GRID_X}")
    return (ctas, 1, 1), (inst.threads, 1, 1), _bwd_shared_bytes(inst)
