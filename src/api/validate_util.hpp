// Building blocks of argument validation, shared by every validation file (validate.cpp for
// attention, the KV-cache entry points): each checks one rule and returns a Status whose message
// names the argument, in the project's one format "<argument>: <what is wrong> (<rule>)".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/status.hpp"
#include "flashcore/flashcore.h"

namespace flashcore::validate_detail {

/** Memory interval a tensor touches, in bytes relative to its data pointer. */
struct Extent {
  int64_t numel = 0;
  int64_t lo = 0;  // bytes, inclusive
  int64_t hi = 0;  // bytes, exclusive
};

const char* dtype_name(int32_t t);
std::string shape_str(const fc_tensor& t);
/** ndim, known dtype/device, non-negative sizes, int64-safe extent, non-null data, last dim stride 1. */
Status check_tensor_basics(const fc_tensor* t, const char* name, int ndim, Extent* ext);
Status check_shape(const fc_tensor* t, const char* name, const std::vector<int64_t>& expected, const char* rule);
Status check_same_device(const fc_tensor* t, const char* name, const fc_tensor* ref, const char* ref_name);
Status check_dtype(const fc_tensor* t, const char* name, int32_t expected, const char* why);
/** Outputs: every element at a distinct address. */
Status check_no_self_overlap(const fc_tensor* t, const char* name);
/** Two tensors' memory intervals must not intersect. */
Status check_disjoint(const fc_tensor* a, const Extent& ea, const char* an, const fc_tensor* b, const Extent& eb,
                      const char* bn);

/** The options every attention entry point shares, checked and resolved: the scale (0 selects
 *  1/sqrt(head_dim)) and softcap as float32, the window with causal folded in (right = 0). */
struct ResolvedOptions {
  float softmax_scale = 0.f;
  float softcap = 0.f;
  int64_t window_left = -1;
  int64_t window_right = -1;
};
Status check_common_options(const fc_attention_options& opt, int64_t head_dim, ResolvedOptions* r);

/** alibi_slopes (every entry point that takes them): float32 (heads_q) or (batch, heads_q) on q's
 *  device, rows contiguous; the values are checked (finite) only for CPU tensors, and trusted on a
 *  GPU as flash_attn does (reading them there would synchronize). On success *values and
 *  *batch_stride (0 for (heads_q) slopes) describe them. */
Status check_alibi_slopes(const fc_tensor& slopes, int64_t batch, int64_t heads_q, const fc_tensor* q,
                          const float** values, int64_t* batch_stride);

}  // namespace flashcore::validate_detail
