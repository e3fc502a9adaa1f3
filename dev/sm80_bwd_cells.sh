#!/bin/bash
# The sm80 backward's timing cells for dev/ab_builds.sh (run once per package there): fwd+bwd bf16
# on cuda_sm80 beside SDPA's FlashAttention-2 (dev/fwd_variants.py, one round), then the per-kernel
# times of two cells (dev/backward_breakdown.py: main kernel, preprocess, postprocess).
#   dev/ab_builds.sh run OUT --dims '64;128;256' --rounds 2 [--tests FILTER] -- bash dev/sm80_bwd_cells.sh
# CELLS (d:S:causal,...) replaces the timed cells and BREAKDOWN=0 leaves the per-kernel times out;
# both must be in the working tree that runs (session 57's call 5 ran a tree without them). BWD=0
# times the forward alone (and leaves the breakdown out).
cd "$(dirname "$0")/.."
BWD_FLAG=--bwd; [ "${BWD:-1}" = 0 ] && BWD_FLAG= BREAKDOWN=0
python3 dev/fwd_variants.py 0 $BWD_FLAG --rounds 1 --backend cuda_sm80 --peer flash \
  --cells "${CELLS:-64:2048:0,64:2048:1,64:8192:1,128:2048:0,128:2048:1,128:8192:1,256:2048:1}" 2>&1 | sed -n '/^====/,$p'
[ "${BREAKDOWN:-1}" = 0 ] || python3 dev/backward_breakdown.py --impls=flashcore_sm80 128:2048:1 64:8192:1 2>&1 | grep -v -i warn | tail -16
