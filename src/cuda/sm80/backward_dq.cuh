// Deterministic dQ for the sm80 backward: one CTA per (query block, query head, batch) walks the
// key blocks its rows can see in increasing order, recomputes P and dS for each (the same code
// as the main kernel, backward_scores.cuh) and accumulates dQ = dS K in registers. No atomics:
// the summation order is fixed, so dq is bit-identical run to run. Costs the S and dP GEMMs a
// second time; used only when BackwardParams::deterministic is set (the main kernel then skips
// its dQ atomics).
//
// Relies on backward_scores.cuh and on the preprocess having filled lse_log2 / dsum.
#pragma once

#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/sm80/backward_scores.cuh"
#include "cuda/sm80/grid_order.hpp"

namespace flashcore::cuda::sm80::bwd {

template <typename Element, typename Traits>
struct alignas(128) DqSharedStorage {
  Element q[Traits::kBlockM * Traits::kHeadDim];  // reused for the dq epilogue
  Element dout[Traits::kBlockM * Traits::kHeadDim];
  Element k[Traits::kBlockN * Traits::kHeadDim];
  Element v[Traits::kBlockN * Traits::kHeadDim];
  Element ds[Traits::kBlockM * Traits::kBlockN];
  float lse_log2[Traits::kBlockM];
  float dsum[Traits::kBlockM];
};

/** kAlibi: the ALiBi version, kDropout: the dropout version (kernels of their own, as
 *  backward_dkdv_kernel's). */
template <typename Element, typename Traits, bool kAlibi = false, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    backward_dq_kernel(const BackwardParams p, BackwardWorkspacePtrs ws, GridOrder order) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  using Smem = DqSharedStorage<Element, Traits>;
  constexpr int kM = Traits::kBlockM;
  constexpr int kN = Traits::kBlockN;
  constexpr int kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  // Query block fastest, the last (costliest under a causal mask) first; the grid's tail in order
  // of falling cost across its (batch, head) pairs (grid_order.hpp).
  const GridPosition position = grid_position</*kHeaviestLast=*/true>(order, static_cast<int>(blockIdx.x));
  const int m_block = position.block;
  const int64_t head_batch = position.pair;
  const int64_t h = head_batch % p.heads_q;
  const int64_t b = head_batch / p.heads_q;
  const int64_t kv_head = h / (p.heads_q / p.heads_kv);

  const SeqInfo seq = seq_info(p, b);
  const int64_t m0 = static_cast<int64_t>(m_block) * kM;
  if (m0 >= seq.seqlen_q) return;
  const MaskInfo mask = mask_info(p, seq);
  const int64_t rows_left = seq.seqlen_q - m0;
  const int rows_valid = static_cast<int>(rows_left < kM ? rows_left : kM);
  const int head_dim = static_cast<int>(p.head_dim);
  const ScoreTransform tf = ScoreTransform::make(p);
  const float alibi_log2 = kAlibi ? ScoreTransform::alibi_log2(p, b, h) : 0.f;
  const DropoutTile drop{&p.dropout, static_cast<uint32_t>(b * p.heads_q + h)};  // below 2^32 (validate.cpp)

  const int64_t q_off = offset_of(p.q, b, seq.q_start + m0, h);
  const int64_t do_off = offset_of(p.dout, b, seq.q_start + m0, h);
  load_tile_async<Element, kM, kD, kThreads>(smem.q, static_cast<const Element*>(p.q.data) + q_off, p.q.row_stride,
                                             rows_valid, head_dim, tid);
  load_tile_async<Element, kM, kD, kThreads>(smem.dout, static_cast<const Element*>(p.dout.data) + do_off,
                                             p.dout.row_stride, rows_valid, head_dim, tid);
  const int64_t stat = h * p.total_q + first_packed_q_row(p, b, seq) + m0;
  load_row_stats_async<kM>(smem.lse_log2, ws.lse_log2 + stat, rows_valid, tid);
  load_row_stats_async<kM>(smem.dsum, ws.dsum + stat, rows_valid, tid);

  // Keys any row of this block may see (mask.hpp); empty when none: dq stays 0.
  const KeyRange keys = mask.keys_for_rows(m0, m0 + rows_valid);
  const int64_t n_block_begin = keys.begin / kN;
  const int64_t n_block_end = keys.empty() ? n_block_begin : (keys.end + kN - 1) / kN;

  float dq_acc[Traits::kDqMTiles][Traits::kDqNTiles][4];
  zero_fill(dq_acc);
  const int dq_row_origin = (warp / Traits::kDqWarpsD) * Traits::kDqWarpRows;
  const int dq_col_origin = (warp % Traits::kDqWarpsD) * Traits::kDqWarpCols;

  for (int64_t n_block = n_block_begin; n_block < n_block_end; ++n_block) {
    const int64_t n0 = n_block * kN;
    const int64_t keys_left = seq.seqlen_k - n0;
    const int keys_valid = static_cast<int>(keys_left < kN ? keys_left : kN);
    const int64_t k_off = offset_of(p.k, b, seq.k_start + n0, kv_head);
    const int64_t v_off = offset_of(p.v, b, seq.k_start + n0, kv_head);
    // The previous iteration ended with a barrier, so K/V/dS may be overwritten.
    load_tile_async<Element, kN, kD, kThreads>(smem.k, static_cast<const Element*>(p.k.data) + k_off,
                                               p.k.row_stride, keys_valid, head_dim, tid);
    load_tile_async<Element, kN, kD, kThreads>(smem.v, static_cast<const Element*>(p.v.data) + v_off,
                                               p.v.row_stride, keys_valid, head_dim, tid);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();
    compute_p_and_ds<Element, Traits, /*kStoreP=*/false, kAlibi, kDropout>(smem.q, smem.dout, smem.k, smem.v,
                                                                       smem.lse_log2, smem.dsum, tf, mask, m0, n0,
                                                                       nullptr, smem.ds, warp, lane, alibi_log2, drop);
    __syncthreads();
    // dq += dS K: A = dS stored [m][n]; B = K stored [n][d] = [k][n], read transposed.
    warp_gemm<Element, Traits::kDqMTiles, Traits::kDqNTiles, kN / 16, false, true, kN, kD>(
        dq_acc, smem.ds, dq_row_origin, 0, smem.k, dq_col_origin, 0, lane);
    __syncthreads();
  }

  // Epilogue through the Q tile (free now; the wait covers the case of no key block at all).
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncthreads();
  store_fragments_to_smem<Element, kD>(dq_acc, p.softmax_scale, smem.q, dq_row_origin, dq_col_origin, lane);
  __syncthreads();
  const int64_t dq_off = offset_of(p.dq, b, seq.q_start + m0, h);
  store_tile<Element, kM, kD, kThreads>(smem.q, static_cast<Element*>(p.dq.data) + dq_off, p.dq.row_stride,
                                        rows_valid, head_dim, tid);
}

}  // namespace flashcore::cuda::sm80::bwd
