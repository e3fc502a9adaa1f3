// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): D(64xN, fp32) (+)= A(64x16) * B(16xN) for
// 16-bit inputs, issued by one warpgroup (4 consecutive warps starting at a multiple of 4), with B
// (and A in the "SS" form) read by the tensor cores straight from shared memory through 64-bit
// matrix descriptors, or A from registers in the "RS" form (O += P V keeps P in registers).
//
// ---- Execution and ordering (PTX ISA "Asynchronous Warpgroup Level Matrix" sections) ----------
//  wgmma_fence()          before the first wgmma, and again whenever the accumulator or the RS
//                         A registers were written by ordinary instructions since the last wgmma
//                         that used them (e.g. O rescaled by the online softmax).
//  wgmma_ss / wgmma_rs    issue asynchronously; the accumulator registers must not be read or
//                         written until a wait covering that wgmma returns.
//  wgmma_commit_group()   closes the group of wgmmas issued since the previous commit.
//  wgmma_wait_group<N>()  waits until at most N committed groups are still pending.
//  wgmma_fence_operands() after the wait: an empty asm that ties the registers to this point so the
//                         compiler cannot hoist their uses above the wait (the asm of the mma
//                         itself told it they were final at issue).
//  Shared memory filled by ordinary stores (st.shared, stmatrix) must be published to the async
//  proxy with fence.proxy.async.shared::cta (ptx::fence_proxy_async_shared_cta in tma.cuh) by the
//  writing threads before the barrier that precedes the wgmma; TMA-filled memory needs only the
//  mbarrier wait.
//
// ---- Accumulator fragment (m64nNk16, fp32: N/2 floats per thread) ------------------------------
//  t = thread index in the warpgroup (0..127), w = t / 32 (warp), g = (t % 32) / 4, q = t % 4.
//  Register i (0 <= i < N/2) holds   row = 16*w + g + 8*((i % 4) / 2)
//                                    col = 8*(i / 4) + 2*q + (i % 2)
//  i.e. warp w owns rows 16w..16w+15 and, per 8-column block j = i / 4, the same four values as an
//  mma.m16n8 C fragment: {d[4j], d[4j+1]} at (g, 2q..2q+1), {d[4j+2], d[4j+3]} at (g+8, 2q..2q+1).
//  accumulator_coord() computes it.
//
// ---- A fragment of the RS form (64x16, 4 x .b32 per thread, two 16-bit values each) ------------
//  a[r] holds A(row, col) and A(row, col+1) (low half first) with
//    row = 16*w + g + 8*(r % 2),  col = 2*q + 8*(r / 2)
//  -- the mma.m16n8k16 A layout per warp. Hence an accumulator tile converts to the A operand of
//  the next product with no data movement: k-slice s (cols 16s..16s+15) of a 64xN fp32 tile gives
//  a[0] = pack(d[8s], d[8s+1]), a[1] = pack(d[8s+2], d[8s+3]), a[2] = pack(d[8s+4], d[8s+5]),
//  a[3] = pack(d[8s+6], d[8s+7]).  a_fragment_coord() computes it.
//
// ---- Matrix descriptor (64 bits; make_smem_desc) ------------------------------------------------
//  bits  0-13  start address >> 4 (shared-window byte address, 16-byte aligned)
//  bits 16-29  leading dimension byte offset (LBO) >> 4
//  bits 32-45  stride dimension byte offset (SBO) >> 4
//  bits 49-51  matrix base offset (0 here: every tile starts at a swizzle-period boundary)
//  bits 62-63  swizzle: 0 none (interleaved), 1 128B, 2 64B, 3 32B
//
// ---- Canonical shared-memory layouts (16-bit elements; "core matrix" = 8 rows x 16 bytes) ------
//  A swizzle of span S bytes (32/64/128) stores rows of S bytes; within each group of 8 rows
//  (period 8*S bytes) the 16-byte chunk index (address bits 4..) is XORed with the row bits
//  (address bits 7..): byte ^= ((byte >> 7) & (S/16 - 1)) << 4 -- exactly what a TMA load with the
//  same swizzle writes, provided the tile starts at a multiple of 8*S bytes.
//  K-major (K contiguous: A, and B of Q K^T; trans bit 0):
//    swizzled: [K / (S/2)][MN][S bytes]; SBO = 8*S (next 8 MN rows); LBO unused (16); a k16 slice
//              at k0 starts (k0 % (S/2))*2 bytes into the row -- advance the start address.
//    none:     [K/8][MN/8] core matrices of 128 contiguous bytes (row r at r*16);
//              LBO = next core matrix along K = MN*16, SBO = next along MN = 128.
//  MN-major (MN contiguous: B of P V, i.e. V stored [keys][dim]; trans bit 1):
//    swizzled: [MN / (S/2)][K][S bytes]; LBO = next MN atom = K*S, SBO = next 8 K rows = 8*S.
//    none:     [K/8][MN/8] core matrices, each 8 K-rows of 16 bytes (8 MN values);
//              LBO = next along K = MN*16, SBO = next along MN = 128.
//  (LBO and SBO swap their K/MN roles between the swizzled and the interleaved MN-major forms, as
//  CUTLASS's make_gmma_desc encodes them; tests/cuda/sm90 checks every form on the GPU.)
//  KMajorTile / MnMajorTile below compute byte offsets and descriptors for these layouts. In
//  kernels, make them local constexpr values or constexpr function results: a static constexpr
//  data member of class type cannot be used from device code.
//
// Relies on: PTX ISA 8.0, sm_90a (compile with -gencode arch=compute_90a,code=sm_90a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashcore::ptx {

/** Swizzle mode, valued as the descriptor's bits 62-63. */
enum class SmemSwizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

struct WgmmaTraits {
  static constexpr uint32_t kM = 64;             // rows of D and A per wgmma
  static constexpr uint32_t kK = 16;             // K per wgmma for 16-bit inputs
  static constexpr uint32_t kElemBytes = 2;      // bf16 / fp16
  static constexpr uint32_t kCoreRows = 8;       // core matrix: 8 rows ...
  static constexpr uint32_t kCoreRowBytes = 16;  // ... of 16 bytes
  static constexpr uint32_t kCoreBytes = kCoreRows * kCoreRowBytes;
  static constexpr uint32_t kCoreRowElems = kCoreRowBytes / kElemBytes;
  static constexpr uint32_t kRowsPerWarp = 16;  // accumulator rows owned by one warp
  static constexpr uint32_t kColsPerBlock = 8;  // accumulator columns per 4-register block
  static constexpr uint32_t kRegsPerBlock = 4;
  static constexpr uint32_t kARegs = 4;  // .b32 registers of an RS A fragment
  // descriptor fields
  static constexpr uint32_t kDescEncodeShift = 4;  // addresses and offsets drop 4 low bits
  static constexpr uint64_t kDescFieldMask = 0x3FFF;
  static constexpr uint32_t kDescLboBit = 16;
  static constexpr uint32_t kDescSboBit = 32;
  static constexpr uint32_t kDescSwizzleBit = 62;
  static constexpr uint32_t kSwizzleRowBit = 7;  // swizzle XORs address bits 7.. into bits 4..
};

/** Bytes per swizzled row (the swizzle span); 16 (one core-matrix row) for kNone. */
__host__ __device__ constexpr uint32_t swizzle_span_bytes(SmemSwizzle s) {
  return s == SmemSwizzle::k128B  ? 128u
         : s == SmemSwizzle::k64B ? 64u
         : s == SmemSwizzle::k32B ? 32u
                                  : 16u;
}

/** Number of chunk-index bits the swizzle XORs (log2 of span / 16). */
__host__ __device__ constexpr uint32_t swizzle_xor_bits(SmemSwizzle s) {
  return s == SmemSwizzle::k128B  ? 3u
         : s == SmemSwizzle::k64B ? 2u
         : s == SmemSwizzle::k32B ? 1u
                                  : 0u;
}

/** Bytes after which the swizzle pattern repeats; tiles must start at a multiple of it. */
__host__ __device__ constexpr uint32_t swizzle_period_bytes(SmemSwizzle s) {
  return WgmmaTraits::kCoreRows * swizzle_span_bytes(s);
}

/** Physical byte offset of a linear offset (row * span + byte-in-row) under the swizzle. */
__host__ __device__ constexpr uint32_t apply_swizzle(SmemSwizzle s, uint32_t linear_byte_offset) {
  const uint32_t mask = (1u << swizzle_xor_bits(s)) - 1u;
  const uint32_t row_bits = (linear_byte_offset >> WgmmaTraits::kSwizzleRowBit) & mask;
  return linear_byte_offset ^ (row_bits << WgmmaTraits::kDescEncodeShift);
}

/** Builds a wgmma shared-memory matrix descriptor (layout in the file comment). */
__host__ __device__ constexpr uint64_t make_smem_desc(uint32_t smem_byte_addr, SmemSwizzle s,
                                                      uint32_t lbo_bytes, uint32_t sbo_bytes) {
  using T = WgmmaTraits;
  return ((uint64_t(smem_byte_addr) >> T::kDescEncodeShift) & T::kDescFieldMask) |
         (((uint64_t(lbo_bytes) >> T::kDescEncodeShift) & T::kDescFieldMask) << T::kDescLboBit) |
         (((uint64_t(sbo_bytes) >> T::kDescEncodeShift) & T::kDescFieldMask) << T::kDescSboBit) |
         (uint64_t(static_cast<uint32_t>(s)) << T::kDescSwizzleBit);
}

/** Moves a descriptor's start address by `byte_delta` (multiple of 16), as a k-loop does. The add
 *  touches the low 32 bits only: the start-address field cannot carry into the LBO field as long
 *  as the operand ends below 256 KiB, which every shared-memory address does. A kernel that builds
 *  the descriptor of a tile's base once and advances it per wgmma pays one uniform add per wgmma
 *  instead of the shift / mask / or of a full make_smem_desc (about 10 uniform instructions). */
__host__ __device__ constexpr uint64_t advance_smem_desc(uint64_t desc, uint32_t byte_delta) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (byte_delta >> WgmmaTraits::kDescEncodeShift);
  return (desc & 0xffffffff00000000ull) | lo;
}

/** An operand tile stored K-major (K contiguous): mn_extent x k_extent elements. */
struct KMajorTile {
  SmemSwizzle swizzle;
  uint32_t mn_extent;  // multiple of 8
  uint32_t k_extent;   // multiple of 16

  __host__ __device__ constexpr uint32_t span() const { return swizzle_span_bytes(swizzle); }
  __host__ __device__ constexpr uint32_t span_elems() const {
    return span() / WgmmaTraits::kElemBytes;
  }
  __host__ __device__ constexpr bool swizzled() const { return swizzle != SmemSwizzle::kNone; }
  /** Bytes between consecutive K blocks (a span-wide column of the tile, or 8 K of core matrices).
   */
  __host__ __device__ constexpr uint32_t k_block_bytes() const { return mn_extent * span(); }
  __host__ __device__ constexpr uint32_t bytes() const {
    return (k_extent + span_elems() - 1) / span_elems() * k_block_bytes();
  }
  __host__ __device__ constexpr uint32_t byte_offset(uint32_t mn, uint32_t k) const {
    using T = WgmmaTraits;
    if (swizzled())
      return apply_swizzle(swizzle, k / span_elems() * k_block_bytes() + mn * span() +
                                        k % span_elems() * T::kElemBytes);
    return k / T::kCoreRowElems * k_block_bytes() + mn / T::kCoreRows * T::kCoreBytes +
           mn % T::kCoreRows * T::kCoreRowBytes + k % T::kCoreRowElems * T::kElemBytes;
  }
  __host__ __device__ constexpr uint32_t lbo_bytes() const {
    return swizzled() ? WgmmaTraits::kCoreRowBytes : k_block_bytes();
  }
  __host__ __device__ constexpr uint32_t sbo_bytes() const {
    return swizzled() ? swizzle_period_bytes(swizzle) : WgmmaTraits::kCoreBytes;
  }
  /** Offset of the sub-tile starting at (mn0 multiple of 8, k0 multiple of 16). */
  __host__ __device__ constexpr uint32_t slice_offset(uint32_t mn0, uint32_t k0) const {
    if (swizzled())
      return k0 / span_elems() * k_block_bytes() + mn0 * span() +
             k0 % span_elems() * WgmmaTraits::kElemBytes;
    return k0 / WgmmaTraits::kCoreRowElems * k_block_bytes() +
           mn0 / WgmmaTraits::kCoreRows * WgmmaTraits::kCoreBytes;
  }
  /** Descriptor of the wgmma operand starting at (mn0, k0) of a tile placed at smem_base: the
   *  base's descriptor advanced by the slice offset, so that the base part is common to every
   *  wgmma of an unrolled k-loop and each one costs a single add. */
  __host__ __device__ constexpr uint64_t desc(uint32_t smem_base, uint32_t mn0, uint32_t k0) const {
    return advance_smem_desc(make_smem_desc(smem_base, swizzle, lbo_bytes(), sbo_bytes()),
                             slice_offset(mn0, k0));
  }
};

/** An operand tile stored MN-major (MN contiguous): element (mn, k) of k_extent rows of MN. */
struct MnMajorTile {
  SmemSwizzle swizzle;
  uint32_t mn_extent;  // multiple of the span in elements (8 for kNone)
  uint32_t k_extent;   // multiple of 16

  __host__ __device__ constexpr uint32_t span() const { return swizzle_span_bytes(swizzle); }
  __host__ __device__ constexpr uint32_t span_elems() const {
    return span() / WgmmaTraits::kElemBytes;
  }
  __host__ __device__ constexpr bool swizzled() const { return swizzle != SmemSwizzle::kNone; }
  /** Swizzled: bytes of one MN atom (span_elems columns x all K rows). */
  __host__ __device__ constexpr uint32_t mn_atom_bytes() const { return k_extent * span(); }
  /** Interleaved: bytes of one row of core matrices along MN (8 K rows x all MN). */
  __host__ __device__ constexpr uint32_t k_group_bytes() const {
    return mn_extent * WgmmaTraits::kCoreRowBytes;
  }
  __host__ __device__ constexpr uint32_t bytes() const {
    return mn_extent * k_extent * WgmmaTraits::kElemBytes;
  }
  __host__ __device__ constexpr uint32_t byte_offset(uint32_t mn, uint32_t k) const {
    using T = WgmmaTraits;
    if (swizzled())
      return apply_swizzle(swizzle, mn / span_elems() * mn_atom_bytes() + k * span() +
                                        mn % span_elems() * T::kElemBytes);
    return k / T::kCoreRows * k_group_bytes() + mn / T::kCoreRowElems * T::kCoreBytes +
           k % T::kCoreRows * T::kCoreRowBytes + mn % T::kCoreRowElems * T::kElemBytes;
  }
  __host__ __device__ constexpr uint32_t lbo_bytes() const {
    return swizzled() ? mn_atom_bytes() : k_group_bytes();
  }
  __host__ __device__ constexpr uint32_t sbo_bytes() const {
    return swizzled() ? swizzle_period_bytes(swizzle) : WgmmaTraits::kCoreBytes;
  }
  /** Offset of the sub-tile starting at (mn0 multiple of the span, k0 multiple of 16). */
  __host__ __device__ constexpr uint32_t slice_offset(uint32_t mn0, uint32_t k0) const {
    if (swizzled()) return mn0 / span_elems() * mn_atom_bytes() + k0 * span();
    return k0 / WgmmaTraits::kCoreRows * k_group_bytes() +
           mn0 / WgmmaTraits::kCoreRowElems * WgmmaTraits::kCoreBytes;
  }
  /** As KMajorTile::desc: the base's descriptor advanced by the slice offset. */
  __host__ __device__ constexpr uint64_t desc(uint32_t smem_base, uint32_t mn0, uint32_t k0) const {
    return advance_smem_desc(make_smem_desc(smem_base, swizzle, lbo_bytes(), sbo_bytes()),
                             slice_offset(mn0, k0));
  }
};

struct FragmentCoord {
  uint32_t row;
  uint32_t col;
};

/** (row, col) of accumulator register i of warpgroup thread t (layout in the file comment). */
__host__ __device__ constexpr FragmentCoord accumulator_coord(uint32_t t, uint32_t i) {
  using T = WgmmaTraits;
  const uint32_t warp = t / 32, group = t % 32 / 4, quad = t % 4;
  return {warp * T::kRowsPerWarp + group + T::kCoreRows * (i % T::kRegsPerBlock / 2),
          T::kColsPerBlock * (i / T::kRegsPerBlock) + 2 * quad + i % 2};
}

/** (row, col) of the low half of RS A-fragment register r of warpgroup thread t (the high half
 *  is col + 1). */
__host__ __device__ constexpr FragmentCoord a_fragment_coord(uint32_t t, uint32_t r) {
  using T = WgmmaTraits;
  const uint32_t warp = t / 32, group = t % 32 / 4, quad = t % 4;
  return {warp * T::kRowsPerWarp + group + T::kCoreRows * (r % 2),
          2 * quad + T::kCoreRowElems * (r / 2)};
}

// ---- ordering ----------------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

template <int kCount>
__device__ __forceinline__ void wgmma_fence_operands(float (&regs)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}

template <int kCount>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&regs)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(regs[i])::"memory");
}

// ---- the instructions (one wrapper per shape / type / form; generated text, regular pattern) ---
// Operands after the registers: scale-d as a predicate (false: D = A*B, true: D += A*B), then the
// immediates imm-scale-a, imm-scale-b (1 or -1), imm-trans-a (SS only), imm-trans-b (0 = K-major,
// 1 = MN-major).
namespace detail {

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss_bf16(float (&d)[32], uint64_t desc_a,
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, accumulate, %35, %36, %37, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss_f16(float (&d)[32], uint64_t desc_a,
                                                       uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, accumulate, %35, %36, %37, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n80k16_ss_bf16(float (&d)[40], uint64_t desc_a,
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39"
      "}, "
      "%40, %41, accumulate, %43, %44, %45, %46;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n80k16_ss_f16(float (&d)[40], uint64_t desc_a,
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39"
      "}, "
      "%40, %41, accumulate, %43, %44, %45, %46;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss_bf16(float (&d)[64], uint64_t desc_a,
                                                         uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, accumulate, %67, %68, %69, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss_f16(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, accumulate, %67, %68, %69, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_ss_bf16(float (&d)[128], uint64_t desc_a,
                                                         uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127}, "
      "%128, %129, accumulate, %131, %132, %133, %134;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_ss_f16(float (&d)[128], uint64_t desc_a,
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127}, "
      "%128, %129, accumulate, %131, %132, %133, %134;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kScaleA), "n"(kScaleB), "n"(kTransA),
        "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs_bf16(float (&d)[32], const uint32_t (&a)[4],
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, accumulate, %38, %39, %40;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs_f16(float (&d)[32], const uint32_t (&a)[4],
                                                       uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, accumulate, %38, %39, %40;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs_bf16(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, accumulate, %70, %71, %72;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs_f16(float (&d)[64], const uint32_t (&a)[4],
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, accumulate, %70, %71, %72;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_rs_bf16(float (&d)[128], const uint32_t (&a)[4],
                                                         uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127}, "
      "{%128, %129, %130, %131}, %132, accumulate, %134, %135, %136;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

template <int kScaleA, int kScaleB, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_rs_f16(float (&d)[128], const uint32_t (&a)[4],
                                                        uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127}, "
      "{%128, %129, %130, %131}, %132, accumulate, %134, %135, %136;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kScaleA),
        "n"(kScaleB), "n"(kTransB));
}

}  // namespace detail

template <typename Elem>
inline constexpr bool kIsWgmma16BitType =
    std::is_same_v<Elem, __nv_bfloat16> || std::is_same_v<Elem, __half>;

template <int kN>
inline constexpr bool kIsWgmmaN = kN == 64 || kN == 128 || kN == 256;

/** N of the S = Q K^T products (shared-memory operands only): also 80, whose K/V tiles let the
 *  d256 forward keep two stages in shared memory. */
template <int kN>
inline constexpr bool kIsWgmmaSsN = kIsWgmmaN<kN> || kN == 80;

template <int kScale>
inline constexpr bool kIsWgmmaScale = kScale == 1 || kScale == -1;

/** D(64 x kN) = (accumulate ? D : 0) + A * B with A and B in shared memory (descriptors).
 *  kTransA / kTransB: 0 = K-major, 1 = MN-major operand. */
template <int kN, typename Elem, int kTransA = 0, int kTransB = 0, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
  static_assert(kIsWgmma16BitType<Elem>, "wgmma_ss: bf16 or fp16 inputs");
  static_assert(kIsWgmmaSsN<kN>, "wgmma_ss: N in {64, 80, 128, 256}");
  static_assert(kIsWgmmaScale<kScaleA> && kIsWgmmaScale<kScaleB>, "scale is 1 or -1");
  static_assert((kTransA == 0 || kTransA == 1) && (kTransB == 0 || kTransB == 1), "trans is 0/1");
  const uint32_t scale_d = accumulate ? 1u : 0u;
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  if constexpr (kN == 64) {
    if constexpr (kBf16)
      detail::wgmma_m64n64k16_ss_bf16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                          scale_d);
    else
      detail::wgmma_m64n64k16_ss_f16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                         scale_d);
  } else if constexpr (kN == 80) {
    if constexpr (kBf16)
      detail::wgmma_m64n80k16_ss_bf16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                          scale_d);
    else
      detail::wgmma_m64n80k16_ss_f16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                         scale_d);
  } else if constexpr (kN == 128) {
    if constexpr (kBf16)
      detail::wgmma_m64n128k16_ss_bf16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                           scale_d);
    else
      detail::wgmma_m64n128k16_ss_f16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                          scale_d);
  } else {
    if constexpr (kBf16)
      detail::wgmma_m64n256k16_ss_bf16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                           scale_d);
    else
      detail::wgmma_m64n256k16_ss_f16<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                          scale_d);
  }
}

/** D(64 x kN) = (accumulate ? D : 0) + A * B with A from registers (a_fragment_coord layout) and
 *  B in shared memory. */
template <int kN, typename Elem, int kTransB = 0, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b, bool accumulate) {
  static_assert(kIsWgmma16BitType<Elem>, "wgmma_rs: bf16 or fp16 inputs");
  static_assert(kIsWgmmaN<kN>, "wgmma_rs: N in {64, 128, 256}");
  static_assert(kIsWgmmaScale<kScaleA> && kIsWgmmaScale<kScaleB>, "scale is 1 or -1");
  static_assert(kTransB == 0 || kTransB == 1, "trans is 0/1");
  const uint32_t scale_d = accumulate ? 1u : 0u;
  constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  if constexpr (kN == 64) {
    if constexpr (kBf16)
      detail::wgmma_m64n64k16_rs_bf16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
    else
      detail::wgmma_m64n64k16_rs_f16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
  } else if constexpr (kN == 128) {
    if constexpr (kBf16)
      detail::wgmma_m64n128k16_rs_bf16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
    else
      detail::wgmma_m64n128k16_rs_f16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
  } else {
    if constexpr (kBf16)
      detail::wgmma_m64n256k16_rs_bf16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
    else
      detail::wgmma_m64n256k16_rs_f16<kScaleA, kScaleB, kTransB>(d, a, desc_b, scale_d);
  }
}

}  // namespace flashcore::ptx
