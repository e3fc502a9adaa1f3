// CPU backends against the fp64 reference: every TESTING.md grid, forward and backward, for the
// cpu_flash backend (fp32, fp16, bf16), plus race hunting (bit-identical repeats).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "common/grids.hpp"
#include "common/harness.hpp"
#include "cpu/amx.hpp"
#include "cpu/key_split.hpp"

namespace flashcore::testing {
namespace {

GridOptions cpu_grid() {
  GridOptions g;
  g.dtypes = {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16};
  g.head_dims = {64, 32};
  g.odd_head_dims = {1, 40, 59, 80, 96, 111, 128, 256};
  return g;
}

void expect_forward(const std::vector<Case>& cases, fc_backend backend) {
  auto mem = host_memory();
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const CheckResult r = check_forward(c, backend, *mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
  }
}

void expect_backward(const std::vector<Case>& cases, fc_backend backend) {
  auto mem = host_memory();
  uint64_t seed = 1000;
  for (const Case& c : cases) {
    const CheckResult r = check_backward(c, backend, *mem, seed++);
    EXPECT_TRUE(r.ok) << c.name() << "\n" << r.summary();
  }
}

TEST(CpuFlashForward, SeqlenGrid) { expect_forward(grid_seqlens(cpu_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashForward, Shapes) { expect_forward(grid_shapes(cpu_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashForward, Masks) { expect_forward(grid_masks(cpu_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashForward, Varlen) { expect_forward(grid_varlen(cpu_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashForward, PagedKv) { expect_forward(grid_paged(cpu_grid(), {1, 16, 256}), FC_BACKEND_CPU_FLASH); }
TEST(CpuReference, PagedKv) { expect_forward(grid_paged(cpu_grid(), {16}), FC_BACKEND_CPU_REFERENCE); }
TEST(CpuFlashForward, Edges) { expect_forward(grid_edges(cpu_grid()), FC_BACKEND_CPU_FLASH); }
// cpu_grid's dtypes alternate over the cases: fp32 runs among them.
TEST(CpuFlashForward, Alibi) { expect_forward(grid_alibi(cpu_grid()), FC_BACKEND_CPU_FLASH); }
// Paged K/V with ALiBi (the CPU serves both together): the bias follows key positions in the
// sequence, whichever page holds the key.
TEST(CpuFlashForward, AlibiPagedKv) {
  std::vector<Case> cases;
  for (const Case& c : grid_alibi(cpu_grid())) {
    if (!c.is_varlen()) continue;
    for (int64_t page_size : {1, 16}) {
      Case paged = c;
      paged.page_size = page_size;
      cases.push_back(paged);
    }
  }
  ASSERT_FALSE(cases.empty());
  expect_forward(cases, FC_BACKEND_CPU_FLASH);
}
TEST(CpuFlashForward, LargeSeqlens) {
  GridOptions g = cpu_grid();
  g.dtypes = {FC_DTYPE_BF16};
  std::vector<Case> cases;
  for (auto [sq, sk] : std::vector<std::pair<int64_t, int64_t>>{{1023, 1024}, {1024, 1023}, {2048, 2048}}) {
    Case c;
    c.seqlen_q = sq;
    c.seqlen_k = sk;
    c.head_dim = 64;
    c.dtype = FC_DTYPE_BF16;
    c.causal = sq == 2048;
    cases.push_back(c);
  }
  expect_forward(cases, FC_BACKEND_CPU_FLASH);
}

GridOptions small_grid() {
  GridOptions g = cpu_grid();
  g.head_dims = {32, 64};
  g.odd_head_dims = {1, 40, 59, 96, 128};
  return g;
}

// On a CPU with AMX the tests of cpu_flash ran its AMX paths (src/cpu/amx_forward.cpp,
// amx_backward.cpp) for bf16 and fp16 and the AVX-512 paths for fp32. Both paths must pass every
// dtype there: each test below forces one of them for its calls (FLASHCORE_CPU_AMX, read at every
// call; "1" moves the fp32 forward onto AMX, and the fp32 backward, which has no AMX path, stays).
/** An environment variable set for one scope (the CPU backends read theirs at every call). */
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

struct ScopedAmxSetting : ScopedEnv {
  explicit ScopedAmxSetting(const char* value) : ScopedEnv("FLASHCORE_CPU_AMX", value) {}
};

/** Every TESTING.md grid of `g` through `expect` (expect_forward or expect_backward). */
void expect_every_grid(const GridOptions& g, void (*expect)(const std::vector<Case>&, fc_backend)) {
  for (const auto& cases :
       {grid_seqlens(g), grid_shapes(g), grid_masks(g), grid_varlen(g), grid_edges(g), grid_paged(g, {16}),
        grid_alibi(g)}) {
    expect(cases, FC_BACKEND_CPU_FLASH);
  }
}

TEST(CpuFlashForward, AvxPathWhereAmxIsUsed) {
  if (!cpu::amx_usable()) GTEST_SKIP() << "no AMX on this CPU (or in this build): the tests above ran the AVX path";
  ScopedAmxSetting off("0");
  ASSERT_FALSE(cpu::amx_forward_enabled(DType::BF16));
  expect_every_grid(cpu_grid(), expect_forward);
}

TEST(CpuFlashBackward, AvxPathWhereAmxIsUsed) {
  if (!cpu::amx_usable()) GTEST_SKIP() << "no AMX on this CPU (or in this build): the tests above ran the AVX path";
  ScopedAmxSetting off("0");
  ASSERT_FALSE(cpu::amx_forward_enabled(DType::BF16));
  ASSERT_FALSE(cpu::amx_backward_enabled(DType::BF16));
  expect_every_grid(small_grid(), expect_backward);
}

TEST(CpuFlashForward, AmxPathForEveryDtype) {
  if (!cpu::amx_usable()) GTEST_SKIP() << "no AMX on this CPU (or in this build)";
  ScopedAmxSetting on("1");
  ASSERT_TRUE(cpu::amx_forward_enabled(DType::F32));
  expect_every_grid(cpu_grid(), expect_forward);  // fp32 on 64-key tiles
  // The backward recomputes P from the forward's lse: with the AMX forward's lse too.
  expect_backward(grid_edges(small_grid()), FC_BACKEND_CPU_FLASH);
  expect_backward(grid_masks(small_grid()), FC_BACKEND_CPU_FLASH);
}

TEST(CpuFlashBackward, SeqlenGrid) { expect_backward(grid_seqlens(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Shapes) { expect_backward(grid_shapes(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Masks) { expect_backward(grid_masks(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Varlen) { expect_backward(grid_varlen(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Edges) { expect_backward(grid_edges(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Alibi) { expect_backward(grid_alibi(small_grid()), FC_BACKEND_CPU_FLASH); }
// Dropout: the fp16 / bf16 calls run on the AVX-512 path even where AMX serves the others
// (flash_forward.cpp), so every dtype meets the same mask code.
TEST(CpuFlashForward, Dropout) { expect_forward(grid_dropout(cpu_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuFlashBackward, Dropout) { expect_backward(grid_dropout(small_grid()), FC_BACKEND_CPU_FLASH); }
TEST(CpuReference, DropoutLowPrecisionMatchesExact) {
  // The reference against itself through the harness: its low-precision mode drops the same entries.
  expect_forward(grid_dropout(small_grid()), FC_BACKEND_CPU_REFERENCE);
}

// The mask is a function of positions, not of tasks: thread counts (and with them the query
// blocks per task and the backward's key chunks) must not move a bit.
TEST(CpuFlashThreads, DropoutThreadCountDoesNotChangeBits) {
  auto mem = host_memory();
  Case c;
  c.batch = 2;
  c.seqlen_q = 700;
  c.seqlen_k = 900;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_BF16;
  c.window_left = 100;
  c.window_right = 30;
  c.dropout_p = 0.3;
  std::string why;
  EXPECT_TRUE(thread_counts_are_bit_identical(c, FC_BACKEND_CPU_FLASH, *mem, {1, 2, 5}, true, &why)) << why;
}

TEST(CpuFlashRaces, RepeatsAreBitIdentical) {
  auto mem = host_memory();
  Case c;
  c.batch = 2;
  c.seqlen_q = 300;
  c.seqlen_k = 277;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.head_dim = 64;
  c.dtype = FC_DTYPE_BF16;
  c.causal = true;
  std::string why;
  EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CPU_FLASH, *mem, 20, false, &why)) << why;
  EXPECT_TRUE(repeat_is_bit_identical(c, FC_BACKEND_CPU_FLASH, *mem, 10, true, &why)) << why;
}

// Results must not depend on how many threads share the work.
TEST(CpuFlashThreads, AnyThreadCountIsCorrect) {
  auto mem = host_memory();
  for (int32_t threads : {1, 2, 7}) {
    Case c;
    c.batch = 2;
    c.seqlen_q = 130;
    c.seqlen_k = 170;
    c.heads_q = 4;
    c.heads_kv = 2;
    c.head_dim = 64;
    c.dtype = FC_DTYPE_BF16;
    c.causal = true;
    c.num_threads = threads;
    CheckResult r = check_forward(c, FC_BACKEND_CPU_FLASH, *mem, 77);
    EXPECT_TRUE(r.ok) << threads << " threads\n" << r.summary();
    r = check_backward(c, FC_BACKEND_CPU_FLASH, *mem, 78);
    EXPECT_TRUE(r.ok) << threads << " threads\n" << r.summary();
  }
}

// Tasks take more or fewer query blocks with the thread count (flash_forward_kernel.hpp), and
// the pool runs them in any order: the bits must not move. A sliding window puts each block's
// first key off the tile grid; GQA stacks query heads into blocks; varlen adds sequences of
// their own. The backward runs a head of several key chunks whole at 1 thread and split into
// chunks at 3 or more here (cpu/backward_tasks.hpp, BackwardPlan): both must sum dQ alike.
TEST(CpuFlashThreads, ThreadCountDoesNotChangeBits) {
  auto mem = host_memory();
  Case dense;
  dense.batch = 2;
  dense.seqlen_q = 1000;
  dense.seqlen_k = 1100;
  dense.heads_q = 4;
  dense.heads_kv = 2;
  dense.head_dim = 64;
  dense.dtype = FC_DTYPE_BF16;
  dense.window_left = 100;
  dense.window_right = 30;
  Case varlen = dense;  // d = 128, causal, sequences of their own
  varlen.head_dim = 128;
  varlen.window_left = varlen.window_right = -1;
  varlen.causal = true;
  varlen.varlen_q = {700, 5, 300};
  varlen.varlen_k = {900, 77, 300};
  Case dense_fp32 = dense;  // the AVX-512 paths on any CPU
  dense_fp32.dtype = FC_DTYPE_F32;
  auto expect_all = [&] {
    for (const Case& c : {dense, varlen, dense_fp32}) {
      std::string why;
      EXPECT_TRUE(thread_counts_are_bit_identical(c, FC_BACKEND_CPU_FLASH, *mem, {1, 16, 40, 3}, false, &why)) << why;
      EXPECT_TRUE(thread_counts_are_bit_identical(c, FC_BACKEND_CPU_FLASH, *mem, {1, 16, 3}, true, &why)) << why;
    }
  };
  expect_all();
  if (cpu::amx_usable()) {  // bf16 ran on AMX above
    ScopedAmxSetting off("0");
    expect_all();
  }
}

// The backwards split a head's keys into chunks where B x H makes few tasks
// (cpu/backward_tasks.hpp) and sum each dQ row chunk by chunk. The grids' sequences are too
// short for the shipped chunk sizes, so FLASHCORE_CPU_CHUNK_KEYS (read at every call) sets the
// shortest chunk to 256 keys here: every sequence of 512 keys or more splits, and the cases below
// put chunk edges on the causal diagonal, inside windows, in varlen batches beside sequences too
// short to split, and under GQA's partials.
std::vector<Case> key_split_cases() {
  std::vector<Case> cases;
  for (int32_t dtype : {FC_DTYPE_F32, FC_DTYPE_F16, FC_DTYPE_BF16}) {
    Case c;
    c.heads_q = 2;
    c.heads_kv = 1;
    c.head_dim = 40;
    c.dtype = dtype;
    c.seqlen_q = 700;
    c.seqlen_k = 1100;  // chunks of 512, 512 and 76 keys
    cases.push_back(c);
    c.causal = true;  // bottom-right: the first 400 keys are seen by every row
    cases.push_back(c);
    c.seqlen_q = c.seqlen_k = 900;  // chunks whose rows start on the diagonal
    c.head_dim = 64;
    cases.push_back(c);
    c.causal = false;
    c.window_left = 200;  // rows see a band: chunks with row ranges in the middle
    c.window_right = 10;
    c.softcap = 20;
    cases.push_back(c);
    Case v;  // varlen: one sequence splits, one is too short to, one has no keys
    v.heads_q = 4;
    v.heads_kv = 2;
    v.head_dim = 32;
    v.dtype = dtype;
    v.causal = true;
    v.varlen_q = {600, 130, 40};
    v.varlen_k = {800, 200, 0};
    v.batch = 3;
    cases.push_back(v);
  }
  return cases;
}

/** The shortest key chunk KeyChunks sets through FLASHCORE_CPU_CHUNK_KEYS. */
constexpr int64_t kTestChunkKeys = 256;

/** The cases of `cases` that the test's chunk override splits, those with a sequence of two chunks'
 *  keys or more (choose_key_split): the others run one task per head, exactly as in the grids' own
 *  tests. */
std::vector<Case> split_by_the_override(const std::vector<Case>& cases) {
  std::vector<Case> split;
  for (const Case& c : cases) {
    int64_t longest = c.varlen_k.empty() ? c.seqlen_k : 0;
    for (int32_t keys : c.varlen_k) longest = std::max<int64_t>(longest, keys);
    if (longest >= 2 * kTestChunkKeys) split.push_back(c);
  }
  return split;
}

TEST(CpuFlashBackward, KeyChunks) {
  BackwardParams p;  // the first case's shapes: the override must split them
  p.batch = 1;
  p.seqlen_q = 700;
  p.seqlen_k = 1100;
  p.heads_q = 2;
  p.heads_kv = 1;
  p.head_dim = 40;
  ASSERT_EQ(cpu::backward_detail::choose_key_split(p, kTestChunkKeys).chunks, 4);
  ASSERT_EQ(cpu::backward_detail::choose_key_split(p, 0).chunks, 1);
  ScopedEnv split("FLASHCORE_CPU_CHUNK_KEYS", std::to_string(kTestChunkKeys).c_str());
  expect_backward(key_split_cases(), FC_BACKEND_CPU_FLASH);
  expect_every_grid(small_grid(), [](const std::vector<Case>& cases, fc_backend backend) {
    expect_backward(split_by_the_override(cases), backend);
  });
  ASSERT_GE(split_by_the_override(grid_seqlens(small_grid())).size(), 4u);
  if (cpu::amx_usable()) {  // and the AVX-512 backward where the cases above ran the AMX one
    ScopedAmxSetting off("0");
    expect_backward(key_split_cases(), FC_BACKEND_CPU_FLASH);
  }
}

// The oracle itself: the public reference backend agrees with its own row function and the
// default (auto) backend on CPU tensors is cpu_flash, which must match the reference too.
TEST(CpuReference, AutoBackendOnCpuTensors) {
  auto mem = host_memory();
  Case c;
  c.seqlen_q = 65;
  c.seqlen_k = 129;
  c.head_dim = 48;
  c.dtype = FC_DTYPE_F32;
  const CheckResult r = check_forward(c, FC_BACKEND_AUTO, *mem, 7);
  EXPECT_TRUE(r.ok) << r.summary();
}

}  // namespace
}  // namespace flashcore::testing
