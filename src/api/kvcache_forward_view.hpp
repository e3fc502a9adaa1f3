// A KV-cache call (KvCacheParams) seen as a varlen forward over paged K/V (AttentionParams): how
// the calls with many query rows per KV head run on the forward kernels instead of the decode
// ones, on the GPU (cuda/decode/prefill_route.*) and on the CPU (cpu/decode.cpp). q and out rows
// b * seqlen_q + i form a packed view whose batch stride carries what q's (and out's, lse's) has
// beyond the packed rows; the cache is the K/V pages: a paged cache's block table as it is, a
// contiguous cache as pages of one cache row each (cache_batch_idx, or the identity, as the table;
// cache_leftpad as each sequence's first slot). And back: a dense forward as a KV-cache call
// (forward_as_kvcache). Host code only: no device or backend dependency.
// Relies on: api/kvcache_params.hpp, api/params.hpp.
#pragma once

#include <cstdint>

#include "api/kvcache_params.hpp"
#include "api/params.hpp"

namespace flashcore {

/** The int32 arrays the forward view reads, in the call's memory: prefix sums of the query rows
 *  (b * seqlen_q) and of each sequence's keys after the append (total_len), and the identity
 *  table 0 .. batch - 1 (contiguous caches without cache_batch_idx). */
struct KvForwardArrays {
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* identity;
};

/** p as a varlen forward over paged K/V (see the file comment). total_k is left at INT32_MAX
 *  (only a clamp for paged K/V); the caller may set it exactly. ALiBi slopes and the thread count
 *  travel too; the backends' own rules decide whether they take the result. */
inline AttentionParams kvcache_as_forward(const KvCacheParams& p, const KvForwardArrays& a) {
  AttentionParams f;
  f.dtype = p.dtype;
  f.device_type = p.device_type;
  f.device_id = p.device_id;
  auto packed_view = [&](const TensorRef& t) {
    return TensorRef{t.data, t.batch_stride - p.seqlen_q * t.row_stride, t.row_stride, t.head_stride};
  };
  f.q = packed_view(p.q);
  f.out = packed_view(p.out);
  if (p.lse.data)
    f.lse = {p.lse.data, p.lse.batch_stride - p.seqlen_q * p.lse.row_stride, p.lse.head_stride, p.lse.row_stride};
  f.k = p.k_cache;
  f.v = p.v_cache;
  f.batch = p.batch;
  f.seqlen_q = p.seqlen_q;
  f.seqlen_k = p.capacity();
  f.heads_q = p.heads_q;
  f.heads_kv = p.heads_kv;
  f.head_dim = p.head_dim;
  f.cu_seqlens_q = a.cu_q;
  f.cu_seqlens_k = a.cu_k;
  f.total_q = p.batch * p.seqlen_q;
  f.total_k = INT32_MAX;
  f.softmax_scale = p.softmax_scale;
  f.softcap = p.softcap;
  f.causal = p.causal;
  f.window_left = p.window_left;
  f.window_right = p.window_right;
  f.num_threads = p.num_threads;
  f.sm_margin = p.sm_margin;
  f.stream = p.stream;
  f.alibi_slopes = p.alibi_slopes;
  f.alibi_batch_stride = p.alibi_batch_stride;
  f.num_splits = p.num_splits;
  f.pages.page_size = p.page_size;
  f.pages.num_pages = p.cache_rows;
  f.pages.per_seq = p.pages_per_seq;
  if (p.paged) {
    f.pages.table = p.block_table;
    f.pages.batch_stride = p.block_table_batch_stride;
    f.pages.page_stride = p.block_table_page_stride;
  } else {
    f.pages.table = p.cache_batch_idx ? p.cache_batch_idx : a.identity;
    f.pages.batch_stride = p.cache_batch_idx ? p.cache_batch_idx_stride : 1;
    f.pages.page_stride = 1;
    f.pages.first_slot = p.cache_leftpad;
    f.pages.first_slot_stride = p.cache_leftpad_stride;
  }
  return f;
}

/** The other way: a dense forward (no cu_seqlens, no block table) as a KV-cache call whose caches
 *  are k and v, one cache row per sequence, every row full (no cache_seqlens), nothing appended.
 *  AUTO hands forwards with a few query rows per KV head to the decode kernel this way
 *  (api/dispatch.cpp); the masks, scale, softcap and ALiBi keep their meaning, since both calls
 *  align a causal mask or window to the bottom right. */
inline KvCacheParams forward_as_kvcache(const AttentionParams& f) {
  KvCacheParams p;
  p.dtype = f.dtype;
  p.device_type = f.device_type;
  p.device_id = f.device_id;
  p.q = f.q;
  p.k_cache = f.k;
  p.v_cache = f.v;
  p.out = f.out;
  p.lse = f.lse;
  p.batch = f.batch;
  p.seqlen_q = f.seqlen_q;
  p.heads_q = f.heads_q;
  p.heads_kv = f.heads_kv;
  p.head_dim = f.head_dim;
  p.paged = false;
  p.cache_rows = f.batch;
  p.page_size = f.seqlen_k;  // a contiguous cache's row: seqlen_cache
  p.pages_per_seq = 1;
  p.cache_seqlens = nullptr;  // every row full (cache_end)
  p.softmax_scale = f.softmax_scale;
  p.softcap = f.softcap;
  p.alibi_slopes = f.alibi_slopes;
  p.alibi_batch_stride = f.alibi_batch_stride;
  p.causal = f.causal;
  p.window_left = f.window_left;
  p.window_right = f.window_right;
  p.num_threads = f.num_threads;
  p.sm_margin = f.sm_margin;
  p.stream = f.stream;
  return p;
}

/** A varlen forward (decoding through flash_attn_varlen_func, as engines batch their sequences:
 *  max_seqlen_q of 1, or a few for speculative decoding) as a KV-cache call, nothing appended.
 *  Sequence b's query tokens are packed rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q / out /
 *  lse (KvCacheParams::q_cu_seqlens), its mask aligned to its last key with its own token count,
 *  as the varlen forward aligns it. Its keys: packed k / v rows [cu_seqlens_k[b], cu_seqlens_k[b + 1])
 *  are one cache row shared by every sequence (batch stride 0) with cu_seqlens_k as the left padding
 *  and cu_seqlens_k + 1 as the ends, so key j is packed row cu_seqlens_k[b] + j; paged K/V keep
 *  their block table, cu_seqlens_k giving the lengths as prefix sums. Masks, softcap and ALiBi
 *  keep their meaning. Keys past max_seqlen_k are not clamped away as the forward
 *  kernels clamp them (such cu_seqlens break the call's contract), and sequences whose cu_seqlens_k
 *  leave the tensor get NaN rows and the error flag, as bad KV-cache lengths do. Not for K/V pages
 *  with first slots (those come from kvcache_as_forward only). */
inline KvCacheParams varlen_forward_as_kvcache(const AttentionParams& f) {
  KvCacheParams p = forward_as_kvcache(f);
  auto rows_as_batches = [](const TensorRef& t) { return TensorRef{t.data, t.row_stride, t.row_stride, t.head_stride}; };
  p.q = rows_as_batches(f.q);
  p.out = rows_as_batches(f.out);
  p.lse = f.lse;
  p.lse.batch_stride = f.lse.row_stride;
  p.q_cu_seqlens = f.cu_seqlens_q;
  p.q_rows = f.total_q;
  p.longest_sequence = f.seqlen_k;
  p.error_flag = f.error_flag;
  if (f.is_paged()) {
    p.paged = true;
    p.cache_rows = f.pages.num_pages;
    p.page_size = f.pages.page_size;
    p.pages_per_seq = f.pages.per_seq;
    p.block_table = f.pages.table;
    p.block_table_batch_stride = f.pages.batch_stride;
    p.block_table_page_stride = f.pages.page_stride;
    p.cache_seqlens = f.cu_seqlens_k;
    p.cache_seqlens_cumulative = true;
  } else {
    p.k_cache.batch_stride = 0;
    p.v_cache.batch_stride = 0;
    p.cache_rows = f.batch;  // row b (batch stride 0: the packed rows) for every sequence b
    p.page_size = f.total_k;
    p.cache_leftpad = f.cu_seqlens_k;
    p.cache_seqlens = f.cu_seqlens_k + 1;
  }
  return p;
}

}  // namespace flashcore
