// Backend functions of the portable tensor-core forward (see api/backends.hpp): which calls it can
// serve, its workspace (none, but for pages it gathers), and the dispatch from (dtype, head_dim) to the kernel units that
// cmake/cuda.cmake generated. A head_dim below a compiled bucket runs in the smallest compiled
// bucket above it; the kernel zero-fills the padded columns and never stores them.
//
// Relies on: forward_run<Element, kHeadDim> being explicitly instantiated in the generated units for
// every bucket/dtype whose FLASHCORE_HDIM_* / FLASHCORE_DTYPE_* macro is defined. This file only
// declares the template, so it stays cheap to compile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstddef>
#include <string>

#include "api/backends.hpp"
#include "api/params.hpp"
#include "api/status.hpp"
#include "cuda/build_config.hpp"
#include "cuda/compiled_dispatch.cuh"
#include "cuda/paged_gather.hpp"

namespace flashcore::cuda {

namespace sm80 {
using forward_params_t = AttentionParams;
template <typename Element, int kHeadDim>
Status forward_run(const forward_params_t& p, void* workspace, size_t workspace_bytes);
}  // namespace sm80

namespace {

constexpr int64_t kHeadDimAlignment = 8;   // one 16-byte chunk of fp16/bf16
constexpr int64_t kMaxHeadDim = 256;
constexpr int kMinComputeCapability = 80;  // mma.sync bf16, cp.async, ldmatrix
// Paged K/V are read in place where a key tile (at most 128 keys, at a multiple of its size) lies in
// one page, so that one table lookup places the whole tile (flash_attn's rule for its pages), or
// where a sequence has one page; other pages are first gathered into packed rows in the workspace
// (cuda/paged_gather.hpp), as the Hopper forward does, and the call runs as a packed varlen call.
constexpr int64_t kPagedPageMultiple = 256;
// The gather's workspace grows with batch x max_seqlen_k (K and V, 4 bytes a key and feature);
// past this a call asks for more memory than a caller would expect of an O(N) copy.
constexpr size_t kMaxGatherBytes = size_t(4) << 30;
// Must not exceed the smallest kBlockM of DefaultForwardTraits (grid size bound below). The
// small-grid configuration's 32-row blocks only run when their grid fits two waves of CTAs,
// so it stays far from the limit.
constexpr int64_t kSmallestBlockM = 128;
// The same for dropout calls: the smallest kBlockM of DropoutForwardTraits (forward.cuh).
constexpr int64_t kSmallestDropoutBlockM = 64;

bool dtype_compiled(DType dtype) {
  switch (dtype) {
#if defined(FLASHCORE_DTYPE_FP16)
    case DType::F16:
      return true;
#endif
#if defined(FLASHCORE_DTYPE_BF16)
    case DType::BF16:
      return true;
#endif
    default:
      return false;
  }
}

/** Whether the kernels read p's pages in place (see kPagedPageMultiple); else they are gathered.
 *  ALiBi with dropout is always gathered: the paged tiles have no instantiation with both (the
 *  packed dropout tiles take ALiBi). */
bool reads_pages_in_place(const AttentionParams& p) {
  if (p.has_alibi() && p.dropout.enabled()) return false;
  return p.pages.page_size % kPagedPageMultiple == 0 || p.pages.per_seq <= 1;
}

/** Whether p's pages are gathered into packed rows before the kernels run. */
bool gathers_pages(const AttentionParams& p) { return p.is_paged() && !reads_pages_in_place(p); }

bool reject(Status* why, const std::string& message) {
  if (why != nullptr) *why = Status::unsupported("cuda_sm80: " + message);
  return false;
}

template <typename Element, int kHeadDim>
struct ForwardEntry {
  static Status run(const AttentionParams& p, void* workspace, size_t workspace_bytes) {
    return sm80::forward_run<Element, kHeadDim>(p, workspace, workspace_bytes);
  }
};

}  // namespace

bool sm80_supports(const AttentionParams& p, Status* why) {
  if (p.dtype != DType::F16 && p.dtype != DType::BF16) {
    return reject(why, "only fp16 and bf16 are supported");
  }
  if (!dtype_compiled(p.dtype)) {
    return reject(why, std::string(p.dtype == DType::F16 ? "fp16" : "bf16") +
                           " kernels are not compiled in (FLASHCORE_DTYPES)");
  }
  if (p.head_dim <= 0 || p.head_dim > kMaxHeadDim || p.head_dim % kHeadDimAlignment != 0) {
    return reject(why, "head_dim " + std::to_string(p.head_dim) +
                           " must be a multiple of 8 and at most 256");
  }
  if (compiled_head_dim_bucket(p.head_dim) == 0) {
    return reject(why, "no compiled head-dim bucket holds head_dim " + std::to_string(p.head_dim) +
                           " (FLASHCORE_HEAD_DIMS)");
  }
  if (p.seqlen_q > INT_MAX || p.seqlen_k > INT_MAX) {
    return reject(why, "sequence lengths above 2^31 - 1 are not supported");
  }
  const int64_t block_m = p.dropout.enabled() ? kSmallestDropoutBlockM : kSmallestBlockM;
  const int64_t m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  if (p.heads_q > 0 && p.batch > 0 && m_blocks > INT_MAX / p.heads_q / p.batch) {
    return reject(why, "batch * heads_q * query blocks exceeds the grid limit");
  }
  if (gathers_pages(p) && paged_gather_bytes(p) > kMaxGatherBytes) {
    return reject(why, "paged k / v in pages of " + std::to_string(p.pages.page_size) + " keys would need " +
                           std::to_string(paged_gather_bytes(p)) + " bytes of workspace to gather (more than 4 GiB); "
                           "pages of a multiple of " + std::to_string(kPagedPageMultiple) +
                           " keys are read in place");
  }
  const int capability = compute_capability(p.device_id);
  if (capability < kMinComputeCapability) {
    return reject(why, "device " + std::to_string(p.device_id) + " has compute capability " +
                           std::to_string(capability) + ", sm_80 or newer is required");
  }
  return true;
}

size_t sm80_forward_workspace(const AttentionParams& p) { return gathers_pages(p) ? paged_gather_bytes(p) : 0; }

Status sm80_forward(const AttentionParams& p, void* workspace, size_t workspace_bytes) {
  if (!gathers_pages(p)) return run_compiled<ForwardEntry>(p, workspace, workspace_bytes, "sm80 forward");
  // The copy and the attention run on the caller's stream, one after the other; the packed call
  // needs no workspace of its own. (The API checked the workspace against sm80_forward_workspace;
  // a call without keys needs none, and gather_pages then copies nothing.)
  if (workspace_bytes < paged_gather_bytes(p))
    return Status::internal("sm80 forward: called without the page gather's workspace");
  AttentionParams packed;
  if (Status s = gather_pages(p, workspace, &packed); !s.is_ok()) return s;
  return run_compiled<ForwardEntry>(packed, nullptr, 0, "sm80 forward");
}

}  // namespace flashcore::cuda
