// cpu_flash forward: tiled online softmax (FlashAttention-2) on the CPU, fp32 accumulation.
//
// Work split: one task per (batch, kv head, block of "stacked" rows). A stacked row is a
// (query row, query head) pair of one GQA group, ordered query-row-major, so the query heads that
// share a KV head share every K/V tile (for MHA the group has one head and this is the usual
// (batch, head, query block) split). Tasks are independent; each thread owns its tiles, so memory
// is O(tile) per thread and never seqlen_q x seqlen_k.
//
// Layout choice: every tile is kept transposed, with the stacked rows along the SIMD lanes:
//   Q^T [D x M], S^T = K Q^T [N x M], O^T += V^T P^T [D x M].
// Then K and V are only ever read by scalar broadcast in their natural row layout (fp32 inputs
// are used in place, fp16/bf16 rows are converted once per tile), the per-row softmax state
// (max, sum, rescale factor) is one vector per 16 rows, and row max / row sum are vertical
// vector ops with no horizontal reductions. Only the row dimension is padded (to the SIMD width).
//
// Relies on: cpu_common.hpp (Simd, vexp/vtanh, conversions, gemm_bcast, run_workers),
// params.hpp (seq_info, offset_of) and mask.hpp (keys_for_row(s), tile_fully_visible).
#include <algorithm>
#include <cmath>
#include <vector>

#include "api/backends.hpp"
#include "cpu/cpu_common.hpp"

namespace flashcore {
namespace cpu {
namespace {

using namespace flash_detail;

struct ForwardTraits {
  static constexpr int64_t kBlockRows = 64;  // stacked rows per task (a multiple of kSimdWidth)
  static constexpr int64_t kBlockKeys = 64;  // keys per K/V tile
  static_assert(kBlockRows % kSimdWidth == 0, "row block must fill whole vectors");
};

struct ForwardTask {
  int64_t batch;
  int64_t kv_head;
  int64_t first_row;  // first stacked row: query row first_row / group, head first_row % group
  int64_t cost;       // rows x visible keys, for longest-first scheduling
};

/** Per-thread tiles; sized once per call for the largest task. */
struct ForwardScratch {
  AlignedFloats q_t;       // [D x M]
  AlignedFloats s_t;       // [N x M] scores, then probabilities
  AlignedFloats o_t;       // [D x M] unnormalized output
  AlignedFloats k_rows;    // [N x D] converted K tile (fp16/bf16 only)
  AlignedFloats v_rows;    // [N x D] converted V tile (fp16/bf16 only)
  AlignedFloats row_buf;   // [D] one row in flight
  AlignedFloats row_max;   // [M] running max m
  AlignedFloats row_sum;   // [M] running sum l
  AlignedFloats rescale;   // [M] exp(m_old - m_new) of the current tile
  AlignedFloats key_lo;    // [M] first allowed key, relative to the current tile
  AlignedFloats key_hi;    // [M] one past the last allowed key, relative to the current tile
  std::vector<KeyRange> row_keys;  // [M] keys_for_row of each stacked row

  void reserve(int64_t head_dim) {
    const int64_t m = ForwardTraits::kBlockRows, n = ForwardTraits::kBlockKeys;
    q_t.reserve(head_dim * m);
    s_t.reserve(n * m);
    o_t.reserve(head_dim * m);
    k_rows.reserve(n * head_dim);
    v_rows.reserve(n * head_dim);
    row_buf.reserve(head_dim);
    for (AlignedFloats* a : {&row_max, &row_sum, &rescale, &key_lo, &key_hi}) a->reserve(m);
    row_keys.resize(static_cast<size_t>(m));
  }
};

/** A K or V tile as fp32 rows: the input itself for fp32, else a converted copy. */
struct RowTile {
  const float* data;
  int64_t row_stride;
};

RowTile load_kv_tile(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t first_row, int64_t rows,
                     int64_t kv_head, AlignedFloats& buffer) {
  if (p.dtype == DType::F32) {
    return {static_cast<const float*>(element_ptr(t, p.dtype, b, first_row, kv_head)), t.row_stride};
  }
  float* dst = buffer.data();
  for (int64_t r = 0; r < rows; ++r) {
    load_row(p.dtype, element_ptr(t, p.dtype, b, first_row + r, kv_head), p.head_dim, dst + r * p.head_dim);
  }
  return {dst, p.head_dim};
}

class ForwardTaskRunner {
 public:
  ForwardTaskRunner(const AttentionParams& p, ForwardScratch& scratch) : p_(p), w_(scratch) {}

  void run(const ForwardTask& task) {
    const SeqInfo seq = seq_info(p_, task.batch);
    const MaskInfo mask = mask_info(p_, seq);
    const int64_t group = p_.group_size();
    const int64_t head_dim = p_.head_dim;
    const int64_t rows = std::min(ForwardTraits::kBlockRows, group * seq.seqlen_q - task.first_row);
    const int64_t m_pad = round_up(rows, kSimdWidth);
    const int64_t first_q = task.first_row / group;
    const int64_t last_q = (task.first_row + rows - 1) / group;

    pack_queries(task, seq, rows, m_pad);
    for (int64_t r = 0; r < m_pad; ++r) {
      w_.row_keys[r] = r < rows ? mask.keys_for_row((task.first_row + r) / group) : KeyRange{0, 0};
      w_.row_max.data()[r] = kNegInf;
      w_.row_sum.data()[r] = 0.f;
    }

    const KeyRange keys = mask.keys_for_rows(first_q, last_q + 1);
    bool first_tile = true;
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += ForwardTraits::kBlockKeys) {
      const int64_t n_valid = std::min(ForwardTraits::kBlockKeys, keys.end - n0);
      const RowTile k = load_kv_tile(p_, p_.k, task.batch, seq.k_start + n0, n_valid, task.kv_head, w_.k_rows);
      // S^T[n][m] = sum_d K[n][d] * Q^T[d][m]
      gemm_bcast<Accumulate::kOverwrite>(n_valid, m_pad, head_dim, k.data, k.row_stride, 1, w_.q_t.data(), m_pad,
                                         w_.s_t.data(), m_pad);
      const bool full = mask.tile_fully_visible(first_q, last_q + 1, n0, n0 + n_valid);
      if (!full) set_relative_key_bounds(n0, m_pad);
      softmax_tile(n_valid, m_pad, full);
      const RowTile v = load_kv_tile(p_, p_.v, task.batch, seq.k_start + n0, n_valid, task.kv_head, w_.v_rows);
      // O^T[d][m] = O^T[d][m] * rescale[m] + sum_n V[n][d] * P^T[n][m]
      if (first_tile) {
        gemm_bcast<Accumulate::kOverwrite>(head_dim, m_pad, n_valid, v.data, 1, v.row_stride, w_.s_t.data(), m_pad,
                                           w_.o_t.data(), m_pad);
      } else {
        gemm_bcast<Accumulate::kScaleAdd>(head_dim, m_pad, n_valid, v.data, 1, v.row_stride, w_.s_t.data(), m_pad,
                                          w_.o_t.data(), m_pad, w_.rescale.data());
      }
      first_tile = false;
    }
    write_outputs(task, seq, rows, m_pad, /*have_accumulator=*/!first_tile);
  }

 private:
  /** Q^T[d][r] for the task's stacked rows; padding rows are zero so their scores stay finite. */
  void pack_queries(const ForwardTask& task, const SeqInfo& seq, int64_t rows, int64_t m_pad) {
    const int64_t group = p_.group_size();
    float* q_t = w_.q_t.data();
    float* row = w_.row_buf.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t stacked = task.first_row + r;
      const int64_t head = task.kv_head * group + stacked % group;
      load_row(p_.dtype, element_ptr(p_.q, p_.dtype, task.batch, seq.q_start + stacked / group, head), p_.head_dim, row);
      for (int64_t d = 0; d < p_.head_dim; ++d) q_t[d * m_pad + r] = row[d];
    }
    for (int64_t d = 0; d < p_.head_dim; ++d) {
      std::fill(q_t + d * m_pad + rows, q_t + (d + 1) * m_pad, 0.f);
    }
  }

  /** Each row's allowed keys relative to the tile at n0, clamped to small exact floats. */
  void set_relative_key_bounds(int64_t n0, int64_t m_pad) {
    const int64_t lo_clamp = -1, hi_clamp = ForwardTraits::kBlockKeys + 1;
    for (int64_t r = 0; r < m_pad; ++r) {
      const KeyRange kr = w_.row_keys[r];
      w_.key_lo.data()[r] = static_cast<float>(std::clamp(kr.begin - n0, lo_clamp, hi_clamp));
      w_.key_hi.data()[r] = static_cast<float>(std::clamp(kr.end - n0, lo_clamp, hi_clamp));
    }
  }

  /** Turns the score tile into probabilities against the updated running max, and updates
   *  (row_max, row_sum) and the rescale factor the output accumulator needs. */
  void softmax_tile(int64_t n_valid, int64_t m_pad, bool full) {
    const Vec scale = Simd::set1(p_.softmax_scale);
    const bool capped = p_.softcap > 0.f;
    const Vec cap = Simd::set1(p_.softcap);
    const Vec inv_cap = Simd::set1(capped ? 1.f / p_.softcap : 0.f);
    const Vec neg_inf = Simd::set1(kNegInf);
    float* s_t = w_.s_t.data();
    for (int64_t m = 0; m < m_pad; m += kSimdWidth) {
      const Vec lo = full ? Simd::zero() : Simd::load(w_.key_lo.data() + m);
      const Vec hi = full ? Simd::zero() : Simd::load(w_.key_hi.data() + m);
      Vec tile_max = neg_inf;
      Vec key = Simd::zero();
      const Vec one = Simd::set1(1.f);
      for (int64_t n = 0; n < n_valid; ++n, key = Simd::add(key, one)) {
        float* s = s_t + n * m_pad + m;
        Vec x = Simd::mul(Simd::load(s), scale);
        if (capped) x = Simd::mul(cap, vtanh(Simd::mul(x, inv_cap)));
        if (!full) x = Simd::select(Simd::both(Simd::le(lo, key), Simd::lt(key, hi)), x, neg_inf);
        Simd::store(s, x);
        tile_max = Simd::max(tile_max, x);
      }
      const Vec old_max = Simd::load(w_.row_max.data() + m);
      const Vec new_max = Simd::max(old_max, tile_max);
      // A row with no allowed key so far keeps max -inf; subtracting 0 instead keeps exp() at
      // exactly 0 for it rather than producing NaN from (-inf) - (-inf).
      const Vec safe_max = Simd::select(Simd::eq(new_max, neg_inf), Simd::zero(), new_max);
      const Vec alpha = vexp(Simd::sub(old_max, safe_max));
      Vec sum = Simd::zero();
      for (int64_t n = 0; n < n_valid; ++n) {
        float* s = s_t + n * m_pad + m;
        const Vec prob = vexp(Simd::sub(Simd::load(s), safe_max));
        Simd::store(s, prob);
        sum = Simd::add(sum, prob);
      }
      Simd::store(w_.row_sum.data() + m, Simd::fma(Simd::load(w_.row_sum.data() + m), alpha, sum));
      Simd::store(w_.row_max.data() + m, new_max);
      Simd::store(w_.rescale.data() + m, alpha);
    }
  }

  /** out = O / l, lse = m + log l; rows without any allowed key get 0 and -inf. */
  void write_outputs(const ForwardTask& task, const SeqInfo& seq, int64_t rows, int64_t m_pad, bool have_accumulator) {
    const int64_t group = p_.group_size();
    float* row = w_.row_buf.data();
    const float* o_t = w_.o_t.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t stacked = task.first_row + r;
      const int64_t q_row = seq.q_start + stacked / group;
      const int64_t head = task.kv_head * group + stacked % group;
      const float l = w_.row_sum.data()[r];
      const bool any = have_accumulator && l > 0.f;
      if (any) {
        const float inv_l = 1.f / l;
        for (int64_t d = 0; d < p_.head_dim; ++d) row[d] = o_t[d * m_pad + r] * inv_l;
      } else {
        std::fill(row, row + p_.head_dim, 0.f);
      }
      store_row(p_.dtype, row, p_.head_dim, element_ptr_mut(p_.out, p_.dtype, task.batch, q_row, head));
      if (p_.lse.data) {
        const int64_t off = task.batch * p_.lse.batch_stride + head * p_.lse.head_stride + q_row * p_.lse.row_stride;
        p_.lse.data[off] = any ? w_.row_max.data()[r] + std::log(l) : kNegInf;
      }
    }
  }

  const AttentionParams& p_;
  ForwardScratch& w_;
};

std::vector<ForwardTask> make_forward_tasks(const AttentionParams& p) {
  std::vector<ForwardTask> tasks;
  const int64_t group = p.group_size();
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    const MaskInfo mask = mask_info(p, seq);
    const int64_t stacked = group * seq.seqlen_q;
    for (int64_t first = 0; first < stacked; first += ForwardTraits::kBlockRows) {
      const int64_t rows = std::min(ForwardTraits::kBlockRows, stacked - first);
      const KeyRange keys = mask.keys_for_rows(first / group, (first + rows - 1) / group + 1);
      const int64_t cost = rows * (keys.end - keys.begin + 1);
      for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh) tasks.push_back({b, kvh, first, cost});
    }
  }
  // Longest first so the dynamic queue ends with short tasks (causal and varlen are uneven).
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ForwardTask& x, const ForwardTask& y) { return x.cost > y.cost; });
  return tasks;
}

}  // namespace

Status flash_forward(const AttentionParams& p) {
  std::vector<ForwardTask> tasks;
  try {
    tasks = make_forward_tasks(p);
  } catch (const std::bad_alloc&) {
    return Status::internal("cpu_flash forward: out of host memory for the task list");
  }
  return run_workers(static_cast<int64_t>(tasks.size()), p.num_threads, [&](TaskQueue& queue) {
    ForwardScratch scratch;
    scratch.reserve(p.head_dim);
    ForwardTaskRunner runner(p, scratch);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) runner.run(tasks[static_cast<size_t>(t)]);
  });
}

}  // namespace cpu
}  // namespace flashcore
