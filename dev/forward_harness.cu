// Development harness for the sm80 forward kernel: a shared library with a flat C entry point that
// dev/forward_check.py drives through ctypes with torch tensors (correctness against a torch fp64
// reference, timing against PyTorch's FlashAttention-2). Variant 0 goes through the real backend
// entry (sm80_supports + sm80_forward, i.e. forward_api.cu and the default traits); variants >= 1
// launch alternative tile configurations directly so they can be compared in one GPU session.
//
// Build (on the GPU machine; see dev/README.md):
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I include -I src -shared -Xcompiler -fPIC
//        -gencode arch=compute_90,code=sm_90 -DFLASHCORE_HDIM_64=1 ... dev/forward_harness.cu
//        src/cuda/sm80/forward_api.cu src/cuda/device.cu -o /tmp/libfcdev.so
#include <cstdio>

#include "api/backends.hpp"
#include "cuda/sm80/forward.cuh"

namespace flashcore::cuda::sm80 {
// What the generated units of cmake/cuda.cmake instantiate.
template Status forward_run<__half, 64>(const forward_params_t&, void*, size_t);
template Status forward_run<__half, 128>(const forward_params_t&, void*, size_t);
template Status forward_run<__half, 256>(const forward_params_t&, void*, size_t);
template Status forward_run<__nv_bfloat16, 64>(const forward_params_t&, void*, size_t);
template Status forward_run<__nv_bfloat16, 128>(const forward_params_t&, void*, size_t);
template Status forward_run<__nv_bfloat16, 256>(const forward_params_t&, void*, size_t);
}  // namespace flashcore::cuda::sm80

namespace {

using namespace flashcore;
using namespace flashcore::cuda::sm80;

// Alternative configurations (bf16 only): X(id, head_dim, kBlockM, kBlockN, warps,
//   Q in registers, min CTAs per SM (0 = default), P V overlapped with the next softmax).
// 20 / 21 (session 25): d128 with Q in registers on 16-key tiles, to test whether the shipped
// d128 kernel (Q re-read from smem per k-step) is bound by shared-memory bandwidth. It is not:
// 0.77x the shipped kernel at d128 S = 4096 (docs/PERF.md).
#ifndef FCDEV_VARIANTS
#define FCDEV_VARIANTS                    \
  X(1, 64, 128, 64, 4, true, 0, true)     \
  X(2, 64, 128, 64, 4, true, 0, false)    \
  X(5, 128, 128, 64, 4, false, 0, false)  \
  X(6, 128, 128, 32, 4, false, 0, false)  \
  X(8, 256, 128, 64, 8, false, 0, true)   \
  X(9, 256, 128, 64, 8, false, 0, false)  \
  X(11, 256, 128, 32, 8, false, 0, true)  \
  X(12, 128, 128, 32, 4, false, 0, true)  \
  X(20, 128, 128, 16, 4, true, 0, true)   \
  X(21, 128, 128, 16, 4, true, 0, false)  \
  X(22, 128, 64, 32, 4, true, 3, true)    \
  X(23, 128, 64, 64, 4, true, 3, false)   \
  X(24, 64, 64, 64, 4, true, 4, true)     \
  X(25, 256, 64, 64, 4, false, 2, false)  \
  X(26, 256, 64, 32, 4, true, 2, true)
#endif

// variant + 100: the same configuration with eager rescaling (threshold 0).
Status run_variant(int variant, const AttentionParams& p) {
  const float threshold = variant >= 100 ? 0.f : kRescaleThresholdLog2;
  switch (variant % 100) {
#define X(id, d, m, n, w, qreg, min_blocks, overlap) \
  case id:                                           \
    return launch_forward<ForwardTraits<__nv_bfloat16, d, m, n, w, qreg, min_blocks, overlap>>( \
        p, threshold);
    FCDEV_VARIANTS
#undef X
    default:
      return Status::invalid("unknown variant");
  }
}

}  // namespace

extern "C" int fcdev_variant_head_dim(int variant) {
  switch (variant % 100) {
#define X(id, d, m, n, w, qreg, min_blocks, overlap) \
  case id:                                           \
    return d;
    FCDEV_VARIANTS
#undef X
    default:
      return 0;
  }
}

/** strides: q, k, v, out as (batch, row, head) triples, then lse (batch, head, row). */
extern "C" int fcdev_forward(int variant, int dtype, void* q, void* k, void* v, void* out,
                             float* lse, const int64_t* strides, int64_t batch, int64_t seqlen_q,
                             int64_t seqlen_k, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                             const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                             int64_t total_q, int64_t total_k, float scale, float softcap,
                             int64_t window_left, int64_t window_right, void* stream) {
  AttentionParams p;
  p.dtype = dtype == 1 ? DType::F16 : DType::BF16;
  p.device_type = FC_DEVICE_CUDA;
  p.device_id = 0;
  TensorRef* refs[4] = {&p.q, &p.k, &p.v, &p.out};
  void* data[4] = {q, k, v, out};
  for (int i = 0; i < 4; ++i) {
    refs[i]->data = data[i];
    refs[i]->batch_stride = strides[3 * i];
    refs[i]->row_stride = strides[3 * i + 1];
    refs[i]->head_stride = strides[3 * i + 2];
  }
  p.lse.data = lse;
  p.lse.batch_stride = strides[12];
  p.lse.head_stride = strides[13];
  p.lse.row_stride = strides[14];
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.cu_seqlens_q = cu_seqlens_q;
  p.cu_seqlens_k = cu_seqlens_k;
  p.total_q = total_q;
  p.total_k = total_k;
  p.softmax_scale = scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.causal = window_right == 0;
  p.stream = stream;

  Status status;
  if (variant == 0) {
    Status why;
    if (!flashcore::cuda::sm80_supports(p, &why)) {
      std::fprintf(stderr, "unsupported: %s\n", why.message.c_str());
      return static_cast<int>(why.code);
    }
    status = flashcore::cuda::sm80_forward(p, nullptr, flashcore::cuda::sm80_forward_workspace(p));
  } else {
    status = run_variant(variant, p);
  }
  if (!status.is_ok()) std::fprintf(stderr, "error: %s\n", status.message.c_str());
  return static_cast<int>(status.code);
}
