// Phase trace of the sm80 forward kernel, for dev/sm80_forward_trace.cu only: with
// FLASHCORE_SM80_FWD_TRACE defined, lane 0 of every warp of every CTA records the SM clock when it
// reaches each phase (past the wait, the first loads issued, each of its first two tiles landed
// and done, the last V landed, the merge, the end) plus the global timer at its start and end, so
// a run shows where a short call's time goes. Without the macro FWD80_TRACE expands to nothing and
// the kernel is unchanged.
#pragma once

#include <cstdint>

namespace flashcore::cuda::sm80 {

/** What a warp reached; the record is the SM clock, or the global timer (ns) for the two k*Ns. */
enum ForwardPhase : int {
  kPhaseStart = 0,      // past griddepcontrol.wait
  kPhaseFirstIssued,    // the first loads (Q, the first tile) issued; small-grid path only
  kPhaseTile0Landed,    // tile 0's K (and Q) landed, pipeline barrier passed
  kPhaseTile0Done,      // S_0, softmax_0 (and the P V it overlaps) issued and done
  kPhaseTile1Landed,
  kPhaseTile1Done,
  kPhaseLastVLanded,    // the last tile's V landed (the overlapped order's tail)
  kPhaseLoopDone,       // the last P V done
  kPhaseGroupDone,      // the key group's barrier before the merge passed
  kPhaseMergeBarrier,   // the CTA-wide barrier of the merge passed
  kPhaseMerged,         // group 0 merged the partials
  kPhaseEnd,            // output stores issued
  kPhaseStartNs,        // global timer at the start
  kPhaseEndNs,          // global timer at the end
  kForwardPhases
};

#ifdef FLASHCORE_SM80_FWD_TRACE
__device__ uint64_t* g_forward_trace;  // [grid][warps][kForwardPhases], set by the tool

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void forward_trace(int warps, int phase) {
  if (g_forward_trace == nullptr || threadIdx.x % 32 != 0) return;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const uint64_t value = (phase == kPhaseStartNs || phase == kPhaseEndNs)
                             ? global_timer_ns()
                             : static_cast<uint64_t>(clock64());
  g_forward_trace[(static_cast<int64_t>(blockIdx.x) * warps + warp) * kForwardPhases + phase] = value;
}
#define FWD80_TRACE(phase) forward_trace(Traits::kWarps, (phase))
#else
#define FWD80_TRACE(phase) ((void)0)
#endif

}  // namespace flashcore::cuda::sm80
