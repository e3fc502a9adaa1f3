// cpu_flash forward: tiled online softmax (FlashAttention-2) on the CPU, fp32 accumulation.
//
// Work split: one task per (batch, kv head, up to 8 blocks of 48 "stacked" rows). A stacked row
// is a (query row, query head) pair of one GQA group, ordered query-row-major, so the query heads
// that share a KV head share every K/V tile (for MHA the group has one head and this is the usual
// (batch, head, query block) split). Inside a task the loop runs over K/V tiles and, per tile,
// over the task's blocks: each tile is copied (fp32) or converted (fp16/bf16) into contiguous
// rows once and used by every block. Tasks are independent; each thread owns its tiles, so
// memory is O(tile) per thread and never seqlen_q x seqlen_k.
//
// Layout choice: every tile is kept transposed, with the stacked rows along the SIMD lanes:
//   Q^T [D x M], S^T = K Q^T [N x M], O^T += V^T P^T [D x M].
// Then K and V are only ever read by scalar broadcast in their natural row layout, the per-row
// softmax state (max, sum, rescale factor) is one vector per 16 rows, and row max / row sum are
// vertical vector ops with no horizontal reductions. Only the row dimension is padded (to the
// SIMD width). Probabilities are vexp2_softmax((s - m) log2e). ALiBi's bias is added in the
// softmax's pass over the tile, from a slope and a diagonal per row (lane): a block's stacked rows
// mix query heads, each with its own slope.
//
// Relies on: cpu_common.hpp (Simd, vexp/vtanh, conversions, gemm_bcast, run_workers),
// params.hpp (seq_info, offset_of) and mask.hpp (keys_for_row(s), tile_fully_visible).
//
// The kernel is a template over its tile configuration (ForwardConfig below: block and tile
// sizes, the micro-tiles of its two GEMMs) so that dev/cpu_forward_sweep.cpp can time other
// configurations on a new CPU; flash_forward.cpp instantiates the ones the library ships.
#pragma once

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "api/backends.hpp"
#include "cpu/cpu_common.hpp"
#include "cpu/dropout_bits.hpp"

namespace flashcore {
namespace cpu {
namespace forward_detail {

using namespace flash_detail;

constexpr float kLog2e = ExpConstants::kLog2e;

/** Phases of a forward task, for dev/cpu_forward_sweep.cpp's split of the time (PHASES=1). */
enum class ForwardPhase { kBetweenTasks, kRows, kCopy, kScores, kSoftmax, kOutput, kCount };

/** What the shipped configuration times: nothing (every lap compiles away). A configuration's
 *  PhaseTimer::lap(phase) is called at the end of each phase of a task; a timing one charges the
 *  time since its previous lap on this thread to `phase`. */
struct NoPhaseTimer {
  static void lap(ForwardPhase) {}
};

/** The configuration the library ships (every head_dim); a configuration is any struct with these
 *  members. Chosen with dev/cpu_forward_sweep.cpp on two CPUs (docs/PERF.md, session 8): against
 *  the earlier 64-row blocks with 8 x 2 micro-tiles (and 128-key tiles, 16 blocks per task from
 *  d = 128), the GPU machine's Xeon ran 3-23% faster at 2 and 16 threads, the development EPYC
 *  -6% to +4%. */
struct ForwardConfig {
  static constexpr const char* kName = "48 rows x 64 keys, 8 blocks per task, GEMMs 8x3";
  // Micro-tiles of S^T = K Q^T and O^T += V^T P^T (cpu_common.hpp). A block's rows are the
  // micro-tile's columns: 48 = 3 vectors of 16, one micro-tile wide.
  using ScoreGemm = WideGemmTraits;
  using OutputGemm = WideGemmTraits;
  static constexpr int64_t kBlockRows = 48;  // stacked rows per block (a multiple of kSimdWidth)
  static constexpr int64_t kBlockKeys = 64;  // keys per K/V tile
  // Blocks per task: each K/V tile is copied (fp32) or converted (fp16/bf16) into contiguous
  // rows once per task and then used by every block of the task, so K/V are streamed from L3
  // once per 384 stacked rows instead of once per 48. Read in place, rows of one head are
  // H * D * 4 bytes apart (4-8 KiB at H = 16), a stride the hardware prefetcher does not follow
  // and that maps a micro-tile's broadcast rows onto one L1 set; copying them per block cost
  // more than it saved. Scratch per thread: 8 x (Q^T + O^T) = D x 3 KiB. Larger tasks (128-key
  // tiles, 16 blocks) gained 0-6% at d >= 128 on the EPYC but lost 6-8% at 16 threads on the
  // Xeon, where 16 blocks per task leave too few tasks to balance the threads.
  static constexpr int64_t kMaxBlocksPerTask = 8;
  // Tasks take fewer blocks where the call would otherwise have fewer than
  // max(kMinTasks, kTasksPerThread x threads) tasks, so that every thread gets work. Not more
  // than 2 per thread: halving the blocks per task doubles the K/V tile copies, measured at
  // +3-4% of a d=64 forward (4% -> 7-8% of the time) on the development EPYC. Results do not
  // depend on it: a block meets the same key tiles (on a grid of kBlockKeys from key 0) and
  // computes the same values in whichever task it runs.
  static constexpr int64_t kMinTasks = 32;
  static constexpr int64_t kTasksPerThread = 2;
  // Prefetches of the next K/V tile (and of the next task's rows) go out a few lines per GEMM
  // micro-tile (PrefetchQueue); false sends each tile's in one burst, the old way, for the sweep.
  static constexpr bool kPacedPrefetch = true;
  using PhaseTimer = NoPhaseTimer;
};

struct ForwardTask {
  int64_t batch;
  int64_t kv_head;
  int64_t first_row;  // first stacked row: query row first_row / group, head first_row % group
  int64_t rows;       // stacked rows of the task (blocks of kBlockRows, the last one may be short)
  int64_t cost;       // rows x visible keys, for longest-first scheduling
};

/** Walks the stacked rows of a block: (query row within the sequence, query head). Stepping
 *  instead of dividing keeps 64-bit divisions out of the per-row loops. */
struct StackedRow {
  int64_t q_row;
  int64_t head;

  static StackedRow first_of(int64_t first_row, int64_t kv_head, int64_t group) {
    return {first_row / group, kv_head * group + first_row % group};
  }
  void advance(int64_t group, int64_t kv_head) {
    if (++head == (kv_head + 1) * group) {
      head = kv_head * group;
      ++q_row;
    }
  }
};

/** Per-thread tiles; sized once per call for the largest task. Per-block arrays hold
 *  kMaxBlocksPerTask slices of kBlockRows (row state) or D x kBlockRows (Q^T, O^T). */
struct ForwardScratch {
  AlignedFloats q_t;       // [blocks][D x M]
  AlignedFloats o_t;       // [blocks][D x M] unnormalized output
  AlignedFloats s_t;       // [N x M] scores, then probabilities
  AlignedFloats k_rows;    // [N x D] K tile as contiguous fp32 rows
  AlignedFloats v_rows;    // [N x D] V tile as contiguous fp32 rows
  AlignedFloats stage;     // [M x D] rows on their way into Q^T or out of O^T
  AlignedFloats row_max;   // [blocks][M] running max m
  AlignedFloats row_sum;   // [blocks][M] running sum l
  AlignedFloats rescale;   // [M] exp(m_old - m_new) of the current tile
  AlignedFloats tile_max;  // [M] max score of each row in the current tile
  AlignedFloats key_lo;    // [M] first allowed key, relative to the current tile
  AlignedFloats key_hi;    // [M] one past the last allowed key, relative to the current tile
  // ALiBi only (reserved when the call has slopes): per stacked row, -slope of its query head and
  // q_row + seqlen_k - seqlen_q, the key on its diagonal (distance 0); padding rows 0 and 0.
  AlignedFloats alibi_neg_slope;  // [blocks][M]
  AlignedFloats alibi_diagonal;   // [blocks][M]
  std::vector<KeyRange> row_keys;  // [blocks][M] keys_for_row of each stacked row
  PrefetchQueue prefetch;          // next K/V tile, next task's queries, this task's outputs

  template <class Config>
  void reserve(int64_t head_dim, bool alibi) {
    const int64_t m = Config::kBlockRows, n = Config::kBlockKeys;
    const int64_t blocks = Config::kMaxBlocksPerTask;
    q_t.reserve(blocks * head_dim * m);
    o_t.reserve(blocks * head_dim * m);
    s_t.reserve(n * m);
    k_rows.reserve(n * head_dim);
    v_rows.reserve(n * head_dim);
    stage.reserve(m * head_dim);
    row_max.reserve(blocks * m);
    row_sum.reserve(blocks * m);
    for (AlignedFloats* a : {&rescale, &tile_max, &key_lo, &key_hi}) a->reserve(m);
    if (alibi) {
      for (AlignedFloats* a : {&alibi_neg_slope, &alibi_diagonal}) a->reserve(blocks * m);
    }
    row_keys.resize(static_cast<size_t>(blocks * m));
  }
};

/** The stacked rows of one block of a task, the keys they may see, and where their softmax state
 *  lives: shared by the AVX-512 and AMX forwards (amx_forward_kernel.hpp). */
struct BlockRows {
  int64_t first_row;  // stacked row
  int64_t rows;
  int64_t first_q, last_q;  // query rows covered (inclusive)
  KeyRange keys;            // keys any of its rows may see
  float* row_max;
  float* row_sum;
  KeyRange* row_keys;
  float* alibi_neg_slope;  // ALiBi (set_alibi_rows): each row's -slope; null without ALiBi
  float* alibi_diagonal;   // ... and its diagonal key

  /** Whether any row of the block may see a key of [n_begin, n_end). */
  bool overlaps(int64_t n_begin, int64_t n_end) const {
    return !keys.empty() && n_begin < keys.end && keys.begin < n_end;
  }

  /** Places the block at `first` (relative to the task) with up to `max_rows` rows, resets the
   *  state of its first `state_rows` rows (padding rows see no key), and widens `task_keys` to
   *  the keys it may see. The state pointers must be set. */
  void start(const ForwardTask& task, int64_t first, int64_t max_rows, int64_t state_rows, const MaskInfo& mask,
             int64_t group, KeyRange& task_keys) {
    first_row = task.first_row + first;
    rows = std::min(max_rows, task.rows - first);
    first_q = first_row / group;
    last_q = (first_row + rows - 1) / group;
    keys = mask.keys_for_rows(first_q, last_q + 1);
    StackedRow at = StackedRow::first_of(first_row, task.kv_head, group);
    for (int64_t r = 0; r < state_rows; ++r, at.advance(group, task.kv_head)) {
      row_keys[r] = r < rows ? mask.keys_for_row(at.q_row) : KeyRange{0, 0};
      row_max[r] = kNegInf;
      row_sum[r] = 0.f;
    }
    if (!keys.empty()) {
      task_keys = task_keys.empty()
                      ? keys
                      : KeyRange{std::min(task_keys.begin, keys.begin), std::max(task_keys.end, keys.end)};
    }
  }

  /** alibi_neg_slope / alibi_diagonal (which must be set): each stacked row's -slope and its
   *  diagonal key (q_row + seqlen_k - seqlen_q), from which the softmaxes derive integer
   *  distances, exact in float below 2^24 (lengths under 16M); rows from `rows` to `pad_rows` get
   *  0 (no bias). Shared by the AVX-512 and the AMX forward. */
  void set_alibi_rows(const AttentionParams& p, const ForwardTask& task, const SeqInfo& seq, int64_t pad_rows) const {
    const int64_t group = p.group_size();
    const int64_t diagonal_shift = seq.seqlen_k - seq.seqlen_q;
    StackedRow at = StackedRow::first_of(first_row, task.kv_head, group);
    for (int64_t r = 0; r < rows; ++r, at.advance(group, task.kv_head)) {
      alibi_neg_slope[r] = -p.alibi_slope(task.batch, at.head);
      alibi_diagonal[r] = static_cast<float>(at.q_row + diagonal_shift);
    }
    std::fill(alibi_neg_slope + rows, alibi_neg_slope + pad_rows, 0.f);
    std::fill(alibi_diagonal + rows, alibi_diagonal + pad_rows, 0.f);
  }
};

/** One block of up to kBlockRows stacked rows of the AVX-512 forward. */
struct Block : BlockRows {
  int64_t m_pad;
  bool started;  // O^T holds a partial sum
  float* q_t;
  float* o_t;
};

/** Copies (fp32) or converts (fp16/bf16) `rows` K or V rows into contiguous fp32 [rows x D]. */
inline void load_kv_tile(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t first_row, int64_t rows,
                  int64_t kv_head, float* buffer) {
  for_kv_rows(p, t, b, first_row, rows, kv_head,
              [&](int64_t r, const void* row) { load_row(p.dtype, row, p.head_dim, buffer + r * p.head_dim); });
}

/** Queues the prefetch of `rows` K and V rows from first_row on: one range per page they touch
 *  (paged K/V). With only the first page's rows queued, pages of 16 keys left most of a tile
 *  unprefetched: paged prefill 5-26% slower than over the same keys unpaged (docs/PERF.md,
 *  session 33). */
inline void queue_kv_tile(const AttentionParams& p, int64_t b, int64_t first_row, int64_t rows, int64_t kv_head,
                          PrefetchQueue& queue) {
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  for (const TensorRef* t : {&p.k, &p.v}) {
    for_kv_runs(p, *t, b, first_row, rows, kv_head, [&](int64_t, const char* row, int64_t run) {
      queue.add(row, run, t->row_stride * elem, p.head_dim * elem);
    });
  }
}

/** Queues the rows of `t` (q or out) that a task covers: for each query head of its KV head,
 *  its query rows (a superset by at most one row per head at each end, all in bounds). */
inline void queue_task_rows(const AttentionParams& p, const ForwardTask& task, const TensorRef& t, bool for_write,
                            PrefetchQueue& queue) {
  const SeqInfo seq = seq_info(p, task.batch);
  const int64_t group = p.group_size();
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t first_q = task.first_row / group, last_q = (task.first_row + task.rows - 1) / group;
  for (int64_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
    queue.add(element_ptr(t, p.dtype, task.batch, seq.q_start + first_q, h), last_q - first_q + 1,
              t.row_stride * elem, p.head_dim * elem, for_write);
  }
}

template <class Config>
class ForwardTaskRunner {
  static_assert(Config::kBlockRows % kSimdWidth == 0, "row block must fill whole vectors");
  using ScoreGemm = typename Config::ScoreGemm;
  using OutputGemm = typename Config::OutputGemm;

 public:
  ForwardTaskRunner(const AttentionParams& p, ForwardScratch& scratch) : p_(p), w_(scratch) {}

  /** Runs `task`; `next` (may be null) is the task this worker will likely run next, whose
   *  query rows are prefetched during this task's last key tile. */
  void run(const ForwardTask& task, const ForwardTask* next) {
    using Phases = typename Config::PhaseTimer;
    Phases::lap(ForwardPhase::kBetweenTasks);
    const SeqInfo seq = seq_info(p_, task.batch);
    const MaskInfo mask = mask_info(p_, seq);
    const int64_t group = p_.group_size();
    const int64_t head_dim = p_.head_dim;
    constexpr int64_t kM = Config::kBlockRows;

    // Blocks of the task, their queries packed and their row state reset.
    Block blocks[Config::kMaxBlocksPerTask];
    int64_t num_blocks = 0;
    KeyRange keys{0, 0};
    for (int64_t first = 0; first < task.rows; first += kM, ++num_blocks) {
      Block& bl = blocks[num_blocks];
      const int64_t slot = num_blocks;
      bl.row_max = w_.row_max.data() + slot * kM;
      bl.row_sum = w_.row_sum.data() + slot * kM;
      bl.row_keys = w_.row_keys.data() + slot * kM;
      bl.start(task, first, kM, round_up(std::min(kM, task.rows - first), kSimdWidth), mask, group, keys);
      bl.m_pad = round_up(bl.rows, kSimdWidth);
      bl.started = false;
      bl.q_t = w_.q_t.data() + slot * head_dim * kM;
      bl.o_t = w_.o_t.data() + slot * head_dim * kM;
      bl.alibi_neg_slope = bl.alibi_diagonal = nullptr;
      if (p_.has_alibi()) {
        bl.alibi_neg_slope = w_.alibi_neg_slope.data() + slot * kM;
        bl.alibi_diagonal = w_.alibi_diagonal.data() + slot * kM;
        bl.set_alibi_rows(p_, task, seq, bl.m_pad);
      }
      pack_queries(task, seq, bl);
    }
    Phases::lap(ForwardPhase::kRows);

    constexpr int64_t kN = Config::kBlockKeys;
    // Tiles sit on a fixed grid (multiples of kN), so a block's tiles, and with them its
    // rounding, do not depend on the other blocks of its task.
    keys.begin = keys.begin / kN * kN;
    // Tile rows are 4 KiB or more apart in the input, a stride the hardware prefetcher does not
    // follow: the next tile, and in the last tile the next task's query rows and this task's
    // output rows, are prefetched a few lines per GEMM micro-tile while this tile is used.
    PrefetchQueue& prefetch = w_.prefetch;
    float* k_rows = w_.k_rows.data();
    float* v_rows = w_.v_rows.data();
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += kN) {
      const int64_t n_valid = std::min(kN, keys.end - n0);
      load_kv_tile(p_, p_.k, task.batch, seq.k_start + n0, n_valid, task.kv_head, k_rows);
      load_kv_tile(p_, p_.v, task.batch, seq.k_start + n0, n_valid, task.kv_head, v_rows);
      int64_t active_blocks = 0;
      for (int64_t bi = 0; bi < num_blocks; ++bi) active_blocks += blocks[bi].overlaps(n0, n0 + n_valid);
      if (n0 + kN < keys.end) {
        queue_kv_tile(p_, task.batch, seq.k_start + n0 + kN, std::min(kN, keys.end - n0 - kN), task.kv_head, prefetch);
      } else {
        queue_task_rows(p_, task, p_.out, /*for_write=*/true, prefetch);
        if (next) queue_task_rows(p_, *next, p_.q, /*for_write=*/false, prefetch);
      }
      prefetch.pace(Config::kPacedPrefetch ? active_blocks * micro_tiles_per_block(n_valid) : 1);
      Phases::lap(ForwardPhase::kCopy);
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        Block& bl = blocks[bi];
        if (!bl.overlaps(n0, n0 + n_valid)) continue;
        const int64_t n_block = std::min(n_valid, bl.keys.end - n0);  // keys of the tile this block may see
        const int64_t m_pad = bl.m_pad;
        // S^T[n][m] = sum_d K[n][d] * Q^T[d][m]; on unmasked, uncapped tiles without ALiBi the
        // GEMM also produces each row's max, sparing the softmax a pass over the tile.
        const bool full = mask.tile_fully_visible(bl.first_q, bl.last_q + 1, n0, n0 + n_block);
        const bool plain = full && p_.softcap <= 0.f && !p_.has_alibi();
        if (plain) {
          std::fill(w_.tile_max.data(), w_.tile_max.data() + m_pad, kNegInf);
          gemm_bcast<Accumulate::kOverwriteMax, ScoreGemm>(n_block, m_pad, head_dim, k_rows, head_dim, 1, bl.q_t,
                                                           m_pad, w_.s_t.data(), m_pad, w_.tile_max.data(), &prefetch);
        } else {
          gemm_bcast<Accumulate::kOverwrite, ScoreGemm>(n_block, m_pad, head_dim, k_rows, head_dim, 1, bl.q_t, m_pad,
                                                        w_.s_t.data(), m_pad, nullptr, &prefetch);
        }
        Phases::lap(ForwardPhase::kScores);
        if (!full) set_relative_key_bounds(bl, n0);
        // ALiBi as a template argument: without it the softmax's loops are the bias-free ones.
        if (p_.has_alibi()) {
          softmax_tile</*kAlibi=*/true>(bl, n0, n_block, full, plain);
        } else {
          softmax_tile</*kAlibi=*/false>(bl, n0, n_block, full, plain);
        }
        if (p_.dropout.enabled()) drop_probabilities(task, bl, n0, n_block);
        Phases::lap(ForwardPhase::kSoftmax);
        // O^T[d][m] = O^T[d][m] * rescale[m] + sum_n V[n][d] * P^T[n][m]
        if (!bl.started) {
          gemm_bcast<Accumulate::kOverwrite, OutputGemm>(head_dim, m_pad, n_block, v_rows, 1, head_dim,
                                                         w_.s_t.data(), m_pad, bl.o_t, m_pad, nullptr, &prefetch);
        } else {
          gemm_bcast<Accumulate::kScaleAdd, OutputGemm>(head_dim, m_pad, n_block, v_rows, 1, head_dim,
                                                        w_.s_t.data(), m_pad, bl.o_t, m_pad, w_.rescale.data(),
                                                        &prefetch);
        }
        bl.started = true;
        Phases::lap(ForwardPhase::kOutput);
      }
      prefetch.drain();  // whatever the micro-tiles left, before the next tile is loaded
      Phases::lap(ForwardPhase::kCopy);
    }
    for (int64_t bi = 0; bi < num_blocks; ++bi) write_outputs(task, seq, blocks[bi]);
    Phases::lap(ForwardPhase::kRows);
  }

 private:
  /** GEMM micro-tiles of one block on a tile of n keys (the turns PrefetchQueue gets). */
  int64_t micro_tiles_per_block(int64_t n) const {
    const int64_t score_passes = ceil_div(Config::kBlockRows, kSimdWidth * ScoreGemm::kVecs);
    const int64_t output_passes = ceil_div(Config::kBlockRows, kSimdWidth * OutputGemm::kVecs);
    return score_passes * ceil_div(n, ScoreGemm::kRows) + output_passes * ceil_div(p_.head_dim, OutputGemm::kRows);
  }


  /** Q^T[d][r] * softmax_scale for the block's stacked rows (scaling Q once spares a multiply
   *  per score); padding rows are zero so their scores stay finite. */
  void pack_queries(const ForwardTask& task, const SeqInfo& seq, const Block& bl) {
    const int64_t group = p_.group_size(), head_dim = p_.head_dim;
    const float scale = p_.softmax_scale;
    float* stage = w_.stage.data();  // row-major [m_pad x D]
    StackedRow at = StackedRow::first_of(bl.first_row, task.kv_head, group);
    for (int64_t r = 0; r < bl.rows; ++r, at.advance(group, task.kv_head)) {
      float* row = stage + r * head_dim;
      load_row(p_.dtype, element_ptr(p_.q, p_.dtype, task.batch, seq.q_start + at.q_row, at.head), head_dim, row);
      for (int64_t d = 0; d < head_dim; ++d) row[d] *= scale;
    }
    std::fill(stage + bl.rows * head_dim, stage + bl.m_pad * head_dim, 0.f);
    transpose(stage, head_dim, bl.m_pad, head_dim, bl.q_t, bl.m_pad);
  }

  /** Each row's allowed keys relative to the tile at n0, clamped to small exact floats. */
  void set_relative_key_bounds(const Block& bl, int64_t n0) {
    const int64_t lo_clamp = -1, hi_clamp = Config::kBlockKeys + 1;
    for (int64_t r = 0; r < bl.m_pad; ++r) {
      const KeyRange kr = bl.row_keys[r];
      w_.key_lo.data()[r] = static_cast<float>(std::clamp(kr.begin - n0, lo_clamp, hi_clamp));
      w_.key_hi.data()[r] = static_cast<float>(std::clamp(kr.end - n0, lo_clamp, hi_clamp));
    }
  }

  /** Turns the score tile at key n0 into probabilities against the updated running max, and
   *  updates (row_max, row_sum) and the rescale factor the output accumulator needs. Scores get
   *  softcap, then the ALiBi bias (kAlibi: the call has slopes), then the mask. */
  template <bool kAlibi>
  void softmax_tile(Block& bl, int64_t n0, int64_t n_valid, bool full, bool plain) {
    const int64_t m_pad = bl.m_pad;
    const bool capped = p_.softcap > 0.f;
    const Vec cap = Simd::set1(p_.softcap);
    const Vec inv_cap = Simd::set1(capped ? 1.f / p_.softcap : 0.f);
    const Vec log2e = Simd::set1(kLog2e);
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
        // ALiBi: the bias of key n (relative to the tile) is neg_slope * |diagonal - n|.
        const Vec neg_slope = kAlibi ? Simd::load(bl.alibi_neg_slope + m) : Simd::zero();
        const Vec diagonal = kAlibi ? Simd::sub(Simd::load(bl.alibi_diagonal + m), Simd::set1(static_cast<float>(n0)))
                                    : Simd::zero();
        Vec key = Simd::zero();
        for (int64_t n = 0; n < n_valid; ++n, key = Simd::add(key, one)) {
          float* s = s_t + n * m_pad + m;
          Vec x = Simd::load(s);
          if (capped) x = Simd::mul(cap, vtanh(Simd::mul(x, inv_cap)));
          if constexpr (kAlibi) {
            const Vec d = Simd::sub(diagonal, key);
            x = Simd::fma(neg_slope, Simd::max(d, Simd::sub(Simd::zero(), d)), x);
          }
          if (!full) x = Simd::select(Simd::both(Simd::le(lo, key), Simd::lt(key, hi)), x, neg_inf);
          Simd::store(s, x);
          tile_max = Simd::max(tile_max, x);
        }
      }
      const Vec old_max = Simd::load(bl.row_max + m);
      const Vec new_max = Simd::max(old_max, tile_max);
      // A row with no allowed key so far keeps max -inf; subtracting 0 instead keeps exp() at
      // exactly 0 for it rather than producing NaN from (-inf) - (-inf).
      const Vec safe_max = Simd::select(Simd::eq(new_max, neg_inf), Simd::zero(), new_max);
      // exp(x) = 2^(x log2e): x = s - m is exact near the max, where the terms that matter are.
      // (Folding the multiply into one FMA, s log2e - fl(m log2e), failed the backward tests
      // with logits near 1e4: the LSE it implies lost accuracy.)
      const Vec alpha = vexp2_softmax(Simd::mul(Simd::sub(old_max, safe_max), log2e));
      Vec sum = Simd::zero();
      for (int64_t n = 0; n < n_valid; ++n) {
        float* s = s_t + n * m_pad + m;
        const Vec prob = vexp2_softmax(Simd::mul(Simd::sub(Simd::load(s), safe_max), log2e));
        Simd::store(s, prob);
        sum = Simd::add(sum, prob);
      }
      Simd::store(bl.row_sum + m, Simd::fma(Simd::load(bl.row_sum + m), alpha, sum));
      Simd::store(bl.row_max + m, new_max);
      Simd::store(w_.rescale.data() + m, alpha);
    }
  }

  /** Dropout (common/dropout.hpp): zeroes the dropped entries of P^T at keys [n0, n0 + n_valid)
   *  after the softmax has summed them into l (the normalization and lse see every probability);
   *  write_outputs applies the kept entries' 1 / (1 - p). Per 64-key block the tile touches: each
   *  row's keep bits (shifted to the tile's first key there), then every key's rows at once
   *  (zero_dropped_columns; padding rows keep their 0). */
  void drop_probabilities(const ForwardTask& task, const Block& bl, int64_t n0, int64_t n_valid) {
    const int64_t group = p_.group_size(), m_pad = bl.m_pad;
    uint64_t kept[Config::kBlockRows];
    for (int64_t j0 = n0; j0 < n0 + n_valid; j0 = (j0 / 64 + 1) * 64) {
      const int64_t block = j0 / 64, shift = j0 - block * 64;
      const int64_t keys = std::min(n0 + n_valid, (block + 1) * 64) - j0;
      StackedRow at = StackedRow::first_of(bl.first_row, task.kv_head, group);
      for (int64_t r = 0; r < bl.rows; ++r, at.advance(group, task.kv_head)) {
        kept[r] = keep_bits_of_block(p_.dropout, task.batch * p_.heads_q + at.head, at.q_row, block) >> shift;
      }
      std::fill(kept + bl.rows, kept + m_pad, ~uint64_t(0));
      zero_dropped_columns(w_.s_t.data() + (j0 - n0) * m_pad, m_pad, kept, keys);
    }
  }

  /** out = O / l, lse = m + log l; rows without any allowed key get 0 and -inf. */
  void write_outputs(const ForwardTask& task, const SeqInfo& seq, const Block& bl) {
    const int64_t group = p_.group_size(), head_dim = p_.head_dim;
    const bool have_accumulator = bl.started;
    const float keep_scale = p_.dropout.enabled() ? p_.dropout.keep_scale : 1.f;  // dropout's 1 / (1 - p)
    float* stage = w_.stage.data();  // row-major [m_pad x D]
    if (have_accumulator) transpose(bl.o_t, bl.m_pad, head_dim, bl.m_pad, stage, head_dim);
    StackedRow at = StackedRow::first_of(bl.first_row, task.kv_head, group);
    for (int64_t r = 0; r < bl.rows; ++r, at.advance(group, task.kv_head)) {
      const int64_t q_row = seq.q_start + at.q_row;
      const int64_t head = at.head;
      const float l = bl.row_sum[r];
      const bool any = have_accumulator && l > 0.f;
      float* row = stage + r * head_dim;
      const float inv_l = any ? keep_scale / l : 0.f;
      if (any) {
        for (int64_t d = 0; d < head_dim; ++d) row[d] *= inv_l;
      } else {
        std::fill(row, row + head_dim, 0.f);
      }
      store_row(p_.dtype, row, head_dim, element_ptr_mut(p_.out, p_.dtype, task.batch, q_row, head));
      if (p_.lse.data) {
        const int64_t off = task.batch * p_.lse.batch_stride + head * p_.lse.head_stride + q_row * p_.lse.row_stride;
        p_.lse.data[off] = any ? bl.row_max[r] + std::log(l) : kNegInf;
      }
    }
  }

  const AttentionParams& p_;
  ForwardScratch& w_;
};

/** Blocks per task (see ForwardConfig::kMaxBlocksPerTask and kTasksPerThread). */
template <class Config>
int64_t blocks_per_task(const AttentionParams& p) {
  const int64_t group = p.group_size();
  int64_t blocks = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t stacked = group * seq_info(p, b).seqlen_q;
    blocks += p.heads_kv * ((stacked + Config::kBlockRows - 1) / Config::kBlockRows);
  }
  const int64_t min_tasks = std::max<int64_t>(Config::kMinTasks,
                                              Config::kTasksPerThread * resolve_thread_count(p.num_threads));
  return std::clamp<int64_t>(blocks / min_tasks, 1, Config::kMaxBlocksPerTask);
}

/** Task order: the tasks of one (batch, kv head) stay adjacent, so threads working side by side
 *  share that head's K/V in cache (interleaving heads was measured ~30% slower on causal calls);
 *  heads with more work go first, and inside a head the longest tasks go first, so the queue
 *  ends on short tasks and the threads finish together. */
template <class Config>
std::vector<ForwardTask> make_forward_tasks(const AttentionParams& p) {
  struct Head {
    size_t first_task, task_count;
    int64_t cost;
  };
  std::vector<ForwardTask> tasks;
  std::vector<Head> heads;
  const int64_t group = p.group_size();
  const int64_t task_rows = Config::kBlockRows * blocks_per_task<Config>(p);
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    const MaskInfo mask = mask_info(p, seq);
    const int64_t stacked = group * seq.seqlen_q;
    for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh) {
      Head head{tasks.size(), 0, 0};
      for (int64_t first = 0; first < stacked; first += task_rows) {
        const int64_t rows = std::min(task_rows, stacked - first);
        int64_t cost = 0;
        for (int64_t r0 = first; r0 < first + rows; r0 += Config::kBlockRows) {
          const int64_t block_rows = std::min(Config::kBlockRows, first + rows - r0);
          const KeyRange keys = mask.keys_for_rows(r0 / group, (r0 + block_rows - 1) / group + 1);
          cost += block_rows * (keys.end - keys.begin + 1);
        }
        tasks.push_back({b, kvh, first, rows, cost});
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

/** Runs the forward's tasks (make_forward_tasks<Config>) on the worker pool: every worker calls
 *  worker(queue, tasks) once, which drains the shared queue (see drain_tasks). */
template <class Config, class Worker>
Status run_forward_tasks(const AttentionParams& p, Worker&& worker) {
  std::vector<ForwardTask> tasks;
  try {
    tasks = make_forward_tasks<Config>(p);
  } catch (const std::bad_alloc&) {
    return Status::internal("cpu_flash forward: out of host memory for the task list");
  }
  return run_workers(static_cast<int64_t>(tasks.size()), p.num_threads,
                     [&](TaskQueue& queue) { worker(queue, static_cast<const std::vector<ForwardTask>&>(tasks)); });
}

/** Feeds `runner` the queue's tasks, each with a guess at this worker's next task, whose query rows
 *  the runner prefetches during its last key tile. */
template <class Runner>
void drain_tasks(Runner& runner, TaskQueue& queue, const std::vector<ForwardTask>& tasks) {
  for (int64_t t = queue.next(); t >= 0; t = queue.next()) {
    const int64_t ahead = t + queue.workers();  // a fair guess at this worker's next task
    runner.run(tasks[static_cast<size_t>(t)], ahead < queue.size() ? &tasks[static_cast<size_t>(ahead)] : nullptr);
  }
}

/** The forward with configuration Config (see ForwardConfig). */
template <class Config>
Status flash_forward_with(const AttentionParams& p) {
  return run_forward_tasks<Config>(p, [&](TaskQueue& queue, const std::vector<ForwardTask>& tasks) {
    ForwardScratch scratch;
    scratch.reserve<Config>(p.head_dim, p.has_alibi());
    ForwardTaskRunner<Config> runner(p, scratch);
    drain_tasks(runner, queue, tasks);
  });
}

}  // namespace forward_detail
}  // namespace cpu
}  // namespace flashcore
