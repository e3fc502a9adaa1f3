// cpu_flash's row conversions (cpu_common.hpp load_row / store_row) against the scalar host
// conversions of dtype_host.hpp, bit for bit: every fp16 / bf16 pattern in, and fp32 patterns out
// across the whole range (ties, subnormals, infinities, NaNs). One exception: F16C quiets fp16
// NaNs and keeps their payloads where the scalar conversions keep signalling NaNs signalling and
// write a canonical quiet NaN; a NaN stays a NaN either way.
// Built with -march=native where the library is (tests/CMakeLists.txt), so the vector loops are
// the code under test. Buffers are 32-bit wide so that no branch of the conversions could
// overrun them (the compiler checks the fp32 branch too).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype_host.hpp"
#include "cpu/cpu_common.hpp"

namespace flashcore {
namespace {

using cpu::flash_detail::load_row;
using cpu::flash_detail::store_row;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(CpuRowConversions, EverySixteenBitPatternLoads) {
  constexpr size_t kCount = 0x10000 + 5;  // + a tail the vector loop leaves to the scalar one
  std::vector<uint32_t> storage(kCount);
  uint16_t* in = reinterpret_cast<uint16_t*>(storage.data());
  for (size_t i = 0; i < kCount; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(kCount);
  for (DType t : {DType::BF16, DType::F16}) {
    load_row(t, in, static_cast<int64_t>(kCount), out.data());
    for (size_t i = 0; i < kCount; ++i) {
      const float want = t == DType::BF16 ? bf16_bits_to_float(in[i]) : fp16_bits_to_float(in[i]);
      if (t == DType::F16 && std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[i])) << "fp16 " << std::hex << in[i];
        continue;
      }
      ASSERT_EQ(to_bits(out[i]), to_bits(want)) << (t == DType::BF16 ? "bf16 " : "fp16 ") << std::hex << in[i];
    }
  }
}

TEST(CpuRowConversions, Fp32PatternsStoreAsTheScalarConversionDoes) {
  std::vector<float> in;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 0x10001ull) in.push_back(from_bits(static_cast<uint32_t>(u)));
  for (uint32_t hi : {0x3f80u, 0x3f81u, 0x0000u, 0x0080u, 0x7f7fu, 0x7f80u, 0x7fc0u, 0xff80u, 0x8001u}) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) in.push_back(from_bits(hi << 16 | lo));
  }
  in.push_back(from_bits(0x7f800001u));  // signalling NaN with a low payload
  in.push_back(from_bits(0xffbfffffu));
  std::vector<uint32_t> storage(in.size());
  uint16_t* out = reinterpret_cast<uint16_t*>(storage.data());
  for (DType t : {DType::BF16, DType::F16}) {
    store_row(t, in.data(), static_cast<int64_t>(in.size()), out);
    for (size_t i = 0; i < in.size(); ++i) {
      if (t == DType::F16 && std::isnan(in[i])) {
        ASSERT_TRUE(std::isnan(fp16_bits_to_float(out[i]))) << "fp16 " << std::hex << to_bits(in[i]);
        continue;
      }
      const uint16_t want = t == DType::BF16 ? float_to_bf16_bits(in[i]) : float_to_fp16_bits(in[i]);
      ASSERT_EQ(out[i], want) << (t == DType::BF16 ? "bf16 " : "fp16 ") << std::hex << to_bits(in[i]);
    }
  }
}

}  // namespace
}  // namespace flashcore
