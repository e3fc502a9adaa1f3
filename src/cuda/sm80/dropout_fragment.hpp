// Dropout draws as the sm80 kernels' mma.sync m16n8k16 accumulators hold them (forward.cuh,
// backward_scores.cuh). A lane of a C fragment holds, in each of its rows, the key columns
// 8n + 2 quad and 8n + 2 quad + 1 (quad = lane % 4) of every 8-key n-tile; common/dropout.hpp
// gives exactly the columns 8n + 2 quad + {0, 1}, n = 4u .. 4u + 3, of one 64-key block's half u
// to one Philox call. So a lane computes one call per (row, 32 keys starting at a multiple of
// 32) and reads n-tile n's two draws from word n % 4: the low 16 bits for column 8n + 2 quad,
// the high 16 bits for the next one. No draw it computes goes unused when its tile spans whole
// 32-key halves.
//
// Host and device (plain C++ when not compiled by nvcc), so that tests/cuda/test_cuda_dropout.cpp
// checks this mapping against dropout_keeps on machines without a GPU.
#pragma once

#include <cstdint>

#include "common/dropout.hpp"
#include "common/host_device.hpp"

namespace flashcore::cuda::sm80 {

/** Counter word 0 of the Philox call of lane quad `quad` in the 32 keys starting at key32 (a
 *  multiple of 32): dropout_column_group(key32 + 2 * quad), without its 64-bit arithmetic. */
FC_HOST_DEVICE uint32_t dropout_quad_group(uint32_t key32, int quad) {
  return ((key32 >> 6) << 3) | (static_cast<uint32_t>(quad) << 1) | ((key32 >> 5) & 1u);
}

/** The eight draws of row `row` (in-sequence query row) of problem bh = b * heads_q + h for lane
 *  quad `quad` over keys key32 .. key32 + 31: word n belongs to n-tile key32 / 8 + n. */
FC_HOST_DEVICE PhiloxWords dropout_quad_words(const DropoutParams& d, uint32_t bh, uint32_t row, uint32_t key32,
                                              int quad) {
  return philox4x32_10_rounds(dropout_quad_group(key32, quad), row, bh, d.offset_lo, d.round_keys);
}

/** dropout_quad_words with the rounds' keys computed in the call from key0 / key1 (20 more
 *  additions): for kernels where ptxas, given the 20 keys as parameters, keeps them in registers
 *  across a loop and spills (the d128 dK / dV kernels with ALiBi: 48 -> 152 bytes). */
FC_HOST_DEVICE PhiloxWords dropout_quad_words_keyed(const DropoutParams& d, uint32_t bh, uint32_t row, uint32_t key32,
                                                    int quad) {
  return philox4x32_10(dropout_quad_group(key32, quad), row, bh, d.offset_lo, d.key0, d.key1);
}

}  // namespace flashcore::cuda::sm80
