// The rate of the cpu_flash forward's two GEMMs alone, per micro-tile, with operands resident in
// cache, on 1..N threads at once: how close the micro-kernel gets to the FMA ceiling
// (dev/fma_peak.cpp) on this CPU, apart from the softmax, the tile copies and the threading.
//
// Why: on the development EPYC the d = 128 forward runs at ~88% of the FMA peak and its GEMMs at
// ~93%; on the GPU machine's Xeon (two 512-bit FMA ports) the whole forward ran at 60-70%. This
// says whether the micro-kernel or the rest of the forward is what the Xeon loses.
//
// The two GEMMs of one (key tile, row block), shapes as in flash_forward_kernel.hpp:
//   S^T [keys x rows]  = K [keys x D] Q^T [D x rows]        (gemm_bcast kOverwriteMax, depth D)
//   O^T [D x rows]    += V^T [D x keys] P^T [keys x rows]   (gemm_bcast kScaleAdd, depth keys)
// Each thread loops over its own operands (K, V, Q^T, P^T, O^T: 24-80 KiB at D = 128), so they
// stay in L1/L2 as they do inside one task of the forward.
//
// Build (from the repository root):
//   g++ -std=c++17 -O3 -march=native -pthread -I include -I src dev/cpu_gemm_rate.cpp -o /tmp/cpu_gemm_rate
// Run: /tmp/cpu_gemm_rate [threads ...]    (default: 1 2), e.g. /tmp/cpu_gemm_rate 1 2 16
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cpu/cpu_common.hpp"

using namespace flashcore::cpu::flash_detail;

namespace {

template <int R, int V>
struct Tile {
  static constexpr int kRows = R;
  static constexpr int kVecs = V;
};

/** One thread's operands, 64-byte aligned like the forward's scratch (ForwardScratch): a
 *  16-byte-aligned buffer (std::vector's) makes 3 of 4 512-bit loads span two cache lines. */
struct Operands {
  AlignedFloats k, v, qt, pt, st, ot, column_max, column_scale;
  Operands(int64_t d, int64_t keys, int64_t rows) {
    auto fill = [](AlignedFloats& a, int64_t n, float x) {
      float* p = a.reserve(n);
      std::fill(p, p + n, x);
    };
    fill(k, keys * d, 0.01f);
    fill(v, keys * d, 0.02f);
    fill(qt, d * rows, 0.03f);
    fill(pt, keys * rows, 0.04f);
    fill(st, keys * rows, 0.f);
    fill(ot, d * rows, 0.f);
    fill(column_max, rows, -1e30f);
    fill(column_scale, rows, 0.5f);
  }
};

enum class Which { kBoth, kScores, kOutput };

/** GFLOP/s of one thread running `reps` (key tile, row block) GEMM pairs (or only one of them). */
template <class Traits>
double run_pairs(int64_t d, int64_t keys, int64_t rows, int64_t reps, Which which) {
  Operands o(d, keys, rows);
  auto once = [&] {
    if (which != Which::kOutput)
      gemm_bcast<Accumulate::kOverwriteMax, Traits>(keys, rows, d, o.k.data(), d, 1, o.qt.data(), rows, o.st.data(),
                                                    rows, o.column_max.data());
    if (which != Which::kScores)
      gemm_bcast<Accumulate::kScaleAdd, Traits>(d, rows, keys, o.v.data(), 1, d, o.pt.data(), rows, o.ot.data(), rows,
                                                o.column_scale.data());
  };
  for (int i = 0; i < 20; ++i) once();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) once();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float sink = o.ot.data()[0] + o.st.data()[0];
  (void)sink;
  const double gemms = which == Which::kBoth ? 2.0 : 1.0;
  return gemms * 2.0 * double(d) * double(keys) * double(rows) * double(reps) / s / 1e9;
}

/** Sum over `threads` threads running run_pairs at once. */
template <class Traits>
double rate(int threads, int64_t d, int64_t keys, int64_t rows, Which which = Which::kBoth) {
  // ~0.1 s per thread on a 100 GFLOP/s core, after a warm-up, so that the clock has settled.
  const int64_t reps = std::max<int64_t>(200, int64_t(1e10 / (4.0 * d * keys * rows)));
  std::vector<double> per(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { per[static_cast<size_t>(t)] = run_pairs<Traits>(d, keys, rows, reps, which); });
  for (auto& th : pool) th.join();
  double total = 0;
  for (double x : per) total += x;
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<int> thread_counts;
  for (int i = 1; i < argc; ++i) thread_counts.push_back(std::atoi(argv[i]));
  if (thread_counts.empty()) thread_counts = {1, 2};
  std::printf("cpu_flash forward GEMM pairs (S^T = K Q^T, O^T += V^T P^T), operands in cache, GFLOP/s summed over threads\n");
  for (int threads : thread_counts) {
    for (int64_t d : {64, 128}) {
      std::printf("%2d threads, D=%3lld, 64 keys:  8x2 / 64 rows %7.1f   8x3 / 48 rows %7.1f   6x4 / 64 rows %7.1f   "
                  "8x3 / 96 rows %7.1f\n",
                  threads, static_cast<long long>(d), rate<Tile<8, 2>>(threads, d, 64, 64),
                  rate<Tile<8, 3>>(threads, d, 64, 48), rate<Tile<6, 4>>(threads, d, 64, 64),
                  rate<Tile<8, 3>>(threads, d, 64, 96));
    }
    // Each GEMM alone, and 32-key tiles (K / V tile 16 KiB: with Q^T, P^T of a 48-row block
    // it all fits a 48 KiB L1).
    for (int64_t keys : {64, 32}) {
      std::printf("%2d threads, D=128, %2lld keys, 8x3 / 48 rows: S^T alone %7.1f  O^T alone %7.1f  both %7.1f\n",
                  threads, static_cast<long long>(keys), rate<Tile<8, 3>>(threads, 128, keys, 48, Which::kScores),
                  rate<Tile<8, 3>>(threads, 128, keys, 48, Which::kOutput), rate<Tile<8, 3>>(threads, 128, keys, 48));
    }
  }
  return 0;
}
