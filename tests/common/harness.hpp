// Backend-agnostic correctness harness shared by the CPU and CUDA test suites.
//
// A Case describes one attention problem. check_forward/check_backward draw fresh random inputs,
// poison the outputs with NaN, run the backend under test through the public C ABI, and compare
// against the fp64 reference with TESTING.md's tolerance rule:
//   pass when max|X - X_ref| <= k * max|X_same - X_ref| + atol  (k = 2 forward, 3 gradients)
// where X_same is the reference computed the way an honest low-precision kernel would, and atol
// is the rounding of one add at the reference's magnitude. fp32 uses a relative-norm bound.
// Gradients: X_same reads the O the backend stored (checked first), and each element's error is
// first reduced by what an fp32 score error moves it (cpu::ReferenceMode::score_error_bound):
// nothing at unit inputs; at scores near 1e4 an fp32 score is no finer than the dtype, and the
// forward and backward sum it in different orders.
// Memory abstracts where tensors live so the same checks run on CPU and GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "flashcore/flashcore.h"

namespace flashcore::testing {

/** Where the tensors under test live. */
class Memory {
 public:
  virtual ~Memory() = default;
  virtual int32_t device_type() const = 0;
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void* stream() const { return nullptr; }
};

std::unique_ptr<Memory> host_memory();

struct Case {
  int64_t batch = 1;
  int64_t seqlen_q = 1;
  int64_t seqlen_k = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t head_dim = 64;
  int32_t dtype = FC_DTYPE_F16;
  bool causal = false;
  int32_t window_left = -1;
  int32_t window_right = -1;
  double softcap = 0;
  double softmax_scale = 0;
  // Varlen when non-empty: one length per sequence (batch = size).
  std::vector<int32_t> varlen_q;
  std::vector<int32_t> varlen_k;
  // Pad row/head strides so tensors are not contiguous (exercises stride handling).
  bool padded = false;
  // Multiply q by this to push scores toward overflow territory.
  float q_magnitude = 1.f;
  bool deterministic = false;
  int32_t num_threads = 0;  // CPU backends: 0 = all cores
  int32_t sm_margin = 0;    // CUDA: fc_attention_options.sm_margin
  // Varlen forward only, > 0: k / v handed to the call as pages of this many keys in shuffled
  // order through a block table (with spare pages of random data); the references read the packed
  // k / v, so a wrong page walk fails the comparison.
  int64_t page_size = 0;
  // Varlen: rows the packed q / k / v (and dout) hold past the last sequence, all NaN, as in a
  // preallocated buffer: no result may depend on them (a kernel whose loads read them, as TMA boxes
  // do, must zero them before they meet a 0 probability: 0 x NaN = NaN).
  int64_t packed_tail_rows = 37;
  // ALiBi: 1 = random slopes of shape (heads_q), 2 = (batch, heads_q); 0 = none.
  int alibi = 0;
  // Dropout (fc_attention_options.dropout_p): the backend and the references get the same seed
  // and offset, so they drop the same entries (common/dropout.hpp).
  double dropout_p = 0;
  uint64_t dropout_seed = 0x5eedf1a5c0de1234ull;
  uint64_t dropout_offset = 0;

  std::string name() const;
  bool is_varlen() const { return !varlen_q.empty(); }
};

struct ErrorReport {
  std::string what;   // "out", "lse", "dq", ...
  double max_err = 0;  // max |X - X_ref|
  double bound = 0;    // allowed
  double same_err = 0; // max |X_same - X_ref|
  double allowance = 0; // max per-element score-error allowance (backward; 0 when none applies)
  bool ok = true;
  std::string detail;  // first failure, NaN or unwritten element
};

struct CheckResult {
  bool ok = true;
  std::vector<ErrorReport> reports;
  std::string status_error;  // non-empty when the call itself failed
  std::string summary() const;
};

/** Runs task(t) for every t in [0, tasks) on every hardware thread (tasks that write disjoint
 *  results: the host references' slices). */
void run_on_all_threads(int64_t tasks, const std::function<void(int64_t)>& task);

CheckResult check_forward(const Case& c, fc_backend backend, Memory& mem, uint64_t seed);
CheckResult check_backward(const Case& c, fc_backend backend, Memory& mem, uint64_t seed);

/** Runs forward (and backward when `backward`) `repeats` times on the same inputs; returns
 *  true when every run is bit-identical to the first (race hunting). */
bool repeat_is_bit_identical(const Case& c, fc_backend backend, Memory& mem, int repeats, bool backward,
                             std::string* why);

/** Runs forward (and backward when `backward`) once with each num_threads of `thread_counts`;
 *  true when every run is bit-identical to the first. */
bool thread_counts_are_bit_identical(const Case& c, fc_backend backend, Memory& mem,
                                     const std::vector<int32_t>& thread_counts, bool backward, std::string* why);

/** Runs forward (and backward when `backward`) once with each sm_margin of `margins`; true when
 *  every run is bit-identical to the first. */
bool sm_margins_are_bit_identical(const Case& c, fc_backend backend, Memory& mem, const std::vector<int32_t>& margins,
                                  bool backward, std::string* why);

/** A chain of `depth` forward calls issued back to back on the memory's stream, each call's output
 *  the next one's q (same shape), against the same chain with the stream drained after every
 *  call: true when the last outputs are bit-identical. Catches a kernel that starts reading its
 *  inputs before the previous call finished writing them (programmatic dependent launches).
 *  Dense or varlen cases with packed K/V and no ALiBi. */
bool chained_forward_calls_are_ordered(const Case& c, fc_backend backend, Memory& mem, int depth, std::string* why);

/** The TESTING.md grids. */
std::vector<std::pair<int64_t, int64_t>> seqlen_pairs(bool include_large);

}  // namespace flashcore::testing
