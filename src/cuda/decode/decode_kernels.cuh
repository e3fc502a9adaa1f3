// CUDA kernels of the inference path: in-place append of new keys/values, split-KV decode
// attention (flash-decoding), and the merge of partial results (split-KV combine and the public
// fc_merge_partials).
//
// Attention CTA = (split, KV head x chunk of kRows query rows, sequence). The query rows of one CTA
// are the GQA heads sharing the KV head times the query tokens, so every K/V row is read once for
// all of them. The CTA's key range is cut into tiles of 16 keys; each of its 4 or 8 warps streams
// every 4th or 8th tile through its own multi-stage cp.async ring in shared memory (several tiles
// in flight per warp, so the memory system always has enough bytes requested) and computes
// S = Q K^T and O += P V with mma.sync (m16n8k16, fp32 accumulation; the query rows are the M
// dimension, padded to 16, so the tensor cores make the math free and the kernel is bound by the
// cache reads). Each warp keeps its own online-softmax state; the warps are combined through
// shared memory at the end. Cache indices that live on the device (cache_seqlens,
// cache_batch_idx, block_table) are checked before use: nothing out of bounds is read or written;
// a bad sequence gets NaN rows and *error_flag = 1. On sm_90 every kernel here is launched as a
// programmatic dependent of the kernel before it on the stream (ptx::wait_previous_grid /
// allow_next_grid).
// Relies on: api/kvcache_params.hpp (addressing and checks shared with the CPU backend),
// cuda/ptx/grid_dependency.cuh, decode_trace.cuh (phase records for dev/decode_trace.cu; no-ops
// unless FLASHCORE_DECODE_TRACE is defined).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "api/kvcache_params.hpp"
#include "common/rotary.hpp"
#include "cuda/decode/decode_trace.cuh"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/l2_prefetch.cuh"

namespace flashcore::cuda::decode {

struct DecodeTraits {
  static constexpr int kThreads = 128;
  static constexpr int kVec = 8;    // elements per 16-byte load
  static constexpr int kRows = 16;  // query rows per attention CTA (the m of the mma tile)
  static constexpr int kWarp = 32;
  static constexpr int kMergeThreads = 128;
  static constexpr int kMergeBatch = 16;  // parts whose loads a merge warp issues together
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ void to_float8(const uint4& raw, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ void to_float8(const uint4& raw, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Programmatic dependent launch (cuda/programmatic_launch.hpp): the append, attention and combine
// kernels are launched as programmatic dependents of the kernel before them on the stream (the
// previous call's too), so a launch and its CTAs' placement overlap that kernel's tail: each
// kernel first waits for the previous grid to complete with its writes visible, reading no global
// memory before for its results (the attention kernel only warms L2 there: prefetch_first_tiles),
// then lets its own dependent be scheduled (which waits in turn).
using ptx::allow_next_grid;
using ptx::wait_previous_grid;

// ---------------------------------------------------------------------------------------------
// Append: block (token t, sequence b, row r) copies the K and V rows of KV head r (r < heads_kv)
// of k_new/v_new into the cache, the key rotated on the way when the call has rotary tables; with
// them, blocks r >= heads_kv write q's row (t, head r - heads_kv) rotated to `q_rotated` (the
// workspace copy the attention kernel reads instead of q). One row per block keeps every thread's
// work to a feature or two: with a block per token looping over all heads, the rotation's loads
// ran one loop step after another (~50 us per call at 16 x 8192, docs/PERF.md session 27).
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float rotary_table(const void* table, DType dtype, int64_t at) {
  if (dtype == DType::F32) return static_cast<const float*>(table)[at];
  if constexpr (std::is_same_v<T, __half>) return __half2float(static_cast<const __half*>(table)[at]);
  else return __bfloat162float(static_cast<const __nv_bfloat16*>(table)[at]);
}

/** Feature d of row `src` rotated at rotary position `pos` into dst[d] (common/rotary.hpp: fp32,
 *  rounded once); features from 2 * half on are copied. */
template <typename T>
__device__ __forceinline__ void rotate_feature_of(const KvCacheParams& p, const T* src, T* dst, int64_t pos, int64_t d) {
  const RotaryTables& r = p.rotary;
  float x = static_cast<float>(src[d]);
  if (d < 2 * r.half) {
    const RotaryFeature f = rotary_feature(d, r.half, r.interleaved);
    const float c = rotary_table<T>(r.cos, r.dtype, pos * r.cos_row_stride + f.index);
    const float sn = rotary_table<T>(r.sin, r.dtype, pos * r.sin_row_stride + f.index);
    x = rotate_feature(x, static_cast<float>(src[f.partner]), c, sn, f.first);
  }
  dst[d] = from_float<T>(x);
}

/** Row src (head_dim <= 256 features) rotated at rotary position pos into dst, a feature or two
 *  per thread (all loads of a thread issued together). */
template <typename T>
__device__ __forceinline__ void rotate_row(const KvCacheParams& p, const T* src, T* dst, int64_t pos) {
  static_assert(2 * DecodeTraits::kThreads >= 256, "two features per thread cover head_dim 256");
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int d = threadIdx.x + j * DecodeTraits::kThreads;
    if (d < p.head_dim) rotate_feature_of(p, src, dst, pos, d);
  }
}

template <typename T>
__global__ void __launch_bounds__(DecodeTraits::kThreads) append_kernel(KvCacheParams p, T* q_rotated) {
  wait_previous_grid();
  allow_next_grid();
  const int64_t b = blockIdx.y, t = blockIdx.x, row = blockIdx.z;
  const bool is_q = row >= p.heads_kv;
  if (t >= (is_q ? p.seqlen_q : p.seqlen_new)) return;  // the grid covers the longer of the two
  bool ok = sequence_in_bounds(p, b);
  const int64_t end = ok ? cache_end(p, b) : 0;
  const int64_t slot = end + t;
  const int64_t phys = ok && !is_q ? physical_page(p, b, p.paged ? slot / p.page_size : 0) : 0;
  if (ok && !is_q) ok = page_in_range(p, phys);
  if (!ok) {
    if (threadIdx.x == 0 && p.error_flag) *p.error_flag = 1;
    return;
  }
  if (is_q) {
    const int64_t h = row - p.heads_kv;
    rotate_row(p, static_cast<const T*>(p.q.data) + offset_of(p.q, b, t, h),
               q_rotated + ((b * p.seqlen_q + t) * p.heads_q + h) * p.head_dim,
               end + (p.rotary.per_token_queries ? t : 0));
    return;
  }
  const int64_t h = row;
  if (p.rotary.on())  // feature by feature: a pair may straddle 16-byte vectors
    rotate_row(p, static_cast<const T*>(p.k_new.data) + offset_of(p.k_new, b, t, h),
               static_cast<T*>(p.k_cache.data) + cache_offset(p.k_cache, p, phys, slot, h), slot);
  const int vecs = static_cast<int>(p.head_dim) / DecodeTraits::kVec;  // <= 32 per row
  static_assert(DecodeTraits::kThreads >= 2 * 32, "a thread per 16-byte vector of a K and a V row");
  const int v = threadIdx.x + (p.rotary.on() ? vecs : 0);
  if (v < 2 * vecs) {
    const bool is_v = v >= vecs;
    const int d = (is_v ? v - vecs : v) * DecodeTraits::kVec;
    const TensorRef& src = is_v ? p.v_new : p.k_new;
    const TensorRef& dst = is_v ? p.v_cache : p.k_cache;
    const T* from = static_cast<const T*>(src.data) + offset_of(src, b, t, h) + d;
    T* to = static_cast<T*>(dst.data) + cache_offset(dst, p, phys, slot, h) + d;
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
  }
}

// ---------------------------------------------------------------------------------------------
// Split-KV attention.
// ---------------------------------------------------------------------------------------------
struct SplitOutput {
  float* part_o = nullptr;    // (splits, batch, seqlen_q, heads_q, qo_head_dim); unused when splits == 1
  float* part_lse = nullptr;  // (splits, batch, heads_q, seqlen_q)
  int num_splits = 1;
  int row_chunks = 1;
  int prefetch_tiles = 0;  // tiles per warp warmed in L2 before the wait (prefetch_first_tiles)
};

/** Shapes of the attention kernel for one head-dim bucket and warp count. The shared-memory ring
 *  holds, per warp, kStages tiles of kKeys keys (K and V): (kStages - 1) tiles stay in flight while
 *  one is used. kWarpsPerCta: 4, or 8 (HD <= 128) where a block may take the doubled ring
 *  (kWideWarps). */
// Head dim 64's ring depth: 6 stages keep a warp's bytes in flight at d128's (4 KB tiles). A
// warp's rate is set by its tiles, not their bytes: this kernel read 2.1-2.9 TB/s on an H200 where
// the same bytes as d128 rows read 3.0-4.1 (docs/PERF.md session 36), so d64 caches whose KV heads
// pair (head_pairs.hpp) run on the 128-wide kernel instead; this one serves the rest.
// FLASHCORE_DECODE_D64_STAGES=3 builds 48 KB rings for an A/B measurement (unmeasured; 162
// registers a thread hold it to three 4-warp CTAs per SM, where the host's plan, which counts
// shared memory only, assumes four).
#ifndef FLASHCORE_DECODE_D64_STAGES
#define FLASHCORE_DECODE_D64_STAGES 6
#endif
inline constexpr int kD64Stages = FLASHCORE_DECODE_D64_STAGES;
static_assert(kD64Stages >= 2 && kD64Stages <= 8, "FLASHCORE_DECODE_D64_STAGES: 2..8");

template <int HD, int kWarpsPerCta>
struct AttnTile {
  static constexpr int kWarps = kWarpsPerCta;
  static constexpr int kThreads = kWarps * DecodeTraits::kWarp;
  static constexpr int kKeys = 16;                        // keys per tile (the k of the P.V mma)
  static constexpr int kRows = DecodeTraits::kRows;       // query rows per CTA (the m of the mma)
  static constexpr int kChunks = HD / DecodeTraits::kVec;  // 16-byte chunks per key row
  static constexpr int kRowBytes = HD * 2;
  static constexpr int kStageBytes = 2 * kKeys * kRowBytes;  // K + V of one tile
  // 4 warps: 96 KB of ring for HD 64 / 128 (two CTAs per SM on Hopper; fits the 99 KB of
  // sm_86/89); HD 256 takes 2 stages (136 KB with Q: fits A100's 163 KB). 8 warps: 192 KB, one CTA
  // per SM. A ring twice as deep (one 4-warp CTA per SM, 5 tiles in flight per warp) was slower on
  // every decode target cell of the H100 (2026-11-23), 4 and 5 stages on the H200 (session 33).
  static constexpr int kStages = HD <= 64 ? kD64Stages : (HD <= 128 ? 3 : 2);
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  // The warps' O rows for the combine, kCombineStride floats apart: HD + 8 puts the rows g = 0..3 of
  // a half-warp's fragment store (float2 at 8n + 2c) on distinct banks, where rows HD apart all hit
  // the same eight (a 4-way conflict per half-warp on every store of the epilogue).
  static constexpr int kCombineStride = HD + 8;
  static constexpr int kCombineBytes = kWarps * kRows * kCombineStride * int(sizeof(float));
  // HD 256: Q's mma fragments (64 registers) would spill next to the 128 accumulators; they are
  // read from shared memory (ldmatrix per k-step) instead, placed after the ring.
  static constexpr bool kQInSmem = HD > 128;
  static constexpr int kQBytes = kQInSmem ? kRows * kRowBytes : 0;
  static constexpr int kSmemBytes = (kRingBytes > kCombineBytes ? kRingBytes : kCombineBytes) + kQBytes;
  // The kernel's static shared memory (s_m, s_l, s_w, s_lse, the output offsets), rounded up.
  static constexpr int kStaticSmemBytes = (3 * kWarps * kRows * 4 + kRows * 4 + 2 * kRows * 8 + 255) / 256 * 256;
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "the swizzle needs rows of 8k 16-byte chunks");
  static_assert(kWarps == 4 || (kWarps == 8 && HD <= 128), "4 warps, or 8 at head dims up to 128");
};

// The attention CTA's warps at head dims up to 128 where a block may hold their ring (192 KB:
// Hopper's 227 KB, not A100's 163 KB or sm_86/89's 99 KB): one CTA of 8 warps per SM instead of
// two CTAs of 4. One CTA of 4 warps per SM reads ~23 GB/s on Hopper, whatever its ring's depth
// (docs/PERF.md session 33: 3-5 stages, 64-128 KB in flight, all 3.0-3.1 TB/s on 132 SMs); two
// per SM read the H200's 4.2 TB/s, but reaching them took splits and their combine.
// FLASHCORE_DECODE_WARPS=4 builds the 4-warp kernel alone (for A/B measurements).
#ifndef FLASHCORE_DECODE_WARPS
#define FLASHCORE_DECODE_WARPS 8
#endif
inline constexpr int kWideWarps = FLASHCORE_DECODE_WARPS;
static_assert(kWideWarps == 4 || kWideWarps == 8, "FLASHCORE_DECODE_WARPS: 4 or 8");

/** The keys split `split` of `num_splits` reads: [k0, k1) inside the rows' visible keys `all`.
 *  Splits start on multiples of kKeys so that tiles never straddle a page of 16 or more keys. */
struct SplitKeys {
  KeyRange all;
  int64_t k0, k1;
};
template <int kKeys>
__device__ __forceinline__ SplitKeys split_keys(const KvCacheParams& p, int64_t seqlen_k, int64_t q_tokens, int split,
                                                int num_splits) {
  SplitKeys sk;
  sk.all = q_tokens > 0 ? kv_mask(p, seqlen_k, q_tokens).keys_for_rows(0, q_tokens) : KeyRange{0, 0};
  const int64_t base = sk.all.begin / kKeys * kKeys;
  const int64_t len = sk.all.end > sk.all.begin ? sk.all.end - base : 0;
  const int64_t per_split = ((len + num_splits - 1) / num_splits + kKeys - 1) / kKeys * kKeys;
  sk.k0 = base + split * per_split;
  sk.k1 = max(sk.k0, min(sk.all.end, sk.k0 + per_split));
  return sk;
}

/** cache_end / cache_start / cache_row_of's loads before the wait (ptx::load_unordered_s32: L2 only, never merged
 *  with the reads after it). */
struct UnorderedIndexLoad {
  __device__ __forceinline__ int32_t operator()(const int32_t* at) const { return ptx::load_unordered_s32(at); }
};

/** Before the wait: requests into L2 the K and V rows of this warp's first `so.prefetch_tiles`
 *  tiles (at most kMaxTiles), placed where the sequence's length, cache row and block-table entries
 *  read now say (ptx/l2_prefetch.cuh: they may predate the previous grid's writes; a wrong guess
 *  only warms the wrong lines, all inside the cache). A call's CTAs sit at the wait while the
 *  previous call drains, so the first tiles' DRAM latency moves under that call's tail. Lane l
 *  takes key l % 16 of a tile, of K (l < 16) or V. */
template <typename T, int HD, int kKeys, int kWarps>
__device__ __forceinline__ void prefetch_first_tiles(const KvCacheParams& p, const SplitOutput& so, int64_t b, int hk,
                                                     int split, int warp, int lane) {
  static_assert(2 * kKeys == DecodeTraits::kWarp, "a lane per K or V row of a tile");
  constexpr int kMaxTiles = 4;
  const int tiles = min(so.prefetch_tiles, kMaxTiles);
  if (tiles <= 0) return;
  const int64_t end = cache_end(p, b, UnorderedIndexLoad{}), start = cache_start(p, b, UnorderedIndexLoad{});
  const int64_t seqlen_k = end - start + p.seqlen_new;
  if (start < 0 || end < start || end + p.seqlen_new > p.capacity()) return;
  const int64_t row = p.paged ? b : cache_row_of(p, b, UnorderedIndexLoad{});
  // (A varlen view's token count is not read here: seqlen_q's keys hold it, and a guess only warms lines.)
  const SplitKeys sk = split_keys<kKeys>(p, seqlen_k, p.seqlen_q, split, so.num_splits);
  const bool is_v = lane >= kKeys;
  const TensorRef& cache = is_v ? p.v_cache : p.k_cache;
  int64_t pos[kMaxTiles], page[kMaxTiles];
#pragma unroll
  for (int i = 0; i < kMaxTiles; ++i) {  // every table read issued before the first is used
    pos[i] = sk.k0 + int64_t(warp + kWarps * i) * kKeys + (lane % kKeys);
    page[i] = -1;
    if (i < tiles && pos[i] < sk.k1)
      page[i] = p.paged ? ptx::load_unordered_s32(p.block_table + b * p.block_table_batch_stride +
                                                  pos[i] / p.page_size * p.block_table_page_stride)
                        : row;
  }
#pragma unroll
  for (int i = 0; i < kMaxTiles; ++i) {
    if (!page_in_range(p, page[i])) continue;
    const char* at =
        static_cast<const char*>(cache.data) + cache_offset(cache, p, page[i], start + pos[i], hk) * int64_t(sizeof(T));
    const int row_bytes = static_cast<int>(p.head_dim) * int(sizeof(T));  // <= HD: padded buckets
#pragma unroll
    for (int off = 0; off < HD * int(sizeof(T)); off += 128)
      if (off < row_bytes) ptx::prefetch_l2(at + off);
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/** 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes zeros and reads nothing. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/** An L2 policy for data read once: its lines are the first evicted (createpolicy, sm_80+). */
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
/** cp_async16 under an L2 policy from createpolicy. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/** d += a * b on tensor cores (m16n8k16, fp32 accumulate). */
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                         __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// CTA = (split, KV head x chunk of kRows query rows, sequence); kWarps warps (4 or 8), each owning
// every kWarps-th tile of the CTA's key range with its own cp.async ring and online-softmax state.
// Per tile: S (16 rows x 16 keys) = Q K^T and O += P V on tensor cores (rows past the GQA group are
// zero padding: the math is free, the kernel is bound by the cache reads). Shared-memory rows are
// XOR-swizzled by 16-byte chunk (chunk ^ (key & 7)) so cp.async stores and ldmatrix loads are free
// of bank conflicts. The warps' states are combined through shared memory at the end.
// kAlibi: the call has ALiBi slopes (one FMA per score after the softcap, from a slope and a
// diagonal per row); a template argument so that calls without them run the bias-free code.
// kPaired: the call is a head-pair view (head_pairs.hpp, KvCacheParams::heads_paired; HD 128 over
// two d64 heads); its own kernels, so that unpaired calls run code without the pairs' selects.
template <typename T, int HD, int kWarpsPerCta, bool kAlibi, bool kPaired = false>
__global__ void __launch_bounds__(kWarpsPerCta * DecodeTraits::kWarp) attention_kernel(KvCacheParams p, SplitOutput so) {
  static_assert(!kPaired || HD == 128, "head pairs run on the 128-wide kernel");
  using Tl = AttnTile<HD, kWarpsPerCta>;
  constexpr int kWarps = Tl::kWarps, kKeys = Tl::kKeys, kRows = Tl::kRows, kStages = Tl::kStages;
  constexpr int kSteps = HD / 16;  // k-steps of Q K^T, n-tiles of P V: HD / 8
  const float kNegInf = -__int_as_float(0x7f800000);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_m[kWarps][kRows];
  __shared__ float s_l[kWarps][kRows];
  __shared__ float s_w[kWarps][kRows];
  __shared__ float s_lse[kRows];  // log2 domain
  __shared__ int64_t s_out_offset[kRows];
  __shared__ int64_t s_lse_offset[kRows];
  DECODE_TRACE(kDecodeEntry);

  // Before the wait: everything that depends on the arguments alone (the CTA's rows, where its Q
  // rows and outputs live), in 32-bit arithmetic where the grid check bounds the values
  // (rows_total <= 16 x 65535). A call's CTAs sit at the wait for most of the previous call, so
  // this is free; what follows the wait is paid once per wave of CTAs (dev/decode_trace.cu: 3-5 us
  // from the wait to the first copies, 2.6-2.8 us of epilogue before this change, H100).
  const int split = blockIdx.x;
  const int hk = static_cast<int>(blockIdx.y) / so.row_chunks;
  const int chunk = static_cast<int>(blockIdx.y) - hk * so.row_chunks;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / DecodeTraits::kWarp, lane = tid % DecodeTraits::kWarp;
  const int g = lane >> 2, c = lane & 3;  // mma fragment coordinates
  const int group_size = static_cast<int>(p.heads_q / p.heads_kv);
  const int seqlen_q = static_cast<int>(p.seqlen_q);
  const int rows_total = group_size * seqlen_q;
  const int row0 = chunk * kRows;
  const int nrows = min(kRows, rows_total - row0);
  const int hd_chunks = static_cast<int>(p.head_dim) / DecodeTraits::kVec;
  // Query row r of the CTA is (query token i, head h) = (rr % seqlen_q, hk * group + rr / seqlen_q).
  auto token_of = [&](int r) { return (row0 + r) % seqlen_q; };
  auto head_of = [&](int r) { return hk * group_size + (row0 + r) / seqlen_q; };
  // Head pairs (head_pairs.hpp): K / V rows hold KV heads 2 hk and 2 hk + 1 side by side; the rows
  // of the second head's query heads (from rr = group / 2 x seqlen_q on) sit on side 1, reading
  // q into dims [qo_hd, 2 qo_hd) and writing their output from there. Without pairs every row is
  // on side 0 and qo_hd = head_dim.
  const int qo_hd = static_cast<int>(kPaired ? p.head_dim / 2 : p.head_dim);
  const int side1_from = kPaired ? group_size / 2 * seqlen_q : rows_total;
  auto side_offset = [&](int r) { return row0 + r >= side1_from ? qo_hd : 0; };
  // This thread's two query rows (g and g + 8) in Q; nullptr past the CTA's rows.
  const T* q_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    q_row[half] = r < nrows ? static_cast<const T*>(p.q.data) + offset_of(p.q, b, token_of(r), head_of(r)) : nullptr;
  }
  // Where row r's output (element offset in out, or in part_o) and LSE go, kept in shared memory
  // (not registers) until the epilogue.
  int64_t out_offset = 0;
  if (tid < nrows) {
    const int64_t i = token_of(tid), h = head_of(tid);
    if (so.num_splits == 1) {
      out_offset = offset_of(p.out, b, i, h);
      s_lse_offset[tid] = b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride;
    } else {
      out_offset = ((((int64_t)split * p.batch + b) * p.seqlen_q + i) * p.heads_q + h) * qo_hd;
      s_lse_offset[tid] = (((int64_t)split * p.batch + b) * p.heads_q + h) * p.seqlen_q + i;
    }
    s_out_offset[tid] = out_offset;
  }

  const float score_scale = p.softcap > 0 ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_scale = p.softcap * kLog2e;

  const T* kc = static_cast<const T*>(p.k_cache.data);
  const T* vc = static_cast<const T*>(p.v_cache.data);
  const int64_t page_size = p.page_size;
  const bool page_pow2 = (page_size & (page_size - 1)) == 0;
  const int page_shift = __ffsll(page_size) - 1;
  const int64_t k_head = hk * p.k_cache.head_stride, v_head = hk * p.v_cache.head_stride;
  const uint32_t ring = smem_addr(smem) + warp * kStages * Tl::kStageBytes;
  prefetch_first_tiles<T, HD, kKeys, kWarps>(p, so, b, hk, split, warp, lane);

  // The previous kernel (this call's append, or the last call's attention or combine) must be
  // complete before anything is read; the combine kernel (or the next call's first kernel) may then
  // be scheduled once every CTA has started: it waits for this grid's completion. The condition
  // keeps ptxas from hoisting the wait above the math it depends on, and is always true: strides
  // may be negative, but validation keeps every byte extent within int64, so no element offset is
  // INT64_MIN.
  if (out_offset != INT64_MIN) wait_previous_grid();
  allow_next_grid();
  DECODE_TRACE(kDecodeWaited);

  // A varlen forward's view (KvCacheParams::q_cu_seqlens): where the sequence's query rows sit in
  // q, out and lse, read now that the previous grid is done, and how many tokens it has; rows past
  // them are neither read nor stored.
  int64_t q_batch = b;
  int q_tokens = seqlen_q;
  if (p.q_cu_seqlens != nullptr) {
    const QueryRows qr = query_rows(p, b);
    q_batch = qr.batch_index;
    q_tokens = static_cast<int>(qr.tokens);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      q_row[half] = r < nrows && token_of(r) < q_tokens
                        ? static_cast<const T*>(p.q.data) + offset_of(p.q, q_batch, token_of(r), head_of(r))
                        : nullptr;
    }
    if (tid < nrows && so.num_splits == 1) {
      const int64_t i = token_of(tid), h = head_of(tid);
      s_out_offset[tid] = offset_of(p.out, q_batch, i, h);
      s_lse_offset[tid] = q_batch * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride;
    }
  }

  bool bad = !sequence_in_bounds(p, b);
  const int64_t seqlen_k = bad ? 0 : total_len(p, b);
#ifdef FLASHCORE_DECODE_TRACE
  asm volatile("" ::"l"(seqlen_k));  // the trace point below waits for the load
#endif
  DECODE_TRACE(kDecodeSeqlenReady);
  const MaskInfo mask = kv_mask(p, seqlen_k, q_tokens);
  const SplitKeys sk = split_keys<kKeys>(p, seqlen_k, q_tokens, split, so.num_splits);
  const KeyRange all = sk.all;
  const int64_t k0 = sk.k0, k1 = sk.k1;
  const int span = static_cast<int>(k1 - k0);
  const int64_t contiguous_row = (p.paged || bad) ? 0 : cache_row_of(p, b);
  const int64_t contiguous_start = (p.paged || bad) ? 0 : cache_start(p, b);  // key j at slot start + j
#ifdef FLASHCORE_DECODE_TRACE
  asm volatile("" ::"l"(contiguous_start), "l"(contiguous_row), "l"(k0), "l"(k1));
#endif
  DECODE_TRACE(kDecodeRangeReady);

  // Tiles of this warp: w, w + kWarps, ... of the CTA's range.
  const int tiles = (span + kKeys - 1) / kKeys;
  const int my_tiles = warp < tiles ? (tiles - warp + kWarps - 1) / kWarps : 0;

  // Copies: lane copies keys (lane / 8) + 4i (i < 4), chunks (lane % 8) + 8j of K and V.
  // With pages of kKeys or more keys (powers of two) a tile lies in one page, so one block-table
  // entry serves a tile. Those entries are read kTableBatch tiles at a time, lane j holding the
  // entry of the warp's tile (batch * kTableBatch + j), and the next batch is requested as soon as
  // the current one is entered: a table read is issued ~32 tiles before its copy needs it, and a
  // tile's address costs a shuffle instead of a dependent global load on the copy's critical path
  // (with pages of 16 keys every tile is a new page). Entries are checked only when a copy uses them.
  // Other page sizes read one entry per key, one tile ahead of its copy.
  constexpr int kTableBatch = DecodeTraits::kWarp;
  auto tile_pos = [&](int local) { return k0 + int64_t(warp + kWarps * local) * kKeys; };
  const bool page_per_tile = p.paged && page_pow2 && page_size >= kKeys;
  const int32_t* table_row = p.paged ? p.block_table + b * p.block_table_batch_stride : nullptr;
  auto table_batch = [&](int batch) -> int32_t {  // this lane's entry of the given batch
    const int local = batch * kTableBatch + lane;
    if (!page_per_tile || local >= my_tiles) return 0;  // local < my_tiles: tile_pos < k1 <= capacity
    return table_row[(tile_pos(local) >> page_shift) * p.block_table_page_stride];
  };
  int table_at = 0;                   // batch held in table_cur
  int32_t table_cur = table_batch(0);  // lane j: page of the warp's tile table_at * kTableBatch + j
  int32_t table_next = table_batch(1);
  int32_t phys[4] = {0, 0, 0, 0};  // page (or cache row) of each of the lane's keys, unchecked
  unsigned need = 0;  // bit i: key i of the lane is copied (else zero-filled)
  // Called by the whole warp with the same `local`, for local = 0, 1, 2, ... in order.
  auto lookup = [&](int local) {
    need = 0;
    const int64_t pos0 = tile_pos(local);
    if (page_per_tile) {
      if (local / kTableBatch != table_at) {  // entering the next batch: prefetch the one after
        ++table_at;
        table_cur = table_next;
        table_next = table_batch(table_at + 1);
      }
      const int32_t ph = __shfl_sync(0xffffffffu, table_cur, local % kTableBatch);
#pragma unroll
      for (int i = 0; i < 4; ++i) phys[i] = ph;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t pos = pos0 + (lane >> 3) + 4 * i;
      if (local < my_tiles && pos >= all.begin && pos < k1) {
        need |= 1u << i;
        if (!p.paged) {
          phys[i] = static_cast<int32_t>(contiguous_row);
        } else if (!page_per_tile) {
          const int64_t page = page_pow2 ? pos >> page_shift : pos / page_size;
          phys[i] = table_row[page * p.block_table_page_stride];
        }
      }
    }
  };
  // The cache is read once per call: its lines go first from L2, so that the small data every CTA
  // needs right after the wait (lengths, block tables, Q, split partials, the next kernel's code)
  // is still there.
  const uint64_t stream_policy = l2_evict_first_policy();
  auto issue = [&](int local) {
    const uint32_t stage = ring + (local % kStages) * Tl::kStageBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = (lane >> 3) + 4 * i;
      const int64_t pos = tile_pos(local) + key;
      const int64_t in_page = !p.paged ? contiguous_start + pos : (page_pow2 ? (pos & (page_size - 1)) : pos % page_size);
      const bool in_range = page_in_range(p, phys[i]);
      const bool ok = ((need >> i) & 1u) && in_range;
      if (((need >> i) & 1u) && !in_range) bad = true;
      const T* ks = ok ? kc + phys[i] * p.k_cache.batch_stride + in_page * p.k_cache.row_stride + k_head : kc;
      const T* vs = ok ? vc + phys[i] * p.v_cache.batch_stride + in_page * p.v_cache.row_stride + v_head : vc;
#pragma unroll
      for (int j = 0; j < Tl::kChunks / 8; ++j) {
        const int ch = (lane & 7) + 8 * j;
        const bool on = ok && ch < hd_chunks;
        const uint32_t dst = stage + key * Tl::kRowBytes + ((ch ^ (key & 7)) << 4);
        cp_async16(dst, on ? ks + ch * DecodeTraits::kVec : kc, on ? 16 : 0, stream_policy);
        cp_async16(dst + kKeys * Tl::kRowBytes, on ? vs + ch * DecodeTraits::kVec : vc, on ? 16 : 0, stream_policy);
      }
    }
  };

  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float acc[2 * kSteps][4];
#pragma unroll
  for (int t = 0; t < 2 * kSteps; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

  lookup(0);
  DECODE_TRACE(kDecodeLookup0);
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < my_tiles) issue(st);
    cp_async_commit();
    if (st == 0) DECODE_TRACE(kDecodeIssued0);
    lookup(st + 1);
  }
  DECODE_TRACE(kDecodeFirstIssued);
  // With the first copies in flight: Q as mma A fragments (a0: row g, d 2c..; a1: row g+8; a2: row
  // g, d 2c+8..; a3: row g+8, d 2c+8..) in registers, or (kQInSmem) in shared memory after the ring,
  // swizzled like the K/V tiles. (Requested before the sequence's length instead, Q's loads were
  // queued ahead of it: at 1 x 65536, 128 CTAs read the same 8 KB of Q at once, and the first
  // copies went out 1.3-2 us later in dev/decode_trace.cu, H100, 2026-11-24.)
  constexpr int kQRegSteps = Tl::kQInSmem ? 1 : kSteps;
  uint32_t qa[kQRegSteps][4];
  if constexpr (!Tl::kQInSmem) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d0 = side_offset(g + 8 * half);
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = 16 * s + 2 * c + 8 * e - d0;
          qa[s][half + 2 * e] = (q_row[half] != nullptr && d >= 0 && d < qo_hd)
                                    ? *reinterpret_cast<const uint32_t*>(q_row[half] + d)
                                    : 0u;
        }
    }
  }
  // The visible keys of this thread's two rows, relative to k0; with ALiBi, the rows' slopes in
  // log2 units (negated) and their diagonals relative to k0 (key k0 + rel is at distance
  // |diagonal - rel|; exact as floats below 2^24 keys).
  int rel_lo[2], rel_hi[2];
  float alibi_neg_slope[2] = {0.f, 0.f}, alibi_diagonal[2] = {0.f, 0.f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    rel_lo[half] = rel_hi[half] = 0;
    if (g + 8 * half < nrows) {
      const int i = token_of(g + 8 * half);
      const KeyRange kr = mask.keys_for_row(i);
      rel_lo[half] = static_cast<int>(min(max(kr.begin - k0, int64_t(0)), int64_t(span)));
      rel_hi[half] = static_cast<int>(min(max(kr.end - k0, int64_t(0)), int64_t(span)));
      if constexpr (kAlibi) {
        alibi_neg_slope[half] = -p.alibi_slope(b, head_of(g + 8 * half)) * kLog2e;
        alibi_diagonal[half] = static_cast<float>(mask.diagonal(i) - k0);
      }
    }
  }
  const uint32_t q_smem = smem_addr(smem) + (Tl::kSmemBytes - Tl::kQBytes);
  if constexpr (Tl::kQInSmem) {
    for (int idx = tid; idx < kRows * Tl::kChunks; idx += Tl::kThreads) {
      const int r = idx / Tl::kChunks, ch = idx % Tl::kChunks;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nrows && ch < hd_chunks && token_of(r) < q_tokens)
        v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q.data) +
                                            offset_of(p.q, q_batch, token_of(r), head_of(r)) + ch * DecodeTraits::kVec);
      *reinterpret_cast<uint4*>(smem + (Tl::kSmemBytes - Tl::kQBytes) + r * Tl::kRowBytes + ((ch ^ (r & 7)) << 4)) = v;
    }
    __syncthreads();
  }
  DECODE_TRACE(kDecodeQReady);
  const bool row_hi[2] = {side_offset(g) != 0, side_offset(g + 8) != 0};  // head pairs: rows g, g + 8 on side 1
  for (int t = 0; t < my_tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncwarp();  // every lane's copies of tile t landed; every lane is done with tile t - 1
    if (t == 0) DECODE_TRACE(kDecodeTile0Landed);
    if (t + kStages - 1 < my_tiles) issue(t + kStages - 1);
    cp_async_commit();
    lookup(t + kStages);
    const uint32_t ks = ring + (t % kStages) * Tl::kStageBytes, vs = ks + kKeys * Tl::kRowBytes;

    // S = Q K^T: n-tile j holds keys 8j..8j+7 (c0, c1: row g, keys 8j + 2c, +1; c2, c3: row g + 8).
    // Head pairs sum dims [64, 128) apart (s_hi), and each row takes its own head's half alone: the
    // other head's keys never reach its scores, not even as the 0 x inf = NaN of a non-finite key.
    float sacc[2][4], s_hi[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[j][e] = s_hi[j][e] = 0.f;
#pragma unroll
      for (int sp = 0; sp < kSteps / 2; ++sp) {
        float(&to)[4] = kPaired && sp >= kSteps / 4 ? s_hi[j] : sacc[j];
        uint32_t kb[4];
        const int key = 8 * j + (lane & 7), ch = 4 * sp + (lane >> 3);
        ldmatrix_x4(kb, ks + key * Tl::kRowBytes + ((ch ^ (lane & 7)) << 4));
        if constexpr (Tl::kQInSmem) {
          // A fragments of k-steps 2sp, 2sp+1: matrices (rows 0-7 | 8-15) x (chunk lo | hi).
          const int qr = ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int qch = 2 * (2 * sp + u) + (lane >> 4);
            ldmatrix_x4(qa[0], q_smem + qr * Tl::kRowBytes + ((qch ^ (lane & 7)) << 4));
            mma16816(to, qa[0], kb[2 * u], kb[2 * u + 1], T());
          }
        } else {
          mma16816(to, qa[2 * sp], kb[0], kb[1], T());
          mma16816(to, qa[2 * sp + 1], kb[2], kb[3], T());
        }
      }
    }
    if constexpr (kPaired) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[j][e] = (e < 2 ? row_hi[0] : row_hi[1]) ? s_hi[j][e] : sacc[j][e];
    }
    // Online softmax (log2 domain) of rows g and g + 8; the 4 lanes of a row hold 4 keys each.
    const int rel0 = (warp + kWarps * t) * kKeys;
    uint32_t pa[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sc[4];
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = sacc[j][2 * half + e] * score_scale;
          if (p.softcap > 0) x = cap_scale * tanhf(x);
          const int rel = rel0 + 8 * j + 2 * c + e;
          if constexpr (kAlibi) x = fmaf(alibi_neg_slope[half], fabsf(alibi_diagonal[half] - static_cast<float>(rel)), x);
          x = (rel >= rel_lo[half] && rel < rel_hi[half]) ? x : kNegInf;
          sc[2 * j + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[half], mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;  // nothing visible yet: p = 0, state stays 0
      const float alpha = exp2f(m[half] - m_use);
      float psum = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[e] = exp2f(sc[e] - m_use);
        psum += sc[e];
      }
      l[half] = l[half] * alpha + psum;
      m[half] = m_new;
#pragma unroll
      for (int n = 0; n < 2 * kSteps; ++n) {
        acc[n][2 * half] *= alpha;
        acc[n][2 * half + 1] *= alpha;
      }
      pa[half] = pack2(sc[0], sc[1], T());      // keys 2c, 2c + 1
      pa[half + 2] = pack2(sc[2], sc[3], T());  // keys 8 + 2c, 8 + 2c + 1
    }
    // O += P V: n-tile n holds d 8n..8n+7 (c0, c1: row g, d 8n + 2c, +1; c2, c3: row g + 8).
#pragma unroll
    for (int np = 0; np < kSteps; ++np) {
      uint32_t vb[4];
      const int key = ((lane >> 3) & 1) * 8 + (lane & 7), ch = 2 * np + (lane >> 4);
      ldmatrix_x4_trans(vb, vs + key * Tl::kRowBytes + ((ch ^ (lane & 7)) << 4));
      mma16816(acc[2 * np], pa, vb[0], vb[1], T());
      mma16816(acc[2 * np + 1], pa, vb[2], vb[3], T());
    }
  }
  cp_async_wait<0>();
  DECODE_TRACE(kDecodeLoopDone);

  // Combine the warps' states.
  const bool any_bad = __syncthreads_or(bad);  // also: every warp is done with its ring
  float* s_o = reinterpret_cast<float*>(smem);  // [warp][row][kCombineStride]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    const int r = g + 8 * half;
    if (r >= nrows) continue;  // padding rows: never read (one token of GQA 32 / 8 fills 4 of 16)
#pragma unroll
    for (int n = 0; n < 2 * kSteps; ++n)
      *reinterpret_cast<float2*>(s_o + (warp * kRows + r) * Tl::kCombineStride + 8 * n + 2 * c) =
          make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
    if (c == 0) {
      s_m[warp][r] = m[half];
      s_l[warp][r] = l[half];
    }
  }
  __syncthreads();
  if (tid < nrows) {
    float mx = kNegInf;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][tid]);
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float wt = mx == kNegInf ? 0.f : exp2f(s_m[w][tid] - mx);
      s_w[w][tid] = wt;
      total += wt * s_l[w][tid];
    }
    for (int w = 0; w < kWarps; ++w) s_w[w][tid] = total > 0.f ? s_w[w][tid] / total : 0.f;
    s_lse[tid] = total > 0.f ? mx + log2f(total) : kNegInf;
  }
  __syncthreads();
  DECODE_TRACE(kDecodeCombined);
  // Output items: (row, 8 consecutive d) -> one 16-byte store (or two of fp32 partials); every
  // address was formed before the wait.
  const float nan = __int_as_float(0x7fc00000);
  constexpr int kOutVecs = HD / DecodeTraits::kVec;
  for (int idx = tid; idx < nrows * kOutVecs; idx += Tl::kThreads) {
    const int r = idx / kOutVecs, d = (idx % kOutVecs) * DecodeTraits::kVec;
    if (d >= qo_hd || token_of(r) >= q_tokens) continue;
    const int d_acc = d + side_offset(r);
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = s_w[w][r];
      const float4* from = reinterpret_cast<const float4*>(s_o + (w * kRows + r) * Tl::kCombineStride + d_acc);
      const float4 lo = from[0], hi = from[1];
      o[0] = fmaf(wt, lo.x, o[0]);
      o[1] = fmaf(wt, lo.y, o[1]);
      o[2] = fmaf(wt, lo.z, o[2]);
      o[3] = fmaf(wt, lo.w, o[3]);
      o[4] = fmaf(wt, hi.x, o[4]);
      o[5] = fmaf(wt, hi.y, o[5]);
      o[6] = fmaf(wt, hi.z, o[6]);
      o[7] = fmaf(wt, hi.w, o[7]);
    }
    if (any_bad)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = nan;
    const int64_t at = s_out_offset[r] + d;
    if (so.num_splits == 1) {
      const uint4 packed = make_uint4(pack2(o[0], o[1], T()), pack2(o[2], o[3], T()), pack2(o[4], o[5], T()),
                                      pack2(o[6], o[7], T()));
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out.data) + at) = packed;
    } else {
      float4* to = reinterpret_cast<float4*>(so.part_o + at);
      to[0] = make_float4(o[0], o[1], o[2], o[3]);
      to[1] = make_float4(o[4], o[5], o[6], o[7]);
    }
  }
  if (tid < nrows && token_of(tid) < q_tokens) {
    const float lse = any_bad ? nan : (s_lse[tid] == kNegInf ? kNegInf : s_lse[tid] * kLn2);
    if (so.num_splits > 1) {
      so.part_lse[s_lse_offset[tid]] = lse;
    } else if (p.lse.data) {
      p.lse.data[s_lse_offset[tid]] = lse;
    }
  }
  if (any_bad && tid == 0 && p.error_flag) *p.error_flag = 1;
  DECODE_TRACE(kDecodeEnd);
}

// ---------------------------------------------------------------------------------------------
// Merge of (out, lse) partials. A NaN part poisons the row; all parts -inf give 0 / -inf.
// ---------------------------------------------------------------------------------------------
/** One warp's running merge of a row's parts over columns [d0, d0 + kPerLane x 32): the online
 *  softmax's max / sum and the weighted O of its lane's kPerLane columns. */
struct MergeState {
  static constexpr int kPerLane = 4;
  float run_max, run_sum, acc[kPerLane];
  bool has_nan;
};

/** Folds parts first, first + 1, ... (kBatch at a time, then `stride` on) into st. The combine is
 *  latency-bound (a few KB per row, read from L2): every load of a batch (its LSEs and the lane's
 *  columns of each O) is issued before any is used, so a batch costs one round trip to memory;
 *  across batches the running max / sum / weighted O are rescaled as in the online softmax. */
template <int kBatch>
__device__ __forceinline__ void merge_parts(const MergeParams& p, const float* lp, const float* op, int64_t d0, int lane,
                                            int64_t first, int64_t stride, MergeState& st) {
  constexpr int kWarp = DecodeTraits::kWarp, kPerLane = MergeState::kPerLane;
  const float kNegInf = -__int_as_float(0x7f800000);
  st.run_max = kNegInf;
  st.run_sum = 0.f;
  st.has_nan = false;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) st.acc[j] = 0.f;
  for (int64_t s0 = first; s0 < p.parts; s0 += stride) {
    float l[kBatch], v[kBatch][kPerLane];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const bool in = s0 + k < p.parts;
      l[k] = in ? lp[(s0 + k) * p.lp_part_stride] : kNegInf;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int64_t d = d0 + lane + j * kWarp;
        v[k][j] = (in && d < p.head_dim) ? op[(s0 + k) * p.op_part_stride + d] : 0.f;
      }
    }
    float batch_max = kNegInf;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      st.has_nan |= isnan(l[k]);
      batch_max = fmaxf(batch_max, l[k]);  // fmaxf ignores a NaN operand
    }
    const float new_max = fmaxf(st.run_max, batch_max);
    if (new_max == kNegInf) continue;  // nothing but empty parts so far
    const float rescale = __expf(st.run_max - new_max);  // run_max = -inf: 0, and the state is 0
    st.run_sum *= rescale;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) st.acc[j] *= rescale;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (!(l[k] > kNegInf)) continue;  // an empty part's O may hold anything: never read into the sum
      const float w = __expf(l[k] - new_max);
      st.run_sum += w;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) st.acc[j] = fmaf(w, v[k][j], st.acc[j]);
    }
    st.run_max = new_max;
  }
}

/** Rows per merge CTA: one warp per (b, i, h) row, all of its parts (kPartsSplit = false), or one
 *  row whose parts the CTA's warps share, batch w, w + warps, ... each, combined through shared
 *  memory (kPartsSplit = true: past one batch of parts, where a lone warp would pay one round trip
 *  per batch in turn; docs/PERF.md session 40, H200: 63 parts of 32 rows took 8.9 us alone on lone
 *  warps, 3.9 shared). */
template <bool kPartsSplit>
constexpr int merge_rows_per_cta() {
  return kPartsSplit ? 1 : DecodeTraits::kMergeThreads / DecodeTraits::kWarp;
}

template <typename OutT, bool kPartsSplit>
__global__ void __launch_bounds__(DecodeTraits::kMergeThreads) merge_kernel(MergeParams p) {
  constexpr int kWarp = DecodeTraits::kWarp, kWarps = DecodeTraits::kMergeThreads / kWarp;
  constexpr int kPerLane = MergeState::kPerLane;
  constexpr int kBatch = DecodeTraits::kMergeBatch;
  // A split-KV combine is short and sits between two long attention grids: it lets the next grid
  // (the next call's attention) be scheduled at once, so that grid's CTAs are placed while this
  // call's attention still runs instead of after this kernel started; then it waits until its
  // own inputs (the partials) are complete and visible. No-ops for an ordinary launch. The row's
  // addresses (three 64-bit divisions) are formed before the wait, which is conditional on them so
  // that ptxas keeps it after them (always true: see attention_kernel's wait).
  allow_next_grid();
  const float kNegInf = -__int_as_float(0x7f800000);
  const float kNan = __int_as_float(0x7fc00000);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t row = int64_t(blockIdx.x) * merge_rows_per_cta<kPartsSplit>() + (kPartsSplit ? 0 : warp);
  if (row >= p.batch * p.seqlen_q * p.heads) return;  // (a whole CTA when kPartsSplit)
  const int64_t h = row % p.heads, i = (row / p.heads) % p.seqlen_q, b = row / (p.heads * p.seqlen_q);
  const float* lp = p.lse_partials + b * p.lp_batch_stride + h * p.lp_head_stride + i * p.lp_row_stride;
  const float* op = p.out_partials + b * p.op_batch_stride + i * p.op_row_stride + h * p.op_head_stride;
  int64_t out_offset = offset_of(p.out, b, i, h), lse_row = i;
  if (out_offset != INT64_MIN) wait_previous_grid();
  if (p.out_cu_seqlens != nullptr) {  // a varlen combine: its packed rows, read after the wait
    int64_t start, tokens;
    packed_rows(p.out_cu_seqlens, b, p.out_rows, p.seqlen_q, start, tokens);
    if (i >= tokens) return;  // (uniform over the CTA when kPartsSplit: one row)
    out_offset = offset_of(p.out, b, start + i, h);
    lse_row = start + i;
  }
  OutT* out = static_cast<OutT*>(p.out.data) + out_offset;
  __shared__ float s_max[kPartsSplit ? kWarps : 1], s_sum[kPartsSplit ? kWarps : 1];
  __shared__ float s_acc[kPartsSplit ? kWarps : 1][kPerLane * kWarp];
  __shared__ int s_nan[kPartsSplit ? kWarps : 1];
  float lse = kNegInf;
  for (int64_t d0 = 0; d0 < p.head_dim; d0 += kPerLane * kWarp) {
    MergeState st;
    if constexpr (kPartsSplit) {
      merge_parts<kBatch>(p, lp, op, d0, lane, int64_t(warp) * kBatch, int64_t(kWarps) * kBatch, st);
      // The warps' states, rescaled to their common max (as across batches above) by warp 0.
      if (lane == 0) {
        s_max[warp] = st.run_max;
        s_sum[warp] = st.run_sum;
        s_nan[warp] = st.has_nan;
      }
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) s_acc[warp][lane + j * kWarp] = st.acc[j];
      __syncthreads();
      if (warp == 0) {
        float mx = kNegInf;
        bool has_nan = false;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          mx = fmaxf(mx, s_max[w]);
          has_nan |= s_nan[w] != 0;
        }
        float sum = 0.f, acc[kPerLane] = {};
        if (mx != kNegInf) {
#pragma unroll
          for (int w = 0; w < kWarps; ++w) {
            if (!(s_max[w] > kNegInf)) continue;  // a warp without a non-empty part
            const float scale = __expf(s_max[w] - mx);
            sum = fmaf(scale, s_sum[w], sum);
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) acc[j] = fmaf(scale, s_acc[w][lane + j * kWarp], acc[j]);
          }
        }
        st.run_max = mx;
        st.run_sum = sum;
        st.has_nan = has_nan;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) st.acc[j] = acc[j];
      }
      __syncthreads();  // shared memory free for the next columns
      if (warp != 0) continue;
    } else {
      merge_parts<kBatch>(p, lp, op, d0, lane, 0, kBatch, st);
    }
    lse = st.has_nan ? kNan : (st.run_max == kNegInf ? kNegInf : st.run_max + __logf(st.run_sum));
    const float inv = st.run_max == kNegInf ? 0.f : 1.f / st.run_sum;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = d0 + lane + j * kWarp;
      if (d < p.head_dim) out[d] = from_float<OutT>(st.has_nan ? kNan : st.acc[j] * inv);
    }
  }
  if ((!kPartsSplit || warp == 0) && lane == 0 && p.lse.data)
    p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + lse_row * p.lse.row_stride] = lse;
}

}  // namespace flashcore::cuda::decode
