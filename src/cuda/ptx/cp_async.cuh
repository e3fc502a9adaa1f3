// Asynchronous global->shared copies (sm_80 cp.async), the basis of the multi-stage pipeline.
// A copy is issued, grouped with commit(), and waited on with wait<N>() which blocks until at
// most N of the most recent groups are still in flight. A __syncthreads() is still needed after
// the wait before other threads read the data.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

/** Copy 16 bytes; when `valid` is false the destination is zero-filled and nothing is read
 *  (src-size 0), which is how out-of-range rows of a partial tile are handled. */
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}

/** Copy 4 bytes through L1 (.ca: the 4-byte form has no .cg): small values that go to shared
 *  memory without passing through a register, e.g. block-table entries a thread with few
 *  registers needs later. */
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_dst), "l"(gmem_src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace flashcore::ptx
