// The validated, backend-facing description of a KV-cache attention call (fc_attention_kvcache)
// and of a merge of partial results (fc_merge_partials).
//
// kvcache_validate.cpp is the only producer: shapes, dtypes, devices, strides and overlap are
// checked; for CPU tensors the *values* of cache_seqlens / block_table / cache_batch_idx are checked
// too. For CUDA tensors those values are only known on the device, so the CUDA kernels re-check them
// with `sequence_in_bounds` / `page_in_range` below (shared host/device, so both backends agree).
// Relies on: params.hpp (DType, TensorRef, LseRef), mask.hpp (MaskInfo).
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/params.hpp"
#include "common/host_device.hpp"
#include "common/mask.hpp"

namespace flashcore {

/** rotary_cos / rotary_sin of fc_attention_kvcache: (rows, half) tables in `dtype` (q's dtype or
 *  F32), rotating features [0, 2 * half) of the appended keys and of q. */
struct RotaryTables {
  const void* cos = nullptr;
  const void* sin = nullptr;
  DType dtype = DType::F32;
  int64_t cos_row_stride = 0, sin_row_stride = 0;
  int64_t rows = 0;  // 0: off
  int64_t half = 0;
  bool interleaved = false;        // pairs (2i, 2i + 1); else (i, i + half)
  bool per_token_queries = false;  // causal or windowed: q[i] at position + i; else every q at position
  FC_HOST_DEVICE bool on() const { return rows > 0; }
};

struct KvCacheParams {
  DType dtype = DType::F16;  // q, caches, new keys/values and out share it
  int device_type = 0;
  int device_id = 0;

  TensorRef q;        // (batch, seqlen_q, heads_q, head_dim)
  TensorRef k_cache;  // batch_stride = stride of a cache row (contiguous) or of a page (paged)
  TensorRef v_cache;  // row_stride = stride of a token inside the cache row / page
  TensorRef k_new;    // data == nullptr when nothing is appended
  TensorRef v_new;
  TensorRef out;
  LseRef lse;  // (batch, heads_q, seqlen_q); data == nullptr when not asked for

  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_new = 0;  // 0 when k_new is not given
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;

  bool paged = false;
  int64_t cache_rows = 0;  // contiguous: batch_cache; paged: num_pages
  int64_t page_size = 0;   // contiguous: seqlen_cache (one "page" per cache row); paged: page_size
  int64_t pages_per_seq = 1;  // paged: block_table's second dimension; contiguous: 1

  const int32_t* cache_seqlens = nullptr;  // (batch), stride cache_seqlens_stride; see cache_end
  int64_t cache_seqlens_stride = 1;
  const int32_t* block_table = nullptr;    // (batch, pages_per_seq) or nullptr
  int64_t block_table_batch_stride = 0;
  int64_t block_table_page_stride = 1;
  const int32_t* cache_batch_idx = nullptr;  // (batch) or nullptr (identity); contiguous only
  int64_t cache_batch_idx_stride = 1;
  const int32_t* cache_leftpad = nullptr;  // (batch) or nullptr (0); contiguous only
  int64_t cache_leftpad_stride = 1;
  RotaryTables rotary;  // rows == 0: no rotary embedding

  float softmax_scale = 0.f;  // resolved (never 0)
  float softcap = 0.f;
  // ALiBi (fc_attention_options.alibi_slopes): the score of query i and key j of sequence b, head
  // h, gets -slope(b, h) * |i + seqlen_k - seqlen_q - j| after the scale and softcap, seqlen_k
  // being the sequence's keys after the append (total_len), j counted from its first key.
  const float* alibi_slopes = nullptr;  // on q's device; nullptr = no bias
  int64_t alibi_batch_stride = 0;       // 0 for (heads_q) slopes; the head stride is 1
  bool causal = false;        // informational: folded into window_right = 0
  int64_t window_left = -1;
  int64_t window_right = -1;

  int num_splits = 0;             // 0 = backend heuristic
  // The caller chose cuda_sm80 (not auto): only the portable kernels run, so the route for many
  // query rows takes sm80's forward even on a Hopper GPU (a comparison, and sm80's route tested there).
  bool portable_kernels = false;
  // Set only in the CUDA decode kernel's view of a call (cuda/decode/head_pairs.hpp): heads_kv,
  // head_dim and the caches' head strides then describe pairs of adjacent KV heads read as one
  // row of twice the width, while q, out, lse and split partials keep their per-head shapes of
  // qo_head_dim() = head_dim / 2.
  bool heads_paired = false;
  // Set only in the decode route's view of a varlen forward (api/kvcache_forward_view.hpp's
  // varlen_forward_as_kvcache). q_cu_seqlens: sequence b's query tokens are the packed rows
  // [q_cu_seqlens[b], q_cu_seqlens[b + 1]) of q, out and lse (q_rows of them in all), at most
  // seqlen_q of them (query_rows below), and its mask aligns them to its last key (kv_mask with
  // that count); q, out and lse carry the packed row's stride as their batch stride.
  // cache_seqlens_cumulative: cache_seqlens holds prefix sums (batch + 1 entries), sequence b's
  // keys are the first cache_seqlens[b + 1] - cache_seqlens[b] of its pages.
  // longest_sequence: the most keys a sequence has (max_seqlen_k; 0: capacity()), which sizes the
  // split-KV count on the host where the lengths live on the device.
  const int32_t* q_cu_seqlens = nullptr;
  int64_t q_rows = 0;
  bool cache_seqlens_cumulative = false;
  int64_t longest_sequence = 0;
  int32_t* error_flag = nullptr;  // optional; set to 1 on bad cache indices (device side on CUDA)
  int num_threads = 0;
  int sm_margin = 0;  // CUDA: SMs left to concurrent work (fc_attention_options.sm_margin)
  void* stream = nullptr;

  FC_HOST_DEVICE int64_t group_size() const { return heads_q / heads_kv; }
  /** Head dim of q, out and split partials (head_dim, or half of it in a head-pair view). */
  FC_HOST_DEVICE int64_t qo_head_dim() const { return heads_paired ? head_dim / 2 : head_dim; }
  FC_HOST_DEVICE bool has_alibi() const { return alibi_slopes != nullptr; }
  FC_HOST_DEVICE float alibi_slope(int64_t b, int64_t h) const {
    return alibi_slopes != nullptr ? alibi_slopes[b * alibi_batch_stride + h] : 0.f;
  }
  /** Tokens one sequence can hold. */
  FC_HOST_DEVICE int64_t capacity() const { return paged ? pages_per_seq * page_size : page_size; }
  bool appends() const { return k_new.data != nullptr; }
};

/** How cache_end / cache_start / cache_row_of read the index arrays: a plain load, or the caller's (the decode
 *  kernel's prefetch reads them before its programmatic wait with loads of its own). */
struct PlainIndexLoad {
  FC_HOST_DEVICE int32_t operator()(const int32_t* at) const { return *at; }
};

/** cache_seqlens[b] (device or host memory, matching the call): the slot after sequence b's last
 *  cached token, where the first appended token goes and the rotary position it takes. Without
 *  cache_seqlens (fc_attention_kvcache without an append, and the dense forwards the decode route
 *  hands over, api/kvcache_forward_view.hpp) every sequence fills its cache row. */
template <class Load = PlainIndexLoad>
FC_HOST_DEVICE int64_t cache_end(const KvCacheParams& p, int64_t b, Load load = {}) {
  if (!p.cache_seqlens) return p.capacity();
  const int64_t at = load(p.cache_seqlens + b * p.cache_seqlens_stride);
  return p.cache_seqlens_cumulative ? load(p.cache_seqlens + (b + 1) * p.cache_seqlens_stride) - at : at;
}

/** Where sequence b's query tokens sit in q, out and lse: the batch index offset_of takes (the
 *  packed first row in a varlen view, see q_cu_seqlens; b otherwise) and how many tokens it has
 *  (seqlen_q, or fewer in a varlen view; rows past them are neither read nor written). */
struct QueryRows {
  int64_t batch_index;
  int64_t tokens;
};
FC_HOST_DEVICE QueryRows query_rows(const KvCacheParams& p, int64_t b) {
  if (!p.q_cu_seqlens) return {b, p.seqlen_q};
  QueryRows r;
  packed_rows(p.q_cu_seqlens, b, p.q_rows, p.seqlen_q, r.batch_index, r.tokens);
  return r;
}

/** Slot of sequence b's first token: cache_leftpad[b], 0 without it (and for paged caches). Key j of
 *  the sequence sits at slot cache_start + j. */
template <class Load = PlainIndexLoad>
FC_HOST_DEVICE int64_t cache_start(const KvCacheParams& p, int64_t b, Load load = {}) {
  return p.cache_leftpad ? int64_t(load(p.cache_leftpad + b * p.cache_leftpad_stride)) : 0;
}

/** Tokens of sequence b already cached. */
FC_HOST_DEVICE int64_t cached_len(const KvCacheParams& p, int64_t b) { return cache_end(p, b) - cache_start(p, b); }

/** Rotary positions a call uses past cache_end (the last one is cache_end + this - 1). */
FC_HOST_DEVICE int64_t rotary_span(const KvCacheParams& p) {
  const int64_t q_span = p.rotary.per_token_queries ? p.seqlen_q : (p.seqlen_q > 0 ? 1 : 0);
  return p.seqlen_new > q_span ? p.seqlen_new : q_span;
}

/** Keys the sequence attends over: what was cached plus what is appended. */
FC_HOST_DEVICE int64_t total_len(const KvCacheParams& p, int64_t b) { return cached_len(p, b) + p.seqlen_new; }

/** The mask of a sequence with seqlen_k keys and q_tokens query tokens (seqlen_q, or a varlen
 *  view's own count: query_rows), aligned to its last key. */
FC_HOST_DEVICE MaskInfo kv_mask(const KvCacheParams& p, int64_t seqlen_k, int64_t q_tokens) {
  return {q_tokens, seqlen_k, p.window_left, p.window_right};
}
FC_HOST_DEVICE MaskInfo kv_mask(const KvCacheParams& p, int64_t seqlen_k) { return kv_mask(p, seqlen_k, p.seqlen_q); }

/** Which cache row sequence b uses (contiguous caches). */
template <class Load = PlainIndexLoad>
FC_HOST_DEVICE int64_t cache_row_of(const KvCacheParams& p, int64_t b, Load load = {}) {
  return p.cache_batch_idx ? int64_t(load(p.cache_batch_idx + b * p.cache_batch_idx_stride)) : b;
}

/** Sequence-level value checks: length within capacity (including what is appended) and a valid
 *  cache row. Page ids are checked page by page with page_in_range as they are used. */
FC_HOST_DEVICE bool sequence_in_bounds(const KvCacheParams& p, int64_t b) {
  const int64_t end = cache_end(p, b), start = cache_start(p, b);
  if (start < 0 || end < start || end + p.seqlen_new > p.capacity()) return false;
  if (p.rotary.on() && end + rotary_span(p) > p.rotary.rows) return false;
  if (!p.paged) {
    const int64_t row = cache_row_of(p, b);
    if (row < 0 || row >= p.cache_rows) return false;
  }
  return true;
}

/** Page id (paged) or cache row (contiguous) holding logical page `page` of sequence b. */
FC_HOST_DEVICE int64_t physical_page(const KvCacheParams& p, int64_t b, int64_t page) {
  if (!p.paged) return cache_row_of(p, b);
  return p.block_table[b * p.block_table_batch_stride + page * p.block_table_page_stride];
}

FC_HOST_DEVICE bool page_in_range(const KvCacheParams& p, int64_t physical) {
  return physical >= 0 && physical < p.cache_rows;
}

/** Element offset of (slot, kv head h) inside a cache, given its physical page (contiguous caches:
 *  the cache row, and the slot in it). Key j of sequence b is slot cache_start(p, b) + j. */
FC_HOST_DEVICE int64_t cache_offset(const TensorRef& cache, const KvCacheParams& p, int64_t physical,
                                    int64_t slot, int64_t h) {
  const int64_t in_page = p.paged ? slot % p.page_size : slot;
  return physical * cache.batch_stride + in_page * cache.row_stride + h * cache.head_stride;
}

/** Merge of partial attention results (fc_merge_partials, and split-KV's combine step). */
struct MergeParams {
  DType out_dtype = DType::F32;
  int device_type = 0;
  int device_id = 0;
  const float* out_partials = nullptr;  // (parts, batch, seqlen_q, heads, head_dim)
  int64_t op_part_stride = 0, op_batch_stride = 0, op_row_stride = 0, op_head_stride = 0;
  const float* lse_partials = nullptr;  // (parts, batch, heads, seqlen_q)
  int64_t lp_part_stride = 0, lp_batch_stride = 0, lp_head_stride = 0, lp_row_stride = 0;
  TensorRef out;  // (batch, seqlen_q, heads, head_dim)
  LseRef lse;     // (batch, heads, seqlen_q); optional
  int64_t parts = 0, batch = 0, seqlen_q = 0, heads = 0, head_dim = 0;
  // A varlen combine (KvCacheParams::q_cu_seqlens, the Hopper forward's split-KV): sequence b's
  // out and lse rows are packed rows start + i, start found through these prefix sums (out_rows
  // packed rows), at b * batch_stride + (start + i) * row_stride as in AttentionParams; rows past
  // its tokens are left alone. nullptr for every other merge (fc_merge_partials never sets it).
  const int32_t* out_cu_seqlens = nullptr;
  int64_t out_rows = 0;
  int num_threads = 0;
  void* stream = nullptr;
};

/** Sets m's parts and shape and points it at split partials in the dense layout the GPU kernels
 *  write (the decode kernel's SplitOutput, the Hopper forward's split-KV): O (parts, batch,
 *  seqlen_q, heads, head_dim) and lse (parts, batch, heads, seqlen_q), fp32. */
inline void set_dense_partials(MergeParams& m, int64_t parts, int64_t batch, int64_t seqlen_q, int64_t heads,
                               int64_t head_dim, const float* out_partials, const float* lse_partials) {
  m.parts = parts;
  m.batch = batch;
  m.seqlen_q = seqlen_q;
  m.heads = heads;
  m.head_dim = head_dim;
  m.out_partials = out_partials;
  m.op_head_stride = m.head_dim;
  m.op_row_stride = m.heads * m.head_dim;
  m.op_batch_stride = m.seqlen_q * m.op_row_stride;
  m.op_part_stride = m.batch * m.op_batch_stride;
  m.lse_partials = lse_partials;
  m.lp_row_stride = 1;
  m.lp_head_stride = m.seqlen_q;
  m.lp_batch_stride = m.heads * m.seqlen_q;
  m.lp_part_stride = m.batch * m.lp_batch_stride;
}

}  // namespace flashcore
