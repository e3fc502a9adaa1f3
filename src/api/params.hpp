// The validated, backend-facing description of one attention call.
//
// validate.cpp is the only producer: every field here has already been checked (shapes agree,
// strides are sane, pointers are non-null, sizes fit in int64). Backends trust these values and
// never validate again. All strides are in elements; offsets must be computed in int64.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dropout.hpp"
#include "common/mask.hpp"

namespace flashcore {

enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, I32 = 3 };

inline size_t dtype_size(DType t) { return t == DType::F16 || t == DType::BF16 ? 2 : 4; }

/** A tensor as backends see it: base pointer plus element strides for (batch, row, head).
 *  For varlen calls the batch stride is 0 and rows are counted from the packed start. */
struct TensorRef {
  void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

/** LSE layout: dense (batch, heads, seqlen_q) or varlen (heads, total_q). */
struct LseRef {
  float* data = nullptr;  // nullptr when the caller did not ask for LSE (forward only)
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
};

/** Paged K/V of a varlen forward (fc_attention_options.block_table): k/v are (num_pages,
 *  page_size, heads_kv, head_dim), sequence b's key j in page table[b, j / page_size]. */
struct KvPages {
  const int32_t* table = nullptr;  // nullptr: k/v are packed as usual
  int64_t batch_stride = 0, page_stride = 1;
  int64_t page_size = 0;
  int64_t num_pages = 0;
  int64_t per_seq = 0;  // table columns
  // Optional first slot of each sequence (a KV cache's cache_leftpad, whole cache rows as pages):
  // key j is slot first_slot[b] + j.
  const int32_t* first_slot = nullptr;
  int64_t first_slot_stride = 1;
};

struct AttentionParams {
  DType dtype = DType::F16;  // q, k, v, out (and dout, dq, dk, dv) share it
  int device_type = 0;       // fc_device_type
  int device_id = 0;

  TensorRef q, k, v, out;
  LseRef lse;

  int64_t batch = 0;
  int64_t seqlen_q = 0;  // dense: the length; varlen: max_seqlen_q
  int64_t seqlen_k = 0;  // dense: the length; varlen: max_seqlen_k
  int64_t heads_q = 0;
  int64_t heads_kv = 0;  // heads_q % heads_kv == 0; query head h reads KV head h / (heads_q / heads_kv)
  int64_t head_dim = 0;

  // Varlen: device (or host, for CPU) int32 prefix sums of length batch + 1; nullptr when dense.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0;  // rows of the packed q (varlen) or batch * seqlen_q (dense)
  int64_t total_k = 0;

  float softmax_scale = 0.f;  // resolved (never 0)
  float softcap = 0.f;        // 0 = off
  bool causal = false;        // informational: already folded into window_right = 0
  int64_t window_left = -1;   // -1 = unbounded
  int64_t window_right = -1;  // -1 = unbounded

  bool deterministic = false;
  int num_threads = 0;        // CPU: 0 = every core of the affinity mask (cpu::available_cores)
  int sm_margin = 0;          // CUDA: SMs left to concurrent work (fc_attention_options.sm_margin)
  void* stream = nullptr;     // cudaStream_t
  int32_t* error_flag = nullptr;  // CUDA varlen: set to 1 on the device when cu_seqlens break the rules
  KvPages pages;                  // forward only
  // The Hopper forward's split-KV (cuda/sm90/split_kv.hpp): 0 = its rule, 1 = no split, n = n key
  // ranges per tile (at most one per key block). A KV-cache call's num_splits on the forward route.
  int num_splits = 0;
  // ALiBi (fc_attention_options.alibi_slopes): the score of query i and key j of sequence b, head
  // h, gets -slope(b, h) * |i + seqlen_k - seqlen_q - j| (per-sequence lengths and positions).
  const float* alibi_slopes = nullptr;  // on q's device; nullptr = no bias
  int64_t alibi_batch_stride = 0;       // 0 for (heads_q) slopes; the head stride is 1
  // Dropout of the attention probabilities (fc_attention_options.dropout_p): entry (i, j) of
  // sequence b, query head h is kept when dropout_keeps(dropout, b * heads_q + h, i, j) (positions
  // inside the sequence) and kept entries are scaled by dropout.keep_scale; lse is not affected.
  DropoutParams dropout;

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  /** A causal mask or a window: rows see different key ranges (causal is window_right = 0). */
  FC_HOST_DEVICE bool has_mask() const { return window_left >= 0 || window_right >= 0; }
  FC_HOST_DEVICE bool has_alibi() const { return alibi_slopes != nullptr; }
  FC_HOST_DEVICE float alibi_slope(int64_t b, int64_t h) const {
    return alibi_slopes != nullptr ? alibi_slopes[b * alibi_batch_stride + h] : 0.f;
  }
  FC_HOST_DEVICE bool is_paged() const { return pages.table != nullptr; }
  int64_t group_size() const { return heads_q / heads_kv; }
};

/** Backward adds the incoming gradient and the three gradient outputs. */
struct BackwardParams : AttentionParams {
  TensorRef dout, dq, dk, dv;
};

/** Per-sequence view used by backends: where sequence b starts in the packed rows, and its
 *  lengths. For dense calls the starts are b * seqlen and the lengths are the full seqlens.
 *  Kept header-only and host/device so the CUDA kernels resolve sequences the same way. */
struct SeqInfo {
  int64_t q_start;   // first packed row of q (varlen) or 0 (dense: use batch_stride)
  int64_t k_start;
  int64_t seqlen_q;
  int64_t seqlen_k;
};

/** Rows [start, start + length) of sequence b in a packed tensor of `total` rows, from prefix sums
 *  `cu`, kept inside the tensor and at most `max_length` long. cu_seqlens in GPU memory are only
 *  validated when the caller asks (validate.cpp); clamped here, wrong values still never send a
 *  kernel outside the tensors or its workspace (rows of a total_q-row layout). For valid values
 *  (0 <= cu[b] <= cu[b + 1] <= total, length <= max_seqlen) nothing changes. */
FC_HOST_DEVICE void packed_rows(const int32_t* cu, int64_t b, int64_t total, int64_t max_length, int64_t& start,
                                int64_t& length) {
  // In 32 bits (cu holds int32, so no valid row lies past INT32_MAX): a few instructions on the
  // kernels' tile walks.
  const int32_t rows = total < INT32_MAX ? static_cast<int32_t>(total) : INT32_MAX;
  const int32_t longest = max_length < INT32_MAX ? static_cast<int32_t>(max_length) : INT32_MAX;
  const int32_t begin = cu[b], end = cu[b + 1];
  const int32_t first = begin < 0 ? 0 : (begin > rows ? rows : begin);
  const int32_t stop = end < first ? first : (end > rows ? rows : end);
  start = first;
  length = stop - first > longest ? longest : stop - first;
}

FC_HOST_DEVICE SeqInfo seq_info(const AttentionParams& p, int64_t b) {
  if (p.cu_seqlens_q) {
    // p.seqlen_q / p.seqlen_k hold max_seqlen (clamped to the totals) for varlen calls.
    SeqInfo s;
    packed_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, s.q_start, s.seqlen_q);
    packed_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, s.k_start, s.seqlen_k);
    if (p.is_paged()) s.k_start = 0;  // keys are addressed through the pages (kv_offset)
    return s;
  }
  return {0, 0, p.seqlen_q, p.seqlen_k};
}

FC_HOST_DEVICE MaskInfo mask_info(const AttentionParams& p, const SeqInfo& s) {
  return {s.seqlen_q, s.seqlen_k, p.window_left, p.window_right};
}

/** Element offset of (batch b, packed-or-local row r, head h) in a tensor. */
FC_HOST_DEVICE int64_t offset_of(const TensorRef& t, int64_t b, int64_t row, int64_t h) {
  return b * t.batch_stride + row * t.row_stride + h * t.head_stride;
}

/** Where key j of sequence b lives in paged K/V: its page and its slot in that page. The table
 *  column and the page id are clamped into the table and the tensor, so wrong values in GPU memory
 *  never send a kernel outside them (validation rejects them for CPU calls). */
struct PageSlot {
  int64_t page, slot;
};
FC_HOST_DEVICE PageSlot kv_page_slot(const AttentionParams& p, int64_t b, int64_t j) {
  const KvPages& pg = p.pages;
  if (pg.first_slot) {
    const int64_t first = pg.first_slot[b * pg.first_slot_stride];
    j += first > 0 ? first : 0;
  }
  int64_t column = j / pg.page_size;
  column = column < pg.per_seq ? column : pg.per_seq - 1;
  int64_t page = pg.table[b * pg.batch_stride + column * pg.page_stride];
  page = page < 0 ? 0 : (page >= pg.num_pages ? pg.num_pages - 1 : page);
  int64_t slot = j - column * pg.page_size;
  slot = slot < pg.page_size ? slot : pg.page_size - 1;  // rows past the table: its last slot
  return {page, slot};
}

/** Element offset of key `row` (seq.k_start + j) of sequence b, KV head h, in k or v: offset_of, or
 *  through the page table for paged K/V (seq.k_start is 0 there; kv_page_slot). */
FC_HOST_DEVICE int64_t kv_offset(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t row, int64_t h) {
  if (!p.is_paged()) return offset_of(t, b, row, h);
  const PageSlot at = kv_page_slot(p, b, row);
  return at.page * t.batch_stride + at.slot * t.row_stride + h * t.head_stride;
}

}  // namespace flashcore
