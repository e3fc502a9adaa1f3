// A 16-byte global store that stays one instruction.
//
// The sm80 backward's postprocess stores each converted dq chunk as a uint4 through a pointer the
// API guarantees 16-byte aligned (api/validate.cpp), yet nvcc 13 split those stores into four
// 4-byte STG.E at -O3 (session 53, PTX st.global.u32 x 4; __builtin_assume_aligned did not help),
// which quadruples the store instructions of a bandwidth-bound kernel. __stwb keeps the vector
// but becomes STG.E.128.STRONG.SM. This wrapper emits the plain weak st.global.v4.b32.
#pragma once

#include <cstdint>

namespace flashcore::ptx {

/** Stores 16 bytes at `ptr` (16-byte aligned, global memory) as one st.global.v4.b32. Volatile
 *  so it is never dropped; no memory clobber, since nothing in the calling thread reads the
 *  bytes back. */
__device__ __forceinline__ void store_global_v4(void* ptr, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(x), "r"(y), "r"(z), "r"(w));
}

}  // namespace flashcore::ptx
