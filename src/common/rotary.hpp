// Rotary position embedding of one feature, shared by the CPU and CUDA KV-cache paths so both
// compute the same thing: feature d of a row is rotated with its partner by the angle of pair
// `index` (cos / sin table column). Pairs are (2i, 2i + 1) when interleaved (GPT-J) and (i, i +
// half) otherwise (GPT-NeoX); features from 2 * half on are not rotated. In float32, as flash_attn:
//   first  feature x1: x1 * cos - x2 * sin
//   second feature x2: x1 * sin + x2 * cos
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace flashcore {

struct RotaryFeature {
  int64_t index;    // table column: the pair's angle
  int64_t partner;  // the other feature of the pair
  bool first;
};

/** Where feature d (< 2 * half) sits in its pair. */
FC_HOST_DEVICE RotaryFeature rotary_feature(int64_t d, int64_t half, bool interleaved) {
  if (interleaved) return {d / 2, d ^ 1, (d & 1) == 0};
  const bool first = d < half;
  return {first ? d : d - half, first ? d + half : d - half, first};
}

/** Feature x rotated, given its partner's value and the pair's cos / sin. */
FC_HOST_DEVICE float rotate_feature(float x, float partner, float cos, float sin, bool first) {
  return first ? x * cos - partner * sin : partner * sin + x * cos;
}

}  // namespace flashcore
