// `flashcore bench`: times a grid of shapes on one backend, next to a naive materialized fp32
// attention on the CPU (the peer every CPU user would otherwise write), and prints a table;
// --json / --csv write the rows for plots and docs/PERF.md. GPU peers (PyTorch SDPA backends)
// are measured by bench/peers.py in one process with flashcore.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "common.hpp"
#include "cpu/worker_pool.hpp"  // available_cores: what num_threads = 0 means to the library

namespace flashcore::cli {
namespace {

struct Row {
  Problem p;
  std::string direction;
  double ms = 0, rate = 0;          // flashcore
  double naive_ms = 0, naive_rate = 0;  // naive fp32 CPU peer (forward only, CPU only)
};

/** Naive attention in fp32: materializes each head's full score matrix (O(N^2) memory), then
 *  softmax, then P*V; threads over (batch, head). The honest "what you would write" peer. */
void naive_forward_fp32(const Problem& p, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, std::vector<float>& out, int threads) {
  const int64_t B = p.batch, Sq = p.seqlen_q, Sk = p.seqlen_k, H = p.heads_q, Hk = p.heads_kv, D = p.head_dim;
  const float scale = 1.f / std::sqrt(float(D));
  auto work = [&](int64_t task) {
    const int64_t b = task / H, h = task % H, hk = h / (H / Hk);
    std::vector<float> s(static_cast<size_t>(Sq * Sk));
    for (int64_t i = 0; i < Sq; ++i) {
      const float* qi = &q[((b * Sq + i) * H + h) * D];
      for (int64_t j = 0; j < Sk; ++j) {
        const float* kj = &k[((b * Sk + j) * Hk + hk) * D];
        float dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        const bool masked = p.causal && j > i + Sk - Sq;
        s[i * Sk + j] = masked ? -INFINITY : dot * scale;
      }
      float m = -INFINITY, l = 0;
      for (int64_t j = 0; j < Sk; ++j) m = std::max(m, s[i * Sk + j]);
      for (int64_t j = 0; j < Sk; ++j) l += (s[i * Sk + j] = m == -INFINITY ? 0.f : std::exp(s[i * Sk + j] - m));
      float* oi = &out[((b * Sq + i) * H + h) * D];
      std::fill(oi, oi + D, 0.f);
      for (int64_t j = 0; j < Sk; ++j) {
        const float pj = l > 0 ? s[i * Sk + j] / l : 0.f;
        const float* vj = &v[((b * Sk + j) * Hk + hk) * D];
        for (int64_t d = 0; d < D; ++d) oi[d] += pj * vj[d];
      }
    }
  };
  const int64_t tasks = B * H;
  const int n = std::max(1, threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < n; ++t)
    pool.emplace_back([&, t] {
      for (int64_t task = t; task < tasks; task += n) work(task);
    });
  for (auto& th : pool) th.join();
}

/** The cells of grid `name` around `base`; `keys` (0: the grid's own) sets the few-tokens grid's
 *  key length. */
std::vector<Problem> grid(const std::string& name, const Problem& base, int64_t keys) {
  std::vector<Problem> g;
  if (name == "training") {  // TARGETS.md: 16k tokens, model dim 2048
    for (int64_t d : {64, 128, 256})
      for (bool causal : {false, true})
        for (int64_t s : {512, 1024, 2048, 4096, 8192, 16384}) {
          Problem p = base;
          p.batch = 16384 / s;
          p.seqlen_q = p.seqlen_k = s;
          p.head_dim = d;
          p.heads_q = p.heads_kv = 2048 / d;
          p.causal = causal;
          g.push_back(p);
        }
  } else if (name == "seed") {  // the FlashCore seed shape
    Problem p = base;
    p.batch = 1;
    p.heads_q = p.heads_kv = 8;
    p.seqlen_q = p.seqlen_k = 512;
    p.head_dim = 64;
    if (p.on_gpu) p.dtype = FC_DTYPE_F16;
    g.push_back(p);
  } else if (name == "cpu") {
    for (int64_t d : {64, 128})
      for (bool causal : {false, true})
        for (int64_t s : {512, 1024, 2048, 4096}) {
          Problem p = base;
          p.batch = 1;
          p.heads_q = p.heads_kv = 16;
          p.seqlen_q = p.seqlen_k = s;
          p.head_dim = d;
          p.causal = causal;
          g.push_back(p);
        }
  } else if (name == "decode") {  // TARGETS.md's decode cells: one token against a long KV cache
    for (auto [batch, keys] : {std::pair<int64_t, int64_t>{1, 65536}, {16, 8192}, {64, 2048}}) {
      Problem p = base;
      p.batch = batch;
      p.seqlen_q = 1;
      p.seqlen_k = keys;
      p.heads_q = 32;
      p.heads_kv = 8;
      p.head_dim = 128;
      p.causal = true;
      g.push_back(p);
    }
  } else if (name == "few-tokens") {  // speculative decoding, chunked prefill: a few tokens, long keys
    for (int64_t tokens : {8, 16, 32, 64, 128}) {
      Problem p = base;
      p.batch = 1;
      p.seqlen_q = tokens;
      p.seqlen_k = keys > 0 ? keys : p.on_gpu ? 65536 : 16384;
      p.heads_q = 32;
      p.heads_kv = 8;
      p.head_dim = 128;
      p.causal = true;
      g.push_back(p);
    }
  } else if (name == "one") {
    g.push_back(base);
  } else {
    throw UsageError("--grid: unknown grid '" + name + "' (training, cpu, seed, decode, few-tokens, one)");
  }
  return g;
}

/** Decode-shaped: at most 16 query rows per KV head (the table then shows K+V bytes / time). */
bool decode_shaped(const Problem& p) { return p.seqlen_q * (p.heads_q / p.heads_kv) <= 16; }

}  // namespace

int command_bench(int argc, char** argv) {
  auto known = problem_options();
  for (const char* k : {"grid", "json", "csv", "repeats"}) known[k] = true;
  known["backward"] = false;
  known["no-naive"] = false;
  const Args a(argc, argv, 2, known);
  if (a.has("help")) {
    std::printf("usage: flashcore bench [options]\n\n"
                "  --grid G             training (16k tokens, dim 2048) | cpu | seed | decode (one token,\n"
                "                       GQA 32/8 d128, 1x65536 16x8192 64x2048 keys) | few-tokens (8-128\n"
                "                       tokens of one sequence, GQA 32/8 d128, against 65536 keys, 16384\n"
                "                       on the CPU, or --seqlen-k) | one (default: cpu without a GPU,\n"
                "                       training with one)\n"
                "  --backward           also time forward+backward\n"
                "  --no-naive           skip the naive fp32 CPU peer\n"
                "  --json FILE          write rows as JSON\n"
                "  --csv FILE           write rows as CSV\n"
                "  --repeats N          timed repetitions per cell (median; default 5)\n%s",
                problem_options_help().c_str());
    return 0;
  }
  Problem base;
  base.on_gpu = gpu_usable();
  base.dtype = base.on_gpu ? FC_DTYPE_BF16 : FC_DTYPE_F32;
  base = parse_problem(a, base);
  const std::string grid_name = a.str("grid", base.on_gpu ? "training" : "cpu");
  const std::vector<Problem> cells = grid(grid_name, base, a.has("seqlen-k") ? base.seqlen_k : 0);
  const bool backward = a.has("backward");
  // The naive peer computes plain (optionally causal) attention only: with a window, softcap,
  // ALiBi or dropout it would not compute the same function, so it sits those runs out.
  const bool plain = base.window_left == -1 && base.window_right == -1 && base.softcap == 0 && !base.alibi &&
                     base.dropout_p == 0;
  const bool naive = !base.on_gpu && !a.has("no-naive") && plain;
  const int repeats = static_cast<int>(std::max<int64_t>(1, a.num("repeats", 5)));
  // The naive peer gets as many threads as flashcore's default (the process's affinity mask).
  const int threads = base.threads > 0 ? base.threads : flashcore::cpu::available_cores();

  std::vector<Row> rows;
  for (size_t i = 0; i < cells.size(); ++i) {
    const Problem& p = cells[i];
    std::fprintf(stderr, "\r[%zu/%zu] %-80s", i + 1, cells.size(), p.describe().c_str());
    std::fflush(stderr);
    for (const char* dir : {"fwd", "fwd+bwd"}) {
      const bool bwd = std::string(dir) == "fwd+bwd";
      if (bwd && !backward) continue;
      Buffers buf(p, bwd, 7 + i);
      Row r{p, dir};
      const int inner = p.on_gpu ? 10 : 1;
      if (buf.forward() != FC_OK) throw std::runtime_error(fc_last_error());
      r.ms = time_ms(p, repeats, inner, [&] {
        buf.forward();
        if (bwd) buf.backward();
      });
      if (bwd && buf.backward() != FC_OK) throw std::runtime_error(fc_last_error());
      const double flops = p.flops_forward() * (bwd ? 3.5 : 1.0);
      r.rate = flops / (r.ms * 1e-3);
      if (naive && !bwd) {
        std::vector<float> q = buf.fetch(buf.q), k = buf.fetch(buf.k), v = buf.fetch(buf.v), out(q.size());
        r.naive_ms = time_ms(p, std::min(repeats, 3), 1, [&] { naive_forward_fp32(p, q, k, v, out, threads); });
        r.naive_rate = flops / (r.naive_ms * 1e-3);
      }
      rows.push_back(r);
    }
  }
  std::fprintf(stderr, "\r%-100s\r", "");

  const std::string backend_name = base.backend != FC_BACKEND_AUTO ? fc_backend_name(base.backend)
                                                                    : std::string("auto (forward ") +
                                           auto_backend_name(base.on_gpu, false) + ", backward " +
                                           auto_backend_name(base.on_gpu, true) + ")";
  const char* unit = base.on_gpu ? "TFLOP/s" : "GFLOP/s";
  const double div = base.on_gpu ? 1e12 : 1e9;
  std::printf("flashcore bench: backend %s, grid %s, threads %d\n", backend_name.c_str(), grid_name.c_str(),
              base.on_gpu ? 0 : threads);
  char device[256];
  if (base.on_gpu && fc_cuda_device_describe(0, device, sizeof(device)) == FC_OK) std::printf("device: %s\n", device);
  // Decode-shaped grids (and few-tokens, memory-bound at its short end) also show K+V bytes / time
  // (the rate TARGETS.md's decode cells use), and every grid the key length and KV heads.
  const bool decode = grid_name == "few-tokens" || std::all_of(cells.begin(), cells.end(), decode_shaped);
  std::printf("%-6s %-7s %-7s %-7s %-6s %-6s %-8s %10s %10s", "batch", "seqlen", "keys", "heads", "hdim", "mask", "dir",
              "ms", unit);
  if (decode) std::printf(" %10s", "K+V GB/s");
  if (naive) std::printf(" %12s %10s %8s", "naive ms", "naive", "speedup");
  std::printf("\n");
  for (const Row& r : rows) {
    const std::string heads = std::to_string(r.p.heads_q) + "/" + std::to_string(r.p.heads_kv);
    std::printf("%-6lld %-7lld %-7lld %-7s %-6lld %-6s %-8s %10.3f %10.2f", (long long)r.p.batch,
                (long long)r.p.seqlen_q, (long long)r.p.seqlen_k, heads.c_str(), (long long)r.p.head_dim,
                r.p.causal ? "causal" : "full", r.direction.c_str(), r.ms, r.rate / div);
    if (decode && r.direction == "fwd") std::printf(" %10.1f", r.p.kv_bytes() / (r.ms * 1e-3) / 1e9);
    if (decode && r.direction != "fwd") std::printf(" %10s", "-");  // (a backward reads more than K and V)
    if (naive && r.naive_ms > 0) std::printf(" %12.3f %10.2f %7.2fx", r.naive_ms, r.naive_rate / div, r.naive_ms / r.ms);
    std::printf("\n");
  }
  auto fields = [&](const Row& r, bool json) {
    std::ostringstream s;
    const char* q = json ? "\"" : "";
    auto kv = [&](const char* k, const std::string& v, bool quoted, bool last = false) {
      if (json) s << "\"" << k << "\": " << (quoted ? q : "") << v << (quoted ? q : "") << (last ? "" : ", ");
      else s << v << (last ? "" : ",");
    };
    kv("backend", backend_name, true);
    kv("dtype", r.p.dtype == FC_DTYPE_F32 ? "fp32" : r.p.dtype == FC_DTYPE_F16 ? "fp16" : "bf16", true);
    kv("batch", std::to_string(r.p.batch), false);
    kv("seqlen", std::to_string(r.p.seqlen_q), false);
    kv("seqlen_k", std::to_string(r.p.seqlen_k), false);
    kv("heads", std::to_string(r.p.heads_q), false);
    kv("heads_kv", std::to_string(r.p.heads_kv), false);
    kv("head_dim", std::to_string(r.p.head_dim), false);
    kv("causal", r.p.causal ? "true" : "false", false);
    kv("direction", r.direction, true);
    kv("threads", std::to_string(base.on_gpu ? 0 : threads), false);
    kv("ms", std::to_string(r.ms), false);
    kv("flops_per_s", std::to_string(r.rate), false);
    kv("kv_bytes_per_s", std::to_string(r.p.kv_bytes() / (r.ms * 1e-3)), false);
    kv("naive_ms", std::to_string(r.naive_ms), false, true);
    return s.str();
  };
  if (a.has("json")) {
    std::ofstream f(a.str("json", ""));
    if (!f) throw std::runtime_error("cannot write " + a.str("json", ""));
    f << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) f << "  {" << fields(rows[i], true) << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
    f << "]\n";
  }
  if (a.has("csv")) {
    std::ofstream f(a.str("csv", ""));
    if (!f) throw std::runtime_error("cannot write " + a.str("csv", ""));
    f << "backend,dtype,batch,seqlen,seqlen_k,heads,heads_kv,head_dim,causal,direction,threads,ms,flops_per_s,"
         "kv_bytes_per_s,naive_ms\n";
    for (const Row& r : rows) f << fields(r, false) << "\n";
  }
  return 0;
}

}  // namespace flashcore::cli
