// Workspace layout of the sm80 backward, shared by the size query (backward_api.cu) and the
// launcher (backward.cuh) so the two cannot disagree. Plain C++: no CUDA headers needed.
//
//   [lse_log2 : heads_q * total_q fp32] [dsum : heads_q * total_q fp32]
//   [dq_accum : heads_q * total_q * head-dim bucket fp32, non-deterministic mode only]
// Each region starts on a kWorkspaceAlign boundary (16-byte vector access needs at least that).
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/params.hpp"

namespace flashcore::cuda::sm80 {

struct BackwardWorkspaceLayout {
  static constexpr size_t kWorkspaceAlign = 256;
  size_t lse_log2_offset = 0;
  size_t dsum_offset = 0;
  size_t dq_accum_offset = 0;  // meaningful only when has_dq_accum
  bool has_dq_accum = false;
  size_t total_bytes = 0;

  static size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

  /** head_dim_bucket: the compiled head dim the call runs with (>= p.head_dim). */
  static BackwardWorkspaceLayout make(const BackwardParams& p, int head_dim_bucket) {
    BackwardWorkspaceLayout l;
    const size_t rows = static_cast<size_t>(p.heads_q) * static_cast<size_t>(p.total_q);
    const size_t stats_bytes = align_up(rows * sizeof(float));
    l.lse_log2_offset = 0;
    l.dsum_offset = stats_bytes;
    l.dq_accum_offset = 2 * stats_bytes;
    l.has_dq_accum = !p.deterministic;
    const size_t dq_bytes = l.has_dq_accum ? align_up(rows * static_cast<size_t>(head_dim_bucket) * sizeof(float)) : 0;
    l.total_bytes = 2 * stats_bytes + dq_bytes;
    return l;
  }
};

}  // namespace flashcore::cuda::sm80
