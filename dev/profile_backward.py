"""Runs a few training steps (forward + backward, or forward only with a fifth argument `fwd`) of
one attention configuration so that dev/profile_backward.sh / dev/profile_forward_sm90.sh can
profile one kernel launch with Nsight Compute.
usage: python3 dev/profile_backward.py IMPL HEAD_DIM SEQLEN CAUSAL [fwd]
       (batch = 16384 / seqlen, heads = 2048 / head_dim; IMPL flashcore, flashcore_sm80,
       sdpa_flash or sdpa_cudnn)"""
import sys

import torch
import torch.nn.functional as F

impl, d, s, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
forward_only = len(sys.argv) > 5 and sys.argv[5] == "fwd"
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
if impl.startswith("flashcore"):
    import flashcore
    flashcore.set_default_backend("cuda_sm80" if impl == "flashcore_sm80" else "auto")
    step = lambda: flashcore.flash_attn_func(q, k, v, causal=causal)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    q, k, v = qt, kt, vt
    dout = dout.transpose(1, 2)

    def step():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
for _ in range(4):
    if forward_only:
        with torch.no_grad():
            step()
    else:
        step().backward(dout)
torch.cuda.synchronize()
