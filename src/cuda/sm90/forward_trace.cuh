// Event trace of the Hopper forward kernel, for dev/sm90_trace.cu only: with
// FLASHCORE_SM90_FWD_TRACE defined, one thread per warpgroup of the first kTraceCtas CTAs records
// (kernel_trace.cuh) the pipeline's waits and phase ends, so a run shows where a tile's time goes
// (waiting for K/V, for the issue turn, for S, softmax, the epilogue).
// FWD_TRACE uses the PipelineCounters `pc` in scope for the thread's record count.
// Without the macro FWD_TRACE expands to nothing and the kernels are unchanged.
#pragma once

#include <cstdint>

#include "cuda/sm90/kernel_trace.cuh"

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
  kEpilogueEnter,   // consumer: epilogue entered (row sums reduced)
  kEpilogueStaged,  // consumer: O written to the staging buffer and fenced
  kQSlotFree = 20,  // producer: Q slot free, load issued
  kKSlotFree,       // producer: K stage free, load of iteration arg issued
  kVSlotFree,       // producer: V stage free
};

#ifdef FLASHCORE_SM90_FWD_TRACE
#define FWD_TRACE(role, event, arg) \
  trace_event(pc.trace_events, (role), static_cast<uint32_t>(TraceEvent::event), (arg))
#else
#define FWD_TRACE(role, event, arg) ((void)0)
#endif

}  // namespace flashcore::cuda::sm90
