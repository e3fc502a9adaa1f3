// How the Hopper kernels see the caller's attention tensors through TMA: the 4-D view
// (head_dim, rows, heads, batch) a tensor map is encoded from, and whether a tensor's pointer and
// strides can be described that way at all. Host-only; shared by the forward and the backward.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "api/params.hpp"
#include "api/status.hpp"
#include "cuda/sm90/tensor_map.hpp"

namespace flashcore::cuda::sm90 {

constexpr int64_t kTmaAlignElems = 8;  // TMA: base and outer strides multiples of 16 bytes
constexpr uint32_t kTmaChunkCols = 64;  // one box spans 64 columns: the 128-byte swizzle span

/** The TMA element type of a kernel's 16-bit element type (__nv_bfloat16 or __half). */
template <typename Element>
constexpr TmaElement tma_element_of() {
  return std::is_same_v<Element, __nv_bfloat16> ? TmaElement::kBf16 : TmaElement::kFp16;
}

/** validate_for_backend already demands 16-byte pointers and strides that are multiples of 8
 *  elements, but only for dimensions longer than 1. The 4-D tensor map encodes the head stride
 *  even for a single head, so this checks it (and the batch stride where it is used) too; a call
 *  that fails here is served by sm80 under AUTO. */
inline bool tma_addressable(const TensorRef& t, bool varlen, int64_t batch) {
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  if (base % (kTmaAlignElems * 2) != 0) return false;
  if (t.row_stride % kTmaAlignElems != 0 || t.row_stride <= 0) return false;
  if (t.head_stride % kTmaAlignElems != 0 || t.head_stride <= 0) return false;
  if (!varlen && batch > 1 && (t.batch_stride % kTmaAlignElems != 0 || t.batch_stride <= 0)) return false;
  return true;
}

/** The 4-D view TMA reads a q/k/v/dout tensor through: (head_dim, rows, heads, batch). Varlen
 *  tensors are one batch of packed rows; a box is 64 columns x box_rows rows of one head. */
inline TiledViewNd attention_view(const TensorRef& t, TmaElement element, int64_t rows, int64_t heads,
                                  int64_t batch, int64_t head_dim, bool varlen, uint32_t box_rows) {
  TiledViewNd v;
  v.base = t.data;
  v.element = element;
  v.rank = 4;
  v.dims[0] = static_cast<uint64_t>(head_dim);
  v.dims[1] = static_cast<uint64_t>(rows);
  v.dims[2] = static_cast<uint64_t>(heads);
  v.dims[3] = varlen ? 1 : static_cast<uint64_t>(batch);
  v.strides[0] = 1;
  v.strides[1] = static_cast<uint64_t>(t.row_stride);
  v.strides[2] = static_cast<uint64_t>(t.head_stride);
  // A batch of one never steps its stride; any legal value does.
  v.strides[3] = varlen || batch == 1 ? static_cast<uint64_t>(t.row_stride)
                                      : static_cast<uint64_t>(t.batch_stride);
  v.box[0] = kTmaChunkCols;
  v.box[1] = box_rows;
  v.box[2] = 1;
  v.box[3] = 1;
  v.swizzle = TmaSwizzle::k128B;
  return v;
}

/** The 5-D view of a q / out tensor whose query heads are packed by GQA group (the forward's
 *  pack-GQA kernels): (head_dim, group, rows, heads_kv, batch), so that a box of {64, group,
 *  box_rows / group, 1, 1} is box_rows packed rows of one KV head's group, row j * group + i
 *  being query head kv_head * group + i of token row0 + j (tma_load_5d). */
inline TiledViewNd packed_group_view(const TensorRef& t, TmaElement element, int64_t rows, int64_t heads_kv,
                                     int64_t group, int64_t batch, int64_t head_dim, bool varlen,
                                     uint32_t box_rows) {
  TiledViewNd v = attention_view(t, element, rows, heads_kv * group, batch, head_dim, varlen, box_rows);
  v.rank = 5;
  v.dims[1] = static_cast<uint64_t>(group);
  v.dims[2] = static_cast<uint64_t>(rows);
  v.dims[3] = static_cast<uint64_t>(heads_kv);
  v.dims[4] = varlen ? 1 : static_cast<uint64_t>(batch);
  v.strides[1] = static_cast<uint64_t>(t.head_stride);
  v.strides[2] = static_cast<uint64_t>(t.row_stride);
  v.strides[3] = static_cast<uint64_t>(t.head_stride * group);
  v.strides[4] = varlen || batch == 1 ? static_cast<uint64_t>(t.row_stride) : static_cast<uint64_t>(t.batch_stride);
  v.box[1] = static_cast<uint32_t>(group);
  v.box[2] = box_rows / static_cast<uint32_t>(group);
  v.box[3] = 1;
  v.box[4] = 1;
  return v;
}

/** One tensor map a launcher needs: which tensor, how many rows and heads its view has, and the
 *  rows of one box. group > 1: q / out with each KV head's query heads packed (packed_group_view;
 *  `heads` then counts KV heads). */
struct AttentionMapJob {
  const char* name;  // the argument name errors report
  const TensorRef* tensor;
  int64_t rows, heads;
  uint32_t box_rows;
  CUtensorMap* map;
  int64_t group = 1;
};

/** Encodes every job's map over attention_view (packed_group_view for a group > 1); a tensor with
 *  no rows gets none (it is never read). A failure names the tensor and `what` (the kernel). */
inline Status encode_attention_maps(const AttentionMapJob* jobs, int count, TmaElement element, int64_t batch,
                                    int64_t head_dim, bool varlen, const char* what) {
  for (int i = 0; i < count; ++i) {
    const AttentionMapJob& job = jobs[i];
    if (job.rows == 0) continue;
    const TiledViewNd view =
        job.group > 1 ? packed_group_view(*job.tensor, element, job.rows, job.heads, job.group, batch, head_dim, varlen,
                                          job.box_rows)
                      : attention_view(*job.tensor, element, job.rows, job.heads, batch, head_dim, varlen, job.box_rows);
    const Status s = encode_tensor_map_nd(view, job.map);
    if (!s.is_ok()) return Status{s.code, std::string(job.name) + ": " + what + ": " + s.message};
  }
  return Status::ok();
}

}  // namespace flashcore::cuda::sm90
