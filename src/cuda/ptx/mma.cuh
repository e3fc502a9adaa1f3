// Warp-level tensor-core primitives of the sm_80 instruction set, as tiny inline-PTX wrappers.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16" section), lane = threadIdx.x % 32,
// group = lane / 4 (0..7), quad = lane % 4 (0..3):
//   A (16x16, row-major), 4 x .b32 regs, each two 16-bit values:
//     a0: (row group,     cols 2*quad + {0,1})      a1: (row group + 8, cols 2*quad + {0,1})
//     a2: (row group,     cols 2*quad + 8 + {0,1})  a3: (row group + 8, cols 2*quad + 8 + {0,1})
//   B (16x8, "col" = stored as 8 rows of k): 2 x .b32 regs
//     b0: (k 2*quad + {0,1}, n group)               b1: (k 2*quad + 8 + {0,1}, n group)
//   C/D (16x8 fp32), 4 floats: c0,c1: (row group, cols 2*quad + {0,1});
//                              c2,c3: (row group + 8, cols 2*quad + {0,1})
#pragma once

#include <cstdint>

namespace flashcore::ptx {

/** D = A * B + D, fp16 inputs, fp32 accumulation. */
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/** D = A * B + D, bf16 inputs, fp32 accumulation. */
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/** Shared-memory address (32-bit, .shared window) of a generic pointer into shared memory. */
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/** Four 8x8 b16 matrices; lanes 8i..8i+7 supply the row addresses of matrix i. */
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/** As ldmatrix_x4 but each 8x8 matrix is transposed on the way into registers. */
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/** The inverse of ldmatrix_x4: four 8x8 b16 matrices from registers to shared memory. Thread t
 *  holds in r[i] the pair (row t / 4, columns 2 (t % 4), 2 (t % 4) + 1) of matrix i - the mma /
 *  wgmma accumulator fragment once packed to 16 bits - and lanes 8i..8i+7 supply the addresses of
 *  matrix i's rows (16 contiguous bytes each). One instruction stores what four 4-byte st.shared
 *  per thread would. */
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

/** Two 8x8 b16 matrices (lanes 0..15 supply addresses). */
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

}  // namespace flashcore::ptx
