# Shared by the Nsight Compute scripts in dev/ (sourced, not run): which kernel an IMPL names
# (profile_forward.sh, for the sm80 harness, picks its own), the metrics every summary reports,
# and the summary itself.

# ncu_kernel_regex PASS IMPL: the --kernel-name filter of IMPL's main kernel of PASS (fwd or bwd);
# prints nothing for an unknown pair.
ncu_kernel_regex() {
  case "$1:$2" in
    fwd:flashcore | fwd:flashcore_sm80) echo "regex:forward_kernel" ;;
    fwd:sdpa_cudnn) echo "regex:(fprop|fort_native)" ;;
    fwd:sdpa_flash) echo "regex:flash_fwd" ;;
    bwd:flashcore) echo "regex:^backward_kernel" ;;
    bwd:flashcore_sm80) echo "regex:backward_dkdv_kernel" ;;
    bwd:sdpa_flash) echo "regex:flash_bwd_dq_dk_dv" ;;  # the main kernel, not its preprocess or dQ conversion
  esac
}

# Duration, registers, tensor / MUFU / issue utilization, L2 and DRAM throughput, instructions and
# the stall reasons (average warps stalled per issued instruction).
NCU_METRICS="gpu__time_duration.sum,launch__registers_per_thread"
NCU_METRICS+=",sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
NCU_METRICS+=",sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
NCU_METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
NCU_METRICS+=",lts__throughput.avg.pct_of_peak_sustained_elapsed"
NCU_METRICS+=",dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum"
NCU_METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"

# ncu_summary FILE: one "metric value" line per metric of an ncu --metrics report (stall reasons
# below 0.05 left out).
ncu_summary() {
  grep -E "^\s+(gpu__|launch__|sm__|smsp__|l1tex__|lts__|dram__)" "$1" | awk '$NF+0 >= 0.05 || $1 !~ /stalled/' \
    | sed -E 's/smsp__average_warps_issue_stalled_/stall_/; s/_per_issue_active.ratio//' | awk '{print $1, $NF}'
}
