// Warpgroup-level helpers (sm_90 / sm_90a): the unit of warp specialisation in the Hopper kernels.
//
// A warpgroup is 4 consecutive warps whose first warp index is a multiple of 4 (threads
// 128*g .. 128*g+127 of a 1D block); wgmma and setmaxnreg operate on whole warpgroups.
//
// - setmaxnreg (sm_90a only): moves registers between warpgroups of a CTA through a per-CTA pool.
//   `dec` releases registers down to N per thread; `inc` blocks until the pool can raise the
//   warpgroup to N per thread (new registers hold garbage). All warps of a warpgroup must execute
//   the same setmaxnreg; N is an immediate, a multiple of 8 in [24, 256]. ptxas honours it only
//   when the kernel's register count at entry is known (__launch_bounds__(threads, 1) or
//   -maxrregcount) and otherwise says so (warning C7508, "setmaxnreg ignored"). The sum over
//   warpgroups of 128 * N must fit in what the CTA was launched with (threads * registers at
//   entry).
// - Named barriers (bar.sync / bar.arrive with an id and a thread count, both multiples of a warp):
//   id 0 is the one __syncthreads() uses, so kernels use ids 1..15 for their own handshakes.
//   bar.arrive does not wait: a producer arrives, a consumer syncs on the same id and count.
//   bar.sync / bar.arrive are the .aligned forms: every participating thread must execute the
//   same barrier instruction. Warpgroups that meet at a barrier from different code (role
//   branches, one template instance per role) use the barrier.sync / barrier.arrive forms
//   (barrier_sync_any / barrier_arrive_any); compute-sanitizer's synccheck reports the aligned
//   ones there as divergent.
//
// Relies on: PTX ISA 8.0; sm_90a for setmaxnreg, sm_90 for elect.sync; sm_70+ for named barriers.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

struct WarpgroupTraits {
  static constexpr uint32_t kWarpSize = 32;
  static constexpr uint32_t kWarpsPerWarpgroup = 4;
  static constexpr uint32_t kThreads = kWarpSize * kWarpsPerWarpgroup;
  static constexpr uint32_t kMinRegisters = 24;  // setmaxnreg range, PTX ISA
  static constexpr uint32_t kMaxRegisters = 256;
  static constexpr uint32_t kRegisterGranule = 8;
  static constexpr uint32_t kFirstFreeBarrierId = 1;  // 0 belongs to __syncthreads()
  static constexpr uint32_t kBarrierIds = 16;
};

template <uint32_t kRegisters>
inline constexpr bool kValidSetmaxnregCount =
    kRegisters >= WarpgroupTraits::kMinRegisters&& kRegisters <=
        WarpgroupTraits::kMaxRegisters&& kRegisters % WarpgroupTraits::kRegisterGranule ==
    0;

/** Raises this warpgroup's per-thread register limit to kRegisters (blocks until available). */
template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kValidSetmaxnregCount<kRegisters>, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

/** Lowers this warpgroup's per-thread register limit to kRegisters, returning the rest to the pool.
 */
template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kValidSetmaxnregCount<kRegisters>, "setmaxnreg: multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

/** Waits until `thread_count` threads (a multiple of 32) have arrived at barrier `id`, counting the
 *  calling warp; also orders shared/global memory among the participants like __syncthreads(). */
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t thread_count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

/** Arrives at barrier `id` (expecting `thread_count` in total) without waiting: the signalling side
 *  of a producer/consumer handshake whose other side calls named_barrier_sync(id, thread_count). */
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t thread_count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

/** named_barrier_sync for participants that reach the barrier from different instructions (the
 *  non-.aligned barrier.sync; see the header comment). */
__device__ __forceinline__ void barrier_sync_any(uint32_t id, uint32_t thread_count) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

/** named_barrier_arrive for participants that reach the barrier from different instructions. */
__device__ __forceinline__ void barrier_arrive_any(uint32_t id, uint32_t thread_count) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

/** Index of the calling thread's warpgroup in a 1D block, made warp-uniform with a shuffle so the
 *  compiler can treat role branches as uniform (one branch per warpgroup, as setmaxnreg needs). */
__device__ __forceinline__ uint32_t warpgroup_index() {
  return __shfl_sync(0xffffffffu, threadIdx.x / WarpgroupTraits::kThreads, 0);
}

/** Thread index within the warpgroup, 0..127. */
__device__ __forceinline__ uint32_t thread_in_warpgroup() {
  return threadIdx.x % WarpgroupTraits::kThreads;
}

/** Warp index within the warpgroup, 0..3 (selects the 16-row slice of a wgmma accumulator). */
__device__ __forceinline__ uint32_t warp_in_warpgroup() {
  return __shfl_sync(
      0xffffffffu, (threadIdx.x / WarpgroupTraits::kWarpSize) % WarpgroupTraits::kWarpsPerWarpgroup,
      0);
}

/** True in exactly one active lane of the (fully active) warp: the lane that issues a TMA copy or
 *  an mbarrier arrive on the warp's behalf. */
__device__ __forceinline__ bool elect_one_sync() {
  uint32_t elected = 0;
  asm volatile(
      "{\n"
      ".reg .b32 leader;\n"
      ".reg .pred is_leader;\n"
      "elect.sync leader|is_leader, %1;\n"
      "selp.u32 %0, 1, 0, is_leader;\n"
      "}\n"
      : "=r"(elected)
      : "r"(0xffffffffu));
  return elected != 0;
}

}  // namespace flashcore::ptx
