// flashcore C++ API: a thin, header-only layer over the C ABI (flashcore.h) that throws
// flashcore::Error instead of returning status codes and fills the option struct from named
// fields. Tensors stay fc_tensor views of caller-owned memory; make_tensor() builds a
// contiguous view.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "flashcore/flashcore.h"

namespace flashcore {

/** Thrown for every failed call; code() is the fc_status, what() the message naming the argument. */
class Error : public std::runtime_error {
 public:
  Error(fc_status code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  fc_status code() const { return code_; }

 private:
  fc_status code_;
};

using Tensor = fc_tensor;

/** A contiguous (row-major) view of `data` with the given shape. */
inline Tensor make_tensor(void* data, fc_dtype dtype, std::initializer_list<int64_t> shape,
                          fc_device_type device = FC_DEVICE_CPU, int32_t device_id = 0) {
  if (shape.size() > FC_MAX_DIMS) throw Error(FC_ERROR_INVALID_ARGUMENT, "make_tensor: more than FC_MAX_DIMS dimensions");
  Tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device_type = device;
  t.device_id = device_id;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

/** Named options; see fc_attention_options for each field's meaning. */
struct Options {
  double softmax_scale = 0;  // 0 = 1/sqrt(head_dim)
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  double softcap = 0;
  const Tensor* cu_seqlens_q = nullptr;
  const Tensor* cu_seqlens_k = nullptr;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  fc_backend backend = FC_BACKEND_AUTO;
  bool deterministic = false;
  void* stream = nullptr;  // cudaStream_t
  int32_t num_threads = 0;
  bool check_cu_seqlens = false;  // CUDA varlen: validate cu_seqlens on the host (synchronizes)
  int32_t* error_flag = nullptr;  // CUDA varlen: set to 1 on the device for bad cu_seqlens (no sync)
  const Tensor* block_table = nullptr;  // varlen forward: k / v are pages (fc_attention_options.block_table)
  const Tensor* alibi_slopes = nullptr;  // float32 (heads_q) or (batch, heads_q): ALiBi bias
  int32_t sm_margin = 0;  // CUDA: SMs left to concurrent work (fc_attention_options.sm_margin)
  double dropout_p = 0;   // dropout of the probabilities (fc_attention_options.dropout_p); 0 = none
  uint64_t dropout_seed = 0, dropout_offset = 0;  // the mask's Philox seed and offset

  fc_attention_options to_c() const {
    fc_attention_options o{};
    o.softmax_scale = softmax_scale;
    o.causal = causal;
    o.has_window = window_left != -1 || window_right != -1;
    o.window_left = window_left;
    o.window_right = window_right;
    o.softcap = softcap;
    o.cu_seqlens_q = cu_seqlens_q;
    o.cu_seqlens_k = cu_seqlens_k;
    o.max_seqlen_q = max_seqlen_q;
    o.max_seqlen_k = max_seqlen_k;
    o.backend = backend;
    o.deterministic = deterministic;
    o.stream = stream;
    o.num_threads = num_threads;
    o.check_cu_seqlens = check_cu_seqlens ? 1 : 0;
    o.error_flag = error_flag;
    o.block_table = block_table;
    o.alibi_slopes = alibi_slopes;
    o.sm_margin = sm_margin;
    o.dropout_p = dropout_p;
    o.dropout_seed = dropout_seed;
    o.dropout_offset = dropout_offset;
    return o;
  }
};

inline void check(fc_status s) {
  if (s != FC_OK) throw Error(s, fc_last_error());
}

inline size_t forward_workspace(const Tensor& q, const Tensor& k, const Tensor& v, const Options& opt = {}) {
  const fc_attention_options o = opt.to_c();
  size_t bytes = 0;
  check(fc_attention_forward_workspace(&q, &k, &v, &o, &bytes));
  return bytes;
}

inline size_t backward_workspace(const Tensor& q, const Tensor& k, const Tensor& v, const Options& opt = {}) {
  const fc_attention_options o = opt.to_c();
  size_t bytes = 0;
  check(fc_attention_backward_workspace(&q, &k, &v, &o, &bytes));
  return bytes;
}

/** out = attention(q, k, v); lse optional. workspace: forward_workspace() bytes on the device. */
inline void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor* lse = nullptr,
                    const Options& opt = {}, void* workspace = nullptr, size_t workspace_bytes = 0) {
  const fc_attention_options o = opt.to_c();
  check(fc_attention_forward(&q, &k, &v, &out, lse, &o, workspace, workspace_bytes));
}

/** dq, dk, dv from dout and the forward's out and lse. */
inline void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, const Options& opt = {},
                     void* workspace = nullptr, size_t workspace_bytes = 0) {
  const fc_attention_options o = opt.to_c();
  check(fc_attention_backward(&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &o, workspace, workspace_bytes));
}

/** Arguments of attention against a KV cache; see fc_kvcache_args (flashcore.h) for every field.
 *  q, k_cache, v_cache and out are required; cache_seqlens too when k_new / v_new are appended
 *  (without it every sequence fills its cache); null pointers leave a feature off. */
struct KvCacheArgs {
  const Tensor* q = nullptr;
  const Tensor* k_cache = nullptr;  // written in place when k_new is given
  const Tensor* v_cache = nullptr;
  const Tensor* cache_seqlens = nullptr;
  const Tensor* block_table = nullptr;      // paged caches
  const Tensor* cache_batch_idx = nullptr;  // contiguous caches
  const Tensor* k_new = nullptr;            // appended before attending
  const Tensor* v_new = nullptr;
  Tensor* out = nullptr;
  Tensor* lse = nullptr;
  int32_t num_splits = 0;  // 0 = heuristic
  int32_t* error_flag = nullptr;
  const Tensor* rotary_cos = nullptr;  // with k_new: rotary embedding of q and k_new
  const Tensor* rotary_sin = nullptr;
  bool rotary_interleaved = true;        // GPT-J pairs (flash_attn's default); false: GPT-NeoX
  const Tensor* cache_leftpad = nullptr;  // contiguous caches: each sequence's first slot

  fc_kvcache_args to_c() const {
    fc_kvcache_args a{};
    a.q = q;
    a.k_cache = k_cache;
    a.v_cache = v_cache;
    a.cache_seqlens = cache_seqlens;
    a.block_table = block_table;
    a.cache_batch_idx = cache_batch_idx;
    a.k_new = k_new;
    a.v_new = v_new;
    a.out = out;
    a.lse = lse;
    a.num_splits = num_splits;
    a.error_flag = error_flag;
    a.rotary_cos = rotary_cos;
    a.rotary_sin = rotary_sin;
    a.rotary_interleaved = rotary_interleaved ? 1 : 0;
    a.cache_leftpad = cache_leftpad;
    return a;
  }
};

inline size_t kvcache_workspace(const KvCacheArgs& args, const Options& opt = {}) {
  const fc_kvcache_args a = args.to_c();
  const fc_attention_options o = opt.to_c();
  size_t bytes = 0;
  check(fc_attention_kvcache_workspace(&a, &o, &bytes));
  return bytes;
}

/** Attention of args.q against the cache (flash_attn_with_kvcache); workspace: kvcache_workspace()
 *  bytes on the device (CUDA: split-KV partials, the rotated q, and for calls with many query rows
 *  the forward route's prefix sums, table and gathered pages), none on the CPU. opt.error_flag and
 *  opt.block_table must stay null (the call's own are args.error_flag and args.block_table). */
inline void kvcache(const KvCacheArgs& args, const Options& opt = {}, void* workspace = nullptr,
                    size_t workspace_bytes = 0) {
  const fc_kvcache_args a = args.to_c();
  const fc_attention_options o = opt.to_c();
  check(fc_attention_kvcache(&a, &o, workspace, workspace_bytes));
}

/** Merges (out, lse) partials over disjoint key sets; shapes as fc_merge_partials. */
inline void merge_partials(const Tensor& out_partials, const Tensor& lse_partials, Tensor& out, Tensor* lse = nullptr,
                           const Options& opt = {}) {
  const fc_attention_options o = opt.to_c();
  check(fc_merge_partials(&out_partials, &lse_partials, &out, lse, &o));
}

}  // namespace flashcore
