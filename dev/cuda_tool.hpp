// Shared by the dev/ CUDA tools (sm80_forward_trace.cu, sm80_backward_trace.cu, sm90_trace.cu,
// decode_trace.cu, decode_read_patterns.cu, decode_bulk_read.cu): CHECK(call) for CUDA runtime
// calls, require_ok for the library's Status, the time per call of launches issued back to back,
// the tools' deterministic input values, a dense (batch, seqlen, heads, head_dim) problem's
// parameters, and one training-grid cell with every tensor of a backward call on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "api/params.hpp"
#include "api/status.hpp"

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

/** Stops the tool with the status's message unless it is ok (a library call the tool makes). */
inline void require_ok(const flashcore::Status& st) {
  if (st.is_ok()) return;
  std::fprintf(stderr, "launch: %s\n", st.message.c_str());
  std::exit(1);
}

/** Milliseconds per call of `launch()` issued `calls` times back to back on the default stream
 *  (CUDA events around the whole run). */
template <typename Launch>
float ms_per_call(Launch launch, int calls) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < calls; ++i) launch();
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  return ms / calls;
}

/** n values uniform in [-1, 1) from a fixed-seed LCG, converted by from_float (same every run). */
template <typename T, typename FromFloat>
std::vector<T> uniform_values(int64_t n, FromFloat from_float) {
  std::vector<T> values(n);
  uint32_t state = 12345;
  for (auto& x : values) {
    state = state * 1664525u + 1013904223u;
    x = from_float(static_cast<float>(state >> 8) / 16777216.f * 2.f - 1.f);
  }
  return values;
}

/** q, k, v, out of one dense self-attention problem, each (b, s, h, d) contiguous, MHA, default
 *  softmax scale; masks and the lse are left to the caller. */
inline void set_dense_problem(flashcore::AttentionParams& p, flashcore::DType dtype, void* q, void* k,
                              void* v, void* out, int64_t b, int64_t s, int64_t h, int64_t d) {
  p.dtype = dtype;
  p.device_type = 1;
  const flashcore::TensorRef layout{nullptr, s * h * d, h * d, d};  // (batch, seqlen, heads, head_dim)
  p.q = p.k = p.v = p.out = layout;
  p.q.data = q;
  p.k.data = k;
  p.v.data = v;
  p.out.data = out;
  p.batch = b;
  p.seqlen_q = p.seqlen_k = s;
  p.heads_q = p.heads_kv = h;
  p.head_dim = d;
  p.total_q = p.total_k = b * s;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
}

/** One cell of the training grid (batch 16384 / s, heads 2048 / d, bf16, full or causal) with q, k,
 *  v, out, dout (deterministic values), dq, dk, dv and the lse allocated on the device: the
 *  parameters of a forward or backward call. The lse is a plausible constant, log(s): its values
 *  change no branch, only the numbers. Stops the tool when d is not 64 / 128 / 256 or s does not
 *  divide 16384. */
inline flashcore::BackwardParams training_grid_cell(int d, int s, bool causal) {
  if ((d != 64 && d != 128 && d != 256) || s <= 0 || 16384 % s != 0) {
    std::fprintf(stderr, "HEAD_DIM must be 64, 128 or 256 and SEQLEN divide 16384\n");
    std::exit(2);
  }
  const int64_t b = 16384 / s, h = 2048 / d;
  const int64_t elems = b * s * h * d;
  const std::vector<__nv_bfloat16> host =
      uniform_values<__nv_bfloat16>(elems, [](float x) { return __float2bfloat16(x); });
  __nv_bfloat16 *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  float* lse;
  for (auto** t : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) CHECK(cudaMalloc(t, elems * 2));
  CHECK(cudaMalloc(&lse, b * h * s * sizeof(float)));
  for (auto* t : {q, k, v, o, dout}) CHECK(cudaMemcpy(t, host.data(), elems * 2, cudaMemcpyHostToDevice));
  const std::vector<float> host_lse(b * h * s, std::log(static_cast<float>(s)));
  CHECK(cudaMemcpy(lse, host_lse.data(), host_lse.size() * sizeof(float), cudaMemcpyHostToDevice));

  flashcore::BackwardParams p;
  set_dense_problem(p, flashcore::DType::BF16, q, k, v, o, b, s, h, d);
  p.dout = p.dq = p.dk = p.dv = p.q;
  p.dout.data = dout;
  p.dq.data = dq;
  p.dk.data = dk;
  p.dv.data = dv;
  p.lse = {lse, h * s, s, 1};
  p.causal = causal;
  p.window_right = causal ? 0 : -1;
  return p;
}
