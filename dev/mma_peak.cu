// Measures the sustained rate of mma.sync.m16n8k16 (bf16 in, fp32 accumulate) on the current GPU:
// every warp runs a long loop of independent mmas into 8 accumulators, many warps per SM. This is
// the ceiling the sm80 kernels are measured against on Hopper (where wgmma is faster still).
// build: nvcc -O3 -std=c++17 -I src -gencode arch=compute_90,code=sm_90 dev/mma_peak.cu -o /tmp/mma_peak
#include <cstdio>

#include "cuda/ptx/mma.cuh"

constexpr int kAccumulators = 8;
constexpr int kIterations = 4096;
constexpr int kFlopsPerMma = 2 * 16 * 8 * 16;

__global__ void mma_loop(float* sink, uint32_t seed) {
  uint32_t a[4] = {seed, seed ^ 1u, seed ^ 2u, seed ^ 3u};
  uint32_t b[2] = {seed ^ 4u, seed ^ 5u};
  float acc[kAccumulators][4] = {};
  for (int it = 0; it < kIterations; ++it) {
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) flashcore::ptx::mma_m16n8k16_bf16(acc[i], a, b);
  }
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) total += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  if (total == 12345.f) sink[threadIdx.x] = total;  // keeps the loop alive
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, 1024 * sizeof(float));
  for (int warps : {4, 8, 16}) {
    const int blocks = sms * 4;
    mma_loop<<<blocks, warps * 32>>>(sink, 0x3c003c00u);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    mma_loop<<<blocks, warps * 32>>>(sink, 0x3c003c00u);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    const double flops = double(blocks) * warps * kIterations * kAccumulators * kFlopsPerMma;
    std::printf("mma.sync bf16 m16n8k16: %2d warps/CTA x %d CTAs: %.1f TFLOP/s\n", warps, blocks,
                flops / ms / 1e9);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
