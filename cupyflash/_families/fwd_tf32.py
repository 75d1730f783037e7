"""fwd_tf32 (``cuda_src/fwd_tf32.cu``): float32 on the TF32 tensor cores (mma.sync m16n8k8 .tf32).

Only where the caller allows TF32 (``precision="tf32"``: each operand rounded
to TF32 once; ``"tf32x3"``: split into two TF32 parts, three products per
product), for float32 with ``head_dim == head_dim_v <= 128`` and a scale the
kernel can fold (:func:`~cupyflash._families.fwd_mma.folds_scale`) on sm_80 and
later, any strides (rows that are not 16-byte aligned are copied word by
word).  It takes precedence over fwd_dmma.
"""

from __future__ import annotations

from ._family import FEATURES, FORWARD, Call, Family, Sizes, smallest_fit
from .fwd_mma import folds_scale

__all__ = ["FWD_TF32", "TF32_HEAD_DIMS", "TF32_PASSES", "tf32_bucket"]

# attention(..., precision=...) -> TF32 MMAs per product.  precision="ieee" (the
# default) never runs the TF32 kernels.
TF32_PASSES = {"tf32": 1, "tf32x3": 3}
TF32_HEAD_DIMS = (32, 64, 128)


def tf32_bucket(call: Call, arch: int) -> int | None:
    """The head dim the TF32 kernels (fwd_tf32, bwd_tf32) run ``call`` in, or None where
    they do not apply (precision, dtype, head dims, arch below 8.0)."""
    if (call.precision in TF32_PASSES and call.dtype == "float32" and int(arch) >= 80
            and call.head_dim == call.head_dim_v):
        return smallest_fit(TF32_HEAD_DIMS, call.head_dim)
    return None


class FwdTf32(Family):
    name = "fwd_tf32"
    entry = "fwd_tf32.cu"
    split_kv = True
    takes = frozenset(FEATURES)   # score.cuh's terms and modifications, through score_epilogue
    # (block_m, block_n, warps) per head dim, both precisions: 4 warps of 16 query
    # rows (one m16 tile each); shared memory (Q + K + V) x 4 bytes, plus the small
    # TF32 parts of K and V (else of V alone) with three passes, within 80 KB (two
    # CTAs per sm_80 SM).  Registers from the static report (NVRTC 13.5, sm_80 / sm_90):
    # one pass 165-185 (at most 168 at d = 64 and 128: three CTAs per SM where the
    # shared memory allows), three 221-242 (two); no spills, nor under NVRTC 13.0 and
    # 12.0.  Not yet timed on a GPU.
    tiles = {
        32: (64, 64, 4),    # 24 KB (tf32x3: 40 KB)
        64: (64, 64, 4),    # 48 KB (tf32x3: 80 KB)
        128: (64, 32, 4),   # 64 KB (tf32x3: 80 KB, V's small plane only); 64 keys: 96 KB
    }
    # A call with score features at d = 128 takes 16-key blocks: with 32, one pass (held
    # to 168 registers, three CTAs per SM) spilled 12-28 B with mod_args tables (a
    # relative-position table, document ids, a prefix per batch) or two biases and a
    # mask (NVRTC 13.5, sm_80 / sm_90; 16 keys: no spills; benchmarks/results/terms/).
    feature_tiles = {128: (64, 16, 4)}
    # A call over a paged KV cache takes 32-key blocks at d = 64 and 16-key ones at
    # d = 128 (the feature tile): with the table lookups, one pass of the 64-key tile
    # spilled 16-64 B (NVRTC 13.5, sm_80 / sm_90; 32 keys: 153 / 159 registers) and of
    # d = 128's 32-key tile 8 B under NVRTC 13.0 on sm_80 (16 keys: 167, none under either;
    # tools/lengths_report.py --form paged).
    paged_tiles = {64: (64, 32, 4), 128: (64, 16, 4)}

    def make_row(self, head_dim: int, passes: int, features: bool = False, paged: bool = False):
        """``fwd_tf32_kernel<head_dim, block_m, block_n, warps, passes>`` (``features``: a
        call's with score features; ``paged``: over a paged KV cache)."""
        block_m, block_n, warps = self.tile(head_dim, features)
        if paged:
            block_m, block_n, warps = self.paged_tiles.get(head_dim, (block_m, block_n, warps))
        return self.row("fwd_tf32_kernel", head_dim, block_m, block_n, warps, passes, role=FORWARD,
                        dtype="float32", head_dim=head_dim, head_dim_v=head_dim, threads=32 * warps,
                        block_m=block_m, block_n=block_n, passes=passes)

    def build_rows(self):
        rows = [self.make_row(d, passes, features, paged) for passes in sorted(set(TF32_PASSES.values()))
                for d in self.tiles for features, paged in ((False, False), (True, False), (False, True))]
        return list(dict.fromkeys(rows))

    def launchable(self, arch: int):
        return self.rows if int(arch) >= 80 else ()

    def applies(self, call: Call, arch: int, options) -> bool:
        # a paged cache's rows only 16-byte aligned (its word-by-word copy reads dense rows)
        return folds_scale(call.scale) and tf32_bucket(call, arch) is not None and (call.aligned or not call.paged)

    def plan(self, call: Call, arch: int, options):
        return (self.make_row(tf32_bucket(call, arch), TF32_PASSES[call.precision], bool(call.features),
                              call.paged),)

    def shared_bytes(self, row, sizes: Sizes | None = None) -> int:
        # Tf32FwdTraits::kSmemBytes: Q, K and V tiles of floats; with three passes a second
        # plane (the small TF32 parts) for K and V, or else for V alone, within 80 KB.
        q, plane = row.block_m * row.head_dim * 4, row.block_n * row.head_dim * 4
        planes = 2
        if row.passes == 3:
            planes = 4 if q + 4 * plane <= 80 * 1024 else 3 if q + 3 * plane <= 80 * 1024 else 2
        return q + planes * plane

    def min_ctas_per_sm(self, row) -> int:
        return 2                                                            # Tf32FwdTraits


FWD_TF32 = FwdTf32()
