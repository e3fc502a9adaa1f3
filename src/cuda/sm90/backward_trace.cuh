// Event trace of the Hopper backward kernel, for dev/sm90_bwd_trace.cu only: with
// FLASHCORE_SM90_BWD_TRACE defined, one thread per warpgroup of the first kTraceCtas CTAs records
// (kernel_trace.cuh) the end of each wait and phase of a query step, so a run shows where a
// step's time goes. BWD_TRACE takes the recording thread's counter (an int it keeps across
// tiles). Without the macro BWD_TRACE expands to nothing and the kernel is unchanged.
// Records are global stores, and the MEMBAR that fence.proxy.async compiles to waits for them:
// an interval holding such a fence (the dQ flush) reads longer traced than it runs untraced
// (docs/PERF.md, session 12); time changes to it with the benchmark.
#pragma once

#include <cstdint>

#include "cuda/sm90/kernel_trace.cuh"

namespace flashcore::cuda::sm90 {

/** What happened; the record's `arg` is the query step within the tile. */
enum class BwdTraceEvent : uint32_t {
  kTileBegin = 1,  // consumer: K and V of the tile landed / producer: started the tile
  kStepBegin,      // consumer: Q, dO and the statistics of the step landed
  kSReady,         // consumer: S^T complete
  kDvIssued,       // consumer: P^T computed, dV issued (at d64: dS^T stored too)
  kDsStored,       // consumer: dS^T computed, stored and fenced
  kDsShared,       // consumer: both consumers' dS^T stored (barrier 1 passed)
  kDqReady,        // consumer: the dQ piece complete
  kDqSent,         // consumer: the dQ piece staged and its reduction issued (or its atomics)
  kStepEnd,        // consumer: dK and dV of the step complete, the stage released
  kTileEnd,        // consumer: dK and dV stored
  kStageFree = 20,  // producer: a Q / dO stage free, its loads issued
  kKvFree,          // producer: K / V free, the tile's loads issued
};

#ifdef FLASHCORE_SM90_BWD_TRACE
#define BWD_TRACE(count, role, event, arg) \
  trace_event((count), (role), static_cast<uint32_t>(BwdTraceEvent::event), (arg))
#else
#define BWD_TRACE(count, role, event, arg) ((void)0)
#endif

}  // namespace flashcore::cuda::sm90
