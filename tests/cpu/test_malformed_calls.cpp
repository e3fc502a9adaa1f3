// Randomized malformed calls of every C ABI entry point (forward, backward, the KV-cache call and
// the merge of partials, with their workspace queries): a valid small call has one to three of its
// arguments broken at random (dtypes, devices, ranks, shapes, strides, null or aliased or
// misaligned data, options, index values, optional tensors added or dropped). Whatever the
// library makes of it, it must not crash or touch memory outside the buffers (this file runs
// under ASan + UBSan in CI), and it must either succeed with an empty last error or fail with
// FC_ERROR_INVALID_ARGUMENT / FC_ERROR_UNSUPPORTED, a message that starts with the argument's name,
// and no byte of any buffer changed.
//
// Every buffer is a slot of the same size with the tensor's data in its middle third, so a view
// the validation accepts (a shrunk shape, a stride of 0 or of flipped sign, another dtype,
// another tensor's data) still lies inside memory the test owns; mutations that would describe
// more memory than the caller has (a lie no library can detect) are not drawn. Only the values
// CPU validation checks (lengths, page ids, slopes) are drawn at random.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "flashcore/flashcore.hpp"

namespace {

// Bytes on either side of a data pointer: more than any view drawn below reaches (the widest, a
// contiguous fp32 cache of 3 x 16 x 2 x 8 with its sizes permuted onto other strides and a stride
// negated, reaches ~15.9 KB).
constexpr int64_t kRegion = 16384;

/** Buffers of 3 x kRegion bytes each; data pointers at +kRegion. */
class Arena {
 public:
  unsigned char* add() {
    slots_.emplace_back(3 * kRegion);
    return slots_.back().data() + kRegion;
  }
  void fill(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto& s : slots_)
      for (size_t i = 0; i + 4 <= s.size(); i += 4) {
        const float x = u(rng);
        std::memcpy(&s[i], &x, 4);
      }
  }
  std::vector<std::vector<unsigned char>> snapshot() const { return slots_; }
  bool same_as(const std::vector<std::vector<unsigned char>>& before) const { return slots_ == before; }

 private:
  std::vector<std::vector<unsigned char>> slots_;
};

int64_t pick(std::mt19937_64& rng, std::initializer_list<int64_t> values) {
  std::uniform_int_distribution<size_t> d(0, values.size() - 1);
  return *(values.begin() + d(rng));
}

/** One broken tensor view; `pool` holds other tensors' data pointers for aliasing. */
void break_tensor(fc_tensor* t, std::mt19937_64& rng, const std::vector<void*>& pool, bool cuda_present) {
  const int dims = t->ndim >= 1 && t->ndim <= FC_MAX_DIMS ? t->ndim : FC_MAX_DIMS;
  std::uniform_int_distribution<int> dim(0, dims - 1);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  switch (std::uniform_int_distribution<int>(0, 8)(rng)) {
    case 0: t->dtype = static_cast<int32_t>(pick(rng, {-2, -1, 0, 1, 2, 3, 4, 9})); break;
    case 1:
      t->device_type = static_cast<int32_t>(cuda_present ? pick(rng, {-1, 2, 5}) : pick(rng, {-1, 1, 2, 5}));
      t->device_id = static_cast<int32_t>(pick(rng, {0, 0, 1, -1, 99}));
      break;
    case 2: t->ndim = static_cast<int32_t>(pick(rng, {-1, 0, 1, 2, 3, 4, 5, 1000})); break;
    case 3: {  // shrink, or sizes no memory can hold
      const int d = dim(rng);
      const int64_t s = t->shape[d];
      t->shape[d] = pick(rng, {-1, -9, 0, 1, s > 0 ? s - 1 : 0, s / 2, int64_t(1) << 62, kMax, kMin});
      break;
    }
    case 4: {  // broadcast, reversed, halved, or strides no memory can hold
      const int d = dim(rng);
      const int64_t s = t->strides[d];
      t->strides[d] = pick(rng, {0, s == kMin ? kMax : -s, s / 2, 3, int64_t(1) << 61, kMax, kMin});
      break;
    }
    case 5: t->data = nullptr; break;
    case 6: t->data = pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)]; break;
    case 7:  // misaligned (a null pointer stays null: 0x1 is no pointer the library can check)
      if (t->data) t->data = static_cast<unsigned char*>(t->data) + pick(rng, {1, 2, 3, 6});
      break;
    default: {  // two sizes at once (a transposed view, say)
      const int a = dim(rng), b = dim(rng);
      std::swap(t->shape[a], t->shape[b]);
      break;
    }
  }
}

void break_options(fc_attention_options* o, std::mt19937_64& rng) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  switch (std::uniform_int_distribution<int>(0, 9)(rng)) {
    case 0: o->softmax_scale = static_cast<double>(pick(rng, {0, 1, -1, 3})) * 0.25 + (pick(rng, {0, 1}) ? 0 : nan); break;
    case 1: o->softmax_scale = pick(rng, {0, 1}) ? inf : 1e300; break;
    case 2: o->softcap = pick(rng, {0, 1, 2}) == 0 ? -1.0 : (pick(rng, {0, 1}) ? 1e300 : nan); break;
    case 3:
      o->has_window = 1;
      o->window_left = static_cast<int32_t>(pick(rng, {-5, -1, 0, 1, 3, INT32_MAX, INT32_MIN}));
      o->window_right = static_cast<int32_t>(pick(rng, {-5, -1, 0, 1, 3, INT32_MAX, INT32_MIN}));
      break;
    case 4: o->causal = static_cast<int32_t>(pick(rng, {0, 1, 7, -1})); break;
    case 5: o->backend = static_cast<int32_t>(pick(rng, {-3, -1, 0, 1, 2, 3, 4, 5, 99})); break;
    case 6: o->num_threads = static_cast<int32_t>(pick(rng, {-1, 0, 1, 2, 3})); break;
    case 7: o->deterministic = static_cast<int32_t>(pick(rng, {0, 1, 5})); break;
    case 8: o->sm_margin = static_cast<int32_t>(pick(rng, {-1, 0, 1, 200, INT32_MIN})); break;
    default:
      o->max_seqlen_q = pick(rng, {-1, 0, 1, 100, std::numeric_limits<int64_t>::max()});
      o->max_seqlen_k = pick(rng, {-1, 0, 7, std::numeric_limits<int64_t>::max()});
      break;
  }
}

/** The error rules of every failed call: a known failure code, a message naming the argument
 *  ("name: ..." or "name, other: ..."), and nothing written. */
void expect_clean_outcome(fc_status st, const Arena& arena, const std::vector<std::vector<unsigned char>>& before,
                          const std::string& call) {
  static const std::regex kNamed("^[a-z_][a-z0-9_]*(, [a-z_][a-z0-9_]*)*: .+");
  const std::string msg = fc_last_error();
  if (st == FC_OK) {
    EXPECT_EQ(msg, "") << call;
    return;
  }
  EXPECT_TRUE(st == FC_ERROR_INVALID_ARGUMENT || st == FC_ERROR_UNSUPPORTED)
      << call << ": status " << st << ", message: " << msg;
  EXPECT_TRUE(std::regex_match(msg, kNamed)) << call << ": the message does not start with an argument's name: " << msg;
  EXPECT_TRUE(arena.same_as(before)) << call << ": failed with '" << msg << "' but wrote into a buffer";
}

constexpr int kIterations = 1500;
bool cuda_present() { return fc_cuda_device_count() > 0; }

// ---- forward and backward -------------------------------------------------------------------

struct AttentionCall {
  Arena arena;
  fc_tensor q{}, k{}, v{}, out{}, lse{}, dout{}, dq{}, dk{}, dv{}, cu_q{}, cu_k{}, slopes{}, table{};
  fc_attention_options opt{};
  std::vector<void*> pool;
  int32_t flag = 0;  // outside the arena: a failed varlen check may set it

  explicit AttentionCall(std::mt19937_64& rng) {
    // B = 2, Sq = 5, Sk = 7, Hq = 4, Hkv = 2, D = 8, fp32 / fp16 / bf16 inputs.
    const fc_dtype dt = static_cast<fc_dtype>(pick(rng, {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16}));
    q = flashcore::make_tensor(arena.add(), dt, {2, 5, 4, 8});
    k = flashcore::make_tensor(arena.add(), dt, {2, 7, 2, 8});
    v = flashcore::make_tensor(arena.add(), dt, {2, 7, 2, 8});
    out = flashcore::make_tensor(arena.add(), dt, {2, 5, 4, 8});
    lse = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {2, 4, 5});
    dout = flashcore::make_tensor(arena.add(), dt, {2, 5, 4, 8});
    dq = flashcore::make_tensor(arena.add(), dt, {2, 5, 4, 8});
    dk = flashcore::make_tensor(arena.add(), dt, {2, 7, 2, 8});
    dv = flashcore::make_tensor(arena.add(), dt, {2, 7, 2, 8});
    slopes = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {2, 4});
    cu_q = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {3});
    cu_k = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {3});
    table = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {2, 2});
    arena.fill(rng);
    pool = {q.data, k.data, v.data, out.data, lse.data, dout.data, dq.data, cu_q.data};
    opt.num_threads = 2;
  }

  /** Varlen: q (10, 4, 8) packed as lengths 4 + 6, keys (12, 2, 8) as 5 + 7 (views of the same
   *  buffers), prefix sums drawn around valid ones; paged K/V sometimes on top. */
  void make_varlen(std::mt19937_64& rng) {
    auto packed = [](fc_tensor* t, int64_t rows) {
      *t = flashcore::make_tensor(t->data, static_cast<fc_dtype>(t->dtype), {rows, t->shape[2], t->shape[3]});
    };
    for (fc_tensor* t : {&q, &out, &dout, &dq}) packed(t, 10);
    for (fc_tensor* t : {&k, &v, &dk, &dv}) packed(t, 12);
    lse = flashcore::make_tensor(lse.data, FC_DTYPE_F32, {4, 10});
    int32_t* cq = static_cast<int32_t*>(cu_q.data);
    int32_t* ck = static_cast<int32_t*>(cu_k.data);
    cq[0] = 0, cq[1] = 4, cq[2] = 10, ck[0] = 0, ck[1] = 5, ck[2] = 12;
    if (pick(rng, {0, 1})) {  // one prefix sum off: negative, decreasing, past the rows, or huge
      int32_t* sums = pick(rng, {0, 1}) ? cq : ck;
      const int64_t at = pick(rng, {0, 1, 2});
      const int64_t value = pick(rng, {-1, 3, 11, 13, INT32_MAX});
      sums[at] = static_cast<int32_t>(value);
    }
    opt.cu_seqlens_q = &cu_q;
    opt.cu_seqlens_k = pick(rng, {0, 1, 1, 1}) ? &cu_k : nullptr;
    opt.max_seqlen_q = 6;
    opt.max_seqlen_k = 7;
    if (pick(rng, {0, 0, 0, 1})) {  // paged K/V: 3 pages of 4 keys ... as (pages, page, heads, dim)
      k = flashcore::make_tensor(k.data, static_cast<fc_dtype>(k.dtype), {3, 4, 2, 8});
      v = flashcore::make_tensor(v.data, static_cast<fc_dtype>(v.dtype), {3, 4, 2, 8});
      int32_t* ids = static_cast<int32_t*>(table.data);
      for (int i = 0; i < 4; ++i) ids[i] = static_cast<int32_t>(pick(rng, {0, 1, 2, 2, -1, 3}));
      opt.block_table = &table;
    }
  }

  void add_slopes(std::mt19937_64& rng) {
    float* s = static_cast<float*>(slopes.data);
    for (int i = 0; i < 8; ++i) s[i] = 0.25f;
    if (pick(rng, {0, 1})) s[pick(rng, {0, 3, 7})] = pick(rng, {0, 1}) ? std::nanf("") : INFINITY;
    if (pick(rng, {0, 1})) slopes = flashcore::make_tensor(slopes.data, FC_DTYPE_F32, {4});
    opt.alibi_slopes = &slopes;
  }
};

TEST(MalformedCalls, ForwardAndBackward) {
  std::mt19937_64 rng(20261129);
  int ok = 0;
  for (int it = 0; it < kIterations; ++it) {
    AttentionCall c(rng);
    if (pick(rng, {0, 0, 1})) c.make_varlen(rng);
    if (pick(rng, {0, 0, 0, 1})) c.add_slopes(rng);
    fc_tensor* tensors[] = {&c.q, &c.k, &c.v, &c.out, &c.lse, &c.dout, &c.dq, &c.dk, &c.dv, &c.cu_q, &c.cu_k, &c.slopes, &c.table};
    const int breaks = static_cast<int>(pick(rng, {1, 1, 2, 3}));
    for (int b = 0; b < breaks; ++b) {
      if (pick(rng, {0, 1, 1})) {
        break_tensor(tensors[std::uniform_int_distribution<int>(0, 12)(rng)], rng, c.pool, cuda_present());
      } else if (pick(rng, {0, 1, 1, 1})) {
        break_options(&c.opt, rng);
      } else {  // drop an optional output, or ask for the error flag
        if (pick(rng, {0, 1})) c.opt.error_flag = &c.flag;
        else c.opt.check_cu_seqlens = 1;
      }
    }
    fc_tensor* lse = pick(rng, {0, 0, 0, 1}) ? nullptr : &c.lse;
    const auto before = c.arena.snapshot();
    size_t ws = 0;
    const std::string where = "iteration " + std::to_string(it);
    const fc_status qs = fc_attention_forward_workspace(&c.q, &c.k, &c.v, &c.opt, &ws);
    expect_clean_outcome(qs, c.arena, before, where + " forward_workspace");
    std::vector<unsigned char> workspace(qs == FC_OK ? ws : 0);
    const fc_status fs = fc_attention_forward(&c.q, &c.k, &c.v, &c.out, lse, &c.opt, workspace.data(), workspace.size());
    expect_clean_outcome(fs, c.arena, before, where + " forward");
    ok += fs == FC_OK;
    const auto after_forward = c.arena.snapshot();
    const fc_status bq = fc_attention_backward_workspace(&c.q, &c.k, &c.v, &c.opt, &ws);
    expect_clean_outcome(bq, c.arena, after_forward, where + " backward_workspace");
    std::vector<unsigned char> bw(bq == FC_OK ? ws : 0);
    const fc_status bs = fc_attention_backward(&c.dout, &c.q, &c.k, &c.v, &c.out, &c.lse, &c.dq, &c.dk, &c.dv, &c.opt,
                                               bw.data(), bw.size());
    expect_clean_outcome(bs, c.arena, after_forward, where + " backward");
    if (HasFailure()) {
      ADD_FAILURE() << "stopping at " << where;
      return;
    }
  }
  // Not a test of error paths only: some broken calls are still valid ones.
  EXPECT_GT(ok, kIterations / 50);
}

// ---- the KV-cache call ------------------------------------------------------------------------

struct KvCall {
  Arena arena;
  fc_tensor q{}, k_cache{}, v_cache{}, k_new{}, v_new{}, out{}, lse{}, lens{}, table{}, batch_idx{}, leftpad{}, cos{},
      sin{}, slopes{};
  fc_kvcache_args args{};
  fc_attention_options opt{};
  std::vector<void*> pool;
  int32_t flag = 0;

  explicit KvCall(std::mt19937_64& rng) {
    // B = 2, Sq = 2, Hq = 4, Hkv = 2, D = 8; contiguous caches (3 rows of 16 slots) or pages of 4.
    const fc_dtype dt = static_cast<fc_dtype>(pick(rng, {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16}));
    const bool paged = pick(rng, {0, 1});
    q = flashcore::make_tensor(arena.add(), dt, {2, 2, 4, 8});
    const int64_t rows = paged ? 9 : 3, slots = paged ? 4 : 16;
    k_cache = flashcore::make_tensor(arena.add(), dt, {rows, slots, 2, 8});
    v_cache = flashcore::make_tensor(arena.add(), dt, {rows, slots, 2, 8});
    k_new = flashcore::make_tensor(arena.add(), dt, {2, 2, 2, 8});
    v_new = flashcore::make_tensor(arena.add(), dt, {2, 2, 2, 8});
    out = flashcore::make_tensor(arena.add(), dt, {2, 2, 4, 8});
    lse = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {2, 4, 2});
    lens = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {2});
    table = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {2, 4});
    batch_idx = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {2});
    leftpad = flashcore::make_tensor(arena.add(), FC_DTYPE_I32, {2});
    cos = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {20, 4});
    sin = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {20, 4});
    slopes = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {4});
    arena.fill(rng);
    auto ints = [](fc_tensor& t) { return static_cast<int32_t*>(t.data); };
    auto value = [&] { return static_cast<int32_t>(pick(rng, {0, 1, 3, 5, 9, 12, 14, 15, 16, 17, -1, INT32_MAX, INT32_MIN})); };
    for (int b = 0; b < 2; ++b) {
      ints(lens)[b] = pick(rng, {0, 1, 1, 1}) ? static_cast<int32_t>(pick(rng, {0, 3, 7, 12})) : value();
      ints(batch_idx)[b] = pick(rng, {0, 1, 1, 1}) ? static_cast<int32_t>(2 - b) : value();
      ints(leftpad)[b] = pick(rng, {0, 1, 1, 1}) ? static_cast<int32_t>(pick(rng, {0, 1, 2})) : value();
    }
    for (int i = 0; i < 8; ++i) ints(table)[i] = pick(rng, {0, 1, 1, 1, 1}) ? 8 - i : value();
    args.q = &q;
    args.k_cache = &k_cache;
    args.v_cache = &v_cache;
    args.cache_seqlens = &lens;
    args.out = &out;
    args.lse = pick(rng, {0, 1, 1}) ? &lse : nullptr;
    if (paged) args.block_table = &table;
    if (pick(rng, {0, 1, 1})) {
      args.k_new = &k_new;
      args.v_new = &v_new;
    }
    if (!paged && pick(rng, {0, 0, 1})) args.cache_batch_idx = &batch_idx;
    if (!paged && pick(rng, {0, 0, 1})) args.cache_leftpad = &leftpad;
    if (pick(rng, {0, 0, 0, 1})) {
      args.rotary_cos = &cos;
      args.rotary_sin = &sin;
      args.rotary_interleaved = static_cast<int32_t>(pick(rng, {0, 1}));
    }
    if (pick(rng, {0, 0, 0, 1})) {
      float* s = static_cast<float*>(slopes.data);
      for (int h = 0; h < 4; ++h) s[h] = pick(rng, {0, 0, 0, 1}) ? std::nanf("") : 0.5f;
      opt.alibi_slopes = &slopes;
    }
    args.num_splits = static_cast<int32_t>(pick(rng, {0, 0, 1, 2, 3, -1, 300}));
    args.error_flag = pick(rng, {0, 1}) ? &flag : nullptr;
    pool = {q.data, k_cache.data, v_cache.data, k_new.data, out.data, lse.data, lens.data, table.data};
    opt.num_threads = 2;
  }
};

TEST(MalformedCalls, KvCache) {
  std::mt19937_64 rng(1129);
  int ok = 0;
  for (int it = 0; it < kIterations; ++it) {
    KvCall c(rng);
    fc_tensor* tensors[] = {&c.q,     &c.k_cache,   &c.v_cache, &c.k_new, &c.v_new, &c.out, &c.lse,
                            &c.lens,  &c.table,     &c.batch_idx, &c.leftpad, &c.cos, &c.sin, &c.slopes};
    const int breaks = static_cast<int>(pick(rng, {0, 1, 1, 2, 3}));
    for (int b = 0; b < breaks; ++b) {
      if (pick(rng, {0, 1, 1})) {
        break_tensor(tensors[std::uniform_int_distribution<int>(0, 13)(rng)], rng, c.pool, cuda_present());
      } else if (pick(rng, {0, 1})) {
        break_options(&c.opt, rng);
      } else {  // optional tensors where they do not belong, or missing where they must be
        switch (std::uniform_int_distribution<int>(0, 6)(rng)) {
          case 0: c.args.k_new = nullptr; break;
          case 1: c.args.cache_seqlens = nullptr; break;
          case 2: c.args.rotary_sin = nullptr; break;
          case 3: c.args.block_table = &c.table; break;
          case 4: c.opt.block_table = &c.table; break;  // the varlen forward's field, not the cache's
          case 5: c.opt.error_flag = &c.flag; break;    // the forward's flag; the call has its own
          default: c.opt.cu_seqlens_q = &c.lens; break;
        }
      }
    }
    const auto before = c.arena.snapshot();
    size_t ws = 0;
    const std::string where = "iteration " + std::to_string(it);
    const fc_status qs = fc_attention_kvcache_workspace(&c.args, &c.opt, &ws);
    expect_clean_outcome(qs, c.arena, before, where + " kvcache_workspace");
    std::vector<unsigned char> workspace(qs == FC_OK ? ws : 0);
    const fc_status st = fc_attention_kvcache(&c.args, &c.opt, workspace.data(), workspace.size());
    expect_clean_outcome(st, c.arena, before, where + " kvcache");
    ok += st == FC_OK;
    if (HasFailure()) {
      ADD_FAILURE() << "stopping at " << where;
      return;
    }
  }
  EXPECT_GT(ok, kIterations / 50);
}

// ---- the merge of partials --------------------------------------------------------------------

TEST(MalformedCalls, MergePartials) {
  std::mt19937_64 rng(291126);
  int ok = 0;
  for (int it = 0; it < kIterations; ++it) {
    Arena arena;
    const fc_dtype dt = static_cast<fc_dtype>(pick(rng, {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16}));
    // 3 parts of (batch 2 x seqlen_q 2, heads 4, head_dim 8).
    fc_tensor op = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {3, 4, 4, 8});
    fc_tensor lp = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {3, 2, 4, 2});
    fc_tensor out = flashcore::make_tensor(arena.add(), dt, {2, 2, 4, 8});
    fc_tensor lse = flashcore::make_tensor(arena.add(), FC_DTYPE_F32, {2, 4, 2});
    arena.fill(rng);
    std::vector<void*> pool = {op.data, lp.data, out.data, lse.data};
    fc_tensor* tensors[] = {&op, &lp, &out, &lse};
    fc_attention_options opt{};
    const int breaks = static_cast<int>(pick(rng, {0, 1, 1, 2}));
    for (int b = 0; b < breaks; ++b) {
      if (pick(rng, {0, 1, 1, 1})) break_tensor(tensors[std::uniform_int_distribution<int>(0, 3)(rng)], rng, pool, cuda_present());
      else break_options(&opt, rng);
    }
    const auto before = arena.snapshot();
    const fc_status st = fc_merge_partials(&op, &lp, &out, pick(rng, {0, 1, 1}) ? &lse : nullptr, &opt);
    expect_clean_outcome(st, arena, before, "iteration " + std::to_string(it) + " merge_partials");
    ok += st == FC_OK;
    if (HasFailure()) return;
  }
  EXPECT_GT(ok, kIterations / 50);
}

}  // namespace
