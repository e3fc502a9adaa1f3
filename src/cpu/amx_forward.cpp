// cpu_flash on Intel AMX: whether this process can use it and which calls take it, and the
// forward's entry point. The kernel and how it stays exact are in amx_forward_kernel.hpp; the
// backward is amx_backward.cpp.
#include "cpu/amx.hpp"

#include "common/env_switch.hpp"
#include "cpu/amx_forward_kernel.hpp"

#if FLASHCORE_AMX_BUILT
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace flashcore {
namespace cpu {

bool amx_is_software_model() {
#if defined(FLASHCORE_AMX_EMULATE) && FLASHCORE_AMX_BUILT
  return true;
#else
  return false;
#endif
}

namespace {

/** FLASHCORE_CPU_AMX's first character ('0': never, '1': always), 0 when unset. */
char amx_setting() { return env_mode("FLASHCORE_CPU_AMX"); }

}  // namespace

bool amx_forward_enabled(DType dtype) {
  if (!amx_usable()) return false;
  const char setting = amx_setting();
  if (setting == '0' || setting == '1') return setting == '1';
  return dtype != DType::F32;
}

bool amx_backward_enabled(DType dtype) { return dtype != DType::F32 && amx_usable() && amx_setting() != '0'; }

#if !FLASHCORE_AMX_BUILT

bool amx_usable() { return false; }

Status amx_flash_forward(const AttentionParams&) {
  return Status::unsupported("cpu_flash: this build has no AMX forward (needs an -march=native build on an "
                             "AVX512-BF16 machine and a compiler with -mamx-tile / -mamx-bf16)");
}

#else

bool amx_usable() {
  if (amx_is_software_model()) return true;  // the model needs no CPU support
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
    if (!amx_bf16 || !amx_tile) return false;
    __get_cpuid_count(7, 1, &a, &b, &c, &d);
    if (!(a & (1u << 5))) return false;  // AVX512-BF16 (the conversions into parts)
    // Linux keeps the 8 KiB of tile data out of a thread's state until the process asks for it;
    // the first tile instruction without this permission is a SIGILL. Granted process-wide.
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

Status amx_flash_forward(const AttentionParams& p) {
  using amx_detail::amx_flash_forward_with;
  using forward_detail::NoPhaseTimer;
  // Tiles of 256 keys move O's fp32 accumulator through the tile registers a quarter as often as
  // 64-key tiles (+13-27% for bf16 on the GPU machine's Xeon), and 16 blocks per task share each
  // packed K/V tile twice as widely as 8 (+5-33%; docs/PERF.md, session 22). Since K/V are packed
  // once per call (PackedKv), smaller tasks cost little: at least 8 per thread where the blocks
  // allow balanced 16 threads better (+3% to +101% in 5 of 6 bf16 cells, -2% in one; session 23).
  // fp32, bound by its six products per GEMM, did not gain from 256 keys and keeps 64 keys and 8
  // blocks.
  if (p.dtype == DType::F32) return amx_flash_forward_with<64, NoPhaseTimer, 8>(p);
  return amx_flash_forward_with<256, NoPhaseTimer, 16, 8>(p);
}

#endif  // FLASHCORE_AMX_BUILT

}  // namespace cpu
}  // namespace flashcore
