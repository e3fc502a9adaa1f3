"""Padding helpers for the varlen entry points, with flash_attn.bert_padding's names and returns.

Models batch sequences of different lengths as (batch, seqlen, ...) with an attention mask; the
varlen calls (flash_attn_varlen_func and its packed forms) take the tokens packed as (total, ...)
with cu_seqlens. ``unpad_input`` packs, ``pad_input`` scatters the result back:

    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                       max_seqlen, max_seqlen, causal=True)
    out = pad_input(out_unpad, indices, batch, seqlen)

Plain torch indexing, so autograd and any device work as for other torch ops; unpad_input's sizes
depend on the mask's values (nonzero, the longest row), which breaks a torch.compile graph there,
as flash_attn's does. This module imports torch; ``import flashcore`` does not load it.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "IndexFirstAxis",
    "IndexFirstAxisResidual",
    "IndexPutFirstAxis",
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input, indices):
    """input[indices] along the first axis: (first_axis, ...) -> (len(indices), ...)."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A (first_axis_dim, ...) tensor of zeros with values at the rows `indices`."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def index_first_axis_residual(input, indices):
    """(input[indices], input): the gathered rows and the whole input for a residual branch, as
    flash_attn's; the gradient reaching input is the gathered rows' scattered back plus the
    residual's, which autograd adds here by itself."""
    return input[indices], input


class IndexFirstAxis:
    """flash_attn's autograd Function names, for code that calls ``X.apply`` directly: plain torch
    indexing already has the gradients those Functions define."""

    apply = staticmethod(index_first_axis)


class IndexPutFirstAxis:
    """See IndexFirstAxis."""

    apply = staticmethod(index_put_first_axis)


class IndexFirstAxisResidual:
    """See IndexFirstAxis."""

    apply = staticmethod(index_first_axis_residual)


def _packed(hidden_states, keep, seqlens):
    """The rows of hidden_states (batch, seqlen, ...) where keep (batch, seqlen) is true, in
    row-major order, with their flat indices, cu_seqlens (int32, from seqlens) and the longest."""
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the tokens of a padded batch.

    hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), bool or int, nonzero =
    a token; unused_mask (optional, same shape): positions that are allocated but not attended
    (kept in the packed rows and counted in cu_seqlens, not in the used lengths). A row's tokens
    need not be contiguous: they are taken in order.

    Returns (hidden_states (total, ...), indices (total,) into the flattened batch x seqlen
    positions, cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int), used_seqlens_in_batch
    (batch,) int32: the attention_mask's tokens per row).
    """
    used = attention_mask.bool()
    keep = used if unused_mask is None else used | unused_mask.bool()
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    packed, indices, cu_seqlens, max_seqlen = _packed(hidden_states, keep, seqlens)
    return packed, indices, cu_seqlens, max_seqlen, used.sum(dim=-1, dtype=torch.int32)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packs rows that each hold several sequences back to back (sequence packing).

    attention_mask_in_length: (batch, seqlen), row b = the lengths of the sequences in row b in
    order, then zeros, e.g. [[2, 3, 0, 0, 0], [3, 2, 0, 0, 0]]: row 0 holds a 2-token and a
    3-token sequence in positions 0-4. Returns (hidden_states (total, ...), indices, cu_seqlens
    (int32, one entry per sequence + 1), max_seqlen_in_batch (int)).
    """
    lengths = attention_mask_in_length
    seqlens = lengths.flatten()[lengths.flatten() > 0].to(torch.int32)  # row 0's first
    totals = lengths.sum(dim=-1)
    positions = torch.arange(lengths.shape[-1], device=lengths.device)
    keep = positions[None, :] < totals[:, None]
    return _packed(hidden_states, keep, seqlens)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: (total, ...) rows back to (batch, seqlen, ...), zeros at the
    positions no index names."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
