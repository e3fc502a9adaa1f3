// The recomputation step shared by the backward kernels: for one (kBlockM queries x kBlockN keys)
// tile, with Q, dO, K, V and the per-row statistics already in shared memory, compute
//   dP = dO V^T,  S = Q K^T,  P = exp(transform(S) [+ ALiBi bias] - lse),  dS = P * (dP - D) [* (1 - tanh^2)]
// in registers (the S/dP warp layout of the traits), applying the causal/window mask and the
// sequence bounds, and store P (optionally) and dS to shared memory as the element type.
//
// Dropout (kDropout): O = sum_j P_j Z_j v_j with Z_j = keep_scale where entry j is kept and 0
// where it is dropped (common/dropout.hpp), so dV = (P o Z)^T dO and dL/dP_j = Z_j dP_j, while
// D = rowsum(dO o O) (the preprocess, on the stored, dropped O) is still sum_j P_j Z_j dP_j. So
// dS = P (Z dP - D), and the P stored for dV is P where kept, 0 where dropped; the dK/dV kernel
// multiplies dV by keep_scale once, on store. The mask comes from the same Philox calls as the
// forward's: one per (row, 32 keys) of a lane's columns (dropout_fragment.hpp).
//
// Relies on backward_common.cuh (warp_gemm, traits), common/mask.hpp (MaskInfo) and
// dropout_fragment.hpp.
#pragma once

#include "cuda/sm80/backward_common.cuh"
#include "cuda/sm80/dropout_fragment.hpp"

namespace flashcore::cuda::sm80::bwd {

template <typename Traits>
using SdpFragments = float[Traits::kSdpMTiles][Traits::kSdpNTiles][4];

/** 2^x in one MUFU instruction (flushes denormal results to 0, -inf gives 0): the probabilities
 *  it produces are rounded to 16 bits right after, so the approximation is invisible there. */
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/** The dropout of one backward tile (kDropout kernels): the call's parameters and the problem
 *  index b * heads_q + h of the query head. */
struct DropoutTile {
  const DropoutParams* params;
  uint32_t bh;
};

/** The keys one query row sees inside a tile of kBlockN keys from n0, as tile-local columns
 *  [lo, hi); rows past the sequence see none. */
struct TileKeys {
  int lo;
  int hi;
  template <int kBlockN>
  __device__ __forceinline__ static TileKeys of_row(const MaskInfo& mask, int64_t query_row, int64_t n0) {
    if (query_row >= mask.seqlen_q) return {0, 0};
    const KeyRange keys = mask.keys_for_row(query_row);
    const int64_t lo = keys.begin - n0;
    const int64_t hi = keys.end - n0;
    return {static_cast<int>(lo < 0 ? 0 : (lo > kBlockN ? kBlockN : lo)),
            static_cast<int>(hi < 0 ? 0 : (hi > kBlockN ? kBlockN : hi))};
  }
};

/** The element-wise part: p (holding S on entry) becomes P, ds (holding dP on entry) becomes dS.
 *  kSoftcap selects the tanh-capped transform, kMasked the per-element visibility test, kAlibi
 *  the ALiBi bias (alibi_log2 per unit of distance) and kDropout the dropout mask (P stored as
 *  P o Z / keep_scale, dS = P (Z dP - D), see the top comment) at compile time, so the common path
 *  (no softcap, tile fully visible) stays lean. */
template <typename Traits, bool kSoftcap, bool kMasked, bool kAlibi = false, bool kDropout = false>
__device__ __forceinline__ void scores_to_p_and_ds(SdpFragments<Traits>& p, SdpFragments<Traits>& ds,
                                                   const float* lse_log2_rows, const float* dsum_rows,
                                                   const ScoreTransform& tf, const MaskInfo& mask, int64_t m0,
                                                   int64_t n0, int warp, int lane, float alibi_log2 = 0.f,
                                                   const DropoutTile& drop = {}) {
  const int group = lane >> 2;
  const int quad = lane & 3;
  const int row_origin = (warp / Traits::kSdpWarpsN) * Traits::kSdpWarpRows;
  const int col_origin = (warp % Traits::kSdpWarpsN) * Traits::kSdpWarpCols;
  // Dropout: a warp's columns are whole 32-key halves of a 64-key block (one Philox call each,
  // word nt % 4 for n-tile nt), or, 16 columns wide (d256), one half of such a half: the call of
  // the 32 keys around them, of which this warp reads words 0-1 or 2-3 (the other warp of the
  // pair computes the same call for the other two; the price of 16-column warp tiles).
  static_assert(!kDropout || Traits::kSdpWarpCols % 32 == 0 || Traits::kSdpWarpCols == 16,
                "dropout: warp columns are whole 32-key halves or 16 keys");
  constexpr bool kHalfCall = Traits::kSdpWarpCols == 16;
  const uint32_t key32 = static_cast<uint32_t>(n0 + col_origin) & ~31u;  // n0: a multiple of kBlockN >= 64
  const int word0 = kHalfCall ? (col_origin & 16) >> 3 : 0;              // 0 or 2
#pragma unroll
  for (int mt = 0; mt < Traits::kSdpMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_origin + mt * 16 + half * 8 + group;
      const float lse_log2 = lse_log2_rows[row];
      const float dsum = dsum_rows[row];
      // ALiBi: key column c of this tile lies diagonal - c keys before the row's diagonal key
      // (i + sk - sq); tile-local, and a float (exact below 2^24) so that no score needs an
      // int-to-float conversion (they run on the exponentials' unit).
      const float diagonal =
          static_cast<float>(m0 + row + mask.seqlen_k - mask.seqlen_q - n0 - col_origin - quad * 2);
      const TileKeys keys = kMasked ? TileKeys::of_row<Traits::kBlockN>(mask, m0 + row, n0) : TileKeys{0, 0};
      const int key_lo = keys.lo;
      const int key_hi = keys.hi;
      PhiloxWords words{};
#pragma unroll
      for (int nt = 0; nt < Traits::kSdpNTiles; ++nt) {
        if constexpr (kDropout) {
          if (nt % 4 == 0) {  // this row's draws of the next 32 keys, used right away
            words = dropout_quad_words_keyed(*drop.params, drop.bh, static_cast<uint32_t>(m0 + row), key32 + 8 * nt,
                                             quad);
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = half * 2 + j;
          const float s = p[mt][nt][e];
          // dP (ds on entry), times Z under dropout: keep_scale when kept, 0 when dropped.
          float dp = ds[mt][nt][e];
          bool kept = true;
          if constexpr (kDropout) {
            uint32_t word;
            if constexpr (kHalfCall) {
              word = word0 == 0 ? words.w[nt] : words.w[2 + nt];
            } else {
              word = words.w[nt % 4];
            }
            kept = dropout_draw_kept(word, j, *drop.params);
            dp = kept ? dp * drop.params->keep_scale : 0.f;
          }
          // The bias enters the exponent only: it is a constant of the score, so dS keeps its form.
          float bias_minus_lse = -lse_log2;
          if constexpr (kAlibi) {
            const float distance = diagonal - static_cast<float>(nt * 8 + j);
            bias_minus_lse = fmaf(alibi_log2, fabsf(distance), -lse_log2);
          }
          float prob;
          float dscore;
          if constexpr (kSoftcap) {
            const float t = tanhf(s * tf.tanh_arg_scale);
            prob = fast_exp2(t * tf.softcap_log2 + bias_minus_lse);
            dscore = prob * (dp - dsum) * (1.f - t * t);
          } else {
            prob = fast_exp2(s * tf.scale_log2 + bias_minus_lse);
            dscore = prob * (dp - dsum);
          }
          // dV's weight: P o Z without keep_scale (applied to dV on store); dS above used all of P.
          if constexpr (kDropout) prob = kept ? prob : 0.f;
          if constexpr (kMasked) {
            // Select (not multiply) so an inf/NaN computed for a masked entry cannot leak.
            const int col = col_origin + nt * 8 + quad * 2 + j;
            const bool visible = col >= key_lo && col < key_hi;
            prob = visible ? prob : 0.f;
            dscore = visible ? dscore : 0.f;
          }
          p[mt][nt][e] = prob;
          ds[mt][nt][e] = dscore;
        }
      }
    }
  }
}

/** The early-P order's first half (compute_p_and_ds, kEarlyP): p holds S on entry and
 *  P = exp2(S * scale_log2 - lse) on return, 0 where masked (kMasked). No softcap, ALiBi or
 *  dropout. */
template <typename Traits, bool kMasked>
__device__ __forceinline__ void scores_to_p(SdpFragments<Traits>& p, const float* lse_log2_rows,
                                            const ScoreTransform& tf, const MaskInfo& mask, int64_t m0, int64_t n0,
                                            int warp, int lane) {
  const int group = lane >> 2;
  const int quad = lane & 3;
  const int row_origin = (warp / Traits::kSdpWarpsN) * Traits::kSdpWarpRows;
  const int col_origin = (warp % Traits::kSdpWarpsN) * Traits::kSdpWarpCols;
#pragma unroll
  for (int mt = 0; mt < Traits::kSdpMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_origin + mt * 16 + half * 8 + group;
      const float lse_log2 = lse_log2_rows[row];
      const TileKeys keys = kMasked ? TileKeys::of_row<Traits::kBlockN>(mask, m0 + row, n0) : TileKeys{0, 0};
      const int key_lo = keys.lo;
      const int key_hi = keys.hi;
#pragma unroll
      for (int nt = 0; nt < Traits::kSdpNTiles; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = half * 2 + j;
          float prob = fast_exp2(p[mt][nt][e] * tf.scale_log2 - lse_log2);
          if constexpr (kMasked) {
            const int col = col_origin + nt * 8 + quad * 2 + j;
            prob = col >= key_lo && col < key_hi ? prob : 0.f;
          }
          p[mt][nt][e] = prob;
        }
      }
    }
  }
}

/** The early-P order's second half: ds holds dP on entry, dS = P (dP - D) on return. Under a
 *  mask (kMasked) dS is selected to 0 wherever P is 0 (the masked entries among them, where an
 *  inf in dP must not leak; elsewhere P = 0 gives dS = 0 anyway). */
template <typename Traits, bool kMasked>
__device__ __forceinline__ void p_to_ds(const SdpFragments<Traits>& p, SdpFragments<Traits>& ds,
                                        const float* dsum_rows, int warp, int lane) {
  const int group = lane >> 2;
  const int row_origin = (warp / Traits::kSdpWarpsN) * Traits::kSdpWarpRows;
#pragma unroll
  for (int mt = 0; mt < Traits::kSdpMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float dsum = dsum_rows[row_origin + mt * 16 + half * 8 + group];
#pragma unroll
      for (int nt = 0; nt < Traits::kSdpNTiles; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = half * 2 + j;
          const float dscore = p[mt][nt][e] * (ds[mt][nt][e] - dsum);
          ds[mt][nt][e] = kMasked && p[mt][nt][e] == 0.f ? 0.f : dscore;
        }
      }
    }
  }
}

/** The default `after_gemms` of compute_p_and_ds: nothing. */
struct NoStep {
  __device__ __forceinline__ void operator()() const {}
};

/** Full recomputation of one tile from shared memory: P (when kStoreP) and dS go to the
 *  kBlockM x kBlockN swizzled tiles p_tile / ds_tile as Element. q/dout tiles are
 *  kBlockM x kHeadDim, k/v tiles kBlockN x kHeadDim, the stats kBlockM floats.
 *  `after_gemms()` runs once both GEMMs are issued and before the element-wise step needs their
 *  results: work placed there (the dK / dV kernel's next loads) overlaps the GEMMs' tail.
 *  Order: by default both GEMMs run before the element-wise step. kEarlyP (plain kernels only:
 *  no ALiBi, dropout or softcap) computes S, then P, then dP and dS, so that P's exponentials
 *  overlap the dP GEMM as in FA2: on an H200 +1% to +2% at d = 64 and 256, level at d = 128, where
 *  it spilled more (docs/PERF.md, session 54; an older H100 measurement had it slower at d = 64
 *  and 128 for the same reason). */
template <typename Element, typename Traits, bool kStoreP, bool kAlibi, bool kDropout = false,
          typename AfterGemms = NoStep, bool kEarlyP = false>
__device__ __forceinline__ void compute_p_and_ds(const Element* q_tile, const Element* dout_tile,
                                                 const Element* k_tile, const Element* v_tile,
                                                 const float* lse_log2_rows, const float* dsum_rows,
                                                 const ScoreTransform& tf, const MaskInfo& mask, int64_t m0,
                                                 int64_t n0, Element* p_tile, Element* ds_tile, int warp, int lane,
                                                 float alibi_log2, const DropoutTile& drop = {},
                                                 const AfterGemms& after_gemms = {}) {
  constexpr int kD = Traits::kHeadDim;
  constexpr int kKSteps = kD / 16;
  const int row_origin = (warp / Traits::kSdpWarpsN) * Traits::kSdpWarpRows;
  const int col_origin = (warp % Traits::kSdpWarpsN) * Traits::kSdpWarpCols;
  float p[Traits::kSdpMTiles][Traits::kSdpNTiles][4];
  float ds[Traits::kSdpMTiles][Traits::kSdpNTiles][4];
  zero_fill(ds);
  zero_fill(p);
  if constexpr (kEarlyP && !kAlibi && !kDropout) {
    // S first, P from it, then the dP GEMM in the same basic block as P's exponentials (each
    // mask case has its own copy of the GEMM, so the compiler interleaves the exponentials with
    // its tensor instructions), then dS. Softcap keeps the common order (its dS needs tanh(S)).
    if (tf.softcap <= 0.f) {
      warp_gemm<Element, Traits::kSdpMTiles, Traits::kSdpNTiles, kKSteps, false, false, kD, kD>(
          p, q_tile, row_origin, 0, k_tile, col_origin, 0, lane);
      const bool masked_tile = !mask.tile_fully_visible(m0, m0 + Traits::kBlockM, n0, n0 + Traits::kBlockN);
      if (masked_tile) {
        scores_to_p<Traits, true>(p, lse_log2_rows, tf, mask, m0, n0, warp, lane);
        warp_gemm<Element, Traits::kSdpMTiles, Traits::kSdpNTiles, kKSteps, false, false, kD, kD>(
            ds, dout_tile, row_origin, 0, v_tile, col_origin, 0, lane);
        after_gemms();
        p_to_ds<Traits, true>(p, ds, dsum_rows, warp, lane);
      } else {
        scores_to_p<Traits, false>(p, lse_log2_rows, tf, mask, m0, n0, warp, lane);
        warp_gemm<Element, Traits::kSdpMTiles, Traits::kSdpNTiles, kKSteps, false, false, kD, kD>(
            ds, dout_tile, row_origin, 0, v_tile, col_origin, 0, lane);
        after_gemms();
        p_to_ds<Traits, false>(p, ds, dsum_rows, warp, lane);
      }
      if constexpr (kStoreP) {
        store_fragments_to_smem<Element, Traits::kBlockN>(p, 1.f, p_tile, row_origin, col_origin, lane);
      }
      store_fragments_to_smem<Element, Traits::kBlockN>(ds, 1.f, ds_tile, row_origin, col_origin, lane);
      return;
    }
  }
  // dP = dO V^T and S = Q K^T: A stored [m][d], B = K^T / V^T read from the K / V rows [n][d].
  warp_gemm<Element, Traits::kSdpMTiles, Traits::kSdpNTiles, kKSteps, false, false, kD, kD>(
      ds, dout_tile, row_origin, 0, v_tile, col_origin, 0, lane);
  warp_gemm<Element, Traits::kSdpMTiles, Traits::kSdpNTiles, kKSteps, false, false, kD, kD>(
      p, q_tile, row_origin, 0, k_tile, col_origin, 0, lane);
  after_gemms();  // work that needs none of the results (the dK / dV kernel's next loads)
  // Tiles with every (row, key) visible and inside both sequences skip the per-element test.
  const bool masked = !mask.tile_fully_visible(m0, m0 + Traits::kBlockM, n0, n0 + Traits::kBlockN);
  if constexpr (kAlibi) {  // every tile through the masked body (the bias is per element anyway)
    if (tf.softcap > 0.f) {
      scores_to_p_and_ds<Traits, true, true, true, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                             lane, alibi_log2, drop);
    } else {
      scores_to_p_and_ds<Traits, false, true, true, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                              lane, alibi_log2, drop);
    }
  } else if (tf.softcap > 0.f) {
    if (masked) {
      scores_to_p_and_ds<Traits, true, true, false, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                              lane, 0.f, drop);
    } else {
      scores_to_p_and_ds<Traits, true, false, false, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                               lane, 0.f, drop);
    }
  } else if (masked) {
    scores_to_p_and_ds<Traits, false, true, false, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                             lane, 0.f, drop);
  } else {
    scores_to_p_and_ds<Traits, false, false, false, kDropout>(p, ds, lse_log2_rows, dsum_rows, tf, mask, m0, n0, warp,
                                                              lane, 0.f, drop);
  }
  if constexpr (kStoreP) {
    store_fragments_to_smem<Element, Traits::kBlockN>(p, 1.f, p_tile, row_origin, col_origin, lane);
  }
  store_fragments_to_smem<Element, Traits::kBlockN>(ds, 1.f, ds_tile, row_origin, col_origin, lane);
}

}  // namespace flashcore::cuda::sm80::bwd
