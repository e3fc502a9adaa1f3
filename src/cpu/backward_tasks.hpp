// cpu_flash backward: the work split and the reductions that the AVX-512 backward
// (flash_backward.cpp) and the AMX backward (amx_backward_kernel.hpp) share.
//
// Tasks. A task is one (batch, query head) and a range of that sequence's keys. It owns dK / dV of
// its keys (complete when its loop over query rows ends) and computes dQ of the query rows that
// can see any of them. Where B x H is small a head's keys fall into chunks (key_split.hpp, from
// the shapes alone), and the head runs as one task per chunk (dQ through fp32 partials and a
// second pass) or as one task that folds its chunks (BackwardPlan). Why: the backward used to
// run one task per (batch, head), so B x H = 16 tasks met 16 threads with nothing to balance a
// slow core (docs/PERF.md, CPU session 24).
//
// With GQA several tasks feed one KV head: each writes fp32 partial dK / dV for its own query
// head, and a second pass sums the group's partials in head order.
//
// Every sum runs in an order fixed by the shapes (dQ chunk by chunk in chunk order, GQA partials
// in head order) whichever way a head runs: results are bit-identical run to run and for any
// thread count, without locks or atomics on data.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

#include "api/backends.hpp"
#include "cpu/cpu_common.hpp"
#include "cpu/key_split.hpp"

namespace flashcore {
namespace cpu {
namespace backward_detail {

struct BackwardTask {
  int64_t batch;
  int64_t head;                // query head
  int64_t chunk;               // its first key chunk's index within the head
  int64_t key_begin, key_end;  // the task's keys
  int64_t row_begin, row_end;  // its query rows: all of the head's for a whole head, else the
                               // KeySplit::kRowAlign blocks that can see its keys
  int64_t fold_keys;           // a whole head of several chunks: dQ summed chunk by chunk, every
                               // fold_keys keys (0: one chunk, nothing to fold)
  int64_t dq_offset;           // a task of one chunk of a split head: where its rows start in DqPartials
  int64_t cost;

  int64_t rows() const { return row_end - row_begin; }
};

/** Each task's unscaled fp32 dQ, [row_end - row_begin][head_dim] at its dq_offset, when heads run
 *  as one task per key chunk. */
struct DqPartials {
  // Not zeroed: every task writes all of its rows. Each worker first touches the pages of its own
  // tasks, so a fresh allocation's page faults spread over the threads (zeroing it on one thread
  // cost more than the split gained: docs/PERF.md, CPU session 24).
  flash_detail::AlignedFloats data;
  float* rows_of(const BackwardTask& t) { return data.data() + t.dq_offset; }
  const float* rows_of(const BackwardTask& t) const { return data.data() + t.dq_offset; }
};

/** The tasks of a call. A head of several key chunks (KeySplit) runs either as one task per chunk
 *  (split_heads: dQ through DqPartials and reduce_dq_partials) or as one task that sums its dQ
 *  chunk by chunk (fold_keys). Both sum every dQ row as ((0 + chunk 0) + chunk 1) + ..., each
 *  chunk's part from zero over its key tiles in order, so they give the same bits and the choice
 *  may follow the thread count: split where whole heads would leave threads short of tasks, whole
 *  where a chunk's repeated loads of its query rows would cost more than the balance gains. */
struct BackwardPlan {
  std::vector<BackwardTask> tasks;  // heaviest first
  bool split_heads = false;
  int64_t dq_floats = 0;            // of the DqPartials (split_heads)
};

/** may_fold: whether the kernel sums a whole head's dQ chunk by chunk (else heads of several
 *  chunks always split). */
BackwardPlan plan_backward(const BackwardParams& p, const KeySplit& split, bool may_fold);

/** fp32 partial dK / dV per query head, [heads_q][key row][D], used when heads_q > heads_kv. */
struct GqaPartials {
  flash_detail::AlignedFloats dk, dv;  // not zeroed (see DqPartials): tasks write every key row
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

/** Where a task's time goes, for dev/cpu_backward_sweep.cpp's PHASES=1: both backwards call
 *  PhaseTimer::lap(phase) at the end of each phase, and run_backward_tasks charges the reductions
 *  after the tasks, all threads' time from `start` on (the shipped NoBackwardTimer compiles every
 *  lap and charge away). */
enum class BackwardPhase {
  kBetweenTasks, kPackHead, kPackKeys, kScores, kSoftmax, kKeyGrads, kQueryGrads, kWrite, kReductions, kCount
};
struct NoBackwardTimer {
  static void lap(BackwardPhase) {}
  static std::chrono::steady_clock::time_point now() { return {}; }  // no clock read when untimed
  static void charge(BackwardPhase, std::chrono::steady_clock::time_point /*start*/, int /*threads*/) {}
};

/** Where a task's results go besides the outputs themselves (null: straight to the outputs). */
struct TaskSinks {
  GqaPartials* gqa = nullptr;  // dK / dV per query head (GQA)
  DqPartials* dq = nullptr;    // dQ per task (several key chunks per head)
};

/** Sums the group's fp32 partials in head order and writes dK / dV in the output dtype. */
Status reduce_gqa_partials(const BackwardParams& p, GqaPartials& partials);

/** Sums each row's chunks in chunk order and writes dQ (times softmax_scale) in the output dtype;
 *  rows that no chunk computed get 0. */
Status reduce_dq_partials(const BackwardParams& p, const KeySplit& split, const std::vector<BackwardTask>& tasks,
                          const DqPartials& partials);

/** Runs worker(queue, tasks, sinks) on p.num_threads workers, then the reductions the sinks need. */
template <class PhaseTimer, class Worker>
Status run_backward_tasks(const BackwardParams& p, const KeySplit& split, bool may_fold, Worker&& worker) {
  BackwardPlan plan;
  GqaPartials gqa;
  DqPartials dq;
  const bool grouped = p.heads_q != p.heads_kv;
  try {
    plan = plan_backward(p, split, may_fold);
    if (plan.split_heads) dq.data.reserve(plan.dq_floats);
    if (grouped) {
      gqa.rows = p.is_varlen() ? p.cu_seqlens_k[p.batch] : p.batch * p.seqlen_k;
      gqa.dk.reserve(p.heads_q * gqa.rows * p.head_dim);
      gqa.dv.reserve(p.heads_q * gqa.rows * p.head_dim);
    }
  } catch (const std::bad_alloc&) {
    return Status::internal("cpu_flash backward: out of host memory for the task list or the dQ / GQA partials");
  }
  const TaskSinks sinks{grouped ? &gqa : nullptr, plan.split_heads ? &dq : nullptr};
  const std::vector<BackwardTask>& tasks = plan.tasks;
  Status st = flash_detail::run_workers(static_cast<int64_t>(tasks.size()), p.num_threads, [&](flash_detail::TaskQueue& queue) {
    worker(queue, tasks, sinks);
  });
  const auto reductions = PhaseTimer::now();
  if (st.is_ok() && sinks.dq) st = reduce_dq_partials(p, split, tasks, dq);
  if (st.is_ok() && sinks.gqa) st = reduce_gqa_partials(p, gqa);
  PhaseTimer::charge(BackwardPhase::kReductions, reductions, flash_detail::resolve_thread_count(p.num_threads));
  return st;
}

}  // namespace backward_detail
}  // namespace cpu
}  // namespace flashcore
