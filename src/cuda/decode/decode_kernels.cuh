// CUDA kernels of the inference path: in-place append of new keys/values, split-KV decode
// attention (flash-decoding), and the merge of partial results (split-KV combine and the public
// fc_merge_partials).
//
// Attention CTA = (split, KV head x chunk of kRows query rows, sequence). The query rows of one CTA
// are the GQA heads sharing the KV head times the query tokens, so every K/V row is read once for
// all of them. A "thread group" of HD/8 threads owns one key at a time: each thread holds 8
// elements (one 16-byte load) of the key/value row and of every query row; the q.k dot is reduced
// with xor-shuffles inside the group. Each group keeps its own online-softmax state over the keys
// it visits (kKeysPerIter keys per step, all loads issued before use, streaming cache hint), and
// the groups are combined through shared memory at the end. Memory-bound by design: fp32 FMA, no
// tensor cores. Cache indices that live on the device (cache_seqlens, cache_batch_idx, block_table)
// are checked before use: nothing out of bounds is read or written; a bad sequence gets NaN rows
// and *error_flag = 1.
// Relies on: api/kvcache_params.hpp (addressing and checks shared with the CPU backend).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "api/kvcache_params.hpp"

namespace flashcore::cuda::decode {

struct DecodeTraits {
  static constexpr int kThreads = 128;
  static constexpr int kVec = 8;           // elements per 16-byte load
  static constexpr int kRows = 4;          // query rows per CTA (GQA 32/8 decode = 4)
  static constexpr int kKeysPerIter = 4;   // keys a thread group loads before using them
  static constexpr int kWarp = 32;
  static constexpr int kMergeThreads = 128;
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

// ---------------------------------------------------------------------------------------------
// Append: block (token t, sequence b) copies k_new/v_new rows of every KV head into the cache.
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(DecodeTraits::kThreads) append_kernel(KvCacheParams p) {
  const int64_t b = blockIdx.y, t = blockIdx.x;
  bool ok = sequence_in_bounds(p, b);
  const int64_t pos = ok ? cached_len(p, b) + t : 0;
  const int64_t phys = ok ? physical_page(p, b, p.paged ? pos / p.page_size : 0) : 0;
  ok = ok && page_in_range(p, phys);
  if (!ok) {
    if (threadIdx.x == 0 && p.error_flag) *p.error_flag = 1;
    return;
  }
  const int64_t vecs_per_head = p.head_dim / DecodeTraits::kVec;
  const int64_t per_tensor = p.heads_kv * vecs_per_head;
  for (int64_t v = threadIdx.x; v < 2 * per_tensor; v += blockDim.x) {
    const bool is_v = v >= per_tensor;
    const int64_t rest = is_v ? v - per_tensor : v;
    const int64_t h = rest / vecs_per_head, d = (rest % vecs_per_head) * DecodeTraits::kVec;
    const TensorRef& src = is_v ? p.v_new : p.k_new;
    const TensorRef& dst = is_v ? p.v_cache : p.k_cache;
    const T* from = static_cast<const T*>(src.data) + offset_of(src, b, t, h) + d;
    T* to = static_cast<T*>(dst.data) + cache_offset(dst, p, phys, pos, h) + d;
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
  }
}

// ---------------------------------------------------------------------------------------------
// Split-KV attention.
// ---------------------------------------------------------------------------------------------
struct SplitOutput {
  float* part_o = nullptr;    // (splits, batch, seqlen_q, heads_q, head_dim); unused when splits == 1
  float* part_lse = nullptr;  // (splits, batch, heads_q, seqlen_q)
  int num_splits = 1;
  int row_chunks = 1;
};

template <typename T, int HD>
__global__ void __launch_bounds__(DecodeTraits::kThreads) attention_kernel(KvCacheParams p, SplitOutput so) {
  using Tr = DecodeTraits;
  constexpr int kG = HD / Tr::kVec;  // threads per key
  static_assert(kG <= Tr::kWarp && Tr::kWarp % kG == 0, "a key's thread group must sit inside one warp");
  constexpr int kGroups = Tr::kThreads / kG;
  constexpr int kRows = Tr::kRows, kU = Tr::kKeysPerIter;
  const float kNegInf = -__int_as_float(0x7f800000);

  __shared__ float s_acc[kGroups][kRows][HD];
  __shared__ float s_m[kGroups][kRows];
  __shared__ float s_l[kGroups][kRows];
  __shared__ float s_w[kGroups][kRows];  // weight of each group's state in the CTA's result
  __shared__ float s_lse[kRows];         // log2 domain

  const int split = blockIdx.x;
  const int64_t hk = blockIdx.y / so.row_chunks, chunk = blockIdx.y % so.row_chunks;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, group = tid / kG, lane_g = tid % kG;
  const int d0 = lane_g * Tr::kVec;
  const bool d_active = d0 < p.head_dim;
  const int64_t group_size = p.heads_q / p.heads_kv;
  const int64_t rows_total = group_size * p.seqlen_q;
  const int64_t row0 = chunk * kRows;
  const int nrows = static_cast<int>(min(int64_t(kRows), rows_total - row0));

  bool bad = !sequence_in_bounds(p, b);
  const int64_t seqlen_k = bad ? 0 : total_len(p, b);
  const MaskInfo mask = kv_mask(p, seqlen_k);
  const KeyRange all = mask.keys_for_rows(0, p.seqlen_q);
  const int64_t len = all.end > all.begin ? all.end - all.begin : 0;
  const int64_t per_split = (len + so.num_splits - 1) / so.num_splits;
  const int64_t k0 = all.begin + split * per_split;
  const int64_t k1 = max(k0, min(all.end, k0 + per_split));
  const int span = static_cast<int>(k1 - k0);
  const int64_t contiguous_row = (p.paged || bad) ? 0 : cache_row_of(p, b);

  // Query rows (pre-scaled) and each row's visible keys relative to k0.
  float q[kRows][Tr::kVec];
  int rel_lo[kRows], rel_hi[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    rel_lo[r] = rel_hi[r] = 0;
#pragma unroll
    for (int e = 0; e < Tr::kVec; ++e) q[r][e] = 0.f;
    if (r < nrows) {
      const int64_t rr = row0 + r, h = hk * group_size + rr / p.seqlen_q, i = rr % p.seqlen_q;
      if (d_active) {
        const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q.data) + offset_of(p.q, b, i, h) + d0);
        to_float8(raw, q[r], T());
      }
      const KeyRange kr = mask.keys_for_row(i);
      rel_lo[r] = static_cast<int>(min(max(kr.begin - k0, int64_t(0)), int64_t(span)));
      rel_hi[r] = static_cast<int>(min(max(kr.end - k0, int64_t(0)), int64_t(span)));
    }
  }
  const float score_scale = p.softcap > 0 ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_scale = p.softcap * kLog2e;

  float m[kRows], l[kRows], acc[kRows][Tr::kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < Tr::kVec; ++e) acc[r][e] = 0.f;
  }

  const T* kc = static_cast<const T*>(p.k_cache.data);
  const T* vc = static_cast<const T*>(p.v_cache.data);
  // Loop bounds are warp-uniform (every lane takes part in the shuffles): a warp steps while its
  // first group still has keys; the other groups of the warp mask theirs.
  constexpr int kGroupsPerWarp = Tr::kWarp / kG;
  const int warp_first_group = (tid / Tr::kWarp) * kGroupsPerWarp;
  // Paged addressing without 64-bit division: page sizes are powers of two in practice (shift and
  // mask), any other size takes a 32-bit division (positions fit int32: cache_seqlens is int32).
  const int page_size = static_cast<int>(p.page_size);
  const bool page_pow2 = (page_size & (page_size - 1)) == 0;
  const int page_shift = __ffs(page_size) - 1;
  // All kU keys' loads of a step are issued before any is used. (Register double buffering of the
  // next step was measured slower on H100: ~209 registers leave 2 CTAs per SM.)
  auto load_step = [&](int step, uint4 (&kr)[kU], uint4 (&vr)[kU]) {
    const int base = group * kU + step * kGroups * kU;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      const int rel = base + u;
      if (rel < span && d_active) {
        const int pos = static_cast<int>(k0) + rel;
        int64_t phys = contiguous_row, in_page = pos;
        if (p.paged) {
          const int page = page_pow2 ? pos >> page_shift : pos / page_size;
          in_page = pos - page * page_size;
          phys = physical_page(p, b, page);
        }
        if (page_in_range(p, phys)) {
          const int64_t ko = phys * p.k_cache.batch_stride + in_page * p.k_cache.row_stride + hk * p.k_cache.head_stride;
          const int64_t vo = phys * p.v_cache.batch_stride + in_page * p.v_cache.row_stride + hk * p.v_cache.head_stride;
          kr[u] = __ldcs(reinterpret_cast<const uint4*>(kc + ko + d0));
          vr[u] = __ldcs(reinterpret_cast<const uint4*>(vc + vo + d0));
        } else {
          bad = true;
        }
      }
    }
  };
  for (int step = 0; warp_first_group * kU + step * kGroups * kU < span; ++step) {
    const int base = group * kU + step * kGroups * kU;
    uint4 kraw[kU], vraw[kU];
    load_step(step, kraw, vraw);
    float s[kRows][kU];
    {
      float kf[kU][Tr::kVec];
#pragma unroll
      for (int u = 0; u < kU; ++u) to_float8(kraw[u], kf[u], T());
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < Tr::kVec; ++e) dot = fmaf(q[r][e], kf[u][e], dot);
          if (r < nrows) {
#pragma unroll
            for (int off = kG / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
          }
          const int rel = base + u;
          float sc = dot * score_scale;
          if (p.softcap > 0) sc = cap_scale * tanhf(sc);
          s[r][u] = (rel >= rel_lo[r] && rel < rel_hi[r]) ? sc : kNegInf;
        }
      }
    }
    float vf[kU][Tr::kVec];
#pragma unroll
    for (int u = 0; u < kU; ++u) to_float8(vraw[u], vf[u], T());
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float cmax = s[r][0];
#pragma unroll
      for (int u = 1; u < kU; ++u) cmax = fmaxf(cmax, s[r][u]);
      const float m_new = fmaxf(m[r], cmax);
      if (m_new == kNegInf) continue;  // nothing visible to this row yet
      const float alpha = exp2f(m[r] - m_new);
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < Tr::kVec; ++e) acc[r][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const float pu = exp2f(s[r][u] - m_new);
        l[r] += pu;
#pragma unroll
        for (int e = 0; e < Tr::kVec; ++e) acc[r][e] = fmaf(pu, vf[u][e], acc[r][e]);
      }
      m[r] = m_new;
    }
  }

  // Combine the groups' states.
  const bool any_bad = __syncthreads_or(bad);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < Tr::kVec; ++e) s_acc[group][r][d0 + e] = acc[r][e];
    if (lane_g == 0) {
      s_m[group][r] = m[r];
      s_l[group][r] = l[r];
    }
  }
  __syncthreads();
  if (tid < nrows) {
    float mx = kNegInf;
    for (int g = 0; g < kGroups; ++g) mx = fmaxf(mx, s_m[g][tid]);
    float total = 0.f;
    for (int g = 0; g < kGroups; ++g) {
      const float w = mx == kNegInf ? 0.f : exp2f(s_m[g][tid] - mx);
      s_w[g][tid] = w;
      total += w * s_l[g][tid];
    }
    for (int g = 0; g < kGroups; ++g) s_w[g][tid] = total > 0.f ? s_w[g][tid] / total : 0.f;
    s_lse[tid] = total > 0.f ? mx + log2f(total) : kNegInf;
  }
  __syncthreads();
  const float nan = __int_as_float(0x7fc00000);
  for (int idx = tid; idx < nrows * p.head_dim; idx += Tr::kThreads) {
    const int r = idx / static_cast<int>(p.head_dim), d = idx % static_cast<int>(p.head_dim);
    float o = 0.f;
    for (int g = 0; g < kGroups; ++g) o = fmaf(s_w[g][r], s_acc[g][r][d], o);
    if (any_bad) o = nan;
    const int64_t rr = row0 + r, h = hk * group_size + rr / p.seqlen_q, i = rr % p.seqlen_q;
    if (so.num_splits == 1) {
      static_cast<T*>(p.out.data)[offset_of(p.out, b, i, h) + d] = from_float<T>(o);
    } else {
      so.part_o[((((int64_t)split * p.batch + b) * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + d] = o;
    }
  }
  if (tid < nrows) {
    const int64_t rr = row0 + tid, h = hk * group_size + rr / p.seqlen_q, i = rr % p.seqlen_q;
    const float lse = any_bad ? nan : (s_lse[tid] == kNegInf ? kNegInf : s_lse[tid] * kLn2);
    if (so.num_splits == 1) {
      if (p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
    } else {
      so.part_lse[(((int64_t)split * p.batch + b) * p.heads_q + h) * p.seqlen_q + i] = lse;
    }
  }
  if (any_bad && tid == 0 && p.error_flag) *p.error_flag = 1;
}

// ---------------------------------------------------------------------------------------------
// Merge: one warp per (b, i, h) row. A NaN part poisons the row; all parts -inf give 0 / -inf.
// ---------------------------------------------------------------------------------------------
template <typename OutT>
__global__ void __launch_bounds__(DecodeTraits::kMergeThreads) merge_kernel(MergeParams p) {
  constexpr int kWarp = DecodeTraits::kWarp;
  const float kNegInf = -__int_as_float(0x7f800000);
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= p.batch * p.seqlen_q * p.heads) return;
  const int64_t h = row % p.heads, i = (row / p.heads) % p.seqlen_q, b = row / (p.heads * p.seqlen_q);
  const float* lp = p.lse_partials + b * p.lp_batch_stride + h * p.lp_head_stride + i * p.lp_row_stride;
  const float* op = p.out_partials + b * p.op_batch_stride + i * p.op_row_stride + h * p.op_head_stride;
  float mx = kNegInf;
  int has_nan = 0;
  for (int64_t s = lane; s < p.parts; s += kWarp) {
    const float x = lp[s * p.lp_part_stride];
    if (isnan(x)) has_nan = 1;
    else mx = fmaxf(mx, x);
  }
  has_nan = __any_sync(0xffffffffu, has_nan);
  for (int off = kWarp / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float lse;
  if (has_nan) {
    lse = __int_as_float(0x7fc00000);
  } else if (mx == kNegInf) {
    lse = kNegInf;
  } else {
    float total = 0.f;
    for (int64_t s = lane; s < p.parts; s += kWarp) total += __expf(lp[s * p.lp_part_stride] - mx);
    for (int off = kWarp / 2; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    lse = mx + __logf(total);
  }
  OutT* out = static_cast<OutT*>(p.out.data) + offset_of(p.out, b, i, h);
  for (int64_t d = lane; d < p.head_dim; d += kWarp) {
    float x = 0.f;
    if (has_nan) {
      x = lse;
    } else if (mx != kNegInf) {
      for (int64_t s = 0; s < p.parts; ++s) {
        const float l = lp[s * p.lp_part_stride];
        if (l != kNegInf) x = fmaf(__expf(l - lse), op[s * p.op_part_stride + d], x);
      }
    }
    out[d] = from_float<OutT>(x);
  }
  if (lane == 0 && p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + i * p.lse.row_stride] = lse;
}

}  // namespace flashcore::cuda::decode
