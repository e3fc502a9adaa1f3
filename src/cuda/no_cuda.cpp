// Stand-ins for the CUDA backend when the library is built without CUDA: no devices, and every
// CUDA entry reports that it is not compiled in.
#include "api/backends.hpp"

namespace flashcore::cuda {

int device_count() { return 0; }
int compute_capability(int) { return 0; }
std::string device_description(int) { return ""; }
Status check_cu_seqlens_on_device(const AttentionParams&) { return Status::ok(); }
Status copy_to_host(void*, const void*, size_t, int, void*) {
  return Status::unsupported("CUDA is not compiled into this build: device memory cannot be read");
}

static Status not_built() {
  return Status::unsupported("backend: cuda_sm80 is not compiled into this build (configure with nvcc present)");
}
bool sm80_supports(const AttentionParams&, Status* why) {
  *why = not_built();
  return false;
}
size_t sm80_forward_workspace(const AttentionParams&) { return 0; }
Status sm80_forward(const AttentionParams&, void*, size_t) { return not_built(); }
size_t sm80_backward_workspace(const BackwardParams&) { return 0; }
Status sm80_backward(const BackwardParams&, void*, size_t) { return not_built(); }

}  // namespace flashcore::cuda
