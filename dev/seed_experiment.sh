#!/bin/bash
# One device call for a seed-shape experiment (B=1 H=8 S=512 D=64 fp16 forward, #3's target): a
# fp16 / d64-only build of the Python package (no tests unless --filter), dev/seed_anatomy.py per
# variant in alternating processes (a variant is FLASHCORE_DEV_SEED_VARIANT, read by whatever
# temporary switch the experiment adds), and optionally Nsight Compute on one warm launch: the
# replayed graph keeps K/V and the code in cache, so --cache-control none is the closer picture.
# Logs go to OUTDIR; the summary prints last. Keep the whole under the device's 10 minutes.
# usage: dev/seed_experiment.sh OUTDIR VARIANTS [--rounds R] [--ncu yes] [--ncu-variants 0,1]
#        [--filter GTEST_FILTER (builds the CUDA tests and runs them per variant)]
#        [--sanitize yes (compute-sanitizer on CudaSanitizerSmall.* per variant, with --filter)]
#        [--trace "B H S" (dev/sm80_forward_trace.cu per variant: the phases of the sm80 kernel)]
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage}; VARIANTS=${2:?usage}; shift 2
ROUNDS=3 NCU= NCU_VARIANTS=0 FILTER= SANITIZE= TRACE=
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --ncu) NCU=$2; shift 2 ;;
    --ncu-variants) NCU_VARIANTS=$2; shift 2 ;;
    --filter) FILTER=$2; shift 2 ;;
    --sanitize) SANITIZE=$2; shift 2 ;;
    --trace) TRACE=$2; shift 2 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
source dev/experiment_common.sh
experiment_start "$OUTDIR"

TESTS=OFF HDIMS=64 DTYPES=fp16; [ -n "$FILTER" ] && TESTS=ON HDIMS="64;128;256" DTYPES="fp16;bf16"
build_package build-seed /tmp/fcseed "-DFLASHCORE_HEAD_DIMS=$HDIMS" "-DFLASHCORE_DTYPES=$DTYPES" \
  -DFLASHCORE_BUILD_TESTS=$TESTS

for r in $(seq "$ROUNDS"); do
  for v in ${VARIANTS//,/ }; do
    FLASHCORE_DEV_SEED_VARIANT=$v timeout 120 python3 dev/seed_anatomy.py >"$OUTDIR/seed_v${v}_r$r.log" 2>&1
    note "round $r variant $v: $(grep -E 'flashcore auto|sdpa cudnn|sdpa flash|launch floor' "$OUTDIR/seed_v${v}_r$r.log" \
      | sed -E 's/ +/ /g; s/ us per call/us/' | tr '\n' ';')"
  done
done

# A quick check per variant against fp32 SDPA math on small-grid shapes (the full grids need --filter).
for v in ${VARIANTS//,/ }; do
  FLASHCORE_DEV_SEED_VARIANT=$v timeout 120 python3 -c "
import torch, torch.nn.functional as F, flashcore
worst = 0.0
for (b, h, hk, sq, sk, causal) in [(1, 8, 8, 512, 512, False), (1, 8, 8, 512, 512, True), (2, 4, 2, 300, 77, False),
                                  (1, 6, 3, 130, 700, True), (1, 16, 16, 64, 1, False), (3, 2, 2, 200, 200, True)]:
    q = torch.randn(b, sq, h, 64, device='cuda', dtype=torch.float16)
    k, v = (torch.randn(b, sk, hk, 64, device='cuda', dtype=torch.float16) for _ in range(2))
    out = flashcore.flash_attn_func(q, k, v, causal=causal)
    kr, vr = (x.float().repeat_interleave(h // hk, dim=2).transpose(1, 2) for x in (k, v))
    mask = None
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device='cuda').tril(sk - sq)
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), kr, vr, attn_mask=mask).transpose(1, 2)
    ref = torch.nan_to_num(ref)  # rows with no key: flashcore gives 0
    worst = max(worst, (out.float() - ref).abs().max().item())
print('max|diff| vs fp32 SDPA: %.2e %s' % (worst, 'ok' if worst < 4e-3 else 'BAD'))
" >"$OUTDIR/check_v$v.log" 2>&1
  note "check variant $v: $(tail -1 "$OUTDIR/check_v$v.log")"
done

if [ -n "$TRACE" ]; then
  if nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DFLASHCORE_SM80_FWD_TRACE \
      -I include -I src dev/sm80_forward_trace.cu src/cuda/device.cu -o build-seed/sm80_forward_trace >"$OUTDIR/trace.log" 2>&1; then
    for v in ${VARIANTS//,/ }; do
      echo "== variant $v" >>"$OUTDIR/trace.log"
      FLASHCORE_DEV_SEED_VARIANT=$v timeout 60 build-seed/sm80_forward_trace $TRACE >>"$OUTDIR/trace.log" 2>&1
    done
    note "trace: ($(el))"; cat "$OUTDIR/trace.log" >>"$SUM"
  else
    note "trace build FAILED"; tail -5 "$OUTDIR/trace.log" | tee -a "$SUM"
  fi
fi

if [ -n "$FILTER" ]; then
  for v in ${VARIANTS//,/ }; do
    FLASHCORE_DEV_SEED_VARIANT=$v timeout 300 build-seed/tests/flashcore_cuda_tests --gtest_filter="$FILTER" \
      >"$OUTDIR/tests_v$v.log" 2>&1
    note "tests variant $v: rc=$? ($(el)) $(grep -E '^\[  (PASSED|FAILED)' "$OUTDIR/tests_v$v.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUTDIR/tests_v$v.log" | head -5 | tee -a "$SUM"
    if [ -n "$SANITIZE" ]; then
      for tool in memcheck racecheck synccheck; do
        FLASHCORE_DEV_SEED_VARIANT=$v timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
          build-seed/tests/flashcore_cuda_tests --gtest_filter='CudaSanitizerSmall.*' >"$OUTDIR/sanitize_v$v.log" 2>&1
        note "compute-sanitizer $tool variant $v: rc=$? $(grep -E 'ERROR SUMMARY|hazard' "$OUTDIR/sanitize_v$v.log" | sort | uniq -c | tr '\n' ' ')"
      done
    fi
  done
fi

if [ "$NCU" = yes ]; then
  for v in ${NCU_VARIANTS//,/ }; do
    # Launch 26 of one process's calls: caches warm from the 25 before it, as in the replay.
    FLASHCORE_DEV_SEED_VARIANT=$v timeout 200 ncu --kernel-name regex:forward_kernel --launch-skip 25 --launch-count 1 \
      --cache-control none --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
      --metrics lts__t_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,sm__cycles_active.avg,smsp__inst_executed.sum \
      python3 -c "
import torch, flashcore
q, k, v = (torch.randn(1, 512, 8, 64, device='cuda', dtype=torch.float16) for _ in range(3))
for _ in range(30): flashcore.flash_attn_func(q, k, v)
torch.cuda.synchronize()" >"$OUTDIR/ncu_v$v.log" 2>&1
    note "ncu variant $v: rc=$? ($(el))"
    grep -E "Duration|Throughput|lts__t_bytes|xbar2l1tex|srcunit|sm__cycles_active|inst_executed.sum|Registers|Stall|Issued Warp|No Eligible|Active Warps|Hit Rate|Mem Busy|Max Bandwidth" \
      "$OUTDIR/ncu_v$v.log" | sed -E 's/ +/ /g' | head -40 | tee -a "$SUM"
  done
fi
echo; echo "==================== SUMMARY ===================="; cat "$SUM"
