// How the forward kernels (sm80 and sm90) turn a raw q.k score into the log2-domain exponent of
// the online softmax, resolved once on the host from softmax_scale and softcap.
//  kFoldedScale (scale > 0, no softcap): the row max runs on raw scores and the scale is folded
//      into one FFMA, p = exp2(s * exp2_scale - m * exp2_scale).
//  kLinear (scale < 0): s <- s * pre_scale first (a max of raw scores would be a min).
//  kSoftcap: s <- post_scale * tanh(s * pre_scale) first (tanh must see natural-scale scores).
//  ALiBi calls never fold the scale: their per-element bias is added to the transformed score.
#pragma once

#include "api/params.hpp"

namespace flashcore::cuda {

enum class ScoreTransform : int { kFoldedScale = 0, kLinear = 1, kSoftcap = 2 };

struct ScoreScales {
  ScoreTransform transform = ScoreTransform::kFoldedScale;
  float exp2_scale = 1.f;  // factor of the (transformed) score in the exponent
  float pre_scale = 1.f;   // kLinear / kSoftcap
  float post_scale = 1.f;  // kSoftcap
};

inline ScoreScales resolve_score_scales(const AttentionParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  ScoreScales s;
  if (p.softcap > 0.f) {
    s.transform = ScoreTransform::kSoftcap;
    s.pre_scale = p.softmax_scale / p.softcap;
    s.post_scale = p.softcap * kLog2e;
  } else if (p.softmax_scale > 0.f && !p.has_alibi()) {
    s.exp2_scale = p.softmax_scale * kLog2e;
  } else {
    s.transform = ScoreTransform::kLinear;
    s.pre_scale = p.softmax_scale * kLog2e;
  }
  return s;
}

}  // namespace flashcore::cuda
