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
#include "cuda/compiled_dispatch.cuh"
#include "cuda/sm80/backward_workspace.hpp"

namespace flashcore::cuda {

namespace sm80 {
using backward_params_t = BackwardParams;
template <typename Element, int kHeadDim>
Status backward_run(const backward_params_t& p, void* workspace, size_t workspace_bytes);
}  // namespace sm80

namespace {

template <typename Element, int kHeadDim>
struct BackwardEntry {
  static Status run(const BackwardParams& p, void* workspace, size_t workspace_bytes) {
    return sm80::backward_run<Element, kHeadDim>(p, workspace, workspace_bytes);
  }
};

}  // namespace

size_t sm80_backward_workspace(const BackwardParams& p) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  if (bucket == 0) return 0;  // sm80_backward reports the unsupported head_dim
  return sm80::BackwardWorkspaceLayout::make(p, bucket, /*dq_tiled=*/true).total_bytes;
}

Status sm80_backward(const BackwardParams& p, void* workspace, size_t workspace_bytes) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  if (bucket == 0) {
    return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) +
                               " has no compiled sm80 backward head-dim bucket (FLASHCORE_HEAD_DIMS)");
  }
  const size_t needed = sm80::BackwardWorkspaceLayout::make(p, bucket, /*dq_tiled=*/true).total_bytes;
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
    return Status::invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " +
                           std::to_string(needed) + " needed (query it with the *_workspace function)");
  }
  return run_compiled<BackwardEntry>(p, workspace, workspace_bytes, "sm80 backward");
}

}  // namespace flashcore::cuda
