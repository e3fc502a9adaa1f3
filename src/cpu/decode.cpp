// CPU backend of the inference path: append k_new/v_new into the cache (contiguous or paged), then
// attention of the few new query rows against the whole cache, optionally split over the keys
// (flash-decoding) and merged; and fc_merge_partials.
//
// One task = one (sequence, KV head): all query heads of the GQA group and all query rows are
// processed together so every cached K/V row is converted and read once per task. Keys go in
// blocks: scores for the block, one rescale of the accumulators per block (online softmax), fp32
// throughout. Relies on: kvcache_params.hpp (validated params, cache addressing, masks), the
// host dtype conversions in dtype_host.hpp, the CPU backend's worker pool in cpu_common.hpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "api/kvcache_backends.hpp"
#include "cpu/cpu_common.hpp"
#include "common/dtype_host.hpp"

namespace flashcore::cpu {
namespace {

struct DecodeTraits {
  static constexpr int64_t kKeyBlock = 64;  // keys scored per online-softmax step
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

void load_row(const void* base, int64_t off, DType dt, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = load_as_float(base, off + d, dt);
}

/** Writes new tokens into the caches at positions cache_seqlens[b] ... (validated in bounds). */
void append_new_tokens(const KvCacheParams& p) {
  const int64_t hd = p.head_dim;
  const size_t elem = dtype_size(p.dtype);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t start = cached_len(p, b);
    for (int64_t t = 0; t < p.seqlen_new; ++t) {
      const int64_t pos = start + t;
      const int64_t page = physical_page(p, b, p.paged ? pos / p.page_size : 0);
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const TensorRef* src[] = {&p.k_new, &p.v_new};
        const TensorRef* dst[] = {&p.k_cache, &p.v_cache};
        for (int kv = 0; kv < 2; ++kv) {
          const char* from = static_cast<const char*>(src[kv]->data) + offset_of(*src[kv], b, t, h) * elem;
          char* to = static_cast<char*>(dst[kv]->data) + cache_offset(*dst[kv], p, page, pos, h) * elem;
          std::copy(from, from + hd * elem, to);
        }
      }
    }
  }
}

/** Online-softmax state of the query rows of one task; row r = (head in group g, query i). */
struct RowState {
  std::vector<float> q, acc, m, l;  // q/acc: rows x hd
};

/** Attends rows of (b, hk) to keys [k0, k1) intersected with each row's mask; leaves unnormalized
 *  acc, running max m and sum l in `st`. */
void attend_keys(const KvCacheParams& p, int64_t b, int64_t hk, const MaskInfo& mask, int64_t k0, int64_t k1,
                 RowState& st) {
  const int64_t hd = p.head_dim, group = p.group_size(), rows = group * p.seqlen_q;
  constexpr int64_t kBlock = DecodeTraits::kKeyBlock;
  std::vector<float> kb(kBlock * hd), vb(kBlock * hd), s(kBlock);
  st.acc.assign(rows * hd, 0.f);
  st.m.assign(rows, kNegInf);
  st.l.assign(rows, 0.f);
  for (int64_t j0 = k0; j0 < k1; j0 += kBlock) {
    const int64_t n = std::min(kBlock, k1 - j0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = j0 + j;
      const int64_t page = physical_page(p, b, p.paged ? pos / p.page_size : 0);
      load_row(p.k_cache.data, cache_offset(p.k_cache, p, page, pos, hk), p.dtype, hd, &kb[j * hd]);
      load_row(p.v_cache.data, cache_offset(p.v_cache, p, page, pos, hk), p.dtype, hd, &vb[j * hd]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % p.seqlen_q;
      const KeyRange allowed = mask.keys_for_row(i);
      const int64_t lo = std::max(allowed.begin, j0), hi = std::min(allowed.end, j0 + n);
      if (lo >= hi) continue;
      const float* qr = &st.q[r * hd];
      float block_max = kNegInf;
      for (int64_t j = lo - j0; j < hi - j0; ++j) {
        float dot = 0.f;
        for (int64_t d = 0; d < hd; ++d) dot += qr[d] * kb[j * hd + d];
        float sc = dot * p.softmax_scale;
        if (p.softcap > 0) sc = p.softcap * std::tanh(sc / p.softcap);
        s[j] = sc;
        block_max = std::max(block_max, sc);
      }
      const float m_new = std::max(st.m[r], block_max);
      const float rescale = std::exp(st.m[r] - m_new);  // exp(-inf) = 0 on the first block
      float* acc = &st.acc[r * hd];
      for (int64_t d = 0; d < hd; ++d) acc[d] *= rescale;
      float sum = 0.f;
      for (int64_t j = lo - j0; j < hi - j0; ++j) {
        const float pj = std::exp(s[j] - m_new);
        sum += pj;
        for (int64_t d = 0; d < hd; ++d) acc[d] += pj * vb[j * hd + d];
      }
      st.l[r] = st.l[r] * rescale + sum;
      st.m[r] = m_new;
    }
  }
}

/** Combines parts (o_s normalized, lse_s) into out/lse of one row. A NaN lse poisons the row;
 *  all parts at -inf give out 0 and lse -inf. */
template <typename PartO, typename PartLse, typename Store>
void merge_row(int64_t parts, int64_t hd, PartO part_o, PartLse part_lse, Store store, float* lse_out) {
  float m = kNegInf;
  for (int64_t s = 0; s < parts; ++s) {
    const float l = part_lse(s);
    if (!(l <= m)) m = l;  // NaN propagates into m
  }
  if (m == kNegInf) {
    for (int64_t d = 0; d < hd; ++d) store(d, 0.f);
    *lse_out = kNegInf;
    return;
  }
  float total = 0.f;
  for (int64_t s = 0; s < parts; ++s) total += std::exp(part_lse(s) - m);
  const float lse = m + std::log(total);
  for (int64_t d = 0; d < hd; ++d) {
    float x = 0.f;
    for (int64_t s = 0; s < parts; ++s) {
      const float l = part_lse(s);
      if (l == kNegInf) continue;  // its o may be anything (never read by callers that skip it)
      x += std::exp(l - lse) * part_o(s, d);
    }
    store(d, x);
  }
  *lse_out = lse;
}

void attend_task(const KvCacheParams& p, int64_t b, int64_t hk, int num_splits) {
  const int64_t hd = p.head_dim, group = p.group_size(), rows = group * p.seqlen_q;
  const MaskInfo mask = kv_mask(p, total_len(p, b));
  const KeyRange keys = mask.keys_for_rows(0, p.seqlen_q);
  RowState st;
  st.q.resize(rows * hd);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hk * group + r / p.seqlen_q, i = r % p.seqlen_q;
    load_row(p.q.data, offset_of(p.q, b, i, h), p.dtype, hd, &st.q[r * hd]);
  }
  // Per split: normalized partial out (rows x hd) and lse (rows).
  const int64_t len = std::max<int64_t>(0, keys.end - keys.begin);
  const int64_t chunk = (len + num_splits - 1) / num_splits;
  std::vector<float> part_o(static_cast<size_t>(num_splits * rows * hd)), part_lse(num_splits * rows);
  for (int sp = 0; sp < num_splits; ++sp) {
    const int64_t k0 = keys.begin + sp * chunk, k1 = std::min(keys.end, k0 + chunk);
    attend_keys(p, b, hk, mask, k0, std::max(k0, k1), st);
    for (int64_t r = 0; r < rows; ++r) {
      const float l = st.l[r];
      part_lse[sp * rows + r] = l > 0 ? st.m[r] + std::log(l) : kNegInf;
      for (int64_t d = 0; d < hd; ++d) part_o[(sp * rows + r) * hd + d] = l > 0 ? st.acc[r * hd + d] / l : 0.f;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = hk * group + r / p.seqlen_q, i = r % p.seqlen_q;
    const int64_t o_off = offset_of(p.out, b, i, h);
    float lse = 0.f;
    merge_row(
        num_splits, hd, [&](int64_t s, int64_t d) { return part_o[(s * rows + r) * hd + d]; },
        [&](int64_t s) { return part_lse[s * rows + r]; },
        [&](int64_t d, float x) { store_from_float(p.out.data, o_off + d, p.dtype, x); }, &lse);
    if (p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
  }
}

}  // namespace

Status kvcache_forward(const KvCacheParams& p) {
  if (p.appends()) append_new_tokens(p);
  const int num_splits = std::max(1, p.num_splits);  // the CPU heuristic: one pass per task
  return parallel_for(p.batch * p.heads_kv, p.num_threads,
                      [&](int64_t task) { attend_task(p, task / p.heads_kv, task % p.heads_kv, num_splits); });
}

Status merge_partials(const MergeParams& p) {
  return parallel_for(p.batch * p.heads, p.num_threads, [&](int64_t task) {
    const int64_t b = task / p.heads, h = task % p.heads;
    for (int64_t i = 0; i < p.seqlen_q; ++i) {
      const float* o = p.out_partials + b * p.op_batch_stride + i * p.op_row_stride + h * p.op_head_stride;
      const float* l = p.lse_partials + b * p.lp_batch_stride + h * p.lp_head_stride + i * p.lp_row_stride;
      const int64_t o_off = offset_of(p.out, b, i, h);
      float lse = 0.f;
      merge_row(
          p.parts, p.head_dim, [&](int64_t s, int64_t d) { return o[s * p.op_part_stride + d]; },
          [&](int64_t s) { return l[s * p.lp_part_stride]; },
          [&](int64_t d, float x) { store_from_float(p.out.data, o_off + d, p.out_dtype, x); }, &lse);
      if (p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
    }
  });
}

}  // namespace flashcore::cpu
