// Paged K/V for kernels that read packed rows (the Hopper forward's TMA maps): the pages a
// varlen call names through fc_attention_options.block_table are copied, on the caller's stream,
// into packed varlen k / v in the call's workspace, and the call then runs as a packed varlen call.
// The copy reads and writes each K/V element once (O(N), ~2% of a 4 x 2048 prefill's time); the
// attention itself is O(N^2) and runs on the fast kernels. No synchronization, CUDA-graph safe.
#pragma once

#include <cstddef>

#include "api/params.hpp"
#include "api/status.hpp"

namespace flashcore::cuda {

/** Workspace bytes of the packed copies: batch x seqlen_k (max_seqlen_k clamped to the pages)
 *  rows of k and of v, each row heads_kv x head_dim elements of 2 bytes. 0 when p is not paged. */
size_t paged_gather_bytes(const AttentionParams& p);

/** Copies p's paged k / v into `workspace` (sequence b's key j at packed row cu_seqlens_k[b] + j,
 *  clamped like seq_info, so wrong values in GPU memory stay inside both buffers) and fills
 *  `packed` with the same call over the copies (pages off). fp16 / bf16 only. */
Status gather_pages(const AttentionParams& p, void* workspace, AttentionParams* packed);

}  // namespace flashcore::cuda
