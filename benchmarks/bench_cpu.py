"""asv: the CPU path (:func:`cupyflash.attention` on NumPy arrays) against naive NumPy attention.

Both implementations come from :mod:`cupyflash._bench` (``python -m cupyflash
bench`` times the same callables).  ``naive`` is matmul, softmax in place,
matmul (:func:`cupyflash.reference.naive_attention` with ``oracle=False``), holding the L x L score matrix.  Sizes are small enough for
``asv run --quick`` on two cores.
"""

import statistics

from cupyflash import _bench

IMPLS = ["cupyflash", "numpy-naive"]
DTYPES = ["float32", "float64"]
SHAPES = [(1, 4, 256, 64), (1, 2, 1024, 64)]     # (B, H, L, d)


class _CPUSuite:
    params = [IMPLS, DTYPES, SHAPES, [False, True]]
    param_names = ["impl", "dtype", "shape", "causal"]
    backward = False
    timeout = 120

    def setup(self, impl, dtype, shape, causal):
        b, h, length, d = shape
        self.case = _bench.Case(dtype, b, h, length, length, d, causal, self.backward)
        self.fn, _ = _bench.prepare(impl, self.case, _bench.random_inputs(self.case), "cpu")

    def time_attention(self, impl, dtype, shape, causal):
        self.fn()

    def track_gflops(self, impl, dtype, shape, causal):
        seconds = statistics.median(_bench.time_call(self.fn, "cpu", repeat=3))
        return self.case.flops / seconds / 1e9

    track_gflops.unit = "GFLOP/s"

    def track_peak_memory(self, impl, dtype, shape, causal):
        return _bench.peak_tracemalloc(self.fn)

    track_peak_memory.unit = "bytes"


class CPUForward(_CPUSuite):
    """Forward: ``attention(q, k, v)``."""

    backward = False


class CPUBackward(_CPUSuite):
    """Backward: ``attention_backward`` from the forward's out and lse (naive: from scratch)."""

    backward = True


class CPUScoreOperands:
    """Forward and backward with a score operand (``python -m cupyflash bench --scores``):
    a (1, H, L, L) bias in the inputs' dtype, or a (B, 1, 1, L) key-padding mask."""

    params = [IMPLS, ["bias", "mask"], [False, True]]
    param_names = ["impl", "scores", "backward"]
    timeout = 120

    def setup(self, impl, scores, backward):
        self.case = _bench.Case("float32", 1, 2, 1024, 1024, 64, False, backward, scores)
        inputs = [*_bench.random_inputs(self.case), _bench.score_operands(self.case)]
        self.fn, _ = _bench.prepare(impl, self.case, inputs, "cpu")

    def time_attention(self, impl, scores, backward):
        self.fn()

    def track_peak_memory(self, impl, scores, backward):
        return _bench.peak_tracemalloc(self.fn)

    track_peak_memory.unit = "bytes"
