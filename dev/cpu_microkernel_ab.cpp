// A/B of GEMM micro-kernel variants for the cpu_flash forward's two GEMMs, in alternating rounds
// (median per variant), on 1..N threads at once, operands 64-byte aligned and in cache.
//
// Why: on the GPU machine's Xeon (two 512-bit FMA ports) the forward's GEMMs run at ~73% of the
// FMA peak where MKL's matmul reaches 77-88% on the same VM, and at ~92% on the development EPYC
// (docs/PERF.md, session 8). The variants try what BLAS micro-kernels do beyond ours:
//   lib      cpu_common.hpp's gemm_bcast, 8 x 3 (the forward's)
//   unroll4  the same tile with the k loop unrolled 4 times
//   packedA  A pre-packed in panels of 8 rows, [k][8] (one contiguous 32-byte broadcast source per
//            k instead of 8 rows D * 4 bytes apart); the forward's K/V tile copy could write it so
//   packed+unroll4
//   prefB    lib + a prefetch of B 8 k-steps ahead (3 lines per k)
// Shapes (D = 128, a 64-key tile, a 48-row block): S^T = K Q^T (depth D, kOverwriteMax) and
// O^T += V^T P^T (depth 64, kScaleAdd), as in flash_forward_kernel.hpp.
//
// Build: g++ -std=c++17 -O3 -march=native -pthread -I include -I src dev/cpu_microkernel_ab.cpp -o /tmp/ab
// Run:   /tmp/ab [threads ...]  (default 2); ROUNDS=n (default 7)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cpu/cpu_common.hpp"

using namespace flashcore::cpu::flash_detail;

namespace {

constexpr int kR = 8, kV = 3;
constexpr int64_t kD = 128, kKeys = 64, kCols = kV * kSimdWidth;  // 48 columns: one pass

/** gemm_micro with the k loop unrolled kUnroll times and an optional prefetch of B kPrefetch
 *  k-steps ahead; modes kOverwriteMax and kScaleAdd only. */
template <Accumulate kMode, int kUnroll, int kPrefetch>
inline void micro(const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb, float* c, int64_t ldc,
                  int64_t depth, float* column) {
  Vec acc[kR][kV];
  FC_UNROLL for (int r = 0; r < kR; ++r) {
    FC_UNROLL for (int v = 0; v < kV; ++v) acc[r][v] = Simd::zero();
  }
  auto step = [&](int64_t k) {
    const float* b_k = b + k * ldb;
    if constexpr (kPrefetch > 0) {
      FC_UNROLL for (int v = 0; v < kV; ++v) __builtin_prefetch(b_k + kPrefetch * ldb + v * kSimdWidth, 0, 3);
    }
    const float* a_k_ptr = a + k * a_k;
    Vec bv[kV];
    FC_UNROLL for (int v = 0; v < kV; ++v) bv[v] = Simd::load(b_k + v * kSimdWidth);
    FC_UNROLL for (int r = 0; r < kR; ++r) {
      const Vec ar = Simd::set1(a_k_ptr[r * a_row]);
      FC_UNROLL for (int v = 0; v < kV; ++v) acc[r][v] = Simd::fma(ar, bv[v], acc[r][v]);
    }
  };
  if constexpr (kUnroll == 4) {  // depth is a multiple of 4 here
    for (int64_t k = 0; k < depth; k += 4) {
      step(k);
      step(k + 1);
      step(k + 2);
      step(k + 3);
    }
  } else {
    for (int64_t k = 0; k < depth; ++k) step(k);
  }
  FC_UNROLL for (int r = 0; r < kR; ++r) {
    FC_UNROLL for (int v = 0; v < kV; ++v) {
      float* dst = c + r * ldc + v * kSimdWidth;
      if constexpr (kMode == Accumulate::kScaleAdd) {
        Simd::store(dst, Simd::fma(Simd::load(dst), Simd::load(column + v * kSimdWidth), acc[r][v]));
      } else {
        Simd::store(dst, acc[r][v]);
      }
    }
  }
  if constexpr (kMode == Accumulate::kOverwriteMax) {
    FC_UNROLL for (int v = 0; v < kV; ++v) {
      Vec m = acc[0][v];
      FC_UNROLL for (int r = 1; r < kR; ++r) m = Simd::max(m, acc[r][v]);
      Simd::store(column + v * kSimdWidth, Simd::max(Simd::load(column + v * kSimdWidth), m));
    }
  }
}

struct Operands {
  AlignedFloats k, v, k_packed, v_packed, qt, pt, st, ot, column_max, column_scale;
  Operands() {
    auto fill = [](AlignedFloats& a, int64_t n, float x) {
      float* p = a.reserve(n);
      for (int64_t i = 0; i < n; ++i) p[i] = x * static_cast<float>(1 + i % 7);
    };
    fill(k, kKeys * kD, 0.01f);
    fill(v, kKeys * kD, 0.02f);
    fill(qt, kD * kCols, 0.03f);
    fill(pt, kKeys * kCols, 0.04f);
    fill(st, kKeys * kCols, 0.f);
    fill(ot, kD * kCols, 0.f);
    fill(column_max, kCols, -1e30f);
    fill(column_scale, kCols, 0.5f);
    // K panels: rows (keys) 8p..8p+7 as [d][8]; V^T panels: rows (d) 8p..8p+7 as [key][8].
    float* kp = k_packed.reserve(kKeys * kD);
    for (int64_t key = 0; key < kKeys; ++key)
      for (int64_t d = 0; d < kD; ++d) kp[(key / 8) * 8 * kD + d * 8 + key % 8] = k.data()[key * kD + d];
    float* vp = v_packed.reserve(kKeys * kD);
    for (int64_t key = 0; key < kKeys; ++key)
      for (int64_t d = 0; d < kD; ++d) vp[(d / 8) * 8 * kKeys + key * 8 + d % 8] = v.data()[key * kD + d];
  }
};

enum class Variant { kLib, kUnroll4, kPackedA, kPackedUnroll4, kPrefetchB, kCount };
const char* kNames[] = {"lib 8x3", "unroll4", "packedA", "packed+unroll4", "prefB"};

template <int kUnroll, int kPrefetch>
void pair_local(Operands& o, bool packed) {
  // S^T [keys x cols] = K [keys x D] Q^T [D x cols]
  for (int64_t i = 0; i < kKeys; i += kR) {
    const float* a = packed ? o.k_packed.data() + (i / 8) * 8 * kD : o.k.data() + i * kD;
    micro<Accumulate::kOverwriteMax, kUnroll, kPrefetch>(a, packed ? 1 : kD, packed ? 8 : 1, o.qt.data(), kCols,
                                                         o.st.data() + i * kCols, kCols, kD, o.column_max.data());
  }
  // O^T [D x cols] = O^T * scale + V^T [D x keys] P^T [keys x cols]
  for (int64_t i = 0; i < kD; i += kR) {
    const float* a = packed ? o.v_packed.data() + (i / 8) * 8 * kKeys : o.v.data() + i;
    micro<Accumulate::kScaleAdd, kUnroll, kPrefetch>(a, 1, packed ? 8 : kD, o.pt.data(), kCols,
                                                     o.ot.data() + i * kCols, kCols, kKeys, o.column_scale.data());
  }
}

void pair(Operands& o, Variant v) {
  switch (v) {
    case Variant::kLib:
      gemm_bcast<Accumulate::kOverwriteMax, WideGemmTraits>(kKeys, kCols, kD, o.k.data(), kD, 1, o.qt.data(), kCols,
                                                            o.st.data(), kCols, o.column_max.data());
      gemm_bcast<Accumulate::kScaleAdd, WideGemmTraits>(kD, kCols, kKeys, o.v.data(), 1, kD, o.pt.data(), kCols,
                                                        o.ot.data(), kCols, o.column_scale.data());
      break;
    case Variant::kUnroll4: pair_local<4, 0>(o, false); break;
    case Variant::kPackedA: pair_local<1, 0>(o, true); break;
    case Variant::kPackedUnroll4: pair_local<4, 0>(o, true); break;
    case Variant::kPrefetchB: pair_local<1, 8>(o, false); break;
    default: break;
  }
}

double gflops(int threads, Variant v, int64_t reps) {
  std::vector<std::thread> pool;
  std::vector<Operands*> ops(static_cast<size_t>(threads));
  for (auto& p : ops) p = new Operands();
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t i = 0; i < reps; ++i) pair(*ops[static_cast<size_t>(t)], v);
    });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto* p : ops) delete p;
  return 4.0 * kD * kKeys * kCols * double(reps) * threads / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<int> thread_counts;
  for (int i = 1; i < argc; ++i) thread_counts.push_back(std::atoi(argv[i]));
  if (thread_counts.empty()) thread_counts.push_back(2);
  const int rounds = std::getenv("ROUNDS") ? std::max(1, std::atoi(std::getenv("ROUNDS"))) : 7;
  const int64_t reps = 20000;  // ~1.6 GFLOP per thread: 10-20 ms
  constexpr int kVariants = static_cast<int>(Variant::kCount);
  {  // every variant computes what the library does (same order of the sums: equal bits)
    Operands ref;
    pair(ref, Variant::kLib);
    for (int v = 1; v < kVariants; ++v) {
      Operands o;
      pair(o, static_cast<Variant>(v));
      for (int64_t i = 0; i < kD * kCols; ++i)
        if (o.ot.data()[i] != ref.ot.data()[i]) { std::printf("%s differs at O^T %lld\n", kNames[v], (long long)i); return 1; }
      for (int64_t i = 0; i < kKeys * kCols; ++i)
        if (o.st.data()[i] != ref.st.data()[i]) { std::printf("%s differs at S^T %lld\n", kNames[v], (long long)i); return 1; }
    }
  }
  std::printf("forward GEMM pair (D=128, 64 keys, 48 rows) per micro-kernel variant, GFLOP/s summed over threads, "
              "median of %d alternating rounds\n", rounds);
  for (int threads : thread_counts) {
    std::vector<std::vector<double>> r(kVariants);
    for (int v = 0; v < kVariants; ++v) gflops(threads, static_cast<Variant>(v), reps / 10);  // warm-up
    for (int round = 0; round < rounds; ++round)
      for (int v = 0; v < kVariants; ++v) r[static_cast<size_t>(v)].push_back(gflops(threads, static_cast<Variant>(v), reps));
    std::printf("%2d threads:", threads);
    double base = 0;
    for (int v = 0; v < kVariants; ++v) {
      auto& x = r[static_cast<size_t>(v)];
      std::sort(x.begin(), x.end());
      const double med = x[x.size() / 2];
      if (v == 0) base = med;
      std::printf("  %s %.1f (%.2fx)", kNames[v], med, med / base);
    }
    std::printf("\n");
  }
  return 0;
}
