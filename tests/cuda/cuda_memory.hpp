// Device memory for the backend-agnostic harness: tensors live in cudaMalloc memory and every
// flashcore call runs on a private non-blocking stream (as a framework's stream would be).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/harness.hpp"

namespace flashcore::testing {

#define CUDA_OK(x)                                                                         \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(e_)); \
  } while (0)

class CudaMemory final : public Memory {
 public:
  CudaMemory() { CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CudaMemory() override { cudaStreamDestroy(stream_); }
  int32_t device_type() const override { return FC_DEVICE_CUDA; }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    if (bytes) CUDA_OK(cudaMalloc(&p, bytes));
    return p;
  }
  void release(void* p) override { CUDA_OK(cudaFree(p)); }
  void upload(void* dst, const void* src, size_t n) override {
    CUDA_OK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, size_t n) override {
    CUDA_OK(cudaStreamSynchronize(stream_));  // the kernels ran on this stream
    CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
  }
  void* stream() const override { return stream_; }

 private:
  cudaStream_t stream_{};
};

}  // namespace flashcore::testing
