"""The Hopper forward's pack-GQA kernels against the per-head ones and SDPA's backends: GQA calls
with few query tokens per head (chunked prefill, speculative decoding), bf16, TFLOP/s by the FLOPs
the rows compute (causal: bottom-right aligned, keys up to each token's position). Device time per
call under CUDA-graph replay: calls this short are otherwise timed at the Python call's own cost.

Run it twice in one device call, FLASHCORE_SM90_PACK_GQA=1 (default) and =0, to put the packed
and the per-head kernels beside the same peers:
    python3 dev/pack_gqa_bench.py [--causal]
"""
import argparse
import os

import torch
import torch.nn.functional as F

import flashcore
import warnings

from timing import graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")  # SDPA's notes on GQA inputs its fused kernels decline


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    packed = os.environ.get("FLASHCORE_SM90_PACK_GQA", "1") != "0"
    print(f"pack-GQA {'on' if packed else 'off'}, d {a.dim}, causal={a.causal}, bf16, TFLOP/s")
    print("batch x tokens x keys, heads q/kv | flashcore | SDPA cuDNN | SDPA flash | SDPA efficient")
    for batch, keys, hq, hkv in ((8, 4096, 32, 8), (4, 8192, 64, 8), (16, 2048, 16, 2)):
        for tokens in (1, 4, 16, 32, 64, 128):
            q = torch.randn(batch, tokens, hq, a.dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, keys, hkv, a.dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            visible = keys - (tokens - 1) / 2 if a.causal else keys
            flop = 4.0 * batch * hq * tokens * visible * a.dim
            row = [flop / (graph_replay_us(lambda: flashcore.flash_attn_func(q, k, v, causal=a.causal), 50) * 1e-6) / 1e12]
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            # SDPA's causal mask is top-left aligned: with fewer queries than keys it is a
            # different mask, so the peers run unmasked in causal mode (an upper bound of theirs).
            for backend in (torch.nn.attention.SDPBackend.CUDNN_ATTENTION, torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                            torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
                try:
                    with torch.nn.attention.sdpa_kernel(backend):
                        us = graph_replay_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), 50)
                    row.append(4.0 * batch * hq * tokens * keys * a.dim / (us * 1e-6) / 1e12)
                except RuntimeError:
                    row.append(float("nan"))
            print(f"{batch} x {tokens} x {keys}, {hq}/{hkv} | " + " | ".join(f"{x:.1f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
