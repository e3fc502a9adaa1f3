// Shared building blocks of the fast CPU backend (flash_forward.cpp, flash_backward.cpp).
//
// - Simd: a thin wrapper over one float vector type, chosen at compile time: AVX-512 when
//   __AVX512F__, AVX2+FMA when __AVX2__ && __FMA__, else four floats in GCC / Clang vector
//   extensions. Everything else here is written once against that wrapper.
// - vexp / vtanh: vectorized exp (Cody-Waite range reduction + degree-6 minimax polynomial, ~1-2 ulp)
//   and tanh (odd polynomial near 0, exp-based elsewhere) for softmax and softcap.
// - load_row / store_row: one row of fp16 / bf16 / fp32 to fp32 and back (round to nearest even).
// - dot, transpose (16 x 16 register blocks on AVX-512), prefetch_rows (rows 4 KiB apart, which
//   the hardware prefetcher does not follow).
// - gemm_bcast: the one register-blocked micro-kernel family both directions are built from:
//   C[i][j..j+W) (+)= sum_k A(i, k) * B[k][j..j+W), A read by scalar broadcast through two
//   strides (so the same code serves A and A^T), B and C read as vectors along j; optional
//   epilogues fold in the online-softmax rescale and the row max.
// - AlignedFloats (64-byte aligned scratch) and run_workers (a shared atomic task counter drained
//   by the worker pool of worker_pool.hpp; results never depend on which thread ran a task).
// Compiled with -O3 -march=native (CMakeLists sets it for the two .cpp files that include this).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
// GCC 12 reports its own _mm512_undefined_ps() placeholders as maybe-uninitialized once the
// intrinsics are inlined (GCC bug 105593); the warning points into the header, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

#include "api/params.hpp"
#include "api/status.hpp"
#include "cpu/worker_pool.hpp"

namespace flashcore {
namespace cpu {
namespace flash_detail {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Simd: one float vector type and the handful of operations the kernels need.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct Simd {
  using F = __m512;
  using Mask = __mmask16;
  static constexpr int kWidth = 16;
  static constexpr const char* kName = "avx512";
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
  static Mask lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static Mask le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static Mask eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static Mask both(Mask a, Mask b) { return static_cast<Mask>(a & b); }
  static F select(Mask m, F if_true, F if_false) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  static F round_nearest(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F times_pow2(F x, F n) { return _mm512_scalef_ps(x, n); }  // x * 2^n, n integral
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  using F = __m256;
  using Mask = __m256;  // all-ones / all-zeros lanes
  static constexpr int kWidth = 8;
  static constexpr const char* kName = "avx2";
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static Mask lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static Mask le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static Mask eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  static F select(Mask m, F if_true, F if_false) { return _mm256_blendv_ps(if_false, if_true, m); }
  static F round_nearest(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F times_pow2(F x, F n) {  // n in [-126, 127]: build 2^n from its exponent bits
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  }
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
// Portable fallback: GCC / Clang vector extensions, four floats (SSE2 on any x86-64, NEON on
// AArch64), so that the vectors stay in registers. The per-lane arrays this replaced, with a
// std::fma per lane, ran a d128 forward at 1.1 GFLOP/s where AVX-512 runs 103 (2 threads): without
// FMA in the target each std::fma is a libm call. Where FMA is not an instruction (FP_FAST_FMAF
// unset, e.g. baseline x86-64), fma here multiplies and adds with two roundings (14.8 GFLOP/s).
struct Simd {
  static constexpr int kWidth = 4;
  static constexpr const char* kName = "portable";
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t Mask __attribute__((vector_size(16)));  // all-ones / all-zeros lanes
  static F load(const float* p) { F r; std::memcpy(&r, p, sizeof(r)); return r; }
  static void store(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }
  static F set1(float x) { return F{x, x, x, x}; }
  static F zero() { return set1(0.f); }
  static F iota() { return F{0.f, 1.f, 2.f, 3.f}; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F max(F a, F b) { return select(a > b, a, b); }
  static F min(F a, F b) { return select(a < b, a, b); }
#if defined(FP_FAST_FMAF)
  static F fma(F a, F b, F c) { return F{std::fma(a[0], b[0], c[0]), std::fma(a[1], b[1], c[1]), std::fma(a[2], b[2], c[2]), std::fma(a[3], b[3], c[3])}; }
#else
  static F fma(F a, F b, F c) { return a * b + c; }
#endif
  static Mask lt(F a, F b) { return a < b; }
  static Mask le(F a, F b) { return a <= b; }
  static Mask eq(F a, F b) { return a == b; }
  static Mask both(Mask a, Mask b) { return a & b; }
  static F select(Mask m, F if_true, F if_false) {
    return reinterpret_cast<F>((reinterpret_cast<Mask>(if_true) & m) | (reinterpret_cast<Mask>(if_false) & ~m));
  }
  // |x| < 2^22 (exp_of_clamped's exponents): adding and removing 1.5 * 2^23 rounds to the nearest
  // integer, ties to even, as nearbyint does in the default rounding mode.
  static F round_nearest(F x) {
    const F magic = set1(12582912.f);
    return (x + magic) - magic;
  }
  static F times_pow2(F x, F n) {  // n in [-126, 127]: build 2^n from its exponent bits
    const Mask biased = __builtin_convertvector(n, Mask) + 127;
    return x * reinterpret_cast<F>(biased << 23);
  }
  static float reduce_add(F v) { return ((v[0] + v[1]) + v[2]) + v[3]; }
};
#endif

using Vec = Simd::F;
constexpr int kSimdWidth = Simd::kWidth;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
inline int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

// ---------------------------------------------------------------------------------------------
// Vectorized exp and tanh.
// ---------------------------------------------------------------------------------------------
struct ExpConstants {
  // Inputs below ln(FLT_MIN) give 0 (flushing the subnormal range keeps exp(-inf) exactly 0);
  // the upper clamp keeps 2^n inside the normal exponent range (n <= 127).
  static constexpr float kMinInput = -87.3365447505f;
  static constexpr float kMaxInput = 88.0f;
  // vexp_softmax's floor: 2^round(-110 log2 e) = 2^-159 scales any y < 2 to exactly 0.
  static constexpr float kSoftmaxFloor = -110.0f;
  static constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split in two (Cody-Waite) so r = x - n ln2 is exact to ~2^-32.
  static constexpr float kLn2Hi = 0.693359375f;
  static constexpr float kLn2Lo = -2.12194440e-4f;
  // exp(r) ~ sum_j kC[j] r^j on |r| <= ln2 / 2: relative-error minimax fit (Remez, error
  // 1.9e-9 before float rounding), evaluated by Horner with fused multiply-adds.
  static constexpr int kDegree = 6;
  static constexpr float kC[kDegree + 1] = {1.0f, 1.0000000363f, 4.9999992080e-1f, 1.6666420170e-1f,
                                             4.1668225567e-2f, 8.3748157983e-3f, 1.3836846135e-3f};
};

/** exp(x) = y * 2^n with |r| <= ln2 / 2; `clamped` must already be inside the usable range. */
inline Vec exp_of_clamped(Vec clamped) {
  using C = ExpConstants;
  const Vec n = Simd::round_nearest(Simd::mul(clamped, Simd::set1(C::kLog2e)));
  Vec r = Simd::fma(n, Simd::set1(-C::kLn2Hi), clamped);
  r = Simd::fma(n, Simd::set1(-C::kLn2Lo), r);
  Vec y = Simd::set1(C::kC[C::kDegree]);
  for (int j = C::kDegree - 1; j >= 0; --j) y = Simd::fma(y, r, Simd::set1(C::kC[j]));
  return Simd::times_pow2(y, n);
}

/** exp for any input: 0 below ln(FLT_MIN) (so exp(-inf) is exactly 0), clamped above. */
inline Vec vexp(Vec x) {
  using C = ExpConstants;
  const Vec clamped = Simd::min(Simd::max(x, Simd::set1(C::kMinInput)), Simd::set1(C::kMaxInput));
  return Simd::select(Simd::lt(x, Simd::set1(C::kMinInput)), Simd::zero(), exp_of_clamped(clamped));
}

/** exp for softmax arguments x = s - max (<= 0, or -inf): exactly 0 for -inf. There is no upper
 *  clamp: a lane that may be large and positive (a masked key in the backward) must be selected
 *  away by the caller. With AVX-512 scalef underflows to 0 on its own, which saves the
 *  clamp-and-select of vexp in the hottest loop; other ISAs take the general path. */
inline Vec vexp_softmax(Vec x) {
#if defined(__AVX512F__)
  return exp_of_clamped(Simd::max(x, Simd::set1(ExpConstants::kSoftmaxFloor)));
#else
  return vexp(x);
#endif
}

/** 2^x for the forward's softmax, which passes x = (s - max) * log2(e) <= 0, or -inf (exactly 0
 *  then). With AVX-512DQ: x - floor(x) in one vreduceps, a degree-5 polynomial for 2^r on
 *  [0, 1] (relative error 1.6e-7 in fp32 evaluation, ~2 ulp) and one vscalefps
 *  (p * 2^floor(x)): 7 vector instructions where vexp_softmax takes 11 (Cody-Waite reduction,
 *  degree 6), in the loop that runs once per score. No clamp is needed: vreduceps(-inf) is +0
 *  and vscalefps(p, -inf) is 0 (Intel SDM special-case tables; checked on Zen 4), a finite
 *  x < -150 underflows to 0 in vscalefps: the results are bit-identical to clamping at -160
 *  first, except that a NaN score now stays NaN (vmaxps turned it into 0). Dropping that clamp
 *  (a vmaxps per vector) was measured at ~1% of the whole d=64 forward. */
struct Exp2Constants {
  static constexpr float kLn2 = 0.693147180559945309f;
  static constexpr int kDegree = 5;
  // Relative-error fit of 2^r on [0, 1) (Lawson iteration over Chebyshev points).
  static constexpr float kC[kDegree + 1] = {9.9999992507e-01f, 6.9315307312e-01f, 2.4015361742e-01f,
                                             5.5826317418e-02f, 8.9893404715e-03f, 1.8775766391e-03f};
};

inline Vec vexp2_softmax(Vec x) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  using C = Exp2Constants;
  const Vec r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x)
  Vec y = Simd::set1(C::kC[C::kDegree]);
  for (int j = C::kDegree - 1; j >= 0; --j) y = Simd::fma(y, r, Simd::set1(C::kC[j]));
  return _mm512_scalef_ps(y, x);  // y * 2^floor(x)
#else
  return vexp_softmax(Simd::mul(x, Simd::set1(Exp2Constants::kLn2)));
#endif
}

struct TanhConstants {
  // Below this |x| an odd polynomial avoids the cancellation of 1 - 2 / (exp(2x) + 1).
  static constexpr float kPolyLimit = 0.625f;
  // tanh(x) ~ x + x^3 * Q(x^2) (Cephes tanhf).
  static constexpr float kQ0 = -5.70498872745e-3f;
  static constexpr float kQ1 = 2.06390887954e-2f;
  static constexpr float kQ2 = -5.37397155531e-2f;
  static constexpr float kQ3 = 1.33314422036e-1f;
  static constexpr float kQ4 = -3.33332819422e-1f;
};

inline Vec vtanh(Vec x) {
  using C = TanhConstants;
  const Vec one = Simd::set1(1.f);
  const Vec abs_x = Simd::max(x, Simd::sub(Simd::zero(), x));
  const Vec e = vexp(Simd::add(abs_x, abs_x));
  const Vec big = Simd::sub(one, Simd::div(Simd::set1(2.f), Simd::add(e, one)));
  const Vec signed_big = Simd::select(Simd::lt(x, Simd::zero()), Simd::sub(Simd::zero(), big), big);
  const Vec z = Simd::mul(x, x);
  Vec q = Simd::set1(C::kQ0);
  q = Simd::fma(q, z, Simd::set1(C::kQ1));
  q = Simd::fma(q, z, Simd::set1(C::kQ2));
  q = Simd::fma(q, z, Simd::set1(C::kQ3));
  q = Simd::fma(q, z, Simd::set1(C::kQ4));
  const Vec small = Simd::fma(Simd::mul(q, z), x, x);
  return Simd::select(Simd::lt(abs_x, Simd::set1(C::kPolyLimit)), small, signed_big);
}

// ---------------------------------------------------------------------------------------------
// Element conversion (fp16 / bf16 <-> fp32, round to nearest even).
// ---------------------------------------------------------------------------------------------
inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, sizeof u); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, sizeof f); return f; }

struct HalfBits {
  static constexpr uint32_t kSign = 0x8000u;
  static constexpr uint32_t kExpMask = 0x1fu;
  static constexpr int kMantBits = 10;
  static constexpr uint32_t kMantMask = 0x3ffu;
  static constexpr int kExpRebias = 127 - 15;        // float exponent bias minus half's
  static constexpr float kSubnormalUnit = 5.9604644775390625e-8f;  // 2^-24
  static constexpr uint32_t kInf = 0x7c00u;
  static constexpr uint32_t kQuietNan = 0x7e00u;
  static constexpr uint32_t kFloatInf = 0x7f800000u;
  static constexpr uint32_t kFirstOverflow = 0x477ff000u;   // 65520 rounds to inf
  static constexpr uint32_t kSmallestNormal = 0x38800000u;  // 2^-14
  static constexpr float kSubnormalMagic = 0.5f;  // ulp(0.5f) == 2^-24 == half's subnormal unit
  static constexpr int kMantShift = 23 - kMantBits;
};

inline float half_to_float(uint16_t h) {
  using H = HalfBits;
  const uint32_t sign = (static_cast<uint32_t>(h) & H::kSign) << 16;
  const uint32_t exponent = (h >> H::kMantBits) & H::kExpMask;
  const uint32_t mantissa = h & H::kMantMask;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float
    return bits_float(sign | float_bits(static_cast<float>(mantissa) * H::kSubnormalUnit));
  }
  if (exponent == H::kExpMask) return bits_float(sign | H::kFloatInf | (mantissa << H::kMantShift));
  return bits_float(sign | ((exponent + H::kExpRebias) << 23) | (mantissa << H::kMantShift));
}

inline uint16_t float_to_half(float f) {
  using H = HalfBits;
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & H::kSign;
  uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude >= H::kFloatInf) return static_cast<uint16_t>(sign | (magnitude > H::kFloatInf ? H::kQuietNan : H::kInf));
  if (magnitude >= H::kFirstOverflow) return static_cast<uint16_t>(sign | H::kInf);
  if (magnitude < H::kSmallestNormal) {
    // Adding 0.5 lets the float adder round to a multiple of 2^-24 (nearest even) for us.
    const float shifted = bits_float(magnitude) + H::kSubnormalMagic;
    return static_cast<uint16_t>(sign | (float_bits(shifted) - float_bits(H::kSubnormalMagic)));
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  const uint32_t odd = (magnitude >> H::kMantShift) & 1u;
  const uint32_t half_ulp_minus_one = (1u << (H::kMantShift - 1)) - 1u;
  magnitude += half_ulp_minus_one + odd - (static_cast<uint32_t>(H::kExpRebias) << 23);
  return static_cast<uint16_t>(sign | (magnitude >> H::kMantShift));
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > HalfBits::kFloatInf) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

/** Reads n elements of `dtype` at src as fp32 into dst. fp32 is copied with vector loads inline:
 *  a libc memcpy call per row (512 bytes at d128) cost more in the decode path's staging. */
inline void load_row(DType dtype, const void* src, int64_t n, float* dst) {
  if (dtype == DType::F32) {
    const float* s = static_cast<const float*>(src);
    int64_t i = 0;
    for (; i + kSimdWidth <= n; i += kSimdWidth) Simd::store(dst + i, Simd::load(s + i));
    for (; i < n; ++i) dst[i] = s[i];
  } else if (dtype == DType::F16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#if defined(__F16C__)
    constexpr int kLanes = 8;
    for (; i + kLanes <= n; i += kLanes) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = half_to_float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {  // bf16 is fp32's upper half
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      _mm512_storeu_si512(dst + i, _mm512_slli_epi32(bits, 16));
    }
#endif
    for (; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  }
}

/** Writes n fp32 values as `dtype` (round to nearest even) at dst. */
inline void store_row(DType dtype, const float* src, int64_t n, void* dst) {
  if (dtype == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else if (dtype == DType::F16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t i = 0;
#if defined(__F16C__)
    constexpr int kLanes = 8;
    for (; i + kLanes <= n; i += kLanes) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; ++i) d[i] = float_to_half(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t i = 0;
#if defined(__AVX512F__)
    // float_to_bf16 on 16 lanes: the same rounding (nearest even) and quiet NaNs, bit for bit.
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i half_minus_one = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    for (; i + 16 <= n; i += 16) {
      const __m512i x = _mm512_loadu_si512(src + i);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs_mask), inf);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(half_minus_one, odd)), 16);
      const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                          _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
    }
#endif
    for (; i < n; ++i) d[i] = float_to_bf16(src[i]);
  }
}

/** Address of element (b, row, h, 0) of a tensor of `dtype`. */
inline const void* element_ptr(const TensorRef& t, DType dtype, int64_t b, int64_t row, int64_t h) {
  return static_cast<const char*>(t.data) + offset_of(t, b, row, h) * static_cast<int64_t>(dtype_size(dtype));
}
/** Key / value row `row` (seq.k_start + j) of sequence b, head h, of k or v (through the page
 *  table for paged K/V, api/params.hpp's kv_offset). */
inline const void* kv_row_ptr(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t row, int64_t h) {
  return static_cast<const char*>(t.data) + kv_offset(p, t, b, row, h) * static_cast<int64_t>(dtype_size(p.dtype));
}
/** Calls fn(r, row, run) for the `rows` key / value rows first_row, first_row + 1, ... of
 *  sequence b, head h, of k or v, in order, a run of consecutive rows at a time: rows r .. r +
 *  run - 1 sit `row_stride` elements apart from `row` on. Paged K/V take one page lookup per run
 *  (a page, or what the range holds of one): a lookup per row (a 64-bit division) made a d64
 *  forward over a paged view ~25% slower than over the same keys unpaged (docs/PERF.md,
 *  session 33). */
template <class Fn>
inline void for_kv_runs(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t first_row, int64_t rows,
                        int64_t h, Fn&& fn) {
  for (int64_t r = 0; r < rows;) {
    int64_t run = rows - r;
    if (p.is_paged()) run = std::min(run, p.pages.page_size - kv_page_slot(p, b, first_row + r).slot);
    fn(r, static_cast<const char*>(kv_row_ptr(p, t, b, first_row + r, h)), run);
    r += run;
  }
}
/** for_kv_runs row by row: fn(r, row). */
template <class Fn>
inline void for_kv_rows(const AttentionParams& p, const TensorRef& t, int64_t b, int64_t first_row, int64_t rows,
                        int64_t h, Fn&& fn) {
  const int64_t row_bytes = t.row_stride * static_cast<int64_t>(dtype_size(p.dtype));
  for_kv_runs(p, t, b, first_row, rows, h, [&](int64_t r, const char* row, int64_t run) {
    for (int64_t i = 0; i < run; ++i) fn(r + i, static_cast<const void*>(row + i * row_bytes));
  });
}
inline void* element_ptr_mut(const TensorRef& t, DType dtype, int64_t b, int64_t row, int64_t h) {
  return static_cast<char*>(t.data) + offset_of(t, b, row, h) * static_cast<int64_t>(dtype_size(dtype));
}

/** sum_i a[i] * b[i] in fp32, SIMD lanes first, then the lanes in a fixed order. */
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = Simd::zero();
  int64_t i = 0;
  for (; i + kSimdWidth <= n; i += kSimdWidth) acc = Simd::fma(Simd::load(a + i), Simd::load(b + i), acc);
  float sum = Simd::reduce_add(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// ---------------------------------------------------------------------------------------------
// Transposition (Q into Q^T, O^T back into rows) in register blocks: a scalar loop with strided
// stores was measured at ~7 cycles per element, a large share of a short sequence's time.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int kTransposeBlock = 16;
/** dst[c * dst_ld + r] = src[r * src_ld + c] for one full 16 x 16 block. */
inline void transpose_block(const float* src, int64_t src_ld, float* dst, int64_t dst_ld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_ld);
  for (int i = 0; i < 16; i += 2) {  // interleave 32-bit lanes of row pairs
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then 64-bit lanes of pairs of pairs
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
      r[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
    }
  }
  for (int i = 0; i < 16; i += 8) {  // then 128-bit lanes, twice
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  // Lane bookkeeping of the four stages: output row c sits in r[perm[c]].
  static constexpr int kOrder[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  for (int c = 0; c < 16; ++c) _mm512_storeu_ps(dst + c * dst_ld, r[kOrder[c]]);
}
#else
constexpr int kTransposeBlock = 8;
inline void transpose_block(const float* src, int64_t src_ld, float* dst, int64_t dst_ld) {
  for (int c = 0; c < kTransposeBlock; ++c)
    for (int r = 0; r < kTransposeBlock; ++r) dst[c * dst_ld + r] = src[r * src_ld + c];
}
#endif

/** dst[c * dst_ld + r] = src[r * src_ld + c] for r < rows, c < cols. */
inline void transpose(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst, int64_t dst_ld) {
  constexpr int64_t kB = kTransposeBlock;
  const int64_t full_rows = rows / kB * kB, full_cols = cols / kB * kB;
  for (int64_t r = 0; r < full_rows; r += kB)
    for (int64_t c = 0; c < full_cols; c += kB) transpose_block(src + r * src_ld + c, src_ld, dst + c * dst_ld + r, dst_ld);
  for (int64_t r = 0; r < rows; ++r) {  // ragged edges
    const int64_t c_begin = r < full_rows ? full_cols : 0;
    for (int64_t c = c_begin; c < cols; ++c) dst[c * dst_ld + r] = src[r * src_ld + c];
  }
}

/** Asks the cache for `rows` rows of `row_bytes` bytes, `stride_bytes` apart. Rows of one head
 *  in a (batch, seq, heads, dim) tensor are often 4 KiB apart, a stride the hardware prefetcher
 *  does not follow, so loads of a tile would otherwise wait on one cache miss after another. */
constexpr int64_t kCacheLine = 64;

/** One cache line into L1, for reading or for writing (__builtin_prefetch wants constants). */
inline void prefetch_line(const char* at, bool for_write) {
  if (for_write) {
    __builtin_prefetch(at, 1, 3);
  } else {
    __builtin_prefetch(at, 0, 3);
  }
}

inline void prefetch_rows(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes, bool for_write = false) {
  const char* base = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t off = 0; off < row_bytes; off += kCacheLine) prefetch_line(base + r * stride_bytes + off, for_write);
  }
}

/** Prefetches handed out a few cache lines at a time, between the micro-tiles of the GEMMs,
 *  instead of in one burst. A burst of hundreds of prefetches (a whole K/V tile, a task's query
 *  rows) mostly did not arrive in time: copying 64 rows of 512 B, 8 KiB apart, from DRAM took
 *  10.0k cycles unprefetched, 6.5k after one burst of 512 prefetches 60 us earlier, and 1.7-2.3k
 *  when the same prefetches went out 8 lines at a time over those 60 us; bursts of 16 to 256
 *  lines gave 4.2k-6.8k (dev EPYC; the line fill buffers take a dozen or two misses at once). */
class PrefetchQueue {
 public:
  PrefetchQueue() { ranges_.reserve(64); }

  /** Queues `rows` rows of `row_bytes` bytes, `stride_bytes` apart. */
  void add(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes, bool for_write = false) {
    if (rows <= 0 || row_bytes <= 0) return;
    ranges_.push_back({static_cast<const char*>(first), rows, stride_bytes, row_bytes, for_write});
    pending_ += rows * ceil_div(row_bytes, kCacheLine);
  }
  /** Spreads what is queued over about `slots` calls of issue(). */
  void pace(int64_t slots) { per_issue_ = std::max<int64_t>(1, ceil_div(pending_, std::max<int64_t>(slots, 1))); }
  /** The next few lines (see pace); cheap when the queue is empty. */
  void issue() {
    if (pending_ > 0) issue_lines(per_issue_);
  }
  /** Everything still queued, now. */
  void drain() { issue_lines(pending_); }

 private:
  struct Range {
    const char* first;
    int64_t rows, stride_bytes, row_bytes;
    bool for_write;
  };
  void issue_lines(int64_t lines) {
    for (; lines > 0 && next_range_ < ranges_.size(); --lines, --pending_) {
      const Range& r = ranges_[next_range_];
      prefetch_line(r.first + row_ * r.stride_bytes + offset_, r.for_write);
      if ((offset_ += kCacheLine) >= r.row_bytes) {
        offset_ = 0;
        if (++row_ == r.rows) {
          row_ = 0;
          ++next_range_;
        }
      }
    }
    if (next_range_ == ranges_.size()) {
      ranges_.clear();
      next_range_ = 0;
      pending_ = 0;
    }
  }
  std::vector<Range> ranges_;
  size_t next_range_ = 0;
  int64_t row_ = 0, offset_ = 0;  // position inside ranges_[next_range_]
  int64_t pending_ = 0;           // lines queued and not issued
  int64_t per_issue_ = 1;
};

// ---------------------------------------------------------------------------------------------
// Scratch memory.
// ---------------------------------------------------------------------------------------------
/** A growable, 64-byte aligned float array; contents are not preserved by reserve(). */
class AlignedFloats {
 public:
  static constexpr size_t kAlignment = 64;
  AlignedFloats() = default;
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  ~AlignedFloats() { release(); }
  float* reserve(int64_t count) {
    if (count > capacity_) {
      release();
      data_ = static_cast<float*>(::operator new[](static_cast<size_t>(count) * sizeof(float), std::align_val_t(kAlignment)));
      capacity_ = count;
    }
    return data_;
  }
  float* data() const { return data_; }

 private:
  void release() {
    if (data_) ::operator delete[](data_, std::align_val_t(kAlignment));
    data_ = nullptr;
    capacity_ = 0;
  }
  float* data_ = nullptr;
  int64_t capacity_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Register-blocked micro-kernels: C[i][j] (+)= sum_k A(i, k) * B[k][j], j vectorized.
// ---------------------------------------------------------------------------------------------
enum class Accumulate {
  kOverwrite,   // C = A B
  kAdd,         // C += A B
  kScaleAdd,    // C = C * column[j] + A B     (the online-softmax rescale, folded in)
  kOverwriteMax,  // C = A B and column[j] = max(column[j], max_i C[i][j])  (the row max, folded in)
};

struct GemmTraits {
  // Accumulator tile: kRows rows x kVecs vectors. AVX-512: 6 x 4 = 24 of 32 zmm registers,
  // leaving room for the B vectors and one broadcast. Narrower ISAs have 16 registers.
#if defined(__AVX512F__)
  static constexpr int kRows = 6;
  static constexpr int kVecs = 4;
#else
  static constexpr int kRows = 4;
  static constexpr int kVecs = 2;
#endif
};

/** An R x V tile on AVX-512 (32 registers); GemmTraits' tile on narrower ISAs (16 registers). */
template <int R, int V>
struct Avx512Tile {
#if defined(__AVX512F__)
  static constexpr int kRows = R;
  static constexpr int kVecs = V;
#else
  static constexpr int kRows = GemmTraits::kRows;
  static constexpr int kVecs = GemmTraits::kVecs;
#endif
};

/** 8 rows x 3 vectors (24 accumulators, 3 vector loads + 8 broadcasts per 24 FMAs), the
 *  forward's: 8 divides the key and head_dim rows (6 x 4 left a 4- or 2-row remainder tile,
 *  measured ~40% slower per FMA), and the tile issues fewer loads per FMA than the 8 x 2 shipped
 *  until session 7, which a CPU with two 512-bit FMA ports needs. On the GPU machine's Xeon (two ports) the
 *  forward ran 3-23% faster with it than with 8 x 2, at 2 and 16 threads; on the single-port EPYC
 *  within -6% / +4% (dev/cpu_forward_sweep.cpp, docs/PERF.md session 8). */
struct WideGemmTraits : Avx512Tile<8, 3> {};

// Full unrolling of the R x V loops lets GCC keep the accumulators in registers from start to end
// (without it they round-trip through the stack around the k loop).
#if defined(__GNUC__) && !defined(__clang__)
#define FC_UNROLL _Pragma("GCC unroll 16")
#elif defined(__clang__)
#define FC_UNROLL _Pragma("unroll")
#else
#define FC_UNROLL
#endif

/** One R x V-vector tile. A(i, k) = a[i * a_row + k * a_k]. */
template <int R, int V, Accumulate kMode>
inline void gemm_micro(const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb, float* c,
                       int64_t ldc, int64_t depth, float* column) {
  Vec acc[R][V];
  FC_UNROLL for (int r = 0; r < R; ++r) {
    FC_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = Simd::zero();
  }
  for (int64_t k = 0; k < depth; ++k) {
    const float* b_k = b + k * ldb;
    const float* a_k_ptr = a + k * a_k;
    Vec bv[V];
    FC_UNROLL for (int v = 0; v < V; ++v) bv[v] = Simd::load(b_k + v * kSimdWidth);
    FC_UNROLL for (int r = 0; r < R; ++r) {
      const Vec ar = Simd::set1(a_k_ptr[r * a_row]);
      FC_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = Simd::fma(ar, bv[v], acc[r][v]);
    }
  }
  FC_UNROLL for (int r = 0; r < R; ++r) {
    float* c_r = c + r * ldc;
    FC_UNROLL for (int v = 0; v < V; ++v) {
      float* dst = c_r + v * kSimdWidth;
      if (kMode == Accumulate::kOverwrite) {
        Simd::store(dst, acc[r][v]);
      } else if (kMode == Accumulate::kAdd) {
        Simd::store(dst, Simd::add(Simd::load(dst), acc[r][v]));
      } else if (kMode == Accumulate::kScaleAdd) {
        Simd::store(dst, Simd::fma(Simd::load(dst), Simd::load(column + v * kSimdWidth), acc[r][v]));
      } else {
        Simd::store(dst, acc[r][v]);
      }
    }
  }
  if (kMode == Accumulate::kOverwriteMax) {
    FC_UNROLL for (int v = 0; v < V; ++v) {
      Vec m = acc[0][v];
      FC_UNROLL for (int r = 1; r < R; ++r) m = Simd::max(m, acc[r][v]);
      Simd::store(column + v * kSimdWidth, Simd::max(Simd::load(column + v * kSimdWidth), m));
    }
  }
}

/** The last `rest` (< R) rows of a gemm_rows call: one tile of exactly `rest` rows. */
template <int R, int V, Accumulate kMode>
inline void gemm_row_remainder(int rest, const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb,
                               float* c, int64_t ldc, int64_t depth, float* column) {
  if constexpr (R > 1) {
    if (rest == R - 1) {
      gemm_micro<R - 1, V, kMode>(a, a_row, a_k, b, ldb, c, ldc, depth, column);
    } else {
      gemm_row_remainder<R - 1, V, kMode>(rest, a, a_row, a_k, b, ldb, c, ldc, depth, column);
    }
  }
}

/** Rows of C in tiles of kR rows; `prefetch` (optional) gets a turn after every tile. */
template <int V, Accumulate kMode, int kR = GemmTraits::kRows>
inline void gemm_rows(int64_t rows, const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb,
                      float* c, int64_t ldc, int64_t depth, float* column, PrefetchQueue* prefetch = nullptr) {
  int64_t i = 0;
  for (; i + kR <= rows; i += kR) {
    gemm_micro<kR, V, kMode>(a + i * a_row, a_row, a_k, b, ldb, c + i * ldc, ldc, depth, column);
    if (prefetch) prefetch->issue();
  }
  if (i < rows) {
    gemm_row_remainder<kR, V, kMode>(static_cast<int>(rows - i), a + i * a_row, a_row, a_k, b, ldb, c + i * ldc, ldc,
                                     depth, column);
  }
}

/** The last `rest` (< V) vectors of columns of a gemm_bcast call. */
template <int V, int kR, Accumulate kMode>
inline void gemm_column_remainder(int rest, int64_t rows, const float* a, int64_t a_row, int64_t a_k, const float* b,
                                  int64_t ldb, float* c, int64_t ldc, int64_t depth, float* column,
                                  PrefetchQueue* prefetch) {
  if constexpr (V > 1) {
    if (rest == V - 1) {
      gemm_rows<V - 1, kMode, kR>(rows, a, a_row, a_k, b, ldb, c, ldc, depth, column, prefetch);
    } else {
      gemm_column_remainder<V - 1, kR, kMode>(rest, rows, a, a_row, a_k, b, ldb, c, ldc, depth, column, prefetch);
    }
  }
}

/** C[rows x cols] (+)= A[rows x depth] * B[depth x cols]; cols must be a multiple of kSimdWidth.
 *  A(i, k) = a[i * a_row + k * a_k]: (a_row = lda, a_k = 1) reads A, (1, lda) reads A^T.
 *  column has cols entries: the scale read by kScaleAdd or the running max kOverwriteMax updates.
 *  prefetch (optional) issues a few queued prefetches after every micro-tile. */
template <Accumulate kMode, class Traits = GemmTraits>
inline void gemm_bcast(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t a_row, int64_t a_k,
                       const float* b, int64_t ldb, float* c, int64_t ldc, float* column = nullptr,
                       PrefetchQueue* prefetch = nullptr) {
  constexpr int kV = Traits::kVecs;
  constexpr int kR = Traits::kRows;
  const int64_t vectors = cols / kSimdWidth;
  int64_t v = 0;
  for (; v + kV <= vectors; v += kV) {
    const int64_t j = v * kSimdWidth;
    gemm_rows<kV, kMode, kR>(rows, a, a_row, a_k, b + j, ldb, c + j, ldc, depth, column ? column + j : nullptr,
                             prefetch);
  }
  if (v < vectors) {
    const int64_t j = v * kSimdWidth;
    gemm_column_remainder<kV, kR, kMode>(static_cast<int>(vectors - v), rows, a, a_row, a_k, b + j, ldb, c + j, ldc,
                                         depth, column ? column + j : nullptr, prefetch);
  }
}

// ---------------------------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------------------------
/** Hands out task ids 0..count-1, each exactly once, to whichever worker asks first. */
class TaskQueue {
 public:
  TaskQueue(int64_t count, int64_t workers) : count_(count), workers_(workers) {}
  /** Number of workers draining the queue: task t + workers() is a fair guess at what the
   *  worker that just took t will take next (used to prefetch its inputs). */
  int64_t workers() const { return workers_; }
  int64_t size() const { return count_; }
  /** Next task id, or -1 when all are taken. */
  int64_t next() {
    const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    return t < count_ ? t : -1;
  }

 private:
  std::atomic<int64_t> next_{0};
  int64_t count_;
  int64_t workers_;
};

inline int resolve_thread_count(int requested) { return requested > 0 ? requested : available_cores(); }

/** Runs worker(queue) on up to `requested_threads` threads (the caller's thread is one of them,
 *  the others come from the process-wide pool in worker_pool.hpp) until the queue is drained.
 *  Each worker owns its scratch; outputs must depend only on the task, so results are identical
 *  whatever the thread count or timing. Exceptions become a Status. */
template <class Worker>
Status run_workers(int64_t num_tasks, int requested_threads, Worker&& worker) {
  if (num_tasks <= 0) return Status::ok();
  const int threads = static_cast<int>(std::min<int64_t>(resolve_thread_count(requested_threads), num_tasks));
  TaskQueue queue(num_tasks, threads);
  std::atomic<bool> failed{false};
  std::string failure;
  std::atomic_flag failure_lock = ATOMIC_FLAG_INIT;
  auto record = [&](const char* what) {
    if (!failure_lock.test_and_set()) failure = what;
    failed.store(true);
  };
  auto guarded = [&](int /*worker index*/) {
    try {
      worker(queue);
    } catch (const std::bad_alloc&) {
      record("cpu_flash: out of host memory for scratch buffers");
    } catch (const std::exception& e) {
      record(e.what());
    } catch (...) {
      record("cpu_flash: unknown exception in a worker");
    }
  };
  // If the system refused some threads, the workers that ran drained the queue anyway.
  run_on_workers(threads, WorkerBody::of(guarded));
  if (failed.load()) return Status::internal(failure);
  return Status::ok();
}

}  // namespace flash_detail
}  // namespace cpu
}  // namespace flashcore
