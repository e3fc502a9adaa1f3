// cpu_flash backward: FlashAttention-2 gradients by recomputation, fp32 accumulation.
//
// Work split (backward_tasks.hpp): a task per (batch, query head), or per chunk of its keys where
// B x H is small. Inside a task the FA2 loop order is kept: for each key block of its keys (its
// K^T, V^T tiles packed once), for each query block that can see it:
//   S = (scale Q) K^T, P = exp(S - lse)  (softcap: s = cap * tanh(s / cap), and tanh' = 1 - t^2)
//   dV^T += dO^T P      dP = dO V^T      dS = P * (dP - D) [* tanh']
//   dK^T += (scale Q)^T dS               dQ += dS K  (times scale once, when dQ is written)
// with D_i = rowsum(dO_i * O_i) computed first. dQ accumulates in a per-thread fp32 buffer
// [rows x D] for the task's query rows.
// On CPUs with AMX, fp16 / bf16 take the AMX backward instead (amx_backward_kernel.hpp).
//
// Tiles are [rows x keys] with keys along the SIMD lanes (64 keys = 4 AVX-512 vectors); all five
// products are the gemm_bcast micro-kernel of cpu_common.hpp with different operand strides.
// Relies on: cpu_common.hpp, params.hpp (seq_info, offset_of), mask.hpp (keys_for_row(s)).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "api/backends.hpp"
#include "cpu/amx.hpp"
#include "cpu/backward_tasks.hpp"
#include "cpu/cpu_common.hpp"

namespace flashcore {
namespace cpu {
namespace {

using namespace flash_detail;
using namespace backward_detail;

struct BackwardTraits {
  static constexpr int64_t kBlockKeys = 64;   // keys per tile (a multiple of kSimdWidth)
  static constexpr int64_t kBlockRows = 64;   // query rows per tile
  static constexpr int64_t kReduceRows = 256; // key rows per task of the GQA reduction pass
  // Shortest key chunk of a split head (backward_tasks.hpp): a chunk repeats the loads of its
  // query rows, cheap next to the fp32 GEMMs over 256 keys.
  static constexpr int64_t kMinChunkKeys = 256;
  static constexpr int64_t kPrefetchRows = 8; // how far ahead strided input rows are prefetched
  static_assert(kBlockKeys % kSimdWidth == 0, "key block must fill whole vectors");
};

/** Per-thread buffers; the per-head ones are sized for the longest sequence. */
struct BackwardScratch {
  AlignedFloats q_rows;             // [seqlen_q x D] Q * softmax_scale
  AlignedFloats dout_rows;          // [seqlen_q x D]
  AlignedFloats dq_acc;             // [seqlen_q x D_pad] this chunk's dQ
  AlignedFloats dq_sum;             // [seqlen_q x D_pad] dQ of the chunks before it (BackwardTask::fold_keys)
  AlignedFloats delta, lse;         // [seqlen_q]
  AlignedFloats k_t, v_t;           // [D x N]
  AlignedFloats k_rows;             // [N x D_pad], zero padded columns
  AlignedFloats v_rows;             // [N x D] V rows on their way into V^T, then dV rows
  AlignedFloats dk_rows;            // [N x D] dK rows on their way out
  AlignedFloats dk_t, dv_t;         // [D x N]
  AlignedFloats probs, dscores, tanh_grad;  // [M x N]
  AlignedFloats row_a;              // [D_pad] one row in flight
  PrefetchQueue prefetch;           // the next key block's K and V rows

  void reserve(int64_t max_seqlen_q, int64_t head_dim) {
    const int64_t n = BackwardTraits::kBlockKeys, m = BackwardTraits::kBlockRows;
    const int64_t d_pad = round_up(head_dim, kSimdWidth);
    const int64_t rows = std::max<int64_t>(max_seqlen_q, 1);
    q_rows.reserve(rows * head_dim);
    dout_rows.reserve(rows * head_dim);
    dq_acc.reserve(rows * d_pad);
    dq_sum.reserve(rows * d_pad);
    delta.reserve(rows);
    lse.reserve(rows);
    for (AlignedFloats* a : {&k_t, &v_t, &dk_t, &dv_t}) a->reserve(head_dim * n);
    k_rows.reserve(n * d_pad);
    v_rows.reserve(n * head_dim);
    dk_rows.reserve(n * head_dim);
    for (AlignedFloats* a : {&probs, &dscores, &tanh_grad}) a->reserve(m * n);
    row_a.reserve(d_pad);
  }
};

class BackwardTaskRunner {
 public:
  BackwardTaskRunner(const BackwardParams& p, BackwardScratch& scratch, const TaskSinks& sinks)
      : p_(p), w_(scratch), partials_(sinks.gqa), dq_partials_(sinks.dq), d_pad_(round_up(p.head_dim, kSimdWidth)) {}

  void run(const BackwardTask& task) {
    task_ = task;
    kv_head_ = task.head / p_.group_size();
    seq_ = seq_info(p_, task.batch);
    const MaskInfo mask = mask_info(p_, seq_);
    load_head();
    const int64_t dq_floats = (task.row_end - task.row_begin) * d_pad_;
    std::fill(w_.dq_acc.data(), w_.dq_acc.data() + dq_floats, 0.f);
    if (task.fold_keys) std::fill(w_.dq_sum.data(), w_.dq_sum.data() + dq_floats, 0.f);

    constexpr int64_t kN = BackwardTraits::kBlockKeys, kM = BackwardTraits::kBlockRows;
    for (int64_t n0 = task.key_begin; n0 < task.key_end; n0 += kN) {
      const int64_t n_valid = std::min(kN, task.key_end - n0);
      if (task.fold_keys && n0 > task.key_begin && (n0 - task.key_begin) % task.fold_keys == 0) fold_dq();
      pack_keys(n0, n_valid);
      auto sees_keys = [&](int64_t m0) {
        return rows_see_keys(mask, m0, std::min(m0 + kM, task.row_end), n0, n0 + n_valid);
      };
      int64_t query_blocks = 0;
      for (int64_t m0 = task.row_begin; m0 < task.row_end; m0 += kM) query_blocks += sees_keys(m0);
      w_.prefetch.pace(query_blocks * micro_tiles_per_block());
      bool have_grads = false;
      for (int64_t m0 = task.row_begin; m0 < task.row_end; m0 += kM) {
        if (!sees_keys(m0)) continue;
        process_block(mask, m0, std::min(kM, task.row_end - m0), n0, n_valid, /*first=*/!have_grads);
        have_grads = true;
      }
      w_.prefetch.drain();  // whatever the micro-tiles left, before the next key block is packed
      write_key_grads(n0, n_valid, have_grads);
    }
    if (task.fold_keys) fold_dq();
    write_dq(task.fold_keys ? w_.dq_sum.data() : w_.dq_acc.data());
  }

 private:
  /** Loads what the head's rows need for the whole task, as contiguous fp32:
   *  - Q * softmax_scale, rounded exactly as the forward rounds it, so the recomputed scores
   *    match the forward's bit for bit (same products, same summation order) and P = exp(s - lse)
   *    stays consistent with the given lse even for huge logits; dK = dS^T (Q * scale) then
   *    needs no further scaling;
   *  - dO (copied even for fp32: rows 4 KiB apart in the input all fall into one L1 set, and the
   *    dO^T P product walks every row once per group of columns);
   *  - D_i = dO_i . O_i and the forward's lse.
   *  Rows task_.row_begin .. task_.row_end of the head, at local indices from 0. Input rows are prefetched a few
   *  rows ahead: their stride defeats the hardware prefetcher. */
  void load_head() {
    const int64_t head_dim = p_.head_dim;
    const int64_t row_bytes = head_dim * static_cast<int64_t>(dtype_size(p_.dtype));
    float* q_rows = w_.q_rows.data();
    float* dout_rows = w_.dout_rows.data();
    float* out_row = w_.row_a.data();
    for (int64_t i = 0; i < task_.row_end - task_.row_begin; ++i) {
      const int64_t row = seq_.q_start + task_.row_begin + i;
      if (i + BackwardTraits::kPrefetchRows < task_.row_end - task_.row_begin) {
        const int64_t ahead = row + BackwardTraits::kPrefetchRows;
        for (const TensorRef* t : {&p_.q, &p_.dout, &p_.out}) {
          prefetch_rows(element_ptr(*t, p_.dtype, task_.batch, ahead, task_.head), 1, 0, row_bytes);
        }
      }
      float* q = q_rows + i * head_dim;
      load_row(p_.dtype, element_ptr(p_.q, p_.dtype, task_.batch, row, task_.head), head_dim, q);
      for (int64_t d = 0; d < head_dim; ++d) q[d] *= p_.softmax_scale;
      float* dout = dout_rows + i * head_dim;
      load_row(p_.dtype, element_ptr(p_.dout, p_.dtype, task_.batch, row, task_.head), head_dim, dout);
      load_row(p_.dtype, element_ptr(p_.out, p_.dtype, task_.batch, row, task_.head), head_dim, out_row);
      w_.delta.data()[i] = dot(dout, out_row, head_dim);
      w_.lse.data()[i] = p_.lse.data[task_.batch * p_.lse.batch_stride + task_.head * p_.lse.head_stride + row * p_.lse.row_stride];
    }
  }

  /** K^T and V^T [D x N] (zero past n_valid) and K rows [N x D_pad] (zero past D). */
  void pack_keys(int64_t n0, int64_t n_valid) {
    constexpr int64_t kN = BackwardTraits::kBlockKeys;
    const int64_t head_dim = p_.head_dim;
    // The next block's rows stream in while this block's query loop computes, a few cache lines
    // per GEMM micro-tile (PrefetchQueue: one burst of them mostly did not arrive).
    const int64_t next_rows = std::min(kN, task_.key_end - n0 - kN);
    if (next_rows > 0) {
      const int64_t elem = static_cast<int64_t>(dtype_size(p_.dtype));
      for (const TensorRef* t : {&p_.k, &p_.v}) {
        w_.prefetch.add(element_ptr(*t, p_.dtype, task_.batch, seq_.k_start + n0 + kN, kv_head_), next_rows,
                        t->row_stride * elem, head_dim * elem);
      }
    }
    float* k_rows = w_.k_rows.data();
    float* v_rows = w_.v_rows.data();
    for (int64_t n = 0; n < n_valid; ++n) {
      float* k_row = k_rows + n * d_pad_;
      load_row(p_.dtype, element_ptr(p_.k, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_), head_dim, k_row);
      std::fill(k_row + head_dim, k_row + d_pad_, 0.f);
      load_row(p_.dtype, element_ptr(p_.v, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_), head_dim, v_rows + n * head_dim);
    }
    std::fill(k_rows + n_valid * d_pad_, k_rows + kN * d_pad_, 0.f);
    std::fill(v_rows + n_valid * head_dim, v_rows + kN * head_dim, 0.f);
    transpose(k_rows, d_pad_, kN, head_dim, w_.k_t.data(), kN);
    transpose(v_rows, head_dim, kN, head_dim, w_.v_t.data(), kN);
  }

  void process_block(const MaskInfo& mask, int64_t m0, int64_t m_valid, int64_t n0, int64_t n_valid, bool first) {
    constexpr int64_t kN = BackwardTraits::kBlockKeys;
    const int64_t head_dim = p_.head_dim;
    const float* q = w_.q_rows.data() + (m0 - task_.row_begin) * head_dim;
    const float* dout = w_.dout_rows.data() + (m0 - task_.row_begin) * head_dim;
    float* probs = w_.probs.data();
    float* dscores = w_.dscores.data();
    // S = (scale Q) K^T, then P in place.
    PrefetchQueue* pf = &w_.prefetch;
    gemm_bcast<Accumulate::kOverwrite>(m_valid, kN, head_dim, q, head_dim, 1, w_.k_t.data(), kN, probs, kN, nullptr,
                                       pf);
    probabilities(mask, m0, m_valid, n0, n_valid);
    // dV^T += dO^T P
    if (first) {
      gemm_bcast<Accumulate::kOverwrite>(head_dim, kN, m_valid, dout, 1, head_dim, probs, kN, w_.dv_t.data(), kN,
                                         nullptr, pf);
    } else {
      gemm_bcast<Accumulate::kAdd>(head_dim, kN, m_valid, dout, 1, head_dim, probs, kN, w_.dv_t.data(), kN, nullptr,
                                   pf);
    }
    // dP = dO V^T, then dS in place.
    gemm_bcast<Accumulate::kOverwrite>(m_valid, kN, head_dim, dout, head_dim, 1, w_.v_t.data(), kN, dscores, kN,
                                       nullptr, pf);
    score_gradients(m0, m_valid);
    // dK^T += (scale Q)^T dS
    if (first) {
      gemm_bcast<Accumulate::kOverwrite>(head_dim, kN, m_valid, q, 1, head_dim, dscores, kN, w_.dk_t.data(), kN,
                                         nullptr, pf);
    } else {
      gemm_bcast<Accumulate::kAdd>(head_dim, kN, m_valid, q, 1, head_dim, dscores, kN, w_.dk_t.data(), kN, nullptr,
                                   pf);
    }
    // dQ += dS K
    gemm_bcast<Accumulate::kAdd>(m_valid, d_pad_, n_valid, dscores, kN, 1, w_.k_rows.data(), d_pad_,
                                 w_.dq_acc.data() + (m0 - task_.row_begin) * d_pad_, d_pad_, nullptr, pf);
  }

  /** GEMM micro-tiles of process_block on a full block (the turns PrefetchQueue gets). */
  int64_t micro_tiles_per_block() const {
    constexpr int64_t kN = BackwardTraits::kBlockKeys, kM = BackwardTraits::kBlockRows;
    constexpr int64_t kR = GemmTraits::kRows, kColumns = kSimdWidth * GemmTraits::kVecs;
    const int64_t key_passes = ceil_div(kN, kColumns), dq_passes = ceil_div(d_pad_, kColumns);
    return key_passes * (2 * ceil_div(kM, kR) + 2 * ceil_div(p_.head_dim, kR)) + dq_passes * ceil_div(kM, kR);
  }

  /** probs[r][j] = exp(s - lse) for allowed keys, else 0; under softcap also tanh' = 1 - t^2. */
  void probabilities(const MaskInfo& mask, int64_t m0, int64_t m_valid, int64_t n0, int64_t n_valid) {
    constexpr int64_t kN = BackwardTraits::kBlockKeys;
    const bool capped = p_.softcap > 0.f;
    const Vec cap = Simd::set1(p_.softcap);
    const Vec inv_cap = Simd::set1(capped ? 1.f / p_.softcap : 0.f);
    const Vec one = Simd::set1(1.f);
    for (int64_t r = 0; r < m_valid; ++r) {
      const int64_t row = m0 + r;
      float* s = w_.probs.data() + r * kN;
      float* tanh_grad = w_.tanh_grad.data() + r * kN;
      const float lse = w_.lse.data()[row - task_.row_begin];
      if (lse == kNegInf) {  // fully masked row: contributes nothing
        std::fill(s, s + kN, 0.f);
        if (capped) std::fill(tanh_grad, tanh_grad + kN, 0.f);
        continue;
      }
      const KeyRange keys = mask.keys_for_row(row);
      const Vec lo = Simd::set1(static_cast<float>(std::clamp<int64_t>(keys.begin - n0, 0, n_valid)));
      const Vec hi = Simd::set1(static_cast<float>(std::clamp<int64_t>(keys.end - n0, 0, n_valid)));
      const Vec row_lse = Simd::set1(lse);
      Vec key = Simd::iota();
      const Vec step = Simd::set1(static_cast<float>(kSimdWidth));
      for (int64_t j = 0; j < kN; j += kSimdWidth, key = Simd::add(key, step)) {
        Vec x = Simd::load(s + j);
        if (capped) {
          const Vec t = vtanh(Simd::mul(x, inv_cap));
          x = Simd::mul(cap, t);
          Simd::store(tanh_grad + j, Simd::sub(one, Simd::mul(t, t)));
        }
        const Vec prob = vexp_softmax(Simd::sub(x, row_lse));
        Simd::store(s + j, Simd::select(Simd::both(Simd::le(lo, key), Simd::lt(key, hi)), prob, Simd::zero()));
      }
    }
  }

  /** dS = P * (dP - D_i), times tanh' under softcap (the scale is in Q for dK, applied to dQ last). */
  void score_gradients(int64_t m0, int64_t m_valid) {
    constexpr int64_t kN = BackwardTraits::kBlockKeys;
    const bool capped = p_.softcap > 0.f;
    for (int64_t r = 0; r < m_valid; ++r) {
      const float* prob = w_.probs.data() + r * kN;
      const float* tanh_grad = w_.tanh_grad.data() + r * kN;
      float* ds = w_.dscores.data() + r * kN;
      const Vec delta = Simd::set1(w_.delta.data()[m0 - task_.row_begin + r]);
      for (int64_t j = 0; j < kN; j += kSimdWidth) {
        Vec g = Simd::mul(Simd::load(prob + j), Simd::sub(Simd::load(ds + j), delta));
        if (capped) g = Simd::mul(g, Simd::load(tanh_grad + j));
        Simd::store(ds + j, g);
      }
    }
  }

  /** dK and dV rows of the block (transposed back): to the outputs, or to this head's partials. */
  void write_key_grads(int64_t n0, int64_t n_valid, bool have_grads) {
    constexpr int64_t kN = BackwardTraits::kBlockKeys;
    const int64_t head_dim = p_.head_dim;
    // Rows of this block: straight into this head's partials (consecutive rows), or staged.
    float* dk_rows = w_.dk_rows.data();
    float* dv_rows = w_.v_rows.data();
    if (partials_) {
      const int64_t row = partials_->row_index(p_, task_.batch, seq_, n0);
      dk_rows = partials_->dk_row(p_, task_.head, row);
      dv_rows = partials_->dv_row(p_, task_.head, row);
    }
    if (have_grads) {
      transpose(w_.dk_t.data(), kN, head_dim, n_valid, dk_rows, head_dim);
      transpose(w_.dv_t.data(), kN, head_dim, n_valid, dv_rows, head_dim);
    } else {
      std::fill(dk_rows, dk_rows + n_valid * head_dim, 0.f);
      std::fill(dv_rows, dv_rows + n_valid * head_dim, 0.f);
    }
    if (partials_) return;
    for (int64_t n = 0; n < n_valid; ++n) {
      const int64_t key_row = seq_.k_start + n0 + n;
      store_row(p_.dtype, dk_rows + n * head_dim, head_dim, element_ptr_mut(p_.dk, p_.dtype, task_.batch, key_row, kv_head_));
      store_row(p_.dtype, dv_rows + n * head_dim, head_dim, element_ptr_mut(p_.dv, p_.dtype, task_.batch, key_row, kv_head_));
    }
  }

  /** dq_sum += dq_acc (the chunk just done), and dq_acc = 0 for the next: the order in which
   *  reduce_dq_partials sums a split head's chunks (BackwardPlan). */
  void fold_dq() {
    float* sum = w_.dq_sum.data();
    float* acc = w_.dq_acc.data();
    for (int64_t i = 0; i < (task_.row_end - task_.row_begin) * d_pad_; i += kSimdWidth) {
      Simd::store(sum + i, Simd::add(Simd::load(sum + i), Simd::load(acc + i)));
      Simd::store(acc + i, Simd::zero());
    }
  }

  /** The task's dQ rows `dq` [rows x D_pad]: unscaled to its partials (a task of a split head),
   *  else times softmax_scale to the output. */
  void write_dq(const float* dq) {
    if (dq_partials_) {
      float* out = dq_partials_->rows_of(task_);
      for (int64_t i = 0; i < task_.row_end - task_.row_begin; ++i) {
        std::copy(dq + i * d_pad_, dq + i * d_pad_ + p_.head_dim, out + i * p_.head_dim);
      }
      return;
    }
    float* row = w_.row_a.data();
    const int64_t row_bytes = p_.head_dim * static_cast<int64_t>(dtype_size(p_.dtype));
    for (int64_t i = 0; i < seq_.seqlen_q; ++i) {  // one chunk: the task's rows are the head's
      if (i + BackwardTraits::kPrefetchRows < seq_.seqlen_q) {
        prefetch_rows(element_ptr(p_.dq, p_.dtype, task_.batch, seq_.q_start + i + BackwardTraits::kPrefetchRows, task_.head), 1, 0,
                      row_bytes, /*for_write=*/true);
      }
      const float* acc = dq + i * d_pad_;
      for (int64_t d = 0; d < p_.head_dim; ++d) row[d] = acc[d] * p_.softmax_scale;
      store_row(p_.dtype, row, p_.head_dim, element_ptr_mut(p_.dq, p_.dtype, task_.batch, seq_.q_start + i, task_.head));
    }
  }

  const BackwardParams& p_;
  BackwardScratch& w_;
  GqaPartials* partials_;
  DqPartials* dq_partials_;
  const int64_t d_pad_;
  BackwardTask task_{};  // the current task
  int64_t kv_head_ = 0;  // derived from it
  SeqInfo seq_{};
};

}  // namespace

namespace backward_detail {

using namespace flash_detail;

KeySplit choose_key_split(const BackwardParams& p, int64_t min_chunk_keys) {
  // Chunks enough for 64 tasks (four per thread on a 16-core machine) where B x H makes fewer. A
  // head run as chunk tasks repeats the pass over its query rows (loads, packs) per chunk and
  // adds the dQ reduction (plan_backward decides whether it does).
  constexpr int64_t kTasksWanted = 64, kMaxChunks = 8;
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
  int64_t chunks = std::min({ceil_div(kTasksWanted, heads), kMaxChunks, max_seqlen_k / min_chunk_keys});
  const int64_t dq_floats = (p.is_varlen() ? p.cu_seqlens_q[p.batch] : p.batch * p.seqlen_q) * p.heads_q * p.head_dim;
  while (chunks > 1 && chunks * dq_floats > kMaxPartialFloats) --chunks;
  split.chunks = std::max<int64_t>(chunks, 1);
  return split;
}

int64_t min_chunk_keys_or_env(int64_t shipped) {
  const char* env = std::getenv("FLASHCORE_CPU_CHUNK_KEYS");
  if (!env || !*env) return shipped;
  char* end = nullptr;
  const long long keys = std::strtoll(env, &end, 10);
  return *end == 0 && keys >= 0 ? keys : shipped;
}

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
      for (int64_t k0 = 0; k0 < seq.seqlen_k; k0 += BackwardTraits::kReduceRows) tasks.push_back({b, kvh, k0});
  }
  const int64_t group = p.group_size(), head_dim = p.head_dim;
  return run_workers(static_cast<int64_t>(tasks.size()), p.num_threads, [&](TaskQueue& queue) {
    AlignedFloats dk_buf, dv_buf;
    float* dk = dk_buf.reserve(head_dim);
    float* dv = dv_buf.reserve(head_dim);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) {
      const ReduceTask& task = tasks[static_cast<size_t>(t)];
      const SeqInfo seq = seq_info(p, task.batch);
      const int64_t end = std::min(seq.seqlen_k, task.first_key + BackwardTraits::kReduceRows);
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

Status avx_flash_backward_with(const BackwardParams& p, int64_t min_chunk_keys) {
  return run_backward_tasks(p, choose_key_split(p, min_chunk_keys), /*may_fold=*/true,
                            [&](TaskQueue& queue, const std::vector<BackwardTask>& tasks, const TaskSinks& sinks) {
    BackwardScratch scratch;
    scratch.reserve(p.seqlen_q, p.head_dim);
    BackwardTaskRunner runner(p, scratch, sinks);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) runner.run(tasks[static_cast<size_t>(t)]);
  });
}

}  // namespace backward_detail

Status flash_backward(const BackwardParams& p) {
  if (amx_backward_enabled(p.dtype)) return amx_flash_backward(p);
  return backward_detail::avx_flash_backward_with(p, backward_detail::min_chunk_keys_or_env(BackwardTraits::kMinChunkKeys));
}

}  // namespace cpu
}  // namespace flashcore
