"""Does the order of timing inside a benchmark cell move the result? Each cell (training-grid
shape, bf16, fresh tensors) is timed flashcore, cuDNN, flashcore, cuDNN, ... with bench_ms
(bench/peers.py's method), three times each, then the host time to issue 20 calls of each.

Session 19 (H100): SDPA cuDNN read 5-12% faster the first time it was timed in an S = 512 cell
than the two times after (d128 full 524.9 / 472.8 / 463.0 TFLOP/s), flashcore did not (473.1 /
471.7 / 457.2); which is why bench/peers.py times every implementation of a cell in interleaved
rounds and keeps each one's best.

usage: python3 dev/order_probe.py [--cells d:S:causal,...]   (default: the S = 512 cells and d128 1k)
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from timing import bench_ms

ap = argparse.ArgumentParser()
ap.add_argument("--cells", default="128:512:0,64:512:1,64:512:0,256:512:0,128:1024:0")
args = ap.parse_args()
cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]

for d, s, causal in cells:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flop = 4.0 * b * h * s * s * d / (2 if causal else 1)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=bool(causal))

    def fc():
        return flashcore.flash_attn_func(q, k, v, causal=bool(causal))

    seq = []
    with torch.no_grad():
        for name, fn in [("fc", fc), ("cudnn", cudnn)] * 3:
            seq.append(f"{name} {flop / bench_ms(fn) / 1e9:6.1f}")
        for name, fn in [("fc", fc), ("cudnn", cudnn)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - t) / 20 * 1e6
            torch.cuda.synchronize()
            total = (time.perf_counter() - t) / 20 * 1e6
            seq.append(f"{name} host {host:.0f} us, with the device {total:.0f} us per call")
    print(f"d{d} S{s} {'causal' if causal else 'full'}: " + " | ".join(seq), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
