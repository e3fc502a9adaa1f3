// Where a tile's time goes in the Hopper forward: runs the sm90 forward kernel of one training-grid
// shape built with FLASHCORE_SM90_FWD_TRACE (src/cuda/sm90/forward_trace.cuh), so one thread per
// warpgroup of the first CTAs records (event, SM clock) at every pipeline wait and phase end,
// times the traced kernel (to set beside the library's untraced one in the same call), and writes
// the records for dev/sm90_fwd_trace.py to summarize.
//
// build (on the GPU machine, from the repository root; ~1 min):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -DFLASHCORE_SM90_FWD_TRACE -I include -I src dev/sm90_fwd_trace.cu src/cuda/sm90/tensor_map.cpp \
//     src/cuda/device.cu -o build/sm90_fwd_trace
// run:   build/sm90_fwd_trace HEAD_DIM SEQLEN CAUSAL OUT.bin   (batch 16384/S, heads 2048/d, bf16)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm90/forward.cuh"

namespace fc = flashcore;
namespace sm90 = flashcore::cuda::sm90;

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s HEAD_DIM SEQLEN CAUSAL OUT.bin\n", argv[0]);
    return 2;
  }
  const int d = std::atoi(argv[1]);
  const int s = std::atoi(argv[2]);
  const bool causal = std::atoi(argv[3]) != 0;
  if ((d != 64 && d != 128 && d != 256) || s <= 0 || 16384 % s != 0) {
    std::fprintf(stderr, "HEAD_DIM must be 64, 128 or 256 and SEQLEN divide 16384\n");
    return 2;
  }
  const int64_t b = 16384 / s, h = 2048 / d;
  const int64_t elems = b * s * h * d;

  std::vector<__nv_bfloat16> host(elems);
  uint32_t state = 12345;
  for (auto& x : host) {
    state = state * 1664525u + 1013904223u;
    x = __float2bfloat16(static_cast<float>(state >> 8) / 16777216.f * 2.f - 1.f);
  }
  __nv_bfloat16 *q, *k, *v, *o;
  float* lse;
  CHECK(cudaMalloc(&q, elems * 2));
  CHECK(cudaMalloc(&k, elems * 2));
  CHECK(cudaMalloc(&v, elems * 2));
  CHECK(cudaMalloc(&o, elems * 2));
  CHECK(cudaMalloc(&lse, b * h * s * sizeof(float)));
  for (auto* t : {q, k, v}) CHECK(cudaMemcpy(t, host.data(), elems * 2, cudaMemcpyHostToDevice));

  fc::AttentionParams p;
  p.dtype = fc::DType::BF16;
  p.device_type = 1;
  const fc::TensorRef layout{nullptr, s * h * d, h * d, d};  // (batch, seqlen, heads, head_dim)
  p.q = p.k = p.v = p.out = layout;
  p.q.data = q;
  p.k.data = k;
  p.v.data = v;
  p.out.data = o;
  p.lse = {lse, h * s, s, 1};
  p.batch = b;
  p.seqlen_q = p.seqlen_k = s;
  p.heads_q = p.heads_kv = h;
  p.head_dim = d;
  p.total_q = p.total_k = b * s;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
  p.causal = causal;
  p.window_right = causal ? 0 : -1;

  const int records = sm90::kTraceCtas * sm90::kTraceRoles * sm90::kTraceCapacity;
  sm90::TraceRecord* trace;
  CHECK(cudaMalloc(&trace, records * sizeof(sm90::TraceRecord)));
  CHECK(cudaMemcpyToSymbol(sm90::g_fwd_trace, &trace, sizeof(trace)));
  auto run = [&] {
    // forward_run: the library's own choice of tile configuration and score-transform kernel.
    const fc::Status st = d == 64    ? sm90::forward_run<__nv_bfloat16, 64>(p, nullptr, 0)
                          : d == 128 ? sm90::forward_run<__nv_bfloat16, 128>(p, nullptr, 0)
                                     : sm90::forward_run<__nv_bfloat16, 256>(p, nullptr, 0);
    if (!st.is_ok()) {
      std::fprintf(stderr, "launch: %s\n", st.message.c_str());
      std::exit(1);
    }
  };
  // Warm up, then time the traced kernel (it writes records only until the buffers fill), then
  // one clean traced run whose records are kept.
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int reps = 20;
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) run();
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<int> counts(sm90::kTraceCtas * sm90::kTraceRoles, 0);
  CHECK(cudaMemcpyToSymbol(sm90::g_fwd_trace_count, counts.data(), counts.size() * sizeof(int)));
  run();
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpyFromSymbol(counts.data(), sm90::g_fwd_trace_count, counts.size() * sizeof(int)));
  std::vector<sm90::TraceRecord> rec(records);
  CHECK(cudaMemcpy(rec.data(), trace, records * sizeof(sm90::TraceRecord), cudaMemcpyDeviceToHost));

  const double flop = 4.0 * b * h * s * double(s) * d / (causal ? 2 : 1);
  const double us = 1e3 * ms / reps;
  std::printf("d%d S%d %s batch %lld heads %lld: traced kernel %.1f us, %.1f TFLOP/s\n", d, s,
              causal ? "causal" : "full", static_cast<long long>(b), static_cast<long long>(h), us,
              flop / us * 1e-6);
  FILE* f = std::fopen(argv[4], "wb");
  if (!f) return 1;
  const int header[6] = {d, s, causal, sm90::kTraceCtas, sm90::kTraceRoles, sm90::kTraceCapacity};
  std::fwrite(header, sizeof(int), 6, f);
  std::fwrite(counts.data(), sizeof(int), counts.size(), f);
  std::fwrite(rec.data(), sizeof(sm90::TraceRecord), rec.size(), f);
  std::fclose(f);
  return 0;
}
