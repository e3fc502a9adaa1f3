// cpu_flash forward: the entry point. The kernel (tiled online softmax, fp32 accumulation) is
// flash_forward_kernel.hpp, a template over its tile configuration; this file picks the one the
// library ships for the call's head_dim.
#include "api/backends.hpp"
#include "cpu/flash_forward_kernel.hpp"

namespace flashcore {
namespace cpu {

Status flash_forward(const AttentionParams& p) {
  using namespace forward_detail;
  constexpr int64_t kLargeHeadDim = 128;
  return p.head_dim >= kLargeHeadDim ? flash_forward_with<LargeHeadForwardConfig>(p)
                                     : flash_forward_with<ForwardConfig>(p);
}

}  // namespace cpu
}  // namespace flashcore
