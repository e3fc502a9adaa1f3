// FlashAttention-2 style forward kernel on the sm_80 tensor-core instruction set (mma.sync,
// ldmatrix, cp.async), which also runs on Ada and Hopper. Header-only: cmake/cuda.cmake generates
// one translation unit per (dtype, head-dim bucket) that explicitly instantiates forward_run.
//
// Relies on: api/params.hpp (AttentionParams, seq_info, offset_of), common/mask.hpp (MaskInfo: the
// one definition of causal / window masks), cuda/sm80/tile_common.cuh (swizzled tiles, cp.async
// tile loads, packing, reductions) and cuda/ptx/*.cuh (raw instructions).
//
// ---- Work decomposition -------------------------------------------------------------------------
// One CTA per (query block of kBlockM rows, query head, batch entry), kWarps warps; warp w owns rows
// [w * kWarpRows, (w + 1) * kWarpRows) of the block, i.e. kMTiles stacked 16-row mma tiles, and the
// full key width of every S tile and the full head dim of O for those rows. Nothing is exchanged
// between warps except the shared K/V tiles. The grid is 1-D: block index = m fastest (reversed, so
// the heaviest causal blocks of a head start first), then query head, then batch; CTAs of one head
// run together and share K/V through L2.
//
// ---- Small-grid path (SmallGridForwardTraits, chosen per call in forward_run) ------------------
// With few heads and short sequences the default grid (128-row blocks) leaves most SMs idle and
// each CTA walks all keys serially, one warp per scheduler: latency-bound (B=1 H=8 S=512 d64: 32
// CTAs on 132 SMs, 13.2 us vs SDPA FA2 10.1 / cuDNN 9.2). When a grid of 32-row blocks (4x the CTAs
// of the default one, one CTA per SM) fits in at most two waves, a second configuration runs
// instead: those 32-row blocks and kKeyGroups = 4 warp groups per CTA that split the block's
// key tiles into contiguous shares differing by at most one tile, the larger ones to the lowest
// groups (split-KV inside the CTA). The CTA loads Q once for all groups (one barrier); each group
// has its own smem region {K stages, V stages} and its own named barrier, so it runs exactly the
// loop below on its share; afterwards the groups' O, reference max and partial sums meet in
// smem and group 0 merges them in group order (exact, deterministic; merge_key_groups) and runs
// the epilogue. Compared with a split-KV over CTAs this needs no workspace, no second (combine)
// kernel launch and no fp32 round trip through L2. Only d64 and d128 compile it; devices whose
// opt-in smem cannot hold it (sm_86/89) keep the default.
// H100, CUDA-graph replay, small-grid vs default configuration: one wave, the seed shape B=1 H=8
// S=512 d64 fp16, 7.0 vs 13.5 us (5.35 us since session 17: one Q per CTA, the unmasked first
// tile, the 32-bit prologue; SDPA cuDNN 9.06); two waves (B=1, 64 default blocks) ahead in all
// ten shapes measured, from d64 S=512 H=16 12.3 vs 13.3 to d128 S=4096 H=2 74.5 vs 127.2; three
// and four waves behind in all nine (d64 S=512 H=24 17.8 vs 13.5, d128 S=1024 H=16 49.4 vs 35.9).
//
// ---- Fragment layouts (mma.sync.m16n8k16, see cuda/ptx/mma.cuh) ----------------------------------
// lane = 4 * group + quad. A C fragment of a 16x8 tile holds (row group, cols 2quad, 2quad+1) in
// c0,c1 and (row group + 8, same cols) in c2,c3.
//  S = Q K^T : A = Q (row-major in smem) by ldmatrix.x4 (non-trans): matrix i covers rows
//              + 8*(i%2), k-chunk + (i/2) -> a0..a3. B = K^T: K is stored [key][dim], which is
//              exactly the "col" B layout, so a non-trans ldmatrix.x4 gives b0,b1 of two adjacent
//              8-key n-tiles (matrix i: keys + 8*(i/2), dim-chunk + (i%2)).
//  O += P V  : the C fragments of S tiles 2k and 2k+1 are, element for element, the A fragment of
//              k-step k of the P V product (a0 = S[2k].c0c1, a1 = S[2k].c2c3, a2 = S[2k+1].c0c1,
//              a3 = S[2k+1].c2c3), so P is rounded to 16 bits and packed in registers, never
//              touching smem. B = V with keys as the reduction dim: V is stored [key][dim], so
//              ldmatrix.x4.trans gives b0,b1 of two adjacent 8-dim n-tiles (matrix i: keys +
//              8*(i%2), dim-chunk + (i/2)).
// Every smem tile is XOR-swizzled per 16-byte chunk (SwizzledTile), so each 8-row ldmatrix phase,
// the cp.async fills and the epilogue's fragment stores are all bank-conflict free.
//
// ---- Pipeline (kStages = 2 smem buffers for K and for V, one barrier per key tile) -------------
// Iteration j starts with cp.async.wait_group 0 + __syncthreads (the key group's named barrier on
// the small-grid path): the tiles issued one iteration earlier have landed for every thread, and
// every warp is done with iteration j-1, whose buffers the loads issued right after the barrier
// overwrite. Two orders exist (Traits::kOverlapPV):
//  overlap (default for d64/d128): issue K_{j+1}, V_j; S_j = Q K_j; softmax_j -> P_j;
//      O += P_{j-1} V_{j-1}. The P V mmas of the previous tile do not depend on softmax_j, so the
//      scheduler interleaves them with its max/exp work inside one warp; P_{j-1} stays in registers
//      for one iteration and the last tile's P V runs after the loop.
//  FA2 order (d256, where smem bandwidth and not latency binds): issue K_{j+1}, V_{j+1};
//      S_j; softmax_j; O += P_j V_j.
// The loop bodies are specialized (first tile / masked / unmasked / softcap) so the hot body is
// one branch-free block; the only branch, the rare O rescale, sits right after the barrier.
//
// ---- Softmax in registers -----------------------------------------------------------------------
// A thread holds 2 rows per m-tile. The running max is kept on raw scores and the scale is folded
// into one FFMA in log2 units: p = exp2(s * scale*log2e - m * scale*log2e). A softcap (tanh must see
// natural-scale scores) or a negative scale instead transforms the scores first into log2 units and
// uses a factor of 1. Row maxima are tree-reduced, then over the quad with two shuffles per tile;
// row sums stay per-thread partials until the epilogue. Lazy rescaling: the reference max of a row
// moves only when a tile exceeds it by more than kRescaleThresholdLog2 (so P <= 2^8), and O is
// multiplied only when some row of the warp moved; exact either way, since O, l and the lse all
// use the same reference max. Masked scores are -inf; a row whose max is still -inf uses 0 as its
// subtrahend so that exp2(-inf - -inf) = NaN never happens, and its sum stays 0.
//
// ---- Masking ------------------------------------------------------------------------------------
// The key blocks of a query block are MaskInfo::keys_for_rows(block rows). Per-element masking runs
// only on tiles that are not MaskInfo::tile_fully_visible: the causal diagonal, window edges and the
// partial last key block (keys >= seqlen_k are out of every row's range). Query rows past seqlen_q
// are computed on zero-filled Q and simply not stored. A block with no keys at all skips the loop
// and writes out = 0, lse = -inf; so does any single row with an empty key range (sum 0).
//
// ---- Dropout (forward_kernel<..., kDropout = true>) ----------------------------------------------
// After a row's probabilities are summed into l (every one of them: l and the lse ignore dropout),
// drop_row zeroes the dropped ones before P is packed for the P V mma; the epilogue multiplies by
// keep_scale / l instead of 1 / l. The mask is common/dropout.hpp's: a lane computes one Philox
// call per (row, 32 keys) of each tile, whose eight draws are exactly that lane's columns there
// (dropout_fragment.hpp). Only DropoutForwardTraits compile it (with and without ALiBi, and
// paged): the default tiles with 16 rows per warp, which leave the Philox rounds registers;
// forward_run never sends a dropout call to the small-grid configuration. Key groups would need
// nothing more (the mask is a function of the key, and l, O merge linearly), but that kernel would
// only add compile time for a latency-bound shape that training calls rarely have.
//
// ---- Epilogue -----------------------------------------------------------------------------------
// O / l is rounded to the dtype and staged through this warp's own rows of the Q smem region, then
// written with 16-byte stores predicated on row < seqlen_q and column < head_dim (head dims below
// the bucket are zero-filled on load and never stored). lse = (m*scale*log2e + log2 l) * ln2.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "api/params.hpp"
#include "api/status.hpp"
#include "common/mask.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/global_store.cuh"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/forward_scores.hpp"
#include "cuda/programmatic_launch.hpp"
#include "cuda/scoped_device.hpp"
#include "cuda/sm80/dropout_fragment.hpp"
#include "cuda/sm80/forward_trace.cuh"
#include "cuda/sm80/grid_order.hpp"
#include "cuda/sm80/tile_common.cuh"

namespace flashcore::cuda::sm80 {

using forward_params_t = AttentionParams;

/** Tile sizes and the shared-memory plan of one forward kernel instantiation. */
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, bool kQInRegs_,
          int kMinBlocksPerSm_ = 0, bool kOverlapPV_ = true, int kKeyGroups_ = 1, bool kPagedKV_ = false>
struct ForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the compiled bucket; actual head_dim <= this
  static constexpr int kBlockM = kBlockM_;    // query rows per CTA
  static constexpr int kBlockN = kBlockN_;    // keys per pipelined K/V tile
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kStages = 2;           // K and V buffers each (the loop assumes exactly 2)
  static constexpr bool kQInRegs = kQInRegs_; // Q fragments loaded once into registers
  // P V of tile j-1 issued after S_j so that it overlaps softmax_j (costs P's registers across the
  // iteration); false = the FA2 order S_j, softmax_j, P_j V_j.
  static constexpr bool kOverlapPV = kOverlapPV_;
  // K/V tiles placed through the page table (paged varlen forward, AttentionParams::pages): one
  // lookup per tile, so a tile must lie in one page (forward_api.cu reads pages of 256k keys in
  // place and gathers others into packed rows first).
  static constexpr bool kPagedKV = kPagedKV_;
  static_assert(!kPagedKV || 256 % kBlockN_ == 0, "a key tile must lie inside a page of 256 keys");

  // Warp groups that split the key range of one query block (small-grid path, see the top
  // comment); each group owns kWarps / kKeyGroups warps covering all kBlockM rows.
  static constexpr int kKeyGroups = kKeyGroups_;
  static constexpr int kGroupWarps = kWarps / kKeyGroups;
  static constexpr int kGroupThreads = kGroupWarps * kWarpSize;
  static_assert(kWarps % kKeyGroups == 0, "key groups of whole, equal warp counts");
  static_assert(kKeyGroups < kMaxNamedBarriers, "one named barrier per group, besides id 0");

  static constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;
  static constexpr int kWarpRows = kBlockM / kGroupWarps;
  static constexpr int kMTiles = kWarpRows / kMmaM;  // 16-row tiles per warp
  static constexpr int kNTilesS = kBlockN / kMmaN;   // 8-key tiles of S
  static constexpr int kKStepsS = kHeadDim / kMmaK;  // reduction steps of Q K^T
  static constexpr int kNTilesO = kHeadDim / kMmaN;  // 8-dim tiles of O
  static constexpr int kKStepsO = kBlockN / kMmaK;   // reduction steps of P V
  static_assert(kWarpRows % kMmaM == 0, "each warp owns whole 16-row tiles");
  static_assert(kNTilesS % 2 == 0 && kNTilesO % 2 == 0, "ldmatrix.x4 loads two n-tiles at once");
  static constexpr int kQFragMTiles = kQInRegs ? kMTiles : 1;  // register Q, or a 1-entry dummy
  static constexpr int kQFragKSteps = kQInRegs ? kKStepsS : 1;

  // Shared memory: Q once (every key group reads the same rows), then one region per key group
  // with its own K and V stages, so the groups never synchronize with each other between the first
  // tile and the final merge (kKeyGroups = 1: the plain Q, K, V layout).
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using KVTile = SwizzledTile<kBlockN, kHeadDim>;
  static constexpr int kSmemGroupsOffset = QTile::kBytes;
  static constexpr int kSmemKOffset = 0;  // within a group's region
  static constexpr int kSmemVOffset = kSmemKOffset + kStages * KVTile::kBytes;
  static constexpr int kSmemGroupBytes = kSmemVOffset + kStages * KVTile::kBytes;
  static constexpr int kSmemBytes = kSmemGroupsOffset + kKeyGroups * kSmemGroupBytes;
  // Key-group merge: groups >= 1 leave O (fp32 accumulators) and the row max / partial sum per
  // thread in their own K/V region (dead by then); group 0 reads them.
  static constexpr int kMergeOBytes = kMTiles * kNTilesO * kGroupThreads * int(sizeof(float4));
  static constexpr int kMergeStatsBytes = kMTiles * 2 * kGroupThreads * int(sizeof(float2));
  static_assert(kKeyGroups == 1 || kMergeOBytes + kMergeStatsBytes <= kSmemGroupBytes,
                "merge scratch must fit in a group's K/V region");

  // The epilogue's global stores from per-lane bases formed once (a stepped output pointer, the
  // swizzle's few patterns) rather than re-derived per store: 180-640 fewer instructions a warp
  // (d128's plain kernel 7392 -> 6752, its key loop's SASS unchanged). The stores go through
  // ptx::store_global_v4: as a plain uint4 store ptxas split each into four 4-byte STG.E, which
  // cost d128 -0.7% to -3.4% (session 58). With the wrapper (session 59, forward best of 2):
  // d128 causal S = 512 +3.2%, others -0.4% to +0.6%; d64 -0.1% to +1.1% on top of the stepped
  // form's +5%. d256 lost 1.4% to 3.7% (its key loops' allocation changes with the epilogue), so it
  // keeps the per-store addresses, and so do the paged kernels, which were not timed and spilled
  // 4-12 bytes more with the stepped form (session 59's build).
  static constexpr bool kSteppedOutputStores = kHeadDim <= 128 && !kPagedKV_;

  // Register budget hint for __launch_bounds__ (0 = small CTAs should fit twice per SM).
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_ > 0 ? kMinBlocksPerSm_
                                         : (kThreads <= 128 ? 2 : 1);
};

/** The configuration forward_run uses per (dtype, bucket). */
template <typename Element, int kHeadDim>
struct DefaultForwardTraits;
template <typename Element>
struct DefaultForwardTraits<Element, 64> {
  // 4 warps x 32 rows (K/V fragments serve two m-tiles: half the smem reads of 16-row warps),
  // Q in registers, two CTAs per SM.
  using type = ForwardTraits<Element, 64, 128, 64, 4, true>;
};
template <typename Element>
struct DefaultForwardTraits<Element, 128> {
  // N = 32 keeps O (128 regs), S, the carried P and the Q fragment of one k-step within 255
  // registers with the P V overlap; Q is re-read from smem per k-step.
  using type = ForwardTraits<Element, 128, 128, 32, 4, false>;
};
template <typename Element>
struct DefaultForwardTraits<Element, 256> {
  // O alone is 128 registers at 16 rows per warp, so 8 warps of 16 rows; one CTA per SM. Here the
  // FA2 order (no P V overlap) measured faster: the loop is bound by smem bandwidth, not latency.
  using type = ForwardTraits<Element, 256, 128, 64, 8, false, 0, false>;
};

/** The configuration of dropout calls (forward_kernel<..., kDropout = true>). A lane's Philox
 *  rounds (one call per row and 32 keys of a tile) need registers the default d64 / d128 tiles
 *  (32 rows per warp) do not have: with them the dropout kernels spilled 268 / 80 bytes (nvcc 13,
 *  sm_80; 116 / 44 without dropout), so they take 64-row blocks of 4 warps x 16 rows instead
 *  (227 / 240 registers on sm_80, 233 / 254 on sm_90, no spills; two CTAs per SM as before). d256
 *  already has 16-row warps. */
template <typename Element, int kHeadDim>
struct DropoutForwardTraits {
  using type = typename DefaultForwardTraits<Element, kHeadDim>::type;
};
template <typename Element>
struct DropoutForwardTraits<Element, 64> {
  using type = ForwardTraits<Element, 64, 64, 64, 4, true>;
};
template <typename Element>
struct DropoutForwardTraits<Element, 128> {
  using type = ForwardTraits<Element, 128, 64, 32, 4, true>;
};

/** The default configuration with its K/V tiles placed through a page table. */
template <class Traits>
struct PagedForwardTraits;
template <typename E, int kHeadDim, int kBlockM, int kBlockN, int kWarps, bool kQInRegs, int kMinBlocks, bool kOverlap,
          int kGroups, bool kPaged>
struct PagedForwardTraits<ForwardTraits<E, kHeadDim, kBlockM, kBlockN, kWarps, kQInRegs, kMinBlocks, kOverlap, kGroups, kPaged>> {
  using type = ForwardTraits<E, kHeadDim, kBlockM, kBlockN, kWarps, kQInRegs, kMinBlocks, kOverlap, kGroups, true>;
};

/** The small-grid configuration per (dtype, bucket), used when the default grid would leave SMs
 *  idle (see forward_run); `void` where none is compiled (it only pays for the common head dims,
 *  and every instantiation adds a kernel to the unit's compile time). 32-row query blocks (4x the
 *  CTAs of the default 128) and 4 key groups of 2 warps x 16 rows: a warp's serial work per query
 *  block is 16 rows x a quarter of the keys instead of 32 rows x all keys. */
template <typename Element, int kHeadDim>
struct SmallGridForwardTraits {
  using type = void;
};
template <typename Element>
struct SmallGridForwardTraits<Element, 64> {
  using type = ForwardTraits<Element, 64, 32, 64, 8, true, 0, true, 4>;  // 144 KiB smem
};
template <typename Element>
struct SmallGridForwardTraits<Element, 128> {
  // N = 32 keeps the 4 regions at 160 KiB (A100 allows 163); one m-tile leaves room for Q in regs.
  using type = ForwardTraits<Element, 128, 32, 32, 8, true, 0, true, 4>;
};

using cuda::ScoreScales;
using cuda::ScoreTransform;
using cuda::ScopedDevice;

/** The reference row max moves only when a tile exceeds it by more than this (log2 units), so
 *  unnormalized P stays <= 2^8 (fine for fp16/bf16 and fp32 sums). */
constexpr float kRescaleThresholdLog2 = 8.f;

/** One (batch, head)'s first elements of q, k, v (its KV head) and out. */
template <typename Element>
struct HeadPointers {
  const Element* q;
  const Element* k;
  const Element* v;
  Element* out;
};

struct ForwardKernelArgs {
  AttentionParams params;
  GridOrder order;  // (batch, head) pairs x query blocks, last query block first (grid_order.hpp)
  int heads_q;     // p.heads_q and p.heads_q / p.heads_kv in 32 bits: the kernel's index math
  int group_size;
  ScoreTransform transform;
  float exp2_scale;  // factor of the (transformed) score in the exponent
  float pre_scale;
  float post_scale;
  float rescale_threshold;  // lazy rescaling, in the units of row_max (see online_softmax)
};

// ---- building blocks of the main loop (each inlines into one straight-line block) ---------------

/** S = Q K^T for one key tile. Q comes from registers (kQInRegs) or from smem per k-step; K from the
 *  smem stage `k_stage`. Each ldmatrix.x4 of K feeds 2 n-tiles for all of the warp's m-tiles. */
template <class Traits>
__device__ __forceinline__ void qk_gemm(
    float (&s)[Traits::kMTiles][Traits::kNTilesS][4],
    const uint32_t (&q_frag)[Traits::kQFragMTiles][Traits::kQFragKSteps][4],
    const LdmatrixLaneAddress<typename Traits::QTile>& q_address, uint32_t k_stage,
    const LdmatrixLaneAddress<typename Traits::KVTile>& k_address) {
  using Ops = ElementOps<typename Traits::Element>;
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;
    }
  }
#pragma unroll
  for (int kk = 0; kk < Traits::kKStepsS; ++kk) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt) {
      if constexpr (Traits::kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][kk][i];
      } else {
        ptx::ldmatrix_x4(a[mt], q_address.at(mt * Traits::kMmaM, kk));
      }
    }
#pragma unroll
    for (int np = 0; np < Traits::kNTilesS / 2; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, k_stage + k_address.at(np * 2 * Traits::kMmaN, kk));
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
        Ops::mma(s[mt][2 * np], a[mt], b_lo);
        Ops::mma(s[mt][2 * np + 1], a[mt], b_hi);
      }
    }
  }
}

/** O += P V for one key tile; P is in A-fragment form, V in the smem stage `v_stage`. */
template <class Traits>
__device__ __forceinline__ void pv_gemm(float (&o)[Traits::kMTiles][Traits::kNTilesO][4],
                                        const uint32_t (&p)[Traits::kMTiles][Traits::kKStepsO][4],
                                        uint32_t v_stage,
                                        const LdmatrixLaneAddress<typename Traits::KVTile>& v_address) {
  using Ops = ElementOps<typename Traits::Element>;
#pragma unroll
  for (int kk = 0; kk < Traits::kKStepsO; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Traits::kNTilesO / 2; ++dp) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, v_stage + v_address.at(kk * Traits::kMmaK, dp));
      const uint32_t b_lo[2] = {b[0], b[1]};
      const uint32_t b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
        Ops::mma(o[mt][2 * dp], p[mt][kk], b_lo);
        Ops::mma(o[mt][2 * dp + 1], p[mt][kk], b_hi);
      }
    }
  }
}

/** Softcap (or a negative scale): raw scores -> log2-domain scores, exp2 factor 1 afterwards.
 *  kBranchOutside (the ALiBi kernels, whose calls mostly take the linear transform): one branch
 *  around two loops, where the select inside one loop computes tanhf (two MUFU operations) for
 *  every score of a linear transform too. The other kernels keep the one loop (their registers). */
template <class Traits, bool kBranchOutside = false>
__device__ __forceinline__ void transform_scores(float (&s)[Traits::kMTiles][Traits::kNTilesS][4],
                                                 const ForwardKernelArgs& args) {
  const bool softcap = args.transform == ScoreTransform::kSoftcap;
  if constexpr (kBranchOutside) {
    if (!softcap) {
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mt][nt][i] *= args.pre_scale;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float x = s[mt][nt][i] * args.pre_scale;
        s[mt][nt][i] = softcap ? args.post_scale * tanhf(x) : x;
      }
    }
  }
}

/** ALiBi: adds alibi_log2 * |i + sk - sq - j| to each (transformed, log2-unit) score. diagonal:
 *  this lane's row of m-tile 0 plus seqlen_k - seqlen_q, minus the tile's key 0 (tile-local, so
 *  32 bits hold it). Runs before mask_scores, which overwrites masked scores with -inf. The
 *  distances are floats less compile-time column offsets (exact below 2^24): an int-to-float
 *  conversion per score would run on the exponentials' 16-per-clock unit. */
template <class Traits>
__device__ __forceinline__ void add_alibi_bias(float (&s)[Traits::kMTiles][Traits::kNTilesS][4], float alibi_log2,
                                               int diagonal, int lane_quad) {
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float row_diagonal = static_cast<float>(diagonal + mt * Traits::kMmaM + 8 * h - 2 * lane_quad);
#pragma unroll
      for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float distance = row_diagonal - static_cast<float>(nt * Traits::kMmaN + e);
          float& x = s[mt][nt][2 * h + e];
          x = fmaf(alibi_log2, fabsf(distance), x);
        }
      }
    }
  }
}

/** -inf for every score whose key is outside its row's MaskInfo range (which also excludes keys
 *  >= seqlen_k). first_row: this lane's row of m-tile 0 (in-sequence index); n0: the tile's key 0. */
template <class Traits>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kMTiles][Traits::kNTilesS][4],
                                            const MaskInfo& mask, int first_row, int n0,
                                            int lane_quad) {
  constexpr float kNegInf = -__builtin_huge_valf();
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const KeyRange allowed = mask.keys_for_row(first_row + mt * Traits::kMmaM + 8 * h);
      const int64_t lo64 = allowed.begin - n0;  // tile-relative, clamped to [0, kBlockN]
      const int64_t hi64 = allowed.end - n0;
      const int lo = static_cast<int>(lo64 < 0 ? 0 : (lo64 > Traits::kBlockN ? Traits::kBlockN : lo64));
      const int hi = static_cast<int>(hi64 < 0 ? 0 : (hi64 > Traits::kBlockN ? Traits::kBlockN : hi64));
#pragma unroll
      for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = nt * Traits::kMmaN + 2 * lane_quad + e;
          if (key < lo || key >= hi) s[mt][nt][2 * h + e] = kNegInf;
        }
      }
    }
  }
}

/** Where a lane's dropout draws of one key tile come from (kDropout kernels; common/dropout.hpp,
 *  dropout_fragment.hpp). params points into the kernel's parameters (the Philox key, offset and
 *  threshold). */
struct DropoutTile {
  const DropoutParams* params;
  uint32_t bh;    // b * heads_q + h
  int first_row;  // this lane's row of m-tile 0 (in-sequence)
  int n0;         // the tile's key 0, a multiple of kBlockN (itself a multiple of 32)
  int quad;       // lane % 4
};

/** Dropout of one accumulator row (m-tile mt, half h) of P: entries whose draw is not kept
 *  become 0. One Philox call per 32 keys, its four words consumed right away (word n of call u
 *  holds the draws of n-tile 4u + n, low half the even column), so only they and the counter are
 *  live for a moment. keep_scale is not applied here: the epilogue folds it into 1 / l. */
template <class Traits>
__device__ __forceinline__ void drop_row(float (&s)[Traits::kMTiles][Traits::kNTilesS][4], int mt, int h,
                                         const DropoutTile& drop) {
  static_assert(Traits::kBlockN % 32 == 0, "dropout draws cover whole 32-key halves of a tile");
  const DropoutParams& d = *drop.params;
  const uint32_t row = static_cast<uint32_t>(drop.first_row + mt * Traits::kMmaM + 8 * h);
#pragma unroll
  for (int u = 0; u < Traits::kNTilesS / 4; ++u) {
    const PhiloxWords words =
        dropout_quad_words(d, drop.bh, row, static_cast<uint32_t>(drop.n0 + 32 * u), drop.quad);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[mt][4 * u + n][2 * h + e];
        x = dropout_draw_kept(words.w[n], e, d) ? x : 0.f;
      }
    }
  }
}

/** One online-softmax step: updates the reference row max (lazily), the partial row sums, writes
 *  P (rounded, A-fragment form) and the factor alpha by which O must be rescaled. Returns whether
 *  any of this lane's rows moved its reference max (alpha != 1). kDropout: the row sums take every
 *  probability (l and the lse ignore dropout), then the dropped ones are zeroed before P is packed
 *  for the P V product.
 *
 *  Lazy rescaling: the reference max only moves when a tile's max exceeds it by more than
 *  `rescale_threshold` (kRescaleThresholdLog2 in log2 units), so P <= 2^threshold and O needs
 *  rescaling only on those rare tiles. The result is exact either way: l and O always refer to the
 *  same reference max, which the epilogue uses for O / l and the lse. */
template <class Traits, bool kDropout = false>
__device__ __forceinline__ bool online_softmax(float (&s)[Traits::kMTiles][Traits::kNTilesS][4],
                                               float (&row_max)[Traits::kMTiles][2],
                                               float (&row_sum)[Traits::kMTiles][2],
                                               float (&alpha)[Traits::kMTiles][2],
                                               uint32_t (&p)[Traits::kMTiles][Traits::kKStepsO][4],
                                               float exp2_scale, float rescale_threshold,
                                               const DropoutTile& drop = {}) {
  using Ops = ElementOps<typename Traits::Element>;
  constexpr float kNegInf = -__builtin_huge_valf();
  bool any_raised = false;
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Pairwise tree: log-depth dependency chain instead of one FMNMX after another.
      float partial_max[Traits::kNTilesS];
#pragma unroll
      for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
        partial_max[nt] = fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
      }
#pragma unroll
      for (int count = Traits::kNTilesS; count > 1; count = (count + 1) / 2) {
#pragma unroll
        for (int i = 0; i < count / 2; ++i) {
          partial_max[i] = fmaxf(partial_max[i], partial_max[i + (count + 1) / 2]);
        }
      }
      const float tile_max = quad_allreduce_max(partial_max[0]);
      const float old_max = row_max[mt][h];
      // old_max = -inf and a finite tile max also raises (-inf + threshold = -inf).
      const bool raise = tile_max > old_max + rescale_threshold;
      const float new_max = raise ? tile_max : old_max;
      // A row with no allowed key so far keeps max -inf; 0 avoids exp2(-inf - -inf) = NaN.
      const float scaled_max = new_max == kNegInf ? 0.f : new_max * exp2_scale;
      alpha[mt][h] = raise ? fast_exp2(old_max * exp2_scale - scaled_max) : 1.f;
      any_raised = any_raised || raise;
      row_max[mt][h] = new_max;
      // Two interleaved partial sums halve the FADD dependency chain.
      float sum[2] = {row_sum[mt][h] * alpha[mt][h], 0.f};
#pragma unroll
      for (int nt = 0; nt < Traits::kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float prob = fast_exp2(fmaf(s[mt][nt][2 * h + e], exp2_scale, -scaled_max));
          s[mt][nt][2 * h + e] = prob;
          sum[e] += prob;
        }
      }
      row_sum[mt][h] = sum[0] + sum[1];
      if constexpr (kDropout) drop_row<Traits>(s, mt, h, drop);
    }
#pragma unroll
    for (int kk = 0; kk < Traits::kKStepsO; ++kk) {
      // C fragments of S tiles 2kk, 2kk+1 = A fragment of P V k-step kk (see the top comment).
      p[mt][kk][0] = Ops::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      p[mt][kk][1] = Ops::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      p[mt][kk][2] = Ops::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      p[mt][kk][3] = Ops::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
  }
  return any_raised;
}

template <class Traits>
__device__ __forceinline__ void rescale_o(float (&o)[Traits::kMTiles][Traits::kNTilesO][4],
                                          const float (&alpha)[Traits::kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Traits::kNTilesO; ++dt) {
      o[mt][dt][0] *= alpha[mt][0];
      o[mt][dt][1] *= alpha[mt][0];
      o[mt][dt][2] *= alpha[mt][1];
      o[mt][dt][3] *= alpha[mt][1];
    }
  }
}

/** The pipeline barrier of one key group: the whole CTA when there is a single group, else the
 *  group's own named barrier (id 1 + group), so groups run their loops independently. */
template <class Traits>
__device__ __forceinline__ void key_group_sync(int key_group) {
  if constexpr (Traits::kKeyGroups == 1) {
    __syncthreads();
  } else {
    named_barrier_sync<Traits::kGroupThreads>(1 + key_group);
  }
}

/** Merges the online-softmax states of the key groups into group 0's registers (called by every
 *  thread of the CTA after its group's loop). Warp w of every group holds the same rows with the
 *  same fragment layout, so thread t of group g >= 1 hands its O accumulators, reference row max
 *  and partial row sums to thread t of group 0 through group g's smem region (its K/V are dead
 *  after the group barrier). Group 0 rescales every state to the largest reference max, in group
 *  order (deterministic). A state with max -inf (no allowed key) gets weight exp2(-inf) = 0; when
 *  all are -inf the subtrahend is 0 (no -inf - -inf = NaN), leaving O = 0, sum 0, max -inf, which
 *  the epilogue turns into out = 0, lse = -inf.
 *
 *  The stores of groups >= 1 and group 0's loads are ordered by the __syncthreads between them:
 *  every one of the kThreads threads reaches that single bar.sync 0 (no thread has returned, the
 *  barrier is outside any group-dependent branch), each after its own stores, and every load comes
 *  after it. Each group's region is written only by that group (its cp.async copies were waited for
 *  before the group barrier above), so nothing else touches the scratch. Still, compute-sanitizer
 *  racecheck (2025.3, H100) reported RAW hazards between these stores and group 0's loads, and
 *  only in CTAs where group 0's key share was empty while a writer's was not (the 1-3 tile blocks
 *  of 77 x 131 keys at d64, or of causal S=256, when the shares were floor(tiles * g / 4) splits
 *  that left the remainder to the highest groups). The hazards vanish when group 0 takes a share
 *  whenever any group does (the larger shares go to the lowest groups, see forward_kernel) and
 *  also when every group passes the same number of pipeline barriers; racecheck's tracking of the
 *  per-group named barriers evidently does not order a group that ran no loop. The shares now go
 *  largest-first, which costs nothing and keeps the checker usable on this path. */
template <class Traits>
__device__ __forceinline__ void merge_key_groups(
    float (&o)[Traits::kMTiles][Traits::kNTilesO][4], float (&row_max)[Traits::kMTiles][2],
    float (&row_sum)[Traits::kMTiles][2], unsigned char* smem, int key_group, int group_thread,
    float exp2_scale) {
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTilesO = Traits::kNTilesO;
  constexpr float kNegInf = -__builtin_huge_valf();
  auto region = [&](int group) {  // the group's K/V region, the merge scratch
    return smem + Traits::kSmemGroupsOffset + group * Traits::kSmemGroupBytes;
  };
  auto o_slot = [&](int group, int mt, int dt) {
    return reinterpret_cast<float4*>(region(group)) + (mt * kNTilesO + dt) * Traits::kGroupThreads +
           group_thread;
  };
  auto stats_slot = [&](int group, int mt, int h) {
    return reinterpret_cast<float2*>(region(group) + Traits::kMergeOBytes) +
           (mt * 2 + h) * Traits::kGroupThreads + group_thread;
  };

  key_group_sync<Traits>(key_group);  // every warp of the group is done with its K/V buffers
  FWD80_TRACE(kPhaseGroupDone);
  if (key_group != 0) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt) {
        *o_slot(key_group, mt, dt) =
            make_float4(o[mt][dt][0], o[mt][dt][1], o[mt][dt][2], o[mt][dt][3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *stats_slot(key_group, mt, h) = make_float2(row_max[mt][h], row_sum[mt][h]);
      }
    }
  }
  __syncthreads();
  FWD80_TRACE(kPhaseMergeBarrier);
  if (key_group != 0) {
    FWD80_TRACE(kPhaseEndNs);
    return;
  }

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    float2 stats[Traits::kKeyGroups][2];
    float weight[Traits::kKeyGroups][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      stats[0][h] = make_float2(row_max[mt][h], row_sum[mt][h]);
      float merged_max = stats[0][h].x;
#pragma unroll
      for (int g = 1; g < Traits::kKeyGroups; ++g) {
        stats[g][h] = *stats_slot(g, mt, h);
        merged_max = fmaxf(merged_max, stats[g][h].x);
      }
      const float scaled_max = merged_max == kNegInf ? 0.f : merged_max * exp2_scale;
      float sum = 0.f;
#pragma unroll
      for (int g = 0; g < Traits::kKeyGroups; ++g) {
        weight[g][h] = fast_exp2(stats[g][h].x * exp2_scale - scaled_max);
        sum += weight[g][h] * stats[g][h].y;
      }
      row_max[mt][h] = merged_max;
      row_sum[mt][h] = sum;
    }
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
      float acc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = o[mt][dt][i] * weight[0][i / 2];
#pragma unroll
      for (int g = 1; g < Traits::kKeyGroups; ++g) {
        const float4 part = *o_slot(g, mt, dt);
        acc[0] += part.x * weight[g][0];
        acc[1] += part.y * weight[g][0];
        acc[2] += part.z * weight[g][1];
        acc[3] += part.w * weight[g][1];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][dt][i] = acc[i];
    }
  }
}

// ---- the kernel ---------------------------------------------------------------------------------

/** kAlibi: the scores carry ALiBi biases (p.alibi_slopes; only the transforming bodies are
 *  compiled). A kernel of its own, so that the common kernels keep their register allocation.
 *  kDropout: P is dropped with p.dropout (drop_row) and the output scaled by keep_scale; also a
 *  kernel of its own (the Philox rounds are ~60 integer instructions per 32 keys of a row). */
template <class Traits, bool kAlibi = false, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    forward_kernel(const __grid_constant__ ForwardKernelArgs args) {
  using Element = typename Traits::Element;
  using Ops = ElementOps<Element>;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kWarpRows = Traits::kWarpRows;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTilesO = Traits::kNTilesO;
  constexpr int kKStepsO = Traits::kKStepsO;
  constexpr float kNegInf = -__builtin_huge_valf();
  using std::false_type;
  using std::true_type;

  const AttentionParams& p = args.params;

  // ---- which tile this CTA computes --------------------------------------------------------------
  // In 32 bits (launch_forward checks the ranges), from the kernel's parameters only, so before the
  // wait below: a short call's CTAs are on the critical path from their first instruction, and
  // the 64-bit divisions this used to make (block -> head, batch; head -> KV head) are ~100-
  // instruction routines: the seed shape's CTAs issued their first load ~2650 cycles after the
  // wait, of ~11800 in all (1220 of ~9700 now; docs/PERF.md, session 17).
  // Head by head, each head's last (costliest) query block first, the grid's tail in order of
  // falling cost across its heads (grid_order.hpp).
  const GridPosition position = grid_position</*kHeaviestLast=*/true>(args.order, static_cast<int>(blockIdx.x));
  const int head_batch = position.pair;
  const int m_block = position.block;
  const int batch_index = head_batch / args.heads_q;
  const int head_index = head_batch - batch_index * args.heads_q;
  const int64_t head = head_index;
  const int64_t batch = batch_index;
  const int64_t kv_head = head_index / args.group_size;
  // The per-head base pointers: on the small-grid path formed here too, with the parameters the
  // first loads need, since every launch's parameter block is new to the constant cache and these
  // reads otherwise sit between the wait and the first load (the empty asm keeps them before the
  // wait). The default configurations form them after the wait, as before: formed here they
  // changed the d256 kernel's register allocation and cost it 3.5-4.5% (docs/PERF.md, session 17).
  auto head_pointers = [&] {
    return HeadPointers<Element>{
        static_cast<const Element*>(p.q.data) + batch * p.q.batch_stride + head * p.q.head_stride,
        static_cast<const Element*>(p.k.data) + batch * p.k.batch_stride + kv_head * p.k.head_stride,
        static_cast<const Element*>(p.v.data) + batch * p.v.batch_stride + kv_head * p.v.head_stride,
        static_cast<Element*>(p.out.data) + batch * p.out.batch_stride + head * p.out.head_stride};
  };
  HeadPointers<Element> heads{};
  if constexpr (Traits::kKeyGroups > 1) {
    heads = head_pointers();
    asm volatile("" ::"l"(heads.q), "l"(heads.k), "l"(heads.v), "l"(heads.out), "l"(p.lse.data),
                 "l"(p.cu_seqlens_q), "l"(p.seqlen_k));
  }
  const bool unbounded_mask = p.window_left < 0 && p.window_right < 0;  // every key for every row

  // Launched as a programmatic dependent (launch_forward): nothing global is read before the
  // previous kernel on the stream is complete; the next one may be placed from here on. The
  // branch, always taken (the pair index is never negative), ties the wait to the index math:
  // without it ptxas hoists the wait above all of the above.
  if (head_batch >= 0) ptx::wait_previous_grid();
  ptx::allow_next_grid();
  FWD80_TRACE(kPhaseStartNs);
  FWD80_TRACE(kPhaseStart);
  if constexpr (Traits::kKeyGroups == 1) heads = head_pointers();

  const SeqInfo seq = seq_info(p, batch);
  const int seqlen_q = static_cast<int>(seq.seqlen_q);
  const int seqlen_k = static_cast<int>(seq.seqlen_k);
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen_q) return;  // varlen: this sequence is shorter than max_seqlen_q
  const int rows_end = min(m0 + kBlockM, seqlen_q);
  const MaskInfo mask = mask_info(p, seq);
  const KeyRange keys =
      unbounded_mask ? KeyRange{0, seq.seqlen_k} : mask.keys_for_rows(m0, rows_end);
  int n_block_begin = keys.empty() ? 0 : static_cast<int>(keys.begin / kBlockN);
  int n_block_end = keys.empty() ? 0 : static_cast<int>(ceil_div<int64_t>(keys.end, kBlockN));

  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int lane_group = lane / 4;  // accumulator row within a 16-row tile (and +8)
  const int lane_quad = lane % 4;   // accumulator column pair
  // Key groups: group g takes a contiguous share of the block's key tiles, in order; the shares
  // differ by at most one tile and the larger ones go to the lowest groups, so group 0 (which
  // merges) never runs fewer loop iterations, hence pipeline barriers, than a group it reads from
  // (see merge_key_groups for why that matters).
  const int key_group = Traits::kKeyGroups == 1 ? 0 : warp / Traits::kGroupWarps;
  const int group_warp = Traits::kKeyGroups == 1 ? warp : warp % Traits::kGroupWarps;
  const int group_thread = Traits::kKeyGroups == 1 ? thread : thread % Traits::kGroupThreads;
  const int warp_row0 = group_warp * kWarpRows;
  if constexpr (Traits::kKeyGroups > 1) {
    const int tiles = n_block_end - n_block_begin;
    const int share = tiles / Traits::kKeyGroups;
    const int larger_shares = tiles % Traits::kKeyGroups;  // groups 0 .. larger_shares-1 get +1
    const int group_begin =
        n_block_begin + key_group * share + (key_group < larger_shares ? key_group : larger_shares);
    n_block_end = group_begin + share + (key_group < larger_shares ? 1 : 0);
    n_block_begin = group_begin;
  }

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_q = ptx::smem_addr(smem);
  const uint32_t smem_group =
      smem_q + Traits::kSmemGroupsOffset + key_group * Traits::kSmemGroupBytes;
  const uint32_t smem_k = smem_group + Traits::kSmemKOffset;
  const uint32_t smem_v = smem_group + Traits::kSmemVOffset;

  const int head_dim = static_cast<int>(p.head_dim);
  const Element* q_block = heads.q + (seq.q_start + m0) * p.q.row_stride;
  const Element* k_seq = heads.k + seq.k_start * p.k.row_stride;
  const Element* v_seq = heads.v + seq.k_start * p.v.row_stride;
  // First element of the key tile at n0 (a multiple of kBlockN): in the sequence's rows, or in its
  // page (kv_offset: one table read per tile; the tile's rows follow at row_stride). Caching the
  // page across the 4-8 tiles it holds measured the same at prefill (docs/PERF.md, session 27)
  // and spilled more, so the lookup stays per tile.
  auto kv_tile = [&](const Element* seq_rows, const TensorRef& t, int n0) -> const Element* {
    if constexpr (Traits::kPagedKV) {
      return static_cast<const Element*>(t.data) + kv_offset(p, t, batch, n0, kv_head);
    } else {
      return seq_rows + n0 * t.row_stride;
    }
  };

  float acc_o[kMTiles][kNTilesO][4];
  float row_max[kMTiles][2];  // reference max, raw (or transformed) score units
  float row_sum[kMTiles][2];  // this thread's partial sum; quad-reduced in the epilogue
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mt][h] = kNegInf;
      row_sum[mt][h] = 0.f;
    }
  }
  const float exp2_scale = args.exp2_scale;

  using QLoader = TileLoader<QTile, Traits::kThreads>;
  using KVLoader = TileLoader<KVTile, Traits::kGroupThreads>;
  auto load_k = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    KVLoader::load_async(smem_k + stage * KVTile::kBytes, kv_tile(k_seq, p.k, n0), p.k.row_stride, seqlen_k - n0,
                         head_dim, group_thread);
  };
  auto load_v = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    KVLoader::load_async(smem_v + stage * KVTile::kBytes, kv_tile(v_seq, p.v, n0), p.v.row_stride, seqlen_k - n0,
                         head_dim, group_thread);
  };
  auto issue_first_tile = [&] {  // K_first (+ V_first without the overlap), one cp.async group
    load_k(n_block_begin, 0);
    if constexpr (!Traits::kOverlapPV) load_v(n_block_begin, 0);
    ptx::cp_async_commit();
  };
  // Prologue. One group: {Q, first tile} in one cp.async group, waited for by iteration 0.
  // Key groups share one Q: the whole CTA loads it, each group issues its first tile behind it,
  // and one CTA barrier publishes every thread's Q chunks to all groups (keys.empty() is the same
  // for every thread of the CTA, so all of them reach it). A copy per group cost the seed shape
  // 0.1-0.2 us: ~550 cycles more before its first tile landed (docs/PERF.md, session 17).
  if constexpr (Traits::kKeyGroups == 1) {
    if (n_block_begin < n_block_end) {
      QLoader::load_async(smem_q, q_block, p.q.row_stride, seqlen_q - m0, head_dim, thread);
      issue_first_tile();
    }
  } else if (!keys.empty()) {
    QLoader::load_async(smem_q, q_block, p.q.row_stride, seqlen_q - m0, head_dim, thread);
    ptx::cp_async_commit();
    if (n_block_begin < n_block_end) {
      issue_first_tile();
      FWD80_TRACE(kPhaseFirstIssued);
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
  }

  if (n_block_begin < n_block_end) {

    // Per-lane ldmatrix addresses (see the fragment comment at the top).
    const LdmatrixLaneAddress<QTile> q_address(smem_q, warp_row0 + lane % 8 + ((lane / 8) % 2) * 8,
                                               lane / 16);
    const LdmatrixLaneAddress<KVTile> k_address(0, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LdmatrixLaneAddress<KVTile> v_address(0, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const int lane_first_row = m0 + warp_row0 + lane_group;
    const float alibi_log2 = kAlibi ? -p.alibi_slope(batch, head) * kLog2e : 0.f;  // per unit of distance
    // Dropout's problem index b * heads_q + h: below 2^32 (validate.cpp), so 32-bit math is exact.
    const uint32_t dropout_bh =
        kDropout ? static_cast<uint32_t>(batch_index) * static_cast<uint32_t>(args.heads_q) + static_cast<uint32_t>(head_index)
                 : 0u;

    uint32_t q_frag[Traits::kQFragMTiles][Traits::kQFragKSteps][4];
    // Carried from one iteration to the next: P of the previous tile (its P V runs one iteration
    // later) and the O rescale factor its softmax produced, applied before that P V.
    uint32_t p_prev[kMTiles][kKStepsO][4];
    float alpha_prev[kMTiles][2];
    bool rescale_pending = false;

    // Iteration j (kOverlapPV): wait K_j, V_{j-1}; barrier; issue K_{j+1}, V_j; O *= alpha_{j-1}
    // if needed; S_j = Q K_j; softmax_j -> P_j; O += P_{j-1} V_{j-1}. The P V product is
    // independent of softmax_j, so the scheduler interleaves the two; the only branch (the rare O
    // rescale) sits right after the barrier so that it does not split that block.
    // Without the overlap: wait K_j, V_j; barrier; issue K_{j+1}, V_{j+1}; S_j; softmax_j;
    // O *= alpha_j if needed; O += P_j V_j.
    // Either way one barrier per tile: after it every warp is done with the buffers of tile j-1,
    // which the loads issued right after it overwrite.
    auto iteration = [&](int n_block, auto has_prev, auto masked, auto general) {
      constexpr bool kHasPrev = decltype(has_prev)::value;
      const int stage = (n_block - n_block_begin) & 1;
      ptx::cp_async_wait<0>();
      key_group_sync<Traits>(key_group);
      const int tile_index = n_block - n_block_begin;
      if (tile_index < 2) FWD80_TRACE(kPhaseTile0Landed + 2 * tile_index);
      if constexpr (Traits::kOverlapPV) {
        if (n_block + 1 < n_block_end) load_k(n_block + 1, stage ^ 1);
        load_v(n_block, stage);
      } else if (n_block + 1 < n_block_end) {
        load_k(n_block + 1, stage ^ 1);
        load_v(n_block + 1, stage ^ 1);
      }
      ptx::cp_async_commit();
      if constexpr (Traits::kOverlapPV && kHasPrev) {
        if (rescale_pending) rescale_o<Traits>(acc_o, alpha_prev);
      }

      if constexpr (!kHasPrev && Traits::kQInRegs) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int kk = 0; kk < Traits::kKStepsS; ++kk) {
            ptx::ldmatrix_x4(q_frag[mt][kk], q_address.at(mt * Traits::kMmaM, kk));
          }
        }
      }
      float s[kMTiles][Traits::kNTilesS][4];
      qk_gemm<Traits>(s, q_frag, q_address, smem_k + stage * KVTile::kBytes, k_address);
      if constexpr (decltype(general)::value) {
        transform_scores<Traits, kAlibi>(s, args);
        // ALiBi (transforming bodies only: resolve_score_scales never folds the scale under it).
        if constexpr (kAlibi) {
          add_alibi_bias<Traits>(s, alibi_log2, lane_first_row + seqlen_k - seqlen_q - n_block * kBlockN, lane_quad);
        }
      }
      if constexpr (decltype(masked)::value) {
        mask_scores<Traits>(s, mask, lane_first_row, n_block * kBlockN, lane_quad);
      }
      uint32_t p_next[kMTiles][kKStepsO][4];
      const bool raised = online_softmax<Traits, kDropout>(
          s, row_max, row_sum, alpha_prev, p_next, exp2_scale, args.rescale_threshold,
          DropoutTile{&p.dropout, dropout_bh, lane_first_row, n_block * kBlockN, lane_quad});
      if constexpr (Traits::kOverlapPV) {
        // O is still zero after the first tile: nothing to rescale.
        rescale_pending = kHasPrev && __any_sync(kFullWarpMask, raised);
        if constexpr (kHasPrev) {
          pv_gemm<Traits>(acc_o, p_prev, smem_v + (stage ^ 1) * KVTile::kBytes, v_address);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int kk = 0; kk < kKStepsO; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) p_prev[mt][kk][i] = p_next[mt][kk][i];
          }
        }
      } else {
        if (kHasPrev && __any_sync(kFullWarpMask, raised)) rescale_o<Traits>(acc_o, alpha_prev);
        pv_gemm<Traits>(acc_o, p_next, smem_v + stage * KVTile::kBytes, v_address);
      }
      if (tile_index < 2) FWD80_TRACE(kPhaseTile0Done + 2 * tile_index);
    };

    // Specialized bodies keep the common path branch-free: fully visible tiles skip the
    // per-element mask, and softcap / negative-scale calls run transforming, always-masked bodies.
    // The first tile takes the masked body, except on the small-grid path: there a group's loop
    // is one or two tiles, and the masked first body cost the seed shape 0.36 us of 6.2 (the
    // default configurations keep one body fewer: with it they spilled 40-70 bytes more).
    auto mainloop = [&](auto general) {
      const int first_n0 = n_block_begin * kBlockN;
      if constexpr (Traits::kKeyGroups > 1 && !decltype(general)::value) {
        if (mask.tile_fully_visible(m0, rows_end, first_n0, first_n0 + kBlockN)) {
          iteration(n_block_begin, false_type{}, false_type{}, general);
        } else {
          iteration(n_block_begin, false_type{}, true_type{}, general);
        }
      } else {
        iteration(n_block_begin, false_type{}, true_type{}, general);
      }
      for (int n_block = n_block_begin + 1; n_block < n_block_end; ++n_block) {
        const int n0 = n_block * kBlockN;
        if (decltype(general)::value || !mask.tile_fully_visible(m0, rows_end, n0, n0 + kBlockN)) {
          iteration(n_block, true_type{}, true_type{}, general);
        } else {
          iteration(n_block, true_type{}, false_type{}, general);
        }
      }
    };
    if constexpr (kAlibi) {
      mainloop(true_type{});
    } else if (args.transform == ScoreTransform::kFoldedScale) {
      mainloop(false_type{});
    } else {
      mainloop(true_type{});
    }

    if constexpr (Traits::kOverlapPV) {  // the last tile's P V
      ptx::cp_async_wait<0>();
      key_group_sync<Traits>(key_group);
      FWD80_TRACE(kPhaseLastVLanded);
      const int last_stage = (n_block_end - 1 - n_block_begin) & 1;
      if (rescale_pending) rescale_o<Traits>(acc_o, alpha_prev);
      pv_gemm<Traits>(acc_o, p_prev, smem_v + last_stage * KVTile::kBytes, v_address);
      FWD80_TRACE(kPhaseLoopDone);
    } else {
      ptx::cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight
    }
  }

  if constexpr (Traits::kKeyGroups > 1) {
    merge_key_groups<Traits>(acc_o, row_max, row_sum, smem, key_group, group_thread, exp2_scale);
    if (key_group != 0) return;  // group 0 alone writes the block
    FWD80_TRACE(kPhaseMerged);
  }

  // ---- epilogue: normalize, lse, stage O in this warp's Q rows, 16-byte stores ------------------
  __syncwarp();  // this warp's ldmatrix reads of its Q rows are done before they are overwritten
  float* lse_row0 = nullptr;
  if (p.lse.data != nullptr) {
    lse_row0 = p.lse.data + batch * p.lse.batch_stride + head * p.lse.head_stride +
               (seq.q_start + m0) * p.lse.row_stride;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = quad_allreduce_sum(row_sum[mt][h]);
      // Dropout: O = (sum_j P_j Z_j v_j) / l with Z_j = keep_scale on kept entries (drop_row left
      // P_j or 0), so keep_scale joins 1 / l; l and the lse below saw every P_j.
      const float numerator = kDropout ? p.dropout.keep_scale : 1.f;
      const float inv_total = total > 0.f ? numerator / total : 0.f;
      const int block_row = warp_row0 + mt * Traits::kMmaM + lane_group + 8 * h;
      if (lse_row0 != nullptr && lane_quad == 0 && m0 + block_row < seqlen_q) {
        const float lse =
            total > 0.f ? (row_max[mt][h] * exp2_scale + __log2f(total)) * kLn2 : kNegInf;
        lse_row0[block_row * p.lse.row_stride] = lse;
      }
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt) {
        const uint32_t packed =
            Ops::pack(acc_o[mt][dt][2 * h] * inv_total, acc_o[mt][dt][2 * h + 1] * inv_total);
        // One 8-column d-tile is one 16-byte chunk; this lane's column pair sits at byte 4 * quad.
        store_shared_4(smem_q + QTile::offset(block_row, dt) + lane_quad * 4, packed);
      }
    }
  }
  __syncwarp();

  constexpr int kChunksPerRow = QTile::kChunksPerRow;
  if constexpr (Traits::kSteppedOutputStores) {
    // A pass stores kRowsPerPass whole rows, lane l taking chunk l % kChunksPerRow of row
    // l / kChunksPerRow. Row lane_row + pass * kRowsPerPass of the warp has row % 8 equal to
    // lane_row ^ (pass * kRowsPerPass % 8) (kRowsPerPass is a power of two <= 8 above lane_row),
    // so kLoadPatterns bases (pattern i: the row i * kRowsPerPass further on) plus immediates
    // address every load; the output pointer steps by a fixed stride, as in TileLoader.
    constexpr int kRowsPerPass = kWarpSize / kChunksPerRow;
    static_assert(kWarpSize % kChunksPerRow == 0 && kRowsPerPass <= kSwizzleChunks &&
                      kWarpRows % kRowsPerPass == 0,
                  "a pass stores whole rows, and the passes cover the warp's rows");
    constexpr int kPasses = kWarpRows / kRowsPerPass;
    constexpr int kLoadPatterns = kSwizzleChunks / kRowsPerPass;
    const int lane_row = static_cast<int>(static_cast<unsigned>(lane) / kChunksPerRow);
    const int lane_chunk = static_cast<int>(static_cast<unsigned>(lane) % kChunksPerRow);
    const uint32_t load_row = smem_q + static_cast<uint32_t>((warp_row0 + lane_row) * QTile::kRowBytes);
    uint32_t load_base[kLoadPatterns];
#pragma unroll
    for (int i = 0; i < kLoadPatterns; ++i) {
      load_base[i] = load_row + static_cast<uint32_t>(i * kRowsPerPass * QTile::kRowBytes +
                                                      ((lane_chunk ^ lane_row) ^ (i * kRowsPerPass)) * kChunkBytes);
    }
    const bool chunk_valid = lane_chunk * kChunkElems < head_dim;
    const int lane_rows_valid = seqlen_q - m0 - warp_row0 - lane_row;
    Element* out_lane = heads.out + (seq.q_start + m0 + warp_row0 + lane_row) * p.out.row_stride +
                        lane_chunk * kChunkElems;
    const int64_t pass_stride = kRowsPerPass * p.out.row_stride;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const uint4 value = load_shared_16(
          load_base[pass % kLoadPatterns] +
          static_cast<uint32_t>((pass / kLoadPatterns) * kSwizzleChunks * QTile::kRowBytes));
      if (chunk_valid && pass * kRowsPerPass < lane_rows_valid) {
        // Through the wrapper: the plain uint4 store through the stepped pointer became four
        // 4-byte STG.E here, as in session 53's postprocess (ptx/global_store.cuh).
        ptx::store_global_v4(out_lane, value.x, value.y, value.z, value.w);
      }
      out_lane += pass_stride;
    }
  } else {
    constexpr int kWarpChunks = kWarpRows * kChunksPerRow;
    static_assert(kWarpChunks % kWarpSize == 0, "whole passes");
    Element* out_block = heads.out + (seq.q_start + m0) * p.out.row_stride;
#pragma unroll
    for (int pass = 0; pass < kWarpChunks / kWarpSize; ++pass) {
      const int index = pass * kWarpSize + lane;
      const int block_row = warp_row0 + index / kChunksPerRow;
      const int chunk = index % kChunksPerRow;
      const uint4 value = load_shared_16(smem_q + QTile::offset(block_row, chunk));
      if (m0 + block_row < seqlen_q && chunk * kChunkElems < head_dim) {
        *reinterpret_cast<uint4*>(out_block + block_row * p.out.row_stride + chunk * kChunkElems) =
            value;
      }
    }
  }
  FWD80_TRACE(kPhaseEnd);
  FWD80_TRACE(kPhaseEndNs);
}

// ---- host side ------------------------------------------------------------------------------------

/** Launches the forward kernel configured by Traits (kAlibi: its ALiBi version, kDropout: its
 *  dropout version) on p.stream. */
template <class Traits, bool kAlibi = false, bool kDropout = false>
Status launch_forward(const forward_params_t& p,
                      float rescale_threshold_log2 = kRescaleThresholdLog2) {
  const int64_t num_m_blocks = ceil_div<int64_t>(p.seqlen_q, Traits::kBlockM);
  const int64_t num_blocks = num_m_blocks * p.heads_q * p.batch;
  if (num_blocks == 0) return Status::ok();
  if (num_blocks > INT_MAX) {
    return Status::unsupported("cuda_sm80 forward: " + std::to_string(num_blocks) +
                               " query blocks exceed the grid limit");
  }

  ForwardKernelArgs args{};
  args.params = p;
  // The tail in order of falling cost where a mask makes query blocks cost different amounts;
  // resident CTAs: SMs x kMinBlocksPerSm. The small grid (at most two waves) is then all tail: its
  // first wave takes the costliest blocks (session 49 measured the default tiles only).
  args.order = make_grid_order(p.heads_q * p.batch, num_m_blocks, /*costs_differ=*/p.has_mask(),
                               int64_t(device_limits(p.device_id).sm_count) * Traits::kMinBlocksPerSm);
  args.heads_q = static_cast<int>(p.heads_q);  // <= num_blocks <= INT_MAX
  args.group_size = static_cast<int>(p.group_size());
  const ScoreScales scales = resolve_score_scales(p);
  args.transform = scales.transform;
  args.exp2_scale = scales.exp2_scale;
  args.pre_scale = scales.pre_scale;
  args.post_scale = scales.post_scale;

  args.rescale_threshold = rescale_threshold_log2 / args.exp2_scale;

  ScopedDevice device(p.device_id);
  auto* kernel = forward_kernel<Traits, kAlibi, kDropout>;
  constexpr int kDefaultSmemLimit = 48 * 1024;
  if (Traits::kSmemBytes > kDefaultSmemLimit) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (err != cudaSuccess) {
      return Status::cuda(std::string("cuda_sm80 forward: cannot reserve shared memory: ") +
                          cudaGetErrorString(err));
    }
  }
  // A programmatic dependent of the kernel before it (the kernel waits for it first thing), so
  // back-to-back calls overlap one launch with the previous kernel's tail: the seed shape under
  // graph replay 6.8 -> 6.3 us on the H100 (docs/PERF.md, session 16).
  const cudaError_t err = launch_kernel(kernel, dim3(static_cast<unsigned>(num_blocks)), dim3(Traits::kThreads),
                                        Traits::kSmemBytes, static_cast<cudaStream_t>(p.stream),
                                        supports_programmatic_launch(p.device_id), args);
  if (err != cudaSuccess) {
    return Status::cuda(std::string("cuda_sm80 forward launch failed: ") + cudaGetErrorString(err));
  }
  return Status::ok();
}

/** True when the small-grid kernel's grid fits in at most two waves (it runs one CTA per SM), i.e.
 *  when the default grid leaves at least half of the GPU idle (short sequences, few heads; the
 *  measurements are in the top comment), and its shared memory fits the device (it does not on
 *  the ~100 KiB parts such as sm_86 / sm_89, which keep the default path). src/api/dispatch.cpp
 *  sends the one-wave part of this range to this backend on Hopper too: keep the two in step. */
template <class SmallTraits>
bool prefer_small_grid(const forward_params_t& p) {
  constexpr int64_t kMaxWaves = 2;
  const int64_t small_grid_blocks =
      ceil_div<int64_t>(p.seqlen_q, SmallTraits::kBlockM) * p.heads_q * p.batch;
  const DeviceLimits limits = device_limits(p.device_id);
  return small_grid_blocks <= kMaxWaves * limits.sm_count &&
         SmallTraits::kSmemBytes <= limits.max_smem_per_block;
}

/** Entry point instantiated once per (dtype, head-dim bucket) by the generated units: the default
 *  configuration, or the small-grid one where it is compiled and the grid would be small. Both give
 *  the same results up to fp32 rounding and are deterministic. The forward needs no workspace. */
// Switch for the small-grid path (kept for A/B measurements against the default configuration).
inline constexpr bool kSmallGridPathEnabled = true;

template <typename Element, int kHeadDim>
Status forward_run(const forward_params_t& p, void* /*workspace*/, size_t /*workspace_bytes*/) {
  using DefaultTraits = typename DefaultForwardTraits<Element, kHeadDim>::type;
  using SmallTraits = typename SmallGridForwardTraits<Element, kHeadDim>::type;
  // Dropout: DropoutForwardTraits only (the small-grid configuration is never taken for it), with
  // ALiBi, paged K/V or neither: three more kernels per unit, so that calls without dropout keep
  // theirs unchanged. Paged K/V with both ALiBi and dropout arrives gathered into packed rows
  // (forward_api.cu), so no paged kernel has both.
  if (p.dropout.enabled()) {
    using DropoutTraits = typename DropoutForwardTraits<Element, kHeadDim>::type;
    if (p.has_alibi()) return launch_forward<DropoutTraits, /*kAlibi=*/true, /*kDropout=*/true>(p);
    if (p.is_paged()) {
      return launch_forward<typename PagedForwardTraits<DropoutTraits>::type, /*kAlibi=*/false, /*kDropout=*/true>(p);
    }
    return launch_forward<DropoutTraits, /*kAlibi=*/false, /*kDropout=*/true>(p);
  }
  // ALiBi: the default tiles, read through the pages where K/V are paged (two more kernels per
  // unit). The bias counts keys inside the sequence, whatever page holds them.
  using PagedTraits = typename PagedForwardTraits<DefaultTraits>::type;
  if (p.has_alibi()) {
    return p.is_paged() ? launch_forward<PagedTraits, /*kAlibi=*/true>(p) : launch_forward<DefaultTraits, /*kAlibi=*/true>(p);
  }
  if (p.is_paged()) return launch_forward<PagedTraits>(p);
  if constexpr (kSmallGridPathEnabled && !std::is_void_v<SmallTraits>) {
    if (prefer_small_grid<SmallTraits>(p)) return launch_forward<SmallTraits>(p);
  }
  return launch_forward<DefaultTraits>(p);
}

}  // namespace flashcore::cuda::sm80
