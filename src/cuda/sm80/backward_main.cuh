// Stage 2 of the sm80 backward: one CTA per (key block, KV head, batch) accumulates dK and dV for
// its kBlockN keys in registers over every query head of the KV head's group and every query
// block that can see those keys; in the default (non-deterministic) mode it also adds
// dS K into the fp32 dQ accumulator with atomics. No atomics touch dK/dV, so GQA needs no
// extra workspace and dK/dV are reproducible in both modes.
//
// Relies on backward_scores.cuh (tile recomputation), backward_common.cuh (GEMM, tiles) and the
// preprocess having filled lse_log2 / dsum (and zeroed dq_accum) in the workspace.
#pragma once

#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/sm80/backward_scores.cuh"
#include "cuda/sm80/backward_trace.cuh"
#include "cuda/sm80/grid_order.hpp"

namespace flashcore::cuda::sm80::bwd {

template <typename Element, typename Traits>
struct alignas(128) MainSharedStorage {
  Element k[Traits::kBlockN * Traits::kHeadDim];  // reused for the dK epilogue
  Element v[Traits::kBlockN * Traits::kHeadDim];  // reused for the dV epilogue
  Element q[Traits::kStages][Traits::kBlockM * Traits::kHeadDim];
  Element dout[Traits::kStages][Traits::kBlockM * Traits::kHeadDim];
  Element p[Traits::kBlockM * Traits::kBlockN];
  Element ds[Traits::kBlockM * Traits::kBlockN];
  float lse_log2[Traits::kStages][Traits::kBlockM];
  float dsum[Traits::kStages][Traits::kBlockM];
};

/** The order of a step's parts in the plain dK / dV kernel (no ALiBi, no dropout), per tile
 *  configuration, from an H200 A/B of each against the shipped order (docs/PERF.md, session 54):
 *  - kLatePrefetch: the next query block's Q / dO / statistics copies are issued after this
 *    step's S and dP GEMMs instead of right after the step's first barrier, where every warp
 *    computed ~230 instructions of addresses with the tensor pipes idle: +1.0% to +1.3% at
 *    d = 128; at d = 256 (twice the copies) it spilled in the loop and lost 4.5%, at d = 64 -0.4%.
 *  - kEarlyP: P between the S and dP GEMMs (compute_p_and_ds): +1.2% to +2.1% at d = 64 and
 *    +1.9% to +2.1% at d = 256 (double-buffered shape), level at d = 128.
 *  Combined they spilled 64-200 bytes and lost everywhere. Shapes not measured keep the order. */
template <typename Traits, bool kAlibi, bool kDropout>
struct StepSchedule {
  static constexpr bool kPlain = !kAlibi && !kDropout;
  static constexpr bool kLatePrefetch = kPlain && Traits::kHeadDim == 128 && Traits::kStages == 2;
  static constexpr bool kEarlyP =
      kPlain && Traits::kStages == 2 && (Traits::kHeadDim == 64 || Traits::kHeadDim == 256);
};

/** Query blocks [begin, end) holding a row that sees any key of [n0, n_end) (n_end > n0).
 *  Row i sees key j when diag(i) - left <= j <= diag(i) + right, diag(i) = i + seqlen_k - seqlen_q
 *  (mask.hpp); both bounds grow with i, so the rows form one interval:
 *    some key <= diag(i) + right  <=>  i >= n0 - seqlen_k + seqlen_q - right
 *    some key >= diag(i) - left   <=>  i <= n_end - 1 - seqlen_k + seqlen_q + left
 *  Rows of the interval with no key in the block only cost a fully masked tile. */
struct QueryBlockRange {
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ QueryBlockRange query_blocks_for_keys(const MaskInfo& mask, int64_t n0, int64_t n_end,
                                                                 int block_m) {
  int64_t row_first = 0;
  int64_t row_last = mask.seqlen_q - 1;
  if (mask.window_right >= 0) {
    const int64_t lo = n0 - mask.seqlen_k + mask.seqlen_q - mask.window_right;
    row_first = lo > row_first ? lo : row_first;
  }
  if (mask.window_left >= 0) {
    const int64_t hi = n_end - 1 - mask.seqlen_k + mask.seqlen_q + mask.window_left;
    row_last = hi < row_last ? hi : row_last;
  }
  if (row_last < row_first) return {0, 0};
  return {row_first / block_m, row_last / block_m + 1};
}

/** kAlibi: the scores carry ALiBi biases (p.alibi_slopes); a kernel of its own, so that the
 *  bias's code does not change the register allocation of the common kernel (it made the d64
 *  kernel spill, 0 -> 16-60 bytes, when both shared one body). kDropout: P is dropped with
 *  p.dropout (backward_scores.cuh) and dV scaled by keep_scale on store; a kernel of its own too. */
template <typename Element, typename Traits, bool kAlibi = false, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    backward_dkdv_kernel(const BackwardParams p, BackwardWorkspacePtrs ws, GridOrder order) {
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  using Smem = MainSharedStorage<Element, Traits>;
  using Schedule = StepSchedule<Traits, kAlibi, kDropout>;
  constexpr int kM = Traits::kBlockM;
  constexpr int kN = Traits::kBlockN;
  constexpr int kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  // Key block fastest: CTAs running together share (batch, KV head) and so their Q / dO in L2; the
  // first key blocks (seen by the most query blocks under a causal mask) first, the grid's tail in
  // order of falling cost across its pairs (grid_order.hpp).
  const GridPosition position = grid_position</*kHeaviestLast=*/false>(order, static_cast<int>(blockIdx.x));
  const int n_block = position.block;
  const int64_t head_batch = position.pair;
  const int64_t kv_head = head_batch % p.heads_kv;
  const int64_t b = head_batch / p.heads_kv;

  const SeqInfo seq = seq_info(p, b);
  const int64_t n0 = static_cast<int64_t>(n_block) * kN;
  if (n0 >= seq.seqlen_k) return;  // past this sequence's keys: nothing to own
  const MaskInfo mask = mask_info(p, seq);
  const int64_t n_end = n0 + kN < seq.seqlen_k ? n0 + kN : seq.seqlen_k;
  const int keys_valid = static_cast<int>(n_end - n0);
  const int head_dim = static_cast<int>(p.head_dim);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t q_row0 = first_packed_q_row(p, b, seq);
  const int64_t dq_row0 = DqTiles::sequence_row0(q_row0, b);  // this sequence's rows in dQ_accum
  const ScoreTransform tf = ScoreTransform::make(p);

  const QueryBlockRange m_blocks =
      seq.seqlen_q > 0 ? query_blocks_for_keys(mask, n0, n_end, kM) : QueryBlockRange{0, 0};
  const int64_t blocks_per_head = m_blocks.end - m_blocks.begin;
  const int64_t iterations = blocks_per_head * group;

  // K and V stay resident for the whole CTA; they join the first cp.async group.
  const int64_t k_off = offset_of(p.k, b, seq.k_start + n0, kv_head);
  const int64_t v_off = offset_of(p.v, b, seq.k_start + n0, kv_head);
  load_tile_async<Element, kN, kD, kThreads>(smem.k, static_cast<const Element*>(p.k.data) + k_off, p.k.row_stride,
                                             keys_valid, head_dim, tid);
  load_tile_async<Element, kN, kD, kThreads>(smem.v, static_cast<const Element*>(p.v.data) + v_off, p.v.row_stride,
                                             keys_valid, head_dim, tid);

  // The iterations walk (query head of the group, query block), the block fastest: heads outer so
  // the pipeline runs across them. A step to the next position instead of a 64-bit division of
  // the iteration count per use.
  struct QueryPosition {
    int64_t head;   // query head
    int64_t block;  // query block
  };
  auto next_position = [&](const QueryPosition& at) {
    return at.block + 1 < m_blocks.end ? QueryPosition{at.head, at.block + 1}
                                       : QueryPosition{at.head + 1, m_blocks.begin};
  };
  auto load_query_side = [&](const QueryPosition& at, int stage) {
    const int64_t h = at.head;
    const int64_t m0 = at.block * kM;
    const int64_t rows_left = seq.seqlen_q - m0;
    const int rows_valid = static_cast<int>(rows_left < kM ? rows_left : kM);
    const int64_t q_off = offset_of(p.q, b, seq.q_start + m0, h);
    const int64_t do_off = offset_of(p.dout, b, seq.q_start + m0, h);
    load_tile_async<Element, kM, kD, kThreads>(smem.q[stage], static_cast<const Element*>(p.q.data) + q_off,
                                               p.q.row_stride, rows_valid, head_dim, tid);
    load_tile_async<Element, kM, kD, kThreads>(smem.dout[stage], static_cast<const Element*>(p.dout.data) + do_off,
                                               p.dout.row_stride, rows_valid, head_dim, tid);
    const int64_t stat = h * p.total_q + q_row0 + m0;
    load_row_stats_async<kM>(smem.lse_log2[stage], ws.lse_log2 + stat, rows_valid, tid);
    load_row_stats_async<kM>(smem.dsum[stage], ws.dsum + stat, rows_valid, tid);
  };

  float dk_acc[Traits::kKvMTiles][Traits::kKvNTiles][4];
  float dv_acc[Traits::kKvMTiles][Traits::kKvNTiles][4];
  zero_fill(dk_acc);
  zero_fill(dv_acc);
  const int kv_row_origin = (warp / Traits::kKvWarpsD) * Traits::kKvWarpRows;
  const int kv_col_origin = (warp % Traits::kKvWarpsD) * Traits::kKvWarpCols;
  const int dq_row_origin = (warp / Traits::kDqWarpsD) * Traits::kDqWarpRows;
  const int dq_col_origin = (warp % Traits::kDqWarpsD) * Traits::kDqWarpCols;

  QueryPosition position_now{kv_head * group, m_blocks.begin};
  if (iterations > 0) load_query_side(position_now, 0);
  ptx::cp_async_commit();
  [[maybe_unused]] int trace_count = 0;  // BWD80_TRACE's record counter (backward_trace.cuh)

  for (int64_t it = 0; it < iterations; ++it) {
    const int stage = Traits::kStages == 2 ? static_cast<int>(it & 1) : 0;
    // (A) This iteration's tiles have landed, and every warp is done with the previous
    // iteration (so P/dS and the other stage may be overwritten).
    ptx::cp_async_wait<0>();
    __syncthreads();
    BWD80_TRACE(trace_count, kBwdStepBegin, it);
    // The other stage was last read before barrier (A): the next block's copies may go there now.
    const QueryPosition position_next = next_position(position_now);
    auto prefetch_next = [&] {
      if (it + 1 < iterations) load_query_side(position_next, stage ^ 1);
      ptx::cp_async_commit();
    };
    if constexpr (Traits::kStages == 2 && !Schedule::kLatePrefetch) prefetch_next();
    auto after_gemms = [&] {
      if constexpr (Schedule::kLatePrefetch) prefetch_next();
    };
    const int64_t h = position_now.head;
    const int64_t m0 = position_now.block * kM;

    // Dropout's problem index b * heads_q + h: below 2^32 (validate.cpp).
    const DropoutTile drop{&p.dropout, static_cast<uint32_t>(b * p.heads_q + h)};
    compute_p_and_ds<Element, Traits, /*kStoreP=*/true, kAlibi, kDropout, decltype(after_gemms), Schedule::kEarlyP>(
        smem.q[stage], smem.dout[stage], smem.k, smem.v, smem.lse_log2[stage], smem.dsum[stage], tf, mask, m0, n0,
        smem.p, smem.ds, warp, lane, kAlibi ? ScoreTransform::alibi_log2(p, b, h) : 0.f, drop, after_gemms);
    BWD80_TRACE(trace_count, kBwdScoresDone, it);
    __syncthreads();  // (B) P and dS visible to every warp
    BWD80_TRACE(trace_count, kBwdPdsShared, it);

    // dV += P^T dO and dK += dS^T Q: A = P^T / dS^T read transposed from the [m][n] tiles,
    // B = dO / Q read transposed from their [m][d] tiles (the contraction runs over queries).
    auto accumulate_dv = [&] {
      warp_gemm<Element, Traits::kKvMTiles, Traits::kKvNTiles, kM / 16, true, true, kN, kD>(
          dv_acc, smem.p, kv_row_origin, 0, smem.dout[stage], kv_col_origin, 0, lane);
    };
    auto accumulate_dk = [&] {
      warp_gemm<Element, Traits::kKvMTiles, Traits::kKvNTiles, kM / 16, true, true, kN, kD>(
          dk_acc, smem.ds, kv_row_origin, 0, smem.q[stage], kv_col_origin, 0, lane);
    };
    // dQ_accum[rows of this block] += dS K (contraction over keys; softmax_scale is applied in
    // the postprocess) with fp32 atomics. A = dS stored [m][n]; B = K stored [n][d] = [k][n].
    // The accumulator is in DqTiles' layout (backward_workspace.hpp): each 16 x 8 fragment tile
    // is one 16-byte reduction per lane on sm_90, four scalar ones before, into 512 contiguous
    // bytes either way.
    auto accumulate_dq = [&] {
      if (ws.dq_accum == nullptr) return;  // deterministic mode: backward_dq.cuh computes dq
      // This lane's slot in the warp's first tile, hidden from the optimizer (see opaque()): every
      // reduction of the step is then that one address plus a constant, instead of a 64-bit
      // address per tile held across the main loop (d64 spilled for them).
      const int lane_offset = opaque(DqTiles::tile_offset(dq_row_origin, dq_col_origin, kD) +
                                     DqTiles::slot(lane, 0, dq_vector_slots()));
      float* const dq_lane = ws.dq_accum + (h * ws.dq_rows_per_head + dq_row0 + m0) * kD + lane_offset;
#pragma unroll
      for (int chunk = 0; chunk < Traits::kDqChunks; ++chunk) {
        const int col0 = dq_col_origin + chunk * Traits::kDqColChunk;
        float dq_frag[Traits::kDqMTiles][Traits::kDqChunkNTiles][4];
        zero_fill(dq_frag);
        warp_gemm<Element, Traits::kDqMTiles, Traits::kDqChunkNTiles, kN / 16, false, true, kN, kD>(
            dq_frag, smem.ds, dq_row_origin, 0, smem.k, col0, 0, lane);
#pragma unroll
        for (int mt = 0; mt < Traits::kDqMTiles; ++mt) {
          // A tile wholly past the sequence is skipped; a partial one's rows past it land in the
          // sequence's own padding rows.
          if (m0 + dq_row_origin + mt * 16 >= seq.seqlen_q) continue;
#pragma unroll
          for (int nt = 0; nt < Traits::kDqChunkNTiles; ++nt) {
            // Tile (mt, nt) from the warp's first: tile_offset is linear in whole tiles.
            float* tile_lane = dq_lane + DqTiles::tile_offset(mt * DqTiles::kRows,
                                                              chunk * Traits::kDqColChunk + nt * DqTiles::kCols, kD);
            if constexpr (dq_vector_slots()) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              atomicAdd(reinterpret_cast<float4*>(tile_lane),
                        make_float4(dq_frag[mt][nt][0], dq_frag[mt][nt][1], dq_frag[mt][nt][2], dq_frag[mt][nt][3]));
#endif
            } else {
#pragma unroll
              for (int k = 0; k < 4; ++k) atomicAdd(tile_lane + DqTiles::slot(0, k, false), dq_frag[mt][nt][k]);
            }
          }
        }
      }
    };

    accumulate_dv();
    BWD80_TRACE(trace_count, kBwdDvIssued, it);
    accumulate_dk();
    BWD80_TRACE(trace_count, kBwdDkIssued, it);
    if constexpr (Traits::kStages == 1) {
      // (C) Q/dO are free once every warp passed the GEMMs above: prefetch the next block
      // while the dQ part (which reads only dS and K) runs.
      __syncthreads();
      if (it + 1 < iterations) load_query_side(position_next, 0);
      ptx::cp_async_commit();
    }
    accumulate_dq();
    BWD80_TRACE(trace_count, kBwdDqSent, it);
    BWD80_TRACE(trace_count, kBwdStepEnd, it);
    position_now = position_next;
  }

  // Epilogue: dK = softmax_scale * sum dS^T Q, dV = sum P^T dO (dropout: keep_scale * sum (P o
  // kept)^T dO), staged through the K/V tiles.
  ptx::cp_async_wait<0>();
  __syncthreads();  // K/V no longer read (and their loads landed even when no iteration ran)
  store_fragments_to_smem<Element, kD>(dk_acc, p.softmax_scale, smem.k, kv_row_origin, kv_col_origin, lane);
  store_fragments_to_smem<Element, kD>(dv_acc, kDropout ? p.dropout.keep_scale : 1.f, smem.v, kv_row_origin,
                                       kv_col_origin, lane);
  __syncthreads();
  const int64_t dk_off = offset_of(p.dk, b, seq.k_start + n0, kv_head);
  const int64_t dv_off = offset_of(p.dv, b, seq.k_start + n0, kv_head);
  store_tile<Element, kN, kD, kThreads>(smem.k, static_cast<Element*>(p.dk.data) + dk_off, p.dk.row_stride,
                                        keys_valid, head_dim, tid);
  store_tile<Element, kN, kD, kThreads>(smem.v, static_cast<Element*>(p.dv.data) + dv_off, p.dv.row_stride,
                                        keys_valid, head_dim, tid);
}

}  // namespace flashcore::cuda::sm80::bwd
