"""Forward TFLOP/s of flashcore forced onto one backend, next to SDPA FA2, on chosen training-grid
cells (bf16, batch 16384/S, heads 2048/d): run it once per build in alternating processes to
compare two builds of a backend (e.g. before / after a change to its kernels) through their
ratios to the FA2 measured beside each.
usage: PYTHONPATH=<flashcore package> python3 dev/backend_ab.py BACKEND d:S:causal[,d:S:causal...] [LABEL]
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import flashcore  # noqa: E402
from timing import bench_ms  # noqa: E402

backend, cells = sys.argv[1], sys.argv[2]
label = sys.argv[3] if len(sys.argv) > 3 else ""
for cell in cells.split(","):
    d, s, causal = (int(x) for x in cell.split(":"))
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flop = 4.0 * b * h * s * s * d / (2 if causal else 1)

    def ours():
        flashcore.set_default_backend(backend)
        try:
            return flashcore.flash_attn_func(q, k, v, causal=bool(causal))
        finally:
            flashcore.set_default_backend("auto")

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))

    with torch.no_grad():
        t_ours, t_fa2 = bench_ms(ours), bench_ms(fa2)
    print(f"{label} d{d} S{s} {'causal' if causal else 'full'}: {backend} {flop / t_ours * 1e-9:6.1f} "
          f"FA2 {flop / t_fa2 * 1e-9:6.1f} TFLOP/s, ratio {t_fa2 / t_ours:.3f}", flush=True)
