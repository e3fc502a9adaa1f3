// CUDA tests of the inference path against the fp64 oracle of tests/common/kvcache_check.hpp:
// the CPU suite's grid (contiguous / paged 1-16-64-256, cache_batch_idx, append, causal, window,
// softcap, GQA/MQA) on device memory with 1, 5 and heuristic splits (and up to 24 at the decode
// target's shape), head dims 64/128/256 and a padded one, long paged sequences (block-table
// batches), fc_merge_partials on the GPU, the device-side checks of cache indices (error_flag, NaN
// rows, no out-of-bounds access - run under compute-sanitizer memcheck), cache_leftpad and rotary
// tables (the CPU suite's cases, and their device-side checks), and CUDA-graph capture and replay
// (two graphs of one split-KV call on one workspace, replayed in turn).
// Every test skips when no GPU is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/kvcache_check.hpp"
#include "flashcore/flashcore.hpp"
#include "cuda/cuda_memory.hpp"

namespace flashcore::testing {
namespace {

bool have_gpu() { return fc_cuda_device_count() > 0 && fc_backend_available(FC_BACKEND_CUDA_SM80, 0); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU with sm_80+ present: CUDA tests skipped"

void expect_cases(std::vector<KvCase> cases, const std::vector<int32_t>& splits, uint64_t seed) {
  CudaMemory mem;
  for (KvCase c : cases)
    for (int32_t s : splits) {
      c.num_splits = s;
      const std::string err = run_kvcache_case(c, mem, seed++);
      EXPECT_TRUE(err.empty()) << c.name() << ": " << err;
    }
}

TEST(CudaKvCache, Grid) {
  REQUIRE_GPU();
  expect_cases(kvcache_grid({FC_DTYPE_F16, FC_DTYPE_BF16}, {64, 128}), {1, 5, 0}, 1);
}

TEST(CudaKvCache, HeadDims) {
  REQUIRE_GPU();
  std::vector<KvCase> cases;
  for (int64_t hd : {40, 96, 256}) {
    KvCase c;
    c.head_dim = hd;
    c.batch = 2;
    c.cache_lens = {513, 90};
    c.heads_q = 6;
    c.heads_kv = 2;
    c.page_size = 16;
    c.seqlen_new = 1;
    cases.push_back(c);
  }
  expect_cases(cases, {1, 3, 0}, 100);
}

TEST(CudaKvCache, TargetShapesSmall) {
  REQUIRE_GPU();
  // The decode target's shape (GQA 32/8, d=128, bf16) at short lengths, contiguous and paged.
  std::vector<KvCase> cases;
  for (int64_t page : {0, 16, 256}) {
    KvCase c;
    c.dtype = FC_DTYPE_BF16;
    c.head_dim = 128;
    c.heads_q = 32;
    c.heads_kv = 8;
    c.batch = 4;
    c.cache_lens = {4095, 1000, 1, 2048};
    c.page_size = page;
    c.seqlen_new = 1;
    cases.push_back(c);
  }
  expect_cases(cases, {0, 1, 8, 16, 17, 24}, 200);
}

// sm_margin leaves SMs to concurrent work: the decode plan splits for fewer SMs (its workspace, the
// partials, shrinks when one SM is left) and the KV-cache route's forward sizes its grid for them;
// results stay within the reference's tolerance.
TEST(CudaKvCache, SmMargin) {
  REQUIRE_GPU();
  KvCase decode;  // one long sequence: split-KV (the heuristic's count)
  decode.dtype = FC_DTYPE_BF16;
  decode.head_dim = 128;
  decode.heads_q = 32;
  decode.heads_kv = 8;
  decode.cache_lens = {20000};
  decode.seqlen_new = 1;
  decode.num_splits = 0;
  {
    CudaMemory mem;
    KvProblem pr(decode, mem, 650);
    size_t every_sm = 0, one_sm = 0;
    ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &every_sm), FC_OK) << fc_last_error();
    pr.opt.sm_margin = 100000;
    ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &one_sm), FC_OK) << fc_last_error();
    EXPECT_GT(every_sm, 0u) << "one sequence of 20000 keys was expected to split";
    EXPECT_LT(one_sm, every_sm);
  }
  std::vector<KvCase> cases;
  for (int32_t margin : {8, 100, 100000}) {
    decode.sm_margin = margin;
    KvCase prefill = decode;  // 64 query rows per KV head: the forward route
    prefill.batch = 2;
    prefill.cache_lens = {3000, 700};
    prefill.seqlen_new = 0;
    prefill.seqlen_q = 16;
    prefill.causal = true;
    cases.push_back(decode);
    cases.push_back(prefill);
  }
  expect_cases(cases, {0}, 700);
}

TEST(CudaKvCache, BothWarpCounts) {
  REQUIRE_GPU();
  // On Hopper d64 / d128 calls run 8-warp CTAs where one wave of them fills the SMs (batch 2 x 8 KV
  // heads, or a caller's split count whose CTAs make one wave: 24 x 5) and 4-warp CTAs elsewhere
  // (batch 3's 24 CTAs with the heuristic's splits, 24 x 6 CTAs): the batch-3 shapes run both
  // kernels, the batch-2 ones 8 warps with and without splits (decode/split_heuristic.hpp:
  // eight_warp_ctas_suit). Other GPUs run 4 warps throughout.
  // d64 runs twice: one token (read in head pairs, cuda/decode/head_pairs.hpp: the 128-wide
  // kernels over half the CTAs) and three (24 rows a pair: the d64 kernels themselves).
  std::vector<KvCase> cases;
  for (int64_t hd : {64, 128}) {
    for (int64_t batch : {2, 3}) {
      for (int64_t seqlen_q : {1, 3}) {
        if (hd == 128 && seqlen_q == 3) continue;
        KvCase c;
        c.dtype = hd == 64 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
        c.head_dim = hd;
        c.heads_q = 32;
        c.heads_kv = 8;
        c.batch = batch;
        c.seqlen_q = seqlen_q;
        c.causal = seqlen_q > 1;
        c.cache_lens = batch == 2 ? std::vector<int32_t>{3000, 17} : std::vector<int32_t>{2500, 0, 1777};
        c.page_size = batch == 2 ? 16 : 0;
        c.seqlen_new = seqlen_q;
        cases.push_back(c);
      }
    }
  }
  expect_cases(cases, {0, 1, 5, 6}, 300);
}

/** Head dim 64 read in head pairs (cuda/decode/head_pairs.hpp: two adjacent KV heads as one
 *  128-wide row, the 128-wide kernel, each query row's output from its own half): pairs whose
 *  query rows fill a CTA exactly (GQA 8, GQA 4 x 2 causal tokens), three pairs, MHA with a window
 *  and softcap, appends with rotary tables, permuted cache rows and pages of 16 / 256, 40
 *  sequences (the 4-warp kernels on Hopper, whose small grids take 8 warps), beside d64 calls that
 *  stay on single heads (24 rows a pair, odd KV heads). */
TEST(CudaKvCache, HeadPairs) {
  REQUIRE_GPU();
  std::vector<KvCase> cases;
  auto base = [](int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t page) {
    KvCase c;
    c.head_dim = 64;
    c.heads_q = heads_q;
    c.heads_kv = heads_kv;
    c.seqlen_q = seqlen_q;
    c.batch = 3;
    c.cache_lens = {700, 1, 2100};
    c.page_size = page;
    c.seqlen_new = 1;
    return c;
  };
  for (int64_t page : {0, 16, 256}) {
    cases.push_back(base(64, 8, 1, page));  // 16 rows a pair
    KvCase two = base(32, 8, 2, page);       // 16 rows a pair, causal
    two.seqlen_new = 2;
    two.causal = true;
    two.dtype = FC_DTYPE_F16;
    cases.push_back(two);
    KvCase mha = base(6, 6, 1, page);  // three pairs
    mha.window_left = 300;
    mha.softcap = 20;
    cases.push_back(mha);
  }
  KvCase rot = base(8, 4, 1, 0);
  rot.rotary_half = 16;
  rot.batch_idx = true;
  cases.push_back(rot);
  for (int64_t page : {0, 16}) {  // 40 sequences x 4 pairs: more CTAs than SMs, the 4-warp kernels
    KvCase many = base(32, 8, 1, page);
    many.batch = 40;
    many.cache_lens.clear();
    for (int32_t b = 0; b < 40; ++b) many.cache_lens.push_back(37 * b % 700);
    many.dtype = page == 0 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    cases.push_back(many);
  }
  cases.push_back(base(32, 8, 3, 0));  // 24 rows a pair: single heads
  cases.push_back(base(12, 3, 1, 16));  // odd KV heads: single heads
  expect_cases(cases, {1, 3, 0}, 7000);
}

/** cache_seqlens = NULL on the GPU: every sequence fills its cache, the same bits as the lengths
 *  given (the decode kernel's cache_end; d64 pairs and d128, both dtypes). */
TEST(CudaKvCache, FullCachesWithoutLengths) {
  REQUIRE_GPU();
  CudaMemory mem;
  uint64_t seed = 950;
  for (int32_t dt : {FC_DTYPE_F16, FC_DTYPE_BF16})
    for (int64_t hd : {int64_t(64), int64_t(128)})
      for (const KvCase& c : full_cache_cases(dt, hd)) {
        const std::string err = run_full_cache_without_lengths(c, mem, seed++);
        EXPECT_TRUE(err.empty()) << c.name() << ": " << err;
      }
}

TEST(CudaKvCache, LongPagedTables) {
  REQUIRE_GPU();
  // Pages of 16+ keys (powers of two) read the block table in batches of 32 tiles per warp, the
  // next batch prefetched: long sequences with few splits cross several batches, a window makes
  // the key range start past 0, and pages of 48 (not a power of two) take the per-key lookups.
  std::vector<KvCase> cases;
  for (int64_t page : {16, 32, 64, 256, 48}) {
    for (bool window : {false, true}) {
      KvCase c;
      c.dtype = page == 32 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
      c.head_dim = 128;
      c.heads_q = 8;
      c.heads_kv = 2;
      c.batch = 3;
      c.seqlen_q = window ? 2 : 1;
      c.cache_lens = {4100, 2500, 17};
      c.page_size = page;
      c.seqlen_new = 1;
      c.causal = window;
      if (window) c.window_left = 3000;
      cases.push_back(c);
    }
  }
  expect_cases(cases, {1, 2, 0}, 300);
}

TEST(CudaKvCache, ManySequences) {
  REQUIRE_GPU();
  // A large grid (split x KV head x row chunk x sequence: two waves of CTAs and more) over
  // sequences of 0 to ~700 keys (CTAs whose warps have no tile, CTAs of one partial tile), two row
  // chunks per KV head (GQA 4 x 5 query tokens), contiguous with permuted rows and paged (16 and 48
  // keys). Sized to keep the fp64 oracle to seconds.
  std::vector<KvCase> cases;
  for (int64_t page : {0, 16, 48}) {
    KvCase c;
    c.dtype = page == 48 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    c.head_dim = page == 16 ? 64 : 128;
    c.heads_q = 32;
    c.heads_kv = 8;
    c.batch = 24;
    for (int64_t b = 0; b < c.batch; ++b) c.cache_lens.push_back(static_cast<int32_t>((b * 397) % 700 + (b % 7 == 0 ? 0 : 1)));
    c.cache_lens[3] = 0;
    c.cache_lens[4] = 15;
    c.cache_lens[5] = 16;
    c.cache_lens[6] = 17;
    c.page_size = page;
    c.batch_idx = page == 0;
    c.seqlen_q = 5;
    c.seqlen_new = 5;
    c.causal = true;
    cases.push_back(c);
    KvCase d = c;  // one query token, a window, softcap
    d.seqlen_q = 1;
    d.seqlen_new = 1;
    d.causal = false;
    d.window_left = 700;
    d.window_right = 0;
    d.softcap = 20;
    cases.push_back(d);
  }
  expect_cases(cases, {1, 0}, 400);
  // d256 (Q in shared memory) and many splits of short sequences (empty splits).
  KvCase e;
  e.head_dim = 256;
  e.heads_q = 8;
  e.heads_kv = 8;
  e.batch = 24;
  for (int64_t b = 0; b < e.batch; ++b) e.cache_lens.push_back(static_cast<int32_t>(b * 61 % 700));
  e.page_size = 16;
  e.seqlen_new = 1;
  expect_cases({e}, {1, 7}, 500);
}

/** Runs a 3-sequence problem whose sequences 1 and 2 carry bad values on the device: the call
 *  succeeds, sets the error flag, leaves sequence 0's results and caches exact, gives NaN rows (out
 *  and lse) for the others and appends nothing for them. */
void expect_later_sequences_flagged(KvProblem& pr, CudaMemory& mem) {
  int32_t* flag = static_cast<int32_t*>(mem.alloc(sizeof(int32_t)));
  const int32_t zero = 0;
  mem.upload(flag, &zero, sizeof(zero));
  pr.args.error_flag = flag;
  ASSERT_EQ(pr.run(mem), FC_OK) << fc_last_error();
  int32_t flag_value = 0;
  mem.download(&flag_value, flag, sizeof(flag_value));
  mem.release(flag);
  EXPECT_EQ(flag_value, 1);
  pr.fetch();
  EXPECT_EQ(check_kvcache_result(pr, 1), "") << "sequence 0 must be unaffected";
  const KvCase& c = pr.c;
  const int64_t per_seq = c.seqlen_q * c.heads_q * c.head_dim;
  for (int64_t i = per_seq; i < 3 * per_seq; ++i) ASSERT_TRUE(std::isnan(pr.out.get(i))) << "out[" << i << "]";
  for (int64_t i = c.heads_q * c.seqlen_q; i < pr.lse.numel(); ++i) ASSERT_TRUE(std::isnan(pr.lse.get(i)));
}

TEST(CudaKvCache, DeviceSideIndexChecks) {
  REQUIRE_GPU();
  CudaMemory mem;
  KvCase c;
  c.batch = 3;
  c.cache_lens = {40, 33, 20};
  c.heads_q = 4;
  c.heads_kv = 2;
  c.page_size = 16;
  c.seqlen_new = 1;
  c.num_splits = 3;
  for (int32_t splits : {1, 3, 20, 64}) {  // 64: more CTAs than SMs, most of them without keys
    c.num_splits = splits;
    KvProblem pr(c, mem, 9);
    // Sequence 1: the page its new token goes to is out of range. Sequence 2: length beyond capacity.
    pr.block_table.ints()[1 * pr.pages_per_seq + c.cache_lens[1] / c.page_size] = static_cast<int32_t>(pr.cache_rows + 7);
    pr.seqlens.ints()[2] = static_cast<int32_t>(pr.capacity + 1000);
    pr.upload_indices();
    expect_later_sequences_flagged(pr, mem);
  }
}

TEST(CudaKvCache, LeftPadAndRotary) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  for (int32_t dt : {FC_DTYPE_F16, FC_DTYPE_BF16})
    for (int64_t hd : {int64_t(64), int64_t(128)}) expect_cases(leftpad_rotary_cases(dt, hd), {1, 4, 0}, seed += 50);
}

TEST(CudaKvCache, LeftPadAndRotaryDeviceSideChecks) {
  REQUIRE_GPU();
  CudaMemory mem;
  KvCase c;
  c.batch = 3;
  c.cache_lens = {20, 33, 40};
  c.leftpad = {2, 5, 0};
  c.heads_q = 4;
  c.heads_kv = 2;
  c.seqlen_new = 2;
  c.seqlen_q = 2;
  c.causal = true;
  c.rotary_half = 8;
  for (int32_t splits : {1, 3}) {
    c.num_splits = splits;
    KvProblem pr(c, mem, 19);
    // Sequence 1: left padding past its cache_seqlens. Sequence 2: rotary positions past the
    // tables (the tables shortened to end one row before sequence 2's last new key).
    pr.leftpad.ints()[1] = pr.seqlens.ints()[1] + 1;
    pr.upload_indices();
    pr.tcos.shape[0] = pr.tsin.shape[0] = pr.seqlens.ints()[2] + 1;
    ASSERT_GT(pr.tcos.shape[0], pr.seqlens.ints()[0] + 2) << "sequence 0 must stay inside the tables";
    expect_later_sequences_flagged(pr, mem);
  }
}

/** A chunked prefill the forward-kernel route takes: 520 query rows per KV head (GQA 4), 96
 *  blocks of 128 rows over 3 sequences, appending as many tokens as it queries. */
KvCase prefill_case(std::vector<int32_t> cache_lens, int64_t page_size) {
  KvCase c;
  c.batch = 3;
  c.cache_lens = std::move(cache_lens);
  c.heads_q = 16;
  c.heads_kv = 4;
  c.seqlen_q = 130;
  c.seqlen_new = 130;
  c.causal = true;
  c.page_size = page_size;
  return c;
}

/** Many query rows per KV head (chunked prefill into the cache): the forward-kernel route
 *  (cuda/decode/prefill_route.hpp) over every cache layout. On a Hopper GPU the sm90 forward takes
 *  them all (contiguous rows and 128 / 256-key pages in place, 16-key pages gathered); elsewhere
 *  sm80 takes contiguous and 256-key caches and the decode kernel the others. */
TEST(CudaKvCache, PrefillRoute) {
  REQUIRE_GPU();
  std::vector<KvCase> cases;
  for (int32_t dt : {FC_DTYPE_F16, FC_DTYPE_BF16})
    for (int64_t page : {int64_t(0), int64_t(16), int64_t(128), int64_t(256)}) {
      KvCase c = prefill_case({0, 100, 300}, page);
      c.dtype = dt;
      c.head_dim = dt == FC_DTYPE_BF16 ? 128 : 64;
      cases.push_back(c);
      KvCase w = c;  // queries past the new keys, window + softcap, no append
      w.seqlen_new = 0;
      w.causal = false;
      w.window_left = 70;
      w.window_right = 5;
      w.softcap = 20;
      cases.push_back(w);
      if (page == 0) {
        KvCase pad = c;  // left padding, rows through cache_batch_idx, rotary (NeoX, part of d)
        pad.leftpad = {3, 0, 40};
        pad.seqlen_new = 100;
        pad.batch_idx = true;
        pad.rotary_half = 12;
        pad.rotary_interleaved = false;
        cases.push_back(pad);
      } else {
        KvCase r = c;  // rotary on a paged cache, GQA 8
        r.heads_kv = 2;
        r.rotary_half = c.head_dim / 2;
        cases.push_back(r);
      }
    }
  expect_cases(cases, {0, 3}, 900);
  // The route is taken: its prefix sums need a workspace where the decode kernel without splits
  // and rotary needs none.
  CudaMemory mem;
  KvCase c = cases[0];
  c.num_splits = 1;
  KvProblem pr(c, mem, 5);
  size_t bytes = 0;
  ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &bytes), FC_OK) << fc_last_error();
  EXPECT_GT(bytes, 0u);
  c.seqlen_q = c.seqlen_new = 1;  // and not taken for a decode step
  KvProblem decode(c, mem, 5);
  ASSERT_EQ(fc_attention_kvcache_workspace(&decode.args, &decode.opt, &bytes), FC_OK) << fc_last_error();
  EXPECT_EQ(bytes, 0u);

  // Short chunks over many sequences: 8 query tokens x GQA 4 = 32 rows per KV head in 160 tiles.
  // The Hopper forward packs the group (sm90/pack_gqa.hpp) and the route takes them there; other
  // GPUs keep the decode kernel.
  KvCase s;
  s.batch = 40;
  for (int b = 0; b < 40; ++b) s.cache_lens.push_back((b * 37) % 500);
  s.heads_q = 16;
  s.heads_kv = 4;
  s.head_dim = 128;
  s.dtype = FC_DTYPE_BF16;
  s.seqlen_q = s.seqlen_new = 8;
  s.causal = true;
  expect_cases({s}, {0}, 950);
  if (fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) {
    s.num_splits = 1;
    KvProblem chunks(s, mem, 5);
    ASSERT_EQ(fc_attention_kvcache_workspace(&chunks.args, &chunks.opt, &bytes), FC_OK) << fc_last_error();
    EXPECT_GT(bytes, 0u) << "short GQA chunks over many sequences did not take the packed forward route";
  }
}

/** c (a contiguous prefill_case) with left padding, rows through cache_batch_idx and a window. */
KvCase left_padded(KvCase c) {
  c.leftpad = {3, 0, 40};
  c.batch_idx = true;
  c.window_left = 90;
  c.window_right = 0;
  return c;
}

/** ALiBi slopes on the decode kernel, with and without splits; calls with many query rows on the
 *  forward-kernel route, over contiguous and paged caches and with left padding (the bias counts
 *  keys from the first one after the padding, as the decode kernel does). */

TEST(CudaKvCache, Alibi) {
  REQUIRE_GPU();
  uint64_t seed = 3000;
  for (int32_t dt : {FC_DTYPE_F16, FC_DTYPE_BF16})
    for (int64_t hd : {int64_t(64), int64_t(128), int64_t(256)}) expect_cases(alibi_cases(dt, hd), {1, 4, 0}, seed += 50);
  std::vector<KvCase> long_chunks;
  for (int64_t page : {int64_t(0), int64_t(16), int64_t(256)}) {
    KvCase c = prefill_case({0, 100, 300}, page);
    c.dtype = page == 16 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    c.head_dim = page == 256 ? 64 : 128;
    c.alibi = page == 16 ? 1 : 2;
    long_chunks.push_back(c);
    if (page == 0) long_chunks.push_back(left_padded(c));
  }
  expect_cases(long_chunks, {0, 3}, 4000);
  // The route is taken: its prefix sums need a workspace where the decode kernel without splits
  // needs none.
  CudaMemory mem;
  KvCase c = long_chunks[0];
  c.num_splits = 1;
  KvProblem pr(c, mem, 5);
  size_t bytes = 0;
  ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &bytes), FC_OK) << fc_last_error();
  EXPECT_GT(bytes, 0u) << "an ALiBi call with many query rows stayed on the decode kernel";
}

// backend cuda_sm80 asks for the portable kernels only: calls with many query rows run sm80's
// forward on the route (contiguous caches, with cache_leftpad and ALiBi; 256-key pages) or the
// decode kernel (pages sm80's forward does not read) even on a Hopper GPU, where auto takes the
// Hopper forward. So sm80's route is checked on every GPU the tests run on.
TEST(CudaKvCache, PortableKernelsOnRequest) {
  REQUIRE_GPU();
  std::vector<KvCase> cases;
  for (int64_t page : {int64_t(0), int64_t(16), int64_t(256)}) {
    KvCase c = prefill_case({0, 100, 300}, page);
    c.backend = FC_BACKEND_CUDA_SM80;
    c.dtype = page == 16 ? FC_DTYPE_F16 : FC_DTYPE_BF16;
    c.head_dim = page == 256 ? 64 : 128;
    cases.push_back(c);
    KvCase a = c;
    a.alibi = page == 16 ? 1 : 2;
    cases.push_back(a);
    if (page == 0) {
      cases.push_back(left_padded(a));
      KvCase capped = c;  // no append, softcap
      capped.seqlen_new = 0;
      capped.softcap = 12;
      capped.dtype = FC_DTYPE_F16;
      cases.push_back(capped);
    }
  }
  expect_cases(cases, {0, 3}, 5000);
  // Which kernels took them, read from the workspace of an unsplit call: the route's arrays (its
  // prefix sums) where sm80's forward takes the call; none on the decode kernel, unsplit. On
  // Hopper, auto also gathers the 16-key pages of an ALiBi call for its forward, where the
  // portable kernels leave that call on the decode kernel.
  CudaMemory mem;
  const bool hopper = fc_backend_available(FC_BACKEND_CUDA_SM90, 0);
  for (KvCase c : cases) {
    c.num_splits = 1;
    size_t portable = 0, automatic = 0;
    KvProblem pr(c, mem, 7);
    ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &portable), FC_OK) << fc_last_error();
    pr.opt.backend = FC_BACKEND_AUTO;
    ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &automatic), FC_OK) << fc_last_error();
    if (c.page_size == 16) {
      EXPECT_EQ(portable, 0u) << c.name() << ": not on the decode kernel";
      if (hopper && c.alibi > 0) EXPECT_GT(automatic, 0u) << c.name() << ": auto did not gather the pages";
    } else {
      EXPECT_GT(portable, 0u) << c.name() << ": not on sm80's forward route";
    }
  }
}

TEST(CudaKvCache, PrefillRouteDeviceSideChecks) {
  REQUIRE_GPU();
  CudaMemory mem;
  for (int64_t page : {int64_t(0), int64_t(256)}) {
    const KvCase c = prefill_case({40, 33, 20}, page);
    KvProblem pr(c, mem, 23);
    // Sequence 1: length beyond capacity; sequence 2: a page out of range (paged) or a cache row
    // out of range (contiguous, through cache_batch_idx made explicit below).
    pr.seqlens.ints()[1] = static_cast<int32_t>(pr.capacity + 5);
    if (page > 0) {
      pr.block_table.ints()[2 * pr.pages_per_seq] = static_cast<int32_t>(pr.cache_rows + 1);
    } else {
      pr.seqlens.ints()[2] = -4;
    }
    pr.upload_indices();
    expect_later_sequences_flagged(pr, mem);
  }
}

TEST(CudaKvCache, RejectsHostIndicesAndMixedDevices) {
  REQUIRE_GPU();
  CudaMemory mem;
  KvCase c;
  c.cache_lens = {10};
  KvProblem pr(c, mem, 3);
  std::vector<int32_t> host_lens = {10};
  fc_tensor host = pr.tlens;
  host.data = host_lens.data();
  host.device_type = FC_DEVICE_CPU;
  pr.args.cache_seqlens = &host;
  EXPECT_EQ(fc_attention_kvcache(&pr.args, &pr.opt, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(fc_last_error()).rfind("cache_seqlens:", 0), 0u) << fc_last_error();
}

TEST(CudaKvCache, GraphCapture) {
  REQUIRE_GPU();
  CudaMemory mem;
  KvCase c;
  c.batch = 2;
  c.cache_lens = {3000, 100};
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.page_size = 64;
  c.num_splits = 0;
  KvProblem pr(c, mem, 21);
  size_t ws = 0;
  ASSERT_EQ(fc_attention_kvcache_workspace(&pr.args, &pr.opt, &ws), FC_OK) << fc_last_error();
  ASSERT_GT(ws, 0u) << "the heuristic should split this call";
  void* w = mem.alloc(ws);
  cudaStream_t stream = static_cast<cudaStream_t>(mem.stream());
  // Two captures of the same split-KV call on the same workspace, replayed in turn: every replay
  // rewrites every output (poisoned before each) through the partials and the combine.
  cudaGraph_t graphs[2] = {nullptr, nullptr};
  cudaGraphExec_t execs[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    const fc_status st = fc_attention_kvcache(&pr.args, &pr.opt, w, ws);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graphs[i]), cudaSuccess);
    ASSERT_EQ(st, FC_OK) << fc_last_error();
    ASSERT_EQ(cudaGraphInstantiate(&execs[i], graphs[i], 0), cudaSuccess);
  }
  for (int replay = 0; replay < 5; ++replay) {
    for (KvBuffer* t : {&pr.out, &pr.lse}) {  // poison again: every replay must write every value
      std::fill(t->host.begin(), t->host.end(), uint8_t{0xFF});
      t->upload();
    }
    ASSERT_EQ(cudaGraphLaunch(execs[replay == 2 || replay == 3 ? 1 : 0], stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    pr.fetch();
    EXPECT_EQ(check_kvcache_result(pr), "") << "replay " << replay;
  }
  for (int i = 0; i < 2; ++i) {
    cudaGraphExecDestroy(execs[i]);
    cudaGraphDestroy(graphs[i]);
  }
  mem.release(w);
}

/** Split calls take their partials from the caller's workspace, whatever it held before (all ones,
 *  random bytes, zeros, what another shape's split call left there): every call writes every
 *  output, call after call, d128 and d64 (head pairs) sharing one workspace. */
TEST(CudaKvCache, SplitCallsOnAnyWorkspace) {
  REQUIRE_GPU();
  CudaMemory mem;
  std::vector<KvCase> cases(2);
  cases[0].batch = 3;
  cases[0].cache_lens = {4000, 1, 2500};
  cases[0].heads_q = 8;
  cases[0].heads_kv = 2;
  cases[0].head_dim = 128;
  cases[0].num_splits = 7;
  cases[1] = cases[0];
  cases[1].head_dim = 64;  // head pairs: other groups, another word count
  cases[1].heads_q = 16;
  cases[1].heads_kv = 4;
  cases[1].num_splits = 0;
  std::vector<std::unique_ptr<KvProblem>> problems;  // (a problem's arguments point into itself)
  size_t ws = 0;
  for (size_t n = 0; n < cases.size(); ++n) {
    problems.push_back(std::make_unique<KvProblem>(cases[n], mem, 40 + n));
    size_t bytes = 0;
    ASSERT_EQ(fc_attention_kvcache_workspace(&problems[n]->args, &problems[n]->opt, &bytes), FC_OK) << fc_last_error();
    ASSERT_GT(bytes, 0u) << cases[n].name() << ": the call should split";
    ws = std::max(ws, bytes);
  }
  void* w = mem.alloc(ws);
  std::vector<uint8_t> fill(ws);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int round = 0; round < 4; ++round) {
    if (round < 3) {  // round 3 keeps what the calls before left
      for (size_t i = 0; i < ws; ++i) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        fill[i] = round == 0 ? uint8_t{0xFF} : round == 1 ? uint8_t(state >> 56) : uint8_t{0};
      }
      ASSERT_EQ(cudaMemcpy(w, fill.data(), ws, cudaMemcpyHostToDevice), cudaSuccess);
    }
    for (int call = 0; call < 3; ++call)
      for (auto& problem : problems) {
        KvProblem& pr = *problem;
        for (KvBuffer* t : {&pr.out, &pr.lse}) {
          std::fill(t->host.begin(), t->host.end(), uint8_t{0xFF});
          t->upload();
        }
        ASSERT_EQ(fc_attention_kvcache(&pr.args, &pr.opt, w, ws), FC_OK) << fc_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        pr.fetch();
        EXPECT_EQ(check_kvcache_result(pr), "") << pr.c.name() << ", round " << round << ", call " << call;
      }
  }
  mem.release(w);
}

/** fc_merge_partials on the GPU against the CPU's on the same partials: `parts` parts of
 *  (batch, seqlen_q, heads, head_dim); row (b 1, i 0, h 0) is empty in every part (0 / -inf), and
 *  with `poison` one part of row (b 0, i 1, h 2) has a NaN LSE (the row becomes NaN) and row
 *  (b 1, i 1, h 1) has only its last part non-empty. */
void expect_gpu_merge_matches_cpu(int64_t parts, int64_t head_dim, bool poison) {
  constexpr int64_t kBatch = 2, kSq = 2, kHeads = 3;
  const int64_t kHd = head_dim;
  std::vector<float> op(parts * kBatch * kSq * kHeads * kHd), lp(parts * kBatch * kHeads * kSq);
  for (size_t i = 0; i < op.size(); ++i) op[i] = std::sin(0.37 * i);
  for (size_t i = 0; i < lp.size(); ++i) lp[i] = 4 * std::cos(1.3 * i);
  auto lse_at = [&](int64_t s, int64_t b, int64_t i, int64_t h) -> float& {
    return lp[((s * kBatch + b) * kHeads + h) * kSq + i];
  };
  for (int64_t s = 0; s < parts; ++s) lse_at(s, 1, 0, 0) = -INFINITY;  // one empty row
  if (poison) {
    lse_at(parts / 2, 0, 1, 2) = NAN;
    for (int64_t s = 0; s + 1 < parts; ++s) lse_at(s, 1, 1, 1) = -INFINITY;
  }
  CudaMemory mem;
  std::vector<float> cpu_out(kBatch * kSq * kHeads * kHd), cpu_lse(kBatch * kHeads * kSq);
  fc_tensor hop = flashcore::make_tensor(op.data(), FC_DTYPE_F32, {parts, kBatch * kSq, kHeads, kHd});
  fc_tensor hlp = flashcore::make_tensor(lp.data(), FC_DTYPE_F32, {parts, kBatch, kHeads, kSq});
  fc_tensor hout = flashcore::make_tensor(cpu_out.data(), FC_DTYPE_F32, {kBatch, kSq, kHeads, kHd});
  fc_tensor hlse = flashcore::make_tensor(cpu_lse.data(), FC_DTYPE_F32, {kBatch, kHeads, kSq});
  ASSERT_EQ(fc_merge_partials(&hop, &hlp, &hout, &hlse, nullptr), FC_OK) << fc_last_error();
  void* dop = mem.alloc(op.size() * 4);
  void* dlp = mem.alloc(lp.size() * 4);
  void* dout = mem.alloc(cpu_out.size() * 4);
  void* dlse = mem.alloc(cpu_lse.size() * 4);
  mem.upload(dop, op.data(), op.size() * 4);
  mem.upload(dlp, lp.data(), lp.size() * 4);
  fc_tensor gop = flashcore::make_tensor(dop, FC_DTYPE_F32, {parts, kBatch * kSq, kHeads, kHd}, FC_DEVICE_CUDA);
  fc_tensor glp = flashcore::make_tensor(dlp, FC_DTYPE_F32, {parts, kBatch, kHeads, kSq}, FC_DEVICE_CUDA);
  fc_tensor gout = flashcore::make_tensor(dout, FC_DTYPE_F32, {kBatch, kSq, kHeads, kHd}, FC_DEVICE_CUDA);
  fc_tensor glse = flashcore::make_tensor(dlse, FC_DTYPE_F32, {kBatch, kHeads, kSq}, FC_DEVICE_CUDA);
  fc_attention_options opt{};
  opt.stream = mem.stream();
  ASSERT_EQ(fc_merge_partials(&gop, &glp, &gout, &glse, &opt), FC_OK) << fc_last_error();
  std::vector<float> gpu_out(cpu_out.size()), gpu_lse(cpu_lse.size());
  mem.download(gpu_out.data(), dout, gpu_out.size() * 4);
  mem.download(gpu_lse.data(), dlse, gpu_lse.size() * 4);
  int nan_rows = 0;
  for (size_t i = 0; i < cpu_out.size(); ++i) {
    if (std::isnan(cpu_out[i])) {
      EXPECT_TRUE(std::isnan(gpu_out[i])) << "parts " << parts << ", element " << i;
      continue;
    }
    EXPECT_NEAR(gpu_out[i], cpu_out[i], 1e-5) << "parts " << parts << ", element " << i;
  }
  for (size_t i = 0; i < cpu_lse.size(); ++i) {
    nan_rows += std::isnan(cpu_lse[i]);
    if (std::isnan(cpu_lse[i]) || std::isinf(cpu_lse[i]))
      EXPECT_TRUE(std::isnan(cpu_lse[i]) ? std::isnan(gpu_lse[i]) : gpu_lse[i] == cpu_lse[i]) << "parts " << parts << ", row " << i;
    else
      EXPECT_LT(std::fabs(gpu_lse[i] - cpu_lse[i]), 1e-5) << "parts " << parts << ", row " << i;
  }
  EXPECT_EQ(nan_rows, poison ? 1 : 0);  // the poisoned row, and only it
  for (void* p : {dop, dlp, dout, dlse}) mem.release(p);
}

TEST(CudaMergePartials, MatchesCpu) {
  REQUIRE_GPU();
  expect_gpu_merge_matches_cpu(5, 40, false);
  expect_gpu_merge_matches_cpu(5, 40, true);
  // Past one batch of parts (DecodeTraits::kMergeBatch) the merge splits a row's parts over its
  // CTA's warps, warp w taking batches w, w + 4, ...: 17 parts leave warps 2-3 nothing and warp 1
  // one part (in the poisoned rows, the only non-empty one); 70 give warp 0 a second, partial
  // batch (parts 64-69: a rescale inside a warp). head_dim 256 takes two column passes.
  for (int64_t parts : {17, 70})
    for (int64_t hd : {64, 256}) expect_gpu_merge_matches_cpu(parts, hd, true);
}

}  // namespace
}  // namespace flashcore::testing
