// The header-only C++ API: a call that works, and an error surfacing as flashcore::Error.
#include <gtest/gtest.h>

#include <cmath>
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

TEST(CppApi, OptionsReachTheCStruct) {
  flashcore::Options opt;
  fc_attention_options c = opt.to_c();
  EXPECT_EQ(c.check_cu_seqlens, 0);
  EXPECT_EQ(c.error_flag, nullptr);
  EXPECT_EQ(c.has_window, 0);
  for (int32_t r : c.reserved) EXPECT_EQ(r, 0);  // zero: future fields keep their defaults
  int32_t flag = 0;
  opt.check_cu_seqlens = true;
  opt.error_flag = &flag;
  opt.window_left = 8;
  opt.deterministic = true;
  opt.num_threads = 3;
  c = opt.to_c();
  EXPECT_EQ(c.check_cu_seqlens, 1);
  EXPECT_EQ(c.error_flag, &flag);
  EXPECT_EQ(c.has_window, 1);
  EXPECT_EQ(c.window_left, 8);
  EXPECT_EQ(c.deterministic, 1);
  EXPECT_EQ(c.num_threads, 3);
}
