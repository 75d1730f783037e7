"""Launch heuristics shared by the forward families: how many splits of the keys.

A family owns its grid and shared memory
(:meth:`~cupyflash._families._family.Family.launch_config`); this module holds
what is decided across families: the split-KV count (:func:`num_splits`) and
the occupancy estimate it rests on (:func:`ctas_per_sm`).
"""

from __future__ import annotations

import functools

from ._arch import sm_limits
from ._families import Instantiation
from ._families._family import MAX_SPLITS

__all__ = ["num_splits", "ctas_per_sm", "MAX_SPLITS"]

# ---- split-KV ------------------------------------------------------------------------------------

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


def ctas_per_sm(inst: Instantiation, arch: int) -> int:
    """CTAs of ``inst`` one SM holds at once on compute capability ``arch``: the kernel's
    own occupancy target (its ``__launch_bounds__`` minimum, which caps the registers)
    bounded by the SM's shared memory -- an estimate for :func:`num_splits`.

    Raises
    ------
    ValueError
        ``inst`` is not of a family that splits keys (:attr:`Family.split_kv`).
    """
    if not inst.family.split_kv:
        raise ValueError(f"no split-KV for kernel family {inst.family.name!r}")
    limits = sm_limits(arch)
    shared = inst.family.shared_bytes(inst) + limits.shared_reserved_per_block
    return max(1, min(inst.family.min_ctas_per_sm(inst), limits.shared_per_sm // shared))


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
    if not inst.family.split_kv or seqlen_k <= 0:
        return 1
    ctas = -(-seqlen_q // inst.block_m) * heads * batch
    slots = max(1, ctas_per_sm(inst, arch) * int(multiprocessors))
    if ctas >= 0.8 * slots:
        return 1
    keys = seqlen_k   # the most keys one query block visits
    if window_left is not None and window_right is not None:
        keys = min(keys, inst.block_m + int(window_left) + int(window_right) + inst.block_n)
    key_blocks = -(-keys // inst.block_n)
    most = min(MAX_SPLITS, (keys // inst.block_n) // -(-_SPLIT_MIN_KEYS // inst.block_n),
               _SPLIT_MAX_WAVES * slots // ctas)

    def time(splits: int) -> int:   # in key blocks of one CTA
        return -(-ctas * splits // slots) * (-(-key_blocks // splits) + _CTA_OVERHEAD_BLOCKS)

    best = min(range(1, max(most, 1) + 1), key=lambda s: (time(s), s))
    return best if time(best) <= (1 - _SPLIT_MIN_GAIN) * time(1) else 1
