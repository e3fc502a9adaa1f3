// Stage 1 and stage 3 of the sm80 backward: small memory-bound kernels around the main kernel.
//   preprocess : per (query row, query head): D = sum_d dO * O (fp32) and lse * log2(e) (with
//                lse = -inf mapped to +inf so that exp2(s - lse) is exactly 0) into the workspace,
//                and the row's dQ accumulator zeroed (when there is one; in DqTiles' layout only
//                the sequences' rows, not the padding rows of their last tiles).
//   postprocess: dq = softmax_scale * dQ_accum (fp32 workspace) converted to the element type.
//
// Relies on backward_common.cuh (workspace layout, element helpers). In the preprocess a row
// vector takes kHeadDim / 8 lanes, one 16-byte load of dO and of O each (so a warp serves 4 rows
// at d64, 2 at d128, 1 at d256), and consecutive lane groups take consecutive rows of one head:
// the lse reads, the statistics writes and the zeroing are contiguous. (One warp per row, heads
// fastest, read d64 rows with a quarter of the lanes and wrote the statistics total_q apart:
// 147 us where 45 us of bandwidth is the bound, for B=32 H=32 S=512 d64 on an H100.)
#pragma once

#include <algorithm>

#include "cuda/ptx/global_store.cuh"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/sm80/backward_common.cuh"

namespace flashcore::cuda::sm80::bwd {

constexpr int kPrepostThreads = 256;
constexpr int kPrepostWarps = kPrepostThreads / kWarpSize;

/** (packed row r, head h) -> batch index and tensor row: dense rows are b * seqlen_q + i. */
__device__ __forceinline__ void split_packed_row(const BackwardParams& p, int64_t r, int64_t* b, int64_t* row) {
  if (p.cu_seqlens_q != nullptr) {
    *b = 0;  // varlen tensors have batch_stride 0 and packed rows
    *row = r;
  } else {
    *b = r / p.seqlen_q;
    *row = r - *b * p.seqlen_q;
  }
}

/** Sequence `seq`'s first packed row and its length (dense: seq * seqlen_q and seqlen_q). */
__device__ __forceinline__ void sequence_rows(const BackwardParams& p, int64_t seq, int64_t* first, int64_t* length) {
  if (p.cu_seqlens_q == nullptr) {
    *first = seq * p.seqlen_q;
    *length = p.seqlen_q;
  } else {
    packed_rows(p.cu_seqlens_q, seq, p.total_q, p.seqlen_q, *first, *length);
  }
}

/** The last sequence b (batch > 0) with start_of(its first packed row, b) <= value, and that
 *  sequence's first packed row and length: a binary search, the starts growing with b for valid
 *  cu_seqlens_q (invalid ones still give some sequence of the call). */
template <typename StartOf>
__device__ __forceinline__ int64_t last_sequence_starting_by(const BackwardParams& p, int64_t value, StartOf start_of,
                                                             int64_t* first, int64_t* length) {
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    sequence_rows(p, mid, first, length);
    if (start_of(*first, mid) <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  sequence_rows(p, lo, first, length);
  return lo;
}

/** The padded row of packed row r in DqTiles' layout (backward_workspace.hpp) and how many rows of
 *  its sequence start at r (r itself included); false when r lies in no sequence (varlen rows
 *  between or after the clamped sequences). Varlen calls find r's sequence by a binary search
 *  over the clamped starts (invalid cu_seqlens_q still give an in-bounds row,
 *  DqTiles::rows_per_head). */
__device__ __forceinline__ bool dq_tile_row_of(const BackwardParams& p, int64_t r, int64_t* padded_row,
                                               int64_t* rows_left) {
  if (p.cu_seqlens_q == nullptr) {
    const int64_t b = r / p.seqlen_q;
    *padded_row = DqTiles::sequence_row0(b * p.seqlen_q, b) + (r - b * p.seqlen_q);
    *rows_left = (b + 1) * p.seqlen_q - r;
    return true;
  }
  if (p.batch <= 0) return false;  // a varlen call of no sequence (cu_seqlens_q has one entry)
  int64_t start = 0, length = 0;
  const int64_t b = last_sequence_starting_by(p, r, [](int64_t first, int64_t) { return first; }, &start, &length);
  *padded_row = DqTiles::sequence_row0(start, b) + (r - start);
  *rows_left = start + length - r;
  return r >= start && *rows_left > 0;
}

/** The sequence b holding padded row `padded_row` of DqTiles' layout, the row's index i inside it,
 *  the sequence's first packed row and its length; false for padding rows (past a sequence, before
 *  the next one's start). Sequences start at strictly growing padded rows for valid cu_seqlens_q
 *  (invalid ones give some sequence; i < length keeps the caller's dq writes inside it, the
 *  caller's item range its accumulator reads). */
__device__ __forceinline__ bool sequence_of_padded_row(const BackwardParams& p, int64_t padded_row, int64_t* b,
                                                       int64_t* start, int64_t* i, int64_t* length) {
  if (p.batch <= 0) return false;  // a varlen call of no sequence
  *b = last_sequence_starting_by(
      p, padded_row, [](int64_t first, int64_t seq) { return DqTiles::sequence_row0(first, seq); }, start, length);
  *i = padded_row - DqTiles::sequence_row0(*start, *b);
  return *i >= 0 && *i < *length;
}

/** Rows g and g + 8 (g < 8) of a 16 x 8 DqTiles tile, in column order. Both rows' values sit in
 *  lanes 4g..4g+3 (column c in lane 4g + c / 2): with vector slots those lanes' four registers
 *  are 64 contiguous bytes (row g's pair of columns, then row g + 8's), with scalar slots each
 *  register is a float4 over the four lanes (row g's even columns, its odd ones, then row g + 8's),
 *  so a thread that takes both rows reads whole 16-byte pieces either way. */
__device__ __forceinline__ void load_dq_tile_rows(const float* tile, int g, float (&lo)[8], float (&hi)[8]) {
  const float4* src = reinterpret_cast<const float4*>(tile);
  if constexpr (dq_vector_slots()) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 x = src[4 * g + j];  // lane 4g + j: columns 2j, 2j + 1
      lo[2 * j] = x.x, lo[2 * j + 1] = x.y, hi[2 * j] = x.z, hi[2 * j + 1] = x.w;
    }
  } else {
    const float4 e0 = src[g], o0 = src[8 + g], e1 = src[16 + g], o1 = src[24 + g];  // register k: float4 8k + g
    lo[0] = e0.x, lo[1] = o0.x, lo[2] = e0.y, lo[3] = o0.y, lo[4] = e0.z, lo[5] = o0.z, lo[6] = e0.w, lo[7] = o0.w;
    hi[0] = e1.x, hi[1] = o1.x, hi[2] = e1.y, hi[3] = o1.y, hi[4] = e1.z, hi[5] = o1.z, hi[6] = e1.w, hi[7] = o1.w;
  }
}

/** dq's chunk of 8 elements at `dst` = s * v, converted (one 16-byte store: ptx/global_store.cuh). */
template <typename Element>
__device__ __forceinline__ void store_scaled_chunk(Element* dst, const float (&v)[8], float s) {
  ptx::store_global_v4(dst, pack_pair<Element>(v[0] * s, v[1] * s), pack_pair<Element>(v[2] * s, v[3] * s),
                       pack_pair<Element>(v[4] * s, v[5] * s), pack_pair<Element>(v[6] * s, v[7] * s));
}

template <int kHeadDim>
struct PreprocessShape {
  static constexpr int kLanesPerRow = kHeadDim / kChunkElems;
  static_assert(kLanesPerRow <= kWarpSize && kWarpSize % kLanesPerRow == 0, "whole rows per warp");
  static constexpr int kRowsPerWarp = kWarpSize / kLanesPerRow;
  static constexpr int kRowsPerBlock = kRowsPerWarp * kPrepostWarps;
};

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_preprocess_kernel(const BackwardParams p,
                                                                              BackwardWorkspacePtrs ws) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  using Shape = PreprocessShape<kHeadDim>;
  const int lane = threadIdx.x % kWarpSize;
  const int sub = lane % Shape::kLanesPerRow;  // this lane's 16-byte chunk of the row
  // item = h * total_q + r, the row's index in the statistics (and, times kHeadDim, in dQ_accum).
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * kPrepostWarps + threadIdx.x / kWarpSize) *
                           Shape::kRowsPerWarp + lane / Shape::kLanesPerRow;
  const bool valid = item < p.total_q * p.heads_q;
  const int col = sub * kChunkElems;
  int64_t h = 0, r = 0, b = 0, row = 0;
  float dot = 0.f;
  if (valid) {
    h = item / p.total_q;
    r = item - h * p.total_q;
    split_packed_row(p, r, &b, &row);
    if (col < p.head_dim) {  // head_dim is a multiple of 8: whole chunks only
      const uint4 dout_bits = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.dout.data) +
                                                              offset_of(p.dout, b, row, h) + col);
      const uint4 out_bits =
          *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.out.data) + offset_of(p.out, b, row, h) + col);
      const Element* dout_elems = reinterpret_cast<const Element*>(&dout_bits);
      const Element* out_elems = reinterpret_cast<const Element*>(&out_bits);
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e) dot += to_float(dout_elems[e]) * to_float(out_elems[e]);
    }
    // The accumulator's flat rows [flat, flat_end) of this head are zeroed, the bucket's whole
    // width (padding columns included). Row-major: the row itself. DqTiles: a 16-row group's
    // tiles fill its 16 flat rows, so zeroing the group as flat rows zeroes it whatever the slot
    // order, with the same coalesced stores; the row ending a sequence also zeroes the flat rows
    // of its group past it (padding rows have no item of their own; their floats hold other rows'
    // values).
    int64_t flat = 0, flat_end = 0, padded_row = 0, rows_left = 0;
    if (ws.dq_accum != nullptr && !ws.dq_tiled) {
      flat = r;
      flat_end = r + 1;
    } else if (ws.dq_accum != nullptr && dq_tile_row_of(p, r, &padded_row, &rows_left)) {
      flat = padded_row;
      flat_end = rows_left > 1 ? padded_row + 1 : (padded_row / DqTiles::kRows + 1) * DqTiles::kRows;
    } else if (ws.dq_accum != nullptr && p.cu_seqlens_q != nullptr && col < p.head_dim &&
               r >= p.cu_seqlens_q[0] && r < p.cu_seqlens_q[p.batch]) {
      // DqTiles, a varlen row of no (clamped) sequence inside [cu_seqlens_q[0], cu_seqlens_q[batch]):
      // its dq is 0, written here because the tiled postprocess walks the sequences' rows only.
      ptx::store_global_v4(static_cast<Element*>(p.dq.data) + offset_of(p.dq, b, row, h) + col, 0u, 0u, 0u, 0u);
    }
    for (; flat < flat_end; ++flat) {
      float4* dst = reinterpret_cast<float4*>(ws.dq_accum + (h * ws.dq_rows_per_head + flat) * kHeadDim + col);
      dst[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // Butterfly reduction inside the lane group: a fixed order, so D is bit-reproducible. Every lane
  // takes part (full mask); an invalid item's lanes add zeros and write nothing.
#pragma unroll
  for (int offset = Shape::kLanesPerRow / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (valid && sub == 0) {
    const float lse = p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + row * p.lse.row_stride];
    ws.dsum[item] = dot;
    ws.lse_log2[item] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

/** The postprocess for the row-major accumulator (the Hopper backward's, whose TMA reductions
 *  write row-major boxes): a thread per (sequence row, head, 8-column chunk). */
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_postprocess_kernel(const BackwardParams p,
                                                                               BackwardWorkspacePtrs ws) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  const int64_t chunks_per_row = (p.head_dim + kChunkElems - 1) / kChunkElems;
  // Varlen: only the sequences' rows, [cu_seqlens_q[0], cu_seqlens_q[batch]) (clamped into the
  // tensor). The packed dq's other rows belong to the caller (a preallocated buffer's tail), as
  // in every other backend.
  int64_t first_row = 0, end_row = p.total_q;
  if (p.cu_seqlens_q != nullptr) {
    first_row = std::min<int64_t>(std::max<int64_t>(p.cu_seqlens_q[0], 0), p.total_q);
    end_row = std::min<int64_t>(std::max<int64_t>(p.cu_seqlens_q[p.batch], first_row), p.total_q);
  }
  const int64_t total = (end_row - first_row) * p.heads_q * chunks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total; item += stride) {
    const int64_t chunk = item % chunks_per_row;
    const int64_t rh = item / chunks_per_row;
    const int64_t r = first_row + rh / p.heads_q;
    const int64_t h = rh % p.heads_q;
    int64_t b;
    int64_t row;
    split_packed_row(p, r, &b, &row);
    const float4* src = reinterpret_cast<const float4*>(ws.dq_accum + ((h * p.total_q + r) * kChunksPerRow + chunk) *
                                                                          kChunkElems);
    const float4 lo = src[0];
    const float4 hi = src[1];
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    store_scaled_chunk<Element>(static_cast<Element*>(p.dq.data) + offset_of(p.dq, b, row, h) + chunk * kChunkElems, v,
                                p.softmax_scale);
  }
}

/** The postprocess for DqTiles' accumulator (the sm80 backward): a thread per (leader row, head,
 *  8-column chunk), leaders fastest. Leaders are the padded rows g < 8 of each 16-row group; the
 *  thread converts rows g and g + 8 from 64 contiguous bytes of the tile (load_dq_tile_rows), so
 *  no thread idles but those of padding rows. A leader's sequence comes from a binary search over
 *  the padded rows (sequence_of_padded_row). Varlen rows of no sequence got their zeros in the
 *  preprocess. (Earlier forms, d128 causal 2k on an H200: a thread per packed row with the g >= 8
 *  ones idle, 92 us; a warp per pair of tiles with quad shuffles, 109 us; this one with the chunks
 *  fastest and the heads next, 88 us, and 3.18 TB/s under ncu where the first read 2.42
 *  (docs/PERF.md, session 53), each warp reading 64 of every 512 bytes of 16 tiles. Leaders
 *  fastest, a warp reads four whole tiles in order: training steps +0.2% to +1.0%, session 57.) */
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_postprocess_tiles_kernel(const BackwardParams p,
                                                                                     BackwardWorkspacePtrs ws) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kLeadersPerGroup = DqTiles::kRows / 2;
  const int64_t groups_per_head = ws.dq_rows_per_head / DqTiles::kRows;
  const int64_t total = groups_per_head * p.heads_q * kChunksPerRow * kLeadersPerGroup;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool varlen = p.cu_seqlens_q != nullptr;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total; item += stride) {
    // Leader fastest, then the chunk, the 16-row group, the head: the 8 leaders of a tile read its
    // 512 bytes together and a warp four consecutive tiles, so the accumulator streams in order.
    const int g = static_cast<int>(item % kLeadersPerGroup);
    const int64_t rest = item / kLeadersPerGroup;
    const int col = static_cast<int>(rest % kChunksPerRow) * kChunkElems;
    const int64_t head_group = rest / kChunksPerRow;  // h * groups_per_head + the 16-row group
    const int64_t h = head_group / groups_per_head;
    const int64_t padded_row = (head_group - h * groups_per_head) * DqTiles::kRows + g;
    if (col >= p.head_dim) continue;  // columns of the bucket only
    int64_t b, start, i, length;
    if (!sequence_of_padded_row(p, padded_row, &b, &start, &i, &length)) continue;  // padding
    float lo[8], hi[8];
    load_dq_tile_rows(ws.dq_accum + h * ws.dq_rows_per_head * kHeadDim + DqTiles::tile_offset(padded_row, col, kHeadDim),
                      g, lo, hi);
    // Dense: batch entry b, row i; varlen: packed row start + i.
    const int64_t dq_b = varlen ? 0 : b;
    const int64_t dq_row = varlen ? start + i : i;
    Element* dq = static_cast<Element*>(p.dq.data) + col;
    store_scaled_chunk<Element>(dq + offset_of(p.dq, dq_b, dq_row, h), lo, p.softmax_scale);
    if (i + 8 < length) store_scaled_chunk<Element>(dq + offset_of(p.dq, dq_b, dq_row + 8, h), hi, p.softmax_scale);
  }
}

}  // namespace flashcore::cuda::sm80::bwd
