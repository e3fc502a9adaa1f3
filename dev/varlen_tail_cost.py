"""What zeroing the rows past each sequence (src/cuda/sm90/tail_rows.cuh) costs the Hopper kernels
on packed varlen calls: forward and forward+backward TFLOP/s of flash_attn_varlen_func over
~16k tokens in sequences of uneven lengths (none a multiple of a block, so every sequence's last
key and query blocks are partial), bf16, heads 2048 / d. Run it once per build in alternating
processes (the same seed gives the same lengths) to compare two builds.
usage: PYTHONPATH=<flashcore package> python3 dev/varlen_tail_cost.py [LABEL]"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import flashcore  # noqa: E402
from timing import bench_ms  # noqa: E402

label = sys.argv[1] if len(sys.argv) > 1 else ""
torch.manual_seed(0)
for mean in (512, 2048):
    lengths = []
    while sum(lengths) < 16384 - mean:
        lengths.append(int(torch.randint(mean // 2, 3 * mean // 2, ()).item()) | 1)  # odd: partial blocks
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    for d in (64, 128):
        h = 2048 // d
        rows = max(total, 16384)
        q, k, v, dout = (torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            flop = sum(4.0 * h * n * n * d for n in lengths) / (2 if causal else 1)

            def fwd():
                return flashcore.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)

            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def fwd_bwd():
                out = flashcore.flash_attn_varlen_func(qg, kg, vg, cu, cu, max(lengths), max(lengths), causal=causal)
                out.backward(dout)

            # The same tokens as a fixed-length batch of `mean`-key sequences, which never zero
            # anything: what the change costs calls without varlen (code generation).
            fq, fk, fv, fdo = (t[: 16384].view(16384 // mean, mean, h, d) for t in (q, k, v, dout))
            fixed_flop = 4.0 * h * 16384 * mean * d / (2 if causal else 1)
            fqg, fkg, fvg = (t.clone().requires_grad_() for t in (fq, fk, fv))

            def fixed_fwd():
                return flashcore.flash_attn_func(fq, fk, fv, causal=causal)

            def fixed_fwd_bwd():
                flashcore.flash_attn_func(fqg, fkg, fvg, causal=causal).backward(fdo)

            with torch.no_grad():
                t_f, t_ff = bench_ms(fwd), bench_ms(fixed_fwd)
            t_fb, t_ffb = bench_ms(fwd_bwd), bench_ms(fixed_fwd_bwd)
            print(f"{label} mean {mean} ({len(lengths)} seqs) d{d} {'causal' if causal else 'full'}: "
                  f"varlen fwd {flop / t_f * 1e-9:6.1f} fwd+bwd {3.5 * flop / t_fb * 1e-9:6.1f} | "
                  f"fixed fwd {fixed_flop / t_ff * 1e-9:6.1f} fwd+bwd {3.5 * fixed_flop / t_ffb * 1e-9:6.1f} TFLOP/s",
                  flush=True)
