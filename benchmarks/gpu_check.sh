#!/usr/bin/env bash
# The GPU check: step 0 (benchmarks/gpu_first_contact.py: how the tensor cores add, the
# wgmma probes, an A/B table; one minute), then `pytest -m gpu` and the timing table
# within six minutes, then the tile sweep and the ncu profiles (their limits add about
# three minutes more).
#
# Run from anywhere on a machine with a CUDA GPU, CuPy and the checkout (nothing
# installed: PYTHONPATH points at the checkout):
#
#     bash benchmarks/gpu_check.sh
#
# Writes benchmarks/results/<date>-<gpu>.json and .md (see benchmarks/gpu_check.py)
# and, when $OUT is set, copies them there, with the sweep's gpu_variants*.json,
# and keeps the logs, JUnit files, the table's progress and the ncu profile
# (benchmarks/gpu_profile.py) in $OUT/gpu_check_logs.tar.gz as it goes.  Without a
# usable GPU it says so and exits 0.  Otherwise the exit status is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
FIRST_CONTACT_SECONDS="${GPU_CHECK_FIRST_CONTACT_SECONDS:-60}"  # step 0; 0 skips it
PRECOMPILE_SECONDS="${GPU_CHECK_PRECOMPILE_SECONDS:-120}"  # what is left compiles on first use
TEST_SECONDS="${GPU_CHECK_TEST_SECONDS:-150}"       # an H200 took 70-80 s
BENCH_SECONDS="${GPU_CHECK_BENCH_SECONDS:-150}"     # no new case starts after this
VARIANT_SECONDS="${GPU_CHECK_VARIANT_SECONDS:-90}"  # benchmarks/gpu_variants.py (wgmma variants first); 0 skips it
PROFILE_SECONDS="${GPU_CHECK_PROFILE_SECONDS:-60}"  # ncu over benchmarks/gpu_profile.py; 0 skips it
SOURCE_SECONDS="${GPU_CHECK_SOURCE_SECONDS:-45}"    # ncu per-instruction samples of SOURCE_CASES; 0 skips it
# The target kernels first: each case a process and a report of its own, so that the time
# limit costs only the cases it has not reached.
SOURCE_CASES="${GPU_CHECK_SOURCE_CASES:-fwd_wgmma_d128 fwd_mma_d128 bwd_wgmma_d128 bwd_mma_d128}"

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

# Logs, JUnit files, the table's progress and the profiles go to $work.  With $OUT set
# (the device machines), $OUT/gpu_check_logs.tar.gz holds a copy of $work, refreshed
# every 15 s and after each step: those machines return at most 8 files from $OUT, and a
# run stopped at the device's time limit (SIGKILL: no trap runs) still returns the last
# copy.  $OUT then holds step 0's first_contact.json, the results' .json and .md, the
# sweep's two gpu_variants*.json and this archive (and, while it is rewritten, one or two .tmp files).  ncu's own
# reports stay out of it (their CSV exports go in).
work=$(mktemp -d)
save_logs() {   # the saver below and the main shell may both be at it: a file each
    [ -n "${OUT:-}" ] || return 0
    local tmp="$OUT/gpu_check_logs.$BASHPID.tmp"
    tar -czf "$tmp" -C "$work" --exclude='*.ncu-rep' . 2>/dev/null
    if [ -s "$tmp" ]; then mv -f "$tmp" "$OUT/gpu_check_logs.tar.gz"; else rm -f "$tmp"; fi
}
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    ( while sleep 15; do save_logs; done ) > /dev/null 2>&1 &
    saver=$!
    trap 'kill "$saver" 2>/dev/null; save_logs; rm -rf "$work"' EXIT
else
    trap 'rm -rf "$work"' EXIT
fi
start=$(date +%s)
cpus=$(nproc 2>/dev/null || echo 1)
# Step 0, first: whether the tensor cores sum products exactly or truncate them (the
# GPU tier's tolerances assume the former), the one-wgmma probes, then an A/B table
# until its budget is spent.  Its JSON goes to the logs archive and $OUT.
if [ "$FIRST_CONTACT_SECONDS" -gt 0 ]; then
    timeout --signal=INT --kill-after=10 "$(( FIRST_CONTACT_SECONDS + 15 ))" \
        "$PY" benchmarks/gpu_first_contact.py --budget "$FIRST_CONTACT_SECONDS" \
        --json "$work/first_contact.json" --junit "$work/junit-first-contact.xml" 2>&1 |
        tee "$work/first_contact.log"
    if [ -s "$work/first_contact.json" ] && [ -n "${OUT:-}" ]; then
        cp "$work/first_contact.json" "$OUT/first_contact.json"
    fi
    save_logs
fi
# NVRTC is the slow part of a first run: compile the whole catalogue into CuPy's
# disk cache with one process per core, then let the test processes load it.
timeout --signal=INT --kill-after=10 "$PRECOMPILE_SECONDS" \
    "$PY" benchmarks/gpu_check.py --precompile "$cpus" 2>&1 | tee "$work/precompile.log"
save_logs
# One process per test_gpu*.py module (and one for the rest), side by side: a kernel
# that hangs or loses its CUDA context costs only its own module's results.
"$PY" benchmarks/gpu_check.py --tests "$TEST_SECONDS" --work "$work" 2>&1 | tee "$work/pytest.log"
test_rc=${PIPESTATUS[0]}
save_logs
echo "gpu_check: pytest exit status $test_rc after $(( $(date +%s) - start ))s"

# The table runs in watched child processes (a hung or context-losing implementation
# is left out and the table goes on); the outer limit is a last resort.
timeout --signal=INT --kill-after=10 "$(( BENCH_SECONDS + 150 ))" \
    "$PY" benchmarks/gpu_check.py --budget "$BENCH_SECONDS" --junit "$work" --work "$work" \
    --test-rc "$test_rc" 2>&1 | tee "$work/bench.log"
bench_rc=${PIPESTATUS[0]}
save_logs

if [ "$VARIANT_SECONDS" -gt 0 ]; then
    # the never-run wgmma variants in a process of their own (a third of the time),
    # so that a kernel that loses the CUDA context cannot cost the others
    wgmma_seconds=$(( VARIANT_SECONDS / 3 ))
    echo "gpu_check: tile sweep (benchmarks/gpu_variants.py: wgmma ${wgmma_seconds}s, the rest $(( VARIANT_SECONDS - wgmma_seconds ))s)"
    timeout --signal=INT --kill-after=10 "$wgmma_seconds" "$PY" benchmarks/gpu_variants.py \
        --kinds wfwd,wbwd --json gpu_variants_wgmma.json 2>&1 | tee "$work/variants-wgmma.log"
    timeout --signal=INT --kill-after=10 "$(( VARIANT_SECONDS - wgmma_seconds ))" "$PY" benchmarks/gpu_variants.py \
        --kinds fwd,bwd,tfwd,sfwd,sbwd,dfwd,dbwd 2>&1 | tee "$work/variants.log"
fi
save_logs

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
        # Where in each kernel the warps wait: the SourceCounters section samples every
        # warp's state at its program counter, so the per-instruction table (--page source,
        # SASS) shows which loads, barriers or products the stalls sit on.  Saved as reports
        # and as CSV for reading on a machine without ncu.
        source_end=$(( $(date +%s) + SOURCE_SECONDS ))
        [ "$SOURCE_SECONDS" -gt 0 ] || SOURCE_CASES=""
        for case in $SOURCE_CASES; do
            left=$(( source_end - $(date +%s) ))
            [ "$left" -gt 5 ] || { echo "gpu_check: no time left for the source profile of $case"; break; }
            report="$work/source-$case"
            timeout --signal=INT --kill-after=5 "$left" "$ncu_bin" --clock-control none \
                --section SourceCounters --section WarpStateStats -f -o "$report" \
                "$PY" benchmarks/gpu_profile.py --case "$case" >> "$work/source.log" 2>&1
            echo "gpu_check: source profile of $case: ncu exit status $?"
            if [ -f "$report.ncu-rep" ]; then
                "$ncu_bin" --import "$report.ncu-rep" --csv --page source --print-source sass \
                    > "$report-sass.csv" 2>> "$work/source.log" ||
                    "$ncu_bin" --import "$report.ncu-rep" --csv --page source \
                    > "$report-sass.csv" 2>> "$work/source.log"    # an ncu without --print-source
                "$ncu_bin" --import "$report.ncu-rep" --csv --page details \
                    > "$report.csv" 2>> "$work/source.log"
                echo "gpu_check: $(wc -l < "$report-sass.csv") SASS lines in $report-sass.csv"
            fi
        done
    else
        echo "gpu_check: no ncu on this machine; the profile is skipped"
    fi
fi

echo "gpu_check: done in $(( $(date +%s) - start ))s (pytest $test_rc, timing $bench_rc)"
[ "$test_rc" -eq 0 ] && exit "$bench_rc"
exit "$test_rc"
