// The CPU backends' threads: a process-wide pool of helper threads, started on first use and
// kept for the life of the process.
//
// Why a pool: starting and joining fresh std::threads on every call cost 15-25 us per thread
// (measured on the 2-core development VM), so a 16-thread call paid a few hundred microseconds
// before any work began, and the threads started one after another, so the last one began its
// first task that much later. That is 5-10% of a 16-thread forward of a few milliseconds, the
// size of a typical CPU attention call. Helpers that finished a call spin for a short while
// (a burst of calls back to back, as in a training step, finds them awake) and then sleep on a
// condition variable, so an idle process uses no CPU.
//
// Callers: run_workers in cpu_common.hpp. One call uses the pool at a time; a call that finds it
// busy (another application thread, or a call made from inside a worker) starts threads of its
// own for that call, as before the pool existed. After fork() the child sees no helpers (they
// were not copied) and builds a new pool on its first call; the parent's pool is left alone.
#pragma once

#include <cstdint>

namespace flashcore {
namespace cpu {

/** A reference to a callable `void(int worker)`, valid for the duration of one run(). */
struct WorkerBody {
  void (*invoke)(const void* callable, int worker);
  const void* callable;

  template <class F>
  static WorkerBody of(const F& f) {
    return {[](const void* c, int worker) { (*static_cast<const F*>(c))(worker); }, &f};
  }
  void operator()(int worker) const { invoke(callable, worker); }
};

/** Runs body(0), ..., body(workers - 1) concurrently, body(0) on the calling thread, and returns
 *  when all have returned. body must not throw. Returns the number of workers that ran (fewer
 *  than asked only if the system refused to start a thread; the caller's queue of tasks must
 *  then be drained by the workers that did run). */
int run_on_workers(int workers, WorkerBody body);

/** Helper threads the pool has started so far (for tests and `flashcore info`). */
int worker_pool_size();

/** Cores this process may run on: the CPU affinity mask where the system has one (taskset,
 *  cgroup cpusets, container limits on cores), else the hardware thread count; at least 1.
 *  What num_threads = 0 means. */
int available_cores();

}  // namespace cpu
}  // namespace flashcore
