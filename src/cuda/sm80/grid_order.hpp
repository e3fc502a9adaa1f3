// The order in which the sm80 kernels' CTAs take their (sequence x head, block) work items (plain
// C++ with host-device functions: tests/cpu/test_grid_order.cpp checks the mapping on the CPU).
//
// The GPU dispatches a grid's CTAs in index order as slots free up. The sm80 kernels give each
// (batch, head) pair's blocks consecutive indices, heaviest block first, so that the CTAs running
// together share that pair's K / V (or Q / dO) in L2. Under a causal mask or a window the blocks of
// a pair cost different amounts (a query block sees more keys the later it is; a key block is seen
// by more query blocks the earlier it is), and the grid's last pairs then left a few long blocks
// running alone at its end: a list-scheduling model of the training grid put that order 6-15%
// above the ideal makespan. The last ~two waves of work items therefore run in order of falling
// cost across their pairs (every tail pair's heaviest block, then every one's second, ...), which
// keeps the tail's K / V within L2. Measured on the forward (H200, docs/PERF.md session 49): +3% to
// +11% on every causal cell; the whole grid in that order lost L2 reuse from 1k keys on. The
// backward grids take it too (session 50, fwd+bwd on causal cells): the sm80 dK / dV and
// deterministic dQ kernels +0.6% to +5.5%, and the Hopper backward's one-CTA-per-tile grid
// (src/cuda/sm90/backward.cuh, which reuses these types) -0.2% to +4.1%.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common/host_device.hpp"

namespace flashcore::cuda::sm80 {

struct GridOrder {
  int blocks_per_pair = 1;        // work items of one (batch, head) pair
  int lpt_first_block = INT_MAX;  // grid index where the tail starts (none: past the grid)
  int lpt_first_pair = 0;         // lpt_first_block / blocks_per_pair
  int lpt_pairs = 1;              // pairs in the tail
};

struct GridPosition {
  int pair;   // batch x heads index (its meaning is the kernel's)
  int block;  // block index inside the pair
};

/** Where grid index `index` works: one 32-bit division either way (index = pair * blocks_per_pair +
 *  rank outside the tail, t = rank * lpt_pairs + tail pair inside it; rank 0 is the heaviest).
 *  kHeaviestLast: cost rises with the block index (query blocks under a causal mask), so rank r is
 *  block blocks_per_pair - 1 - r; else (key blocks) block r. */
template <bool kHeaviestLast>
FC_HOST_DEVICE GridPosition grid_position(const GridOrder& order, int index) {
  const bool in_tail = index >= order.lpt_first_block;
  const int local = in_tail ? index - order.lpt_first_block : index;
  const int divisor = in_tail ? order.lpt_pairs : order.blocks_per_pair;
  const int quotient = local / divisor, remainder = local - quotient * divisor;
  const int rank = in_tail ? quotient : remainder;
  return GridPosition{in_tail ? order.lpt_first_pair + remainder : quotient,
                      kHeaviestLast ? order.blocks_per_pair - 1 - rank : rank};
}

/** The order of a grid of pairs x blocks_per_pair CTAs (callers check that it fits an int), with
 *  `slots` CTAs resident at once (0 when unknown: the plain order). costs_differ: a mask makes the
 *  blocks of a pair cost different amounts; otherwise the plain order. */
inline GridOrder make_grid_order(int64_t pairs, int64_t blocks_per_pair, bool costs_differ, int64_t slots) {
  constexpr int64_t kTailWaves = 2;
  GridOrder order;
  order.blocks_per_pair = static_cast<int>(blocks_per_pair);
  if (!costs_differ || blocks_per_pair < 2 || slots <= 0 || pairs <= 0) return order;
  const int64_t tail = std::min(pairs, (kTailWaves * slots + blocks_per_pair - 1) / blocks_per_pair);
  order.lpt_pairs = static_cast<int>(tail);
  order.lpt_first_pair = static_cast<int>(pairs - tail);
  order.lpt_first_block = static_cast<int>((pairs - tail) * blocks_per_pair);
  return order;
}

}  // namespace flashcore::cuda::sm80
