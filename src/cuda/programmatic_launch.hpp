// Kernel launches as programmatic dependents of the kernel before them on the stream (sm_90+):
// the launch, the CTAs' placement and their prologue overlap that kernel's tail instead of
// starting after it drained. Every kernel launched this way starts with
// ptx::wait_previous_grid() before touching global memory and then ptx::allow_next_grid()
// (cuda/ptx/grid_dependency.cuh), so results are as with ordinary launches, in CUDA graphs too.
// Used by the forward, backward and decode launches.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashcore::cuda {

/** Whether kernels on this device can be programmatic dependents (compute capability 9.0 and up);
 *  false when the query fails (the error is cleared). */
bool supports_programmatic_launch(int device_id);

/** kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the previous
 *  kernel on the stream when `programmatic`. Returns the launch's error, cleared from the
 *  runtime's sticky state like cudaGetLastError. */
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

}  // namespace flashcore::cuda
