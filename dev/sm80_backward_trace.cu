// Where a query step's time goes in the sm80 dK / dV kernel: runs sm80::backward_run on one
// training-grid shape (batch 16384 / S, heads 2048 / d, bf16) built with FLASHCORE_SM80_BWD_TRACE
// (src/cuda/sm80/backward_trace.cuh), so lane 0 of every warp of the first CTAs records the SM
// clock at each phase boundary of each step; prints the traced backward's time and, per interval
// of a step, the mean SM cycles per warp (a barrier's interval is mostly its wait). Then, for the
// warps sharing an SM sub-partition (w and w + 4), how far apart they reach the end of the
// element-wise step: near 0 means they ran their exponentials at the same time.
//
// build (on the GPU machine, from the repository root; ~1 min):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 --expt-relaxed-constexpr \
//     -DFLASHCORE_SM80_BWD_TRACE -I include -I src dev/sm80_backward_trace.cu src/cuda/device.cu \
//     -o build/sm80_backward_trace
// run:   build/sm80_backward_trace HEAD_DIM SEQLEN CAUSAL
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm80/backward.cuh"
#include "cuda_tool.hpp"

namespace fc = flashcore;
namespace sm80 = flashcore::cuda::sm80;
namespace bwd = flashcore::cuda::sm80::bwd;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s HEAD_DIM SEQLEN CAUSAL\n", argv[0]);
    return 2;
  }
  const int d = std::atoi(argv[1]);
  const int s = std::atoi(argv[2]);
  const bool causal = std::atoi(argv[3]) != 0;
  const fc::BackwardParams p = training_grid_cell(d, s, causal);
  const int64_t b = p.batch, h = p.heads_q;

  const int slots = bwd::kBwdTraceCtas * bwd::kBwdTraceWarps;
  flashcore::cuda::TraceRecord* trace;
  CHECK(cudaMalloc(&trace, int64_t(slots) * bwd::kBwdTraceCapacity * sizeof(flashcore::cuda::TraceRecord)));
  CHECK(cudaMemcpyToSymbol(bwd::g_bwd_trace, &trace, sizeof(trace)));
  const size_t ws_bytes = sm80::BackwardWorkspaceLayout::make(p, d, /*dq_tiled=*/true).total_bytes;
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, ws_bytes));
  auto run = [&] {
    require_ok(d == 64    ? sm80::backward_run<__nv_bfloat16, 64>(p, ws, ws_bytes)
               : d == 128 ? sm80::backward_run<__nv_bfloat16, 128>(p, ws, ws_bytes)
                          : sm80::backward_run<__nv_bfloat16, 256>(p, ws, ws_bytes));
  };
  // Warm up, time the traced backward, then one clean traced run whose records are kept.
  for (int i = 0; i < 3; ++i) run();
  const int reps = 20;
  const float ms = ms_per_call(run, reps) * reps;
  std::vector<int> counts(slots, 0);
  CHECK(cudaMemcpyToSymbol(bwd::g_bwd_trace_count, counts.data(), counts.size() * sizeof(int)));
  run();
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpyFromSymbol(counts.data(), bwd::g_bwd_trace_count, counts.size() * sizeof(int)));
  std::vector<flashcore::cuda::TraceRecord> rec(int64_t(slots) * bwd::kBwdTraceCapacity);
  CHECK(cudaMemcpy(rec.data(), trace, rec.size() * sizeof(flashcore::cuda::TraceRecord), cudaMemcpyDeviceToHost));

  const double us = 1e3 * ms / reps;
  const double flop = 2.5 * 4.0 * b * h * s * double(s) * d / (causal ? 2 : 1);
  std::printf("sm80 backward d%d S%d %s, batch %lld heads %lld bf16: traced %.1f us per call, %.1f TFLOP/s "
              "(all stages)\n",
              d, s, causal ? "causal" : "full", static_cast<long long>(b), static_cast<long long>(h), us,
              flop / us * 1e-6);

  // Intervals between consecutive records of a warp, keyed by (event before, event after): the
  // record order is the kernel's program order, whichever order a variant runs its phases in.
  constexpr int kEvents = bwd::kBwdStepEnd + 1;
  const char* names[kEvents] = {"", "step begin", "scores done", "P/dS shared", "dV issued", "dK issued",
                                "dQ sent", "step end"};
  const int warps = bwd::kBwdTraceWarps;
  std::vector<double> sum(kEvents * kEvents * warps, 0.0);
  std::vector<int> num(kEvents * kEvents * warps, 0);
  std::vector<int> first_seen(kEvents * kEvents, 1 << 30);  // for printing in program order
  // Per (CTA, warp, step): the clock at 'scores done' and at 'step begin', for the sibling check.
  auto clock_at = [&](int slot, int event) {
    std::vector<uint32_t> at;
    const int n = std::min(counts[slot], bwd::kBwdTraceCapacity);
    for (int i = 0; i < n; ++i) {
      const flashcore::cuda::TraceRecord& r = rec[int64_t(slot) * bwd::kBwdTraceCapacity + i];
      if (static_cast<int>(r.event_and_arg & 0xFF) != event) continue;
      const size_t step = r.event_and_arg >> 8;
      if (step >= at.size()) at.resize(step + 1, 0);
      at[step] = r.clock;
    }
    return at;
  };
  int traced_steps = 0;
  std::vector<double> sibling_gap, scores_length;
  for (int cta = 0; cta < bwd::kBwdTraceCtas; ++cta) {
    for (int w = 0; w < warps; ++w) {
      const int slot = cta * warps + w;
      const int n = std::min(counts[slot], bwd::kBwdTraceCapacity);
      for (int i = 1; i < n; ++i) {
        const flashcore::cuda::TraceRecord& a = rec[int64_t(slot) * bwd::kBwdTraceCapacity + i - 1];
        const flashcore::cuda::TraceRecord& c = rec[int64_t(slot) * bwd::kBwdTraceCapacity + i];
        const int from = static_cast<int>(a.event_and_arg & 0xFF), to = static_cast<int>(c.event_and_arg & 0xFF);
        if (from >= kEvents || to >= kEvents) continue;
        const int key = from * kEvents + to;
        sum[key * warps + w] += static_cast<double>(c.clock - a.clock);
        ++num[key * warps + w];
        first_seen[key] = std::min(first_seen[key], i);
        if (w == 0 && to == bwd::kBwdStepBegin) ++traced_steps;
      }
      if (w >= 4) continue;
      const std::vector<uint32_t> done = clock_at(slot, bwd::kBwdScoresDone);
      const std::vector<uint32_t> sib = clock_at(slot + 4, bwd::kBwdScoresDone);
      const std::vector<uint32_t> begin = clock_at(slot, bwd::kBwdStepBegin);
      for (size_t i = 0; i < std::min({done.size(), sib.size(), begin.size()}); ++i) {
        if (done[i] == 0 || sib[i] == 0 || begin[i] == 0) continue;
        sibling_gap.push_back(std::fabs(static_cast<double>(static_cast<int32_t>(done[i] - sib[i]))));
        scores_length.push_back(static_cast<double>(done[i] - begin[i]));
      }
    }
  }
  std::vector<int> keys;
  for (int key = 0; key < kEvents * kEvents; ++key) {
    if (first_seen[key] != (1 << 30)) keys.push_back(key);
  }
  std::sort(keys.begin(), keys.end(), [&](int x, int y) { return first_seen[x] < first_seen[y]; });
  std::printf("%d CTAs traced, %d query steps each on average; mean SM cycles per interval:\n",
              bwd::kBwdTraceCtas, traced_steps / bwd::kBwdTraceCtas + 1);
  std::printf("%-28s", "interval");
  for (int w = 0; w < warps; ++w) std::printf("  warp %d", w);
  std::printf("     all\n");
  for (int key : keys) {
    char label[64];
    std::snprintf(label, sizeof(label), "%s -> %s", names[key / kEvents], names[key % kEvents]);
    std::printf("%-28s", label);
    double all = 0.0;
    int all_n = 0;
    for (int w = 0; w < warps; ++w) {
      const int i = key * warps + w;
      std::printf(" %7.0f", num[i] ? sum[i] / num[i] : 0.0);
      all += sum[i];
      all_n += num[i];
    }
    std::printf(" %7.0f\n", all_n ? all / all_n : 0.0);
  }
  if (!sibling_gap.empty()) {
    std::sort(sibling_gap.begin(), sibling_gap.end());
    std::sort(scores_length.begin(), scores_length.end());
    std::printf("warps w and w + 4 (one SM sub-partition): their 'scores done' apart by median %.0f cycles "
                "(90th percentile %.0f); step begin -> scores done takes median %.0f\n",
                sibling_gap[sibling_gap.size() / 2], sibling_gap[sibling_gap.size() * 9 / 10],
                scores_length[scores_length.size() / 2]);
  }
  return 0;
}
