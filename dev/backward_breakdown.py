"""Per-kernel device time of one training step (forward + backward) for flashcore and the SDPA
peers, from torch.profiler: where a short-sequence step spends its time (memsets, preprocess,
main kernel, dQ conversion, layout copies). Also the step's elapsed time between CUDA events
(back-to-back steps, as bench/peers.py times them) and the host time to issue one step: when
the events show more than the kernels add up to, the GPU waited for the host.
usage: PYTHONPATH=<dir with the flashcore package> python3 dev/backward_breakdown.py [--impls=A,B,...]
       [HDIM:SEQLEN:CAUSAL ...] (impls: flashcore (AUTO), flashcore_sm80, sdpa_flash, sdpa_cudnn)
       (default: the S=512 cells of the training grid; batch = 16384 / seqlen, heads = 2048 / hdim)"""
import collections
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashcore

args = sys.argv[1:]
impls = ("flashcore", "sdpa_flash", "sdpa_cudnn")
if args and args[0].startswith("--impls="):
    impls = tuple(args.pop(0).split("=", 1)[1].split(","))
cells = args or ["64:512:0", "64:512:1", "128:512:0", "128:512:1", "256:512:0", "256:512:1"]
REPS = 5


def step_fn(impl, q, k, v, dout, causal):
    if impl in ("flashcore", "flashcore_sm80"):
        # Set once here: an impl's steps all run before the next impl's step_fn.
        flashcore.set_default_backend("cuda_sm80" if impl == "flashcore_sm80" else "auto")
        return lambda: flashcore.flash_attn_func(q, k, v, causal=causal).backward(dout)
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)

    def step():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dt)
    return step


for cell in cells:
    d, s, causal = (int(x) for x in cell.split(":"))
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    for impl in impls:
        step = step_fn(impl, q, k, v, dout, bool(causal))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS):
                step()
            torch.cuda.synchronize()
        per_kernel = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name[:70]] += e.device_time / REPS
        total = sum(per_kernel.values())
        n = 20
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        host0 = time.perf_counter()
        start.record()
        for _ in range(n):
            step()
        end.record()
        host_us = (time.perf_counter() - host0) / n * 1e6
        end.synchronize()
        event_us = start.elapsed_time(end) / n * 1e3
        print(f"== d{d} S{s} {'causal' if causal else 'full'} {impl}: {total:.1f} us of kernels per step, "
              f"{event_us:.1f} us between events, host {host_us:.1f} us to issue")
        for name, us in sorted(per_kernel.items(), key=lambda x: -x[1]):
            print(f"   {us:9.1f} us  {name}")
        for x in (q, k, v):
            x.grad = None
