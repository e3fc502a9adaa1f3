// Host side of TMA: cuTensorMapEncodeTiled looked up through the runtime's driver entry-point
// query, plus the argument checks that turn the driver's bare CUDA_ERROR_INVALID_VALUE into a
// message naming the offending field. Plain C++ (compiled by the host compiler with the CUDA
// include directory); see tensor_map.hpp for the rules.
#include "cuda/sm90/tensor_map.hpp"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_runtime_api.h>

#include <string>

namespace flashcore::cuda::sm90 {
namespace {

using EncodeTiledFn = PFN_cuTensorMapEncodeTiled_v12000;

constexpr uint32_t kRank = 2;
constexpr unsigned int kEntryPointAbiVersion = 12000;  // the v12000 prototype above

struct EntryPoint {
  EncodeTiledFn fn = nullptr;
  std::string error;
};

EntryPoint lookup_encode_tiled() {
  EntryPoint result;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(
      "cuTensorMapEncodeTiled", &fn, kEntryPointAbiVersion, cudaEnableDefault, &query);
#else
  (void)kEntryPointAbiVersion;
  const cudaError_t err =
      cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &query);
#endif
  if (err != cudaSuccess) {
    result.error = std::string("driver entry-point query failed: ") + cudaGetErrorString(err);
    cudaGetLastError();  // the failed query must not poison the caller's next error check
  } else if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
    result.error = query == cudaDriverEntryPointVersionNotSufficent
                       ? "the CUDA driver is too old to export cuTensorMapEncodeTiled (need 12.0+)"
                       : "the CUDA driver does not export cuTensorMapEncodeTiled";
  } else {
    result.fn = reinterpret_cast<EncodeTiledFn>(fn);
  }
  return result;
}

const EntryPoint& encode_tiled_entry_point() {
  static const EntryPoint entry = lookup_encode_tiled();  // thread-safe, looked up once
  return entry;
}

CUtensorMapSwizzle to_cu_swizzle(TmaSwizzle swizzle) {
  switch (swizzle) {
    case TmaSwizzle::k32B:
      return CU_TENSOR_MAP_SWIZZLE_32B;
    case TmaSwizzle::k64B:
      return CU_TENSOR_MAP_SWIZZLE_64B;
    case TmaSwizzle::k128B:
      return CU_TENSOR_MAP_SWIZZLE_128B;
    case TmaSwizzle::kNone:
      break;
  }
  return CU_TENSOR_MAP_SWIZZLE_NONE;
}

Status validate(const TiledView2d& v) {
  using L = TensorMapLimits;
  const std::string where = "tensor map: ";
  if (v.base == nullptr) return Status::invalid(where + "base is null");
  if (reinterpret_cast<uintptr_t>(v.base) % L::kAlignBytes != 0)
    return Status::invalid(where + "base must be 16-byte aligned");
  if (v.rows == 0 || v.cols == 0 || v.rows > L::kMaxDim || v.cols > L::kMaxDim)
    return Status::invalid(where + "rows and cols must be in [1, 2^32], got " +
                           std::to_string(v.rows) + " x " + std::to_string(v.cols));
  if (v.row_stride < v.cols)
    return Status::invalid(where + "row_stride (" + std::to_string(v.row_stride) +
                           ") is smaller than cols (" + std::to_string(v.cols) + ")");
  const uint64_t stride_bytes = v.row_stride * tma_element_bytes(v.element);
  if (stride_bytes % L::kAlignBytes != 0 || stride_bytes >= L::kMaxStrideBytes)
    return Status::invalid(where + "row stride must be a multiple of 16 bytes below 2^40, got " +
                           std::to_string(stride_bytes) + " bytes");
  if (v.box_rows == 0 || v.box_cols == 0 || v.box_rows > L::kMaxBoxSide ||
      v.box_cols > L::kMaxBoxSide)
    return Status::invalid(where + "box sides must be in [1, 256], got " +
                           std::to_string(v.box_rows) + " x " + std::to_string(v.box_cols));
  const uint32_t box_row_bytes = v.box_cols * tma_element_bytes(v.element);
  if (box_row_bytes % L::kAlignBytes != 0)
    return Status::invalid(where + "box row must be a multiple of 16 bytes, got " +
                           std::to_string(box_row_bytes));
  const uint32_t span = tma_swizzle_span_bytes(v.swizzle);
  if (span != 0 && box_row_bytes > span)
    return Status::invalid(where + "box row of " + std::to_string(box_row_bytes) +
                           " bytes exceeds the " + std::to_string(span) + "-byte swizzle span");
  return Status::ok();
}

}  // namespace

uint32_t tma_swizzle_span_bytes(TmaSwizzle swizzle) {
  switch (swizzle) {
    case TmaSwizzle::k32B:
      return 32;
    case TmaSwizzle::k64B:
      return 64;
    case TmaSwizzle::k128B:
      return 128;
    case TmaSwizzle::kNone:
      break;
  }
  return 0;
}

Status encode_tensor_map_2d(const TiledView2d& view, CUtensorMap* map) {
  if (map == nullptr) return Status::invalid("tensor map: output pointer is null");
  if (Status s = validate(view); !s.is_ok()) return s;
  TiledViewNd nd;
  nd.base = view.base;
  nd.element = view.element;
  nd.rank = kRank;
  nd.dims[0] = view.cols;
  nd.dims[1] = view.rows;
  nd.strides[0] = 1;
  nd.strides[1] = view.row_stride;
  nd.box[0] = view.box_cols;
  nd.box[1] = view.box_rows;
  nd.swizzle = view.swizzle;
  return encode_tensor_map_nd(nd, map);
}

Status encode_tensor_map_nd(const TiledViewNd& view, CUtensorMap* map) {
  using L = TensorMapLimits;
  const std::string where = "tensor map: ";
  if (map == nullptr) return Status::invalid(where + "output pointer is null");
  if (view.rank < 2 || view.rank > TiledViewNd::kMaxRank)
    return Status::invalid(where + "rank must be in [2, 5], got " + std::to_string(view.rank));
  if (view.base == nullptr) return Status::invalid(where + "base is null");
  if (reinterpret_cast<uintptr_t>(view.base) % L::kAlignBytes != 0)
    return Status::invalid(where + "base must be 16-byte aligned");
  cuuint64_t global_dim[TiledViewNd::kMaxRank];
  cuuint64_t global_stride[TiledViewNd::kMaxRank - 1];  // bytes, every dimension but the innermost
  cuuint32_t box_dim[TiledViewNd::kMaxRank];
  cuuint32_t element_stride[TiledViewNd::kMaxRank];
  for (int d = 0; d < view.rank; ++d) {
    const std::string dim = "dimension " + std::to_string(d);
    if (view.dims[d] == 0 || view.dims[d] > L::kMaxDim)
      return Status::invalid(where + dim + " extent must be in [1, 2^32], got " +
                             std::to_string(view.dims[d]));
    if (view.box[d] == 0 || view.box[d] > L::kMaxBoxSide)
      return Status::invalid(where + dim + " box side must be in [1, 256], got " +
                             std::to_string(view.box[d]));
    global_dim[d] = view.dims[d];
    box_dim[d] = view.box[d];
    element_stride[d] = 1;  // dense box, no sub-sampling
    if (d > 0) {
      const uint64_t bytes = view.strides[d] * tma_element_bytes(view.element);
      if (bytes == 0 || bytes % L::kAlignBytes != 0 || bytes >= L::kMaxStrideBytes)
        return Status::invalid(where + dim + " stride must be a nonzero multiple of 16 bytes below "
                               "2^40, got " + std::to_string(bytes) + " bytes");
      global_stride[d - 1] = bytes;
    }
  }
  const uint32_t box_row_bytes = view.box[0] * tma_element_bytes(view.element);
  if (box_row_bytes % L::kAlignBytes != 0)
    return Status::invalid(where + "box row must be a multiple of 16 bytes, got " +
                           std::to_string(box_row_bytes));
  const uint32_t span = tma_swizzle_span_bytes(view.swizzle);
  if (span != 0 && box_row_bytes > span)
    return Status::invalid(where + "box row of " + std::to_string(box_row_bytes) +
                           " bytes exceeds the " + std::to_string(span) + "-byte swizzle span");
  const EntryPoint& entry = encode_tiled_entry_point();
  if (entry.fn == nullptr) return Status::cuda(where + entry.error);
  const CUtensorMapDataType type = view.element == TmaElement::kBf16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : view.element == TmaElement::kFp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult rc = entry.fn(map, type, static_cast<cuuint32_t>(view.rank),
                               const_cast<void*>(view.base), global_dim, global_stride, box_dim,
                               element_stride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               to_cu_swizzle(view.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // out of bounds reads zero
  if (rc != CUDA_SUCCESS)
    return Status::cuda(where + "cuTensorMapEncodeTiled failed with CUresult " +
                        std::to_string(static_cast<int>(rc)));
  return Status::ok();
}

}  // namespace flashcore::cuda::sm90
