// Times the CPU decode path (fc_attention_kvcache on the cpu_flash backend) through the C ABI,
// against a contiguous cache of random data, and prints K+V bytes read per second next to the
// GFLOP/s of the attention (4 x heads_q x length x head_dim per query token). The tool behind the
// session 9 rewrite of src/cpu/decode.cpp; run it beside `bench/peers.py`'s torch numbers. Each cell
// also times fc_attention_forward on the same tensors (decoding through flash_attn_func), and the
// same tensors packed as a varlen forward (flash_attn_varlen_func's decoding) with the backend
// AUTO (the decode route where it takes the call) and cpu_flash named (its forward).
//
// Build (from the repository root, against a CPU build in BUILD):
//   g++ -std=c++17 -O2 -I include dev/cpu_decode_bench.cpp -L BUILD -lflashcore -Wl,-rpath,BUILD
//       -o /tmp/cpu_decode_bench
// Run: [TOKENS=1] [HEADS=32/8] [DIM=128] [CAUSAL=1] /tmp/cpu_decode_bench [threads] [dtype f32|f16|bf16] [batch x length ...]
//      default: 2 threads, f32, 1x512 1x2048 1x8192 1x32768 8x2048 (GQA 32 / 8 heads, d = 128)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcore/flashcore.hpp"


int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::string dt = argc > 2 ? argv[2] : "f32";
  const fc_dtype dtype = dt == "f16" ? FC_DTYPE_F16 : dt == "bf16" ? FC_DTYPE_BF16 : FC_DTYPE_F32;
  const size_t elem = dtype == FC_DTYPE_F32 ? 4 : 2;
  std::vector<std::pair<int64_t, int64_t>> cells;
  for (int i = 3; i < argc; ++i) {
    long long b = 0, l = 0;
    if (std::sscanf(argv[i], "%lldx%lld", &b, &l) == 2) cells.push_back({b, l});
  }
  if (cells.empty()) cells = {{1, 512}, {1, 2048}, {1, 8192}, {1, 32768}, {8, 2048}};
  // TOKENS (query tokens per sequence, default 1), HEADS (q/kv, default 32/8) and DIM (128) from
  // the environment.
  const int64_t tokens = std::getenv("TOKENS") ? std::atoll(std::getenv("TOKENS")) : 1;
  long long heads_q = 32, heads_kv = 8;
  if (std::getenv("HEADS")) std::sscanf(std::getenv("HEADS"), "%lld/%lld", &heads_q, &heads_kv);
  const int64_t hq = heads_q, hk = heads_kv, d = std::getenv("DIM") ? std::atoll(std::getenv("DIM")) : 128;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  for (auto [batch, len] : cells) {
    std::vector<uint8_t> q(batch * tokens * hq * d * elem), k(batch * len * hk * d * elem), v(k.size()),
        out(q.size());
    for (auto* buf : {&q, &k, &v}) {
      // Random values in [-1, 1): fp32 from 16-bit fractions, fp16 / bf16 by rounding those down.
      for (size_t i = 0; i < buf->size() / elem; ++i) {
        const float x = bits(rng) / 32768.f - 1.f;
        if (elem == 4) {
          std::memcpy(buf->data() + 4 * i, &x, 4);
        } else {
          uint32_t u;
          std::memcpy(&u, &x, 4);
          uint16_t h;
          if (dtype == FC_DTYPE_BF16) {
            h = static_cast<uint16_t>(u >> 16);
          } else {  // fp16 of x in [-1, 1): sign, 5-bit exponent, 10-bit mantissa (truncated)
            const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
            h = static_cast<uint16_t>(((u >> 16) & 0x8000) | (e > 0 ? (e << 10) | ((u >> 13) & 0x3ff) : 0));
          }
          std::memcpy(buf->data() + 2 * i, &h, 2);
        }
      }
    }
    std::vector<int32_t> lens(batch, static_cast<int32_t>(len));
    fc_tensor tq = flashcore::make_tensor(q.data(), dtype, {batch, tokens, hq, d});
    fc_tensor tk = flashcore::make_tensor(k.data(), dtype, {batch, len, hk, d});
    fc_tensor tv = flashcore::make_tensor(v.data(), dtype, {batch, len, hk, d});
    fc_tensor to = flashcore::make_tensor(out.data(), dtype, {batch, tokens, hq, d});
    fc_tensor tl = flashcore::make_tensor(lens.data(), FC_DTYPE_I32, {batch});
    fc_kvcache_args args{};
    args.q = &tq;
    args.k_cache = &tk;
    args.v_cache = &tv;
    args.cache_seqlens = &tl;
    args.out = &to;
    fc_attention_options opt{};
    opt.backend = FC_BACKEND_CPU_FLASH;
    opt.causal = std::getenv("CAUSAL") != nullptr;  // bottom-right: a token sees the keys before it
    opt.num_threads = threads;
    auto decode_call = [&] {
      if (fc_attention_kvcache(&args, &opt, nullptr, 0) != FC_OK) {
        std::fprintf(stderr, "fc_attention_kvcache: %s\n", fc_last_error());
        std::exit(1);
      }
    };
    // The same tensors through fc_attention_forward (flash_attn_func's call).
    auto forward_call = [&] {
      if (fc_attention_forward(&tq, &tk, &tv, &to, nullptr, &opt, nullptr, 0) != FC_OK) {
        std::fprintf(stderr, "fc_attention_forward: %s\n", fc_last_error());
        std::exit(1);
      }
    };
    auto median_ms = [](auto&& call) {  // alternating callers share the same warm-up state
      call();
      std::vector<double> ms;
      for (int r = 0; r < 15; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        call();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    // The same bytes as a varlen forward: q (batch x tokens, hq, d), k / v (batch x len, hk, d).
    std::vector<int32_t> cu_q(batch + 1), cu_k(batch + 1);
    for (int64_t b = 0; b <= batch; ++b) {
      cu_q[b] = static_cast<int32_t>(b * tokens);
      cu_k[b] = static_cast<int32_t>(b * len);
    }
    fc_tensor pq = flashcore::make_tensor(q.data(), dtype, {batch * tokens, hq, d});
    fc_tensor pk = flashcore::make_tensor(k.data(), dtype, {batch * len, hk, d});
    fc_tensor pv = flashcore::make_tensor(v.data(), dtype, {batch * len, hk, d});
    fc_tensor po = flashcore::make_tensor(out.data(), dtype, {batch * tokens, hq, d});
    fc_tensor tcq = flashcore::make_tensor(cu_q.data(), FC_DTYPE_I32, {batch + 1});
    fc_tensor tck = flashcore::make_tensor(cu_k.data(), FC_DTYPE_I32, {batch + 1});
    fc_attention_options vopt = opt;
    vopt.cu_seqlens_q = &tcq;
    vopt.cu_seqlens_k = &tck;
    vopt.max_seqlen_q = tokens;
    vopt.max_seqlen_k = len;
    auto varlen_call = [&](int32_t backend) {
      return [&, backend] {
        fc_attention_options o = vopt;
        o.backend = backend;
        if (fc_attention_forward(&pq, &pk, &pv, &po, nullptr, &o, nullptr, 0) != FC_OK) {
          std::fprintf(stderr, "fc_attention_forward (varlen): %s\n", fc_last_error());
          std::exit(1);
        }
      };
    };
    const double t = median_ms(decode_call), t_fwd = median_ms(forward_call);
    const double t_var_auto = median_ms(varlen_call(FC_BACKEND_AUTO)), t_var_flash = median_ms(varlen_call(FC_BACKEND_CPU_FLASH));
    const double bytes = 2.0 * batch * len * hk * d * elem;
    std::printf("%s %d threads, %lld / %lld heads, d%lld, %lld tokens, batch %lld x %lld keys: %.3f ms, %.1f GB/s of K+V, %.1f GFLOP/s; "
                "fc_attention_forward on the same tensors %.3f ms (%.2fx); varlen AUTO %.3f ms, varlen cpu_flash %.3f ms (%.2fx)\n",
                dt.c_str(), threads, heads_q, heads_kv, static_cast<long long>(d), static_cast<long long>(tokens),
                static_cast<long long>(batch), static_cast<long long>(len), t, bytes / t / 1e6,
                4.0 * batch * tokens * hq * len * d / t / 1e6, t_fwd, t_fwd / t, t_var_auto, t_var_flash,
                t_var_flash / t_var_auto);
  }
  return 0;
}
