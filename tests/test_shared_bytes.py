"""Shared memory: the launch configuration's formula (Python) equals the kernels' traits (C++).

Every kernel whose dynamic shared memory is a compile-time constant of its
traits has a host-callable sibling ``<kernel>_smem<same template arguments>()``
returning ``Traits::kSmemBytes``.  For each entry file, one host program is
compiled with the emulator's toolchain and headers (traits only: no kernel is
instantiated) that prints the sibling of every catalogue row; each value must
equal what the row's family gives the launch (``Family.shared_bytes``).
A launch asking for less than the kernel carves up would overrun its shared
memory; one asking for more wastes occupancy.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from cupyflash import _source
from cupyflash._families import catalogue
from cupyflash.emulator import _build, emulator_available

_OK, _WHY = emulator_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"CPU emulator unavailable: {_WHY}")

# The kernels whose dynamic shared memory is Traits::kSmemBytes (fwd_v1's
# depends on the run-time SRAM size; fwd_combine and the delta kernel use none).
SIBLINGS = ("fwd_simt_kernel", "fwd_mma_kernel", "fwd_wgmma_kernel", "fwd_dmma_kernel", "fwd_tf32_kernel",
            "bwd_simt_dkdv_kernel", "bwd_simt_dq_kernel", "bwd_mma_dkdv_kernel", "bwd_mma_dq_kernel",
            "bwd_wgmma_dkdv_kernel", "bwd_wgmma_dq_kernel", "bwd_dmma_dkdv_kernel", "bwd_dmma_dq_kernel",
            "bwd_tf32_dkdv_kernel", "bwd_tf32_dq_kernel")


def _rows_by_entry() -> dict[str, list]:
    out: dict[str, list] = {}
    for inst in catalogue():
        if inst.kernel in SIBLINGS:
            out.setdefault(inst.entry, []).append(inst)
    return out


ROWS = _rows_by_entry()


def _sibling(inst) -> str:
    """``cf::<kernel>_smem<the row's template arguments>`` (built like the row's name expression)."""
    return inst.family.row(inst.kernel + "_smem", *inst.args, role=inst.role, dtype=inst.dtype,
                           head_dim=inst.head_dim, head_dim_v=inst.head_dim_v,
                           threads=inst.threads).name_expression


def _host_program(entry: str, rows) -> str:
    """The emulator's translation unit for ``entry`` (see wrapper_source) with a
    main() printing each row's sibling, one per line, instead of launch wrappers."""
    assembled = _source.assemble(entry, substitutions=_build.SUBSTITUTIONS)
    prints = "\n".join(f'    std::printf("%d\\n", {_sibling(inst)}());' for inst in rows)
    return f'#include "cuda_emu.h"\n{assembled}\n#include <cstdio>\nint main() {{\n{prints}\n    return 0;\n}}\n'


@pytest.fixture(scope="module")
def toolchain():
    """The emulator's compiler and the flags and precompiled cuda_emu.h of its modules."""
    tc = _build.find_toolchain()
    flags = list(_build._MODULE_FLAGS)
    return tc, flags, _build.ModuleCache().precompiled_header(tc, flags)


def _traits_bytes(toolchain, entry: str, rows) -> list[int]:
    tc, flags, pch_dir = toolchain
    with tempfile.TemporaryDirectory(prefix="cupyflash-smem-") as tmp:
        src, exe = Path(tmp) / "smem.cpp", Path(tmp) / "smem"
        src.write_text(_host_program(entry, rows))
        build = subprocess.run([tc.cxx, *flags, f"-I{pch_dir}", *_build._include_options(tc), str(src),
                                "-o", str(exe)], capture_output=True, text=True, check=False)
        assert build.returncode == 0, f"{entry}: the host program did not build:\n{build.stderr[-4000:]}"
        run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    return [int(line) for line in run.stdout.split()]


def test_every_sibling_kernel_has_catalogue_rows():
    found = {inst.kernel for rows in ROWS.values() for inst in rows}
    assert found == set(SIBLINGS)


@pytest.mark.parametrize("entry", sorted(ROWS))
def test_launch_shared_bytes_equal_the_traits(toolchain, entry):
    rows = ROWS[entry]
    cxx = _traits_bytes(toolchain, entry, rows)
    assert len(cxx) == len(rows)
    wrong = [f"{inst.name_expression}: launch {inst.family.shared_bytes(inst)}, traits {b}"
             for inst, b in zip(rows, cxx) if inst.family.shared_bytes(inst) != b]
    assert not wrong, f"{len(wrong)} of {len(rows)} rows disagree:\n" + "\n".join(wrong[:20])
