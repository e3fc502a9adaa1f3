// Backend selection and the validated call path: validate -> choose backend -> check workspace
// -> run. The C ABI (c_api.cpp) is a thin exception-safe shell over these functions.
#pragma once

#include <cstddef>

#include "api/validate.hpp"

namespace flashcore {

/** Whether `backend` is compiled in and can run on device `device_id` (ignored for CPU). */
bool backend_available(fc_backend backend, int device_id);

/** The backend AUTO resolves to for these (validated) forward / backward parameters, or an
 *  error when the requested backend is not available. */
Status choose_backend(const AttentionParams& p, fc_backend requested, fc_backend* chosen);
Status choose_backend(const BackwardParams& p, fc_backend requested, fc_backend* chosen);

/** Whether run_forward hands these arguments to the decode kernel (AUTO's decode route: a dense or
 *  varlen forward with few query rows per KV head); false for invalid arguments. For reports such as
 *  `flashcore run`'s backend line. */
bool forward_takes_decode_route(const ForwardArgs& args);

/** A CUDA call's workspace: a given one (non-NULL, bytes > 0) 16-byte aligned, since the kernels
 *  store 16-byte vectors and fp32 partials there; at least `needed` bytes where the call needs
 *  any. `query` names the function that reports the size, for the message. */
Status check_workspace(size_t needed, const void* workspace, size_t workspace_bytes, const char* query);

Status forward_workspace(const ForwardArgs& args, size_t* bytes);
Status run_forward(const ForwardArgs& args, void* workspace, size_t workspace_bytes);
Status backward_workspace(const BackwardArgs& args, size_t* bytes);
Status run_backward(const BackwardArgs& args, void* workspace, size_t workspace_bytes);

}  // namespace flashcore
