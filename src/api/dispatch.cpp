// Backend registry: which backends exist, which one AUTO picks, and the single call path every
// public entry point goes through. Nothing here computes attention.
#include "api/dispatch.hpp"

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "api/backends.hpp"
#include "api/kvcache_backends.hpp"
#include "api/kvcache_forward_view.hpp"
#if defined(FLASHCORE_HAS_SM90)
#include "cuda/build_config.hpp"
#include "cuda/sm90/split_kv.hpp"
#endif

namespace flashcore {
namespace {

constexpr int kMinSm80Capability = 80;
constexpr int kSm90Capability = 90;  // sm_90a SASS runs on CC 9.0 only

#if defined(FLASHCORE_HAS_SM90)
constexpr bool kSm90Built = true;
#else
constexpr bool kSm90Built = false;
#endif

bool is_cuda_backend(fc_backend b) { return b == FC_BACKEND_CUDA_SM80 || b == FC_BACKEND_CUDA_SM90; }

/** AUTO's one exception to "a Hopper forward runs on cuda_sm90": a forward so small that the sm80
 *  backend's small-grid configuration (32-row query blocks, each block's keys split over 4 warp
 *  groups of one CTA; d64 / d128 buckets; its smem fits every CC 9.0 part) runs in one wave of
 *  CTAs. prefer_small_grid in src/cuda/sm80/forward.cuh takes that configuration up to two waves,
 *  so every call this rule sends there runs it. The sm90 kernel's 128-row tiles leave most SMs
 *  idle on such grids. H100, CUDA-graph replay, B=1 S=512, sm80 vs sm90: d64 fp16 H=8 (the seed
 *  shape) 7.0 vs 10.3 us, H=4 6.7 vs 10.0, causal H=8 6.7 vs 10.9; d128 bf16 H=8 9.6 vs 11.5. At
 *  two waves sm90 leads at d128 (H=16: 11.9 vs 17.9 us, and in all five shapes measured) and at
 *  d64 S=512 (H=16: 10.3 vs 12.3), sm80 only at d64 with long keys (S=4096 H=2: 42.0 vs 53.7), so
 *  the rule stops at one wave. Calls whose sm90 tiles split their key ranges over the idle SMs
 *  (sm90/split_kv.hpp: few tiles, long keys) into at least as many work items as the small grid
 *  has CTAs stay on sm90: the small grid streams each block's keys in one CTA (H200, one sequence
 *  against 64k keys, GQA 32 / 8 d128: 16 tokens 0.54 TB/s of K+V on it, 3.13 split on sm90;
 *  MHA d64 32 tokens x 32k keys 0.89 against 2.65; docs/PERF.md session 38). Splits into fewer
 *  items (square calls of 1k tokens over two heads: 2 splits, 32 items against 64 CTAs) leave
 *  the rule as it was: not measured against each other. */
enum class SmallGrid { kNo, kYes, kYieldsToSplit };

SmallGrid sm80_small_grid_rule(const AttentionParams& p) {
#if defined(FLASHCORE_HAS_SM90)
  constexpr int64_t kSmallGridBlockM = 32;  // SmallGridForwardTraits' query rows per CTA
  const int bucket = cuda::compiled_head_dim_bucket(p.head_dim);
  if (bucket != 64 && bucket != 128) return SmallGrid::kNo;
  if (p.dropout.enabled()) return SmallGrid::kNo;  // sm80 runs dropout on its dropout tiles, never the small grid
  const int64_t blocks = (p.seqlen_q + kSmallGridBlockM - 1) / kSmallGridBlockM * p.heads_q * p.batch;
  if (blocks > cuda::multiprocessor_count(p.device_id, 0) || !cuda::sm80_supports(p, nullptr)) return SmallGrid::kNo;
  // Pages sm80 would gather first (paged_gather.hpp) stay on sm90, which reads most of them in
  // place: the rule was measured on packed calls, and the gather's workspace is not in sm90's.
  if (cuda::sm80_forward_workspace(p) > 0) return SmallGrid::kNo;
  const cuda::sm90::ForwardSplit split = cuda::sm90_forward_split_plan(p);
  return split.splits > 1 && split.tiles * split.splits >= blocks ? SmallGrid::kYieldsToSplit : SmallGrid::kYes;
#else
  (void)p;
  return SmallGrid::kNo;
#endif
}

bool sm80_small_grid_preferred(const AttentionParams& p) { return sm80_small_grid_rule(p) == SmallGrid::kYes; }

namespace {
constexpr const char* kForwardQuery = "fc_attention_forward_workspace";
constexpr const char* kBackwardQuery = "fc_attention_backward_workspace";
}  // namespace

template <typename Args>
Status backend_checks(const AttentionParams& p, const Args& a, fc_backend backend, bool backward);

template <>
Status backend_checks(const AttentionParams& p, const ForwardArgs& a, fc_backend backend, bool) {
  const fc_attention_options* o = a.options;
  const fc_tensor* ts[] = {a.q,   a.k, a.v, a.out, a.lse, o ? o->cu_seqlens_q : nullptr, o ? o->cu_seqlens_k : nullptr,
                           o ? o->alibi_slopes : nullptr};
  const char* ns[] = {"q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"};
  return validate_for_backend(p, backend, ts, ns, 8);
}

template <>
Status backend_checks(const AttentionParams& p, const BackwardArgs& a, fc_backend backend, bool) {
  const fc_attention_options* o = a.options;
  const fc_tensor* ts[] = {a.dout, a.q, a.k, a.v, a.out, a.lse, a.dq, a.dk, a.dv,
                           o ? o->cu_seqlens_q : nullptr, o ? o->cu_seqlens_k : nullptr,
                           o ? o->alibi_slopes : nullptr};
  const char* ns[] = {"dout", "q",  "k",  "v",  "out", "lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                      "alibi_slopes"};
  return validate_for_backend(p, backend, ts, ns, 12);
}

fc_backend requested_backend(const fc_attention_options* o) {
  return o ? static_cast<fc_backend>(o->backend) : FC_BACKEND_AUTO;
}

}  // namespace

bool backend_available(fc_backend backend, int device_id) {
  switch (backend) {
    case FC_BACKEND_CPU_REFERENCE:
    case FC_BACKEND_CPU_FLASH: return true;
    case FC_BACKEND_CUDA_SM80:
      return device_id < cuda::device_count() && cuda::compute_capability(device_id) >= kMinSm80Capability;
    case FC_BACKEND_CUDA_SM90:
      return kSm90Built && device_id < cuda::device_count() &&
             cuda::compute_capability(device_id) == kSm90Capability;
    default: return false;
  }
}

namespace {

/** Whether the Hopper backend can serve the call, and if not why: the backward has rules of its
 *  own (32-bit row indexing, dout / dk / dv addressing). */
Status sm90_serves(const AttentionParams& p) {
  Status why;
  return cuda::sm90_supports(p, &why) ? Status::ok() : why;
}
Status sm90_serves(const BackwardParams& p) {
  Status why;
  return cuda::sm90_backward_supports(p, &why) ? Status::ok() : why;
}

template <class Params>
Status choose_backend_for(const Params& p, fc_backend requested, fc_backend* chosen) {
  fc_backend b = requested;
  if (b == FC_BACKEND_AUTO) {
    if (p.device_type != FC_DEVICE_CUDA) {
      b = FC_BACKEND_CPU_FLASH;
    } else if (backend_available(FC_BACKEND_CUDA_SM90, p.device_id) && sm90_serves(p).is_ok() &&
               !(std::is_same_v<Params, AttentionParams> && sm80_small_grid_preferred(p))) {
      b = FC_BACKEND_CUDA_SM90;  // Hopper kernels; anything they cannot serve goes to sm80
    } else {
      b = FC_BACKEND_CUDA_SM80;
    }
  }
  if (is_cuda_backend(b) && p.device_type == FC_DEVICE_CUDA && !backend_available(b, p.device_id)) {
    return Status::unsupported(std::string("backend: ") + fc_backend_name(b) + " is not available on cuda:" +
                               std::to_string(p.device_id) + " (not compiled in, no such device, or the GPU is "
                               "older than the backend needs); `flashcore info` lists what is available");
  }
  *chosen = b;
  return Status::ok();
}

}  // namespace

Status choose_backend(const AttentionParams& p, fc_backend requested, fc_backend* chosen) {
  return choose_backend_for(p, requested, chosen);
}
Status choose_backend(const BackwardParams& p, fc_backend requested, fc_backend* chosen) {
  return choose_backend_for(p, requested, chosen);
}

static bool takes_decode_route(const AttentionParams& p, const ForwardArgs& a, fc_backend chosen, KvCacheParams* kv);

/** Whether `backend`'s own kernels serve p, and if not why (the CPU backends serve every valid call). */
template <typename Params>
static Status backend_kernels_serve(const Params& p, fc_backend backend) {
  if (backend == FC_BACKEND_CUDA_SM80) {
    Status why;
    if (!cuda::sm80_supports(p, &why)) return why;
  }
  if (backend == FC_BACKEND_CUDA_SM90) return sm90_serves(p);
  return Status::ok();
}

template <typename Args, typename Params>
static Status prepare(const Args& a, bool workspace_query, Params* p, fc_backend* backend) {
  Status s;
  if constexpr (std::is_same_v<Args, ForwardArgs>) {
    s = validate_forward(a, workspace_query, p);
  } else {
    s = validate_backward(a, workspace_query, p);
  }
  if (!s.is_ok()) return s;
  constexpr bool kBackward = std::is_same_v<Args, BackwardArgs>;
  if (!(s = choose_backend(*p, requested_backend(a.options), backend)).is_ok()) return s;
  if (!(s = backend_checks(*p, a, *backend, kBackward)).is_ok()) return s;
  const Status served = backend_kernels_serve(*p, *backend);
  if constexpr (!kBackward) {
    // A forward AUTO hands to the decode path needs only that path: e.g. pages the portable
    // forward would gather into more than 4 GiB on a GPU without the Hopper forward.
    KvCacheParams kv;
    if (!served.is_ok() && takes_decode_route(*p, a, *backend, &kv)) return Status::ok();
  }
  return served;
}

/** A CUDA backend's run: its workspace checked, then the caller's device-side cu_seqlens check
 *  (error_flag; a kernel on the stream, so only for calls that passed every host check). */
template <class Params, class Kernel>
static Status run_cuda(const Params& p, size_t needed, void* workspace, size_t workspace_bytes, Kernel kernel,
                       const char* query) {
  Status s = check_workspace(needed, workspace, workspace_bytes, query);
  if (s.is_ok()) s = cuda::check_cu_seqlens_on_device(p);
  return s.is_ok() ? kernel(p, workspace, workspace_bytes) : s;
}

/** AUTO's decode route: a dense forward with a few query rows per KV head (decoding through
 *  flash_attn_func, as model code without a KV-cache API does it), or a varlen one whose
 *  max_seqlen_q makes as few (flash_attn_varlen_func's decoding and speculative decoding, packed or
 *  paged K/V), runs on the decode path, as the KV-cache call of the same tensors would
 *  (api/kvcache_forward_view.hpp).
 *  The GPU forward kernels' tiles hold 64-192 query rows: with a handful they stream K / V at a
 *  fraction of the memory's rate, one tile per (sequence, head) (cuda/decode/prefill_route.hpp
 *  has the rule and the numbers); cpu_flash's forward streams K / V once per query head
 *  (cpu/decode.cpp's rule). A backend the caller names runs the call itself. */
static bool takes_decode_route(const AttentionParams& p, const ForwardArgs& a, fc_backend chosen, KvCacheParams* kv) {
  if (requested_backend(a.options) != FC_BACKEND_AUTO) return false;
  if (chosen != FC_BACKEND_CPU_FLASH && !is_cuda_backend(chosen)) return false;
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return false;
  if (p.dropout.enabled()) return false;  // the decode kernels have no dropout
  if (p.is_varlen()) {
    if (p.pages.first_slot != nullptr) return false;
    *kv = varlen_forward_as_kvcache(p);
  } else {
    if (p.is_paged()) return false;
    *kv = forward_as_kvcache(p);
  }
  if (kv->capacity() > INT32_MAX) return false;  // the decode kernels count keys in int32
  return is_cuda_backend(chosen) ? cuda::decode_route_suits(*kv) : cpu::decode_route_suits(*kv);
}

bool forward_takes_decode_route(const ForwardArgs& a) {
  AttentionParams p;
  fc_backend b;
  KvCacheParams kv;
  return prepare(a, /*workspace_query=*/true, &p, &b).is_ok() && takes_decode_route(p, a, b, &kv);
}

Status check_workspace(size_t needed, const void* workspace, size_t workspace_bytes, const char* query) {
  constexpr uintptr_t kAlignment = 16;
  if (workspace != nullptr && workspace_bytes > 0 && reinterpret_cast<uintptr_t>(workspace) % kAlignment != 0) {
    return Status::invalid("workspace: its address must be " + std::to_string(kAlignment) +
                           "-byte aligned (the kernels store 16-byte vectors there)");
  }
  if (needed == 0) return Status::ok();
  if (workspace == nullptr || workspace_bytes < needed) {
    return Status::invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " +
                           std::to_string(needed) + " needed (query it with " + query + ")");
  }
  return Status::ok();
}

Status forward_workspace(const ForwardArgs& a, size_t* bytes) {
  AttentionParams p;
  fc_backend b;
  Status s = prepare(a, /*workspace_query=*/true, &p, &b);
  if (!s.is_ok()) return s;
  KvCacheParams kv;
  if (takes_decode_route(p, a, b, &kv)) {
    *bytes = is_cuda_backend(b) ? cuda::kvcache_workspace(kv) : 0;
    return Status::ok();
  }
  *bytes = b == FC_BACKEND_CUDA_SM80   ? cuda::sm80_forward_workspace(p)
           : b == FC_BACKEND_CUDA_SM90 ? cuda::sm90_forward_workspace(p)
                                       : 0;
  return Status::ok();
}

Status run_forward(const ForwardArgs& a, void* workspace, size_t workspace_bytes) {
  AttentionParams p;
  fc_backend b;
  Status s = prepare(a, false, &p, &b);
  if (!s.is_ok()) return s;
  // (Every CUDA path below may use a workspace it is given: its alignment first.)
  if (is_cuda_backend(b) && !(s = check_workspace(0, workspace, workspace_bytes, kForwardQuery)).is_ok()) return s;
  KvCacheParams kv;
  if (takes_decode_route(p, a, b, &kv)) {
    if (!is_cuda_backend(b)) return cpu::kvcache_forward(kv);
    // The split-KV partials are the route's only workspace: a caller that gives less than the
    // query reported (dense forwards needed none before the route) gets the forward kernels.
    const size_t needed = cuda::kvcache_workspace(kv);
    if (needed == 0 || (workspace != nullptr && workspace_bytes >= needed)) {
      if (!(s = cuda::check_cu_seqlens_on_device(p)).is_ok()) return s;  // varlen calls with an error flag
      return cuda::kvcache_forward(kv, workspace, workspace_bytes);
    }
    // Without the route's workspace the forward kernels run the call, where they serve it.
    if (!backend_kernels_serve(p, b).is_ok()) return check_workspace(needed, workspace, workspace_bytes, kForwardQuery);
  }
  // AUTO moved the call off sm80's small grid for sm90's split-KV: without the partials' workspace
  // sm90 would run it whole, where the small grid is faster.
  if (b == FC_BACKEND_CUDA_SM90 && requested_backend(a.options) == FC_BACKEND_AUTO &&
      (workspace == nullptr || workspace_bytes < cuda::sm90_forward_workspace(p)) &&
      sm80_small_grid_rule(p) == SmallGrid::kYieldsToSplit) {
    b = FC_BACKEND_CUDA_SM80;
  }
  switch (b) {
    case FC_BACKEND_CPU_REFERENCE: return cpu::reference_forward(p);
    case FC_BACKEND_CPU_FLASH: return cpu::flash_forward(p);
    case FC_BACKEND_CUDA_SM80:
      return run_cuda(p, cuda::sm80_forward_workspace(p), workspace, workspace_bytes, cuda::sm80_forward, kForwardQuery);
    case FC_BACKEND_CUDA_SM90:
      return run_cuda(p, cuda::sm90_forward_required_workspace(p), workspace, workspace_bytes, cuda::sm90_forward,
                      kForwardQuery);
    default: return Status::unsupported(std::string("backend: ") + fc_backend_name(b) + " cannot run forward");
  }
}

Status backward_workspace(const BackwardArgs& a, size_t* bytes) {
  BackwardParams p;
  fc_backend b;
  Status s = prepare(a, true, &p, &b);
  if (!s.is_ok()) return s;
  *bytes = b == FC_BACKEND_CUDA_SM80   ? cuda::sm80_backward_workspace(p)
           : b == FC_BACKEND_CUDA_SM90 ? cuda::sm90_backward_workspace(p)
                                       : 0;
  return Status::ok();
}

Status run_backward(const BackwardArgs& a, void* workspace, size_t workspace_bytes) {
  BackwardParams p;
  fc_backend b;
  Status s = prepare(a, false, &p, &b);
  if (!s.is_ok()) return s;
  switch (b) {
    case FC_BACKEND_CPU_REFERENCE: return cpu::reference_backward(p);
    case FC_BACKEND_CPU_FLASH: return cpu::flash_backward(p);
    case FC_BACKEND_CUDA_SM80:
      return run_cuda(p, cuda::sm80_backward_workspace(p), workspace, workspace_bytes, cuda::sm80_backward,
                      kBackwardQuery);
    case FC_BACKEND_CUDA_SM90:
      return run_cuda(p, cuda::sm90_backward_workspace(p), workspace, workspace_bytes, cuda::sm90_backward,
                      kBackwardQuery);
    default: return Status::unsupported(std::string("backend: ") + fc_backend_name(b) + " cannot run backward");
  }
}

}  // namespace flashcore
