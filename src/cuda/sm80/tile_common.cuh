// Device helpers shared by the sm80 (mma.sync) kernels: element packing and mma dispatch per dtype,
// the XOR-swizzled shared-memory tile layout, per-lane ldmatrix addressing into it, predicated
// global->shared tile copies with cp.async, quad (4-lane) reductions, fast exp2, named barriers;
// on the host, a per-device cache of the SM count and shared-memory limit.
//
// Relies on: src/cuda/ptx/{mma,cp_async}.cuh for the raw instructions, the CUDA runtime for the
// device queries. Everything here works on 16-bit elements (__half / __nv_bfloat16) and 16-byte
// "chunks" (8 elements), the unit of cp.async, of one ldmatrix row and of a vector store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mma.cuh"

namespace flashcore::cuda::sm80 {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;
constexpr int kChunkBytes = 16;            // cp.async size, one ldmatrix row, one vector store
constexpr int kElementBytes = 2;           // fp16 / bf16
constexpr int kChunkElems = kChunkBytes / kElementBytes;
constexpr int kSwizzleChunks = 8;          // chunks XOR-permuted within each 128-byte row segment
constexpr int kMaxNamedBarriers = 16;      // bar.sync ids per CTA; __syncthreads uses id 0
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- per-dtype packing and tensor-core mma ---------------------------------------------------

template <typename Element>
struct ElementOps;

template <>
struct ElementOps<__half> {
  /** Two floats rounded to fp16 in one 32-bit register; `lo` lands in the low half (lower column). */
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    ptx::mma_m16n8k16_f16(d, a, b);
  }
};

template <>
struct ElementOps<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    ptx::mma_m16n8k16_bf16(d, a, b);
  }
};

// ---- swizzled shared-memory tiles ------------------------------------------------------------

/** A row-major kRows x kCols tile of 16-bit elements in shared memory. Within every 128-byte
 *  segment of a row, 16-byte chunk c is stored at chunk c ^ (row % 8). The 8 rows an ldmatrix
 *  phase (or a column of C fragments) touches then hit 8 different chunks = all 32 banks once,
 *  while cp.async writes of consecutive chunks stay contiguous per row. Needs rows of a multiple
 *  of 128 bytes (kCols % 64 == 0) and a 128-byte aligned base. */
template <int kRows_, int kCols_>
struct SwizzledTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kRowBytes = kCols * kElementBytes;
  static constexpr int kChunksPerRow = kRowBytes / kChunkBytes;
  static constexpr int kBytes = kRows * kRowBytes;
  static_assert(kChunksPerRow % kSwizzleChunks == 0, "rows must be a multiple of 128 bytes");

  /** Byte offset of (row, logical chunk) inside the tile. */
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row % kSwizzleChunks)) * kChunkBytes));
  }
};

/** The shared-memory addresses one lane feeds to ldmatrix when walking a SwizzledTile.
 *
 *  Every ldmatrix use in these kernels has the same shape: lane l supplies the address of
 *  row  R + lane_row  (R a multiple of 8 known at compile time, lane_row % 8 == l % 8) and of
 *  logical chunk  2 * step + lane_chunk_bit  (step known at compile time). Because 2 * step has a
 *  zero low bit, the swizzled chunk is  (2*step) ^ (lane_chunk_bit ^ (l % 8)), whose low 3 bits take
 *  only four values per lane. They are precomputed here, so each ldmatrix address is a register
 *  plus a compile-time immediate. */
template <class Tile>
struct LdmatrixLaneAddress {
  static constexpr int kPatterns = kSwizzleChunks / 2;  // (2*step) % 8 in {0, 2, 4, 6}
  uint32_t base[kPatterns];

  __device__ __forceinline__ LdmatrixLaneAddress(uint32_t tile_base, int lane_row, int lane_chunk_bit) {
    const int lane_xor = lane_chunk_bit ^ (lane_row % kSwizzleChunks);
#pragma unroll
    for (int i = 0; i < kPatterns; ++i) {
      base[i] = tile_base + static_cast<uint32_t>(lane_row * Tile::kRowBytes +
                                                  (((2 * i) ^ lane_xor) * kChunkBytes));
    }
  }

  /** Address for tile row offset `row_offset` (multiple of 8) and chunk pair `step`; both must be
   *  compile-time constants after unrolling for the arithmetic to fold away. */
  __device__ __forceinline__ uint32_t at(int row_offset, int step) const {
    constexpr int kSegmentBytes = kSwizzleChunks * kChunkBytes;
    return base[step % kPatterns] +
           static_cast<uint32_t>(row_offset * Tile::kRowBytes + (step / kPatterns) * kSegmentBytes);
  }
};

// ---- global -> shared tile copies --------------------------------------------------------------

/** Copies a kRows x kCols tile from global memory (row-major, contiguous rows of `row_stride`
 *  elements) into a SwizzledTile with cp.async, kThreads threads cooperating. Rows >= valid_rows
 *  and columns >= valid_cols (a multiple of 8) are zero-filled without touching global memory.
 *  Consecutive threads take consecutive 16-byte chunks of a row, so warps read whole rows. */
template <class Tile, int kThreads>
struct TileLoader {
  static constexpr int kChunksPerRow = Tile::kChunksPerRow;
  static_assert(kThreads % kChunksPerRow == 0, "a pass must cover whole rows");
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(Tile::kRows % kRowsPerPass == 0, "tile rows must be a multiple of the rows per pass");
  static constexpr int kPasses = Tile::kRows / kRowsPerPass;

  template <typename Element>
  static __device__ __forceinline__ void load_async(uint32_t smem_tile, const Element* gmem_tile,
                                                    int64_t row_stride, int valid_rows,
                                                    int valid_cols, int thread) {
    const int chunk = thread % kChunksPerRow;
    const int first_row = thread / kChunksPerRow;
    const bool column_valid = chunk * kChunkElems < valid_cols;
    // Written as a pointer that advances by a fixed stride so that only one 64-bit value per tile
    // stays live (a per-pass offset table would cost two registers per pass).
    const Element* src = gmem_tile + first_row * row_stride + chunk * kChunkElems;
    const int64_t pass_stride = kRowsPerPass * row_stride;
    const uint32_t dst = smem_tile + Tile::offset(first_row, chunk);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = first_row + pass * kRowsPerPass;
      const bool valid = column_valid && row < valid_rows;
      // When a pass spans a multiple of 8 rows the swizzle repeats and the smem step is constant.
      const uint32_t dst_pass = kRowsPerPass % kSwizzleChunks == 0
                                    ? dst + pass * kRowsPerPass * Tile::kRowBytes
                                    : smem_tile + Tile::offset(row, chunk);
      // Invalid chunks pass the tile's base address (valid memory); nothing is read from it.
      ptx::cp_async_16(dst_pass, valid ? src : gmem_tile, valid);
      src += pass_stride;
    }
  }
};

// ---- reductions and math ----------------------------------------------------------------------

/** Max over the 4 lanes of a quad (the lanes sharing an mma accumulator row). */
__device__ __forceinline__ float quad_allreduce_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullWarpMask, v, 1));
  v = fmaxf(v, __shfl_xor_sync(kFullWarpMask, v, 2));
  return v;
}

__device__ __forceinline__ float quad_allreduce_sum(float v) {
  v += __shfl_xor_sync(kFullWarpMask, v, 1);
  v += __shfl_xor_sync(kFullWarpMask, v, 2);
  return v;
}

/** 2^x with the hardware approximation (MUFU.EX2, ~2 ulp); exp2(-inf) = +0, which is how masked
 *  scores vanish. */
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/** log2(x) for a positive finite normal x (a softmax row sum): the exponent exactly, the mantissa
 *  in [1, 2) through the hardware approximation (MUFU.LG2, absolute error <= 2^-22 there), so the
 *  error is 2^-22 plus the final add's rounding whatever the magnitude. log2f's software polynomial is ~30 dependent
 *  instructions, which sat in the sm90 epilogue's chain twice per thread (~500 cycles a tile). */
__device__ __forceinline__ float log2_positive(float x) {
  const uint32_t bits = __float_as_uint(x);
  const float mantissa = __uint_as_float((bits & 0x007FFFFFu) | 0x3F800000u);
  return static_cast<float>(static_cast<int>(bits >> 23) - 127) + __log2f(mantissa);
}

/** Barrier among the kThreads threads (whole warps) that use named barrier `id` (1 .. 15; 0 belongs
 *  to __syncthreads). Like __syncthreads, it also orders shared-memory accesses and, after
 *  cp.async.wait_group, publishes the participating threads' completed copies. */
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  static_assert(kThreads % kWarpSize == 0, "named barriers count whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

/** 16-byte shared-memory load (from a .shared window address). */
__device__ __forceinline__ uint4 load_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

/** 4-byte shared-memory store (to a .shared window address). */
__device__ __forceinline__ void store_shared_4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// ---- host: device limits for launch-configuration choices -------------------------------------

/** What a kernel-configuration choice (the forward's small-grid path) needs to know about a device,
 *  queried once per device and cached in function-local statics (the only mutable state of the
 *  backend; racing first calls store equal values). */
struct DeviceLimits {
  int sm_count = 0;            // 0 when unknown: the small-grid path is then never taken
  int max_smem_per_block = 0;  // opt-in dynamic shared memory limit
};
inline DeviceLimits device_limits(int device_id) {
  constexpr int kCachedDevices = 64;
  // sm_count is stored last (release) and read first (acquire): nonzero means both are valid.
  static std::atomic<int> cached_sm_count[kCachedDevices];  // 0 = not queried yet
  static std::atomic<int> cached_max_smem[kCachedDevices];
  const bool cacheable = device_id >= 0 && device_id < kCachedDevices;
  DeviceLimits limits;
  if (cacheable) {
    limits.sm_count = cached_sm_count[device_id].load(std::memory_order_acquire);
    limits.max_smem_per_block = cached_max_smem[device_id].load(std::memory_order_relaxed);
    if (limits.sm_count > 0) return limits;
  }
  if (cudaDeviceGetAttribute(&limits.sm_count, cudaDevAttrMultiProcessorCount, device_id) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&limits.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             device_id) != cudaSuccess) {
    cudaGetLastError();  // a failed query must not leave a sticky error for the launch check
    return DeviceLimits{};
  }
  if (cacheable) {
    cached_max_smem[device_id].store(limits.max_smem_per_block, std::memory_order_relaxed);
    cached_sm_count[device_id].store(limits.sm_count, std::memory_order_release);
  }
  return limits;
}

}  // namespace flashcore::cuda::sm80
