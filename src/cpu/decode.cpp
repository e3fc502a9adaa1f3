// CPU backend of the inference path: append k_new/v_new into the cache (contiguous or paged), then
// attention of the few new query rows against the whole cache, optionally split over the keys
// (flash-decoding) and merged; and fc_merge_partials.
//
// One task = one (sequence, split of its keys), every KV head: all query heads of a GQA group
// and all query rows go through each key block together, so every cached K/V row is converted
// and read once (DecodeAttention below). The splits come from the shapes and lengths alone
// (decode_splits), so results do not depend on the thread count; a second pass merges them.
// fp32 throughout. Calls with many query rows per KV head (chunked prefill into the cache) run on
// cpu_flash's forward instead, with the cache as its paged K/V (api/kvcache_forward_view.hpp), as
// the GPU path's forward-kernel route does. Relies on: kvcache_params.hpp (validated params,
// cache addressing, masks), the host dtype conversions in dtype_host.hpp, cpu_common.hpp (Simd,
// gemm_bcast, transpose, the worker pool).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "api/backends.hpp"
#include "api/kvcache_backends.hpp"
#include "api/kvcache_forward_view.hpp"
#include "cpu/cpu_common.hpp"
#include "common/dtype_host.hpp"
#include "common/rotary.hpp"

namespace flashcore::cpu {
namespace {

using flash_detail::AlignedFloats;
using flash_detail::Simd;
using flash_detail::Vec;
using flash_detail::kSimdWidth;

struct DecodeTraits {
  static constexpr int64_t kKeyBlock = 64;       // keys per online-softmax step, at most
  static constexpr int64_t kTargetTasks = 64;    // the split heuristic's aim: tasks for 16+ threads
  static constexpr int64_t kMinSplitKeys = 128;  // ... with no split shorter than this
  // Query rows per KV head (GQA group x seqlen_q) from which cpu_flash's forward takes the call.
  // The decode pass's time grows with the rows (each key block's S and P V per row, no tiling),
  // the forward's much less: on the development EPYC (2 threads, causal, contiguous caches) the
  // forward took 0.87x (GQA 32 / 8, d128) and 0.67x (MHA, d64) the decode pass's time at 16 rows,
  // 0.53-0.76x at more, and 1.09-1.34x at 1-4 rows (docs/PERF.md, session 32); at 12 rows
  // 0.94-0.95x (GQA 32 / 8, d128), 0.90-0.94x (MHA d64), 0.76-0.78x (MHA d128), at 8 rows
  // 1.04-1.07x (GQA), 0.92-1.05x (MHA d64), 0.85-0.87x (MHA d128) (session 33, once the forward
  // read a paged view as fast as the same keys unpaged).
  static constexpr int64_t kForwardMinRows = 12;
  // The other way (AUTO's decode route, api/dispatch.cpp): a dense forward with at most this many
  // query rows per KV head runs this decode pass instead of cpu_flash's forward, which streams each
  // query head's K / V for its few rows (development EPYC, 2 threads, `dev/cpu_decode_bench.cpp`,
  // session 35: the forward took 1.11-1.43x the decode pass's time at d128 and 1.48-2.12x at d64,
  // 1 and 4 rows, GQA 32 / 8 and MHA, fp32 and bf16; at 8 rows, causal, 0.95-0.98x at d128 MHA,
  // 1.01-1.47x elsewhere; session 32 read 1.09-1.34x at 1-4 rows and 0.85-1.07x at 8).
  static constexpr int64_t kRouteMaxRows = 4;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/** Runs task(i) for i in [0, count) on the CPU backend's shared worker pool (cpu_common.hpp):
 *  up to `threads` threads (0 = all cores); an exception in a task becomes the returned Status. */
template <typename Task>
Status parallel_for(int64_t count, int threads, Task&& task) {
  return flash_detail::run_workers(count, threads, [&](flash_detail::TaskQueue& queue) {
    for (int64_t i; (i = queue.next()) >= 0;) task(i);
  });
}

/** A row of p.dtype rotated at rotary position `pos` (common/rotary.hpp), in fp32 then rounded to
 *  the dtype once, written to `dst` (p.dtype). `scratch` holds head_dim floats. */
void rotate_row(const KvCacheParams& p, const void* src, int64_t pos, void* dst, float* scratch) {
  const RotaryTables& r = p.rotary;
  const int64_t hd = p.head_dim;
  flash_detail::load_row(p.dtype, src, hd, scratch);
  for (int64_t d = 0; d < hd; ++d) {
    float x = scratch[d];
    if (d < 2 * r.half) {
      const RotaryFeature f = rotary_feature(d, r.half, r.interleaved);
      const float c = load_as_float(r.cos, pos * r.cos_row_stride + f.index, r.dtype);
      const float sn = load_as_float(r.sin, pos * r.sin_row_stride + f.index, r.dtype);
      x = rotate_feature(x, scratch[f.partner], c, sn, f.first);
    }
    store_from_float(dst, d, p.dtype, x);
  }
}

/** Writes new tokens into the caches at slots cache_seqlens[b] ... (validated in bounds), the keys
 *  rotated first when the call has rotary tables. */
void append_new_tokens(const KvCacheParams& p) {
  const int64_t hd = p.head_dim;
  const size_t elem = dtype_size(p.dtype);
  std::vector<float> scratch(static_cast<size_t>(hd));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t end = cache_end(p, b);
    for (int64_t t = 0; t < p.seqlen_new; ++t) {
      const int64_t slot = end + t;
      const int64_t page = physical_page(p, b, p.paged ? slot / p.page_size : 0);
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const TensorRef* src[] = {&p.k_new, &p.v_new};
        const TensorRef* dst[] = {&p.k_cache, &p.v_cache};
        for (int kv = 0; kv < 2; ++kv) {
          const char* from = static_cast<const char*>(src[kv]->data) + offset_of(*src[kv], b, t, h) * elem;
          char* to = static_cast<char*>(dst[kv]->data) + cache_offset(*dst[kv], p, page, slot, h) * elem;
          if (kv == 0 && p.rotary.on()) {
            rotate_row(p, from, slot, to, scratch.data());
          } else {
            std::copy(from, from + hd * elem, to);
          }
        }
      }
    }
  }
}

/** q rotated (flash_attn's positions: cache_seqlens[b] + i per token under a causal mask or a
 *  window, else cache_seqlens[b] for every token) into `rotated` (batch, seqlen_q, heads_q,
 *  head_dim) contiguous in p.dtype; returns the view the attention reads instead of p.q. */
TensorRef rotate_queries(const KvCacheParams& p, std::vector<unsigned char>& rotated) {
  const int64_t hd = p.head_dim, elem = static_cast<int64_t>(dtype_size(p.dtype));
  const TensorRef view{nullptr, p.seqlen_q * p.heads_q * hd, p.heads_q * hd, hd};
  rotated.resize(static_cast<size_t>(p.batch * view.batch_stride * elem));
  std::vector<float> scratch(static_cast<size_t>(hd));
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.seqlen_q; ++i) {
      const int64_t pos = cache_end(p, b) + (p.rotary.per_token_queries ? i : 0);
      for (int64_t h = 0; h < p.heads_q; ++h)
        rotate_row(p, flash_detail::element_ptr(p.q, p.dtype, b, i, h), pos,
                   rotated.data() + offset_of(view, b, i, h) * elem, scratch.data());
    }
  return {rotated.data(), view.batch_stride, view.row_stride, view.head_stride};
}

/** One task: the query rows of one sequence against a range of its keys, for every KV head,
 *  vectorized. A KV head's R = group x seqlen_q query rows (its GQA group) go through each key
 *  block together, keys along the SIMD lanes:
 *    S [R x n] = Q K^T       (Q pre-scaled by softmax_scale; K^T transposed from the staged rows)
 *    online softmax per row  (max, exp and sum along the lanes)
 *    acc [R x D] += P V      (V rows as staged)
 *  Query rows along the lanes instead (S^T = K Q^T, no transpose) wasted 12 of 16 lanes at a
 *  GQA group of 4 and 15 at MHA; the K^T transpose costs less than that.
 *  A key block is staged token by token, every KV head of a token at once, converted to fp32 into
 *  per-head contiguous rows: in a (batch, seqlen, heads_kv, head_dim) cache or a page that is
 *  memory order, which the hardware prefetcher streams (one core read 10-13 GB/s that way on the
 *  EPYC, 5-6 GB/s walking one head's 512-byte rows 4 KiB apart, which is what the first version
 *  of this code did). docs/PERF.md, session 9, has the measurements. */
class DecodeAttention {
 public:
  explicit DecodeAttention(const KvCacheParams& p)
      : p_(p),
        rows_(p.group_size() * p.seqlen_q),
        d_pad_(flash_detail::round_up(p.head_dim, kSimdWidth)),
        block_(block_keys(p)) {
    const int64_t heads = p.heads_kv, hd = p.head_dim, block_pad = flash_detail::round_up(block_, kSimdWidth);
    q_rows_.reserve(heads * rows_ * hd);
    k_rows_.reserve(heads * block_ * hd);
    v_rows_.reserve(heads * block_ * d_pad_);
    k_t_.reserve(hd * block_pad);
    s_.reserve(std::max<int64_t>(rows_, 1) * block_pad);
    acc_.reserve(heads * rows_ * d_pad_);
    max_.resize(static_cast<size_t>(heads * rows_));
    sum_.resize(static_cast<size_t>(heads * rows_));
  }

  /** Keys [k0, k1) of sequence b under `mask`, every KV head: leaves normalized out rows
   *  ([heads_kv][R][D]) and the natural-log lse of each row ([heads_kv][R]; -inf and out 0 where a
   *  row saw no key). */
  void attend(int64_t b, const MaskInfo& mask, int64_t k0, int64_t k1, float* out, float* lse) {
    const int64_t hd = p_.head_dim, heads = p_.heads_kv;
    b_ = b;
    load_queries(b);
    std::fill(acc_.data(), acc_.data() + heads * rows_ * d_pad_, 0.f);
    std::fill(max_.begin(), max_.end(), kNegInf);
    std::fill(sum_.begin(), sum_.end(), 0.f);
    for (int64_t j0 = k0; j0 < k1; j0 += block_) {
      const int64_t n = std::min(block_, k1 - j0), n_pad = flash_detail::round_up(n, kSimdWidth);
      stage_block(b, j0, n);
      for (int64_t hk = 0; hk < heads; ++hk) {
        // K^T [D x n_pad], zero columns past n; then S = Q K^T.
        float* k_t = k_t_.data();
        flash_detail::transpose(k_rows_.data() + hk * block_ * hd, hd, n, hd, k_t, n_pad);
        if (n_pad > n) {
          for (int64_t d = 0; d < hd; ++d) std::fill(k_t + d * n_pad + n, k_t + (d + 1) * n_pad, 0.f);
        }
        flash_detail::gemm_bcast<flash_detail::Accumulate::kOverwrite>(
            rows_, n_pad, hd, q_rows_.data() + hk * rows_ * hd, hd, 1, k_t, n_pad, s_.data(), n_pad);
        if (p_.has_alibi()) {
          softmax_block</*kAlibi=*/true>(mask, hk, j0, n, n_pad);
        } else {
          softmax_block</*kAlibi=*/false>(mask, hk, j0, n, n_pad);
        }
        // acc += P V over the n keys (P's padding columns are never read).
        flash_detail::gemm_bcast<flash_detail::Accumulate::kAdd>(rows_, d_pad_, n, s_.data(), n_pad, 1,
                                                                 v_rows_.data() + hk * block_ * d_pad_, d_pad_,
                                                                 acc_.data() + hk * rows_ * d_pad_, d_pad_);
      }
    }
    for (int64_t row = 0; row < heads * rows_; ++row) {
      const float l = sum_[row];
      lse[row] = l > 0.f ? max_[row] + std::log(l) : kNegInf;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float* acc = acc_.data() + row * d_pad_;
      for (int64_t d = 0; d < hd; ++d) out[row * hd + d] = acc[d] * inv;
    }
  }

 private:
  /** Keys per block: up to 64, fewer when staging every KV head's K and V rows of 64 keys as fp32
   *  would not stay in a core's L2 (256 KiB budget). */
  static int64_t block_keys(const KvCacheParams& p) {
    constexpr int64_t kStageBytes = 256 * 1024;
    const int64_t per_key = 2 * p.heads_kv * flash_detail::round_up(p.head_dim, kSimdWidth) * int64_t(sizeof(float));
    return std::clamp<int64_t>(kStageBytes / per_key / 8 * 8, 8, DecodeTraits::kKeyBlock);
  }

  /** The query rows of sequence b, scaled by softmax_scale, per KV head: [heads_kv][R][D]. */
  void load_queries(int64_t b) {
    const int64_t hd = p_.head_dim, group = p_.group_size();
    const QueryRows qr = query_rows(p_, b);
    for (int64_t hk = 0; hk < p_.heads_kv; ++hk) {
      for (int64_t r = 0; r < rows_; ++r) {
        const int64_t h = hk * group + r / p_.seqlen_q, i = r % p_.seqlen_q;
        float* q = q_rows_.data() + (hk * rows_ + r) * hd;
        if (i >= qr.tokens) {  // a varlen view's sequence with fewer tokens: a row never stored
          std::fill(q, q + hd, 0.f);
          continue;
        }
        flash_detail::load_row(p_.dtype, flash_detail::element_ptr(p_.q, p_.dtype, qr.batch_index, i, h), hd, q);
        for (int64_t d = 0; d < hd; ++d) q[d] *= p_.softmax_scale;
      }
    }
  }

  /** Pointer to K or V of (slot, KV head 0) in physical page `page`. */
  const char* cache_row(const TensorRef& cache, int64_t page, int64_t slot) const {
    return static_cast<const char*>(cache.data) +
           cache_offset(cache, p_, page, slot, 0) * static_cast<int64_t>(dtype_size(p_.dtype));
  }

  /** K rows [heads][n x D] and V rows [heads][n x D_pad] (zero padding columns) of keys j0.. as
   *  fp32, read token by token (see the class comment). */
  void stage_block(int64_t b, int64_t j0, int64_t n) {
    const int64_t hd = p_.head_dim, elem = static_cast<int64_t>(dtype_size(p_.dtype));
    const int64_t k_head = p_.k_cache.head_stride * elem, v_head = p_.v_cache.head_stride * elem;
    const int64_t start = cache_start(p_, b);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = start + j0 + j, page = physical_page(p_, b, p_.paged ? slot / p_.page_size : 0);
      const char* k = cache_row(p_.k_cache, page, slot);
      const char* v = cache_row(p_.v_cache, page, slot);
      for (int64_t hk = 0; hk < p_.heads_kv; ++hk) {
        flash_detail::load_row(p_.dtype, k + hk * k_head, hd, k_rows_.data() + (hk * block_ + j) * hd);
      }
      for (int64_t hk = 0; hk < p_.heads_kv; ++hk) {
        float* dst = v_rows_.data() + (hk * block_ + j) * d_pad_;
        flash_detail::load_row(p_.dtype, v + hk * v_head, hd, dst);
        std::fill(dst + hd, dst + d_pad_, 0.f);
      }
    }
  }

  /** Scores of keys j0..j0+n of KV head hk in S to probabilities, each row's running max / sum,
   *  and the rescale of its accumulator. Scores get softcap, then (kAlibi: the call has slopes)
   *  the ALiBi bias -slope * |diagonal - key|, then the mask: keys outside a row's keys_for_row
   *  (and the padding columns past n) get p = 0. ALiBi is a template argument so that calls
   *  without it keep the bias-free loop. */
  template <bool kAlibi>
  void softmax_block(const MaskInfo& mask, int64_t hk, int64_t j0, int64_t n, int64_t n_pad) {
    const bool capped = p_.softcap > 0.f;
    const Vec cap = Simd::set1(p_.softcap), inv_cap = Simd::set1(capped ? 1.f / p_.softcap : 0.f);
    const Vec neg_inf = Simd::set1(kNegInf);
    for (int64_t r = 0; r < rows_; ++r) {
      float* s = s_.data() + r * n_pad;
      // Visible keys of the row relative to the block, clamped to [0, n] (exact as floats).
      const KeyRange keys = mask.keys_for_row(r % p_.seqlen_q);
      const int64_t lo = std::clamp<int64_t>(keys.begin - j0, 0, n), hi = std::clamp<int64_t>(keys.end - j0, 0, n);
      const bool masked = lo > 0 || hi < n_pad;
      const Vec lo_v = Simd::set1(static_cast<float>(lo)), hi_v = Simd::set1(static_cast<float>(hi));
      // ALiBi: key j0 + key of the row is at distance |diagonal - key| from the row's diagonal
      // (exact as floats below 2^24 keys).
      Vec neg_slope = Simd::zero(), diagonal = Simd::zero();
      if constexpr (kAlibi) {
        const int64_t h = hk * p_.group_size() + r / p_.seqlen_q;
        neg_slope = Simd::set1(-p_.alibi_slope(b_, h));
        diagonal = Simd::set1(static_cast<float>(mask.diagonal(r % p_.seqlen_q) - j0));
      }
      Vec row_max = neg_inf;
      Vec key = Simd::iota();
      const Vec step = Simd::set1(static_cast<float>(kSimdWidth));
      for (int64_t j = 0; j < n_pad; j += kSimdWidth, key = Simd::add(key, step)) {
        Vec x = Simd::load(s + j);
        if (capped) x = Simd::mul(cap, flash_detail::vtanh(Simd::mul(x, inv_cap)));
        if constexpr (kAlibi) {
          const Vec d = Simd::sub(diagonal, key);
          x = Simd::fma(neg_slope, Simd::max(d, Simd::sub(Simd::zero(), d)), x);
        }
        if (masked) x = Simd::select(Simd::both(Simd::le(lo_v, key), Simd::lt(key, hi_v)), x, neg_inf);
        Simd::store(s + j, x);
        row_max = Simd::max(row_max, x);
      }
      alignas(64) float lanes[kSimdWidth];
      Simd::store(lanes, row_max);
      float block_max = kNegInf;
      for (int l = 0; l < kSimdWidth; ++l) block_max = std::max(block_max, lanes[l]);
      const int64_t at = hk * rows_ + r;
      const float new_max = std::max(max_[at], block_max);
      // A row that has seen no key yet keeps max -inf and subtracts 0 (never -inf - -inf).
      const float base = new_max == kNegInf ? 0.f : new_max;
      const float correction = std::exp(max_[at] - base);  // 0 while the max was -inf
      const Vec base_v = Simd::set1(base);
      Vec row_sum = Simd::zero();
      for (int64_t j = 0; j < n_pad; j += kSimdWidth) {
        const Vec prob = flash_detail::vexp_softmax(Simd::sub(Simd::load(s + j), base_v));
        Simd::store(s + j, prob);
        row_sum = Simd::add(row_sum, prob);
      }
      sum_[at] = sum_[at] * correction + Simd::reduce_add(row_sum);
      max_[at] = new_max;
      if (correction != 1.f) {
        float* acc = acc_.data() + at * d_pad_;
        const Vec c = Simd::set1(correction);
        for (int64_t d = 0; d < d_pad_; d += kSimdWidth) Simd::store(acc + d, Simd::mul(Simd::load(acc + d), c));
      }
    }
  }

  const KvCacheParams& p_;
  const int64_t rows_, d_pad_, block_;
  int64_t b_ = 0;  // the sequence attend() works on
  AlignedFloats q_rows_, k_rows_, v_rows_, k_t_, s_, acc_;
  std::vector<float> max_, sum_;  // per (KV head, row)
};

/** Combines parts (o_s normalized, lse_s) into out/lse of one row. A NaN lse poisons the row;
 *  all parts at -inf give out 0 and lse -inf. `weight` is the caller's scratch (one per task,
 *  reused across its rows): each part's share, computed once per row, and the row's sum. Parts are
 *  added one whole row at a time, in part order: a part's o is contiguous, where a walk over the
 *  parts per element strides 16 KiB (32 heads, d = 128). With that walk, and one merging thread
 *  per sequence, B = 1 x 8192 keys took 1.14-1.32 ms at 16 threads against 0.69-0.77 ms now
 *  (docs/PERF.md, CPU session 24). */
template <typename PartO, typename PartLse, typename Store>
void merge_row(int64_t parts, int64_t hd, PartO part_o, PartLse part_lse, Store store, float* lse_out,
               std::vector<float>& weight) {
  float m = kNegInf;
  bool has_nan = false;  // kept apart: a NaN in m would be replaced by the next part's lse
  for (int64_t s = 0; s < parts; ++s) {
    const float l = part_lse(s);
    has_nan = has_nan || std::isnan(l);
    m = std::max(m, l);
  }
  if (has_nan) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t d = 0; d < hd; ++d) store(d, nan);
    *lse_out = nan;
    return;
  }
  if (m == kNegInf) {
    for (int64_t d = 0; d < hd; ++d) store(d, 0.f);
    *lse_out = kNegInf;
    return;
  }
  float total = 0.f;
  for (int64_t s = 0; s < parts; ++s) total += std::exp(part_lse(s) - m);
  const float lse = m + std::log(total);
  weight.resize(static_cast<size_t>(parts + hd));
  float* x = weight.data() + parts;
  std::fill(x, x + hd, 0.f);
  for (int64_t s = 0; s < parts; ++s) {
    if (part_lse(s) == kNegInf) continue;  // its o may be anything (never read by callers that skip it)
    const float w = std::exp(part_lse(s) - lse);
    for (int64_t d = 0; d < hd; ++d) x[d] += w * part_o(s, d);
  }
  for (int64_t d = 0; d < hd; ++d) store(d, x[d]);
  *lse_out = lse;
}

/** Splits of every sequence's keys: the caller's num_splits, or enough that batch x splits
 *  reaches kTargetTasks with no split under kMinSplitKeys keys. It depends on the shapes and
 *  lengths only, never on the thread count, so results do not either. */
int decode_splits(const KvCacheParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  int64_t longest = 0;
  for (int64_t b = 0; b < p.batch; ++b) longest = std::max(longest, total_len(p, b));
  const int64_t wanted = flash_detail::ceil_div(DecodeTraits::kTargetTasks, std::max<int64_t>(1, p.batch));
  const int64_t fit = std::max<int64_t>(1, longest / DecodeTraits::kMinSplitKeys);
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, fit)));
}

/** The keys of split `sp` of a sequence (empty when the sequence has fewer chunks). */
KeyRange split_keys(const KeyRange& keys, int splits, int sp) {
  const int64_t len = std::max<int64_t>(0, keys.end - keys.begin);
  const int64_t chunk = flash_detail::ceil_div(len, splits);
  const int64_t k0 = std::min(keys.end, keys.begin + sp * chunk);
  return {k0, std::min(keys.end, k0 + chunk)};
}

/** Out rows and lse of KV head hk's query rows of sequence b from parts [splits][heads_kv][R][D] /
 *  [splits][heads_kv][R], merged in split order (one part: copied, since exp(lse - lse) = 1
 *  exactly). */
void store_head(const KvCacheParams& p, int64_t b, int64_t hk, int splits, const float* part_o, const float* part_lse) {
  const int64_t hd = p.head_dim, group = p.group_size(), rows = group * p.seqlen_q;
  const int64_t per_part = p.heads_kv * rows;
  const QueryRows qr = query_rows(p, b);
  std::vector<float> weight;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hk * group + r / p.seqlen_q, i = r % p.seqlen_q;
    if (i >= qr.tokens) continue;  // past a varlen view's tokens: no such row
    const int64_t o_off = offset_of(p.out, qr.batch_index, i, h), row = hk * rows + r;
    float lse = 0.f;
    merge_row(
        splits, hd, [&](int64_t s, int64_t d) { return part_o[(s * per_part + row) * hd + d]; },
        [&](int64_t s) { return part_lse[s * per_part + row]; },
        [&](int64_t d, float x) { store_from_float(p.out.data, o_off + d, p.dtype, x); }, &lse, weight);
    if (p.lse.data) p.lse.data[qr.batch_index * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
  }
}

/** Whether the forward takes p (after its append): enough query rows per KV head, and every
 *  sequence's keys within the int32 prefix sums of a varlen call. */
bool forward_takes(const KvCacheParams& p) {
  if (p.q_cu_seqlens != nullptr) return false;  // a varlen forward's view: kvcache_as_forward has no such q
  if (p.group_size() * p.seqlen_q < DecodeTraits::kForwardMinRows) return false;
  int64_t keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) keys += total_len(p, b);
  return keys <= INT32_MAX && p.batch * p.seqlen_q <= INT32_MAX;
}

/** p's attention on cpu_flash's forward: the host arrays of the forward view (values validated
 *  on the host, so every sequence is in bounds), then the forward writes out and lse. */
Status forward_route(const KvCacheParams& p) {
  std::vector<int32_t> cu_q(static_cast<size_t>(p.batch + 1)), cu_k(static_cast<size_t>(p.batch + 1)),
      identity(static_cast<size_t>(p.batch));
  for (int64_t b = 0; b < p.batch; ++b) {
    cu_q[static_cast<size_t>(b + 1)] = static_cast<int32_t>((b + 1) * p.seqlen_q);
    cu_k[static_cast<size_t>(b + 1)] = static_cast<int32_t>(cu_k[static_cast<size_t>(b)] + total_len(p, b));
    identity[static_cast<size_t>(b)] = static_cast<int32_t>(b);
  }
  AttentionParams f = kvcache_as_forward(p, {cu_q.data(), cu_k.data(), identity.data()});
  f.total_k = cu_k.back();
  return flash_forward(f);
}

}  // namespace

bool decode_route_suits(const KvCacheParams& p) {
  return p.group_size() * p.seqlen_q <= DecodeTraits::kRouteMaxRows;
}

Status kvcache_forward(const KvCacheParams& params) {
  KvCacheParams p = params;
  std::vector<unsigned char> rotated_q;
  if (p.rotary.on()) p.q = rotate_queries(params, rotated_q);
  if (p.appends()) append_new_tokens(p);
  if (p.batch > 0 && forward_takes(p)) return forward_route(p);
  const int splits = decode_splits(p);
  const int64_t hd = p.head_dim, per_part = p.heads_kv * p.group_size() * p.seqlen_q;
  // Every (sequence, split) is a task writing its normalized partial out and lse for all heads;
  // a second pass merges each sequence's splits in split order and writes out / lse.
  // Not value-initialized: every task writes its whole part (empty key ranges included).
  std::unique_ptr<float[]> part_o(new float[static_cast<size_t>(p.batch * splits * per_part * hd)]);
  std::unique_ptr<float[]> part_lse(new float[static_cast<size_t>(p.batch * splits * per_part)]);
  Status st = flash_detail::run_workers(p.batch * splits, p.num_threads, [&](flash_detail::TaskQueue& queue) {
    DecodeAttention work(p);  // one per worker thread: its staging buffers
    for (int64_t t; (t = queue.next()) >= 0;) {
      const int64_t b = t / splits;
      const int64_t tokens = query_rows(p, b).tokens;  // seqlen_q, or a varlen view's own count
      const MaskInfo mask = kv_mask(p, total_len(p, b), tokens);
      const KeyRange all = tokens > 0 ? mask.keys_for_rows(0, tokens) : KeyRange{0, 0};  // no query: nothing to read
      const KeyRange keys = split_keys(all, splits, static_cast<int>(t % splits));
      work.attend(b, mask, keys.begin, keys.end, &part_o[t * per_part * hd], &part_lse[t * per_part]);
    }
  });
  if (!st.is_ok()) return st;
  // One merge task per (sequence, KV head): one per sequence left B = 1 to a single thread.
  return parallel_for(p.batch * p.heads_kv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / p.heads_kv;
    store_head(p, b, task % p.heads_kv, splits, &part_o[b * splits * per_part * hd], &part_lse[b * splits * per_part]);
  });
}

Status merge_partials(const MergeParams& p) {
  return parallel_for(p.batch * p.heads, p.num_threads, [&](int64_t task) {
    const int64_t b = task / p.heads, h = task % p.heads;
    std::vector<float> weight;
    for (int64_t i = 0; i < p.seqlen_q; ++i) {
      const float* o = p.out_partials + b * p.op_batch_stride + i * p.op_row_stride + h * p.op_head_stride;
      const float* l = p.lse_partials + b * p.lp_batch_stride + h * p.lp_head_stride + i * p.lp_row_stride;
      const int64_t o_off = offset_of(p.out, b, i, h);
      float lse = 0.f;
      merge_row(
          p.parts, p.head_dim, [&](int64_t s, int64_t d) { return o[s * p.op_part_stride + d]; },
          [&](int64_t s) { return l[s * p.lp_part_stride]; },
          [&](int64_t d, float x) { store_from_float(p.out.data, o_off + d, p.out_dtype, x); }, &lse, weight);
      if (p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
    }
  });
}

}  // namespace flashcore::cpu
