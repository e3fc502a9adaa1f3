#!/usr/bin/env python3
"""CPU KV-cache calls with several query tokens: flashcore.flash_attn_with_kvcache against
flashcore.flash_attn_func over the same keys (the cache, with the new tokens written into it), in
one process, torch CPU tensors, fp32, causal. Two tables:
  crossover: the query rows per KV head (GQA group x seqlen_q) at which the KV-cache call's own
             pass and the forward cross (time of each, no append);
  prefill:   chunked prefill (the new tokens appended and attended), GFLOP/s of both and the ratio.
Best of 3 timings of `calls` calls each. The threads are torch's (THREADS) and the library's
(all cores unless FLASHCORE_NUM_THREADS is set).

Usage: python3 dev/kvcache_prefill_cpu.py [--calls 3]   (sessions 32-33: the CPU forward route)
"""
import argparse
import os
import time

import torch

import flashcore


def best_seconds(fn, calls):
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    if os.environ.get("THREADS"):
        torch.set_num_threads(int(os.environ["THREADS"]))
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("crossover (forward time / KV-cache call time):")
    for batch, cache, heads, heads_kv, d in [(4, 4096, 32, 8, 128), (2, 2048, 16, 16, 64), (2, 2048, 16, 16, 128)]:
        k = torch.randn(batch, cache, heads_kv, d)
        v = torch.randn_like(k)
        lens = torch.full((batch,), cache, dtype=torch.int32)
        for sq in [1, 2, 3, 4, 8, 12, 16, 32, 64]:
            q = torch.randn(batch, sq, heads, d)
            kv = best_seconds(lambda: flashcore.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True),
                              a.calls)
            fwd = best_seconds(lambda: flashcore.flash_attn_func(q, k, v, causal=True), a.calls)
            print(f"  B{batch} cache {cache} GQA {heads}/{heads_kv} d{d} seqlen_q {sq} "
                  f"({heads // heads_kv * sq} rows per KV head): KV-cache {kv * 1e3:.2f} ms, "
                  f"forward {fwd * 1e3:.2f} ms, {fwd / kv:.2f}")
    print("prefill (GFLOP/s):")
    for batch, sq, cache, heads, heads_kv, d in [(2, 512, 2048, 16, 4, 128), (1, 256, 4096, 32, 8, 128),
                                                 (4, 64, 1024, 16, 16, 64)]:
        q = torch.randn(batch, sq, heads, d)
        k_cache = torch.randn(batch, cache + sq, heads_kv, d)
        v_cache = torch.randn_like(k_cache)
        k_new, v_new = torch.randn(batch, sq, heads_kv, d), torch.randn(batch, sq, heads_kv, d)
        lens = torch.full((batch,), cache, dtype=torch.int32)
        k_full, v_full = k_cache.clone(), v_cache.clone()
        k_full[:, cache:] = k_new
        v_full[:, cache:] = v_new
        kv = best_seconds(lambda: flashcore.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                    cache_seqlens=lens, causal=True), a.calls)
        fwd = best_seconds(lambda: flashcore.flash_attn_func(q, k_full, v_full, causal=True), a.calls)
        flop = 4 * batch * heads * sq * (cache + sq / 2) * d
        print(f"  B{batch}, {sq} new tokens, cache {cache}, GQA {heads}/{heads_kv}, d{d}: KV-cache call "
              f"{flop / kv / 1e9:.1f}, flash_attn_func {flop / fwd / 1e9:.1f}, ratio {fwd / kv:.2f}")


if __name__ == "__main__":
    main()
