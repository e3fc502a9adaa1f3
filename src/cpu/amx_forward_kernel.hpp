// The cpu_flash forward on Intel AMX (Sapphire Rapids and later): the same tiled online softmax as
// flash_forward_kernel.hpp, with both GEMMs on the tile unit instead of AVX-512 FMAs.
//
// Exactness. AMX multiplies bf16 (8 significant bits) and accumulates in fp32. Each fp32 operand
// is split into three bf16 parts, x = x0 + x1 + x2 (x0 = bf16(x), x1 = bf16(x - x0), ...: 24
// significant bits, x itself for every normal fp32 whose parts stay normal), and a product is
// the sum of the part products whose indices add up to at most 2: (0,0), (0,1), (1,0), (0,2),
// (1,1), (2,0). What is dropped is below 2^-24 of the product, so scores and outputs are as
// accurate as an fp32 dot product (dev/amx_probe.cpp: S = Q K^T at d = 128, relative error 5e-8
// with six products against 2e-7 for fp32 FMAs; 4e-6 with three, too close to TESTING.md's 1e-5).
// fp16 inputs need two parts (11 bits), bf16 inputs one, so S = Q K^T takes 6 / 4 / 1 products
// (fp32 / fp16 / bf16), all exact. P gets as many parts as the inputs: three for fp32; two for
// fp16 (16 bits, finer than fp16), with the products of index sum <= 1; one for bf16, P rounded
// to bf16 as TESTING.md's X_same for bf16 does. So P V takes 6 / 3 / 1 products.
//
// Layout (per block of 32 stacked rows and tile of kN keys; rows as in flash_forward_kernel.hpp):
//   S = Q K^T: A = Q's parts, row-major [32 x d_pad] bf16, straight from the rows; B = K's parts
//   in the tile unit's pair-interleaved ("VNNI") layout: for each 32-wide slice of d and 16 keys,
//   16 rows of (k[d], k[d+1]) pairs, one per key: a 16 x 16 transposition of 32-bit pairs.
//   O += P V: A = P's parts, row-major [32 x kN]; B = V's parts with rows 2r and 2r+1
//   interleaved per 16 columns of d. O stays fp32 in memory, [32 x d_pad], loaded into the
//   accumulator tiles and stored back per 32 columns and key tile.
// Tiles as amx_tiles.hpp says (one configuration per worker). d is padded to a multiple
// of 32 with zeros in Q, K and V; padding rows and keys past the tile's end are zero. Inside each
// GEMM the slices of d (S) or chunks of 32 keys (P V) run outside the products, so one slice's
// parts stay in L1 across its products.
// The softmax between the GEMMs runs on AVX-512 over S in row-major order (a horizontal max
// and sum per row) and writes P's parts.
// Shipped (amx_forward.cpp): fp16 / bf16 on 256-key tiles with up to 16 blocks per task sharing
// each packed K/V tile; fp32, when asked for, on 64-key tiles with 8.
//
// The kernel is a template over its tile size, blocks per task and phase timer so that
// dev/cpu_forward_sweep.cpp can compare and split them; amx_forward.cpp instantiates it. Built only
// where FLASHCORE_AMX_BUILT ends up 1: code compiled with -march=native plus -mamx-tile
// -mamx-bf16 (CMakeLists.txt) on a machine whose native target has AVX-512 (F, BW, DQ, VL) and
// AVX512-BF16, or with FLASHCORE_AMX_EMULATE.
#pragma once

#include "cpu/amx_tiles.hpp"

#if FLASHCORE_AMX_BUILT
#include "cpu/flash_forward_kernel.hpp"

namespace flashcore {
namespace cpu {

namespace amx_detail {

using namespace forward_detail;
using namespace amx_tiles;

constexpr int64_t kM = 32;  // stacked rows per block: two accumulator tiles tall
constexpr int kMaxParts = 3;

/** Task shapes for make_forward_tasks (flash_forward_kernel.hpp): 32-row blocks, up to Blocks per
 *  task, at least TasksPerThread tasks per thread where the blocks allow, and tiles of Keys keys. */
template <int64_t Keys, int64_t Blocks, int64_t TasksPerThread = 2>
struct AmxTaskConfig {
  static constexpr int64_t kBlockRows = kM;
  static constexpr int64_t kBlockKeys = Keys;
  static constexpr int64_t kMaxBlocksPerTask = Blocks;
  static constexpr int64_t kMinTasks = 32;
  static constexpr int64_t kTasksPerThread = TasksPerThread;
};

/** Per-thread buffers for tiles of kN keys, sized once per call. bf16 arrays live in AlignedFloats
 *  (two per float). */
template <int64_t kN, int64_t kBlocks>
struct AmxScratch {
  int64_t d_pad = 0;
  AlignedFloats q_parts;   // [blocks][parts][kM x d_pad] bf16
  AlignedFloats o_acc;     // [blocks][kM x d_pad] fp32, unnormalized
  AlignedFloats row_max;   // [blocks][kM]
  AlignedFloats row_sum;   // [blocks][kM]
  AlignedFloats k_stage;   // [parts][d_pad / 32][16 keys][16 pairs]: 16 keys' parts before the transposition
  AlignedFloats k_pack;    // [parts][d_pad / 32][kN / 16] B tiles of K
  AlignedFloats v_pack;    // [parts][kN / 32][d_pad / 16] B tiles of V
  AlignedFloats s_buf;     // [kM x kN] fp32 scores
  AlignedFloats p_parts;   // [3][kM x kN] bf16 probabilities
  AlignedFloats out_row;   // [d_pad] one output row on its way out
  AlignedFloats alibi_neg_slope;  // [blocks][kM] ALiBi: -slope of each stacked row
  AlignedFloats alibi_diagonal;   // [blocks][kM] ALiBi: each row's diagonal key (i + seqlen_k - seqlen_q)
  std::vector<KeyRange> row_keys;  // [blocks][kM]
  PrefetchQueue prefetch;

  void reserve(int64_t head_dim) {
    d_pad = round_up(head_dim, kSlice);
    const int64_t blocks = kBlocks, slices = d_pad / kSlice;
    q_parts.reserve(blocks * kMaxParts * kM * d_pad / 2);
    o_acc.reserve(blocks * kM * d_pad);
    row_max.reserve(blocks * kM);
    row_sum.reserve(blocks * kM);
    k_stage.reserve(kMaxParts * slices * kTileUnits);
    k_pack.reserve(kMaxParts * slices * (kN / 16) * kTileUnits);
    v_pack.reserve(kMaxParts * (kN / 32) * (d_pad / 16) * kTileUnits);
    s_buf.reserve(kM * kN);
    p_parts.reserve(kMaxParts * kM * kN / 2);
    out_row.reserve(d_pad);
    alibi_neg_slope.reserve(blocks * kM);
    alibi_diagonal.reserve(blocks * kM);
    row_keys.resize(static_cast<size_t>(blocks * kM));
  }
};

/** One tile of kN keys as the GEMMs' B operands: K rows first .. first + n_valid of (batch,
 *  kv_head) through pack_column_pairs into k_pack [parts][d_pad / 32][kN / 16] tiles, V through
 *  pack_row_pairs into v_pack [parts][kN / 32][d_pad / 16] tiles; zero rows after n_valid, up to
 *  the whole chunks of 32 keys the GEMMs read. stage: pack_column_pairs' scratch. */
template <int64_t kN>
void pack_kv_tile(const AttentionParams& p, int64_t batch, int64_t kv_head, int64_t first, int64_t n_valid, int parts,
                  int64_t d_pad, float* stage, float* k_pack, float* v_pack) {
  const void* k_rows[kN];
  const void* v_rows[kN];
  for_kv_rows(p, p.k, batch, first, n_valid, kv_head, [&](int64_t n, const void* row) { k_rows[n] = row; });
  for_kv_rows(p, p.v, batch, first, n_valid, kv_head, [&](int64_t n, const void* row) { v_rows[n] = row; });
  auto k_row = [&](int64_t n) -> const void* { return n < n_valid ? k_rows[n] : nullptr; };
  auto v_row = [&](int64_t n) -> const void* { return n < n_valid ? v_rows[n] : nullptr; };
  const int64_t n_pack = round_up(n_valid, int64_t{32}), slices = d_pad / kSlice;
  pack_column_pairs(p.dtype, k_row, n_pack, p.head_dim, d_pad, parts, stage, k_pack, kN / 16, slices * (kN / 16));
  pack_row_pairs(p.dtype, v_row, n_pack, p.head_dim, d_pad, parts, v_pack, (kN / 32) * (d_pad / 16));
}

/** K and V of every (batch, KV head) packed once per call into the B tiles the GEMMs read, tile by
 *  tile of kN keys (each tile laid out as AmxScratch's k_pack / v_pack). Without it every task
 *  packs the key tiles it reads: a head's rows span group * seqlen_q / (32 * blocks per task)
 *  tasks, and packing took 27% of the bf16 forward at S = 2048 with four tasks per head
 *  (docs/PERF.md, session 22). Built only when a head spans more than one task and the copy stays
 *  under kMaxBytes; otherwise the tasks pack as before. */
template <int64_t kN>
class PackedKv {
 public:
  static constexpr int64_t kMaxBytes = int64_t{1} << 30;

  /** Packs K and V when worth it; false when the tasks should pack for themselves. */
  bool build(const AttentionParams& p, int parts, int64_t d_pad, int64_t task_rows) {
    const int64_t group = p.group_size();
    bool spans = false;
    int64_t tiles = 0;
    first_tile_.resize(static_cast<size_t>(p.batch * p.heads_kv));
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqInfo seq = seq_info(p, b);
      spans = spans || group * seq.seqlen_q > task_rows;
      for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh) {
        first_tile_[static_cast<size_t>(b * p.heads_kv + kvh)] = tiles;
        tiles += ceil_div(seq.seqlen_k, kN);
      }
    }
    tile_floats_ = parts * kN * d_pad / 2;  // parts x kN x d_pad bf16
    if (!spans || tiles == 0 || 2 * tiles * tile_floats_ * 4 > kMaxBytes) return false;
    k_.reserve(tiles * tile_floats_);
    v_.reserve(tiles * tile_floats_);
    struct Unit { int64_t batch, kv_head, n0; };
    std::vector<Unit> units;
    units.reserve(static_cast<size_t>(tiles));
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t kvh = 0; kvh < p.heads_kv; ++kvh)
        for (int64_t n0 = 0; n0 < seq_info(p, b).seqlen_k; n0 += kN) units.push_back({b, kvh, n0});
    const Status st = run_workers(static_cast<int64_t>(units.size()), p.num_threads, [&](TaskQueue& queue) {
      AlignedFloats stage;
      stage.reserve(parts * (d_pad / kSlice) * kTileUnits);
      for (int64_t u = queue.next(); u >= 0; u = queue.next()) {
        const Unit& at = units[static_cast<size_t>(u)];
        const SeqInfo seq = seq_info(p, at.batch);
        const int64_t tile = tile_of(at.batch, at.kv_head, at.n0, p.heads_kv) * tile_floats_;
        pack_kv_tile<kN>(p, at.batch, at.kv_head, seq.k_start + at.n0, std::min(kN, seq.seqlen_k - at.n0), parts, d_pad,
                         stage.data(), k_.data() + tile, v_.data() + tile);
      }
    });
    return st.is_ok();
  }

  /** The packed tile of keys n0 .. n0 + kN (n0 a multiple of kN) of (batch, kv_head). */
  const float* keys(int64_t batch, int64_t kv_head, int64_t n0, int64_t heads_kv) const {
    return k_.data() + tile_of(batch, kv_head, n0, heads_kv) * tile_floats_;
  }
  const float* values(int64_t batch, int64_t kv_head, int64_t n0, int64_t heads_kv) const {
    return v_.data() + tile_of(batch, kv_head, n0, heads_kv) * tile_floats_;
  }

 private:
  int64_t tile_of(int64_t batch, int64_t kv_head, int64_t n0, int64_t heads_kv) const {
    return first_tile_[static_cast<size_t>(batch * heads_kv + kv_head)] + n0 / kN;
  }

  AlignedFloats k_, v_;
  std::vector<int64_t> first_tile_;  // per (batch, kv head): index of its first tile
  int64_t tile_floats_ = 0;
};

/** One block of 32 stacked rows of the AMX forward: its Q parts and its fp32 O accumulator. */
struct AmxBlock : BlockRows {
  uint16_t* q_parts;
  float* o;
};

template <int64_t kN, class PhaseTimer, int64_t kBlocks>
class AmxTaskRunner {
 public:
  AmxTaskRunner(const AttentionParams& p, AmxScratch<kN, kBlocks>& w, const PackedKv<kN>* packed)
      : p_(p), w_(w), packed_(packed), in_parts_(parts_of(p.dtype)), score_products_(in_parts_, in_parts_, 2),
        output_products_(in_parts_, in_parts_, in_parts_ - 1), prescale_(in_parts_ == kMaxParts) {}

  void run(const ForwardTask& task, const ForwardTask* next) {
    PhaseTimer::lap(ForwardPhase::kBetweenTasks);
    const SeqInfo seq = seq_info(p_, task.batch);
    const MaskInfo mask = mask_info(p_, seq);
    const int64_t group = p_.group_size(), d_pad = w_.d_pad;

    AmxBlock blocks[kBlocks];
    int64_t num_blocks = 0;
    KeyRange keys{0, 0};
    for (int64_t first = 0; first < task.rows; first += kM, ++num_blocks) {
      AmxBlock& bl = blocks[num_blocks];
      const int64_t slot = num_blocks;
      bl.row_max = w_.row_max.data() + slot * kM;
      bl.row_sum = w_.row_sum.data() + slot * kM;
      bl.row_keys = w_.row_keys.data() + slot * kM;
      bl.start(task, first, kM, kM, mask, group, keys);
      bl.q_parts = reinterpret_cast<uint16_t*>(w_.q_parts.data()) + slot * kMaxParts * kM * d_pad;
      bl.o = w_.o_acc.data() + slot * kM * d_pad;
      bl.alibi_neg_slope = w_.alibi_neg_slope.data() + slot * kM;
      bl.alibi_diagonal = w_.alibi_diagonal.data() + slot * kM;
      if (p_.has_alibi()) bl.set_alibi_rows(p_, task, seq, kM);
      pack_queries(task, seq, bl);
      std::fill(bl.o, bl.o + kM * d_pad, 0.f);
    }

    PhaseTimer::lap(ForwardPhase::kRows);
    keys.begin = keys.begin / kN * kN;  // tiles on a fixed grid: results independent of the task split
    PrefetchQueue& prefetch = w_.prefetch;
    for (int64_t n0 = keys.begin; n0 < keys.end; n0 += kN) {
      const int64_t n_valid = std::min(kN, keys.end - n0);
      if (packed_) {
        k_tiles_ = reinterpret_cast<const uint16_t*>(packed_->keys(task.batch, task.kv_head, n0, p_.heads_kv));
        v_tiles_ = reinterpret_cast<const uint16_t*>(packed_->values(task.batch, task.kv_head, n0, p_.heads_kv));
      } else {
        pack_kv_tile<kN>(p_, task.batch, task.kv_head, seq.k_start + n0, n_valid, in_parts_, w_.d_pad,
                         w_.k_stage.data(), w_.k_pack.data(), w_.v_pack.data());
        k_tiles_ = reinterpret_cast<const uint16_t*>(w_.k_pack.data());
        v_tiles_ = reinterpret_cast<const uint16_t*>(w_.v_pack.data());
      }
      int64_t active_blocks = 0;
      for (int64_t bi = 0; bi < num_blocks; ++bi) active_blocks += blocks[bi].overlaps(n0, n0 + n_valid);
      if (n0 + kN < keys.end) {
        // The next tile's input rows (packed tiles are contiguous: the hardware prefetcher has them).
        if (!packed_) {
          queue_kv_tile(p_, task.batch, seq.k_start + n0 + kN, std::min(kN, keys.end - n0 - kN), task.kv_head,
                        prefetch);
        }
      } else {
        queue_task_rows(p_, task, p_.out, /*for_write=*/true, prefetch);
        if (next) queue_task_rows(p_, *next, p_.q, /*for_write=*/false, prefetch);
      }
      prefetch.pace(active_blocks * (kN / 32 + d_pad / 32));
      PhaseTimer::lap(ForwardPhase::kCopy);
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        AmxBlock& bl = blocks[bi];
        if (!bl.overlaps(n0, n0 + n_valid)) continue;
        const int64_t n_block = std::min(n_valid, bl.keys.end - n0);
        const int64_t key_chunks = ceil_div(n_block, int64_t{32});
        scores(bl, key_chunks);
        PhaseTimer::lap(ForwardPhase::kScores);
        const bool full = n_block == kN && mask.tile_fully_visible(bl.first_q, bl.last_q + 1, n0, n0 + n_block);
        // ALiBi as a template argument: without it the softmax's loop is the bias-free one.
        if (p_.has_alibi()) {
          softmax</*kAlibi=*/true>(bl, n0, n_block, full);
        } else {
          softmax</*kAlibi=*/false>(bl, n0, n_block, full);
        }
        PhaseTimer::lap(ForwardPhase::kSoftmax);
        accumulate_output(bl, key_chunks);
        PhaseTimer::lap(ForwardPhase::kOutput);
      }
      prefetch.drain();
      PhaseTimer::lap(ForwardPhase::kCopy);
    }
    for (int64_t bi = 0; bi < num_blocks; ++bi) write_outputs(task, seq, blocks[bi]);
    PhaseTimer::lap(ForwardPhase::kRows);
  }

 private:
  /** Q's parts, row-major [kM x d_pad] each; padding rows and columns zero. */
  void pack_queries(const ForwardTask& task, const SeqInfo& seq, const AmxBlock& bl) {
    const int64_t group = p_.group_size(), d_pad = w_.d_pad;
    StackedRow at = StackedRow::first_of(bl.first_row, task.kv_head, group);
    for (int64_t r = 0; r < kM; ++r) {
      const void* row = nullptr;
      if (r < bl.rows) {
        row = element_ptr(p_.q, p_.dtype, task.batch, seq.q_start + at.q_row, at.head);
        at.advance(group, task.kv_head);
      }
      split_row(p_.dtype, row, p_.head_dim, d_pad, in_parts_, bl.q_parts + r * d_pad, kM * d_pad, prescale_,
                p_.softmax_scale);
    }
  }

  /** S[32 x 32 * key_chunks] = Q K^T, stored row-major into s_buf. */
  void scores(const AmxBlock& bl, int64_t key_chunks) {
    const int64_t d_pad = w_.d_pad, slices = d_pad / kSlice;
    const uint16_t* k_pack = k_tiles_;
    float* s = w_.s_buf.data();
    for (int64_t kc = 0; kc < key_chunks; ++kc) {
      zero_accumulators();
      // Slices outer, products inner: one slice's parts of Q and K (12 KiB for fp32) stay in L1
      // across its products, and an A tile serves the products that share it.
      for (int64_t slice = 0; slice < slices; ++slice) {
        for (int pi = 0; pi < score_products_.count; ++pi) {
          if (pi == 0 || score_products_.a[pi] != score_products_.a[pi - 1]) {
            load_a(bl.q_parts + score_products_.a[pi] * kM * d_pad + slice * kSlice, d_pad);
          }
          const uint16_t* k = k_pack + score_products_.b[pi] * slices * (kN / 16) * kTileUnits * 2;
          multiply_accumulate(k + (slice * (kN / 16) + 2 * kc) * kTileUnits * 2);
        }
      }
      store_accumulators(s + kc * 32, kN);
      w_.prefetch.issue();
    }
  }

  /** Scores into probabilities against the updated running max; updates (row_max, row_sum),
   *  rescales the rows of O whose max moved, and writes P's parts. Scores get softcap, then
   *  (kAlibi) the bias -slope * |diagonal - key|, then the mask. */
  template <bool kAlibi>
  void softmax(AmxBlock& bl, int64_t n0, int64_t n_block, bool full) {
    const int64_t d_pad = w_.d_pad;
    const bool capped = p_.softcap > 0.f;
    const __m512 scale = _mm512_set1_ps(prescale_ ? 1.f : p_.softmax_scale);
    const __m512 cap = _mm512_set1_ps(p_.softcap), inv_cap = _mm512_set1_ps(capped ? 1.f / p_.softcap : 0.f);
    const __m512 log2e = _mm512_set1_ps(kLog2e), neg_inf = _mm512_set1_ps(kNegInf);
    const int64_t chunks = ceil_div(n_block, int64_t{16});
    uint16_t* p_parts = reinterpret_cast<uint16_t*>(w_.p_parts.data());
    for (int64_t r = 0; r < kM; ++r) {
      float* s = w_.s_buf.data() + r * kN;
      int64_t lo = 0, hi = n_block;
      if (!full) {
        const KeyRange kr = bl.row_keys[r];
        lo = std::clamp(kr.begin - n0, int64_t{0}, n_block);
        hi = std::clamp(kr.end - n0, int64_t{0}, n_block);
      }
      __m512 x[kN / 16];
      __m512 vmax = neg_inf;
      // ALiBi: key n0 + 16 k + lane is at distance |(diagonal - n0 - 16 k) - lane| from the diagonal.
      const __m512 neg_slope = _mm512_set1_ps(kAlibi ? bl.alibi_neg_slope[r] : 0.f);
      const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t k = 0; k < chunks; ++k) {
        x[k] = _mm512_loadu_ps(s + k * 16);
        if (!prescale_) x[k] = _mm512_mul_ps(x[k], scale);
        if (capped) x[k] = _mm512_mul_ps(cap, vtanh(_mm512_mul_ps(x[k], inv_cap)));
        if constexpr (kAlibi) {
          const __m512 d = _mm512_sub_ps(_mm512_set1_ps(bl.alibi_diagonal[r] - static_cast<float>(n0 + k * 16)), lanes);
          x[k] = _mm512_fmadd_ps(neg_slope, _mm512_abs_ps(d), x[k]);
        }
        if (!full) x[k] = _mm512_mask_blend_ps(lane_range(lo - k * 16, hi - k * 16), neg_inf, x[k]);
        vmax = _mm512_max_ps(vmax, x[k]);
      }
      const float old_max = bl.row_max[r];
      const float new_max = std::max(old_max, _mm512_reduce_max_ps(vmax));
      // A row with no allowed key so far keeps max -inf; subtracting 0 instead keeps exp() at
      // exactly 0 for it rather than producing NaN from (-inf) - (-inf).
      const float safe_max = new_max == kNegInf ? 0.f : new_max;
      const __m512 vsafe = _mm512_set1_ps(safe_max);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t k = 0; k < chunks; ++k) {
        const __m512 prob = vexp2_softmax(_mm512_mul_ps(_mm512_sub_ps(x[k], vsafe), log2e));
        vsum = _mm512_add_ps(vsum, prob);
        split16(prob, in_parts_, p_parts + r * kN + k * 16, kM * kN);
      }
      for (int64_t k = chunks; k < round_up(chunks, 2); ++k) {  // a half-used key chunk: zero the rest
        split16(_mm512_setzero_ps(), in_parts_, p_parts + r * kN + k * 16, kM * kN);
      }
      if (new_max > old_max && old_max != kNegInf) {
        const float alpha = std::exp2((old_max - safe_max) * kLog2e);
        bl.row_sum[r] *= alpha;
        float* o = bl.o + r * d_pad;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < d_pad; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), va));
      }
      bl.row_sum[r] += _mm512_reduce_add_ps(vsum);
      bl.row_max[r] = new_max;
    }
  }

  /** O[32 x d_pad] += P V over key_chunks chunks of 32 keys. */
  void accumulate_output(const AmxBlock& bl, int64_t key_chunks) {
    const int64_t d_pad = w_.d_pad, col_tiles = d_pad / 16;
    const uint16_t* p_parts = reinterpret_cast<const uint16_t*>(w_.p_parts.data());
    const uint16_t* v_pack = v_tiles_;
    const int64_t v_part_stride = (kN / 32) * col_tiles * kTileUnits * 2;  // bf16 per part
    for (int64_t c = 0; c < d_pad; c += 32) {
      float* o = bl.o + c;
      load_accumulators(o, d_pad);
      for (int64_t kc = 0; kc < key_chunks; ++kc) {  // key chunks outer, as the slices in scores()
        for (int pi = 0; pi < output_products_.count; ++pi) {
          if (pi == 0 || output_products_.a[pi] != output_products_.a[pi - 1]) {
            load_a(p_parts + output_products_.a[pi] * kM * kN + kc * 32, kN);
          }
          const uint16_t* vp = v_pack + output_products_.b[pi] * v_part_stride;
          multiply_accumulate(vp + (kc * col_tiles + c / 16) * kTileUnits * 2);
        }
      }
      store_accumulators(o, d_pad);
      w_.prefetch.issue();
    }
  }

  /** out = O / l, lse = m + log l; rows without any allowed key get 0 and -inf. */
  void write_outputs(const ForwardTask& task, const SeqInfo& seq, const AmxBlock& bl) {
    const int64_t group = p_.group_size(), head_dim = p_.head_dim, d_pad = w_.d_pad;
    float* row = w_.out_row.data();
    StackedRow at = StackedRow::first_of(bl.first_row, task.kv_head, group);
    for (int64_t r = 0; r < bl.rows; ++r, at.advance(group, task.kv_head)) {
      const int64_t q_row = seq.q_start + at.q_row;
      const float l = bl.row_sum[r];
      const bool any = l > 0.f;
      const __m512 inv_l = _mm512_set1_ps(any ? 1.f / l : 0.f);
      for (int64_t c = 0; c < d_pad; c += 16) {
        _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(bl.o + r * d_pad + c), inv_l));
      }
      store_row(p_.dtype, row, head_dim, element_ptr_mut(p_.out, p_.dtype, task.batch, q_row, at.head));
      if (p_.lse.data) {
        const int64_t off = task.batch * p_.lse.batch_stride + at.head * p_.lse.head_stride + q_row * p_.lse.row_stride;
        p_.lse.data[off] = any ? bl.row_max[r] + std::log(l) : kNegInf;
      }
    }
  }

  const AttentionParams& p_;
  AmxScratch<kN, kBlocks>& w_;
  const PackedKv<kN>* packed_;  // null: each task packs its key tiles into w_
  const uint16_t* k_tiles_ = nullptr;  // the current key tile's K and V B tiles
  const uint16_t* v_tiles_ = nullptr;
  const int in_parts_;
  const Products score_products_;
  const Products output_products_;
  // fp32 queries are multiplied by softmax_scale before the split, as the AVX forward and the
  // backward do: the backward recomputes P from the lse with scores of the scaled queries, and
  // at scores near 1e4 an lse from differently rounded scores moves the gradients past their
  // bound (CpuFlashBackward.Edges, magnitude 100 and 1500). fp16 / bf16 queries keep their one or
  // two exact parts, and their scores are scaled in the softmax.
  const bool prescale_;
};

/** The forward on tiles of Keys keys (a multiple of 32), up to Blocks blocks of 32 rows per task;
 *  PhaseTimer::lap(phase) marks the end of each phase of a task (see NoPhaseTimer). */
template <int64_t Keys, class PhaseTimer, int64_t Blocks, int64_t TasksPerThread = 2>
Status amx_flash_forward_with(const AttentionParams& p) {
  using Config = AmxTaskConfig<Keys, Blocks, TasksPerThread>;
  PackedKv<Keys> packed;
  bool prepacked = false;
  try {
    prepacked = packed.build(p, parts_of(p.dtype), round_up(p.head_dim, kSlice),
                             Config::kBlockRows * blocks_per_task<Config>(p));
  } catch (const std::bad_alloc&) {
    prepacked = false;  // the tasks pack for themselves
  }
  return run_forward_tasks<Config>(p, [&](TaskQueue& queue, const std::vector<ForwardTask>& tasks) {
    AmxScratch<Keys, Blocks> scratch;
    scratch.reserve(p.head_dim);
    const ScopedTiles tiles;  // per thread; released before the worker returns to the pool
    AmxTaskRunner<Keys, PhaseTimer, Blocks> runner(p, scratch, prepacked ? &packed : nullptr);
    drain_tasks(runner, queue, tasks);
  });
}

}  // namespace amx_detail

}  // namespace cpu
}  // namespace flashcore

#endif  // FLASHCORE_AMX_BUILT
