"""The sweep of score modifications through the CUDA kernels, on the emulator.

Opt-in (a few minutes on two cores; CI runs tests/test_score_mods.py, one combined case
per family)::

    python tests/mods_sweep.py            # every configuration and case
    python tests/mods_sweep.py mma        # configurations whose name contains a word
    python tests/mods_sweep.py --head-dim 128   # at another head dim (default 64): d = 128
                                                # runs the families' feature tiles

For each dispatch configuration of tests/terms_sweep.py, every case of issue 29 -- softcap
5, 30 and 50; ALiBi with Lq != Lk, causal, GQA; the score_mods and mask_mods of
tests/test_score_mods.py (each paired with a NumPy function of its own, and the score_mods
with their derivatives); a sliding window and a softcap written by hand against
``window=`` and ``softcap=`` -- runs forward and backward on the emulator and is checked
against the float64 oracle with the table (``assert_close``, ``assert_grad_close``).
Prints one line per case and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import cupyflash  # noqa: E402
from cupyflash import _dispatch  # noqa: E402
from cupyflash._options import KernelOptions  # noqa: E402
from cupyflash.emulator import EmulatorExecutor  # noqa: E402
from cupyflash.reference import naive_attention, naive_attention_backward  # noqa: E402

from _util import LaunchSpy, assert_close, assert_grad_close, assert_lse_close, random_array  # noqa: E402
from terms_sweep import _rng, sweep  # noqa: E402
from test_score_mods import B, H, LK, LQ, MASK_MODS, SCORE_MODS  # noqa: E402


def cases():
    """(name, Hkv, Lq, Lk, api keywords, oracle keywords, common keywords)."""
    out = []
    # the default scale throughout: the table is the rule for logits of order 1 (larger ones
    # need the logit term of docs/testing.md); softcap 30 and 50 then bend the scores only
    # slightly -- tests/test_score_mods.py bends them hard on the NumPy path (scale 4)
    for cap in (5.0, 30.0, 50.0):
        out.append((f"softcap {cap:g}", H, LQ, LK, dict(softcap=cap), dict(softcap=cap), {}))
    slopes = 2.0 ** -np.arange(1, H + 1)
    for lq, lk in ((LQ, LK), (LK, LQ)):
        out.append((f"ALiBi Lq={lq} Lk={lk} causal GQA", 2, lq, lk, dict(alibi_slopes=slopes),
                    dict(alibi_slopes=slopes), dict(causal=True, enable_gqa=True)))
    for name, (text, args, fn, grad) in SCORE_MODS.items():
        out.append((f"score_mod {name}", H, LQ, LK, dict(score_mod=text, mod_args=args),
                    dict(score_mod=fn, score_mod_grad=grad), dict(causal=True)))
    for name, (text, args, fn) in MASK_MODS.items():
        out.append((f"mask_mod {name}", H, LQ, LK, dict(mask_mod=text, mod_args=args), dict(mask_mod=fn), {}))
    diagonal = LK - LQ
    out.append(("window by hand", H, LQ, LK,
                dict(mask_mod=f"(kv_idx >= q_idx + {diagonal} - 4) & (kv_idx <= q_idx + {diagonal} + 2)"),
                dict(window=(4, 2)), {}))
    out.append(("softcap by hand", H, LQ, LK, dict(score_mod="5.0 * tanh(score / 5.0)"), dict(softcap=5.0), {}))
    return out


HEAD_DIM = [64]


def run_case(case, config, dtype):
    name, hkv, lq, lk, api, oracle, common = case
    _, arch, options, _, precision = config
    spy = LaunchSpy(EmulatorExecutor(arch=arch, seed=arch, shuffle=True, race_check=True))
    _dispatch.executor_for = lambda backend: spy
    chosen = KernelOptions(**options)
    KernelOptions.from_environment = classmethod(lambda cls, environ=None: chosen)
    rng = _rng("mods", name, config[0], dtype.name)
    d = HEAD_DIM[0]
    q = random_array(rng, (B, H, lq, d), dtype)
    k = random_array(rng, (B, hkv, lk, d), dtype)
    v = random_array(rng, (B, hkv, lk, d), dtype)
    dout = random_array(rng, (B, H, lq, d), dtype)
    out, lse = cupyflash.attention(q, k, v, backend="emulator", return_lse=True, precision=precision, **api, **common)
    ref, ref_lse = naive_attention(q, k, v, return_lse=True, **{n: x for n, x in oracle.items()
                                                                 if n != "score_mod_grad"}, **common)
    accuracy = np.float32 if precision != "ieee" else dtype
    assert_close(out, ref, accuracy)
    assert_lse_close(lse, ref_lse, dtype)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, backend="emulator", precision=precision,
                                         **api, **common)
    expected = naive_attention_backward(dout, q, k, v, **oracle, **common)
    for n, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_grad_close(g, e, accuracy, what=n)
    return sorted({n.split("<")[0].removeprefix("cf::") for n in spy.launched})


def main(argv) -> int:
    argv = list(argv)
    if "--head-dim" in argv:
        at = argv.index("--head-dim")
        HEAD_DIM[0] = int(argv[at + 1])
        del argv[at:at + 2]
    return sweep(argv, cases, run_case, width=36)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
