#!/bin/bash
# Nsight Compute summary of one forward configuration (ours or FA2) on the GPU machine: duration,
# pipe utilizations and the stall reasons (average warps stalled per issued instruction).
# usage: dev/profile_forward.sh LIB VARIANT(-1 = PyTorch FA2) HEAD_DIM SEQLEN CAUSAL OUTFILE
LIB=$1; VAR=$2; D=$3; S=$4; C=$5; OUTFILE=$6
if [[ $VAR -lt 0 ]]; then NAME="regex:flash_fwd"; else NAME="regex:forward_kernel"; fi
METRICS="gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active"
METRICS+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
METRICS+=",smsp__inst_executed.sum"
METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
ncu --kernel-name "$NAME" --launch-skip 1 --launch-count 1 --metrics "$METRICS" \
  python3 dev/forward_check.py "$LIB" --profile="$VAR,$D,$S,$C" > "$OUTFILE" 2>&1
grep -E "^\s+(gpu__|launch__|sm__|smsp__|l1tex__)" "$OUTFILE" | awk '$NF+0 >= 0.05 || $1 !~ /stalled/' \
  | sed -E 's/smsp__average_warps_issue_stalled_/stall_/; s/_per_issue_active.ratio//' | awk '{print $1, $NF}'
