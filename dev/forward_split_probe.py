"""The Hopper forward's split-KV (sm90/split_kv.hpp) on the calls it is for: a few query tokens of
one or a few sequences against a long K / V (speculative decoding, chunked prefill, with more
rows per KV head than AUTO's decode route takes), bf16, causal (bottom-right) unless --full.
Columns: flash_attn_func (AUTO: the Hopper forward here), flash_attn_with_kvcache on the same
tensors (the decode kernel, or the forward through the KV-cache route), SDPA cuDNN and flash
(top-left causal masks, so they run unmasked: an upper bound of theirs). Device time per call under
CUDA-graph replay; K+V bytes / time in TB/s and TFLOP/s of the visible keys.

--softcap X gives flashcore's calls a softcap (the score-transform split kernels); --quick takes
one or two rows per head dim; --no-peers skips SDPA.

Run it twice in one device call to put the split and the whole kernels beside the same peers
(FLASHCORE_SM90_SPLITS is read once per process; 1 turns the split off):
    PYTHONPATH=<package>:bench FLASHCORE_SM90_SPLITS=1 python3 dev/forward_split_probe.py
    PYTHONPATH=<package>:bench python3 dev/forward_split_probe.py
"""
import argparse
import os
import warnings

import torch

import flashcore

from timing import graph_replay_us, sdpa_graph_replay_us  # bench/timing.py (PYTHONPATH=bench)

warnings.filterwarnings("ignore")  # SDPA's notes on GQA inputs its fused kernels decline

SHAPES = (  # batch, keys, heads q, heads kv, head dim, query tokens
    (1, 65536, 32, 8, 128, (8, 16, 32, 64, 128, 256)),
    (4, 16384, 32, 8, 128, (8, 32, 128)),
    (1, 32768, 16, 16, 64, (32, 128)),
    (1, 32768, 16, 16, 256, (32, 128)),
)


QUICK_SHAPES = (  # one row per bucket
    (1, 65536, 32, 8, 128, (16, 64)),
    (1, 32768, 16, 16, 64, (32,)),
    (1, 32768, 16, 16, 256, (32,)),
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="no mask")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="flashcore's calls with this softcap (the SDPA columns have none)")
    ap.add_argument("--quick", action="store_true", help="one or two rows per head dim")
    ap.add_argument("--no-peers", action="store_true", help="skip the SDPA columns")
    a = ap.parse_args()
    causal = not a.full
    forced = os.environ.get("FLASHCORE_SM90_SPLITS", "")
    print(f"split-KV {'off' if forced == '1' else 'forced ' + forced if forced else 'by the rule'}, "
          f"causal={causal}, softcap={a.softcap}, bf16; K+V TB/s / TFLOP/s (graph replay)")
    print("batch x tokens x keys, heads q/kv, d | flash_attn_func | with_kvcache | SDPA cuDNN | SDPA flash")
    for batch, keys, hq, hkv, d, token_counts in (QUICK_SHAPES if a.quick else SHAPES):
        k = torch.randn(batch, keys, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        for tokens in token_counts:
            q = torch.randn(batch, tokens, hq, d, device="cuda", dtype=torch.bfloat16)
            visible = keys - (tokens - 1) / 2 if causal else keys
            flop = 4.0 * batch * hq * tokens * visible * d
            cells = []
            sc = a.softcap
            for us in (graph_replay_us(lambda: flashcore.flash_attn_func(q, k, v, causal=causal, softcap=sc), 50),
                       graph_replay_us(lambda: flashcore.flash_attn_with_kvcache(q, k, v, causal=causal, softcap=sc),
                                       50)):
                cells.append(f"{kv_bytes / (us * 1e-6) / 1e12:.2f} / {flop / (us * 1e-6) / 1e12:.0f}")
            for backend in () if a.no_peers else (torch.nn.attention.SDPBackend.CUDNN_ATTENTION, torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                try:
                    us = sdpa_graph_replay_us(backend, q, k, v)
                    cells.append(f"{kv_bytes / (us * 1e-6) / 1e12:.2f} / {4.0 * batch * hq * tokens * keys * d / (us * 1e-6) / 1e12:.0f}")
                except RuntimeError:
                    cells.append("-")
            print(f"{batch} x {tokens} x {keys}, {hq}/{hkv}, d{d} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
