// The dropout mask's generator (src/common/dropout.hpp) on its own: Philox4x32-10 against the
// known-answer vectors of its authors' Random123 library, the draws' grouping that the GPU kernels
// rely on, the kept fraction, and that every input of the mask changes it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "common/dropout.hpp"
#include "cpu/dropout_bits.hpp"

namespace flashcore {
namespace {

TEST(DropoutRng, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  const PhiloxWords zero = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(zero.w[0], 0x6627e8d5u);
  EXPECT_EQ(zero.w[1], 0xe169c58du);
  EXPECT_EQ(zero.w[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.w[3], 0x9b00dbd8u);
  const PhiloxWords ones = philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(ones.w[0], 0x408f276du);
  EXPECT_EQ(ones.w[1], 0x41c83b0eu);
  EXPECT_EQ(ones.w[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.w[3], 0x6d5451fdu);
  const PhiloxWords pi = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(pi.w[0], 0xd16cfe09u);
  EXPECT_EQ(pi.w[1], 0x94fdccebu);
  EXPECT_EQ(pi.w[2], 0x5001e420u);
  EXPECT_EQ(pi.w[3], 0x24126ea1u);
}

TEST(DropoutRng, ParametersFromProbability) {
  const DropoutParams off = make_dropout(0.0, 1, 2);
  EXPECT_FALSE(off.enabled());
  const DropoutParams d = make_dropout(0.25, 0x0123456789abcdefull, 0x0000000500000007ull);
  EXPECT_TRUE(d.enabled());
  EXPECT_EQ(d.kept_threshold, 49152u);  // 0.75 * 65536
  EXPECT_FLOAT_EQ(d.keep_scale, 1.f / 0.75f);
  EXPECT_EQ(d.key0, 0x89abcdefu);
  EXPECT_EQ(d.key1, 0x01234567u + 5u);
  EXPECT_EQ(d.offset_lo, 7u);
  EXPECT_EQ(make_dropout(1e-9, 0, 0).kept_threshold, 65536u);  // keeps everything: no draw reaches 2^16
}

// One Philox call serves the columns one accumulator thread holds in a row: 8n + 2t + {0, 1} for
// n = 4u .. 4u + 3 of a 64-key block, and dropout_keep_bits (the CPU form) agrees with the
// per-entry rule everywhere.
// The GPU kernels' forms: the rounds' keys precomputed (philox4x32_10_rounds with
// DropoutParams::round_keys) and one compare per draw against kept_below_hi (dropout_draw_kept)
// must give the rule's draws and decisions, for every 16-bit draw and threshold edge.
TEST(DropoutRng, KernelFormsAreTheRule) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 32);
  };
  for (int i = 0; i < 2000; ++i) {
    const uint64_t seed = (static_cast<uint64_t>(next()) << 32) | next();
    const uint64_t offset = (static_cast<uint64_t>(next()) << 32) | next();
    const DropoutParams d = make_dropout(0.3, seed, offset);
    const uint32_t c0 = next(), c1 = next(), c2 = next();
    const PhiloxWords a = philox4x32_10(c0, c1, c2, d.offset_lo, d.key0, d.key1);
    const PhiloxWords b = philox4x32_10_rounds(c0, c1, c2, d.offset_lo, d.round_keys);
    for (int w = 0; w < 4; ++w) ASSERT_EQ(a.w[w], b.w[w]) << "call " << i << " word " << w;
  }
  for (double p : {1e-6, 1.0 / 65536, 0.1, 0.5, 0.9, 1.0 - 2.0 / 65536, 1.0 - 1.0 / 65536}) {
    const DropoutParams d = make_dropout(p, 7, 0);
    ASSERT_GE(d.kept_threshold, 1u);
    for (uint32_t draw = 0; draw < 65536; ++draw) {
      const uint32_t other = next() & 0xFFFFu;  // the word's other half must not matter
      const bool kept = draw < d.kept_threshold;
      ASSERT_EQ(dropout_draw_kept((other << 16) | draw, 0, d), kept) << "p " << p << " draw " << draw;
      ASSERT_EQ(dropout_draw_kept((draw << 16) | other, 1, d), kept) << "p " << p << " draw " << draw;
    }
  }
}

TEST(DropoutRng, ColumnGroupsMatchTheAccumulatorLayout) {
  for (int64_t j = 0; j < 64 * 5; ++j) {
    const int64_t block = j / 64, n = (j % 64) / 8, t = (j % 8) / 2;
    EXPECT_EQ(dropout_column_group(j), static_cast<uint32_t>(block * 8 + t * 2 + n / 4)) << j;
  }
  const DropoutParams d = make_dropout(0.4, 99, 3);
  // Up to the validated limits: b * heads_q + h below 2^32, rows below 2^32, keys below 2^29.
  for (int64_t bh : {int64_t(0), int64_t(5), int64_t(0xFFFFFFF0)}) {
    for (int64_t i : {int64_t(0), int64_t(1), int64_t(77), int64_t(0xFFFFFFFE)}) {
      for (int64_t block : {int64_t(0), int64_t(1), int64_t(9), (int64_t(1) << 23) - 1}) {
        const uint64_t bits = dropout_keep_bits(d, bh, i, block);
        // The CPU kernels' vectorized form (AVX-512 where built: this file is compiled natively
        // like the kernels) is the same function.
        ASSERT_EQ(cpu::keep_bits_of_block(d, bh, i, block), bits) << bh << " " << i << " " << block;
        for (int64_t k = 0; k < 64; ++k) {
          ASSERT_EQ(((bits >> k) & 1) != 0, dropout_keeps(d, bh, i, block * 64 + k)) << bh << " " << i << " " << block << " " << k;
        }
      }
    }
  }
}

TEST(DropoutRng, KeptFractionIsOneMinusP) {
  for (double p : {0.1, 0.5, 0.9}) {
    const DropoutParams d = make_dropout(p, 1234, 0);
    int64_t kept = 0, total = 0;
    for (int64_t bh = 0; bh < 4; ++bh)
      for (int64_t i = 0; i < 64; ++i)
        for (int64_t block = 0; block < 16; ++block) {
          kept += __builtin_popcountll(dropout_keep_bits(d, bh, i, block));
          total += 64;
        }
    const double expected = (1 - p) * static_cast<double>(total);
    const double sigma = std::sqrt(static_cast<double>(total) * p * (1 - p));
    EXPECT_NEAR(static_cast<double>(kept), expected, 5 * sigma) << "p " << p;
  }
}

/** Fraction of the entries two masks disagree on over a 16 x 256 patch of one problem. */
double disagreement(const DropoutParams& a, int64_t bh_a, const DropoutParams& b, int64_t bh_b) {
  int64_t differ = 0;
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t block = 0; block < 4; ++block)
      differ += __builtin_popcountll(dropout_keep_bits(a, bh_a, i, block) ^ dropout_keep_bits(b, bh_b, i, block));
  return static_cast<double>(differ) / (16 * 256);
}

TEST(DropoutRng, EveryInputChangesTheMask) {
  // Independent masks at p = 0.5 disagree on half their entries.
  const DropoutParams base = make_dropout(0.5, 42, 7);
  EXPECT_EQ(disagreement(base, 3, base, 3), 0.0);
  EXPECT_NEAR(disagreement(base, 3, base, 4), 0.5, 0.05);                           // problem (b, h)
  EXPECT_NEAR(disagreement(base, 3, make_dropout(0.5, 43, 7), 3), 0.5, 0.05);       // seed
  EXPECT_NEAR(disagreement(base, 3, make_dropout(0.5, 42, 8), 3), 0.5, 0.05);       // offset
  EXPECT_NEAR(disagreement(base, 3, make_dropout(0.5, 42, 7 + (1ull << 32)), 3), 0.5, 0.05);  // offset's high word
  EXPECT_NEAR(disagreement(base, 3, make_dropout(0.5, 42ull + (1ull << 32), 7), 3), 0.5, 0.05);  // seed's high word
  // Rows: row i against row i + 1 of the same problem.
  int64_t differ = 0;
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t block = 0; block < 4; ++block)
      differ += __builtin_popcountll(dropout_keep_bits(base, 3, i, block) ^ dropout_keep_bits(base, 3, i + 1, block));
  EXPECT_NEAR(static_cast<double>(differ) / (16 * 256), 0.5, 0.05);
}

}  // namespace
}  // namespace flashcore
