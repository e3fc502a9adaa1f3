// The CUDA backends against the CPU fp64 reference: the same TESTING.md grids as the CPU suite,
// with tensors in device memory, poisoned outputs, race hunting, and GPU-only bad inputs.
// Forward and backward tests run once per CUDA backend (sm80 everywhere, sm90 on Hopper); every test skips
// with a message when its backend is not available (no GPU, or not a CC 9.0 device for sm90).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/dispatch.hpp"
#include "common/grids.hpp"
#include "flashcore/flashcore.hpp"
#include "common/harness.hpp"
#include "cuda/cuda_memory.hpp"

namespace flashcore::testing {
namespace {

bool have_gpu() { return fc_cuda_device_count() > 0 && fc_backend_available(FC_BACKEND_CUDA_SM80, 0); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU with sm_80+ present: CUDA tests skipped"

#define REQUIRE_BACKEND(backend)                                                             \
  if (!fc_backend_available(backend, 0))                                                     \
  GTEST_SKIP() << fc_backend_name(backend) << " is not available here (no GPU, not compiled, " \
                                              "or the GPU is not of its generation): skipped"

/** The CUDA forward backends, each running every forward test. */
class CudaForward : public ::testing::TestWithParam<fc_backend> {};

std::string backend_label(const ::testing::TestParamInfo<fc_backend>& info) {
  return info.param == FC_BACKEND_CUDA_SM90 ? "sm90" : "sm80";
}

GridOptions cuda_grid() {
  GridOptions g;
  g.dtypes = {FC_DTYPE_F16, FC_DTYPE_BF16};
  g.head_dims = {64, 128};
  g.odd_head_dims = {40, 56, 80, 96, 112, 136, 256};  // served by padding to a compiled bucket
  g.large = true;
  return g;
}

void expect_forward(const std::vector<Case>& cases, fc_backend backend) {
  CudaMemory mem;
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const CheckResult r = check_forward(c, backend, mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
  }
}

/** The CUDA backward backends, each running every backward test (both serve every head dim). */
class CudaBackward : public ::testing::TestWithParam<fc_backend> {};

void expect_backward(const std::vector<Case>& cases, fc_backend backend, bool deterministic = false) {
  CudaMemory mem;
  uint64_t seed = 500;
  for (Case c : cases) {
    c.deterministic = deterministic;
    const CheckResult r = check_backward(c, backend, mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
  }
}

TEST_P(CudaForward, SeqlenGrid) { REQUIRE_BACKEND(GetParam()); expect_forward(grid_seqlens(cuda_grid()), GetParam()); }
TEST_P(CudaForward, Shapes) { REQUIRE_BACKEND(GetParam()); expect_forward(grid_shapes(cuda_grid()), GetParam()); }
TEST_P(CudaForward, Masks) { REQUIRE_BACKEND(GetParam()); expect_forward(grid_masks(cuda_grid()), GetParam()); }
TEST_P(CudaForward, Varlen) { REQUIRE_BACKEND(GetParam()); expect_forward(grid_varlen(cuda_grid()), GetParam()); }
TEST_P(CudaForward, Edges) { REQUIRE_BACKEND(GetParam()); expect_forward(grid_edges(cuda_grid()), GetParam()); }

// Shapes whose normal grid leaves most SMs idle (the seed shape B=1 H=8 S=512 D=64 among them):
// whatever configuration serves them must keep every semantic of the large-grid path.
TEST_P(CudaForward, SmallGrids) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  for (bool causal : {false, true})
    for (int64_t d : {64, 128}) {
      Case c;
      c.seqlen_q = c.seqlen_k = 512;
      c.heads_q = c.heads_kv = 8;
      c.head_dim = d;
      c.dtype = FC_DTYPE_F16;
      c.causal = causal;
      cases.push_back(c);
      c.seqlen_q = 100;  // q shorter than k, GQA, window, softcap
      c.seqlen_k = 1500;
      c.heads_q = 4;
      c.heads_kv = 2;
      c.window_left = causal ? 300 : -1;
      c.softcap = causal ? 0.0 : 20.0;
      c.dtype = FC_DTYPE_BF16;
      cases.push_back(c);
    }
  // Either side of sm80's small-grid bound on a 132-SM H100 (32-row blocks in at most two waves:
  // 16 x 16 = 256 CTAs take it, 17 x 16 = 272 do not).
  for (int64_t heads : {16, 17}) {
    Case c;
    c.seqlen_q = c.seqlen_k = 512;
    c.heads_q = c.heads_kv = heads;
    c.head_dim = 64;
    c.dtype = FC_DTYPE_F16;
    cases.push_back(c);
  }
  for (bool causal : {false, true}) {  // few queries, many keys: uneven key shares, partial tile
    Case c;
    c.seqlen_q = 17;
    c.seqlen_k = 5000;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.head_dim = 128;
    c.dtype = FC_DTYPE_BF16;
    c.causal = causal;
    cases.push_back(c);
  }
  {  // a narrow window: some key groups get no tiles, rows inside groups fully masked
    Case c;
    c.seqlen_q = 32;
    c.seqlen_k = 2000;
    c.heads_q = 2;
    c.head_dim = 64;
    c.causal = true;
    c.window_left = 16;
    cases.push_back(c);
  }
  Case v;
  v.varlen_q = {1, 300, 0};
  v.varlen_k = {700, 300, 50};
  v.heads_q = 2;
  v.head_dim = 64;
  v.causal = true;
  cases.push_back(v);
  expect_forward(cases, GetParam());
  CudaMemory mem;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(cases[0], GetParam(), mem, 50, false, &why)) << why;
}

GridOptions cuda_bwd_grid() {
  GridOptions g = cuda_grid();
  g.large = false;
  return g;
}
#define BACKWARD_TEST(name, grid, ...)                         \
  TEST_P(CudaBackward, name) {                                 \
    REQUIRE_BACKEND(GetParam());                               \
    expect_backward(grid(cuda_bwd_grid()), GetParam(), ##__VA_ARGS__); \
  }
BACKWARD_TEST(SeqlenGrid, grid_seqlens)
BACKWARD_TEST(Shapes, grid_shapes)
BACKWARD_TEST(Masks, grid_masks)
BACKWARD_TEST(Varlen, grid_varlen)
BACKWARD_TEST(Edges, grid_edges)
BACKWARD_TEST(Deterministic, grid_varlen, true)
#undef BACKWARD_TEST

// ALiBi: forward and backward on both backends (sm90's forward in its score-transform kernels,
// its backward and sm80's in kernels instantiated for ALiBi), and through FC_BACKEND_AUTO.
std::vector<Case> alibi_cases(const GridOptions& g) {
  std::vector<Case> cases = grid_alibi(g);
  Case c = cases[1];  // keys on both sides of the diagonal, per-batch slopes
  c.head_dim = 256;
  cases.push_back(c);
  return cases;
}

TEST_P(CudaForward, Alibi) {
  REQUIRE_BACKEND(GetParam());
  expect_forward(alibi_cases(cuda_grid()), GetParam());
}

TEST_P(CudaBackward, Alibi) {
  REQUIRE_BACKEND(GetParam());
  expect_backward(alibi_cases(cuda_bwd_grid()), GetParam());
  expect_backward(grid_alibi(cuda_bwd_grid()), GetParam(), /*deterministic=*/true);
}

TEST(CudaAlibi, AutoBackend) {
  REQUIRE_GPU();
  std::vector<Case> cases = grid_alibi(cuda_bwd_grid());
  Case seed_shape;  // where AUTO would otherwise weigh sm80's small-grid configuration
  seed_shape.seqlen_q = seed_shape.seqlen_k = 512;
  seed_shape.heads_q = seed_shape.heads_kv = 8;
  seed_shape.causal = true;
  seed_shape.alibi = 1;
  cases.push_back(seed_shape);
  expect_forward(cases, FC_BACKEND_AUTO);
  expect_backward(cases, FC_BACKEND_AUTO);
}

// Many key blocks and query steps per CTA, GQA groups walked inside one CTA, a causal diagonal
// crossing the tiles, and sequence ends inside a tile (the sm90 pipeline wraps its stages).
TEST_P(CudaBackward, LongSequences) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  for (int64_t d : {64, 128, 256})
    for (bool causal : {false, true}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = 1000;
      c.seqlen_k = 1100;
      c.heads_q = 6;
      c.heads_kv = 2;
      c.head_dim = d;
      c.dtype = d == 64 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
      c.causal = causal;
      cases.push_back(c);
    }
  Case w;
  w.seqlen_q = 700;
  w.seqlen_k = 650;
  w.heads_q = 2;
  w.head_dim = 128;
  w.window_left = 100;
  w.window_right = 20;
  w.softcap = 30.f;
  cases.push_back(w);
  w.head_dim = 256;  // the role-split kernel's softcap path
  w.heads_kv = 1;
  cases.push_back(w);
  expect_backward(cases, GetParam());
}

// More tiles (key block x KV head x batch) than an H100 has SMs, without a window: the sm90
// backward's persistent grid then walks several tiles per CTA, carrying its Q/dO stages, dS
// buffers and K/V barrier phases across them (sm80 has no such path: sm90 only). The ragged
// varlen case runs one CTA per tile since session 30 (persistent_grid), with tiles past a
// sequence's keys (no steps) and sequences without queries (tiles of no steps, dK = dV = 0), many
// more tiles than SMs. Short sequences keep the fp64 reference cheap: a first version with
// 1400-row sequences passed on both backends but took 275 s each, mostly in the reference.
TEST(CudaSm90Backward, ManyTilesPerCta) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  Case dense;  // d64: 3 key blocks x 4 KV heads x 24 = 288 tiles of 2 query blocks x GQA 2
  dense.batch = 24;
  dense.seqlen_q = 130;
  dense.seqlen_k = 300;
  dense.heads_q = 8;
  dense.heads_kv = 4;
  dense.head_dim = 64;
  dense.dtype = FC_DTYPE_BF16;
  Case wide = dense;  // d256 (64-key blocks): 4 x 2 x 20 = 160 tiles
  wide.batch = 20;
  wide.seqlen_q = 100;
  wide.seqlen_k = 200;
  wide.heads_q = 4;
  wide.heads_kv = 2;
  wide.head_dim = 256;
  wide.dtype = FC_DTYPE_F16;
  Case ragged;  // d128: 2 key blocks x 2 x 40 = 160 tiles, many past their sequence's keys
  for (int i = 0; i < 40; ++i) {
    ragged.varlen_q.push_back(i % 7 == 3 ? 0 : (37 * i) % 200 + 1);
    ragged.varlen_k.push_back(i % 11 == 5 ? 0 : (53 * i) % 260 + 1);
  }
  ragged.heads_q = 6;
  ragged.heads_kv = 2;
  ragged.head_dim = 128;
  ragged.dtype = FC_DTYPE_BF16;
  expect_backward({dense, wide, ragged}, FC_BACKEND_CUDA_SM90);
  expect_backward({dense}, FC_BACKEND_CUDA_SM90, /*deterministic=*/true);  // the main kernel without dQ
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaBackward,
                         ::testing::Values(FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90), backend_label);

// Enough query blocks that the persistent sm90 grid pairs them (odd block count: a block alone),
// and a varlen call that spreads them over more CTAs than SMs.
TEST_P(CudaForward, ManyTiles) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  for (bool causal : {true, false}) {
    Case c;
    c.batch = 2;  // 5 query blocks of 128: 3 pairs x 24 heads x 2 >= 132 SMs
    c.seqlen_q = 600;
    c.seqlen_k = causal ? 700 : 600;
    c.heads_q = 24;
    c.heads_kv = causal ? 8 : 24;
    c.head_dim = causal ? 128 : 64;
    c.dtype = causal ? FC_DTYPE_BF16 : FC_DTYPE_F16;
    c.causal = causal;
    cases.push_back(c);
  }
  // On 132 SMs the sm90 forward deals the last pairs of these causal calls as single tiles in order
  // of falling cost (src/cuda/sm90/tile_tail.hpp; tests/cpu/test_tile_tail.cpp checks that each
  // shape here and the one above take a tail): whole heads after one or three rounds of pairs
  // (d128, d256 GQA 5), and a tail of two rounds' length that starts inside a head after one (d64,
  // GQA 7: its heads' K/V is small enough for the round more).
  for (int64_t d : {256, 128, 64}) {
    Case c;
    c.batch = d == 128 ? 2 : 1;
    c.seqlen_q = d == 256 ? 900 : (d == 128 ? 1300 : 1200);
    c.seqlen_k = d == 256 ? 1000 : (d == 128 ? 1400 : 1200);
    c.heads_q = d == 256 ? 40 : (d == 128 ? 41 : 70);
    c.heads_kv = d == 256 ? 8 : (d == 128 ? 41 : 10);
    c.head_dim = d;
    c.dtype = d == 64 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    c.causal = true;
    cases.push_back(c);
  }
  // Causal varlen of uneven lengths: the sm90 grid then holds four CTAs per SM (kVarlenListsPerSm)
  // and still more pairs than CTAs (2 pairs x 8 heads x 40 sequences = 640 > 4 x 132), so CTAs
  // take several items whose sequences differ in length, some without queries.
  Case ragged;
  for (int i = 0; i < 40; ++i) {
    ragged.varlen_q.push_back(i % 9 == 4 ? 0 : (67 * i) % 450 + 1);
    ragged.varlen_k.push_back(ragged.varlen_q.back());
  }
  ragged.heads_q = 8;
  ragged.heads_kv = 2;
  ragged.head_dim = 64;
  ragged.dtype = FC_DTYPE_BF16;
  ragged.causal = true;
  cases.push_back(ragged);
  expect_forward(cases, GetParam());
}

// GQA calls with few query tokens per head: the sm90 forward packs each KV head's group of query
// heads into its tiles (sm90/pack_gqa.hpp: groups of 2 to 64 that divide 64, the packed tiles
// fuller than the per-head ones). Every shape below packs there but the group of 3 and the
// 192-token call (control cases that keep the per-head tiles); sm80 runs them all per head.
// Causal rows are bottom-right aligned, so a token's row sees keys up to its own position.
TEST_P(CudaForward, PackedGqa) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  struct Shape {
    int64_t seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
    int32_t dtype;
  };
  const Shape shapes[] = {{1, 300, 8, 2, 64, FC_DTYPE_BF16},    {5, 257, 32, 8, 128, FC_DTYPE_F16},
                          {16, 1000, 16, 2, 128, FC_DTYPE_BF16}, {33, 129, 8, 1, 64, FC_DTYPE_F16},
                          {7, 200, 64, 1, 128, FC_DTYPE_BF16},   {20, 333, 16, 4, 256, FC_DTYPE_BF16},
                          {3, 90, 4, 2, 96, FC_DTYPE_F16},       {40, 40, 32, 2, 64, FC_DTYPE_BF16},
                          {9, 150, 12, 4, 128, FC_DTYPE_BF16},   {192, 400, 8, 2, 128, FC_DTYPE_F16}};
  for (const Shape& sh : shapes) {
    for (int mask = 0; mask < 4; ++mask) {
      Case c;
      c.batch = 2;
      c.seqlen_q = sh.seqlen_q;
      c.seqlen_k = sh.seqlen_k;
      c.heads_q = sh.heads_q;
      c.heads_kv = sh.heads_kv;
      c.head_dim = sh.head_dim;
      c.dtype = sh.dtype;
      c.causal = mask == 1;
      if (mask == 2) {  // a sliding window on both sides
        c.window_left = 37;
        c.window_right = 5;
      }
      if (mask == 3) {  // softcap, on padded (non-contiguous) tensors
        c.softcap = 20;
        c.padded = true;
      }
      cases.push_back(c);
    }
  }
  // Varlen: short query chunks against longer keys, an empty sequence among them.
  for (int64_t d : {64, 128}) {
    Case v;
    v.varlen_q = {3, 0, 17, 1, 40};
    v.varlen_k = {100, 7, 300, 65, 40};
    v.heads_q = 16;
    v.heads_kv = 4;
    v.head_dim = d;
    v.dtype = FC_DTYPE_BF16;
    v.causal = d == 64;
    cases.push_back(v);
  }
  expect_forward(cases, GetParam());
}

// Few query tiles against long key ranges: the sm90 forward cuts every tile's key blocks into
// splits that fill the SMs, writes fp32 partials to the workspace (poisoned by the harness) and
// merges them (sm90/split_kv.hpp; the CPU test ForwardSplitRule.PlansTheGpuTestsShapes checks that
// the dense shapes below split). Among them: packed GQA, MHA d64, d256's 64-key blocks, varlen with
// an empty sequence and a sequence of 9 keys (splits without keys), and varlen pages of 8 keys
// (gathered), 16 (one TMA box each) and 128; a narrow window on padded tensors, which the plan keeps whole
// (its tiles' keys are short); softcap, ALiBi and a negative scale on the score-transform split
// kernels. sm80 runs them all whole.
TEST_P(CudaForward, SplitKv) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  for (int mask = 0; mask < 3; ++mask) {
    Case c;
    c.seqlen_q = 16;
    c.seqlen_k = 4096;
    c.heads_q = 32;
    c.heads_kv = 8;
    c.head_dim = 128;
    c.dtype = FC_DTYPE_BF16;
    c.causal = mask == 1;
    if (mask == 2) {
      c.window_left = 100;
      c.window_right = 0;
      c.padded = true;
    }
    cases.push_back(c);
  }
  for (bool causal : {false, true}) {
    Case c;
    c.batch = 2;
    c.seqlen_q = 5;
    c.seqlen_k = 3000;
    c.heads_q = c.heads_kv = 8;
    c.head_dim = 64;
    c.dtype = FC_DTYPE_F16;
    c.causal = causal;
    cases.push_back(c);
  }
  Case d256;
  d256.seqlen_q = 33;
  d256.seqlen_k = 2000;
  d256.heads_q = 4;
  d256.heads_kv = 2;
  d256.head_dim = 256;
  d256.dtype = FC_DTYPE_BF16;
  d256.causal = true;
  cases.push_back(d256);
  Case box_pages;  // the 16-key page case (sm90 only)
  for (int64_t page_size : {0, 8, 16, 128}) {  // 8: gathered into packed rows first
    // (sm80 gathers these pages: CudaPagedKv covers it; here the sm90 routes)
    if (page_size != 0 && GetParam() != FC_BACKEND_CUDA_SM90) continue;
    Case v;
    v.varlen_q = {3, 0, 17, 9};
    v.varlen_k = {1000, 50, 3000, 9};
    v.heads_q = 16;
    v.heads_kv = 4;
    v.head_dim = page_size == 0 ? 96 : 128;
    v.dtype = FC_DTYPE_BF16;
    v.causal = page_size != 128;
    v.page_size = page_size;
    cases.push_back(v);
    if (page_size == 16) box_pages = v;
  }
  // The score-transform split kernels: softcap on packed GQA (and on 16-key pages, which such calls
  // gather), ALiBi (never packed) with per-sequence slopes, a negative scale; d64 / d128 / d256.
  Case softcap = cases[1];  // causal, 16 tokens x 4096 keys, GQA 32 / 8
  softcap.softcap = 30;
  softcap.q_magnitude = 4.f;
  cases.push_back(softcap);
  Case alibi = cases[3];  // MHA d64, 2 x 5 tokens x 3000 keys
  alibi.alibi = 2;
  alibi.causal = true;
  cases.push_back(alibi);
  Case negative = d256;
  negative.softmax_scale = -0.05;
  cases.push_back(negative);
  if (GetParam() == FC_BACKEND_CUDA_SM90) {
    box_pages.softcap = 20;
    cases.push_back(box_pages);
  }
  expect_forward(cases, GetParam());
}

// The sm90 forward serves long masked calls with its wide tiles (d64: 192 query rows, d256: 80
// keys), which the grids above reach only without a mask: causal and window masks from
// seqlen_k = 4096 on, a partial last query block, GQA and varlen among them.
TEST_P(CudaForward, LongMaskedCalls) {
  REQUIRE_BACKEND(GetParam());
  std::vector<Case> cases;
  for (int64_t d : {64, 256}) {
    Case c;
    c.seqlen_q = 700;  // 192-row blocks: a partial last one; bottom-right causal alignment
    c.seqlen_k = 4100;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = d;
    c.dtype = d == 64 ? FC_DTYPE_BF16 : FC_DTYPE_F16;
    c.causal = true;
    cases.push_back(c);
    Case w = c;  // a window bounded on both sides
    w.causal = false;
    w.seqlen_q = w.seqlen_k = 4097;
    w.heads_q = w.heads_kv = 2;
    w.window_left = 300;
    w.window_right = 77;
    cases.push_back(w);
    Case v = c;  // varlen: max_seqlen_k >= 4096 with a short sequence beside it
    v.varlen_q = {333, 1000};
    v.varlen_k = {4200, 90};
    v.batch = 2;
    cases.push_back(v);
  }
  expect_forward(cases, GetParam());
}

// The sm90 forward runs d128 and d256 calls under a one-sided mask from 8192 queries and keys on
// in clusters of two CTAs that share each K/V block (forward.cuh, "Cluster pairs"): causal with
// pairs of tiles and more pairs than clusters (a second round: the margin leaves 14 clusters for
// 16 pairs, so one head is enough and the fp64 reference stays short; rank 0 hands back the
// blocks above its diagonal uncomputed), causal with more keys than queries (bottom-right
// alignment) and GQA in fp16, a window bounded on the left only (the extra key blocks of a
// cluster's walk then lie below the CTA's rows), and d128's tile at head_dim 112 (rank 1's
// multicast chunk reaches past the columns) and in fp16 with GQA, and a window bounded on the right
// only (d256: after the pair's skip, a consumer skips the blocks past its own rows' keys too).
TEST(CudaSm90Forward, LongCausalClusterPairs) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  std::vector<Case> cases;
  Case c;
  c.seqlen_q = c.seqlen_k = 8192;
  c.head_dim = 256;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  c.sm_margin = 104;  // 28 SMs of a 132-SM GPU: 16 pairs of tiles >= 28 / 2, on 14 clusters
  cases.push_back(c);
  Case g = c;
  g.sm_margin = 0;
  g.seqlen_q = 8448;  // 66 query blocks of 128 rows: an even number, as the pairs need
  g.seqlen_k = 8500;
  g.heads_q = 2;
  g.heads_kv = 1;
  g.dtype = FC_DTYPE_F16;
  cases.push_back(g);
  Case w = c;
  w.sm_margin = 0;
  w.causal = false;
  w.window_left = 1500;
  w.window_right = -1;
  cases.push_back(w);
  Case r = c;
  r.sm_margin = 0;
  r.causal = false;
  r.window_right = 70;
  cases.push_back(r);
  Case n = c;
  n.head_dim = 112;
  cases.push_back(n);
  Case n16 = g;  // d128's pairs in fp16, bottom-right causal, GQA
  n16.head_dim = 128;
  cases.push_back(n16);
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// d64 heads of at most 512 keys run whole by default (K/V loaded once per head and kept in the
// ring across its query tiles, the last tile first) where the heads fill the SMs: sm_margin leaves
// 8 of them for 8 heads. Causal with more keys than queries (bottom-right alignment), unmasked on
// the wide tile (500 rows: 192 + 192 + 116), GQA in fp16, a window bounded on the right only, and
// head_dim 40 (columns past it padded in the ring).
TEST(CudaSm90Forward, WholeHeadsByDefault) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  std::vector<Case> cases;
  Case c;
  c.batch = 2;
  c.heads_q = c.heads_kv = 4;
  c.seqlen_q = 400;
  c.seqlen_k = 512;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  c.sm_margin = 124;
  cases.push_back(c);
  Case full = c;
  full.causal = false;
  full.seqlen_q = 500;
  full.seqlen_k = 300;
  cases.push_back(full);
  Case gqa = c;
  gqa.dtype = FC_DTYPE_F16;
  gqa.heads_kv = 2;
  gqa.seqlen_q = gqa.seqlen_k = 512;
  cases.push_back(gqa);
  Case right = c;
  right.causal = false;
  right.window_right = 40;
  cases.push_back(right);
  Case narrow = c;
  narrow.head_dim = 40;
  cases.push_back(narrow);
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// A consumer whose 64 rows see none of its tile's first key blocks hands them back uncomputed and
// computes the rest (ForwardTraits::kSkipsBlocksPastRows): d256 (128-row tiles, 64-key blocks)
// under a causal mask, with more queries than keys (bottom-right: whole consumers whose rows see
// no key), with a window bounded on the right only that is no multiple of the block, in fp16 GQA;
// d64's wide tile (192 rows, 128-key blocks, masked calls from 4096 keys), whose last tile here
// leaves its third consumer idle (the same loop passes its blocks). sm_margin leaves 8 SMs, so
// each CTA carries P V from tile to tile across skipped blocks.
TEST(CudaSm90Forward, BlocksPastConsumerRows) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  std::vector<Case> cases;
  Case c;
  c.heads_q = c.heads_kv = 2;
  c.seqlen_q = c.seqlen_k = 512;
  c.head_dim = 256;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  c.sm_margin = 124;
  cases.push_back(c);
  Case more_q = c;
  more_q.seqlen_q = 700;
  more_q.seqlen_k = 300;
  cases.push_back(more_q);
  Case right = c;
  right.causal = false;
  right.window_right = 70;
  cases.push_back(right);
  Case gqa = c;
  gqa.dtype = FC_DTYPE_F16;
  gqa.heads_q = 4;
  gqa.seqlen_q = gqa.seqlen_k = 450;
  cases.push_back(gqa);
  Case wide = c;
  wide.head_dim = 64;
  wide.seqlen_q = wide.seqlen_k = 4100;
  cases.push_back(wide);
  Case wide_more_q = wide;
  wide_more_q.seqlen_q = 4300;
  wide_more_q.seqlen_k = 4096;
  cases.push_back(wide_more_q);
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// Causal pairs of query blocks on few SMs (sm_margin), so that even one or two heads make pairs
// and each CTA walks several pairs in a row: d64 at 2048 tokens, bottom-right causal with more keys
// than queries, a window bounded on the right only, GQA in fp16, and d128 at 1024 tokens with
// head_dim 96.
TEST(CudaSm90Forward, CausalPairsOnFewSms) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  std::vector<Case> cases;
  Case c;
  c.heads_q = c.heads_kv = 2;
  c.seqlen_q = c.seqlen_k = 2048;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  c.sm_margin = 124;
  cases.push_back(c);
  Case wider = c;
  wider.seqlen_q = 1000;
  wider.seqlen_k = 1300;
  cases.push_back(wider);
  Case right = c;
  right.causal = false;
  right.window_right = 100;
  right.seqlen_q = 1024;
  cases.push_back(right);
  Case gqa = c;
  gqa.dtype = FC_DTYPE_F16;
  gqa.heads_q = 4;
  gqa.seqlen_q = gqa.seqlen_k = 1024;
  cases.push_back(gqa);
  Case d128 = c;
  d128.head_dim = 96;
  d128.seqlen_q = d128.seqlen_k = 1024;
  cases.push_back(d128);
  expect_forward(cases, FC_BACKEND_CUDA_SM90);
}

// Long calls without a mask take the sm90 forward's wide d128 tile (three consumers, 192 query rows,
// 80-key blocks) from seqlen_q and seqlen_k 4096 on: a partial last query block and key block,
// GQA, fp16 with a softcap (the score-transform kernel), strided tensors, and varlen with a short
// sequence beside a long one.
TEST_P(CudaForward, LongUnmaskedCalls) {
  REQUIRE_BACKEND(GetParam());
  Case c;
  c.seqlen_q = 4100;  // 21 x 192 + 68 rows; 4133 keys = 51 x 80 + 53
  c.seqlen_k = 4133;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.head_dim = 128;
  c.dtype = FC_DTYPE_BF16;
  Case soft = c;
  soft.dtype = FC_DTYPE_F16;
  soft.softcap = 30.0;
  soft.padded = true;
  soft.head_dim = 120;  // padded to the d128 bucket
  Case v = c;
  v.varlen_q = {4097, 70};
  v.varlen_k = {4096, 4200};
  v.batch = 2;
  expect_forward({c, soft, v}, GetParam());
}

TEST_P(CudaForward, RepeatsAreBitIdentical) {
  REQUIRE_BACKEND(GetParam());
  CudaMemory mem;
  Case c;
  c.batch = 2;
  c.seqlen_q = 1000;
  c.seqlen_k = 1031;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(c, GetParam(), mem, 100, false, &why)) << why;
}

// sm_margin (SMs left to work running beside the call) shrinks the Hopper forward's persistent grid,
// down to one CTA: each tile is computed as before, so every margin gives the same bits (on sm80,
// whose grids hold one CTA per tile, it changes nothing). Calls the forward does not split only:
// a split count follows the SMs too (CudaSmMargin.PlansForFewerSms), and with it the bits. Causal
// GQA (query blocks go in pairs of equal cost once there are at least as many pairs as SMs: not at
// margin 0 for this one sequence, but on the smaller grids), unmasked d64 (three consumers) and
// varlen (four lists per SM), then accuracy against the reference with the grid at one CTA.
TEST_P(CudaForward, SmMarginKeepsTheBits) {
  REQUIRE_BACKEND(GetParam());
  CudaMemory mem;
  Case causal_gqa;
  causal_gqa.batch = 1;
  causal_gqa.seqlen_q = causal_gqa.seqlen_k = 1100;
  causal_gqa.heads_q = 16;
  causal_gqa.heads_kv = 4;
  causal_gqa.head_dim = 128;
  causal_gqa.dtype = FC_DTYPE_BF16;
  causal_gqa.causal = true;
  Case unmasked = causal_gqa;
  unmasked.causal = false;
  unmasked.head_dim = 64;
  unmasked.dtype = FC_DTYPE_F16;
  Case varlen = causal_gqa;
  varlen.varlen_q = {700, 1, 260, 1300};
  varlen.varlen_k = {700, 90, 260, 1400};
  varlen.batch = 4;
  std::string why;
  for (const Case& c : {causal_gqa, unmasked, varlen})
    EXPECT_TRUE(sm_margins_are_bit_identical(c, GetParam(), mem, {0, 1, 100, 131, 100000}, false, &why)) << why;
  std::vector<Case> cases;
  for (Case c : {causal_gqa, unmasked, varlen}) {
    c.sm_margin = 100000;
    cases.push_back(c);
  }
  expect_forward(cases, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaForward,
                         ::testing::Values(FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90), backend_label);

// sm80 reads pages of a multiple of 256 keys in place and gathers the others (1, 16, 48 keys)
// into packed rows in the workspace first; one page per sequence (2048) is read in place too.
TEST(CudaPagedKv, Sm80AndAutoAgainstTheReference) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM80);
  GridOptions g = cuda_grid();
  g.head_dims = {64, 128, 256};
  expect_forward(grid_paged(g, {1, 16, 48, 256, 512, 2048}), FC_BACKEND_CUDA_SM80);
  expect_forward(grid_paged(g, {16, 256}), FC_BACKEND_AUTO);
}

// Pages of 1 and 8 keys are gathered into packed rows; pages that divide a key block (16, 32, 64:
// one TMA box per page at d64 / d128, gathered at d256; pages of 16 where box_pages_pay), pages of whole 128-key blocks (128 here, 256 and 512 through AUTO above on
// a Hopper GPU) and one page per sequence (2048: every sequence of the grid fits one) are read in
// place. The harness shuffles the pages and fills every unused slot with NaN.
TEST(CudaPagedKv, Sm90AnyPageSize) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM90);
  GridOptions g = cuda_grid();
  g.head_dims = {64, 128, 256};
  expect_forward(grid_paged(g, {1, 8, 16, 32, 64, 128, 2048}), FC_BACKEND_CUDA_SM90);
}

/** grid_paged with ALiBi slopes on every case, per head and per (batch, head) in turn. */
std::vector<Case> paged_alibi_cases(const GridOptions& g, const std::vector<int64_t>& page_sizes) {
  std::vector<Case> cases = grid_paged(g, page_sizes);
  for (size_t i = 0; i < cases.size(); ++i) cases[i].alibi = i % 2 ? 2 : 1;
  return cases;
}

// ALiBi over paged K/V: the bias counts keys inside each sequence, whichever page holds them. On
// Hopper: pages gathered (1, 16: the page-box kernels take no score transform), read in place
// (128, one page per sequence), and through AUTO; on sm80 pages gathered (16) and read in place
// (256, 512), and ALiBi with dropout over pages of 16 and 256 keys (gathered either way: its paged
// tiles have no dropout with ALiBi) against the reference.
TEST(CudaPagedKv, AlibiAgainstTheReference) {
  REQUIRE_GPU();
  GridOptions g = cuda_grid();
  g.head_dims = {64, 128, 256};
  if (fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) {
    expect_forward(paged_alibi_cases(g, {1, 16, 128, 2048}), FC_BACKEND_CUDA_SM90);
    expect_forward(paged_alibi_cases(g, {64, 256}), FC_BACKEND_AUTO);
  }
  if (fc_backend_available(FC_BACKEND_CUDA_SM80, 0)) {
    expect_forward(paged_alibi_cases(g, {16, 256, 512}), FC_BACKEND_CUDA_SM80);
    CudaMemory mem;
    for (int64_t page : {16, 256}) {
      Case c = paged_alibi_cases(g, {page})[0];
      c.dropout_p = 0.2;
      const CheckResult r = check_forward(c, FC_BACKEND_CUDA_SM80, mem, 4);
      EXPECT_TRUE(r.ok && r.status_error.empty()) << "pages of " << page << ": " << r.summary() << r.status_error;
    }
  }
}

// Pages sm80 gathers (paged_gather.hpp) cost workspace: the query reports it (none for pages read
// in place: a multiple of 256 keys over two pages per sequence), a call given less is refused,
// naming the workspace, with out left as it was; a call with enough runs (zero inputs: out = 0),
// and one whose sequences have no keys needs none. q, k and v are zeros, out is poisoned.
TEST(CudaPagedKv, Sm80GatherWorkspace) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM80);
  CudaMemory mem;
  constexpr int64_t kHeads = 2, kDim = 64, kTotalQ = 14, kPages = 8;
  const std::vector<int32_t> cu = {0, 5, 14};
  struct Call {
    int64_t page_size;
    std::vector<int32_t> cu_keys;
    bool run;
    size_t give_less;
  };
  // Returns the status; *bytes the workspace the query reported, *out_after what out held after.
  auto call = [&](const Call& c, size_t* bytes, std::vector<uint8_t>* out_after) -> fc_status {
    const int64_t max_k = std::max(c.cu_keys[1] - c.cu_keys[0], c.cu_keys[2] - c.cu_keys[1]);
    const int64_t per_seq = std::max<int64_t>(2, (max_k + c.page_size - 1) / c.page_size);
    const size_t q_bytes = kTotalQ * kHeads * kDim * 2, kv_bytes = kPages * c.page_size * kHeads * kDim * 2;
    std::vector<int32_t> table_host(size_t(2 * per_seq));
    for (size_t i = 0; i < table_host.size(); ++i) table_host[i] = int32_t(i % kPages);
    void* q = mem.alloc(q_bytes);
    void* kv = mem.alloc(kv_bytes);
    void* out = mem.alloc(q_bytes);
    void* cq = mem.alloc(3 * sizeof(int32_t));
    void* ck = mem.alloc(3 * sizeof(int32_t));
    void* table = mem.alloc(table_host.size() * sizeof(int32_t));
    const std::vector<uint8_t> zeros(std::max(q_bytes, kv_bytes), 0), poison(q_bytes, 0xff);
    mem.upload(q, zeros.data(), q_bytes);
    mem.upload(kv, zeros.data(), kv_bytes);
    mem.upload(out, poison.data(), q_bytes);
    mem.upload(cq, cu.data(), 3 * sizeof(int32_t));
    mem.upload(ck, c.cu_keys.data(), 3 * sizeof(int32_t));
    mem.upload(table, table_host.data(), table_host.size() * sizeof(int32_t));
    const fc_tensor tq = flashcore::make_tensor(q, FC_DTYPE_BF16, {kTotalQ, kHeads, kDim}, FC_DEVICE_CUDA);
    const fc_tensor tk = flashcore::make_tensor(kv, FC_DTYPE_BF16, {kPages, c.page_size, kHeads, kDim}, FC_DEVICE_CUDA);
    fc_tensor to = flashcore::make_tensor(out, FC_DTYPE_BF16, {kTotalQ, kHeads, kDim}, FC_DEVICE_CUDA);
    const fc_tensor tcq = flashcore::make_tensor(cq, FC_DTYPE_I32, {3}, FC_DEVICE_CUDA);
    const fc_tensor tck = flashcore::make_tensor(ck, FC_DTYPE_I32, {3}, FC_DEVICE_CUDA);
    const fc_tensor tt = flashcore::make_tensor(table, FC_DTYPE_I32, {2, per_seq}, FC_DEVICE_CUDA);
    fc_attention_options o{};
    o.backend = FC_BACKEND_CUDA_SM80;
    o.cu_seqlens_q = &tcq;
    o.cu_seqlens_k = &tck;
    o.max_seqlen_q = 9;
    o.max_seqlen_k = max_k;
    o.block_table = &tt;
    o.stream = mem.stream();
    fc_status st = fc_attention_forward_workspace(&tq, &tk, &tk, &o, bytes);
    if (st == FC_OK && c.run) {
      const size_t given = *bytes - c.give_less;
      void* ws = given ? mem.alloc(given) : nullptr;
      st = fc_attention_forward(&tq, &tk, &tk, &to, nullptr, &o, ws, given);
      out_after->assign(q_bytes, 0);
      mem.download(out_after->data(), out, q_bytes);
      if (ws) mem.release(ws);
    }
    for (void* ptr : {q, kv, out, cq, ck, table}) mem.release(ptr);
    return st;
  };
  const std::vector<uint8_t> poison(kTotalQ * kHeads * kDim * 2, 0xff), zero(poison.size(), 0);
  std::vector<uint8_t> after;
  size_t gathered = 0, in_place = 0, no_keys = 0;
  ASSERT_EQ(call({16, {0, 40, 49}, false, 0}, &gathered, &after), FC_OK) << fc_last_error();
  ASSERT_GE(gathered, size_t(2 * 2 * 40 * kHeads * kDim * 2)) << "K and V of both sequences' key bound";
  ASSERT_EQ(call({256, {0, 40, 49}, false, 0}, &in_place, &after), FC_OK) << fc_last_error();
  EXPECT_EQ(in_place, 0u);
  size_t bytes = 0;
  EXPECT_EQ(call({16, {0, 40, 49}, true, 1}, &bytes, &after), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("workspace:"), std::string::npos) << fc_last_error();
  EXPECT_EQ(after, poison) << "a refused call wrote out";
  EXPECT_EQ(call({16, {0, 40, 49}, true, 0}, &bytes, &after), FC_OK) << fc_last_error();
  EXPECT_EQ(after, zero) << "zero inputs give out = 0";
  EXPECT_EQ(call({16, {0, 0, 0}, true, 0}, &no_keys, &after), FC_OK) << fc_last_error();
  EXPECT_EQ(no_keys, 0u);
  EXPECT_EQ(after, zero) << "rows without keys give out = 0";
}

TEST(CudaRaces, DeterministicBackwardIsBitIdentical) {
  REQUIRE_GPU();
  CudaMemory mem;
  Case c;
  c.batch = 2;
  c.seqlen_q = 500;
  c.seqlen_k = 531;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_F16;
  c.causal = true;
  c.deterministic = true;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CUDA_SM80, mem, 20, true, &why)) << why;
  if (fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) {
    EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CUDA_SM90, mem, 20, true, &why)) << "sm90: " << why;
    c.head_dim = 256;  // the role-split kernel
    c.dtype = FC_DTYPE_BF16;
    EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CUDA_SM90, mem, 10, true, &why)) << "sm90 d256: " << why;
  }
}

// What sm_margin changes must be seen: a call that the Hopper forward splits over its keys (16 query
// tokens against 4096 keys) plans its splits for the SMs left, so its workspace (the partials)
// shrinks when one SM is left.
TEST(CudaSmMargin, PlansForFewerSms) {
  if (!fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) GTEST_SKIP() << "no sm_90 GPU";
  CudaMemory mem;
  void* q = mem.alloc(16 * 32 * 128 * 2);
  void* kv = mem.alloc(4096 * 8 * 128 * 2);
  const fc_tensor tq = flashcore::make_tensor(q, FC_DTYPE_BF16, {1, 16, 32, 128}, FC_DEVICE_CUDA);
  const fc_tensor tk = flashcore::make_tensor(kv, FC_DTYPE_BF16, {1, 4096, 8, 128}, FC_DEVICE_CUDA);
  fc_attention_options o{};
  o.backend = FC_BACKEND_CUDA_SM90;
  size_t every_sm = 0, one_sm = 0;
  ASSERT_EQ(fc_attention_forward_workspace(&tq, &tk, &tk, &o, &every_sm), FC_OK) << fc_last_error();
  o.sm_margin = 100000;
  ASSERT_EQ(fc_attention_forward_workspace(&tq, &tk, &tk, &o, &one_sm), FC_OK) << fc_last_error();
  EXPECT_GT(every_sm, 0u) << "the call was expected to split over its keys";
  EXPECT_LT(one_sm, every_sm);
}

// The Hopper backward's persistent grid (no mask) under sm_margin: the same bits in deterministic
// mode at every margin, and the gradients against the reference with the grid at one CTA.
TEST(CudaSm90Backward, SmMarginKeepsTheBits) {
  if (!fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) GTEST_SKIP() << "no sm_90 GPU";
  CudaMemory mem;
  Case c;
  c.batch = 2;
  c.seqlen_q = 700;
  c.seqlen_k = 900;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.dtype = FC_DTYPE_BF16;
  c.deterministic = true;
  std::string why;
  EXPECT_TRUE(sm_margins_are_bit_identical(c, FC_BACKEND_CUDA_SM90, mem, {0, 3, 131, 100000}, true, &why)) << why;
  c.sm_margin = 100000;
  c.deterministic = false;
  expect_backward({c}, FC_BACKEND_CUDA_SM90);
}

// On sm_90 every kernel is a programmatic dependent of the one before it and must wait for it before
// reading: calls whose inputs are the previous call's outputs, issued back to back, have to give
// what the same calls give with the stream drained in between.
TEST(CudaRaces, ChainedForwardCallsReadFinishedInputs) {
  REQUIRE_GPU();
  CudaMemory mem;
  Case seed;  // the seed shape: the sm80 small-grid kernel, a few microseconds per call
  seed.heads_q = seed.heads_kv = 8;
  seed.seqlen_q = seed.seqlen_k = 512;
  seed.head_dim = 64;
  seed.dtype = FC_DTYPE_F16;
  Case wide = seed;  // the persistent sm90 kernel (sm80's default grid elsewhere)
  wide.batch = 2;
  wide.heads_q = 8;
  wide.heads_kv = 2;
  wide.seqlen_q = wide.seqlen_k = 700;
  wide.head_dim = 128;
  wide.dtype = FC_DTYPE_BF16;
  wide.causal = true;
  Case split = wide;  // sm90: split-KV, whose merge kernel sits between the calls' forwards
  split.batch = 1;
  split.seqlen_q = 16;
  split.seqlen_k = 4096;
  split.heads_q = 32;
  split.heads_kv = 8;
  for (fc_backend backend : {FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90}) {
    if (!fc_backend_available(backend, 0)) continue;
    for (const Case& c : {seed, wide, split}) {
      std::string why;
      EXPECT_TRUE(chained_forward_calls_are_ordered(c, backend, mem, 8, &why))
          << fc_backend_name(backend) << " " << c.name() << ": " << why;
    }
  }
}

/** A contiguous view of device memory, for tests that build C-ABI calls by hand. */
fc_tensor device_tensor(void* data, fc_dtype dtype, std::initializer_list<int64_t> shape) {
  return flashcore::make_tensor(data, dtype, shape, FC_DEVICE_CUDA);
}

// A workspace given to a CUDA call must be 16-byte aligned (the kernels store 16-byte vectors
// there): a misaligned one is refused, naming the workspace, before anything runs, in the
// forward (whether or not the call needs one), the backward and the KV-cache call; out stays as
// it was. The same calls with an aligned workspace run.
TEST(CudaWorkspace, MisalignedIsAClearError) {
  REQUIRE_BACKEND(FC_BACKEND_CUDA_SM80);
  CudaMemory mem;
  constexpr int64_t kB = 1, kS = 64, kH = 2, kD = 64;
  const size_t elems = kB * kS * kH * kD, bytes = elems * 2;
  const std::vector<uint8_t> zeros(bytes, 0), poison(bytes, 0xff);
  void* buffers[8];
  for (void*& b : buffers) {
    b = mem.alloc(bytes);
    mem.upload(b, zeros.data(), bytes);
  }
  void* lse = mem.alloc(kB * kH * kS * sizeof(float));
  void* lens = mem.alloc(sizeof(int32_t));
  const int32_t len = kS;
  mem.upload(lens, &len, sizeof(int32_t));
  const fc_tensor tq = device_tensor(buffers[0], FC_DTYPE_BF16, {kB, kS, kH, kD});
  const fc_tensor tk = device_tensor(buffers[1], FC_DTYPE_BF16, {kB, kS, kH, kD});
  const fc_tensor tv = device_tensor(buffers[2], FC_DTYPE_BF16, {kB, kS, kH, kD});
  fc_tensor to = device_tensor(buffers[3], FC_DTYPE_BF16, {kB, kS, kH, kD});
  fc_tensor tl = flashcore::make_tensor(lse, FC_DTYPE_F32, {kB, kH, kS}, FC_DEVICE_CUDA);
  const fc_tensor tdo = device_tensor(buffers[4], FC_DTYPE_BF16, {kB, kS, kH, kD});
  fc_tensor tdq = device_tensor(buffers[5], FC_DTYPE_BF16, {kB, kS, kH, kD});
  fc_tensor tdk = device_tensor(buffers[6], FC_DTYPE_BF16, {kB, kS, kH, kD});
  fc_tensor tdv = device_tensor(buffers[7], FC_DTYPE_BF16, {kB, kS, kH, kD});
  const fc_tensor tlens = flashcore::make_tensor(lens, FC_DTYPE_I32, {kB}, FC_DEVICE_CUDA);
  fc_attention_options o{};
  o.backend = FC_BACKEND_CUDA_SM80;
  o.stream = mem.stream();
  size_t fwd_bytes = 0, bwd_bytes = 0, kv_bytes = 0;
  ASSERT_EQ(fc_attention_forward_workspace(&tq, &tk, &tv, &o, &fwd_bytes), FC_OK) << fc_last_error();
  ASSERT_EQ(fc_attention_backward_workspace(&tq, &tk, &tv, &o, &bwd_bytes), FC_OK) << fc_last_error();
  fc_kvcache_args kv{};
  kv.q = &tq;
  kv.k_cache = &tk;
  kv.v_cache = &tv;
  kv.cache_seqlens = &tlens;
  kv.out = &to;
  ASSERT_EQ(fc_attention_kvcache_workspace(&kv, &o, &kv_bytes), FC_OK) << fc_last_error();
  const size_t ws_bytes = std::max({fwd_bytes, bwd_bytes, kv_bytes, size_t(256)});
  char* ws = static_cast<char*>(mem.alloc(ws_bytes + 16));
  auto out_now = [&](void* buffer) {
    std::vector<uint8_t> h(bytes);
    mem.download(h.data(), buffer, bytes);
    return h;
  };
  auto expect_refused = [&](fc_status st, const char* what, void* output) {
    EXPECT_EQ(st, FC_ERROR_INVALID_ARGUMENT) << what;
    EXPECT_NE(std::string(fc_last_error()).find("workspace: its address must be 16-byte aligned"), std::string::npos)
        << what << ": " << fc_last_error();
    EXPECT_EQ(out_now(output), poison) << what << " wrote its output";
  };
  mem.upload(buffers[3], poison.data(), bytes);
  expect_refused(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &o, ws + 4, ws_bytes), "forward", buffers[3]);
  expect_refused(fc_attention_kvcache(&kv, &o, ws + 8, ws_bytes), "kvcache", buffers[3]);
  EXPECT_EQ(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &o, ws, ws_bytes), FC_OK) << fc_last_error();
  EXPECT_EQ(out_now(buffers[3]), zeros) << "zero inputs give out = 0";
  mem.upload(buffers[5], poison.data(), bytes);
  expect_refused(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &o, ws + 4, ws_bytes),
                 "backward", buffers[5]);
  EXPECT_EQ(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &o, ws, ws_bytes), FC_OK)
      << fc_last_error();
  EXPECT_EQ(out_now(buffers[5]), zeros) << "zero inputs give dq = 0";
  mem.release(ws);
  for (void* b : buffers) mem.release(b);
  mem.release(lse);
  mem.release(lens);
}

// AUTO's decode route (api/dispatch.cpp): dense forwards with a few query rows per KV head run on
// the decode kernel, with every semantic the forward kernels keep: masks aligned to the bottom
// right (rows that see no key: out 0, lse -inf), windows, softcap, ALiBi, GQA / MQA, padded
// strides, split-KV over long keys, and a backward from the lse it wrote.
TEST(CudaDecodeRoute, FewQueryRows) {
  REQUIRE_GPU();
  std::vector<Case> cases;
  for (int64_t d : {64, 96, 128, 256})
    for (int64_t sq : {1, 3}) {
      Case c;
      c.batch = 3;
      c.seqlen_q = sq;
      c.seqlen_k = 777;
      c.heads_q = 8;
      c.heads_kv = 2;
      c.head_dim = d;
      c.dtype = sq == 1 ? FC_DTYPE_BF16 : FC_DTYPE_F16;
      c.causal = sq == 3;
      c.softcap = d == 96 ? 15.0 : 0.0;
      c.padded = d == 128;
      cases.push_back(c);
    }
  Case c;
  c.batch = 2;
  c.heads_q = c.heads_kv = 4;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_BF16;
  c.seqlen_q = 16;  // MHA: 16 rows, one pass
  c.seqlen_k = 300;
  c.causal = true;
  cases.push_back(c);
  c.seqlen_q = 5;  // more queries than keys: the first rows see nothing
  c.seqlen_k = 3;
  cases.push_back(c);
  c.seqlen_q = 4;  // a window on both sides
  c.seqlen_k = 1000;
  c.causal = false;
  c.window_left = 100;
  c.window_right = 1;
  cases.push_back(c);
  c.window_left = c.window_right = -1;
  c.alibi = 2;  // per-sequence slopes
  cases.push_back(c);
  Case mqa;  // MQA with split-KV over long keys
  mqa.seqlen_q = 2;
  mqa.seqlen_k = 20000;
  mqa.heads_q = 8;
  mqa.heads_kv = 1;
  mqa.head_dim = 128;
  mqa.dtype = FC_DTYPE_BF16;
  mqa.causal = true;
  cases.push_back(mqa);
  expect_forward(cases, FC_BACKEND_AUTO);
  expect_backward({cases[0], cases[3], cases[9], mqa}, FC_BACKEND_AUTO);
  CudaMemory mem;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(mqa, FC_BACKEND_AUTO, mem, 20, false, &why)) << why;
  EXPECT_TRUE(chained_forward_calls_are_ordered(cases[1], FC_BACKEND_AUTO, mem, 8, &why)) << why;
}

// AUTO's decode route for varlen forwards with a few query rows per KV head
// (flash_attn_varlen_func's decoding, api/kvcache_forward_view.hpp's varlen_forward_as_kvcache):
// sequences without a query or without keys, sequences of 1-4 tokens (16 rows per KV head) whose
// masks align to their own last key, packed K/V and pages of 16, 256 and 5 keys, head dims 64
// (read in head pairs), 96 (padded), 128 and 256, GQA / MQA, causal, windows, softcap, ALiBi
// (packed and over 5-key pages, which the portable forward declines and the route serves), NaN rows
// past the packed sequences, split-KV over long keys with the combine skipping the sequences
// without a query, a backward from its lse, repeat runs bit-identical, chained calls ordered (each
// call's out the next one's q: cu_seqlens_q and q are read after the wait); and the rule: taken
// for these calls, not for 20 rows per KV head (five tokens of a GQA group of 4).
TEST(CudaDecodeRoute, VarlenFewQueryRows) {
  REQUIRE_GPU();
  std::vector<Case> cases;
  for (int64_t d : {64, 96, 128, 256})
    for (int64_t page : {0, 16, 256, 5}) {
      Case c;
      c.varlen_q = {1, 0, 1, 1};
      c.varlen_k = {300, 40, 0, 777};
      c.heads_q = 8;
      c.heads_kv = 2;
      c.head_dim = d;
      c.dtype = page == 16 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
      c.page_size = page;
      c.causal = page != 5;
      c.softcap = page == 256 ? 15.0 : 0.0;
      if (page == 5) {
        c.window_left = 100;
        c.window_right = 0;
      }
      c.alibi = (page == 0 && d != 64) || page == 5 ? 2 : 0;
      cases.push_back(c);
    }
  Case split;  // GQA 32 / 8 over long keys: split-KV, and a combine that skips sequence 1
  split.varlen_q = {1, 0, 1};
  split.varlen_k = {30000, 9000, 12345};
  split.heads_q = 32;
  split.heads_kv = 8;
  split.head_dim = 128;
  split.dtype = FC_DTYPE_BF16;
  split.causal = true;
  cases.push_back(split);
  Case paged_split = split;
  paged_split.page_size = 16;
  paged_split.dtype = FC_DTYPE_F16;
  cases.push_back(paged_split);
  for (int64_t d : {64, 128}) {  // up to 4 tokens of a GQA group of 4: 16 rows per KV head
    Case c;
    c.varlen_q = {3, 0, 1, 4, 2};
    c.varlen_k = {3000, 40, 7, 2, 1000};  // (4 tokens against 2 keys: the first rows see nothing)
    c.heads_q = 8;
    c.heads_kv = 2;
    c.head_dim = d;
    c.dtype = FC_DTYPE_BF16;
    c.causal = d == 64;
    if (d == 128) {
      c.window_left = 20;
      c.window_right = 1;
      c.alibi = 2;
    }
    cases.push_back(c);
    c.alibi = 0;
    c.page_size = 16;
    cases.push_back(c);
  }
  Case mqa;  // MQA, 16 rows: one pass
  mqa.varlen_q = {1, 1};
  mqa.varlen_k = {5000, 1};
  mqa.heads_q = 16;
  mqa.heads_kv = 1;
  mqa.head_dim = 128;
  mqa.dtype = FC_DTYPE_BF16;
  mqa.alibi = 1;
  cases.push_back(mqa);
  expect_forward(cases, FC_BACKEND_AUTO);
  expect_backward({cases[0], cases[8], split, cases[18], cases[20]}, FC_BACKEND_AUTO);
  CudaMemory mem;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(split, FC_BACKEND_AUTO, mem, 10, false, &why)) << why;
  EXPECT_TRUE(chained_forward_calls_are_ordered(split, FC_BACKEND_AUTO, mem, 8, &why)) << why;
  EXPECT_TRUE(chained_forward_calls_are_ordered(cases[18], FC_BACKEND_AUTO, mem, 8, &why)) << why;

  // The rule, on tensors of split's shape.
  const int64_t total_k = 30000 + 9000 + 12345, hq = 32, hk = 8, d = 128;
  constexpr int64_t kRowsQ = 8;  // (max_seqlen_q is clamped to the packed rows)
  void* q = mem.alloc(size_t(2) * kRowsQ * hq * d);
  void* k = mem.alloc(size_t(2) * total_k * hk * d);
  void* o = mem.alloc(size_t(2) * kRowsQ * hq * d);
  void* cu = mem.alloc(sizeof(int32_t) * 8);
  const int32_t cu_values[8] = {0, 1, 1, 2, 0, 30000, 39000, static_cast<int32_t>(total_k)};  // cu_seqlens_q, _k
  mem.upload(cu, cu_values, sizeof(cu_values));
  fc_tensor tq = device_tensor(q, FC_DTYPE_BF16, {kRowsQ, hq, d}), tk = device_tensor(k, FC_DTYPE_BF16, {total_k, hk, d});
  fc_tensor to = device_tensor(o, FC_DTYPE_BF16, {kRowsQ, hq, d});
  fc_tensor cu_q = device_tensor(cu, FC_DTYPE_I32, {4}), cu_k = device_tensor(static_cast<int32_t*>(cu) + 4, FC_DTYPE_I32, {4});
  fc_attention_options opt{};
  opt.causal = 1;
  opt.cu_seqlens_q = &cu_q;
  opt.cu_seqlens_k = &cu_k;
  opt.max_seqlen_q = 1;
  opt.max_seqlen_k = 30000;
  EXPECT_TRUE(forward_takes_decode_route(ForwardArgs{&tq, &tk, &tk, &to, nullptr, &opt}));
  opt.max_seqlen_q = 4;
  EXPECT_TRUE(forward_takes_decode_route(ForwardArgs{&tq, &tk, &tk, &to, nullptr, &opt}));
  opt.max_seqlen_q = 5;
  EXPECT_FALSE(forward_takes_decode_route(ForwardArgs{&tq, &tk, &tk, &to, nullptr, &opt}));
  for (void* x : {q, k, o, cu}) mem.release(x);

  // ALiBi over pages with many query rows: on the forward kernels (which add the bias over pages).
  Case prefill = cases[3];
  prefill.varlen_q = {100, 0, 1, 50};
  prefill.page_size = 256;  // (a page size sm80 reads too)
  expect_forward({prefill}, FC_BACKEND_AUTO);
}

/** One bf16 dense problem on the GPU (fresh normal inputs), run as the forward (AUTO or a backend
 *  named, with or without the workspace the query reports) or as the KV-cache call over the same
 *  tensors (k / v as caches whose rows are full). Returns out's and lse's bytes. */
struct DenseProblem {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
};
struct RouteResult {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};
enum class RouteCall { kForward, kForwardWithoutWorkspace, kKvCache };

class RouteRunner {
 public:
  /** Tensors on the current device; calls made later may run with another one current. */
  explicit RouteRunner(const DenseProblem& d) : d_(d) {
    CUDA_OK(cudaGetDevice(&device_));
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    auto upload_random = [&](size_t n) {
      std::vector<uint16_t> host(n);
      for (uint16_t& h : host) {
        const float x = normal(rng);
        uint32_t u;
        std::memcpy(&u, &x, 4);
        h = static_cast<uint16_t>((u + 0x8000u) >> 16);  // bf16, rounded
      }
      void* dev = mem_.alloc(n * 2);
      mem_.upload(dev, host.data(), n * 2);
      return dev;
    };
    q_ = upload_random(size_t(d.batch * d.seqlen_q * d.heads_q * d.head_dim));
    k_ = upload_random(size_t(d.batch * d.seqlen_k * d.heads_kv * d.head_dim));
    v_ = upload_random(size_t(d.batch * d.seqlen_k * d.heads_kv * d.head_dim));
    const std::vector<int32_t> full(size_t(d.batch), static_cast<int32_t>(d.seqlen_k));
    lens_ = mem_.alloc(full.size() * 4);
    mem_.upload(lens_, full.data(), full.size() * 4);
  }

  RouteResult run(RouteCall call, fc_backend backend = FC_BACKEND_AUTO) {
    const size_t out_elems = size_t(d_.batch * d_.seqlen_q * d_.heads_q * d_.head_dim);
    const size_t lse_elems = size_t(d_.batch * d_.heads_q * d_.seqlen_q);
    void* out = alloc_on_tensors_device(out_elems * 2);
    void* lse = alloc_on_tensors_device(lse_elems * 4);
    auto on_device = [&](void* data, fc_dtype dtype, std::initializer_list<int64_t> shape) {
      fc_tensor t = device_tensor(data, dtype, shape);
      t.device_id = device_;
      return t;
    };
    const fc_tensor tq = on_device(q_, FC_DTYPE_BF16, {d_.batch, d_.seqlen_q, d_.heads_q, d_.head_dim});
    const fc_tensor tk = on_device(k_, FC_DTYPE_BF16, {d_.batch, d_.seqlen_k, d_.heads_kv, d_.head_dim});
    const fc_tensor tv = on_device(v_, FC_DTYPE_BF16, {d_.batch, d_.seqlen_k, d_.heads_kv, d_.head_dim});
    fc_tensor to = on_device(out, FC_DTYPE_BF16, {d_.batch, d_.seqlen_q, d_.heads_q, d_.head_dim});
    fc_tensor tl = on_device(lse, FC_DTYPE_F32, {d_.batch, d_.heads_q, d_.seqlen_q});
    const fc_tensor tlens = on_device(lens_, FC_DTYPE_I32, {d_.batch});
    Options opt;
    opt.causal = d_.causal;
    opt.backend = backend;
    opt.stream = mem_.stream();
    KvCacheArgs args;
    args.q = &tq;
    args.k_cache = &tk;
    args.v_cache = &tv;
    args.cache_seqlens = &tlens;
    args.out = &to;
    args.lse = &tl;
    const size_t ws_bytes = call == RouteCall::kForwardWithoutWorkspace ? 0
                            : call == RouteCall::kKvCache               ? kvcache_workspace(args, opt)
                                                                        : forward_workspace(tq, tk, tv, opt);
    void* ws = alloc_on_tensors_device(ws_bytes);
    if (call == RouteCall::kKvCache) {
      kvcache(args, opt, ws, ws_bytes);
    } else {
      forward(tq, tk, tv, to, &tl, opt, ws, ws_bytes);
    }
    RouteResult r{std::vector<uint16_t>(out_elems), std::vector<float>(lse_elems)};
    mem_.download(r.out.data(), out, out_elems * 2);
    mem_.download(r.lse.data(), lse, lse_elems * 4);
    for (void* p : {out, lse, ws})
      if (p) mem_.release(p);
    return r;
  }

 private:
  /** cudaMalloc on the tensors' device, whichever device is current. */
  void* alloc_on_tensors_device(size_t bytes) {
    int current = 0;
    CUDA_OK(cudaGetDevice(&current));
    CUDA_OK(cudaSetDevice(device_));
    void* p = mem_.alloc(bytes);
    CUDA_OK(cudaSetDevice(current));
    return p;
  }

  int device_ = 0;
  DenseProblem d_;
  CudaMemory mem_;
  void *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *lens_ = nullptr;
};

bool same_bits(const RouteResult& a, const RouteResult& b) {
  return a.out == b.out && std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// The route is taken where it suits (the same bits as the KV-cache call: GQA 32 / 8 with one
// token over one sequence, split-KV; MHA d256; d64 GQA over few tiles), not where 64 rows per KV
// head over 64 sequences fill the forward's tiles (the same bits as the forward backend named),
// and a call without the workspace the query reports runs on the forward kernels (the route's
// split-KV partials are all its workspace).
TEST(CudaDecodeRoute, TakenWhereItSuits) {
  REQUIRE_GPU();
  for (const DenseProblem& d : {DenseProblem{1, 1, 16384, 32, 8, 128, false}, DenseProblem{2, 3, 2000, 4, 4, 256, true},
                                DenseProblem{3, 2, 999, 8, 2, 64, true}}) {
    RouteRunner runner(d);
    const RouteResult routed = runner.run(RouteCall::kForward);
    EXPECT_TRUE(same_bits(routed, runner.run(RouteCall::kKvCache)))
        << "heads " << d.heads_q << " / " << d.heads_kv << ", d" << d.head_dim << ": not the decode kernel's bits";
  }
  const fc_backend forward_kernels = fc_backend_available(FC_BACKEND_CUDA_SM90, 0) ? FC_BACKEND_CUDA_SM90
                                                                                 : FC_BACKEND_CUDA_SM80;
  RouteRunner tiles({64, 64, 512, 8, 1, 128, true});
  EXPECT_TRUE(same_bits(tiles.run(RouteCall::kForward), tiles.run(RouteCall::kForward, forward_kernels)))
      << "64 rows per KV head over 64 sequences did not stay on " << fc_backend_name(forward_kernels);

  RouteRunner split({1, 1, 16384, 32, 8, 128, false});
  const RouteResult routed = split.run(RouteCall::kForward);
  const RouteResult fallback = split.run(RouteCall::kForwardWithoutWorkspace);
  EXPECT_FALSE(same_bits(routed, fallback)) << "without the workspace the call still took the split route";
  float worst = 0.f, largest = 0.f;  // two bf16 roundings of fp32 sums apart: ~1% of the largest
  for (size_t i = 0; i < routed.out.size(); ++i) {
    const uint32_t a = uint32_t(routed.out[i]) << 16, b = uint32_t(fallback.out[i]) << 16;
    float fa, fb;
    std::memcpy(&fa, &a, 4);
    std::memcpy(&fb, &b, 4);
    largest = std::max(largest, std::fabs(fa));
    worst = std::isfinite(fb) ? std::max(worst, std::fabs(fa - fb)) : INFINITY;
  }
  EXPECT_GT(largest, 0.f);
  EXPECT_LE(worst, 0.02f * largest) << "the forward kernels' result differs from the route's";
}

// The route on the tensors' GPU when another one is current (the decode path switches devices as
// the forward kernels do).
TEST(CudaDecodeRoute, RunsOnTheTensorsDevice) {
  REQUIRE_GPU();
  if (fc_cuda_device_count() < 2) GTEST_SKIP() << "one GPU: the device switch is not exercised";
  CUDA_OK(cudaSetDevice(1));
  RouteRunner on_one({1, 1, 16384, 32, 8, 128, false});
  const RouteResult expected = on_one.run(RouteCall::kKvCache);
  CUDA_OK(cudaSetDevice(0));
  const RouteResult got = on_one.run(RouteCall::kForward);
  EXPECT_TRUE(same_bits(got, expected));
  CUDA_OK(cudaSetDevice(0));
}

TEST(CudaDeviceInfo, DescribesEveryVisibleDevice) {
  // (The bad-argument cases run in the CPU tests: DeviceInfo.*.)
  const int n = fc_cuda_device_count();
  if (n == 0) GTEST_SKIP() << "no CUDA device visible";
  for (int d = 0; d < n; ++d) {
    char line[256];
    ASSERT_EQ(fc_cuda_device_describe(d, line, sizeof(line)), FC_OK) << fc_last_error();
    EXPECT_NE(std::string(line).find(", sm_"), std::string::npos) << line;
    EXPECT_NE(std::string(line).find(" SMs, "), std::string::npos) << line;
  }
  char small[8];
  ASSERT_EQ(fc_cuda_device_describe(0, small, sizeof(small)), FC_OK) << fc_last_error();
  EXPECT_EQ(std::strlen(small), sizeof(small) - 1);  // cut, terminated
}

// cu_seqlens on the GPU are trusted unless the caller asks for a check (check_cu_seqlens or
// FLASHCORE_CHECK_CU_SEQLENS=1): then bad values get the CPU path's errors, and nothing is written.
TEST(CudaValidation, CuSeqlensCheckedOnRequest) {
  REQUIRE_GPU();
  CudaMemory mem;
  constexpr int64_t kTotalQ = 10, kTotalK = 12, kHeads = 2, kDim = 64;
  const size_t q_elems = kTotalQ * kHeads * kDim, k_elems = kTotalK * kHeads * kDim;
  const std::vector<uint16_t> ones_q(q_elems, 0x3c00), ones_k(k_elems, 0x3c00);  // fp16 1.0
  const std::vector<uint16_t> poison_bits(k_elems, 0x7bff);  // fp16 65504, enough for every output (k_elems >= q_elems)
  const std::vector<float> poison_lse(kHeads * kTotalQ, -7.f);
  auto device_copy = [&](const void* host, size_t bytes) {
    void* d = mem.alloc(bytes);
    mem.upload(d, host, bytes);
    return d;
  };
  void* q = device_copy(ones_q.data(), q_elems * 2);
  void* k = device_copy(ones_k.data(), k_elems * 2);
  void* v = device_copy(ones_k.data(), k_elems * 2);
  void* dout = device_copy(ones_q.data(), q_elems * 2);
  void* out = mem.alloc(q_elems * 2);
  void* lse = mem.alloc(poison_lse.size() * sizeof(float));
  void* grads[3] = {mem.alloc(q_elems * 2), mem.alloc(k_elems * 2), mem.alloc(k_elems * 2)};
  void* cu_q = mem.alloc(3 * sizeof(int32_t));
  void* cu_k = mem.alloc(3 * sizeof(int32_t));
  fc_tensor tq = device_tensor(q, FC_DTYPE_F16, {kTotalQ, kHeads, kDim}), tk = device_tensor(k, FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  fc_tensor tv = device_tensor(v, FC_DTYPE_F16, {kTotalK, kHeads, kDim}), tdo = device_tensor(dout, FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  fc_tensor to = device_tensor(out, FC_DTYPE_F16, {kTotalQ, kHeads, kDim}), tl = device_tensor(lse, FC_DTYPE_F32, {kHeads, kTotalQ});
  fc_tensor tdq = device_tensor(grads[0], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  fc_tensor tdk = device_tensor(grads[1], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  fc_tensor tdv = device_tensor(grads[2], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  fc_tensor tcq = device_tensor(cu_q, FC_DTYPE_I32, {3}), tck = device_tensor(cu_k, FC_DTYPE_I32, {3});
  fc_attention_options opt{};
  opt.cu_seqlens_q = &tcq;
  opt.cu_seqlens_k = &tck;
  opt.max_seqlen_q = 6;
  opt.max_seqlen_k = 7;
  opt.backend = FC_BACKEND_CUDA_SM80;
  opt.stream = mem.stream();

  auto set_lengths = [&](std::vector<int32_t> cq, std::vector<int32_t> ck) {
    mem.upload(cu_q, cq.data(), cq.size() * sizeof(int32_t));
    mem.upload(cu_k, ck.data(), ck.size() * sizeof(int32_t));
  };
  auto poison = [&] {
    mem.upload(out, poison_bits.data(), q_elems * 2);
    mem.upload(lse, poison_lse.data(), poison_lse.size() * sizeof(float));
    for (void* g : grads) mem.upload(g, poison_bits.data(), (g == grads[0] ? q_elems : k_elems) * 2);
  };
  auto untouched = [&] {
    std::vector<uint16_t> h(k_elems);
    std::vector<float> hl(poison_lse.size());
    mem.download(h.data(), out, q_elems * 2);
    bool same = std::equal(h.begin(), h.begin() + q_elems, poison_bits.begin());
    mem.download(hl.data(), lse, hl.size() * sizeof(float));
    same = same && hl == poison_lse;
    for (void* g : grads) {
      const size_t n = g == grads[0] ? q_elems : k_elems;
      mem.download(h.data(), g, n * 2);
      same = same && std::all_of(h.begin(), h.begin() + n, [](uint16_t x) { return x == 0x7bff; });
    }
    return same;
  };
  auto expect_error = [&](const char* needle) {
    poison();
    EXPECT_EQ(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fc_last_error()).find(needle), std::string::npos) << fc_last_error();
    EXPECT_EQ(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt, nullptr, 0),
              FC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fc_last_error()).find(needle), std::string::npos) << fc_last_error();
    EXPECT_TRUE(untouched()) << needle;
  };

  opt.check_cu_seqlens = 1;
  set_lengths({1, 4, 10}, {0, 5, 12});
  expect_error("cu_seqlens_q: starts at 1");
  set_lengths({0, 6, 4}, {0, 5, 12});
  expect_error("cu_seqlens_q: decreases at index 2");
  set_lengths({0, 4, 10}, {0, 7, 13});
  expect_error("cu_seqlens_k: last entry 13 exceeds the packed tensor's 12 rows");
  set_lengths({0, 4, 10}, {0, 2, 12});
  expect_error("max_seqlen_k: 7 is smaller than sequence 1's length 10");

  opt.check_cu_seqlens = 0;  // the environment switch does the same
  ASSERT_EQ(setenv("FLASHCORE_CHECK_CU_SEQLENS", "1", 1), 0);
  set_lengths({0, 4, 10}, {0, 7, 14});
  expect_error("cu_seqlens_k: last entry 14 exceeds");
  unsetenv("FLASHCORE_CHECK_CU_SEQLENS");

  opt.check_cu_seqlens = 1;  // valid lengths pass the check and run
  set_lengths({0, 4, 10}, {0, 5, 12});
  poison();
  ASSERT_EQ(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, nullptr, 0), FC_OK) << fc_last_error();
  size_t workspace_bytes = 0;
  ASSERT_EQ(fc_attention_backward_workspace(&tq, &tk, &tv, &opt, &workspace_bytes), FC_OK) << fc_last_error();
  void* workspace = mem.alloc(workspace_bytes);
  ASSERT_EQ(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt, workspace, workspace_bytes),
            FC_OK)
      << fc_last_error();
  std::vector<uint16_t> h(q_elems);
  mem.download(h.data(), out, q_elems * 2);
  EXPECT_TRUE(std::all_of(h.begin(), h.end(), [](uint16_t x) { return x == 0x3c00; }))
      << "attention over values of 1 must give 1";
  for (void* p : {q, k, v, dout, out, lse, grads[0], grads[1], grads[2], cu_q, cu_k, workspace}) {
    if (p) mem.release(p);
  }
}

// Without the host check, wrong cu_seqlens in GPU memory give wrong results but no access outside
// the tensors or the workspace (seq_info clamps every sequence into its packed tensor): the calls
// finish without a CUDA error (compute-sanitizer memcheck runs this test, gpu_check.sh), and the
// device-side check sets the caller's error_flag; valid lengths leave it 0.
TEST(CudaSanitizerSmall, UncheckedBadCuSeqlensStayInBounds) {
  REQUIRE_GPU();
  CudaMemory mem;
  constexpr int64_t kTotalQ = 37, kTotalK = 45, kHeads = 2, kDim = 64;
  const size_t q_elems = kTotalQ * kHeads * kDim, k_elems = kTotalK * kHeads * kDim;
  const std::vector<uint16_t> ones(k_elems, 0x3c00);  // fp16 1.0, enough for q and k
  auto device_copy = [&](size_t elems) {
    void* d = mem.alloc(elems * 2);
    mem.upload(d, ones.data(), elems * 2);
    return d;
  };
  void* buffers[9] = {device_copy(q_elems), device_copy(k_elems), device_copy(k_elems), device_copy(q_elems),
                      device_copy(q_elems), mem.alloc(kHeads * kTotalQ * sizeof(float)),
                      device_copy(q_elems), device_copy(k_elems), device_copy(k_elems)};
  void* cu = mem.alloc(2 * 4 * sizeof(int32_t));
  void* flag = mem.alloc(sizeof(int32_t));
  auto flag_after = [&](fc_status status) {  // the call's status must be OK; then the flag's value
    EXPECT_EQ(status, FC_OK) << fc_last_error();
    int32_t value = -1;
    mem.download(&value, flag, sizeof value);
    const int32_t zero = 0;
    mem.upload(flag, &zero, sizeof zero);
    return value;
  };
  const fc_tensor tq = device_tensor(buffers[0], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  const fc_tensor tk = device_tensor(buffers[1], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  const fc_tensor tv = device_tensor(buffers[2], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  const fc_tensor tdo = device_tensor(buffers[3], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  fc_tensor to = device_tensor(buffers[4], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  fc_tensor tl = device_tensor(buffers[5], FC_DTYPE_F32, {kHeads, kTotalQ});
  fc_tensor tdq = device_tensor(buffers[6], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  fc_tensor tdk = device_tensor(buffers[7], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  fc_tensor tdv = device_tensor(buffers[8], FC_DTYPE_F16, {kTotalK, kHeads, kDim});
  const fc_tensor tcq = device_tensor(cu, FC_DTYPE_I32, {4});
  const fc_tensor tck = device_tensor(static_cast<int32_t*>(cu) + 4, FC_DTYPE_I32, {4});
  fc_attention_options opt{};
  opt.cu_seqlens_q = &tcq;
  opt.cu_seqlens_k = &tck;
  opt.max_seqlen_q = 20;
  opt.max_seqlen_k = 30;
  opt.stream = mem.stream();
  opt.error_flag = static_cast<int32_t*>(flag);
  const int32_t zero = 0;
  mem.upload(flag, &zero, sizeof zero);
  // Decreasing, negative, past the packed rows, longer than max_seqlen: each case breaks a rule.
  const std::vector<std::vector<int32_t>> bad = {{0, 30, 10, 37, 0, 40, 12, 45},
                                                 {-50, 5, 9, 37, 0, -7, 3, 45},
                                                 {0, 4, 90, 400, 10, 20, 1000, 2000},
                                                 {0, 36, 36, 37, 0, 44, 44, 45}};
  for (fc_backend backend : {FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90}) {
    if (!fc_backend_available(backend, 0)) continue;
    opt.backend = backend;
    for (bool causal : {false, true}) {
      opt.causal = causal;
      size_t workspace_bytes = 0;
      ASSERT_EQ(fc_attention_backward_workspace(&tq, &tk, &tv, &opt, &workspace_bytes), FC_OK) << fc_last_error();
      void* workspace = workspace_bytes ? mem.alloc(workspace_bytes) : nullptr;
      const std::vector<int32_t> good = {0, 12, 20, 37, 0, 30, 30, 45};
      for (const std::vector<int32_t>& lengths : bad) {
        mem.upload(cu, lengths.data(), lengths.size() * sizeof(int32_t));
        const std::string what = std::string(fc_backend_name(backend)) + " lengths " + ::testing::PrintToString(lengths);
        EXPECT_EQ(flag_after(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, nullptr, 0)), 1) << what;
        EXPECT_EQ(flag_after(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt, workspace,
                                                   workspace_bytes)),
                  1)
            << what;
        EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(mem.stream())), cudaSuccess) << what;
      }
      mem.upload(cu, good.data(), good.size() * sizeof(int32_t));
      EXPECT_EQ(flag_after(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, nullptr, 0)), 0);
      EXPECT_EQ(flag_after(fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt, workspace,
                                                 workspace_bytes)),
                0);
      if (workspace) mem.release(workspace);
    }
  }
  for (void* b : buffers) mem.release(b);
  mem.release(cu);
  mem.release(flag);
}

// Paged K/V with page ids and lengths in GPU memory that break the rules: kv_offset clamps the
// table column and the page id, seq_info the lengths, so the call reads nothing outside k, v and
// the table (compute-sanitizer memcheck runs this test) and ends without a CUDA error. Pages of
// 256 keys (read in place by sm80 and sm90) and of 16 (sm90: one TMA box per page, whose table
// entries the producer clamps the same way; sm80: gathered into packed rows first, the gather
// placing each row through the same clamps).
TEST(CudaSanitizerSmall, UncheckedBadPagesStayInBounds) {
  REQUIRE_GPU();
  CudaMemory mem;
  constexpr int64_t kTotalQ = 24, kPages = 3, kPage = 256, kHeads = 2, kDim = 64;
  const size_t q_elems = kTotalQ * kHeads * kDim, kv_elems = kPages * kPage * kHeads * kDim;
  const std::vector<uint16_t> ones(kv_elems, 0x3c00);  // fp16 1.0
  auto device_copy = [&](size_t elems) {
    void* d = mem.alloc(elems * 2);
    mem.upload(d, ones.data(), elems * 2);
    return d;
  };
  void* buffers[4] = {device_copy(q_elems), device_copy(kv_elems), device_copy(kv_elems), device_copy(q_elems)};
  void* lse = mem.alloc(kHeads * kTotalQ * sizeof(float));
  void* ints = mem.alloc(16 * sizeof(int32_t));  // cu_seqlens_q (3), cu_seqlens_k (3), table (2 x 2)
  const fc_tensor tq = device_tensor(buffers[0], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
  for (const int64_t page : {kPage, int64_t{16}}) {
    const fc_tensor tk = device_tensor(buffers[1], FC_DTYPE_F16, {kPages, page, kHeads, kDim});
    const fc_tensor tv = device_tensor(buffers[2], FC_DTYPE_F16, {kPages, page, kHeads, kDim});
    fc_tensor to = device_tensor(buffers[3], FC_DTYPE_F16, {kTotalQ, kHeads, kDim});
    fc_tensor tl = device_tensor(lse, FC_DTYPE_F32, {kHeads, kTotalQ});
    const fc_tensor tcq = device_tensor(ints, FC_DTYPE_I32, {3});
    const fc_tensor tck = device_tensor(static_cast<int32_t*>(ints) + 3, FC_DTYPE_I32, {3});
    const fc_tensor tt = device_tensor(static_cast<int32_t*>(ints) + 6, FC_DTYPE_I32, {2, 2});
    fc_attention_options opt{};
    opt.cu_seqlens_q = &tcq;
    opt.cu_seqlens_k = &tck;
    opt.block_table = &tt;
    opt.max_seqlen_q = 20;
    opt.max_seqlen_k = 2 * page;
    opt.stream = mem.stream();
    // cu_seqlens_q, cu_seqlens_k, table: page ids past the pages and negative; lengths past the
    // table row; a decreasing cu_seqlens_k.
    const std::vector<std::vector<int32_t>> bad = {{0, 4, 24, 0, 300, 700, 5, 1, -3, 99},
                                                   {0, 20, 24, 0, 900, 950, 0, 1, 2, 0},
                                                   {0, 10, 24, 0, 400, 100, 2, 2, 1, 1}};
    for (fc_backend backend : {FC_BACKEND_CUDA_SM80, FC_BACKEND_CUDA_SM90}) {
      if (!fc_backend_available(backend, 0)) continue;
      opt.backend = backend;
      size_t workspace_bytes = 0;
      ASSERT_EQ(fc_attention_forward_workspace(&tq, &tk, &tv, &opt, &workspace_bytes), FC_OK) << fc_last_error();
      void* workspace = workspace_bytes ? mem.alloc(workspace_bytes) : nullptr;
      for (bool causal : {false, true}) {
        opt.causal = causal;
        for (const std::vector<int32_t>& values : bad) {
          mem.upload(ints, values.data(), values.size() * sizeof(int32_t));
          EXPECT_EQ(fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, workspace, workspace_bytes), FC_OK)
              << fc_last_error();
          EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(mem.stream())), cudaSuccess)
              << fc_backend_name(backend) << " " << ::testing::PrintToString(values);
        }
      }
      if (workspace) mem.release(workspace);
    }
  }
  for (void* b : buffers) mem.release(b);
  mem.release(lse);
  mem.release(ints);
}

// Small cases for compute-sanitizer runs (memcheck / racecheck are slow: keep them tiny).
TEST(CudaSanitizerSmall, ForwardAndBackward) {
  REQUIRE_GPU();
  CudaMemory mem;
  std::vector<Case> cases;
  for (bool causal : {false, true})
    for (int64_t d : {64, 128, 256}) {
      Case c;
      c.seqlen_q = 77;
      c.seqlen_k = 131;
      c.heads_q = 2;
      c.heads_kv = 1;
      c.head_dim = d;
      c.dtype = FC_DTYPE_BF16;
      c.causal = causal;
      cases.push_back(c);
    }
  Case v;
  v.varlen_q = {3, 0, 70};
  v.varlen_k = {90, 5, 0};
  v.heads_q = 2;
  v.head_dim = 64;
  cases.push_back(v);
  // d256 with softcap: the Hopper backward's role split stores X^T = P^T (1 - t^2) into the dS
  // tile for consumer 1, the path its d256 dropout kernels share (docs/DESIGN.md, "Dropout").
  Case capped = cases[2];
  capped.softcap = 30.f;
  capped.seqlen_q = 200;  // four query steps per GQA head: both dS buffers are reused
  cases.push_back(capped);
  // Two 128-row query blocks against 300 keys, causal at d64 / d128 / d256 and unmasked at d64:
  // scripts/gpu_check.sh runs the sanitizers with FLASHCORE_SM90_CLUSTER_PAIRS=1 and
  // FLASHCORE_SM90_WHOLE_HEADS=2, so the d128 / d256 ones run in cluster pairs (multicast loads,
  // remote arrivals, rank 0's blocks handed back uncomputed) and the d64 ones over whole heads
  // (K/V kept in the ring across a head's tiles); without the switches they take the usual kernels.
  for (int index : {0, 3, 4, 5}) {  // full d64; causal d64, d128, d256
    Case paired = cases[index];
    paired.seqlen_q = 250;
    paired.seqlen_k = 300;
    cases.push_back(paired);
  }
  // Causal pairs of query blocks on two SMs (sm_margin), at d64, d128 and d256 (whose first
  // consumer hands back the block above its diagonal uncomputed). 640 tokens: more keys than whole
  // heads take, and five query blocks, which cluster pairs (forced in the sanitizer runs) cannot
  // split.
  for (int index : {3, 4, 5}) {
    Case shared = cases[index];
    shared.seqlen_q = shared.seqlen_k = 640;
    shared.sm_margin = 130;
    cases.push_back(shared);
  }
  uint64_t seed = 9;
  const bool sm90 = fc_backend_available(FC_BACKEND_CUDA_SM90, 0);
  for (const Case& c : cases) {
    CheckResult r = check_forward(c, FC_BACKEND_CUDA_SM80, mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
    if (sm90) {
      r = check_forward(c, FC_BACKEND_CUDA_SM90, mem, seed++);
      EXPECT_TRUE(r.ok) << "sm90 " << c.name() << "\n" << r.summary();
    }
    r = check_backward(c, FC_BACKEND_CUDA_SM80, mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
    if (sm90) {
      r = check_backward(c, FC_BACKEND_CUDA_SM90, mem, seed++);
      EXPECT_TRUE(r.ok) << "sm90 " << c.name() << "\n" << r.summary();
    }
  }
}

}  // namespace
}  // namespace flashcore::testing
