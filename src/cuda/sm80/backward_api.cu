// Host entry points of the sm80 backward: workspace size and dispatch on (dtype, head-dim bucket)
// to the backward_run instantiations that cmake/cuda.cmake generates, one translation unit each.
// A head_dim below a bucket runs in the smallest compiled bucket that holds it (the kernels
// zero-fill the padded columns on load and skip them on store).
//
// Relies on: the FLASHCORE_HDIM_<n> / FLASHCORE_DTYPE_<T> definitions from cmake/cuda.cmake,
// backward_workspace.hpp for the layout shared with the launcher. Kernels are not included
// here: the instantiations live in the generated units and are only declared below.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "api/backends.hpp"
#include "cuda/build_config.hpp"
#include "cuda/sm80/backward_workspace.hpp"

namespace flashcore::cuda {

namespace sm80 {
using backward_params_t = BackwardParams;
template <typename Element, int kHeadDim>
Status backward_run(const backward_params_t& p, void* workspace, size_t workspace_bytes);
}  // namespace sm80

namespace {

template <typename Element>
Status run_for_bucket(int bucket, const BackwardParams& p, void* workspace, size_t workspace_bytes) {
  switch (bucket) {
#ifdef FLASHCORE_HDIM_64
    case 64: return sm80::backward_run<Element, 64>(p, workspace, workspace_bytes);
#endif
#ifdef FLASHCORE_HDIM_128
    case 128: return sm80::backward_run<Element, 128>(p, workspace, workspace_bytes);
#endif
#ifdef FLASHCORE_HDIM_256
    case 256: return sm80::backward_run<Element, 256>(p, workspace, workspace_bytes);
#endif
    default: break;
  }
  (void)workspace;
  (void)workspace_bytes;
  return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) +
                             " has no compiled sm80 backward head-dim bucket (FLASHCORE_HEAD_DIMS)");
}

}  // namespace

size_t sm80_backward_workspace(const BackwardParams& p) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  if (bucket == 0) return 0;  // sm80_backward reports the unsupported head_dim
  return sm80::BackwardWorkspaceLayout::make(p, bucket).total_bytes;
}

Status sm80_backward(const BackwardParams& p, void* workspace, size_t workspace_bytes) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  if (bucket == 0) {
    return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) +
                               " has no compiled sm80 backward head-dim bucket (FLASHCORE_HEAD_DIMS)");
  }
  const size_t needed = sm80::BackwardWorkspaceLayout::make(p, bucket).total_bytes;
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
    return Status::invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " +
                           std::to_string(needed) + " needed (query it with the *_workspace function)");
  }
  switch (p.dtype) {
#ifdef FLASHCORE_DTYPE_FP16
    case DType::F16: return run_for_bucket<__half>(bucket, p, workspace, workspace_bytes);
#endif
#ifdef FLASHCORE_DTYPE_BF16
    case DType::BF16: return run_for_bucket<__nv_bfloat16>(bucket, p, workspace, workspace_bytes);
#endif
    default: break;
  }
  return Status::unsupported("q: dtype is not compiled for the sm80 backward (FLASHCORE_DTYPES)");
}

}  // namespace flashcore::cuda
