"""Reproducer of a known bug (docs/DESIGN.md, "Known issues"; session 27): the Hopper forward of a
packed varlen call reads k / v rows past the last sequence (its last key block's TMA box), where
P = 0 but 0 x NaN = NaN, so NaN values in those rows (a preallocated, uninitialised buffer) reach
the output. cuda_sm80's predicated loads zero-fill them. Prints, per backend, whether the output
has NaN when the rows past cu_seqlens_k[-1] hold NaN, and its largest change against zeros there.

usage: PYTHONPATH=<a built flashcore package> python3 dev/varlen_nan_tail_probe.py
H100, session 27: cuda_sm90 True (the bug), cuda_sm80 False."""
import torch

import flashcore

torch.manual_seed(0)
for backend in ("cuda_sm90", "cuda_sm80"):
    flashcore.set_default_backend(backend)
    cu = torch.tensor([0, 100, 137], dtype=torch.int32, device="cuda")
    q = torch.randn(137, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(137 + 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    clean = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100)
    k[137:] = float("nan")
    v[137:] = float("nan")
    dirty = flashcore.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100)
    change = (dirty.float() - clean.float()).abs().nan_to_num(float("inf")).max().item()
    print(f"{backend}: NaN in out with NaN rows past the last sequence: {bool(dirty.isnan().any())}, "
          f"largest change {change}")
flashcore.set_default_backend("auto")
