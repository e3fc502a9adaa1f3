// Sustained fp32 FMA rate of this CPU (GFLOP/s) at 1..N threads: the ceiling of any fp32 CPU
// attention kernel, next to which the CPU benchmark's numbers (flashcore and torch SDPA) read.
// Each thread runs 16 independent vector FMA chains (more than ports x latency on current x86),
// operands in registers, no memory traffic.
// build: g++ -O2 -march=native -fopenmp dev/fma_peak.cpp -o /tmp/fma_peak; run: /tmp/fma_peak [threads...]
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#if defined(__AVX512F__)
using Vec = __m512;
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline Vec splat(float x) { return _mm512_set1_ps(x); }
static inline float first(Vec v) { return _mm512_cvtss_f32(v); }
constexpr int kLanes = 16;
#else
using Vec = __m256;
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline Vec splat(float x) { return _mm256_set1_ps(x); }
static inline float first(Vec v) { return _mm256_cvtss_f32(v); }
constexpr int kLanes = 8;
#endif

constexpr int kChains = 16;

static float run(long iters) {
  Vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = splat(1.0f + 1e-7f * i);
  const Vec a = splat(0.999999f), b = splat(1e-7f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = fma(acc[i], a, b);
  }
  float s = 0;
  for (int i = 0; i < kChains; ++i) s += first(acc[i]);
  return s;
}

int main(int argc, char** argv) {
  const long iters = 20000000;
  for (int ai = 1; ai < argc || ai == 1; ++ai) {
    const int threads = argc > 1 ? std::atoi(argv[ai]) : omp_get_max_threads();
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
      sink += run(iters);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double gflops = 2.0 * kLanes * kChains * iters * threads / s / 1e9;
      if (gflops > best) best = gflops;
      if (sink == 12345.f) std::printf(" ");
    }
    std::printf("fp32 FMA peak, %d threads: %.1f GFLOP/s (%d-lane vectors)\n", threads, best, kLanes);
    if (argc <= 1) break;
  }
  return 0;
}
