// What cpu_flash's AMX kernels (amx_forward_kernel.hpp, amx_backward_kernel.hpp) share: whether
// the build has them, the tile instructions (or their software model), the one tile configuration,
// fp32 values split into exact bf16 parts, and the packing of operands into tile layouts.
//
// The tile unit computes C[16 x 16] += A[16 x 32] B[32 x 16] (TDPBF16PS) with C in fp32 and A, B
// in bf16. A is row-major: 16 rows of 32 bf16. B is "pair-interleaved" (VNNI): its 32 rows of the
// reduction run in pairs, and tile row i holds, for each of the 16 output columns, the 32-bit unit
// (B[2i][col], B[2i + 1][col]). Every kernel keeps eight tiles of 16 rows x 64 bytes: 0-3 fp32
// accumulators (a 32 x 32 block: rows 0-15 / 16-31 x columns 0-15 / 16-31), 4-5 A (rows 0-15 /
// 16-31), 6-7 B (columns 0-15 / 16-31).
//
// Exactness. An fp32 value x splits into bf16 parts x = x0 + x1 + x2 (x0 = bf16(x), x1 =
// bf16(x - x0), ...: 24 significant bits). A product of split operands is the sum of the part
// products (i, j) with i + j below a bound (Products): fp16 values need two parts (11 bits), bf16
// one, fp32 three. amx_forward_kernel.hpp says which bound each GEMM takes and why.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && \
    defined(__linux__) && ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(FLASHCORE_AMX_EMULATE))
#define FLASHCORE_AMX_BUILT 1
#endif

#if FLASHCORE_AMX_BUILT
#include <algorithm>
#include <cstdint>

#include "cpu/cpu_common.hpp"  // and through it <immintrin.h>, AMX intrinsics too

#if defined(FLASHCORE_AMX_EMULATE)
// A software model of the tile instructions (cpu/amx_emulation.hpp), for checking the kernels'
// layouts with the test grids on a CPU without AMX (CMake option FLASHCORE_AMX_EMULATION).
#include "cpu/amx_emulation.hpp"
#define FC_TILE_CONFIGURE(cfg) amx_emulation::configure(cfg)
#define FC_TILE_RELEASE() amx_emulation::release()
#define FC_TILE_ZERO(t) amx_emulation::zero(t)
#define FC_TILE_LOAD(t, base, stride) amx_emulation::load(t, base, stride)
#define FC_TILE_STORE(t, base, stride) amx_emulation::store(t, base, stride)
#define FC_TILE_DPBF16PS(c, a, b) amx_emulation::dpbf16ps(c, a, b)
#else
#define FC_TILE_CONFIGURE(cfg) _tile_loadconfig(cfg)
#define FC_TILE_RELEASE() _tile_release()
#define FC_TILE_ZERO(t) _tile_zero(t)
#define FC_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define FC_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define FC_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

namespace flashcore {
namespace cpu {
namespace amx_tiles {

using flash_detail::transpose_block;

constexpr int64_t kTileUnits = 256;  // 16 x 16 32-bit units: one 1 KiB tile
constexpr int64_t kSlice = 32;       // bf16 along the reduction per A tile row (64 bytes)

/** The eight 16 x 64-byte tiles described in the file comment. */
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

/** Loads the configuration on this thread for its lifetime in scope; releases the tile state
 *  before the worker goes back to the pool. */
class ScopedTiles {
 public:
  ScopedTiles() { FC_TILE_CONFIGURE(&config_); }
  ~ScopedTiles() { FC_TILE_RELEASE(); }
  ScopedTiles(const ScopedTiles&) = delete;
  ScopedTiles& operator=(const ScopedTiles&) = delete;

 private:
  const TileConfig config_;
};

/** Significant parts of an input dtype's values in bf16. */
inline int parts_of(DType dtype) {
  switch (dtype) {
    case DType::BF16: return 1;
    case DType::F16: return 2;
    default: return 3;
  }
}

/** The pairs (i, j) of parts with i + j <= max_sum whose products make up a GEMM, grouped by i
 *  (so an A tile serves consecutive products) and roughly smallest first. max_sum 2 drops only
 *  terms below 2^-24 of the product (fp32-exact). */
struct Products {
  int count = 0;
  int a[6], b[6];
  Products(int a_parts, int b_parts, int max_sum) {
    for (int i = a_parts - 1; i >= 0; --i)
      for (int j = b_parts - 1; j >= 0; --j)
        if (i + j <= max_sum) a[count] = i, b[count] = j, ++count;
  }
};

inline __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h)), 16));
}

/** The `parts` bf16 parts of 16 floats: part s goes to dst + s * part_stride (16 bf16 each). */
inline void split16(__m512 x, int parts, uint16_t* dst, int64_t part_stride) {
  for (int s = 0; s < parts; ++s) {
    __m256bh h = _mm512_cvtneps_pbh(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + s * part_stride), reinterpret_cast<__m256i&>(h));
    if (s + 1 < parts) x = _mm512_sub_ps(x, widen(h));  // exact: x - round(x) is representable
  }
}

/** Two rows' 16 floats as the parts of 16 B-tile units (x0[c], x1[c]): part s goes to
 *  dst + s * part_stride (16 units each). */
inline void split_pairs16(__m512 x0, __m512 x1, int parts, uint32_t* dst, int64_t part_stride) {
  for (int s = 0; s < parts; ++s) {
    __m256bh h0 = _mm512_cvtneps_pbh(x0), h1 = _mm512_cvtneps_pbh(x1);
    const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h0));
    const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(h1));
    _mm512_storeu_si512(dst + s * part_stride, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    if (s + 1 < parts) {
      x0 = _mm512_sub_ps(x0, widen(h0));
      x1 = _mm512_sub_ps(x1, widen(h1));
    }
  }
}

/** Lanes [lo, hi) of a 16-lane vector, for lo, hi in any range. */
inline __mmask16 lane_range(int64_t lo, int64_t hi) {
  const int64_t l = std::clamp<int64_t>(lo, 0, 16), h = std::clamp<int64_t>(hi, 0, 16);
  const uint32_t upto_h = (1u << h) - 1, upto_l = (1u << l) - 1;
  return static_cast<__mmask16>(upto_h & ~upto_l);
}

/** 16 elements of a `dtype` row from column c on as floats, zeros past `valid` columns (masked
 *  loads: nothing past the row's end is touched). */
inline __m512 load16(DType dtype, const void* row, int64_t c, int64_t valid) {
  const __mmask16 mask = lane_range(0, valid - c);
  if (dtype == DType::F32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + c);
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + c);
  if (dtype == DType::F16) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/** One `dtype` row of `cols` elements (nullptr: zeros) as `parts` row-major bf16 rows of d_pad
 *  (a multiple of 16) at dst + s * part_stride, times `scale` where scaled. */
inline void split_row(DType dtype, const void* row, int64_t cols, int64_t d_pad, int parts, uint16_t* dst,
                      int64_t part_stride, bool scaled = false, float scale = 1.f) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < d_pad; c += 16) {
    __m512 x = row ? load16(dtype, row, c, cols) : _mm512_setzero_ps();
    if (scaled) x = _mm512_mul_ps(x, vscale);
    split16(x, parts, dst + c, part_stride);
  }
}

/** Accumulator tiles 0-3 (a 32 x 32 fp32 block) from or to memory with rows `ld` floats apart. */
inline void load_accumulators(const float* c, int64_t ld) {
  FC_TILE_LOAD(0, c, ld * 4);
  FC_TILE_LOAD(1, c + 16, ld * 4);
  FC_TILE_LOAD(2, c + 16 * ld, ld * 4);
  FC_TILE_LOAD(3, c + 16 * ld + 16, ld * 4);
}
inline void store_accumulators(float* c, int64_t ld) {
  FC_TILE_STORE(0, c, ld * 4);
  FC_TILE_STORE(1, c + 16, ld * 4);
  FC_TILE_STORE(2, c + 16 * ld, ld * 4);
  FC_TILE_STORE(3, c + 16 * ld + 16, ld * 4);
}
inline void zero_accumulators() {
  FC_TILE_ZERO(0);
  FC_TILE_ZERO(1);
  FC_TILE_ZERO(2);
  FC_TILE_ZERO(3);
}

/** A tiles 4-5: A's 32 rows (16-row tiles at a and a + 16 rows, rows `a_ld` bf16 apart). */
inline void load_a(const uint16_t* a, int64_t a_ld) {
  FC_TILE_LOAD(4, a, a_ld * 2);
  FC_TILE_LOAD(5, a + 16 * a_ld, a_ld * 2);
}

/** Accumulators += A B for the A in tiles 4-5 (load_a) and B's two 16-column tiles, stored back
 *  to back from b. */
inline void multiply_accumulate(const uint16_t* b) {
  FC_TILE_LOAD(6, b, 64);
  FC_TILE_LOAD(7, b + kTileUnits * 2, 64);
  FC_TILE_DPBF16PS(0, 4, 6);
  FC_TILE_DPBF16PS(1, 4, 7);
  FC_TILE_DPBF16PS(2, 5, 6);
  FC_TILE_DPBF16PS(3, 5, 7);
}

/** B tiles of a matrix whose rows are the output columns and whose columns are the reduction (K
 *  in S = Q K^T; the backward's Q in S^T = K Q^T): rows [0, n_pack) (a multiple of 16), row n
 *  at row_at(n) (a `dtype` row of `cols` elements; nullptr: zeros), d_pad a multiple of 32. Per
 *  32-column slice and 16 rows one tile, whose row i holds (x[2i], x[2i + 1]) of the 16 rows: tile
 *  (part s, slice, t = n / 16) at dst + (s * part_stride + slice * slice_stride + t) * kTileUnits
 *  floats. Each 16 rows are split row-major into `stage` (parts * 8 * d_pad floats), then
 *  transposed as 32-bit units. */
template <class RowAt>
void pack_column_pairs(DType dtype, RowAt&& row_at, int64_t n_pack, int64_t cols, int64_t d_pad, int parts,
                       float* stage, float* dst, int64_t slice_stride, int64_t part_stride) {
  const int64_t slices = d_pad / kSlice;
  uint16_t* staged = reinterpret_cast<uint16_t*>(stage);
  const int64_t staged_part = slices * kTileUnits * 2;  // bf16 per part
  for (int64_t t = 0; t < n_pack / 16; ++t) {
    for (int64_t r = 0; r < 16; ++r) {
      const void* row = row_at(t * 16 + r);
      for (int64_t c = 0; c < d_pad; c += 16) {
        const __m512 x = row ? load16(dtype, row, c, cols) : _mm512_setzero_ps();
        split16(x, parts, staged + ((c / kSlice) * 16 + r) * kSlice + c % kSlice, staged_part);
      }
    }
    for (int s = 0; s < parts; ++s)
      for (int64_t slice = 0; slice < slices; ++slice)
        transpose_block(stage + (s * slices + slice) * kTileUnits, 16,
                        dst + (s * part_stride + slice * slice_stride + t) * kTileUnits, 16);
  }
}

/** B tiles of a matrix whose rows are the reduction (V in O += P V; the backward's dO and Q):
 *  rows [0, n_pack) (a multiple of 32) from row_at as in pack_column_pairs. Per 32 rows and 16
 *  columns one tile whose row i interleaves rows 2i and 2i + 1: tile (part s, chunk n / 32, column
 *  tile ct) at dst + (s * part_stride + (n / 32) * (d_pad / 16) + ct) * kTileUnits floats. */
template <class RowAt>
void pack_row_pairs(DType dtype, RowAt&& row_at, int64_t n_pack, int64_t cols, int64_t d_pad, int parts,
                    float* dst, int64_t part_stride) {
  const int64_t col_tiles = d_pad / 16;
  uint32_t* pack = reinterpret_cast<uint32_t*>(dst);
  for (int64_t n = 0; n < n_pack; n += 2) {
    const void* row0 = row_at(n);
    const void* row1 = row_at(n + 1);
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      const __m512 x0 = row0 ? load16(dtype, row0, ct * 16, cols) : _mm512_setzero_ps();
      const __m512 x1 = row1 ? load16(dtype, row1, ct * 16, cols) : _mm512_setzero_ps();
      split_pairs16(x0, x1, parts, pack + ((n / 32) * col_tiles + ct) * kTileUnits + ((n % 32) / 2) * 16,
                    part_stride * kTileUnits);
    }
  }
}

}  // namespace amx_tiles
}  // namespace cpu
}  // namespace flashcore

#endif  // FLASHCORE_AMX_BUILT
