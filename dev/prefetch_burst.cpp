// How many software prefetches may go out at once: the experiment behind PrefetchQueue
// (src/cpu/cpu_common.hpp).
//
// The access pattern of the CPU forward's K/V tiles: 64 rows of 512 B, 8 KiB apart (one head of
// a (batch, seq, heads, dim) tensor), in a 256 MiB buffer so every tile comes from DRAM. Between
// two tiles the loop runs ~60 us of register-only FMAs (the GEMMs of the blocks that use a tile).
// Modes: 0 = no prefetch; 1 = the next tile's 512 lines prefetched in one burst before the
// compute; 2 = the same lines spread over the compute, LINES at a time. Printed: cycles (TSC) to
// copy one tile, the number that fell from ~10k (mode 0) and ~6k (mode 1) to ~2k with 8 lines
// per burst on the development EPYC (docs/PERF.md, session 7).
//
// Build: g++ -O2 -march=native dev/prefetch_burst.cpp -o prefetch_burst
// Run:   ./prefetch_burst 0; ./prefetch_burst 1; for n in 8 16 64 256; do ./prefetch_burst 2 $n; done
#include <immintrin.h>
#include <x86intrin.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kStride = 8192, kRowBytes = 512, kRows = 64, kLine = 64;
constexpr size_t kTotal = size_t{256} << 20;
constexpr int kComputeSteps = 20000;  // ~60 us of FMAs per tile on the EPYC
float g_sink;

/** `steps` rounds of 8 independent FMA chains: busy cores, no memory traffic. */
__attribute__((noinline)) void compute(int steps) {
  const __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
  __m256 c[8];
  for (__m256& x : c) x = a;
  for (int i = 0; i < steps; ++i) {
    for (__m256& x : c) x = _mm256_fmadd_ps(x, b, a);
  }
  for (int i = 1; i < 8; ++i) c[0] = _mm256_add_ps(c[0], c[i]);
  float out[8];
  _mm256_storeu_ps(out, c[0]);
  g_sink += out[0];
}

}  // namespace

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  const size_t lines_per_burst = argc > 2 ? static_cast<size_t>(std::atoi(argv[2])) : 8;
  char* buffer = static_cast<char*>(std::aligned_alloc(4096, kTotal));
  std::memset(buffer, 1, kTotal);
  std::vector<char> tile(kRows * kRowBytes);
  const size_t tiles = kTotal / (kStride * kRows);
  const size_t lines_per_row = kRowBytes / kLine, lines = kRows * lines_per_row;
  unsigned long long copy_cycles = 0;
  for (size_t t = 0; t < tiles; ++t) {
    const char* here = buffer + t * kStride * kRows;
    const char* next = here + kStride * kRows;
    auto line = [&](size_t i) { return next + (i / lines_per_row) * kStride + (i % lines_per_row) * kLine; };
    const bool ahead = t + 1 < tiles;
    if (mode == 1 && ahead) {
      for (size_t i = 0; i < lines; ++i) _mm_prefetch(line(i), _MM_HINT_T0);
    }
    if (mode == 2 && ahead) {
      const size_t bursts = (lines + lines_per_burst - 1) / lines_per_burst;
      for (size_t i = 0; i < lines; i += lines_per_burst) {
        for (size_t j = i; j < i + lines_per_burst && j < lines; ++j) _mm_prefetch(line(j), _MM_HINT_T0);
        compute(static_cast<int>(kComputeSteps / bursts));
      }
    } else {
      compute(kComputeSteps);
    }
    const unsigned long long start = __rdtsc();
    for (size_t r = 0; r < kRows; ++r) std::memcpy(tile.data() + r * kRowBytes, here + r * kStride, kRowBytes);
    copy_cycles += __rdtsc() - start;
  }
  std::printf("mode %d%s: %.0f cycles to copy one 32 KiB tile\n", mode,
              mode == 2 ? (" (" + std::to_string(lines_per_burst) + " lines per burst)").c_str() : "",
              static_cast<double>(copy_cycles) / static_cast<double>(tiles));
  std::free(buffer);
  return static_cast<int>(g_sink) == 12345;  // keep the compute alive
}
