// Direct calls of the GPU dropout tests (test_cuda_dropout*.cpp): small dense problems as 16-bit
// host patterns, one forward (and backward, when dout is given; or several backwards, on other
// backends, of one forward) through the C ABI, and the conversions the tests read results with.
// Shared so the backends' tests call the library alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/harness.hpp"
#include "cuda/cuda_memory.hpp"
#include "flashcore/flashcore.hpp"

namespace flashcore::testing::dropout_calls {

inline uint16_t one_bits(int32_t dtype) { return dtype == FC_DTYPE_F16 ? 0x3C00 : 0x3F80; }

inline float bits_to_float(uint16_t b, int32_t dtype) {
  uint32_t u;
  if (dtype == FC_DTYPE_BF16) {
    u = static_cast<uint32_t>(b) << 16;
  } else {  // fp16 -> fp32 (normals, zero and subnormals; no inf / NaN expected here)
    const uint32_t sign = (b & 0x8000u) << 16, exp = (b >> 10) & 0x1F, man = b & 0x3FFu;
    if (exp == 0) {
      const float f = std::ldexp(static_cast<float>(man), -24);
      return sign ? -f : f;
    }
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bits(float f, int32_t dtype) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (dtype == FC_DTYPE_BF16) return static_cast<uint16_t>(u >> 16);  // truncation: any value will do
  // fp16 of a value in [-4, 4]: exponent rebiased, mantissa truncated.
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((u >> 13) & 0x3FFu));
}

/** A dense call's host tensors (16-bit patterns), (batch, seqlen, heads, head_dim) each. */
struct DenseProblem {
  int64_t batch = 2, sq = 1, sk = 1, heads_q = 2, heads_kv = 2, d = 64;
  int32_t dtype = FC_DTYPE_F16;
  std::vector<uint16_t> q, k, v, dout;

  size_t q_elems() const { return static_cast<size_t>(batch * sq * heads_q * d); }
  size_t k_elems() const { return static_cast<size_t>(batch * sk * heads_kv * d); }
};

struct DenseResult {
  std::vector<uint16_t> out, dq, dk, dv;
  std::vector<float> lse;
  std::string error;  // non-empty when a call failed
};

/** The forward on opt.backend, then (when pr.dout is given) one backward per entry of
 *  backward_backends on that forward's out and lse, on the GPU through the C ABI: every backward
 *  sees the same O, so backends compare on one forward. Result i holds the forward's out / lse and
 *  backward i's dq / dk / dv, or its error (a failed forward's error is every result's); with no
 *  dout or no backends, one result: the forward alone. opt's other fields (causal, deterministic,
 *  dropout, ...) go to every call. */
inline std::vector<DenseResult> run_dense_backwards(CudaMemory& mem, const DenseProblem& pr, fc_attention_options opt,
                                                    const std::vector<fc_backend>& backward_backends) {
  const bool backward = !pr.dout.empty() && !backward_backends.empty();
  std::vector<DenseResult> results(backward ? backward_backends.size() : 1);
  const auto dt = static_cast<fc_dtype>(pr.dtype);
  std::vector<void*> owned;
  auto upload = [&](const std::vector<uint16_t>& host, size_t elems) {
    void* dev = mem.alloc(elems * 2);
    owned.push_back(dev);
    if (!host.empty()) mem.upload(dev, host.data(), elems * 2);
    return dev;
  };
  auto finish = [&] {
    for (void* p : owned) mem.release(p);
    return results;
  };
  auto fail = [&](const std::string& error) {
    for (DenseResult& r : results) r.error = error;
    return finish();
  };
  void* q = upload(pr.q, pr.q_elems());
  void* k = upload(pr.k, pr.k_elems());
  void* v = upload(pr.v, pr.k_elems());
  void* out = upload({}, pr.q_elems());
  void* lse = mem.alloc(static_cast<size_t>(pr.batch * pr.heads_q * pr.sq) * sizeof(float));
  owned.push_back(lse);
  fc_tensor tq = make_tensor(q, dt, {pr.batch, pr.sq, pr.heads_q, pr.d}, FC_DEVICE_CUDA);
  fc_tensor tk = make_tensor(k, dt, {pr.batch, pr.sk, pr.heads_kv, pr.d}, FC_DEVICE_CUDA);
  fc_tensor tv = make_tensor(v, dt, {pr.batch, pr.sk, pr.heads_kv, pr.d}, FC_DEVICE_CUDA);
  fc_tensor to = make_tensor(out, dt, {pr.batch, pr.sq, pr.heads_q, pr.d}, FC_DEVICE_CUDA);
  fc_tensor tl = make_tensor(lse, FC_DTYPE_F32, {pr.batch, pr.heads_q, pr.sq}, FC_DEVICE_CUDA);
  opt.stream = mem.stream();
  size_t ws_bytes = 0;
  if (fc_attention_forward_workspace(&tq, &tk, &tv, &opt, &ws_bytes) != FC_OK) return fail(fc_last_error());
  void* ws = ws_bytes ? mem.alloc(ws_bytes) : nullptr;
  if (ws) owned.push_back(ws);
  if (fc_attention_forward(&tq, &tk, &tv, &to, &tl, &opt, ws, ws_bytes) != FC_OK) return fail(fc_last_error());
  DenseResult& first = results.front();
  first.out.resize(pr.q_elems());
  mem.download(first.out.data(), out, pr.q_elems() * 2);
  first.lse.resize(static_cast<size_t>(pr.batch * pr.heads_q * pr.sq));
  mem.download(first.lse.data(), lse, first.lse.size() * sizeof(float));
  for (size_t b = 1; b < results.size(); ++b) {
    results[b].out = first.out;
    results[b].lse = first.lse;
  }
  if (!backward) return finish();
  void* dout = upload(pr.dout, pr.q_elems());
  fc_tensor tdo = make_tensor(dout, dt, {pr.batch, pr.sq, pr.heads_q, pr.d}, FC_DEVICE_CUDA);
  for (size_t b = 0; b < backward_backends.size(); ++b) {
    DenseResult& r = results[b];
    opt.backend = backward_backends[b];
    void* dq = upload({}, pr.q_elems());
    void* dk = upload({}, pr.k_elems());
    void* dv = upload({}, pr.k_elems());
    fc_tensor tdq = make_tensor(dq, dt, {pr.batch, pr.sq, pr.heads_q, pr.d}, FC_DEVICE_CUDA);
    fc_tensor tdk = make_tensor(dk, dt, {pr.batch, pr.sk, pr.heads_kv, pr.d}, FC_DEVICE_CUDA);
    fc_tensor tdv = make_tensor(dv, dt, {pr.batch, pr.sk, pr.heads_kv, pr.d}, FC_DEVICE_CUDA);
    size_t bws_bytes = 0;
    if (fc_attention_backward_workspace(&tq, &tk, &tv, &opt, &bws_bytes) != FC_OK) {
      r.error = fc_last_error();
      continue;
    }
    void* bws = bws_bytes ? mem.alloc(bws_bytes) : nullptr;
    if (bws) owned.push_back(bws);
    if (fc_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, &opt, bws, bws_bytes) != FC_OK) {
      r.error = fc_last_error();
      continue;
    }
    r.dq.resize(pr.q_elems());
    r.dk.resize(pr.k_elems());
    r.dv.resize(pr.k_elems());
    mem.download(r.dq.data(), dq, pr.q_elems() * 2);
    mem.download(r.dk.data(), dk, pr.k_elems() * 2);
    mem.download(r.dv.data(), dv, pr.k_elems() * 2);
  }
  return finish();
}

/** Forward (and, when pr.dout is given, backward) on opt.backend on the GPU through the C ABI. */
inline DenseResult run_dense(CudaMemory& mem, const DenseProblem& pr, fc_attention_options opt) {
  return run_dense_backwards(mem, pr, opt, {static_cast<fc_backend>(opt.backend)}).front();
}

inline fc_attention_options dropout_options(fc_backend backend, double p, uint64_t seed, uint64_t offset) {
  fc_attention_options opt{};
  opt.backend = backend;
  opt.dropout_p = p;
  opt.dropout_seed = seed;
  opt.dropout_offset = offset;
  return opt;
}

/** q, k, v (and dout when with_dout: run_dense then runs the backward too) uniform in [-1, 1]. */
inline DenseProblem random_problem(int64_t d, int32_t dtype, uint64_t seed, int64_t sq = 150, int64_t sk = 230,
                                   int64_t heads_q = 4, int64_t heads_kv = 2, int64_t batch = 2,
                                   bool with_dout = false) {
  DenseProblem pr;
  pr.batch = batch;
  pr.sq = sq;
  pr.sk = sk;
  pr.heads_q = heads_q;
  pr.heads_kv = heads_kv;
  pr.d = d;
  pr.dtype = dtype;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto fill = [&](std::vector<uint16_t>& t, size_t n) {
    t.resize(n);
    for (auto& x : t) x = float_to_bits(u(rng), dtype);
  };
  fill(pr.q, pr.q_elems());
  fill(pr.k, pr.k_elems());
  fill(pr.v, pr.k_elems());
  if (with_dout) fill(pr.dout, pr.q_elems());
  return pr;
}

inline size_t count_different(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

}  // namespace flashcore::testing::dropout_calls
