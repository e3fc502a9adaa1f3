#!/usr/bin/env bash
# The CPU path on this machine in one call (meant for the GPU machine's Xeon, which has AMX): a
# CPU-only build with all cores (tests + Python package), every CPU test, the AMX probe
# (dev/amx_probe.cpp) and fma_peak as ceilings, then bench/peers.py's CPU section against torch's
# CPU SDPA (on an AMX CPU with the AVX path timed beside the AMX forward). Needs no GPU and no
# network. Logs in OUTDIR; a summary prints last.
#
# usage: dev/cpu_check.sh OUTDIR [THREADS ...]     (default threads: 2 16)
#   TESTS=0 skips the tests; FILTER=... narrows them (gtest filter).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: dev/cpu_check.sh OUTDIR [THREADS ...]}
shift
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(2 16)
mkdir -p "$OUT"
JOBS=$(nproc)
BUILD=${BUILD:-/tmp/flashcore-cpu-check}
SUM="$OUT/summary.txt"
: >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }

note "== $(lscpu | grep 'Model name' | sed 's/ \+/ /g'); AMX: $(grep -o -w 'amx_bf16' /proc/cpuinfo | head -1 || echo none)"
T0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=OFF -DFLASHCORE_BUILD_PYTHON=ON \
  >"$OUT/build.log" 2>&1 && cmake --build "$BUILD" -j "$JOBS" >>"$OUT/build.log" 2>&1
if [ $? -ne 0 ]; then
  note "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -30 | tee -a "$SUM"; exit 1
fi
note "build: $(( $(date +%s) - T0 )) s"

BIN=$(mktemp -d)
g++ -std=c++17 -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16 -pthread dev/amx_probe.cpp -o "$BIN/amx_probe" 2>/dev/null &
g++ -std=c++17 -O2 -march=native -fopenmp dev/fma_peak.cpp -o "$BIN/fma_peak" &

if [ "${TESTS:-1}" != 0 ]; then
  T0=$(date +%s)
  "$BUILD/tests/flashcore_cpu_tests" --gtest_filter="${FILTER:-*}" >"$OUT/tests.log" 2>&1
  rc=$?
  note "cpu tests (filter ${FILTER:-*}): rc=$rc, $(grep -c '^\[       OK' "$OUT/tests.log") ok," \
    "$(grep -c '^\[  FAILED  \] [A-Za-z]' "$OUT/tests.log") failed, $(grep -c '^\[  SKIPPED' "$OUT/tests.log") skipped," \
    "$(( $(date +%s) - T0 )) s"
  grep -E '^\[  (FAILED|SKIPPED) ' "$OUT/tests.log" | sort -u | head -20 | tee -a "$SUM"
  grep -B2 -A6 "FAIL:" "$OUT/tests.log" | head -40 >>"$SUM"
fi

wait
[ -x "$BIN/amx_probe" ] && "$BIN/amx_probe" "${THREADS[@]}" >"$OUT/amx_probe.txt" 2>&1
"$BIN/fma_peak" "${THREADS[@]}" >"$OUT/fma_peak.txt" 2>&1

PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  PKG="$BIN/pkg"
  mkdir -p "$PKG" && cp -r python/flashcore "$PKG/" && cp "$BUILD"/python/_C*.so "$PKG/flashcore/"
  (IFS=,; OMP_WAIT_POLICY=passive PYTHONPATH="$PKG" "$PY" bench/peers.py "$OUT/peers" --cpu-only \
     --threads "${THREADS[*]}") >"$OUT/peers.txt" 2>&1
fi

{
  cat "$OUT/fma_peak.txt"
  [ -f "$OUT/amx_probe.txt" ] && grep -E "TDPBF16PS 2x2|error|WRONG|not usable" "$OUT/amx_probe.txt"
  [ -f "$OUT/peers.txt" ] && grep -E "^cpu |Traceback|Error" "$OUT/peers.txt"
} | tee -a "$SUM"
rm -rf "$BIN"
