// Programmatic dependent launch (sm_90+), the device side. A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start (be placed on SMs, run its
// prologue) while the kernel before it on the stream is still running; it must call
// wait_previous_grid() before it touches global memory that kernel writes or reads, and calls
// allow_next_grid() to let the kernel after it start early in turn. Both are no-ops for an
// ordinary launch and below sm_90.
#pragma once

namespace flashcore::ptx {

/** Blocks until the previous grid on the stream completed and its writes are visible. */
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/** Lets the next grid on the stream be scheduled (it still waits for this grid's completion
 *  before reading what this grid writes: wait_previous_grid). */
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace flashcore::ptx
