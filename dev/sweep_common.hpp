// What the CPU sweeps (dev/cpu_forward_sweep.cpp, dev/cpu_backward_sweep.cpp) share: their
// command line and environment (thread counts, ROUNDS, SHAPES, ONLY), a timed call of a variant,
// and the phase timer of their PHASES=1 modes with its report.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

/** One problem shape of the sweeps: B = 1, H = 16, this sequence length and head dim. */
struct SweepShape {
  int64_t seqlen, head_dim;
  bool causal;
  /** Forward FLOPs (4 B H S^2 D, halved when causal). */
  double forward_flops() const { return 4.0 * 16 * seqlen * seqlen * head_dim * (causal ? 0.5 : 1.0); }
};

/** "16 threads, S=2048 d=128 causal". */
inline std::string sweep_cell(int threads, const SweepShape& s) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%d threads, S=%lld d=%lld%s", threads, static_cast<long long>(s.seqlen),
                static_cast<long long>(s.head_dim), s.causal ? " causal" : "");
  return buf;
}

/** Thread counts from the arguments (default: 2). */
inline std::vector<int> sweep_thread_counts(int argc, char** argv) {
  std::vector<int> counts;
  for (int i = 1; i < argc; ++i) counts.push_back(std::atoi(argv[i]));
  if (counts.empty()) counts.push_back(2);
  return counts;
}

/** ROUNDS from the environment, else `fallback`. */
inline int sweep_rounds(int fallback) {
  const char* r = std::getenv("ROUNDS");
  return r ? std::max(1, std::atoi(r)) : fallback;
}

/** bench/peers.py's CPU shapes; SHAPES=all adds S=4096 d=128, S=1024 d=128 causal, S=2048 d=256. */
inline std::vector<SweepShape> sweep_shapes() {
  std::vector<SweepShape> shapes = {{1024, 64, false}, {2048, 64, true}, {2048, 128, false}};
  if (std::getenv("SHAPES") && std::string(std::getenv("SHAPES")) == "all") {
    shapes.push_back({4096, 128, false});
    shapes.push_back({1024, 128, true});
    shapes.push_back({2048, 256, false});
  }
  return shapes;
}

/** ONLY=1,3 from the environment: the first variant and those listed by index; else all. */
template <class Entry>
std::vector<Entry> sweep_picked(const std::vector<Entry>& all) {
  const char* only = std::getenv("ONLY");
  if (!only) return all;
  std::vector<Entry> picked = {all[0]};
  for (const char* c = only; *c;) {
    char* end = nullptr;
    const long i = std::strtol(c, &end, 10);
    if (end == c) break;
    if (i > 0 && i < static_cast<long>(all.size())) picked.push_back(all[static_cast<size_t>(i)]);
    c = *end ? end + 1 : end;
  }
  return picked;
}

/** Seconds of one call of entry.run(params) (an Entry has a name and a run returning a Status);
 *  a failed call ends the sweep. */
template <class Entry, class Params>
double seconds_of(const Entry& e, const Params& p) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = e.run(p);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s failed: %s\n", e.name.c_str(), st.message.c_str());
    std::exit(1);
  }
  return dt;
}

/** Median seconds per call of each variant on params: `rounds` rounds that run every variant
 *  once in order, so that a slow spell of a shared machine hits all alike. */
template <class Entry, class Params>
std::vector<double> sweep_medians(const std::vector<Entry>& all, const Params& params, int rounds) {
  std::vector<std::vector<double>> times(all.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < all.size(); ++i) times[i].push_back(seconds_of(all[i], params));
  }
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

/** A kernel's PhaseTimer for PHASES=1: a kernel's PhaseTimer::lap(phase) ends each phase of a
 *  task, and this timer charges the steady_clock time since the same thread's previous lap in the
 *  same call to that phase. new_call() before every call: a thread's first lap in a call only
 *  starts its clock, so the time between calls is not charged. Phase is an enum class ending in
 *  kCount. */
template <class Phase>
struct SweepPhaseTimer {
  static constexpr int kCount = static_cast<int>(Phase::kCount);
  static inline std::array<std::atomic<int64_t>, kCount> ns{};
  static inline std::atomic<int> epoch{0};
  static void reset() {
    for (auto& x : ns) x.store(0);
  }
  static void new_call() { epoch.fetch_add(1); }
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  /** Charges `threads` threads' time from `start` to now to `phase` (work that runs on all of them
   *  between laps, e.g. the backward's reductions after its tasks). */
  static void charge(Phase phase, std::chrono::steady_clock::time_point start, int threads) {
    const auto ns_each = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    ns[static_cast<size_t>(phase)].fetch_add(ns_each.count() * threads, std::memory_order_relaxed);
  }
  static void lap(Phase phase) {
    thread_local int seen = -1;
    thread_local std::chrono::steady_clock::time_point last;
    const auto now = std::chrono::steady_clock::now();
    const int e = epoch.load(std::memory_order_relaxed);
    if (seen == e) {
      ns[static_cast<size_t>(phase)].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count(),
                                                std::memory_order_relaxed);
    }
    seen = e;
    last = now;
  }

  /** Times `rounds` calls of entry on params after one untimed call and prints one line: `label`,
   *  GFLOP/s for `flops` per call, and each phase's share of the thread time (wall x threads),
   *  named by `names`, then what no phase was charged (a thread's start and end of a call, idle). */
  template <class Entry, class Params>
  static void report(const char* label, const Entry& entry, const Params& params, int rounds, int threads,
                     double flops, const char* const* names) {
    seconds_of(entry, params);
    reset();
    double wall = 0;
    for (int r = 0; r < rounds; ++r) {
      new_call();
      wall += seconds_of(entry, params);
    }
    const double thread_ns = wall * 1e9 * threads;
    std::printf("%s: %.1f GFLOP/s |", label, flops * rounds / wall * 1e-9);
    double charged = 0;
    for (int i = 0; i < kCount; ++i) {
      const double x = static_cast<double>(ns[static_cast<size_t>(i)].load());
      charged += x;
      std::printf(" %s %.1f%%", names[i], 100.0 * x / thread_ns);
    }
    std::printf(" | untimed %.1f%%\n", 100.0 * (1.0 - charged / thread_ns));
  }
};
