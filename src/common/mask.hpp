// Which keys a query row may attend to: causal and sliding-window masks, as one rule.
//
// Semantics follow FlashAttention >= 2.1: masks are aligned to the bottom-right corner of the
// (seqlen_q x seqlen_k) score matrix, so query row i sits on "diagonal" key i + seqlen_k - seqlen_q.
// A window (left, right) admits key j when  diag - left <= j <= diag + right  (-1 = unbounded);
// causal is the window (left, 0). Every backend (CPU reference, CPU flash, CUDA) uses these
// helpers so the masks cannot drift apart.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashcore {

/** Half-open key interval [begin, end) a query row attends to; empty when begin >= end. */
struct KeyRange {
  int64_t begin;
  int64_t end;
  FC_HOST_DEVICE bool empty() const { return begin >= end; }
};

/** The mask of one (batch, head) problem: lengths and window, with causal folded in. */
struct MaskInfo {
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t window_left;   // -1 = unbounded
  int64_t window_right;  // -1 = unbounded (0 when causal)

  FC_HOST_DEVICE int64_t diagonal(int64_t row) const { return row + seqlen_k - seqlen_q; }

  /** Keys row `row` may attend to, clipped to [0, seqlen_k). */
  FC_HOST_DEVICE KeyRange keys_for_row(int64_t row) const {
    const int64_t diag = diagonal(row);
    int64_t lo = 0;
    int64_t hi = seqlen_k;
    if (window_left >= 0 && diag - window_left > lo) lo = diag - window_left;
    if (window_right >= 0 && diag + window_right + 1 < hi) hi = diag + window_right + 1;
    if (hi < lo) hi = lo;
    return {lo, hi};
  }

  /** Keys any row of [row_begin, row_end) may attend to (the union of keys_for_row). */
  FC_HOST_DEVICE KeyRange keys_for_rows(int64_t row_begin, int64_t row_end) const {
    const KeyRange first = keys_for_row(row_begin);
    const KeyRange last = keys_for_row(row_end - 1);
    // Both bounds are monotone non-decreasing in the row index.
    int64_t hi = last.end;
    int64_t lo = first.begin;
    if (hi < lo) hi = lo;
    return {lo, hi};
  }

  FC_HOST_DEVICE bool allowed(int64_t row, int64_t key) const {
    const KeyRange r = keys_for_row(row);
    return key >= r.begin && key < r.end;
  }

  /** True when every key of [key_begin, key_end) is allowed for every row of
   *  [row_begin, row_end): such a tile needs no per-element masking. */
  FC_HOST_DEVICE bool tile_fully_visible(int64_t row_begin, int64_t row_end, int64_t key_begin,
                                         int64_t key_end) const {
    // The tightest constraints come from the last row (left bound) and the first row (right).
    const KeyRange first = keys_for_row(row_begin);
    const KeyRange last = keys_for_row(row_end - 1);
    return key_begin >= last.begin && key_end <= first.end && row_end <= seqlen_q;
  }
};

}  // namespace flashcore
