// Warming L2 before a programmatic dependent's wait (cuda/ptx/grid_dependency.cuh).
//
// A kernel launched as a programmatic dependent is often placed on the SMs long before the kernel
// ahead of it completes, and then sits at griddepcontrol.wait. Reads issued there may see values
// that grid has not written yet, so nothing it uses for results may be read before the wait. An L2
// prefetch is different: L2 is the GPU's point of coherence, so a line brought in early is updated
// by any later write and never serves a stale value. A kernel may therefore guess where its first
// reads will go (from indices read early, possibly stale) and prefetch them into L2 while the
// previous grid drains; after the wait it reads everything again, the normal way.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

/** A 32-bit global load cached in L2 only (ld.global.cg), for values read before
 *  wait_previous_grid() that only steer prefetches: bypassing L1 leaves no line there that a read
 *  after the wait could hit while the previous grid's write of it went to L2. Volatile, so it is
 *  never merged with the real read of the same address after the wait. */
__device__ __forceinline__ int32_t load_unordered_s32(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.global.cg.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
  return v;
}

/** Requests the line holding `ptr` into L2 (prefetch.global.L2, sm_80+); no register result and
 *  no ordering: the issuing thread moves on at once. `ptr` must lie inside an allocation. */
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

}  // namespace flashcore::ptx
