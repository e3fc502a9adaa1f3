// Hopper backward: dK and dV (and dQ through an fp32 accumulator) with TMA loads and wgmma, one
// producer warp and two consumer warpgroups. Header-only: cmake/cuda.cmake generates one sm_90a
// translation unit per (dtype, head-dim bucket) that explicitly instantiates backward_run.
//
// Stages, all on p.stream, no host synchronization (stages 1 and 3 are the sm80 backward's own
// kernels, compiled here for sm_90a; only the main kernel differs):
//   1. preprocess: D = rowsum(dO * O), lse * log2(e) into the workspace; zero the dQ accumulator.
//   2. main (this file): one CTA per (key block of kBlockN keys, KV head, batch); kBlockN = 128 at
//      d64 / d128, 64 at d256.
//   3. postprocess: dq = softmax_scale * dQ_accum in the element type; in deterministic mode the
//      main kernel adds nothing to dQ and the sm80 dq kernel recomputes it in a fixed order.
//
// Relies on: cuda/sm80/backward.cuh (stages 1 and 3, the workspace layout, the score transform,
// the query-block range of a key block), cuda/ptx/{wgmma,tma,mbarrier,warpgroup}.cuh,
// cuda/sm90/attention_views.hpp and tensor_map.hpp (host side of TMA).
//
// ---- Work of one CTA ------------------------------------------------------------------------------
// K and V of its keys are loaded once (TMA) and stay in shared memory. The CTA walks every query
// head of the KV head's GQA group and, per head, every query block of kBlockM rows that can see
// one of its keys (QueryBlockRange); dK and dV stay in registers the whole time (no atomics, so
// GQA needs no extra workspace). At d64 / d128 consumer warpgroup c owns keys 64c .. 64c + 63 of
// the block and computes, per query block, with the key dimension as the wgmma M:
//   S^T  = K_c Q^T             wgmma SS: A = K (K-major), B = Q (K-major)          64 x kBlockM
//   dP^T = V_c dO^T            wgmma SS: A = V, B = dO                              64 x kBlockM
//   P^T  = exp2(S^T * scale * log2e - lse_log2[query]), dS^T = P^T (dP^T - D[query])   registers
//   dV  += P^T dO              wgmma RS: A = P^T from registers, B = dO (MN-major)  64 x d
//   dS^T goes to shared memory (both consumers' halves), then
//   dQ piece c = dS K          wgmma SS: A = dS (MN-major), B = K (MN-major)        64 x 64
//   dK  += dS^T Q              wgmma RS: A = dS^T from registers, B = Q (MN-major)  64 x d
//   added to the fp32 dQ accumulator: staged in shared memory and added by TMA reductions
//   (stage_dq_piece, flushed at the next step's start), or by vector atomics (add_dq_piece) where
//   the map cannot clip the rows.
// At the tile's end each consumer's dK and dV (16-bit) go to memory through a dS (or P) buffer
// and TMA stores (store_dk_dv_staged; from registers where TMA cannot serve: varlen blocks past
// their sequence, tensors TMA cannot describe).
// Computing the transposed products keeps P^T and dS^T in the accumulator layout that converts
// to the RS A fragment with no data movement (as P does in the forward), so only dS is ever
// stored. The dQ tile (kBlockM x d = 2 x 64 x 64 by choice of kBlockM) splits into one 64 x 64
// piece per consumer: by rows at d = 64 (kBlockM = 128), by columns at d = 128 (kBlockM = 64).
// At d256 the two consumers share 64 keys by roles instead (consume_split_roles): consumer 0
// computes S^T and P^T, consumer 1 dP^T and dS^T, and each adds 128 head-dim columns of dV, dK
// and dQ; P^T goes through shared memory too (named barriers 2 and 3 there), and dK reads dS^T
// from the dS tile (SS), since consumer 0 never has it in registers.
//
// ---- Schedule of a step (keys split) ----------------------------------------------------------------
// S^T and dP^T are issued as two wgmma groups; P^T is computed as soon as S^T completes, dV is
// issued, and dS^T is computed while dV runs (d128; at d64 the registers do not allow it, see
// consume). The dQ wgmma goes before dK's: the dQ piece is staged in shared memory while dK still
// runs and flushed to the accumulator at the next step's start, under S^T and dP^T. At d128 dK
// is still running when the next step issues S^T and dP^T behind it (kCarryDk). fwd+bwd about
// 0.91x-1.04x cuDNN's on the H100 (docs/PERF.md, session 15); dev/sm90_trace.cu shows a step's
// phases.
//
// ---- Grid ----------------------------------------------------------------------------------------
// A tile is (key block, KV head, batch entry), key block fastest. Without a window the grid is
// persistent: min(tiles, SMs) CTAs, CTA c taking tiles c, c + gridDim.x, ...; every role walks the
// same tiles and keeps the same TileCursor, so query steps are numbered CTA-wide (stages, their
// parities and the dS / P buffers run on from tile to tile) and K / V loads are counted. Under a
// causal or local mask, and in varlen calls, the tiles' costs differ and the grid is one CTA per
// tile (see persistent_grid).
//
// ---- Pipeline -------------------------------------------------------------------------------------
//  kv_full/kv_empty:    K and V of a tile (TMA; phase = the count of earlier tiles that loaded
//                       them). Every consumer warp arrives on kv_empty once the wgmmas of the
//                       tile's last step completed; the producer issues the next tile's first Q
//                       and dO, then waits on kv_empty before loading its K and V.
//  q_full[s]/q_empty[s]: Q, dO and the rows' lse_log2 and D (TMA, one producer thread; the
//                       statistics through 1-row fp32 maps of the workspace) of query step i in
//                       stage s = i % kStages; every consumer warp arrives on q_empty once the
//                       wgmmas that read the stage have completed (kCarryDk: dK's, during step i + 1). (Ordinary stores of the
//                       statistics by the producer, published by the mbarrier arrive, are just as
//                       correct, but compute-sanitizer's racecheck does not follow that ordering.)
//  named barrier 1:     the 256 consumer threads: (d64 / d128) after both halves of dS^T are
//                       stored (and fenced to the async proxy) and before either reads them in
//                       the dQ wgmma; (every head dim) at both ends of the staged dK / dV epilogue. dS is double-buffered by step parity: a consumer can only
//                       write step i + 2's dS after passing step i + 1's barrier, which the other
//                       consumer reaches only after its dQ wgmma of step i completed.
//  named barriers 4, 5: consumer 0's / 1's warpgroup: (d64 / d128) after its dQ piece is staged in
//                       shared memory (and fenced, at the next step's start) and before one thread
//                       adds it with TMA reductions. That thread waits for the reduction's reads
//                       before that step's barrier 1. Also between the staged epilogue's rounds.
//
// ---- Shared memory (128-byte swizzle, every tile 1024-byte aligned) -------------------------------
// Q, dO, K, V are stored as TMA writes them: d/64 column chunks of [rows][128 bytes]. That one
// layout is both KMajorTile{rows, d} (A/B of the S^T and dP^T products, the head dim contracted)
// and MnMajorTile{d, rows} (B of dV, dK and dQ, the rows contracted). dS is MnMajorTile{kBlockM,
// kBlockN}: queries contiguous, so each thread's accumulator pairs (two adjacent queries of one
// key) are single 4-byte stores, conflict-free under the swizzle.
//
// ---- Masks and bounds -----------------------------------------------------------------------------
// Elements are masked (P = dS = 0, by select) only in tiles that are not fully visible: outside
// MaskInfo::keys_for_row, keys past seqlen_k, queries past seqlen_q (whose statistics are the
// next rows' values, or zeros past the workspace: selecting 0 keeps any inf they produce out),
// and their dQ is never added. Every tile holding such a row is a masked one. Varlen rows past a sequence's end are the next sequence's rows in TMA's view (as
// in the forward); the end of a tensor reads as zeros.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "api/params.hpp"
#include "api/status.hpp"
#include "common/mask.hpp"
#include "cuda/build_config.hpp"  // multiprocessor_count
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/programmatic_launch.hpp"
#include "cuda/scoped_device.hpp"
#include "cuda/sm80/backward.cuh"
#include "cuda/sm80/grid_order.hpp"
#include "cuda/sm90/attention_views.hpp"
#include "cuda/sm90/backward_dropout.cuh"
#include "cuda/sm90/backward_trace.cuh"
#include "cuda/sm90/tail_rows.cuh"
#include "cuda/sm90/tensor_map.hpp"

namespace flashcore::cuda::sm90 {

using backward_params_t = BackwardParams;

/** Tile sizes, roles and the shared-memory plan of one backward instantiation.
 *
 *  Two ways to share a key block between the two consumer warpgroups:
 *  - by keys (d64, d128): consumer c owns keys 64c .. 64c + 63 (kBlockN = 128) and every column of
 *    their dK and dV; each computes its own S^T and dP^T.
 *  - by roles (d256, kSplitRoles): dK and dV of 64 keys x 256 columns would take 256 registers per
 *    thread, so both consumers share one block of 64 keys and own half of the head dim each:
 *    consumer 0 computes S^T and P^T, consumer 1 dP^T and dS^T (from P^T, through shared
 *    memory), and each adds its 128 columns of dV, dK and dQ. */
template <typename Element_, int kHeadDim_, int kBlockM_, int kStages_ = 2>
struct BackwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step (the N of S^T, the K of dV / dK)
  static constexpr int kConsumers = 2;
  static constexpr bool kSplitRoles = kHeadDim == 256;
  static constexpr int kKeysPerConsumer = 64;  // one wgmma M
  static constexpr int kBlockN = kSplitRoles ? kKeysPerConsumer : kConsumers * kKeysPerConsumer;
  static constexpr int kColsPerConsumer = kSplitRoles ? kHeadDim / kConsumers : kHeadDim;  // of dK / dV
  static constexpr int kStages = kStages_;  // Q / dO buffers
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kConsumerWarps = kConsumers * 4;
  static constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;
  // Same register split as the forward (see ForwardTraits): 384 threads enter with 168 each.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumers * kConsumerRegisters) <=
                    kThreads * kEntryRegisters,
                "setmaxnreg split exceeds the registers the CTA is launched with");

  // Whether a step's dK wgmma stays in flight into the next step (keys split, 64-query steps:
  // d128): the next step's S^T and dP^T are issued behind it instead of after it drained, and
  // its stage goes back to the producer after that step's first wait. fwd+bwd d128 against
  // draining every step: 16k 0.90x -> 0.97x cuDNN, 2k 0.94x -> 0.97x; d64 (128-query steps,
  // whose schedule waits for S^T and dP^T together) lost 1-2%, so it drains (docs/PERF.md,
  // session 15). Deterministic calls (no dQ) drain every step: the step's only wait before its end
  // is dQ's, which also retires dV.
  static constexpr bool kCarryDk = !kSplitRoles && kBlockM == 64;

  // dQ (kBlockM x kHeadDim) in one 64-row piece per consumer: by rows at d = 64 (kBlockM = 128),
  // by columns at d = 128 (64 each) and d = 256 (128 each).
  static constexpr int kDqRows = 64;
  static constexpr bool kDqSplitRows = kBlockM > kDqRows;
  static constexpr int kDqCols = kDqSplitRows ? kHeadDim : kHeadDim / kConsumers;
  static_assert(kBlockM * kHeadDim == kConsumers * kDqRows * kDqCols, "one dQ piece per consumer");
  // How a dQ piece reaches the accumulator: staged in shared memory (fp32, 128-byte swizzle, boxes
  // of kDqBoxCols columns) and added by TMA reductions, one thread issuing them, or (the role
  // split, whose shared memory is full, and steps with query rows past the sequence) by vector
  // atomics from registers.
  static constexpr bool kDqViaTma = !kSplitRoles;
  static constexpr int kDqBoxCols = 32;  // 128 bytes of fp32: the swizzle span
  static constexpr uint32_t kDqBoxBytes = kDqRows * kDqBoxCols * sizeof(float);
  static constexpr uint32_t kDqPieceBytes = kDqViaTma ? kDqRows * kDqCols * sizeof(float) : 0;

  static constexpr int kChunkCols = 64;  // 128-byte swizzle span of 16-bit elements
  static constexpr int kChunks = kHeadDim / kChunkCols;
  static constexpr uint32_t kSwizzleBytes = 128;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;   // one Q or dO buffer
  static constexpr uint32_t kKvBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr uint32_t kQChunkBytes = kBlockM * kSwizzleBytes;
  static constexpr uint32_t kKvChunkBytes = kBlockN * kSwizzleBytes;
  static constexpr uint32_t kDsBytes = kBlockM * kBlockN * 2;
  static constexpr uint32_t kPBytes = kSplitRoles ? kDsBytes : 0;  // P^T for consumer 1's dV
  // A statistics box starts on a 16-byte boundary of the workspace (TMA faults on a row start that
  // is not: an illegal instruction), so it is kStatAlign values longer and the step's rows start
  // (index % kStatAlign) values into it.
  static constexpr int kStatAlign = 4;
  static constexpr int kStatBox = kBlockM + kStatAlign;
  static constexpr uint32_t kStatBoxBytes = kStatBox * sizeof(float);
  static constexpr uint32_t kStatBytes = (kStatBoxBytes + 127) / 128 * 128;  // buffers 128-aligned

  static constexpr uint32_t kAlign = 1024;
  static constexpr uint32_t kKOffset = 0;
  static constexpr uint32_t kVOffset = kKOffset + kKvBytes;
  static constexpr uint32_t kQOffset = kVOffset + kKvBytes;
  static constexpr uint32_t kDoOffset = kQOffset + kStages * kQBytes;
  static constexpr uint32_t kDsOffset = kDoOffset + kStages * kQBytes;  // dS, then P: by step parity
  static constexpr uint32_t kPOffset = kDsOffset + 2 * kDsBytes;
  static constexpr uint32_t kDqOffset = kPOffset + 2 * kPBytes;  // one dQ piece per consumer
  static constexpr uint32_t kLseOffset = kDqOffset + kConsumers * kDqPieceBytes;  // per stage: kBlockM rows
  static constexpr uint32_t kDsumOffset = kLseOffset + kStages * kStatBytes;
  static constexpr uint32_t kBarrierOffset = kDsumOffset + kStages * kStatBytes;
  static constexpr int kBarriers = 3 + 3 * kStages;
  static constexpr uint32_t kSmemBytes = kBarrierOffset + 8 * kBarriers + kAlign;  // + base align

  // Dropout kernels only: the step's keep bits (backward_dropout.cuh), one 64-key mask per
  // consumer (keys split) or one that consumer 1 writes for both (role split). Outside the layout
  // above, so the kernels without dropout keep theirs: in the kAlign bytes before the aligned base
  // where the base's padding left that many (d256's plan has no room past its barriers for a mask
  // plus the whole alignment slack), else after the barriers; kDropoutSmemBytes covers either case
  // (a padding below kDropoutBytes leaves at least kDropoutBytes past the barriers).
  static constexpr int kDropoutMasks = kSplitRoles ? 1 : kConsumers;
  static constexpr uint32_t kDropoutMaskBytes = DropoutMaskLayout<kBlockM>::kBytes;
  static constexpr uint32_t kDropoutBytes = kDropoutMasks * kDropoutMaskBytes;
  static constexpr uint32_t kDropoutOffset = (kBarrierOffset + 8 * kBarriers + 127) / 128 * 128;
  static constexpr uint32_t kDropoutSmemBytes =
      kDropoutOffset + (2 * kDropoutBytes > kAlign ? 2 * kDropoutBytes : kAlign);

  // The epilogue: each consumer stages its dK and dV (16-bit, 64 keys x kColsPerConsumer) in
  // buffers the steps are done with once both consumers finished the tile's last step, as
  // [64 keys][128 bytes] boxes per 64-column chunk, and stores them by TMA; dK's chunks, then
  // dV's, as many per round as its buffer holds. Keys split: dS buffer `consumer` (d64: both
  // chunks in one round; d128: 2 of 4). Role split: consumer 0 the two P buffers, consumer 1
  // the two dS buffers (2 of 4 chunks per round).
  static constexpr uint32_t kGradStagingBytes = kSplitRoles ? 2 * kDsBytes : kDsBytes;
  static constexpr uint32_t kGradChunkBytes = kKeysPerConsumer * kSwizzleBytes;
  static constexpr int kGradChunks = 2 * kColsPerConsumer / kChunkCols;  // dK's, then dV's
  static constexpr int kGradChunksPerRound = kGradStagingBytes / kGradChunkBytes < kGradChunks
                                                 ? kGradStagingBytes / kGradChunkBytes
                                                 : kGradChunks;
  static_assert(kGradChunksPerRound > 0 && kGradChunks % kGradChunksPerRound == 0,
                "staging rounds cover dK's and dV's chunks evenly");

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head-dim buckets");
  static_assert(kColsPerConsumer <= 128, "dK and dV of a consumer: 64 x kColsPerConsumer floats each");
  static_assert(kBlockM == 64 || kBlockM == 128, "wgmma N of S^T");
  static_assert(kQBytes % kAlign == 0 && kKvBytes % kAlign == 0 && kDsBytes % kAlign == 0 &&
                    kDqBoxBytes % kAlign == 0,
                "tiles stay 1024-aligned");
  static_assert(kDqCols % kDqBoxCols == 0, "whole dQ boxes per piece");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one sm_90 block");
  static_assert(kDropoutSmemBytes <= 227 * 1024, "shared memory of one sm_90 block (dropout kernels)");
  static_assert(kDropoutMaskBytes % 128 == 0, "each dropout mask 128-aligned (8-byte loads)");
};

/** Per-bucket configuration. d64 / d128: 192 KiB of shared memory (32 of them the dQ staging);
 *  registers per consumer thread: dK and dV d/2 floats each, S^T and dP^T kBlockM/2 each, the dQ
 *  piece 32. d256: 227 KiB (two stages of 64-row Q and dO tiles, 64 keys of K and V); dK, dV and
 *  the dQ piece 64 floats each. */
template <typename Element, int kHeadDim>
struct DefaultBackwardTraits;
template <typename Element>
struct DefaultBackwardTraits<Element, 64> {
  using type = BackwardTraits<Element, 64, 128>;
};
template <typename Element>
struct DefaultBackwardTraits<Element, 128> {
  using type = BackwardTraits<Element, 128, 64>;
};
template <typename Element>
struct DefaultBackwardTraits<Element, 256> {
  using type = BackwardTraits<Element, 256, 64>;
};

struct BackwardKernelArgs {
  CUtensorMap map_q, map_k, map_v, map_do;  // first: 64-byte aligned members
  CUtensorMap map_lse, map_dsum;            // the workspace statistics, one row of heads * total_q
  CUtensorMap map_dq;                       // the fp32 dQ accumulator (heads * total_q rows)
  CUtensorMap map_dk, map_dv;               // the outputs, boxes of 64 keys (valid if store_dkdv_with_tma)
  BackwardParams params;
  sm80::bwd::BackwardWorkspacePtrs ws;
  sm80::GridOrder order;  // (KV head, batch) pairs x key blocks; a masked grid's tail (grid_order.hpp)
  int num_tiles;  // key blocks x KV heads x batch; the persistent grid strides over them
  bool store_dkdv_with_tma;  // dk and dv TMA-addressable (map_dk, map_dv encoded)
};

template <class T>
struct BackwardSmem {
  uint8_t* base;  // 1024-aligned
  uint32_t addr;  // its .shared window address
  uint64_t* bars;

  __device__ uint8_t* k_ptr() const { return base + T::kKOffset; }
  __device__ uint8_t* v_ptr() const { return base + T::kVOffset; }
  __device__ uint8_t* q_ptr(int s) const { return base + T::kQOffset + s * T::kQBytes; }
  __device__ uint8_t* do_ptr(int s) const { return base + T::kDoOffset + s * T::kQBytes; }
  __device__ uint8_t* ds_ptr(int b) const { return base + T::kDsOffset + b * T::kDsBytes; }
  __device__ uint8_t* p_ptr(int b) const { return base + T::kPOffset + b * T::kPBytes; }
  __device__ uint8_t* dq_ptr(int consumer) const { return base + T::kDqOffset + consumer * T::kDqPieceBytes; }
  __device__ float* lse(int s) const { return reinterpret_cast<float*>(base + T::kLseOffset + s * T::kStatBytes); }
  __device__ float* dsum(int s) const { return reinterpret_cast<float*>(base + T::kDsumOffset + s * T::kStatBytes); }
  __device__ uint32_t k_addr() const { return addr + T::kKOffset; }
  __device__ uint32_t v_addr() const { return addr + T::kVOffset; }
  __device__ uint32_t q_addr(int s) const { return addr + T::kQOffset + s * T::kQBytes; }
  __device__ uint32_t do_addr(int s) const { return addr + T::kDoOffset + s * T::kQBytes; }
  __device__ uint32_t ds_addr(int b) const { return addr + T::kDsOffset + b * T::kDsBytes; }
  __device__ uint32_t p_addr(int b) const { return addr + T::kPOffset + b * T::kPBytes; }
  __device__ uint64_t* kv_full() const { return bars; }
  __device__ uint64_t* q_full(int s) const { return bars + 1 + s; }
  __device__ uint64_t* q_empty(int s) const { return bars + 1 + T::kStages + s; }
  __device__ uint64_t* kv_empty() const { return bars + 1 + 2 * T::kStages; }
  // Fills with rows past their sequence complete here; zero_tails then arrives on kv_full / q_full.
  __device__ uint64_t* kv_loaded() const { return bars + 2 + 2 * T::kStages; }
  __device__ uint64_t* q_loaded(int s) const { return bars + 3 + 2 * T::kStages + s; }
};

/** The CTA's key block and the query steps it walks, resolved identically by both roles. Row
 *  indices are 32-bit (backward_api.cu admits only calls whose rows, query steps and key blocks
 *  fit), which keeps the consumers' bookkeeping registers few next to dK, dV, S^T and dP^T. */
struct KeyBlockWork {
  int batch, kv_head, n0;
  int seqlen_q, seqlen_k, q_start, k_start;  // SeqInfo; starts are packed rows (varlen) or 0
  int m_block_begin;                         // first query block that sees a key of the block
  int blocks_per_head;                       // query blocks per head
  int steps;                                 // blocks_per_head * GQA group
  int group;
  int64_t q_row0;  // packed row of the sequence's first query (workspace statistics)

  __device__ int head_of(int step) const { return kv_head * group + step / blocks_per_head; }
  /** The batch coordinate of the 4-D tensor maps: varlen maps have a single batch of packed rows. */
  __device__ int32_t map_batch(const BackwardParams& p) const { return p.cu_seqlens_q != nullptr ? 0 : batch; }
  __device__ int m0_of(int step, int block_m) const { return (m_block_begin + step % blocks_per_head) * block_m; }
  /** Index of the step's first row in the workspace statistics (heads_q x total_q values; below
   *  2^31 - 128 by backward_api.cu). */
  __device__ int32_t stat_index(const BackwardParams& p, int step, int block_m) const {
    return static_cast<int32_t>(int64_t(head_of(step)) * p.total_q + q_row0 + m0_of(step, block_m));
  }
  __device__ MaskInfo mask(const BackwardParams& p) const {
    return {seqlen_q, seqlen_k, p.window_left, p.window_right};
  }
};

/** Whether the grid is persistent (see launch_main). Without a window every key block costs the
 *  same and a persistent CTA per SM striding over the tiles loads each next tile under the last
 *  one; under a causal or local mask the costs differ per key block, and a static stride left
 *  some CTAs the heavy halves of the heads (causal fwd+bwd d256 S = 8192: 302 -> 179 TFLOP/s;
 *  heaviest-first bands taken in snake order still gave 267), so those calls launch one CTA per
 *  tile and let the hardware balance them. So do varlen calls: a key block's cost is its
 *  sequence's query count (docs/PERF.md, session 30, dev/varlen_peers.py). */
__host__ __device__ __forceinline__ bool persistent_grid(const BackwardParams& p) {
  return p.window_left < 0 && p.window_right < 0 && p.cu_seqlens_q == nullptr;
}

template <class T>
__device__ KeyBlockWork resolve_key_block(const BackwardParams& p, const sm80::GridOrder& order, int tile) {
  KeyBlockWork w;
  // Key block fastest: tiles running together share one head's Q and dO in L2; key block 0 (seen
  // by the most query blocks under a causal mask) first, a masked grid's tail in order of falling
  // cost across its heads (sm80/grid_order.hpp: the grid is then one CTA per tile).
  const sm80::GridPosition position = sm80::grid_position</*kHeaviestLast=*/false>(order, tile);
  const int n_block = position.block;
  const int head_batch = position.pair;
  w.kv_head = head_batch % static_cast<int>(p.heads_kv);
  w.batch = head_batch / static_cast<int>(p.heads_kv);
  w.n0 = n_block * T::kBlockN;
  const SeqInfo seq = seq_info(p, w.batch);
  w.seqlen_q = static_cast<int>(seq.seqlen_q);
  w.seqlen_k = static_cast<int>(seq.seqlen_k);
  w.q_start = static_cast<int>(seq.q_start);
  w.k_start = static_cast<int>(seq.k_start);
  w.q_row0 = sm80::bwd::first_packed_q_row(p, w.batch, seq);
  w.group = static_cast<int>(p.heads_q / p.heads_kv);
  w.m_block_begin = 0;
  w.blocks_per_head = 0;
  if (w.n0 < w.seqlen_k && w.seqlen_q > 0) {
    const int n_end = w.n0 + T::kBlockN < w.seqlen_k ? w.n0 + T::kBlockN : w.seqlen_k;
    const sm80::bwd::QueryBlockRange r = sm80::bwd::query_blocks_for_keys(w.mask(p), w.n0, n_end, T::kBlockM);
    w.m_block_begin = static_cast<int>(r.begin);
    w.blocks_per_head = static_cast<int>(r.end - r.begin);
  }
  w.steps = w.blocks_per_head * w.group;
  return w;
}

/** Where a tile's pipeline state starts, the same in every role: the CTA-wide index of its first
 *  query step (stages, their parities and the dS / P buffers run on across tiles) and how many
 *  earlier tiles loaded K and V (the phase of kv_full / kv_empty). */
struct TileCursor {
  int first_step = 0;
  int kv_loads = 0;
  __device__ void advance(const KeyBlockWork& w) {
    first_step += w.steps;
    kv_loads += w.steps > 0 ? 1 : 0;
  }
  /** Where step `step` of the tile lives: its Q / dO stage, that stage's mbarrier parity, and
   *  its dS (and P) buffer. */
  struct Slot {
    int stage;
    uint32_t parity;
    int buf;
  };
  template <class T>
  __device__ Slot slot(int step) const {
    const int g = first_step + step;
    return {g % T::kStages, static_cast<uint32_t>(g / T::kStages) & 1, g & 1};
  }
  __device__ uint32_t kv_parity() const { return static_cast<uint32_t>(kv_loads & 1); }
};

/** Rows of the tile's key block inside its sequence when the rest must read as zeros (packed
 *  varlen calls, whose TMA boxes read the rows after a sequence: tail_rows.cuh), else kBlockN.
 *  Only K needs them zero: its rows past the sequence reach dQ through dS K, where dS = 0 by
 *  select. V's reach only dP^T of those keys, which the select drops. */
template <class T>
__device__ __forceinline__ int key_rows_inside(const BackwardParams& p, const KeyBlockWork& w) {
  if (p.cu_seqlens_q == nullptr) return T::kBlockN;
  const int inside = w.seqlen_k - w.n0;
  return inside < T::kBlockN ? inside : T::kBlockN;
}

/** The same for a query step's Q and dO: rows past the sequence reach dK through dS^T Q and dV
 *  through P^T dO (P = dS = 0 there by select). */
template <class T>
__device__ __forceinline__ int query_rows_inside(const BackwardParams& p, const KeyBlockWork& w, int step) {
  if (p.cu_seqlens_q == nullptr) return T::kBlockM;
  const int inside = w.seqlen_q - w.m0_of(step, T::kBlockM);
  return inside < T::kBlockM ? inside : T::kBlockM;
}

/** The producer thread, one tile: Q, dO and the row statistics of every query step, and K and V
 *  once. The first step's Q and dO go out before K and V, whose buffers the consumers may still
 *  be reading for the previous tile (kv_empty), so they load under that tile's last step. */
template <class T>
__device__ void produce(const BackwardKernelArgs& args, const BackwardSmem<T>& sm, const KeyBlockWork& w,
                        const TileCursor& at, [[maybe_unused]] int& trace_events) {
  const BackwardParams& p = args.params;
  const int32_t bc = w.map_batch(p);
  const int32_t hk = static_cast<int32_t>(w.kv_head);
  if (w.steps == 0) return;  // no query sees these keys: dK = dV = 0, nothing to load
  BWD_TRACE(trace_events, 0, kTileBegin, 0);
  const auto load_kv = [&]() {
    // A fresh barrier counts as having completed the phase before phase 0: the first wait passes.
    ptx::mbarrier_wait_parity(sm.kv_empty(), at.kv_parity() ^ 1);
    BWD_TRACE(trace_events, 0, kKvFree, 0);
    const int32_t k_row = w.k_start + w.n0;
    uint64_t* full = key_rows_inside<T>(p, w) < T::kBlockN ? sm.kv_loaded() : sm.kv_full();  // zero_tails
    ptx::mbarrier_arrive_expect_tx(full, 2 * T::kKvBytes);
#pragma unroll
    for (int c = 0; c < T::kChunks; ++c) {
      ptx::tma_load_4d(sm.k_ptr() + c * T::kKvChunkBytes, &args.map_k, full, c * T::kChunkCols, k_row, hk, bc);
      ptx::tma_load_4d(sm.v_ptr() + c * T::kKvChunkBytes, &args.map_v, full, c * T::kChunkCols, k_row, hk, bc);
    }
  };
  for (int step = 0; step < w.steps; ++step) {
    if (step == 1) load_kv();
    const TileCursor::Slot slot = at.slot<T>(step);
    const int stage = slot.stage;
    // A fresh barrier counts as having completed the phase before phase 0: the first waits pass.
    ptx::mbarrier_wait_parity(sm.q_empty(stage), slot.parity ^ 1);
    BWD_TRACE(trace_events, 0, kStageFree, step);
    const int32_t q_row = w.q_start + w.m0_of(step, T::kBlockM);
    const int32_t hq = w.head_of(step);
    // Statistics of rows h * total_q + q_row0 + m0 + [0, kBlockM) (backward_api.cu keeps the index
    // below 2^31 - 128).
    const int32_t stat_row = w.stat_index(p, step, T::kBlockM);
    const int32_t stat_box0 = stat_row - stat_row % T::kStatAlign;
    uint64_t* full = query_rows_inside<T>(p, w, step) < T::kBlockM ? sm.q_loaded(stage) : sm.q_full(stage);
    ptx::mbarrier_arrive_expect_tx(full, 2 * T::kQBytes + 2 * T::kStatBoxBytes);
    ptx::tma_load_2d(sm.lse(stage), &args.map_lse, full, stat_box0, 0);
    ptx::tma_load_2d(sm.dsum(stage), &args.map_dsum, full, stat_box0, 0);
#pragma unroll
    for (int c = 0; c < T::kChunks; ++c) {
      ptx::tma_load_4d(sm.q_ptr(stage) + c * T::kQChunkBytes, &args.map_q, full, c * T::kChunkCols, q_row, hq, bc);
      ptx::tma_load_4d(sm.do_ptr(stage) + c * T::kQChunkBytes, &args.map_do, full, c * T::kChunkCols, q_row, hq, bc);
    }
  }
  if (w.steps == 1) load_kv();
}

/** A warp of the producer warpgroup, in packed varlen calls, one tile: mirrors `produce`'s loads
 *  in its order, and for each that runs past its sequence waits for the copy (kv_loaded /
 *  q_loaded), zeroes those rows and hands the buffers to the consumers (tail_rows.cuh). */
template <class T>
__device__ void zero_tails(const BackwardKernelArgs& args, const BackwardSmem<T>& sm, const KeyBlockWork& w,
                           const TileCursor& at, TailPhases& q_phases, uint32_t& kv_phase) {
  const BackwardParams& p = args.params;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const auto key_block = [&]() {
    const int rows = key_rows_inside<T>(p, w);
    if (rows == T::kBlockN) return;
    ptx::mbarrier_wait_parity(sm.kv_loaded(), kv_phase);
    kv_phase ^= 1u;
    zero_rows_from<T::kBlockN, T::kChunks>(sm.k_addr(), rows, lane);
    arrive_after_zeroing(sm.kv_full(), lane);
  };
  for (int step = 0; step < w.steps; ++step) {
    if (step == 1) key_block();
    const int rows = query_rows_inside<T>(p, w, step);
    if (rows == T::kBlockM) continue;
    const int stage = at.slot<T>(step).stage;
    ptx::mbarrier_wait_parity(sm.q_loaded(stage), q_phases.take(stage));
    zero_rows_from<T::kBlockM, T::kChunks>(sm.q_addr(stage), rows, lane);
    zero_rows_from<T::kBlockM, T::kChunks>(sm.do_addr(stage), rows, lane);
    arrive_after_zeroing(sm.q_full(stage), lane);
  }
  if (w.steps == 1) key_block();
}

/** S^T (or dP^T) = A B^T over the head dim: A = the 64 rows of K or V from block row a_row0,
 *  B = the step's Q or dO. */
template <class T>
__device__ __forceinline__ void issue_scores_t(float (&acc)[T::kBlockM / 2], uint32_t a_tile, uint32_t b_tile,
                                               int a_row0) {
  constexpr ptx::KMajorTile kKeyTile{ptx::SmemSwizzle::k128B, T::kBlockN, T::kHeadDim};
  constexpr ptx::KMajorTile kQueryTile{ptx::SmemSwizzle::k128B, T::kBlockM, T::kHeadDim};
#pragma unroll
  for (int k = 0; k < T::kHeadDim / 16; ++k) {
    ptx::wgmma_ss<T::kBlockM, typename T::Element>(acc, kKeyTile.desc(a_tile, a_row0, 16 * k),
                                                   kQueryTile.desc(b_tile, 0, 16 * k), k > 0);
  }
}

/** acc (64 keys x kColsPerConsumer, from head-dim column col0) += X^T R with X^T as A fragments in
 *  registers (64 keys x kBlockM queries): dV += P^T dO, and dK += dS^T Q where dS^T is still in
 *  registers. R is the step's dO or Q (MN-major B: the queries contracted). */
template <class T>
__device__ __forceinline__ void issue_from_registers(float (&acc)[T::kColsPerConsumer / 2],
                                                     const uint32_t (&a)[T::kBlockM / 16][4], uint32_t rows_tile,
                                                     int col0) {
  constexpr ptx::MnMajorTile kQueryTileMn{ptx::SmemSwizzle::k128B, T::kHeadDim, T::kBlockM};
#pragma unroll
  for (int k = 0; k < T::kBlockM / 16; ++k) {
    ptx::wgmma_rs<T::kColsPerConsumer, typename T::Element, /*kTransB=*/1>(
        acc, a[k], kQueryTileMn.desc(rows_tile, col0, 16 * k), true);
  }
}

/** acc (64 keys x kColsPerConsumer) += X^T R[:, col0 ..] with X^T read back from a tile of the
 *  step (dS or P) stored queries-contiguous per key: that is the K-major A operand (keys x
 *  queries) as it stands, so it needs no registers once stored. R is the step's Q (dK += dS^T Q)
 *  or, for consumer 1 of the role split, dO (dV += P^T dO). */
template <class T>
__device__ __forceinline__ void issue_from_key_tile(float (&acc)[T::kColsPerConsumer / 2], uint32_t x_tile,
                                                    uint32_t rows_tile, int key0, int col0) {
  constexpr ptx::KMajorTile kKeyQueryTile{ptx::SmemSwizzle::k128B, T::kBlockN, T::kBlockM};
  constexpr ptx::MnMajorTile kQueryTileMn{ptx::SmemSwizzle::k128B, T::kHeadDim, T::kBlockM};
#pragma unroll
  for (int k = 0; k < T::kBlockM / 16; ++k) {
    ptx::wgmma_ss<T::kColsPerConsumer, typename T::Element, /*kTransA=*/0, /*kTransB=*/1>(
        acc, kKeyQueryTile.desc(x_tile, key0, 16 * k), kQueryTileMn.desc(rows_tile, col0, 16 * k), true);
  }
}

/** This consumer's kDqRows x kDqCols piece of dQ = dS K (contraction over the block's keys). */
template <class T>
__device__ __forceinline__ void issue_dq(float (&acc)[T::kDqRows * T::kDqCols / 128], uint32_t ds_tile,
                                         uint32_t k_tile, int consumer) {
  constexpr ptx::MnMajorTile kDsTile{ptx::SmemSwizzle::k128B, T::kBlockM, T::kBlockN};
  constexpr ptx::MnMajorTile kKeyTileMn{ptx::SmemSwizzle::k128B, T::kHeadDim, T::kBlockN};
  const uint32_t a_mn0 = T::kDqSplitRows ? consumer * T::kDqRows : 0;
  const uint32_t b_mn0 = T::kDqSplitRows ? 0 : consumer * T::kDqCols;
#pragma unroll
  for (int k = 0; k < T::kBlockN / 16; ++k) {
    ptx::wgmma_ss<T::kDqCols, typename T::Element, /*kTransA=*/1, /*kTransB=*/1>(
        acc, kDsTile.desc(ds_tile, a_mn0, 16 * k), kKeyTileMn.desc(k_tile, b_mn0, 16 * k), k > 0);
  }
}

/** The mask of a tile as bounds on (key - query): mask.hpp's keys_for_row(i) is
 *  [diag(i) - left, diag(i) + right] with diag(i) = i + seqlen_k - seqlen_q, so a visible key j of
 *  query i has lo <= j - i <= hi; plus j < seqlen_k and i < seqlen_q. A few 32-bit registers
 *  instead of a key range per query column (which the unrolled loop would keep live at once). */
struct TileMask {
  int lo, hi;  // bounds on key - query (INT_MIN / INT_MAX: unbounded)
  int seqlen_q, seqlen_k;

  __device__ static int clamp_to_int(int64_t x) {
    return x < INT_MIN ? INT_MIN : (x > INT_MAX ? INT_MAX : static_cast<int>(x));
  }
  __device__ static TileMask make(const MaskInfo& m) {
    const int64_t diag = m.seqlen_k - m.seqlen_q;
    TileMask t;
    t.lo = m.window_left >= 0 ? clamp_to_int(diag - m.window_left) : INT_MIN;
    t.hi = m.window_right >= 0 ? clamp_to_int(diag + m.window_right) : INT_MAX;
    t.seqlen_q = static_cast<int>(m.seqlen_q);
    t.seqlen_k = static_cast<int>(m.seqlen_k);
    return t;
  }
  __device__ bool visible(int key, int query) const {
    const int offset = key - query;  // |offset| < 2^31: rows fit int32 (backward_api.cu)
    return offset >= lo && offset <= hi && key < seqlen_k && query < seqlen_q;
  }
};

/** ALiBi of one step (AlibiStep<true>, in the kernels instantiated with kAlibi): the bias per key
 *  of distance in log2 units for the step's query head, and this thread's distance base: query
 *  m0 + 2 quad + seqlen_k - seqlen_q less key key_row0, as a float (exact below 2^24), so that each
 *  register's distance is the base plus a compile-time offset (an int-to-float conversion per score
 *  would run on the exponentials' 16-per-clock unit). AlibiStep<false> is empty: the kernels
 *  without ALiBi carry nothing for it. */
template <bool kAlibi>
struct AlibiStep {
  __device__ __forceinline__ static AlibiStep make(const BackwardParams&, const KeyBlockWork&, int, int, int, int) {
    return {};
  }
};
template <>
struct AlibiStep<true> {
  float log2;
  float base;

  __device__ __forceinline__ static AlibiStep make(const BackwardParams& p, const KeyBlockWork& w, int step, int m0,
                                                   int key_row0, int quad) {
    return {-p.alibi_slope(w.batch, w.head_of(step)) * sm80::bwd::kLog2e,
            static_cast<float>(m0 + 2 * quad + w.seqlen_k - w.seqlen_q - key_row0)};
  }
  /** log2 bias of register i (key row half (i % 4) / 2, query column 8 * (i / 4) + i % 2). */
  __device__ __forceinline__ float bias(int i) const {
    return log2 * fabsf(base + static_cast<float>(8 * (i / 4) + (i % 2) - 8 * ((i % 4) / 2)));
  }
};

/** Dropout of one step (DropoutStep<true>, in the kernels instantiated with kDropout): this
 *  thread's keep bits (gather_keep_bits: bit i for accumulator register i) and keep_scale.
 *  DropoutStep<false> is empty: the kernels without dropout carry nothing for it. */
template <bool kDropout, int kRows>
struct DropoutStep {};
template <int kRows>
struct DropoutStep<true, kRows> {
  uint32_t bits[kRows / 64];
  float keep_scale;

  __device__ __forceinline__ bool kept(int i) const { return register_kept(bits, i); }
  /** Z dP: dP times keep_scale where register i is kept, 0 where dropped. */
  __device__ __forceinline__ float scale_grad(float dp, int i) const { return kept(i) ? dp * keep_scale : 0.f; }
};

/** The CTA's keep-bit masks (kernels with kDropout; see BackwardTraits::kDropoutSmemBytes):
 *  before the aligned base where its padding holds them, else after the barriers. */
template <class T>
__device__ __forceinline__ uint32_t* dropout_masks(const BackwardSmem<T>& sm) {
  extern __shared__ uint8_t smem_raw[];  // the kernel's dynamic shared memory (one start)
  uint8_t* masks = sm.base - smem_raw >= static_cast<ptrdiff_t>(T::kDropoutBytes) ? sm.base - T::kDropoutBytes
                                                                                  : sm.base + T::kDropoutOffset;
  return reinterpret_cast<uint32_t*>(masks);
}

/** This thread's keep bits of the step from its warpgroup's published mask. */
template <class T, bool kDropout>
__device__ __forceinline__ DropoutStep<kDropout, T::kBlockM> read_dropout_step(const BackwardParams& p,
                                                                              const uint32_t* mask,
                                                                              int key_local, int quad) {
  DropoutStep<kDropout, T::kBlockM> d;
  if constexpr (kDropout) {
    gather_keep_bits<T::kBlockM>(mask, key_local, quad, d.bits);
    d.keep_scale = p.dropout.keep_scale;
  }
  return d;
}

/** Every keep bit of a step's 64 keys (64-key block `block` of the sequence) x kRows queries from
 *  m0 into the warpgroup's mask, each Philox call once (DropoutMaskLayout's items of thread t).
 *  The caller publishes the stores with a barrier of the threads that read them. */
template <int kRows>
__device__ __forceinline__ void write_dropout_mask(uint32_t* mask, const DropoutParams& d, uint32_t bh, int m0,
                                                   uint32_t block, int t) {
  using L = DropoutMaskLayout<kRows>;
#pragma unroll
  for (int k = 0; k < L::kItemsPerThread; ++k) {
    const int q = L::item_row(t, k), half = L::item_half(t, k);
    mask[L::word(half, q)] = dropout_half_row_bits(d, bh, static_cast<uint32_t>(m0 + q), block, half);
  }
}

/** The problem index of dropout's counter (common/dropout.hpp): sequence (or batch entry) times
 *  heads_q plus the step's query head; below 2^32 (validate.cpp). */
__device__ __forceinline__ uint32_t dropout_problem(const BackwardParams& p, const KeyBlockWork& w, int step) {
  return static_cast<uint32_t>(w.batch) * static_cast<uint32_t>(p.heads_q) + static_cast<uint32_t>(w.head_of(step));
}

/** P^T = exp2(S^T * scale * log2e - lse_log2[query]) from S^T (element-wise, accumulator
 *  layout: register i of this thread is key `key_row0 + 8 * ((i % 4) / 2)` and query
 *  `m0 + 8 * (i / 4) + 2 * quad + i % 2`), rounded to 16 bits as RS A fragments in `pa`. `s` is
 *  left holding what dS^T = s (dP^T - D) needs: P^T, or P^T (1 - t^2) under softcap (the factor
 *  needs S^T, which is gone afterwards). Masked entries select 0 (not multiply), so an inf/NaN
 *  computed for one cannot leak. kDropout: `pa` (dV's weight) is P^T o kept, keep_scale left to
 *  dV's store; `s` keeps every probability (dS = P (Z dP - D)). */
template <class T, bool kSoftcap, bool kMasked, bool kAlibi, bool kDropout = false>
__device__ __forceinline__ void probabilities(float (&s)[T::kBlockM / 2], uint32_t (&pa)[T::kBlockM / 16][4],
                                              const float* lse, const sm80::bwd::ScoreTransform& tf,
                                              const TileMask& mask, int m0, int key_row0, int quad,
                                              AlibiStep<kAlibi> alibi,
                                              const DropoutStep<kDropout, T::kBlockM>& drop = {}) {
#pragma unroll
  for (int j = 0; j < T::kBlockM / 8; ++j) {
    const int col = 8 * j + 2 * quad;
    const float2 l = make_float2(lse[col], lse[col + 1]);  // scalar loads: only 4-byte aligned
    float prob[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 4 * j + r;
      const int e = r % 2;
      // ALiBi's bias enters the exponent only: a constant of the score, so dS keeps its form.
      float lse_log2 = e == 0 ? l.x : l.y;
      if constexpr (kAlibi) lse_log2 -= alibi.bias(i);
      float grad_factor = 1.f;
      if constexpr (kSoftcap) {
        const float t = tanhf(s[i] * tf.tanh_arg_scale);
        prob[r] = sm80::bwd::fast_exp2(t * tf.softcap_log2 - lse_log2);
        grad_factor = 1.f - t * t;
      } else {
        prob[r] = sm80::bwd::fast_exp2(s[i] * tf.scale_log2 - lse_log2);
      }
      if constexpr (kMasked) prob[r] = mask.visible(key_row0 + 8 * (r / 2), m0 + col + e) ? prob[r] : 0.f;
      s[i] = kSoftcap ? prob[r] * grad_factor : prob[r];
      if constexpr (kDropout) prob[r] = drop.kept(i) ? prob[r] : 0.f;
    }
    // Registers 4j .. 4j + 3 are A-fragment registers 2 (j % 2) and 2 (j % 2) + 1 of k-slice j / 2.
    using Element = typename T::Element;
    pa[j / 2][2 * (j % 2)] = sm80::bwd::pack_pair<Element>(prob[0], prob[1]);
    pa[j / 2][2 * (j % 2) + 1] = sm80::bwd::pack_pair<Element>(prob[2], prob[3]);
  }
}

/** dS^T = X^T (dP^T - D) in place, X^T as `probabilities` left it in registers. Same layout;
 *  masked entries select 0. kDropout: dS^T = X^T (Z dP^T - D). */
template <class T, bool kMasked, bool kDropout = false>
__device__ __forceinline__ void grads(float (&dp)[T::kBlockM / 2], const float (&x)[T::kBlockM / 2],
                                      const float* dsum, const TileMask& mask, int m0, int key_row0, int quad,
                                      const DropoutStep<kDropout, T::kBlockM>& drop = {}) {
#pragma unroll
  for (int j = 0; j < T::kBlockM / 8; ++j) {
    const int col = 8 * j + 2 * quad;
    const float2 d = make_float2(dsum[col], dsum[col + 1]);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 4 * j + r;
      const int e = r % 2;
      float dpz = dp[i];
      if constexpr (kDropout) dpz = drop.scale_grad(dpz, i);
      const float dscore = x[i] * (dpz - (e == 0 ? d.x : d.y));
      dp[i] = kMasked ? (mask.visible(key_row0 + 8 * (r / 2), m0 + col + e) ? dscore : 0.f) : dscore;
    }
  }
}

/** P^T and dS^T from S^T and dP^T in place, in one pass (the d64 schedule; same layout and
 *  masking as `probabilities`). kDropout: `s` becomes P^T o kept (dV's weight), dS^T = P^T (Z dP^T
 *  - D). */
template <class T, bool kSoftcap, bool kMasked, bool kAlibi, bool kDropout = false>
__device__ __forceinline__ void probabilities_and_grads(float (&s)[T::kBlockM / 2], float (&dp)[T::kBlockM / 2],
                                                        const float* lse, const float* dsum,
                                                        const sm80::bwd::ScoreTransform& tf, const TileMask& mask,
                                                        int m0, int key_row0, int quad,
                                                        AlibiStep<kAlibi> alibi,
                                                        const DropoutStep<kDropout, T::kBlockM>& drop = {}) {
#pragma unroll
  for (int j = 0; j < T::kBlockM / 8; ++j) {
    const int col = 8 * j + 2 * quad;
    const float2 l = make_float2(lse[col], lse[col + 1]);  // scalar loads: lse is only 4-byte aligned
    const float2 d = make_float2(dsum[col], dsum[col + 1]);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 4 * j + r;
      const int e = r % 2;
      float lse_log2 = e == 0 ? l.x : l.y;
      if constexpr (kAlibi) lse_log2 -= alibi.bias(i);  // the bias enters the exponent only
      const float dsum_row = e == 0 ? d.x : d.y;
      [[maybe_unused]] bool kept = true;
      float dpz = dp[i];
      if constexpr (kDropout) {
        kept = drop.kept(i);
        dpz = kept ? dpz * drop.keep_scale : 0.f;
      }
      float prob, dscore;
      if constexpr (kSoftcap) {
        const float t = tanhf(s[i] * tf.tanh_arg_scale);
        prob = sm80::bwd::fast_exp2(t * tf.softcap_log2 - lse_log2);
        dscore = prob * (dpz - dsum_row) * (1.f - t * t);
      } else {
        prob = sm80::bwd::fast_exp2(s[i] * tf.scale_log2 - lse_log2);
        dscore = prob * (dpz - dsum_row);
      }
      if constexpr (kMasked) {
        // Select (not multiply) so an inf/NaN computed for a masked entry cannot leak.
        const bool visible = mask.visible(key_row0 + 8 * (r / 2), m0 + col + e);
        prob = visible ? prob : 0.f;
        dscore = visible ? dscore : 0.f;
      }
      if constexpr (kDropout) prob = kept ? prob : 0.f;  // dS above used all of P
      s[i] = prob;
      dp[i] = dscore;
    }
  }
}

/** Calls f(kSoftcap, kMasked) with the two flags as std::bool_constant, so that each of the four
 *  element-wise variants is compiled with its flags fixed. */
template <class F>
__device__ __forceinline__ void with_score_variant(bool softcap, bool masked, F&& f) {
  if (softcap) {
    if (masked) f(std::true_type{}, std::true_type{});
    else f(std::true_type{}, std::false_type{});
  } else if (masked) {
    f(std::false_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

/** Accumulator tile (64 x kBlockM) rounded to 16 bits as RS A fragments. */
template <class T>
__device__ __forceinline__ void pack_a_fragments(const float (&x)[T::kBlockM / 2], uint32_t (&a)[T::kBlockM / 16][4]) {
#pragma unroll
  for (int k = 0; k < T::kBlockM / 16; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[k][r] = sm80::bwd::pack_pair<typename T::Element>(x[8 * k + 2 * r], x[8 * k + 2 * r + 1]);
  }
}

/** Byte offset in a keys x queries tile (dS or P; queries contiguous per key) of A-fragment
 *  register r of k-slice k: a[k][r] holds (key_row + 8 * (r % 2), queries q .. q + 1) with
 *  q = 16k + 2 * quad + 8 * (r / 2). So each register is one 4-byte word, conflict-free under the
 *  swizzle, and the thread that reads a word back (role split) is the one whose accumulator holds
 *  the same elements. */
template <class T>
__device__ __forceinline__ uint32_t key_tile_offset(int k, int r, int key_row, int quad) {
  constexpr ptx::MnMajorTile kKeyTile{ptx::SmemSwizzle::k128B, T::kBlockM, T::kBlockN};
  const uint32_t query = 16 * k + 2 * quad + 8 * (r / 2);
  const uint32_t key = static_cast<uint32_t>(key_row + 8 * (r % 2));
  return kKeyTile.byte_offset(query, key);
}

/** This consumer's rows of a keys x queries tile from A fragments (dS^T, or P^T in the split). */
template <class T>
__device__ __forceinline__ void store_key_tile(const uint32_t (&a)[T::kBlockM / 16][4], uint8_t* tile, int key_row,
                                               int quad) {
#pragma unroll
  for (int k = 0; k < T::kBlockM / 16; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      *reinterpret_cast<uint32_t*>(tile + key_tile_offset<T>(k, r, key_row, quad)) = a[k][r];
    }
  }
}

/** The role split's consumer 1: dS^T = X^T (dP^T - D) in place, X^T read back from the tile
 *  consumer 0 stored (P^T, times (1 - t^2) under softcap; 16-bit, as the dtype-precision backward
 *  rounds P). Masked entries have X = 0 there, and dS^T = 0 by a select on it, with no mask here:
 *  dP^T of keys past a varlen sequence (V rows there are not zeroed) and D of queries past it (dO
 *  rows of the tail) may be NaN. kDropout: dS^T = X^T (Z dP^T - D), Z from the step's mask. */
template <class T, bool kDropout = false>
__device__ __forceinline__ void grads_from_tile(float (&dp)[T::kBlockM / 2], const uint8_t* x_tile, const float* dsum,
                                                int key_row, int quad,
                                                const DropoutStep<kDropout, T::kBlockM>& drop = {}) {
#pragma unroll
  for (int k = 0; k < T::kBlockM / 16; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t bits = *reinterpret_cast<const uint32_t*>(x_tile + key_tile_offset<T>(k, r, key_row, quad));
      const float2 x = sm80::bwd::unpack_pair<typename T::Element>(bits);
      const int i = 8 * k + 2 * r;  // accumulator index of the pair's first element
      const int col = 8 * (i / 4) + 2 * quad;
      float dp0 = dp[i], dp1 = dp[i + 1];
      if constexpr (kDropout) {
        dp0 = drop.scale_grad(dp0, i);
        dp1 = drop.scale_grad(dp1, i + 1);
      }
      dp[i] = x.x == 0.f ? 0.f : x.x * (dp0 - dsum[col]);
      dp[i + 1] = x.y == 0.f ? 0.f : x.y * (dp1 - dsum[col + 1]);
    }
  }
}

/** One warp's arrival on an "empty" barrier once its wgmmas reading the buffer completed. */
__device__ __forceinline__ void release_stage(uint64_t* bar) {
  if ((threadIdx.x & 31) == 0) ptx::mbarrier_arrive(bar);
}

/** This consumer's dQ piece of one step into the fp32 accumulator (vector atomics). Piece element
 *  i: row 16 * warp + group + 8 * ((i % 4) / 2), column 8 * (i / 4) + 2 * quad + i % 2, offset by
 *  the consumer's rows (kDqSplitRows) or columns. Lanes quad and quad ^ 1 swap one column pair per
 *  two 8-column groups, so that each holds 4 consecutive columns: one 16-byte red per 4 values
 *  instead of two 8-byte ones (same L2 sectors, half the instructions). */
template <class T>
__device__ __forceinline__ void add_dq_piece(const BackwardKernelArgs& args, const KeyBlockWork& w, int step,
                                             const float (&dq)[T::kDqRows * T::kDqCols / 128], int consumer,
                                             int warp, int group, int quad) {
  static_assert(T::kDqCols % 16 == 0, "pairs of 8-column groups");
  const BackwardParams& p = args.params;
  const int m0 = w.m0_of(step, T::kBlockM);
  const int row_off = T::kDqSplitRows ? consumer * T::kDqRows : 0;
  const int col_off = T::kDqSplitRows ? 0 : consumer * T::kDqCols;
  const int64_t h = w.head_of(step);
  const bool odd = quad & 1;
  float* dq_rows = args.ws.dq_accum + (h * p.total_q + w.q_row0 + m0) * T::kHeadDim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_off + warp * 16 + group + 8 * half;
    const bool present = m0 + row < w.seqlen_q;  // else no such query (or the next sequence's)
    // Even lanes keep group j's pair and take the partner's; odd lanes keep group j + 1's.
    float* dst_row = dq_rows + static_cast<int64_t>(row) * T::kHeadDim + col_off + 2 * (quad & ~1);
#pragma unroll
    for (int j = 0; j < T::kDqCols / 8; j += 2) {
      const float2 a = make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
      const float2 b = make_float2(dq[4 * (j + 1) + 2 * half], dq[4 * (j + 1) + 2 * half + 1]);
      const float2 give = odd ? a : b;
      const float2 got = make_float2(__shfl_xor_sync(0xffffffffu, give.x, 1), __shfl_xor_sync(0xffffffffu, give.y, 1));
      const float4 v = odd ? make_float4(got.x, got.y, b.x, b.y) : make_float4(a.x, a.y, got.x, got.y);
      if (present) atomicAdd(reinterpret_cast<float4*>(dst_row + 8 * (j + (odd ? 1 : 0))), v);
    }
  }
}

/** Named barrier of one consumer warpgroup's 128 threads: the dQ piece's staging and the staged
 *  dK / dV epilogue's rounds (ids 0-3 are taken: __syncthreads, the consumers' barrier, the role
 *  split's two). */
__device__ __forceinline__ uint32_t warpgroup_barrier(int consumer) { return 4 + static_cast<uint32_t>(consumer); }

/** Whether the step's dQ piece goes to the accumulator by TMA (staged, then flushed): only when
 *  every query row of its block exists, since the map cannot clip at a sequence's end. */
template <class T>
__device__ __forceinline__ bool dq_by_tma(const KeyBlockWork& w, int step) {
  return T::kDqViaTma && w.m0_of(step, T::kBlockM) + T::kBlockM <= w.seqlen_q;
}

/** This consumer's dQ piece of one step into the fp32 accumulator through shared memory, in two
 *  parts. stage_dq_piece: every thread stores its elements (layout as in add_dq_piece) into the
 *  piece's staging buffer, laid out as the TMA reduction reads it (boxes of kDqBoxCols columns x
 *  kDqRows rows, 128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8), so a warp's
 *  8-byte stores hit every bank once per 256 bytes). flush_dq_piece, at the start of the next
 *  step under its S^T and dP^T wgmmas (the fence and barrier cost ~1000 cycles per step at d128
 *  where only dK ran beside them; dev/sm90_trace.cu): the stores are fenced to the async proxy,
 *  the warpgroup meets, and one thread adds the boxes to global memory with TMA reductions.
 *  Only for steps where dq_by_tma holds. The buffer is free again once the issuing thread's bulk
 *  group has been read: that thread waits for it before the dS barrier of the step that flushed
 *  it (see consume), which every thread passes before staging the next piece. */
template <class T>
__device__ __forceinline__ void stage_dq_piece(const BackwardSmem<T>& sm,
                                               const float (&dq)[T::kDqRows * T::kDqCols / 128], int consumer,
                                               int warp, int group, int quad) {
  uint8_t* piece = sm.dq_ptr(consumer);
#pragma unroll
  for (int j = 0; j < T::kDqCols / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * 16 + group + 8 * half;
      const int col = 8 * j + 2 * quad;
      const int box = col / T::kDqBoxCols, chunk = (col % T::kDqBoxCols) / 4;
      const uint32_t offset = box * T::kDqBoxBytes + row * 128 + ((chunk ^ (row % 8)) << 4) + (col % 4) * 4;
      *reinterpret_cast<float2*>(piece + offset) = make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
    }
  }
}

template <class T>
__device__ __forceinline__ void flush_dq_piece(const BackwardKernelArgs& args, const BackwardSmem<T>& sm,
                                               const KeyBlockWork& w, int step, int consumer, int thread) {
  ptx::fence_proxy_async_shared_cta();  // the staging stores -> the TMA reduction's reads
  ptx::named_barrier_sync(warpgroup_barrier(consumer), T::kWarpgroupThreads);
  if (thread == 0) {
    const BackwardParams& p = args.params;
    const int row_off = T::kDqSplitRows ? consumer * T::kDqRows : 0;
    const int col_off = T::kDqSplitRows ? 0 : consumer * T::kDqCols;
    // Below 2^31 - 128 (backward_api.cu): the statistics' row index of the same rows.
    const int32_t row = w.stat_index(p, step, T::kBlockM) + row_off;
    uint8_t* piece = sm.dq_ptr(consumer);
#pragma unroll
    for (int box = 0; box < T::kDqCols / T::kDqBoxCols; ++box) {
      ptx::tma_reduce_add_2d(&args.map_dq, piece + box * T::kDqBoxBytes, col_off + box * T::kDqBoxCols, row);
    }
    ptx::tma_store_commit_group();
  }
}

/** Epilogue: this consumer's dK = softmax_scale * sum dS^T Q and dV = sum P^T dO (64 keys from
 *  key_row0, head-dim columns from col0), column pairs as 4-byte stores. kDropout: dV summed
 *  (P^T o kept) dO, so it is multiplied by keep_scale here, once. */
template <class T, bool kDropout = false>
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, const KeyBlockWork& w,
                                            const float (&dk)[T::kColsPerConsumer / 2],
                                            const float (&dv)[T::kColsPerConsumer / 2], int key_row0, int col0,
                                            int quad) {
  using Element = typename T::Element;
  using sm80::bwd::pack_pair;
  auto* dk_out = static_cast<Element*>(p.dk.data);
  auto* dv_out = static_cast<Element*>(p.dv.data);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_row0 + 8 * half;
    if (key >= w.seqlen_k) continue;
    const int64_t packed_key = int64_t(w.k_start) + key;
    Element* dk_row = dk_out + offset_of(p.dk, w.batch, packed_key, w.kv_head);
    Element* dv_row = dv_out + offset_of(p.dv, w.batch, packed_key, w.kv_head);
#pragma unroll
    for (int j = 0; j < T::kColsPerConsumer / 8; ++j) {
      const int col = col0 + 8 * j + 2 * quad;
      if (col >= p.head_dim) continue;
      const int i = 4 * j + 2 * half;
      *reinterpret_cast<uint32_t*>(dk_row + col) = pack_pair<Element>(dk[i] * p.softmax_scale, dk[i + 1] * p.softmax_scale);
      if constexpr (kDropout) {
        const float ks = p.dropout.keep_scale;
        *reinterpret_cast<uint32_t*>(dv_row + col) = pack_pair<Element>(dv[i] * ks, dv[i + 1] * ks);
      } else {
        *reinterpret_cast<uint32_t*>(dv_row + col) = pack_pair<Element>(dv[i], dv[i + 1]);
      }
    }
  }
}

/** Named barrier of both consumers' 256 threads: the dS exchange of every step (consume) and the
 *  two ends of the staged epilogue. */
constexpr uint32_t kConsumersBarrier = 1;

/** Epilogue through shared memory and TMA: this consumer's dK (times softmax_scale) and dV (64
 *  keys, kColsPerConsumer columns) as 16-bit pairs in the swizzled layout of a [64 keys][128 bytes]
 *  box per 64-column chunk (ptx::swizzled_box_offset), then one thread stores the boxes with TMA,
 *  which clips keys past the tensor's end (dense) and columns past head_dim. The staging buffer (see kGradStagingBytes) is one the steps
 *  use, so:
 *  - on entry both consumers meet (kConsumersBarrier): the other consumer's wgmmas of the tile's
 *    last step read the dS (and P) buffers until then;
 *  - between rounds the issuing thread has waited for the previous stores to read the buffer,
 *    and the warpgroup meets;
 *  - on exit both consumers meet again, each issuing thread having seen its stores read: the
 *    next tile's first step may write any of the buffers.
 *  The role split's consumers reach the consumer barrier from different code: its non-.aligned
 *  form. Replaces 4-byte stores from registers (8 rows x 16 bytes per warp instruction), which
 *  took ~18% of a tile at S = 512, d64 and d128 (session 14's trace; docs/PERF.md).
 *  kDropout: dV is multiplied by keep_scale (see store_dk_dv). */
template <class T, bool kDropout = false>
__device__ __forceinline__ void store_dk_dv_staged(const BackwardKernelArgs& args, const BackwardSmem<T>& sm,
                                                   const KeyBlockWork& w, const float (&dk)[T::kColsPerConsumer / 2],
                                                   const float (&dv)[T::kColsPerConsumer / 2], int consumer, int t) {
  using sm80::bwd::pack_pair;
  using Element = typename T::Element;
  constexpr int kChunksPerGrad = T::kGradChunks / 2;
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const float scale = args.params.softmax_scale;
  uint8_t* buf = !T::kSplitRoles ? sm.ds_ptr(consumer) : (consumer == 0 ? sm.p_ptr(0) : sm.ds_ptr(0));
  ptx::barrier_sync_any(kConsumersBarrier, T::kConsumerThreads);
#pragma unroll
  for (int c0 = 0; c0 < T::kGradChunks; c0 += T::kGradChunksPerRound) {
    // The previous round's stores have read the buffer (its issuing thread waited for them).
    if (c0 > 0) ptx::named_barrier_sync(warpgroup_barrier(consumer), T::kWarpgroupThreads);
#pragma unroll
    for (int c = c0; c < c0 + T::kGradChunksPerRound; ++c) {
      const bool is_dk = c < kChunksPerGrad;
      const float(&acc)[T::kColsPerConsumer / 2] = is_dk ? dk : dv;
      const float factor = is_dk ? scale : (kDropout ? args.params.dropout.keep_scale : 1.f);
      const int chunk = is_dk ? c : c - kChunksPerGrad;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + group + 8 * r;
#pragma unroll
        for (int u = 0; u < 8; ++u) {  // 16-byte units: 8 columns, accumulator column group j
          const int j = 8 * chunk + u;
          const uint32_t offset = ptx::swizzled_box_offset(T::kKeysPerConsumer, c - c0, row, u, 4 * quad);
          *reinterpret_cast<uint32_t*>(buf + offset) =
              pack_pair<Element>(acc[4 * j + 2 * r] * factor, acc[4 * j + 2 * r + 1] * factor);
        }
      }
    }
    ptx::fence_proxy_async_shared_cta();  // the generic-proxy stores -> the TMA store's reads
    ptx::named_barrier_sync(warpgroup_barrier(consumer), T::kWarpgroupThreads);
    if (t == 0) {
      const int32_t row = w.k_start + w.n0 + (T::kSplitRoles ? 0 : consumer * T::kKeysPerConsumer);
      const int32_t col0 = T::kSplitRoles ? consumer * T::kColsPerConsumer : 0;
      const int32_t batch = w.map_batch(args.params);
#pragma unroll
      for (int c = c0; c < c0 + T::kGradChunksPerRound; ++c) {
        const bool is_dk = c < kChunksPerGrad;
        const int chunk = is_dk ? c : c - kChunksPerGrad;
        ptx::tma_store_4d(is_dk ? &args.map_dk : &args.map_dv, buf + (c - c0) * T::kGradChunkBytes,
                          col0 + chunk * T::kChunkCols, row, w.kv_head, batch);
      }
      ptx::tma_store_commit_group();
      ptx::tma_store_wait_group_read<0>();
    }
  }
  ptx::barrier_sync_any(kConsumersBarrier, T::kConsumerThreads);
}

/** Whether the tile's dK and dV go out through store_dk_dv_staged: the same answer in both
 *  consumers (its barriers span both). A varlen block reaching past its sequence's keys would
 *  overwrite the next sequence's rows (TMA sees packed rows), so it stores from registers. */
template <class T>
__device__ __forceinline__ bool dk_dv_by_tma(const BackwardKernelArgs& args, const KeyBlockWork& w) {
  return args.store_dkdv_with_tma &&
         (args.params.cu_seqlens_q == nullptr || w.n0 + T::kBlockN <= w.seqlen_k);
}

/** This consumer's dK and dV of the tile to memory: staged and stored by TMA where dk_dv_by_tma
 *  allows, else from registers (rows from key_row0, columns from col0). */
template <class T, bool kDropout = false>
__device__ __forceinline__ void store_tile_grads(const BackwardKernelArgs& args, const BackwardSmem<T>& sm,
                                                 const KeyBlockWork& w, const float (&dk)[T::kColsPerConsumer / 2],
                                                 const float (&dv)[T::kColsPerConsumer / 2], int consumer, int t,
                                                 int key_row0, int col0, int quad) {
  if (dk_dv_by_tma<T>(args, w)) {
    store_dk_dv_staged<T, kDropout>(args, sm, w, dk, dv, consumer, t);
  } else {
    store_dk_dv<T, kDropout>(args.params, w, dk, dv, key_row0, col0, quad);
  }
}

/** The end of a step, the same for both ways of sharing the block (the dS tile of the step is
 *  complete): this consumer's dQ piece and dK[keys from key0, columns from col0] += dS^T Q, in
 *  that order, so the dQ piece goes to the accumulator while dK still runs; then, once every
 *  wgmma of the step (the dV one included) has completed, the stage goes back to the producer.
 *  kCarryDk (BackwardTraits): except at the tile's last step, dK is left in flight and the next
 *  step retires it and releases the stage (consume).
 *  A piece that goes by TMA (dq_by_tma) is only staged here; the caller flushes it.
 *  kDsInRegisters: dS^T is taken from this thread's A fragments `ds` (RS, the keys-split
 *  consumers, whose fragments hold exactly their keys), else read from the dS tile (SS). */
template <class T, bool kWithDq, bool kDsInRegisters, bool kCarryDk = false>
__device__ __forceinline__ void finish_step(const BackwardKernelArgs& args, const BackwardSmem<T>& sm,
                                            const KeyBlockWork& w, const TileCursor& at, int step, int key0,
                                            int col0, int consumer, const uint32_t (&ds)[T::kBlockM / 16][4],
                                            float (&dv)[T::kColsPerConsumer / 2],
                                            float (&dk)[T::kColsPerConsumer / 2],
                                            [[maybe_unused]] int& trace_events) {
  [[maybe_unused]] const int role = 1 + consumer;  // trace role
  const TileCursor::Slot slot = at.slot<T>(step);
  const int stage = slot.stage;
  float dq[T::kDqRows * T::kDqCols / 128];
  // dS^T's A fragments (keys split) were packed after the step's last wgmma.fence, which the
  // dK wgmma reading them needs (ptxas used to insert it itself, reporting C7519).
  if constexpr (kDsInRegisters) ptx::wgmma_fence();
  if constexpr (kWithDq) {
    issue_dq<T>(dq, sm.ds_addr(slot.buf), sm.k_addr(), consumer);
    ptx::wgmma_commit_group();
  }
  if constexpr (kDsInRegisters) {
    issue_from_registers<T>(dk, ds, sm.q_addr(stage), col0);
  } else {
    issue_from_key_tile<T>(dk, sm.ds_addr(slot.buf), sm.q_addr(stage), key0, col0);
  }
  ptx::wgmma_commit_group();
  if constexpr (kWithDq) {
    ptx::wgmma_wait_group<1>();  // dQ (dK may still run)
    ptx::wgmma_fence_operands(dq);
    BWD_TRACE(trace_events, role, kDqReady, step);
    const int t = static_cast<int>(ptx::thread_in_warpgroup());
    if (dq_by_tma<T>(w, step)) {
      stage_dq_piece<T>(sm, dq, consumer, t / 32, (t % 32) / 4, t % 4);
    } else {
      add_dq_piece<T>(args, w, step, dq, consumer, t / 32, (t % 32) / 4, t % 4);
    }
    BWD_TRACE(trace_events, role, kDqSent, step);
  }
  static_assert(!kCarryDk || kWithDq, "the carry relies on the dQ wait having retired dV");
  if (kCarryDk && step < w.steps - 1) {
    // dK stays in flight into the next step, which releases this stage after its first wait.
    ptx::wgmma_fence_operands(dv);
    BWD_TRACE(trace_events, role, kStepEnd, step);
    return;
  }
  ptx::wgmma_wait_group<0>();
  ptx::wgmma_fence_operands(dv);
  ptx::wgmma_fence_operands(dk);
  release_stage(sm.q_empty(stage));  // Q, dO and the statistics of this stage are read
  if (step == w.steps - 1) release_stage(sm.kv_empty());  // and, at the tile's last step, K and V
  BWD_TRACE(trace_events, role, kStepEnd, step);
}

/** One consumer warpgroup when the block is shared by keys: its 64 keys through every query
 *  step, then dK and dV to memory. kWithDq is a template parameter, not a run-time flag: a wgmma
 *  under a run-time branch made ptxas serialize every wgmma of the loop and spill ~680 bytes
 *  (d128). kDropout: each step's keep bits of this consumer's 64 keys are drawn into its mask under
 *  the step's S^T and dP^T wgmmas (backward_dropout.cuh), after the dQ flush (drawn before it,
 *  beside the flush's values, the d128 kernels spilled ~100 bytes more), published by a warpgroup
 *  barrier and gathered into one register per 64 queries at once; the mask is rewritten only
 *  after the step's dS barrier, which every thread passes after its gather. */
template <class T, bool kWithDq, bool kCarryDk, bool kAlibi, bool kDropout = false>
__device__ void consume(const BackwardKernelArgs& args, const BackwardSmem<T>& sm, const KeyBlockWork& w,
                        const TileCursor& at, int consumer, [[maybe_unused]] int& trace_events) {
  [[maybe_unused]] const int role = 1 + consumer;  // trace role
  const BackwardParams& p = args.params;
  const int t = static_cast<int>(ptx::thread_in_warpgroup());
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int key_row = consumer * T::kKeysPerConsumer + warp * 16 + group;  // in the block; and + 8
  const int key_row0 = w.n0 + key_row;
  const int wg_key0 = w.n0 + consumer * T::kKeysPerConsumer;
  const sm80::bwd::ScoreTransform tf = sm80::bwd::ScoreTransform::make(p);
  const bool softcap = tf.softcap > 0.f;
  [[maybe_unused]] uint32_t* drop_mask = nullptr;  // this consumer's keep-bit mask (kDropout)
  if constexpr (kDropout) drop_mask = dropout_masks<T>(sm) + consumer * (T::kDropoutMaskBytes / 4);

  // Two schedules of a step. kDvUnderDs (64 queries per step): S^T and dP^T are two wgmma
  // groups; P^T is computed while dP^T still runs and dV += P^T dO is issued before dS^T is
  // computed, so the tensor cores work under both element-wise parts. At 128 queries (d64) S^T,
  // dP^T and P^T's fragments do not fit the registers together (ptxas serialized every wgmma):
  // there both products complete, P^T and dS^T are computed in one pass and dV follows dS^T.
  constexpr bool kDvUnderDs = T::kBlockM == 64;
  float dv[T::kColsPerConsumer / 2], dk[T::kColsPerConsumer / 2];
#pragma unroll
  for (int i = 0; i < T::kColsPerConsumer / 2; ++i) dv[i] = dk[i] = 0.f;

  uint32_t dsa[T::kBlockM / 16][4];  // dS^T: stored for dQ (both halves), kept for dK (RS)
  // The previous step's dK (and the A fragments it reads) still in flight: completed by this
  // step's first wait, after which its stage goes back to the producer.
  const auto retire_carried_dk = [&](int step) {
    if constexpr (kCarryDk) {
      if (step > 0) {
        ptx::wgmma_fence_operands(dk);
#pragma unroll
        for (int k = 0; k < T::kBlockM / 16; ++k) ptx::wgmma_fence_operands(dsa[k]);
        release_stage(sm.q_empty(at.slot<T>(step - 1).stage));
      }
    }
  };

  if (w.steps > 0) ptx::mbarrier_wait_parity(sm.kv_full(), at.kv_parity());
  BWD_TRACE(trace_events, role, kTileBegin, 0);
  for (int step = 0; step < w.steps; ++step) {
    const auto [stage, parity, ds_buf] = at.slot<T>(step);  // run on across tiles
    const int m0 = w.m0_of(step, T::kBlockM);
    ptx::mbarrier_wait_parity(sm.q_full(stage), parity);
    BWD_TRACE(trace_events, role, kStepBegin, step);

    const int stat_shift = w.stat_index(p, step, T::kBlockM) % T::kStatAlign;  // see kStatAlign
    const float* lse = sm.lse(stage) + stat_shift;
    const float* dsum = sm.dsum(stage) + stat_shift;
    // ALiBi: every tile through the masked bodies (the bias is per element anyway). Dropout
    // likewise: with the unmasked bodies as well (four with softcap) ptxas spilled 150-330 bytes
    // at d64 and 28-140 more at d128; in a fully visible tile every element is visible, so the
    // masked body computes the same values, for a few integer compares per element.
    const bool masked = kAlibi || kDropout ||
                        !w.mask(p).tile_fully_visible(m0, m0 + T::kBlockM, wg_key0, wg_key0 + T::kKeysPerConsumer);
    const TileMask mask = TileMask::make(w.mask(p));
    const auto alibi = AlibiStep<kAlibi>::make(p, w, step, m0, key_row0, quad);
    float s[T::kBlockM / 2], dp[T::kBlockM / 2];
    uint32_t pa[T::kBlockM / 16][4];  // P^T as RS A fragments
    ptx::wgmma_fence();
    issue_scores_t<T>(s, sm.k_addr(), sm.q_addr(stage), consumer * T::kKeysPerConsumer);
    ptx::wgmma_commit_group();
    issue_scores_t<T>(dp, sm.v_addr(), sm.do_addr(stage), consumer * T::kKeysPerConsumer);
    ptx::wgmma_commit_group();
    // The previous step's dQ piece, staged in shared memory, goes out under S^T and dP^T.
    if (kWithDq && step > 0 && dq_by_tma<T>(w, step - 1)) flush_dq_piece<T>(args, sm, w, step - 1, consumer, t);
    if constexpr (kDropout) {
      // This step's keep bits, also under S^T and dP^T.
      write_dropout_mask<T::kBlockM>(drop_mask, p.dropout, dropout_problem(p, w, step), m0,
                                     static_cast<uint32_t>(wg_key0 / T::kKeysPerConsumer), t);
      ptx::named_barrier_sync(warpgroup_barrier(consumer), T::kWarpgroupThreads);
    }
    // This thread's bits, one register per 64 queries from here to dS^T.
    const auto drop = read_dropout_step<T, kDropout>(p, drop_mask, key_row - consumer * T::kKeysPerConsumer, quad);
    if constexpr (kDvUnderDs) {
      // P^T while dP^T still runs, then dV += P^T dO under dS^T's element-wise part.
      ptx::wgmma_wait_group<1>();
      ptx::wgmma_fence_operands(s);
      retire_carried_dk(step);
      BWD_TRACE(trace_events, role, kSReady, step);
      with_score_variant(softcap, masked, [&](auto kSoftcap, auto kMasked) {
        probabilities<T, decltype(kSoftcap)::value, decltype(kMasked)::value, kAlibi, kDropout>(
            s, pa, lse, tf, mask, m0, key_row0, quad, alibi, drop);
      });
      ptx::wgmma_fence();
      issue_from_registers<T>(dv, pa, sm.do_addr(stage), 0);
      ptx::wgmma_commit_group();
      BWD_TRACE(trace_events, role, kDvIssued, step);
      ptx::wgmma_wait_group<1>();  // dP^T (dV may still run)
      ptx::wgmma_fence_operands(dp);
      if (masked) {
        grads<T, true, kDropout>(dp, s, dsum, mask, m0, key_row0, quad, drop);
      } else {
        grads<T, false, kDropout>(dp, s, dsum, mask, m0, key_row0, quad, drop);
      }
    } else {
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(s);
      ptx::wgmma_fence_operands(dp);
      retire_carried_dk(step);
      BWD_TRACE(trace_events, role, kSReady, step);
      with_score_variant(softcap, masked, [&](auto kSoftcap, auto kMasked) {
        probabilities_and_grads<T, decltype(kSoftcap)::value, decltype(kMasked)::value, kAlibi, kDropout>(
            s, dp, lse, dsum, tf, mask, m0, key_row0, quad, alibi, drop);
      });
    }
    pack_a_fragments<T>(dp, dsa);
    store_key_tile<T>(dsa, sm.ds_ptr(ds_buf), key_row, quad);
    ptx::fence_proxy_async_shared_cta();  // dS stores -> visible to the wgmmas (async proxy)
    if constexpr (!kDvUnderDs) {
      pack_a_fragments<T>(s, pa);
      ptx::wgmma_fence();
      issue_from_registers<T>(dv, pa, sm.do_addr(stage), 0);
      ptx::wgmma_commit_group();
      BWD_TRACE(trace_events, role, kDvIssued, step);
    }
    BWD_TRACE(trace_events, role, kDsStored, step);

    // The dQ piece flushed at this step's start has been read by its TMA reduction: every thread
    // may stage the next one after this barrier.
    if (kWithDq && T::kDqViaTma && t == 0) ptx::tma_store_wait_group_read<0>();
    // Both consumers' halves of dS are stored (dQ reads them all; dK reads this one's).
    ptx::named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    BWD_TRACE(trace_events, role, kDsShared, step);
    finish_step<T, kWithDq, true, kCarryDk>(args, sm, w, at, step, consumer * T::kKeysPerConsumer, 0, consumer, dsa,
                                            dv, dk, trace_events);
  }
  if (kWithDq && w.steps > 0 && dq_by_tma<T>(w, w.steps - 1)) {
    flush_dq_piece<T>(args, sm, w, w.steps - 1, consumer, t);
  }
  store_tile_grads<T, kDropout>(args, sm, w, dk, dv, consumer, t, key_row0, 0, quad);
  BWD_TRACE(trace_events, role, kTileEnd, 0);
}

/** The two consumers when the block is shared by roles (d256; see BackwardTraits). Per step:
 *    consumer 0: S^T = K Q^T; P^T; stores P^T (for consumer 1's dV) and P^T, or P^T (1 - t^2)
 *                under softcap, into the dS tile; arrives on barrier 2; dV[:, 0:128] += P^T dO
 *                from registers (RS) while consumer 1 computes dS; syncs on barrier 3.
 *    consumer 1: dP^T = V dO^T; syncs on barrier 2; dS^T from the dS tile in place; syncs on
 *                barrier 3 (its own dS stores are then visible to its wgmmas too);
 *                dV[:, 128:256] += P^T dO from the P tile.
 *    both:       dK[:, own half] += dS^T Q, dQ[:, own half] = dS K (+ atomics).
 *  Barrier 2 (consumer 0 arrives, consumer 1 syncs) and barrier 3 (both sync) each complete once
 *  per step (the non-.aligned barrier forms: each role meets them from its own code); neither
 *  side can arrive twice ahead, because each waits on the other's barrier of the step before. The P and dS tiles are double-buffered by step parity: a consumer writes a
 *  buffer at step i + 2 only after a barrier the other consumer reaches once its step-i wgmmas
 *  completed (consumer 0: barrier 3 of step i + 1; consumer 1: barrier 2 of step i + 2).
 *  kDropout: consumer 1, which would otherwise wait for P^T, draws the step's keep bits into the
 *  mask right after issuing dP^T and arrives on barrier 6, on which consumer 0 syncs before it
 *  forms P^T: consumer 0 keeps P^T o kept for dV (registers and the P tile) and stores the whole
 *  X^T into the dS tile; consumer 1 reads Z from the mask for dS^T (its own warps' bits, ordered by
 *  barrier 2). Consumer 1 rewrites the mask only after barrier 3, which consumer 0 reaches after
 *  reading it, and cannot arrive on barrier 6 twice ahead for the same reason. */
template <class T, bool kWithDq, int kConsumer, bool kAlibi, bool kDropout = false>
__device__ void consume_split_roles(const BackwardKernelArgs& args, const BackwardSmem<T>& sm, const KeyBlockWork& w,
                                    const TileCursor& at, int& trace_events) {
  constexpr uint32_t kPReady = 2, kDsReady = 3, kMaskReady = 6;
  constexpr int consumer = kConsumer;  // a template parameter: no wgmma under a run-time branch
  const BackwardParams& p = args.params;
  const int t = static_cast<int>(ptx::thread_in_warpgroup());
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int key_row = warp * 16 + group;  // in the block (both consumers see all 64 keys); and + 8
  const int key_row0 = w.n0 + key_row;
  const int col0 = consumer * T::kColsPerConsumer;
  const sm80::bwd::ScoreTransform tf = sm80::bwd::ScoreTransform::make(p);
  const bool softcap = tf.softcap > 0.f;
  [[maybe_unused]] uint32_t* drop_mask = nullptr;  // the keep-bit mask consumer 1 writes (kDropout)
  if constexpr (kDropout) drop_mask = dropout_masks<T>(sm);

  float dv[T::kColsPerConsumer / 2], dk[T::kColsPerConsumer / 2];
#pragma unroll
  for (int i = 0; i < T::kColsPerConsumer / 2; ++i) dv[i] = dk[i] = 0.f;

  if (w.steps > 0) ptx::mbarrier_wait_parity(sm.kv_full(), at.kv_parity());
  for (int step = 0; step < w.steps; ++step) {
    const auto [stage, parity, buf] = at.slot<T>(step);  // run on across tiles
    const int m0 = w.m0_of(step, T::kBlockM);
    const int stat_shift = w.stat_index(p, step, T::kBlockM) % T::kStatAlign;  // see kStatAlign
    ptx::mbarrier_wait_parity(sm.q_full(stage), parity);

    float x[T::kBlockM / 2];  // S^T (consumer 0) or dP^T (consumer 1)
    ptx::wgmma_fence();
    if constexpr (consumer == 0) {
      issue_scores_t<T>(x, sm.k_addr(), sm.q_addr(stage), 0);
    } else {
      issue_scores_t<T>(x, sm.v_addr(), sm.do_addr(stage), 0);
    }
    ptx::wgmma_commit_group();
    if constexpr (kDropout && consumer == 1) {
      write_dropout_mask<T::kBlockM>(drop_mask, p.dropout, dropout_problem(p, w, step), m0,
                                     static_cast<uint32_t>(w.n0 / T::kBlockN), t);
      ptx::barrier_arrive_any(kMaskReady, T::kConsumerThreads);
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(x);

    uint32_t pa[T::kBlockM / 16][4];  // P^T as RS fragments (consumer 0)
    if constexpr (consumer == 0) {
      const float* lse = sm.lse(stage) + stat_shift;
      const bool masked = kAlibi || !w.mask(p).tile_fully_visible(m0, m0 + T::kBlockM, w.n0, w.n0 + T::kBlockN);
      const TileMask mask = TileMask::make(w.mask(p));
      const auto alibi = AlibiStep<kAlibi>::make(p, w, step, m0, key_row0, quad);
      if constexpr (kDropout) ptx::barrier_sync_any(kMaskReady, T::kConsumerThreads);  // the step's keep bits
      const auto drop = read_dropout_step<T, kDropout>(p, drop_mask, key_row, quad);
      with_score_variant(softcap, masked, [&](auto kSoftcap, auto kMasked) {
        probabilities<T, decltype(kSoftcap)::value, decltype(kMasked)::value, kAlibi, kDropout>(
            x, pa, lse, tf, mask, m0, key_row0, quad, alibi, drop);
      });
      store_key_tile<T>(pa, sm.p_ptr(buf), key_row, quad);
      if (kDropout || softcap) {  // x = P^T (1 - t^2), or (dropout) P^T where pa is P^T o kept
        uint32_t pc[T::kBlockM / 16][4];
        pack_a_fragments<T>(x, pc);
        store_key_tile<T>(pc, sm.ds_ptr(buf), key_row, quad);
      } else {
        store_key_tile<T>(pa, sm.ds_ptr(buf), key_row, quad);
      }
      ptx::fence_proxy_async_shared_cta();  // P -> consumer 1's wgmma (async proxy)
      ptx::barrier_arrive_any(kPReady, T::kConsumerThreads);
      ptx::wgmma_fence();
      issue_from_registers<T>(dv, pa, sm.do_addr(stage), col0);
      ptx::wgmma_commit_group();
      ptx::barrier_sync_any(kDsReady, T::kConsumerThreads);
      // dV ran during consumer 1's dS: retire it, so its A fragments are free before the dQ
      // accumulator is allocated (pa, dK, dV and dQ together spilled ~140 bytes).
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(dv);
    } else {
      ptx::barrier_sync_any(kPReady, T::kConsumerThreads);
      grads_from_tile<T, kDropout>(x, sm.ds_ptr(buf), sm.dsum(stage) + stat_shift, key_row, quad,
                                   read_dropout_step<T, kDropout>(p, drop_mask, key_row, quad));
      uint32_t dsa[T::kBlockM / 16][4];
      pack_a_fragments<T>(x, dsa);
      store_key_tile<T>(dsa, sm.ds_ptr(buf), key_row, quad);
      ptx::fence_proxy_async_shared_cta();  // dS -> both consumers' wgmmas
      ptx::barrier_sync_any(kDsReady, T::kConsumerThreads);
      ptx::wgmma_fence();
      issue_from_key_tile<T>(dv, sm.p_addr(buf), sm.do_addr(stage), 0, col0);
    }
    finish_step<T, kWithDq, false>(args, sm, w, at, step, 0, col0, consumer, pa, dv, dk,  // pa: unused
                                   trace_events);
  }
  store_tile_grads<T, kDropout>(args, sm, w, dk, dv, consumer, t, key_row0, col0, quad);
}

/** kWithDq: false in deterministic mode, where dq is recomputed by the sm80 dq kernel instead of
 *  accumulated here with atomics. */
/** kAlibi: the scores carry ALiBi biases (p.alibi_slopes): a kernel of its own, so that the
 *  kernels without them keep their code and registers. kDropout likewise (p.dropout; launched
 *  with T::kDropoutSmemBytes of shared memory for the keep-bit masks). */
template <class T, bool kWithDq, bool kAlibi = false, bool kDropout = false>
__global__ void __launch_bounds__(T::kThreads, 1) backward_kernel(const __grid_constant__ BackwardKernelArgs args) {
  extern __shared__ uint8_t smem_raw[];
  // A programmatic dependent of the kernel before it (cuda/programmatic_launch.hpp).
  ptx::wait_previous_grid();
  ptx::allow_next_grid();
  const uint32_t raw_addr = ptx::smem_addr(smem_raw);
  const uint32_t pad = (T::kAlign - raw_addr % T::kAlign) % T::kAlign;
  BackwardSmem<T> sm;
  sm.base = smem_raw + pad;
  sm.addr = raw_addr + pad;
  sm.bars = reinterpret_cast<uint64_t*>(sm.base + T::kBarrierOffset);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(sm.kv_full(), 1);
    ptx::mbarrier_init(sm.kv_empty(), T::kConsumerWarps);
    ptx::mbarrier_init(sm.kv_loaded(), 1);
    for (int s = 0; s < T::kStages; ++s) {
      ptx::mbarrier_init(sm.q_full(s), 1);
      ptx::mbarrier_init(sm.q_empty(s), T::kConsumerWarps);
      ptx::mbarrier_init(sm.q_loaded(s), 1);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  // Every role walks the same tiles in the same order (the grid is persistent and strides over
  // them) and advances the same cursor, so stages, buffers and barrier phases agree.
  const auto for_each_tile = [&](auto&& body) {
    TileCursor at;
    for (int tile = static_cast<int>(blockIdx.x); tile < args.num_tiles; tile += static_cast<int>(gridDim.x)) {
      const KeyBlockWork w = resolve_key_block<T>(args.params, args.order, tile);
      if (w.n0 >= w.seqlen_k) continue;  // past this sequence's keys (varlen): nothing to own
      body(w, at);
      at.advance(w);
    }
  };
  int trace_events = 0;  // records this thread wrote (backward_trace.cuh; unused otherwise)
  const uint32_t warpgroup = ptx::warpgroup_index();
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<T::kProducerRegisters>();
    if (ptx::warp_in_warpgroup() == 0) {
      if (ptx::elect_one_sync()) {
        for (const CUtensorMap* map : {&args.map_q, &args.map_do, &args.map_lse, &args.map_dsum, &args.map_k, &args.map_v}) {
          ptx::tma_prefetch_tensor_map(map);
        }
        for_each_tile([&](const KeyBlockWork& w, const TileCursor& at) { produce<T>(args, sm, w, at, trace_events); });
      }
    } else if (ptx::warp_in_warpgroup() == 2 && args.params.cu_seqlens_q != nullptr) {
      TailPhases q_phases;
      uint32_t kv_phase = 0;
      for_each_tile([&](const KeyBlockWork& w, const TileCursor& at) { zero_tails<T>(args, sm, w, at, q_phases, kv_phase); });
    }
  } else {
    ptx::setmaxnreg_inc<T::kConsumerRegisters>();
    if (args.store_dkdv_with_tma && ptx::thread_in_warpgroup() == 0) {
      ptx::tma_prefetch_tensor_map(&args.map_dk);
      ptx::tma_prefetch_tensor_map(&args.map_dv);
    }
    if constexpr (T::kSplitRoles) {
      if (warpgroup == 1) {
        for_each_tile([&](const KeyBlockWork& w, const TileCursor& at) {
          consume_split_roles<T, kWithDq, 0, kAlibi, kDropout>(args, sm, w, at, trace_events);
        });
      } else {
        for_each_tile([&](const KeyBlockWork& w, const TileCursor& at) {
          consume_split_roles<T, kWithDq, 1, kAlibi, kDropout>(args, sm, w, at, trace_events);
        });
      }
    } else {
      const int consumer = static_cast<int>(warpgroup) - 1;
      for_each_tile([&](const KeyBlockWork& w, const TileCursor& at) {
        consume<T, kWithDq, T::kCarryDk && kWithDq, kAlibi, kDropout>(args, sm, w, at, consumer, trace_events);
      });
    }
    // The last dQ reductions and dK / dV stores complete before the CTA (and its shared memory)
    // goes away.
    if (ptx::thread_in_warpgroup() == 0) ptx::tma_store_wait_group<0>();
  }
}

// ---- host -----------------------------------------------------------------------------------------

/** A TMA map over fp32 workspace rows (`cols` values each, `row_stride` apart) with the given box. */
inline Status encode_workspace_map(const float* base, uint64_t cols, uint64_t rows, uint64_t row_stride,
                                   uint32_t box_cols, uint32_t box_rows, TmaSwizzle swizzle, CUtensorMap* map) {
  TiledViewNd v;
  v.base = base;
  v.element = TmaElement::kFp32;
  v.rank = 2;
  v.dims[0] = cols;
  v.dims[1] = rows;
  v.strides[0] = 1;
  v.strides[1] = row_stride;
  v.box[0] = box_cols;
  v.box[1] = box_rows;
  v.swizzle = swizzle;
  const Status s = encode_tensor_map_nd(v, map);
  if (s.is_ok()) return s;
  return Status{s.code, std::string("workspace: cuda_sm90 backward: ") + s.message};
}

template <class T>
Status launch_main(const backward_params_t& p, const sm80::bwd::BackwardWorkspacePtrs& ws, cudaStream_t stream) {
  const int64_t num_key_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  const int64_t ctas = num_key_blocks * p.heads_kv * p.batch;
  if (ctas == 0) return Status::ok();
  if (ctas > INT_MAX) return Status::unsupported("k: too many key blocks for the cuda_sm90 backward grid");

  const int sm_count = usable_multiprocessors(p.device_id, kFallbackSmCount, p.sm_margin);
  BackwardKernelArgs args{};
  args.params = p;
  args.ws = ws;
  // One CTA per SM: the tail holds ~2 x sm_count tiles where a mask makes key blocks cost
  // different amounts (such grids are one CTA per tile, see persistent_grid).
  args.order = sm80::make_grid_order(p.heads_kv * p.batch, num_key_blocks,
                                     /*costs_differ=*/p.has_mask(), sm_count);
  args.num_tiles = static_cast<int>(ctas);
  const bool varlen = p.is_varlen();
  const TmaElement element = tma_element_of<typename T::Element>();
  const int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t k_rows = varlen ? p.total_k : p.seqlen_k;
  // No step reads an empty tensor (no query rows, or no key block).
  const AttentionMapJob jobs[] = {{"q", &p.q, q_rows, p.heads_q, T::kBlockM, &args.map_q},
                                  {"dout", &p.dout, q_rows, p.heads_q, T::kBlockM, &args.map_do},
                                  {"k", &p.k, k_rows, p.heads_kv, T::kBlockN, &args.map_k},
                                  {"v", &p.v, k_rows, p.heads_kv, T::kBlockN, &args.map_v}};
  Status s = encode_attention_maps(jobs, 4, element, p.batch, p.head_dim, varlen, "cuda_sm90 backward");
  if (!s.is_ok()) return s;
  // lse_log2 and D as one fp32 row each (heads_q * total_q values): a box is kStatBox values from
  // a 16-byte boundary (kStatAlign). Past the array's end TMA reads zeros; rows past seqlen_q are
  // masked anyway.
  const uint64_t stat_count = static_cast<uint64_t>(p.heads_q) * static_cast<uint64_t>(p.total_q);
  if (stat_count > 0) {
    for (auto [values, map] : {std::pair<const float*, CUtensorMap*>{ws.lse_log2, &args.map_lse},
                               std::pair<const float*, CUtensorMap*>{ws.dsum, &args.map_dsum}}) {
      // One row (the encoder's smallest rank is 2; the outer dimension has extent 1). Its stride is
      // never stepped, but TMA still wants a legal one: a multiple of 16 bytes no smaller than the
      // row (a shorter one made the copy fault with an illegal instruction).
      if (!(s = encode_workspace_map(values, stat_count, 1, (stat_count + 3) / 4 * 4, T::kStatBox, 1,
                                     TmaSwizzle::kNone, map)).is_ok()) {
        return s;
      }
    }
  }
  if (ws.dq_accum != nullptr && T::kDqViaTma && stat_count > 0) {
    // The dQ accumulator as rows of kHeadDim floats; a reduction adds one kDqRows x kDqBoxCols box.
    if (!(s = encode_workspace_map(ws.dq_accum, T::kHeadDim, stat_count, T::kHeadDim, T::kDqBoxCols, T::kDqRows,
                                   TmaSwizzle::k128B, &args.map_dq)).is_ok()) {
      return s;
    }
  }
  // dK and dV through TMA where they can be described; otherwise the epilogue stores from registers.
  if (k_rows > 0 && tma_addressable(p.dk, varlen, p.batch) && tma_addressable(p.dv, varlen, p.batch)) {
    const AttentionMapJob out_jobs[] = {{"dk", &p.dk, k_rows, p.heads_kv, T::kKeysPerConsumer, &args.map_dk},
                                        {"dv", &p.dv, k_rows, p.heads_kv, T::kKeysPerConsumer, &args.map_dv}};
    args.store_dkdv_with_tma =
        encode_attention_maps(out_jobs, 2, element, p.batch, p.head_dim, varlen, "cuda_sm90 backward").is_ok();
  }
  auto* kernel = ws.dq_accum != nullptr ? backward_kernel<T, true> : backward_kernel<T, false>;
  if (p.has_alibi()) kernel = ws.dq_accum != nullptr ? backward_kernel<T, true, true> : backward_kernel<T, false, true>;
  uint32_t smem_bytes = T::kSmemBytes;
  if (p.dropout.enabled()) {  // kernels of their own (with or without ALiBi), and their masks
    if (p.has_alibi()) {
      kernel = ws.dq_accum != nullptr ? backward_kernel<T, true, true, true> : backward_kernel<T, false, true, true>;
    } else {
      kernel = ws.dq_accum != nullptr ? backward_kernel<T, true, false, true> : backward_kernel<T, false, false, true>;
    }
    smem_bytes = T::kDropoutSmemBytes;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) {
    return Status::cuda(std::string("cuda_sm90 backward: cannot reserve shared memory: ") + cudaGetErrorString(err));
  }
  // Persistent (persistent_grid): one CTA per SM (the shared memory allows no second), each
  // walking tiles blockIdx.x, + gridDim.x, ...: the next tile's Q, dO, K and V load under the
  // current one's last step and epilogue instead of after a fresh CTA starts (fwd+bwd d256
  // S = 512: 139 -> 179 TFLOP/s). Otherwise one CTA per tile.
  const int64_t grid = persistent_grid(p) ? std::min<int64_t>(ctas, sm_count) : ctas;
  err = launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(T::kThreads), smem_bytes, stream,
                      supports_programmatic_launch(p.device_id), args);
  if (err != cudaSuccess) return Status::cuda(std::string("cuda_sm90 backward launch failed: ") + cudaGetErrorString(err));
  return Status::ok();
}

/** Entry point instantiated once per (dtype, head-dim bucket) by the generated units. */
template <typename Element, int kHeadDim>
Status backward_run(const backward_params_t& p, void* workspace, size_t workspace_bytes) {
  using T = typename DefaultBackwardTraits<Element, kHeadDim>::type;  // d64 / d128 only (backward_api.cu)
  const sm80::BackwardWorkspaceLayout layout = sm80::BackwardWorkspaceLayout::make(p, kHeadDim, /*dq_tiled=*/false);
  if (workspace_bytes < layout.total_bytes || (layout.total_bytes > 0 && workspace == nullptr)) {
    return Status::invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " +
                           std::to_string(layout.total_bytes) + " needed by the cuda_sm90 backward");
  }
  ScopedDevice device(p.device_id);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const sm80::bwd::BackwardWorkspacePtrs ws = sm80::bwd::workspace_ptrs(layout, workspace);
  Status s = sm80::bwd::launch_preprocess<Element, kHeadDim>(p, ws, stream);
  if (!s.is_ok()) return s;
  if (!(s = launch_main<T>(p, ws, stream)).is_ok()) return s;
  // Deterministic dropout calls recompute dq in sm80's dq kernel, whose dropout versions draw the
  // same mask (common/dropout.hpp); the other stage-3 kernels are untouched by dropout.
  return sm80::bwd::launch_dq_stage<Element, kHeadDim, /*kDropoutKernels=*/true>(p, ws, stream);
}

}  // namespace flashcore::cuda::sm90
