// CPU tests of the inference path (fc_attention_kvcache, fc_merge_partials) against the fp64
// oracle of tests/common/kvcache_check.hpp: contiguous and paged caches (page sizes 1/16/64/256),
// cache_batch_idx, in-place append, causal with seqlen_q > 1, windows, softcap, GQA/MQA, split-KV
// (1..8 splits agree), many KV heads (short staged blocks), ALiBi, the forward route of calls with
// many query rows, thread-count independence, merge of
// partials incl. all -inf parts, and every bad input (the message names the argument; outputs and
// caches stay untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "api/dispatch.hpp"
#include "common/kvcache_check.hpp"
#include "flashcore/flashcore.hpp"

namespace flashcore::testing {
namespace {

std::vector<int32_t> all_dtypes() { return {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16}; }

void expect_cases(const std::vector<KvCase>& cases, uint64_t seed) {
  auto mem = host_memory();
  for (const KvCase& c : cases) {
    const std::string err = run_kvcache_case(c, *mem, seed++);
    EXPECT_TRUE(err.empty()) << c.name() << ": " << err;
  }
}

TEST(KvCacheCpu, Grid) { expect_cases(kvcache_grid(all_dtypes(), {64, 59}), 1); }

TEST(KvCacheCpu, SplitsAgree) {
  std::vector<KvCase> cases;
  for (int32_t splits = 0; splits <= 8; ++splits) {
    KvCase c;
    c.batch = 2;
    c.cache_lens = {700, 5};
    c.heads_q = 4;
    c.heads_kv = 2;
    c.seqlen_q = 2;
    c.seqlen_new = 2;
    c.causal = true;
    c.page_size = splits % 2 ? 16 : 0;
    c.num_splits = splits;
    cases.push_back(c);
  }
  expect_cases(cases, 100);
}

TEST(KvCacheCpu, FullyMaskedRows) {
  KvCase c;  // seqlen_q > keys with causal: the first rows see nothing (bottom-right aligned)
  c.batch = 2;
  c.seqlen_q = 4;
  c.cache_lens = {1, 0};
  c.causal = true;
  c.num_splits = 3;
  KvCase w = c;  // a window that excludes every key of the longer sequence's first rows
  w.causal = false;
  w.cache_lens = {9, 2};
  w.window_left = 0;
  w.window_right = -1;
  w.seqlen_q = 3;
  w.seqlen_new = 1;
  expect_cases({c, w}, 200);
}

TEST(KvCacheCpu, LongSequenceHeadDim128) {
  KvCase c;
  c.batch = 1;
  c.cache_lens = {4000};
  c.heads_q = 8;
  c.heads_kv = 2;
  c.head_dim = 128;
  c.page_size = 64;
  c.num_splits = 8;
  c.seqlen_new = 1;
  expect_cases({c}, 300);
}

// Many KV heads: the CPU path stages fewer keys per block (16 here: every head's K and V rows of a
// block must stay in L2), so blocks end inside sequences and inside 16-lane vectors; the split
// heuristic (num_splits 0) splits the keys.
TEST(KvCacheCpu, ManyKvHeads) {
  std::vector<KvCase> cases;
  for (int32_t dt : {FC_DTYPE_F32, FC_DTYPE_BF16})
    for (int64_t page : {0, 16}) {
      KvCase c;
      c.dtype = dt;
      c.batch = 2;
      c.cache_lens = {300, 77};
      c.heads_q = 32;
      c.heads_kv = 16;
      c.head_dim = 128;
      c.seqlen_q = 2;
      c.seqlen_new = 1;
      c.causal = true;
      c.page_size = page;
      c.num_splits = 0;
      cases.push_back(c);
    }
  expect_cases(cases, 400);
}

/** Calls with 16 or more query rows per KV head run on cpu_flash's forward with the cache as its
 *  paged K/V (cpu/decode.cpp's forward route): every layout, appends, masks, rotary, ALiBi, and
 *  rows that see no key, against the same oracle. */
TEST(KvCacheCpu, ForwardRoute) {
  std::vector<KvCase> cases;
  uint64_t seed = 5000;
  for (int32_t dt : all_dtypes())
    for (int64_t page : {int64_t(0), int64_t(1), int64_t(16), int64_t(64)}) {
      KvCase c;  // chunked prefill: 40 new tokens appended and attended, GQA 4
      c.dtype = dt;
      c.page_size = page;
      c.batch = 3;
      c.cache_lens = {0, 57, 200};
      c.heads_q = 8;
      c.heads_kv = 2;
      c.seqlen_q = 40;
      c.seqlen_new = 40;
      c.causal = true;
      c.num_splits = 3;  // ignored by the forward
      cases.push_back(c);
      KvCase w = c;  // queries past the new keys, window + softcap + ALiBi, MHA, no append
      w.seqlen_new = 0;
      w.causal = false;
      w.window_left = 30;
      w.window_right = 4;
      w.softcap = 20;
      w.heads_kv = 8;
      w.seqlen_q = 16;
      w.alibi = 2;
      cases.push_back(w);
      if (page == 0) {
        KvCase pad = c;  // left padding and rows through cache_batch_idx, rotary (NeoX, part of d)
        pad.leftpad = {3, 0, 40};
        pad.batch_idx = true;
        pad.rotary_half = 12;
        pad.rotary_interleaved = false;
        cases.push_back(pad);
      } else {
        KvCase r = c;  // rotary on a paged cache with ALiBi, MQA
        r.heads_kv = 1;
        r.rotary_half = c.head_dim / 2;
        r.alibi = 1;
        cases.push_back(r);
      }
    }
  KvCase masked;  // more queries than keys under a causal mask: the first rows see nothing
  masked.batch = 2;
  masked.cache_lens = {1, 0};
  masked.seqlen_q = 20;
  masked.seqlen_new = 2;
  masked.causal = true;
  cases.push_back(masked);
  expect_cases(cases, seed);
}

// AUTO's decode route (api/dispatch.cpp): a dense forward with at most 4 query rows per KV head
// runs the decode pass. Checked as a forward against the fp64 reference (masks aligned to the
// bottom right, rows that see no key, windows, softcap, ALiBi, GQA / MQA, padded strides, every
// dtype, a backward from its lse), and as the route: the same bits as the KV-cache call over the
// same tensors.
TEST(CpuDecodeRoute, FewQueryRows) {
  auto mem = host_memory();
  std::vector<Case> cases;
  for (int32_t dt : all_dtypes())
    for (int64_t sq : {1, 2}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = sq;
      c.seqlen_k = 300;
      c.heads_q = 4;
      c.heads_kv = sq == 1 ? 1 : 2;  // MQA: 4 rows; GQA 2: 4 rows
      c.head_dim = dt == FC_DTYPE_F32 ? 72 : 128;
      c.dtype = dt;
      c.causal = sq == 2;
      c.softcap = dt == FC_DTYPE_F16 ? 12.0 : 0.0;
      c.padded = dt == FC_DTYPE_BF16;
      cases.push_back(c);
    }
  Case c;
  c.batch = 2;
  c.heads_q = c.heads_kv = 3;
  c.dtype = FC_DTYPE_F32;
  c.seqlen_q = 4;  // more queries than keys under a causal mask
  c.seqlen_k = 2;
  c.causal = true;
  cases.push_back(c);
  c.seqlen_k = 500;  // a window on both sides, per-sequence ALiBi slopes
  c.causal = false;
  c.window_left = 50;
  c.window_right = 1;
  c.alibi = 2;
  cases.push_back(c);
  uint64_t seed = 9000;
  for (const Case& x : cases) {
    const CheckResult r = check_forward(x, FC_BACKEND_AUTO, *mem, seed++);
    EXPECT_TRUE(r.ok) << x.name() << "\n" << r.summary();
  }
  for (const Case& x : {cases[0], cases[3], cases[6]}) {
    const CheckResult r = check_backward(x, FC_BACKEND_AUTO, *mem, seed++);
    EXPECT_TRUE(r.ok) << x.name() << "\n" << r.summary();
  }

  // The route itself: GQA 8 / 2, one token, fp32.
  constexpr int64_t kBatch = 2, kKeys = 700, kHq = 8, kHk = 2, kD = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> q(kBatch * kHq * kD), k(kBatch * kKeys * kHk * kD), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);
  std::vector<float> out_fwd(q.size(), NAN), out_cache(q.size(), NAN), lse_fwd(kBatch * kHq, NAN),
      lse_cache(lse_fwd.size(), NAN);
  std::vector<int32_t> full(kBatch, static_cast<int32_t>(kKeys));
  Tensor tq = make_tensor(q.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  Tensor tk = make_tensor(k.data(), FC_DTYPE_F32, {kBatch, kKeys, kHk, kD});
  Tensor tv = make_tensor(v.data(), FC_DTYPE_F32, {kBatch, kKeys, kHk, kD});
  Tensor to_fwd = make_tensor(out_fwd.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  Tensor tl_fwd = make_tensor(lse_fwd.data(), FC_DTYPE_F32, {kBatch, kHq, 1});
  Tensor to_cache = make_tensor(out_cache.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  Tensor tl_cache = make_tensor(lse_cache.data(), FC_DTYPE_F32, {kBatch, kHq, 1});
  Tensor tlens = make_tensor(full.data(), FC_DTYPE_I32, {kBatch});
  Options opt;
  opt.causal = true;
  forward(tq, tk, tv, to_fwd, &tl_fwd, opt);
  KvCacheArgs args;
  args.q = &tq;
  args.k_cache = &tk;
  args.v_cache = &tv;
  args.cache_seqlens = &tlens;
  args.out = &to_cache;
  args.lse = &tl_cache;
  kvcache(args, opt);
  EXPECT_EQ(std::memcmp(out_fwd.data(), out_cache.data(), out_fwd.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(lse_fwd.data(), lse_cache.data(), lse_fwd.size() * sizeof(float)), 0);
}

// AUTO's decode route for varlen forwards with a few query rows per KV head (flash_attn_varlen_func's
// decoding): checked as a forward against the fp64 reference (sequences without a query or without
// keys, sequences of 1-4 query tokens whose masks align to their own last key, packed and paged
// K/V with pages of 16 and 5 keys, causal, windows, softcap, ALiBi, GQA / MHA / MQA, every dtype,
// NaN rows past the packed sequences, a backward from its lse), and as the route: taken, and the
// same bits as the KV-cache call over the same tensors (the packed keys as one cache row, each
// sequence's first key as its left padding).
TEST(CpuDecodeRoute, VarlenFewQueryRows) {
  auto mem = host_memory();
  std::vector<Case> cases;
  for (int32_t dt : all_dtypes())
    for (int64_t page : {0, 16, 5}) {
      Case c;
      c.varlen_q = {1, 0, 1, 1};
      c.varlen_k = {300, 40, 0, 517};
      c.heads_q = 8;
      c.heads_kv = 2;
      c.head_dim = dt == FC_DTYPE_F32 ? 72 : 128;
      c.dtype = dt;
      c.causal = page != 5;
      c.page_size = page;
      c.softcap = page == 16 ? 12.0 : 0.0;
      if (page == 5) {
        c.window_left = 100;
        c.window_right = 0;
        c.alibi = 2;
      }
      c.padded = dt == FC_DTYPE_BF16;
      cases.push_back(c);
    }
  for (bool causal : {true, false}) {  // MHA with up to 4 query tokens: each sequence's mask aligned to its own
    Case c;
    c.varlen_q = {3, 0, 1, 4, 2};
    c.varlen_k = {300, 40, 7, 2, 1000};  // (4 tokens against 2 keys: the first rows see nothing)
    c.heads_q = c.heads_kv = 3;
    c.head_dim = 64;
    c.dtype = FC_DTYPE_F32;
    c.causal = causal;
    if (!causal) {
      c.window_left = 20;
      c.window_right = 1;
      c.alibi = 2;
      c.page_size = 16;
    }
    cases.push_back(c);
  }
  Case mqa;  // MQA: 4 query heads on one KV head
  mqa.varlen_q = {1, 1, 1};
  mqa.varlen_k = {1, 1000, 64};
  mqa.heads_q = 4;
  mqa.heads_kv = 1;
  mqa.head_dim = 64;
  mqa.dtype = FC_DTYPE_F16;
  mqa.alibi = 1;
  cases.push_back(mqa);
  uint64_t seed = 9100;
  for (const Case& x : cases) {
    const CheckResult r = check_forward(x, FC_BACKEND_AUTO, *mem, seed++);
    EXPECT_TRUE(r.ok) << x.name() << "\n" << r.summary();
  }
  for (const Case& x : {cases[0], cases[4], cases[9]}) {
    const CheckResult r = check_backward(x, FC_BACKEND_AUTO, *mem, seed++);
    EXPECT_TRUE(r.ok) << x.name() << "\n" << r.summary();
  }

  // The route itself: GQA 8 / 2, three sequences of one token each, fp32.
  constexpr int64_t kBatch = 3, kHq = 8, kHk = 2, kD = 64;
  std::vector<int32_t> cu_q = {0, 1, 2, 3}, cu_k = {0, 700, 701, 1500};
  const int64_t total_k = cu_k.back();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> q(kBatch * kHq * kD), k(total_k * kHk * kD), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);
  std::vector<float> out_fwd(q.size(), NAN), out_cache(q.size(), NAN), lse_fwd(kBatch * kHq, NAN),
      lse_cache(lse_fwd.size(), NAN);
  Tensor tq = make_tensor(q.data(), FC_DTYPE_F32, {kBatch, kHq, kD});
  Tensor tk = make_tensor(k.data(), FC_DTYPE_F32, {total_k, kHk, kD});
  Tensor tv = make_tensor(v.data(), FC_DTYPE_F32, {total_k, kHk, kD});
  Tensor to_fwd = make_tensor(out_fwd.data(), FC_DTYPE_F32, {kBatch, kHq, kD});
  Tensor tl_fwd = make_tensor(lse_fwd.data(), FC_DTYPE_F32, {kHq, kBatch});
  Tensor tcu_q = make_tensor(cu_q.data(), FC_DTYPE_I32, {kBatch + 1});
  Tensor tcu_k = make_tensor(cu_k.data(), FC_DTYPE_I32, {kBatch + 1});
  Options opt;
  opt.causal = true;
  opt.cu_seqlens_q = &tcu_q;
  opt.cu_seqlens_k = &tcu_k;
  opt.max_seqlen_q = 1;
  opt.max_seqlen_k = 800;
  const fc_attention_options c_opt = opt.to_c();
  EXPECT_TRUE(forward_takes_decode_route(ForwardArgs{&tq, &tk, &tv, &to_fwd, &tl_fwd, &c_opt}));
  forward(tq, tk, tv, to_fwd, &tl_fwd, opt);

  // The same keys as a KV cache: one row of total_k slots, sequence b from slot cu_k[b] to cu_k[b + 1].
  std::vector<int32_t> rows(kBatch, 0), starts(cu_k.begin(), cu_k.end() - 1), ends(cu_k.begin() + 1, cu_k.end());
  std::vector<float> lse_heads_first(lse_cache.size(), NAN);
  Tensor cq = make_tensor(q.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  Tensor ck = make_tensor(k.data(), FC_DTYPE_F32, {1, total_k, kHk, kD});
  Tensor cv = make_tensor(v.data(), FC_DTYPE_F32, {1, total_k, kHk, kD});
  Tensor co = make_tensor(out_cache.data(), FC_DTYPE_F32, {kBatch, 1, kHq, kD});
  Tensor cl = make_tensor(lse_cache.data(), FC_DTYPE_F32, {kBatch, kHq, 1});
  Tensor crows = make_tensor(rows.data(), FC_DTYPE_I32, {kBatch});
  Tensor cstarts = make_tensor(starts.data(), FC_DTYPE_I32, {kBatch});
  Tensor cends = make_tensor(ends.data(), FC_DTYPE_I32, {kBatch});
  KvCacheArgs args;
  args.q = &cq;
  args.k_cache = &ck;
  args.v_cache = &cv;
  args.cache_seqlens = &cends;
  args.cache_batch_idx = &crows;
  args.cache_leftpad = &cstarts;
  args.out = &co;
  args.lse = &cl;
  Options cache_opt;
  cache_opt.causal = true;
  kvcache(args, cache_opt);
  EXPECT_EQ(std::memcmp(out_fwd.data(), out_cache.data(), out_fwd.size() * sizeof(float)), 0);
  for (int64_t b = 0; b < kBatch; ++b)  // varlen lse is (heads, total_q); the cache call's (batch, heads, 1)
    for (int64_t h = 0; h < kHq; ++h) EXPECT_EQ(lse_fwd[h * kBatch + b], lse_cache[b * kHq + h]) << b << " " << h;

  // Two query tokens in one sequence (max_seqlen_q = 2: 8 rows per KV head) stay on cpu_flash's forward.
  std::vector<int32_t> cu_q2 = {0, 2, 2, 3};
  Tensor tcu_q2 = make_tensor(cu_q2.data(), FC_DTYPE_I32, {kBatch + 1});
  opt.cu_seqlens_q = &tcu_q2;
  opt.max_seqlen_q = 2;
  const fc_attention_options c_opt2 = opt.to_c();
  EXPECT_FALSE(forward_takes_decode_route(ForwardArgs{&tq, &tk, &tv, &to_fwd, &tl_fwd, &c_opt2}));
}

// Results do not depend on the thread count (the split heuristic looks at shapes and lengths), on
// the decode pass and on the forward route (a chunk of 24 query tokens, 96 rows per KV head).
TEST(KvCacheCpu, ThreadCountDoesNotChangeBits) {
  KvCase decode;
  decode.batch = 1;
  decode.cache_lens = {3000};
  decode.heads_q = 8;
  decode.heads_kv = 2;
  decode.head_dim = 64;
  decode.dtype = FC_DTYPE_F32;
  decode.num_splits = 0;
  KvCase chunk = decode;
  chunk.cache_lens = {700};
  chunk.seqlen_q = chunk.seqlen_new = 24;
  chunk.causal = true;
  auto mem = host_memory();
  for (const KvCase& c : {decode, chunk}) {
    std::vector<uint8_t> first_out, first_lse;
    for (int32_t threads : {1, 2, 3, 7}) {
      KvProblem pr(c, *mem, 500);
      pr.opt.num_threads = threads;
      ASSERT_EQ(pr.run(*mem), FC_OK) << fc_last_error();
      pr.fetch();
      if (first_out.empty()) {
        first_out = pr.out.host;
        first_lse = pr.lse.host;
      } else {
        EXPECT_TRUE(pr.out.host == first_out) << c.name() << ", " << threads << " threads: out differs from 1 thread";
        EXPECT_TRUE(pr.lse.host == first_lse) << c.name() << ", " << threads << " threads: lse differs from 1 thread";
      }
    }
  }
}

// ---- bad inputs -------------------------------------------------------------------------------

KvCase small_case(int64_t page_size) {
  KvCase c;
  c.batch = 2;
  c.cache_lens = {3, 10};
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 16;
  c.page_size = page_size;
  c.seqlen_new = 2;
  c.seqlen_q = 2;
  return c;
}

/** Builds a valid problem, breaks it, and expects a named error with nothing written. */
void expect_rejected(const KvCase& c, const std::function<void(KvProblem&)>& breakit, const std::string& prefix,
                     bool value_error = false, fc_status code = FC_ERROR_INVALID_ARGUMENT) {
  auto mem = host_memory();
  KvProblem pr(c, *mem, 7);
  int32_t flag = 0;
  pr.args.error_flag = &flag;
  breakit(pr);
  pr.upload_indices();
  const fc_status st = fc_attention_kvcache(&pr.args, &pr.opt, nullptr, 0);
  pr.fetch();
  EXPECT_EQ(st, code) << prefix;
  const std::string msg = fc_last_error();
  EXPECT_EQ(msg.rfind(prefix, 0), 0u) << "expected the message to start with '" << prefix << "', got: " << msg;
  for (int64_t i = 0; i < pr.out.numel(); ++i) ASSERT_TRUE(std::isnan(pr.out.get(i))) << prefix << ": out written";
  for (int64_t i = 0; i < pr.lse.numel(); ++i) ASSERT_TRUE(std::isnan(pr.lse.get(i))) << prefix << ": lse written";
  EXPECT_TRUE(pr.k_cache.host == pr.k_cache_before) << prefix << ": k_cache written";
  EXPECT_TRUE(pr.v_cache.host == pr.v_cache_before) << prefix << ": v_cache written";
  EXPECT_EQ(flag, value_error ? 1 : 0) << prefix;
}

/** cache_seqlens = NULL: every sequence fills its cache (flash_attn_with_kvcache without
 *  cache_seqlens), the same bits as the lengths given. */
TEST(KvCacheCpu, FullCachesWithoutLengths) {
  auto mem = host_memory();
  uint64_t seed = 900;
  for (int32_t dt : all_dtypes())
    for (const KvCase& c : full_cache_cases(dt, 64)) {
      const std::string err = run_full_cache_without_lengths(c, *mem, seed++);
      EXPECT_TRUE(err.empty()) << c.name() << ": " << err;
    }
}

TEST(KvCacheCpuBadInput, Tensors) {
  const KvCase c = small_case(0);
  expect_rejected(c, [](KvProblem& p) { p.args.q = nullptr; }, "q:");
  expect_rejected(c, [](KvProblem& p) { p.tq.dtype = FC_DTYPE_I32; }, "q:");
  expect_rejected(c, [](KvProblem& p) { p.tq.strides[3] = 2; }, "q:");
  expect_rejected(c, [](KvProblem& p) { p.tq.shape[3] = 0; }, "q:");
  expect_rejected(c, [](KvProblem& p) { p.tkc.dtype = FC_DTYPE_F16; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tkc.shape[3] = 8; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tkc.shape[2] = 3; p.tvc.shape[2] = 3; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tkc.data = nullptr; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tvc.shape[1] -= 1; }, "v_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tkc.shape[0] = 1; p.tvc.shape[0] = 1; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.args.cache_seqlens = nullptr; }, "cache_seqlens:");  // with k_new
  expect_rejected(c, [](KvProblem& p) { p.tlens.dtype = FC_DTYPE_F32; }, "cache_seqlens:");
  expect_rejected(c, [](KvProblem& p) { p.tlens.shape[0] = 3; }, "cache_seqlens:");
  expect_rejected(c, [](KvProblem& p) { p.args.v_new = nullptr; }, "v_new:");
  expect_rejected(c, [](KvProblem& p) { p.args.k_new = nullptr; }, "k_new:");
  expect_rejected(c, [](KvProblem& p) { p.tkn.shape[2] = 1; }, "k_new:");
  expect_rejected(c, [](KvProblem& p) { p.tvn.dtype = FC_DTYPE_F16; }, "v_new:");
  expect_rejected(c, [](KvProblem& p) { p.tkn.data = p.tkc.data; }, "k_cache:");
  expect_rejected(c, [](KvProblem& p) { p.tout.shape[1] = 1; }, "out:");
  expect_rejected(c, [](KvProblem& p) { p.tout.dtype = FC_DTYPE_F16; }, "out:");
  expect_rejected(c, [](KvProblem& p) { p.tout.data = p.tq.data; }, "out:");
  expect_rejected(c, [](KvProblem& p) { p.tout.strides[2] = 0; }, "out:");
  expect_rejected(c, [](KvProblem& p) { p.tlse.shape[2] = 1; }, "lse:");
  expect_rejected(c, [](KvProblem& p) { p.tlse.dtype = FC_DTYPE_BF16; }, "lse:");
  expect_rejected(c, [](KvProblem& p) { p.args.num_splits = -1; }, "num_splits:");
  expect_rejected(c, [](KvProblem& p) { p.args.num_splits = 100000; }, "num_splits:");
}

TEST(KvCacheCpuBadInput, Options) {
  const KvCase c = small_case(4);
  expect_rejected(c, [](KvProblem& p) { p.opt.has_window = 1; p.opt.window_left = -2; }, "window_left:");
  expect_rejected(c, [](KvProblem& p) { p.opt.has_window = 1; p.opt.window_right = -3; }, "window_right:");
  expect_rejected(c, [](KvProblem& p) { p.opt.softcap = -1; }, "softcap:");
  expect_rejected(c, [](KvProblem& p) { p.opt.softmax_scale = std::nan(""); }, "softmax_scale:");
  expect_rejected(c, [](KvProblem& p) { p.opt.cu_seqlens_q = p.args.cache_seqlens; }, "cu_seqlens_q:");
  // The forward's block_table / error_flag would be ignored here: the call has its own.
  expect_rejected(c, [](KvProblem& p) { p.opt.block_table = p.args.cache_seqlens; }, "block_table: must be null in "
                                                                                       "fc_attention_options");
  static int32_t flag = 0;
  expect_rejected(c, [](KvProblem& p) { p.opt.error_flag = &flag; }, "error_flag: must be null in fc_attention_options");
  expect_rejected(c, [](KvProblem& p) { p.opt.dropout_p = 0.1; }, "dropout_p: must be 0 for fc_attention_kvcache");
  EXPECT_EQ(flag, 0);
  expect_rejected(c, [](KvProblem& p) { p.opt.backend = 99; }, "backend:");
  expect_rejected(c, [](KvProblem& p) { p.opt.backend = FC_BACKEND_CUDA_SM80; }, "q:");
  // ALiBi slopes: float32, (heads_q) or (batch, heads_q), finite, on q's device, not written over.
  KvCase alibi = c;
  alibi.alibi = 2;
  expect_rejected(alibi, [](KvProblem& p) { p.tslopes.dtype = FC_DTYPE_F16; }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.tslopes.shape[1] = 3; }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.tslopes.shape[0] = 1; }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.tslopes.ndim = 3; }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.tslopes.device_type = FC_DEVICE_CUDA; }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.slopes.set(3, std::nanf("")); p.slopes.upload(); }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.slopes.set(1, INFINITY); p.slopes.upload(); }, "alibi_slopes:");
  expect_rejected(alibi, [](KvProblem& p) { p.tlse.data = p.tslopes.data; }, "lse:");
  auto mem = host_memory();
  EXPECT_EQ(fc_attention_kvcache(nullptr, nullptr, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(fc_last_error()).rfind("args:", 0), 0u);
}

TEST(KvCacheCpuBadInput, IndexValues) {
  const KvCase contiguous = small_case(0);
  const KvCase paged = small_case(4);
  KvCase bidx = small_case(0);
  bidx.batch_idx = true;
  for (const KvCase* c : {&contiguous, &paged}) {
    expect_rejected(*c, [](KvProblem& p) { p.seqlens.ints()[1] = -1; }, "cache_seqlens:", true);
    // Capacity is longest + slack: the cached length alone fits, cached + appended does not.
    expect_rejected(*c, [](KvProblem& p) { p.seqlens.ints()[0] = static_cast<int32_t>(p.capacity - 1); },
                    "cache_seqlens:", true);
    expect_rejected(*c, [](KvProblem& p) { p.seqlens.ints()[0] = static_cast<int32_t>(p.capacity + 100); },
                    "cache_seqlens:", true);
  }
  expect_rejected(paged, [](KvProblem& p) { p.block_table.ints()[1] = static_cast<int32_t>(p.cache_rows); },
                  "block_table:", true);
  expect_rejected(paged, [](KvProblem& p) { p.block_table.ints()[p.pages_per_seq] = -1; }, "block_table:", true);
  expect_rejected(paged, [](KvProblem& p) { p.tbt.shape[0] = 1; }, "block_table:");
  expect_rejected(paged, [](KvProblem& p) { p.tbt.dtype = FC_DTYPE_F32; }, "block_table:");
  expect_rejected(paged, [](KvProblem& p) { p.args.cache_batch_idx = p.args.cache_seqlens; }, "cache_batch_idx:");
  expect_rejected(paged, [](KvProblem& p) { p.tkc.shape[1] = 0; p.tvc.shape[1] = 0; }, "k_cache:");
  expect_rejected(bidx, [](KvProblem& p) { p.batch_idx.ints()[0] = static_cast<int32_t>(p.cache_rows); },
                  "cache_batch_idx:", true);
  expect_rejected(bidx, [](KvProblem& p) { p.batch_idx.ints()[1] = -1; }, "cache_batch_idx:", true);
  // Without cache_seqlens every sequence holds its whole cache: a cache row of 2^31 slots (its
  // rows overlapping through a zero stride: nothing is read) is more than int32 lengths count.
  expect_rejected(contiguous, [](KvProblem& p) {
    p.args.cache_seqlens = nullptr;
    p.args.k_new = p.args.v_new = nullptr;
    for (fc_tensor* t : {&p.tkc, &p.tvc}) {
      t->shape[1] = int64_t(1) << 31;
      t->strides[1] = 0;
    }
  }, "cache_seqlens:");
}

TEST(KvCacheCpu, UnusedBlockTableEntriesAreIgnored) {
  // Entries past a sequence's last page may hold anything (as in flash_attn_with_kvcache).
  auto mem = host_memory();
  KvCase c = small_case(4);
  c.slack = 40;
  KvProblem pr(c, *mem, 11);
  pr.block_table.ints()[pr.pages_per_seq - 1] = -12345;
  pr.upload_indices();
  ASSERT_EQ(pr.run(*mem), FC_OK) << fc_last_error();
  pr.fetch();
  EXPECT_EQ(check_kvcache_result(pr), "");
}

// ---- cache_leftpad and rotary embedding ---------------------------------------------------------

TEST(KvCacheCpu, LeftPadAndRotary) {
  uint64_t seed = 400;
  for (int32_t dt : all_dtypes())
    for (int64_t hd : {int64_t(64), int64_t(24)}) expect_cases(leftpad_rotary_cases(dt, hd), seed += 50);
}

/** ALiBi slopes over layouts, masks, splits, appends and left padding (alibi_cases). */
TEST(KvCacheCpu, Alibi) {
  uint64_t seed = 2000;
  for (int32_t dt : all_dtypes())
    for (int64_t hd : {int64_t(64), int64_t(59)}) expect_cases(alibi_cases(dt, hd), seed += 50);
}

/** The oracle's ALiBi is not vacuous: the same problem without the bias differs from it by more
 *  than the tolerance (so a backend ignoring the slopes fails KvCacheCpu.Alibi). */
TEST(KvCacheCpu, AlibiCheckCatchesAMissingBias) {
  auto mem = host_memory();
  KvCase c = alibi_cases(FC_DTYPE_F32, 64)[1];
  KvProblem pr(c, *mem, 11);
  ASSERT_EQ(pr.run(*mem), FC_OK) << fc_last_error();
  pr.fetch();
  ASSERT_EQ(check_kvcache_result(pr), "");
  KvProblem plain(c, *mem, 11);  // same inputs
  plain.opt.alibi_slopes = nullptr;
  ASSERT_EQ(plain.run(*mem), FC_OK) << fc_last_error();
  plain.fetch();
  pr.out.host = plain.out.host;
  pr.lse.host = plain.lse.host;
  EXPECT_NE(check_kvcache_result(pr), "");
}

/** The oracle must see a wrong rotation: positions off by one, or the other pairing, fail. */
TEST(KvCacheCpu, RotaryCheckCatchesWrongPositionsAndPairs) {
  auto mem = host_memory();
  KvCase c = small_case(0);
  c.rotary_half = 4;
  c.causal = true;
  {
    KvProblem pr(c, *mem, 21);
    pr.seqlens.ints()[0] += 1;  // the library rotates (and appends) one slot later than the oracle
    pr.upload_indices();
    ASSERT_EQ(pr.run(*mem), FC_OK) << fc_last_error();
    pr.fetch();
    EXPECT_NE(check_kvcache_result(pr), "");
  }
  {
    KvProblem pr(c, *mem, 22);
    pr.args.rotary_interleaved = 0;  // the oracle expects interleaved pairs
    ASSERT_EQ(pr.run(*mem), FC_OK) << fc_last_error();
    pr.fetch();
    EXPECT_NE(check_kvcache_result(pr), "");
  }
}

TEST(KvCacheCpuBadInput, LeftPadAndRotary) {
  KvCase pad = small_case(0);
  pad.leftpad = {1, 2};
  KvCase rot = small_case(0);
  rot.rotary_half = 4;
  KvCase paged_rot = small_case(4);
  paged_rot.rotary_half = 2;
  expect_rejected(pad, [](KvProblem& p) { p.leftpad.ints()[0] = -1; }, "cache_leftpad: entry 0 is -1", true);
  expect_rejected(pad, [](KvProblem& p) { p.leftpad.ints()[1] = p.seqlens.ints()[1] + 1; }, "cache_leftpad: entry 1",
                  true);
  expect_rejected(pad, [](KvProblem& p) { p.tpad.shape[0] = 3; }, "cache_leftpad:");
  expect_rejected(pad, [](KvProblem& p) { p.tpad.dtype = FC_DTYPE_F32; }, "cache_leftpad:");
  expect_rejected(pad, [](KvProblem& p) { p.tout.data = p.tpad.data; }, "out:");
  expect_rejected(pad, [](KvProblem& p) { p.seqlens.ints()[0] = static_cast<int32_t>(p.capacity - 1); },
                  "cache_seqlens:", true);  // padding counts toward the row's slots
  expect_rejected(small_case(4), [&](KvProblem& p) { p.args.cache_leftpad = p.args.cache_seqlens; },
                  "cache_leftpad: not supported with a paged cache");
  expect_rejected(rot, [](KvProblem& p) { p.args.rotary_sin = nullptr; }, "rotary_cos, rotary_sin: give both");
  expect_rejected(rot, [](KvProblem& p) { p.args.rotary_cos = nullptr; }, "rotary_cos, rotary_sin: give both");
  expect_rejected(rot, [](KvProblem& p) { p.args.k_new = p.args.v_new = nullptr; }, "rotary_cos: rotary embedding");
  expect_rejected(rot, [](KvProblem& p) { p.tsin.shape[0] -= 1; }, "rotary_sin: shape");
  expect_rejected(rot, [](KvProblem& p) { p.tcos.shape[1] = p.tsin.shape[1] = 9; }, "rotary_cos: shape");
  expect_rejected(rot, [](KvProblem& p) { p.tcos.shape[0] = p.tsin.shape[0] = 0; }, "rotary_cos: shape");
  expect_rejected(rot, [](KvProblem& p) { p.tcos.dtype = p.tsin.dtype = FC_DTYPE_I32; }, "rotary_cos: dtype");
  expect_rejected(rot, [](KvProblem& p) { p.tsin.strides[1] = 2; }, "rotary_sin: last dimension");
  expect_rejected(rot, [](KvProblem& p) { p.tcos.ndim = 3; }, "rotary_cos:");
  expect_rejected(rot, [](KvProblem& p) { p.tout.data = p.tcos.data; }, "out:");
  expect_rejected(rot, [](KvProblem& p) { p.tcos.data = p.tkc.data; }, "k_cache:");  // written while read
  for (const KvCase* c : {&rot, &paged_rot}) {
    // The last position (cache_seqlens + seqlen_new - 1) must be a row of the tables.
    expect_rejected(*c, [](KvProblem& p) { p.tcos.shape[0] = p.tsin.shape[0] = p.seqlens.ints()[1] + 1; },
                    "rotary_cos: has", true);
  }
}

// ---- fc_merge_partials ------------------------------------------------------------------------

TEST(MergePartialsCpu, MatchesFp64AndHandlesEmptyParts) {
  constexpr int64_t kParts = 4, kBatch = 2, kSq = 3, kHeads = 2, kHd = 24;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> op(kParts * kBatch * kSq * kHeads * kHd), lp(kParts * kBatch * kHeads * kSq);
  for (auto& x : op) x = normal(rng);
  for (auto& x : lp) x = 3.f * normal(rng);
  // Row (b=0, h=1, i=2): all parts empty; row (b=1, h=0, i=0): parts 0 and 2 empty.
  auto lidx = [&](int64_t s, int64_t b, int64_t h, int64_t i) { return ((s * kBatch + b) * kHeads + h) * kSq + i; };
  for (int64_t s = 0; s < kParts; ++s) lp[lidx(s, 0, 1, 2)] = kNegInf;
  lp[lidx(0, 1, 0, 0)] = lp[lidx(2, 1, 0, 0)] = kNegInf;
  for (int32_t dt : all_dtypes()) {
    std::vector<uint8_t> out(kBatch * kSq * kHeads * kHd * 4);
    std::vector<float> lse(kBatch * kHeads * kSq, std::nanf(""));
    fc_tensor top = flashcore::make_tensor(op.data(), FC_DTYPE_F32, {kParts, kBatch * kSq, kHeads, kHd});
    fc_tensor tlp = flashcore::make_tensor(lp.data(), FC_DTYPE_F32, {kParts, kBatch, kHeads, kSq});
    fc_tensor tout = flashcore::make_tensor(out.data(), static_cast<fc_dtype>(dt), {kBatch, kSq, kHeads, kHd});
    fc_tensor tlse = flashcore::make_tensor(lse.data(), FC_DTYPE_F32, {kBatch, kHeads, kSq});
    ASSERT_EQ(fc_merge_partials(&top, &tlp, &tout, &tlse, nullptr), FC_OK) << fc_last_error();
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t i = 0; i < kSq; ++i) {
          double m = -INFINITY;
          for (int64_t s = 0; s < kParts; ++s) m = std::max(m, double(lp[lidx(s, b, h, i)]));
          double total = 0;
          for (int64_t s = 0; s < kParts; ++s) total += std::exp(lp[lidx(s, b, h, i)] - m);
          const double ref_lse = std::isinf(m) ? m : m + std::log(total);
          EXPECT_TRUE(std::isinf(ref_lse) ? lse[(b * kHeads + h) * kSq + i] == ref_lse
                                          : std::fabs(lse[(b * kHeads + h) * kSq + i] - ref_lse) < 1e-5);
          for (int64_t d = 0; d < kHd; ++d) {
            double ref = 0;
            if (!std::isinf(ref_lse))
              for (int64_t s = 0; s < kParts; ++s) {
                const double l = lp[lidx(s, b, h, i)];
                if (!std::isinf(l)) ref += std::exp(l - ref_lse) * op[(((s * kBatch + b) * kSq + i) * kHeads + h) * kHd + d];
              }
            const int64_t o = ((b * kSq + i) * kHeads + h) * kHd + d;
            const double got = load_as_float(out.data(), o, static_cast<DType>(dt));
            const double tol = dt == FC_DTYPE_F32 ? 1e-5 : (dt == FC_DTYPE_F16 ? 2e-3 : 1.6e-2) * (1 + std::fabs(ref));
            EXPECT_NEAR(got, ref, tol) << "dtype " << dt << " b" << b << " h" << h << " i" << i << " d" << d;
          }
        }
    // Bad input: wrong partial shape names the argument; nothing written.
    std::vector<float> lse_before = lse;
    fc_tensor bad = top;
    bad.shape[1] = kBatch;
    EXPECT_EQ(fc_merge_partials(&bad, &tlp, &tout, &tlse, nullptr), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(fc_last_error()).rfind("out_partials:", 0), 0u) << fc_last_error();
    fc_tensor badl = tlp;
    badl.dtype = FC_DTYPE_BF16;
    EXPECT_EQ(fc_merge_partials(&top, &badl, &tout, &tlse, nullptr), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(fc_last_error()).rfind("lse_partials:", 0), 0u) << fc_last_error();
    fc_tensor badlse = tlse;
    badlse.shape[0] = 1;
    EXPECT_EQ(fc_merge_partials(&top, &tlp, &tout, &badlse, nullptr), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(fc_last_error()).rfind("lse:", 0), 0u) << fc_last_error();
    fc_attention_options negative_margin{};
    negative_margin.sm_margin = -1;
    EXPECT_EQ(fc_merge_partials(&top, &tlp, &tout, &tlse, &negative_margin), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(fc_last_error()).rfind("sm_margin:", 0), 0u) << fc_last_error();
    for (size_t i = 0; i < lse.size(); ++i)
      EXPECT_TRUE(std::isinf(lse_before[i]) ? lse[i] == lse_before[i] : lse[i] == lse_before[i]);
  }
}

// A NaN among a row's part LSEs poisons the row (out and lse NaN) wherever it stands: before or
// after finite parts, and with only empty (-inf) parts beside it. The other rows stay exact.
TEST(MergePartialsCpu, NanPartPoisonsItsRow) {
  const float kNan = std::nanf(""), kNegInf = -std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {
      {kNan, kNegInf, kNegInf}, {kNegInf, kNan, kNegInf}, {kNegInf, kNegInf, kNan},
      {kNan, 1.f, kNegInf},     {2.f, kNan, 1.f},          {0.5f, -1.f, 2.f}};  // the last one clean
  const int64_t parts = 3, heads = static_cast<int64_t>(rows.size()), hd = 8;
  std::vector<float> op(parts * heads * hd), lp(parts * heads);
  for (size_t i = 0; i < op.size(); ++i) op[i] = std::cos(0.7 * double(i));
  for (int64_t s = 0; s < parts; ++s)
    for (int64_t h = 0; h < heads; ++h) lp[s * heads + h] = rows[h][s];
  std::vector<float> out(heads * hd, 123.f), lse(heads, 123.f);
  fc_tensor top = flashcore::make_tensor(op.data(), FC_DTYPE_F32, {parts, 1, heads, hd});
  fc_tensor tlp = flashcore::make_tensor(lp.data(), FC_DTYPE_F32, {parts, 1, heads, 1});
  fc_tensor tout = flashcore::make_tensor(out.data(), FC_DTYPE_F32, {1, 1, heads, hd});
  fc_tensor tlse = flashcore::make_tensor(lse.data(), FC_DTYPE_F32, {1, heads, 1});
  ASSERT_EQ(fc_merge_partials(&top, &tlp, &tout, &tlse, nullptr), FC_OK) << fc_last_error();
  for (int64_t h = 0; h + 1 < heads; ++h) {
    EXPECT_TRUE(std::isnan(lse[h])) << "row " << h << ": lse " << lse[h];
    for (int64_t d = 0; d < hd; ++d) EXPECT_TRUE(std::isnan(out[h * hd + d])) << "row " << h << ", d " << d;
  }
  const int64_t h = heads - 1;
  double m = -INFINITY, total = 0;
  for (float l : rows[h]) m = std::max(m, double(l));
  for (float l : rows[h]) total += std::exp(l - m);
  const double ref_lse = m + std::log(total);
  EXPECT_NEAR(lse[h], ref_lse, 1e-5);
  for (int64_t d = 0; d < hd; ++d) {
    double ref = 0;
    for (int64_t s = 0; s < parts; ++s) ref += std::exp(rows[h][s] - ref_lse) * op[(s * heads + h) * hd + d];
    EXPECT_NEAR(out[h * hd + d], ref, 1e-5) << "d " << d;
  }
}

}  // namespace
}  // namespace flashcore::testing
