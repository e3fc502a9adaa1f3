"""Where the seed shape's time goes (B=1 H=8 S=512 D=64 fp16, forward, CUDA-graph replay).

Times per call, each captured 200 times back to back in one CUDA graph as bench/peers.py does:
  - a launch floor: a one-element add (the cost of any kernel in such a graph, work aside);
  - flashcore on AUTO and forced onto each CUDA backend;
  - SDPA cuDNN and FA2 beside them.
With --once it makes one call of each flashcore backend and exits, for
  ncu --metrics gpu__time_duration.sum -k regex:forward python3 dev/seed_anatomy.py --once
whose kernel durations, set against the replay times, split a call into kernel and launch gap.
usage: PYTHONPATH=<flashcore package> python3 dev/seed_anatomy.py [--once]
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import flashcore  # noqa: E402
from timing import graph_replay_us  # noqa: E402

B, H, S, D = 1, 8, 512, 64
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))


def on(backend):
    def fn():
        flashcore.set_default_backend(backend)
        try:
            return flashcore.flash_attn_func(q, k, v)
        finally:
            flashcore.set_default_backend("auto")
    return fn


def sdpa(be):
    def fn():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(qt, kt, vt)
    return fn


backends = [b for b in ("cuda_sm80", "cuda_sm90") if flashcore.backend_available(b)]
if "--once" in sys.argv:
    for b in backends:
        on(b)()
    torch.cuda.synchronize()
    sys.exit(0)

tiny = torch.zeros(1, device="cuda")
impls = {"launch floor (1-element add)": lambda: tiny.add_(1), "flashcore auto": on("auto")}
impls.update({f"flashcore {b}": on(b) for b in backends})
impls.update({"sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION)})
for name, fn in impls.items():
    print(f"{name:32s} {graph_replay_us(fn):6.2f} us per call", flush=True)
