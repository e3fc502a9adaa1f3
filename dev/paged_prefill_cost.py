"""What flash_attn_varlen_func's block_table (paged K/V, forward only) costs at a prefill shape
(docs/PERF.md, sessions 27-29): TFLOP/s of the paged call (pages of 8 / 16 / 32 / 64 / 256 / 512
keys in shuffled order) on the default backend (cuda_sm90 on Hopper: pages of 8 gathered into
packed rows first, the others read in place) and on cuda_sm80 (pages of 256k keys read in place),
next to the packed varlen call on each in the same process.
bf16, GQA 32 / 8, d128, causal, 4 sequences of 2048 tokens.

usage: PYTHONPATH=<a built flashcore package> python3 dev/paged_prefill_cost.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)
batch, seqlen, hq, hkv, d = 4, 2048, 32, 8, 128
cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
q = torch.randn(batch * seqlen, hq, d, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(batch * seqlen, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
flops = 4 * batch * hq * d * seqlen * seqlen / 2  # causal


def paged(page):
    per_seq = seqlen // page
    table = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).to(torch.int32)
    kp = torch.empty(batch * per_seq, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[table.flatten().long()] = k.view(batch * per_seq, page, hkv, d)
    vp[table.flatten().long()] = v.view(batch * per_seq, page, hkv, d)
    return kp, vp, table


def rate(fn):
    return events_rate(fn, flops)


call = lambda kk, vv, **kw: flashcore.flash_attn_varlen_func(q, kk, vv, cu, cu, seqlen, seqlen, causal=True, **kw)
with torch.no_grad():
    pages = {page: paged(page) for page in (8, 16, 32, 64, 256, 512)}
    ref = call(k, v)
    for page, (kp, vp, table) in pages.items():
        torch.testing.assert_close(call(kp, vp, block_table=table), ref, rtol=0, atol=2e-2)
    results = {"packed, default backend": rate(lambda: call(k, v))}
    for page, (kp, vp, table) in pages.items():
        results[f"paged {page}, default backend"] = rate(lambda: call(kp, vp, block_table=table))
    flashcore.set_default_backend("cuda_sm80")
    results["packed, cuda_sm80"] = rate(lambda: call(k, v))
    for page, (kp, vp, table) in pages.items():
        if page % 256 == 0:
            results[f"paged {page}, cuda_sm80"] = rate(lambda: call(kp, vp, block_table=table))
    flashcore.set_default_backend("auto")
for name, value in results.items():
    print(f"{name}: {value:.1f} TFLOP/s")
