// Attention dropout: which probabilities are kept, as one pure function of (seed, offset, sequence,
// query head, query row, key column). Every backend (the fp64 reference, the CPU flash path, the
// CUDA kernels, forward and backward) draws its mask here, so a forward and its backward, any tile
// shape, any thread count and any backend drop the same entries.
//
// The random numbers come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011): a counter-based generator, so a kernel computes the bits of any score
// element without state. One Philox call gives four 32-bit words = eight 16-bit draws; entry
// (i, j) keeps its probability when its draw is below kept_threshold = round((1 - p) * 65536),
// and kept probabilities are multiplied by 1 / (1 - p) (flash_attn's scaling).
//
// Which draw belongs to (i, j): the eight draws of one call cover the key columns that one thread
// of an mma.sync m16n8 or wgmma m64nN accumulator holds in one row of a 64-key block (columns
// 8n + 2t and 8n + 2t + 1 for n = 4u .. 4u + 3, t = lane % 4), so GPU kernels never compute a
// draw they do not use. The counter of the call serving (i, j):
//   c0 = (j / 64) * 8 + ((j / 2) % 4) * 2 + (j / 32) % 2     the column group (64-key block, t, u)
//   c1 = i                                                  the query row of the sequence
//   c2 = b * heads_q + h                                     sequence (varlen: its index), query head
//   c3 = low 32 bits of the offset
// and the key is (low, high) 32 bits of the seed, the offset's high 32 bits added to the high key
// word. The draw is 16-bit half (j % 2) of word ((j / 8) % 4). validate.cpp limits dropout calls
// to seqlen_k < 2^29 and batch * heads_q < 2^32 so the counter words never wrap.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashcore {

/** One call's dropout, as the backends see it (AttentionParams::dropout). */
struct DropoutParams {
  float p = 0.f;                 // probability of dropping; 0 = off
  float keep_scale = 1.f;        // 1 / (1 - p)
  uint32_t kept_threshold = 0;   // a 16-bit draw below this keeps the entry (round((1 - p) * 65536))
  uint32_t key0 = 0, key1 = 0;   // Philox key: seed low word, seed high word + offset high word
  uint32_t offset_lo = 0;        // counter word 3

  FC_HOST_DEVICE bool enabled() const { return p > 0.f; }
};

/** The Philox key and threshold of (p, seed, offset); p in [0, 1). */
inline DropoutParams make_dropout(double p, uint64_t seed, uint64_t offset) {
  DropoutParams d;
  if (!(p > 0.0)) return d;
  d.p = static_cast<float>(p);
  d.keep_scale = static_cast<float>(1.0 / (1.0 - p));
  const double t = (1.0 - p) * 65536.0 + 0.5;
  d.kept_threshold = t >= 65536.0 ? 65536u : static_cast<uint32_t>(t);
  d.key0 = static_cast<uint32_t>(seed);
  d.key1 = static_cast<uint32_t>(seed >> 32) + static_cast<uint32_t>(offset >> 32);
  d.offset_lo = static_cast<uint32_t>(offset);
  return d;
}

struct PhiloxWords {
  uint32_t w[4];
};

namespace philox_detail {
FC_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  lo = static_cast<uint32_t>(prod);
  hi = static_cast<uint32_t>(prod >> 32);
#endif
}
}  // namespace philox_detail

/** Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1). */
FC_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                         uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_detail::mulhilo(kMul0, c0, hi0, lo0);
    philox_detail::mulhilo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

/** Counter word 0 of the call that serves key column j (see the file comment). */
FC_HOST_DEVICE uint32_t dropout_column_group(int64_t j) {
  return static_cast<uint32_t>(((j >> 6) << 3) | (((j >> 1) & 3) << 1) | ((j >> 5) & 1));
}

/** The eight draws of column group `group` in row i of problem bh (b * heads_q + h). */
FC_HOST_DEVICE PhiloxWords dropout_draws(const DropoutParams& d, uint32_t group, int64_t i, int64_t bh) {
  return philox4x32_10(group, static_cast<uint32_t>(i), static_cast<uint32_t>(bh), d.offset_lo, d.key0, d.key1);
}

/** The 16-bit draw of key column j inside its group's words. */
FC_HOST_DEVICE uint32_t dropout_draw_of(const PhiloxWords& r, int64_t j) {
  return (r.w[(j >> 3) & 3] >> ((j & 1) * 16)) & 0xFFFFu;
}

/** Which key columns 64 * block .. 64 * block + 63 of row i of problem bh keep their probability:
 *  bit k of the result for column 64 * block + k (eight Philox calls; the CPU backends' form). */
FC_HOST_DEVICE uint64_t dropout_keep_bits(const DropoutParams& d, int64_t bh, int64_t i, int64_t block) {
  uint64_t bits = 0;
  for (uint32_t t = 0; t < 4; ++t) {
    for (uint32_t u = 0; u < 2; ++u) {
      const PhiloxWords r = dropout_draws(d, static_cast<uint32_t>(block << 3) | (t << 1) | u, i, bh);
      for (int w = 0; w < 4; ++w) {
        for (int half = 0; half < 2; ++half) {
          // Column 8n + 2t + half of the block, n = 4u + w (the file comment's grouping).
          const int column = (static_cast<int>(u) * 4 + w) * 8 + 2 * static_cast<int>(t) + half;
          if (((r.w[w] >> (16 * half)) & 0xFFFFu) < d.kept_threshold) bits |= uint64_t(1) << column;
        }
      }
    }
  }
  return bits;
}

/** True when entry (i, j) of problem bh keeps its probability. One Philox call per entry: for
 *  the reference and tests; kernels compute a group's words once and use dropout_draw_of. */
FC_HOST_DEVICE bool dropout_keeps(const DropoutParams& d, int64_t bh, int64_t i, int64_t j) {
  return dropout_draw_of(dropout_draws(d, dropout_column_group(j), i, bh), j) < d.kept_threshold;
}

}  // namespace flashcore
