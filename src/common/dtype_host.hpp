// Host-side conversions between fp32 and the 16-bit storage types (IEEE fp16, bfloat16), with
// round-to-nearest-even, plus typed element load/store by DType. Used by the CPU backends, the
// tests and the CLI; the CUDA code uses the hardware conversions instead.
#pragma once

#include <cstdint>
#include <cstring>

#include "api/params.hpp"

namespace flashcore {

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_fp16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;        // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;       // overflow (incl. inf) after rounding
  if (abs < 0x33000001u) return sign;                  // rounds to zero
  const int exp = static_cast<int>(abs >> 23);
  uint32_t man = (abs & 0x7fffffu) | 0x800000u;
  if (exp < 113) {  // result is subnormal in fp16
    const int shift = 126 - exp;
    const uint32_t half_ulp = 1u << (shift - 1);
    const uint32_t rest = man & ((1u << shift) - 1);
    uint32_t r = man >> shift;
    if (rest > half_ulp || (rest == half_ulp && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ((static_cast<uint32_t>(exp - 112)) << 10) | ((man >> 13) & 0x3ffu);
  const uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // carries into exponent correctly
  return sign | static_cast<uint16_t>(r);
}

/** Read element `i` of a buffer of type `t` as float. */
inline float load_as_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::F16: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return 0.f;
  }
}

/** Write `x` rounded to type `t` into element `i`. */
inline void store_from_float(void* base, int64_t i, DType t, float x) {
  switch (t) {
    case DType::F32: static_cast<float*>(base)[i] = x; break;
    case DType::F16: static_cast<uint16_t*>(base)[i] = float_to_fp16_bits(x); break;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(x); break;
    default: break;
  }
}

/** x rounded to the precision of `t` and back (identity for fp32). */
inline float round_to(DType t, float x) {
  switch (t) {
    case DType::F16: return fp16_bits_to_float(float_to_fp16_bits(x));
    case DType::BF16: return bf16_bits_to_float(float_to_bf16_bits(x));
    default: return x;
  }
}

}  // namespace flashcore
