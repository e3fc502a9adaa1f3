"""cache_leftpad for flash_attn_with_kvcache: caches whose sequences start at a per-sequence
offset inside their row (left-padded batches), expressed as a paged cache of one-token pages.

flash_attn's rules (contiguous caches only): sequence b's tokens sit at slots
[cache_leftpad[b], cache_seqlens[b]) of its cache row; the new tokens are written at slots
cache_seqlens[b] ...; masks and rotary positions count from cache_leftpad[b]. Here the cache is
viewed as pages of one token (no copy: appended tokens land in the caller's tensors) with a
block table mapping sequence b's token j to slot cache_leftpad[b] + j of its row, and -1 past the
row's end, so the library's own checks catch a sequence that would run past it: an error on the
CPU, NaN rows and error_flag on a GPU (no host synchronization there). On the CPU the values are
also checked here first, so the errors name cache_leftpad. Cost: the table is built per call and
the one-token pages read a table entry per key: 2-3.5x slower than a plain call at decode shapes
(docs/PERF.md, session 26).
"""

import numpy as np


def _pages_error(name, shape, strides):
    return NotImplementedError(
        f"{name}: cache_leftpad needs a cache whose (batch, seqlen) dimensions merge into one "
        f"(shape {tuple(shape)}, strides {tuple(strides)})")


def _check_values(leftpad, lengths, seqlen_new, slots, row, rows):
    for b, r in enumerate(row.tolist()):
        if not 0 <= r < rows:
            raise ValueError(f"cache_batch_idx: entry {b} is {r}, outside 0..{rows - 1} (k_cache rows)")
    for b, (pad, length) in enumerate(zip(leftpad.tolist(), lengths.tolist())):
        if pad < 0 or pad > length:
            raise ValueError(f"cache_leftpad: entry {b} is {pad}, outside 0..cache_seqlens[{b}] = {length}")
        if length + seqlen_new > slots:
            raise ValueError(f"cache_seqlens: entry {b} ({length}) + seqlen_new {seqlen_new} exceeds the cache "
                             f"row's {slots} slots")


def as_pages_torch(k_cache, v_cache, cache_seqlens, cache_batch_idx, leftpad, seqlen_new):
    """(k_pages, v_pages, cache_seqlens from each sequence's start, block_table) for torch
    tensors; cache_seqlens an int32 tensor (batch,)."""
    import torch

    rows, slots = k_cache.shape[:2]
    pages = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        try:
            pages.append(cache.view(rows * slots, 1, *cache.shape[2:]))
        except RuntimeError:
            raise _pages_error(name, cache.shape, cache.stride()) from None
    batch = cache_seqlens.shape[0]
    if not isinstance(leftpad, torch.Tensor) or leftpad.shape != (batch,):
        raise ValueError(f"cache_leftpad: expected an integer tensor of shape ({batch},)")
    pad = leftpad.to(device=k_cache.device, dtype=torch.int64)
    lengths = cache_seqlens.to(torch.int64)
    row = (torch.arange(batch, device=k_cache.device) if cache_batch_idx is None
           else cache_batch_idx.to(device=k_cache.device, dtype=torch.int64))
    if k_cache.device.type == "cpu":
        _check_values(pad, lengths, seqlen_new, slots, row, rows)
    slot = pad[:, None] + torch.arange(slots, device=k_cache.device)[None]
    table = torch.where(slot < slots, row[:, None] * slots + slot, torch.full_like(slot, -1))
    return pages[0], pages[1], (lengths - pad).to(torch.int32), table.to(torch.int32)


def as_pages_numpy(k_cache, v_cache, cache_seqlens, cache_batch_idx, leftpad, seqlen_new):
    """The same for numpy arrays; cache_seqlens an int or an integer array (batch,)."""
    rows, slots = k_cache.shape[:2]
    pages = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        view = cache.view()
        try:
            view.shape = (rows * slots, 1) + cache.shape[2:]  # raises rather than copy
        except AttributeError:
            raise _pages_error(name, cache.shape, cache.strides) from None
        pages.append(view)
    pad = np.asarray(leftpad)
    if pad.ndim != 1 or not np.issubdtype(pad.dtype, np.integer):
        raise ValueError(f"cache_leftpad: expected a 1-D integer array, got shape {pad.shape}, dtype {pad.dtype}")
    batch = pad.shape[0]
    lengths = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,))
    pad = pad.astype(np.int64)
    row = np.arange(batch) if cache_batch_idx is None else np.asarray(cache_batch_idx, dtype=np.int64)
    _check_values(pad, lengths, seqlen_new, slots, row, rows)
    slot = pad[:, None] + np.arange(slots)[None]
    table = np.where(slot < slots, row[:, None] * slots + slot, -1)
    return pages[0], pages[1], (lengths - pad).astype(np.int32), table.astype(np.int32)
