// CUDA device queries used by dispatch: how many GPUs are visible and what they are. Both
// tolerate a missing driver or GPU (they report 0) and clear the error they provoke, so a CPU-only
// machine running a CUDA build sees no sticky CUDA error afterwards.
//
// Relies on: the CUDA runtime only.
#include <cuda_runtime.h>

#include "api/backends.hpp"

namespace flashcore::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // "no driver" / "no device" must not leak into later calls
    return 0;
  }
  return count;
}

int compute_capability(int device_id) {
  int major = 0;
  int minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  constexpr int kMajorWeight = 10;
  return major * kMajorWeight + minor;
}

}  // namespace flashcore::cuda
