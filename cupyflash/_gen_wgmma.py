"""Moved to ``tools/gen_wgmma.py``: a developer tool, not part of the runtime package.

Kept only while tests/test_fwd_wgmma.py imports it from here (issue 25; its check now
lives in tests/test_architecture.py).  It loads the checkout's ``tools/gen_wgmma.py``
by path, so it works in a checkout only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gen_wgmma", Path(__file__).resolve().parents[1] / "tools" / "gen_wgmma.py")
_generator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_generator)

header_text, TYPES, NS = _generator.header_text, _generator.TYPES, _generator.NS
