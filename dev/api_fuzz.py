"""Randomized differential fuzz of flashcore's backends through the Python API (a development tool,
not a test). On the CPU (the default, `--device cpu`; session 47 ran ~71,000 iterations as
dev/cpu_fuzz.py and found one misleading cu_seqlens error message, since fixed) it exercises
cpu_flash and cpu_reference (the fp64 oracle), plus auto three times in ten; with `--device cuda`
(a GPU machine) cuda_sm80 and auto, plus cuda_sm90 on a CC 9.0 device, at least two of them
per iteration.

Every backend is compared with an independent float64 plain-torch implementation written here
(dense, varlen, paged varlen, KV cache with append / rotary / leftpad / cache_batch_idx / paged
caches, ALiBi, softcap, windows, dropout through the test suite's numpy replica of the Philox
mask); the CPU run thereby also compares cpu_flash with cpu_reference.
Tolerance (tests' rule): max|X - truth| <= F * max|X_same - truth| + atol, X_same = a naive
same-precision computation (fp32 math, P rounded to the dtype), atol = 2 roundings at the
truth's magnitude; fp32 additionally passes with a relative (norm) error <= 1e-5.

CUDA mode: inputs are drawn on the CPU exactly as in CPU mode and moved to the GPU for the call;
the truth stays on the CPU (fp64 / fp32, 8 threads) and results come back with .cpu(). Only fp16
and bf16 are drawn (the CUDA backends take no fp32), sequences reach ~1100 tokens (multi-tile
paths; a larger work cap keeps the truth within seconds), paged and KV-cache calls take head dims
that are multiples of 8 (the library pads only the dense and varlen calls), and invalid inputs
are limited to the ones the library checks on the host (values inside CUDA index tensors are
checked by the kernels, not reported as errors). A documented refusal of one backend (REFUSALS)
skips that backend for the iteration and is counted as skip:<backend>:<reason>. Each iteration
ends with torch.cuda.synchronize(), so an asynchronous fault is charged to its seed; one that
leaves the CUDA context unusable stops the run.

Usage: PYTHONPATH=<package> nice -n 10 python3 dev/api_fuzz.py [--device cpu|cuda] [--minutes M]
       [--seed S] [--repro SEED] [--modes dense,varlen,paged,kvcache,invalid] [--out FILE]
Failures go to --out (default /tmp/fz_failures.jsonl; one JSON object per failure, with the
iteration seed: `--repro SEED` with the same --device replays it).
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from attention_reference import allowed_keys, dropout_keep_mask  # noqa: E402

import flashcore as fc  # noqa: E402

torch.set_num_threads(1)
NEG = -1e30
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FAIL_LOG = "/tmp/fz_failures.jsonl"
CUR = [None]

# Where the library's tensors live; main() switches these for --device cuda (setup_cuda).
DEVICE = "cpu"
GPU_BACKENDS = []  # cuda mode: "cuda_sm80", "cuda_sm90" on a CC 9.0 device, "auto"
# Bound on a case's sum(len_q x len_k) x heads_q x head_dim, what the float64 truth costs.
WORK_CAP = 3e7
# CUDA mode only: also bound sum(len_q x len_k) x heads_q, the size of the truth's materialized
# (heads, len_q, len_k) fp64 score matrices and of the numpy dropout mask (~0.26 us an entry).
PAIR_CAP = 1e7
LONG_LEN = 1100  # CUDA mode: the longest sequence pick_len draws
TRUTH_THREADS = 1  # torch threads of the truth computation (8 in CUDA mode)


class Failure(Exception):
    pass


def on_cuda():
    return DEVICE == "cuda"


def dev(x):
    """x on the device the library is fuzzed on (the same tensor in CPU mode)."""
    return x.to(DEVICE) if on_cuda() and torch.is_tensor(x) else x


def host(x):
    """x on the CPU, where the truth and the comparisons are (the same tensor in CPU mode)."""
    return x.cpu() if on_cuda() and torch.is_tensor(x) else x


def reset_threads():
    torch.set_num_threads(TRUTH_THREADS)


# ---- documented refusals of the CUDA backends ---------------------------------------------------
# A backend that cannot serve a valid call says so with FC_ERROR_UNSUPPORTED (NotImplementedError
# in Python). Those below are refusals by design, found in the code: the backend is skipped for the
# iteration and counted as skip:<backend>:<reason>. Any other NotImplementedError stays a failure:
#  - validate_for_backend (src/api/validate.cpp): "q: dtype float32 is not supported by backend"
#    and "q: head_dim N is not a multiple of 8": never drawn here (fp16 / bf16 only; the dense and
#    varlen torch calls pad the head_dim in Python, paged and KV-cache calls get multiples of 8),
#    so seeing one is a bug. The same for "backend: X is not available" (GPU_BACKENDS keeps only
#    what backend_available says), for the launch-time guards behind a *_supports function
#    ("cuda_sm90 forward: pages of N ...", "... GQA group cannot be packed", "cuda_sm80 forward:
#    ... grid limit", "backward dq stage: dropout kernels are not compiled") and for Python's own
#    refusals (dropout or autograd with a block_table, cache_leftpad with pages: not drawn).
#  - sm80_supports (src/cuda/sm80/forward_api.cu), also what AUTO runs where sm90 cannot: pages it
#    would gather (not a multiple of 256 keys) into more than 4 GiB (not drawn); head_dim above
#    256 / over 2^31 rows: not drawn.
#  - sm90_supports / sm90_backward_supports (src/cuda/sm90/forward_api.cu, backward_api.cu), only
#    when cuda_sm90 is named (AUTO then takes sm80): q / k / v / dout strides TMA cannot describe,
#    out / dk / dv without even strides (the layouts drawn here keep strides multiples of 8, so
#    not expected), a page gather above 4 GiB, 32-bit row indexing of the backward.
#  - the KV-cache entry (src/api/kvcache_api.cpp, src/cuda/decode/decode_api.cu): cuda_sm90 serves
#    none (kept out of the KV-cache mode's backends), shared memory the GPU does not offer, the
#    decode kernel's grid limits.
#  - build-dependent on every backend: a dtype or head-dim bucket not compiled in
#    (FLASHCORE_DTYPES / FLASHCORE_HEAD_DIMS).
# (pattern, backends it may come from, short reason)
REFUSALS = [
    (r"\(FLASHCORE_(DTYPES|HEAD_DIMS)\)", ("cuda_sm80", "cuda_sm90", "auto"), "not_compiled"),
    (r"^cuda_sm80: paged k / v in pages of \d+ keys would need \d+ bytes of workspace to gather", ("cuda_sm80", "auto"),
     "gather_4GiB"),
    (r"^cuda_sm90: q, k and v need 16-byte aligned data", ("cuda_sm90",), "tma_strides"),
    (r"^cuda_sm90: out needs 4-byte aligned data", ("cuda_sm90",), "out_strides"),
    (r"^cuda_sm90: dout needs 16-byte aligned data", ("cuda_sm90",), "dout_strides"),
    (r"^cuda_sm90: d[kv] needs 4-byte aligned data", ("cuda_sm90",), "dkdv_strides"),
    (r"^cuda_sm90: paged k / v would need \d+ bytes of workspace to gather", ("cuda_sm90",), "gather_4GiB"),
    (r"^cuda_sm90: the backward indexes heads_q \* total_q rows in 32 bits", ("cuda_sm90",), "bwd_32bit"),
    (r"^backend: cuda_sm90 does not serve the KV-cache entry points", ("cuda_sm90",), "kvcache"),
    (r"^q: head_dim \d+: the CUDA KV-cache kernel needs \d+ bytes of shared memory", ("cuda_sm80", "auto"), "smem"),
    (r"^q: this KV-cache call runs on the decode kernel, whose grid", ("cuda_sm80", "auto"), "decode_grid"),
    (r"^q: batch or heads exceed the CUDA grid limits", ("cuda_sm80", "auto"), "grid"),
]


def skip_refusal(cfg, backend, e):
    """True (and the skip recorded in cfg) when e is one of REFUSALS from `backend` in CUDA mode;
    False otherwise: the caller re-raises, so everything else stays a failure."""
    if not on_cuda() or not isinstance(e, NotImplementedError):
        return False
    msg = str(e)
    for pattern, backends, reason in REFUSALS:
        if backend in backends and re.search(pattern, msg):
            cfg.setdefault("skips", []).append(f"skip:{backend}:{reason}")
            return True
    return False


class BackendCall:
    """Around one backend's call in an iteration: a documented refusal (skip_refusal) is swallowed
    and `refused` set, so the caller skips that backend; any other error propagates. The truth's
    thread count is restored either way."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend, self.refused = cfg, backend, False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        reset_threads()
        self.refused = isinstance(error, NotImplementedError) and skip_refusal(self.cfg, self.backend, error)
        return self.refused


def pick_backends(r, kvcache=False):
    """The backends of one iteration. CPU: cpu_flash and cpu_reference, plus auto three times in
    ten. CUDA: at least two of GPU_BACKENDS (the KV-cache entry refuses cuda_sm90 by design)."""
    u = r.random()
    if not on_cuda():
        return ("cpu_flash", "cpu_reference", "auto") if u < 0.3 else ("cpu_flash", "cpu_reference")
    names = [b for b in GPU_BACKENDS if not (kvcache and b == "cuda_sm90")]
    if len(names) <= 2 or u >= 0.5:
        return tuple(names)
    two = r.sample(names, 2)
    return tuple(b for b in names if b in two)


# ---- independent float64 torch reference --------------------------------------------------------


def allowed(sq, sk, causal, window):
    return torch.from_numpy(allowed_keys(sq, sk, causal, window))


def seq_attention(q, k, v, scale, causal, window, softcap, slopes, keep, p_drop, compute, p_dtype):
    """One sequence, differentiable. q (sq, hq, d), k/v (sk, hkv, d); slopes (hq,) or None;
    keep (hq, sq, sk) bool or None. Returns out (sq, hq, d), lse (hq, sq) in `compute`."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        dist = (i + sk - sq - j).abs().to(compute)
        s = s - slopes.to(compute)[:, None, None] * dist[None]
    a = allowed(sq, sk, causal, window)
    s = s.masked_fill(~a[None], NEG)
    has = a.any(dim=-1)  # (sq,)
    p = torch.softmax(s, dim=-1) * has[None, :, None].to(compute)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~has[None], float("-inf"))
    if p_dtype is not None:
        p = p.to(p_dtype).to(compute)
    if keep is not None:
        p = p * keep.to(compute) / (1.0 - p_drop)
    out = torch.einsum("hij,jhd->ihd", p, v)
    return out, lse


def manual_grads(q, k, v, dout, scale, causal, window, softcap, slopes, keep, p_drop, dtype, round_o=True):
    """naive fp32 backward of one sequence, with out rounded to dtype before D (flash-like)."""
    f = torch.float32
    sq, hq, d = q.shape; sk, hkv = k.shape[:2]; g = hq // hkv
    Q, K, V, dO = q.to(f), k.to(f).repeat_interleave(g, 1), v.to(f).repeat_interleave(g, 1), dout.to(f)
    s0 = torch.einsum("ihd,jhd->hij", Q, K) * scale
    s = softcap * torch.tanh(s0 / softcap) if softcap > 0 else s0
    if slopes is not None:
        i = torch.arange(sq)[:, None]; j = torch.arange(sk)[None, :]
        s = s - slopes.to(f)[:, None, None] * (i + sk - sq - j).abs().to(f)[None]
    a = allowed(sq, sk, causal, window)
    s = s.masked_fill(~a[None], -1e30)
    has = a.any(-1)
    P = torch.softmax(s, -1) * has[None, :, None].to(f)
    Pd = P * keep.to(f) / (1 - p_drop) if keep is not None else P
    O = torch.einsum("hij,jhd->ihd", Pd, V)
    Or = O.to(dtype).to(f) if round_o else O
    dP = torch.einsum("ihd,jhd->hij", dO, V)
    if keep is not None:
        dP = dP * keep.to(f) / (1 - p_drop)
    D = (dO * Or).sum(-1).permute(1, 0)[:, :, None]  # (h, i, 1)
    dS = P * (dP - D)
    if softcap > 0:
        dS = dS * (1 - torch.tanh(s0 / softcap) ** 2)
    dq = torch.einsum("hij,jhd->ihd", dS, K) * scale
    dk = torch.einsum("hij,ihd->jhd", dS, Q) * scale
    dv = torch.einsum("hij,ihd->jhd", Pd, dO)
    red = lambda x: x.reshape(sk, hkv, g, d).sum(2)
    return dq, red(dk), red(dv)


# ---- comparisons ----


def lse_floor(lse64, scale, q, k, softcap, slopes):
    """A few fp32 roundings of the row max the lse is computed around: lse = m + log(l) loses
    |m| * eps32 when it cancels toward 0."""
    mx = lambda x: x.detach().double().nan_to_num(0.0).abs().max().item() if x.numel() else 0.0
    m = abs(scale) * mx(q) * mx(k) * q.shape[-1] ** 0.5 * 3
    if softcap > 0:
        m = min(m, softcap)
    fin = torch.isfinite(lse64)
    big = lse64[fin].abs().max().item() if fin.any() else 0.0
    return 4 * 2.0 ** -24 * (max(m, big) + 1.0) * (1.0 if slopes is None else 4.0)




def rounding_atol(truth, dtype):
    x = truth.to(dtype)
    probe = torch.tensor(0.3, dtype=dtype)
    return 2 * ((x + probe) - probe - x).double().abs().max().item() if x.numel() else 0.0


def check(name, actual, truth, same, dtype, factor=2.0, floor=0.0):
    """Raises Failure when actual is outside the rule. truth float64, same the naive same-precision
    result (rounded to dtype). -inf entries of truth must be -inf in actual; NaN never passes."""
    a = actual.detach().double()
    t = truth.detach().double()
    if a.shape != t.shape:
        raise Failure(f"{name}: shape {tuple(a.shape)} != {tuple(t.shape)}")
    if torch.isnan(a).any():
        raise Failure(f"{name}: NaN in result ({int(torch.isnan(a).sum())} entries)")
    fin = torch.isfinite(t)
    if not torch.equal(a[~fin], t[~fin]):
        bad = (~fin) & (a != t)
        idx = bad.nonzero()[0].tolist()
        raise Failure(f"{name}: expected {t[tuple(idx)].item()} at {idx}, got {a[tuple(idx)].item()}")
    if not torch.isfinite(a[fin]).all():
        raise Failure(f"{name}: inf where the truth is finite")
    if fin.sum() == 0:
        return 0.0
    err = (a[fin] - t[fin]).abs().max().item()
    s = same.detach().double()
    serr = (s[fin] - t[fin]).abs().max().item()
    atol = rounding_atol(t[fin], dtype if dtype != torch.float32 else torch.float32)
    bound = factor * serr + atol + floor
    if err <= bound:
        return err
    if dtype == torch.float32:
        norm = t[fin].norm().item()
        rel = (a[fin] - t[fin]).norm().item() / max(norm, 1e-30)
        if rel <= 1e-5:
            return err
    where = torch.where(fin, (a - t).abs(), torch.zeros_like(a)).flatten().argmax().item()  # (-inf - -inf is NaN)
    idx = np.unravel_index(where, tuple(a.shape))
    raise Failure(f"{name}: max err {err:.3g} > {factor} x same {serr:.3g} + atol {atol:.3g} "
                  f"(worst at {tuple(int(x) for x in idx)}: got {a[idx].item():.6g}, truth {t[idx].item():.6g}, "
                  f"truth max|.| {t[fin].abs().max().item():.3g})")


# ---- random configuration ---------------------------------------------------------------------


HEAD_DIMS = list(range(8, 257, 8)) + [36, 60, 100, 20, 44, 4, 12]


def pick_head_dim(r, mult8=False):
    """mult8: rounded up to a multiple of 8 (CUDA paged and KV-cache calls: the library pads only
    the dense and varlen torch calls, the others refuse such head dims by design)."""
    if r.random() < 0.2:
        d = r.choice([36, 60, 100, 20, 44, 4, 12])
    else:
        d = r.choice([8, 16, 24, 32, 40, 48, 64, 64, 72, 80, 96, 128, 128, 160, 192, 256, 256]
                     + list(range(8, 257, 8)))
    return -(-d // 8) * 8 if mult8 else d


def pick_len(r, hi=300):
    u = r.random()
    if u < 0.08:
        return 0
    if u < 0.18:
        return 1
    if u < 0.45:
        return r.randint(2, 20)
    if u < 0.8:
        return r.randint(20, 130)
    if on_cuda() and r.random() < 0.5:
        return r.randint(hi, LONG_LEN)  # many query / key tiles, split-KV
    return r.randint(130, hi)


def fit_lengths(lens_q, lens_k, hq, d):
    """CUDA mode: lens_q and lens_k halved together until the truth's cost fits WORK_CAP and
    PAIR_CAP (after the head-count and head-dim cuts, which stop at head_dim 8). Equal lengths stay
    equal, so dense cases keep one length per batch. CPU mode: unchanged."""
    pairs = lambda: sum(a * b for a, b in zip(lens_q, lens_k))
    while on_cuda() and (pairs() * hq * d > WORK_CAP or pairs() * hq > PAIR_CAP):
        lens_q, lens_k = [(x + 1) // 2 for x in lens_q], [(x + 1) // 2 for x in lens_k]
    return lens_q, lens_k


def pick_window(r, sk):
    def side():
        u = r.random()
        if u < 0.35:
            return -1
        if u < 0.5:
            return 0
        if u < 0.85:
            return r.randint(0, max(1, sk))
        return r.randint(sk, sk + 400)
    if r.random() < 0.45:
        return (-1, -1)
    return (side(), side())


def pick_common(r, hq, batch, dtype_name=None):
    c = {}
    c["dtype"] = dtype_name or r.choice(["fp16", "bf16"] if on_cuda() else ["fp32", "fp16", "bf16"])
    c["causal"] = r.random() < 0.35
    c["softcap"] = 0.0 if r.random() < 0.65 else r.choice([0.5, 1.0, 5.0, 30.0, r.uniform(0.2, 50)])
    u = r.random()
    if u < 0.5:
        c["scale"] = None
    elif u < 0.8:
        c["scale"] = r.uniform(0.02, 0.4)
    elif u < 0.95:
        c["scale"] = -r.uniform(0.02, 0.4)
    else:
        c["scale"] = r.choice([1.0, -1.0, 1e-4])
    u = r.random()
    if u < 0.6:
        c["alibi"] = None
    else:
        shape = (hq,) if r.random() < 0.5 else (batch, hq)
        lo = -0.3 if r.random() < 0.3 else 0.0
        c["alibi"] = ("shape", list(shape), lo, r.choice([0.05, 0.3, 1.0, 4.0]))
    c["in_scale"] = r.choice([1.0, 1.0, 1.0, 0.1, 3.0])
    return c


def make_slopes(spec, g):
    if spec is None:
        return None
    _, shape, lo, hi = spec
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()


def randn(shape, dtype, g, s=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * s).to(dtype)


def restride(x, r, kind=None):
    """x's values in another memory layout (last dim contiguous): dims permuted in storage,
    or a slice of a padded base. Returns (view, base, kind)."""
    kind = kind or r.choice(["same", "same", "perm", "pad"])
    if kind == "same" or x.dim() < 2:
        return x.clone(), None, "same"
    if kind == "perm":
        dims = list(range(x.dim() - 1))
        r.shuffle(dims)
        order = dims + [x.dim() - 1]
        base = x.permute(order).contiguous()
        inv = [order.index(i) for i in range(x.dim())]
        return base.permute(inv), None, "perm"
    # The CUDA backends need strides of 8 elements (16 bytes; a documented error otherwise): pad
    # the last dimension by multiples of 8 there.
    pads = [r.randint(0, 2) for _ in range(x.dim() - 1)] + [r.choice([0, 0, 8, 16] if on_cuda() else [0, 0, 1, 8])]
    base = torch.full([n + p for n, p in zip(x.shape, pads)], float("nan"), dtype=x.dtype, device=x.device)
    view = base[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view, base, "pad"


def set_threads(r):
    """Threads of a CPU backend's call. The CUDA backends take none: there the draw is made (the
    random stream keeps its shape) and the truth's thread count stays."""
    n = 2 if r.random() < 0.25 else 1
    if not on_cuda():
        torch.set_num_threads(n)


def drawn_seed(seed):
    torch.manual_seed(seed)
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


# ---- dense / varlen (autograd) ----------------------------------------------------------------


def attention_case(r, g, mode):
    """dense or varlen (packed sequences) forward + backward through autograd."""
    batch = r.randint(1, 3)
    hkv = r.choice([1, 1, 2, 3, 4])
    hq = hkv * r.choice([1, 1, 2, 3, 4])
    d = pick_head_dim(r)
    c = pick_common(r, hq, batch)
    dtype = DTYPES[c["dtype"]]
    if mode == "dense":
        sq = pick_len(r)
        sk = sq if r.random() < 0.3 else pick_len(r)
        lens_q, lens_k = [sq] * batch, [sk] * batch
    else:
        lens_q = [pick_len(r, 200) for _ in range(batch)]
        lens_k = [x if r.random() < 0.3 else pick_len(r, 200) for x in lens_q]
    work = sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d
    if work > WORK_CAP and r.random() < 0.5:
        hq = hkv
        if c["alibi"]:
            sh = c["alibi"][1]
            c["alibi"] = ("shape", [hq] if len(sh) == 1 else [batch, hq], c["alibi"][2], c["alibi"][3])
        work = sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d
    while work > WORK_CAP and d > 8:
        d = max(8, d // 2 // 8 * 8)
        work = sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d
    lens_q, lens_k = fit_lengths(lens_q, lens_k, hq, d)
    window = pick_window(r, max(lens_k) if lens_k else 0)
    dropout = 0.0 if r.random() < 0.7 else r.choice([0.1, 0.17, 0.5, 0.9, r.uniform(0.01, 0.95)])
    backward = r.random() < 0.6
    deterministic = r.random() < 0.3
    packed = None
    if mode == "dense" and lens_q[0] == lens_k[0] and hq == hkv and r.random() < 0.3:
        packed = "qkv"
    elif mode == "dense" and r.random() < 0.15:
        packed = "kv"
    cfg = dict(mode=mode, batch=batch, hq=hq, hkv=hkv, d=d, lens_q=lens_q, lens_k=lens_k, window=window,
               dropout=dropout, backward=backward, packed=packed, deterministic=deterministic, **c)
    CUR[0] = cfg
    s = c["in_scale"]
    slopes = make_slopes(c["alibi"], g)
    extra_q = r.randint(0, 3) if mode == "varlen" else 0
    extra_k = r.randint(0, 3) if mode == "varlen" else 0
    cfg["extra_rows"] = (extra_q, extra_k)
    if mode == "varlen":  # the packed varlen entry points: qkv takes the query lengths for the keys
        u = r.random()
        pairs = sum(a * a for a in lens_q)
        if hq == hkv and u < 0.12 and pairs * hq * d <= WORK_CAP and (not on_cuda() or pairs * hq <= PAIR_CAP):
            lens_k, extra_k = list(lens_q), extra_q
            cfg["lens_k"], cfg["extra_rows"] = lens_k, (extra_q, extra_k)
            packed = "qkv"
        elif u >= 0.85:
            packed = "kv"
        cfg["packed"] = packed
    cu_dtype = torch.int32 if r.random() < 0.8 else torch.int64
    if mode == "dense":
        q = randn((batch, lens_q[0], hq, d), dtype, g, s)
        k = randn((batch, lens_k[0], hkv, d), dtype, g, s)
        v = randn((batch, lens_k[0], hkv, d), dtype, g)
        dout = randn(q.shape, dtype, g)
    else:
        tq, tk = sum(lens_q), sum(lens_k)
        q = randn((tq + extra_q, hq, d), dtype, g, s)
        k = randn((tk + extra_k, hkv, d), dtype, g, s)
        v = randn((tk + extra_k, hkv, d), dtype, g)
        for t, n in ((q, tq), (k, tk), (v, tk)):
            t[n:] = float("nan")
        dout = randn(q.shape, dtype, g)
        cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=cu_dtype)
        cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=cu_dtype)
        mq = max(lens_q) + r.choice([0, 0, 1, 7])
        mk = max(lens_k) + r.choice([0, 0, 1, 7])
        cfg["max_seqlen"] = (mq, mk)
    call_seed = r.randint(0, 10**6)
    results = {}
    for backend in pick_backends(r):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        else:
            reset_threads()
        # CUDA mode: each layout is made on the device (a copy of a CPU layout would be contiguous)
        leaves = [restride(dev(x), r)[0].requires_grad_(backward) for x in (q, k, v)]
        dout_b = restride(dev(dout), r)[0]
        kw = dict(dropout_p=dropout, softmax_scale=c["scale"], causal=c["causal"], window_size=window,
                  softcap=c["softcap"], alibi_slopes=dev(slopes), return_attn_probs=True, deterministic=deterministic)
        torch.manual_seed(call_seed)
        with BackendCall(cfg, backend) as call:
            if mode == "dense":
                if packed == "qkv":
                    qkv = torch.stack(leaves, dim=2)
                    out, lse, _ = fc.flash_attn_qkvpacked_func(qkv, **kw)
                elif packed == "kv":
                    out, lse, _ = fc.flash_attn_kvpacked_func(leaves[0], torch.stack(leaves[1:], dim=2), **kw)
                else:
                    out, lse, _ = fc.flash_attn_func(*leaves, **kw)
            else:
                if packed == "qkv":  # (total, 3, heads, d); one cu_seqlens and max_seqlen for both
                    out, lse, _ = fc.flash_attn_varlen_qkvpacked_func(torch.stack(leaves, dim=1), dev(cu_q),
                                                                      max(mq, mk), **kw)
                elif packed == "kv":  # kv (total_k, 2, heads_kv, d)
                    out, lse, _ = fc.flash_attn_varlen_kvpacked_func(leaves[0], torch.stack(leaves[1:], dim=1),
                                                                     dev(cu_q), dev(cu_k), mq, mk, **kw)
                else:
                    out, lse, _ = fc.flash_attn_varlen_func(*leaves, dev(cu_q), dev(cu_k), mq, mk, **kw)
            grads = None
            if backward:
                grads = tuple(host(x) for x in torch.autograd.grad(out, leaves, dout_b))
        if call.refused:
            continue
        results[backend] = (host(out.detach()), host(lse.detach()), grads)
    reset_threads()
    fc.set_default_backend("auto")
    mask_seed = drawn_seed(call_seed) if dropout else None

    # truth and same-precision, per sequence
    q64 = q.double().nan_to_num(0.0).requires_grad_(backward)
    k64 = k.double().nan_to_num(0.0).requires_grad_(backward)
    v64 = v.double().nan_to_num(0.0).requires_grad_(backward)
    q32 = q.float().nan_to_num(0.0).requires_grad_(backward)
    k32 = k.float().nan_to_num(0.0).requires_grad_(backward)
    v32 = v.float().nan_to_num(0.0).requires_grad_(backward)
    scale = c["scale"] if c["scale"] is not None else d ** -0.5
    outs64, lses64, outs32, lses32 = [], [], [], []
    mgrads = []
    oq = ok = 0
    for b in range(batch):
        sq, sk = lens_q[b], lens_k[b]
        if mode == "dense":
            sl = lambda x, rows, kind: x[b]
        else:
            sl = None
        def part(x, kind):
            if mode == "dense":
                return x[b]
            return x[oq:oq + sq] if kind == "q" else x[ok:ok + sk]
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        keep = None
        if dropout:
            keep = torch.from_numpy(np.stack([dropout_keep_mask(dropout, mask_seed, 0, b * hq + h, sq, sk)
                                              for h in range(hq)])) if sq and sk else torch.ones(hq, sq, sk, dtype=torch.bool)
        o64, l64 = seq_attention(part(q64, "q"), part(k64, "k"), part(v64, "k"), scale, c["causal"], window,
                                 c["softcap"], sb, keep, dropout, torch.float64, None)
        o32, l32 = seq_attention(part(q32, "q"), part(k32, "k"), part(v32, "k"), scale, c["causal"], window,
                                 c["softcap"], sb, keep, dropout, torch.float32,
                                 dtype if dtype != torch.float32 else None)
        outs64.append(o64); lses64.append(l64); outs32.append(o32); lses32.append(l32)
        if backward:
            dsl = dout[b] if mode == "dense" else dout[oq:oq + sq]
            mg = manual_grads(part(q, "q").nan_to_num(0.0), part(k, "k").nan_to_num(0.0), part(v, "k").nan_to_num(0.0),
                              dsl, scale, c["causal"], window, c["softcap"], sb, keep, dropout, dtype,
                              round_o=dtype != torch.float32)
            mgrads.append(mg)
        oq += sq
        ok += sk
    if mode == "dense":
        out64 = torch.stack(outs64)
        lse64 = torch.stack(lses64)
        out32 = torch.stack(outs32)
        lse32 = torch.stack(lses32)
        sel_q = lambda x: x
        sel_lse = lambda x: x
        sel_k = lambda x: x
    else:
        tq, tk = sum(lens_q), sum(lens_k)
        out64 = torch.cat(outs64)
        lse64 = torch.cat(lses64, dim=1)
        out32 = torch.cat(outs32)
        lse32 = torch.cat(lses32, dim=1)
        sel_q = lambda x: x[:tq]
        sel_lse = lambda x: x[:, :tq]
        sel_k = lambda x: x[:tk]
    same_out = out32.detach().to(dtype)
    for backend, (out, lse, grads) in results.items():
        check(f"{backend} out", sel_q(out), out64, same_out, dtype)
        check(f"{backend} lse", sel_lse(lse), lse64, lse32.detach(), torch.float32, floor=lse_floor(lse64, scale, q, k, c["softcap"], slopes))
    # fully masked rows: out exactly 0
    for backend, (out, lse, grads) in results.items():
        dead = ~torch.isfinite(lse64.detach())  # dense (b, h, sq) / varlen (h, tq)
        o = sel_q(out).double()
        if mode == "dense":
            dead_rows = dead.permute(0, 2, 1)  # (b, sq, h)
        else:
            dead_rows = dead.permute(1, 0)  # (tq, h)
        if dead_rows.any() and not (o[dead_rows] == 0).all():
            raise Failure(f"{backend}: fully masked rows have out != 0 (max {o[dead_rows].abs().max().item():.3g})")
    if backward:
        mx = lambda x: x.detach().double().nan_to_num(0.0).abs().max().item() if x.numel() else 0.0
        eps32, dd = 2.0 ** -24, float(d)
        base = 2 * eps32 * dd * mx(dout) * mx(v)
        floors = {"dq": base * abs(scale) * mx(k) * 4, "dk": base * abs(scale) * mx(q) * 4,
                  "dv": 2 * eps32 * mx(dout) * 4}
        # The backward recomputes P = exp(s - lse) in fp32 from scores whose absolute rounding grows
        # with their size, so P, and every gradient, carry a relative error of a few eps32 x the
        # size of the scores that carry weight, which the lse measures (ALiBi biases make it reach
        # max|slope| x the distance to the nearest key): the floors scale with it, as lse_floor does
        # for the lse (an fp32 limit of the algorithm that flash_attn's kernels share; session 47
        # measured it on cpu_flash, session 48's CPU run drew it again at slopes up to 4).
        lse_fin = lse64.detach()[torch.isfinite(lse64.detach())]
        reach = lse_fin.abs().max().item() if lse_fin.numel() else 0.0
        floors = {name: value * (1.0 + reach) for name, value in floors.items()}
        g64 = torch.autograd.grad(out64, (q64, k64, v64), sel_q(dout).double(), allow_unused=True)
        g64 = [torch.zeros_like(x) if gg is None else gg for gg, x in zip(g64, (q64, k64, v64))]
        if mode == "dense":
            g32 = [torch.stack([m[i] for m in mgrads]) for i in range(3)]
        else:
            g32 = [torch.cat([m[i] for m in mgrads]) for i in range(3)]
        for backend, (out, lse, grads) in results.items():
            for name, got, want, same, sel in zip(("dq", "dk", "dv"), grads, g64, g32, (sel_q, sel_k, sel_k)):
                check(f"{backend} {name}", sel(got), sel(want), same.to(dtype), dtype, factor=4.0,
                      floor=floors[name])
    # direct flash vs reference (dropout must draw the same mask: check out agreement already covers it)
    return cfg


# ---- paged varlen (forward only) --------------------------------------------------------------


def paged_case(r, g):
    batch = r.randint(1, 3)
    hkv = r.choice([1, 2, 3])
    hq = hkv * r.choice([1, 2, 4])
    d = pick_head_dim(r, mult8=on_cuda())
    c = pick_common(r, hq, batch)
    dtype = DTYPES[c["dtype"]]
    # CUDA: also whole key blocks (sm90 reads them in place) and multiples of 256 (sm80 takes
    # several pages per sequence only of those; smaller ones are gathered on sm90).
    page = r.choice([1, 2, 3, 7, 8, 16, 31, 32, 64, r.randint(1, 64)]
                    + ([16, 32, 64, 128, 256, 256, 512, 512] if on_cuda() else []))
    lens_q = [pick_len(r, 150) for _ in range(batch)]
    lens_k = [pick_len(r, 250) for _ in range(batch)]
    while sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d > WORK_CAP and d > 8:
        d = max(8, d // 2 // 8 * 8)
    lens_q, lens_k = fit_lengths(lens_q, lens_k, hq, d)
    pages_per_seq = max(1, max(-(-x // page) for x in lens_k)) + r.randint(0, 2)
    num_pages = batch * pages_per_seq + r.randint(0, 3)
    window = pick_window(r, max(lens_k))
    cfg = dict(mode="paged", batch=batch, hq=hq, hkv=hkv, d=d, lens_q=lens_q, lens_k=lens_k, page=page,
               pages_per_seq=pages_per_seq, num_pages=num_pages, window=window, **c)
    CUR[0] = cfg
    s = c["in_scale"]
    slopes = make_slopes(c["alibi"], g)
    tq = sum(lens_q)
    q = randn((tq, hq, d), dtype, g, s)
    kp = randn((num_pages, page, hkv, d), dtype, g, s)
    vp = randn((num_pages, page, hkv, d), dtype, g)
    perm = torch.randperm(num_pages, generator=g)[:batch * pages_per_seq]
    table = perm.reshape(batch, pages_per_seq).to(torch.int32)
    cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=torch.int32)
    mq, mk = max(lens_q), max(lens_k)
    results = {}
    for backend in pick_backends(r):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        kp_c, vp_c = dev(kp).clone(), dev(vp).clone()
        with BackendCall(cfg, backend) as call:
            out, lse, _ = fc.flash_attn_varlen_func(restride(dev(q), r)[0], kp_c, vp_c, dev(cu_q), dev(cu_k), mq, mk,
                                                    softmax_scale=c["scale"], causal=c["causal"], window_size=window,
                                                    softcap=c["softcap"], alibi_slopes=dev(slopes),
                                                    return_attn_probs=True, block_table=dev(table))
        if call.refused:
            continue
        if not (torch.equal(host(kp_c), kp) and torch.equal(host(vp_c), vp)):
            raise Failure(f"{backend}: paged forward modified k/v pages")
        results[backend] = (host(out), host(lse))
    fc.set_default_backend("auto")
    scale = c["scale"] if c["scale"] is not None else d ** -0.5
    outs64, lses64, outs32, lses32 = [], [], [], []
    oq = 0
    for b in range(batch):
        sq, sk = lens_q[b], lens_k[b]
        slots = [(int(table[b, t // page]), t % page) for t in range(sk)]
        kk = torch.stack([kp[p_, s_] for p_, s_ in slots]) if slots else kp[0, :0]
        vv = torch.stack([vp[p_, s_] for p_, s_ in slots]) if slots else vp[0, :0]
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        qq = q[oq:oq + sq]
        o64, l64 = seq_attention(qq, kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0, torch.float64, None)
        o32, l32 = seq_attention(qq, kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0, torch.float32,
                                 dtype if dtype != torch.float32 else None)
        outs64.append(o64); lses64.append(l64); outs32.append(o32); lses32.append(l32)
        oq += sq
    out64, lse64 = torch.cat(outs64), torch.cat(lses64, dim=1)
    same = torch.cat(outs32).to(dtype)
    lse32 = torch.cat(lses32, dim=1)
    for backend, (out, lse) in results.items():
        check(f"{backend} out", out, out64, same, dtype)
        check(f"{backend} lse", lse, lse64, lse32, torch.float32, floor=lse_floor(lse64, scale, q, kp, c["softcap"], slopes))
    return cfg


# ---- KV cache -----------------------------------------------------------------------------------


def rotate(x, cos, sin, positions, interleaved):
    """x (b, s, h, d) float64; cos/sin (rows, half) float64; positions (b, s) long."""
    out = x.clone()
    half = cos.shape[1]
    c = cos[positions][:, :, None, :]  # (b, s, 1, half)
    s_ = sin[positions][:, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = x1 * c - x2 * s_
        out[..., 1:2 * half:2] = x1 * s_ + x2 * c
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        out[..., :half] = x1 * c - x2 * s_
        out[..., half:2 * half] = x1 * s_ + x2 * c
    return out


def rotation_flips(x, cos, sin, positions, interleaved, dtype):
    """Per element of rotate(x) rounded to dtype, how far the library's value may lie from ours: one
    step to the other neighbour where the exact rotated value sits within fp32 rounding of a
    midpoint between two dtype values (the library's fp32 arithmetic, e.g. a fused multiply-add,
    may then round it the other way), else 0. Float64, the shape of x. fp32 math errs by at most a
    few 2^-24 of |x1 cos| + |x2 sin| <= |x1| + |x2| (the pair's terms, not the result, which may
    cancel): the margin is 2^-21 of that; features past the rotated ones are copied exactly."""
    exact = rotate(x.double(), cos.double(), sin.double(), positions, interleaved)
    half = cos.shape[1]
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    a = x.double().abs()
    margin = torch.zeros_like(a)
    margin[..., first] = margin[..., second] = (a[..., first] + a[..., second]) * 2.0 ** -21
    lo = (exact - margin).to(dtype).double()
    hi = (exact + margin).to(dtype).double()
    return (hi - lo).abs()


def rotation_envelope(scale, q_abs, dq, k_abs, dk):
    """Bound on |score change| over one sequence's rows and keys when q and k move by dq and dk
    elementwise: |scale| x max over (head, row, key) of dq . |k| + |q| . dk. q (sq, hq, d), k (sk,
    hkv, d). A softcap only shrinks it (tanh is 1-Lipschitz); ALiBi adds nothing."""
    if q_abs.numel() == 0 or k_abs.numel() == 0:
        return 0.0
    g = q_abs.shape[1] // k_abs.shape[1]
    ka, dka = k_abs.repeat_interleave(g, dim=1), dk.repeat_interleave(g, dim=1)
    b = torch.einsum("ihd,jhd->hij", dq, ka) + torch.einsum("ihd,jhd->hij", q_abs, dka)
    return abs(scale) * b.max().item()


def kvcache_case(r, g):
    batch = r.randint(1, 3)
    hkv = r.choice([1, 2, 3, 4])
    hq = hkv * r.choice([1, 1, 2, 4, 8])
    d = pick_head_dim(r, mult8=on_cuda())
    c = pick_common(r, hq, batch)
    dtype = DTYPES[c["dtype"]]
    u = r.random()
    sq = 1 if u < 0.4 else (r.randint(2, 16) if u < 0.8 else r.randint(17, 100))
    append = r.random() < 0.5
    sn = r.randint(1, 20) if append else 0
    if r.random() < 0.2 and append:
        sn = r.randint(20, 80)
    paged = r.random() < 0.4
    page = r.choice([1, 2, 5, 8, 16, 32, 64, r.randint(1, 64)] + ([128, 256] if on_cuda() else [])) if paged else None
    # CUDA: long caches too (split-KV, the forward-kernel route's many key blocks)
    want_cap = r.randint(max(1, sn), max(sn, 1) + r.choice([5, 40, 150, 300] + ([1100, 2000] if on_cuda() else [])))
    if paged:
        pages_per_seq = -(-want_cap // page)
        cap = pages_per_seq * page
        num_pages = batch * pages_per_seq + r.randint(0, 3)
    else:
        cap = want_cap
    use_bidx = (not paged) and r.random() < 0.3
    bc = batch + (r.randint(0, 3) if use_bidx else 0)
    leftpad_on = (not paged) and r.random() < 0.25
    seqlens_none = (not append) and r.random() < 0.2
    while batch * hq * sq * cap * d > WORK_CAP and d > 8:
        d = max(8, d // 2 // 8 * 8)
    rotary = append and r.random() < 0.4
    num_splits = r.choice([0, 1, 3])
    window = pick_window(r, cap)
    cfg = dict(mode="kvcache", batch=batch, hq=hq, hkv=hkv, d=d, sq=sq, seqlen_new=sn, paged=paged, page=page,
               capacity=cap, cache_batch_idx=use_bidx, batch_cache=bc, leftpad=leftpad_on, seqlens_none=seqlens_none,
               rotary=rotary, num_splits=num_splits, window=window, **c)
    CUR[0] = cfg
    s = c["in_scale"]
    slopes = make_slopes(c["alibi"], g)
    q = randn((batch, sq, hq, d), dtype, g, s)
    if paged:
        kc = randn((num_pages, page, hkv, d), dtype, g, s)
        vc = randn((num_pages, page, hkv, d), dtype, g)
        perm = torch.randperm(num_pages, generator=g)[:batch * pages_per_seq]
        table = perm.reshape(batch, pages_per_seq).to(torch.int32)
        cfg["num_pages"] = num_pages
    else:
        kc = randn((bc, cap, hkv, d), dtype, g, s)
        vc = randn((bc, cap, hkv, d), dtype, g)
        table = None
    bidx = torch.randperm(bc, generator=g)[:batch].to(torch.int32) if use_bidx else None
    kn = randn((batch, sn, hkv, d), dtype, g, s) if append else None
    vn = randn((batch, sn, hkv, d), dtype, g) if append else None
    # lengths: include empty and full
    lens = []
    for b in range(batch):
        u = r.random()
        lens.append(0 if u < 0.15 else (cap - sn if u < 0.3 else r.randint(0, cap - sn)))
    if seqlens_none:
        lens = [cap] * batch
    leftpad = None
    if leftpad_on:
        leftpad = torch.tensor([r.randint(0, L) for L in lens], dtype=torch.int32)
    cfg["lens"] = lens
    cfg["leftpad_values"] = None if leftpad is None else leftpad.tolist()
    cos = sin = None
    interleaved = r.random() < 0.5
    if rotary:
        half = r.randint(1, d // 2)
        if r.random() < 0.5:
            half = max(1, (d // 2) // 2 * 2 // (1 if r.random() < 0.5 else 2))
        per_token = c["causal"] or (0 <= window[0] < cap) or (0 <= window[1] < cap)
        span = max(sn, sq if per_token else 1)
        rows = max(lens) + span + r.randint(0, 5)
        ang = torch.rand((rows, half), generator=g, dtype=torch.float64) * 2 * math.pi
        tdt = torch.float32 if r.random() < 0.6 else dtype
        cos, sin = ang.cos().to(tdt), ang.sin().to(tdt)
        cfg.update(rotary_half=half, rotary_rows=rows, rotary_dtype=str(tdt), interleaved=interleaved,
                   per_token=per_token)
    if seqlens_none:
        cs_arg = None
    else:
        u = r.random()
        if u < 0.15 and len(set(lens)) == 1:
            cs_arg = lens[0]
        else:
            cs_arg = torch.tensor(lens, dtype=torch.int32 if u < 0.8 else torch.int64)
    results = {}
    for backend in pick_backends(r, kvcache=True):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        kc_c, kbase, kkind = restride(dev(kc), r, r.choice(["same", "pad"]))
        vc_c, vbase, vkind = restride(dev(vc), r, r.choice(["same", "pad"]))
        cfg.setdefault("cache_layouts", []).append((kkind, vkind))
        q_b = restride(dev(q), r)[0]
        kn_b = restride(dev(kn), r)[0] if kn is not None else None
        vn_b = restride(dev(vn), r)[0] if vn is not None else None
        with BackendCall(cfg, backend) as call:
            out, lse = fc.flash_attn_with_kvcache(
                q_b, kc_c, vc_c, kn_b, vn_b, rotary_cos=dev(cos), rotary_sin=dev(sin), cache_seqlens=dev(cs_arg),
                cache_batch_idx=dev(bidx), cache_leftpad=dev(leftpad), block_table=dev(table), softmax_scale=c["scale"],
                causal=c["causal"], window_size=window, softcap=c["softcap"], rotary_interleaved=interleaved,
                alibi_slopes=dev(slopes), num_splits=num_splits, return_softmax_lse=True)
        if call.refused:
            continue
        # (CUDA: the caches' bases and views are compared as CPU copies)
        for base, view in ((host(kbase), kc_c), (host(vbase), vc_c)):
            if base is not None:
                outside = torch.ones(base.shape, dtype=torch.bool)
                outside[tuple(slice(0, n) for n in view.shape)] = False
                if not torch.isnan(base[outside]).all():
                    raise Failure(f"{backend}: wrote outside the strided cache view")
        results[backend] = (host(out), host(lse), host(kc_c), host(vc_c))
    fc.set_default_backend("auto")
    # reference append (exact unless rotary)
    kn_w = kn
    q_use = q
    dq_flip = dkn_flip = None
    if rotary:
        pos_k = torch.tensor([[lens[b] + j for j in range(sn)] for b in range(batch)], dtype=torch.long).reshape(batch, sn)
        # fp32 math rounded once, as documented (flash_attn's rule)
        kn_w = rotate(kn.float(), cos.float(), sin.float(), pos_k, interleaved).to(dtype)
        per_token = cfg["per_token"]
        pos_q = torch.tensor([[lens[b] + (i if per_token else 0) for i in range(sq)] for b in range(batch)],
                             dtype=torch.long).reshape(batch, sq)
        q_use = rotate(q.float(), cos.float(), sin.float(), pos_q, interleaved).to(dtype)
        if dtype != torch.float32:  # (fp32 results are not rounded again: no flips)
            dq_flip = rotation_flips(q.float(), cos.float(), sin.float(), pos_q, interleaved, dtype)
            dkn_flip = rotation_flips(kn.float(), cos.float(), sin.float(), pos_k, interleaved, dtype)
    k_after, v_after = kc.clone(), vc.clone()
    # Where the library may have rounded a rotated key the other way (rotation_flips), by slot.
    dk_after = torch.zeros(k_after.shape, dtype=torch.float64)
    def slot(b, t):
        if paged:
            return int(table[b, t // page]), t % page
        return (b if bidx is None else int(bidx[b])), t
    if append:
        for b in range(batch):
            for t in range(sn):
                rr, ss = slot(b, lens[b] + t)
                k_after[rr, ss] = kn_w[b, t]
                v_after[rr, ss] = vn[b, t]
                if dkn_flip is not None:
                    dk_after[rr, ss] = dkn_flip[b, t]
    for backend, (out, lse, kc_c, vc_c) in results.items():
        if not torch.equal(vc_c, v_after):
            diff = (vc_c != v_after).nonzero()[0].tolist()
            raise Failure(f"{backend}: v_cache after append differs at {diff}")
        if rotary:
            dif = (kc_c.double() - k_after.double()).abs()
            # rounding: 1 ulp of dtype at the value's magnitude (fp32 math vs fp64 math)
            ulp = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
            tol = k_after.double().abs().clamp_min(1e-3) * ulp + 1e-6
            if (dif > tol).any():
                idx = (dif > tol).nonzero()[0].tolist()
                raise Failure(f"{backend}: rotated k_cache after append differs at {idx}: got "
                              f"{kc_c[tuple(idx)].item()} want {k_after[tuple(idx)].item()}")
        elif not torch.equal(kc_c, k_after):
            diff = (kc_c != k_after).nonzero()[0].tolist()
            raise Failure(f"{backend}: k_cache after append differs at {diff}")
    # truth: keys of each sequence, from the reference caches
    scale = c["scale"] if c["scale"] is not None else d ** -0.5
    o64s, l64s, o32s, l32s = [], [], [], []
    flip_shift = 0.0  # the largest score change rotation_flips allows (0 without rotary or in fp32)
    for b in range(batch):
        start = 0 if leftpad is None else int(leftpad[b])
        end = lens[b] + sn
        slots = [slot(b, t) for t in range(start, end)]
        kk = torch.stack([k_after[a_, s_] for a_, s_ in slots]) if slots else k_after[0, :0]
        if dq_flip is not None:
            dkk = torch.stack([dk_after[a_, s_] for a_, s_ in slots]) if slots else dk_after[0, :0]
            flip_shift = max(flip_shift, rotation_envelope(scale, q_use[b].double().abs(), dq_flip[b],
                                                           kk.double().abs(), dkk))
        vv = torch.stack([v_after[a_, s_] for a_, s_ in slots]) if slots else v_after[0, :0]
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o64, l64 = seq_attention(q_use[b], kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0,
                                 torch.float64, None)
        o32, l32 = seq_attention(q_use[b], kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0,
                                 torch.float32, dtype if dtype != torch.float32 else None)
        o64s.append(o64); l64s.append(l64); o32s.append(o32); l32s.append(l32)
    out64, lse64 = torch.stack(o64s), torch.stack(l64s)
    same, lse32 = torch.stack(o32s).to(dtype), torch.stack(l32s)
    # A rotated q or k the library rounded the other way moves each score by at most flip_shift:
    # the lse by as much (it is 1-Lipschitz in the scores), each probability by a factor within
    # exp(+-2 flip_shift), so out by at most (exp(2 flip_shift) - 1) max|v|.
    cfg["flip_shift"] = flip_shift
    out_flip = math.expm1(2 * flip_shift) * v_after.double().nan_to_num(0.0).abs().max().item() if flip_shift else 0.0
    for backend, (out, lse, _, _) in results.items():
        check(f"{backend} out", out, out64, same, dtype, factor=3.0 if rotary else 2.0, floor=out_flip)
        check(f"{backend} lse", lse, lse64, lse32, torch.float32, factor=3.0 if rotary else 2.0,
              floor=lse_floor(lse64, scale, q_use, kc, c["softcap"], slopes) + flip_shift)
    return cfg


# ---- invalid inputs ---------------------------------------------------------------------------


def choose_invalid(r, options, cuda_only):
    """r.choice over options, entries (expect, overrides[, tag]); returns (expect, overrides) with
    the tensors on the fuzzed device. Tag "value": the error comes from values inside a tensor,
    which the library reads on the host only for CPU tensors (CUDA ones are the kernels' to guard:
    NaN rows, error_flag), so CUDA mode leaves it out. cuda_only: (expect, overrides) added in CUDA
    mode, their tensors placed as given (a CPU tensor there is the point of the case). The CPU
    list keeps its order, so a CPU seed draws the case it drew before."""
    if on_cuda():
        options = [o for o in options if o[2:] != ("value",)] + [o + ("as_given",) for o in cuda_only]
    choice = r.choice(options)
    expect, over = choice[0], choice[1]
    if choice[2:] != ("as_given",):
        over = {kk: dev(vv) for kk, vv in over.items()}
    return expect, over


def invalid_case(r, g):
    """One random invalid call. Must raise ValueError / NotImplementedError / TypeError naming the
    expected argument and leave caller buffers (out / lse / caches) untouched."""
    cuda = on_cuda()
    dtype = DTYPES[r.choice(["fp16", "bf16"] if cuda else ["fp32", "fp16", "bf16"])]
    backend = r.choice(GPU_BACKENDS if cuda else ["cpu_flash", "cpu_reference"])
    # On the GPU a head dim that is not a multiple of 8 makes q itself invalid (its row stride), and
    # the library rightly names q first: the cases below each break one other argument.
    b, sq, sk, hq, hkv, d = r.randint(1, 3), r.randint(1, 40), r.randint(1, 40), 4, 2, r.choice([16, 40 if cuda else 36, 64])
    q = randn((b, sq, hq, d), dtype, g)
    k = randn((b, sk, hkv, d), dtype, g)
    v = randn((b, sk, hkv, d), dtype, g)
    kind = r.choice(["fwd", "fwd", "varlen", "kvcache", "kvcache", "kvcache"])
    if kind == "kvcache" and backend == "cuda_sm90":
        backend = "auto"  # the KV-cache entry refuses cuda_sm90 (its own case below)
    cfg = dict(mode="invalid", kind=kind, dtype=str(dtype), backend=backend, shape=(b, sq, sk, hq, hkv, d))
    CUR[0] = cfg
    if kind == "fwd":
        options = [
            ("k", dict(k=randn((b, sk, 3, d), dtype, g))),  # heads_q % heads_kv
            ("k", dict(k=randn((b, sk, hkv, d + 8), dtype, g))),
            ("v", dict(v=randn((b, sk + 1, hkv, d), dtype, g))),
            ("k", dict(k=k.float() if dtype != torch.float32 else k.half())),
            ("window", dict(window_size=(-2, 3))),
            ("window", dict(window_size=(3, -5))),
            ("softcap", dict(softcap=-1.0)),
            ("softcap", dict(softcap=float("nan"))),
            ("softmax_scale", dict(softmax_scale=float("inf"))),
            ("softmax_scale", dict(softmax_scale=float("nan"))),
            ("dropout_p", dict(dropout_p=1.0)),
            ("dropout_p", dict(dropout_p=-0.1)),
            ("dropout_p", dict(dropout_p=0.99999999)),
            ("alibi_slopes", dict(alibi_slopes=torch.ones(hq + 1))),
            ("alibi_slopes", dict(alibi_slopes=torch.ones(b + 1, hq))),
            ("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("nan"))), "value"),
            ("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("inf"))), "value"),
            ("alibi_slopes", dict(alibi_slopes=torch.ones(hq, dtype=torch.float16))),
            ("out", dict(out=torch.zeros((b, sq, hq, d + 1), dtype=dtype))),
            ("out", dict(out=torch.zeros((b, sq, hq, d), dtype=torch.float32 if dtype != torch.float32 else torch.float16))),
            ("lse", dict(lse=torch.zeros((b, sq, hq + 1), dtype=torch.float32))),  # (b, sq, hq) is right at sq = hq
            ("q", dict(q=q.double())),
        ]
        cuda_only = []
        if cuda:
            # the CUDA backends' own rules (validate_for_backend): fp16 / bf16 only, head dims that
            # are multiples of 8 (attention_forward does not pad them), strides of 8 elements; and
            # every tensor on q's device
            def on_device(x, width):  # x's values in a row of `width` elements (NaN after them)
                base = torch.full(x.shape[:-1] + (width,), float("nan"), dtype=x.dtype, device=DEVICE)
                view = base[..., :x.shape[-1]]
                view.copy_(x)
                return view
            # head_dim d + 3 in rows of a multiple of 8 (and an out like them): the strides pass,
            # so the head_dim rule is the one that answers
            d3, w3 = d + 3, -(-(d + 3) // 8) * 8
            odd = [on_device(randn(shape, dtype, g), w3) for shape in
                   ((b, sq, hq, d3), (b, sk, hkv, d3), (b, sk, hkv, d3), (b, sq, hq, d3))]
            cuda_only = [
                ("q", dict(q=dev(q.float()), k=dev(k.float()), v=dev(v.float()))),
                ("q", dict(q=odd[0], k=odd[1], v=odd[2], out=odd[3])),
                ("q", dict(q=on_device(q, d + 1))),  # a row stride that is not a multiple of 8
                ("k", dict(k=k.clone())),  # a CPU tensor beside a CUDA q
            ]
        expect, over = choose_invalid(r, options, cuda_only)
        cfg["case"] = expect + " " + repr({kk: (tuple(vv.shape), str(vv.dtype)) if torch.is_tensor(vv) else vv
                                          for kk, vv in over.items()})
        if cuda:
            cfg["case"] += " " + repr({kk: str(vv.device) for kk, vv in over.items() if torch.is_tensor(vv)})
        q, k, v = dev(q), dev(k), dev(v)
        args = dict(q=q, k=k, v=v)
        args.update({kk: vv for kk, vv in over.items() if kk in ("q", "k", "v")})
        out = over.get("out", torch.full_like(args["q"], 7.0))
        lse = over.get("lse", torch.full((b, hq, sq), 7.0, device=DEVICE))
        out0, lse0 = out.clone(), lse.clone()
        kw = {kk: vv for kk, vv in over.items() if kk not in ("q", "k", "v", "out", "lse")}
        try:
            fc.attention_forward(args["q"], args["k"], args["v"], out=out, lse=lse, return_lse=True, backend=backend,
                                 dropout_seed=5, **kw)
        except (ValueError, NotImplementedError, TypeError) as e:
            msg = str(e)
            cfg["message"] = msg
            if expect not in msg.split(":")[0] and not msg.startswith(expect):
                raise Failure(f"invalid {cfg['case']}: message does not name {expect!r}: {msg!r}")
            if not (torch.equal(out.nan_to_num(123.0), out0.nan_to_num(123.0)) and torch.equal(lse, lse0)):
                raise Failure(f"invalid {cfg['case']}: out/lse written before the error {msg!r}")
            # also through the flash_attn API with torch autograd
            return cfg
        raise Failure(f"invalid {cfg['case']}: no exception")
    if kind == "varlen":
        lens = [r.randint(0, 10) for _ in range(3)]
        tot = sum(lens)
        qv = randn((tot + 2, hq, d), dtype, g)
        kv_ = randn((tot + 2, hkv, d), dtype, g)
        cu = [0] + list(np.cumsum(lens))
        bad = list(cu)
        options = []
        b2 = list(cu); b2[1], b2[2] = cu[2] + 1, cu[1]
        options.append(("cu_seqlens_q", "q", b2))
        b3 = list(cu); b3[-1] = tot + 5
        options.append(("cu_seqlens_k", "k", b3))
        b4 = list(cu); b4[0] = 1
        options.append(("cu_seqlens_q", "q", [1] + cu[1:] if cu[1] >= 1 else [1, 1] + cu[2:]))
        options.append(("max_seqlen_q", "maxq", cu))
        options.append(("max_seqlen_k", "maxk", cu))
        expect, which, cu_bad = r.choice(options)
        good = dev(torch.tensor(cu, dtype=torch.int32))
        badt = dev(torch.tensor(cu_bad, dtype=torch.int32))
        qv, kv_ = dev(qv), dev(kv_)
        cu_q = badt if which == "q" else good
        cu_k = badt if which == "k" else good
        mq = 1000 if which != "maxq" else max(lens) - 1
        mk = 1000 if which != "maxk" else max(lens) - 1
        if max(lens) == 0 and which in ("maxq", "maxk"):
            return None
        cfg["case"] = f"{expect} cu={cu_bad} lens={lens}"
        out = torch.full_like(qv, 7.0)
        lse = torch.full((hq, tot + 2), 7.0, device=DEVICE)
        try:
            # CUDA cu_seqlens are trusted unless check_cu_seqlens asks for the host copy and check
            # (as flash_attn; a training step must not synchronize): the call that has the rules
            fc.attention_forward(qv, kv_, kv_, out=out, lse=lse, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=mq, max_seqlen_k=mk, backend=backend, check_cu_seqlens=cuda)
        except (ValueError, NotImplementedError, TypeError) as e:
            msg = str(e)
            cfg["message"] = msg
            if not msg.startswith(expect) and expect not in msg.split(":")[0]:
                raise Failure(f"invalid {cfg['case']}: message does not name {expect!r}: {msg!r}")
            if not ((out == 7.0).all() and (lse == 7.0).all()):
                raise Failure(f"invalid {cfg['case']}: out/lse written before the error {msg!r}")
            return cfg
        raise Failure(f"invalid {cfg['case']}: no exception")
    # kvcache
    cap = r.randint(5, 40)
    paged = r.random() < 0.3
    page = r.choice([1, 4, 16])
    pps = -(-cap // page)
    if paged:
        cap = pps * page
        kc = randn((b * pps + 1, page, hkv, d), dtype, g)
        table = torch.randperm(b * pps + 1, generator=g)[:b * pps].reshape(b, pps).to(torch.int32)
    else:
        kc = randn((b, cap, hkv, d), dtype, g)
        table = None
    vc = randn(kc.shape, dtype, g)
    sn = r.randint(1, 4)
    kn = randn((b, sn, hkv, d), dtype, g)
    vn = randn((b, sn, hkv, d), dtype, g)
    lens = [r.randint(0, cap - sn) for _ in range(b)]
    bad_b = r.randrange(b)
    opts = []
    # ("value": checked on the host for CPU tensors only, see choose_invalid)
    L = list(lens); L[bad_b] = cap - sn + 1
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int32)), "value"))
    L = list(lens); L[bad_b] = -1
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int32)), "value"))
    L = list(lens); L[bad_b] = 2**40
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int64)), "value"))
    opts.append(("k", dict(k=randn((b, sn, hkv + 1, d), dtype, g), v=randn((b, sn, hkv + 1, d), dtype, g))))
    opts.append(("v", dict(v=randn((b, sn + 1, hkv, d), dtype, g))))
    opts.append(("k", dict(v=None)))
    opts.append(("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("nan"))), "value"))
    opts.append(("alibi_slopes", dict(alibi_slopes=torch.ones(hq - 1))))
    opts.append(("window", dict(window_size=(-3, 0))))
    opts.append(("softcap", dict(softcap=-2.0)))
    rows = max(lens) + sn - 1  # too few for cache_seqlens' positions
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(rows, 4), rotary_sin=torch.ones(rows, 4)), "value"))
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(cap + 5, d // 2 + 1), rotary_sin=torch.ones(cap + 5, d // 2 + 1))))
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(cap + 5, 4))))
    opts.append(("num_splits", dict(num_splits=-1)))
    if paged:
        used = (lens[bad_b] + sn - 1) // page  # last page the sequence uses (unused entries are ignored, as flash_attn)
        T = table.clone(); T[bad_b, used] = kc.shape[0]
        opts.append(("block_table", dict(block_table=T), "value"))
        T = table.clone(); T[bad_b, r.randint(0, used)] = -1
        opts.append(("block_table", dict(block_table=T), "value"))
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.zeros(b, dtype=torch.int32))))
    else:
        opts.append(("cache_batch_idx", dict(cache_batch_idx=torch.tensor([0] * (b - 1) + [b], dtype=torch.int32)),
                     "value"))
        opts.append(("cache_batch_idx", dict(cache_batch_idx=torch.tensor([-1] + [0] * (b - 1), dtype=torch.int32)),
                     "value"))
        LP = [0] * b; LP[bad_b] = lens[bad_b] + 1
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.tensor(LP, dtype=torch.int32)), "value"))
        LP = [0] * b; LP[bad_b] = -1
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.tensor(LP, dtype=torch.int32)), "value"))
    cuda_only = []
    if cuda:
        d3 = d + 3  # not a multiple of 8: the KV-cache call does not pad (appending into a copy would be lost)
        cuda_only = [
            ("q", {kk: dev(randn(x.shape[:-1] + (d3,), dtype, g)) for kk, x in
                   (("q", q), ("k_cache", kc), ("v_cache", vc), ("k", kn), ("v", vn))}),
            ("k_cache", dict(k_cache=kc.clone())),  # a CPU cache beside a CUDA q
        ]
        if "cuda_sm90" in GPU_BACKENDS:
            cuda_only.append(("backend", dict(_backend="cuda_sm90")))  # serves no KV-cache call
    expect, over = choose_invalid(r, opts, cuda_only)
    cfg["case"] = expect + " " + repr({kk: (tuple(vv.shape), vv.flatten()[:6].tolist()) if torch.is_tensor(vv) else vv
                                      for kk, vv in over.items()})
    kw = dict(k=kn, v=vn, cache_seqlens=torch.tensor(lens, dtype=torch.int32), block_table=table)
    kw = {kk: dev(vv) for kk, vv in kw.items()}
    kw.update(over)
    if expect == "num_splits":
        pass
    cfg["backend"] = backend = kw.pop("_backend", backend)
    q, kc, vc = kw.pop("q", dev(q)), kw.pop("k_cache", dev(kc)), kw.pop("v_cache", dev(vc))
    kc0, vc0 = kc.clone(), vc.clone()
    fc.set_default_backend(backend)
    try:
        fc.flash_attn_with_kvcache(q, kc, vc, **kw)
    except (ValueError, NotImplementedError, TypeError) as e:
        msg = str(e)
        cfg["message"] = msg
        if not msg.startswith(expect) and expect not in msg.split(":")[0]:
            raise Failure(f"invalid kvcache {cfg['case']}: message does not name {expect!r}: {msg!r}")
        if not (torch.equal(kc, kc0) and torch.equal(vc, vc0)):
            raise Failure(f"invalid kvcache {cfg['case']}: caches modified before the error {msg!r}")
        return cfg
    finally:
        fc.set_default_backend("auto")
    if expect == "num_splits":
        cfg["note"] = "num_splits=-1 accepted"
        raise Failure(f"invalid kvcache {cfg['case']}: no exception")
    raise Failure(f"invalid kvcache {cfg['case']}: no exception")


# ---- driver -------------------------------------------------------------------------------------


MODES = {"dense": lambda r, g: attention_case(r, g, "dense"),
         "varlen": lambda r, g: attention_case(r, g, "varlen"),
         "paged": paged_case,
         "kvcache": kvcache_case,
         "invalid": invalid_case}
WEIGHTS = {"dense": 4, "varlen": 2, "paged": 1.5, "kvcache": 3, "invalid": 1}


def run_one(seed, mode=None):
    r = random.Random(seed)
    mode = mode or r.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    g = torch.Generator().manual_seed(seed)
    cfg = MODES[mode](r, g)
    if on_cuda():
        torch.cuda.synchronize()  # an asynchronous fault surfaces here, charged to this seed
    return mode, cfg


def summarize(cfg):
    keys = []
    if cfg is None:
        return keys
    m = cfg["mode"]
    keys.append(m)
    if m == "invalid":
        keys.append("invalid:" + cfg.get("case", "").split(" ")[0])
        return keys
    keys.append(m + ":" + cfg["dtype"])
    for f in ("causal",):
        if cfg.get(f):
            keys.append(m + ":" + f)
    if cfg.get("softcap"):
        keys.append(m + ":softcap")
    if cfg.get("alibi"):
        keys.append(m + ":alibi")
    if cfg.get("window", (-1, -1)) != (-1, -1):
        keys.append(m + ":window")
    if cfg.get("scale") is not None and cfg["scale"] < 0:
        keys.append(m + ":neg_scale")
    if cfg.get("dropout"):
        keys.append(m + ":dropout")
    if cfg.get("backward"):
        keys.append(m + ":backward")
    if cfg.get("dropout") and cfg.get("backward"):
        keys.append(m + ":dropout+backward")
    if cfg.get("packed"):
        keys.append(m + ":packed_" + cfg["packed"])
    if cfg.get("d", 8) % 8:
        keys.append(m + ":odd_head_dim")
    for f in ("paged", "rotary", "leftpad", "cache_batch_idx", "seqlens_none"):
        if cfg.get(f):
            keys.append(m + ":" + f)
    if m == "kvcache":
        keys.append(f"kvcache:splits{cfg['num_splits']}")
        if cfg["seqlen_new"]:
            keys.append("kvcache:append")
    if on_cuda():
        longest = max(cfg.get("lens_q", []) + cfg.get("lens_k", []) + [cfg.get("capacity", 0)])
        if longest > 300:
            keys.append(m + ":long")
        if cfg.get("page"):  # which page sizes each CUDA backend read in place (see REFUSALS)
            page = cfg["page"]
            kind = "x256" if page % 256 == 0 else "x128" if page % 128 == 0 else "small"
            keys.append(f"{m}:pages_{kind}")
    keys.extend(cfg.get("skips", ()))
    return keys


def setup_cuda():
    """CUDA mode's settings, or an exit with the reason when this machine cannot run it."""
    global DEVICE, WORK_CAP, TRUTH_THREADS
    if not torch.cuda.is_available():
        sys.exit("api_fuzz: --device cuda: no CUDA device (torch.cuda.is_available() is False)")
    index = torch.cuda.current_device()
    if not fc.backend_available("cuda_sm80", index):
        sys.exit(f"api_fuzz: --device cuda: no CUDA device flashcore can use (cuda_sm80 is not available on "
                 f"cuda:{index}: a build without CUDA or a GPU older than sm_80)\n" + fc.build_info())
    DEVICE = "cuda"
    GPU_BACKENDS[:] = ["cuda_sm80"]
    if torch.cuda.get_device_capability(index) == (9, 0):
        if fc.backend_available("cuda_sm90", index):
            GPU_BACKENDS.append("cuda_sm90")
        else:
            print("note: a CC 9.0 device, but cuda_sm90 is not compiled into this build", flush=True)
    GPU_BACKENDS.append("auto")
    # The float64 truth of cases with ~1100-token sequences: the GPU machine has 16 cores
    WORK_CAP = 2e8
    TRUTH_THREADS = min(8, os.cpu_count() or 1)
    reset_threads()
    print(f"cuda:{index}: {fc.cuda_device_description(index)}; backends {', '.join(GPU_BACKENDS)}", flush=True)


def cuda_usable():
    """Whether the CUDA context still runs work: a fault such as an illegal memory access is
    sticky, and every later call would fail with it."""
    try:
        torch.cuda.synchronize()
        return (torch.ones(1, device=DEVICE) + 1).item() == 2.0
    except Exception:  # noqa: BLE001
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the library's tensors live: cpu (cpu_flash, cpu_reference, auto) or cuda "
                         "(cuda_sm80, cuda_sm90 on CC 9.0, auto)")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--repro", type=int, default=None)
    ap.add_argument("--modes", default=None)
    ap.add_argument("--max-iters", type=int, default=10**9)
    ap.add_argument("--out", default=FAIL_LOG, help="failure log, one JSON object per line (appended)")
    a = ap.parse_args()
    if a.device == "cuda":
        setup_cuda()
    if a.modes:
        for m in list(WEIGHTS):
            if m not in a.modes.split(","):
                WEIGHTS.pop(m)
    if a.repro is not None:
        try:
            mode, cfg = run_one(a.repro)
            print("PASS", mode, json.dumps(cfg, default=str))
        except Exception as e:  # noqa: BLE001
            print("FAIL", type(e).__name__, e)
            print(json.dumps(CUR[0], default=str))
            raise
        return
    start = time.time()
    counts, fails = {}, 0
    it = 0

    def summary():
        print(f"iterations {it}, failures {fails}, {time.time() - start:.0f}s")
        for kk in sorted(counts):
            print(f"  {kk}: {counts[kk]}")

    while time.time() - start < a.minutes * 60 and it < a.max_iters:
        seed = a.seed + it
        it += 1
        CUR[0] = None
        try:
            mode, cfg = run_one(seed)
            for kk in summarize(cfg):
                counts[kk] = counts.get(kk, 0) + 1
        except Exception as e:  # noqa: BLE001
            fails += 1
            kind = "Failure" if isinstance(e, Failure) else type(e).__name__
            rec = dict(seed=seed, device=a.device, kind=kind, error=str(e)[:600], cfg=CUR[0])
            if not isinstance(e, Failure):
                rec["trace"] = traceback.format_exc()[-1500:]
            # recover the config by replaying the random choices is not possible mid-way; log seed
            with open(a.out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            print(f"[{it}] seed {seed} FAIL {kind}: {str(e)[:300]}", flush=True)
            # a failure mid-loop leaves a backend and a thread count behind
            fc.set_default_backend("auto")
            reset_threads()
            if on_cuda() and not cuda_usable():
                summary()
                sys.exit(f"api_fuzz: the CUDA context is unusable after seed {seed} ({kind}: {str(e)[:200]}); "
                         f"stopped (logged to {a.out}). Replay it in a fresh process: --device cuda --repro {seed}")
        if it % 25 == 0:
            print(f"[{it}] {time.time() - start:.0f}s fails={fails}", flush=True)
    summary()


if __name__ == "__main__":
    main()
