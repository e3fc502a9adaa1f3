"""ALiBi (alibi_slopes) on the GPU against FlashAttention-2's ALiBi forward in the same process.

On Hopper flashcore runs ALiBi in cuda_sm90's kernels (the forward's score-transform kernels, the
backward's ALiBi instantiations); `--sm80` forces the portable kernels for both directions. The
peer: PyTorch's FlashAttention-2 kernel called with its
alibi_slopes argument (aten._flash_attention_forward; its backward entry takes no slopes, so the
peer has no fwd+bwd). torch 2.11's build refuses it ("This flash attention build does not support
alibi", docs/PERF.md session 31), and no other ALiBi kernel is installed there, so on that machine
the line to read is flashcore without ALiBi: what the bias costs. Training-grid shapes (16k tokens, heads 2048 / d, bf16, slopes of ALiBi's
geometric sequence 2^(-8 (h + 1) / H)). Per cell: flashcore with ALiBi (fwd, fwd+bwd), FA2 with
ALiBi (fwd), flashcore without ALiBi (fwd, fwd+bwd: what the bias costs), and how far the two
ALiBi outputs are apart (max |difference|: the same bias by both; FA2's causal kernel adds
slope * j where the documented bias is -slope * |i + sk - sq - j|, a constant per row, which
changes its lse but not its output).

usage: PYTHONPATH=<a built flashcore package> python3 dev/alibi_peers.py [--no-backward] [--sm80]"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import torch

import flashcore
from timing import events_rate, training_rates

BACKWARD = "--no-backward" not in sys.argv
SM80 = "--sm80" in sys.argv


def rates(fwd, flop):
    return training_rates(fwd, flop, BACKWARD)


def show(name, r):
    f, fb = r
    print(f"  {name:<28} fwd {f:6.1f}" + (f"  fwd+bwd {fb:6.1f}" if fb is not None else ""), flush=True)


def cell(d, seqlen, causal):
    h = 2048 // d
    b = 16384 // seqlen
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda", dtype=torch.float32)
    flop = 4.0 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    print(f"== d{d} S={seqlen} {'causal' if causal else 'full'} (B={b}, H={h})", flush=True)
    show("flashcore ALiBi", rates(lambda: flashcore.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes), flop))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    try:
        def fa2():
            return torch.ops.aten._flash_attention_forward(qd, kd, vd, None, None, seqlen, seqlen, 0.0, causal, False,
                                                           alibi_slopes=slopes)[0]
        with torch.no_grad():
            diff = (fa2().float() - flashcore.flash_attn_func(qd, kd, vd, causal=causal, alibi_slopes=slopes).float())
            print(f"  max |flashcore - FA2| (ALiBi out): {diff.abs().max().item():.2e}", flush=True)
            show("FA2 ALiBi (aten)", (events_rate(fa2, flop), None))
    except Exception as e:  # a torch without the argument
        print(f"  FA2 ALiBi: n/a ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    show("flashcore without ALiBi", rates(lambda: flashcore.flash_attn_func(q, k, v, causal=causal), flop))


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}" + (", flashcore on cuda_sm80" if SM80 else ""))
    if SM80:
        flashcore.set_default_backend("cuda_sm80")
    for d in (64, 128):
        for seqlen in (512, 2048, 8192):
            for causal in (False, True):
                cell(d, seqlen, causal)


if __name__ == "__main__":
    main()
