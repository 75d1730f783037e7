"""cupyflash: exact, memory-efficient attention (FlashAttention) for NumPy and CuPy.

>>> import cupyflash
>>> out = cupyflash.attention(q, k, v)      # doctest: +SKIP
"""

from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward
from ._kvcache import append_kv
from ._merge import merge_attention
from . import reference

__version__ = "0.1.0"

__all__ = ["append_kv", "attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "merge_attention", "precompile", "reference", "__version__"]


def precompile(*, dtypes=None, head_dims=None, families=None, device=None):
    """Compile kernel variants ahead of time (needs CuPy and a GPU).

    The first call that needs a kernel instantiation compiles it with NVRTC
    (seconds); ``precompile`` pays that cost up front, in parallel.

    Parameters
    ----------
    dtypes : sequence of str or dtype, optional
        e.g. ``["float16", "float32"]`` or ``[numpy.float16]``; default all.
    head_dims : sequence of int, optional
        Head dims of the data to be run; each selects the kernels the
        dispatcher picks for it. Default all.
    families : sequence of str, optional
        Kernel families (``"fwd_simt"``, ``"fwd_mma"``, ``"fwd_v1"``,
        ``"bwd_simt"``, ``"bwd_mma"``); default all.
    device : int, optional
        CUDA device id; default the current device.

    Returns
    -------
    list
        The instantiations compiled (already compiled ones included): those
        a call on the device's architecture can launch.

    Notes
    -----
    Compiled modules are kept per device in the process and in CuPy's
    on-disk kernel cache (``CUPY_CACHE_DIR``, default
    ``~/.cupy/kernel_cache``), so a later process loads them in
    milliseconds.

    Examples
    --------
    >>> import numpy as np
    >>> import cupyflash
    >>> rows = cupyflash.precompile(dtypes=[np.float16], head_dims=[128])  # doctest: +SKIP
    >>> sorted({r.family.name for r in rows})                              # doctest: +SKIP
    ['bwd_simt', 'fwd_mma', 'fwd_simt', 'fwd_v1']
    """
    from ._loader import precompile as _precompile

    return _precompile(dtypes=dtypes, head_dims=head_dims, families=families, device=device)
