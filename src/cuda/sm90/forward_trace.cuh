// Event trace of the Hopper forward kernel, for dev/sm90_fwd_trace.cu only: with
// FLASHCORE_SM90_FWD_TRACE defined, one thread per warpgroup of the first kTraceCtas CTAs writes
// (event, SM clock) pairs to a global buffer at the pipeline's waits and phase ends, so a run shows
// where a tile's time goes (waiting for K/V, for the issue turn, for S, softmax, the epilogue).
// FWD_TRACE uses the PipelineCounters `pc` in scope for the thread's record count.
// Without the macro FWD_TRACE expands to nothing and the kernels are unchanged.
#pragma once

#include <cstdint>

namespace flashcore::cuda::sm90 {

/** What happened; the record's `arg` is the key-block iteration where one applies. */
enum class TraceEvent : uint32_t {
  kTileBegin = 1,   // consumer entered a tile / producer started its loads
  kQReady,          // consumer: Q's barrier passed
  kKReady,          // consumer: K of iteration arg landed
  kVReady,          // consumer: V of iteration arg landed
  kTurnTaken,       // consumer: its issue turn (ping-pong) came
  kSReady,          // consumer: S of iteration arg complete
  kSoftmaxDone,     // consumer: P of iteration arg ready (before the P V wait)
  kPvDone,          // consumer: O += P V of iteration arg complete
  kEpilogueDone,    // consumer: O and lse stored (issued)
  kQSlotFree = 20,  // producer: Q slot free, load issued
  kKSlotFree,       // producer: K stage free, load of iteration arg issued
  kVSlotFree,       // producer: V stage free
};

#ifdef FLASHCORE_SM90_FWD_TRACE
constexpr int kTraceCtas = 8;
constexpr int kTraceRoles = 4;        // producer + up to three consumers
constexpr int kTraceCapacity = 8192;  // records per (CTA, role)
struct TraceRecord {
  uint32_t event_and_arg;  // event | arg << 8
  uint32_t clock;          // low 32 bits of clock64 (per SM; differences only)
};
__device__ TraceRecord* g_fwd_trace;  // [kTraceCtas][kTraceRoles][kTraceCapacity], set by the host
__device__ int g_fwd_trace_count[kTraceCtas * kTraceRoles];

/** `count` is the writing thread's own record counter (in a register: a counter in global memory
 *  put a load round trip into every traced interval); it is published at each record. */
__device__ __forceinline__ void trace_event(int& count, int role, TraceEvent e, int arg) {
  if (blockIdx.x >= kTraceCtas || ((threadIdx.x % 128) != 0 && role != 0)) return;
  const int slot = blockIdx.x * kTraceRoles + role;
  const int n = count++;
  g_fwd_trace_count[slot] = count;
  if (n < kTraceCapacity) {
    g_fwd_trace[int64_t(slot) * kTraceCapacity + n] = {
        static_cast<uint32_t>(e) | (static_cast<uint32_t>(arg) << 8), static_cast<uint32_t>(clock64())};
  }
}
#define FWD_TRACE(role, event, arg) trace_event(pc.trace_events, (role), TraceEvent::event, (arg))
#else
#define FWD_TRACE(role, event, arg) ((void)0)
#endif

}  // namespace flashcore::cuda::sm90
