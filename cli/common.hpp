// Shared pieces of the `flashcore` command: argument parsing, problem setup in host or device
// memory, timing, and formatting. Device memory goes through the CUDA runtime only when the
// library was built with CUDA (cli/common.cpp hides the difference).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashcore/flashcore.h"

namespace flashcore::cli {

/** A usage error: printed with the command's help, exit code 2. */
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** --key value / --flag parsing against a declared set of options. */
class Args {
 public:
  Args(int argc, char** argv, int first, const std::map<std::string, bool>& known /* name -> takes value */);
  bool has(const std::string& k) const { return values_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def) const;
  int64_t num(const std::string& k, int64_t def) const;
  double real(const std::string& k, double def) const;

 private:
  std::map<std::string, std::string> values_;
};

struct Problem {
  int64_t batch = 1, seqlen_q = 1024, seqlen_k = 1024, heads_q = 16, heads_kv = 16, head_dim = 64;
  int32_t dtype = FC_DTYPE_F32;
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  double softcap = 0;
  bool alibi = false;  // ALiBi with the geometric slopes 2^(-8 (h + 1) / heads_q)
  double dropout_p = 0;  // dropout of the probabilities (fixed seed)
  int32_t backend = FC_BACKEND_AUTO;
  int32_t threads = 0;
  bool on_gpu = false;

  double flops_forward() const;
  /** Bytes of K and V a forward reads at least (each element once): what bounds a decode-shaped
   *  call, whose speed is the memory's. */
  double kv_bytes() const;
  std::string describe() const;
};

/** Parses the options every command shares (shape, dtype, mask, backend, threads). */
Problem parse_problem(const Args& a, const Problem& defaults);
const std::map<std::string, bool>& problem_options();
std::string problem_options_help();

/** Best backend present for a problem: CUDA when a usable GPU exists, else CPU flash. */
bool gpu_usable();
/** The backend AUTO resolves to for a standard problem of the given direction (for labels). */
const char* auto_backend_name(bool on_gpu, bool backward);

/** Tensors of one problem, filled with random normal values, in host or device memory. */
class Buffers {
 public:
  Buffers(const Problem& p, bool with_grads, uint64_t seed);
  ~Buffers();
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;

  fc_tensor q, k, v, out, lse, dout, dq, dk, dv;
  fc_tensor alibi_slopes{};         // Problem::alibi: float32 (heads_q), where q lives
  std::vector<float> alibi_host;    // the same slopes in host memory (reference checks)
  fc_attention_options options{};
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  fc_status forward();
  fc_status backward();
  /** Host copies (as float) of a tensor's element range, for checks. */
  std::vector<float> fetch(const fc_tensor& t) const;
  void sync() const;
  size_t device_bytes() const { return bytes_; }

 private:
  const Problem p_;
  std::vector<void*> owned_;
  size_t bytes_ = 0;
  void* alloc_tensor(fc_tensor* t, int32_t dtype, std::vector<int64_t> shape, uint64_t seed, bool random);
};

/** Median wall time (ms) of `fn` over `repeats` timed batches after warm-up; device-synchronized. */
double time_ms(const Problem& p, int repeats, int inner, const std::function<void()>& fn);

std::string format_bytes(double b);

}  // namespace flashcore::cli
