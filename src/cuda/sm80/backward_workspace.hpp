// Workspace layout of the sm80 backward, shared by the size query (backward_api.cu) and the
// launcher (backward.cuh) so the two cannot disagree. Plain C++: no CUDA headers needed.
//
//   [lse_log2 : heads_q * total_q fp32] [dsum : heads_q * total_q fp32]
//   [dq_accum : heads_q * dq rows * head-dim bucket fp32, non-deterministic mode only]
// Each region starts on a kWorkspaceAlign boundary (16-byte vector access needs at least that).
//
// dq_accum comes in two layouts. Row-major (the Hopper backward: total_q rows per head, row r at
// r * bucket) or tiled (the sm80 backward, DqTiles below): the sm80 kernel adds a 16 x 8 tile of
// its m16n8 accumulator fragments per warp instruction, and in the tiled layout the 32 lanes'
// values of one tile are 512 contiguous bytes. Row-major, the same instruction touched 8 rows
// (eight 128-byte lines for 256 bytes), and those reductions cost ~8% of a d128 training step
// (docs/PERF.md, sessions 51-52).
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/params.hpp"

namespace flashcore::cuda::sm80 {

/** The tiled dQ accumulator layout. Per query head, sequence b's rows start at the padded row
 *  16 * (first_packed_row / 16 + b): a multiple of 16 (a query block's 16-row fragment tiles are
 *  whole tiles there) and past the previous sequence's rows rounded up to 16 (so the padding
 *  rows of a sequence's last tile are its own; kernels add into them and nobody reads them). The
 *  rows are cut into 16 x 8 tiles, row-major over (row / 16, col / 8), 128 floats each, in which
 *  element (r, c) sits at the m16n8 fragment's slot: lane (r % 8) * 4 + c / 2, register
 *  c % 2 + 2 * (r / 8), stored at lane * 4 + register (sm_90: one 16-byte reduction per lane)
 *  or register * 32 + lane (before sm_90: scalar reductions, a warp's 32 on one 128-byte line). */
struct DqTiles {
  static constexpr int kRows = 16;
  static constexpr int kCols = 8;
  static constexpr int kElems = kRows * kCols;
  /** Padded rows per head: any clamped sequence layout fits (start + length <= total_q). */
  FC_HOST_DEVICE static int64_t rows_per_head(int64_t total_q, int64_t batch) {
    return kRows * ((total_q + kRows - 1) / kRows + batch + 1);
  }
  /** Padded row of sequence b's first row. */
  FC_HOST_DEVICE static int64_t sequence_row0(int64_t first_packed_row, int64_t b) {
    return kRows * (first_packed_row / kRows + b);
  }
  /** Offset of the tile holding (padded row, col) from its head's first element. */
  FC_HOST_DEVICE static int64_t tile_offset(int64_t row, int col, int head_dim_bucket) {
    return (row / kRows) * kRows * head_dim_bucket + (col / kCols) * kElems;
  }
  /** Offset of fragment register k (0..3) of `lane` inside a tile. */
  FC_HOST_DEVICE static int slot(int lane, int k, bool vector) { return vector ? lane * 4 + k : k * 32 + lane; }
};

struct BackwardWorkspaceLayout {
  static constexpr size_t kWorkspaceAlign = 256;
  size_t lse_log2_offset = 0;
  size_t dsum_offset = 0;
  size_t dq_accum_offset = 0;  // meaningful only when has_dq_accum
  bool has_dq_accum = false;
  bool dq_tiled = false;         // DqTiles (the sm80 backward) or row-major (the Hopper backward)
  int64_t dq_rows_per_head = 0;
  size_t total_bytes = 0;

  static size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

  /** head_dim_bucket: the compiled head dim the call runs with (>= p.head_dim); dq_tiled: the
   *  accumulator in DqTiles' layout. */
  static BackwardWorkspaceLayout make(const BackwardParams& p, int head_dim_bucket, bool dq_tiled) {
    BackwardWorkspaceLayout l;
    const size_t rows = static_cast<size_t>(p.heads_q) * static_cast<size_t>(p.total_q);
    const size_t stats_bytes = align_up(rows * sizeof(float));
    l.lse_log2_offset = 0;
    l.dsum_offset = stats_bytes;
    l.dq_accum_offset = 2 * stats_bytes;
    l.has_dq_accum = !p.deterministic;
    l.dq_tiled = dq_tiled;
    l.dq_rows_per_head = dq_tiled ? DqTiles::rows_per_head(p.total_q, p.batch) : p.total_q;
    const size_t dq_rows = static_cast<size_t>(p.heads_q) * static_cast<size_t>(l.dq_rows_per_head);
    const size_t dq_bytes =
        l.has_dq_accum ? align_up(dq_rows * static_cast<size_t>(head_dim_bucket) * sizeof(float)) : 0;
    l.total_bytes = 2 * stats_bytes + dq_bytes;
    return l;
  }
};

}  // namespace flashcore::cuda::sm80
