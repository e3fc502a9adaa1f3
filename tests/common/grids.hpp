// The TESTING.md case grids, shared by every backend's test suite so each backend faces the same
// inputs. `scale` shrinks the grids for slow configurations (sanitizers) without removing a kind
// of case.
#pragma once

#include <vector>

#include "harness.hpp"

namespace flashcore::testing {

struct GridOptions {
  std::vector<int32_t> dtypes = {FC_DTYPE_F16, FC_DTYPE_BF16};
  std::vector<int64_t> head_dims = {64, 128};
  std::vector<int64_t> odd_head_dims = {40, 59, 80, 96, 111, 256};  // CPU: any; CUDA: multiples of 8
  bool large = false;  // include the 1k-2k seqlen pairs
};

/** seqlen pairs x causal x dtype, MHA/GQA alternating, head_dim alternating. */
std::vector<Case> grid_seqlens(const GridOptions& g);
/** Head dims (odd ones included), heads layouts (MHA, GQA 8/2, MQA 4/1). */
std::vector<Case> grid_shapes(const GridOptions& g);
/** Windows (left, right, both), softcap, causal with sq > sk and sq < sk, padded strides. */
std::vector<Case> grid_masks(const GridOptions& g);
/** Varlen batches with 0-length query and key sequences. */
std::vector<Case> grid_varlen(const GridOptions& g);
/** Paged K/V (a varlen forward through a block table): the varlen grid at each page size, plus
 *  softcap with a window over sequences spanning several pages. */
std::vector<Case> grid_paged(const GridOptions& g, const std::vector<int64_t>& page_sizes);
/** ALiBi slopes ((heads_q) and (batch, heads_q)) with causal masks at both alignments, a window,
 *  softcap, GQA, varlen batches with empty sequences, one query row, several key blocks. */
std::vector<Case> grid_alibi(const GridOptions& g);
/** Dropout (p = 0.17, 0.5, 0.9) with causal masks at both alignments, a window starting inside
 *  a 64-key block, softcap, ALiBi, GQA, MQA, padded strides, lengths off every tile size, one
 *  query row, fully masked rows, varlen batches with empty sequences; head dims from g, odd ones
 *  included. */
std::vector<Case> grid_dropout(const GridOptions& g);
/** Dropout over every dtype x head dim of `dims`: GQA 4 / 2, 200 x 333 keys at p = 0.17 and causal
 *  333 x 200 (rows before the first key) at p = 0.5; a softcap with a two-sided window (left
 *  `window_left`, right 9) over 150 x `window_keys` at p = 0.5; ALiBi (batch, heads_q) slopes,
 *  causal, MQA 4 / 1 at p = 0.17. Offsets count from first_offset (the causal-pair cases' past
 *  2^32). */
std::vector<Case> grid_dropout_matrix(const std::vector<int64_t>& dims, int64_t window_keys, int32_t window_left,
                                      uint64_t first_offset);
/** The dropout repeat tests' case (head_dim left to the caller): causal varlen, GQA 4 / 2,
 *  sequences of 130 x 300, 77 x 77 and 256 x 129 at p = 0.5. */
Case dropout_repeat_case();
/** Fully masked rows, seqlen_k = 0, huge logits. */
std::vector<Case> grid_edges(const GridOptions& g);

}  // namespace flashcore::testing
