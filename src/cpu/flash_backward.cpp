// cpu_flash backward: the entry point, and what both backwards share from backward_tasks.hpp and
// key_split.hpp (the key split, the task plan, the dQ and GQA reductions). The AVX-512 kernel is
// flash_backward_kernel.hpp; on CPUs with AMX, fp16 / bf16 take the AMX backward instead
// (amx_backward_kernel.hpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "api/backends.hpp"
#include "common/env_switch.hpp"
#include "cpu/amx.hpp"
#include "cpu/backward_tasks.hpp"
#include "cpu/cpu_common.hpp"
#include "cpu/flash_backward_kernel.hpp"

namespace flashcore {
namespace cpu {
namespace {

// Shortest key chunk of a split head in the AVX-512 backward (backward_tasks.hpp): a chunk
// repeats the loads of its query rows, cheap next to the fp32 GEMMs over 256 keys.
constexpr int64_t kAvxMinChunkKeys = 256;
constexpr int64_t kReduceRows = 256;  // key rows per task of the GQA reduction pass

}  // namespace

namespace backward_detail {

using namespace flash_detail;

KeySplit choose_key_split(const BackwardParams& p, int64_t min_chunk_keys, int64_t tasks_wanted) {
  // Chunks enough for tasks_wanted tasks where B x H makes fewer. A head run as chunk tasks
  // repeats the pass over its query rows (loads, packs) per chunk and adds the dQ reduction
  // (plan_backward decides whether it does).
  constexpr int64_t kMaxChunks = 8;
  constexpr int64_t kMaxPartialFloats = int64_t{1} << 26;  // 256 MiB of dQ partials at most
  KeySplit split;
  if (min_chunk_keys <= 0) return split;
  int64_t heads = 0, max_seqlen_k = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    if (seq.seqlen_q > 0 && seq.seqlen_k > 0) heads += p.heads_q;
    max_seqlen_k = std::max(max_seqlen_k, seq.seqlen_k);
  }
  if (heads == 0) return split;
  int64_t chunks = std::min({ceil_div(tasks_wanted, heads), kMaxChunks, max_seqlen_k / min_chunk_keys});
  const int64_t dq_floats = (p.is_varlen() ? p.cu_seqlens_q[p.batch] : p.batch * p.seqlen_q) * p.heads_q * p.head_dim;
  while (chunks > 1 && chunks * dq_floats > kMaxPartialFloats) --chunks;
  split.chunks = std::max<int64_t>(chunks, 1);
  return split;
}

int64_t min_chunk_keys_or_env(int64_t shipped) { return env_count("FLASHCORE_CPU_CHUNK_KEYS", shipped); }

BackwardPlan plan_backward(const BackwardParams& p, const KeySplit& split, bool may_fold) {
  // Heads split where whole heads would give fewer than 4 tasks per thread.
  constexpr int64_t kWholeHeadsPerThread = 4;
  BackwardPlan plan;
  int64_t heads = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    if (seq.seqlen_q > 0 || seq.seqlen_k > 0) heads += p.heads_q;
  }
  plan.split_heads = split.chunks > 1 &&
                     (!may_fold || heads < kWholeHeadsPerThread * resolve_thread_count(p.num_threads));
  std::vector<BackwardTask>& tasks = plan.tasks;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    if (seq.seqlen_q == 0 && seq.seqlen_k == 0) continue;
    const int64_t chunk_keys = split.chunk_keys(seq.seqlen_k);
    if (!plan.split_heads) {
      const int64_t cost = (seq.seqlen_q + 1) * (seq.seqlen_k + 1);
      const int64_t fold = split.chunks > 1 && seq.seqlen_k > chunk_keys ? chunk_keys : 0;
      for (int64_t h = 0; h < p.heads_q; ++h) tasks.push_back({b, h, 0, 0, seq.seqlen_k, 0, seq.seqlen_q, fold, 0, cost});
      continue;
    }
    const MaskInfo mask = mask_info(p, seq);
    for (int64_t c = 0; c * chunk_keys < seq.seqlen_k; ++c) {
      const int64_t key_begin = c * chunk_keys, key_end = std::min(seq.seqlen_k, key_begin + chunk_keys);
      int64_t row_begin = 0, row_end = 0;  // the blocks of rows that see any of the keys
      for (int64_t r0 = 0; r0 < seq.seqlen_q; r0 += KeySplit::kRowAlign) {
        const int64_t r1 = std::min(seq.seqlen_q, r0 + KeySplit::kRowAlign);
        if (!rows_see_keys(mask, r0, r1, key_begin, key_end)) continue;
        if (row_end == 0) row_begin = r0;
        row_end = r1;
      }
      const int64_t cost = (row_end - row_begin + 1) * (key_end - key_begin + 1);
      for (int64_t h = 0; h < p.heads_q; ++h) {
        tasks.push_back({b, h, c, key_begin, key_end, row_begin, row_end, 0, plan.dq_floats, cost});
        plan.dq_floats += (row_end - row_begin) * p.head_dim;
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const BackwardTask& x, const BackwardTask& y) { return x.cost > y.cost; });
  return plan;
}

Status reduce_dq_partials(const BackwardParams& p, const KeySplit& split, const std::vector<BackwardTask>& tasks,
                          const DqPartials& partials) {
  constexpr int64_t kRows = 256;  // rows per reduction task
  const int64_t chunks = split.chunks, head_dim = p.head_dim;
  std::vector<const BackwardTask*> by_chunk;  // [batch][head][chunk], null where a chunk is empty
  struct ReduceTask { int64_t batch, head, first_row; };
  std::vector<ReduceTask> work;
  try {
    by_chunk.assign(static_cast<size_t>(p.batch * p.heads_q * chunks), nullptr);
    for (const BackwardTask& t : tasks) by_chunk[static_cast<size_t>((t.batch * p.heads_q + t.head) * chunks + t.chunk)] = &t;
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqInfo seq = seq_info(p, b);
      for (int64_t h = 0; h < p.heads_q; ++h)
        for (int64_t r0 = 0; r0 < seq.seqlen_q; r0 += kRows) work.push_back({b, h, r0});
    }
  } catch (const std::bad_alloc&) {
    return Status::internal("cpu_flash backward: out of host memory for the dQ reduction");
  }
  return run_workers(static_cast<int64_t>(work.size()), p.num_threads, [&](TaskQueue& queue) {
    AlignedFloats acc_buf;
    float* acc = acc_buf.reserve(head_dim);
    for (int64_t w = queue.next(); w >= 0; w = queue.next()) {
      const ReduceTask& rt = work[static_cast<size_t>(w)];
      const SeqInfo seq = seq_info(p, rt.batch);
      const BackwardTask* const* head_chunks = by_chunk.data() + (rt.batch * p.heads_q + rt.head) * chunks;
      for (int64_t i = rt.first_row; i < std::min(seq.seqlen_q, rt.first_row + kRows); ++i) {
        std::fill(acc, acc + head_dim, 0.f);
        for (int64_t c = 0; c < chunks; ++c) {
          const BackwardTask* t = head_chunks[c];
          if (!t || i < t->row_begin || i >= t->row_end) continue;
          const float* part = partials.rows_of(*t) + (i - t->row_begin) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += part[d];
        }
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= p.softmax_scale;
        store_row(p.dtype, acc, head_dim, element_ptr_mut(p.dq, p.dtype, rt.batch, seq.q_start + i, rt.head));
      }
    }
  });
}

Status reduce_gqa_partials(const BackwardParams& p, GqaPartials& partials) {
  struct ReduceTask { int64_t batch, kv_head, first_key; };
  std::vector<ReduceTask> tasks;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh)
      for (int64_t k0 = 0; k0 < seq.seqlen_k; k0 += kReduceRows) tasks.push_back({b, kvh, k0});
  }
  const int64_t group = p.group_size(), head_dim = p.head_dim;
  return run_workers(static_cast<int64_t>(tasks.size()), p.num_threads, [&](TaskQueue& queue) {
    AlignedFloats dk_buf, dv_buf;
    float* dk = dk_buf.reserve(head_dim);
    float* dv = dv_buf.reserve(head_dim);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) {
      const ReduceTask& task = tasks[static_cast<size_t>(t)];
      const SeqInfo seq = seq_info(p, task.batch);
      const int64_t end = std::min(seq.seqlen_k, task.first_key + kReduceRows);
      for (int64_t key = task.first_key; key < end; ++key) {
        const int64_t row = partials.row_index(p, task.batch, seq, key);
        std::fill(dk, dk + head_dim, 0.f);
        std::fill(dv, dv + head_dim, 0.f);
        for (int64_t g = 0; g < group; ++g) {
          const float* pk = partials.dk_row(p, task.kv_head * group + g, row);
          const float* pv = partials.dv_row(p, task.kv_head * group + g, row);
          for (int64_t d = 0; d < head_dim; ++d) {
            dk[d] += pk[d];
            dv[d] += pv[d];
          }
        }
        store_row(p.dtype, dk, head_dim, element_ptr_mut(p.dk, p.dtype, task.batch, seq.k_start + key, task.kv_head));
        store_row(p.dtype, dv, head_dim, element_ptr_mut(p.dv, p.dtype, task.batch, seq.k_start + key, task.kv_head));
      }
    }
  });
}

}  // namespace backward_detail

Status flash_backward(const BackwardParams& p) {
  if (amx_backward_enabled(p.dtype) && !p.dropout.enabled()) return amx_flash_backward(p);  // no dropout on AMX
  using namespace backward_detail;
  return avx_flash_backward_tiles<ShippedBackwardConfig>(p, min_chunk_keys_or_env(kAvxMinChunkKeys));
}

}  // namespace cpu
}  // namespace flashcore
