// The Hopper forward's tile tail (src/cuda/sm90/tile_tail.hpp), checked on the CPU: the tail's
// ranks cover exactly the tiles of its pair items in order of falling cost, the whole persistent
// walk (bulk pairs by stride, then the snake) gives every tile to one CTA once, and the host's
// plan takes a tail only where its model finishes sooner.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "cuda/sm90/tile_tail.hpp"

namespace {
using flashcore::MaskInfo;
using flashcore::cuda::sm90::make_tile_tail;
using flashcore::cuda::sm90::pair_half_of;
using flashcore::cuda::sm90::PairHalf;
using flashcore::cuda::sm90::plan_tile_tail;
using flashcore::cuda::sm90::planned_tile_tail;
using flashcore::cuda::sm90::query_block_costs;
using flashcore::cuda::sm90::tail_rank;
using flashcore::cuda::sm90::tail_tile;
using flashcore::cuda::sm90::TailTile;
using flashcore::cuda::sm90::TileTail;

using Tile = std::pair<int, int>;  // (head, query block)

// The tiles of pair item i (head i / per_head, pair j = i % per_head): blocks M - 1 - j and j.
void add_pair_tiles(int64_t item, int64_t per_head, int m_blocks, std::vector<Tile>& out) {
  const int head = static_cast<int>(item / per_head), j = static_cast<int>(item % per_head);
  out.push_back({head, m_blocks - 1 - j});
  if (j != m_blocks - 1 - j) out.push_back({head, j});
}

void check_tail(int heads, int m_blocks, int64_t tail_items) {
  SCOPED_TRACE(testing::Message() << "heads " << heads << ", blocks " << m_blocks << ", tail items " << tail_items);
  const int64_t per_head = (m_blocks + 1) / 2, items = per_head * heads;
  const TileTail t = make_tile_tail(items, per_head, m_blocks, tail_items);
  std::vector<Tile> expected;
  for (int64_t i = items - std::min(tail_items, items); i < items; ++i) add_pair_tiles(i, per_head, m_blocks, expected);
  ASSERT_EQ(t.tiles, static_cast<int>(expected.size()));
  std::set<Tile> seen;
  Tile previous{-1, m_blocks};
  for (int rank = 0; rank < t.tiles; ++rank) {
    const TailTile at = tail_tile(t, static_cast<uint32_t>(rank));
    const Tile tile{at.rest, at.m_block};
    ASSERT_TRUE(seen.insert(tile).second) << "rank " << rank << " repeats a tile";
    // Falling cost: the query block never rises; within a level, heads in order.
    ASSERT_TRUE(at.m_block < previous.second || (at.m_block == previous.second && at.rest > previous.first))
        << "rank " << rank;
    previous = tile;
  }
  EXPECT_EQ(seen, std::set<Tile>(expected.begin(), expected.end()));
}

TEST(TileTail, RanksCoverTheTailsTilesHeaviestFirst) {
  for (int heads : {1, 2, 3, 7, 32})
    for (int m_blocks : {2, 3, 4, 5, 16, 43, 86})
      for (int64_t tail_items : {1, 2, 3, 5, 17, 55, 132, 187, 10000}) check_tail(heads, m_blocks, tail_items);
}

TEST(TileTail, PairHalfNamesTheBlockAsThePairsWalkDoes) {
  for (int m_blocks : {1, 2, 5, 8, 43, 86})
    for (int m = 0; m < m_blocks; ++m) {
      const PairHalf at = pair_half_of(m, m_blocks);
      ASSERT_LT(at.pair, (m_blocks + 1) / 2);
      // The walk's block for (pair, half), and its rule that half 1 of an odd M's middle pair
      // repeats half 0 (so is skipped): a tail tile must never be named that way.
      EXPECT_EQ(at.half == 0 ? m_blocks - 1 - at.pair : at.pair, m) << m_blocks << " blocks, block " << m;
      EXPECT_FALSE(at.half == 1 && at.pair == m_blocks - 1 - at.pair);
    }
}

TEST(TileTail, SnakeDealsEveryRankOnce) {
  for (uint32_t ctas : {1u, 2u, 5u, 132u}) {
    std::vector<int> taken(5 * ctas + 3, 0);
    for (uint32_t cta = 0; cta < ctas; ++cta)
      for (uint32_t round = 0;; ++round) {
        const int rank = tail_rank(static_cast<int>(round * ctas), (round & 1) != 0, static_cast<int>(cta), static_cast<int>(ctas));
        if (rank >= static_cast<int>(taken.size())) break;
        ++taken[rank];
      }
    for (size_t r = 0; r < taken.size(); ++r) EXPECT_EQ(taken[r], 1) << "ctas " << ctas << ", rank " << r;
  }
  // Round 1 runs backwards: the CTA with the heaviest first tile gets the lightest second one.
  EXPECT_EQ(tail_rank(0, false, 0, 132), 0);
  EXPECT_EQ(tail_rank(132, true, 0, 132), 263);
  EXPECT_EQ(tail_rank(132, true, 131, 132), 132);
}

// One head's K and V in bf16 / fp16 bytes, and the L2 of an H100 / H200: what plan_tile_tail weighs.
double kv_bytes(int seqlen_k, int head_dim) { return 2.0 * seqlen_k * head_dim * 2; }
constexpr double kL2Bytes = 50.0 * 1024 * 1024;

// Block m of a causal call of seqlen x seqlen: its key blocks plus one (the launcher's model).
std::vector<double> causal_costs(int seqlen, int block_m, int block_n) {
  const MaskInfo causal{seqlen, seqlen, -1, 0};
  return query_block_costs(causal, seqlen, block_m, block_n, 0);
}

// The persistent walk as each CTA runs it (forward.cuh's TileWalker): items by stride up to the
// tail, then the snake. Returns each CTA's modeled time; every tile must be walked exactly once.
std::vector<double> walk(const TileTail& t, int64_t items, int64_t per_head, const std::vector<double>& cost,
                         int ctas) {
  const int m_blocks = static_cast<int>(cost.size());
  std::multiset<Tile> walked;
  std::vector<double> load(static_cast<size_t>(ctas), 0.0);
  for (int cta = 0; cta < ctas; ++cta) {
    std::vector<Tile> mine;
    for (int64_t item = cta; item < std::min<int64_t>(items, t.first_item); item += ctas)
      add_pair_tiles(item, per_head, m_blocks, mine);
    for (uint32_t round = 0;; ++round) {
      const int rank = tail_rank(static_cast<int>(round) * ctas, (round & 1) != 0, cta, ctas);
      if (rank >= t.tiles) break;
      const TailTile at = tail_tile(t, static_cast<uint32_t>(rank));
      mine.push_back({at.rest, at.m_block});
    }
    for (const Tile& tile : mine) {
      walked.insert(tile);
      load[static_cast<size_t>(cta)] += cost[static_cast<size_t>(tile.second)];
    }
  }
  const int heads = static_cast<int>(items / per_head);
  EXPECT_EQ(walked.size(), static_cast<size_t>(heads) * static_cast<size_t>(m_blocks));
  for (int h = 0; h < heads; ++h)
    for (int m = 0; m < m_blocks; ++m) EXPECT_EQ(walked.count({h, m}), 1u) << "head " << h << ", block " << m;
  return load;
}

TEST(TileTail, PlanOnTheCausalTrainingGridWalksEveryTileAndFinishesNoLater) {
  struct Cell {
    int seqlen, heads, head_dim, block_m, block_n;
  };
  // 16k tokens, model dim 2048: d64 (192- or 128-row tiles), d128 (128 x 128), d256 (128 x 64).
  const Cell cells[] = {{16384, 32, 64, 192, 128},  {8192, 64, 64, 192, 128},  {4096, 128, 64, 192, 128},
                        {2048, 256, 64, 128, 128},  {1024, 512, 64, 128, 128}, {16384, 16, 128, 128, 128},
                        {8192, 32, 128, 128, 128},  {2048, 128, 128, 128, 128}, {1024, 256, 128, 128, 128},
                        {16384, 8, 256, 128, 64},   {4096, 32, 256, 128, 64},   {1024, 128, 256, 128, 64}};
  for (const Cell& c : cells) {
    SCOPED_TRACE(testing::Message() << "seqlen " << c.seqlen << ", heads " << c.heads << ", tile " << c.block_m);
    const std::vector<double> cost = causal_costs(c.seqlen, c.block_m, c.block_n);
    const int64_t per_head = (static_cast<int64_t>(cost.size()) + 1) / 2, items = per_head * c.heads;
    const int ctas = 132;
    const TileTail plan = plan_tile_tail(items, per_head, cost, ctas, kv_bytes(c.seqlen, c.head_dim), kL2Bytes);
    const std::vector<double> with_plan = walk(plan, items, per_head, cost, ctas);
    const std::vector<double> pairs_only = walk(TileTail{}, items, per_head, cost, ctas);
    const double planned = *std::max_element(with_plan.begin(), with_plan.end());
    const double plain = *std::max_element(pairs_only.begin(), pairs_only.end());
    EXPECT_LE(planned, plain);
    if (c.seqlen == 1024 && c.head_dim == 128) {  // d128 1k: 1024 pairs over 132 CTAs, 7.76 rounds
      EXPECT_EQ(plan.first_item, items - items % ctas);  // a round more models no better
      EXPECT_LT(planned, 0.98 * plain);
    }
    if (c.head_dim <= 128 && c.seqlen >= 2048) {  // a round more: the remainder alone gains < 1%
      EXPECT_EQ(plan.first_item, items - items % ctas - ctas);
      EXPECT_LT(planned, 0.985 * plain);
    }
    if (c.head_dim == 256 && c.seqlen >= 2048) {  // 67-84 MB of K/V in a round more's heads
      EXPECT_GE(plan.first_item, items - items % ctas);
    }
  }
}

TEST(TileTail, BlockCostsFollowTheBottomRightCausalDiagonal) {
  // 600 queries against 700 keys, 128 x 128 tiles: block m sees keys up to 128 (m + 1) + 100.
  const MaskInfo causal{600, 700, -1, 0};
  EXPECT_EQ(query_block_costs(causal, 600, 128, 128, 0), (std::vector<double>{3, 4, 5, 6, 7}));
  // Packed GQA, group 4 (shift 2): 512 packed rows are tokens 0..127.
  const MaskInfo square{128, 128, -1, 0};
  EXPECT_EQ(query_block_costs(square, 512, 128, 64, 2),
            (std::vector<double>{2, 2, 3, 3}));
}

// The shapes of tests/cuda/test_cuda_attention.cpp's CudaForward.ManyTiles take a tail on a GPU of
// 132 SMs (an H100 / H200): whole heads after one or three rounds, or (d64, where the tail takes a
// round of pairs more) a tail that starts inside a head.
TEST(TileTail, TheGpuTestShapesTakeTheTail) {
  struct Shape {
    int batch, heads, head_dim, seqlen_q, seqlen_k, block_m, block_n, first_item, first_pair;
  };
  const Shape shapes[] = {{2, 24, 128, 600, 700, 128, 128, 132, 0},
                          {1, 40, 256, 900, 1000, 128, 64, 132, 0},
                          {2, 41, 128, 1300, 1400, 128, 128, 396, 0},
                          {1, 70, 64, 1200, 1200, 128, 128, 132, 2}};  // the two-consumer tile below 4096 keys; a round more
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << s.batch << " x " << s.heads << " heads, " << s.seqlen_q << " x " << s.seqlen_k);
    const MaskInfo causal{s.seqlen_q, s.seqlen_k, -1, 0};
    const std::vector<double> cost = query_block_costs(causal, s.seqlen_q, s.block_m, s.block_n, 0);
    const int64_t per_head = (static_cast<int64_t>(cost.size()) + 1) / 2, items = per_head * s.heads * s.batch;
    const TileTail plan = plan_tile_tail(items, per_head, cost, 132, kv_bytes(s.seqlen_k, s.head_dim), kL2Bytes);
    EXPECT_GT(plan.tiles, 0);
    EXPECT_EQ(plan.first_item, s.first_item);
    EXPECT_EQ(plan.first_pair, s.first_pair);
  }
}

TEST(TileTail, NoTailWhereItCannotHelpOrWouldRunBackwards) {
  const std::vector<double> rising = causal_costs(4096, 128, 128);  // 32 blocks, 16 pairs a head
  // Fewer items than CTAs, or more than 64 rounds: no tail.
  EXPECT_EQ(plan_tile_tail(16 * 4, 16, rising, 132, kv_bytes(4096, 128), kL2Bytes).tiles, 0);
  EXPECT_EQ(plan_tile_tail(16 * 132 * 70, 16, rising, 132, kv_bytes(4096, 128), kL2Bytes).tiles, 0);
  // Costs falling along the query blocks (a window bounded on the left only).
  std::vector<double> falling(rising.rbegin(), rising.rend());
  EXPECT_EQ(plan_tile_tail(16 * 100, 16, falling, 132, kv_bytes(4096, 128), kL2Bytes).tiles, 0);
  EXPECT_GE(plan_tile_tail(16 * 100, 16, falling, 132, kv_bytes(4096, 128), kL2Bytes).first_item, 16 * 100);
}

// The launch's kept plan answers as the model does when the inputs change between calls, back and
// forth, in any one of them.
TEST(TileTail, TheKeptPlanFollowsItsInputs) {
  struct Call {
    int seqlen;
    int64_t heads, ctas;
    double head_kv, l2;
  };
  const Call calls[] = {{1024, 256, 132, kv_bytes(1024, 128), kL2Bytes},
                        {16384, 16, 132, kv_bytes(16384, 128), kL2Bytes},
                        {1024, 256, 132, kv_bytes(1024, 128), kL2Bytes},
                        {1024, 256, 114, kv_bytes(1024, 128), kL2Bytes},
                        {16384, 16, 132, kv_bytes(16384, 128), kL2Bytes / 4},
                        {16384, 16, 132, kv_bytes(16384, 64), kL2Bytes},
                        {16384, 20, 132, kv_bytes(16384, 128), kL2Bytes},
                        {16384, 16, 132, kv_bytes(16384, 128), kL2Bytes}};
  for (const Call& c : calls) {
    const std::vector<double> cost = causal_costs(c.seqlen, 128, 128);
    const int64_t per_head = (static_cast<int64_t>(cost.size()) + 1) / 2, items = per_head * c.heads;
    const TileTail want = plan_tile_tail(items, per_head, cost, c.ctas, c.head_kv, c.l2);
    const MaskInfo causal{c.seqlen, c.seqlen, -1, 0};
    for (int repeat = 0; repeat < 2; ++repeat) {
      const TileTail got = planned_tile_tail(causal, c.seqlen, 128, 128, 0, items, per_head, c.ctas, c.head_kv, c.l2);
      EXPECT_EQ(got.first_item, want.first_item);
      EXPECT_EQ(got.tiles, want.tiles);
      EXPECT_EQ(got.first_rest, want.first_rest);
      EXPECT_EQ(got.first_pair, want.first_pair);
      EXPECT_EQ(got.full_heads, want.full_heads);
    }
  }
}

}  // namespace
