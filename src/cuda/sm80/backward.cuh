// sm80 (mma.sync) FlashAttention-2 backward: dQ, dK, dV from Q, K, V, O, dO and the forward's LSE.
//
// Stages, all on p.stream, no host synchronization (on sm_90 each launched as a programmatic
// dependent of the kernel before it: launch_stage):
//   1. preprocess (backward_prepost.cuh): per query row and head, D = rowsum(dO * O) and
//      lse * log2(e) into the workspace (lse = -inf -> +inf so P = exp2(s - lse) is exactly 0);
//      in the default mode the fp32 dQ accumulator is zeroed with cudaMemsetAsync.
//   2. main (backward_main.cuh): one CTA per (key block of kBlockN rows, KV head, batch) keeps K, V
//      in shared memory and dK, dV in registers, and loops over every query head of the GQA group
//      and every query block that can see its keys (the block range is derived from the window;
//      tiles that are only partly visible are masked per element with MaskInfo::keys_for_row).
//      Per step: dP = dO V^T, S = Q K^T, P = exp2(S*scale*log2e - lse_log2) (softcap: via tanh),
//      dS = P (dP - D) (* (1 - tanh^2)); P and dS go to shared memory as the element type;
//      dV += P^T dO, dK += dS^T Q; then dQ_accum += dS K with fp32 atomics (default mode).
//      The plain kernels' order within a step is tuned per head dim (StepSchedule in
//      backward_main.cuh: P between the two GEMMs, the next block's copies after them).
//      Q/dO are double-buffered with cp.async for d <= 128 (single buffer at d = 256, where the
//      next block's load overlaps the dQ part instead; where a block may use more shared memory,
//      as on sm_90, d = 256 takes the double-buffered LargeSmemBackwardTraits shape, chosen at
//      run time from the device attribute). dK is scaled by softmax_scale on store.
//   3. postprocess (default mode): dq = softmax_scale * dQ_accum, converted, with p.dq's strides.
//
// Dropout (p.dropout, kernels of their own on the portable tiles: backward_dkdv_kernel and
// backward_dq_kernel with kDropout): the recomputed P is dropped with the forward's mask, dS =
// P (Z dP - D) and dV = keep_scale * (P o kept)^T dO (backward_scores.cuh). D needs nothing new:
// rowsum(dO * O) of the stored, dropped O is already sum_j P_j Z_j dP_j.
//
// Deterministic mode (p.deterministic): fp32 atomics would make dq depend on the arrival order,
// so the main kernel skips them and stage 3 is backward_dq.cuh instead: one CTA per (query
// block, query head, batch) recomputes P and dS for the key blocks in increasing order and
// accumulates dq = dS K in registers. dK/dV never use atomics (the CTA loops over the whole
// GQA group), D uses a fixed shuffle tree, so every output is bit-identical run to run; the
// price is the S and dP GEMMs computed twice (DeterministicDqTraits gives that kernel its tiles).
//
// Performance notes (H100, bf16, B = 16384/S, H = 2048/D; bench in the helper report): addresses
// of the ldmatrix operands are rebuilt per GEMM from four per-lane bases (SwizzledOperand) and an
// opaque() lane, because letting the compiler hoist them out of the main loop made it spill;
// exp2 is one ex2.approx instruction; fully visible tiles skip the per-element mask test.
//
// Fragment layouts (ptx/mma.cuh): all GEMMs are m16n8k16 with operands from XOR-swizzled shared
// tiles (backward_common.cuh, SwizzledTile). A warp GEMM reads A as [m][k] with ldmatrix or as
// [k][m] with ldmatrix.trans, and B as [n][k] with ldmatrix or [k][n] with ldmatrix.trans:
//   S = Q K^T, dP = dO V^T : A = Q/dO [m][d],      B = K/V rows [n][d]  (both plain)
//   dV = P^T dO, dK = dS^T Q: A = P/dS [m][n] (.trans), B = dO/Q [m][d] (.trans)
//   dQ = dS K              : A = dS [m][n] (plain),  B = K [n][d] (.trans)
// Accumulators follow the C layout (rows group / group + 8, columns 2*quad + {0,1}); P and dS
// are stored from it as element pairs. Each GEMM has its own warp grid (BackwardTraits).
//
// Head dims below the bucket: loads zero-fill the padded columns (so they add nothing to any
// dot product) and stores skip them. Offsets are int64; grids are 1-D with the key (or query)
// block fastest.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>
#include <utility>

#include "api/status.hpp"
#include "cuda/build_config.hpp"
#include "cuda/programmatic_launch.hpp"
#include "cuda/sm80/backward_dq.cuh"
#include "cuda/sm80/backward_main.cuh"
#include "cuda/sm80/backward_prepost.cuh"
#include "cuda/sm80/backward_workspace.hpp"

namespace flashcore::cuda::sm80 {

using backward_params_t = BackwardParams;

namespace bwd {

constexpr int64_t kPostprocessMaxBlocks = 1 << 16;  // grid-stride beyond this many blocks

/** The stages' launches: each a programmatic dependent of the kernel before it (the preprocess of
 *  the caller's previous kernel, the main kernel of the preprocess, the dq stage of the main
 *  kernel), each kernel waiting for its predecessor first thing (cuda/programmatic_launch.hpp). */
template <typename... Params, typename... Args>
Status launch_stage(const char* what, void (*kernel)(Params...), int64_t blocks, int threads, int smem,
                    cudaStream_t stream, int device_id, Args&&... args) {
  const cudaError_t err = launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads),
                                        static_cast<size_t>(smem), stream, supports_programmatic_launch(device_id),
                                        std::forward<Args>(args)...);
  if (err == cudaSuccess) return Status::ok();
  return Status::cuda(std::string("backward ") + what + ": " + cudaGetErrorString(err));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace bwd

namespace bwd {

/** The workspace regions of `layout` inside `workspace`. */
inline BackwardWorkspacePtrs workspace_ptrs(const BackwardWorkspaceLayout& layout, void* workspace) {
  char* base = static_cast<char*>(workspace);
  BackwardWorkspacePtrs ws;
  ws.lse_log2 = reinterpret_cast<float*>(base + layout.lse_log2_offset);
  ws.dsum = reinterpret_cast<float*>(base + layout.dsum_offset);
  ws.dq_accum = layout.has_dq_accum ? reinterpret_cast<float*>(base + layout.dq_accum_offset) : nullptr;
  ws.dq_tiled = layout.dq_tiled;
  ws.dq_rows_per_head = layout.dq_rows_per_head;
  return ws;
}

/** Stage 1: D, lse_log2; zero dQ_accum (one kernel: the zeroing rides on the same row walk).
 *  Shared with the sm90 backward, which runs the same stages 1 and 3 around its own main kernel. */
template <typename Element, int kHeadDim>
Status launch_preprocess(const backward_params_t& p, const BackwardWorkspacePtrs& ws, cudaStream_t stream) {
  const int64_t stat_rows = p.total_q * p.heads_q;
  if (stat_rows == 0) return Status::ok();
  const int64_t blocks = ceil_div(stat_rows, PreprocessShape<kHeadDim>::kRowsPerBlock);
  if (blocks > INT_MAX) return Status::unsupported("q: total_q * heads_q is too large for the backward grid");
  return launch_stage("preprocess", backward_preprocess_kernel<Element, kHeadDim>, blocks, kPrepostThreads, 0, stream,
                      p.device_id, p, ws);
}

/** Resident CTAs of the backward's kernels for grid_order.hpp's tail (they run 1-2 per SM; 2
 *  makes the tail the longer one); 0 when the device cannot be asked (the plain order). */
inline int64_t backward_slots(int device_id) { return int64_t(multiprocessor_count(device_id, 0)) * 2; }

/** Stage 3: dq from the fp32 accumulator, or (deterministic mode) recomputed by the dq kernel.
 *  kDropoutKernels: compile the dq kernel's dropout versions (both callers do: the sm80 backward
 *  and the Hopper backward, whose deterministic dropout calls recompute dq here too); without
 *  them a dropout call is refused. */
template <typename Element, int kHeadDim, bool kDropoutKernels = false>
Status launch_dq_stage(const backward_params_t& p, const BackwardWorkspacePtrs& ws, cudaStream_t stream) {
  const int64_t stat_rows = p.total_q * p.heads_q;
  if (p.deterministic) {
    using DqTraits = typename DeterministicDqTraits<kHeadDim>::type;
    const int64_t num_query_blocks = ceil_div(p.seqlen_q, DqTraits::kBlockM);
    const int64_t dq_ctas = num_query_blocks * p.heads_q * p.batch;
    if (dq_ctas > INT_MAX) return Status::unsupported("q: too many query blocks for the backward grid");
    if (dq_ctas == 0) return Status::ok();
    auto* kernel = p.has_alibi() ? backward_dq_kernel<Element, DqTraits, /*kAlibi=*/true>
                                 : backward_dq_kernel<Element, DqTraits>;
    if (p.dropout.enabled()) {
      if constexpr (kDropoutKernels) {
        kernel = p.has_alibi() ? backward_dq_kernel<Element, DqTraits, /*kAlibi=*/true, /*kDropout=*/true>
                               : backward_dq_kernel<Element, DqTraits, /*kAlibi=*/false, /*kDropout=*/true>;
      } else {
        return Status::unsupported("backward dq stage: dropout kernels are not compiled for this backend");
      }
    }
    const int smem_bytes = static_cast<int>(sizeof(DqSharedStorage<Element, DqTraits>));
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return Status::cuda(std::string("backward dq smem: ") + cudaGetErrorString(err));
    return launch_stage("dq kernel", kernel, dq_ctas, DqTraits::kThreads, smem_bytes, stream, p.device_id, p, ws,
                        make_grid_order(p.heads_q * p.batch, num_query_blocks, p.has_mask(),
                                        backward_slots(p.device_id)));
  }
  if (stat_rows == 0) return Status::ok();
  if (ws.dq_tiled) {  // a thread per (leader row: half the padded rows, head, 8-column chunk)
    const int64_t items = ws.dq_rows_per_head / 2 * p.heads_q * (kHeadDim / kChunkElems);
    const int64_t blocks = std::min<int64_t>(ceil_div(items, kPrepostThreads), kPostprocessMaxBlocks);
    return launch_stage("postprocess", backward_postprocess_tiles_kernel<Element, kHeadDim>, blocks, kPrepostThreads, 0,
                        stream, p.device_id, p, ws);
  }
  // Row-major: a thread per (row, head, chunk).
  const int64_t items = stat_rows * ceil_div(p.head_dim, kChunkElems);
  const int64_t blocks = std::min<int64_t>(ceil_div(items, kPrepostThreads), kPostprocessMaxBlocks);
  return launch_stage("postprocess", backward_postprocess_kernel<Element, kHeadDim>, blocks, kPrepostThreads, 0, stream,
                      p.device_id, p, ws);
}

/** The three stages for one tile configuration (BackwardTraits<d> in production; kDropout: the
 *  dropout kernels, on DropoutBackwardTraits<d>). */
template <typename Element, typename Traits, bool kDropout = false>
Status launch_backward(const backward_params_t& p, void* workspace, size_t workspace_bytes) {
  constexpr int kHeadDim = Traits::kHeadDim;
  const BackwardWorkspaceLayout layout = BackwardWorkspaceLayout::make(p, kHeadDim, /*dq_tiled=*/true);
  if (workspace_bytes < layout.total_bytes || (layout.total_bytes > 0 && workspace == nullptr)) {
    return Status::invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " +
                           std::to_string(layout.total_bytes) + " needed by the sm80 backward");
  }
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const BackwardWorkspacePtrs ws = workspace_ptrs(layout, workspace);
  Status s = launch_preprocess<Element, kHeadDim>(p, ws, stream);
  if (!s.is_ok()) return s;

  // 2. dK, dV (and dQ_accum).
  const int64_t num_key_blocks = ceil_div(p.seqlen_k, Traits::kBlockN);
  const int64_t main_ctas = num_key_blocks * p.heads_kv * p.batch;
  if (main_ctas > INT_MAX) return Status::unsupported("k: too many key blocks for the sm80 backward grid");
  if (main_ctas > 0) {
    void (*kernel)(const BackwardParams, BackwardWorkspacePtrs, GridOrder) = nullptr;
    if constexpr (kDropout) {
      kernel = p.has_alibi() ? backward_dkdv_kernel<Element, Traits, /*kAlibi=*/true, /*kDropout=*/true>
                             : backward_dkdv_kernel<Element, Traits, /*kAlibi=*/false, /*kDropout=*/true>;
    } else {
      kernel = backward_dkdv_kernel<Element, Traits>;
      if constexpr (std::is_same_v<Traits, BackwardTraits<Traits::kHeadDim>>) {
        if (p.has_alibi()) kernel = backward_dkdv_kernel<Element, Traits, /*kAlibi=*/true>;
      }
    }
    const int smem_bytes = static_cast<int>(sizeof(MainSharedStorage<Element, Traits>));
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return Status::cuda(std::string("sm80 backward smem: ") + cudaGetErrorString(err));
    if (!(s = launch_stage("main kernel", kernel, main_ctas, Traits::kThreads, smem_bytes, stream, p.device_id, p, ws,
                           make_grid_order(p.heads_kv * p.batch, num_key_blocks, p.has_mask(),
                                           backward_slots(p.device_id)))).is_ok()) {
      return s;
    }
  }
  return launch_dq_stage<Element, kHeadDim, /*kDropoutKernels=*/true>(p, ws, stream);
}

}  // namespace bwd

template <typename Element, int kHeadDim>
Status backward_run(const backward_params_t& p, void* workspace, size_t workspace_bytes) {
  using PortableTraits = bwd::BackwardTraits<kHeadDim>;
  using LargeSmemTraits = typename bwd::LargeSmemBackwardTraits<kHeadDim>::type;
  // Dropout (with or without ALiBi): its own tiles, two more dK/dV kernels per unit.
  if (p.dropout.enabled()) {
    using DropoutTraits = typename bwd::DropoutBackwardTraits<kHeadDim>::type;
    return bwd::launch_backward<Element, DropoutTraits, /*kDropout=*/true>(p, workspace, workspace_bytes);
  }
  // ALiBi calls take the portable configuration only: one more kernel per unit instead of two.
  if constexpr (!std::is_same_v<PortableTraits, LargeSmemTraits>) {
    if (p.has_alibi()) return bwd::launch_backward<Element, PortableTraits>(p, workspace, workspace_bytes);
    // Host-side attribute query only (no synchronization): take the larger configuration where
    // the device lets one block have its shared memory.
    int smem_optin = 0;
    if (cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device_id) == cudaSuccess &&
        static_cast<size_t>(smem_optin) >= sizeof(bwd::MainSharedStorage<Element, LargeSmemTraits>)) {
      return bwd::launch_backward<Element, LargeSmemTraits>(p, workspace, workspace_bytes);
    }
    cudaGetLastError();  // a failed query falls back to the portable shape, leaving no error behind
  }
  return bwd::launch_backward<Element, PortableTraits>(p, workspace, workspace_bytes);
}

}  // namespace flashcore::cuda::sm80
