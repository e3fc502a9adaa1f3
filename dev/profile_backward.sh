#!/bin/bash
# Nsight Compute summary of one backward main kernel (flashcore's sm90 or sm80, or PyTorch's FA2)
# on the GPU machine: duration, pipe utilizations and the stall reasons (average warps
# stalled per issued instruction). Needs the Python package on PYTHONPATH (gpu_check.sh puts it in
# /tmp/fcpkg).
# usage: dev/profile_backward.sh IMPL(flashcore|flashcore_sm80|sdpa_flash) HEAD_DIM SEQLEN CAUSAL(0|1) OUTFILE
IMPL=$1; D=$2; S=$3; C=$4; OUTFILE=$5
cd "$(dirname "$0")/.."
source dev/ncu_common.sh
NAME=$(ncu_kernel_regex bwd "$IMPL")
[ -n "$NAME" ] || { echo "unknown IMPL '$IMPL' (flashcore, flashcore_sm80 or sdpa_flash)"; exit 2; }
METRICS="$NCU_METRICS,sm__warps_active.avg.per_cycle_active"
METRICS+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
METRICS+=",lts__t_sectors_op_red.sum"
# EXTRA_METRICS (environment): more ncu metrics, comma-separated.
METRICS+="${EXTRA_METRICS:+,$EXTRA_METRICS}"
ncu --kernel-name "$NAME" --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
  python3 dev/profile_backward.py "$IMPL" "$D" "$S" "$C" > "$OUTFILE" 2>&1
ncu_summary "$OUTFILE"
