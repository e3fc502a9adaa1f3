// Copy of paged K/V into packed varlen rows (paged_gather.hpp). One CTA copies kRowsPerBlock key
// rows of one sequence, K and V, in 16-byte vectors; the page of each row comes from kv_offset
// (api/params.hpp), the same addressing and clamps as the kernels that read pages directly.
#include "cuda/paged_gather.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/scoped_device.hpp"

namespace flashcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 8;
constexpr int kVecElems = 8;        // 2-byte elements per 16-byte vector
constexpr size_t kAlign = 256;      // each buffer's start in the workspace
constexpr int64_t kElemBytes = 2;  // fp16 / bf16
// The rows after the last sequence stay as the workspace had them (NaN included): a key block
// reaching past a sequence's end reads them, and the sm90 kernels zero such rows in shared
// memory themselves (sm90/tail_rows.cuh), as for any packed varlen call.

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int64_t packed_rows_bound(const AttentionParams& p) { return p.batch * p.seqlen_k; }

size_t buffer_bytes(const AttentionParams& p) {
  return align_up(size_t(packed_rows_bound(p)) * size_t(p.heads_kv * p.head_dim * kElemBytes));
}

/** Block = (sequence b, rows [chunk * kRowsPerBlock, +kRowsPerBlock)), blocks numbered b-major;
 *  warp w copies row w of the chunk, K then V: the row's page is placed once (kv_offset), then the
 *  lanes stream its heads x head_dim elements in 16-byte vectors. (A thread per vector that placed
 *  its own row and head with 64-bit divisions ran the copy at ~0.75 TB/s, session 27.) */
__global__ void __launch_bounds__(kThreads) gather_kernel(AttentionParams paged, AttentionParams packed,
                                                          int64_t chunks_per_seq) {
  constexpr int kWarp = 32;
  static_assert(kThreads / kWarp == kRowsPerBlock, "a warp per row");
  const int64_t b = blockIdx.x / chunks_per_seq;
  const int64_t j = (blockIdx.x - b * chunks_per_seq) * kRowsPerBlock + threadIdx.x / kWarp;
  const SeqInfo from = seq_info(paged, b);  // k_start 0, length within the pages
  const SeqInfo to = seq_info(packed, b);   // start and length within the packed bound
  if (j >= min(from.seqlen_k, to.seqlen_k)) return;
  const int lane = threadIdx.x % kWarp;
  const int chunks = static_cast<int>(paged.head_dim / kVecElems);  // vectors per head
  const int vecs = static_cast<int>(paged.heads_kv) * chunks;       // per row (heads_kv * head_dim < 2^31)
  for (int t = 0; t < 2; ++t) {
    const TensorRef& src = t ? paged.v : paged.k;
    const TensorRef& dst = t ? packed.v : packed.k;
    const char* s = static_cast<const char*>(src.data) + kv_offset(paged, src, b, j, 0) * kElemBytes;
    char* d = static_cast<char*>(dst.data) + offset_of(dst, 0, to.k_start + j, 0) * kElemBytes;
#pragma unroll 4
    for (int v = lane; v < vecs; v += kWarp) {
      const int h = v / chunks, c = v - h * chunks;
      const uint4 x = *reinterpret_cast<const uint4*>(s + (h * src.head_stride + c * kVecElems) * kElemBytes);
      *reinterpret_cast<uint4*>(d + (h * dst.head_stride + c * kVecElems) * kElemBytes) = x;
    }
  }
}

}  // namespace

size_t paged_gather_bytes(const AttentionParams& p) { return p.is_paged() ? 2 * buffer_bytes(p) : 0; }

Status gather_pages(const AttentionParams& p, void* workspace, AttentionParams* packed) {
  *packed = p;
  packed->pages = KvPages{};
  packed->total_k = packed_rows_bound(p);
  char* base = static_cast<char*>(workspace);
  const int64_t row_stride = p.heads_kv * p.head_dim;
  packed->k = {base, 0, row_stride, p.head_dim};
  packed->v = {base + buffer_bytes(p), 0, row_stride, p.head_dim};
  const int64_t chunks = (p.seqlen_k + kRowsPerBlock - 1) / kRowsPerBlock;
  if (p.batch == 0 || packed->total_k == 0) return Status::ok();
  const int64_t blocks = p.batch * chunks;
  if (blocks > INT32_MAX) return Status::unsupported("block_table: too many key rows to gather for the packed kernels");
  const ScopedDevice on_device(p.device_id);
  gather_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p, *packed,
                                                                                                   chunks);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status::cuda(std::string("block_table: the page gather failed to launch: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace flashcore::cuda
