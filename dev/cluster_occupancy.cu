// How many thread-block clusters of the decode attention kernel (cuda/decode/decode_kernels.cuh)
// the GPU holds at once, by cluster size, for its 8-warp and 4-warp d128 tiles (a GPC must hold a
// whole cluster, so clusters of CTAs that take a whole SM each may leave SMs idle): the number
// that kept a split call's merge inside its clusters (branch decode-cluster-merge, docs/PERF.md
// session 40) off main.
//
// build / run (on the GPU machine, from the repository root; ~30 s):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I include -I src dev/cluster_occupancy.cu -o build/cluster_occupancy && build/cluster_occupancy
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/decode/decode_kernels.cuh"

namespace dec = flashcore::cuda::decode;

template <int kWarps>
void report() {
  using Tl = dec::AttnTile<128, kWarps>;
  auto* kernel = dec::attention_kernel<__nv_bfloat16, 128, kWarps, false, false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::kSmemBytes);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Tl::kThreads, Tl::kSmemBytes);
  std::printf("d128, %d warps, %d B dynamic shared memory: %d CTAs per SM\n", kWarps, Tl::kSmemBytes, blocks);
  for (int cluster : {1, 2, 4, 8, 12, 16}) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cluster);
    cfg.blockDim = dim3(Tl::kThreads);
    cfg.dynamicSmemBytes = Tl::kSmemBytes;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    std::printf("  clusters of %2d: %3d resident (%3d CTAs)%s%s\n", cluster, clusters, clusters * cluster,
                err == cudaSuccess ? "" : "  error: ", err == cudaSuccess ? "" : cudaGetErrorString(err));
    cudaGetLastError();
  }
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  report<8>();
  report<4>();
  return 0;
}
