#!/usr/bin/env bash
# One GPU call for the decode (KV-cache) path: build (sm_90 only), the decode / KV-cache / merge
# tests, compute-sanitizer memcheck, racecheck and synccheck on the device-side index checks, and
# bench/decode_bench.py (cuDNN / FA2 peers and the read ceiling measured in the same process).
# Logs go to OUTDIR; a short summary prints last.
#
# usage: bench/decode_check.sh OUTDIR [extra bench/decode_bench.py arguments, e.g. --profile --sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bench/decode_check.sh OUTDIR [decode_bench.py args]}
shift
mkdir -p "$OUTDIR"
SUM="$OUTDIR/summary.txt"
: >"$SUM"
note() { echo "$*" | tee -a "$SUM"; }
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 ))s; }
B=build-gpu

note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCORE_CUDA=ON -DFLASHCORE_CUDA_ARCHS=90 \
  -UFLASHCORE_MAX_CUDA_UNITS -UFLASHCORE_HEAD_DIMS -UFLASHCORE_DTYPES -DFLASHCORE_BUILD_TESTS=ON \
  -DFLASHCORE_BUILD_PYTHON=OFF -DCMAKE_CUDA_FLAGS="-Xptxas=-v" >"$OUTDIR/build.log" 2>&1
if ! timeout 330 cmake --build $B -j 16 --target libflashcore.so flashcore_cuda_tests >>"$OUTDIR/build.log" 2>&1; then
  note "BUILD FAILED ($(el)):"; grep -E "error|Error" "$OUTDIR/build.log" | head -30 | tee -a "$SUM"; exit 1
fi
[ -f $B/libflashcore.so ] || { note "no $B/libflashcore.so after the build"; exit 1; }
note "build ok ($(el)); decode kernels: $(grep -A3 'attention_kernelI13__nv_bfloat16Li128' "$OUTDIR/build.log" | grep -oE 'Used [0-9]+ registers|[0-9]+ bytes spill stores' | sort | uniq -c | tr '\n' ' ')"

timeout 240 $B/tests/flashcore_cuda_tests --gtest_filter='CudaKvCache*:CudaMergePartials*:*Decode*:*KvCache*' \
  >"$OUTDIR/tests.log" 2>&1
note "decode tests: rc=$? ($(el)) $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]|Failure|error' "$OUTDIR/tests.log" | head -20 | tee -a "$SUM"
for tool in memcheck racecheck synccheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $B/tests/flashcore_cuda_tests \
    --gtest_filter="CudaKvCache.DeviceSideIndexChecks:CudaMergePartials.*" >"$OUTDIR/sanitizer_$tool.log" 2>&1
  note "compute-sanitizer $tool: rc=$? ($(el)) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUTDIR/sanitizer_$tool.log" | tr '\n' ' ')"
done

PYTHONUNBUFFERED=1 timeout 300 python3 bench/decode_bench.py --lib $B/libflashcore.so "$@" >"$OUTDIR/decode.log" 2>&1
note "decode bench: rc=$? ($(el))"
sed -n '/^batch x kv_len/,$p' "$OUTDIR/decode.log" >>"$SUM"
echo; echo "==================== SUMMARY ===================="; cat "$SUM"
