// The CPU backends' worker pool (src/cpu/worker_pool.cpp): every worker of a call runs exactly
// once, helpers are reused across calls, concurrent and nested callers (which find the pool busy
// and start threads of their own) and forked children get every worker, and attention computed
// from several application threads at once is still correct.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#include "common/harness.hpp"
#include "cpu/worker_pool.hpp"

namespace flashcore::testing {
namespace {

/** Runs `workers` workers once; true when each index ran exactly once. Records thread ids. */
bool every_worker_ran_once(int workers, std::set<std::thread::id>* ids = nullptr) {
  std::vector<std::atomic<int>> runs(static_cast<size_t>(workers));
  std::mutex m;
  auto body = [&](int w) {
    runs[static_cast<size_t>(w)].fetch_add(1);
    if (ids) {
      std::lock_guard<std::mutex> lock(m);
      ids->insert(std::this_thread::get_id());
    }
  };
  const int ran = cpu::run_on_workers(workers, cpu::WorkerBody::of(body));
  bool ok = ran == workers;
  for (auto& r : runs) ok = ok && r.load() == 1;
  return ok;
}

TEST(CpuWorkerPool, HelpersAreReusedAcrossCalls) {
  std::set<std::thread::id> first, second;
  ASSERT_TRUE(every_worker_ran_once(5, &first));
  ASSERT_TRUE(every_worker_ran_once(5, &second));
  EXPECT_EQ(first.size(), 5u);
  EXPECT_EQ(first, second) << "the second call should run on the same helper threads";
  EXPECT_GE(cpu::worker_pool_size(), 4);
  EXPECT_TRUE(every_worker_ran_once(1));
  EXPECT_TRUE(every_worker_ran_once(2));  // fewer workers than helpers
}

TEST(CpuWorkerPool, ConcurrentAndNestedCallers) {
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&bad, t] {
      for (int i = 0; i < 200; ++i) {
        if (!every_worker_ran_once(2 + (t + i) % 4)) bad.fetch_add(1);
      }
    });
  }
  // A call from inside a worker finds the pool busy (held by this very call).
  std::atomic<int> nested_ok{0};
  auto outer = [&](int) {
    if (every_worker_ran_once(3)) nested_ok.fetch_add(1);
  };
  cpu::run_on_workers(3, cpu::WorkerBody::of(outer));
  for (std::thread& c : callers) c.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(nested_ok.load(), 3);
}

#if defined(__unix__)
TEST(CpuWorkerPool, ForkedChildGetsItsOwnPool) {
  ASSERT_TRUE(every_worker_ran_once(4));  // the parent's pool exists
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(every_worker_ran_once(4) && every_worker_ran_once(3) ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_TRUE(every_worker_ran_once(4));  // and the parent's pool still works
}
#endif

#if defined(__linux__)
// num_threads = 0 means the cores the process may run on, not every core of the machine.
TEST(CpuWorkerPool, AvailableCoresFollowsTheAffinityMask) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof saved, &saved), 0);
  EXPECT_EQ(cpu::available_cores(), CPU_COUNT(&saved));
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  EXPECT_EQ(cpu::available_cores(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof saved, &saved), 0);
}
#endif

TEST(CpuWorkerPool, AttentionFromSeveralThreadsAtOnce) {
  std::vector<std::thread> callers;
  std::vector<CheckResult> results(3);
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&results, t] {
      auto mem = host_memory();
      Case c;
      c.seqlen_q = 150 + 40 * t;
      c.seqlen_k = 300;
      c.heads_q = 4;
      c.heads_kv = 2;
      c.head_dim = 64;
      c.dtype = FC_DTYPE_F32;
      c.causal = t == 1;
      c.num_threads = 3;
      results[static_cast<size_t>(t)] = check_forward(c, FC_BACKEND_CPU_FLASH, *mem, 500 + t);
    });
  }
  for (std::thread& c : callers) c.join();
  for (const CheckResult& r : results) EXPECT_TRUE(r.ok) << r.summary();
}

}  // namespace
}  // namespace flashcore::testing
