// Where the time goes in the Hopper forward or backward: runs the sm90 kernel of one training-grid
// shape built with FLASHCORE_SM90_FWD_TRACE / FLASHCORE_SM90_BWD_TRACE (src/cuda/sm90/
// forward_trace.cuh, backward_trace.cuh), so one thread per warpgroup of the first CTAs records
// (event, SM clock) at every pipeline wait and phase end, times the traced kernel (to set beside
// the library's untraced one in the same call), and writes the records for dev/sm90_trace.py.
//
// build (on the GPU machine, from the repository root; ~1 min):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DFLASHCORE_SM90_FWD_TRACE -DFLASHCORE_SM90_BWD_TRACE -I include -I src dev/sm90_trace.cu \
//     src/cuda/sm90/tensor_map.cpp src/cuda/device.cu -o build/sm90_trace
// run:   build/sm90_trace fwd|bwd HEAD_DIM SEQLEN CAUSAL OUT.bin   (batch 16384/S, heads 2048/d, bf16;
//        bwd times and traces the backward's main kernel with the stages around it)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/sm90/backward.cuh"
#include "cuda/sm90/forward.cuh"
#include "cuda_tool.hpp"

namespace fc = flashcore;
namespace sm90 = flashcore::cuda::sm90;

// The traced shapes fill the GPU with query tiles, so the forward never splits their keys and
// never calls the merge of split partials (src/cuda/decode/decode_api.cu, left out of this build).
namespace flashcore::cuda {
Status merge_split_partials(const MergeParams&, bool) {
  return Status::internal("sm90_trace: the merge of split partials is not built into this tool");
}
}  // namespace flashcore::cuda

int main(int argc, char** argv) {
  if (argc != 6 || (std::strcmp(argv[1], "fwd") != 0 && std::strcmp(argv[1], "bwd") != 0)) {
    std::fprintf(stderr, "usage: %s fwd|bwd HEAD_DIM SEQLEN CAUSAL OUT.bin\n", argv[0]);
    return 2;
  }
  const bool backward = std::strcmp(argv[1], "bwd") == 0;
  const int d = std::atoi(argv[2]);
  const int s = std::atoi(argv[3]);
  const bool causal = std::atoi(argv[4]) != 0;
  const fc::BackwardParams p = training_grid_cell(d, s, causal);
  const int64_t b = p.batch, h = p.heads_q;

  const int records = sm90::kTraceCtas * sm90::kTraceRoles * sm90::kTraceCapacity;
  sm90::TraceRecord* trace;
  CHECK(cudaMalloc(&trace, records * sizeof(sm90::TraceRecord)));
  CHECK(cudaMemcpyToSymbol(sm90::g_kernel_trace, &trace, sizeof(trace)));
  const size_t ws_bytes = flashcore::cuda::sm80::BackwardWorkspaceLayout::make(p, d, /*dq_tiled=*/false).total_bytes;
  void* ws = nullptr;
  if (backward) CHECK(cudaMalloc(&ws, ws_bytes));
  auto run = [&] {
    // forward_run / backward_run: the library's own choice of configuration.
    fc::Status st;
    if (backward) {
      st = d == 64    ? sm90::backward_run<__nv_bfloat16, 64>(p, ws, ws_bytes)
           : d == 128 ? sm90::backward_run<__nv_bfloat16, 128>(p, ws, ws_bytes)
                      : sm90::backward_run<__nv_bfloat16, 256>(p, ws, ws_bytes);
    } else {
      st = d == 64    ? sm90::forward_run<__nv_bfloat16, 64>(p, nullptr, 0)
           : d == 128 ? sm90::forward_run<__nv_bfloat16, 128>(p, nullptr, 0)
                      : sm90::forward_run<__nv_bfloat16, 256>(p, nullptr, 0);
    }
    require_ok(st);
  };
  // Warm up, then time the traced kernel (it writes records only until the buffers fill), then
  // one clean traced run whose records are kept.
  for (int i = 0; i < 3; ++i) run();
  const int reps = 20;
  const float ms = ms_per_call(run, reps) * reps;
  std::vector<int> counts(sm90::kTraceCtas * sm90::kTraceRoles, 0);
  CHECK(cudaMemcpyToSymbol(sm90::g_kernel_trace_count, counts.data(), counts.size() * sizeof(int)));
  run();
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpyFromSymbol(counts.data(), sm90::g_kernel_trace_count, counts.size() * sizeof(int)));
  std::vector<sm90::TraceRecord> rec(records);
  CHECK(cudaMemcpy(rec.data(), trace, records * sizeof(sm90::TraceRecord), cudaMemcpyDeviceToHost));

  const double flop = (backward ? 2.5 : 1.0) * 4.0 * b * h * s * double(s) * d / (causal ? 2 : 1);
  const double us = 1e3 * ms / reps;
  std::printf("%s d%d S%d %s batch %lld heads %lld: traced kernel %.1f us, %.1f TFLOP/s\n", argv[1], d, s,
              causal ? "causal" : "full", static_cast<long long>(b), static_cast<long long>(h), us,
              flop / us * 1e-6);
  FILE* f = std::fopen(argv[5], "wb");
  if (!f) return 1;
  const int header[7] = {d, s, causal, sm90::kTraceCtas, sm90::kTraceRoles, sm90::kTraceCapacity, backward};
  std::fwrite(header, sizeof(int), 7, f);
  std::fwrite(counts.data(), sizeof(int), counts.size(), f);
  std::fwrite(rec.data(), sizeof(sm90::TraceRecord), rec.size(), f);
  std::fclose(f);
  return 0;
}
