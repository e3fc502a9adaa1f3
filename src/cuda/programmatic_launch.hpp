// Kernel launches as programmatic dependents of the kernel before them on the stream (sm_90+):
// the launch, the CTAs' placement and their prologue overlap that kernel's tail instead of
// starting after it drained. Every kernel launched this way starts with
// ptx::wait_previous_grid() before touching global memory and then ptx::allow_next_grid()
// (cuda/ptx/grid_dependency.cuh), so results are as with ordinary launches, in CUDA graphs too.
// Used by the forward, backward and decode launches; the Hopper forward's cluster-pair kernels
// also launch in clusters of two CTAs.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashcore::cuda {

/** Whether kernels on this device can be programmatic dependents (compute capability 9.0 and up);
 *  false when the query fails (the error is cleared). */
bool supports_programmatic_launch(int device_id);

/** The launch attribute that groups CTAs into clusters of `cluster_ctas` along x. */
inline cudaLaunchAttribute cluster_dimension(unsigned cluster_ctas) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_ctas;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

/** kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster_ctas` CTAs along x (1:
 *  no clusters; grid.x a multiple of it), as a programmatic dependent of the previous kernel on the
 *  stream when `programmatic`. Returns the launch's error, cleared from the runtime's sticky state
 *  like cudaGetLastError. */
template <typename... Params, typename... Args>
cudaError_t launch_kernel_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                      cudaStream_t stream, bool programmatic, unsigned cluster_ctas,
                                      Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned count = 0;
  if (programmatic) {
    attr[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_ctas > 1) attr[count++] = cluster_dimension(cluster_ctas);
  cfg.attrs = attr;
  cfg.numAttrs = count;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

/** kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the previous
 *  kernel on the stream when `programmatic` (launch_kernel_in_clusters without clusters). */
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  return launch_kernel_in_clusters(kernel, grid, block, smem, stream, programmatic, 1u, std::forward<Args>(args)...);
}

/** How many clusters of `cluster_ctas` CTAs of `kernel` (block threads, smem dynamic bytes, its
 *  shared-memory attribute already set) the current device holds at once; 0 when the query fails
 *  (the error is cleared). */
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), dim3 block, size_t smem, unsigned cluster_ctas) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster_ctas);
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr = cluster_dimension(cluster_ctas);
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

}  // namespace flashcore::cuda
