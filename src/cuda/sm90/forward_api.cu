// Backend functions of the Hopper forward (see api/backends.hpp): which calls it can serve (the
// TMA constraints on pointers and strides included), its workspace (none), and the dispatch from
// (dtype, head_dim) to the kernel units that cmake/cuda.cmake generated for sm_90a.
//
// Relies on: forward_run<Element, kHeadDim> explicitly instantiated in the generated sm90 units for
// every bucket/dtype whose FLASHCORE_HDIM_* / FLASHCORE_DTYPE_* macro is defined.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "api/backends.hpp"
#include "api/params.hpp"
#include "api/status.hpp"
#include "cuda/paged_gather.hpp"
#include "cuda/build_config.hpp"
#include "cuda/compiled_dispatch.cuh"
#include "cuda/forward_scores.hpp"
#include "cuda/sm90/attention_views.hpp"
#include "cuda/sm90/split_kv.hpp"

namespace flashcore::cuda {

namespace sm90 {
using forward_params_t = AttentionParams;
template <typename Element, int kHeadDim>
Status forward_run(const forward_params_t& p, void* workspace, size_t workspace_bytes);
}  // namespace sm90

namespace {

constexpr int kHopperCapability = 90;      // wgmma / setmaxnreg: sm_90a SASS runs on CC 9.0 only
constexpr int64_t kHeadDimAlignment = 8;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kSmallestBlockM = 128;  // of the ForwardConfigs tiles (most tiles)
constexpr int64_t kLargestBlockM = 192;   // (furthest TMA row coordinate)
constexpr int64_t kMaxTmaCoord = INT_MAX;  // TMA coordinates are int32

bool reject(Status* why, const std::string& message) {
  if (why != nullptr) *why = Status::unsupported("cuda_sm90: " + message);
  return false;
}

/** Keys per block of the tiles a paged call can get (ForwardConfigs: d64 and d128 128, d256 64; the
 *  80-key d128 tile is not chosen for pages of several blocks). */
constexpr int64_t kPagedBlockKeys = 128;
/** The smallest page read in place as one TMA box per page: 16 keys make 8 boxes per 128-key block
 *  and 64 columns (vLLM's default page); smaller pages are gathered. */
constexpr int64_t kMinBoxPageKeys = 16;
/** The largest head-dim bucket with kernels that read pages smaller than a block in place
 *  (sm90/forward.cuh, ForwardTraits::kPageBoxes: 128-key tiles). */
constexpr int64_t kMaxBoxPagesHeadDim = 128;
/** Pages of 16 keys read in place run the kernel ~20% slower than packed rows (8 boxes of 2 KiB per
 *  block and 64 columns; docs/PERF.md, session 29), while the gather copies batch x max_seqlen_k
 *  keys in and out once: in place only where the attention's FLOPs per gathered byte are below
 *  this (measured at GQA 32 / 8, d128: gathering 10-25% faster at ~960-3000, in place 20-38%
 *  faster at ~250, a short chunk against a long cache). Pages of 32 and 64 keys were faster in
 *  place at every measured shape. */
constexpr double kBoxPages16FlopsPerGatheredByte = 512;

/** Whether reading pages of 16 / 32 / 64 keys in place (one box per page) beats the gather. */
bool box_pages_pay(const AttentionParams& p) {
  if (p.pages.page_size > kMinBoxPageKeys) return true;
  // Keys a query row sees, on average: bottom-right causal rows see seqlen_k - seqlen_q / 2.
  const double keys = p.window_right == 0 ? p.seqlen_k - 0.5 * std::min(p.seqlen_q, p.seqlen_k) : double(p.seqlen_k);
  const double flops = 4.0 * double(p.heads_q) * double(p.head_dim) * double(p.total_q) * keys;
  const double gathered = 2.0 * double(paged_gather_bytes(p));  // read and written
  return flops < kBoxPages16FlopsPerGatheredByte * gathered;
}

/** Whether the kernel reads p's pages in place (TMA boxes from the pages, no gather): one page per
 *  sequence (a KV cache row: a box reaching past it reads zeros); pages of whole key blocks; or
 *  pages that divide a key block, one box each (16, 32 or 64 keys, head_dim <= 128, no softcap or
 *  dropout, where box_pages_pay); the last two with no first slot, so that a box never spans two pages; and the
 *  pages TMA-addressable. Otherwise the pages are gathered into packed rows first
 *  (cuda/paged_gather.hpp). */
bool reads_pages_in_place(const AttentionParams& p) {
  const KvPages& pg = p.pages;
  const bool whole_blocks = pg.page_size % kPagedBlockKeys == 0;
  // Pages that divide a block: by kernels of their own (sm90/forward.cuh, WithPageBoxes), compiled
  // for the 128-key tiles (d64 / d128), the plain softmax scale and no dropout only; other such
  // calls gather.
  const bool page_boxes = pg.page_size >= kMinBoxPageKeys && kPagedBlockKeys % pg.page_size == 0 &&
                          compiled_head_dim_bucket(p.head_dim) <= kMaxBoxPagesHeadDim &&
                          resolve_score_scales(p).transform == ScoreTransform::kFoldedScale &&
                          !p.dropout.enabled() && p.is_paged() && box_pages_pay(p);
  return p.is_paged() && (pg.per_seq == 1 || ((whole_blocks || page_boxes) && pg.first_slot == nullptr)) &&
         sm90::tma_addressable(p.k, false, pg.num_pages) && sm90::tma_addressable(p.v, false, pg.num_pages);
}

/** Workspace of the paged gather, when the pages are not read in place. */
size_t gather_bytes(const AttentionParams& p) { return reads_pages_in_place(p) ? 0 : paged_gather_bytes(p); }

template <typename Element, int kHeadDim>
struct ForwardEntry {
  static Status run(const AttentionParams& p, void* workspace, size_t workspace_bytes) {
    return sm90::forward_run<Element, kHeadDim>(p, workspace, workspace_bytes);
  }
};

}  // namespace

bool sm90_supports(const AttentionParams& p, Status* why) {
  if (p.dtype != DType::F16 && p.dtype != DType::BF16) return reject(why, "only fp16 and bf16 are supported");
#if !defined(FLASHCORE_DTYPE_FP16)
  if (p.dtype == DType::F16) return reject(why, "fp16 kernels are not compiled in (FLASHCORE_DTYPES)");
#endif
#if !defined(FLASHCORE_DTYPE_BF16)
  if (p.dtype == DType::BF16) return reject(why, "bf16 kernels are not compiled in (FLASHCORE_DTYPES)");
#endif
  if (p.head_dim <= 0 || p.head_dim > kMaxHeadDim || p.head_dim % kHeadDimAlignment != 0) {
    return reject(why, "head_dim " + std::to_string(p.head_dim) + " must be a multiple of 8 and at most 256");
  }
  // Dropout runs in kernels of their own on every route (sm90/forward.cuh, "Dropout"); pages
  // smaller than a key block are gathered for it (reads_pages_in_place).
  // ALiBi runs in the score-transform kernels, paged K/V too (pages smaller than a key block are
  // gathered for it, as for softcap: reads_pages_in_place).
  if (compiled_head_dim_bucket(p.head_dim) == 0) {
    return reject(why, "no compiled head-dim bucket holds head_dim " + std::to_string(p.head_dim) +
                           " (FLASHCORE_HEAD_DIMS)");
  }
  const bool varlen = p.is_varlen();
  // Paged k / v are read in place where the pages allow it (reads_pages_in_place), else first
  // gathered into packed rows in the workspace (cuda/paged_gather.hpp), at most batch x
  // max_seqlen_k of them, which the TMA maps then describe.
  const bool paged = p.is_paged();
  const bool gathered = paged && !reads_pages_in_place(p);
  // The gather's workspace grows with batch x max_seqlen_k; past kMaxGatherBytes, pages that
  // cuda_sm80 reads in place go there (AUTO) rather than asking for that much memory.
  constexpr size_t kMaxGatherBytes = size_t(4) << 30;
  if (gathered && paged_gather_bytes(p) > kMaxGatherBytes && p.pages.page_size % 256 == 0) {
    return reject(why, "paged k / v would need " + std::to_string(paged_gather_bytes(p)) +
                           " bytes of workspace to gather (more than 4 GiB); cuda_sm80 reads these pages in place");
  }
  const int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t k_rows = paged ? (gathered ? p.batch * p.seqlen_k : p.pages.page_size)
                               : (varlen ? p.total_k : p.seqlen_k);
  if (q_rows + kLargestBlockM > kMaxTmaCoord || k_rows + kLargestBlockM > kMaxTmaCoord) {
    return reject(why, "more than 2^31 - 193 rows do not fit TMA coordinates");
  }
  const int64_t m_blocks = (p.seqlen_q + kSmallestBlockM - 1) / kSmallestBlockM;
  if (p.heads_q > 0 && p.batch > 0 && m_blocks > INT_MAX / p.heads_q / p.batch) {
    return reject(why, "batch * heads_q * query blocks exceeds 2^31 - 1 tiles");
  }
  if (!sm90::tma_addressable(p.q, varlen, p.batch) ||
      (!paged && (!sm90::tma_addressable(p.k, varlen, p.batch) || !sm90::tma_addressable(p.v, varlen, p.batch)))) {
    return reject(why, "q, k and v need 16-byte aligned data and strides that are multiples of 8 "
                       "elements (TMA)");
  }
  // Same gap for out: 4-byte column-pair stores need even strides of single-extent dims too.
  if (p.out.row_stride % 2 != 0 || reinterpret_cast<uintptr_t>(p.out.data) % 4 != 0 ||
      p.out.head_stride % 2 != 0 || (!varlen && p.out.batch_stride % 2 != 0)) {
    return reject(why, "out needs 4-byte aligned data and even strides (column-pair stores)");
  }
  const int capability = compute_capability(p.device_id);
  if (capability != kHopperCapability) {
    return reject(why, "device " + std::to_string(p.device_id) + " has compute capability " +
                           std::to_string(capability) + "; the sm_90a kernels need exactly 9.0");
  }
  return true;
}

namespace {
/** The page gather's bytes rounded to where the split-KV partials start after them. */
size_t gather_bytes_aligned(const AttentionParams& p) { return (gather_bytes(p) + 255) / 256 * 256; }
}  // namespace

size_t sm90_forward_required_workspace(const AttentionParams& p) { return gather_bytes(p); }

sm90::ForwardSplit sm90_forward_split_plan(const AttentionParams& p) {
  AttentionParams seen = p;
  if (p.is_paged() && !reads_pages_in_place(p)) seen.pages = KvPages{};  // gathered into packed rows
  const int bucket = static_cast<int>(compiled_head_dim_bucket(p.head_dim));
  return sm90::plan_forward_split(seen, bucket, usable_multiprocessors(p.device_id, kFallbackSmCount, p.sm_margin));
}

size_t sm90_forward_workspace(const AttentionParams& p) {
  const size_t split = sm90_forward_split_plan(p).bytes;
  return split == 0 ? gather_bytes(p) : gather_bytes_aligned(p) + split;
}

Status sm90_forward(const AttentionParams& p, void* workspace, size_t workspace_bytes) {
  // The split-KV partials (sm90/split_kv.hpp) follow the gather's bytes; with less workspace than
  // sm90_forward_workspace reports, the call runs unsplit.
  const size_t before_split = gather_bytes_aligned(p);
  void* split_workspace = workspace != nullptr && workspace_bytes > before_split
                              ? static_cast<char*>(workspace) + before_split
                              : nullptr;
  const size_t split_bytes = split_workspace != nullptr ? workspace_bytes - before_split : 0;
  if (!p.is_paged() || reads_pages_in_place(p)) {
    return run_compiled<ForwardEntry>(p, split_workspace, split_bytes, "sm90 forward");
  }
  // Other paged k / v: gathered into packed rows in the workspace first (one O(N) copy on the
  // stream), then the packed varlen kernels.
  AttentionParams packed;
  const Status s = gather_pages(p, workspace, &packed);
  return s.is_ok() ? run_compiled<ForwardEntry>(packed, split_workspace, split_bytes, "sm90 forward") : s;
}

}  // namespace flashcore::cuda
