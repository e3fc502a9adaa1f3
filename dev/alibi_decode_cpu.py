#!/usr/bin/env python3
"""CPU decode with ALiBi: flashcore.flash_attn_with_kvcache(alibi_slopes=...) against PyTorch's CPU
SDPA given the same bias as a float attn_mask (built once, outside the timing: the peer's best
case), with the plain (no ALiBi) call of each beside it, in one process. One query token per
sequence, GQA 32 q / 8 kv heads, head_dim 128, fp32, K+V bytes / time (GB/s), median of
interleaved rounds. Both use every core torch and the library see (torch.set_num_threads(THREADS)
when THREADS is set; the library's num_threads follows FLASHCORE_NUM_THREADS or all cores).

Usage: python3 dev/alibi_decode_cpu.py [--cells 4x4096,1x16384] [--rounds 7]
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import flashcore

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def seconds(fn, calls):
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="4x4096,1x16384")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5)
    a = ap.parse_args()
    if os.environ.get("THREADS"):
        torch.set_num_threads(int(os.environ["THREADS"]))
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    slopes = torch.exp2(-8.0 * torch.arange(1, HEADS_Q + 1, dtype=torch.float32) / HEADS_Q)
    for cell in a.cells.split(","):
        batch, kv_len = (int(x) for x in cell.split("x"))
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM)
        k = torch.randn(batch, kv_len, HEADS_KV, HEAD_DIM)
        v = torch.randn_like(k)
        lens = torch.full((batch,), kv_len, dtype=torch.int32)
        # The bias of the one query (the last position) against key j: -slope * (kv_len - 1 - j).
        dist = (kv_len - 1 - torch.arange(kv_len, dtype=torch.float32))
        bias = (-slopes[:, None] * dist[None, :]).view(1, HEADS_Q, 1, kv_len).expand(batch, -1, -1, -1).contiguous()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (batch, heads, seq, dim)
        calls = {
            "flashcore plain": lambda: flashcore.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
            "flashcore alibi": lambda: flashcore.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                                         alibi_slopes=slopes),
            "torch plain": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            "torch alibi": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True),
        }
        ref = calls["torch alibi"]().transpose(1, 2)
        err = (calls["flashcore alibi"]() - ref).abs().max().item()
        times = {name: [] for name in calls}
        for _ in range(a.rounds):
            for name, fn in calls.items():
                times[name].append(seconds(fn, a.calls))
        nbytes = 2 * k.numel() * k.element_size()
        rate = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
        print(f"{batch} x {kv_len}: " + ", ".join(f"{n} {r:.1f} GB/s" for n, r in rate.items()) +
              f"; alibi flashcore / torch {rate['flashcore alibi'] / rate['torch alibi']:.2f}x, "
              f"flashcore alibi / plain {rate['flashcore alibi'] / rate['flashcore plain']:.2f}; "
              f"max |out - torch| {err:.2e}")


if __name__ == "__main__":
    main()
