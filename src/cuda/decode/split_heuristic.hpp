// The split-KV count of a decode call, from a model of how its CTAs share the memory system.
// Plain C++ (no CUDA): decode_api.cu fills SplitModel from the device's attributes, and the CPU
// tests check the choices on the H100's and the H200's numbers.
//
// The model. The attention CTAs of a call stream about the same number of bytes each. Alone a CTA
// reads at most `cta_read_rate`, which its warps set (each streams its tiles one after another; a
// deeper ring per warp did not raise it, more warps on the SM did). The memory system reads at most
// `read_rate` in all, shared evenly by the SMs, and an SM's share is split among the CTAs resident
// on it. A wave of n resident CTAs therefore ends when a CTA on its busiest SM (ceil(n / sms)
// CTAs) has read its bytes at
//     min(cta_read_rate, read_rate / sms / ceil(n / sms)).
// Measured (docs/PERF.md, session 33, d128 bf16 decode, K+V TB/s by explicit split count):
// - One 4-warp CTA per SM (128 CTAs) reads 3.04-3.08 TB/s on both an H100 (ceiling 3.07) and an
//   H200 (ceiling 4.21-4.32): a CTA's rate, not the memory system, bounds it, so the H200 needs
//   two such CTAs per SM: 16 x 8192 reads 3.08 with one split and 4.05 with two; 1 x 65536 2.87
//   with 16 splits and 3.61 with 32. One 8-warp CTA per SM reads 4.18 at 16 x 8192 unsplit.
// - 192 CTAs on 132 SMs (1 x 65536, 24 splits) read 3.18 on the H200, not more than 128 CTAs: the
//   CTAs sharing an SM set the wave's time, hence the busiest-SM term.
// Among the split counts, the fewest within kNearBest of the best modeled rate wins (each split
// adds partials and a combine that the model does not count).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flashcore::cuda::decode {

struct SplitModel {
  int64_t ctas = 1;            // attention CTAs of one split (KV heads x row chunks x sequences)
  int64_t max_splits = 1;      // the most splits the key range allows
  int sms = 1;                 // streaming multiprocessors
  int ctas_per_sm = 1;         // attention CTAs resident on one SM (shared memory bound)
  double cta_read_rate = 1;    // bytes / s one CTA reads alone
  double read_rate = 0;        // bytes / s the device reads in all; <= 0: unknown (see below)
};

inline constexpr double kNearBest = 0.95;

/** Whether 8-warp CTAs (one per SM) suit a call whose splits have `ctas` CTAs each: some split
 *  count fills the SMs within kNearBest in one wave. Several waves of one CTA per SM pay every
 *  CTA's start and end in turn, which two 4-warp CTAs per SM overlap (docs/PERF.md session 33:
 *  64 x 2048, 512 CTAs, -8% to -13% on 8 warps). */
inline bool one_wave_fills_sms(int64_t ctas, int sms) {
  if (ctas <= 0 || sms <= 0 || ctas > sms) return false;
  return double(sms / ctas * ctas) >= kNearBest * sms;
}

/** Whether a call takes 8-warp CTAs: with the split count left to choose_num_splits, where
 *  one_wave_fills_sms (the splits then keep to that wave); with `forced_splits` > 0 (the caller's
 *  num_splits), while its CTAs make one wave. */
inline bool eight_warp_ctas_suit(int64_t ctas, int64_t forced_splits, int sms) {
  if (forced_splits <= 0) return one_wave_fills_sms(ctas, sms);
  return ctas > 0 && sms > 0 && ctas <= sms / forced_splits;
}

/** Bytes / s per CTA while a wave of `n` resident CTAs streams (the model above). With the device's
 *  read rate unknown, one CTA per SM is taken to saturate it (the H100's case). */
inline double wave_cta_rate(const SplitModel& m, double n) {
  const double read_rate = m.read_rate > 0 ? m.read_rate : m.cta_read_rate * m.sms;
  const double busiest_sm = std::ceil(n / m.sms);
  return std::min(m.cta_read_rate, read_rate / m.sms / busiest_sm);
}

/** Modeled bytes / s of a call cut into `splits` (in units of one CTA's bytes, which cancel). */
inline double split_read_rate(const SplitModel& m, int64_t splits) {
  const double n = double(m.ctas) * double(splits);
  const double resident = double(m.sms) * m.ctas_per_sm;
  const double full_waves = std::floor(n / resident);
  const double rest = n - full_waves * resident;
  double time = full_waves / wave_cta_rate(m, resident);
  if (rest > 0) time += 1.0 / wave_cta_rate(m, rest);
  return n / time;
}

/** The fewest splits whose modeled rate is within kNearBest of the best one (1 for a model
 *  without CTAs, SMs or rates). */
inline int choose_num_splits(const SplitModel& m) {
  if (m.ctas <= 0 || m.sms <= 0 || m.ctas_per_sm <= 0 || !(m.cta_read_rate > 0)) return 1;
  const int64_t max_splits = std::clamp<int64_t>(m.max_splits, 1, 1 << 16);
  double best = 0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, split_read_rate(m, s));
  for (int64_t s = 1; s <= max_splits; ++s)
    if (split_read_rate(m, s) >= kNearBest * best) return static_cast<int>(s);
  return 1;
}

}  // namespace flashcore::cuda::decode
