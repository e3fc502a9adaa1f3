// The sm80 kernels' grid order (src/cuda/sm80/grid_order.hpp), checked on the CPU: every grid
// index works on a distinct (pair, block), the plain part runs pair by pair heaviest block first,
// and the tail runs in order of falling cost across its pairs.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <utility>

#include "cuda/sm80/grid_order.hpp"

namespace {
using flashcore::cuda::sm80::GridOrder;
using flashcore::cuda::sm80::GridPosition;
using flashcore::cuda::sm80::grid_position;
using flashcore::cuda::sm80::make_grid_order;

// The block's cost rank (0 = the heaviest) under kHeaviestLast's rule.
template <bool kHeaviestLast>
int rank_of(const GridOrder& order, int block) {
  return kHeaviestLast ? order.blocks_per_pair - 1 - block : block;
}

template <bool kHeaviestLast>
void check_order(int64_t pairs, int64_t blocks, bool costs_differ, int64_t slots) {
  SCOPED_TRACE(testing::Message() << "pairs " << pairs << ", blocks " << blocks << ", masked " << costs_differ
                                  << ", slots " << slots);
  const GridOrder order = make_grid_order(pairs, blocks, costs_differ, slots);
  const int total = static_cast<int>(pairs * blocks);
  std::set<std::pair<int, int>> seen;
  int previous_rank = -1;
  for (int index = 0; index < total; ++index) {
    const GridPosition at = grid_position<kHeaviestLast>(order, index);
    ASSERT_GE(at.pair, 0);
    ASSERT_LT(at.pair, pairs);
    ASSERT_GE(at.block, 0);
    ASSERT_LT(at.block, blocks);
    ASSERT_TRUE(seen.insert({at.pair, at.block}).second) << "index " << index << " repeats a work item";
    const int rank = rank_of<kHeaviestLast>(order, at.block);
    if (index < order.lpt_first_block) {
      EXPECT_EQ(at.pair, index / blocks);  // pair by pair, heaviest first
      EXPECT_EQ(rank, index % blocks);
    } else {
      EXPECT_GE(at.pair, order.lpt_first_pair);  // the tail: ranks never rise
      EXPECT_GE(rank, previous_rank);
      previous_rank = rank;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), pairs * blocks);
}

TEST(GridOrder, EveryWorkItemOnceInBothOrders) {
  for (int64_t pairs : {1, 2, 3, 7, 64, 1024})
    for (int64_t blocks : {1, 2, 3, 4, 16, 128})
      for (bool masked : {false, true})
        for (int64_t slots : {0, 1, 132, 264}) {
          check_order<true>(pairs, blocks, masked, slots);
          check_order<false>(pairs, blocks, masked, slots);
        }
}

TEST(GridOrder, TailOnlyWhereCostsDiffer) {
  const GridOrder plain = make_grid_order(512, 4, /*costs_differ=*/false, 264);
  EXPECT_GE(plain.lpt_first_block, 512 * 4);  // no tail: every index takes the plain order
  const GridOrder one_block = make_grid_order(512, 1, /*costs_differ=*/true, 264);
  EXPECT_GE(one_block.lpt_first_block, 512);
  const GridOrder unknown_device = make_grid_order(512, 4, /*costs_differ=*/true, 0);
  EXPECT_GE(unknown_device.lpt_first_block, 512 * 4);
}

TEST(GridOrder, TailHoldsAboutTwoWavesOfWholePairs) {
  // 264 resident CTAs, 4 blocks a pair: ceil(2 * 264 / 4) = 132 pairs in the tail.
  const GridOrder order = make_grid_order(1024, 4, /*costs_differ=*/true, 264);
  EXPECT_EQ(order.lpt_pairs, 132);
  EXPECT_EQ(order.lpt_first_pair, 1024 - 132);
  EXPECT_EQ(order.lpt_first_block, (1024 - 132) * 4);
  // Long pairs: fewer of them (ceil(528 / 128) = 5).
  const GridOrder long_pairs = make_grid_order(16, 128, /*costs_differ=*/true, 264);
  EXPECT_EQ(long_pairs.lpt_pairs, 5);
  EXPECT_EQ(long_pairs.lpt_first_block, 11 * 128);
  // Fewer pairs than two waves need: the whole grid is the tail.
  const GridOrder small = make_grid_order(4, 16, /*costs_differ=*/true, 264);
  EXPECT_EQ(small.lpt_pairs, 4);
  EXPECT_EQ(small.lpt_first_block, 0);
}

TEST(GridOrder, TailStartsWithEveryPairsHeaviestBlock) {
  const GridOrder order = make_grid_order(40, 8, /*costs_differ=*/true, 48);  // tail: ceil(96 / 8) = 12 pairs
  ASSERT_EQ(order.lpt_pairs, 12);
  for (int t = 0; t < 12; ++t) {
    const GridPosition causal_query = grid_position<true>(order, order.lpt_first_block + t);
    EXPECT_EQ(causal_query.pair, 28 + t);
    EXPECT_EQ(causal_query.block, 7);  // the last query block
    const GridPosition key = grid_position<false>(order, order.lpt_first_block + t);
    EXPECT_EQ(key.block, 0);  // the first key block
  }
}

}  // namespace
