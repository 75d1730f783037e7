"""The package's shape, read statically from its source: no import cycle among the
``cupyflash`` modules, no dispatch by comparing kernel-family names or parsing kernel
names back, no developer tool inside the runtime package, and the code those tools
generate up to date.

Everything here reads files (``ast``, text); nothing imports the modules it checks, so
a cycle is found even where the imports are lazy and happen to run in a harmless order.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cupyflash"


# ---- the import graph ------------------------------------------------------------------------

def module_name(path: Path, root: Path = ROOT) -> str:
    """``cupyflash/emulator/_build.py`` -> ``cupyflash.emulator._build``; a package's
    ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node in ``tree`` -- at module level, in functions, in
    classes, in try blocks -- except those under ``if TYPE_CHECKING:`` (its ``else``
    branch is real code and is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(node, name: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules of ``modules`` that one import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            parts = alias.name.split(".")       # import a.b.c: a.b.c (its packages run first,
            for n in range(len(parts), 0, -1):  # but a cycle through them is not this edge's)
                if ".".join(parts[:n]) in modules:
                    found.append(".".join(parts[:n]))
                    break
        return found
    if node.level:                               # relative: from . import x, from ..m import y
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = package[:len(package) - (node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = []
    for alias in node.names:                     # from base import x: the submodule base.x if it is one
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.append(sub)
        elif base in modules:
            found.append(base)
    return found


def import_graph(package: Path = PACKAGE, root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """``{module: {imported module: ["file:line", ...]}}`` over every ``.py`` file under
    ``package``, restricted to the package's own modules."""
    files = {module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in modules}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                if target != name:
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    graph[name].setdefault(target, []).append(where)
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one
    module (Tarjan's algorithm for the components, a breadth-first search for the cycle)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        start = min(component)
        previous = {start: None}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:                   # start -> ... -> v -> start
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    found.append(path[::-1] + [start])
                    queue = []
                    break
                if w in component and w not in previous:
                    previous[w] = v
                    queue.append(w)
    return sorted(found)


def describe(cycle: list[str], graph) -> str:
    """``a -> b -> a`` with the file and line of each import that makes an edge."""
    steps = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n      " + "\n      ".join(steps)


def test_the_import_graph_sees_lazy_and_relative_imports_but_not_type_checking_ones(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                              "else:\n    from .sub import d\n")
    (pkg / "c.py").write_text("import os\nimport pkg.a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("import numpy\n")
    graph = import_graph(pkg, tmp_path)
    assert {m: sorted(t) for m, t in graph.items()} == {
        "pkg": ["pkg.a"], "pkg.a": ["pkg.b"], "pkg.b": ["pkg.sub.d"], "pkg.c": ["pkg.a"],
        "pkg.sub": [], "pkg.sub.d": []}
    assert cycles(graph) == []                   # b -> c is under TYPE_CHECKING
    (pkg / "sub" / "d.py").write_text("try:\n    from .. import c\nexcept ImportError:\n    pass\n")
    graph = import_graph(pkg, tmp_path)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.d", "pkg.c", "pkg.a"]]
    text = describe(cycles(graph)[0], graph)
    assert "pkg/a.py:2" in text and "pkg/sub/d.py:2" in text and "pkg/c.py:2" in text


def test_the_import_graph_finds_the_cycles_issue_25_names(tmp_path):
    """The package as it was before issue 25 (a copy with the two circles put back):
    _loader <-> _report through a lazy import, _bench <-> _cli."""
    copy = tmp_path / "cupyflash"
    for path in PACKAGE.rglob("*.py"):
        (copy / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.relative_to(PACKAGE)).write_text(path.read_text())
    with open(copy / "_loader.py", "a") as f:
        f.write("\n\ndef _planted():\n    from ._report import kernel_report\n")
    with open(copy / "_bench.py", "a") as f:
        f.write("\n\ndef _planted():\n    from ._cli import check\n")
    found = cycles(import_graph(copy, tmp_path))
    assert ["cupyflash._bench", "cupyflash._cli", "cupyflash._bench"] in found
    assert ["cupyflash._loader", "cupyflash._report", "cupyflash._loader"] in found


def test_no_import_cycle_among_cupyflash_modules():
    graph = import_graph()
    assert len(graph) > 20 and graph["cupyflash._report"]    # the walk found the package
    found = cycles(graph)
    assert not found, "import cycles:\n  " + "\n  ".join(describe(c, graph) for c in found)


# ---- no dispatch on family-name strings -----------------------------------------------------

# issue 25's grep: a family compared by its name, a kernel's identity parsed back from
# its C++ name expression
FAMILY_STRING_DISPATCH = re.compile(r'family ==|family !=|startswith\("(fwd|bwd)_|endswith\(", (true|false)>')


def test_no_code_dispatches_on_family_name_strings():
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if FAMILY_STRING_DISPATCH.search(line)]
    assert not hits, f"{len(hits)} lines compare family names or parse kernel names:\n" + "\n".join(hits)


def test_the_family_name_pattern_is_the_issues_grep():
    for line in ('if inst.family == "fwd_mma":', "if family != x:", 'name.startswith("bwd_")',
                 'expr.endswith(", true>")'):
        assert FAMILY_STRING_DISPATCH.search(line), line
    for line in ('families=("fwd_mma",)', 'name.startswith("cf::")', 'r.family in wanted'):
        assert not FAMILY_STRING_DISPATCH.search(line), line


# ---- developer tools stay out of the runtime package ------------------------------------------

def test_cupyflash_does_not_import_tools():
    graph_files = sorted(PACKAGE.rglob("*.py"))
    hits = []
    for path in graph_files:
        for node in _imports(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if not node.level else []
            hits += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                     if n == "tools" or n.startswith("tools.")]
    assert not hits, "\n".join(hits)


def test_generated_wgmma_wrappers_are_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "tools" / "gen_wgmma.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    text = generator.HEADER.read_text()
    assert generator.header_text(text) == text, "run python tools/gen_wgmma.py"
    # ss, rs_mn and ss_mn per type and n
    assert text.count("wgmma.mma_async.sync.aligned.m64n") == 3 * len(generator.TYPES) * len(generator.NS)
