// Dropout in the Hopper backward (backward.cuh, kernels instantiated with kDropout): which entries
// of a step's transposed score tile are kept, as a bit mask in shared memory.
//
// Why a mask in shared memory: common/dropout.hpp gives one Philox call the eight key columns
// 8n + 2t + {0, 1} (n = 4u .. 4u + 3) of ONE query row of a 64-key block, the columns a thread of
// an accumulator with queries as rows holds. The Hopper backward holds S^T (keys as the wgmma M,
// queries as N): a thread has two key rows (r, r + 8, r = 16 warp + group) and, per key, the
// query columns 8n + 2 quad + {0, 1}. The eight draws of one call then belong to four threads in
// two warps (keys 8n + 2t + h: warp n / 2, lane group 2t + h), each using two, so a thread drawing
// only its own entries would make each call four times (a shuffle exchange inside the warp still
// twice). Instead a warpgroup makes every call of its 64 keys x kRows queries exactly once (each
// thread whole calls: a query row's 32 keys of one half u, four calls), turns the draws into keep
// bits in the forward's orientation (one 32-bit word per query row and 32-key half, bit k = key
// 32u + k) and stores the words; after a barrier each thread reads, per group of 8 query columns,
// the two words of its columns and its two key bits of each. Cost per step and thread: kRows / 16
// Philox calls (4 at d128 and d256, 8 at d64), one 4-byte store per 4 calls and one 8-byte load per
// 8 query columns, the calls issued under the step's S^T and dP^T wgmmas.
//
// Word layout (kRows queries, two halves): word (u, q) at u * kHalfWords + ((q / 2) % 4) *
// kQuadStride + 2 (q / 8) + q % 2, so the two words of a reader's columns 8n + 2 quad + {0, 1}
// are adjacent (one 8-byte load) and the four quads of a warp read different banks (kQuadStride
// = kRows / 4 + 4: the quads' pairs start 20 (36) words apart, banks 0, 20, 8, 28 (0, 4, 8, 12)).
//
// Host and device (plain C++ when not compiled by nvcc), so that tests/cuda/test_cuda_dropout_
// sm90_backward.cpp checks the writer's and the reader's mapping against dropout_keeps on
// machines without a GPU.
#pragma once

#include <cstdint>

#include "common/dropout.hpp"
#include "common/host_device.hpp"

namespace flashcore::cuda::sm90 {

/** The keep-bit words of one 64-key block (an aligned Philox block: a consumer's keys) x kRows
 *  query rows of a step (see the file comment). */
template <int kRows>
struct DropoutMaskLayout {
  static_assert(kRows % 64 == 0, "whole query rows per writer thread: 2 kRows / 128 items each");
  static constexpr int kQuadStride = kRows / 4 + 4;
  static constexpr int kHalfWords = 4 * kQuadStride;
  static constexpr int kWords = 2 * kHalfWords;
  static constexpr uint32_t kBytes = static_cast<uint32_t>(kWords) * 4;
  /** Writer items (query row, 32-key half) per thread of a 128-thread warpgroup. */
  static constexpr int kItemsPerThread = 2 * kRows / 128;

  FC_HOST_DEVICE static int word(int half, int q) {
    return half * kHalfWords + ((q >> 1) & 3) * kQuadStride + 2 * (q >> 3) + (q & 1);
  }
  /** Writer item k of warpgroup thread t: query row q (step-relative) and key half u. */
  FC_HOST_DEVICE static int item_row(int t, int k) { return (t + 128 * k) % kRows; }
  FC_HOST_DEVICE static int item_half(int t, int k) { return (t + 128 * k) / kRows; }
};

/** The keep bits of keys 32 half .. 32 half + 31 of 64-key block `block` for query row `row` of
 *  problem bh: bit k for key 32 half + k of the block. Four Philox calls (t = 0..3), each
 *  serving keys 8 (4 half + w) + 2t + e from half e of word w. One 32-bit compare per draw
 *  (dropout_draw_kept), so kept_threshold = 65536 (keep all) needs no case. */
FC_HOST_DEVICE uint32_t dropout_half_row_bits(const DropoutParams& d, uint32_t bh, uint32_t row, uint32_t block,
                                              int half) {
  uint32_t bits = 0;
  // The four calls unrolled, so their rounds interleave (one call's 10 dependent multiply-XOR
  // rounds alone leave the issue slots idle): +1-3% on a training step with dropout (docs/PERF.md
  // session 45). With the keys computed per call they spilled; with the rounds' keys as
  // parameters only the d128 ALiBi kernels spill a few bytes more (4 -> 12, 144 -> 148).
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (uint32_t t = 0; t < 4; ++t) {
    // The rounds' keys come from the kernel's parameters (constant operands; computed per call
    // from key0 / key1 they were 20 additions, or 20 registers when the compiler hoisted them).
    const PhiloxWords r = philox4x32_10_rounds((block << 3) | (t << 1) | static_cast<uint32_t>(half), row, bh,
                                               d.offset_lo, d.round_keys);
    uint32_t call_bits = 0;  // keys 8w + {0, 1}, moved to 8w + 2t + {0, 1} below
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int w = 0; w < 4; ++w) {
      call_bits |= static_cast<uint32_t>(dropout_draw_kept(r.w[w], 0, d)) << (8 * w);
      call_bits |= static_cast<uint32_t>(dropout_draw_kept(r.w[w], 1, d)) << (8 * w + 1);
    }
    bits |= call_bits << (2 * t);
  }
  return bits;
}

/** The reader: a thread of a warpgroup whose accumulator holds key rows `key_local` and
 *  key_local + 8 (key_local = 16 warp + group, of the block's 64) and query columns 8j + 2 quad +
 *  {0, 1} gathers the keep bits of all its kRows / 2 accumulator registers into kRows / 64 words:
 *  bit i % 32 of word i / 32 for register i = 4j + r (r % 2: the column, r / 2: the key row).
 *  One 8-byte load per column group; the words then live in one or two registers through the
 *  step instead of the mask's address and reloads. */
template <int kRows>
FC_HOST_DEVICE void gather_keep_bits(const uint32_t* mask, int key_local, int quad, uint32_t (&bits)[kRows / 64]) {
  using L = DropoutMaskLayout<kRows>;
  const uint32_t* pairs = mask + (key_local >> 5) * L::kHalfWords + quad * L::kQuadStride;
  const int shift = key_local & 31;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kRows / 64; ++k) bits[k] = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < kRows / 8; ++j) {
#if defined(__CUDA_ARCH__)
    const uint2 w = *reinterpret_cast<const uint2*>(pairs + 2 * j);  // 8-byte aligned: see the layout
    const uint32_t even = w.x >> shift, odd = w.y >> shift;
#else
    const uint32_t even = pairs[2 * j] >> shift, odd = pairs[2 * j + 1] >> shift;
#endif
    // Registers 4j .. 4j + 3: (column even, key), (odd, key), (even, key + 8), (odd, key + 8).
    const uint32_t nibble = (even & 1u) | ((odd & 1u) << 1) | ((even >> 6) & 4u) | ((odd >> 5) & 8u);
    bits[j / 8] |= nibble << (4 * (j % 8));
  }
#if defined(__CUDA_ARCH__)
  // Opaque words: otherwise the compiler keeps the partial ORs above and tests each register's
  // bit in the smallest one holding it, several registers live (and spilled) through P^T and dS^T
  // instead of one.
#pragma unroll
  for (int k = 0; k < kRows / 64; ++k) asm volatile("" : "+r"(bits[k]));
#endif
}

/** Whether accumulator register i is kept, from gather_keep_bits' words. */
template <int kWords>
FC_HOST_DEVICE bool register_kept(const uint32_t (&bits)[kWords], int i) {
  return (bits[i / 32] >> (i % 32)) & 1u;
}

}  // namespace flashcore::cuda::sm90
