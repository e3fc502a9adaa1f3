// The end of the Hopper forward's persistent tile walk under a causal (one-sided) mask, in plain
// C++ with host-device functions: tests/cpu/test_tile_tail.cpp checks the order on the CPU.
//
// The persistent CTAs take work items by a static stride (item blockIdx.x, then + gridDim.x, ...),
// an item being a pair of query blocks of one head whose costs add up to about the same (the m-th
// and the (M-1-m)-th of M: under a causal mask block m sees m + 1 key blocks). With n pairs over G
// CTAs, n % G of them take one pair more than the rest: at d64 causal 16k (2752 pairs, G = 132)
// that is 11 pairs against 10.42 on average, ~5% of the call spent with part of the GPU idle; 3%
// at most other causal cells of the training grid.
//
// The tail evens that out: the last n % G pairs are split back into their single tiles,
// sorted by falling cost (query block from the last down, heads inner), and dealt over the CTAs in
// snake order (turn t: CTA c takes rank t * G + c when t is even, t * G + G - 1 - c when it is
// odd). The bulk before the tail is a whole number of rounds, so every CTA starts its tail at about
// the same time, and the snake pairs its heavy early tiles with light later ones: list
// scheduling, with no counter in memory (the walk stays a pure function of the launch, as each
// consumer warp runs it itself). Where the model gains 1% or more the host takes the tail; where a
// call has many rounds, the remainder's tiles cannot even out its end by themselves (at d64 16k
// each CTA gets at most one), so the tail may take one whole round of pairs more while its heads'
// K/V stays well inside the L2. plan_tile_tail has the rule and what it measured.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "common/fast_divmod.hpp"
#include "common/host_device.hpp"
#include "common/mask.hpp"

namespace flashcore::cuda::sm90 {

/** Where the tail starts and what it holds. The tail's tiles are the pairs (rest, j) of items
 *  first_item .. end: the head `first_rest` from its pair j = first_pair on (its query blocks
 *  first_pair .. M - 1 - first_pair, "the partial head"; all of them when first_pair is 0), then
 *  full_heads heads with every block. A head here is the walk's (batch x heads) index. */
struct TileTail {
  int first_item = INT_MAX;  // items from here on are dealt as single tiles (none: past the items)
  int tiles = 0;             // single tiles in the tail
  int first_rest = 0;
  int first_pair = 0;
  int full_heads = 0;
  int m_blocks = 0;
  FastDivmod by_full{1};   // full_heads (1 when there are none: then never used)
  FastDivmod by_level{1};  // full_heads + 1: the levels where the partial head has a block
};

struct TailTile {
  int m_block;
  int rest;
};

/** The rank-th tile of the tail in order of falling cost: the levels (query blocks) from the last
 *  down, each with the full heads' block and, on the levels first_pair .. M - 1 - first_pair, the
 *  partial head's block before them. Three stretches: the top first_pair levels and the bottom
 *  first_pair levels hold full_heads tiles each, the middle ones full_heads + 1. */
FC_HOST_DEVICE TailTile tail_tile(const TileTail& t, uint32_t rank) {
  const uint32_t edge = static_cast<uint32_t>(t.first_pair) * static_cast<uint32_t>(t.full_heads);
  if (rank < edge) {  // the top levels: full heads only
    const uint32_t level = t.by_full.div(rank);
    return {t.m_blocks - 1 - static_cast<int>(level), t.first_rest + 1 + static_cast<int>(rank - level * t.by_full.divisor)};
  }
  rank -= edge;
  const uint32_t middle = static_cast<uint32_t>(t.m_blocks - 2 * t.first_pair) * t.by_level.divisor;
  if (rank < middle) {
    const uint32_t level = t.by_level.div(rank);
    return {t.m_blocks - 1 - t.first_pair - static_cast<int>(level),
            t.first_rest + static_cast<int>(rank - level * t.by_level.divisor)};
  }
  rank -= middle;  // the bottom levels: full heads only
  const uint32_t level = t.by_full.div(rank);
  return {t.first_pair - 1 - static_cast<int>(level), t.first_rest + 1 + static_cast<int>(rank - level * t.by_full.divisor)};
}

/** Query block m_block of M as the pairs' walk names it: pair j = min(m, M - 1 - m), half 0 for
 *  block M - 1 - j (an odd M's middle block too), half 1 for block j. The walk takes a tail tile
 *  through the pairs' code in this form (forward.cuh's TileWalker). */
struct PairHalf {
  int pair;
  int half;
};
FC_HOST_DEVICE PairHalf pair_half_of(int m_block, int m_blocks) {
  const int mirror = m_blocks - 1 - m_block;
  return m_block < mirror ? PairHalf{m_block, 1} : PairHalf{mirror, 0};
}

/** The rank a CTA takes in a turn of the tail, in snake order over the ctas CTAs: turn_start is
 *  the turn's index times ctas; odd turns run backwards. */
FC_HOST_DEVICE int tail_rank(int turn_start, bool odd_turn, int cta, int ctas) {
  return turn_start + (odd_turn ? ctas - 1 - cta : cta);
}

/** The tail made of the last tail_items of `items` pair items (items_per_head pairs a head, pair j
 *  holding query blocks M - 1 - j and j of M = m_blocks). */
inline TileTail make_tile_tail(int64_t items, int64_t items_per_head, int m_blocks, int64_t tail_items) {
  TileTail t;
  t.m_blocks = m_blocks;
  if (tail_items <= 0 || items <= 0 || items_per_head <= 0) return t;
  tail_items = std::min(tail_items, items);
  const int64_t first = items - tail_items;
  t.first_item = static_cast<int>(first);
  t.first_rest = static_cast<int>(first / items_per_head);
  t.first_pair = static_cast<int>(first % items_per_head);
  t.full_heads = static_cast<int>(items / items_per_head - 1 - t.first_rest);
  t.by_full = FastDivmod(static_cast<uint32_t>(std::max(t.full_heads, 1)));
  t.by_level = FastDivmod(static_cast<uint32_t>(t.full_heads + 1));
  t.tiles = (m_blocks - 2 * t.first_pair) + t.full_heads * m_blocks;
  return t;
}

/** The model's cost of each query block of a fixed-length call: its key blocks under `mask`, plus
 *  one for the tile's fixed work (Q load, pipeline fill, epilogue). Rows are the walk's (pack-GQA
 *  kernels: packed rows, token = row >> pack_shift). */
inline std::vector<double> query_block_costs(const MaskInfo& mask, int64_t walk_rows, int block_m, int block_n,
                                             int pack_shift) {
  std::vector<double> cost;
  for (int64_t row0 = 0; row0 < walk_rows; row0 += block_m) {
    const int64_t row_end = std::min<int64_t>(walk_rows, row0 + block_m);
    const KeyRange keys = mask.keys_for_rows(row0 >> pack_shift, ((row_end - 1) >> pack_shift) + 1);
    const int64_t blocks = keys.empty() ? 0 : (keys.end + block_n - 1) / block_n - keys.begin / block_n;
    cost.push_back(static_cast<double>(blocks + 1));
  }
  return cost;
}

/** The host's choice of tail: none, the last items % ctas pairs, or those and one more whole round
 *  of pairs, by a list-scheduling model. block_cost[m] is query block m's cost (its key blocks plus
 *  one for the tile's fixed work); every CTA takes the same number of bulk pairs, costed at the
 *  average pair. The remainder is taken where the model finishes at least 1% sooner with it; the
 *  longer tail where it finishes at least 1% sooner again and the tail's heads hold at most
 *  kTailKvShareOfL2 of the L2 (l2_bytes) in K/V (head_kv_bytes each), since their tiles run at
 *  one time and share that K/V there.
 *
 *  Measured on an H200 (docs/PERF.md, sessions 59 and 60): the remainder +1.7% to +1.9% on average
 *  over three runs at d64 causal 512 / 1k, d128 512 and d256 1k, level or within the noise where it
 *  models less than 1%. The round more, over two bf16 runs and one fp16 run: d64 causal (13-25 MB
 *  of K/V) +0.6% at 1k, +0.8% at 2k, +1.1% at 4k, +1.5% at 8k, +3.0% at 16k; d128 causal (31-42 MB)
 *  +0.3% at 2k, +0.9% at 4k, +0.4% at 8k, +1.0% at 16k. Longer tails lost where their heads' K/V
 *  outgrew the L2 (three rounds more: -2% to -6% where the whole grid became the tail). Calls with
 *  many rounds gain little and skip it, and so do costs that fall along the query blocks (a window
 *  bounded on the left only), for which the tail's order would be the wrong way round. */
inline TileTail plan_tile_tail(int64_t items, int64_t items_per_head, const std::vector<double>& block_cost,
                               int64_t ctas, double head_kv_bytes, double l2_bytes) {
  const int m_blocks = static_cast<int>(block_cost.size());
  TileTail none = make_tile_tail(items, items_per_head, m_blocks, 0);
  constexpr int64_t kMaxRounds = 64;
  constexpr int kMaxExtraRounds = 1;
  constexpr double kTailKvShareOfL2 = 0.85;  // 45 MB of an H100's / H200's 50 MiB, as measured
  constexpr double kMinModeledGain = 0.01;
  const int64_t remainder = ctas > 0 ? items % ctas : 0;
  if (ctas < 2 || items <= ctas || items / ctas > kMaxRounds || remainder == 0 || m_blocks < 2 ||
      items_per_head != (m_blocks + 1) / 2 || items % items_per_head != 0 ||
      !std::is_sorted(block_cost.begin(), block_cost.end())) {
    return none;
  }
  double head_cost = 0;
  for (double c : block_cost) head_cost += c;
  const double pair_cost = head_cost / static_cast<double>(items_per_head);
  const double rounds = static_cast<double>(items / ctas);
  // Without a tail every CTA runs the same whole rounds of pairs, then `remainder` of them one more.
  TileTail best = none;
  double best_span = (rounds + 1) * pair_cost;
  std::vector<double> load(static_cast<size_t>(ctas));
  for (int extra = 0; extra <= kMaxExtraRounds && extra < rounds; ++extra) {
    const int64_t tail_items = remainder + extra * ctas;
    const int64_t tail_heads = (tail_items + items_per_head - 1) / items_per_head + 1;  // + 1: a partial head
    if (extra > 0 && static_cast<double>(tail_heads) * head_kv_bytes > kTailKvShareOfL2 * l2_bytes) break;
    const TileTail t = make_tile_tail(items, items_per_head, m_blocks, tail_items);
    std::fill(load.begin(), load.end(), 0.0);
    for (int cta = 0; cta < ctas; ++cta) {
      for (int turn = 0;; ++turn) {
        const int rank = tail_rank(turn * static_cast<int>(ctas), (turn & 1) != 0, cta, static_cast<int>(ctas));
        if (rank >= t.tiles) break;
        load[static_cast<size_t>(cta)] += block_cost[static_cast<size_t>(tail_tile(t, static_cast<uint32_t>(rank)).m_block)];
      }
    }
    const double span = (rounds - extra) * pair_cost + *std::max_element(load.begin(), load.end());
    if (span <= (1 - kMinModeledGain) * best_span) {
      best_span = span;
      best = t;
    }
  }
  return best;
}

/** plan_tile_tail for a launch, from the cost model's inputs (query_block_costs' and the plan's):
 *  the same answer, kept for the calling thread's last inputs. The model walks every tail tile of
 *  each candidate (6-9 us on a host core for the training grid's causal calls), and a training or
 *  serving loop repeats its shapes call after call; a repeat builds no cost vector either. */
inline TileTail planned_tile_tail(const MaskInfo& mask, int64_t walk_rows, int block_m, int block_n, int pack_shift,
                                  int64_t items, int64_t items_per_head, int64_t ctas, double head_kv_bytes,
                                  double l2_bytes) {
  struct Inputs {
    int64_t seqlen_q, seqlen_k, window_left, window_right, walk_rows, items, items_per_head, ctas;
    int block_m, block_n, pack_shift;
    double head_kv_bytes, l2_bytes;
    bool operator==(const Inputs& o) const {
      return seqlen_q == o.seqlen_q && seqlen_k == o.seqlen_k && window_left == o.window_left &&
             window_right == o.window_right && walk_rows == o.walk_rows && items == o.items &&
             items_per_head == o.items_per_head && ctas == o.ctas && block_m == o.block_m && block_n == o.block_n &&
             pack_shift == o.pack_shift && head_kv_bytes == o.head_kv_bytes && l2_bytes == o.l2_bytes;
    }
  };
  struct Last {
    bool valid = false;
    Inputs inputs{};
    TileTail plan;
  };
  thread_local Last last;
  const Inputs in{mask.seqlen_q, mask.seqlen_k, mask.window_left, mask.window_right, walk_rows, items, items_per_head,
                  ctas, block_m, block_n, pack_shift, head_kv_bytes, l2_bytes};
  if (!last.valid || !(last.inputs == in)) {
    const std::vector<double> block_cost = query_block_costs(mask, walk_rows, block_m, block_n, pack_shift);
    last.plan = plan_tile_tail(items, items_per_head, block_cost, ctas, head_kv_bytes, l2_bytes);
    last.inputs = in;
    last.valid = true;
  }
  return last.plan;
}

}  // namespace flashcore::cuda::sm90
