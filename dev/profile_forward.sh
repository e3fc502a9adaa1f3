#!/bin/bash
# Nsight Compute summary of one forward configuration (ours or FA2) on the GPU machine: duration,
# pipe utilizations and the stall reasons (average warps stalled per issued instruction).
# usage: dev/profile_forward.sh LIB VARIANT(-1 = PyTorch FA2) HEAD_DIM SEQLEN CAUSAL OUTFILE
LIB=$1; VAR=$2; D=$3; S=$4; C=$5; OUTFILE=$6
if [[ $VAR -lt 0 ]]; then NAME="regex:flash_fwd"; else NAME="regex:forward_kernel"; fi
cd "$(dirname "$0")/.."
source dev/ncu_common.sh
METRICS="$NCU_METRICS,sm__warps_active.avg.per_cycle_active"
METRICS+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
ncu --kernel-name "$NAME" --launch-skip 1 --launch-count 1 --metrics "$METRICS" \
  python3 dev/forward_check.py "$LIB" --profile="$VAR,$D,$S,$C" > "$OUTFILE" 2>&1
ncu_summary "$OUTFILE"
