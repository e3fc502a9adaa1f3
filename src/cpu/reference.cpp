// The oracle: attention computed the obvious way, one query row at a time, with every score of
// the row materialized. Two precisions:
//  - exact (default): fp64 throughout - the truth every test compares against;
//  - low_precision: what an honest fp16/bf16 kernel computes (scores and sums in fp32, P rounded
//    to the input dtype before P*V, dS rounded before dS*K and dS^T*Q, and the backward's
//    D = rowsum(dO * O) read from the stored O as a kernel reads it) - the "X_same" of TESTING.md's
//    tolerance rule, which measures how wrong low precision alone makes a result;
//  - score_error_bound (backward only): how far each gradient moves, to first order, when every
//    score carries the error of an fp32 dot product (see reference_backward in backends.hpp).
// Single-threaded on purpose: it must be obviously right, not fast.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "common/dtype_host.hpp"

namespace flashcore::cpu {
namespace {

/** Arithmetic policy: Real is the accumulation type; round() models storage in the input dtype. */
template <typename Real>
struct Arith {
  DType dtype;
  bool low;
  Real round(Real x) const { return low ? static_cast<Real>(round_to(dtype, static_cast<float>(x))) : x; }
};

template <typename Real>
Real load(const TensorRef& t, DType dt, int64_t b, int64_t row, int64_t h, int64_t d) {
  return static_cast<Real>(load_as_float(t.data, offset_of(t, b, row, h) + d, dt));
}

/** Keys [r.begin, r.end) of sequence b, KV head hk, as Real: every row of K and V read once
 *  (kv_offset places row s.k_start + j, through the page table for paged K/V), so that the row
 *  loops below index plain arrays instead of converting each element once per query row. */
template <typename Real>
class KvRows {
 public:
  KvRows(const AttentionParams& p, int64_t b, const SeqInfo& s, int64_t hk, KeyRange r)
      : begin_(r.begin), hd_(p.head_dim) {
    const size_t n = static_cast<size_t>(std::max<int64_t>(r.end - r.begin, 0) * hd_);
    k_.resize(n);
    v_.resize(n);
    for (int64_t j = r.begin; j < r.end; ++j) {
      const int64_t k_off = kv_offset(p, p.k, b, s.k_start + j, hk), v_off = kv_offset(p, p.v, b, s.k_start + j, hk);
      for (int64_t d = 0; d < hd_; ++d) {
        k_[(j - begin_) * hd_ + d] = static_cast<Real>(load_as_float(p.k.data, k_off + d, p.dtype));
        v_[(j - begin_) * hd_ + d] = static_cast<Real>(load_as_float(p.v.data, v_off + d, p.dtype));
      }
    }
  }
  /** Key / value row j (j in [r.begin, r.end), counted from the sequence's first key). */
  const Real* k(int64_t j) const { return k_.data() + (j - begin_) * hd_; }
  const Real* v(int64_t j) const { return v_.data() + (j - begin_) * hd_; }

 private:
  int64_t begin_, hd_;
  std::vector<Real> k_, v_;
};

/** All keys of sequence b: what a query row's key range is drawn from. */
KeyRange all_keys(const SeqInfo& s) { return KeyRange{0, s.seqlen_k}; }

/** Scores of one query row against keys [r.begin, r.end): scale * q.k, then softcap, then the
 *  ALiBi bias -slope * |i + seqlen_k - seqlen_q - j|. Also returns the tanh values needed by the
 *  backward chain rule (tanh_out, when softcap > 0; the bias is a constant there). */
template <typename Real>
void row_scores(const AttentionParams& p, int64_t b, const SeqInfo& s, int64_t i, int64_t h, KeyRange r,
                const KvRows<Real>& kv, const std::vector<Real>& q_row, std::vector<Real>* scores,
                std::vector<Real>* tanh_out) {
  scores->assign(static_cast<size_t>(r.end - r.begin), Real(0));
  if (tanh_out) tanh_out->assign(scores->size(), Real(0));
  const Real slope = static_cast<Real>(p.alibi_slope(b, h));
  const int64_t diagonal = i + s.seqlen_k - s.seqlen_q;  // the key at distance 0
  for (int64_t j = r.begin; j < r.end; ++j) {
    const Real* k_row = kv.k(j);
    Real dot = 0;
    for (int64_t d = 0; d < p.head_dim; ++d) dot += q_row[d] * k_row[d];
    Real sc = dot * static_cast<Real>(p.softmax_scale);
    if (p.softcap > 0) {
      const Real cap = static_cast<Real>(p.softcap);
      const Real t = std::tanh(sc / cap);
      if (tanh_out) (*tanh_out)[j - r.begin] = t;
      sc = cap * t;
    }
    if (slope != 0) sc -= slope * static_cast<Real>(diagonal > j ? diagonal - j : j - diagonal);
    (*scores)[j - r.begin] = sc;
  }
}

/** Dropout (common/dropout.hpp): whether entry (i, j) of sequence b, query head h is dropped. */
bool dropped(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return p.dropout.enabled() && !dropout_keeps(p.dropout, b * p.heads_q + h, i, j);
}

/** The factor of kept probabilities: 1 / (1 - dropout_p) as every backend applies it (the float
 *  make_dropout computes in double; 1 without dropout). */
template <typename Real>
Real keep_scale(const AttentionParams& p) {
  return p.dropout.enabled() ? static_cast<Real>(p.dropout.keep_scale) : Real(1);
}

template <typename Real>
Status forward_impl(const AttentionParams& p, bool low) {
  const Arith<Real> ar{p.dtype, low};
  const int64_t hd = p.head_dim;
  std::vector<Real> q_row(hd), scores, acc(hd);
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    const MaskInfo mask = mask_info(p, s);
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const KvRows<Real> kv(p, b, s, hk, all_keys(s));  // shared by the KV head's query heads
      for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        for (int64_t i = 0; i < s.seqlen_q; ++i) {
          const int64_t qrow = s.q_start + i;
          const KeyRange r = mask.keys_for_row(i);
          const int64_t o_off = offset_of(p.out, b, qrow, h);
          float lse = -std::numeric_limits<float>::infinity();
          if (r.empty()) {
            for (int64_t d = 0; d < hd; ++d) store_from_float(p.out.data, o_off + d, p.dtype, 0.f);
          } else {
            for (int64_t d = 0; d < hd; ++d) q_row[d] = load<Real>(p.q, p.dtype, b, qrow, h, d);
            row_scores<Real>(p, b, s, i, h, r, kv, q_row, &scores, nullptr);
            Real m = -std::numeric_limits<Real>::infinity();
            for (Real x : scores) m = std::max(m, x);
            Real l = 0;
            std::fill(acc.begin(), acc.end(), Real(0));
            for (int64_t j = r.begin; j < r.end; ++j) {
              const Real pj = std::exp(scores[j - r.begin] - m);
              l += pj;  // lse and the normalization see every probability; dropout only zeroes P V's terms
              if (dropped(p, b, h, i, j)) continue;
              const Real pj_stored = ar.round(pj);
              const Real* v_row = kv.v(j);
              for (int64_t d = 0; d < hd; ++d) acc[d] += pj_stored * v_row[d];
            }
            const Real out_scale = keep_scale<Real>(p) / l;
            for (int64_t d = 0; d < hd; ++d)
              store_from_float(p.out.data, o_off + d, p.dtype, static_cast<float>(acc[d] * out_scale));
            lse = static_cast<float>(m + std::log(l));
          }
          if (p.lse.data) p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + qrow * p.lse.row_stride] = lse;
        }
      }
    }
  }
  return Status::ok();
}

/** Relative error allowed to an fp32 dot product of length n, in units of sum|q_d k_d|: a
 *  kernel's forward and backward accumulate the same score in different orders (tensor-core
 *  adders truncate), so P recomputed in the backward does not match the forward's lse exactly.
 *  sqrt(n)/2 units of 2^-24 is the statistical size of n roundings, not the worst case. */
double score_relative_error(int64_t n) { return 0.5 * std::sqrt(static_cast<double>(n)) * std::ldexp(1.0, -24); }

template <typename Real>
Status backward_impl(const BackwardParams& p, ReferenceMode mode) {
  const bool low = mode == ReferenceMode::low_precision;
  const bool bound = mode == ReferenceMode::score_error_bound;
  const Arith<Real> ar{p.dtype, low};
  const Real score_rel_err = static_cast<Real>(score_relative_error(p.head_dim));
  const int64_t hd = p.head_dim;
  const Real scale = static_cast<Real>(p.softmax_scale);
  const Real kept = keep_scale<Real>(p);  // Z_ij of a kept entry
  std::vector<Real> q_row(hd), do_row(hd), scores, tanhs, probs, dq(hd), o_row(hd);
  std::vector<Real> dk, dv;  // (seqlen_k, hd) of one KV head, summed over its query heads
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqInfo s = seq_info(p, b);
    const MaskInfo mask = mask_info(p, s);
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const KvRows<Real> kv(p, b, s, hk, all_keys(s));
      dk.assign(static_cast<size_t>(s.seqlen_k * hd), Real(0));
      dv.assign(static_cast<size_t>(s.seqlen_k * hd), Real(0));
      for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        for (int64_t i = 0; i < s.seqlen_q; ++i) {
          const int64_t qrow = s.q_start + i;
          const KeyRange r = mask.keys_for_row(i);
          std::fill(dq.begin(), dq.end(), Real(0));
          if (!r.empty()) {
            for (int64_t d = 0; d < hd; ++d) {
              q_row[d] = load<Real>(p.q, p.dtype, b, qrow, h, d);
              do_row[d] = load<Real>(p.dout, p.dtype, b, qrow, h, d);
            }
            row_scores<Real>(p, b, s, i, h, r, kv, q_row, &scores, &tanhs);
            Real m = -std::numeric_limits<Real>::infinity();
            for (Real x : scores) m = std::max(m, x);
            Real l = 0;
            probs.resize(scores.size());
            for (size_t j = 0; j < scores.size(); ++j) l += (probs[j] = std::exp(scores[j] - m));
            for (auto& x : probs) x /= l;
            // D_i = dO_i . O_i. Exact: O_i recomputed in fp64. Low precision: the stored O, as a
            // kernel reads it; with spread scores dP_ij - D_i cancels, so O's rounding in the
            // forward (already checked there) sets most of dS's error.
            if (low) {
              for (int64_t d = 0; d < hd; ++d) o_row[d] = load<Real>(p.out, p.dtype, b, qrow, h, d);
            } else {
              std::fill(o_row.begin(), o_row.end(), Real(0));
              for (int64_t j = r.begin; j < r.end; ++j) {
                if (dropped(p, b, h, i, j)) continue;
                const Real* v_row = kv.v(j);
                for (int64_t d = 0; d < hd; ++d) o_row[d] += probs[j - r.begin] * kept * v_row[d];
              }
            }
            Real Di = 0;
            for (int64_t d = 0; d < hd; ++d) Di += do_row[d] * o_row[d];
            for (int64_t j = r.begin; j < r.end; ++j) {
              const Real pj = probs[j - r.begin];
              // Dropout: O = sum_j P_j Z_j v_j with Z_j = 0 or 1 / (1 - p), so dL/dP_j = Z_j dO.v_j,
              // and sum_j P_j Z_j dO.v_j is still dO.O = D_i.
              const Real zj = dropped(p, b, h, i, j) ? Real(0) : kept;
              const Real *k_row = kv.k(j), *v_row = kv.v(j);
              Real dp = 0;
              for (int64_t d = 0; d < hd; ++d) dp += do_row[d] * v_row[d];
              Real ds = pj * (dp * zj - Di);
              Real dscore = 1;  // d(score)/d(q.k * scale): below 1 under a softcap
              if (p.softcap > 0) {
                const Real t = tanhs[j - r.begin];
                dscore = Real(1) - t * t;
                ds *= dscore;
              }
              // The weights of this key in dV and of its dS in dQ / dK. In score_error_bound mode
              // they become what a score error e moves them by: P_ij e and |dS_ij| e, with e the
              // fp32 error of the row's dot product (natural-log units, through the softcap).
              Real p_weight = ar.round(pj) * zj, ds_weight = ar.round(ds);
              if (bound) {
                Real dot_abs = 0;
                for (int64_t d = 0; d < hd; ++d) dot_abs += std::fabs(q_row[d] * k_row[d]);
                const Real e = score_rel_err * dot_abs * scale * dscore;
                p_weight = pj * zj * e;
                ds_weight = std::fabs(ds) * e;
              }
              for (int64_t d = 0; d < hd; ++d) {
                const Real kd = k_row[d];
                dv[(j * hd) + d] += p_weight * (bound ? std::fabs(do_row[d]) : do_row[d]);
                dq[d] += ds_weight * (bound ? std::fabs(kd) : kd);
                dk[(j * hd) + d] += ds_weight * (bound ? std::fabs(q_row[d]) : q_row[d]);
              }
            }
          }
          const int64_t dq_off = offset_of(p.dq, b, qrow, h);
          for (int64_t d = 0; d < hd; ++d) store_from_float(p.dq.data, dq_off + d, p.dtype, static_cast<float>(scale * dq[d]));
        }
      }
      for (int64_t j = 0; j < s.seqlen_k; ++j) {
        const int64_t dk_off = offset_of(p.dk, b, s.k_start + j, hk);
        const int64_t dv_off = offset_of(p.dv, b, s.k_start + j, hk);
        for (int64_t d = 0; d < hd; ++d) {
          store_from_float(p.dk.data, dk_off + d, p.dtype, static_cast<float>(scale * dk[j * hd + d]));
          store_from_float(p.dv.data, dv_off + d, p.dtype, static_cast<float>(dv[j * hd + d]));
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace

void reference_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, double* out_row, double* lse) {
  const SeqInfo s = seq_info(p, b);
  const KeyRange r = mask_info(p, s).keys_for_row(i);
  *lse = -std::numeric_limits<double>::infinity();
  std::fill(out_row, out_row + p.head_dim, 0.0);
  if (r.empty()) return;
  std::vector<double> q_row(p.head_dim), scores;
  for (int64_t d = 0; d < p.head_dim; ++d) q_row[d] = load<double>(p.q, p.dtype, b, s.q_start + i, h, d);
  const KvRows<double> kv(p, b, s, h / p.group_size(), r);  // this row's keys only
  row_scores<double>(p, b, s, i, h, r, kv, q_row, &scores, nullptr);
  double m = -std::numeric_limits<double>::infinity();
  for (double x : scores) m = std::max(m, x);
  double l = 0;
  for (int64_t j = r.begin; j < r.end; ++j) {
    const double pj = std::exp(scores[j - r.begin] - m);
    l += pj;
    if (dropped(p, b, h, i, j)) continue;
    const double* v_row = kv.v(j);
    for (int64_t d = 0; d < p.head_dim; ++d) out_row[d] += pj * v_row[d];
  }
  for (int64_t d = 0; d < p.head_dim; ++d) out_row[d] *= keep_scale<double>(p) / l;
  *lse = m + std::log(l);
}

Status reference_forward(const AttentionParams& p, ReferenceMode mode) {
  if (mode == ReferenceMode::score_error_bound) return Status::invalid("reference_forward: no score_error_bound mode");
  return mode == ReferenceMode::low_precision ? forward_impl<float>(p, true) : forward_impl<double>(p, false);
}

Status reference_backward(const BackwardParams& p, ReferenceMode mode) {
  return mode == ReferenceMode::low_precision ? backward_impl<float>(p, mode) : backward_impl<double>(p, mode);
}

}  // namespace flashcore::cpu
