// When the Hopper forward splits each query tile's key range (split-KV, sm90/forward.cuh), into how
// many parts, and the workspace the parts' fp32 partials take. Host-only: the workspace query
// (forward_api.cu) and the launch (forward_run) make the same plan, and the CPU tests check the
// split count's rule (forward_num_splits) without a GPU.
//
// The rule. A persistent CTA per SM takes one query tile at a time, so a call with fewer tiles than
// SMs leaves SMs idle: one sequence of 16 tokens against 64k keys with 8 KV heads (GQA packed) is 8
// tiles on 132 SMs. Cutting every tile's key blocks into s equal ranges makes s x tiles work items
// of equal cost; s = floor(SMs / tiles) fills one wave without a second, partial one. Each range
// keeps at least kMinKeyBlocksPerSplit key blocks (a CTA's start, its pipeline's fill and the
// partials' write and merge are paid per item), and calls with at least half as many tiles as SMs
// are left alone (two splits would make a second wave for some of them).
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "api/params.hpp"
#include "cuda/forward_scores.hpp"
#include "cuda/sm90/pack_gqa.hpp"

namespace flashcore::cuda::sm90 {

/** Paged K/V read in place in pages smaller than a 128-key block, one TMA box per page (the launcher
 *  admitted them: forward_api.cu's reads_pages_in_place), by the kernels that carry that path
 *  (ForwardTraits::kPageBoxes; they do not pack GQA groups). */
inline bool reads_page_boxes(const AttentionParams& p) {
  constexpr int64_t kBoxTileKeys = 128;  // ForwardTraits::kPageBoxes's tiles
  return p.is_paged() && p.pages.per_seq > 1 && p.pages.page_size < kBoxTileKeys;
}

inline constexpr int kMinKeyBlocksPerSplit = 4;
inline constexpr size_t kMaxForcedPartialBytes = size_t(1) << 30;  // plan_forward_split
inline constexpr int kMaxForwardSplits = 64;
/** Query rows of the tiles split kernels use: every bucket's two-consumer tile (ForwardConfigs'
 *  Narrow at d64 / d128, Tile at d256). */
inline constexpr int64_t kSplitTileRows = 128;

/** Keys per key block of those tiles. */
inline constexpr int64_t split_block_keys(int head_dim_bucket) { return head_dim_bucket <= 128 ? 128 : 64; }

/** Splits of every tile's key blocks for `tiles` query tiles over at most `key_blocks` key blocks
 *  each on `sms` SMs (1: no split). */
inline int forward_num_splits(int64_t tiles, int64_t key_blocks, int sms) {
  if (tiles <= 0 || sms <= 0 || 2 * tiles > sms) return 1;
  const int64_t by_sms = sms / tiles;
  const int64_t by_keys = key_blocks / kMinKeyBlocksPerSplit;
  const int64_t s = std::min({by_sms, by_keys, int64_t(kMaxForwardSplits)});
  return s >= 2 ? static_cast<int>(s) : 1;
}

/** FLASHCORE_SM90_SPLITS=n in the environment: n splits (at most one per key block) for every call
 *  a split kernel can take, 1 for none; unset, the rule. An A/B switch for measurements (read once
 *  per process). */
inline int forced_forward_splits() {
  static const int forced = [] {
    const char* v = std::getenv("FLASHCORE_SM90_SPLITS");
    return v == nullptr ? 0 : std::clamp(std::atoi(v), 0, kMaxForwardSplits);
  }();
  return forced;
}

/** A call's split-KV plan: its split count, whether its tiles pack the GQA group (as the split
 *  kernels choose, forward.cuh's dispatch_split: sm90/pack_gqa.hpp on 128-row tiles, except over
 *  page boxes), and the workspace of its partials. */
struct ForwardSplit {
  int splits = 1;
  bool packed = false;
  int64_t tiles = 0;   // query tiles (work items: tiles x splits)
  size_t o_bytes = 0;  // (splits, batch, seqlen_q, heads_q, head_dim) fp32 O / l
  size_t bytes = 0;    // o_bytes, then (splits, batch, heads_q, seqlen_q) fp32 lse
};

/** The plan for p on a device with `sms` SMs: p.num_splits where the caller set it (at most
 *  kMaxForwardSplits and one per key block), else the rule. Softcap, ALiBi and negative scales
 *  split too, in the score-transform kernels (forward.cuh's dispatch_split); ALiBi never packs. */
inline ForwardSplit plan_forward_split(const AttentionParams& p, int head_dim_bucket, int sms) {
  ForwardSplit plan;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.heads_kv <= 0) return plan;
  plan.packed = !(head_dim_bucket <= 128 && reads_page_boxes(p)) && pack_gqa_chosen(p, kSplitTileRows, kSplitTileRows);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t rows = plan.packed ? p.seqlen_q * group : p.seqlen_q;
  const int64_t heads = plan.packed ? p.heads_kv : p.heads_q;
  const int64_t tiles = (rows + kSplitTileRows - 1) / kSplitTileRows * heads * p.batch;
  plan.tiles = tiles;
  const int64_t block_keys = split_block_keys(head_dim_bucket);
  int64_t key_blocks = (p.seqlen_k + block_keys - 1) / block_keys;
  // A window bounded on both sides (causal is a right bound of 0) bounds every tile's keys: its
  // tokens plus the window's width, whatever seqlen_k.
  if (p.window_left >= 0 && p.window_right >= 0) {
    const int64_t tile_tokens = plan.packed ? std::max<int64_t>(1, kSplitTileRows / group) : kSplitTileRows;
    const int64_t span = std::min(p.seqlen_q, tile_tokens) + p.window_left + p.window_right;
    key_blocks = std::min(key_blocks, (span + block_keys - 1) / block_keys + 1);
  }
  // The caller's count (a KV-cache call's num_splits), else the environment's, else the rule. A
  // forced count takes at most kMaxForcedPartialBytes of partials (the rule's splits only come to
  // calls of few tiles, whose partials are small).
  int forced = p.num_splits > 0 ? std::min(p.num_splits, kMaxForwardSplits) : forced_forward_splits();
  if (forced > 1) {
    const double per_split = double(p.batch) * double(p.seqlen_q) * double(p.heads_q) * double(p.head_dim + 1) * 4.0;
    forced = static_cast<int>(std::clamp<double>(double(kMaxForcedPartialBytes) / per_split, 1.0, double(forced)));
  }
  plan.splits = forced > 0 ? static_cast<int>(std::clamp<int64_t>(key_blocks, 1, std::min<int64_t>(forced, INT_MAX / std::max<int64_t>(tiles, 1))))
                           : forward_num_splits(tiles, key_blocks, sms);
  if (plan.splits > 1) {
    const size_t rows_all = size_t(plan.splits) * size_t(p.batch) * size_t(p.seqlen_q) * size_t(p.heads_q);
    plan.o_bytes = (rows_all * size_t(p.head_dim) * sizeof(float) + 255) / 256 * 256;
    plan.bytes = plan.o_bytes + rows_all * sizeof(float);
  }
  return plan;
}

}  // namespace flashcore::cuda::sm90

namespace flashcore::cuda {
/** plan_forward_split on the call the Hopper forward's kernels will see: paged K/V that
 *  forward_api.cu gathers first are packed rows there (no page boxes, so GQA groups may pack).
 *  The workspace query, the launch and the routing rules all take this plan. Splits 1 where the
 *  sm90 kernels are not built. */
sm90::ForwardSplit sm90_forward_split_plan(const AttentionParams& p);
}  // namespace flashcore::cuda
