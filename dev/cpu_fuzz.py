"""Randomized differential fuzz of flashcore's CPU backends (a development tool, not a test: session 47
ran ~71,000 iterations with it and found one misleading cu_seqlens error message, since fixed).

cpu_flash and cpu_reference (the fp64 oracle) are both compared with an independent float64
plain-torch implementation written here (dense, varlen, paged varlen, KV cache with append /
rotary / leftpad / cache_batch_idx / paged caches, ALiBi, softcap, windows, dropout through the
test suite's numpy replica of the Philox mask), plus cpu_flash vs cpu_reference directly.
Tolerance (tests' rule): max|X - truth| <= F * max|X_same - truth| + atol, X_same = a naive
same-precision computation (fp32 math, P rounded to the dtype), atol = 2 roundings at the
truth's magnitude; fp32 additionally passes with a relative (norm) error <= 1e-5.

Usage: PYTHONPATH=<package> nice -n 10 python3 dev/cpu_fuzz.py [--minutes M] [--seed S]
       [--repro SEED] [--modes dense,varlen,paged,kvcache,invalid]
Failures go to /tmp/fz_failures.jsonl (one JSON object per failure, with the iteration seed).
"""

import argparse
import json
import math
import os
import random
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


class Failure(Exception):
    pass


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
    where = ((a - t).abs() * fin).flatten().argmax().item()
    idx = np.unravel_index(where, tuple(a.shape))
    raise Failure(f"{name}: max err {err:.3g} > {factor} x same {serr:.3g} + atol {atol:.3g} "
                  f"(worst at {tuple(int(x) for x in idx)}: got {a[idx].item():.6g}, truth {t[idx].item():.6g}, "
                  f"truth max|.| {t[fin].abs().max().item():.3g})")


# ---- random configuration ---------------------------------------------------------------------


HEAD_DIMS = list(range(8, 257, 8)) + [36, 60, 100, 20, 44, 4, 12]


def pick_head_dim(r):
    if r.random() < 0.2:
        return r.choice([36, 60, 100, 20, 44, 4, 12])
    return r.choice([8, 16, 24, 32, 40, 48, 64, 64, 72, 80, 96, 128, 128, 160, 192, 256, 256]
                    + list(range(8, 257, 8)))


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
    return r.randint(130, hi)


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
    c["dtype"] = dtype_name or r.choice(["fp32", "fp16", "bf16"])
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
    pads = [r.randint(0, 2) for _ in range(x.dim() - 1)] + [r.choice([0, 0, 1, 8])]
    base = torch.full([n + p for n, p in zip(x.shape, pads)], float("nan"), dtype=x.dtype)
    view = base[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view, base, "pad"


def set_threads(r):
    torch.set_num_threads(2 if r.random() < 0.25 else 1)


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
    if work > 3e7 and r.random() < 0.5:
        hq = hkv
        if c["alibi"]:
            sh = c["alibi"][1]
            c["alibi"] = ("shape", [hq] if len(sh) == 1 else [batch, hq], c["alibi"][2], c["alibi"][3])
        work = sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d
    while work > 3e7 and d > 8:
        d = max(8, d // 2 // 8 * 8)
        work = sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d
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
    for backend in (("cpu_flash", "cpu_reference", "auto") if r.random() < 0.3 else ("cpu_flash", "cpu_reference")):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        else:
            torch.set_num_threads(1)
        leaves = [restride(x, r)[0].requires_grad_(backward) for x in (q, k, v)]
        dout_b = restride(dout, r)[0]
        kw = dict(dropout_p=dropout, softmax_scale=c["scale"], causal=c["causal"], window_size=window,
                  softcap=c["softcap"], alibi_slopes=slopes, return_attn_probs=True, deterministic=deterministic)
        torch.manual_seed(call_seed)
        if mode == "dense":
            if packed == "qkv":
                qkv = torch.stack(leaves, dim=2)
                out, lse, _ = fc.flash_attn_qkvpacked_func(qkv, **kw)
            elif packed == "kv":
                out, lse, _ = fc.flash_attn_kvpacked_func(leaves[0], torch.stack(leaves[1:], dim=2), **kw)
            else:
                out, lse, _ = fc.flash_attn_func(*leaves, **kw)
        else:
            out, lse, _ = fc.flash_attn_varlen_func(*leaves, cu_q, cu_k, mq, mk, **kw)
        grads = None
        if backward:
            grads = torch.autograd.grad(out, leaves, dout_b)
        results[backend] = (out.detach(), lse.detach(), grads)
    torch.set_num_threads(1)
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
    d = pick_head_dim(r)
    c = pick_common(r, hq, batch)
    dtype = DTYPES[c["dtype"]]
    page = r.choice([1, 2, 3, 7, 8, 16, 31, 32, 64, r.randint(1, 64)])
    lens_q = [pick_len(r, 150) for _ in range(batch)]
    lens_k = [pick_len(r, 250) for _ in range(batch)]
    while sum(a * b for a, b in zip(lens_q, lens_k)) * hq * d > 3e7 and d > 8:
        d = max(8, d // 2 // 8 * 8)
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
    for backend in (("cpu_flash", "cpu_reference", "auto") if r.random() < 0.3 else ("cpu_flash", "cpu_reference")):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        kp_c, vp_c = kp.clone(), vp.clone()
        out, lse, _ = fc.flash_attn_varlen_func(restride(q, r)[0], kp_c, vp_c, cu_q, cu_k, mq, mk, softmax_scale=c["scale"],
                                                causal=c["causal"], window_size=window, softcap=c["softcap"],
                                                alibi_slopes=slopes, return_attn_probs=True, block_table=table)
        torch.set_num_threads(1)
        if not (torch.equal(kp_c, kp) and torch.equal(vp_c, vp)):
            raise Failure(f"{backend}: paged forward modified k/v pages")
        results[backend] = (out, lse)
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


def kvcache_case(r, g):
    batch = r.randint(1, 3)
    hkv = r.choice([1, 2, 3, 4])
    hq = hkv * r.choice([1, 1, 2, 4, 8])
    d = pick_head_dim(r)
    c = pick_common(r, hq, batch)
    dtype = DTYPES[c["dtype"]]
    u = r.random()
    sq = 1 if u < 0.4 else (r.randint(2, 16) if u < 0.8 else r.randint(17, 100))
    append = r.random() < 0.5
    sn = r.randint(1, 20) if append else 0
    if r.random() < 0.2 and append:
        sn = r.randint(20, 80)
    paged = r.random() < 0.4
    page = r.choice([1, 2, 5, 8, 16, 32, 64, r.randint(1, 64)]) if paged else None
    want_cap = r.randint(max(1, sn), max(sn, 1) + r.choice([5, 40, 150, 300]))
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
    while batch * hq * sq * cap * d > 3e7 and d > 8:
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
    for backend in (("cpu_flash", "cpu_reference", "auto") if r.random() < 0.3 else ("cpu_flash", "cpu_reference")):
        fc.set_default_backend(backend)
        if backend != "cpu_reference":
            set_threads(r)
        kc_c, kbase, kkind = restride(kc, r, r.choice(["same", "pad"]))
        vc_c, vbase, vkind = restride(vc, r, r.choice(["same", "pad"]))
        cfg.setdefault("cache_layouts", []).append((kkind, vkind))
        q_b = restride(q, r)[0]
        kn_b = restride(kn, r)[0] if kn is not None else None
        vn_b = restride(vn, r)[0] if vn is not None else None
        out, lse = fc.flash_attn_with_kvcache(
            q_b, kc_c, vc_c, kn_b, vn_b, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cs_arg, cache_batch_idx=bidx,
            cache_leftpad=leftpad, block_table=table, softmax_scale=c["scale"], causal=c["causal"],
            window_size=window, softcap=c["softcap"], rotary_interleaved=interleaved, alibi_slopes=slopes,
            num_splits=num_splits, return_softmax_lse=True)
        torch.set_num_threads(1)
        for base, view in ((kbase, kc_c), (vbase, vc_c)):
            if base is not None:
                outside = torch.ones(base.shape, dtype=torch.bool)
                outside[tuple(slice(0, n) for n in view.shape)] = False
                if not torch.isnan(base[outside]).all():
                    raise Failure(f"{backend}: wrote outside the strided cache view")
        results[backend] = (out, lse, kc_c, vc_c)
    fc.set_default_backend("auto")
    # reference append (exact unless rotary)
    kn_w = kn
    q_use = q
    if rotary:
        pos_k = torch.tensor([[lens[b] + j for j in range(sn)] for b in range(batch)], dtype=torch.long).reshape(batch, sn)
        # fp32 math rounded once, as documented (flash_attn's rule)
        kn_w = rotate(kn.float(), cos.float(), sin.float(), pos_k, interleaved).to(dtype)
        per_token = cfg["per_token"]
        pos_q = torch.tensor([[lens[b] + (i if per_token else 0) for i in range(sq)] for b in range(batch)],
                             dtype=torch.long).reshape(batch, sq)
        q_use = rotate(q.float(), cos.float(), sin.float(), pos_q, interleaved).to(dtype)
    k_after, v_after = kc.clone(), vc.clone()
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
    for backend, (out, lse, kc_c, vc_c) in results.items():
        if not torch.equal(vc_c, v_after):
            diff = (vc_c != v_after).nonzero()[0].tolist()
            raise Failure(f"{backend}: v_cache after append differs at {diff}")
        if rotary:
            if not torch.equal(kc_c[~torch.isclose(k_after.double(), k_after.double())], k_after[~torch.isclose(k_after.double(), k_after.double())]):
                pass
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
    for b in range(batch):
        start = 0 if leftpad is None else int(leftpad[b])
        end = lens[b] + sn
        slots = [slot(b, t) for t in range(start, end)]
        kk = torch.stack([k_after[a_, s_] for a_, s_ in slots]) if slots else k_after[0, :0]
        vv = torch.stack([v_after[a_, s_] for a_, s_ in slots]) if slots else v_after[0, :0]
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o64, l64 = seq_attention(q_use[b], kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0,
                                 torch.float64, None)
        o32, l32 = seq_attention(q_use[b], kk, vv, scale, c["causal"], window, c["softcap"], sb, None, 0,
                                 torch.float32, dtype if dtype != torch.float32 else None)
        o64s.append(o64); l64s.append(l64); o32s.append(o32); l32s.append(l32)
    out64, lse64 = torch.stack(o64s), torch.stack(l64s)
    same, lse32 = torch.stack(o32s).to(dtype), torch.stack(l32s)
    for backend, (out, lse, _, _) in results.items():
        check(f"{backend} out", out, out64, same, dtype, factor=3.0 if rotary else 2.0)
        check(f"{backend} lse", lse, lse64, lse32, torch.float32, factor=3.0 if rotary else 2.0,
              floor=lse_floor(lse64, scale, q_use, kc, c["softcap"], slopes))
    return cfg


# ---- invalid inputs ---------------------------------------------------------------------------


def invalid_case(r, g):
    """One random invalid call. Must raise ValueError / NotImplementedError / TypeError naming the
    expected argument and leave caller buffers (out / lse / caches) untouched."""
    dtype = DTYPES[r.choice(["fp32", "fp16", "bf16"])]
    backend = r.choice(["cpu_flash", "cpu_reference"])
    b, sq, sk, hq, hkv, d = r.randint(1, 3), r.randint(1, 40), r.randint(1, 40), 4, 2, r.choice([16, 36, 64])
    q = randn((b, sq, hq, d), dtype, g)
    k = randn((b, sk, hkv, d), dtype, g)
    v = randn((b, sk, hkv, d), dtype, g)
    kind = r.choice(["fwd", "fwd", "varlen", "kvcache", "kvcache", "kvcache"])
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
            ("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("nan")))),
            ("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("inf")))),
            ("alibi_slopes", dict(alibi_slopes=torch.ones(hq, dtype=torch.float16))),
            ("out", dict(out=torch.zeros((b, sq, hq, d + 1), dtype=dtype))),
            ("out", dict(out=torch.zeros((b, sq, hq, d), dtype=torch.float32 if dtype != torch.float32 else torch.float16))),
            ("lse", dict(lse=torch.zeros((b, sq, hq), dtype=torch.float32))),
            ("q", dict(q=q.double())),
        ]
        expect, over = r.choice(options)
        cfg["case"] = expect + " " + repr({kk: (tuple(vv.shape), str(vv.dtype)) if torch.is_tensor(vv) else vv
                                          for kk, vv in over.items()})
        args = dict(q=q, k=k, v=v)
        args.update({kk: vv for kk, vv in over.items() if kk in ("q", "k", "v")})
        out = over.get("out", torch.full_like(args["q"], 7.0))
        lse = over.get("lse", torch.full((b, hq, sq), 7.0))
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
        good = torch.tensor(cu, dtype=torch.int32)
        badt = torch.tensor(cu_bad, dtype=torch.int32)
        cu_q = badt if which == "q" else good
        cu_k = badt if which == "k" else good
        mq = 1000 if which != "maxq" else max(lens) - 1
        mk = 1000 if which != "maxk" else max(lens) - 1
        if max(lens) == 0 and which in ("maxq", "maxk"):
            return None
        cfg["case"] = f"{expect} cu={cu_bad} lens={lens}"
        out = torch.full_like(qv, 7.0)
        lse = torch.full((hq, tot + 2), 7.0)
        try:
            fc.attention_forward(qv, kv_, kv_, out=out, lse=lse, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=mq, max_seqlen_k=mk, backend=backend)
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
    L = list(lens); L[bad_b] = cap - sn + 1
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int32))))
    L = list(lens); L[bad_b] = -1
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int32))))
    L = list(lens); L[bad_b] = 2**40
    opts.append(("cache_seqlens", dict(cache_seqlens=torch.tensor(L, dtype=torch.int64))))
    opts.append(("k", dict(k=randn((b, sn, hkv + 1, d), dtype, g), v=randn((b, sn, hkv + 1, d), dtype, g))))
    opts.append(("v", dict(v=randn((b, sn + 1, hkv, d), dtype, g))))
    opts.append(("k", dict(v=None)))
    opts.append(("alibi_slopes", dict(alibi_slopes=torch.full((hq,), float("nan")))))
    opts.append(("alibi_slopes", dict(alibi_slopes=torch.ones(hq - 1))))
    opts.append(("window", dict(window_size=(-3, 0))))
    opts.append(("softcap", dict(softcap=-2.0)))
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(max(lens) + sn - 1, 4), rotary_sin=torch.ones(max(lens) + sn - 1, 4))))
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(cap + 5, d // 2 + 1), rotary_sin=torch.ones(cap + 5, d // 2 + 1))))
    opts.append(("rotary_cos", dict(rotary_cos=torch.ones(cap + 5, 4))))
    opts.append(("num_splits", dict(num_splits=-1)))
    if paged:
        used = (lens[bad_b] + sn - 1) // page  # last page the sequence uses (unused entries are ignored, as flash_attn)
        T = table.clone(); T[bad_b, used] = kc.shape[0]
        opts.append(("block_table", dict(block_table=T)))
        T = table.clone(); T[bad_b, r.randint(0, used)] = -1
        opts.append(("block_table", dict(block_table=T)))
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.zeros(b, dtype=torch.int32))))
    else:
        opts.append(("cache_batch_idx", dict(cache_batch_idx=torch.tensor([0] * (b - 1) + [b], dtype=torch.int32))))
        opts.append(("cache_batch_idx", dict(cache_batch_idx=torch.tensor([-1] + [0] * (b - 1), dtype=torch.int32))))
        LP = [0] * b; LP[bad_b] = lens[bad_b] + 1
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.tensor(LP, dtype=torch.int32))))
        LP = [0] * b; LP[bad_b] = -1
        opts.append(("cache_leftpad", dict(cache_leftpad=torch.tensor(LP, dtype=torch.int32))))
    expect, over = r.choice(opts)
    cfg["case"] = expect + " " + repr({kk: (tuple(vv.shape), vv.flatten()[:6].tolist()) if torch.is_tensor(vv) else vv
                                      for kk, vv in over.items()})
    kw = dict(k=kn, v=vn, cache_seqlens=torch.tensor(lens, dtype=torch.int32), block_table=table)
    kw.update(over)
    if expect == "num_splits":
        pass
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
    return mode, MODES[mode](r, g)


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
    return keys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--repro", type=int, default=None)
    ap.add_argument("--modes", default=None)
    ap.add_argument("--max-iters", type=int, default=10**9)
    a = ap.parse_args()
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
            rec = dict(seed=seed, kind=kind, error=str(e)[:600], cfg=CUR[0])
            if not isinstance(e, Failure):
                rec["trace"] = traceback.format_exc()[-1500:]
            # recover the config by replaying the random choices is not possible mid-way; log seed
            with open(FAIL_LOG, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            print(f"[{it}] seed {seed} FAIL {kind}: {str(e)[:300]}", flush=True)
        if it % 25 == 0:
            print(f"[{it}] {time.time() - start:.0f}s fails={fails}", flush=True)
    print(f"iterations {it}, failures {fails}, {time.time() - start:.0f}s")
    for kk in sorted(counts):
        print(f"  {kk}: {counts[kk]}")


if __name__ == "__main__":
    main()
