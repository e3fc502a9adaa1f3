// cpu_flash's Simd layer (cpu_common.hpp) lane by lane against scalar rules: the vector exp and
// tanh against std::exp / std::tanh, round_nearest against nearbyint, times_pow2 against ldexp,
// the compares, select, max / min and the lane sum. Built with -march=native where the library is
// (tests/CMakeLists.txt), so it checks the ISA the kernels run: AVX-512 or AVX2 in a native build,
// the portable vector-extension fallback in the sanitizer build (no native flags there).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_common.hpp"

namespace flashcore {
namespace {

using cpu::flash_detail::kSimdWidth;
using cpu::flash_detail::Simd;
using cpu::flash_detail::Vec;

/** f applied to `in` one vector at a time (the inputs padded to whole vectors with 0). */
template <class F>
std::vector<float> per_vector(const std::vector<float>& in, F f) {
  std::vector<float> padded(in);
  padded.resize((in.size() + kSimdWidth - 1) / kSimdWidth * kSimdWidth, 0.f);
  std::vector<float> out(padded.size());
  for (size_t i = 0; i < padded.size(); i += kSimdWidth) Simd::store(out.data() + i, f(Simd::load(padded.data() + i)));
  out.resize(in.size());
  return out;
}

/** Evenly spaced points of [lo, hi] plus random ones. */
std::vector<float> sweep(float lo, float hi, int n, uint32_t seed) {
  std::vector<float> v;
  for (int i = 0; i <= n; ++i) v.push_back(lo + (hi - lo) * static_cast<float>(i) / static_cast<float>(n));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (int i = 0; i < n; ++i) v.push_back(u(rng));
  return v;
}

TEST(CpuSimd, ExpMatchesStdExp) {
  using C = cpu::flash_detail::ExpConstants;
  std::vector<float> x = sweep(C::kMinInput, C::kMaxInput, 20000, 1);
  const std::vector<float> y = per_vector(x, [](Vec v) { return cpu::flash_detail::vexp(v); });
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    worst = std::max(worst, std::fabs(y[i] - want) / want);
  }
  // A few units of 2^-24: range reduction, a degree-6 polynomial, and without FMA rounded products.
  EXPECT_LT(worst, 4 * std::ldexp(1.0, -24)) << Simd::kName;
  std::printf("%s vexp: largest relative error %.2f x 2^-24\n", Simd::kName, worst / std::ldexp(1.0, -24));
  // Below ln(FLT_MIN) and at -inf: exactly 0; above the clamp: the clamp's value, finite.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> edges = {-inf, -1000.f, C::kMinInput - 1.f, 100.f, inf};
  const std::vector<float> e = per_vector(edges, [](Vec v) { return cpu::flash_detail::vexp(v); });
  EXPECT_EQ(e[0], 0.f);
  EXPECT_EQ(e[1], 0.f);
  EXPECT_EQ(e[2], 0.f);
  EXPECT_TRUE(std::isfinite(e[3]) && e[3] > 1e38f) << e[3];
  EXPECT_TRUE(std::isfinite(e[4]) && e[4] > 1e38f) << e[4];
}

TEST(CpuSimd, TanhMatchesStdTanh) {
  std::vector<float> x = sweep(-12.f, 12.f, 20000, 2);
  const std::vector<float> y = per_vector(x, [](Vec v) { return cpu::flash_detail::vtanh(v); });
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::tanh(static_cast<double>(x[i]));
    if (want != 0) worst = std::max(worst, std::fabs(y[i] - want) / std::fabs(want));
  }
  EXPECT_LT(worst, 8 * std::ldexp(1.0, -24)) << Simd::kName;
  std::printf("%s vtanh: largest relative error %.2f x 2^-24\n", Simd::kName, worst / std::ldexp(1.0, -24));
}

TEST(CpuSimd, RoundNearestTiesToEven) {
  std::vector<float> x = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 0.49999997f, 126.5f, -126.5f, 127.f, -127.f, 0.f};
  for (float v : sweep(-200.f, 200.f, 4000, 3)) x.push_back(v);
  const std::vector<float> y = per_vector(x, [](Vec v) { return Simd::round_nearest(v); });
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], std::nearbyint(x[i])) << "round(" << x[i] << ")";
}

TEST(CpuSimd, TimesPow2MatchesLdexp) {
  const std::vector<float> mantissas = sweep(-2.f, 2.f, 50, 4);
  for (int n = -126; n <= 127; ++n) {
    const Vec exponent = Simd::set1(static_cast<float>(n));
    const std::vector<float> y = per_vector(mantissas, [&](Vec v) { return Simd::times_pow2(v, exponent); });
    // 2^n is exact for n in [-126, 127]; the product rounds once, as ldexp's does.
    for (size_t i = 0; i < mantissas.size(); ++i)
      EXPECT_EQ(y[i], static_cast<float>(static_cast<double>(mantissas[i]) * std::ldexp(1.0, n))) << mantissas[i] << " * 2^" << n;
  }
}

TEST(CpuSimd, ComparesSelectMaxMinAndSum) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a = sweep(-3.f, 3.f, 200, 5), b = sweep(-3.f, 3.f, 200, 6);
  a.resize(a.size() / kSimdWidth * kSimdWidth);
  b.resize(a.size());
  for (size_t i = 0; i < a.size(); i += 7) b[i] = a[i];  // equal lanes
  a[3] = nan;                                            // NaN lanes: every compare false
  b[10] = nan;
  for (size_t i = 0; i < a.size(); i += kSimdWidth) {
    const Vec va = Simd::load(a.data() + i), vb = Simd::load(b.data() + i);
    float lt[kSimdWidth], le[kSimdWidth], eq[kSimdWidth], both[kSimdWidth], mx[kSimdWidth], mn[kSimdWidth];
    const Vec ones = Simd::set1(1.f), zeros = Simd::zero();
    Simd::store(lt, Simd::select(Simd::lt(va, vb), ones, zeros));
    Simd::store(le, Simd::select(Simd::le(va, vb), ones, zeros));
    Simd::store(eq, Simd::select(Simd::eq(va, vb), ones, zeros));
    Simd::store(both, Simd::select(Simd::both(Simd::le(va, vb), Simd::le(vb, va)), ones, zeros));
    Simd::store(mx, Simd::max(va, vb));
    Simd::store(mn, Simd::min(va, vb));
    for (int l = 0; l < kSimdWidth; ++l) {
      const float x = a[i + l], y = b[i + l];
      EXPECT_EQ(lt[l], x < y ? 1.f : 0.f) << x << " < " << y;
      EXPECT_EQ(le[l], x <= y ? 1.f : 0.f) << x << " <= " << y;
      EXPECT_EQ(eq[l], x == y ? 1.f : 0.f) << x << " == " << y;
      EXPECT_EQ(both[l], x == y ? 1.f : 0.f) << x << " <= " << y << " <= " << x;
      if (std::isnan(x) || std::isnan(y)) {  // max / min return the second operand (maxps / minps)
        EXPECT_TRUE(std::memcmp(&mx[l], &y, sizeof y) == 0 && std::memcmp(&mn[l], &y, sizeof y) == 0) << x << ", " << y;
      } else {
        EXPECT_EQ(mx[l], std::max(x, y));
        EXPECT_EQ(mn[l], std::min(x, y));
      }
    }
  }
  // The lane sum: exact on small integers, whatever the order of the adds.
  std::vector<float> iota(kSimdWidth);
  for (int l = 0; l < kSimdWidth; ++l) iota[l] = static_cast<float>(l + 1);
  EXPECT_EQ(Simd::reduce_add(Simd::load(iota.data())), static_cast<float>(kSimdWidth * (kSimdWidth + 1) / 2));
  float lanes[kSimdWidth];
  Simd::store(lanes, Simd::iota());
  for (int l = 0; l < kSimdWidth; ++l) EXPECT_EQ(lanes[l], static_cast<float>(l));
}

}  // namespace
}  // namespace flashcore
