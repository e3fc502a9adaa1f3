#!/usr/bin/env bash
# One call on a machine with several GPUs of one host (device kinds nvidia-h200-x2 and up): ring
# attention (python/flashcore/ring_attention.py) over NCCL. Builds the Python package (sm_90,
# every head dim and dtype), prints the GPUs' topology, runs tests/python/test_ring_attention.py
# (the NCCL ranks test needs two GPUs; the thread-ring and gloo tests run too), then
# bench/ring_bench.py over every GPU: forward and forward + backward, contiguous and zigzag shards,
# causal and not, next to flashcore on one GPU over the whole sequence in the same run.
# Logs go to OUTDIR; a short summary prints last.
#
# usage: dev/ring_check.sh OUTDIR [seqlen per rank, default 8192]
set -uo pipefail
cd "$(dirname "$0")/.."
source dev/experiment_common.sh
OUTDIR=${1:?usage: dev/ring_check.sh OUTDIR [seqlen per rank]}
PER_RANK=${2:-8192}
experiment_start "$OUTDIR"
note "GPUs: $(nvidia-smi --query-gpu=index,name --format=csv,noheader | tr '\n' ';')"
nvidia-smi topo -m >"$OUTDIR/topology.txt" 2>&1
build_package build-ring /tmp/fcpkg-ring

timeout 300 python3 -m pytest -q -rs tests/python/test_ring_attention.py >"$OUTDIR/pytest.log" 2>&1
note "test_ring_attention.py: rc=$? ($(el)) $(tail -1 "$OUTDIR/pytest.log")"
grep -E "SKIPPED|FAILED|Error" "$OUTDIR/pytest.log" | head -10 | tee -a "$SUM"

: >"$OUTDIR/bench.log"
for args in "--layout contiguous" "--causal --layout contiguous" "--causal --layout zigzag"; do
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/ring_bench.py --seqlen-per-rank "$PER_RANK" $args \
    >>"$OUTDIR/bench.log" 2>&1
  note "ring_bench $args: rc=$? ($(el))"
done
grep -E "^ring over|^  (forward|fwd\+bwd)" "$OUTDIR/bench.log" | tee -a "$SUM" >/dev/null
echo; echo "==================== SUMMARY ===================="; cat "$SUM"
