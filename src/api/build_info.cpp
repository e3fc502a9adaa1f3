// Version and build configuration strings (what `flashcore info` prints).
#include <string>

#include "cpu/amx.hpp"
#include "flashcore/flashcore.h"

extern "C" {

FC_API const char* fc_version(void) { return FLASHCORE_VERSION; }

FC_API const char* fc_build_info(void) {
  static const std::string info = std::string("flashcore ") + FLASHCORE_VERSION +
                                  "\n  backends compiled: cpu_reference, cpu_flash" +
                                  (FLASHCORE_WITH_CUDA ? ", cuda_sm80" : "") +
#if defined(FLASHCORE_HAS_SM90)
                                  ", cuda_sm90" +
#endif
                                  "\n  cuda: " + (FLASHCORE_WITH_CUDA ? "yes" : "no") +
                                  "\n  cuda archs: " + (FLASHCORE_WITH_CUDA ? FLASHCORE_CUDA_ARCHS_STR : "-") +
                                  "\n  cuda head dims: " + (FLASHCORE_WITH_CUDA ? FLASHCORE_HEAD_DIMS_STR : "-") +
                                  "\n  cuda dtypes: " + (FLASHCORE_WITH_CUDA ? FLASHCORE_DTYPES_STR : "-") +
#if defined(__AVX512F__)
                                  "\n  cpu simd: avx512"
#elif defined(__AVX2__)
                                  "\n  cpu simd: avx2"
#else
                                  "\n  cpu simd: portable"
#endif
                                  + (flashcore::cpu::amx_is_software_model()
                                         ? "\n  cpu amx: software model of the tile unit (a test build)"
                                         : flashcore::cpu::amx_usable()
                                               ? "\n  cpu amx: yes (cpu_flash forward and backward on AMX tiles for bf16 and fp16)"
                                               : "\n  cpu amx: no (this CPU or build has none; FLASHCORE_CPU_AMX is ignored)");
  return info.c_str();
}

}  // extern "C"
