"""The fast subset of tests/mutations.py, on every CI run: each planted bug of the CPU path
and the NumPy code (no g++ needed) must be caught by the tests listed for it.

The whole list, the kernels' mutations on the emulator included, is run by hand
(``python tests/mutations.py``) before a kernel issue is resolved; its last results
are in docs/testing.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mutations

HERE = Path(__file__).resolve().parent


def test_the_list_has_at_least_20_mutations_with_distinct_names_and_a_fast_subset():
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert 5 <= sum(m.fast for m in mutations.MUTATIONS) < len(names)
    for m in mutations.MUTATIONS:
        assert m.selection and all(s.startswith(("tests/", "-")) or s == "emulator" for s in m.selection), m.name


def test_every_mutation_text_occurs_exactly_once():
    # The full run reports MISSING too; this catches a moved text on every CI run.
    for m in mutations.MUTATIONS:
        text = (mutations.ROOT / m.file).read_text()
        assert text.count(m.text) == 1, f"{m.name}: {m.text!r} occurs {text.count(m.text)} times in {m.file}"


@pytest.mark.mutations
@pytest.mark.xdist_group("mutations")
def test_fast_mutations_are_all_caught():
    done = subprocess.run([sys.executable, str(HERE / "mutations.py"), "--fast"], capture_output=True, text=True,
                          timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " caught, 0 survived" in summary, summary
