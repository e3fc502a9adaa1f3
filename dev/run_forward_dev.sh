#!/bin/bash
# Builds dev/forward_harness.cu into a shared library and runs dev/forward_check.py: correctness of
# the backend entry (variant 0) and of the alternative configs, a race check, then the training-grid
# benchmark against PyTorch's FlashAttention-2. Meant for the GPU machine (nvcc + torch).
# usage: dev/run_forward_dev.sh [check|bench|all] [variants for bench, e.g. 1,4,8]
set -o pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
VARIANTS=${2:-1,2,3,4,5,6,7,8,9,10}
LIB=${LIB:-/tmp/libfcdev.so}
LOG=${OUT:-/tmp}
ARCH=${ARCH:-"-gencode arch=compute_90,code=sm_90"}
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -Xptxas -v -I include -I src -shared -Xcompiler -fPIC \
  $ARCH -DFLASHCORE_HDIM_64=1 -DFLASHCORE_HDIM_128=1 -DFLASHCORE_HDIM_256=1 \
  -DFLASHCORE_DTYPE_FP16=1 -DFLASHCORE_DTYPE_BF16=1 \
  dev/forward_harness.cu src/cuda/sm80/forward_api.cu src/cuda/device.cu -o "$LIB" \
  > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
export PYTHONUNBUFFERED=1
status=0
if [[ $MODE == check || $MODE == all ]]; then
  python3 dev/forward_check.py "$LIB" --check --check-variants 0 2>&1 | tee "$LOG/check.log" || status=1
  python3 dev/forward_check.py "$LIB" --check --quick --check-variants "$VARIANTS" 2>&1 \
    | tee "$LOG/check_variants.log" || status=1
fi
if [[ $MODE == bench || $MODE == all ]]; then
  python3 dev/forward_check.py "$LIB" --bench --variants "$VARIANTS" 2>&1 | tee "$LOG/bench.log"
fi
exit $status
