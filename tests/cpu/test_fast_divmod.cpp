// FastDivmod (src/common/fast_divmod.hpp) against the / and % operators: every divisor up to 4096
// with dense and edge numerators, then random divisors and numerators over the whole valid range.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/fast_divmod.hpp"

namespace {

void expect_divides(uint32_t d, uint32_t n) {
  const flashcore::FastDivmod f(d);
  ASSERT_EQ(f.div(n), n / d) << "n=" << n << " d=" << d;
  ASSERT_EQ(f.mod(n), n % d) << "n=" << n << " d=" << d;
}

TEST(FastDivmod, SmallDivisorsAllNearbyNumerators) {
  constexpr uint32_t kMaxN = (uint32_t(1) << 31) - 1;
  for (uint32_t d = 1; d <= 4096; ++d) {
    for (uint32_t n = 0; n < 3 * d + 5; ++n) expect_divides(d, n);
    for (uint32_t k = 0; k < 8; ++k) expect_divides(d, kMaxN - k);
  }
}

TEST(FastDivmod, RandomDivisorsAndNumerators) {
  std::mt19937 rng(20261123);
  std::uniform_int_distribution<uint32_t> divisor(1, uint32_t(1) << 31);
  std::uniform_int_distribution<uint32_t> numerator(0, (uint32_t(1) << 31) - 1);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t d = i % 2 ? divisor(rng) : divisor(rng) % 65536 + 1;
    expect_divides(d, numerator(rng));
    expect_divides(d, d - 1 < (uint32_t(1) << 31) ? d - 1 : 0);
  }
  expect_divides(uint32_t(1) << 31, (uint32_t(1) << 31) - 1);
}

}  // namespace
