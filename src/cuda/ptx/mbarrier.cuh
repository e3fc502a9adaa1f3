// mbarrier primitives (sm_90): the shared-memory barrier object that TMA copies complete on and
// that producer/consumer warpgroups hand stages over with.
//
// An mbarrier is a 64-bit word in shared memory holding a phase bit, a pending-arrival count and a
// pending transaction-byte count (tx-count). A phase completes when both the arrivals expected for
// it (set at init) and the bytes announced with expect_tx have arrived; the phase bit then flips
// and the counts re-arm for the next phase. Waiters name the phase they wait for by its parity
// (0 for the first phase, 1 for the second, ...): in a ring of S stages, the n-th fill of the
// ring (n = 0, 1, ...) lands in stage n % S and completes phase parity (n / S) & 1 there.
//
// Scope: every wrapper here addresses the barrier through the .shared::cta window, i.e. the barrier
// of the executing CTA (a peer CTA's barrier takes a .shared::cluster address: ptx/cluster.cuh).
// Waits have .acquire.cta semantics (PTX default), so data written by a TMA copy that completed
// the phase is visible to the waiting thread.
//
// Relies on: PTX ISA 8.0 (mbarrier.try_wait.parity, expect_tx, fence.mbarrier_init), sm_90.
#pragma once

#include <cstdint>

#include "cuda/ptx/mma.cuh"  // smem_addr

namespace flashcore::ptx {

/** Initialises the barrier at `bar` for `arrival_count` arrivals per phase (phase 0, tx-count 0).
 *  One thread does it, before any other use; follow with fence_mbarrier_init() and a CTA barrier.
 */
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrival_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrival_count)
               : "memory");
}

/** Makes preceding mbarrier_init()s visible to the async proxy (TMA complete_tx) and to the other
 *  threads that will arrive/wait, before they use the barrier. Only the .release.cluster form
 *  exists in PTX; for a single CTA it is simply stronger than needed. Call it in the initialising
 *  thread, then __syncthreads(). */
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/** One arrival on the current phase (release semantics at CTA scope). Returns the barrier state
 *  token (opaque; callers that wait by parity may ignore it). */
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t* bar) {
  uint64_t state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
               : "=l"(state)
               : "r"(smem_addr(bar))
               : "memory");
  return state;
}

/** Announces `tx_bytes` more bytes to arrive on the current phase (a TMA copy will deliver them
 *  with complete_tx) and performs one arrival, atomically. The producer thread does this once per
 *  stage fill, with the sum of the bytes of every copy that completes on this barrier. */
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  uint64_t state;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
               : "=l"(state)
               : "r"(smem_addr(bar)), "r"(tx_bytes)
               : "memory");
  return state;
}

/** Announces `tx_bytes` without arriving (for a second copy on a phase already armed). */
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(tx_bytes)
               : "memory");
}

/** One probe: true when the phase with parity `phase_parity` has completed. try_wait may suspend
 *  the thread for a system-dependent time before answering false, so a loop of it is not a busy
 *  spin. Acquire semantics at CTA scope when it returns true. */
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t phase_parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred complete;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
      "selp.u32 %0, 1, 0, complete;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(phase_parity)
      : "memory");
  return done != 0;
}

/** Blocks until the phase with parity `phase_parity` has completed. The loop lives in C++ (not as
 *  a PTX label loop) so that the asm stays label-free and can be inlined any number of times.
 *  Lanes may leave the loop at different iterations: call __syncwarp() before a .sync.aligned
 *  instruction (wgmma, setmaxnreg, elect.sync) that follows. */
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t phase_parity) {
  while (!mbarrier_try_wait_parity(bar, phase_parity)) {
  }
}

}  // namespace flashcore::ptx
