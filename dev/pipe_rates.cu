// Per-SM throughput of the instructions the forward's softmax is made of, on this GPU: ex2.approx
// (MUFU.EX2, the exponentials), cvt.rn.bf16x2.f32 (F2FP, P rounded for the P V wgmma; timed with
// one FADD and one LOP3 beside each, so its line is a lower bound) and FFMA. Eight independent
// chains per thread, 4 x 512-thread CTAs per SM. Results per clock assume the maximum SM clock.
// Session 19 (H100): ex2 15.9 / clock / SM, the F2FP line 37.3, FFMA 111.7 - the conversions are
// not on the exponentials' quarter-rate pipe.
// Build and run: nvcc -O3 -arch=sm_90a dev/pipe_rates.cu -o /tmp/pipe_rates && /tmp/pipe_rates
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

template <int kOp>
__global__ void chains(float* out, int iters) {
  float a[8];
  uint32_t p[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = threadIdx.x * 1e-3f + i;
    p[i] = 0;
  }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (kOp == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(a[i]));
      if constexpr (kOp == 1) {
        uint32_t r;
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a[i]), "f"(a[(i + 1) & 7]));
        p[i] ^= r;
        a[i] += 1.0f;
      }
      if constexpr (kOp == 2) asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(a[i]));
    }
  }
  float s = 0;
  for (int i = 0; i < 8; ++i) s += a[i] + p[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the chains live
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const int blocks = sms * 4, threads = 512, iters = 4096;
  float* out = nullptr;
  if (cudaMalloc(&out, sizeof(float) * blocks * threads) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 1;
  }
  const char* names[] = {"ex2.approx", "cvt.rn.bf16x2.f32 (+FADD)", "FFMA"};
  void (*kernels[])(float*, int) = {chains<0>, chains<1>, chains<2>};
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int op = 0; op < 3; ++op) {
    kernels[op]<<<blocks, threads>>>(out, 16);  // warm-up
    cudaEventRecord(start);
    kernels[op]<<<blocks, threads>>>(out, iters);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    const double per_sm_per_s = double(blocks) * threads * iters * 8 / sms / (ms * 1e-3);
    std::printf("%-28s %.1f Gop/s per SM = %.1f per clock at the %.0f MHz maximum clock\n", names[op],
                per_sm_per_s / 1e9, per_sm_per_s / (clock_khz * 1e3), clock_khz / 1e3);
  }
  cudaFree(out);
  return 0;
}
