"""cupyflash: exact, memory-efficient attention (FlashAttention) for NumPy and CuPy.

>>> import cupyflash
>>> out = cupyflash.attention(q, k, v)      # doctest: +SKIP
"""

from ._api import attention, attention_backward
from . import reference

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "precompile", "reference", "__version__"]


def precompile(*, dtypes=None, head_dims=None, families=None, device=None):
    """Compile kernel variants ahead of time (needs CuPy and a GPU).

    Parameters
    ----------
    dtypes : sequence of str, optional
        e.g. ``["float16", "float32"]``; default all.
    head_dims : sequence of int, optional
        Head dims whose kernels to build; default all.
    families : sequence of str, optional
        Kernel families, e.g. ``["fwd_simt"]``; default every family ``attention`` can pick.
    device : int, optional
        CUDA device id; default the current device.

    Returns
    -------
    list
        The instantiations compiled.
    """
    from ._loader import precompile as _precompile

    return _precompile(dtypes=dtypes, head_dims=head_dims, families=families, device=device)
