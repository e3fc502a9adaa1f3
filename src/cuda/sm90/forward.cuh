// Hopper forward kernel: TMA loads into an mbarrier pipeline, wgmma on the tensor cores, one
// producer warpgroup and two consumer warpgroups (warp specialization). Header-only:
// cmake/cuda.cmake generates one sm_90a translation unit per (dtype, head-dim bucket) that
// explicitly instantiates forward_run.
//
// Relies on: api/params.hpp (AttentionParams, seq_info, offset_of), common/mask.hpp (MaskInfo, the
// one definition of causal / window masks), cuda/ptx/{wgmma,tma,mbarrier,warpgroup,cluster}.cuh (the PTX
// wrappers, each unit-tested alone in tests/cuda/sm90), cuda/sm90/tensor_map.hpp (host side).
//
// ---- Work decomposition -------------------------------------------------------------------------
// A tile is (query block of kBlockM = 64 * kConsumers rows, query head, batch entry); a CTA has
// 1 + kConsumers warpgroups:
//  warpgroup 0, the producer: one elected thread issues every TMA copy (Q of a tile, then K and
//      V of its key blocks into a ring of kStages buffers); the warpgroup gives registers away
//      with setmaxnreg.dec so the consumers can hold 240 each.
//      In packed varlen calls its warp 2 zeroes the rows of V past a sequence's end (zero_v_tails).
//  warpgroups 1.., the consumers: each owns 64 query rows (one wgmma M) and runs the whole key
//      loop for them: S = Q K^T (wgmma, both operands in shared memory), online softmax in
//      registers, O += P V (wgmma with P from registers, the "RS" form). The consumers share
//      each K/V tile and interleave naturally: while one does its softmax (FMA / MUFU pipes) the
//      other's wgmmas occupy the tensor cores.
// The grid is persistent (one CTA per SM; four for varlen calls of uneven lengths under a causal
// mask, kVarlenListsPerSm): the producer loads the next tile's first K/V blocks while the
// consumers finish the current one (the walk's divisions are FastDivmod: each tile's resolve runs
// on one thread with nothing to hide it), and (d64, d128: two Q slots) the next tile's Q right
// after the current tile's first key block (produce_all). Tiles come in pairs of equal total cost
// under a causal mask (the last ones as single tiles in order of falling cost, where that evens
// out the CTAs' ends: tile_tail.hpp), in order otherwise (TileWalker). Key blocks run from the
// last to the first, so the tiles that need per-element masks (the causal diagonal, the partial
// last block) come first and the rest take the branch-free body.
// Every consumer warp walks the tiles itself (TileWalker, ~800-970 cycles a tile at d128) although
// the producer has the same walk: what steers a consumer's control flow (the key loop's bounds,
// the mask choices) must come from kernel parameters, blockIdx or global memory. Read from shared
// memory, ptxas cannot take it as warp-uniform and guards the softmax's shuffles with divergent-
// path copies (BRA.DIV, WARPSYNC): a producer-published tile cost 3-11% (docs/PERF.md, session 21).
//
// ---- Pipeline (mbarriers; the n-th use of a ring slot waits for parity (n / slots) & 1) -------
//  q_full[q] / q_empty[q]: Q of a tile (kQStages buffers); every consumer warp arrives on
//                      q_empty once its last Q K^T completed; the producer waits before a refill.
//  k_full[s], v_full[s]: producer arms with a tile's bytes; the TMA completes the phase.
//  k_empty[s], v_empty[s]: one arrival per consumer warp once its wgmmas reading the buffer have
//                      completed (wgmma.wait_group); the producer waits before refilling.
// K and V have separate barriers so S = Q K^T starts before V has landed. Fill counters run on
// across the tiles of a persistent CTA (PipelineCounters), identically in both roles.
//
// ---- Cluster pairs (kClusterPair kernels: d128 / d256, one-sided masks, from 8192 tokens) -----
// At the H200's 700 W cap the long cells run at a clock the power sets, and copying K/V from L2
// into shared memory costs power (docs/PERF.md, session 63: half the bytes raised d256 causal 16k
// by 7%). Two CTAs of a cluster take query blocks 2i and 2i + 1 of one head and walk the key
// blocks of both blocks' rows (a block outside this CTA's own rows is all masked: under a causal
// mask rank 0 loads kBlockM / kBlockN more blocks a tile, for its peer, and its consumers hand
// them back uncomputed), so their walks are the same. Each
// producer copies its rank's 64-column chunks of every K/V block into both CTAs (multicast TMA)
// and arms its own full barrier for the whole block; each consumer warp releases a stage on both
// CTAs' empty barriers (counting 2 x kConsumerWarps), so neither producer refills a stage the
// other CTA still reads. A cluster_sync after the barrier setup, and one by the consumers before
// they exit, keep every remote access inside the peer's lifetime. Walking in pairs costs per
// clock (no tile tail, two CTAs held to one pace) and returns it in clock where tiles are long
// (cluster_pair_chosen).
//
// ---- Whole heads (kWholeHead kernels: d64, keys <= the ring; whole_heads_chosen) ------------
// Short heads load their K/V again for every query tile (a causal pair of S = 512 tiles loads 2.5
// blocks a tile), and each tile waits for its first K. Where a head's keys fit the ring whole (d64's
// 4 stages of 128 keys), one work item is every query tile of a (batch, head), the last first. Its
// first tile loads every K/V block once, top down, as any tile would; the other tiles load only
// their Q and read the blocks in place. The fill counters stay FIFO: each tile of the head ends
// with the counter at the head's last fill, and a tile's blocks (key 0 up to its last) are the
// head's last n_tiles fills. A block is handed back after the last tile that reads it (under a
// causal mask, tile m is the last reader of block m), so the next head's loads start while the
// lower tiles still run. Key ranges must start at key 0 and not shrink from tile m - 1 to tile m
// (whole_heads_fit). Each call keeps the tile it would take otherwise (the narrow one under a mask,
// the wide one with issue turns without); H200, bf16, same process as cuDNN, two processes each
// way (docs/PERF.md, session 66): S = 512 full +4%, causal +1.5% to +3%, S = 256 +2% / +4%,
// S = 384 full level.
//
// ---- Overlap inside a consumer (iteration j >= 1) ----------------------------------------------
//   issue S_j = Q K_j ; issue O += P_{j-1} V_{j-1} ; wait for S_j (wait_group 1) ; release K_j ;
//   softmax_j on S_j (fp32, in place) ; wait for the P V (wait_group 0) ; release V_{j-1} ;
//   rescale O by the max correction of tile j ; round P_j to 16 bits in the A-fragment registers.
// The softmax of tile j runs while the tensor cores still work on P_{j-1} V_{j-1}; O is touched
// only after its wgmma completed, and P_{j-1}'s registers are not rewritten before that either.
// At d128/d256 (and on d64's wide tile below 4096 keys) the consumers also take turns issuing
// (IssueTurn, named barriers), so one's GEMMs run while another does its softmax.
// Across tiles the same step continues (consume): the last P V of a tile is issued together with
// the next tile's first Q K^T, and the tile's epilogue runs after that first softmax, once the
// P V completed. Against draining each tile before its epilogue (session 10, bf16, same process):
// d256 +3% to +11%, d64/d128 within +-2%; it also removed the d256 kernels' spills.
//
// ---- Shared memory (128-byte swizzle, every tile 1024-byte aligned) ----------------------------
// A tile of R rows x D columns is stored as D/64 column chunks of [R rows][128 bytes] - what a TMA
// box of {64, R} with CU_TENSOR_MAP_SWIZZLE_128B writes, and the canonical wgmma layout:
// KMajorTile{k128B, R, D} for Q (A operand) and K (B operand of Q K^T, K-major), and
// MnMajorTile{k128B, D, R} for V (B operand of P V, head dim contiguous = MN-major).
// The epilogue stages O there too: per consumer, one [64 rows][128 bytes] swizzled box per 64-column
// chunk (d256: two chunks at a time), which a TMA store writes out (store_o_staged; the async stores
// free the consumers and the load/store unit for the next tile, where 4-byte register stores queued
// up).
//
// ---- Fragments (see cuda/ptx/wgmma.cuh) ---------------------------------------------------------
// Accumulator register i of warpgroup thread t (warp w, g = lane / 4, quad = lane % 4) holds row
// 16w + g + 8*((i % 4) / 2), column 8*(i / 4) + 2*quad + (i % 2): each thread owns 2 rows, whose
// maxima and sums reduce over the 4 lanes of a quad. The S accumulator of key slice s (16 keys)
// packs into the RS A fragment {S[8s],S[8s+1]}, {S[8s+2],S[8s+3]}, {S[8s+4],S[8s+5]},
// {S[8s+6],S[8s+7]} with no data movement.
//
// ---- Softmax and masks ---------------------------------------------------------------------------
// The sm80 rules, lazy rescaling included: a row's reference max moves only when its max grew by
// more than kRescaleThresholdLog2 (8) log2 units, so P <= 2^8 and O (64 or 128 registers per thread
// at d128 / d256) is multiplied only when some row of the warp moved, which after a row's first
// tiles is rare. Against eager rescaling: d128 -1% to +7%, d256 +1% to +4% (docs/PERF.md, session
// 9); the multiply sat between the P V wgmma's completion and the next issue. The max runs on raw
// scores with the scale folded into one FFMA in log2 units (a softcap or a negative scale
// transforms the scores first, in kernels compiled with kScoreTransforms); a row whose max is
// still -inf subtracts 0, so exp2 never sees -inf - -inf; masked scores are -inf. Keys outside
// MaskInfo::keys_for_row (which also ends at seqlen_k) are masked per element only in tiles that
// are not MaskInfo::tile_fully_visible for the rows that are stored. Rows past seqlen_q compute on
// whatever TMA loaded (finite), take the unmasked body and are never stored; a consumer whose rows
// all lie past it computes nothing (it only keeps the turns and barriers in step). Rows with no
// keys give out = 0, lse = -inf. At d64, a consumer that sees only the left half of its tile's
// first key block (the causal diagonal above the first 64 rows of a 128-row tile) runs that
// softmax on the half: P = 0 on the rest, without its exponentials (ForwardTraits::kLeftHalfDiagonal).
// Where a tile has more rows than a key block has keys (d256's 64-key blocks, d64's 192-row
// tiles), the tile's first blocks may lie wholly past the keys of a consumer's rows (under a
// causal mask, above its part of the diagonal): that consumer hands them back uncomputed and
// keeps their issue turns (ForwardTraits::kSkipsBlocksPastRows). d256 causal 512 / 1k / 2k
// +2.5% / +3.2% / +4.1% (H200, bf16, same process, docs/PERF.md session 67).
//
// ---- Addressing -----------------------------------------------------------------------------------
// Dense calls: 4-D tensor maps (head_dim, seqlen, heads, batch) with the caller's strides, so
// rows past a sequence's end read as zeros. Varlen calls: (head_dim, total rows, heads, 1) and the
// row coordinate starts at the sequence's packed offset; keys past seqlen_k of sequence b are
// then rows of sequence b+1, which the mask turns into P = 0 exactly (their values are finite
// inputs), and the end of the packed tensor reads as zeros.
// Head dims below the bucket: the map's head_dim extent is the real one, TMA zero-fills the
// padding columns, and the epilogue never stores them.
//
// ---- Packed GQA (ForwardTraits::kPackGqa, sm90/pack_gqa.hpp says when) ----------------------------
// A tile is kBlockM rows of one KV head's packed rows: row r is query head kv_head * group +
// r % group of token r / group, so a call with a few tokens per head fills its tiles with the
// group's rows and reads each K / V block once per group. The tiles walk (packed block, KV head,
// batch); Q and O go through 5-D maps (head_dim, group, tokens, heads_kv, batch) whose boxes hold
// whole tokens (the group divides 64), landing in shared memory in exactly the packed order; the
// masks take each row's token (token_of / token_end), the direct stores and the lse each row's
// head (head_of_row). BlockWork::rows counts packed rows. No ALiBi (a slope per query head).
//
// ---- Split-KV (ForwardTraits::kSplitKv, sm90/split_kv.hpp says when) -----------------------------
// A call with fewer query tiles than half the SMs and a long key range (a few tokens of one
// sequence against a long context: speculative decoding, chunked prefill) would leave most SMs
// idle, one CTA per tile. Its work items are then (split, tile): the tile's key blocks cut into
// num_splits ranges of equal length (resolve_block), so the CTAs cover the GPU. Each writes O / l
// in fp32 and its lse to the workspace (store_partial); the decode path's merge kernel then
// combines the splits into out and lse (forward_run). A split with no key block writes lse = -inf,
// which the merge skips. Softcap, ALiBi and negative scales split on the score-transform tiles
// (dispatch_split).
//
// ---- Dropout (ForwardTraits::kDropout) -----------------------------------------------------------
// common/dropout.hpp's mask: after a key block's softmax summed its probabilities into l (every one
// of them: l and the lse ignore dropout), drop_probabilities zeroes the dropped ones before P is
// packed for the P V wgmma, and the epilogue multiplies by keep_scale / l (inverse_sum; split-KV
// partials too, so the merge by lse stays exact). A thread makes one Philox call per (row, 32 keys)
// of a block, whose eight draws are exactly its accumulator registers there (dropout_fragment.hpp);
// the calls run while the previous block's P V is on the tensor cores. The counter takes the
// block's key in the sequence, the row's token and b * heads_q + the row's query head, so split
// ranges, packed GQA rows and varlen sequences draw what every other backend draws. Kernels of
// their own (dispatch_dropout, dispatch_split): the two-consumer tiles with the score transforms,
// plain, packed, split and packed split; no page boxes (forward_api.cu gathers such pages for
// dropout calls) and no three-consumer or 80-key tiles.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "api/kvcache_backends.hpp"  // cuda::merge_split_partials, MergeParams
#include "api/params.hpp"
#include "api/status.hpp"
#include "common/fast_divmod.hpp"
#include "common/mask.hpp"
#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/forward_scores.hpp"
#include "cuda/build_config.hpp"  // multiprocessor_count
#include "cuda/programmatic_launch.hpp"
#include "cuda/scoped_device.hpp"
#include "cuda/sm80/tile_common.cuh"  // ElementOps::pack, quad reductions, fast_exp2
#include "cuda/sm90/attention_views.hpp"
#include "cuda/sm90/dropout_fragment.hpp"
#include "cuda/sm90/forward_trace.cuh"
#include "cuda/sm90/pack_gqa.hpp"
#include "cuda/sm90/split_kv.hpp"
#include "cuda/sm90/tail_rows.cuh"
#include "cuda/sm90/tensor_map.hpp"
#include "cuda/sm90/tile_tail.hpp"

namespace flashcore::cuda::sm90 {

using forward_params_t = AttentionParams;
using sm80::ElementOps;
using sm80::fast_exp2;
using sm80::kLn2;
using sm80::kLog2e;
using sm80::quad_allreduce_max;
using sm80::quad_allreduce_sum;

/** Tile sizes, warp roles and the shared-memory plan of one kernel instantiation. */
template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_ = 2,
          bool kPingPong_ = true, bool kScoreTransforms_ = false, bool kPageBoxes_ = false,
          bool kPackGqa_ = false, bool kSplitKv_ = false, bool kDropout_ = false, bool kClusterPair_ = false,
          bool kWholeHead_ = false>
struct ForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // the compiled bucket; actual head_dim <= this
  static constexpr int kBlockN = kBlockN_;    // keys per K/V tile (the N of S = Q K^T)
  static constexpr int kStages = kStages_;    // K/V buffers in the ring
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups, 64 query rows each
  static constexpr int kRowsPerConsumer = 64; // one wgmma M
  static constexpr int kBlockM = kConsumers * kRowsPerConsumer;
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kConsumerWarps = kConsumers * 4;
  static constexpr bool kPingPong = kPingPong_;  // consumers take turns issuing wgmmas
  // The reference max of a row moves only when the row's max grew by more than this many log2
  // units (lazy rescaling, see "Softmax and masks" above); 0 would rescale on every tile.
  static constexpr int kRescaleThresholdLog2 = 8;
  // Whether the kernel carries the softcap / linear score transforms. Calls with the plain folded
  // scale (nearly all) run a kernel without them: the transform code, inlined per score, was
  // over half of the kernel's PTX. With lazy rescaling: d64 -2% to +5%, d128 +1% to +7%, d256
  // +2% to +4% against neither (session 9); without it d64 lost up to 8% to lazy rescaling.
  static constexpr bool kScoreTransforms = kScoreTransforms_;
  // A consumer that sees only the left half of its tile's first key block (the causal diagonal
  // above its rows) runs that block's softmax on the half (softmax_tile's kLeftHalf). d64 only,
  // where the exponentials (MUFU, 16 per clock per SM) take as long as the GEMMs: d64 causal
  // +8.5% at S = 512, +5.9% at 1k, +1% at 4k / 16k; d128 causal lost 0.4-1% (session 20).
  // Q K^T stays N = 128: a half-width wgmma behind a run-time test serialized every wgmma (C7515).
  static constexpr bool kLeftHalfDiagonal = kHeadDim_ == 64 && kBlockN_ == 128;
  // Q K^T with Q in registers (the RS form: each consumer loads its 64 rows of Q once per tile
  // with ldmatrix) instead of both operands from shared memory: every key block's S then reads
  // only K from shared memory. d128 on two consumers of 240 registers (the split-KV kernels would
  // spill 32-88 bytes). Sustained rates at the H200's power limit (dev/power_probe.py, docs/PERF.md
  // session 43, two alternating builds): d128 causal 8k / 16k +1.1% / +1.3% at the same clock,
  // 512-2k and the unmasked narrow-tile cells within their noise; d64 lost 0.8-0.9% (causal 512-2k).
  static constexpr bool kQInRegisters = kConsumers_ == 2 && kHeadDim_ == 128 && kBlockN_ == 128 && !kSplitKv_;
  static constexpr int kQSlices = kQInRegisters ? kHeadDim_ / 16 : 1;  // A fragments held (1: unused)
  // setmaxnreg moves registers within what the CTA was launched with: kThreads times the
  // per-thread count at entry (65536 / kThreads rounded down to the allocation granule of 8,
  // which __launch_bounds__(kThreads, 1) makes ptxas use). The split must fit in it, or the
  // consumers' setmaxnreg.inc waits forever: 384 threads enter with 168 (64512 registers =
  // 128 * (24 + 2 * 240)), 512 threads with 128 (65536 = 128 * (32 + 3 * 160)).
  static constexpr int kProducerRegisters = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = kConsumers == 2 ? 240 : 160;
  static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumers * kConsumerRegisters) <=
                    kThreads * kEntryRegisters,
                "setmaxnreg split exceeds the registers the CTA is launched with");

  static constexpr int kChunkCols = 64;  // 128-byte swizzle span of 16-bit elements
  static constexpr int kChunks = kHeadDim / kChunkCols;
  static constexpr int kSwizzleBytes = 128;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;
  static constexpr uint32_t kTileBytes = kBlockN * kHeadDim * 2;  // one K or V buffer
  static constexpr uint32_t kQChunkBytes = kBlockM * kSwizzleBytes;
  static constexpr uint32_t kTileChunkBytes = kBlockN * kSwizzleBytes;

  static constexpr uint32_t kAlign = 1024;  // 128B-swizzle period: tiles start on it
  // Paged K/V in pages smaller than a key block (kernels of their own, WithPageBoxes): at most
  // this many pages (TMA boxes) per block, pages of 16 keys or more (forward_api.cu's
  // kMinBoxPageKeys); their ids sit after the barriers. 128-key tiles only, without the score
  // transforms (other such calls are gathered). Compiled into every kernel, the box path had made
  // the d256 producer spill 16-28 bytes and moved unpaged cells by -5% to +2% (session 29).
  static constexpr bool kPageBoxes = kPageBoxes_;
  static_assert(!kPageBoxes || (kBlockN == 128 && !kScoreTransforms), "page boxes: 128-key tiles, folded scale");
  static constexpr int kMaxPageBoxes = kPageBoxes ? kBlockN / 16 : 0;
  // Pack-GQA kernels (WithPackedGqa, "Packed GQA" above). Kernels of their own, so the others
  // keep their code; no page boxes, no ALiBi (a slope per row).
  static constexpr bool kPackGqa = kPackGqa_;
  static_assert(!kPackGqa || !kPageBoxes, "pack-GQA kernels read K / V in rows or whole-block pages");
  // Split-KV kernels (WithSplitKv, "Split-KV" above): each tile's key blocks are cut into
  // num_splits ranges, one work item each, and the epilogue writes fp32 O / l and the lse of its
  // range to the workspace for the merge. Kernels of their own, so the others keep their code.
  static constexpr bool kSplitKv = kSplitKv_;
  // Dropout kernels (WithDropout, "Dropout" above): the dropped entries of P are zeroed after the
  // row sums took them and before P is packed for the P V product, and the epilogue scales by
  // keep_scale / l. Kernels of their own on the two-consumer tiles with the score transforms
  // (dispatch_dropout, dispatch_split), so the others keep their code.
  static constexpr bool kDropout = kDropout_;
  static_assert(!kDropout || (kBlockN % 32 == 0 && !kPageBoxes && kConsumers == 2),
                "dropout: whole 32-key halves per key block, rows or whole-block pages, 240-register consumers");
  static constexpr uint32_t kPageIdBytes = 4 * kMaxPageBoxes;
  // Cluster-pair kernels (WithClusterPair, "Cluster pairs" above): fixed-length calls with plain
  // rows (no pages, packed GQA, splits or dropout) and an even number of 64-column chunks.
  static constexpr bool kClusterPair = kClusterPair_;
  // Whole heads ("Whole heads" above): a work item is every query tile of one (batch, head), last
  // first, over K/V blocks loaded once per head that stay in the ring for all of its tiles.
  // A tile may keep blocks for the head's next tile (BlockWork::keep_blocks) and read blocks the
  // previous one kept (BlockWork::rewind) instead of handing each back after its use.
  static constexpr bool kWholeHead = kWholeHead_;
  static constexpr int kClusterCtas = kClusterPair ? 2 : 1;
  // A consumer hands the tile's first key blocks that lie past every key of its own rows back
  // uncomputed (under a causal mask: the blocks above its part of the diagonal), where a tile has
  // more query rows than a key block has keys: d256's two consumers over 64-key blocks and d64's
  // three over 128-key blocks (d128's three-consumer tile runs unmasked calls only). Cluster pairs
  // skip so after the blocks that their CTA's rows skip as a whole. (Never with whole heads, whose
  // blocks a skipped pass would have to keep for the next tile.)
  static constexpr bool kSkipsBlocksPastRows = (kConsumers == 2 || kHeadDim_ == 64) &&
                                               kConsumers * kRowsPerConsumer > kBlockN &&
                                               !kPageBoxes_ && !kPackGqa_ && !kSplitKv_ && !kDropout_ &&
                                               !kWholeHead_;
  static_assert(!kClusterPair || (kHeadDim_ / 64 % 2 == 0 && !kPageBoxes_ && !kPackGqa_ && !kSplitKv_ && !kDropout_),
                "cluster pairs: an even number of 64-column chunks, plain rows");
  // Q is double-buffered where shared memory allows (the next tile's Q lands while this tile
  // still reads its own); d256 keeps one buffer and reloads after the last Q K^T.
  static constexpr int kQStages = kHeadDim <= 128 ? 2 : 1;
  static_assert(!kWholeHead || (kQStages > 1 && !kClusterPair && !kScoreTransforms_ && !kPageBoxes_ &&
                                !kPackGqa_ && !kSplitKv_ && !kDropout_),
                "whole heads: plain tiles with two Q slots (the producer runs ahead on Q alone)");
  static constexpr uint32_t kSmemLimit = 227 * 1024;  // shared memory per block on sm_90
  static constexpr int kBarriers = 2 * kQStages + 5 * kStages;
  static constexpr uint32_t kQOffset = 0;
  static constexpr uint32_t kKOffset = kQOffset + kQStages * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr uint32_t kOOffset = kVOffset + kStages * kTileBytes;
  // The epilogue stages O in the shared memory left beside Q and the K/V ring and stores it with
  // TMA: per consumer, as many of its 64-column chunks per round as that room holds (d64 and d128
  // all at once, d256 with 64-key tiles two of four). With no room (d256 with 80-key tiles) it
  // would store from registers.
  static constexpr uint32_t kOChunkBytes = kRowsPerConsumer * kSwizzleBytes;  // one consumer's box
  static constexpr uint32_t kORoom = kSmemLimit - (kOOffset + 8 * kBarriers + kPageIdBytes + kAlign);
  static constexpr int kOChunksStaged =
      std::min<int>(kChunks, static_cast<int>(kORoom / (kConsumers * kOChunkBytes)));  // per round
  static constexpr bool kStageO = kOChunksStaged > 0;
  static constexpr uint32_t kOBytesPerConsumer = kOChunksStaged * kOChunkBytes;
  static constexpr uint32_t kBarrierOffset = kOOffset + kConsumers * kOBytesPerConsumer;
  static constexpr uint32_t kPageIdOffset = kBarrierOffset + 8 * kBarriers;
  static constexpr uint32_t kSmemBytes = kPageIdOffset + kPageIdBytes + kAlign;  // + base align
  static_assert(kSmemBytes <= kSmemLimit, "shared memory per block on sm_90");
  static_assert(!kStageO || kChunks % kOChunksStaged == 0, "staging rounds cover the chunks evenly");

  static_assert(kHeadDim % kChunkCols == 0, "head dim buckets are multiples of 64");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 256, "wgmma N");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "wgmma N of P V");
  static_assert(kQBytes % kAlign == 0 && kTileBytes % kAlign == 0, "tiles stay 1024-aligned");
};

/** The same tile in clusters of two CTAs sharing their K/V loads (ForwardTraits::kClusterPair;
 *  "Cluster pairs" above). */
template <class T>
using WithClusterPair = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                      T::kPingPong, /*kScoreTransforms=*/false, /*kPageBoxes=*/false,
                                      /*kPackGqa=*/false, /*kSplitKv=*/false, /*kDropout=*/false,
                                      /*kClusterPair=*/true>;

/** The same tile over whole heads (ForwardTraits::kWholeHead; "Whole heads" above). */
template <class T>
using WithWholeHeads = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                     T::kPingPong, /*kScoreTransforms=*/false, /*kPageBoxes=*/false,
                                     /*kPackGqa=*/false, /*kSplitKv=*/false, /*kDropout=*/false,
                                     /*kClusterPair=*/false, /*kWholeHead=*/true>;

/** The same tile with the paged box path compiled in (ForwardTraits::kPageBoxes). */
template <class T>
using WithPageBoxes = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                    T::kPingPong, /*kScoreTransforms=*/false, /*kPageBoxes=*/true>;

/** The same tile over packed GQA rows (ForwardTraits::kPackGqa). */
template <class T>
using WithPackedGqa = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                    T::kPingPong, /*kScoreTransforms=*/false, /*kPageBoxes=*/false,
                                    /*kPackGqa=*/true>;

/** The same tile writing split-KV partials (ForwardTraits::kSplitKv). */
template <class T>
using WithSplitKv = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                  T::kPingPong, T::kScoreTransforms, T::kPageBoxes, T::kPackGqa, /*kSplitKv=*/true,
                                  T::kDropout>;

/** The same tile with dropout (ForwardTraits::kDropout). */
template <class T>
using WithDropout = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages, T::kConsumers,
                                  T::kPingPong, T::kScoreTransforms, T::kPageBoxes, T::kPackGqa, T::kSplitKv,
                                  /*kDropout=*/true>;

/** Calls with this many keys (d64) or queries and keys (d128) count as long for the tile choice. */
constexpr int64_t kLongSeqlen = 4096;

/** Whether p's mask bounds each row's keys on one side only (causal, or a window open on the other
 *  side): a query block's cost then grows or shrinks with its index. */
inline bool one_sided_mask(const forward_params_t& p) { return (p.window_left < 0) != (p.window_right < 0); }

/** Whether the cluster-pair kernel of a block_m-row tile can run p: fixed-length rows read in
 *  place (both CTAs of a cluster then see the same sequence) and an even number of query blocks
 *  (every cluster's two blocks exist). */
inline bool cluster_pair_fits(const forward_params_t& p, int64_t block_m) {
  return !p.is_varlen() && !p.is_paged() && (p.seqlen_q + block_m - 1) / block_m % 2 == 0;
}

/** Query and key lengths from which d128 / d256 calls under a one-sided mask run in cluster pairs. */
constexpr int64_t kClusterPairSeqlen = 8192;

/** Whether p runs on the cluster-pair kernel (d128's narrow tile and d256). Sustained rates at the
 *  700 W cap, same process, bf16 causal, against the single-CTA kernels (docs/PERF.md): d256 16k
 *  +1.6%, 8k +0.7%, 4k -3.0% (session 64), then rank 0's blocks above its diagonal handed back
 *  uncomputed (pair_blocks_past_own_keys) +1.3% more at 8k, level at 16k; d128 with that, 16k
 *  +2.2%, 8k +1.6% (session 65). Without a mask d256 lost 2-3%. Walking in pairs costs per clock
 *  (no tile tail, two CTAs held to one pace); the halved L2 reads pay it back in clock only where
 *  the tiles are long. */
inline bool cluster_pair_chosen(const forward_params_t& p, int64_t block_m) {
  if (!cluster_pair_fits(p, block_m)) return false;
  // FLASHCORE_SM90_CLUSTER_PAIRS in the environment: 0 never, 1 wherever they fit (d128 / d256; an
  // A/B and sanitizer switch, read once per process); otherwise the rule.
  static const int forced = [] {
    const char* v = std::getenv("FLASHCORE_SM90_CLUSTER_PAIRS");
    return v == nullptr ? -1 : v[0] == '0' ? 0 : v[0] == '1' ? 1 : -1;
  }();
  if (forced >= 0) return forced == 1;
  return one_sided_mask(p) && p.seqlen_q >= kClusterPairSeqlen && p.seqlen_k >= kClusterPairSeqlen;
}

/** Whether a block_m x block_n tile with `stages` ring slots can run p over whole heads: fixed
 *  length, K/V read in place, every key of a head in the ring at once, and key ranges that start
 *  at key 0 and do not shrink from one query tile to the next (no mask, causal, or a window
 *  bounded on the right only), so that the head's last tile, visited first, loads every block
 *  and a block is done after the last tile that sees it. */
inline bool whole_heads_fit(const forward_params_t& p, int64_t block_m, int64_t block_n, int stages) {
  return !p.is_varlen() && !p.is_paged() && p.window_left < 0 && p.seqlen_k <= block_n * stages &&
         p.seqlen_q > block_m;
}

/** Whether p runs over whole heads (d64, heads of at most 512 keys): where it fits and the heads
 *  fill the GPU's SMs (fewer heads than SMs keep the per-tile items, which spread one head's
 *  tiles over several SMs). FLASHCORE_SM90_WHOLE_HEADS (read once per process) overrides: 0 off,
 *  2 wherever it fits (tests and sanitizer runs on small shapes). */
inline bool whole_heads_chosen(const forward_params_t& p, int64_t block_m, int64_t block_n, int stages) {
  static const int level = [] {
    const char* v = std::getenv("FLASHCORE_SM90_WHOLE_HEADS");
    return v == nullptr ? 1 : v[0] == '0' ? 0 : v[0] == '2' ? 2 : 1;
  }();
  if (level == 0 || !whole_heads_fit(p, block_m, block_n, stages)) return false;
  return level == 2 || p.batch * p.heads_q >= usable_multiprocessors(p.device_id, kFallbackSmCount, p.sm_margin);
}

/** Devices whose resident-cluster count the cluster-pair launch keeps (launch_forward). */
constexpr int kMaxClusterDevices = 64;

/** The tile a bucket's `dispatch` chose, as a value the launcher can take the type from. */
template <class Traits>
struct TileChoice {
  using type = Traits;
};

/** Per-bucket configurations (shared memory <= 227 KiB; registers: O is kHeadDim/2 floats, S
 *  kBlockN/2 floats and P kBlockN/4 registers per consumer thread). A bucket's `dispatch` picks
 *  its tile per call and hands that traits type to the launcher (as TileChoice<Traits>). Wide
 *  tiles (more query rows at d64 and d128) cost more at the diagonal of a causal or window mask,
 *  where a tile is partly masked and its masked part still runs, so masked calls take them only
 *  from a sequence length on (d128's never).
 *  Measured on the H100 (docs/PERF.md, session 6), bf16 fwd against the narrow tile, same process:
 *  - d64, three consumers (192-row tiles, 160 registers each): +3% to +17% without a mask
 *    (S = 512..16k); causal -35% at S = 512, -4% at 2k, +6% at 4k, +19% at 16k. Ping-pong turns
 *    cost ~2% at d64 with two consumers (the softmax is as long as the GEMMs it would hide
 *    behind); with three they pay below 4096 keys (session 19, ForwardConfigs<64>).
 *  - d256 has one configuration since session 14: 64-key tiles, whose 32 KiB of spare shared memory
 *    stage the epilogue's O for TMA stores. 80-key tiles (two stages of 40 KiB K and V) had been
 *    ahead of 64-key ones at S >= 1k without a mask and 4k with one (session 6, +1% to +11%: the
 *    Q K^T wgmma at N = 64 reads about as many shared-memory bytes per FLOP as the tensor cores
 *    consume), but they leave no room to stage O, and the register stores of a 64 x 256 output
 *    took ~6000 cycles of a 35000-cycle tile at S = 512. Staged 64-key tiles against the former
 *    choice, same process: +5% to +20% at S = 512..2k, +3% to +7% at 4k..16k (docs/PERF.md). */
template <typename Element, int kHeadDim>
struct ForwardConfigs;
template <typename Element>
struct ForwardConfigs<Element, 64> {
  // The wide tile takes issue turns below 4096 keys: against it without them (session 19, same
  // process, unmasked, three calls) S = 512 +1.6% / +3.5% / +5.7% (bf16 / fp16 / bf16), 1k +1.4%
  // to +2.6%, 2k +0.7% to +1.0%, 4k -0.8% to +0.6%, 16k -0.8% to -1.7%: short key loops gain
  // from one consumer's GEMMs running under another's softmax, long ones lose the turns' waits.
  using Wide = ForwardTraits<Element, 64, 128, 4, 3, /*kPingPong=*/false>;       // 2*24 + 4*32 + 24 KiB
  using WideTurns = ForwardTraits<Element, 64, 128, 4, 3, /*kPingPong=*/true>;   // the same
  using Narrow = ForwardTraits<Element, 64, 128, 4, 2, /*kPingPong=*/false>;     // 2*16 + 4*32 + 16 KiB
  using SplitTile = Narrow;  // split-KV kernels (dispatch_split)
  using DropoutTile = Narrow;  // dropout kernels (dispatch_dropout)
  template <class Launch>
  static Status dispatch(const forward_params_t& p, Launch&& launch) {
    if (reads_page_boxes(p)) return launch(TileChoice<WithPageBoxes<Narrow>>{});
    // One query tile per head whatever the tile: the narrow one computes fewer padded rows (H200,
    // session 35: MHA 32 x 16 heads x 2048 keys, 1-16 queries, 3.0 TB/s of K+V against 2.5 wide).
    const bool one_narrow_tile = p.seqlen_q <= Narrow::kBlockM;
    const int64_t block_m =
        one_narrow_tile || (p.has_mask() && p.seqlen_k < kLongSeqlen) ? Narrow::kBlockM : Wide::kBlockM;
    if (pack_gqa_chosen(p, block_m, Narrow::kBlockM)) return launch(TileChoice<WithPackedGqa<Narrow>>{});
    if (one_narrow_tile) return launch(TileChoice<Narrow>{});
    if (p.seqlen_k >= kLongSeqlen) return launch(TileChoice<Wide>{});
    // Heads whose keys fit the ring (S <= 512) may run whole, on the tile they would take anyway.
    if (p.has_mask()) {
      if (whole_heads_chosen(p, Narrow::kBlockM, Narrow::kBlockN, Narrow::kStages)) {
        return launch(TileChoice<WithWholeHeads<Narrow>>{});
      }
      return launch(TileChoice<Narrow>{});
    }
    if (whole_heads_chosen(p, WideTurns::kBlockM, WideTurns::kBlockN, WideTurns::kStages)) {
      return launch(TileChoice<WithWholeHeads<WideTurns>>{});
    }
    return launch(TileChoice<WideTurns>{});
  }
};
template <typename Element>
struct ForwardConfigs<Element, 128> {
  // Long calls without a mask: three consumers (192-row tiles, 160 registers each) on 80-key
  // tiles (S and P of 80 keys fit beside O in 160 registers). A third warpgroup's GEMMs fill the
  // tensor cores while the other two are in their softmax, where two consumers leave them idle
  // about a third of a key block (the S = 512 trace, docs/PERF.md session 19). Against the
  // two-consumer tile, same process: d128 full 16k +3% to +5% (bf16, three calls) and +6% (fp16),
  // 8k +1.5% to +3.8%, 4k -0.5% to +1.4%, 2k -0.5%, 1k -8%, 512 -13% (192-row tiles pad short
  // heads, and short loops pay a tile boundary every few blocks); causal calls lost 2-34% (pairs
  // of 192-row blocks balance worse), so masked calls keep the narrow tile.
  using Wide = ForwardTraits<Element, 128, 80, 2, 3>;    // 2*48 + 2*2*20 + 48 (O) KiB
  using Narrow = ForwardTraits<Element, 128, 128, 2>;  // 2*32 + 2*64 + 32 KiB
  using SplitTile = Narrow;  // split-KV kernels (dispatch_split)
  using DropoutTile = Narrow;  // dropout kernels (dispatch_dropout)
  template <class Launch>
  static Status dispatch(const forward_params_t& p, Launch&& launch) {
    if (reads_page_boxes(p)) return launch(TileChoice<WithPageBoxes<Narrow>>{});
    if (pack_gqa_chosen(p, Narrow::kBlockM, Narrow::kBlockM)) return launch(TileChoice<WithPackedGqa<Narrow>>{});
    if (cluster_pair_chosen(p, Narrow::kBlockM)) return launch(TileChoice<WithClusterPair<Narrow>>{});
    const bool long_unmasked = !p.has_mask() && p.seqlen_q >= kLongSeqlen && p.seqlen_k >= kLongSeqlen;
    // Paged K/V in place with several pages a sequence: pages hold whole 128-key blocks, not 80.
    const bool pages_of_128 = p.is_paged() && p.pages.per_seq > 1;
    return long_unmasked && !pages_of_128 ? launch(TileChoice<Wide>{}) : launch(TileChoice<Narrow>{});
  }
};
template <typename Element>
struct ForwardConfigs<Element, 256> {
  using Tile = ForwardTraits<Element, 256, 64, 2>;  // 64 + 2*64 + 2*16 (O) KiB
  using SplitTile = Tile;  // split-KV kernels (dispatch_split)
  using DropoutTile = Tile;  // dropout kernels (dispatch_dropout)
  template <class Launch>
  static Status dispatch(const forward_params_t& p, Launch&& launch) {
    if (pack_gqa_chosen(p, Tile::kBlockM, Tile::kBlockM)) return launch(TileChoice<WithPackedGqa<Tile>>{});
    if (cluster_pair_chosen(p, Tile::kBlockM)) return launch(TileChoice<WithClusterPair<Tile>>{});
    return launch(TileChoice<Tile>{});
  }
};

using cuda::ScoreScales;  // how raw scores become the log2-domain exponent (as in sm80)
using cuda::ScoreTransform;
using cuda::ScopedDevice;

struct ForwardKernelArgs {
  CUtensorMap map_q, map_k, map_v, map_o;  // first: 64-byte aligned members
  AttentionParams params;
  bool store_o_with_tma;  // the traits stage O and `out` is TMA-addressable (map_o is valid)
  bool prefetch_first_tile;  // warm L2 with the first tile before the wait (prefetch_first_tile)
  // Paged K/V in pages smaller than a key block: a block is kv_boxes TMA boxes of one page each
  // (kv_box_rows = page_size keys). 1 otherwise: one box of kBlockN rows per 64 columns.
  int kv_boxes;
  int kv_box_rows;
  int pack_shift;      // pack-GQA kernels: log2 of the GQA group (packed rows per token)
  int num_m_blocks;
  int tiles_per_item;  // 2: pairs of query blocks (see TileWalker); 1: single blocks
  int num_items;       // ceil(num_m_blocks / tiles_per_item) * heads_q * batch (* num_splits)
  // Split-KV kernels: item i is split i / split_items.divisor of its tile's key blocks; the
  // partials go to part_o (splits, batch, seqlen_q, heads_q, head_dim) and part_lse (splits, batch,
  // heads_q, seqlen_q), fp32 (store_partial).
  int num_splits;
  FastDivmod split_items;  // the items of one split
  float* part_o;
  float* part_lse;
  // The tile walk's divisors (TileWalker, resolve_block), fixed per launch.
  FastDivmod items_per_head;  // ceil(num_m_blocks / tiles_per_item)
  FastDivmod heads_q;  // the heads the tiles walk: heads_kv in pack-GQA kernels
  FastDivmod group;  // heads_q / heads_kv
  ScoreTransform transform;
  float exp2_scale;  // factor of the (transformed) score in the exponent
  float pre_scale;   // kLinear / kSoftcap
  float post_scale;  // kSoftcap
  // Pair items from tail.first_item on run as single tiles in order of falling cost, dealt in
  // snake order (tile_tail.hpp); last, so that the fields above keep their alignment (ptxas
  // vectorizes parameter loads by it).
  TileTail tail;
  int walk_end;          // items past the last: num_items, or the tail's last turn's end
  FastDivmod grid_turns;  // gridDim.x: an item's turn in the tail
};

/** Shared-memory tiles and barriers of one CTA: generic pointers for TMA destinations, .shared
 *  window addresses for wgmma descriptors. */
template <class T>
struct SmemPlan {
  uint8_t* base;   // 1024-aligned
  uint32_t addr;   // its .shared window address
  uint64_t* bars;

  __device__ uint8_t* q_ptr(int q) const { return base + T::kQOffset + q * T::kQBytes; }
  __device__ uint8_t* k_ptr(int s) const { return base + T::kKOffset + s * T::kTileBytes; }
  __device__ uint8_t* v_ptr(int s) const { return base + T::kVOffset + s * T::kTileBytes; }
  __device__ uint8_t* o_ptr(int consumer) const {
    return base + T::kOOffset + consumer * T::kOBytesPerConsumer;
  }
  // The block-table entries of the key block the producer loads (request_block_pages).
  __device__ const int32_t* page_ids() const { return reinterpret_cast<const int32_t*>(base + T::kPageIdOffset); }
  __device__ uint32_t page_ids_addr() const { return addr + T::kPageIdOffset; }
  __device__ uint32_t q_addr(int q) const { return addr + T::kQOffset + q * T::kQBytes; }
  __device__ uint32_t k_addr(int s) const { return addr + T::kKOffset + s * T::kTileBytes; }
  __device__ uint32_t v_addr(int s) const { return addr + T::kVOffset + s * T::kTileBytes; }
  __device__ uint64_t* q_full(int q) const { return bars + q; }
  __device__ uint64_t* k_full(int s) const { return bars + T::kQStages + s; }
  __device__ uint64_t* v_full(int s) const { return bars + T::kQStages + T::kStages + s; }
  __device__ uint64_t* k_empty(int s) const { return bars + T::kQStages + 2 * T::kStages + s; }
  __device__ uint64_t* v_empty(int s) const { return bars + T::kQStages + 3 * T::kStages + s; }
  __device__ uint64_t* q_empty(int q) const { return bars + T::kQStages + 4 * T::kStages + q; }
  // A V fill with rows past its sequence completes here; zero_v_tails then arrives on v_full.
  __device__ uint64_t* v_loaded(int s) const { return bars + 2 * T::kQStages + 4 * T::kStages + s; }
};

/** The work of one CTA, resolved identically by every warpgroup. */
struct BlockWork {
  int64_t batch, head, kv_head, m0;  // pack-GQA kernels: head is the KV head, m0 a packed row
  int64_t rows;  // the sequence's query rows: seqlen_q, times the group in pack-GQA kernels
  SeqInfo seq;
  MaskInfo mask;
  int n_block_end;  // key blocks [n_block_end - n_tiles, n_block_end), visited downwards
  int n_tiles;
  int split;      // split-KV kernels: which range of the tile's key blocks (0 otherwise)
  bool has_rows;  // false: nothing to compute or store (both roles skip the tile)
  // Whole-head kernels (set by the walk): key blocks [0, keep_blocks) stay in the
  // ring for the head's next tile, which reads them in place (rewind: it loads nothing, and its
  // blocks are the last n_tiles fills).
  int keep_blocks;
  bool rewind;
  int64_t q_row0, k_row0, batch_coord;  // TMA coordinates
};

/** This CTA's rank in its cluster pair (cluster-pair kernels): the clusters are (2, 1, 1) on a
 *  one-dimensional grid, so it is blockIdx.x % 2, what %cluster_ctarank would read. */
__device__ __forceinline__ int pair_rank() { return static_cast<int>(blockIdx.x & 1u); }

/** The token of query row `row` (pack-GQA kernels: of packed row `row`), and the end of the tokens
 *  of rows [.., row_end): what the masks (MaskInfo) take. */
template <class T>
__device__ __forceinline__ int64_t token_of(const ForwardKernelArgs& args, int64_t row) {
  if constexpr (T::kPackGqa) {
    return row >> args.pack_shift;
  } else {
    return row;
  }
}
template <class T>
__device__ __forceinline__ int64_t token_end(const ForwardKernelArgs& args, int64_t row_end) {
  if constexpr (T::kPackGqa) {
    return ((row_end - 1) >> args.pack_shift) + 1;  // 0 for row_end 0: -1 >> s is -1
  } else {
    return row_end;
  }
}

/** The key blocks that hold keys [0, end): blocks [0, result). */
template <class T>
__device__ __forceinline__ int key_blocks_to(int64_t end) {
  return static_cast<int>((end + T::kBlockN - 1) / T::kBlockN);
}

template <class T>
__device__ BlockWork resolve_block(const ForwardKernelArgs& args, int m_block, int head,
                                   int batch, int split) {
  const AttentionParams& p = args.params;
  BlockWork w;
  w.head = head;
  w.batch = batch;
  w.kv_head = T::kPackGqa ? head : args.group.div(static_cast<uint32_t>(head));
  w.m0 = int64_t(m_block) * T::kBlockM;
  w.seq = seq_info(p, w.batch);
  w.mask = mask_info(p, w.seq);
  w.n_tiles = 0;
  w.n_block_end = 0;
  w.keep_blocks = 0;
  w.rewind = false;
  w.rows = T::kPackGqa ? w.seq.seqlen_q << args.pack_shift : w.seq.seqlen_q;
  w.has_rows = w.m0 < w.rows;  // varlen: a sequence shorter than max_seqlen_q
  if (w.has_rows) {
    // Cluster pairs walk the key blocks of both CTAs' rows (their query blocks 2i and 2i + 1), so
    // that the two walks load the same blocks; a block outside this CTA's own rows is all masked.
    const int64_t rows_begin = T::kClusterPair ? int64_t(m_block & ~1) * T::kBlockM : w.m0;
    const int64_t rows_span = int64_t(T::kClusterCtas) * T::kBlockM;
    const int64_t row_end = rows_begin + rows_span < w.rows ? rows_begin + rows_span : w.rows;
    const KeyRange keys = w.mask.keys_for_rows(token_of<T>(args, rows_begin), token_end<T>(args, row_end));
    if (!keys.empty()) {
      const int first = static_cast<int>(keys.begin / T::kBlockN);
      w.n_block_end = key_blocks_to<T>(keys.end);
      w.n_tiles = w.n_block_end - first;
      if constexpr (T::kSplitKv) {  // blocks [lo, hi) of this split, visited downwards as ever
        const int per = (w.n_tiles + args.num_splits - 1) / args.num_splits;
        const int lo = first + split * per;
        const int hi = lo + per < w.n_block_end ? lo + per : w.n_block_end;
        w.n_block_end = hi > lo ? hi : lo;
        w.n_tiles = hi > lo ? hi - lo : 0;
      }
    }
  }
  w.split = split;
  const bool varlen = p.cu_seqlens_q != nullptr;
  w.q_row0 = w.seq.q_start + token_of<T>(args, w.m0);  // pack-GQA kernels: a token (the maps are 5-D)
  w.k_row0 = w.seq.k_start;
  w.batch_coord = varlen ? 0 : w.batch;
  return w;
}

/** Where the TMA box of the tile's it-th key block starts in the K / V maps (blocks are visited
 *  downwards from n_block_end - 1: produce_kv, prefetch_first_tile): a row of the tensor and the
 *  batch coordinate, or, for paged K/V read in place, a slot of a page and the page (the maps'
 *  batch dimension; the launcher admits only pages that hold whole key blocks, or one page per
 *  sequence, so a box never spans two pages). Pages smaller than a block (the kPageBoxes kernels):
 *  the block's first column in the table as the row (request_block_pages). */
struct KeyBlockCoord {
  int32_t row, batch;
};
template <class T>
__device__ __forceinline__ KeyBlockCoord key_block_coord(const ForwardKernelArgs& args, const BlockWork& w, int it) {
  const int64_t key0 = int64_t(w.n_block_end - 1 - it) * T::kBlockN;
  if (!args.params.is_paged()) {
    return {static_cast<int32_t>(w.k_row0 + key0), static_cast<int32_t>(w.batch_coord)};
  }
  if (T::kPageBoxes && args.kv_boxes > 1) return {(w.n_block_end - 1 - it) * args.kv_boxes, 0};  // first column
  const PageSlot at = kv_page_slot(args.params, w.batch, key0);
  return {static_cast<int32_t>(at.slot), static_cast<int32_t>(at.page)};
}

/** Pages smaller than a key block (kv_boxes > 1, no first slot: forward_api.cu): requests the
 *  block-table entries of a key block whose first column is `first_column` (key_block_coord) into
 *  shared memory (`ids`, kv_boxes int32), box b's page in entry b; block_page reads them after the
 *  copies' wait. cp.async keeps them out of the producer's 24 registers (eight loads in flight
 *  into registers spilled 12-28 bytes there) and issues them together (one after another, each
 *  load's latency held up the next box: 344 against 499 TFLOP/s gathered at 16 keys). A column
 *  past the table reads its last entry, as kv_page_slot clamps it (its rows lie past the sequence:
 *  masked for K, zeroed for V, unless the lengths themselves are out of range). */
__device__ __forceinline__ void request_block_pages(const ForwardKernelArgs& args, uint32_t ids, int64_t batch,
                                                    int first_column) {
  const KvPages& pg = args.params.pages;
  const int32_t* row = pg.table + batch * pg.batch_stride;
  for (int box = 0; box < args.kv_boxes; ++box) {
    const int64_t c = first_column + box;
    const int64_t column = c < pg.per_seq ? c : pg.per_seq - 1;
    ptx::cp_async_4(ids + 4 * box, row + column * pg.page_stride);
  }
  ptx::cp_async_commit();
}

/** Box `box`'s page from the entries request_block_pages copied (after their wait), clamped into
 *  the pool as kv_page_slot clamps. */
__device__ __forceinline__ int32_t block_page(const ForwardKernelArgs& args, const int32_t* ids, int box) {
  const int32_t page = ids[box];
  const auto last = static_cast<int32_t>(args.params.pages.num_pages - 1);
  return page < 0 ? 0 : (page > last ? last : page);
}

/** Where a tile's output goes: what the epilogue needs of a BlockWork, compact enough to keep
 *  while the next tile's first key block runs (consume). */
struct TileOutput {
  int64_t m0, q_start, rows;  // rows: BlockWork::rows
  int32_t batch, head, q_row0, batch_coord;  // TMA coordinates are int32
  int32_t split;  // split-KV kernels
};

__device__ __forceinline__ TileOutput tile_output(const BlockWork& w) {
  return {w.m0, w.seq.q_start, w.rows, static_cast<int32_t>(w.batch), static_cast<int32_t>(w.head),
          static_cast<int32_t>(w.q_row0), static_cast<int32_t>(w.batch_coord), static_cast<int32_t>(w.split)};
}

/** The query head of a tile's row (pack-GQA kernels: of its packed row; out.head is the KV head). */
template <class T>
__device__ __forceinline__ int64_t head_of_row(const ForwardKernelArgs& args, const TileOutput& out, int64_t row) {
  if constexpr (T::kPackGqa) {
    return (int64_t(out.head) << args.pack_shift) + (row & ((int64_t(1) << args.pack_shift) - 1));
  } else {
    return out.head;
  }
}

/** Rows of the tile's first key block (its last keys, loaded first) that lie inside the sequence,
 *  when the rest must read as zeros: a packed varlen call's block that runs past its sequence,
 *  whose TMA box reads the rows after it (tail_rows.cuh says why they must be zeroed). kBlockN
 *  otherwise, including fixed-length calls, where TMA itself zero-fills past the map's seqlen. */
template <class T>
__device__ __forceinline__ int first_block_rows(const ForwardKernelArgs& args, const BlockWork& w) {
  if (args.params.cu_seqlens_q == nullptr || w.n_tiles == 0) return T::kBlockN;
  const int64_t key0 = int64_t(w.n_block_end - 1) * T::kBlockN;
  const int64_t inside = w.seq.seqlen_k - key0;
  return inside < T::kBlockN ? static_cast<int>(inside) : T::kBlockN;
}

/** Pipeline position carried across the tiles of a persistent CTA: how many Q tiles and K/V
 *  tiles went through their barriers so far (stage = count % kStages, parity = count / kStages). */
struct PipelineCounters {
  int q_fills = 0;
  int kv_fills = 0;
#ifdef FLASHCORE_SM90_FWD_TRACE
  int trace_events = 0;  // records this thread wrote (forward_trace.cuh)
#endif
};

/** The producer thread: Q of a tile into its slot. Q of the previous tile in that slot must be dead
 *  (every consumer warp past its last Q K^T). A fresh barrier counts as having completed the phase
 *  before phase 0, so the first wait passes. */
template <class T>
__device__ void produce_q(const ForwardKernelArgs& args, const SmemPlan<T>& sm, const BlockWork& w,
                          PipelineCounters& pc) {
  const int q_slot = pc.q_fills % T::kQStages;
  ptx::mbarrier_wait_parity(sm.q_empty(q_slot), ((pc.q_fills / T::kQStages) & 1) ^ 1);
  FWD_TRACE(0, kQSlotFree, 0);
  ++pc.q_fills;
  ptx::mbarrier_arrive_expect_tx(sm.q_full(q_slot), T::kQBytes);
#pragma unroll
  for (int c = 0; c < T::kChunks; ++c) {
    if constexpr (T::kPackGqa) {  // {64 columns, the group's heads, kBlockM / group tokens}
      ptx::tma_load_5d(sm.q_ptr(q_slot) + c * T::kQChunkBytes, &args.map_q, sm.q_full(q_slot),
                       c * T::kChunkCols, 0, static_cast<int32_t>(w.q_row0), static_cast<int32_t>(w.head),
                       static_cast<int32_t>(w.batch_coord));
    } else {
      ptx::tma_load_4d(sm.q_ptr(q_slot) + c * T::kQChunkBytes, &args.map_q, sm.q_full(q_slot),
                       c * T::kChunkCols, static_cast<int32_t>(w.q_row0), static_cast<int32_t>(w.head),
                       static_cast<int32_t>(w.batch_coord));
    }
  }
}

/** Online-softmax state of the two rows a consumer thread owns. */
struct RowState {
  float max[2];  // reference max per row, raw (or transformed) score units
  float sum[2];  // this thread's partial sum of P per row
};

/** ALiBi of the two rows a consumer thread owns (kScoreTransforms kernels only): the bias per key
 *  of distance, in log2 units (0: none), and each row's diagonal key i + seqlen_k - seqlen_q. */
struct AlibiRows {
  float log2 = 0.f;
  int64_t diagonal[2] = {0, 0};
};

/** Turns the fp32 scores of one tile into unnormalized probabilities in place, updating the row
 *  state; returns through `correction` the factor O must be multiplied by (0 <= c <= 1). */
template <class T, bool kMasked, bool kLeftHalf = false>
__device__ __forceinline__ void softmax_tile(float (&s)[T::kBlockN / 2], RowState& st,
                                             float (&correction)[2], const ForwardKernelArgs& args,
                                             const KeyRange (&rows)[2], int64_t key0, int quad,
                                             const AlibiRows& alibi) {
  // kLeftHalf: no stored row of this consumer sees the block's last kBlockN / 2 keys (see
  // ForwardTraits::kLeftHalfDiagonal): the softmax runs on the first half of s (the accumulator's
  // registers 0 .. kBlockN / 4 - 1 are exactly its first kBlockN / 2 columns) and sets P = 0 on
  // the other half, skipping its masks, maxima and exponentials.
  constexpr int kRegs = kLeftHalf ? T::kBlockN / 4 : T::kBlockN / 2;
  if (T::kScoreTransforms && args.transform != ScoreTransform::kFoldedScale) {
    // One branch around two loops: a select inside one loop computed tanhf (two MUFU operations)
    // for every score of the linear transform too, which ALiBi calls take (ALiBi forward d128
    // S = 2048 at 0.51x of the call without it).
    if (args.transform == ScoreTransform::kSoftcap) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) s[i] = args.post_scale * tanhf(s[i] * args.pre_scale);
    } else {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) s[i] *= args.pre_scale;
    }
    // ALiBi, on every key block (ALiBi calls never fold the scale, so they take these kernels):
    // distances from this thread's first column, whose register offsets are compile-time
    // constants, in float (exact below 2^24): an int-to-float conversion per score runs on the
    // same 16-per-clock unit as the exponentials, and made the ALiBi forward 2-4x slower.
    if (alibi.log2 != 0.f) {
      const int64_t first = key0 + 2 * quad;
      const float to_diagonal[2] = {static_cast<float>(alibi.diagonal[0] - first),
                                    static_cast<float>(alibi.diagonal[1] - first)};
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const float distance = to_diagonal[(i % 4) / 2] - static_cast<float>(8 * (i / 4) + (i % 2));
        s[i] = fmaf(alibi.log2, fabsf(distance), s[i]);
      }
    }
  }
  if constexpr (kMasked) {
    // Each row's allowed keys as offsets from this thread's first column (key0 + 2 quad), clamped
    // to [0, kBlockN]: the column offset of register i is a compile-time constant, so a score
    // costs two 32-bit compares with immediates and a select instead of 64-bit key arithmetic
    // (d64 causal +4% to +6% at S <= 2k, d128 causal +1% to +5%; session 10).
    const int64_t first = key0 + 2 * quad;
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lo[r] = static_cast<int>(std::min<int64_t>(std::max<int64_t>(rows[r].begin - first, 0), T::kBlockN));
      hi[r] = static_cast<int>(std::min<int64_t>(std::max<int64_t>(rows[r].end - first, 0), T::kBlockN));
    }
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int col = 8 * (i / 4) + (i % 2);
      const int r = (i % 4) / 2;
      if (col < lo[r] || col >= hi[r]) s[i] = -INFINITY;
    }
  }
  const float scale = args.exp2_scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = st.max[r];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      if ((i % 4) / 2 == r) mx = fmaxf(mx, s[i]);
    }
    mx = quad_allreduce_max(mx);
    // Keep the reference max while the row's max grew by at most the threshold: then P <= 2^thr
    // and O needs no rescale (correction exactly 1). -inf - -inf is NaN, which compares false, so
    // the first keys a row sees always move its max.
    if ((mx - st.max[r]) * scale <= float(T::kRescaleThresholdLog2)) mx = st.max[r];
    // A row that has seen only masked keys keeps max -inf and subtracts 0 (no -inf - -inf).
    const float base = mx == -INFINITY ? 0.f : mx * scale;
    // exp2(-inf) = 0 when the row's first keys arrive (O and the sum are still zero then).
    correction[r] = mx == st.max[r] ? 1.f : fast_exp2(st.max[r] * scale - base);
    st.max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      if ((i % 4) / 2 == r) {
        s[i] = fast_exp2(fmaf(s[i], scale, -base));
        sum += s[i];
      }
    }
    st.sum[r] = st.sum[r] * correction[r] + sum;
  }
  if constexpr (kLeftHalf) {
#pragma unroll
    for (int i = kRegs; i < T::kBlockN / 2; ++i) s[i] = 0.f;
  }
}

/** P (fp32 accumulator layout) rounded to 16 bits as the RS A fragments of the P V product. */
template <class T>
__device__ __forceinline__ void pack_probabilities(const float (&s)[T::kBlockN / 2],
                                                   uint32_t (&pa)[T::kBlockN / 16][4]) {
  using Ops = ElementOps<typename T::Element>;
#pragma unroll
  for (int k = 0; k < T::kBlockN / 16; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[k][r] = Ops::pack(s[8 * k + 2 * r], s[8 * k + 2 * r + 1]);
  }
}

/** This consumer's 64 rows of Q as RS A fragments, one per k-slice of 16 columns (kQInRegisters):
 *  ldmatrix.x4 per slice, lane l addressing row l % 16 of its warp's 16 at column 8 (l / 16), so
 *  that the four 8x8 matrices land in the A layout's a[0..3] (wgmma.cuh). Q rows are 128-byte
 *  swizzled, so the 8 rows of each matrix hit 8 different 16-byte bank groups. */
template <class T>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[T::kQSlices][4], const SmemPlan<T>& sm,
                                                 int consumer, int q_slot) {
  constexpr ptx::KMajorTile kQTile{ptx::SmemSwizzle::k128B, T::kBlockM, T::kHeadDim};
  const uint32_t t = ptx::thread_in_warpgroup(), lane = t % 32;
  const uint32_t row = consumer * T::kRowsPerConsumer + (t / 32) * 16 + lane % 16;
#pragma unroll
  for (int k = 0; k < T::kHeadDim / 16; ++k)
    ptx::ldmatrix_x4(qa[k], sm.q_addr(q_slot) + kQTile.byte_offset(row, 16 * k + 8 * (lane / 16)));
}

template <class T>
__device__ __forceinline__ void issue_qk(float (&s)[T::kBlockN / 2], const SmemPlan<T>& sm,
                                         const uint32_t (&qa)[T::kQSlices][4], int consumer,
                                         int q_slot, int stage) {
  constexpr ptx::KMajorTile kQTile{ptx::SmemSwizzle::k128B, T::kBlockM, T::kHeadDim};
  constexpr ptx::KMajorTile kKTile{ptx::SmemSwizzle::k128B, T::kBlockN, T::kHeadDim};
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < T::kHeadDim / 16; ++k) {
    if constexpr (T::kQInRegisters) {
      ptx::wgmma_rs<T::kBlockN, typename T::Element, /*kTransB=*/0>(
          s, qa[k], kKTile.desc(sm.k_addr(stage), 0, 16 * k), k > 0);
    } else {
      ptx::wgmma_ss<T::kBlockN, typename T::Element>(
          s, kQTile.desc(sm.q_addr(q_slot), consumer * T::kRowsPerConsumer, 16 * k),
          kKTile.desc(sm.k_addr(stage), 0, 16 * k), k > 0);
    }
  }
  ptx::wgmma_commit_group();
}

template <class T>
__device__ __forceinline__ void issue_pv(float (&o)[T::kHeadDim / 2],
                                         const uint32_t (&pa)[T::kBlockN / 16][4],
                                         const SmemPlan<T>& sm, int stage) {
  constexpr ptx::MnMajorTile kVTile{ptx::SmemSwizzle::k128B, T::kHeadDim, T::kBlockN};
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < T::kBlockN / 16; ++k) {
    ptx::wgmma_rs<T::kHeadDim, typename T::Element, /*kTransB=*/1>(
        o, pa[k], kVTile.desc(sm.v_addr(stage), 0, 16 * k), true);
  }
  ptx::wgmma_commit_group();
}

/** One warp's arrival on an "empty" barrier once its wgmmas reading the buffer completed. */
__device__ __forceinline__ void release(uint64_t* bar) {
  if ((threadIdx.x & 31) == 0) ptx::mbarrier_arrive(bar);
}

/** The same for a K or V stage. Cluster pairs: on both CTAs' barriers, since either CTA's
 *  producer writes the stage in both (the barriers count both CTAs' consumer warps). */
template <class T>
__device__ __forceinline__ void release_kv(uint64_t* bar) {
  if ((threadIdx.x & 31) == 0) {
    ptx::mbarrier_arrive(bar);
    if constexpr (T::kClusterPair) {
      const auto peer = static_cast<uint32_t>(pair_rank() ^ 1);
      ptx::mbarrier_arrive_cluster(ptx::peer_shared_addr(ptx::smem_addr(bar), peer));
    }
  }
}

/** Ping-pong between the consumer warpgroups: they take turns issuing their wgmmas (named barrier
 *  1 + c is consumer c's turn; it waits there, issues, and passes the turn to the next one), so
 *  one warpgroup's GEMMs run on the tensor cores while the other does its softmax instead of the
 *  two contending for both at once. Every consumer issues at the same points (both walk the
 *  same tiles and key blocks), so the turns stay in step across tiles; the last pass of the
 *  kernel is left pending at exit, which no one waits for. */
template <class T>
struct IssueTurn {
  int consumer;
  static constexpr uint32_t kThreads = 2 * T::kWarpgroupThreads;  // the taker + the passer
  __device__ void take() const {
    if constexpr (T::kPingPong) ptx::named_barrier_sync(1 + consumer, kThreads);
  }
  __device__ void pass() const {
    if constexpr (T::kPingPong) {
      ptx::named_barrier_arrive(1 + (consumer + 1) % T::kConsumers, kThreads);
    }
  }
  /** Before the first take: the last consumer hands the first turn to consumer 0. */
  __device__ void start() const {
    if constexpr (T::kPingPong) {
      if (consumer == T::kConsumers - 1) ptx::named_barrier_arrive(1, kThreads);
    }
  }
};

/** Named barrier of one consumer warpgroup's epilogue (ids 1..kConsumers are the issue turns). */
template <class T>
__device__ __forceinline__ void epilogue_barrier(int consumer) {
  ptx::named_barrier_sync(1 + T::kConsumers + consumer, T::kWarpgroupThreads);
}

/** The factor of a row's O in the epilogue: 1 / l, 0 for a row that saw no key. Dropout kernels:
 *  O = (sum_j P_j Z_j v_j) / l with Z_j = keep_scale on kept entries (drop_probabilities left P_j
 *  or 0), so keep_scale joins 1 / l; l and the lse saw every P_j. */
template <class T>
__device__ __forceinline__ float inverse_sum(const ForwardKernelArgs& args, float sum) {
  if constexpr (T::kDropout) {
    return sum > 0.f ? args.params.dropout.keep_scale / sum : 0.f;
  } else {
    return sum > 0.f ? 1.f / sum : 0.f;
  }
}

/** The staged epilogue of one consumer: O / l rounded to 16 bits into its shared-memory box
 *  ([64 rows][128 bytes] per 64-column chunk, 128-byte swizzle: ptx::swizzled_box_offset), with
 *  one stmatrix per 16 x 16 block (a quarter of the store instructions of 4-byte st.shared: d256
 *  S = 512 / 1k +1% to +4%, d64 / d128 -1% to +4%, docs/PERF.md session 21), then
 *  one TMA store per chunk by thread 0; kOChunksStaged chunks per round where the box holds fewer than all of them
 *  (d256). The buffer is reused (by the next round or tile) only after that thread has seen the
 *  previous stores finish reading it (bulk async-group), which the round's first barrier publishes.
 *  d256 against its register stores (4-byte stores, 8 rows x 16 bytes per warp instruction, which
 *  took ~6000 cycles of a 35000-cycle tile at S = 512 in session 14's trace): docs/PERF.md. */
template <class T>
__device__ __forceinline__ void store_o_staged(const ForwardKernelArgs& args, const SmemPlan<T>& sm,
                                               const TileOutput& out, int consumer,
                                               const float (&o)[T::kHeadDim / 2],
                                               const float (&sums)[2], int t,
                                               [[maybe_unused]] PipelineCounters& pc) {
  using Ops = ElementOps<typename T::Element>;
  const int warp = t / 32;
  uint8_t* buf = sm.o_ptr(consumer);
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = inverse_sum<T>(args, sums[r]);
  // stmatrix: lane l supplies the row address of matrix m = l / 8 of each 16 x 16 block, which is
  // (column group j + m / 2, row half m % 2).
  const int lane = t % 32, m = lane / 8;
  const int row = warp * 16 + lane % 8 + 8 * (m % 2);
  const uint32_t buf_addr = ptx::smem_addr(buf);
#pragma unroll
  for (int c0 = 0; c0 < T::kChunks; c0 += T::kOChunksStaged) {
    if (t == 0) ptx::tma_store_wait_group_read<0>();
    epilogue_barrier<T>(consumer);
#pragma unroll
    for (int j = 8 * c0; j < 8 * (c0 + T::kOChunksStaged); j += 2) {
      uint32_t frag[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = 4 * (j + q / 2) + 2 * (q % 2);
        frag[q] = Ops::pack(o[i] * inv[q % 2], o[i + 1] * inv[q % 2]);
      }
      const int jj = j + m / 2;
      ptx::stmatrix_x4(buf_addr + ptx::swizzled_box_offset(T::kRowsPerConsumer, jj / 8 - c0, row, jj % 8, 0), frag);
    }
    ptx::fence_proxy_async_shared_cta();  // make the generic-proxy writes visible to TMA
    FWD_TRACE(1 + consumer, kEpilogueStaged, 0);
    epilogue_barrier<T>(consumer);
    if (t == 0) {
      const int32_t row0 =
          static_cast<int32_t>(out.q_row0 + token_of<T>(args, int64_t(consumer) * T::kRowsPerConsumer));
#pragma unroll
      for (int c = c0; c < c0 + T::kOChunksStaged; ++c) {
        if constexpr (T::kPackGqa) {
          ptx::tma_store_5d(&args.map_o, buf + (c - c0) * T::kOChunkBytes, c * T::kChunkCols, 0, row0, out.head,
                            out.batch_coord);
        } else {
          ptx::tma_store_4d(&args.map_o, buf + (c - c0) * T::kOChunkBytes, c * T::kChunkCols, row0,
                            out.head, out.batch_coord);
        }
      }
      ptx::tma_store_commit_group();
    }
  }
}

/** The natural-log lse of a row from its running max (raw score units) and its sum; -inf for a
 *  row that saw no key. */
__device__ __forceinline__ float row_lse(const ForwardKernelArgs& args, float max, float sum) {
  return sum > 0.f ? (max * args.exp2_scale + sm80::log2_positive(sum)) * kLn2 : -INFINITY;
}

/** The split-KV epilogue of one consumer's 64 rows: O / l and the lse of this split's key range,
 *  fp32, into the workspace (ForwardKernelArgs::part_o / part_lse, indexed by sequence and token
 *  as the merge reads them); 8-byte stores of column pairs. A range without keys gives O = 0 and
 *  lse = -inf, which the merge skips. */
template <class T>
__device__ __forceinline__ void store_partial(const ForwardKernelArgs& args, const TileOutput& out, int consumer,
                                              const float (&o)[T::kHeadDim / 2], const RowState& st,
                                              const float (&sums)[2], int t) {
  const AttentionParams& p = args.params;
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int64_t row_base = out.m0 + consumer * T::kRowsPerConsumer + warp * 16 + group;
  if constexpr (T::kHeadDim > 128) {
    // d256: both rows' destinations and scales first, then one pass over the columns. Row by row,
    // the unpacked kernels spilled 132 bytes; this order has none and reads 3.87 against 3.64 TB/s
    // (H200, MHA 1 x 32 x 32768, docs/PERF.md session 39). At d64 the same order read 2.20 against
    // 2.66 (same process), so the smaller buckets keep the row-by-row loop below.
    const int64_t seq = int64_t(out.split) * p.batch + out.batch;
    float* dst[2];
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row_base + 8 * r;
      const int64_t token = token_of<T>(args, row), head = head_of_row<T>(args, out, row);
      dst[r] = row < out.rows ? args.part_o + ((seq * p.seqlen_q + token) * p.heads_q + head) * p.head_dim : nullptr;
      inv[r] = inverse_sum<T>(args, sums[r]);
      if (dst[r] != nullptr && quad == 0)
        args.part_lse[(seq * p.heads_q + head) * p.seqlen_q + token] = row_lse(args, st.max[r], sums[r]);
    }
#pragma unroll
    for (int j = 0; j < T::kHeadDim / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      if (col >= p.head_dim) continue;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (dst[r] != nullptr)
          *reinterpret_cast<float2*>(dst[r] + col) =
              make_float2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row_base + 8 * r;
      if (row >= out.rows) continue;
      const int64_t token = token_of<T>(args, row), head = head_of_row<T>(args, out, row);
      const int64_t seq = int64_t(out.split) * p.batch + out.batch;
      float* dst = args.part_o + ((seq * p.seqlen_q + token) * p.heads_q + head) * p.head_dim;
      const float inv = inverse_sum<T>(args, sums[r]);
#pragma unroll
      for (int j = 0; j < T::kHeadDim / 8; ++j) {
        const int col = 8 * j + 2 * quad;
        if (col < p.head_dim)
          *reinterpret_cast<float2*>(dst + col) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      }
      if (quad == 0) args.part_lse[(seq * p.heads_q + head) * p.seqlen_q + token] = row_lse(args, st.max[r], sums[r]);
    }
  }
}

/** The epilogue of one consumer's 64 rows: O / l rounded to the dtype; lse from lane quad 0
 *  (split-KV kernels: store_partial). */
template <class T>
__device__ __forceinline__ void store_tile(const ForwardKernelArgs& args, const SmemPlan<T>& sm,
                                           const TileOutput& out, int consumer,
                                           const float (&o)[T::kHeadDim / 2], const RowState& st,
                                           [[maybe_unused]] PipelineCounters& pc) {
  const AttentionParams& p = args.params;
  const int t = static_cast<int>(ptx::thread_in_warpgroup());
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int64_t wg_row0 = out.m0 + consumer * T::kRowsPerConsumer;
  const int64_t row_base = wg_row0 + warp * 16 + group;
  using Ops = ElementOps<typename T::Element>;
  float sums[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) sums[r] = quad_allreduce_sum(st.sum[r]);
  FWD_TRACE(1 + consumer, kEpilogueEnter, 0);
  if constexpr (T::kSplitKv) {
    store_partial<T>(args, out, consumer, o, st, sums, t);
    return;
  }
  // Staged: this consumer's 64 rows go to shared memory (the swizzled layout of a TMA box) and one
  // thread stores them with TMA, which clips rows past the tensor's end (dense) and columns past
  // head_dim. A varlen block that reaches past its sequence would overwrite the next sequence's
  // rows, so it takes the direct path.
  bool staged = false;
  if constexpr (T::kStageO) {
    staged = args.store_o_with_tma &&
             (p.cu_seqlens_q == nullptr || wg_row0 + T::kRowsPerConsumer <= out.rows);
  }
  if (staged) {
    store_o_staged<T>(args, sm, out, consumer, o, sums, t, pc);
  } else {
    // Direct: 4-byte stores of column pairs, row by row.
    auto* dst_base = static_cast<typename T::Element*>(p.out.data);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float inv = inverse_sum<T>(args, sums[r]);
      const int64_t row = row_base + 8 * r;
      if (row >= out.rows) continue;
      typename T::Element* dst =
          dst_base + offset_of(p.out, out.batch, out.q_start + token_of<T>(args, row), head_of_row<T>(args, out, row));
#pragma unroll
      for (int j = 0; j < T::kHeadDim / 8; ++j) {
        const int col = 8 * j + 2 * quad;
        if (col < p.head_dim) {
          const uint32_t packed = Ops::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
          *reinterpret_cast<uint32_t*>(dst + col) = packed;
        }
      }
    }
  }
  if (p.lse.data != nullptr && quad == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row_base + 8 * r;
      if (row >= out.rows) continue;
      const float lse = row_lse(args, st.max[r], sums[r]);
      p.lse.data[out.batch * p.lse.batch_stride + head_of_row<T>(args, out, row) * p.lse.head_stride +
                 (out.q_start + token_of<T>(args, row)) * p.lse.row_stride] = lse;
    }
  }
}

/** The tiles of this persistent CTA, in order, as both roles must see them. Work item i (CTAs
 *  take items blockIdx.x, blockIdx.x + gridDim.x, ...) is a pair of query blocks of one head:
 *  the (M-1-j)-th and the j-th of its M blocks (or just the (M-1-j)-th when tiles_per_item is 1:
 *  masks whose cost does not vary along the query blocks, and problems too small to fill the GPU
 *  with pairs). Under a causal mask block m costs m + 1 key blocks, so every pair costs about the
 *  same (M + 1) and a static round-robin keeps the SMs evenly busy up to the last round, where
 *  items % gridDim.x CTAs take one pair more than the rest. Items run head after head, so the CTAs
 *  working at one time share K/V through L2. Pair items from args.tail.first_item on (a whole
 *  number of rounds after the start) run as the tail's single tiles instead, heaviest first, dealt
 *  in snake order (tile_tail.hpp), which evens out the CTAs' ends. Tiles without query rows
 *  (varlen) are skipped by both roles alike. Cluster-pair kernels walk the same pairs over blocks
 *  of 2 kBlockM rows, one item per cluster (no tail): rank r of the cluster takes query block
 *  2 m + r of the pair's block m. */
template <class T>
struct TileWalker {
  const ForwardKernelArgs& args;
  int item = static_cast<int>(blockIdx.x) / T::kClusterCtas;
  int k = 0;  // next tile of the item

  /** The next tile with query rows, or false when this CTA has none left. A turn of the tail
   *  enters the pairs' code as a virtual item (its tile's pair and half) with one tile: only data
   *  differs between the two, since a second path to resolve_block made ptxas copy the consumer's
   *  softmax with divergent-path guards (+1700-2300 instructions a kernel, and spills in the
   *  160-register consumers). */
  __device__ bool next(BlockWork& w) {
    if constexpr (T::kWholeHead) {
      return next_whole_head(w);
    } else {
      return next_pair(w);
    }
  }

  /** Whole-head kernels: item = (batch, head), and its tile k is query block M - 1 - k. */
  __device__ bool next_whole_head(BlockWork& w) {
    while (item < args.walk_end) {
      if (k < args.num_m_blocks) {
        const int m_block = args.num_m_blocks - 1 - k;
        const uint32_t rest = static_cast<uint32_t>(item);
        w = resolve_block<T>(args, m_block, static_cast<int>(args.heads_q.mod(rest)),
                             static_cast<int>(args.heads_q.div(rest)), 0);
        // The head's first tile loads every block; the next tile, one query block lower, sees
        // keys up to block keep_blocks only, so the blocks from there up are done after this one.
        w.rewind = k > 0;
        if (m_block > 0) {
          const KeyRange next_keys = w.mask.keys_for_rows(w.m0 - T::kBlockM, w.m0);
          w.keep_blocks = next_keys.empty() ? 0 : key_blocks_to<T>(next_keys.end);
        }
        ++k;
        return true;  // fixed length: every tile has rows
      }
      k = 0;
      item += static_cast<int>(gridDim.x);
    }
    return false;
  }

  /** The other kernels: pairs of query blocks, the tail's single tiles, cluster pairs. */
  __device__ bool next_pair(BlockWork& w) {
    const int m_blocks = args.num_m_blocks / T::kClusterCtas;  // cluster pairs: an even number
    while (item < args.walk_end) {
      // Split-KV kernels: the splits are the outermost index of the items.
      uint32_t tile_item = static_cast<uint32_t>(item);
      int split = 0;
      if constexpr (T::kSplitKv) {
        split = static_cast<int>(args.split_items.div(tile_item));
        tile_item = args.split_items.mod(tile_item);
      }
      int half = k;  // 0: block M - 1 - j of the pair j, 1: block j
      bool more = k < args.tiles_per_item;
      if (item >= args.tail.first_item) {
        // Turn `turn` of this CTA in the tail (first_item is a multiple of the grid).
        const uint32_t turn = args.grid_turns.div(static_cast<uint32_t>(item - args.tail.first_item));
        const int rank = tail_rank(static_cast<int>(turn * gridDim.x), (turn & 1u) != 0,
                                   static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
        const TailTile t = tail_tile(args.tail, static_cast<uint32_t>(rank < args.tail.tiles ? rank : 0));
        const PairHalf at = pair_half_of(t.m_block, m_blocks);
        tile_item = static_cast<uint32_t>(t.rest) * args.items_per_head.divisor + static_cast<uint32_t>(at.pair);
        half = at.half;
        more = k == 0 && rank < args.tail.tiles;
      }
      const int j = static_cast<int>(args.items_per_head.mod(tile_item));
      const int m_block = half == 0 ? m_blocks - 1 - j : j;
      // Half 1 of an odd M's middle item repeats half 0: the item is done.
      const bool valid = more && !(half == 1 && m_block == m_blocks - 1 - j);
      if (valid) {
        ++k;
        const uint32_t rest = args.items_per_head.div(tile_item);
        const int head = static_cast<int>(args.heads_q.mod(rest));
        const int batch = static_cast<int>(args.heads_q.div(rest));
        const int cta_block = T::kClusterPair ? 2 * m_block + pair_rank() : m_block;
        w = resolve_block<T>(args, cta_block, head, batch, split);
        if (w.has_rows) return true;
        continue;
      }
      k = 0;
      item += static_cast<int>(gridDim.x) / T::kClusterCtas;
    }
    return false;
  }
};

/** How many of the tile's first key blocks (the walk runs downwards from n_block_end - 1) lie past
 *  every key of rows [row_begin, row_end): all of them where those rows see no key. */
template <class T>
__device__ __forceinline__ int blocks_past_keys_of_rows(const ForwardKernelArgs& args, const BlockWork& w,
                                                        int64_t row_begin, int64_t row_end) {
  if (w.n_tiles == 0) return 0;
  const KeyRange keys = w.mask.keys_for_rows(token_of<T>(args, row_begin), token_end<T>(args, row_end));
  if (keys.empty()) return w.n_tiles;
  const int past = w.n_block_end - key_blocks_to<T>(keys.end);
  return past <= 0 ? 0 : (past < w.n_tiles ? past : w.n_tiles);
}

/** Cluster pairs: how many of the tile's first key blocks (the walk runs downwards from
 *  n_block_end - 1) lie past every key of this CTA's own rows. Those blocks are in the walk for
 *  the peer's rows (resolve_block walks both CTAs' keys) and all masked here: under a causal
 *  mask rank 0's kBlockM / kBlockN blocks above its diagonal, all of them where its rows see no
 *  key. Rank 1 counts 0, and so does a window bounded on the left only, whose extra blocks come
 *  last in rank 1's walk and are computed (masked) as before. */
template <class T>
__device__ __forceinline__ int pair_blocks_past_own_keys(const ForwardKernelArgs& args, const BlockWork& w) {
  const int64_t own_end = w.m0 + T::kBlockM < w.rows ? w.m0 + T::kBlockM : w.rows;
  return blocks_past_keys_of_rows<T>(args, w, w.m0, own_end);
}

/** One consumer warpgroup over all of its CTA's tiles, with the last P V of a tile carried into
 *  the next: it is issued together with the next tile's first Q K^T, and the epilogue runs after
 *  that tile's first softmax, so the tensor cores see Q K^T_0 queued behind P V_last instead of a
 *  drain, epilogue and refill at every tile boundary. */
template <class T>
__device__ void consume(const ForwardKernelArgs& args, const SmemPlan<T>& sm, int consumer,
                        PipelineCounters& pc, const IssueTurn<T>& turn) {
  const int t = static_cast<int>(ptx::thread_in_warpgroup());
  const int warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  [[maybe_unused]] const int role = 1 + consumer;  // trace role
  float o[T::kHeadDim / 2];
  float s[T::kBlockN / 2];
  uint32_t pa[T::kBlockN / 16][4];
  uint32_t qa[T::kQSlices][4];  // Q's A fragments (kQInRegisters)
  float correction[2];
  // The previous tile while its last P V is still to be issued: where its output goes and its row
  // state. That P V reads the V of the last K/V fill consumed so far, pc.kv_fills - 1.
  bool pending = false;
  TileOutput pending_out{};
  RowState pending_st{};
  // Whole heads: whether that V block is done once its P V completed (no later tile of the head
  // reads it); every other kernel hands each block back after its one use.
  [[maybe_unused]] bool pending_release = true;

  auto finish_pending = [&]() {
    const int pending_fill = pc.kv_fills - 1;
    const int stage = pending_fill % T::kStages;
    ptx::mbarrier_wait_parity(sm.v_full(stage), (pending_fill / T::kStages) & 1);
    turn.take();
    issue_pv<T>(o, pa, sm, stage);
    turn.pass();
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(o);
    if (!T::kWholeHead || pending_release) release_kv<T>(sm.v_empty(stage));
    store_tile<T>(args, sm, pending_out, consumer, o, pending_st, pc);
    FWD_TRACE(role, kEpilogueDone, 0);
    pending = false;
  };
  // Where the tile drains its carried P V (no key block, blocks skipped before the first computed
  // one, the end): a consumer with nothing pending takes that turn too, since an idle consumer's
  // tile (below) leaves it without a P V that the others carry, and every consumer must take as
  // many turns.
  auto drain = [&]() {
    if (pending) {
      finish_pending();
    } else {
      turn.take();
      turn.pass();
    }
  };

  // A key block this consumer does not compute (a cluster pair's blocks for the peer, blocks past
  // its rows' keys, an idle consumer's tile): wait until it landed, take the block's issue turn
  // where the others issue in turns (take_turn), then hand it back unless the item keeps it.
  auto pass_over_block = [&](bool hand_back, bool take_turn) {
    const int slot = pc.kv_fills % T::kStages;
    const uint32_t parity = (pc.kv_fills / T::kStages) & 1;
    ptx::mbarrier_wait_parity(sm.k_full(slot), parity);
    if (take_turn) {
      turn.take();
      turn.pass();
    }
    if (hand_back) release_kv<T>(sm.k_empty(slot));
    ptx::mbarrier_wait_parity(sm.v_full(slot), parity);
    if (hand_back) release_kv<T>(sm.v_empty(slot));
    ++pc.kv_fills;
  };

  TileWalker<T> tiles{args};
  BlockWork w;
  while (tiles.next(w)) {
    FWD_TRACE(role, kTileBegin, 0);
    const int64_t row_base = w.m0 + consumer * T::kRowsPerConsumer + warp * 16 + group;
    KeyRange rows[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) rows[r] = w.mask.keys_for_row(token_of<T>(args, row_base + 8 * r));
    AlibiRows alibi;
    if constexpr (T::kScoreTransforms && !T::kPackGqa) {
      if (args.params.alibi_slopes != nullptr) {
        alibi.log2 = -args.params.alibi_slope(w.batch, w.head) * kLog2e;
#pragma unroll
        for (int r = 0; r < 2; ++r) alibi.diagonal[r] = row_base + 8 * r + w.seq.seqlen_k - w.seq.seqlen_q;
      }
    }
    // Dropout's counter words of this thread's two rows: the row's token and b * heads_q + its
    // query head (pack-GQA kernels: each packed row's own; rows past seqlen_q draw too, unstored).
    [[maybe_unused]] DropoutRows drop_rows{};
    if constexpr (T::kDropout) {
      const TileOutput here = tile_output(w);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = row_base + 8 * r;
        drop_rows.row[r] = static_cast<uint32_t>(token_of<T>(args, row));
        drop_rows.bh[r] = static_cast<uint32_t>(w.batch) * static_cast<uint32_t>(args.params.heads_q) +
                          static_cast<uint32_t>(head_of_row<T>(args, here, row));
      }
    }
    // After a key block's softmax (its row sums took every probability): its dropped entries of P
    // become 0 before pack_probabilities; kRegs: the registers the softmax computed (kLeftHalf: the
    // rest are 0 already). Runs while the previous block's P V is on the tensor cores.
    auto drop = [&](auto regs, int n_block) {
      if constexpr (T::kDropout) {
        drop_probabilities<decltype(regs)::value>(s, args.params.dropout, drop_rows,
                                                  static_cast<uint32_t>(n_block) * T::kBlockN, quad);
      }
    };
    RowState st{{-INFINITY, -INFINITY}, {0.f, 0.f}};

    const int q_slot = pc.q_fills % T::kQStages;
    ptx::mbarrier_wait_parity(sm.q_full(q_slot), (pc.q_fills / T::kQStages) & 1);
    FWD_TRACE(role, kQReady, 0);
    ++pc.q_fills;
    // Whether this tile's carried P V was drained already (by the cluster pair's skip, below).
    [[maybe_unused]] bool drained = false;
    if constexpr (T::kClusterPair) {
      // The blocks past this CTA's own rows' keys came for the peer: hand them back once landed,
      // without computing them (both consumers skip alike, so the issue turns stay in step). The
      // previous tile drains first, since its last P V finds its fill from the counter.
      const int skip = pair_blocks_past_own_keys<T>(args, w);
      if (skip > 0) {
        drain();
        drained = true;
        for (int i = 0; i < skip; ++i) pass_over_block(true, false);
        w.n_block_end -= skip;
        w.n_tiles -= skip;
      }
    }
    if (w.n_tiles == 0) {
      release(sm.q_empty(q_slot));  // no key block: Q was loaded but is not needed
      drain();
#pragma unroll
      for (int i = 0; i < T::kHeadDim / 2; ++i) o[i] = 0.f;
      store_tile<T>(args, sm, tile_output(w), consumer, o, st, pc);
      continue;
    }
    // Whole heads: a tile that reads the blocks the head's previous tile kept finds them as the
    // last n_tiles fills (key 0 up, loaded from the top down), so the fill counter steps back over
    // them; the blocks from the returned one up are done after this tile. Other kernels: 0, every
    // block handed back after its use.
    auto enter_tile_fills = [&]() {
      if constexpr (T::kWholeHead) {
        if (w.rewind) pc.kv_fills -= w.n_tiles;
        return w.keep_blocks;
      }
      return 0;
    };
    const int64_t wg_row0 = w.m0 + consumer * T::kRowsPerConsumer;
    // Idle: every row of this consumer lies past the sequence (the last query block of a wide
    // tile: at d64, S = 512 leaves its third consumer without rows, S = 1k its second and third),
    // so it computes nothing. It keeps the tile's issue turns (one per key block, the first
    // draining its carried P V), and waits for each block and hands it back as the others do, so
    // that turns and barriers stay in step. Against computing those rows (H200, bf16, same
    // process, docs/PERF.md session 66): d64 full S = 512 +7.3%, 2k +1.2%, 1k level, d128 full 4k
    // +0.7%.
    const bool idle = wg_row0 >= w.rows;
    if constexpr (!T::kSkipsBlocksPastRows) {
      if (idle) {
        drain();
        const int release_from = enter_tile_fills();
        for (int it = 0; it < w.n_tiles; ++it) {
          pass_over_block(!T::kWholeHead || w.n_block_end - 1 - it >= release_from, it > 0);
        }
        release(sm.q_empty(q_slot));
        continue;
      }
    } else {
      // The tile's first blocks past every key of this consumer's rows (all of them when idle):
      // it drains its carried P V in the first one's issue turn, takes the others' turns without
      // issuing and hands each block back once landed, then computes the rest as a tile of its
      // own. Every consumer takes one turn per key block of the tile either way. Rows that see no
      // key at all still compute the tile's last block (all masked: out = 0, lse = -inf), which
      // saves a second epilogue path. After a cluster pair's skip (both consumers drained there,
      // one turn each) every block skipped here takes its own turn. One loop for idle and skipped
      // blocks: as two, ptxas spilled in d64's three-consumer kernels (session 67).
      const int64_t own_end = std::min<int64_t>(wg_row0 + T::kRowsPerConsumer, w.rows);
      const int skip =
          idle ? w.n_tiles : std::min(blocks_past_keys_of_rows<T>(args, w, wg_row0, own_end), w.n_tiles - 1);
      if (skip > 0) {
        if (!drained) drain();
        for (int it = 0; it < skip; ++it) pass_over_block(true, drained || it > 0);
      }
      if (idle) {
        release(sm.q_empty(q_slot));
        continue;
      }
      w.n_block_end -= skip;
      w.n_tiles -= skip;
    }
    if constexpr (T::kQInRegisters) load_q_fragments<T>(qa, sm, consumer, q_slot);
    // Only the rows that will be stored decide whether a key block needs per-element masks: rows
    // past seqlen_q (the last query block's tail, or a whole consumer's 64 rows) compute on finite
    // inputs and are discarded, so they take the branch-free body. Counting them made every key
    // block of a partial query block masked, and a CTA that always drew the partial block of its
    // heads (132 SMs, 22 blocks of 192 rows per head at S = 4096) ran the whole kernel at 0.6x.
    const int64_t stored_rows_end = std::min<int64_t>(wg_row0 + T::kRowsPerConsumer, w.rows);
    const int64_t stored_tokens_begin = token_of<T>(args, wg_row0);
    const int64_t stored_tokens_end = token_end<T>(args, stored_rows_end);
    auto masked = [&](int n_block) {
      const int64_t key0 = int64_t(n_block) * T::kBlockN;
      return wg_row0 < stored_rows_end &&
             !w.mask.tile_fully_visible(stored_tokens_begin, stored_tokens_end, key0, key0 + T::kBlockN);
    };
    // The tile's first block (its last keys) on a causal diagonal: the first consumer of a 128-row
    // tile sees at most its left half.
    const int n_first = w.n_block_end - 1;
    const bool left_half = T::kLeftHalfDiagonal && masked(n_first) &&
                           w.mask.keys_for_rows(stored_tokens_begin, stored_tokens_end).end <=
                               int64_t(n_first) * T::kBlockN + T::kBlockN / 2;
    auto softmax = [&](int n_block) {
      const int64_t key0 = int64_t(n_block) * T::kBlockN;
      if (masked(n_block)) {
        softmax_tile<T, true>(s, st, correction, args, rows, key0, quad, alibi);
      } else {
        softmax_tile<T, false>(s, st, correction, args, rows, key0, quad, alibi);
      }
      drop(std::integral_constant<int, T::kBlockN / 2>{}, n_block);
    };

    // The previous tile's last fill: the V its carried P V reads (whole heads move the counter).
    [[maybe_unused]] const int carried_fill = pc.kv_fills - 1;
    [[maybe_unused]] const int release_from = enter_tile_fills();
    // Key block 0 of this tile, with the previous tile's last P V (if any) issued behind its
    // Q K^T. Two copies, so that every wgmma wait is unconditional within its copy: behind a
    // run-time `pending` test, ptxas must assume the P V may still be writing O wherever the two
    // paths merge, and serializes every wgmma of the kernel (C7514) - 20% at every length.
    int stage = pc.kv_fills % T::kStages;
    auto first_block = [&](auto carried) {
      constexpr bool kCarried = decltype(carried)::value;
      // (Whole heads have moved the counter since; the other kernels read it here, which keeps
      // their code as it was.)
      const int pending_fill = T::kWholeHead ? carried_fill : pc.kv_fills - 1;
      const int pending_stage = pending_fill % T::kStages;
      ptx::mbarrier_wait_parity(sm.k_full(stage), (pc.kv_fills / T::kStages) & 1);
      FWD_TRACE(role, kKReady, 0);
      if constexpr (kCarried) {
        ptx::mbarrier_wait_parity(sm.v_full(pending_stage), (pending_fill / T::kStages) & 1);
      }
      turn.take();
      FWD_TRACE(role, kTurnTaken, 0);
      issue_qk<T>(s, sm, qa, consumer, q_slot, stage);
      if constexpr (kCarried) issue_pv<T>(o, pa, sm, pending_stage);
      turn.pass();
      if constexpr (kCarried) {
        ptx::wgmma_wait_group<1>();
      } else {
        ptx::wgmma_wait_group<0>();
      }
      ptx::wgmma_fence_operands(s);
      FWD_TRACE(role, kSReady, 0);
      if (!T::kWholeHead || n_first >= release_from) release_kv<T>(sm.k_empty(stage));
      if (w.n_tiles == 1) release(sm.q_empty(q_slot));
      // O is still zero: its correction is irrelevant
      if (left_half) {
        softmax_tile<T, true, true>(s, st, correction, args, rows, int64_t(n_first) * T::kBlockN, quad, alibi);
        drop(std::integral_constant<int, T::kBlockN / 4>{}, n_first);
      } else {
        softmax(n_first);
      }
      FWD_TRACE(role, kSoftmaxDone, 0);
      if constexpr (kCarried) {
        ptx::wgmma_wait_group<0>();
        ptx::wgmma_fence_operands(o);
        FWD_TRACE(role, kPvDone, 0);  // the previous tile's last P V
        if (!T::kWholeHead || pending_release) release_kv<T>(sm.v_empty(pending_stage));
      }
      pack_probabilities<T>(s, pa);
      if constexpr (kCarried) {
        store_tile<T>(args, sm, pending_out, consumer, o, pending_st, pc);
        FWD_TRACE(role, kEpilogueDone, 0);
      }
#pragma unroll
      for (int i = 0; i < T::kHeadDim / 2; ++i) o[i] = 0.f;
    };
    if (pending) {
      first_block(std::true_type{});
    } else {
      first_block(std::false_type{});
    }

    for (int it = 1; it < w.n_tiles; ++it) {
      const int prev = stage;
      const uint32_t prev_parity = (pc.kv_fills / T::kStages) & 1;
      ++pc.kv_fills;
      stage = pc.kv_fills % T::kStages;
      ptx::mbarrier_wait_parity(sm.k_full(stage), (pc.kv_fills / T::kStages) & 1);
      FWD_TRACE(role, kKReady, it);
      ptx::mbarrier_wait_parity(sm.v_full(prev), prev_parity);
      FWD_TRACE(role, kVReady, it - 1);
      turn.take();
      FWD_TRACE(role, kTurnTaken, it);
      issue_qk<T>(s, sm, qa, consumer, q_slot, stage);
      issue_pv<T>(o, pa, sm, prev);
      turn.pass();
      ptx::wgmma_wait_group<1>();  // S_it is complete, P_{it-1} V_{it-1} may still run
      ptx::wgmma_fence_operands(s);
      FWD_TRACE(role, kSReady, it);
      if (!T::kWholeHead || w.n_block_end - 1 - it >= release_from) release_kv<T>(sm.k_empty(stage));
      if (it == w.n_tiles - 1) release(sm.q_empty(q_slot));  // this tile's last read of Q
      softmax(w.n_block_end - 1 - it);
      FWD_TRACE(role, kSoftmaxDone, it);
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(o);
      FWD_TRACE(role, kPvDone, it - 1);
      if (!T::kWholeHead || w.n_block_end - it >= release_from) release_kv<T>(sm.v_empty(prev));
      // Warp-uniform: with lazy rescaling most tiles leave every row's max where it was.
      if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < T::kHeadDim / 2; ++i) o[i] *= correction[(i % 4) / 2];
      }
      pack_probabilities<T>(s, pa);
    }
    pending = true;
    pending_out = tile_output(w);
    pending_st = st;
    if constexpr (T::kWholeHead) pending_release = w.n_block_end - w.n_tiles >= release_from;
    ++pc.kv_fills;
  }
  drain();
}

/** The producer thread, for one tile: K and V of every key block into the ring, and the walk to
 *  the next tile (into `next`; false when there is none) right after the first key block's loads.
 *  Walked before the first K instead, it held that K up at every tile boundary (~2300 cycles at
 *  d128 for one thread with 24 registers; moving it gained 4% at d128 causal S = 2k, docs/PERF.md
 *  session 11, and nothing measurable elsewhere). With two Q slots the next
 *  tile's Q is issued there too, so it lands long before this tile ends; its slot was freed by the
 *  tile before this one, whose key blocks are all issued already, so the wait cannot hold up this
 *  tile. */
template <class T>
__device__ bool produce_kv(const ForwardKernelArgs& args, const SmemPlan<T>& sm, const BlockWork& w,
                           TileWalker<T>& tiles, BlockWork& next, PipelineCounters& pc) {
  const int32_t hk = static_cast<int32_t>(w.kv_head);
  bool has_next = false;
  auto walk_on = [&] {
    has_next = tiles.next(next);
    if (T::kQStages > 1 && has_next) produce_q<T>(args, sm, next, pc);
  };
  FWD_TRACE(0, kTileBegin, 0);
  // Whole heads: the item's first tile (the head's last query block) loads every K/V block of
  // the head, which stay for its other tiles.
  int fills = w.n_tiles;
  if constexpr (T::kWholeHead) {
    if (w.rewind) fills = 0;  // the item's previous tile left them in the ring
  }
  for (int it = 0; it < fills; ++it, ++pc.kv_fills) {
    const int stage = pc.kv_fills % T::kStages;
    const uint32_t parity = (pc.kv_fills / T::kStages) & 1;
    // Before the slot's wait: a paged block's table lookups run under it (pages smaller than the
    // block: copies of one entry per page into shared memory, request_block_pages).
    const KeyBlockCoord at = key_block_coord<T>(args, w, it);
    if (T::kPageBoxes && args.kv_boxes > 1) request_block_pages(args, sm.page_ids_addr(), w.batch, at.row);
    // One key block of K (then V): wait for the stage's slot, arm its full barrier, TMA the chunks
    // (of pages smaller than the block: one box per page and chunk, each page's rows where its
    // keys sit in the tile; a box of 8k rows starts on the 128-byte swizzle's 1024-byte period).
    auto load_block = [&](uint64_t* empty, uint64_t* full, uint8_t* dst, const CUtensorMap* map) {
      ptx::mbarrier_wait_parity(empty, parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(full, T::kTileBytes);
      if constexpr (T::kClusterPair) {  // this rank's chunks, into both CTAs (both armed for all)
        const int rank = pair_rank();
#pragma unroll
        for (int c = 0; c < T::kChunks; c += 2) {
          ptx::tma_load_4d_multicast(dst + (c + rank) * T::kTileChunkBytes, map, full, (c + rank) * T::kChunkCols,
                                     at.row, hk, at.batch, 0x3);
        }
      } else if (!T::kPageBoxes || args.kv_boxes == 1) {
#pragma unroll
        for (int c = 0; c < T::kChunks; ++c)
          ptx::tma_load_4d(dst + c * T::kTileChunkBytes, map, full, c * T::kChunkCols, at.row, hk, at.batch);
      } else {
        ptx::cp_async_wait<0>();  // the block's entries (a no-op for V: K's wait took them)
        for (int box = 0; box < args.kv_boxes; ++box) {
          const int32_t page = block_page(args, sm.page_ids(), box);
          uint8_t* box_dst = dst + box * args.kv_box_rows * T::kSwizzleBytes;
#pragma unroll
          for (int c = 0; c < T::kChunks; ++c)
            ptx::tma_load_4d(box_dst + c * T::kTileChunkBytes, map, full, c * T::kChunkCols, 0, hk, page);
        }
      }
    };
    load_block(sm.k_empty(stage), sm.k_full(stage), sm.k_ptr(stage), &args.map_k);
    FWD_TRACE(0, kKSlotFree, it);
    // The first block's V with rows past the sequence goes to zero_v_tails before the consumers.
    const bool v_tail = it == 0 && first_block_rows<T>(args, w) < T::kBlockN;
    load_block(sm.v_empty(stage), v_tail ? sm.v_loaded(stage) : sm.v_full(stage), sm.v_ptr(stage),
               &args.map_v);
    FWD_TRACE(0, kVSlotFree, it);
    if (it == 0) walk_on();
  }
  if (fills == 0) walk_on();
  return has_next;
}

/** The producer's walk: each tile's K/V, and Q one tile ahead where there are two Q slots (d256,
 *  with one, loads each tile's Q before its K/V: the slot frees only at the previous tile's last
 *  Q K^T, and waiting for it inside the previous tile's K/V would deadlock). */
template <class T>
__device__ void produce_all(const ForwardKernelArgs& args, const SmemPlan<T>& sm) {
  PipelineCounters pc;
  TileWalker<T> tiles{args};
  BlockWork cur, next;
  bool has_cur = tiles.next(cur);
  if (T::kQStages > 1 && has_cur) produce_q<T>(args, sm, cur, pc);
  while (has_cur) {
    if (T::kQStages == 1) produce_q<T>(args, sm, cur, pc);
    has_cur = produce_kv<T>(args, sm, cur, tiles, next, pc);
    cur = next;
  }
}

/** A warp of the producer warpgroup, in packed varlen calls: walks the tiles as the producer does,
 *  and where a tile's first V block runs past its sequence, waits for its copy (v_loaded), zeroes
 *  the rows past the sequence and hands the buffer to the consumers (v_full). K needs no such care:
 *  the scores of those keys are replaced by -inf (select), and P = 0 there. Off the consumers'
 *  path: that V is first read by the P V after the next key block's Q K^T and softmax. */
template <class T>
__device__ void zero_v_tails(const ForwardKernelArgs& args, const SmemPlan<T>& sm) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  TileWalker<T> tiles{args};
  BlockWork w;
  TailPhases phases;
  int fills = 0;  // K/V fills of the tiles walked so far, as the producer counts them
  while (tiles.next(w)) {
    const int rows = first_block_rows<T>(args, w);
    if (rows < T::kBlockN) {
      const int stage = fills % T::kStages;
      ptx::mbarrier_wait_parity(sm.v_loaded(stage), phases.take(stage));
      zero_rows_from<T::kBlockN, T::kChunks>(sm.v_addr(stage), rows, lane);
      arrive_after_zeroing(sm.v_full(stage), lane);
    }
    fills += w.n_tiles;
  }
}

/** Before the wait, on a thread with no other work: the CTA's first tile's Q and first kStages K
 *  and V blocks requested into L2 (ptx/l2_prefetch.cuh says why that is safe). A persistent CTA is
 *  placed when one of the previous grid's CTAs leaves its SM, and then waits for the rest of that
 *  grid: its first loads' DRAM latency moves under that tail (same process, docs/PERF.md session 26:
 *  +0.2% to +3.3% in 11 of 12 S = 512 measurements, within +-1.3% from 1k). Fixed-length calls
 *  only (a varlen tile's rows come from cu_seqlens, which the previous grid may still write). */
template <class T>
__device__ void prefetch_first_tile(const ForwardKernelArgs& args) {
  TileWalker<T> tiles{args};
  BlockWork w;
  if (!tiles.next(w)) return;
  const int32_t bc = static_cast<int32_t>(w.batch_coord), hk = static_cast<int32_t>(w.kv_head);
#pragma unroll
  for (int c = 0; c < T::kChunks; ++c) {
    if constexpr (T::kPackGqa) {
      ptx::tma_prefetch_l2_5d(&args.map_q, c * T::kChunkCols, 0, static_cast<int32_t>(w.q_row0),
                              static_cast<int32_t>(w.head), bc);
    } else {
      ptx::tma_prefetch_l2_4d(&args.map_q, c * T::kChunkCols, static_cast<int32_t>(w.q_row0),
                              static_cast<int32_t>(w.head), bc);
    }
  }
  const int blocks = w.n_tiles < T::kStages ? w.n_tiles : T::kStages;
  for (int it = 0; it < blocks; ++it) {
    const KeyBlockCoord at = key_block_coord<T>(args, w, it);
#pragma unroll
    for (int c = 0; c < T::kChunks; ++c) {
      ptx::tma_prefetch_l2_4d(&args.map_k, c * T::kChunkCols, at.row, hk, at.batch);
      ptx::tma_prefetch_l2_4d(&args.map_v, c * T::kChunkCols, at.row, hk, at.batch);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    forward_kernel(const __grid_constant__ ForwardKernelArgs args) {
  extern __shared__ uint8_t smem_raw[];
  // Launched as a programmatic dependent (launch_forward): nothing global is read before the
  // previous kernel on the stream is complete (every role but the L2 prefetch waits right after
  // setting up its registers); the next one may be placed from there on.
  const uint32_t raw_addr = ptx::smem_addr(smem_raw);
  const uint32_t pad = (T::kAlign - raw_addr % T::kAlign) % T::kAlign;
  SmemPlan<T> sm;
  sm.base = smem_raw + pad;
  sm.addr = raw_addr + pad;
  sm.bars = reinterpret_cast<uint64_t*>(sm.base + T::kBarrierOffset);

  if (threadIdx.x == 0) {
    for (int q = 0; q < T::kQStages; ++q) {
      ptx::mbarrier_init(sm.q_full(q), 1);
      ptx::mbarrier_init(sm.q_empty(q), T::kConsumerWarps);
    }
    for (int s = 0; s < T::kStages; ++s) {
      ptx::mbarrier_init(sm.k_full(s), 1);
      ptx::mbarrier_init(sm.v_full(s), 1);
      ptx::mbarrier_init(sm.k_empty(s), T::kClusterCtas * T::kConsumerWarps);
      ptx::mbarrier_init(sm.v_empty(s), T::kClusterCtas * T::kConsumerWarps);
      ptx::mbarrier_init(sm.v_loaded(s), 1);
    }
    ptx::fence_mbarrier_init();
  }
  // Cluster pairs: the peer's barriers are set up before either CTA's loads or releases reach them.
  if constexpr (T::kClusterPair) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  // Persistent CTA: tiles blockIdx.x, blockIdx.x + gridDim.x, ... Both roles walk the same list
  // and skip the same empty tiles, so their barrier phases stay in step; the producer runs ahead
  // by up to kStages K/V tiles and one Q tile, which overlaps the next tile's loads with this
  // tile's last P V and epilogue.
  PipelineCounters pc;
  const uint32_t warpgroup = ptx::warpgroup_index();
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<T::kProducerRegisters>();
    if (ptx::warp_in_warpgroup() == 1) {
      if (args.prefetch_first_tile && ptx::elect_one_sync()) prefetch_first_tile<T>(args);
    } else {
      ptx::wait_previous_grid();
    }
    ptx::allow_next_grid();
    // This shape of the branches matters to ptxas: with `warp 0 && elect_one_sync()` as one test
    // and the tail warp in an `else if` (even with an empty body) it spilled 160 bytes in the d128
    // kernels; tested this way, nothing (docs/PERF.md, session 28).
    if (ptx::warp_in_warpgroup() == 0) {
      if (ptx::elect_one_sync()) {
        ptx::tma_prefetch_tensor_map(&args.map_q);
        ptx::tma_prefetch_tensor_map(&args.map_k);
        ptx::tma_prefetch_tensor_map(&args.map_v);
        produce_all<T>(args, sm);
      }
    } else if (ptx::warp_in_warpgroup() == 2 && args.params.cu_seqlens_q != nullptr) {
      zero_v_tails<T>(args, sm);
    }
  } else {
    ptx::setmaxnreg_inc<T::kConsumerRegisters>();
    ptx::wait_previous_grid();
    ptx::allow_next_grid();
    const int consumer = static_cast<int>(warpgroup) - 1;
    const IssueTurn<T> turn{consumer};
    turn.start();
    consume<T>(args, sm, consumer, pc, turn);
    // The shared memory a TMA store reads must outlive it.
    if (T::kStageO && ptx::thread_in_warpgroup() == 0) ptx::tma_store_wait_group<0>();
    // Cluster pairs: neither CTA leaves while the other's consumers may still release its stages
    // (the barrier waits for the threads that have not exited: the producer warps leave without
    // it, since with it ptxas spilled 300 bytes at d128; their last loads are waited for by the
    // consumers of both CTAs anyway).
    if constexpr (T::kClusterPair) ptx::cluster_sync();
  }
}

// ---- host -----------------------------------------------------------------------------------------

/** CTAs per SM for varlen calls of uneven lengths (provably_uneven) under a causal (one-sided)
 *  mask. A CTA's list of items is fixed by the stride over the grid, and with sequences of uneven
 *  lengths the lists' costs differ (the pairs of query blocks assume every sequence max_seqlen
 *  long); with four shorter lists per SM, the hardware starts the next waiting list on whichever
 *  SM frees first. Same process, ~16k tokens in sequences uniform in [mean / 2, 3 mean / 2)
 *  (dev/varlen_peers.py, docs/PERF.md session 30): causal +15% to +33% at mean 512 / 2048, d64 /
 *  d128. Equal lengths lost 2% to 9% with it (the CTAs' restarts, where the pairs balanced
 *  already), hence provably_uneven. Without a mask every query block of a sequence costs the same
 *  and it gained -4% to +12%: not used there. */
constexpr int64_t kVarlenListsPerSm = 4;

/** Whether a varlen call's sequences are of uneven lengths, as far as the host can tell: fewer
 *  packed rows than batch x max_seqlen (every length is at most max_seqlen). Packed tensors with
 *  spare rows, or key lengths the host does not see (paged K/V, the KV-cache route), read as even. */
inline bool provably_uneven(const forward_params_t& p) {
  if (p.cu_seqlens_q == nullptr) return false;
  return p.total_q < p.batch * p.seqlen_q || (!p.is_paged() && p.total_k < p.batch * p.seqlen_k);
}

/** Where a split-KV kernel's partials go (forward_run; ForwardKernelArgs::part_o / part_lse). */
struct SplitTarget {
  int splits = 1;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};

template <class T>
Status launch_forward(const forward_params_t& p, const SplitTarget& split = {}) {
  // Pack-GQA kernels walk (packed rows, KV head, batch) tiles: a KV head's group of query heads is
  // one head of seqlen_q x group rows.
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  if (T::kPackGqa && !pack_gqa_fits(p)) {
    return Status::unsupported("cuda_sm90 forward: this call's GQA group cannot be packed");
  }
  const int64_t walk_rows = T::kPackGqa ? p.seqlen_q * group : p.seqlen_q;
  const int64_t walk_heads = T::kPackGqa ? p.heads_kv : p.heads_q;
  const int64_t num_m_blocks = (walk_rows + T::kBlockM - 1) / T::kBlockM;
  if (num_m_blocks == 0 || walk_heads == 0 || p.batch == 0) return Status::ok();
  if (num_m_blocks * walk_heads * p.batch > INT_MAX) {  // sm90_supports rules this out
    return Status::unsupported("cuda_sm90 forward: more than 2^31 - 1 query tiles");
  }
  if (T::kClusterPair && !cluster_pair_fits(p, T::kBlockM)) {
    return Status::unsupported("cuda_sm90 forward: this call cannot run in cluster pairs");
  }
  if (T::kWholeHead && !whole_heads_fit(p, T::kBlockM, T::kBlockN, T::kStages)) {
    return Status::unsupported("cuda_sm90 forward: this call cannot run over whole heads");
  }

  ForwardKernelArgs args{};
  args.params = p;
  args.num_m_blocks = static_cast<int>(num_m_blocks);
  args.pack_shift = T::kPackGqa ? log2_of_power_of_two(group) : 0;
  // Pairs only where the cost of a query block grows (causal) or shrinks with its index (a window
  // bounded on one side only), and only when they still give every SM work: a small problem keeps
  // one block per item (twice the CTAs), since an idle SM costs more than an uneven one. Without
  // such a mask single blocks go in order, so the CTAs working at one time cover every query block
  // of a head together and read its K/V from DRAM once (pairs read it a second time for the second
  // block: 1.6x the DRAM bytes at d256 S=512).
  // Cluster pairs walk blocks of 2 kBlockM rows, one per cluster (TileWalker).
  const int sm_count = usable_multiprocessors(p.device_id, kFallbackSmCount, p.sm_margin);
  const int64_t walk_blocks = num_m_blocks / T::kClusterCtas;
  const int64_t pairs = (walk_blocks + 1) / 2 * walk_heads * p.batch;
  const bool uneven_cost = one_sided_mask(p);
  args.tiles_per_item = uneven_cost && pairs * T::kClusterCtas >= sm_count ? 2 : 1;
  if constexpr (T::kWholeHead) args.tiles_per_item = static_cast<int>(num_m_blocks);  // one item a head
  const int64_t tile_items = T::kWholeHead            ? walk_heads * p.batch
                             : args.tiles_per_item == 2 ? pairs
                                                        : walk_blocks * walk_heads * p.batch;
  const int splits = T::kSplitKv ? split.splits : 1;
  if (T::kSplitKv && (splits < 1 || split.part_o == nullptr || split.part_lse == nullptr)) {
    return Status::internal("cuda_sm90 forward: a split-KV kernel without its partials");
  }
  if (tile_items * splits > INT_MAX) return Status::unsupported("cuda_sm90 forward: more than 2^31 - 1 work items");
  args.num_items = static_cast<int>(tile_items * splits);
  args.num_splits = splits;
  args.split_items = FastDivmod(static_cast<uint32_t>(tile_items));
  args.part_o = split.part_o;
  args.part_lse = split.part_lse;
  args.items_per_head =
      FastDivmod(static_cast<uint32_t>((walk_blocks + args.tiles_per_item - 1) / args.tiles_per_item));
  args.heads_q = FastDivmod(static_cast<uint32_t>(walk_heads));
  args.group = FastDivmod(static_cast<uint32_t>(group));
  // Pairs of a fixed-length call without splits: the last ones may run as single tiles in order of
  // falling cost (tile_tail.hpp), where the model finishes sooner. Varlen calls keep the pairs
  // (their lengths are on the device); a split call's items are not pairs of one launch's heads.
  args.tail = TileTail{};
  if (args.tiles_per_item == 2 && splits == 1 && !p.is_varlen() && !T::kClusterPair && !T::kWholeHead) {
    const MaskInfo mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    // One walk head's K and V: what the tail's heads share in L2 while their tiles run together.
    const double head_kv_bytes = 2.0 * static_cast<double>(p.seqlen_k) * static_cast<double>(p.head_dim) *
                                 static_cast<double>(sizeof(typename T::Element));
    args.tail = planned_tile_tail(mask, walk_rows, T::kBlockM, T::kBlockN, args.pack_shift, tile_items,
                                  args.items_per_head.divisor, sm_count, head_kv_bytes,
                                  static_cast<double>(l2_cache_bytes(p.device_id, kFallbackL2Bytes)));
  }
  const ScoreScales scales = resolve_score_scales(p);
  args.transform = scales.transform;
  args.exp2_scale = scales.exp2_scale;
  args.pre_scale = scales.pre_scale;
  args.post_scale = scales.post_scale;

  const bool varlen = p.is_varlen();
  const bool programmatic = supports_programmatic_launch(p.device_id);
  args.prefetch_first_tile = programmatic && !varlen;
  const TmaElement element = tma_element_of<typename T::Element>();
  const int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t k_rows = varlen ? p.total_k : p.seqlen_k;
  // With no keys anywhere (k_rows == 0) the K/V maps stay zero: n_tiles is 0 in every CTA, no
  // copy is issued, and every row gets out = 0, lse = -inf.
  // Paged K/V read in place: (head_dim, page_size, heads_kv, num_pages), the page as the batch
  // coordinate (key_block_coord); a box reaching past its page reads zeros.
  // Pages smaller than a key block (sequences of several pages): one box per page, so the pages
  // divide the block; only the kernels compiled with that path take them (forward_api.cu admits
  // such pages only where ForwardConfigs picks one; others are gathered first).
  const bool paged = p.is_paged();
  const bool page_boxes = reads_page_boxes(p);
  if (page_boxes != T::kPageBoxes ||
      (page_boxes && (T::kBlockN % p.pages.page_size != 0 || p.pages.first_slot != nullptr))) {
    return Status::unsupported("cuda_sm90 forward: pages of " + std::to_string(p.pages.page_size) +
                               " keys cannot be read in place by the " + std::to_string(T::kBlockN) +
                               "-key tile chosen for this call (they are gathered first)");
  }
  args.kv_boxes = page_boxes ? static_cast<int>(T::kBlockN / p.pages.page_size) : 1;
  args.kv_box_rows = page_boxes ? static_cast<int>(p.pages.page_size) : T::kBlockN;
  const auto kv_box = static_cast<uint32_t>(args.kv_box_rows);
  // Pack-GQA kernels read q and write out as (head_dim, group, tokens, heads_kv, batch).
  const int64_t q_group = T::kPackGqa ? group : 1;
  const AttentionMapJob jobs[] = {{"q", &p.q, q_rows, walk_heads, T::kBlockM, &args.map_q, q_group},
                                  {"k", &p.k, paged ? p.pages.page_size : k_rows, p.heads_kv, kv_box, &args.map_k},
                                  {"v", &p.v, paged ? p.pages.page_size : k_rows, p.heads_kv, kv_box, &args.map_v}};
  Status s = encode_attention_maps(jobs, paged ? 1 : 3, element, p.batch, p.head_dim, varlen, "cuda_sm90 forward");
  if (s.is_ok() && paged) {
    s = encode_attention_maps(jobs + 1, 2, element, p.pages.num_pages, p.head_dim, /*varlen=*/false,
                              "cuda_sm90 forward (pages)");
  }
  if (!s.is_ok()) return s;
  // `out` through TMA where it can be described (16-byte aligned base and strides); otherwise the
  // epilogue stores from registers.
  if (T::kStageO && !T::kSplitKv && tma_addressable(p.out, varlen, p.batch)) {
    const AttentionMapJob out_job{"out", &p.out, q_rows, walk_heads, T::kRowsPerConsumer, &args.map_o, q_group};
    args.store_o_with_tma =
        encode_attention_maps(&out_job, 1, element, p.batch, p.head_dim, varlen, "cuda_sm90 forward").is_ok();
  }

  ScopedDevice device(p.device_id);
  auto* kernel = forward_kernel<T>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) {
    return Status::cuda(std::string("cuda_sm90 forward: cannot reserve shared memory: ") +
                        cudaGetErrorString(err));
  }
  // Persistent: one CTA per SM (fewer when there are fewer work items); varlen calls of uneven
  // lengths under a one-sided mask, kVarlenListsPerSm CTAs per SM (see there).
  // Cluster pairs: two CTAs per item, as many clusters as fit at once (a GPC with an odd number of
  // free SMs leaves one idle).
  const int64_t lists_per_sm = uneven_cost && provably_uneven(p) ? kVarlenListsPerSm : 1;
  int64_t ctas = std::min<int64_t>(args.num_items, lists_per_sm * sm_count);
  if constexpr (T::kClusterPair) {
    // Asked once per device (a few microseconds a query).
    static std::atomic<int> known[kMaxClusterDevices] = {};
    std::atomic<int>* cached = p.device_id >= 0 && p.device_id < kMaxClusterDevices ? &known[p.device_id] : nullptr;
    int clusters = cached != nullptr ? cached->load(std::memory_order_relaxed) : 0;
    if (clusters <= 0) {
      clusters = resident_clusters(kernel, dim3(T::kThreads), T::kSmemBytes, T::kClusterCtas);
      if (cached != nullptr) cached->store(clusters, std::memory_order_relaxed);
    }
    if (clusters <= 0) return Status::cuda("cuda_sm90 forward: no cluster of two CTAs fits on this GPU");
    ctas = T::kClusterCtas * std::min<int64_t>({args.num_items, clusters, sm_count / T::kClusterCtas});
  }
  const dim3 grid(static_cast<unsigned>(ctas));
  // The tail's turns: planned for sm_count CTAs, which is the grid whenever there are pairs
  // (tiles_per_item 2: at least sm_count of them) of a fixed-length call (lists_per_sm 1).
  args.grid_turns = FastDivmod(grid.x);
  args.walk_end = args.num_items;
  if (args.tail.tiles > 0) {
    if (static_cast<int64_t>(grid.x) != sm_count) {
      return Status::internal("cuda_sm90 forward: a tile tail planned for another grid");
    }
    const int64_t turns = (args.tail.tiles + sm_count - 1) / sm_count;
    args.walk_end = static_cast<int>(std::min<int64_t>(INT_MAX, args.tail.first_item + turns * sm_count));
  }
  // A programmatic dependent of the kernel before it (each role waits for it before its first read).
  err = launch_kernel_in_clusters(kernel, grid, dim3(T::kThreads), T::kSmemBytes,
                                  static_cast<cudaStream_t>(p.stream), programmatic, T::kClusterCtas, args);
  if (err != cudaSuccess) {
    return Status::cuda(std::string("cuda_sm90 forward launch failed: ") + cudaGetErrorString(err));
  }
  return Status::ok();
}

/** The same tile configuration with the score transforms compiled in (softcap, linear scale). */
template <class T>
using WithScoreTransforms = ForwardTraits<typename T::Element, T::kHeadDim, T::kBlockN, T::kStages,
                                          T::kConsumers, T::kPingPong, /*kScoreTransforms=*/true,
                                          /*kPageBoxes=*/false, T::kPackGqa>;

template <class T>
Status launch_for_transform(const forward_params_t& p) {
  if (resolve_score_scales(p).transform == ScoreTransform::kFoldedScale) return launch_forward<T>(p);
  static_assert(!T::kSplitKv, "split-KV kernels take their score transforms in dispatch_split");
  if constexpr (T::kPageBoxes) {  // forward_api.cu gathers such pages for these calls
    return Status::unsupported("cuda_sm90 forward: paged k / v in pages smaller than a key block need the plain "
                               "softmax scale (no softcap)");
  } else {
    return launch_forward<WithScoreTransforms<T>>(p);
  }
}

/** Dropout calls with pages smaller than a key block: forward_api.cu gathers them first (the page-box
 *  kernels have no dropout). */
inline Status page_boxes_without_dropout() {
  return Status::unsupported("cuda_sm90 forward: dropout with pages smaller than a key block needs them gathered");
}

/** The dropout kernel for an unsplit call: the bucket's two-consumer tile (DropoutTile; the
 *  three-consumer tiles' 160 registers leave no room for the Philox rounds, and d128's 80-key one
 *  would compute draws it does not use) with the score transforms compiled in, so that one kernel
 *  serves the folded scale, softcap, ALiBi and negative scales alike; the GQA group packed where
 *  the packed tiles pay on that tile, as plan_forward_split decides (never with ALiBi). Every route
 *  applies the mask by the in-sequence row and key and the row's query head, so a split, a packed
 *  row or a varlen sequence drops what common/dropout.hpp says. */
template <class Tile, class Launch>
Status dispatch_dropout(const forward_params_t& p, Launch&& launch) {
  if (reads_page_boxes(p)) return page_boxes_without_dropout();
  if (pack_gqa_chosen(p, Tile::kBlockM, Tile::kBlockM)) {
    return launch(TileChoice<WithDropout<WithScoreTransforms<WithPackedGqa<Tile>>>>{});
  }
  return launch(TileChoice<WithDropout<WithScoreTransforms<Tile>>>{});
}

/** The split-KV kernel for p on a bucket's two-consumer tile (kSplitTileRows): with the page
 *  boxes where the pages need them (d64 / d128, folded scale only: forward_api.cu gathers the pages
 *  of other calls), or packing the GQA group where the plan packs; softcap, ALiBi and negative
 *  scales on the score-transform kernels (ALiBi calls never pack: pack_gqa_fits). */
template <class Tile, class Launch>
Status dispatch_split(const forward_params_t& p, bool packed, Launch&& launch) {
  static_assert(Tile::kBlockM == kSplitTileRows && Tile::kBlockN == split_block_keys(Tile::kHeadDim),
                "plan_forward_split's tile");
  if (p.dropout.enabled()) {  // the dropout kernels carry the score transforms (dispatch_dropout)
    if (reads_page_boxes(p)) return page_boxes_without_dropout();
    if (packed) return launch(TileChoice<WithSplitKv<WithDropout<WithScoreTransforms<WithPackedGqa<Tile>>>>>{});
    return launch(TileChoice<WithSplitKv<WithDropout<WithScoreTransforms<Tile>>>>{});
  }
  if (resolve_score_scales(p).transform != ScoreTransform::kFoldedScale) {
    if (packed) return launch(TileChoice<WithSplitKv<WithScoreTransforms<WithPackedGqa<Tile>>>>{});
    return launch(TileChoice<WithSplitKv<WithScoreTransforms<Tile>>>{});
  }
  if constexpr (Tile::kHeadDim <= 128) {
    if (reads_page_boxes(p)) return launch(TileChoice<WithSplitKv<WithPageBoxes<Tile>>>{});
  }
  if (packed) return launch(TileChoice<WithSplitKv<WithPackedGqa<Tile>>>{});
  return launch(TileChoice<WithSplitKv<Tile>>{});
}

/** The merge of p's split partials (`target`, laid out as store_partial writes them) into out and
 *  lse, by the decode path's merge kernel (a programmatic dependent of the split kernel). Varlen
 *  calls: out / lse rows found through cu_seqlens_q, addressed as the forward addresses them. */
inline Status merge_split(const forward_params_t& p, const SplitTarget& target) {
  MergeParams m;
  m.out_dtype = p.dtype;
  m.device_type = p.device_type;
  m.device_id = p.device_id;
  m.out = p.out;
  m.lse = p.lse;
  if (p.is_varlen()) {
    m.out_cu_seqlens = p.cu_seqlens_q;
    m.out_rows = p.total_q;
  }
  set_dense_partials(m, target.splits, p.batch, p.seqlen_q, p.heads_q, p.head_dim, target.part_o, target.part_lse);
  m.stream = p.stream;
  return merge_split_partials(m, supports_programmatic_launch(p.device_id));
}

/** Entry point instantiated once per (dtype, head-dim bucket) by the generated units. Calls whose
 *  tiles leave SMs idle split their key ranges (plan_forward_split) where the workspace holds the
 *  partials (sm90_forward_workspace reports them); otherwise, or without that workspace, the tile
 *  ForwardConfigs chooses runs the call whole. */
template <typename Element, int kHeadDim>
Status forward_run(const forward_params_t& p, void* workspace, size_t workspace_bytes) {
  using Configs = ForwardConfigs<Element, kHeadDim>;
  const ForwardSplit plan =
      plan_forward_split(p, kHeadDim, usable_multiprocessors(p.device_id, kFallbackSmCount, p.sm_margin));
  const bool aligned = reinterpret_cast<uintptr_t>(workspace) % 16 == 0;  // the partials' float2 stores
  if (plan.splits > 1 && workspace != nullptr && aligned && workspace_bytes >= plan.bytes) {
    const SplitTarget target{plan.splits, static_cast<float*>(workspace),
                             reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.o_bytes)};
    const Status s = dispatch_split<typename Configs::SplitTile>(
        p, plan.packed, [&](auto choice) { return launch_forward<typename decltype(choice)::type>(p, target); });
    return s.is_ok() ? merge_split(p, target) : s;
  }
  if (p.dropout.enabled()) {
    return dispatch_dropout<typename Configs::DropoutTile>(
        p, [&](auto choice) { return launch_forward<typename decltype(choice)::type>(p); });
  }
  return Configs::dispatch(p, [&](auto choice) { return launch_for_transform<typename decltype(choice)::type>(p); });
}

}  // namespace flashcore::cuda::sm90
