"""Why does a cell read lower inside bench/peers.py's grid than alone? Times flashcore's forward on
one training-grid cell in several contexts, each with the SM clock of its window, so that a rate
that falls at an unchanged clock (fewer FLOPs per cycle) is told apart from one that follows the
clock.

Session 65 (H200): d256 full 8k read 636-657 TFLOP/s in the grid (1575-1680 MHz) and 698-726
alone (dev/order_probe.py, dev/power_probe.py: 709 at 1575 MHz), 4k 616 against 683; cuDNN read
the same in both. The grid differs from the probes in three ways, one context each here:
- alloc:      q, k, v and dout allocated as peers.py does (dout shifts the later allocations);
- after-eff:  flashcore timed right after SDPA's efficient-attention kernel (peers.py's last
              implementation of every cell, so the one before each cell's first timing);
- after-cell: the previous grid cell (S / 2) timed first with every implementation, freed with
              empty_cache, then this cell allocated and flashcore timed first, as in the grid.
`alone` (fresh q, k, v, nothing before) is the reference; every context is timed `--repeats`
times with bench_window (peers.py's method), alternating with cuDNN where it says so.

usage: PYTHONPATH=<package> python3 dev/grid_context_probe.py [--cells 256:4096:0,256:8192:0]
       [--repeats 3] [--dtype bf16]
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
from gpu_clocks import ClockSampler
from timing import bench_window

ap = argparse.ArgumentParser()
ap.add_argument("--cells", default="256:4096:0,256:8192:0")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
args = ap.parse_args()
DT = torch.bfloat16 if args.dtype == "bf16" else torch.float16
CLOCKS = ClockSampler()


def make(d, s, with_dout):
    b, h = 16384 // s, 2048 // d
    t = [torch.randn(b, s, h, d, device="cuda", dtype=DT) for _ in range(4 if with_dout else 3)]
    return t


def on_sm80(q, k, v, causal):
    """The portable kernels, as peers.py's flashcore_sm80 column times them."""
    flashcore.set_default_backend("cuda_sm80")
    try:
        return flashcore.flash_attn_func(q, k, v, causal=causal)
    finally:
        flashcore.set_default_backend("auto")


def impls(q, k, v, causal):
    """peers.py's implementations of a forward cell, in its order (flashcore first)."""
    def sdpa(be):
        def run():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal)
        return run
    return {
        "flashcore": lambda: flashcore.flash_attn_func(q, k, v, causal=causal),
        "flashcore_sm80": lambda: on_sm80(q, k, v, causal),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def timed(label, fn, flop):
    ms, start = bench_window(fn)
    w = CLOCKS.window(start, time.time()) if CLOCKS else None
    rate = flop / ms / 1e9
    if w:
        return f"{label} {rate:6.1f} @ {w['sm_mhz']:.0f} ({rate / w['sm_mhz']:.3f}/MHz)"
    return f"{label} {rate:6.1f}"


def line(name, parts):
    print(f"  {name:<10} " + " | ".join(parts), flush=True)


with torch.no_grad():
    for cell in args.cells.split(","):
        d, s, causal = (int(x) for x in cell.split(":"))
        causal = bool(causal)
        b, h = 16384 // s, 2048 // d
        flop = 4.0 * b * h * s * s * d / (2 if causal else 1)
        print(f"d{d} S{s} {'causal' if causal else 'full'} ({args.dtype}), TFLOP/s @ SM MHz:", flush=True)

        q, k, v = make(d, s, False)
        fns = impls(q, k, v, causal)
        line("alone", [timed(n, fns[n], flop) for _ in range(args.repeats) for n in ("flashcore", "sdpa_cudnn")])
        del q, k, v, fns
        torch.cuda.empty_cache()

        q, k, v, dout = make(d, s, True)
        fns = impls(q, k, v, causal)
        line("alloc", [timed(n, fns[n], flop) for _ in range(args.repeats) for n in ("flashcore", "sdpa_cudnn")])
        line("after-eff", [timed(n, fns[n], flop) for _ in range(args.repeats)
                           for n in ("sdpa_efficient", "flashcore")])
        del q, k, v, dout, fns
        torch.cuda.empty_cache()

        parts = []
        for _ in range(args.repeats):
            # The previous grid cell, every implementation once, as peers.py's grid runs it.
            pq, pk, pv, pd = make(d, s // 2, True)
            for fn in impls(pq, pk, pv, causal).values():
                bench_window(fn)
            del pq, pk, pv, pd
            torch.cuda.empty_cache()
            q, k, v, dout = make(d, s, True)
            parts.append(timed("flashcore", impls(q, k, v, causal)["flashcore"], flop))
            del q, k, v, dout
            torch.cuda.empty_cache()
        line("after-cell", parts)

if CLOCKS:
    CLOCKS.stop()
