// Stand-ins for the Hopper backend when it is not compiled (no CUDA, or 90 not among
// FLASHCORE_CUDA_ARCHS): it serves nothing, and says why.
#include "api/backends.hpp"

namespace flashcore::cuda {

bool sm90_supports(const AttentionParams&, Status* why) {
  if (why != nullptr) {
    *why = Status::unsupported("backend: cuda_sm90 is not compiled into this build (needs nvcc and 90 in "
                               "FLASHCORE_CUDA_ARCHS)");
  }
  return false;
}
size_t sm90_forward_workspace(const AttentionParams&) { return 0; }
Status sm90_forward(const AttentionParams&, void*, size_t) {
  return Status::unsupported("backend: cuda_sm90 is not compiled into this build");
}

}  // namespace flashcore::cuda
