#!/usr/bin/env bash
# Base-vs-new timing of two source trees in one device call: the working tree (new) against a git
# ref (base), each built as a Python package, a script run for each in alternating processes.
#
#   here:    bash dev/ab_builds.sh prepare REF
#            (git archive REF into dev_ab/base: ignored by git, so the device call must carry it)
#   device:  run(command="bash dev/ab_builds.sh run OUTDIR [--dims '64;128'] [--dtypes bf16]
#                 [--rounds 2] -- python3 dev/varlen_peers.py --flashcore-only", carry=["dev_ab"])
#
# OUTDIR receives three files (ab.txt, build_base.log, build_new.log): the device tool returns at
# most 8, so a command that writes more of its own beside them loses some (session 51's first call).
# --tests FILTER also builds the new tree's CUDA tests (both dtypes, beside the packages) and runs
# them after the rounds, then compute-sanitizer memcheck and racecheck on CudaSanitizerSmall.*
# (tests.log, build_tests.log; session 52's call 5 did all of it in 382 s). --tests-flags FLAGS
# builds those tests with CMAKE_CUDA_FLAGS=FLAGS (e.g. -DFLASHCORE_DQ_SCALAR_SLOTS=1: the sm_80
# order of the dQ accumulator on the H200).
# The GPU machine has no .git, hence the archive made here. Both packages build at once (bf16,
# d64 / d128 by default: ~2 min on 16 cores); then each round runs the command with PYTHONPATH on
# the base package, then on the new one (AB_LABEL=base / new in its environment), everything
# appended to OUTDIR/ab.txt. The order inside a round stays fixed: judge a long cell on two
# rounds at least (docs/PERF.md, session 21: the variant timed last in a round can read low).
# Sessions 29-30 did this by hand each time (base-vs-new tables in docs/PERF.md).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: dev/ab_builds.sh prepare REF | run OUTDIR [options] -- COMMAND...}
shift

if [ "$MODE" = prepare ]; then
  REF=${1:?usage: dev/ab_builds.sh prepare REF}
  rm -rf dev_ab/base && mkdir -p dev_ab/base && git archive "$REF" | tar -x -C dev_ab/base || exit 1
  echo "dev_ab/base: $(git rev-parse --short "$REF") ($(du -sh dev_ab/base | cut -f1)); carry [\"dev_ab\"] in the device call"
  exit 0
fi
[ "$MODE" = run ] || { echo "unknown mode $MODE"; exit 2; }

OUTDIR=${1:?usage: dev/ab_builds.sh run OUTDIR [options] -- COMMAND...}
shift
DIMS='64;128' DTYPES=bf16 ROUNDS=2 TESTS= TESTS_FLAGS=
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case "$1" in
    --dims) DIMS=$2; shift 2 ;;
    --dtypes) DTYPES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --tests) TESTS=$2; shift 2 ;;
    --tests-flags) TESTS_FLAGS=$2; shift 2 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || { echo "no command after --"; exit 2; }
[ -d dev_ab/base ] || { echo "dev_ab/base missing: run 'dev/ab_builds.sh prepare REF' here and carry dev_ab"; exit 2; }
mkdir -p "$OUTDIR"

# build TREE LABEL JOBS: a Python-only package of TREE in /tmp/ab_pkg_LABEL.
build() {
  local tree=$1 label=$2 jobs=$3 log="$OUTDIR/build_$2.log"
  cmake -S "$tree" -B "$tree/build-ab" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON \
    -DFLASHCORE_CUDA_ARCHS=90 -DFLASHCORE_BUILD_PYTHON=ON -DFLASHCORE_BUILD_TESTS=OFF -DFLASHCORE_BUILD_CLI=OFF \
    -DFLASHCORE_DTYPES="$DTYPES" -DFLASHCORE_HEAD_DIMS="$DIMS" -DCMAKE_CUDA_FLAGS="-Xptxas=-v" >"$log" 2>&1 &&
    cmake --build "$tree/build-ab" -j "$jobs" >>"$log" 2>&1 || { echo "$label: BUILD FAILED (see build_$label.log)"; return 1; }
  rm -rf "/tmp/ab_pkg_$label" && mkdir -p "/tmp/ab_pkg_$label/flashcore" &&
    cp "$tree"/python/flashcore/*.py "/tmp/ab_pkg_$label/flashcore/" && cp "$tree"/build-ab/python/_C*.so "/tmp/ab_pkg_$label/flashcore/"
  echo "$label: built, kernels with spills: $(grep -E '[1-9][0-9]* bytes spill stores' "$log" | wc -l)"
}
T0=$(date +%s)
if [ -n "$TESTS" ]; then
  ( cmake -S . -B build-ab-tests -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON -DFLASHCORE_CUDA_ARCHS=90 \
      -DFLASHCORE_BUILD_PYTHON=OFF -DFLASHCORE_BUILD_TESTS=ON -DFLASHCORE_BUILD_CLI=OFF "-DFLASHCORE_DTYPES=fp16;bf16" \
      "-DCMAKE_CUDA_FLAGS=$TESTS_FLAGS" \
      >"$OUTDIR/build_tests.log" 2>&1 &&
      cmake --build build-ab-tests -j 8 --target flashcore_cuda_tests >>"$OUTDIR/build_tests.log" 2>&1
    echo "tests build rc=$? at $(( $(date +%s) - T0 )) s" ) >/tmp/ab_build_tests.status 2>&1 &
fi
build dev_ab/base base 8 >/tmp/ab_build_base.status 2>&1 &
build . new 8 || exit 1
wait
cat /tmp/ab_build_base.status
grep -q FAILED /tmp/ab_build_base.status && exit 1
echo "builds: $(( $(date +%s) - T0 )) s"

for round in $(seq 1 "$ROUNDS"); do
  for label in base new; do
    echo "#### $label, round $round: $*" | tee -a "$OUTDIR/ab.txt"
    AB_LABEL=$label PYTHONPATH="/tmp/ab_pkg_$label" "$@" 2>&1 | tee -a "$OUTDIR/ab.txt"
  done
done

if [ -n "$TESTS" ]; then  # its build finished with the packages' (the wait above)
  cat /tmp/ab_build_tests.status
  timeout 240 build-ab-tests/tests/flashcore_cuda_tests --gtest_filter="$TESTS" >"$OUTDIR/tests.log" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s: $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$OUTDIR/tests.log" | head
  for tool in memcheck racecheck; do
    timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 build-ab-tests/tests/flashcore_cuda_tests \
      --gtest_filter='CudaSanitizerSmall.*' >/tmp/ab_sanitize.log 2>&1
    echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/ab_sanitize.log | tr '\n' ' ')"
  done
fi
