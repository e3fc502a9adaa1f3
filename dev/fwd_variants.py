"""A/B of forward (or, with --bwd, fwd+bwd) variants next to an SDPA peer (cuDNN, or FA2 with
--peer flash), in one process, interleaved rounds.

Rounds alternate the order of the variants (the peer always first). The library under test reads
FLASHCORE_DEV_FWD_VARIANT on every call (a temporary switch that an experiment adds to
src/cuda/sm90/forward.cuh, backward.cuh or src/cuda/sm80/forward.cuh and removes before its
commit); this script sets it before each timed call, so the switch must call getenv on every
call: one that caches the value (a function-local static) times the first variant under every
label (docs/PERF.md, session 56: five comparisons lost that way). --backend puts flashcore on
one backend (cuda_sm80 for the portable kernels; default auto). Every variant's output (with --bwd: dq, dk,
dv) is first compared with the peer's (max abs difference, a sanity check only: the GPU test grids are what decide
correctness).

usage: python3 dev/fwd_variants.py VARIANTS [--cells d:S:causal,...] [--rounds R] [--bwd] [--dtype fp16]
       [--backend auto|cuda_sm80|cuda_sm90] [--peer cudnn|flash] [--softcap C]
       e.g. python3 dev/fwd_variants.py 0,1,2,3 --cells 128:512:0,128:512:1 --rounds 3
--softcap C gives flashcore's calls a softcap (SDPA has none: the peer then runs without it, a
timing reference only, and the variants are compared with the first variant's result instead).
Cells default to hdim 64/128/256 x S 512/1024/2048 x causal or not, plus d128 S=16384 full.
Training-grid shapes: batch = 16384 / S, heads = 2048 / d, bf16 (or --dtype fp16).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from timing import bench_ms

ap = argparse.ArgumentParser()
ap.add_argument("variants", help="comma-separated variant numbers, 0 = the shipped kernel")
ap.add_argument("--cells", default="", help="d:S:causal,... (default: the short-sequence grid)")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--bwd", action="store_true", help="time forward + backward (FLOP = 3.5x the forward's)")
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
ap.add_argument("--backend", default="auto")
ap.add_argument("--peer", default="cudnn", choices=("cudnn", "flash"))
ap.add_argument("--softcap", type=float, default=0.0, help="flashcore's softcap (the peer runs without)")
args = ap.parse_args()
variants = [int(v) for v in args.variants.split(",")]
PEER = SDPBackend.CUDNN_ATTENTION if args.peer == "cudnn" else SDPBackend.FLASH_ATTENTION
flashcore.set_default_backend(args.backend)  # once: every call below is flashcore's on it
DTYPE = torch.bfloat16 if args.dtype == "bf16" else torch.float16
if args.cells:
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]
else:
    cells = [(d, s, c) for d in (64, 128, 256) for c in (0, 1) for s in (512, 1024, 2048)]
    cells.append((128, 16384, 0))


def set_variant(v):
    os.environ["FLASHCORE_DEV_FWD_VARIANT"] = str(v)


print("variants", variants, "rounds", args.rounds, torch.cuda.get_device_name())
header = f"{'d':>4} {'S':>6} {'mask':>6} {args.peer:>7} " + " ".join(f"{'v%d' % v:>13}" for v in variants)
rows = []
for d, s, causal in cells:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DTYPE) for _ in range(3))
    flop = 4.0 * b * h * s * s * d / (2 if causal else 1)

    def peer():
        with sdpa_kernel([PEER]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=bool(causal)).transpose(1, 2)

    def ours():
        return flashcore.flash_attn_func(q, k, v, causal=bool(causal), softcap=args.softcap)

    if args.bwd:
        flop *= 3.5
        dout = torch.randn_like(q)
        for x in (q, k, v):
            x.requires_grad_(True)

        def run(fn):
            def step():
                fn().backward(dout)
            return step

        def result(fn):
            for x in (q, k, v):
                x.grad = None
            fn().backward(dout)
            return [x.grad.float() for x in (q, k, v)]
    else:
        def run(fn):
            def step():
                with torch.no_grad():
                    return fn()
            return step

        def result(fn):
            with torch.no_grad():
                return [fn().float()]

    if args.softcap > 0:
        set_variant(variants[0])
        ref = result(ours)
    else:
        ref = result(peer)
    errs = {}
    for var in variants:
        set_variant(var)
        errs[var] = max((a - b).abs().max().item() for a, b in zip(result(ours), ref))
    best = {"peer": 1e9, **{var: 1e9 for var in variants}}
    for rnd in range(args.rounds):
        best["peer"] = min(best["peer"], bench_ms(run(peer), rep=7, warm_s=0.15))
        # Odd rounds time the variants in reverse order: on long cells the variant timed last read
        # 4-11% low, whichever it was (d64 causal 16k, docs/PERF.md session 21).
        for var in (variants if rnd % 2 == 0 else variants[::-1]):
            set_variant(var)
            best[var] = min(best[var], bench_ms(run(ours), rep=7, warm_s=0.15))
    set_variant(0)
    tf = {key: flop / ms / 1e9 for key, ms in best.items()}
    line = f"{d:>4} {s:>6} {'causal' if causal else 'full':>6} {tf['peer']:7.1f} " + " ".join(
        f"{tf[var]:6.1f} {tf[var] / tf['peer']:5.2f}x" for var in variants)
    print(line + f"   max|diff| vs {'v%d' % variants[0] if args.softcap > 0 else args.peer} " + " ".join(f"v{var} {errs[var]:.1e}" for var in variants), flush=True)
    rows.append(line)
    del q, k, v, ref
    torch.cuda.empty_cache()
print(f"\n==== {'fwd+bwd' if args.bwd else 'fwd'} {args.dtype} TFLOP/s on {args.backend}"
      + (f", softcap {args.softcap} (the peer without)" if args.softcap > 0 else "") + ", best of", args.rounds,
      f"rounds; ratio vs SDPA {args.peer} ====")
print(header)
for r in rows:
    print(r)
