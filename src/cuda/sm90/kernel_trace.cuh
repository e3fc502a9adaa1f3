// Event recorder shared by the Hopper kernels' traces (forward_trace.cuh, backward_trace.cuh), for
// the dev/ trace tools only: with FLASHCORE_SM90_FWD_TRACE or FLASHCORE_SM90_BWD_TRACE defined,
// one thread per warpgroup role of the first kTraceCtas CTAs writes (event, SM clock) pairs to a
// global buffer that the tool allocates. Without either macro nothing here is compiled and the
// kernels are unchanged.
#pragma once

#include <cstdint>

#include "cuda/trace_record.cuh"

#if defined(FLASHCORE_SM90_FWD_TRACE) || defined(FLASHCORE_SM90_BWD_TRACE)
#define FLASHCORE_SM90_TRACE 1
#endif

namespace flashcore::cuda::sm90 {

#ifdef FLASHCORE_SM90_TRACE
constexpr int kTraceCtas = 8;
constexpr int kTraceRoles = 4;        // producer + up to three consumers
constexpr int kTraceCapacity = 8192;  // records per (CTA, role)
using TraceRecord = cuda::TraceRecord;
__device__ TraceRecord* g_kernel_trace;  // [kTraceCtas][kTraceRoles][kTraceCapacity], set by the tool
__device__ int g_kernel_trace_count[kTraceCtas * kTraceRoles];

/** Records `event` for `role` (0: the producer's one thread; else a consumer warpgroup, recorded by
 *  its first thread); `count` is the recording thread's counter (append_trace_record). */
__device__ __forceinline__ void trace_event(int& count, int role, uint32_t event, int arg) {
  if (blockIdx.x >= kTraceCtas || ((threadIdx.x % 128) != 0 && role != 0)) return;
  append_trace_record(g_kernel_trace, g_kernel_trace_count, static_cast<int>(blockIdx.x) * kTraceRoles + role,
                      kTraceCapacity, count, event, static_cast<uint32_t>(arg));
}
#endif

}  // namespace flashcore::cuda::sm90
