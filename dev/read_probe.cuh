// Shared by the dev/ read probes (decode_read_patterns.cu, decode_bulk_read.cu): their cp.async
// wrappers (with memory clobbers, since the probes read the ring with plain loads after the wait),
// the sum-read ceiling kernel they print beside their readers, and their rate measurement.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda_tool.hpp"

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The ceiling: every byte of both pools read once with 16-byte loads, 4 in flight per thread.
__global__ void sum_read(const uint4* a, const uint4* b, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = i + u * stride < n ? a[i + u * stride] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ x[u].w;
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = i + u * stride < n ? b[i + u * stride] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= x[u].y ^ x[u].z;
  }
  if (acc == 0x12345678u) *sink = acc;
}

/** K+V TB/s of `launch`: the median of 7 runs of 20 calls back to back, after 3 warm-up calls. */
template <typename Launch>
double tbps(Launch launch, double bytes) {
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) ms.push_back(ms_per_call(launch, 20));
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
}
