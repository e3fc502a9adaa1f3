"""flash_attn_func with a few query tokens against a long K / V (decoding through flash_attn_func, as
model code without a KV-cache API does it): AUTO (which takes the decode kernel where
cuda/decode/prefill_route.hpp's decode_kernel_suits says so), the forward kernels (the backend
named), the decode kernel on the same tensors (flash_attn_with_kvcache with the whole K / V as the
cache) and SDPA's backends.
bf16, device time per call under CUDA-graph replay, K+V bytes / time in TB/s.

    PYTHONPATH=<package>:bench python3 dev/forward_few_rows.py [--causal]
"""
import argparse
import warnings

import torch

import flashcore

from timing import graph_replay_us, sdpa_graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")  # SDPA's notes on GQA inputs its fused kernels decline

SHAPES = (  # batch, keys, heads q, heads kv, head dim
    (8, 4096, 32, 8, 128),
    (1, 65536, 32, 8, 128),
    (16, 8192, 32, 8, 128),
    (8, 4096, 32, 32, 128),
    (32, 2048, 16, 16, 64),
    (4, 8192, 16, 16, 256),
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    a = ap.parse_args()
    print(f"causal={a.causal}, bf16, K+V TB/s (graph replay)")
    kernels = "cuda_sm90" if torch.cuda.get_device_capability() == (9, 0) else "cuda_sm80"
    print(f"batch x tokens x keys, heads q/kv, d | flash_attn_func AUTO | {kernels} | with_kvcache (decode kernel) | "
          "SDPA cuDNN | SDPA flash")
    for batch, keys, hq, hkv, d in SHAPES:
        k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        for tokens in (int(t) for t in a.tokens.split(",")):
            q = torch.randn(batch, tokens, hq, d, device="cuda", dtype=torch.bfloat16)
            rate = lambda us: kv_bytes / (us * 1e-6) / 1e12
            row = []
            for backend in ("auto", kernels):
                flashcore.set_default_backend(backend)
                row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_func(q, k, v, causal=a.causal), 50)))
            flashcore.set_default_backend("auto")
            row.append(rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q, k, v, causal=a.causal), 50)))
            # SDPA's causal mask is top-left aligned: the peers run unmasked (keys >> tokens).
            for backend in (torch.nn.attention.SDPBackend.CUDNN_ATTENTION, torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                row.append(rate(sdpa_graph_replay_us(backend, q, k, v)))
            print(f"{batch} x {tokens} x {keys}, {hq}/{hkv}, d{d} | " + " | ".join(f"{x:.2f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
