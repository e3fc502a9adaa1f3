"""What ALiBi costs over paged K/V and on the KV-cache call's forward route (docs/PERF.md, session
46): chunked prefill through flash_attn_with_kvcache (bf16, GQA 32 / 8, d128, causal, the new
tokens appended) on a contiguous cache and on pages of 16 and 256 keys, and flash_attn_varlen_func
over the same pages; each with per-head alibi_slopes next to the same call without them, in the
same process. Until session 46 the GPU kernels declined ALiBi over pages, so these ALiBi calls ran
on the decode kernel (KV-cache) or raised NotImplementedError (varlen with a block_table). TFLOP/s
counts the causal FLOPs of the queries against cache + new keys.

usage: PYTHONPATH=<a built flashcore package> python3 dev/alibi_paged_cost.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)
HQ, HK, D = 32, 8, 128
slopes = torch.rand(HQ, device="cuda", dtype=torch.float32) * 0.1


def rate(fn, flops):
    try:
        return events_rate(fn, flops, calls=10)
    except NotImplementedError:  # a tree from before session 46: ALiBi over pages declined
        return float("nan")


def as_pages(cache, page):
    batch, rows = cache.shape[:2]
    pages = rows // page
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    return cache.reshape(batch * pages, page, HK, D), table


for batch, sq, cached in ((1, 2048, 2048), (4, 512, 3584), (8, 128, 8064)):
    sk = cached + sq
    q = torch.randn(batch, sq, HQ, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(batch, sk + 256, HK, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((batch,), cached, dtype=torch.int32, device="cuda")
    kn = torch.randn(batch, sq, HK, D, device="cuda", dtype=torch.bfloat16); vn = torch.randn_like(kn)
    flops = 4 * batch * HQ * D * sq * (sk - sq / 2)
    cells = []
    for page in (0, 16, 256):
        kp, vp, table = kc, vc, None
        if page:
            (kp, table), (vp, _) = as_pages(kc, page), as_pages(vc, page)
        def kv(alibi, kp=kp, vp=vp, table=table):
            return flashcore.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table,
                                                     causal=True, alibi_slopes=alibi)
        plain, with_alibi = rate(lambda: kv(None), flops), rate(lambda: kv(slopes), flops)
        cells.append(f"kvcache {'contiguous' if not page else f'pages {page}'} {with_alibi:.1f} / {plain:.1f}")
        if page:
            # The same keys (cached + new, already appended by the calls above) through the varlen call.
            qv = q.reshape(batch * sq, HQ, D)
            cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device="cuda")
            cu_k = torch.arange(0, (batch + 1) * sk, sk, dtype=torch.int32, device="cuda")
            def var(alibi, kp=kp, vp=vp, table=table):
                return flashcore.flash_attn_varlen_func(qv, kp, vp, cu_q, cu_k, sq, sk, causal=True,
                                                        alibi_slopes=alibi, block_table=table)
            plain, with_alibi = rate(lambda: var(None), flops), rate(lambda: var(slopes), flops)
            cells.append(f"varlen pages {page} {with_alibi:.1f} / {plain:.1f}")
    print(f"b{batch} sq{sq} cached{cached} (TFLOP/s with ALiBi / without): " + ", ".join(cells))
