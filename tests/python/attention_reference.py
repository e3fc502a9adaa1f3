"""The fp64 numpy attention reference shared by the Python test files: bottom-right aligned
causal / sliding-window masks, softcap, ALiBi, GQA, fully masked rows (out 0, lse -inf). Not a
test module (no test_ prefix); the test files import it from their own directory."""

import numpy as np


def allowed_keys(seqlen_q, seqlen_k, causal, window):
    """(seqlen_q, seqlen_k) bool mask: bottom-right aligned causal / sliding window."""
    left, right = window
    if causal:
        right = 0
    rows = np.arange(seqlen_q)[:, None]
    keys = np.arange(seqlen_k)[None, :]
    diagonal = rows + seqlen_k - seqlen_q
    allowed = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        allowed &= keys >= diagonal - left
    if right >= 0:
        allowed &= keys <= diagonal + right
    return allowed


def scores(q, k, scale, softcap):
    # q (sq, hq, d), k (sk, hq, d) already expanded to query heads -> (hq, sq, sk)
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    return s


def alibi_bias(seqlen_q, seqlen_k, slopes, dtype=np.float64):
    """(hq, sq, sk) ALiBi bias of one sequence, flash_attn's: -slope[h] * |i + sk - sq - j|, added
    to the scores after the scale and the softcap. slopes (hq,); None gives 0."""
    if slopes is None:
        return np.zeros((1, seqlen_q, seqlen_k), dtype)
    rows = np.arange(seqlen_q)[:, None]
    keys = np.arange(seqlen_k)[None, :]
    distance = np.abs(rows + seqlen_k - seqlen_q - keys).astype(dtype)
    return -np.asarray(slopes, dtype)[:, None, None] * distance[None]


def sequence_forward(q, k, v, scale, causal, window, softcap, compute_dtype, p_dtype, slopes=None):
    """One sequence: out (sq, hq, d) and lse (hq, sq). compute_dtype float64 is the truth;
    float32 with p_dtype = the input dtype is the naive same-precision implementation. slopes
    (hq,): this sequence's ALiBi slopes, or None."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scores(q, k, scale, softcap) + alibi_bias(q.shape[0], k.shape[0], slopes, compute_dtype)
    s = np.where(allowed_keys(q.shape[0], k.shape[0], causal, window)[None], s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0)
    p = np.exp(s - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(row_sum > 0, np.log(row_sum) + row_max, -np.inf)[..., 0]
        p = np.where(row_sum > 0, p / row_sum, 0)
    p = p.astype(p_dtype).astype(compute_dtype)
    out = np.einsum("hij,jhd->ihd", p, v)
    return out, lse
