// The sm80 backward's tiled dQ accumulator layout (DqTiles, src/cuda/sm80/backward_workspace.hpp),
// checked on the CPU: each slot order places a 16 x 8 fragment tile's 128 values once, the rows
// g and g + 8 the postprocess reads together sit where it reads them, a 16-row group's tiles fill
// exactly the floats the preprocess zeroes as flat rows, and every sequence of a ragged batch gets
// whole tiles of its own inside the rows the workspace holds.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cuda/sm80/backward_workspace.hpp"

namespace {
using flashcore::cuda::sm80::DqTiles;

// The m16n8 accumulator fragment: register k of `lane` holds element (row, col) of the tile.
int fragment_row(int lane, int k) { return lane / 4 + 8 * (k / 2); }
int fragment_col(int lane, int k) { return 2 * (lane % 4) + k % 2; }

TEST(DqTiles, EachSlotOrderPlacesATileOnce) {
  for (bool vector : {true, false}) {
    std::set<int> seen;
    for (int lane = 0; lane < 32; ++lane) {
      for (int k = 0; k < 4; ++k) {
        const int slot = DqTiles::slot(lane, k, vector);
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, DqTiles::kElems);
        ASSERT_TRUE(seen.insert(slot).second) << "vector " << vector << " lane " << lane << " k " << k;
      }
    }
  }
}

TEST(DqTiles, RowPairsSitWhereThePostprocessReadsThem) {
  // load_dq_tile_rows: vector slots, rows g and g + 8 are float4 4g..4g+3, column 2j, 2j + 1 of row
  // g in .x / .y of float4 4g + j and row g + 8's in .z / .w; scalar slots, register k of lanes
  // 4g..4g+3 is float4 8k + g (k = 0 row g's even columns, 1 its odd ones, 2 / 3 row g + 8's).
  for (int lane = 0; lane < 32; ++lane) {
    for (int k = 0; k < 4; ++k) {
      const int row = fragment_row(lane, k), col = fragment_col(lane, k);
      const int g = row % 8, j = col / 2;
      const int vector_expected = 4 * (4 * g + j) + (row >= 8 ? 2 : 0) + col % 2;
      EXPECT_EQ(DqTiles::slot(lane, k, true), vector_expected) << "lane " << lane << " k " << k;
      const int reg = (row >= 8 ? 2 : 0) + col % 2;
      const int scalar_expected = 4 * (8 * reg + g) + j;
      EXPECT_EQ(DqTiles::slot(lane, k, false), scalar_expected) << "lane " << lane << " k " << k;
    }
  }
}

TEST(DqTiles, AGroupsTilesFillItsFlatRows) {
  // The preprocess zeroes a 16-row group as 16 flat rows of head_dim floats.
  for (int head_dim : {64, 128, 256}) {
    for (int64_t group : {0, 1, 7}) {
      std::set<int64_t> covered;
      for (int r = 0; r < DqTiles::kRows; ++r) {
        for (int col = 0; col < head_dim; col += DqTiles::kCols) {
          const int64_t tile = DqTiles::tile_offset(group * DqTiles::kRows + r, col, head_dim);
          for (int e = 0; e < DqTiles::kElems; ++e) covered.insert(tile + e);
        }
      }
      const int64_t first = group * DqTiles::kRows * head_dim;
      ASSERT_EQ(covered.size(), static_cast<size_t>(DqTiles::kRows * head_dim));
      EXPECT_EQ(*covered.begin(), first);
      EXPECT_EQ(*covered.rbegin(), first + DqTiles::kRows * head_dim - 1);
    }
  }
}

TEST(DqTiles, SequencesGetWholeTilesOfTheirOwn) {
  std::mt19937 rng(20261130);
  for (int trial = 0; trial < 400; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 12);
    std::vector<int64_t> starts, lengths;
    int64_t row = rng() % 3 == 0 ? rng() % 40 : 0;  // varlen may start past row 0
    for (int b = 0; b < batch; ++b) {
      const int64_t length = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 300);
      starts.push_back(row);
      lengths.push_back(length);
      row += length;
    }
    const int64_t total_q = row + (rng() % 2 ? 0 : rng() % 20);  // rows past the last sequence
    const int64_t rows = DqTiles::rows_per_head(total_q, batch);
    int64_t previous_end = 0;
    for (int b = 0; b < batch; ++b) {
      SCOPED_TRACE(testing::Message() << "trial " << trial << ", sequence " << b);
      const int64_t row0 = DqTiles::sequence_row0(starts[b], b);
      ASSERT_EQ(row0 % DqTiles::kRows, 0);
      ASSERT_GE(row0, previous_end) << "overlaps the sequence before";
      const int64_t end = row0 + (lengths[b] + DqTiles::kRows - 1) / DqTiles::kRows * DqTiles::kRows;
      ASSERT_LE(end, rows) << "past the workspace's rows";
      previous_end = end;
    }
  }
}

}  // namespace
