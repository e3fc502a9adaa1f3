// Step trace of the sm80 dK / dV kernel (backward_main.cuh), for dev/sm80_backward_trace.cu only:
// with FLASHCORE_SM80_BWD_TRACE defined, lane 0 of every warp of the first kBwdTraceCtas CTAs
// records (event, SM clock) at each phase boundary of a query step, so a run shows where a step's
// time goes and whether the warps sharing an SM sub-partition (w and w + 4) reach the
// element-wise work at the same time. Without the macro BWD80_TRACE expands to nothing and the
// kernel is unchanged.
// A record is taken when the warp issues it, not when the tensor-core work before it completes:
// an event after a GEMM marks that GEMM issued; the events after the element-wise step and after
// the barriers mark completion (they depend on the GEMMs' results or wait for every warp).
#pragma once

#include <cstdint>

#include "cuda/trace_record.cuh"

namespace flashcore::cuda::sm80::bwd {

/** What a warp reached in a query step. */
enum BwdStepEvent : uint32_t {
  kBwdStepBegin = 1,  // barrier (A) passed: the step's Q / dO / statistics landed
  kBwdScoresDone,     // compute_p_and_ds returned: S, dP, P, dS computed and stored to smem
  kBwdPdsShared,      // barrier (B) passed: every warp's P and dS stored
  kBwdDvIssued,       // the dV GEMM issued
  kBwdDkIssued,       // the dK GEMM issued
  kBwdDqSent,         // the dQ GEMM done and its atomics issued
  kBwdStepEnd,        // the step's last instruction issued
};

#ifdef FLASHCORE_SM80_BWD_TRACE
constexpr int kBwdTraceCtas = 8;
constexpr int kBwdTraceWarps = 8;
constexpr int kBwdTraceCapacity = 4096;  // records per (CTA, warp); arg = the query step
__device__ TraceRecord* g_bwd_trace;     // [kBwdTraceCtas][kBwdTraceWarps][kBwdTraceCapacity], set by the tool
__device__ int g_bwd_trace_count[kBwdTraceCtas * kBwdTraceWarps];

/** Records `event` of query step `step` for the calling warp (its lane 0); `count` is the warp's
 *  record counter (append_trace_record). */
__device__ __forceinline__ void bwd_trace_event(int& count, uint32_t event, int64_t step) {
  const int warp = static_cast<int>(threadIdx.x / 32);
  if (blockIdx.x >= kBwdTraceCtas || warp >= kBwdTraceWarps || threadIdx.x % 32 != 0) return;
  append_trace_record(g_bwd_trace, g_bwd_trace_count, static_cast<int>(blockIdx.x) * kBwdTraceWarps + warp,
                      kBwdTraceCapacity, count, event, static_cast<uint32_t>(step));
}
#define BWD80_TRACE(count, event, step) bwd_trace_event((count), (event), (step))
#else
#define BWD80_TRACE(count, event, step) ((void)0)
#endif

}  // namespace flashcore::cuda::sm80::bwd
