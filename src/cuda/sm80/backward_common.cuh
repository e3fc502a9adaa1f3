// Building blocks shared by the sm80 backward kernels: tile-size traits per head-dim bucket,
// the swizzled shared-memory tile layout, a warp-level GEMM over shared-memory operands
// (ldmatrix + mma.sync m16n8k16), predicated cp.async tile loads and 16-byte tile stores.
//
// Relies on: src/cuda/ptx/{mma,cp_async}.cuh for the raw PTX, api/params.hpp for the
// parameter structs. Kept independent of the forward kernel's headers on purpose.
// Assumes what validation guarantees for the CUDA path: head_dim is a multiple of 8, row and
// head strides are multiples of 8 elements and data pointers are 16-byte aligned, so every
// 8-element chunk of a row is either entirely inside head_dim or entirely outside it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "api/params.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/sm80/backward_workspace.hpp"

namespace flashcore::cuda::sm80::bwd {

// ---- tile configuration ---------------------------------------------------------------------

/** Tile sizes and warp layouts of the backward kernels for one head-dim bucket.
 *  kBlockM query rows x kBlockN key rows per step; kStages buffers for the query-side tiles
 *  (Q, dO, lse, D) of the main kernel. Each of the GEMMs has its own warp grid:
 *    S, dP  (kBlockM x kBlockN)  : kSdpWarpsM x kSdpWarpsN
 *    dK, dV (kBlockN x kHeadDim) : kKvWarpsN  x kKvWarpsD
 *    dQ     (kBlockM x kHeadDim) : kDqWarpsM  x kDqWarpsD, kDqColChunk columns at a time
 *  (the chunking bounds the live fp32 registers while dK/dV accumulators are resident). */
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kSdpWarpsM_, int kKvWarpsN_,
          int kDqWarpsM_, int kDqColChunk_>
struct BackwardTraitsBase {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;

  static constexpr int kSdpWarpsM = kSdpWarpsM_;
  static constexpr int kSdpWarpsN = kWarps / kSdpWarpsM;
  static constexpr int kSdpWarpRows = kBlockM / kSdpWarpsM;
  static constexpr int kSdpWarpCols = kBlockN / kSdpWarpsN;
  static constexpr int kSdpMTiles = kSdpWarpRows / 16;
  static constexpr int kSdpNTiles = kSdpWarpCols / 8;

  static constexpr int kKvWarpsN = kKvWarpsN_;
  static constexpr int kKvWarpsD = kWarps / kKvWarpsN;
  static constexpr int kKvWarpRows = kBlockN / kKvWarpsN;
  static constexpr int kKvWarpCols = kHeadDim / kKvWarpsD;
  static constexpr int kKvMTiles = kKvWarpRows / 16;
  static constexpr int kKvNTiles = kKvWarpCols / 8;

  static constexpr int kDqWarpsM = kDqWarpsM_;
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;
  static constexpr int kDqWarpRows = kBlockM / kDqWarpsM;
  static constexpr int kDqWarpCols = kHeadDim / kDqWarpsD;
  static constexpr int kDqMTiles = kDqWarpRows / 16;
  static constexpr int kDqNTiles = kDqWarpCols / 8;
  static constexpr int kDqColChunk = kDqColChunk_;
  static constexpr int kDqChunkNTiles = kDqColChunk / 8;
  static constexpr int kDqChunks = kDqWarpCols / kDqColChunk;

  // Every warp tile is a whole number of 16-row mma tiles and of 16-column ldmatrix pairs.
  static_assert(kSdpWarpRows % 16 == 0 && kSdpWarpCols % 16 == 0, "S/dP warp tile");
  static_assert(kKvWarpRows % 16 == 0 && kKvWarpCols % 16 == 0, "dK/dV warp tile");
  static_assert(kDqWarpRows % 16 == 0 && kDqColChunk % 16 == 0 && kDqWarpCols % kDqColChunk == 0,
                "dQ warp tile");
  // The swizzle permutes 8 chunks of 16 bytes: every tile row must span a multiple of 64 elements.
  static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0 && kBlockM % 64 == 0, "swizzle width");
  static_assert(kStages == 1 || kStages == 2, "query-side buffering");
  // warp_gemm's alignment rule: warp origins along stored columns are multiples of a power of
  // two (in 16-byte chunks) at least as large as the tile steps taken from them.
  static constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }
  static_assert(is_pow2(kKvMTiles) && is_pow2(kKvNTiles) && is_pow2(kDqNTiles) && is_pow2(kDqChunkNTiles),
                "warp tile counts must be powers of two (swizzled addressing)");
};

template <int kHeadDim>
struct BackwardTraits;
// Shapes measured on an H100 against a few alternatives (see backward.cuh):
//  d=64 : 128 x 128 tiles (more reuse per shared-memory read than 64 x 128), S/dP warps 2 x 4
//         (64 x 32 warp tiles: +1% over 4 x 2 on an H200, session 53, and fewer spills);
//  d=128: 64 x 128 tiles, dQ warps 2 x 4 (32 x 32 warp tiles read less than 16 x 64 ones);
//  d=256: 64 x 64 tiles with single-buffered Q/dO (about 145 KiB of shared memory).
// All fit the 163 KiB an sm_80 block may use; Q/dO are double-buffered where that fits.
template <>
struct BackwardTraits<64> : BackwardTraitsBase<64, 128, 128, 2, 2, 4, 4, 32> {};
template <>
struct BackwardTraits<128> : BackwardTraitsBase<128, 64, 128, 2, 2, 4, 2, 32> {};
template <>
struct BackwardTraits<256> : BackwardTraitsBase<256, 64, 64, 1, 2, 2, 4, 64> {};

/** The configuration to use where a block may have more shared memory (e.g. 227 KiB on sm_90):
 *  at d=256, double-buffered Q/dO (about 209 KiB) runs about 5% faster. Elsewhere the same. */
template <int kHeadDim>
struct LargeSmemBackwardTraits {
  using type = BackwardTraits<kHeadDim>;
};
template <>
struct LargeSmemBackwardTraits<256> {
  using type = BackwardTraitsBase<256, 64, 64, 2, 2, 2, 4, 64>;
};

/** Tiles of the dropout kernels (backward_dkdv_kernel<..., kDropout = true>): a lane's Philox
 *  rounds need registers that d64's 128 x 128 tiles (32 x 64 S/dP warp tiles) do not have (the
 *  dropout kernel spilled 184 bytes there, nvcc 13 sm_80), so d64 takes d128's shape: 64 x 128
 *  tiles, 32 x 32 warp tiles (255 registers, no spills). Elsewhere the portable tiles. */
template <int kHeadDim>
struct DropoutBackwardTraits {
  using type = BackwardTraits<kHeadDim>;
};
template <>
struct DropoutBackwardTraits<64> {
  using type = BackwardTraitsBase<64, 64, 128, 2, 2, 4, 4, 32>;
};

/** Tiles of the deterministic dQ kernel (backward_dq.cuh), which holds a dQ accumulator instead
 *  of dK/dV: at d=64 the main kernel's 128 x 128 tiles would spill there, so it uses 64 x 128. */
template <int kHeadDim>
struct DeterministicDqTraits {
  using type = BackwardTraits<kHeadDim>;
};
template <>
struct DeterministicDqTraits<64> {
  using type = BackwardTraitsBase<64, 64, 128, 1, 2, 4, 4, 32>;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kChunkElems = 8;  // one 16-byte vector of 16-bit elements
constexpr int kWarpSize = 32;

// ---- element helpers ------------------------------------------------------------------------

template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Element, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    bits = *reinterpret_cast<const uint32_t*>(&h);
  }
  return bits;
}

/** The inverse of pack_pair: two 16-bit elements of one 32-bit word as floats (low first). */
template <typename Element>
__device__ __forceinline__ float2 unpack_pair(uint32_t bits) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
}

template <typename Element>
__device__ __forceinline__ float to_float(Element x) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

template <typename Element>
__device__ __forceinline__ Element from_float(float x) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

template <typename Element>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<Element, __half>) {
    ptx::mma_m16n8k16_f16(d, a, b);
  } else {
    ptx::mma_m16n8k16_bf16(d, a, b);
  }
}

// ---- shared-memory layout -------------------------------------------------------------------

/** Row-major tile of 16-bit elements, kCols wide, whose 16-byte chunks are XOR-swizzled with
 *  the row index: chunk c of row r lives at chunk c ^ (r % 8). Eight consecutive rows at the
 *  same logical chunk then hit eight different bank groups, so ldmatrix (normal or .trans),
 *  cp.async 16-byte writes and the 4-byte fragment stores are all conflict-free without padding. */
template <int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "the swizzle needs rows of at least 8 chunks");
  __device__ __forceinline__ static int offset(int row, int col) {
    return row * kCols + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
  }
};

// ---- warp GEMM ------------------------------------------------------------------------------

/** Returns x unchanged, hidden from the optimizer. The shared-memory addresses of the GEMMs
 *  depend only on the lane, so the compiler would otherwise hoist every one of them out of the
 *  main loop and keep them live in registers (a hundred-odd at d=128, which spills); recomputing
 *  them per GEMM costs a few integer instructions per ldmatrix instead. */
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

/** ldmatrix addresses of one lane into a swizzled tile, for a GEMM that walks the tile in steps
 *  of (d_row, d_chunk) from the lane's own (row, chunk): d_row a multiple of 8 rows (so row % 8,
 *  the swizzle key, never changes) and d_chunk an even number of 16-byte chunks, known at
 *  compile time once the GEMM loops unroll. Because the lane's chunk has no bit in common with
 *  (d_chunk % 8) (see the alignment rule on warp_gemm),
 *    ((chunk + d_chunk) ^ key) = ((chunk ^ key) ^ (d_chunk % 8)) + (d_chunk - d_chunk % 8),
 *  so four base addresses (one per value of d_chunk % 8) plus immediate offsets cover every step. */
template <int kLd>
struct SwizzledOperand {
  static constexpr int kElemBytes = 2;
  uint32_t base[4];

  __device__ __forceinline__ SwizzledOperand(uint32_t tile_addr, int row, int chunk) {
    const int swizzled_chunk = chunk ^ (row & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) base[j] = tile_addr + (row * kLd + ((swizzled_chunk ^ (2 * j)) << 3)) * kElemBytes;
  }
  __device__ __forceinline__ uint32_t at(int d_row, int d_chunk) const {
    return base[(d_chunk & 7) >> 1] + (d_row * kLd + (d_chunk & ~7) * kChunkElems) * kElemBytes;
  }
};

/** acc[m][n] += sum_k A[m][k] * B[k][n] for one warp's (kMTiles*16) x (kNTiles*8) tile, with
 *  kKSteps*16 terms, both operands read from swizzled shared-memory tiles.
 *  A is stored [m][k] (kAStoredKxM = false, plain ldmatrix) or [k][m] (true, ldmatrix.trans);
 *  B is stored [n][k] (kBStoredKxN = false, plain ldmatrix) or [k][n] (true, ldmatrix.trans).
 *  kALd / kBLd are the row widths of the stored tiles. Origins (a_m0, a_k0, b_n0, b_k0) are in
 *  the logical GEMM coordinates. Alignment rule (SwizzledOperand): the origin along a stored
 *  tile's columns, in chunks of 8 elements, must be a multiple of the smallest power of two
 *  that exceeds every column step the GEMM takes modulo 8 chunks (e.g. origin 0 or a multiple of
 *  64 elements always works; with 2 tiles of 16 columns, a multiple of 32 elements does); the
 *  origin along the stored rows must be a multiple of 8. Traits static_asserts enforce this for
 *  the kernels' warp layouts. Register fragment layouts are those of ptx/mma.cuh. */
template <typename Element, int kMTiles, int kNTiles, int kKSteps, bool kAStoredKxM, bool kBStoredKxN,
          int kALd, int kBLd>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], const Element* a_tile, int a_m0,
                                          int a_k0, const Element* b_tile, int b_n0, int b_k0, int lane_id) {
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles at a time");
  static_assert(sizeof(Element) == SwizzledOperand<kALd>::kElemBytes, "16-bit elements");
  const int lane = opaque(lane_id);
  // ldmatrix.x4 lane roles: lanes 8i..8i+7 give the 8 row addresses of matrix i.
  // A matrices 0..3 = (m +0, k +0), (m +8, k +0), (m +0, k +8), (m +8, k +8) = a0..a3.
  // B matrices 0..3 = (k +0, n +0), (k +8, n +0), (k +0, n +8), (k +8, n +8) = b0, b1 of two n-tiles.
  const SwizzledOperand<kALd> a_addr =
      !kAStoredKxM ? SwizzledOperand<kALd>(ptx::smem_addr(a_tile), a_m0 + (lane & 15), a_k0 / 8 + (lane >> 4))
                   : SwizzledOperand<kALd>(ptx::smem_addr(a_tile), a_k0 + (lane & 7) + (lane >> 4) * 8,
                                           a_m0 / 8 + ((lane >> 3) & 1));
  const SwizzledOperand<kBLd> b_addr =
      !kBStoredKxN ? SwizzledOperand<kBLd>(ptx::smem_addr(b_tile), b_n0 + (lane & 7) + (lane >> 4) * 8,
                                           b_k0 / 8 + ((lane >> 3) & 1))
                   : SwizzledOperand<kBLd>(ptx::smem_addr(b_tile), b_k0 + (lane & 15), b_n0 / 8 + (lane >> 4));
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a_frag[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if constexpr (!kAStoredKxM) {
        ptx::ldmatrix_x4(a_frag[mt], a_addr.at(mt * 16, ks * 2));
      } else {
        ptx::ldmatrix_x4_trans(a_frag[mt], a_addr.at(ks * 16, mt * 2));
      }
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b_frag[4];  // {b0, b1} of n-tile 2*np, then {b0, b1} of n-tile 2*np+1
      if constexpr (!kBStoredKxN) {
        ptx::ldmatrix_x4(b_frag, b_addr.at(np * 16, ks * 2));
      } else {
        ptx::ldmatrix_x4_trans(b_frag, b_addr.at(ks * 16, np * 2));
      }
      const uint32_t b_even[2] = {b_frag[0], b_frag[1]};
      const uint32_t b_odd[2] = {b_frag[2], b_frag[3]};
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma<Element>(acc[mt][2 * np], a_frag[mt], b_even);
        mma<Element>(acc[mt][2 * np + 1], a_frag[mt], b_odd);
      }
    }
  }
}

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero_fill(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

/** Writes a warp's fp32 accumulator tile, times `scale`, as Element pairs into a swizzled tile
 *  (row origin row0, column origin col0; fragment layout of ptx/mma.cuh). */
template <typename Element, int kLd, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_fragments_to_smem(const float (&acc)[kMTiles][kNTiles][4], float scale,
                                                        Element* tile, int row0, int col0, int lane_id) {
  const int lane = opaque(lane_id);  // see opaque(): offsets recomputed per call, not kept live
  const int group = lane >> 2;
  const int quad = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int row = row0 + mt * 16 + half * 8 + group;
        const int col = col0 + nt * 8 + quad * 2;
        *reinterpret_cast<uint32_t*>(tile + SwizzledTile<kLd>::offset(row, col)) =
            pack_pair<Element>(acc[mt][nt][2 * half] * scale, acc[mt][nt][2 * half + 1] * scale);
      }
}

// ---- global <-> shared tile movement ----------------------------------------------------------

/** 16-byte cp.async with a runtime source size: bytes past src_bytes are zero-filled (0 = all). */
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_dst, const void* gmem_src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}

/** 4-byte cp.async (only .ca exists at this size), zero-filled when !valid. */
__device__ __forceinline__ void cp_async_4_zfill(uint32_t smem_dst, const void* gmem_src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(valid ? 4 : 0));
}

/** Asynchronously copies a kRows x kCols tile whose row r starts at gmem_row0 + r * row_stride
 *  into a swizzled smem tile; rows >= rows_valid and columns >= cols_valid become zeros.
 *  A thread's chunks share a column and lie kRowStep rows apart (row % 8, the swizzle key, is the
 *  same for all of them): one source address and one shared-memory address per call, then a
 *  uniform 64-bit step and an immediate offset per chunk (instead of a 64-bit multiply and a
 *  swizzle per chunk). */
template <typename Element, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_tile_async(Element* smem_tile, const Element* gmem_row0, int64_t row_stride,
                                                int rows_valid, int cols_valid, int thread_id) {
  constexpr int kChunksPerRow = kCols / kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among threads");
  static_assert(kThreads % kChunksPerRow == 0, "a thread keeps its column across its chunks");
  constexpr int kRowStep = kThreads / kChunksPerRow;
  static_assert(kRowStep % 8 == 0, "a thread keeps its swizzle key across its chunks");
  const int tid = opaque(thread_id);  // see opaque(): keep the per-chunk offsets out of the loop
  const int row0 = tid / kChunksPerRow;
  const int col = (tid % kChunksPerRow) * kChunkElems;
  const bool col_valid = col < cols_valid;
  const uint32_t smem0 = ptx::smem_addr(smem_tile) + SwizzledTile<kCols>::offset(row0, col) * sizeof(Element);
  const Element* src0 = gmem_row0 + row0 * row_stride + col;
  const int64_t step = kRowStep * row_stride;
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const bool valid = col_valid && row0 + i * kRowStep < rows_valid;
    // An invalid chunk reads nothing (src-size 0); the pointer only has to be well-formed.
    const Element* src = valid ? src0 + i * step : gmem_row0;
    cp_async_16_zfill(smem0 + i * kRowStep * kCols * sizeof(Element), src, valid ? 16 : 0);
  }
}

/** Asynchronously copies kRows consecutive floats (per-row statistics), zeros past rows_valid. */
template <int kRows>
__device__ __forceinline__ void load_row_stats_async(float* smem_rows, const float* gmem_rows, int rows_valid,
                                                     int tid) {
  if (tid < kRows) {
    const bool valid = tid < rows_valid;
    cp_async_4_zfill(ptx::smem_addr(smem_rows + tid), valid ? gmem_rows + tid : gmem_rows, valid);
  }
}

/** Stores the valid part (rows < rows_valid, columns < cols_valid) of a swizzled smem tile to
 *  global memory with 16-byte vector stores. */
template <typename Element, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void store_tile(const Element* smem_tile, Element* gmem_row0, int64_t row_stride,
                                           int rows_valid, int cols_valid, int tid) {
  constexpr int kChunksPerRow = kCols / kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = tid + i * kThreads;
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * kChunkElems;
    if (row < rows_valid && col < cols_valid) {
      *reinterpret_cast<uint4*>(gmem_row0 + row * row_stride + col) =
          *reinterpret_cast<const uint4*>(smem_tile + SwizzledTile<kCols>::offset(row, col));
    }
  }
}

// ---- problem geometry -----------------------------------------------------------------------

/** Per-row statistics (lse * log2 e, D) live in the workspace as (heads_q, total_q): row index =
 *  first packed row of the sequence + i, where the first packed row is q_start (varlen) or
 *  b * seqlen_q (dense). The fp32 dQ accumulator: (heads_q, dq_rows_per_head, head-dim bucket),
 *  row-major with the statistics' rows or in DqTiles' layout (backward_workspace.hpp). */
struct BackwardWorkspacePtrs {
  float* lse_log2;  // lse * log2(e); +inf where lse = -inf (no visible key: P must be 0)
  float* dsum;      // D = rowsum(dO * O)
  float* dq_accum;  // fp32 dQ / softmax_scale; nullptr in deterministic mode
  bool dq_tiled;    // DqTiles (the sm80 main kernel) or row-major (the Hopper one)
  int64_t dq_rows_per_head;
};

/** Whether this device code stores DqTiles slots for 16-byte reductions (sm_90's float4
 *  atomics) or scalar ones; every kernel of one call is compiled for the same architecture.
 *  FLASHCORE_DQ_SCALAR_SLOTS (a test build's define) takes the scalar order on sm_90 too, so
 *  a Hopper machine can run the order that sm_80 builds use. */
__device__ __forceinline__ constexpr bool dq_vector_slots() {
#if defined(FLASHCORE_DQ_SCALAR_SLOTS)
  return false;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return true;
#else
  return false;
#endif
}

__device__ __forceinline__ int64_t first_packed_q_row(const BackwardParams& p, int64_t b, const SeqInfo& s) {
  return p.cu_seqlens_q != nullptr ? s.q_start : b * p.seqlen_q;
}

/** Scalars of the score transform, precomputed once per kernel. */
struct ScoreTransform {
  float scale_log2;      // softmax_scale * log2(e)           (no softcap)
  float softcap;         // 0 = off
  float tanh_arg_scale;  // softmax_scale / softcap            (softcap)
  float softcap_log2;    // softcap * log2(e)                 (softcap)

  __device__ __forceinline__ static ScoreTransform make(const BackwardParams& p) {
    ScoreTransform t;
    t.scale_log2 = p.softmax_scale * kLog2e;
    t.softcap = p.softcap;
    t.tanh_arg_scale = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;
    t.softcap_log2 = p.softcap * kLog2e;
    return t;
  }

  /** The ALiBi bias per unit of distance (the scores carry -slope * |i + sk - sq - j|) for query
   *  head h of batch entry b, in log2 units; 0 without ALiBi (a zero slope is no bias either). */
  __device__ __forceinline__ static float alibi_log2(const BackwardParams& p, int64_t b, int64_t h) {
    return p.alibi_slopes != nullptr ? -p.alibi_slope(b, h) * kLog2e : 0.f;
  }
};

}  // namespace flashcore::cuda::sm80::bwd
