#!/bin/bash
# Nsight Compute summary of one backward main kernel (flashcore's sm90 or sm80, or PyTorch's FA2)
# on the GPU machine: duration, pipe utilizations and the stall reasons (average warps
# stalled per issued instruction). Needs the Python package on PYTHONPATH (gpu_check.sh puts it in
# /tmp/fcpkg).
# usage: dev/profile_backward.sh IMPL(flashcore|flashcore_sm80|sdpa_flash) HEAD_DIM SEQLEN CAUSAL(0|1) OUTFILE
IMPL=$1; D=$2; S=$3; C=$4; OUTFILE=$5
case "$IMPL" in
  flashcore) NAME="regex:^backward_kernel" ;;
  flashcore_sm80) NAME="regex:backward_dkdv_kernel" ;;
  sdpa_flash) NAME="regex:flash_bwd" ;;
  *) echo "unknown IMPL '$IMPL' (flashcore, flashcore_sm80 or sdpa_flash)"; exit 2 ;;
esac
METRICS="gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active"
METRICS+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
METRICS+=",lts__t_sectors_op_red.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed"
METRICS+=",dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum"
METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
  python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" > "$OUTFILE" 2>&1
grep -E "^\s+(gpu__|launch__|sm__|smsp__|l1tex__|lts__|dram__)" "$OUTFILE" | awk '$NF+0 >= 0.05 || $1 !~ /stalled/' \
  | sed -E 's/smsp__average_warps_issue_stalled_/stall_/; s/_per_issue_active.ratio//' | awk '{print $1, $NF}'
