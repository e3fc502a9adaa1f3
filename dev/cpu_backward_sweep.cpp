// Times the cpu_flash backward side by side in one process: the AVX-512 path (variant 0: one task
// per head, as before session 24's key chunks; then 256-key chunks as shipped, and 512), the AMX
// backward (src/cpu/amx_backward_kernel.hpp) with and without the key split and on several key
// tile / query group sizes, and last the AVX-512 path on other tiles (flash_backward_kernel.hpp's
// BackwardConfig: query rows per block, micro-kernel tile). The tool for choosing the backwards'
// task split and tile sizes.
//
// Every variant's dQ, dK, dV are checked against variant 0's first (max |difference| relative to
// the largest gradient, printed), then all are timed in rounds that run each variant once (a slow
// spell of a shared machine hits all alike); median per variant, ratio to variant 0. The forward
// (for out and lse) runs once per shape, untimed. Backward FLOPs: 2.5 x the forward's.
//
// Build (from the repository root; on a CPU without AMX the AMX variants are left out):
//   g++ -std=c++17 -O3 -march=native -mamx-tile -mamx-bf16 -pthread -I include -I src
//       dev/cpu_backward_sweep.cpp src/cpu/flash_forward.cpp src/cpu/flash_backward.cpp
//       src/cpu/amx_forward.cpp src/cpu/amx_backward.cpp src/cpu/worker_pool.cpp -o /tmp/cpu_backward_sweep
// Run: /tmp/cpu_backward_sweep [threads ...]   (default: 2)
//      DTYPE=bf16 (default) | f16 | f32 (AVX-512 variants only), ROUNDS=n (default 5),
//      ONLY=1,3 (those variants beside 0),
//      SHAPES=all (adds S=4096 d=128, S=1024 d=128 causal, S=2048 d=256),
//      PHASES=1 (instead: where the shipped backward's thread time goes, per phase of a task: the
//               AMX one for 16-bit DTYPEs on an AMX CPU, else the AVX-512 one),
//      GQA=g (16 query heads on 16 / g KV heads; default 1)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "sweep_common.hpp"
#include "cpu/amx.hpp"
#include "cpu/amx_backward_kernel.hpp"
#include "cpu/flash_backward_kernel.hpp"

using namespace flashcore;
using namespace flashcore::cpu;
using namespace flashcore::cpu::flash_detail;

namespace {

struct Entry {
  std::string name;
  Status (*run)(const BackwardParams&);
};

using TimedPhases = SweepPhaseTimer<backward_detail::BackwardPhase>;  // dev/sweep_common.hpp

// The AVX-512 backward's tiles (flash_backward_kernel.hpp): query rows per block x 64 keys, and the
// micro-kernel tile of its five products.
using backward_detail::BackwardConfig;
using backward_detail::ShippedBackwardConfig;

template <class Config, int64_t kMinChunkKeys, class PhaseTimer = backward_detail::NoBackwardTimer,
          int64_t kTasksWanted = backward_detail::kKeySplitTasksWanted>
Status avx_backward(const BackwardParams& p) {
  return backward_detail::avx_flash_backward_tiles<Config, PhaseTimer>(p, kMinChunkKeys, kTasksWanted);
}

DType sweep_dtype() {
  const char* d = std::getenv("DTYPE");
  if (d && std::string(d) == "f16") return DType::F16;
  if (d && std::string(d) == "f32") return DType::F32;
  return DType::BF16;
}

std::vector<Entry> variants() {
  std::vector<Entry> all = {{"avx-512, one task per head", &avx_backward<ShippedBackwardConfig, 0>},
                            {"avx-512, chunks >= 256 keys (shipped)", &avx_backward<ShippedBackwardConfig, 256>},
                            {"avx-512, chunks >= 512 keys", &avx_backward<ShippedBackwardConfig, 512>}};
#if FLASHCORE_AMX_BUILT
  if (amx_usable() && sweep_dtype() != DType::F32) {
    using namespace amx_backward_detail;
    all.push_back({"amx 128 x 128, one task per head (shipped)", &amx_flash_backward_with<128, 128, 0>});
    all.push_back({"amx 128 x 128, chunks >= 1024 keys", &amx_flash_backward_with<128, 128, 1024>});
    all.push_back({"amx 128 x 128, chunks >= 512 keys", &amx_flash_backward_with<128, 128, 512>});
    all.push_back({"amx 64 keys x 128 rows", &amx_flash_backward_with<64, 128, 0>});
    all.push_back({"amx 128 keys x 64 rows", &amx_flash_backward_with<128, 64, 0>});
    all.push_back({"amx 256 keys x 128 rows", &amx_flash_backward_with<256, 128, 0>});
  }
#endif
  // Other AVX-512 tiles (query rows per block, micro-kernel rows x vectors; one key tile at a
  // time), 256-key chunks.
  // Session 25 on the GPU machine's Xeon, fp32, against the shipped 6x4 on 64 rows at 2 / 16
  // threads: 8x2 0.86-0.90x / 0.89-0.94x, 4x4 0.90-1.00x / 0.91-1.00x, 48 and 96 rows (blocks that
  // KeySplit's row alignment no longer allows) 0.92-1.02x. 32 and 128 rows: not measured there.
  all.push_back({"avx-512, 64 rows, 8x2", &avx_backward<BackwardConfig<64, Avx512Tile<8, 2>>, 256>});
  all.push_back({"avx-512, 64 rows, 4x4", &avx_backward<BackwardConfig<64, Avx512Tile<4, 4>>, 256>});
  all.push_back({"avx-512, 32 rows, 6x4", &avx_backward<BackwardConfig<32, GemmTraits>, 256>});
  all.push_back({"avx-512, 128 rows, 6x4", &avx_backward<BackwardConfig<128, GemmTraits>, 256>});
  // Key tiles in smaller groups than the shipped 4 that each query block visits in turn (one: as
  // before session 62, every query block's Q, dO and dQ rows came from memory once per key tile).
  // Session 62 on the GPU machine's Xeon, fp32, groups of 1 / 2 / 4 at 2 threads: S1024 d64
  // 203.7 / 206.6 / 201.8, S2048 d64 causal 205.7 / 197.2 / 205.9, S2048 d128 229.5 / 234.5 /
  // 241.1; at 16 threads: 1134.3 / 1133.3 / 1199.3, 1313.0 / 1352.6 / 1374.7, 1151.7 / 1260.4 / 1269.7.
  all.push_back({"avx-512, one key tile at a time", &avx_backward<BackwardConfig<64, GemmTraits, 1>, 256>});
  all.push_back({"avx-512, groups of 2 key tiles", &avx_backward<BackwardConfig<64, GemmTraits, 2>, 256>});
  // Heads split for 128 tasks where B x H makes fewer, instead of 64 (eight per thread at 16
  // threads, each half as long: a shorter wait for the last of them). Session 63 on the Xeon,
  // fp32, against the shipped split: 16 threads S2048 d64 causal 991.8 / 1284.0, S2048 d128
  // 1092.0 / 1206.5 (2 threads -5% / +1%); at S1024 both make the same four chunks.
  all.push_back({"avx-512, split for 128 tasks", &avx_backward<ShippedBackwardConfig, 256, backward_detail::NoBackwardTimer, 128>});
  return all;
}

using Shape = SweepShape;

/** One problem in the storage dtype (16-bit types: two elements per float of each buffer) plus
 *  the fp32 lse. */
struct Problem {
  DType dtype = DType::BF16;
  int64_t n = 0, n_kv = 0;  // elements of Q (dQ, out, dout) and of K (V, dK, dV)
  std::vector<float> q, k, v, out, dout, dq, dk, dv, lse;
  BackwardParams p;

  float at(const std::vector<float>& t, int64_t i) const {
    if (dtype == DType::F32) return t[static_cast<size_t>(i)];
    const uint16_t h = reinterpret_cast<const uint16_t*>(t.data())[i];
    return dtype == DType::BF16 ? bf16_to_float(h) : half_to_float(h);
  }
  size_t floats() const { return static_cast<size_t>(dtype == DType::F32 ? n : n / 2 + 1); }
  void set(std::vector<float>& t, int64_t i, float x) const {
    if (dtype == DType::F32) {
      t[static_cast<size_t>(i)] = x;
    } else {
      reinterpret_cast<uint16_t*>(t.data())[i] = dtype == DType::BF16 ? float_to_bf16(x) : float_to_half(x);
    }
  }
};

void build(Problem& pr, const Shape& s, int threads) {
  constexpr int64_t kHeads = 16;
  pr.dtype = sweep_dtype();
  pr.n = s.seqlen * kHeads * s.head_dim;
  const int64_t group = std::getenv("GQA") ? std::max(1, std::atoi(std::getenv("GQA"))) : 1;
  const int64_t heads_kv = kHeads / group, n_kv = s.seqlen * heads_kv * s.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto* t : {&pr.q, &pr.k, &pr.v, &pr.dout}) {
    t->assign(pr.floats(), 0.f);
    for (int64_t i = 0; i < pr.n; ++i) pr.set(*t, i, normal(rng));
  }
  for (auto* t : {&pr.out, &pr.dq, &pr.dk, &pr.dv}) t->assign(pr.floats(), 0.f);
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

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::vector<int> thread_counts = sweep_thread_counts(argc, argv);
  const int rounds = sweep_rounds(5);
  const std::vector<Shape> shapes = sweep_shapes();
  const std::vector<Entry> all = sweep_picked(variants());
  if (std::getenv("PHASES")) {
    // The shipped AMX backward (16-bit DTYPE on an AMX CPU), else the shipped AVX-512 one.
    Entry timed{"avx-512 (shipped)", &avx_backward<ShippedBackwardConfig, 256, TimedPhases>};
    const char* names[] = {"between tasks", "pack Q/dO", "pack K/V", "S+dP", "softmax", "dV+dK", "dQ", "write",
                           "reductions"};
#if FLASHCORE_AMX_BUILT
    if (amx_usable() && sweep_dtype() != DType::F32) {
      timed = {"amx (shipped)", &amx_backward_detail::amx_flash_backward_with<128, 128, 0, TimedPhases>};
    }
#endif
    for (int threads : thread_counts) {
      for (const Shape& s : shapes) {
        Problem pr;
        build(pr, s, threads);
        TimedPhases::report(sweep_cell(threads, s).c_str(), timed, pr.p, rounds, threads, 2.5 * s.forward_flops(),
                            names);
      }
    }
    return 0;
  }
  std::printf("cpu_flash backward variants, %s, B=1 H=16 (GQA %s), median of %d rounds, GFLOP/s (2.5 x forward "
              "FLOPs)\n", std::getenv("DTYPE") ? std::getenv("DTYPE") : "bf16", std::getenv("GQA") ? std::getenv("GQA") : "1",
              rounds);
  for (int threads : thread_counts) {
    for (const Shape& s : shapes) {
      Problem pr;
      build(pr, s, threads);
      const double flops = 2.5 * s.forward_flops();
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
      const std::vector<double> medians = sweep_medians(all, pr.p, rounds);
      std::printf("\n%s\n", sweep_cell(threads, s).c_str());
      double base = 0.0;
      for (size_t i = 0; i < all.size(); ++i) {
        const double gflops = flops / medians[i] * 1e-9;
        if (i == 0) base = gflops;
        // Variants round P and dS differently, and a split sums dQ in another order: gradients a
        // few ulps of the dtype apart are expected.
        std::printf("  %-36s %8.1f  %5.2fx  max|diff| / max|grad| %.1e%s\n", all[i].name.c_str(), gflops,
                    gflops / base, max_rel[i], max_rel[i] > 5e-2 ? "  WRONG" : "");
      }
    }
  }
  return 0;
}
