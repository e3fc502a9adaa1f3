// The device-side check of a varlen call's cu_seqlens (fc_attention_options::error_flag): one
// small kernel, launched on the caller's stream before the attention kernels, that sets the flag
// when the prefix sums break the rules the CPU path enforces on the host. No host synchronization,
// so it works inside CUDA-graph capture. The attention kernels clamp every sequence into its
// tensors anyway (seq_info), so a flagged call is wrong but in bounds.
//
// Relies on: the CUDA runtime, api/params.hpp, scoped_device.hpp.
#include <cuda_runtime.h>

#include <string>

#include "api/backends.hpp"
#include "api/params.hpp"
#include "cuda/scoped_device.hpp"

namespace flashcore::cuda {
namespace {

constexpr int kCheckThreads = 256;

/** One CTA: entry i of both arrays is checked by thread i % kCheckThreads. The rules of
 *  validate.cpp's check_cu_seqlens_values: cu[0] = 0, non-decreasing, every length <= max_length,
 *  last entry <= total. */
__global__ void __launch_bounds__(kCheckThreads) cu_seqlens_check_kernel(const int32_t* cu_q, const int32_t* cu_k,
                                                                        int32_t batch, int64_t total_q,
                                                                        int64_t total_k, int64_t max_q,
                                                                        int64_t max_k, int32_t* error_flag) {
  bool bad = false;
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i <= batch; i += kCheckThreads) {
    for (int which = 0; which < 2; ++which) {
      const int32_t* cu = which == 0 ? cu_q : cu_k;
      const int64_t total = which == 0 ? total_q : total_k, longest = which == 0 ? max_q : max_k;
      const int64_t x = cu[i];
      if (i == 0 && x != 0) bad = true;
      if (i == batch && x > total) bad = true;
      if (i < batch) {
        const int64_t next = cu[i + 1];
        if (next < x || next - x > longest) bad = true;
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *error_flag = 1;
}

}  // namespace

Status check_cu_seqlens_on_device(const AttentionParams& p) {
  if (!p.is_varlen() || p.error_flag == nullptr) return Status::ok();
  const ScopedDevice on_device(p.device_id);
  // p.seqlen_q / p.seqlen_k are max_seqlen clamped to the totals: the same lengths pass.
  cu_seqlens_check_kernel<<<1, kCheckThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(
      p.cu_seqlens_q, p.cu_seqlens_k, static_cast<int32_t>(p.batch), p.total_q, p.total_k, p.seqlen_q, p.seqlen_k,
      p.error_flag);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::cuda(std::string("error_flag: the cu_seqlens check failed to launch: ") +
                                              cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace flashcore::cuda
