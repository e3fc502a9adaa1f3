"""Correctness and speed of the sm80 forward kernel through dev/forward_harness.cu (ctypes + torch).

Correctness: every case against a torch fp64 reference of the flashcore semantics (bottom-right
aligned causal/window masks, softcap, GQA, varlen, empty rows -> out 0 / lse -inf), with the
TESTING.md rule  err <= 2 * err_same + atol  where "same" is a fp32 emulation that rounds the
unnormalized P to the input dtype like the kernel. Outputs are poisoned first; padding columns of
strided outputs must stay untouched. Speed: the training grid (B = 16384 / S, H = 2048 / D, bf16)
against PyTorch SDPA's FlashAttention-2 backend, median of CUDA-event timed loops.

usage: python3 dev/forward_check.py LIB.so [--check] [--bench] [--variants 1,2,...] [--quick]
"""
import argparse
import ctypes
import itertools
import math
import statistics
import sys

import torch
import torch.nn.functional as F

DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2}


class Harness:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        f = self.lib.fcdev_forward
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp, vp, vp, vp, ctypes.POINTER(i64), i64, i64,
                      i64, i64, i64, i64, vp, vp, i64, i64, ctypes.c_float, ctypes.c_float, i64, i64,
                      vp]
        f.restype = ctypes.c_int
        self.lib.fcdev_variant_head_dim.argtypes = [ctypes.c_int]
        self.lib.fcdev_variant_head_dim.restype = ctypes.c_int

    def variant_head_dim(self, v):
        return self.lib.fcdev_variant_head_dim(v)

    def forward(self, variant, q, k, v, out, lse, *, batch, seqlen_q, seqlen_k, cu_q=None, cu_k=None,
                scale, softcap=0.0, wl=-1, wr=-1):
        """q/k/v/out: dense (B, S, H, D) or varlen (T, H, D) views; lse dense (B, H, S) or (H, T)."""
        varlen = cu_q is not None

        def trip(t):
            if varlen:
                return [0, t.stride(0), t.stride(1)]
            return [t.stride(0), t.stride(1), t.stride(2)]

        strides = trip(q) + trip(k) + trip(v) + trip(out)
        if lse is None:
            strides += [0, 0, 0]
        elif varlen:
            strides += [0, lse.stride(0), lse.stride(1)]
        else:
            strides += [lse.stride(0), lse.stride(1), lse.stride(2)]
        arr = (ctypes.c_int64 * 15)(*strides)
        hq, d = q.shape[-2], q.shape[-1]
        hkv = k.shape[-2]
        rc = self.lib.fcdev_forward(
            variant, DTYPE_CODE[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            lse.data_ptr() if lse is not None else None, arr, batch, seqlen_q, seqlen_k, hq, hkv, d,
            cu_q.data_ptr() if varlen else None, cu_k.data_ptr() if varlen else None,
            q.shape[0] if varlen else batch * seqlen_q, k.shape[0] if varlen else batch * seqlen_k,
            scale, softcap, wl, wr, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"fcdev_forward returned {rc}")


# ---- reference -----------------------------------------------------------------------------------

def allowed_mask(sq, sk, wl, wr, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if wl >= 0:
        ok &= j >= diag - wl
    if wr >= 0:
        ok &= j <= diag + wr
    return ok


def reference_one(q, k, v, scale, softcap, wl, wr, same_dtype=None):
    """q (Sq, Hq, D), k/v (Sk, Hkv, D) -> out (Sq, Hq, D), lse (Hq, Sq). fp64, or fp32 with the
    unnormalized P rounded to same_dtype (the kernel's own precision)."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    work = torch.float64 if same_dtype is None else torch.float32
    q, k, v = q.to(work), k.to(work), v.to(work)
    if sk == 0:
        return torch.zeros(sq, hq, d, dtype=work, device=q.device), torch.full(
            (hq, sq), -math.inf, dtype=work, device=q.device)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed_mask(sq, sk, wl, wr, q.device), -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    lse = (m_safe + torch.log(l)).squeeze(-1)
    if same_dtype is not None:
        p = p.to(same_dtype).to(work)
    out = torch.einsum("hqk,khd->qhd", p, v) / torch.where(l == 0, torch.ones_like(l), l).permute(
        1, 0, 2)
    if same_dtype is not None:
        out = out.to(same_dtype).to(work)  # the kernel's output is stored in the dtype too
    return out, lse


# ---- cases -------------------------------------------------------------------------------------

class Case:
    def __init__(self, name, *, b=1, sq, sk, hq=4, hkv=None, d=64, dtype=torch.bfloat16,
                 causal=False, wl=-1, wr=-1, softcap=0.0, scale=None, varlen=None, pad=0,
                 magnitude=1.0, lse=True):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        self.hkv = hkv or hq
        if causal:
            self.wr = 0
        self.scale = scale if scale is not None else 1.0 / math.sqrt(d)


def make_case_tensors(c, gen):
    dev = "cuda"

    def rnd(*shape):
        t = torch.randn(*shape[:-1], shape[-1] + c.pad, generator=gen, device=dev)
        return (t * c.magnitude).to(c.dtype)[..., :shape[-1]]

    if c.varlen:
        lq = [x[0] for x in c.varlen]
        lk = [x[1] for x in c.varlen]
        cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32, device=dev)
        q = rnd(sum(lq), c.hq, c.d)
        k = rnd(sum(lk), c.hkv, c.d)
        v = rnd(sum(lk), c.hkv, c.d)
        return q, k, v, cu_q, cu_k, lq, lk
    q = rnd(c.b, c.sq, c.hq, c.d)
    k = rnd(c.b, c.sk, c.hkv, c.d)
    v = rnd(c.b, c.sk, c.hkv, c.d)
    return q, k, v, None, None, None, None


def check_case(h, variant, c, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, cu_q, cu_k, lq, lk = make_case_tensors(c, gen)
    sentinel = 12288.0
    out_full = torch.full((*q.shape[:-1], q.shape[-1] + c.pad), sentinel, dtype=c.dtype,
                          device="cuda")
    out_full[..., :c.d] = float("nan")
    out = out_full[..., :c.d]
    if c.varlen:
        lse = torch.full((c.hq, q.shape[0]), float("nan"), device="cuda") if c.lse else None
        batch, sq, sk = len(lq), max(lq + [0]), max(lk + [0])
    else:
        lse = torch.full((c.b, c.hq, c.sq), float("nan"), device="cuda") if c.lse else None
        batch, sq, sk = c.b, c.sq, c.sk
    h.forward(variant, q, k, v, out, lse, batch=batch, seqlen_q=sq, seqlen_k=sk, cu_q=cu_q,
              cu_k=cu_k, scale=c.scale, softcap=c.softcap, wl=c.wl, wr=c.wr)
    torch.cuda.synchronize()
    # Reference per sequence.
    refs, sames, lrefs, lsames = [], [], [], []
    if c.varlen:
        qs = torch.split(q, lq)
        ks = torch.split(k, lk)
        vs = torch.split(v, lk)
    else:
        qs, ks, vs = list(q), list(k), list(v)
    for qi, ki, vi in zip(qs, ks, vs):
        o, l = reference_one(qi, ki, vi, c.scale, c.softcap, c.wl, c.wr)
        o2, l2 = reference_one(qi, ki, vi, c.scale, c.softcap, c.wl, c.wr, same_dtype=c.dtype)
        refs.append(o)
        sames.append(o2)
        lrefs.append(l)
        lsames.append(l2)
    if c.varlen:
        ref, same = torch.cat(refs), torch.cat(sames)
        lref, lsame = torch.cat(lrefs, dim=1), torch.cat(lsames, dim=1)
    else:
        ref, same = torch.stack(refs), torch.stack(sames)
        lref, lsame = torch.stack(lrefs), torch.stack(lsames)
    problems = []
    o64 = out.double()
    if torch.isnan(o64).any():
        problems.append(f"out has {int(torch.isnan(o64).sum())} NaN/unwritten")
    err = (o64 - ref).abs().max().item() if ref.numel() else 0.0
    err_same = (same.double() - ref).abs().max().item() if ref.numel() else 0.0
    # tests/common/harness.cpp's atol: twice the rounding of one add at the reference's magnitude.
    atol = 0.0
    if ref.numel():
        back = ((ref.to(c.dtype).float() + 0.3).to(c.dtype).float() - 0.3).to(c.dtype).double()
        atol = 2 * (back - ref).abs().max().item()
    if not err <= 2 * err_same + atol:
        problems.append(f"out err {err:.3e} > 2*{err_same:.3e}+{atol:.2e}")
    if c.pad and not (out_full[..., c.d:] == sentinel).all():
        problems.append("wrote into padding columns")
    if lse is not None:
        l64 = lse.double()
        fin = torch.isfinite(lref)
        if torch.isnan(l64).any():
            problems.append(f"lse has {int(torch.isnan(l64).sum())} NaN/unwritten")
        if not torch.equal(torch.isinf(l64) & (l64 < 0), ~fin):
            problems.append("lse -inf pattern differs")
        elif fin.any():
            lerr = (l64[fin] - lref[fin]).abs().max().item()
            lerr_same = (lsame.double()[fin] - lref[fin]).abs().max().item()
            if not lerr <= 2 * lerr_same + 1e-4:
                problems.append(f"lse err {lerr:.3e} > 2*{lerr_same:.3e}+1e-4")
    return problems, err, err_same


def correctness_cases(quick=False):
    cases = []
    pairs = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (127, 512), (239, 1), (512, 256),
             (1023, 1024), (1024, 1023), (2048, 2048), (300, 100)]
    dims = [64, 128, 256]
    for d in dims:
        for sq, sk in pairs:
            if quick and sq * sk > 300000:
                continue
            for causal in (False, True):
                cases.append(Case(f"d{d} {sq}x{sk} causal={causal}", sq=sq, sk=sk, d=d,
                                  causal=causal, hq=2 if sq * sk > 1e6 else 4))
    for d in (40, 56, 80, 96, 112, 136, 200, 248):
        for causal in (False, True):
            cases.append(Case(f"odd d{d} causal={causal}", sq=257, sk=333, d=d, causal=causal))
    for dt in (torch.float16,):
        for d in dims:
            for causal in (False, True):
                cases.append(Case(f"fp16 d{d} causal={causal}", sq=385, sk=411, d=d, dtype=dt,
                                  causal=causal))
    for d in dims:
        cases.append(Case(f"gqa 8/2 d{d}", b=2, sq=200, sk=300, hq=8, hkv=2, d=d, causal=True))
        cases.append(Case(f"mqa 8/1 d{d}", b=2, sq=200, sk=300, hq=8, hkv=1, d=d))
        cases.append(Case(f"window left d{d}", sq=500, sk=520, d=d, wl=64))
        cases.append(Case(f"window right d{d}", sq=500, sk=520, d=d, wr=7))
        cases.append(Case(f"window both d{d}", sq=500, sk=400, d=d, wl=100, wr=50))
        cases.append(Case(f"causal+window d{d}", sq=700, sk=700, d=d, causal=True, wl=60))
        cases.append(Case(f"window empties rows d{d}", sq=300, sk=100, d=d, wl=0, wr=0))
        cases.append(Case(f"softcap d{d}", sq=333, sk=444, d=d, softcap=5.0, scale=0.3,
                          causal=True))
        cases.append(Case(f"negative scale d{d}", sq=160, sk=170, d=d, scale=-0.2))
        cases.append(Case(f"seqlen_k 0 d{d}", b=2, sq=70, sk=0, d=d))
        cases.append(Case(f"strided d{d}", b=2, sq=190, sk=210, d=d, pad=8, causal=True))
        cases.append(Case(f"big logits d{d}", sq=256, sk=256, d=d, magnitude=12.0))
        cases.append(Case(f"no lse d{d}", sq=100, sk=100, d=d, lse=False))
        cases.append(Case(f"varlen d{d}", varlen=[(0, 5), (17, 0), (130, 260), (1, 1), (257, 129),
                                                  (64, 64), (3, 900)], sq=0, sk=0, d=d, hq=4,
                          hkv=2))
        cases.append(Case(f"varlen causal d{d}", varlen=[(100, 0), (0, 0), (255, 300), (129, 64),
                                                         (64, 640)], sq=0, sk=0, d=d,
                          causal=True))
    return cases


def run_checks(h, variants, quick):
    failures = 0
    total = 0
    for variant in variants:
        vd = h.variant_head_dim(variant) if variant else 0
        for i, c in enumerate(correctness_cases(quick)):
            if variant:
                # Alternative tile configs are bf16-only and fixed to one bucket.
                if c.dtype != torch.bfloat16 or not (vd // 2 < c.d <= vd):
                    continue
            total += 1
            try:
                problems, err, err_same = check_case(h, variant, c, seed=1000 + i)
            except Exception as e:  # noqa: BLE001
                problems, err, err_same = [f"exception {e}"], 0, 0
            if problems:
                failures += 1
                print(f"FAIL v{variant} {c.name}: {'; '.join(problems)}", flush=True)
    print(f"checks: {total - failures}/{total} passed over variants {variants}", flush=True)
    return failures


def race_check(h, reps=30):
    gen = torch.Generator(device="cuda").manual_seed(7)
    c = Case("race", b=2, sq=1000, sk=1100, hq=8, hkv=2, d=128, causal=True)
    q, k, v, *_ = make_case_tensors(c, gen)
    first = None
    bad = 0
    for _ in range(reps):
        out = torch.empty_like(q)
        lse = torch.empty(c.b, c.hq, c.sq, device="cuda")
        h.forward(0, q, k, v, out, lse, batch=c.b, seqlen_q=c.sq, seqlen_k=c.sk, scale=c.scale,
                  wr=0)
        if first is None:
            first = (out.clone(), lse.clone())
        elif not (torch.equal(out, first[0]) and torch.equal(lse, first[1])):
            bad += 1
    print(f"race check: {reps - 1 - bad}/{reps - 1} repeats bit-identical", flush=True)
    return bad


# ---- benchmark ---------------------------------------------------------------------------------

def time_ms(fn, target_ms=40.0, reps=5):
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    once = max(e0.elapsed_time(e1), 1e-3)
    iters = max(1, min(200, int(target_ms / once)))
    times = []
    for _ in range(reps):
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / iters)
    return statistics.median(times)


def run_bench(h, variants, seqlens, dims, dtype=torch.bfloat16):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for d in dims:
        vs = [0] + [v for v in variants if v and h.variant_head_dim(v) == d]
        for causal in (False, True):
            for s in seqlens:
                b, hh = 16384 // s, 2048 // d
                q = torch.randn(b, s, hh, d, device="cuda", dtype=dtype)
                k = torch.randn(b, s, hh, d, device="cuda", dtype=dtype)
                v = torch.randn(b, s, hh, d, device="cuda", dtype=dtype)
                out = torch.empty_like(q)
                lse = torch.empty(b, hh, s, device="cuda")
                flops = 4 * b * hh * s * s * d / (2 if causal else 1)
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

                def fa2():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                t_fa2 = time_ms(fa2)
                res = {}
                for var in vs:
                    def ours(var=var):
                        h.forward(var, q, k, v, out, lse, batch=b, seqlen_q=s, seqlen_k=s,
                                  scale=1 / math.sqrt(d), wr=0 if causal else -1)
                    res[var] = time_ms(ours)
                fa2_tf = flops / t_fa2 / 1e9
                cells = " ".join(f"v{var}={flops / t / 1e9:6.1f}({t_fa2 / t:4.2f}x)"
                                 for var, t in res.items())
                line = f"d{d} {'causal' if causal else 'full  '} S={s:5d} FA2={fa2_tf:6.1f} {cells}"
                print(line, flush=True)
                rows.append((d, causal, s, t_fa2, res))
                del q, k, v, out, lse
    # Geometric mean of speedup over FA2 per variant per head dim.
    print("summary (geomean speedup vs FA2, min):")
    for d in dims:
        vs = [0] + [v for v in variants if v and h.variant_head_dim(v) == d]
        for var in vs:
            ratios = [r[3] / r[4][var] for r in rows if r[0] == d]
            gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"  d{d} v{var}: geomean {gm:.3f} min {min(ratios):.3f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--check-variants", default="0")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--profile", default="", help="variant,d,seqlen,causal: run that cell 3 times")
    a = ap.parse_args()
    h = Harness(a.lib)
    variants = [int(x) for x in a.variants.split(",") if x]
    fails = 0
    if a.check:
        fails += run_checks(h, [int(x) for x in a.check_variants.split(",") if x], a.quick)
        fails += race_check(h)
    if a.profile:
        var, d, s, causal = (int(x) for x in a.profile.split(","))
        b, hh = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, hh, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        for _ in range(3):
            if var < 0:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=bool(causal))
            else:
                h.forward(var, q, k, v, out, None, batch=b, seqlen_q=s, seqlen_k=s,
                          scale=1 / math.sqrt(d), wr=0 if causal else -1)
        torch.cuda.synchronize()
    if a.bench:
        run_bench(h, variants, [int(x) for x in a.seqlens.split(",")],
                  [int(x) for x in a.dims.split(",")])
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
