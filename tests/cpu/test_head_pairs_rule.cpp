// The decode kernel's head pairs (src/cuda/decode/head_pairs.hpp), host-only: which calls read
// their d64 cache two KV heads at a time, and the view the 128-wide kernel then gets.
#include <gtest/gtest.h>

#include "cuda/decode/head_pairs.hpp"

namespace {
using flashcore::KvCacheParams;
using flashcore::cuda::decode::head_pair_view;
using flashcore::cuda::decode::head_pairs_apply;

constexpr int64_t kCtaRows = 16;

/** A packed (batch, seqlen, heads_kv, head_dim) cache and one query token. */
KvCacheParams call(int64_t heads_q, int64_t heads_kv, int64_t head_dim = 64, int64_t seqlen_q = 1) {
  KvCacheParams p;
  p.batch = 4;
  p.seqlen_q = seqlen_q;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.page_size = 4096;
  for (auto* t : {&p.k_cache, &p.v_cache}) {
    t->head_stride = head_dim;
    t->row_stride = heads_kv * head_dim;
    t->batch_stride = p.page_size * t->row_stride;
  }
  return p;
}

TEST(HeadPairsRule, PairsEvenHeadsOfDim64WhoseRowsFitOneCta) {
  EXPECT_TRUE(head_pairs_apply(call(16, 16), true, kCtaRows));  // MHA: 2 rows a pair
  EXPECT_TRUE(head_pairs_apply(call(32, 8), true, kCtaRows));   // GQA 4: 8 rows
  EXPECT_TRUE(head_pairs_apply(call(64, 8), true, kCtaRows));   // GQA 8: 16 rows
  EXPECT_TRUE(head_pairs_apply(call(32, 8, 64, 2), true, kCtaRows));
  EXPECT_TRUE(head_pairs_apply(call(16, 16, 64, 8), true, kCtaRows));
}

TEST(HeadPairsRule, KeepsSingleHeadsElsewhere) {
  EXPECT_FALSE(head_pairs_apply(call(32, 8), false, kCtaRows)) << "no 128-wide kernel compiled";
  EXPECT_FALSE(head_pairs_apply(call(32, 8, 128), true, kCtaRows)) << "d128 reads full tiles already";
  EXPECT_FALSE(head_pairs_apply(call(24, 8, 48), true, kCtaRows)) << "a padded head dim";
  EXPECT_FALSE(head_pairs_apply(call(12, 3), true, kCtaRows)) << "an odd number of KV heads";
  EXPECT_FALSE(head_pairs_apply(call(32, 1), true, kCtaRows)) << "MQA";
  EXPECT_FALSE(head_pairs_apply(call(32, 8, 64, 3), true, kCtaRows)) << "24 rows a pair: two CTAs would read it twice";
  EXPECT_FALSE(head_pairs_apply(call(128, 8), true, kCtaRows)) << "GQA 16: 32 rows a pair";
  KvCacheParams heads_outer = call(16, 16);  // (batch, heads, seqlen, d) storage
  heads_outer.k_cache.head_stride = heads_outer.v_cache.head_stride = 4096 * 64;
  heads_outer.k_cache.row_stride = heads_outer.v_cache.row_stride = 64;
  EXPECT_FALSE(head_pairs_apply(heads_outer, true, kCtaRows)) << "a pair's heads are not one row";
  KvCacheParams v_apart = call(16, 16);
  v_apart.v_cache.head_stride = 128;
  EXPECT_FALSE(head_pairs_apply(v_apart, true, kCtaRows)) << "V's heads padded apart";
  EXPECT_FALSE(head_pairs_apply(head_pair_view(call(32, 8)), true, kCtaRows)) << "a view is not paired again";
}

TEST(HeadPairsRule, ViewReadsPairsAsWideHeads) {
  const KvCacheParams p = call(32, 8);
  const KvCacheParams v = head_pair_view(p);
  EXPECT_TRUE(v.heads_paired);
  EXPECT_EQ(v.heads_kv, 4);
  EXPECT_EQ(v.head_dim, 128);
  EXPECT_EQ(v.group_size(), 8);  // both heads' query rows in one CTA
  EXPECT_EQ(v.qo_head_dim(), 64);
  EXPECT_EQ(v.k_cache.head_stride, 128);
  EXPECT_EQ(v.v_cache.head_stride, 128);
  EXPECT_EQ(v.k_cache.row_stride, p.k_cache.row_stride);
  EXPECT_EQ(v.k_cache.batch_stride, p.k_cache.batch_stride);
  EXPECT_EQ(v.heads_q, p.heads_q);
  EXPECT_EQ(p.qo_head_dim(), 64);
}

}  // namespace
