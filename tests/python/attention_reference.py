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


# ---- dropout ------------------------------------------------------------------------------------
# An independent numpy replica of the library's dropout mask (src/common/dropout.hpp): Philox4x32-10
# keyed by the seed, one call per (row, 64-key block, column pair t, half u) of a (sequence, query
# head) problem, whose eight 16-bit draws serve columns 8n + 2t + {0, 1}, n = 4u .. 4u + 3.

_PHILOX_MUL = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
_LOW32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counter arrays (broadcast together) under the key (k0, k1)."""
    c = [np.asarray(x, dtype=np.uint64) for x in np.broadcast_arrays(c0, c1, c2, c3)]
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = _PHILOX_MUL[0] * c[0]
        p1 = _PHILOX_MUL[1] * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _LOW32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _LOW32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0 = (k0 + _PHILOX_WEYL[0]) & 0xFFFFFFFF
        k1 = (k1 + _PHILOX_WEYL[1]) & 0xFFFFFFFF
    return [x.astype(np.uint32) for x in c]


def dropout_keep_mask(p, seed, offset, problem, seqlen_q, seqlen_k):
    """(seqlen_q, seqlen_k) bool: which probabilities of problem b * heads_q + h survive dropout
    with probability p under (seed, offset), positions inside the sequence."""
    threshold = min(int((1.0 - p) * 65536.0 + 0.5), 65536)
    key0 = seed & 0xFFFFFFFF
    key1 = ((seed >> 32) + (offset >> 32)) & 0xFFFFFFFF
    j = np.arange(seqlen_k, dtype=np.uint64)[None, :]
    i = np.arange(seqlen_q, dtype=np.uint64)[:, None]
    group = ((j >> np.uint64(6)) << np.uint64(3)) | (((j >> np.uint64(1)) & np.uint64(3)) << np.uint64(1)) | \
        ((j >> np.uint64(5)) & np.uint64(1))
    words = philox4x32_10(group, i, problem, offset & 0xFFFFFFFF, key0, key1)
    word = (j >> np.uint64(3)) & np.uint64(3)
    chosen = np.choose(np.broadcast_to(word, (seqlen_q, seqlen_k)).astype(np.intp), words).astype(np.uint64)
    draw = (chosen >> ((j & np.uint64(1)) * np.uint64(16))) & np.uint64(0xFFFF)
    return draw < threshold
