"""The flash_attn_func forward at the training grid's short cells (S = 512 and 2048; d64 / d128 /
d256; full and causal; bf16, 16k tokens, model dim 2048), TFLOP/s as the median of 5 timings of 20
back-to-back calls. For A/B checks of two builds in alternating processes (docs/PERF.md, session
29): the label names the build in the output line.

usage: PYTHONPATH=<a built flashcore package> python3 dev/forward_short_cells.py LABEL"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate

torch.manual_seed(0)
cells = []
for d in (64, 128, 256):
    for causal in (False, True):
        for S in (512, 2048):
            B, H = 16384 // S, 2048 // d
            q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * B * H * S * S * d / (2 if causal else 1)
            rate = events_rate(lambda: flashcore.flash_attn_func(q, k, v, causal=causal), flops)
            cells.append(f"d{d} {'causal' if causal else 'full'} S{S}: {rate:.1f}")
print(sys.argv[1], " | ".join(cells))
