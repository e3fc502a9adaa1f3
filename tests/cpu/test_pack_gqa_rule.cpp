// The Hopper forward's pack-GQA rule (src/cuda/sm90/pack_gqa.hpp), a host-only function: which
// calls pack a KV head's group of query heads into the forward's tiles.
#include <gtest/gtest.h>

#include "cuda/sm90/pack_gqa.hpp"

namespace {
using flashcore::AttentionParams;
using flashcore::cuda::sm90::log2_of_power_of_two;
using flashcore::cuda::sm90::pack_gqa_fits;
using flashcore::cuda::sm90::pack_gqa_pays;

AttentionParams call(int64_t seqlen_q, int64_t heads_q, int64_t heads_kv) {
  AttentionParams p;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = 4096;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = 128;
  return p;
}

TEST(PackGqaRule, GroupsThatDivideAConsumersRows) {
  EXPECT_FALSE(pack_gqa_fits(call(16, 8, 8)));   // MHA: nothing to pack
  EXPECT_TRUE(pack_gqa_fits(call(16, 8, 4)));    // 2
  EXPECT_TRUE(pack_gqa_fits(call(16, 32, 8)));   // 4
  EXPECT_TRUE(pack_gqa_fits(call(16, 64, 1)));   // 64: MQA with 64 heads
  EXPECT_FALSE(pack_gqa_fits(call(16, 128, 1)));  // 128 does not divide 64 rows
  EXPECT_FALSE(pack_gqa_fits(call(16, 12, 4)));  // 3
  EXPECT_FALSE(pack_gqa_fits(call(16, 24, 4)));  // 6
  AttentionParams alibi = call(16, 32, 8);
  float slopes[32] = {};
  alibi.alibi_slopes = slopes;
  EXPECT_FALSE(pack_gqa_fits(alibi));  // a slope per query head
}

TEST(PackGqaRule, FewTokensPackLongSequencesDoNot) {
  EXPECT_TRUE(pack_gqa_pays(call(1, 32, 8), 128, 128));    // 1 of 128 rows against 4
  EXPECT_TRUE(pack_gqa_pays(call(16, 32, 8), 128, 128));   // 16 / 128 against 64 / 128
  EXPECT_TRUE(pack_gqa_pays(call(64, 16, 2), 128, 128));   // 64 / 128 against 512 / 512
  EXPECT_FALSE(pack_gqa_pays(call(100, 32, 8), 128, 128)); // 100 / 128 either way
  EXPECT_FALSE(pack_gqa_pays(call(512, 32, 8), 128, 128)); // full tiles either way
  EXPECT_FALSE(pack_gqa_pays(call(4096, 32, 8), 192, 128));
  EXPECT_TRUE(pack_gqa_pays(call(128, 32, 8), 192, 128));  // 128 / 192 against 512 / 512
  EXPECT_FALSE(pack_gqa_pays(call(16, 32, 32), 128, 128)); // MHA
  EXPECT_FALSE(pack_gqa_pays(call(0, 32, 8), 128, 128));
}

TEST(PackGqaRule, Log2OfPowersOfTwo) {
  EXPECT_EQ(log2_of_power_of_two(1), 0);
  EXPECT_EQ(log2_of_power_of_two(2), 1);
  EXPECT_EQ(log2_of_power_of_two(8), 3);
  EXPECT_EQ(log2_of_power_of_two(64), 6);
}

}  // namespace
