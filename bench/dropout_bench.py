"""Attention dropout on a GPU: flashcore against PyTorch SDPA's flash (FlashAttention-2) and
memory-efficient backends, all with dropout_p, in one process, forward and forward + backward.

SDPA's cuDNN backend takes no dropout, so FlashAttention-2 is the peer. flashcore's dropout calls
are timed on AUTO's choice (on Hopper: the Hopper kernels where they take dropout) and on the
portable (sm80) kernels forced; the same calls without dropout are timed beside them, so the table
shows both the price of the mask and what the Hopper kernels gain over the portable ones.

usage: PYTHONPATH=<package> python3 bench/dropout_bench.py [--p 0.1] [--dtype bf16]
       [--cells 64:2048:0,128:4096:1,...]   (head_dim:seqlen:causal; 16k tokens, model dim 2048)
       [--impls "fc drop,fc80 drop,FA2 drop"] (a subset of the columns; fc drop and FA2 drop give the ratio)
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import training_rates  # noqa: E402

import flashcore  # noqa: E402

DEFAULT_CELLS = "64:1024:0,64:4096:1,128:1024:0,128:4096:0,128:4096:1,128:16384:1,256:2048:0,256:8192:1"


def flop_count(batch, seqlen, heads, head_dim, causal):
    return 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def sdpa(backend, q, k, v, causal, p):
    with torch.nn.attention.sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              dropout_p=p, is_causal=causal).transpose(1, 2)


def flashcore_call(backend, q, k, v, causal, p):
    flashcore.set_default_backend(backend)
    try:
        return flashcore.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    finally:
        flashcore.set_default_backend("auto")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--cells", default=DEFAULT_CELLS)
    ap.add_argument("--impls", default="", help="comma-separated column names to time (default: all)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    B = torch.nn.attention.SDPBackend
    impls = [
        ("fc drop", lambda *x: flashcore_call("auto", *x, args.p)),
        ("fc80 drop", lambda *x: flashcore_call("cuda_sm80", *x, args.p)),
        ("fc none", lambda *x: flashcore_call("auto", *x, 0.0)),
        ("fc80 none", lambda *x: flashcore_call("cuda_sm80", *x, 0.0)),
        ("FA2 drop", lambda *x: sdpa(B.FLASH_ATTENTION, *x, args.p)),
        ("FA2 none", lambda *x: sdpa(B.FLASH_ATTENTION, *x, 0.0)),
        ("effic drop", lambda *x: sdpa(B.EFFICIENT_ATTENTION, *x, args.p)),
    ]
    if args.impls:
        wanted = [x.strip() for x in args.impls.split(",")]
        unknown = set(wanted) - {name for name, _ in impls}
        if unknown:
            ap.error(f"--impls: unknown column(s) {sorted(unknown)}")
        impls = [(name, fn) for name, fn in impls if name in wanted]
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, dropout_p {args.p}; TFLOP/s (fwd+bwd counts 3.5x the "
          f"forward's FLOPs), CUDA events around calls back to back")
    print("cell                 " + "".join(f"{name:>22}" for name, _ in impls) + "   drop fc/FA2 (fwd, fwd+bwd)")
    for cell in args.cells.split(","):
        head_dim, seqlen, causal = (int(x) for x in cell.split(":"))
        heads, batch = 2048 // head_dim, max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        flop = flop_count(batch, seqlen, heads, head_dim, bool(causal))
        rates = {}
        for name, fn in impls:
            try:
                rates[name] = training_rates(lambda: fn(q, k, v, bool(causal)), flop)
            except Exception as e:  # a peer without this shape: reported, not fatal
                rates[name] = None
                print(f"#   {name} at {cell}: {type(e).__name__}: {str(e)[:120]}")
        cells = "".join(f"{'-':>22}" if r is None else f"{r[0]:>10.1f} / {r[1]:>9.1f}" for r in rates.values())
        ratio = ""
        if rates.get("fc drop") and rates.get("FA2 drop"):
            ratio = f"   {rates['fc drop'][0] / rates['FA2 drop'][0]:.2f}x, {rates['fc drop'][1] / rates['FA2 drop'][1]:.2f}x"
        print(f"d{head_dim:<3} S{seqlen:<6} {'causal' if causal else 'full  '}  {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
