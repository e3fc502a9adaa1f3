"""Rotary position embedding for flash_attn_with_kvcache (rotary_cos / rotary_sin), applied to q
and to the appended k before the library call, in float32, rounded once to the input dtype.

flash_attn's rules: rotary_cos / rotary_sin are (seqlen_ro, rotary_dim / 2) and rotate the first
rotary_dim features; only with k and v appended. The appended k[b, j] sits at position
cache_seqlens[b] + j. q[b, i] sits at cache_seqlens[b] + i under a causal mask or a sliding
window, and at cache_seqlens[b] otherwise (every query treated as the next token).
rotary_interleaved=True pairs features (0, 1), (2, 3), ... (GPT-J); False pairs i with
i + rotary_dim / 2 (GPT-NeoX).

Cost: array operations in Python around the library call, ~15-20 small launches per call on a GPU,
which at decode shapes take longer than the attention itself (docs/PERF.md, session 26). For
speed, rotate q and k in a fused kernel of your own and call without rotary_cos / rotary_sin.

Positions past rotary_cos's rows are an error on the CPU (checked before anything is written).
On a GPU checking them would need the lengths on the host (a synchronization), so they are clamped
to the last row there; lengths that are wrong beyond that are flagged by the call itself.
"""

import numpy as np


def _check_tables(cos, sin, head_dim, appending):
    if cos is None or sin is None:
        raise ValueError("rotary_cos, rotary_sin: give both or neither")
    if not appending:
        raise ValueError("rotary_cos: rotary embedding applies only when k and v are appended")
    if len(cos.shape) != 2 or tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"rotary_cos, rotary_sin: expected two (seqlen_ro, rotary_dim / 2) tables of one shape, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.shape[0] < 1 or cos.shape[1] < 1 or 2 * cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos: shape {tuple(cos.shape)} needs at least one row and "
                         f"rotary_dim = 2 x {cos.shape[1]} <= head_dim {head_dim}")


def _rotate(xf, c, s, interleaved, stack, concat):
    """Rotated features of float32 xf (..., rotary_dim) by cos c and sin s (..., rotary_dim / 2)."""
    half = c.shape[-1]
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c
    if interleaved:
        return stack((o1, o2), -1).reshape(xf.shape)
    return concat((o1, o2), -1)


def rotate_torch(q, k, cos, sin, cache_seqlens, per_token_queries, interleaved):
    """(q, k) rotated; torch tensors, cache_seqlens an int32 tensor (batch,) on q's device."""
    import torch

    _check_tables(cos, sin, q.shape[-1], k is not None)
    rows, half = cos.shape
    base = cache_seqlens.to(device=q.device, dtype=torch.int64)[:, None]
    pos_k = base + torch.arange(k.shape[1], device=q.device)[None]
    same_positions = q.shape[1] == k.shape[1] and (per_token_queries or q.shape[1] == 1)
    pos_q = pos_k if same_positions else (
        base + (torch.arange(q.shape[1], device=q.device)[None] if per_token_queries else 0)).expand(q.shape[:2])
    if q.device.type == "cpu":
        last = max(int(pos_k.max()) if pos_k.numel() else 0, int(pos_q.max()) if pos_q.numel() else 0)
        if last >= rows:
            raise ValueError(f"rotary_cos: has {rows} rows, but cache_seqlens and the new tokens reach position {last}")
    cos, sin = cos.to(q.device), sin.to(q.device)  # no copy when they are there already

    def apply(x, pos):
        pos = pos.clamp(0, rows - 1)
        # only the rows used are gathered and widened (a table can hold the whole context)
        c, s = (t[pos].to(torch.float32).unsqueeze(2) for t in (cos, sin))  # (batch, seq, 1, half)
        rot = _rotate(x[..., :2 * half].float(), c, s, interleaved, torch.stack, torch.cat)
        return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)

    if same_positions and q.dtype == k.dtype:  # decode: one pass over q and k side by side
        both = apply(torch.cat((q, k), dim=2), pos_k)
        return both[:, :, :q.shape[2]], both[:, :, q.shape[2]:]
    return apply(q, pos_q), apply(k, pos_k)


def rotate_numpy(q, k, cos, sin, cache_seqlens, per_token_queries, interleaved):
    """(q, k) rotated; numpy arrays (float32, float16 or ml_dtypes bfloat16), cache_seqlens an int
    or an int array (batch,)."""
    _check_tables(cos, sin, q.shape[-1], k is not None)
    cos, sin = np.asarray(cos, dtype=np.float32), np.asarray(sin, dtype=np.float32)
    rows, half = cos.shape
    base = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (q.shape[0],))[:, None]
    pos_k = base + np.arange(k.shape[1])[None]
    pos_q = np.broadcast_to(base + (np.arange(q.shape[1])[None] if per_token_queries else 0), q.shape[:2])
    last = max(pos_k.max(initial=0), pos_q.max(initial=0))
    if last >= rows:
        raise ValueError(f"rotary_cos: has {rows} rows, but cache_seqlens and the new tokens reach position {last}")

    def apply(x, pos):
        pos = np.clip(pos, 0, rows - 1)
        c, s = cos[pos][:, :, None], sin[pos][:, :, None]
        rot = _rotate(x[..., :2 * half].astype(np.float32), c, s, interleaved,
                      lambda xs, axis: np.stack(xs, axis=axis), lambda xs, axis: np.concatenate(xs, axis=axis))
        out = np.array(x, copy=True)
        out[..., :2 * half] = rot.astype(x.dtype)
        return out

    return apply(q, pos_q), apply(k, pos_k)
