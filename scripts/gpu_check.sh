#!/usr/bin/env bash
# Everything a GPU machine should check, in one call: build with all cores, the CUDA test suite,
# compute-sanitizer (memcheck, racecheck, synccheck) on the small cases, the Python tests with
# torch, the SASS instruction mix, the `flashcore run` demo, and the benchmark against the
# PyTorch SDPA peers in one process. Logs go to OUTDIR (at most 11 files); a summary prints last.
#
# usage: scripts/gpu_check.sh OUTDIR [--bench quick|full|none] [--tests all|none] [--budget S]
#                               [--filter GTEST_FILTER] [--bench-args "ARGS for bench/peers.py"]
#                               [--pytest yes|no] [--decode yes|no] [--dropout yes|no] [--test-timeout S]
#                               [--fuzz MINUTES] [--deadline S]
#
# --deadline S (default 570): seconds from the start by which the summary must have printed. The
# device tool kills a call at 600 s and then returns no output at all (session 50's first call):
# every step's timeout is cut to what is left before the deadline, and a CUDA test run that is
# cut short names the tests of its filter it did not reach, as a filter for the next call.
#
# One call must finish inside the device tool's 10 minutes. The whole CUDA suite no longer does
# with a benchmark beside it (the backward grids alone took ~330 s on an H100 in session 4, both
# backends): split it over calls with --filter, e.g. '*sm80*',
# '*sm90*:*Sm90*:CudaRaces*:CudaSanitizer*:*SmallGrids*' and 'CudaKvCache*:CudaMergePartials*',
# and raise --test-timeout (default 420 s) when one filter needs more. The backend-parametrized
# suites are named Backends/CudaForward.Varlen/sm90 and so on: their patterns need a leading '*'
# ('CudaBackward.Deterministic*' matches nothing, '*CudaBackward.Deterministic*' both backends). bench/peers.py times every
# training-grid cell in two interleaved rounds by default: the bf16 forward grid takes ~2 min, forward
# and forward+backward ~5; `--bench-args "--rounds 1"` halves that, and cells past --budget are
# reported as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR [--bench quick|full|none] [--tests all|none]}
shift
BENCH=quick TESTS=all BUDGET=300 FILTER='*' BENCH_ARGS= PYTEST=yes DECODE=yes DROPOUT=no TEST_TIMEOUT=420 FUZZ=0 DEADLINE=570
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) BENCH=$2; shift 2 ;;
    --tests) TESTS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --filter) FILTER=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --pytest) PYTEST=$2; shift 2 ;;
    --decode) DECODE=$2; shift 2 ;;
    --dropout) DROPOUT=$2; shift 2 ;;
    --test-timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --fuzz) FUZZ=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
mkdir -p "$OUTDIR"
SUM="$OUTDIR/summary.txt"
: >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 ))s; }
# capped LIMIT [RESERVE]: LIMIT seconds, or less so as to end RESERVE seconds (default 30) before
# the deadline; never below 10.
capped() {
  local left=$(( DEADLINE - ($(date +%s) - T0) - ${2:-30} ))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -ge 10 ] || left=10
  echo "$left"
}

{ nvidia-smi -L; nvcc --version | tail -2; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$OUTDIR/build.log" 2>&1
note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

# 1. Build: sm_90 SASS only here (the H100); CI compiles the full arch list. -Xptxas -v records
#    registers / spills / shared memory of every kernel in build.log. The -U / -D options that
#    restate defaults keep a build directory that an experiment configured differently (another
#    head-dim or dtype list, no tests) from silently standing in for the full build.
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON -DFLASHCORE_CUDA_ARCHS=90 \
  -UFLASHCORE_MAX_CUDA_UNITS -UFLASHCORE_HEAD_DIMS -UFLASHCORE_DTYPES -DFLASHCORE_BUILD_TESTS=ON -DFLASHCORE_BUILD_CLI=ON \
  -DFLASHCORE_BUILD_PYTHON=ON -DCMAKE_CUDA_FLAGS="-Xptxas=-v" >>"$OUTDIR/build.log" 2>&1
if ! cmake --build build-gpu -j 16 >>"$OUTDIR/build.log" 2>&1; then
  note "BUILD FAILED ($(el)); tail of build.log:"; grep -E "error|Error" "$OUTDIR/build.log" | head -30 | tee -a "$SUM"; exit 1
fi
# Spills per kernel from ptxas -v (ninja prints each unit's output whole), against the baseline of
# the last reviewed build (dev/spill_baseline_sm90.txt; refresh it with --write-baseline when a
# change's new spills were measured and accepted). The full list goes to build.log.
python3 scripts/spill_report.py "$OUTDIR/build.log" --top 20 --baseline dev/spill_baseline_sm90.txt >/tmp/spills.txt 2>&1
cat /tmp/spills.txt >>"$OUTDIR/build.log"
note "build ok ($(el)); $(head -1 /tmp/spills.txt); $(grep '^against' /tmp/spills.txt)"
grep '^  MORE' /tmp/spills.txt | head -10 | tee -a "$SUM"
# The Python package for pytest and the benchmarks, from the same build (no second compile): the
# .py files plus the built _C.
rm -rf /tmp/fcpkg && mkdir -p /tmp/fcpkg/flashcore && cp python/flashcore/*.py /tmp/fcpkg/flashcore/ \
  && cp build-gpu/python/_C*.so /tmp/fcpkg/flashcore/ 2>/dev/null

# 2. SASS instruction mix of the kernels (HMMA = tensor-core mma.sync).
SO=$(ls build-gpu/libflashcore.so 2>/dev/null)
if [ -n "$SO" ]; then
  cuobjdump -sass "$SO" >/tmp/sass.txt 2>/dev/null
  { echo "functions: $(grep -c 'Function :' /tmp/sass.txt)"; for op in HMMA HGMMA UTMALDG SYNCS LDSM LDGSTS LDL STL BAR; do echo "$op $(grep -c "$op" /tmp/sass.txt)"; done;
    grep -E 'Function :' /tmp/sass.txt | head -40; } >/tmp/sass_summary.txt; cat /tmp/sass_summary.txt >>"$OUTDIR/build.log"
  note "sass: $(grep -E '^(HMMA|HGMMA|UTMALDG|LDSM|LDGSTS|LDL|STL) ' /tmp/sass_summary.txt | tr '\n' ' ')"
  # Per kernel, from the binary: where local memory is used (spills or local arrays), and whether
  # inside a loop, which costs every iteration (dev/sass_spills.py).
  python3 dev/sass_spills.py /tmp/sass.txt >/tmp/sass_spills.txt 2>&1
  { echo "kernels with local memory instructions (dev/sass_spills.py):"; cat /tmp/sass_spills.txt; } >>"$OUTDIR/build.log"
  note "spills in loops (SASS): $(grep -c 'instructions, [0-9]* loops' /tmp/sass_spills.txt) kernels with LDL / STL, $(grep -E ', [1-9][0-9]* of them inside loops' /tmp/sass_spills.txt | wc -l) with some inside a loop"
fi

# 3. Tests. After the smoke, three jobs share the GPU at once (none of them times anything): the
#    CUDA suite (then the sm90 primitives), compute-sanitizer's three tools one after another on
#    the small cases, and pytest. One after another they took ~8 minutes of a 10-minute call with
#    a broad filter (session 47); side by side the call lasts as long as the longest job.
if [ "$TESTS" = all ]; then
  # Smoke first: the small cases of every backend, briefly. A pipeline that deadlocks shows up
  # here in a minute instead of eating every later step's timeout.
  timeout 60 build-gpu/tests/flashcore_cuda_tests --gtest_filter='CudaSanitizerSmall.*' >"$OUTDIR/tests.log" 2>&1
  rc=$?
  if [ $rc = 124 ]; then
    note "SMOKE TEST HUNG (CudaSanitizerSmall, 60 s): stopping; see tests.log"; tail -5 "$OUTDIR/tests.log" | tee -a "$SUM"; exit 1
  fi
  note "smoke (small cases): rc=$rc ($(el))"
  # Each job notes its own result lines in the summary as it finishes, so a call cut off at its
  # limit still reports what completed. The sanitizers' timeouts allow for the shared GPU.
  if [ "$PYTEST" = yes ]; then
    ( PYTHONPATH=/tmp/fcpkg timeout "$(capped 300)" python3 -m pytest -q -x tests/python >"$OUTDIR/pytest.log" 2>&1
      note "pytest (torch + CUDA): rc=$? ($(el)) $(tail -1 "$OUTDIR/pytest.log")" ) &
  fi
  # --fuzz M: dev/api_fuzz.py on the CUDA backends for M minutes beside the tests, from a seed of
  # its own each call (in fuzz.log; a failure's line names its seed for --repro).
  if [ "$FUZZ" != 0 ]; then
    ( seed=$(( $(date +%s) % 100000 * 1000 ))
      PYTHONPATH=/tmp/fcpkg timeout "$(capped $(( FUZZ * 60 + 120 )))" python3 dev/api_fuzz.py --device cuda --minutes "$FUZZ" \
        --seed $seed --out /tmp/fuzz_failures.jsonl >"$OUTDIR/fuzz.log" 2>&1
      note "api fuzz (cuda, $FUZZ min, seed $seed): rc=$? ($(el)) $(grep -E '^iterations' "$OUTDIR/fuzz.log")"
      grep -E ' FAIL ' "$OUTDIR/fuzz.log" | head -5 | cut -c1-300 | tee -a "$SUM" ) &
  fi
  : >"$OUTDIR/sanitizers.log"
  # FLASHCORE_SM90_CLUSTER_PAIRS=1: the d128 / d256 calls the Hopper forward's cluster pairs fit run on
  # them (only long calls do by default), so the small cases reach that kernel too;
  # FLASHCORE_SM90_WHOLE_HEADS=2 likewise sends the d64 ones it fits over whole heads.
  ( for tool in memcheck racecheck synccheck; do
      FLASHCORE_SM90_CLUSTER_PAIRS=1 FLASHCORE_SM90_WHOLE_HEADS=2 timeout "$(capped 240)" compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/flashcore_cuda_tests \
        --gtest_filter='CudaSanitizerSmall.*:CudaKvCache.DeviceSideIndexChecks:CudaKvCache.LeftPadAndRotaryDeviceSideChecks:CudaKvCache.PrefillRouteDeviceSideChecks:CudaMergePartials.*:CudaDropout.SeedAndOffsetSelectTheMask:CudaDropout.ZeroProbabilityIsNoDropout:CudaSm90Dropout.ZeroProbabilityIsNoDropout:CudaDropoutSm90Backward.BackwardDrawsTheRulesMask' >>"$OUTDIR/sanitizers.log" 2>&1
      note "compute-sanitizer $tool: rc=$? ($(el))"
    done
    grep -E "ERROR SUMMARY|Invalid|Race|hazard" "$OUTDIR/sanitizers.log" | sort | uniq -c | head -10 | tee -a "$SUM" ) &
  # timeouts: a hung kernel (e.g. a pipeline barrier never completing) must not eat the whole call
  timeout "$(capped "$TEST_TIMEOUT" 45)" build-gpu/tests/flashcore_cuda_tests --gtest_filter="$FILTER" >>"$OUTDIR/tests.log" 2>&1
  rc=$?
  note "cuda tests: rc=$rc ($(el)) $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests.log" | tr '\n' ' ')"
  if [ $rc = 124 ]; then
    # Cut short: which tests of the filter never started (the one running when it was stopped
    # counts as not passed), as a --filter for the next call.
    build-gpu/tests/flashcore_cuda_tests --gtest_filter="$FILTER" --gtest_list_tests 2>/dev/null |
      awk '/^[^ ]/ {suite=$1; next} /^  / {print suite $1}' >/tmp/filter_tests.txt
    grep -oE '^\[       OK \] [^ ]+' "$OUTDIR/tests.log" | awk '{print $4}' | sort -u >/tmp/passed_tests.txt
    grep -vxFf /tmp/passed_tests.txt /tmp/filter_tests.txt >/tmp/unreached_tests.txt
    note "cuda tests CUT SHORT at the deadline: $(wc -l </tmp/unreached_tests.txt) of $(wc -l </tmp/filter_tests.txt) not passed, $(grep -c '^\[  FAILED  \]' "$OUTDIR/tests.log") FAILED lines; next: --filter '$(paste -sd: /tmp/unreached_tests.txt | cut -c1-1500)'"
  fi
  grep -E '^\[  FAILED  \]' "$OUTDIR/tests.log" | head -20 | tee -a "$SUM"
  if [ -x build-gpu/tests/cuda/sm90/flashcore_sm90_primitive_tests ]; then
    timeout "$(capped 60)" build-gpu/tests/cuda/sm90/flashcore_sm90_primitive_tests >>"$OUTDIR/tests.log" 2>&1
    note "sm90 primitive tests: rc=$? ($(el)) $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests.log" | tail -1)"
  fi
  wait
fi

# 4. The demo.
timeout "$(capped 60 10)" build-gpu/flashcore run >>"$SUM" 2>&1 || note "flashcore run FAILED"

# 5. Benchmark against the peers (same process).
if [ "$BENCH" != none ]; then
  Q=; [ "$BENCH" = quick ] && Q=--quick
  PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/fcpkg timeout "$(capped $((BUDGET + 60)) 10)" python3 bench/peers.py "$OUTDIR" $Q --budget "$BUDGET" $BENCH_ARGS \
    >"$OUTDIR/bench.log" 2>&1
  note "bench: rc=$? ($(el))"
  sed -n '/==== flashcore vs peers/,$p' "$OUTDIR/bench.log" >>"$SUM"
fi
if [ "$BENCH" != none ] && [ "$DECODE" = yes ]; then
  # Decode against the KV cache: K+V bytes per second next to SDPA cuDNN / flash.
  PYTHONUNBUFFERED=1 timeout "$(capped 180 10)" python3 bench/decode_bench.py --lib build-gpu/libflashcore.so >"$OUTDIR/decode.log" 2>&1
  note "decode bench: rc=$? ($(el))"
  tail -15 "$OUTDIR/decode.log" >>"$SUM"
fi
if [ "$DROPOUT" = yes ]; then
  # Dropout against SDPA's FlashAttention-2 with dropout (cuDNN takes none), forward and fwd+bwd.
  PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/fcpkg timeout "$(capped 300 10)" python3 bench/dropout_bench.py >"$OUTDIR/dropout.log" 2>&1
  note "dropout bench: rc=$? ($(el))"
  cat "$OUTDIR/dropout.log" >>"$SUM"
fi
echo; echo "==================== SUMMARY ===================="; cat "$SUM"
