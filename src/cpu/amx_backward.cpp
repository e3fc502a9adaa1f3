// cpu_flash backward on Intel AMX: the entry point. The kernel is amx_backward_kernel.hpp; which
// calls take it, amx_backward_enabled (amx_forward.cpp).
#include "cpu/amx.hpp"
#include "cpu/amx_backward_kernel.hpp"

namespace flashcore {
namespace cpu {

#if FLASHCORE_AMX_BUILT

Status amx_flash_backward(const BackwardParams& p) {
  if (p.dtype == DType::F32) return Status::unsupported("cpu_flash: the AMX backward takes fp16 and bf16 only");
  // 128-key tiles against 128-row query groups: per key tile and group, dK / dV (128 x d) and the
  // group's dQ^T (d x 128) pass through the accumulator tiles once for 4 x 4 blocks of products.
  // The fastest of six sizes in 11 of 12 bf16 cells on the GPU machine's Xeon (+4-24% over 64 x
  // 128; docs/PERF.md, session 23).
  // One task per head: no key chunks (backward_tasks.hpp). Each chunk would pack its query rows
  // again, which costs more next to the AMX GEMMs than next to AVX-512's; split into 1024-key
  // chunks, the B=1 H=16 cells ran -10% to -25% at 2 threads and -16% to +7% at 16 on the Xeon
  // (docs/PERF.md, CPU session 24). FLASHCORE_CPU_CHUNK_KEYS still splits them (the tests do).
  constexpr int64_t kMinChunkKeys = 0;
  return amx_backward_detail::amx_flash_backward_split<128, 128>(
      p, backward_detail::min_chunk_keys_or_env(kMinChunkKeys));
}

#else

Status amx_flash_backward(const BackwardParams&) {
  return Status::unsupported("cpu_flash: this build has no AMX backward (needs an -march=native build on an "
                             "AVX512-BF16 machine and a compiler with -mamx-tile / -mamx-bf16)");
}

#endif  // FLASHCORE_AMX_BUILT

}  // namespace cpu
}  // namespace flashcore
