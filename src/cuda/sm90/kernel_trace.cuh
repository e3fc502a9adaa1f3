// Event recorder shared by the Hopper kernels' traces (forward_trace.cuh, backward_trace.cuh), for
// the dev/ trace tools only: with FLASHCORE_SM90_FWD_TRACE or FLASHCORE_SM90_BWD_TRACE defined,
// one thread per warpgroup role of the first kTraceCtas CTAs writes (event, SM clock) pairs to a
// global buffer that the tool allocates. Without either macro nothing here is compiled and the
// kernels are unchanged.
#pragma once

#include <cstdint>

#if defined(FLASHCORE_SM90_FWD_TRACE) || defined(FLASHCORE_SM90_BWD_TRACE)
#define FLASHCORE_SM90_TRACE 1
#endif

namespace flashcore::cuda::sm90 {

#ifdef FLASHCORE_SM90_TRACE
constexpr int kTraceCtas = 8;
constexpr int kTraceRoles = 4;        // producer + up to three consumers
constexpr int kTraceCapacity = 8192;  // records per (CTA, role)
struct TraceRecord {
  uint32_t event_and_arg;  // event | arg << 8
  uint32_t clock;          // low 32 bits of clock64 (per SM; differences only)
};
__device__ TraceRecord* g_kernel_trace;  // [kTraceCtas][kTraceRoles][kTraceCapacity], set by the tool
__device__ int g_kernel_trace_count[kTraceCtas * kTraceRoles];

/** Records `event` for `role` (0: the producer's one thread; else a consumer warpgroup, recorded by
 *  its first thread). `count` is the writing thread's own record counter (in a register: a counter
 *  in global memory put a load round trip into every traced interval); it is published at each
 *  record. */
__device__ __forceinline__ void trace_event(int& count, int role, uint32_t event, int arg) {
  if (blockIdx.x >= kTraceCtas || ((threadIdx.x % 128) != 0 && role != 0)) return;
  const int slot = blockIdx.x * kTraceRoles + role;
  const int n = count++;
  g_kernel_trace_count[slot] = count;
  if (n < kTraceCapacity) {
    g_kernel_trace[int64_t(slot) * kTraceCapacity + n] = {event | (static_cast<uint32_t>(arg) << 8),
                                                          static_cast<uint32_t>(clock64())};
  }
}
#endif

}  // namespace flashcore::cuda::sm90
