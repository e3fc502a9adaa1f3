// The one place that turns a call's (dtype, head_dim) into the kernel instantiation
// cmake/cuda.cmake compiled for it. Each CUDA entry point names its instantiations with a class
// template Entry<Element, kHeadDim> whose static run(params, workspace, workspace_bytes) calls the
// explicitly instantiated kernel function; a head_dim below a bucket runs in the smallest compiled
// bucket that holds it (the kernels zero-fill the padded columns and never store them).
//
// Relies on: the FLASHCORE_HDIM_<n> / FLASHCORE_DTYPE_<T> definitions from cmake/cuda.cmake and
// compiled_head_dim_bucket (build_config.hpp), which agree by construction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <string>

#include "api/params.hpp"
#include "api/status.hpp"
#include "cuda/build_config.hpp"

namespace flashcore::cuda {

template <template <typename, int> class Entry, typename Element, class Params>
Status run_compiled_bucket(const Params& p, void* workspace, size_t workspace_bytes, const char* what) {
  switch (compiled_head_dim_bucket(p.head_dim)) {
#if defined(FLASHCORE_HDIM_64)
    case 64:
      return Entry<Element, 64>::run(p, workspace, workspace_bytes);
#endif
#if defined(FLASHCORE_HDIM_128)
    case 128:
      return Entry<Element, 128>::run(p, workspace, workspace_bytes);
#endif
#if defined(FLASHCORE_HDIM_256)
    case 256:
      return Entry<Element, 256>::run(p, workspace, workspace_bytes);
#endif
    default:
      break;
  }
  (void)workspace;
  (void)workspace_bytes;
  return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) + " has no compiled " + what +
                             " head-dim bucket (FLASHCORE_HEAD_DIMS)");
}

/** Runs Entry<Element, bucket> for p.dtype and p.head_dim; `what` names the caller in errors. */
template <template <typename, int> class Entry, class Params>
Status run_compiled(const Params& p, void* workspace, size_t workspace_bytes, const char* what) {
  switch (p.dtype) {
#if defined(FLASHCORE_DTYPE_FP16)
    case DType::F16:
      return run_compiled_bucket<Entry, __half>(p, workspace, workspace_bytes, what);
#endif
#if defined(FLASHCORE_DTYPE_BF16)
    case DType::BF16:
      return run_compiled_bucket<Entry, __nv_bfloat16>(p, workspace, workspace_bytes, what);
#endif
    default:
      break;
  }
  return Status::unsupported(std::string("q: dtype is not compiled for the ") + what + " (FLASHCORE_DTYPES)");
}

}  // namespace flashcore::cuda
