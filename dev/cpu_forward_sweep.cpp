// Times the cpu_flash forward in several tile configurations on this machine, side by side in
// one process: the tool for tuning the CPU path on a CPU it was not tuned on.
//
// Why: the configurations shipped until session 7 were tuned on the development EPYC (one 512-bit
// FMA per cycle), where d = 128 ran at ~87% of the FMA peak; on the GPU machine's Xeon (two
// 512-bit FMA ports) they ran at 46-68% (docs/PERF.md, sessions 6 and 8). Session 8 chose the
// shipped ForwardConfig (listed first) from this sweep run on both. Each variant here is the same kernel (src/cpu/flash_forward_kernel.hpp) with other
// block sizes or micro-tiles, so results differ only in rounding; every variant is checked
// against the first (ForwardConfig) before it is timed (max |difference| printed; ratios are to
// the first too), and timed in rounds that run every variant once (so a slow spell of a shared
// machine hits all alike), median per variant.
//
// Build (from the repository root; the shapes are those of bench/peers.py's CPU section; with
// -mamx-tile -mamx-bf16 on an AMX CPU the AMX forward joins as variant 1):
//   g++ -std=c++17 -O3 -march=native [-mamx-tile -mamx-bf16] -pthread -I include -I src
//       dev/cpu_forward_sweep.cpp src/cpu/worker_pool.cpp src/cpu/amx_forward.cpp -o /tmp/cpu_forward_sweep
// Run: /tmp/cpu_forward_sweep [threads ...]        (default: 2)
//      ROUNDS=n (default 7), SHAPES=all (adds S=4096 d=128, S=1024 d=128 causal, S=2048 d=256),
//      ONLY=1,8 (time only those variants beside the first, by their index in the list),
//      PHASES=1 (instead: where the shipped configuration's thread time goes, per phase of a task),
//      DTYPE=bf16|f16 (inputs and output in that dtype; default fp32)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "sweep_common.hpp"
#include "cpu/amx.hpp"
#include "cpu/amx_forward_kernel.hpp"
#include "cpu/flash_forward_kernel.hpp"

using namespace flashcore;
using namespace flashcore::cpu;
using namespace flashcore::cpu::forward_detail;

namespace {

template <int R, int V>
struct MicroTile {
  static constexpr int kRows = R;
  static constexpr int kVecs = V;
};

/** ForwardConfig with other block sizes and micro-tiles. */
template <int64_t Rows, int64_t Keys, class Score, class Output, int64_t MaxBlocks = ForwardConfig::kMaxBlocksPerTask,
          bool Paced = true>
struct Variant : ForwardConfig {
  static constexpr bool kPacedPrefetch = Paced;
  using ScoreGemm = Score;
  using OutputGemm = Output;
  static constexpr int64_t kBlockRows = Rows;
  static constexpr int64_t kBlockKeys = Keys;
  static constexpr int64_t kMaxBlocksPerTask = MaxBlocks;
};

using TimedPhases = SweepPhaseTimer<ForwardPhase>;  // dev/sweep_common.hpp

struct TimedConfig : ForwardConfig {
  using PhaseTimer = TimedPhases;
};

struct Entry {
  std::string name;
  Status (*run)(const AttentionParams&);
};

template <class Config>
Entry entry(const char* name) {
  return {name, &flash_forward_with<Config>};
}

std::vector<Entry> variants() {
  using T8x2 = MicroTile<8, 2>;
  using T6x4 = MicroTile<6, 4>;
  using T12x2 = MicroTile<12, 2>;
  using T14x2 = MicroTile<14, 2>;
  using T4x4 = MicroTile<4, 4>;
  using T8x3 = MicroTile<8, 3>;
  return {
      entry<ForwardConfig>("shipped: 48 rows, 64 keys, 8x3 / 8x3"),
      entry<Variant<64, 64, T8x2, T8x2>>("64 rows, 64 keys, 8x2 / 8x2 (shipped d<128 until session 7)"),
      entry<Variant<64, 64, T6x4, T6x4>>("64 rows, 64 keys, 6x4 / 6x4"),
      entry<Variant<64, 64, T12x2, T12x2>>("64 rows, 64 keys, 12x2 / 12x2"),
      entry<Variant<64, 64, T14x2, T14x2>>("64 rows, 64 keys, 14x2 / 14x2"),
      entry<Variant<64, 64, T4x4, T4x4>>("64 rows, 64 keys, 4x4 / 4x4"),
      entry<Variant<64, 64, T6x4, T8x2>>("64 rows, 64 keys, 6x4 / 8x2"),
      entry<Variant<64, 64, T8x2, T6x4>>("64 rows, 64 keys, 8x2 / 6x4"),
      entry<Variant<64, 32, T8x2, T8x2>>("64 rows, 32 keys, 8x2 / 8x2"),
      entry<Variant<64, 128, T8x2, T8x2>>("64 rows, 128 keys, 8x2 / 8x2"),
      entry<Variant<32, 64, T8x2, T8x2, 16>>("32 rows, 64 keys, 8x2 / 8x2, 16 blocks"),
      entry<Variant<128, 64, T6x4, T6x4, 4>>("128 rows, 64 keys, 6x4 / 6x4, 4 blocks"),
      entry<Variant<64, 64, T8x2, T8x2, 16>>("64 rows, 64 keys, 8x2 / 8x2, 16 blocks"),
      entry<Variant<64, 128, T8x2, T8x2, 16>>("64 rows, 128 keys, 8x2 / 8x2, 16 blocks (shipped d>=128 until session 7)"),
      entry<Variant<64, 64, T8x2, T8x2, 4>>("64 rows, 64 keys, 8x2 / 8x2, 4 blocks"),
      entry<Variant<64, 64, T8x2, T8x2, 8, false>>("64 rows, 64 keys, 8x2 / 8x2, burst prefetch"),
      entry<Variant<64, 128, T8x2, T8x2, 16, false>>("64 rows, 128 keys, 8x2 / 8x2, 16 blocks, burst prefetch"),
      // Larger micro-tiles with the d >= 128 blocking: fewer loads per FMA, for CPUs with two
      // 512-bit FMA ports.
      entry<Variant<64, 128, T6x4, T6x4, 16>>("64 rows, 128 keys, 6x4 / 6x4, 16 blocks"),
      entry<Variant<64, 128, T14x2, T14x2, 16>>("64 rows, 128 keys, 14x2 / 14x2, 16 blocks"),
      entry<Variant<64, 128, T8x2, T6x4, 16>>("64 rows, 128 keys, 8x2 / 6x4, 16 blocks"),
      // Around the shipped 8x3 tile (session 8).
      entry<Variant<48, 64, T8x3, T8x3, 4>>("48 rows, 64 keys, 8x3 / 8x3, 4 blocks"),
      entry<Variant<48, 64, T8x3, T8x3, 12>>("48 rows, 64 keys, 8x3 / 8x3, 12 blocks"),
      entry<Variant<48, 128, T8x3, T8x3, 8>>("48 rows, 128 keys, 8x3 / 8x3"),
      entry<Variant<96, 64, T8x3, T8x3, 4>>("96 rows, 64 keys, 8x3 / 8x3, 4 blocks"),
      entry<Variant<48, 32, T8x3, T8x3>>("48 rows, 32 keys, 8x3 / 8x3"),
  };
}

/** The AMX forward (src/cpu/amx_forward_kernel.hpp) where this build and CPU have it. */
std::vector<Entry> amx_variants() {
#if FLASHCORE_AMX_BUILT
  if (amx_usable()) {
    return {{"amx: 64 keys, 8 blocks (fp32's)", &amx_detail::amx_flash_forward_with<64, NoPhaseTimer, 8>},
            {"amx: 256 keys, 8 blocks", &amx_detail::amx_flash_forward_with<256, NoPhaseTimer, 8>},
            {"amx: 256 keys, 16 blocks, 2 tasks per thread", &amx_detail::amx_flash_forward_with<256, NoPhaseTimer, 16>},
            {"amx: 256 keys, 32 blocks", &amx_detail::amx_flash_forward_with<256, NoPhaseTimer, 32>},
            {"amx: 256 x 16, 4 tasks per thread", &amx_detail::amx_flash_forward_with<256, NoPhaseTimer, 16, 4>},
            {"amx: 256 x 16, 8 tasks per thread (fp16 / bf16's)",
             &amx_detail::amx_flash_forward_with<256, NoPhaseTimer, 16, 8>}};
  }
#endif
  return {};
}

using Shape = SweepShape;

struct Problem {
  std::vector<float> q, k, v, out;  // fp32 data, or 16-bit elements two per float (DTYPE=bf16|f16)
  DType dtype = DType::F32;
  AttentionParams p;
  /** Output element i as a float. */
  float out_at(size_t i) const {
    if (dtype == DType::F32) return out[i];
    const uint16_t h = reinterpret_cast<const uint16_t*>(out.data())[i];
    return dtype == DType::BF16 ? bf16_to_float(h) : half_to_float(h);
  }
  size_t out_count() const { return out.size(); }  // n elements either way (16-bit ones use half the buffer)
};

/** DTYPE from the environment: f32 (default), bf16 or f16. */
DType sweep_dtype() {
  const char* d = std::getenv("DTYPE");
  if (d && std::string(d) == "bf16") return DType::BF16;
  if (d && std::string(d) == "f16") return DType::F16;
  return DType::F32;
}

void build(Problem& pr, const Shape& s, int threads) {
  constexpr int64_t kHeads = 16;
  const int64_t n = s.seqlen * kHeads * s.head_dim;
  pr.dtype = sweep_dtype();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto* t : {&pr.q, &pr.k, &pr.v}) {
    t->resize(static_cast<size_t>(n));
    for (float& x : *t) x = normal(rng);
    if (pr.dtype != DType::F32) {  // convert in place into the first half of the buffer
      uint16_t* h = reinterpret_cast<uint16_t*>(t->data());
      for (int64_t i = 0; i < n; ++i) {
        const float x = (*t)[static_cast<size_t>(i)];
        h[i] = pr.dtype == DType::BF16 ? float_to_bf16(x) : float_to_half(x);
      }
    }
  }
  pr.out.assign(static_cast<size_t>(n), 0.f);
  AttentionParams& p = pr.p;
  auto view = [&](TensorRef& t, float* data) {  // (batch 1, seqlen, heads, head_dim), as peers.py passes it
    t.data = data;
    t.batch_stride = n;
    t.row_stride = kHeads * s.head_dim;
    t.head_stride = s.head_dim;
  };
  view(p.q, pr.q.data());
  view(p.k, pr.k.data());
  view(p.v, pr.v.data());
  view(p.out, pr.out.data());
  p.dtype = pr.dtype;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = s.seqlen;
  p.total_q = p.total_k = s.seqlen;
  p.heads_q = p.heads_kv = kHeads;
  p.head_dim = s.head_dim;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  p.causal = s.causal;
  p.window_right = s.causal ? 0 : -1;
  p.num_threads = threads;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::vector<int> thread_counts = sweep_thread_counts(argc, argv);
  const int rounds = sweep_rounds(7);
  const std::vector<Shape> shapes = sweep_shapes();
  std::vector<Entry> all = variants();
  const std::vector<Entry> amx = amx_variants();
  all.insert(all.begin() + 1, amx.begin(), amx.end());  // indices 1-6 when present
  all = sweep_picked(all);  // the first variant stays first
  if (std::getenv("PHASES")) {
    std::printf("cpu_flash forward, shipped configuration, %% of thread time (wall x threads) per phase, "
                "summed over %d calls\n", rounds);
    const char* names[] = {"between tasks", "q pack + out", "k/v copy", "S gemm", "softmax", "O gemm"};
    std::vector<Entry> timed_entries = {entry<TimedConfig>("avx")};
#if FLASHCORE_AMX_BUILT
    if (amx_usable()) {
      timed_entries.push_back({"amx 64 x 8", &amx_detail::amx_flash_forward_with<64, TimedPhases, 8>});
      timed_entries.push_back({"amx 256 x 16 x 8", &amx_detail::amx_flash_forward_with<256, TimedPhases, 16, 8>});
    }
#endif
    for (int threads : thread_counts) {
      for (const Shape& s : shapes) for (const Entry& timed : timed_entries) {
        Problem pr;
        build(pr, s, threads);
        const std::string label = timed.name + " " + sweep_cell(threads, s);
        TimedPhases::report(label.c_str(), timed, pr.p, rounds, threads, s.forward_flops(), names);
      }
    }
    return 0;
  }
  std::printf("cpu_flash forward variants (%s), %s, B=1 H=16, median of %d rounds, GFLOP/s\n", Simd::kName,
              std::getenv("DTYPE") ? std::getenv("DTYPE") : "fp32", rounds);
  for (int threads : thread_counts) {
    for (const Shape& s : shapes) {
      Problem pr;
      build(pr, s, threads);
      const double flops = s.forward_flops();
      // Reference output of the first configuration, then each variant checked against it.
      seconds_of(all[0], pr.p);
      // Variants round differently: a few output ulps apart is expected (bf16: 2^-8 relative).
      const double wrong_above = pr.dtype == DType::BF16 ? 2e-2 : pr.dtype == DType::F16 ? 4e-3 : 1e-4;
      std::vector<float> shipped(pr.out_count());
      for (size_t j = 0; j < shipped.size(); ++j) shipped[j] = pr.out_at(j);
      std::vector<double> max_diff(all.size(), 0.0);
      for (size_t i = 0; i < all.size(); ++i) {
        std::fill(pr.out.begin(), pr.out.end(), std::nanf(""));
        seconds_of(all[i], pr.p);
        for (size_t j = 0; j < shipped.size(); ++j) {
          const double d = std::fabs(static_cast<double>(pr.out_at(j)) - shipped[j]);
          max_diff[i] = std::max(max_diff[i], std::isnan(d) ? INFINITY : d);
        }
      }
      const std::vector<double> medians = sweep_medians(all, pr.p, rounds);
      std::printf("\n%s\n", sweep_cell(threads, s).c_str());
      double base = 0.0;
      for (size_t i = 0; i < all.size(); ++i) {
        const double gflops = flops / medians[i] * 1e-9;
        if (i == 0) base = gflops;
        std::printf("  %-44s %8.1f  %5.2fx  max|diff| %.1e%s\n", all[i].name.c_str(), gflops, gflops / base,
                    max_diff[i], max_diff[i] > wrong_above ? "  WRONG" : "");
      }
    }
  }
  return 0;
}
