// Head pairs: the decode kernel reads a head-dim-64 cache two adjacent KV heads at a time.
//
// Why. The decode kernel's warps stream 16-key tiles, and a warp's rate is set by tiles, not by
// bytes: at d64 (4 KB tiles) it read 2.1-2.8 TB/s on an H200 where the same bytes as d128 rows
// (8 KB tiles) read 3.0-4.1, whatever the layout (heads inner or outer; docs/PERF.md, session 36,
// dev/decode_d64_probe.py). In the usual layout (..., heads_kv, 64) the two KV heads of a pair are
// one 128-wide row, so the d128 kernel can read them as one head:
// - the query rows of the pair's first head take q in dims [0, 64) and zeros in [64, 128), those
//   of its second head zeros then q; the kernel (kPaired) sums the two halves of Q K^T apart and
//   each row keeps its own head's half, so its scores are exactly its head's (the other half, q's
//   zeros times the other head's keys, is dropped: an inf there would make 0 x inf = NaN);
// - a row's output is its own half of the 128-wide O (the other half, P times the other head's V,
//   is dropped).
// The CTA then holds the query rows of both heads (2 x group x seqlen_q); pairs are taken only
// where those fit one CTA's 16 rows, so each key row is still read once per call.
// Plain C++: decode_api.cu builds the view, the kernel (decode_kernels.cuh) reads
// KvCacheParams::heads_paired, and the CPU tests check the rule and the view.
#pragma once

#include <cstdint>

#include "api/kvcache_params.hpp"
#include "common/env_switch.hpp"
#include "cuda/build_config.hpp"

namespace flashcore::cuda::decode {

struct HeadPairTraits {
  static constexpr int64_t kHeadDim = 64;  // the head dim that pairs (two make the 128 kernel's rows)
};

/** Whether the decode kernel reads p's cache in head pairs: head_dim 64 whose pairs' rows the
 *  128-wide kernel exists for (`wide_kernel_compiled`), an even number of KV heads stored side by
 *  side in both caches (head stride = head_dim), and both heads' query rows in one CTA of
 *  `cta_rows`. */
inline bool head_pairs_apply(const KvCacheParams& p, bool wide_kernel_compiled, int64_t cta_rows) {
  using H = HeadPairTraits;
  return wide_kernel_compiled && !p.heads_paired && p.head_dim == H::kHeadDim && p.heads_kv > 0 &&
         p.heads_kv % 2 == 0 && p.heads_q % p.heads_kv == 0 && p.k_cache.head_stride == H::kHeadDim &&
         p.v_cache.head_stride == H::kHeadDim && 2 * p.group_size() * p.seqlen_q <= cta_rows;
}

/** p as the decode kernel sees it in head pairs: half the KV heads, each twice as wide. */
inline KvCacheParams head_pair_view(const KvCacheParams& p) {
  KvCacheParams v = p;
  v.heads_kv = p.heads_kv / 2;
  v.head_dim = 2 * p.head_dim;
  v.k_cache.head_stride = 2 * p.k_cache.head_stride;
  v.v_cache.head_stride = 2 * p.v_cache.head_stride;
  v.heads_paired = true;
  return v;
}

/** FLASHCORE_DECODE_HEAD_PAIRS=0 in the environment turns head pairs off (an A/B switch for
 *  dev/decode_d64_probe.py; read once per process, so that a workspace query and its call agree). */
inline bool head_pairs_enabled() {
  static const bool enabled = env_mode("FLASHCORE_DECODE_HEAD_PAIRS") != '0';
  return enabled;
}

/** Whether this build has the 128-wide decode kernel head pairs run on (FLASHCORE_HDIM_128). */
#if defined(FLASHCORE_HDIM_128)
inline constexpr bool kPairKernelCompiled = true;
#else
inline constexpr bool kPairKernelCompiled = false;
#endif

/** head_pairs_apply with this build's kernels (head dim 64 in its own bucket, and the 128 bucket)
 *  and the environment's switch. */
inline bool head_pairs_chosen(const KvCacheParams& p, int64_t cta_rows) {
  const bool wide = kPairKernelCompiled && compiled_head_dim_bucket(p.head_dim) == HeadPairTraits::kHeadDim;
  return head_pairs_enabled() && head_pairs_apply(p, wide, cta_rows);
}

}  // namespace flashcore::cuda::decode
