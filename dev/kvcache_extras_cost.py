"""What flash_attn_with_kvcache's cache_leftpad and rotary_cos / rotary_sin cost at decode shapes
(docs/PERF.md, sessions 26-27): K+V TB/s of a plain call, with cache_leftpad (zeros), appending one
token, and appending one token with rotary tables; torch CUDA tensors, GQA 32 / 8, d128 bf16. The
plain call in the same process is the peer (no SDPA backend has these features).

usage: PYTHONPATH=<a built flashcore package> python3 dev/kvcache_extras_cost.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)
for batch, kv in ((16, 8192), (1, 65536)):
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), kv, dtype=torch.int32, device="cuda")
    pad = torch.zeros(batch, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * 2
    def t(fn):
        return events_rate(fn, nbytes, calls=30)
    a = t(lambda: flashcore.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))
    b = t(lambda: flashcore.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=pad))
    cos = torch.randn(kv + 8, 64, device="cuda", dtype=torch.bfloat16); sin = torch.randn_like(cos)
    kn = torch.randn(batch, 1, 8, 128, device="cuda", dtype=torch.bfloat16); vn = torch.randn_like(kn)
    lens1 = lens - 1
    c = t(lambda: flashcore.flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=lens1))
    d = t(lambda: flashcore.flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=lens1, rotary_cos=cos, rotary_sin=sin))
    print(f"{batch}x{kv}: contiguous {a:.2f} TB/s, cache_leftpad {b:.2f}; with append {c:.2f}, append + rotary {d:.2f}")
