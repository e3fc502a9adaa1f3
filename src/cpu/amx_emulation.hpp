// A software model of the AMX tile instructions that amx_forward.cpp uses (LDTILECFG,
// TILERELEASE, TILEZERO, TILELOADD, TILESTORED, TDPBF16PS), one tile file per thread. Only for
// builds with FLASHCORE_AMX_EMULATION=ON: the AMX forward's layouts then run through the test
// grids on any AVX512-BF16 CPU. TDPBF16PS is modelled as its definition in the Intel SDM: per
// output element, the pairs of bf16 products added in order into the fp32 accumulator (the
// hardware's rounding inside a pair may differ; exactness is not what this model checks).
#pragma once

#include <cstdint>
#include <cstring>

namespace flashcore {
namespace cpu {
namespace amx_emulation {

struct Tile {
  int rows = 0;
  int colsb = 0;  // bytes per row
  uint8_t data[16][64];
};

inline Tile* tiles() {
  thread_local Tile file[8];
  return file;
}

/** cfg: the 64-byte LDTILECFG operand (palette, start row, 14 reserved, colsb[16], rows[16]). */
inline void configure(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    tiles()[t].colsb = colsb;
    tiles()[t].rows = c[48 + t];
    std::memset(tiles()[t].data, 0, sizeof tiles()[t].data);
  }
}

inline void release() {
  for (int t = 0; t < 8; ++t) tiles()[t] = Tile{};
}

inline void zero(int t) { std::memset(tiles()[t].data, 0, sizeof tiles()[t].data); }

inline void load(int t, const void* base, int64_t stride) {
  Tile& tile = tiles()[t];
  for (int r = 0; r < tile.rows; ++r) std::memcpy(tile.data[r], static_cast<const uint8_t*>(base) + r * stride, tile.colsb);
}

inline void store(int t, void* base, int64_t stride) {
  const Tile& tile = tiles()[t];
  for (int r = 0; r < tile.rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile.data[r], tile.colsb);
}

inline float bf16_at(const Tile& t, int row, int element) {
  uint16_t h;
  std::memcpy(&h, t.data[row] + 2 * element, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/** C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] (A: M x 2K bf16, B: K x 2N bf16). */
inline void dpbf16ps(int c, int a, int b) {
  Tile& tc = tiles()[c];
  const Tile& ta = tiles()[a];
  const Tile& tb = tiles()[b];
  for (int m = 0; m < tc.rows; ++m) {
    for (int n = 0; n < tc.colsb / 4; ++n) {
      float acc;
      std::memcpy(&acc, tc.data[m] + 4 * n, 4);
      for (int k = 0; k < ta.colsb / 4; ++k) {
        acc += bf16_at(ta, m, 2 * k) * bf16_at(tb, k, 2 * n);
        acc += bf16_at(ta, m, 2 * k + 1) * bf16_at(tb, k, 2 * n + 1);
      }
      std::memcpy(tc.data[m] + 4 * n, &acc, 4);
    }
  }
}

}  // namespace amx_emulation
}  // namespace cpu
}  // namespace flashcore
