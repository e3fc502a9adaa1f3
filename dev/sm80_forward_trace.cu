// Where a short call's time goes in the sm80 forward: runs one shape (default the seed shape,
// B=1 H=8 S=512 D=64 fp16) through sm80::forward_run built with FLASHCORE_SM80_FWD_TRACE
// (src/cuda/sm80/forward_trace.cuh), many calls back to back as programmatic dependents (as in a
// replayed graph), and prints for the last call: per phase, the SM cycles since the warp's start
// (median and max over warps, per key group), and the spread of the CTAs' start and end times.
//
// build (on the GPU machine, from the repository root; ~30 s):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DFLASHCORE_SM80_FWD_TRACE -I include -I src dev/sm80_forward_trace.cu src/cuda/device.cu \
//     -o build/sm80_forward_trace
// run:   build/sm80_forward_trace [BATCH HEADS SEQLEN]   (fp16, full attention)
// The head dim is d64 unless built with -DTRACE_HEAD_DIM=128 (or 256).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm80/forward.cuh"
#include "cuda_tool.hpp"

namespace fc = flashcore;
namespace sm80 = flashcore::cuda::sm80;

int main(int argc, char** argv) {
  const int64_t b = argc > 1 ? std::atoll(argv[1]) : 1;
  const int64_t h = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t s = argc > 3 ? std::atoll(argv[3]) : 512;
#ifndef TRACE_HEAD_DIM
#define TRACE_HEAD_DIM 64
#endif
  constexpr int d = TRACE_HEAD_DIM;
  const int64_t elems = b * s * h * d;
  const std::vector<__half> host =
      uniform_values<__half>(elems, [](float x) { return __float2half(x); });
  __half *q, *k, *v, *o;
  for (auto** t : {&q, &k, &v, &o}) CHECK(cudaMalloc(t, elems * 2));
  for (auto* t : {q, k, v}) CHECK(cudaMemcpy(t, host.data(), elems * 2, cudaMemcpyHostToDevice));
  fc::AttentionParams p;
  set_dense_problem(p, fc::DType::F16, q, k, v, o, b, s, h, d);

  // Generous: room for 16 warps per 16-row block.
  const int64_t slots = (s / 16 + 1) * h * b * 16 * sm80::kForwardPhases;
  uint64_t* trace;
  CHECK(cudaMalloc(&trace, slots * sizeof(uint64_t)));
  CHECK(cudaMemset(trace, 0, slots * sizeof(uint64_t)));
  CHECK(cudaMemcpyToSymbol(sm80::g_forward_trace, &trace, sizeof(trace)));
  auto run = [&] { require_ok(sm80::forward_run<__half, d>(p, nullptr, 0)); };
  for (int i = 0; i < 20; ++i) run();
  const int reps = 200;
  const float ms = ms_per_call(run, reps) * reps;
  std::vector<uint64_t> rec(slots);
  CHECK(cudaMemcpy(rec.data(), trace, slots * sizeof(uint64_t), cudaMemcpyDeviceToHost));

  // The configuration forward_run chose (the same test it makes).
  using Small = sm80::SmallGridForwardTraits<__half, d>::type;
  using Default = sm80::DefaultForwardTraits<__half, d>::type;
  const bool small = sm80::prefer_small_grid<Small>(p);
  const int warps = small ? Small::kWarps : Default::kWarps;
  const int groups = small ? Small::kKeyGroups : Default::kKeyGroups;
  const int64_t rows = small ? Small::kBlockM : Default::kBlockM;
  const int ctas = static_cast<int>((s + rows - 1) / rows * h * b);
  std::printf("B=%lld H=%lld S=%lld d%d fp16: %.2f us per call (%d back to back, events), "
              "%d CTAs x %d warps\n",
              static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(s), d,
              1e3 * ms / reps, reps, ctas, warps);
  const char* names[] = {"start", "first issued", "tile0 landed", "tile0 done", "tile1 landed", "tile1 done",
                         "last V landed", "loop done", "group done", "merge barrier", "merged", "end"};
  const int group_warps = warps / groups;
  std::printf("%-14s", "phase");
  for (int g = 0; g < groups; ++g) std::printf("   group %d med/max", g);
  std::printf("   (SM cycles since the warp's start)\n");
  for (int ph = 1; ph < sm80::kPhaseStartNs; ++ph) {
    std::printf("%-14s", names[ph]);
    for (int g = 0; g < groups; ++g) {
      std::vector<double> v;
      for (int cta = 0; cta < ctas; ++cta) {
        for (int w = g * group_warps; w < (g + 1) * group_warps; ++w) {
          const uint64_t* r = &rec[(static_cast<int64_t>(cta) * warps + w) * sm80::kForwardPhases];
          if (r[ph] != 0 && r[sm80::kPhaseStart] != 0 && r[ph] >= r[sm80::kPhaseStart]) {
            v.push_back(static_cast<double>(r[ph] - r[sm80::kPhaseStart]));
          }
        }
      }
      if (v.empty()) {
        std::printf("   %17s", "-");
      } else {
        std::sort(v.begin(), v.end());
        std::printf("   %8.0f/%8.0f", v[v.size() / 2], v.back());
      }
    }
    std::printf("\n");
  }
  uint64_t first_start = ~0ull, last_start = 0, last_end = 0;
  for (int cta = 0; cta < ctas; ++cta) {
    const uint64_t* r = &rec[static_cast<int64_t>(cta) * warps * sm80::kForwardPhases];
    if (r[sm80::kPhaseStartNs] == 0) continue;
    first_start = std::min(first_start, r[sm80::kPhaseStartNs]);
    last_start = std::max(last_start, r[sm80::kPhaseStartNs]);
    last_end = std::max(last_end, r[sm80::kPhaseEndNs]);
  }
  std::printf("global timer: CTA starts spread over %.0f ns; first start to last end %.0f ns\n",
              double(last_start - first_start), double(last_end - first_start));
  return 0;
}
