// Dropout draws as the Hopper forward's wgmma m64nN fp32 accumulators hold them (forward.cuh,
// ForwardTraits::kDropout). Accumulator register i of a warpgroup thread (quad = lane % 4) holds
// row (i % 4) / 2 of the thread's two rows and key column 8 (i / 4) + 2 quad + (i % 2) of the key
// block; common/dropout.hpp gives the columns 8n + 2 quad + {0, 1}, n = 4u .. 4u + 3, of one
// 64-key block's half u to one Philox call, the eight draws of one thread in one row. So a thread
// makes one call per (row, 32 keys starting at a multiple of 32) and reads n-tile 4u + n's two
// draws from word n (low 16 bits: the even column): register i = 4 (4u + n) + 2 row + e, the
// same call and words as the sm80 kernels' (sm80/dropout_fragment.hpp, whose helpers these use).
// Tiles of 64 or 128 keys span whole 32-key halves, so no draw computed goes unused; tiles of 80
// keys (d128's three-consumer tile) would not, and dropout calls never take them.
//
// Host and device (plain C++ when not compiled by nvcc), so that
// tests/cuda/test_cuda_dropout_sm90_forward.cpp checks the mapping against dropout_keeps on
// machines without a GPU.
#pragma once

#include <cstdint>

#include "common/dropout.hpp"
#include "common/host_device.hpp"
#include "cuda/sm80/dropout_fragment.hpp"

namespace flashcore::cuda::sm90 {

/** The accumulator register of n-tile n (of the 4 in 32-key half u), thread row r (0: the row
 *  lane / 4 of the warp's 16, 1: that row + 8) and column parity e. */
FC_HOST_DEVICE constexpr int dropout_register(int u, int n, int r, int e) { return 4 * (4 * u + n) + 2 * r + e; }

/** The key column (within the key block) of accumulator register i for lane quad `quad`. */
FC_HOST_DEVICE constexpr int dropout_register_column(int i, int quad) { return 8 * (i / 4) + 2 * quad + (i % 2); }

/** The Philox counter words c1, c2 of a consumer thread's two rows (common/dropout.hpp): the
 *  in-sequence query row (pack-GQA kernels: the packed row's token) and b * heads_q + h (its
 *  query head). Below 2^32 by validate.cpp's limits, so 32-bit words are exact. */
struct DropoutRows {
  uint32_t row[2];
  uint32_t bh[2];
};

/** Zeroes the dropped entries of P in a thread's accumulator layout (s: kBlockN / 2 registers of
 *  one key block whose first key is key0, a multiple of 32) for the registers below kRegs (a
 *  multiple of 16: whole 32-key halves). One Philox call per (row, 32 keys), its four words used
 *  at once, so only they and the counter are live for a moment. One 32-bit compare per
 *  draw (dropout_draw_kept), so a threshold of 65536 needs no case. */
template <int kRegs, int kBlockRegs>
FC_HOST_DEVICE void drop_probabilities(float (&s)[kBlockRegs], const DropoutParams& d, const DropoutRows& rows,
                                       uint32_t key0, int quad) {
  static_assert(kRegs % 16 == 0 && kRegs <= kBlockRegs, "dropout draws cover whole 32-key halves");
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 2; ++r) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int u = 0; u < kRegs / 16; ++u) {
      const PhiloxWords words = sm80::dropout_quad_words(d, rows.bh[r], rows.row[r], key0 + 32u * u, quad);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int n = 0; n < 4; ++n) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int e = 0; e < 2; ++e) {
          float& x = s[dropout_register(u, n, r, e)];
          x = dropout_draw_kept(words.w[n], e, d) ? x : 0.f;
        }
      }
    }
  }
}

}  // namespace flashcore::cuda::sm90
