// Whether this CPU runs Intel AMX (bf16 tiles) for this process, and what it is worth to an fp32
// attention kernel: the question behind a possible AMX forward for the CPU path (#2's d128 cell on
// the GPU machine's Xeon, where the AVX-512 GEMMs reach only ~70% of the FMA peak at 2 threads).
//
// 1. CPUID (AMX-TILE, AMX-BF16, AVX512-BF16), XCR0's tile bits, and the Linux permission request
//    (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA) that must precede the first tile instruction.
// 2. One TDPBF16PS against a scalar model of its definition (exact: products of bf16 are exact in
//    fp32, and the scalar model adds in the instruction's order).
// 3. Sustained TDPBF16PS rate, 2 x 2 accumulator tiles, operands loaded from L1 every step, at 1..N
//    threads (bf16 GFLOP/s), against fma_peak's fp32 number.
// 4. Accuracy of S = Q K^T (32 x 64, d = 128) from fp32 operands split into three bf16 parts each
//    (x = hi + mid + lo) with the six products whose split indices sum to <= 2, against fp64: the
//    split an fp32-exact AMX path would need (TESTING.md: CPU fp32 relative error < 1e-5).
//
// build: g++ -std=c++17 -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16 -pthread dev/amx_probe.cpp -o amx_probe
// run:   ./amx_probe 1 2 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "tile configuration is 64 bytes");

float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

/** Tiles 0-3: 16 x 16 fp32 accumulators; 4-5: A (16 rows x 32 bf16); 6-7: B (16 pair-rows x 16 x 2). */
void configure_tiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

bool probe_support() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  const bool avx512_bf16 = a & (1u << 5);
  std::printf("cpuid: amx-tile %d amx-bf16 %d avx512-bf16 %d\n", amx_tile, amx_bf16, avx512_bf16);
  if (!amx_tile || !amx_bf16) return false;
  uint32_t xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  std::printf("xcr0: 0x%x (tile bits 17-18: %d %d)\n", xcr0_lo, (xcr0_lo >> 17) & 1, (xcr0_lo >> 18) & 1);
  const long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
  std::printf("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): %ld\n", rc);
  return rc == 0;
}

bool check_one_product() {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16], ref[16 * 16];
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (auto& x : a) x = float_to_bf16(u(gen));
  for (auto& x : b) x = float_to_bf16(u(gen));
  configure_tiles();
  _tile_zero(0);
  _tile_loadd(4, a, 64);
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_stored(0, c, 64);
  _tile_release();
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      float acc = 0.f;
      for (int k = 0; k < 16; ++k) {
        acc += bf16_to_float(a[m * 32 + 2 * k]) * bf16_to_float(b[k * 32 + 2 * n]);
        acc += bf16_to_float(a[m * 32 + 2 * k + 1]) * bf16_to_float(b[k * 32 + 2 * n + 1]);
      }
      ref[m * 16 + n] = acc;
    }
  }
  double worst = 0;
  for (int i = 0; i < 256; ++i) worst = std::max(worst, std::fabs(double(c[i]) - ref[i]) / (std::fabs(ref[i]) + 1e-6));
  std::printf("one TDPBF16PS vs scalar model: max relative difference %.3g\n", worst);
  return worst < 1e-5;
}

/** Sustained TDPBF16PS in three loop shapes (how = 0, 1, 2):
 *  0: 2 x 2 accumulators, A and B reloaded from L1 every step (the usual GEMM block);
 *  1: the same products with no loads in the loop (the instruction's own rate);
 *  2: 1 x 2 accumulators with A and B double-buffered across steps (tiles 2-3 and 4-7), so no load
 *     overwrites a tile that an unfinished product still reads. */
double products_per_second(long steps, int how) {
  alignas(64) static thread_local uint16_t a[2][16 * 32], b[4][16 * 32];
  alignas(64) static thread_local float c[4][256];
  for (int i = 0; i < 16 * 32; ++i) a[0][i] = a[1][i] = b[0][i] = b[1][i] = b[2][i] = b[3][i] = 0x3f80;
  configure_tiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a[0], 64);
  _tile_loadd(5, a[1], 64);
  _tile_loadd(6, b[0], 64);
  _tile_loadd(7, b[1], 64);
  const auto t0 = std::chrono::steady_clock::now();
  long products = 0;
  if (how == 0) {
    for (long s = 0; s < steps; ++s) {
      _tile_loadd(4, a[0], 64);
      _tile_loadd(5, a[1], 64);
      _tile_loadd(6, b[0], 64);
      _tile_loadd(7, b[1], 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    products = 4 * steps;
  } else if (how == 1) {
    for (long s = 0; s < steps; ++s) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    products = 4 * steps;
  } else {
    for (long s = 0; s < steps; s += 2) {
      _tile_loadd(2, a[0], 64);
      _tile_loadd(4, b[0], 64);
      _tile_loadd(5, b[1], 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
      _tile_loadd(3, a[1], 64);
      _tile_loadd(6, b[2], 64);
      _tile_loadd(7, b[3], 64);
      _tile_dpbf16ps(0, 3, 6);
      _tile_dpbf16ps(1, 3, 7);
    }
    products = 2 * steps;
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  _tile_release();
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return products / sec;
}

void split3(float x, uint16_t parts[3]) {
  float rest = x;
  for (int i = 0; i < 3; ++i) {
    parts[i] = float_to_bf16(rest);
    rest -= bf16_to_float(parts[i]);
  }
}

/** S = Q K^T through AMX with split operands; returns relative Frobenius error against fp64. */
void split_accuracy() {
  constexpr int M = 32, N = 64, D = 128;
  std::mt19937 gen(7);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> q(M * D), k(N * D);
  for (auto& x : q) x = g(gen);
  for (auto& x : k) x = g(gen);
  // q_parts[s][m][d]; k_vnni[s][chunk of 32 d][key block of 16][16 pair rows x 16 keys x 2]
  alignas(64) static uint16_t q_parts[3][M * D], k_vnni[3][D / 32][N / 16][512];
  for (int m = 0; m < M; ++m)
    for (int d = 0; d < D; ++d) {
      uint16_t p[3];
      split3(q[m * D + d], p);
      for (int s = 0; s < 3; ++s) q_parts[s][m * D + d] = p[s];
    }
  for (int n = 0; n < N; ++n)
    for (int d = 0; d < D; ++d) {
      uint16_t p[3];
      split3(k[n * D + d], p);
      const int chunk = d / 32, within = d % 32, pair_row = within / 2, half = within % 2;
      for (int s = 0; s < 3; ++s) k_vnni[s][chunk][n / 16][pair_row * 32 + (n % 16) * 2 + half] = p[s];
    }
  for (int products : {1, 3, 6}) {
    alignas(64) float s_out[M * N];
    configure_tiles();
    for (int n0 = 0; n0 < N; n0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      // pairs (qi, ki) with qi + ki <= 2, smallest terms first
      const int order[6][2] = {{2, 0}, {0, 2}, {1, 1}, {1, 0}, {0, 1}, {0, 0}};
      for (int pi = 6 - products; pi < 6; ++pi) {
        const int qs = order[pi][0], ks = order[pi][1];
        for (int c = 0; c < D / 32; ++c) {
          _tile_loadd(4, &q_parts[qs][0 * D + c * 32], D * 2);
          _tile_loadd(5, &q_parts[qs][16 * D + c * 32], D * 2);
          _tile_loadd(6, k_vnni[ks][c][n0 / 16], 64);
          _tile_loadd(7, k_vnni[ks][c][n0 / 16 + 1], 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, &s_out[0 * N + n0], N * 4);
      _tile_stored(1, &s_out[0 * N + n0 + 16], N * 4);
      _tile_stored(2, &s_out[16 * N + n0], N * 4);
      _tile_stored(3, &s_out[16 * N + n0 + 16], N * 4);
    }
    _tile_release();
    double err = 0, norm = 0, err32 = 0;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double ref = 0;
        float f32 = 0;
        for (int d = 0; d < D; ++d) {
          ref += double(q[m * D + d]) * k[n * D + d];
          f32 = std::fma(q[m * D + d], k[n * D + d], f32);
        }
        err += (s_out[m * N + n] - ref) * (s_out[m * N + n] - ref);
        err32 += (f32 - ref) * (f32 - ref);
        norm += ref * ref;
      }
    std::printf("S = Q K^T, %d bf16 product(s): relative error %.3g (fp32 FMA dot: %.3g)\n", products,
                std::sqrt(err / norm), std::sqrt(err32 / norm));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!probe_support()) {
    std::printf("AMX not usable here\n");
    return 1;
  }
  if (!check_one_product()) std::printf("WRONG: TDPBF16PS disagrees with the scalar model\n");
  split_accuracy();
  const long steps = 2000000;
  const char* shapes[3] = {"2x2 reloaded", "no loads", "1x2 double-buffered"};
  for (int ai = 1; ai < argc; ++ai) {
    const int threads = std::atoi(argv[ai]);
    for (int how = 0; how < 3; ++how) {
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<double> rates(threads);
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
            rates[t] = products_per_second(steps, how);
          });
        }
        for (auto& th : pool) th.join();
        double sum = 0;
        for (double r : rates) sum += r;
        best = std::max(best, sum);
      }
      // one TDPBF16PS on 16 x 16 x 32 = 8192 multiply-adds
      std::printf("TDPBF16PS %-20s %2d threads: %6.1f M/s = %7.1f bf16 GFLOP/s (%.0f M/s per thread)\n", shapes[how],
                  threads, best / 1e6, best * 8192 * 2 / 1e9, best / threads / 1e6);
    }
  }
  return 0;
}
