// cpu_flash backward: how a call splits each head's keys into tasks (backward_tasks.hpp runs
// them). A separate header because it needs no SIMD: the tests include it to check the rule.
#pragma once

#include <algorithm>
#include <cstdint>

#include "api/params.hpp"

namespace flashcore {
namespace cpu {
namespace backward_detail {

/** How a call splits each head's keys into tasks; choose_key_split picks it from the shapes. */
struct KeySplit {
  // Chunk boundaries and task rows fall on multiples of every kernel's key tile and query block.
  static constexpr int64_t kKeyAlign = 256;
  static constexpr int64_t kRowAlign = 128;
  int64_t chunks = 1;  // key chunks per (batch, query head); 1: one task per head, dQ written directly

  /** Keys per chunk of a sequence with seqlen_k keys (its last chunks may be short or empty). */
  int64_t chunk_keys(int64_t seqlen_k) const {
    const int64_t keys = std::max<int64_t>((seqlen_k + chunks - 1) / chunks, 1);
    return (keys + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
  }
};

/** Tasks a call's split aims at where B x H makes fewer: four per thread on a 16-core machine. */
constexpr int64_t kKeySplitTasksWanted = 64;

/** The split of a call, from its shapes alone: chunks of at least min_chunk_keys keys (what a
 *  kernel's per-task setup amortizes; 0 = never split) where B x H alone gives fewer than
 *  tasks_wanted tasks (dev/cpu_backward_sweep.cpp compares other counts); bounded in count and in
 *  the dQ partials' memory. */
KeySplit choose_key_split(const BackwardParams& p, int64_t min_chunk_keys,
                          int64_t tasks_wanted = kKeySplitTasksWanted);

/** A backward's shortest key chunk: `shipped`, unless the environment variable
 *  FLASHCORE_CPU_CHUNK_KEYS holds a number (read at every call; 0 = never split), so that the
 *  tests can split the short sequences of their grids. */
int64_t min_chunk_keys_or_env(int64_t shipped);

}  // namespace backward_detail
}  // namespace cpu
}  // namespace flashcore
