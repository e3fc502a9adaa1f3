"""The decode kernel's rate by explicit split count on shapes beside the decode target cells
(fewer KV heads, MQA, head pairs at d64), with the heuristic's choice (num_splits=0) and SDPA
cuDNN in the same process. bf16, one query token, device time per call under CUDA-graph replay,
K+V bytes / time in TB/s.

    PYTHONPATH=<package>:bench python3 dev/decode_splits_probe.py [--splits 0,8,16,24,32,33,48,64]
"""
import argparse
import warnings

import torch

import flashcore

from timing import graph_replay_us, sdpa_graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")

SHAPES = (  # batch, keys, heads q, heads kv, head dim
    (1, 65536, 32, 8, 128),
    (1, 65536, 32, 4, 128),
    (1, 65536, 28, 4, 128),
    (1, 65536, 32, 2, 128),
    (1, 65536, 32, 1, 128),
    (1, 65536, 32, 8, 64),
    (2, 32768, 32, 4, 128),
    (4, 16384, 28, 4, 128),
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", default="0,8,16,24,32,33,48,64")
    a = ap.parse_args()
    splits = [int(s) for s in a.splits.split(",")]
    print("batch x keys, heads q / kv, d | " + " | ".join(f"splits {s}" if s else "heuristic" for s in splits)
          + " | SDPA cuDNN")
    for batch, keys, hq, hkv, d in SHAPES:
        k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * k.numel() * k.element_size()
        rate = lambda us: kv_bytes / (us * 1e-6) / 1e12
        row = [rate(graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q, k, v, num_splits=s), 50))
               for s in splits]
        row.append(rate(sdpa_graph_replay_us(torch.nn.attention.SDPBackend.CUDNN_ATTENTION, q, k, v)))
        print(f"{batch} x {keys}, {hq} / {hkv}, d{d} | " + " | ".join(f"{x:.2f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
