// Host side of TMA: builds CUtensorMap descriptors for the sm_90 kernels.
//
// cuTensorMapEncodeTiled is a driver-API function; flashcore links only the CUDA runtime, so the
// function is looked up once through the runtime's driver entry-point query (no -lcuda needed).
// The map describes a 2D row-major view of 16-bit elements (rows x cols, `row_stride` elements
// between rows) and the box (tile) one TMA copy moves; kernels take the map by value as a
// `const __grid_constant__ CUtensorMap` parameter (see cuda/ptx/tma.cuh).
//
// Rules checked here (cuTensorMapEncodeTiled's, restated so failures name the argument):
// base 16-byte aligned; row stride a multiple of 16 bytes; box sides in [1, 256]; the box's row
// (box_cols * 2 bytes) a multiple of 16 bytes and, with a swizzle, at most the swizzle span
// (32/64/128 bytes). Out-of-bounds box elements read as zero and are not written by stores.
//
// Relies on: CUDA 12.0+ headers (<cuda.h> for the types only), the runtime library, a driver that
// exports cuTensorMapEncodeTiled (any 12.x driver).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "api/status.hpp"

namespace flashcore::cuda::sm90 {

/** Element type of a mapped tensor: the attention tensors' 16-bit types, or fp32 (the backward's
 *  per-row statistics). */
enum class TmaElement { kFp16, kBf16, kFp32 };

/** Bytes of one element. */
inline uint32_t tma_element_bytes(TmaElement e) { return e == TmaElement::kFp32 ? 4u : 2u; }

/** Shared-memory swizzle the copy applies; must match the wgmma descriptor's SmemSwizzle. */
enum class TmaSwizzle { kNone, k32B, k64B, k128B };

struct TensorMapLimits {
  static constexpr uint32_t kMaxBoxSide = 256;
  static constexpr uint32_t kAlignBytes = 16;  // base address, strides, box row
  static constexpr uint64_t kMaxStrideBytes = uint64_t(1) << 40;
  static constexpr uint64_t kMaxDim = uint64_t(1) << 32;
};

/** A 2D row-major view of a global tensor and the box one copy moves. */
struct TiledView2d {
  const void* base = nullptr;  // first element, 16-byte aligned
  TmaElement element = TmaElement::kBf16;
  uint64_t rows = 0;        // outer dimension
  uint64_t cols = 0;        // inner (contiguous) dimension
  uint64_t row_stride = 0;  // elements between consecutive rows (>= cols)
  uint32_t box_rows = 0;
  uint32_t box_cols = 0;
  TmaSwizzle swizzle = TmaSwizzle::k128B;
};

/** Bytes a swizzle mode spans per row (0 for none: no limit beyond kMaxBoxSide elements). */
uint32_t tma_swizzle_span_bytes(TmaSwizzle swizzle);

/** Bytes one copy of the view's box moves (what mbarrier_arrive_expect_tx must announce). */
inline uint32_t box_bytes(const TiledView2d& view) {
  return view.box_rows * view.box_cols * tma_element_bytes(view.element);
}

/** A row-major view of rank 2..5 (dims[0] innermost and contiguous) and its box: the attention
 *  tensors are 4-D (head_dim, rows, heads, batch) with arbitrary outer strides. */
struct TiledViewNd {
  static constexpr int kMaxRank = 5;
  const void* base = nullptr;  // 16-byte aligned
  TmaElement element = TmaElement::kBf16;
  int rank = 0;
  uint64_t dims[kMaxRank] = {};     // extent of each dimension, innermost first
  uint64_t strides[kMaxRank] = {};  // elements between consecutive indices; strides[0] is 1
  uint32_t box[kMaxRank] = {};      // box side per dimension
  TmaSwizzle swizzle = TmaSwizzle::k128B;
};

/** Encodes an N-D view (same rules per dimension as the 2-D form: each outer stride a multiple of
 *  16 bytes below 2^40, box sides in [1, 256], box row within the swizzle span). */
Status encode_tensor_map_nd(const TiledViewNd& view, CUtensorMap* map);

/** Encodes `view` into *map. Errors: FC_ERROR_INVALID_ARGUMENT for a view TMA cannot describe,
 *  FC_ERROR_CUDA when the driver entry point is missing or the driver rejects the map. */
Status encode_tensor_map_2d(const TiledView2d& view, CUtensorMap* map);

}  // namespace flashcore::cuda::sm90
