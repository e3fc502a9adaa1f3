// Host fp16/bf16 conversions: exact values, rounding to nearest even, subnormals, overflow.
#include <gtest/gtest.h>

#include <cmath>

#include "common/dtype_host.hpp"

namespace flashcore {
namespace {

TEST(DtypeHost, Fp16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = fp16_bits_to_float(bits);
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_fp16_bits(f), bits) << std::hex << h;
  }
}

TEST(DtypeHost, Fp16Rounding) {
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1.0f + 1.0f / 4096)), 1.0f);          // tie -> even
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1.0f + 6.0f / 4096)), 1.0f + 1.0f / 512);  // tie -> even (up)
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1.0f + 3.0f / 4096)), 1.0f + 1.0f / 1024);  // nearest
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(65504.f)), 65504.f);
  EXPECT_TRUE(std::isinf(fp16_bits_to_float(float_to_fp16_bits(65520.f))));
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(std::ldexp(1.f, -24))), std::ldexp(1.f, -24));
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(std::ldexp(1.f, -26))), 0.f);
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(NAN))));
}

TEST(DtypeHost, Bf16) {
  for (uint32_t h = 0; h < 0x10000u; h += 7) {
    const float f = bf16_bits_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_bf16_bits(f), h);
  }
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 1.0f / 256)), 1.0f);  // tie -> even
  EXPECT_EQ(round_to(DType::BF16, 3.14159f), 3.140625f);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
}

}  // namespace
}  // namespace flashcore
