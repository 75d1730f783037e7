"""Sphinx configuration of the cupyflash documentation.

Build:  python -m sphinx -W -b html docs docs/_build/html
Pages are Markdown (MyST); the API reference is autodoc + numpydoc; the code
examples of every page run in the test suite (tests/test_docs.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # document the checkout, installed or not

import cupyflash  # noqa: E402

project = "cupyflash"
author = "the cupyflash authors"
copyright = "the cupyflash authors, MIT License"  # noqa: A001 - Sphinx's name
version = release = cupyflash.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "numpydoc",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}  # .rst: numpydoc loads autosummary
root_doc = "index"
exclude_patterns = ["_build", "_scripts", "Thumbs.db", ".DS_Store"]

# MyST: $...$ and $$...$$ math, ::: fences, heading anchors for links such as
# semantics.md#causal-alignment.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + numpydoc: signatures as written, members in source order, no
# autosummary tables of class members (the API page lists what is public).
autodoc_member_order = "bysource"
# the framework adapters (cupyflash.torch, cupyflash.jax) are documented where
# their optional framework is not installed, on a stand-in
autodoc_mock_imports = [name for name in ("torch", "jax") if importlib.util.find_spec(name) is None]
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "pydata_sphinx_theme"
html_title = f"cupyflash {release}"
html_static_path = ["_static"]
html_css_files = ["cupyflash.css"]     # labels the gpu-only code blocks
html_theme_options = {
    "navigation_depth": 2,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"**": ["sidebar-nav-bs"]}
pygments_style = "sphinx"
