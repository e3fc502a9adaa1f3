// C ABI of the inference path: fc_attention_kvcache[_workspace] and fc_merge_partials.
// validate -> choose backend (CPU tensors -> CPU, CUDA tensors -> CUDA) -> backend checks ->
// workspace check -> run. Exception-safe like c_api.cpp; errors go to the same per-thread last error.
// Relies on: kvcache_validate.cpp, validate_for_backend (validate.hpp), backend_available (dispatch.hpp).
#include <exception>
#include <string>

#include "api/dispatch.hpp"
#include "api/kvcache_backends.hpp"
#include "api/last_error.hpp"
#include "api/validate.hpp"

namespace flashcore {
namespace {

template <typename F>
fc_status guarded(F&& body) {
  try {
    return record_status(body());
  } catch (const std::bad_alloc&) {
    return record_status(Status::internal("out of host memory"));
  } catch (const std::exception& e) {
    return record_status(Status::internal(std::string("internal error: ") + e.what()));
  } catch (...) {
    return record_status(Status::internal("internal error: unknown exception"));
  }
}

bool is_cuda(fc_backend b) { return b == FC_BACKEND_CUDA_SM80 || b == FC_BACKEND_CUDA_SM90; }

/** Backend for tensors on `device_type`: AUTO follows the tensors; an explicit one must match. */
Status choose(int device_type, int device_id, const fc_attention_options* o, fc_backend* chosen) {
  fc_backend b = o ? static_cast<fc_backend>(o->backend) : FC_BACKEND_AUTO;
  if (b == FC_BACKEND_AUTO) b = device_type == FC_DEVICE_CUDA ? FC_BACKEND_CUDA_SM80 : FC_BACKEND_CPU_FLASH;
  if (b == FC_BACKEND_CUDA_SM90)
    return Status::unsupported("backend: cuda_sm90 does not serve the KV-cache entry points (use auto or cuda_sm80)");
  if (is_cuda(b) && device_type == FC_DEVICE_CUDA && !backend_available(b, device_id))
    return Status::unsupported(std::string("backend: ") + fc_backend_name(b) + " is not available on cuda:" +
                               std::to_string(device_id) + " (not compiled in, no such device, or the GPU is older "
                               "than sm_80)");
  *chosen = b;
  return Status::ok();
}

Status prepare_kvcache(const fc_kvcache_args* a, const fc_attention_options* o, KvCacheParams* p, fc_backend* b) {
  Status s = validate_kvcache(a, o, p);
  if (!s.is_ok()) return s;
  if (!(s = choose(p->device_type, p->device_id, o, b)).is_ok()) return s;
  p->portable_kernels = o != nullptr && o->backend == FC_BACKEND_CUDA_SM80;
  // Device kind, dtype, 16-byte alignment and head_dim rules shared with the forward path.
  AttentionParams shape_only;
  shape_only.dtype = p->dtype;
  shape_only.head_dim = p->head_dim;
  const fc_tensor* ts[] = {a->q, a->k_cache, a->v_cache, a->cache_seqlens, a->block_table, a->cache_batch_idx,
                           a->k_new, a->v_new, a->out, a->lse};
  const char* ns[] = {"q", "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_batch_idx",
                      "k_new", "v_new", "out", "lse"};
  if (!(s = validate_for_backend(shape_only, *b, ts, ns, 10)).is_ok()) return s;
  if (is_cuda(*b)) {
    Status why;
    if (!cuda::kvcache_supports(*p, &why)) return why;
  }
  return Status::ok();
}

Status merge(const fc_tensor* op, const fc_tensor* lp, const fc_tensor* out, const fc_tensor* lse,
             const fc_attention_options* o) {
  MergeParams p;
  Status s = validate_merge(op, lp, out, lse, o, &p);
  if (!s.is_ok()) return s;
  fc_backend b;
  if (!(s = choose(p.device_type, p.device_id, o, &b)).is_ok()) return s;
  const fc_tensor* ts[] = {op, lp, out, lse};
  const char* ns[] = {"out_partials", "lse_partials", "out", "lse"};
  for (int i = 0; i < 4; ++i) {
    if (ts[i] == nullptr) continue;
    const bool on_cuda = ts[i]->device_type == FC_DEVICE_CUDA;
    if (on_cuda != is_cuda(b))
      return Status::invalid(std::string(ns[i]) + ": is a " + (on_cuda ? "cuda" : "cpu") + " tensor but backend " +
                             fc_backend_name(b) + " needs " + (is_cuda(b) ? "cuda" : "cpu") + " tensors");
  }
  return is_cuda(b) ? cuda::merge_partials(p) : cpu::merge_partials(p);
}

}  // namespace
}  // namespace flashcore

extern "C" {

FC_API fc_status fc_attention_kvcache_workspace(const fc_kvcache_args* args, const fc_attention_options* options,
                                                size_t* workspace_bytes) {
  using namespace flashcore;
  return guarded([&] {
    if (workspace_bytes == nullptr) return Status::invalid("workspace_bytes: is null");
    KvCacheParams p;
    fc_backend b;
    Status s = prepare_kvcache(args, options, &p, &b);
    if (!s.is_ok()) return s;
    *workspace_bytes = is_cuda(b) ? cuda::kvcache_workspace(p) : 0;
    return Status::ok();
  });
}

FC_API fc_status fc_attention_kvcache(const fc_kvcache_args* args, const fc_attention_options* options,
                                      void* workspace, size_t workspace_bytes) {
  using namespace flashcore;
  return guarded([&] {
    KvCacheParams p;
    fc_backend b;
    Status s = prepare_kvcache(args, options, &p, &b);
    if (!s.is_ok()) return s;
    if (!is_cuda(b)) {
      if (!(s = check_kvcache_host_values(p)).is_ok()) {
        if (p.error_flag) *p.error_flag = 1;  // reported like the GPU does, besides the status
        return s;
      }
      return cpu::kvcache_forward(p);
    }
    if (!(s = check_workspace(cuda::kvcache_workspace(p), workspace, workspace_bytes, "fc_attention_kvcache_workspace"))
             .is_ok())
      return s;
    return cuda::kvcache_forward(p, workspace, workspace_bytes);
  });
}

FC_API fc_status fc_merge_partials(const fc_tensor* out_partials, const fc_tensor* lse_partials, fc_tensor* out,
                                   fc_tensor* lse, const fc_attention_options* options) {
  using namespace flashcore;
  return guarded([&] { return merge(out_partials, lse_partials, out, lse, options); });
}

}  // extern "C"
