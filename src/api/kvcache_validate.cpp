// Argument validation of fc_attention_kvcache and fc_merge_partials, built from the shared rules in
// validate_util.hpp so messages keep the project's format "<argument>: <what is wrong> (<rule>)".
// For CPU tensors the values inside cache_seqlens / cache_batch_idx / block_table are checked here
// on the host (nothing is written on failure); CUDA tensors are checked on the device by the kernels.
#include <cmath>
#include <string>
#include <vector>

#include "api/kvcache_backends.hpp"
#include "api/validate_util.hpp"

namespace flashcore {
namespace {
using namespace validate_detail;

struct KvLimits {
  static constexpr int64_t kMaxHeadDim = 256;
  static constexpr int32_t kMaxSplits = 256;  // bounds the workspace and the combine loop
};

std::string str(int64_t x) { return std::to_string(x); }

TensorRef ref4(const fc_tensor* t) { return {t->data, t->strides[0], t->strides[1], t->strides[2]}; }

Status check_int_vector(const fc_tensor* t, const char* name, int64_t len, const fc_tensor* q, const char* rule) {
  Extent e;
  Status s;
  if (!(s = check_tensor_basics(t, name, 1, &e)).is_ok()) return s;
  if (!(s = check_dtype(t, name, FC_DTYPE_I32, "indices and lengths are int32")).is_ok()) return s;
  if (!(s = check_same_device(t, name, q, "q")).is_ok()) return s;
  return check_shape(t, name, {len}, rule);
}

/** The options rules of the forward call that apply here (varlen fields must be unset; ALiBi slopes
 *  as the forward takes them, q's shape already in p). */
Status apply_options(const fc_attention_options& opt, const fc_tensor* q, KvCacheParams* p) {
  if (opt.cu_seqlens_q || opt.cu_seqlens_k)
    return Status::invalid(std::string(opt.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k") +
                           ": must be null for fc_attention_kvcache (lengths come from cache_seqlens)");
  // The forward's fields with a KV-cache counterpart: set here they would be ignored.
  if (opt.block_table)
    return Status::invalid("block_table: must be null in fc_attention_options for fc_attention_kvcache (a paged "
                           "cache's table is fc_kvcache_args.block_table)");
  if (opt.error_flag)
    return Status::invalid("error_flag: must be null in fc_attention_options for fc_attention_kvcache (its flag is "
                           "fc_kvcache_args.error_flag)");
  if (opt.dropout_p != 0)
    return Status::invalid("dropout_p: must be 0 for fc_attention_kvcache (inference; flash_attn_with_kvcache has no "
                           "dropout)");
  ResolvedOptions ro;
  Status s = check_common_options(opt, p->head_dim, &ro);
  if (!s.is_ok()) return s;
  if (opt.alibi_slopes &&
      !(s = check_alibi_slopes(*opt.alibi_slopes, p->batch, p->heads_q, q, &p->alibi_slopes, &p->alibi_batch_stride))
           .is_ok())
    return s;
  p->softmax_scale = ro.softmax_scale;
  p->softcap = ro.softcap;
  p->causal = opt.causal != 0;
  p->window_left = ro.window_left;
  p->window_right = ro.window_right;
  p->num_threads = opt.num_threads;
  p->sm_margin = opt.sm_margin;
  p->stream = opt.stream;
  return Status::ok();
}

/** rotary_cos / rotary_sin: both, with k_new appended, (rows >= 1, half) tables with 2 half <=
 *  head_dim, float32 or q's dtype, on q's device (rows contiguous: check_tensor_basics). Fills p->rotary (its
 *  per_token_queries from the resolved window, so apply_options must have run). */
Status check_rotary(const fc_kvcache_args& a, KvCacheParams* p, Extent* ecos, Extent* esin) {
  if (!a.rotary_cos || !a.rotary_sin) return Status::invalid("rotary_cos, rotary_sin: give both or neither");
  if (!a.k_new)
    return Status::invalid("rotary_cos: rotary embedding applies only when k_new and v_new are appended (as in flash_attn)");
  Status s;
  const fc_tensor* tables[] = {a.rotary_cos, a.rotary_sin};
  const char* names[] = {"rotary_cos", "rotary_sin"};
  Extent* extents[] = {ecos, esin};
  for (int i = 0; i < 2; ++i) {
    const fc_tensor* t = tables[i];
    if (!(s = check_tensor_basics(t, names[i], 2, extents[i])).is_ok()) return s;
    if (t->dtype != FC_DTYPE_F32 && t->dtype != a.q->dtype)
      return Status::invalid(std::string(names[i]) + ": dtype " + dtype_name(t->dtype) + " is not supported (float32 or q's " +
                             dtype_name(a.q->dtype) + ")");
    if (!(s = check_same_device(t, names[i], a.q, "q")).is_ok()) return s;
  }
  const fc_tensor& c = *a.rotary_cos;
  if (a.rotary_sin->shape[0] != c.shape[0] || a.rotary_sin->shape[1] != c.shape[1] || a.rotary_sin->dtype != c.dtype)
    return Status::invalid("rotary_sin: shape " + shape_str(*a.rotary_sin) + " and dtype " + dtype_name(a.rotary_sin->dtype) +
                           " must match rotary_cos's " + shape_str(c) + " " + dtype_name(c.dtype));
  if (c.shape[0] < 1 || c.shape[1] < 1 || 2 * c.shape[1] > p->head_dim)
    return Status::invalid("rotary_cos: shape " + shape_str(c) + " needs at least one row and rotary_dim = 2 x " +
                           str(c.shape[1]) + " <= head_dim " + str(p->head_dim) +
                           " (the tables are (seqlen_ro, rotary_dim / 2))");
  RotaryTables& r = p->rotary;
  r.cos = c.data;
  r.sin = a.rotary_sin->data;
  r.dtype = static_cast<DType>(c.dtype);
  r.cos_row_stride = c.strides[0];
  r.sin_row_stride = a.rotary_sin->strides[0];
  r.rows = c.shape[0];
  r.half = c.shape[1];
  r.interleaved = a.rotary_interleaved != 0;
  // flash_attn's rule: a window side as wide as the cache counts as unbounded; what is left bounded
  // (causal folds into right = 0) makes the queries take a position each.
  const int64_t capacity = p->capacity();
  r.per_token_queries = (p->window_left >= 0 && p->window_left < capacity) ||
                        (p->window_right >= 0 && p->window_right < capacity);
  return Status::ok();
}

}  // namespace

Status check_kvcache_host_values(const KvCacheParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t end = cache_end(p, b), start = cache_start(p, b);
    if (end < 0) return Status::invalid("cache_seqlens: entry " + str(b) + " is negative (" + str(end) + ")");
    if (start < 0 || start > end)
      return Status::invalid("cache_leftpad: entry " + str(b) + " is " + str(start) + ", outside 0.." +
                             (p.cache_seqlens ? "cache_seqlens[" + str(b) + "]" : std::string("the cache capacity")) +
                             " = " + str(end));
    if (end + p.seqlen_new > p.capacity()) {
      const std::string what = p.seqlen_new > 0 ? " + seqlen_new " + str(p.seqlen_new) : "";
      return Status::invalid("cache_seqlens: entry " + str(b) + " (" + str(end) + ")" + what +
                             " exceeds the cache capacity of " + str(p.capacity()) + " tokens per sequence");
    }
    if (p.rotary.on() && end + rotary_span(p) > p.rotary.rows)
      return Status::invalid("rotary_cos: has " + str(p.rotary.rows) + " rows, but cache_seqlens[" + str(b) + "] = " +
                             str(end) + " and the new tokens reach position " + str(end + rotary_span(p) - 1));
    if (!p.paged) {
      const int64_t row = cache_row_of(p, b);
      if (p.cache_batch_idx && (row < 0 || row >= p.cache_rows))
        return Status::invalid("cache_batch_idx: entry " + str(b) + " is " + str(row) + ", outside 0.." +
                               str(p.cache_rows - 1) + " (k_cache rows)");
      continue;
    }
    const int64_t pages_used = (end + p.seqlen_new + p.page_size - 1) / p.page_size;
    for (int64_t pg = 0; pg < pages_used; ++pg) {
      const int64_t id = physical_page(p, b, pg);
      if (!page_in_range(p, id))
        return Status::invalid("block_table: entry [" + str(b) + ", " + str(pg) + "] is page " + str(id) +
                               ", outside 0.." + str(p.cache_rows - 1) + " (k_cache pages)");
    }
  }
  return Status::ok();
}

Status validate_kvcache(const fc_kvcache_args* args, const fc_attention_options* opt_in, KvCacheParams* p) {
  if (args == nullptr) return Status::invalid("args: is null (an fc_kvcache_args is required)");
  const fc_kvcache_args& a = *args;
  fc_attention_options defaults{};
  const fc_attention_options& opt = opt_in ? *opt_in : defaults;
  Status s;
  Extent eq, ekc, evc, ekn, evn, eo, el;
  if (!(s = check_tensor_basics(a.q, "q", 4, &eq)).is_ok()) return s;
  if (!(s = check_tensor_basics(a.k_cache, "k_cache", 4, &ekc)).is_ok()) return s;
  if (!(s = check_tensor_basics(a.v_cache, "v_cache", 4, &evc)).is_ok()) return s;
  const fc_tensor* q = a.q;
  if (q->dtype != FC_DTYPE_F32 && q->dtype != FC_DTYPE_F16 && q->dtype != FC_DTYPE_BF16)
    return Status::invalid(std::string("q: dtype ") + dtype_name(q->dtype) + " is not supported (float32, float16 or bfloat16)");
  if (!(s = check_dtype(a.k_cache, "k_cache", q->dtype, "k_cache must have q's dtype")).is_ok()) return s;
  if (!(s = check_dtype(a.v_cache, "v_cache", q->dtype, "v_cache must have q's dtype")).is_ok()) return s;
  if (!(s = check_same_device(a.k_cache, "k_cache", q, "q")).is_ok()) return s;
  if (!(s = check_same_device(a.v_cache, "v_cache", q, "q")).is_ok()) return s;

  const int64_t batch = q->shape[0], seqlen_q = q->shape[1], heads_q = q->shape[2], head_dim = q->shape[3];
  if (head_dim <= 0 || head_dim > KvLimits::kMaxHeadDim)
    return Status::invalid("q: head_dim " + str(head_dim) + " is outside 1.." + str(KvLimits::kMaxHeadDim));
  if (heads_q <= 0) return Status::invalid("q: number of heads " + str(heads_q) + " must be >= 1");
  const int64_t heads_kv = a.k_cache->shape[2];
  if (a.k_cache->shape[3] != head_dim)
    return Status::invalid("k_cache: head_dim " + str(a.k_cache->shape[3]) + " does not match q head_dim " + str(head_dim));
  if (heads_kv <= 0) return Status::invalid("k_cache: number of heads " + str(heads_kv) + " must be >= 1");
  if (heads_q % heads_kv != 0)
    return Status::invalid("k_cache: heads_kv " + str(heads_kv) + " does not divide q heads " + str(heads_q) +
                           " (heads_q must be a multiple of heads_kv)");
  if (!(s = check_shape(a.v_cache, "v_cache", std::vector<int64_t>(a.k_cache->shape, a.k_cache->shape + 4),
                        "v_cache must have k_cache's shape")).is_ok())
    return s;

  p->dtype = static_cast<DType>(q->dtype);
  p->device_type = q->device_type;
  p->device_id = q->device_type == FC_DEVICE_CUDA ? q->device_id : 0;
  p->batch = batch;
  p->seqlen_q = seqlen_q;
  p->heads_q = heads_q;
  p->heads_kv = heads_kv;
  p->head_dim = head_dim;
  p->q = ref4(q);
  p->k_cache = ref4(a.k_cache);
  p->v_cache = ref4(a.v_cache);
  p->cache_rows = a.k_cache->shape[0];
  p->page_size = a.k_cache->shape[1];

  if (a.cache_seqlens == nullptr) {
    // Every sequence fills its cache (cache_end): no lengths to read, and none to append after.
    // Given lengths are int32, and so are the kernels' key counts: a full cache must fit them.
    if (a.k_new != nullptr || a.v_new != nullptr)
      return Status::invalid("cache_seqlens: is null, but k_new / v_new are given (the lengths say where they go)");
  } else {
    if (!(s = check_int_vector(a.cache_seqlens, "cache_seqlens", batch, q, "cache_seqlens is (batch,)")).is_ok())
      return s;
    p->cache_seqlens = static_cast<const int32_t*>(a.cache_seqlens->data);
    p->cache_seqlens_stride = a.cache_seqlens->strides[0];
  }

  if (a.block_table) {
    Extent e;
    p->paged = true;
    if (a.cache_batch_idx)
      return Status::invalid("cache_batch_idx: must be null with a paged cache (block_table selects the pages)");
    if (!(s = check_tensor_basics(a.block_table, "block_table", 2, &e)).is_ok()) return s;
    if (!(s = check_dtype(a.block_table, "block_table", FC_DTYPE_I32, "page ids are int32")).is_ok()) return s;
    if (!(s = check_same_device(a.block_table, "block_table", q, "q")).is_ok()) return s;
    if (a.block_table->shape[0] != batch)
      return Status::invalid("block_table: shape " + shape_str(*a.block_table) + " has " + str(a.block_table->shape[0]) +
                             " rows, expected batch " + str(batch) + " (block_table is (batch, max_pages_per_seq))");
    if (p->page_size < 1)
      return Status::invalid("k_cache: page_size " + str(p->page_size) + " must be >= 1 (paged k_cache is (num_pages, page_size, heads_kv, head_dim))");
    p->pages_per_seq = a.block_table->shape[1];
    p->block_table = static_cast<const int32_t*>(a.block_table->data);
    p->block_table_batch_stride = a.block_table->strides[0];
    p->block_table_page_stride = a.block_table->strides[1];
  } else if (a.cache_batch_idx) {
    if (!(s = check_int_vector(a.cache_batch_idx, "cache_batch_idx", batch, q, "cache_batch_idx is (batch,)")).is_ok())
      return s;
    p->cache_batch_idx = static_cast<const int32_t*>(a.cache_batch_idx->data);
    p->cache_batch_idx_stride = a.cache_batch_idx->strides[0];
  } else if (p->cache_rows != batch) {
    return Status::invalid("k_cache: shape " + shape_str(*a.k_cache) + " has " + str(p->cache_rows) +
                           " cache rows but q has batch " + str(batch) +
                           " (without cache_batch_idx or block_table, sequence b uses cache row b)");
  }

  if (!p->cache_seqlens && p->capacity() > INT32_MAX)  // (capacity known now: paged or not)
    return Status::invalid("cache_seqlens: is null, so every sequence holds its whole cache of " + str(p->capacity()) +
                           " tokens, more than int32 lengths allow");

  if ((a.k_new == nullptr) != (a.v_new == nullptr))
    return Status::invalid(a.k_new ? "v_new: is null but k_new is given (append needs both)"
                                   : "k_new: is null but v_new is given (append needs both)");
  if (a.k_new) {
    if (!(s = check_tensor_basics(a.k_new, "k_new", 4, &ekn)).is_ok()) return s;
    if (!(s = check_tensor_basics(a.v_new, "v_new", 4, &evn)).is_ok()) return s;
    const int64_t seqlen_new = a.k_new->shape[1];
    if (!(s = check_shape(a.k_new, "k_new", {batch, seqlen_new, heads_kv, head_dim},
                          "k_new is (batch, seqlen_new, heads_kv, head_dim)")).is_ok())
      return s;
    if (!(s = check_shape(a.v_new, "v_new", {batch, seqlen_new, heads_kv, head_dim}, "v_new must have k_new's shape")).is_ok())
      return s;
    if (!(s = check_dtype(a.k_new, "k_new", q->dtype, "k_new must have q's dtype")).is_ok()) return s;
    if (!(s = check_dtype(a.v_new, "v_new", q->dtype, "v_new must have q's dtype")).is_ok()) return s;
    if (!(s = check_same_device(a.k_new, "k_new", q, "q")).is_ok()) return s;
    if (!(s = check_same_device(a.v_new, "v_new", q, "q")).is_ok()) return s;
    p->seqlen_new = seqlen_new;
    p->k_new = ref4(a.k_new);
    p->v_new = ref4(a.v_new);
  }

  if (!(s = apply_options(opt, q, p)).is_ok()) return s;
  Extent elp, ecos, esin;
  if (a.cache_leftpad) {
    if (a.block_table)
      return Status::invalid("cache_leftpad: not supported with a paged cache (block_table), as in flash_attn");
    if (!(s = check_int_vector(a.cache_leftpad, "cache_leftpad", batch, q, "cache_leftpad is (batch,)")).is_ok())
      return s;
    check_tensor_basics(a.cache_leftpad, "cache_leftpad", 1, &elp);
    p->cache_leftpad = static_cast<const int32_t*>(a.cache_leftpad->data);
    p->cache_leftpad_stride = a.cache_leftpad->strides[0];
  }
  if (a.rotary_cos || a.rotary_sin) {
    if (!(s = check_rotary(a, p, &ecos, &esin)).is_ok()) return s;
  }
  if (a.num_splits < 0 || a.num_splits > KvLimits::kMaxSplits)
    return Status::invalid("num_splits: " + str(a.num_splits) + " is outside 0.." + str(KvLimits::kMaxSplits) +
                           " (0 = heuristic, 1 = no split)");
  p->num_splits = a.num_splits;
  p->error_flag = a.error_flag;

  // Outputs.
  if (!(s = check_tensor_basics(a.out, "out", 4, &eo)).is_ok()) return s;
  if (!(s = check_shape(a.out, "out", std::vector<int64_t>(q->shape, q->shape + 4), "out must have q's shape")).is_ok())
    return s;
  if (!(s = check_dtype(a.out, "out", q->dtype, "out must have q's dtype")).is_ok()) return s;
  if (!(s = check_same_device(a.out, "out", q, "q")).is_ok()) return s;
  if (!(s = check_no_self_overlap(a.out, "out")).is_ok()) return s;
  p->out = ref4(a.out);
  if (a.lse) {
    if (!(s = check_tensor_basics(a.lse, "lse", 3, &el)).is_ok()) return s;
    if (!(s = check_dtype(a.lse, "lse", FC_DTYPE_F32, "lse is float32")).is_ok()) return s;
    if (!(s = check_same_device(a.lse, "lse", q, "q")).is_ok()) return s;
    if (!(s = check_shape(a.lse, "lse", {batch, heads_q, seqlen_q}, "lse is (batch, heads_q, seqlen_q)")).is_ok()) return s;
    if (!(s = check_no_self_overlap(a.lse, "lse")).is_ok()) return s;
    p->lse = {static_cast<float*>(a.lse->data), a.lse->strides[0], a.lse->strides[1], a.lse->strides[2]};
  }

  // Aliasing: what is written (out, lse, and the caches when appending) must not overlap what is read.
  const fc_tensor* ins[] = {q,          a.k_cache,   a.v_cache,       a.k_new,      a.v_new,      a.cache_seqlens,
                            a.rotary_cos, a.rotary_sin, a.cache_leftpad, a.block_table, a.cache_batch_idx,
                            opt.alibi_slopes};
  const char* in_names[] = {"q",          "k_cache",    "v_cache",       "k_new",       "v_new",          "cache_seqlens",
                            "rotary_cos", "rotary_sin", "cache_leftpad", "block_table", "cache_batch_idx",
                            "alibi_slopes"};
  constexpr int kInputs = 12;
  Extent ein[kInputs] = {eq, ekc, evc, ekn, evn, {}, ecos, esin, elp};
  for (int i = 5; i < kInputs; ++i)
    if (ins[i] && (i == 5 || i > 8)) check_tensor_basics(ins[i], in_names[i], ins[i]->ndim, &ein[i]);  // validated above
  const fc_tensor* outs[] = {a.out, a.lse};
  const Extent* eouts[] = {&eo, &el};
  const char* out_names[] = {"out", "lse"};
  for (int o = 0; o < 2; ++o) {
    if (!outs[o]) continue;
    for (int i = 0; i < kInputs; ++i)
      if (ins[i] && !(s = check_disjoint(outs[o], *eouts[o], out_names[o], ins[i], ein[i], in_names[i])).is_ok()) return s;
  }
  if (a.lse && !(s = check_disjoint(a.lse, el, "lse", a.out, eo, "out")).is_ok()) return s;
  if (a.k_new) {
    // The caches are written: each element once, and not into anything else the call reads.
    if (!(s = check_no_self_overlap(a.k_cache, "k_cache")).is_ok()) return s;
    if (!(s = check_no_self_overlap(a.v_cache, "v_cache")).is_ok()) return s;
    if (!(s = check_disjoint(a.k_cache, ekc, "k_cache", a.v_cache, evc, "v_cache")).is_ok()) return s;
    for (int c = 1; c <= 2; ++c)
      for (int i = 0; i < kInputs; ++i)
        if (i != 1 && i != 2 && ins[i] &&
            !(s = check_disjoint(ins[c], ein[c], in_names[c], ins[i], ein[i], in_names[i])).is_ok())
          return s;
  }
  return Status::ok();
}

Status validate_merge(const fc_tensor* op, const fc_tensor* lp, const fc_tensor* out, const fc_tensor* lse,
                      const fc_attention_options* opt_in, MergeParams* p) {
  // An fc_tensor holds at most FC_MAX_DIMS = 4 dimensions, so out_partials comes with batch and
  // seqlen_q merged: (num_parts, batch * seqlen_q, heads, head_dim), rows ordered (b, i).
  Extent eop, elp, eo, el;
  Status s;
  if (!(s = check_tensor_basics(out, "out", 4, &eo)).is_ok()) return s;
  if (out->dtype == FC_DTYPE_I32)
    return Status::invalid("out: dtype int32 is not supported (float32, float16 or bfloat16)");
  const int64_t batch = out->shape[0], seqlen_q = out->shape[1], heads = out->shape[2], head_dim = out->shape[3];
  if (!(s = check_tensor_basics(op, "out_partials", 4, &eop)).is_ok()) return s;
  if (!(s = check_tensor_basics(lp, "lse_partials", 4, &elp)).is_ok()) return s;
  if (!(s = check_dtype(op, "out_partials", FC_DTYPE_F32, "partials are float32")).is_ok()) return s;
  if (!(s = check_dtype(lp, "lse_partials", FC_DTYPE_F32, "partials are float32")).is_ok()) return s;
  if (!(s = check_same_device(op, "out_partials", out, "out")).is_ok()) return s;
  if (!(s = check_same_device(lp, "lse_partials", out, "out")).is_ok()) return s;
  const int64_t parts = op->shape[0];
  if (parts < 1) return Status::invalid("out_partials: has no parts (num_parts must be >= 1)");
  if (!(s = check_shape(op, "out_partials", {parts, batch * seqlen_q, heads, head_dim},
                        "out_partials is (num_parts, batch * seqlen_q, heads, head_dim), batch/seqlen_q/heads/head_dim "
                        "of out")).is_ok())
    return s;
  if (!(s = check_shape(lp, "lse_partials", {parts, batch, heads, seqlen_q},
                        "lse_partials is (num_parts, batch, heads, seqlen_q)")).is_ok())
    return s;
  if (!(s = check_no_self_overlap(out, "out")).is_ok()) return s;
  if (!(s = check_disjoint(out, eo, "out", op, eop, "out_partials")).is_ok()) return s;
  if (!(s = check_disjoint(out, eo, "out", lp, elp, "lse_partials")).is_ok()) return s;
  if (lse) {
    if (!(s = check_tensor_basics(lse, "lse", 3, &el)).is_ok()) return s;
    if (!(s = check_dtype(lse, "lse", FC_DTYPE_F32, "lse is float32")).is_ok()) return s;
    if (!(s = check_same_device(lse, "lse", out, "out")).is_ok()) return s;
    if (!(s = check_shape(lse, "lse", {batch, heads, seqlen_q}, "lse is (batch, heads, seqlen_q)")).is_ok()) return s;
    if (!(s = check_no_self_overlap(lse, "lse")).is_ok()) return s;
    if (!(s = check_disjoint(lse, el, "lse", op, eop, "out_partials")).is_ok()) return s;
    if (!(s = check_disjoint(lse, el, "lse", lp, elp, "lse_partials")).is_ok()) return s;
    if (!(s = check_disjoint(lse, el, "lse", out, eo, "out")).is_ok()) return s;
    p->lse = {static_cast<float*>(lse->data), lse->strides[0], lse->strides[1], lse->strides[2]};
  }
  fc_attention_options defaults{};
  const fc_attention_options& opt = opt_in ? *opt_in : defaults;
  if (opt.backend < FC_BACKEND_AUTO || opt.backend > FC_BACKEND_CUDA_SM90)
    return Status::invalid("backend: unknown backend code " + str(opt.backend));
  if (opt.num_threads < 0) return Status::invalid("num_threads: " + str(opt.num_threads) + " is negative (0 = all cores)");
  if (opt.sm_margin < 0) return Status::invalid("sm_margin: " + str(opt.sm_margin) + " is negative (0 = every SM)");

  p->out_dtype = static_cast<DType>(out->dtype);
  p->device_type = out->device_type;
  p->device_id = out->device_type == FC_DEVICE_CUDA ? out->device_id : 0;
  p->out_partials = static_cast<const float*>(op->data);
  p->op_part_stride = op->strides[0];
  // Merged (b, i) rows: row r = b * seqlen_q + i sits at r * strides[1].
  p->op_row_stride = op->strides[1];
  p->op_batch_stride = op->strides[1] * seqlen_q;
  p->op_head_stride = op->strides[2];
  p->lse_partials = static_cast<const float*>(lp->data);
  p->lp_part_stride = lp->strides[0];
  p->lp_batch_stride = lp->strides[1];
  p->lp_head_stride = lp->strides[2];
  p->lp_row_stride = lp->strides[3];
  p->out = ref4(out);
  p->parts = parts;
  p->batch = batch;
  p->seqlen_q = seqlen_q;
  p->heads = heads;
  p->head_dim = head_dim;
  p->num_threads = opt.num_threads;
  p->stream = opt.stream;
  return Status::ok();
}

}  // namespace flashcore
