// The Hopper forward's split-KV plan (src/cuda/sm90/split_kv.hpp), host-only: which calls cut their
// tiles' key ranges, into how many splits, and the workspace of the partials. The shapes of the GPU
// test CudaForward.SplitKv are checked to split here (with 132 SMs, and with 32), so that test runs
// the split kernels.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/sm90/split_kv.hpp"

namespace {
using flashcore::AttentionParams;
using flashcore::cuda::sm90::ForwardSplit;
using flashcore::cuda::sm90::forward_num_splits;
using flashcore::cuda::sm90::plan_forward_split;

AttentionParams call(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q, int64_t heads_kv,
                     int64_t head_dim) {
  AttentionParams p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.softmax_scale = 0.125f;
  return p;
}

TEST(ForwardSplitRule, FillsOneWaveOfIdleSms) {
  EXPECT_EQ(forward_num_splits(8, 512, 132), 16);  // 8 tiles: 16 splits, 128 items
  EXPECT_EQ(forward_num_splits(40, 512, 132), 3);  // 120 items
  EXPECT_EQ(forward_num_splits(66, 512, 132), 2);
  EXPECT_EQ(forward_num_splits(67, 512, 132), 1);  // two splits would need a second wave
  EXPECT_EQ(forward_num_splits(8, 20, 132), 5);    // at least 4 key blocks a split
  EXPECT_EQ(forward_num_splits(8, 7, 132), 1);
  EXPECT_EQ(forward_num_splits(1, 100000, 132), 64);  // at most kMaxForwardSplits
  EXPECT_EQ(forward_num_splits(0, 512, 132), 1);
}

TEST(ForwardSplitRule, PlansTheGpuTestsShapes) {
  for (int sms : {132, 32}) {
    // 16 tokens of GQA 32 / 8 against 4096 keys: packed, 8 tiles.
    ForwardSplit s = plan_forward_split(call(1, 16, 4096, 32, 8, 128), 128, sms);
    EXPECT_TRUE(s.packed);
    EXPECT_EQ(s.tiles, 8);
    EXPECT_GT(s.splits, 1) << sms;
    EXPECT_EQ(s.bytes, s.o_bytes + size_t(s.splits) * 16 * 32 * 4);
    EXPECT_EQ(s.o_bytes, size_t(s.splits) * 16 * 32 * 128 * 4);
    // MHA d64, 2 x 8 heads of 5 tokens against 3000 keys: 16 tiles.
    s = plan_forward_split(call(2, 5, 3000, 8, 8, 64), 64, sms);
    EXPECT_FALSE(s.packed);
    EXPECT_GT(s.splits, 1) << sms;
    // d256 (64-key blocks), GQA 4 / 2.
    EXPECT_GT(plan_forward_split(call(1, 33, 2000, 4, 2, 256), 256, sms).splits, 1) << sms;
  }
}

TEST(ForwardSplitRule, CallsItDoesNotSplit) {
  EXPECT_EQ(plan_forward_split(call(4, 4096, 4096, 16, 16, 128), 128, 132).splits, 1);  // many tiles
  EXPECT_EQ(plan_forward_split(call(1, 16, 300, 32, 8, 128), 128, 132).splits, 1);     // 3 key blocks
  EXPECT_EQ(plan_forward_split(call(1, 16, 4096, 32, 8, 128), 128, 0).splits, 1);  // no SM count
  // A window bounds each tile's keys: 16 tokens + 100 keys left of them are two key blocks.
  AttentionParams window = call(1, 16, 4096, 32, 8, 128);
  window.window_left = 100;
  window.window_right = 0;
  EXPECT_EQ(plan_forward_split(window, 128, 132).splits, 1);
  window.window_left = 4000;  // a wide one still splits
  EXPECT_GT(plan_forward_split(window, 128, 132).splits, 1);
}

TEST(ForwardSplitRule, TakesTheCallersCount) {
  AttentionParams p = call(1, 16, 4096, 32, 8, 128);  // the rule: 16 splits on 132 SMs
  p.num_splits = 1;
  EXPECT_EQ(plan_forward_split(p, 128, 132).splits, 1);
  EXPECT_EQ(plan_forward_split(p, 128, 132).bytes, 0u);
  p.num_splits = 3;
  ForwardSplit s = plan_forward_split(p, 128, 132);
  EXPECT_EQ(s.splits, 3);
  EXPECT_EQ(s.bytes, s.o_bytes + size_t(3) * 16 * 32 * 4);
  p.num_splits = 1000;  // at most kMaxForwardSplits, and one per key block (32 here)
  EXPECT_EQ(plan_forward_split(p, 128, 132).splits, 32);
  AttentionParams many = call(4, 4096, 4096, 16, 16, 128);  // the rule leaves it whole
  many.num_splits = 2;
  EXPECT_EQ(plan_forward_split(many, 128, 132).splits, 2);
  // A forced count keeps the partials within 1 GiB: 8 x 4096 tokens x 32 heads x (128 + 1) floats
  // are 541 MB a split, so 8 asked for become 1.
  AttentionParams huge = call(8, 4096, 4096, 32, 32, 128);
  huge.num_splits = 8;
  EXPECT_EQ(plan_forward_split(huge, 128, 132).splits, 1);
  huge.batch = 2;  // 135 MB a split: 7 fit
  EXPECT_EQ(plan_forward_split(huge, 128, 132).splits, 7);
  EXPECT_LE(plan_forward_split(huge, 128, 132).bytes, size_t(1) << 30);
}

TEST(ForwardSplitRule, ScoreTransformsSplitToo) {
  AttentionParams softcap = call(1, 16, 4096, 32, 8, 128);
  softcap.softcap = 30.f;  // the score-transform split kernels, packed as the plain call
  ForwardSplit s = plan_forward_split(softcap, 128, 132);
  EXPECT_TRUE(s.packed);
  EXPECT_EQ(s.splits, 8);  // 8 tiles, 32 key blocks: at least 4 a split
  AttentionParams alibi = call(1, 16, 4096, 32, 8, 128);
  float slopes[32] = {};
  alibi.alibi_slopes = slopes;  // slopes differ by query head: unpacked, 32 tiles
  s = plan_forward_split(alibi, 128, 132);
  EXPECT_FALSE(s.packed);
  EXPECT_EQ(s.tiles, 32);
  EXPECT_EQ(s.splits, 4);
  AttentionParams negative = call(1, 16, 4096, 32, 8, 128);
  negative.softmax_scale = -0.125f;
  EXPECT_GT(plan_forward_split(negative, 128, 132).splits, 1);
}

}  // namespace
