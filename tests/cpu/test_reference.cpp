// The oracle checked against things that need no oracle: closed-form outputs and finite
// differences of its own forward (which validates the reference backward every other test uses).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "api/backends.hpp"
#include "api/validate.hpp"
#include "common/dropout.hpp"

namespace flashcore {
namespace {

/** fp32 dense tensors of one small problem, owned by the fixture. */
struct Tiny {
  int64_t b = 1, sq, sk, hq, hkv, d;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  fc_attention_options opt{};

  Tiny(int64_t sq_, int64_t sk_, int64_t hq_, int64_t hkv_, int64_t d_, uint64_t seed)
      : sq(sq_), sk(sk_), hq(hq_), hkv(hkv_), d(d_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.f, 1.f);
    auto fill = [&](std::vector<float>& x, int64_t count) {
      x.resize(count);
      for (auto& e : x) e = n(rng);
    };
    fill(q, b * sq * hq * d);
    fill(k, b * sk * hkv * d);
    fill(v, b * sk * hkv * d);
    fill(dout, b * sq * hq * d);
    out.assign(q.size(), NAN);
    dq.assign(q.size(), NAN);
    dk.assign(k.size(), NAN);
    dv.assign(v.size(), NAN);
    lse.assign(b * hq * sq, NAN);
  }
  static fc_tensor t4(std::vector<float>& x, int64_t a0, int64_t a1, int64_t a2, int64_t a3) {
    fc_tensor t{};
    t.data = x.data();
    t.dtype = FC_DTYPE_F32;
    t.ndim = 4;
    const int64_t sh[4] = {a0, a1, a2, a3};
    int64_t st = 1;
    for (int i = 3; i >= 0; --i) {
      t.shape[i] = sh[i];
      t.strides[i] = st;
      st *= sh[i];
    }
    return t;
  }
  fc_tensor Q() { return t4(q, b, sq, hq, d); }
  fc_tensor K() { return t4(k, b, sk, hkv, d); }
  fc_tensor V() { return t4(v, b, sk, hkv, d); }
  fc_tensor O() { return t4(out, b, sq, hq, d); }
  fc_tensor dO() { return t4(dout, b, sq, hq, d); }
  fc_tensor L() {
    fc_tensor t = t4(lse, 1, b, hq, sq);
    t.ndim = 3;
    for (int i = 0; i < 3; ++i) {
      t.shape[i] = t.shape[i + 1];
      t.strides[i] = t.strides[i + 1];
    }
    return t;
  }

  AttentionParams params() {
    fc_tensor tq = Q(), tk = K(), tv = V(), to = O(), tl = L();
    AttentionParams p;
    Status s = validate_forward({&tq, &tk, &tv, &to, &tl, &opt}, false, &p);
    EXPECT_TRUE(s.is_ok()) << s.message;
    return p;
  }

  /** Loss L = sum(dout * out) computed with the fp64 row function. */
  double loss() {
    AttentionParams p = params();
    std::vector<double> row(d);
    double l, total = 0;
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        cpu::reference_row(p, 0, h, i, row.data(), &l);
        for (int64_t e = 0; e < d; ++e) total += row[e] * dout[(i * hq + h) * d + e];
      }
    return total;
  }

  void backward(cpu::ReferenceMode mode = cpu::ReferenceMode::exact) {
    fc_tensor tq = Q(), tk = K(), tv = V(), to = O(), tl = L(), tdo = dO();
    fc_tensor tdq = t4(dq, b, sq, hq, d), tdk = t4(dk, b, sk, hkv, d), tdv = t4(dv, b, sk, hkv, d);
    BackwardParams p;
    Status s = validate_backward({&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt}, false, &p);
    ASSERT_TRUE(s.is_ok()) << s.message;
    ASSERT_TRUE(cpu::reference_forward(p).is_ok());
    ASSERT_TRUE(cpu::reference_backward(p, mode).is_ok());
  }
};

void check_finite_differences(Tiny& t) {
  t.backward();
  const float eps = 1e-2f;
  auto check = [&](std::vector<float>& x, const std::vector<float>& grad, const char* name) {
    for (size_t i = 0; i < x.size(); ++i) {
      const float orig = x[i];
      x[i] = orig + eps;
      const double up = t.loss();
      const float hi = x[i];
      x[i] = orig - eps;
      const double down = t.loss();
      const float lo = x[i];
      x[i] = orig;
      const double fd = (up - down) / (double(hi) - double(lo));
      EXPECT_NEAR(grad[i], fd, 2e-3 * (1 + std::fabs(fd))) << name << "[" << i << "]";
    }
  };
  check(t.q, t.dq, "dq");
  check(t.k, t.dk, "dk");
  check(t.v, t.dv, "dv");
}

TEST(Reference, FiniteDifferencesPlain) {
  Tiny t(3, 4, 2, 1, 5, 11);
  check_finite_differences(t);
}

TEST(Reference, FiniteDifferencesCausalSoftcapWindow) {
  Tiny t(5, 3, 2, 2, 4, 12);
  t.opt.causal = 1;
  t.opt.softcap = 2.0;
  t.opt.softmax_scale = 0.7;
  check_finite_differences(t);
  Tiny w(4, 6, 3, 1, 3, 13);
  w.opt.has_window = 1;
  w.opt.window_left = 1;
  w.opt.window_right = 1;
  check_finite_differences(w);
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float e : x) m = std::max(m, double(std::fabs(e)));
  return m;
}

// The score-error bound (what the tests add to a kernel's gradient bound) is negligible at unit
// inputs and becomes a real share of the gradient when scores reach ~1e4, where an fp32 score is
// no finer than an fp16 value.
TEST(Reference, ScoreErrorBoundScalesWithScoreMagnitude) {
  for (float magnitude : {1.f, 1500.f}) {
    Tiny t(9, 13, 2, 1, 64, 21);
    for (auto& e : t.q) e *= magnitude;
    t.backward();
    const double dq = max_abs(t.dq), dk = max_abs(t.dk), dv = max_abs(t.dv);
    t.backward(cpu::ReferenceMode::score_error_bound);
    for (auto* g : {&t.dq, &t.dk, &t.dv})
      for (float e : *g) ASSERT_TRUE(e >= 0.f && std::isfinite(e));
    const double rq = max_abs(t.dq) / dq, rk = max_abs(t.dk) / dk, rv = max_abs(t.dv) / dv;
    if (magnitude == 1.f) {
      EXPECT_LT(std::max({rq, rk, rv}), 1e-5) << "dq " << rq << " dk " << rk << " dv " << rv;
    } else {
      EXPECT_GT(std::max({rq, rk, rv}), 1e-4) << "dq " << rq << " dk " << rk << " dv " << rv;
      EXPECT_LT(std::max({rq, rk, rv}), 0.5) << "dq " << rq << " dk " << rk << " dv " << rv;
    }
  }
}

TEST(Reference, ClosedForms) {
  // q = 0: every allowed key gets the same weight, so out is the mean of v and lse = log(count).
  Tiny t(4, 6, 1, 1, 3, 21);
  std::fill(t.q.begin(), t.q.end(), 0.f);
  t.opt.causal = 1;  // bottom-right: row i sees keys 0 .. i + 2
  AttentionParams p = t.params();
  ASSERT_TRUE(cpu::reference_forward(p).is_ok());
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t n = i + 3;
    EXPECT_NEAR(t.lse[i], std::log(double(n)), 1e-6);
    for (int64_t e = 0; e < 3; ++e) {
      double mean = 0;
      for (int64_t j = 0; j < n; ++j) mean += t.v[j * 3 + e];
      EXPECT_NEAR(t.out[i * 3 + e], mean / n, 1e-6);
    }
  }
  // One key: out = v, lse = the score.
  Tiny one(2, 1, 1, 1, 4, 22);
  AttentionParams p1 = one.params();
  ASSERT_TRUE(cpu::reference_forward(p1).is_ok());
  for (int64_t i = 0; i < 2; ++i) {
    double dot = 0;
    for (int e = 0; e < 4; ++e) dot += double(one.q[i * 4 + e]) * one.k[e];
    EXPECT_NEAR(one.lse[i], dot / 2.0, 1e-5);
    for (int e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(one.out[i * 4 + e], one.v[e]);
  }
  // Rows without keys (sq > sk, causal): out 0, lse -inf.
  Tiny empty(5, 2, 1, 1, 2, 23);
  empty.opt.causal = 1;
  AttentionParams pe = empty.params();
  ASSERT_TRUE(cpu::reference_forward(pe).is_ok());
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isinf(empty.lse[i]) && empty.lse[i] < 0);
    EXPECT_EQ(empty.out[i * 2], 0.f);
  }
  EXPECT_FALSE(std::isinf(empty.lse[3]));
}

/** A float32 (n) tensor over `x`. */
fc_tensor vector_tensor(std::vector<float>& x) {
  fc_tensor t{};
  t.data = x.data();
  t.dtype = FC_DTYPE_F32;
  t.ndim = 1;
  t.shape[0] = static_cast<int64_t>(x.size());
  t.strides[0] = 1;
  return t;
}

TEST(Reference, AlibiClosedForm) {
  // q = 0: every score is 0, so key j's weight is exp(-slope * |i + sk - sq - j|) alone.
  for (bool causal : {false, true}) {
    Tiny t(3, 7, 2, 1, 2, 24);
    std::fill(t.q.begin(), t.q.end(), 0.f);
    std::vector<float> slopes = {0.5f, 0.125f};
    fc_tensor ts = vector_tensor(slopes);
    t.opt.alibi_slopes = &ts;
    t.opt.causal = causal;
    AttentionParams p = t.params();
    ASSERT_TRUE(cpu::reference_forward(p).is_ok());
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 3; ++i) {
        const int64_t diagonal = i + 7 - 3;
        double total = 0, out[2] = {0, 0};
        for (int64_t j = 0; j <= (causal ? diagonal : 6); ++j) {
          const double w = std::exp(-double(slopes[h]) * double(std::abs(diagonal - j)));
          total += w;
          for (int e = 0; e < 2; ++e) out[e] += w * t.v[j * 2 + e];
        }
        EXPECT_NEAR(t.lse[h * 3 + i], std::log(total), 1e-6) << "h " << h << " i " << i;
        for (int e = 0; e < 2; ++e) EXPECT_NEAR(t.out[(i * 2 + h) * 2 + e], out[e] / total, 1e-6);
      }
  }
}

TEST(Reference, FiniteDifferencesAlibi) {
  // The bias is a constant of the scores: gradients as without it, through other probabilities.
  Tiny t(5, 6, 2, 1, 4, 25);
  std::vector<float> slopes = {0.9f, 0.3f};
  fc_tensor ts = vector_tensor(slopes);
  t.opt.alibi_slopes = &ts;
  t.opt.softcap = 3.0;
  check_finite_differences(t);
}

TEST(Reference, DropoutClosedForm) {
  // q = 0: every allowed key weighs 1 / (allowed keys); dropout keeps the entries the mask keeps,
  // times 1 / (1 - p), and leaves lse = log(allowed keys).
  for (bool causal : {false, true}) {
    Tiny t(3, 70, 2, 1, 2, 31);  // 70 keys: two 64-key blocks
    std::fill(t.q.begin(), t.q.end(), 0.f);
    t.opt.causal = causal;
    t.opt.dropout_p = 0.3;
    t.opt.dropout_seed = 0xabcdef0123ull;
    t.opt.dropout_offset = 5;
    AttentionParams p = t.params();
    ASSERT_TRUE(p.dropout.enabled());
    ASSERT_TRUE(cpu::reference_forward(p).is_ok());
    const DropoutParams d = make_dropout(0.3, 0xabcdef0123ull, 5);
    int64_t dropped = 0;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 3; ++i) {
        const int64_t allowed = causal ? i + 70 - 3 + 1 : 70;
        double out[2] = {0, 0};
        for (int64_t j = 0; j < allowed; ++j) {
          if (!dropout_keeps(d, h, i, j)) {  // batch 0: problem bh = h
            ++dropped;
            continue;
          }
          for (int e = 0; e < 2; ++e) out[e] += t.v[j * 2 + e] / 0.7 / static_cast<double>(allowed);
        }
        EXPECT_NEAR(t.lse[h * 3 + i], std::log(static_cast<double>(allowed)), 1e-6) << "h " << h << " i " << i;
        for (int e = 0; e < 2; ++e) EXPECT_NEAR(t.out[(i * 2 + h) * 2 + e], out[e], 1e-5) << "h " << h << " i " << i;
      }
    EXPECT_GT(dropped, 0);  // the check above saw dropped entries
  }
}

TEST(Reference, FiniteDifferencesDropout) {
  // The mask is a fixed function of the seed: the loss is smooth in q, k, v and the backward's
  // Z-weighted dV and dP must match its finite differences (GQA, causal, softcap).
  Tiny t(5, 6, 2, 1, 4, 26);
  t.opt.dropout_p = 0.4;
  t.opt.dropout_seed = 77;
  t.opt.causal = 1;
  t.opt.softcap = 3.0;
  check_finite_differences(t);
  Tiny u(4, 9, 2, 2, 3, 27);
  u.opt.dropout_p = 0.6;
  u.opt.dropout_seed = 78;
  u.opt.dropout_offset = 1ull << 40;
  check_finite_differences(u);
}

TEST(Reference, DropoutChangesTheOutputBySeedAndOffset) {
  auto forward = [](double p, uint64_t seed, uint64_t offset) {
    Tiny t(8, 100, 2, 1, 8, 32);
    t.opt.dropout_p = p;
    t.opt.dropout_seed = seed;
    t.opt.dropout_offset = offset;
    AttentionParams params = t.params();
    EXPECT_TRUE(cpu::reference_forward(params).is_ok());
    return t.out;
  };
  auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
    return m;
  };
  const std::vector<float> plain = forward(0, 1, 0), base = forward(0.5, 1, 0);
  EXPECT_EQ(max_diff(forward(0, 2, 3), plain), 0.0);  // p = 0: the seed is ignored
  EXPECT_EQ(max_diff(forward(0.5, 1, 0), base), 0.0);  // the same mask again
  EXPECT_GT(max_diff(base, plain), 0.05);
  EXPECT_GT(max_diff(forward(0.5, 2, 0), base), 0.05);
  EXPECT_GT(max_diff(forward(0.5, 1, 1), base), 0.05);
}

}  // namespace
}  // namespace flashcore
