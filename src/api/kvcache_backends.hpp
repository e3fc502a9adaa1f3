// The KV-cache (decode) entry points each backend implements, and the validation that produces
// their parameters. kvcache_api.cpp is the only caller; it hands backends parameters that
// kvcache_validate.cpp has already checked. Backends never allocate device memory or synchronize:
// split-KV partials live in the caller's workspace.
#pragma once

#include <cstddef>

#include "api/kvcache_params.hpp"
#include "api/status.hpp"
#include "flashcore/flashcore.h"

namespace flashcore {

/** Every structural rule of fc_attention_kvcache (see flashcore.h), messages naming the argument. */
Status validate_kvcache(const fc_kvcache_args* args, const fc_attention_options* options, KvCacheParams* p);
/** The values of cache_seqlens, cache_batch_idx and the used block_table entries; only for host
 *  memory (CPU calls) - CUDA kernels check the same rules on the device. */
Status check_kvcache_host_values(const KvCacheParams& p);
/** Every rule of fc_merge_partials. */
Status validate_merge(const fc_tensor* out_partials, const fc_tensor* lse_partials, const fc_tensor* out,
                      const fc_tensor* lse, const fc_attention_options* options, MergeParams* p);

namespace cpu {
// Appends k_new/v_new into the caches, then attends; num_splits > 1 computes partials per key
// range and merges them (the same arithmetic as split-KV on the GPU). Threads over (batch, kv head).
Status kvcache_forward(const KvCacheParams& p);
Status merge_partials(const MergeParams& p);
/** Whether a dense forward with few query rows, seen as the KV-cache call p, runs faster on the
 *  decode pass than on cpu_flash's forward (AUTO's decode route, api/dispatch.cpp). */
bool decode_route_suits(const KvCacheParams& p);
}  // namespace cpu

namespace cuda {
/** Splits the call will use (resolves num_splits = 0 with the heuristic). */
int kvcache_num_splits(const KvCacheParams& p);
size_t kvcache_workspace(const KvCacheParams& p);
/** Backend-specific support (dtype, head_dim, alignment); false with a reason otherwise. */
bool kvcache_supports(const KvCacheParams& p, Status* why);
Status kvcache_forward(const KvCacheParams& p, void* workspace, size_t workspace_bytes);
/** The merge kernel on p, launched as a programmatic dependent of the kernel before it where
 *  `programmatic` (the Hopper forward's split-KV partials, sm90/forward.cuh). */
Status merge_split_partials(const MergeParams& p, bool programmatic);
Status merge_partials(const MergeParams& p);
/** Whether a dense forward with few query rows, seen as the KV-cache call p
 *  (api/kvcache_forward_view.hpp's forward_as_kvcache), runs faster on the decode kernel than on
 *  the forward kernels, and that kernel serves it (AUTO's decode route, api/dispatch.cpp). */
bool decode_route_suits(const KvCacheParams& p);
}  // namespace cuda

}  // namespace flashcore
