// cpu_flash on Intel AMX tiles: whether this process can use them, and the forward
// (amx_forward.cpp: fp32-exact scores and outputs from bf16 tile products of split operands) and
// backward (amx_backward.cpp: fp16 / bf16) entry points. cpu::flash_forward / flash_backward take
// them on CPUs that have AMX-BF16.
#pragma once

#include "api/params.hpp"
#include "api/status.hpp"

namespace flashcore {
namespace cpu {

/** Whether this process can run the AMX forward: the library was built with AMX support (an
 *  -march=native build on an AVX-512 + AVX512-BF16 machine), this CPU has AMX-TILE and AMX-BF16,
 *  and Linux granted the process the tile state (arch_prctl, asked once). */
bool amx_usable();

/** Whether this build runs the AMX forward on a software model of the tile unit instead of the
 *  hardware (FLASHCORE_AMX_EMULATION: a test build; amx_usable() is then true on any CPU). */
bool amx_is_software_model();

/** Whether cpu_flash's forward takes the AMX path for inputs of `dtype`: only where
 *  amx_usable(), and then as the environment variable FLASHCORE_CPU_AMX says (read at every call,
 *  so that a benchmark or a test can compare both paths): "0" never, "1" always, unset where it
 *  measured faster than the AVX-512 path on the GPU machine's Xeon (docs/PERF.md, session 22):
 *  bf16 (1.8-3.5x) and fp16 (1.03-1.75x). fp32 needs six tile
 *  products per GEMM and ran at 0.69-0.81x of the AVX-512 path. Every head_dim measured so far
 *  follows the dtype. */
bool amx_forward_enabled(DType dtype);

/** The forward on AMX; call only when amx_usable(). Same contract as cpu::flash_forward. */
Status amx_flash_forward(const AttentionParams& p);

/** Whether cpu_flash's backward takes the AMX path for inputs of `dtype`: fp16 and bf16 where
 *  amx_usable(), unless FLASHCORE_CPU_AMX is "0" (read at every call). fp32 has no AMX backward:
 *  its GEMMs would take six tile products each, which made the fp32 forward slower than AVX-512. */
bool amx_backward_enabled(DType dtype);

/** The backward on AMX (fp16 / bf16); call only when amx_backward_enabled(). Same contract as
 *  cpu::flash_backward. */
Status amx_flash_backward(const BackwardParams& p);

}  // namespace cpu
}  // namespace flashcore
