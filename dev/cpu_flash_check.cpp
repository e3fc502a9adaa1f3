// Standalone check and timing driver for the cpu_flash backend (src/cpu/flash_*.cpp).
//
// It builds AttentionParams the way validate.cpp would (dense or varlen, strided layouts), runs
// cpu::flash_forward / cpu::flash_backward and compares against a naive fp64 oracle written here
// (so it needs nothing but the two backend files), plus: finite differences of the loss
// sum(out * dout) for the backward, bit-identical results across thread counts and repeats,
// NaN-poisoned outputs that must all be overwritten, and unit checks of the SIMD helpers
// (exp, tanh, fp16/bf16 rounding). `bench` times the forward and backward in GFLOP/s.
//
// Build (from the repository root):
//   g++ -std=c++17 -O3 -march=native -pthread -I include -I src dev/cpu_flash_check.cpp
//       src/cpu/flash_forward.cpp src/cpu/flash_backward.cpp src/cpu/worker_pool.cpp -o /tmp/cpu_flash_check
// Run: /tmp/cpu_flash_check check | bench [threads] | bench-bwd [threads] | all [threads]
//      (QUICK=1: small check cases only, for sanitizer builds; VERBOSE=1: print passing cases too;
//      ONLY=D:S:causal: one bench shape, e.g. under perf record)
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "cpu/cpu_common.hpp"

using namespace flashcore;
using flashcore::cpu::flash_detail::bf16_to_float;
using flashcore::cpu::flash_detail::float_to_bf16;
using flashcore::cpu::flash_detail::float_to_half;
using flashcore::cpu::flash_detail::half_to_float;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Host tensors of one dtype, values read and written as double.
// ---------------------------------------------------------------------------------------------
struct HostTensor {
  DType dtype = DType::F32;
  std::vector<unsigned char> bytes;
  void resize(DType t, int64_t n) { dtype = t; bytes.assign(static_cast<size_t>(n) * dtype_size(t), 0); }
  int64_t size() const { return static_cast<int64_t>(bytes.size() / dtype_size(dtype)); }
  void* data() { return bytes.data(); }
  double get(int64_t i) const {
    if (dtype == DType::F32) { float f; std::memcpy(&f, &bytes[i * 4], 4); return f; }
    uint16_t h; std::memcpy(&h, &bytes[i * 2], 2);
    return dtype == DType::F16 ? half_to_float(h) : bf16_to_float(h);
  }
  void set(int64_t i, double v) {
    const float f = static_cast<float>(v);
    if (dtype == DType::F32) { std::memcpy(&bytes[i * 4], &f, 4); return; }
    const uint16_t h = dtype == DType::F16 ? float_to_half(f) : float_to_bf16(f);
    std::memcpy(&bytes[i * 2], &h, 2);
  }
  void poison() { for (int64_t i = 0; i < size(); ++i) set(i, std::nan("")); }
};

struct Case {
  std::string name;
  DType dtype = DType::F32;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 1, heads_kv = 1, head_dim = 64;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.f;
  double scale = 0.0;                  // 0 = 1/sqrt(d)
  std::vector<int32_t> q_lens, k_lens;  // non-empty: varlen
  int64_t head_pad = 0;                 // extra elements between heads (strided layout)
  double input_scale = 1.0;             // magnitude of random inputs
  int threads = 2;
};

/** All buffers of one case plus the params that describe them. */
struct Problem {
  Case c;
  HostTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  std::vector<int32_t> cu_q, cu_k;
  BackwardParams p;
};

TensorRef make_ref(HostTensor& t, int64_t rows_per_batch, int64_t heads, int64_t head_dim, int64_t pad, bool varlen) {
  TensorRef r;
  r.data = t.data();
  r.head_stride = head_dim + pad;
  r.row_stride = heads * r.head_stride;
  r.batch_stride = varlen ? 0 : rows_per_batch * r.row_stride;
  return r;
}

void build(Problem& pr, uint64_t seed) {
  Case& c = pr.c;
  const bool varlen = !c.q_lens.empty();
  int64_t total_q, total_k;
  if (varlen) {
    c.batch = static_cast<int64_t>(c.q_lens.size());
    pr.cu_q = {0};
    pr.cu_k = {0};
    int64_t mq = 0, mk = 0;
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      pr.cu_q.push_back(pr.cu_q.back() + c.q_lens[b]);
      pr.cu_k.push_back(pr.cu_k.back() + c.k_lens[b]);
      mq = std::max<int64_t>(mq, c.q_lens[b]);
      mk = std::max<int64_t>(mk, c.k_lens[b]);
    }
    c.seqlen_q = mq;
    c.seqlen_k = mk;
    total_q = pr.cu_q.back();
    total_k = pr.cu_k.back();
  } else {
    total_q = c.batch * c.seqlen_q;
    total_k = c.batch * c.seqlen_k;
  }
  const int64_t hs = c.head_dim + c.head_pad;
  pr.q.resize(c.dtype, total_q * c.heads_q * hs);
  pr.out.resize(c.dtype, total_q * c.heads_q * hs);
  pr.dout.resize(c.dtype, total_q * c.heads_q * hs);
  pr.dq.resize(c.dtype, total_q * c.heads_q * hs);
  pr.k.resize(c.dtype, total_k * c.heads_kv * hs);
  pr.v.resize(c.dtype, total_k * c.heads_kv * hs);
  pr.dk.resize(c.dtype, total_k * c.heads_kv * hs);
  pr.dv.resize(c.dtype, total_k * c.heads_kv * hs);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (HostTensor* t : {&pr.q, &pr.k, &pr.v, &pr.dout}) {
    for (int64_t i = 0; i < t->size(); ++i) t->set(i, normal(rng) * c.input_scale);
  }
  pr.lse.assign(static_cast<size_t>(total_q * c.heads_q), std::nanf(""));

  BackwardParams& p = pr.p;
  p = BackwardParams{};
  p.dtype = c.dtype;
  p.q = make_ref(pr.q, c.seqlen_q, c.heads_q, c.head_dim, c.head_pad, varlen);
  p.out = make_ref(pr.out, c.seqlen_q, c.heads_q, c.head_dim, c.head_pad, varlen);
  p.dout = make_ref(pr.dout, c.seqlen_q, c.heads_q, c.head_dim, c.head_pad, varlen);
  p.dq = make_ref(pr.dq, c.seqlen_q, c.heads_q, c.head_dim, c.head_pad, varlen);
  p.k = make_ref(pr.k, c.seqlen_k, c.heads_kv, c.head_dim, c.head_pad, varlen);
  p.v = make_ref(pr.v, c.seqlen_k, c.heads_kv, c.head_dim, c.head_pad, varlen);
  p.dk = make_ref(pr.dk, c.seqlen_k, c.heads_kv, c.head_dim, c.head_pad, varlen);
  p.dv = make_ref(pr.dv, c.seqlen_k, c.heads_kv, c.head_dim, c.head_pad, varlen);
  p.lse.data = pr.lse.data();
  if (varlen) {
    p.lse.batch_stride = 0;
    p.lse.head_stride = total_q;
    p.lse.row_stride = 1;
    p.cu_seqlens_q = pr.cu_q.data();
    p.cu_seqlens_k = pr.cu_k.data();
  } else {
    p.lse.batch_stride = c.heads_q * c.seqlen_q;
    p.lse.head_stride = c.seqlen_q;
    p.lse.row_stride = 1;
  }
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = c.head_dim;
  p.total_q = total_q;
  p.total_k = total_k;
  p.softmax_scale = static_cast<float>(c.scale != 0.0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.softcap = c.softcap;
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : c.window_right;
  p.num_threads = c.threads;
}

// ---------------------------------------------------------------------------------------------
// fp64 oracle.
// ---------------------------------------------------------------------------------------------
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;  // same element indexing as the tensors
};

double elem(const HostTensor& t, const TensorRef& r, int64_t b, int64_t row, int64_t h, int64_t d) {
  return t.get(offset_of(r, b, row, h) + d);
}

/** Scores of one query row against all keys (capped, -inf where masked), in `Real`. */
template <class Real>
void row_scores(const Problem& pr, int64_t b, const SeqInfo& s, int64_t h, int64_t i, std::vector<Real>& sc,
                std::vector<Real>& tanh_of) {
  const BackwardParams& p = pr.p;
  const MaskInfo mask = mask_info(p, s);
  const int64_t kvh = h / p.group_size();
  sc.assign(static_cast<size_t>(s.seqlen_k), static_cast<Real>(-kInf));
  tanh_of.assign(static_cast<size_t>(s.seqlen_k), Real(0));
  for (int64_t j = 0; j < s.seqlen_k; ++j) {
    if (!mask.allowed(i, j)) continue;
    Real dot = 0;
    for (int64_t d = 0; d < p.head_dim; ++d) {
      dot += static_cast<Real>(elem(pr.q, p.q, b, s.q_start + i, h, d)) * static_cast<Real>(elem(pr.k, p.k, b, s.k_start + j, kvh, d));
    }
    Real x = static_cast<Real>(p.softmax_scale) * dot;
    if (p.softcap > 0) {
      tanh_of[j] = std::tanh(x / static_cast<Real>(p.softcap));
      x = static_cast<Real>(p.softcap) * tanh_of[j];
    }
    sc[j] = x;
  }
}

/** Naive materialized attention in `Real`: double is the truth (X_ref), float is an honest
 *  same-precision implementation (X_same of TESTING.md's tolerance rule). */
template <class Real>
Reference reference(const Problem& pr, bool with_backward) {
  const BackwardParams& p = pr.p;
  Reference ref;
  ref.out.assign(pr.out.size(), 0.0);
  ref.lse.assign(pr.lse.size(), -kInf);
  ref.dq.assign(pr.dq.size(), 0.0);
  ref.dk.assign(pr.dk.size(), 0.0);
  ref.dv.assign(pr.dv.size(), 0.0);
  std::vector<Real> sc, th, prob, dp, out_row;
  auto in = [](const HostTensor& t, const TensorRef& r, int64_t b, int64_t row, int64_t h, int64_t d) {
    return static_cast<Real>(elem(t, r, b, row, h, d));
  };
  const Real scale = static_cast<Real>(p.softmax_scale);
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t kvh = h / p.group_size();
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        row_scores<Real>(pr, b, s, h, i, sc, th);
        Real mx = static_cast<Real>(-kInf);
        for (Real x : sc) mx = std::max(mx, x);
        if (mx == static_cast<Real>(-kInf)) continue;
        Real sum = 0;
        prob.assign(sc.size(), Real(0));
        for (size_t j = 0; j < sc.size(); ++j) sum += (prob[j] = std::exp(sc[j] - mx));
        for (Real& x : prob) x /= sum;
        const int64_t o_off = offset_of(p.out, b, s.q_start + i, h);
        out_row.assign(static_cast<size_t>(p.head_dim), Real(0));
        for (int64_t d = 0; d < p.head_dim; ++d) {
          Real acc = 0;
          for (int64_t j = 0; j < s.seqlen_k; ++j) acc += prob[j] * in(pr.v, p.v, b, s.k_start + j, kvh, d);
          out_row[d] = acc;
          ref.out[o_off + d] = acc;
        }
        ref.lse[b * p.lse.batch_stride + h * p.lse.head_stride + (s.q_start + i) * p.lse.row_stride] = mx + std::log(sum);
        if (!with_backward) continue;
        // dP_ij = dO_i . v_j ; D_i = dO_i . O_i ; dS = P (dP - D) (* tanh' under softcap).
        dp.assign(sc.size(), Real(0));
        Real delta = 0;
        for (int64_t d = 0; d < p.head_dim; ++d) delta += in(pr.dout, p.dout, b, s.q_start + i, h, d) * out_row[d];
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          if (prob[j] == 0) continue;
          for (int64_t d = 0; d < p.head_dim; ++d) {
            dp[j] += in(pr.dout, p.dout, b, s.q_start + i, h, d) * in(pr.v, p.v, b, s.k_start + j, kvh, d);
          }
        }
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          if (prob[j] == 0) continue;
          Real ds = prob[j] * (dp[j] - delta);
          if (p.softcap > 0) ds *= Real(1) - th[j] * th[j];
          const int64_t k_off = offset_of(p.k, b, s.k_start + j, kvh);
          for (int64_t d = 0; d < p.head_dim; ++d) {
            ref.dq[o_off + d] += scale * ds * in(pr.k, p.k, b, s.k_start + j, kvh, d);
            ref.dk[k_off + d] += scale * ds * in(pr.q, p.q, b, s.q_start + i, h, d);
            ref.dv[k_off + d] += prob[j] * in(pr.dout, p.dout, b, s.q_start + i, h, d);
          }
        }
      }
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------
// Comparison.
// ---------------------------------------------------------------------------------------------
struct ErrorStats {
  double rel_l2 = 0, max_abs = 0, max_ref = 0;
  int64_t bad = 0;  // NaN, unwritten, or -inf mismatches
};

/** Compares the (b, row, h, 0..D) elements that the call owns: padding between heads is skipped. */
ErrorStats compare_tensor(const Problem& pr, const HostTensor& got, const std::vector<double>& want, bool keys) {
  const BackwardParams& p = pr.p;
  ErrorStats e;
  double num = 0, den = 0;
  const TensorRef& r = keys ? p.k : p.q;
  const int64_t heads = keys ? p.heads_kv : p.heads_q;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    const int64_t rows = keys ? s.seqlen_k : s.seqlen_q, start = keys ? s.k_start : s.q_start;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < p.head_dim; ++d) {
          const int64_t off = offset_of(r, b, start + i, h) + d;
          const double g = got.get(off), w = want[off];
          if (!std::isfinite(g)) { ++e.bad; continue; }
          num += (g - w) * (g - w);
          den += w * w;
          e.max_abs = std::max(e.max_abs, std::fabs(g - w));
          e.max_ref = std::max(e.max_ref, std::fabs(w));
        }
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

ErrorStats compare_lse(const Problem& pr, const std::vector<double>& want) {
  const BackwardParams& p = pr.p;
  ErrorStats e;
  double num = 0, den = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t off = b * p.lse.batch_stride + h * p.lse.head_stride + (s.q_start + i) * p.lse.row_stride;
        const double g = pr.lse[off], w = want[off];
        if (w == -kInf || g == -kInf) { e.bad += (g != w); continue; }
        if (!std::isfinite(g)) { ++e.bad; continue; }
        num += (g - w) * (g - w);
        den += w * w;
        e.max_abs = std::max(e.max_abs, std::fabs(g - w));
        e.max_ref = std::max(e.max_ref, std::fabs(w));
      }
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

/** fp32: relative L2 error; fp16/bf16: errors within a few roundings of the dtype. Either way,
 *  TESTING.md's rule also passes: max error within 2x (3x for gradients) of an honest fp32
 *  implementation's (`same`) plus one rounding at the reference's magnitude - this is what
 *  decides ill-conditioned cases (near one-hot softmax, gradients that cancel to ~0). */
bool within(const ErrorStats& e, DType t, bool gradient, const ErrorStats* same = nullptr) {
  if (e.bad) return false;
  // A gradient that is exactly 0 in exact arithmetic (e.g. seqlen_k = 1: dS = dP - D = 0) is pure
  // cancellation noise in fp32 (dP and D are O(1) sums rounded in different orders, then summed
  // over every query row): judge it absolutely, far below any real gradient's O(0.1) size.
  if (e.max_ref < 1e-6) return e.max_abs < 1e-4;
  if (same) {
    const double atol = std::ldexp(std::max(e.max_ref, 1e-30), -23);
    if (e.max_abs <= (gradient ? 3.0 : 2.0) * same->max_abs + atol) return true;
  }
  if (t == DType::F32) return e.rel_l2 < 1e-5;
  const double eps = t == DType::F16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  const double factor = gradient ? 3.0 : 1.0;
  return e.rel_l2 <= factor * eps && e.max_abs <= 2 * factor * eps * std::max(e.max_ref, 1e-3);
}

const char* dtype_name(DType t) { return t == DType::F32 ? "fp32" : t == DType::F16 ? "fp16" : "bf16"; }

int g_failures = 0;
int g_passed = 0;

void count(bool ok) { ok ? ++g_passed : ++g_failures; }

void report(const Problem& pr, const char* what, const ErrorStats& e, bool ok) {
  count(ok);
  if (!ok || std::getenv("VERBOSE")) {
    std::printf("  %-4s %-4s %-48s rel_l2=%.2e max_abs=%.2e max_ref=%.2e bad=%lld\n", ok ? "ok" : "FAIL", what,
                pr.c.name.c_str(), e.rel_l2, e.max_abs, e.max_ref, static_cast<long long>(e.bad));
  }
}

std::vector<unsigned char> snapshot(const Problem& pr) {
  std::vector<unsigned char> s;
  for (const HostTensor* t : {&pr.out, &pr.dq, &pr.dk, &pr.dv}) s.insert(s.end(), t->bytes.begin(), t->bytes.end());
  const unsigned char* l = reinterpret_cast<const unsigned char*>(pr.lse.data());
  s.insert(s.end(), l, l + pr.lse.size() * sizeof(float));
  return s;
}

void run_case(Case c, bool backward, uint64_t seed) {
  Problem pr;
  pr.c = c;
  build(pr, seed);
  pr.out.poison();
  Status st = cpu::flash_forward(pr.p);
  if (!st.is_ok()) { std::printf("  FAIL forward status %s: %s\n", c.name.c_str(), st.message.c_str()); ++g_failures; return; }
  const Reference ref = reference<double>(pr, backward);
  const Reference same = reference<float>(pr, backward);
  auto vs_ref = [&](const HostTensor& got, const std::vector<double>& want_same, const std::vector<double>& want, bool keys) {
    // The float oracle's error, measured like ours, via a temporary tensor of its values.
    HostTensor tmp;
    tmp.resize(DType::F32, got.size());
    for (int64_t i = 0; i < tmp.size(); ++i) tmp.set(i, want_same[i]);
    return compare_tensor(pr, tmp, want, keys);
  };
  const DType t = c.dtype;
  const ErrorStats eo = compare_tensor(pr, pr.out, ref.out, false), so = vs_ref(pr.out, same.out, ref.out, false);
  report(pr, "O", eo, within(eo, t, false, &so));
  const ErrorStats le = compare_lse(pr, ref.lse);
  report(pr, "LSE", le, le.bad == 0 && le.rel_l2 < (t == DType::F32 ? 1e-5 : 1e-3));
  if (backward) {
    for (HostTensor* g : {&pr.dq, &pr.dk, &pr.dv}) g->poison();
    st = cpu::flash_backward(pr.p);
    if (!st.is_ok()) { std::printf("  FAIL backward status %s: %s\n", c.name.c_str(), st.message.c_str()); ++g_failures; return; }
    const ErrorStats eq = compare_tensor(pr, pr.dq, ref.dq, false);
    const ErrorStats ek = compare_tensor(pr, pr.dk, ref.dk, true);
    const ErrorStats ev = compare_tensor(pr, pr.dv, ref.dv, true);
    const ErrorStats sq = vs_ref(pr.dq, same.dq, ref.dq, false);
    const ErrorStats sk = vs_ref(pr.dk, same.dk, ref.dk, true);
    const ErrorStats sv = vs_ref(pr.dv, same.dv, ref.dv, true);
    report(pr, "dQ", eq, within(eq, t, true, &sq));
    report(pr, "dK", ek, within(ek, t, true, &sk));
    report(pr, "dV", ev, within(ev, t, true, &sv));
  }
  // Same bits with another thread count and on a repeat.
  const std::vector<unsigned char> first = snapshot(pr);
  pr.p.num_threads = c.threads == 1 ? 3 : 1;
  cpu::flash_forward(pr.p);
  if (backward) cpu::flash_backward(pr.p);
  const bool identical = snapshot(pr) == first;
  count(identical);
  if (!identical) std::printf("  FAIL determinism %s\n", c.name.c_str());
}

// ---------------------------------------------------------------------------------------------
// Case grids.
// ---------------------------------------------------------------------------------------------
std::vector<Case> check_cases() {
  std::vector<Case> cases;
  auto add = [&](Case c, const char* tag) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s %s b%lld sq%lld sk%lld h%lld/%lld d%lld%s%s w(%lld,%lld) cap%g", tag,
                  dtype_name(c.dtype), (long long)c.batch, (long long)c.seqlen_q, (long long)c.seqlen_k,
                  (long long)c.heads_q, (long long)c.heads_kv, (long long)c.head_dim, c.causal ? " causal" : "",
                  c.q_lens.empty() ? "" : " varlen", (long long)c.window_left, (long long)c.window_right,
                  static_cast<double>(c.softcap));
    c.name = buf;
    cases.push_back(c);
  };
  const int64_t pairs[][2] = {{1, 1}, {1, 239}, {3, 799}, {113, 203}, {128, 217}, {127, 512}, {239, 1},
                              {512, 256}, {1023, 1024}, {1024, 1023}};
  for (const auto& sp : pairs) {
    for (int order = 0; order < 2; ++order) {
      for (bool causal : {false, true}) {
        Case c;
        c.seqlen_q = order ? sp[1] : sp[0];
        c.seqlen_k = order ? sp[0] : sp[1];
        c.causal = causal;
        c.head_dim = (c.seqlen_q * c.seqlen_k > 300000) ? 40 : 64;
        c.heads_q = 2;
        c.heads_kv = 1;
        add(c, "pair");
      }
    }
  }
  for (int64_t d : {1, 7, 16, 40, 59, 64, 80, 96, 111, 128, 200, 256}) {
    for (DType t : {DType::F32, DType::F16, DType::BF16}) {
      Case c;
      c.dtype = t;
      c.head_dim = d;
      c.batch = 2;
      c.seqlen_q = 77;
      c.seqlen_k = 133;
      c.heads_q = 4;
      c.heads_kv = 2;
      c.causal = d % 2 == 0;
      add(c, "hdim");
    }
  }
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    Case c;
    c.dtype = t;
    c.heads_q = 8; c.heads_kv = 2; c.seqlen_q = 150; c.seqlen_k = 170; c.head_dim = 32;
    add(c, "gqa");
    c.heads_kv = 1; c.causal = true;
    add(c, "mqa");
    c.causal = false; c.heads_q = 3; c.heads_kv = 3; c.window_left = 20; c.window_right = -1;
    add(c, "win-left");
    c.window_left = -1; c.window_right = 5;
    add(c, "win-right");
    c.window_left = 7; c.window_right = 3;
    add(c, "win-both");
    c.window_left = 0; c.window_right = 0;
    add(c, "win-diag");
    c.window_left = -1; c.window_right = -1; c.softcap = 5.f; c.input_scale = 3.0;
    add(c, "softcap");
    c.causal = true; c.softcap = 30.f;
    add(c, "softcap-causal");
    Case v;
    v.dtype = t; v.heads_q = 4; v.heads_kv = 2; v.head_dim = 48;
    v.q_lens = {5, 0, 70, 33, 1, 129};
    v.k_lens = {9, 12, 0, 100, 1, 65};
    add(v, "varlen");
    v.causal = true;
    add(v, "varlen");
    v.causal = false; v.window_left = 10; v.window_right = 2; v.head_pad = 5;
    add(v, "varlen-strided");
  }
  {
    Case c;  // a window that excludes every key of some rows: fully masked rows, lse -inf
    c.seqlen_q = 40; c.seqlen_k = 10; c.window_left = 3; c.window_right = 0; c.head_dim = 24;
    add(c, "masked-rows");
    c.seqlen_q = 10; c.seqlen_k = 0;
    add(c, "sk0");
    c.seqlen_q = 0; c.seqlen_k = 10;
    add(c, "sq0");
    c.seqlen_q = 9; c.seqlen_k = 300; c.window_left = -1; c.window_right = -1; c.input_scale = 30.0;
    add(c, "big-logits");
    c.head_pad = 3; c.batch = 3; c.input_scale = 1.0; c.causal = true;
    add(c, "strided");
  }
  for (const auto& sp : {std::array<int64_t, 2>{2048, 2048}}) {
    Case c;
    c.seqlen_q = sp[0]; c.seqlen_k = sp[1]; c.head_dim = 16; c.causal = true;
    add(c, "pair");
  }
  return cases;
}

// ---------------------------------------------------------------------------------------------
// Unit checks of the helpers and finite differences.
// ---------------------------------------------------------------------------------------------
void check_helpers() {
  namespace fd = flashcore::cpu::flash_detail;
  using fd::Simd;
  double worst_exp = 0, worst_tanh = 0;
  float xs[fd::kSimdWidth], ys[fd::kSimdWidth];
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-87.f, 87.f), ut(-12.f, 12.f), small(-1.f, 1.f);
  for (int it = 0; it < 200000; ++it) {
    for (float& x : xs) x = (it % 3 == 0) ? small(rng) : u(rng);
    Simd::store(ys, fd::vexp(Simd::load(xs)));
    for (int i = 0; i < fd::kSimdWidth; ++i) {
      const double want = std::exp(static_cast<double>(xs[i]));
      worst_exp = std::max(worst_exp, std::fabs(ys[i] - want) / want);
    }
    for (float& x : xs) x = (it % 2 == 0) ? small(rng) * 0.7f : ut(rng);
    Simd::store(ys, fd::vtanh(Simd::load(xs)));
    for (int i = 0; i < fd::kSimdWidth; ++i) {
      const double want = std::tanh(static_cast<double>(xs[i]));
      worst_tanh = std::max(worst_tanh, std::fabs(ys[i] - want) / std::max(std::fabs(want), 1e-30));
    }
  }
  for (float& x : xs) x = -std::numeric_limits<float>::infinity();
  Simd::store(ys, fd::vexp(Simd::load(xs)));
  const bool exp_inf_ok = ys[0] == 0.f;
  const bool exp_ok = worst_exp < 3e-7 && exp_inf_ok, tanh_ok = worst_tanh < 5e-7;
  std::printf("  %-4s vexp max rel err %.2e (exp(-inf) = %g), vtanh max rel err %.2e\n",
              exp_ok && tanh_ok ? "ok" : "FAIL", worst_exp, ys[0], worst_tanh);
  count(exp_ok && tanh_ok);

  // fp16: every half round-trips; random floats round like the hardware converter (RNE).
  int64_t half_bad = 0, bf16_bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    if (float_to_half(f) != h) ++half_bad;
  }
  std::uniform_int_distribution<uint32_t> bits;
  for (int it = 0; it < 2000000; ++it) {
    uint32_t b = bits(rng);
    if (it % 2) b = (b & 0x83ffffffu) | 0x30000000u;  // concentrate around half's range
    float f;
    std::memcpy(&f, &b, 4);
    if (std::isnan(f)) continue;
#if defined(__F16C__)
    if (float_to_half(f) != _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) ++half_bad;
#endif
    // bf16: the nearer of the two neighbours (ties to even), computed in double. The value past
    // the largest finite bf16 counts as 2^128, which is what IEEE overflow under RNE means.
    const uint16_t lo = static_cast<uint16_t>(b >> 16), hi = static_cast<uint16_t>(lo + 1);
    auto value = [](uint16_t x) {
      const double v = bf16_to_float(x);
      return std::isinf(v) ? std::copysign(std::ldexp(1.0, 128), v) : v;
    };
    const double dl = std::fabs(value(lo) - f), dh = std::fabs(value(hi) - f);
    const uint16_t want = (b & 0xffffu) == 0 ? lo : dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
    if (float_to_bf16(f) != want) ++bf16_bad;
  }
  std::printf("  %-4s fp16 rounding mismatches %lld, bf16 rounding mismatches %lld\n",
              half_bad || bf16_bad ? "FAIL" : "ok", static_cast<long long>(half_bad), static_cast<long long>(bf16_bad));
  count(!half_bad && !bf16_bad);
}

/** loss = sum(out * dout); d loss / d x by central differences, against flash_backward. */
void check_finite_differences(Case c) {
  Problem pr;
  pr.c = c;
  build(pr, 99);
  auto loss = [&]() {
    cpu::flash_forward(pr.p);
    double l = 0;
    for (int64_t i = 0; i < pr.out.size(); ++i) l += pr.out.get(i) * pr.dout.get(i);
    return l;
  };
  loss();
  cpu::flash_backward(pr.p);
  const double h = 1e-2;
  double worst = 0, scale = 0;
  for (auto [x, g] : {std::pair<HostTensor*, HostTensor*>{&pr.q, &pr.dq}, {&pr.k, &pr.dk}, {&pr.v, &pr.dv}}) {
    for (int64_t i = 0; i < x->size(); ++i) {
      if (c.head_pad && (i % (c.head_dim + c.head_pad)) >= c.head_dim) continue;
      const double x0 = x->get(i);
      x->set(i, x0 + h);
      const double lp = loss();
      x->set(i, x0 - h);
      const double lm = loss();
      x->set(i, x0);
      const double fd = (lp - lm) / (2 * h);
      worst = std::max(worst, std::fabs(fd - g->get(i)));
      scale = std::max(scale, std::fabs(fd));
    }
  }
  const bool ok = worst <= 2e-3 * std::max(scale, 1.0);
  count(ok);
  std::printf("  %-4s finite differences %-30s max|fd - grad| = %.2e (max|grad| %.2e)\n", ok ? "ok" : "FAIL",
              c.name.c_str(), worst, scale);
}

int run_checks() {
  check_helpers();
  {
    Case c; c.seqlen_q = 5; c.seqlen_k = 7; c.heads_q = 2; c.heads_kv = 1; c.head_dim = 3; c.name = "tiny gqa";
    check_finite_differences(c);
    c.causal = true; c.softcap = 2.f; c.name = "tiny causal softcap";
    check_finite_differences(c);
    c.causal = false; c.softcap = 0.f; c.window_left = 1; c.window_right = 1; c.q_lens = {3, 0, 4}; c.k_lens = {2, 3, 6};
    c.name = "tiny varlen window";
    check_finite_differences(c);
  }
  uint64_t seed = 1;
  const std::vector<Case> cases = check_cases();
  // quick: small cases only (for slow builds: ThreadSanitizer, -O0).
  const bool quick = std::getenv("QUICK") != nullptr;
  constexpr int64_t kQuickScores = 100000, kBackwardScores = 1100000;
  for (const Case& c : cases) {
    if (quick && c.seqlen_q * c.seqlen_k > kQuickScores) continue;
    run_case(c, c.seqlen_q * c.seqlen_k <= kBackwardScores, seed++);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failures);
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// Timing.
// ---------------------------------------------------------------------------------------------
template <class Fn>
double best_seconds(Fn fn, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int run_bench(int threads, bool with_backward) {
  std::printf("cpu_flash (%s) B=1 H=16 fp32, %d threads, best of 3\n", flashcore::cpu::flash_detail::Simd::kName, threads);
  std::printf("%6s %4s %7s %10s %10s%s\n", "S", "D", "causal", "fwd ms", "fwd GF/s", with_backward ? "     bwd ms   bwd GF/s" : "");
  for (int64_t d : {64, 128}) {
    for (int64_t s : {1024, 2048, 4096}) {
      for (bool causal : {false, true}) {
        if (const char* only = std::getenv("ONLY")) {  // "D:S:causal", e.g. ONLY=128:2048:0
          char want[64];
          std::snprintf(want, sizeof want, "%lld:%lld:%d", (long long)d, (long long)s, causal ? 1 : 0);
          if (std::string(only) != want) continue;
        }
        Problem pr;
        pr.c.batch = 1; pr.c.heads_q = pr.c.heads_kv = 16; pr.c.seqlen_q = pr.c.seqlen_k = s;
        pr.c.head_dim = d; pr.c.causal = causal; pr.c.threads = threads;
        build(pr, 5);
        const double flops = 4.0 * 16 * s * s * d * (causal ? 0.5 : 1.0);
        cpu::flash_forward(pr.p);
        const double tf = best_seconds([&] { cpu::flash_forward(pr.p); }, 3);
        std::printf("%6lld %4lld %7s %10.2f %10.1f", (long long)s, (long long)d, causal ? "yes" : "no", tf * 1e3, flops / tf * 1e-9);
        if (with_backward) {
          const double tb = best_seconds([&] { cpu::flash_backward(pr.p); }, 2);
          std::printf(" %10.2f %10.1f", tb * 1e3, 2.5 * flops / tb * 1e-9);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = argc > 1 ? argv[1] : "check";
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  if (mode == "check") return run_checks();
  if (mode == "bench") return run_bench(threads, false);
  if (mode == "bench-bwd") return run_bench(threads, true);
  if (mode == "all") return run_checks() | run_bench(threads, true);
  std::fprintf(stderr, "usage: %s check | bench [threads] | bench-bwd [threads] | all [threads]\n", argv[0]);
  return 2;
}
