"""The persistent sm90 forward's wave quantization: flashcore and SDPA cuDNN TFLOP/s (bf16, B = 1,
no mask) as the tile count crosses multiples of the SM count; d128 (192-row tiles from 4k keys on)
and d256 (128-row tiles). docs/PERF.md, session 26.

usage: PYTHONPATH=<a built flashcore package> python3 dev/forward_waves.py"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashcore
from timing import bench_ms
sms = torch.cuda.get_device_properties(0).multi_processor_count
for d, h, rows, seqs in ((128, 16, 192, range(14976, 17665, 192)), (256, 8, 128, range(15360, 17409, 256))):
    for s in seqs:
        q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flop = 4.0 * h * s * s * d
        tiles = (s + rows - 1) // rows * h
        ms = bench_ms(lambda: flashcore.flash_attn_func(q, k, v), rep=7)
        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        mc = bench_ms(cudnn, rep=7)
        print(f"d{d} S{s} tiles {tiles} waves {tiles / sms:.2f} flashcore {flop / ms / 1e9:.1f} cuDNN {flop / mc / 1e9:.1f}", flush=True)
        del q, k, v
