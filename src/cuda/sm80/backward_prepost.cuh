// Stage 1 and stage 3 of the sm80 backward: small memory-bound kernels around the main kernel.
//   preprocess : per (query row, query head): D = sum_d dO * O (fp32) and lse * log2(e) (with
//                lse = -inf mapped to +inf so that exp2(s - lse) is exactly 0) into the workspace.
//   postprocess: dq = softmax_scale * dQ_accum (fp32 workspace) converted to the element type.
//
// Relies on backward_common.cuh (workspace layout, element helpers). One warp per row vector in
// the preprocess: head dims up to 256 = 32 lanes x 8 elements, one 16-byte load per lane.
#pragma once

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

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_preprocess_kernel(const BackwardParams p,
                                                                              BackwardWorkspacePtrs ws) {
  static_assert(kHeadDim <= kWarpSize * kChunkElems, "one 16-byte chunk per lane");
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kPrepostWarps + threadIdx.x / kWarpSize;
  if (item >= p.total_q * p.heads_q) return;
  const int64_t r = item / p.heads_q;
  const int64_t h = item - r * p.heads_q;
  int64_t b;
  int64_t row;
  split_packed_row(p, r, &b, &row);

  float dot = 0.f;
  const int col = lane * kChunkElems;
  if (col < p.head_dim) {  // head_dim is a multiple of 8: whole chunks only
    const uint4 dout_bits =
        *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.dout.data) + offset_of(p.dout, b, row, h) + col);
    const uint4 out_bits =
        *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.out.data) + offset_of(p.out, b, row, h) + col);
    const Element* dout_elems = reinterpret_cast<const Element*>(&dout_bits);
    const Element* out_elems = reinterpret_cast<const Element*>(&out_bits);
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) dot += to_float(dout_elems[e]) * to_float(out_elems[e]);
  }
  // Butterfly reduction: a fixed order, so D is bit-reproducible.
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0) {
    const float lse = p.lse.data[b * p.lse.batch_stride + h * p.lse.head_stride + row * p.lse.row_stride];
    const int64_t stat = h * p.total_q + r;
    ws.dsum[stat] = dot;
    ws.lse_log2[stat] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) backward_postprocess_kernel(const BackwardParams p,
                                                                               BackwardWorkspacePtrs ws) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  const int64_t chunks_per_row = (p.head_dim + kChunkElems - 1) / kChunkElems;
  const int64_t total = p.total_q * p.heads_q * chunks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total; item += stride) {
    const int64_t chunk = item % chunks_per_row;
    const int64_t rh = item / chunks_per_row;
    const int64_t r = rh / p.heads_q;
    const int64_t h = rh - r * p.heads_q;
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

}  // namespace flashcore::cuda::sm80::bwd
