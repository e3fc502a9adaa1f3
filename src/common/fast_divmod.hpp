// Division by a divisor fixed before a kernel starts, as one multiply-high, an add and a shift
// (the round-up method of Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994). A GPU has no integer divider: `n / d` with a run-time d is a ~20-instruction
// float-reciprocal sequence in 32 bits and a subroutine call in 64 bits, which a persistent kernel's
// tile walk pays for every tile on one thread, with nothing to hide it behind.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashcore {

/** n / d and n % d for 0 <= n < 2^31 and 1 <= d <= 2^31.
 *  With s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, n / d = (umulhi(n, m) + n) >> s;
 *  umulhi(n, m) < n keeps the sum below 2^32 for n < 2^31. */
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while (shift < 31 && (uint32_t(1) << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }

  FC_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t(n) * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }
  FC_HOST_DEVICE uint32_t mod(uint32_t n) const { return n - div(n) * divisor; }
};

}  // namespace flashcore
