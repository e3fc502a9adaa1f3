// The record that the kernels' dev-only event traces write (src/cuda/sm90/kernel_trace.cuh for the
// Hopper kernels, src/cuda/sm80/backward_trace.cuh for the sm80 dK / dV kernel) and how one is
// appended. Nothing here runs unless a trace macro compiles a kernel's trace points in.
#pragma once

#include <cstdint>

namespace flashcore::cuda {

struct TraceRecord {
  uint32_t event_and_arg;  // event | arg << 8
  uint32_t clock;          // low 32 bits of clock64 (per SM; differences only)
};

/** Appends (event, arg, SM clock) to record slot `slot` of `buffer` ([slots][capacity]) and
 *  publishes the slot's count in `counts`. `count` is the writing thread's own counter, kept in a
 *  register: a counter in global memory would put a load round trip into every traced interval.
 *  Records past `capacity` are counted, not written. */
__device__ __forceinline__ void append_trace_record(TraceRecord* buffer, int* counts, int slot, int capacity,
                                                    int& count, uint32_t event, uint32_t arg) {
  const int n = count++;
  counts[slot] = count;
  if (n < capacity) {
    buffer[int64_t(slot) * capacity + n] = {event | (arg << 8), static_cast<uint32_t>(clock64())};
  }
}

}  // namespace flashcore::cuda
