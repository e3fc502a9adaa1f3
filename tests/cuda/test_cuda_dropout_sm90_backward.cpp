// Dropout in the Hopper backward (cuda_sm90, kDropout kernels; src/cuda/sm90/backward_dropout.cuh):
// - with no GPU: the keep-bit mask's writer and reader mappings against common/dropout.hpp's rule;
// - on an sm_90 GPU: the backward against the fp64 reference through the harness (FC_BACKEND_AUTO,
//   after checking that the Hopper backward serves the case: AUTO then runs it there, and the
//   forward wherever AUTO puts it, as the mask does not depend on the backend), the mask read out
//   of dv element for element (one-hot inputs; forward on cuda_sm80, backward on cuda_sm90 through
//   the C ABI), cuda_sm90 against cuda_sm80 on the same forward, deterministic repeats bit for
//   bit, and p = 0 with a seed bit-identical to no dropout.
// The mask read-out runs as two tests: d64 / d128 (in scripts/gpu_check.sh's compute-sanitizer
// filter) and d256, whose role-split kernels racecheck misreads (docs/DESIGN.md, "Dropout").
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/dropout.hpp"
#include "common/grids.hpp"
#include "common/harness.hpp"
#include "cuda/cuda_memory.hpp"
#include "cuda/dropout_calls.hpp"
#include "cuda/sm90/backward_dropout.cuh"
#include "flashcore/flashcore.hpp"

namespace flashcore::testing {
namespace {

using namespace dropout_calls;

bool have_hopper() {
  return fc_cuda_device_count() > 0 && fc_backend_available(FC_BACKEND_CUDA_SM90, 0) &&
         fc_backend_available(FC_BACKEND_CUDA_SM80, 0);
}

#define REQUIRE_HOPPER() \
  if (!have_hopper()) GTEST_SKIP() << "no sm_90 GPU (or cuda_sm90 not built): Hopper dropout backward tests skipped"

// ---- the mask mapping (no GPU needed) -----------------------------------------------------------

// The writers (128 threads, DropoutMaskLayout's items, dropout_half_row_bits) fill every word of a
// step's mask exactly once; each reader thread (warp, lane) of the S^T accumulator layout (key rows
// 16 warp + group and + 8, query columns 8j + 2 quad + {0, 1}) then finds in gather_keep_bits'
// bit i the rule's answer for its register i. A wrong key, row, half or word index breaks it.
template <int kRows>
void check_mask_mapping(const DropoutParams& d, uint32_t bh, int m0, uint32_t block) {
  using L = cuda::sm90::DropoutMaskLayout<kRows>;
  std::vector<uint32_t> mask(L::kWords, 0xA5A5A5A5u);
  std::vector<int> writes(L::kWords, 0);
  for (int t = 0; t < 128; ++t) {
    for (int k = 0; k < L::kItemsPerThread; ++k) {
      const int q = L::item_row(t, k), half = L::item_half(t, k);
      ASSERT_TRUE(q >= 0 && q < kRows && (half == 0 || half == 1));
      const int word = L::word(half, q);
      mask[word] = cuda::sm90::dropout_half_row_bits(d, bh, static_cast<uint32_t>(m0 + q), block, half);
      ++writes[word];
    }
  }
  int written = 0;
  for (int n : writes) {
    ASSERT_LE(n, 1) << "a word written twice";
    written += n;
  }
  ASSERT_EQ(written, 2 * kRows) << "every (query row, key half) word written";
  for (int warp = 0; warp < 4; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      const int group = lane / 4, quad = lane % 4;
      const int key_local = 16 * warp + group;
      uint32_t bits[kRows / 64];
      cuda::sm90::gather_keep_bits<kRows>(mask.data(), key_local, quad, bits);
      for (int i = 0; i < kRows / 2; ++i) {
        const int key = key_local + 8 * ((i % 4) / 2);
        const int query = 8 * (i / 4) + 2 * quad + i % 2;
        const int64_t j = int64_t(block) * 64 + key;
        ASSERT_EQ(cuda::sm90::register_kept(bits, i), dropout_keeps(d, bh, m0 + query, j))
            << "rows " << kRows << " warp " << warp << " lane " << lane << " register " << i << " (key " << j
            << ", query " << m0 + query << ")";
      }
    }
  }
}

TEST(CudaDropoutSm90Backward, MaskMappingIsTheRule) {
  for (double p : {0.17, 0.5, 0.9}) {
    const DropoutParams d = make_dropout(p, 0x0123456789abcdefull, 0x0000000900000011ull);
    for (uint32_t bh : {0u, 5u, 77u}) {
      for (int m0 : {0, 64, 1000}) {
        for (uint32_t block : {0u, 1u, 7u, (1u << 22) + 3u}) {
          check_mask_mapping<64>(d, bh, m0, block);   // d128, d256
          check_mask_mapping<128>(d, bh, m0, block);  // d64
        }
      }
    }
  }
  // The thresholds' ends: 65536 (p below 2^-17) keeps every draw; 1 (p = 1 - 2^-16, the largest
  // p a call may pass) only draws of 0, bit for bit as the rule. Thresholds come from make_dropout
  // only (kept_below_hi and the rounds' keys derive there; a threshold of 0 is refused by validation).
  const DropoutParams all = make_dropout(1e-9, 1, 2);
  ASSERT_EQ(all.kept_threshold, 65536u);
  EXPECT_EQ(cuda::sm90::dropout_half_row_bits(all, 3, 4, 5, 1), 0xFFFFFFFFu);
  const DropoutParams one = make_dropout(1.0 - 1.0 / 65536, 1, 2);
  ASSERT_EQ(one.kept_threshold, 1u);
  for (int half = 0; half < 2; ++half) {
    uint32_t rule = 0;
    for (int k = 0; k < 32; ++k) rule |= static_cast<uint32_t>(dropout_keeps(one, 3, 4, 5 * 64 + 32 * half + k)) << k;
    EXPECT_EQ(cuda::sm90::dropout_half_row_bits(one, 3, 4, 5, half), rule) << "half " << half;
  }
}

// ---- against the reference ----------------------------------------------------------------------

/** Whether cuda_sm90 itself serves the case's backward (its workspace query runs its rules on
 *  the shapes and options; contiguous q / k / v as the harness makes them for unpadded cases), so
 *  that FC_BACKEND_AUTO in check_backward runs the Hopper backward, not sm80's. */
bool sm90_backward_serves(const Case& c, std::string* why) {
  const auto dt = static_cast<fc_dtype>(c.dtype);
  CudaMemory mem;
  std::vector<void*> owned;
  auto alloc = [&](size_t bytes) {
    void* p = mem.alloc(std::max<size_t>(bytes, 256));
    owned.push_back(p);
    return p;
  };
  fc_attention_options o{};
  o.backend = FC_BACKEND_CUDA_SM90;
  o.causal = c.causal;
  o.has_window = c.window_left != -1 || c.window_right != -1;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  o.dropout_p = c.dropout_p;
  o.dropout_seed = c.dropout_seed;
  o.dropout_offset = c.dropout_offset;
  o.deterministic = c.deterministic;
  fc_tensor tq{}, tk{}, tv{}, tcq{}, tck{};
  if (c.is_varlen()) {
    std::vector<int32_t> cu_q{0}, cu_k{0};
    for (size_t b = 0; b < c.varlen_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + c.varlen_q[b]);
      cu_k.push_back(cu_k.back() + c.varlen_k[b]);
      o.max_seqlen_q = std::max<int64_t>(o.max_seqlen_q, c.varlen_q[b]);
      o.max_seqlen_k = std::max<int64_t>(o.max_seqlen_k, c.varlen_k[b]);
    }
    const int64_t rows_q = std::max(cu_q.back(), 1), rows_k = std::max(cu_k.back(), 1);
    const int64_t n = static_cast<int64_t>(cu_q.size());
    void* dq = alloc(cu_q.size() * 4);
    void* dk = alloc(cu_k.size() * 4);
    mem.upload(dq, cu_q.data(), cu_q.size() * 4);
    mem.upload(dk, cu_k.data(), cu_k.size() * 4);
    tcq = make_tensor(dq, FC_DTYPE_I32, {n}, FC_DEVICE_CUDA);
    tck = make_tensor(dk, FC_DTYPE_I32, {n}, FC_DEVICE_CUDA);
    o.cu_seqlens_q = &tcq;
    o.cu_seqlens_k = &tck;
    tq = make_tensor(alloc(rows_q * c.heads_q * c.head_dim * 2), dt, {rows_q, c.heads_q, c.head_dim}, FC_DEVICE_CUDA);
    tk = make_tensor(alloc(rows_k * c.heads_kv * c.head_dim * 2), dt, {rows_k, c.heads_kv, c.head_dim}, FC_DEVICE_CUDA);
    tv = make_tensor(alloc(rows_k * c.heads_kv * c.head_dim * 2), dt, {rows_k, c.heads_kv, c.head_dim}, FC_DEVICE_CUDA);
  } else {
    const size_t q_bytes = static_cast<size_t>(c.batch * c.seqlen_q * c.heads_q * c.head_dim * 2);
    const size_t k_bytes = static_cast<size_t>(c.batch * c.seqlen_k * c.heads_kv * c.head_dim * 2);
    tq = make_tensor(alloc(q_bytes), dt, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, FC_DEVICE_CUDA);
    tk = make_tensor(alloc(k_bytes), dt, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, FC_DEVICE_CUDA);
    tv = make_tensor(alloc(k_bytes), dt, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, FC_DEVICE_CUDA);
  }
  size_t bytes = 0;
  const bool ok = fc_attention_backward_workspace(&tq, &tk, &tv, &o, &bytes) == FC_OK;
  if (!ok) *why = fc_last_error();
  for (void* p : owned) mem.release(p);
  return ok;
}

/** Against the reference through AUTO, after checking that the Hopper backward takes the case
 *  (so AUTO runs it there). */
void expect_backward(const std::vector<Case>& cases, bool deterministic) {
  CudaMemory mem;
  uint64_t seed = 900;
  for (Case c : cases) {
    c.deterministic = deterministic;
    std::string why;
    ASSERT_TRUE(sm90_backward_serves(c, &why)) << c.name() << ": cuda_sm90 refuses the backward: " << why;
    const CheckResult r = check_backward(c, FC_BACKEND_AUTO, mem, seed++);
    EXPECT_TRUE(r.ok) << (deterministic ? "deterministic " : "") << c.name() << "\n" << r.summary();
  }
}

/** grid_dropout_matrix over every head-dim bucket (64, 128, 256) and the padded dims 72 and 40,
 *  fp16 and bf16 (causal both ways with lengths off every tile, rows before the first key; GQA and
 *  MQA, dk / dv summed over the group; softcap with a two-sided window; ALiBi, the kAlibi dropout
 *  kernels), plus per dtype and dim varlen with empty sequences, and one query row at p = 0.9. */
std::vector<Case> sm90_dropout_cases() {
  std::vector<Case> cases = grid_dropout_matrix({64, 128, 256, 72, 40}, 270, 70, 0);
  uint64_t offset = cases.size();
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    for (int64_t dim : {64, 128, 256, 72, 40}) {
      Case vl;  // varlen with empty sequences, sequences off the tiles
      vl.varlen_q = {5, 0, 130, 64, 200};
      vl.varlen_k = {7, 33, 0, 200, 129};
      vl.heads_q = 4;
      vl.heads_kv = 2;
      vl.head_dim = dim;
      vl.dtype = dtype;
      vl.causal = dim != 64;
      vl.dropout_p = 0.5;
      vl.dropout_offset = offset++;
      cases.push_back(vl);
    }
  }
  Case one_row;  // one query row against several key blocks, p = 0.9
  one_row.batch = 2;
  one_row.seqlen_q = 1;
  one_row.seqlen_k = 700;
  one_row.heads_q = 8;
  one_row.heads_kv = 2;
  one_row.dropout_p = 0.9;
  cases.push_back(one_row);
  return cases;
}

TEST(CudaDropoutSm90Backward, MatchesTheReference) {
  REQUIRE_HOPPER();
  expect_backward(sm90_dropout_cases(), false);
}

TEST(CudaDropoutSm90Backward, DeterministicMatchesTheReference) {
  REQUIRE_HOPPER();
  expect_backward(sm90_dropout_cases(), true);
}

// The harness's dropout grid (masks at both alignments, a window inside a 64-key block, fully
// masked rows, padded strides where TMA can serve them, ...) on the buckets.
TEST(CudaDropoutSm90Backward, DropoutGrid) {
  REQUIRE_HOPPER();
  GridOptions g;
  g.head_dims = {64, 128};
  g.odd_head_dims = {256, 96};
  std::vector<Case> served;
  for (const Case& c : grid_dropout(g)) {
    std::string why;
    // Padded strides: the workspace query above sees contiguous tensors; leave them to AUTO's
    // own choice in test_cuda_dropout.cpp.
    if (!c.padded && sm90_backward_serves(c, &why)) served.push_back(c);
  }
  ASSERT_GE(served.size(), grid_dropout(g).size() / 2) << "most of the grid runs on cuda_sm90";
  expect_backward(served, false);
}

TEST(CudaDropoutSm90Backward, DeterministicIsBitIdentical) {
  REQUIRE_HOPPER();
  CudaMemory mem;
  Case c = dropout_repeat_case();
  c.deterministic = true;
  for (int64_t dim : {64, 128, 256}) {
    c.head_dim = dim;
    std::string why;
    ASSERT_TRUE(sm90_backward_serves(c, &why)) << why;
    EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_AUTO, mem, 10, true, &why)) << "d" << dim << ": " << why;
  }
}

// ---- direct calls (dropout_calls.hpp): forward on cuda_sm80, backward on cuda_sm90 --------------

// q = 0: every visible probability of a row is 1 / (visible keys). dout of query head h, row i =
// e_(g * sq + i) with g = h's index in its GQA group (sq * group <= head_dim): column g * sq + i
// of dv_j is then P_ij Z_ij of head h alone (the group's heads land in different columns), nonzero
// exactly where entry (i, j) of that head is visible and kept. Compared element for element with
// dropout_keeps of (b * heads_q + h, i, j): a wrong key, query, head or sequence index, a
// transposed bit or a key block off by one fails. Lengths cross the 64- and 128-key blocks.
void expect_rules_mask(std::initializer_list<int64_t> dims) {
  CudaMemory mem;
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    for (int64_t dim : dims) {
      for (bool causal : {false, true}) {
        for (bool deterministic : {false, true}) {
          const double p = causal ? 0.5 : 0.17;
          DenseProblem pr;
          pr.batch = 2;
          pr.heads_q = 4;
          pr.heads_kv = dim == 64 ? 4 : 2;  // MHA at d64, GQA 2 elsewhere
          const int64_t group = pr.heads_q / pr.heads_kv;
          pr.d = dim;
          pr.sq = dim / group - 3;
          pr.sk = 3 * dim / 2 + 7;  // several key blocks, the last partial
          pr.dtype = dtype;
          pr.q.assign(pr.q_elems(), 0);
          pr.k.assign(pr.k_elems(), 0);
          pr.v.assign(pr.k_elems(), 0);
          pr.dout.assign(pr.q_elems(), 0);
          auto at = [&](int64_t b, int64_t row, int64_t h, int64_t c, int64_t seqlen, int64_t heads) {
            return static_cast<size_t>(((b * seqlen + row) * heads + h) * pr.d + c);
          };
          for (int64_t b = 0; b < pr.batch; ++b) {
            for (int64_t h = 0; h < pr.heads_q; ++h) {
              for (int64_t i = 0; i < pr.sq; ++i) pr.dout[at(b, i, h, (h % group) * pr.sq + i, pr.sq, pr.heads_q)] = one_bits(dtype);
            }
            for (int64_t h = 0; h < pr.heads_kv; ++h) {
              for (int64_t j = 0; j < pr.sk; ++j) pr.v[at(b, j, h, j % pr.d, pr.sk, pr.heads_kv)] = one_bits(dtype);
            }
          }
          fc_attention_options opt = dropout_options(FC_BACKEND_CUDA_SM80, p, 0xbeefull + dim, 77ull << 32);
          opt.causal = causal;
          opt.deterministic = deterministic;
          const std::vector<DenseResult> r = run_dense_backwards(mem, pr, opt, {FC_BACKEND_CUDA_SM90});
          ASSERT_TRUE(r[0].error.empty()) << r[0].error;
          const DropoutParams d = make_dropout(p, opt.dropout_seed, opt.dropout_offset);
          int64_t visible = 0, kept = 0, wrong = 0;
          std::string first;
          for (int64_t b = 0; b < pr.batch; ++b)
            for (int64_t h = 0; h < pr.heads_q; ++h)
              for (int64_t i = 0; i < pr.sq; ++i)
                for (int64_t j = 0; j < pr.sk; ++j) {
                  const bool seen = !causal || j <= i + pr.sk - pr.sq;
                  const bool keep = seen && dropout_keeps(d, b * pr.heads_q + h, i, j);
                  visible += seen;
                  kept += keep;
                  const size_t e = at(b, j, h / group, (h % group) * pr.sq + i, pr.sk, pr.heads_kv);
                  const bool dv_kept = (r[0].dv[e] & 0x7FFF) != 0;
                  if (dv_kept != keep) {
                    ++wrong;
                    if (first.empty()) {
                      first = "b " + std::to_string(b) + " h " + std::to_string(h) + " i " + std::to_string(i) +
                              " j " + std::to_string(j) + ": rule " + (keep ? "keeps" : "drops");
                    }
                  }
                }
          const std::string what = std::string(dtype == FC_DTYPE_F16 ? "fp16" : "bf16") + " d" +
                                   std::to_string(dim) + (causal ? " causal" : "") +
                                   (deterministic ? " deterministic" : "");
          EXPECT_EQ(wrong, 0) << what << ", first: " << first;
          const double fraction = static_cast<double>(kept) / static_cast<double>(visible);
          EXPECT_NEAR(fraction, 1 - p, 0.05) << what << ": " << kept << " of " << visible << " kept";
          // A kept entry of dv is keep_scale / visible keys (non-causal rows): keep_scale applied once.
          if (!causal) {
            const float expected = static_cast<float>(d.keep_scale / static_cast<double>(pr.sk));
            int checked = 0;
            for (int64_t j = 0; j < pr.sk && checked < 8; ++j) {
              if (!dropout_keeps(d, 0, 0, j)) continue;
              EXPECT_NEAR(bits_to_float(r[0].dv[at(0, j, 0, 0, pr.sk, pr.heads_kv)], dtype), expected,
                          expected * 1e-2)
                  << what << " j " << j;
              ++checked;
            }
          }
        }
      }
    }
  }
}

TEST(CudaDropoutSm90Backward, BackwardDrawsTheRulesMask) {
  REQUIRE_HOPPER();
  expect_rules_mask({64, 128});
}

// d256 apart: compute-sanitizer racecheck reports hazards in its role-split kernels that the
// barriers rule out (docs/DESIGN.md, "Dropout"), so scripts/gpu_check.sh's sanitizer filter
// names only the test above.
TEST(CudaDropoutSm90Backward, BackwardDrawsTheRulesMaskD256) {
  REQUIRE_HOPPER();
  expect_rules_mask({256});
}

/** max |a - b| over max |b| (16-bit patterns). */
double relative_max_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int32_t dtype) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bits_to_float(a[i], dtype), y = bits_to_float(b[i], dtype);
    diff = std::max(diff, std::fabs(x - y));
    scale = std::max(scale, std::fabs(y));
  }
  return scale > 0 ? diff / scale : diff;
}

// The two backward backends on one forward's O and lse agree to rounding (both validated against
// the reference elsewhere; here every head dim, GQA, causal and not), and both differ clearly from
// the backward without dropout: a mask, keep_scale or D that only one of them gets right fails.
TEST(CudaDropoutSm90Backward, AgreesWithSm80) {
  REQUIRE_HOPPER();
  CudaMemory mem;
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    const double tol = dtype == FC_DTYPE_F16 ? 1e-2 : 3e-2;
    for (int64_t dim : {64, 128, 256, 96}) {
      for (bool causal : {false, true}) {
        const DenseProblem pr =
            random_problem(dim, dtype, 31 + dim, 190, 301, 4, causal ? 1 : 2, 2, /*with_dout=*/true);
        fc_attention_options opt = dropout_options(FC_BACKEND_CUDA_SM80, 0.3, 1234 + dim, 5);
        opt.causal = causal;
        const auto r = run_dense_backwards(mem, pr, opt, {FC_BACKEND_CUDA_SM90, FC_BACKEND_CUDA_SM80});
        ASSERT_TRUE(r[0].error.empty() && r[1].error.empty()) << r[0].error << r[1].error;
        const std::string what = std::string(dtype == FC_DTYPE_F16 ? "fp16" : "bf16") + " d" + std::to_string(dim) +
                                 (causal ? " causal" : "");
        EXPECT_LT(relative_max_difference(r[0].dq, r[1].dq, dtype), tol) << what << " dq";
        EXPECT_LT(relative_max_difference(r[0].dk, r[1].dk, dtype), tol) << what << " dk";
        EXPECT_LT(relative_max_difference(r[0].dv, r[1].dv, dtype), tol) << what << " dv";
        // Without dropout (the same forward would differ too: its own run, its own O).
        const auto none =
            run_dense_backwards(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0, 0, 0), {FC_BACKEND_CUDA_SM90});
        ASSERT_TRUE(none[0].error.empty()) << none[0].error;
        EXPECT_GT(relative_max_difference(r[0].dv, none[0].dv, dtype), 0.1) << what << ": dropout changes dv";
      }
    }
  }
}

// dropout_p = 0 is no dropout whatever the seed and offset: the same kernels, the same bits
// (deterministic backward on cuda_sm90).
TEST(CudaDropoutSm90Backward, ZeroProbabilityIsNoDropout) {
  REQUIRE_HOPPER();
  CudaMemory mem;
  for (int64_t dim : {64, 128, 256}) {
    for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
      const DenseProblem pr = random_problem(dim, dtype, 9 + dim, 190, 301, 4, 2, 2, /*with_dout=*/true);
      fc_attention_options plain = dropout_options(FC_BACKEND_CUDA_SM80, 0, 0, 0);
      fc_attention_options seeded = dropout_options(FC_BACKEND_CUDA_SM80, 0, 0xabcdefull, 99ull << 40);
      plain.deterministic = seeded.deterministic = 1;
      plain.causal = seeded.causal = dim == 128;
      const auto a = run_dense_backwards(mem, pr, plain, {FC_BACKEND_CUDA_SM90});
      const auto b = run_dense_backwards(mem, pr, seeded, {FC_BACKEND_CUDA_SM90});
      ASSERT_TRUE(a[0].error.empty() && b[0].error.empty()) << a[0].error << b[0].error;
      EXPECT_EQ(a[0].dq, b[0].dq) << "d" << dim;
      EXPECT_EQ(a[0].dk, b[0].dk) << "d" << dim;
      EXPECT_EQ(a[0].dv, b[0].dv) << "d" << dim;
    }
  }
}

}  // namespace
}  // namespace flashcore::testing
