"""asv: host time of one call up to its kernel launches (validation, dispatch, views, params).

Where the kernels are short (small batches, a single query row while decoding),
the Python work before the launch is a visible part of a call.  These suites
time it on any machine: NumPy arrays on ``backend="emulator"`` with an executor
whose ``launch`` does nothing, so the figure is the host path alone, for the
dispatch an sm_90 GPU (132 SMs) would see.  CuPy arrays add their own costs
(array allocation, the launch itself) on top.
"""

import ml_dtypes
import numpy as np

from cupyflash import _dispatch, attention, attention_backward

CASES = {
    # name: (B, Hq, Hkv, Lq, Lk, d, (B, L, H, d) views, options)
    "bhld": (2, 16, 16, 1024, 1024, 128, False, {}),
    "blhd-view": (2, 16, 16, 1024, 1024, 128, True, {}),
    "gqa-causal": (2, 16, 4, 1024, 1024, 128, False, {"enable_gqa": True, "causal": True}),
    "decode": (4, 32, 32, 1, 8192, 128, False, {}),
}


class _NoLaunch:
    """An executor with the emulator's interface that launches nothing."""

    arch = 90
    multiprocessors = 132

    def launch(self, *args):
        pass


class _HostSuite:
    params = [list(CASES)]
    param_names = ["case"]
    max_length = None       # cut Lq and Lk to this (the backward's NumPy work grows with them)

    def setup(self, case):
        b, hq, hkv, lq, lk, d, blhd, options = CASES[case]
        if self.max_length is not None:
            lq, lk = min(lq, self.max_length), min(lk, self.max_length)

        def make(heads, length):
            if blhd:
                return np.zeros((b, length, heads, d), ml_dtypes.bfloat16).swapaxes(1, 2)
            return np.zeros((b, heads, length, d), ml_dtypes.bfloat16)

        self.q, self.k, self.v = make(hq, lq), make(hkv, lk), make(hkv, lk)
        self.options = options
        self.saved = _dispatch._executors.get(("emulator",))
        _dispatch._executors[("emulator",)] = _NoLaunch()
        self.out, self.lse = attention(self.q, self.k, self.v, return_lse=True, backend="emulator",
                                       **options)

    def teardown(self, case):
        if self.saved is None:
            _dispatch._executors.pop(("emulator",), None)
        else:
            _dispatch._executors[("emulator",)] = self.saved


class HostForward(_HostSuite):
    """``attention(q, k, v)`` on bfloat16, up to the launch."""

    def time_forward(self, case):
        attention(self.q, self.k, self.v, backend="emulator", **self.options)


class HostBackward(_HostSuite):
    """``attention_backward``, up to the launches, at one query and key row: the dispatch
    is the same as at full length, NumPy's work on the gradients (allocation, the cast)
    is not."""

    max_length = 1

    def time_backward(self, case):
        attention_backward(self.out, self.q, self.k, self.v, self.out, self.lse, backend="emulator",
                           **self.options)
