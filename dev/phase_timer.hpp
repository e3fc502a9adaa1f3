// The phase timer of the CPU sweeps (dev/cpu_forward_sweep.cpp, dev/cpu_backward_sweep.cpp), for
// their PHASES=1 modes: a kernel's PhaseTimer::lap(phase) ends each phase of a task, and this
// timer charges the steady_clock time since the same thread's previous lap in the same call to
// that phase. new_call() before every call: a thread's first lap in a call only starts its clock,
// so the time between calls is not charged. Phase is an enum class ending in kCount.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

template <class Phase>
struct SweepPhaseTimer {
  static constexpr int kCount = static_cast<int>(Phase::kCount);
  static inline std::array<std::atomic<int64_t>, kCount> ns{};
  static inline std::atomic<int> epoch{0};
  static void reset() {
    for (auto& x : ns) x.store(0);
  }
  static void new_call() { epoch.fetch_add(1); }
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
};
