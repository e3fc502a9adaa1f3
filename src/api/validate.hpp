// Argument validation: the one place where every rule of the public API is checked and every
// error message is written. On success it produces the AttentionParams/BackwardParams that
// backends consume; on failure it returns a Status whose message names the argument and the rule.
#pragma once

#include "api/params.hpp"
#include "api/status.hpp"
#include "flashcore/flashcore.h"

namespace flashcore {

struct ForwardArgs {
  const fc_tensor* q;
  const fc_tensor* k;
  const fc_tensor* v;
  const fc_tensor* out;  // may be nullptr only for workspace queries
  const fc_tensor* lse;  // optional
  const fc_attention_options* options;  // nullptr = defaults
};

struct BackwardArgs {
  const fc_tensor* dout;
  const fc_tensor* q;
  const fc_tensor* k;
  const fc_tensor* v;
  const fc_tensor* out;
  const fc_tensor* lse;
  const fc_tensor* dq;
  const fc_tensor* dk;
  const fc_tensor* dv;
  const fc_attention_options* options;
};

/** Checks shapes, dtypes, devices, strides, overlap, options; fills `params`.
 *  `for_workspace_query` skips the output tensors (they are not passed to workspace queries). */
Status validate_forward(const ForwardArgs& args, bool for_workspace_query, AttentionParams* params);
Status validate_backward(const BackwardArgs& args, bool for_workspace_query, BackwardParams* params);

/** Backend-specific rules (device kind, dtype, head_dim, pointer/stride alignment). `tensors` are
 *  all tensors of the call (nullptr entries are skipped) for the alignment checks. */
Status validate_for_backend(const AttentionParams& params, fc_backend backend,
                            const fc_tensor* const* tensors, const char* const* names, int count);

}  // namespace flashcore
