// Thread-block clusters (sm_90): the CTAs of a cluster run at the same time on SMs of one GPC and
// can reach each other's shared memory through the .shared::cluster window. Used by the Hopper
// forward's cluster-pair kernels, where two CTAs share each K/V block: each copies half of it
// from L2 into both CTAs' shared memory with one multicast TMA load (tma.cuh), and each consumer
// releases a stage on both CTAs' "empty" barriers before either producer refills it.
//
// Addresses: a .shared::cta address (smem_addr) names this CTA's shared memory; peer_shared_addr
// maps it to the same offset in another CTA of the cluster (mapa), as a .shared::cluster address.
// A CTA must not touch a peer's shared memory before the peer initialised it (cluster_sync after
// the barrier setup) nor after the peer may have exited (cluster_sync before the end).
//
// Relies on: PTX ISA 7.8 (barrier.cluster, mapa, %cluster_ctarank), 8.0
// (mbarrier.arrive on .shared::cluster), sm_90.
#pragma once

#include <cstdint>

#include "cuda/ptx/mma.cuh"  // smem_addr

namespace flashcore::ptx {

/** This CTA's rank in its cluster (0 .. cluster size - 1). */
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

/** Every non-exited thread of the cluster arrives (release: this thread's earlier writes, shared
 *  memory of any CTA included, are visible to the threads past the matching wait), then waits for
 *  all of them (acquire). Threads of a warp may arrive at different points (not .aligned). */
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;\n" ::
          : "memory");
}

/** The .shared::cluster address of `local_addr` (a .shared::cta address) in the CTA of rank
 *  `rank` of this cluster. */
__device__ __forceinline__ uint32_t peer_shared_addr(uint32_t local_addr, uint32_t rank) {
  uint32_t addr;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(addr) : "r"(local_addr), "r"(rank));
  return addr;
}

/** One arrival on the mbarrier at `cluster_addr` (a .shared::cluster address: peer_shared_addr),
 *  which may belong to another CTA of the cluster. Release semantics at CTA scope (the default):
 *  enough to hand back a buffer whose reads have completed (wgmma.wait_group), and free of the
 *  fence that .release.cluster compiles to (a MEMBAR per arrival, which stalled the Hopper
 *  forward's consumers: docs/PERF.md, session 64). */
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}

}  // namespace flashcore::ptx
