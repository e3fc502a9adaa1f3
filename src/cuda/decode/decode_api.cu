// Host side of the CUDA inference path: the split heuristic, the workspace layout (partial O and
// LSE of split-KV), the supported-shape rules, and the launches (append -> attention -> combine),
// all on the caller's stream with no allocation and no synchronization, so a call can be captured
// in a CUDA graph. The compiled kernels follow FLASHCORE_HDIM_* / FLASHCORE_DTYPE_* (set by
// cmake/cuda.cmake): fp16/bf16 x head-dim buckets 64/128/256, a head_dim padded up to its bucket.
// Relies on: decode_kernels.cuh, api/kvcache_backends.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "api/kvcache_backends.hpp"
#include "cuda/build_config.hpp"
#include "cuda/decode/decode_kernels.cuh"
#include "cuda/decode/head_pairs.hpp"
#include "cuda/decode/prefill_route.hpp"
#include "cuda/decode/split_heuristic.hpp"
#include "cuda/programmatic_launch.hpp"
#include "cuda/scoped_device.hpp"


namespace flashcore::cuda {
namespace {
using decode::DecodeTraits;

struct HeuristicTraits {
  // The split model's constants (decode/split_heuristic.hpp). One warp's read rate: one 4-warp
  // CTA per SM read 3.04-3.08 TB/s on 132 SMs of an H100 and of an H200 (23.3 GB/s a CTA, d128),
  // with 2 to 4 tiles in flight per warp alike (docs/PERF.md session 33).
  static constexpr double kWarpReadRate = 23.3e9 / 4;
  // The share of the DRAM's peak (memory clock x bus width) a streaming read reaches: the read
  // ceilings bench/decode_bench.py measured, H100 3.07 of 3.35 TB/s, H200 4.21-4.32 of 4.8.
  static constexpr double kReadCeilingShare = 0.9;
  static constexpr int64_t kMinKeysPerSplit = 256;  // below this a split costs more than it hides
  static constexpr int kMaxSplits = 128;
  static constexpr int kDefaultSms = 132;        // when the device query fails
  static constexpr int kDefaultSmemPerSm = 228 * 1024;
  static constexpr int kSmemReservedPerCta = 1024;  // the driver's reserve per CTA
  static constexpr int kMaxCtasPerSm = 16;
  static constexpr int64_t kMaxGridYZ = 65535;
  static constexpr size_t kWorkspaceAlign = 256;
};

int64_t row_chunks(const KvCacheParams& p) {
  const int64_t rows = p.group_size() * p.seqlen_q;
  return (rows + DecodeTraits::kRows - 1) / DecodeTraits::kRows;
}

/** p as the attention kernel sees it: in head pairs where decode/head_pairs.hpp takes them, else
 *  p itself. The plan, the grid and the kernel's parameters come from this view; the append
 *  kernel, the workspace's partials and the merge keep the call's per-head shapes. */
KvCacheParams attention_view(const KvCacheParams& p) {
  return decode::head_pairs_chosen(p, DecodeTraits::kRows) ? decode::head_pair_view(p) : p;
}

/** What the host needs of an attention kernel's tile shape (decode::AttnTile). */
struct TileNumbers {
  int smem;             // dynamic shared memory
  int static_smem;      // static shared memory
  int warps;
};
template <int HD, int kWarps>
constexpr TileNumbers tile_numbers() {
  using Tl = decode::AttnTile<HD, kWarps>;
  return {Tl::kSmemBytes, Tl::kStaticSmemBytes, kWarps};
}

/** The 4-warp tile of p's head-dim bucket (every GPU the decode kernel supports holds it). */
TileNumbers narrow_tile(const KvCacheParams& p) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  return bucket <= 64 ? tile_numbers<64, 4>() : bucket <= 128 ? tile_numbers<128, 4>() : tile_numbers<256, 4>();
}

/** The tile p's attention runs with: decode::kWideWarps warps at head dims up to 128 where the
 *  device lets a block take their shared memory and one wave of them, one per SM, fills the SMs
 *  (decode::eight_warp_ctas_suit; the split count then keeps to that wave), else 4. Same process on
 *  an H200 (docs/PERF.md session 33), 8 warps against 4: 1 x 65536 (8 CTAs a split, 16 splits
 *  against 32) +2.9% to +3.2%, 16 x 8192 (128 CTAs, no split against 2) +2.0% to +4.6%; 64 x 2048
 *  (512 CTAs, 4 waves of 8 warps against 2 of two 4-warp CTAs per SM) -8% to -13%. */
TileNumbers attention_tile(const KvCacheParams& p, int64_t ctas, int sms) {
  const int bucket = compiled_head_dim_bucket(p.head_dim);
  if (decode::kWideWarps == 4 || bucket > 128) return narrow_tile(p);
  if (!decode::eight_warp_ctas_suit(ctas, p.num_splits, sms)) return narrow_tile(p);
  const TileNumbers wide = bucket <= 64 ? tile_numbers<64, decode::kWideWarps>() : tile_numbers<128, decode::kWideWarps>();
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device_id) != cudaSuccess) {
    cudaGetLastError();
    return narrow_tile(p);
  }
  return optin >= wide.smem + wide.static_smem ? wide : narrow_tile(p);
}

/** How p's attention (the decode kernel) runs, from one round of device queries shared by the
 *  workspace size and the launch: its tile, the SMs, how many of its CTAs one SM holds (shared
 *  memory bound), and the split count (the caller's num_splits, else the split model's). */
struct AttentionPlan {
  TileNumbers tile;
  int sms;
  int ctas_per_sm;
  int splits;
};
AttentionPlan plan_attention(const KvCacheParams& p) {
  using H = HeuristicTraits;
  AttentionPlan plan;
  plan.sms = usable_multiprocessors(p.device_id, H::kDefaultSms, p.sm_margin);
  const int64_t ctas = p.batch * p.heads_kv * row_chunks(p);  // of one split
  plan.tile = attention_tile(p, ctas, plan.sms);
  int smem_per_sm = 0;
  if (cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, p.device_id) != cudaSuccess ||
      smem_per_sm <= 0) {
    cudaGetLastError();
    smem_per_sm = H::kDefaultSmemPerSm;
  }
  const int per_cta = plan.tile.smem + plan.tile.static_smem + H::kSmemReservedPerCta;
  plan.ctas_per_sm = std::clamp(smem_per_sm / per_cta, 1, H::kMaxCtasPerSm);
  if (p.num_splits > 0) {
    plan.splits = p.num_splits;
    return plan;
  }
  // Device lengths are unknown on the host: size for the longest possible sequence.
  int64_t max_keys = p.longest_sequence > 0 ? std::min(p.capacity(), p.longest_sequence) : p.capacity();
  if (p.window_left >= 0 && p.window_right >= 0)
    max_keys = std::min(max_keys, p.window_left + p.window_right + p.seqlen_q);
  const int64_t by_length = std::max<int64_t>(1, (max_keys + H::kMinKeysPerSplit - 1) / H::kMinKeysPerSplit);
  decode::SplitModel m;
  m.ctas = std::max<int64_t>(1, ctas);
  m.max_splits = std::min<int64_t>(by_length, H::kMaxSplits);
  if (plan.tile.warps > 4) m.max_splits = std::max<int64_t>(1, std::min<int64_t>(m.max_splits, plan.sms / m.ctas));  // one wave
  m.sms = plan.sms;
  m.ctas_per_sm = plan.ctas_per_sm;
  m.cta_read_rate = plan.tile.warps * H::kWarpReadRate;
  m.read_rate = H::kReadCeilingShare * dram_peak_bytes_per_second(p.device_id);  // 0 when unknown
  plan.splits = decode::choose_num_splits(m);
  return plan;
}

bool dtype_compiled(DType t) {
#if defined(FLASHCORE_DTYPE_FP16)
  if (t == DType::F16) return true;
#endif
#if defined(FLASHCORE_DTYPE_BF16)
  if (t == DType::BF16) return true;
#endif
  return false;
}

size_t align_up(size_t x) {
  return (x + HeuristicTraits::kWorkspaceAlign - 1) / HeuristicTraits::kWorkspaceAlign * HeuristicTraits::kWorkspaceAlign;
}

size_t part_o_bytes(const KvCacheParams& p, int splits) {
  return align_up(sizeof(float) * size_t(splits) * p.batch * p.seqlen_q * p.heads_q * p.qo_head_dim());
}
size_t part_lse_bytes(const KvCacheParams& p, int splits) {
  return align_up(sizeof(float) * size_t(splits) * p.batch * p.heads_q * p.seqlen_q);
}
/** The rotated copy of q (batch, seqlen_q, heads_q, head_dim), contiguous, when the call has rotary
 *  tables (fp16 / bf16: 2 bytes an element). */
size_t rotated_q_bytes(const KvCacheParams& p) {
  return p.rotary.on() ? align_up(size_t(2) * p.batch * p.seqlen_q * p.heads_q * p.head_dim) : 0;
}
/** Split-KV partials (part_o, part_lse) when there are splits (the rotated q follows them). */
size_t split_bytes(const KvCacheParams& p, int splits) {
  return splits > 1 ? part_o_bytes(p, splits) + part_lse_bytes(p, splits) : 0;
}

Status launch_error(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return Status::cuda(std::string(what) + " launch failed: " + cudaGetErrorString(err));
}

/** kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the previous kernel
 *  on the stream when `programmatic_dependent` (cuda/programmatic_launch.hpp). */
template <typename... Params, typename... Args>
Status launch(const char* what, void (*kernel)(Params...), dim3 grid, int block, int smem, cudaStream_t stream,
              bool programmatic_dependent, Args&&... args) {
  const cudaError_t err = launch_kernel(kernel, grid, dim3(static_cast<unsigned>(block)), static_cast<size_t>(smem),
                                        stream, programmatic_dependent, std::forward<Args>(args)...);
  if (err != cudaSuccess) return Status::cuda(std::string(what) + " launch failed: " + cudaGetErrorString(err));
  return Status::ok();
}

template <typename OutT>
Status launch_merge(const MergeParams& m, bool programmatic_dependent = false) {
  const int64_t rows = m.batch * m.seqlen_q * m.heads;
  if (rows == 0) return Status::ok();
  // Past one batch of parts a row's warps share its parts (decode::merge_kernel).
  const bool parts_split = m.parts > DecodeTraits::kMergeBatch;
  const int64_t per_block = parts_split ? decode::merge_rows_per_cta<true>() : decode::merge_rows_per_cta<false>();
  const int64_t blocks = (rows + per_block - 1) / per_block;
  return launch("merge_partials", parts_split ? decode::merge_kernel<OutT, true> : decode::merge_kernel<OutT, false>,
                dim3(static_cast<unsigned>(blocks)), DecodeTraits::kMergeThreads, 0, static_cast<cudaStream_t>(m.stream),
                programmatic_dependent, m);
}

/** The attention kernel of p with kWarps warps per CTA (kPaired: p is a head-pair view). */
template <typename T, int HD, int kWarps, bool kPaired>
Status launch_attention(const KvCacheParams& p, const decode::SplitOutput& so, dim3 grid, cudaStream_t stream,
                        bool programmatic) {
  using Tl = decode::AttnTile<HD, kWarps>;
  auto* const kernel = p.has_alibi() ? decode::attention_kernel<T, HD, kWarps, true, kPaired>
                                     : decode::attention_kernel<T, HD, kWarps, false, kPaired>;
  // Per call (cheap, allowed during stream capture, and right for whichever device is current).
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::kSmemBytes) != cudaSuccess)
    return launch_error("kvcache attention (shared memory size)");
  return launch("kvcache attention", kernel, grid, Tl::kThreads, Tl::kSmemBytes, stream, programmatic, p, so);
}

/** Where the attention kernel of p puts its result under `plan`: partial O / LSE in the workspace
 *  when it splits (the merge combines them), else the output itself; and whether its CTAs warm L2
 *  before the wait. */
decode::SplitOutput split_output(const KvCacheParams& p, const AttentionPlan& plan, void* workspace,
                                 bool programmatic) {
  decode::SplitOutput so;
  so.num_splits = plan.splits;
  so.row_chunks = static_cast<int>(row_chunks(p));
  // Two tiles per warp warmed in L2 before the wait, where the CTAs wait for the previous call's
  // tail (a programmatic launch) and that tail is this call's last use of the memory system:
  // without splits, or with splits whose CTAs leave fewer free slots than there are SMs. With more
  // free, the next call's CTAs are placed on them while this call's attention still streams (its
  // combine kernel lets them launch), and their prefetch competes with it. Same process
  // (docs/PERF.md): without splits 64 x 2048 +1.3% to +1.9%, 16 x 8192 +0.3% (H100, session 26);
  // 4-warp CTAs, 1 x 65536 on an H100 (16 splits, 128 CTAs in 264 slots) -0.3% to -0.7%; on an
  // H200 (session 33, 256 CTAs in 264 slots) 1 x 65536 with 32 splits +2.3% to +2.6%, 16 x 8192
  // with 2 splits +1.1% to +1.2%; 4 tiles per warp gained less on both. 8-warp CTAs with splits
  // fill one wave (at most 5% of the SMs free) and take it for the same reason: against none, two
  // tiles +1.0% to +2.8% on every target cell (H200, session 42; one tile gained about half of
  // that, four 0.2-0.5% more at 1 x 65536 and up to 1.4% less at 64 x 2048). Requests for more
  // tiles after the wait (an L2 lookahead past the ring) queue with the first copies: -1% to -12%.
  const int64_t attention_ctas = int64_t(so.num_splits) * p.heads_kv * so.row_chunks * p.batch;
  const bool slots_filled = attention_ctas > int64_t(plan.sms) * (plan.ctas_per_sm - 1);
  so.prefetch_tiles = programmatic && (so.num_splits == 1 || slots_filled) ? 2 : 0;
  if (so.num_splits > 1) {
    so.part_o = static_cast<float*>(workspace);
    so.part_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + part_o_bytes(p, so.num_splits));
  }
  return so;
}

/** The attention kernel of p for `plan`'s tile (kWideWarps or 4 warps), writing `so`. */
template <typename T, int HD, bool kPaired = false>
Status launch_planned_attention(const KvCacheParams& p, const AttentionPlan& plan, const decode::SplitOutput& so,
                                cudaStream_t stream, bool programmatic) {
  const dim3 grid(static_cast<unsigned>(so.num_splits), static_cast<unsigned>(p.heads_kv * so.row_chunks),
                  static_cast<unsigned>(p.batch));
  if constexpr (HD <= 128 && decode::kWideWarps != 4) {
    if (plan.tile.warps == decode::kWideWarps)
      return launch_attention<T, HD, decode::kWideWarps, kPaired>(p, so, grid, stream, programmatic);
  }
  return launch_attention<T, HD, 4, kPaired>(p, so, grid, stream, programmatic);
}

/** The merge of a split attention's partials (`so`) into p's out and lse. */
MergeParams merge_params(const KvCacheParams& p, const decode::SplitOutput& so) {
  MergeParams m;
  m.out_dtype = p.dtype;
  m.device_type = p.device_type;
  m.device_id = p.device_id;
  m.out = p.out;
  m.lse = p.lse;
  set_dense_partials(m, so.num_splits, p.batch, p.seqlen_q, p.heads_q, p.qo_head_dim(), so.part_o, so.part_lse);
  m.out_cu_seqlens = p.q_cu_seqlens;
  m.out_rows = p.q_rows;
  if (p.q_cu_seqlens != nullptr) {
    // A varlen view's refs take packed rows as batches (varlen_forward_as_kvcache); the merge
    // adds the packed row itself. The forward's varlen out / lse have no batch stride.
    m.out.batch_stride = 0;
    m.lse.batch_stride = 0;
  }
  m.stream = p.stream;
  return m;
}

template <typename T, int HD>
Status run_typed(const KvCacheParams& call, void* workspace) {
  const cudaStream_t stream = static_cast<cudaStream_t>(call.stream);
  const bool programmatic = supports_programmatic_launch(call.device_id);
  // Many query rows: the forward kernels attend (decode/prefill_route.hpp), without splits.
  const bool prefill = decode::prefill_route_applies(call);
  const AttentionPlan plan = prefill ? AttentionPlan{} : plan_attention(attention_view(call));
  const int splits = prefill ? 1 : plan.splits;
  // With rotary tables the append kernel writes q rotated into the workspace, and the attention
  // reads that copy.
  KvCacheParams p = call;
  T* q_rotated = nullptr;
  if (call.rotary.on()) {
    q_rotated = reinterpret_cast<T*>(static_cast<char*>(workspace) + split_bytes(call, splits));
    p.q = {q_rotated, p.seqlen_q * p.heads_q * p.head_dim, p.heads_q * p.head_dim, p.head_dim};
  }
  const int64_t append_tokens = std::max<int64_t>(p.seqlen_new, q_rotated ? p.seqlen_q : 0);
  // (k_new may hold no token, even with a null data pointer: q still has to be rotated.)
  if ((p.appends() || q_rotated) && p.batch > 0 && append_tokens > 0) {
    const dim3 grid(static_cast<unsigned>(append_tokens), static_cast<unsigned>(p.batch),
                    static_cast<unsigned>(p.heads_kv + (q_rotated ? p.heads_q : 0)));
    Status s = launch("kvcache append", decode::append_kernel<T>, grid, DecodeTraits::kThreads, 0, stream, programmatic,
                      call, q_rotated);
    if (!s.is_ok()) return s;
  }
  if (p.batch == 0 || p.seqlen_q == 0) return Status::ok();
  if (prefill) {
    return decode::run_prefill_route(p, decode::prefill_route_on_hopper(call),
                                     static_cast<char*>(workspace) + rotated_q_bytes(call));
  }
  const KvCacheParams a = attention_view(p);
  const decode::SplitOutput so = split_output(a, plan, workspace, programmatic);
  Status s;
  if constexpr (HD == decode::HeadPairTraits::kHeadDim && decode::kPairKernelCompiled) {
    s = a.heads_paired ? launch_planned_attention<T, 2 * HD, true>(a, plan, so, stream, programmatic)
                       : launch_planned_attention<T, HD>(a, plan, so, stream, programmatic);
  } else {
    s = launch_planned_attention<T, HD>(a, plan, so, stream, programmatic);
  }
  if (!s.is_ok() || so.num_splits == 1) return s;
  return launch_merge<T>(merge_params(p, so), programmatic);
}

template <typename T>
Status run_dtype(const KvCacheParams& p, void* workspace) {
  switch (compiled_head_dim_bucket(p.head_dim)) {
#if defined(FLASHCORE_HDIM_64)
    case 64: return run_typed<T, 64>(p, workspace);
#endif
#if defined(FLASHCORE_HDIM_128)
    case 128: return run_typed<T, 128>(p, workspace);
#endif
#if defined(FLASHCORE_HDIM_256)
    case 256: return run_typed<T, 256>(p, workspace);
#endif
    default: return Status::internal("kvcache: no kernel for head_dim " + std::to_string(p.head_dim));
  }
}

}  // namespace

int kvcache_num_splits(const KvCacheParams& p) { return plan_attention(attention_view(p)).splits; }

size_t kvcache_workspace(const KvCacheParams& p) {
  if (decode::prefill_route_applies(p)) return rotated_q_bytes(p) + decode::prefill_route_workspace(p);
  return split_bytes(p, kvcache_num_splits(p)) + rotated_q_bytes(p);
}

bool kvcache_supports(const KvCacheParams& p, Status* why) {
  if (!dtype_compiled(p.dtype)) {
    *why = Status::unsupported("q: this dtype's CUDA KV-cache kernels are not compiled in (FLASHCORE_DTYPES)");
    return false;
  }
  if (compiled_head_dim_bucket(p.head_dim) == 0) {
    *why = Status::unsupported("q: head_dim " + std::to_string(p.head_dim) +
                               " has no compiled CUDA KV-cache kernel (FLASHCORE_HEAD_DIMS)");
    return false;
  }
  const TileNumbers tile = narrow_tile(p);
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device_id) == cudaSuccess &&
      optin > 0 && optin < tile.smem + tile.static_smem) {
    *why = Status::unsupported("q: head_dim " + std::to_string(p.head_dim) + ": the CUDA KV-cache kernel needs " +
                               std::to_string(tile.smem + tile.static_smem) +
                               " bytes of shared memory per block, this GPU offers " + std::to_string(optin));
    return false;
  }
  cudaGetLastError();
  // (The decode kernel's row chunks bound its grid; the prefill route's forward grid has its own.)
  const bool decode_grid_fits = p.heads_kv * row_chunks(p) <= HeuristicTraits::kMaxGridYZ || decode::prefill_route_applies(p);
  if (!decode_grid_fits) {  // the forward-kernel route declined a call too large for the decode kernel
    *why = Status::unsupported("q: this KV-cache call runs on the decode kernel, whose grid takes at most " +
                               std::to_string(HeuristicTraits::kMaxGridYZ) + " blocks of " +
                               std::to_string(DecodeTraits::kRows) + " query rows (heads_kv x heads_q / heads_kv x "
                               "seqlen_q rows make " + std::to_string(p.heads_kv * row_chunks(p)) +
                               " here); split seqlen_q into smaller chunks");
    return false;
  }
  if (p.batch > HeuristicTraits::kMaxGridYZ ||
      p.heads_kv + p.heads_q > HeuristicTraits::kMaxGridYZ || p.seqlen_new > INT32_MAX || p.seqlen_q > INT32_MAX) {
    *why = Status::unsupported("q: batch or heads exceed the CUDA grid limits (65535) of the KV-cache kernels");
    return false;
  }
  return true;
}

Status kvcache_forward(const KvCacheParams& p, void* workspace, size_t) {
  const ScopedDevice on_device(p.device_id);  // the tensors' GPU, whichever is current
  switch (p.dtype) {
#if defined(FLASHCORE_DTYPE_FP16)
    case DType::F16: return run_dtype<__half>(p, workspace);
#endif
#if defined(FLASHCORE_DTYPE_BF16)
    case DType::BF16: return run_dtype<__nv_bfloat16>(p, workspace);
#endif
    default: return Status::internal("kvcache: dtype not compiled");
  }
}

bool decode_route_suits(const KvCacheParams& p) {
  Status why;  // the rule first: it turns training-size calls away without a device query
  return decode::decode_kernel_suits(p) && kvcache_supports(p, &why);
}

Status merge_split_partials(const MergeParams& p, bool programmatic) {
  const ScopedDevice on_device(p.device_id);
  switch (p.out_dtype) {
    case DType::F32: return launch_merge<float>(p, programmatic);
    case DType::F16: return launch_merge<__half>(p, programmatic);
    case DType::BF16: return launch_merge<__nv_bfloat16>(p, programmatic);
    default: return Status::invalid("out: dtype int32 is not supported");
  }
}

Status merge_partials(const MergeParams& p) { return merge_split_partials(p, /*programmatic=*/false); }

}  // namespace flashcore::cuda
