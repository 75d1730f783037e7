"""asv: the static kernel report as tracked numbers (no GPU needed, NVRTC is).

Every instantiation the dispatcher can pick (:func:`cupyflash._families.catalogue`)
is compiled for sm_80 and sm_90 once, in ``setup_cache``, with the ptxas report
on (:func:`cupyflash._report.kernel_report`, as ``python -m cupyflash kernels``);
each ``track_*`` then reads one number of one (instantiation, arch): registers
per thread, shared memory per block (static + the launch's dynamic amount),
theoretical occupancy (resident warps per SM) and spilled bytes.

Compiling everything takes a few CPU-minutes.  ``CUPYFLASH_ASV_KERNELS``, a
regular expression, keeps only the instantiations whose family or name
expression it matches (e.g. ``fwd_v1`` for a quick CI run); the parameter set
then differs, so do not mix such results with full ones.  Without NVRTC
every benchmark here is skipped.
"""

import os
import re

from cupyflash._families import catalogue

ARCHS = ["sm_80", "sm_90"]


def _selected():
    pattern = os.environ.get("CUPYFLASH_ASV_KERNELS")
    rows = catalogue()
    if pattern:
        rows = [r for r in rows
                if re.search(pattern, r.family.name) or re.search(pattern, r.name_expression)]
    return rows


class StaticReport:
    params = [[r.name_expression for r in _selected()], ARCHS]
    param_names = ["instantiation", "arch"]
    timeout = 1800          # setup_cache compiles every entry file for both archs

    def setup_cache(self):
        try:
            from cupyflash._report import kernel_report

            rows = kernel_report(ARCHS, _selected(), sass=False)
        except Exception as exc:  # noqa: BLE001 - no NVRTC / CUDA headers: skip the suite
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {(r["name"], r["arch"]): r for r in rows}

    def setup(self, report, instantiation, arch):
        if "error" in report:
            raise NotImplementedError(report["error"])
        self.row = report[(instantiation, arch)]

    def track_registers(self, report, instantiation, arch):
        return self.row["registers"]

    track_registers.unit = "registers/thread"

    def track_shared_memory(self, report, instantiation, arch):
        return self.row["shared_bytes"]

    track_shared_memory.unit = "bytes/block"

    def track_occupancy(self, report, instantiation, arch):
        return self.row["occupancy_warps"]

    track_occupancy.unit = "warps/SM"

    def track_spill_bytes(self, report, instantiation, arch):
        return self.row["spill_stores"] + self.row["spill_loads"]

    track_spill_bytes.unit = "bytes"
