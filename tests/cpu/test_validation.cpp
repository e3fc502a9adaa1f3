// Every bad input from TESTING.md: a clear error naming the argument, and nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "flashcore/flashcore.hpp"

namespace {

/** A valid dense call (B=2, Sq=5, Sk=7, Hq=4, Hkv=2, D=8, fp32) whose pieces tests break. */
class BadInput : public ::testing::Test {
 protected:
  std::vector<float> qb = std::vector<float>(2 * 5 * 4 * 8, 0.5f), kb = std::vector<float>(2 * 7 * 2 * 8, 0.25f),
                     vb = std::vector<float>(2 * 7 * 2 * 8, 1.f), ob = std::vector<float>(2 * 5 * 4 * 8, -7.f),
                     lb = std::vector<float>(2 * 4 * 5, -7.f), dob = std::vector<float>(2 * 5 * 4 * 8, 0.1f),
                     dqb = std::vector<float>(2 * 5 * 4 * 8, -7.f), dkb = std::vector<float>(2 * 7 * 2 * 8, -7.f),
                     dvb = std::vector<float>(2 * 7 * 2 * 8, -7.f);
  fc_tensor q = flashcore::make_tensor(qb.data(), FC_DTYPE_F32, {2, 5, 4, 8});
  fc_tensor k = flashcore::make_tensor(kb.data(), FC_DTYPE_F32, {2, 7, 2, 8});
  fc_tensor v = flashcore::make_tensor(vb.data(), FC_DTYPE_F32, {2, 7, 2, 8});
  fc_tensor out = flashcore::make_tensor(ob.data(), FC_DTYPE_F32, {2, 5, 4, 8});
  fc_tensor lse = flashcore::make_tensor(lb.data(), FC_DTYPE_F32, {2, 4, 5});
  fc_tensor dout = flashcore::make_tensor(dob.data(), FC_DTYPE_F32, {2, 5, 4, 8});
  fc_tensor dq = flashcore::make_tensor(dqb.data(), FC_DTYPE_F32, {2, 5, 4, 8});
  fc_tensor dk = flashcore::make_tensor(dkb.data(), FC_DTYPE_F32, {2, 7, 2, 8});
  fc_tensor dv = flashcore::make_tensor(dvb.data(), FC_DTYPE_F32, {2, 7, 2, 8});
  fc_attention_options opt{};

  bool outputs_untouched() const {
    for (const auto* buf : {&ob, &lb, &dqb, &dkb, &dvb})
      for (float x : *buf)
        if (x != -7.f) return false;
    return true;
  }

  void expect_forward_error(const std::string& needle, fc_status code = FC_ERROR_INVALID_ARGUMENT) {
    const fc_status s = fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0);
    EXPECT_EQ(s, code) << fc_last_error();
    EXPECT_NE(std::string(fc_last_error()).find(needle), std::string::npos)
        << "message: '" << fc_last_error() << "' lacks '" << needle << "'";
    EXPECT_TRUE(outputs_untouched());
  }
  void expect_backward_error(const std::string& needle, fc_status code = FC_ERROR_INVALID_ARGUMENT) {
    const fc_status s = fc_attention_backward(&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &opt, nullptr, 0);
    EXPECT_EQ(s, code) << fc_last_error();
    EXPECT_NE(std::string(fc_last_error()).find(needle), std::string::npos)
        << "message: '" << fc_last_error() << "' lacks '" << needle << "'";
    EXPECT_TRUE(outputs_untouched());
  }
};

TEST_F(BadInput, ValidCallSucceedsAndClearsError) {
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  EXPECT_STREQ(fc_last_error(), "");
  EXPECT_EQ(fc_attention_backward(&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &opt, nullptr, 0), FC_OK)
      << fc_last_error();
}

TEST_F(BadInput, Dtypes) {
  k.dtype = FC_DTYPE_F16;
  expect_forward_error("k: dtype float16 does not match float32");
  k.dtype = FC_DTYPE_F32;
  q.dtype = k.dtype = v.dtype = out.dtype = FC_DTYPE_I32;
  expect_forward_error("q: dtype int32 is not supported");
  q.dtype = k.dtype = v.dtype = FC_DTYPE_F32;
  out.dtype = FC_DTYPE_BF16;
  expect_forward_error("out: dtype bfloat16");
  out.dtype = FC_DTYPE_F32;
  lse.dtype = FC_DTYPE_F16;
  expect_forward_error("lse: dtype float16");
  lse.dtype = FC_DTYPE_F32;
  q.dtype = 17;
  expect_forward_error("q: unknown dtype");
}

TEST_F(BadInput, MismatchedShapes) {
  k.shape[0] = 1;
  v.shape[0] = 1;
  expect_forward_error("k: batch 1 does not match q batch 2");
  k.shape[0] = v.shape[0] = 2;
  k.shape[3] = 4;
  expect_forward_error("k: head_dim 4 does not match q head_dim 8");
  k.shape[3] = 8;
  v.shape[1] = 6;
  expect_forward_error("v: shape");
  v.shape[1] = 7;
  out.shape[1] = 4;
  expect_forward_error("out: shape");
  out.shape[1] = 5;
  lse.shape[2] = 7;
  expect_forward_error("lse: shape");
  lse.shape[2] = 5;
  dk.shape[1] = 5;
  expect_backward_error("dk: shape");
  dk.shape[1] = 7;
  dout.shape[2] = 2;
  expect_backward_error("dout: shape");
  dout.shape[2] = 4;
  q.ndim = 3;
  expect_forward_error("q: has 3 dimensions, expected 4");
}

TEST_F(BadInput, Heads) {
  k.shape[2] = v.shape[2] = 3;
  expect_forward_error("k: heads_kv 3 does not divide q heads 4");
  k.shape[2] = v.shape[2] = 0;
  expect_forward_error("k: number of heads 0");
}

TEST_F(BadInput, HeadDim) {
  q.shape[3] = k.shape[3] = v.shape[3] = out.shape[3] = 0;
  expect_forward_error("q: head_dim 0 is outside 1..256");
  std::vector<float> big(2 * 5 * 4 * 264), bigk(2 * 7 * 2 * 264), bigv(2 * 7 * 2 * 264);
  q = flashcore::make_tensor(big.data(), FC_DTYPE_F32, {2, 5, 4, 264});
  k = flashcore::make_tensor(bigk.data(), FC_DTYPE_F32, {2, 7, 2, 264});
  v = flashcore::make_tensor(bigv.data(), FC_DTYPE_F32, {2, 7, 2, 264});
  expect_forward_error("q: head_dim 264 is outside 1..256");
}

TEST_F(BadInput, Strides) {
  q.strides[3] = 2;
  expect_forward_error("q: last dimension has stride 2");
  q.strides[3] = 1;
  out.strides[1] = 0;  // every sequence position writes the same row
  expect_forward_error("out: strides make elements overlap");
  out.strides[1] = 32;
  dq.strides[0] = 8;  // batches overlap
  expect_backward_error("dq: strides make elements overlap");
}

TEST_F(BadInput, NullPointers) {
  const fc_status s = fc_attention_forward(nullptr, &k, &v, &out, &lse, &opt, nullptr, 0);
  EXPECT_EQ(s, FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("q: is null"), std::string::npos);
  EXPECT_EQ(fc_attention_forward(&q, &k, &v, nullptr, &lse, &opt, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("out: is null"), std::string::npos);
  v.data = nullptr;
  expect_forward_error("v: data pointer is null");
  v.data = vb.data();
  EXPECT_EQ(fc_attention_backward(&dout, &q, &k, &v, &out, nullptr, &dq, &dk, &dv, &opt, nullptr, 0),
            FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("lse: is null"), std::string::npos);
  size_t* null_bytes = nullptr;
  EXPECT_EQ(fc_attention_forward_workspace(&q, &k, &v, &opt, null_bytes), FC_ERROR_INVALID_ARGUMENT);
}

TEST_F(BadInput, NegativeSizesAndOverflow) {
  q.shape[1] = -5;
  expect_forward_error("q: dimension 1 has negative size -5");
  q.shape[1] = 5;
  k.shape[1] = v.shape[1] = int64_t(1) << 62;
  expect_forward_error("k: shape");  // more elements than int64 can count
  k.shape[1] = v.shape[1] = 7;
  k.strides[1] = std::numeric_limits<int64_t>::max() / 2;
  expect_forward_error("k: stride");
  // Fits int64 but no address space: refused, not a fault (an unset stride of a C caller, say).
  k.strides[1] = int64_t(1) << 58;
  expect_forward_error("k: its strides reach");
  k.strides[1] = -(int64_t(1) << 58);
  expect_forward_error("k: its strides reach");
  k.strides[1] = 2 * 8;
  v.strides[0] = -(int64_t(1) << 50);
  v.data = reinterpret_cast<void*>(uintptr_t(1) << 20);  // 2^50 bytes below it is below address 0
  expect_forward_error("v: data pointer plus its strides wraps around");
  v.strides[0] = 7 * 2 * 8;
  v.data = reinterpret_cast<unsigned char*>(vb.data()) + 2;
  expect_forward_error("v: data pointer is not aligned to its 4-byte elements");
}

TEST_F(BadInput, Aliasing) {
  out.data = qb.data();
  expect_forward_error("out: memory overlaps q");
  out.data = ob.data();
  lse.data = ob.data() + 4;
  expect_forward_error("lse: memory overlaps out");
  lse.data = lb.data();
  dk = flashcore::make_tensor(dqb.data(), FC_DTYPE_F32, {2, 7, 2, 8});
  expect_backward_error("dk: memory overlaps dq");
}

TEST_F(BadInput, Options) {
  opt.softmax_scale = NAN;
  expect_forward_error("softmax_scale: must be finite");
  opt.softmax_scale = INFINITY;
  expect_forward_error("softmax_scale: must be finite");
  opt.softmax_scale = 1e300;
  expect_forward_error("softmax_scale: ");  // overflows float32
  opt.softmax_scale = 0;
  opt.softcap = 1e300;
  expect_forward_error("softcap: ");
  opt.softcap = 1e-50;  // would flush to 0 = "off"
  expect_forward_error("softcap: ");
  opt.softcap = -1;
  expect_forward_error("softcap: must be finite and >= 0");
  opt.softcap = NAN;
  expect_forward_error("softcap: must be finite and >= 0");
  opt.softcap = 0;
  opt.has_window = 1;
  opt.window_left = -2;
  opt.window_right = -1;
  expect_forward_error("window_left: -2 is below -1");
  opt.window_left = 3;
  opt.window_right = -5;
  expect_forward_error("window_right: -5 is below -1");
  opt.has_window = 0;
  opt.backend = 42;
  expect_forward_error("backend: unknown backend code 42");
  opt.backend = 0;
  opt.num_threads = -1;
  expect_forward_error("num_threads: -1 is negative");
  opt.num_threads = 0;
  opt.sm_margin = -3;
  expect_forward_error("sm_margin: -3 is negative");
  opt.sm_margin = 0;
  opt.dropout_p = -0.1;
  expect_forward_error("dropout_p: -0.100000 is outside [0, 1)");
  opt.dropout_p = 1.0;
  expect_forward_error("dropout_p: 1.000000 is outside [0, 1)");
  opt.dropout_p = NAN;
  expect_forward_error("dropout_p: ");
  opt.dropout_p = 0.99999999;  // below 1, but its keep probability rounds to 0 at 2^-16 steps
  expect_forward_error("keeps nothing");
  opt.dropout_p = 0.99999;  // keeps 1 / 65536: valid
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  opt.dropout_p = 0;
  opt.sm_margin = 1000;  // more than any GPU has: the grids keep one SM; CPU backends ignore it
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
}

TEST_F(BadInput, WorkspaceQueryValidatesToo) {
  size_t bytes = 123;
  k.shape[3] = 4;
  EXPECT_EQ(fc_attention_forward_workspace(&q, &k, &v, &opt, &bytes), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("k: head_dim"), std::string::npos);
  k.shape[3] = 8;
  EXPECT_EQ(fc_attention_forward_workspace(&q, &k, &v, &opt, &bytes), FC_OK);
  EXPECT_EQ(bytes, 0u);  // CPU backends need no workspace
}

TEST_F(BadInput, DeviceMismatch) {
  k.device_type = FC_DEVICE_CUDA;
  expect_forward_error("k: is on cuda:0 but q is on cpu");
  k.device_type = FC_DEVICE_CPU;
  lse.device_type = FC_DEVICE_CUDA;
  expect_forward_error("lse: is on cuda:0 but q is on cpu");
  lse.device_type = FC_DEVICE_CPU;
  // CPU tensors given to a CUDA backend (and the reverse) name the tensor and the backend.
  opt.backend = FC_BACKEND_CUDA_SM80;
  expect_forward_error("q: is a cpu tensor but backend cuda_sm80 needs cuda tensors");
  opt.backend = FC_BACKEND_CUDA_SM90;
  expect_forward_error("q: is a cpu tensor but backend cuda_sm90 needs cuda tensors");
  opt.backend = FC_BACKEND_CPU_FLASH;
  q.device_type = k.device_type = v.device_type = out.device_type = lse.device_type = FC_DEVICE_CUDA;
  expect_forward_error("q: is a cuda tensor but backend cpu_flash needs cpu tensors");
}

// alibi_slopes: float32 (heads_q) or (batch, heads_q) on q's device, finite (checked on the CPU),
// and never the memory of an output.
TEST_F(BadInput, AlibiSlopes) {
  std::vector<float> slopes(3 * 4, 0.25f);  // room for every shape below
  fc_tensor ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {4});
  opt.alibi_slopes = &ts;
  ts.dtype = FC_DTYPE_F16;
  expect_forward_error("alibi_slopes: dtype float16 does not match float32");
  expect_backward_error("alibi_slopes: dtype float16 does not match float32");
  ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {2, 2, 3});
  expect_forward_error("alibi_slopes: has 3 dimensions, expected 1 (heads_q) or 2 (batch, heads_q)");
  expect_backward_error("alibi_slopes: has 3 dimensions");
  ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {5});  // heads_q + 1
  expect_forward_error("alibi_slopes: shape [5]");
  expect_backward_error("alibi_slopes: shape [5]");
  ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {3, 4});  // batch + 1
  expect_forward_error("alibi_slopes: shape [3, 4]");
  expect_backward_error("alibi_slopes: shape [3, 4]");
  ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {4});
  slopes[2] = NAN;
  expect_forward_error("alibi_slopes: entry [2] is not finite");
  expect_backward_error("alibi_slopes: entry [2] is not finite");
  slopes[2] = 0.25f;
  ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {2, 4});
  slopes[7] = INFINITY;
  expect_forward_error("alibi_slopes: entry [1, 3] is not finite");
  slopes[7] = -INFINITY;
  expect_backward_error("alibi_slopes: entry [1, 3] is not finite");
  slopes[7] = 0.25f;
  ts.device_type = FC_DEVICE_CUDA;
  expect_forward_error("alibi_slopes: is on cuda:0 but q is on cpu");
  expect_backward_error("alibi_slopes: is on cuda:0 but q is on cpu");
  ts = flashcore::make_tensor(ob.data() + 8, FC_DTYPE_F32, {4});  // inside out (values -7: finite)
  expect_forward_error("out: memory overlaps alibi_slopes");
  ts = flashcore::make_tensor(lb.data(), FC_DTYPE_F32, {2, 4});
  expect_forward_error("lse: memory overlaps alibi_slopes");
  ts = flashcore::make_tensor(dqb.data() + 40, FC_DTYPE_F32, {4});
  expect_backward_error("dq: memory overlaps alibi_slopes");
  ts = flashcore::make_tensor(dvb.data(), FC_DTYPE_F32, {2, 4});
  expect_backward_error("dv: memory overlaps alibi_slopes");
}

// Slopes of shape (batch, heads_q) with a padded batch stride reach cpu_flash's rows as they
// reach the reference's: the same lse (the bias is all that varies over the keys here).
TEST_F(BadInput, AlibiSlopesStridedMatchReference) {
  std::vector<float> slopes = {0.5f, 0.25f, 1.f, 0.125f, -1.f, -1.f, 2.f, 0.0625f, 0.75f, 0.375f};
  fc_tensor ts = flashcore::make_tensor(slopes.data(), FC_DTYPE_F32, {2, 4});
  ts.strides[0] = 6;  // row 1 starts at slopes[6]; slopes[4, 5] are padding
  opt.alibi_slopes = &ts;
  opt.causal = 1;
  opt.backend = FC_BACKEND_CPU_REFERENCE;
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  const std::vector<float> reference_lse = lb;
  opt.backend = FC_BACKEND_CPU_FLASH;
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  for (size_t i = 0; i < lb.size(); ++i) EXPECT_NEAR(lb[i], reference_lse[i], 1e-5) << "lse entry " << i;
  EXPECT_EQ(fc_attention_backward(&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &opt, nullptr, 0), FC_OK)
      << fc_last_error();
}

TEST_F(BadInput, Sm90BackwardNeedsCudaTensors) {
  // The Hopper backward, forced on CPU tensors, names the tensor and the backend (its own
  // refusals on a GPU, e.g. head_dim 256, are tested in tests/cuda and tests/python).
  opt.backend = FC_BACKEND_CUDA_SM90;
  expect_backward_error("dout: is a cpu tensor but backend cuda_sm90 needs cuda tensors");
}

/** Varlen: (total, heads, dim) tensors with int32 prefix sums. */
class BadVarlen : public ::testing::Test {
 protected:
  std::vector<float> qb = std::vector<float>(10 * 2 * 8, 1.f), kb = std::vector<float>(12 * 2 * 8, 1.f),
                     vb = std::vector<float>(12 * 2 * 8, 1.f), ob = std::vector<float>(10 * 2 * 8, -7.f),
                     lb = std::vector<float>(2 * 10, -7.f);
  std::vector<int32_t> cq = {0, 4, 10}, ck = {0, 5, 12};
  fc_tensor q = flashcore::make_tensor(qb.data(), FC_DTYPE_F32, {10, 2, 8});
  fc_tensor k = flashcore::make_tensor(kb.data(), FC_DTYPE_F32, {12, 2, 8});
  fc_tensor v = flashcore::make_tensor(vb.data(), FC_DTYPE_F32, {12, 2, 8});
  fc_tensor out = flashcore::make_tensor(ob.data(), FC_DTYPE_F32, {10, 2, 8});
  fc_tensor lse = flashcore::make_tensor(lb.data(), FC_DTYPE_F32, {2, 10});
  fc_tensor tcq = flashcore::make_tensor(cq.data(), FC_DTYPE_I32, {3});
  fc_tensor tck = flashcore::make_tensor(ck.data(), FC_DTYPE_I32, {3});
  fc_attention_options opt{};
  void SetUp() override {
    opt.cu_seqlens_q = &tcq;
    opt.cu_seqlens_k = &tck;
    opt.max_seqlen_q = 6;
    opt.max_seqlen_k = 7;
  }
  void expect_error(const std::string& needle) {
    EXPECT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fc_last_error()).find(needle), std::string::npos)
        << "message: '" << fc_last_error() << "' lacks '" << needle << "'";
    for (float x : ob) ASSERT_EQ(x, -7.f);
    for (float x : lb) ASSERT_EQ(x, -7.f);
  }
};

TEST_F(BadVarlen, ValidCallSucceeds) {
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
}

TEST_F(BadVarlen, CuSeqlens) {
  cq = {1, 4, 10};
  expect_error("cu_seqlens_q: starts at 1");
  cq = {0, 6, 4};
  expect_error("cu_seqlens_q: decreases at index 2");
  // The array's own rules come before max_seqlen's: a decrease or an overlong last entry is
  // named as such even where it also makes a length longer than max_seqlen.
  cq = {0, 10, 4};
  expect_error("cu_seqlens_q: decreases at index 2");
  cq = {0, 4, 11};
  expect_error("cu_seqlens_q: last entry 11 exceeds the packed tensor's 10 rows");
  opt.max_seqlen_q = 7;
  expect_error("cu_seqlens_q: last entry 11 exceeds the packed tensor's 10 rows");
  cq = {0, 4, 10};
  opt.max_seqlen_q = 5;
  expect_error("max_seqlen_q: 5 is smaller than sequence 1's length 6");
  opt.max_seqlen_q = 6;
  ck = {0, 9, 12};
  expect_error("max_seqlen_k: 7 is smaller than sequence 0's length 9");
  ck = {0, 5, 12};
  opt.cu_seqlens_k = nullptr;
  expect_error("cu_seqlens_k: is null but cu_seqlens_q is given");
  opt.cu_seqlens_k = &tck;
  tck.dtype = FC_DTYPE_F32;
  expect_error("cu_seqlens_k: dtype float32 does not match int32");
  tck.dtype = FC_DTYPE_I32;
  tck.shape[0] = 2;
  expect_error("cu_seqlens_k: has 2 entries but cu_seqlens_q has 3");
  tck.shape[0] = 3;
  lse = flashcore::make_tensor(lb.data(), FC_DTYPE_F32, {2, 2, 5});
  expect_error("lse: has 3 dimensions, expected 2");
  opt.max_seqlen_k = -1;
  expect_error("max_seqlen_k: -1 is negative");
}

TEST_F(BadVarlen, PagedKv) {
  // k / v as 3 pages of 4 keys (12 rows, so the packed extents are the same), sequences of 5 and 7
  // keys over pages {2, 0} and {1, 2}.
  std::vector<int32_t> table = {2, 0, 1, 2};
  fc_tensor tt = flashcore::make_tensor(table.data(), FC_DTYPE_I32, {2, 2});
  fc_tensor pk = flashcore::make_tensor(kb.data(), FC_DTYPE_F32, {3, 4, 2, 8});
  fc_tensor pv = flashcore::make_tensor(vb.data(), FC_DTYPE_F32, {3, 4, 2, 8});
  k = pk;
  v = pv;
  opt.block_table = &tt;
  ASSERT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  for (float& x : ob) x = -7.f;
  for (float& x : lb) x = -7.f;
  table[3] = 3;
  expect_error("block_table: entry [1, 1] is page 3, outside 0..2 (k pages)");
  table[3] = -1;
  expect_error("block_table: entry [1, 1] is page -1");
  table[3] = 2;
  ck = {0, 5, 14};
  opt.max_seqlen_k = 9;
  expect_error("cu_seqlens_k: sequence 1 has 9 keys, more than its 2 pages of 4 hold (block_table)");
  ck = {0, 5, 12};
  opt.max_seqlen_k = 7;
  tt.dtype = FC_DTYPE_F32;
  expect_error("block_table: dtype float32 does not match int32");
  tt.dtype = FC_DTYPE_I32;
  tt.shape[0] = 3;
  expect_error("block_table: shape [3, 2] has 3 rows, expected batch 2");
  tt.shape[0] = 2;
  k = flashcore::make_tensor(kb.data(), FC_DTYPE_F32, {12, 2, 8});
  expect_error("k: has 3 dimensions, expected 4");
  k = flashcore::make_tensor(kb.data(), FC_DTYPE_F32, {0, 4, 2, 8});
  v = flashcore::make_tensor(vb.data(), FC_DTYPE_F32, {0, 4, 2, 8});
  expect_error("k: shape [0, 4, 2, 8] has no pages or empty pages");
  k = pk;
  v = pv;
  out.data = table.data();
  out.dtype = FC_DTYPE_F32;
  expect_error("out: ");  // overlaps block_table (or q): never written
  out = flashcore::make_tensor(ob.data(), FC_DTYPE_F32, {10, 2, 8});
  // Paged K/V needs a varlen call and is forward only.
  fc_attention_options dense{};
  dense.block_table = &tt;
  EXPECT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &dense, nullptr, 0), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(fc_last_error()).rfind("block_table: paged K/V needs a varlen call", 0), 0u) << fc_last_error();
  std::vector<float> g(qb.size()), gk(kb.size()), gv(vb.size());
  fc_tensor dq = flashcore::make_tensor(g.data(), FC_DTYPE_F32, {10, 2, 8});
  fc_tensor dk = flashcore::make_tensor(gk.data(), FC_DTYPE_F32, {3, 4, 2, 8});
  fc_tensor dv = flashcore::make_tensor(gv.data(), FC_DTYPE_F32, {3, 4, 2, 8});
  EXPECT_EQ(fc_attention_backward(&out, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &opt, nullptr, 0),
            FC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(fc_last_error()).rfind("block_table: paged K/V is forward only", 0), 0u) << fc_last_error();
}

// Alignment rules of the GPU paths are checked before any GPU work; test them directly so they
// are covered on machines without a GPU.
TEST(BackendRules, CudaAlignmentAndDtype) {
  alignas(16) static uint16_t buf[4096];
  fc_tensor q = flashcore::make_tensor(buf + 1, FC_DTYPE_F16, {1, 4, 2, 16});  // 2-byte aligned only
  q.device_type = FC_DEVICE_CUDA;
  flashcore::AttentionParams p;
  p.dtype = flashcore::DType::F16;
  p.head_dim = 16;
  const fc_tensor* ts[] = {&q};
  const char* ns[] = {"q"};
  flashcore::Status s = flashcore::validate_for_backend(p, FC_BACKEND_CUDA_SM80, ts, ns, 1);
  EXPECT_EQ(s.code, FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("q: data pointer is not 16-byte aligned"), std::string::npos) << s.message;
  q.data = buf;
  q.strides[1] = 36;  // row stride not a multiple of 8 elements
  s = flashcore::validate_for_backend(p, FC_BACKEND_CUDA_SM80, ts, ns, 1);
  EXPECT_NE(s.message.find("q: stride 36 of dimension 1 is not a multiple of 8"), std::string::npos) << s.message;
  q.strides[1] = 32;
  p.head_dim = 12;
  s = flashcore::validate_for_backend(p, FC_BACKEND_CUDA_SM80, ts, ns, 1);
  EXPECT_EQ(s.code, FC_ERROR_UNSUPPORTED);
  EXPECT_NE(s.message.find("head_dim 12 is not a multiple of 8"), std::string::npos) << s.message;
  p.dtype = flashcore::DType::F32;
  s = flashcore::validate_for_backend(p, FC_BACKEND_CUDA_SM80, ts, ns, 1);
  EXPECT_NE(s.message.find("float32 is not supported by backend cuda_sm80"), std::string::npos) << s.message;
}

TEST(BackendRules, UnavailableCudaBackendIsAClearError) {
  if (fc_cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present; this checks the no-GPU message";
  alignas(16) static uint16_t qb[1024], kb[1024], vb[1024], ob[1024];
  fc_tensor q = flashcore::make_tensor(qb, FC_DTYPE_F16, {1, 4, 2, 16}), k = flashcore::make_tensor(kb, FC_DTYPE_F16, {1, 4, 2, 16}),
            v = flashcore::make_tensor(vb, FC_DTYPE_F16, {1, 4, 2, 16}), out = flashcore::make_tensor(ob, FC_DTYPE_F16, {1, 4, 2, 16});
  for (fc_tensor* t : {&q, &k, &v, &out}) t->device_type = FC_DEVICE_CUDA;
  fc_attention_options opt{};
  EXPECT_EQ(fc_attention_forward(&q, &k, &v, &out, nullptr, &opt, nullptr, 0), FC_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(fc_last_error()).find("cuda_sm80 is not available"), std::string::npos) << fc_last_error();
}

TEST(DeviceInfo, DescribeRejectsBadArgumentsAndWritesNothing) {
  char buf[16];
  std::memset(buf, 'x', sizeof(buf));
  auto untouched = [&] {
    for (char c : buf)
      if (c != 'x') return false;
    return true;
  };
  EXPECT_EQ(fc_cuda_device_describe(0, nullptr, sizeof(buf)), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("buffer: is null"), std::string::npos) << fc_last_error();
  EXPECT_EQ(fc_cuda_device_describe(0, buf, 0), FC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fc_last_error()).find("buffer:"), std::string::npos) << fc_last_error();
  for (int32_t bad : {-1, fc_cuda_device_count(), 1 << 30}) {
    EXPECT_EQ(fc_cuda_device_describe(bad, buf, sizeof(buf)), FC_ERROR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(fc_last_error()).find("device_id: " + std::to_string(bad) + " is not a visible CUDA device"),
              std::string::npos)
        << fc_last_error();
  }
  EXPECT_TRUE(untouched());
}

}  // namespace

namespace {

TEST_F(BadInput, ErrorFlagAlignment) {
  alignas(8) char storage[8] = {};
  opt.error_flag = reinterpret_cast<int32_t*>(storage + 1);
  expect_forward_error("error_flag: is not 4-byte aligned");
  expect_backward_error("error_flag: is not 4-byte aligned");
  opt.error_flag = reinterpret_cast<int32_t*>(storage);  // CPU calls validate on the host: no flag
  EXPECT_EQ(fc_attention_forward(&q, &k, &v, &out, &lse, &opt, nullptr, 0), FC_OK) << fc_last_error();
  EXPECT_EQ(storage[0], 0);
}

}  // namespace
