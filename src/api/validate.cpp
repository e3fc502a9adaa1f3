// Every rule of the public API, checked before any work starts. Messages follow one pattern:
// "<argument>: <what is wrong> (<the rule>)", so a user can fix the call without reading code.
#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "api/validate_util.hpp"
#include "common/env_switch.hpp"

namespace flashcore {
namespace validate_detail {

constexpr int64_t kMaxHeadDim = 256;

const char* dtype_name(int32_t t) {
  switch (t) {
    case FC_DTYPE_F32: return "float32";
    case FC_DTYPE_F16: return "float16";
    case FC_DTYPE_BF16: return "bfloat16";
    case FC_DTYPE_I32: return "int32";
    default: return "unknown";
  }
}

std::string device_name(const fc_tensor& t) {
  if (t.device_type == FC_DEVICE_CPU) return "cpu";
  if (t.device_type == FC_DEVICE_CUDA) return "cuda:" + std::to_string(t.device_id);
  return "device_type " + std::to_string(t.device_type);
}

std::string shape_str(const fc_tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.shape[i];
  s << "]";
  return s.str();
}

std::string expected_str(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

bool mul_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }
bool add_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); }


// Structural checks common to every tensor argument: ndim, sizes, strides, overflow.
Status check_tensor_basics(const fc_tensor* t, const char* name, int ndim, Extent* ext) {
  if (t == nullptr) return Status::invalid(std::string(name) + ": is null (a tensor is required)");
  if (t->ndim != ndim) {
    return Status::invalid(std::string(name) + ": has " + std::to_string(t->ndim) +
                           " dimensions, expected " + std::to_string(ndim));
  }
  if (t->dtype < FC_DTYPE_F32 || t->dtype > FC_DTYPE_I32)
    return Status::invalid(std::string(name) + ": unknown dtype code " + std::to_string(t->dtype));
  if (t->device_type != FC_DEVICE_CPU && t->device_type != FC_DEVICE_CUDA)
    return Status::invalid(std::string(name) + ": unknown device_type " +
                           std::to_string(t->device_type));
  if (t->device_id < 0)
    return Status::invalid(std::string(name) + ": device_id " + std::to_string(t->device_id) +
                           " is negative");
  const int64_t elem = t->dtype == FC_DTYPE_F16 || t->dtype == FC_DTYPE_BF16 ? 2 : 4;
  int64_t numel = 1;
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < ndim; ++i) {
    if (t->shape[i] < 0)
      return Status::invalid(std::string(name) + ": dimension " + std::to_string(i) + " has negative size " +
                             std::to_string(t->shape[i]));
    if (mul_overflows(numel, t->shape[i], &numel))
      return Status::invalid(std::string(name) + ": shape " + shape_str(*t) +
                             " has more elements than int64 can count");
  }
  for (int i = 0; i < ndim; ++i) {
    if (t->shape[i] <= 1) continue;
    int64_t span = 0;
    if (mul_overflows(t->strides[i], t->shape[i] - 1, &span))
      return Status::invalid(std::string(name) + ": stride " + std::to_string(t->strides[i]) + " x size " +
                             std::to_string(t->shape[i]) + " overflows int64");
    if (span >= 0 ? add_overflows(hi, span, &hi) : add_overflows(lo, span, &lo))
      return Status::invalid(std::string(name) + ": strides span more than int64 can address");
  }
  if (numel > 0) {
    if (t->data == nullptr) return Status::invalid(std::string(name) + ": data pointer is null");
    // Element access through a misaligned pointer is undefined in C++ and faults on a GPU.
    if (reinterpret_cast<uintptr_t>(t->data) % static_cast<uintptr_t>(elem) != 0)
      return Status::invalid(std::string(name) + ": data pointer is not aligned to its " + std::to_string(elem) +
                             "-byte elements");
    int64_t lo_b = 0, hi_b = 0;
    int64_t hi_end = 0;
    if (add_overflows(hi, 1, &hi_end) || mul_overflows(lo, elem, &lo_b) || mul_overflows(hi_end, elem, &hi_b))
      return Status::invalid(std::string(name) + ": byte extent overflows int64");
    lo = lo_b;
    hi = hi_b;
    // A view that fits int64 may still reach past any memory: a stride left unset by a C caller,
    // say. Spans beyond 2^57 bytes (the largest virtual address space, x86-64's 5-level paging)
    // and views whose addresses wrap around are refused instead of faulting in a kernel.
    constexpr int64_t kMaxSpanBytes = int64_t(1) << 57;
    if (hi > kMaxSpanBytes || lo < -kMaxSpanBytes)
      return Status::invalid(std::string(name) + ": its strides reach " + std::to_string(hi > kMaxSpanBytes ? hi : lo) +
                             " bytes from the data pointer, more than an address space holds (2^57)");
    const uintptr_t base = reinterpret_cast<uintptr_t>(t->data);
    if ((lo < 0 && base < static_cast<uintptr_t>(-lo)) || base + static_cast<uintptr_t>(hi) < base)
      return Status::invalid(std::string(name) + ": data pointer plus its strides wraps around the address space");
  }
  if (t->shape[ndim - 1] > 1 && t->strides[ndim - 1] != 1)
    return Status::invalid(std::string(name) + ": last dimension has stride " +
                           std::to_string(t->strides[ndim - 1]) + " (it must be contiguous, stride 1)");
  ext->numel = numel;
  ext->lo = numel > 0 ? lo : 0;
  ext->hi = numel > 0 ? hi : 0;
  return Status::ok();
}

Status check_shape(const fc_tensor* t, const char* name, const std::vector<int64_t>& expected,
                   const char* rule) {
  for (size_t i = 0; i < expected.size(); ++i) {
    if (t->shape[i] != expected[i]) {
      return Status::invalid(std::string(name) + ": shape " + shape_str(*t) + " does not match expected " +
                             expected_str(expected) + " (" + rule + ")");
    }
  }
  return Status::ok();
}

Status check_same_device(const fc_tensor* t, const char* name, const fc_tensor* ref, const char* ref_name) {
  if (t->device_type != ref->device_type || (t->device_type == FC_DEVICE_CUDA && t->device_id != ref->device_id)) {
    return Status::invalid(std::string(name) + ": is on " + device_name(*t) + " but " + ref_name + " is on " +
                           device_name(*ref) + " (all tensors must be on one device)");
  }
  return Status::ok();
}

Status check_dtype(const fc_tensor* t, const char* name, int32_t expected, const char* why) {
  if (t->dtype != expected) {
    return Status::invalid(std::string(name) + ": dtype " + dtype_name(t->dtype) + " does not match " +
                           dtype_name(expected) + " (" + why + ")");
  }
  return Status::ok();
}

/** An output must not write one element twice: sort dims by stride and require each stride to
 *  step past everything the smaller dims cover. */
Status check_no_self_overlap(const fc_tensor* t, const char* name) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] == 0) return Status::ok();
    if (t->shape[i] > 1) dims.push_back({t->strides[i], t->shape[i]});
  }
  std::sort(dims.begin(), dims.end());
  int64_t covered = 1;  // elements spanned by the dims processed so far
  for (auto& [stride, size] : dims) {
    if (stride < covered) {
      return Status::invalid(std::string(name) + ": strides make elements overlap (an output needs a "
                             "distinct memory location for every element)");
    }
    covered = stride * (size - 1) + covered;  // cannot overflow: extent was checked
  }
  return Status::ok();
}

Status check_disjoint(const fc_tensor* a, const Extent& ea, const char* an, const fc_tensor* b,
                      const Extent& eb, const char* bn) {
  if (ea.numel == 0 || eb.numel == 0) return Status::ok();
  if (a->device_type != b->device_type) return Status::ok();
  const auto base_a = reinterpret_cast<intptr_t>(a->data);
  const auto base_b = reinterpret_cast<intptr_t>(b->data);
  const intptr_t a0 = base_a + ea.lo, a1 = base_a + ea.hi;
  const intptr_t b0 = base_b + eb.lo, b1 = base_b + eb.hi;
  if (a0 < b1 && b0 < a1) {
    return Status::invalid(std::string(an) + ": memory overlaps " + bn +
                           " (outputs must not alias inputs or other outputs)");
  }
  return Status::ok();
}

// Check of a cu_seqlens array in host memory (batch + 1 contiguous entries): the array's own rules
// first, then max_seqlen against the lengths it gives, so that a broken array is named as such
// (a decrease makes a later "length" look long).
Status check_cu_seqlens_values(const int32_t* v, const char* name, int64_t batch, int64_t total,
                               int64_t max_seqlen, const char* max_name) {
  if (v[0] != 0)
    return Status::invalid(std::string(name) + ": starts at " + std::to_string(v[0]) + " (it must start at 0)");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t a = v[b], c = v[b + 1];
    if (c < a) {
      return Status::invalid(std::string(name) + ": decreases at index " + std::to_string(b + 1) + " (" +
                             std::to_string(a) + " -> " + std::to_string(c) + "; it must be non-decreasing)");
    }
  }
  const int64_t last = v[batch];
  if (last > total) {
    return Status::invalid(std::string(name) + ": last entry " + std::to_string(last) +
                           " exceeds the packed tensor's " + std::to_string(total) + " rows");
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = int64_t(v[b + 1]) - v[b];
    if (length > max_seqlen) {
      return Status::invalid(std::string(max_name) + ": " + std::to_string(max_seqlen) +
                             " is smaller than sequence " + std::to_string(b) + "'s length " +
                             std::to_string(length) + " given by " + name);
    }
  }
  return Status::ok();
}

/** A finite double that float32 represents without overflowing. */
bool fits_float(double x) { return std::fabs(x) <= std::numeric_limits<float>::max(); }

/** ... and, for a switch like softcap where 0 means "off", without flushing a nonzero to 0. */
bool fits_float_nonzero(double x) {
  return fits_float(x) && (x == 0 || std::fabs(x) >= std::numeric_limits<float>::denorm_min());
}

Status check_common_options(const fc_attention_options& opt, int64_t head_dim, ResolvedOptions* r) {
  if (!std::isfinite(opt.softmax_scale))
    return Status::invalid("softmax_scale: must be finite (0 selects 1/sqrt(head_dim))");
  if (!fits_float(opt.softmax_scale))
    return Status::invalid("softmax_scale: " + std::to_string(opt.softmax_scale) +
                           " is outside float32's range (kernels compute scores in float32)");
  if (!std::isfinite(opt.softcap) || opt.softcap < 0)
    return Status::invalid("softcap: must be finite and >= 0 (0 disables capping)");
  if (!fits_float_nonzero(opt.softcap))
    return Status::invalid("softcap: " + std::to_string(opt.softcap) + " is outside float32's range");
  int64_t wl = -1, wr = -1;
  if (opt.has_window) {
    if (opt.window_left < -1)
      return Status::invalid("window_left: " + std::to_string(opt.window_left) + " is below -1 (-1 = unbounded)");
    if (opt.window_right < -1)
      return Status::invalid("window_right: " + std::to_string(opt.window_right) + " is below -1 (-1 = unbounded)");
    wl = opt.window_left;
    wr = opt.window_right;
  }
  if (opt.causal) wr = 0;
  if (opt.backend < FC_BACKEND_AUTO || opt.backend > FC_BACKEND_CUDA_SM90)
    return Status::invalid("backend: unknown backend code " + std::to_string(opt.backend));
  if (opt.num_threads < 0)
    return Status::invalid("num_threads: " + std::to_string(opt.num_threads) + " is negative (0 = all cores)");
  if (opt.sm_margin < 0)
    return Status::invalid("sm_margin: " + std::to_string(opt.sm_margin) + " is negative (0 = every SM)");
  if (!std::isfinite(opt.dropout_p) || opt.dropout_p < 0 || opt.dropout_p >= 1)
    return Status::invalid("dropout_p: " + std::to_string(opt.dropout_p) + " is outside [0, 1) (0 = no dropout)");
  r->softmax_scale =
      static_cast<float>(opt.softmax_scale != 0 ? opt.softmax_scale : 1.0 / std::sqrt(double(head_dim)));
  r->softcap = static_cast<float>(opt.softcap);
  r->window_left = wl;
  r->window_right = wr;
  return Status::ok();
}

Status check_alibi_slopes(const fc_tensor& slopes, int64_t batch, int64_t heads_q, const fc_tensor* q,
                          const float** values_out, int64_t* batch_stride_out) {
  if (slopes.ndim != 1 && slopes.ndim != 2)
    return Status::invalid("alibi_slopes: has " + std::to_string(slopes.ndim) +
                           " dimensions, expected 1 (heads_q) or 2 (batch, heads_q)");
  Status s;
  Extent e;
  if (!(s = check_tensor_basics(&slopes, "alibi_slopes", slopes.ndim, &e)).is_ok()) return s;
  if (!(s = check_dtype(&slopes, "alibi_slopes", FC_DTYPE_F32, "ALiBi slopes are float32")).is_ok()) return s;
  if (!(s = check_same_device(&slopes, "alibi_slopes", q, "q")).is_ok()) return s;
  const bool per_batch = slopes.ndim == 2;
  const std::vector<int64_t> expected = per_batch ? std::vector<int64_t>{batch, heads_q} : std::vector<int64_t>{heads_q};
  if (!(s = check_shape(&slopes, "alibi_slopes", expected, "alibi_slopes is (heads_q) or (batch, heads_q)")).is_ok())
    return s;
  const float* values = static_cast<const float*>(slopes.data);
  const int64_t batch_stride = per_batch ? slopes.strides[0] : 0;
  if (q->device_type == FC_DEVICE_CPU) {
    for (int64_t b = 0; b < (per_batch ? batch : 1); ++b) {
      for (int64_t h = 0; h < heads_q; ++h) {
        if (!std::isfinite(values[b * batch_stride + h])) {
          return Status::invalid("alibi_slopes: entry " + (per_batch ? "[" + std::to_string(b) + ", " : std::string("[")) +
                                 std::to_string(h) + "] is not finite");
        }
      }
    }
  }
  *values_out = values;
  *batch_stride_out = batch_stride;
  return Status::ok();
}

}  // namespace validate_detail

namespace {
using namespace validate_detail;

/** alibi_slopes into p (check_alibi_slopes has the rules). */
Status apply_alibi(const fc_tensor& slopes, int64_t batch, const fc_tensor* q, AttentionParams* p) {
  return check_alibi_slopes(slopes, batch, p->heads_q, q, &p->alibi_slopes, &p->alibi_batch_stride);
}

/** Dropout's rules past its range (check_common_options): the Philox counter holds a key column
 *  below 2^29 (64-key blocks x 8 groups in 32 bits), a query row and b * heads_q + h in 32 bits
 *  (common/dropout.hpp). p->seqlen_q / seqlen_k bound every sequence's positions (varlen: the
 *  clamped max_seqlen). */
Status apply_dropout(const fc_attention_options& opt, AttentionParams* p) {
  if (opt.dropout_p == 0) return Status::ok();
  if (p->seqlen_k >= (int64_t(1) << 29))
    return Status::invalid("dropout_p: needs seqlen_k below 2^29 (got " + std::to_string(p->seqlen_k) + ")");
  if (p->seqlen_q > UINT32_MAX || p->batch * p->heads_q > UINT32_MAX)
    return Status::invalid("dropout_p: needs seqlen_q and batch * heads_q below 2^32");
  p->dropout = make_dropout(opt.dropout_p, opt.dropout_seed, opt.dropout_offset);
  // Keep probabilities are multiples of 2^-16: a p that rounds the keep probability to 0 would
  // drop everything and scale nothing by an infinite or huge factor (0 x inf = NaN).
  if (p->dropout.kept_threshold == 0)
    return Status::invalid("dropout_p: " + std::to_string(opt.dropout_p) +
                           " keeps nothing (keep probabilities are multiples of 2^-16: 1 - dropout_p must be >= 2^-17)");
  return Status::ok();
}

/** The options applied after the shapes are known: ALiBi slopes and dropout. */
Status apply_bias_and_dropout(const fc_attention_options& opt, int64_t batch, const fc_tensor* q, AttentionParams* p) {
  if (opt.alibi_slopes) {
    const Status s = apply_alibi(*opt.alibi_slopes, batch, q, p);
    if (!s.is_ok()) return s;
  }
  return apply_dropout(opt, p);
}

TensorRef dense_ref(const fc_tensor* t) {
  return {t->data, t->strides[0], t->strides[1], t->strides[2]};
}
TensorRef varlen_ref(const fc_tensor* t) { return {t->data, 0, t->strides[0], t->strides[1]}; }

/** block_table of a paged varlen forward: int32 (batch, max_pages_per_seq) on q's device, k / v
 *  (num_pages, page_size >= 1, ...). Fills p->pages. */
Status apply_pages(const fc_tensor& table, const fc_tensor& k, int64_t batch, const fc_tensor* q, AttentionParams* p) {
  Extent e;
  Status s;
  if (!(s = check_tensor_basics(&table, "block_table", 2, &e)).is_ok()) return s;
  if (!(s = check_dtype(&table, "block_table", FC_DTYPE_I32, "page ids are int32")).is_ok()) return s;
  if (!(s = check_same_device(&table, "block_table", q, "q")).is_ok()) return s;
  if (table.shape[0] != batch)
    return Status::invalid("block_table: shape " + shape_str(table) + " has " + std::to_string(table.shape[0]) +
                           " rows, expected batch " + std::to_string(batch) + " (block_table is (batch, max_pages_per_seq))");
  if (k.shape[0] < 1 || k.shape[1] < 1)
    return Status::invalid("k: shape " + shape_str(k) + " has no pages or empty pages (paged k is (num_pages >= 1, "
                           "page_size >= 1, heads_kv, head_dim))");
  p->pages.table = static_cast<const int32_t*>(table.data);
  p->pages.batch_stride = table.strides[0];
  p->pages.page_stride = table.strides[1];
  p->pages.page_size = k.shape[1];
  p->pages.num_pages = k.shape[0];
  p->pages.per_seq = table.shape[1];
  return Status::ok();
}

/** CPU paged calls: every sequence's keys fit its table row, and the page ids it uses exist. */
Status check_page_values(const AttentionParams& p, const int32_t* cu_k) {
  const KvPages& pg = p.pages;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = int64_t(cu_k[b + 1]) - cu_k[b];
    if (len > pg.per_seq * pg.page_size)
      return Status::invalid("cu_seqlens_k: sequence " + std::to_string(b) + " has " + std::to_string(len) +
                             " keys, more than its " + std::to_string(pg.per_seq) + " pages of " +
                             std::to_string(pg.page_size) + " hold (block_table)");
    for (int64_t c = 0; c < (len + pg.page_size - 1) / pg.page_size; ++c) {
      const int64_t id = pg.table[b * pg.batch_stride + c * pg.page_stride];
      if (id < 0 || id >= pg.num_pages)
        return Status::invalid("block_table: entry [" + std::to_string(b) + ", " + std::to_string(c) + "] is page " +
                               std::to_string(id) + ", outside 0.." + std::to_string(pg.num_pages - 1) + " (k pages)");
    }
  }
  return Status::ok();
}

/** Everything q, k, v, options, cu_seqlens have to satisfy, shared by forward and backward. */
Status validate_common(const fc_tensor* q, const fc_tensor* k, const fc_tensor* v,
                       const fc_attention_options* opt_in, AttentionParams* p, Extent* eq, Extent* ek,
                       Extent* ev) {
  fc_attention_options defaults{};
  const fc_attention_options& opt = opt_in ? *opt_in : defaults;

  const bool varlen = opt.cu_seqlens_q != nullptr || opt.cu_seqlens_k != nullptr;
  if (varlen && (opt.cu_seqlens_q == nullptr || opt.cu_seqlens_k == nullptr)) {
    return Status::invalid(opt.cu_seqlens_q ? "cu_seqlens_k: is null but cu_seqlens_q is given (varlen needs both)"
                                            : "cu_seqlens_q: is null but cu_seqlens_k is given (varlen needs both)");
  }
  const bool paged = opt.block_table != nullptr;
  if (paged && !varlen)
    return Status::invalid("block_table: paged K/V needs a varlen call (cu_seqlens_q / cu_seqlens_k given)");
  const int nd = varlen ? 3 : 4;
  const int kd = paged ? 4 : nd;  // paged k / v: (num_pages, page_size, heads_kv, head_dim)
  Status s;
  if (!(s = check_tensor_basics(q, "q", nd, eq)).is_ok()) return s;
  if (!(s = check_tensor_basics(k, "k", kd, ek)).is_ok()) return s;
  if (!(s = check_tensor_basics(v, "v", kd, ev)).is_ok()) return s;
  if (q->dtype != FC_DTYPE_F32 && q->dtype != FC_DTYPE_F16 && q->dtype != FC_DTYPE_BF16)
    return Status::invalid(std::string("q: dtype ") + dtype_name(q->dtype) +
                           " is not supported (float32, float16 or bfloat16)");
  if (!(s = check_dtype(k, "k", q->dtype, "k must have q's dtype")).is_ok()) return s;
  if (!(s = check_dtype(v, "v", q->dtype, "v must have q's dtype")).is_ok()) return s;
  if (!(s = check_same_device(k, "k", q, "q")).is_ok()) return s;
  if (!(s = check_same_device(v, "v", q, "q")).is_ok()) return s;

  const int hd = nd - 1, hh = nd - 2, khd = kd - 1, khh = kd - 2;
  const int64_t head_dim = q->shape[hd];
  if (head_dim <= 0 || head_dim > kMaxHeadDim) {
    return Status::invalid("q: head_dim " + std::to_string(head_dim) + " is outside 1.." +
                           std::to_string(kMaxHeadDim));
  }
  if (k->shape[khd] != head_dim)
    return Status::invalid("k: head_dim " + std::to_string(k->shape[khd]) + " does not match q head_dim " +
                           std::to_string(head_dim));
  if (v->shape[khd] != head_dim)
    return Status::invalid("v: head_dim " + std::to_string(v->shape[khd]) + " does not match q head_dim " +
                           std::to_string(head_dim) + " (a different value head_dim is not supported)");
  const int64_t heads_q = q->shape[hh], heads_kv = k->shape[khh];
  if (heads_q <= 0) return Status::invalid("q: number of heads " + std::to_string(heads_q) + " must be >= 1");
  if (heads_kv <= 0) return Status::invalid("k: number of heads " + std::to_string(heads_kv) + " must be >= 1");
  if (heads_q % heads_kv != 0) {
    return Status::invalid("k: heads_kv " + std::to_string(heads_kv) + " does not divide q heads " +
                           std::to_string(heads_q) + " (heads_q must be a multiple of heads_kv)");
  }
  if (!(s = check_shape(v, "v", std::vector<int64_t>(k->shape, k->shape + kd), "v must have k's shape")).is_ok())
    return s;

  // Options.
  ResolvedOptions ro;
  if (!(s = check_common_options(opt, head_dim, &ro)).is_ok()) return s;

  p->dtype = static_cast<DType>(q->dtype);
  p->device_type = q->device_type;
  p->device_id = q->device_type == FC_DEVICE_CUDA ? q->device_id : 0;
  p->heads_q = heads_q;
  p->heads_kv = heads_kv;
  p->head_dim = head_dim;
  p->softmax_scale = ro.softmax_scale;
  p->softcap = ro.softcap;
  p->causal = opt.causal != 0;
  p->window_left = ro.window_left;
  p->window_right = ro.window_right;
  p->deterministic = opt.deterministic != 0;
  p->num_threads = opt.num_threads;
  p->sm_margin = opt.sm_margin;
  p->stream = opt.stream;
  if (reinterpret_cast<uintptr_t>(opt.error_flag) % alignof(int32_t) != 0)
    return Status::invalid("error_flag: is not 4-byte aligned (it must point at an int32)");
  p->error_flag = opt.error_flag;

  if (!varlen) {
    const int64_t batch = q->shape[0];
    if (k->shape[0] != batch)
      return Status::invalid("k: batch " + std::to_string(k->shape[0]) + " does not match q batch " +
                             std::to_string(batch));
    p->batch = batch;
    p->seqlen_q = q->shape[1];
    p->seqlen_k = k->shape[1];
    p->total_q = batch * p->seqlen_q;
    p->total_k = batch * p->seqlen_k;
    p->q = dense_ref(q);
    p->k = dense_ref(k);
    p->v = dense_ref(v);
    return apply_bias_and_dropout(opt, batch, q, p);
  }

  const fc_tensor* cq = opt.cu_seqlens_q;
  const fc_tensor* ck = opt.cu_seqlens_k;
  Extent ecq, eck;
  if (!(s = check_tensor_basics(cq, "cu_seqlens_q", 1, &ecq)).is_ok()) return s;
  if (!(s = check_tensor_basics(ck, "cu_seqlens_k", 1, &eck)).is_ok()) return s;
  if (!(s = check_dtype(cq, "cu_seqlens_q", FC_DTYPE_I32, "cu_seqlens must be int32")).is_ok()) return s;
  if (!(s = check_dtype(ck, "cu_seqlens_k", FC_DTYPE_I32, "cu_seqlens must be int32")).is_ok()) return s;
  if (!(s = check_same_device(cq, "cu_seqlens_q", q, "q")).is_ok()) return s;
  if (!(s = check_same_device(ck, "cu_seqlens_k", q, "q")).is_ok()) return s;
  if (cq->shape[0] < 1) return Status::invalid("cu_seqlens_q: is empty (it needs batch + 1 >= 1 entries)");
  if (ck->shape[0] != cq->shape[0])
    return Status::invalid("cu_seqlens_k: has " + std::to_string(ck->shape[0]) + " entries but cu_seqlens_q has " +
                           std::to_string(cq->shape[0]) + " (both are batch + 1)");
  if (cq->shape[0] > 1 && cq->strides[0] != 1)
    return Status::invalid("cu_seqlens_q: must be contiguous (stride 1)");
  if (ck->shape[0] > 1 && ck->strides[0] != 1)
    return Status::invalid("cu_seqlens_k: must be contiguous (stride 1)");
  if (opt.max_seqlen_q < 0) return Status::invalid("max_seqlen_q: " + std::to_string(opt.max_seqlen_q) + " is negative");
  if (opt.max_seqlen_k < 0) return Status::invalid("max_seqlen_k: " + std::to_string(opt.max_seqlen_k) + " is negative");
  if (k->shape[0] != v->shape[0])
    return Status::invalid("v: total rows do not match k's");
  const int64_t batch = cq->shape[0] - 1;
  p->batch = batch;
  p->total_q = q->shape[0];
  // Paged keys are not packed: cu_seqlens_k only gives lengths (each within its pages, clamped
  // there by seq_info), so no packed total bounds them.
  p->total_k = paged ? INT32_MAX : k->shape[0];
  if (paged && !(s = apply_pages(*opt.block_table, *k, batch, q, p)).is_ok()) return s;
  // No sequence is longer than its packed tensor (paged: than its pages): a generous max_seqlen (an
  // engine's configured maximum) is clamped there, so backends never size grids or scratch from an
  // absurd value.
  p->seqlen_q = std::min<int64_t>(opt.max_seqlen_q, p->total_q);
  p->seqlen_k = std::min<int64_t>(opt.max_seqlen_k, paged ? p->pages.per_seq * p->pages.page_size : p->total_k);
  // CPU arrays are always checked. CUDA arrays only on request: reading them needs a host
  // synchronization, which a training step or a CUDA-graph capture must not have.
  const bool on_cpu = q->device_type == FC_DEVICE_CPU;
  if (on_cpu || opt.check_cu_seqlens != 0 || env_flag("FLASHCORE_CHECK_CU_SEQLENS")) {
    auto check = [&](const fc_tensor* cu, const char* name, int64_t total, int64_t max_seqlen, const char* max_name) {
      const int32_t* values = static_cast<const int32_t*>(cu->data);
      std::vector<int32_t> host;
      if (!on_cpu) {  // CUDA: a host copy first (in stream order)
        host.resize(static_cast<size_t>(batch + 1));
        const Status copied = cuda::copy_to_host(host.data(), values, host.size() * sizeof(int32_t), q->device_id, opt.stream);
        if (!copied.is_ok()) return Status::cuda(std::string(name) + ": " + copied.message);
        values = host.data();
      }
      return check_cu_seqlens_values(values, name, batch, total, max_seqlen, max_name);
    };
    if (!(s = check(cq, "cu_seqlens_q", p->total_q, opt.max_seqlen_q, "max_seqlen_q")).is_ok()) return s;
    if (!(s = check(ck, "cu_seqlens_k", p->total_k, opt.max_seqlen_k, "max_seqlen_k")).is_ok()) return s;
    if (paged && on_cpu && !(s = check_page_values(*p, static_cast<const int32_t*>(ck->data))).is_ok()) return s;
  }
  p->cu_seqlens_q = static_cast<const int32_t*>(cq->data);
  p->cu_seqlens_k = static_cast<const int32_t*>(ck->data);
  p->q = varlen_ref(q);
  p->k = paged ? dense_ref(k) : varlen_ref(k);
  p->v = paged ? dense_ref(v) : varlen_ref(v);
  return apply_bias_and_dropout(opt, batch, q, p);
}

/** lse: dense (batch, heads_q, seqlen_q), varlen (heads_q, total_q); fp32. */
Status validate_lse(const fc_tensor* lse, const char* name, const fc_tensor* q, const AttentionParams& p,
                    Extent* e) {
  Status s;
  const bool varlen = p.is_varlen();
  if (!(s = check_tensor_basics(lse, name, varlen ? 2 : 3, e)).is_ok()) return s;
  if (!(s = check_dtype(lse, name, FC_DTYPE_F32, "lse is float32")).is_ok()) return s;
  if (!(s = check_same_device(lse, name, q, "q")).is_ok()) return s;
  if (varlen) {
    if (!(s = check_shape(lse, name, {p.heads_q, p.total_q}, "varlen lse is (heads_q, total_q)")).is_ok()) return s;
  } else {
    if (!(s = check_shape(lse, name, {p.batch, p.heads_q, p.seqlen_q}, "lse is (batch, heads_q, seqlen_q)")).is_ok())
      return s;
  }
  return Status::ok();
}

LseRef lse_ref(const fc_tensor* lse, bool varlen) {
  if (varlen) return {static_cast<float*>(lse->data), 0, lse->strides[0], lse->strides[1]};
  return {static_cast<float*>(lse->data), lse->strides[0], lse->strides[1], lse->strides[2]};
}

Status validate_like(const fc_tensor* t, const char* name, const fc_tensor* ref, const char* ref_name,
                     Extent* e) {
  Status s;
  if (!(s = check_tensor_basics(t, name, ref->ndim, e)).is_ok()) return s;
  const std::string rule = std::string(name) + " must have " + ref_name + "'s shape";
  if (!(s = check_shape(t, name, std::vector<int64_t>(ref->shape, ref->shape + ref->ndim), rule.c_str())).is_ok())
    return s;
  const std::string drule = std::string(name) + " must have " + ref_name + "'s dtype";
  if (!(s = check_dtype(t, name, ref->dtype, drule.c_str())).is_ok()) return s;
  return check_same_device(t, name, ref, ref_name);
}

TensorRef ref_of(const fc_tensor* t, bool varlen) { return varlen ? varlen_ref(t) : dense_ref(t); }

}  // namespace

Status validate_forward(const ForwardArgs& a, bool for_workspace_query, AttentionParams* p) {
  Extent eq, ek, ev, eo, el;
  Status s = validate_common(a.q, a.k, a.v, a.options, p, &eq, &ek, &ev);
  if (!s.is_ok() || for_workspace_query) return s;
  if (!(s = validate_like(a.out, "out", a.q, "q", &eo)).is_ok()) return s;
  if (!(s = check_no_self_overlap(a.out, "out")).is_ok()) return s;
  if (!(s = check_disjoint(a.out, eo, "out", a.q, eq, "q")).is_ok()) return s;
  if (!(s = check_disjoint(a.out, eo, "out", a.k, ek, "k")).is_ok()) return s;
  if (!(s = check_disjoint(a.out, eo, "out", a.v, ev, "v")).is_ok()) return s;
  if (p->is_paged()) {
    Extent et;
    check_tensor_basics(a.options->block_table, "block_table", 2, &et);  // validated above
    if (!(s = check_disjoint(a.out, eo, "out", a.options->block_table, et, "block_table")).is_ok()) return s;
  }
  const fc_tensor* slopes = a.options ? a.options->alibi_slopes : nullptr;
  Extent es;
  if (slopes) {
    check_tensor_basics(slopes, "alibi_slopes", slopes->ndim, &es);  // validated above
    if (!(s = check_disjoint(a.out, eo, "out", slopes, es, "alibi_slopes")).is_ok()) return s;
  }
  p->out = ref_of(a.out, p->is_varlen());
  if (a.lse) {
    if (!(s = validate_lse(a.lse, "lse", a.q, *p, &el)).is_ok()) return s;
    if (!(s = check_no_self_overlap(a.lse, "lse")).is_ok()) return s;
    if (!(s = check_disjoint(a.lse, el, "lse", a.q, eq, "q")).is_ok()) return s;
    if (!(s = check_disjoint(a.lse, el, "lse", a.k, ek, "k")).is_ok()) return s;
    if (!(s = check_disjoint(a.lse, el, "lse", a.v, ev, "v")).is_ok()) return s;
    if (!(s = check_disjoint(a.lse, el, "lse", a.out, eo, "out")).is_ok()) return s;
    if (slopes && !(s = check_disjoint(a.lse, el, "lse", slopes, es, "alibi_slopes")).is_ok()) return s;
    p->lse = lse_ref(a.lse, p->is_varlen());
  }
  return Status::ok();
}

Status validate_backward(const BackwardArgs& a, bool for_workspace_query, BackwardParams* p) {
  Extent eq, ek, ev, eo, el, edo, edq, edk, edv;
  if (a.options && a.options->block_table)
    return Status::invalid("block_table: paged K/V is forward only (as flash_attn's block_table); the backward takes "
                           "packed k / v");
  Status s = validate_common(a.q, a.k, a.v, a.options, p, &eq, &ek, &ev);
  if (!s.is_ok() || for_workspace_query) return s;
  const bool varlen = p->is_varlen();
  if (!(s = validate_like(a.out, "out", a.q, "q", &eo)).is_ok()) return s;
  if (!(s = validate_like(a.dout, "dout", a.q, "q", &edo)).is_ok()) return s;
  if (a.lse == nullptr) return Status::invalid("lse: is null (backward needs the forward's lse)");
  if (!(s = validate_lse(a.lse, "lse", a.q, *p, &el)).is_ok()) return s;
  if (!(s = validate_like(a.dq, "dq", a.q, "q", &edq)).is_ok()) return s;
  if (!(s = validate_like(a.dk, "dk", a.k, "k", &edk)).is_ok()) return s;
  if (!(s = validate_like(a.dv, "dv", a.v, "v", &edv)).is_ok()) return s;
  const fc_tensor* outs[] = {a.dq, a.dk, a.dv};
  const Extent* eouts[] = {&edq, &edk, &edv};
  const char* onames[] = {"dq", "dk", "dv"};
  const fc_tensor* ins[] = {a.q, a.k, a.v, a.out, a.dout, a.lse};
  const Extent* eins[] = {&eq, &ek, &ev, &eo, &edo, &el};
  const char* inames[] = {"q", "k", "v", "out", "dout", "lse"};
  const fc_tensor* slopes = a.options ? a.options->alibi_slopes : nullptr;
  Extent es;
  if (slopes) check_tensor_basics(slopes, "alibi_slopes", slopes->ndim, &es);  // validated above
  for (int i = 0; i < 3; ++i) {
    if (!(s = check_no_self_overlap(outs[i], onames[i])).is_ok()) return s;
    if (slopes && !(s = check_disjoint(outs[i], *eouts[i], onames[i], slopes, es, "alibi_slopes")).is_ok()) return s;
    for (int j = 0; j < 6; ++j)
      if (!(s = check_disjoint(outs[i], *eouts[i], onames[i], ins[j], *eins[j], inames[j])).is_ok()) return s;
    for (int j = 0; j < i; ++j)
      if (!(s = check_disjoint(outs[i], *eouts[i], onames[i], outs[j], *eouts[j], onames[j])).is_ok()) return s;
  }
  p->out = ref_of(a.out, varlen);
  p->dout = ref_of(a.dout, varlen);
  p->lse = lse_ref(a.lse, varlen);
  p->dq = ref_of(a.dq, varlen);
  p->dk = ref_of(a.dk, varlen);
  p->dv = ref_of(a.dv, varlen);
  return Status::ok();
}

Status validate_for_backend(const AttentionParams& p, fc_backend backend, const fc_tensor* const* tensors,
                            const char* const* names, int count) {
  const bool cuda_backend = backend == FC_BACKEND_CUDA_SM80 || backend == FC_BACKEND_CUDA_SM90;
  const char* bname = fc_backend_name(backend);
  for (int i = 0; i < count; ++i) {
    const fc_tensor* t = tensors[i];
    if (t == nullptr) continue;
    const bool on_cuda = t->device_type == FC_DEVICE_CUDA;
    if (cuda_backend && !on_cuda)
      return Status::invalid(std::string(names[i]) + ": is a cpu tensor but backend " + bname + " needs cuda tensors");
    if (!cuda_backend && on_cuda)
      return Status::invalid(std::string(names[i]) + ": is a cuda tensor but backend " + bname + " needs cpu tensors");
  }
  if (!cuda_backend) return Status::ok();
  if (p.dtype != DType::F16 && p.dtype != DType::BF16)
    return Status::unsupported(std::string("q: dtype float32 is not supported by backend ") + bname +
                               " (CUDA backends take float16 or bfloat16)");
  // Tensor-core tiles are moved in 16-byte vectors: rows and pointers must be 16-byte aligned.
  constexpr int64_t kVecElems = 8;
  for (int i = 0; i < count; ++i) {
    const fc_tensor* t = tensors[i];
    if (t == nullptr || t->dtype == FC_DTYPE_I32 || t->dtype == FC_DTYPE_F32) continue;
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      return Status::invalid(std::string(names[i]) + ": data pointer is not 16-byte aligned (needed by " + bname + ")");
    for (int d = 0; d + 1 < t->ndim; ++d) {
      if (t->shape[d] > 1 && t->strides[d] % kVecElems != 0)
        return Status::invalid(std::string(names[i]) + ": stride " + std::to_string(t->strides[d]) + " of dimension " +
                               std::to_string(d) + " is not a multiple of 8 elements (16 bytes, needed by " +
                               bname + ")");
    }
  }
  if (p.head_dim % kVecElems != 0)
    return Status::unsupported("q: head_dim " + std::to_string(p.head_dim) + " is not a multiple of 8 (needed by " +
                               bname + "; the CPU backends take any head_dim)");
  return Status::ok();
}

}  // namespace flashcore
