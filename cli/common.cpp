// Implementation of the CLI's shared pieces (see common.hpp).
#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "common/dtype_host.hpp"
#include "common/mask.hpp"

#if FLASHCORE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace flashcore::cli {

Args::Args(int argc, char** argv, int first, const std::map<std::string, bool>& known) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + a + "'");
    std::string key = a.substr(2), value = "1";
    const size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    auto it = known.find(key);
    if (it == known.end()) throw UsageError("unknown option --" + key);
    if (!it->second && eq != std::string::npos) throw UsageError("option --" + key + " takes no value");
    if (it->second && eq == std::string::npos) {
      if (i + 1 >= argc) throw UsageError("option --" + key + " needs a value");
      value = argv[++i];
    }
    values_[key] = value;
  }
}

std::string Args::str(const std::string& k, const std::string& def) const {
  auto it = values_.find(k);
  return it == values_.end() ? def : it->second;
}

int64_t Args::num(const std::string& k, int64_t def) const {
  auto it = values_.find(k);
  if (it == values_.end()) return def;
  try {
    size_t pos = 0;
    const long long v = std::stoll(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("");
    return v;
  } catch (...) {
    throw UsageError("option --" + k + " expects an integer, got '" + it->second + "'");
  }
}

double Args::real(const std::string& k, double def) const {
  auto it = values_.find(k);
  if (it == values_.end()) return def;
  try {
    size_t pos = 0;
    const double v = std::stod(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("");
    return v;
  } catch (...) {
    throw UsageError("option --" + k + " expects a number, got '" + it->second + "'");
  }
}

const std::map<std::string, bool>& problem_options() {
  static const std::map<std::string, bool> opts = {
      {"batch", true},  {"seqlen", true},   {"seqlen-k", true}, {"heads", true},    {"heads-kv", true},
      {"head-dim", true}, {"dtype", true},  {"causal", false},  {"window", true},   {"softcap", true},
      {"alibi", false},  {"dropout", true}, {"backend", true}, {"threads", true}, {"help", false}};
  return opts;
}

std::string problem_options_help() {
  return "  --batch B            sequences per batch\n"
         "  --seqlen S           query length (and key length unless --seqlen-k)\n"
         "  --seqlen-k S         key/value length\n"
         "  --heads H            query heads\n"
         "  --heads-kv H         key/value heads (GQA/MQA; divides --heads)\n"
         "  --head-dim D         1..256 (CUDA: multiple of 8)\n"
         "  --dtype T            fp32 | fp16 | bf16\n"
         "  --causal             causal mask (bottom-right aligned)\n"
         "  --window L,R         sliding window, -1 = unbounded side\n"
         "  --softcap C          tanh soft-capping of scores (0 = off)\n"
         "  --alibi              ALiBi biases, slopes 2^(-8 (h + 1) / heads)\n"
         "  --dropout P          dropout of the probabilities, 0 <= P < 1 (a fixed seed)\n"
         "  --backend B          auto | cpu | cpu_reference | cuda | cuda_sm80 | cuda_sm90\n"
         "  --threads N          CPU threads (0 = all cores)\n";
}

bool gpu_usable() { return fc_backend_available(FC_BACKEND_CUDA_SM80, 0) != 0; }

Problem parse_problem(const Args& a, const Problem& defaults) {
  Problem p = defaults;
  const std::string backend = a.str("backend", "auto");
  if (backend == "auto") {
    p.backend = FC_BACKEND_AUTO;
    p.on_gpu = defaults.on_gpu;
  } else if (backend == "cpu" || backend == "cpu_flash") {
    p.backend = FC_BACKEND_CPU_FLASH;
    p.on_gpu = false;
  } else if (backend == "cpu_reference") {
    p.backend = FC_BACKEND_CPU_REFERENCE;
    p.on_gpu = false;
  } else if (backend == "cuda_sm80") {
    p.backend = FC_BACKEND_CUDA_SM80;
    p.on_gpu = true;
  } else if (backend == "cuda_sm90") {
    p.backend = FC_BACKEND_CUDA_SM90;
    p.on_gpu = true;
  } else if (backend == "cuda") {
    p.backend = FC_BACKEND_AUTO;  // the best CUDA backend for each call
    p.on_gpu = true;
  } else {
    throw UsageError("--backend: unknown backend '" + backend +
                     "' (auto, cpu, cpu_reference, cuda, cuda_sm80, cuda_sm90)");
  }
  if (p.on_gpu && p.dtype == FC_DTYPE_F32) p.dtype = FC_DTYPE_BF16;
  if (!p.on_gpu && defaults.on_gpu) p.dtype = FC_DTYPE_F32;
  p.batch = a.num("batch", p.batch);
  p.seqlen_q = a.num("seqlen", p.seqlen_q);
  p.seqlen_k = a.num("seqlen-k", a.has("seqlen") ? p.seqlen_q : p.seqlen_k);
  p.heads_q = a.num("heads", p.heads_q);
  p.heads_kv = a.num("heads-kv", a.has("heads") ? p.heads_q : p.heads_kv);
  p.head_dim = a.num("head-dim", p.head_dim);
  const std::string dt = a.str("dtype", "");
  if (dt == "fp32" || dt == "float32") p.dtype = FC_DTYPE_F32;
  else if (dt == "fp16" || dt == "float16") p.dtype = FC_DTYPE_F16;
  else if (dt == "bf16" || dt == "bfloat16") p.dtype = FC_DTYPE_BF16;
  else if (!dt.empty()) throw UsageError("--dtype: unknown dtype '" + dt + "' (fp32, fp16, bf16)");
  p.causal = a.has("causal");
  if (a.has("window")) {
    const std::string w = a.str("window", "");
    const size_t comma = w.find(',');
    if (comma == std::string::npos) throw UsageError("--window expects L,R (e.g. 256,0)");
    try {
      size_t n1 = 0, n2 = 0;
      const std::string l = w.substr(0, comma), r = w.substr(comma + 1);
      p.window_left = std::stoi(l, &n1);
      p.window_right = std::stoi(r, &n2);
      if (n1 != l.size() || n2 != r.size()) throw std::invalid_argument("trailing characters");
    } catch (...) {
      throw UsageError("--window expects two integers L,R, got '" + w + "'");
    }
  }
  p.softcap = a.real("softcap", 0);
  p.alibi = a.has("alibi");
  p.dropout_p = a.real("dropout", 0);
  if (!(p.dropout_p >= 0 && p.dropout_p < 1)) throw UsageError("--dropout: expects 0 <= P < 1");
  const int64_t threads = a.num("threads", 0);
  if (threads < 0 || threads > 4096) throw UsageError("--threads: " + std::to_string(threads) + " is outside 0..4096");
  p.threads = static_cast<int32_t>(threads);
  // Sizes are checked here, before any buffer is allocated for them.
  const std::pair<const char*, int64_t> dims[] = {{"--batch", p.batch},       {"--seqlen", p.seqlen_q},
                                                  {"--seqlen-k", p.seqlen_k}, {"--heads", p.heads_q},
                                                  {"--heads-kv", p.heads_kv}, {"--head-dim", p.head_dim}};
  for (const auto& [name, value] : dims)
    if (value < 1) throw UsageError(std::string(name) + ": " + std::to_string(value) + " must be >= 1");
  constexpr double kMaxElements = double(int64_t(1) << 36);  // 128 GiB of fp16 per tensor
  const double q_elems = double(p.batch) * double(p.seqlen_q) * double(p.heads_q) * double(p.head_dim);
  const double k_elems = double(p.batch) * double(p.seqlen_k) * double(p.heads_kv) * double(p.head_dim);
  if (q_elems > kMaxElements || k_elems > kMaxElements)
    throw UsageError("the problem needs more than 2^36 elements per tensor; reduce --batch, --seqlen or --heads");
  return p;
}

double Problem::kv_bytes() const {
  const double elem = dtype == FC_DTYPE_F32 ? 4.0 : 2.0;
  return 2.0 * double(batch) * double(seqlen_k) * double(heads_kv) * double(head_dim) * elem;
}

double Problem::flops_forward() const {
  const double per_pair = 4.0 * batch * heads_q * head_dim;
  if (window_left == -1 && window_right == -1)  // the field's convention: halved when causal
    return per_pair * double(seqlen_q) * double(seqlen_k) / (causal ? 2 : 1);
  // Sliding windows: count the (query, key) pairs the mask admits.
  const MaskInfo mask{seqlen_q, seqlen_k, window_left, causal ? 0 : window_right};
  double pairs = 0;
  for (int64_t i = 0; i < seqlen_q; ++i) {
    const KeyRange r = mask.keys_for_row(i);
    pairs += double(r.end - r.begin);
  }
  return per_pair * pairs;
}

std::string Problem::describe() const {
  std::ostringstream s;
  const char* dt = dtype == FC_DTYPE_F32 ? "fp32" : dtype == FC_DTYPE_F16 ? "fp16" : "bf16";
  s << "batch " << batch << ", seqlen_q " << seqlen_q << ", seqlen_k " << seqlen_k << ", heads " << heads_q << "/"
    << heads_kv << ", head_dim " << head_dim << ", " << dt << (causal ? ", causal" : "");
  if (window_left != -1 || window_right != -1) s << ", window (" << window_left << "," << window_right << ")";
  if (softcap > 0) s << ", softcap " << softcap;
  if (alibi) s << ", alibi";
  if (dropout_p > 0) s << ", dropout " << dropout_p;
  return s.str();
}

namespace {
[[noreturn]] void cuda_missing() { throw std::runtime_error("this build has no CUDA support"); }

#if FLASHCORE_WITH_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

size_t elem_bytes(int32_t dtype) { return dtype == FC_DTYPE_F16 || dtype == FC_DTYPE_BF16 ? 2 : 4; }
}  // namespace

void* Buffers::alloc_tensor(fc_tensor* t, int32_t dtype, std::vector<int64_t> shape, uint64_t seed, bool random) {
  *t = fc_tensor{};
  t->dtype = dtype;
  t->device_type = p_.on_gpu ? FC_DEVICE_CUDA : FC_DEVICE_CPU;
  t->ndim = static_cast<int32_t>(shape.size());
  int64_t n = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    t->shape[i] = shape[i];
    t->strides[i] = n;
    n *= shape[i];
  }
  const size_t bytes = static_cast<size_t>(n) * elem_bytes(dtype);
  std::vector<uint8_t> host(bytes);
  if (random) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) store_from_float(host.data(), i, static_cast<DType>(dtype), dist(rng));
  } else {
    for (int64_t i = 0; i < n; ++i) store_from_float(host.data(), i, static_cast<DType>(dtype), NAN);
  }
  void* ptr = nullptr;
  if (p_.on_gpu) {
#if FLASHCORE_WITH_CUDA
    cuda_check(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), "cudaMalloc");
    cuda_check(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
#else
    cuda_missing();
#endif
  } else {
    ptr = ::operator new(std::max<size_t>(bytes, 16));
    std::memcpy(ptr, host.data(), bytes);
  }
  bytes_ += bytes;
  owned_.push_back(ptr);
  t->data = ptr;
  return ptr;
}

Buffers::Buffers(const Problem& p, bool with_grads, uint64_t seed) : p_(p) {
  alloc_tensor(&q, p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, seed + 1, true);
  alloc_tensor(&k, p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, seed + 2, true);
  alloc_tensor(&v, p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, seed + 3, true);
  alloc_tensor(&out, p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, 0, false);
  alloc_tensor(&lse, FC_DTYPE_F32, {p.batch, p.heads_q, p.seqlen_q}, 0, false);
  if (with_grads) {
    alloc_tensor(&dout, p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, seed + 4, true);
    alloc_tensor(&dq, p.dtype, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, 0, false);
    alloc_tensor(&dk, p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, 0, false);
    alloc_tensor(&dv, p.dtype, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, 0, false);
  }
  options.causal = p.causal;
  options.has_window = p.window_left != -1 || p.window_right != -1;
  options.window_left = p.window_left;
  options.window_right = p.window_right;
  options.softcap = p.softcap;
  if (p.alibi) {
    for (int64_t h = 0; h < p.heads_q; ++h) alibi_host.push_back(std::exp2(-8.0f * float(h + 1) / float(p.heads_q)));
    void* slopes = alloc_tensor(&alibi_slopes, FC_DTYPE_F32, {p.heads_q}, 0, false);
    const size_t bytes = alibi_host.size() * sizeof(float);
    if (p.on_gpu) {
#if FLASHCORE_WITH_CUDA
      cuda_check(cudaMemcpy(slopes, alibi_host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
#else
      cuda_missing();
#endif
    } else {
      std::memcpy(slopes, alibi_host.data(), bytes);
    }
    options.alibi_slopes = &alibi_slopes;
  }
  options.dropout_p = p.dropout_p;
  options.dropout_seed = 0x5eed;  // a fixed mask: runs are comparable and the spot check draws the same one
  options.backend = p.backend;
  options.num_threads = p.threads;
  size_t fws = 0, bws = 0;
  if (fc_attention_forward_workspace(&q, &k, &v, &options, &fws) != FC_OK)
    throw UsageError(fc_last_error());
  if (with_grads && fc_attention_backward_workspace(&q, &k, &v, &options, &bws) != FC_OK)
    throw UsageError(fc_last_error());
  workspace_bytes = std::max(fws, bws);
  if (workspace_bytes) {
#if FLASHCORE_WITH_CUDA
    if (p.on_gpu) cuda_check(cudaMalloc(&workspace, workspace_bytes), "cudaMalloc(workspace)");
#endif
    if (!p.on_gpu) workspace = ::operator new(workspace_bytes);
  }
}

Buffers::~Buffers() {
  for (void* ptr : owned_) {
#if FLASHCORE_WITH_CUDA
    if (p_.on_gpu) {
      cudaFree(ptr);
      continue;
    }
#endif
    ::operator delete(ptr);
  }
  if (workspace) {
#if FLASHCORE_WITH_CUDA
    if (p_.on_gpu) {
      cudaFree(workspace);
      return;
    }
#endif
    ::operator delete(workspace);
  }
}

fc_status Buffers::forward() {
  return fc_attention_forward(&q, &k, &v, &out, &lse, &options, workspace, workspace_bytes);
}

fc_status Buffers::backward() {
  return fc_attention_backward(&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &options, workspace, workspace_bytes);
}

std::vector<float> Buffers::fetch(const fc_tensor& t) const {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  std::vector<uint8_t> host(static_cast<size_t>(n) * elem_bytes(t.dtype));
  if (p_.on_gpu) {
#if FLASHCORE_WITH_CUDA
    cuda_check(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
#else
    cuda_missing();
#endif
  } else {
    std::memcpy(host.data(), t.data, host.size());
  }
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = load_as_float(host.data(), i, static_cast<DType>(t.dtype));
  return out;
}

void Buffers::sync() const {
#if FLASHCORE_WITH_CUDA
  if (p_.on_gpu) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

double time_ms([[maybe_unused]] const Problem& p, int repeats, int inner, const std::function<void()>& fn) {
  auto sync = [&] {
#if FLASHCORE_WITH_CUDA
    if (p.on_gpu) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
  };
  fn();  // warm-up (also first-touch of CPU memory / module load on GPU)
  sync();
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
#if FLASHCORE_WITH_CUDA
    if (p.on_gpu) {
      cudaEvent_t a, b;
      cuda_check(cudaEventCreate(&a), "cudaEventCreate");
      cuda_check(cudaEventCreate(&b), "cudaEventCreate");
      cuda_check(cudaEventRecord(a), "cudaEventRecord");
      for (int i = 0; i < inner; ++i) fn();
      cuda_check(cudaEventRecord(b), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      samples.push_back(ms / inner);
      continue;
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < inner; ++i) fn();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / inner);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  std::ostringstream s;
  s.precision(b < 10 ? 2 : 1);
  s << std::fixed << b << " " << units[u];
  return s.str();
}

const char* auto_backend_name(bool on_gpu, bool backward) {
  if (!on_gpu) return "cpu_flash";
  if (!backward && fc_backend_available(FC_BACKEND_CUDA_SM90, 0)) return "cuda_sm90";
  return "cuda_sm80";
}

}  // namespace flashcore::cli
