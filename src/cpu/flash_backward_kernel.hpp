// The cpu_flash backward on AVX-512 (AVX2 / scalar fallbacks through cpu_common.hpp's Simd):
// FlashAttention-2 gradients by recomputation, fp32 accumulation. flash_backward.cpp instantiates it
// with the shipped tiles (and runs it for fp32, and for fp16 / bf16 without AMX);
// dev/cpu_backward_sweep.cpp compares other tiles and splits with it.
//
// Inside a task (backward_tasks.hpp) the FA2 loop order is kept, over groups of key blocks: for each
// group of its keys (each block's K^T, V^T tiles packed once), for each query block, for each block
// of the group that the query block can see:
//   S = (scale Q) K^T, P = exp(S - lse)  (softcap: s = cap * tanh(s / cap), and tanh' = 1 - t^2;
//                                          ALiBi: then s - slope * |i + seqlen_k - seqlen_q - j|)
//   dV^T += dO^T P      dP = dO V^T      dS = P * (dP - D) [* tanh']
//   dK^T += (scale Q)^T dS               dQ += dS K  (times scale once, when dQ is written)
// with D_i = rowsum(dO_i * O_i) computed first. dQ accumulates in a per-thread fp32 buffer
// [rows x D] for the task's query rows.
//
// Tiles are [rows x keys] with keys along the SIMD lanes (64 keys = 4 AVX-512 vectors); all five
// products are the gemm_bcast micro-kernel of cpu_common.hpp with different operand strides.
// Relies on: cpu_common.hpp, backward_tasks.hpp (tasks, sinks, phases), params.hpp (seq_info,
// offset_of), mask.hpp (keys_for_row(s)).
#pragma once

#include <algorithm>
#include <vector>

#include "cpu/backward_tasks.hpp"
#include "cpu/cpu_common.hpp"
#include "cpu/dropout_bits.hpp"

namespace flashcore {
namespace cpu {
namespace backward_detail {

using namespace flash_detail;

/** Tiles of the AVX-512 backward: Rows query rows per block against 64-key tiles, every product on
 *  the micro-kernel tile GemmTile (cpu_common.hpp). Key tiles and query blocks must divide
 *  KeySplit's alignments: a whole head and its chunk tasks then meet the same tiles and blocks, and
 *  sum dQ and dK / dV alike (the same bits at any thread count). 64 keys keep the [rows x keys]
 *  score tiles in L1.
 *  Group key tiles are packed together, and each query block visits all of them in turn: its
 *  Q, dO and dQ rows then come from memory once per group instead of once per key tile (a head's
 *  rows are megabytes, past a core's L2). Every sum keeps its order (dQ over keys, dK / dV over
 *  query blocks), so the grouping changes no bit. */
template <int64_t Rows, class GemmTile, int64_t Group = 1>
struct BackwardConfig {
  static constexpr int64_t kBlockKeys = 64;    // keys per tile (a multiple of kSimdWidth)
  static constexpr int64_t kBlockRows = Rows;  // query rows per block
  static constexpr int64_t kGroupTiles = Group;  // key tiles a query block visits in turn
  static constexpr int64_t kGroupKeys = Group * kBlockKeys;
  static constexpr int64_t kPrefetchRows = 8;  // how far ahead strided input rows are prefetched
  using Gemm = GemmTile;
  static_assert(kBlockKeys % kSimdWidth == 0, "key block must fill whole vectors");
  static_assert(KeySplit::kKeyAlign % kGroupKeys == 0, "chunk boundaries fall on key groups");
  static_assert(KeySplit::kRowAlign % kBlockRows == 0, "a chunk's first row starts a query block");
};

/** What flash_backward runs: 64 x 64 tiles, GemmTraits' 6 x 4 micro-kernel, key tiles in groups
 *  of 4. Against one tile at a time on the GPU machine's Xeon (fp32, dev/cpu_backward_sweep.cpp,
 *  docs/PERF.md session 62): +5% to +10% at 16 threads, d128 +5% at 2, d64 level at 2; session
 *  63 at 16 threads: S4096 d128 +4.7%, S2048 d256 level (-0.6%). */
using ShippedBackwardConfig = BackwardConfig<64, GemmTraits, 4>;

/** Per-thread buffers; the per-head ones are sized for the longest sequence. */
template <class Config>
struct BackwardScratch {
  AlignedFloats q_rows;             // [seqlen_q x D] Q * softmax_scale
  AlignedFloats dout_rows;          // [seqlen_q x D]
  AlignedFloats dq_acc;             // [seqlen_q x D_pad] this chunk's dQ
  AlignedFloats dq_sum;             // [seqlen_q x D_pad] dQ of the chunks before it (BackwardTask::fold_keys)
  AlignedFloats delta, lse;         // [seqlen_q]
  AlignedFloats k_t, v_t;           // [group tiles][D x N]
  AlignedFloats k_rows;             // [group tiles][N x D_pad], zero padded columns
  AlignedFloats v_rows;             // [N x D] V rows on their way into V^T, then dV rows
  AlignedFloats dk_rows;            // [N x D] dK rows on their way out
  AlignedFloats dk_t, dv_t;         // [group tiles][D x N]
  AlignedFloats probs, dscores, tanh_grad;  // [M x N]
  AlignedFloats dropped_probs;      // [M x N] dropout: P * Z (Z = 0 or 1 / (1 - p)), dV's operand
  AlignedFloats row_a;              // [D_pad] one row in flight
  PrefetchQueue prefetch;           // the next key group's K and V rows

  void reserve(int64_t max_seqlen_q, int64_t head_dim) {
    const int64_t n = Config::kBlockKeys, m = Config::kBlockRows;
    const int64_t d_pad = round_up(head_dim, kSimdWidth);
    const int64_t rows = std::max<int64_t>(max_seqlen_q, 1);
    q_rows.reserve(rows * head_dim);
    dout_rows.reserve(rows * head_dim);
    dq_acc.reserve(rows * d_pad);
    dq_sum.reserve(rows * d_pad);
    delta.reserve(rows);
    lse.reserve(rows);
    const int64_t g = Config::kGroupTiles;
    for (AlignedFloats* a : {&k_t, &v_t, &dk_t, &dv_t}) a->reserve(g * head_dim * n);
    k_rows.reserve(g * n * d_pad);
    v_rows.reserve(n * head_dim);
    dk_rows.reserve(n * head_dim);
    for (AlignedFloats* a : {&probs, &dscores, &tanh_grad, &dropped_probs}) a->reserve(m * n);
    row_a.reserve(d_pad);
  }
};

template <class Config, class PhaseTimer = NoBackwardTimer>
class BackwardTaskRunner {
 public:
  BackwardTaskRunner(const BackwardParams& p, BackwardScratch<Config>& scratch, const TaskSinks& sinks)
      : p_(p), w_(scratch), partials_(sinks.gqa), dq_partials_(sinks.dq), d_pad_(round_up(p.head_dim, kSimdWidth)) {}

  void run(const BackwardTask& task) {
    PhaseTimer::lap(BackwardPhase::kBetweenTasks);
    task_ = task;
    kv_head_ = task.head / p_.group_size();
    seq_ = seq_info(p_, task.batch);
    const MaskInfo mask = mask_info(p_, seq_);
    load_head();
    const int64_t dq_floats = task.rows() * d_pad_;
    std::fill(w_.dq_acc.data(), w_.dq_acc.data() + dq_floats, 0.f);
    if (task.fold_keys) std::fill(w_.dq_sum.data(), w_.dq_sum.data() + dq_floats, 0.f);
    PhaseTimer::lap(BackwardPhase::kPackHead);

    constexpr int64_t kN = Config::kBlockKeys, kM = Config::kBlockRows, kG = Config::kGroupKeys;
    for (int64_t g0 = task.key_begin; g0 < task.key_end; g0 += kG) {
      // Fold boundaries are chunk boundaries, multiples of KeySplit::kKeyAlign: never inside a group.
      if (task.fold_keys && g0 > task.key_begin && (g0 - task.key_begin) % task.fold_keys == 0) {
        fold_dq();
        PhaseTimer::lap(BackwardPhase::kWrite);
      }
      const int64_t tiles = ceil_div(std::min(kG, task.key_end - g0), kN);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = g0 + t * kN;
        tiles_[t] = KeyTile{n0, std::min(kN, task.key_end - n0), false};
        pack_keys(t);
      }
      queue_next_keys(g0 + kG);
      PhaseTimer::lap(BackwardPhase::kPackKeys);
      auto sees_tile = [&](int64_t m0, const KeyTile& kt) {
        return rows_see_keys(mask, m0, std::min(m0 + kM, task.row_end), kt.n0, kt.n0 + kt.n_valid);
      };
      int64_t blocks = 0;
      for (int64_t m0 = task.row_begin; m0 < task.row_end; m0 += kM) {
        for (int64_t t = 0; t < tiles; ++t) blocks += sees_tile(m0, tiles_[t]);
      }
      w_.prefetch.pace(blocks * micro_tiles_per_block());
      for (int64_t m0 = task.row_begin; m0 < task.row_end; m0 += kM) {
        for (int64_t t = 0; t < tiles; ++t) {
          if (!sees_tile(m0, tiles_[t])) continue;
          process_block(mask, m0, std::min(kM, task.row_end - m0), t);
          tiles_[t].have_grads = true;
        }
      }
      w_.prefetch.drain();  // whatever the micro-tiles left, before the next group is packed
      for (int64_t t = 0; t < tiles; ++t) write_key_grads(t);
      PhaseTimer::lap(BackwardPhase::kWrite);
    }
    if (task.fold_keys) fold_dq();
    write_dq(task.fold_keys ? w_.dq_sum.data() : w_.dq_acc.data());
    PhaseTimer::lap(BackwardPhase::kWrite);
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
    for (int64_t i = 0; i < task_.rows(); ++i) {
      const int64_t row = seq_.q_start + task_.row_begin + i;
      if (i + Config::kPrefetchRows < task_.rows()) {
        const int64_t ahead = row + Config::kPrefetchRows;
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

  /** A key tile of the current group: its keys and whether a query block has added to its dK / dV. */
  struct KeyTile {
    int64_t n0 = 0, n_valid = 0;
    bool have_grads = false;
  };
  float* k_t(int64_t t) const { return w_.k_t.data() + t * p_.head_dim * Config::kBlockKeys; }
  float* v_t(int64_t t) const { return w_.v_t.data() + t * p_.head_dim * Config::kBlockKeys; }
  float* dk_t(int64_t t) const { return w_.dk_t.data() + t * p_.head_dim * Config::kBlockKeys; }
  float* dv_t(int64_t t) const { return w_.dv_t.data() + t * p_.head_dim * Config::kBlockKeys; }
  float* k_rows(int64_t t) const { return w_.k_rows.data() + t * Config::kBlockKeys * d_pad_; }

  /** The K and V rows of the group from key n0 on stream in while this group's query loop
   *  computes, a few cache lines per GEMM micro-tile (PrefetchQueue: one burst of them mostly did
   *  not arrive). */
  void queue_next_keys(int64_t n0) {
    const int64_t rows = std::min(Config::kGroupKeys, task_.key_end - n0);
    if (rows <= 0) return;
    const int64_t elem = static_cast<int64_t>(dtype_size(p_.dtype));
    for (const TensorRef* t : {&p_.k, &p_.v}) {
      w_.prefetch.add(element_ptr(*t, p_.dtype, task_.batch, seq_.k_start + n0, kv_head_), rows,
                      t->row_stride * elem, p_.head_dim * elem);
    }
  }

  /** Key tile t of the group: K^T and V^T [D x N] (zero past n_valid) and K rows [N x D_pad] (zero
   *  past D). */
  void pack_keys(int64_t t) {
    constexpr int64_t kN = Config::kBlockKeys;
    const int64_t head_dim = p_.head_dim;
    const int64_t n0 = tiles_[t].n0, n_valid = tiles_[t].n_valid;
    float* k_rows = this->k_rows(t);
    float* v_rows = w_.v_rows.data();
    for (int64_t n = 0; n < n_valid; ++n) {
      float* k_row = k_rows + n * d_pad_;
      load_row(p_.dtype, element_ptr(p_.k, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_), head_dim, k_row);
      std::fill(k_row + head_dim, k_row + d_pad_, 0.f);
      load_row(p_.dtype, element_ptr(p_.v, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_), head_dim, v_rows + n * head_dim);
    }
    std::fill(k_rows + n_valid * d_pad_, k_rows + kN * d_pad_, 0.f);
    std::fill(v_rows + n_valid * head_dim, v_rows + kN * head_dim, 0.f);
    transpose(k_rows, d_pad_, kN, head_dim, k_t(t), kN);
    transpose(v_rows, head_dim, kN, head_dim, v_t(t), kN);
  }

  /** The five products of query block m0 against key tile t of the group. */
  void process_block(const MaskInfo& mask, int64_t m0, int64_t m_valid, int64_t t) {
    constexpr int64_t kN = Config::kBlockKeys;
    const int64_t n0 = tiles_[t].n0, n_valid = tiles_[t].n_valid;
    const bool first = !tiles_[t].have_grads;
    using Gemm = typename Config::Gemm;
    constexpr Accumulate kSet = Accumulate::kOverwrite, kAdd = Accumulate::kAdd;
    const int64_t head_dim = p_.head_dim;
    const float* q = w_.q_rows.data() + (m0 - task_.row_begin) * head_dim;
    const float* dout = w_.dout_rows.data() + (m0 - task_.row_begin) * head_dim;
    float* probs = w_.probs.data();
    float* dscores = w_.dscores.data();
    PrefetchQueue* pf = &w_.prefetch;
    // acc^T [D x keys] (+)= rows^T scores: the block's part of dV^T or dK^T (the first block sets it).
    auto add_key_grads = [&](const float* rows, const float* scores, float* acc) {
      if (first) {
        gemm_bcast<kSet, Gemm>(head_dim, kN, m_valid, rows, 1, head_dim, scores, kN, acc, kN, nullptr, pf);
      } else {
        gemm_bcast<kAdd, Gemm>(head_dim, kN, m_valid, rows, 1, head_dim, scores, kN, acc, kN, nullptr, pf);
      }
      PhaseTimer::lap(BackwardPhase::kKeyGrads);
    };
    // S = (scale Q) K^T, then P in place.
    gemm_bcast<kSet, Gemm>(m_valid, kN, head_dim, q, head_dim, 1, k_t(t), kN, probs, kN, nullptr, pf);
    PhaseTimer::lap(BackwardPhase::kScores);
    // ALiBi as a template argument: without it the loops are the bias-free ones.
    if (p_.has_alibi()) {
      probabilities</*kAlibi=*/true>(mask, m0, m_valid, n0, n_valid);
    } else {
      probabilities</*kAlibi=*/false>(mask, m0, m_valid, n0, n_valid);
    }
    const bool dropout = p_.dropout.enabled();
    if (dropout) drop_probabilities(m0, m_valid, n0);
    PhaseTimer::lap(BackwardPhase::kSoftmax);
    add_key_grads(dout, dropout ? w_.dropped_probs.data() : probs, dv_t(t));  // dV^T += dO^T (P * Z)
    // dP = dO V^T, then dS in place.
    gemm_bcast<kSet, Gemm>(m_valid, kN, head_dim, dout, head_dim, 1, v_t(t), kN, dscores, kN, nullptr, pf);
    PhaseTimer::lap(BackwardPhase::kScores);
    if (dropout) {
      score_gradients</*kDropout=*/true>(m0, m_valid);
    } else {
      score_gradients</*kDropout=*/false>(m0, m_valid);
    }
    PhaseTimer::lap(BackwardPhase::kSoftmax);
    add_key_grads(q, dscores, dk_t(t));  // dK^T += (scale Q)^T dS
    // dQ += dS K
    gemm_bcast<kAdd, Gemm>(m_valid, d_pad_, n_valid, dscores, kN, 1, k_rows(t), d_pad_,
                           w_.dq_acc.data() + (m0 - task_.row_begin) * d_pad_, d_pad_, nullptr, pf);
    PhaseTimer::lap(BackwardPhase::kQueryGrads);
  }

  /** GEMM micro-tiles of process_block on a full block (the turns PrefetchQueue gets). */
  int64_t micro_tiles_per_block() const {
    constexpr int64_t kN = Config::kBlockKeys, kM = Config::kBlockRows;
    constexpr int64_t kR = Config::Gemm::kRows, kColumns = kSimdWidth * Config::Gemm::kVecs;
    const int64_t key_passes = ceil_div(kN, kColumns), dq_passes = ceil_div(d_pad_, kColumns);
    return key_passes * (2 * ceil_div(kM, kR) + 2 * ceil_div(p_.head_dim, kR)) + dq_passes * ceil_div(kM, kR);
  }

  /** probs[r][j] = exp(s - lse) for allowed keys, else 0; under softcap also tanh' = 1 - t^2. The
   *  score s is the forward's: softcap, then the ALiBi bias (kAlibi: the call has slopes; a
   *  constant, so dS keeps its form). */
  template <bool kAlibi>
  void probabilities(const MaskInfo& mask, int64_t m0, int64_t m_valid, int64_t n0, int64_t n_valid) {
    constexpr int64_t kN = Config::kBlockKeys;
    const bool capped = p_.softcap > 0.f;
    // ALiBi: the bias of key n0 + j is neg_slope * |diagonal - j|, the row's diagonal key taken
    // relative to the tile; the distances are integers, exact in float below 2^24 (as the forward's).
    const Vec neg_slope = kAlibi ? Simd::set1(-p_.alibi_slope(task_.batch, task_.head)) : Simd::zero();
    const int64_t diagonal_shift = seq_.seqlen_k - seq_.seqlen_q - n0;
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
      const Vec diagonal = kAlibi ? Simd::set1(static_cast<float>(row + diagonal_shift)) : Simd::zero();
      Vec key = Simd::iota();
      const Vec step = Simd::set1(static_cast<float>(kSimdWidth));
      for (int64_t j = 0; j < kN; j += kSimdWidth, key = Simd::add(key, step)) {
        Vec x = Simd::load(s + j);
        if (capped) {
          const Vec t = vtanh(Simd::mul(x, inv_cap));
          x = Simd::mul(cap, t);
          Simd::store(tanh_grad + j, Simd::sub(one, Simd::mul(t, t)));
        }
        if constexpr (kAlibi) {
          const Vec d = Simd::sub(diagonal, key);
          x = Simd::fma(neg_slope, Simd::max(d, Simd::sub(Simd::zero(), d)), x);
        }
        const Vec prob = vexp_softmax(Simd::sub(x, row_lse));
        Simd::store(s + j, Simd::select(Simd::both(Simd::le(lo, key), Simd::lt(key, hi)), prob, Simd::zero()));
      }
    }
  }

  /** dropped_probs = P * Z for the block's rows (common/dropout.hpp's mask; Z = 1 / (1 - p) where
   *  kept, 0 where dropped). A key tile is one 64-key block: tasks start on KeySplit's aligned
   *  chunks and step by kBlockKeys = 64. Keys past n_valid have P = 0. */
  void drop_probabilities(int64_t m0, int64_t m_valid, int64_t n0) {
    constexpr int64_t kN = Config::kBlockKeys;
    static_assert(kN == 64 && KeySplit::kKeyAlign % 64 == 0, "a key tile is one 64-key block of the mask");
    const int64_t bh = task_.batch * p_.heads_q + task_.head;
    for (int64_t r = 0; r < m_valid; ++r) {
      scale_kept_row(w_.probs.data() + r * kN, keep_bits_of_block(p_.dropout, bh, m0 + r, n0 / 64),
                     p_.dropout.keep_scale, w_.dropped_probs.data() + r * kN);
    }
  }

  /** dS = P * (dP - D_i), times tanh' under softcap (the scale is in Q for dK, applied to dQ last).
   *  kDropout: dP is first multiplied by Z, read back from dropped_probs (nonzero exactly where P
   *  is nonzero and kept; where P is 0, dS is 0 either way). */
  template <bool kDropout>
  void score_gradients(int64_t m0, int64_t m_valid) {
    constexpr int64_t kN = Config::kBlockKeys;
    const bool capped = p_.softcap > 0.f;
    const Vec keep_scale = Simd::set1(p_.dropout.keep_scale);
    for (int64_t r = 0; r < m_valid; ++r) {
      const float* prob = w_.probs.data() + r * kN;
      const float* dropped = w_.dropped_probs.data() + r * kN;
      const float* tanh_grad = w_.tanh_grad.data() + r * kN;
      float* ds = w_.dscores.data() + r * kN;
      const Vec delta = Simd::set1(w_.delta.data()[m0 - task_.row_begin + r]);
      for (int64_t j = 0; j < kN; j += kSimdWidth) {
        Vec dp = Simd::load(ds + j);
        if constexpr (kDropout) {
          const Vec z = Simd::select(Simd::eq(Simd::load(dropped + j), Simd::zero()), Simd::zero(), keep_scale);
          dp = Simd::mul(dp, z);
        }
        Vec g = Simd::mul(Simd::load(prob + j), Simd::sub(dp, delta));
        if (capped) g = Simd::mul(g, Simd::load(tanh_grad + j));
        Simd::store(ds + j, g);
      }
    }
  }

  /** dK and dV rows of key tile t (transposed back): to the outputs, or to this head's partials. */
  void write_key_grads(int64_t t) {
    constexpr int64_t kN = Config::kBlockKeys;
    const int64_t head_dim = p_.head_dim;
    const int64_t n0 = tiles_[t].n0, n_valid = tiles_[t].n_valid;
    const bool have_grads = tiles_[t].have_grads;
    // Rows of this block: straight into this head's partials (consecutive rows), or staged.
    float* dk_rows = w_.dk_rows.data();
    float* dv_rows = w_.v_rows.data();
    if (partials_) {
      const int64_t row = partials_->row_index(p_, task_.batch, seq_, n0);
      dk_rows = partials_->dk_row(p_, task_.head, row);
      dv_rows = partials_->dv_row(p_, task_.head, row);
    }
    if (have_grads) {
      transpose(dk_t(t), kN, head_dim, n_valid, dk_rows, head_dim);
      transpose(dv_t(t), kN, head_dim, n_valid, dv_rows, head_dim);
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
    for (int64_t i = 0; i < task_.rows() * d_pad_; i += kSimdWidth) {
      Simd::store(sum + i, Simd::add(Simd::load(sum + i), Simd::load(acc + i)));
      Simd::store(acc + i, Simd::zero());
    }
  }

  /** The task's dQ rows `dq` [rows x D_pad]: unscaled to its partials (a task of a split head),
   *  else times softmax_scale to the output. */
  void write_dq(const float* dq) {
    if (dq_partials_) {
      float* out = dq_partials_->rows_of(task_);
      for (int64_t i = 0; i < task_.rows(); ++i) {
        std::copy(dq + i * d_pad_, dq + i * d_pad_ + p_.head_dim, out + i * p_.head_dim);
      }
      return;
    }
    float* row = w_.row_a.data();
    const int64_t row_bytes = p_.head_dim * static_cast<int64_t>(dtype_size(p_.dtype));
    for (int64_t i = 0; i < seq_.seqlen_q; ++i) {  // one chunk: the task's rows are the head's
      if (i + Config::kPrefetchRows < seq_.seqlen_q) {
        prefetch_rows(element_ptr(p_.dq, p_.dtype, task_.batch, seq_.q_start + i + Config::kPrefetchRows, task_.head), 1, 0,
                      row_bytes, /*for_write=*/true);
      }
      const float* acc = dq + i * d_pad_;
      for (int64_t d = 0; d < p_.head_dim; ++d) row[d] = acc[d] * p_.softmax_scale;
      store_row(p_.dtype, row, p_.head_dim, element_ptr_mut(p_.dq, p_.dtype, task_.batch, seq_.q_start + i, task_.head));
    }
  }

  const BackwardParams& p_;
  BackwardScratch<Config>& w_;
  GqaPartials* partials_;
  DqPartials* dq_partials_;
  const int64_t d_pad_;
  BackwardTask task_{};  // the current task
  KeyTile tiles_[Config::kGroupTiles];  // the current group's key tiles
  int64_t kv_head_ = 0;  // derived from it
  SeqInfo seq_{};
};


/** The AVX-512 backward on Config's tiles with key chunks of at least min_chunk_keys keys;
 *  PhaseTimer::lap(phase) ends each phase of a task (dev/cpu_backward_sweep.cpp's PHASES=1). */
template <class Config, class PhaseTimer = NoBackwardTimer>
Status avx_flash_backward_tiles(const BackwardParams& p, int64_t min_chunk_keys,
                                int64_t tasks_wanted = kKeySplitTasksWanted) {
  return run_backward_tasks<PhaseTimer>(p, choose_key_split(p, min_chunk_keys, tasks_wanted), /*may_fold=*/true,
                            [&](TaskQueue& queue, const std::vector<BackwardTask>& tasks, const TaskSinks& sinks) {
    BackwardScratch<Config> scratch;
    scratch.reserve(p.seqlen_q, p.head_dim);
    BackwardTaskRunner<Config, PhaseTimer> runner(p, scratch, sinks);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) runner.run(tasks[static_cast<size_t>(t)]);
  });
}

}  // namespace backward_detail
}  // namespace cpu
}  // namespace flashcore
