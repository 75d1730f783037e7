"""Mutation harness: plant one known bug at a time and check that the tests catch it.

Usage (from anywhere inside a checkout)::

    python tests/mutations.py                 # every mutation
    python tests/mutations.py NAME [NAME ...] # only these
    python tests/mutations.py --fast          # the subset CI runs every time (tests/test_mutations.py)
    python tests/mutations.py --list          # names, files and selections, nothing run
    python tests/mutations.py --baseline ...  # first check that every selection passes unmutated

Each entry of :data:`MUTATIONS` is a file of the checkout, an exact text that
must occur in it exactly once, its replacement (the planted bug) and the pytest
selection that must catch it.  The harness copies the checkout's files (those
git tracks, plus untracked ones it does not ignore; without git, everything but
``.git`` and caches) to a temporary folder, checks that Python run there imports
*that* copy of cupyflash, and then, for one mutation at a time, writes the
mutated file, runs ``python -m pytest -x -q -p no:cacheprovider SELECTION`` in
the copy with an emulator cache of its own (``CUPYFLASH_EMULATOR_CACHE``, empty
at the start of the run; modules are keyed by their source, so a mutated kernel
is always rebuilt) and restores the file.  It prints one line per mutation,
``caught`` or ``SURVIVED`` (or ``MISSING`` when the text is not found exactly
once, ``ERROR`` when pytest could not run the selection: a selection that no
longer exists), with the seconds it took, then ``N caught, M survived`` and
exits 1 if anything was not caught -- so that the list is kept up to date as
the code moves.

A selection that skips (no g++ for the emulator) passes, and so reports the
mutation as SURVIVED: loud, as it should be.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str           # relative to the checkout's root
    text: str           # must occur exactly once
    replacement: str
    selection: tuple    # pytest arguments (test ids), relative to the root
    fast: bool = False  # in the subset CI runs every time (CPU path and NumPy code: no g++)
    why: str = ""


def M(name, file, text, replacement, *selection, fast=False, why=""):
    return Mutation(name, file, text, replacement, tuple(selection), fast, why)


T = "tests/"
RUNTIME = "cupyflash/emulator/src/runtime.cpp"
BARRIERS = T + "test_emulator_barriers.py::"
BIAS_KERNELS = T + "test_bias_mask_kernels.py::"
MODS = T + "test_score_mods.py::"
CPU_FUZZ = T + "test_fuzz.py::test_cpu_path_forward_matches_oracle"


def family_cases(test, family, *cases):
    """Test ids of tests/test_families.py's ``test`` for ``family``'s ``cases`` (its table rows)."""
    return [f"{T}test_families.py::{test}[{family}-{case}]" for case in cases]


def family_masks(test, family, *windows):
    """The ids of a mask test of tests/test_families.py: both length pairs, each window."""
    return family_cases(test, family, *(f"{lengths}-{w}" for lengths in ("lq>lk", "lq<lk") for w in windows))


SIMT_MASKS = ("causal", "full", "w16-0", "w0-0", "w5-40", "wN-9", "w31-N", "w0-N")
FWD_SIMT_MASKS = family_masks("test_forward_masks_match_oracle", "fwd_simt", *SIMT_MASKS)
FWD_SIMT_ROWS = family_cases("test_forward_every_instantiation_matches_oracle_with_tails", "fwd_simt",
                             *(f"{dtype}-{d}-{d}-{tile}" for dtype in ("float16", "bfloat16", "float32")
                               for d, tile in ((32, "64-32"), (64, "64-32"), (128, "32-32"), (256, "32-16"))),
                             "float64-32-32-32-32", "float64-64-64-32-32", "float64-128-128-32-16",
                             "float64-256-256-16-8")
BWD_MMA_CASES = family_cases("test_backward_every_instantiation_matches_oracle", "bwd_mma",
                             *(f"{dtype}-d{d}{'-causal' if bucket % 64 else ''}" for dtype in ("float16", "bfloat16")
                               for bucket, d in zip((32, 64, 96, 128, 160, 192, 224, 256),
                                                    (24, 64, 88, 128, 152, 192, 200, 256))))

MUTATIONS = [
    # ---- the CPU path (cupyflash/_cpu.py) and the NumPy code: cheap, the CI subset ---------------
    M("cpu-causal-diagonal-off-by-one", "cupyflash/_cpu.py",
      "diagonal = np.arange(rows)[:, None]",
      "diagonal = np.arange(rows)[:, None] + 1",
      T + "test_cpu_path.py::test_causal_is_not_top_left_aligned_when_lq_lt_lk", fast=True,
      why="audit: caught"),
    M("cpu-float32-accumulation-for-float64", "cupyflash/_dtypes.py",
      'return "float64" if dtype_name(dtype) == "float64" else "float32"',
      'return "float32"',
      T + "test_cpu_path.py::test_output_and_lse_dtypes", fast=True, why="audit: caught"),
    M("cpu-no-running-output-rescale", "cupyflash/_cpu.py",
      "acc *= alpha[..., None]", "acc *= 1",
      CPU_FUZZ, fast=True,
      why="audit finding 3: survived both CPU fuzzers, which never crossed a key block"),
    M("cpu-no-running-sum-rescale", "cupyflash/_cpu.py",
      "l *= alpha", "l *= 1",
      CPU_FUZZ, fast=True),
    M("cpu-lazy-limit-ignored", "cupyflash/_cpu.py",
      "if np.all(pv_block[..., dv] <= _LAZY_LIMIT):", "if True:",
      T + "test_cpu_path.py::test_later_key_blocks_with_larger_scores", fast=True),
    M("cpu-bias-query-axis-sliced-as-if-full", "cupyflash/_cpu.py",
      "rows = slice(0, 1) if x.shape[-2] == 1 else slice(i0, i1)", "rows = slice(i0, i1)",
      T + "test_bias_mask.py::test_bias_shapes_match_the_oracle[small-blocks-b11k]",
      why="a bias broadcast over the queries, past the first query block"),
    M("cpu-dbias-in-place-assigned-not-added", "cupyflash/_cpu.py",
      "_block_of(_index_into(dbias[t], idx), i0, i1, j0, j1)[...] += part",
      "_block_of(_index_into(dbias[t], idx), i0, i1, j0, j1)[...] = part",
      T + "test_bias_mask.py::test_bias_shapes_match_the_oracle[small-blocks-bh1k]",
      why="a term broadcast over the queries sums every query block into one row"),
    M("cpu-dbias-caller-sum-assigned-not-added", "cupyflash/_cpu.py",
      "_block_of(_index_into(dbias[t], idx), rows0, rows0 + part.shape[-2], j0, j1)[...] += part",
      "_block_of(_index_into(dbias[t], idx), rows0, rows0 + part.shape[-2], j0, j1)[...] = part",
      T + "test_bias_mask.py::test_bias_shapes_match_the_oracle",
      why="a term broadcast over a looped batch axis: the calling thread sums the tasks"),
    M("cpu-backward-ignores-the-bias", "cupyflash/_cpu.py",
      "            if terms:\n                d_cap, d_mod = terms.transform(p, i0, i1, j0, j1, grad=True)\n",
      "            if False:\n                d_cap, d_mod = terms.transform(p, i0, i1, j0, j1, grad=True)\n",
      T + "test_bias_mask.py::test_bias_shapes_match_the_oracle[default-blocks-11qk]", fast=True),
    M("cpu-backward-ignores-the-mask", "cupyflash/_cpu.py",
      "            if hidden is not None:\n                np.copyto(p, 0, where=hidden)",
      "            if False:\n                np.copyto(p, 0, where=hidden)",
      T + "test_bias_mask.py::test_mask_shapes_match_the_oracle[default-blocks-bhqk]"),
    M("cpu-mask-skips-blocks-it-does-not-hide", "cupyflash/_cpu.py",
      "return hidden is not None and bool(hidden.all())",
      "return hidden is not None and bool(hidden.any())",
      T + "test_bias_mask.py::test_mask_shapes_match_the_oracle", MODS + "test_mask_mod_matches_the_oracle",
      why="a block is skipped only when the mask and mask_mod hide all of it"),
    M("cpu-nan-bias-on-a-hidden-pair-read", "cupyflash/_cpu.py",
      "            np.copyto(s, -np.inf, where=hidden)",
      "            s[...] = np.where(hidden, s - np.inf, s)",
      T + "test_bias_mask.py::test_nan_in_bias_poisons_exactly_its_rows_unless_hidden",
      why="DESIGN 3b: a hidden pair's score is never read"),
    M("validation-bias-broadcast-not-checked", "cupyflash/_validation.py",
      "if len(shape) > len(target) or any(n not in (1, t) for n, t in zip(shape[::-1], target[::-1])):",
      "if len(shape) > len(target):",
      T + "test_bias_mask.py::test_bad_bias_is_refused_before_any_work", fast=True),
    M("oracle-ignores-the-bias", "cupyflash/reference.py",
      "        s = s + term\n", "        s = s + 0 * term\n",
      T + "test_bias_mask.py::test_oracle_dbias_matches_finite_differences", T + "test_bias_mask.py::test_bias_shapes_match_the_oracle"),
    M("cpu-lengths-padded-rows-left-unwritten", "cupyflash/_cpu.py",
      "                o[idx][..., q_len:, :] = 0\n", "                pass\n",
      T + "test_lengths.py::test_each_sequence_equals_plain_attention_on_it"),
    M("cpu-lengths-padded-keys-read", "cupyflash/_cpu.py",
      "kf = _index_into(k, idx)[..., :kv_len, :].astype(acc_t, copy=False)",
      "kf = _index_into(k, idx).astype(acc_t, copy=False)[..., :max(kv_len, 1), :]",
      T + "test_lengths.py::test_each_sequence_equals_plain_attention_on_it", fast=True,
      why="a padded key's NaN must reach nothing"),
    M("cpu-lengths-diagonal-of-the-padded-shape", "cupyflash/_cpu.py",
      "            mask_args = (kv_len - q_len, left, right)", "            mask_args = (lk - lq, left, right)",
      T + "test_lengths.py::test_each_sequence_equals_plain_attention_on_it",
      why="causal and window align to each sequence's own lengths"),
    M("cpu-lengths-backward-diagonal-of-the-padded-shape", "cupyflash/_cpu.py",
      "                   kv_len - q_len)\n", "                   lk - lq)\n",
      T + "test_lengths.py::test_each_sequence_equals_plain_attention_on_it"),
    M("validation-lengths-upper-bound-not-checked", "cupyflash/_validation.py",
      "bad = np.argwhere((host < 0) | (host > limit))", "bad = np.argwhere(host < 0)",
      T + "test_lengths.py::test_bad_lengths_are_refused_before_any_work"),
    M("kvcache-gather-pages-slot-major", "cupyflash/_kvcache.py",
      "return part.transpose(1, 0, 2, 3).reshape(h, n * p, d)[:, :length]",
      "return part.transpose(1, 2, 0, 3).reshape(h, n * p, d)[:, :length]",
      T + "test_kvcache.py::test_paged_attention_equals_dense_attention_over_the_gathered_pages", fast=True,
      why="key j is slot j % page_size of page j // page_size"),
    M("kvcache-append-to-the-first-page-only", "cupyflash/_kvcache.py",
      "pages = table[b, positions // k_cache.shape[2]]", "pages = table[b, 0 * positions]",
      T + "test_kvcache.py::test_append_to_a_paged_cache_then_attend"),
    M("kvcache-dense-capacity-not-checked", "cupyflash/_kvcache.py",
      "over = np.flatnonzero(lengths + new > capacity)", "over = np.flatnonzero(lengths < 0)",
      T + "test_kvcache.py::test_append_past_the_capacity_writes_nothing",
      why="nothing partially written"),
    M("dispatch-ignores-the-score-features", "cupyflash/_families/__init__.py",
      "if call.features <= family.takes and family.applies(call, int(arch), options):",
      "if family.applies(call, int(arch), options):",
      T + "test_dispatch.py::test_a_family_serves_score_features_only_if_it_takes_them", fast=True,
      why="a family must never silently ignore a bias or a mask"),
    M("cpu-backward-ds-sign", "cupyflash/_cpu.py",
      "ds -= delta[..., i0:i1, None]", "ds += delta[..., i0:i1, None]",
      T + "test_backward_cpu.py::test_backward_matches_naive_backward", fast=True),
    M("cpu-backward-dq-unscaled", "cupyflash/_cpu.py",
      "dq_i *= scale ", "dq_i *= 1 ",
      T + "test_backward_cpu.py::test_backward_matches_naive_backward", fast=True),
    M("cpu-gqa-head-h-uses-kv-head-h-mod-hkv", "cupyflash/_cpu.py",
      "return x.reshape(x.shape[:-3] + (x.shape[-3] // g, g) + x.shape[-2:])",
      "return np.swapaxes(x.reshape(x.shape[:-3] + (g, x.shape[-3] // g) + x.shape[-2:]), -4, -3)",
      T + "test_cpu_path.py::test_gqa_query_head_h_uses_kv_head_h_over_group", fast=True),
    M("validation-causal-not-folded-into-window", "cupyflash/_validation.py",
      "right = 0 if right is None else min(right, 0)", "right = 0 if right is None else right",
      T + "test_cpu_path.py::test_cpu_path_and_algorithm1_match_oracle", fast=True,
      why="audit finding 8: passed every oracle comparison while the oracle shared check_forward"),
    M("oracle-mask-off-by-one", "cupyflash/reference.py",
      "bounds.append(j <= i + offset + right)", "bounds.append(j <= i + offset + right + 1)",
      T + "test_cpu_path.py::test_oracle_follows_its_own_mask_rule", fast=True),
    # ---- the package's seams (issue 25): one NVRTC module, one naive attention ----------------
    M("loader-borrows-the-reports-nvrtc-again", "cupyflash/_loader.py",
      "    nvrtc = _nvrtc.compiler()\n",
      "    from ._report import _nvrtc as compiler\n\n    nvrtc = compiler()\n",
      T + "test_architecture.py::test_no_import_cycle_among_cupyflash_modules", fast=True,
      why="the _loader <-> _report circle issue 25 removed, back through a lazy import"),
    M("naive-peer-times-float64", "cupyflash/reference.py",
      "acc = accumulator_dtype(_dtype_of(q))", "acc = np.dtype(np.float64)",
      T + "test_bench.py::test_naive_peer_as_written_computes_in_the_accumulator_type", fast=True,
      why="bench and the check would time a float64 oracle, not what a user writes"),
    M("naive-peer-rows-without-keys-nan", "cupyflash/reference.py",
      "top = xp.where(top == -xp.inf, acc.type(0), top)", "pass",
      T + "test_bench.py::test_naive_peer_as_written_matches_the_oracle", fast=True),
    M("check-times-the-oracle", "cupyflash/_cli.py",
      "reference.naive_attention(q, k, v, oracle=False)", "reference.naive_attention(q, k, v)",
      T + "test_cli.py::test_the_check_times_the_naive_attention_bench_times", fast=True),

    # ---- the CUDA kernels, on the emulator (each recompiles its kernels with g++) ----------------
    M("mask-last-key-off-by-one", "cuda_src/mask.cuh",
      "return min64(seqlen_k - 1, i + diagonal + right); }",
      "return min64(seqlen_k - 1, i + diagonal + right + 1); }",
      *FWD_SIMT_MASKS, why="audit: caught"),
    M("fwd-mma-mask-includes-key-hi", "cuda_src/score.cuh",
      "hi = min(hi_base + q, keys);",
      "hi = min(hi_base + q + 1, keys);",
      *family_masks("test_forward_masks_match_oracle", "fwd_mma", "causal", "w16-0", "w0-0", "w5-40", "wN-9",
                    "w70-N"), why="audit: caught"),
    M("softmax-no-output-rescale", "cuda_src/softmax.cuh",
      "            l[r] = t;\n            scale_in_place(o[r], rescale);",
      "            l[r] = t;",
      *FWD_SIMT_MASKS, why="audit: caught"),
    M("softmax-no-row-sum-rescale", "cuda_src/softmax.cuh",
      "        l[r] *= rescale;\n", "",
      T + "test_fwd_mma.py::test_row_maxima_growing_from_block_to_block", why="audit: caught"),
    M("softmax-nan-row-sum-gives-minus-inf-lse", "cuda_src/softmax.cuh",
      "return l == Acc(0) ? neg_inf<Acc>()", "return !(l > Acc(0)) ? neg_inf<Acc>()",
      T + "test_bad_inputs.py::test_nonfinite_query_makes_its_row_nan_and_no_other", "-k", "emulator",
      why="audit: caught (the NaN-row bug of the first reliability sweep)"),
    M("fwd-simt-score-scale-off-by-1e-3", "cuda_src/fwd_simt.cu",
      "for (int jj = 0; jj < TN; ++jj) s[ii][jj] *= scale_log2;",
      "for (int jj = 0; jj < TN; ++jj) s[ii][jj] *= scale_log2 * Acc(1.001);",
      *FWD_SIMT_ROWS, why="the score epilogue: a relative error of 1e-3 in every logit"),
    M("fwd-gqa-head-h-reads-kv-head-h-mod-hkv", "cuda_src/block_info.cuh",
      "const int64_t head_kv = static_cast<int>(head) / static_cast<int>(p.gqa_ratio);",
      "const int64_t head_kv = static_cast<int>(head) % static_cast<int>(p.heads_q / p.gqa_ratio);",
      T + "test_kernels_emulated.py::test_gqa_query_heads_share_kv_heads"),
    M("bwd-simt-ds-adds-delta", "cuda_src/bwd_simt.cu",
      "dp[ii][jj] = p[ii][jj] * (dp[ii][jj] - query_stat<kQueryRows>(delta, ii, jj));",
      "dp[ii][jj] = p[ii][jj] * (dp[ii][jj] + query_stat<kQueryRows>(delta, ii, jj));",
      *family_masks("test_backward_masks_match_oracle", "bwd_simt", *SIMT_MASKS), why="dS of bwd_simt"),
    M("bwd-tensor-core-ds-adds-delta", "cuda_src/bwd_blocks.cuh",
      "dp[r][c] = p[r][c] * (dp[r][c] - delta(r, c));",
      "dp[r][c] = p[r][c] * (dp[r][c] + delta(r, c));",
      *family_masks("test_backward_masks_match_oracle", "bwd_mma", "causal", "w16-0", "w0-0", "w5-40", "w31-N"),
      why="dS of the tensor-core backward kernels (mma, wgmma, tf32, dmma)"),
    M("bwd-mma-dp-rounded-to-half-before-ds", "cuda_src/bwd_mma.cu",
      "mma_own_stream<Tr>(dp, sV, sdO, row0);                         // dP^T = V dO^T",
      "mma_own_stream<Tr>(dp, sV, sdO, row0); for (auto& row : dp) for (float& x : row) "
      "x = static_cast<float>(static_cast<T>(x));",
      *BWD_MMA_CASES,
      why="audit finding 2: a 2-3x precision loss that passed all 70 bwd_mma tests"),
    M("bwd-mma-dk-unscaled", "cuda_src/bwd_mma.cu",
      "static_cast<float>(p.scale), keys_valid, d);", "1.0f, keys_valid, d);",
      *BWD_MMA_CASES, why="dK scaling"),
    M("bwd-mma-dv-scaled", "cuda_src/bwd_mma.cu",
      "1.0f, keys_valid, static_cast<int>(p.head_dim_v));",
      "static_cast<float>(p.scale), keys_valid, static_cast<int>(p.head_dim_v));",
      *BWD_MMA_CASES, why="dV scaling"),
    M("bwd-mma-gqa-group-sums-one-head", "cuda_src/bwd_mma.cu",
      "const int64_t head_end = first_head + p.gqa_ratio;", "const int64_t head_end = first_head + 1;",
      *BWD_MMA_CASES,
      why="GQA: dK, dV summed over the group's query heads"),
    M("bwd-tf32-halved-gradients-at-large-scales", "cuda_src/bwd_tf32.cu",
      "store_row_tf32(dst + row * row_stride, g[r], factor, cols_valid)",
      "store_row_tf32(dst + row * row_stride, g[r], fabsf(factor) > 1.0f ? 0.5f * factor : factor, cols_valid)",
      T + "test_bwd_tf32.py::test_extreme_and_negative_scales[large-tf32x3]",
      why="audit finding 1: passed all 60 tests of test_bwd_tf32.py, whose large-scale test could not fail"),

    # ---- the Hopper kernels' schedule (issue 32): read in their SASS, and the emulator's checks -----
    M("fwd-wgmma-p-v-wait-beside-the-exponentials", "cuda_src/fwd_wgmma.cu",
      "        else wgmma_wait_all_apart(n_block, o, p);    // O and P(n - 1) free",
      "        else wgmma_wait<0>(o, p);                    // O and P(n - 1) free",
      T + "test_wgmma_schedule.py::test_forward_softmax_runs_while_p_v_is_in_flight",
      why="ptxas hoists a wait in the exponentials' basic block above all of them"),
    M("fwd-wgmma-copies-before-the-products", "cuda_src/fwd_wgmma.cu",
      "        wgmma_fence();\n        wgmma_qk<Tr>(s, sQ, kv.k(stage), wg_row0);   // S(n) = Q K(n)^T\n"
      "        wgmma_pv<Tr>(o, p, kv.v(stage ^ 1));         // O += P(n - 1) V(n - 1), behind it\n"
      "        products_issued(n_block, stage);\n",
      "        products_issued(n_block, stage);\n        wgmma_fence();\n        wgmma_qk<Tr>(s, sQ, kv.k(stage), wg_row0);\n"
      "        wgmma_pv<Tr>(o, p, kv.v(stage ^ 1));\n",
      T + "test_wgmma_schedule.py::test_forward_loop_issues_its_products_right_after_the_barrier"),
    M("bwd-wgmma-next-query-block-never-copied", "cuda_src/bwd_wgmma.cu",
      "                queries.issue_tiles(stage ^ 1, next_head, next_m);\n", "",
      *family_masks("test_backward_masks_match_oracle", "bwd_wgmma", "w16-0", "w0-0", "w5-40", "wN-9", "w130-N")),
    M("emulator-shared-memory-checked-at-first-retirement-only", "cupyflash/emulator/src/runtime.cpp",
      "if (nth == 1 || nth == 128)", "if (nth == 1)",
      T + "test_emulator_wgmma_checks.py::test_planted_register_and_shared_memory_faults_are_reported",
      why="issue 32, 4c"),
    M("emulator-in-flight-accumulator-writes-unchecked", "cupyflash/emulator/src/runtime.cpp",
      "if (std::memcmp(&p.d[e], &kWgmmaPoison, 4) != 0) {", "if (false) {",
      T + "test_emulator_wgmma_checks.py::test_planted_register_and_shared_memory_faults_are_reported",
      why="issue 32, 4b"),
    M("emulator-writes-after-the-fence-unchecked", "cupyflash/emulator/src/runtime.cpp",
      "if (std::memcmp(before + i, now + i, 4) != 0) {", "if (false) {",
      T + "test_emulator_wgmma_checks.py::test_planted_register_and_shared_memory_faults_are_reported",
      why="issue 32, 4a"),
    M("emulator-truncation-one-bit-short", "cupyflash/emulator/src/runtime.cpp",
      "const int shift = 23 + extra - emax;", "const int shift = 24 + extra - emax;",
      T + "test_emulator_wgmma_checks.py::test_truncating_mma_matches_the_model_bit_for_bit",
      T + "test_emulator_wgmma_checks.py::test_truncating_wgmma_matches_the_model_bit_for_bit", why="issue 32, 4d"),
    # ---- barriers.cuh on the emulator: mbarriers, named barriers, bulk reductions ----------------
    # (one per check of the runtime's model; tests/test_emulator_barriers.py)
    *[M(name, RUNTIME, text, replacement, *[BARRIERS + s for s in selection], why=why)
      for name, text, replacement, selection, why in (
        ("emulator-mbarrier-use-after-inval-unchecked", "if (!b || !b->live)", "if (!b)",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault2]"], ""),
        ("emulator-mbarrier-init-visibility-unchecked", "b->init_epoch == epoch &&", "b->init_epoch == epoch + 1 &&",
         ["test_use_before_the_init_is_visible_is_reported"], ""),
        ("emulator-mbarrier-second-init-unchecked", "if (b && b->live)", "if (false)",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault3]"], ""),
        ("emulator-mbarrier-extra-arrival-unchecked", "if (b.pending <= 0)", "if (b.pending < 0)",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault4]"], ""),
        ("emulator-mbarrier-arrival-before-wait-unchecked", "if (b.phase > 0 && !b.waited_prev)", "if (false)",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault5]"], ""),
        ("emulator-mbarrier-lapped-waiter-unchecked", "b.phase >= e.second + 2", "b.phase >= e.second + 3",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault6]"], ""),
        ("emulator-mbarrier-plain-access-unchecked",
         "for (size_t i = off; i < off + 8; ++i) shadow[i].pending = kPendMbar;", "",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault7]"], ""),
        ("emulator-mbarrier-parity-unchecked", "if (parity > 1)", "if (parity > 2)",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault13]"], ""),
        ("emulator-mbarrier-try-wait-parity-inverted", "if ((b.phase & 1) != parity) {", "if ((b.phase & 1) == parity) {",
         ["test_the_emulated_mbarrier_agrees_with_the_model"], "the Python model alone"),
        ("emulator-mbarrier-tx-count-ignored",
         "if (b.pending == 0 && b.tx == 0) mbar_complete(b);\n    }\n\n    void cp_async_mbar_arrive",
         "if (b.pending == 0) mbar_complete(b);\n    }\n\n    void cp_async_mbar_arrive",
         ["test_mbarrier_deadlocks_name_the_barrier_phase_and_counts[tx-pending]",
          "test_the_emulated_mbarrier_agrees_with_the_model"], ""),
        ("emulator-mbarrier-untracked-copies-at-exit-unchecked", "        if (untracked)\n", "        if (false)\n",
         ["test_mbarrier_misuse_is_reported_at_its_line[fault18]"], ""),
        ("emulator-mbarrier-copies-never-land",
         "        for (int a : b.arr_prev) land_arrival(a);\n        b.arr_prev.clear();", "        b.arr_prev.clear();",
         ["test_the_pipeline_matches_numpy"], ""),
        ("emulator-mbarrier-copies-land-at-the-arrive", "        b.arr_cur.push_back(a);", "        land_arrival(a);",
         ["test_copies_are_invisible_to_a_consumer_that_does_not_wait"], "data visible before the wait"),
        ("emulator-mbarrier-arrival-releases-nothing", "            if (hb) release(f, b.vc_cur);", "",
         ["test_a_plain_store_handoff_is_ordered_by_the_phases"], "a false race"),
        ("emulator-mbarrier-copies-release-nothing", "            e = std::max(e, agent_clock[f->tid]);", "",
         ["test_the_pipeline_matches_numpy"], "a false race"),
        ("emulator-vector-clocks-order-everything",
         "        return vcs[static_cast<size_t>(f->tid) * nclocks + clock_index(u)] >= c;",
         "        return vcs[static_cast<size_t>(f->tid) * nclocks + clock_index(u)] >= 0 * c;",
         ["test_unordered_handoffs_are_races[consumer-reads-before-waiting]",
          "test_an_unsynchronised_ping_pong_is_a_race"], "a missed race"),
        ("emulator-syncwarp-joins-no-clocks",
         "                if ((mask >> l) & 1) release(&fibers[base + l], joined);", "",
         ["test_a_plain_store_handoff_is_ordered_by_the_phases[lane-0-after-syncwarp]"], "a false race"),
        ("emulator-named-barrier-count-not-whole-warps", "threads <= 0 || threads % 32 ||", "threads <= 0 || threads % 16 ||",
         ["test_named_barrier_misuse_is_reported[fault2]"], ""),
        ("emulator-named-barrier-two-counts-unchecked", "if (nb.count && nb.count != threads)", "if (false)",
         ["test_named_barrier_misuse_is_reported[fault4]"], ""),
        ("emulator-named-barrier-divergence-unchecked",
         "            if (other_bar || g.state == St::WarpOp || g.state == St::BlockBar)",
         "            if (g.state == St::WarpOp || g.state == St::BlockBar)",
         ["test_named_barrier_misuse_is_reported[fault5]"], ""),
        ("emulator-named-barrier-double-arrival-unchecked", "if ((nb.warps >> warp) & 1)", "if (false)",
         ["test_named_barrier_misuse_is_reported[fault8]"], ""),
        ("emulator-named-barrier-releases-nothing", "            if (hb) release(&g, nb.vc);", "",
         ["test_a_named_barrier_ping_pong_matches_numpy"], "a false race"),
        ("emulator-barrier-0-beside-syncthreads-unchecked", "        if (nbars[0].count)", "        if (false)",
         ["test_barrier_0_with_another_count_beside_syncthreads_is_reported_from_either_side"], ""),
        ("emulator-barrier-0-after-syncthreads-unchecked", "if (id == 0 && at_bar)", "if (false)",
         ["test_barrier_0_with_another_count_beside_syncthreads_is_reported_from_either_side"], ""),
        ("emulator-bulk-size-unchecked", "if (bytes == 0 || bytes % 16)", "if (bytes == 0 || bytes % 8)",
         ["test_bulk_reduction_misuse_is_reported[bug4-ex]"], ""),
        ("emulator-bulk-source-alignment-unchecked", "        if (off % 16)\n            fail(format(\"%s: %s source",
         "        if (off % 4)\n            fail(format(\"%s: %s source",
         ["test_bulk_reduction_misuse_is_reported[bug5-ex]"], ""),
        ("emulator-bulk-destination-alignment-unchecked", "reinterpret_cast<uintptr_t>(d) % 16",
         "reinterpret_cast<uintptr_t>(d) % 4", ["test_bulk_reduction_misuse_is_reported[bug6-ex]"], ""),
        ("emulator-bulk-proxy-fence-unchecked",
         "for (size_t i = off; i < off + bytes; ++i) check_proxy_fence(*f, i, what, \"the bulk copy engine\", pc);", "",
         ["test_bulk_reduction_misuse_is_reported[bug1-ex_ordered]"], ""),
        ("emulator-bulk-source-writes-unmarked", "                shadow[i].pending = kPendBulk;", "",
         ["test_bulk_reduction_misuse_is_reported[bug2-ex]"], ""),
        ("emulator-bulk-source-unchecked-at-retirement", "            if (now[i] != then[i])", "            if (false)",
         ["test_bulk_reduction_misuse_is_reported[bug2-ex_plain]"], ""),
        ("emulator-bulk-exit-before-wait-read-unchecked",
         "            for (const BulkOp& op : sync[f->tid].bulk)\n                if (!op.read_retired)",
         "            for (const BulkOp& op : sync[f->tid].bulk)\n                if (false)",
         ["test_bulk_reduction_misuse_is_reported[bug3-ex]"], ""),
        ("emulator-bulk-adds-at-wait-read", "if (!read_only && !sync[f->tid].bulk.empty()) {",
         "if (!sync[f->tid].bulk.empty()) {", ["test_bulk_additions_land_at_bulk_wait_not_at_wait_read"], ""),
        ("emulator-bulk-adds-dropped-at-exit", "        bulk_perform(f, std::numeric_limits<uint32_t>::max());", "",
         ["test_bulk_reductions_add_every_block_exactly[exits-after-wait-read]"], ""),
    )],
    # ---- semaphores on the emulator: suspended blocks and the rules of a post ----------------------
    # (one per check of the runtime's model; tests/test_emulator_semaphores.py)
    *[M(name, RUNTIME, text, replacement, *[T + "test_emulator_semaphores.py::" + s for s in selection],
        why="issue 32: ordered dQ")
      for name, text, replacement, selection in (
        ("emulator-semaphore-post-with-bulk-in-flight-unchecked",
         "            if (!ts.bulk.empty())\n                fail(format(\"%s: semaphore_post(",
         "            if (false)\n                fail(format(\"%s: semaphore_post(",
         ["test_planted_faults_are_reported[post-before-completion]"]),
        ("emulator-semaphore-post-ordering-unchecked", "if (hb && ts.bulk_done && !ordered(f, g.tid, ts.bulk_done))",
         "if (false)", ["test_a_post_not_ordered_after_the_lanes_completion_is_reported"]),
        ("emulator-semaphore-later-block-unchecked",
         "if (post != sem_posts.end() && post->second.value == value && post->second.block > linear(block)) {",
         "if (false) {",
         ["test_planted_faults_are_reported[waits-for-a-later-block]"]),
        ("emulator-semaphore-grid-deadlock-passes", "            L.grid_deadlock();\n            return false;",
         "            return true;", ["test_planted_faults_are_reported[deadlock]"]),
        ("emulator-semaphore-in-shared-memory-unchecked",
         "if ((a + 4 > smem_alloc && a < smem_alloc + smem_alloc_size) || on_stack(",
         "if (on_stack(", ["test_planted_faults_are_reported[in-shared-memory]"]),
        ("emulator-semaphore-reader-proxy-fence-unchecked", "if (last_acquire > sync[f->tid].global_fence)",
         "if (false)", ["test_planted_faults_are_reported[no-reader-fence]"]),
        ("emulator-semaphore-writer-proxy-fence-unchecked", "if (ts.bulk_done_event > ts.global_fence)", "if (false)",
         ["test_planted_faults_are_reported[no-writer-fence]"]),
        ("emulator-suspended-block-loses-its-shared-memory",
         "        std::swap_ranges(smem, smem + smem_size, s.smem.begin());\n", "",
         ["test_turns_add_in_block_order_whatever_order_the_blocks_start_in[1-True]"]),
        ("emulator-suspended-block-loses-its-runnable-threads", "        run_next.swap(s.run_next);\n", "",
         ["test_turns_add_in_block_order_whatever_order_the_blocks_start_in[1-True]"]),
    )],
    # ---- setmaxnreg on the emulator: the warpgroup collective and the CTA's register pool ---------
    # (one per check of the runtime's model; tests/test_emulator_setmaxnreg.py)
    *[M(name, RUNTIME, text, replacement, *[T + "test_emulator_setmaxnreg.py::" + s for s in selection], why=why)
      for name, text, replacement, selection, why in (
        ("emulator-setmaxnreg-count-not-a-multiple-of-8-unchecked", "if (regs < 24 || regs > 256 || regs % 8)",
         "if (regs < 24 || regs > 256)", ["test_setmaxnreg_misuse_is_reported_at_its_line[fault9-ex]"], ""),
        ("emulator-setmaxnreg-incomplete-warpgroup-unchecked",
         "if (first + 128 > static_cast<int>(nthreads))\n            fail(format(\"%s executes %s%s, but its warpgroup",
         "if (false)\n            fail(format(\"%s executes %s%s, but its warpgroup",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault7-ex]"], "a deadlock instead"),
        ("emulator-setmaxnreg-exited-thread-unchecked",
         "            if (g.state == St::Exited)\n                fail(format(\"%s executes %s%s, but %s of its warpgroup",
         "            if (false)\n                fail(format(\"%s executes %s%s, but %s of its warpgroup",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault8-ex_ordered]"], "a deadlock instead"),
        ("emulator-setmaxnreg-exit-while-waited-for-unchecked",
         "if (at_setmaxnreg && (f->warp & ~3) * 32 + 128 <= static_cast<int>(nthreads))", "if (false)",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault2-ex_ordered]"], "a deadlock instead"),
        ("emulator-setmaxnreg-call-site-unchecked", "if (g.op_variant != variant || g.op_pc != pc)",
         "if (g.op_variant != variant)", ["test_setmaxnreg_misuse_is_reported_at_its_line[fault10-ex]"], ""),
        ("emulator-setmaxnreg-count-and-action-unchecked", "if (g.op_variant != variant || g.op_pc != pc)",
         "if (g.op_pc != pc)", ["test_setmaxnreg_misuse_is_reported_at_its_line[fault13-ex]"],
         "one call site, two counts"),
        ("emulator-setmaxnreg-divergent-warp-unchecked", "if (g.warp == f->warp && ((g.state",
         "if (false && ((g.state", ["test_setmaxnreg_misuse_is_reported_at_its_line[fault11-ex_ordered]"], ""),
        ("emulator-setmaxnreg-dec-may-raise", "if (!inc && regs > now)", "if (false)",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault4-ex]"], ""),
        ("emulator-setmaxnreg-inc-may-lower", "if (inc && regs < now)", "if (false)",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault5-ex]"], ""),
        ("emulator-setmaxnreg-pool-unchecked", "        if (reg_pool < need) return false;\n", "",
         ["test_setmaxnreg_misuse_is_reported_at_its_line[fault6-ex]",
          "test_a_producer_handing_registers_to_two_consumers_matches_numpy[inc-first]"],
         "an .inc before the .dec"),
        ("emulator-setmaxnreg-dec-gives-nothing-back", "reg_pool += static_cast<int64_t>(now - regs) * 128;", "",
         ["test_the_emulated_register_pool_agrees_with_the_model"], "the Python model alone"),
        ("emulator-setmaxnreg-waiting-inc-never-granted", "if (setmaxnreg_granted(reg_waiting[i]))", "if (false)",
         ["test_a_producer_handing_registers_to_two_consumers_matches_numpy[inc-first]"], ""),
        ("emulator-setmaxnreg-start-ignores-register-quarters", "16384 / (32 * ((nwarps + 3) / 4))",
         "65536 / (32 * nwarps)", ["test_each_warp_starts_with_the_most_registers_one_block_per_sm_allows[288]"],
         "9 warps: 224, not 168"),
        ("emulator-setmaxnreg-start-255-rounded-down", "reg_start = std::min(256,", "reg_start = std::min(248,",
         ["test_each_warp_starts_with_the_most_registers_one_block_per_sm_allows[256]"], ""),
    )],
    # ---- the happens-before checks the decoupled forward needed (its survivors showed them missing)
    M("emulator-wgmma-reads-end-at-issue", RUNTIME,
      "            if (race && f->lane == 0) {\n                const int w = f->warp & 3;",
      "            if (false) {\n                const int w = f->warp & 3;",
      T + "test_emulator_wgmma_checks.py::test_a_hand_off_that_only_the_schedule_saves_is_reported"
          "[released-before-the-wait]", why="issue 32: decoupled forward"),
    M("emulator-proxy-fence-any-time-before-the-read", RUNTIME,
      "        if (hb && s.w_epoch == epoch && s.w_tid != reader.tid) {",
      "        if (false) {",
      T + "test_emulator_wgmma_checks.py::test_a_hand_off_that_only_the_schedule_saves_is_reported"
          "[fence-after-the-arrival]", why="issue 32: decoupled forward"),
    M("emulator-named-barrier-arrivals-left-at-exit", RUNTIME,
      "                if (live == 0) return named_barriers_complete() ? Ran::Done : Ran::Failed;",
      "                if (live == 0) return Ran::Done;",
      T + "test_emulator_barriers.py::test_named_barrier_misuse_is_reported[fault10]",
      why="issue 32: decoupled forward"),
    M("first-contact-decoder-one-bit-off", "benchmarks/gpu_first_contact.py",
      "ulp = Fraction(2) ** (top - 23 - extra_bits)", "ulp = Fraction(2) ** (top - 24 - extra_bits)",
      T + "test_gpu_first_contact.py::test_a_truncating_accumulator_is_decoded_with_its_bits", fast=True),

    # ---- the CPU path's threads and error hints (issue 33) --------------------------------------
    M("cpu-backward-dq-part-overwrites", "cupyflash/_cpu.py",
      "grads[1][..., rows0:rows0 + dq_part.shape[-2], :] += dq_part",
      "grads[1][..., rows0:rows0 + dq_part.shape[-2], :] = dq_part",
      T + "test_backward_cpu.py::test_backward_with_small_blocks_matches_naive_backward", fast=True,
      why="dQ summed over the key-block tasks: needs more than one key block"),
    M("cpu-blas-not-held-to-one-thread", "cupyflash/_threads.py",
      "lib.set_num_threads(1)", "lib.set_num_threads(lib.num_threads)",
      T + "test_cpu_threads.py::test_tasks_run_on_the_pool_with_blas_on_one_thread", fast=True),
    M("validation-no-gqa-hint", "cupyflash/_validation.py",
      "if hk == hv and 1 < hk < hq and hq % hk == 0:", "if False:",
      T + "test_error_hints.py::test_gqa_head_counts_without_enable_gqa_suggest_it", fast=True),

    # ---- merge_attention and ring attention (issue 31) ------------------------------------------
    M("merge-weights-without-the-shift", "cupyflash/_merge.py",
      "weight = xp.exp(xp.take(lses, i, axis=ax) - lse_shift)",
      "weight = xp.exp(xp.take(lses, i, axis=ax) - shift)",
      T + "test_merge.py::test_merge_float64_equals_single_call_to_1e_12", fast=True),
    M("ring-pair-slice-one-key-short", "cupyflash/distributed.py",
      "c1 = nk if hi is None else min(nk, nq + hi)", "c1 = nk if hi is None else min(nk, nq + hi - 1)",
      T + "test_distributed.py::test_pair_slices_give_exactly_the_global_band", fast=True),
    M("ring-dv-accumulator-overwritten", "cupyflash/distributed.py",
      "            grads[1][..., keys, :] += dv_s", "            grads[1][..., keys, :] = dv_s",
      T + "test_distributed.py::test_ring_equals_single_process_attention_under_mpiexec[3]"),

    # ---- the framework adapters (issue 30) ------------------------------------------------------
    M("torch-window-sides-swapped", "cupyflash/torch.py",
      "window = None if window_left == window_right == -1 else (window_left, window_right)",
      "window = None if window_left == window_right == -1 else (window_right, window_left)",
      T + "test_torch_adapter.py::test_output_and_gradients_match_sdpa_math_float64[window]"),
    M("torch-gradients-out-of-order", "cupyflash/torch.py",
      "return (dq, dk, dv) + (None,) * len(ctx.arguments)",
      "return (dq, dv, dk) + (None,) * len(ctx.arguments)",
      T + "test_torch_adapter.py::test_gradcheck_float64"),
    M("jax-vmap-method-expand-dims", "cupyflash/jax.py",
      'dout, q, k, v, out, lse, vmap_method="broadcast_all")',
      'dout, q, k, v, out, lse, vmap_method="expand_dims")',
      T + "test_jax_adapter.py::test_vmap_of_forward_and_grad_with_an_unbatched_argument"),

    # ---- kernel families and dispatch options (issue 25) ----------------------------------------
    M("fwd-mma-takes-scales-it-cannot-fold", "cupyflash/_families/fwd_mma.py",
      "return folds_scale(call.scale) and mma_bucket(call, arch) is not None",
      "return mma_bucket(call, arch) is not None",
      T + "test_families.py::test_dispatch_picks_the_family_where_it_applies_and_leaves_other_calls[fwd_mma]",
      fast=True, why="a tiny scale times log2(e) is 0 in float32 there: -inf * 0 = NaN"),
    M("fwd-dmma-float32-shared-memory-of-two-kv-buffers", "cupyflash/_families/fwd_dmma.py",
      '(2 if row.dtype == "float64" else 1)', "2",
      T + "test_families.py::test_launch_config_grid_block_and_shared_memory[fwd_dmma]", fast=True),
    M("whole-kv-rows-ignore-the-option", "cupyflash/_families/fwd_mma.py",
      "head_dim == bucket and options.whole_blocks", "head_dim == bucket",
      T + "test_families.py::test_the_whole_kv_row_only_for_whole_key_blocks_at_the_bucket[fwd_mma]", fast=True),
    M("wgmma-switch-not-stripped", "cupyflash/_options.py",
      'wgmma = env.get(WGMMA_ENV, "").strip().lower() in _TRUE',
      'wgmma = env.get(WGMMA_ENV, "").lower() in _TRUE',
      T + "test_dispatch.py::test_wgmma_is_read_from_the_environment_as_before", fast=True),
    M("dmma-all-without-float32", "cupyflash/_options.py",
      'if words & {"float32", "all"}:', 'if words & {"float32"}:',
      T + "test_dispatch.py::test_dmma_is_read_from_the_environment_as_before", fast=True),
    M("options-families-not-resolved", "cupyflash/_families/__init__.py",
      "    for family in options.resolve(families):", "    for family in families:",
      T + "test_dispatch.py::test_a_family_in_the_options_replaces_the_registrys", fast=True),
    M("environment-not-read-per-call", "cupyflash/_dispatch.py",
      "options=KernelOptions.from_environment() if options is None else options)",
      "options=KernelOptions.from_environment({}) if options is None else options)",
      T + "test_dispatch.py::test_the_environment_is_read_at_each_call", fast=True),
    M("split-kv-occupancy-for-any-family", "cupyflash/_launch.py",
      "    if not inst.family.split_kv:\n", "    if False:\n",
      T + "test_split_kv.py::test_ctas_per_sm_follows_the_occupancy_targets_and_shared_memory", fast=True),
    M("bwd-tf32-shared-memory-one-stage", "cupyflash/_families/bwd_tf32.py",
      "return (2 * own + 4 * streamed) * row.head_dim * 4", "return (2 * own + 2 * streamed) * row.head_dim * 4",
      T + "test_shared_bytes.py::test_launch_shared_bytes_equal_the_traits[bwd_tf32.cu]",
      why="the Python formula against the C++ kSmemBytes"),
    M("score-epilogue-transposed-mask-includes-key-hi", "cuda_src/score.cuh",
      "rule.range(frag.col(c), lo, hi);\n                if constexpr (Rule::kBoundsQueries) {\n"
      "                    if (rule.gone(frag.col(c)) || k < lo || k >= hi) x[r][c] = hidden;",
      "rule.range(frag.col(c), lo, hi);\n                if constexpr (Rule::kBoundsQueries) {\n"
      "                    if (rule.gone(frag.col(c)) || k < lo || k > hi) x[r][c] = hidden;",
      *family_masks("test_backward_masks_match_oracle", "bwd_mma", "causal", "w16-0", "w5-40"),
      why="the dK/dV kernels' S^T tiles, walked element by element: keys are the rows"),
    M("score-epilogue-query-walk-skips-the-last-query", "cuda_src/score.cuh",
      "    } else if constexpr (kWalk == Walk::kByQuery) {\n#pragma unroll\n        for (int c = 0; c < C; ++c) {",
      "    } else if constexpr (kWalk == Walk::kByQuery) {\n#pragma unroll\n        for (int c = 0; c < C - 1; ++c) {",
      *family_cases("test_backward_masks_match_oracle", "bwd_tf32",
                    *(f"tf32-{lengths}-{w}" for lengths in ("lq>lk", "lq<lk") for w in ("causal", "w16-0", "w5-40"))),
      why="the S^T tiles walked query by query (bwd_tc_loops: bwd_tf32, bwd_dmma)"),
    M("forward-loop-tile-origin-without-the-warp-row", "cuda_src/fwd_loop.cuh",
      "ScoreTile{tile.batch, tile.head, block.m0 + Tr::first_row(me), n0, 0,",
      "ScoreTile{tile.batch, tile.head, block.m0, n0, 0,",
      *family_masks("test_forward_masks_match_oracle", "fwd_dmma", "causal", "w5-40")),
    M("fwd-dmma-scores-scaled-by-1e-3-more", "cuda_src/fwd_dmma.cu",
      "for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] *= scale_log2;",
      "for (int c = 0; c < Tr::kSCols; ++c) s[mi][c] *= scale_log2 * 1.001;",
      T + "test_families.py::test_forward_every_instantiation_matches_oracle_with_tails[fwd_dmma-32-64-32-4]"),
    M("combine-launched-with-the-splits-grid", "cupyflash/_run.py",
      "one_row = replace(sizes, num_splits=1)", "one_row = sizes",
      T + "test_split_kv.py::test_split_and_unsplit_agree"),
    # the score terms (bias, mask) in the kernels: score.cuh and the launches around it
    M("terms-bias-in-natural-units", "cuda_src/score.cuh",
      "return bias_sum(a, b) * Acc(kLog2e);", "return bias_sum(a, b);",
      BIAS_KERNELS + "test_forward_families_match_the_oracle[simt-f32]",
      why="the log2-unit scores need log2(e) * bias"),
    M("terms-raw-scores-not-scaled-before-the-bias", "cuda_src/score.cuh",
      "fma(x, scale_log2, bias) : x + bias", "x + bias : x + bias",
      BIAS_KERNELS + "test_forward_families_match_the_oracle[mma-f16]",
      why="fwd_mma/fwd_wgmma/fwd_tf32 hold q.k: the epilogue must apply the scale"),
    M("terms-softmax-scales-again", "cuda_src/score.cuh",
      "return kEpilogueScales ? Acc(1) : static_cast<Acc>(p.scale_log2);",
      "return static_cast<Acc>(p.scale_log2);",
      BIAS_KERNELS + "test_forward_families_match_the_oracle[wgmma-f16]"),
    M("terms-tf32-softmax-scales-again", "cuda_src/fwd_tf32.cu",
      "update_unscaled<false>(s, o, kEpilogueScales ? 1.0f : scale_log2);",
      "update_unscaled<false>(s, o, scale_log2);",
      BIAS_KERNELS + "test_forward_families_match_the_oracle[tf32x3]"),
    M("terms-mask-ignored-by-the-backward", "cuda_src/score.cuh",
      "s[r][c] = terms.admits(a, b) && mods.admits(i, j) ? x : Acc(0);", "s[r][c] = mods.admits(i, j) ? x : Acc(0);",
      BIAS_KERNELS + "test_backward_families_match_the_oracle[dmma-f64]"),
    M("terms-tile-rows-past-lq-read", "cuda_src/score.cuh",
      "f(r, c, a, b, a < queries_left && b < keys_left);", "f(r, c, a, b, b < keys_left);",
      BIAS_KERNELS + "test_terms_outside_the_view_are_never_read[mma-f16]",
      why="the padding rows of a tile must read no term (past the view: anything, NaN here)"),
    M("bias-gradient-query-sum-from-one-lane", "cuda_src/score.cuh",
      "            sum = group_sum<Frag::kRowLanes>(sum);\n", "",
      BIAS_KERNELS + "test_backward_families_match_the_oracle[mma-f16]",
      why="a term broadcast along the queries sums over the lanes holding a key's queries"),
    M("bias-gradient-of-bwd-simt-not-added", "cuda_src/bwd_simt.cu",
      "        gradient_epilogue<Acc>(dp, s, chain, me,", "        if (false) gradient_epilogue<Acc>(dp, s, chain, me,",
      BIAS_KERNELS + "test_backward_families_match_the_oracle[simt-f64]"),
    M("bias-gradient-launches-not-split", "cupyflash/_dispatch.py",
      "split = [n > 1 and any(v.strides[a] == 0 for v in views) for a, n in enumerate(shape)]",
      "split = [False for n in shape]",
      BIAS_KERNELS + "test_launches_keep_bias_gradient_writes_disjoint",
      why="two CTAs would add into one dbias element (the emulator runs CTAs in turn, so only the "
          "launch count shows it)"),
    M("bias-gradient-of-a-row-constant-computed", "cupyflash/_dispatch.py",
      "views = tuple(None if (b.shape[-1:] in ((), (1,)))", "views = tuple(None if False",
      BIAS_KERNELS + "test_a_term_constant_along_the_keys_has_exactly_zero_gradient"),
    # score modifications (softcap, ALiBi, score_mod, mask_mod) on the NumPy path
    M("mods-softcap-derivative-sign", "cupyflash/_mods.py",
      "d_cap = 1 - t * t", "d_cap = 1 + t * t",
      MODS + "test_softcap_matches_the_oracle_and_the_expression_written_by_hand[5.0]", fast=True),
    M("mods-alibi-without-the-diagonal", "cupyflash/_mods.py",
      "np.abs(rows + offset - keys)", "np.abs(rows - keys)",
      MODS + "test_alibi_with_lq_ne_lk_causal_and_gqa[lq<lk]", fast=True),
    M("cpu-score-mod-derivative-ignored", "cupyflash/_cpu.py",
      "                    ds *= d_mod\n", "                    pass\n",
      MODS + "test_score_mod_matches_the_oracle[temperature per batch]", fast=True),
    M("expr-tanh-derivative-sign", "cupyflash/_expr.py",
      "return _mul(_sub(_num(1.0), _mul(t, t)), da)", "return _mul(_add(_num(1.0), _mul(t, t)), da)",
      MODS + "test_the_derived_gradient_matches_finite_differences"),
    M("expr-min-takes-the-other-branch", "cupyflash/_expr.py",
      'pick = Node("op", "bool", "<=" if name == "min" else ">=", (a, b))',
      'pick = Node("op", "bool", ">=" if name == "min" else "<=", (a, b))',
      MODS + "test_the_derived_gradient_matches_finite_differences"),
    M("expr-negative-index-wraps", "cupyflash/_expr.py",
      "if i.size and (i.min() < 0 or i.max() >= size):", "if i.size and i.max() >= size:",
      MODS + "test_an_index_out_of_bounds_raises_index_error"),
    M("expr-comparison-binds-looser-than-and", "cupyflash/_expr.py",
      "return self.binary((\"&\",), self.not_, self.logical)", "return self.binary((\"&\",), self.sum, self.logical)",
      MODS + "test_and_or_bind_looser_than_comparisons"),
    M("mods-kernel-alibi-sign", "cuda_src/score.cuh",
      "if constexpr (Mods::kAlibi) s -= slope", "if constexpr (Mods::kAlibi) s += slope",
      MODS + "test_forward_kernels_take_every_modification[simt-f32-d64]"),
    M("mods-kernel-softcap-skipped", "cuda_src/score.cuh",
      "            return cap * t;\n", "            return s;\n",
      MODS + "test_forward_kernels_take_every_modification[mma-f16-d64]"),
    M("mods-kernel-mask-mod-ignored-by-the-backward", "cuda_src/score.cuh",
      "s[r][c] = terms.admits(a, b) && mods.admits(i, j) ? x : Acc(0);", "s[r][c] = terms.admits(a, b) ? x : Acc(0);",
      MODS + "test_backward_kernels_take_alibi_and_mask_mod[dmma-f64]"),
    M("mods-kernel-index-unchecked", "cuda_src/score.cuh",
      "if (at[axis] < 0 || at[axis] >= p.mod_shape[t][axis]) mod_index_fault();", "",
      MODS + "test_an_index_out_of_bounds_on_the_emulator_raises_index_error"),
    M("mods-kernel-chain-without-the-softcap", "cuda_src/score.cuh",
      "for (int c = 0; c < C; ++c) ds[r][c] *= cap[r][c];", "for (int c = 0; c < C; ++c) ds[r][c] *= Acc(1);",
      MODS + "test_backward_kernels_carry_the_chain_rule[simt-f32-d64]"),
    M("mods-kernel-chain-without-score-mods-derivative", "cuda_src/score.cuh",
      "ds[r][c] = prob[r][c] == Acc(0) ? Acc(0) : ds[r][c] * mod[r][c];",
      "ds[r][c] = prob[r][c] == Acc(0) ? Acc(0) : ds[r][c];",
      MODS + "test_backward_kernels_carry_the_chain_rule[mma-f16-d64]"),
    # score_mod's constant derivative and the tiles that keep modified kernels from spilling
    M("mods-kernel-every-derivative-taken-for-a-number", "cuda_src/score.cuh",
      "static constexpr bool kModGradConst = kScoreMod && CF_SCORE_MOD_GRAD_CONST != 0;",
      "static constexpr bool kModGradConst = kScoreMod;",
      MODS + "test_backward_kernels_carry_the_chain_rule[mma-f16-d64]",
      why="a derivative that varies must be kept per element, not dropped"),
    M("mods-expr-every-derivative-constant", "cupyflash/_expr.py",
      "    return node.kind not in (\"name\", \"index\") and all(constant(a) for a in node.args)",
      "    return True",
      MODS + "test_backward_kernels_carry_the_chain_rule[simt-f32-d64]",
      why="a derivative naming score evaluated with no context"),
    M("bwd-dmma-dp-product-first", "cuda_src/bwd_dmma.cu",
      "    static constexpr bool kDvFirst = (kAnyTerms || kSeqLengths) && kHeadDim_ >= 128;",
      "    static constexpr bool kDvFirst = false;",
      "tests/test_static_report.py::test_rows_planned_for_a_score_modification_do_not_spill[bwd_dmma.cu-80]",
      why="the d = 128 dK/dV kernel spilled 16 B with the distance kernel in that order"),
    M("fwd-tf32-feature-tile-ignored", "cupyflash/_families/fwd_tf32.py",
      "TF32_PASSES[call.precision], bool(call.features),", "TF32_PASSES[call.precision], False,",
      MODS + "test_forward_kernels_take_every_modification[tf32x3-d128]"),
    M("bwd-wgmma-mods-launch-dv-and-dk-together", "cupyflash/_families/bwd_wgmma.py",
      "self.mod_tiles[head_dim] if modified and head_dim in self.mod_tiles",
      "self.mod_tiles[head_dim] if False and head_dim in self.mod_tiles",
      "tests/test_static_report.py::test_rows_planned_for_a_score_modification_do_not_spill[bwd_wgmma.cu-90]"),
    M("oracle-softcap-left-out-of-the-chain", "cupyflash/reference.py",
      "        ds = ds * d_cap\n", "        pass\n",
      MODS + "test_softcap_matches_the_oracle_and_the_expression_written_by_hand[30.0]",
      why="the oracle's backward and the library's must not share a mistake: FD checks the library"),
    # ---- per-sequence lengths in one launch (cuda_src/sequence.cuh; issue 27) ----------------------
    M("seq-keys-from-the-query-start", "cuda_src/block_info.cuh",
      "k += p.first_key * p.k_row_stride;", "k += p.first_row * p.k_row_stride;",
      T + "test_lengths_kernels.py::test_packed_sequences_in_one_launch[simt-f32]",
      why="a packed sequence's keys start at its own first key"),
    M("seq-key-length-is-the-query-length", "cuda_src/sequence.cuh",
      "p.seqlen_k = sequence_entry(launch, kSeqKLen, batch);",
      "p.seqlen_k = sequence_entry(launch, kSeqQLen, batch);",
      T + "test_lengths_kernels.py::test_padded_forward_is_one_launch_per_family[mma-f16]"),
    M("seq-delta-of-the-packed-start-ignored", "cuda_src/block_info_bwd.cuh",
      "delta += f.first_row * p.delta_row_stride;", "",
      T + "test_lengths_kernels.py::test_packed_sequences_in_one_launch[mma-f16]"),
    M("seq-slot-runs-the-wrong-batch-entry", "cuda_src/sequence.cuh",
      "return sequence_entry(p, kSeqOrder, slot);", "return sequence_entry(p, kSeqOrder, 0);",
      T + "test_lengths_kernels.py::test_padded_forward_is_one_launch_per_family[simt-f32]"),
    M("seq-past-end-skips-the-last-key-block", "cuda_src/block_info_bwd.cuh",
      "return n_block * block_n >= seq.seqlen_k;", "return (n_block + 1) * block_n >= seq.seqlen_k;",
      T + "test_lengths_kernels.py::test_padded_backward_is_one_launch_per_kernel[simt-f32]"),
    M("seq-combine-writes-past-the-length", "cuda_src/fwd_combine.cu",
      "if (kSeqLengths && i >= sequence_entry(p, kSeqQLen, batch)) return;",
      "if (kSeqLengths && i > sequence_entry(p, kSeqQLen, batch)) return;",
      T + "test_lengths_kernels.py::test_window_and_split_kv_with_lengths"),
    M("seq-split-rows-of-the-sequence", "cuda_src/block_info.cuh",
      "const int64_t rows = kSeqLengths ? p.split_rows : p.seqlen_q;", "const int64_t rows = p.seqlen_q;",
      T + "test_lengths_kernels.py::test_window_and_split_kv_with_lengths"),
    M("seq-bwd-dmma-dp-first-with-lengths", "cuda_src/bwd_dmma.cu",
      "kDvFirst = (kAnyTerms || kSeqLengths) && kHeadDim_ >= 128;", "kDvFirst = kAnyTerms && kHeadDim_ >= 128;",
      T + "test_static_report.py::test_rows_planned_with_lengths_do_not_spill[bwd_dmma.cu-80]",
      why="the float64 d = 128 dK/dV kernel spilled 20 B with lengths in that order"),
    M("seq-bwd-tf32-dp-first-with-lengths", "cuda_src/bwd_tf32.cu",
      "kDvFirst = kSeqLengths && kHeadDim >= 128 && kPasses == 3 && kCompiledForSm90;", "kDvFirst = false;",
      T + "test_static_report.py::test_rows_planned_with_lengths_do_not_spill[bwd_tf32.cu-90]"),
    M("decode-gqa-heads-not-packed", "cupyflash/_run.py",
      "if (q.shape[2] == 1 and gqa_ratio > 1 and window_left is None",
      "if (q.shape[2] == 1 and gqa_ratio > 99 and window_left is None",
      T + "test_lengths_kernels.py::test_decode_packs_the_query_heads_of_a_kv_head[gqa-4:1]"),
    M("decode-gqa-packed-rows-keep-the-causal-bound", "cupyflash/_run.py",
      "gqa_ratio, window_right = 1, None", "gqa_ratio, window_right = 1, window_right",
      T + "test_lengths_kernels.py::test_decode_packs_the_query_heads_of_a_kv_head[gqa-4:1]",
      why="packed as rows of one block, the heads would sit at other diagonals"),
    M("decode-gqa-packed-with-a-left-bound", "cupyflash/_run.py",
      "and window_left is None and not terms.features", "and not terms.features",
      T + "test_lengths_kernels.py::test_decode_packs_the_query_heads_of_a_kv_head[window-not-packed]"),
    M("seq-table-not-longest-first-but-shuffled-lengths", "cupyflash/_dispatch.py",
      "return np.stack([zeros, q_len, zeros, kv_len]).astype(np.int64)",
      "return np.stack([zeros, q_len[::-1], zeros, kv_len]).astype(np.int64)",
      T + "test_lengths_kernels.py::test_padded_forward_is_one_launch_per_family[simt-f32]"),
    # ---- paged KV caches in the kernels (cuda_src/paged.cuh) ----
    M("paged-page-of-the-next-key", "cuda_src/paged.cuh",
      "const unsigned page = key / size;", "const unsigned page = (key + 1) / size;",
      T + "test_kvcache_kernels.py::test_paged_decode_page_sizes[17]"),
    M("paged-every-sequence-reads-the-first-table-row", "cuda_src/paged.cuh",
      "static_cast<int32_t>(batch * p.table_stride)", "0",
      T + "test_kvcache_kernels.py::test_paged_decode_page_sizes[16]"),
    M("paged-key-block-offset-dropped", "cuda_src/paged.cuh",
      "src.first += static_cast<int32_t>(n0);", "",
      T + "test_kvcache_kernels.py::test_paged_decode_page_sizes[1]"),
    M("paged-mma-copies-one-row-per-pass", "cuda_src/mma_tile.cuh",
      "row_at(src, first_row + r, row_stride) + 8 * c0", "row_at(src, first_row + r0, row_stride) + 8 * c0",
      T + "test_kvcache_kernels.py::test_paged_prefill_and_decode_per_family[mma-f16]"),
    M("paged-float-rows-from-the-first-pass", "cuda_src/tile_io.cuh",
      "bytes > 0 ? src.row(r, row_stride) + c : src.base", "bytes > 0 ? src.row(r0, row_stride) + c : src.base",
      T + "test_kvcache_kernels.py::test_paged_prefill_and_decode_per_family[simt-f64]"),
    M("paged-converting-load-of-the-first-chunk", "cuda_src/tile_io.cuh",
      "if (r < rows_valid) in = *reinterpret_cast<const Vec16<T>*>(row_at(src, r, row_stride) + c);",
      "if (r < rows_valid) in = *reinterpret_cast<const Vec16<T>*>(row_at(src, r, row_stride));",
      T + "test_kvcache_kernels.py::test_paged_rows_only_fwd_simt_takes[f16-d-not-dv]"),
    M("paged-tf32-units-of-the-wrong-row", "cuda_src/tf32_tile.cuh",
      "valid > 0 ? row_at(src, r, row_stride) + c : any_row(src)",
      "valid > 0 ? row_at(src, r ^ 1, row_stride) + c : any_row(src)",
      T + "test_kvcache_kernels.py::test_paged_prefill_and_decode_per_family[tf32x3]"),
    M("paged-view-without-the-page-stride", "cupyflash/_kvcache.py",
      "return KernelView(cache, (batch, cache.shape[1], capacity, cache.shape[3]), cache.strides)",
      "return KernelView(cache, (batch, cache.shape[1], capacity, cache.shape[3]), (0,) + cache.strides[1:])",
      T + "test_kvcache_kernels.py::test_paged_decode_page_sizes[16]"),
    M("paged-rows-past-the-queries-not-zeroed", "cupyflash/_kvcache.py",
      "    target[...] = 0\n", "",
      T + "test_kvcache_kernels.py::test_paged_decode_with_a_window_and_query_lengths"),
    M("decode-simt-output-pointers-across-the-loop", "cuda_src/fwd_loop.cuh",
      "} else if constexpr (kSeqLengths) {", "} else if constexpr (false) {",
      T + "test_static_report.py::test_rows_planned_over_a_kv_cache_do_not_spill[fwd_simt.cu-80-padded]"),
    M("paged-mma-keeps-the-spilling-tile", "cupyflash/_families/fwd_mma.py",
      "            tile = self.paged_tiles.get(bucket, tile)", "            pass",
      T + "test_kvcache_kernels.py::test_paged_tiles_are_planned[mma-f16]", fast=True),
    M("paged-tf32-takes-unaligned-pages", "cupyflash/_families/fwd_tf32.py",
      "and (call.aligned or not call.paged)", "",
      T + "test_kvcache_kernels.py::test_paged_tiles_are_planned[tf32x3]", fast=True),
    M("async-dq-source-rewritten-before-its-read", "cuda_src/bwd_wgmma.cu",
      "if (warp_id() == 0) bulk_wait_read<0>();  // the last block's dQ read from sdQ", "",
      T + "test_families.py::test_backward_every_instantiation_matches_oracle[bwd_wgmma-float16-d128]",
      why="issue 32: asynchronous dQ"),
    M("async-dq-tile-not-fenced-for-the-bulk-reads", "cuda_src/bwd_wgmma.cu",
      "fence_proxy_async_shared();  // the tile's stores before the bulk reads", "",
      T + "test_families.py::test_backward_every_instantiation_matches_oracle[bwd_wgmma-float16-d128]",
      why="issue 32: asynchronous dQ"),
    M("async-dq-without-scale", "cuda_src/bwd_wgmma.cu",
      "make_float2(acc[r][c] * scale, acc[r][c + 1] * scale)", "make_float2(acc[r][c], acc[r][c + 1])",
      T + "test_families.py::test_backward_every_instantiation_matches_oracle[bwd_wgmma-bfloat16-d104]",
      why="issue 32: asynchronous dQ"),
    M("async-dq-rows-sent-without-their-padding", "cuda_src/bwd_wgmma.cu",
      "sdQ + row * Tr::kDqStride, static_cast", "sdQ + row * Tr::kHeadDim, static_cast",
      T + "test_families.py::test_backward_every_instantiation_matches_oracle[bwd_wgmma-float16-d40]",
      why="issue 32: asynchronous dQ"),
    M("async-dq-on-8-byte-rows", "cupyflash/_families/bwd_wgmma.py",
      "bulk_dq = options.async_dq and call.dq_aligned_16\n", "bulk_dq = options.async_dq\n",
      T + "test_bwd_wgmma.py::test_async_dq_is_opt_in_and_needs_16_byte_aligned_dq_rows",
      why="issue 32: asynchronous dQ"),
    # the ordered dQ (deterministic, key blocks taking turns per query block)
    *[M(name, "cuda_src/bwd_wgmma.cu", text, replacement,
        T + "test_bwd_wgmma.py::test_ordered_dq_is_the_same_sum_whatever_order_the_blocks_run_in" + case,
        why="issue 32: ordered dQ")
      for name, text, replacement, case in (
        ("ordered-dq-without-turns",
         "                            if (lane_id() == 0)\n                                semaphore_wait(", 
         "                            if (false)\n                                semaphore_wait(", "[d64-causal]"),
        ("ordered-dq-no-proxy-fence-after-the-acquire",
         "                            fence_proxy_async_global();  // ... which go through the async proxy\n", "",
         "[d64-causal]"),
        ("ordered-dq-no-proxy-fence-before-the-post",
         "                            fence_proxy_async_global();  // ... for the generic proxy too\n", "",
         "[d64-causal]"),
        ("ordered-dq-posts-before-its-additions-complete",
         "                            bulk_wait<0>();  // this lane's additions complete\n", "", "[d64-causal]"),
        ("ordered-dq-posts-before-the-other-lanes-complete",
         "                            __syncwarp();    // ... every lane's, before lane 0 posts\n", "", "[d64-causal]"),
        ("ordered-dq-turn-ignores-the-key-block-before",
         "m_block < turn_below ? static_cast<int>(tile.n_block) : 0", "static_cast<int>(tile.n_block)",
         "[d128-window]"),   # (causal, Lq < Lk, every key block adds into every query block)
        ("ordered-dq-turns-shared-by-the-query-heads", "(batch * launch.fwd.heads_q + head) * m_blocks",
         "(batch * launch.fwd.heads_q) * m_blocks", "[d128-full]"),
    )],
    *[M(name, "cuda_src/bwd_wgmma.cu", text, replacement,
        T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]",
        why="issue 32: the decoupled dK/dV kernel's turns")
      for name, text, replacement in (
        ("decoupled-dkdv-turns-not-waited-for",
         "                named_barrier_sync(kTurnBarrier + (warp_id() >> 2), 2 * 128);  // this warpgroup's turn\n", ""),
        ("decoupled-dkdv-turn-passed-after-the-last-turn", "if (warp_id() >> 2 == 0 || has_next) named_barrier_arrive(",
         "if (true) named_barrier_arrive("),
        ("decoupled-dkdv-first-turn-never-given",
         "        if (warp_id() >> 2 == 1 && m_begin < m_end) named_barrier_arrive(kTurnBarrier, 2 * 128);\n", ""),
    )],
    M("fwd-timing-before-fixes-ignored", "cuda_src/fwd_wgmma.cu",
      "constexpr bool kTimingBeforeFixes = CF_TIMING_BEFORE_FIXES != 0;", "constexpr bool kTimingBeforeFixes = false;",
      T + "test_wgmma_schedule.py::test_the_loop_before_the_fixes_fails_both_rules",
      why="issue 32: the loop before fixes 1+2"),
    M("bwd-timing-no-copy-ignored", "cuda_src/bwd_wgmma.cu",
      "constexpr bool kBwdTimingNoCopy = CF_TIMING_NO_COPY != 0;", "constexpr bool kBwdTimingNoCopy = false;",
      T + "test_bwd_wgmma.py::test_the_timing_only_backward_runs_without_its_copies",
      why="issue 32: timing-only builds"),
    M("ordered-dq-fused-at-d128", "cupyflash/_families/bwd_wgmma.py",
      "        if ordered and head_dim in self.ordered_tiles:", "        if False:",
      T + "test_bwd_wgmma.py::test_async_dq_is_opt_in_and_needs_16_byte_aligned_dq_rows",
      why="issue 32: ordered dQ (the fused d = 128 row spills)"),
    M("decoupled-products-skip-the-values-barrier", "cuda_src/fwd_wgmma.cu",
      '            if (with_values) mbarrier_wait_parity(',
      '            if (false) mbarrier_wait_parity(',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-producer-publishes-before-the-copies-land", "cuda_src/fwd_wgmma.cu",
      "        if (unpublished != nullptr) publish_copies<1>(unpublished);",
      "        if (unpublished != nullptr) publish_copies<2>(unpublished);",
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-producer-refills-a-buffer-in-use", "cuda_src/fwd_wgmma.cu",
      '        if (use == 0) return;',
      '        return;',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-waits-for-the-wrong-phase", "cuda_src/fwd_wgmma.cu",
      'mbarrier_wait_parity(&bars->full_k[i & 1], static_cast<uint32_t>(i >> 1) & 1);',
      'mbarrier_wait_parity(&bars->full_k[i & 1], static_cast<uint32_t>(i) & 1);',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-turns-not-waited-for", "cuda_src/fwd_wgmma.cu",
      '            named_barrier_sync(kTurnBarrier + wg, 2 * 128);',
      '',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-empty-barriers-count-half-the-consumers", "cuda_src/fwd_wgmma.cu",
      '        if (threadIdx.x == 0) bars->init(Tr::kThreads);',
      '        if (threadIdx.x == 0) bars->init(Tr::kThreads / 2);',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-producer-publishes-without-a-proxy-fence", "cuda_src/fwd_wgmma.cu",
      "        if (unpublished != nullptr) publish_copies<1>(unpublished);",
      "        if (unpublished != nullptr) {\n            cp_async_wait<1>();\n            mbarrier_arrive(unpublished);\n        }",
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-values-released-before-p-v-retires", "cuda_src/fwd_wgmma.cu",
      '        else wgmma_wait_all_apart(n_block, o, p);    // O and P(n - 1) free\n        values_read(stage ^ 1);',
      '        else {\n            values_read(stage ^ 1);\n            wgmma_wait_all_apart(n_block, o, p);\n        }\n        if constexpr (kTimingBeforeFixes) values_read(stage ^ 1);',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-turn-passed-after-the-last-turn", "cuda_src/fwd_wgmma.cu",
      '            if (wg != kWarpGroups - 1 || n_block + 1 < n_end)',
      '            if (true)',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-consumers-take-more-registers-than-the-producer-frees", "cuda_src/fwd_wgmma.cu",
      'constexpr int kProducerRegs = 40, kConsumerRegs = 232;',
      'constexpr int kProducerRegs = 40, kConsumerRegs = 240;',
      T + "test_fwd_wgmma.py::test_decoupled_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="issue 32: decoupled forward"),
    M("decoupled-dkdv-producer-refills-a-stage-in-use", "cuda_src/bwd_wgmma.cu",
      "            if (use > 0) {  // the stage's previous block read by every consumer",
      "            if (false) {",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("decoupled-dkdv-producer-publishes-before-the-copies-land", "cuda_src/bwd_wgmma.cu",
      "            if (unpublished != nullptr) publish_copies<1>(unpublished);",
      "            if (unpublished != nullptr) publish_copies<2>(unpublished);",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("decoupled-dkdv-waits-for-the-wrong-phase", "cuda_src/bwd_wgmma.cu",
      "mbarrier_wait_parity(&bars->full[stage], (walked >> 1) & 1);",
      "mbarrier_wait_parity(&bars->full[stage], walked & 1);",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("decoupled-dkdv-stage-freed-before-the-products-retire", "cuda_src/bwd_wgmma.cu",
      "            if constexpr (kDV && kDK) wgmma_wait<0>(dv, a, dk, ds);",
      "            if constexpr (kDecoupled) mbarrier_arrive(&bars->empty[stage]);\n"
      "            if constexpr (kDV && kDK) wgmma_wait<0>(dv, a, dk, ds);",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("decoupled-dkdv-statistics-published-unstored", "cuda_src/bwd_wgmma.cu",
      "            queries.template stage_stats_by<kDkdvProducerThreads>(thread, stage, head, m_block);\n",
      "",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("decoupled-dkdv-consumers-take-more-registers-than-the-producer-frees", "cuda_src/bwd_wgmma.cu",
      "constexpr int kDkdvProducerRegs = 24, kDkdvConsumerRegs = 240;",
      "constexpr int kDkdvProducerRegs = 32, kDkdvConsumerRegs = 240;",
      T + "test_bwd_wgmma.py::test_decoupled_dkdv_rows_match_the_coupled_kernel_bit_for_bit[exact]", why="decoupled dK/dV"),
    M("timing-no-exp-build-keeps-the-softmax", "cuda_src/fwd_wgmma.cu",
      "constexpr bool kTimingNoExp = CF_TIMING_NO_EXP != 0;", "constexpr bool kTimingNoExp = false;",
      T + "test_fwd_wgmma.py::test_timing_only_builds_run_and_leave_out_what_they_say[no-exp]",
      why="issue 32: timing-only builds"),
    M("tf32x3-drops-the-b-operands-small-part", "cuda_src/tf32_tile.cuh",
      "        mma_m16n8k8_tf32(d, a_big, b_small, d);\n", "",
      T + "test_fwd_tf32.py::test_three_passes_recover_float32_accuracy_and_one_does_not",
      T + "test_bwd_tf32.py::test_three_passes_recover_float32_accuracy_and_one_does_not",
      why="tf32x3's derived bound (K and V rounded to TF32 once, Q and P still split)"),
]


# ---- running ------------------------------------------------------------------------------------

def checkout_files(root: Path) -> list[str]:
    """The checkout's files, relative to root: git's tracked and unignored untracked files."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        return [f for f in out.decode().split("\0") if f and (root / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".hypothesis", ".pytest_cache"}
        return [str(p.relative_to(root)) for p in root.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(root).parts)]


def copy_checkout(root: Path, dest: Path) -> None:
    for rel in checkout_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def child_env(copy: Path, cache: Path) -> dict:
    env = dict(os.environ)
    env.pop("CUPYFLASH_CUDA_SRC", None)                 # the copy's own cuda_src/
    env.pop("PYTHONPATH", None)
    env["CUPYFLASH_EMULATOR_CACHE"] = str(cache)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_copy(copy: Path, env: dict) -> None:
    probe = ("import cupyflash, cupyflash._source as s; "
             "print(cupyflash.__file__); print(s.cuda_src_dir())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    for line in out[:2]:
        if not Path(line).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"mutations.py: Python in the copy imports {line}, not the copy's files")


def run_one(m: Mutation, copy: Path, env: dict) -> tuple[str, float, str]:
    path = copy / m.file
    original = path.read_text()
    if m.text and original.count(m.text) != 1:
        return "MISSING", 0.0, f"text found {original.count(m.text)} times in {m.file}: {m.text!r}"
    path.write_text(original.replace(m.text, m.replacement))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "-p", "no:randomly", "-o", "addopts=", "--hypothesis-profile=mutations",
                               *m.selection],
                              cwd=copy, env=env, capture_output=True, text=True)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    status = {0: "SURVIVED", 1: "caught"}.get(proc.returncode, "ERROR")
    return status, seconds, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--fast", action="store_true", help="only the subset CI runs every time")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--verbose", action="store_true", help="print pytest's last lines for each")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each selection unmutated: it must pass, or 'caught' means nothing")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(unknown)}")
    chosen = [known[n] for n in args.names] if args.names else MUTATIONS
    if args.fast:
        chosen = [m for m in chosen if m.fast]
    if args.list:
        for m in chosen:
            print(f"{m.name:45s} {'fast' if m.fast else '    '} {m.file:28s} {' '.join(m.selection)}")
        return 0
    caught = survived = 0
    total = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cupyflash-mutations-") as tmp:
        copy, cache = Path(tmp) / "checkout", Path(tmp) / "emulator-cache"
        copy_checkout(ROOT, copy)
        env = child_env(copy, cache)
        check_imports_copy(copy, env)
        if args.baseline:
            for selection in dict.fromkeys(m.selection for m in chosen):
                status, seconds, tail = run_one(Mutation("baseline", chosen[0].file, "", "", selection), copy, env)
                ok = status == "SURVIVED"       # nothing planted: the selection passes
                print(f"{'baseline' if ok else 'BASELINE':8s} {' '.join(selection)[:60]:60s} {seconds:7.1f} s",
                      flush=True)
                if not ok:
                    print("    " + tail.replace("\n", "\n    "), flush=True)
                    return 1
        for m in chosen:
            status, seconds, tail = run_one(m, copy, env)
            print(f"{status:8s} {m.name:45s} {seconds:7.1f} s", flush=True)
            if status == "caught":
                caught += 1
            else:
                survived += 1
            if status != "caught" or args.verbose:
                print("    " + tail.replace("\n", "\n    "), flush=True)
    print(f"{caught} caught, {survived} survived ({time.perf_counter() - total:.0f} s)")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
