// cpu_flash backward: the work split and the GQA reduction that the AVX-512 backward
// (flash_backward.cpp) and the AMX backward (amx_backward_kernel.hpp) share.
//
// One task per (batch, query head). The task owns its query head, so dQ needs no sharing; dK / dV
// of a key block are complete when the task's loop over query rows ends. With GQA several tasks
// feed one KV head: each writes fp32 partial dK / dV for its own query head, and a second pass sums
// the group's partials in head order. Every sum therefore runs in a fixed order: results are
// bit-identical run to run and for any thread count, without locks or atomics on data.
#pragma once

#include <algorithm>
#include <vector>

#include "api/backends.hpp"
#include "cpu/cpu_common.hpp"

namespace flashcore {
namespace cpu {
namespace backward_detail {

struct BackwardTask {
  int64_t batch;
  int64_t head;  // query head
  int64_t cost;
};

/** fp32 partial dK / dV per query head, [heads_q][key row][D], used when heads_q > heads_kv. */
struct GqaPartials {
  std::vector<float> dk, dv;
  int64_t rows = 0;  // key rows per head: batch * seqlen_k (dense) or total packed keys (varlen)

  int64_t row_index(const AttentionParams& p, int64_t b, const SeqInfo& s, int64_t key) const {
    return p.is_varlen() ? s.k_start + key : b * p.seqlen_k + key;
  }
  float* dk_row(const AttentionParams& p, int64_t head, int64_t row) { return dk.data() + (head * rows + row) * p.head_dim; }
  float* dv_row(const AttentionParams& p, int64_t head, int64_t row) { return dv.data() + (head * rows + row) * p.head_dim; }
};

/** Whether any query row of [row_begin, row_end) may see a key of [key_begin, key_end): the
 *  query blocks a backward runs against a key tile. */
inline bool rows_see_keys(const MaskInfo& mask, int64_t row_begin, int64_t row_end, int64_t key_begin,
                          int64_t key_end) {
  const KeyRange keys = mask.keys_for_rows(row_begin, row_end);
  return !keys.empty() && keys.end > key_begin && keys.begin < key_end;
}

/** The tasks, heaviest first. */
std::vector<BackwardTask> make_backward_tasks(const BackwardParams& p);

/** Sums the group's fp32 partials in head order and writes dK / dV in the output dtype. */
Status reduce_gqa_partials(const BackwardParams& p, GqaPartials& partials);

/** Runs worker(queue, tasks, partials) on p.num_threads workers, where partials is null without
 *  GQA (the worker then writes dK / dV itself), then the GQA reduction. */
template <class Worker>
Status run_backward_tasks(const BackwardParams& p, Worker&& worker) {
  std::vector<BackwardTask> tasks;
  GqaPartials partials;
  const bool grouped = p.heads_q != p.heads_kv;
  try {
    tasks = make_backward_tasks(p);
    if (grouped) {
      partials.rows = p.is_varlen() ? p.cu_seqlens_k[p.batch] : p.batch * p.seqlen_k;
      const size_t count = static_cast<size_t>(p.heads_q * partials.rows * p.head_dim);
      partials.dk.resize(count);
      partials.dv.resize(count);
    }
  } catch (const std::bad_alloc&) {
    return Status::internal("cpu_flash backward: out of host memory for the task list or GQA partials");
  }
  Status st = flash_detail::run_workers(static_cast<int64_t>(tasks.size()), p.num_threads, [&](flash_detail::TaskQueue& queue) {
    worker(queue, tasks, grouped ? &partials : nullptr);
  });
  if (!st.is_ok() || !grouped) return st;
  return reduce_gqa_partials(p, partials);
}

}  // namespace backward_detail
}  // namespace cpu
}  // namespace flashcore
