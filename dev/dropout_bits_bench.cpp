// Time per 64-key block of cpu_flash's dropout mask: the AVX-512 form (cpu/dropout_bits.hpp,
// keep_bits_of_block) against the scalar rule it must equal (common/dropout.hpp, dropout_keep_bits:
// eight Philox4x32-10 calls one after another), in the same process; every AVX-512 result is
// checked against the scalar one.
//
// build: g++ -O3 -march=native -std=c++17 -I src dev/dropout_bits_bench.cpp -o /tmp/dropout_bits_bench
#include <chrono>
#include <cstdint>
#include <cstdio>

#include "cpu/dropout_bits.hpp"

int main() {
  using namespace flashcore;
  using Clock = std::chrono::steady_clock;
  const DropoutParams d = make_dropout(0.1, 1234, 5);
  constexpr int kBlocks = 400000;
  uint64_t sink = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kBlocks; ++i) sink += dropout_keep_bits(d, 3, i, i & 7);
    const auto t1 = Clock::now();
    for (int i = 0; i < kBlocks; ++i) sink += cpu::keep_bits_of_block(d, 3, i, i & 7);
    const auto t2 = Clock::now();
    auto ns = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::nano>(b - a).count() / kBlocks;
    };
    std::printf("scalar %.1f ns / block, vectorized %.1f ns / block\n", ns(t0, t1), ns(t1, t2));
  }
  for (int i = 0; i < 4096; ++i) {
    if (cpu::keep_bits_of_block(d, i % 5, i, i % 9) != dropout_keep_bits(d, i % 5, i, i % 9)) {
      std::printf("MISMATCH at %d\n", i);
      return 1;
    }
  }
  return sink == 42 ? 2 : 0;  // keeps the loops
}
