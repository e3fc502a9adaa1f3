"""Power, SM clock and rate of long forward (or training-step) calls, flashcore next to an SDPA
peer (GPU machine).

Why: under Nsight Compute's locked base clocks the d256 causal 16k forward took 1.62 ms against
cuDNN's 2.09 (1.29x), while the benchmark (free-running clocks) read 632 TFLOP/s against 597
(1.06x): at long lengths the clock, not the cycle count, may set the ratio. This keeps each
implementation busy for a few seconds, alternating, while nvidia-smi samples power, SM clock,
temperature and the active clock-event reasons (bench/gpu_clocks.py), and prints per phase:
TFLOP/s, median clock, power and temperature, and the share of samples with the power cap active.

usage: PYTHONPATH=<package> python3 dev/power_probe.py [--cells mm,256:16384:1,... (mm: the matmul)] [--seconds 3]
       [--rounds 2] [--backend auto|cuda_sm80] [--peer cudnn|flash] [--bwd (training steps: forward + backward)]
       [--variants 0,1 (flashcore once per value of the temporary switch FLASHCORE_DEV_FWD_VARIANT, which
        an experiment reads on every call (dev/fwd_variants.py); the variants alternate within each round)]
"""
import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from gpu_clocks import ClockSampler  # noqa: E402
from timing import ms_per_call  # noqa: E402


def run_phase(fn, seconds):
    """Calls back to back for `seconds`; returns (start, end, ms per call over the last 80%)."""
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    one_start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - one_start
    n = max(5, int(seconds / max(one, 1e-5)))
    warm = n // 5
    for _ in range(warm):
        fn()
    ms = ms_per_call(fn, n - warm)
    return t0, time.time(), ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="mm,256:16384:1,256:16384:0,128:16384:0,64:16384:1,mm")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="flashcore's backend (cuda_sm80: the portable kernels)")
    ap.add_argument("--peer", default="cudnn", choices=("cudnn", "flash"), help="the SDPA backend beside it")
    ap.add_argument("--bwd", action="store_true", help="time training steps (forward + backward) instead")
    ap.add_argument("--variants", default="", help="values of FLASHCORE_DEV_FWD_VARIANT to time flashcore with")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    flashcore.set_default_backend(args.backend)
    peer_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[args.peer]
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,power.max_limit,clocks.max.sm,"
                          "clocks.applications.graphics", "--format=csv"], capture_output=True, text=True).stdout)
    sampler = ClockSampler()
    phases = []
    try:
        for cell in args.cells.split(","):
            if cell == "mm":  # the bf16 8192^3 matmul, the benchmark's ceiling
                a, bm = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                for r in range(args.rounds):
                    t0, t1, ms = run_phase(lambda: a @ bm, args.seconds)
                    phases.append(("matmul 8192", "torch", r, t0, t1, 2 * 8192**3 / ms / 1e9))
                    time.sleep(0.3)
                del a, bm
                continue
            d, s, c = (int(x) for x in cell.split(":"))
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
                       for _ in range(3))
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(args.bwd) for x in (q, k, v))
            dout = torch.randn_like(q)
            flop = 4 * b * h * s * s * d * (0.5 if c else 1.0) * (3.5 if args.bwd else 1.0)
            # (forward, the gradient of its output in its layout) per implementation
            calls = {
                "flashcore": (lambda: flashcore.flash_attn_func(q, k, v, causal=bool(c)), dout),
                f"sdpa_{args.peer}": (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(c)),
                                      dout.transpose(1, 2)),
            }
            # --bwd: a training step; the gradients accumulate across calls, as in bench/peers.py's steps
            impls = {name: (lambda f=f, g=g: f().backward(g)) if args.bwd else f for name, (f, g) in calls.items()}
            # (label, call, switch value or None): flashcore once per variant, then the rest
            variant_runs = [(f"flashcore v{x}", impls["flashcore"], x) for x in variants]
            other_runs = [(n, fn, None) for n, fn in impls.items() if not variants or n != "flashcore"]
            with torch.set_grad_enabled(args.bwd), sdpa_kernel([peer_backend]):
                for r in range(args.rounds):
                    # odd rounds run the variants in reverse order: each follows the others as often
                    runs = (variant_runs if r % 2 == 0 else variant_runs[::-1]) + other_runs
                    for name, fn, variant in runs:
                        if variant is not None:
                            os.environ["FLASHCORE_DEV_FWD_VARIANT"] = variant
                        t0, t1, ms = run_phase(fn, args.seconds)
                        phases.append((f"d{d} S{s} {'causal' if c else 'full'}", name, r, t0, t1, flop / ms / 1e9))
                        time.sleep(0.3)
            del q, k, v, qt, kt, vt, dout
            torch.cuda.empty_cache()
    finally:
        time.sleep(0.2)
        sampler.stop()
    os.environ.pop("FLASHCORE_DEV_FWD_VARIANT", None)
    print(f"{len(sampler.samples)} nvidia-smi samples")
    print(f"{'cell':<18} {'impl':<13} {'round':>5} {'TFLOP/s':>8} {'MHz':>6} {'W':>6} {'degC':>5}  power-capped share")
    for cell, name, r, t0, t1, tf in phases:
        w = sampler.window(t0 + 0.3 * (t1 - t0), t1)  # the timed part
        if w is None:
            print(f"{cell:<18} {name:<13} {r:>5} {tf:>8.1f}  (no samples)")
            continue
        print(f"{cell:<18} {name:<13} {r:>5} {tf:>8.1f} {w['sm_mhz']:>6.0f} {w['watts']:>6.0f} "
              f"{w['temperature']:>5.0f}  {w['power_capped']:.2f}")


if __name__ == "__main__":
    main()
