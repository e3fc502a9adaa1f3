// Test support for fc_attention_kvcache, shared by the CPU and CUDA suites (header-only, so each
// suite's glob-picked test file is all CMake needs).
//
// KvCase describes one decode problem; KvProblem draws random inputs (caches full of random data
// also beyond each sequence's length, so reading past it changes results), lays the cache out
// contiguously (optionally through a permuted cache_batch_idx) or in shuffled pages, poisons out/lse
// with NaN, uploads everything through a harness Memory and runs the public C ABI. check_kvcache
// then compares against an fp64 oracle written here from the header's semantics (independent of
// every backend) with TESTING.md's rule, and checks that the caches changed exactly where k_new/v_new
// were appended.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype_host.hpp"
#include "common/harness.hpp"
#include "common/mask.hpp"
#include "flashcore/flashcore.h"

namespace flashcore::testing {

struct KvCase {
  int64_t batch = 1;
  int64_t seqlen_q = 1;
  int64_t seqlen_new = 0;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t head_dim = 64;
  int32_t dtype = FC_DTYPE_BF16;
  std::vector<int32_t> cache_lens;  // tokens already cached, one per sequence (size batch)
  int64_t page_size = 0;            // 0 = contiguous cache
  bool batch_idx = false;           // contiguous: sequences use permuted cache rows (+ spare rows)
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  double softcap = 0;
  int32_t num_splits = 1;
  int32_t sm_margin = 0;  // fc_attention_options.sm_margin (CUDA: SMs the plan leaves free)
  bool want_lse = true;
  int64_t slack = 5;  // capacity beyond the longest sequence (garbage that must not be read)
  std::vector<int32_t> leftpad;  // contiguous caches: sequence b starts at slot leftpad[b]; empty = none
  int64_t rotary_half = 0;       // > 0: rotary tables (rows, rotary_half) applied to q and k_new
  bool rotary_interleaved = true;
  bool rotary_fp32 = false;  // tables in float32 (else in the case's dtype)
  bool empty_append = false;  // seqlen_new == 0 but k_new / v_new given (zero tokens, null data)
  int alibi = 0;  // ALiBi slopes: 0 none, 1 (heads_q), 2 (batch, heads_q); random, some negative
  int32_t backend = FC_BACKEND_AUTO;  // fc_attention_options.backend (CUDA: auto or cuda_sm80)

  /** flash_attn's rule for q's rotary positions: a window side as wide as the cache is unbounded;
   *  a causal mask or what stays bounded puts each query at its own position. */
  bool per_token_queries(int64_t capacity) const {
    return causal || (window_left != -1 && window_left < capacity) || (window_right != -1 && window_right < capacity);
  }

  std::string name() const {
    std::ostringstream s;
    s << "b" << batch << " sq" << seqlen_q << " new" << seqlen_new << " h" << heads_q << "/" << heads_kv << " d"
      << head_dim << " dt" << dtype << " page" << page_size << (batch_idx ? " bidx" : "") << (causal ? " causal" : "")
      << " win(" << window_left << "," << window_right << ") cap" << softcap << " splits" << num_splits
      << (sm_margin ? " sm_margin" + std::to_string(sm_margin) : std::string()) << " lens[";
    for (size_t i = 0; i < cache_lens.size(); ++i) s << (i ? "," : "") << cache_lens[i];
    s << "]";
    if (!leftpad.empty()) {
      s << " leftpad[";
      for (size_t i = 0; i < leftpad.size(); ++i) s << (i ? "," : "") << leftpad[i];
      s << "]";
    }
    if (rotary_half > 0)
      s << " rotary" << 2 * rotary_half << (rotary_interleaved ? " interleaved" : " neox") << (rotary_fp32 ? " f32" : "");
    if (alibi > 0) s << (alibi == 1 ? " alibi(heads)" : " alibi(batch, heads)");
    if (backend != FC_BACKEND_AUTO) s << " " << fc_backend_name(backend);
    return s.str();
  }
};

/** A host buffer mirrored in the memory under test. */
struct KvBuffer {
  Memory* mem = nullptr;
  int32_t dtype = FC_DTYPE_F32;
  std::vector<int64_t> shape, strides;
  std::vector<uint8_t> host;
  void* dev = nullptr;

  KvBuffer() = default;
  KvBuffer(const KvBuffer&) = delete;
  KvBuffer& operator=(const KvBuffer&) = delete;
  ~KvBuffer() {
    if (dev) mem->release(dev);
  }
  void init(Memory& m, int32_t dt, std::vector<int64_t> shp) {
    mem = &m;
    dtype = dt;
    shape = std::move(shp);
    strides.assign(shape.size(), 1);
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    host.assign(static_cast<size_t>(n) * elem(), 0);
  }
  size_t elem() const { return dtype == FC_DTYPE_F16 || dtype == FC_DTYPE_BF16 ? 2 : 4; }
  int64_t numel() const { return static_cast<int64_t>(host.size() / elem()); }
  float get(int64_t i) const { return load_as_float(host.data(), i, static_cast<DType>(dtype)); }
  void set(int64_t i, float x) { store_from_float(host.data(), i, static_cast<DType>(dtype), x); }
  int32_t* ints() { return reinterpret_cast<int32_t*>(host.data()); }
  void upload() {
    if (!dev && !host.empty()) dev = mem->alloc(host.size());
    if (dev) mem->upload(dev, host.data(), host.size());
  }
  void download() {
    if (dev) mem->download(host.data(), dev, host.size());
  }
  fc_tensor tensor() const {
    fc_tensor t{};
    t.data = dev;
    t.dtype = dtype;
    t.device_type = mem->device_type();
    t.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    return t;
  }
};

struct KvProblem {
  KvCase c;
  int64_t capacity = 0, pages_per_seq = 0, cache_rows = 0;
  KvBuffer q, k_cache, v_cache, k_new, v_new, out, lse, seqlens, block_table, batch_idx, leftpad, cos, sin, slopes;
  std::vector<uint8_t> k_cache_before, v_cache_before;
  fc_tensor tq{}, tkc{}, tvc{}, tkn{}, tvn{}, tout{}, tlse{}, tlens{}, tbt{}, tbi{}, tpad{}, tcos{}, tsin{}, tslopes{};
  fc_kvcache_args args{};
  fc_attention_options opt{};

  KvProblem(const KvCase& kc, Memory& mem, uint64_t seed) : c(kc) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    int64_t longest = 0;
    for (int64_t b = 0; b < c.batch; ++b) longest = std::max<int64_t>(longest, start(b) + c.cache_lens[b] + c.seqlen_new);
    capacity = longest + c.slack;
    if (c.page_size > 0) {
      pages_per_seq = (capacity + c.page_size - 1) / c.page_size;
      capacity = pages_per_seq * c.page_size;  // what the library sees
      cache_rows = c.batch * pages_per_seq + 3;  // spare pages stay unused
    } else {
      cache_rows = c.batch + (c.batch_idx ? 2 : 0);
    }
    const int64_t rows_len = c.page_size > 0 ? c.page_size : capacity;
    auto fill = [&](KvBuffer& t) {
      for (int64_t i = 0; i < t.numel(); ++i) t.set(i, normal(rng));
    };
    q.init(mem, c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
    k_cache.init(mem, c.dtype, {cache_rows, rows_len, c.heads_kv, c.head_dim});
    v_cache.init(mem, c.dtype, {cache_rows, rows_len, c.heads_kv, c.head_dim});
    fill(q);
    fill(k_cache);
    fill(v_cache);
    k_cache_before = k_cache.host;
    v_cache_before = v_cache.host;
    out.init(mem, c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
    for (int64_t i = 0; i < out.numel(); ++i) out.set(i, std::numeric_limits<float>::quiet_NaN());
    lse.init(mem, FC_DTYPE_F32, {c.batch, c.heads_q, c.seqlen_q});
    for (int64_t i = 0; i < lse.numel(); ++i) lse.set(i, std::numeric_limits<float>::quiet_NaN());
    seqlens.init(mem, FC_DTYPE_I32, {c.batch});
    for (int64_t b = 0; b < c.batch; ++b) seqlens.ints()[b] = static_cast<int32_t>(start(b) + c.cache_lens[b]);
    if (!c.leftpad.empty()) {
      leftpad.init(mem, FC_DTYPE_I32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) leftpad.ints()[b] = c.leftpad[b];
    }
    if (c.rotary_half > 0) {  // a row for every slot a query or key can take
      std::uniform_real_distribution<double> angle(-3.2, 3.2);
      const int64_t rows = capacity + c.seqlen_q;
      cos.init(mem, c.rotary_fp32 ? FC_DTYPE_F32 : c.dtype, {rows, c.rotary_half});
      sin.init(mem, c.rotary_fp32 ? FC_DTYPE_F32 : c.dtype, {rows, c.rotary_half});
      for (int64_t i = 0; i < cos.numel(); ++i) {
        const double a = angle(rng);
        cos.set(i, static_cast<float>(std::cos(a)));
        sin.set(i, static_cast<float>(std::sin(a)));
      }
    }
    if (c.alibi > 0) {  // slopes of both signs and several magnitudes (ALiBi's are 2^-8h/H, in (0, 1])
      std::uniform_real_distribution<float> magnitude(-6.f, 0.f);
      std::bernoulli_distribution negative(0.2);
      slopes.init(mem, FC_DTYPE_F32, c.alibi == 1 ? std::vector<int64_t>{c.heads_q} : std::vector<int64_t>{c.batch, c.heads_q});
      for (int64_t i = 0; i < slopes.numel(); ++i) slopes.set(i, (negative(rng) ? -0.1f : 1.f) * std::exp2(magnitude(rng)));
    }
    if (c.seqlen_new > 0 || c.empty_append) {
      k_new.init(mem, c.dtype, {c.batch, c.seqlen_new, c.heads_kv, c.head_dim});
      v_new.init(mem, c.dtype, {c.batch, c.seqlen_new, c.heads_kv, c.head_dim});
      fill(k_new);
      fill(v_new);
    }
    if (c.page_size > 0) {
      std::vector<int32_t> ids(cache_rows);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      block_table.init(mem, FC_DTYPE_I32, {c.batch, pages_per_seq});
      for (int64_t i = 0; i < c.batch * pages_per_seq; ++i) block_table.ints()[i] = ids[i];
    } else if (c.batch_idx) {
      batch_idx.init(mem, FC_DTYPE_I32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) batch_idx.ints()[b] = static_cast<int32_t>(cache_rows - 1 - b);
    }
    for (KvBuffer* t :
         {&q, &k_cache, &v_cache, &k_new, &v_new, &out, &lse, &seqlens, &block_table, &batch_idx, &leftpad, &cos, &sin,
          &slopes})
      if (t->mem) t->upload();
    tq = q.tensor();
    tkc = k_cache.tensor();
    tvc = v_cache.tensor();
    tout = out.tensor();
    tlse = lse.tensor();
    tlens = seqlens.tensor();
    args.q = &tq;
    args.k_cache = &tkc;
    args.v_cache = &tvc;
    args.cache_seqlens = &tlens;
    args.out = &tout;
    args.lse = c.want_lse ? &tlse : nullptr;
    args.num_splits = c.num_splits;
    if (c.seqlen_new > 0 || c.empty_append) {
      tkn = k_new.tensor();
      tvn = v_new.tensor();
      args.k_new = &tkn;
      args.v_new = &tvn;
    }
    if (c.page_size > 0) {
      tbt = block_table.tensor();
      args.block_table = &tbt;
    } else if (c.batch_idx) {
      tbi = batch_idx.tensor();
      args.cache_batch_idx = &tbi;
    }
    if (leftpad.mem) {
      tpad = leftpad.tensor();
      args.cache_leftpad = &tpad;
    }
    if (cos.mem) {
      tcos = cos.tensor();
      tsin = sin.tensor();
      args.rotary_cos = &tcos;
      args.rotary_sin = &tsin;
      args.rotary_interleaved = c.rotary_interleaved;
    }
    opt.causal = c.causal;
    opt.has_window = c.window_left != -1 || c.window_right != -1;
    opt.window_left = c.window_left;
    opt.window_right = c.window_right;
    opt.softcap = c.softcap;
    if (slopes.mem) {
      tslopes = slopes.tensor();
      opt.alibi_slopes = &tslopes;
    }
    opt.stream = mem.stream();
    opt.sm_margin = c.sm_margin;
    opt.backend = c.backend;
  }

  /** Runs the call with a workspace of the size the library asks for. */
  fc_status run(Memory& mem) {
    size_t ws = 0;
    fc_status st = fc_attention_kvcache_workspace(&args, &opt, &ws);
    if (st != FC_OK) return st;
    void* w = ws ? mem.alloc(ws) : nullptr;
    st = fc_attention_kvcache(&args, &opt, w, ws);
    if (w) mem.release(w);
    return st;
  }

  /** Re-uploads the index tensors after a test edited their host copies. */
  void upload_indices() {
    for (KvBuffer* t : {&seqlens, &block_table, &batch_idx, &leftpad})
      if (t->mem) t->upload();
  }

  void fetch() {
    for (KvBuffer* t : {&out, &lse, &k_cache, &v_cache}) t->download();
  }

  /** Slot of sequence b's first token (its left padding). */
  int64_t start(int64_t b) const { return c.leftpad.empty() ? 0 : c.leftpad[b]; }

  /** Element offset of logical token `pos`, kv head h, of sequence b in the cache buffers. */
  int64_t cache_elem(int64_t b, int64_t pos, int64_t h) const {
    int64_t row = b, in_row = start(b) + pos;
    if (c.page_size > 0) {
      row = const_cast<KvBuffer&>(block_table).ints()[b * pages_per_seq + pos / c.page_size];
      in_row = pos % c.page_size;
    } else if (c.batch_idx) {
      row = const_cast<KvBuffer&>(batch_idx).ints()[b];
    }
    return row * k_cache.strides[0] + in_row * k_cache.strides[1] + h * k_cache.strides[2];
  }

  /** Feature d of `row` (head_dim features at element `at` of x) rotated at rotary position pos in
   *  fp64 (exact), or as the library computes it (emulate: fp32 of the stored values, rounded to
   *  the dtype once); unrotated features as stored. */
  double rotated(const KvBuffer& x, int64_t at, int64_t pos, int64_t d, bool emulate) const {
    const int64_t half = c.rotary_half;
    if (half == 0 || d >= 2 * half) return x.get(at + d);
    const bool inter = c.rotary_interleaved;
    const int64_t i = inter ? d / 2 : d % half, partner = inter ? (d ^ 1) : (d < half ? d + half : d - half);
    const bool first = inter ? d % 2 == 0 : d < half;
    const double cs = cos.get(pos * half + i), sn = sin.get(pos * half + i);
    const double v = x.get(at + d), w = x.get(at + partner);
    if (emulate) {
      const float fv = float(v), fw = float(w), fc = float(cs), fs = float(sn);
      const float r = first ? fv * fc - fw * fs : fw * fs + fv * fc;
      return round_to(static_cast<DType>(c.dtype), r);
    }
    return first ? v * cs - w * sn : w * sn + v * cs;
  }

  /** ALiBi slope of (sequence b, query head h); 0 without slopes. */
  double slope(int64_t b, int64_t h) const {
    if (c.alibi == 0) return 0;
    return slopes.get(c.alibi == 1 ? h : b * c.heads_q + h);
  }

  /** Query element (rotated when the case has rotary tables). */
  double query(int64_t b, int64_t i, int64_t h, int64_t d, bool emulate) const {
    const int64_t pos = start(b) + c.cache_lens[b] + (c.per_token_queries(capacity) ? i : 0);
    return rotated(q, ((b * c.seqlen_q + i) * c.heads_q + h) * c.head_dim, pos, d, emulate);
  }

  /** Logical key/value element after the append: cached tokens, then k_new/v_new (keys rotated). */
  double logical(bool value, int64_t b, int64_t pos, int64_t h, int64_t d, bool emulate = false) const {
    const int64_t len = c.cache_lens[b];
    if (pos >= len) {
      const int64_t at = ((b * c.seqlen_new + pos - len) * c.heads_kv + h) * c.head_dim;
      return value ? v_new.get(at + d) : rotated(k_new, at, start(b) + pos, d, emulate);
    }
    const std::vector<uint8_t>& before = value ? v_cache_before : k_cache_before;
    return load_as_float(before.data(), cache_elem(b, pos, h) + d, static_cast<DType>(c.dtype));
  }
};

/** fp64 oracle (exact) or the low-precision emulation X_same (fp32 scores, P rounded to the
 *  dtype, fp32 accumulation): out as (batch, seqlen_q, heads_q, head_dim), lse (batch, heads_q, seqlen_q).
 *  One task per (sequence, KV head): its keys and values read once, then each query row of its
 *  GQA group in turn (each row's sums in key order, so the threads change no bit). */
inline void kv_oracle(const KvProblem& pr, bool emulate, std::vector<double>* out, std::vector<double>* lse,
                      int64_t batch_limit) {
  const KvCase& c = pr.c;
  const int64_t hd = c.head_dim, group = c.heads_q / c.heads_kv;
  const double scale = 1.0 / std::sqrt(double(hd));
  const DType dt = static_cast<DType>(c.dtype);
  out->assign(c.batch * c.seqlen_q * c.heads_q * hd, 0.0);
  lse->assign(c.batch * c.heads_q * c.seqlen_q, -std::numeric_limits<double>::infinity());
  run_on_all_threads(batch_limit * c.heads_kv, [&](int64_t task) {
    const int64_t b = task / c.heads_kv, hk = task % c.heads_kv;
    const int64_t sk = c.cache_lens[b] + c.seqlen_new;
    const MaskInfo mask{c.seqlen_q, sk, c.window_left, c.causal ? 0 : c.window_right};
    std::vector<double> K(sk * hd), V(sk * hd), q(hd), acc(hd);
    for (int64_t j = 0; j < sk; ++j)
      for (int64_t d = 0; d < hd; ++d) {
        K[j * hd + d] = pr.logical(false, b, j, hk, d, emulate);
        V[j * hd + d] = pr.logical(true, b, j, hk, d, emulate);
      }
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        const KeyRange r = mask.keys_for_row(i);
        if (r.empty()) continue;
        for (int64_t d = 0; d < hd; ++d) q[d] = pr.query(b, i, h, d, emulate);
        std::vector<double> s(r.end - r.begin);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = r.begin; j < r.end; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q[d] * K[j * hd + d];
          double sc = dot * scale;
          if (c.softcap > 0) sc = c.softcap * std::tanh(sc / c.softcap);
          sc -= pr.slope(b, h) * std::fabs(double(mask.diagonal(i) - j));  // ALiBi (0 without slopes)
          if (emulate) sc = static_cast<float>(sc);
          s[j - r.begin] = sc;
          m = std::max(m, sc);
        }
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = r.begin; j < r.end; ++j) {
          double pj = std::exp(s[j - r.begin] - m);
          l += pj;
          if (emulate) pj = round_to(dt, static_cast<float>(pj));
          for (int64_t d = 0; d < hd; ++d) acc[d] += pj * V[j * hd + d];
        }
        for (int64_t d = 0; d < hd; ++d) {
          double o = acc[d] / l;
          if (emulate) o = round_to(dt, static_cast<float>(o));
          (*out)[((b * c.seqlen_q + i) * c.heads_q + h) * hd + d] = o;
        }
        (*lse)[(b * c.heads_q + h) * c.seqlen_q + i] = m + std::log(l);
      }
    }
  });
}

/** TESTING.md's rule: max|x - ref| <= 2 max|same - ref| + atol (atol: one rounding at the
 *  reference's magnitude; 1e-4 for the fp32 lse); fp32 data: relative norm <= 1e-5 (or within 2x
 *  the fp32 emulation's error). NaN never passes; infinities must match exactly. */
inline std::string kv_compare(const char* what, const std::vector<float>& x, const std::vector<double>& ref,
                              const std::vector<double>& same, int32_t dtype, bool is_lse) {
  constexpr double kFactor = 2.0, kLseAtol = 1e-4, kFp32Rel = 1e-5, kProbe = 0.3;
  double max_err = 0, same_err = 0, atol = 0, diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) return std::string(what) + "[" + std::to_string(i) + "] is NaN (unwritten or computed NaN)";
    if (std::isinf(ref[i]) || std::isinf(x[i])) {
      if (double(x[i]) != ref[i])
        return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(x[i]) + ", ref " + std::to_string(ref[i]);
      continue;
    }
    const double e = std::fabs(x[i] - ref[i]);
    max_err = std::max(max_err, e);
    diff2 += e * e;
    ref2 += ref[i] * ref[i];
    same_err = std::max(same_err, std::fabs(same[i] - ref[i]));
    if (!is_lse && dtype != FC_DTYPE_F32) {
      const DType dt = static_cast<DType>(dtype);
      const float rr = round_to(dt, static_cast<float>(ref[i]));
      const float back = round_to(dt, round_to(dt, rr + float(kProbe)) - float(kProbe));
      atol = std::max(atol, 2.0 * std::fabs(double(back) - ref[i]));
    }
  }
  std::ostringstream msg;
  if (dtype == FC_DTYPE_F32) {
    const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    if (rel > kFp32Rel && max_err > kFactor * same_err && max_err > kFp32Rel)
      msg << what << ": relative error " << rel << " > " << kFp32Rel;
  } else {
    if (is_lse) atol = kLseAtol;
    const double bound = kFactor * same_err + atol;
    if (max_err > bound) msg << what << ": max error " << max_err << " > bound " << bound << " (same " << same_err << ")";
  }
  return msg.str();
}

/** Everything a successful call must satisfy for sequences [0, batch_limit) (default: all); ""
 *  when it does. Call after pr.fetch(). Later sequences are neither compared nor expected to have
 *  appended anything (the device-side bad-index test makes them invalid on purpose). */
inline std::string check_kvcache_result(const KvProblem& pr, int64_t batch_limit = -1) {
  const KvCase& c = pr.c;
  if (batch_limit < 0) batch_limit = c.batch;
  std::vector<double> ref_o, ref_l, same_o, same_l;
  kv_oracle(pr, false, &ref_o, &ref_l, batch_limit);
  kv_oracle(pr, true, &same_o, &same_l, batch_limit);
  // Sequence-major layouts: the first batch_limit sequences are a prefix of out and lse.
  const int64_t o_n = batch_limit * c.seqlen_q * c.heads_q * c.head_dim, l_n = batch_limit * c.heads_q * c.seqlen_q;
  ref_o.resize(o_n);
  same_o.resize(o_n);
  ref_l.resize(l_n);
  same_l.resize(l_n);
  std::vector<float> o(o_n), l(l_n);
  for (int64_t i = 0; i < o_n; ++i) o[i] = pr.out.get(i);
  for (int64_t i = 0; i < l_n; ++i) l[i] = pr.lse.get(i);
  std::string e = kv_compare("out", o, ref_o, same_o, c.dtype, false);
  if (e.empty() && c.want_lse) e = kv_compare("lse", l, ref_l, same_l, c.dtype, true);
  if (!e.empty()) return e;
  // The caches: appended positions hold k_new/v_new bit for bit (rotated keys: within a few
  // roundings of the fp64 rotation); everything else is unchanged.
  std::vector<uint8_t> expect_k = pr.k_cache_before, expect_v = pr.v_cache_before;
  const size_t es = pr.k_cache.elem();
  const double eps = c.dtype == FC_DTYPE_BF16 ? 0x1p-8 : c.dtype == FC_DTYPE_F16 ? 0x1p-11 : 0x1p-23;
  for (int64_t b = 0; b < batch_limit; ++b)
    for (int64_t t = 0; t < c.seqlen_new; ++t)
      for (int64_t h = 0; h < c.heads_kv; ++h) {
        const int64_t dst = pr.cache_elem(b, c.cache_lens[b] + t, h);
        const int64_t src = ((b * c.seqlen_new + t) * c.heads_kv + h) * c.head_dim;
        std::memcpy(&expect_k[dst * es], &pr.k_new.host[src * es], c.head_dim * es);
        std::memcpy(&expect_v[dst * es], &pr.v_new.host[src * es], c.head_dim * es);
        for (int64_t d = 0; d < 2 * c.rotary_half; ++d) {
          const double exact = pr.logical(false, b, c.cache_lens[b] + t, h, d);
          const double got = pr.k_cache.get(dst + d), mag = std::fabs(pr.k_new.get(src + d)) + 1.0;
          if (!(std::fabs(got - exact) <= 4 * eps * mag))
            return "k_cache: appended key " + std::to_string(t) + " of sequence " + std::to_string(b) + ", head " +
                   std::to_string(h) + ", feature " + std::to_string(d) + " is " + std::to_string(got) +
                   ", the rotation gives " + std::to_string(exact);
          std::memcpy(&expect_k[(dst + d) * es], &pr.k_cache.host[(dst + d) * es], es);  // checked just above
        }
      }
  if (expect_k != pr.k_cache.host) return "k_cache: contents differ from the expected append";
  if (expect_v != pr.v_cache.host) return "v_cache: contents differ from the expected append";
  return "";
}

/** Runs one case end to end; "" on success, else what failed. */
inline std::string run_kvcache_case(const KvCase& c, Memory& mem, uint64_t seed) {
  KvProblem pr(c, mem, seed);
  if (pr.run(mem) != FC_OK) return std::string("call failed: ") + fc_last_error();
  pr.fetch();
  return check_kvcache_result(pr);
}

/** A call without cache_seqlens (fc_kvcache_args.cache_seqlens = NULL: every sequence fills its
 *  cache) against the same call with the lengths given: the case's lengths must fill every cache
 *  (slack 0, start + cache_lens = the capacity) and nothing may be appended. The call with lengths
 *  is checked against the fp64 oracle; the one without must give the same bits, output poisoned
 *  again between them. "" on success, else what failed. */
inline std::string run_full_cache_without_lengths(const KvCase& c, Memory& mem, uint64_t seed) {
  KvProblem pr(c, mem, seed);
  for (int64_t b = 0; b < c.batch; ++b)
    if (pr.start(b) + c.cache_lens[b] != pr.capacity) return "the case does not fill every cache";
  if (pr.run(mem) != FC_OK) return std::string("call with lengths failed: ") + fc_last_error();
  pr.fetch();
  const std::string err = check_kvcache_result(pr);
  if (!err.empty()) return "with lengths: " + err;
  const std::vector<uint8_t> out = pr.out.host, lse = pr.lse.host;
  for (KvBuffer* t : {&pr.out, &pr.lse}) {
    std::fill(t->host.begin(), t->host.end(), uint8_t{0xFF});
    t->upload();
  }
  pr.args.cache_seqlens = nullptr;
  if (pr.run(mem) != FC_OK) return std::string("call without lengths failed: ") + fc_last_error();
  pr.fetch();
  if (pr.out.host != out) return "out differs without lengths";
  if (pr.lse.host != lse) return "lse differs without lengths";
  return "";
}

/** A one-token case of three sequences (the base the case lists below vary). */
inline KvCase three_sequences(int32_t dtype, int64_t head_dim, std::vector<int32_t> lens, int64_t heads_q,
                              int64_t heads_kv) {
  KvCase c;
  c.dtype = dtype;
  c.head_dim = head_dim;
  c.batch = 3;
  c.cache_lens = std::move(lens);
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  return c;
}

/** Cases for run_full_cache_without_lengths: contiguous caches (permuted rows, left padding, a
 *  window), paged ones (16 / 64 / 256 keys a page), GQA / MHA / MQA, ALiBi with splits, and 16 /
 *  256 query rows per KV head (the CPU's and the GPU's forward-kernel routes). (Rotary tables
 *  come with an append, which needs the lengths.) */
inline std::vector<KvCase> full_cache_cases(int32_t dtype, int64_t head_dim) {
  std::vector<KvCase> cases;
  KvCase base = three_sequences(dtype, head_dim, {512, 512, 512}, 8, 2);
  base.slack = 0;
  cases.push_back(base);
  KvCase rows = base;
  rows.batch_idx = true;
  rows.causal = true;
  rows.seqlen_q = 2;
  cases.push_back(rows);
  KvCase pad = base;
  pad.leftpad = {0, 7, 500};
  pad.cache_lens = {512, 505, 12};
  cases.push_back(pad);
  KvCase window = base;
  window.heads_kv = 8;  // MHA
  window.window_left = 100;
  window.window_right = 0;
  window.softcap = 20;
  cases.push_back(window);
  for (int64_t page : {16, 64, 256}) {
    KvCase paged = base;
    paged.page_size = page;
    paged.heads_kv = page == 64 ? 1 : 2;  // MQA
    cases.push_back(paged);
  }
  KvCase alibi = base;  // splits and slopes
  alibi.alibi = 2;
  alibi.num_splits = 3;
  cases.push_back(alibi);
  for (int64_t seqlen_q : {4, 64}) {  // 16 and 256 rows per KV head: the forward-kernel routes
    KvCase chunk = base;
    chunk.seqlen_q = seqlen_q;
    chunk.causal = true;
    chunk.page_size = seqlen_q == 64 ? 16 : 0;
    cases.push_back(chunk);
  }
  // 256 rows per KV head of contiguous full caches: the GPU route hands them to the forward as a
  // dense call (no arrays built), here cut into 3 key ranges by the caller's num_splits.
  KvCase dense = base;
  dense.seqlen_q = 64;
  dense.causal = true;
  dense.num_splits = 3;
  cases.push_back(dense);
  return cases;
}

/** The shared grid: layouts x masks x GQA/MQA x append, for the given dtypes and head dims. */
inline std::vector<KvCase> kvcache_grid(const std::vector<int32_t>& dtypes, const std::vector<int64_t>& head_dims) {
  std::vector<KvCase> cases;
  const int64_t pages[] = {0, 1, 16, 64, 256};
  for (int32_t dt : dtypes)
    for (int64_t hd : head_dims)
      for (int64_t page : pages) {
        KvCase c;
        c.dtype = dt;
        c.head_dim = hd;
        c.page_size = page;
        c.batch = 3;
        c.cache_lens = {0, 37, 300};
        c.heads_q = 8;
        c.heads_kv = 2;
        cases.push_back(c);  // decode, GQA
        KvCase a = c;
        a.seqlen_new = 3;
        a.seqlen_q = 3;
        a.causal = true;
        a.heads_kv = 1;  // MQA, append, causal with seqlen_q > 1
        cases.push_back(a);
        KvCase w = c;
        w.seqlen_q = 2;
        w.seqlen_new = 1;
        w.window_left = 50;
        w.window_right = 0;
        w.softcap = 30;
        w.heads_kv = 8;  // MHA, window + softcap
        cases.push_back(w);
        if (page == 0) {
          KvCase bi = a;
          bi.batch_idx = true;
          cases.push_back(bi);
        }
      }
  return cases;
}

/** Left-padded caches and rotary tables, alone and together, over layouts and masks. */
inline std::vector<KvCase> leftpad_rotary_cases(int32_t dtype, int64_t head_dim) {
  std::vector<KvCase> cases;
  const KvCase base = three_sequences(dtype, head_dim, {0, 37, 130}, 4, 2);
  KvCase pad = base;  // decode from left-padded rows; the first sequence is all padding
  pad.leftpad = {6, 0, 21};
  cases.push_back(pad);
  KvCase pad_append = pad;  // appending, causal, split, rows taken through cache_batch_idx
  pad_append.seqlen_new = 3;
  pad_append.seqlen_q = 3;
  pad_append.causal = true;
  pad_append.num_splits = 3;
  pad_append.batch_idx = true;
  cases.push_back(pad_append);
  KvCase pad_window = pad;
  pad_window.seqlen_new = 1;
  pad_window.seqlen_q = 2;
  pad_window.window_left = 20;
  pad_window.window_right = 0;
  cases.push_back(pad_window);
  for (int64_t page : {int64_t(0), int64_t(16)})
    for (bool interleaved : {true, false}) {
      KvCase r = base;  // one token, every query at the same position
      r.page_size = page;
      r.seqlen_new = 1;
      r.rotary_half = head_dim / 2;
      r.rotary_interleaved = interleaved;
      cases.push_back(r);
      KvCase partial = r;  // rotary_dim 10 of head_dim: pairs straddle 8-element vectors (NeoX)
      partial.rotary_half = 5;
      partial.seqlen_new = 2;
      partial.seqlen_q = 3;  // queries reach one position past the new keys
      partial.causal = true;
      partial.rotary_fp32 = true;
      cases.push_back(partial);
      KvCase shared = partial;  // without a mask all queries sit at cache_seqlens
      shared.causal = false;
      shared.num_splits = 2;
      cases.push_back(shared);
    }
  KvCase both = pad_append;  // positions are slots: they count the padding
  both.rotary_half = 6;
  both.rotary_interleaved = false;
  cases.push_back(both);
  KvCase wide = base;  // a window as wide as the cache: flash_attn treats it as none (one position)
  wide.rotary_half = 6;
  wide.seqlen_q = 2;
  wide.seqlen_new = 2;
  wide.window_left = 100000;
  cases.push_back(wide);
  KvCase no_new_token = base;  // rotary with k_new of zero tokens: q is still rotated
  no_new_token.rotary_half = 4;
  no_new_token.seqlen_q = 2;
  no_new_token.causal = true;
  no_new_token.empty_append = true;
  cases.push_back(no_new_token);
  KvCase both_window = pad_window;
  both_window.rotary_half = head_dim / 2;
  cases.push_back(both_window);
  return cases;
}

/** ALiBi slopes over layouts, masks, GQA, appends, splits and left padding: the bias counts keys
 *  from each sequence's first (after the padding) and includes the appended ones. */
inline std::vector<KvCase> alibi_cases(int32_t dtype, int64_t head_dim) {
  std::vector<KvCase> cases;
  KvCase base = three_sequences(dtype, head_dim, {0, 37, 300}, 8, 2);
  base.alibi = 1;
  cases.push_back(base);  // decode, GQA, (heads_q) slopes
  KvCase paged = base;    // (batch, heads_q) slopes, paged, appending, causal, splits
  paged.alibi = 2;
  paged.page_size = 16;
  paged.seqlen_q = 3;
  paged.seqlen_new = 3;
  paged.causal = true;
  paged.num_splits = 3;
  cases.push_back(paged);
  KvCase window = base;  // window + softcap: the bias comes after the cap
  window.alibi = 2;
  window.seqlen_q = 2;
  window.seqlen_new = 1;
  window.window_left = 50;
  window.window_right = 0;
  window.softcap = 30;
  window.heads_kv = 8;
  cases.push_back(window);
  KvCase pad = base;  // left padding and rows through cache_batch_idx, queries past the new keys
  pad.leftpad = {6, 0, 21};
  pad.cache_lens = {0, 37, 130};
  pad.batch_idx = true;
  pad.seqlen_q = 4;
  pad.seqlen_new = 2;
  pad.num_splits = 2;
  cases.push_back(pad);
  KvCase mqa = paged;  // MQA, pages of one key
  mqa.heads_kv = 1;
  mqa.page_size = 1;
  mqa.num_splits = 1;
  cases.push_back(mqa);
  return cases;
}

}  // namespace flashcore::testing
