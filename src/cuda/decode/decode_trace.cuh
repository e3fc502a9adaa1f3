// Phase trace of the decode attention kernel, for dev/decode_trace.cu only: with
// FLASHCORE_DECODE_TRACE defined, lane 0 of every warp of every CTA records the global timer (ns,
// comparable across SMs) when it reaches each phase: the kernel's entry, past the wait for the
// previous grid, its first copies issued, Q ready, its first tile landed, the loop done, the warps'
// states combined, the end. Without the macro DECODE_TRACE expands to nothing and the kernel is
// unchanged.
#pragma once

#include <cstdint>

namespace flashcore::cuda::decode {

enum DecodePhase : int {
  kDecodeEntry = 0,       // first instruction
  kDecodeWaited,          // past griddepcontrol.wait
  kDecodeSeqlenReady,     // the sequence's length (cache_seqlens) loaded
  kDecodeFirstIssued,     // the ring's first kStages - 1 tiles requested
  kDecodeQReady,          // Q in registers (or shared memory): the main loop starts
  kDecodeTile0Landed,     // the warp's first tile landed
  kDecodeLoopDone,        // every copy landed, the last tile's math done
  kDecodeCombined,        // the warps' states combined (second barrier of the epilogue)
  kDecodeEnd,             // outputs written
  kDecodeRangeReady,      // the split's key range and the cache row / start computed
  kDecodeLookup0,         // the first tile's addresses looked up
  kDecodeIssued0,         // the first tile's copies issued
  kDecodePhases
};

#ifdef FLASHCORE_DECODE_TRACE
__device__ uint64_t* g_decode_trace;  // [cta (x fastest)][warp][kDecodePhases], set by the tool

__device__ __forceinline__ void decode_trace(int warps, int phase) {
  if (g_decode_trace == nullptr || threadIdx.x % 32 != 0) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const int64_t cta = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  g_decode_trace[(cta * warps + threadIdx.x / 32) * kDecodePhases + phase] = t;
}
#define DECODE_TRACE(phase) decode_trace(kWarps, (phase))
#else
#define DECODE_TRACE(phase) ((void)0)
#endif

}  // namespace flashcore::cuda::decode
