// What this build compiled for CUDA and what the device offers, asked in one place by every CUDA
// entry point (forward, backward, decode): the head-dim buckets and dtypes chosen with
// FLASHCORE_HEAD_DIMS / FLASHCORE_DTYPES, and the multiprocessor count and L2 size for grid
// heuristics.
#pragma once

#include <cstdint>

#include "api/params.hpp"

namespace flashcore::cuda {

/** Smallest compiled head-dim bucket (64, 128, 256) that holds head_dim, or 0 when none does.
 *  Head dims below a bucket run in it with zero-filled padding columns. */
int compiled_head_dim_bucket(int64_t head_dim);

/** Multiprocessors of a device, or `fallback` when the query fails (the error is cleared). */
int multiprocessor_count(int device_id, int fallback);
/** The multiprocessors a call's grid may plan for: the count less the caller's sm_margin (SMs left
 *  to work running beside it, fc_attention_options.sm_margin), at least one. */
inline int usable_multiprocessors(int device_id, int fallback, int sm_margin) {
  const int sms = multiprocessor_count(device_id, fallback);
  return sm_margin <= 0 ? sms : (sm_margin < sms ? sms - sm_margin : 1);
}
/** The DRAM's peak bytes / s (memory clock x bus width, double data rate); 0 when the device does
 *  not report them. */
double dram_peak_bytes_per_second(int device_id);
/** What the Hopper launchers assume when the SM-count query fails (H100 SXM). */
inline constexpr int kFallbackSmCount = 132;
/** The L2 cache's bytes, or `fallback` when the query fails (the error is cleared). */
int64_t l2_cache_bytes(int device_id, int64_t fallback);
/** What the Hopper launchers assume when the L2 query fails (H100 SXM: 50 MiB). */
inline constexpr int64_t kFallbackL2Bytes = int64_t(50) << 20;

}  // namespace flashcore::cuda
