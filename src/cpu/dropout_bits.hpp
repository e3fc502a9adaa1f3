// The CPU backends' form of the dropout mask (common/dropout.hpp): which of 64 key columns of one
// row keep their probability, as the bits of a uint64. With AVX-512 the eight Philox4x32-10 calls
// of a 64-key block run side by side, one per 64-bit lane (their 32-bit words in the low halves,
// where vpmuludq multiplies), and two permutes put the 64 draws in column order for two 16-bit
// compares: ~10 ns a block on the development EPYC against ~147 ns for one call after another (at
// d64 the scalar calls took three quarters of a dropout forward's time). The loop is bound by
// throughput, not latency: interleaving two blocks' calls gained nothing.
#pragma once

#include <cstdint>

#include "common/dropout.hpp"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace flashcore {
namespace cpu {

#if defined(__AVX512BW__)
/** For each of the 64 columns of a block, where its draw sits in (w0 | w1 << 32, w2 | w3 << 32) as
 *  32 + 32 16-bit elements: lane L = 2t + u, word w, half h of column 8 (4u + w) + 2t + h. */
struct ColumnSources {
  alignas(64) uint16_t index[2][32];
};
constexpr ColumnSources column_sources() {
  ColumnSources table{};
  for (int column = 0; column < 64; ++column) {
    const int n = column >> 3, t = (column >> 1) & 3, half = column & 1, u = n >> 2, w = n & 3;
    table.index[column >> 5][column & 31] =
        static_cast<uint16_t>((w >= 2 ? 32 : 0) + (2 * t + u) * 4 + (w & 1) * 2 + half);
  }
  return table;
}
#endif

/** dropout_keep_bits(d, bh, i, block): bit k for key column 64 * block + k of row i. static: its
 *  body depends on the ISA a file is compiled for (the kernels' files are native, others not), so
 *  each file keeps its own copy instead of the linker picking one. */
static inline uint64_t keep_bits_of_block(const DropoutParams& d, int64_t bh, int64_t i, int64_t block) {
#if defined(__AVX512BW__)
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
  if (d.kept_threshold > 0xFFFFu) return ~uint64_t(0);  // keeps everything (no 16-bit draw reaches 2^16)
  // Word w's 16-bit half h of lane L = 2t + u serves column 8 (4u + w) + 2t + h. Two words per
  // 64-bit lane (w0 | w1 << 32, w2 | w3 << 32) make two vectors of 32 draws; one two-source
  // permute per 32 columns puts each column's draw at the column's position, and one 16-bit compare
  // gives that half's keep bits in column order.
  const __m512i w01 = _mm512_or_si512(c0, _mm512_slli_epi64(c1, 32));
  const __m512i w23 = _mm512_or_si512(c2, _mm512_slli_epi64(c3, 32));
  static constexpr ColumnSources kColumnSource = column_sources();
  const __m512i threshold = _mm512_set1_epi16(static_cast<int16_t>(d.kept_threshold));
  uint64_t bits = 0;
  for (int part = 0; part < 2; ++part) {
    const __m512i index = _mm512_load_si512(kColumnSource.index[part]);
    const __m512i draws = _mm512_permutex2var_epi16(w01, index, w23);
    bits |= static_cast<uint64_t>(_mm512_cmplt_epu16_mask(draws, threshold)) << (32 * part);
  }
  return bits;
#else
  return dropout_keep_bits(d, bh, i, block);
#endif
}

/** Zeroes the dropped entries of a column-major tile P^T [keys x m_pad] (m_pad a multiple of 16)
 *  whose key n is bit n of every row's keep bits (kept[m], m < m_pad), for keys n < n_keys <= 64.
 *  With AVX-512 a key's 16 rows are one masked move (the rows' bits tested in two vectors):
 *  scalar stores of the dropped entries, then vector loads of the same lines by the P V GEMM, cost
 *  more than the Philox calls at p = 0.1. */
static inline void zero_dropped_columns(float* p_t, int64_t m_pad, const uint64_t* kept, int64_t n_keys) {
#if defined(__AVX512BW__)
  for (int64_t m = 0; m < m_pad; m += 16) {
    const __m512i rows_lo = _mm512_loadu_si512(kept + m), rows_hi = _mm512_loadu_si512(kept + m + 8);
    for (int64_t n = 0; n < n_keys; ++n) {
      const __m512i bit = _mm512_set1_epi64(static_cast<int64_t>(uint64_t(1) << n));
      const __mmask16 keep = static_cast<__mmask16>(_mm512_test_epi64_mask(rows_lo, bit) |
                                                    (static_cast<uint32_t>(_mm512_test_epi64_mask(rows_hi, bit)) << 8));
      float* column = p_t + n * m_pad + m;
      _mm512_storeu_ps(column, _mm512_maskz_mov_ps(keep, _mm512_loadu_ps(column)));
    }
  }
#else
  for (int64_t n = 0; n < n_keys; ++n)
    for (int64_t m = 0; m < m_pad; ++m)
      if (!((kept[m] >> n) & 1)) p_t[n * m_pad + m] = 0.f;
#endif
}

/** dropped[j] = kept bit j ? prob[j] * keep_scale : 0 for j < 64 (a row of 64 keys). */
static inline void scale_kept_row(const float* prob, uint64_t kept, float keep_scale, float* dropped) {
#if defined(__AVX512BW__)
  const __m512 scale = _mm512_set1_ps(keep_scale);
  for (int q = 0; q < 4; ++q) {
    const __mmask16 keep = static_cast<__mmask16>(kept >> (16 * q));
    _mm512_storeu_ps(dropped + 16 * q, _mm512_maskz_mul_ps(keep, _mm512_loadu_ps(prob + 16 * q), scale));
  }
#else
  for (int j = 0; j < 64; ++j) dropped[j] = ((kept >> j) & 1) ? prob[j] * keep_scale : 0.f;
#endif
}

}  // namespace cpu
}  // namespace flashcore
