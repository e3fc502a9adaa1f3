#!/bin/bash
# Nsight Compute summary of one forward kernel launch (flashcore's cuda_sm90 forward, or PyTorch's
# cuDNN / FA2 forward) on the GPU machine: duration, tensor-pipe and memory utilization, and the
# stall reasons. Same metric list and package setup as dev/profile_backward.sh.
# usage: dev/profile_forward_sm90.sh IMPL(flashcore|sdpa_cudnn|sdpa_flash) HEAD_DIM SEQLEN CAUSAL(0|1) OUTFILE
IMPL=$1; D=$2; S=$3; C=$4; OUTFILE=$5
case "$IMPL" in
  flashcore) NAME="regex:forward_kernel" ;;
  sdpa_cudnn) NAME="regex:(fprop|fort_native)" ;;
  sdpa_flash) NAME="regex:flash_fwd" ;;
  *) echo "unknown IMPL '$IMPL' (flashcore, sdpa_cudnn or sdpa_flash)"; exit 2 ;;
esac
METRICS="gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size"
METRICS+=",sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
METRICS+=",lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct"
METRICS+=",dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum"
METRICS+=",smsp__inst_executed.sum,sm__cycles_active.avg"
METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
  python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" fwd > "$OUTFILE" 2>&1
grep -E "^\s+(gpu__|launch__|sm__|smsp__|l1tex__|lts__|dram__)" "$OUTFILE" | awk '$NF+0 >= 0.05 || $1 !~ /stalled/' \
  | sed -E 's/smsp__average_warps_issue_stalled_/stall_/; s/_per_issue_active.ratio//' | awk '{print $1, $NF}'
