// Zero-filling the rows of a TMA-loaded tile that lie past a sequence's end, for the Hopper kernels'
// packed varlen calls.
//
// Why: a TMA box has a fixed number of rows, and a packed varlen map spans every row of the tensor,
// so a sequence's last block also reads the rows after it: the next sequence's, or, after the last
// sequence, whatever the buffer holds there (a preallocated, uninitialised k / v / q / dO). The
// kernels give those rows probability 0 (or dS = 0) by select, but the tensor cores still multiply
// them: 0 x NaN = NaN, which would reach the valid rows' output or gradients. flash_attn's and
// cuda_sm80's predicated loads read zeros there; these helpers make the TMA tiles read the same.
//
// How: such a load completes on a private "loaded" barrier instead of the consumers' "full" one; a
// warp of the producer warpgroup that has no other work waits for it, zeroes the rows with plain
// stores, orders them before the consumers' wgmma reads (the async proxy), and then arrives on
// "full" (initialised with one arrival, which a plain load's arrive_expect_tx gives instead).
//
// Relies on: the tile layout of ptx::KMajorTile{k128B}: 64-column chunks of `rows` x 128 bytes,
// whose swizzle permutes 16-byte units within a row's 128 bytes, so a row is 128 contiguous bytes.
#pragma once

#include <cstdint>

#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"

namespace flashcore::cuda::sm90 {

/** Parity bookkeeping of a ring of "loaded" barriers that complete a phase only for the fills that
 *  need zeroing (so a fill count does not give their parity): bit s is the parity of stage s's next
 *  phase. */
struct TailPhases {
  uint32_t bits = 0;
  __device__ uint32_t take(int stage) {
    const uint32_t parity = (bits >> stage) & 1u;
    bits ^= 1u << stage;
    return parity;
  }
};

/** One warp: zeroes rows [valid_rows, kRows) of a tile (at .shared address `tile`) of kChunks
 *  128-byte-swizzled chunks of kRows rows each. Every lane then fences its stores into the async
 *  proxy; the caller syncs the warp and arrives on the consumers' barrier. 32-bit addresses: this
 *  runs in a warp of the producer warpgroup, which holds 24 registers. */
template <int kRows, int kChunks>
__device__ __forceinline__ void zero_rows_from(uint32_t tile, int valid_rows, int lane) {
  // Lane l stores 16-byte unit l % 8 of every fourth row from valid_rows + l / 8.
  for (uint32_t at = tile + (valid_rows + lane / 8) * 128 + (lane % 8) * 16; at < tile + kRows * 128; at += 4 * 128) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(at + c * kRows * 128), "r"(0u) : "memory");
    }
  }
  ptx::fence_proxy_async_shared_cta();  // the zeros -> the consumers' wgmma reads (async proxy)
}

/** One warp's hand-over after zero_rows_from on every tile the barrier guards: all lanes' stores
 *  and fences happen before the single arrival. */
__device__ __forceinline__ void arrive_after_zeroing(uint64_t* full, int lane) {
  __syncwarp();
  if (lane == 0) ptx::mbarrier_arrive(full);
}

}  // namespace flashcore::cuda::sm90
