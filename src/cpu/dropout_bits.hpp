// The CPU backends' form of the dropout mask (common/dropout.hpp): which of 64 key columns of one
// row keep their probability, as the bits of a uint64. With AVX-512 the eight Philox4x32-10 calls
// of a 64-key block run side by side, one per 64-bit lane (their 32-bit words in the low halves,
// where vpmuludq multiplies), about five times faster than one call after another: at d64 the
// scalar calls took three quarters of a dropout forward's time.
#pragma once

#include <cstdint>

#include "common/dropout.hpp"

#if defined(__AVX512F__) && defined(__BMI2__)
#include <immintrin.h>
#endif

namespace flashcore {
namespace cpu {

/** dropout_keep_bits(d, bh, i, block): bit k for key column 64 * block + k of row i. static: its
 *  body depends on the ISA a file is compiled for (the kernels' files are native, others not), so
 *  each file keeps its own copy instead of the linker picking one. */
static inline uint64_t keep_bits_of_block(const DropoutParams& d, int64_t bh, int64_t i, int64_t block) {
#if defined(__AVX512F__) && defined(__BMI2__)
  // Lane L = 2t + u holds the call of counter word 0 = 8 * block + L.
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i mul0 = _mm512_set1_epi64(0xD2511F53ll), mul1 = _mm512_set1_epi64(0xCD9E8D57ll);
  __m512i c0 = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(static_cast<uint32_t>(block << 3))), lanes);
  __m512i c1 = _mm512_set1_epi64(static_cast<uint32_t>(i));
  __m512i c2 = _mm512_set1_epi64(static_cast<uint32_t>(bh));
  __m512i c3 = _mm512_set1_epi64(d.offset_lo);
  uint32_t k0 = d.key0, k1 = d.key1;
  for (int round = 0; round < 10; ++round) {
    const __m512i p0 = _mm512_mul_epu32(mul0, c0), p1 = _mm512_mul_epu32(mul1, c2);
    const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p1, 32), c1), _mm512_set1_epi64(k0));
    const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p0, 32), c3), _mm512_set1_epi64(k1));
    c1 = _mm512_and_si512(p1, low32);
    c3 = _mm512_and_si512(p0, low32);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // Word w's 16-bit half h of lane 2t + u serves column 8 (4u + w) + 2t + h: per (w, h), pext
  // splits the lanes' compare bits by u, and pdep spreads t to the even (h = 0) or odd columns.
  const __m512i threshold = _mm512_set1_epi64(d.kept_threshold);
  const __m512i low16 = _mm512_set1_epi64(0xFFFF);
  const __m512i words[4] = {c0, c1, c2, c3};
  uint64_t bits = 0;
  for (int w = 0; w < 4; ++w) {
    for (int half = 0; half < 2; ++half) {
      const __m512i draw = _mm512_and_si512(_mm512_srli_epi64(words[w], 16 * half), low16);
      const uint32_t kept = _mm512_cmplt_epu64_mask(draw, threshold);
      const uint32_t columns = 0x55u << half;
      bits |= static_cast<uint64_t>(_pdep_u32(_pext_u32(kept, 0x55u), columns)) << (8 * w);
      bits |= static_cast<uint64_t>(_pdep_u32(_pext_u32(kept, 0xAAu), columns)) << (8 * (4 + w));
    }
  }
  return bits;
#else
  return dropout_keep_bits(d, bh, i, block);
#endif
}

}  // namespace cpu
}  // namespace flashcore
