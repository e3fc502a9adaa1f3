// Dropout on the portable GPU kernels (cuda_sm80; the Hopper kernels have their own tests in
// test_cuda_dropout_sm90_forward.cpp and test_cuda_dropout_sm90_backward.cpp): forward and backward against the fp64 reference with the same seed and offset
// (TESTING.md's tolerance rule), through every configuration a dropout call can reach (head-dim
// buckets 64 / 128 / 256 and a padded dim, fp16 / bf16, causal both ways, windows, softcap, ALiBi,
// GQA / MQA, varlen, paged K/V, lengths off every tile size, the deterministic backward), plus
// tests that read the mask itself out of the kernels: with q = 0 every visible probability is
// equal and v_j = e_j (dout_i = e_i) makes out (dv) show exactly which entries were kept, element
// for element against common/dropout.hpp's rule. The first test needs no GPU: it checks the
// lane-to-draw mapping the kernels use (cuda/sm80/dropout_fragment.hpp) against that rule.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dropout.hpp"
#include "common/grids.hpp"
#include "common/harness.hpp"
#include "cuda/cuda_memory.hpp"
#include "cuda/dropout_calls.hpp"
#include "cuda/sm80/dropout_fragment.hpp"
#include "flashcore/flashcore.hpp"

namespace flashcore::testing {
namespace {

using namespace dropout_calls;

bool have_gpu() { return fc_cuda_device_count() > 0 && fc_backend_available(FC_BACKEND_CUDA_SM80, 0); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU with sm_80+ present: CUDA dropout tests skipped"

// ---- the lane mapping (no GPU needed) -----------------------------------------------------------

// Lane quad t of an m16n8 accumulator holds columns 8n + 2t + {0, 1}; the kernels draw them with
// one call per 32 keys (dropout_quad_words) and read word n % 4, half e. Every column of every
// group must get the draw dropout_keeps gives it, or the GPU and the CPU backends drop different
// entries.
TEST(CudaDropoutFragment, LaneDrawsAreTheRule) {
  const DropoutParams d = make_dropout(0.4, 0x0123456789abcdefull, 0x0000000900000011ull);
  for (uint32_t bh : {0u, 5u, 77u}) {
    for (uint32_t row : {0u, 1u, 63u, 1000u}) {
      for (uint32_t key32 = 0; key32 < 1024; key32 += 32) {
        for (int quad = 0; quad < 4; ++quad) {
          const PhiloxWords words = cuda::sm80::dropout_quad_words(d, bh, row, key32, quad);
          for (int n = 0; n < 4; ++n) {
            for (int e = 0; e < 2; ++e) {
              const int64_t key = key32 + 8 * n + 2 * quad + e;
              ASSERT_EQ(dropout_draw_kept(words.w[n], e, d),
                        dropout_keeps(d, bh, row, key))
                  << "bh " << bh << " row " << row << " key " << key;
            }
          }
        }
      }
    }
  }
  // Keys far out (the counter's 64-key block count uses the high bits).
  const uint32_t far = (1u << 28) + 64 * 12345;
  for (int quad = 0; quad < 4; ++quad) {
    const PhiloxWords words = cuda::sm80::dropout_quad_words(d, 3, 7, far + 32, quad);
    for (int n = 0; n < 4; ++n)
      for (int e = 0; e < 2; ++e)
        EXPECT_EQ(dropout_draw_kept(words.w[n], e, d),
                  dropout_keeps(d, 3, 7, far + 32 + 8 * n + 2 * quad + e));
  }
  // The threshold's ends: 65536 keeps every draw (p below 2^-17); 1 keeps only a draw of 0,
  // whatever the word's other half holds.
  const DropoutParams all = make_dropout(1e-6, 1, 0), one = make_dropout(1.0 - 1.0 / 65536, 1, 0);
  ASSERT_EQ(all.kept_threshold, 65536u);
  ASSERT_EQ(one.kept_threshold, 1u);
  EXPECT_TRUE(dropout_draw_kept(0xFFFFFFFFu, 0, all));
  EXPECT_TRUE(dropout_draw_kept(0xFFFFFFFFu, 1, all));
  EXPECT_TRUE(dropout_draw_kept(0xFFFF0000u, 0, one));
  EXPECT_TRUE(dropout_draw_kept(0x0000FFFFu, 1, one));
  EXPECT_FALSE(dropout_draw_kept(0x00000001u, 0, one));
  EXPECT_FALSE(dropout_draw_kept(0x00010000u, 1, one));
}

// ---- against the reference ----------------------------------------------------------------------

void expect_forward(const std::vector<Case>& cases, fc_backend backend) {
  CudaMemory mem;
  uint64_t seed = 11;
  for (const Case& c : cases) {
    const CheckResult r = check_forward(c, backend, mem, seed++);
    EXPECT_TRUE(r.ok) << fc_backend_name(backend) << " " << c.name() << "\n" << r.summary();
  }
}

void expect_backward(const std::vector<Case>& cases, fc_backend backend, bool deterministic) {
  CudaMemory mem;
  uint64_t seed = 700;
  for (Case c : cases) {
    c.deterministic = deterministic;
    const CheckResult r = check_backward(c, backend, mem, seed++);
    EXPECT_TRUE(r.ok) << fc_backend_name(backend) << (deterministic ? " deterministic " : " ") << c.name() << "\n"
                      << r.summary();
  }
}

/** grid_dropout twice, fp16 and bf16 swapped, so that each of its shapes (causal both ways, a
 *  window with softcap, ALiBi, one query row, p = 0.9, varlen) runs in both dtypes, over the
 *  compiled buckets and the padded dims 40 / 72. */
std::vector<Case> dropout_grid_cases() {
  std::vector<Case> cases;
  for (int swap = 0; swap < 2; ++swap) {
    GridOptions g;
    g.dtypes = swap ? std::vector<int32_t>{FC_DTYPE_BF16, FC_DTYPE_F16} : std::vector<int32_t>{FC_DTYPE_F16, FC_DTYPE_BF16};
    g.head_dims = swap ? std::vector<int64_t>{128, 64} : std::vector<int64_t>{64, 128};
    g.odd_head_dims = swap ? std::vector<int64_t>{72, 256} : std::vector<int64_t>{256, 40};
    for (Case c : grid_dropout(g)) {
      c.dropout_seed += 1000 * swap;
      cases.push_back(c);
    }
  }
  return cases;
}

/** grid_dropout_matrix over the buckets and the padded dim 72: every (dtype, dim) with causal both
 *  ways, GQA, lengths off every tile, and per dim one softcap + window and one ALiBi case (the
 *  kAlibi dropout kernels). */
std::vector<Case> dropout_matrix_cases() { return grid_dropout_matrix({64, 128, 256, 72}, 270, 70, 0); }

TEST(CudaDropout, ForwardMatchesTheReference) {
  REQUIRE_GPU();
  expect_forward(dropout_grid_cases(), FC_BACKEND_CUDA_SM80);
  expect_forward(dropout_matrix_cases(), FC_BACKEND_CUDA_SM80);
}

TEST(CudaDropout, BackwardMatchesTheReference) {
  REQUIRE_GPU();
  expect_backward(dropout_grid_cases(), FC_BACKEND_CUDA_SM80, false);
  expect_backward(dropout_matrix_cases(), FC_BACKEND_CUDA_SM80, false);
}

TEST(CudaDropout, DeterministicBackwardMatchesTheReference) {
  REQUIRE_GPU();
  expect_backward(dropout_grid_cases(), FC_BACKEND_CUDA_SM80, true);
  expect_backward(dropout_matrix_cases(), FC_BACKEND_CUDA_SM80, true);
}

// Paged K/V (the paged dropout kernel): the varlen grid through block tables.
TEST(CudaDropout, PagedForward) {
  REQUIRE_GPU();
  GridOptions g;
  g.head_dims = {64, 128, 256};
  std::vector<Case> cases = grid_paged(g, {256, 512});
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].dropout_p = i % 2 ? 0.5 : 0.17;
    cases[i].dropout_seed += i;
  }
  expect_forward(cases, FC_BACKEND_CUDA_SM80);
  expect_forward(cases, FC_BACKEND_AUTO);
}

// AUTO takes dropout calls on any GPU (the Hopper forward on sm90, sm80 elsewhere and for every
// backward; none may error), also
// the seed shape B=1 H=8 S=512 d64, which without dropout runs on sm80's small-grid
// configuration (or is weighed for it on Hopper) and with it must not lose the mask.
TEST(CudaDropout, AutoBackend) {
  REQUIRE_GPU();
  std::vector<Case> cases;
  Case seed_shape;
  seed_shape.seqlen_q = seed_shape.seqlen_k = 512;
  seed_shape.heads_q = seed_shape.heads_kv = 8;
  seed_shape.causal = true;
  seed_shape.dropout_p = 0.17;
  cases.push_back(seed_shape);
  Case d128 = seed_shape;
  d128.head_dim = 128;
  d128.seqlen_q = d128.seqlen_k = 256;
  d128.heads_q = 2;
  d128.heads_kv = 1;
  d128.dtype = FC_DTYPE_BF16;
  d128.dropout_p = 0.5;
  cases.push_back(d128);
  Case varlen;
  varlen.varlen_q = {5, 0, 130, 64};
  varlen.varlen_k = {7, 33, 0, 200};
  varlen.heads_q = 4;
  varlen.heads_kv = 2;
  varlen.head_dim = 256;
  varlen.dropout_p = 0.5;
  cases.push_back(varlen);
  Case one_row;  // one query row: the shape of AUTO's decode route, which has no dropout
  one_row.batch = 2;
  one_row.seqlen_q = 1;
  one_row.seqlen_k = 700;
  one_row.heads_q = 8;
  one_row.heads_kv = 2;
  one_row.dropout_p = 0.5;
  cases.push_back(one_row);
  expect_forward(cases, FC_BACKEND_AUTO);
  expect_backward(cases, FC_BACKEND_AUTO, false);
  expect_forward(cases, FC_BACKEND_CUDA_SM80);
}

TEST(CudaDropout, DeterministicBackwardIsBitIdentical) {
  REQUIRE_GPU();
  CudaMemory mem;
  Case c = dropout_repeat_case();
  c.deterministic = true;
  for (int64_t dim : {64, 128, 256}) {
    c.head_dim = dim;
    std::string why;
    EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CUDA_SM80, mem, 20, true, &why)) << "d" << dim << ": " << why;
  }
}

// ---- direct calls: the mask itself, seeds, p = 0 ------------------------------------------------

// q = 0: every visible probability of a row is the same, 1 / (visible keys). v_j = e_j: out_i's
// column j is P_ij Z_ij, so it is nonzero exactly where entry (i, j) is visible and kept (kept:
// keep_scale / visible, never 0 in fp16 / bf16). dout_i = e_i (seqlen_q <= head_dim): dv_j's
// column i is P_ij Z_ij too, summed over nothing else (MHA), so the backward's mask shows the
// same way. Each is compared element for element with dropout_keeps of (b * heads_q + h, i, j),
// which a wrong column, row, head or sequence index in any kernel breaks; the kept fraction of
// the visible entries must be near 1 - p.
TEST(CudaDropout, KernelsDrawTheRulesMask) {
  REQUIRE_GPU();
  CudaMemory mem;
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    for (int64_t dim : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        for (bool deterministic : {false, true}) {
          const double p = causal ? 0.5 : 0.17;
          DenseProblem pr;
          pr.batch = 2;
          pr.heads_q = pr.heads_kv = 2;
          pr.d = dim;
          pr.sq = dim - 3;  // lengths off every tile size, seqlen_q, seqlen_k <= head_dim
          pr.sk = dim - 5;
          pr.dtype = dtype;
          pr.q.assign(pr.q_elems(), 0);
          pr.k.assign(pr.k_elems(), 0);
          pr.v.assign(pr.k_elems(), 0);
          pr.dout.assign(pr.q_elems(), 0);
          auto at = [&](int64_t b, int64_t row, int64_t h, int64_t c, int64_t seqlen, int64_t heads) {
            return static_cast<size_t>(((b * seqlen + row) * heads + h) * pr.d + c);
          };
          for (int64_t b = 0; b < pr.batch; ++b)
            for (int64_t h = 0; h < pr.heads_kv; ++h) {
              for (int64_t j = 0; j < pr.sk; ++j) pr.v[at(b, j, h, j, pr.sk, pr.heads_kv)] = one_bits(dtype);
              for (int64_t i = 0; i < pr.sq; ++i) pr.dout[at(b, i, h, i, pr.sq, pr.heads_q)] = one_bits(dtype);
            }
          fc_attention_options opt = dropout_options(FC_BACKEND_CUDA_SM80, p, 0xfeedull + dim, 12345ull << 32);
          opt.causal = causal;
          opt.deterministic = deterministic;
          const DenseResult r = run_dense(mem, pr, opt);
          ASSERT_TRUE(r.error.empty()) << r.error;
          const DropoutParams d = make_dropout(p, opt.dropout_seed, opt.dropout_offset);
          int64_t visible = 0, kept = 0, wrong_out = 0, wrong_dv = 0;
          std::string first;
          for (int64_t b = 0; b < pr.batch; ++b)
            for (int64_t h = 0; h < pr.heads_q; ++h)
              for (int64_t i = 0; i < pr.sq; ++i)
                for (int64_t j = 0; j < pr.sk; ++j) {
                  const bool seen = !causal || j <= i + pr.sk - pr.sq;
                  const bool keep = seen && dropout_keeps(d, b * pr.heads_q + h, i, j);
                  visible += seen;
                  kept += keep;
                  const bool out_kept = (r.out[at(b, i, h, j, pr.sq, pr.heads_q)] & 0x7FFF) != 0;
                  const bool dv_kept = (r.dv[at(b, j, h, i, pr.sk, pr.heads_kv)] & 0x7FFF) != 0;
                  if (out_kept != keep || dv_kept != keep) {
                    wrong_out += out_kept != keep;
                    wrong_dv += dv_kept != keep;
                    if (first.empty()) {
                      first = "b " + std::to_string(b) + " h " + std::to_string(h) + " i " + std::to_string(i) +
                              " j " + std::to_string(j) + ": rule " + (keep ? "keeps" : "drops") + ", out " +
                              (out_kept ? "kept" : "dropped") + ", dv " + (dv_kept ? "kept" : "dropped");
                    }
                  }
                }
          const std::string what = std::string(dtype == FC_DTYPE_F16 ? "fp16" : "bf16") + " d" +
                                   std::to_string(dim) + (causal ? " causal" : "") +
                                   (deterministic ? " deterministic" : "");
          EXPECT_EQ(wrong_out, 0) << what << ", first: " << first;
          EXPECT_EQ(wrong_dv, 0) << what << ", first: " << first;
          const double fraction = static_cast<double>(kept) / static_cast<double>(visible);
          // >= 6000 visible entries per case: 0.035 is over 5 standard deviations at p = 0.5.
          EXPECT_NEAR(fraction, 1 - p, 0.035) << what << ": " << kept << " of " << visible << " kept";
          // A kept entry of out is keep_scale / visible keys of its row (here: a non-causal row).
          if (!causal) {
            const float expected = static_cast<float>(d.keep_scale / static_cast<double>(pr.sk));
            for (int64_t j = 0; j < pr.sk; ++j) {
              if (!dropout_keeps(d, 0, 0, j)) continue;
              EXPECT_NEAR(bits_to_float(r.out[at(0, 0, 0, j, pr.sq, pr.heads_q)], dtype), expected,
                          expected * 1e-2)
                  << what << " j " << j;
              break;
            }
          }
        }
      }
    }
  }
}

// The mask follows the seed and the offset: another seed or offset changes (nearly) every output
// element, the same ones give the same bits, and the output is far from the one without dropout
// while the lse is the lse without dropout.
TEST(CudaDropout, SeedAndOffsetSelectTheMask) {
  REQUIRE_GPU();
  CudaMemory mem;
  for (int64_t dim : {64, 128, 256}) {
    const DenseProblem pr = random_problem(dim, FC_DTYPE_BF16, 42 + dim, 150, 230, 4, 2, 2, /*with_dout=*/true);
    const DenseResult base = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0.5, 7, 0));
    const DenseResult again = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0.5, 7, 0));
    const DenseResult seed = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0.5, 8, 0));
    const DenseResult offset = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0.5, 7, 1));
    const DenseResult none = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM80, 0, 0, 0));
    for (const DenseResult* r : {&base, &again, &seed, &offset, &none}) ASSERT_TRUE(r->error.empty()) << r->error;
    const size_t n = base.out.size();
    EXPECT_EQ(base.out, again.out) << "d" << dim;
    EXPECT_GT(count_different(base.out, seed.out), n * 9 / 10) << "d" << dim;
    EXPECT_GT(count_different(base.out, offset.out), n * 9 / 10) << "d" << dim;
    EXPECT_GT(count_different(base.out, none.out), n * 9 / 10) << "d" << dim;
    EXPECT_EQ(base.dv, again.dv) << "d" << dim;  // (not dq: fp32 atomics outside the deterministic mode)
    EXPECT_GT(count_different(base.dv, seed.dv), base.dv.size() * 9 / 10) << "d" << dim;
    // The lse of the dropout kernels is the softmax's (other tiles than the call without dropout,
    // so not bit for bit; counting only kept entries would move it by log(1 - p) = -0.69).
    for (size_t i = 0; i < base.lse.size(); ++i) {
      ASSERT_NEAR(base.lse[i], none.lse[i], 1e-4f * std::max(1.f, std::fabs(none.lse[i])))
          << "d" << dim << " row " << i << ": the lse must not see dropout";
    }
  }
}

// dropout_p = 0 is no dropout, whatever the seed and offset: the same kernels, the same bits
// (forward and the deterministic backward), on sm80 and through AUTO.
TEST(CudaDropout, ZeroProbabilityIsNoDropout) {
  REQUIRE_GPU();
  CudaMemory mem;
  for (fc_backend backend : {FC_BACKEND_CUDA_SM80, FC_BACKEND_AUTO}) {
    for (int64_t dim : {64, 128, 256}) {
      for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
        const DenseProblem pr = random_problem(dim, dtype, 9 + dim, 150, 230, 4, 2, 2, /*with_dout=*/true);
        fc_attention_options plain = dropout_options(backend, 0, 0, 0);
        fc_attention_options seeded = dropout_options(backend, 0, 0xabcdefull, 99ull << 40);
        plain.deterministic = seeded.deterministic = 1;
        plain.causal = seeded.causal = dim == 128;
        const DenseResult a = run_dense(mem, pr, plain);
        const DenseResult b = run_dense(mem, pr, seeded);
        ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
        EXPECT_EQ(a.out, b.out) << "d" << dim;
        EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << "d" << dim;
        EXPECT_EQ(a.dq, b.dq) << "d" << dim;
        EXPECT_EQ(a.dk, b.dk) << "d" << dim;
        EXPECT_EQ(a.dv, b.dv) << "d" << dim;
      }
    }
  }
}

}  // namespace
}  // namespace flashcore::testing
