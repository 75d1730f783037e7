"""The documentation's code runs: every page's examples, and the Sphinx build.

- Every ``docs/**/*.md`` page is run as a doctest (its ``>>>`` examples, in
  order, sharing one namespace per page), with ELLIPSIS, NORMALIZE_WHITESPACE
  and NUMBER (a float in the expected output matches to the digits written).
  The same pages pass ``pytest --doctest-glob='*.md' docs/``.
- GPU-only snippets are MyST ``{code-block} python`` blocks with the class
  ``gpu-only``: plain code without prompts, so no doctest runs them.  On every
  machine they must at least compile; in the GPU tier (marker ``gpu``) they
  run, after the page's CPU examples, in the same namespace.
- ``test_sphinx_build_is_warning_free`` builds the HTML with ``-W``.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
               if not {"_build", "_scripts"} & set(p.relative_to(DOCS).parts))

# pytest registers NUMBER under the same name; registering again returns its value.
NUMBER = doctest.register_optionflag("NUMBER")
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | NUMBER

_FLOAT = re.compile(r"(?<![\w.])[+-]?(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?")


class _NumberChecker(doctest.OutputChecker):
    """doctest's checker plus NUMBER: ``0.333`` in the expected output matches
    ``0.3333333`` (any float that rounds to the digits written)."""

    def check_output(self, want, got, optionflags):
        if super().check_output(want, got, optionflags):
            return True
        if not optionflags & NUMBER:
            return False
        wants, gots = list(_FLOAT.finditer(want)), list(_FLOAT.finditer(got))
        if not wants or len(wants) != len(gots):
            return False
        pieces, last = [], 0
        for w, g in zip(wants, gots):
            mantissa, _, exponent = w.group().lower().partition("e")
            digits = len(mantissa.partition(".")[2])
            tolerance = 0.5 * 10.0 ** (int(exponent or 0) - digits)
            if abs(float(w.group()) - float(g.group())) > tolerance:
                return False
            pieces += [got[last:g.start()], w.group()]
            last = g.end()
        return super().check_output(want, "".join(pieces) + got[last:], optionflags)


# ---- GPU-only blocks --------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\{code-block\}\s+python\s*$")


def gpu_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ``{code-block} python`` with class gpu-only."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, j, classes = m.group("fence"), i + 1, ""
        while j < len(lines) and lines[j].startswith(":"):
            if lines[j].startswith(":class:"):
                classes = lines[j][len(":class:"):]
            j += 1
        end = j
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if "gpu-only" in classes.split():
            blocks.append((j + 1, "\n".join(lines[j:end]).strip("\n") + "\n"))
        i = end + 1
    return blocks


def _missing_imports(code: str) -> list[str]:
    """Top-level packages the code imports that are not installed (torch, jax, ...)."""
    roots = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return sorted(r for r in roots if importlib.util.find_spec(r) is None)


# ---- what a page needs besides the test extra ----------------------------------------------

def _emulator() -> tuple[bool, str]:
    from cupyflash.emulator import emulator_available

    return emulator_available()


def _torch_and_jax() -> tuple[bool, str]:
    missing = [m for m in ("torch", "jax") if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI") != "true":     # CI installs both: there it must run
        return False, f"{' and '.join(missing)} not installed"
    return True, ""


REQUIRES = {
    "tutorials/without-a-gpu.md": _emulator,
    "tutorials/interop.md": _torch_and_jax,       # the adapters' CPU examples
}


def _find_checkout_in_subprocesses(monkeypatch) -> None:
    """Let ``python -m cupyflash ...`` in an example import this checkout, installed or not."""
    path = [str(ROOT)] + ([p for p in [os.environ.get("PYTHONPATH")] if p])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def _run_page(page: str) -> dict:
    """Run the page's doctest examples; fail with doctest's report; return the namespace."""
    path = DOCS / page
    globs = {"__name__": f"docs.{page}"}
    test = doctest.DocTestParser().get_doctest(path.read_text(), globs, page, str(path), 0)
    runner = doctest.DocTestRunner(checker=_NumberChecker(), optionflags=OPTIONFLAGS)
    report: list[str] = []
    result = runner.run(test, out=report.append, clear_globs=False)
    if result.failed:
        pytest.fail(f"{result.failed} of {result.attempted} examples in docs/{page} failed:\n"
                    + "".join(report), pytrace=False)
    return test.globs


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    needs = REQUIRES.get(page)
    if needs is not None:
        ok, reason = needs()
        if not ok:
            pytest.skip(f"docs/{page} needs {needs.__name__.strip('_')}: {reason}")
    monkeypatch.chdir(tmp_path)          # examples that write files write them here
    _find_checkout_in_subprocesses(monkeypatch)
    _run_page(page)


@pytest.mark.parametrize("page", PAGES)
def test_gpu_snippets_compile_and_are_not_doctests(page):
    for line, code in gpu_blocks((DOCS / page).read_text()):
        assert ">>>" not in code, f"docs/{page}:{line}: a gpu-only block must not hold doctest prompts"
        compile(code, f"docs/{page}:{line}", "exec")


GPU_PAGES = [p for p in PAGES if gpu_blocks((DOCS / p).read_text())]


@pytest.mark.gpu
@pytest.mark.parametrize("page", GPU_PAGES)
def test_gpu_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _find_checkout_in_subprocesses(monkeypatch)
    namespace = _run_page(page)
    ran, skipped = 0, []
    for line, code in gpu_blocks((DOCS / page).read_text()):
        missing = _missing_imports(code)
        if missing:
            skipped.append(f"line {line} needs {', '.join(missing)}")
            continue
        exec(compile(code, f"docs/{page}:{line}", "exec"), namespace)  # noqa: S102 - our own docs
        ran += 1
    if not ran:
        pytest.skip(f"docs/{page}: no GPU snippet could run ({'; '.join(skipped)})")


@pytest.mark.parametrize("want, got, ok", [
    ("0.333\n", "0.3333333333\n", True),
    ("(1.5e-3, 2.0)\n", "(0.0014999, 2.04)\n", True),
    ("0.333\n", "0.334\n", False),
    ("array([0.5, 1. ])\n", "array([0.5000001, 1.       ])\n", True),
    ("3.14\n", "3.14159 2.7\n", False),
])
def test_number_option_matches_floats_to_the_digits_written(want, got, ok):
    assert _NumberChecker().check_output(want, got, OPTIONFLAGS) is ok


def test_every_page_is_found():
    assert "index.md" in PAGES and len(PAGES) >= 10, PAGES


# Control characters other than newline: a TAB where a backslash escape was meant
# ("\top" written in a normal Python string) renders as P^<TAB>op in the HTML.
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


def test_docs_and_docstrings_have_no_control_characters():
    files = [DOCS / page for page in PAGES] + [ROOT / "README.md"]
    files += sorted((ROOT / "cupyflash").rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{n}: {line!r}"
             for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1)
             if _CONTROL.search(line)]
    assert not found, "control characters (a TAB from an unescaped \\t?):\n" + "\n".join(found)


# ---- the Sphinx build -----------------------------------------------------------------------

_SPHINX_PACKAGES = ("sphinx", "myst_parser", "numpydoc", "pydata_sphinx_theme")


@pytest.mark.slow
def test_sphinx_build_is_warning_free(tmp_path):
    missing = [p for p in _SPHINX_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing)")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"sphinx-build -W failed after {seconds:.0f} s:\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "html" / "index.html").is_file()
