// The process-wide helper threads of the CPU backends (see worker_pool.hpp for why).
//
// Protocol of one call (the caller holds busy_ throughout):
//   1. the caller stores the body and the number of helpers that take part, then publishes a
//      new job word (generation << 16 | workers) with release order and wakes sleepers;
//   2. helper i (1-based) waits for a generation it has not run whose worker count exceeds i,
//      runs body(i) and counts down pending_; helpers not taking part are not woken (each
//      sleeps on a condition variable of its own), which matters when the pool has more
//      threads than the machine has cores;
//   3. the caller runs body(0), then waits for pending_ to reach 0.
// The body is read only by helpers that take part, and the caller overwrites it only after they
// all counted down, so the one word every helper reads is the atomic job word.
#include "cpu/worker_pool.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#define FC_HAVE_GETPID 1
#endif
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FC_SPIN_PAUSE() _mm_pause()
#else
#define FC_SPIN_PAUSE() std::this_thread::yield()
#endif

namespace flashcore {
namespace cpu {
namespace {

long current_process() {
#ifdef FC_HAVE_GETPID
  return static_cast<long>(getpid());
#else
  return 0;
#endif
}

struct PoolTraits {
  // How long a helper that finished a job (and the caller waiting for the last helper) polls
  // before blocking. Long enough to cover the gap between back-to-back calls of a training step
  // or a benchmark loop, short enough that an idle pool stops using CPU almost at once.
  static constexpr std::chrono::microseconds kSpin{200};
  static constexpr int kWorkerBits = 16;  // job word: generation << kWorkerBits | workers
  static constexpr int kMaxWorkers = (1 << kWorkerBits) - 1;
};

class Pool {
  struct Sleeper {
    std::condition_variable wake;  // the helper sleeps here between jobs
  };

 public:
  explicit Pool(long owner) : owner_(owner) {}
  long owner() const { return owner_; }

  /** Runs the job if no other call holds the pool; false (nothing run) if one does. */
  bool try_run(int workers, WorkerBody body, int* ran) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    workers = std::min(workers, PoolTraits::kMaxWorkers);
    grow(workers - 1);
    const int helpers = std::min(workers - 1, started_.load(std::memory_order_relaxed));
    *ran = helpers + 1;
    body_ = body;
    pending_.store(helpers, std::memory_order_relaxed);
    generation_ += 1;
    {
      std::lock_guard<std::mutex> lock(m_);
      job_.store(generation_ << PoolTraits::kWorkerBits | static_cast<uint64_t>(helpers + 1), std::memory_order_release);
    }
    for (int i = 0; i < helpers; ++i) sleepers_[static_cast<size_t>(i)].wake.notify_one();
    body(0);
    wait_until(spins(workers), [&] { return pending_.load(std::memory_order_acquire) == 0; }, done_);
    return true;
  }

  int size() const { return started_.load(std::memory_order_relaxed); }

 private:
  /** Starts helpers until there are `count` (or the system refuses one). Called under busy_. */
  void grow(int count) {
    for (int i = started_.load(std::memory_order_relaxed); i < count; ++i) {
      sleepers_.emplace_back();  // a deque: the references helpers hold stay valid
      Sleeper& sleeper = sleepers_.back();
      try {
        std::thread([this, i, &sleeper] { helper_main(i + 1, sleeper); }).detach();
      } catch (const std::system_error&) {
        sleepers_.pop_back();
        return;  // run with the helpers there are
      }
      started_.store(i + 1, std::memory_order_relaxed);
    }
  }

  /** Polling pays only while the thread `rank` (0 = the caller, i = helper i) would not take
   *  the core of another worker: ranks beyond the core count block at once. */
  static bool spins(int rank) {
    static const int cores = available_cores();
    return rank < cores;
  }

  /** Polls `ready` for kSpin (if `spin`), then sleeps on `cv` until it holds. */
  template <class Ready>
  void wait_until(bool spin, Ready ready, std::condition_variable& cv) {
    if (spin) {
      const auto deadline = std::chrono::steady_clock::now() + PoolTraits::kSpin;
      for (int i = 0; !ready(); ++i) {
        FC_SPIN_PAUSE();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
      }
    }
    if (ready()) return;
    std::unique_lock<std::mutex> lock(m_);
    cv.wait(lock, ready);
  }

  void helper_main(int index, Sleeper& sleeper) {
    uint64_t seen = 0;  // generation of the last job this helper ran
    for (;;) {
      uint64_t job = 0;
      wait_until(spins(index), [&] {
        job = job_.load(std::memory_order_acquire);
        return (job >> PoolTraits::kWorkerBits) != seen && index < static_cast<int>(job & PoolTraits::kMaxWorkers);
      }, sleeper.wake);
      seen = job >> PoolTraits::kWorkerBits;
      body_(index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        { std::lock_guard<std::mutex> lock(m_); }  // the caller is either polling or waiting on done_
        done_.notify_one();
      }
    }
  }

  const long owner_;
  std::mutex busy_;                 // held by the call using the pool
  std::mutex m_;                    // for sleeping and waking only
  std::deque<Sleeper> sleepers_;    // one per helper; grown under busy_
  std::condition_variable done_;    // the caller sleeps here until the last helper is done
  std::atomic<uint64_t> job_{0};    // generation << kWorkerBits | workers of the latest job
  uint64_t generation_ = 0;         // caller side, under busy_
  WorkerBody body_{};               // the current job; read by its helpers only
  std::atomic<int> pending_{0};     // helpers of the current job still running it
  std::atomic<int> started_{0};     // helper threads started (they never exit)
};

// The pool is never destroyed: its helpers are blocked on its condition variables when the
// process exits, and destroying those under them is undefined. It stays reachable from here, so
// leak checkers do not report it. A forked child replaces it (see owner()).
std::atomic<Pool*> g_pool{nullptr};

Pool& process_pool() {
  const long me = current_process();
  Pool* pool = g_pool.load(std::memory_order_acquire);
  while (pool == nullptr || pool->owner() != me) {
    Pool* fresh = new Pool(me);
    if (g_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread installed one first; `pool` now holds it
  }
  return *pool;
}

/** The fallback for a call that finds the pool busy: threads of its own, joined at the end. */
int run_on_fresh_threads(int workers, WorkerBody body) {
  std::vector<std::thread> threads;
  try {
    threads.reserve(static_cast<size_t>(workers - 1));
    for (int w = 1; w < workers; ++w) threads.emplace_back([body, w] { body(w); });
  } catch (const std::system_error&) {
    // run with the threads that started
  }
  body(0);
  for (std::thread& t : threads) t.join();
  return static_cast<int>(threads.size()) + 1;
}

}  // namespace

int run_on_workers(int workers, WorkerBody body) {
  if (workers <= 1) {
    body(0);
    return 1;
  }
  int ran = 0;
  if (process_pool().try_run(workers, body, &ran)) return ran;
  return run_on_fresh_threads(workers, body);
}

int worker_pool_size() { return process_pool().size(); }

int available_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

}  // namespace cpu
}  // namespace flashcore
