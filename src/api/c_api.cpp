// The C ABI: converts internal Status to fc_status, keeps the last error message per thread, and
// guarantees no C++ exception crosses the boundary.
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "api/backends.hpp"
#include "api/dispatch.hpp"
#include "api/last_error.hpp"
#include "flashcore/flashcore.h"

namespace {

thread_local std::string g_last_error;

fc_status finish(const flashcore::Status& s) {
  g_last_error = s.is_ok() ? std::string() : s.message;
  return s.code;
}

template <typename F>
fc_status guarded(F&& body) {
  try {
    return finish(body());
  } catch (const std::bad_alloc&) {
    return finish(flashcore::Status::internal("out of host memory"));
  } catch (const std::exception& e) {
    return finish(flashcore::Status::internal(std::string("internal error: ") + e.what()));
  } catch (...) {
    return finish(flashcore::Status::internal("internal error: unknown exception"));
  }
}

}  // namespace

namespace flashcore {
fc_status record_status(const Status& s) { return finish(s); }
}  // namespace flashcore

extern "C" {

FC_API const char* fc_last_error(void) { return g_last_error.c_str(); }

FC_API const char* fc_backend_name(int32_t backend) {
  switch (backend) {
    case FC_BACKEND_AUTO: return "auto";
    case FC_BACKEND_CPU_REFERENCE: return "cpu_reference";
    case FC_BACKEND_CPU_FLASH: return "cpu_flash";
    case FC_BACKEND_CUDA_SM80: return "cuda_sm80";
    case FC_BACKEND_CUDA_SM90: return "cuda_sm90";
    default: return "unknown";
  }
}

FC_API int32_t fc_backend_available(int32_t backend, int32_t device_id) {
  try {
    if (backend < FC_BACKEND_AUTO || backend > FC_BACKEND_CUDA_SM90 || device_id < 0) return 0;
    return flashcore::backend_available(static_cast<fc_backend>(backend), device_id) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

FC_API int32_t fc_cuda_device_count(void) {
  try {
    return flashcore::cuda::device_count();
  } catch (...) {
    return 0;
  }
}

FC_API fc_status fc_cuda_device_describe(int32_t device_id, char* buffer, size_t size) {
  return guarded([&] {
    if (buffer == nullptr || size == 0) return flashcore::Status::invalid("buffer: is null or has size 0");
    const int visible = flashcore::cuda::device_count();
    if (device_id < 0 || device_id >= visible) {
      return flashcore::Status::invalid("device_id: " + std::to_string(device_id) + " is not a visible CUDA device (" +
                                        std::to_string(visible) + " visible)");
    }
    const std::string line = flashcore::cuda::device_description(device_id);
    if (line.empty()) return flashcore::Status::cuda("device_id: CUDA device " + std::to_string(device_id) + " could not be queried");
    const size_t n = std::min(line.size(), size - 1);
    std::memcpy(buffer, line.data(), n);
    buffer[n] = '\0';
    return flashcore::Status::ok();
  });
}

FC_API fc_status fc_attention_forward_workspace(const fc_tensor* q, const fc_tensor* k, const fc_tensor* v,
                                                const fc_attention_options* options, size_t* workspace_bytes) {
  return guarded([&] {
    if (workspace_bytes == nullptr) return flashcore::Status::invalid("workspace_bytes: is null");
    return flashcore::forward_workspace({q, k, v, nullptr, nullptr, options}, workspace_bytes);
  });
}

FC_API fc_status fc_attention_forward(const fc_tensor* q, const fc_tensor* k, const fc_tensor* v, fc_tensor* out,
                                      fc_tensor* lse, const fc_attention_options* options, void* workspace,
                                      size_t workspace_bytes) {
  return guarded([&] {
    return flashcore::run_forward({q, k, v, out, lse, options}, workspace, workspace_bytes);
  });
}

FC_API fc_status fc_attention_backward_workspace(const fc_tensor* q, const fc_tensor* k, const fc_tensor* v,
                                                 const fc_attention_options* options, size_t* workspace_bytes) {
  return guarded([&] {
    if (workspace_bytes == nullptr) return flashcore::Status::invalid("workspace_bytes: is null");
    return flashcore::backward_workspace({nullptr, q, k, v, nullptr, nullptr, nullptr, nullptr, nullptr, options},
                                         workspace_bytes);
  });
}

FC_API fc_status fc_attention_backward(const fc_tensor* dout, const fc_tensor* q, const fc_tensor* k,
                                       const fc_tensor* v, const fc_tensor* out, const fc_tensor* lse, fc_tensor* dq,
                                       fc_tensor* dk, fc_tensor* dv, const fc_attention_options* options,
                                       void* workspace, size_t workspace_bytes) {
  return guarded([&] {
    return flashcore::run_backward({dout, q, k, v, out, lse, dq, dk, dv, options}, workspace, workspace_bytes);
  });
}

}  // extern "C"
