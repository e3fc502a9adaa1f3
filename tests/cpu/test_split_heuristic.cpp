// The decode path's split-KV count (src/cuda/decode/split_heuristic.hpp), a host-only model, on
// the numbers of the devices it was measured on: the decode target cells (GQA 32 / 8 heads, d128,
// so 8 CTAs per sequence) on 132 SMs, two d128 CTAs resident per SM.
#include <gtest/gtest.h>

#include "cuda/decode/split_heuristic.hpp"

namespace {
using flashcore::cuda::decode::choose_num_splits;
using flashcore::cuda::decode::eight_warp_ctas_suit;
using flashcore::cuda::decode::one_wave_fills_sms;
using flashcore::cuda::decode::split_read_rate;
using flashcore::cuda::decode::SplitModel;

constexpr double kCtaRate = 23.3e9;  // one 4-warp CTA (4 x HeuristicTraits::kWarpReadRate)

SplitModel cell(int64_t batch, int64_t kv_len, double dram_peak) {
  SplitModel m;
  m.ctas = batch * 8;
  m.max_splits = std::min<int64_t>(kv_len / 256, 128);
  m.sms = 132;
  m.ctas_per_sm = 2;
  m.cta_read_rate = kCtaRate;
  m.read_rate = 0.9 * dram_peak;
  return m;
}

TEST(DecodeSplitHeuristic, H100KeepsOneCtaPerSm) {
  // Measured (docs/PERF.md session 18): 16 splits best at 1 x 65536, one split at 16 x 8192 and
  // 64 x 2048.
  EXPECT_EQ(choose_num_splits(cell(1, 65536, 3.35e12)), 16);
  EXPECT_EQ(choose_num_splits(cell(16, 8192, 3.35e12)), 1);
  EXPECT_EQ(choose_num_splits(cell(64, 2048, 3.35e12)), 1);
}

TEST(DecodeSplitHeuristic, H200FillsTwoCtasPerSm) {
  // Measured (session 33): 32 splits at 1 x 65536 (3.61 TB/s against 2.87 with 16), two at
  // 16 x 8192 (4.05 against 3.08 with one), one at 64 x 2048 (512 CTAs already fill the SMs).
  EXPECT_EQ(choose_num_splits(cell(1, 65536, 4.8e12)), 32);
  EXPECT_EQ(choose_num_splits(cell(16, 8192, 4.8e12)), 2);
  EXPECT_EQ(choose_num_splits(cell(64, 2048, 4.8e12)), 1);
}

TEST(DecodeSplitHeuristic, EightWarpCtasOnePerSm) {
  // Where one wave of them fills the SMs, Hopper runs 8-warp CTAs (one per SM; the host caps the
  // splits at that wave). Measured on the H200 (session 33): 16 splits best at 1 x 65536 (3.78
  // TB/s against 3.51 with 32), one at 16 x 8192 (4.18 against 3.99 with two).
  for (double peak : {3.35e12, 4.8e12}) {
    SplitModel wide = cell(1, 65536, peak);
    wide.ctas_per_sm = 1;
    wide.cta_read_rate = 2 * kCtaRate;
    wide.max_splits = 132 / wide.ctas;
    EXPECT_EQ(choose_num_splits(wide), 16) << peak;
    wide = cell(16, 8192, peak);
    wide.ctas_per_sm = 1;
    wide.cta_read_rate = 2 * kCtaRate;
    wide.max_splits = 132 / wide.ctas;
    EXPECT_EQ(choose_num_splits(wide), 1) << peak;
  }
}

TEST(DecodeSplitHeuristic, EightWarpCtasOnlyWhereOneWaveFillsTheSms) {
  // 8 KV heads per sequence: batch 1, 2, 4, 8, 16 (with 16 / 8 / 4 / 2 / 1 splits) fill 128 of
  // 132 SMs; batch 3 (24 CTAs) fills 120 at best, batch 64 (512 CTAs) needs four waves.
  for (int64_t batch : {1, 2, 4, 8, 16}) EXPECT_TRUE(one_wave_fills_sms(batch * 8, 132)) << batch;
  for (int64_t batch : {3, 5, 12, 17, 64}) EXPECT_FALSE(one_wave_fills_sms(batch * 8, 132)) << batch;
  EXPECT_TRUE(one_wave_fills_sms(33, 132));
  EXPECT_TRUE(one_wave_fills_sms(132, 132));
  EXPECT_FALSE(one_wave_fills_sms(133, 132));
  EXPECT_FALSE(one_wave_fills_sms(0, 132));
  EXPECT_FALSE(one_wave_fills_sms(8, 0));
  // A caller's num_splits: 8 warps while its CTAs make one wave (bench/decode_bench.py --sweep then
  // times 1 x 65536 with 16 splits on 8 warps and with 32 on 4).
  EXPECT_TRUE(eight_warp_ctas_suit(8, 0, 132));
  EXPECT_FALSE(eight_warp_ctas_suit(24, 0, 132));
  EXPECT_TRUE(eight_warp_ctas_suit(8, 16, 132));
  EXPECT_FALSE(eight_warp_ctas_suit(8, 32, 132));
  EXPECT_TRUE(eight_warp_ctas_suit(24, 5, 132));
  EXPECT_FALSE(eight_warp_ctas_suit(24, 6, 132));
  EXPECT_FALSE(eight_warp_ctas_suit(0, 1, 132));
}

TEST(DecodeSplitHeuristic, UnknownBandwidthTakesOneCtaPerSmAsSaturating) {
  EXPECT_EQ(choose_num_splits(cell(1, 65536, 0)), 16);
  EXPECT_EQ(choose_num_splits(cell(16, 8192, 0)), 1);
}

TEST(DecodeSplitHeuristic, UnevenSmsCostTheirWave) {
  // 192 CTAs on 132 SMs: 60 SMs hold two, and their CTAs set the wave's time (the H200 read 3.18
  // TB/s with 24 splits at 1 x 65536, about what 16 splits read, against 3.61 with 32).
  const SplitModel m = cell(1, 65536, 4.8e12);
  EXPECT_LT(split_read_rate(m, 24), 1.1 * split_read_rate(m, 16));
  EXPECT_GT(split_read_rate(m, 32), 1.3 * split_read_rate(m, 16));
}

TEST(DecodeSplitHeuristic, DegenerateModelsTakeOneSplit) {
  SplitModel m = cell(1, 65536, 4.8e12);
  m.cta_read_rate = 0;
  EXPECT_EQ(choose_num_splits(m), 1);
  m = cell(1, 65536, 4.8e12);
  m.sms = 0;
  EXPECT_EQ(choose_num_splits(m), 1);
  m = cell(1, 65536, 4.8e12);
  m.ctas = 0;
  EXPECT_EQ(choose_num_splits(m), 1);
}

TEST(DecodeSplitHeuristic, StaysWithinTheAllowedSplits) {
  for (int64_t ctas : {1, 3, 8, 100, 1000, 100000}) {
    for (int64_t max_splits : {0, 1, 2, 7, 128}) {
      for (double peak : {0.0, 2.0e12, 3.35e12, 8.0e12}) {
        SplitModel m = cell(1, 256, peak);
        m.ctas = ctas;
        m.max_splits = max_splits;
        const int s = choose_num_splits(m);
        EXPECT_GE(s, 1);
        EXPECT_LE(s, std::max<int64_t>(1, max_splits));
      }
    }
  }
}
}  // namespace
