"""Finding ``cuda_src/`` and assembling a kernel family's source text.

Both the GPU loader and the CPU emulator compile one self-contained string:
the family's ``.cu`` file with every quoted ``#include "..."`` inlined
recursively (each header once), ``#line`` directives so that compiler errors
name the real file and line, and ``<...>`` includes left for the compiler.
Because the string holds every header's text, CuPy's on-disk cache (keyed by
the source string, not by included files) can never serve a kernel built from
stale headers.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["cuda_src_dir", "assemble", "source_hash", "Variant", "entry_file", "with_defines"]

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


@functools.lru_cache(maxsize=1)
def cuda_src_dir() -> Path:
    """Directory holding the CUDA sources.

    Order: ``$CUPYFLASH_CUDA_SRC``; ``cupyflash/cuda_src`` (installed wheel,
    where the build force-includes it); ``<checkout>/cuda_src`` (plain checkout
    or editable install).
    """
    env = os.environ.get("CUPYFLASH_CUDA_SRC")
    here = Path(__file__).resolve().parent
    candidates = ([Path(env)] if env else []) + [here / "cuda_src", here.parent / "cuda_src"]
    for path in candidates:
        if (path / "ptx.cuh").is_file():
            return path
    raise FileNotFoundError(
        "cupyflash: cannot find the CUDA sources (cuda_src/ptx.cuh); looked in "
        + ", ".join(str(p) for p in candidates)
    )


@dataclass(frozen=True)
class Variant:
    """An entry file compiled with macro definitions placed before its text: a module of
    kernels with score terms (:mod:`cupyflash._terms`).  The executors, their module
    caches and :func:`assemble` take it wherever they take an entry file name; it
    compares and hashes by file and definitions, so each variant is its own module.
    """

    file: str
    defines: tuple   # ((name, value), ...), in order

    def prelude(self) -> str:
        return "".join(f"#define {name} {value}\n" for name, value in self.defines)

    def __str__(self) -> str:
        return self.file + "".join(f" [{name}={value}]" for name, value in self.defines)


def with_defines(entry, defines: tuple):
    """``entry`` (a file name or a :class:`Variant`) with ``defines`` after its own (itself
    when there are none)."""
    if not defines:
        return entry
    if isinstance(entry, Variant):
        return Variant(entry.file, entry.defines + tuple(defines))
    return Variant(entry, tuple(defines))


def entry_file(entry) -> str:
    """The ``cuda_src/`` file of an entry: the name itself, or a :class:`Variant`'s file."""
    return entry.file if isinstance(entry, Variant) else entry


def assemble(entry, substitutions: dict[str, Path] | None = None) -> str:
    """Return the source of ``entry`` (a file in cuda_src/) with quoted includes inlined.

    Parameters
    ----------
    entry : str or Variant
        File name relative to :func:`cuda_src_dir`, e.g. ``"fwd_simt.cu"``; a
        :class:`Variant`'s definitions come first.
    substitutions : dict, optional
        Maps an include name (e.g. ``"ptx.cuh"``) to a replacement file; the
        emulator uses this to swap in its twin of the PTX-wrapper header.
    """
    if isinstance(entry, Variant):
        return entry.prelude() + assemble(entry.file, substitutions)
    root = cuda_src_dir()
    subs = {k: Path(v) for k, v in (substitutions or {}).items()}
    seen: set[Path] = set()
    out: list[str] = []

    def visit(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.add(path)
        text = path.read_text()
        out.append(f'#line 1 "{_display(path, root)}"')
        for lineno, line in enumerate(text.splitlines(), start=1):
            m = _INCLUDE.match(line)
            if m:
                name = m.group(1)
                target = subs.get(name)
                if target is None:
                    target = path.parent / name
                    if not target.is_file():
                        target = root / name
                if not target.is_file():
                    raise FileNotFoundError(f"{path}:{lineno}: cannot find included file {name!r}")
                visit(target)
                out.append(f'#line {lineno + 1} "{_display(path, root)}"')
            elif _PRAGMA_ONCE.match(line):
                out.append("")
            else:
                out.append(line)

    visit(root / entry)
    return "\n".join(out) + "\n"


def _display(path: Path, root: Path) -> str:
    """``cuda_src/<name>`` for project files (stable across checkouts), else the full path."""
    try:
        return "cuda_src/" + path.relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def source_hash(text: str) -> str:
    """Short content hash used to key on-disk caches."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
