// The cpu_flash backward on Intel AMX for fp16 and bf16 inputs: the FlashAttention-2 gradients of
// flash_backward.cpp (recomputed P from the forward's lse, fp32 accumulation), with all five GEMMs
// on the tile unit. Tile layouts, the split into bf16 parts and the instructions: amx_tiles.hpp.
//
// Transposed scores. Per tile of kKeys keys and group of kGroup query rows the kernel computes
// S^T = K Q^T and dP^T = V dO^T, [keys x rows], as FlashAttention's GPU backwards do: then
//   P^T = exp(scale S^T - lse)           (lse, D per column: a vector load, no reduction)
//   dS^T = P^T * (dP^T - D)  [* tanh']
// are the A operands of dV += P^T dO and dK += dS^T Q exactly as written (row-major [keys x
// rows]), and dQ^T += K^T dS^T takes dS^T with its key rows paired, which the same pass writes.
// So no score tile is ever transposed. The B operands come from per-task packs of Q and dO (both
// pair layouts) and the A operands from per-key-tile packs of K, V and K^T. dK and dV accumulate
// in fp32 [keys x d] per key tile; dQ^T in fp32 [d x 32] panels, one per 32 query rows of the
// task (a [d x rows] matrix would put an accumulator tile's 16 rows a whole sequence apart, all
// in one L1 set), transposed once at the end.
//
// Exactness, as amx_forward_kernel.hpp: fp16 values take two bf16 parts, bf16 one.
//   S^T, dP^T: parts of inputs, products with index sum <= 2 (fp16: 4, all of them): exact.
//   P, dS: fp32 values rounded to the input dtype in TESTING.md's X_same; here as many parts as
//   the inputs (fp16: 16 bits, finer than fp16's 11), products with index sum <= parts - 1 (fp16:
//   3 of 4; the dropped part-1 x part-1 term is below 2^-16 of the product).
// fp16 / bf16 queries are not prescaled (their parts stay exact): scores are scaled in the
// softmax, and dK, dQ are multiplied by softmax_scale when written.
//
// Built only where FLASHCORE_AMX_BUILT (amx_tiles.hpp); amx_backward.cpp instantiates it with the
// shipped tile sizes.
#pragma once

#include "cpu/amx_tiles.hpp"

#if FLASHCORE_AMX_BUILT
#include <cstring>
#include <vector>

#include "cpu/backward_tasks.hpp"

namespace flashcore {
namespace cpu {
namespace amx_backward_detail {

using namespace flash_detail;
using namespace amx_tiles;
using namespace backward_detail;

// Input rows of one head sit heads * head_dim elements apart, a stride the hardware prefetcher
// does not follow: rows read or written in order are prefetched this many rows ahead.
constexpr int64_t kPrefetchRows = 8;

/** Per-thread buffers for key tiles of kKeys keys and query groups of kGroup rows, sized once per
 *  call for the longest query sequence. bf16 arrays live in AlignedFloats (two per float);
 *  "tiles" are amx_tiles.hpp's 1 KiB B tiles. */
template <int64_t kKeys, int64_t kGroup>
struct AmxBackwardScratch {
  static_assert(kKeys % 32 == 0 && kGroup % 32 == 0, "tiles come in 32 x 32 accumulator blocks");
  int64_t d_pad = 0;
  // Per task (rows_pad = the head's query rows rounded up to 32):
  AlignedFloats q_cols;      // B of S^T = K Q^T: [parts][d_pad / 32][rows_pad / 16] tiles
  AlignedFloats dout_cols;   // B of dP^T = V dO^T: the same for dO
  AlignedFloats q_pairs;     // B of dK += dS^T Q: [parts][rows_pad / 32][d_pad / 16] tiles
  AlignedFloats dout_pairs;  // B of dV += P^T dO: the same for dO
  AlignedFloats dq_t;        // [rows_pad / 32][d_pad x 32] fp32: dQ^T unscaled, in panels of 32 rows
  AlignedFloats lse, delta;  // [rows_pad] the forward's lse, D = rowsum(dO * O)
  AlignedFloats dout_row, out_row;  // [d_pad] rows on their way into D
  AlignedFloats q_stage, dout_stage;  // [32 x head_dim] input rows (input dtype) on their way into the packs
  // Per key tile:
  AlignedFloats k_rows;      // [kKeys x d_pad] fp32 K, zeros past the keys and head_dim
  AlignedFloats kt_rows;     // [d_pad x kKeys] fp32 K^T
  AlignedFloats k_parts;     // A of S^T: [parts][kKeys x d_pad] bf16
  AlignedFloats v_parts;     // A of dP^T: [parts][kKeys x d_pad] bf16
  AlignedFloats kt_parts;    // A of dQ^T: [parts][d_pad x kKeys] bf16
  AlignedFloats dk_acc, dv_acc;  // [kKeys x d_pad] fp32, dK unscaled
  // Per key tile and query group:
  AlignedFloats s_t, dp_t;   // [kKeys x kGroup] fp32
  AlignedFloats p_t, ds_t;   // A of dV / dK: [parts][kKeys x kGroup] bf16
  AlignedFloats ds_pairs;    // B of dQ^T: [parts][kKeys / 32][kGroup / 16] tiles
  std::vector<int32_t> first_key, end_key;  // [kGroup] each row's allowed keys in the tile
  AlignedFloats stage;       // pack_column_pairs' 16 rows: [parts][d_pad / 32] tiles
  AlignedFloats rows16;      // [16 x d_pad] dQ rows on their way out
  PrefetchQueue prefetch;    // the next key tile's K / V rows and this tile's dK / dV rows

  /** For `parts` bf16 parts per value (amx_tiles::parts_of the dtype): the per-task packs grow
   *  with the sequence, and bf16 needs half of fp16's. */
  void reserve(int64_t max_seqlen_q, int64_t head_dim, int parts) {
    d_pad = round_up(head_dim, kSlice);
    const int64_t rows_pad = round_up(std::max<int64_t>(max_seqlen_q, 1), 32);
    for (AlignedFloats* a : {&q_cols, &dout_cols, &q_pairs, &dout_pairs}) a->reserve(parts * rows_pad * d_pad / 2);
    dq_t.reserve(d_pad * rows_pad);
    lse.reserve(rows_pad);
    delta.reserve(rows_pad);
    dout_row.reserve(d_pad);
    out_row.reserve(d_pad);
    q_stage.reserve(32 * d_pad);  // 32 rows of any dtype
    dout_stage.reserve(32 * d_pad);
    k_rows.reserve(kKeys * d_pad);
    kt_rows.reserve(d_pad * kKeys);
    for (AlignedFloats* a : {&k_parts, &v_parts, &kt_parts}) a->reserve(parts * kKeys * d_pad / 2);
    dk_acc.reserve(kKeys * d_pad);
    dv_acc.reserve(kKeys * d_pad);
    s_t.reserve(kKeys * kGroup);
    dp_t.reserve(kKeys * kGroup);
    p_t.reserve(parts * kKeys * kGroup / 2);
    ds_t.reserve(parts * kKeys * kGroup / 2);
    ds_pairs.reserve(parts * kKeys * kGroup / 2);
    first_key.resize(kGroup);
    end_key.resize(kGroup);
    stage.reserve(parts * (d_pad / kSlice) * kTileUnits);
    rows16.reserve(16 * d_pad);
  }
};

inline uint16_t* bf16_of(AlignedFloats& a) { return reinterpret_cast<uint16_t*>(a.data()); }

template <int64_t kKeys, int64_t kGroup, class PhaseTimer>
class AmxBackwardRunner {
 public:
  AmxBackwardRunner(const BackwardParams& p, AmxBackwardScratch<kKeys, kGroup>& w, const TaskSinks& sinks)
      : p_(p), w_(w), partials_(sinks.gqa), dq_partials_(sinks.dq), d_pad_(w.d_pad), parts_(parts_of(p.dtype)),
        score_products_(parts_, parts_, 2), grad_products_(parts_, parts_, parts_ - 1) {}

  void run(const BackwardTask& task) {
    PhaseTimer::lap(BackwardPhase::kBetweenTasks);
    task_ = task;
    kv_head_ = task.head / p_.group_size();
    seq_ = seq_info(p_, task.batch);
    rows_pad_ = round_up(std::max<int64_t>(task.rows(), 1), 32);
    const MaskInfo mask = mask_info(p_, seq_);
    load_head();
    PhaseTimer::lap(BackwardPhase::kPackHead);
    for (int64_t n0 = task.key_begin; n0 < task.key_end; n0 += kKeys) {
      const int64_t n_valid = std::min(kKeys, task.key_end - n0);
      pack_key_tile(n0, n_valid);
      auto sees_tile = [&](int64_t g0) {
        return rows_see_keys(mask, g0, std::min(g0 + kGroup, task.row_end), n0, n0 + n_valid);
      };
      int64_t groups = 0;
      for (int64_t g0 = task.row_begin; g0 < task.row_end; g0 += kGroup) groups += sees_tile(g0);
      queue_prefetches(n0, n_valid, groups);
      PhaseTimer::lap(BackwardPhase::kPackKeys);
      for (int64_t g0 = task.row_begin; g0 < task.row_end; g0 += kGroup) {
        if (sees_tile(g0)) process_group(mask, n0, n_valid, g0, std::min(g0 + kGroup, task.row_end));
      }
      w_.prefetch.drain();
      write_key_grads(n0, n_valid);
      PhaseTimer::lap(BackwardPhase::kWrite);
    }
    write_dq();
    PhaseTimer::lap(BackwardPhase::kWrite);
  }

 private:
  /** The task's B operands from Q and dO (its rows task_.row_begin .. task_.row_end at local indices from 0, zero
   *  rows up to rows_pad), the lse and D per row, and a zeroed dQ^T. 32 rows at a time, each input row is read once: Q and dO rows are copied
   *  into contiguous stages (prefetched a few rows ahead), from which both packs of each are
   *  built. Reading the strided rows once per pack instead found them evicted: rows of one head
   *  sit heads * head_dim elements apart (4 KiB at H = 16, d = 128), all in a few sets of L2. */
  void load_head() {
    const int64_t slices = d_pad_ / kSlice, head_dim = p_.head_dim;
    const int64_t elem = static_cast<int64_t>(dtype_size(p_.dtype)), row_bytes = head_dim * elem;
    const int64_t pairs_part = (rows_pad_ / 32) * (d_pad_ / 16), col_tiles = d_pad_ / 16;
    char* q_stage = reinterpret_cast<char*>(w_.q_stage.data());
    char* dout_stage = reinterpret_cast<char*>(w_.dout_stage.data());
    for (int64_t r0 = 0; r0 < rows_pad_; r0 += 32) {
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t i = r0 + r, row = seq_.q_start + task_.row_begin + i;
        if (i >= task_.rows()) {
          w_.lse.data()[i] = 0.f;
          w_.delta.data()[i] = 0.f;
          continue;
        }
        if (i + kPrefetchRows < task_.rows()) {
          for (const TensorRef* t : {&p_.q, &p_.dout, &p_.out}) {
            prefetch_rows(element_ptr(*t, p_.dtype, task_.batch, row + kPrefetchRows, task_.head), 1, 0, row_bytes);
          }
        }
        std::memcpy(q_stage + r * row_bytes, element_ptr(p_.q, p_.dtype, task_.batch, row, task_.head), row_bytes);
        std::memcpy(dout_stage + r * row_bytes, element_ptr(p_.dout, p_.dtype, task_.batch, row, task_.head), row_bytes);
        load_row(p_.dtype, dout_stage + r * row_bytes, head_dim, w_.dout_row.data());
        load_row(p_.dtype, element_ptr(p_.out, p_.dtype, task_.batch, row, task_.head), head_dim, w_.out_row.data());
        w_.delta.data()[i] = dot(w_.dout_row.data(), w_.out_row.data(), head_dim);
        w_.lse.data()[i] = p_.lse.data[task_.batch * p_.lse.batch_stride + task_.head * p_.lse.head_stride + row * p_.lse.row_stride];
      }
      const int64_t valid = std::min<int64_t>(32, task_.rows() - r0);
      auto q_at = [&](int64_t r) -> const void* { return r < valid ? q_stage + r * row_bytes : nullptr; };
      auto dout_at = [&](int64_t r) -> const void* { return r < valid ? dout_stage + r * row_bytes : nullptr; };
      const int64_t col_tile = (r0 / 16) * kTileUnits, pair_tile = (r0 / 32) * col_tiles * kTileUnits;
      pack_column_pairs(p_.dtype, q_at, 32, head_dim, d_pad_, parts_, w_.stage.data(), w_.q_cols.data() + col_tile,
                        rows_pad_ / 16, slices * (rows_pad_ / 16));
      pack_column_pairs(p_.dtype, dout_at, 32, head_dim, d_pad_, parts_, w_.stage.data(),
                        w_.dout_cols.data() + col_tile, rows_pad_ / 16, slices * (rows_pad_ / 16));
      pack_row_pairs(p_.dtype, q_at, 32, head_dim, d_pad_, parts_, w_.q_pairs.data() + pair_tile, pairs_part);
      pack_row_pairs(p_.dtype, dout_at, 32, head_dim, d_pad_, parts_, w_.dout_pairs.data() + pair_tile, pairs_part);
    }
    std::fill(w_.dq_t.data(), w_.dq_t.data() + d_pad_ * rows_pad_, 0.f);
  }

  /** K and V rows n0 .. n0 + n_valid as the tile's A operands (K, V row-major; K^T row-major),
   *  zeros past the keys; dK, dV accumulators zeroed. */
  void pack_key_tile(int64_t n0, int64_t n_valid) {
    const int64_t head_dim = p_.head_dim;
    float* k_rows = w_.k_rows.data();
    for (int64_t n = 0; n < kKeys; ++n) {
      float* k = k_rows + n * d_pad_;
      const bool valid = n < n_valid;
      if (valid) load_row(p_.dtype, element_ptr(p_.k, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_), head_dim, k);
      std::fill(k + (valid ? head_dim : 0), k + d_pad_, 0.f);
      const void* v = valid ? element_ptr(p_.v, p_.dtype, task_.batch, seq_.k_start + n0 + n, kv_head_) : nullptr;
      split_row(p_.dtype, v, head_dim, d_pad_, parts_, bf16_of(w_.v_parts) + n * d_pad_, kKeys * d_pad_);
      split_row(DType::F32, k, d_pad_, d_pad_, parts_, bf16_of(w_.k_parts) + n * d_pad_, kKeys * d_pad_);
    }
    transpose(k_rows, d_pad_, kKeys, d_pad_, w_.kt_rows.data(), kKeys);
    for (int64_t c = 0; c < d_pad_; ++c) {
      split_row(DType::F32, w_.kt_rows.data() + c * kKeys, kKeys, kKeys, parts_, bf16_of(w_.kt_parts) + c * kKeys,
                d_pad_ * kKeys);
    }
    std::fill(w_.dk_acc.data(), w_.dk_acc.data() + kKeys * d_pad_, 0.f);
    std::fill(w_.dv_acc.data(), w_.dv_acc.data() + kKeys * d_pad_, 0.f);
  }

  /** Queues the next key tile's K and V rows (read by the next pack_key_tile) and, without GQA
   *  partials, this tile's dK and dV rows (written at its end) on the prefetch queue, paced over
   *  the accumulator stores of the tile's `groups` query groups (PrefetchQueue::issue). */
  void queue_prefetches(int64_t n0, int64_t n_valid, int64_t groups) {
    const int64_t elem = static_cast<int64_t>(dtype_size(p_.dtype)), row_bytes = p_.head_dim * elem;
    const int64_t next_rows = std::min(kKeys, task_.key_end - n0 - kKeys);
    if (next_rows > 0) {
      for (const TensorRef* t : {&p_.k, &p_.v}) {
        w_.prefetch.add(element_ptr(*t, p_.dtype, task_.batch, seq_.k_start + n0 + kKeys, kv_head_), next_rows,
                        t->row_stride * elem, row_bytes);
      }
    }
    if (!partials_) {
      for (const TensorRef* t : {&p_.dk, &p_.dv}) {
        w_.prefetch.add(element_ptr(*t, p_.dtype, task_.batch, seq_.k_start + n0, kv_head_), n_valid, t->row_stride * elem,
                        row_bytes, /*for_write=*/true);
      }
    }
    const int64_t kc = kKeys / 32, rb = kGroup / 32, dc = d_pad_ / 32;
    w_.prefetch.pace(groups * (2 * kc * rb + 2 * kc * dc + dc * rb));
  }

  /** The group of query rows g0 .. g_end (rows of the sequence; the task's buffers hold them from
   *  l0 = g0 - task_.row_begin) against the key tile n0 .. n0 + n_valid. */
  void process_group(const MaskInfo& mask, int64_t n0, int64_t n_valid, int64_t g0, int64_t g_end) {
    const int64_t key_chunks = ceil_div(n_valid, int64_t{32});
    const int64_t row_blocks = ceil_div(g_end - g0, int64_t{32});
    const int64_t l0 = g0 - task_.row_begin;
    transposed_scores(bf16_of(w_.k_parts), bf16_of(w_.q_cols), w_.s_t.data(), l0, key_chunks, row_blocks);
    transposed_scores(bf16_of(w_.v_parts), bf16_of(w_.dout_cols), w_.dp_t.data(), l0, key_chunks, row_blocks);
    PhaseTimer::lap(BackwardPhase::kScores);
    for (int64_t r = 0; r < row_blocks * 32; ++r) {
      const int64_t row = g0 + r;
      int64_t lo = 0, hi = 0;  // rows past the sequence and rows without any key see nothing
      if (row < g_end && w_.lse.data()[l0 + r] != kNegInf) {
        const KeyRange keys = mask.keys_for_row(row);
        lo = std::clamp<int64_t>(keys.begin - n0, 0, n_valid);
        hi = std::clamp<int64_t>(keys.end - n0, 0, n_valid);
      }
      w_.first_key[static_cast<size_t>(r)] = static_cast<int32_t>(lo);
      w_.end_key[static_cast<size_t>(r)] = static_cast<int32_t>(std::max(lo, hi));
    }
    // Every row of the group sees every key of the tile, and no chunk has padding keys: no mask.
    const bool unmasked = n_valid == key_chunks * 32 && g0 + row_blocks * 32 == g_end &&
                          mask.tile_fully_visible(g0, g_end, n0, n0 + n_valid);
    // ALiBi: query row g0 + c sits at distance |diagonal(g0) - n0 + c - j| from key n0 + j.
    const float alibi_base = static_cast<float>(mask.diagonal(g0) - n0);
    if (p_.has_alibi()) {
      probabilities_for<true>(unmasked, l0, key_chunks, row_blocks, alibi_base);
    } else {
      probabilities_for<false>(unmasked, l0, key_chunks, row_blocks, alibi_base);
    }
    PhaseTimer::lap(BackwardPhase::kSoftmax);
    const int64_t pairs_part = (rows_pad_ / 32) * (d_pad_ / 16);
    accumulate_key_grads(bf16_of(w_.p_t), bf16_of(w_.dout_pairs), pairs_part, w_.dv_acc.data(), l0, key_chunks,
                         row_blocks);
    accumulate_key_grads(bf16_of(w_.ds_t), bf16_of(w_.q_pairs), pairs_part, w_.dk_acc.data(), l0, key_chunks,
                         row_blocks);
    PhaseTimer::lap(BackwardPhase::kKeyGrads);
    accumulate_dq(l0, key_chunks, row_blocks);
    PhaseTimer::lap(BackwardPhase::kQueryGrads);
  }

  /** out[kKeys x kGroup] (the first key_chunks x row_blocks 32 x 32 blocks) = A B^T for A a key
   *  tile's row-major parts (K or V) and B the task's column-pair tiles (Q or dO) from its row l0. */
  void transposed_scores(const uint16_t* a_parts, const uint16_t* b_cols, float* out, int64_t l0, int64_t key_chunks,
                         int64_t row_blocks) {
    const int64_t slices = d_pad_ / kSlice, b_part = slices * (rows_pad_ / 16) * kTileUnits * 2;
    for (int64_t kc = 0; kc < key_chunks; ++kc) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        zero_accumulators();
        for (int64_t slice = 0; slice < slices; ++slice) {
          for (int pi = 0; pi < score_products_.count; ++pi) {
            if (pi == 0 || score_products_.a[pi] != score_products_.a[pi - 1]) {
              load_a(a_parts + score_products_.a[pi] * kKeys * d_pad_ + kc * 32 * d_pad_ + slice * kSlice, d_pad_);
            }
            const int64_t tile = slice * (rows_pad_ / 16) + (l0 + rb * 32) / 16;
            multiply_accumulate(b_cols + score_products_.b[pi] * b_part + tile * kTileUnits * 2);
          }
        }
        store_accumulators(out + kc * 32 * kGroup + rb * 32, kGroup);
        w_.prefetch.issue();
      }
    }
  }

  /** probabilities_and_gradients for this call's parts and the group's mask. */
  template <bool kAlibi>
  void probabilities_for(bool unmasked, int64_t l0, int64_t key_chunks, int64_t row_blocks, float alibi_base) {
    if (parts_ == 1) {
      unmasked ? probabilities_and_gradients<false, 1, kAlibi>(l0, key_chunks, row_blocks, alibi_base)
               : probabilities_and_gradients<true, 1, kAlibi>(l0, key_chunks, row_blocks, alibi_base);
    } else {
      unmasked ? probabilities_and_gradients<false, 2, kAlibi>(l0, key_chunks, row_blocks, alibi_base)
               : probabilities_and_gradients<true, 2, kAlibi>(l0, key_chunks, row_blocks, alibi_base);
    }
  }

  /** P^T and dS^T from S^T and dP^T, as the row-major parts p_t / ds_t and, for dQ^T, dS^T's
   *  parts with key rows paired (ds_pairs). Keys are visited two at a time for the pairing.
   *  kMasked: apply each row's key range (first_key / end_key); kParts: parts_ (1 for bf16, whose
   *  one rounding of dS serves both layouts); kAlibi: the scores get the bias -slope * |distance|
   *  after softcap (a constant of the score: dS keeps its form), the distance of row column c and
   *  key row j being alibi_base + c - j. A template argument so calls without ALiBi keep their loop. */
  template <bool kMasked, int kParts, bool kAlibi>
  void probabilities_and_gradients(int64_t l0, int64_t key_chunks, int64_t row_blocks, float alibi_base) {
    const bool capped = p_.softcap > 0.f;
    const __m512 neg_slope = _mm512_set1_ps(kAlibi ? -p_.alibi_slope(task_.batch, task_.head) : 0.f);
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_set1_ps(p_.softmax_scale), log2e = _mm512_set1_ps(ExpConstants::kLog2e);
    const __m512 cap = _mm512_set1_ps(p_.softcap), inv_cap = _mm512_set1_ps(capped ? 1.f / p_.softcap : 0.f);
    const __m512 one = _mm512_set1_ps(1.f);
    const int64_t cols = row_blocks * 32, part = kKeys * kGroup;  // bf16 per part of p_t / ds_t
    const int64_t pair_part = (kKeys / 32) * (kGroup / 16) * kTileUnits;  // units per part of ds_pairs
    uint16_t* p_t = bf16_of(w_.p_t);
    uint16_t* ds_t = bf16_of(w_.ds_t);
    uint32_t* ds_pairs = reinterpret_cast<uint32_t*>(w_.ds_pairs.data());
    for (int64_t j = 0; j < key_chunks * 32; j += 2) {  // rows of S^T in order, two at a time
      for (int64_t c = 0; c < cols; c += 16) {
        const __m512 lse = _mm512_loadu_ps(w_.lse.data() + l0 + c);
        const __m512 delta = _mm512_loadu_ps(w_.delta.data() + l0 + c);
        __m512 ds[2];
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t at = (j + h) * kGroup + c;
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w_.s_t.data() + at), scale);
          __m512 tanh_grad = one;
          if (capped) {
            const __m512 t = vtanh(_mm512_mul_ps(x, inv_cap));
            x = _mm512_mul_ps(cap, t);
            tanh_grad = _mm512_sub_ps(one, _mm512_mul_ps(t, t));
          }
          if constexpr (kAlibi) {
            const __m512 d = _mm512_add_ps(_mm512_set1_ps(alibi_base + static_cast<float>(c - (j + h))), lanes);
            x = _mm512_fmadd_ps(neg_slope, _mm512_abs_ps(d), x);
          }
          __m512 prob = vexp2_softmax(_mm512_mul_ps(_mm512_sub_ps(x, lse), log2e));
          if (kMasked) {
            const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(j + h));
            const __m512i lo = _mm512_loadu_si512(w_.first_key.data() + c);
            const __m512i hi = _mm512_loadu_si512(w_.end_key.data() + c);
            prob = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(lo, key) & _mm512_cmplt_epi32_mask(key, hi), prob);
          }
          ds[h] = _mm512_mul_ps(prob, _mm512_sub_ps(_mm512_loadu_ps(w_.dp_t.data() + at), delta));
          if (capped) ds[h] = _mm512_mul_ps(ds[h], tanh_grad);
          split16(prob, kParts, p_t + at, part);
          if (kParts > 1) split16(ds[h], kParts, ds_t + at, part);
        }
        const int64_t tile = (j / 32) * (kGroup / 16) + c / 16;
        uint32_t* pair_row = ds_pairs + tile * kTileUnits + ((j % 32) / 2) * 16;
        if (kParts == 1) {  // dS rounded once, stored row-major and paired
          __m256bh h0 = _mm512_cvtneps_pbh(ds[0]), h1 = _mm512_cvtneps_pbh(ds[1]);
          const __m256i b0 = reinterpret_cast<__m256i&>(h0), b1 = reinterpret_cast<__m256i&>(h1);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_t + j * kGroup + c), b0);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_t + (j + 1) * kGroup + c), b1);
          _mm512_storeu_si512(pair_row, _mm512_or_si512(_mm512_cvtepu16_epi32(b0),
                                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(b1), 16)));
        } else {
          split_pairs16(ds[0], ds[1], kParts, pair_row, pair_part);
        }
      }
    }
  }

  /** acc[kKeys x d_pad] += A B over the group's rows, for A the row-major parts of P^T or dS^T
   *  and B the task's row-pair tiles of dO or Q from its row l0. */
  void accumulate_key_grads(const uint16_t* a_parts, const uint16_t* b_pairs, int64_t b_part_tiles, float* acc,
                            int64_t l0, int64_t key_chunks, int64_t row_blocks) {
    const int64_t col_tiles = d_pad_ / 16;
    for (int64_t kc = 0; kc < key_chunks; ++kc) {
      for (int64_t c = 0; c < d_pad_; c += 32) {
        float* out = acc + kc * 32 * d_pad_ + c;
        load_accumulators(out, d_pad_);
        for (int64_t rb = 0; rb < row_blocks; ++rb) {
          for (int pi = 0; pi < grad_products_.count; ++pi) {
            if (pi == 0 || grad_products_.a[pi] != grad_products_.a[pi - 1]) {
              load_a(a_parts + grad_products_.a[pi] * kKeys * kGroup + kc * 32 * kGroup + rb * 32, kGroup);
            }
            const int64_t tile = ((l0 / 32) + rb) * col_tiles + c / 16;
            multiply_accumulate(b_pairs + (grad_products_.b[pi] * b_part_tiles + tile) * kTileUnits * 2);
          }
        }
        store_accumulators(out, d_pad_);
        w_.prefetch.issue();
      }
    }
  }

  /** dQ^T[:, l0 .. ] += K^T dS^T, in the group's panels (l0: the group's first row in the task). */
  void accumulate_dq(int64_t l0, int64_t key_chunks, int64_t row_blocks) {
    const uint16_t* kt = bf16_of(w_.kt_parts);
    const uint16_t* ds_pairs = bf16_of(w_.ds_pairs);
    const int64_t pair_part = (kKeys / 32) * (kGroup / 16) * kTileUnits * 2;  // bf16 per part
    for (int64_t dc = 0; dc < d_pad_; dc += 32) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        float* out = w_.dq_t.data() + (l0 / 32 + rb) * d_pad_ * 32 + dc * 32;
        load_accumulators(out, 32);
        for (int64_t kc = 0; kc < key_chunks; ++kc) {
          for (int pi = 0; pi < grad_products_.count; ++pi) {
            if (pi == 0 || grad_products_.a[pi] != grad_products_.a[pi - 1]) {
              load_a(kt + grad_products_.a[pi] * d_pad_ * kKeys + dc * kKeys + kc * 32, kKeys);
            }
            const int64_t tile = kc * (kGroup / 16) + rb * 2;
            multiply_accumulate(ds_pairs + grad_products_.b[pi] * pair_part + tile * kTileUnits * 2);
          }
        }
        store_accumulators(out, 32);
        w_.prefetch.issue();
      }
    }
  }

  /** dK (times softmax_scale) and dV rows of the tile: to the outputs, or to this head's partials. */
  void write_key_grads(int64_t n0, int64_t n_valid) {
    const int64_t head_dim = p_.head_dim;
    const __m512 scale = _mm512_set1_ps(p_.softmax_scale);
    float* dk = w_.dk_acc.data();
    const float* dv = w_.dv_acc.data();
    for (int64_t n = 0; n < n_valid; ++n) {
      float* dk_row = dk + n * d_pad_;
      for (int64_t c = 0; c < d_pad_; c += 16) {
        _mm512_storeu_ps(dk_row + c, _mm512_mul_ps(_mm512_loadu_ps(dk_row + c), scale));
      }
      const float* dv_row = dv + n * d_pad_;
      if (partials_) {
        const int64_t row = partials_->row_index(p_, task_.batch, seq_, n0 + n);
        std::copy(dk_row, dk_row + head_dim, partials_->dk_row(p_, task_.head, row));
        std::copy(dv_row, dv_row + head_dim, partials_->dv_row(p_, task_.head, row));
      } else {
        const int64_t key_row = seq_.k_start + n0 + n;
        store_row(p_.dtype, dk_row, head_dim, element_ptr_mut(p_.dk, p_.dtype, task_.batch, key_row, kv_head_));
        store_row(p_.dtype, dv_row, head_dim, element_ptr_mut(p_.dv, p_.dtype, task_.batch, key_row, kv_head_));
      }
    }
  }

  /** dQ = softmax_scale * (dQ^T)^T, 16 rows at a time; with several key chunks per head, the
   *  unscaled rows to the task's partials instead. */
  void write_dq() {
    float* rows = w_.rows16.data();
    if (dq_partials_) {
      float* out = dq_partials_->rows_of(task_);
      for (int64_t i0 = 0; i0 < task_.rows(); i0 += 16) {
        transpose(w_.dq_t.data() + (i0 / 32) * d_pad_ * 32 + i0 % 32, 32, d_pad_, 16, rows, d_pad_);
        for (int64_t i = i0; i < std::min(i0 + 16, task_.rows()); ++i) {
          std::copy(rows + (i - i0) * d_pad_, rows + (i - i0) * d_pad_ + p_.head_dim, out + i * p_.head_dim);
        }
      }
      return;
    }
    const __m512 scale = _mm512_set1_ps(p_.softmax_scale);
    const int64_t row_bytes = p_.head_dim * static_cast<int64_t>(dtype_size(p_.dtype));
    for (int64_t i0 = 0; i0 < seq_.seqlen_q; i0 += 16) {  // one chunk: the task's rows are the head's
      const int64_t ahead = std::min<int64_t>(16, seq_.seqlen_q - i0 - 16);  // the next 16 rows, for writing
      if (ahead > 0) {
        prefetch_rows(element_ptr_mut(p_.dq, p_.dtype, task_.batch, seq_.q_start + i0 + 16, task_.head), ahead,
                      p_.dq.row_stride * static_cast<int64_t>(dtype_size(p_.dtype)), row_bytes, /*for_write=*/true);
      }
      transpose(w_.dq_t.data() + (i0 / 32) * d_pad_ * 32 + i0 % 32, 32, d_pad_, 16, rows, d_pad_);
      for (int64_t i = i0; i < std::min(i0 + 16, seq_.seqlen_q); ++i) {
        float* row = rows + (i - i0) * d_pad_;
        for (int64_t c = 0; c < d_pad_; c += 16) _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), scale));
        store_row(p_.dtype, row, p_.head_dim, element_ptr_mut(p_.dq, p_.dtype, task_.batch, seq_.q_start + i, task_.head));
      }
    }
  }

  const BackwardParams& p_;
  AmxBackwardScratch<kKeys, kGroup>& w_;
  GqaPartials* partials_;
  DqPartials* dq_partials_;
  const int64_t d_pad_;
  const int parts_;
  const Products score_products_;  // S^T, dP^T: exact
  const Products grad_products_;   // dV, dK, dQ^T: P / dS as fine as the input dtype
  BackwardTask task_{};  // the current task
  int64_t kv_head_ = 0, rows_pad_ = 0;  // derived from it
  SeqInfo seq_{};
};

/** The backward on AMX for fp16 / bf16 inputs, on tiles of Keys keys and groups of Group query
 *  rows (both multiples of 32), heads split into key chunks of at least min_chunk_keys
 *  (backward_tasks.hpp; 0 = one task per head). Templates so that dev/cpu_backward_sweep.cpp can
 *  compare sizes and time their phases. */
template <int64_t Keys, int64_t Group, class PhaseTimer = NoBackwardTimer>
Status amx_flash_backward_split(const BackwardParams& p, int64_t min_chunk_keys) {
  return run_backward_tasks<PhaseTimer>(p, choose_key_split(p, min_chunk_keys), /*may_fold=*/false,
                            [&](TaskQueue& queue, const std::vector<BackwardTask>& tasks, const TaskSinks& sinks) {
    AmxBackwardScratch<Keys, Group> scratch;
    scratch.reserve(p.seqlen_q, p.head_dim, parts_of(p.dtype));
    const ScopedTiles tiles;  // per thread; released before the worker returns to the pool
    AmxBackwardRunner<Keys, Group, PhaseTimer> runner(p, scratch, sinks);
    for (int64_t t = queue.next(); t >= 0; t = queue.next()) runner.run(tasks[static_cast<size_t>(t)]);
  });
}

/** The same with the chunks' minimum as a template argument (a plain function pointer for the sweep). */
template <int64_t Keys, int64_t Group, int64_t MinChunkKeys, class PhaseTimer = NoBackwardTimer>
Status amx_flash_backward_with(const BackwardParams& p) {
  return amx_flash_backward_split<Keys, Group, PhaseTimer>(p, MinChunkKeys);
}

}  // namespace amx_backward_detail
}  // namespace cpu
}  // namespace flashcore

#endif  // FLASHCORE_AMX_BUILT
