// KV-cache calls with many query rows (chunked prefill into the cache through
// flash_attn_with_kvcache) on the forward kernels instead of the decode kernel. The decode
// kernel gives every 16 query rows of a KV head their own pass over the keys, which is right for
// a few new tokens and ~10x slower than the forward kernels from a few hundred rows on (H100,
// docs/PERF.md session 27). Here the cache becomes the paged K/V of a varlen forward: contiguous
// caches are pages of one cache row each (cache_batch_idx, or the identity, as the table;
// cache_leftpad as each sequence's first slot), paged caches keep their block table. On Hopper the
// sm90 forward runs it (reading a cache row per sequence or 128k-key pages in place, gathering
// smaller pages into the workspace first), cuda_sm80 elsewhere. A one-CTA
// kernel writes the varlen prefix sums from cache_seqlens on the device (no synchronization) and
// marks sequences whose indices break the rules, whose rows a last small kernel sets to NaN (and
// error_flag to 1), as the decode kernel does.
#pragma once

#include <cstddef>

#include "api/kvcache_params.hpp"
#include "api/status.hpp"

namespace flashcore::cuda::decode {

/** Whether p (after its append) runs on the forward kernels: many query rows per KV head, enough
 *  of the forward's 128-row blocks to fill half the GPU, and a forward that takes its cache (sm90:
 *  any, pages smaller than a key block gathered within 1 GiB of workspace; sm80: a cache row per
 *  sequence or pages of 256k keys). */
bool prefill_route_applies(const KvCacheParams& p);

/** The reverse question, for a dense forward with few query rows seen as a KV-cache call (AUTO's
 *  decode route, api/dispatch.cpp): whether the decode kernel serves it better than the forward
 *  kernels. Where its rows per KV head fit one of its 16-row passes over the keys (at head dim 64
 *  where it reads the KV heads in pairs, decode/head_pairs.hpp; else, since the unpaired d64 kernel
 *  streams slower, only when the forward's tiles would leave SMs idle), and
 *  where the Hopper forward would pack more rows into tiles too few to fill the GPU (the calls
 *  prefill_route_applies leaves on the decode kernel, so a forward and a KV-cache call of one
 *  shape take one kernel). H200, docs/PERF.md session 35, K+V TB/s, 1-4 query tokens: GQA 32 / 8
 *  d128, 1 x 65536 keys 0.38 -> 3.3-3.9, 8 x 4096 2.6 -> 3.4-3.5; MHA d128 +5% to +15%, d256 3.0
 *  -> 4.0. */
bool decode_kernel_suits(const KvCacheParams& p);

/** Whether the route runs p on the Hopper forward (else cuda_sm80). Decided on the call as the
 *  caller made it (before q is rotated into the workspace), as the workspace size is. */
bool prefill_route_on_hopper(const KvCacheParams& p);

/** Workspace of the route: the prefix sums, the identity table and the per-sequence marks; on
 *  Hopper, the page gather's buffers for pages smaller than a key block. */
size_t prefill_route_workspace(const KvCacheParams& p);

/** The attention of p on the forward kernels, on p.stream (q may be the rotated copy); on_hopper
 *  is prefill_route_on_hopper of the call the workspace was sized for. */
Status run_prefill_route(const KvCacheParams& p, bool on_hopper, void* workspace);

}  // namespace flashcore::cuda::decode
