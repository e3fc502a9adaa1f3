// The header-only C++ API: calls that work (the same bits as the C ABI called directly), and
// errors surfacing as flashcore::Error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "flashcore/flashcore.hpp"

TEST(CppApi, ForwardBackwardAndErrors) {
  std::vector<float> q(2 * 16 * 4 * 32), k(2 * 24 * 2 * 32), v(k.size()), out(q.size(), NAN), lse(2 * 4 * 16, NAN);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * i);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.11f * i), v[i] = std::sin(0.05f * i + 1);
  auto tq = flashcore::make_tensor(q.data(), FC_DTYPE_F32, {2, 16, 4, 32});
  auto tk = flashcore::make_tensor(k.data(), FC_DTYPE_F32, {2, 24, 2, 32});
  auto tv = flashcore::make_tensor(v.data(), FC_DTYPE_F32, {2, 24, 2, 32});
  auto to = flashcore::make_tensor(out.data(), FC_DTYPE_F32, {2, 16, 4, 32});
  auto tl = flashcore::make_tensor(lse.data(), FC_DTYPE_F32, {2, 4, 16});
  flashcore::Options opt;
  opt.causal = true;
  EXPECT_EQ(flashcore::forward_workspace(tq, tk, tv, opt), 0u);
  flashcore::forward(tq, tk, tv, to, &tl, opt);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  std::vector<float> dout(q.size(), 0.5f), dq(q.size()), dk(k.size()), dv(v.size());
  auto tdo = flashcore::make_tensor(dout.data(), FC_DTYPE_F32, {2, 16, 4, 32});
  auto tdq = flashcore::make_tensor(dq.data(), FC_DTYPE_F32, {2, 16, 4, 32});
  auto tdk = flashcore::make_tensor(dk.data(), FC_DTYPE_F32, {2, 24, 2, 32});
  auto tdv = flashcore::make_tensor(dv.data(), FC_DTYPE_F32, {2, 24, 2, 32});
  flashcore::backward(tdo, tq, tk, tv, to, tl, tdq, tdk, tdv, opt);
  opt.softcap = -1;
  try {
    flashcore::forward(tq, tk, tv, to, &tl, opt);
    FAIL() << "expected flashcore::Error";
  } catch (const flashcore::Error& e) {
    EXPECT_EQ(e.code(), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("softcap"), std::string::npos);
  }
}

// Fields of a newer C ABI are appended, so a caller built against an older header passes a prefix.
static_assert(offsetof(fc_attention_options, block_table) > offsetof(fc_attention_options, reserved), "ABI 2");
static_assert(offsetof(fc_attention_options, alibi_slopes) > offsetof(fc_attention_options, block_table), "ABI 3");
static_assert(offsetof(fc_attention_options, sm_margin) > offsetof(fc_attention_options, alibi_slopes), "ABI 4");

TEST(CppApi, OptionsReachTheCStruct) {
  flashcore::Options opt;
  fc_attention_options c = opt.to_c();
  EXPECT_EQ(c.check_cu_seqlens, 0);
  EXPECT_EQ(c.error_flag, nullptr);
  EXPECT_EQ(c.has_window, 0);
  EXPECT_EQ(c.block_table, nullptr);
  for (int32_t r : c.reserved) EXPECT_EQ(r, 0);  // zero: future fields keep their defaults
  int32_t flag = 0;
  opt.check_cu_seqlens = true;
  opt.error_flag = &flag;
  opt.window_left = 8;
  opt.deterministic = true;
  opt.num_threads = 3;
  opt.sm_margin = 5;
  const flashcore::Tensor table{};
  opt.block_table = &table;
  c = opt.to_c();
  EXPECT_EQ(c.sm_margin, 5);
  EXPECT_EQ(c.block_table, &table);
  EXPECT_EQ(c.check_cu_seqlens, 1);
  EXPECT_EQ(c.error_flag, &flag);
  EXPECT_EQ(c.has_window, 1);
  EXPECT_EQ(c.window_left, 8);
  EXPECT_EQ(c.deterministic, 1);
  EXPECT_EQ(c.num_threads, 3);
}

TEST(CppApi, KvCacheAndMergeMatchTheCAbi) {
  // Two sequences, GQA 4 / 2, d 16: one new token appended and rotated (NeoX pairs), left padding.
  constexpr int64_t kBatch = 2, kSlots = 12, kHq = 4, kHkv = 2, kD = 16, kHalf = 4;
  std::vector<float> q(kBatch * kHq * kD), kc(kBatch * kSlots * kHkv * kD), vc(kc.size()), kn(kBatch * kHkv * kD),
      vn(kn.size()), cosv(kSlots * kHalf), sinv(cosv.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3f * i);
  for (size_t i = 0; i < kc.size(); ++i) kc[i] = std::cos(0.07f * i), vc[i] = std::sin(0.13f * i);
  for (size_t i = 0; i < kn.size(); ++i) kn[i] = std::cos(0.5f * i), vn[i] = std::sin(0.9f * i);
  for (size_t i = 0; i < cosv.size(); ++i) cosv[i] = std::cos(0.2f * i), sinv[i] = std::sin(0.2f * i);
  std::vector<int32_t> lens = {5, 9}, pad = {2, 0};
  std::vector<float> kc2 = kc, vc2 = vc, out(q.size(), NAN), out2(q.size(), NAN), lse(kBatch * kHq, NAN), lse2 = lse;
  auto tq = flashcore::make_tensor(q.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  auto tkn = flashcore::make_tensor(kn.data(), FC_DTYPE_F32, {kBatch, 1, kHkv, kD});
  auto tvn = flashcore::make_tensor(vn.data(), FC_DTYPE_F32, {kBatch, 1, kHkv, kD});
  auto tlens = flashcore::make_tensor(lens.data(), FC_DTYPE_I32, {kBatch});
  auto tpad = flashcore::make_tensor(pad.data(), FC_DTYPE_I32, {kBatch});
  auto tcos = flashcore::make_tensor(cosv.data(), FC_DTYPE_F32, {kSlots, kHalf});
  auto tsin = flashcore::make_tensor(sinv.data(), FC_DTYPE_F32, {kSlots, kHalf});
  auto call = [&](std::vector<float>& k_cache, std::vector<float>& v_cache, std::vector<float>& o, std::vector<float>& l,
                  fc_tensor* tkc, fc_tensor* tvc, fc_tensor* to, fc_tensor* tl) {
    *tkc = flashcore::make_tensor(k_cache.data(), FC_DTYPE_F32, {kBatch, kSlots, kHkv, kD});
    *tvc = flashcore::make_tensor(v_cache.data(), FC_DTYPE_F32, {kBatch, kSlots, kHkv, kD});
    *to = flashcore::make_tensor(o.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
    *tl = flashcore::make_tensor(l.data(), FC_DTYPE_F32, {kBatch, kHq, 1});
  };
  fc_tensor tkc, tvc, to, tl, tkc2, tvc2, to2, tl2;
  call(kc, vc, out, lse, &tkc, &tvc, &to, &tl);
  call(kc2, vc2, out2, lse2, &tkc2, &tvc2, &to2, &tl2);
  flashcore::KvCacheArgs args;
  args.q = &tq;
  args.k_cache = &tkc;
  args.v_cache = &tvc;
  args.cache_seqlens = &tlens;
  args.k_new = &tkn;
  args.v_new = &tvn;
  args.out = &to;
  args.lse = &tl;
  args.rotary_cos = &tcos;
  args.rotary_sin = &tsin;
  args.rotary_interleaved = false;
  args.cache_leftpad = &tpad;
  flashcore::Options opt;
  opt.causal = true;
  EXPECT_EQ(flashcore::kvcache_workspace(args, opt), 0u);
  flashcore::kvcache(args, opt);
  fc_kvcache_args c{};
  c.q = &tq;
  c.k_cache = &tkc2;
  c.v_cache = &tvc2;
  c.cache_seqlens = &tlens;
  c.k_new = &tkn;
  c.v_new = &tvn;
  c.out = &to2;
  c.lse = &tl2;
  c.rotary_cos = &tcos;
  c.rotary_sin = &tsin;
  c.rotary_interleaved = 0;
  c.cache_leftpad = &tpad;
  const fc_attention_options o = opt.to_c();
  ASSERT_EQ(fc_attention_kvcache(&c, &o, nullptr, 0), FC_OK) << fc_last_error();
  EXPECT_EQ(out, out2);
  EXPECT_EQ(lse, lse2);
  EXPECT_EQ(kc, kc2);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  pad[1] = 10;  // past cache_seqlens[1]
  try {
    flashcore::kvcache(args, opt);
    FAIL() << "expected flashcore::Error";
  } catch (const flashcore::Error& e) {
    EXPECT_EQ(e.code(), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(e.what()).rfind("cache_leftpad:", 0), 0u) << e.what();
  }

  // merge_partials: two parts, one of them empty (lse -inf), give the other part back.
  std::vector<float> parts(2 * kHq * kD), part_lse = {0.5f, 1.f, -1.f, 2.f, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  for (size_t i = 0; i < parts.size(); ++i) parts[i] = std::cos(0.4f * i);
  std::vector<float> merged(kHq * kD, NAN), merged_lse(kHq, NAN);
  auto tp = flashcore::make_tensor(parts.data(), FC_DTYPE_F32, {2, 1, kHq, kD});
  auto tpl = flashcore::make_tensor(part_lse.data(), FC_DTYPE_F32, {2, 1, kHq, 1});
  auto tm = flashcore::make_tensor(merged.data(), FC_DTYPE_F32, {1, 1, kHq, kD});
  auto tml = flashcore::make_tensor(merged_lse.data(), FC_DTYPE_F32, {1, kHq, 1});
  flashcore::merge_partials(tp, tpl, tm, &tml);
  for (int64_t i = 0; i < kHq * kD; ++i) EXPECT_FLOAT_EQ(merged[i], parts[i]);
  for (int64_t h = 0; h < kHq; ++h) EXPECT_FLOAT_EQ(merged_lse[h], part_lse[h]);
}
