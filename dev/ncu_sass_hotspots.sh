#!/bin/bash
# Where one attention kernel's warps stall, instruction by instruction: Nsight Compute's PC sampling
# of one launch (flashcore's forward or backward main kernel, or a PyTorch SDPA peer's), exported
# as the SASS source page (CSV) and summarized by dev/ncu_sass_hotspots.py. Needs the Python
# package on PYTHONPATH (gpu_check.sh puts it in /tmp/fcpkg).
# usage: dev/ncu_sass_hotspots.sh IMPL(flashcore|flashcore_sm80|sdpa_cudnn|sdpa_flash) HEAD_DIM SEQLEN
#        CAUSAL(0|1) OUTPREFIX [PASS(fwd|bwd), default fwd]
IMPL=$1; D=$2; S=$3; C=$4; PREFIX=$5; PASS=${6:-fwd}
cd "$(dirname "$0")/.."
source dev/ncu_common.sh
NAME=$(ncu_kernel_regex "$PASS" "$IMPL")
[ -n "$NAME" ] || { echo "no $PASS kernel known for IMPL '$IMPL'"; exit 2; }
FWD_ONLY=; [ "$PASS" = fwd ] && FWD_ONLY=fwd
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats \
  -f -o "$PREFIX" python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" $FWD_ONLY > "$PREFIX.log" 2>&1
ncu -i "$PREFIX.ncu-rep" --page source --csv --print-source sass > "$PREFIX.csv" 2>>"$PREFIX.log" \
  || ncu -i "$PREFIX.ncu-rep" --page source --csv > "$PREFIX.csv" 2>>"$PREFIX.log"
python3 dev/ncu_sass_hotspots.py "$PREFIX.csv"
