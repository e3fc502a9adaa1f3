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

/** The padded row of packed row r in DqTiles' layout (backward_workspace.hpp) and how many rows of
 *  its sequence start at r (r itself included); false when r lies in no sequence (varlen rows
 *  between or after the clamped sequences). Varlen calls find r's sequence by a binary search
 *  over the clamped starts (increasing for valid cu_seqlens_q; invalid ones still give an
 *  in-bounds row, DqTiles::rows_per_head). */
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
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    packed_rows(p.cu_seqlens_q, mid, p.total_q, p.seqlen_q, start, length);
    if (start <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  packed_rows(p.cu_seqlens_q, lo, p.total_q, p.seqlen_q, start, length);
  *padded_row = DqTiles::sequence_row0(start, lo) + (r - start);
  *rows_left = start + length - r;
  return r >= start && *rows_left > 0;
}

/** The sequence b holding padded row `padded_row` of DqTiles' layout, the row's index i inside it
 *  and the sequence's length; false for padding rows (past a sequence, before the next one's
 *  start). A binary search over b: sequence_row0 grows strictly with b for valid cu_seqlens_q
 *  (invalid ones give some sequence; i < length keeps the caller's dq writes inside it, the
 *  caller's item range its accumulator reads). */
__device__ __forceinline__ bool sequence_of_padded_row(const BackwardParams& p, int64_t padded_row, int64_t* b,
                                                       int64_t* start, int64_t* i, int64_t* length) {
  // Sequence `seq`'s first packed row (b * seqlen_q when dense), its length and its first padded row.
  auto locate = [&](int64_t seq, int64_t* first, int64_t* len) {
    if (p.cu_seqlens_q == nullptr) {
      *first = seq * p.seqlen_q;
      *len = p.seqlen_q;
    } else {
      packed_rows(p.cu_seqlens_q, seq, p.total_q, p.seqlen_q, *first, *len);
    }
    return DqTiles::sequence_row0(*first, seq);
  };
  if (p.batch <= 0) return false;  // a varlen call of no sequence
  int64_t lo = 0, hi = p.batch - 1, first = 0, len = 0;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (locate(mid, &first, &len) <= padded_row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  *b = lo;
  *i = padded_row - locate(lo, start, length);
  return *i >= 0 && *i < *length;
}

/** Lane `lane`'s four m16n8 fragment registers of a DqTiles tile (row lane / 4, columns
 *  2 (lane % 4) and + 1 in registers 0 / 1; row + 8 in registers 2 / 3): one 16-byte load with
 *  vector slots, four scalar ones with scalar slots (a warp's each on one 128-byte line). */
__device__ __forceinline__ float4 load_dq_fragment(const float* tile, int lane) {
  if constexpr (dq_vector_slots()) {
    return reinterpret_cast<const float4*>(tile)[lane];
  } else {
    return make_float4(tile[DqTiles::slot(lane, 0, false)], tile[DqTiles::slot(lane, 1, false)],
                       tile[DqTiles::slot(lane, 2, false)], tile[DqTiles::slot(lane, 3, false)]);
  }
}

/** Turns a quad's fragments of two adjacent tiles (a: columns c..c+7, b: c+8..c+15) into rows:
 *  quad lane q gets 8 consecutive values of one row, row g = lane / 4 (+ 8 when q >= 2) of tile
 *  a (q even) or b (q odd), in column order. Four rounds of shuffles inside the quad: in round t
 *  lane q reads quad lane (q + t) % 4, which sends what that reader wants (its two columns of the
 *  reader's row and tile). Selects on compile-time indices keep everything in registers. */
__device__ __forceinline__ void quad_fragments_to_row(const float4& a, const float4& b, int lane, float (&v)[8]) {
  const int q = lane & 3;
  const float2 mine[4] = {make_float2(a.x, a.y), make_float2(b.x, b.y), make_float2(a.z, a.w), make_float2(b.z, b.w)};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int reader = (q - t) & 3;  // the quad lane that reads this lane in round t
    float2 send = mine[0];
#pragma unroll
    for (int d = 1; d < 4; ++d) send = reader == d ? mine[d] : send;
    const int source = (q + t) & 3;  // the quad lane this lane reads: its columns 2 source, + 1
    const int source_lane = (lane & ~3) | source;
    const float x = __shfl_sync(0xffffffffu, send.x, source_lane);
    const float y = __shfl_sync(0xffffffffu, send.y, source_lane);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      v[2 * c] = source == c ? x : v[2 * c];
      v[2 * c + 1] = source == c ? y : v[2 * c + 1];
    }
  }
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
      *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq.data) + offset_of(p.dq, b, row, h) + col) =
          make_uint4(0u, 0u, 0u, 0u);
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
    const float s = p.softmax_scale;
    uint4 bits;
    bits.x = pack_pair<Element>(lo.x * s, lo.y * s);
    bits.y = pack_pair<Element>(lo.z * s, lo.w * s);
    bits.z = pack_pair<Element>(hi.x * s, hi.y * s);
    bits.w = pack_pair<Element>(hi.z * s, hi.w * s);
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq.data) + offset_of(p.dq, b, row, h) + chunk * kChunkElems) =
        bits;
  }
}

/** The postprocess for DqTiles' accumulator (the sm80 backward): a warp takes two adjacent tiles
 *  of one 16-row group and head (16 rows x 16 columns), reads them as its lanes' fragments (512
 *  contiguous bytes per tile), turns them into rows inside each quad (quad_fragments_to_row) and
 *  stores 16 B per lane: 32 contiguous bytes in each of 16 rows. Warps walk (group, head, tile
 *  pair), pairs fastest; a group's sequence comes from a binary search over the padded rows
 *  (sequence_of_padded_row); padding groups cost a warp each. Varlen rows of no sequence got
 *  their zeros in the preprocess. (A thread per row and chunk read 16-byte pieces of 32 tiles per
 *  warp instruction: 102 us at d128 causal 2k where rows took 78, session 52.) */
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_postprocess_tiles_kernel(const BackwardParams p,
                                                                                     BackwardWorkspacePtrs ws) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  static_assert(kHeadDim % (2 * DqTiles::kCols) == 0, "whole pairs of 8-column tiles per row");
  constexpr int kPairsPerRow = kHeadDim / (2 * DqTiles::kCols);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t groups_per_head = ws.dq_rows_per_head / DqTiles::kRows;
  const int64_t total = groups_per_head * p.heads_q * kPairsPerRow;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kPrepostWarps;
  const float s = p.softmax_scale;
  const bool varlen = p.cu_seqlens_q != nullptr;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kPrepostWarps + threadIdx.x / kWarpSize; item < total;
       item += warps) {
    const int pair = static_cast<int>(item % kPairsPerRow);
    const int64_t rest = item / kPairsPerRow;
    const int64_t h = rest % p.heads_q;
    const int64_t group_row = rest / p.heads_q * DqTiles::kRows;  // the group's first padded row
    const int col = pair * 2 * DqTiles::kCols;
    if (col >= p.head_dim) continue;  // columns of the bucket only (warp-uniform)
    int64_t b, start, i0, length;
    if (!sequence_of_padded_row(p, group_row, &b, &start, &i0, &length)) continue;  // padding (warp-uniform)
    const float* tile = ws.dq_accum + h * ws.dq_rows_per_head * kHeadDim + DqTiles::tile_offset(group_row, col, kHeadDim);
    const float4 a = load_dq_fragment(tile, lane);
    const float4 c = load_dq_fragment(tile + DqTiles::kElems, lane);
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    quad_fragments_to_row(a, c, lane, v);
    const int q = lane & 3;
    const int64_t i = i0 + lane / 4 + (q >= 2 ? 8 : 0);  // this lane's row in its sequence
    const int my_col = col + (q & 1) * DqTiles::kCols;
    if (i >= length || my_col >= p.head_dim) continue;
    uint4 bits;
    bits.x = pack_pair<Element>(v[0] * s, v[1] * s);
    bits.y = pack_pair<Element>(v[2] * s, v[3] * s);
    bits.z = pack_pair<Element>(v[4] * s, v[5] * s);
    bits.w = pack_pair<Element>(v[6] * s, v[7] * s);
    // Dense: batch entry b, row i; varlen: packed row start + i.
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dq.data) +
                              offset_of(p.dq, varlen ? 0 : b, varlen ? start + i : i, h) + my_col) = bits;
  }
}

}  // namespace flashcore::cuda::sm80::bwd
