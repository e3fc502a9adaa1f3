// cpu_flash forward: the entry point. The kernel (tiled online softmax, fp32 accumulation) is
// flash_forward_kernel.hpp, a template over its tile configuration; this file instantiates the one
// the library ships. On CPUs with AMX the forward runs on the tile unit instead (amx_forward.cpp).
#include "api/backends.hpp"
#include "cpu/amx.hpp"
#include "cpu/flash_forward_kernel.hpp"

namespace flashcore {
namespace cpu {

Status flash_forward(const AttentionParams& p) {
  using namespace forward_detail;
  // The AMX kernels have no dropout: such calls run on the AVX-512 path.
  if (amx_forward_enabled(p.dtype) && !p.dropout.enabled()) return amx_flash_forward(p);
  return flash_forward_with<ForwardConfig>(p);
}

}  // namespace cpu
}  // namespace flashcore
