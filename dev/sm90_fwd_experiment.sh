#!/bin/bash
# One device call for an sm90 forward experiment: a bf16-only build of the Python package (no
# tests, no CLI: 20-60 s on 16 cores), dev/fwd_variants.py (variants next to cuDNN, same process;
# ~12 s per cell for four variants, 3 rounds; env VARIANTS_TIMEOUT caps it, default 400 s), then
# optionally the CUDA tests with given variants and Nsight Compute on one cell per listed variant
# (metrics and the SASS stall hotspots). Logs go to OUTDIR (at most 8 files); the summary prints
# last. Keep the whole under the device's 10 min.
# usage: dev/sm90_fwd_experiment.sh OUTDIR VARIANTS [--cells C] [--rounds R] [--bwd (time fwd+bwd)]
#        [--backend B --peer flash|cudnn (fwd_variants' backend and SDPA peer: an sm80 experiment
#        takes --backend cuda_sm80 --peer flash)] [--ncu D:S:CAUSAL]
#        [--ncu-variants 0,1] [--filter GTEST_FILTER --test-variants 1,2 (builds the CUDA tests,
#        both dtypes, and runs them with each of these variants)] [--trace D:S:CAUSAL,... (the
#        event trace of dev/sm90_trace.cu: where a tile's time goes) [--trace-variants 0,1]
#        [--trace-kernel fwd|bwd (bwd: the backward's main kernel instead)]]
#        [--sanitize-variants 1,2 (with --filter: compute-sanitizer memcheck, racecheck and synccheck
#        on the small cases, CudaSanitizerSmall.*, per variant)] [--test-timeout S (per variant, default 200)]
#        [--cmake ARG (one more CMake argument for the build, repeatable; e.g.
#        '-DCMAKE_CUDA_FLAGS=-Xptxas=-v -DFLASHCORE_DQ_SCALAR_SLOTS=1' runs the sm80 backward's
#        sm_80 dQ slot order on a Hopper GPU)]
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage}; VARIANTS=${2:?usage}; shift 2
CELLS= ROUNDS=3 BWD= BACKEND=auto PEER=cudnn NCU= NCU_VARIANTS=0 FILTER= TEST_VARIANTS= TRACE= TRACE_VARIANTS=0 TRACE_KERNEL=fwd SANITIZE_VARIANTS= TEST_TIMEOUT=200
EXTRA_CMAKE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cells) CELLS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --bwd) BWD=--bwd; shift ;;
    --backend) BACKEND=$2; shift 2 ;;
    --peer) PEER=$2; shift 2 ;;
    --ncu) NCU=$2; shift 2 ;;
    --ncu-variants) NCU_VARIANTS=$2; shift 2 ;;
    --filter) FILTER=$2; shift 2 ;;
    --test-variants) TEST_VARIANTS=$2; shift 2 ;;
    --trace) TRACE=$2; shift 2 ;;
    --trace-variants) TRACE_VARIANTS=$2; shift 2 ;;
    --trace-kernel) TRACE_KERNEL=$2; shift 2 ;;
    --sanitize-variants) SANITIZE_VARIANTS=$2; shift 2 ;;
    --test-timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --cmake) EXTRA_CMAKE+=("$2"); shift 2 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
source dev/experiment_common.sh
experiment_start "$OUTDIR"

TESTS=OFF DTYPES=bf16; [ -n "$FILTER" ] && TESTS=ON DTYPES="fp16;bf16"
build_package build-exp /tmp/fcexp "-DFLASHCORE_DTYPES=$DTYPES" -DFLASHCORE_BUILD_TESTS=$TESTS "${EXTRA_CMAKE[@]}"

ARGS=(--rounds "$ROUNDS" $BWD --backend "$BACKEND" --peer "$PEER"); [ -n "$CELLS" ] && ARGS+=(--cells "$CELLS")
PYTHONUNBUFFERED=1 timeout "${VARIANTS_TIMEOUT:-400}" python3 dev/fwd_variants.py "$VARIANTS" "${ARGS[@]}" >"$OUTDIR/variants.log" 2>&1
note "variants: rc=$? ($(el))"
sed -n '/^====/,$p' "$OUTDIR/variants.log" >>"$SUM"
grep "max|diff|" "$OUTDIR/variants.log" | sed 's/.*max|diff|/max|diff|/' | sort | uniq -c | head -3 >>"$SUM"

if [ -n "$FILTER" ]; then
  IFS=',' read -ra TV <<<"${TEST_VARIANTS:-$VARIANTS}"
  for v in "${TV[@]}"; do
    FLASHCORE_DEV_FWD_VARIANT=$v timeout "$TEST_TIMEOUT" build-exp/tests/flashcore_cuda_tests --gtest_filter="$FILTER" \
      >"$OUTDIR/tests_v$v.log" 2>&1
    note "tests variant $v: rc=$? ($(el)) $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests_v$v.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUTDIR/tests_v$v.log" | head -5 | tee -a "$SUM"
  done
fi

if [ -n "$FILTER" ] && [ -n "$SANITIZE_VARIANTS" ]; then
  for v in ${SANITIZE_VARIANTS//,/ }; do
    for tool in memcheck racecheck synccheck; do
      FLASHCORE_DEV_FWD_VARIANT=$v timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
        build-exp/tests/flashcore_cuda_tests --gtest_filter='CudaSanitizerSmall.*' >"$OUTDIR/sanitize.log" 2>&1
      note "compute-sanitizer $tool variant $v: rc=$? ($(el)) $(grep -E 'ERROR SUMMARY|hazard' "$OUTDIR/sanitize.log" | sort | uniq -c | tr '\n' ' ')"
    done
  done
fi

if [ -n "$TRACE" ]; then
  TRACE_MACRO=FLASHCORE_SM90_FWD_TRACE; [ "$TRACE_KERNEL" = bwd ] && TRACE_MACRO=FLASHCORE_SM90_BWD_TRACE
  if nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -D$TRACE_MACRO \
      -I include -I src dev/sm90_trace.cu src/cuda/sm90/tensor_map.cpp src/cuda/device.cu \
      -o build-exp/sm90_trace >"$OUTDIR/trace.log" 2>&1; then
    IFS=',' read -ra TC <<<"$TRACE"
    for c in "${TC[@]}"; do
      IFS=':' read -r D S C <<<"$c"
      for v in ${TRACE_VARIANTS//,/ }; do
        bin="$OUTDIR/trace_d${D}_s${S}_c${C}_v$v.bin"
        FLASHCORE_DEV_FWD_VARIANT=$v timeout 60 build-exp/sm90_trace "$TRACE_KERNEL" "$D" "$S" "$C" "$bin" >>"$OUTDIR/trace.log" 2>&1
        python3 dev/sm90_trace.py "$bin" --ctas 4 >>"$OUTDIR/trace.log" 2>&1 && rm -f "$bin"
      done
    done
    note "trace: ($(el))"; grep -E "traced kernel" "$OUTDIR/trace.log" | tee -a "$SUM"
  else
    note "trace build FAILED"; tail -5 "$OUTDIR/trace.log" | tee -a "$SUM"
  fi
fi

if [ -n "$NCU" ]; then
  IFS=':' read -r D S C <<<"$NCU"
  IFS=',' read -ra NV <<<"$NCU_VARIANTS"
  for v in "${NV[@]}"; do
    { echo "== flashcore variant $v, d$D S$S causal $C"
      FLASHCORE_DEV_FWD_VARIANT=$v bash dev/profile_forward_sm90.sh flashcore "$D" "$S" "$C" /tmp/ncu_m_$v.txt
      FLASHCORE_DEV_FWD_VARIANT=$v bash dev/ncu_sass_hotspots.sh flashcore "$D" "$S" "$C" /tmp/ncu_h_$v
    } >"$OUTDIR/ncu_v$v.log" 2>&1
    note "ncu variant $v: rc=$? ($(el))"
  done
  { echo "== cuDNN d$D S$S causal $C"; bash dev/profile_forward_sm90.sh sdpa_cudnn "$D" "$S" "$C" /tmp/ncu_m_cudnn.txt
    grep -m3 -E "fprop|fort_native" /tmp/ncu_m_cudnn.txt; } >"$OUTDIR/ncu_cudnn.log" 2>&1
  note "ncu cuDNN: rc=$? ($(el))"
fi
echo; echo "==================== SUMMARY ===================="; cat "$SUM"
