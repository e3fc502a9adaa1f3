// Implementation of the correctness harness (see harness.hpp for the rules it applies).
#include "harness.hpp"

#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <algorithm>
#include <atomic>
#include <thread>
#include <type_traits>

#include "api/backends.hpp"
#include "api/validate.hpp"
#include "common/dtype_host.hpp"

namespace flashcore::testing {
namespace {

constexpr int64_t kStridePad = 8;  // extra elements per row/head when Case::padded
constexpr double kFp32RelTol = 1e-5;

size_t elem_size(int32_t dt) { return dt == FC_DTYPE_F16 || dt == FC_DTYPE_BF16 ? 2 : 4; }

/** A host tensor with explicit strides; its memory is what gets uploaded. */
struct HostTensor {
  int32_t dtype = FC_DTYPE_F32;
  std::vector<int64_t> shape, strides;
  std::vector<uint8_t> bytes;

  int64_t extent() const {
    int64_t e = 1;
    for (size_t i = 0; i < shape.size(); ++i)
      if (shape[i] == 0) return 0;
    for (size_t i = 0; i < shape.size(); ++i) e += (shape[i] - 1) * strides[i];
    return e;
  }
  void* data() { return bytes.empty() ? nullptr : bytes.data(); }
  float get(int64_t off) const { return load_as_float(bytes.data(), off, static_cast<DType>(dtype)); }
  void set(int64_t off, float x) { store_from_float(bytes.data(), off, static_cast<DType>(dtype), x); }
};

HostTensor make_tensor(int32_t dtype, std::vector<int64_t> shape, bool padded) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.strides.assign(shape.size(), 1);
  const int64_t pad = padded ? kStridePad : 0;
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    t.strides[i] = t.strides[i + 1] * shape[i + 1] + (i == static_cast<int>(shape.size()) - 2 ? pad : 0);
  t.bytes.assign(static_cast<size_t>(t.extent()) * elem_size(dtype), 0);
  return t;
}

void fill_nan(HostTensor& t) {
  const int64_t n = t.extent();
  for (int64_t i = 0; i < n; ++i) t.set(i, std::numeric_limits<float>::quiet_NaN());
}

void fill_random(HostTensor& t, std::mt19937_64& rng, float magnitude) {
  std::normal_distribution<float> dist(0.f, 1.f);
  const int64_t n = t.extent();
  for (int64_t i = 0; i < n; ++i) t.set(i, magnitude * dist(rng));
}

/** NaN in rows [first_row, shape[0]) of a packed (rows, heads, head_dim) tensor. */
void poison_rows_from(HostTensor& t, int64_t first_row) {
  for (int64_t r = first_row; r < t.shape[0]; ++r)
    for (int64_t h = 0; h < t.shape[1]; ++h)
      for (int64_t d = 0; d < t.shape[2]; ++d)
        t.set(r * t.strides[0] + h * t.strides[1] + d, std::numeric_limits<float>::quiet_NaN());
}

HostTensor upcast(const HostTensor& t) {
  HostTensor u = t;
  u.dtype = FC_DTYPE_F32;
  u.bytes.assign(static_cast<size_t>(t.extent()) * 4, 0);
  for (int64_t i = 0; i < t.extent(); ++i) u.set(i, t.get(i));
  return u;
}

fc_tensor view(HostTensor& t, void* data, int32_t device_type) {
  fc_tensor v{};
  v.data = data;
  v.dtype = t.dtype;
  v.device_type = device_type;
  v.device_id = 0;
  v.ndim = static_cast<int32_t>(t.shape.size());
  for (size_t i = 0; i < t.shape.size(); ++i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides[i];
  }
  return v;
}

/** A tensor mirrored in the memory under test. */
struct Mirror {
  Memory& mem;
  HostTensor& host;
  void* dev = nullptr;
  size_t bytes() const { return host.bytes.size(); }
  Mirror(Memory& m, HostTensor& h) : mem(m), host(h) {
    if (bytes()) {
      dev = mem.alloc(bytes());
      mem.upload(dev, host.bytes.data(), bytes());
    }
  }
  ~Mirror() {
    if (dev) mem.release(dev);
  }
  void fetch() {
    if (bytes()) mem.download(host.bytes.data(), dev, bytes());
  }
  fc_tensor tensor() { return view(host, dev, mem.device_type()); }
};

/** The rows (b, local row, packed row) a case defines, for q or k. */
struct RowSet {
  std::vector<int64_t> seq_start;  // packed start per sequence (varlen) or 0
  std::vector<int64_t> lengths;
};

RowSet rows_of(const Case& c, bool keys) {
  RowSet r;
  if (c.is_varlen()) {
    const auto& lens = keys ? c.varlen_k : c.varlen_q;
    int64_t acc = 0;
    for (int32_t L : lens) {
      r.seq_start.push_back(acc);
      r.lengths.push_back(L);
      acc += L;
    }
  } else {
    for (int64_t b = 0; b < c.batch; ++b) {
      r.seq_start.push_back(0);
      r.lengths.push_back(keys ? c.seqlen_k : c.seqlen_q);
    }
  }
  return r;
}

/** Gathers every element of the valid rows of a (b, s, h, d) or (total, h, d) tensor. */
std::vector<float> gather_rows(const HostTensor& t, const Case& c, bool keys) {
  const RowSet rs = rows_of(c, keys);
  std::vector<float> out;
  const bool varlen = c.is_varlen();
  const int nd = static_cast<int>(t.shape.size());
  const int64_t heads = t.shape[nd - 2], hd = t.shape[nd - 1];
  for (size_t b = 0; b < rs.lengths.size(); ++b)
    for (int64_t i = 0; i < rs.lengths[b]; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          const int64_t off = varlen ? (rs.seq_start[b] + i) * t.strides[0] + h * t.strides[1] + d
                                     : int64_t(b) * t.strides[0] + i * t.strides[1] + h * t.strides[2] + d;
          out.push_back(t.get(off));
        }
  return out;
}

std::vector<float> gather_lse(const HostTensor& t, const Case& c) {
  const RowSet rs = rows_of(c, false);
  std::vector<float> out;
  const bool varlen = c.is_varlen();
  for (size_t b = 0; b < rs.lengths.size(); ++b)
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (int64_t i = 0; i < rs.lengths[b]; ++i) {
        const int64_t off = varlen ? h * t.strides[0] + (rs.seq_start[b] + i) * t.strides[1]
                                   : int64_t(b) * t.strides[0] + h * t.strides[1] + i * t.strides[2];
        out.push_back(t.get(off));
      }
  return out;
}

/** Every element of `t` outside the valid rows (stride padding, rows of no sequence) must still
 *  hold the NaN poison: a backend writing past head_dim or into foreign rows fails here. */
ErrorReport untouched_outside(const std::string& what, const HostTensor& t, const Case& c, bool keys, bool is_lse) {
  ErrorReport r;
  r.what = what + " (outside valid rows)";
  std::vector<char> valid(static_cast<size_t>(t.extent()), 0);
  const RowSet rs = rows_of(c, keys);
  const bool varlen = c.is_varlen();
  const int nd = static_cast<int>(t.shape.size());
  for (size_t b = 0; b < rs.lengths.size(); ++b)
    for (int64_t i = 0; i < rs.lengths[b]; ++i) {
      if (is_lse) {
        for (int64_t h = 0; h < c.heads_q; ++h)
          valid[varlen ? h * t.strides[0] + (rs.seq_start[b] + i) * t.strides[1]
                       : int64_t(b) * t.strides[0] + h * t.strides[1] + i * t.strides[2]] = 1;
        continue;
      }
      const int64_t heads = t.shape[nd - 2], hd = t.shape[nd - 1];
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < hd; ++d)
          valid[varlen ? (rs.seq_start[b] + i) * t.strides[0] + h * t.strides[1] + d
                       : int64_t(b) * t.strides[0] + i * t.strides[1] + h * t.strides[2] + d] = 1;
    }
  for (int64_t off = 0; off < t.extent(); ++off) {
    if (!valid[off] && !std::isnan(t.get(off))) {
      r.ok = false;
      r.detail = what + ": element at offset " + std::to_string(off) + " outside every valid row was written";
      break;
    }
  }
  return r;
}

/** TESTING.md's rule for one output (see harness.hpp). */
ErrorReport compare(const std::string& what, const std::vector<float>& x, const std::vector<float>& ref,
                    const std::vector<float>& same, int32_t dtype, double k, bool is_lse,
                    const std::vector<float>& allowance = {}) {
  ErrorReport r;
  r.what = what;
  std::ostringstream detail;
  // excess: max over elements of |X - X_ref| less that element's allowance (0 without one).
  double max_err = 0, excess = 0, max_allowance = 0, same_err = 0, atol = 0, diff2 = 0, ref2 = 0, max_ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i], ri = ref[i];
    if (std::isnan(ri)) {
      r.ok = false;
      if (detail.str().empty()) detail << what << "[" << i << "]: the reference itself is NaN";
      continue;
    }
    if (std::isnan(xi)) {
      r.ok = false;
      if (detail.str().empty()) detail << what << "[" << i << "] is NaN (unwritten or computed NaN), ref " << ri;
      continue;
    }
    if (std::isinf(ri) || std::isinf(xi)) {
      if (xi != ri) {
        r.ok = false;
        if (detail.str().empty()) detail << what << "[" << i << "] = " << xi << " but ref = " << ri;
      }
      continue;
    }
    const double e = std::fabs(xi - ri);
    if (e > max_err) max_err = e;
    const double allowed = allowance.empty() ? 0.0 : allowance[i];
    excess = std::max(excess, e - allowed);
    max_allowance = std::max(max_allowance, allowed);
    max_ref = std::max(max_ref, std::fabs(ri));
    diff2 += e * e;
    ref2 += ri * ri;
    if (!same.empty() && !std::isinf(same[i])) same_err = std::max(same_err, std::fabs(double(same[i]) - ri));
    if (!is_lse && dtype != FC_DTYPE_F32) {
      const float rr = round_to(static_cast<DType>(dtype), static_cast<float>(ri));
      const float up = round_to(static_cast<DType>(dtype), rr + 0.3f);
      const float back = round_to(static_cast<DType>(dtype), up - 0.3f);
      atol = std::max(atol, 2.0 * std::fabs(double(back) - ri));
    }
  }
  r.max_err = max_err;
  r.same_err = same_err;
  r.allowance = max_allowance;
  if (dtype == FC_DTYPE_F32) {
    // Relative-norm bound; where plain fp32 arithmetic is itself worse (huge logits make the
    // fp32 lse lose absolute precision; dS = P (dP - D) cancels), the fp32 emulation's error
    // (X_same) scaled by k is allowed instead - the same rule as the low-precision dtypes.
    const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    r.bound = kFp32RelTol;
    r.max_err = rel;  // reported as relative for fp32
    // Near-zero references (e.g. dq with a single key, where dS cancels exactly) make the
    // relative norm meaningless: an absolute error of kFp32RelTol at unit magnitude passes too.
    // Gradients carry each element's score-error allowance here too (harness.hpp): a backward
    // that recomputes P from an lse whose scores were rounded differently (cpu_flash's AMX
    // forward sums its scores in another order than the AVX backward) moves them by that much at
    // scores near 1e4, where one fp32 score is coarser than the bound.
    const bool within_allowance = max_allowance > 0 && excess <= k * same_err;
    if (rel > kFp32RelTol && !(max_err <= k * same_err) && !within_allowance &&
        !(max_err <= kFp32RelTol * std::max(1.0, max_ref))) {
      r.ok = false;
      if (detail.str().empty())
        detail << what << ": relative error " << rel << " > " << kFp32RelTol << " and max error " << max_err
               << " > " << k << " x fp32-emulation error " << same_err;
    }
  } else {
    // lse is fp32 in every implementation: allow fp32 summation-order noise.
    if (is_lse) atol = 1e-4;
    r.bound = k * same_err + atol;
    if (excess > r.bound) {
      r.ok = false;
      if (detail.str().empty()) {
        detail << what << ": max error " << max_err << " > bound " << r.bound << " (low-precision reference error "
               << same_err << ")";
        if (max_allowance > 0) detail << " after each element's score-error allowance (max " << max_allowance << ")";
      }
    }
  }
  r.detail = detail.str();
  return r;
}

struct Problem {
  Case c;
  HostTensor q, k, v, out, lse, cu_q, cu_k;
  HostTensor slopes;  // Case::alibi: float32 (heads_q) or (batch, heads_q)
  int64_t used_q = 0;  // varlen: rows the sequences use (the rest is Case::packed_tail_rows)
};

Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem p{c, {}, {}, {}, {}, {}, {}, {}, {}};
  int64_t tq = 0, tk = 0;  // rows the sequences use (varlen)
  if (c.is_varlen()) {
    for (auto L : c.varlen_q) tq += L;
    for (auto L : c.varlen_k) tk += L;
    const int64_t rows_q = tq + c.packed_tail_rows, rows_k = tk + c.packed_tail_rows;
    p.q = make_tensor(c.dtype, {rows_q, c.heads_q, c.head_dim}, c.padded);
    p.k = make_tensor(c.dtype, {rows_k, c.heads_kv, c.head_dim}, c.padded);
    p.v = make_tensor(c.dtype, {rows_k, c.heads_kv, c.head_dim}, c.padded);
    p.out = make_tensor(c.dtype, {rows_q, c.heads_q, c.head_dim}, c.padded);
    p.lse = make_tensor(FC_DTYPE_F32, {c.heads_q, rows_q}, false);
    p.cu_q = make_tensor(FC_DTYPE_I32, {int64_t(c.varlen_q.size()) + 1}, false);
    p.cu_k = make_tensor(FC_DTYPE_I32, {int64_t(c.varlen_k.size()) + 1}, false);
    int32_t aq = 0, ak = 0;
    auto* cq = reinterpret_cast<int32_t*>(p.cu_q.bytes.data());
    auto* ck = reinterpret_cast<int32_t*>(p.cu_k.bytes.data());
    cq[0] = ck[0] = 0;
    for (size_t b = 0; b < c.varlen_q.size(); ++b) {
      cq[b + 1] = (aq += c.varlen_q[b]);
      ck[b + 1] = (ak += c.varlen_k[b]);
    }
  } else {
    p.q = make_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, c.padded);
    p.k = make_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, c.padded);
    p.v = make_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, c.padded);
    p.out = make_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, c.padded);
    p.lse = make_tensor(FC_DTYPE_F32, {c.batch, c.heads_q, c.seqlen_q}, false);
  }
  fill_random(p.q, rng, c.q_magnitude);
  fill_random(p.k, rng, 1.f);
  fill_random(p.v, rng, 1.f);
  if (c.is_varlen()) {
    poison_rows_from(p.q, tq);
    poison_rows_from(p.k, tk);
    poison_rows_from(p.v, tk);
  }
  p.used_q = tq;
  if (c.alibi != 0) {
    // Slopes from ALiBi's range (2^-8 .. 1/2 for 8 heads) and past it, so that biases of a few
    // units to a few hundred meet scores of order one.
    const int64_t batch = c.is_varlen() ? static_cast<int64_t>(c.varlen_q.size()) : c.batch;
    p.slopes = c.alibi == 2 ? make_tensor(FC_DTYPE_F32, {batch, c.heads_q}, false)
                            : make_tensor(FC_DTYPE_F32, {c.heads_q}, false);
    std::uniform_real_distribution<float> log2_slope(-9.f, 0.f);
    auto* slopes = reinterpret_cast<float*>(p.slopes.bytes.data());
    for (size_t i = 0; i < p.slopes.bytes.size() / sizeof(float); ++i) slopes[i] = std::exp2(log2_slope(rng));
  }
  fill_nan(p.out);
  fill_nan(p.lse);
  return p;
}

fc_attention_options options_for(const Case& c, fc_backend backend, const fc_tensor* cu_q, const fc_tensor* cu_k,
                                 void* stream) {
  fc_attention_options o{};
  o.softmax_scale = c.softmax_scale;
  o.causal = c.causal;
  o.has_window = c.window_left != -1 || c.window_right != -1;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  o.backend = backend;
  o.stream = stream;
  o.deterministic = c.deterministic;
  o.num_threads = c.num_threads;
  o.sm_margin = c.sm_margin;
  o.dropout_p = c.dropout_p;
  o.dropout_seed = c.dropout_seed;
  o.dropout_offset = c.dropout_offset;
  if (c.is_varlen()) {
    o.cu_seqlens_q = cu_q;
    o.cu_seqlens_k = cu_k;
    for (auto L : c.varlen_q) o.max_seqlen_q = std::max<int64_t>(o.max_seqlen_q, L);
    for (auto L : c.varlen_k) o.max_seqlen_k = std::max<int64_t>(o.max_seqlen_k, L);
  }
  return o;
}

/** t's data pointer moved `heads` heads on. */
void shift_heads(TensorRef& t, DType dt, int64_t heads) {
  if (t.data) t.data = static_cast<char*>(t.data) + heads * t.head_stride * static_cast<int64_t>(dtype_size(dt));
}

/** `params` restricted to query heads [h0, h0 + count) and KV heads [hk0, hk0 + count_kv): the
 *  data pointers (and the ALiBi slopes) move to the first head, the strides stay. */
template <class Params>
Params head_slice(const Params& params, int64_t h0, int64_t count, int64_t hk0, int64_t count_kv) {
  Params s = params;
  s.heads_q = count;
  s.heads_kv = count_kv;
  shift_heads(s.q, s.dtype, h0);
  shift_heads(s.out, s.dtype, h0);
  shift_heads(s.k, s.dtype, hk0);
  shift_heads(s.v, s.dtype, hk0);
  if (s.lse.data) s.lse.data += h0 * s.lse.head_stride;
  if (s.alibi_slopes) s.alibi_slopes += h0;
  if constexpr (std::is_same_v<Params, BackwardParams>) {
    shift_heads(s.dout, s.dtype, h0);
    shift_heads(s.dq, s.dtype, h0);
    shift_heads(s.dk, s.dtype, hk0);
    shift_heads(s.dv, s.dtype, hk0);
  }
  return s;
}

/** The single-threaded CPU reference over slices of the heads run side by side on every hardware
 *  thread: the forward one query head per slice, the backward one KV head with its GQA group (its
 *  dk / dv sum the group). The reference computes each head on its own, so the slices give the
 *  whole call's bits; the GPU tests spend most of their time in these passes. Dropout calls run
 *  as one slice. */
template <class Params, class Run>
Status reference_by_heads(const Params& p, bool by_query_head, const Run& run) {
  // A dropout mask is drawn per (sequence, query head of the whole call): a slice would renumber
  // its heads from 0 and draw another mask. Such calls run whole.
  if (p.dropout.enabled()) return run(p);
  const int64_t group = p.heads_q / p.heads_kv, slices = by_query_head ? p.heads_q : p.heads_kv;
  std::vector<Status> status(static_cast<size_t>(slices));
  run_on_all_threads(slices, [&](int64_t t) {
    const Params slice = by_query_head ? head_slice(p, t, 1, t / group, 1) : head_slice(p, t * group, group, t, 1);
    status[static_cast<size_t>(t)] = run(slice);
  });
  for (const Status& st : status)
    if (!st.is_ok()) return st;
  return Status::ok();
}

/** Runs the reference (exact, or low-precision emulation) on host tensors. */
void host_reference_forward(Problem& pr, bool low, HostTensor* out, HostTensor* lse) {
  HostTensor q = low ? pr.q : upcast(pr.q), k = low ? pr.k : upcast(pr.k), v = low ? pr.v : upcast(pr.v);
  *out = make_tensor(q.dtype, pr.out.shape, false);
  *lse = make_tensor(FC_DTYPE_F32, pr.lse.shape, false);
  fc_tensor tq = view(q, q.data(), FC_DEVICE_CPU), tk = view(k, k.data(), FC_DEVICE_CPU),
            tv = view(v, v.data(), FC_DEVICE_CPU), to = view(*out, out->data(), FC_DEVICE_CPU),
            tl = view(*lse, lse->data(), FC_DEVICE_CPU), tcq = view(pr.cu_q, pr.cu_q.data(), FC_DEVICE_CPU),
            tck = view(pr.cu_k, pr.cu_k.data(), FC_DEVICE_CPU);
  fc_attention_options o = options_for(pr.c, FC_BACKEND_CPU_REFERENCE, &tcq, &tck, nullptr);
  fc_tensor ts{};
  if (pr.c.alibi != 0) {
    ts = view(pr.slopes, pr.slopes.data(), FC_DEVICE_CPU);
    o.alibi_slopes = &ts;
  }
  AttentionParams params;
  Status s = validate_forward({&tq, &tk, &tv, &to, &tl, &o}, false, &params);
  if (!s.is_ok()) throw std::runtime_error("reference forward: " + s.message);
  const cpu::ReferenceMode mode = low ? cpu::ReferenceMode::low_precision : cpu::ReferenceMode::exact;
  s = reference_by_heads(params, true, [&](const AttentionParams& slice) { return cpu::reference_forward(slice, mode); });
  if (!s.is_ok()) throw std::runtime_error("reference forward: " + s.message);
}

}  // namespace

std::string Case::name() const {
  std::ostringstream s;
  const char* dt = dtype == FC_DTYPE_F16 ? "f16" : dtype == FC_DTYPE_BF16 ? "bf16" : "f32";
  if (is_varlen()) {
    s << "varlen" << varlen_q.size();
  } else {
    s << "b" << batch << "_q" << seqlen_q << "_k" << seqlen_k;
  }
  s << "_h" << heads_q << "x" << heads_kv << "_d" << head_dim << "_" << dt;
  if (causal) s << "_causal";
  if (window_left != -1 || window_right != -1) s << "_win" << window_left << "_" << window_right;
  if (softcap > 0) s << "_cap" << softcap;
  if (softmax_scale != 0) s << "_scale" << softmax_scale;
  if (padded) s << "_padded";
  if (q_magnitude != 1.f) s << "_mag" << q_magnitude;
  if (deterministic) s << "_det";
  if (page_size > 0) s << "_pages" << page_size;
  if (alibi != 0) s << "_alibi" << alibi;
  if (dropout_p > 0) s << "_drop" << static_cast<int>(dropout_p * 100 + 0.5);
  return s.str();
}

std::string CheckResult::summary() const {
  std::ostringstream s;
  if (!status_error.empty()) s << "call failed: " << status_error << "\n";
  for (auto& r : reports) {
    s << "  " << r.what << ": max_err " << r.max_err << " bound " << r.bound << " (same " << r.same_err << ")";
    if (r.allowance > 0) s << " [score-error allowance up to " << r.allowance << "]";
    s << (r.ok ? "" : "  FAIL: " + r.detail) << "\n";
  }
  return s.str();
}

class HostMemory final : public Memory {
 public:
  int32_t device_type() const override { return FC_DEVICE_CPU; }
  void* alloc(size_t bytes) override { return bytes ? ::operator new(bytes) : nullptr; }
  void release(void* p) override { ::operator delete(p); }
  void upload(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void download(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
};

std::unique_ptr<Memory> host_memory() { return std::make_unique<HostMemory>(); }

namespace {

/** Forward through the public API on `mem`; leaves results in pr.out / pr.lse (host). */
/** Paged copies of a varlen problem's k and v (Case::page_size): sequence b's keys in whole pages
 *  of its own, the pages shuffled among spare ones, and the block table. Every slot no sequence
 *  uses (spare pages, the rest of a sequence's last page) holds NaN: a kernel whose loads reach
 *  them must keep them out of every result. */
struct PagedKv {
  HostTensor k, v, table;
  PagedKv(const Problem& pr, std::mt19937_64& rng) {
    const Case& c = pr.c;
    const int64_t ps = c.page_size, batch = static_cast<int64_t>(c.varlen_k.size());
    int64_t per_seq = 1;
    for (int32_t L : c.varlen_k) per_seq = std::max<int64_t>(per_seq, (L + ps - 1) / ps);
    const int64_t pages = batch * per_seq + 3;
    k = make_tensor(c.dtype, {pages, ps, c.heads_kv, c.head_dim}, c.padded);
    v = make_tensor(c.dtype, {pages, ps, c.heads_kv, c.head_dim}, c.padded);
    fill_nan(k);
    fill_nan(v);
    std::vector<int32_t> ids(static_cast<size_t>(pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table = make_tensor(FC_DTYPE_I32, {batch, per_seq}, false);
    auto* t = reinterpret_cast<int32_t*>(table.bytes.data());
    const auto* cu = reinterpret_cast<const int32_t*>(pr.cu_k.bytes.data());
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < per_seq; ++j) t[b * per_seq + j] = ids[b * per_seq + j];
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < c.varlen_k[b]; ++j)
        for (int64_t h = 0; h < c.heads_kv; ++h)
          for (int64_t d = 0; d < c.head_dim; ++d) {
            const int64_t page = t[b * per_seq + j / ps];
            const int64_t to = page * k.strides[0] + (j % ps) * k.strides[1] + h * k.strides[2] + d;
            const int64_t from = (cu[b] + j) * pr.k.strides[0] + h * pr.k.strides[1] + d;
            k.set(to, pr.k.get(from));
            v.set(to, pr.v.get(from));
          }
  }
};

std::string run_forward(Problem& pr, fc_backend backend, Memory& mem) {
  std::optional<PagedKv> paged;
  if (pr.c.page_size > 0) {
    std::mt19937_64 rng(pr.c.page_size * 7919 + pr.c.varlen_k.size());
    paged.emplace(pr, rng);
  }
  HostTensor& hk = paged ? paged->k : pr.k;
  HostTensor& hv = paged ? paged->v : pr.v;
  HostTensor no_table;
  Mirror q(mem, pr.q), k(mem, hk), v(mem, hv), out(mem, pr.out), lse(mem, pr.lse), cq(mem, pr.cu_q),
      ck(mem, pr.cu_k), table(mem, paged ? paged->table : no_table), slopes(mem, pr.slopes);
  fc_tensor tq = q.tensor(), tk = k.tensor(), tv = v.tensor(), to = out.tensor(), tl = lse.tensor(),
            tcq = cq.tensor(), tck = ck.tensor(), ttable{}, ts{};
  fc_attention_options o = options_for(pr.c, backend, &tcq, &tck, mem.stream());
  if (pr.c.alibi != 0) {
    ts = slopes.tensor();
    o.alibi_slopes = &ts;
  }
  if (paged) {
    ttable = table.tensor();
    o.block_table = &ttable;
  }
  size_t ws_bytes = 0;
  if (fc_attention_forward_workspace(&tq, &tk, &tv, &o, &ws_bytes) != FC_OK) return fc_last_error();
  void* ws = ws_bytes ? mem.alloc(ws_bytes) : nullptr;
  if (ws) {  // NaN bytes (0xffff in fp16 / bf16, fp32 too): whatever the call reads there must be its own
    const std::vector<uint8_t> poison(ws_bytes, 0xff);
    mem.upload(ws, poison.data(), ws_bytes);
  }
  const fc_status st = fc_attention_forward(&tq, &tk, &tv, &to, &tl, &o, ws, ws_bytes);
  std::string err = st == FC_OK ? "" : fc_last_error();
  out.fetch();
  lse.fetch();
  if (ws) mem.release(ws);
  return err;
}

}  // namespace

void run_on_all_threads(int64_t tasks, const std::function<void(int64_t)>& task) {
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) task(t);
  };
  const int64_t threads = std::min<int64_t>(tasks, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& th : pool) th.join();
}

CheckResult check_forward(const Case& c, fc_backend backend, Memory& mem, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem pr = make_problem(c, rng);
  CheckResult res;
  res.status_error = run_forward(pr, backend, mem);
  if (!res.status_error.empty()) {
    res.ok = false;
    return res;
  }
  HostTensor ref_out, ref_lse, same_out, same_lse;
  {  // the two references are independent passes (each split over the heads): run them side by side
    auto same = std::async(std::launch::async, [&] { host_reference_forward(pr, true, &same_out, &same_lse); });
    host_reference_forward(pr, false, &ref_out, &ref_lse);
    same.get();
  }
  res.reports.push_back(compare("out", gather_rows(pr.out, c, false), gather_rows(ref_out, c, false),
                                gather_rows(same_out, c, false), c.dtype, 2.0, false));
  res.reports.push_back(compare("lse", gather_lse(pr.lse, c), gather_lse(ref_lse, c), gather_lse(same_lse, c),
                                c.dtype, 2.0, true));
  res.reports.push_back(untouched_outside("out", pr.out, c, false, false));
  res.reports.push_back(untouched_outside("lse", pr.lse, c, false, true));
  for (auto& r : res.reports) res.ok = res.ok && r.ok;
  return res;
}

namespace {

struct Grads {
  HostTensor dq, dk, dv;
};

/** Backward on host tensors through the reference: exact or the score-error bound on upcast
 *  inputs, or emulated in low precision reading the O that the backend under test stored. */
Grads host_reference_backward(Problem& pr, const HostTensor& dout_in, cpu::ReferenceMode mode) {
  const bool low = mode == cpu::ReferenceMode::low_precision;
  HostTensor q = low ? pr.q : upcast(pr.q), k = low ? pr.k : upcast(pr.k), v = low ? pr.v : upcast(pr.v);
  HostTensor dout = low ? dout_in : upcast(dout_in);
  // The reference backward recomputes P from the scores: only the low-precision mode reads `out`
  // (the backend's, for D) and none reads the lse, so no forward runs here.
  HostTensor out = low ? pr.out : make_tensor(q.dtype, pr.out.shape, false);
  HostTensor lse = make_tensor(FC_DTYPE_F32, pr.lse.shape, false);
  Grads g{make_tensor(q.dtype, q.shape, false), make_tensor(q.dtype, k.shape, false),
          make_tensor(q.dtype, v.shape, false)};
  fc_tensor tq = view(q, q.data(), 0), tk = view(k, k.data(), 0), tv = view(v, v.data(), 0),
            to = view(out, out.data(), 0), tl = view(lse, lse.data(), 0), tdo = view(dout, dout.data(), 0),
            tdq = view(g.dq, g.dq.data(), 0), tdk = view(g.dk, g.dk.data(), 0), tdv = view(g.dv, g.dv.data(), 0),
            tcq = view(pr.cu_q, pr.cu_q.data(), 0), tck = view(pr.cu_k, pr.cu_k.data(), 0);
  fc_attention_options o = options_for(pr.c, FC_BACKEND_CPU_REFERENCE, &tcq, &tck, nullptr);
  fc_tensor ts{};
  if (pr.c.alibi != 0) {
    ts = view(pr.slopes, pr.slopes.data(), FC_DEVICE_CPU);
    o.alibi_slopes = &ts;
  }
  BackwardParams params;
  Status s = validate_backward({&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &o}, false, &params);
  if (!s.is_ok()) throw std::runtime_error("reference backward: " + s.message);
  s = reference_by_heads(params, false, [&](const BackwardParams& slice) { return cpu::reference_backward(slice, mode); });
  if (!s.is_ok()) throw std::runtime_error("reference backward: " + s.message);
  return g;
}

/** Varlen: NaN in dout's rows past the last sequence, as in q (Case::packed_tail_rows). */
void poison_dout_tail(const Problem& pr, HostTensor& dout) {
  if (pr.c.is_varlen()) poison_rows_from(dout, pr.used_q);
}

/** Forward + backward through the public API on `mem`; results in the returned host tensors. */
std::string run_backward(Problem& pr, HostTensor& dout, Grads* g, fc_backend backend, Memory& mem) {
  g->dq = make_tensor(pr.c.dtype, pr.q.shape, pr.c.padded);
  g->dk = make_tensor(pr.c.dtype, pr.k.shape, pr.c.padded);
  g->dv = make_tensor(pr.c.dtype, pr.v.shape, pr.c.padded);
  fill_nan(g->dq);
  fill_nan(g->dk);
  fill_nan(g->dv);
  Mirror q(mem, pr.q), k(mem, pr.k), v(mem, pr.v), out(mem, pr.out), lse(mem, pr.lse), cq(mem, pr.cu_q),
      ck(mem, pr.cu_k), mdo(mem, dout), dq(mem, g->dq), dk(mem, g->dk), dv(mem, g->dv), slopes(mem, pr.slopes);
  fc_tensor tq = q.tensor(), tk = k.tensor(), tv = v.tensor(), to = out.tensor(), tl = lse.tensor(),
            tcq = cq.tensor(), tck = ck.tensor(), tdo = mdo.tensor(), tdq = dq.tensor(), tdk = dk.tensor(),
            tdv = dv.tensor(), ts{};
  fc_attention_options o = options_for(pr.c, backend, &tcq, &tck, mem.stream());
  if (pr.c.alibi != 0) {
    ts = slopes.tensor();
    o.alibi_slopes = &ts;
  }
  size_t fws = 0, bws = 0;
  if (fc_attention_forward_workspace(&tq, &tk, &tv, &o, &fws) != FC_OK) return fc_last_error();
  if (fc_attention_backward_workspace(&tq, &tk, &tv, &o, &bws) != FC_OK) return fc_last_error();
  const size_t ws_bytes = std::max(fws, bws);
  void* ws = ws_bytes ? mem.alloc(ws_bytes) : nullptr;
  std::string err;
  if (fc_attention_forward(&tq, &tk, &tv, &to, &tl, &o, ws, ws_bytes) != FC_OK) {
    err = fc_last_error();
  } else if (fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &o, ws, ws_bytes) != FC_OK) {
    err = fc_last_error();
  }
  out.fetch();
  lse.fetch();
  dq.fetch();
  dk.fetch();
  dv.fetch();
  if (ws) mem.release(ws);
  return err;
}

}  // namespace

CheckResult check_backward(const Case& c, fc_backend backend, Memory& mem, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem pr = make_problem(c, rng);
  HostTensor dout = make_tensor(c.dtype, pr.out.shape, c.padded);
  fill_random(dout, rng, 1.f);
  poison_dout_tail(pr, dout);
  CheckResult res;
  Grads g;
  res.status_error = run_backward(pr, dout, &g, backend, mem);
  if (!res.status_error.empty()) {
    res.ok = false;
    return res;
  }
  HostTensor ref_out, ref_lse, same_out, same_lse;
  // Five independent reference passes (the long-sequence grids spend minutes in them; each is split
  // over the heads too): run side by side. Each writes only its own outputs; pr and dout are
  // read-only here.
  auto run_async = [](auto fn) { return std::async(std::launch::async, fn); };
  auto fwd_same = run_async([&] { host_reference_forward(pr, true, &same_out, &same_lse); });
  auto bwd_same = run_async([&] { return host_reference_backward(pr, dout, cpu::ReferenceMode::low_precision); });
  auto bwd_bound = run_async([&] { return host_reference_backward(pr, dout, cpu::ReferenceMode::score_error_bound); });
  auto bwd_ref = run_async([&] { return host_reference_backward(pr, dout, cpu::ReferenceMode::exact); });
  host_reference_forward(pr, false, &ref_out, &ref_lse);
  fwd_same.get();
  const Grads same = bwd_same.get(), score_err = bwd_bound.get(), ref = bwd_ref.get();
  // The forward's O first: the low-precision emulation reads it (as the kernel does), so a wrong O
  // must fail here rather than widen the gradients' bound.
  res.reports.push_back(compare("out (forward before backward)", gather_rows(pr.out, c, false),
                                gather_rows(ref_out, c, false), gather_rows(same_out, c, false), c.dtype, 2.0, false));
  auto cmp = [&](const char* name, const HostTensor& x, const HostTensor& r, const HostTensor& s,
                 const HostTensor& allowance, bool keys) {
    res.reports.push_back(compare(name, gather_rows(x, c, keys), gather_rows(r, c, keys), gather_rows(s, c, keys),
                                  c.dtype, 3.0, false, gather_rows(allowance, c, keys)));
  };
  cmp("dq", g.dq, ref.dq, same.dq, score_err.dq, false);
  cmp("dk", g.dk, ref.dk, same.dk, score_err.dk, true);
  cmp("dv", g.dv, ref.dv, same.dv, score_err.dv, true);
  res.reports.push_back(untouched_outside("dq", g.dq, c, false, false));
  res.reports.push_back(untouched_outside("dk", g.dk, c, true, false));
  res.reports.push_back(untouched_outside("dv", g.dv, c, true, false));
  for (auto& r : res.reports) res.ok = res.ok && r.ok;
  return res;
}

namespace {
/** A run's settings: its num_threads and sm_margin. */
struct RunSetting {
  int32_t num_threads;
  int32_t sm_margin;
};
/** Runs forward (and backward) once per entry of `runs` on the same inputs; true when every run
 *  is bit-identical to the first. */
bool runs_are_bit_identical(const Case& c, fc_backend backend, Memory& mem, const std::vector<RunSetting>& runs,
                            bool backward, std::string* why) {
  std::mt19937_64 rng(1234);
  Problem pr = make_problem(c, rng);
  HostTensor dout = make_tensor(c.dtype, pr.out.shape, c.padded);
  fill_random(dout, rng, 1.f);
  poison_dout_tail(pr, dout);
  std::vector<uint8_t> first;
  for (size_t r = 0; r < runs.size(); ++r) {
    pr.c.num_threads = runs[r].num_threads;
    pr.c.sm_margin = runs[r].sm_margin;
    fill_nan(pr.out);
    fill_nan(pr.lse);
    std::vector<uint8_t> now;
    if (backward) {
      Grads g;
      const std::string err = run_backward(pr, dout, &g, backend, mem);
      if (!err.empty()) {
        *why = err;
        return false;
      }
      for (auto* t : {&g.dq, &g.dk, &g.dv}) now.insert(now.end(), t->bytes.begin(), t->bytes.end());
    } else {
      const std::string err = run_forward(pr, backend, mem);
      if (!err.empty()) {
        *why = err;
        return false;
      }
      now = pr.out.bytes;
      now.insert(now.end(), pr.lse.bytes.begin(), pr.lse.bytes.end());
    }
    if (r == 0) {
      first = now;
    } else if (now != first) {
      auto setting = [&](size_t i) {
        return "(num_threads " + std::to_string(runs[i].num_threads) + ", sm_margin " +
               std::to_string(runs[i].sm_margin) + ")";
      };
      *why = "run " + std::to_string(r) + " " + setting(r) + " differs from run 0 " + setting(0);
      return false;
    }
  }
  return true;
}
}  // namespace

bool repeat_is_bit_identical(const Case& c, fc_backend backend, Memory& mem, int repeats, bool backward,
                             std::string* why) {
  return runs_are_bit_identical(c, backend, mem,
                                std::vector<RunSetting>(static_cast<size_t>(repeats), {c.num_threads, c.sm_margin}),
                                backward, why);
}

bool chained_forward_calls_are_ordered(const Case& c, fc_backend backend, Memory& mem, int depth, std::string* why) {
  std::mt19937_64 rng(4321);
  Problem pr = make_problem(c, rng);
  HostTensor poison = pr.out;
  fill_nan(poison);
  // links[i]: the output of call i, which is the q of call i + 1 (out and q have the same shape).
  std::vector<HostTensor> links(static_cast<size_t>(depth), poison);
  Mirror q(mem, pr.q), k(mem, pr.k), v(mem, pr.v), lse(mem, pr.lse), cu_q(mem, pr.cu_q), cu_k(mem, pr.cu_k);
  std::vector<std::unique_ptr<Mirror>> outs;
  for (auto& t : links) outs.push_back(std::make_unique<Mirror>(mem, t));
  fc_tensor tq = q.tensor(), tk = k.tensor(), tv = v.tensor(), tcq = cu_q.tensor(), tck = cu_k.tensor();
  const fc_attention_options o = options_for(c, backend, &tcq, &tck, mem.stream());  // (cu_seqlens: varlen only)
  size_t ws_bytes = 0;
  if (fc_attention_forward_workspace(&tq, &tk, &tv, &o, &ws_bytes) != FC_OK) {
    *why = fc_last_error();
    return false;
  }
  void* ws = ws_bytes ? mem.alloc(ws_bytes) : nullptr;
  auto run_chain = [&](bool drain_each, std::vector<uint8_t>* last) -> std::string {
    for (auto& m : outs) mem.upload(m->dev, poison.bytes.data(), poison.bytes.size());
    for (int i = 0; i < depth; ++i) {
      fc_tensor in = i == 0 ? q.tensor() : outs[static_cast<size_t>(i) - 1]->tensor();
      fc_tensor out = outs[static_cast<size_t>(i)]->tensor(), tl = lse.tensor();
      if (fc_attention_forward(&in, &tk, &tv, &out, &tl, &o, ws, ws_bytes) != FC_OK) return fc_last_error();
      if (drain_each) outs[static_cast<size_t>(i)]->fetch();
    }
    outs.back()->fetch();
    *last = outs.back()->host.bytes;
    return "";
  };
  std::vector<uint8_t> chained, drained;
  std::string err = run_chain(false, &chained);
  if (err.empty()) err = run_chain(true, &drained);
  if (ws) mem.release(ws);
  if (!err.empty()) {
    *why = err;
    return false;
  }
  if (chained != drained) {
    *why = "the back-to-back chain of " + std::to_string(depth) + " calls differs from the drained one";
    return false;
  }
  return true;
}

bool thread_counts_are_bit_identical(const Case& c, fc_backend backend, Memory& mem,
                                     const std::vector<int32_t>& thread_counts, bool backward, std::string* why) {
  std::vector<RunSetting> runs;
  for (int32_t t : thread_counts) runs.push_back({t, c.sm_margin});
  return runs_are_bit_identical(c, backend, mem, runs, backward, why);
}

bool sm_margins_are_bit_identical(const Case& c, fc_backend backend, Memory& mem, const std::vector<int32_t>& margins,
                                  bool backward, std::string* why) {
  std::vector<RunSetting> runs;
  for (int32_t m : margins) runs.push_back({c.num_threads, m});
  return runs_are_bit_identical(c, backend, mem, runs, backward, why);
}

std::vector<std::pair<int64_t, int64_t>> seqlen_pairs(bool include_large) {
  std::vector<std::pair<int64_t, int64_t>> v = {{1, 1},     {1, 239},   {3, 799},  {113, 203}, {128, 217},
                                                {127, 512}, {239, 1},   {512, 256}, {203, 113}, {217, 128},
                                                {512, 127}, {799, 3}};
  if (include_large) {
    v.push_back({1023, 1024});
    v.push_back({1024, 1023});
    v.push_back({2048, 2048});
  }
  return v;
}

}  // namespace flashcore::testing
