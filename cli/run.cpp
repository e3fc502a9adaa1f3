// `flashcore run`: the README's main job. Builds a realistic problem, runs it on the best
// backend present, spot-checks sampled rows against the fp64 reference, and reports time,
// throughput, error and memory (flashcore's vs what naive attention would allocate).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "api/backends.hpp"
#include "api/dispatch.hpp"
#include "api/validate.hpp"
#include "common.hpp"

namespace flashcore::cli {
namespace {

fc_tensor host_f32(std::vector<float>& data, const fc_tensor& like) {
  fc_tensor t = like;
  t.data = data.data();
  t.dtype = FC_DTYPE_F32;
  t.device_type = FC_DEVICE_CPU;
  t.device_id = 0;
  return t;
}

/** Max |out - ref| (and lse) over `rows` sampled query rows; ref from the fp64 reference. */
struct SpotCheck {
  double max_out_err = 0, max_lse_err = 0, max_ref = 0;
  bool finite = true;
};

SpotCheck spot_check(Buffers& buf, const Problem& p, int64_t rows) {
  std::vector<float> q = buf.fetch(buf.q), k = buf.fetch(buf.k), v = buf.fetch(buf.v), out = buf.fetch(buf.out),
                     lse = buf.fetch(buf.lse);
  fc_tensor tq = host_f32(q, buf.q), tk = host_f32(k, buf.k), tv = host_f32(v, buf.v);
  fc_attention_options opt = buf.options;
  opt.backend = FC_BACKEND_CPU_REFERENCE;
  fc_tensor host_slopes = buf.alibi_slopes;  // the reference reads the host copy
  if (p.alibi) {
    host_slopes.data = buf.alibi_host.data();
    host_slopes.device_type = FC_DEVICE_CPU;
    host_slopes.device_id = 0;
    opt.alibi_slopes = &host_slopes;
  }
  AttentionParams params;
  const Status s = validate_forward({&tq, &tk, &tv, nullptr, nullptr, &opt}, true, &params);
  if (!s.is_ok()) throw std::runtime_error(s.message);
  SpotCheck r;
  std::mt19937_64 rng(99);
  std::vector<double> ref(p.head_dim);
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t b = rng() % p.batch, h = rng() % p.heads_q;
    const int64_t i = n == 0 ? p.seqlen_q - 1 : int64_t(rng() % p.seqlen_q);  // always include the last row
    double ref_lse;
    cpu::reference_row(params, b, h, i, ref.data(), &ref_lse);
    const int64_t o = ((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) {
      if (!std::isfinite(out[o + d])) r.finite = false;
      r.max_out_err = std::max(r.max_out_err, std::fabs(out[o + d] - ref[d]));
      r.max_ref = std::max(r.max_ref, std::fabs(ref[d]));
    }
    const float l = lse[(b * p.heads_q + h) * p.seqlen_q + i];
    if (std::isinf(ref_lse)) {
      if (l != ref_lse) r.finite = false;
    } else {
      if (!std::isfinite(l)) r.finite = false;
      r.max_lse_err = std::max(r.max_lse_err, std::fabs(l - ref_lse));
    }
  }
  return r;
}

}  // namespace

int command_run(int argc, char** argv) {
  auto known = problem_options();
  known["check-rows"] = true;
  known["repeats"] = true;
  const Args a(argc, argv, 2, known);
  if (a.has("help")) {
    std::printf("usage: flashcore run [options]\n\nComputes attention on the best backend present (CUDA when a GPU\n"
                "is usable, else the CPU flash path), checks sampled rows against the fp64 reference\nand "
                "reports time, throughput, error and memory.\n\n%s"
                "  --check-rows N       rows compared with the reference (default 64)\n"
                "  --repeats N          timed repetitions (default 5)\n",
                problem_options_help().c_str());
    return 0;
  }
  Problem defaults;
  defaults.on_gpu = gpu_usable();
  if (defaults.on_gpu) {  // a training-sized problem: 8k tokens, model dim 2048
    defaults.batch = 2;
    defaults.seqlen_q = defaults.seqlen_k = 4096;
    defaults.heads_q = defaults.heads_kv = 16;
    defaults.head_dim = 128;
    defaults.dtype = FC_DTYPE_BF16;
  } else {  // what a laptop does in well under a second
    defaults.batch = 1;
    defaults.seqlen_q = defaults.seqlen_k = 2048;
    defaults.heads_q = defaults.heads_kv = 16;
    defaults.head_dim = 64;
    defaults.dtype = FC_DTYPE_F32;
  }
  const Problem p = parse_problem(a, defaults);
  const int64_t check_rows = a.num("check-rows", 64);
  const int repeats = static_cast<int>(std::max<int64_t>(1, a.num("repeats", 5)));

  Buffers buf(p, false, 42);
  const char* backend = p.backend != FC_BACKEND_AUTO ? fc_backend_name(p.backend)
                                                     : auto_backend_name(p.on_gpu, false);
  std::printf("flashcore %s  run\n", fc_version());
  std::printf("  problem : %s\n", p.describe().c_str());
  const ForwardArgs args{&buf.q, &buf.k, &buf.v, &buf.out, &buf.lse, &buf.options};
  const bool decode_route = p.backend == FC_BACKEND_AUTO && forward_takes_decode_route(args);
  std::printf("  backend : %s%s\n", backend,
              decode_route ? ", decode path (few query rows per KV head: AUTO's decode route)" : "");
  char device[256];
  if (p.on_gpu && fc_cuda_device_describe(0, device, sizeof(device)) == FC_OK) std::printf("  device  : %s\n", device);
  if (buf.forward() != FC_OK) {
    std::fprintf(stderr, "flashcore run: %s\n", fc_last_error());
    return 1;
  }
  buf.sync();
  const double ms = time_ms(p, repeats, p.on_gpu ? 10 : 1, [&] { buf.forward(); });
  const double flops = p.flops_forward();
  const double rate = flops / (ms * 1e-3);
  // A decode-shaped call is bound by reading K and V: its rate in those bytes is the number to
  // compare with the memory's (as `flashcore bench --grid decode` reports it).
  const std::string kv_rate =
      decode_route ? "   K+V read at " + std::to_string(static_cast<int64_t>(p.kv_bytes() / (ms * 1e-3) / 1e9)) + " GB/s"
                   : "";
  if (p.on_gpu) std::printf("  time    : %.3f ms   %.1f TFLOP/s%s\n", ms, rate / 1e12, kv_rate.c_str());
  else std::printf("  time    : %.3f ms   %.1f GFLOP/s%s\n", ms, rate / 1e9, kv_rate.c_str());

  const int64_t rows_checked = std::min<int64_t>(std::max<int64_t>(check_rows, 0), p.batch * p.heads_q * p.seqlen_q);
  const SpotCheck c = spot_check(buf, p, rows_checked);
  // Error budget per dtype: a few ulps of the output magnitude (fp16/bf16 also round P).
  const double tol = p.dtype == FC_DTYPE_F32 ? 1e-5 : p.dtype == FC_DTYPE_F16 ? 4e-3 : 3e-2;
  const bool ok = c.finite && c.max_out_err <= tol * std::max(1.0, c.max_ref) && c.max_lse_err <= 1e-3;
  std::printf("  check   : %lld rows vs fp64 reference: max |out err| %.3g, max |lse err| %.3g  %s\n",
              static_cast<long long>(rows_checked), c.max_out_err, c.max_lse_err, ok ? "OK" : "FAILED");
  const double naive = 2.0 * p.batch * p.heads_q * double(p.seqlen_q) * double(p.seqlen_k) * 4;
  const double ours = double(buf.workspace_bytes) + 4.0 * p.batch * p.heads_q * p.seqlen_q;
  std::printf("  memory  : flashcore extra %s (workspace + lse) vs naive attention %s (scores + probabilities, fp32)\n",
              format_bytes(ours).c_str(), format_bytes(naive).c_str());
  return ok ? 0 : 1;
}

}  // namespace flashcore::cli
