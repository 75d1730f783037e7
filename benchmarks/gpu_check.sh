#!/usr/bin/env bash
# The GPU check: `pytest -m gpu`, the timing table, the tile sweep, then an ncu profile, in under six minutes.
#
# Run from anywhere on a machine with a CUDA GPU, CuPy and the checkout (nothing
# installed: PYTHONPATH points at the checkout):
#
#     bash benchmarks/gpu_check.sh
#
# Writes benchmarks/results/<date>-<gpu>.json and .md (see benchmarks/gpu_check.py)
# and, when $OUT is set, copies them, the logs, the sweep's gpu_variants.json and
# the ncu profile (benchmarks/gpu_profile.py) there (ten files).  Without a usable
# GPU it says so and exits 0.  Otherwise the exit status is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
TEST_SECONDS="${GPU_CHECK_TEST_SECONDS:-150}"       # an H200 took 70-80 s
BENCH_SECONDS="${GPU_CHECK_BENCH_SECONDS:-130}"     # no new case starts after this
VARIANT_SECONDS="${GPU_CHECK_VARIANT_SECONDS:-90}"  # benchmarks/gpu_variants.py (wgmma variants first); 0 skips it
PROFILE_SECONDS="${GPU_CHECK_PROFILE_SECONDS:-60}"  # ncu over benchmarks/gpu_profile.py; 0 skips it

if ! reason=$("$PY" - <<'PYEOF' 2>&1
import cupy
n = cupy.cuda.runtime.getDeviceCount()
if n < 1:
    raise SystemExit("no CUDA device")
PYEOF
); then
    echo "gpu_check: no usable GPU here (${reason##*$'\n'}); nothing run. This script needs CuPy and a CUDA device."
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
cpus=$(nproc 2>/dev/null || echo 1)
# NVRTC is the slow part of a first run: compile the whole catalogue into CuPy's
# disk cache with one process per core, then let the test workers load it.
"$PY" benchmarks/gpu_check.py --precompile "$cpus" 2>&1 | tee "$work/precompile.log"
# pytest-xdist, where installed, spreads the (independent) GPU tests over processes
xdist=()
if [ "$cpus" -gt 2 ] && "$PY" -c "import xdist" 2>/dev/null; then
    xdist=(-n "$(( cpus < 8 ? cpus : 8 ))")
fi
# one hung test must not eat the whole budget
"$PY" -c "import pytest_timeout" 2>/dev/null && xdist+=(--timeout=90)
echo "gpu_check: pytest -m gpu ${xdist[*]} (limit ${TEST_SECONDS}s)"
timeout --signal=INT --kill-after=20 "$TEST_SECONDS" \
    "$PY" -m pytest -m gpu tests "${xdist[@]}" -q -rfEs -p no:cacheprovider \
    --junitxml="$work/junit.xml" 2>&1 | tee "$work/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "gpu_check: pytest exit status $test_rc after $(( $(date +%s) - start ))s"

"$PY" benchmarks/gpu_check.py --budget "$BENCH_SECONDS" --junit "$work/junit.xml" \
    --test-rc "$test_rc" 2>&1 | tee "$work/bench.log"
bench_rc=${PIPESTATUS[0]}

if [ "$VARIANT_SECONDS" -gt 0 ]; then
    echo "gpu_check: tile sweep (benchmarks/gpu_variants.py, limit ${VARIANT_SECONDS}s)"
    timeout --signal=INT --kill-after=10 "$VARIANT_SECONDS" "$PY" benchmarks/gpu_variants.py \
        2>&1 | tee "$work/variants.log"
fi

# Hardware counters of one launch of each target kernel (where ncu can read them:
# Firecracker machines; elsewhere it fails and says so in the log).
if [ "$PROFILE_SECONDS" -gt 0 ]; then
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
    if [ -n "$ncu_bin" ]; then
        echo "gpu_check: $ncu_bin over benchmarks/gpu_profile.py (limit ${PROFILE_SECONDS}s)"
        timeout --signal=INT --kill-after=10 "$PROFILE_SECONDS" "$ncu_bin" --clock-control none \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
            --csv --page details "$PY" benchmarks/gpu_profile.py \
            > "$work/profile.csv" 2> "$work/profile.log"
        echo "gpu_check: ncu exit status $? ($(wc -l < "$work/profile.csv") CSV lines)"
    else
        echo "gpu_check: no ncu on this machine; the profile is skipped"
    fi
fi

if [ -n "${OUT:-}" ]; then
    [ -f "$work/profile.csv" ] && cp "$work/profile.csv" "$OUT/gpu_check_profile.csv"
    [ -f "$work/profile.log" ] && cp "$work/profile.log" "$OUT/gpu_check_profile.log"
    cp "$work/precompile.log" "$OUT/gpu_check_precompile.log"
    cp "$work/pytest.log" "$OUT/gpu_check_pytest.log"
    [ -f "$work/junit.xml" ] && cp "$work/junit.xml" "$OUT/gpu_check_junit.xml"
    cp "$work/bench.log" "$OUT/gpu_check_bench.log"
    [ -f "$work/variants.log" ] && cp "$work/variants.log" "$OUT/gpu_check_variants.log"
fi
echo "gpu_check: done in $(( $(date +%s) - start ))s (pytest $test_rc, timing $bench_rc)"
[ "$test_rc" -eq 0 ] && exit "$bench_rc"
exit "$test_rc"
