// Stand-ins for the Hopper backend when it is not compiled (no CUDA, or 90 not among
// FLASHCORE_CUDA_ARCHS): it serves nothing, and says why.
#include "api/backends.hpp"
#include "cuda/sm90/split_kv.hpp"

namespace flashcore::cuda {

bool sm90_supports(const AttentionParams&, Status* why) {
  if (why != nullptr) {
    *why = Status::unsupported("backend: cuda_sm90 is not compiled into this build (needs nvcc and 90 in "
                               "FLASHCORE_CUDA_ARCHS)");
  }
  return false;
}
size_t sm90_forward_workspace(const AttentionParams&) { return 0; }
size_t sm90_forward_required_workspace(const AttentionParams&) { return 0; }
sm90::ForwardSplit sm90_forward_split_plan(const AttentionParams&) { return {}; }
Status sm90_forward(const AttentionParams&, void*, size_t) {
  return Status::unsupported("backend: cuda_sm90 is not compiled into this build");
}
bool sm90_backward_supports(const BackwardParams& p, Status* why) { return sm90_supports(p, why); }
size_t sm90_backward_workspace(const BackwardParams&) { return 0; }
Status sm90_backward(const BackwardParams&, void*, size_t) {
  return Status::unsupported("backend: cuda_sm90 is not compiled into this build");
}

}  // namespace flashcore::cuda
