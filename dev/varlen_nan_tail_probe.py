"""Probe of packed varlen calls whose buffers hold NaN past the last sequence (a preallocated,
uninitialised q / k / v / dout): the Hopper kernels' TMA boxes read those rows, where P = 0 but
0 x NaN = NaN, so they must zero them first (src/cuda/sm90/tail_rows.cuh); cuda_sm80's predicated
loads read zeros. Prints, per backend, whether out / dq / dk / dv of the sequences' own rows changed
when the rows past them went from random values to NaN (they must not: "False, 0.0").

usage: PYTHONPATH=<a built flashcore package> python3 dev/varlen_nan_tail_probe.py
H100, session 27 (before the fix): cuda_sm90 forward True, cuda_sm80 False."""
import torch

import flashcore

torch.manual_seed(0)
lengths = [100, 37, 129]
used = sum(lengths)
tail = 64
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
for backend in ("cuda_sm90", "cuda_sm80"):
    flashcore.set_default_backend(backend)
    for d in (64, 128, 256):
        base = [torch.randn(used + tail, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

        def run(poison):
            q, k, v, dout = (t.clone() for t in base)
            if poison:
                for t in (q, k, v, dout):
                    t[used:] = float("nan")
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=False)
            out.backward(dout)
            return [t[:used].float() for t in (out, q.grad, k.grad, v.grad)]

        clean, dirty = run(False), run(True)
        for name, a, b in zip(("out", "dq", "dk", "dv"), clean, dirty):
            change = (b - a).abs().nan_to_num(float("inf")).max().item()
            print(f"{backend} d{d} {name}: NaN with NaN rows past the last sequence: {bool(b.isnan().any())}, "
                  f"largest change {change}")
flashcore.set_default_backend("auto")
