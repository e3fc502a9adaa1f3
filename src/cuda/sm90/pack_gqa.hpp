// When the Hopper forward packs the query heads of a GQA group into its tiles (host side, plain
// C++): a KV head's group of query heads becomes one head of seqlen_q x group rows, row r being
// query head kv_head * group + r % group of token r / group. A call with few query tokens (chunked
// prefill, speculative decoding, the KV-cache call's forward route) then fills its 128-row tiles
// with the group's rows instead of padding each head's few rows to a tile, and reads each K / V
// block once per group instead of once per query head.
//
// The kernels (sm90/forward.cuh, ForwardTraits::kPackGqa) read Q and write O through 5-D tensor
// maps (head_dim, group, tokens, heads_kv, batch) whose boxes hold whole tokens
// (attention_views.hpp's packed_group_view), so the group must divide a consumer's 64 rows.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "api/params.hpp"

namespace flashcore::cuda::sm90 {

/** A consumer warpgroup's rows: a packed box of O holds 64 / group tokens. */
constexpr int64_t kPackedRowsPerConsumer = 64;

/** log2 of x, a power of two. */
constexpr int log2_of_power_of_two(int64_t x) {
  int s = 0;
  while ((int64_t(1) << s) < x) ++s;
  return s;
}

/** Whether p's query heads can be packed by GQA group: a group of 2 to 64 that divides 64 (a power
 *  of two), and no ALiBi (its slope varies by query head, so by packed row). */
inline bool pack_gqa_fits(const AttentionParams& p) {
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return false;
  const int64_t group = p.heads_q / p.heads_kv;
  return group >= 2 && kPackedRowsPerConsumer % group == 0 && !p.has_alibi();
}

/** The share of `tiles` rows that hold query rows when `rows` rows are cut into tiles of block_m. */
inline double tile_fill(int64_t rows, int64_t block_m) {
  if (rows <= 0) return 1.0;
  const int64_t tiles = (rows + block_m - 1) / block_m;
  return double(rows) / double(tiles * block_m);
}

/** Whether the forward packs p: it fits and its packed tiles (block_m_packed rows) are at least
 *  1 / 0.9 as full as the tiles it would otherwise get (block_m_unpacked rows per query head),
 *  FlashAttention-3's rule. Sequences as long as a few tiles fill them either way and keep the
 *  unpacked kernels (and their wide tiles); a handful of tokens per head packs. Varlen calls are
 *  judged by max_seqlen_q. */
inline bool pack_gqa_pays(const AttentionParams& p, int64_t block_m_unpacked, int64_t block_m_packed) {
  if (!pack_gqa_fits(p) || p.seqlen_q <= 0) return false;
  const int64_t group = p.heads_q / p.heads_kv;
  return tile_fill(p.seqlen_q, block_m_unpacked) < 0.9 * tile_fill(p.seqlen_q * group, block_m_packed);
}

/** FLASHCORE_SM90_PACK_GQA=0 in the environment turns packing off (an A/B switch for
 *  dev/pack_gqa_bench.py; read once per process). */
inline bool pack_gqa_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHCORE_SM90_PACK_GQA");
    return v == nullptr || v[0] != '0';
  }();
  return enabled;
}

/** Whether the forward packs p: pack_gqa_pays, unless the environment turned packing off. */
inline bool pack_gqa_chosen(const AttentionParams& p, int64_t block_m_unpacked, int64_t block_m_packed) {
  return pack_gqa_enabled() && pack_gqa_pays(p, block_m_unpacked, block_m_packed);
}

}  // namespace flashcore::cuda::sm90
