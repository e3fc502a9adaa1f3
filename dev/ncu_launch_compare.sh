#!/bin/bash
# Launch configuration (grid, block, registers, shared memory, clusters) and headline counters
# (duration, DRAM and L2 bytes, warp instructions) of SDPA cuDNN's and flashcore's forward kernels
# on a few training-grid cells, one Nsight Compute pass each: what cuDNN's kernel is made of next
# to ours. Builds the bf16 Python package first (dev/experiment_common.sh). Needs a GPU and ncu.
# usage: dev/ncu_launch_compare.sh OUTDIR ["D S CAUSAL" ...]   (default: d128 512 full, d64 512
#        causal, d128 16k full)
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/experiment_common.sh
source dev/ncu_common.sh
experiment_start "${1:?usage: dev/ncu_launch_compare.sh OUTDIR [\"D S CAUSAL\" ...]}"
shift
CELLS=("$@")
[ ${#CELLS[@]} -eq 0 ] && CELLS=("128 512 0" "64 512 1" "128 16384 0")
build_package build-exp /tmp/fcexp -DFLASHCORE_DTYPES=bf16 -DFLASHCORE_BUILD_TESTS=OFF
METRICS=gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
METRICS+=,dram__bytes_write.sum,lts__t_bytes.sum,smsp__inst_executed.sum
for cell in "${CELLS[@]}"; do
  read -r D S C <<<"$cell"
  for impl in sdpa_cudnn flashcore; do
    NAME=$(ncu_kernel_regex fwd "$impl")
    note "=== $impl d$D S$S causal $C"
    ncu --kernel-name "$NAME" --launch-skip 3 --launch-count 1 --section LaunchStats --metrics "$METRICS" \
      python3 dev/profile_backward.py "$impl" "$D" "$S" "$C" fwd 2>&1 \
      | grep -E "==PROF== Profiling|__|Block Size|Grid Size|Registers Per|Dynamic Shared Memory Per|Cluster Size" \
      | sed 's/==PROF== Profiling //; s/: 0%.*//' | tee -a "$SUM"
  done
done
