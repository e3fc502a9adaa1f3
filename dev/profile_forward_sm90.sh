#!/bin/bash
# Nsight Compute summary of one forward kernel launch (flashcore's cuda_sm90 forward, or PyTorch's
# cuDNN / FA2 forward) on the GPU machine: duration, tensor-pipe and memory utilization, and the
# stall reasons. Same package setup as dev/profile_backward.sh.
# usage: dev/profile_forward_sm90.sh IMPL(flashcore|sdpa_cudnn|sdpa_flash) HEAD_DIM SEQLEN CAUSAL(0|1) OUTFILE
IMPL=$1; D=$2; S=$3; C=$4; OUTFILE=$5
cd "$(dirname "$0")/.."
source dev/ncu_common.sh
NAME=$(ncu_kernel_regex fwd "$IMPL")
[ -n "$NAME" ] || { echo "unknown IMPL '$IMPL' (flashcore, sdpa_cudnn or sdpa_flash)"; exit 2; }
METRICS="$NCU_METRICS,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,lts__t_sector_hit_rate.pct"
METRICS+=",dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg"
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
  python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" fwd > "$OUTFILE" 2>&1
ncu_summary "$OUTFILE"
