"""pytest configuration for the whole checkout.

The framework adapters ``cupyflash/torch.py`` and ``cupyflash/jax.py`` import
their framework, which is an optional dependency: ``--doctest-modules`` collects
them only where it is installed -- and always on CI (``CI=true``), which installs
both, so that their absence there is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import os


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:          # sys.modules[name] is None: imports of it are blocked
        return False


collect_ignore = [] if os.environ.get("CI") == "true" else [
    f"cupyflash/{name}.py" for name in ("torch", "jax") if not _installed(name)
]
