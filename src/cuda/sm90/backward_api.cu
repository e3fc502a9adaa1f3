// Backend functions of the Hopper backward (see api/backends.hpp): which calls it can serve, its
// workspace (the sm80 backward's layout: the two backends share stages 1 and 3), and the dispatch
// from (dtype, head_dim) to the kernel units that cmake/cuda.cmake generated for sm_90a.
//
// Relies on: backward_run<Element, kHeadDim> explicitly instantiated in the generated sm90 units,
// sm90_supports (forward_api.cu) for the checks the two directions share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <string>

#include "api/backends.hpp"
#include "cuda/build_config.hpp"
#include "cuda/compiled_dispatch.cuh"
#include "cuda/sm80/backward_workspace.hpp"
#include "cuda/sm90/attention_views.hpp"

namespace flashcore::cuda {

namespace sm90 {
using backward_params_t = BackwardParams;
template <typename Element, int kHeadDim>
Status backward_run(const backward_params_t& p, void* workspace, size_t workspace_bytes);
}  // namespace sm90

namespace {

template <typename Element, int kHeadDim>
struct BackwardEntry {
  static Status run(const BackwardParams& p, void* workspace, size_t workspace_bytes) {
    return sm90::backward_run<Element, kHeadDim>(p, workspace, workspace_bytes);
  }
};

}  // namespace

bool sm90_backward_supports(const BackwardParams& p, Status* why) {
  // Dropout needs no rule of its own: every tile configuration has kDropout kernels
  // (backward.cuh), which draw the mask of common/dropout.hpp whatever backend ran the forward. So
  // the checks shared with the forward see the call without it: whether the Hopper forward takes
  // dropout (its kernels, its paged routes) does not decide where the backward runs.
  if (p.dropout.enabled()) {
    // The d256 (role-split) dropout kernels run too. compute-sanitizer racecheck reports hazards in
    // them that PTX's barrier semantics rule out (docs/DESIGN.md, "Dropout": a RAW reported across
    // a barrier.sync of both sides, session 46), so their racecheck case is kept apart.
    BackwardParams shared = p;
    shared.dropout = DropoutParams{};
    if (!sm90_supports(shared, why)) return false;  // dtype, device, q/k/v addressing
  } else if (!sm90_supports(p, why)) {
    return false;
  }
  // The kernel indexes rows, query steps (query blocks x GQA group) and the statistics
  // (heads_q x total_q, a TMA coordinate) in 32 bits.
  constexpr int64_t kMaxBlockM = 128;
  const int64_t steps = (p.seqlen_q / 64 + 1) * (p.heads_kv > 0 ? p.heads_q / p.heads_kv : 0);
  if (p.heads_q * p.total_q > INT_MAX - kMaxBlockM || steps > INT_MAX) {
    if (why != nullptr) *why = Status::unsupported("cuda_sm90: the backward indexes heads_q * total_q rows in 32 bits");
    return false;
  }
  // A workspace query validates q/k/v only (dout, dk, dv are not given): the rules below apply
  // when the tensors are known. The query reports the sm80 backward's size (the larger, see
  // sm90_backward_workspace), so a run that falls back to sm80 for its dout / dk / dv still finds
  // the size it was told.
  if (p.dout.data == nullptr) return true;
  const bool varlen = p.is_varlen();
  if (!sm90::tma_addressable(p.dout, varlen, p.batch)) {
    if (why != nullptr) {
      *why = Status::unsupported("cuda_sm90: dout needs 16-byte aligned data and strides that are multiples of 8 "
                                 "elements (TMA)");
    }
    return false;
  }
  // dK / dV are stored as 4-byte column pairs straight from registers.
  for (const TensorRef* t : {&p.dk, &p.dv}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 4 != 0 || t->row_stride % 2 != 0 || t->head_stride % 2 != 0 ||
        (!varlen && t->batch_stride % 2 != 0)) {
      if (why != nullptr) {
        *why = Status::unsupported(std::string("cuda_sm90: ") + (t == &p.dk ? "dk" : "dv") +
                                   " needs 4-byte aligned data and even strides (column-pair stores)");
      }
      return false;
    }
  }
  return true;
}

size_t sm90_backward_workspace(const BackwardParams& p) {
  // The sm80 backward's size (its tiled dQ accumulator is the larger): a call that falls back to
  // sm80 once dout / dk / dv are known (sm90_backward_supports) still finds the size it was told.
  return sm80_backward_workspace(p);
}

Status sm90_backward(const BackwardParams& p, void* workspace, size_t workspace_bytes) {
  return run_compiled<BackwardEntry>(p, workspace, workspace_bytes, "sm90 backward");
}

}  // namespace flashcore::cuda
