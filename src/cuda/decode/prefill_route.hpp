// KV-cache calls with many query rows (chunked prefill into the cache through
// flash_attn_with_kvcache) on the forward kernels instead of the decode kernel. The decode
// kernel gives every 16 query rows of a KV head their own pass over the keys, which is right for
// a few new tokens and ~10x slower than the forward kernels from a few hundred rows on (H100,
// docs/PERF.md session 27). Here the cache becomes the paged K/V of a varlen forward: contiguous
// caches are pages of one cache row each (cache_batch_idx, or the identity, as the table;
// cache_leftpad as each sequence's first slot), paged caches keep their block table. The Hopper
// forward runs it where it reads those pages in place (one page per sequence, or pages of whole
// 128-key blocks), cuda_sm80 otherwise. A one-CTA
// kernel writes the varlen prefix sums from cache_seqlens on the device (no synchronization) and
// marks sequences whose indices break the rules, whose rows a last small kernel sets to NaN (and
// error_flag to 1), as the decode kernel does.
#pragma once

#include <cstddef>

#include "api/kvcache_params.hpp"
#include "api/status.hpp"

namespace flashcore::cuda::decode {

/** Whether p (after its append) runs on the forward kernels: many query rows per KV head, enough
 *  of the forward's 128-row blocks to fill half the GPU, and pages a forward reads in place (one
 *  per sequence; or multiples of 256 keys for sm80, of 128 for sm90). */
bool prefill_route_applies(const KvCacheParams& p);

/** Workspace of the route: the prefix sums, the identity table and the per-sequence marks. */
size_t prefill_route_workspace(const KvCacheParams& p);

/** The attention of p on the forward kernels, on p.stream (q may be the rotated copy). */
Status run_prefill_route(const KvCacheParams& p, void* workspace);

}  // namespace flashcore::cuda::decode
