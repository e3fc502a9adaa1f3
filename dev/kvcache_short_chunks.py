"""flash_attn_with_kvcache with a few query tokens per sequence (speculative decoding, short
prefill chunks): GQA 32 / 8, d128, bf16, causal, the new tokens appended into a contiguous cache;
TFLOP/s over the causal FLOPs of the queries against cache + new keys (CUDA events over 20 calls,
median of 5). Which kernel serves a cell is the call's own choice (decode kernel or the forward
route, cuda/decode/prefill_route.cu), so two builds with different route rules, each run in its
own process in one device call, put the two paths side by side (docs/PERF.md, session 34: builds
with RouteTraits::kMinRows 256 and 8, then the rule kept).

usage: PYTHONPATH=<a built flashcore package>:bench python3 dev/kvcache_short_chunks.py LABEL"""
import sys

import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)
label = sys.argv[1] if len(sys.argv) > 1 else "flashcore"
for batch, cached in ((16, 4080), (4, 8176), (64, 2000)):
    for sq in (2, 4, 8, 16, 32, 48, 63):
        sk = cached + sq
        q = torch.randn(batch, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(batch, sk + 64, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((batch,), cached, dtype=torch.int32, device="cuda")
        kn = torch.randn(batch, sq, 8, 128, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        flops = 4 * batch * 32 * 128 * sq * (sk - sq / 2)
        t = events_rate(lambda: flashcore.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True),
                        flops, calls=20)
        print(f"{label} {batch} x {sq} tokens, cache {cached}: {t:.1f} TFLOP/s", flush=True)
