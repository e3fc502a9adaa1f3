"""The FlashAttention-2 Python API (flash_attn.flash_attn_interface) on top of flashcore.

Same function names, argument names, defaults, shapes and semantics as flash_attn, so that
``import flashcore as flash_attn`` runs flash_attn code unchanged:
  - torch tensors (CUDA or CPU) go through flashcore._torch: custom ops with autograd,
    torch.compile and CUDA-graph support;
  - numpy arrays and other DLPack arrays go through flashcore._dlpack_api (forward only).
dropout_p works on torch tensors, forward and backward, on the CPU backends and on the GPU (the
Hopper kernels and the portable sm80 ones): the mask's seed comes from
torch's default generator (torch.manual_seed reproduces it), and a call with dropout cannot be
captured in a CUDA graph (the seed is drawn on the host).
What flash_attn offers and flashcore does not raise NotImplementedError: dropout_p != 0 on numpy /
DLPack arrays (flashcore.attention_forward takes an explicit seed) or with a block_table; on a GPU
a head_dim that is not a multiple of 8 in flash_attn_with_kvcache and in a paged (block_table)
flash_attn_varlen_func call, and in any call on other DLPack arrays (the dense and varlen calls
on torch tensors pad it to the next multiple of 8 and cut the output back, as flash_attn does).
alibi_slopes works everywhere, forward and backward, paged calls included.
Paged caches: flash_attn_with_kvcache
(with rotary_cos / rotary_sin and cache_leftpad, all inside the library call) and
flash_attn_varlen_func's block_table (forward). return_attn_probs returns
(out, softmax_lse, S_dmask) with S_dmask an empty tensor (0,) of out's dtype and device, which is
what flash_attn returns without dropout; with dropout flash_attn's S_dmask (the probabilities with
the dropout pattern, a testing aid) is not materialized and the tensor stays empty.
flash_attn_with_kvcache has no autograd, as in flash_attn.
merge_partials is flashcore's own (combining attention over disjoint key sets).
"""

import numpy as np

from . import _dlpack_api

# Set by set_default_backend(); read at call time (and at trace time under torch.compile).
_default_backend = "auto"
_torch_impl = None  # flashcore._torch, once torch tensors have been seen (or torch was loaded)


def set_default_backend(backend):
    """Backend the flash_attn_* functions use: 'auto' (default) or a name from
    flashcore.backends(), e.g. 'cpu_reference' to run the fp64 oracle."""
    global _default_backend
    _dlpack_api.backend_id(backend)  # validates
    _default_backend = backend


def _load_torch_impl():
    global _torch_impl
    if _torch_impl is None:
        from . import _torch

        _torch_impl = _torch
    return _torch_impl


def _is_torch(x):
    if _torch_impl is not None:
        return _torch_impl.is_tensor(x)
    return type(x).__module__.startswith("torch")


def _check_dropout(dropout_p, q, block_table=None):
    """dropout_p as a float, or the reason it cannot be served here."""
    if dropout_p == 0.0:
        return 0.0
    if not _is_torch(q):
        raise NotImplementedError("dropout_p: needs torch tensors here (their seed comes from torch's generator); "
                                  "flashcore.attention_forward / attention_backward take numpy arrays with an "
                                  "explicit dropout_seed")
    if block_table is not None:
        raise NotImplementedError("dropout_p: not supported with a block_table (paged K/V is forward only, for "
                                  "inference)")
    return float(dropout_p)


def _last_dim_contiguous_numpy(x):
    # flash_attn accepts any layout and copies when the head_dim stride is not 1; do the same.
    import numpy as np

    if isinstance(x, np.ndarray) and x.ndim > 0 and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        return np.ascontiguousarray(x)
    return x


def _empty_probs(out):
    """flash_attn's third return value with return_attn_probs and no dropout: an empty tensor."""
    if _is_torch(out):
        return out.new_empty((0,))
    return np.empty((0,), dtype=out.dtype)


def _head_dim_padding(q):
    """Columns to add to a head_dim that the GPU kernels cannot take (they move 16-byte rows: a
    multiple of 8 elements); 0 on the CPU, whose backends take any head_dim."""
    return -q.shape[-1] % 8 if q.is_cuda else 0


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
               dropout_p=0.0):
    if _is_torch(q):
        # As flash_attn does: zero columns padded onto q, k and v add nothing to Q K^T and give
        # output columns of 0, which are cut off again; the scale stays the caller's head_dim's.
        # The pad and the cut are torch ops, so autograd and torch.compile see through them.
        head_dim, pad = q.shape[-1], _head_dim_padding(q)
        if pad:
            import torch.nn.functional as F

            if softmax_scale is None:
                softmax_scale = head_dim ** -0.5
            q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        out, lse = _load_torch_impl().attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_size, softcap, deterministic, _default_backend, alibi_slopes, dropout_p)
        if pad:
            out = out[..., :head_dim]
    else:
        q, k, v = (_last_dim_contiguous_numpy(x) for x in (q, k, v))
        out, lse = _dlpack_api.attention_forward(
            q, k, v, return_lse=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, backend=_default_backend,
            alibi_slopes=alibi_slopes)
    return (out, lse, _empty_probs(out)) if return_attn_probs else out


def _split_packed(packed, axis, count, name):
    if packed.ndim <= axis or packed.shape[axis] != count:
        raise ValueError(f"{name}: expected size {count} at dimension {axis}, got shape "
                         f"{tuple(packed.shape)}")
    index = (slice(None),) * axis
    return tuple(packed[index + (i,)] for i in range(count))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads % nheads_k == 0 (GQA/MQA). Causal and window masks are aligned to the bottom-right
    corner; query i attends to keys in [i + sk - sq - window_size[0], i + sk - sq +
    window_size[1]]. alibi_slopes (nheads,) or (batch, nheads), float32 on q's device: the
    score of query i and key j gets -slope * |i + seqlen_k - seqlen_q - j| (no gradient for the
    slopes). Returns out (batch, seqlen_q, nheads, headdim) in q's memory layout (as flash_attn:
    a q viewed from (batch, nheads, seqlen, headdim) storage gives such an out), or (out,
    softmax_lse, S_dmask) with return_attn_probs (S_dmask empty: see the module's docstring),
    softmax_lse (batch, nheads, seqlen_q) in float32.
    With the 'auto' backend a call with a few query rows per KV head (decoding without a KV-cache API) runs on the
    decode kernel, as flash_attn_with_kvcache over the same tensors would. dropout_p in [0, 1): each
    probability is kept with probability 1 - dropout_p and scaled by 1 / (1 - dropout_p), the mask drawn
    from a seed that torch's default generator supplies (torch.manual_seed reproduces it) and reused by
    the backward; the lse is unaffected."""
    dropout_p = _check_dropout(dropout_p, q)
    return _attention(q, k, v, None, None, None, None, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, dropout_p)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Otherwise as flash_attn_func."""
    dropout_p = _check_dropout(dropout_p, qkv)
    q, k, v = _split_packed(qkv, 2, 3, "qkv")
    return _attention(q, k, v, None, None, None, None, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, dropout_p)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    dropout_p = _check_dropout(dropout_p, q)
    k, v = _split_packed(kv, 2, 2, "kv")
    return _attention(q, k, v, None, None, None, None, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, dropout_p)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q/k:
    (batch + 1,) int32 prefix sums (int64 is converted); max_seqlen_q/k: ints >= every
    length. alibi_slopes as in flash_attn_func, positions counted inside each sequence.
    Returns out (total_q, nheads, headdim), or (out, softmax_lse, None) with softmax_lse
    (nheads, total_q). block_table (batch, max_num_blocks_per_seq) int32: k and v are paged
    caches (num_blocks, page_block_size, nheads_k, headdim), sequence b's keys in pages
    block_table[b] (lengths from cu_seqlens_k); forward only, as in flash_attn (any page size:
    on GPUs other than Hopper pages of a multiple of 256 keys are read in place and other sizes
    first gathered into the call's workspace, up to 4 GiB), alibi_slopes included. Decoding calls
    (at most 16 query rows per KV head: max_seqlen_q x the GQA group) run on the decode kernel,
    which takes any page size."""
    dropout_p = _check_dropout(dropout_p, q, block_table)
    if block_table is None:
        return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                          return_attn_probs, dropout_p)
    if _is_torch(q):
        out, lse = _load_torch_impl().attention_paged(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            softmax_scale, causal, window_size, softcap, _default_backend, alibi_slopes)
    else:
        q = _last_dim_contiguous_numpy(q)
        out, lse = _dlpack_api.attention_forward(
            q, k, v, return_lse=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, backend=_default_backend,
            block_table=block_table, alibi_slopes=alibi_slopes)
    return (out, lse, _empty_probs(out)) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens shared by queries and keys."""
    dropout_p = _check_dropout(dropout_p, qkv)
    q, k, v = _split_packed(qkv, 1, 3, "qkv")
    return _attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                      dropout_p)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    dropout_p = _check_dropout(dropout_p, q)
    k, v = _split_packed(kv, 1, 2, "kv")
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, dropout_p)


def _check_unsupported_kvcache(cache_leftpad, block_table):
    if cache_leftpad is not None and block_table is not None:
        raise NotImplementedError("cache_leftpad: not supported with a paged cache (block_table), as in flash_attn")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Decoding / incremental attention against a KV cache (inference only, no autograd).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or paged (num_blocks, page_block_size, nheads_k, headdim) with
    block_table (batch, max_num_blocks_per_seq) int32. k, v (batch, seqlen_new, nheads_k,
    headdim), when given, are written into the caches in place starting at cache_seqlens
    (which the caller advances afterwards). cache_seqlens: int or (batch,) int32 (int64 is
    converted); None means every slot of the cache. cache_batch_idx (batch,) int32: cache row of
    each sequence. Causal/window masks are aligned to the bottom-right (queries are the last
    tokens). num_splits: 0 = heuristic, 1 = no split-KV. Returns out (batch, seqlen_q, nheads,
    headdim), or (out, softmax_lse) with return_softmax_lse, softmax_lse (batch, nheads,
    seqlen_q) float32. rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2), q's dtype or
    float32, with k and v appended: rotary embedding of q and of the appended k as in flash_attn,
    fused into the call (k[b, j] at position cache_seqlens[b] + j; q[b, i] at cache_seqlens[b] + i
    under a causal mask or a window, else at cache_seqlens[b]; rotary_interleaved picks GPT-J or
    GPT-NeoX pairs). cache_leftpad (batch,) int32, contiguous caches: sequence b's tokens sit at
    slots cache_leftpad[b] .. cache_seqlens[b] - 1 of its row. alibi_slopes float32 (nheads) or
    (batch, nheads): ALiBi, key j at distance |i + seqlen_k - seqlen_q - j| from query i, seqlen_k
    counting the appended keys."""
    _check_unsupported_kvcache(cache_leftpad, block_table)
    if (k is None) != (v is None):
        raise ValueError("k, v: give both (to append into the caches) or neither")
    if cache_seqlens is None and k is not None:
        raise ValueError("cache_seqlens: is required when k and v are appended")
    # cache_seqlens None travels as a null tensor: every sequence fills its cache, with no
    # lengths array to build (a fill kernel per call on a GPU).
    extras = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  rotary_interleaved=bool(rotary_interleaved), cache_leftpad=cache_leftpad,
                  alibi_slopes=alibi_slopes)
    try:
        if _is_torch(q):
            return _load_torch_impl().attention_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                softmax_scale, causal, window_size, softcap, num_splits, return_softmax_lse,
                _default_backend, **extras)
        q, k, v = (_last_dim_contiguous_numpy(x) for x in (q, k, v))
        return _dlpack_api.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
            cache_batch_idx=cache_batch_idx, return_lse=return_softmax_lse,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            num_splits=num_splits, backend=_default_backend, **extras)
    except ValueError as e:
        # The library calls the appended tokens k_new / v_new; this API's arguments are k / v.
        message = str(e)
        for lib_name, arg in (("k_new:", "k:"), ("v_new:", "v:")):
            if message.startswith(lib_name):
                raise ValueError(arg + message[len(lib_name):]) from None
        raise


def merge_partials(out_partials, lse_partials, out=None, lse=None):
    """Merges attention computed over disjoint key sets (split-KV, cascades, ring attention).

    out_partials float32 (num_parts, batch, seqlen_q, heads, head_dim); lse_partials float32
    (num_parts, batch, heads, seqlen_q), natural-log, -inf for parts that saw no keys. out
    (batch, seqlen_q, heads, head_dim, any float dtype) and lse float32 (batch, heads, seqlen_q)
    may be passed in; otherwise both are float32, allocated with out_partials' framework on its
    device. torch CUDA tensors run on the current stream. Returns (out, lse)."""
    if _is_torch(out_partials):
        return _load_torch_impl().merge_partials(out_partials, lse_partials, out, lse,
                                                 _default_backend)
    return _dlpack_api.merge_partials(out_partials, lse_partials, out, lse,
                                      backend=_default_backend)
