"""asv: cupyflash's CUDA kernels, forward and backward (skipped where CuPy sees no GPU).

``time_attention`` is wall time with the device synchronised after each call
(launch overhead included); ``track_gpu_ms`` is the median CUDA-event time
(``cupyx.profiler.benchmark``); ``track_tflops`` uses FlashAttention's FLOP
count; ``track_peak_memory`` is the high-water mark of a fresh CuPy memory
pool over one call (the result included).  CuPy is imported in ``setup``
only, never at import (asv launches each benchmark in a fresh interpreter:
``launch_method: spawn``).
"""

import statistics

from cupyflash import _bench

DTYPES = ["float16", "bfloat16", "float32"]
SHAPES = [(4, 16, 1024, 64), (2, 16, 4096, 64), (2, 16, 4096, 128)]   # (B, H, L, d)
REPEAT = 30


class _GPUSuite:
    params = [DTYPES, SHAPES, [False, True]]
    param_names = ["dtype", "shape", "causal"]
    backward = False
    timeout = 300

    def setup(self, dtype, shape, causal):
        if not _bench.gpu_available():
            raise NotImplementedError("no CUDA device")
        import cupy

        b, h, length, d = shape
        self.case = _bench.Case(dtype, b, h, length, length, d, causal, self.backward)
        inputs = _bench.random_inputs(self.case, cupy)
        self.fn, _ = _bench.prepare("cupyflash", self.case, inputs, "gpu")
        self.sync = cupy.cuda.Device().synchronize
        self.fn()                      # compile (or load from CuPy's cache) and warm up
        self.sync()

    def time_attention(self, dtype, shape, causal):
        self.fn()
        self.sync()

    def track_gpu_ms(self, dtype, shape, causal):
        return statistics.median(_bench.time_call(self.fn, "gpu", repeat=REPEAT, warmup=3)) * 1e3

    track_gpu_ms.unit = "ms"

    def track_tflops(self, dtype, shape, causal):
        seconds = statistics.median(_bench.time_call(self.fn, "gpu", repeat=REPEAT, warmup=3))
        return self.case.flops / seconds / 1e12

    track_tflops.unit = "TFLOP/s"

    def track_peak_memory(self, dtype, shape, causal):
        return _bench.peak_cupy_pool(self.fn)

    track_peak_memory.unit = "bytes"


class GPUForward(_GPUSuite):
    """Forward: ``attention(q, k, v)`` as dispatched (fwd_mma for 16-bit inputs on sm_80+)."""

    backward = False


class GPUBackward(_GPUSuite):
    """Backward: ``attention_backward`` as dispatched (bwd_mma for 16-bit inputs on sm_80+,
    bwd_simt otherwise) from the forward's out and lse."""

    backward = True
