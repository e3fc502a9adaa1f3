// Dropout in the Hopper forward (cuda_sm90, ForwardTraits::kDropout): against the fp64 reference
// with the same seed and offset (TESTING.md's tolerance rule) on every route a dropout call can
// take there: the head-dim buckets 64 / 128 (Q in registers) / 256 and padded dims, fp16 / bf16,
// causal both ways, windows, softcap, ALiBi, GQA and MQA with the group packed into the tiles
// (groups below and above 8, so a thread's two rows have the same or different query heads),
// varlen, paged K/V (pages gathered first and pages read in place), split-KV (a few tiles against
// long keys, plain and packed), lengths off every tile size; plus the mask itself read out of the
// kernel (q = 0 and v_j = e_j make out show which entries were kept), the same bits on repeat and
// across seeds, p = 0 as no dropout, and AUTO taking these kernels. The first test needs no GPU: it
// checks the register-to-draw mapping of the wgmma accumulator (cuda/sm90/dropout_fragment.hpp)
// against common/dropout.hpp's rule. The backward of these calls runs elsewhere (cuda_sm80 under
// AUTO), so only forwards are checked here.
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
#include "cuda/sm90/dropout_fragment.hpp"
#include "flashcore/flashcore.hpp"

namespace flashcore::testing {
namespace {

using namespace dropout_calls;

bool have_sm90() { return fc_cuda_device_count() > 0 && fc_backend_available(FC_BACKEND_CUDA_SM90, 0); }

#define REQUIRE_SM90() \
  if (!have_sm90()) GTEST_SKIP() << "no Hopper GPU with the cuda_sm90 kernels: sm90 dropout tests skipped"

// ---- the register mapping (no GPU needed) -------------------------------------------------------

/** drop_probabilities over one key block of kBlockRegs registers (kBlockRegs * 2 keys) starting at
 *  key0, on all ones: each register must be kept exactly where dropout_keeps keeps its (row, key)
 *  of its row's problem, and registers from kRegs on must be left alone. */
template <int kRegs, int kBlockRegs>
void expect_block_mapping(const DropoutParams& d, const cuda::sm90::DropoutRows& rows, uint32_t key0) {
  for (int quad = 0; quad < 4; ++quad) {
    float s[kBlockRegs];
    for (float& x : s) x = 1.f;
    cuda::sm90::drop_probabilities<kRegs>(s, d, rows, key0, quad);
    for (int i = 0; i < kBlockRegs; ++i) {
      const int r = (i % 4) / 2;  // the accumulator row of register i (wgmma.cuh)
      const int64_t key = int64_t(key0) + cuda::sm90::dropout_register_column(i, quad);
      const bool keep = i >= kRegs || dropout_keeps(d, rows.bh[r], rows.row[r], key);
      ASSERT_EQ(s[i] != 0.f, keep) << "register " << i << " quad " << quad << " row " << rows.row[r] << " bh "
                                   << rows.bh[r] << " key " << key;
    }
  }
}

TEST(CudaSm90DropoutFragment, RegistersDrawTheRule) {
  const DropoutParams d = make_dropout(0.4, 0x0123456789abcdefull, 0x0000000900000011ull);
  // The register layout itself: register i of quad t is column 8 (i / 4) + 2 t + (i % 2), and
  // dropout_register inverts (n-tile, row, parity).
  for (int u = 0; u < 4; ++u)
    for (int n = 0; n < 4; ++n)
      for (int r = 0; r < 2; ++r)
        for (int e = 0; e < 2; ++e) {
          const int i = cuda::sm90::dropout_register(u, n, r, e);
          EXPECT_EQ((i % 4) / 2, r);
          EXPECT_EQ(cuda::sm90::dropout_register_column(i, 3), 8 * (4 * u + n) + 6 + e);
        }
  // Rows of one problem (unpacked tiles) and of two (packed GQA: group 16, rows 8 apart in two
  // heads), 128-key blocks (d64 / d128), 64-key ones (d256), the left half of a 128-key block.
  const cuda::sm90::DropoutRows same{{5u, 13u}, {9u, 9u}};
  const cuda::sm90::DropoutRows packed{{700u, 700u}, {3u * 32u + 4u, 3u * 32u + 12u}};
  for (const cuda::sm90::DropoutRows& rows : {same, packed}) {
    for (uint32_t key0 : {0u, 128u, 384u, 1u << 20}) expect_block_mapping<64, 64>(d, rows, key0);
    for (uint32_t key0 : {0u, 64u, 448u, (1u << 28) + 64u}) expect_block_mapping<32, 32>(d, rows, key0);
    expect_block_mapping<32, 64>(d, rows, 256u);
  }
  // The thresholds' ends: 65536 keeps all (p below 2^-17); 1 (p = 1 - 2^-16, the largest p a call
  // may pass) keeps only draws of 0. A threshold of 0 is refused by validation, so no kernel meets
  // it; thresholds come from make_dropout only (kept_below_hi and the rounds' keys derive there).
  float s[64];
  for (float& x : s) x = 1.f;
  cuda::sm90::drop_probabilities<64>(s, make_dropout(1e-9, 1, 2), same, 0, 1);
  for (float x : s) EXPECT_EQ(x, 1.f);
  const DropoutParams one = make_dropout(1.0 - 1.0 / 65536, 1, 2);
  ASSERT_EQ(one.kept_threshold, 1u);
  for (const cuda::sm90::DropoutRows& rows : {same, packed}) expect_block_mapping<64, 64>(one, rows, 128u);
}

// ---- against the reference ----------------------------------------------------------------------

void expect_forward(const std::vector<Case>& cases, fc_backend backend) {
  CudaMemory mem;
  uint64_t seed = 31;
  for (const Case& c : cases) {
    const CheckResult r = check_forward(c, backend, mem, seed++);
    EXPECT_TRUE(r.ok) << fc_backend_name(backend) << " " << c.name() << "\n" << r.summary();
  }
}

/** grid_dropout twice, fp16 and bf16 swapped, over the buckets and the padded dims 40 / 72 / 96
 *  (buckets 64 / 128). */
std::vector<Case> grid_cases() {
  std::vector<Case> cases;
  for (int swap = 0; swap < 2; ++swap) {
    GridOptions g;
    g.dtypes = swap ? std::vector<int32_t>{FC_DTYPE_BF16, FC_DTYPE_F16} : std::vector<int32_t>{FC_DTYPE_F16, FC_DTYPE_BF16};
    g.head_dims = swap ? std::vector<int64_t>{128, 64} : std::vector<int64_t>{64, 128};
    g.odd_head_dims = swap ? std::vector<int64_t>{72, 256, 96} : std::vector<int64_t>{256, 40, 96};
    for (Case c : grid_dropout(g)) {
      c.dropout_seed += 2000 * swap;
      cases.push_back(c);
    }
  }
  return cases;
}

TEST(CudaSm90Dropout, GridMatchesTheReference) {
  REQUIRE_SM90();
  expect_forward(grid_cases(), FC_BACKEND_CUDA_SM90);
}

/** grid_dropout_matrix over the buckets and the padded dim 96: every (dtype, dim) with causal both
 *  ways, GQA, lengths off every tile (sq > sk and sq < sk), and per dim a softcap + window case
 *  over several 128-key blocks and an ALiBi case. */
TEST(CudaSm90Dropout, MatrixMatchesTheReference) {
  REQUIRE_SM90();
  expect_forward(grid_dropout_matrix({64, 128, 256, 96}, 700, 170, 3), FC_BACKEND_CUDA_SM90);
}

// Few query tokens per KV head: the packed GQA tiles (group 4: a thread's two rows are tokens of
// one head; 16 and 32: rows of different heads), causal both ways, varlen, and one shape whose
// packed tile holds more than a consumer's 64 rows.
TEST(CudaSm90Dropout, PackedGqaMatchesTheReference) {
  REQUIRE_SM90();
  std::vector<Case> cases;
  uint64_t i = 0;
  for (int64_t dim : {64, 128, 256}) {
    for (int64_t group : {4, 16, 32}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = group == 4 ? 23 : 3;
      c.seqlen_k = 600;
      c.heads_kv = 2;
      c.heads_q = 2 * group;
      c.head_dim = dim;
      c.dtype = i % 2 ? FC_DTYPE_BF16 : FC_DTYPE_F16;
      c.causal = i % 3 == 1;
      c.dropout_p = i % 2 ? 0.5 : 0.17;
      c.dropout_seed += i;
      c.dropout_offset = i++ << 30;
      cases.push_back(c);
    }
    Case v;  // varlen with empty sequences
    v.varlen_q = {5, 0, 9, 3};
    v.varlen_k = {300, 40, 0, 257};
    v.heads_q = 8;
    v.heads_kv = 1;
    v.head_dim = dim;
    v.dtype = FC_DTYPE_BF16;
    v.causal = dim == 128;
    v.dropout_p = 0.5;
    v.dropout_seed += 50 + dim;
    cases.push_back(v);
  }
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// Split-KV: one query tile against 16k keys (32+ splits of the key blocks, each applying the mask at
// its own global keys and scaling its partial by keep_scale before the merge by lse); packed GQA
// split; softcap and ALiBi (the split score-transform kernels); causal with sq < sk; varlen.
TEST(CudaSm90Dropout, SplitKvMatchesTheReference) {
  REQUIRE_SM90();
  std::vector<Case> cases;
  uint64_t i = 0;
  for (int64_t dim : {64, 128, 256}) {
    Case c;  // MHA: 1 head, 128 queries x 16k keys
    c.seqlen_q = 128;
    c.seqlen_k = 16384;
    c.head_dim = dim;
    c.dtype = dim == 128 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    c.dropout_p = 0.5;
    c.dropout_seed += i;
    c.dropout_offset = (i++ << 34) + 5;
    c.q_magnitude = 4.f;  // peaked rows: a misplaced key's draw moves the output far past the bound
    cases.push_back(c);
    Case g = c;  // GQA 8 / 1 with 16 tokens: 128 packed rows, one tile
    g.seqlen_q = 16;
    g.seqlen_k = 8192;
    g.heads_q = 8;
    g.causal = true;
    g.dropout_p = 0.17;
    g.dropout_seed += 77;
    cases.push_back(g);
    Case sc = c;  // softcap
    sc.seqlen_k = 6000;
    sc.softcap = 30;
    sc.dropout_seed += 99;
    cases.push_back(sc);
    Case al = sc;  // ALiBi, 2 heads
    al.softcap = 0;
    al.heads_q = al.heads_kv = 2;
    al.alibi = 1;
    al.causal = true;
    cases.push_back(al);
  }
  Case v;  // varlen: two sequences of a few tokens against long keys
  v.varlen_q = {40, 7};
  v.varlen_k = {9000, 5000};
  v.heads_q = 4;
  v.heads_kv = 2;
  v.head_dim = 128;
  v.dtype = FC_DTYPE_BF16;
  v.dropout_p = 0.5;
  cases.push_back(v);
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// Paged K/V: pages of 16 and 48 keys are gathered into packed rows first (the page-box kernels
// have no dropout), pages of 256 are read in place by the dropout kernels.
TEST(CudaSm90Dropout, PagedMatchesTheReference) {
  REQUIRE_SM90();
  GridOptions g;
  g.head_dims = {64, 128, 256};
  std::vector<Case> cases = grid_paged(g, {16, 48, 256});
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].dropout_p = i % 2 ? 0.5 : 0.17;
    cases[i].dropout_seed += i;
    cases[i].alibi = i % 3 == 0 ? 2 : 0;  // ALiBi over pages on some
  }
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// ---- direct calls: the mask itself, seeds, p = 0, AUTO ------------------------------------------

// q = 0: every visible probability of a row is the same, 1 / (visible keys). v_j = e_j (of every KV
// head): out_i's column j is P_ij Z_ij, nonzero exactly where entry (i, j) is visible and kept
// (keep_scale / visible, never 0 in fp16 / bf16). Compared element for element with dropout_keeps
// of (b * heads_q + h, i, j), which a wrong column, row, query head or sequence index breaks: MHA
// on the plain tiles (d128: Q in registers), GQA with few tokens on the packed tiles (group 4 and
// 16). The kept fraction of the visible entries must be near 1 - p.
TEST(CudaSm90Dropout, KernelsDrawTheRulesMask) {
  REQUIRE_SM90();
  CudaMemory mem;
  for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
    for (int64_t dim : {64, 128, 256}) {
      for (int layout = 0; layout < 3; ++layout) {  // MHA, packed group 4, packed group 16
        for (bool causal : {false, true}) {
          const double p = causal ? 0.5 : 0.17;
          DenseProblem pr;
          pr.batch = 2;
          pr.d = dim;
          pr.heads_kv = 2;
          pr.heads_q = layout == 0 ? 2 : (layout == 1 ? 8 : 32);
          pr.sq = layout == 0 ? dim - 3 : (layout == 1 ? 13 : 3);  // off every tile size
          pr.sk = dim - 5;  // seqlen_k <= head_dim: one output column per key
          pr.dtype = dtype;
          pr.q.assign(pr.q_elems(), 0);
          pr.k.assign(pr.k_elems(), 0);
          pr.v.assign(pr.k_elems(), 0);
          auto at = [&](int64_t b, int64_t row, int64_t h, int64_t c, int64_t seqlen, int64_t heads) {
            return static_cast<size_t>(((b * seqlen + row) * heads + h) * pr.d + c);
          };
          for (int64_t b = 0; b < pr.batch; ++b)
            for (int64_t h = 0; h < pr.heads_kv; ++h)
              for (int64_t j = 0; j < pr.sk; ++j) pr.v[at(b, j, h, j, pr.sk, pr.heads_kv)] = one_bits(dtype);
          fc_attention_options opt = dropout_options(FC_BACKEND_CUDA_SM90, p, 0xbeefull + dim + layout, 777ull << 32);
          opt.causal = causal;
          const DenseResult r = run_dense(mem, pr, opt);
          ASSERT_TRUE(r.error.empty()) << r.error;
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
                  const bool out_kept = (r.out[at(b, i, h, j, pr.sq, pr.heads_q)] & 0x7FFF) != 0;
                  if (out_kept != keep) {
                    ++wrong;
                    if (first.empty()) {
                      first = "b " + std::to_string(b) + " h " + std::to_string(h) + " i " + std::to_string(i) +
                              " j " + std::to_string(j) + ": rule " + (keep ? "keeps" : "drops");
                    }
                  }
                }
          const std::string what = std::string(dtype == FC_DTYPE_F16 ? "fp16" : "bf16") + " d" +
                                   std::to_string(dim) + " heads " + std::to_string(pr.heads_q) + "/" +
                                   std::to_string(pr.heads_kv) + (causal ? " causal" : "");
          EXPECT_EQ(wrong, 0) << what << ", first: " << first;
          const double fraction = static_cast<double>(kept) / static_cast<double>(visible);
          // >= 3000 visible entries per case: 0.05 is over 5 standard deviations at p = 0.5.
          EXPECT_NEAR(fraction, 1 - p, 0.05) << what << ": " << kept << " of " << visible << " kept";
          // A kept entry of a non-causal row is keep_scale / seqlen_k (keep_scale in the epilogue).
          if (!causal) {
            const float expected = static_cast<float>(d.keep_scale / static_cast<double>(pr.sk));
            int checked = 0;
            for (int64_t j = 0; j < pr.sk && checked < 4; ++j) {
              if (!dropout_keeps(d, 0, 0, j)) continue;
              const float f = bits_to_float(r.out[at(0, 0, 0, j, pr.sq, pr.heads_q)], dtype);
              EXPECT_NEAR(f, expected, expected * 1e-2) << what << " j " << j;
              ++checked;
            }
          }
        }
      }
    }
  }
}

// The same seed and offset give the same bits (plain, packed and split routes; a split's merge
// must not depend on which CTA finishes first), another seed or offset changes nearly every
// output element, and the lse is the lse without dropout.
TEST(CudaSm90Dropout, SeedsRepeatsAndLse) {
  REQUIRE_SM90();
  CudaMemory mem;
  struct Shape {
    int64_t sq, sk, heads_q, heads_kv, batch;
  };
  const Shape shapes[] = {{150, 230, 4, 2, 2}, {5, 900, 16, 2, 1}, {128, 8192, 1, 1, 1}};  // plain, packed, split
  for (int64_t dim : {64, 128, 256}) {
    for (const Shape& sh : shapes) {
      const DenseProblem pr = random_problem(dim, FC_DTYPE_BF16, 42 + dim, sh.sq, sh.sk, sh.heads_q, sh.heads_kv, sh.batch);
      const std::string what = "d" + std::to_string(dim) + " " + std::to_string(sh.sq) + "x" + std::to_string(sh.sk);
      const DenseResult base = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM90, 0.5, 7, 0));
      const DenseResult seed = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM90, 0.5, 8, 0));
      const DenseResult offset = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM90, 0.5, 7, 1));
      const DenseResult none = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM90, 0, 0, 0));
      for (const DenseResult* r : {&base, &seed, &offset, &none}) ASSERT_TRUE(r->error.empty()) << r->error;
      for (int repeat = 0; repeat < 5; ++repeat) {
        const DenseResult again = run_dense(mem, pr, dropout_options(FC_BACKEND_CUDA_SM90, 0.5, 7, 0));
        ASSERT_TRUE(again.error.empty()) << again.error;
        EXPECT_EQ(base.out, again.out) << what << " repeat " << repeat;
        EXPECT_EQ(0, std::memcmp(base.lse.data(), again.lse.data(), base.lse.size() * sizeof(float)))
            << what << " repeat " << repeat;
      }
      const size_t n = base.out.size();
      EXPECT_GT(count_different(base.out, seed.out), n * 9 / 10) << what;
      EXPECT_GT(count_different(base.out, offset.out), n * 9 / 10) << what;
      EXPECT_GT(count_different(base.out, none.out), n * 9 / 10) << what;
      // The dropout kernels' lse is the softmax's (other kernels than the call without dropout, so
      // not bit for bit; counting only kept entries would move it by log(1 - p) = -0.69).
      for (size_t i = 0; i < base.lse.size(); ++i) {
        ASSERT_NEAR(base.lse[i], none.lse[i], 1e-4f * std::max(1.f, std::fabs(none.lse[i])))
            << what << " row " << i << ": the lse must not see dropout";
      }
    }
  }
  // The harness's repeat check too (varlen, causal, GQA: packed rows past sequences).
  Case c = dropout_repeat_case();
  for (int64_t dim : {64, 128, 256}) {
    c.head_dim = dim;
    std::string why;
    EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CUDA_SM90, mem, 10, false, &why)) << "d" << dim << ": " << why;
  }
}

// dropout_p = 0 is no dropout, whatever the seed and offset: the kernels without dropout, the same
// bits (plain and split shapes).
TEST(CudaSm90Dropout, ZeroProbabilityIsNoDropout) {
  REQUIRE_SM90();
  CudaMemory mem;
  for (int64_t dim : {64, 128, 256}) {
    for (int32_t dtype : {FC_DTYPE_F16, FC_DTYPE_BF16}) {
      for (bool split : {false, true}) {
        const DenseProblem pr = split ? random_problem(dim, dtype, 9 + dim, 64, 8192, 1, 1, 1)
                                      : random_problem(dim, dtype, 9 + dim);
        fc_attention_options plain = dropout_options(FC_BACKEND_CUDA_SM90, 0, 0, 0);
        fc_attention_options seeded = dropout_options(FC_BACKEND_CUDA_SM90, 0, 0xabcdefull, 99ull << 40);
        plain.causal = seeded.causal = dim == 128;
        const DenseResult a = run_dense(mem, pr, plain);
        const DenseResult b = run_dense(mem, pr, seeded);
        ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
        EXPECT_EQ(a.out, b.out) << "d" << dim << (split ? " split" : "");
        EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << "d" << dim;
      }
    }
  }
}

// FC_BACKEND_AUTO sends a dropout forward to the Hopper kernels: its bits are cuda_sm90's, which
// differ from cuda_sm80's (other tiles, other rounding) on these shapes. Shapes past the small-grid
// rule (more 32-row blocks than SMs), where AUTO takes cuda_sm90 for calls without dropout.
TEST(CudaSm90Dropout, AutoRunsTheHopperForward) {
  REQUIRE_SM90();
  CudaMemory mem;
  for (int64_t dim : {64, 128, 256}) {
    const DenseProblem pr = random_problem(dim, FC_DTYPE_BF16, 5 + dim, 512, 512, 8, 8, 2);
    fc_attention_options opt[3];
    const fc_backend backends[3] = {FC_BACKEND_AUTO, FC_BACKEND_CUDA_SM90, FC_BACKEND_CUDA_SM80};
    DenseResult r[3];
    for (int i = 0; i < 3; ++i) {
      opt[i] = dropout_options(backends[i], 0.17, 123, 456);
      opt[i].causal = dim == 64;
      r[i] = run_dense(mem, pr, opt[i]);
      ASSERT_TRUE(r[i].error.empty()) << fc_backend_name(backends[i]) << ": " << r[i].error;
    }
    ASSERT_GT(count_different(r[1].out, r[2].out), 0u) << "d" << dim << ": sm80 and sm90 agree bit for bit";
    EXPECT_EQ(r[0].out, r[1].out) << "d" << dim << ": AUTO did not run the Hopper forward";
  }
}

}  // namespace
}  // namespace flashcore::testing
