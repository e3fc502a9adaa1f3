// CUDA device queries used by dispatch and the kernels' launch heuristics: how many GPUs are
// visible, what they are, how many SMs they have, and which head-dim buckets this build compiled;
// and the one host copy the library makes, for checks the caller asks for (copy_to_host).
// The queries tolerate a missing driver or GPU and clear the error they provoke, so a CPU-only
// machine running a CUDA build sees no sticky CUDA error afterwards.
//
// Relies on: the CUDA runtime, scoped_device.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <string>

#include "api/backends.hpp"
#include "cuda/build_config.hpp"
#include "cuda/programmatic_launch.hpp"
#include "cuda/scoped_device.hpp"

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

std::string device_description(int device_id) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_id) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  char line[512];
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const int n = std::snprintf(line, sizeof(line), "%s, sm_%d%d, %d SMs, %.1f GiB", prop.name, prop.major, prop.minor,
                              prop.multiProcessorCount, double(prop.totalGlobalMem) / kGiB);
  std::string text(line, n > 0 ? std::min<size_t>(size_t(n), sizeof(line) - 1) : 0);
  const double peak = dram_peak_bytes_per_second(device_id);
  if (peak > 0) {
    std::snprintf(line, sizeof(line), ", DRAM peak %.2f TB/s", peak / 1e12);
    text += line;
  }
  return text;
}

Status copy_to_host(void* host, const void* device_ptr, size_t bytes, int device_id, void* stream) {
  const ScopedDevice on_device(device_id);
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(host, device_ptr, bytes, cudaMemcpyDeviceToHost, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) {
    cudaGetLastError();  // like the queries above: a missing device leaves no sticky error behind
    return Status::cuda(std::string("copying to the host failed: ") + cudaGetErrorString(err));
  }
  return Status::ok();
}

int compiled_head_dim_bucket(int64_t head_dim) {
#if defined(FLASHCORE_HDIM_64)
  if (head_dim <= 64) return 64;
#endif
#if defined(FLASHCORE_HDIM_128)
  if (head_dim <= 128) return 128;
#endif
#if defined(FLASHCORE_HDIM_256)
  if (head_dim <= 256) return 256;
#endif
  (void)head_dim;
  return 0;
}

bool supports_programmatic_launch(int device_id) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9;
}

int multiprocessor_count(int device_id, int fallback) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_id) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    return fallback;
  }
  return sms;
}

namespace {

/** A device attribute kept per device once asked: `ask` returns the answer, or 0 when the query
 *  failed, which is not kept (the next call asks again). Devices past the table are asked every
 *  time. */
template <class Value, class Ask>
Value kept_per_device(std::array<std::atomic<Value>, 64>& known, int device_id, Ask ask) {
  const bool keeps = device_id >= 0 && device_id < int(known.size());
  if (keeps) {
    const Value v = known[device_id].load(std::memory_order_relaxed);
    if (v != 0) return v;
  }
  const Value v = ask();
  if (keeps && v != 0) known[device_id].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace

int64_t l2_cache_bytes(int device_id, int64_t fallback) {
  // Kept, so that a launch's tile plan never waits on the driver.
  static std::array<std::atomic<int64_t>, 64> known{};
  const int64_t bytes = kept_per_device(known, device_id, [device_id]() -> int64_t {
    int b = 0;
    if (cudaDeviceGetAttribute(&b, cudaDevAttrL2CacheSize, device_id) != cudaSuccess || b <= 0) {
      cudaGetLastError();
      return 0;
    }
    return b;
  });
  return bytes > 0 ? bytes : fallback;
}

double dram_peak_bytes_per_second(int device_id) {
  // The memory-clock query is a driver round trip of a few hundred microseconds (it made every
  // decode call ~10x slower, docs/PERF.md session 33): a device's answer is kept (< 0: the device
  // reports no clock or bus width).
  static std::array<std::atomic<double>, 64> known{};
  const double peak = kept_per_device(known, device_id, [device_id]() -> double {
    int khz = 0, bus_bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device_id) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device_id) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return khz > 0 && bus_bits > 0 ? 2.0 * khz * 1e3 * bus_bits / 8 : -1;
  });
  return std::max(peak, 0.0);
}

}  // namespace flashcore::cuda
