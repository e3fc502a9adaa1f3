// The functions each backend provides. dispatch.cpp is their only caller; it hands them
// parameters that validate.cpp has already checked. A backend never validates again, never
// calls another backend, and never synchronizes or allocates device memory behind the caller.
#pragma once

#include <cstddef>
#include <string>

#include "api/params.hpp"
#include "api/status.hpp"

namespace flashcore {

namespace cpu {
// fp64 materialized attention: the oracle.
enum class ReferenceMode {
  exact,          // fp64 throughout: the truth
  low_precision,  // fp32 sums, P and dS rounded to the input dtype, the backward's D from the
                  // stored `out`: the "X_same" of the tolerance rule in TESTING.md
  // Backward only, fp64: writes into dq/dk/dv how far each gradient element moves, to first
  // order, when every score carries an fp32 dot product's error (sqrt(d)/2 roundings of
  // sum|q k|). Negligible at unit inputs; at scores near 1e4 it is as large as the dtype's
  // rounding, and the tests add it to the bound of a kernel that recomputes P from the lse.
  score_error_bound,
};
Status reference_forward(const AttentionParams& p, ReferenceMode mode = ReferenceMode::exact);
Status reference_backward(const BackwardParams& p, ReferenceMode mode = ReferenceMode::exact);

// Tiled online softmax, fp32 accumulation, threads over (batch, head, query block), SIMD.
Status flash_forward(const AttentionParams& p);
Status flash_backward(const BackwardParams& p);
}  // namespace cpu

namespace cuda {
// Number of visible devices; 0 when CUDA is not compiled in or no GPU is present.
int device_count();
// Compute capability major*10+minor of a device, or 0.
int compute_capability(int device_id);
// One line about a device (name, compute capability, SMs, memory, DRAM peak), or "" when it cannot
// be queried.
std::string device_description(int device_id);
// Copies `bytes` from device memory to the host in stream order and waits for the copy (a host
// synchronization: only for checks the caller asked for).
Status copy_to_host(void* host, const void* device_ptr, size_t bytes, int device_id, void* stream);
// Varlen calls with an error_flag: a one-CTA kernel on p.stream sets *p.error_flag = 1 when
// cu_seqlens break the rules (varlen_check.cu); nothing to do otherwise.
Status check_cu_seqlens_on_device(const AttentionParams& p);

// Portable tensor-core path (mma.sync, sm_80+). Workspace sizes in bytes on the device.
bool sm80_supports(const AttentionParams& p, Status* why);
size_t sm80_forward_workspace(const AttentionParams& p);
Status sm80_forward(const AttentionParams& p, void* workspace, size_t workspace_bytes);
size_t sm80_backward_workspace(const BackwardParams& p);
Status sm80_backward(const BackwardParams& p, void* workspace, size_t workspace_bytes);

// Hopper path (TMA + wgmma, sm_90a SASS). Where it cannot serve a call (not built, not a CC 9.0
// device, TMA-unfriendly strides; for the backward also head dims above 128) the *_supports
// function says why and AUTO uses sm80.
bool sm90_supports(const AttentionParams& p, Status* why);
/** Workspace of a forward: the page gather's where pages are gathered, then the split-KV partials
 *  where the call's tiles leave SMs idle (sm90/split_kv.hpp). Only the gather's part is required
 *  (sm90_forward_required_workspace): with less than the whole the call runs unsplit. */
size_t sm90_forward_workspace(const AttentionParams& p);
size_t sm90_forward_required_workspace(const AttentionParams& p);
Status sm90_forward(const AttentionParams& p, void* workspace, size_t workspace_bytes);
bool sm90_backward_supports(const BackwardParams& p, Status* why);
size_t sm90_backward_workspace(const BackwardParams& p);
Status sm90_backward(const BackwardParams& p, void* workspace, size_t workspace_bytes);
}  // namespace cuda

}  // namespace flashcore

namespace flashcore::cpu {
/** One row of the exact reference: out_row (head_dim doubles) and its lse, for (batch b, query
 *  head h, query row i within sequence b). Used by the CLI to spot-check large problems. */
void reference_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, double* out_row, double* lse);
}  // namespace flashcore::cpu
