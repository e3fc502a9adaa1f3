// Tensor Memory Accelerator (TMA, sm_90) bulk tensor copies: tiles between global memory and
// shared memory described by a CUtensorMap (built on the host, see cuda/sm90/tensor_map.hpp).
//
// Loads (global -> shared) complete on an mbarrier: the copy adds its byte count to the barrier's
// tx-count as it lands, so a producer first arms the barrier with mbarrier_arrive_expect_tx(total
// bytes) and the consumers wait on the phase. Stores and reductions (shared -> global) are tracked
// per thread by bulk async-groups: commit, then wait until the reads of shared memory
// (wait_group_read, enough to reuse the buffer) or the whole writes (wait_group) are done.
//
// Coordinates are element indices, innermost dimension first ({col, row} for a row-major 2D view),
// and may be negative or run past the tensor: loads fill out-of-bounds elements with zeros, stores
// skip them. The tensor map must live in param/const/global memory: pass it to the kernel as a
// `const __grid_constant__ CUtensorMap` parameter and hand its address to these wrappers.
//
// Shared-memory destination/source: 128-byte aligned, and aligned to the swizzle pattern's period
// (1024 bytes for 128B swizzle) when the map swizzles, so that the pattern starts at row 0 exactly
// as the wgmma descriptors assume.
//
// Ordering across proxies: shared memory written by ordinary stores and then read by a TMA store
// (or by wgmma) needs fence_proxy_async_shared_cta() in every writing thread before the barrier
// that precedes the copy.
//
// Relies on: PTX ISA 8.0, sm_90; <cuda.h> only for the CUtensorMap type.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/ptx/mma.cuh"  // smem_addr

namespace flashcore::ptx {

/** Generic address of a tensor map (kernel parameter) as the 64-bit operand TMA expects. */
__device__ __forceinline__ uint64_t tensor_map_operand(const CUtensorMap* map) {
  return reinterpret_cast<uint64_t>(map);
}

/** Pulls the tensor map's 128 bytes into the TMA unit's cache ahead of the first copy. */
__device__ __forceinline__ void tma_prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map_operand(map)) : "memory");
}

/** Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
 *  ones (TMA, wgmma) on the CTA's shared memory. */
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- loads: global -> shared, completion counted in bytes on an mbarrier ----------------------

/** Byte offset of (row, 16-byte unit, byte) in shared memory laid out as consecutive 128-byte-
 *  swizzled boxes of `box_rows` rows x 128 bytes (64 16-bit columns), as a TMA map with
 *  CU_TENSOR_MAP_SWIZZLE_128B reads or writes them: unit u of row r sits at unit u ^ (r % 8), so
 *  the 8 rows x 4 words of a warp's accumulator-fragment store hit 32 distinct banks. The same
 *  layout as ptx::KMajorTile{k128B}, in the few integer operations a per-element epilogue wants. */
__host__ __device__ constexpr uint32_t swizzled_box_offset(uint32_t box_rows, uint32_t box, uint32_t row,
                                                           uint32_t unit, uint32_t byte) {
  return box * box_rows * 128u + row * 128u + ((unit ^ (row % 8u)) << 4) + byte;
}

/** 2D tile load of the map's box at {c0 (inner), c1}. */
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

/** 3D tile load at {c0 (inner), c1, c2}. */
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

/** 4D tile load at {c0 (inner), c1, c2, c3}. */
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/** Multicast loads (thread-block clusters, ptx/cluster.cuh): the box lands at the same
 *  shared-memory offset `smem_dst` in every CTA of the cluster whose bit is set in `cta_mask`
 *  (bit r: rank r), and completes its bytes on the mbarrier at the same offset as `bar` in each of
 *  them. Every receiving CTA arms its own barrier for the bytes it receives; one L2 read feeds
 *  them all. */
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                                      int32_t c0, int32_t c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

/** The 4D multicast load at {c0 (inner), c1, c2, c3} (see tma_load_2d_multicast). */
__device__ __forceinline__ void tma_load_4d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                                      int32_t c0, int32_t c1, int32_t c2, int32_t c3,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(cta_mask)
      : "memory");
}

/** 5D tile load at {c0 (inner), c1, c2, c3, c4}. The box lands in shared memory in row-major order
 *  of its dimensions, innermost first, so a box of {64, G, R, 1, 1} is G x R rows of 128 bytes:
 *  row j * G + i holds index i of dimension 1 and j of dimension 2 (the packed GQA rows of the
 *  Hopper forward: G query heads of one token, token after token). */
__device__ __forceinline__ void tma_load_5d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_addr(smem_dst)),
      "l"(tensor_map_operand(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

/** The 5D form of tma_prefetch_l2_4d. */
__device__ __forceinline__ void tma_prefetch_l2_5d(const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                                   int32_t c3, int32_t c4) {
  asm volatile("cp.async.bulk.prefetch.tensor.5d.L2.global.tile [%0, {%1, %2, %3, %4, %5}];\n" ::"l"(
                   tensor_map_operand(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

/** Requests the 4D box at {c0 (inner), c1, c2, c3} into L2 without copying it anywhere
 *  (cp.async.bulk.prefetch.tensor): no barrier, no completion, out-of-bounds parts are skipped.
 *  Safe before griddepcontrol.wait (cuda/ptx/l2_prefetch.cuh says why). */
__device__ __forceinline__ void tma_prefetch_l2_4d(const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                                   int32_t c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(
                   tensor_map_operand(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// ---- stores: shared -> global, tracked by bulk async-groups ----------------------------------

/** 2D tile store of the shared box to {c0 (inner), c1}; out-of-bounds elements are not written. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          tensor_map_operand(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          tensor_map_operand(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          tensor_map_operand(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/** 5D tile store (the shared box laid out as tma_load_5d lands it); out-of-bounds elements are not
 *  written. */
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
          tensor_map_operand(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

/** 2D tile reduction into global memory: the box at {c0 (inner), c1} += the shared box, element by
 *  element in the map's type (fp32: an atomic add per element, performed at L2), out-of-bounds
 *  elements skipped. The shared box is read through the async proxy, so generic stores to it
 *  need fence_proxy_async_shared_cta first; completion is tracked by the same bulk async-groups
 *  as the stores (tma_store_commit_group / tma_store_wait_group[_read]). */
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* smem_src,
                                                  int32_t c0, int32_t c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          tensor_map_operand(map)),
      "r"(smem_addr(smem_src)), "r"(c0), "r"(c1)
      : "memory");
}

/** Closes the bulk async-group of this thread's stores issued since the previous commit. */
__device__ __forceinline__ void tma_store_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/** Waits until at most `kPending` of this thread's most recent store groups are incomplete
 *  (writes to global memory done and visible). */
template <int kPending>
__device__ __forceinline__ void tma_store_wait_group() {
  static_assert(kPending >= 0, "pending group count must be non-negative");
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/** Waits only until the source shared memory of all but `kPending` groups has been read, which is
 *  what reusing the staging buffer needs (cheaper than tma_store_wait_group). */
template <int kPending>
__device__ __forceinline__ void tma_store_wait_group_read() {
  static_assert(kPending >= 0, "pending group count must be non-negative");
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flashcore::ptx
