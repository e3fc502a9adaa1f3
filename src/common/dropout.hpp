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

// Philox4x32-10's multipliers and key increments (Salmon et al.).
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

/** One call's dropout, as the backends see it (AttentionParams::dropout). Made by make_dropout
 *  only: the derived fields below follow from the others, so setting one field by hand leaves the
 *  kernels' copies stale. */
struct DropoutParams {
  float p = 0.f;                 // probability of dropping; 0 = off
  float keep_scale = 1.f;        // 1 / (1 - p)
  uint32_t kept_threshold = 0;   // a 16-bit draw below this keeps the entry (round((1 - p) * 65536))
  uint32_t key0 = 0, key1 = 0;   // Philox key: seed low word, seed high word + offset high word
  uint32_t offset_lo = 0;        // counter word 3
  // Derived for the GPU kernels, which read these from their parameters (uniform registers and
  // constant operands) instead of computing them per call:
  // - kept_below_hi = kept_threshold * 65536 - 1: draw e of a word is kept when the word shifted so
  //   the draw is its high half (word << 16, or the word itself) is <= this; one compare per draw,
  //   no mask or shift of the word (kept_threshold 65536 gives 0xFFFFFFFF: every draw kept);
  // - round_keys[r] = the Philox key of round r, (key0 + r W0, key1 + r W1): 20 additions saved
  //   per call, and no key registers to keep live (philox4x32_10_rounds).
  uint32_t kept_below_hi = 0;
  uint32_t round_keys[10][2] = {};
  // Pads the derived fields to 96 bytes, a multiple of 16: the kernels' argument structs hold
  // AttentionParams (which ends with this struct) before fields of their own, and ptxas vectorizes
  // parameter loads by their alignment. Fields shifted by 84 bytes compiled the d64 Hopper
  // forward kernels WITHOUT dropout to +2-3% instructions; shifted by 96, to the same SASS.
  uint32_t alignment_pad[3] = {};

  FC_HOST_DEVICE bool enabled() const { return p > 0.f; }
};

static_assert(sizeof(DropoutParams) == 24 + 96, "the derived fields' 96 bytes keep later kernel arguments aligned");

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
  // kept_threshold is >= 1 here for any p < 1 - 2^-17; a threshold of 0 ("keeps nothing") is
  // refused by validation before a kernel could read the wrapped value.
  d.kept_below_hi = static_cast<uint32_t>((static_cast<uint64_t>(d.kept_threshold) << 16) - 1u);
  uint32_t k0 = d.key0, k1 = d.key1;
  for (int r = 0; r < 10; ++r) {
    d.round_keys[r][0] = k0;
    d.round_keys[r][1] = k1;
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
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
/** One Philox round on the counter words under the round's key (k0, k1). */
FC_HOST_DEVICE void one_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  mulhilo(kPhiloxMul0, c0, hi0, lo0);
  mulhilo(kPhiloxMul1, c2, hi1, lo1);
  const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
  c0 = n0;
  c1 = lo1;
  c2 = n2;
  c3 = lo0;
}
}  // namespace philox_detail

/** Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1). */
FC_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                         uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    philox_detail::one_round(c0, c1, c2, c3, k0, k1);
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

/** philox4x32_10 with its ten rounds' keys given (DropoutParams::round_keys): the GPU kernels'
 *  form. Read from a kernel's parameters, each key is a constant operand of the round's XOR, so
 *  a call is its 20 multiplies and 20 three-way XORs and holds no key registers. */
FC_HOST_DEVICE PhiloxWords philox4x32_10_rounds(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                const uint32_t (&round_keys)[10][2]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) philox_detail::one_round(c0, c1, c2, c3, round_keys[r][0], round_keys[r][1]);
  return {{c0, c1, c2, c3}};
}

/** Whether draw e (0: the low 16 bits, 1: the high) of a Philox word keeps its entry:
 *  draw < kept_threshold, as one 32-bit compare against kept_below_hi (the draw moved to the
 *  high half; the bits below it cannot lift it past kept_threshold * 65536 - 1). */
FC_HOST_DEVICE bool dropout_draw_kept(uint32_t word, int e, const DropoutParams& d) {
  return (e == 0 ? word << 16 : word) <= d.kept_below_hi;
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
