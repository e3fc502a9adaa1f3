// Times the cpu_flash backward side by side in one process: the AVX-512 path (variant 0, what
// FLASHCORE_CPU_AMX=0 runs) and the AMX backward (src/cpu/amx_backward_kernel.hpp) on several key
// tile / query group sizes. The tool for choosing the AMX backward's tile sizes on a CPU.
//
// Every variant's dQ, dK, dV are checked against variant 0's first (max |difference| relative to
// the largest gradient, printed), then all are timed in rounds that run each variant once (a slow
// spell of a shared machine hits all alike); median per variant, ratio to variant 0. The forward
// (for out and lse) runs once per shape, untimed. Backward FLOPs: 2.5 x the forward's.
//
// Build (from the repository root, on an AMX CPU; without AMX only variant 0 runs):
//   g++ -std=c++17 -O3 -march=native -mamx-tile -mamx-bf16 -pthread -I include -I src
//       dev/cpu_backward_sweep.cpp src/cpu/flash_forward.cpp src/cpu/flash_backward.cpp
//       src/cpu/amx_forward.cpp src/cpu/amx_backward.cpp src/cpu/worker_pool.cpp -o /tmp/cpu_backward_sweep
// Run: /tmp/cpu_backward_sweep [threads ...]   (default: 2)
//      DTYPE=bf16 (default) | f16, ROUNDS=n (default 5), ONLY=1,3 (those variants beside 0),
//      SHAPES=all (adds S=4096 d=128, S=1024 d=128 causal, S=2048 d=256),
//      PHASES=1 (instead: where the shipped AMX backward's thread time goes, per phase of a task),
//      GQA=g (16 query heads on 16 / g KV heads; default 1)
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "phase_timer.hpp"
#include "cpu/amx.hpp"
#include "cpu/amx_backward_kernel.hpp"

using namespace flashcore;
using namespace flashcore::cpu;
using namespace flashcore::cpu::flash_detail;

namespace {

struct Entry {
  std::string name;
  Status (*run)(const BackwardParams&);
};

using TimedPhases = SweepPhaseTimer<amx_backward_detail::BackwardPhase>;  // dev/phase_timer.hpp

Status avx_backward(const BackwardParams& p) {
  setenv("FLASHCORE_CPU_AMX", "0", 1);
  const Status st = flash_backward(p);
  unsetenv("FLASHCORE_CPU_AMX");
  return st;
}

std::vector<Entry> variants() {
  std::vector<Entry> all = {{"avx-512 backward", &avx_backward}};
#if FLASHCORE_AMX_BUILT
  if (amx_usable()) {
    using namespace amx_backward_detail;
    all.push_back({"amx 128 keys x 128 rows (shipped)", &amx_flash_backward_with<128, 128>});
    all.push_back({"amx 64 keys x 128 rows", &amx_flash_backward_with<64, 128>});
    all.push_back({"amx 128 keys x 64 rows", &amx_flash_backward_with<128, 64>});
    all.push_back({"amx 128 keys x 256 rows", &amx_flash_backward_with<128, 256>});
    all.push_back({"amx 256 keys x 128 rows", &amx_flash_backward_with<256, 128>});
    all.push_back({"amx 256 keys x 64 rows", &amx_flash_backward_with<256, 64>});
  }
#endif
  return all;
}

struct Shape {
  int64_t seqlen, head_dim;
  bool causal;
};

/** One problem in 16-bit storage (two elements per float of each buffer) plus the fp32 lse. */
struct Problem {
  DType dtype = DType::BF16;
  int64_t n = 0, n_kv = 0;  // elements of Q (dQ, out, dout) and of K (V, dK, dV)
  std::vector<float> q, k, v, out, dout, dq, dk, dv, lse;
  BackwardParams p;

  float at(const std::vector<float>& t, int64_t i) const {
    const uint16_t h = reinterpret_cast<const uint16_t*>(t.data())[i];
    return dtype == DType::BF16 ? bf16_to_float(h) : half_to_float(h);
  }
};

void build(Problem& pr, const Shape& s, int threads) {
  constexpr int64_t kHeads = 16;
  const char* d = std::getenv("DTYPE");
  pr.dtype = d && std::string(d) == "f16" ? DType::F16 : DType::BF16;
  pr.n = s.seqlen * kHeads * s.head_dim;
  const int64_t group = std::getenv("GQA") ? std::max(1, std::atoi(std::getenv("GQA"))) : 1;
  const int64_t heads_kv = kHeads / group, n_kv = s.seqlen * heads_kv * s.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto* t : {&pr.q, &pr.k, &pr.v, &pr.dout}) {
    t->assign(static_cast<size_t>(pr.n / 2 + 1), 0.f);
    uint16_t* h = reinterpret_cast<uint16_t*>(t->data());
    for (int64_t i = 0; i < pr.n; ++i) {
      const float x = normal(rng);
      h[i] = pr.dtype == DType::BF16 ? float_to_bf16(x) : float_to_half(x);
    }
  }
  for (auto* t : {&pr.out, &pr.dq, &pr.dk, &pr.dv}) t->assign(static_cast<size_t>(pr.n / 2 + 1), 0.f);
  pr.lse.assign(static_cast<size_t>(kHeads * s.seqlen), 0.f);
  BackwardParams& p = pr.p;
  auto view = [&](TensorRef& t, std::vector<float>& data, int64_t heads) {  // (1, seqlen, heads, head_dim)
    t.data = data.data();
    t.batch_stride = s.seqlen * heads * s.head_dim;
    t.row_stride = heads * s.head_dim;
    t.head_stride = s.head_dim;
  };
  view(p.q, pr.q, kHeads);
  view(p.k, pr.k, heads_kv);  // the first n_kv elements of the buffer
  view(p.v, pr.v, heads_kv);
  view(p.out, pr.out, kHeads);
  view(p.dout, pr.dout, kHeads);
  view(p.dq, pr.dq, kHeads);
  view(p.dk, pr.dk, heads_kv);
  view(p.dv, pr.dv, heads_kv);
  pr.n_kv = n_kv;
  p.lse.data = pr.lse.data();
  p.lse.batch_stride = kHeads * s.seqlen;
  p.lse.head_stride = s.seqlen;
  p.lse.row_stride = 1;
  p.dtype = pr.dtype;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = s.seqlen;
  p.total_q = p.total_k = s.seqlen;
  p.heads_q = kHeads;
  p.heads_kv = heads_kv;
  p.head_dim = s.head_dim;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  p.causal = s.causal;
  p.window_right = s.causal ? 0 : -1;
  p.num_threads = threads;
  const Status st = flash_forward(p);
  if (!st.is_ok()) {
    std::fprintf(stderr, "forward failed: %s\n", st.message.c_str());
    std::exit(1);
  }
}

double seconds_of(const Entry& e, const BackwardParams& p) {
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = e.run(p);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s failed: %s\n", e.name.c_str(), st.message.c_str());
    std::exit(1);
  }
  return dt;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<int> thread_counts;
  for (int i = 1; i < argc; ++i) thread_counts.push_back(std::atoi(argv[i]));
  if (thread_counts.empty()) thread_counts.push_back(2);
  const int rounds = std::getenv("ROUNDS") ? std::max(1, std::atoi(std::getenv("ROUNDS"))) : 5;
  std::vector<Shape> shapes = {{1024, 64, false}, {2048, 64, true}, {2048, 128, false}};
  if (std::getenv("SHAPES") && std::string(std::getenv("SHAPES")) == "all") {
    shapes.push_back({4096, 128, false});
    shapes.push_back({1024, 128, true});
    shapes.push_back({2048, 256, false});
  }
  std::vector<Entry> all = variants();
  if (const char* only = std::getenv("ONLY")) {
    std::vector<Entry> picked = {all[0]};
    for (const char* c = only; *c;) {
      char* end = nullptr;
      const long i = std::strtol(c, &end, 10);
      if (end == c) break;
      if (i > 0 && i < static_cast<long>(all.size())) picked.push_back(all[static_cast<size_t>(i)]);
      c = *end ? end + 1 : end;
    }
    all = picked;
  }
  if (std::getenv("PHASES")) {
#if FLASHCORE_AMX_BUILT
    const char* names[] = {"between tasks", "pack Q/dO", "pack K/V", "S^T+dP^T", "softmax", "dV+dK", "dQ", "write"};
    for (int threads : thread_counts) {
      for (const Shape& s : shapes) {
        Problem pr;
        build(pr, s, threads);
        const Entry timed{"amx (shipped sizes)", &amx_backward_detail::amx_flash_backward_with<128, 128, TimedPhases>};
        seconds_of(timed, pr.p);
        TimedPhases::reset();
        double wall = 0;
        for (int r = 0; r < rounds; ++r) {
          TimedPhases::new_call();
          wall += seconds_of(timed, pr.p);
        }
        const double thread_ns = wall * 1e9 * threads;
        const double flops = 2.5 * 4.0 * 16 * s.seqlen * s.seqlen * s.head_dim * (s.causal ? 0.5 : 1.0);
        std::printf("%2d threads, S=%lld d=%lld%s: %.1f GFLOP/s |", threads, static_cast<long long>(s.seqlen),
                    static_cast<long long>(s.head_dim), s.causal ? " causal" : "", flops * rounds / wall * 1e-9);
        double charged = 0;
        for (int i = 0; i < TimedPhases::kCount; ++i) {
          const double x = static_cast<double>(TimedPhases::ns[static_cast<size_t>(i)].load());
          charged += x;
          std::printf(" %s %.1f%%", names[i], 100.0 * x / thread_ns);
        }
        std::printf(" | untimed %.1f%%\n", 100.0 * (1.0 - charged / thread_ns));
      }
    }
#endif
    return 0;
  }
  std::printf("cpu_flash backward variants, %s, B=1 H=16 (GQA %s), median of %d rounds, GFLOP/s (2.5 x forward "
              "FLOPs)\n", std::getenv("DTYPE") ? std::getenv("DTYPE") : "bf16", std::getenv("GQA") ? std::getenv("GQA") : "1",
              rounds);
  for (int threads : thread_counts) {
    for (const Shape& s : shapes) {
      Problem pr;
      build(pr, s, threads);
      const double flops = 2.5 * 4.0 * 16 * s.seqlen * s.seqlen * s.head_dim * (s.causal ? 0.5 : 1.0);
      std::vector<std::vector<float>> first;  // variant 0's dq, dk, dv as floats
      std::vector<double> max_rel(all.size(), 0.0);
      for (size_t i = 0; i < all.size(); ++i) {
        seconds_of(all[i], pr.p);
        int t = 0;
        for (const std::vector<float>* g : {&pr.dq, &pr.dk, &pr.dv}) {
          const int64_t count = g == &pr.dq ? pr.n : pr.n_kv;
          std::vector<float> x(static_cast<size_t>(count));
          for (int64_t j = 0; j < count; ++j) x[static_cast<size_t>(j)] = pr.at(*g, j);
          if (i == 0) {
            first.push_back(x);
          } else {
            double diff = 0, scale = 0;
            for (size_t j = 0; j < x.size(); ++j) {
              const double d = std::fabs(static_cast<double>(x[j]) - first[static_cast<size_t>(t)][j]);
              diff = std::max(diff, std::isnan(d) ? INFINITY : d);
              scale = std::max(scale, std::fabs(static_cast<double>(first[static_cast<size_t>(t)][j])));
            }
            max_rel[i] = std::max(max_rel[i], diff / std::max(scale, 1e-30));
          }
          ++t;
        }
      }
      std::vector<std::vector<double>> times(all.size());
      for (int r = 0; r < rounds; ++r) {
        for (size_t i = 0; i < all.size(); ++i) times[i].push_back(seconds_of(all[i], pr.p));
      }
      std::printf("\n%d threads, S=%lld d=%lld%s\n", threads, static_cast<long long>(s.seqlen),
                  static_cast<long long>(s.head_dim), s.causal ? " causal" : "");
      double base = 0.0;
      for (size_t i = 0; i < all.size(); ++i) {
        std::vector<double>& t = times[i];
        std::sort(t.begin(), t.end());
        const double gflops = flops / t[t.size() / 2] * 1e-9;
        if (i == 0) base = gflops;
        // Variants round P and dS differently: bf16 gradients a few bf16 ulps apart are expected.
        std::printf("  %-36s %8.1f  %5.2fx  max|diff| / max|grad| %.1e%s\n", all[i].name.c_str(), gflops,
                    gflops / base, max_rel[i], max_rel[i] > 5e-2 ? "  WRONG" : "");
      }
    }
  }
  return 0;
}
