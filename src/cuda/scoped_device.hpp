// Makes a device current for a launch and restores the caller's device afterwards (the library
// never leaves the caller's current device changed).
#pragma once

#include <cuda_runtime.h>

namespace flashcore::cuda {

class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      switched_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace flashcore::cuda
