"""flash_attn_with_kvcache with many query tokens (chunked prefill into the cache) against
flash_attn_func over the same keys in the same process (docs/PERF.md, session 27): bf16, GQA 32 /
8, d128, causal, the new tokens appended; TFLOP/s (causal FLOPs of the queries against cache +
new keys), with a contiguous cache and with the same cache as pages of 16 keys. The decode kernel
serves the last row's 16 x 16 shape, the forward kernels the others.

usage: PYTHONPATH=<a built flashcore package> python3 dev/kvcache_prefill_cost.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)


def rate(fn, flops):
    return events_rate(fn, flops, calls=10)


for batch, sq, cached in ((1, 2048, 2048), (4, 512, 3584), (8, 128, 8064), (16, 16, 4080)):
    sk = cached + sq
    q = torch.randn(batch, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(batch, sk + 64, 8, 128, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((batch,), cached, dtype=torch.int32, device="cuda")
    kn = torch.randn(batch, sq, 8, 128, device="cuda", dtype=torch.bfloat16); vn = torch.randn_like(kn)
    flops = 4*batch*32*128*sq*(sk - sq/2)
    a = rate(lambda: flashcore.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True), flops)
    k = kc[:, :sk].contiguous(); v = vc[:, :sk].contiguous()
    b = rate(lambda: flashcore.flash_attn_func(q, k, v, causal=True), flops)
    # The same cache as pages of 16 keys, in order (vLLM's default page size).
    pages = kc.shape[1] // 16
    kp, vp = (t.reshape(batch * pages, 16, 8, 128) for t in (kc, vc))
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    c = rate(lambda: flashcore.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table,
                                                       causal=True), flops)
    print(f"b{batch} sq{sq} cached{cached}: kvcache {a:.1f} TFLOP/s, paged 16 {c:.1f}, flash_attn_func on the same "
          f"keys {b:.1f} ({a/b:.2f}x, {c/b:.2f}x)")
