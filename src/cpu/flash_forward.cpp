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

/** Walks the stacked rows of a task: (query row within the sequence, query head). Stepping
 *  instead of dividing keeps 64-bit divisions out of the per-row loops. */
struct StackedRow {
  int64_t q_row;
  int64_t head;

  static StackedRow first_of(const ForwardTask& task, int64_t group) {
    return {task.first_row / group, task.kv_head * group + task.first_row % group};
  }
  void advance(int64_t group, int64_t kv_head) {
    if (++head == (kv_head + 1) * group) {
      head = kv_head * group;
      ++q_row;
    }
  }
};

/** Per-thread tiles; sized once per call for the largest task. */
struct ForwardScratch {
  AlignedFloats q_t;       // [D x M]
  AlignedFloats s_t;       // [N x M] scores, then probabilities
  AlignedFloats o_t;       // [D x M] unnormalized output
  AlignedFloats k_rows;    // [N x D] converted K tile (fp16/bf16 only)
  AlignedFloats v_rows;    // [N x D] converted V tile (fp16/bf16 only)
  AlignedFloats stage;     // [M x D] rows on their way into Q^T or out of O^T
  AlignedFloats row_max;   // [M] running max m
  AlignedFloats row_sum;   // [M] running sum l
  AlignedFloats rescale;   // [M] exp(m_old - m_new) of the current tile
  AlignedFloats tile_max;  // [M] max score of each row in the current tile
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
    stage.reserve(m * head_dim);
    for (AlignedFloats* a : {&row_max, &row_sum, &rescale, &tile_max, &key_lo, &key_hi}) a->reserve(m);
    row_keys.resize(static_cast<size_t>(m));
  }
};

/** A K or V tile as fp32 rows: the input itself for fp32 (copying it was measured slower: the
 *  micro-kernel only broadcasts from these rows), else a converted copy [rows x D]. */
struct RowTile {
  const float* data;
  int64_t row_stride;
};

RowTile load_kv_tile(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t first_row, int64_t rows,
                     int64_t kv_head, float* buffer) {
  if (p.dtype == DType::F32) {
    return {static_cast<const float*>(element_ptr(t, p.dtype, b, first_row, kv_head)), t.row_stride};
  }
  for (int64_t r = 0; r < rows; ++r) {
    load_row(p.dtype, element_ptr(t, p.dtype, b, first_row + r, kv_head), p.head_dim, buffer + r * p.head_dim);
  }
  return {buffer, p.head_dim};
}

void prefetch_kv_tile(const AttentionParams& p, int64_t b, int64_t first_row, int64_t rows, int64_t kv_head) {
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  prefetch_rows(element_ptr(p.k, p.dtype, b, first_row, kv_head), rows, p.k.row_stride * elem, p.head_dim * elem);
  prefetch_rows(element_ptr(p.v, p.dtype, b, first_row, kv_head), rows, p.v.row_stride * elem, p.head_dim * elem);
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
    StackedRow at = StackedRow::first_of(task, group);
    for (int64_t r = 0; r < m_pad; ++r, at.advance(group, task.kv_head)) {
      w_.row_keys[r] = r < rows ? mask.keys_for_row(at.q_row) : KeyRange{0, 0};
      w_.row_max.data()[r] = kNegInf;
      w_.row_sum.data()[r] = 0.f;
    }

    const KeyRange keys = mask.keys_for_rows(first_q, last_q + 1);
    constexpr int64_t kN = ForwardTraits::kBlockKeys;
    // Converted tiles are read row by row; prefetching the next tile hides those misses. (For
    // fp32, read in place by the micro-kernel, the hardware prefetcher did better on its own.)
    const bool convert = p_.dtype != DType::F32;
    if (convert && !keys.empty()) {
      prefetch_kv_tile(p_, task.batch, seq.k_start + keys.begin, std::min(kN, keys.end - keys.begin), task.kv_head);
    }
    bool first_tile = true;
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += kN) {
      const int64_t n_valid = std::min(kN, keys.end - n0);
      const RowTile k = load_kv_tile(p_, p_.k, task.batch, seq.k_start + n0, n_valid, task.kv_head, w_.k_rows.data());
      const RowTile v = load_kv_tile(p_, p_.v, task.batch, seq.k_start + n0, n_valid, task.kv_head, w_.v_rows.data());
      if (convert && n0 + kN < keys.end) {
        prefetch_kv_tile(p_, task.batch, seq.k_start + n0 + kN, std::min(kN, keys.end - n0 - kN), task.kv_head);
      }
      // S^T[n][m] = sum_d K[n][d] * Q^T[d][m]; on unmasked, uncapped tiles the GEMM also
      // produces each row's max, sparing the softmax a pass over the tile.
      const bool full = mask.tile_fully_visible(first_q, last_q + 1, n0, n0 + n_valid);
      const bool plain = full && p_.softcap <= 0.f;
      if (plain) {
        std::fill(w_.tile_max.data(), w_.tile_max.data() + m_pad, kNegInf);
        gemm_bcast<Accumulate::kOverwriteMax>(n_valid, m_pad, head_dim, k.data, k.row_stride, 1, w_.q_t.data(),
                                              m_pad, w_.s_t.data(), m_pad, w_.tile_max.data());
      } else {
        gemm_bcast<Accumulate::kOverwrite>(n_valid, m_pad, head_dim, k.data, k.row_stride, 1, w_.q_t.data(), m_pad,
                                           w_.s_t.data(), m_pad);
      }
      if (!full) set_relative_key_bounds(n0, m_pad);
      softmax_tile(n_valid, m_pad, full, plain);
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

  /** Starts the cache misses of a task's query rows (read) and output rows (written at its end).
   *  Rows of one head are usually 4 KiB apart, which the hardware prefetcher does not follow;
   *  issued one task ahead, the misses overlap with this task's compute. */
  void prefetch_task_rows(const ForwardTask& task) const {
    const SeqInfo seq = seq_info(p_, task.batch);
    const int64_t group = p_.group_size();
    const int64_t rows = std::min(ForwardTraits::kBlockRows, group * seq.seqlen_q - task.first_row);
    const int64_t row_bytes = p_.head_dim * static_cast<int64_t>(dtype_size(p_.dtype));
    StackedRow at = StackedRow::first_of(task, group);
    for (int64_t r = 0; r < rows; ++r, at.advance(group, task.kv_head)) {
      const int64_t q_row = seq.q_start + at.q_row;
      prefetch_rows(element_ptr(p_.q, p_.dtype, task.batch, q_row, at.head), 1, 0, row_bytes);
      prefetch_rows(element_ptr(p_.out, p_.dtype, task.batch, q_row, at.head), 1, 0, row_bytes, /*for_write=*/true);
    }
  }

 private:
  /** Q^T[d][r] * softmax_scale for the task's stacked rows (scaling Q once spares a multiply
   *  per score); padding rows are zero so their scores stay finite. */
  void pack_queries(const ForwardTask& task, const SeqInfo& seq, int64_t rows, int64_t m_pad) {
    const int64_t group = p_.group_size(), head_dim = p_.head_dim;
    const float scale = p_.softmax_scale;
    float* stage = w_.stage.data();  // row-major [m_pad x D]
    StackedRow at = StackedRow::first_of(task, group);
    for (int64_t r = 0; r < rows; ++r, at.advance(group, task.kv_head)) {
      float* row = stage + r * head_dim;
      load_row(p_.dtype, element_ptr(p_.q, p_.dtype, task.batch, seq.q_start + at.q_row, at.head), head_dim, row);
      for (int64_t d = 0; d < head_dim; ++d) row[d] *= scale;
    }
    std::fill(stage + rows * head_dim, stage + m_pad * head_dim, 0.f);
    transpose(stage, head_dim, m_pad, head_dim, w_.q_t.data(), m_pad);
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
  void softmax_tile(int64_t n_valid, int64_t m_pad, bool full, bool plain) {
    const bool capped = p_.softcap > 0.f;
    const Vec cap = Simd::set1(p_.softcap);
    const Vec inv_cap = Simd::set1(capped ? 1.f / p_.softcap : 0.f);
    const Vec neg_inf = Simd::set1(kNegInf);
    const Vec one = Simd::set1(1.f);
    float* s_t = w_.s_t.data();
    for (int64_t m = 0; m < m_pad; m += kSimdWidth) {
      Vec tile_max = neg_inf;
      if (plain) {  // the common case: scores are final and the GEMM found their max
        tile_max = Simd::load(w_.tile_max.data() + m);
      } else {
        const Vec lo = full ? Simd::zero() : Simd::load(w_.key_lo.data() + m);
        const Vec hi = full ? Simd::zero() : Simd::load(w_.key_hi.data() + m);
        Vec key = Simd::zero();
        for (int64_t n = 0; n < n_valid; ++n, key = Simd::add(key, one)) {
          float* s = s_t + n * m_pad + m;
          Vec x = Simd::load(s);
          if (capped) x = Simd::mul(cap, vtanh(Simd::mul(x, inv_cap)));
          if (!full) x = Simd::select(Simd::both(Simd::le(lo, key), Simd::lt(key, hi)), x, neg_inf);
          Simd::store(s, x);
          tile_max = Simd::max(tile_max, x);
        }
      }
      const Vec old_max = Simd::load(w_.row_max.data() + m);
      const Vec new_max = Simd::max(old_max, tile_max);
      // A row with no allowed key so far keeps max -inf; subtracting 0 instead keeps exp() at
      // exactly 0 for it rather than producing NaN from (-inf) - (-inf).
      const Vec safe_max = Simd::select(Simd::eq(new_max, neg_inf), Simd::zero(), new_max);
      const Vec alpha = vexp_softmax(Simd::sub(old_max, safe_max));
      Vec sum = Simd::zero();
      for (int64_t n = 0; n < n_valid; ++n) {
        float* s = s_t + n * m_pad + m;
        const Vec prob = vexp_softmax(Simd::sub(Simd::load(s), safe_max));
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
    const int64_t group = p_.group_size(), head_dim = p_.head_dim;
    float* stage = w_.stage.data();  // row-major [m_pad x D]
    if (have_accumulator) transpose(w_.o_t.data(), m_pad, head_dim, m_pad, stage, head_dim);
    StackedRow at = StackedRow::first_of(task, group);
    for (int64_t r = 0; r < rows; ++r, at.advance(group, task.kv_head)) {
      const int64_t q_row = seq.q_start + at.q_row;
      const int64_t head = at.head;
      const float l = w_.row_sum.data()[r];
      const bool any = have_accumulator && l > 0.f;
      float* row = stage + r * head_dim;
      const float inv_l = any ? 1.f / l : 0.f;
      if (any) {
        for (int64_t d = 0; d < head_dim; ++d) row[d] *= inv_l;
      } else {
        std::fill(row, row + head_dim, 0.f);
      }
      store_row(p_.dtype, row, head_dim, element_ptr_mut(p_.out, p_.dtype, task.batch, q_row, head));
      if (p_.lse.data) {
        const int64_t off = task.batch * p_.lse.batch_stride + head * p_.lse.head_stride + q_row * p_.lse.row_stride;
        p_.lse.data[off] = any ? w_.row_max.data()[r] + std::log(l) : kNegInf;
      }
    }
  }

  const AttentionParams& p_;
  ForwardScratch& w_;
};

/** Task order: the blocks of one (batch, kv head) stay adjacent, so threads working side by side
 *  share that head's K/V in cache (interleaving heads was measured ~30% slower on causal calls);
 *  heads with more work go first, and inside a head the longest blocks go first, so the queue
 *  ends on short tasks and the threads finish together. */
std::vector<ForwardTask> make_forward_tasks(const AttentionParams& p) {
  struct Head {
    size_t first_task, task_count;
    int64_t cost;
  };
  std::vector<ForwardTask> tasks;
  std::vector<Head> heads;
  const int64_t group = p.group_size();
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    const MaskInfo mask = mask_info(p, seq);
    const int64_t stacked = group * seq.seqlen_q;
    for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh) {
      Head head{tasks.size(), 0, 0};
      for (int64_t first = 0; first < stacked; first += ForwardTraits::kBlockRows) {
        const int64_t rows = std::min(ForwardTraits::kBlockRows, stacked - first);
        const KeyRange keys = mask.keys_for_rows(first / group, (first + rows - 1) / group + 1);
        const int64_t cost = rows * (keys.end - keys.begin + 1);
        tasks.push_back({b, kvh, first, cost});
        head.cost += cost;
      }
      head.task_count = tasks.size() - head.first_task;
      std::stable_sort(tasks.begin() + static_cast<std::ptrdiff_t>(head.first_task), tasks.end(),
                       [](const ForwardTask& x, const ForwardTask& y) { return x.cost > y.cost; });
      if (head.task_count) heads.push_back(head);
    }
  }
  std::stable_sort(heads.begin(), heads.end(), [](const Head& x, const Head& y) { return x.cost > y.cost; });
  std::vector<ForwardTask> ordered;
  ordered.reserve(tasks.size());
  for (const Head& h : heads) {
    ordered.insert(ordered.end(), tasks.begin() + static_cast<std::ptrdiff_t>(h.first_task),
                   tasks.begin() + static_cast<std::ptrdiff_t>(h.first_task + h.task_count));
  }
  return ordered;
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
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) {
      const int64_t ahead = t + queue.workers();
      if (ahead < queue.size()) runner.prefetch_task_rows(tasks[static_cast<size_t>(ahead)]);
      runner.run(tasks[static_cast<size_t>(t)]);
    }
  });
}

}  // namespace cpu
}  // namespace flashcore
