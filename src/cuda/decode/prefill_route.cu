// The forward-kernel route of KV-cache calls with many query rows (prefill_route.hpp).
#include "cuda/decode/prefill_route.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "api/backends.hpp"
#include "api/kvcache_forward_view.hpp"
#include "cuda/build_config.hpp"
#include "cuda/decode/decode_kernels.cuh"
#include "cuda/decode/head_pairs.hpp"
#include "cuda/programmatic_launch.hpp"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/scoped_device.hpp"
#include "cuda/sm90/pack_gqa.hpp"
#include "cuda/sm90/split_kv.hpp"

namespace flashcore::cuda::decode {
namespace {

struct RouteTraits {
  // When the forward kernels take over (docs/PERF.md, session 27: GQA 32 / 8, d128, H100). The
  // decode kernel's rate stays at ~70-80 TFLOP/s whatever the query count; the forward's grows
  // with the rows that fill its 128-row blocks and with the blocks that fill the GPU: at 16 or 64
  // sequences it won from 64 query tokens (256 rows per KV head: 128 against 78 TFLOP/s) and lost
  // at 32 (66 against 77); with one sequence (32 blocks) it lost even at 128 tokens (42 against 83).
  static constexpr int64_t kMinRows = 256;
  // Where the Hopper forward packs the GQA group (sm90/pack_gqa.hpp), its tiles fill with the
  // group's rows and each K / V block is read once per group: the route then pays from 32 rows
  // per KV head, as long as the packed tiles fill most of the GPU (docs/PERF.md, session 34, GQA
  // 32 / 8, d128, H200; decode kernel ~70-79 TFLOP/s at every row count): 64 x 8 tokens 104-110
  // against 69, 16 x 8 105 against 74, 16 x 32 376-386 against 75; 4 sequences (32 tiles) lost at
  // 8 tokens (33-36 against 60-62), tied at 16 and won from 32 (136-145 against 79); 2 and 4
  // tokens lost everywhere. Taken when (rows' share of their tiles) x (tiles / SMs, at most 1) is
  // at least kMinPackedShare and there are kMinPackedRows rows. Share 0.12 (8 x 8 tokens, 4096
  // keys, session 35: the forward 2.62 TB/s against 2.26; 4 x 16 tokens above: a tie) takes it.
  // Where the Hopper forward splits its tiles' keys (sm90/split_kv.hpp: tiles short of the SMs
  // against a long cache), the tiles count times their splits.
  static constexpr int64_t kMinPackedRows = 32;
  static_assert(kMinPackedRows <= kMinRows, "prefill_route_applies returns early below the packed rule");
  static constexpr double kMinPackedShare = 0.1;
  static constexpr int kThreads = 256;
  static constexpr size_t kAlign = 256;
  static constexpr int64_t kLargestCtaRows = 128;  // the forward's kBlockM: the grid-size bound
};

size_t align_up(size_t x) { return (x + RouteTraits::kAlign - 1) / RouteTraits::kAlign * RouteTraits::kAlign; }

/** Workspace: cu_seqlens_q, cu_seqlens_k (batch + 1 each), the identity table (batch), marks. */
struct RouteArrays {
  int32_t *cu_q, *cu_k, *identity, *bad;
};
/** Bytes of one prefix-sum array and of one per-sequence array (each aligned). */
size_t cu_bytes(int64_t batch) { return align_up(sizeof(int32_t) * size_t(batch + 1)); }
size_t per_seq_bytes(int64_t batch) { return align_up(sizeof(int32_t) * size_t(batch)); }

RouteArrays arrays_in(void* workspace, int64_t batch) {
  char* at = static_cast<char*>(workspace);
  const size_t cu = cu_bytes(batch), per_seq = per_seq_bytes(batch);
  return {reinterpret_cast<int32_t*>(at), reinterpret_cast<int32_t*>(at + cu),
          reinterpret_cast<int32_t*>(at + 2 * cu), reinterpret_cast<int32_t*>(at + 2 * cu + per_seq)};
}

/** One CTA: each sequence's key count (0, and marked, when its indices break the rules the
 *  decode kernel checks), then the prefix sums; the identity table of contiguous caches. A
 *  programmatic dependent (cuda/programmatic_launch.hpp): the kernel before it may write the
 *  lengths and tables it reads, or still read the workspace it writes. */
__global__ void __launch_bounds__(RouteTraits::kThreads) build_kernel(KvCacheParams p, RouteArrays a) {
  ptx::wait_previous_grid();
  ptx::allow_next_grid();  // the forward's CTAs set up while this runs; they wait for its arrays
  constexpr int kThreads = RouteTraits::kThreads;
  __shared__ int64_t partial[kThreads];
  const int64_t per_thread = (p.batch + kThreads - 1) / kThreads;
  const int64_t b0 = threadIdx.x * per_thread, b1 = min(p.batch, b0 + per_thread);
  int64_t sum = 0;
  bool any_bad = false;
  for (int64_t b = b0; b < b1; ++b) {
    bool ok = sequence_in_bounds(p, b);
    if (ok && p.paged) {
      const int64_t pages = (cache_end(p, b) + p.seqlen_new + p.page_size - 1) / p.page_size;
      for (int64_t pg = 0; pg < pages && ok; ++pg) ok = page_in_range(p, physical_page(p, b, pg));
    }
    a.bad[b] = ok ? 0 : 1;
    any_bad = any_bad || !ok;
    sum += ok ? total_len(p, b) : 0;
    a.identity[b] = static_cast<int32_t>(b);
    a.cu_q[b] = static_cast<int32_t>(b * p.seqlen_q);
  }
  partial[threadIdx.x] = sum;
  if (__syncthreads_or(any_bad) && threadIdx.x == 0 && p.error_flag) *p.error_flag = 1;
  if (threadIdx.x == 0) {
    int64_t running = 0;
    for (int i = 0; i < kThreads; ++i) {
      const int64_t x = partial[i];
      partial[i] = running;
      running += x;
    }
    a.cu_q[p.batch] = static_cast<int32_t>(p.batch * p.seqlen_q);
    a.cu_k[p.batch] = static_cast<int32_t>(running < INT_MAX ? running : INT_MAX);
  }
  __syncthreads();
  int64_t running = partial[threadIdx.x];
  for (int64_t b = b0; b < b1; ++b) {
    a.cu_k[b] = static_cast<int32_t>(running < INT_MAX ? running : INT_MAX);
    running += a.bad[b] ? 0 : total_len(p, b);
  }
}

/** Block b: NaN into the out and lse rows of a marked sequence, after the forward wrote them (a
 *  programmatic dependent of it). */
__global__ void __launch_bounds__(RouteTraits::kThreads) poison_kernel(KvCacheParams p, const int32_t* bad) {
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  const int64_t b = blockIdx.x;
  if (!bad[b]) return;
  const float nan = __int_as_float(0x7fc00000);
  const int64_t per_row = p.heads_q * p.head_dim;
  for (int64_t e = threadIdx.x; e < p.seqlen_q * per_row; e += blockDim.x) {
    const int64_t i = e / per_row, h = (e % per_row) / p.head_dim, d = e % p.head_dim;
    const int64_t at = offset_of(p.out, b, i, h) + d;
    if (p.dtype == DType::BF16) {
      static_cast<__nv_bfloat16*>(p.out.data)[at] = __float2bfloat16(nan);
    } else {
      static_cast<__half*>(p.out.data)[at] = __float2half(nan);
    }
  }
  if (p.lse.data)
    for (int64_t e = threadIdx.x; e < p.seqlen_q * p.heads_q; e += blockDim.x) {
      const int64_t h = e / p.seqlen_q, i = e % p.seqlen_q;
      p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = nan;
    }
}

/** Whether p is a plain dense forward: contiguous caches whose rows are full (no cache_seqlens),
 *  sequence b on cache row b (no cache_batch_idx, no left padding), nothing appended. The route then
 *  builds no arrays and checks no indices (there are none): no kernel runs before or after the
 *  forward, which also warms L2 with its first tiles before its programmatic wait (varlen calls,
 *  whose rows the kernel before builds, cannot). */
bool dense_call(const KvCacheParams& p) {
  return !p.paged && p.cache_seqlens == nullptr && p.cache_batch_idx == nullptr && p.cache_leftpad == nullptr &&
         !p.appends() && !p.rotary.on() && p.q_cu_seqlens == nullptr;
}

/** The same call as a forward: dense (dense_call), else a varlen forward over paged K/V
 *  (api/kvcache_forward_view.hpp) on the route's arrays, ALiBi slopes included. */
AttentionParams forward_params(const KvCacheParams& p, const RouteArrays& a) {
  AttentionParams f = kvcache_as_forward(p, {a.cu_q, a.cu_k, a.identity});
  if (dense_call(p)) {  // q, out, lse as given; cache row b holds sequence b's seqlen_k keys
    f.q = p.q;
    f.out = p.out;
    f.lse = p.lse;
    f.cu_seqlens_q = f.cu_seqlens_k = nullptr;
    f.total_q = p.batch * p.seqlen_q;
    f.total_k = p.batch * f.seqlen_k;
    f.pages = KvPages{};
  }
  return f;
}

/** The most workspace the route asks for to gather pages for the Hopper forward (pages it cannot
 *  read in place: smaller than a key block); past it, the call stays on the decode kernel. Below
 *  the Hopper forward's own 4 GiB bound (forward_api.cu), as a KV-cache call's workspace is
 *  allocated per call. */
constexpr size_t kMaxRouteGatherBytes = size_t(1) << 30;

/** Whether the Hopper forward takes f, the forward view of p: the caller did not ask for the
 *  portable kernels (KvCacheParams::portable_kernels), the GPU and the call suit it
 *  (sm90_supports), q and out are contiguous across the batch (their packed views have no gap
 *  between sequences), as its varlen TMA maps of q and out assume, and pages it cannot read in
 *  place need at most kMaxRouteGatherBytes of gather workspace (a copy of batch x capacity keys,
 *  O(N) next to the attention). */
bool hopper_takes(const KvCacheParams& p, const AttentionParams& f) {
  if (p.portable_kernels) return false;
  const bool rows_packed = !f.is_varlen() || f.batch == 1 || (f.q.batch_stride == 0 && f.out.batch_stride == 0);
  return rows_packed && sm90_supports(f, nullptr) &&
         sm90_forward_required_workspace(f) <= kMaxRouteGatherBytes;
}

/** f with placeholder arrays: for the rules and the workspace size, which read only their presence
 *  (a call without cache_seqlens, the forward's decode route, has no device array to point at). */
AttentionParams shape_params(const KvCacheParams& p) {
  static int32_t never_read;
  int32_t* placeholder = &never_read;
  return forward_params(p, {placeholder, placeholder, placeholder, placeholder});
}

/** shape_params with the forward's own split rule: which kernels take a call does not depend on the
 *  caller's num_splits, which sets only how the chosen forward splits (a count forced on a call with
 *  many tiles would otherwise move it from the decode kernel onto a route measured for few). */
AttentionParams rule_params(const KvCacheParams& p) {
  AttentionParams f = shape_params(p);
  f.num_splits = 0;
  return f;
}

/** The route's own arrays (arrays_in), before the forward's workspace; none for dense calls. */
size_t arrays_bytes(const KvCacheParams& p) {
  return dense_call(p) ? 0 : 2 * cu_bytes(p.batch) + 2 * per_seq_bytes(p.batch);
}

/** Whether the route pays for a call whose Hopper forward packs the GQA group: `rows` packed rows
 *  per KV head, `heads` = batch x heads_kv of them, or the work items of the forward's split-KV
 *  plan where it splits (sm90/split_kv.hpp; RouteTraits::kMinPackedShare). */
bool packed_route_pays(int64_t rows, int64_t heads, const sm90::ForwardSplit& split, int sms) {
  using R = RouteTraits;
  if (rows < R::kMinPackedRows) return false;
  const double tiles = split.splits > 1 ? double(split.tiles) * double(split.splits)
                                        : double(heads) * double((rows + R::kLargestCtaRows - 1) / R::kLargestCtaRows);
  const double occupancy = std::min(1.0, tiles / double(sms));
  return sm90::tile_fill(rows, R::kLargestCtaRows) * occupancy >= R::kMinPackedShare;
}

}  // namespace

bool prefill_route_applies(const KvCacheParams& p) {
  using R = RouteTraits;
  const int64_t rows = p.group_size() * p.seqlen_q;  // per KV head
  if (rows < R::kMinPackedRows || p.seqlen_q > INT_MAX) return false;  // below both rules
  if (p.q_cu_seqlens != nullptr) return false;  // a varlen forward's view: it came from the forward
  // (ALiBi calls take it too: the forward kernels add the bias over paged K/V, by the key's place in
  // its sequence after cache_leftpad, as the decode kernel does; they never pack the GQA group.)
  // cu_seqlens_k is int32: every sequence's keys together must fit it.
  if (p.capacity() > INT_MAX || p.batch * p.capacity() > INT_MAX) return false;
  const int64_t blocks = (p.seqlen_q + R::kLargestCtaRows - 1) / R::kLargestCtaRows;
  if (p.batch * p.heads_q > INT_MAX / blocks) return false;
  constexpr int kDefaultSms = 132;
  const int sms = multiprocessor_count(p.device_id, kDefaultSms);
  // The forward kernels' own rules (sm80: pages of 256k keys in place; sm90: any, gathered where
  // they are smaller than a key block), before anything is launched.
  const AttentionParams f = rule_params(p);
  const bool hopper = hopper_takes(p, f);
  // The Hopper forward's split-KV multiplies its tiles (sm90/split_kv.hpp).
  const sm90::ForwardSplit split = hopper ? sm90_forward_split_plan(f) : sm90::ForwardSplit{};
  const int splits = split.splits;
  if (hopper && sm90::pack_gqa_chosen(f, R::kLargestCtaRows, R::kLargestCtaRows))
    return packed_route_pays(rows, p.batch * p.heads_kv, split, sms);
  // Unpacked tiles: from kMinRows rows per KV head with half a block per SM; where the forward
  // splits, from kMinPackedRows as the packed tiles (flash_attn_func, split forward against the
  // decode kernel, H200, one sequence of 32 tokens x 32768 keys, MHA: d64 2.65 against 1.24 TB/s,
  // d256 3.95 against 2.12; docs/PERF.md session 38).
  const int64_t min_rows = splits > 1 ? R::kMinPackedRows : R::kMinRows;
  if (rows < min_rows || 2 * p.batch * p.heads_q * blocks * splits < sms) return false;  // half a block per SM
  // The sm80 forward runs here without workspace: pages it would gather first (paged_gather.hpp)
  // keep the call on the decode kernel, as before it took them.
  return hopper || (sm80_supports(f, nullptr) && sm80_forward_workspace(f) == 0);
}

bool decode_kernel_suits(const KvCacheParams& p) {
  using R = RouteTraits;
  const int64_t rows = p.group_size() * p.seqlen_q;  // per KV head
  if (rows >= R::kMinRows) return false;
  // Up to kRows: one pass over the keys. At head dim 64 the decode kernel reads ~2.5 TB/s where the
  // forward's narrow tile reads ~3.0 (H200, session 35, MHA 32 x 16 heads x 2048 keys): there it
  // takes only calls it reads in head pairs (as fast as d128, head_pairs.hpp) or whose forward
  // tiles leave SMs idle.
  const bool one_pass = rows <= DecodeTraits::kRows;
  if (one_pass && (compiled_head_dim_bucket(p.head_dim) > 64 || head_pairs_chosen(p, DecodeTraits::kRows))) return true;
  // A varlen forward's view (one query token per sequence): the forward kernels would read each KV
  // head's keys once per query head, in a tile per (sequence, head) holding one row.
  if (p.q_cu_seqlens != nullptr) return one_pass;
  const AttentionParams f = rule_params(p);
  const bool hopper_packs = hopper_takes(p, f) && sm90::pack_gqa_chosen(f, R::kLargestCtaRows, R::kLargestCtaRows);
  if (!one_pass) return hopper_packs && !prefill_route_applies(p);
  constexpr int kDefaultSms = 132;
  const int64_t tiles = hopper_packs ? p.batch * p.heads_kv * ((rows + R::kLargestCtaRows - 1) / R::kLargestCtaRows)
                                     : p.batch * p.heads_q * ((p.seqlen_q + R::kLargestCtaRows - 1) / R::kLargestCtaRows);
  return tiles < multiprocessor_count(p.device_id, kDefaultSms);
}

bool prefill_route_on_hopper(const KvCacheParams& p) { return hopper_takes(p, shape_params(p)); }

size_t prefill_route_workspace(const KvCacheParams& p) {
  const AttentionParams f = shape_params(p);
  return arrays_bytes(p) + (hopper_takes(p, f) ? sm90_forward_workspace(f) : 0);
}

Status run_prefill_route(const KvCacheParams& p, bool on_hopper, void* workspace) {
  const bool dense = dense_call(p);
  const RouteArrays a = dense ? RouteArrays{} : arrays_in(workspace, p.batch);
  const ScopedDevice on_device(p.device_id);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  // Both small kernels launch as programmatic dependents where the GPU has them: their launches
  // and the forward's setup overlap the kernel before each instead of draining the stream.
  const bool programmatic = supports_programmatic_launch(p.device_id);
  cudaError_t err = cudaSuccess;
  if (!dense) {
    err = launch_kernel(build_kernel, dim3(1), dim3(RouteTraits::kThreads), 0, stream, programmatic, p, a);
    if (err != cudaSuccess) return Status::cuda(std::string("kvcache prefill: launch failed: ") + cudaGetErrorString(err));
  }

  const AttentionParams f = forward_params(p, a);
  Status s;
  if (on_hopper) {
    const size_t bytes = sm90_forward_workspace(f);  // the page gather's and the split partials', where needed
    s = sm90_forward(f, bytes ? static_cast<char*>(workspace) + arrays_bytes(p) : nullptr, bytes);
  } else {
    s = sm80_forward(f, nullptr, 0);
  }
  if (!s.is_ok() || dense) return s;
  err = launch_kernel(poison_kernel, dim3(static_cast<unsigned>(p.batch)), dim3(RouteTraits::kThreads), 0, stream,
                      programmatic, p, static_cast<const int32_t*>(a.bad));
  if (err != cudaSuccess) return Status::cuda(std::string("kvcache prefill: launch failed: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace flashcore::cuda::decode
