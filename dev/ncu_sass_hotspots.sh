#!/bin/bash
# Where one forward kernel's warps stall, instruction by instruction: Nsight Compute's PC sampling
# of one launch (flashcore's cuda_sm90 forward or a PyTorch SDPA peer), exported as the SASS source
# page (CSV) and summarized by dev/ncu_sass_hotspots.py. Needs the Python package on PYTHONPATH
# (gpu_check.sh puts it in /tmp/fcpkg).
# usage: dev/ncu_sass_hotspots.sh IMPL(flashcore|sdpa_cudnn|sdpa_flash) HEAD_DIM SEQLEN CAUSAL(0|1) OUTPREFIX
IMPL=$1; D=$2; S=$3; C=$4; PREFIX=$5
cd "$(dirname "$0")/.."
source dev/ncu_common.sh
NAME=$(ncu_kernel_regex fwd "$IMPL")
[ -n "$NAME" ] || { echo "unknown IMPL '$IMPL' (flashcore, sdpa_cudnn or sdpa_flash)"; exit 2; }
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats \
  -f -o "$PREFIX" python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" fwd > "$PREFIX.log" 2>&1
ncu -i "$PREFIX.ncu-rep" --page source --csv --print-source sass > "$PREFIX.csv" 2>>"$PREFIX.log" \
  || ncu -i "$PREFIX.ncu-rep" --page source --csv > "$PREFIX.csv" 2>>"$PREFIX.log"
python3 dev/ncu_sass_hotspots.py "$PREFIX.csv"
