"""Where flash_attn_with_kvcache's forward route loses time against flash_attn_func on the same
kernels (docs/PERF.md session 38: MHA d64, 32 tokens x 32768 keys, 1.99 against 2.63 TB/s).
For each cell: device time per call under CUDA-graph replay of flash_attn_func and of
flash_attn_with_kvcache without and with cache_seqlens (full caches either way: a dense forward,
and the varlen view over the route's arrays), then every kernel one eager call of each launches
(bench/decode_bench.py's kernel_breakdown: torch.profiler over 20 calls, each kernel's device us
per call and the span per call; programmatic dependents start early and wait, so their durations
overlap), so extra kernels and changes in the attention
kernel's own time show apart.

    PYTHONPATH=<package>:bench python3 dev/route_gap_probe.py [--cells d64,d128,d256]
"""
import argparse
import torch

import flashcore

from decode_bench import kernel_breakdown  # bench/ (PYTHONPATH=bench)
from timing import graph_replay_us

CELLS = {  # name: batch, query tokens, keys, heads q, heads kv, head dim
    "d64": (1, 32, 32768, 16, 16, 64),
    "d64x128": (1, 128, 32768, 16, 16, 64),
    "d128": (1, 32, 65536, 32, 8, 128),
    "d256": (1, 32, 32768, 16, 16, 256),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--causal", type=int, default=1)
    a = ap.parse_args()
    for name in a.cells.split(","):
        batch, tokens, keys, hq, hkv, d = CELLS[name]
        q = torch.randn(batch, tokens, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        calls = {
            "flash_attn_func": lambda: flashcore.flash_attn_func(q, k, v, causal=bool(a.causal)),
            "with_kvcache": lambda: flashcore.flash_attn_with_kvcache(q, k, v, causal=bool(a.causal)),
            "with_kvcache, cache_seqlens": lambda: flashcore.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=lengths, causal=bool(a.causal)),
        }
        outs = [fn().float() for fn in calls.values()]
        diffs = ", ".join(f"{(o - outs[0]).abs().max().item():.3g}" for o in outs[1:])
        print(f"\n== {name}: {batch} x {tokens} x {keys}, heads {hq}/{hkv}, d{d}, causal={a.causal}; "
              f"max |func - kvcache| {diffs}")
        for label, fn in calls.items():
            us = graph_replay_us(fn, 50)
            print(f"{label}: {us:.1f} us per call under graph replay, {kv_bytes / (us * 1e-6) / 1e12:.2f} TB/s")
            print(f"    eager, per call: {kernel_breakdown(fn)}")


if __name__ == "__main__":
    main()
