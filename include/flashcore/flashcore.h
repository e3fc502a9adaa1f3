/* flashcore C ABI: exact attention (FlashAttention algorithm) for CPU and CUDA.
 *
 * Stable, plain-C interface: POD structs, integer status codes, and a thread-local
 * last-error message. Every entry point validates all arguments before any work starts;
 * on error nothing is written to any output buffer and fc_last_error() names the
 * offending argument and the rule it broke.
 *
 * Layout (as in FlashAttention):
 *   dense : q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k, heads_kv, head_dim)
 *   varlen: q (total_q, heads_q, head_dim), k/v (total_k, heads_kv, head_dim) with
 *           cu_seqlens_q / cu_seqlens_k int32 (batch + 1) prefix sums of the sequence lengths.
 *   lse   : fp32, dense (batch, heads_q, seqlen_q); varlen (heads_q, total_q).
 *   Varlen tensors may hold more rows than the sequences use (a preallocated buffer): rows
 *   outside [cu_seqlens[0], cu_seqlens[batch]) never affect a result, whatever they
 *   hold (NaN included), and out / lse / dq / dk / dv are not written there.
 * Strides are in elements (not bytes); any strides are accepted as long as the last
 * (head_dim) dimension is contiguous (stride 1).
 */
#ifndef FLASHCORE_FLASHCORE_H
#define FLASHCORE_FLASHCORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FC_API __declspec(dllexport)
#else
#define FC_API __attribute__((visibility("default")))
#endif

/* 2: fc_kvcache_args gained rotary_cos / rotary_sin / rotary_interleaved / cache_leftpad (appended
 *    after error_flag) and fc_attention_options gained block_table (appended after reserved);
 *    callers built against version 1 pass shorter structs: rebuild them.
 * 3: fc_attention_options gained alibi_slopes (appended after block_table).
 * 4: fc_attention_options gained sm_margin (appended after alibi_slopes). */
#define FC_ABI_VERSION 5
#define FC_MAX_DIMS 4

/** Element types. Values are part of the ABI. */
typedef enum fc_dtype {
  FC_DTYPE_F32 = 0,
  FC_DTYPE_F16 = 1,
  FC_DTYPE_BF16 = 2,
  FC_DTYPE_I32 = 3,
} fc_dtype;

/** Where a tensor's memory lives. Values are part of the ABI. */
typedef enum fc_device_type {
  FC_DEVICE_CPU = 0,
  FC_DEVICE_CUDA = 1,
} fc_device_type;

/** Status codes returned by every entry point. */
typedef enum fc_status {
  FC_OK = 0,
  FC_ERROR_INVALID_ARGUMENT = 1, /**< an argument broke a documented rule; nothing was written */
  FC_ERROR_UNSUPPORTED = 2,      /**< valid request that no compiled backend can serve */
  FC_ERROR_CUDA = 3,             /**< a CUDA runtime call failed */
  FC_ERROR_INTERNAL = 4,         /**< a bug in flashcore; please report */
} fc_status;

/** Backend selection. FC_BACKEND_AUTO picks the fastest backend able to serve the call. */
typedef enum fc_backend {
  FC_BACKEND_AUTO = 0,
  FC_BACKEND_CPU_REFERENCE = 1, /**< naive fp64 materialized attention: the oracle */
  FC_BACKEND_CPU_FLASH = 2,     /**< tiled online softmax, fp32 accumulation, threaded + SIMD */
  FC_BACKEND_CUDA_SM80 = 3,     /**< mma.sync tensor-core kernels (Ampere, Ada, Hopper) */
  FC_BACKEND_CUDA_SM90 = 4,     /**< TMA + wgmma kernels (Hopper) */
} fc_backend;

/** A strided view of caller-owned memory. shape/strides beyond ndim are ignored. Every entry
 *  point refuses views whose data pointer is not aligned to the element size, whose byte extent
 *  does not fit int64 or reaches more than 2^57 bytes from data, or whose addresses wrap around. */
typedef struct fc_tensor {
  void* data;
  int32_t dtype;       /**< fc_dtype */
  int32_t device_type; /**< fc_device_type */
  int32_t device_id;   /**< CUDA ordinal; 0 for CPU */
  int32_t ndim;
  int64_t shape[FC_MAX_DIMS];
  int64_t strides[FC_MAX_DIMS]; /**< in elements */
} fc_tensor;

/** Options shared by forward and backward. A zero-initialized struct means FlashAttention's
 *  defaults: scale 1/sqrt(head_dim), no mask, no softcap, dense batch, automatic backend. */
typedef struct fc_attention_options {
  double softmax_scale;  /**< 0 = 1/sqrt(head_dim); must be finite */
  int32_t causal;        /**< bottom-right aligned when seqlen_q != seqlen_k (FlashAttention >= 2.1) */
  int32_t window_left;   /**< sliding window: keys j with i + sk - sq - left <= j; -1 = unbounded */
  int32_t window_right;  /**< keys j <= i + sk - sq + right; -1 = unbounded; causal forces 0 */
  int32_t has_window;    /**< 0: window fields ignored (same as -1, -1) */
  double softcap;        /**< > 0: scores become softcap * tanh(score / softcap); 0 = off */
  const fc_tensor* cu_seqlens_q; /**< NULL for dense batches; int32 (batch + 1) otherwise */
  const fc_tensor* cu_seqlens_k; /**< must be given together with cu_seqlens_q */
  int64_t max_seqlen_q;  /**< varlen only: >= every query length */
  int64_t max_seqlen_k;  /**< varlen only: >= every key length */
  int32_t backend;       /**< fc_backend */
  int32_t deterministic; /**< backward: bit-identical results run to run */
  void* stream;          /**< cudaStream_t for CUDA backends; NULL = the legacy default stream */
  int32_t num_threads;   /**< CPU backends: 0 = every core the process may run on (its affinity mask) */
  /** CUDA varlen calls: nonzero = copy cu_seqlens_q / cu_seqlens_k to the host and validate them as
   *  CPU ones are (start at 0, non-decreasing, within the packed tensors and max_seqlen) before any
   *  work; this synchronizes `stream`. 0 = their values are trusted, as in flash_attn (the
   *  environment variable FLASHCORE_CHECK_CU_SEQLENS=1 turns the check on for every call).
   *  Ignored for CPU tensors, which are always validated. */
  int32_t check_cu_seqlens;
  /** CUDA varlen calls, optional: an int32 in device memory on q's device (zero it first) that a
   *  one-CTA kernel, run on `stream` before the attention, sets to 1 when cu_seqlens break those
   *  rules; no host synchronization (CUDA-graph safe). A flagged call still reads and writes only
   *  inside its tensors (each sequence is clamped into them) but its results are not meaningful.
   *  NULL = no check. Ignored for CPU tensors and dense calls. */
  int32_t* error_flag;
  int32_t reserved[4];
  /** Since FC_ABI_VERSION 2. Forward of a varlen call only: paged K/V, as flash_attn_varlen_func's
   *  block_table. k/v are then (num_pages, page_size, heads_kv, head_dim) and int32 block_table
   *  (batch, max_pages_per_seq) lists sequence b's pages in order: its key j (j < cu_seqlens_k[b +
   *  1] - cu_seqlens_k[b]) sits in page block_table[b, j / page_size] at slot j % page_size.
   *  cuda_sm80 reads pages of a multiple of 256 keys (as flash_attn) and one page per sequence in
   *  place, and first gathers other pages (and any with ALiBi and dropout together) into packed
   *  rows in the workspace, 2 x batch x max_seqlen_k rows (refused above 4 GiB of it); cuda_sm90
   *  takes any page size: it reads pages of
   *  128k keys, one page per sequence, and pages of 16 / 32 / 64 keys (head_dim <= 128, no
   *  softcap, ALiBi or dropout; pages of 16 where the copy below would cost more) in place, and first gathers other
   *  pages into packed rows in the workspace, 2 x batch x max_seqlen_k rows (above 4 GiB of it,
   *  pages of 256k keys go to cuda_sm80 under FC_BACKEND_AUTO); the CPU backends take any. Page ids in GPU
   *  memory are trusted like cu_seqlens: a wrong one never makes a kernel read outside k/v (it
   *  is clamped) but the results are not meaningful. NULL = k/v are packed as usual. */
  const fc_tensor* block_table;
  /** Since FC_ABI_VERSION 3. ALiBi, as flash_attn's alibi_slopes: float32 (heads_q) or (batch,
   *  heads_q) on q's device. The score of query i and key j (positions inside their sequence) gets
   *  the bias -slope[b, h] * |i + seqlen_k - seqlen_q - j| after softmax_scale and softcap, in
   *  forward and backward (lse includes it). Served by cpu_reference, cpu_flash, cuda_sm80 and
   *  cuda_sm90, paged K/V included;
   *  fc_attention_kvcache takes them too (seqlen_k there is the sequence's keys after the append,
   *  key j counted from the first after cache_leftpad). CPU slopes must
   *  be finite; CUDA slopes are trusted (a NaN slope gives NaN rows). NULL = no bias. */
  const fc_tensor* alibi_slopes;
  /** Since FC_ABI_VERSION 4. CUDA: SMs the call leaves to work running beside it (FlashAttention-3's
   *  sm_margin), e.g. the communication kernels of ring attention. The Hopper kernels whose grids
   *  hold one CTA per SM and walk a fixed list of tiles (forward; backward without a mask) size
   *  their grids for SM count - sm_margin SMs (at least one), so no CTA waits for an SM that such
   *  a kernel holds while the others finish their lists; the split-KV plans (the Hopper forward's,
   *  the decode kernel's on any GPU) choose their split counts for those SMs too, which changes a
   *  split call's rounding (not its accuracy). Other grids (one CTA per tile) and CPU backends
   *  ignore it. 0 = every SM; negative is an error. */
  int32_t sm_margin;
  /** Since FC_ABI_VERSION 5. Dropout of the attention probabilities, as flash_attn's dropout_p
   *  (training): in [0, 1); 0 = none. Each probability P_ij (after the softmax) is kept with
   *  probability 1 - dropout_p and then multiplied by 1 / (1 - dropout_p), else zeroed; lse is the
   *  softmax's, without dropout. Which entries are kept is a pure function of (dropout_seed,
   *  dropout_offset, sequence, query head, query row, key column) (Philox4x32-10; the exact rule is
   *  in src/common/dropout.hpp), the same on every backend, tile shape and thread count: a backward
   *  given the forward's seed and offset drops the same entries. Keep probabilities are multiples
   *  of 2^-16 (a dropout_p whose keep probability rounds to 0 is an error). Served by cpu_reference, cpu_flash,
   *  cuda_sm80 and cuda_sm90 (forward and backward); not by fc_attention_kvcache. Calls need seqlen_k < 2^29 and batch * heads_q < 2^32. */
  double dropout_p;
  uint64_t dropout_seed;
  uint64_t dropout_offset;
} fc_attention_options;

/** Message of the last failed call on this thread ("" when none). Valid until the next call. */
FC_API const char* fc_last_error(void);

/** FC_ABI_VERSION of the library actually loaded (compare with the header's). */
FC_API int32_t fc_abi_version(void);

/** Library version string, e.g. "0.1.0". */
FC_API const char* fc_version(void);

/** Human-readable build configuration: backends compiled in, CUDA archs, head dims, dtypes. */
FC_API const char* fc_build_info(void);

/** Name of a backend ("cpu_reference", "cpu_flash", "cuda_sm80", "cuda_sm90"). */
FC_API const char* fc_backend_name(int32_t backend);

/** Whether a backend is compiled in and has a device to run on (device_id for CUDA). */
FC_API int32_t fc_backend_available(int32_t backend, int32_t device_id);

/** Number of CUDA devices visible (0 when CUDA support is not compiled in or no GPU). */
FC_API int32_t fc_cuda_device_count(void);

/** One line about CUDA device device_id into buffer (NUL-terminated, cut to size - 1 bytes): its
 *  name, compute capability, SMs, memory and, when the device reports its memory clock and bus
 *  width, the DRAM peak bandwidth, e.g. "NVIDIA H200, sm_90, 132 SMs, 139.8 GiB, DRAM peak 4.81
 *  TB/s". FC_ERROR_INVALID_ARGUMENT for no such device or a null / empty buffer, FC_ERROR_CUDA
 *  when the device cannot be queried; on error nothing is written. Added without a change of
 *  FC_ABI_VERSION (a new function, no layout change): a library without it fails to link or load. */
FC_API fc_status fc_cuda_device_describe(int32_t device_id, char* buffer, size_t size);

/** Scratch memory (bytes, on the tensors' device) that fc_attention_forward needs for these
 *  arguments. Validates like the call itself. A workspace given to a CUDA call (non-NULL with
 *  workspace_bytes > 0; here and in fc_attention_backward and fc_attention_kvcache) must be
 *  16-byte aligned, as cudaMalloc's are: the kernels store 16-byte vectors there. */
FC_API fc_status fc_attention_forward_workspace(const fc_tensor* q, const fc_tensor* k,
                                                const fc_tensor* v,
                                                const fc_attention_options* options,
                                                size_t* workspace_bytes);

/** out = softmax(scale * q k^T + mask) v ; lse (optional, may be NULL) = log-sum-exp per row
 *  in natural-log units of the scaled (and capped) scores. Fully masked rows give out = 0 and
 *  lse = -inf. workspace may be NULL when fc_attention_forward_workspace reports 0. Under
 *  FC_BACKEND_AUTO a dense call with a few query rows per KV head (decoding through the forward)
 *  runs on the decode path; on a GPU its split-KV partials are the workspace reported, and with
 *  less the call runs on the forward kernels instead (slower there, same results within the
 *  tolerance of either). On Hopper GPUs a call with few query tiles against long keys splits its
 *  key ranges over the idle SMs where the workspace (16-byte aligned) holds the fp32 partials
 *  that the query reports; with less (only a page gather's part is required) it runs unsplit. */
FC_API fc_status fc_attention_forward(const fc_tensor* q, const fc_tensor* k, const fc_tensor* v,
                                      fc_tensor* out, fc_tensor* lse,
                                      const fc_attention_options* options, void* workspace,
                                      size_t workspace_bytes);

/** Scratch memory (bytes) that fc_attention_backward needs for these arguments. */
FC_API fc_status fc_attention_backward_workspace(const fc_tensor* q, const fc_tensor* k,
                                                 const fc_tensor* v,
                                                 const fc_attention_options* options,
                                                 size_t* workspace_bytes);

/** Gradients of the forward above. out and lse must come from the forward with the same
 *  options. With GQA/MQA the gradients of query heads sharing a KV head are summed into dk/dv.
 *  dq/dk/dv have the shapes and dtypes of q/k/v. */
FC_API fc_status fc_attention_backward(const fc_tensor* dout, const fc_tensor* q,
                                       const fc_tensor* k, const fc_tensor* v,
                                       const fc_tensor* out, const fc_tensor* lse, fc_tensor* dq,
                                       fc_tensor* dk, fc_tensor* dv,
                                       const fc_attention_options* options, void* workspace,
                                       size_t workspace_bytes);


/* ---------------------------------------------------------------------------------------------
 * Inference: attention against a KV cache (flash_attn_with_kvcache semantics).
 *
 *   q            (batch, seqlen_q, heads_q, head_dim): the new query tokens (1 or a few)
 *   k_cache/v_cache  contiguous (batch_cache, seqlen_cache, heads_kv, head_dim), or paged
 *                (num_pages, page_size, heads_kv, head_dim) when block_table is given
 *   block_table  int32 (batch, max_pages_per_seq): page ids of each sequence, in order; NULL = contiguous
 *   cache_seqlens int32 (batch): tokens already in each sequence's cache; NULL (only without
 *                k_new / v_new): every sequence fills its cache (seqlen_cache tokens, or
 *                max_pages_per_seq x page_size), as flash_attn_with_kvcache without cache_seqlens
 *   cache_batch_idx int32 (batch) or NULL: which cache row sequence b uses (contiguous caches only)
 *   k_new/v_new  (batch, seqlen_new, heads_kv, head_dim) or NULL: appended into the cache in place at
 *                positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending
 *                (cache_seqlens itself is not modified; the caller advances it)
 *   out, lse     as in fc_attention_forward; queries sit at the end of each sequence, so causal
 *                means query i attends keys 0 .. cache_seqlens[b] + seqlen_new - seqlen_q + i
 *   num_splits   split-KV (flash-decoding) partitions; 0 = heuristic from batch, heads, length, SMs
 *                and the memory bandwidth; 1 = none. It sets how the kernel that runs the call
 *                splits, not which kernel that is. Calls with many query rows per KV head that run
 *                on the Hopper forward kernels take at most 64, one per 128-key block (64 keys at
 *                head dim 256), and as many as keep the fp32 partials within 1 GiB
 *   cache_leftpad int32 (batch) or NULL, contiguous caches only: sequence b's tokens sit at slots
 *                cache_leftpad[b] .. cache_seqlens[b] - 1 of its cache row (left-padded batches);
 *                it attends over cache_seqlens[b] - cache_leftpad[b] cached tokens (plus the appended
 *                ones), and the masks count from its first slot. 0 <= cache_leftpad[b] <= cache_seqlens[b].
 *   rotary_cos/rotary_sin (seqlen_ro, rotary_dim / 2), q's dtype or float32, or NULL; only with
 *                k_new/v_new: rotary embedding of the first rotary_dim features of the appended keys
 *                (before they are written) and of q, computed in float32 and rounded once, as in
 *                flash_attn. Positions are cache slots: k_new[b, j] at cache_seqlens[b] + j, q[b, i]
 *                at cache_seqlens[b] + i under a causal mask or a window, else at cache_seqlens[b].
 *                rotary_interleaved != 0 rotates pairs (0, 1), (2, 3), ... (GPT-J), else (i, i +
 *                rotary_dim / 2) (GPT-NeoX). Every position must be a row of the tables. q itself is
 *                not modified: CUDA calls rotate it into the workspace.
 * Options: softmax_scale, causal, window, softcap, alibi_slopes, stream, num_threads as usual;
 * backend auto, cpu_flash or cpu_reference (both run the CPU decode path) or cuda_sm80 (the
 * portable kernels only, as on an Ampere GPU: calls with many query rows run sm80's forward where
 * it takes them, else the decode kernel, even on a Hopper GPU where auto takes the Hopper forward;
 * cuda_sm90 is refused: the CUDA path picks its kernels itself); cu_seqlens_*, block_table and
 * error_flag must be null (this call's table and flag are fields of fc_kvcache_args). Values inside cache_seqlens / block_table on the GPU are checked on the
 * device: a sequence whose length exceeds its capacity, whose page id is out of range, whose
 * cache_leftpad is outside 0..cache_seqlens or whose rotary positions pass the tables' rows is not
 * read or written out of bounds; its output rows are set to NaN and *error_flag (when given, int32
 * on the device, zero it first) is set to 1, without a host synchronization.
 * ------------------------------------------------------------------------------------------- */
typedef struct fc_kvcache_args {
  const fc_tensor* q;
  const fc_tensor* k_cache; /**< written in place when k_new is given */
  const fc_tensor* v_cache;
  const fc_tensor* cache_seqlens;
  const fc_tensor* block_table;     /**< NULL for contiguous caches */
  const fc_tensor* cache_batch_idx; /**< NULL = identity */
  const fc_tensor* k_new;           /**< NULL = nothing to append */
  const fc_tensor* v_new;
  fc_tensor* out;
  fc_tensor* lse;      /**< optional */
  int32_t num_splits;  /**< 0 = heuristic; 1 = no split */
  int32_t* error_flag; /**< optional device-side (or host, for CPU) flag for bad cache indices */
  /* Since FC_ABI_VERSION 2; NULL / 0 = off. */
  const fc_tensor* rotary_cos;
  const fc_tensor* rotary_sin;
  int32_t rotary_interleaved; /**< 0 = GPT-NeoX pairs; the C++ KvCacheArgs and Python default to GPT-J */
  const fc_tensor* cache_leftpad;
} fc_kvcache_args;

FC_API fc_status fc_attention_kvcache_workspace(const fc_kvcache_args* args,
                                                const fc_attention_options* options,
                                                size_t* workspace_bytes);

FC_API fc_status fc_attention_kvcache(const fc_kvcache_args* args, const fc_attention_options* options,
                                      void* workspace, size_t workspace_bytes);

/** Merges attention computed over disjoint key sets: out_partials fp32 (num_parts, batch * seqlen_q,
 *  heads, head_dim) (the contiguous 5-D (num_parts, batch, seqlen_q, heads, head_dim) array viewed
 *  as 4-D, since FC_MAX_DIMS is 4), lse_partials fp32 (num_parts, batch, heads, seqlen_q) -> out
 *  (dtype of out) and optional lse. Parts with lse = -inf contribute nothing; all parts -inf gives out 0, lse -inf.
 *  Used for split-KV, cascades and ring attention. */
FC_API fc_status fc_merge_partials(const fc_tensor* out_partials, const fc_tensor* lse_partials,
                                   fc_tensor* out, fc_tensor* lse, const fc_attention_options* options);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FLASHCORE_FLASHCORE_H
